#!/usr/bin/env bash
# The main job: perftest and pyrdma side by side on one RDMA device (the host's, or rxe0 in the
# Soft-RoCE VM when the host has none), in one boot, in 3 rounds: the table gives each ratio's median
# over the rounds and its range, then per-op latency and where a Python iteration's time goes.
# Table on stdout; JSON and PNG in build/bench/.
# Extra arguments go to bench/side_by_side.py (e.g. --rounds 5, --tests write_bw,write_lat --iters-lat 2000).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
bash scripts/setup.sh || { echo "bench.sh: setup failed"; exit 1; }
PYTHON=$("$PYTHON" -c 'import sys; print(sys.executable)')
OUT=build/bench
# 3 rounds of every test: the VM limit (a guard against a hang) is over twice the one-pass 3300 s; not yet timed
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MPLBACKEND=Agg
exec "$PYTHON" -m pyrdma.testing.vm --rwdir "$OUT" --timeout 7200 -- \
  "$PYTHON" bench/side_by_side.py --out "$OUT" "$@"
