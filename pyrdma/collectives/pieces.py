"""How buffers are cut: segments (one per rank) and chunks (one per message); and the scaling of
a floating-point avg. Pure arithmetic."""
import functools


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


class Segments:
    """``count`` elements in ``parts`` segments, each cut into the same number of chunks (so that
    the chunk k of any segment is a message both sides agree on)."""

    def __init__(self, count, itemsize, parts, max_message, bounds=None):
        self.itemsize = itemsize
        self.bounds = tuple(bounds) if bounds is not None else segment_bounds(count, parts)
        longest = max(self.bounds[i + 1] - self.bounds[i] for i in range(parts))
        self.nchunks = nchunks_for(longest, itemsize, max_message)

    def chunks(self, seg):
        return chunk_ranges(self.bounds[seg], self.bounds[seg + 1], self.nchunks, self.itemsize)


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
