"""Collectives on CUDA arrays (CuPy, or any __cuda_array_interface__/DLPack CUDA object): the
work areas and staging the Communicator runs its own algorithms on (nothing here calls into it or
imports pyrdma.collectives; the host calls come in as arguments). Two paths (the Communicator's
``gpu_path``):

direct (allreduce, broadcast): the algorithms run in place in the array's GPU memory. The transport
sends from it (over RDMA the NIC reads it through a GPUDirect registration; over TCP each message is
copied out), received chunks are copied up and reduced by reduce_into's CUDA kernels (GpuReducer).

staged (every collective; the only path without GPUDirect RDMA): the data crosses the host:

- allreduce, reduce and broadcast (blocking or not) keep the array's shape, so they run through
  HostStagingPipeline (``StagedPipeline``): chunk k is copied device -> pinned host, the host collective
  runs on it, and it is copied back, while the copies of chunks k-1 and k+1 are in flight. The
  pinned slots are reused across calls, so the host collective registers them for RDMA once.
- allgather, reduce_scatter and all-to-all of equal counts (``StagedBlocks``) go piece by piece
  through the same pipeline and slots: piece i takes sub-block i of every rank's block of the input
  and of the output, and is itself a host call of the collective (HostStagingPipeline.prepare,
  staging.block_pieces), so piece i+1 comes down while piece i runs and piece i-1 goes up.
- every other call (``StagedCall``: gather, scatter, uneven all-to-all, point-to-point) copies the
  CUDA arrays it reads to pinned host memory, the host call runs on the copies, and the copies it
  writes are uploaded (not pipelined).

Either way the call only marks (an event) where the caller's stream stands: the copies run when the
call's turn comes, on the communicator's thread for a non-blocking call, so the caller never waits
for them.

Staged, the arithmetic is the host collective's (pyrdma._reduce); direct, the GPU kernels compute
what it computes (float16 in float32, rounded once; min/max pick an operand's bits; a floating-point
avg divides every input by n first). Either way the results are bit for bit those of the numpy
path. bfloat16 CUDA tensors (DLPack), which the GPU kernels lack, always stage: they travel as their
16-bit patterns and reduce as bfloat16.
Calls are ordered after the current CuPy stream (torch's current stream for torch tensors, or
``stream=``): they wait for work already enqueued there; once a call has returned (or its handle's
wait), the result is in the array.
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


def _copy_into(dst_obj, src_obj, what, copy):
    """dst = src on the GPU (same bytes, same dtype) by ``copy(dst, src)`` (DeviceBuffers), unless
    they are the same memory."""
    dbuf = device_buffer(dst_obj)
    sbuf = device_buffer(src_obj)
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
        copy(dbuf, sbuf)


def _cupy_copy(cp, dst_obj, src_obj):
    """A ``copy`` for _copy_into by CuPy, on its current stream."""
    def copy(dbuf, sbuf):
        _cupy_view(cp, dst_obj, dbuf, np.dtype(np.uint8))[...] = _cupy_view(cp, src_obj, sbuf, np.dtype(np.uint8))
    return copy


def producer_stream(stream, objs):
    """The stream a call on ``objs`` is ordered after: ``stream`` if given, else torch's current
    stream for a torch tensor (torch produced it there, and CuPy does not know torch's streams),
    else None (CuPy's current stream)."""
    if stream is not None:
        return stream
    for obj in objs:
        if obj is not None and type(obj).__module__.partition(".")[0] == "torch" and is_cuda_array(obj):
            import torch
            return torch.cuda.current_stream(obj.device)
    return None


def _device(backend, buf):
    return buf.device_id if buf.device_id is not None else backend.device_of(buf.ptr)


def _mark(backend, stream, device):
    """An event recorded now where ``stream`` (of GPU ``device``) stands."""
    with backend.device(device):
        event = backend.new_event()
        backend.record(event, backend.user_stream(stream))
    return event


def chunk_type(buf, dtype=None):
    """(numpy dtype of the elements of a CUDA array's host chunks, the host reduction dtype): a
    bfloat16 array's chunks hold its bits as uint16, reduced as "bfloat16". No CuPy needed."""
    _, element, bits_of = _describe(buf, "buf")
    return element, host_dtype(dtype, bits_of)


class StagedPipeline:
    """A collective that keeps the array's shape (allreduce, reduce, broadcast) of a CUDA array,
    through pinned host memory chunk by chunk (HostStagingPipeline). Made on the caller's thread:
    ``out``, if given, takes a copy of ``buf`` on the GPU, and an event marks where the caller's
    stream stands (``stream``, else torch's current stream for a torch tensor, else CuPy's);
    nothing waits. ``run(host_op)``, when the call's turn comes, on any thread (the
    communicator's), pipelines the chunks (``chunks()``, known in advance), ``host_op(chunk)``
    running the host collective in place on each, and returns the array holding the result once it is there. A chunk is a numpy array of
    ``element``s (bfloat16 as its uint16 bits), reduced as ``dtype`` (the host reduction dtype:
    "bfloat16" for a bfloat16 array). ``download=False``: the chunks are not copied down (the host
    collective overwrites every chunk, as on a broadcast's receivers); ``upload=False``: nor up
    (nothing is written here, as off a reduce's root, or on a broadcast's root)."""

    def __init__(self, what, buf, out, dtype=None, stream=None, pipeline=None, download=True, upload=True):
        check_pair(buf, out, what)
        self.element, self.dtype = chunk_type(buf, dtype)
        self._pipeline = pipeline or default_pipeline()
        backend = self._pipeline.backend
        sbuf = device_buffer(buf)
        self.result = buf if out is None else out
        if upload and device_buffer(self.result).readonly:
            raise UsageError(f"{what}: the GPU array is read-only; the result is written into it")
        self._stream = producer_stream(stream, (buf, out))
        device = _device(backend, sbuf)
        if self.result is not buf:
            def copy(dbuf, sbuf):
                with backend.device(device):
                    backend.copy_d2d(dbuf.ptr, sbuf.ptr, sbuf.nbytes, backend.user_stream(self._stream))
            _copy_into(out, buf, what, copy)
        self._ready = _mark(backend, self._stream, device)
        self._download, self._upload = download, upload
        self._prepared = self._pipeline.prepare(self.result)

    def chunks(self):
        """The host chunks ``run`` hands host_op, in order (views of the pipeline's pinned slots):
        the host calls are planned on them at the call, in its order among the others."""
        return [chunk for chunk, _ in self._prepared.views]

    def run(self, host_op):
        views = self._prepared.views
        # waits for the last copy up: the caller may go on from another stream, or another thread
        self._prepared.run(lambda i: host_op(views[i][0]), self._stream, self._ready, self._download,
                           self._upload, wait=True)
        return self.result


class StagedBlocks:
    """A blockwise collective (allgather, reduce_scatter, all-to-all of equal counts) of CUDA
    arrays, through pinned host memory piece by piece: ``bounds``, the byte bounds of the blocks of
    ``buf`` and of ``out`` (HostStagingPipeline.prepare), cut so that piece i, sub-block i of every
    block, is itself a call of the collective on host memory; its input comes down while the piece
    before runs on the host and the one before that goes up. Made on the caller's thread, as
    StagedPipeline: an event marks where the caller's stream stands, nothing waits; ``out`` None
    makes a new CUDA array of ``shape`` (and buf's element type) on buf's GPU. ``chunks()``: each
    piece's (input, output) host arrays, to plan the host calls on; ``run(host_op)``, when the call's
    turn comes: ``host_op(i)`` per piece, and returns the result once its last piece is up."""

    def __init__(self, what, buf, out, bounds, shape=None, stream=None, pipeline=None):
        check_pair(buf, out, what)
        pipeline = pipeline or default_pipeline()
        backend = pipeline.backend
        if out is None:
            sbuf, element, _ = _describe(buf, what, allow_empty=True)
            out = backend.empty_device(shape, element, _device(backend, sbuf))
        self.result = out
        self._stream = producer_stream(stream, (buf, out))
        self._prepared = pipeline.prepare(buf, out, bounds)
        self._ready = _mark(backend, self._stream, self._prepared.device_id)

    def chunks(self):
        return self._prepared.views

    def run(self, host_op):
        self._prepared.run(host_op, self._stream, self._ready, wait=True)
        return self.result


def _host_twin(obj, what, alloc):
    """(host array of ``obj``'s shape and element type, from ``alloc(nbytes)``, read-only where obj
    is, so that the host call refuses it as an output as it would the array; DeviceBuffer; bfloat16
    or None): what a host call on a CUDA array gets in its place."""
    buf, dtype, bits_of = _describe(obj, what, allow_empty=True)
    host = alloc(buf.nbytes)[:buf.nbytes].view(dtype) if buf.nbytes else np.empty(0, dtype)
    if buf.readonly:
        host.flags.writeable = False
    return (host.reshape(buf.shape) if buf.shape else host), buf, bits_of


def stand_ins(what, buf, out):
    """(buf's and out's host twins, "bfloat16" or None: how to reduce them) for the host call's
    checks of a call staged piece by piece, on the whole call: uninitialised and never touched, so
    they take no memory."""
    kinds, twins = set(), []
    for obj in (buf, out):
        if obj is None:
            twins.append(None)
            continue
        host, _, bits_of = _host_twin(obj, what, lambda n: np.empty(n, np.uint8))
        twins.append(host)
        kinds.add(bits_of)
    if len(kinds) > 1:
        raise UsageError(f"{what}: buf and out have different dtypes")
    return twins[0], twins[1], kinds.pop()


class StagedCall:
    """A call (any collective or point-to-point one) on CUDA arrays, staged whole through pinned
    host memory. Now, on the caller's thread: a pinned host twin for each CUDA array among ``args``
    (or in a tuple of them), and an event where the caller's stream stands (``stream``, else torch's
    current stream for torch tensors, else CuPy's); nothing waits. ``roles``, parallel to ``args``
    (a tuple for a tuple): "in" (the call reads the array: it is copied down), "out" (the call
    writes all of it: copied up), "inout", or "" (neither: the call only checks it). Then, on the
    thread that runs the call: ``download()`` copies the inputs down once the caller's stream has
    produced them, and ``upload(result)`` the outputs up, and returns the result as the caller sees
    it: a staged array's own CUDA array where the result is its twin, a new device array (CuPy's,
    or torch's where torch stages) where it is a new host array (of the bits, as uint16, for a
    bfloat16 call). ``host_args``: the args with
    the twins in place of the CUDA arrays; ``reduced_as``: "bfloat16" when a bfloat16 array was
    staged (its twin holds the bits as uint16, so a reduction must be told), else None."""

    def __init__(self, name, args, roles, stream=None, pipeline=None):
        self.pipeline = pipeline or default_pipeline()
        backend = self.backend = self.pipeline.backend
        self.staged = []        # (CUDA array, DeviceBuffer, the twin passed to the call, role, GPU)
        stream = producer_stream(stream, [x for a in args for x in (a if isinstance(a, tuple) else (a,))])
        twins = set()

        def twin(obj, role):
            if obj is None or isinstance(obj, np.ndarray) or not is_cuda_array(obj):
                return obj
            passed, buf, bits_of = _host_twin(obj, name, backend.alloc_host)
            if bits_of is not None:
                twins.add(bits_of)
            self.staged.append((obj, buf, passed, role, _device(backend, buf)))
            return passed
        self.host_args = [tuple(twin(x, rx) for x, rx in zip(a, r)) if isinstance(a, tuple) else twin(a, r)
                          for a, r in zip(args, roles)]
        if len(twins) > 1:
            raise UsageError(f"{name}: arrays of {' and '.join(sorted(twins))} in one call")
        self.reduced_as = twins.pop() if twins else None
        self._ready = {device: _mark(backend, stream, device) for *_, device in self.staged}

    def _copy(self, direction):
        """Copy the twins of the arrays whose role has ``direction`` ("in": down, "out": up), after
        the caller's stream reached the call, and wait for the copies."""
        backend, done = self.backend, []
        for obj, buf, host, role, device in self.staged:
            if direction not in role or not buf.nbytes:
                continue
            d2h, h2d = self.pipeline.copy_streams(device)
            with backend.device(device):
                backend.wait(d2h if direction == "in" else h2d, self._ready[device])
                if direction == "in":
                    backend.copy_d2h(host.reshape(-1).view(np.uint8), buf.ptr, buf.nbytes, d2h)
                else:
                    backend.copy_h2d(buf.ptr, host.reshape(-1).view(np.uint8), buf.nbytes, h2d)
                event = backend.new_event()
                backend.record(event, d2h if direction == "in" else h2d)
                done.append(event)
        for event in done:
            backend.synchronize(event)

    def download(self):
        self._copy("in")

    def upload(self, result):
        self._copy("out")
        for obj, _, host, _, _ in self.staged:
            if result is host:
                return obj
        if isinstance(result, np.ndarray):
            return self.backend.device_array(result, self.staged[0][4])
        return result


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
    point scaled by 1/n; ``after(work)``: integers divided by n); and the device kind of work-area
    memory (pyrdma.collectives.work.HostMemory's protocol): received chunks go through Python
    (``consumes``), reduced by a CUDA kernel (``reduce``), stored and read by copies to and from
    the host (``write``, ``read``); the transport registers it for RDMA (``register``) and makes
    sure the stream's writes are done before the NIC reads it (``sync``). The Communicator runs
    its one algorithm path on it inside ``with area:`` (the stream); nothing here calls into the
    Communicator."""

    consumes = True

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

    @staticmethod
    def address(view):
        return view.data.ptr

    @staticmethod
    def access(view):
        return 0        # local read: only sent from (received chunks land in the transport's slots)

    @staticmethod
    def register(pd, whole, access=0):
        """(MemoryRegion, offset of ``whole`` in it): a dma-buf registration covers whole pages."""
        from pyrdma.cuda.registration import gpu_array_offset, register_gpu_array
        mr = register_gpu_array(pd, whole, access)
        return mr, gpu_array_offset(mr, whole)

    def sync(self):
        self.cp.cuda.get_current_stream().synchronize()

    @staticmethod
    def read(view):
        return view.get()           # copied out in stream order

    @staticmethod
    def write(view, data):
        if isinstance(data, np.ndarray):
            view.set(data)          # a host chunk is copied up
        else:
            view[...] = data


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
            _copy_into(out, buf, "allreduce", _cupy_copy(cp, out, buf))
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


