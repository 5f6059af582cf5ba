#!/usr/bin/env bash
# Build pyrdma's binary wheel into build/wheel/ (README "Install"; tests/test_wheel.py installs it in the VM).
# scripts/setup.sh calls it after the in-place build, whose compiled modules `pip wheel` reuses (seconds).
# The modules link only libc (libibverbs.so.1 and librdmacm.so.1 are opened at run time), so auditwheel
# gives the wheel the manylinux tag of the newest glibc symbol version they use: manylinux_2_34 when
# built on glibc 2.34 or newer (dlopen, dlvsym and pthread_once moved into libc in 2.34), as here.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}

rm -rf build/wheel build/wheel-linux
"$PYTHON" -m pip wheel . --no-build-isolation --no-deps -q -w build/wheel-linux
# repair: checks that the modules need no library outside the manylinux set, and retags the wheel
"$PYTHON" -m auditwheel repair -w build/wheel build/wheel-linux/pyrdma-*.whl 2>&1 | grep -v '^INFO:'
ls build/wheel/pyrdma-*manylinux*.whl
