"""Asynchronous events, asyncio and memory windows (issue #18).

Device tests run on rxe0 in the Soft-RoCE VM; the port-event test makes its own rxe device on a
dummy netdev, so taking its link down disturbs nobody else.
"""
import asyncio
import os
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest

import pyrdma as rd
from pyrdma import aio

TIMEOUT = 10.0
device = pytest.mark.device


# ---- host: the fd waiter ----------------------------------------------------------------------------

def test_readable_wakes_every_waiter_and_cleans_up():
    r, w = os.pipe()
    try:
        async def main():
            loop = asyncio.get_running_loop()
            waiters = [asyncio.ensure_future(aio.readable(r)) for _ in range(3)]
            cancelled = asyncio.ensure_future(aio.readable(r))
            await asyncio.sleep(0.05)
            assert not any(t.done() for t in waiters)
            cancelled.cancel()
            await asyncio.sleep(0)
            loop.call_later(0.05, os.write, w, b"x")
            await asyncio.wait_for(asyncio.gather(*waiters), 5)
            assert cancelled.cancelled()
            assert aio._waiters == {}              # no reader left registered on the loop
            assert loop.remove_reader(r) is False
        asyncio.run(main())
    finally:
        os.close(r)
        os.close(w)


def test_cancelled_last_waiter_removes_the_reader():
    r, w = os.pipe()
    try:
        async def main():
            loop = asyncio.get_running_loop()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(aio.readable(r), 0.05)
            assert aio._waiters == {}
            assert loop.remove_reader(r) is False
        asyncio.run(main())
    finally:
        os.close(r)
        os.close(w)


# ---- device: helpers ----------------------------------------------------------------------------------

class Pair:
    """Two connected RC QPs on one device, each with its CQ; both CQs share one completion channel."""

    def __init__(self, ctx, size=4096, access=rd.ACCESS_ALL):
        self.pd = rd.ProtectionDomain(ctx)
        self.channel = rd.CompChannel(ctx)
        self.cq = [rd.CompletionQueue(ctx, 64, self.channel) for _ in range(2)]
        self.qp = [rd.QueuePair(self.pd, rd.QPT_RC, cq, max_send_wr=32, max_recv_wr=32) for cq in self.cq]
        self.buf = [np.zeros(size, np.uint8) for _ in range(2)]
        self.mr = [rd.MemoryRegion(self.pd, b, access) for b in self.buf]
        self.qp[0].connect(self.qp[1].endpoint())
        self.qp[1].connect(self.qp[0].endpoint())

    def close(self):
        self.pd.close()
        self.channel.close()


async def completions(cq, n):
    """The next ``n`` completions of ``cq``, awaited on its channel (checked: a failure raises)."""
    wcs = np.empty(n, rd.WC_DTYPE)
    got = 0
    while got < n:
        got += await aio.poll(cq, wcs[got:], check=True)
    return wcs


@pytest.fixture
def ctx():
    with rd.Context() as c:
        yield c


# ---- device: asyncio ---------------------------------------------------------------------------------

@device
def test_asyncio_write_ping_pong_and_send_recv_on_one_loop_without_threads(ctx):
    rounds = 20
    pp, sr = Pair(ctx), Pair(ctx)
    threads_before = threading.active_count()

    async def write_side(side):
        # RDMA WRITE WITH_IMM of byte r into the peer's byte 0; the peer's receive completion (imm r)
        # says it has landed, and the peer answers the same way
        me, peer_mr = pp.qp[side], pp.mr[1 - side]
        for r in range(1, rounds + 1):
            me.post_recv_buf(pp.mr[side], 0, 0, wr_id=r)
            if side == 1:
                wcs = await completions(pp.cq[1], 1)
                assert wcs[0]["opcode"] == rd.WC_RECV_RDMA_WITH_IMM and wcs[0]["imm_data"] == r
                assert pp.buf[1][0] == r
            pp.buf[side][8] = r
            me.post_write(pp.mr[side], 8, 1, peer_mr.addr, peer_mr.rkey, wr_id=r, imm=r)
            wcs = await completions(pp.cq[side], 2 if side == 0 else 1)
            if side == 0:
                recv = wcs[wcs["opcode"] == rd.WC_RECV_RDMA_WITH_IMM]
                assert len(recv) == 1 and recv[0]["imm_data"] == r and pp.buf[0][0] == r
        return rounds

    async def send_recv():
        payload = np.arange(256, dtype=np.uint8)
        sr.buf[0][:256] = payload
        for r in range(rounds):
            sr.qp[1].post_recv_buf(sr.mr[1], 0, 256, wr_id=1000 + r)
            sr.qp[0].post_send_buf(sr.mr[0], 0, 256, wr_id=r, imm=r)
            sent = await completions(sr.cq[0], 1)
            received = await completions(sr.cq[1], 1)
            assert sent[0]["wr_id"] == r and sent[0]["opcode"] == rd.WC_SEND
            assert received[0]["wr_id"] == 1000 + r and received[0]["byte_len"] == 256
            assert received[0]["imm_data"] == r
            assert np.array_equal(sr.buf[1][:256], payload)
            sr.buf[1][:256] = 0
        return rounds

    async def main():
        work = asyncio.gather(write_side(0), write_side(1), send_recv())
        return await asyncio.wait_for(work, 120)

    try:
        assert asyncio.run(main()) == [rounds, rounds, rounds]
        assert threading.active_count() == threads_before
    finally:
        pp.close()
        sr.close()


@device
def test_aio_poll_needs_a_channel(ctx):
    with rd.CompletionQueue(ctx, 4) as cq:
        with pytest.raises(rd.UsageError, match="CompChannel"):
            asyncio.run(aio.poll(cq, np.empty(2, rd.WC_DTYPE)))


# ---- device: memory windows ----------------------------------------------------------------------------

@device
@pytest.mark.parametrize("mw_type", [rd.MW_TYPE_1, rd.MW_TYPE_2])
def test_memory_window_grants_then_revokes_a_remote_write(ctx, mw_type):
    pd = rd.ProtectionDomain(ctx)
    try:
        cq = [rd.CompletionQueue(ctx, 16) for _ in range(2)]
        owner, writer = (rd.QueuePair(pd, rd.QPT_RC, c) for c in cq)
        owner.connect(writer.endpoint())
        writer.connect(owner.endpoint())
        target = np.zeros(4096, np.uint8)
        # no remote access on the MR itself: only the window grants it
        target_mr = rd.MemoryRegion(pd, target, rd.ACCESS_LOCAL_WRITE | rd.ACCESS_MW_BIND)
        src = np.arange(256, dtype=np.uint8) + 1
        src_mr = rd.MemoryRegion(pd, src, rd.ACCESS_LOCAL_WRITE)
        mw = rd.MemoryWindow(pd, mw_type)
        wcs = np.empty(4, rd.WC_DTYPE)

        rkey = owner.bind_mw(mw, target_mr, 1024, 1024, rd.ACCESS_REMOTE_WRITE, wr_id=7)
        assert cq[0].poll_wait(wcs, timeout=TIMEOUT, check=True) == 1
        assert wcs[0]["opcode"] == rd.WCOpcode.BIND_MW and wcs[0]["wr_id"] == 7
        assert rkey == mw.rkey and mw.bound_mr is target_mr and mw.length == 1024

        writer.post_write(src_mr, 0, 256, target_mr.addr + 1024, rkey, wr_id=1)
        assert cq[1].poll_wait(wcs, timeout=TIMEOUT, check=True) == 1
        assert np.array_equal(target[1024:1280], src) and not target[:1024].any()

        if mw_type == rd.MW_TYPE_1:
            owner.bind_mw(mw, None, wr_id=8)               # a bind of nothing unbinds a type 1 window
            expected = rd.WCOpcode.BIND_MW
        else:
            owner.post_local_invalidate(mw, wr_id=8)      # the window's rkey, and it is marked unbound
            expected = rd.WCOpcode.LOCAL_INV
        assert mw.bound_mr is None
        assert cq[0].poll_wait(wcs, timeout=TIMEOUT, check=True) == 1
        assert wcs[0]["opcode"] == expected and wcs[0]["wr_id"] == 8

        target[:] = 0
        writer.post_write(src_mr, 0, 256, target_mr.addr + 1024, rkey, wr_id=2)
        assert cq[1].poll_wait(wcs, timeout=TIMEOUT) == 1
        assert wcs[0]["status"] == rd.WC_REM_ACCESS_ERR, rd.wc_status_name(wcs[0]["status"])
        assert not target.any()
    finally:
        pd.close()


@device
def test_memory_window_misuse_is_refused_before_c(ctx):
    with rd.ProtectionDomain(ctx) as pd, rd.ProtectionDomain(ctx) as other, rd.CompletionQueue(ctx, 4) as cq:
        qp = rd.QueuePair(pd, rd.QPT_RC, cq)
        buf = np.zeros(64, np.uint8)
        plain = rd.MemoryRegion(pd, buf, rd.ACCESS_LOCAL_WRITE)
        mw = rd.MemoryWindow(pd, rd.MW_TYPE_2)
        with pytest.raises(rd.UsageError, match="RTS"):
            qp.bind_mw(mw, rd.MemoryRegion(pd, buf, rd.ACCESS_LOCAL_WRITE | rd.ACCESS_MW_BIND))
        qp.connect(qp.endpoint())
        with pytest.raises(rd.UsageError, match="ACCESS_MW_BIND"):
            qp.bind_mw(mw, plain)
        with pytest.raises(rd.UsageError, match="outside the MR"):
            qp.bind_mw(mw, rd.MemoryRegion(pd, buf, rd.ACCESS_LOCAL_WRITE | rd.ACCESS_MW_BIND), 32, 64)
        with pytest.raises(rd.UsageError, match="another protection domain"):
            qp.bind_mw(rd.MemoryWindow(other, rd.MW_TYPE_2), plain)
        with pytest.raises(rd.UsageError, match="post_local_invalidate"):
            qp.bind_mw(mw, None)
        with pytest.raises(rd.UsageError, match="type"):
            rd.MemoryWindow(pd, 3)
        with pytest.raises(rd.UsageError, match="32-bit rkey"):
            qp.post_local_invalidate(-1)
        # a bound window is the MR's child: deregistering the MR first closes the window
        bindable = rd.MemoryRegion(pd, buf, rd.ACCESS_LOCAL_WRITE | rd.ACCESS_MW_BIND)
        win = rd.MemoryWindow(pd, rd.MW_TYPE_2)
        qp.bind_mw(win, bindable, 0, 32)
        bindable.close()
        assert win.closed
        mw.close()
        with pytest.raises(rd.UsageError):
            mw.rkey


# ---- device: asynchronous events -----------------------------------------------------------------------

NETDEV, RXE = "pyrdma-ev0", "rxe_ev"     # sorts after rxe0, so default device choices are unchanged


def _sh(*argv):
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def own_rxe_device():
    """An rxe device on a dummy netdev of its own (root in the VM), removed afterwards."""
    if os.geteuid() != 0 or shutil.which("rdma") is None:
        pytest.fail("needs root and iproute2's rdma tool (the Soft-RoCE VM has both)")
    _sh("ip", "link", "add", NETDEV, "type", "dummy")
    try:
        _sh("ip", "addr", "add", "198.19.254.1/32", "dev", NETDEV)
        _sh("ip", "link", "set", NETDEV, "up")
        _sh("rdma", "link", "add", RXE, "type", "rxe", "netdev", NETDEV)
        state = f"/sys/class/infiniband/{RXE}/ports/1/state"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with open(state) as f:
                if "ACTIVE" in f.read():
                    break
            time.sleep(0.1)
        else:
            pytest.fail(f"{RXE} did not become ACTIVE")
        yield RXE
    finally:
        # in the background: a process that loaded librdmacm keeps every device it saw open until it
        # exits, and rxe cannot delete an open device before then
        subprocess.Popen(["sh", "-c", f"rdma link delete {RXE}; ip link delete {NETDEV}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _until(get, kind, deadline):
    seen = []
    while time.monotonic() < deadline:
        event = get()
        if event is not None:
            seen.append(event)
            if event.type == kind:
                return event, seen
    pytest.fail(f"no {kind.name} event before the deadline; saw {seen}")


@device
def test_port_down_and_up_under_a_live_qp_are_async_events(own_rxe_device):
    with rd.Context(own_rxe_device) as ctx:
        pd = rd.ProtectionDomain(ctx)
        cq = rd.CompletionQueue(ctx, 4)
        qp = rd.QueuePair(pd, rd.QPT_RC, cq)
        qp.connect(qp.endpoint())                       # a live QP in RTS on the port
        assert ctx.get_async_event(timeout=0) is None   # nothing yet

        _sh("ip", "link", "set", NETDEV, "down")
        started = time.monotonic()
        event, _ = _until(lambda: ctx.get_async_event(timeout=1.0), rd.AsyncEventType.PORT_ERR, started + 20)
        assert event.port == 1 and event.qp_num is None and "port" in event.description.lower()
        assert "PORT_ERR" in repr(event)
        assert ctx.query_port(1).state != rd.PORT_ACTIVE

        _sh("ip", "link", "set", NETDEV, "up")

        async def wait_active():
            deadline = time.monotonic() + 20
            while True:
                event = await asyncio.wait_for(aio.async_event(ctx), deadline - time.monotonic())
                if event.type == rd.AsyncEventType.PORT_ACTIVE:
                    return event
        event = asyncio.run(wait_active())
        assert event.port == 1
        qp.close()
        pd.close()


@device
def test_async_event_wait_is_woken_by_close_and_bounded_by_timeout(ctx):
    started = time.monotonic()
    assert ctx.get_async_event(timeout=0.3) is None
    assert 0.25 <= time.monotonic() - started < 5
    errors = []

    def blocked():
        try:
            ctx.get_async_event()
        except rd.UsageError as exc:
            errors.append(exc)

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.3)
    ctx.close()
    t.join(10)
    assert not t.is_alive() and errors and "closed" in str(errors[0])
    with pytest.raises(rd.UsageError):
        ctx.fileno()


# ---- device: the extended post API (ibv_wr_*) -----------------------------------------------------------

ALL_OPS = (rd.SendOps.RDMA_WRITE | rd.SendOps.RDMA_WRITE_WITH_IMM | rd.SendOps.SEND | rd.SendOps.SEND_WITH_IMM
           | rd.SendOps.RDMA_READ | rd.SendOps.ATOMIC_FETCH_AND_ADD | rd.SendOps.ATOMIC_CMP_AND_SWP
           | rd.SendOps.LOCAL_INV | rd.SendOps.BIND_MW)


@device
def test_wr_api_posts_every_opcode_in_one_batch(ctx):
    pd = rd.ProtectionDomain(ctx)
    try:
        cq = [rd.CompletionQueue(ctx, 64) for _ in range(2)]
        a = rd.QueuePairEx(pd, rd.QPT_RC, cq[0], send_ops=ALL_OPS, max_inline_data=64)
        b = rd.QueuePair(pd, rd.QPT_RC, cq[1])
        a.connect(b.endpoint())
        b.connect(a.endpoint())
        assert a.send_ops == ALL_OPS
        local = np.zeros(4096, np.uint8)
        remote = np.zeros(4096, np.uint8)
        lmr = rd.MemoryRegion(pd, local, rd.ACCESS_ALL)
        rmr = rd.MemoryRegion(pd, remote, rd.ACCESS_ALL | rd.ACCESS_MW_BIND)
        local[:256] = np.arange(256, dtype=np.uint8)
        remote[1024:1280] = 255 - np.arange(256, dtype=np.uint8)
        remote[2048:2056] = np.frombuffer(np.uint64(40).tobytes(), np.uint8)
        remote[2056:2064] = np.frombuffer(np.uint64(5).tobytes(), np.uint8)
        b.post_recv_buf(rmr, 0, 0, wr_id=103)          # receives are taken in order: the WRITE_WITH_IMM's first
        for i in range(3):
            b.post_recv_buf(rmr, 3072 + 128 * i, 128, wr_id=100 + i)

        with a.wr_batch():
            a.wr_rdma_write(rmr.rkey, rmr.addr, wr_id=1)
            a.wr_set_sge(lmr, 0, 256)
            a.wr_rdma_write(rmr.rkey, rmr.addr + 256, wr_id=2, imm=0xabcd)
            a.wr_set_sge(lmr, 0, 16)
            a.wr_rdma_read(rmr.rkey, rmr.addr + 1024, wr_id=3)
            a.wr_set_sge(lmr, 512, 256)
            a.wr_atomic_fetch_add(rmr.rkey, rmr.addr + 2048, 2, wr_id=4)
            a.wr_set_sge(lmr, 1024, 8)
            a.wr_atomic_cmp_swp(rmr.rkey, rmr.addr + 2056, 5, 77, wr_id=5)
            a.wr_set_sge(lmr, 1032, 8)
            a.wr_send(wr_id=6)
            a.wr_set_sge(lmr, 0, 100)
            a.wr_send(wr_id=7, imm=9, flags=rd.SEND_SIGNALED | rd.SEND_INLINE)
            a.wr_set_inline_data(b"inline!")
            a.wr_send(wr_id=8, flags=rd.SEND_SIGNALED | rd.SEND_INLINE)
            a.wr_set_inline_data(bytes(range(10, 42)))

        wcs = np.empty(16, rd.WC_DTYPE)
        got = 0
        while got < 8:
            got += cq[0].poll_wait(wcs[got:], timeout=TIMEOUT, check=True)
        assert sorted(wcs[:8]["wr_id"]) == list(range(1, 9))
        got = 0
        while got < 4:
            got += cq[1].poll_wait(wcs[got:], timeout=TIMEOUT, check=True)
        by_id = {int(w["wr_id"]): w for w in wcs[:4]}
        assert by_id[103]["imm_data"] == 0xabcd and by_id[101]["imm_data"] == 9
        assert np.array_equal(remote[:256], local[:256])
        assert np.array_equal(remote[256:272], local[:16])
        assert np.array_equal(local[512:768], 255 - np.arange(256, dtype=np.uint8))
        assert int(local[1024:1032].view(np.uint64)[0]) == 40 and int(remote[2048:2056].view(np.uint64)[0]) == 42
        assert int(local[1032:1040].view(np.uint64)[0]) == 5 and int(remote[2056:2064].view(np.uint64)[0]) == 77
        assert np.array_equal(remote[3072:3172], local[:100])
        assert bytes(remote[3200:3207]) == b"inline!"
        assert bytes(remote[3328:3360]) == bytes(range(10, 42))

        # a type 2 window bound and invalidated through the same API
        mw = rd.MemoryWindow(pd, rd.MW_TYPE_2)
        c = rd.QueuePairEx(pd, rd.QPT_RC, cq[1], send_ops=ALL_OPS)
        with pytest.raises(rd.UsageError, match="RTS"):
            c.wr_start()
        with a.wr_batch():
            rkey = a.wr_bind_mw(mw, rmr, 0, 512, rd.ACCESS_REMOTE_READ, wr_id=9)
            a.wr_local_inv(rkey, wr_id=10)
        got = 0
        while got < 2:
            got += cq[0].poll_wait(wcs[got:], timeout=TIMEOUT, check=True)
        assert list(wcs[:2]["opcode"]) == [rd.WCOpcode.BIND_MW, rd.WCOpcode.LOCAL_INV]
    finally:
        pd.close()


@device
def test_wr_api_misuse_is_refused_not_crashed(ctx):
    with rd.ProtectionDomain(ctx) as pd, rd.CompletionQueue(ctx, 16) as cq:
        plain = rd.QueuePair(pd, rd.QPT_RC, cq)
        assert not hasattr(plain, "wr_start")          # the ibv_wr_* API is QueuePairEx's alone
        with pytest.raises(rd.UsageError, match="SendOps"):
            rd.QueuePairEx(pd, rd.QPT_RC, cq, send_ops=1 << 40)
        with pytest.raises(rd.UsageError, match="SendOps"):
            rd.QueuePairEx(pd, rd.QPT_RC, cq, send_ops=0)
        qp = rd.QueuePairEx(pd, rd.QPT_RC, cq, send_ops=rd.SendOps.RDMA_WRITE, max_inline_data=16)
        qp.connect(qp.endpoint())
        buf = np.zeros(64, np.uint8)
        mr = rd.MemoryRegion(pd, buf, rd.ACCESS_ALL)
        with pytest.raises(rd.UsageError, match="wr_start"):
            qp.wr_rdma_write(mr.rkey, mr.addr)
        qp.wr_start()
        with pytest.raises(rd.UsageError, match="wr_start"):
            qp.wr_start()
        with pytest.raises(rd.UsageError, match="RDMA_READ"):      # an op the QP was not created with
            qp.wr_rdma_read(mr.rkey, mr.addr)
        with pytest.raises(rd.UsageError, match="must follow"):
            qp.wr_set_sge(mr, 0, 8)
        qp.wr_rdma_write(mr.rkey, mr.addr)
        with pytest.raises(rd.UsageError, match="no data"):
            qp.wr_rdma_write(mr.rkey, mr.addr)
        with pytest.raises(rd.UsageError, match="outside the MR"):
            qp.wr_set_sge(mr, 60, 8)
        with pytest.raises(rd.UsageError, match="SEND_INLINE"):
            qp.wr_set_inline_data(bytes(8))            # the operation was not flagged inline
        with pytest.raises(rd.UsageError, match="no data"):
            qp.wr_complete()
        qp.wr_start()
        qp.wr_rdma_write(mr.rkey, mr.addr, flags=rd.SEND_SIGNALED | rd.SEND_INLINE)
        with pytest.raises(rd.UsageError, match="SEND_INLINE"):
            qp.wr_set_sge(mr, 0, 8)                    # inline-flagged: the data must come inline
        with pytest.raises(rd.UsageError, match="max_inline_data"):
            qp.wr_set_inline_data(bytes(qp.max_inline_data + 1))
        with pytest.raises(rd.UsageError, match="no data"):
            qp.wr_complete()                           # aborts the batch: nothing is posted
        with pytest.raises(rd.UsageError, match="without wr_start"):
            qp.wr_complete()
        with pytest.raises(ZeroDivisionError):
            with qp.wr_batch():
                qp.wr_rdma_write(mr.rkey, mr.addr + 32)
                qp.wr_set_sge(mr, 0, 8)
                1 / 0                                  # the batch is aborted, not posted
        assert cq.poll_into(np.empty(4, rd.WC_DTYPE)) == 0
        qp.wr_start()
        qp.wr_rdma_write(mr.rkey, mr.addr + 32)
        qp.close()                                      # closing with a batch open aborts it
        with pytest.raises(rd.UsageError, match="closed"):
            qp.wr_start()
        with pytest.raises(rd.UsageError, match="without wr_start"):
            qp.wr_complete()


# ---- device: on-demand paging ---------------------------------------------------------------------------

@device
def test_odp_capability_is_reported_and_registration_follows_it(ctx):
    odp = ctx.query_odp()
    assert isinstance(odp.supported, bool) and set(odp.rc) <= {"send", "recv", "write", "read", "atomic", "srq_recv"}
    buf = np.zeros(8192, np.uint8)
    with rd.ProtectionDomain(ctx) as pd:
        if not odp.supported:
            # rxe before Linux 6.13 has no ODP: the registration says so instead of failing in the kernel
            with pytest.raises(rd.UsageError, match="on-demand paging"):
                rd.MemoryRegion(pd, buf, rd.ACCESS_LOCAL_WRITE | rd.ACCESS_ON_DEMAND)
            return
        pair_cq = rd.CompletionQueue(ctx, 4)
        qp = rd.QueuePair(pd, rd.QPT_RC, pair_cq)
        qp.connect(qp.endpoint())
        odp_mr = rd.MemoryRegion(pd, buf, rd.ACCESS_ALL | rd.ACCESS_ON_DEMAND)
        src = np.arange(4096, dtype=np.uint8)
        src_mr = rd.MemoryRegion(pd, src, rd.ACCESS_LOCAL_WRITE)
        qp.post_write(src_mr, 0, 4096, odp_mr.addr + 4096, odp_mr.rkey)
        assert pair_cq.poll_wait(np.empty(2, rd.WC_DTYPE), timeout=TIMEOUT, check=True) == 1
        assert np.array_equal(buf[4096:], src)
