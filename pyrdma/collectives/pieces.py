"""How buffers are cut: segments (one per rank) and chunks (one per message). Pure arithmetic."""
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
