"""Elementwise reductions on the GPU: ``reduce_into(dst, src, op, stream)`` computes dst = op(dst, src).

The GPU twin of the host ``pyrdma._reduce.reduce_into``: the same op names and dtypes, run on the
caller's stream. Contiguous arrays (what collectives pass) go through one CUDA kernel per op and dtype
that moves 16 bytes per load, so that even int8 and float16 run at memory bandwidth (a one-element-
per-thread kernel is bound by instruction issue there); strided views go through a CuPy
ElementwiseKernel. float16 is computed in float32 and rounded once, as numpy does. Integer sums and
products wrap around as in C; min/max propagate NaN like numpy.minimum/maximum. "avg" accumulates like "sum";
a collective finishes the average with ``finalize_avg(dst, nranks)`` once every contribution is in
(float division; integer division truncates toward zero, as NCCL's ncclAvg does).
"""
import threading

import numpy as np

from pyrdma.errors import UsageError
from pyrdma.cuda._driver import import_cupy
from pyrdma.cuda.buffers import is_cuda_array

REDUCE_OPS = ("sum", "prod", "min", "max", "avg")
REDUCE_DTYPES = tuple(np.dtype(t) for t in ("int8", "uint8", "int32", "int64", "float16", "float32", "float64"))
_DTYPE_SET = frozenset(REDUCE_DTYPES)
_INT_KINDS = "iu"

# Loop bodies: x is the incoming value, y the accumulator (the output, read then written).
_BODIES = {
    "sum": ("y = y + x", "y = y + x"),
    "prod": ("y = y * x", "y = y * x"),
    "min": ("y = (x < y) ? x : y", "y = (x < y || isnan((double)x)) ? x : y"),
    "max": ("y = (x > y) ? x : y", "y = (x > y || isnan((double)x)) ? x : y"),
}
_BODIES["avg"] = _BODIES["sum"]
# count is an int64 scalar argument ("n" and "i" are reserved names in ElementwiseKernel)
_AVG_BODIES = {"int": "y = y / count", "float16": "y = (T)((float)y / (float)count)",
               "float": "y = (T)((double)y / (double)count)"}

# storage type of each dtype in the vector kernel, and the type its arithmetic is done in
_CTYPES = {"int8": ("signed char", None), "uint8": ("unsigned char", None), "int32": ("int", None),
           "int64": ("long long", None), "float16": ("unsigned short", "float"), "float32": ("float", None),
           "float64": ("double", None)}
VECTOR_BYTES = 16
THREADS = 256
BLOCKS_PER_SM = 8      # 8 x 256 threads fill an SM; a grid-stride loop covers the rest

_VECTOR_SOURCE = r"""
typedef %(storage)s T;
typedef %(compute)s C;
__device__ __forceinline__ C load(T v) { %(load)s }
__device__ __forceinline__ T store(C v) { %(store)s }
__device__ __forceinline__ T combine(T yt, T xt) {
    C y = load(yt), x = load(xt);
    %(body)s;
}
// y[i] = op(y[i], x[i]) for i < n; the first nvec * (16 / sizeof(T)) elements as 16-byte vectors
extern "C" __global__ void %(name)s(T* __restrict__ y, const T* __restrict__ x,
                                    unsigned long long n, unsigned long long nvec) {
    const int per = 16 / sizeof(T);
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long v = i; v < nvec; v += stride) {
        uint4 a = reinterpret_cast<const uint4*>(x)[v];
        uint4 b = reinterpret_cast<uint4*>(y)[v];
        const T* pa = reinterpret_cast<const T*>(&a);
        T* pb = reinterpret_cast<T*>(&b);
#pragma unroll
        for (int k = 0; k < per; ++k) pb[k] = combine(pb[k], pa[k]);
        reinterpret_cast<uint4*>(y)[v] = b;
    }
    for (unsigned long long e = nvec * per + i; e < n; e += stride) y[e] = combine(y[e], x[e]);
}
"""
# float16 <-> float32 with the hardware conversions (round to nearest even), no header needed
_HALF_LOAD = 'float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v)); return f;'
_HALF_STORE = 'unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v)); return h;'

_kernel_lock = threading.Lock()
_kernels = {}
_sm_counts = {}


def normalize_op(op):
    """The op name in lower case, or UsageError naming the ops there are."""
    name = getattr(op, "name", op)
    if isinstance(name, str) and name.lower() in REDUCE_OPS:
        return name.lower()
    raise UsageError(f"unknown reduction op {op!r}; use one of {', '.join(REDUCE_OPS)}")


def check_dtype(dtype):
    """numpy dtype if the GPU kernels support it, else UsageError (bfloat16 gets its own reason)."""
    if isinstance(dtype, np.dtype) and dtype in _DTYPE_SET:    # the common case, first
        return dtype
    name = str(dtype).rsplit(".", 1)[-1]      # numpy dtype, "bfloat16", torch.bfloat16 ...
    if name == "bfloat16":
        raise UsageError("bfloat16 reductions need a bfloat16 dtype in CuPy, which it does not have; "
                         "reduce in float32 (cast) or use a framework with native bfloat16")
    try:
        dt = None if dtype is None else np.dtype(dtype)   # np.dtype(None) would be float64
    except TypeError:
        dt = None
    if dt is None or dt not in REDUCE_DTYPES:     # (None == dtype('float64') in numpy)
        raise UsageError(f"GPU reduction of dtype {dtype} is not supported; use one of "
                         f"{', '.join(d.name for d in REDUCE_DTYPES)}")
    return dt


def kernel_source(op, dtype):
    """The loop body used for ``op`` on ``dtype`` (exposed for tests and reading)."""
    return _BODIES[normalize_op(op)][0 if check_dtype(dtype).kind in _INT_KINDS else 1]


def vector_kernel_source(op, dtype):
    """CUDA source of the vectorised kernel for ``op`` on ``dtype``, and its name."""
    op, dt = normalize_op(op), check_dtype(dtype)
    storage, compute = _CTYPES[dt.name]
    name = f"pyrdma_reduce_{op}_{dt.name}"
    body = _BODIES[op][0 if dt.kind in _INT_KINDS else 1].replace("isnan((double)x)", "(x != x)")
    if op in ("min", "max"):
        # "y = (cond) ? x : y": pick an operand's own bits (a NaN's payload too), computing nothing
        body = "return " + body[len("y = "):].replace("? x : y", "? xt : yt")
    else:
        body += "; return store(y)"
    half = compute is not None
    src = _VECTOR_SOURCE % {"storage": storage, "compute": compute or storage, "name": name, "body": body,
                            "load": _HALF_LOAD if half else "return v;",
                            "store": _HALF_STORE if half else "return v;"}
    return src, name


def _vector_kernel(cp, op, dtype):
    key = ("vector", op, dtype)
    with _kernel_lock:
        k = _kernels.get(key)
        if k is None:
            src, name = vector_kernel_source(op, dtype)
            k = _kernels[key] = cp.RawKernel(src, name)
        return k


def _grid(cp, device_id, work):
    sms = _sm_counts.get(device_id)
    if sms is None:
        sms = _sm_counts[device_id] = cp.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"]
    return max(1, min(-(-work // THREADS), sms * BLOCKS_PER_SM))


def _kernel(cp, op, dtype):
    is_int = dtype.kind in _INT_KINDS
    key = (op, is_int)
    with _kernel_lock:
        k = _kernels.get(key)
        if k is None:
            body = _BODIES[op][0 if is_int else 1]
            k = cp.ElementwiseKernel("T x", "T y", body, f"pyrdma_reduce_{op}_{'int' if is_int else 'float'}")
            _kernels[key] = k
        return k


def _avg_kernel(cp, dtype):
    variant = "int" if dtype.kind in _INT_KINDS else ("float16" if dtype == np.float16 else "float")
    key = ("finalize_avg", variant)
    with _kernel_lock:
        k = _kernels.get(key)
        if k is None:
            k = cp.ElementwiseKernel("int64 count", "T y", _AVG_BODIES[variant], f"pyrdma_avg_{variant}")
            _kernels[key] = k
        return k


def as_stream(cp, stream):
    """A CuPy stream object for ``stream``: None (current stream), a CuPy stream, an object with
    ``__cuda_stream__`` or ``cuda_stream`` (e.g. torch.cuda.Stream), or a raw cudaStream_t int."""
    if stream is None:
        return cp.cuda.get_current_stream()
    if isinstance(stream, (cp.cuda.Stream, cp.cuda.ExternalStream)):
        return stream
    if hasattr(stream, "__cuda_stream__"):
        handle = stream.__cuda_stream__()
        handle = handle[1] if isinstance(handle, tuple) else handle
        return cp.cuda.ExternalStream(int(handle))
    if hasattr(stream, "cuda_stream"):
        return cp.cuda.ExternalStream(int(stream.cuda_stream))
    if isinstance(stream, int) and not isinstance(stream, bool):
        return cp.cuda.ExternalStream(stream)
    raise UsageError(f"cannot use {type(stream).__name__} as a CUDA stream; pass a cupy.cuda.Stream, "
                     f"an object with __cuda_stream__, or a cudaStream_t handle")


def as_cupy(cp, obj, what):
    """A CuPy view (never a copy) of a CUDA array object."""
    if isinstance(obj, cp.ndarray):
        return obj
    dtype = getattr(obj, "dtype", None)
    if dtype is not None and str(dtype).endswith("bfloat16"):
        check_dtype(dtype)    # raises the bfloat16 UsageError before CuPy fails to import the array
    if isinstance(obj, np.ndarray):
        raise UsageError(f"{what} is a numpy array; reduce host arrays with pyrdma._reduce.reduce_into")
    if not is_cuda_array(obj):
        raise UsageError(f"{what} ({type(obj).__name__}) is not a CUDA array")
    if hasattr(obj, "__cuda_array_interface__"):
        return cp.asarray(obj)
    return cp.from_dlpack(obj)


def _check_pair(dst, src):
    if dst.dtype != src.dtype:
        raise UsageError(f"dst and src dtypes differ ({dst.dtype} vs {src.dtype})")
    if dst.shape != src.shape:
        if dst.size != src.size:
            raise UsageError(f"dst and src sizes differ ({dst.size} vs {src.size} elements)")
        if not (dst.flags.c_contiguous and src.flags.c_contiguous):
            raise UsageError(f"dst and src shapes differ ({dst.shape} vs {src.shape}) and are not both "
                             f"contiguous")
        src = src.reshape(dst.shape)
    if dst.device.id != src.device.id:
        raise UsageError(f"dst is on GPU {dst.device.id} but src on GPU {src.device.id}")
    return src


def reduce_into(dst, src, op="sum", stream=None):
    """dst = op(dst, src) elementwise on the GPU, enqueued on ``stream`` (default: current stream).

    dst and src are CuPy arrays or CUDA arrays CuPy can view (__cuda_array_interface__, DLPack) of
    the same dtype and size on the same GPU. Returns dst. Asynchronous: synchronize the stream
    before reading the result on the host.
    """
    op = normalize_op(op)
    cp = import_cupy("pyrdma.cuda.reduce_into")
    d = as_cupy(cp, dst, "dst")
    s = as_cupy(cp, src, "src")
    check_dtype(d.dtype)
    s = _check_pair(d, s)
    with d.device:
        st = as_stream(cp, stream)
        with st:
            if d.flags.c_contiguous and s.flags.c_contiguous:
                n = d.size
                per = VECTOR_BYTES // d.itemsize
                aligned = (d.data.ptr | s.data.ptr) % VECTOR_BYTES == 0
                nvec = n // per if aligned else 0
                blocks = _grid(cp, d.device.id, nvec + n % per if aligned else n)
                _vector_kernel(cp, op, d.dtype)((blocks,), (THREADS,), (d, s, np.uint64(n), np.uint64(nvec)))
            else:
                _kernel(cp, op, d.dtype)(s, d)
    return dst


def finalize_avg(dst, count, stream=None):
    """dst /= count on the GPU (the last step of an "avg" reduction over ``count`` ranks). Returns dst."""
    count = int(count)
    if count <= 0:
        raise UsageError(f"count must be positive, got {count}")
    cp = import_cupy("pyrdma.cuda.finalize_avg")
    d = as_cupy(cp, dst, "dst")
    dt = check_dtype(d.dtype)
    kernel = _avg_kernel(cp, dt)
    with d.device:
        with as_stream(cp, stream):
            kernel(np.int64(count), d)
    return dst
