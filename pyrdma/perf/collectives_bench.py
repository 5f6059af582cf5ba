"""All-to-all, gather, scatter and send/recv: pyrdma against OpenMPI+UCX and perftest, one run (one
VM boot), in the way of allreduce_bench.py (bench/collectives_bench.py runs this main()):

    python3 -m pyrdma.testing.vm --rwdir build/bench -- env PYTHONPATH=$PWD \\
        "$(python3 -c 'import sys;print(sys.executable)')" bench/collectives_bench.py --rounds 3 --out build/bench

Per collective (alltoall; alltoallv, the same blocks given as counts; gather and scatter, root 0),
ranks (2 and 4) and size (bytes per peer, 8 B .. 1 MiB): pyrdma's time
(pyrdma.perf.collectives.bench_rank: ranks spawned locally over rdma) and MPI's (mpi_collectives.py under mpirun, OpenMPI's UCX pml on the same device, as
allreduce_bench runs it), each the median over iterations of the slowest rank's time, every
iteration after a barrier, both bound to a core per rank where the ranks fit (else neither).
Send/recv, 2 ranks: a ping-pong of 8 B (half the round trip, median) against ib_write_lat's
t_typical, and a stream of 8 MiB messages (rank 0's bytes per second up to rank 1's
acknowledgement of the last) against ib_write_bw's BW average, both perftest runs in the same
boot; MPI's ping-pong and stream are shown beside them. A round measures all of it once; the VM
drifts within a boot, so each ratio is taken within its round, then the median over rounds (and
the range) is shown. The last target counts the Python frames of a warm blocking all-to-all over
RDMA at the smallest and the largest size (sys.setprofile, as the allreduce test does): at most
the method's own, none since the method is a C function.
Writes collectives.json (rows, anchors, ``targets`` with verdicts).
"""
import argparse
import json
import os
import subprocess
import time

import numpy as np

from pyrdma.perf.allreduce_bench import run_mpi_script, spawn_ranks
from pyrdma.perf.collectives import bench_rank
from pyrdma.perf.parse import parse_output
from pyrdma.testing import again_if_perftest_clock_failed, counting_rc_resends, free_port, tcp_listening

MPI_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_collectives.py")
COLLECTIVES = ("alltoall", "alltoallv", "gather", "scatter")
PIECES = (8, 64, 512, 4096, 32768, 262144, 1048576)
A2A_BW_BYTES = 262144          # the all-to-all whose bandwidth is held against ib_write_bw


def ours(size, plan):
    """bench_rank in ``size`` spawned ranks: {(name, piece): seconds} (per iteration the slowest
    rank, median over iterations), and rank 0's extras (pingpong, stream, python_calls, wrong)."""
    got = spawn_ranks(bench_rank, size, (plan,))
    times = {}
    for i, (name, piece, _) in enumerate(got[0]["rows"]):
        slowest = [max(got[r]["rows"][i][2][k] for r in range(size)) for k in range(plan["iters"])]
        times[(name, piece)] = float(np.median(slowest))
    wrong = sorted({tuple(w) for r in range(size) for w in got[r]["wrong"]})
    # the breakdown: per iteration the slowest rank's call, and the part of it outside the engine
    outside = {}
    for i, (name, piece, _) in enumerate(got[0]["breakdown"]):
        per_iter = [max((got[r]["breakdown"][i][2][k] for r in range(size)), key=lambda p: p[0])
                    for k in range(plan["iters"])]
        one_call = any(e is None for _, e in per_iter)      # (then the whole call is one C call)
        outside[(name, piece)] = (float(np.median([c for c, _ in per_iter])),
                                  None if one_call else float(np.median([c - e for c, e in per_iter])))
    return times, dict(got[0], wrong=wrong, outside=outside)


def mpi(size, plan, dev, timeout=900):
    """mpi_collectives.py under mpirun: (its JSON object, label), or (None, why not)."""
    script_args = ["--collectives", ",".join(plan["collectives"]), "--pieces", ",".join(map(str, plan["pieces"])),
                   "--iters", str(plan["iters"])]
    if plan.get("pingpong"):
        script_args += ["--pingpong", ",".join(map(str, plan["pingpong"]))]
    if plan.get("stream"):
        script_args += ["--stream", ",".join(map(str, plan["stream"]))]
    return run_mpi_script(size, MPI_SCRIPT, script_args, dev, timeout=timeout)


def _perftest_once(server_cmd, client_cmd, port):
    server = subprocess.Popen(server_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not tcp_listening(port) and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        client = subprocess.run(client_cmd, capture_output=True, text=True, timeout=300)
        server_out = server.communicate(timeout=60)[0]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=10)
    assert client.returncode == 0, f"{client_cmd[0]} failed: {client.stdout}{client.stderr}{server_out}"
    return client.stdout


def perftest(tool, dev, gid, nbytes, iters):
    """perftest ``tool`` (ib_write_lat, ib_write_bw) at ``nbytes`` on this host: its parsed row (a
    LatReport or BWReport), or None when it failed (with the reason printed)."""
    port = free_port()
    base = [tool, "-d", dev, "-x", str(gid), "-s", str(nbytes), "-n", str(iters), "-F", "-p", str(port)]
    # server and client each on a CPU of its own: both spin-poll (as side_by_side.py runs them)
    cpus = sorted(os.sched_getaffinity(0))
    pin = (lambda c: ["taskset", "-c", str(cpus[c % len(cpus)])]) if len(cpus) >= 2 else (lambda c: [])
    try:
        out = again_if_perftest_clock_failed(_perftest_once, pin(0) + base, pin(1) + base + ["127.0.0.1"], port,
                                             free_port)
    except (AssertionError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"# {tool} failed: {str(exc)[:300]}", flush=True)
        return None
    rows = parse_output(out).by_size()
    return rows.get(nbytes)


def one_round(args, plans):
    rd = dict(ours={}, mpi={}, mpi_note={}, extras={}, resends={})
    for size, plan in plans.items():
        with counting_rc_resends(args.dev) as resends:
            times, extras = ours(size, plan)
        rd["ours"][size], rd["extras"][size], rd["resends"][size] = times, extras, dict(resends)
        got, note = (None, "skipped") if args.no_mpi else mpi(size, plan, args.dev)
        rd["mpi_note"][size] = note
        rd["mpi"][size] = got
    lat = perftest("ib_write_lat", args.dev, args.gid, args.pingpong_bytes, 1000)
    bw = perftest("ib_write_bw", args.dev, args.gid, args.stream_bytes, 200)
    rd["ib_write_lat_us"] = lat.t_typical if lat else None
    rd["ib_write_bw_gbps"] = bw.bw_avg * 2**20 / 1e9 if bw else None       # perftest MB/s (MiB) -> GB/s
    return rd


def _median(values):
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def _span(values):
    values = [v for v in values if v is not None]
    return [min(values), max(values)] if values else None


def summarize(rounds, plans):
    """Rows per (collective, ranks, bytes per peer): medians over rounds, the ratio ours/MPI taken
    within each round (time: lower is better, so <= 1.0 is the target)."""
    table = []
    for size, plan in plans.items():
        for name in plan["collectives"]:
            for piece in plan["pieces"]:
                mine = [rd["ours"][size][(name, piece)] for rd in rounds]
                theirs = []
                for rd in rounds:
                    m = rd["mpi"][size]
                    t = {(n, b): s for n, b, s in m["rows"]}.get((name, piece)) if m else None
                    theirs.append(t)
                ratios = [a / b if b else None for a, b in zip(mine, theirs)]
                t, m = _median(mine), _median(theirs)
                split = [rd["extras"][size]["outside"].get((name, piece)) for rd in rounds]
                split = [x for x in split if x]
                table.append(dict(collective=name, ranks=size, bytes_per_peer=piece, time_us=t * 1e6,
                                  mpi_time_us=m * 1e6 if m else None, vs_mpi=_median(ratios),
                                  vs_mpi_range=_span(ratios), rounds_us=[x * 1e6 for x in mine],
                                  outside_engine_us=_median([o for _, o in split if o is not None]) * 1e6
                                  if any(o is not None for _, o in split) else None,
                                  breakdown_call_us=_median([c for c, _ in split]) * 1e6 if split else None))
    return table


def p2p_summary(rounds):
    """Ping-pong and stream: ours, MPI's and perftest's per round, ratios within the round."""
    lat, bw, mpi_lat, mpi_bw, lat_ratio, bw_ratio = [], [], [], [], [], []
    for rd in rounds:
        ex = rd["extras"].get(2, {})
        m = rd["mpi"].get(2) or {}
        ours_lat = _median(ex.get("pingpong") or []) if ex.get("pingpong") else None
        ours_bw = _median(ex.get("stream") or []) if ex.get("stream") else None
        lat.append(ours_lat and ours_lat * 1e6)
        bw.append(ours_bw and ours_bw / 1e9)
        mpi_lat.append(_median(m.get("pingpong") or []) and _median(m["pingpong"]) * 1e6)
        mpi_bw.append(_median(m.get("stream") or []) and _median(m["stream"]) / 1e9)
        anchor_lat, anchor_bw = rd["ib_write_lat_us"], rd["ib_write_bw_gbps"]
        lat_ratio.append(lat[-1] / anchor_lat if lat[-1] and anchor_lat else None)
        bw_ratio.append(bw[-1] / anchor_bw if bw[-1] and anchor_bw else None)
    return dict(pingpong_us=_median(lat), mpi_pingpong_us=_median(mpi_lat),
                ib_write_lat_us=_median([rd["ib_write_lat_us"] for rd in rounds]),
                pingpong_vs_ib_write_lat=_median(lat_ratio), pingpong_vs_ib_write_lat_range=_span(lat_ratio),
                stream_gbps=_median(bw), mpi_stream_gbps=_median(mpi_bw),
                ib_write_bw_gbps=_median([rd["ib_write_bw_gbps"] for rd in rounds]),
                stream_vs_ib_write_bw=_median(bw_ratio), stream_vs_ib_write_bw_range=_span(bw_ratio))


def targets(table, p2p, rounds, args):
    """The issue's targets: [(target, verdict, detail)]."""
    out = []
    args_pieces = [int(b) for b in args.pieces.split(",")]
    for name in COLLECTIVES:
        rows = [r for r in table if r["collective"] == name]
        if not rows:
            continue
        measured = [r for r in rows if r["vs_mpi"] is not None]
        if not measured:
            out.append((f"{name} time <= 1.0x OpenMPI+UCX at every size", "n/a", "MPI did not run"))
            continue
        missed = [r for r in measured if r["vs_mpi"] > 1.0]
        detail = ", ".join(f"{r['ranks']} ranks {r['bytes_per_peer']} B {r['vs_mpi']:.2f}" for r in measured)
        verdict = "MET" if not missed and len(measured) == len(rows) else "MISSED"
        out.append((f"{name} time <= 1.0x OpenMPI+UCX at every size {min(args_pieces)}..{max(args_pieces)} B per "
                    f"peer, ranks {sorted({r['ranks'] for r in rows})}", verdict, detail))

    def ratio_target(name, key, limit, at_most):
        v = p2p[key]
        if v is None:
            out.append((name, "n/a", "not measured"))
            return
        rng = p2p[key + "_range"]
        ok = v <= limit if at_most else v >= limit
        out.append((name, "MET" if ok else "MISSED", f"{v:.3f} (rounds {rng[0]:.3f}-{rng[1]:.3f})"))
    # a 2-rank all-to-all's bandwidth at 256 KiB per peer against ib_write_bw's, within each round
    # (the bytes each rank sends over its time)
    row = next((r for r in table if r["collective"] == "alltoall" and r["ranks"] == 2
                and r["bytes_per_peer"] == A2A_BW_BYTES), None)
    if row is not None:
        name = f"alltoall {A2A_BW_BYTES} B per peer, 2 ranks: >= 0.9x ib_write_bw (bytes sent per rank / time)"
        ratios = [A2A_BW_BYTES / (t * 1e-6) / (rd["ib_write_bw_gbps"] * 1e9)
                  for t, rd in zip(row["rounds_us"], rounds) if t and rd["ib_write_bw_gbps"]]
        if ratios:
            v = _median(ratios)
            out.append((name, "MET" if v >= 0.9 else "MISSED", f"{v:.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f}; "
                        f"MPI's time at that size {_fmt(row['mpi_time_us'], '.0f')} us against our "
                        f"{row['time_us']:.0f} us)"))
        else:
            out.append((name, "n/a", "not measured"))
    ratio_target(f"send/recv ping-pong {args.pingpong_bytes} B <= 2.0x ib_write_lat t_typical",
                 "pingpong_vs_ib_write_lat", 2.0, True)
    ratio_target(f"send/recv stream of {args.stream_bytes} B messages >= 0.9x ib_write_bw", "stream_vs_ib_write_bw",
                 0.9, False)
    counted = [rd["extras"].get(2, {}).get("python_calls") for rd in rounds]
    counted = [c for c in counted if c]
    if counted:
        # every round's count must be at most one (the method's own frame; none where the method is
        # a C function); the detail shows the largest count per size
        calls = {int(k): max(c[k] for c in counted) for k in counted[0]}
        ok = all(v <= 1 for v in calls.values())
        out.append((f"a warm blocking all-to-all of host memory over {args.transport} is one Python-level call, "
                    "whatever its size", "MET" if ok else "MISSED",
                    ", ".join(f"{b} B per peer: {v} Python frames" for b, v in sorted(calls.items()))))
    return out


def _fmt(v, spec):
    return "" if v is None else format(v, spec)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join("build", "bench"))
    p.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    p.add_argument("--pieces", default=",".join(map(str, PIECES)), help="comma-separated bytes per peer")
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dev", default="rxe0")
    p.add_argument("--gid", type=int, default=1)
    p.add_argument("--pingpong-bytes", type=int, default=8)
    p.add_argument("--pingpong-iters", type=int, default=1000)
    p.add_argument("--stream-bytes", type=int, default=8 << 20)
    p.add_argument("--stream-messages", type=int, default=20)
    p.add_argument("--stream-repeats", type=int, default=3)
    p.add_argument("--no-mpi", action="store_true", help="skip the OpenMPI+UCX side")
    p.add_argument("--transport", choices=("rdma", "tcp"), default="rdma", help="pyrdma's transport")
    p.add_argument("--breakdown", action="store_true",
                   help="a second pass per size timing the engine's part of each call (transport.run): the "
                        "table adds the time outside it / the whole call (us), per iteration the slowest rank; "
                        "'C call' where the call is the one-call path's single C call (no Python part to split)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.ranks.split(",")]
    pieces = [int(s) for s in args.pieces.split(",")]
    collectives = [c for c in args.collectives.split(",") if c]
    if any(s < 2 for s in sizes) or any(b < 1 for b in pieces) or not set(collectives) <= set(COLLECTIVES):
        p.error(f"need ranks >= 2, sizes >= 1 byte, collectives among {', '.join(COLLECTIVES)}")
    if args.rounds < 1 or args.iters < 1:
        p.error("need --rounds >= 1 and --iters >= 1")
    plans = {}
    for size in sizes:
        plans[size] = dict(collectives=collectives, pieces=pieces, iters=args.iters, transport=args.transport,
                           breakdown=args.breakdown)
        if size == 2:
            plans[size].update(pingpong=(args.pingpong_bytes, args.pingpong_iters),
                               stream=(args.stream_bytes, args.stream_messages, args.stream_repeats),
                               count_calls=[min(pieces), max(pieces)])
    os.makedirs(args.out, exist_ok=True)
    rounds = []
    for k in range(args.rounds):
        rd = one_round(args, plans)
        rounds.append(rd)
        wrong = {s: rd["extras"][s]["wrong"] for s in sizes if rd["extras"][s]["wrong"]}
        print(f"# round {k + 1}/{args.rounds}: ib_write_lat {args.pingpong_bytes} B t_typical "
              f"{_fmt(rd['ib_write_lat_us'], '.2f')} us, ib_write_bw {args.stream_bytes} B "
              f"{_fmt(rd['ib_write_bw_gbps'], '.4f')} GB/s; MPI: "
              + "; ".join(f"{s} ranks: {rd['mpi_note'][s]}" for s in sizes)
              + "".join(f"; {s} ranks rc resends {v}" for s, v in rd["resends"].items() if any(v.values()))
              + (f"; WRONG DATA {wrong}" if wrong else ""), flush=True)
        write_json(args, sizes, pieces, plans, rounds)        # each round: a run cut short still leaves its data
    table, p2p, verdicts = write_json(args, sizes, pieces, plans, rounds)
    print(f"# bytes per peer; per round the median over {args.iters} iterations of the slowest rank, then the "
          f"median over {args.rounds} round(s); vs MPI = our time / MPI's (<= 1.0 is the target)")
    print(f"{'collective':>10} {'ranks':>5} {'bytes':>8} {'pyrdma(us)':>11} {'MPI(us)':>10} {'vs MPI':>7} "
          f"{'range':>13}" + (f" {'outside engine(us)':>19}" if args.breakdown else ""))
    for r in table:
        rng = r["vs_mpi_range"]
        print(f"{r['collective']:>10} {r['ranks']:>5} {r['bytes_per_peer']:>8} {r['time_us']:>11.1f} "
              f"{_fmt(r['mpi_time_us'], '.1f'):>10} {_fmt(r['vs_mpi'], '.2f'):>7} "
              f"{(f'{rng[0]:.2f}-{rng[1]:.2f}' if rng else ''):>13}"
              + (f" {_fmt(r['outside_engine_us'], '.1f') or 'C call'}/{_fmt(r['breakdown_call_us'], '.1f')}".rjust(20)
                 if args.breakdown else ""))
    print(f"# send/recv, 2 ranks: ping-pong {args.pingpong_bytes} B half round trip {_fmt(p2p['pingpong_us'], '.2f')} "
          f"us (MPI {_fmt(p2p['mpi_pingpong_us'], '.2f')} us, ib_write_lat t_typical "
          f"{_fmt(p2p['ib_write_lat_us'], '.2f')} us); "
          f"stream of {args.stream_bytes} B messages {_fmt(p2p['stream_gbps'], '.4f')} GB/s (MPI "
          f"{_fmt(p2p['mpi_stream_gbps'], '.4f')} GB/s, ib_write_bw {_fmt(p2p['ib_write_bw_gbps'], '.4f')} GB/s)")
    for name, verdict, detail in verdicts:
        print(f"# target {name}: {verdict} ({detail})")
    return 0


def write_json(args, sizes, pieces, plans, rounds):
    """collectives.json of the rounds so far; (table, send/recv summary, verdicts)."""
    table = summarize(rounds, plans)
    p2p = p2p_summary(rounds)
    verdicts = targets(table, p2p, rounds, args)
    doc = dict(ranks=sizes, device=args.dev, iters=args.iters, rounds_count=len(rounds), pieces=pieces,
               rounds=[dict(ib_write_lat_us=rd["ib_write_lat_us"], ib_write_bw_gbps=rd["ib_write_bw_gbps"],
                            mpi={str(s): n for s, n in rd["mpi_note"].items()},
                            rc_resends={str(s): v for s, v in rd["resends"].items()},
                            python_calls=rd["extras"].get(2, {}).get("python_calls"),
                            wrong={str(s): rd["extras"][s]["wrong"] for s in sizes}) for rd in rounds],
               rows=table, sendrecv=p2p, targets=[dict(target=t, verdict=v, detail=d) for t, v, d in verdicts])
    with open(os.path.join(args.out, "collectives.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    return table, p2p, verdicts


if __name__ == "__main__":
    raise SystemExit(main())
