"""Communicator: the public face of the collectives.

    comm = Communicator(rank, size, "host:port")          # or Communicator.from_env() / .from_mpi()
    comm.allreduce(x)                                      # in place, op="sum"
    y = comm.allreduce(x, out=np.empty_like(x), op="max")  # out of place
    h = comm.iallreduce(x); ...; h.wait(timeout=5)         # non-blocking

Collectives: allreduce, reduce (to root), broadcast (from root), allgather, reduce_scatter, gather
(to root), scatter (from root), alltoall (equal or uneven counts), barrier, and point-to-point send,
recv, sendrecv, each with a non-blocking ``i*`` form returning a Handle, and batch() for a group of
sends and receives. Each is one spec (pyrdma.collectives.specs: its runs of the engine, each a
schedule, a description, a work area, what to copy in and out) run by one path (_call, _run_spec);
a warm blocking call of host memory is one C call instead, over either link (pyrdma._hostcalls runs
the same spec there, prepared once per shape by pyrdma.collectives.hostplans). Ops: sum, prod, min, max, avg
(floating-point avg scales every input by 1/n before the sum, as NCCL, so a mean near the
largest finite value does not overflow as the sum would; integer avg is the sum, which wraps
around on overflow as C does, divided by n and truncated toward zero, as NCCL). Dtypes: int8,
uint8, int32, int64, float16, float32, float64, bfloat16 (ml_dtypes.bfloat16 arrays, or
``dtype="bfloat16"`` with uint16 arrays holding the bits). Buffers: numpy arrays, anything with
the buffer protocol, CPU DLPack tensors; C-contiguous, of any element count (also fewer elements
than ranks). CUDA arrays (CuPy, DLPack CUDA tensors such as torch's, bfloat16 ones too) go to
pyrdma.cuda.collectives for their work areas: the blocking allreduce and broadcast in place in GPU
memory with CUDA-kernel reductions (``gpu_path="direct"``), or else staged through pinned host
memory, blocking or not: allreduce, reduce and broadcast pipelined chunk by chunk
(cuda.collectives.StagedPipeline, running this Communicator's host call on each chunk), allgather,
reduce_scatter and equal all-to-all piece by piece (cuda.collectives.StagedBlocks, each piece a host
call of the collective on a sub-block of every rank's block), every other call whole
(cuda.collectives.StagedCall), in either case copied down and up when the call's turn
comes (after the caller's stream, which the call does not wait for), only what the call reads
down and only what it writes up.

How it runs: the input is copied into the transport's registered work buffer (registered once,
reused; grown when needed), the algorithm runs there, the result is copied out. One collective
runs at a time per communicator, in the order they were called (all ranks must call the same
collectives in the same order, as with MPI and NCCL). Non-blocking collectives run on one
background thread per communicator; the C reductions and the RDMA completion polling release the
GIL. Every wait has a timeout (``timeout``, seconds): a rank that died or stalls raises PeerError
naming it instead of hanging, and the other ranks are told (an abort message) so that they fail
fast too. Arguments that differ across ranks (sizes, dtypes, ops, roots, algorithms) are detected:
every message carries the full description of its collective, which the receiver compares with its
own, and raise UsageError on every rank. After any such failure the communicator is unusable: close
it and build a new one. ``close()`` may come from any thread: a collective blocked in another one
raises UsageError within a fraction of a second, as Ctrl-C raises KeyboardInterrupt.
"""
import functools
import operator
import os
import threading

import numpy as np

from pyrdma._hostcalls import (communicator_allgather, communicator_allreduce, communicator_alltoall,
                               communicator_barrier, communicator_broadcast, communicator_gather, communicator_recv,
                               communicator_reduce, communicator_reduce_scatter, communicator_scatter,
                               communicator_send, host_key)
from pyrdma.collectives import specs
from pyrdma.collectives.bootstrap import MPIExchange, StoreExchange, TCPStore, check_rank, env_config, parse_address
from pyrdma.collectives.costmodel import CostModel
from pyrdma.collectives.executor import (Done, Executor, Handle, PairHandle,  # noqa: F401 - Handle: the package's name
                                         SendHandle)
from pyrdma.collectives.pieces import segment_bounds
from pyrdma.collectives.schedule import consumer
from pyrdma.collectives.transport import NO_ROOT
from pyrdma.collectives.specs import ALGORITHMS, OPS, check_op  # noqa: F401 - ALGORITHMS, OPS: the package's names
from pyrdma.buffers import is_cuda_array
from pyrdma.errors import UsageError, WireFormatError

TRANSPORTS = ("auto", "rdma", "tcp")
GPU_PATHS = ("auto", "staged", "direct")
_NO_DTYPE = object()        # _call of a call that does not reduce
DEFAULT_MAX_WORK_BYTES = 64 << 20
DEFAULT_ZERO_COPY_BYTES = 1 << 20     # below this a copy costs less than looking up a registration
_SETUP_MAGIC = b"PYRDMA-COLL/1 "
_PAIRED = (specs.allreduce, specs.reduce, specs.allgather, specs.reduce_scatter)   # buf, out: both CUDA or both host
_SHAPED = (specs.allreduce, specs.reduce, specs.broadcast)     # CUDA arrays pipelined chunk by chunk
_BLOCKWISE = (specs.allgather, specs.reduce_scatter, specs.alltoall)     # and piece by piece
_DIRECT = (specs.allreduce, specs.broadcast)        # blocking: in GPU memory where every rank can


def _roles(read, written, *rest):
    """The roles (pyrdma.cuda.collectives.StagedCall) of a call's buf, out and other arguments:
    ``read``/``written`` say whether this rank reads buf and writes out."""
    return ["in" if read else "", "out" if written else "", *[""] * len(rest)]


# what a call staged whole reads and writes of each argument (buf, out, ...), by spec (allgather and
# reduce_scatter go piece by piece, as an all-to-all does unless its counts differ or only one of
# buf and out is a CUDA array)
_ROLES = {
    specs.alltoall: lambda comm, buf, out, *rest: _roles(True, True, *rest),
    specs.gather: lambda comm, buf, out, root, *rest: _roles(True, root == comm.rank, root, *rest),
    specs.scatter: lambda comm, buf, out, root, *rest: _roles(root == comm.rank, True, root, *rest),
    # a receive may fill less than its buffer: the rest must come back up as it was
    specs.p2p: lambda comm, buf, dst, src, tag: [("in", "inout") if isinstance(buf, tuple) else
                                                 "in" if dst is not None else "inout", "", "", ""],
}


_BUFFER = operator.itemgetter(1)      # an op's buffer (Communicator.batch)


def _is_cuda(*objs):
    """Whether any of ``objs`` (None ignored) is a CUDA array (no CuPy imported to tell)."""
    for o in objs:
        if o is not None and not isinstance(o, np.ndarray) and is_cuda_array(o):
            return True
    return False


def _cuda():
    """pyrdma.cuda.collectives, imported when a CUDA array first comes (it imports CuPy lazily too)."""
    from pyrdma.cuda import collectives
    return collectives

def _env_int(environ, name, value, minimum):
    if value is not None:
        return value
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        number = int(text, 0)
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise UsageError(f"{name}={text!r} is not an integer >= {minimum}")
    return number


def ib_config(device=None, port=None, gid_index=None, environ=None):
    """(device, port, gid_index) of the RDMA transport: the arguments, else NCCL-style environment
    variables PYRDMA_IB_HCA (a device name, or "name:port"), PYRDMA_IB_PORT and
    PYRDMA_IB_GID_INDEX, else (first active device, port 1, the best GID of the port)."""
    environ = os.environ if environ is None else environ
    if device is None:
        hca = environ.get("PYRDMA_IB_HCA", "").strip()
        if hca:
            name, _, hca_port = hca.partition(":")
            device = name or None
            if hca_port and port is None:
                port = _env_int({"PYRDMA_IB_HCA": hca_port}, "PYRDMA_IB_HCA", None, 1)
    port = _env_int(environ, "PYRDMA_IB_PORT", port, 1)
    gid_index = _env_int(environ, "PYRDMA_IB_GID_INDEX", gid_index, 0)
    for name, value, low in (("port", port, 1), ("gid_index", gid_index, 0)):
        if value is not None and (not isinstance(value, (int, np.integer)) or isinstance(value, bool)
                                  or value < low):
            raise UsageError(f"{name} must be an integer >= {low}, got {value!r}")
    return device, (1 if port is None else int(port)), (None if gid_index is None else int(gid_index))


def rdma_available(device=None):
    """Whether an RDMA device with an ACTIVE port can be opened here."""
    try:
        import pyrdma
        with pyrdma.Context(device):
            return True
    except Exception:
        return False


def _prepared_under(name):
    """A Communicator setting that the one-call path's prepared calls depend on (cost_model,
    max_work_bytes, zero_copy_bytes): setting it drops them (HostCollectives.forget), so no call
    has to compare the settings it was prepared under."""
    attr = "_" + name

    def set_it(self, value):
        self.__dict__[attr] = value
        host = self.__dict__.get("_host")
        if host is not None:
            host.forget()
    return property(operator.attrgetter(attr), set_it)


class Communicator:
    """A group of ``size`` processes that run collectives together.

    Ways in: ``Communicator(rank, size, "host:port")`` (rank 0 serves the rendezvous on that
    port), ``Communicator.from_env()`` (torchrun: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE),
    ``Communicator.from_mpi(mpi4py_comm)``, or ``Communicator(exchange=...)`` with any object that
    has ``rank``, ``size`` and ``allgather(bytes) -> list[bytes]``.

    ``transport``: "rdma" (one RC QP per peer), "tcp" (sockets), or "auto" (rdma when every rank has
    an RDMA device, else tcp). ``timeout``: seconds any wait may take before the peer is declared
    dead. ``max_message``: bytes per message (the pipelining chunk; RDMA slot size; default 1 MiB
    over both transports); ``slots``: receive slots per peer (RDMA; default 8, so 8 MiB registered
    per peer); ``qp_timeout``: the RC QPs' ACK timeout, 4.096 us * 2^qp_timeout before a resend
    (RDMA; default 20, about 4 s, as NCCL_IB_TIMEOUT). ``cost_model``: a CostModel choosing
    algorithms for ``algorithm="auto"``. ``max_work_bytes``: allreduce, reduce and broadcast of
    larger buffers run in pieces of this size, bounding the registered work buffer.
    ``zero_copy_bytes``: allreduce, broadcast and allgather (with ``out`` given) of at least this
    many bytes work in place on the result's own memory instead of copying it into and out of the
    transport's buffer; over RDMA that memory is registered on first use and kept registered, and
    alive, among the transport's USER_MR_CACHE most recent buffers (0 turns this off). All-to-all,
    gather and scatter likewise, on a software RDMA device and TCP from the cost model's lend_bytes on. Over
    RDMA a point-to-point message of that size or more goes by rendezvous: the sender writes it
    straight into the receiver's buffer (the size given here; ``transport.rendezvous_bytes`` changes
    it later). ``gpu_path``: how allreduce and broadcast move CUDA arrays: "direct" (the transport
    sends straight from GPU memory, over RDMA registered by GPUDirect; reductions run as CUDA
    kernels), "staged" (through pinned host memory, reductions on the CPU), or "auto" (direct when
    every rank's RDMA device and GPU can do GPUDirect RDMA, agreed on at the first CUDA collective;
    else staged). ``device``,
    ``port``, ``gid_index``: the RDMA device, port and GID the QPs use (default: NCCL-style
    environment variables PYRDMA_IB_HCA, a name or "name:port", PYRDMA_IB_PORT, PYRDMA_IB_GID_INDEX;
    else the first active device, port 1, the port's best GID).

    ``op="avg"``: floating-point inputs are divided by ``size`` (rounded once to their dtype; float16
    toward zero) before they are summed, as NCCL does, so a mean near the largest finite value does
    not overflow as their sum would (pyrdma.avg.scale_down has the fine print). Integer avg is the sum,
    which wraps around on overflow as C does, divided by ``size`` and truncated toward zero (-7 over
    2 ranks gives -3), as NCCL.
    ``out`` may be the very same memory as ``buf`` (in place) or memory apart from it; partial
    overlap raises UsageError.
    """

    def __init__(self, rank=None, size=None, master=None, *, transport="auto", timeout=60.0, exchange=None,
                 device=None, max_message=None, slots=None, cost_model=None, tcp_host=None,
                 max_work_bytes=DEFAULT_MAX_WORK_BYTES, spin=None, slot_bytes=None,
                 zero_copy_bytes=DEFAULT_ZERO_COPY_BYTES, gpu_path="auto", qp_timeout=None, port=None,
                 gid_index=None):
        if transport not in TRANSPORTS:
            raise UsageError(f"unknown transport {transport!r}; use one of {', '.join(TRANSPORTS)}")
        if not isinstance(timeout, (int, float)) or not timeout > 0:     # NaN too: no deadline would pass
            raise UsageError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if exchange is not None:
            rank = exchange.rank if rank is None else rank
            size = exchange.size if size is None else size
            if (rank, size) != (exchange.rank, exchange.size):
                raise UsageError(f"rank/size {rank}/{size} differ from the exchange's {exchange.rank}/{exchange.size}")
        check_rank(rank, size)
        device, port, gid_index = ib_config(device, port, gid_index)
        if slot_bytes is not None:       # the older name of max_message
            max_message = slot_bytes if max_message is None else max_message
        self.rank, self.size, self.timeout = rank, size, float(timeout)
        self.max_work_bytes = int(max_work_bytes)
        if self.max_work_bytes < 64:      # (one element per piece would run, at one collective per element)
            raise UsageError(f"max_work_bytes must be at least 64, got {max_work_bytes!r}")
        self.zero_copy_bytes = int(zero_copy_bytes) if zero_copy_bytes else 0
        if gpu_path not in GPU_PATHS:
            raise UsageError(f"unknown gpu_path {gpu_path!r}; use one of {', '.join(GPU_PATHS)}")
        self.gpu_path = gpu_path
        self._gpudirect_agreed = {}      # GPU ordinal -> whether every rank can do GPUDirect RDMA
        own_exchange = exchange is None
        if exchange is None:
            if master is None:
                raise UsageError("give master='host:port' of rank 0, or use Communicator.from_env() / from_mpi()")
            master_host, master_port = parse_address(master)
            exchange = TCPStore(master_host, master_port, rank, size, timeout)
        try:
            chosen = self._agree_on_transport(exchange, transport, device)
            kwargs = {}
            if max_message is not None:
                kwargs["max_message"] = max_message
            if slots is not None:
                kwargs["slots"] = slots
            if spin is not None:
                kwargs["spin"] = spin
            if chosen == "rdma":
                from pyrdma.collectives.transport import RdmaTransport
                if qp_timeout is not None:
                    kwargs["qp_timeout"] = qp_timeout
                self.transport = RdmaTransport(rank, size, exchange, self.timeout, device, port=port,
                                               gid_index=gid_index, rendezvous_bytes=self.zero_copy_bytes, **kwargs)
            else:
                from pyrdma.collectives.transport import TcpTransport
                self.transport = TcpTransport(rank, size, exchange, self.timeout, host=tcp_host, **kwargs)
        finally:
            if own_exchange:
                exchange.close()
        self.transport_name = chosen
        self.cost_model = cost_model or CostModel(transport=chosen, software=self.transport.software)
        self._host = None
        if size > 1:
            # blocking host allreduces, all-to-alls and barriers are one C call each, which takes
            # the executor's lock without a Python call
            from pyrdma._hostcalls import ExecLock, HostCollectives
            from pyrdma.collectives import hostplans
            self._exec = Executor(rank, size, self.transport, ExecLock())
            self._host = HostCollectives(self.transport.engine, self._exec, self, self.transport, hostplans)
        else:
            self._exec = Executor(rank, size, self.transport, threading.RLock())

    def _agree_on_transport(self, exchange, transport, device):
        """Every rank says what it wants (and, for auto, whether it can do RDMA); all must agree."""
        mine = transport
        if transport == "auto":
            mine = "auto-rdma" if rdma_available(device) else "auto-tcp"
        records = exchange.allgather(_SETUP_MAGIC + mine.encode())
        wants = []
        for r, rec in enumerate(records):
            if not rec.startswith(_SETUP_MAGIC):
                raise WireFormatError(f"rank {r} sent a foreign setup record {rec[:32]!r}")
            wants.append(rec[len(_SETUP_MAGIC):].decode(errors="replace"))
        explicit = {w for w in wants if not w.startswith("auto-")}
        if len(explicit) > 1:
            raise UsageError("the ranks asked for different transports: " +
                             ", ".join(f"rank {r}: {w}" for r, w in enumerate(wants)))
        if explicit:
            chosen = explicit.pop()
            if chosen == "rdma":
                lacking = [r for r, w in enumerate(wants) if w == "auto-tcp"]
                if lacking:
                    raise UsageError(f"transport 'rdma' was asked for, but ranks {lacking} have no RDMA device")
            return chosen
        return "rdma" if all(w == "auto-rdma" for w in wants) else "tcp"

    cost_model = _prepared_under("cost_model")
    max_work_bytes = _prepared_under("max_work_bytes")
    zero_copy_bytes = _prepared_under("zero_copy_bytes")

    @classmethod
    def from_env(cls, environ=None, **kwargs):
        """From torchrun-style MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE. Under torchrun itself
        (TORCHELASTIC_RUN_ID set) its agent already serves a c10d store on MASTER_PORT, so the
        ranks join that one (through torch, as the torch backend does); elsewhere rank 0 serves
        the rendezvous there."""
        environ = os.environ if environ is None else environ
        host, port, rank, size = env_config(environ)
        if environ.get("TORCHELASTIC_RUN_ID"):
            import datetime
            from torch.distributed import TCPStore as C10dStore
            wait = datetime.timedelta(seconds=kwargs.get("timeout", 60.0))
            store = C10dStore(host, port, size, is_master=False, timeout=wait)
            return cls(exchange=StoreExchange(store, rank, size, wait, environ), **kwargs)
        return cls(rank, size, f"{host}:{port}", **kwargs)

    @classmethod
    def from_mpi(cls, mpi_comm=None, **kwargs):
        """From an mpi4py communicator (default MPI.COMM_WORLD): rendezvous by MPI allgather."""
        if mpi_comm is None:
            from mpi4py import MPI
            mpi_comm = MPI.COMM_WORLD
        exchange = MPIExchange(mpi_comm, kwargs.get("timeout", 60.0))
        return cls(exchange=exchange, **kwargs)

    def close(self):
        """Release the transport. Idempotent; any thread may call it. A collective still running or
        queued then (blocked in another thread, or non-blocking) raises UsageError ("closed") at its
        next wait, within a fraction of a second: wait on handles first to let them finish. The
        transport is released only once no collective uses it any more."""
        self._exec.close(self.timeout + 5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self._exec.closed else ("broken" if self._exec.broken else "open")
        return f"<Communicator rank {self.rank} of {self.size} over {self.transport_name} ({state})>"

    def segment_bounds(self, count):
        """[(start, stop)] element range of each rank's part of a ``count``-element reduce_scatter:
        near-equal, the first ``count % size`` ranks get one element more."""
        b = segment_bounds(count, self.size)
        return [(b[i], b[i + 1]) for i in range(self.size)]

    # ---- the collectives: each runs its spec (pyrdma.collectives.specs) by the one path, _call ----
    # The blocking ones are C functions (pyrdma._hostcalls'; their docstrings say what they do): a
    # warm call of host memory is one C call, without a Python frame of the method's own; elsewhere
    # they run _call(spec, ...) as the non-blocking forms below do.
    allreduce = communicator_allreduce
    reduce = communicator_reduce
    broadcast = communicator_broadcast
    allgather = communicator_allgather
    reduce_scatter = communicator_reduce_scatter
    barrier = communicator_barrier
    gather = communicator_gather
    scatter = communicator_scatter
    alltoall = communicator_alltoall

    def _queued(self, name, *args):
        """The Handle of the one-call path's ``name`` (a HostCollectives method) queued with
        ``args`` (HostCollectives.submit: one C call on the communicator's thread), or None where
        the general path must run the call."""
        host = self._host
        return None if host is None else host.submit(getattr(host, name), *args)

    def iallreduce(self, buf, out=None, op="sum", algorithm="auto", dtype=None):
        """Non-blocking allreduce: returns a Handle; don't touch ``buf``/``out`` until it is done.
        (Each non-blocking collective of host memory that the one-call path takes runs as one C
        call on the communicator's thread: _queued.)"""
        key = host_key(op, dtype) if out is None else None
        handle = self._queued("allreduce", buf, key, algorithm) if key is not None else None
        if handle is not None:
            return handle
        return self._call(specs.allreduce, buf, out, op, algorithm, blocking=False, dtype=dtype)

    def ireduce(self, buf, out=None, op="sum", root=0, algorithm="auto", dtype=None):
        key = host_key(op, dtype) if out is None else None
        handle = self._queued("reduce", buf, key, root, algorithm) if key is not None else None
        if handle is not None:
            return handle
        return self._call(specs.reduce, buf, out, op, root, algorithm, blocking=False, dtype=dtype)

    def ibroadcast(self, buf, root=0, algorithm="auto"):
        handle = self._queued("broadcast", buf, root, algorithm)
        if handle is not None:
            return handle
        return self._call(specs.broadcast, buf, root, algorithm, blocking=False)

    def iallgather(self, buf, out=None):
        handle = self._queued("allgather", buf, out)
        if handle is not None:
            return handle
        return self._call(specs.allgather, buf, out, blocking=False)

    def ireduce_scatter(self, buf, out=None, op="sum", dtype=None):
        key = host_key(op, dtype)
        handle = self._queued("reduce_scatter", buf, out, key) if key is not None else None
        if handle is not None:
            return handle
        return self._call(specs.reduce_scatter, buf, out, op, blocking=False, dtype=dtype)

    def ibarrier(self):
        handle = self._queued("barrier")
        if handle is not None:
            return handle
        return self._call(specs.barrier, blocking=False)

    def igather(self, buf, out=None, root=0, algorithm="auto"):
        handle = self._queued("gather", buf, out, root, algorithm)
        if handle is not None:
            return handle
        return self._call(specs.gather, buf, out, root, algorithm, blocking=False)

    def _joined(self, pieces):
        """A scatter root's list of pieces as one array, for the one-call path, where the general path
        would copy them in anyway (below the size from which each is sent from where it lies); else the
        list itself (also a list the general path refuses, whose error it names). Not from that size
        even where another algorithm than direct copies them in: the joined array is new at every call,
        and the one-call path would lend (register) it, where the general path copies into the
        transport's own registered buffer."""
        first = pieces[0] if len(pieces) == self.size else None
        if type(first) is not np.ndarray or specs.lends_blocks(self, first.nbytes):
            return pieces
        for p in pieces:
            if type(p) is not np.ndarray or p.dtype != first.dtype or p.shape != first.shape:
                return pieces
        return np.concatenate(pieces)

    def iscatter(self, buf, out=None, root=0, algorithm="auto"):
        full = self._joined(buf) if type(buf) is list and root == self.rank and self._host is not None else buf
        handle = self._queued("scatter", full, out, root, algorithm)
        if handle is not None:
            return handle
        return self._call(specs.scatter, buf, out, root, algorithm, blocking=False)

    def ialltoall(self, buf, out=None, send_counts=None, recv_counts=None):
        handle = self._queued("alltoall", buf, out) if send_counts is None and recv_counts is None \
            else self._queued("alltoallv", buf, out, send_counts, recv_counts)
        if handle is not None:
            return handle
        return self._call(specs.alltoall, buf, out, send_counts, recv_counts, blocking=False)

    # send(buf, dst, tag=0) and recv(buf, src, tag=0) are C functions (pyrdma._hostcalls'; their
    # docstrings say what they do): a warm blocking message of host memory over RDMA is one C call,
    # without a Python frame of the method's own; elsewhere they run _call(_p2p, ...) as isend does
    send = communicator_send
    recv = communicator_recv

    def isend(self, buf, dst, tag=0):
        """Non-blocking send. Over RDMA a message of ``zero_copy_bytes`` or more goes on without
        holding up the calls after it: they run while it waits for its receive (SendHandle)."""
        if _is_cuda(buf):
            return self._call(specs.p2p, buf, dst, None, tag, blocking=False)
        handle = self._queued("message", buf, dst, tag, False)
        if handle is not None:
            return handle
        spec = specs.p2p(self, buf, dst, None, tag)
        t = self.transport

        def job():
            self._run_spec(spec, park=True)
            return None, [t.parked_ticket] if t.parked_ticket else []
        return SendHandle(self._exec.submit(False, job, seq=False), self._exec, t)

    def irecv(self, buf, src, tag=0):
        handle = self._queued("message", buf, src, tag, True)
        if handle is not None:
            return handle
        return self._call(specs.p2p, buf, None, src, tag, blocking=False)

    def sendrecv(self, sendbuf, dst, recvbuf, src, tag=0):
        """send(sendbuf, dst) and recv(recvbuf, src) at once (the exchange of a ring or of a pair:
        neither waits for the other, whatever the sizes). Returns the elements received."""
        if self._host is not None and type(dst) is int and type(src) is int:
            done = self._host.exchange(sendbuf, dst, recvbuf, src, tag, tag)
            if done is not None:
                return done[0]
        return self._call(specs.p2p, (sendbuf, recvbuf), dst, src, tag, blocking=True)

    def isendrecv(self, sendbuf, dst, recvbuf, src, tag=0):
        handle = self._queued("exchange", sendbuf, dst, recvbuf, src, tag, tag)
        if handle is not None:
            return handle
        return self._call(specs.p2p, (sendbuf, recvbuf), dst, src, tag, blocking=False)

    def batch(self, ops):
        """Run a group of point-to-point operations at once, as NCCL's ncclGroupStart/End and
        torch's batch_isend_irecv: ``ops`` is a list of ("send", buf, peer[, tag]) and ("recv", buf,
        peer[, tag]). Calls run in the order they were made, so on every rank a receive posted
        before its send waits for it; in a batch nothing waits for another operation of the same
        batch. Every pair of ranks' messages still keeps its order. Returns a Handle whose wait()
        gives one entry per op: None for a send, the elements received for a receive."""
        return self._batch(ops, False)

    def _batch(self, ops, blocking):
        """batch(ops); ``blocking``: run on this thread where nothing is queued (the Handle is
        then done, but for a parked send's wait)."""
        n, r = self.size, self.rank
        sends, recvs = {}, {}
        ops = list(ops)
        if len(ops) == 2 and self._host is not None:
            done = self._exchange(ops, blocking)
            if done is not None:
                return done
        for i, op in enumerate(ops):
            if not isinstance(op, (tuple, list)) or len(op) not in (3, 4) or op[0] not in ("send", "recv"):
                raise UsageError(f"batch: op {i} must be ('send'|'recv', buf, peer[, tag]), got {op!r}")
        staged = None
        if _is_cuda(*map(_BUFFER, ops)):
            staged = _cuda().StagedCall("batch", [op[1] for op in ops],
                                        ["in" if op[0] == "send" else "inout" for op in ops])
            ops = [(op[0], h, *op[2:]) for op, h in zip(ops, staged.host_args)]
        for i, op in enumerate(ops):
            peer = op[2]
            if not isinstance(peer, (int, np.integer)) or not 0 <= peer < n or peer == r:
                raise UsageError(f"batch: op {i} names rank {peer!r}, not another rank of this communicator")
            (sends if op[0] == "send" else recvs).setdefault(int(peer), []).append((i, op[3] if len(op) > 3 else 0))
        # pairwise order: at step k the j-th send to rank r+k goes with the j-th receive from
        # rank r-k; every rank steps through k alike, so no step waits on one of a later step
        pairings = []           # (send (op index, tag) or None, its rank, receive or None, its rank)
        for k in range(1, n):
            out, inc = sends.get((r + k) % n, []), recvs.get((r - k) % n, [])
            for j in range(max(len(out), len(inc))):
                pairings.append((out[j] if j < len(out) else None, (r + k) % n,
                                 inc[j] if j < len(inc) else None, (r - k) % n))
        results = [None] * len(ops)
        # planning numbers the messages (as collecting does): one that fails its checks leaves the
        # numbers as they were
        sent, received = list(self._exec.sent), list(self._exec.received)
        collected = []          # a non-blocking batch's first steps as one-call runs, and their receives
        if staged is None and self._host is not None:
            first = self._one_call_steps(pairings, results, ops, None if blocking else collected)
            if blocking:
                if first == len(pairings):
                    return Done(results)
                sent, received = list(self._exec.sent), list(self._exec.received)
            pairings = pairings[first:]
        steps = []
        try:
            for s, dst, v, src in pairings:
                buf = (ops[s[0]][1], ops[v[0]][1]) if s and v else ops[(s or v)[0]][1]
                tag = (s[1], v[1]) if s and v else (s or v)[1]
                spec = specs.p2p(self, buf, dst if s else None, src if v else None, tag)
                steps.append(tuple((x[0], spec) for x in (s, v) if x is not None))
        except BaseException:
            self._exec.sent[:], self._exec.received[:] = sent, received
            raise
        t = self.transport

        def run():
            if staged is not None:
                staged.download()
            for step, received_at in collected:
                got = step()
                if received_at is not None:
                    results[received_at] = got
            tickets = []
            for step in steps:
                # each step one run: its own descriptions; a lone send may park (SendHandle)
                lone_send = len(step) == 1 and ops[step[0][0]][0] == "send" and staged is None
                got = self._run_spec(step[0][1], park=lone_send)
                if lone_send and t.parked_ticket:
                    tickets.append(t.parked_ticket)
                for i, _ in step:
                    if ops[i][0] == "recv":
                        results[i] = got
            return (results if staged is None else staged.upload(results)), tickets
        return SendHandle(self._exec.submit(blocking, run, seq=False), self._exec, t)

    def _one_call_steps(self, pairings, results, ops, collect=None):
        """Run the steps of a blocking batch (``pairings``, as _batch makes them) one C call each
        (HostCollectives.exchange, or message for a lone send or receive) while the one-call path
        takes them, the received counts into ``results``; the number of steps it ran (the general
        path runs the rest, in order after them). Only for numpy arrays of host memory that the
        general path would take as they are, and valid tags, so that no step after the first can
        fail its checks (bad input is refused before anything is sent). ``collect``, a list: a
        non-blocking batch's, whose steps are appended to it (HostCollectives.collect: the run,
        and the op index of its receive or None) for the batch's job to run instead."""
        for op in ops:
            buf, tag = op[1], op[3] if len(op) > 3 else 0
            if type(buf) is not np.ndarray or not buf.flags.c_contiguous or \
                    (op[0] == "recv" and not buf.flags.writeable) or type(tag) is not int or not 0 <= tag < NO_ROOT:
                return 0
        host = self._host
        for done, (s, dst, v, src) in enumerate(pairings):
            if s and v:
                how = (host.exchange, ops[s[0]][1], dst, ops[v[0]][1], src, s[1], v[1])
            elif s:
                how = (host.message, ops[s[0]][1], dst, s[1], False)
            else:
                how = (host.message, ops[v[0]][1], src, v[1], True)
            if collect is not None:
                got = host.collect(*how)
                if got is None:
                    return done
                collect.append((got, v[0] if v else None))
                continue
            got = how[0](*how[1:])
            if got is None:
                return done
            if v:
                results[v[0]] = got[0] if s else got
        return len(pairings)

    def _exchange(self, ops, blocking):
        """The Done (``blocking``) or PairHandle of a batch of one send and one receive as the
        one-call path's exchange (both at once: in a batch neither waits for the other, whichever
        steps the general path would give them); None where the general path must run it."""
        if not all(isinstance(op, (tuple, list)) and len(op) in (3, 4) for op in ops):
            return None
        (k0, b0, p0, *t0), (k1, b1, p1, *t1) = ops
        if not isinstance(k0, str) or not isinstance(k1, str) or {k0, k1} != {"send", "recv"}:
            return None
        if k0 == "recv":
            (b0, p0, t0), (b1, p1, t1) = (b1, p1, t1), (b0, p0, t0)
        if type(p0) is not int or type(p1) is not int:
            return None
        args = (b0, p0, b1, p1, t0[0] if t0 else 0, t1[0] if t1 else 0)
        if not blocking:
            handle = self._host.submit(self._host.exchange, *args)
            return None if handle is None else PairHandle(handle, k0 == "send")
        done = self._host.exchange(*args)
        if done is None:
            return None
        return Done([None, done[0]] if k0 == "send" else [done[0], None])

    def _call(self, make_spec, *args, blocking, dtype=_NO_DTYPE):
        """The one call path: validate and plan (``make_spec``, on the caller's thread), then run
        the spec in order with the other collectives (inline, or on the communicator's thread).
        ``dtype``: the reduction dtype of a reducing call (the spec's last argument). CUDA arrays
        are worked on in GPU memory (_direct_job: a blocking allreduce or broadcast where every
        rank can) or staged through pinned host memory (_staged_job)."""
        if dtype is not _NO_DTYPE:
            args += (dtype,)
        if _is_cuda(*(x for a in args for x in (a if isinstance(a, tuple) else (a,)))):
            direct = self._direct_job(make_spec, args) if blocking and make_spec in _DIRECT else None
            job, collective = direct or self._staged_job(make_spec, args, dtype is not _NO_DTYPE)
        else:
            spec = make_spec(self, *args)
            job, collective = functools.partial(self._run_spec, spec), spec.collective
        handle = self._exec.submit(blocking, job, seq=collective)
        return handle.wait() if blocking else handle

    def _staged_job(self, make_spec, args, reduces):
        """(job, is it a collective) of a call on CUDA arrays, staged through pinned host memory
        (pyrdma.cuda.collectives), checked and planned now, its copies made when its turn comes.
        Allreduce, reduce and broadcast keep the array's shape: pipelined chunk by chunk, each chunk
        one host run of the call, copied down only where the call reads it (not on a broadcast's
        receivers) and up only where it writes it (not off a reduce's root). Allgather,
        reduce_scatter and equal all-to-all go piece by piece (_blockwise_job). Every other call is
        staged whole, each array copied down only if the call reads it and up only if it writes
        all of it (_ROLES)."""
        gc = _cuda()
        if make_spec in _PAIRED:        # as the direct path, which needs both on the GPU
            gc.check_pair(args[0], args[1], make_spec.__name__)
        if make_spec in _SHAPED:
            if make_spec is specs.broadcast:
                (buf, *rest), out = args, None
                root = specs.check_root(self, rest[0])
            else:
                buf, out, *rest = args[:-1]
                root = None if make_spec is specs.allreduce else specs.check_root(self, rest[1])
            here = root is None or root == self.rank       # allreduce, or this rank is the root
            sends = here or make_spec is not specs.broadcast       # this rank's data is read
            keeps = here != (make_spec is specs.broadcast)         # and the result written here
            element, dtype = gc.chunk_type(buf, args[-1] if reduces else None)

            def chunk_spec(chunk):
                return make_spec(self, *((chunk, None, *rest, dtype) if reduces else (chunk, *rest)))
            # the host call's checks (op, root, algorithm, dtype) first, on no elements: a mistake is
            # the caller's error, before anything is staged
            chunk_spec(np.empty(0, element))
            piped = gc.StagedPipeline(make_spec.__name__, buf, out if here else None, dtype,
                                      download=sends, upload=keeps)
            # planned now: each chunk's description carries this call's number
            planned = iter([chunk_spec(chunk) for chunk in piped.chunks()])

            def job():
                result = piped.run(lambda chunk: self._run_spec(next(planned)))
                return None if make_spec is specs.reduce and not here else result
            return job, True
        buf, out, *rest = args
        if make_spec in _BLOCKWISE and _is_cuda(buf) and (out is None or _is_cuda(out)) and \
                (make_spec is not specs.alltoall or rest == [None, None]):
            return self._blockwise_job(make_spec, buf, out, rest, reduces), True
        staged = gc.StagedCall(make_spec.__name__, args, _ROLES[make_spec](self, *args))
        host_args = staged.host_args
        if reduces and staged.reduced_as is not None:
            host_args[-1] = gc.host_dtype(args[-1], staged.reduced_as)
        spec = make_spec(self, *host_args)

        def job():
            staged.download()
            return staged.upload(self._run_spec(spec))
        return job, spec.collective

    def _blockwise_job(self, make_spec, buf, out, rest, reduces):
        """The job of an allgather, reduce_scatter or all-to-all (equal counts) of CUDA arrays,
        pipelined piece by piece (cuda.collectives.StagedBlocks): piece i takes sub-block i of every
        rank's block of buf and of out, and is one host run of the call on them. Uneven
        all-to-alls stay staged whole."""
        gc = _cuda()
        what = make_spec.__name__
        host_buf, host_out, reduced_as = gc.stand_ins(what, buf, out)
        if reduces:
            rest[-1] = gc.host_dtype(rest[-1], reduced_as)
        # the host call's checks on the whole call first: a mistake is the caller's error, before
        # anything is staged
        make_spec(self, host_buf, host_out, *rest)
        count, item, n = host_buf.size, host_buf.itemsize, self.size
        if make_spec is specs.allgather:
            src, dst = (0, count), [p * count for p in range(n + 1)]
            shape = specs.allgather_shape(self, host_buf.shape)
        elif make_spec is specs.reduce_scatter:
            src = segment_bounds(count, n)
            dst = (0, src[self.rank + 1] - src[self.rank])
            shape = (dst[1],)
        else:
            src = dst = [p * (count // n) for p in range(n + 1)]
            shape = host_buf.shape
        staged = gc.StagedBlocks(what, buf, out, ([b * item for b in src], [b * item for b in dst]), shape)
        # planned now: each piece's description carries this call's number
        planned = [make_spec(self, piece_in, piece_out, *rest) for piece_in, piece_out in staged.chunks()]
        return lambda: staged.run(lambda i: self._run_spec(planned[i]))

    def _run_spec(self, spec, park=False):
        """Run a spec's runs. ``park``: an isend's, whose rendezvous from a lent buffer may
        outlive the run (RdmaTransport.run)."""
        t = self.transport
        value = None
        for run in spec.runs:
            schedule = run.plan(t.max_message)
            work = t.work_area(run.area, run.lend, run.start, run.kind)
            layout = run.layout
            layout.copy_in(work, run.source, run.target)
            if run.avg is not None:
                run.avg.before(layout.inputs(work))
            if run.fill is not None:
                run.fill(work)
            t.set_tag(run.tag, run.recv_tag)
            consume = consumer(work, run.kind.reduce, run.kind.write) if run.kind.consumes else None
            received = t.run(schedule, run.dtype, run.op, consume, park=park and run.lend is not None, out=run.out)
            if run.avg is not None and layout.out_bytes:
                at = layout.result(schedule)
                run.avg.after(work[at:at + layout.out_bytes])
            layout.copy_out(work, schedule, run.target)
            if run.finish is not None:
                value = run.finish(work, schedule, received)
        return value if spec.result is None else spec.result()

    # ---- CUDA arrays in place (gpu_path "direct") ---------------------------------------------------

    def _gpu_direct(self, buf):
        """Whether this CUDA collective takes the direct path (the same answer on every rank)."""
        if self.gpu_path != "auto":
            return self.gpu_path == "direct"
        if self.transport_name != "rdma":     # all ranks agreed on the transport: no GPUDirect anywhere
            return False
        device_id = _cuda().device_of(buf)
        agreed = self._gpudirect_agreed.get(device_id)
        if agreed is None:
            from pyrdma.cuda import gpudirect_status
            mine = int(gpudirect_status(self.transport.pd, device_id).method is not None)
            # every rank is in this same collective, so a one-element allreduce settles it
            flag = np.array([mine], np.int32)
            self.allreduce(flag, op="min")
            agreed = self._gpudirect_agreed[device_id] = bool(flag[0])
        return agreed

    def _direct_job(self, make_spec, args):
        """(job, True: a collective) of a blocking allreduce or broadcast of a CUDA array in place in
        GPU memory (specs.allreduce_direct, broadcast_direct: the transport sends from it, CUDA
        kernels reduce), or None where it is staged (gpu_path, no GPUDirect on some rank, bfloat16)."""
        gc = _cuda()
        if make_spec is specs.allreduce:
            buf, out, op, algorithm, dtype = args
            gc.check_pair(buf, out, "allreduce")       # before the path is chosen (which may need CuPy)
            if not self._gpu_direct(buf):
                return None
            check_op(op)
            algorithm = specs.check_algorithm(algorithm)
            area = gc.direct_allreduce_area(buf, out, op, dtype, nranks=self.size)
            if area is None:
                return None
            spec, result = specs.allreduce_direct(self, area, op, algorithm), area.result
        else:
            buf, root, algorithm = args
            if not self._gpu_direct(buf):
                return None
            root = specs.check_root(self, root)
            area = gc.direct_broadcast_area(buf, self.rank == root)
            spec, result = specs.broadcast_direct(self, area, root, algorithm), buf

        def job():
            with area:
                self._run_spec(spec)
            return result
        return job, True



def init_from_env(**kwargs):
    """A Communicator from torchrun-style environment variables (MASTER_ADDR, MASTER_PORT, RANK,
    WORLD_SIZE); keyword arguments as for Communicator."""
    return Communicator.from_env(**kwargs)


def init_from_mpi(mpi_comm=None, **kwargs):
    """A Communicator whose rendezvous runs over an mpi4py communicator."""
    return Communicator.from_mpi(mpi_comm, **kwargs)
