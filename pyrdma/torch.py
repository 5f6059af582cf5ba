"""A torch.distributed backend named "pyrdma": PyTorch's collectives and point-to-point calls (and so
DDP, FSDP2, pipelining, tensor parallel, all-to-all) over pyrdma's Communicator, on RDMA when every
rank has a device, else on TCP.

    import pyrdma.torch                      # registers the backend
    torch.distributed.init_process_group("pyrdma")
    model = torch.nn.parallel.DistributedDataParallel(model)

It bootstraps through the c10d Store that torch hands every backend (torchrun's rendezvous: no
port of its own) and honours init_process_group's ``timeout``. Device, port and GID follow
PYRDMA_IB_HCA, PYRDMA_IB_PORT and PYRDMA_IB_GID_INDEX (as NCCL_IB_HCA, NCCL_IB_GID_INDEX);
PYRDMA_TRANSPORT ("auto", "rdma", "tcp") picks the transport; PYRDMA_TCP_HOST the address the TCP
transport listens on (default: the address that reaches MASTER_ADDR).

Collectives run on the Communicator's own thread, so every call returns at once with a Work
whose future completes when the collective has; DDP's buckets overlap the backward pass that way.
Sends and receives wait for the next other call (or a wait on one of them) and then go together as
one Communicator.batch.
Contiguous tensors are used in place: CPU ones as numpy arrays, CUDA ones through the
Communicator's GPU paths (staged through pinned host memory after torch's current stream, by CuPy,
or by torch's own streams and pinned memory without CuPy). Non-contiguous ones go through a
contiguous copy that is written back when the collective completes.
"""
import collections
import math
import os
import threading
import time

import numpy as np

try:
    import torch
    import torch.distributed as dist
    from torch._C import _distributed_c10d as _c10d
except ImportError as _exc:
    raise ImportError(f"pyrdma.torch needs PyTorch with torch.distributed (pip install 'pyrdma[torch]'): "
                      f"{_exc}") from _exc

from pyrdma.collectives.bootstrap import StoreExchange, advertise_host  # noqa: F401 - advertise_host: this module's name too
from pyrdma.collectives.communicator import Communicator, TRANSPORTS
from pyrdma.collectives.executor import Done
from pyrdma.errors import PeerError, UsageError

BACKEND = "pyrdma"

_OPS = {"SUM": "sum", "AVG": "avg", "PRODUCT": "prod", "MIN": "min", "MAX": "max"}
_DTYPES = {torch.int8: None, torch.uint8: None, torch.int32: None, torch.int64: None, torch.float16: None,
           torch.float32: None, torch.float64: None, torch.bfloat16: "bfloat16"}


def _host_array(t):
    """(numpy array sharing the memory of contiguous CPU tensor ``t``, dtype for the Communicator)."""
    if t.dtype not in _DTYPES:
        raise UsageError(f"pyrdma backend: tensors of {t.dtype} are not supported; "
                         f"use one of {', '.join(str(d) for d in _DTYPES)}")
    t = t.detach()
    if t.dtype == torch.bfloat16:       # numpy has no bfloat16: its bits, reduced as bfloat16
        return t.view(torch.int16).numpy().view(np.uint16), "bfloat16"
    return t.numpy(), None


class _Staged:
    """The memory the Communicator works on for tensor ``t`` (``array``, reduced as ``dtype``):
    ``t`` itself when it is contiguous, a CPU tensor as a numpy view, a CUDA tensor as it is (the
    Communicator's GPU paths take it: staged through pinned memory after torch's current stream,
    by CuPy or, without it, by torch, when the call's turn comes on the Communicator's thread);
    else a contiguous copy (on the same device; on the host for other devices) that ``write_back``
    copies into ``t``."""

    def __init__(self, t, name, copy_in=True):
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"pyrdma backend: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise UsageError(f"pyrdma backend: {name} is a {t.layout} tensor; only dense tensors are supported")
        if t.dtype not in _DTYPES:
            raise UsageError(f"pyrdma backend: tensors of {t.dtype} are not supported; "
                             f"use one of {', '.join(str(d) for d in _DTYPES)}")
        self.tensor = t
        device = t.device if t.device.type in ("cpu", "cuda") else torch.device("cpu")
        if t.device == device and t.is_contiguous():
            self.contiguous = t
        elif copy_in:
            self.contiguous = t.detach().to(device).contiguous()
        else:
            self.contiguous = torch.empty(t.shape, dtype=t.dtype, device=device)
        if self.contiguous.device.type == "cuda":
            # the Communicator's staging waits (an event, not the caller) for torch's current stream
            self.array, self.dtype = self.contiguous.detach(), _DTYPES[t.dtype]
        else:
            self.array, self.dtype = _host_array(self.contiguous)

    def flat(self):
        return self.array.reshape(-1)

    def write_back(self):
        if self.contiguous is not self.tensor:
            # a received buffer may be a leaf that requires grad (a pipeline stage's input): the
            # collective fills its data, as it does a CPU tensor's through its numpy view
            with torch.no_grad():
                self.tensor.copy_(self.contiguous)


class _Scratch:
    """Flat host tensors of the list forms (gather's outputs, scatter's inputs, ...), kept for the
    next call of the same dtype and length (the last KEEP kinds): a fresh one of tens of MiB pays
    its page faults every time (32 MiB: 33-51 ms on a 2-core machine, more than the 20 ms scatter
    it served). A tensor is given back only once its call has finished with it."""
    KEEP = 4

    def __init__(self):
        self._free = collections.OrderedDict()       # (dtype, numel) -> tensor
        self._lock = threading.Lock()

    def take(self, dtype, device, numel):
        if device.type == "cpu":
            with self._lock:
                t = self._free.pop((dtype, numel), None)
            if t is not None:
                return t
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, *tensors):
        for t in tensors:
            if t.device.type == "cpu":
                with self._lock:
                    self._free[(t.dtype, t.numel())] = t
                    while len(self._free) > self.KEEP:
                        self._free.popitem(last=False)


_scratch = _Scratch()


def _flat_like(tensors, numel=None):
    """One contiguous tensor on the device of ``tensors`` (from _scratch: give it back once done):
    their concatenation, or (``numel``) uninitialised room for that many elements of their dtype."""
    first = tensors[0]
    if numel is None:
        flat = _scratch.take(first.dtype, first.device, sum([t.numel() for t in tensors]))
        pieces = [t.detach().reshape(-1) for t in tensors]
        if flat.device.type == "cpu" and flat.dtype in _NUMPY_COPIES:
            # numpy's copy: torch.cat took 11-16 ms for 32 MiB on a 2-core machine, numpy 8 ms
            np.concatenate([t.cpu().numpy() for t in pieces], out=flat.numpy())
            return flat
        return torch.cat(pieces, out=flat)
    return _scratch.take(first.dtype, first.device, numel)


_NUMPY_COPIES = {torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64}


def _recycled(finish, *flats):
    """``finish`` (or nothing), then the flat tensors back to _scratch."""
    def run():
        if finish is not None:
            finish()
        _scratch.give(*flats)
    return run


def _op(opts, call):
    red = opts.reduceOp
    name = getattr(getattr(red, "op", red), "name", str(red))
    if name not in _OPS:
        raise UsageError(f"pyrdma backend: {call} with {name} is not supported; use one of {', '.join(_OPS)}")
    return _OPS[name]


def _one(tensors, call):
    if len(tensors) != 1:
        raise UsageError(f"pyrdma backend: {call} takes one tensor per process, got {len(tensors)}")
    return tensors[0]


# A call of host memory runs at once on the caller's thread when nothing is queued on the
# communicator's (its blocking form, the one-call path) if it is this small or the caller waits for
# it anyway (async_op=False: the options' asyncOp): the hop to that thread and back costs more than a
# small call itself (over TCP, 2 ranks: 8-byte allreduce 42 us blocking, 409 us as
# iallreduce().wait(), on a busy 2-core machine), and the Work it returns is complete. A larger
# asynchronous call goes to the communicator's thread, so that the caller's work (DDP's backward)
# overlaps it.
INLINE_BYTES = 64 * 1024


class Work(_c10d.Work):
    """Collectives in flight (one or several Communicator handles). Its future completes (on the
    Communicator's thread) when all have, with the result tensors or the first error; ``wait()``
    re-raises that error (the Work torch makes from a future would return True and drop it: a silent
    wrong result). A send or receive is issued later, with the others around it (``issue``): its
    Work gets its handle then, at the latest when it is waited on."""

    def __init__(self, handles, result, finish=None, issue=None):
        super().__init__()
        self._future = torch.futures.Future()
        self._result, self._issue = result, issue
        self._handles = None
        if handles is not None:
            self._start(handles, finish)

    # No closure here refers back to the Work: a reference cycle per call left every collective to
    # the garbage collector, whose passes over torch's objects cost ~25 us a call on average.
    def _start(self, handles, finish=None):
        self._handles, self._finish = list(handles), finish
        self._once = threading.Lock()
        if not self._handles or (len(self._handles) == 1 and type(self._handles[0]) is Done):
            self._complete()            # (a call that ran on the caller's thread: done already)
            return
        self._remaining = len(self._handles)
        self._count_lock = threading.Lock()
        for h in self._handles:
            h.add_done_callback(self._handle_done)

    def _handle_done(self, _handle):
        with self._count_lock:
            self._remaining -= 1
            if self._remaining:
                return
        self._complete()

    def _complete(self):
        """Once, by whichever comes first: the last handle's callback (on the Communicator's thread)
        or wait() (on the waiting one, which then need not be woken a second time)."""
        if not self._once.acquire(blocking=False):
            return
        try:
            for h in self._handles:
                h.wait()
            if self._finish is not None:
                self._finish()
        except Exception as exc:    # noqa: BLE001 -- handed to whoever waits on the Work
            self._future.set_exception(exc)
        else:
            self._future.set_result(self._result)

    def _issued(self, waiting=False):
        """The handles, the call issued first if it waits to be (``waiting``: by wait(), whose caller
        blocks for it anyway)."""
        if self._handles is None:
            self._issue(self if waiting else None)
        return self._handles

    def wait(self, timeout=None):
        if self._handles is not None and self._once.locked():
            self._future.wait()         # completed (or completing): its future has the outcome or soon will
            return True
        seconds = timeout.total_seconds() if timeout is not None else 0
        deadline = time.monotonic() + seconds if seconds > 0 else None
        for h in self._issued(waiting=True):           # RDMATimeoutError if one is still running at the deadline
            h.wait(None if deadline is None else max(deadline - time.monotonic(), 0.001))
        self._complete()
        self._future.wait()             # re-raises the collective's error
        return True

    def is_completed(self):
        self._issued()
        return self._future.done()

    def is_success(self):
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:   # noqa: BLE001
            return False
        return True

    def exception(self):
        try:
            self._future.value()
        except Exception as exc:   # noqa: BLE001
            return exc
        return None

    def get_future(self):
        self._issued()
        return self._future

    def result(self):
        self._issued()
        return self._future.wait()


def _backend_base():
    """torch >= 2.14 lets Python subclass the c10d Backend (what ProcessGroup wraps per device);
    2.13 only ProcessGroup, which init_process_group then uses as the group itself."""
    try:
        type("_Probe", (_c10d.Backend,), {})(0, 1)
        return _c10d.Backend
    except TypeError:
        return _c10d.ProcessGroup


class ProcessGroupPyrdma(_backend_base()):
    """The backend: one pyrdma Communicator per process group."""

    def __init__(self, store, rank, size, timeout, comm=None):
        """``comm``: a Communicator of this rank and size to run on instead of one made over
        ``store`` (shutdown() closes it all the same)."""
        super().__init__(rank, size)
        transport = os.environ.get("PYRDMA_TRANSPORT", "auto")
        if transport not in TRANSPORTS:
            raise UsageError(f"PYRDMA_TRANSPORT={transport!r}; use one of {', '.join(TRANSPORTS)}")
        if comm is not None and (comm.rank, comm.size) != (rank, size):
            raise UsageError(f"the Communicator is rank {comm.rank} of {comm.size}, not {rank} of {size}")
        self._timeout = timeout
        self._group_name = self._group_desc = ""
        self._coalesced = None          # the Works issued since start_coalescing, else None
        self._p2p_pending = []          # sends and receives not yet issued: (kind, _Staged, peer, tag, Work)
        self._p2p_lock = threading.Lock()
        self.comm = comm if comm is not None else Communicator(
            exchange=StoreExchange(store, rank, size, timeout), transport=transport, timeout=timeout.total_seconds())

    def getBackendName(self):
        return BACKEND

    def name(self):
        return BACKEND

    def __repr__(self):
        return f"<ProcessGroupPyrdma {self.comm!r}>"

    # ---- what torch asks of a backend besides collectives ------------------------------------
    # torch 2.14's Backend trampoline reads these through Python attribute lookup: left undefined,
    # the lookup finds the C++ property, which asks the trampoline again (a RecursionError).
    # With supports_coalescing, batch_isend_irecv and _coalescing_manager bracket their calls with
    # start_coalescing/end_coalescing (torch 2.13 does so only for _coalescing_manager).
    supports_splitting = property(lambda self: False)
    supports_coalescing = property(lambda self: True)
    supports_time_estimate = property(lambda self: False)
    supports_shrinking = property(lambda self: False)
    supports_reconfigure = property(lambda self: False)
    supports_window = property(lambda self: False)

    @property
    def options(self):
        return _c10d.Backend.Options(BACKEND, self._timeout)

    # torch 2.13 uses this object as the ProcessGroup itself; its C++ getter looks for the name in
    # the group's (here absent) per-device backends, so DeviceMesh.from_group found none.
    def _set_group_name(self, name):
        self._group_name = name

    def _set_group_desc(self, desc):
        self._group_desc = desc

    group_name = property(lambda self: self._group_name)
    group_desc = property(lambda self: self._group_desc)

    def start_coalescing(self, device=None):
        """The calls until end_coalescing make one Work (collectives start at once: the Communicator
        runs them in order on its own thread; sends and receives go as one batch at the end). A block
        that raised never reached its end_coalescing: the next one starts afresh."""
        self._coalesced = []

    def end_coalescing(self, device=None):
        if self._coalesced is None:
            raise UsageError("pyrdma backend: end_coalescing without start_coalescing")
        works, self._coalesced = self._coalesced, None
        self._comm()
        return Work([h for work in works for h in work._issued()], [])

    _start_coalescing, _end_coalescing = start_coalescing, end_coalescing

    def _work(self, handles, result, finish=None):
        work = Work(handles if isinstance(handles, list) else [handles], result, finish)
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    # ---- the collectives DDP and the torch API use ---------------------------------------------

    def _start(self, staged, opts, now, later):
        """The handle of a call on ``staged`` memory: ``later()``, the Communicator's non-blocking
        form (run on its thread), or, while nothing is queued there (so the order of calls holds),
        ``now()``, the blocking form, on this thread, if its caller waits for it at once
        (``opts.asyncOp`` false: host or CUDA memory alike, whose staging then waits on this thread
        as the caller would) or it is of host memory and at most INLINE_BYTES (``staged`` None: no
        memory, a barrier)."""
        comm = self.comm                # (each caller took self._comm(), which issues pending sends)
        if comm._exec.state.idle and self._coalesced is None and (not getattr(opts, "asyncOp", True) or staged is None or (
                isinstance(staged.array, np.ndarray) and staged.array.nbytes <= INLINE_BYTES)):
            try:
                now()
            except Exception as exc:    # noqa: BLE001 -- raised by wait(), as from the queued form
                return Done(error=exc)
            return Done()
        return later()

    def allreduce(self, tensors, opts=None):
        t = _Staged(_one(tensors, "allreduce"), "the tensor")
        comm, op = self._comm(), _op(opts, "allreduce")
        handle = self._start(t, opts, lambda: comm.allreduce(t.array, op=op, dtype=t.dtype),
                             lambda: comm.iallreduce(t.array, op=op, dtype=t.dtype))
        return self._work(handle, tensors, t.write_back)

    def allreduce_coalesced(self, tensors, opts=None):
        if not tensors:
            return self._work(self._comm().ibarrier(), tensors)
        if len({t.dtype for t in tensors}) != 1:
            raise UsageError("pyrdma backend: allreduce_coalesced needs tensors of one dtype")
        flat = _flat_like(tensors)
        staged = _Staged(flat, "the tensors")
        comm, op = self._comm(), _op(opts, "allreduce_coalesced")
        handle = self._start(staged, opts, lambda: comm.allreduce(staged.array, op=op, dtype=staged.dtype),
                             lambda: comm.iallreduce(staged.array, op=op, dtype=staged.dtype))
        return self._work(handle, tensors, _recycled(lambda: _unflatten(staged, tensors), flat))

    def broadcast(self, tensors, opts=None):
        t = _Staged(_one(tensors, "broadcast"), "the tensor")
        comm, root = self._comm(), opts.rootRank
        handle = self._start(t, opts, lambda: comm.broadcast(t.array, root=root),
                             lambda: comm.ibroadcast(t.array, root=root))
        return self._work(handle, tensors, t.write_back)

    def reduce(self, tensors, opts=None):
        t = _Staged(_one(tensors, "reduce"), "the tensor")
        comm, op, root = self._comm(), _op(opts, "reduce"), opts.rootRank
        handle = self._start(t, opts, lambda: comm.reduce(t.array, op=op, root=root, dtype=t.dtype),
                             lambda: comm.ireduce(t.array, op=op, root=root, dtype=t.dtype))
        return self._work(handle, tensors, t.write_back if self.rank() == opts.rootRank else None)

    def allgather(self, output_tensors, input_tensors, opts=None):
        handle, finish = self._allgather_list(_one(output_tensors, "allgather"), _one(input_tensors, "allgather"),
                                              "allgather", opts)
        return self._work(handle, output_tensors, finish)

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        """all_gather_coalesced: one allgather per input tensor, into its list of outputs."""
        if len(output_lists) != len(input_tensors):
            raise UsageError(f"pyrdma backend: allgather_coalesced got {len(output_lists)} output lists for "
                             f"{len(input_tensors)} inputs")
        issued = [self._allgather_list(outs, t, "allgather_coalesced", opts)
                  for outs, t in zip(output_lists, input_tensors)]
        return self._work([h for h, _ in issued], output_lists, _all(f for _, f in issued))

    def _allgather_list(self, outs, input, call, opts=None):
        src = _Staged(input, "the input")
        n = src.tensor.numel()
        if len(outs) != self.size() or any([o.numel() != n or o.dtype != src.tensor.dtype for o in outs]):
            raise UsageError(f"pyrdma backend: {call} needs {self.size()} output tensors of {n} "
                             f"{src.tensor.dtype} elements each")
        flat = _flat_like([input], self.size() * n)
        gathered = _Staged(flat, "the output", copy_in=False)
        comm = self._comm()
        handle = self._start(gathered, opts, lambda: comm.allgather(src.flat(), out=gathered.array),
                             lambda: comm.iallgather(src.flat(), out=gathered.array))
        return handle, _recycled(lambda: _unflatten(gathered, outs), flat)

    def all_gather_single(self, output, input, opts=None):
        handle, finish = self._all_gather_single(output, input, "all_gather_into_tensor", opts)
        return self._work(handle, output, finish)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        """all_gather_into_tensor_coalesced (DTensor's functional collectives, _coalescing_manager): one
        allgather per pair."""
        issued = [self._all_gather_single(o, i, "all_gather_into_tensor_coalesced") for o, i in _pairs(outputs, inputs)]
        return self._work([h for h, _ in issued], outputs, _all(f for _, f in issued))

    def _all_gather_single(self, output, input, call, opts=None):
        src, out = _Staged(input, "the input"), _Staged(output, "the output", copy_in=False)
        if out.tensor.numel() != self.size() * src.tensor.numel() or out.tensor.dtype != src.tensor.dtype:
            raise UsageError(f"pyrdma backend: {call} needs an output of {self.size()} x "
                             f"{src.tensor.numel()} {src.tensor.dtype} elements, got {out.tensor.numel()} "
                             f"{out.tensor.dtype}")
        comm = self._comm()
        return self._start(out, opts, lambda: comm.allgather(src.flat(), out=out.flat()),
                           lambda: comm.iallgather(src.flat(), out=out.flat())), out.write_back

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        out, ins = _one(output_tensors, "reduce_scatter"), _one(input_tensors, "reduce_scatter")
        n = out.numel()
        if len(ins) != self.size() or any([t.numel() != n or t.dtype != out.dtype for t in ins]):
            raise UsageError(f"pyrdma backend: reduce_scatter needs {self.size()} input tensors of {n} "
                             f"{out.dtype} elements each (the output's)")
        flat = _flat_like(ins)
        handle, finish = self._reduce_scatter_flat(flat, out, opts, "reduce_scatter")
        return self._work(handle, output_tensors, _recycled(finish, flat))

    def reduce_scatter_single(self, output, input, opts=None):
        handle, finish = self._reduce_scatter_single(output, input, opts, "reduce_scatter_tensor")
        return self._work(handle, output, finish)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        """reduce_scatter_tensor_coalesced: one reduce_scatter per pair."""
        issued = [self._reduce_scatter_single(o, i, opts, "reduce_scatter_tensor_coalesced")
                  for o, i in _pairs(outputs, inputs)]
        return self._work([h for h, _ in issued], outputs, _all(f for _, f in issued))

    def _reduce_scatter_single(self, output, input, opts, call):
        if input.numel() != self.size() * output.numel() or input.dtype != output.dtype:
            raise UsageError(f"pyrdma backend: {call} needs an input of {self.size()} x "
                             f"{output.numel()} {output.dtype} elements, got {input.numel()} {input.dtype}")
        return self._reduce_scatter_flat(input, output, opts, call)

    def _reduce_scatter_flat(self, flat, output, opts, call):
        src, out = _Staged(flat, "the input"), _Staged(output, "the output", copy_in=False)
        comm, op = self._comm(), _op(opts, call)
        handle = self._start(src, opts, lambda: comm.reduce_scatter(src.flat(), out=out.flat(), op=op,
                                                                    dtype=src.dtype),
                             lambda: comm.ireduce_scatter(src.flat(), out=out.flat(), op=op, dtype=src.dtype))
        return handle, out.write_back

    _allgather_base = all_gather_single              # their older names
    _reduce_scatter_base = reduce_scatter_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def barrier(self, opts=None):
        comm = self._comm()
        return self._work(self._start(None, opts, comm.barrier, comm.ibarrier), [])

    # ---- rooted collectives, all-to-all, point to point -----------------------------------------

    def gather(self, output_tensors, input_tensors, opts):
        src = _Staged(_one(input_tensors, "gather"), "the input")
        root, n, comm = opts.rootRank, src.tensor.numel(), self._comm()
        if self.rank() != root:
            return self._work(self._start(src, opts, lambda: comm.gather(src.flat(), root=root),
                                          lambda: comm.igather(src.flat(), root=root)), output_tensors)
        outs = _one(output_tensors, "gather")
        if len(outs) != self.size() or any([o.numel() != n or o.dtype != src.tensor.dtype for o in outs]):
            raise UsageError(f"pyrdma backend: gather needs {self.size()} output tensors of {n} "
                             f"{src.tensor.dtype} elements each on the root")
        flat = _flat_like(outs, self.size() * n)
        gathered = _Staged(flat, "the output", copy_in=False)
        handle = self._start(gathered, opts, lambda: comm.gather(src.flat(), out=gathered.array, root=root),
                             lambda: comm.igather(src.flat(), out=gathered.array, root=root))
        return self._work(handle, output_tensors, _recycled(lambda: _unflatten(gathered, outs), flat))

    def scatter(self, output_tensors, input_tensors, opts):
        out = _Staged(_one(output_tensors, "scatter"), "the output", copy_in=False)
        root, n = opts.rootRank, out.tensor.numel()
        pieces = flat = None
        if self.rank() == root:
            ins = _one(input_tensors, "scatter")
            if len(ins) != self.size() or any([t.numel() != n or t.dtype != out.tensor.dtype for t in ins]):
                raise UsageError(f"pyrdma backend: scatter needs {self.size()} input tensors of {n} "
                                 f"{out.tensor.dtype} elements each (the output's) on the root")
            if all([t.device.type == "cpu" for t in ins]):     # each piece sent from where it lies
                pieces = [_Staged(t, "the inputs").flat() for t in ins]
            else:
                flat = _flat_like(ins)
                pieces = _Staged(flat, "the inputs").array
        comm = self._comm()
        handle = self._start(out, opts, lambda: comm.scatter(pieces, out=out.flat(), root=root),
                             lambda: comm.iscatter(pieces, out=out.flat(), root=root))
        return self._work(handle, output_tensors, out.write_back if flat is None else _recycled(out.write_back, flat))

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """all_to_all (lists): input i goes to rank i, output i comes from rank i; sizes may differ."""
        if len(output_tensors) != self.size() or len(input_tensors) != self.size():
            raise UsageError(f"pyrdma backend: all_to_all needs {self.size()} input and output tensors, got "
                             f"{len(input_tensors)} and {len(output_tensors)}")
        dtype = input_tensors[0].dtype
        if any([t.dtype != dtype for t in input_tensors]) or any([o.dtype != dtype for o in output_tensors]):
            raise UsageError("pyrdma backend: all_to_all needs tensors of one dtype")
        send, recv = [t.numel() for t in input_tensors], [o.numel() for o in output_tensors]
        flat_in = _flat_like(input_tensors)
        src = _Staged(flat_in, "the inputs")
        flat = _flat_like(output_tensors, sum(recv))
        gathered = _Staged(flat, "the outputs", copy_in=False)
        # equal pieces: the Communicator's equal form (its one-call path), as all_to_all_single's
        counts = {} if len(set(send + recv)) == 1 and send[0] else dict(send_counts=send, recv_counts=recv)
        comm = self._comm()
        handle = self._start(src, opts, lambda: comm.alltoall(src.array, out=gathered.array, **counts),
                             lambda: comm.ialltoall(src.array, out=gathered.array, **counts))
        return self._work(handle, output_tensors,
                          _recycled(lambda: _unflatten(gathered, output_tensors), flat_in, flat))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """all_to_all_single: rows of ``input`` (split sizes along dim 0, equal when empty) to each rank."""
        src, out = _Staged(input, "the input"), _Staged(output, "the output", copy_in=False)
        if src.tensor.dtype != out.tensor.dtype:
            raise UsageError(f"pyrdma backend: all_to_all_single got input {src.tensor.dtype}, "
                             f"output {out.tensor.dtype}")
        send = self._split_counts(input, input_split_sizes, "input")
        recv = self._split_counts(output, output_split_sizes, "output")
        equal = not input_split_sizes and not output_split_sizes
        comm = self._comm()
        counts = dict(send_counts=None if equal else send, recv_counts=None if equal else recv)
        handle = self._start(src, opts, lambda: comm.alltoall(src.flat(), out=out.flat(), **counts),
                             lambda: comm.ialltoall(src.flat(), out=out.flat(), **counts))
        return self._work(handle, output, out.write_back)

    all_to_all_single = alltoall_base

    def _split_counts(self, t, split_sizes, name):
        """Element counts per rank of ``t`` split along dim 0 (equally when ``split_sizes`` is empty)."""
        rows = t.shape[0] if t.dim() else 1
        row = math.prod(t.shape[1:]) if t.dim() else 1
        if not split_sizes:
            if rows % self.size():
                raise UsageError(f"pyrdma backend: all_to_all_single: the {name}'s {rows} rows do not split "
                                 f"equally over {self.size()} ranks; pass split sizes")
            return [rows // self.size() * row] * self.size()
        split_sizes = list(split_sizes)
        if len(split_sizes) != self.size() or sum(split_sizes) != rows or min(split_sizes) < 0:
            raise UsageError(f"pyrdma backend: all_to_all_single: {name} split sizes {split_sizes} must be "
                             f"{self.size()} counts summing to the {name}'s {rows} rows")
        return [s * row for s in split_sizes]

    def send(self, tensors, dst, tag=0):
        return self._p2p("send", _Staged(_one(tensors, "send"), "the tensor"), dst, tag, tensors)

    def recv(self, tensors, src, tag=0):
        return self._p2p("recv", _Staged(_one(tensors, "recv"), "the tensor", copy_in=False), src, tag, tensors)

    # Sends and receives wait until the next other call, or until one of their Works is waited on,
    # and then go as one Communicator.batch: its operations wait for none of the others, so the
    # isend/irecv pairs of batch_isend_irecv (and of the pipelining schedules) cannot deadlock
    # whatever their order on each rank (the Communicator runs separate calls one after another).

    def _p2p(self, kind, staged, peer, tag, tensors):
        work = Work(None, tensors, issue=self._issue_p2p)
        with self._p2p_lock:
            self._p2p_pending.append((kind, staged, peer, tag, work))
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _issue_p2p(self, waiter=None):
        """Issue the pending sends and receives as one batch, on the communicator's thread; or,
        where ``waiter`` (a Work being waited on) is one of them, all of host memory, and nothing
        is queued, on this thread, whose caller waits anyway (without the hop to the communicator's
        thread and back: a pipeline's isend/irecv pairs, batch_isend_irecv; a lone blocking send
        or recv is the Communicator's own, one C call)."""
        with self._p2p_lock:
            pending, self._p2p_pending = self._p2p_pending, []
            if not pending:
                return
            comm = self.comm
            inline = any([p[4] is waiter for p in pending]) and comm._exec.state.idle and self._coalesced is None \
                and all([isinstance(p[1].array, np.ndarray) for p in pending])
            if not inline:
                self._batch(pending, False)
                return
        # the blocking calls outside the lock: a thread that queues a send meanwhile must not wait on them
        if len(pending) > 1:
            self._batch(pending, True)
            return
        kind, staged, peer, tag, work = pending[0]
        try:
            if kind == "send":
                comm.send(staged.flat(), peer, tag)
            else:
                got = comm.recv(staged.flat(), peer, tag)
        except Exception as exc:    # noqa: BLE001 -- raised by wait(), as from the batch
            work._start([Done(error=exc)])
            return
        work._start([], None if kind == "send" else _received(lambda: got, staged, peer))

    def _batch(self, pending, blocking):
        """Start the Works of ``pending`` as one Communicator batch (``blocking``: run now)."""
        try:
            handle = self.comm._batch([(kind, staged.flat(), peer, tag) for kind, staged, peer, tag, _ in pending],
                                      blocking)
        except Exception as exc:    # noqa: BLE001 -- raised by wait(), as from the queued batch
            if not blocking:
                raise
            handle = Done(error=exc)
        for i, (kind, staged, peer, tag, work) in enumerate(pending):
            work._start([handle], None if kind == "send" else
                        _received(lambda i=i: handle.wait()[i], staged, peer))

    def _comm(self):
        """The Communicator, once the sends and receives issued before this call have gone."""
        if self._p2p_pending:
            self._issue_p2p()
        return self.comm

    def recv_anysource(self, tensors, tag=0):
        raise UsageError("pyrdma backend: recv_anysource (recv without src) is not supported; pass src")

    def shutdown(self):
        self.comm.close()

    def abort(self):
        self.comm.close()


def _received(count_of, staged, src):
    """What completes a receive (``count_of()``: the elements it received): its length checked, its
    tensor written."""
    def finish():
        count = count_of()
        if count != staged.tensor.numel():
            raise UsageError(f"pyrdma backend: recv from rank {src} got {count} elements for a tensor of "
                             f"{staged.tensor.numel()}")
        staged.write_back()
    return finish


def _pairs(outputs, inputs):
    if len(outputs) != len(inputs):
        raise UsageError(f"pyrdma backend: {len(outputs)} outputs for {len(inputs)} inputs")
    return zip(outputs, inputs)


def _unflatten(staged, tensors):
    """Copy consecutive pieces of the flat tensor of ``staged`` (once written back) into ``tensors``."""
    staged.write_back()
    flat, offset = staged.tensor, 0
    with torch.no_grad():            # as _Staged.write_back
        for t in tensors:
            n = t.numel()
            piece = flat[offset:offset + n]
            if t.device.type == "cpu" and piece.device.type == "cpu" and t.dtype in _NUMPY_COPIES \
                    and t.is_contiguous():
                np.copyto(t.detach().numpy().reshape(-1), piece.numpy())     # faster than copy_ (see _flat_like)
            else:
                t.copy_(piece.view(t.shape))
            offset += n


def _all(finishers):
    finishers = [f for f in finishers if f is not None]
    return lambda: [f() for f in finishers]


def _create(store, rank, size, timeout):
    return ProcessGroupPyrdma(store, rank, size, timeout)


if BACKEND.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])

__all__ = ["BACKEND", "ProcessGroupPyrdma", "StoreExchange", "advertise_host", "PeerError"]
