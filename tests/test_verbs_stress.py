"""Stress: threads open, use and close verbs objects in random (seeded) orders; nothing may crash.

The workload runs in a subprocess so that a crash (a signal) is a failed assertion, not a dead test
run. Every blocking call has a timeout; the only exceptions allowed are the RDMAError family.
"""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.device

WORKLOAD = textwrap.dedent(r'''
    import random, sys, threading, time, traceback
    import numpy as np
    import pyrdma as rd

    seed, seconds, nthreads = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    lock = threading.Lock()                  # guards the pool lists, not the objects
    pool = {k: [] for k in ("ctx", "pd", "ch", "cq", "mr", "qp", "srq", "ah", "wrs")}
    counts = {"ok": 0, "rdma_error": 0}
    unexpected = []
    MAX_EACH = 6

    def pick(kind, rng):
        with lock:
            items = pool[kind]
            return rng.choice(items) if items else None

    def add(kind, obj):
        with lock:
            pool[kind].append(obj)
            if len(pool[kind]) > MAX_EACH:
                # forgotten: freed by its last reference, in whichever thread drops it (__dealloc__)
                pool[kind].pop(0)
        return obj

    def op_ctx(rng):
        add("ctx", rd.Context())

    def op_pd(rng):
        ctx = pick("ctx", rng)
        if ctx is not None:
            add("pd", rd.ProtectionDomain(ctx))

    def op_ch(rng):
        ctx = pick("ctx", rng)
        if ctx is not None:
            add("ch", rd.CompChannel(ctx))

    def op_cq(rng):
        ctx, ch = pick("ctx", rng), pick("ch", rng)
        if ctx is not None:
            # a channel of another context is refused by the provider or the binding, not a crash
            add("cq", rd.CompletionQueue(ctx, 64, channel=ch if rng.random() < 0.6 else None))

    def op_mr(rng):
        pd = pick("pd", rng)
        if pd is not None:
            add("mr", rd.MemoryRegion.allocate(pd, 8192, rd.ACCESS_ALL))

    def op_srq(rng):
        pd = pick("pd", rng)
        if pd is not None:
            add("srq", rd.SharedReceiveQueue(pd, 32))

    def op_qp(rng):
        pd, cq = pick("pd", rng), pick("cq", rng)
        if pd is None or cq is None:
            return
        kind = rng.choice([rd.QPT_RC, rd.QPT_RC, rd.QPT_UD])
        srq = pick("srq", rng) if rng.random() < 0.3 else None
        qp = rd.QueuePair(pd, kind, cq, max_send_wr=64, max_recv_wr=64, srq=srq, max_inline_data=32)
        add("qp", qp)
        if kind == rd.QPT_UD:
            qp.connect()
            add("ah", rd.AddressHandle(pd, qp.endpoint()))
        else:
            qp.connect(qp.endpoint())

    def op_post(rng):
        qp, mr = pick("qp", rng), pick("mr", rng)
        if qp is None or mr is None:
            return
        off = rng.choice([0, 8, 64, 4096, -8, 8190, 1 << 40])
        n = rng.choice([0, 8, 64, 100])
        what = rng.randrange(9)
        if what == 0:
            qp.post_write(mr, off, n, mr.addr + 4096, mr.rkey, signaled=rng.random() < 0.5)
        elif what == 1:
            qp.post_read(mr, off, n, mr.addr + 4096, mr.rkey)
        elif what == 2:
            qp.post_send_buf(mr, off, n, inline=rng.random() < 0.3, ah=pick("ah", rng), remote_qpn=qp.qp_num)
        elif what == 3:
            qp.post_recv_buf(mr, off, n)
        elif what == 4:
            qp.post_atomic_fetch_add(mr, 0, mr.addr + 8, mr.rkey, 1)
        elif what == 5:
            wrs = rd.SendWRList(4)
            wrs.fill(rd.WR_RDMA_WRITE, mr, [0, 64, 128], 64, mr.addr + 4096, mr.rkey)
            add("wrs", wrs)
            qp.post_send_list(wrs)
        elif what == 6:
            wrs = pick("wrs", rng)
            if wrs is not None:
                qp.post_send(wrs)
        elif what == 7:
            ah = pick("ah", rng)
            qp.post_send(rd.SendWR(rd.WR_SEND, [rd.SGE(mr, 0, 8)], ah=ah, remote_qpn=qp.qp_num,
                                   remote_qkey=rd.DEFAULT_QKEY))
        else:
            srq = pick("srq", rng)
            if srq is not None:
                srq.post_recv_buf(mr, 0, 64)

    def op_poll(rng):
        cq = pick("cq", rng)
        if cq is None:
            return
        wcs = np.empty(16, rd.WC_DTYPE)
        what = rng.randrange(4)
        if what == 0:
            cq.poll_into(wcs)
        elif what == 1:
            try:
                cq.poll_wait(wcs, 1, timeout=rng.choice([0.0, 0.01, 0.2]))
            except rd.RDMATimeoutError:
                pass
        elif what == 2:
            cq.req_notify()
        else:
            cq.wait(timeout=rng.choice([0.0, 0.01, 0.2])) if cq.channel is not None else cq.poll(4)

    def op_query(rng):
        what = rng.randrange(3)
        if what == 0:
            ctx = pick("ctx", rng)
            if ctx is not None:
                ctx.query_port(1); ctx.gid_table(1)
        elif what == 1:
            qp = pick("qp", rng)
            if qp is not None:
                qp.query(); qp.endpoint()
        else:
            qp = pick("qp", rng)
            if qp is not None:
                rng.choice([qp.to_error, qp.to_reset])()

    def op_close(rng):
        kind = rng.choice(["ctx", "pd", "ch", "cq", "cq", "mr", "qp", "qp", "srq", "ah"])
        obj = pick(kind, rng)
        if obj is not None:
            obj.close()
            if rng.random() < 0.5:
                with lock:
                    if obj in pool[kind]:
                        pool[kind].remove(obj)

    OPS = ([op_ctx] + [op_pd] * 2 + [op_ch] + [op_cq] * 3 + [op_mr] * 3 + [op_srq] + [op_qp] * 3
           + [op_post] * 14 + [op_poll] * 8 + [op_query] * 3 + [op_close] * 5)

    def worker(index):
        rng = random.Random(seed * 1000 + index)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            op = rng.choice(OPS)
            try:
                op(rng)
                counts["ok"] += 1
            except rd.RDMAError:
                counts["rdma_error"] += 1
            except BaseException:
                unexpected.append(f"{op.__name__}: {traceback.format_exc()}")

    add("ctx", rd.Context())
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(nthreads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
        assert not t.is_alive(), "a worker hangs"
    with lock:
        for ctx in pool["ctx"]:
            ctx.close()
    for text in unexpected[:5]:
        print(text, file=sys.stderr)
    print(f"ops {counts['ok']} rdma_errors {counts['rdma_error']} unexpected {len(unexpected)}")
    sys.exit(1 if unexpected else 0)
''')


@pytest.mark.parametrize("seed", [1, 2])
def test_threads_open_use_close_in_random_order(seed):
    seconds = float(os.environ.get("PYRDMA_STRESS_SECONDS", "12"))
    proc = subprocess.run([sys.executable, "-c", WORKLOAD, str(seed), str(seconds), "4"],
                          capture_output=True, text=True, timeout=seconds + 240)
    assert proc.returncode >= 0, f"killed by signal {signal.Signals(-proc.returncode).name}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    ops = int(proc.stdout.split()[1])
    assert ops > 100, proc.stdout
