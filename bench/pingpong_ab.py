#!/usr/bin/env python3
"""Send/recv ping-pong latency of pyrdma builds side by side in one boot, with perftest's floors.

    python3 -m pyrdma.testing.vm -- "$(python3 -c 'import sys;print(sys.executable)')" \\
        bench/pingpong_ab.py --trees /path/to/A,/path/to/B --rounds 3

Per round: ib_write_lat, ib_send_lat (and ib_write_lat -I 0, no inline) typical latency at
``--bytes``, then for each tree (a built checkout, alternating the order round by round so a
boot's drift falls on every tree alike) two ranks spawned with that tree first on PYTHONPATH,
each bound to a core of its own where two fit, running pyrdma.perf.collectives.pingpong over
rdma (half the round trip, median over ``--iters``). With PINGPONG_PERF=FILE, rank 0 runs ``perf record -a -g`` for 3 s (after 2 s to start it) of the timed loop (give it
--iters to last that long) into FILE. Rank 0 also reports its engine's CQ polls and
channel sleeps and its context switches (voluntary, involuntary) per round trip. The ratio to
ib_write_lat is taken within the round, as collectives_bench.py does.
"""
import argparse
import json
import os
import subprocess
import sys

RANK_CODE = r"""
import json, os, resource, sys, time
import numpy as np
from pyrdma.collectives import Communicator
from pyrdma.perf.collectives import pingpong
rank, master, nbytes, iters = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cpus = sorted(os.sched_getaffinity(0))
if len(cpus) >= 2:
    os.sched_setaffinity(0, {cpus[rank]})
with Communicator(rank, 2, master, transport="rdma", timeout=120) as comm:
    engine = comm.transport.engine
    comm.barrier()
    pingpong(comm, nbytes, 50, comm.send, comm.recv)
    comm.barrier()
    profile = os.environ.get("PINGPONG_PERF")         # perf record -a of the timed loop, from rank 0
    if profile and rank == 0:
        import subprocess
        rec = subprocess.Popen(["perf", "record", "-a", "-g", "-F", "2000", "-o", profile, "--", "sleep", "3"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(2.0)
    comm.barrier()
    ru0, polls0, sleeps0 = resource.getrusage(resource.RUSAGE_SELF), engine.polls, engine.sleeps
    times = pingpong(comm, nbytes, iters, comm.send, comm.recv)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    n = iters + 10
    out = dict(polls=(engine.polls - polls0) / n, sleeps=(engine.sleeps - sleeps0) / n,
               nvcsw=(ru1.ru_nvcsw - ru0.ru_nvcsw) / n, nivcsw=(ru1.ru_nivcsw - ru0.ru_nivcsw) / n)
    if rank == 0:
        out.update(median_us=float(np.median(times)) * 1e6, p10_us=float(np.percentile(times, 10)) * 1e6)
    if profile and rank == 0:
        rec.wait(30)
    comm.barrier()
print("RESULT " + json.dumps(out), flush=True)
"""


def ours(tree, nbytes, iters):
    from pyrdma.testing import free_port
    env = dict(os.environ, PYTHONPATH=tree)
    master = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", RANK_CODE, str(r), master, str(nbytes), str(iters)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tree)
             for r in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
    res = []
    for o in outs:
        line = [ln for ln in o.splitlines() if ln.startswith("RESULT ")]
        if not line:
            raise RuntimeError(f"{tree}: a rank gave no result:\n{o[-2000:]}")
        res.append(json.loads(line[0][7:]))
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", required=True, help="comma-separated built checkouts")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--bytes", type=int, default=8)
    p.add_argument("--dev", default="rxe0")
    p.add_argument("--gid", type=int, default=1)
    p.add_argument("--no-perftest", action="store_true")
    p.add_argument("--out", default=None, help="also write the rounds as JSON here")
    args = p.parse_args(argv)
    from pyrdma.perf.collectives_bench import perftest
    trees = args.trees.split(",")
    rounds = []
    for k in range(args.rounds):
        os.system("uptime")
        rd = {}
        if not args.no_perftest:
            for tool, extra in (("ib_write_lat", []), ("ib_send_lat", []), ("ib_write_lat -I 0", ["-I", "0"])):
                r = perftest_extra(perftest, tool.split()[0], extra, args)
                rd[tool] = r.t_typical if r else None
                print(f"round {k + 1} {tool}: {rd[tool]} us", flush=True)
        for tree in (trees if k % 2 == 0 else trees[::-1]):
            r0, r1 = ours(tree, args.bytes, args.iters)
            rd[tree] = dict(rank0=r0, rank1=r1)
            base = rd.get("ib_write_lat")
            print(f"round {k + 1} {tree}: ping-pong {r0['median_us']:.2f} us (p10 {r0['p10_us']:.2f})"
                  + (f" = {r0['median_us'] / base:.2f}x ib_write_lat" if base else "")
                  + f"; per round trip rank0 polls {r0['polls']:.1f} sleeps {r0['sleeps']:.2f} "
                    f"csw {r0['nvcsw']:.2f}/{r0['nivcsw']:.2f}, rank1 polls {r1['polls']:.1f} "
                    f"sleeps {r1['sleeps']:.2f} csw {r1['nvcsw']:.2f}/{r1['nivcsw']:.2f}", flush=True)
        rounds.append(rd)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rounds, fh, indent=1)
    return 0


def perftest_extra(perftest, tool, extra, args):
    """collectives_bench.perftest with extra flags (it builds the command from the tool's name)."""
    if not extra:
        return perftest(tool, args.dev, args.gid, args.bytes, 1000)
    import pyrdma.perf.collectives_bench as cb
    real = cb._perftest_once

    def once(server_cmd, client_cmd, port):
        return real(server_cmd + extra, client_cmd[:-1] + extra + client_cmd[-1:], port)
    cb._perftest_once = once
    try:
        return perftest(tool, args.dev, args.gid, args.bytes, 1000)
    finally:
        cb._perftest_once = real


if __name__ == "__main__":
    sys.exit(main())
