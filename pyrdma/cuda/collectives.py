"""Collectives on CUDA arrays (CuPy, or any __cuda_array_interface__/DLPack CUDA object).

A host Communicator hands CUDA arrays here (``Communicator.allreduce(cupy_array)`` and the others),
on one of two paths (the Communicator's ``gpu_path``):

direct (allreduce, broadcast): the algorithms run in place in the array's GPU memory. The transport
sends from it (over RDMA the NIC reads it through a GPUDirect registration; over TCP each message is
copied out), received chunks are copied up and reduced by reduce_into's CUDA kernels (GpuReducer).

staged (every collective; the only path without GPUDirect RDMA): the data crosses the host:

- allreduce, reduce and broadcast keep their shape, so they run through HostStagingPipeline: chunk k
  is copied device -> pinned host, the host collective runs on it, and it is copied back, while the
  copies of chunks k-1 and k+1 are in flight. The pinned slots are reused across calls, so the host
  collective registers them for RDMA once.
- allgather and reduce_scatter change the size, so they copy the whole input to pinned host memory,
  run the host collective and copy the result up (not pipelined).

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
from pyrdma.cuda.staging import default_pipeline, staged_allreduce


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


def _staged(comm, array, host_op, stream, pipeline):
    return (pipeline or default_pipeline()).run(array, host_op, stream)


def allreduce(comm, buf, out=None, op="sum", algorithm="auto", dtype=None, stream=None, pipeline=None):
    """``comm.allreduce`` of a CUDA array, in place or into CUDA ``out``. Returns the result array."""
    check_pair(buf, out, "allreduce")
    cp = import_cupy("allreduce of a CUDA array")
    _, _, twin = _describe(buf, "buf")
    dtype = host_dtype(dtype, twin)
    result = buf if out is None else out
    with _on(cp, stream):
        if out is not None:
            _copy_into(cp, out, buf, "allreduce")
        return staged_allreduce(comm, result, op, stream, pipeline, algorithm=algorithm, dtype=dtype)


def reduce(comm, buf, out=None, op="sum", root=0, algorithm="auto", dtype=None, stream=None, pipeline=None):
    """``comm.reduce`` of a CUDA array: the result on root (in place or in ``out``), None elsewhere."""
    check_pair(buf, out, "reduce")
    cp = import_cupy("reduce of a CUDA array")
    _, _, twin = _describe(buf, "buf")
    dtype = host_dtype(dtype, twin)
    is_root = comm.rank == root
    result = buf if out is None or not is_root else out
    with _on(cp, stream):
        if result is not buf:
            _copy_into(cp, out, buf, "reduce")
        # off root the host reduce leaves each chunk as it was, so copying it back changes nothing
        _staged(comm, result, lambda c: comm.reduce(c, op=op, root=root, algorithm=algorithm, dtype=dtype),
                stream, pipeline)
    return result if is_root else None


def broadcast(comm, buf, root=0, algorithm="auto", stream=None, pipeline=None):
    """``comm.broadcast`` of a CUDA array (root's contents into every rank's ``buf``). Returns buf."""
    cp = import_cupy("broadcast of a CUDA array")
    _describe(buf, "buf")
    with _on(cp, stream):
        return _staged(comm, buf, lambda c: comm.broadcast(c, root=root, algorithm=algorithm), stream, pipeline)


def allgather(comm, buf, out=None, stream=None):
    """``comm.allgather`` of a CUDA array into CUDA ``out`` (default: a new CuPy array of
    size x buf's first dimension, like the host version). Returns out."""
    check_pair(buf, out, "allgather")
    cp = import_cupy("allgather of a CUDA array")
    sbuf, dtype, _ = _describe(buf, "buf")
    with _on(cp, stream):
        src = _cupy_view(cp, buf, sbuf, dtype)
        if out is None:
            shape = (comm.size * sbuf.shape[0],) + tuple(sbuf.shape[1:]) if sbuf.shape else (comm.size,)
            if sbuf.dtype is None:
                raise UsageError(f"allgather of a {sbuf.dtype_name} CUDA array needs out=")
            out = cp.empty(shape, dtype)
        obuf, odtype, _ = _describe(out, "out")
        if odtype != dtype or obuf.nbytes != sbuf.nbytes * comm.size or obuf.readonly:
            raise UsageError(f"out must be a writable CUDA array of {comm.size} x {sbuf.nbytes} bytes of "
                             f"{sbuf.dtype_name}; it has {obuf.nbytes} bytes of {obuf.dtype_name}")
        host_in = _pinned_copy(cp, src)
        host_out = _pinned(cp, obuf.nbytes // dtype.itemsize, dtype)
        comm.allgather(host_in, out=host_out)
        _upload(cp, _cupy_view(cp, out, obuf, odtype), host_out)
    return out


def reduce_scatter(comm, buf, out=None, op="sum", dtype=None, stream=None):
    """``comm.reduce_scatter`` of a CUDA array: this rank's segment (segment_bounds) into CUDA ``out``
    (default a new 1-D CuPy array). Returns out."""
    check_pair(buf, out, "reduce_scatter")
    cp = import_cupy("reduce_scatter of a CUDA array")
    sbuf, sdtype, twin = _describe(buf, "buf")
    dtype = host_dtype(dtype, twin)
    with _on(cp, stream):
        host_in = _pinned_copy(cp, _cupy_view(cp, buf, sbuf, sdtype))
        start, stop = comm.segment_bounds(host_in.size)[comm.rank]
        mine = stop - start
        if out is None:
            if sbuf.dtype is None:
                raise UsageError(f"reduce_scatter of a {sbuf.dtype_name} CUDA array needs out=")
            out = cp.empty(mine, sdtype)
        # with fewer elements than ranks some segments are empty: those ranks take part all the same
        obuf, odtype, _ = _describe(out, "out", allow_empty=True)
        if odtype != sdtype or obuf.nbytes != mine * sdtype.itemsize or obuf.readonly:
            raise UsageError(f"out must be a writable CUDA array of this rank's {mine} elements of "
                             f"{sbuf.dtype_name}; it has {obuf.nbytes} bytes of {obuf.dtype_name}")
        host_out = _pinned(cp, mine, sdtype)
        comm.reduce_scatter(host_in, out=host_out, op=op, dtype=dtype)
        if mine:
            _upload(cp, _cupy_view(cp, out, obuf, odtype), host_out)
    return out


def staged_call(host_call, name, *args, stream=None):
    """A call (``name``: gather, scatter, alltoall, a point-to-point one) on CUDA arrays, staged:
    each CUDA array among ``args`` (or in a tuple of them) is copied to pinned host memory,
    ``host_call(*host_args)`` runs on the copies, and the copies the call wrote (its outputs) are
    uploaded back. A new result array comes back as a CuPy array. Returns what the host call
    returns."""
    host_args, finish, _ = stage(name, args, stream)
    return finish(host_call(*host_args))


def stage(name, args, stream=None):
    """The first half of staged_call, for a call that finishes later (a non-blocking one): the
    CUDA arrays among ``args`` copied to pinned host memory now, on ``stream`` (default: the
    current one), in stream order. Returns (host_args, finish, reduced_as): ``finish(result)``,
    called on any thread once the host call has run, uploads what it wrote and synchronises, and
    returns the result as staged_call does; ``reduced_as`` is "bfloat16" when a bfloat16 array was
    staged (its copy holds the bits as uint16, so a reduction must be told), else None."""
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
    """The first step of a floating-point avg: the host's pieces.scale_down, run by CuPy (the same
    operations, so the same bits)."""
    from pyrdma.collectives.pieces import scale_down

    def prescale(work, nranks):
        scale_down(cp, work.view(dtype), nranks)
    return prescale


class DirectArea:
    """A CUDA array as the work area of a direct collective (gloo's workspace parameter): the
    memory (``work``, flat CuPy uint8), its elements (``count``, ``itemsize``, ``code``), the
    reductions as CUDA kernels (``reduce``, ``divide``, ``prescale``), how the transport registers
    it for RDMA (``register``) and makes sure the stream's writes are done before the NIC reads it
    (``sync``). The Communicator runs its one algorithm path on it inside ``with area:`` (the
    stream); nothing here calls into the Communicator."""

    def __init__(self, cp, obj, buf, dtype, op, stream):
        from pyrdma import _reduce
        self.cp, self.result = cp, obj
        self.work = _cupy_view(cp, obj, buf, np.dtype(np.uint8))
        self.itemsize = dtype.itemsize
        self.count = buf.nbytes // dtype.itemsize
        self.code = _reduce.dtype_code(dtype)     # the same dtype check (and message) as the host path
        self.reduce = GpuReducer(cp, dtype, op) if op is not None else None
        self.divide = _gpu_divide(dtype)
        self.prescale = _gpu_prescale(cp, dtype) if dtype.kind == "f" else None
        self._stream = _on(cp, stream)

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


def direct_allreduce_area(buf, out=None, op="sum", dtype=None, stream=None):
    """The DirectArea of ``comm.allreduce`` of a CUDA array in place on GPU memory (gpu_path
    "direct"), ``out`` already holding a copy of ``buf``; None for bfloat16, which the GPU kernels
    lack (it goes the staged way)."""
    check_pair(buf, out, "allreduce")
    cp = import_cupy("allreduce of a CUDA array")
    sbuf, sdtype, twin = _describe(buf, "buf")
    if twin is not None:
        return None
    if dtype is not None and np.dtype(dtype) != sdtype:
        raise UsageError(f"dtype={dtype!r} does not match the array's {sdtype}")
    result = buf if out is None else out
    area = DirectArea(cp, result, device_buffer(result), sdtype, op, stream)
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
