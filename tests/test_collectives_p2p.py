"""gather, scatter, all-to-all(v) and point-to-point send/recv against numpy references, over both
transports with the same bodies: TCP on the host, RDMA (marker ``device``) on rxe0 in the VM.

Worlds (rank processes) are shared by the tests of this module; MAX_MESSAGE is small, so that even
small arrays travel in several chunks, and ZERO_COPY small, so that the zero-copy paths run too.
"""
import contextlib
import time

import numpy as np
import pytest

from pyrdma.collectives import algorithms, costmodel
from pyrdma.testing import free_port
from test_collectives_comm import START_TIMEOUT, TIMEOUT, fresh_comm
from test_collectives_world import World, cached_worlds, world_params

MAX_MESSAGE = 2048
ZERO_COPY = 8192
DTYPES = ["int8", "uint8", "int32", "int64", "float16", "float32", "float64"]
try:
    import ml_dtypes
    DTYPES.append(ml_dtypes.bfloat16)
except ImportError:
    pass


_params = world_params


@pytest.fixture(scope="module")
def worlds():
    yield from cached_worlds(timeout=TIMEOUT, start_timeout=START_TIMEOUT, max_message=MAX_MESSAGE,
                             zero_copy_bytes=ZERO_COPY)


def piece(rank, peer, count, dtype):
    """What rank sends to peer: distinct values per (rank, peer, position)."""
    return ((np.arange(count) + 1000 * rank + 37 * peer) % 120).astype(dtype)


def uneven(rank, peer, size):
    """Element count rank sends to peer: rank-dependent, some zero, some over a chunk."""
    return ((rank * 7 + peer * 3) % 5) * ((rank + peer) % 3) * 300


# ---- gather, scatter ---------------------------------------------------------------------------------

def _dtypes(transport):
    """Every dtype over TCP; two over RDMA, whose engine moves the same bytes for all of them (the
    checks and copies in Python are the ones the TCP runs test), to keep the VM's time down."""
    return DTYPES if transport == "tcp" else ["int8", "float64"]


def _rooted(comm, counts, dtypes):
    out = []
    n, r = comm.size, comm.rank
    # the ranks agree whether any of them moves RDMA data by CPU (Soft-RoCE), and cost it so
    software = comm.transport.software
    assert comm.cost_model.copy == (costmodel.SOFTWARE_COPY if software else 0.0)
    lend = costmodel.LEND_BYTES if software or comm.transport_name == "tcp" else None
    assert comm.cost_model.lend_bytes == lend
    if comm.transport_name == "rdma":
        from pyrdma.collectives.transport.rdma import SOFTWARE_VENDORS
        assert software or comm.transport.ctx.query_device().vendor_id not in SOFTWARE_VENDORS
    for count in counts:
        for dtype in dtypes:
            for root in range(n):
                for algorithm in algorithms.names("scatter") + ("auto",):      # gather's and "read"
                    want = np.concatenate([piece(p, root, count, dtype) for p in range(n)])
                    if algorithm in algorithms.names("gather") + ("auto",):
                        got = comm.gather(piece(r, root, count, dtype), root=root, algorithm=algorithm)
                        if r == root:
                            assert got is not None and got.dtype == np.dtype(dtype), (count, dtype, root, algorithm)
                            assert np.array_equal(got, want), ("gather", count, dtype, root, algorithm)
                        else:
                            assert got is None
                    full = want if r == root else None
                    part = comm.scatter(full, out=np.full(count, 7, dtype), root=root, algorithm=algorithm)
                    assert np.array_equal(part, piece(r, root, count, dtype)), ("scatter", count, dtype, root,
                                                                                algorithm)
            # SPMD form: every rank passes the full array; 2-D rows
            rows = np.stack([piece(p, 0, count, dtype) for p in range(n)]).reshape(n, max(count, 1) if count else 0)
            assert np.array_equal(comm.scatter(rows, root=n - 1)[0] if count else rows[r:r], rows[r] if count
                                  else rows[r:r])
        out.append(count)
    return out


@pytest.mark.parametrize("transport, size", _params([2, 3, 4, 8], [2, 3, 4]))
def test_gather_and_scatter_every_root_dtype_and_algorithm(worlds, transport, size):
    counts = [0, 1, 5, 700] if size <= 4 else [1, 700]      # 700 x 8 bytes: several chunks
    worlds(transport, size).run(_rooted, counts, _dtypes(transport), timeout=300)


# ---- alltoall ----------------------------------------------------------------------------------------

class _Forced(costmodel.CostModel):
    """The communicator's model, but an all-to-all runs ``algorithm``."""

    def __init__(self, model, algorithm):
        super().__init__(model.alpha, model.beta, model.gamma, overhead=model.overhead, copy=model.copy)
        self.one_sided, self.algorithm = model.one_sided, algorithm

    def choose_copy(self, kind, block, n, max_message):
        return self.algorithm if kind == "alltoall" else super().choose_copy(kind, block, n, max_message)

    def written_from(self, max_message):
        return 0 if self.algorithm == "write" else super().written_from(max_message)   # every block, counts too


def _alltoall(comm, dtypes):
    """The cases below by the cost model's choice, then by every other all-to-all algorithm of the
    registry (a new model: the one-call path prepares its calls anew), the spread one also with a
    point-to-point message from an isend ahead of its messages (kept for its receive)."""
    model = comm.cost_model
    _alltoall_cases(comm, dtypes)
    chosen = model.choose_copy("alltoall", 8, comm.size, comm.transport.max_message)
    try:
        for name in algorithms.names("alltoall"):
            if algorithms.ALGORITHMS["alltoall"][name].rdma_only and comm.transport_name == "tcp":
                assert model.choose_copy("alltoall", 1 << 20, comm.size, 1 << 20) != name
                continue                 # (refused there: test_an_rdma_only_alltoall_is_refused_over_tcp)
            if name != chosen:
                comm.cost_model = _Forced(model, name)
                n, r = comm.size, comm.rank
                sent = comm.isend(np.full(5, r, np.int64), (r + 1) % n, tag=3)
                _alltoall_cases(comm, dtypes)
                got = np.zeros(5, np.int64)
                assert comm.recv(got, (r - 1) % n, tag=3) == 5 and (got == (r - 1) % n).all(), name
                sent.wait(timeout=60)
    finally:
        comm.cost_model = model
    return True


def _alltoall_cases(comm, dtypes):
    n, r = comm.size, comm.rank
    for dtype in dtypes:
        for count in (1, 3, 400):
            buf = np.concatenate([piece(r, p, count, dtype) for p in range(n)])
            got = comm.alltoall(buf)
            assert np.array_equal(got, np.concatenate([piece(p, r, count, dtype) for p in range(n)])), (dtype, count)
        send = [uneven(r, p, n) for p in range(n)]
        recv = [uneven(p, r, n) for p in range(n)]
        buf = np.concatenate([piece(r, p, send[p], dtype) for p in range(n)])
        want = np.concatenate([piece(p, r, recv[p], dtype) for p in range(n)])
        assert np.array_equal(comm.alltoall(buf, send_counts=send, recv_counts=recv), want), dtype
        out = np.empty(sum(recv), dtype)
        assert comm.alltoall(buf, out=out, send_counts=send) is out and np.array_equal(out, want), dtype
        h = comm.ialltoall(buf, send_counts=send, recv_counts=recv)
        assert np.array_equal(h.wait(timeout=60), want)
    # over the zero-copy size (sent from buf and received into out where they are): uneven counts
    # with zeros; and out=buf, the same memory, which is copied through the transport's buffer
    def big(src, dst):
        return 0 if (src + dst) % 3 == 0 else 1500 + 7 * src + dst
    send, recv = [big(r, p) for p in range(n)], [big(p, r) for p in range(n)]
    buf = np.concatenate([piece(r, p, send[p], "float64") for p in range(n)])
    want = np.concatenate([piece(p, r, recv[p], "float64") for p in range(n)])
    assert sum(send) * 8 >= ZERO_COPY
    assert np.array_equal(comm.alltoall(buf, send_counts=send, recv_counts=recv), want)
    same = np.concatenate([piece(r, p, 1500, "float64") for p in range(n)])
    assert comm.alltoall(same, out=same) is same
    assert np.array_equal(same, np.concatenate([piece(p, r, 1500, "float64") for p in range(n)]))
    # equal counts over the zero-copy size, out apart from buf: from buf into out where they lie (the
    # one-call path's lent run; over RDMA the write algorithm's asks name out), blocking and queued
    buf = np.concatenate([piece(r, p, 1500, "float64") for p in range(n)])
    want = np.concatenate([piece(p, r, 1500, "float64") for p in range(n)])
    out = np.zeros_like(buf)
    assert comm.alltoall(buf, out=out) is out and np.array_equal(out, want)
    out[:] = 0
    assert np.array_equal(comm.ialltoall(buf, out=out).wait(timeout=60), want) and np.array_equal(out, want)
    # counts of which some pairs' blocks are written (over RDMA, from the cost model's written_from)
    # and others go through the slots, zeros among them: by the cost model's choice the write
    # algorithm's mixed schedule, by the others' theirs; then the one-call path's slotted counts
    # beside it (a rank's call of small counts only meets peers' calls with large ones)
    least = comm.cost_model.written_from(comm.transport.max_message) or 4096

    def mixed(src, dst):
        return (0, 5, least // 8 + 3 * src + dst)[(src + 2 * dst) % 3]
    for counts in (mixed, lambda src, dst: mixed(src, dst) if 0 not in (src, dst) else (src + dst) % 4):
        send, recv = [counts(r, p) for p in range(n)], [counts(p, r) for p in range(n)]
        buf = np.concatenate([piece(r, p, send[p], "float64") for p in range(n)])
        want = np.concatenate([piece(p, r, recv[p], "float64") for p in range(n)])
        assert np.array_equal(comm.alltoall(buf, send_counts=send, recv_counts=recv), want)
        out = np.empty(sum(recv))
        assert np.array_equal(comm.ialltoall(buf, out=out, send_counts=send, recv_counts=recv).wait(timeout=60), want)
    # counts in place (each pair's count the same both ways): through the transport's buffer too
    sym = [1 + (r + p) % 3 for p in range(n)]
    same = np.concatenate([piece(r, p, sym[p], "float64") for p in range(n)])
    assert comm.alltoall(same, out=same, send_counts=sym, recv_counts=sym) is same
    assert np.array_equal(same, np.concatenate([piece(p, r, sym[p], "float64") for p in range(n)]))
    # 2-D rows of equal pieces
    rows = np.stack([piece(r, p, 6, "float32") for p in range(n)])
    assert np.array_equal(comm.alltoall(rows), np.stack([piece(p, r, 6, "float32") for p in range(n)]))


@pytest.mark.parametrize("transport, size", _params([2, 3, 4, 8], [2, 3, 4]))
def test_alltoall_equal_and_uneven_counts(worlds, transport, size):
    assert all(worlds(transport, size).run(_alltoall, _dtypes(transport), timeout=300))



def _warm_lent(comm):
    """Warm all-to-alls, gathers and scatters of lent buffers (the one-call path, which copies the
    own block from input to output itself), the same buffers every call with new contents: every
    block right every time, the own block too, and nothing planned."""
    n, r = comm.size, comm.rank
    count = 2 * ZERO_COPY // 8                   # float64 per peer: lent, not through the slots
    x, y = np.empty(n * count), np.empty(n * count)
    mine, part = np.empty(count), np.empty(count)

    def once(k):
        x[:] = np.concatenate([piece(r, p + k, count, "float64") for p in range(n)])
        mine[:] = piece(r, k, count, "float64")
        y[:] = part[:] = -1
        assert comm.alltoall(x, out=y) is y
        assert np.array_equal(y, np.concatenate([piece(p, r + k, count, "float64") for p in range(n)])), k
        gathered = comm.gather(mine, out=y if r == 0 else None, root=0)
        if r == 0:
            assert np.array_equal(gathered, np.concatenate([piece(p, k, count, "float64") for p in range(n)])), k
        assert comm.scatter(x if r == 0 else None, out=part, root=0) is part
        assert np.array_equal(part, piece(0, r + k, count, "float64")), k
    once(0)
    with _counting_plans(("alltoall", "gather", "scatter")) as planned:
        for k in range(1, 4):
            once(k)
    assert planned == [], planned
    return True


def _warm_counts(comm):
    """Warm all-to-alls with counts: the one-call path keeps the last call of each plan for its
    counts and lending, so a call right after one of the same counts, of other counts with the same
    totals, and of the same counts in place (through the transport's buffer, where the call before
    lent both buffers) must each get every block right."""
    n, r = comm.size, comm.rank
    for k in range(6):
        j = k // 2                            # two calls of each set of counts, then the next set
        for size_of in (lambda s, d: 1 + (s + d + j) % 3, lambda s, d: MAX_MESSAGE // 8 - (s + d + j) % 3):
            send = [size_of(r, p) for p in range(n)]             # the same both ways: in place works
            x = np.concatenate([piece(r, p + k, send[p], "float64") for p in range(n)])
            want = np.concatenate([piece(p, r + k, send[p], "float64") for p in range(n)])
            y = np.full(len(want), -1.0)
            assert comm.alltoall(x, out=y, send_counts=send, recv_counts=send) is y
            assert np.array_equal(y, want), (k, send)
            assert comm.alltoall(x, out=x, send_counts=send, recv_counts=send) is x
            assert np.array_equal(x, want), (k, send)
    return True


@pytest.mark.parametrize("transport, size", _params([2, 3], [2, 3]))
def test_warm_collectives_of_lent_buffers_are_right_at_every_call(worlds, transport, size):
    w = worlds(transport, size)
    assert all(w.run(_warm_lent, timeout=300))
    assert all(w.run(_warm_counts, timeout=300))

# ---- send / recv -------------------------------------------------------------------------------------

def _ring_p2p(comm):
    """Sends around the ring with several tags, interleaved with collectives; sizes from 0 bytes over
    several chunks to the zero-copy size; a shorter message than the buffer; isend/irecv; sendrecv."""
    n, r = comm.size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    for count in (0, 1, 100, 3000):
        for tag in (0, 5):
            x = piece(r, right, count, "float64")
            if r % 2 == 0:
                comm.send(x, right, tag=tag)
                y = np.zeros(count + 10)
                got = comm.recv(y, left, tag=tag)
            else:
                y = np.zeros(count + 10)
                got = comm.recv(y, left, tag=tag)
                comm.send(x, right, tag=tag)
            assert got == count and np.array_equal(y[:count], piece(left, r, count, "float64")), (count, tag)
            assert not y[count:].any()
            s = np.ones(3)
            comm.allreduce(s)                  # collectives in between
            assert s[0] == n
    y = np.zeros(500, np.int32)
    got = comm.sendrecv(piece(r, right, 500, "int32"), right, y, left, tag=3)
    assert got == 500 and np.array_equal(y, piece(left, r, 500, "int32"))
    # even ranks send by rendezvous (zero-copy size), odd ones eagerly: one exchange does both
    count = lambda rank: 3 * ZERO_COPY if rank % 2 == 0 else 100          # noqa: E731
    y = np.zeros(3 * ZERO_COPY, np.int8)
    got = comm.sendrecv(piece(r, right, count(r), "int8"), right, y, left, tag=6)
    assert got == count(left) and np.array_equal(y[:got], piece(left, r, got, "int8"))
    # non-blocking, in call order (as NCCL's ops on a stream): several messages per pair in order
    ss = [comm.isend(np.full(50, 10 * k + r, np.int64), right, tag=1) for k in range(3)]
    ys = [np.zeros(50, np.int64) for _ in range(3)]
    hs = [comm.irecv(y, left, tag=1) for y in ys]
    for h in ss:
        assert h.wait(timeout=60) is None
    for k, h in enumerate(hs):
        assert h.wait(timeout=60) == 50 and (ys[k] == 10 * k + left).all()
    # a batch (torch's batch_isend_irecv): receives first, both directions, each message larger
    # than every receive slot together, so ranks that ran them one by one would wait for each other
    big = 20 * MAX_MESSAGE // 8
    y_left, y_right = np.zeros(big), np.zeros(big)
    # each direction its own tag: a send and a receive of different tags still go as one exchange
    ops = [("recv", y_left, left, 2), ("recv", y_right, right, 4),
           ("send", piece(r, right, big, "float64"), right, 2), ("send", piece(r, left, big, "float64"), left, 4)]
    got = comm.batch(ops).wait(timeout=60) if n > 1 else None
    assert got[:2] == [big, big] and got[2:] == [None, None], got
    if n == 2:                     # left and right are the same rank: its messages come in order
        assert np.array_equal(y_left, piece(left, r, big, "float64"))
        assert np.array_equal(y_right, piece(right, r, big, "float64"))
    else:
        assert np.array_equal(y_left, piece(left, r, big, "float64"))
        assert np.array_equal(y_right, piece(right, r, big, "float64"))
    return True


def _p2p_uninvolved(comm):
    """Only ranks 0 and 1 exchange messages; the others' collectives do not fall out of step."""
    r = comm.rank
    for i in range(5):
        if r == 0:
            comm.send(np.full(10, i, np.int32), 1, tag=i)
        elif r == 1:
            y = np.zeros(10, np.int32)
            assert comm.recv(y, 0, tag=i) == 10 and (y == i).all()
        x = np.full(4, r, np.int64)
        comm.allreduce(x)
        assert (x == sum(range(comm.size))).all()
    return True


@pytest.mark.parametrize("transport, size", _params([2, 3, 4, 8], [2, 4]))
def test_send_recv_tags_sizes_and_interleaved_collectives(worlds, transport, size):
    w = worlds(transport, size)
    assert all(w.run(_ring_p2p, timeout=300))
    assert all(w.run(_p2p_uninvolved, timeout=120))


def _isend_beside_collectives(comm, eager=False):
    """MPI's progress rule, as a 1F1B pipeline beside data-parallel gradients uses it: each rank
    isends to the next (small messages and one of several chunks, over the zero-copy size and
    longer than the receiver's slots hold), runs collectives, and only then receives from the
    previous. The messages that arrive during the collectives are kept for their receives, never
    taken for the collectives' own. ``eager``: no rendezvous (over TCP there is none anyway): the
    big one goes through the slots, which the receiver empties while it waits (Engine._keep_arrivals)."""
    if eager:
        comm.transport.rendezvous_bytes = 0
    n, r = comm.size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    engine = comm.transport.engine
    parks = engine.parks
    small = [comm.isend(np.full(1000, 10 * k + r, np.int32), right, tag=1) for k in range(3)]
    big = 3 * ZERO_COPY
    sent = comm.isend(piece(r, right, big, "int8"), right, tag=2)
    x = np.full(5000, r + 1, np.float64)           # several chunks, so several messages per peer
    comm.allreduce(x)
    assert (x == n * (n + 1) / 2).all()
    # more lent buffers than the registration cache keeps: the parked send's registration is let
    # go by the cache but stays open until the send is written
    lent = [np.full(2 * ZERO_COPY // 8, k, np.float64) for k in range(10)]
    for k, a in enumerate(lent):
        comm.allreduce(a)
        assert (a == n * k).all()
    y = comm.gather(np.full(3, r, np.int16), root=n - 1)
    assert r != n - 1 or np.array_equal(y.reshape(n, 3)[:, 0], np.arange(n))
    for k in range(3):
        z = np.zeros(1000, np.int32)
        assert comm.recv(z, left, tag=1) == 1000 and (z == 10 * k + left).all(), k
    z = np.zeros(big, np.int8)
    assert comm.recv(z, left, tag=2) == big and np.array_equal(z, piece(left, r, big, "int8"))
    for h in small + [sent]:
        assert h.wait(timeout=60) is None
    # over RDMA the big one went by rendezvous and left its turn before its receive (parked); over
    # TCP it went through the slots, kept by the receiver once they were full (Engine._keep_arrivals)
    assert engine.parks == parks + (comm.transport_name == "rdma" and not eager), (engine.parks, parks)
    assert sent.test()
    if eager:
        comm.transport.rendezvous_bytes = comm.zero_copy_bytes
    return True


@pytest.mark.parametrize("transport, size", _params([2, 3, 4], [2, 3]))
def test_isend_then_collectives_then_recv(worlds, transport, size):
    w = worlds(transport, size)
    assert all(w.run(_isend_beside_collectives, timeout=120))
    if transport == "rdma":
        assert all(w.run(_isend_beside_collectives, True, timeout=120))


def _big_send(comm, nbytes, zero_copy_bytes):
    """Rank 0 sends ``nbytes`` to rank 1; rank 1 returns how many messages came through its slots
    (over RDMA; None over TCP)."""
    comm.zero_copy_bytes = comm.transport.rendezvous_bytes = zero_copy_bytes
    engine = getattr(comm.transport, "engine", None)
    slots_used = None
    if comm.rank < 2 and engine is not None:
        slots_used = -engine.state(1 - comm.rank)["recv_seq"]
    data = np.arange(nbytes // 8, dtype=np.int64)
    if comm.rank == 0:
        comm.send(data, 1)
    elif comm.rank == 1:
        y = np.zeros(data.size + 3, np.int64)          # a longer buffer, as MPI allows
        assert comm.recv(y, 0) == data.size
        assert np.array_equal(y[:data.size], data) and not y[data.size:].any()
    if slots_used is not None:
        slots_used += engine.state(1 - comm.rank)["recv_seq"]
    return slots_used


def _max_message(comm):
    return comm.transport.max_message


@pytest.mark.parametrize("transport", [pytest.param("tcp"), pytest.param("rdma", marks=pytest.mark.device)])
def test_send_of_64_mib_eager_and_by_rendezvous(transport):
    """64 MiB by rendezvous (rendezvous_bytes or more: over RDMA the sender writes it straight into
    the receiver's buffer, and only the two headers, RTS and FIN, use the receiver's slots), and
    eagerly (rendezvous_bytes=0: through the slots, max_message at a time)."""
    nbytes = 64 << 20
    with World(2, transport, timeout=120, start_timeout=START_TIMEOUT) as w:
        by_rendezvous = w.run(_big_send, nbytes, 1 << 20, timeout=600)[1]
        eager = w.run(_big_send, nbytes, 0, timeout=600)[1]
        max_message = w.run(_max_message)[1]
    if transport == "rdma":
        assert by_rendezvous == 2, by_rendezvous
        assert eager == nbytes // max_message, (eager, max_message)


# ---- errors: bad input, mismatches, dead ranks ---------------------------------------------------------

def _errors(comm, port):
    import pyrdma
    n, r = comm.size, comm.rank
    bad = []

    def expect(fn, words):
        try:
            fn()
        except pyrdma.UsageError as exc:
            if not all(w in str(exc) for w in words):
                bad.append((words, str(exc)))
        else:
            bad.append((words, "no error"))
    expect(lambda: comm.gather(np.zeros(4), root=n), ["root"])
    expect(lambda: comm.alltoall(np.zeros(n + 1)) if n > 1 else comm.alltoall(np.zeros(1), send_counts=[2]),
           ["pieces"] if n > 1 else ["send_counts"])
    expect(lambda: comm.alltoall(np.zeros(n), send_counts=[1] * (n + 1)), ["send_counts"])
    expect(lambda: comm.alltoall(np.zeros(n), send_counts=[2] * n, recv_counts=[1] * n), ["add up"])
    expect(lambda: comm.alltoall(np.zeros(n), send_counts=[1] * n, recv_counts=[2 if p == r else 1 for p in range(n)]),
           ["sends itself 1", "expects 2", "must be equal"])
    expect(lambda: comm.send(np.zeros(2), n), ["dst"])
    expect(lambda: comm.recv(np.zeros(2), r), ["itself"])
    expect(lambda: comm.send(np.zeros(2), (r + 1) % n, tag=-1), ["tag"])
    expect(lambda: comm.recv(np.zeros(6)[::2], (r + 1) % n), ["C-contiguous"])
    expect(lambda: comm.scatter(None, root=(r + 1) % n), ["out="])
    # a blocking batch (torch's, waited on) whose second step has a bad tag: nothing of its first goes
    sent = list(comm._exec.sent)
    right, left = (r + 1) % n, (r - 1) % n
    expect(lambda: comm._batch([("send", np.ones(2), right), ("recv", np.zeros(2), left),
                                ("send", np.ones(2), right, -1), ("recv", np.zeros(2), left, -1)], True), ["tag"])
    if comm._exec.sent != sent:
        bad.append((["nothing sent"], f"messages sent per rank {sent} -> {comm._exec.sent}"))
    # the communicator still works: bad input is refused before anything is sent
    x = np.ones(2)
    comm.allreduce(x)
    assert x[0] == n
    return bad


@pytest.mark.parametrize("transport, size", _params([3], []))
def test_bad_input_is_a_clear_usage_error(worlds, transport, size):
    for bad in worlds(transport, size).run(_errors, 0, timeout=120):
        assert not bad, bad


def _mismatch(comm, ports, kinds):
    import pyrdma
    outcomes = []
    for k, kind in enumerate(kinds):
        with fresh_comm(comm, ports[k], zero_copy_bytes=ZERO_COPY) as c:
            n, r = c.size, c.rank
            start = time.monotonic()
            result = None
            try:
                if kind == "gather-count":
                    c.gather(np.zeros(10 + (r == 2)), root=0)
                elif kind == "scatter-count":
                    c.scatter(np.zeros(n * (4 + (r == 1))), root=0)
                elif kind == "scatter-list-count":          # each piece sent from where it lies
                    count = 20_000                           # 160 kB: from the cost model's lend_bytes
                    pieces = [np.zeros(count) for _ in range(n)] if r == 0 else None
                    c.scatter(pieces, out=np.zeros(count + (r == 1)), root=0)
                elif kind == "scatter-count-read":
                    c.scatter(np.zeros(n * (4 + (r == 1))), root=0, algorithm="read")
                elif kind == "scatter-algorithm":           # the root offers, the others await data
                    c.scatter(np.zeros(n * 4), root=0, algorithm="read" if r == 0 else "direct")
                elif kind == "alltoall-counts":
                    send = [1] * n
                    recv = [1] * n
                    if r == 1:
                        recv[0] = 2
                    c.alltoall(np.zeros(n), send_counts=send, recv_counts=recv)
                elif kind in ("alltoall-counts-written", "alltoall-counts-sent"):
                    # rank 0's block for rank 1 is over the size that the write algorithm writes
                    # (over RDMA) by one's counts and 16 bytes (an ask's length) by the other's
                    large = (c.cost_model.written_from(c.transport.max_message) or 4096) // 8 + 1
                    send, recv = [1] * n, [1] * n
                    if r == 0:
                        send[1] = 2 if kind == "alltoall-counts-written" else large
                    if r == 1:
                        recv[0] = large if kind == "alltoall-counts-written" else 2
                    c.alltoall(np.zeros(sum(send)), send_counts=send, recv_counts=recv)
                elif kind == "sendrecv-tag":            # an exchange (one C call), each rank its own tag
                    if r < 2:
                        c.sendrecv(np.zeros(5), 1 - r, np.zeros(5), 1 - r, tag=1 + r)
                elif kind == "send-tag":
                    if r == 0:
                        c.send(np.zeros(5), 1, tag=1)
                    elif r == 1:
                        c.recv(np.zeros(5), 0, tag=2)
                elif kind in ("too-long", "too-long-lent"):
                    if r == 0:
                        c.send(np.zeros(3000), 1)        # by rendezvous over RDMA (zero_copy_bytes)
                    elif r == 1:
                        c.recv(np.zeros(100 if kind == "too-long" else 2000), 0)
                result = "no error"
                # a rank that only sent may finish first: it learns at its next call
                c.barrier()
            except pyrdma.RDMAError as exc:
                result = f"{type(exc).__name__}: {exc}" + (" (at the next call)" if result == "no error" else "")
            elapsed = time.monotonic() - start
        outcomes.append((result, elapsed))
    return outcomes


@pytest.mark.parametrize("transport, size", _params([3], [3]))
def test_mismatched_calls_fail_on_every_rank(worlds, transport, size):
    kinds = ["gather-count", "scatter-count", "scatter-list-count", "scatter-count-read", "scatter-algorithm", "alltoall-counts",
             "alltoall-counts-written", "alltoall-counts-sent", "send-tag", "sendrecv-tag", "too-long", "too-long-lent"]
    results = worlds(transport, size).run(_mismatch, [free_port() for _ in kinds], kinds, timeout=300)
    receivers = {"gather-count": {0}, "scatter-count": {1}, "scatter-list-count": {1}, "scatter-count-read": {1},
                 "scatter-algorithm": {1, 2}, "alltoall-counts": {1}, "alltoall-counts-written": {1},
                 "alltoall-counts-sent": {1}, "send-tag": {1}, "sendrecv-tag": {0, 1}, "too-long": {1},
                 "too-long-lent": {1}}
    for rank, outcomes in enumerate(results):
        for kind, (result, elapsed) in zip(kinds, outcomes):
            # every rank raises UsageError; a rank that receives the mismatched message, at that call
            assert result.startswith("UsageError"), (rank, kind, result)
            assert rank not in receivers[kind] or "next call" not in result, (rank, kind, result)
            assert elapsed < TIMEOUT / 2, (rank, kind, elapsed)
    too_long = results[1][kinds.index("too-long")][0]
    assert "24000-byte message" in too_long and "800 bytes" in too_long, too_long
    too_long = results[1][kinds.index("too-long-lent")][0]         # a buffer registered in place
    assert "24000-byte message" in too_long and "16000 bytes" in too_long, too_long
    tag = results[1][kinds.index("send-tag")][0]
    assert "tag=1" in tag and "expects tag=2" in tag and "same order" in tag, tag    # says why, not "collective"
    # both receive a message of the other tag: one names the tags, or each does (the other may be told first)
    tags = [results[rank][kinds.index("sendrecv-tag")][0] for rank in (0, 1)]
    assert any("tag=1" in t and "tag=2" in t for t in tags), tags
    if transport == "rdma":     # one moved it through the slots, the other by RDMA WRITE: the one that found it says so
        for kind in ("alltoall-counts-written", "alltoall-counts-sent"):
            said = [results[rank][kinds.index(kind)][0] for rank in (0, 1)]
            assert any("counts for the block between them disagree" in t for t in said), (kind, said)


def _dead(comm, victim, kind):
    import os
    import pyrdma
    n, r = comm.size, comm.rank
    # (with counts: uneven, each rank's block for each peer written, in the pairwise steps)
    counts = [100 + r + p for p in range(n)] if kind == "alltoallv write" else None
    if kind in ("alltoall write", "alltoallv write"):
        comm.cost_model = _Forced(comm.cost_model, "write")
    if r == victim:
        if kind in ("alltoall write", "alltoallv write"):
            # dies once it has asked every peer for its block; with counts (whose steps are
            # pairwise: ask, a notice ahead of the block, its write) before its first write
            from pyrdma.collectives import schedule, specs
            spec = specs.alltoall(comm, np.zeros(sum(counts) if counts else n * 100), None, counts, counts)
            run, plan = spec.runs[0], spec.runs[0].plan

            def asks(steps):
                kinds = [s[0] for s in steps]
                return list(steps[:kinds.index(schedule.PUT)]) if counts else \
                    [s for s in steps if s[0] == schedule.ASK]
            run.plan = lambda max_message: schedule.Schedule(
                asks(plan(max_message).steps) + [(schedule.WAIT_SENDS,) + (0,) * 7], plan(max_message).chunks)
            comm._exec.submit(True, comm._run_spec, spec).wait()
        os._exit(3)
    start = time.monotonic()
    try:
        if kind in ("alltoall", "alltoall write"):    # the writers wait for the dead rank's landing
            comm.alltoall(np.zeros(n * 100))
        elif kind == "alltoallv write":
            comm.alltoall(np.zeros(sum(counts)), send_counts=counts, recv_counts=counts)
        elif kind == "gather":
            comm.gather(np.zeros(100), root=0)
        elif kind == "scatter":
            comm.scatter(np.zeros(n * 100), root=victim)
        elif kind == "scatter read":           # the root waits for the dead reader's word
            comm.scatter(np.zeros(n * 100), root=0, algorithm="read")
        elif kind == "recv":
            comm.recv(np.zeros(100), victim)
        elif kind == "sendrecv":                 # the one-call exchange
            comm.sendrecv(np.zeros(100), victim, np.zeros(100), victim)
        elif kind == "alltoallv":                # the one-call all-to-all with counts
            comm.alltoall(np.zeros(n * 100), send_counts=[100] * n, recv_counts=[100] * n)
        elif kind == "iallreduce":               # a one-call run queued on the communicator's thread
            comm.iallreduce(np.zeros(100)).wait(30)
        elif kind == "rendezvous send":       # 2 MiB, over the rendezvous size: it waits for the CTS
            comm.send(np.zeros(1 << 18), victim)
    except pyrdma.PeerError as exc:
        return ("PeerError", exc.peer, time.monotonic() - start)
    return ("no error", None, None)


@pytest.mark.parametrize("kind", ["alltoall", "alltoall write", "alltoallv write", "gather", "scatter", "scatter read",
                                  "recv", "sendrecv", "alltoallv", "iallreduce"])
@pytest.mark.parametrize("transport", [pytest.param("tcp"), pytest.param("rdma", marks=pytest.mark.device)])
def test_dead_rank_is_named(transport, kind):
    if kind.endswith("write") and transport == "tcp":
        pytest.skip("RDMA only (RDMA WRITE into the peers' memory)")
    _check_dead_rank_is_named(transport, kind)


def _rdma_only_alltoall(comm):
    import pyrdma
    comm.cost_model = _Forced(comm.cost_model, "write")
    try:
        comm.alltoall(np.zeros(comm.size * 10))
    except pyrdma.UsageError as exc:
        return str(exc)
    return "no error"


def test_an_rdma_only_alltoall_is_refused_over_tcp():
    """A cost model that picks the write all-to-all (its RDMA WRITEs) over TCP gets a clear error
    on every rank before anything is sent, never a hang."""
    with contextlib.closing(World(2, "tcp", timeout=10, start_timeout=START_TIMEOUT)) as w:
        for message in w.run(_rdma_only_alltoall, timeout=60):
            assert "no remote writes" in message and "RDMA transport" in message, message


@pytest.mark.device
def test_dead_rank_during_a_rendezvous_send_is_named():
    """The sender of a rendezvous message waits for the receiver's buffer address (CTS); a receiver
    that died is named within the timeout, as in an eager exchange. (RDMA only: TCP sends eagerly,
    and a send may end in the socket's buffer before the peer's death is known.)"""
    _check_dead_rank_is_named("rdma", "rendezvous send")


def _check_dead_rank_is_named(transport, kind):
    timeout, victim, size = 4.0, 2, 3
    w = World(size, transport, timeout=timeout, start_timeout=START_TIMEOUT, max_message=MAX_MESSAGE)
    try:
        results = w.run(_dead, victim, kind, timeout=timeout * 4 + 20, expect_errors=True, ignore=(victim,))
    finally:
        w.close()
    for rank, (status, value) in enumerate(results):
        if rank == victim:
            continue
        assert status == "ok", value
        outcome, peer, elapsed = value
        if kind in ("gather", "scatter read") and rank != 0:
            continue                 # a non-root of a gather only sends: its call may finish first
                                     # (a reader, once it has its block from the live root)
        assert outcome == "PeerError" and peer == victim, (rank, value)
        assert elapsed < timeout + 3, (rank, elapsed)


def _own_root(comm, ports, kinds):
    import pyrdma
    outcomes = []
    for port, kind in zip(ports, kinds):
        with fresh_comm(comm, port) as c:
            r = c.rank
            try:
                if kind == "broadcast":
                    c.broadcast(np.zeros(10), root=r)
                elif kind == "scatter":
                    c.scatter(np.zeros(10 * c.size), root=r)
                elif kind == "gather":
                    c.gather(np.zeros(10), root=r)
                elif kind == "reduce":
                    c.reduce(np.zeros(10), root=r)
                outcomes.append("no error")
            except pyrdma.RDMAError as exc:
                outcomes.append(f"{type(exc).__name__}: {exc}")
    return outcomes


@pytest.mark.parametrize("transport, size", _params([2], [2]))
def test_ranks_that_each_name_themselves_root_fail_at_that_call(worlds, transport, size):
    """Nobody would receive anything in a broadcast or scatter: the zero-byte message from the rank
    after the root (Builder.greet_root) makes every rank receive, so both find the mismatch at the
    call, not at the next one."""
    kinds = ["broadcast", "scatter", "gather", "reduce"]
    for outcomes in worlds(transport, size).run(_own_root, [free_port() for _ in kinds], kinds, timeout=120):
        for kind, result in zip(kinds, outcomes):
            # this rank found the other's root in a message, or was told so by the other
            assert result.startswith("UsageError") and ("root=" in result or "different collective" in result), \
                (kind, result)


def _one_call_copies(comm):
    """A warm blocking all-to-all, gather or scatter of host memory over RDMA is one Python frame
    whatever its size, and gives what the general path gives (the two mix: a rank may take
    either; here rank 0 takes the general one through the non-blocking form)."""
    from pyrdma.testing import count_python_calls
    n, r = comm.size, comm.rank
    frames = {}
    for count in (1, 1000, 300_000):                       # 8 B to 2.4 MB per peer
        buf = np.concatenate([piece(r, p, count, "float64") for p in range(n)])
        want = np.concatenate([piece(p, r, count, "float64") for p in range(n)])
        out = np.empty_like(buf)
        mine = piece(r, 0, count, "float64")
        everyone = np.concatenate([piece(p, 0, count, "float64") for p in range(n)])
        gathered = np.empty_like(everyone) if r == 1 else None
        part = np.empty(count)
        pieces = [piece(p, 0, count, "float64") for p in range(n)] if r == 2 else None
        calls = {"alltoall": lambda: comm.alltoall(buf, out),
                 "gather": lambda: comm.gather(mine, gathered, root=1),
                 "scatter": lambda: comm.scatter(everyone if r == 2 else None, part, root=2)}
        # a root's list of pieces: joined below the size each is lent from; from it each is sent
        # from where it lies, over TCP by the one-call path too (over RDMA: the general path's runs)
        if count < 300_000 or comm.transport.name == "tcp":
            calls["scatter_list"] = lambda: comm.scatter(pieces, part, root=2)
        for name, call in calls.items():
            call()                                             # prepares the call
            out[:] = 0
            part[:] = 0
            if gathered is not None:
                gathered[:] = 0
            frames.setdefault(name, []).append(count_python_calls(call))
            assert np.array_equal(out, want) if name == "alltoall" else True, count
            assert name != "gather" or r != 1 or np.array_equal(gathered, everyone), count
            assert not name.startswith("scatter") or np.array_equal(part, piece(r, 0, count, "float64")), count
        # with counts (some zero, up to 400 kB a piece: within max_message): the plan is the
        # format's, so the counted call's new counts (k = 1) need no preparing (nor, over RDMA,
        # registering: its pieces are shorter, within the memory the first call registered)
        def counts(a, b, k):
            return 0 if (a + 2 * b) % 4 == 1 and a != b else min(count, 50_000) + 3 * a + b + 1 - k
        vin, vres = np.empty(n * (50_000 + 4 * n)), np.empty(n * (50_000 + 4 * n))
        for k in (0, 1):
            vs, vr = [counts(r, p, k) for p in range(n)], [counts(p, r, k) for p in range(n)]
            vsrc, vout = vin[:sum(vs)], vres[:sum(vr)]
            vsrc[:] = np.concatenate([piece(r, p, vs[p], "float64") for p in range(n)])
            vwant = np.concatenate([piece(p, r, vr[p], "float64") for p in range(n)])
            vout[:] = 0
            if k == 0:
                comm.alltoall(vsrc, vout, send_counts=vs, recv_counts=vr)
            else:
                frames.setdefault("alltoallv", []).append(count_python_calls(
                    lambda: comm.alltoall(vsrc, vout, send_counts=vs, recv_counts=vr)))
            assert np.array_equal(vout, vwant), (count, k)
            vout[:] = 0
        if r == 0:               # the general path on one rank, the one-call path on the others
            got = comm.ialltoall(buf).wait(60)
            comm.ialltoall(vsrc, vout, send_counts=vs, recv_counts=vr).wait(60)
            comm.igather(mine, root=1).wait(60)
            comm.iscatter(None, np.empty(count), root=2).wait(60)
        else:
            got = comm.alltoall(buf)
            comm.alltoall(vsrc, vout, send_counts=vs, recv_counts=vr)
            g = comm.gather(mine, root=1)
            assert r != 1 or np.array_equal(g, everyone)
            assert np.array_equal(comm.scatter(everyone if r == 2 else None, np.empty(count), root=2),
                                  piece(r, 0, count, "float64"))
        assert np.array_equal(got, want) and np.array_equal(vout, vwant), count
    return frames


def _one_call_messages(comm):
    """A warm blocking send or recv is one C call (no Python frame of its own) below the zero-copy
    size, and over TCP from it too (from and into the caller's buffer: no rendezvous there); its
    messages and the general path's (isend/irecv, and a rendezvous) keep one order and numbering
    per pair."""
    from pyrdma.testing import count_python_calls
    r = comm.rank
    frames = []
    if r > 1:
        return frames, []
    peer = 1 - r
    lent = (200_000,) if comm.transport.name == "tcp" else ()
    for count in (1, 1000, 100_000) + lent:            # 8 B to 800 kB (zero-copy: 1 MiB), 1.6 MB
        x = piece(r, peer, count, "float64")
        y = np.zeros(count + 3)
        for k in [0, 1, 2] * 2:                        # the first three prepare the calls (warm: the rest)
            if (r + k) % 2 == 0:
                frames.append(count_python_calls(lambda: comm.send(x, peer, tag=k)))
                comm.isend(x, peer, tag=k).wait(60)
            else:
                n = [None]

                def receive():
                    n[0] = comm.recv(y, peer, tag=k)
                frames.append(count_python_calls(receive))           # receive() stands for the lambda
                assert n[0] == count and np.array_equal(y[:count], piece(peer, r, count, "float64"))
                y[:] = 0
                assert comm.irecv(y, peer, tag=k).wait(60) == count
                assert np.array_equal(y[:count], piece(peer, r, count, "float64"))
        del frames[-6:-3]
    # an exchange: sendrecv, and a batch of one send and one receive waited on at once (torch's
    # batch_isend_irecv, Communicator._batch); the paths mix (rank 0's second call is the general one)
    exchanges = []
    for count in (1, 1000, 100_000) + lent:
        x = piece(r, peer, count, "float64")
        y = np.zeros(count + 3)
        for k in range(3):
            if k == 2:
                n = [None]

                def exchange():
                    n[0] = comm.sendrecv(x, peer, y, peer, tag=4)
                exchanges.append(count_python_calls(exchange))
                got = n[0]
            elif k == 1 and r == 0:
                got = comm.batch([("recv", y, peer, 4), ("send", x, peer, 4)]).wait(60)[0]
            else:
                got = comm._batch([("recv", y, peer, 4), ("send", x, peer, 4)], True).wait(60)[0]
            assert got == count and np.array_equal(y[:count], piece(peer, r, count, "float64")), (count, k)
            assert not y[count:].any()
            y[:] = 0
    big = np.arange(200_000, dtype=np.float64)       # 1.6 MB: over RDMA the general path's rendezvous
    if r == 0:
        comm.send(big, 1)
    else:
        z = np.zeros_like(big)
        assert comm.recv(z, 0) == big.size and np.array_equal(z, big)
    return frames, exchanges


def _one_call_batches(comm):
    """A warm blocking batch of host memory (torch's batch_isend_irecv waited on) runs each of its
    steps as one C call: two messages each way with every other rank (two exchanges per step), and
    sends with no receive beside them (lone steps); the general path's batch mixes with it (rank 0's
    second call) in one numbering per pair."""
    from pyrdma.testing import count_python_calls
    n, r = comm.size, comm.rank
    frames = []
    for count in (1, 1000, 100_000):                # 8 B to 800 kB (zero-copy: 1 MiB)
        others = [(r + k) % n for k in range(1, n)]
        got = {(p, tag): np.zeros(count + 2) for p in others for tag in (0, 5)}
        ops = [("recv", got[p, tag], p, tag) for p in reversed(others) for tag in (0, 5)] + \
              [("send", piece(r, p, count + tag, "float64")[:count + tag // 5], p, tag)
               for p in others for tag in (0, 5)]
        lone = [("send", piece(r, 1, count, "float64"), 1, 7)] * 2 if r == 0 else \
            [("recv", got[0, tag], 0, 7) for tag in (0, 5)] if r == 1 else []
        for k in range(3):                          # prepares, then warm twice
            for y in got.values():
                y[:] = 0
            if k == 1 and r == 0:
                counts = comm.batch(ops).wait(60)
            elif k == 2:
                out = [None]
                frames.append(count_python_calls(lambda: out.__setitem__(0, comm._batch(ops, True).wait(60))))
                counts = out[0]
            else:
                counts = comm._batch(ops, True).wait(60)
            for (kind, buf, p, tag), c in zip(ops, counts):
                if kind == "recv":
                    want = count + tag // 5
                    assert c == want and np.array_equal(buf[:c], piece(p, r, count + tag, "float64")[:c]), (count, k)
                    assert not buf[c:].any()
                else:
                    assert c is None
            if lone:
                counts = comm._batch(lone, True).wait(60) if k != 1 else comm.batch(lone).wait(60)
                assert r == 0 or (counts == [count, count] and all(
                    np.array_equal(got[0, tag][:count], piece(0, 1, count, "float64")) for tag in (0, 5))), (count, k)
    return frames


def _one_call_reductions_and_rooted(comm):
    """A warm blocking broadcast, reduce, allgather or reduce-scatter of host memory below the
    zero-copy size is one Python frame and gives the general path's result; the paths mix (rank 0
    takes the general one through the non-blocking forms), and an op or root that changes between
    calls of one shape is not mistaken for the last call's."""
    from pyrdma.testing import count_python_calls
    n, r = comm.size, comm.rank
    frames = {}
    for count in (1, 1000, 40_000):       # 8 B to 320 kB, under the zero-copy size (1 MiB) allgathered
        mine = piece(r, 0, count, "float64")
        everyone = np.concatenate([piece(p, 0, count, "float64") for p in range(n)])
        total = sum(piece(p, 0, count, "float64") for p in range(n))
        lo, hi = comm.segment_bounds(count)[r]
        for root in (1, 2):
            for op, want in (("sum", total), ("max", np.maximum.reduce([piece(p, 0, count, "float64")
                                                                        for p in range(n)]))):
                cases = {
                    "broadcast": (lambda: comm.broadcast(b, root=root), lambda: comm.ibroadcast(b, root=root),
                                  lambda: piece(root, 0, count, "float64")),
                    "reduce": (lambda: comm.reduce(b, op=op, root=root), lambda: comm.ireduce(b, op=op, root=root),
                               lambda: want if r == root else mine),
                    "allgather": (lambda: comm.allgather(mine, out=b), lambda: comm.iallgather(mine, out=b),
                                  lambda: everyone),
                    "reduce_scatter": (lambda: comm.reduce_scatter(mine, out=b, op=op),
                                       lambda: comm.ireduce_scatter(mine, out=b, op=op), lambda: want[lo:hi]),
                }
                for name, (call, general, expect) in cases.items():
                    def fresh():
                        size = {"allgather": n * count, "reduce_scatter": hi - lo}.get(name, count)
                        if name == "broadcast" and r != root:
                            return np.zeros(size)
                        return mine.copy() if size == count else np.zeros(size)
                    for k in range(3):                     # prepares, then warm twice
                        b = fresh()
                        if r == 0 and k == 1:
                            general().wait(60)
                        elif k == 2:
                            frames.setdefault(name, []).append(count_python_calls(call))
                        else:
                            call()
                        assert np.array_equal(b, expect()), (name, count, root, op, k)
        # the default out= of allgather and reduce_scatter, as the general path makes it
        assert np.array_equal(comm.allgather(mine.reshape(-1, 1)), everyone.reshape(-1, 1)), count
        assert np.array_equal(comm.reduce_scatter(mine), total[lo:hi]), count
    if comm.transport.name == "tcp":            # from the zero-copy size too, in buf itself
        count = 200_000
        for root in (1, 2):
            want = piece(root, 0, count, "float64")
            for k in range(3):
                b = want.copy() if r == root else np.zeros(count)
                b.flags.writeable = r != root        # the root's buffer is only read
                if r == 0 and k == 1:
                    comm.ibroadcast(b, root=root).wait(60)
                elif k == 2:
                    frames["broadcast"].append(count_python_calls(lambda: comm.broadcast(b, root=root)))
                else:
                    comm.broadcast(b, root=root)
                assert np.array_equal(b, want), (root, k)
    import pyrdma
    for bad in (lambda: comm.reduce(mine, op=["sum"]), lambda: comm.broadcast(mine, algorithm=["chain"])):
        with pytest.raises(pyrdma.UsageError):          # unhashable: named by the general path
            bad()
    return {name: sorted(set(f)) for name, f in frames.items()}


@contextlib.contextmanager
def _counting_plans(names):
    """The list of specs' planners among ``names`` called while in it (the general path plans per
    call; the one-call path only to prepare a shape), in call order."""
    from pyrdma.collectives import specs
    planned, originals = [], {name: getattr(specs, name) for name in names}

    def counting(name):
        def plan(*args, **kwargs):
            planned.append(name)
            return originals[name](*args, **kwargs)
        return plan
    for name in originals:
        setattr(specs, name, counting(name))
    try:
        yield planned
    finally:
        for name, plan in originals.items():
            setattr(specs, name, plan)


def _queued_one_calls(comm):
    """Non-blocking collectives of host memory that the one-call path takes are checked and looked
    up on the caller's thread and run as one C call each on the communicator's thread
    (HostCollectives.submit): once a blocking call prepared their shapes no spec is planned again,
    many are in flight at once, mixed with the general path's (out= of an allreduce), and each
    gives the blocking form's result, whichever order they are waited in."""
    n, r = comm.size, comm.rank
    count = 1000
    mine = piece(r, 0, count, "float64")
    everyone = np.concatenate([piece(p, 0, count, "float64") for p in range(n)])
    total = sum(piece(p, 0, count, "float64") for p in range(n))
    lo, hi = comm.segment_bounds(count)[r]
    buf = np.concatenate([piece(r, p, 10, "float64") for p in range(n)])
    send, recv = [1 + (r + 2 * p) % 3 for p in range(n)], [1 + (p + 2 * r) % 3 for p in range(n)]
    vbuf = np.concatenate([piece(r, p, send[p], "float64") for p in range(n)])
    outs = {"ar": mine.copy(), "bc": mine.copy(), "ag": np.zeros(n * count), "rs": np.zeros(hi - lo),
            "a2a": np.zeros(n * 10), "ga": np.zeros(n * count) if r == 1 else None, "sc": np.zeros(count),
            "re": mine.copy(), "a2av": np.zeros(sum(recv))}

    def issue(blocking):
        o = outs
        calls = [("a2av", lambda: comm.alltoall(vbuf, o["a2av"], send_counts=send, recv_counts=recv),
                  lambda: comm.ialltoall(vbuf, o["a2av"], send_counts=send, recv_counts=recv)),
                 ("ar", lambda: comm.allreduce(o["ar"]), lambda: comm.iallreduce(o["ar"])),
                 ("bc", lambda: comm.broadcast(o["bc"], root=1), lambda: comm.ibroadcast(o["bc"], root=1)),
                 ("ag", lambda: comm.allgather(mine, o["ag"]), lambda: comm.iallgather(mine, o["ag"])),
                 ("rs", lambda: comm.reduce_scatter(mine, o["rs"]), lambda: comm.ireduce_scatter(mine, o["rs"])),
                 ("a2a", lambda: comm.alltoall(buf, o["a2a"]), lambda: comm.ialltoall(buf, o["a2a"])),
                 ("ga", lambda: comm.gather(mine, o["ga"], root=1), lambda: comm.igather(mine, o["ga"], root=1)),
                 ("sc", lambda: comm.scatter(everyone if r == 2 else None, o["sc"], root=2),
                  lambda: comm.iscatter(everyone if r == 2 else None, o["sc"], root=2)),
                 ("re", lambda: comm.reduce(o["re"], root=2), lambda: comm.ireduce(o["re"], root=2)),
                 ("bar", lambda: comm.barrier(), lambda: comm.ibarrier())]
        return {name: (now() if blocking else later()) for name, now, later in calls}
    issue(True)                          # prepares every shape
    for o in outs.values():
        if o is not None:
            o[:] = 0
    outs["ar"][:], outs["bc"][:], outs["re"][:] = mine, mine, mine
    with _counting_plans(("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter", "alltoall", "gather",
                          "scatter", "barrier")) as planned:
        handles = issue(False)
        general = comm.iallreduce(mine, out=np.zeros(count))
        results = {name: h.wait(60) for name, h in reversed(list(handles.items()))}
        assert np.array_equal(general.wait(60), total)
    assert planned == ["allreduce"], planned              # the general path's allreduce only
    want = {"ar": total, "bc": piece(1, 0, count, "float64"), "ag": everyone, "rs": total[lo:hi],
            "a2a": np.concatenate([piece(p, r, 10, "float64") for p in range(n)]),
            "ga": everyone if r == 1 else None, "sc": piece(r, 0, count, "float64"),
            "re": total if r == 2 else None,
            "a2av": np.concatenate([piece(p, r, recv[p], "float64") for p in range(n)]), "bar": None}
    for name, expect in want.items():
        got = results[name]
        assert (got is None and expect is None) or (got is outs.get(name) and np.array_equal(got, expect)), name
    return True


def _queued_messages(comm):
    """Non-blocking messages of host memory whose shapes a blocking call prepared (isend, irecv,
    isendrecv, a batch not waited on at once, and a blocking recv behind them) run as one C call
    each, queued with their numbers taken at the call: no spec is planned again but the general
    path's (a tag not prepared), whose messages keep one numbering per pair with theirs."""
    from pyrdma.collectives import specs
    n, r = comm.size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    sent = {tag: piece(r, right, 50 + tag, "float64") for tag in (3, 4, 5, 6, 9)}
    got = {tag: np.zeros(60 + tag) for tag in (3, 4, 5, 6, 9)}
    batch = [("send", sent[6], right, 6), ("recv", got[6], left, 6)]

    for tag in (4, 5):                              # the blocking calls prepare every shape but tag 9's
        comm.send(sent[tag], right, tag)
        comm.recv(got[tag], left, tag)
    comm.sendrecv(sent[3], right, got[3], left, 3)
    comm._batch(batch, True)
    for y in got.values():
        y[:] = 0
    planned = []
    plan = specs.p2p

    def counting(comm, buf, dst, src, tag, *numbered):
        planned.append(tag)
        return plan(comm, buf, dst, src, tag, *numbered)
    specs.p2p = counting
    try:
        handles = [comm.isend(sent[4], right, 4), comm.irecv(got[4], left, 4),
                   comm.isendrecv(sent[3], right, got[3], left, 3),
                   comm.isend(sent[9], right, 9), comm.irecv(got[9], left, 9), comm.batch(batch),
                   comm.isend(sent[5], right, 5)]
        received = comm.recv(got[5], left, 5)
        results = [h.wait(60) for h in reversed(handles)][::-1]
    finally:
        specs.p2p = plan
    assert set(planned) == {9}, planned             # the general path's isend and irecv only
    assert results == [None, 54, 53, None, 59, [None, 56], None] and received == 55, (results, received)
    for tag in (3, 4, 5, 6, 9):
        assert np.array_equal(got[tag][:50 + tag], piece(left, r, 50 + tag, "float64")), tag
        assert not got[tag][50 + tag:].any(), tag
    return True


def _prepared_beside_queued(comm):
    """Shapes first met while calls are queued are prepared then for the one-call path: an
    iallgather behind another, an all-to-all with counts behind them, an irecv behind its isend, a
    batch of a receive and a send (one exchange) behind them. The large allgather needs the
    transport's buffer grown while the small one, prepared with its region, is queued: that call
    goes the general way, whose run grows the buffer, and the next is prepared. Blocking calls
    behind queued ones (barrier, allreduce, broadcast) are queued after them as one C call each and
    waited for. So each shape is planned once (the large allgather once more where it met a
    queued call), and nothing after the second round. (Before, a shape first met behind a queued
    call, and any blocking collective behind one, took the general path at every call.)"""
    n, r = comm.size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    comm.allgather(piece(r, 0, 7, "float64"))          # the small shape prepared, the buffer made
    big = comm.transport._own.nbytes // (8 * n) + 64     # float64s each: out outgrows the buffer
    assert big * 8 < comm.zero_copy_bytes, (big, comm.zero_copy_bytes)     # (copied, not lent)
    counts = [[(s + 2 * p) % 4 * 5 for p in range(n)] for s in range(n)]     # counts[sender][receiver], zeros too
    rounds = []
    with _counting_plans(("allgather", "alltoall", "p2p", "allreduce", "broadcast", "barrier")) as planned:
        for k in range(4):
            planned.clear()
            # each blocking call behind the queued one before it (which its wait runs first)
            before = comm.ibarrier()
            comm.barrier()
            small = comm.iallgather(piece(r, k, 7, "float64"))
            large = comm.iallgather(piece(r, k, big, "float64"))
            mine = np.concatenate([piece(r, p + k, counts[r][p], "float64") for p in range(n)])
            a2av = comm.ialltoall(mine, send_counts=counts[r], recv_counts=[counts[p][r] for p in range(n)])
            summed = np.full(9, r + k, "float64")
            assert comm.allreduce(summed) is summed and (summed == sum(range(n)) + n * k).all()
            send = comm.isend(piece(r, k, 33, "float64"), right, 12)
            got = np.zeros(40)
            recv = comm.irecv(got, left, 12)
            sent = np.full(5, k + 1 if r == 1 else -1, "int32")
            assert comm.broadcast(sent, root=1) is sent and (sent == k + 1).all()
            got2 = np.zeros(20, "int64")             # a batch of a receive and a send: one exchange
            pair = comm.batch([("recv", got2, left, 13), ("send", piece(r, k, 17, "int64"), right, 13)])
            assert pair.wait(60) == [17, None] and np.array_equal(got2[:17], piece(left, k, 17, "int64"))
            assert recv.wait(60) == 33 and send.wait(60) is None and before.wait(60) is None
            assert np.array_equal(got[:33], piece(left, k, 33, "float64")) and not got[33:].any()
            assert np.array_equal(a2av.wait(60), np.concatenate([piece(p, r + k, counts[p][r], "float64")
                                                                 for p in range(n)]))
            for h, count in ((large, big), (small, 7)):
                assert np.array_equal(h.wait(60), np.concatenate([piece(p, k, count, "float64") for p in range(n)]))
            rounds.append(sorted(planned))
    # (the large allgather is planned once more where the small one had run before it was made)
    assert rounds[0] in ([*["allgather"] * k, "allreduce", "alltoall", "barrier", "broadcast", "p2p", "p2p", "p2p"]
                         for k in (1, 2)) and rounds[1] in ([], ["allgather"]) and rounds[2] == rounds[3] == [], rounds
    # what refuses the large one beside queued calls, by itself
    from pyrdma.collectives import hostplans
    t = comm.transport
    region, nbytes = t.own_region(0), t._own.nbytes
    assert hostplans.beside_queued(hostplans.allgather, (comm, np.zeros(nbytes // (8 * n) + 64), None, None)) is None
    assert t.own_region(0) is region and t._own.nbytes == nbytes          # not grown
    fits = hostplans.beside_queued(hostplans.allgather, (comm, np.zeros(nbytes // (8 * n)), None, None))
    assert len(fits) == 1 and fits[0] is not None and t._own.nbytes == nbytes
    return True


def _avg_one_call(comm):
    """op="avg" through the transport's buffer is one C call (floating-point inputs divided by n
    after the copy in, float16 rounded toward zero, integer results after the run), bit for bit
    the general path's (taken with dtype= given, and for bfloat16 by an ml_dtypes array, which has
    no buffer protocol): a warm call plans nothing. bfloat16 comes as uint16 bits with
    dtype="bfloat16", as the torch backend passes its tensors."""
    import ml_dtypes
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(r)
    bits = (rng.standard_normal(77) * 1e3).astype(ml_dtypes.bfloat16).view(np.uint16)
    # (one-call input, its dtype=, the general path's input, its dtype=)
    inputs = [(x, None, x, x.dtype) for x in (
        (rng.standard_normal(301) * 1e3).astype("float32"), rng.standard_normal(301) * 1e3,
        rng.integers(-10 ** 6, 10 ** 6, 301).astype("int32"),
        # float16: the largest finite values (scaled toward zero, their mean stays finite), subnormals
        np.concatenate([rng.standard_normal(40) * 10, [65504, -65504, 65000, 6e-8, -3e-7, 1e-5, 0]]).astype("float16"))]
    inputs.append((bits, "bfloat16", bits.view(ml_dtypes.bfloat16), None))
    rounds = []
    with _counting_plans(("allreduce", "reduce", "reduce_scatter")) as planned:
        for _ in range(2):
            planned.clear()
            for x, dtype, g, gtype in inputs:
                general = {"allreduce": comm.allreduce(g.copy(), op="avg", dtype=gtype),
                           "reduce": comm.reduce(g.copy(), op="avg", root=1, dtype=gtype),
                           "reduce_scatter": comm.reduce_scatter(g.copy(), op="avg", dtype=gtype)}
                one = {"allreduce": comm.allreduce(x.copy(), op="avg", dtype=dtype),
                       "reduce": comm.reduce(x.copy(), op="avg", root=1, dtype=dtype),
                       "reduce_scatter": comm.reduce_scatter(x.copy(), op="avg", dtype=dtype)}
                for name, got in one.items():
                    want = general[name]
                    assert (got is None) == (want is None) and (got is None or got.tobytes() == want.tobytes()), \
                        (name, x.dtype)
            rounds.append(len(planned))
    # the 15 general calls plan at every call; the first round prepares the other 15
    assert rounds == [15 + 15, 15], rounds
    return True


def _in_place_one_call(comm):
    """An allgather whose input is this rank's block of its output (FSDP's all-gather of a shard,
    on every rank: rank 0's starts where the output does) and an all-to-all with out=buf are one
    C call each when warm, and right."""
    n, r = comm.size, comm.rank
    rounds = []
    with _counting_plans(("allgather", "alltoall")) as planned:
        for k in range(2):
            planned.clear()
            out = np.zeros(n * 50, "float32")
            out[r * 50:(r + 1) * 50] = piece(r, k, 50, "float32")
            assert comm.allgather(out[r * 50:(r + 1) * 50], out=out) is out
            assert np.array_equal(out, np.concatenate([piece(p, k, 50, "float32") for p in range(n)]))
            buf = np.concatenate([piece(r, p + k, 20, "int64") for p in range(n)])
            assert comm.alltoall(buf, out=buf) is buf
            assert np.array_equal(buf, np.concatenate([piece(p, r + k, 20, "int64") for p in range(n)]))
            rounds.append(len(planned))
    assert rounds[1] == 0, rounds
    return True


@pytest.mark.parametrize("transport", ["tcp", pytest.param("rdma", marks=pytest.mark.device)])
def test_warm_blocking_host_collectives_are_one_python_call_each(transport):
    with World(3, transport, timeout=TIMEOUT, start_timeout=START_TIMEOUT) as w:
        assert all(w.run(_prepared_beside_queued, timeout=300))
        assert all(w.run(_avg_one_call, timeout=300))
        assert all(w.run(_in_place_one_call, timeout=300))
        for rank, frames in enumerate(w.run(_one_call_copies, timeout=300)):
            # the root joins its list of pieces (_joined, the cost model's lend test, numpy's
            # concatenate: a few frames; the general path's planning would be dozens), or over TCP
            # sends each from where it lies (_joined and the lend test)
            joined = frames.pop("scatter_list")
            assert len(joined) == (3 if transport == "tcp" else 2), joined
            assert all(k <= 6 for k in joined) if rank == 2 else set(joined) == {1}, (rank, joined)
            assert frames == {name: [1, 1, 1] for name in ("alltoall", "alltoallv", "gather", "scatter")}, \
                f"rank {rank}: Python frames per call (the lambda's only): {frames}"
        for frames in w.run(_one_call_reductions_and_rooted, timeout=300):
            assert frames == {name: [1] for name in ("broadcast", "reduce", "allgather", "reduce_scatter")}, \
                f"Python frames per call (the lambda's only): {frames}"
        assert all(w.run(_queued_one_calls, timeout=300))
        assert all(w.run(_queued_messages, timeout=300))
        for rank, frames in enumerate(w.run(_one_call_batches, timeout=300)):
            # the lambda, _batch, _is_cuda, _one_call_steps, Done and its wait (the general path's: 162)
            assert frames == [6] * 3, f"rank {rank}: Python frames per batch of 8: {frames}"
        for rank, (frames, exchanges) in enumerate(w.run(_one_call_messages, timeout=300)):
            assert frames == ([1] * (12 if transport == "tcp" else 9) if rank < 2 else []), \
                f"rank {rank}: Python frames per send/recv (the lambda's only): {frames}"
            assert exchanges == ([2] * (4 if transport == "tcp" else 3) if rank < 2 else []), \
                f"rank {rank}: Python frames per sendrecv (the lambda's and sendrecv's): {exchanges}"


def _each_once(comm):
    """Every new operation once, at a size that takes several chunks."""
    n, r = comm.size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    got = comm.gather(piece(r, 0, 700, "float64"), root=n - 1)
    if r == n - 1:
        assert np.array_equal(got, np.concatenate([piece(p, 0, 700, "float64") for p in range(n)]))
    full = np.concatenate([piece(p, 1, 300, "int32") for p in range(n)]) if r == 2 else None
    assert np.array_equal(comm.scatter(full, out=np.zeros(300, np.int32), root=2), piece(r, 1, 300, "int32"))
    send = [uneven(r, p, n) for p in range(n)]
    buf = np.concatenate([piece(r, p, send[p], "float32") for p in range(n)])
    want = np.concatenate([piece(p, r, uneven(p, r, n), "float32") for p in range(n)])
    assert np.array_equal(comm.alltoall(buf, send_counts=send), want)
    y = np.zeros(1000)
    assert comm.sendrecv(piece(r, right, 1000, "float64"), right, y, left, tag=9) == 1000
    assert np.array_equal(y, piece(left, r, 1000, "float64"))
    return True


@pytest.mark.parametrize("transport", [pytest.param("tcp"), pytest.param("rdma", marks=pytest.mark.device)])
def test_each_new_operation_at_8_ranks(worlds, transport):
    assert all(worlds(transport, 8).run(_each_once, timeout=600))


def _scatter_from_pieces(comm):
    """scatter(list of pieces): the array form's result at every size (copied in below the
    zero-copy size, each piece sent from where it lies from it on, blocking and not), the pieces
    untouched; a wrong list is named before anything is sent."""
    import pyrdma
    n, r = comm.size, comm.rank
    for count in (3, 1000, 300_000):                       # 24 B to 2.4 MB per rank (zero_copy: 1 MiB)
        for root in range(n):
            pieces = [piece(p, root, count, "float64") for p in range(n)] if r == root else None
            keep = [p.copy() for p in pieces] if pieces else None
            out = np.zeros(count)
            assert comm.scatter(pieces, out=out, root=root) is out
            assert np.array_equal(out, piece(r, root, count, "float64")), (count, root)
            got = comm.iscatter(pieces, root=root).wait(60) if r == root else \
                comm.iscatter(None, out=np.zeros(count), root=root).wait(60)
            assert np.array_equal(got, piece(r, root, count, "float64")), (count, root)
            assert keep is None or all(np.array_equal(a, b) for a, b in zip(pieces, keep))
    errors = []
    for bad in ([np.zeros(4)] * (n + 1), [np.zeros(4)] * (n - 1) + [np.zeros(5)],
                [np.zeros(4)] * (n - 1) + [np.zeros(4, np.int32)]):
        try:
            comm.scatter(bad, out=np.zeros(4), root=r)       # every rank its own root: refused at once
        except pyrdma.UsageError as exc:
            errors.append(str(exc).split(";")[0])
    return errors


@pytest.mark.parametrize("transport", ["tcp", pytest.param("rdma", marks=pytest.mark.device)])
@pytest.mark.parametrize("size", [2, 3])
def test_scatter_from_a_list_of_pieces(transport, size):
    with World(size, transport, timeout=TIMEOUT, start_timeout=START_TIMEOUT) as w:
        for errors in w.run(_scatter_from_pieces, timeout=300):
            last = f"buf[{size - 1}] must be a piece like out (4 elements of float64)"
            assert errors == [f"scatter: buf is a list of {size + 1} pieces", last, last], errors
