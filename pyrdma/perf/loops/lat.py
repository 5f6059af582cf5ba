"""Latency loops: perftest's run_iter_lat_write (write_lat), run_iter_lat (read_lat, atomic_lat) and
run_iter_lat_send (send_lat), in loop and batched mode; see pyrdma.perf.loops."""
from __future__ import annotations

from functools import partial

import numpy as np

import pyrdma as rd
from pyrdma.perf.loops.common import (POLL_TIMEOUT, SPIN, SampleWindow, _Deadline, _make_list, _make_poster,
                                      ensure_receives, now_ns, pattern)


def _spin_poll(poll, wc, watchdog, end=None):
    """Spin on ``poll(wc, True)`` until it takes a completion: True; False when ``end`` (a sampled
    run's window end, in ns) passes first. The watchdog fails a run stuck for POLL_TIMEOUT."""
    while not poll(wc, True):
        for _ in SPIN:
            if poll(wc, True):
                break
        else:
            if end is not None and now_ns() >= end:
                return False
            watchdog.check()
            continue
        break
    if watchdog.at:
        watchdog.reset()
    return True


def _signaled_op(res, verb, size, batched, wc, watchdog, atomic_type=None, inline=False):
    """(post, wait) for one signaled op of ``verb`` on QP 0 and its completion: a one-WR SendWRList
    and poll_wait (batched mode), or the fast-path method and a spin on poll_into (loop mode);
    functools.partials, so each call is one public-API call."""
    if batched:
        return (partial(res.qps[0].post_send_list, _make_list(res, verb, 0, size, 1, atomic_type, inline=inline)),
                partial(res.cq.poll_wait, wc, 1, POLL_TIMEOUT, True))
    post = _make_poster(res, verb, 0, size, atomic_type)
    # WRITE and SEND take (wr_id, signaled, imm, inline); READ and the atomics (wr_id, signaled)
    post = partial(post, 0, True, None, inline) if verb in ("write", "send") else partial(post, 0, True)
    return post, partial(_spin_poll, res.cq.poll_into, wc, watchdog)


def _iterations(iters, duration, margin):
    """(timed, n, tposted, window): a timed run of ``iters`` stamps each post into tposted; a sampled
    one (``duration`` seconds) runs until its SampleWindow closes."""
    timed = duration is None
    n = int(iters) if timed else 1 << 62
    return timed, n, [0] * n if timed else None, None if timed else SampleWindow(duration, margin)


def write_lat(res, size, iters, *, is_server, mode="loop", inline=False, duration=None, margin=None):
    """perftest's run_iter_lat_write: ping-pong of RDMA WRITEs. Each side writes its iteration
    counter into the last byte of the message and spins on the last byte of its own destination
    area for the peer's; the server sends first. Returns (tposted, iters) or, with a duration,
    (sample_ticks, sampled iterations)."""
    view = res.bytes_view
    send_idx = size - 1
    poll_idx = res.half + size - 1   # zeroed by the caller before the start barrier
    watchdog = _Deadline()
    post, wait = _signaled_op(res, "write", size, mode == "batched", np.zeros(1, rd.WC_DTYPE), watchdog,
                              inline=inline)
    timed, n, tposted, window = _iterations(iters, duration, margin)
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
                    if not timed and now_ns() >= window.end:
                        break
                    watchdog.check()
            if watchdog.at:
                watchdog.reset()
        if scnt < n:
            if timed:
                tposted[scnt] = now_ns()
            elif not window.take():
                break
            scnt += 1
            view[send_idx] = scnt & 0xFF
            post()
            wait()
    view[send_idx] = int(pattern(size, res.seed)[size - 1])   # restore the data pattern
    if not timed:
        return window.result()
    return tposted, n


def op_lat(res, verb, size, iters, *, mode="loop", atomic_type="FETCH_AND_ADD", duration=None, margin=None):
    """perftest's run_iter_lat (read_lat, atomic_lat; client side): stamp, post one op, spin on
    its completion, repeat."""
    watchdog = _Deadline()
    post, wait = _signaled_op(res, verb, size, mode == "batched", np.zeros(1, rd.WC_DTYPE), watchdog, atomic_type)
    timed, n, tposted, window = _iterations(iters, duration, margin)
    scnt = 0
    while scnt < n:
        # The stamp step is written out in each loop (write_lat, send_lat too), not called: its
        # stamp starts the measured interval, and a Python call after it would add to every sample.
        if timed:
            tposted[scnt] = now_ns()
        elif not window.take():
            break
        scnt += 1
        post()
        wait()
    if not timed:
        return window.result()
    return tposted, scnt


def send_lat(res, size, iters, *, is_server, mode="loop", inline=False, rx_depth=512, duration=None,
             margin=None):
    """perftest's run_iter_lat_send: SEND ping-pong, the client sends first. Receives: rx_depth
    pre-posted, re-posted only while rcnt + rx_depth <= iters (perftest's rule; with the default
    rx_depth >= iters nothing is re-posted during the run)."""
    qp, mr, half = res.qps[0], res.mr, res.half
    timed, n, tposted, window = _iterations(iters, duration, margin)
    ensure_receives(res, min(rx_depth, n))
    size_per_qp = res.rx_posted[0]
    reposted = 0
    rwc = np.zeros(1, rd.WC_DTYPE)
    batched = mode == "batched"
    watchdog = _Deadline()
    post_send, wait_send = _signaled_op(res, "send", size, batched, np.zeros(1, rd.WC_DTYPE), watchdog,
                                        inline=inline)
    if batched:
        rlist = rd.RecvWRList(1)
        rlist.fill(mr, [half], half, wr_ids=[0])
        post_rlist, rpoll_wait = qp.post_recv_list, res.rcq.poll_wait
    else:
        post_recv, rpoll = qp.post_recv_buf, res.rcq.poll_into
    scnt = rcnt = 0
    is_client = not is_server
    try:
        while scnt < n or rcnt < n:
            if rcnt < n and (scnt or not is_client):
                if batched:
                    try:
                        rpoll_wait(rwc, 1, POLL_TIMEOUT if timed else 0.2, True)
                    except rd.RDMATimeoutError:
                        if timed or now_ns() < window.end:
                            raise
                        break
                elif not _spin_poll(rpoll, rwc, watchdog, None if timed else window.end):
                    break
                rcnt += 1
                if not timed or rcnt + size_per_qp <= n:
                    if batched:
                        post_rlist(rlist)
                    else:
                        post_recv(mr, half, half, 0)
                    reposted += 1
            if scnt < n:
                if timed:
                    tposted[scnt] = now_ns()
                elif not window.take():
                    break
                scnt += 1
                post_send()
                wait_send()
    finally:
        res.rx_posted[0] = size_per_qp + reposted - rcnt
    if not timed:
        return window.result()
    return tposted, n
