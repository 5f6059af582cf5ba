#!/usr/bin/env bash
# GPU checks for pyrdma.cuda, on a machine with an NVIDIA GPU and CuPy (CI has none):
#   1. build the extension in place (needs rdma-core's headers and libibverbs, not an RDMA device);
#   2. the GPU tests, which fail rather than skip here (PYRDMA_REQUIRE_GPU=1) -> build/gpu/gpu.xml,
#      and the kernels' tests again under compute-sanitizer's memcheck -> build/gpu/memcheck.log;
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
# The CUDA kernels under compute-sanitizer's memcheck, each array in its own allocation (no CuPy pool),
# so a read or write past a buffer, or a misaligned vector load, is an error.
memcheck=0
if command -v compute-sanitizer > /dev/null; then
  PYRDMA_REQUIRE_GPU=1 PYRDMA_CUDA_NO_POOL=1 compute-sanitizer --tool memcheck --error-exitcode 3 \
    "$PYTHON" -m pytest -m gpu -p no:cacheprovider -q tests/test_cuda.py -k "reduce_into or finalize_avg or staging" \
    > "$OUTDIR/memcheck.log" 2>&1
  memcheck=$?
  grep -E "ERROR SUMMARY|passed|failed" "$OUTDIR/memcheck.log"
else
  echo "gpu.sh: no compute-sanitizer here: the memcheck run is left out"
fi
# shellcheck disable=SC2086
"$PYTHON" bench/gpu_reduce_bench.py --json "$OUTDIR/gpu_reduce.json" ${GPU_BENCH_ARGS:-}
bench=$?
echo "gpu.sh: tests rc=$tests memcheck rc=$memcheck bench rc=$bench"
[ "$tests" -eq 0 ] && [ "$memcheck" -eq 0 ] && [ "$bench" -eq 0 ]
