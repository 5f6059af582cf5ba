"""Faults on the wire of the multi-host test bed, at the sizes of #19, and what each costs: an RC WRITE
stream from host 1 to host 2 and a two-rank ring allreduce (ranks on hosts 1 and 2), each with no fault,
then ``tc netem`` loss 1%, loss 5% and reordering on host 1's wire (both directions). Every byte is
checked; the table gives each run's time and its slowdown against the same run with no fault. Run it
in the Soft-RoCE VM with the test bed:

    python3 -m pyrdma.testing.vm --hosts 2 --rwdir build/bench -- "$(python3 -c 'import sys;print(sys.executable)')" \
        bench/fault_bench.py --out build/bench

Writes fault.json to ``--out``. tests/test_multihost.py checks the same faults at sizes CI can afford.

Where to expect what: on Soft-RoCE a lost packet costs a go-back-N resend of everything after it, and a
gap that the responder's NAK does not cover waits out the ACK timeout (``--qp-timeout``, 4.096 us *
2^14 = 67 ms by default), so the slowdown grows with the loss rate much faster than the lost bytes do.
rxe's resend counters (completer_retry_err: ACK timeouts; duplicate_request: packets received twice)
on both hosts' devices are reported per run.
"""
import argparse
import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # for the default --out

from pyrdma.testing import counting_rc_resends, free_port
from pyrdma.testing import hosts as testbed
from pyrdma.testing.faults import FAST_QP_TIMEOUT, FAULTS, allreduce_under_faults, write_stream


def clean_wire(hosts):
    """No qdisc on any host's wire (a run that failed half way may have left one)."""
    for h in hosts:
        for dev in (h.netdev, h.bridge_port):
            subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True,
                           timeout=testbed.COMMAND_TIMEOUT_S)


@contextlib.contextmanager
def resends_on(a, b):
    """{device: {counter: growth}} over the block, for the devices of hosts ``a`` and ``b``."""
    with counting_rc_resends(a.device) as ra, counting_rc_resends(b.device) as rb:
        out = {}
        yield out
    out.update({a.device: ra, b.device: rb})


def streams(a, b, faults, nbytes, wait):
    rows = []
    for name, spec in faults:
        with resends_on(a, b) as resends:
            with testbed.netem(a, spec) if spec else contextlib.nullcontext():
                elapsed, _ = write_stream(a, b, nbytes, wait=wait)
        rows.append(dict(test="write stream", fault=name, netem=spec, bytes=nbytes, seconds=elapsed,
                         mb_s=nbytes / elapsed / 1e6, exact=True, resends=resends))
        print(f"write stream {nbytes >> 20} MiB h1->h2, {name}: {elapsed:.2f} s, every byte checked", flush=True)
    return rows


def allreduces(hosts, faults, nbytes, timeout):
    a, b = hosts[:2]
    args = (free_port(a.address), os.environ[testbed.HOSTS_ENV], faults, nbytes)
    with resends_on(a, b) as resends:
        with multiprocessing.get_context("spawn").Pool(2) as pool:   # terminates both ranks on the way out
            res = pool.starmap_async(allreduce_under_faults, [(r, 2, *args) for r in range(2)]).get(timeout)
    (times, correct), (times1, correct1) = res
    rows = []
    for name, spec in faults:
        rows.append(dict(test="allreduce", fault=name, netem=spec, bytes=nbytes,
                         seconds=max(times[name], times1[name]), exact=correct[name] and correct1[name]))
    rows[-1]["resends_all_faults"] = resends
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "build", "bench"))
    p.add_argument("--stream-bytes", type=int, default=64 << 20, help="bytes of the WRITE stream (64 MiB)")
    p.add_argument("--allreduce-bytes", type=int, default=16 << 20, help="bytes per rank (16 MiB)")
    p.add_argument("--faults", default=",".join(name for name, _ in FAULTS),
                   help="comma-separated, of: " + ", ".join(name for name, _ in FAULTS).replace("%", "%%"))
    p.add_argument("--skip-stream", action="store_true")
    p.add_argument("--skip-allreduce", action="store_true")
    p.add_argument("--wait", type=int, default=300, help="seconds any one completion may take")
    p.add_argument("--timeout", type=int, default=1800, help="seconds for all the allreduces")
    args = p.parse_args(argv)
    hosts = testbed.load()
    if len(hosts) < 2:
        sys.exit(f"fault_bench: needs the multi-host test bed ({testbed.HOSTS_ENV} unset or < 2 hosts): run it "
                 f"under python3 -m pyrdma.testing.vm --hosts 2")
    known = dict(FAULTS)
    names = [n.strip() for n in args.faults.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"fault_bench: unknown faults {unknown}; known: {', '.join(known)}")
    if "none" not in names:
        names.insert(0, "none")            # the reference every slowdown is against
    faults = [(n, known[n]) for n in names]
    os.makedirs(args.out, exist_ok=True)
    rows = []
    start = time.monotonic()
    try:
        if not args.skip_stream:
            rows += streams(hosts[0], hosts[1], faults, args.stream_bytes, args.wait)
        if not args.skip_allreduce:
            rows += allreduces(hosts, faults, args.allreduce_bytes, args.timeout)
    finally:
        clean_wire(hosts)
    for r in rows:
        ref = next(x for x in rows if x["test"] == r["test"] and x["fault"] == "none")
        r["slowdown"] = r["seconds"] / ref["seconds"]
    print(f"# faults on h1's wire (both directions), qp_timeout {FAST_QP_TIMEOUT}, Ethernet MTU {hosts[0].mtu}")
    print(f"{'test':>13} {'MiB':>5} {'fault':>8} {'seconds':>9} {'slowdown':>9} {'exact':>6}")
    for r in rows:
        print(f"{r['test']:>13} {r['bytes'] >> 20:5d} {r['fault']:>8} {r['seconds']:9.2f} {r['slowdown']:8.1f}x "
              f"{'yes' if r['exact'] else 'NO':>6}")
    with open(os.path.join(args.out, "fault.json"), "w") as f:
        json.dump(dict(rows=rows, qp_timeout=FAST_QP_TIMEOUT, mtu=hosts[0].mtu,
                       total_s=time.monotonic() - start), f, indent=1)
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
