"""A/B of the collective engine's spin (``Communicator(spin=...)``: seconds a wait polls, yielding,
before it sleeps on the completion channel; a value ending in ``:yield`` also yields the CPU
between polls where the ranks fit the machine's CPUs, which the engine then does not:
Engine.spin_yields), alternated call by call in the same processes, so a
boot's drift falls on every variant alike. Per variant: the median over iterations of the slowest
rank's time (barrier, then the timed allreduce, as allreduce_bench.py), and the busiest rank's
context switches per iteration, voluntary (it slept) and involuntary (preempted, or a yield that
handed the CPU over), from getrusage. Ranks are bound one per core where they fit (cores_for).

    python3 -m pyrdma.testing.vm -- "$(python3 -c 'import sys;print(sys.executable)')" \\
        bench/spin_ab.py --ranks 4 --bytes 8 --algorithm rd --iters 400 --spins 200e-6,1e-3
        bench/spin_ab.py --ranks 2 --bytes 8388608 --algorithm ring --iters 12 --spins 200e-6,200e-6:yield
"""
import argparse
import multiprocessing as mp
import os
import resource
import time

import numpy as np

from pyrdma.perf.allreduce_bench import cores_for
from pyrdma.testing import free_port


def _rank(rank, size, ports, nbytes, algorithm, iters, spins, results):
    from pyrdma.collectives import Communicator
    cores = cores_for(size)
    if cores:
        os.sched_setaffinity(0, {cores[rank]})
    comms = [Communicator(rank, size, f"127.0.0.1:{port}", transport="rdma", timeout=300, spin=spin)
             for port, (spin, _) in zip(ports, spins)]
    for comm, (_, yields) in zip(comms, spins):
        comm.transport.engine.spin_yields = comm.transport.engine.spin_yields or yields
    try:
        x = np.ones(max(nbytes // 4, 1), np.float32)
        for comm in comms:
            comm.allreduce(x, algorithm=algorithm)          # warm-up: registration, connections
        times = [[] for _ in comms]
        switches = [[0, 0] for _ in comms]
        for it in range(iters):
            for i in (range(len(comms)) if it % 2 == 0 else reversed(range(len(comms)))):
                before = resource.getrusage(resource.RUSAGE_SELF)
                comms[i].barrier()
                t0 = time.perf_counter()
                comms[i].allreduce(x, algorithm=algorithm)
                times[i].append(time.perf_counter() - t0)
                after = resource.getrusage(resource.RUSAGE_SELF)
                switches[i][0] += after.ru_nvcsw - before.ru_nvcsw
                switches[i][1] += after.ru_nivcsw - before.ru_nivcsw
        for comm in comms:                                  # checked after the loop, as allreduce_bench does
            x[:] = 1
            comm.allreduce(x, algorithm=algorithm)
            if x[0] != size:
                raise SystemExit(f"rank {rank}: allreduce gave {x[0]}, expected {size}")
        results.put((rank, times, switches, [comm.transport.engine.keeps for comm in comms]))
    finally:
        for comm in comms:
            comm.close()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--bytes", type=int, default=8)
    p.add_argument("--algorithm", default="rd")
    p.add_argument("--iters", type=int, default=400)
    p.add_argument("--spins", default="200e-6,1e-3", help="comma-separated spin values in seconds")
    args = p.parse_args(argv)
    spins = [(float(v.split(":")[0]), v.endswith(":yield")) for v in args.spins.split(",")]
    ports = [free_port() for _ in spins]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, ports, args.bytes, args.algorithm, args.iters, spins,
                                             results)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    try:
        got = {rank: (times, switches, keeps) for rank, times, switches, keeps in
               (results.get(timeout=1800) for _ in procs)}
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    print(f"{args.ranks} ranks, {args.bytes} B, {args.algorithm}, {args.iters} iterations per variant")
    print(f"{'spin (us)':>22} {'time (us)':>10} {'vol. switches':>14} {'invol. switches':>16} {'kept':>6}")
    for i, (spin, yields) in enumerate(spins):
        slowest = [max(got[r][0][i][k] for r in got) for k in range(args.iters)]
        vol, invol = max((got[r][1][i] for r in got), key=sum)
        name = f"{spin * 1e6:.0f}" + (" yield" if yields else "")
        kept = max(got[r][2][i] for r in got)
        print(f"{name:>22} {np.median(slowest) * 1e6:>10.1f} {vol / args.iters:>14.2f} {invol / args.iters:>16.2f} {kept:>6}")


if __name__ == "__main__":
    main()
