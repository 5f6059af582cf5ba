"""Where the time of a Python write-latency iteration goes (issue: "what does Python cost me?").

One process, an RC QP pair looped back on one device, 2-byte RDMA WRITEs. Per iteration, median
of ``--iters``:

  bookkeeping   the pure-Python part of pyrdma-perf's write_lat loop body (clock, counters, the
                store of the counter byte, one check of the polled byte), no verbs call
  python_op     qp.post_write(...) then cq.poll_into() until the completion, from Python; its parts
                ``post`` (the post_write call) and ``poll`` (from its return to the completion)
  batched_op    qp.post_send_list(prebuilt WR) then cq.poll_wait() (the wait runs in C)
  empty         an empty Python loop iteration (the interpreter's floor)

python_op - batched_op is what the per-call Python API adds to one operation. Run it where the
latency test runs (in the Soft-RoCE VM: python3 -m pyrdma.testing.vm -- PYTHON bench/lat_breakdown.py);
pyrdma.perf.side_by_side runs ``measure()`` in each of its rounds.
"""
import argparse
import json
import time

import numpy as np

import pyrdma as rd

now_ns = time.perf_counter_ns


def _median_ns(samples):
    return float(np.median(np.diff(np.asarray(samples, dtype=np.int64))))


def measure(dev=None, iters=5000, size=2):
    """The medians (us) of one process's loops on ``dev``: empty, bookkeeping, python_op (with its
    parts post and poll, from a loop that stamps between them), batched_op."""
    n = iters
    out = {}
    with rd.Context(dev) as ctx:
        pd = rd.ProtectionDomain(ctx)
        cq = rd.CompletionQueue(ctx, 64)
        buf = np.zeros(8192, np.uint8)
        mr = rd.MemoryRegion(pd, buf, rd.ACCESS_LOCAL_WRITE | rd.ACCESS_REMOTE_WRITE)
        a = rd.QueuePair(pd, rd.QPT_RC, cq, max_inline_data=64)
        b = rd.QueuePair(pd, rd.QPT_RC, cq)
        a.connect(b.endpoint())
        b.connect(a.endpoint())
        raddr, rkey = mr.addr + 4096, mr.rkey
        wc = np.zeros(1, rd.WC_DTYPE)
        view = memoryview(buf)

        stamps = [0] * (n + 1)
        for i in range(n + 1):
            stamps[i] = now_ns()
        out["empty"] = _median_ns(stamps)

        post_write, poll_into = a.post_write, cq.poll_into
        stamps = [0] * (n + 1)
        for i in range(n + 1):
            stamps[i] = now_ns()
            post_write(mr, 0, size, raddr, rkey, 0, True, None, True)
            while not poll_into(wc):
                pass
        rd.check_wcs(wc)
        out["python_op"] = _median_ns(stamps)

        # the same loop stamped between the post and the poll: the two calls' shares
        starts, posted = [0] * (n + 1), [0] * (n + 1)
        for i in range(n + 1):
            starts[i] = now_ns()
            post_write(mr, 0, size, raddr, rkey, 0, True, None, True)
            posted[i] = now_ns()
            while not poll_into(wc):
                pass
        rd.check_wcs(wc)
        starts, posted = np.asarray(starts, np.int64), np.asarray(posted, np.int64)
        out["post"] = float(np.median(posted[:-1] - starts[:-1]))
        out["poll"] = float(np.median(starts[1:] - posted[:-1]))

        lst = rd.SendWRList(1)
        lst.fill(rd.WR_RDMA_WRITE, mr, np.zeros(1, np.int64), size, raddr, rkey, wr_ids=0,
                 flags=np.full(1, rd.SEND_SIGNALED | rd.SEND_INLINE, np.int32))
        post_list, poll_wait = a.post_send_list, cq.poll_wait
        stamps = [0] * (n + 1)
        for i in range(n + 1):
            stamps[i] = now_ns()
            post_list(lst)
            poll_wait(wc, 1, 5.0)
        rd.check_wcs(wc)
        out["batched_op"] = _median_ns(stamps)

        # write_lat's loop body without its verbs calls; the polled byte already holds the value
        tposted = [0] * n
        stamps = [0] * (n + 1)
        scnt = rcnt = 0
        for i in range(n + 1):
            stamps[i] = now_ns()
            rcnt += 1
            want = rcnt & 0xFF
            view[4096 + size - 1] = want
            while view[4096 + size - 1] != want:
                pass
            t = now_ns()
            if scnt < n:
                tposted[scnt] = t
            scnt += 1
            view[size - 1] = scnt & 0xFF
        out["bookkeeping"] = _median_ns(stamps)
    return {k: v / 1000 for k, v in out.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-d", "--dev", default=None)
    p.add_argument("--iters", type=int, default=5000)
    p.add_argument("--size", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)
    out = measure(args.dev, args.iters, args.size)
    print(f"# {args.iters} iterations, {args.size}-byte inline RDMA WRITE, RC QP pair looped back on one device")
    for k in ("empty", "bookkeeping", "post", "poll", "python_op", "batched_op"):
        print(f"{k:>12}: {out[k]:8.2f} us")
    print(f"{'python adds':>12}: {out['python_op'] - out['batched_op']:8.2f} us per operation")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
