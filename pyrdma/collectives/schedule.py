"""Schedules: a collective planned once as a flat list of steps, then executed.

The algorithms (algorithms/: ring.py, tree.py, rooted.py, exchange.py) plan; they never send. A
Schedule holds two int64 arrays:

    steps   (S, 8): kind, send_peer, recv_peer, send_first, nsend, recv_first, nrecv, consume
    chunks  (C, 3): offset, nbytes, aux              (byte offsets into the work area)

A step of kind EXCHANGE sends chunks[send_first:+nsend] to send_peer while it receives
chunks[recv_first:+nrecv] from recv_peer and consumes each received one: COPY stores it at
``offset``, REDUCE does work[offset] = op(work[offset], data), REDUCE_LOWER work[offset] =
op(work[aux], data) and REDUCE_UPPER work[offset] = op(data, work[aux]) (the operand order that
keeps recursive doubling bit-identical across ranks). NONE drops it (zero-byte barrier messages).
COPY_UPTO receives one point-to-point message of at most the step's chunks (its sender's chunks of
the same max_message, the last one shorter): the first header's count says how long it is, and
the receive ends with its last chunk.
Sends run ahead of the consumption (Engine._exchange). WAIT_SENDS waits until every send to
send_peer (-1: to every peer) has left local memory. OFFER and FETCH move one span of chunks by
the receiver's RDMA READ: OFFER tells send_peer where they lie (a small message), FETCH takes
recv_peer's offer and reads them (COPY); the offering rank may reuse them once it has a later
message from the reader. Over a transport that cannot read (TCP) they are a plain send and a
COPY receive of the chunks. ASK, PUT, NOTICE and LANDED move one span by the sender's RDMA WRITE
into the receiver's chunks: ASK tells recv_peer where the chunks it sends here go (a small
message), PUT takes send_peer's ask and writes its chunks there, NOTICE sends send_peer a
zero-byte message (behind a PUT: its chunks are in place; ahead of one: they will be written, not
sent), LANDED takes recv_peer's notice; RDMA only (the socket link refuses them).
SPREAD steps next to one another are EXCHANGEs the C engine runs
together (each one's chunks sent as its peer's credits allow and taken as they arrive, whichever
peer first); the flow tests' Python model (tests/flowmodel.py) runs them one after another,
which their order must allow as well.

The C engine (pyrdma._engine) executes them, one call per collective without the GIL, over queue
pairs or sockets.
"""
import numpy as np

from pyrdma.collectives.work import HOST

EXCHANGE, WAIT_SENDS, OFFER, FETCH, SPREAD, ASK, PUT, LANDED, NOTICE = 0, 1, 2, 3, 4, 5, 6, 7, 8
NONE, COPY, REDUCE, REDUCE_LOWER, REDUCE_UPPER, COPY_UPTO = 0, 1, 2, 3, 4, 5
STEP_COLUMNS, CHUNK_COLUMNS = 8, 3


class Schedule:
    """A planned collective. ``result_offset``: where in the work area the result lies afterwards
    (recursive doubling may end in the second half of its double buffer). ``program``: set by the
    C engine the first time it runs the schedule (checked once, then trusted)."""

    __slots__ = ("steps", "chunks", "result_offset", "program")

    def __init__(self, steps, chunks, result_offset=0):
        self.steps = np.array(steps, np.int64).reshape(-1, STEP_COLUMNS)
        self.chunks = np.array(chunks, np.int64).reshape(-1, CHUNK_COLUMNS)
        self.steps.flags.writeable = False       # cached and shared: nobody may edit one
        self.chunks.flags.writeable = False
        self.result_offset = result_offset
        self.program = None            # the C engine's checked form (pyrdma._engine.Program), once run

    def __repr__(self):
        return f"<Schedule {len(self.steps)} steps, {len(self.chunks)} chunks>"


class Builder:
    """Accumulates the steps of one rank's part of a collective."""

    def __init__(self):
        self.steps = []
        self.chunks = []

    def _add_chunks(self, chunks):
        first = len(self.chunks)
        self.chunks.extend((c[0], c[1], c[2] if len(c) > 2 else 0) for c in chunks)
        return first

    def exchange(self, send_peer, send_chunks, recv_peer, recv_chunks, consume, kind=EXCHANGE):
        """Send ``send_chunks`` to send_peer while receiving ``recv_chunks`` from recv_peer (either
        peer may be None). ``kind`` SPREAD: run together with the SPREAD steps next to it (at most
        n - 1 of them)."""
        send_chunks = send_chunks if send_peer is not None else ()
        recv_chunks = recv_chunks if recv_peer is not None else ()
        s0 = self._add_chunks(send_chunks)
        r0 = self._add_chunks(recv_chunks)
        self.steps.append((kind, -1 if send_peer is None else send_peer, -1 if recv_peer is None else recv_peer,
                           s0, len(send_chunks), r0, len(recv_chunks), consume))

    def send(self, peer, chunks):
        self.exchange(peer, chunks, None, (), NONE)

    def offer(self, peer, chunks):
        """Let ``peer`` read ``chunks`` (one span) from here (its fetch)."""
        self.steps.append((OFFER, peer, -1, self._add_chunks(chunks), len(chunks), 0, 0, NONE))

    def fetch(self, peer, chunks):
        """Read ``chunks`` (one span) from ``peer``'s offer."""
        self.steps.append((FETCH, -1, peer, 0, 0, self._add_chunks(chunks), len(chunks), COPY))

    def ask(self, peer, chunks):
        """Tell ``peer`` where ``chunks`` (one span) lie here, for its put of them."""
        self.steps.append((ASK, -1, peer, 0, 0, self._add_chunks(chunks), len(chunks), COPY))

    def put(self, peer, chunks):
        """Write ``chunks`` (one span) where ``peer`` asked (a notice behind them tells it they landed)."""
        self.steps.append((PUT, peer, -1, self._add_chunks(chunks), len(chunks), 0, 0, NONE))

    def notice(self, peer):
        """A zero-byte message to ``peer`` that its landed takes."""
        self.steps.append((NOTICE, peer, -1, 0, 0, 0, 0, NONE))

    def landed(self, peer, chunks):
        """Take ``peer``'s notice about ``chunks`` (behind its put of them: they are in place here)."""
        self.steps.append((LANDED, -1, peer, 0, 0, self._add_chunks(chunks), len(chunks), COPY))

    def recv(self, peer, chunks, consume):
        self.exchange(None, (), peer, chunks, consume)

    # Rooted collectives in which the root only sends (broadcast, scatter) or only receives (reduce,
    # gather) add a zero-byte message between the root and the rank after it, the other way: so the
    # root both sends and receives, and ranks that each name themselves root (which would otherwise
    # all only send, or all wait) compare a description with one another and fail at that call.

    def greet_root(self, n, r, root):
        """At the start of a collective whose root only sends: the rank after the root tells it
        (which takes the message at its end: root_greeted). Sent at the start, not once the data
        is in, so that the root's wait for it overlaps its sends instead of adding a round trip."""
        if n > 1 and r == (root + 1) % n:
            self.send(root, ((0, 0, 0),))

    def root_greeted(self, n, r, root):
        if n > 1 and r == root:
            self.recv((root + 1) % n, ((0, 0, 0),), NONE)

    def announce_root(self, n, r, root):
        """At the start of a collective whose root only receives: the root tells the rank after it
        (which takes the message at its end: heard_root)."""
        if n > 1 and r == root:
            self.send((root + 1) % n, ((0, 0, 0),))

    def heard_root(self, n, r, root):
        if n > 1 and r == (root + 1) % n:
            self.recv(root, ((0, 0, 0),), NONE)

    def wait_sends(self, peer=None):
        self.steps.append((WAIT_SENDS, -1 if peer is None else peer, -1, 0, 0, 0, 0, NONE))

    def build(self, result_offset=0):
        return Schedule(self.steps, self.chunks, result_offset)


def consumer(work, reduce, write=HOST.write):
    """consume(kind, chunk, data) over a work area with ``reduce(dst, a, b)`` (dst = op(a, b) on
    uint8 views), received chunks stored by its kind's ``write`` (work.HostMemory)."""
    def consume(kind, chunk, data):
        off, n, aux = chunk
        if kind == COPY:
            write(work[off:off + data.nbytes], data)
        elif kind == REDUCE:
            dst = work[off:off + n]
            reduce(dst, dst, data)
        elif kind == REDUCE_LOWER:
            reduce(work[off:off + n], work[aux:aux + n], data)
        elif kind == REDUCE_UPPER:
            reduce(work[off:off + n], data, work[aux:aux + n])
    return consume
