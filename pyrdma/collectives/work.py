"""The caller's buffers as the collectives see them: flat byte views of C-contiguous arrays of
plain data (host memory: numpy, the buffer protocol, CPU DLPack), their reduction dtype, the checks
every collective makes of them (contiguity, writability, overlap, sizes), and op="avg"."""
import numpy as np

from pyrdma import _reduce
from pyrdma.buffers import host_array
from pyrdma.avg import scale_down, scale_down_bfloat16
from pyrdma.errors import UsageError


class HostMemory:
    """The kind of a work area in host memory (numpy: the transport's own buffer, the caller's
    arrays, pinned staging slots). A kind is all a transport and the engine know of a work area's
    memory, so that neither asks what memory it is (gloo's workspace idea); the device kind is
    pyrdma.cuda's DirectArea (GPU memory). A kind has:
      ``address(view)``; ``access(view)``, the remote access a registration of it needs;
      ``register(pd, view, access)`` -> (MemoryRegion, offset of view in it);
      ``sync()``, which returns once what was written to it is there for the NIC to read;
      ``read(view)``, its bytes as host memory (what a socket sends); ``write(view, data)``, host
      bytes stored into it;
      ``consumes``: whether received chunks go through Python (schedule.consumer, with ``reduce``,
      None to copy only) rather than being reduced and copied in C on the memory itself."""

    consumes = False
    reduce = None

    @staticmethod
    def address(view):
        if not isinstance(view, np.ndarray):
            raise UsageError(f"work_area: lent memory of type {type(view).__name__} is not host memory; it "
                             f"needs its kind (registration and sync: pyrdma.cuda's DirectArea for GPU memory)")
        return view.__array_interface__["data"][0]

    @staticmethod
    def access(view):
        import pyrdma
        # a writable buffer may receive a rendezvous message: the peer writes it
        return pyrdma.ACCESS_LOCAL_WRITE | pyrdma.ACCESS_REMOTE_WRITE if view.flags.writeable else 0

    @staticmethod
    def register(pd, view, access):
        import pyrdma
        return pyrdma.MemoryRegion(pd, view, access), 0

    @staticmethod
    def sync():
        pass

    @staticmethod
    def read(view):
        return view

    @staticmethod
    def write(view, data):
        view[...] = data


HOST = HostMemory()


class Operand:
    """A user buffer as a flat C-contiguous numpy view (never a copy), with its reduction dtype."""

    def __init__(self, obj, name, writable, dtype=None):
        arr = host_view(obj, name, writable, "pass a writable buffer (or out=)")
        self.obj = obj
        self.code = _reduce.dtype_code(arr.dtype if dtype is None else dtype)
        self.itemsize = _reduce.ITEMSIZE[self.code]
        if arr.dtype.itemsize != self.itemsize:
            raise UsageError(f"{name} has {arr.dtype.itemsize}-byte elements ({arr.dtype}); dtype={dtype!r} "
                             f"needs {self.itemsize}-byte ones")
        self.array = arr
        flat = arr.reshape(-1)
        if self.code == _reduce.BFLOAT16:     # ml_dtypes arrays export no buffer: use their bits
            flat = flat.view(np.uint16)
        self.bytes = flat.view(np.uint8)
        self.nbytes = self.bytes.nbytes
        self.count = self.nbytes // self.itemsize
        self.dtype_name = _reduce.DTYPE_NAMES[self.code]

    def same_type(self, other, name):
        if other.code != self.code or other.array.dtype != self.array.dtype:
            raise UsageError(f"{name} has dtype {other.array.dtype}, the input has {self.array.dtype}")


def in_and_out(buf, out, dtype, writes):
    """(src, dst) operands of a reduction: in place on buf when out is None, else into out, which
    must match buf. ``writes``: whether this rank stores a result (buf or out must be writable)."""
    src = Operand(buf, "buf", writable=writes and out is None, dtype=dtype)
    if out is None:
        return src, src
    dst = Operand(out, "out", writable=writes, dtype=dtype)
    src.same_type(dst, "out")
    if dst.count != src.count:
        raise UsageError(f"out has {dst.count} elements ({dst.nbytes} bytes, expected {src.nbytes}): "
                         f"it must match buf")
    check_apart(src, dst)
    return src, dst


FLOAT_CODES = frozenset(_reduce.DTYPE_NAMES.index(n) for n in ("float16", "float32", "float64", "bfloat16"))


def prescale(work, code, n):
    """work /= n in place on the raw bytes of a floating-point dtype (code: pyrdma._reduce's), rounded
    toward zero (pyrdma.avg.scale_down): the first step of a floating-point avg, as NCCL's
    pre-multiplied sum, so the sum of n scaled inputs cannot overflow where their mean is finite."""
    name = _reduce.DTYPE_NAMES[code]
    if name == "bfloat16":
        scale_down_bfloat16(np, work.view(np.uint16), n)
    else:
        scale_down(np, work.view(name), n)


def check_apart(src, dst):
    """UsageError if ``out`` overlaps ``buf`` without being the same memory: the result of one piece
    would overwrite input of a later one. The very same memory is fine (in place)."""
    if src is dst:
        return
    a0 = src.bytes.__array_interface__["data"][0]
    b0 = dst.bytes.__array_interface__["data"][0]
    if a0 == b0 and src.nbytes == dst.nbytes:
        return
    if a0 < b0 + dst.nbytes and b0 < a0 + src.nbytes and src.nbytes and dst.nbytes:
        raise UsageError("out overlaps buf without being the same memory; pass out=None (in place), "
                         "out=buf, or an out that does not overlap buf")


class Avg:
    """op="avg", handled in one place: floating-point inputs are scaled by 1/n before the sum (as
    NCCL), integer sums divided by n after it."""

    def __init__(self, op, code, n):
        self.scale = op == "avg" and code in FLOAT_CODES
        self.divide = op == "avg" and code not in FLOAT_CODES
        self.code, self.n = code, n

    def before(self, work):
        if self.scale:
            prescale(work, self.code, self.n)

    def after(self, work):
        if self.divide:
            _reduce.divide_bytes(work, self.code, self.n)


def plain_bytes(obj, name, writable=False):
    """(array, flat uint8 view) of a C-contiguous buffer of plain data."""
    arr = host_view(obj, name, writable, "it receives data")
    check_plain(arr, name)
    return arr, raw_bytes(arr)


def host_view(obj, name, writable, why):
    """The numpy view of a C-contiguous host buffer; UsageError if it is not one, or read-only
    where it is ``writable`` (``why``: what the message tells the caller to do)."""
    arr = host_array(obj, name)
    if not arr.flags.c_contiguous:
        raise UsageError(f"{name} is not C-contiguous; pass numpy.ascontiguousarray({name})")
    if writable and not arr.flags.writeable:
        raise UsageError(f"{name} is read-only; {why}")
    return arr


def byte_bounds(counts, name, size, itemsize):
    """Byte offsets (size + 1) of per-rank element ``counts``."""
    try:
        c = [int(x) for x in counts]
    except (TypeError, ValueError):
        raise UsageError(f"{name} must be a sequence of {size} element counts, got {counts!r}") from None
    if len(c) != size or any(x < 0 for x in c):
        raise UsageError(f"{name} must hold {size} counts >= 0 (one per rank), got {c}")
    bounds = [0]
    for x in c:
        bounds.append(bounds[-1] + x * itemsize)
    return tuple(bounds)


def check_plain(arr, name):
    """Byte-copying collectives carry plain data only: an object array holds pointers into this
    process, which another process would dereference."""
    if arr.dtype.hasobject:
        raise UsageError(f"{name} has dtype {arr.dtype}, which holds Python objects; the collectives move "
                         f"plain data only")


def raw_bytes(arr):
    """A flat uint8 view of a C-contiguous array of any dtype (bfloat16 and structured included)."""
    flat = arr.reshape(-1)
    try:
        return flat.view(np.uint8)
    except ValueError:
        return flat.view(f"V{arr.dtype.itemsize}").view(np.uint8)
