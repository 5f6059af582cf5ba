"""Collectives on CUDA arrays (CuPy, or any __cuda_array_interface__/DLPack CUDA object): the
work areas and staging the Communicator runs its own algorithms on (nothing here calls into it or
imports pyrdma.collectives; the host calls come in as arguments). Two paths (the Communicator's
``gpu_path``):

direct (allreduce, broadcast): the algorithms run in place in the array's GPU memory. The transport
sends from it (over RDMA the NIC reads it through a GPUDirect registration; over TCP each message is
copied out), received chunks are copied up and reduced by reduce_into's CUDA kernels (GpuReducer).

staged (every collective; the only path without GPUDirect RDMA): the data crosses the host:

- the blocking allreduce, reduce and broadcast keep their shape, so they run through
  HostStagingPipeline (``staged``): chunk k is copied device -> pinned host, the host collective
  runs on it, and it is copied back, while the copies of chunks k-1 and k+1 are in flight. The
  pinned slots are reused across calls, so the host collective registers them for RDMA once.
- every other call (``stage``) copies its CUDA arrays to pinned host memory, the host call runs on
  the copies, and the copies it wrote are uploaded (not pipelined).

Staged, the arithmetic is the host collective's (pyrdma._reduce); direct, the GPU kernels compute
what it computes (float16 in float32, rounded once; min/max pick an operand's bits; a floating-point
avg divides every input by n first). Either way the results are bit for bit those of the numpy
path. bfloat16 CUDA tensors (DLPack), which the GPU kernels lack, always stage: they travel as their
16-bit patterns and reduce as bfloat16.
Calls are stream-ordered on the current CuPy stream (or ``stream=``): they wait for work already
enqueued there, and work enqueued after them sees the result.
"""
import numpy as np

from pyrdma.errors import UsageError
from pyrdma.cuda._driver import import_cupy
from pyrdma.cuda.buffers import BIT_TWINS, device_buffer, is_cuda_array
from pyrdma.cuda.reduce import check_dtype, finalize_avg, reduce_into
from pyrdma.cuda.staging import default_pipeline


def _describe(obj, what, allow_empty=False):
    """(DeviceBuffer, numpy dtype holding its elements, dtype name for the host collectives or None)."""
    buf = device_buffer(obj, allow_empty=allow_empty)
    if buf.dtype is not None:
        return buf, buf.dtype, None
    twin = BIT_TWINS.get(buf.dtype_name)
    if twin is None:
        raise UsageError(f"{what} has dtype {buf.dtype_name}, which the collectives do not support")
    return buf, twin, buf.dtype_name


def _cupy_view(cp, obj, buf, dtype):
    """A flat CuPy array over ``obj``'s memory (no copy), typed ``dtype`` (bfloat16 as uint16)."""
    mem = cp.cuda.UnownedMemory(buf.ptr, buf.nbytes, obj, device_id=_device_id(cp, buf))
    return cp.ndarray((buf.nbytes // dtype.itemsize,), dtype, cp.cuda.MemoryPointer(mem, 0))


def _device_id(cp, buf):
    if buf.device_id is not None:
        return buf.device_id
    return int(cp.cuda.runtime.pointerGetAttributes(buf.ptr).device)


def check_pair(buf, out, what):
    """UsageError unless buf and out (if given) are both CUDA arrays."""
    if out is not None and is_cuda_array(buf) != is_cuda_array(out):
        raise UsageError(f"{what}: buf and out must both be CUDA arrays or both host arrays")


def _copy_into(cp, dst_obj, src_obj, what):
    """dst = src on the GPU (same bytes, same dtype), on the current stream."""
    dbuf, dtype, _ = _describe(dst_obj, "out")
    sbuf, stype, _ = _describe(src_obj, "buf")
    if (dbuf.dtype_name, dbuf.nbytes) != (sbuf.dtype_name, sbuf.nbytes):
        raise UsageError(f"{what}: out must match buf ({sbuf.nbytes} bytes of {sbuf.dtype_name}); "
                         f"it has {dbuf.nbytes} bytes of {dbuf.dtype_name}")
    if dbuf.readonly:
        raise UsageError(f"{what}: out is read-only")
    if dbuf.ptr != sbuf.ptr:
        if dbuf.ptr < sbuf.ptr + sbuf.nbytes and sbuf.ptr < dbuf.ptr + dbuf.nbytes:
            # a copy between overlapping ranges races on the GPU (and the host path refuses it too)
            raise UsageError(f"{what}: out overlaps buf without being the same memory; pass out=None "
                             f"(in place), out=buf, or an out that does not overlap buf")
        _cupy_view(cp, dst_obj, dbuf, dtype)[...] = _cupy_view(cp, src_obj, sbuf, stype)


def staged(what, buf, out, host_op, dtype=None, stream=None, pipeline=None):
    """A collective that keeps the array's shape (allreduce, reduce, broadcast) of a CUDA array,
    through pinned host memory chunk by chunk (HostStagingPipeline): ``out``, if given, first takes
    a copy of ``buf``; then ``host_op(chunk, dtype)`` runs the host collective in place on each
    chunk of it (``dtype``: the host reduction dtype, "bfloat16" for a bfloat16 array, whose chunks
    hold its bits as uint16). The caller (the Communicator) supplies host_op, so nothing here calls
    into it. Returns the array holding the result."""
    check_pair(buf, out, what)
    cp = import_cupy(f"{what} of a CUDA array")
    _, _, twin = _describe(buf, "buf")
    dtype = host_dtype(dtype, twin)
    result = buf if out is None else out
    with _on(cp, stream):
        if result is not buf:
            _copy_into(cp, out, buf, what)
        (pipeline or default_pipeline()).run(result, lambda chunk: host_op(chunk, dtype), stream)
    return result


def stage(name, args, stream=None):
    """A call (``name``: any collective or point-to-point one) on CUDA arrays, staged: the CUDA
    arrays among ``args`` (or in a tuple of them) copied to pinned host memory now, on ``stream``
    (default: the current one), in stream order. Returns (host_args, finish, reduced_as): the caller
    runs the host call on host_args, then ``finish(result)``, on any thread, uploads the copies the
    call wrote (its outputs) and synchronises, and returns the result: a staged array's own CUDA
    array where the result is its copy, a new CuPy array where it is a new host array (of the bits,
    as uint16, for a bfloat16 call); ``reduced_as`` is "bfloat16" when a bfloat16 array was staged
    (its copy holds the bits as uint16, so a reduction must be told), else None."""
    cp = import_cupy(f"{name} of a CUDA array")
    staged = []
    twins = set()

    def down(obj):
        if obj is None or isinstance(obj, np.ndarray) or not is_cuda_array(obj):
            return obj
        buf, dtype, twin = _describe(obj, name, allow_empty=True)
        if twin is not None:
            twins.add(twin)
        host = _pinned_copy(cp, _cupy_view(cp, obj, buf, dtype)) if buf.nbytes else np.empty(0, dtype)
        staged.append((obj, buf, dtype, host, host.copy()))
        if buf.readonly:
            host = host.view()
            host.flags.writeable = False    # the host call refuses it as an output, as it would the array
        return host.reshape(buf.shape) if buf.shape else host
    with _on(cp, stream):
        host_args = [tuple(down(a) for a in x) if isinstance(x, tuple) else down(x) for x in args]

    def finish(result):
        with _on(cp, stream):
            for obj, buf, dtype, host, before in staged:
                if buf.nbytes and not np.array_equal(host.view(np.uint8), before.view(np.uint8)):
                    with cp.cuda.Device(_device_id(cp, buf)):
                        _upload(cp, _cupy_view(cp, obj, buf, dtype), host)
                if result is not None and isinstance(result, np.ndarray) and np.shares_memory(result, host):
                    result = obj
            if isinstance(result, np.ndarray):
                result = cp.asarray(result)
        return result
    if len(twins) > 1:
        raise UsageError(f"{name}: arrays of {' and '.join(sorted(twins))} in one call")
    return host_args, finish, (twins.pop() if twins else None)


# ---- gpu_path "direct": the transport sends from GPU memory, CUDA kernels reduce ----------------

def device_of(obj):
    """The GPU ordinal holding a CUDA array."""
    buf = device_buffer(obj)
    if buf.device_id is not None:
        return buf.device_id
    return _device_id(import_cupy("a CUDA collective"), buf)


class GpuReducer:
    """The ``reduce(dst, a, b)`` of the collective algorithms (dst = op(a, b) on uint8 views), for a
    GPU work area: a received chunk (host memory when it landed in the transport's receive slots)
    is copied up into a scratch buffer, reduced into the work area by reduce_into's kernel, and the
    stream is synchronised, since the next message may be sent from the result."""

    def __init__(self, cp, dtype, op):
        self.cp, self.dtype, self.op = cp, check_dtype(dtype), op
        self._scratch = None

    def __call__(self, dst, a, b):
        cp = self.cp
        if not isinstance(b, cp.ndarray):
            if self._scratch is None or self._scratch.nbytes < b.nbytes:
                self._scratch = cp.empty(max(b.nbytes, 1 << 16), cp.uint8)
            up = self._scratch[:b.nbytes]
            up.set(np.asarray(b))
            b = up
        if a is not dst:
            dst[...] = a
        reduce_into(dst.view(self.dtype), b.view(self.dtype), self.op)
        cp.cuda.get_current_stream().synchronize()


def _gpu_divide(dtype):
    def divide(work, nranks):
        finalize_avg(work.view(dtype), nranks)
    return divide


def _gpu_prescale(cp, dtype):
    """The first step of a floating-point avg: the host's pyrdma.avg.scale_down, run by CuPy (the same
    operations, so the same bits)."""
    from pyrdma.avg import scale_down

    def prescale(work, nranks):
        scale_down(cp, work.view(dtype), nranks)
    return prescale


class DirectArea:
    """A CUDA array as the work area of a direct collective (gloo's workspace parameter), with what
    the host's work areas have: the memory (``bytes``, flat CuPy uint8), its elements (``count``,
    ``itemsize``, ``code``), the steps of op="avg" over ``nranks`` (``before(work)``: floating
    point scaled by 1/n; ``after(work)``: integers divided by n), and the reduction as a CUDA
    kernel (``reduce``); then how the transport registers it for RDMA (``register``) and makes
    sure the stream's writes are done before the NIC reads it (``sync``). The Communicator runs
    its one algorithm path on it inside ``with area:`` (the stream); nothing here calls into the
    Communicator."""

    def __init__(self, cp, obj, buf, dtype, op, stream, nranks=1):
        from pyrdma import _reduce
        self.cp, self.result = cp, obj
        self.bytes = _cupy_view(cp, obj, buf, np.dtype(np.uint8))
        self.itemsize = dtype.itemsize
        self.count = buf.nbytes // dtype.itemsize
        self.code = _reduce.dtype_code(dtype)     # the same dtype check (and message) as the host path
        self.reduce = GpuReducer(cp, dtype, op) if op is not None else None
        floating = dtype.kind == "f"
        self._before = _gpu_prescale(cp, dtype) if op == "avg" and floating else None
        self._after = _gpu_divide(dtype) if op == "avg" and not floating else None
        self.nranks = nranks
        self._stream = _on(cp, stream)

    def before(self, work):
        if self._before is not None:
            self._before(work, self.nranks)

    def after(self, work):
        if self._after is not None:
            self._after(work, self.nranks)

    def __enter__(self):
        self._stream.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            if exc[0] is None:
                self.cp.cuda.get_current_stream().synchronize()   # received chunks were copied up in order
        finally:
            self._stream.__exit__(*exc)

    def register(self, pd, whole):
        """(MemoryRegion, offset of ``whole`` in it): a dma-buf registration covers whole pages."""
        from pyrdma.cuda.registration import gpu_array_offset, register_gpu_array
        mr = register_gpu_array(pd, whole, 0)       # local read: only sent from
        return mr, gpu_array_offset(mr, whole)

    def sync(self):
        self.cp.cuda.get_current_stream().synchronize()


def direct_allreduce_area(buf, out=None, op="sum", dtype=None, stream=None, nranks=1):
    """The DirectArea of ``comm.allreduce`` of a CUDA array over ``nranks`` ranks in place on GPU
    memory (gpu_path "direct"), ``out`` already holding a copy of ``buf``; None for bfloat16, which
    the GPU kernels lack (it goes the staged way)."""
    check_pair(buf, out, "allreduce")
    cp = import_cupy("allreduce of a CUDA array")
    sbuf, sdtype, twin = _describe(buf, "buf")
    if twin is not None:
        return None
    if dtype is not None and np.dtype(dtype) != sdtype:
        raise UsageError(f"dtype={dtype!r} does not match the array's {sdtype}")
    result = buf if out is None else out
    area = DirectArea(cp, result, device_buffer(result), sdtype, op, stream, nranks)
    if out is not None:
        with area:
            _copy_into(cp, out, buf, "allreduce")
    return area


def direct_broadcast_area(buf, is_root, stream=None):
    """The DirectArea of ``comm.broadcast`` of a CUDA array sent from and received into GPU memory."""
    cp = import_cupy("broadcast of a CUDA array")
    sbuf, _, _ = _describe(buf, "buf")
    if sbuf.readonly and not is_root:
        raise UsageError("buf is read-only; on a rank other than root it receives the data")
    area = DirectArea(cp, buf, sbuf, np.dtype(np.uint8), None, stream)
    area.dtype_name = sbuf.dtype_name
    return area


def host_dtype(dtype, twin):
    if dtype is not None and twin is not None and str(dtype) != twin:
        raise UsageError(f"dtype={dtype!r} does not match the array's {twin}")
    return dtype if dtype is not None else twin


class _on:
    """``with cp.cuda.Stream``-like context for an optional stream (None: the current one)."""

    def __init__(self, cp, stream):
        from pyrdma.cuda.reduce import as_stream
        self._stream = as_stream(cp, stream)

    def __enter__(self):
        self._stream.__enter__()
        return self._stream

    def __exit__(self, *exc):
        return self._stream.__exit__(*exc)


def _pinned(cp, count, dtype):
    mem = cp.cuda.alloc_pinned_memory(max(1, count * dtype.itemsize))
    return np.frombuffer(mem, dtype, count)


def _upload(cp, dst, host):
    dst.set(host)
    # the pinned array is dropped when we return: the copy out of it must be over by then
    cp.cuda.get_current_stream().synchronize()


def _pinned_copy(cp, arr):
    host = _pinned(cp, arr.size, arr.dtype)
    arr.get(out=host)     # waits for the stream, then for the copy
    return host
