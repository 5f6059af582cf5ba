"""Latency loops: perftest's run_iter_lat_write (write_lat), run_iter_lat (read_lat, atomic_lat) and
run_iter_lat_send (send_lat), in loop and batched mode; see pyrdma.perf.loops."""
from __future__ import annotations

import numpy as np

import pyrdma as rd
from pyrdma.perf.loops.common import (POLL_TIMEOUT, SPIN, SampleWindow, _Deadline, _make_list, _make_poster,
                                      ensure_receives, now_ns, pattern)


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
    window = None if timed else SampleWindow(duration, margin)
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
        return window.result()
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
    window = None if timed else SampleWindow(duration, margin)
    scnt = 0
    while scnt < n:
        if timed:
            tposted[scnt] = now_ns()
        elif not window.take():
            break
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
        return window.result()
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
    window = None if timed else SampleWindow(duration, margin)
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
                else:
                    stop = False
                    while not rpoll(rwc, True):
                        for _ in SPIN:
                            if rpoll(rwc, True):
                                break
                        else:
                            if not timed and now_ns() >= window.end:
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
                if timed:
                    tposted[scnt] = now_ns()
                elif not window.take():
                    break
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
        return window.result()
    return tposted, n
