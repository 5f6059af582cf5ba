"""Communicator: the public face of the collectives.

    comm = Communicator(rank, size, "host:port")          # or Communicator.from_env() / .from_mpi()
    comm.allreduce(x)                                      # in place, op="sum"
    y = comm.allreduce(x, out=np.empty_like(x), op="max")  # out of place
    h = comm.iallreduce(x); ...; h.wait(timeout=5)         # non-blocking

Collectives: allreduce, reduce (to root), broadcast (from root), allgather, reduce_scatter, gather
(to root), scatter (from root), alltoall (equal or uneven counts), barrier, and point-to-point send,
recv, sendrecv, each with a non-blocking ``i*`` form returning a Handle, and batch() for a group of
sends and receives. Each is one spec (its runs of the engine: schedule, description, work area,
what to copy in and out) run by one path (_call, _run_spec). Ops: sum, prod, min, max, avg
(floating-point avg scales every input by 1/n before the sum, as NCCL, so a mean near the
largest finite value does not overflow as the sum would; integer avg is the sum, which wraps
around on overflow as C does, divided by n and truncated toward zero, as NCCL). Dtypes: int8,
uint8, int32, int64, float16, float32, float64, bfloat16 (ml_dtypes.bfloat16 arrays, or
``dtype="bfloat16"`` with uint16 arrays holding the bits). Buffers: numpy arrays, anything with
the buffer protocol, CPU DLPack tensors; C-contiguous, of any element count (also fewer elements
than ranks). CUDA arrays (CuPy, DLPack CUDA tensors such as torch's, bfloat16 ones too) go to
pyrdma.cuda.collectives: the blocking allreduce and broadcast in place in GPU memory with
CUDA-kernel reductions (``gpu_path="direct"``), or pipelined through pinned host memory; every
other call, and every non-blocking one, staged through pinned host memory (cuda.collectives.stage:
copied down at the call, in stream order, uploaded when the call has run).

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
import os
import threading

import numpy as np

from pyrdma import _reduce
from pyrdma._engine import communicator_recv, communicator_send
from pyrdma.collectives import algorithms, ring, tree
from pyrdma.collectives.algorithms import exchange
from pyrdma.collectives.bootstrap import MPIExchange, TCPStore, check_rank, env_config, parse_address
from pyrdma.collectives.costmodel import ALIASES, ALLREDUCE_ALGORITHMS, ROOTED_ALGORITHMS, CostModel
from pyrdma.collectives.executor import Executor, Handle  # noqa: F401 - Handle: the package's name
from pyrdma.collectives.pieces import segment_bounds
from pyrdma.collectives.schedule import consumer
from pyrdma.collectives.transport import NO_ROOT, describe, describe_message
from pyrdma.collectives.work import Avg, Operand, byte_bounds, in_and_out, plain_bytes
from pyrdma.buffers import host_array, is_cuda_array
from pyrdma.errors import UsageError, WireFormatError

OPS = ("sum", "prod", "min", "max", "avg")
ALGORITHMS = ("auto",) + ALLREDUCE_ALGORITHMS + tuple(ALIASES)
TRANSPORTS = ("auto", "rdma", "tcp")
GPU_PATHS = ("auto", "staged", "direct")
_NO_DTYPE = object()        # _call of a call that does not reduce
DEFAULT_MAX_WORK_BYTES = 64 << 20
DEFAULT_ZERO_COPY_BYTES = 1 << 20     # below this a copy costs less than looking up a registration
_SETUP_MAGIC = b"PYRDMA-COLL/1 "


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


def _check_op(op):
    if op not in OPS:
        raise UsageError(f"unsupported op {op!r}; supported: {', '.join(OPS)}")


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
    alive, among the transport's USER_MR_CACHE most recent buffers (0 turns this off). Over RDMA a
    point-to-point message of that size or more goes by rendezvous: the sender writes it straight
    into the receiver's buffer (the size given here; ``transport.rendezvous_bytes`` changes it
    later). ``gpu_path``:
    how allreduce and broadcast move CUDA arrays: "direct" (the transport sends straight from GPU
    memory, over RDMA registered by GPUDirect; reductions run as CUDA kernels), "staged" (through
    pinned host memory, reductions on the CPU), or "auto" (direct when every rank's RDMA device and
    GPU can do GPUDirect RDMA, agreed on at the first CUDA collective; else staged). ``device``,
    ``port``, ``gid_index``: the RDMA device, port and GID the QPs use (default: NCCL-style
    environment variables PYRDMA_IB_HCA, a name or "name:port", PYRDMA_IB_PORT, PYRDMA_IB_GID_INDEX;
    else the first active device, port 1, the port's best GID).

    ``op="avg"``: floating-point inputs are divided by ``size`` (rounded once to their dtype; float16
    toward zero) before they are summed, as NCCL does, so a mean near the largest finite value does
    not overflow as their sum would (pieces.scale_down has the fine print). Integer avg is the sum,
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
        self._p2p_sent = [0] * size          # messages sent to each rank so far
        self._p2p_received = [0] * size      # and received from each
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
            if chosen == "rdma":
                from pyrdma.collectives.transport import RdmaTransport
                if slots is not None:
                    kwargs["slots"] = slots
                if spin is not None:
                    kwargs["spin"] = spin
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
        self.cost_model = cost_model or CostModel(transport=chosen)
        self._host = None
        if chosen == "rdma" and size > 1:
            # blocking host allreduces, all-to-alls and barriers are one C call each, which takes
            # the executor's lock without a Python call
            from pyrdma._engine import ExecLock, HostCollectives
            self._exec = Executor(rank, size, self.transport, ExecLock())
            self._host = HostCollectives(self.transport.engine, self._exec, self, self.transport)
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
            from pyrdma.torch import StoreExchange
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

    # ---- running collectives ------------------------------------------------------------------

    def _tag(self, kind, **fields):
        """The description of a collective about to be submitted (transport.describe): every rank
        computes the same one for the same call, and every message carries it (the sequence
        number advances in Executor.submit, once the call was accepted)."""
        return describe(self._exec.seq, kind, **fields)

    def _pieces(self, count, itemsize, factor=1):
        """Element ranges of at most max_work_bytes / factor bytes each (at least one range)."""
        per = max(1, self.max_work_bytes // (itemsize * factor))
        if count <= per:
            return [(0, count)]
        return [(s, min(count, s + per)) for s in range(0, count, per)]

    # ---- allreduce ----------------------------------------------------------------------------

    def allreduce(self, buf, out=None, op="sum", algorithm="auto", dtype=None):
        """Element-wise ``op`` of ``buf`` over all ranks, into ``out`` (default: ``buf``, in place).
        Returns the result buffer."""
        if out is None and dtype is None and self._host is not None:
            done = self._host.allreduce(buf, op, algorithm)
            if done is not None:
                return done
        if _is_cuda(buf, out):
            _check_op(op)
            algorithm = self._check_algorithm(algorithm)
            gc = _cuda()
            gc.check_pair(buf, out, "allreduce")       # before the path is chosen (which may need CuPy)
            area = gc.direct_allreduce_area(buf, out, op, dtype) if self._gpu_direct(buf) else None
            if area is None:
                return gc.allreduce(self, buf, out, op, algorithm, dtype)
            with area:
                self._allreduce_in_place(area, op, algorithm)
            return area.result
        return self._call(self._allreduce, buf, out, op, algorithm, blocking=True, dtype=dtype)

    def iallreduce(self, buf, out=None, op="sum", algorithm="auto", dtype=None):
        """Non-blocking allreduce: returns a Handle; don't touch ``buf``/``out`` until it is done."""
        return self._call(self._allreduce, buf, out, op, algorithm, blocking=False, dtype=dtype)

    def _allreduce(self, buf, out, op, algorithm, dtype):
        _check_op(op)
        algorithm = self._check_algorithm(algorithm)
        src, dst = in_and_out(buf, out, dtype, writes=True)
        avg = Avg(op, src.code, self.size)
        runs = []
        for lo, hi, algo, tag in self._allreduce_plan(src, op, algorithm):
            a, b = lo * src.itemsize, hi * src.itemsize
            in_place, work_bytes = self._allreduce_work(algo, b - a)

            def fill(work, a=a, b=b, in_place=in_place):
                if not in_place or src is not dst:
                    work[:b - a] = src.bytes[a:b]
                avg.before(work[:b - a])

            def finish(work, schedule, received, a=a, b=b, in_place=in_place):
                at = schedule.result_offset              # where in work the result lies
                avg.after(work[at:at + b - a])
                if not in_place:
                    dst.bytes[a:b] = work[at:at + b - a]
            plan = functools.partial(algorithms.planner("allreduce", algo), self.size, self.rank, hi - lo,
                                     src.itemsize)
            runs.append(_Run(plan, tag, b - a if in_place else work_bytes, fill, finish, src.code, _op_code(op),
                             lend=dst.bytes if in_place else None, start=a))
        return _Spec(runs, lambda: dst.obj)

    def _allreduce_plan(self, src, op, algorithm):
        """[(lo, hi, algorithm, description)] of the pieces of an allreduce of ``src``."""
        plan = []
        for lo, hi in self._pieces(src.count, src.itemsize):
            nbytes = (hi - lo) * src.itemsize
            algo = algorithm
            if algo == "auto":
                algo = self.cost_model.choose_allreduce(nbytes, self.size, self.transport.max_message)
                algo = ALIASES.get(algo, algo)
                if algo not in ALLREDUCE_ALGORITHMS:
                    raise UsageError(f"the cost model chose an unknown algorithm {algo!r}")
            plan.append((lo, hi, algo, self._tag("allreduce", op=op, dtype=src.code, count=src.count, lo=lo, hi=hi,
                                                     algorithm=algo)))
        return plan

    def _prepare_host_allreduce(self, buf, op, algorithm):
        """What pyrdma._engine.HostCollectives needs to run ``allreduce(buf, op=op,
        algorithm=algorithm)`` as one C call, again for every buffer of the same format and size
        (its cache key): a HostCall, with the same plan, description and work area as the general
        path (_allreduce); or None where the general path must run it (avg, one piece too many,
        arguments it rejects with their error)."""
        from pyrdma._engine import HostCall
        if op not in OPS or op == "avg" or algorithm not in ALGORITHMS:
            return None
        try:
            src = Operand(buf, "buf", writable=True)
        except UsageError:
            return None
        if src.count == 0 or src.code == _reduce.BFLOAT16 or src.nbytes > self.max_work_bytes:
            return None
        plan = self._allreduce_plan(src, op, self._check_algorithm(algorithm))
        if len(plan) != 1:
            return None
        (lo, hi, algo, tag), = plan
        t = self.transport
        schedule = algorithms.planner("allreduce", algo)(self.size, self.rank, src.count, src.itemsize, t.max_message)
        in_place, work_bytes = self._allreduce_work(algo, src.nbytes)
        return HostCall(t.engine.program(schedule), tag, src.code, _op_code(op), src.nbytes, schedule.result_offset,
                        work_bytes, None if in_place else t.own_region(work_bytes))

    def _prepare_host_alltoall(self, buf):
        """The HostCall of a blocking all-to-all of equal pieces (see _prepare_host_allreduce): the
        same plan and description as the general path's (_alltoall), or None where that one must
        run it."""
        from pyrdma._engine import HostCall
        try:
            arr, data = plain_bytes(buf, "buf")
        except UsageError:
            return None
        n, r = self.size, self.rank
        if arr.size % n or not data.nbytes:
            return None
        piece = data.nbytes // n
        bounds = tuple(i * piece for i in range(n + 1))
        t = self.transport
        schedule = algorithms.planner("alltoall", "pairwise")(n, r, bounds, bounds, data.nbytes, t.max_message)
        tag = self._tag("alltoall", dtype=arr.dtype, count=arr.size, algorithm="pairwise")
        return HostCall(t.engine.program(schedule), tag, 0, 0, data.nbytes, data.nbytes, 2 * data.nbytes,
                        t.own_region(2 * data.nbytes), own=(r * piece, data.nbytes + r * piece, piece))

    def _prepare_host_gather(self, buf, root, algorithm):
        """The HostCall of a blocking gather of ``buf`` (see _prepare_host_allreduce), or None."""
        return self._prepare_rooted_copy("gather", buf, root, algorithm)

    def _prepare_host_scatter(self, out, root, algorithm):
        """The HostCall of a blocking scatter into ``out`` (see _prepare_host_allreduce), or None."""
        return self._prepare_rooted_copy("scatter", out, root, algorithm)

    def _prepare_rooted_copy(self, kind, piece, root, algorithm):
        """A gather's or scatter's HostCall for this rank's ``piece``: the same plan, description
        and work area as the general path's (_rooted_copy)."""
        from pyrdma._engine import HostCall
        try:
            arr, data = plain_bytes(piece, "buf")
            algo = self._copy_algorithm(kind, algorithm, data.nbytes)
        except UsageError:
            return None
        n, r, block = self.size, self.rank, data.nbytes
        entry = algorithms.ALGORITHMS[kind][algo]
        full = entry.full_area or r == root
        at = r * block if full else 0
        t = self.transport
        schedule = entry.planner(n, r, root, block, t.max_message)
        tag = self._tag(kind, dtype=arr.dtype, count=arr.size, root=root, algorithm=algo)
        area = n * block if full else block
        if kind == "gather":          # in: this rank's block; out: all of them, on the root
            return HostCall(t.engine.program(schedule), tag, 0, 0, block, 0, area, t.own_region(area), in_offset=at,
                            out_bytes=n * block if r == root else 0)
        return HostCall(t.engine.program(schedule), tag, 0, 0, n * block if r == root else 0, at, area,
                        t.own_region(area), out_bytes=block)

    def _prepare_host_message(self, buf, peer, how):
        """The HostCall of a blocking send to or receive from ``peer`` (``how``: (tag, receive)),
        copied through the transport's buffer: the same plan and description as the general path's
        (_p2p), whose message number HostCollectives fills in per call; or None."""
        from pyrdma._engine import HostCall
        tag, receive = how
        if not 0 <= tag < NO_ROOT:
            return None
        try:
            arr, data = plain_bytes(buf, "buf", writable=receive)
        except UsageError:
            return None
        t, nbytes = self.transport, data.nbytes
        if receive:
            schedule = exchange.message(None, 0, peer, nbytes, 0, t.max_message)
            desc = describe_message(0, 0, arr.dtype, tag)
            return HostCall(t.engine.program(schedule), desc, 0, 0, 0, 0, nbytes, t.own_region(nbytes), out_bytes=0)
        schedule = exchange.message(peer, nbytes, None, 0, nbytes, t.max_message)
        desc = describe_message(0, nbytes, arr.dtype, tag)
        return HostCall(t.engine.program(schedule), desc, 0, 0, nbytes, 0, nbytes, t.own_region(nbytes), out_bytes=0)

    def _prepare_barrier(self):
        """The HostCall of barrier() (see _prepare_host_allreduce): the same plan and description
        as the general path's."""
        from pyrdma._engine import HostCall
        t = self.transport
        return HostCall(t.engine.program(tree.dissemination_barrier(self.size, self.rank)),
                        self._tag("barrier", algorithm="dissemination"), 0, 0, 0, 0, 0, t.own_region(0))

    def _host_registration(self, buf):
        """The MemoryRegion of a host buffer that an allreduce works on in place."""
        return self.transport.registration(host_array(buf, "buf").reshape(-1).view(np.uint8))[0]

    def _check_algorithm(self, algorithm):
        if algorithm not in ALGORITHMS:
            raise UsageError(f"unknown algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}")
        return ALIASES.get(algorithm, algorithm)

    def _zero_copy(self, nbytes):
        """Whether a collective works on ``nbytes`` of the caller's memory itself (registered, no
        copies) rather than on the transport's buffer."""
        return bool(self.zero_copy_bytes) and nbytes >= self.zero_copy_bytes

    def _allreduce_work(self, algo, nbytes):
        """(in place?, work bytes) of an allreduce of ``nbytes`` by ``algo``, for the general path and
        the one-call path alike: in place when _zero_copy, except recursive doubling, which needs
        room for a second copy."""
        if algo == "recursive_doubling":
            return False, 2 * nbytes
        return self._zero_copy(nbytes), nbytes

    # ---- CUDA arrays in place (gpu_path "direct") -----------------------------------------------

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

    def _allreduce_in_place(self, area, op, algorithm):
        """allreduce in place on a work area that is not the transport's: ``area`` has the memory
        (``work``, a flat uint8 array that the transport sends from directly: GPU memory through
        pyrdma.cuda's DirectArea), ``count``, ``itemsize``, ``code`` and the reductions ``reduce``,
        ``divide``, ``prescale`` (floating-point avg: work /= n before the sum; else divide after it)
        and, for memory other than numpy's, ``register(pd, array)`` and ``sync()``."""
        device = None if isinstance(area.work, np.ndarray) else area
        runs = []
        for lo, hi in self._pieces(area.count, area.itemsize):
            algo = algorithm
            if algo == "auto":
                algo = self.cost_model.choose_allreduce((hi - lo) * area.itemsize, self.size,
                                                        self.transport.max_message)
                algo = ALIASES.get(algo, algo)
            if algo == "recursive_doubling":      # needs a second copy of the buffer: not in place
                algo = "halving_doubling"

            def fill(work):
                if op == "avg" and area.prescale is not None:
                    area.prescale(work, self.size)

            def finish(work, schedule, received):
                if op == "avg" and area.prescale is None:
                    area.divide(work, self.size)
            plan = functools.partial(algorithms.planner("allreduce", algo), self.size, self.rank, hi - lo,
                                     area.itemsize)
            tag = self._tag("allreduce-direct", op=op, dtype=area.code, count=area.count, lo=lo, hi=hi, algorithm=algo)
            runs.append(_Run(plan, tag, (hi - lo) * area.itemsize, fill, finish, area.code, _op_code(op), area.work,
                             lo * area.itemsize, device=device, reduce=area.reduce))
        return self._exec.submit(True, self._run_spec, _Spec(runs)).wait()

    def _broadcast_in_place(self, area, root, algorithm):
        """broadcast of ``area.work`` (flat uint8, GPU memory included) from root, sent from directly."""
        device = None if isinstance(area.work, np.ndarray) else area
        runs = []
        for lo, hi in self._pieces(area.work.nbytes, 1):
            algo = self._rooted_algorithm(algorithm, hi - lo)
            plan = functools.partial(algorithms.planner("broadcast", algo), self.size, self.rank, hi - lo, 1,
                                     root=root)
            tag = self._tag("broadcast-direct", dtype=_dtype_field(area.dtype_name), count=area.work.nbytes,
                            root=root, lo=lo, hi=hi, algorithm=algo)
            runs.append(_Run(plan, tag, hi - lo, lend=area.work, start=lo, device=device, reduce=_COPY_ONLY))
        return self._exec.submit(True, self._run_spec, _Spec(runs)).wait()

    # ---- reduce, broadcast ----------------------------------------------------------------------

    def _rooted_algorithm(self, algorithm, nbytes):
        if algorithm == "auto":
            return self.cost_model.choose_rooted(nbytes, self.size, self.transport.max_message)
        if algorithm not in ROOTED_ALGORITHMS:
            raise UsageError(f"unknown algorithm {algorithm!r} for reduce/broadcast; use auto, "
                             f"{', '.join(ROOTED_ALGORITHMS)}")
        return algorithm

    def _check_root(self, root):
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            raise UsageError(f"root {root!r} is not a rank of this communicator (0..{self.size - 1})")
        return int(root)

    def reduce(self, buf, out=None, op="sum", root=0, algorithm="auto", dtype=None):
        """Element-wise ``op`` over all ranks, delivered to ``root`` only (into ``out``, default in
        place). Returns the result on root and None elsewhere; other ranks' buffers are unchanged."""
        if _is_cuda(buf, out):
            _check_op(op)
            return _cuda().reduce(self, buf, out, op, self._check_root(root), algorithm, dtype)
        return self._call(self._reduce, buf, out, op, root, algorithm, blocking=True, dtype=dtype)

    def ireduce(self, buf, out=None, op="sum", root=0, algorithm="auto", dtype=None):
        return self._call(self._reduce, buf, out, op, root, algorithm, blocking=False, dtype=dtype)

    def broadcast(self, buf, root=0, algorithm="auto"):
        """Copy root's ``buf`` into ``buf`` on every rank (same size everywhere). Returns ``buf``."""
        if _is_cuda(buf):
            root = self._check_root(root)
            if self._gpu_direct(buf):
                with _cuda().direct_broadcast_area(buf, self.rank == root) as area:
                    self._broadcast_in_place(area, root, algorithm)
                return buf
            return _cuda().broadcast(self, buf, root, algorithm)
        return self._call(self._broadcast, buf, root, algorithm, blocking=True)

    def ibroadcast(self, buf, root=0, algorithm="auto"):
        return self._call(self._broadcast, buf, root, algorithm, blocking=False)

    def allgather(self, buf, out=None):
        """Every rank's ``buf`` (the same size on all ranks), concatenated in rank order into ``out``
        (size * buf.size elements; default a new array concatenated along the first axis, shape
        (size * len(buf),) + buf.shape[1:], as torch's all_gather_into_tensor)."""
        if _is_cuda(buf, out):
            return _cuda().allgather(self, buf, out)
        return self._call(self._allgather, buf, out, blocking=True)

    def iallgather(self, buf, out=None):
        return self._call(self._allgather, buf, out, blocking=False)

    def reduce_scatter(self, buf, out=None, op="sum", dtype=None):
        """Element-wise ``op`` of ``buf`` over all ranks; rank i receives segment i of
        ``segment_bounds(len(buf))`` into ``out`` (default a new 1-D array). Returns ``out``."""
        if _is_cuda(buf, out):
            _check_op(op)
            return _cuda().reduce_scatter(self, buf, out, op, dtype)
        return self._call(self._reduce_scatter, buf, out, op, blocking=True, dtype=dtype)

    def ireduce_scatter(self, buf, out=None, op="sum", dtype=None):
        return self._call(self._reduce_scatter, buf, out, op, blocking=False, dtype=dtype)

    def barrier(self):
        """Return once every rank has entered the barrier."""
        if self._host is None or self._host.barrier() is None:
            self._call(self._barrier, blocking=True)

    def ibarrier(self):
        return self._call(self._barrier, blocking=False)

    # the specs of the collectives above: validate, plan the pieces (_Run), say what the call returns

    def _reduce(self, buf, out, op, root, algorithm, dtype):
        _check_op(op)
        root = self._check_root(root)
        src, dst = in_and_out(buf, out, dtype, writes=self.rank == root)
        avg = Avg(op, src.code, self.size)
        runs = []
        for lo, hi in self._pieces(src.count, src.itemsize):
            algo = self._rooted_algorithm(algorithm, (hi - lo) * src.itemsize)
            a, b = lo * src.itemsize, hi * src.itemsize

            def fill(work, a=a, b=b):
                work[:b - a] = src.bytes[a:b]
                avg.before(work[:b - a])

            def finish(work, schedule, received, a=a, b=b):
                if self.rank == root:
                    avg.after(work[:b - a])
                    dst.bytes[a:b] = work[:b - a]
            plan = functools.partial(algorithms.planner("reduce", algo), self.size, self.rank, hi - lo, src.itemsize,
                                     root=root)
            runs.append(_Run(plan, self._tag("reduce", op=op, dtype=src.code, count=src.count, root=root, lo=lo,
                                             hi=hi, algorithm=algo), b - a, fill, finish, src.code, _op_code(op)))
        return _Spec(runs, lambda: dst.obj if self.rank == root else None)

    def _broadcast(self, buf, root, algorithm):
        root = self._check_root(root)
        arr, data = plain_bytes(buf, "buf", writable=self.rank != root)    # any dtype: broadcast copies bytes
        runs = []
        for lo, hi in self._pieces(data.nbytes, 1):
            algo = self._rooted_algorithm(algorithm, hi - lo)
            # in place the root only sends from its buffer (which may be read-only)
            lend = data if self._zero_copy(hi - lo) else None

            def fill(work, lo=lo, hi=hi, lend=lend):
                if self.rank == root and lend is None:
                    work[:hi - lo] = data[lo:hi]

            def finish(work, schedule, received, lo=lo, hi=hi, lend=lend):
                if self.rank != root and lend is None:
                    data[lo:hi] = work[:hi - lo]
            plan = functools.partial(algorithms.planner("broadcast", algo), self.size, self.rank, hi - lo, 1,
                                     root=root)
            runs.append(_Run(plan, self._tag("broadcast", dtype=arr.dtype, count=data.nbytes, root=root, lo=lo, hi=hi,
                                             algorithm=algo), hi - lo, fill, finish, lend=lend, start=lo))
        return _Spec(runs, lambda: buf)

    def _allgather(self, buf, out):
        arr, src = plain_bytes(buf, "buf")
        users_out = out is not None
        if out is None:
            shape = (self.size * arr.shape[0],) + arr.shape[1:] if arr.ndim else (self.size,)
            out = np.empty(shape, arr.dtype)
        dst_arr, dst = plain_bytes(out, "out", writable=True)
        if dst_arr.dtype != arr.dtype or dst_arr.size != arr.size * self.size:
            raise UsageError(f"out must hold {self.size} x {arr.size} elements of {arr.dtype}; "
                             f"it has {dst_arr.size} of {dst_arr.dtype}")
        block = src.nbytes
        total = block * self.size
        # a fresh out= of ours would be registered (and kept) once per call: copy instead
        lend = dst if users_out and self._zero_copy(total) else None

        def fill(work):
            work[self.rank * block:(self.rank + 1) * block] = src

        def finish(work, schedule, received):
            if lend is None:
                dst[:] = work[:total]
            return out
        # blocks as "elements" of one byte: boundaries at multiples of the block size
        plan = functools.partial(ring.allgather, self.size, self.rank, total, 1,
                                 bounds=tuple(i * block for i in range(self.size + 1)))
        return _Spec([_Run(plan, self._tag("allgather", dtype=arr.dtype, count=arr.size), total, fill, finish,
                           lend=lend)])

    def _reduce_scatter(self, buf, out, op, dtype):
        _check_op(op)
        src = Operand(buf, "buf", writable=False, dtype=dtype)
        bounds = segment_bounds(src.count, self.size)
        start, stop = bounds[self.rank], bounds[self.rank + 1]
        if out is None:
            out = np.empty(stop - start, src.array.dtype)
        dst = Operand(out, "out", writable=True, dtype=dtype)
        src.same_type(dst, "out")
        if dst.count != stop - start:
            raise UsageError(f"out must hold this rank's {stop - start} elements (segment_bounds), it has {dst.count}")
        avg = Avg(op, src.code, self.size)
        a, b = start * src.itemsize, stop * src.itemsize

        def fill(work):
            work[:src.nbytes] = src.bytes
            avg.before(work[:src.nbytes])

        def finish(work, schedule, received):
            avg.after(work[a:b])
            dst.bytes[:] = work[a:b]
            return dst.obj
        plan = functools.partial(ring.reduce_scatter, self.size, self.rank, src.count, src.itemsize,
                                 bounds=tuple(bounds))
        return _Spec([_Run(plan, self._tag("reduce_scatter", op=op, dtype=src.code, count=src.count), src.nbytes,
                           fill, finish, src.code, _op_code(op))])

    def _barrier(self):
        plan = lambda max_message: tree.dissemination_barrier(self.size, self.rank)    # noqa: E731
        return _Spec([_Run(plan, self._tag("barrier", algorithm="dissemination"), 0)])

    # ---- gather, scatter, alltoall, point-to-point: one spec each, one path ----------------------

    def gather(self, buf, out=None, root=0, algorithm="auto"):
        """Every rank's ``buf`` (the same size everywhere) to ``root``, in rank order, into ``out``
        there (default a new array of shape (size * len(buf),) + buf.shape[1:], as allgather).
        Returns out on root, None elsewhere."""
        if self._host is not None:
            done = self._host.gather(buf, out, root, algorithm)
            if done is not None:
                return done[0]
        return self._call(self._gather, buf, out, root, algorithm, blocking=True)

    def igather(self, buf, out=None, root=0, algorithm="auto"):
        return self._call(self._gather, buf, out, root, algorithm, blocking=False)

    def scatter(self, buf, out=None, root=0, algorithm="auto"):
        """Root's ``buf`` holds ``size`` equal pieces in rank order; rank i receives piece i into
        ``out`` (default a new array of shape (len(buf) // size,) + buf.shape[1:]). Elsewhere ``buf``
        may be None when ``out`` is given (or an array of the root's shape: its piece shape is
        used). Returns out."""
        if self._host is not None:
            done = self._host.scatter(buf, out, root, algorithm)
            if done is not None:
                return done[0]
        return self._call(self._scatter, buf, out, root, algorithm, blocking=True)

    def iscatter(self, buf, out=None, root=0, algorithm="auto"):
        return self._call(self._scatter, buf, out, root, algorithm, blocking=False)

    def alltoall(self, buf, out=None, send_counts=None, recv_counts=None):
        """Rank i's piece j of ``buf`` goes to rank j, which stores it as its piece i of ``out``.
        Without counts the pieces are equal (buf is split in ``size``; out, default a new array
        like buf, likewise); with ``send_counts`` (element counts per rank, zeros allowed, pieces
        contiguous in rank order, as MPI_Alltoallv and torch's input_split_sizes) they may differ,
        and ``recv_counts`` (output_split_sizes) is exchanged first when not given. Returns out."""
        if send_counts is None and recv_counts is None and self._host is not None:
            done = self._host.alltoall(buf, out)
            if done is not None:
                return done
        return self._call(self._alltoall, buf, out, send_counts, recv_counts, blocking=True)

    def ialltoall(self, buf, out=None, send_counts=None, recv_counts=None):
        return self._call(self._alltoall, buf, out, send_counts, recv_counts, blocking=False)

    # send(buf, dst, tag=0) and recv(buf, src, tag=0) are C functions (pyrdma._engine's; their
    # docstrings say what they do): a warm blocking message of host memory over RDMA is one C call,
    # without a Python frame of the method's own; elsewhere they run _call(_p2p, ...) as isend does
    send = communicator_send
    recv = communicator_recv

    def isend(self, buf, dst, tag=0):
        return self._call(self._p2p, buf, dst, None, tag, blocking=False)

    def irecv(self, buf, src, tag=0):
        return self._call(self._p2p, buf, None, src, tag, blocking=False)

    def sendrecv(self, sendbuf, dst, recvbuf, src, tag=0):
        """send(sendbuf, dst) and recv(recvbuf, src) at once (the exchange of a ring or of a pair:
        neither waits for the other, whatever the sizes). Returns the elements received."""
        return self._call(self._p2p, (sendbuf, recvbuf), dst, src, tag, blocking=True)

    def isendrecv(self, sendbuf, dst, recvbuf, src, tag=0):
        return self._call(self._p2p, (sendbuf, recvbuf), dst, src, tag, blocking=False)

    def batch(self, ops):
        """Run a group of point-to-point operations at once, as NCCL's ncclGroupStart/End and
        torch's batch_isend_irecv: ``ops`` is a list of ("send", buf, peer[, tag]) and ("recv", buf,
        peer[, tag]). Calls run in the order they were made, so on every rank a receive posted
        before its send waits for it; in a batch nothing waits for another operation of the same
        batch. Every pair of ranks' messages still keeps its order. Returns a Handle whose wait()
        gives one entry per op: None for a send, the elements received for a receive."""
        n, r = self.size, self.rank
        sends, recvs = {}, {}
        upload = None
        ops = list(ops)
        if all(isinstance(op, (tuple, list)) and len(op) in (3, 4) for op in ops) and _is_cuda(*(op[1] for op in ops)):
            host, upload, _ = _cuda().stage("batch", [op[1] for op in ops])
            ops = [(op[0], h, *op[2:]) for op, h in zip(ops, host)]
        for i, op in enumerate(ops):
            if not isinstance(op, (tuple, list)) or len(op) not in (3, 4) or op[0] not in ("send", "recv"):
                raise UsageError(f"batch: op {i} must be ('send'|'recv', buf, peer[, tag]), got {op!r}")
            peer = op[2]
            if not isinstance(peer, (int, np.integer)) or not 0 <= peer < n or peer == r:
                raise UsageError(f"batch: op {i} names rank {peer!r}, not another rank of this communicator")
            (sends if op[0] == "send" else recvs).setdefault(int(peer), []).append((i, op[1], op[3] if len(op) > 3
                                                                                  else 0))
        # pairwise order: at step k the j-th send to rank r+k goes with the j-th receive from
        # rank r-k; every rank steps through k alike, so no step waits on one of a later step
        steps = []
        for k in range(1, n):
            out, inc = sends.get((r + k) % n, []), recvs.get((r - k) % n, [])
            for j in range(max(len(out), len(inc))):
                s, v = out[j] if j < len(out) else None, inc[j] if j < len(inc) else None
                buf = (s[1], v[1]) if s and v else (s or v)[1]
                tag = (s[2], v[2]) if s and v else (s or v)[2]
                spec = self._p2p(buf, (r + k) % n if s else None, (r - k) % n if v else None, tag)
                steps.append(tuple((x[0], spec) for x in (s, v) if x is not None))
        results = [None] * len(ops)

        def run():
            for step in steps:
                got = self._run_spec(step[0][1])      # each step one run: its own descriptions
                for i, _ in step:
                    if ops[i][0] == "recv":
                        results[i] = got
            return results if upload is None else upload(results)
        return self._exec.submit(False, run, seq=False)

    def _call(self, make_spec, *args, blocking, dtype=_NO_DTYPE):
        """The one call path: validate and plan (``make_spec``, on the caller's thread), then run
        the spec in order with the other collectives (inline, or on the communicator's thread).
        ``dtype``: the reduction dtype of a reducing call (the spec's last argument). CUDA arrays
        are staged through pinned host memory (cuda.collectives.stage): copied down now, in stream
        order, and their results uploaded when the call has run."""
        if dtype is not _NO_DTYPE:
            args += (dtype,)
        if _is_cuda(*(x for a in args for x in (a if isinstance(a, tuple) else (a,)))):
            name = make_spec.__name__.strip("_")
            host_args, upload, reduced_as = _cuda().stage(name, args)
            if reduced_as is not None and dtype is not _NO_DTYPE:
                host_args[-1] = _cuda().host_dtype(dtype, reduced_as)
            spec = make_spec(*host_args)
            spec.then(upload)
        else:
            spec = make_spec(*args)
        handle = self._exec.submit(blocking, self._run_spec, spec, seq=spec.collective)
        return handle.wait() if blocking else handle

    def _run_spec(self, spec):
        t = self.transport
        value = None
        for run in spec.runs:
            schedule = run.plan(t.max_message)
            work = t.work_area(run.area, run.lend, run.start, device=run.device)
            if run.fill is not None:
                run.fill(work)
            t.set_tag(run.tag, run.recv_tag)
            consume = None if run.reduce is None else consumer(work, None if run.reduce is _COPY_ONLY else run.reduce)
            received = t.run(schedule, run.dtype, run.op, consume)
            if run.finish is not None:
                value = run.finish(work, schedule, received)
        value = value if spec.result is None else spec.result()
        return value if spec.after is None else spec.after(value)

    def _copy_algorithm(self, kind, algorithm, block):
        if algorithm == "auto":
            return self.cost_model.choose_copy(kind, block, self.size, self.transport.max_message)
        if algorithm not in algorithms.names(kind):
            raise UsageError(f"unknown algorithm {algorithm!r} for {kind}; use auto, "
                             f"{', '.join(algorithms.names(kind))}")
        return algorithm

    def _gather(self, buf, out, root, algorithm):
        root = self._check_root(root)
        arr, data = plain_bytes(buf, "buf")
        block, n, r = data.nbytes, self.size, self.rank
        if r == root:
            if out is None:
                out = np.empty((n * arr.shape[0],) + arr.shape[1:] if arr.ndim else (n,), arr.dtype)
            dst_arr, dst = plain_bytes(out, "out", writable=True)
            if dst_arr.dtype != arr.dtype or dst.nbytes != n * block:
                raise UsageError(f"out must hold {n} x {arr.size} elements of {arr.dtype}; it has {dst_arr.size} "
                                 f"of {dst_arr.dtype}")

        def fill(work, at):
            work[at:at + block] = data

        def finish(work, at):
            if r != root:
                return None
            dst[:] = work[:n * block]
            return out
        return self._rooted_copy("gather", root, algorithm, arr.dtype, arr.size, block, fill, finish)

    def _scatter(self, buf, out, root, algorithm):
        root = self._check_root(root)
        n, r = self.size, self.rank
        src = None
        if buf is not None:
            arr, src = plain_bytes(buf, "buf")
            if arr.ndim == 0 or arr.shape[0] % n:
                raise UsageError(f"buf's first dimension ({arr.shape[0] if arr.ndim else 'a scalar'}) must split "
                                 f"into {n} equal pieces")
            if out is None:
                out = np.empty((arr.shape[0] // n,) + arr.shape[1:], arr.dtype)
        elif r == root:
            raise UsageError(f"scatter: buf is None on the root (rank {root}), which sends it")
        elif out is None:
            raise UsageError(f"scatter: rank {r} is not the root; pass out= (the piece it receives) or buf")
        out_arr, dst = plain_bytes(out, "out", writable=True)
        block = dst.nbytes
        if src is not None and (arr.dtype != out_arr.dtype or src.nbytes != n * block):
            raise UsageError(f"buf must hold {n} pieces like out ({out_arr.size} elements of {out_arr.dtype}); it "
                             f"has {arr.size} of {arr.dtype}")

        def fill(work, at):
            if r == root:
                work[:n * block] = src

        def finish(work, at):
            dst[:] = work[at:at + block]
            return out
        return self._rooted_copy("scatter", root, algorithm, out_arr.dtype, out_arr.size, block, fill, finish)

    def _rooted_copy(self, kind, root, algorithm, dtype, count, block, fill, finish):
        """The spec of a gather or scatter of ``block`` bytes per rank. The work area holds every
        rank's block in rank order where the root or the algorithm needs them all, else this rank's
        at 0; ``fill(work, at)`` and ``finish(work, at)`` get where this rank's block lies."""
        n, r = self.size, self.rank
        algo = self._copy_algorithm(kind, algorithm, block)
        entry = algorithms.ALGORITHMS[kind][algo]
        full = entry.full_area or r == root
        at = r * block if full else 0
        return _Spec([_Run(functools.partial(entry.planner, n, r, root, block),
                           self._tag(kind, dtype=dtype, count=count, root=root, algorithm=algo),
                           n * block if full else block, lambda work: fill(work, at),
                           lambda work, schedule, received: finish(work, at))])

    def _alltoall(self, buf, out, send_counts, recv_counts):
        n, r = self.size, self.rank
        arr, src = plain_bytes(buf, "buf")
        item = arr.dtype.itemsize
        if send_counts is None:
            if recv_counts is not None:
                raise UsageError("recv_counts without send_counts: give both, or send_counts alone")
            if arr.size % n:
                raise UsageError(f"buf has {arr.size} elements, which do not split into {n} equal pieces; pass "
                                 f"send_counts")
            piece = src.nbytes // n
            sb = rb = tuple(i * piece for i in range(n + 1))
        else:
            sb = byte_bounds(send_counts, "send_counts", n, item)
            if sb[-1] != src.nbytes:
                raise UsageError(f"send_counts add up to {sb[-1] // item} elements; buf has {arr.size}")
            if recv_counts is None:
                mine = np.diff(np.array(sb, np.int64)) // item
                recv_counts = self.alltoall(mine)
            rb = byte_bounds(recv_counts, "recv_counts", n, item)
        if out is None:
            if send_counts is None:
                out = np.empty_like(arr)
            else:
                out = np.empty((rb[-1] // item,) + arr.shape[1:], arr.dtype) if arr.ndim > 1 and \
                    rb[-1] % (item * int(np.prod(arr.shape[1:]))) == 0 else np.empty(rb[-1] // item, arr.dtype)
        out_arr, dst = plain_bytes(out, "out", writable=True)
        if out_arr.dtype != arr.dtype or dst.nbytes != rb[-1]:
            raise UsageError(f"out must hold {rb[-1] // item} elements of {arr.dtype}; it has {out_arr.size} of "
                             f"{out_arr.dtype}")
        base = sb[-1]
        count = arr.size if send_counts is None else 0     # uneven counts: each message's length is checked
        tag = self._tag("alltoall", dtype=arr.dtype, count=count, algorithm="pairwise")

        def fill(work):
            work[:base] = src

        def finish(work, schedule, received):
            dst[:] = work[base:base + rb[-1]]
            dst[rb[r]:rb[r + 1]] = src[sb[r]:sb[r + 1]]
            return out
        plan = functools.partial(algorithms.planner("alltoall", "pairwise"), n, r, sb, rb, base)
        return _Spec([_Run(plan, tag, base + rb[-1], fill, finish)])

    def _p2p(self, buf, dst, src, tag):
        """A send (dst), a receive (src) or both (buf and tag pairs: send's, receive's): one message
        each way."""
        send_tag, recv_tag = tag if isinstance(tag, tuple) else (tag, tag)
        for t in (send_tag, recv_tag):
            if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < NO_ROOT:
                raise UsageError(f"tag must be an integer in [0, {NO_ROOT}), got {t!r}")
        sendbuf, recvbuf = buf if isinstance(buf, tuple) else ((buf, None) if dst is not None else (None, buf))
        for peer, what in ((dst, "dst"), (src, "src")):
            if peer is not None and (not isinstance(peer, (int, np.integer)) or not 0 <= peer < self.size):
                raise UsageError(f"{what} {peer!r} is not a rank of this communicator (0..{self.size - 1})")
        s_arr = r_arr = s_data = r_data = None
        if sendbuf is not None:
            s_arr, s_data = plain_bytes(sendbuf, "buf" if recvbuf is None else "sendbuf")
        if recvbuf is not None:
            r_arr, r_data = plain_bytes(recvbuf, "buf" if sendbuf is None else "recvbuf", writable=True)
        if dst == self.rank or src == self.rank:
            raise UsageError(f"rank {self.rank} sends or receives a message to itself; copy the array instead")
        item = r_arr.dtype.itemsize if r_arr is not None else 1
        send_desc = recv_desc = describe(0, "")
        if dst is not None:
            send_desc = describe_message(self._p2p_sent[dst], s_data.nbytes, s_arr.dtype, send_tag)
            self._p2p_sent[dst] += 1
        if src is not None:
            recv_desc = describe_message(self._p2p_received[src], 0, r_arr.dtype, recv_tag)
            self._p2p_received[src] += 1
        nbytes = s_data.nbytes if s_data is not None else 0
        capacity = r_data.nbytes if r_data is not None else 0
        # a lone send or receive works on the caller's memory itself when zero-copy pays
        lend = None
        if recvbuf is None and self._zero_copy(nbytes):
            lend = s_data
        elif sendbuf is None and self._zero_copy(capacity):
            lend = r_data

        def fill(work):
            if s_data is not None and lend is None:
                work[:nbytes] = s_data

        def finish(work, schedule, received):
            if src is None:
                return None
            if received % item:
                raise UsageError(f"rank {src} sent {received} bytes, not whole {item}-byte elements of "
                                 f"{r_arr.dtype}")
            if lend is None and received:
                r_data[:received] = work[nbytes:nbytes + received]
            return received // item
        plan = functools.partial(exchange.message, dst, nbytes, src, capacity, 0 if lend is not None else nbytes)
        area = nbytes + capacity if lend is None else (nbytes or capacity)
        return _Spec([_Run(plan, send_desc, area, fill, finish, lend=lend, recv_tag=recv_desc)], collective=False)


class _Run:
    """One run of the engine in a call (a piece of a large reduction, or the whole call):
    ``plan(max_message)`` its Schedule, ``tag`` the description its messages carry (``recv_tag``
    the one they are received with, point-to-point), ``area`` the bytes of its work area (the
    transport's buffer, or ``lend[start:start + area]`` in place), ``fill(work)`` before it,
    ``finish(work, schedule, received)`` after it, ``dtype``/``op`` the reduction's codes. Lent
    memory other than numpy's (GPU memory) comes with its ``device`` (transport.work_area); where
    ``reduce`` is given, received chunks are consumed in Python (schedule.consumer: CUDA copies and
    reductions) instead of in C."""

    __slots__ = ("plan", "tag", "area", "fill", "finish", "dtype", "op", "lend", "start", "recv_tag", "device",
                 "reduce")

    def __init__(self, plan, tag, area, fill=None, finish=None, dtype=0, op=0, lend=None, start=0, recv_tag=None,
                 device=None, reduce=None):
        self.plan, self.tag, self.area, self.fill, self.finish = plan, tag, area, fill, finish
        self.dtype, self.op, self.lend, self.start, self.recv_tag = dtype, op, lend, start, recv_tag
        self.device, self.reduce = device, reduce


_COPY_ONLY = object()       # _Run.reduce of a run that consumes in Python but only copies


class _Spec:
    """One call as the one path runs it: its runs in order, then ``result()`` (default: what the
    last run's finish returned). ``collective``: it advances the call number (not point-to-point)."""

    __slots__ = ("runs", "result", "collective", "after")

    def __init__(self, runs, result=None, collective=True):
        self.runs, self.result, self.collective = runs, result, collective
        self.after = None

    def then(self, fn):
        """``fn(result)`` runs after the call, on the thread that ran it, and gives its result."""
        self.after = fn


def _op_code(op):
    """pyrdma._reduce's code of the element-wise op of a collective's op (avg sums)."""
    return _reduce.op_code("sum" if op == "avg" else op)


def _dtype_field(name):
    """describe()'s dtype of a CUDA broadcast: pyrdma._reduce's code, else numpy's type."""
    if name in _reduce.DTYPE_NAMES:
        return _reduce.DTYPE_NAMES.index(name)
    try:
        return np.dtype(name)
    except TypeError:
        return 0xFFFF


def init_from_env(**kwargs):
    """A Communicator from torchrun-style environment variables (MASTER_ADDR, MASTER_PORT, RANK,
    WORLD_SIZE); keyword arguments as for Communicator."""
    return Communicator.from_env(**kwargs)


def init_from_mpi(mpi_comm=None, **kwargs):
    """A Communicator whose rendezvous runs over an mpi4py communicator."""
    return Communicator.from_mpi(mpi_comm, **kwargs)
