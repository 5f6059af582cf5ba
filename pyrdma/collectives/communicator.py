"""Communicator: the public face of the collectives (allreduce, reduce, broadcast, allgather,
reduce_scatter, barrier), each also non-blocking (``i*`` returning a Handle).

Buffers: numpy arrays, anything with the buffer protocol, DLPack CPU tensors (torch) and CuPy
arrays (through pyrdma.cuda's host-staging pipeline). Operations copy the input into the
transport's registered work buffer (registered once, reused across calls), run the algorithm
there, and copy the result out.
"""
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pyrdma import _reduce
from pyrdma.collectives import algorithms
from pyrdma.collectives.bootstrap import MPIExchange, TCPStore, check_rank, env_config, parse_address
from pyrdma.errors import RDMATimeoutError, UsageError

OPS = ("sum", "prod", "min", "max", "avg")
ALGORITHMS = ("auto", "ring", "tree")


class Handle:
    """A collective in flight: ``wait(timeout)`` returns its result (or raises its error), ``test()``
    says whether it has finished."""

    def __init__(self, future):
        self._future = future

    def test(self):
        return self._future.done()

    def wait(self, timeout=None):
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise RDMATimeoutError(f"collective still running after {timeout} s") from None


class _Operand:
    """A user buffer as a flat C-contiguous numpy view, plus its reduction dtype code."""

    def __init__(self, obj, writable, name="buffer"):
        arr = _as_numpy(obj, name)
        if not arr.flags.c_contiguous:
            raise UsageError(f"{name} is not C-contiguous; pass numpy.ascontiguousarray({name})")
        if writable and not arr.flags.writeable:
            raise UsageError(f"{name} is read-only; pass out= or a writable buffer")
        self.array = arr.reshape(-1)
        self.code = _reduce.dtype_code("bfloat16" if arr.dtype.name == "bfloat16" else arr.dtype)
        self.itemsize = arr.dtype.itemsize
        self.bytes = self.array.view(np.uint8)


def _as_numpy(obj, name):
    if isinstance(obj, np.ndarray):
        return obj
    if hasattr(obj, "__dlpack_device__"):
        device_type = obj.__dlpack_device__()[0]
        if device_type != 1:   # kDLCPU
            raise UsageError(f"{name} lives on DLPack device type {device_type}; only CPU tensors "
                             f"(and CuPy arrays) are supported")
        return np.from_dlpack(obj)
    try:
        return np.frombuffer(memoryview(obj), dtype=np.uint8) if not hasattr(obj, "dtype") else np.asarray(obj)
    except TypeError:
        raise UsageError(f"{name} ({type(obj).__name__}) is not an array, a buffer or a DLPack tensor") from None


def _is_cuda(obj):
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    dev = getattr(obj, "__dlpack_device__", None)
    return dev is not None and dev()[0] in (2, 3, 13)   # CUDA, CUDA host, CUDA managed


class Communicator:
    """A group of ``size`` processes that run collectives together.

    Ways in: ``Communicator.from_env()`` (torchrun: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE),
    ``Communicator.from_mpi(mpi4py_comm)``, or ``Communicator(rank, size, "host:port")``.
    ``transport`` is "rdma" (one RC QP per peer; default) or "tcp" (sockets, for machines without
    RDMA). Every wait gives up after ``timeout`` seconds with a PeerError naming the silent rank.
    """

    def __init__(self, rank, size, master=None, transport="rdma", timeout=60.0, device=None,
                 exchange=None, cost_model=None, slot_bytes=None):
        check_rank(rank, size)
        self.rank, self.size, self.timeout = rank, size, timeout
        own_exchange = exchange is None
        if exchange is None:
            if master is None:
                raise UsageError("give master='host:port' of rank 0, or use from_env() / from_mpi()")
            host, port = parse_address(master)
            exchange = TCPStore(host, port, rank, size, timeout)
        kwargs = {} if slot_bytes is None else {"slot_bytes": slot_bytes}
        try:
            if transport == "rdma":
                from pyrdma.collectives.transport import RdmaTransport
                self.transport = RdmaTransport(rank, size, exchange, timeout, device, **kwargs)
            elif transport == "tcp":
                from pyrdma.collectives.transport import TcpTransport
                self.transport = TcpTransport(rank, size, exchange, timeout, **kwargs)
            else:
                raise UsageError(f"unknown transport {transport!r}; use 'rdma' or 'tcp'")
        finally:
            if own_exchange:
                exchange.close()
        self.transport_name = transport
        self.cost_model = cost_model or algorithms.CostModel()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pyrdma-rank{rank}")
        self._closed = False

    @classmethod
    def from_env(cls, environ=None, **kwargs):
        host, port, rank, size = env_config(environ)
        return cls(rank, size, f"{host}:{port}", **kwargs)

    @classmethod
    def from_mpi(cls, mpi_comm=None, **kwargs):
        if mpi_comm is None:
            from mpi4py import MPI
            mpi_comm = MPI.COMM_WORLD
        exchange = MPIExchange(mpi_comm)
        return cls(exchange.rank, exchange.size, exchange=exchange, **kwargs)

    def close(self):
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        self.transport.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<Communicator rank {self.rank} of {self.size} over {self.transport_name}>"

    # ---- plumbing -----------------------------------------------------------------------------

    def _submit(self, fn, *args):
        # One worker thread runs every collective, blocking or not, in the order they were called.
        if self._closed:
            raise UsageError("the communicator is closed")
        return Handle(self._executor.submit(self._locked, fn, *args))

    def _locked(self, fn, *args):
        with self._lock:
            return fn(*args)

    def _reducer(self, code, op):
        opc = _reduce.op_code(op)   # validates op
        dtype_arg = "bfloat16" if code == 7 else None

        def reduce(dst, src):
            if dtype_arg is None:
                _reduce.reduce_into(dst.view(_CODE_DTYPES[code]), src.view(_CODE_DTYPES[code]), op)
            else:
                _reduce.reduce_into(dst.view(np.uint16), src.view(np.uint16), op, dtype="bfloat16")
        return reduce

    def _prepare(self, buf, out, name_out="out", out_nbytes=None):
        src = _Operand(buf, writable=out is None)
        dst = src if out is None else _Operand(out, writable=True, name=name_out)
        if out is not None and dst.array.dtype != src.array.dtype:
            raise UsageError(f"{name_out} has dtype {dst.array.dtype}, input has {src.array.dtype}")
        expected = src.bytes.nbytes if out_nbytes is None else out_nbytes
        if dst.bytes.nbytes != expected:
            raise UsageError(f"{name_out} has {dst.bytes.nbytes} bytes, expected {expected}")
        return src, dst

    def _finish_avg(self, view, code, op):
        if op == "avg":
            _reduce.divide(view.view(_CODE_DTYPES[code]) if code != 7 else view.view(np.uint16), self.size,
                           dtype="bfloat16" if code == 7 else None)

    # ---- collectives --------------------------------------------------------------------------

    def allreduce(self, buf, out=None, op="sum", algorithm="auto"):
        """Element-wise reduction of ``buf`` over all ranks, into ``out`` (default: in place)."""
        if _is_cuda(buf):
            from pyrdma.cuda import staged_allreduce
            return staged_allreduce(self, buf, op)
        return self.iallreduce(buf, out, op, algorithm).wait()

    def iallreduce(self, buf, out=None, op="sum", algorithm="auto"):
        if op not in OPS:
            raise UsageError(f"unsupported op {op!r}; supported: {', '.join(OPS)}")
        if algorithm not in ALGORITHMS:
            raise UsageError(f"unknown algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}")
        src, dst = self._prepare(buf, out)
        return self._submit(self._allreduce, src, dst, op, algorithm)

    def _allreduce(self, src, dst, op, algorithm):
        t = self.transport
        nbytes = src.bytes.nbytes
        count = nbytes // src.itemsize
        work = t.work(nbytes)
        work[:] = src.bytes
        if algorithm == "auto":
            algorithm = self.cost_model.choose(nbytes, self.size, t.max_message)
        run = algorithms.ring_allreduce if algorithm == "ring" else algorithms.tree_allreduce
        run(t, work, count, src.itemsize, self._reducer(src.code, op))
        self._finish_avg(work, src.code, op)
        dst.bytes[:] = work
        return dst.array

    def reduce(self, buf, out=None, op="sum", root=0):
        """Reduction of ``buf`` over all ranks, delivered on ``root`` only (into out, default in place)."""
        return self.ireduce(buf, out, op, root).wait()

    def ireduce(self, buf, out=None, op="sum", root=0):
        self._check_root(root)
        if op not in OPS:
            raise UsageError(f"unsupported op {op!r}; supported: {', '.join(OPS)}")
        src, dst = self._prepare(buf, out)
        return self._submit(self._reduce_to_root, src, dst, op, root)

    def _reduce_to_root(self, src, dst, op, root):
        work = self.transport.work(src.bytes.nbytes)
        work[:] = src.bytes
        algorithms.chain_reduce(self.transport, work, src.itemsize, self._reducer(src.code, op), root)
        if self.rank == root:
            self._finish_avg(work, src.code, op)
            dst.bytes[:] = work
        return dst.array

    def broadcast(self, buf, root=0):
        """Copy ``buf`` of ``root`` into ``buf`` of every rank."""
        return self.ibroadcast(buf, root).wait()

    def ibroadcast(self, buf, root=0):
        self._check_root(root)
        src = _Operand(buf, writable=True)
        return self._submit(self._broadcast, src, root)

    def _broadcast(self, src, root):
        work = self.transport.work(src.bytes.nbytes)
        if self.rank == root:
            work[:] = src.bytes
        algorithms.chain_broadcast(self.transport, work, src.itemsize, root)
        if self.rank != root:
            src.bytes[:] = work
        return src.array

    def allgather(self, buf, out=None):
        """Concatenate every rank's ``buf`` (equal sizes) in rank order into ``out`` (size * len(buf))."""
        return self.iallgather(buf, out).wait()

    def iallgather(self, buf, out=None):
        src = _Operand(buf, writable=False)
        if out is None:
            out = np.empty(src.array.size * self.size, src.array.dtype)
        dst = _Operand(out, writable=True, name="out")
        if dst.array.dtype != src.array.dtype or dst.bytes.nbytes != src.bytes.nbytes * self.size:
            raise UsageError(f"out must hold {self.size} x {src.array.size} {src.array.dtype} elements")
        return self._submit(self._allgather, src, dst)

    def _allgather(self, src, dst):
        block = src.bytes.nbytes
        work = self.transport.work(block * self.size)
        work[self.rank * block:(self.rank + 1) * block] = src.bytes
        algorithms.ring_allgather(self.transport, work, src.array.size * self.size, src.itemsize)
        dst.bytes[:] = work
        return dst.array

    def reduce_scatter(self, buf, out=None, op="sum"):
        """Reduce ``buf`` over all ranks; rank i receives the i-th of ``size`` near-equal segments
        (the first ``len(buf) % size`` ... see ``segment_bounds``)."""
        return self.ireduce_scatter(buf, out, op).wait()

    def segment_bounds(self, count):
        """Element range [start, stop) of each rank's segment of a ``count``-element reduce_scatter."""
        b = algorithms._bounds(count, self.size)
        return [(b[i], b[i + 1]) for i in range(self.size)]

    def ireduce_scatter(self, buf, out=None, op="sum"):
        if op not in OPS:
            raise UsageError(f"unsupported op {op!r}; supported: {', '.join(OPS)}")
        src = _Operand(buf, writable=False)
        start, stop = self.segment_bounds(src.array.size)[self.rank]
        if out is None:
            out = np.empty(stop - start, src.array.dtype)
        dst = _Operand(out, writable=True, name="out")
        if dst.array.dtype != src.array.dtype or dst.array.size != stop - start:
            raise UsageError(f"out must hold {stop - start} {src.array.dtype} elements (this rank's segment)")
        return self._submit(self._reduce_scatter, src, dst, op, start, stop)

    def _reduce_scatter(self, src, dst, op, start, stop):
        work = self.transport.work(src.bytes.nbytes)
        work[:] = src.bytes
        algorithms.ring_reduce_scatter(self.transport, work, src.array.size, src.itemsize,
                                       self._reducer(src.code, op))
        mine = work[start * src.itemsize:stop * src.itemsize]
        self._finish_avg(mine, src.code, op)
        dst.bytes[:] = mine
        return dst.array

    def barrier(self):
        """Return only when every rank has entered the barrier."""
        self.ibarrier().wait()

    def ibarrier(self):
        token = _Operand(np.zeros(1, np.uint8), writable=True)
        return self._submit(self._allreduce, token, token, "max", "tree")

    def _check_root(self, root):
        if not 0 <= root < self.size:
            raise UsageError(f"root {root} outside 0..{self.size - 1}")


_CODE_DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.int64, 4: np.float16, 5: np.float32, 6: np.float64}


def init_from_env(**kwargs):
    """A Communicator from torchrun-style environment variables."""
    return Communicator.from_env(**kwargs)
