"""What both transports share: the description every message carries, the abort reasons, the
errors, and the waits with their wait-for diagnosis (_Waits)."""
import os
import struct

import numpy as np

from pyrdma.collectives.algorithms import WIRE_NAMES
from pyrdma.errors import PeerError, RDMAError, UsageError

# Each message costs a post, a completion and a Python step, so large chunks matter once messages
# are big. Measured in the Soft-RoCE VM (2 ranks, one boot), 1 MiB against 256 KiB messages: a
# 1 MiB allreduce 67/61 ms (ring/tree) against 76/66, an 8 MiB one 452/433 against 548/476.
# Credits go back every slots/2 messages, so fewer slots would add credit messages to every stream
# of small chunks.
DEFAULT_RDMA_MESSAGE = 1024 * 1024
DEFAULT_TCP_MESSAGE = 1024 * 1024
DEFAULT_SLOTS = 8
# RC's local ACK timeout, 4.096 us * 2^n, before the sender resends everything not yet acknowledged.
# perftest's 14 (67 ms) is short where the responder's work is software: on Soft-RoCE in the
# emulated VM the ACKs of a busy stream came late and every 8 MiB allreduce resent data (about 10
# retries per call). 2 ranks, 14 against 20 interleaved in one boot, 3 runs each: ring 440 against
# 406 ms, tree 465 against 388 ms, no retries with 20. NCCL_IB_TIMEOUT defaults to 20 too; a dead
# peer is found by the collective's own timeout anyway.
DEFAULT_QP_TIMEOUT = 20
MAX_RDMA_MESSAGE = 4 * 1024 * 1024   # the immediate carries a 23-bit length
MAX_RANKS = 0xFFFE                   # a REPORT carries a 16-bit rank
USER_MR_CACHE = 8                    # registrations of callers' buffers kept for reuse
CLOSE_POLL = 0.2                     # the longest a wait sleeps before it looks at interrupt() and signals

# Abort reasons (carried by ABORT messages)
PEER_FAILED, MISMATCH, LEFT = 0, 1, 2
_REASONS = {PEER_FAILED: "failed", MISMATCH: "called a collective that does not match", LEFT: "left"}
NO_CULPRIT = 0xFFFFFF


def abort_error(reporter, culprit, reason, me=None):
    """The exception a rank (``me``) raises when ``reporter`` says the group failed because of ``culprit``."""
    if culprit == me and reason == PEER_FAILED:
        return PeerError(f"rank {reporter} gave up on this rank (rank {me}): it waited for it longer than its "
                         f"timeout; the communicator is unusable now", peer=reporter)
    who = "an unknown rank" if culprit == NO_CULPRIT else f"rank {culprit}"
    if reason == MISMATCH:
        err = UsageError(f"rank {reporter} found that {who} called a different collective or sent a different "
                         f"message (a collective's size, dtype, op, root or algorithm, or a message's tag or "
                         f"dtype, differ across ranks); the communicator is unusable now")
        err.peer = culprit if culprit != NO_CULPRIT else reporter
        return err
    return PeerError(f"rank {reporter} reports that {who} {_REASONS.get(reason, 'failed')}; "
                     f"the communicator is unusable now", peer=reporter if culprit == NO_CULPRIT else culprit)


def mismatch_error(peer, what, why="the ranks disagree on the collective (buffer size, dtype, op, root or "
                                   "algorithm differ across ranks)"):
    err = UsageError(f"rank {peer} sent {what}: {why}")
    err.peer = peer
    return err


def closed_error():
    err = UsageError("the communicator was closed while this collective was running")
    err.closed = True          # Communicator._fail tells the peers this rank left, not that they mismatched
    return err


# ------------------------------------------------------------------------------------------------
# The description of a collective. Every message carries it (with its length) in front of its
# payload and the receiver compares it, byte for byte, with the one of the collective it runs
# itself: any difference in kind, count, dtype, op, root, algorithm, piece or call number is a
# mismatch, whatever the sizes. A fixed 48-byte header: negligible next to a message.

DESC = struct.Struct("<QQQQIHBBBB2x")   # seq, count, lo, hi, root, dtype, kind, op, algorithm, placed
# placed (set by the engine, never by describe): an offer's, ask's or landed header's (RDMA READ or
# WRITE straight between the ranks' memory), so that no block's own message is taken for one
HEADER = struct.Struct("<44sI")          # description, payload length
assert DESC.size == 44 and HEADER.size == 48
KINDS = ("", "allreduce", "reduce", "broadcast", "allgather", "reduce_scatter", "barrier",
         "allreduce-direct", "broadcast-direct", "test", "gather", "scatter", "alltoall", "send")
DESC_OPS = ("", "sum", "prod", "min", "max", "avg")
DESC_ALGORITHMS = WIRE_NAMES          # by wire id, from the registry (pyrdma.collectives.algorithms)
NO_ROOT = 0xFFFFFFFF
PLACED_AT = 41                          # the placed byte (engine.pxd DESC_PLACED_AT)
BYTE_DTYPE = 0x8000                     # dtype field of byte-copying collectives: numpy's type number


def describe(seq, kind, count=0, dtype=0, op="", root=None, algorithm="", lo=0, hi=0):
    """The packed description of a collective (what set_tag takes). ``dtype``: pyrdma._reduce's code
    of a reduction's dtype, or a numpy dtype for collectives that copy bytes."""
    if not isinstance(dtype, int):
        dt = np.dtype(dtype)
        dtype = BYTE_DTYPE | ((dt.num & 0x7F) << 8) | min(dt.itemsize, 0xFF)
    return DESC.pack(seq & 0xFFFFFFFFFFFFFFFF, count, lo, hi, NO_ROOT if root is None else root, dtype,
                     KINDS.index(kind), DESC_OPS.index(op), DESC_ALGORITHMS.index(algorithm), 0)


def describe_message(seq, nbytes, dtype, tag):
    """The description of a point-to-point message: ``seq`` counts the messages of one sender to one
    receiver (not the collectives: ranks outside a send never fall out of step), ``count`` is its
    length in bytes (what the receiver learns from it) and ``root`` carries the tag."""
    return describe(seq, "send", count=nbytes, dtype=dtype, root=tag)


def too_long_error(peer, rank, nbytes, capacity):
    err = UsageError(f"rank {peer} sent a {nbytes}-byte message where rank {rank} posted a receive of {capacity} "
                     f"bytes: a message longer than the receive buffer is an error, never truncated")
    err.peer = peer
    return err


def explain(desc):
    """A description as text, for error messages."""
    try:
        seq, count, lo, hi, root, dtype, kind, op, algo, placed = DESC.unpack(desc)
    except struct.error:
        return f"an unreadable description {bytes(desc)[:16].hex()}"

    def name(table, i):
        return table[i] if i < len(table) else f"#{i}"
    if dtype & BYTE_DTYPE:
        num, itemsize = (dtype >> 8) & 0x7F, dtype & 0xFF
        names = {np.dtype(t).num: np.dtype(t).name for t in set(np.sctypeDict.values())}
        dname = names.get(num, f"numpy type {num}") if num != np.dtype("V").num else f"V{itemsize}"
    else:
        from pyrdma import _reduce
        dname = name(_reduce.DTYPE_NAMES, dtype)
    parts = [f"call #{seq} {name(KINDS, kind) or 'collective'}", f"count={count}", f"dtype={dname}"]
    if op:
        parts.append(f"op={name(DESC_OPS, op)}")
    if name(KINDS, kind) == "send":
        parts[0] = f"point-to-point message #{seq}"
        parts[1] = f"{count} bytes"
        parts.append(f"tag={root}")
    elif root != NO_ROOT:
        parts.append(f"root={root}")
    if algo:
        parts.append(f"algorithm={name(DESC_ALGORITHMS, algo)}")
    if hi and (lo, hi) != (0, count):
        parts.append(f"piece [{lo}, {hi})")
    if placed:
        parts.append("an offer, ask or landed header (of a block moved by RDMA READ or WRITE)")
    return ", ".join(parts)


def check_header(peer, rank, got_desc, got_len, want_desc, want_len):
    """UsageError (a mismatch) unless a received message is the one this rank expects."""
    if got_desc[:8] + got_desc[16:] == want_desc[:8] + want_desc[16:] and KINDS[want_desc[38]] == "send" \
            and got_len > want_len:        # a point-to-point message longer than the receive
        raise too_long_error(peer, rank, DESC.unpack(got_desc)[1], want_len)
    if got_desc[:PLACED_AT] + got_desc[PLACED_AT + 1:] == want_desc[:PLACED_AT] + want_desc[PLACED_AT + 1:] \
            and got_desc[PLACED_AT] != want_desc[PLACED_AT]:
        moved, expected = ("a block's own message", "an offer, ask or landed header") if want_desc[PLACED_AT] \
            else ("an offer, ask or landed header", "a block's own message")
        plain = want_desc[:PLACED_AT] + b"\0" + want_desc[PLACED_AT + 1:]
        raise mismatch_error(peer, f"{moved} where rank {rank} expected {expected} ({explain(plain)})",
                             "the two ranks' counts for the block between them disagree: one moves it by RDMA READ "
                             "or WRITE (from the size where that pays), the other through the slots")
    if got_desc != want_desc:
        if KINDS[want_desc[38]] == "send" and got_desc[38] == want_desc[38] and got_desc[:8] == want_desc[:8]:
            err = _message_mismatch(peer, rank, got_desc, want_desc)
            if err is not None:
                raise err
        raise mismatch_error(peer, f"a message of a different collective ({explain(got_desc)}) where rank {rank} "
                                   f"runs {explain(want_desc)}")
    if got_len != want_len:
        raise mismatch_error(peer, f"a {got_len}-byte message where rank {rank} expected {want_len} bytes")


def _message_mismatch(peer, rank, got_desc, want_desc):
    """The error where the point-to-point message a receive takes next (its sender's next, by
    number) differs from the receive in its tag or dtype, saying which and that messages are taken
    in order; None where neither differs."""
    got, want = explain(got_desc).split(", "), explain(want_desc).split(", ")
    expected = [w for g, w in zip(got, want) if g != w and w.startswith(("tag=", "dtype="))]
    if not expected:
        return None
    return mismatch_error(peer, f"{', '.join(got)} where rank {rank}'s receive from it expects "
                                f"{', '.join(expected)}",
                          "a receive takes its sender's next message, so the sends and receives of two "
                          "ranks must come in the same order, with the same tags and dtypes (tags are "
                          "checked, not matched out of order)")


def _as_desc(desc):
    """set_tag's argument: a description from describe(), or an int (a bare call number)."""
    if isinstance(desc, (bytes, bytearray)) and len(desc) == DESC.size:
        return bytes(desc)
    if isinstance(desc, (int, np.integer)):
        return describe(int(desc), "test")
    raise UsageError(f"set_tag takes a description from describe(), got {desc!r}")


def _grow(nbytes, minimum=64 * 1024):
    return max(minimum, 1 << max(0, int(nbytes) - 1).bit_length())


class _Waits:
    """Timeouts and the words of the wait-for diagnosis, for both transports: the C engine waits,
    asks around before its deadline and keeps the answers (``reports``, {peer: the rank it waits
    for}); _stall_error names the rank to blame from them."""

    # True while a collective runs behind the caller's back (a non-blocking one, on the
    # communicator's thread): its waits sleep rather than spin, leaving the CPU to the caller.
    background = False
    # point-to-point messages of this many bytes or more go by rendezvous where the transport can
    # write into the receiver's memory (RDMA); 0: never
    rendezvous_bytes = 0
    # whether a CPU at the ends moves the data of an RDMA operation (a software RDMA device at any
    # rank: the cost model's ``copy``), agreed by every rank
    software = False

    def _init_waits(self, timeout):
        if self.size > MAX_RANKS:
            raise UsageError(f"at most {MAX_RANKS} ranks are supported, got {self.size}")
        self.timeout = float(timeout)
        self.failure = None
        self.reports = {}

    def finish_sends(self, seconds):
        """Let the sends already posted complete (at most ``seconds``) before close(); here they
        always have when a run returns."""

    def interrupt(self):
        """Make every wait, now and later, raise UsageError ("closed") within CLOSE_POLL seconds
        (any thread may call this; close() still has to follow, once the collective has left)."""
        self.engine.interrupt()

    def _chain_end(self, peer):
        """Follow "X waits for Y" reports from ``peer``: (last rank, the chain)."""
        chain = [peer]
        while chain[-1] in self.reports:
            nxt = self.reports[chain[-1]]
            if nxt in chain or nxt == self.rank or not 0 <= nxt < self.size:
                break
            chain.append(nxt)
        return chain[-1], chain

    def _stall_error(self, peer, what):
        suspect, chain = self._chain_end(peer)
        t = f"{self.timeout:g} s"
        if self.reports.get(suspect) == self.rank:
            return PeerError(f"rank {self.rank} and rank {suspect} wait for each other (for {what}) since {t}: "
                             f"the ranks called different collectives?", peer=suspect)
        if suspect == peer:
            return PeerError(f"rank {peer} did not answer within {t} while rank {self.rank} waited for {what} "
                             f"(dead or stalled?)", peer=peer)
        path = " -> ".join(f"rank {r}" for r in chain)
        return PeerError(f"rank {suspect} is dead or stalled: rank {self.rank} waited {t} for {what} from rank "
                         f"{peer}, and the wait-for chain {path} ends at rank {suspect}, which does not answer",
                         peer=suspect)


_KIND_DATA, _KIND_CREDIT, _KIND_ABORT, _KIND_CONTROL = 0, 1, 2, 3
def _malformed(peer, what):
    err = PeerError(f"rank {peer} sent a malformed frame ({what}); its connection is dropped", peer=peer)
    err.malformed = True
    return err


def _imm_abort(culprit, reason):
    return (_KIND_ABORT << 30) | ((reason & 0x3F) << 24) | (culprit & 0xFFFFFF)


class _EngineFailures:
    """The C engine's failures (``self.engine.failure()``) as exceptions of the one hierarchy, for
    both of its links; ``_link_error(peer, a, b)`` says what a failed link means on each. And the
    abort that tells the peers, over the engine's link."""

    def abort(self, culprit, reason):
        """Tell every peer (best effort: a full queue drops it) that this group failed because of
        ``culprit``: the culprit too, which may only be late. On the socket link it may still hold
        address frames of ours unread, pointing into memory that is the caller's again: it reads
        the abort right behind them, and where the abort is dropped the word each frame names
        (Engine.live, changed by the failed run) fails its read all the same."""
        if self._closed:
            return
        for p in self.peers:
            self.engine.post_control(p, _imm_abort(culprit, reason))

    def engine_failed(self):
        """Record the engine's failure as this transport's (every later collective raises it) and
        return it: an exception of the one hierarchy."""
        if self.failure is None:
            self.failure = self._engine_error()
        return self.failure

    def _engine_error(self):
        from pyrdma import _engine
        kind, peer, what, a, b, desc = self.engine.failure()
        name = _engine.FAILURES.get(kind)
        if name == "python":
            return self.engine.python_error()
        if name == "closed":
            return closed_error()
        if name == "abort":
            return abort_error(peer, a, b, self.rank)
        if name == "mismatch":
            try:
                check_header(peer, self.rank, desc, a, self.engine.description(), b)
            except UsageError as exc:
                return exc
        if name == "link":
            return self._link_error(peer, a, b)
        if name == "timeout":
            self.reports = self.engine.reports()
            waits = {"credit": "a free receive slot (a credit)", "arrival": f"a {a}-byte message",
                     "send queue": "send queue space", "sends": "the completion of its sends",
                     "rendezvous": "the receiver's buffer address (a rendezvous send waits for its receive)",
                     "spread": "a message or a credit of its all-to-all"}
            waited = waits.get(_engine.WAITS.get(what), "progress")
            if b > 0:       # sends by address: each completes once its receiver reads it
                waited = (f"its read of {b} message{'s' if b > 1 else ''} sent by address (such a send completes "
                          f"once the receiver copies it, at any call of its own; PYRDMA_SOCKET_CMA=0 sends "
                          f"through the socket instead)")
            return self._stall_error(peer, waited)
        if name == "malformed":
            return _malformed(peer, f"a message its credits did not allow, or longer than max_message "
                                    f"(immediate {a:#x})")
        if name == "address":
            if a < 0:       # read, but the sender's word says its call failed before: not the message
                return PeerError(f"rank {peer} gave up on the {b}-byte message it sent this rank by address "
                                 f"before this rank read it (its call failed); the "
                                 f"communicator is unusable now", peer=peer)
            why = os.strerror(a) if a else "a short read"
            return _malformed(peer, f"a {b}-byte message by address that its process does not hold ({why})")
        if name == "memory":
            return RDMAError(f"out of memory keeping a {a}-byte message for its receive", call="malloc")
        if name == "post":
            return PeerError(f"posting to rank {peer} failed (errno {a}): its queue pair is in error; rank {peer} "
                             f"died or left", peer=peer)
        return RDMAError(f"the completion queue failed (errno {a})", call="ibv_poll_cq")



class _OwnBuffer:
    """buffer() of both transports, over their own work_area()."""

    def own_fits(self, nbytes):
        """Whether own_region(nbytes) would return the buffer as it is (not grow it)."""
        own = self._own
        return own is not None and own.nbytes >= nbytes

    def buffer(self, nbytes):
        """This transport's own buffer, grown to ``nbytes``, as the work area. Memory lent by an
        earlier collective is let go: writing there would change a caller's array after its call."""
        return self.work_area(nbytes)
