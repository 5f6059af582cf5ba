"""All-to-all and point-to-point messages.

- pairwise all-to-all (MPI's and NCCL's for large blocks): at step k = 1 .. n-1 rank r sends its
  block for rank r+k while it receives the block of rank r-k, both pipelined in chunks. The work
  area holds the send blocks (``send_bounds``, byte offsets from 0) and, from ``recv_base``, the
  receive blocks (``recv_bounds``); a rank's own block is copied by the caller. Every pair
  exchanges one message even of zero bytes, so counts that disagree are found, not waited for.
- spread all-to-all (NCCL's and UCX's: every peer's block posted together): the same exchanges as
  the pairwise one, as SPREAD steps, which the engine runs at once (the flow tests' Python model one by
  one, in the pairwise order).
- write all-to-all (the rendezvous of UCX and MPI's large messages, started by the receiver,
  which knows its counts): every rank asks each peer to write its block straight into its own
  receive block (ASK: the address and key), writes each peer's block where that peer asked (PUT:
  an RDMA WRITE, and a NOTICE behind it) and takes the notices (LANDED). No block passes through a
  slot, so none is copied out of one: on a software device that copy costs as much as the
  transfer (a 2-rank RDMA READ of the blocks instead was no faster on rxe: the responder's work
  outweighed the copy it saved up to 256 KiB per peer). With counts (alltoallv) it writes only
  the blocks from ``written_from`` bytes on (per pair: both of its ranks know the pair's size),
  each with a notice ahead, and exchanges the others through the slots.
- a point-to-point exchange: one message to ``dst`` while one is received from ``src`` (either may
  be None), the receive a COPY_UPTO of at most ``capacity`` bytes.
"""
import functools

from pyrdma.collectives.algorithms.rooted import message_chunks
from pyrdma.collectives.schedule import COPY, COPY_UPTO, EXCHANGE, SPREAD, Builder

_cached = functools.lru_cache(maxsize=512)


def _exchanges(n, r, send_bounds, recv_bounds, recv_base, max_message, kind):
    """Step k = 1 .. n-1: this rank's block for rank r+k out while rank r-k's comes in (steps of ``kind``)."""
    b = Builder()
    for k in range(1, n):
        dst, src = (r + k) % n, (r - k) % n
        b.exchange(dst, message_chunks(send_bounds[dst], send_bounds[dst + 1] - send_bounds[dst], max_message),
                   src, message_chunks(recv_base + recv_bounds[src], recv_bounds[src + 1] - recv_bounds[src],
                                       max_message), COPY, kind)
    b.wait_sends()
    return b.build()


@_cached
def pairwise_alltoall(n, r, send_bounds, recv_bounds, recv_base, max_message):
    return _exchanges(n, r, send_bounds, recv_bounds, recv_base, max_message, EXCHANGE)


def pairwise_alltoall_cost(model, block, n, max_message):
    """n-1 steps, each one block out and one in (``block``: the bytes for each rank), copied out of
    its slot."""
    return (n - 1) * (model.send(block, max_message) + model.copy_out(block))


@_cached
def spread_alltoall(n, r, send_bounds, recv_bounds, recv_base, max_message):
    return _exchanges(n, r, send_bounds, recv_bounds, recv_base, max_message, SPREAD)


def spread_alltoall_cost(model, block, n, max_message):
    """Where a NIC moves the bytes the n-1 exchanges overlap: one latency, then each message's
    handling (overhead, as a direct gather's root pays) and the bytes through the link. Where the
    CPU moves them (sockets, Soft-RoCE: ``copy``) the exchanges queue behind one another on it as
    the pairwise ones do: pairwise's estimate, whose tie pairwise wins (A/B, 3 and 4 ranks, 8 B to
    4 MiB per peer: spread/pairwise 0.89-1.14 on rxe, 0.93-1.03 over TCP; 1.31-1.37 on rxe at 3
    ranks below 4 KiB)."""
    if model.copy or not model.one_sided:
        return pairwise_alltoall_cost(model, block, n, max_message)
    return model.alpha + (n - 1) * (model.messages(block, max_message) * model.overhead + block * model.beta
                                    + model.copy_out(block))


@_cached
def write_alltoall(n, r, send_bounds, recv_bounds, recv_base, max_message, written_from=None, slots=EXCHANGE):
    """Every block written where its receiver asked (``written_from`` None: an all-to-all of equal
    counts, whose choice every rank made on the one size they share); with counts (alltoallv) only
    the blocks from ``written_from`` bytes on, the others sent through the slots as ``slots``
    (EXCHANGE or SPREAD) steps would. A pair's size is known to both of its ranks, so both choose
    alike; where their counts disagree, the messages of step k tell them apart (a block's own
    message, or an ask and a notice: the engine marks those) before either waits for a message the
    other does not send: at step k a rank asks rank r-k for its block, tells rank r+k that it
    writes its block (NOTICE) and then takes its ask and writes, and notices behind the writes
    follow every step (a rank takes a peer's messages in the order they were sent)."""
    def recv(p):
        return message_chunks(recv_base + recv_bounds[p], recv_bounds[p + 1] - recv_bounds[p], max_message)

    def send(p):
        return message_chunks(send_bounds[p], send_bounds[p + 1] - send_bounds[p], max_message)
    b = Builder()
    if written_from is None:
        for k in range(1, n):                   # every ask first: a put waits for its peer's
            b.ask((r - k) % n, recv((r - k) % n))
        for k in range(1, n):
            b.put((r + k) % n, send((r + k) % n))
            b.notice((r + k) % n)
        for k in range(1, n):
            b.landed((r - k) % n, recv((r - k) % n))
        b.wait_sends()
        return b.build()
    writes = [send_bounds[(r + k) % n + 1] - send_bounds[(r + k) % n] >= written_from for k in range(n)]
    written = [recv_bounds[(r - k) % n + 1] - recv_bounds[(r - k) % n] >= written_from for k in range(n)]
    for k in range(1, n):
        dst, src = (r + k) % n, (r - k) % n
        if written[k]:
            b.ask(src, recv(src))
        if writes[k]:
            b.notice(dst)
            b.put(dst, send(dst))
        if not (writes[k] and written[k]):
            b.exchange(None if writes[k] else dst, send(dst), None if written[k] else src, recv(src), COPY, slots)
        if written[k]:
            b.landed(src, recv(src))            # its notice: it writes the block
    for k in range(1, n):
        if writes[k]:
            b.notice((r + k) % n)               # behind the writes: in place
    for k in range(1, n):
        if written[k]:
            b.landed((r - k) % n, recv((r - k) % n))
    b.wait_sends()
    return b.build()


def written_from(model, max_message):
    """The smallest block that an all-to-all with counts writes (by write_alltoall) rather than
    sends through the slots: where its estimate, write_alltoall_cost's and a notice's more, falls
    below pairwise_alltoall_cost's for one peer (with a NIC's defaults ~120 KB; ~80 KB where
    max_message is 64 KiB and such a block is two messages; None: never, as over TCP). (CostModel.written_from holds a software device's
    to the size where the A/B on rxe found it.)"""
    if not model.one_sided:
        return None

    def writes(b):
        return write_alltoall_cost(model, b, 2, max_message) + model.alpha < \
            pairwise_alltoall_cost(model, b, 2, max_message)
    lo, hi = 1, 0xFFFFFFFF
    if not writes(hi):
        return None
    while lo < hi:                              # the saving grows with the block (the copy out)
        mid = (lo + hi) // 2
        if writes(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def write_alltoall_cost(model, block, n, max_message):
    """Each peer's block costs three messages (the ask, the write, the notice behind it) against an
    exchange's one, and no copy out of a slot (A/B on rxe, write / pairwise, median of 2 alternating
    rounds: 2 ranks 1.44 at 4 KiB, 1.28 at 16 KiB, 0.88 at 64 KiB, 0.92 at 256 KiB, 0.99 at 1 MiB
    per peer; 4 ranks 1.02, 1.10, 0.93, 0.95). A block beyond the ask's 32-bit length goes through
    the slots."""
    if block > 0xFFFFFFFF:
        return float("inf")
    return (n - 1) * (3 * model.alpha + block * model.beta)


@_cached
def message(dst, nbytes, src, capacity, recv_base, max_message):
    b = Builder()
    b.exchange(dst, message_chunks(0, nbytes, max_message) if dst is not None else (),
               src, message_chunks(recv_base, capacity, max_message) if src is not None else (), COPY_UPTO)
    if dst is not None:
        b.wait_sends(dst)
    return b.build()
