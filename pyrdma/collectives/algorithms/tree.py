"""Logarithmic algorithms for small and medium messages, planned as schedules (same conventions
as ring.py: in place on a work area of ``count`` elements of ``itemsize`` bytes from offset 0).

Any rank count works. With p the largest power of two <= n, the ranks r >= p first fold their
data into rank r - p, sit out the power-of-two algorithm, and get the result back at the end
(two extra messages on their path; none for a power-of-two n).

- halving_doubling_allreduce (Rabenseifner, gloo's allreduce_halving_doubling): reduce-scatter by
  recursive halving (log p steps, the exchanged half shrinks each step) then allgather by recursive
  doubling. 2 log p messages per rank, 2(p-1)/p of the buffer sent: good from small to large sizes.
- recursive_doubling_allreduce: log p steps exchanging the whole buffer; the fewest messages, for
  tiny buffers. Each step computes op(lower ranks' part, higher ranks' part), so every rank
  evaluates the same expression and results are bit-identical across ranks. It needs a work area
  of twice the data (a double buffer); the schedule's result_offset says which half holds the result.
- binomial_broadcast / binomial_reduce: binomial tree from / to ``root``, pipelined per chunk.
- dissemination_barrier: ceil(log2 n) rounds of zero-byte messages, any n.

Each planner's estimate for the cost model sits beside it, as in ring.py.
"""
import functools
import math

from pyrdma.collectives.pieces import chunk_ranges, nchunks_for, segment_bounds
from pyrdma.collectives.algorithms.ring import whole_chunks
from pyrdma.collectives.schedule import COPY, NONE, REDUCE, REDUCE_LOWER, REDUCE_UPPER, Builder

_cached = functools.lru_cache(maxsize=512)


def _pow2_floor(n):
    return 1 << (n.bit_length() - 1)


def _fold_in(b, n, r, p, chunks):
    """The start of a power-of-two algorithm on any n: rank r >= p hands its data to rank r - p and
    waits for the result (returns True: it is done); rank r < p adds rank r + p's data, if any."""
    if r >= p:
        b.send(r - p, chunks)
        b.recv(r - p, chunks, COPY)
        b.wait_sends()
        return True
    if r + p < n:
        b.recv(r + p, chunks, REDUCE)
    return False


def _fold_cost(model, nbytes, n, max_message):
    """What _fold_in and the hand-back cost on a non-power-of-two rank count: two messages of the
    whole data and one reduction."""
    p = _pow2_floor(n)
    return 0.0 if p == n else 2 * model.send(nbytes, max_message) + nbytes * model.gamma


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
    return halving, doubling


@_cached
def halving_doubling_allreduce(n, r, count, itemsize, max_message):
    b = Builder()
    if n == 1:
        return b.build()
    p = _pow2_floor(n)
    chunks = whole_chunks(count, itemsize, max_message)
    if _fold_in(b, n, r, p, chunks):
        return b.build()
    halving, doubling = _halving_doubling_steps(count, itemsize, p, r, max_message)
    for peer, send_chunks, recv_chunks in halving:
        b.exchange(peer, send_chunks, peer, recv_chunks, REDUCE)
    b.wait_sends()                               # the given halves are about to be overwritten
    for peer, send_chunks, recv_chunks in doubling:
        b.exchange(peer, send_chunks, peer, recv_chunks, COPY)
    if r + p < n:
        b.send(r + p, chunks)
    b.wait_sends()
    return b.build()


def halving_doubling_cost(model, nbytes, n, max_message):
    """log2 p steps each way, the exchanged part halving (and doubling back); the halving's parts
    reduced."""
    steps = _pow2_floor(n).bit_length() - 1
    t, part = 0.0, nbytes
    for _ in range(steps):
        part /= 2
        t += 2 * model.send(part, max_message) + part * model.gamma
    return t + _fold_cost(model, nbytes, n, max_message)


@_cached
def recursive_doubling_allreduce(n, r, count, itemsize, max_message):
    """Needs a work area of 2 * count * itemsize bytes (see the module's docstring)."""
    b = Builder()
    if n == 1:
        return b.build()
    p = _pow2_floor(n)
    nbytes = count * itemsize
    chunks = whole_chunks(count, itemsize, max_message)
    if _fold_in(b, n, r, p, chunks):
        return b.build()
    cur, nxt = 0, nbytes
    mask = 1
    while mask < p:
        peer = r ^ mask
        # the received chunk meets ours at cur and the result goes to nxt: lower op higher
        b.exchange(peer, [(cur + off, nb) for off, nb in chunks], peer,
                   [(nxt + off, nb, cur + off) for off, nb in chunks],
                   REDUCE_LOWER if r < peer else REDUCE_UPPER)
        b.wait_sends(peer)                       # next step writes where these sends read
        cur, nxt = nxt, cur
        mask <<= 1
    if r + p < n:
        b.send(r + p, [(cur + off, nb) for off, nb in chunks])
    b.wait_sends()
    return b.build(result_offset=cur)


def recursive_doubling_cost(model, nbytes, n, max_message):
    """log2 p steps, each one message of the whole data and its reduction."""
    steps = _pow2_floor(n).bit_length() - 1
    return steps * (model.send(nbytes, max_message) + nbytes * model.gamma) + _fold_cost(model, nbytes, n, max_message)


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


def _tree(n, r, root):
    parent, children = _binomial(n, (r - root) % n)
    parent = None if parent is None else (parent + root) % n
    return parent, [(c + root) % n for c in children]


@_cached
def binomial_broadcast(n, r, count, itemsize, max_message, root):
    b = Builder()
    if n > 1:
        parent, children = _tree(n, r, root)
        b.greet_root(n, r, root)
        for chunk in whole_chunks(count, itemsize, max_message):
            if parent is not None:
                b.recv(parent, (chunk,), COPY)
            for c in children:
                b.send(c, (chunk,))
        b.root_greeted(n, r, root)
        b.wait_sends()
    return b.build()


@_cached
def binomial_reduce(n, r, count, itemsize, max_message, root):
    """Only ``root``'s work area holds the result afterwards."""
    b = Builder()
    if n > 1:
        parent, children = _tree(n, r, root)
        children.reverse()                       # smallest subtree first: ready first
        b.announce_root(n, r, root)
        for chunk in whole_chunks(count, itemsize, max_message):
            for c in children:
                b.recv(c, (chunk,), REDUCE)
            if parent is not None:
                b.send(parent, (chunk,))
        b.heard_root(n, r, root)
        b.wait_sends()
    return b.build()


def binomial_cost(model, nbytes, n, max_message):
    """binomial_broadcast's and binomial_reduce's: depth d = ceil(log2 n) rounds for one chunk;
    pipelined, the root sends each of the k chunks to up to d children, so its link carries d
    copies of the data."""
    depth = max(1, math.ceil(math.log2(n)))
    k = model.messages(nbytes, max_message)
    return k * depth * model.send(nbytes / k, max_message)


@_cached
def dissemination_barrier(n, r):
    b = Builder()
    dist = 1
    while dist < n:
        b.exchange((r + dist) % n, ((0, 0),), (r - dist) % n, ((0, 0),), NONE)
        dist <<= 1
    b.wait_sends()
    return b.build()


def dissemination_cost(model, nbytes, n, max_message):
    """ceil(log2 n) rounds of one zero-byte message each (``nbytes`` is always 0)."""
    return (n - 1).bit_length() * model.send(0, max_message)
