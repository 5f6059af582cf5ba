"""Verbs binding on a real device (rxe0 in the Soft-RoCE VM): every opcode, data checked byte for byte."""
import os
import select

import numpy as np
import pytest

import pyrdma as rd

pytestmark = pytest.mark.device
TIMEOUT = 10.0


@pytest.fixture
def ctx():
    with rd.Context() as c:
        yield c


class LoopbackPair:
    """Two connected QPs of one type on one device, each with its own CQ and a 64 KiB MR."""

    def __init__(self, ctx, qp_type=rd.QPT_RC, size=65536, **qp_kwargs):
        self.pd = rd.ProtectionDomain(ctx)
        self.cq = [rd.CompletionQueue(ctx, 256) for _ in range(2)]
        self.qp = [rd.QueuePair(self.pd, qp_type, cq, **qp_kwargs) for cq in self.cq]
        self.buf = [np.zeros(size, np.uint8) for _ in range(2)]
        self.mr = [rd.MemoryRegion(self.pd, b, rd.ACCESS_ALL) for b in self.buf]
        ep = [q.endpoint(mr=m) for q, m in zip(self.qp, self.mr)]
        if qp_type == rd.QPT_UD:
            for q in self.qp:
                q.connect()
        else:
            self.qp[0].connect(ep[1])
            self.qp[1].connect(ep[0])
        self.wcs = np.empty(64, rd.WC_DTYPE)

    def wait(self, side, n=1):
        got = 0
        out = []
        while got < n:
            k = self.cq[side].poll_wait(self.wcs, 1, timeout=TIMEOUT)
            out.append(self.wcs[:k].copy())
            got += k
        wcs = np.concatenate(out)
        rd.check_wcs(wcs)
        return wcs


@pytest.fixture
def rc(ctx):
    pair = LoopbackPair(ctx, max_inline_data=64, max_send_sge=4, max_recv_sge=4)
    yield pair
    pair.pd.close()


def test_device_queries(ctx):
    names = [d.name for d in rd.get_device_list()]
    assert ctx.name in names
    attr = ctx.query_device()
    assert attr.max_qp > 0 and attr.max_cqe > 0 and attr.phys_port_cnt >= 1
    port = ctx.query_port(1)
    assert port.state == rd.PORT_ACTIVE and port.state_name == "active"
    assert port.active_mtu_bytes == rd.mtu_to_bytes(port.active_mtu)
    assert port.link_layer in ("Ethernet", "InfiniBand")
    table = ctx.gid_table(1)
    best = ctx.best_gid_index(1)
    assert best in [e.index for e in table]
    entry = next(e for e in table if e.index == best)
    assert ctx.query_gid(1, best) == entry.gid
    if port.link_layer == "Ethernet":
        assert entry.gid_type == "RoCEv2"
        # every RoCE GID names its netdev (rxe0's is lo), and both GID types of an address are listed
        netdevs = {e.netdev for e in table}
        assert None not in netdevs and all(os.path.exists(f"/sys/class/net/{n}") for n in netdevs)
        assert {e.gid_type for e in table if e.gid == entry.gid} >= {"RoCEv2"}
        assert f"netdev={entry.netdev!r}" in repr(entry)
    with pytest.raises(rd.UsageError, match="port 9"):
        ctx.query_port(9)
    with pytest.raises(rd.RDMAError, match="no RDMA device named"):
        rd.Context("no_such_dev0")


def test_mr_registration(ctx):
    with rd.ProtectionDomain(ctx) as pd:
        arr = np.arange(100, dtype=np.int32)
        mr = rd.MemoryRegion(pd, arr, rd.ACCESS_ALL)
        assert mr.addr == arr.ctypes.data and mr.length == arr.nbytes
        assert mr.lkey and mr.rkey
        view = mr.array(np.int32)
        view[5] = -7
        assert arr[5] == -7
        ba = bytearray(4096)
        mr2 = rd.MemoryRegion(pd, ba)
        with pytest.raises(BufferError):
            ba.extend(b"x")   # registered memory cannot move
        mr2.close()
        ba.extend(b"x")       # released on close
        alloc = rd.MemoryRegion.allocate(pd, 10000, rd.ACCESS_LOCAL_WRITE)
        assert alloc.addr % 4096 == 0 and alloc.length == 10000
        assert not alloc.array().any()
        with pytest.raises(rd.UsageError, match="not C-contiguous"):
            rd.MemoryRegion(pd, np.zeros((10, 10))[:, 0])
        with pytest.raises(rd.UsageError, match="read-only"):
            rd.MemoryRegion(pd, b"immutable bytes", rd.ACCESS_LOCAL_WRITE)
        ro = rd.MemoryRegion(pd, b"immutable bytes", 0)   # read-only registration is fine
        assert ro.length == 15
        with pytest.raises(rd.UsageError, match="require ACCESS_LOCAL_WRITE"):
            rd.MemoryRegion(pd, arr, rd.ACCESS_REMOTE_WRITE)
        with pytest.raises(rd.UsageError, match="empty"):
            rd.MemoryRegion(pd, bytearray())
        with pytest.raises(rd.UsageError, match="buffer protocol"):
            rd.MemoryRegion(pd, [1, 2, 3])


def test_rdma_write_and_imm(rc):
    src, dst = rc.buf
    src[:] = np.random.default_rng(1).integers(0, 256, src.size, dtype=np.uint8)
    rc.qp[0].post_write(rc.mr[0], 100, 5000, rc.mr[1].addr + 200, rc.mr[1].rkey, wr_id=11)
    wc = rc.wait(0)
    assert wc["wr_id"][0] == 11 and wc["opcode"][0] == rd.WC_RDMA_WRITE
    assert np.array_equal(dst[200:5200], src[100:5100])
    assert not dst[:200].any() and not dst[5200:].any()
    # WRITE_WITH_IMM consumes a receive on the target and carries the immediate.
    rc.qp[1].post_recv_buf(rc.mr[1], 0, 0, wr_id=99)
    rc.qp[0].post_write(rc.mr[0], 0, 64, rc.mr[1].addr + 8192, rc.mr[1].rkey, wr_id=12, imm=0xDEADBEEF)
    rc.wait(0)
    wc = rc.wait(1)
    assert wc["opcode"][0] == rd.WC_RECV_RDMA_WITH_IMM and wc["imm_data"][0] == 0xDEADBEEF
    assert wc["wc_flags"][0] & rd.WC_WITH_IMM and wc["wr_id"][0] == 99
    assert np.array_equal(dst[8192:8256], src[:64])


def test_rdma_read(rc):
    rc.buf[1][:4096] = np.arange(4096) % 251
    rc.qp[0].post_read(rc.mr[0], 10, 4096, rc.mr[1].addr, rc.mr[1].rkey, wr_id=3)
    wc = rc.wait(0)
    assert wc["opcode"][0] == rd.WC_RDMA_READ and wc["byte_len"][0] == 4096
    assert np.array_equal(rc.buf[0][10:4106], rc.buf[1][:4096])


def test_send_recv_imm_inline_solicited(rc):
    rc.buf[0][:300] = np.arange(300) % 256
    for i in range(3):
        rc.qp[1].post_recv_buf(rc.mr[1], 1000 * i, 1000, wr_id=i)
    rc.qp[0].post_send_buf(rc.mr[0], 0, 300, wr_id=1)
    rc.qp[0].post_send_buf(rc.mr[0], 0, 40, wr_id=2, imm=7, inline=True)
    rc.qp[0].post_send_buf(rc.mr[0], 0, 10, wr_id=3, solicited=True)
    rc.wait(0, 3)
    wcs = rc.wait(1, 3)
    assert list(wcs["wr_id"]) == [0, 1, 2]
    assert list(wcs["byte_len"]) == [300, 40, 10]
    assert wcs["opcode"][1] == rd.WC_RECV and wcs["imm_data"][1] == 7
    assert np.array_equal(rc.buf[1][:300], rc.buf[0][:300])
    assert np.array_equal(rc.buf[1][1000:1040], rc.buf[0][:40])
    with pytest.raises(rd.UsageError, match="max_inline_data"):
        rc.qp[0].post_send_buf(rc.mr[0], 0, 10_000, inline=True)


def test_sge_lists_gather_scatter(rc):
    src = rc.buf[0]
    src[:30] = np.arange(30)
    gather = [rd.SGE(rc.mr[0], 0, 10), rd.SGE(rc.mr[0], 20, 10)]
    scatter = [rd.SGE(rc.mr[1], 500, 5), rd.SGE(rc.mr[1], 600, 15)]
    rc.qp[1].post_recv(rd.RecvWR(scatter, wr_id=5))
    rc.qp[0].post_send(rd.SendWR(rd.WR_SEND, gather, wr_id=6))
    rc.wait(0)
    assert rc.wait(1)["byte_len"][0] == 20
    expected = np.concatenate([np.arange(10), np.arange(20, 30)]).astype(np.uint8)
    assert np.array_equal(np.concatenate([rc.buf[1][500:505], rc.buf[1][600:615]]), expected)
    with pytest.raises(rd.UsageError, match="outside the MR"):
        rd.SGE(rc.mr[0], 65530, 100)


def test_atomics(rc):
    remote = rc.mr[1].array(np.uint64)
    local = rc.mr[0].array(np.uint64)
    remote[0] = 40
    rc.qp[0].post_atomic_fetch_add(rc.mr[0], 0, rc.mr[1].addr, rc.mr[1].rkey, 2, wr_id=1)
    assert rc.wait(0)["opcode"][0] == rd.WC_FETCH_ADD
    assert local[0] == 40 and remote[0] == 42
    rc.qp[0].post_atomic_cmp_swap(rc.mr[0], 8, rc.mr[1].addr, rc.mr[1].rkey, 42, 1000, wr_id=2)
    assert rc.wait(0)["opcode"][0] == rd.WC_COMP_SWAP
    assert local[1] == 42 and remote[0] == 1000
    rc.qp[0].post_atomic_cmp_swap(rc.mr[0], 16, rc.mr[1].addr, rc.mr[1].rkey, 1, 5)   # compare fails
    rc.wait(0)
    assert local[2] == 1000 and remote[0] == 1000
    wr = rd.SendWR(rd.WR_ATOMIC_FETCH_AND_ADD, [rd.SGE(rc.mr[0], 24, 8)], remote_addr=rc.mr[1].addr,
                   rkey=rc.mr[1].rkey, compare_add=1)
    rc.qp[0].post_send(wr)
    rc.wait(0)
    assert local[3] == 1000 and remote[0] == 1001
    with pytest.raises(rd.UsageError, match="aligned"):
        rc.qp[0].post_atomic_fetch_add(rc.mr[0], 3, rc.mr[1].addr, rc.mr[1].rkey, 1)


def test_batched_wr_list_and_fence(rc):
    n = 32
    rc.buf[0][:n * 128] = np.arange(n * 128) % 256
    wrs = rd.SendWRList(64)
    offsets = np.arange(n) * 128
    flags = np.where(np.arange(n) == n - 1, rd.SEND_SIGNALED, 0)
    wrs.fill(rd.WR_RDMA_WRITE, rc.mr[0], offsets, 128, rc.mr[1].addr + offsets, rc.mr[1].rkey,
             wr_ids=np.arange(n) + 100, flags=flags)
    assert len(wrs) == n
    rc.qp[0].post_send_list(wrs)
    wc = rc.wait(0)
    assert wc["wr_id"][0] == 100 + n - 1
    assert np.array_equal(rc.buf[1][:n * 128], rc.buf[0][:n * 128])
    # A fenced READ after a WRITE sees the written data.
    chain = [rd.SendWR(rd.WR_RDMA_WRITE, [rd.SGE(rc.mr[0], 0, 8)], remote_addr=rc.mr[1].addr + 60000,
                       rkey=rc.mr[1].rkey, flags=0),
             rd.SendWR(rd.WR_RDMA_READ, [rd.SGE(rc.mr[0], 50000, 8)], remote_addr=rc.mr[1].addr + 60000,
                       rkey=rc.mr[1].rkey, flags=rd.SEND_SIGNALED | rd.SEND_FENCE, wr_id=9)]
    rc.qp[0].post_send(chain)
    rc.wait(0)
    assert np.array_equal(rc.buf[0][50000:50008], rc.buf[0][:8])
    recvs = rd.RecvWRList(8)
    recvs.fill(rc.mr[1], np.arange(8) * 100, 100)
    rc.qp[1].post_recv_list(recvs)
    sends = rd.SendWRList(8)
    sends.fill(rd.WR_SEND, rc.mr[0], np.arange(8) * 10, 10)
    rc.qp[0].post_send(sends)
    rc.wait(0, 8)
    assert list(rc.wait(1, 8)["wr_id"]) == list(range(8))


def test_error_completions(rc):
    rc.qp[0].post_write(rc.mr[0], 0, 16, rc.mr[1].addr, rc.mr[1].rkey ^ 0xFF00, wr_id=1)
    k = rc.cq[0].poll_wait(rc.wcs, 1, timeout=TIMEOUT)
    assert rd.wc_status_name(int(rc.wcs[0]["status"])) == "REM_ACCESS_ERR"
    with pytest.raises(rd.CompletionError) as info:
        rd.check_wcs(rc.wcs[:k])
    assert info.value.status_name == "REM_ACCESS_ERR" and info.value.wr_id == 1
    assert rc.qp[0].query().state == rd.QPS_ERR
    # A QP in ERR flushes everything posted to it.
    rc.qp[0].post_send_buf(rc.mr[0], 0, 8, wr_id=2)
    k = rc.cq[0].poll_wait(rc.wcs, 1, timeout=TIMEOUT)
    assert rc.wcs[0]["status"] == rd.WC_WR_FLUSH_ERR and rc.wcs[0]["wr_id"] == 2
    # Receives outstanding when a QP moves to ERR are flushed.
    rc.qp[1].post_recv_buf(rc.mr[1], 0, 8, wr_id=3)
    rc.qp[1].to_error()
    k = rc.cq[1].poll_wait(rc.wcs, 1, timeout=TIMEOUT)
    assert rc.wcs[0]["status"] == rd.WC_WR_FLUSH_ERR and rc.wcs[0]["wr_id"] == 3
    with pytest.raises(rd.CompletionError, match="WR_FLUSH_ERR"):
        rd.check_wcs(rc.wcs[:k])


def test_state_machine_and_usage_errors(ctx):
    with rd.ProtectionDomain(ctx) as pd:
        cq = rd.CompletionQueue(ctx, 16)
        qp = rd.QueuePair(pd, rd.QPT_RC, cq)
        mr = rd.MemoryRegion.allocate(pd, 64, rd.ACCESS_ALL)
        assert qp.state == rd.QPS_RESET and qp.query().state_name == "RESET"
        with pytest.raises(rd.UsageError, match="RESET"):
            qp.post_send_buf(mr, 0, 8)
        with pytest.raises(rd.UsageError, match="RESET"):
            qp.post_recv_buf(mr, 0, 8)
        with pytest.raises(rd.UsageError, match="needs a QP in INIT"):
            qp.to_rtr(qp.endpoint())
        qp.to_init()
        assert qp.query().state_name == "INIT"
        qp.post_recv_buf(mr, 0, 8)       # receives may be posted from INIT
        with pytest.raises(rd.UsageError, match="Endpoint"):
            qp.to_rtr(None)
        with pytest.raises(rd.UsageError, match=r"min_rnr_timer must be within 0\.\.31, got 32"):
            qp.to_rtr(qp.endpoint(), min_rnr_timer=32)
        qp.to_rtr(qp.endpoint())         # loop back to itself
        # attribute bit fields: out-of-range values are refused, not cut, and the QP stays in RTR
        for bad, match in (({"timeout": 32}, r"timeout must be within 0\.\.31, got 32"),
                           ({"timeout": -1}, r"timeout must be within 0\.\.31, got -1"),
                           ({"retry_cnt": 8}, r"retry_cnt must be within 0\.\.7"),
                           ({"rnr_retry": 9}, r"rnr_retry must be within 0\.\.7")):
            with pytest.raises(rd.UsageError, match=match):
                qp.to_rts(**bad)
        assert qp.query().state_name == "RTR"
        qp.to_rts(timeout=20)
        assert qp.query().timeout == 20
        assert qp.query().state_name == "RTS"
        qp.to_reset()
        assert qp.query().state_name == "RESET"
        with pytest.raises(rd.UsageError, match=r"retry_cnt must be within 0\.\.7, got 8"):
            qp.connect(qp.endpoint(), retry_cnt=8)
        assert qp.query().state_name == "RESET"         # refused before the first transition
        qp.connect(qp.endpoint())
        assert qp.state == rd.QPS_RTS
        with pytest.raises(rd.UsageError, match="outside"):
            rd.QueuePair(pd, rd.QPT_RC, cq, max_send_wr=10**9)
        with pytest.raises(rd.UsageError, match="unsupported qp_type"):
            rd.QueuePair(pd, 77, cq)
        with pytest.raises(rd.UsageError, match="WC_DTYPE"):
            cq.poll_into(np.zeros(4))
        with pytest.raises(rd.UsageError, match="imm_data"):
            rd.SendWR(rd.WR_SEND_WITH_IMM)
        with pytest.raises(rd.RDMATimeoutError):
            cq.poll_wait(np.empty(4, rd.WC_DTYPE), 1, timeout=0.05)


def test_completion_channel_wait(ctx):
    with rd.ProtectionDomain(ctx) as pd:
        ch = rd.CompChannel(ctx)
        cq = rd.CompletionQueue(ctx, 16, channel=ch)
        qp = rd.QueuePair(pd, rd.QPT_RC, cq)
        qp.connect(qp.endpoint())
        mr = rd.MemoryRegion.allocate(pd, 64, rd.ACCESS_ALL)
        cq.req_notify()
        assert cq.wait(timeout=0.05) is False
        assert select.select([ch], [], [], 0)[0] == []
        qp.post_write(mr, 0, 8, mr.addr + 8, mr.rkey)
        assert select.select([ch.fileno()], [], [], TIMEOUT)[0]
        assert cq.wait(timeout=TIMEOUT) is True
        assert len(cq.poll(4)) == 1
        with pytest.raises(rd.UsageError, match="CompChannel"):
            rd.CompletionQueue(ctx, 4).wait(0.01)


def test_ud_send_recv(ctx):
    pair = LoopbackPair(ctx, rd.QPT_UD)
    try:
        ah = rd.AddressHandle(pair.pd, pair.qp[1].endpoint())
        payload = np.frombuffer(b"hello over UD!", np.uint8)
        pair.buf[0][:payload.size] = payload
        pair.qp[1].post_recv_buf(pair.mr[1], 0, rd.UD_GRH_BYTES + 256, wr_id=1)
        pair.qp[0].post_send_buf(pair.mr[0], 0, payload.size, ah=ah, remote_qpn=pair.qp[1].qp_num, wr_id=2)
        pair.wait(0)
        wc = pair.wait(1)
        assert wc["byte_len"][0] == rd.UD_GRH_BYTES + payload.size
        assert wc["src_qp"][0] == pair.qp[0].qp_num
        got = pair.buf[1][rd.UD_GRH_BYTES:rd.UD_GRH_BYTES + payload.size]
        assert got.tobytes() == b"hello over UD!"
        with pytest.raises(rd.UsageError, match="AddressHandle"):
            pair.qp[0].post_send_buf(pair.mr[0], 0, 4)
        with pytest.raises(rd.UsageError, match="RC QP"):
            pair.qp[0].post_read(pair.mr[0], 0, 4, pair.mr[1].addr, pair.mr[1].rkey)
    finally:
        pair.pd.close()


def test_uc_write(ctx):
    pair = LoopbackPair(ctx, rd.QPT_UC)
    try:
        pair.buf[0][:100] = 9
        pair.qp[0].post_write(pair.mr[0], 0, 100, pair.mr[1].addr, pair.mr[1].rkey)
        pair.wait(0)
        assert (pair.buf[1][:100] == 9).all()
    finally:
        pair.pd.close()


def test_srq_shared_by_two_qps(ctx):
    with rd.ProtectionDomain(ctx) as pd:
        cq = rd.CompletionQueue(ctx, 64)
        srq = rd.SharedReceiveQueue(pd, max_wr=16)
        servers = [rd.QueuePair(pd, rd.QPT_RC, cq, srq=srq) for _ in range(2)]
        clients = [rd.QueuePair(pd, rd.QPT_RC, cq) for _ in range(2)]
        for s, c in zip(servers, clients):
            s.connect(c.endpoint())
            c.connect(s.endpoint())
        buf = rd.MemoryRegion.allocate(pd, 4096, rd.ACCESS_ALL)
        buf.array()[:2] = [1, 2]
        for i in range(4):
            srq.post_recv_buf(buf, 1024 + 256 * i, 256, wr_id=10 + i)
        with pytest.raises(rd.UsageError, match="SRQ"):
            servers[0].post_recv_buf(buf, 0, 8)
        clients[0].post_send_buf(buf, 0, 1, wr_id=1)
        clients[1].post_send_buf(buf, 1, 1, wr_id=2)
        wcs = np.empty(16, rd.WC_DTYPE)
        seen = []
        while len(seen) < 4:
            k = cq.poll_wait(wcs, 1, timeout=TIMEOUT)
            rd.check_wcs(wcs[:k])
            seen.extend(wcs[:k].tolist())
        recvs = [w for w in seen if w[2] == rd.WC_RECV]
        assert sorted(w[6] for w in recvs) == sorted(s.qp_num for s in servers)
        got = {w[6]: buf.array()[1024 + 256 * (w[0] - 10)] for w in recvs}
        assert got == {servers[0].qp_num: 1, servers[1].qp_num: 2}


def test_completion_channel_with_asyncio(ctx):
    import asyncio

    with rd.ProtectionDomain(ctx) as pd:
        ch = rd.CompChannel(ctx)
        cq = rd.CompletionQueue(ctx, 16, channel=ch)
        qp = rd.QueuePair(pd, rd.QPT_RC, cq)
        qp.connect(qp.endpoint())
        mr = rd.MemoryRegion.allocate(pd, 64, rd.ACCESS_ALL)

        async def write_and_await():
            loop = asyncio.get_running_loop()
            ready = asyncio.Event()
            loop.add_reader(ch.fileno(), ready.set)
            try:
                cq.req_notify()
                qp.post_write(mr, 0, 8, mr.addr + 8, mr.rkey, wr_id=77)
                await asyncio.wait_for(ready.wait(), TIMEOUT)
                assert cq.wait(timeout=0) is True   # consume and ack the event
                return cq.poll(4)
            finally:
                loop.remove_reader(ch.fileno())

        wcs = asyncio.run(write_and_await())
        assert list(wcs["wr_id"]) == [77]
