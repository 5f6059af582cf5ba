"""A torch.distributed backend named "pyrdma": PyTorch's collectives (and so DDP) over pyrdma's
Communicator, on RDMA when every rank has a device, else on TCP.

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
CPU tensors are used in place when contiguous; others (CUDA tensors, non-contiguous ones) go
through a contiguous host copy that is written back when the collective completes.
"""
import ipaddress
import os
import socket

import numpy as np

try:
    import torch
    import torch.distributed as dist
    from torch._C import _distributed_c10d as _c10d
except ImportError as _exc:
    raise ImportError(f"pyrdma.torch needs PyTorch with torch.distributed (pip install 'pyrdma[torch]'): "
                      f"{_exc}") from _exc

from pyrdma.collectives.communicator import Communicator, TRANSPORTS
from pyrdma.errors import PeerError, RDMATimeoutError, UsageError

BACKEND = "pyrdma"

_OPS = {"SUM": "sum", "AVG": "avg", "PRODUCT": "prod", "MIN": "min", "MAX": "max"}
_DTYPES = {torch.int8: None, torch.uint8: None, torch.int32: None, torch.int64: None, torch.float16: None,
           torch.float32: None, torch.float64: None, torch.bfloat16: "bfloat16"}
SUPPORTED = ("all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
             "reduce_scatter", "reduce_scatter_tensor", "barrier")


class StoreExchange:
    """The Communicator's rendezvous (``allgather(bytes) -> [bytes]``) through a c10d Store: each
    round, every rank sets its key and waits for the others' until ``timeout``."""

    def __init__(self, store, rank, size, timeout, environ=None):
        self.store, self.rank, self.size = store, rank, size
        self.timeout = timeout
        self.advertise_host = advertise_host(os.environ if environ is None else environ)
        self._round = 0

    def _key(self, rnd, rank):
        return f"pyrdma/{rnd}/{rank}"

    def allgather(self, record):
        rnd = self._round
        self._round += 1
        self.store.set(self._key(rnd, self.rank), bytes(record))
        keys = [self._key(rnd, r) for r in range(self.size)]
        try:
            self.store.wait(keys, self.timeout)
        except RuntimeError as exc:     # torch's DistStoreError (a timeout) or a lost store
            missing = [r for r, k in enumerate(keys) if not self._has(k)]
            raise RDMATimeoutError(f"rank {self.rank}: ranks {missing} did not join the pyrdma rendezvous within "
                                   f"{self.timeout.total_seconds():g} s ({exc})", call="init_process_group") from None
        return [bytes(self.store.get(k)) for k in keys]

    def _has(self, key):
        try:
            return self.store.check([key])
        except RuntimeError:
            return False

    def barrier(self):
        self.allgather(b"")

    def close(self):
        pass


def advertise_host(environ):
    """Where this rank's TCP transport listens: PYRDMA_TCP_HOST, else the local address that routes
    to MASTER_ADDR (loopback when MASTER_ADDR is loopback or unset)."""
    if environ.get("PYRDMA_TCP_HOST"):
        return environ["PYRDMA_TCP_HOST"]
    master = environ.get("MASTER_ADDR")
    if not master:
        return "127.0.0.1"
    try:
        ip = socket.getaddrinfo(master, None, socket.AF_INET)[0][4][0]
        if ipaddress.ip_address(ip).is_loopback:
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))           # no packet is sent: this only asks the routing table
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


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
    """Contiguous host memory for tensor ``t``: ``t`` itself when it is a contiguous CPU tensor,
    else a copy that ``write_back`` copies into ``t``."""

    def __init__(self, t, name, copy_in=True):
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"pyrdma backend: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise UsageError(f"pyrdma backend: {name} is a {t.layout} tensor; only dense tensors are supported")
        self.tensor = t
        if t.device.type == "cpu" and t.is_contiguous():
            self.host = t
        elif copy_in:
            self.host = t.detach().to("cpu").contiguous()
        else:
            self.host = torch.empty(t.shape, dtype=t.dtype)
        self.array, self.dtype = _host_array(self.host)

    def write_back(self):
        if self.host is not self.tensor:
            self.tensor.copy_(self.host)


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


class Work(_c10d.Work):
    """A collective in flight. Its future completes (on the Communicator's thread) when the
    collective has, with the result tensors or the error; ``wait()`` re-raises that error (the Work
    torch makes from a future would return True and drop it: a silent wrong result)."""

    def __init__(self, handle, result, finish=None):
        super().__init__()
        self._handle = handle
        self._future = torch.futures.Future()

        def done(h):
            try:
                h.wait()
                if finish is not None:
                    finish()
            except Exception as exc:    # noqa: BLE001 -- handed to whoever waits on the Work
                self._future.set_exception(exc)
            else:
                self._future.set_result(result)
        handle.add_done_callback(done)

    def wait(self, timeout=None):
        seconds = timeout.total_seconds() if timeout is not None else 0
        self._handle.wait(seconds if seconds > 0 else None)   # RDMATimeoutError if still running
        self._future.wait()             # re-raises the collective's error
        return True

    def is_completed(self):
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
        return self._future

    def result(self):
        return self._future.wait()


def _work(handle, result, finish=None):
    return Work(handle, result, finish)


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

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        transport = os.environ.get("PYRDMA_TRANSPORT", "auto")
        if transport not in TRANSPORTS:
            raise UsageError(f"PYRDMA_TRANSPORT={transport!r}; use one of {', '.join(TRANSPORTS)}")
        seconds = timeout.total_seconds()
        self.comm = Communicator(exchange=StoreExchange(store, rank, size, timeout), transport=transport,
                                 timeout=seconds)

    def getBackendName(self):
        return BACKEND

    def name(self):
        return BACKEND

    def __repr__(self):
        return f"<ProcessGroupPyrdma {self.comm!r}>"

    # ---- the collectives DDP and the torch API use ---------------------------------------------

    def allreduce(self, tensors, opts=None):
        t = _Staged(_one(tensors, "allreduce"), "the tensor")
        handle = self.comm.iallreduce(t.array, op=_op(opts, "allreduce"), dtype=t.dtype)
        return _work(handle, tensors, t.write_back)

    def allreduce_coalesced(self, tensors, opts=None):
        if not tensors:
            return _work(self.comm.ibarrier(), tensors)
        if len({t.dtype for t in tensors}) != 1:
            raise UsageError("pyrdma backend: allreduce_coalesced needs tensors of one dtype")
        flat = torch.cat([t.detach().reshape(-1).cpu() for t in tensors])
        staged = _Staged(flat, "the tensors")
        handle = self.comm.iallreduce(staged.array, op=_op(opts, "allreduce_coalesced"), dtype=staged.dtype)

        def scatter_back():
            offset = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view(t.shape))
                offset += n
        return _work(handle, tensors, scatter_back)

    def broadcast(self, tensors, opts=None):
        t = _Staged(_one(tensors, "broadcast"), "the tensor")
        handle = self.comm.ibroadcast(t.array, root=opts.rootRank)
        return _work(handle, tensors, t.write_back)

    def reduce(self, tensors, opts=None):
        t = _Staged(_one(tensors, "reduce"), "the tensor")
        handle = self.comm.ireduce(t.array, op=_op(opts, "reduce"), root=opts.rootRank, dtype=t.dtype)
        return _work(handle, tensors, t.write_back if self.rank() == opts.rootRank else None)

    def allgather(self, output_tensors, input_tensors, opts=None):
        outs, src = _one(output_tensors, "allgather"), _Staged(_one(input_tensors, "allgather"), "the input")
        n = src.tensor.numel()
        if len(outs) != self.size() or any(o.numel() != n or o.dtype != src.tensor.dtype for o in outs):
            raise UsageError(f"pyrdma backend: allgather needs {self.size()} output tensors of {n} "
                             f"{src.tensor.dtype} elements each")
        flat = torch.empty(self.size() * n, dtype=src.tensor.dtype)
        gathered = _Staged(flat, "the output")
        handle = self.comm.iallgather(src.array.reshape(-1), out=gathered.array)

        def split():
            for i, o in enumerate(outs):
                o.copy_(flat[i * n:(i + 1) * n].view(o.shape))
        return _work(handle, output_tensors, split)

    def all_gather_single(self, output, input, opts=None):
        src, out = _Staged(input, "the input"), _Staged(output, "the output", copy_in=False)
        if out.tensor.numel() != self.size() * src.tensor.numel() or out.tensor.dtype != src.tensor.dtype:
            raise UsageError(f"pyrdma backend: all_gather_into_tensor needs an output of {self.size()} x "
                             f"{src.tensor.numel()} {src.tensor.dtype} elements, got {out.tensor.numel()} "
                             f"{out.tensor.dtype}")
        handle = self.comm.iallgather(src.array.reshape(-1), out=out.array.reshape(-1))
        return _work(handle, output, out.write_back)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        out, ins = _one(output_tensors, "reduce_scatter"), _one(input_tensors, "reduce_scatter")
        n = out.numel()
        if len(ins) != self.size() or any(t.numel() != n or t.dtype != out.dtype for t in ins):
            raise UsageError(f"pyrdma backend: reduce_scatter needs {self.size()} input tensors of {n} "
                             f"{out.dtype} elements each (the output's)")
        flat = torch.cat([t.detach().reshape(-1).cpu() for t in ins])
        return self._reduce_scatter_flat(flat, out, opts, output_tensors, "reduce_scatter")

    def reduce_scatter_single(self, output, input, opts=None):
        if input.numel() != self.size() * output.numel() or input.dtype != output.dtype:
            raise UsageError(f"pyrdma backend: reduce_scatter_tensor needs an input of {self.size()} x "
                             f"{output.numel()} {output.dtype} elements, got {input.numel()} {input.dtype}")
        return self._reduce_scatter_flat(input, output, opts, output, "reduce_scatter_tensor")

    def _reduce_scatter_flat(self, flat, output, opts, result, call):
        src, out = _Staged(flat, "the input"), _Staged(output, "the output", copy_in=False)
        handle = self.comm.ireduce_scatter(src.array.reshape(-1), out=out.array.reshape(-1), op=_op(opts, call),
                                           dtype=src.dtype)
        return _work(handle, result, out.write_back)

    _allgather_base = all_gather_single              # their older names
    _reduce_scatter_base = reduce_scatter_single

    def barrier(self, opts=None):
        return _work(self.comm.ibarrier(), [])

    # ---- the rest of c10d's API: refused by name ----------------------------------------------

    def _unsupported(self, call):
        raise UsageError(f"pyrdma backend: {call} is not supported (supported: {', '.join(SUPPORTED)})")

    def send(self, *args, **kwargs):
        self._unsupported("send")

    def recv(self, *args, **kwargs):
        self._unsupported("recv")

    def recv_anysource(self, *args, **kwargs):
        self._unsupported("recv_anysource")

    def gather(self, *args, **kwargs):
        self._unsupported("gather")

    def scatter(self, *args, **kwargs):
        self._unsupported("scatter")

    def alltoall(self, *args, **kwargs):
        self._unsupported("alltoall")

    def alltoall_base(self, *args, **kwargs):
        self._unsupported("all_to_all_single")

    all_to_all_single = alltoall_base

    def allgather_coalesced(self, *args, **kwargs):
        self._unsupported("allgather_coalesced")

    def all_gather_single_coalesced(self, *args, **kwargs):
        self._unsupported("all_gather_into_tensor_coalesced")

    def reduce_scatter_single_coalesced(self, *args, **kwargs):
        self._unsupported("reduce_scatter_tensor_coalesced")

    def shutdown(self):
        self.comm.close()

    def abort(self):
        self.comm.close()


def _create(store, rank, size, timeout):
    return ProcessGroupPyrdma(store, rank, size, timeout)


if BACKEND.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])

__all__ = ["BACKEND", "ProcessGroupPyrdma", "StoreExchange", "advertise_host", "PeerError"]
