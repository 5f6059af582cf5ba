# cython: boundscheck=False, wraparound=False
"""Element-wise reductions on CPU buffers, in C without the GIL (include/pyrdma_reduce.h).

    reduce_into(dst, src, op)      dst = op(dst, src)
    reduce_out(dst, a, b, op)      dst = op(a, b)
    divide(buf, n)                 buf /= n (the last step of 'avg'; integers truncate toward zero)

Ops: "sum", "prod", "min", "max". Dtypes: int8, uint8, int32, int64, float16, float32, float64 and
bfloat16 (``ml_dtypes.bfloat16`` arrays, or ``dtype="bfloat16"`` on uint16 arrays holding the bits).
Results equal numpy's ufuncs (np.add, np.multiply, np.minimum, np.maximum) element by element:
integers wrap, floats are one IEEE operation each, float16/bfloat16 are computed in float and
rounded to nearest even, min/max propagate NaN. Arrays must be C-contiguous, of the same dtype and
the same number of elements, ``dst`` writable; anything else raises pyrdma.UsageError.

``reduce_bytes(dst, a, b, dtype_code, op_code)`` is the collectives' fast path on uint8 views.
"""
from libc.stdint cimport int64_t, uintptr_t
import numpy as np

from pyrdma.buffers import host_array
from pyrdma.errors import UsageError

cdef extern from "pyrdma_reduce.h" nogil:
    int pyrdma_reduce(void *dst, const void *a, const void *b, size_t n, int dtype, int op)
    int pyrdma_divide(void *buf, size_t count, int dtype, int64_t n)
    int pyrdma_have_f16c()
    int pyrdma_f16c_enabled
    const size_t pyrdma_itemsize[8]

SUM, PROD, MIN, MAX = 0, 1, 2, 3
OPS = {"sum": SUM, "prod": PROD, "min": MIN, "max": MAX}
INT8, UINT8, INT32, INT64, FLOAT16, FLOAT32, FLOAT64, BFLOAT16 = range(8)
DTYPE_NAMES = ("int8", "uint8", "int32", "int64", "float16", "float32", "float64", "bfloat16")
ITEMSIZE = (1, 1, 4, 8, 2, 4, 8, 2)
SUPPORTED_DTYPES = DTYPE_NAMES
# numpy dtype (kind, itemsize) -> code; bfloat16 is recognised by name (ml_dtypes need not be imported)
_KINDS = {("i", 1): INT8, ("u", 1): UINT8, ("i", 4): INT32, ("i", 8): INT64,
          ("f", 2): FLOAT16, ("f", 4): FLOAT32, ("f", 8): FLOAT64}
# storage dtype of each code, for views
STORAGE = (np.int8, np.uint8, np.int32, np.int64, np.float16, np.float32, np.float64, np.uint16)


def dtype_code(dtype):
    """The C code of a supported dtype: a numpy dtype (or anything np.dtype accepts), an
    ``ml_dtypes.bfloat16`` dtype, or the string "bfloat16" (uint16 storage)."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        return BFLOAT16
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise UsageError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPE_NAMES)}") from None
    # dt.type.__name__, not dt.name: numpy computes .name in Python, a cost paid per collective
    if dt.itemsize == 2 and dt.type.__name__ == "bfloat16":
        return BFLOAT16
    code = _KINDS.get((dt.kind, dt.itemsize)) if dt.isnative else None
    if code is None:
        raise UsageError(f"unsupported dtype {dt}{'' if dt.isnative else ' (non-native byte order)'}; "
                         f"supported: {', '.join(DTYPE_NAMES)}")
    return code


def op_code(op):
    """The C code of "sum", "prod", "min" or "max"."""
    try:
        return OPS[op]
    except (KeyError, TypeError):
        pass
    if op == "avg":
        raise UsageError("'avg' is not an element-wise op: reduce with 'sum', then divide(buf, n)")
    raise UsageError(f"unsupported op {op!r}; supported: {', '.join(OPS)}")


cdef object _storage(arr, int code):
    # ml_dtypes.bfloat16 arrays do not export the buffer protocol: look at their bits as uint16.
    if code == BFLOAT16 and arr.dtype != np.uint16:
        return arr.view(np.uint16)
    return arr


cdef int _check_operand(arr, str name, bint writable) except -1:
    if not arr.flags.c_contiguous:
        raise UsageError(f"{name} is not C-contiguous; pass numpy.ascontiguousarray({name})")
    if writable and not arr.flags.writeable:
        raise UsageError(f"{name} is read-only")
    return 0


cdef inline bint _overlap(uintptr_t p, uintptr_t q, size_t n):
    return p < q + n and q < p + n


cdef int _run(object dst, object a, object b, int code, int opc) except -1:
    """dst = op(a, b) on validated, same-length contiguous arrays; copies b (or a) first when it
    overlaps dst other than exactly."""
    cdef const unsigned char[::1] va
    cdef const unsigned char[::1] vb
    cdef unsigned char[::1] vd
    cdef size_t nbytes, count
    cdef int rc
    vd = dst.reshape(-1).view(np.uint8)
    va = a.reshape(-1).view(np.uint8)
    vb = b.reshape(-1).view(np.uint8)
    nbytes = vd.shape[0]
    count = nbytes // ITEMSIZE[code]
    if nbytes == 0:
        return 0
    if <uintptr_t>&va[0] != <uintptr_t>&vd[0] and _overlap(<uintptr_t>&va[0], <uintptr_t>&vd[0], nbytes):
        va = np.array(a, copy=True).reshape(-1).view(np.uint8)
    if <uintptr_t>&vb[0] != <uintptr_t>&vd[0] and _overlap(<uintptr_t>&vb[0], <uintptr_t>&vd[0], nbytes):
        vb = np.array(b, copy=True).reshape(-1).view(np.uint8)
    with nogil:
        rc = pyrdma_reduce(&vd[0], &va[0], &vb[0], count, code, opc)
    if rc:
        raise UsageError(f"no reduction for dtype code {code}, op code {opc}")
    return 0


def _prepare(dst, srcs, op, dtype):
    d = host_array(dst, "dst")
    arrays = [host_array(s, n) for n, s in srcs]
    if dtype is None:
        code = dtype_code(d.dtype)
        for (n, _), arr in zip(srcs, arrays):
            if arr.dtype != d.dtype:
                raise UsageError(f"dtype mismatch: dst is {d.dtype}, {n} is {arr.dtype}")
    else:
        code = dtype_code(dtype)
        for (n, _), arr in zip([("dst", dst)] + list(srcs), [d] + arrays):
            if arr.dtype.itemsize != ITEMSIZE[code]:
                raise UsageError(f"{n} has {arr.dtype.itemsize}-byte elements ({arr.dtype}); "
                                 f"dtype={dtype!r} needs {ITEMSIZE[code]}-byte ones")
    opc = op_code(op)
    _check_operand(d, "dst", True)
    for (n, _), arr in zip(srcs, arrays):
        _check_operand(arr, n, False)
        if arr.size != d.size:
            raise UsageError(f"size mismatch: dst has {d.size} elements, {n} has {arr.size}")
    return _storage(d, code), [_storage(arr, code) for arr in arrays], code, opc


def reduce_into(dst, src, op="sum", dtype=None):
    """dst = op(dst, src) element-wise, the GIL released. ``dtype`` overrides the arrays' own
    (e.g. "bfloat16" on uint16 arrays holding bfloat16 bits). Returns dst."""
    d, (s,), code, opc = _prepare(dst, [("src", src)], op, dtype)
    _run(d, d, s, code, opc)
    return dst


def reduce_out(dst, a, b, op="sum", dtype=None):
    """dst = op(a, b) element-wise (dst may be a or b), the GIL released. Returns dst."""
    d, (x, y), code, opc = _prepare(dst, [("a", a), ("b", b)], op, dtype)
    _run(d, x, y, code, opc)
    return dst


def divide(buf, int64_t n, dtype=None):
    """buf /= n in place: floats divide (float16/bfloat16 through float, rounded to nearest even),
    integers truncate toward zero (C and NCCL semantics). The last step of an 'avg' reduction."""
    cdef unsigned char[::1] view
    cdef int code, rc
    cdef size_t count
    if n <= 0:
        raise UsageError(f"cannot divide by {n}")
    arr = host_array(buf, "buf")
    code = dtype_code(arr.dtype if dtype is None else dtype)
    if arr.dtype.itemsize != ITEMSIZE[code]:
        raise UsageError(f"buf has {arr.dtype.itemsize}-byte elements; dtype={dtype!r} needs {ITEMSIZE[code]}")
    _check_operand(arr, "buf", True)
    view = _storage(arr, code).reshape(-1).view(np.uint8)
    count = view.shape[0] // ITEMSIZE[code]
    if count:
        with nogil:
            rc = pyrdma_divide(&view[0], count, code, n)
    return buf


def reduce_bytes(unsigned char[::1] dst, const unsigned char[::1] a, const unsigned char[::1] b,
                 int dtype, int op):
    """dst = op(a, b) on raw bytes (uint8 views) holding elements of dtype code ``dtype``; dst may
    be a or b but must not partly overlap them. The collectives' inner loop: few checks."""
    cdef size_t nbytes = dst.shape[0]
    cdef int rc
    if not 0 <= dtype < 8:
        raise UsageError(f"unknown dtype code {dtype}")
    if a.shape[0] != <Py_ssize_t>nbytes or b.shape[0] != <Py_ssize_t>nbytes:
        raise UsageError(f"size mismatch: dst {nbytes} bytes, a {a.shape[0]}, b {b.shape[0]}")
    if nbytes % ITEMSIZE[dtype]:
        raise UsageError(f"{nbytes} bytes is not a whole number of {DTYPE_NAMES[dtype]} elements")
    if nbytes == 0:
        return
    if ((<uintptr_t>&a[0] != <uintptr_t>&dst[0] and _overlap(<uintptr_t>&a[0], <uintptr_t>&dst[0], nbytes)) or
            (<uintptr_t>&b[0] != <uintptr_t>&dst[0] and _overlap(<uintptr_t>&b[0], <uintptr_t>&dst[0], nbytes))):
        raise UsageError("dst partly overlaps an operand")
    with nogil:
        rc = pyrdma_reduce(&dst[0], &a[0], &b[0], nbytes // pyrdma_itemsize[dtype], dtype, op)
    if rc:
        raise UsageError(f"unknown op code {op}")


def divide_bytes(unsigned char[::1] buf, int dtype, int64_t n):
    """buf /= n on raw bytes of dtype code ``dtype`` (see divide())."""
    cdef int rc
    if not 0 <= dtype < 8 or n <= 0:
        raise UsageError(f"bad divide: dtype code {dtype}, n {n}")
    if buf.shape[0] == 0:
        return
    with nogil:
        rc = pyrdma_divide(&buf[0], buf.shape[0] // pyrdma_itemsize[dtype], dtype, n)


def simd_float16(enabled=None):
    """Whether float16 uses the F16C instructions (when the CPU has them). ``enabled=False``
    switches to the portable conversions (for tests), ``True`` re-detects. Returns the state."""
    global pyrdma_f16c_enabled
    if enabled is not None:
        pyrdma_f16c_enabled = 0 if not enabled else -1
    return bool(pyrdma_have_f16c())
