#!/usr/bin/env bash
# GPU checks for pyrdma.cuda, on a machine with an NVIDIA GPU and CuPy (CI has none):
#   1. build the extension in place (needs rdma-core's headers and libibverbs, not an RDMA device);
#   2. the GPU tests, which fail rather than skip here (PYRDMA_REQUIRE_GPU=1) -> build/gpu/gpu.xml;
#   3. bench/gpu_reduce_bench.py (reduction vs device copy, host staging vs cudaMemcpy) -> build/gpu/.
# Environment: PYTHON (default python3), GPU_BENCH_ARGS (extra arguments for the benchmark).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
OUTDIR=build/gpu
mkdir -p "$OUTDIR"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

nvidia-smi -L || { echo "gpu.sh: no NVIDIA GPU here"; exit 1; }
"$PYTHON" -c 'import cupy; print("CuPy", cupy.__version__, "CUDA runtime", cupy.cuda.runtime.runtimeGetVersion())' \
  || { echo "gpu.sh: CuPy does not import"; exit 1; }
"$PYTHON" setup.py -q build_ext --inplace -j "$(nproc)" > "$OUTDIR/build-ext.log" 2>&1 \
  || { cat "$OUTDIR/build-ext.log"; echo "gpu.sh: build failed"; exit 1; }

PYRDMA_REQUIRE_GPU=1 "$PYTHON" -m pytest -m gpu -p no:cacheprovider -q -rsx --durations=5 \
  --junitxml="$OUTDIR/gpu.xml" tests
tests=$?
# shellcheck disable=SC2086
"$PYTHON" bench/gpu_reduce_bench.py --json "$OUTDIR/gpu_reduce.json" ${GPU_BENCH_ARGS:-}
bench=$?
echo "gpu.sh: tests rc=$tests bench rc=$bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
