"""The MPI anchor for allreduce_bench.py: MPI_Allreduce (float32 sum) timed like pyrdma's sweep.

Runs under mpirun with Debian's python3 and python3-mpi4py (no numpy: array.array is the buffer):

    mpirun -np 2 --mca pml ucx -x UCX_TLS=rc_verbs,ud_verbs,self -x UCX_NET_DEVICES=rxe0:1 \\
        -x UCX_UD_VERBS_ETH_DGID_CHECK=n /usr/bin/python3 pyrdma/perf/mpi_allreduce.py --sizes 4096,32768 --iters 5

Rank 0 prints one JSON object: {"rows": [[bytes, seconds], ...]}, where seconds is the median
over iterations of the slowest rank's time, each iteration after a barrier. The loop is
allreduce_bench.py's: the ranks keep their times and the slowest is found after the loop (a
reduction of each time inside the loop, as this script once did, is one more collective per
iteration, and it made the timed one 20-30% slower at 8 B with 4 ranks on Soft-RoCE).
"""
import argparse
import array
import json
import time

from mpi4py import MPI


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", required=True, help="comma-separated byte counts")
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rows = []
    for nbytes in (int(s) for s in args.sizes.split(",")):
        n = nbytes // 4
        x = array.array("f", [1.0]) * n
        y = array.array("f", [0.0]) * n
        comm.Allreduce([x, MPI.FLOAT], [y, MPI.FLOAT], op=MPI.SUM)   # warm-up: connections, registration
        if n and y[0] != comm.Get_size():
            raise SystemExit(f"MPI_Allreduce gave {y[0]}, expected {comm.Get_size()}")
        times = []
        for _ in range(args.iters):
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Allreduce([x, MPI.FLOAT], [y, MPI.FLOAT], op=MPI.SUM)
            times.append(time.perf_counter() - t0)
        slowest = sorted(max(column) for column in zip(*comm.allgather(times)))
        rows.append([nbytes, slowest[len(slowest) // 2]])
    if comm.Get_rank() == 0:
        print(json.dumps({"rows": rows, "library": MPI.Get_library_version().splitlines()[0]}), flush=True)


if __name__ == "__main__":
    main()
