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

A run is a list of pieces (``Piece``): the device byte ranges gathered into a slot before its host
op and those filled from the slot after it. In place (``chunk_pieces``: allreduce, reduce,
broadcast) a piece is one chunk, down and up alike. A blockwise collective (``block_pieces``:
allgather, reduce_scatter, all-to-all), whose source and result are blocks, one per rank or one of
its own, is cut into pieces that take the same sub-block of every block, so each piece is itself a
valid call of that collective on the slot (its input the source's sub-blocks end to end, its output
the result's, after the input in the slot). ``prepare`` lays the pieces out on the slots before the
run, so a caller can plan its host calls on them in advance.
"""
import os
import threading
from typing import NamedTuple

import numpy as np

from pyrdma.errors import RDMAError, UsageError
from pyrdma.cuda._driver import cuda_driver, import_cupy
from pyrdma.cuda.buffers import BIT_TWINS, device_buffer

DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_DEPTH = 3
_ALIGN = 64                 # a piece's output starts on a cache line of its slot


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


class Piece(NamedTuple):
    """One host op of a run: ``down``, the source's (offset, nbytes) ranges copied end to end into
    the slot's input, and ``up``, the result's ranges filled from the slot's output in order."""
    down: tuple
    up: tuple


def chunk_pieces(nbytes, chunk_bytes, itemsize=1):
    """The pieces of an in-place run: one chunk of ``chunk_spans`` each, down and up alike."""
    return [Piece((span,), (span,)) for span in chunk_spans(nbytes, chunk_bytes, itemsize)]


def block_pieces(src_bounds, dst_bounds, itemsize, chunk_bytes):
    """The pieces of a blockwise run: source and result are blocks (byte bounds), and piece i takes
    sub-block i of every block, cut at the same offsets in each (the last piece takes the rest of
    each block: a reduce_scatter's segments one item longer than the shortest end there, as the
    host's segment_bounds of that piece puts them). Sub-blocks are as long as lets a piece's input
    and output share a slot of ``chunk_bytes`` (one item at least); one piece when everything fits,
    or when a block is empty. Derived from the bounds alone, so ranks that agree on the call plan
    the same pieces."""
    src = [(a, b - a) for a, b in zip(src_bounds, src_bounds[1:])]
    dst = [(a, b - a) for a, b in zip(dst_bounds, dst_bounds[1:])]
    blocks = len(src) + len(dst)
    # room for the output's alignment and for the last piece's extra item per block
    sub = max(itemsize, ((chunk_bytes - _ALIGN) // blocks - itemsize) // itemsize * itemsize)
    cuts = [off for off, _ in chunk_spans(min(n for _, n in src + dst), sub, itemsize)] or [0]
    cuts.append(None)

    def take(blocks, lo, hi):
        return tuple((start + lo, (n if hi is None else hi) - lo) for start, n in blocks)
    return [Piece(take(src, lo, hi), take(dst, lo, hi)) for lo, hi in zip(cuts, cuts[1:])]


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

    def empty_device(self, shape, dtype, device_id):
        """A new CuPy array on GPU ``device_id``, uninitialised."""
        with self.cp.cuda.Device(device_id):
            return self.cp.empty(shape, dtype)


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

    def empty_device(self, shape, dtype, device_id):
        """A new torch tensor on GPU ``device_id``, uninitialised."""
        like = self.torch.from_numpy(np.empty(0, dtype)).dtype
        return self.torch.empty(shape, dtype=like, device=f"cuda:{device_id}")


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
        self.slot_bytes = slot_bytes
        self.slots = []
        try:
            for _ in range(depth):
                self.slots.append(backend.alloc_host(slot_bytes))
        except BaseException:
            self.free(backend)
            raise

    def fit(self, backend, nbytes):
        """Slots of at least ``nbytes`` (only a piece of a few items per block over a chunk size
        smaller than that needs more): a larger set replaces the list, the old slots kept alive by
        the runs prepared on them."""
        if nbytes > self.slot_bytes:
            self.slots = [backend.alloc_host(nbytes) for _ in self.slots]
            self.slot_bytes = nbytes

    def free(self, backend):
        for slot in self.slots:
            backend.free_host(slot)
        self.slots = []


def _output_start(piece, in_place):
    """Where a piece's output begins in its slot."""
    if in_place:
        return 0
    return -(-sum(n for _, n in piece.down) // _ALIGN) * _ALIGN


class PreparedRun:
    """A run of a HostStagingPipeline laid out on its pinned slots before it starts: ``views[i]``,
    (input, output) of piece i as numpy arrays of ``dtype`` in its slot (one array twice in place),
    on which the caller plans its host ops; ``run`` then moves the data through those very slots."""

    def __init__(self, pipeline, arrays, src_ptr, dst_ptr, pieces, dtype, device_id, slots, in_place):
        self.pipeline, self.pieces, self.device_id = pipeline, pieces, device_id
        self.src_ptr, self.dst_ptr, self.slots, self.in_place = src_ptr, dst_ptr, slots, in_place
        # the memory is copied from and to later, maybe after the caller let go of the arrays
        self.arrays = arrays
        self.views = []
        for i, piece in enumerate(pieces):
            slot, start = slots[i % len(slots)], _output_start(piece, in_place)
            inp = slot[:sum(n for _, n in piece.down)].view(dtype)
            out = inp if in_place else slot[start:start + sum(n for _, n in piece.up)].view(dtype)
            self.views.append((inp, out))

    def run(self, host_op, stream=None, ready=None, download=True, upload=True, wait=False):
        """``host_op(i)`` for each piece i once its input is in ``views[i][0]``, its output then
        copied up from ``views[i][1]``; ordered after ``stream`` (from ``ready``, an event recorded
        there, if given), which waits for the copies up. If host_op raises, the copies in flight are
        drained first and the result is left partly written. ``download``/``upload``: see the
        module's docstring; ``wait``: return once the last copy up is done, not only ordered before
        the stream's later work."""
        pipeline = self.pipeline
        backend = pipeline.backend
        with pipeline._lock, backend.device(self.device_id):
            if pipeline._closed:
                raise UsageError("HostStagingPipeline is closed")
            res = pipeline._device_resources(backend, self.device_id)
            self._run(backend, res, host_op, backend.user_stream(stream), ready, download, upload)
            if wait:
                backend.synchronize(res.done)

    def _run(self, backend, res, host_op, user, ready, download, upload):
        slots, pieces = self.slots, self.pieces
        depth = len(slots)

        def issue_d2h(i):
            slot = i % depth
            # the slot's previous piece must have been copied back to the GPU before it is overwritten
            backend.wait(res.d2h, res.drained[slot])
            if download:
                at = 0
                for off, length in pieces[i].down:
                    if length:
                        backend.copy_d2h(slots[slot][at:at + length], self.src_ptr + off, length, res.d2h)
                    at += length
            backend.record(res.filled[slot], res.d2h)

        # the data may still be being produced on the caller's stream
        if ready is None:
            ready = res.start
            backend.record(ready, user)
        backend.wait(res.d2h, ready)
        try:
            for i in range(min(depth, len(pieces))):
                issue_d2h(i)
            for i, piece in enumerate(pieces):
                slot = i % depth
                backend.synchronize(res.filled[slot])
                host_op(i)
                if upload:
                    at = _output_start(piece, self.in_place)
                    for off, length in piece.up:
                        if length:
                            backend.copy_h2d(self.dst_ptr + off, slots[slot][at:at + length], length, res.h2d)
                        at += length
                backend.record(res.drained[slot], res.h2d)
                if i + depth < len(pieces):
                    issue_d2h(i + depth)
        except BaseException:
            # nothing may still be copying into or out of the pinned slots when we give up
            backend.synchronize_stream(res.d2h)
            backend.synchronize_stream(res.h2d)
            raise
        backend.record(res.done, res.h2d)
        backend.wait(user, res.done)


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
        self._lock = threading.Lock()          # one run at a time
        # the streams, events and slots, taken briefly: preparing a call never waits for a run
        self._resources_lock = threading.Lock()
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

        host_op takes each chunk and changes it in place (returning None or the chunk) or returns
        an array of its shape whose values are copied back. Returns ``array``; the rest as
        PreparedRun.run.
        """
        if upload and device_buffer(array).readonly:
            raise UsageError("the GPU array is read-only; host staging writes the result back into it")
        prepared = self.prepare(array)

        def apply(i):
            chunk = prepared.views[i][0]
            result = host_op(chunk)
            if result is not None and result is not chunk:
                result = np.asarray(result)
                if result.shape != chunk.shape:
                    raise UsageError(f"host_op returned shape {result.shape} for a chunk of shape {chunk.shape}")
                np.copyto(chunk, result, casting="same_kind")
        prepared.run(apply, stream, ready, download, upload, wait)
        return array

    def chunks(self, array):
        """The chunks a run of ``array`` hands host_op, in order: views of the pinned slots."""
        return [inp for inp, _ in self.prepare(array).views]

    def prepare(self, array, out=None, bounds=None):
        """The PreparedRun of ``array`` in place (``out`` None), chunk by chunk, or, with ``out``
        and ``bounds`` (the byte bounds of the blocks of array and of out), blockwise from array
        into out (block_pieces). Both on one GPU; the pinned slots are allocated now if need be."""
        if self._closed:
            raise UsageError("HostStagingPipeline is closed")
        buf = device_buffer(array, allow_empty=out is not None)
        dtype = buf.dtype if buf.dtype is not None else BIT_TWINS.get(buf.dtype_name)
        if dtype is None:
            raise UsageError(f"host staging needs a dtype numpy knows; {buf.dtype_name} is not one")
        dst = buf if out is None else device_buffer(out, allow_empty=True)
        # (an empty array may have no address to ask the driver about)
        devices = [self._device_of(b) for b in (buf, dst) if b.nbytes] or [self._device_of(buf)]
        if len(set(devices)) > 1:
            raise UsageError(f"buf is on GPU {devices[0]} and out on GPU {devices[1]}; pass both on one GPU")
        device_id = devices[0]
        if out is None:
            pieces = chunk_pieces(buf.nbytes, self.chunk_bytes, buf.itemsize)
            need = max([n for p in pieces for _, n in p.down], default=0)
        else:
            pieces = block_pieces(bounds[0], bounds[1], buf.itemsize, self.chunk_bytes)
            need = max(_output_start(p, False) + sum(n for _, n in p.up) for p in pieces)
        backend = self.backend
        with backend.device(device_id):
            slots = self._device_resources(backend, device_id, need).slots
        return PreparedRun(self, (array, out), buf.ptr, dst.ptr, pieces, dtype, device_id, slots, out is None)

    def _device_of(self, buf):
        return buf.device_id if buf.device_id is not None else self.backend.device_of(buf.ptr)

    def _device_resources(self, backend, device_id, need=0):
        """The resources of GPU ``device_id``, with slots of at least ``need`` bytes."""
        with self._resources_lock:
            res = self._resources.get(device_id)
            if res is None:
                res = self._resources[device_id] = _DeviceResources(backend, self.depth, self.chunk_bytes)
            res.fit(backend, need)
            return res

    def copy_streams(self, device_id):
        """(device-to-host, host-to-device) streams of GPU ``device_id``, for staging copies outside a
        run (pyrdma.cuda.collectives.StagedCall); the run's own copies go on them too."""
        backend = self.backend
        with backend.device(device_id):
            res = self._device_resources(backend, device_id)
            return res.d2h, res.h2d

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
    """The process-wide pipeline staged_allreduce and the Communicator use when none is given:
    chunks of PYRDMA_STAGING_CHUNK bytes (default DEFAULT_CHUNK_BYTES; the same on every rank, which
    plans its pieces by it)."""
    global _default_pipeline
    with _default_lock:
        if _default_pipeline is None or _default_pipeline._closed:
            _default_pipeline = HostStagingPipeline(_env_chunk_bytes())
        return _default_pipeline


def _env_chunk_bytes():
    text = os.environ.get("PYRDMA_STAGING_CHUNK", "").strip()
    if not text:
        return DEFAULT_CHUNK_BYTES
    try:
        value = int(text, 0)
    except ValueError:
        value = 0
    if value <= 0:
        raise UsageError(f"PYRDMA_STAGING_CHUNK={text!r} is not a positive number of bytes")
    return value


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
