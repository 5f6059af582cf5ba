"""The measurement loops of pyrdma-perf, one function per (test kind, role), in two modes.

``loop``    one public-API call per operation: ``qp.post_write(...)`` / ``post_read`` / ``post_send_buf``
            / ``post_atomic_*`` per WR and ``cq.poll_into(wcs, check=True)`` to reap — what a user's own Python
            loop gets from pyrdma.
``batched`` the binding's ceiling: prebuilt ``SendWRList``/``RecvWRList`` posted with one call per
            list (perftest's --post_list), and ``cq.poll_wait`` reaping many completions per call
            with the GIL released.

The loops copy perftest's structure (src/perftest_resources.c: run_iter_bw, run_iter_bw_server,
run_iter_lat_write, run_iter_lat, run_iter_lat_send) so their time stamps mean the same thing and
pyrdma.perf.stats turns them into the same columns:

* BW sender: keep up to tx_depth WRs outstanding per QP; only every cq_mod-th WR (and the last) is
  signaled; stamp tposted[k] before posting WR k (batched: before each list, at its first index),
  stamp tcompleted[k] for the last WR a completion covers.
* BW receiver (send_bw server): pre-post rx_depth receives, re-post as they complete; the run is
  timed from the first receive completion to the last (no peak), as perftest does.
* write_lat: ping-pong; each side RDMA-writes its counter into the last byte of the peer's buffer
  and spins on the last byte of its own; the server sends first.
* send_lat: ping-pong of SENDs; the client sends first.
* read_lat / atomic_lat: post one op, spin on its completion, repeat.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

import numpy as np

import pyrdma as rd
from pyrdma.perf import stats

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


# ----------------------------------------------------------------------------------------------
# Bandwidth: sender
# ----------------------------------------------------------------------------------------------

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


@dataclass
class BWRun:
    tposted: list
    tcompleted: list
    posted: int                 # WRs posted, warm-up included (the atomic data check counts on this)
    n: int                      # iterations per QP (duration: sampled total)
    duration_window: tuple = None


def bw_sender(res, verb, size, iters, *, mode="loop", tx_depth=128, cq_mod=100, post_list=32,
              atomic_type="FETCH_AND_ADD", duration=None, margin=None, warmup=True):
    """perftest's run_iter_bw (iterations) or its duration variant; returns a BWRun."""
    nq = len(res.qps)
    batched = mode == "batched"
    step = max(1, min(post_list, tx_depth)) if batched else 1
    if batched:
        cq_mod = step
    cq_mod = max(1, min(cq_mod, tx_depth))
    warm = _warmup(res, verb, size, tx_depth, atomic_type) if warmup else 0
    timed = duration is None
    n = int(iters) if timed else 1 << 62
    N = n * nq
    tposted = [0] * N if timed else [0]
    tcompleted = [0] * N if timed else [0]
    scnt = [0] * nq
    ccnt = [0] * nq
    totscnt = totccnt = 0
    wcs = np.zeros(max(64, 2 * nq * (tx_depth // cq_mod + 1)), rd.WC_DTYPE)
    wc_ids = wcs["wr_id"]
    poll_into = res.cq.poll_into
    poll_wait = res.cq.poll_wait
    if batched:
        full = [_make_list(res, verb, q, size, step, atomic_type) for q in range(nq)]
        rem = n % step if timed else 0
        tail = [_make_list(res, verb, q, size, rem, atomic_type) for q in range(nq)] if rem else None
        post_lists = [qp.post_send_list for qp in res.qps]
    else:
        posters = [_make_poster(res, verb, q, size, atomic_type) for q in range(nq)]
    if timed and nq == 1:
        if batched:
            _bw_one_qp_batched(n, step, tx_depth, full[0], tail[0] if tail else None, post_lists[0], poll_wait,
                               wcs, tposted, tcompleted)
        else:
            _bw_one_qp_loop(n, cq_mod, tx_depth, posters[0], poll_into, wcs, tposted, tcompleted)
        return BWRun(tposted, tcompleted, n + warm, n)
    if not timed:
        t0 = now_ns()
        margin_ns = int((duration // 4 if margin is None else margin) * 1e9)
        sample_start = t0 + margin_ns
        sample_end = t0 + int(duration * 1e9) - margin_ns
        end = t0 + int(duration * 1e9)
        sampled = 0
    deadline = now_ns() + int(POLL_TIMEOUT * 1e9)
    # Duration runs stop posting per QP at a group boundary (right after a signaled WR), so every
    # posted WR is covered by a completion and the QP drains.
    stopped = [False] * nq
    while True:
        if timed:
            if totscnt >= N and totccnt >= N:
                break
        elif totccnt >= totscnt and all(stopped):
            break
        for q in range(nq):
            if stopped[q]:
                continue
            if batched:
                pl = post_lists[q]
                while scnt[q] < n:
                    cnt = step if n - scnt[q] >= step else n - scnt[q]
                    if scnt[q] - ccnt[q] + cnt > tx_depth:
                        break
                    t = now_ns()
                    if timed:
                        tposted[totscnt] = t
                    elif t >= end:
                        stopped[q] = True
                        break
                    pl(full[q] if cnt == step else tail[q])
                    scnt[q] += cnt
                    totscnt += cnt
            else:
                post = posters[q]
                while scnt[q] < n and scnt[q] - ccnt[q] < tx_depth:
                    k = scnt[q]
                    t = now_ns()
                    if timed:
                        tposted[totscnt] = t
                    elif t >= end and k % cq_mod == 0:
                        stopped[q] = True
                        break
                    post(q, k % cq_mod == cq_mod - 1 or k == n - 1)
                    scnt[q] = k + 1
                    totscnt += 1
        if totccnt < (N if timed else totscnt):
            if batched:
                got = poll_wait(wcs, 1, POLL_TIMEOUT, True)
            else:
                got = poll_into(wcs, True)
            if got:
                t = now_ns()
                for i in range(got):
                    q = int(wc_ids[i])
                    if timed:
                        covered = cq_mod if n - ccnt[q] >= cq_mod else n - ccnt[q]
                    else:
                        covered = cq_mod if scnt[q] - ccnt[q] >= cq_mod else scnt[q] - ccnt[q]
                    ccnt[q] += covered
                    totccnt += covered
                    if timed:
                        tcompleted[totccnt - 1] = t
                    elif sample_start <= t < sample_end:
                        sampled += covered
                deadline = t + int(POLL_TIMEOUT * 1e9)
            elif not batched and now_ns() > deadline:
                _deadline_hit(deadline)
    if timed:
        return BWRun(tposted, tcompleted, totscnt + warm, n)
    return BWRun([sample_start], [sample_end], totscnt + warm, sampled, (sample_start, sample_end))


def _bw_one_qp_loop(n, cq_mod, tx_depth, post, poll_into, wcs, tposted, tcompleted):
    """run_iter_bw for one QP, loop mode: one post call per WR, poll_into when the window is full."""
    cqm1 = cq_mod - 1
    last = n - 1
    scnt = ccnt = 0
    idle = 0
    watchdog = _Deadline()
    while ccnt < n:
        while scnt < n and scnt - ccnt < tx_depth:
            tposted[scnt] = now_ns()
            post(0, scnt % cq_mod == cqm1 or scnt == last)
            scnt += 1
        got = poll_into(wcs, True)
        if got:
            t = now_ns()
            for i in range(got):
                ccnt += cq_mod if n - ccnt >= cq_mod else n - ccnt
                tcompleted[ccnt - 1] = t
            if idle:
                idle = 0
                if watchdog.at:
                    watchdog.reset()
        else:
            idle += 1
            if idle >= SPIN_CHECK:
                idle = 1
                watchdog.check()


def _bw_one_qp_batched(n, step, tx_depth, full, tail, post_list, poll_wait, wcs, tposted, tcompleted):
    """run_iter_bw with a post list of ``step`` WRs (one signaled completion per list) and
    poll_wait reaping every completion available in one call, GIL released."""
    scnt = ccnt = 0
    while ccnt < n:
        while scnt < n:
            cnt = step if n - scnt >= step else n - scnt
            if scnt - ccnt + cnt > tx_depth:
                break
            tposted[scnt] = now_ns()
            post_list(full if cnt == step else tail)
            scnt += cnt
        got = poll_wait(wcs, 1, POLL_TIMEOUT, True)
        t = now_ns()
        for i in range(got):
            ccnt += step if n - ccnt >= step else n - ccnt
            tcompleted[ccnt - 1] = t


def _warmup(res, verb, size, tx_depth, atomic_type):
    """perftest's perform_warm_up: tx_depth WRs per QP, then wait for them all."""
    wcs = np.zeros(64, rd.WC_DTYPE)
    count = max(1, min(tx_depth, 16))
    for q in range(len(res.qps)):
        lst = _make_list(res, verb, q, size, count, atomic_type)
        res.qps[q].post_send_list(lst)
        res.cq.poll_wait(wcs, 1, POLL_TIMEOUT, True)
    return count * len(res.qps)


def bw_report_from(run, size, *, num_qps=1, cq_mod=1, post_list=1, gbits=False, no_peak=False,
                   mode="loop", tx_depth=128):
    if run.duration_window is not None:
        return stats.bw_duration_report(run.tposted[0], run.tcompleted[0], size, run.n, gbits=gbits)
    batched = mode == "batched"
    step = max(1, min(post_list, tx_depth)) if batched else 1
    cqm = step if batched else max(1, min(cq_mod, tx_depth))
    if no_peak:
        return stats.bw_report([run.tposted[0]], [run.tcompleted[-1]], size, run.n, num_qps=num_qps,
                               no_peak=True, gbits=gbits)
    return stats.bw_report(run.tposted, run.tcompleted, size, run.n, num_qps=num_qps, cq_mod=cqm,
                           post_list=step, gbits=gbits)


# ----------------------------------------------------------------------------------------------
# Bandwidth: send_bw receiver
# ----------------------------------------------------------------------------------------------

def ensure_receives(res, count):
    """Top every QP's receive queue up to ``count`` posted receives. Every receive spans the whole
    destination half (the largest message), so receives left from one run serve the next."""
    if res.rx_posted is None:
        res.rx_posted = [0] * len(res.qps)
    for q, qp in enumerate(res.qps):
        while res.rx_posted[q] < count:
            qp.post_recv_buf(res.mr, res.half, res.half, q)
            res.rx_posted[q] += 1


def bw_receiver(res, size, iters, *, mode="loop", rx_depth=512, recv_chunk=16, duration=None, margin=None):
    """perftest's run_iter_bw_server. Returns (t_first_rx, t_last, received); duration runs return
    (sample_start, sample_end, received in the window), the window starting at the first receive.

    Re-posting follows perftest: rx_depth receives are pre-posted, and a receive is re-posted only
    while the total posted for the run stays within ``iters`` (on rxe a re-post is not free, so
    doing more than perftest would skew the comparison). Batched mode re-posts ``recv_chunk`` at once."""
    nq = len(res.qps)
    batched = mode == "batched"
    timed = duration is None
    n = int(iters) if timed else 1 << 62
    N = n * nq
    ensure_receives(res, min(rx_depth, n))
    posted = list(res.rx_posted)            # receives available to this run, per QP
    received = [0] * nq
    unused = [0] * nq
    rcnt = 0
    wcs = np.zeros(256, rd.WC_DTYPE)
    wc_ids = wcs["wr_id"]
    poll_into = res.rcq.poll_into
    poll_wait = res.rcq.poll_wait
    mr, half = res.mr, res.half
    if batched:
        chunk = max(1, min(recv_chunk, rx_depth))
        rlists = []
        for q in range(nq):
            lst = rd.RecvWRList(chunk)
            lst.fill(mr, np.full(chunk, half, np.int64), half, wr_ids=np.full(chunk, q, np.uint64))
            rlists.append(lst)
        post_lists = [qp.post_recv_list for qp in res.qps]
    else:
        chunk = 1
        post_recvs = [qp.post_recv_buf for qp in res.qps]
    t_first = t_last = None
    sample_start = sample_end = end = None
    sampled = 0
    idle = 0
    watchdog = _Deadline()
    try:
        while rcnt < N:
            if batched:
                try:
                    got = poll_wait(wcs, 1, POLL_TIMEOUT if timed else 0.5, True)
                except rd.RDMATimeoutError:
                    if timed:
                        raise
                    got = 0
            else:
                got = poll_into(wcs, True)
            if got:
                t = now_ns()
                if t_first is None:
                    t_first = t
                    if not timed:
                        margin_ns = int((duration // 4 if margin is None else margin) * 1e9)
                        sample_start = t + margin_ns
                        sample_end = t + int(duration * 1e9) - margin_ns
                        end = t + int(duration * 1e9)
                rcnt += got
                if not timed and sample_start <= t < sample_end:
                    sampled += got
                for i in range(got):
                    q = int(wc_ids[i]) if nq > 1 else 0
                    received[q] += 1
                    unused[q] += 1
                    if unused[q] >= chunk and (not timed or posted[q] < n):
                        k = chunk if not timed else min(chunk, n - posted[q])
                        if batched:
                            post_lists[q](rlists[q], k)
                        else:
                            post_recvs[q](mr, half, half, q)
                        unused[q] -= k
                        posted[q] += k
                t_last = t
                if idle:
                    idle = 0
                    if watchdog.at:
                        watchdog.reset()
            else:
                idle += 1
                if batched or idle >= SPIN_CHECK:
                    idle = 1
                    if not timed and end is not None and now_ns() >= end + 1_000_000_000:
                        break   # the sender stopped at its own end; nothing more is coming
                    if timed:
                        watchdog.check()
    finally:
        res.rx_posted = [posted[q] - received[q] for q in range(nq)]
    if not timed:
        return sample_start or 0, sample_end or 1, sampled
    return t_first, t_last, rcnt


# ----------------------------------------------------------------------------------------------
# Latency
# ----------------------------------------------------------------------------------------------

def _window(duration, margin):
    t0 = now_ns()
    margin_ns = int((duration // 4 if margin is None else margin) * 1e9)
    return t0 + margin_ns, t0 + int(duration * 1e9) - margin_ns, t0 + int(duration * 1e9)


def write_lat(res, size, iters, *, is_server, mode="loop", inline=False, duration=None, margin=None):
    """perftest's run_iter_lat_write: ping-pong of RDMA WRITEs. Each side writes its iteration
    counter into the last byte of the message and spins on the last byte of its own destination
    area for the peer's; the server sends first. Returns (tposted, iters) or, with a duration,
    (sample_ticks, sampled iterations)."""
    qp, mr = res.qps[0], res.mr
    raddr, rkey = res.remote_dst(0), res.remotes[0].rkey
    view = res.bytes_view
    send_idx = size - 1
    poll_idx = res.half + size - 1   # zeroed by the caller before the start barrier
    wc = np.zeros(1, rd.WC_DTYPE)
    batched = mode == "batched"
    if batched:
        lst = _make_list(res, "write", 0, size, 1, None, inline=inline)
        post_list = qp.post_send_list
        poll_wait = res.cq.poll_wait
    else:
        post_write = qp.post_write
        poll_into = res.cq.poll_into
    watchdog = _Deadline()
    timed = duration is None
    n = int(iters) if timed else 1 << 62
    tposted = [0] * n if timed else None
    if not timed:
        s_start, s_end, end = _window(duration, margin)
        sampled = 0
    scnt = rcnt = 0
    while scnt < n or rcnt < n:
        if rcnt < n and (scnt or not is_server):
            rcnt += 1
            want = rcnt & 0xFF
            while view[poll_idx] != want:
                for _ in SPIN:
                    if view[poll_idx] == want:
                        break
                else:
                    if not timed and now_ns() >= end:
                        break
                    watchdog.check()
            if watchdog.at:
                watchdog.reset()
        if scnt < n:
            t = now_ns()
            if timed:
                tposted[scnt] = t
            else:
                if t >= end:
                    break
                if s_start <= t < s_end:
                    sampled += 1
            scnt += 1
            view[send_idx] = scnt & 0xFF
            if batched:
                post_list(lst)
                poll_wait(wc, 1, POLL_TIMEOUT, True)
            else:
                post_write(mr, 0, size, raddr, rkey, 0, True, None, inline)
                while not poll_into(wc, True):
                    for _ in SPIN:
                        if poll_into(wc, True):
                            break
                    else:
                        watchdog.check()
                        continue
                    break
                if watchdog.at:
                    watchdog.reset()
    view[send_idx] = int(pattern(size, res.seed)[size - 1])   # restore the data pattern
    if not timed:
        return s_end - s_start, sampled
    return tposted, n


def op_lat(res, verb, size, iters, *, mode="loop", atomic_type="FETCH_AND_ADD", duration=None, margin=None):
    """perftest's run_iter_lat (read_lat, atomic_lat; client side): stamp, post one op, spin on
    its completion, repeat."""
    qp = res.qps[0]
    wc = np.zeros(1, rd.WC_DTYPE)
    batched = mode == "batched"
    if batched:
        lst = _make_list(res, verb, 0, size, 1, atomic_type)
        post_list = qp.post_send_list
        poll_wait = res.cq.poll_wait
    else:
        poll_into = res.cq.poll_into
        post = _make_poster(res, verb, 0, size, atomic_type)
    watchdog = _Deadline()
    timed = duration is None
    n = int(iters) if timed else 1 << 62
    tposted = [0] * n if timed else None
    if not timed:
        s_start, s_end, end = _window(duration, margin)
        sampled = 0
    scnt = 0
    while scnt < n:
        t = now_ns()
        if timed:
            tposted[scnt] = t
        else:
            if t >= end:
                break
            if s_start <= t < s_end:
                sampled += 1
        scnt += 1
        if batched:
            post_list(lst)
            poll_wait(wc, 1, POLL_TIMEOUT, True)
        else:
            post(0, True)
            while not poll_into(wc, True):
                for _ in SPIN:
                    if poll_into(wc, True):
                        break
                else:
                    watchdog.check()
                    continue
                break
            if watchdog.at:
                watchdog.reset()
    if not timed:
        return s_end - s_start, sampled
    return tposted, scnt


def send_lat(res, size, iters, *, is_server, mode="loop", inline=False, rx_depth=512, duration=None,
             margin=None):
    """perftest's run_iter_lat_send: SEND ping-pong, the client sends first. Receives: rx_depth
    pre-posted, re-posted only while rcnt + rx_depth <= iters (perftest's rule; with the default
    rx_depth >= iters nothing is re-posted during the run)."""
    qp, mr, half = res.qps[0], res.mr, res.half
    timed = duration is None
    n = int(iters) if timed else 1 << 62
    ensure_receives(res, min(rx_depth, n))
    size_per_qp = res.rx_posted[0]
    reposted = 0
    swc = np.zeros(1, rd.WC_DTYPE)
    rwc = np.zeros(1, rd.WC_DTYPE)
    batched = mode == "batched"
    if batched:
        slist = _make_list(res, "send", 0, size, 1, None, inline=inline)
        rlist = rd.RecvWRList(1)
        rlist.fill(mr, [half], half, wr_ids=[0])
        post_slist, post_rlist = qp.post_send_list, qp.post_recv_list
        spoll_wait, rpoll_wait = res.cq.poll_wait, res.rcq.poll_wait
    else:
        post_send = qp.post_send_buf
        post_recv = qp.post_recv_buf
        spoll, rpoll = res.cq.poll_into, res.rcq.poll_into
    watchdog = _Deadline()
    tposted = [0] * n if timed else None
    if not timed:
        s_start, s_end, end = _window(duration, margin)
        sampled = 0
    scnt = rcnt = 0
    is_client = not is_server
    try:
        while scnt < n or rcnt < n:
            if rcnt < n and (scnt or not is_client):
                if batched:
                    try:
                        rpoll_wait(rwc, 1, POLL_TIMEOUT if timed else 0.2, True)
                    except rd.RDMATimeoutError:
                        if timed or now_ns() < end:
                            raise
                        break
                else:
                    stop = False
                    while not rpoll(rwc, True):
                        for _ in SPIN:
                            if rpoll(rwc, True):
                                break
                        else:
                            if not timed and now_ns() >= end:
                                stop = True
                                break
                            watchdog.check()
                            continue
                        break
                    if watchdog.at:
                        watchdog.reset()
                    if stop:
                        break
                rcnt += 1
                if not timed or rcnt + size_per_qp <= n:
                    if batched:
                        post_rlist(rlist)
                    else:
                        post_recv(mr, half, half, 0)
                    reposted += 1
            if scnt < n:
                t = now_ns()
                if timed:
                    tposted[scnt] = t
                else:
                    if t >= end:
                        break
                    if s_start <= t < s_end:
                        sampled += 1
                scnt += 1
                if batched:
                    post_slist(slist)
                    spoll_wait(swc, 1, POLL_TIMEOUT, True)
                else:
                    post_send(mr, 0, size, 0, True, None, inline)
                    while not spoll(swc, True):
                        for _ in SPIN:
                            if spoll(swc, True):
                                break
                        else:
                            watchdog.check()
                            continue
                        break
                    if watchdog.at:
                        watchdog.reset()
    finally:
        res.rx_posted[0] = size_per_qp + reposted - rcnt
    if not timed:
        return s_end - s_start, sampled
    return tposted, n


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
