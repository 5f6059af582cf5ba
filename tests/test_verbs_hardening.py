"""No Python call on a verbs object crashes the interpreter (issue #16), whatever the thread, order or size.

Each class of defect has its test here: closed objects refuse every call (directly or because a parent
was closed), close() from another thread wakes a blocked call, Ctrl-C interrupts the waits, sizes are
checked in 64 bits, address handles are checked at post time, CQs share a completion channel.
Tests without the ``device`` mark run on any host.
"""
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import pyrdma as rd

TIMEOUT = 10.0
device = pytest.mark.device


# ---- host: sizes, inline sums, objects made with __new__ -----------------------------------------

@pytest.mark.parametrize("cls", [rd.SendWRList, rd.RecvWRList])
def test_wr_list_sizes_are_checked_before_allocation(cls):
    # capacity * max_sge used to be computed in C int: 65536 * 65537 wrapped to 65536 entries,
    # and set(i, ...) wrote far past the allocation.
    for capacity, max_sge in ((1 << 16, (1 << 16) + 1), (1 << 30, 4), (2**31 - 1, 2**31 - 1)):
        with pytest.raises(rd.UsageError):
            cls(capacity, max_sge)
    for capacity, max_sge in ((0, 1), (1, 0), (-5, 1), (1, -1)):
        with pytest.raises(rd.UsageError, match=">= 1"):
            cls(capacity, max_sge)
    lst = cls(1024, 30)     # ordinary sizes still work
    assert lst.capacity == 1024 and lst.max_sge == 30


def test_wr_list_set_indices_and_sge_counts():
    wrs = rd.SendWRList(4, 2)
    sges = [rd.SGE.raw(0x1000 + 8 * i, 8, 1) for i in range(3)]
    wrs.set(3, rd.SendWR(rd.WR_SEND, sges[:2]))
    for bad in (-1, 4, 2**31 - 1):
        with pytest.raises(rd.UsageError, match="outside"):
            wrs.set(bad, rd.SendWR(rd.WR_SEND, sges[:1]))
    with pytest.raises(rd.UsageError, match="SGEs"):
        wrs.set(0, rd.SendWR(rd.WR_SEND, sges))
    recvs = rd.RecvWRList(2, 1)
    with pytest.raises(rd.UsageError, match="SGEs"):
        recvs.set(0, rd.RecvWR(sges[:2]))


def test_inline_total_is_summed_in_64_bits():
    # Two 2 GiB SGEs summed to 0 in 32 bits, so an inline send passed as "small" and the provider
    # copied 4 GiB into its send queue.
    half = rd.SGE.raw(0x1000, 0x80000000, 1)
    for sges in ([half, half], [rd.SGE.raw(0x1000, 0xFFFFFFFF, 1)] * 3):
        with pytest.raises(rd.UsageError, match="inline"):
            rd.SendWR(rd.WR_SEND, sges, flags=rd.SEND_INLINE | rd.SEND_SIGNALED)
    rd.SendWR(rd.WR_SEND, [half, half])     # not inline: the device checks it


def test_sge_count_per_wr_is_bounded():
    with pytest.raises(rd.UsageError, match="SGEs in one WR"):
        rd.SendWR(rd.WR_SEND, [rd.SGE.raw(0, 1, 1)] * ((1 << 16) + 1))


def test_aligned_empty_size_cannot_wrap():
    # nbytes + alignment wrapped in size_t: a tiny buffer came back for an impossible size
    for nbytes in (2**64 - 1, 2**64 - 4096, 2**63):
        with pytest.raises(rd.UsageError, match="cannot allocate"):
            rd.aligned_empty(nbytes)


def test_objects_made_with_new_refuse_every_call():
    qp = rd.QueuePair.__new__(rd.QueuePair)
    cq = rd.CompletionQueue.__new__(rd.CompletionQueue)
    calls = [
        lambda: qp.post_send(rd.SendWR()), lambda: qp.post_recv(rd.RecvWR()), lambda: qp.query(),
        lambda: qp.to_init(), lambda: qp.to_rtr(None), lambda: qp.to_rts(), lambda: qp.to_error(),
        lambda: qp.to_reset(), lambda: qp.connect(None), lambda: qp.endpoint(),
        lambda: qp.post_send_list(_filled_send_list()), lambda: qp.post_recv_list(_filled_recv_list()),
        lambda: cq.poll(1), lambda: cq.poll_into(np.empty(1, rd.WC_DTYPE)), lambda: cq.req_notify(),
        lambda: cq.poll_wait(np.empty(1, rd.WC_DTYPE), 1, timeout=0.01), lambda: cq.wait(0.01),
        lambda: rd.CompChannel.__new__(rd.CompChannel).fileno(),
        lambda: rd.Context.__new__(rd.Context).query_device(),
        lambda: rd.Context.__new__(rd.Context).query_port(1),
        lambda: rd.Context.__new__(rd.Context).gid_table(1),
        lambda: rd.SharedReceiveQueue.__new__(rd.SharedReceiveQueue).post_recv(rd.RecvWR()),
        lambda: rd.MemoryRegion.__new__(rd.MemoryRegion).array(),
        lambda: rd.SGE(rd.MemoryRegion.__new__(rd.MemoryRegion)),
        lambda: rd.ProtectionDomain(rd.Context.__new__(rd.Context)),
        lambda: rd.CompletionQueue(rd.Context.__new__(rd.Context)),
        lambda: rd.CompChannel(rd.Context.__new__(rd.Context)),
        lambda: rd.MemoryRegion(rd.ProtectionDomain.__new__(rd.ProtectionDomain), bytearray(8)),
        lambda: rd.SendWR(rd.WR_SEND, ah=rd.AddressHandle.__new__(rd.AddressHandle)),
    ]
    for i, call in enumerate(calls):
        with pytest.raises(rd.UsageError):
            call()
    for cls in (rd.Context, rd.ProtectionDomain, rd.CompChannel, rd.CompletionQueue, rd.MemoryRegion,
                rd.QueuePair, rd.SharedReceiveQueue, rd.AddressHandle):
        obj = cls.__new__(cls)
        assert "closed" in repr(obj) and obj.closed
        obj.close()
        obj.close()


def _filled_send_list():
    wrs = rd.SendWRList(1)
    wrs.set(0, rd.SendWR())
    return wrs


def _filled_recv_list():
    wrs = rd.RecvWRList(1)
    wrs.set(0, rd.RecvWR())
    return wrs


# ---- device: closed objects ------------------------------------------------------------------------

class Stack:
    """Context, PD, channel, CQ, SRQ, MR, a self-connected RC QP and UD QP, an AH."""

    def __init__(self):
        self.ctx = rd.Context()
        self.pd = rd.ProtectionDomain(self.ctx)
        self.ch = rd.CompChannel(self.ctx)
        self.cq = rd.CompletionQueue(self.ctx, 64, channel=self.ch)
        self.srq = rd.SharedReceiveQueue(self.pd, 16)
        self.mr = rd.MemoryRegion.allocate(self.pd, 65536, rd.ACCESS_ALL)
        self.qp = rd.QueuePair(self.pd, rd.QPT_RC, self.cq, max_inline_data=64, max_send_sge=2)
        self.qp.connect(self.qp.endpoint())
        self.ud = rd.QueuePair(self.pd, rd.QPT_UD, self.cq)
        self.ud.connect()
        self.ah = rd.AddressHandle(self.pd, self.ud.endpoint())
        self.wcs = np.empty(16, rd.WC_DTYPE)

    def posts(self):
        """Every way to post on the RC and UD QPs and the SRQ, as (name, call)."""
        mr, qp, ud, ah = self.mr, self.qp, self.ud, self.ah
        send_list = rd.SendWRList(4)
        send_list.fill(rd.WR_RDMA_WRITE, mr, [0, 64], 64, [mr.addr + 4096, mr.addr + 4160], mr.rkey)
        recv_list = rd.RecvWRList(4)
        recv_list.fill(mr, [0, 64], 64)
        wr = rd.SendWR(rd.WR_RDMA_WRITE, [rd.SGE(mr, 0, 8)], remote_addr=mr.addr + 8, rkey=mr.rkey)
        return [
            ("post_write", lambda: qp.post_write(mr, 0, 8, mr.addr + 8, mr.rkey)),
            ("post_write_imm", lambda: qp.post_write(mr, 0, 8, mr.addr + 8, mr.rkey, imm=1)),
            ("post_read", lambda: qp.post_read(mr, 0, 8, mr.addr + 8, mr.rkey)),
            ("post_send_buf", lambda: qp.post_send_buf(mr, 0, 8)),
            ("post_send_inline", lambda: qp.post_send_buf(mr, 0, 8, inline=True)),
            ("post_recv_buf", lambda: qp.post_recv_buf(mr, 0, 8)),
            ("fetch_add", lambda: qp.post_atomic_fetch_add(mr, 0, mr.addr + 8, mr.rkey, 1)),
            ("cmp_swap", lambda: qp.post_atomic_cmp_swap(mr, 0, mr.addr + 8, mr.rkey, 0, 1)),
            ("post_send_wr", lambda: qp.post_send(wr)),
            ("post_send_chain", lambda: qp.post_send([wr, wr])),
            ("post_send_list", lambda: qp.post_send_list(send_list)),
            ("post_recv_wr", lambda: qp.post_recv(rd.RecvWR([rd.SGE(mr, 0, 8)]))),
            ("post_recv_list", lambda: qp.post_recv_list(recv_list)),
            ("ud_send", lambda: ud.post_send_buf(mr, 0, 8, ah=ah, remote_qpn=ud.qp_num)),
            ("srq_post", lambda: self.srq.post_recv_buf(mr, 0, 8)),
            ("srq_post_wr", lambda: self.srq.post_recv(rd.RecvWR([rd.SGE(mr, 0, 8)]))),
            ("to_error", lambda: qp.to_error()),
            ("query", lambda: qp.query()),
            ("endpoint", lambda: qp.endpoint()),
            ("poll", lambda: self.cq.poll(4)),
            ("poll_wait", lambda: self.cq.poll_wait(self.wcs, 1, timeout=0.01)),
            ("req_notify", lambda: self.cq.req_notify()),
            ("wait", lambda: self.cq.wait(0.01)),
            ("fileno", lambda: self.ch.fileno()),
        ]


CLOSERS = ["qp", "cq", "pd", "ctx", "ch", "srq", "mr", "ah"]


@device
@pytest.mark.parametrize("closer", CLOSERS)
def test_every_call_on_a_closed_object_raises_usage_error(closer):
    stack = Stack()
    try:
        calls = stack.posts()
        assert stack.qp.state == rd.QPS_RTS
        getattr(stack, closer).close()
        refused = 0
        for name, call in calls:
            try:
                call()
            except rd.UsageError as exc:
                assert "closed" in str(exc), (name, exc)
                refused += 1
            except rd.RDMATimeoutError:
                pass          # poll_wait on an open CQ
        assert refused > 0
        if closer in ("qp", "cq", "pd", "ctx"):
            assert stack.qp.closed and stack.qp.state == rd.QPS_RTS   # still reports RTS
            with pytest.raises(rd.UsageError, match="closed"):
                stack.qp.post_write(stack.mr, 0, 8, stack.mr.addr + 8, stack.mr.rkey)
    finally:
        stack.ctx.close()


@device
def test_double_init_is_refused():
    stack = Stack()
    try:
        for obj, args in ((stack.ctx, ()), (stack.pd, (stack.ctx,)), (stack.cq, (stack.ctx,)),
                          (stack.mr, (stack.pd, bytearray(8))), (stack.qp, (stack.pd, rd.QPT_RC, stack.cq)),
                          (stack.srq, (stack.pd,)), (stack.ch, (stack.ctx,))):
            with pytest.raises(rd.UsageError, match="already initialised"):
                obj.__init__(*args)
        assert not stack.qp.closed
    finally:
        stack.ctx.close()


@device
def test_post_bounds_refused_before_c():
    stack = Stack()
    try:
        mr, qp = stack.mr, stack.qp
        for offset, length in ((-1, 8), (0, -1), (65536, 1), (65535, 2), (2**62, 2**62),
                               (2**63 - 1, 2**63 - 1), (8, 2**32)):
            with pytest.raises(rd.UsageError):
                qp.post_write(mr, offset, length, mr.addr, mr.rkey)
            with pytest.raises(rd.UsageError):
                qp.post_recv_buf(mr, offset, length)
        for imm in (-1, 2**32):
            with pytest.raises(rd.UsageError, match="32 bits"):
                qp.post_write(mr, 0, 8, mr.addr, mr.rkey, imm=imm)
        with pytest.raises(rd.UsageError, match="aligned"):
            qp.post_atomic_fetch_add(mr, 4, mr.addr, mr.rkey, 1)
        with pytest.raises(rd.UsageError, match="outside"):
            qp.post_atomic_fetch_add(mr, -8, mr.addr, mr.rkey, 1)
        with pytest.raises(rd.UsageError):
            stack.cq.poll(-1)
        half = rd.SGE.raw(mr.addr, 0x80000000, mr.lkey)
        with pytest.raises(rd.UsageError, match="inline"):
            qp.post_send(rd.SendWR(rd.WR_SEND, [half, half], flags=rd.SEND_INLINE))
    finally:
        stack.ctx.close()


# ---- device: address handles at post time --------------------------------------------------------------

@device
@pytest.mark.parametrize("how", ["ah", "its_pd"])
def test_closed_address_handle_is_refused_at_post_time(how):
    ctx = rd.Context()
    try:
        pd = rd.ProtectionDomain(ctx)
        # the AH lives in its own PD, so closing that PD leaves the QP open
        ah_pd = pd if how == "ah" else rd.ProtectionDomain(ctx)
        cq = rd.CompletionQueue(ctx, 64)
        ud = rd.QueuePair(pd, rd.QPT_UD, cq, max_send_wr=16)
        ud.connect()
        mr = rd.MemoryRegion.allocate(pd, 4096, rd.ACCESS_ALL)
        ah = rd.AddressHandle(ah_pd, ud.endpoint())
        wr = rd.SendWR(rd.WR_SEND, [rd.SGE(mr, 0, 8)], ah=ah, remote_qpn=ud.qp_num,
                       remote_qkey=rd.DEFAULT_QKEY)
        wrs = rd.SendWRList(2)
        wrs.set(0, wr)
        plain = rd.SendWR(rd.WR_SEND, [rd.SGE(mr, 0, 8)], ah=ah, remote_qpn=ud.qp_num)
        if how == "ah":
            ah.close()
        else:
            ah_pd.close()
        assert ah.closed and not ud.closed
        for call in (lambda: ud.post_send(wr), lambda: ud.post_send([plain, wr]),
                     lambda: ud.post_send_list(wrs), lambda: ud.post_send(wrs),
                     lambda: ud.post_send_buf(mr, 0, 8, ah=ah, remote_qpn=ud.qp_num)):
            with pytest.raises(rd.UsageError, match="AddressHandle is closed"):
                call()
        assert ud.query().state == rd.QPS_RTS and len(cq.poll(16)) == 0   # nothing was posted
    finally:
        ctx.close()


# ---- device: close() against blocked calls ---------------------------------------------------------------

def _blocked(target):
    """Run ``target`` in a thread; return (thread, outcome list)."""
    outcome = []

    def run():
        try:
            outcome.append(("returned", target()))
        except BaseException as exc:    # reported to the test thread
            outcome.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


@device
@pytest.mark.parametrize("closer", ["cq", "ctx", "ch"])
@pytest.mark.parametrize("call", ["poll_wait", "wait"])
def test_close_from_another_thread_wakes_a_blocked_wait(call, closer):
    stack = Stack()
    try:
        wcs = np.empty(4, rd.WC_DTYPE)
        if call == "poll_wait":
            target = lambda: stack.cq.poll_wait(wcs, 1, timeout=30)
        else:
            stack.cq.req_notify()
            target = lambda: stack.cq.wait(timeout=30)
        thread, outcome = _blocked(target)
        time.sleep(0.5)                     # let it block with the GIL released
        assert thread.is_alive()
        start = time.monotonic()
        getattr(stack, closer).close()
        thread.join(TIMEOUT)
        assert not thread.is_alive()
        assert time.monotonic() - start < 5
        if call == "poll_wait" and closer == "ch":
            # closing the channel closes its CQs first
            assert stack.cq.closed
        kind, value = outcome[0]
        assert kind == "raised" and isinstance(value, rd.UsageError), outcome
        assert "closed" in str(value)
        assert getattr(stack, closer).closed
    finally:
        stack.ctx.close()


@device
def test_posting_threads_race_close():
    # Posts release the GIL over the QP handle: close() waits for them, later posts are refused.
    for round_ in range(3):
        stack = Stack()
        errors = []
        stop = threading.Event()

        def post():
            mr, qp = stack.mr, stack.qp
            while not stop.is_set():
                try:
                    qp.post_write(mr, 0, 8, mr.addr + 8, mr.rkey, signaled=False)
                    stack.cq.poll_into(stack.wcs)
                except rd.RDMAError:
                    pass
                except BaseException as exc:
                    errors.append(exc)
                    return

        threads = [threading.Thread(target=post) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.2)
        [stack.qp, stack.cq, stack.ctx][round_].close()
        time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join(TIMEOUT)
        stack.ctx.close()
        assert not errors


# ---- device: Ctrl-C --------------------------------------------------------------------------------------

SIGINT_SCRIPT = textwrap.dedent("""
    import sys, time, numpy as np, pyrdma as rd
    ctx = rd.Context(); ch = rd.CompChannel(ctx); cq = rd.CompletionQueue(ctx, 16, channel=ch)
    wcs = np.empty(4, rd.WC_DTYPE)
    cq.req_notify()
    print("ready", flush=True)
    try:
        if sys.argv[1] == "poll_wait":
            cq.poll_wait(wcs, 1, timeout=None)
        else:
            cq.wait(timeout=None)
    except KeyboardInterrupt:
        # the objects stay usable and closable after the interrupt
        cq.req_notify(); cq.poll(4)
        ctx.close()
        print("interrupted", ctx.closed, cq.closed, flush=True)
        raise
""")


@device
@pytest.mark.parametrize("call", ["poll_wait", "wait"])
def test_ctrl_c_interrupts_a_blocking_wait(call):
    proc = subprocess.Popen([sys.executable, "-c", SIGINT_SCRIPT, call], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "KeyboardInterrupt" in err, err
    assert out.strip() == "interrupted True True", (out, err)
    assert proc.returncode != 0 and proc.returncode != -signal.SIGSEGV
    assert elapsed < 5, elapsed    # within 0.5 s plus the emulated VM's process exit


# ---- device: several CQs on one completion channel -------------------------------------------------------

@device
def test_cqs_sharing_a_channel_keep_each_others_events():
    with rd.Context() as ctx:
        pd = rd.ProtectionDomain(ctx)
        ch = rd.CompChannel(ctx)
        cqs = [rd.CompletionQueue(ctx, 16, channel=ch) for _ in range(3)]
        qps = [rd.QueuePair(pd, rd.QPT_RC, cq) for cq in cqs]
        for qp in qps:
            qp.connect(qp.endpoint())
        mr = rd.MemoryRegion.allocate(pd, 4096, rd.ACCESS_ALL)
        for cq in cqs:
            cq.req_notify()
        # completions on CQ 1 and 2; a wait on CQ 0 reads their events and must keep them
        qps[1].post_write(mr, 0, 8, mr.addr + 8, mr.rkey)
        qps[2].post_write(mr, 0, 8, mr.addr + 8, mr.rkey)
        deadline = time.monotonic() + TIMEOUT
        while len(cqs[1].poll(4)) + len(cqs[2].poll(4)) < 2 and time.monotonic() < deadline:
            pass
        time.sleep(0.2)
        assert cqs[0].wait(timeout=0.5) is False
        start = time.monotonic()
        assert cqs[1].wait(timeout=TIMEOUT) is True
        assert cqs[2].wait(timeout=TIMEOUT) is True
        assert time.monotonic() - start < 1.0       # both were already there
        assert cqs[1].wait(timeout=0.05) is False   # each event is returned once
        # two threads waiting on two CQs of the channel both get their event
        for cq in cqs[:2]:
            cq.req_notify()
        threads = [_blocked(lambda cq=cq: cq.wait(timeout=TIMEOUT)) for cq in cqs[:2]]
        time.sleep(0.2)
        qps[0].post_write(mr, 0, 8, mr.addr + 8, mr.rkey)
        qps[1].post_write(mr, 0, 8, mr.addr + 8, mr.rkey)
        for thread, outcome in threads:
            thread.join(TIMEOUT)
            assert outcome == [("returned", True)]
        # an event kept for a CQ that is then closed is dropped, not delivered elsewhere
        cqs[2].req_notify()
        qps[2].post_write(mr, 0, 8, mr.addr + 8, mr.rkey)
        time.sleep(0.3)
        cqs[0].req_notify()
        assert cqs[0].wait(timeout=0.3) is False
        cqs[2].close()
        assert cqs[0].wait(timeout=0.1) is False


@device
def test_resources_of_another_context_are_refused():
    # The kernel looks CQ and SRQ handles up in the PD's context: a CQ of another Context named an
    # unrelated CQ of this one, which then could not be destroyed (EBUSY). Found by the stress test.
    a, b = rd.Context(), rd.Context()
    try:
        pd_a, pd_b = rd.ProtectionDomain(a), rd.ProtectionDomain(b)
        cq_a, cq_b = rd.CompletionQueue(a, 16), rd.CompletionQueue(b, 16)
        srq_b = rd.SharedReceiveQueue(pd_b, 8)
        for kwargs in ({"send_cq": cq_b}, {"send_cq": cq_a, "recv_cq": cq_b},
                       {"send_cq": cq_a, "srq": srq_b}):
            with pytest.raises(rd.UsageError, match="share one Context"):
                rd.QueuePair(pd_a, rd.QPT_RC, **kwargs)
        with pytest.raises(rd.UsageError, match="CompChannel belongs to"):
            rd.CompletionQueue(a, 16, channel=rd.CompChannel(b))
        rd.QueuePair(pd_a, rd.QPT_RC, cq_a).close()
        cq_a.close()          # nothing of b's pins it
    finally:
        a.close()
        b.close()


@pytest.mark.device
def test_ud_send_without_a_usable_address_handle_is_refused():
    """A UD send with no AddressHandle made rxe's provider dereference NULL (found by the stress
    test); one whose AH is of another PD is refused too, as verbs requires the QP's own PD."""
    with rd.Context() as ctx:
        pd, other_pd = rd.ProtectionDomain(ctx), rd.ProtectionDomain(ctx)
        cq = rd.CompletionQueue(ctx, 64)
        ud = rd.QueuePair(pd, rd.QPT_UD, cq, max_send_wr=16)
        ud.connect()
        mr = rd.MemoryRegion.allocate(pd, 4096, rd.ACCESS_ALL)
        stranger_ah = rd.AddressHandle(other_pd, ud.endpoint())
        no_ah = rd.SendWR(rd.WR_SEND, [rd.SGE(mr, 0, 8)], remote_qpn=ud.qp_num, remote_qkey=rd.DEFAULT_QKEY)
        with pytest.raises(rd.UsageError, match="needs an AddressHandle"):
            ud.post_send(no_ah)
        with pytest.raises(rd.UsageError, match="needs an AddressHandle"):
            ud.post_send_buf(mr, 0, 8, remote_qpn=ud.qp_num)
        with pytest.raises(rd.UsageError, match="another protection domain"):
            ud.post_send_buf(mr, 0, 8, ah=stranger_ah, remote_qpn=ud.qp_num)
        ah = rd.AddressHandle(pd, ud.endpoint())
        ud.post_send_buf(mr, 0, 8, ah=ah, remote_qpn=ud.qp_num)   # the QP's own PD: posted
