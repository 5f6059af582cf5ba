"""The completion idiom the README teaches: poll_wait/poll_into(check=True) and check_wcs, whose
status scan runs in C. Host tests on fabricated completion arrays; device tests on real failures."""
import time

import numpy as np
import pytest

import pyrdma as rd


def _wcs(statuses):
    wcs = np.zeros(len(statuses), rd.WC_DTYPE)
    wcs["status"] = statuses
    wcs["wr_id"] = np.arange(len(statuses)) + 100
    wcs["qp_num"] = 7
    return wcs


def test_check_wcs_names_the_first_failed_entry_within_n():
    wcs = _wcs([rd.WC_SUCCESS, rd.WC_SUCCESS, rd.WC_REM_ACCESS_ERR, rd.WC_WR_FLUSH_ERR])
    rd.check_wcs(wcs, 2)                       # the failure lies beyond n
    with pytest.raises(rd.CompletionError) as info:
        rd.check_wcs(wcs)
    exc = info.value
    assert (exc.status, exc.status_name, exc.wr_id, exc.qp_num, exc.polled) == \
        (rd.WC_REM_ACCESS_ERR, "REM_ACCESS_ERR", 102, 7, 4)
    assert "remote access error" in str(exc)
    with pytest.raises(rd.CompletionError, match="wr_id=102"):
        rd.check_wcs(wcs[1:])                  # a contiguous slice works as before
    rd.check_wcs(wcs, 0)
    rd.check_wcs(_wcs([]))


def test_check_wcs_refuses_what_is_not_a_completion_array():
    with pytest.raises(rd.UsageError, match="WC_DTYPE"):
        rd.check_wcs(np.zeros(4, np.uint32))
    with pytest.raises(rd.UsageError, match="C-contiguous"):
        rd.check_wcs(_wcs([0, 0, 0, 0])[::2])
    wcs = _wcs([rd.WC_SUCCESS, rd.WC_GENERAL_ERR])
    wcs.flags.writeable = False                # checking only reads
    with pytest.raises(rd.CompletionError):
        rd.check_wcs(wcs)


def test_check_wcs_costs_less_than_a_microsecond():
    # a guard against a return to numpy operations (several microseconds), not a benchmark: the
    # bound is loose enough for a loaded machine
    wcs = _wcs([rd.WC_SUCCESS] * 16)
    check = rd.check_wcs
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(20000):
            check(wcs, 16)
        best = min(best, (time.perf_counter() - t0) / 20000)
    assert best < 1e-6, f"check_wcs took {best * 1e9:.0f} ns"


@pytest.mark.device
@pytest.mark.parametrize("call", ["poll_wait", "poll_into"])
def test_check_true_raises_the_failed_completion(call):
    with rd.Context() as ctx:
        pd = rd.ProtectionDomain(ctx)
        cq = rd.CompletionQueue(ctx, 16)
        src = np.arange(64, dtype=np.uint8)
        dst = np.zeros(64, np.uint8)
        src_mr = rd.MemoryRegion(pd, src)
        dst_mr = rd.MemoryRegion(pd, dst, rd.ACCESS_LOCAL_WRITE | rd.ACCESS_REMOTE_WRITE)
        a, b = rd.QueuePair(pd, rd.QPT_RC, cq), rd.QueuePair(pd, rd.QPT_RC, cq)
        a.connect(b.endpoint())
        b.connect(a.endpoint())
        wcs = np.zeros(8, rd.WC_DTYPE)
        a.post_write(src_mr, 0, 64, dst_mr.addr, dst_mr.rkey, wr_id=1)
        assert cq.poll_wait(wcs, timeout=10, check=True) == 1 and np.array_equal(src, dst)
        a.post_write(src_mr, 0, 64, dst_mr.addr, dst_mr.rkey ^ 0x5A5A, wr_id=2)    # a wrong rkey
        with pytest.raises(rd.CompletionError) as info:
            if call == "poll_wait":
                cq.poll_wait(wcs, timeout=30, check=True)
            else:
                deadline = time.monotonic() + 30
                while not cq.poll_into(wcs, check=True):
                    assert time.monotonic() < deadline, "no completion within 30 s"
        exc = info.value
        assert exc.status == rd.WC_REM_ACCESS_ERR and exc.wr_id == 2 and exc.polled >= 1
        assert wcs[0]["wr_id"] == 2            # the entry is still there for the caller


def test_constants_are_int_enums_with_names():
    assert repr(rd.WC_REM_ACCESS_ERR) == "<WCStatus.REM_ACCESS_ERR: 10>" and rd.WC_REM_ACCESS_ERR == 10
    assert rd.WCStatus(5) is rd.WC_WR_FLUSH_ERR and rd.wc_status_name(5) == "WR_FLUSH_ERR"
    assert rd.wc_status_name(999) == "STATUS_999" and rd.wc_opcode_name(1) == "RDMA_WRITE"
    assert rd.ACCESS_ALL == rd.Access.LOCAL_WRITE | rd.Access.REMOTE_WRITE | rd.Access.REMOTE_READ | \
        rd.Access.REMOTE_ATOMIC == 15
    assert "REMOTE_READ" in repr(rd.ACCESS_REMOTE_READ | rd.ACCESS_LOCAL_WRITE)
    assert (rd.QPT_RC, rd.QPS_RTS, rd.MTU_4096, rd.PORT_ACTIVE) == (2, 3, 5, 4)
    assert rd.WR_SEND_WITH_IMM.name == "SEND_WITH_IMM" and rd.SEND_SIGNALED | rd.SEND_INLINE == 10
    assert f"{rd.WC_SUCCESS}" == "0" and rd.mtu_to_bytes(rd.MTU_1024) == 1024   # still plain ints in C calls
    wcs = _wcs([rd.WC_SUCCESS])
    assert wcs["status"][0] == rd.WCStatus.SUCCESS


# ---- the extended CQ (ibv_create_cq_ex, polled with ibv_start_poll/next_poll/end_poll) -------------

def _traffic(cq, post_failure=True, stamps=None):
    """An RC pair on ``cq``: a WRITE_WITH_IMM (the receiver's completion carries the immediate), a
    SEND of 40 bytes, and a WRITE with a wrong rkey. Returns the successful completions (sorted by
    wr_id, as records) and the failed one's CompletionError."""
    ctx = cq.context
    pd = rd.ProtectionDomain(ctx)
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, np.uint8)
    src_mr = rd.MemoryRegion(pd, src)
    dst_mr = rd.MemoryRegion(pd, dst, rd.ACCESS_LOCAL_WRITE | rd.ACCESS_REMOTE_WRITE)
    a, b = rd.QueuePair(pd, rd.QPT_RC, cq), rd.QueuePair(pd, rd.QPT_RC, cq)
    a.connect(b.endpoint())
    b.connect(a.endpoint())
    b.post_recv_buf(dst_mr, 0, 64, wr_id=10)
    b.post_recv_buf(dst_mr, 0, 64, wr_id=11)
    a.post_write(src_mr, 0, 64, dst_mr.addr, dst_mr.rkey, wr_id=1, imm=0xC0FFEE)
    a.post_send_buf(src_mr, 0, 40, wr_id=2)
    wcs = np.zeros(8, rd.WC_DTYPE)
    ts = np.zeros(8, np.uint64) if stamps is not None else None
    got = []
    deadline = time.monotonic() + 30
    while len(got) < 4:
        assert time.monotonic() < deadline, f"only {len(got)} of 4 completions"
        n = cq.poll_wait(wcs, timeout=30, check=True, timestamps=ts)
        got.extend(wcs[:n].copy())
        if ts is not None:
            stamps.extend(int(t) for t in ts[:n])
    assert np.array_equal(src, dst)
    exc = None
    if post_failure:
        a.post_write(src_mr, 0, 64, dst_mr.addr, dst_mr.rkey ^ 0x5A5A, wr_id=3)
        with pytest.raises(rd.CompletionError) as info:
            cq.poll_wait(wcs, timeout=30, check=True)
        exc = info.value
    got.sort(key=lambda wc: int(wc["wr_id"]))
    qpns = {"a": a.qp_num, "b": b.qp_num}
    return got, exc, qpns, (a, b, pd)


@pytest.mark.device
def test_extended_cq_fills_the_same_records_as_the_plain_cq():
    with rd.Context() as ctx:
        plain = rd.CompletionQueue(ctx, 32)
        ext = rd.CompletionQueue(ctx, 32, extended=True)
        assert ext.wc_flags == rd.WCExFlags.STANDARD and plain.wc_flags is None and "extended" in repr(ext)
        want, want_exc, want_q, _ = _traffic(plain)
        got, got_exc, got_q, _ = _traffic(ext)
        assert [int(wc["wr_id"]) for wc in got] == [1, 2, 10, 11]
        fields = ("status", "opcode", "byte_len", "imm_data", "wc_flags")
        for w, g in zip(want, got):
            assert all(w[f] == g[f] for f in fields), (w, g)
        assert got[2]["imm_data"] == 0xC0FFEE and got[2]["wc_flags"] & rd.WC_WITH_IMM
        assert got[3]["byte_len"] == 40 and got[3]["opcode"] == rd.WC_RECV
        assert got[0]["qp_num"] == got_q["a"] and got[2]["qp_num"] == got_q["b"]
        # a failed completion through ibv_start_poll: status, wr_id and qp_num, raised by check=True
        assert got_exc.status == want_exc.status == rd.WC_REM_ACCESS_ERR
        assert got_exc.wr_id == 3 and got_exc.qp_num == got_q["a"]


@pytest.mark.device
def test_extended_cq_teardown_channel_and_timestamp_flags():
    with rd.Context() as ctx:
        ch = rd.CompChannel(ctx)
        cq = rd.CompletionQueue(ctx, 16, channel=ch, extended=True)
        cq.req_notify()
        _, _, _, (a, b, pd) = _traffic(cq, post_failure=False)
        assert cq.wait(timeout=10) is True                  # the channel names the extended CQ too
        wcs = np.zeros(4, rd.WC_DTYPE)
        with pytest.raises(rd.UsageError, match="COMPLETION_TIMESTAMP"):
            cq.poll_into(wcs, timestamps=np.zeros(4, np.uint64))
        cq.close()                                          # the one teardown path: its QPs go first
        assert a.closed and b.closed and not pd.closed
        with pytest.raises(rd.UsageError, match="WCExFlags"):
            rd.CompletionQueue(ctx, 16, wc_flags="timestamps")
        # A completion clock where the device has one; a refusal that names the flag where it has not
        # (Debian 12's rxe offers the standard flags only).
        for flag in (rd.WCExFlags.COMPLETION_TIMESTAMP, rd.WCExFlags.COMPLETION_TIMESTAMP_WALLCLOCK):
            try:
                tcq = rd.CompletionQueue(ctx, 16, wc_flags=flag)
            except rd.RDMAError as exc:
                assert exc.call == "ibv_create_cq_ex" and flag.name in str(exc) and "refused" in str(exc), exc
                continue
            with tcq:
                assert tcq.wc_flags & flag
                stamps = []
                _traffic(tcq, post_failure=False, stamps=stamps)
                assert len(stamps) == 4 and all(stamps), stamps     # the device's clock was read
