"""How buffers are cut: segments (one per rank) and chunks (one per message), and the pipelined
step every algorithm is built from. Pure arithmetic plus calls to the transport interface."""
import functools

import numpy as np


def segment_bounds(count, parts):
    """Element boundaries of ``parts`` near-equal segments of ``count`` elements: the first
    ``count % parts`` segments get one element more. Some segments are empty when count < parts."""
    q, r = divmod(count, parts)
    return [i * q + min(i, r) for i in range(parts + 1)]


def nchunks_for(nelems, itemsize, max_message):
    """How many messages of at most ``max_message`` bytes carry ``nelems`` elements (at least 1:
    an empty range still sends one zero-byte message, so both sides count the same messages)."""
    per = max(1, max_message // itemsize)
    return max(1, -(-nelems // per))


@functools.lru_cache(maxsize=1024)     # the same few calls repeat every step of every collective
def chunk_ranges(start, stop, nchunks, itemsize):
    """(byte offset, byte length) of each of ``nchunks`` near-equal chunks of elements [start, stop)."""
    b = segment_bounds(stop - start, nchunks)
    return tuple(((start + b[k]) * itemsize, (b[k + 1] - b[k]) * itemsize) for k in range(nchunks))


def whole_chunks(t, count, itemsize):
    """The chunks (byte offset, length) of a whole buffer of ``count`` elements sent to one peer."""
    return chunk_ranges(0, count, nchunks_for(count, itemsize, t.max_message), itemsize)


class Segments:
    """``count`` elements in ``parts`` segments, each cut into the same number of chunks (so that
    the chunk k of any segment is a message both sides agree on)."""

    def __init__(self, count, itemsize, parts, max_message, bounds=None):
        self.itemsize = itemsize
        self.bounds = bounds if bounds is not None else segment_bounds(count, parts)
        longest = max(self.bounds[i + 1] - self.bounds[i] for i in range(parts))
        self.nchunks = nchunks_for(longest, itemsize, max_message)

    def chunks(self, seg):
        return chunk_ranges(self.bounds[seg], self.bounds[seg + 1], self.nchunks, self.itemsize)


def pipelined_step(t, send_peer, send_chunks, recv_peer, recv_chunks, consume):
    """Send ``send_chunks`` to send_peer while receiving as many chunks from recv_peer.

    Sends run ahead of the consumption (reduction or copy) of received chunks, so that transfers
    overlap it: while chunk k is awaited and consumed, chunks up to k + ``t.send_window`` go out, as
    many as the transport takes without waiting for a credit. Chunk k+1 is always out before chunk
    k+1 is awaited, but when it has to wait for a credit it goes only after chunk k is released.
    Otherwise, with one receive slot per peer, every rank of a ring (or both sides of an exchange)
    would wait for a credit that its neighbour only returns after its own blocked send. A step's
    send chunks must not depend on its received ones (they may leave first). Either peer may be
    None (send only or receive only). ``consume(k, offset, data)`` handles received chunk k,
    destined for ``offset``."""
    nsend = len(send_chunks) if send_peer is not None else 0
    nrecv = len(recv_chunks) if recv_peer is not None else 0
    if nsend == 1 and nrecv == 1:
        # one message each way (every small collective): the loop below, unrolled
        off, n = send_chunks[0]
        t.send(send_peer, off, n)
        off, n = recv_chunks[0]
        consume(0, off, t.recv(recv_peer, n))
        t.release(recv_peer)
        return
    sent = 0

    def send_next():
        nonlocal sent
        off, n = send_chunks[sent]
        t.send(send_peer, off, n)
        sent += 1

    def send_ahead(k):
        # chunks k+1 .. k+window, while the transport can take them without waiting
        while sent < nsend and sent <= k + t.send_window and t.can_send(send_peer):
            send_next()

    if nsend:
        send_next()
    for k in range(max(nsend, nrecv)):
        send_ahead(k)
        if k < nrecv:
            off, n = recv_chunks[k]
            data = t.recv(recv_peer, n)
            send_ahead(k)
            consume(k, off, data)
            t.release(recv_peer)
        if sent < min(nsend, k + 2):
            send_next()


def reducer(reduce, work):
    """consume() that reduces a received chunk into the work buffer: work = op(work, data)."""
    def consume(k, off, data):
        dst = work[off:off + data.nbytes]
        reduce(dst, dst, data)
    return consume


def store(work, off, data):
    """work[off:off + len(data)] = data; into a GPU work area (CuPy) a host chunk is copied up."""
    dst = work[off:off + data.nbytes]
    if isinstance(work, np.ndarray) or not isinstance(data, np.ndarray):
        dst[...] = data
    else:
        dst.set(data)


def copier(work):
    """consume() that stores a received chunk into the work buffer."""
    def consume(k, off, data):
        store(work, off, data)
    return consume


def scale_down(xp, values, n):
    """values /= n in place: the first step of a floating-point avg, as NCCL's pre-multiplied sum
    (``xp`` is numpy or CuPy, which compute the same bits). float32 and float64 round to nearest.
    float16, whose range is tight, goes through float32 and is rounded toward zero: n scaled
    values near 65504 then cannot sum past it for n < 10 (to nearest, three 65504s give
    3 x 21840 = 65520 -> inf); only inputs within a few units in the last place of the maximum,
    over 10 or more ranks, can still overflow in the summation's own rounding. The float32 quotient
    of a float16 by n < 4096 is never a float16 unless exact, so one step back is the truncation."""
    dt = values.dtype
    if dt == xp.float16:
        q = values.astype(xp.float32) / xp.float32(n)
        r = q.astype(xp.float16)
        bits = r.view(xp.uint16)
        over = xp.abs(r.astype(xp.float32)) > xp.abs(q)           # rounded away from zero: step back
        values[...] = xp.where(over, bits - xp.uint16(1), bits).view(xp.float16)
    elif dt == xp.float32 or dt == xp.float64:
        values /= dt.type(n)
    else:
        raise TypeError(f"scale_down of {dt}")


def scale_down_bfloat16(xp, bits16, n):
    """scale_down of bfloat16 values held as their uint16 bits: through float32, to nearest even."""
    f = (bits16.astype(xp.uint32) << 16).view(xp.float32) / xp.float32(n)
    b = f.view(xp.uint32)
    rounded = ((b + xp.uint32(0x7FFF) + ((b >> 16) & xp.uint32(1))) >> 16).astype(xp.uint16)
    bits16[...] = xp.where(xp.isnan(f), (b >> 16).astype(xp.uint16) | xp.uint16(0x40), rounded)   # NaN stays NaN
