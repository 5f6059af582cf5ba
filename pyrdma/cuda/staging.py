"""Host staging for collectives on GPU arrays when GPUDirect RDMA is not available.

``HostStagingPipeline.run(array, host_op)`` cuts the GPU array into chunks and pipelines, per chunk,

    device -> pinned host copy (copy stream A)  ->  host_op(chunk) on the CPU  ->  host -> device copy (stream B)

with ``depth`` pinned slots in flight, so the copy of chunk i+1 in and of chunk i-1 out overlap the
host-side collective on chunk i. ``host_op`` takes the chunk as a numpy array (a view of a pinned
slot) and either changes it in place (returns None or the same array) or returns an array of the same
shape whose values are copied back. Every rank must use the same chunk size, so that the host
collectives of all ranks see the same chunks in the same order.

Ordering against the caller's stream: the first copy waits for work already enqueued on ``stream``
(the producer of the data; or for ``ready``, an event the caller recorded there earlier, when the
run happens later on another thread) and ``stream`` waits for the last copy back, so the result is
stream-ordered like a CUDA library call; the host thread itself returns once the last host_op ran.
A run may skip the copies down (``download=False``: host_op overwrites every chunk, as a broadcast's
receiver) or up (``upload=False``: the result is not needed here, as a reduce off its root).
"""
import os
import threading

import numpy as np

from pyrdma.errors import RDMAError, UsageError
from pyrdma.cuda._driver import cuda_driver, import_cupy
from pyrdma.cuda.buffers import BIT_TWINS, device_buffer

DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_DEPTH = 3


def chunk_spans(nbytes, chunk_bytes, itemsize=1):
    """[(offset, length)] cutting ``nbytes`` into chunks of at most ``chunk_bytes`` whole items."""
    if itemsize <= 0:
        raise UsageError(f"itemsize must be positive, got {itemsize}")
    if nbytes % itemsize:
        raise UsageError(f"{nbytes} bytes is not a whole number of {itemsize}-byte items")
    chunk = chunk_bytes - chunk_bytes % itemsize
    if chunk <= 0:
        raise UsageError(f"chunk_bytes {chunk_bytes} is smaller than one {itemsize}-byte item")
    return [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]


class _StreamsAndEvents:
    """The stream and event calls of a staging backend whose streams and events have CuPy's (and
    torch's, which are alike) methods."""

    def record(self, event, stream):
        event.record(stream)

    def wait(self, stream, event):
        stream.wait_event(event)

    def synchronize(self, event):
        event.synchronize()

    def synchronize_stream(self, stream):
        stream.synchronize()


class CupyStagingBackend(_StreamsAndEvents):
    """The CUDA side of the pipeline, through CuPy: streams, events, async copies, pinned memory.

    Host slots are numpy views of pinned (cudaHostAlloc) memory: stable addresses a host collective
    can register for RDMA once.
    """

    def __init__(self, cp=None):
        self.cp = cp or import_cupy("pyrdma.cuda.HostStagingPipeline")
        self.rt = self.cp.cuda.runtime

    def device_of(self, ptr):
        return int(self.rt.pointerGetAttributes(ptr).device)

    def device(self, device_id):
        return self.cp.cuda.Device(device_id)

    def user_stream(self, stream):
        from pyrdma.cuda.reduce import as_stream
        return as_stream(self.cp, stream)

    def new_stream(self):
        return self.cp.cuda.Stream(non_blocking=True)

    def new_event(self):
        return self.cp.cuda.Event(block=False, disable_timing=True)

    def alloc_host(self, nbytes):
        # cudaHostAlloc'd (page-aligned) through CuPy's pinned pool; the array keeps the memory alive
        # and gives it back to the pool when it goes, so nothing leaks if close() is never called
        mem = self.cp.cuda.alloc_pinned_memory(nbytes)
        return np.ndarray((nbytes,), np.uint8, buffer=mem)

    def free_host(self, host):
        pass

    def copy_d2h(self, host, dev_ptr, nbytes, stream):
        self.rt.memcpyAsync(host.ctypes.data, dev_ptr, nbytes, self.rt.memcpyDeviceToHost, stream.ptr)

    def copy_h2d(self, dev_ptr, host, nbytes, stream):
        self.rt.memcpyAsync(dev_ptr, host.ctypes.data, nbytes, self.rt.memcpyHostToDevice, stream.ptr)

    def copy_d2d(self, dst_ptr, src_ptr, nbytes, stream):
        self.rt.memcpyAsync(dst_ptr, src_ptr, nbytes, self.rt.memcpyDeviceToDevice, stream.ptr)

    def device_array(self, host, device_id):
        """A new CuPy array on GPU ``device_id`` holding ``host``'s values."""
        with self.cp.cuda.Device(device_id):
            return self.cp.asarray(host)


class _DeviceBytes:
    """``nbytes`` of GPU memory at ``ptr``, exported by __cuda_array_interface__ (for torch.as_tensor)."""

    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class TorchStagingBackend(_StreamsAndEvents):
    """The CUDA side of the pipeline through PyTorch, for torch users without CuPy: torch's streams,
    events and pinned memory, copies as tensors over the raw addresses (no CuPy anywhere)."""

    def __init__(self):
        try:
            import torch
        except ImportError:
            torch = None
        if torch is None or not torch.cuda.is_available():
            raise RDMAError("staging CUDA arrays through host memory needs CuPy (e.g. `pip install "
                            "cupy-cuda12x`, pyrdma[cuda]) or PyTorch with CUDA; neither is usable here",
                            call="import cupy")
        self.torch = torch

    def device_of(self, ptr):
        return cuda_driver().pointer_info(ptr).device_ordinal

    def device(self, device_id):
        return self.torch.cuda.device(device_id)

    def user_stream(self, stream):
        cuda = self.torch.cuda
        if stream is None:
            return cuda.current_stream()
        if isinstance(stream, cuda.Stream):
            return stream
        if hasattr(stream, "__cuda_stream__"):
            handle = stream.__cuda_stream__()
            handle = handle[1] if isinstance(handle, tuple) else handle
        else:
            handle = getattr(stream, "cuda_stream", getattr(stream, "ptr", stream))
        if not isinstance(handle, int) or isinstance(handle, bool):
            raise UsageError(f"cannot use {type(stream).__name__} as a CUDA stream; pass a torch.cuda.Stream, "
                             f"an object with __cuda_stream__, or a cudaStream_t handle")
        return cuda.ExternalStream(handle)

    def new_stream(self):
        return self.torch.cuda.Stream()

    def new_event(self):
        return self.torch.cuda.Event()

    def alloc_host(self, nbytes):
        # the numpy view keeps the pinned tensor (and so its memory) alive
        return self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=True).numpy()

    def free_host(self, host):
        pass

    def _on_device(self, ptr, nbytes):
        return self.torch.as_tensor(_DeviceBytes(ptr, nbytes))

    def _copy(self, dst, src, stream):
        with self.torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def copy_d2h(self, host, dev_ptr, nbytes, stream):
        self._copy(self.torch.from_numpy(host[:nbytes]), self._on_device(dev_ptr, nbytes), stream)

    def copy_h2d(self, dev_ptr, host, nbytes, stream):
        self._copy(self._on_device(dev_ptr, nbytes), self.torch.from_numpy(host[:nbytes]), stream)

    def copy_d2d(self, dst_ptr, src_ptr, nbytes, stream):
        self._copy(self._on_device(dst_ptr, nbytes), self._on_device(src_ptr, nbytes), stream)

    def device_array(self, host, device_id):
        """A new torch tensor on GPU ``device_id`` holding ``host``'s values."""
        return self.torch.from_numpy(np.ascontiguousarray(host)).to(f"cuda:{device_id}")


STAGING_BACKENDS = ("cupy", "torch")


def staging_backend():
    """The CUDA side of host staging: CuPy's where CuPy imports, else PyTorch's (a torch user needs
    no CuPy). PYRDMA_STAGING=cupy or =torch asks for one."""
    choice = os.environ.get("PYRDMA_STAGING", "").strip().lower()
    if choice and choice not in STAGING_BACKENDS:
        raise UsageError(f"PYRDMA_STAGING={choice!r}; use one of {', '.join(STAGING_BACKENDS)}")
    if choice != "torch":
        try:
            return CupyStagingBackend()
        except RDMAError:
            if choice == "cupy":
                raise
    return TorchStagingBackend()


class _DeviceResources:
    """Per-GPU streams, events and pinned slots (streams and events belong to one device)."""

    def __init__(self, backend, depth, slot_bytes):
        self.d2h = backend.new_stream()
        self.h2d = backend.new_stream()
        self.start = backend.new_event()
        self.done = backend.new_event()
        self.filled = [backend.new_event() for _ in range(depth)]    # D2H into slot k finished
        self.drained = [backend.new_event() for _ in range(depth)]   # H2D out of slot k finished
        self.slots = []
        try:
            for _ in range(depth):
                self.slots.append(backend.alloc_host(slot_bytes))
        except BaseException:
            self.free(backend)
            raise

    def free(self, backend):
        for slot in self.slots:
            backend.free_host(slot)
        self.slots = []


class HostStagingPipeline:
    """Chunked, overlapped GPU <-> pinned-host staging around a host-side operation.

    ``chunk_bytes`` per chunk (rounded down to whole items), ``depth`` pinned slots in flight
    (``depth`` x ``chunk_bytes`` of pinned memory per GPU, allocated on first use and reused).
    ``backend`` defaults to staging_backend(): CuPy's, else PyTorch's. One run at a time per pipeline (a lock serialises callers).
    """

    def __init__(self, chunk_bytes=DEFAULT_CHUNK_BYTES, depth=DEFAULT_DEPTH, backend=None):
        if chunk_bytes <= 0:
            raise UsageError(f"chunk_bytes must be positive, got {chunk_bytes}")
        if depth < 1:
            raise UsageError(f"depth must be at least 1, got {depth}")
        self.chunk_bytes = int(chunk_bytes)
        self.depth = int(depth)
        self._backend = backend
        self._resources = {}
        self._lock = threading.Lock()
        self._closed = False

    @property
    def backend(self):
        if self._backend is None:
            self._backend = staging_backend()
        return self._backend

    def host_slots(self, device_id=None):
        """The pinned slots used for GPU ``device_id`` (stable across runs; empty before the first run)."""
        res = self._resources.get(device_id)
        return list(res.slots) if res else []

    def run(self, array, host_op, stream=None, ready=None, download=True, upload=True, wait=False):
        """Stage ``array`` (a contiguous CUDA array) through the host chunk by chunk, applying host_op.

        The array is updated in place with what host_op leaves in (or returns for) each chunk.
        Returns ``array``. If host_op raises, the copies in flight are drained first and the array is
        left partly updated. ``ready``: an event recorded on ``stream`` when the data was handed over
        (default: recorded now); ``download``/``upload``: see the module's docstring; ``wait``: return
        once the last copy up is done, not only ordered before the stream's later work.
        """
        buf, dtype, spans, device_id = self._layout(array)
        if upload and buf.readonly:
            raise UsageError("the GPU array is read-only; host staging writes the result back into it")
        backend = self.backend
        with self._lock, backend.device(device_id):
            res = self._device_resources(backend, device_id)
            self._run(backend, res, buf, dtype, spans, host_op, backend.user_stream(stream), ready, download,
                      upload)
            if wait:
                backend.synchronize(res.done)
        return array

    def chunks(self, array):
        """The chunks a run of ``array`` hands host_op, in order: views of the pinned slots (allocated
        now if need be), so that a caller can plan its host work on them before the run."""
        buf, dtype, spans, device_id = self._layout(array)
        backend = self.backend
        with self._lock, backend.device(device_id):
            slots = self._device_resources(backend, device_id).slots
        return [slots[i % len(slots)][:length].view(dtype) for i, (_, length) in enumerate(spans)]

    def _layout(self, array):
        """(DeviceBuffer, numpy dtype of the chunks, chunk spans, GPU) of a run of ``array``."""
        if self._closed:
            raise UsageError("HostStagingPipeline is closed")
        buf = device_buffer(array)
        dtype = buf.dtype if buf.dtype is not None else BIT_TWINS.get(buf.dtype_name)
        if dtype is None:
            raise UsageError(f"host staging needs a dtype numpy knows; {buf.dtype_name} is not one")
        spans = chunk_spans(buf.nbytes, self.chunk_bytes, buf.itemsize)
        device_id = buf.device_id if buf.device_id is not None else self.backend.device_of(buf.ptr)
        return buf, dtype, spans, device_id

    def _device_resources(self, backend, device_id):
        res = self._resources.get(device_id)
        if res is None:
            res = self._resources[device_id] = _DeviceResources(backend, self.depth, self.chunk_bytes)
        return res

    def copy_streams(self, device_id):
        """(device-to-host, host-to-device) streams of GPU ``device_id``, for staging copies outside a
        run (pyrdma.cuda.collectives.StagedCall); the run's own copies go on them too."""
        backend = self.backend
        with self._lock, backend.device(device_id):
            res = self._device_resources(backend, device_id)
            return res.d2h, res.h2d

    def _run(self, backend, res, buf, dtype, spans, host_op, user, ready, download, upload):
        """host_op sees each chunk as ``dtype`` (bfloat16 as its uint16 bits)."""
        depth = len(res.slots)
        ptr = buf.ptr

        def issue_d2h(i):
            slot = i % depth
            off, length = spans[i]
            # the slot's previous chunk must have been copied back to the GPU before it is overwritten
            backend.wait(res.d2h, res.drained[slot])
            if download:
                backend.copy_d2h(res.slots[slot][:length], ptr + off, length, res.d2h)
            backend.record(res.filled[slot], res.d2h)

        # the data may still be being produced on the caller's stream
        if ready is None:
            ready = res.start
            backend.record(ready, user)
        backend.wait(res.d2h, ready)
        try:
            for i in range(min(depth, len(spans))):
                issue_d2h(i)
            for i, (off, length) in enumerate(spans):
                slot = i % depth
                backend.synchronize(res.filled[slot])
                chunk = res.slots[slot][:length].view(dtype)
                result = host_op(chunk)
                if result is not None and result is not chunk:
                    result = np.asarray(result)
                    if result.shape != chunk.shape:
                        raise UsageError(f"host_op returned shape {result.shape} for a chunk of shape "
                                         f"{chunk.shape}")
                    np.copyto(chunk, result, casting="same_kind")
                if upload:
                    backend.copy_h2d(ptr + off, res.slots[slot][:length], length, res.h2d)
                backend.record(res.drained[slot], res.h2d)
                if i + depth < len(spans):
                    issue_d2h(i + depth)
        except BaseException:
            # nothing may still be copying into or out of the pinned slots when we give up
            backend.synchronize_stream(res.d2h)
            backend.synchronize_stream(res.h2d)
            raise
        backend.record(res.done, res.h2d)
        backend.wait(user, res.done)

    def close(self):
        """Wait for copies in flight and release the pinned slots. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            for device_id, res in self._resources.items():
                with self.backend.device(device_id):
                    self.backend.synchronize_stream(res.d2h)
                    self.backend.synchronize_stream(res.h2d)
                    res.free(self.backend)
            self._resources.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_default_lock = threading.Lock()
_default_pipeline = None


def default_pipeline():
    """The process-wide pipeline staged_allreduce uses when none is given."""
    global _default_pipeline
    with _default_lock:
        if _default_pipeline is None or _default_pipeline._closed:
            _default_pipeline = HostStagingPipeline()
        return _default_pipeline


def staged_allreduce(comm, array, op="sum", stream=None, pipeline=None, **options):
    """Allreduce a CUDA array in place through host staging: ``comm.allreduce(chunk, op=op, **options)``
    per chunk (options: algorithm=, dtype=).

    ``comm`` is anything with an in-place host ``allreduce(ndarray, op=...)`` (the Communicator of
    pyrdma.collectives). All ranks must call it with arrays of the same size and the same pipeline
    chunk size. Returns ``array``.

    For a communicator of your own with a host allreduce (pyrdma's Communicator stages CUDA arrays
    itself, through pyrdma.cuda.collectives.staged, which takes the host call as an argument)::

        if pyrdma.cuda.is_cuda_array(buf):
            return pyrdma.cuda.staged_allreduce(self, buf, op)
    """
    pipeline = pipeline or default_pipeline()
    return pipeline.run(array, lambda chunk: comm.allreduce(chunk, op=op, **options), stream)
