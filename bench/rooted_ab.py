#!/usr/bin/env python3
"""Where a small gather's or scatter's time goes when ranks outnumber cores: pyrdma and
OpenMPI+UCX (MPI_Gather, MPI_Scatter) in one boot, root 0, measured two ways.

    python3 -m pyrdma.testing.vm -- "$(python3 -c 'import sys;print(sys.executable)')" \\
        bench/rooted_ab.py --ranks 4 --pieces 8,4096 --iters 100

- The bench loop (collectives_bench.py's: per iteration a barrier, then the timed call): the
  slowest rank's time (what that bench reports), each rank's own time, and when each rank left
  the barrier after the root (every rank stamps CLOCK_MONOTONIC, one clock on one machine).
  A rank that leaves the barrier early waits for the late ones inside its timed call: which rank
  the barrier lets go last moves time between the root and the others.
- Root only: the root enters the call --delay seconds after the others, who are waiting in it;
  its time is then its own work (a scatter's n-1 sends, a gather's n-1 receives, pyrdma's check
  that the root agrees), without a late rank's wait.

Medians over --iters. The MPI side is this file under mpirun (Debian's python3 with mpi4py; it
imports only the standard library and mpi4py), on the RDMA device as collectives_bench.py runs it.
"""
import argparse
import json
import os
import statistics
import sys
import time


def measure(call, barrier, is_root, iters, delay):
    """This rank's stamps: ``loop`` [(left the barrier, call returned)], ``root_only`` [seconds]
    (the root's; empty elsewhere)."""
    loop, root_only = [], []
    for _ in range(iters):
        barrier()
        t0 = time.monotonic()
        call()
        loop.append((t0, time.monotonic()))
    for _ in range(iters):
        barrier()
        if is_root:
            time.sleep(delay)
            t0 = time.monotonic()
            call()
            root_only.append(time.monotonic() - t0)
        else:
            call()
    barrier()
    return dict(loop=loop, root_only=root_only)


def _blocks(name, piece, rank, n):
    """(send, receive, the bytes receive must get) of ``name`` with root 0 (None where a rank has none)."""
    every = b"".join(bytes([i + 1]) * piece for i in range(n))
    if name == "gather":
        return bytes([rank + 1]) * piece, bytearray(n * piece) if rank == 0 else None, every if rank == 0 else None
    return every if rank == 0 else None, bytearray(piece), bytes([rank + 1]) * piece


def _check(recv, want, name, piece, rank):
    if want is not None and recv != want:
        raise SystemExit(f"rank {rank}: {name} of {piece} B per rank gave wrong data")


def _pyrdma_rank(rank, size, master, args):
    import numpy as np
    from pyrdma.collectives import Communicator
    out = {}
    with Communicator(rank, size, master, transport=args.transport, timeout=300) as comm:
        for name in args.collectives:
            for piece in args.pieces:
                send, recv, want = _blocks(name, piece, rank, size)
                x = None if send is None else np.frombuffer(send, np.uint8)
                y = None if recv is None else np.frombuffer(recv, np.uint8)
                if name == "gather":
                    def call(): comm.gather(x, out=y, root=0)              # noqa: E704
                else:
                    def call(): comm.scatter(x, out=y, root=0)             # noqa: E704
                call()
                _check(recv, want, name, piece, rank)
                out[f"{name} {piece}"] = measure(call, comm.barrier, rank == 0, args.iters, args.delay)
    return out


def _mpi_main(args):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    out = {}
    for name in args.collectives:
        for piece in args.pieces:
            send, recv, want = _blocks(name, piece, rank, n)
            sb = None if send is None else [bytearray(send), MPI.BYTE]
            rb = None if recv is None else [recv, MPI.BYTE]
            if name == "gather":
                def call(): comm.Gather(sb, rb, root=0)                     # noqa: E704
            else:
                def call(): comm.Scatter(sb, rb, root=0)                    # noqa: E704
            call()
            _check(recv, want, name, piece, rank)
            out[f"{name} {piece}"] = measure(call, comm.Barrier, rank == 0, args.iters, args.delay)
    every = comm.gather(out, root=0)
    if rank == 0:
        print(json.dumps(dict(ranks=every)))


def summarize(per_rank):
    """{case: dict(slowest, ranks, left_after_root, root_only)} in microseconds (medians)."""
    us = lambda values: round(statistics.median(values) * 1e6)      # noqa: E731
    n, out = len(per_rank), {}
    for case in per_rank[0]:
        loops = [per_rank[r][case]["loop"] for r in range(n)]
        iters = range(len(loops[0]))
        out[case] = dict(
            slowest=us([max(t1 - t0 for t0, t1 in (loops[r][i] for r in range(n))) for i in iters]),
            ranks=[us([t1 - t0 for t0, t1 in loops[r]]) for r in range(n)],
            left_after_root=[us([loops[r][i][0] - loops[0][i][0] for i in iters]) for r in range(n)],
            root_only=us(per_rank[0][case]["root_only"]))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--pieces", default="8,4096", help="comma-separated bytes per rank")
    p.add_argument("--collectives", default="gather,scatter")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--delay", type=float, default=0.003, help="seconds the root enters after the others (root only)")
    p.add_argument("--dev", default="rxe0")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--transport", choices=("rdma", "tcp"), default="rdma", help="pyrdma's transport")
    p.add_argument("--no-mpi", action="store_true", help="skip the OpenMPI+UCX side")
    p.add_argument("--out", default=None, help="write the summary as JSON here")
    p.add_argument("--mpi-rank", action="store_true", help=argparse.SUPPRESS)     # this file under mpirun
    args = p.parse_args(argv)
    args.pieces = [int(s) for s in args.pieces.split(",")]
    args.collectives = [c for c in args.collectives.split(",") if c]
    if args.mpi_rank:
        return _mpi_main(args)
    if args.ranks < 2 or args.iters < 1 or min(args.pieces) < 1 or not set(args.collectives) <= {"gather", "scatter"}:
        p.error("need --ranks >= 2, --iters >= 1, pieces >= 1 byte, collectives among gather, scatter")
    from pyrdma.perf.allreduce_bench import spawn_ranks
    sides = {"pyrdma": summarize(spawn_ranks(_pyrdma_rank, args.ranks, (args,), timeout=args.timeout))}
    if not args.no_mpi:
        from pyrdma.perf.allreduce_bench import run_mpi_script
        script_args = ["--mpi-rank", "--collectives", ",".join(args.collectives),
                       "--pieces", ",".join(map(str, args.pieces)), "--iters", str(args.iters), "--delay", str(args.delay)]
        mpi, label = run_mpi_script(args.ranks, os.path.abspath(__file__), script_args, args.dev, timeout=args.timeout)
        if mpi is None:
            raise SystemExit(f"MPI gave no result: {label}")
        sides[label] = summarize(mpi["ranks"])
    print(f"{args.ranks} ranks, {os.cpu_count()} CPUs, medians of {args.iters} iterations, microseconds")
    print(f"{'case':14s} {'side':32s} {'slowest':>8s} {'root only':>9s}  per rank / left the barrier after the root")
    for case in sides["pyrdma"]:
        for side, rows in sides.items():
            row = rows[case]
            print(f"{case:14s} {side:32s} {row['slowest']:8d} {row['root_only']:9d}  {row['ranks']} / "
                  f"{row['left_after_root']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(ranks=args.ranks, iters=args.iters, sides=sides), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
