"""What the bandwidth and latency loops share: the resources of a side, the data pattern, the
watchdog of spin loops, the per-op posters and prebuilt lists, receive bookkeeping, and the sampling
window of duration runs (SampleWindow)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

import numpy as np

import pyrdma as rd

now_ns = time.perf_counter_ns
POLL_TIMEOUT = 30.0          # seconds a single wait may take before the run is declared stuck
SPIN_CHECK = 1 << 16         # spins between deadline checks in Python spin loops

# wr_id of a signaled WR: the QP index. A completion covers the unsignaled WRs posted before it.


@dataclass
class Resources:
    """Verbs objects of one side: buffer layout is [source half | destination half]."""
    ctx: object
    pd: object
    cq: object
    rcq: object
    mr: object
    buf: np.ndarray
    half: int
    qps: list
    remotes: list = field(default_factory=list)    # peer Endpoints (with the peer's MR)
    inline_size: int = 0
    seed: int = 1                                   # our source-half pattern (pattern(n, seed))
    rx_posted: list = None                          # receives outstanding per QP (send tests)
    perftest_peer: bool = False                     # the peer is perftest: its one address is where we
                                                    # write to and read from

    @property
    def bytes_view(self):
        return memoryview(self.buf)

    def remote_dst(self, q):
        """Address of the peer's destination half (where we write / send / atomically add)."""
        return self.remotes[q].addr + (0 if self.perftest_peer else self.half)

    def remote_src(self, q):
        """Address of the peer's source half (what we RDMA-read)."""
        return self.remotes[q].addr

    def close(self):
        for obj in (*self.qps, self.mr, self.cq, self.rcq, self.pd, self.ctx):
            if obj is not None:
                try:
                    obj.close()
                except Exception:
                    pass


def pattern(nbytes, seed):
    """The byte pattern a side keeps in its source half, so a peer can verify what it got."""
    return ((np.arange(nbytes, dtype=np.uint32) * 7 + seed * 31) & 0xFF).astype(np.uint8)


class RunError(rd.RDMAError):
    pass


def _deadline_hit(deadline):
    if now_ns() > deadline:
        raise rd.RDMATimeoutError(f"no progress for {POLL_TIMEOUT} s (is the peer alive?)", call="perf loop")


def _make_poster(res, verb, q, size, atomic_type):
    """A per-op callable post(wr_id, signaled) for the loop mode: a functools.partial over the
    public fast-path method (no extra Python frame), so each call is one public-API call."""
    qp, mr = res.qps[q], res.mr
    rkey = res.remotes[q].rkey
    if verb == "write":
        return partial(qp.post_write, mr, 0, size, res.remote_dst(q), rkey)
    if verb == "read":
        return partial(qp.post_read, mr, res.half, size, res.remote_src(q), rkey)
    if verb == "send":
        return partial(qp.post_send_buf, mr, 0, size)
    if verb == "atomic":
        if atomic_type == "CMP_AND_SWAP":
            post = partial(qp.post_atomic_cmp_swap, mr, res.half, res.remote_dst(q), rkey, 0, 0)
        else:
            post = partial(qp.post_atomic_fetch_add, mr, res.half, res.remote_dst(q), rkey, 1)
        return post
    raise ValueError(verb)


class _Deadline:
    """Lazily armed watchdog for spin loops: costs nothing until a spin runs long."""
    __slots__ = ("at",)

    def __init__(self):
        self.at = 0

    def check(self):
        t = now_ns()
        if not self.at:
            self.at = t + int(POLL_TIMEOUT * 1e9)
        elif t > self.at:
            _deadline_hit(self.at)

    def reset(self):
        self.at = 0


SPIN = range(SPIN_CHECK)


def _make_list(res, verb, q, size, count, atomic_type, inline=False):
    """A SendWRList of ``count`` WRs of this test, only the last one signaled (wr_id = q)."""
    lst = rd.SendWRList(count)
    flags = np.zeros(count, np.int32)
    flags[-1] = rd.SEND_SIGNALED
    if inline:
        flags |= rd.SEND_INLINE
    rkey = res.remotes[q].rkey if res.remotes else 0
    if verb == "write":
        lst.fill(rd.WR_RDMA_WRITE, res.mr, np.zeros(count, np.int64), size, res.remote_dst(q), rkey,
                 wr_ids=q, flags=flags)
    elif verb == "read":
        lst.fill(rd.WR_RDMA_READ, res.mr, np.full(count, res.half, np.int64), size, res.remote_src(q), rkey,
                 wr_ids=q, flags=flags)
    elif verb == "send":
        lst.fill(rd.WR_SEND, res.mr, np.zeros(count, np.int64), size, wr_ids=q, flags=flags)
    elif verb == "atomic":
        op = rd.WR_ATOMIC_CMP_AND_SWP if atomic_type == "CMP_AND_SWAP" else rd.WR_ATOMIC_FETCH_AND_ADD
        lst.fill(op, res.mr, np.full(count, res.half, np.int64), 8, res.remote_dst(q), rkey, wr_ids=q,
                 flags=flags, compare_add=0 if atomic_type == "CMP_AND_SWAP" else 1, swap=0)
    else:
        raise ValueError(verb)
    return lst




class SampleWindow:
    """The clock of a duration run (perftest's -D): it ends ``duration`` seconds after ``t0`` (default:
    now), and counts the iterations (or completions) that start between t0 + margin and end - margin
    (the margin defaults to a quarter of the duration, as perftest's). ``result()`` is (window length
    in ns, count), what pyrdma.perf.stats turns into a duration report."""
    __slots__ = ("start", "stop", "end", "sampled")

    def __init__(self, duration, margin=None, t0=None):
        t0 = now_ns() if t0 is None else t0
        margin_ns = int((duration // 4 if margin is None else margin) * 1e9)
        self.start = t0 + margin_ns
        self.stop = t0 + int(duration * 1e9) - margin_ns
        self.end = t0 + int(duration * 1e9)
        self.sampled = 0

    def count(self, t, n=1):
        """Count ``n`` iterations that happened at ``t`` if it lies in the window."""
        if self.start <= t < self.stop:
            self.sampled += n

    def take(self):
        """An iteration starts now: count it; False once the run is over (then it does not start)."""
        t = now_ns()
        if t >= self.end:
            return False
        if self.start <= t < self.stop:
            self.sampled += 1
        return True

    def result(self):
        return self.stop - self.start, self.sampled


def ensure_receives(res, count):
    """Top every QP's receive queue up to ``count`` posted receives. Every receive spans the whole
    destination half (the largest message), so receives left from one run serve the next."""
    if res.rx_posted is None:
        res.rx_posted = [0] * len(res.qps)
    for q, qp in enumerate(res.qps):
        while res.rx_posted[q] < count:
            qp.post_recv_buf(res.mr, res.half, res.half, q)
            res.rx_posted[q] += 1



def drain_receives(res, timeout=0.2):
    """After a duration run: reap receive completions that arrived after our loop ended (their
    receives are re-posted, so the queue level stays at rx_depth) and stray send completions."""
    wcs = np.zeros(64, rd.WC_DTYPE)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = res.rcq.poll_into(wcs) if res.rcq is not res.cq else 0
        for i in range(got):
            if wcs["opcode"][i] & rd.WC_RECV:
                res.rx_posted[int(wcs["wr_id"][i])] -= 1
        got2 = res.cq.poll_into(wcs)
        if not got and not got2:
            time.sleep(0.005)
