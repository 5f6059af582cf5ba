"""Logarithmic algorithms for small and medium messages (same conventions as ring.py: in place on
``t.buffer()``, ``count`` elements of ``itemsize`` bytes from offset 0, ``reduce(dst, a, b)``).

Any rank count works. With p the largest power of two <= n, the ranks r >= p first fold their
data into rank r - p, sit out the power-of-two algorithm, and get the result back at the end
(two extra messages on their path; none for a power-of-two n).

- halving_doubling_allreduce (Rabenseifner, gloo's allreduce_halving_doubling): reduce-scatter by
  recursive halving (log p steps, the exchanged half shrinks each step) then allgather by recursive
  doubling. 2 log p messages per rank, 2(p-1)/p of the buffer sent: good from small to large sizes.
- recursive_doubling_allreduce: log p steps exchanging the whole buffer; the fewest messages, for
  tiny buffers. Each step computes op(lower ranks' part, higher ranks' part), so every rank
  evaluates the same expression and results are bit-identical across ranks.
- binomial_broadcast / binomial_reduce: binomial tree from / to ``root``, pipelined per chunk.
- dissemination_barrier: ceil(log2 n) rounds of zero-byte messages, any n.
"""
import functools

from pyrdma.collectives.pieces import (chunk_ranges, copier, nchunks_for, pipelined_step, reducer, store,
                                       segment_bounds, whole_chunks)


def _pow2_floor(n):
    return 1 << (n.bit_length() - 1)


def _send_all(t, peer, count, itemsize, offset=0):
    for off, nb in whole_chunks(t, count, itemsize):
        t.send(peer, offset + off, nb)


def _recv_all(t, peer, count, itemsize, consume):
    for k, (off, nb) in enumerate(whole_chunks(t, count, itemsize)):
        data = t.recv(peer, nb)
        consume(k, off, data)
        t.release(peer)


def _fold_in(t, p, count, itemsize, reduce, work):
    """The start of a power-of-two algorithm on any n: rank r >= p hands its data to rank r - p and
    waits for the result (returns True: it is done); rank r < p adds rank r + p's data, if any."""
    n, r = t.size, t.rank
    if r >= p:
        _send_all(t, r - p, count, itemsize)
        _recv_all(t, r - p, count, itemsize, copier(work))
        t.wait_sends()
        return True
    if r + p < n:
        _recv_all(t, r + p, count, itemsize, reducer(reduce, work))
    return False


@functools.lru_cache(maxsize=256)      # every call of the same size on the same rank has the same steps
def _halving_doubling_steps(count, itemsize, p, r, max_message):
    """(halving, doubling): the (peer, send chunks, receive chunks) of each step of rank r < p."""
    bounds = segment_bounds(count, p)            # block b belongs to rank b at the end of halving

    def step(peer, send_blocks, recv_blocks):
        send = (bounds[send_blocks[0]], bounds[send_blocks[1]])
        recv = (bounds[recv_blocks[0]], bounds[recv_blocks[1]])
        k = nchunks_for(max(send[1] - send[0], recv[1] - recv[0]), itemsize, max_message)
        return peer, chunk_ranges(send[0], send[1], k, itemsize), chunk_ranges(recv[0], recv[1], k, itemsize)

    halving, doubling = [], []
    lo, hi = 0, p                                # the blocks this rank still reduces
    mask = p >> 1
    while mask:
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if r & mask else ((lo, mid), (mid, hi))
        halving.append(step(r ^ mask, give, keep))
        lo, hi = keep
        mask >>= 1
    mask = 1
    while mask < p:
        other = (lo - mask, lo) if r & mask else (hi, hi + mask)
        doubling.append(step(r ^ mask, (lo, hi), other))
        lo, hi = min(lo, other[0]), max(hi, other[1])
        mask <<= 1
    return tuple(halving), tuple(doubling)


def halving_doubling_allreduce(t, count, itemsize, reduce):
    n, r = t.size, t.rank
    if n == 1:
        return
    p = _pow2_floor(n)
    work = t.buffer(0)
    if _fold_in(t, p, count, itemsize, reduce, work):
        return
    halving, doubling = _halving_doubling_steps(count, itemsize, p, r, t.max_message)
    consume = reducer(reduce, work)
    for peer, send_chunks, recv_chunks in halving:
        pipelined_step(t, peer, send_chunks, peer, recv_chunks, consume)
    t.wait_sends()                               # the given halves are about to be overwritten
    consume = copier(work)
    for peer, send_chunks, recv_chunks in doubling:
        pipelined_step(t, peer, send_chunks, peer, recv_chunks, consume)
    if r + p < n:
        _send_all(t, r + p, count, itemsize)
    t.wait_sends()


def recursive_doubling_allreduce(t, count, itemsize, reduce):
    """Needs t.buffer(2 * count * itemsize): the second half is the other side of a double buffer
    (a step reads the current half while its sends may still be in flight). Returns the byte
    offset in t.buffer() where the result lies (0 or count * itemsize): taking it from there saves
    a copy of the whole buffer after an odd number of steps."""
    n, r = t.size, t.rank
    if n == 1:
        return 0
    p = _pow2_floor(n)
    nbytes = count * itemsize
    work = t.buffer(2 * nbytes)
    if _fold_in(t, p, count, itemsize, reduce, work):
        return 0
    cur, nxt = 0, nbytes
    mask = 1
    while mask < p:
        peer = r ^ mask
        lower = r < peer

        def consume(k, off, data, cur=cur, nxt=nxt, lower=lower):
            mine = work[cur + off:cur + off + data.nbytes]
            dst = work[nxt + off:nxt + off + data.nbytes]
            if lower:
                reduce(dst, mine, data)
            else:
                reduce(dst, data, mine)
        chunks = whole_chunks(t, count, itemsize)
        pipelined_step(t, peer, [(cur + off, nb) for off, nb in chunks], peer, chunks, consume)
        t.wait_sends(peer)                       # next step writes where these sends read
        cur, nxt = nxt, cur
        mask <<= 1
    if r + p < n:
        _send_all(t, r + p, count, itemsize, offset=cur)
    t.wait_sends()
    return cur


def _binomial(n, v):
    """(parent, children) of relative rank v in a binomial tree rooted at 0; children in the order
    their subtrees shrink."""
    if v == 0:
        parent, limit = None, _pow2_floor(n) << 1
    else:
        low = v & -v
        parent, limit = v - low, low
    children = []
    bit = limit >> 1
    while bit:
        if v + bit < n:
            children.append(v + bit)
        bit >>= 1
    return parent, children


def binomial_broadcast(t, count, itemsize, root):
    n, r = t.size, t.rank
    if n == 1:
        return
    parent, children = _binomial(n, (r - root) % n)
    parent = None if parent is None else (parent + root) % n
    children = [(c + root) % n for c in children]
    work = t.buffer(0)
    for off, nb in whole_chunks(t, count, itemsize):
        if parent is not None:
            store(work, off, t.recv(parent, nb))
            t.release(parent)
        for c in children:
            t.send(c, off, nb)
    t.wait_sends()


def binomial_reduce(t, count, itemsize, reduce, root):
    """Only ``root``'s buffer holds the result afterwards."""
    n, r = t.size, t.rank
    if n == 1:
        return
    parent, children = _binomial(n, (r - root) % n)
    parent = None if parent is None else (parent + root) % n
    children = [(c + root) % n for c in reversed(children)]   # smallest subtree first: ready first
    work = t.buffer(0)
    for off, nb in whole_chunks(t, count, itemsize):
        dst = work[off:off + nb]
        for c in children:
            data = t.recv(c, nb)
            reduce(dst, dst, data)
            t.release(c)
        if parent is not None:
            t.send(parent, off, nb)
    t.wait_sends()


def dissemination_barrier(t):
    n, r = t.size, t.rank
    t.buffer(0)
    dist = 1
    while dist < n:
        t.send((r + dist) % n, 0, 0)
        t.recv((r - dist) % n, 0)
        t.release((r - dist) % n)
        dist <<= 1
    t.wait_sends()
