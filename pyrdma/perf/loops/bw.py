"""Bandwidth loops: perftest's run_iter_bw (the sender, every test but send_bw's server) and
run_iter_bw_server (send_bw's receiver), in loop and batched mode; see pyrdma.perf.loops."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import pyrdma as rd
from pyrdma.perf import stats
from pyrdma.perf.loops.common import (POLL_TIMEOUT, SPIN_CHECK, SampleWindow, _Deadline, _deadline_hit, _make_list,
                                      _make_poster, ensure_receives, now_ns)


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
        window = SampleWindow(duration, margin)
        end = window.end
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
                    else:
                        window.count(t, covered)
                deadline = t + int(POLL_TIMEOUT * 1e9)
            elif not batched and now_ns() > deadline:
                _deadline_hit(deadline)
    if timed:
        return BWRun(tposted, tcompleted, totscnt + warm, n)
    return BWRun([window.start], [window.stop], totscnt + warm, window.sampled, (window.start, window.stop))


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
    window = None            # duration runs: from the first receive on
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
                        window = SampleWindow(duration, margin, t0=t)
                rcnt += got
                if not timed:
                    window.count(t, got)
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
                    if window is not None and now_ns() >= window.end + 1_000_000_000:
                        break   # the sender stopped at its own end; nothing more is coming
                    if timed:
                        watchdog.check()
    finally:
        res.rx_posted = [posted[q] - received[q] for q in range(nq)]
    if not timed:
        return (window.start, window.stop, window.sampled) if window is not None else (0, 1, 0)
    return t_first, t_last, rcnt


