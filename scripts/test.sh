#!/usr/bin/env bash
# The test command: set up, build, run host tests, then device tests on a real RDMA device
# (rxe0 in the Soft-RoCE VM when the host has none). Fails if any test fails, if the VM did not
# come up, or if any device test was skipped. JUnit XML goes to build/test-reports/.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
bash scripts/setup.sh || { echo "test.sh: setup failed"; exit 1; }
PYTHON=$("$PYTHON" -c 'import sys; print(sys.executable)')
REPORTS=build/test-reports
rm -rf "$REPORTS"; mkdir -p "$REPORTS"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1

echo "== host tests"
timeout 1800 "$PYTHON" -m pytest -m "not device" -p no:cacheprovider -q --junitxml="$REPORTS/host.xml" tests
host=$?

echo "== device tests (real RDMA device; Soft-RoCE VM when the host has none)"
export PYRDMA_REQUIRE_DEVICE=1
timeout 3600 "$PYTHON" -m pyrdma.testing.vm --rwdir "$REPORTS" --timeout 3300 -- \
  "$PYTHON" -m pytest -m device -p no:cacheprovider -q -rs --junitxml="$REPORTS/device.xml" tests
device=$?

"$PYTHON" -m pyrdma.testing.junit "$REPORTS/host.xml" "$REPORTS/device.xml"
verdict=$?
echo "test.sh: host pytest exit $host, device run exit $device, report check exit $verdict"
[ $host -eq 0 ] && [ $device -eq 0 ] && [ $verdict -eq 0 ]
