"""Reductions for the collectives, in C without the GIL (include/pyrdma_reduce.h)."""
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE, PyBUF_C_CONTIGUOUS, PyBUF_SIMPLE
from libc.stdint cimport int64_t
import numpy as np

from pyrdma.errors import UsageError

cdef extern from "pyrdma_reduce.h" nogil:
    int pyrdma_reduce(void *dst, const void *src, size_t n, int dtype, int op)
    int pyrdma_divide(void *buf, size_t count, int dtype, int64_t n)

OPS = {"sum": 0, "prod": 1, "min": 2, "max": 3, "avg": 0}   # avg = sum, then divide()
_DTYPES = {np.dtype(np.int8): 0, np.dtype(np.uint8): 1, np.dtype(np.int32): 2, np.dtype(np.int64): 3,
           np.dtype(np.float16): 4, np.dtype(np.float32): 5, np.dtype(np.float64): 6}
_BFLOAT16 = 7
try:
    import ml_dtypes
    _DTYPES[np.dtype(ml_dtypes.bfloat16)] = _BFLOAT16
except ImportError:
    pass
SUPPORTED_DTYPES = tuple(str(d) for d in _DTYPES)


def dtype_code(dtype):
    """The C code of a supported dtype ('bfloat16' names uint16-stored bfloat16)."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        return _BFLOAT16
    try:
        return _DTYPES[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise UsageError(f"unsupported dtype {dtype}; supported: {', '.join(SUPPORTED_DTYPES)}, bfloat16") from None


def op_code(op):
    try:
        return OPS[op]
    except (KeyError, TypeError):
        raise UsageError(f"unsupported op {op!r}; supported: {', '.join(OPS)}") from None


def reduce_into(dst, src, op="sum", dtype=None):
    """dst = op(dst, src) element-wise; both contiguous, same size. ``dtype`` overrides the arrays'
    dtype (e.g. 'bfloat16' on uint16 storage). For 'avg' this adds; call divide() at the end."""
    cdef Py_buffer d, s
    cdef int code = dtype_code(dst.dtype if dtype is None else dtype)
    cdef int opc = op_code(op)
    cdef size_t itemsize = 2 if code in (4, 7) else (1 if code < 2 else (4 if code in (2, 5) else 8))
    cdef int rc
    if dtype is None and getattr(src, "dtype", None) != dst.dtype:
        raise UsageError(f"dtype mismatch: dst is {dst.dtype}, src is {getattr(src, 'dtype', type(src))}")
    try:
        PyObject_GetBuffer(dst, &d, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
    except (BufferError, ValueError):
        raise UsageError("dst must be a writable C-contiguous array") from None
    try:
        try:
            PyObject_GetBuffer(src, &s, PyBUF_C_CONTIGUOUS)
        except (BufferError, ValueError):
            raise UsageError("src must be a C-contiguous array") from None
        try:
            if d.len != s.len:
                raise UsageError(f"size mismatch: dst has {d.len} bytes, src has {s.len}")
            if d.len % itemsize:
                raise UsageError(f"{d.len} bytes is not a whole number of {itemsize}-byte elements")
            with nogil:
                rc = pyrdma_reduce(d.buf, s.buf, d.len // itemsize, code, opc)
        finally:
            PyBuffer_Release(&s)
    finally:
        PyBuffer_Release(&d)
    if rc:
        raise UsageError(f"no reduction for dtype code {code}, op {op}")


def divide(buf, int64_t n, dtype=None):
    """buf /= n in place (integers truncate toward zero): the last step of 'avg'."""
    cdef Py_buffer b
    cdef int code = dtype_code(buf.dtype if dtype is None else dtype)
    cdef size_t itemsize = 2 if code in (4, 7) else (1 if code < 2 else (4 if code in (2, 5) else 8))
    cdef int rc
    if n <= 0:
        raise UsageError(f"divide by {n}")
    PyObject_GetBuffer(buf, &b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
    try:
        with nogil:
            rc = pyrdma_divide(b.buf, b.len // itemsize, code, n)
    finally:
        PyBuffer_Release(&b)
