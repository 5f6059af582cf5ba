"""Ring algorithms, bandwidth-optimal for large messages.

Every function works in place on the transport's work buffer ``t.buffer()``, which holds ``count``
elements of ``itemsize`` bytes from offset 0. ``reduce(dst, a, b)`` computes dst = op(a, b) on
uint8 views. Messages are cut into chunks of at most ``t.max_message`` bytes and pipelined: sends
run up to the transport's send window ahead of the reductions (pieces.pipelined_step).

- ring_allreduce: reduce-scatter then allgather around the ring, 2(n-1) steps, each rank sends
  2(n-1)/n of the buffer. Every element's reduction is done by one rank and then copied, so every
  rank ends with bit-identical results.
- ring_reduce_scatter: rank r ends with segment r (pieces.segment_bounds) reduced.
- ring_allgather: rank r's block r is copied to every rank.
- chain_broadcast / chain_reduce: a pipelined chain along the ring from / to ``root``; for large
  messages (each link carries the data once; n-1 + chunks - 1 steps).
"""
from pyrdma.collectives.pieces import Segments, copier, pipelined_step, reducer, store, whole_chunks


def _reduce_scatter(t, segs, reduce, last_seg):
    """n-1 steps; at step s rank r sends segment (last_seg - 1 - s) to the right and reduces
    segment (last_seg - 2 - s) from the left, ending with segment ``last_seg`` of rank r complete."""
    n, r = t.size, t.rank
    right, left = (r + 1) % n, (r - 1) % n
    work = t.buffer(0)
    consume = reducer(reduce, work)
    first = last_seg - 1
    for s in range(n - 1):
        pipelined_step(t, right, segs.chunks((first - s) % n), left, segs.chunks((first - s - 1) % n), consume)


def _allgather(t, segs, own_seg):
    """n-1 steps; at step s rank r forwards segment (own_seg - s) and stores (own_seg - s - 1)."""
    n, r = t.size, t.rank
    right, left = (r + 1) % n, (r - 1) % n
    consume = copier(t.buffer(0))
    for s in range(n - 1):
        pipelined_step(t, right, segs.chunks((own_seg - s) % n), left, segs.chunks((own_seg - s - 1) % n), consume)


def ring_allreduce(t, count, itemsize, reduce):
    n, r = t.size, t.rank
    if n == 1:
        return
    segs = Segments(count, itemsize, n, t.max_message)
    _reduce_scatter(t, segs, reduce, last_seg=(r + 1) % n)
    _allgather(t, segs, own_seg=(r + 1) % n)
    t.wait_sends()


def ring_reduce_scatter(t, count, itemsize, reduce, bounds=None):
    """Afterwards this rank's segment ``t.rank`` (of ``bounds``, default segment_bounds) is reduced."""
    if t.size == 1:
        return
    segs = Segments(count, itemsize, t.size, t.max_message, bounds)
    _reduce_scatter(t, segs, reduce, last_seg=t.rank)
    t.wait_sends()


def ring_allgather(t, count, itemsize, bounds=None):
    """``count`` elements in t.size blocks (``bounds``, default equal); block t.rank goes to all."""
    if t.size == 1:
        return
    segs = Segments(count, itemsize, t.size, t.max_message, bounds)
    _allgather(t, segs, own_seg=t.rank)
    t.wait_sends()


def chain_broadcast(t, count, itemsize, root):
    """Pipelined chain root -> root+1 -> ...: each rank forwards chunk k as soon as it has it, while
    chunk k+1 is on its way."""
    n, r = t.size, t.rank
    if n == 1:
        return
    pos = (r - root) % n
    chunks = whole_chunks(t, count, itemsize)
    right, left = (r + 1) % n, (r - 1) % n
    work = t.buffer(0)
    for off, nb in chunks:
        if pos > 0:
            store(work, off, t.recv(left, nb))
            t.release(left)
        if pos < n - 1:
            t.send(right, off, nb)
    t.wait_sends()


def chain_reduce(t, count, itemsize, reduce, root):
    """Pipelined chain root+1 -> root+2 -> ... -> root: each rank adds its data to chunk k and
    passes it on. Only ``root``'s buffer holds the result afterwards."""
    n, r = t.size, t.rank
    if n == 1:
        return
    pos = (r - root - 1) % n          # root+1 starts (pos 0), root ends (pos n-1)
    chunks = whole_chunks(t, count, itemsize)
    right, left = (r + 1) % n, (r - 1) % n
    work = t.buffer(0)
    consume = reducer(reduce, work)
    if pos == 0:
        for off, nb in chunks:
            t.send(right, off, nb)
    else:
        # receive chunk k, reduce it, then forward it: the forward must follow the reduction
        for k, (off, nb) in enumerate(chunks):
            data = t.recv(left, nb)
            consume(k, off, data)
            t.release(left)
            if pos < n - 1:
                t.send(right, off, nb)
    t.wait_sends()
