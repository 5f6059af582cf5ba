"""Collective algorithms over a transport (see transport.py); none of them knows about verbs.

Each works in place on ``buf``, a uint8 view of the transport's work buffer holding ``count``
elements of ``itemsize`` bytes; ``reduce(dst, src)`` combines two uint8 views element-wise.
Messages are cut into chunks no larger than the transport's ``max_message``; a chunk is sent while
the previous one is being reduced, so transfer and reduction overlap.
"""
import numpy as np


def _bounds(count, parts):
    """Element boundaries that split ``count`` elements into ``parts`` near-equal pieces."""
    return [count * i // parts for i in range(parts + 1)]


class _Segments:
    """``count`` elements in ``nseg`` segments, each cut into the same number of chunks."""

    def __init__(self, buf, count, itemsize, nseg, max_message):
        self.buf, self.itemsize = buf, itemsize
        self.seg = _bounds(count, nseg)
        longest = max(self.seg[i + 1] - self.seg[i] for i in range(nseg))
        per_chunk = max(1, max_message // itemsize)
        self.nchunks = max(1, -(-longest // per_chunk))

    def chunk(self, seg, k):
        start, stop = self.seg[seg], self.seg[seg + 1]
        b = _bounds(stop - start, self.nchunks)
        return self.buf[(start + b[k]) * self.itemsize:(start + b[k + 1]) * self.itemsize]


def _ring_reduce_scatter(t, segs, reduce, first_send):
    """N-1 steps; at step s this rank sends segment (first_send - s) and reduces (first_send - s - 1)
    received from the left. It ends holding segment (first_send + 1) fully reduced."""
    n, r = t.size, t.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        send_seg, recv_seg = (first_send - s) % n, (first_send - s - 1) % n
        for k in range(segs.nchunks):
            t.send(right, segs.chunk(send_seg, k))
            dst = segs.chunk(recv_seg, k)
            reduce(dst, t.recv(left, dst.nbytes))
            t.release(left)
    t.flush()


def _ring_allgather(t, segs, first_send):
    """N-1 steps; at step s this rank forwards segment (first_send - s) and stores the one from the left."""
    n, r = t.size, t.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        send_seg, recv_seg = (first_send - s) % n, (first_send - s - 1) % n
        for k in range(segs.nchunks):
            t.send(right, segs.chunk(send_seg, k))
            dst = segs.chunk(recv_seg, k)
            dst[:] = t.recv(left, dst.nbytes)
            t.release(left)
    t.flush()


def ring_allreduce(t, buf, count, itemsize, reduce):
    """Reduce-scatter then allgather around the ring: bandwidth-optimal, 2(N-1) steps."""
    if t.size == 1:
        return
    segs = _Segments(buf, count, itemsize, t.size, t.max_message)
    _ring_reduce_scatter(t, segs, reduce, first_send=t.rank)
    _ring_allgather(t, segs, first_send=(t.rank + 1) % t.size)


def ring_reduce_scatter(t, buf, count, itemsize, reduce):
    """Afterwards this rank's segment (``t.rank`` of ``t.size`` near-equal ones) holds the reduction."""
    if t.size == 1:
        return
    segs = _Segments(buf, count, itemsize, t.size, t.max_message)
    _ring_reduce_scatter(t, segs, reduce, first_send=(t.rank - 1) % t.size)


def ring_allgather(t, buf, count, itemsize):
    """``buf`` holds ``t.size`` equal blocks; this rank's block ``t.rank`` is sent to everyone."""
    if t.size == 1:
        return
    segs = _Segments(buf, count, itemsize, t.size, t.max_message)
    _ring_allgather(t, segs, first_send=t.rank)


def _exchange(t, peer, buf, itemsize, reduce=None):
    """Swap ``buf`` with ``peer``; reduce theirs into ours (or, with reduce=None, only send)."""
    segs = _Segments(buf, buf.nbytes // itemsize, itemsize, 1, t.max_message)
    received = []
    for k in range(segs.nchunks):
        chunk = segs.chunk(0, k)
        t.send(peer, chunk)
        if reduce is not None:
            received.append(np.array(t.recv(peer, chunk.nbytes)))
            t.release(peer)
    t.flush()   # our chunks have left: now ``buf`` may change
    for k, data in enumerate(received):
        reduce(segs.chunk(0, k), data)


def _receive_into(t, peer, buf, itemsize, reduce=None):
    segs = _Segments(buf, buf.nbytes // itemsize, itemsize, 1, t.max_message)
    for k in range(segs.nchunks):
        dst = segs.chunk(0, k)
        data = t.recv(peer, dst.nbytes)
        if reduce is None:
            dst[:] = data
        else:
            reduce(dst, data)
        t.release(peer)


def tree_allreduce(t, buf, count, itemsize, reduce):
    """Recursive doubling: log2(N) full exchanges, latency-optimal for small messages. Ranks beyond
    the largest power of two first fold their data into a partner and get the result back last."""
    n, r = t.size, t.rank
    if n == 1:
        return
    p = 1 << (n.bit_length() - 1)
    if r >= p:
        _exchange(t, r - p, buf, itemsize)
        _receive_into(t, r - p, buf, itemsize)
        return
    if r < n - p:
        _receive_into(t, r + p, buf, itemsize, reduce)
    mask = 1
    while mask < p:
        _exchange(t, r ^ mask, buf, itemsize, reduce)
        mask <<= 1
    if r < n - p:
        _exchange(t, r + p, buf, itemsize)


def chain_broadcast(t, buf, itemsize, root):
    """Pipelined chain from ``root`` around the ring: each rank forwards chunk k while k+1 arrives."""
    n, r = t.size, t.rank
    if n == 1:
        return
    pos = (r - root) % n
    right, left = (r + 1) % n, (r - 1) % n
    segs = _Segments(buf, buf.nbytes // itemsize, itemsize, 1, t.max_message)
    for k in range(segs.nchunks):
        chunk = segs.chunk(0, k)
        if pos > 0:
            chunk[:] = t.recv(left, chunk.nbytes)
            t.release(left)
        if pos < n - 1:
            t.send(right, chunk)
    t.flush()


def chain_reduce(t, buf, itemsize, reduce, root):
    """Pipelined chain ending at ``root``: rank root+1 starts, each rank adds its data and passes on."""
    n, r = t.size, t.rank
    if n == 1:
        return
    pos = (r - root - 1) % n
    right, left = (r + 1) % n, (r - 1) % n
    segs = _Segments(buf, buf.nbytes // itemsize, itemsize, 1, t.max_message)
    for k in range(segs.nchunks):
        chunk = segs.chunk(0, k)
        if pos > 0:
            reduce(chunk, t.recv(left, chunk.nbytes))
            t.release(left)
        if pos < n - 1:
            t.send(right, chunk)
    t.flush()


class CostModel:
    """alpha-beta estimate of each allreduce algorithm: alpha seconds per message, beta per byte."""

    def __init__(self, alpha=5e-6, beta=1 / 10e9):
        self.alpha, self.beta = alpha, beta

    def ring(self, nbytes, n, max_message):
        chunks = max(1, -(-nbytes // (n * max_message)))
        return 2 * (n - 1) * (chunks * self.alpha + nbytes / n * self.beta)

    def tree(self, nbytes, n, max_message):
        p = 1 << (n.bit_length() - 1)
        rounds = (p.bit_length() - 1) + (2 if n > p else 0)
        chunks = max(1, -(-nbytes // max_message))
        return rounds * (chunks * self.alpha + nbytes * self.beta)

    def choose(self, nbytes, n, max_message):
        if n <= 2:
            return "ring" if nbytes > max_message else "tree"
        return "tree" if self.tree(nbytes, n, max_message) <= self.ring(nbytes, n, max_message) else "ring"
