"""Ring algorithms, bandwidth-optimal for large messages, planned as schedules (schedule.py).

Every plan works in place on a work area that holds ``count`` elements of ``itemsize`` bytes from
offset 0. Messages are cut into chunks of at most ``max_message`` bytes and pipelined: sends run
ahead of the reductions (the engine's _exchange). Plans are cached: every call of the same shape
on the same rank has the same steps.

- allreduce: reduce-scatter then allgather around the ring, 2(n-1) steps, each rank sends
  2(n-1)/n of the buffer. Every element's reduction is done by one rank and then copied, so every
  rank ends with bit-identical results.
- reduce_scatter: rank r ends with segment r (pieces.segment_bounds, or ``bounds``) reduced.
- allgather: rank r's block r is copied to every rank.
- chain_broadcast / chain_reduce: a pipelined chain along the ring from / to ``root``; for large
  messages (each link carries the data once; n-1 + chunks - 1 steps).

Each planner's estimate for the cost model sits beside it (``*_cost(model, nbytes, n,
max_message)``, in seconds; the registry, algorithms/__init__.py, pairs them).
"""
import functools

from pyrdma.collectives.pieces import Segments, chunk_ranges, nchunks_for
from pyrdma.collectives.schedule import COPY, REDUCE, Builder

_cached = functools.lru_cache(maxsize=512)


def _reduce_scatter(b, n, r, segs, last_seg):
    """n-1 steps; at step s rank r sends segment (last_seg - 1 - s) to the right and reduces
    segment (last_seg - 2 - s) from the left, ending with segment ``last_seg`` of rank r complete."""
    right, left = (r + 1) % n, (r - 1) % n
    first = last_seg - 1
    for s in range(n - 1):
        b.exchange(right, segs.chunks((first - s) % n), left, segs.chunks((first - s - 1) % n), REDUCE)


def _allgather(b, n, r, segs, own_seg):
    """n-1 steps; at step s rank r forwards segment (own_seg - s) and stores (own_seg - s - 1)."""
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        b.exchange(right, segs.chunks((own_seg - s) % n), left, segs.chunks((own_seg - s - 1) % n), COPY)


def _ring(n, r, count, itemsize, max_message, bounds, reduced, gathered):
    """Reduce-scatter ending with segment ``reduced`` complete here, then (or only) the allgather
    of segment ``gathered`` (None: skip that phase)."""
    b = Builder()
    if n > 1:
        segs = Segments(count, itemsize, n, max_message, bounds)
        if reduced is not None:
            _reduce_scatter(b, n, r, segs, last_seg=reduced)
        if gathered is not None:
            _allgather(b, n, r, segs, own_seg=gathered)
        b.wait_sends()
    return b.build()


@_cached
def allreduce(n, r, count, itemsize, max_message):
    return _ring(n, r, count, itemsize, max_message, None, (r + 1) % n, (r + 1) % n)


def allreduce_cost(model, nbytes, n, max_message):
    """2(n-1) messages of a segment (nbytes / n) each, n-1 segments reduced."""
    seg = nbytes / n
    return 2 * (n - 1) * model.send(seg, max_message) + (n - 1) * seg * model.gamma


@_cached
def reduce_scatter(n, r, count, itemsize, max_message, bounds=None):
    """Afterwards this rank's segment r (of ``bounds``, a tuple; default segment_bounds) is reduced."""
    return _ring(n, r, count, itemsize, max_message, bounds, r, None)


def reduce_scatter_cost(model, nbytes, n, max_message):
    """The allreduce's first half: n-1 messages of a segment, n-1 segments reduced."""
    seg = nbytes / n
    return (n - 1) * model.send(seg, max_message) + (n - 1) * seg * model.gamma


@_cached
def allgather(n, r, count, itemsize, max_message, bounds=None):
    """``count`` elements in n blocks (``bounds``, default equal); block r goes to every rank."""
    return _ring(n, r, count, itemsize, max_message, bounds, None, r)


def allgather_cost(model, nbytes, n, max_message):
    """``nbytes``: the result (n blocks); n-1 messages of a block each."""
    return (n - 1) * model.send(nbytes / n, max_message)


def whole_chunks(count, itemsize, max_message):
    """The chunks (byte offset, length) of a whole buffer of ``count`` elements sent to one peer."""
    return chunk_ranges(0, count, nchunks_for(count, itemsize, max_message), itemsize)


@_cached
def chain_broadcast(n, r, count, itemsize, max_message, root):
    """Pipelined chain root -> root+1 -> ...: each rank forwards chunk k as soon as it has it, while
    chunk k+1 is on its way. The ends take their chunks in one step: the root only sends, and the
    last rank only receives, so that the socket link reads every chunk straight into its place
    (Engine._expect covers a step's chunks)."""
    b = Builder()
    if n > 1:
        pos = (r - root) % n
        right, left = (r + 1) % n, (r - 1) % n
        chunks = whole_chunks(count, itemsize, max_message)
        b.greet_root(n, r, root)
        if pos == 0:
            b.send(right, chunks)
        elif pos == n - 1:
            b.recv(left, chunks, COPY)
        else:
            for chunk in chunks:
                b.recv(left, (chunk,), COPY)
                b.send(right, (chunk,))
        b.root_greeted(n, r, root)
        b.wait_sends()
    return b.build()


def chain_cost(model, nbytes, n, max_message):
    """chain_broadcast's and chain_reduce's: n-1 + k-1 pipelined steps of one of k chunks each."""
    k = model.messages(nbytes, max_message)
    return (n - 1 + k - 1) * model.send(nbytes / k, max_message)


@_cached
def chain_reduce(n, r, count, itemsize, max_message, root):
    """Pipelined chain root+1 -> root+2 -> ... -> root: each rank adds its data to chunk k and
    passes it on. Only ``root``'s work area holds the result afterwards."""
    b = Builder()
    if n > 1:
        pos = (r - root - 1) % n          # root+1 starts (pos 0), root ends (pos n-1)
        right, left = (r + 1) % n, (r - 1) % n
        chunks = whole_chunks(count, itemsize, max_message)
        b.announce_root(n, r, root)
        if pos == 0:
            b.send(right, chunks)
        else:
            # receive chunk k, reduce it, then forward it: the forward must follow the reduction
            for chunk in chunks:
                b.recv(left, (chunk,), REDUCE)
                if pos < n - 1:
                    b.send(right, (chunk,))
        b.heard_root(n, r, root)
        b.wait_sends()
    return b.build()
