"""One spec per collective: what a call of the Communicator runs, described once.

A spec function ``name(comm, *args)`` validates the call's arguments on the caller's thread, plans
its pieces (one Run each: the schedule's planner, the description every message carries, the work
area, what to copy in before and out after) and says what the call returns, as a Spec. The
Communicator runs every spec by one path (Communicator._call: blocking, or non-blocking on its
thread), so a collective's blocking and ``i*`` forms are the same spec; the one-call path of
pyrdma._hostcalls runs a spec's run as it is where its Layout says what it copies (hostplans). Adding a
collective is one planner with its registry entry (algorithms/), one spec here and its tests; the
specs take every algorithm's planner, properties and wire id from the registry.
"""
import functools

import numpy as np

from pyrdma import _reduce
from pyrdma.collectives import algorithms
from pyrdma.collectives.algorithms import exchange, rooted
from pyrdma.collectives.pieces import segment_bounds
from pyrdma.collectives.schedule import EXCHANGE, SPREAD
from pyrdma.collectives.transport import NO_ROOT, describe, describe_message
from pyrdma.collectives.work import HOST, Avg, Operand, byte_bounds, in_and_out, plain_bytes
from pyrdma.errors import UsageError

OPS = ("sum", "prod", "min", "max", "avg")
ALGORITHMS = ("auto",) + algorithms.names("allreduce") + tuple(algorithms.aliases("allreduce"))   # allreduce's
ROOTED_ALGORITHMS = algorithms.names("broadcast")       # broadcast's and reduce's (the same ones)


class Run:
    """One run of the engine in a call (a piece of a large reduction, or the whole call):
    ``plan(max_message)`` its Schedule, ``tag`` the description its messages carry (``recv_tag``
    the one they are received with, point-to-point), ``dtype``/``op`` the reduction's codes.
    ``layout`` (a Layout) gives the bytes of its work area (``area``: the transport's buffer, or
    ``lend[start:start + area]`` in place) and says what is copied from ``source`` (the call's
    input, flat uint8) before the run and into ``target`` (its output) after it; ``avg`` (an Avg,
    or None) scales the input copied in and the result before it is copied out; ``fill(work)``
    and ``finish(work, schedule, received)``, where given, do what a Layout cannot say (pieces
    given as a list, a received message's length). ``kind``: the kind of the lent memory
    (work.HostMemory's protocol: HOST, or GPU memory's DirectArea), which the transport
    registers, syncs, reads and writes it by, and which says whether received chunks are
    consumed in Python (its ``reduce``) instead of in C. ``out``: a second work area of host
    memory in place (flat uint8), where the schedule's offsets from ``area`` on lie (an
    all-to-all receives into the caller's output as it sends from its input)."""

    __slots__ = ("plan", "tag", "layout", "source", "target", "avg", "fill", "finish", "dtype", "op",
                 "lend", "start", "recv_tag", "kind", "out")

    def __init__(self, plan, tag, layout, source=None, target=None, avg=None, fill=None, finish=None,
                 dtype=0, op=0, lend=None, start=0, recv_tag=None, kind=HOST, out=None):
        self.plan, self.tag, self.layout = plan, tag, layout
        self.source, self.target, self.avg, self.fill, self.finish = source, target, avg, fill, finish
        self.dtype, self.op, self.lend, self.start, self.recv_tag = dtype, op, lend, start, recv_tag
        self.kind, self.out = kind, out

    @property
    def area(self):
        return self.layout.area


class Layout:
    """What a run copies, in terms of the call's shape alone, so that the one-call path (hostplans,
    pyrdma._hostcalls.HostCall) runs it in C on each call's own buffers as the general path runs it
    here: the work area is the transport's buffer of ``work_bytes`` (``lent`` None), or the caller's
    memory ("in": its input, "out": its output, "both": the input, and the output as a second
    area). Into the transport's buffer ``in_bytes`` of the input are copied at ``in_offset`` before
    the run, and ``out_bytes`` of the result out of it from ``result_offset`` (None: the
    schedule's) after; ``own`` (from, to, length): a block no message carries, copied before the
    run within the transport's buffer, or from the caller's input to its output where it lends
    them."""

    __slots__ = ("in_bytes", "out_bytes", "work_bytes", "in_offset", "result_offset", "own", "lent")

    def __init__(self, in_bytes, out_bytes, work_bytes, in_offset=0, result_offset=0, own=(0, 0, 0), lent=None):
        self.in_bytes, self.out_bytes, self.work_bytes = in_bytes, out_bytes, work_bytes
        self.in_offset, self.result_offset, self.own, self.lent = in_offset, result_offset, own, lent

    def copy_in(self, work, source, target):
        """Before the run: the input into the transport's buffer, and the own block."""
        a, b, n = self.own
        if self.lent is None:
            if self.in_bytes:
                work[self.in_offset:self.in_offset + self.in_bytes] = source[:self.in_bytes]
            if n:
                work[b:b + n] = work[a:a + n]
        elif n:
            target[b:b + n] = source[a:a + n]

    def copy_out(self, work, schedule, target):
        """After the run: the result out of the transport's buffer."""
        if self.lent is None and self.out_bytes:
            at = self.result(schedule)
            target[:self.out_bytes] = work[at:at + self.out_bytes]

    def inputs(self, work):
        """The input's bytes in the work area (what op="avg" scales first)."""
        at = self.in_offset if self.lent is None else 0
        return work[at:at + self.in_bytes]

    def result(self, schedule):
        return schedule.result_offset if self.result_offset is None else self.result_offset

    @property
    def area(self):
        """The bytes of the work area proper (where it lends both, the input's: the output is the
        run's second area)."""
        return self.in_bytes if self.lent == "both" else self.work_bytes


class Spec:
    """One call as the one path runs it: its runs in order, then ``result()`` (default: what the
    last run's finish returned). ``collective``: it advances the call number (not point-to-point)."""

    __slots__ = ("runs", "result", "collective")

    def __init__(self, runs, result=None, collective=True):
        self.runs, self.result, self.collective = runs, result, collective


def op_code(op):
    """pyrdma._reduce's code of the element-wise op of a collective's op (avg sums)."""
    return _reduce.op_code("sum" if op == "avg" else op)


def dtype_field(name):
    """describe()'s dtype of a CUDA broadcast: pyrdma._reduce's code, else numpy's type."""
    if name in _reduce.DTYPE_NAMES:
        return _reduce.DTYPE_NAMES.index(name)
    try:
        return np.dtype(name)
    except TypeError:
        return 0xFFFF


def check_op(op):
    if op not in OPS:
        raise UsageError(f"unsupported op {op!r}; supported: {', '.join(OPS)}")


# ---- the Communicator's choices, shared by the specs and the one-call path (hostplans) ----


def describe_call(comm, kind, entry, **fields):
    """The description of a collective about to be submitted (transport.describe) that runs the
    registry's Algorithm ``entry`` (its wire id goes in): every rank computes the same one for the
    same call, and every message carries it (the sequence number advances in Executor.submit, once
    the call was accepted)."""
    return describe(comm._exec.state.seq, kind, algorithm=entry.wire_name, **fields)


def work_pieces(comm, count, itemsize, factor=1):
    """Element ranges of at most max_work_bytes / factor bytes each (at least one range)."""
    per = max(1, comm.max_work_bytes // (itemsize * factor))
    if count <= per:
        return [(0, count)]
    return [(s, min(count, s + per)) for s in range(0, count, per)]


def check_algorithm(algorithm):
    if algorithm not in ALGORITHMS:
        raise UsageError(f"unknown algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}")
    return algorithms.canonical("allreduce", algorithm)


def rooted_algorithm(comm, algorithm, nbytes):
    if algorithm == "auto":
        return comm.cost_model.choose_rooted(nbytes, comm.size, comm.transport.max_message)
    if algorithm not in ROOTED_ALGORITHMS:
        raise UsageError(f"unknown algorithm {algorithm!r} for reduce/broadcast; use auto, "
                         f"{', '.join(ROOTED_ALGORITHMS)}")
    return algorithm


def copy_algorithm(comm, kind, algorithm, block):
    if algorithm == "auto":
        return comm.cost_model.choose_copy(kind, block, comm.size, comm.transport.max_message)
    if algorithm not in algorithms.names(kind):
        raise UsageError(f"unknown algorithm {algorithm!r} for {kind}; use auto, "
                         f"{', '.join(algorithms.names(kind))}")
    return algorithm


def check_root(comm, root):
    if not isinstance(root, (int, np.integer)) or not 0 <= root < comm.size:
        raise UsageError(f"root {root!r} is not a rank of this communicator (0..{comm.size - 1})")
    return int(root)


def zero_copy(comm, nbytes):
    """Whether a collective works on ``nbytes`` of the caller's memory itself (registered, no
    copies) rather than on the transport's buffer. Below zero_copy_bytes a copy costs less than a
    registration (RDMA), and the one-call path, which copies, costs less Python than lending does."""
    return bool(comm.zero_copy_bytes) and nbytes >= comm.zero_copy_bytes


def lends_blocks(comm, nbytes):
    """zero_copy for an all-to-all, gather or scatter of ``nbytes`` in a caller's buffer: also from
    the cost model's lend_bytes where that is lower (a software RDMA device or TCP, where each copy is the
    CPU's, and from which a registration pays for itself even when the buffer is not reused)."""
    lend = comm.cost_model.lend_bytes
    return zero_copy(comm, nbytes) or bool(comm.zero_copy_bytes and lend) and nbytes >= lend


def lends_freely(comm):
    """Whether lending the caller's memory costs nothing: over TCP the sockets send from it and
    read into it, while over RDMA a buffer needs its registration (and a receiver's, a rendezvous
    for remote writes)."""
    return comm.transport.engine.sockets


def lends_message(comm, nbytes):
    """zero_copy for a lone send or receive of ``nbytes``: over RDMA from zero_copy_bytes (a
    rendezvous), over TCP at any size, where lending costs nothing (lends_freely; 2 ranks, a
    ping-pong: 0.99-1.01x the time of copying up to 8 KiB, 0.77-0.91x at 16-256 KiB, 0.63x at
    512 KiB)."""
    if lends_freely(comm):
        return bool(comm.zero_copy_bytes) and nbytes > 0
    return zero_copy(comm, nbytes)


def alltoall_lends(comm, in_bytes, out_bytes):
    """Whether an all-to-all sends from its input and receives into its output where they are
    (they must not overlap): from ``total`` bytes of both together, or ``each`` bytes in each of
    them (alltoall_lend_sizes)."""
    total, each = alltoall_lend_sizes(comm)
    return (total is not None and in_bytes + out_bytes >= total) or \
        (each is not None and min(in_bytes, out_bytes) >= each)


def alltoall_lend_sizes(comm):
    """(total, each) of alltoall_lends (None: never), for the general path and the one-call path
    alike: from zero_copy_bytes of both together, and below it where each is large enough for its
    registration (lends_blocks: RDMA's; over TCP the cost model's lend size too)."""
    zc, lend = comm.zero_copy_bytes, comm.cost_model.lend_bytes
    return (zc or None), (lend if zc and lend else None)


def alltoall_entry(comm, block):
    """The registry entry of an all-to-all of ``block`` bytes per rank, the cost model's choice;
    ``block`` None where the counts differ per rank (alltoallv): the choice must be every rank's."""
    algo = comm.cost_model.choose_copy("alltoall", block, comm.size, comm.transport.max_message)
    try:
        return algorithms.ALGORITHMS["alltoall"][algo]
    except KeyError:
        raise UsageError(f"the cost model chose an unknown all-to-all algorithm {algo!r}") from None


def alltoall_planner(comm, entry, counts):
    """``entry``'s planner; the write one, for an all-to-all with ``counts``, writes only the blocks
    from the cost model's written_from and sends the others through the slots as the cheapest for
    a small block does (its steps: every rank's own choice, made on sizes its peers share)."""
    if entry.name != "write" or not counts:
        return entry.planner
    model, mm = comm.cost_model, comm.transport.max_message
    written = model.written_from(mm)
    slots = SPREAD if model.cheapest("alltoall", 0, comm.size, mm) == "spread" else EXCHANGE
    return functools.partial(entry.planner, written_from=0 if written is None else written, slots=slots)


def allreduce_work(comm, entry, nbytes):
    """(in place?, work bytes) of an allreduce of ``nbytes`` by the Algorithm ``entry``, for the
    general path and the one-call path alike: in place when zero_copy, except by an algorithm that
    needs room for a second copy (recursive doubling: the registry's double_area)."""
    if entry.double_area:
        return False, 2 * nbytes
    return zero_copy(comm, nbytes), nbytes


def chosen_allreduce(comm, algorithm, nbytes):
    """``algorithm`` (a checked name), or for "auto" the cost model's choice for ``nbytes``."""
    if algorithm != "auto":
        return algorithm
    algo = comm.cost_model.choose_allreduce(nbytes, comm.size, comm.transport.max_message)
    algo = algorithms.canonical("allreduce", algo)
    if algo not in algorithms.ALGORITHMS["allreduce"]:
        raise UsageError(f"the cost model chose an unknown algorithm {algo!r}")
    return algo


def allreduce_plan(comm, src, op, algorithm, kind="allreduce", in_place=False):
    """[(lo, hi, Algorithm, description)] of the pieces of an allreduce of ``src``. ``in_place``:
    the algorithms run on the caller's memory, so none that needs a second copy of it (the
    registry's in_place_instead runs instead)."""
    plan = []
    registered = algorithms.ALGORITHMS["allreduce"]
    for lo, hi in work_pieces(comm, src.count, src.itemsize):
        entry = registered[chosen_allreduce(comm, algorithm, (hi - lo) * src.itemsize)]
        if in_place and entry.double_area:
            entry = registered[entry.in_place_instead]
        tag = describe_call(comm, kind, entry, op=op, dtype=src.code, count=src.count, lo=lo, hi=hi)
        plan.append((lo, hi, entry, tag))
    return plan


# ---- the specs ------------------------------------------------------------------------------


def allreduce(comm, buf, out, op, algorithm, dtype):
    check_op(op)
    algorithm = check_algorithm(algorithm)
    src, dst = in_and_out(buf, out, dtype, writes=True)
    avg = Avg(op, src.code, comm.size) if op == "avg" else None
    return Spec(allreduce_runs(comm, src, dst, op, algorithm, avg), lambda: dst.obj)


def allreduce_runs(comm, src, dst, op, algorithm, avg, direct=False):
    """The runs of an allreduce of ``src`` into ``dst`` (work areas: ``bytes``, ``count``,
    ``itemsize``, ``code``), op="avg" scaled by ``avg`` (None: no scaling). Host memory goes
    through the transport's buffer, or in place on dst where zero_copy; ``direct``: src is dst, a
    work area of its own kind (see allreduce_direct), always in place, with its own reductions."""
    runs = []
    memory = src if direct else HOST
    for lo, hi, entry, tag in allreduce_plan(comm, src, op, algorithm, "allreduce-direct" if direct else "allreduce",
                                             in_place=direct):
        a, b = lo * src.itemsize, hi * src.itemsize
        n = b - a
        in_place, work_bytes = (True, n) if direct else allreduce_work(comm, entry, n)
        if not in_place:
            layout = Layout(n, n, work_bytes, result_offset=None)
        elif src is dst:
            layout = Layout(n, n, n, lent="in")
        else:                               # in place on out, buf copied there first
            layout = Layout(n, n, n, own=(0, 0, n), lent="out")
        plan = functools.partial(entry.planner, comm.size, comm.rank, hi - lo, src.itemsize)
        runs.append(Run(plan, tag, layout, src.bytes[a:b], dst.bytes[a:b], avg,
                        dtype=src.code, op=op_code(op), lend=dst.bytes if in_place else None, start=a, kind=memory))
    return runs


def reduce(comm, buf, out, op, root, algorithm, dtype):
    check_op(op)
    root = check_root(comm, root)
    src, dst = in_and_out(buf, out, dtype, writes=comm.rank == root)
    avg = Avg(op, src.code, comm.size) if op == "avg" else None
    runs = []
    for lo, hi in work_pieces(comm, src.count, src.itemsize):
        entry = algorithms.ALGORITHMS["reduce"][rooted_algorithm(comm, algorithm, (hi - lo) * src.itemsize)]
        a, b = lo * src.itemsize, hi * src.itemsize
        plan = functools.partial(entry.planner, comm.size, comm.rank, hi - lo, src.itemsize, root=root)
        tag = describe_call(comm, "reduce", entry, op=op, dtype=src.code, count=src.count, root=root, lo=lo, hi=hi)
        layout = Layout(b - a, b - a if comm.rank == root else 0, b - a)
        runs.append(Run(plan, tag, layout, src.bytes[a:b], dst.bytes[a:b], avg, dtype=src.code, op=op_code(op)))
    return Spec(runs, lambda: dst.obj if comm.rank == root else None)


def broadcast(comm, buf, root, algorithm):
    root = check_root(comm, root)
    arr, data = plain_bytes(buf, "buf", writable=comm.rank != root)    # any dtype: broadcast copies bytes
    is_root = comm.rank == root
    runs = []
    for lo, hi in work_pieces(comm, data.nbytes, 1):
        entry = algorithms.ALGORITHMS["broadcast"][rooted_algorithm(comm, algorithm, hi - lo)]
        # in place the root only sends from its buffer (which may be read-only)
        lend = data if zero_copy(comm, hi - lo) else None
        n = hi - lo
        layout = Layout(n, n, n, lent="in") if lend is not None else Layout(n if is_root else 0,
                                                                            0 if is_root else n, n)
        plan = functools.partial(entry.planner, comm.size, comm.rank, n, 1, root=root)
        tag = describe_call(comm, "broadcast", entry, dtype=arr.dtype, count=data.nbytes, root=root, lo=lo, hi=hi)
        runs.append(Run(plan, tag, layout, data[lo:hi], data[lo:hi], lend=lend, start=lo))
    return Spec(runs, lambda: buf)


def allgather_shape(comm, shape):
    """The shape of a new allgather result: the blocks concatenated along the first axis."""
    return (comm.size * shape[0],) + tuple(shape[1:]) if shape else (comm.size,)


def allgather(comm, buf, out):
    arr, src = plain_bytes(buf, "buf")
    users_out = out is not None
    if out is None:
        out = np.empty(allgather_shape(comm, arr.shape), arr.dtype)
    dst_arr, dst = plain_bytes(out, "out", writable=True)
    if dst_arr.dtype != arr.dtype or dst_arr.size != arr.size * comm.size:
        raise UsageError(f"out must hold {comm.size} x {arr.size} elements of {arr.dtype}; "
                         f"it has {dst_arr.size} of {dst_arr.dtype}")
    block = src.nbytes
    total = block * comm.size
    at = comm.rank * block
    # a fresh out= of ours would be registered (and kept) once per call: copy instead
    if users_out and zero_copy(comm, total):
        lend, layout = dst, Layout(block, total, total, own=(0, at, block), lent="out")
    else:
        lend, layout = None, Layout(block, total, total, in_offset=at)
    # blocks as "elements" of one byte: boundaries at multiples of the block size
    entry = algorithms.only("allgather")
    plan = functools.partial(entry.planner, comm.size, comm.rank, total, 1,
                             bounds=tuple(i * block for i in range(comm.size + 1)))
    tag = describe_call(comm, "allgather", entry, dtype=arr.dtype, count=arr.size)
    return Spec([Run(plan, tag, layout, src, dst, lend=lend)], lambda: out)


def reduce_scatter(comm, buf, out, op, dtype):
    check_op(op)
    src = Operand(buf, "buf", writable=False, dtype=dtype)
    bounds = segment_bounds(src.count, comm.size)
    start, stop = bounds[comm.rank], bounds[comm.rank + 1]
    if out is None:
        out = np.empty(stop - start, src.array.dtype)
    dst = Operand(out, "out", writable=True, dtype=dtype)
    src.same_type(dst, "out")
    if dst.count != stop - start:
        raise UsageError(f"out must hold this rank's {stop - start} elements (segment_bounds), it has {dst.count}")
    avg = Avg(op, src.code, comm.size) if op == "avg" else None
    a, b = start * src.itemsize, stop * src.itemsize
    entry = algorithms.only("reduce_scatter")
    plan = functools.partial(entry.planner, comm.size, comm.rank, src.count, src.itemsize, bounds=tuple(bounds))
    tag = describe_call(comm, "reduce_scatter", entry, op=op, dtype=src.code, count=src.count)
    layout = Layout(src.nbytes, b - a, src.nbytes, result_offset=a)
    return Spec([Run(plan, tag, layout, src.bytes, dst.bytes, avg, dtype=src.code, op=op_code(op))],
                lambda: dst.obj)


def barrier(comm):
    entry = algorithms.only("barrier")
    plan = lambda max_message: entry.planner(comm.size, comm.rank)    # noqa: E731
    return Spec([Run(plan, describe_call(comm, "barrier", entry), Layout(0, 0, 0))])


def gather(comm, buf, out, root, algorithm):
    root = check_root(comm, root)
    arr, data = plain_bytes(buf, "buf")
    block, n, r = data.nbytes, comm.size, comm.rank
    dst = None
    if r == root:
        if out is None:
            out = np.empty((n * arr.shape[0],) + arr.shape[1:] if arr.ndim else (n,), arr.dtype)
        dst_arr, dst = plain_bytes(out, "out", writable=True)
        if dst_arr.dtype != arr.dtype or dst.nbytes != n * block:
            raise UsageError(f"out must hold {n} x {arr.size} elements of {arr.dtype}; it has {dst_arr.size} "
                             f"of {dst_arr.dtype}")

    def layout(full, algo, at, area, zero_copy):
        # the root receives into out, its own block copied there; a rank that only sends its
        # block sends it from buf
        if zero_copy and r == root:
            return Layout(block, n * block, n * block, own=(0, at, block), lent="out"), dst
        if zero_copy and not full:
            return Layout(block, 0, block, lent="in"), data
        return Layout(block, n * block if r == root else 0, area, in_offset=at), None
    spec = rooted_copy(comm, "gather", root, algorithm, arr.dtype, arr.size, block, data, dst, layout)
    spec.result = lambda: out if r == root else None
    return spec


def scatter(comm, buf, out, root, algorithm):
    root = check_root(comm, root)
    n, r = comm.size, comm.rank
    src = pieces = None
    if isinstance(buf, (list, tuple)):         # one piece per rank, each where it lies
        if len(buf) != n:
            raise UsageError(f"scatter: buf is a list of {len(buf)} pieces; it needs one per rank ({n})")
        pieces = [plain_bytes(piece, f"buf[{i}]") for i, piece in enumerate(buf)]
        if out is None:
            out = np.empty_like(pieces[0][0])
    elif buf is not None:
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
    if pieces is not None:
        bad = [i for i, (a, d) in enumerate(pieces) if a.dtype != out_arr.dtype or d.nbytes != block]
        if bad:
            a = pieces[bad[0]][0]
            raise UsageError(f"buf[{bad[0]}] must be a piece like out ({out_arr.size} elements of {out_arr.dtype}); "
                             f"it has {a.size} of {a.dtype}")
        if r == root and n > 1 and lends_blocks(comm, block) and \
                copy_algorithm(comm, "scatter", algorithm, block) == "direct":
            return _scatter_parts(comm, pieces, out, dst, root, block, out_arr)

    def layout(full, algo, at, area, zero_copy):
        # the root sends from buf, its own block copied into out (but an RDMA READ needs its own
        # buffer's remote access; a list of pieces is copied in below the zero-copy size); a rank
        # that only receives its block receives it into out
        if zero_copy and r == root and pieces is None and algo != "read":
            return Layout(n * block, block, n * block, own=(at, 0, block), lent="in"), src
        if zero_copy and r != root and not full:
            return Layout(0, block, block, lent="out"), dst
        return Layout(n * block if r == root and pieces is None else 0, block, area, result_offset=at), None
    spec = rooted_copy(comm, "scatter", root, algorithm, out_arr.dtype, out_arr.size, block, src, dst, layout)
    if pieces is not None and r == root:          # (copied in below the zero-copy size)
        def fill(work):
            for i, (_, piece) in enumerate(pieces):
                work[i * block:(i + 1) * block] = piece
        spec.runs[0].fill = fill
    spec.result = lambda: out
    return spec


def _scatter_parts(comm, pieces, out, dst, root, block, out_arr):
    """The root's direct scatter from a list of pieces in place: one run per other rank, sending
    its piece from where it lies (registered over RDMA), the root's own piece copied; the other
    ranks run the plain scatter (algorithms.rooted.direct_scatter_part)."""
    n, r = comm.size, comm.rank
    entry = algorithms.ALGORITHMS["scatter"]["direct"]
    tag = describe_call(comm, "scatter", entry, dtype=out_arr.dtype, count=out_arr.size, root=root)
    others = [(root + k) % n for k in range(1, n)]
    runs = [Run(functools.partial(rooted.direct_scatter_part, n, r, root, block, peer=p, last=p == others[-1]),
                tag, Layout(block, 0, block, own=(0, 0, block) if p == others[-1] else (0, 0, 0), lent="in"),
                pieces[r][1], dst, lend=pieces[p][1]) for p in others]
    return Spec(runs, lambda: out)


def rooted_copy(comm, kind, root, algorithm, dtype, count, block, source, target, layout):
    """The spec of a gather or scatter of ``block`` bytes per rank, from ``source`` into
    ``target`` (the caller's input and output here; None where this rank has none). The work area
    holds every rank's block in rank order where the root or the algorithm needs them all, else
    this rank's at 0; ``layout(full, algorithm, at, area, zero_copy)`` gives the run's Layout and the
    caller's memory it works in (None: the transport's buffer), where zero-copy pays on
    ``area``."""
    n, r = comm.size, comm.rank
    algo = copy_algorithm(comm, kind, algorithm, block)
    entry = algorithms.ALGORITHMS[kind][algo]
    full = entry.full_area or r == root
    at = r * block if full else 0
    area = n * block if full else block
    lay, lend = layout(full, algo, at, area, lends_blocks(comm, area))
    return Spec([Run(functools.partial(entry.planner, n, r, root, block),
                     describe_call(comm, kind, entry, dtype=dtype, count=count, root=root),
                     lay, source, target, lend=lend)])


def alltoall(comm, buf, out, send_counts, recv_counts):
    n, r = comm.size, comm.rank
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
            recv_counts = comm.alltoall(mine)
        rb = byte_bounds(recv_counts, "recv_counts", n, item)
        if sb[r + 1] - sb[r] != rb[r + 1] - rb[r]:
            raise UsageError(f"rank {r} sends itself {(sb[r + 1] - sb[r]) // item} elements (send_counts[{r}]) "
                             f"but expects {(rb[r + 1] - rb[r]) // item} (recv_counts[{r}]): they must be equal")
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
    entry = alltoall_entry(comm, sb[1] if send_counts is None else None)
    tag = describe_call(comm, "alltoall", entry, dtype=arr.dtype, count=count)
    plan = functools.partial(alltoall_planner(comm, entry, send_counts is not None), n, r, sb, rb, base)
    own = sb[r + 1] - sb[r]
    if alltoall_lends(comm, base, rb[-1]) and not np.shares_memory(src, dst):
        # sent from buf and received into out where they are: no copy in or out
        layout = Layout(base, rb[-1], base + rb[-1], own=(sb[r], rb[r], own), lent="both")
        return Spec([Run(plan, tag, layout, src, dst, lend=src, out=dst)], lambda: out)
    # through the transport's buffer, this rank's own piece copied there (out may be buf itself)
    layout = Layout(base, rb[-1], base + rb[-1], result_offset=base, own=(sb[r], base + rb[r], own))
    return Spec([Run(plan, tag, layout, src, dst)], lambda: out)


def p2p(comm, buf, dst, src, tag, numbered=True):
    """A send (dst), a receive (src) or both (buf and tag pairs: send's, receive's): one message
    each way. ``numbered``: the messages take the pair's next numbers (else 0: the one-call path
    numbers each call's)."""
    send_tag, recv_tag = tag if isinstance(tag, tuple) else (tag, tag)
    for t in (send_tag, recv_tag):
        if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < NO_ROOT:
            raise UsageError(f"tag must be an integer in [0, {NO_ROOT}), got {t!r}")
    sendbuf, recvbuf = buf if isinstance(buf, tuple) else ((buf, None) if dst is not None else (None, buf))
    for peer, what in ((dst, "dst"), (src, "src")):
        if peer is not None and (not isinstance(peer, (int, np.integer)) or not 0 <= peer < comm.size):
            raise UsageError(f"{what} {peer!r} is not a rank of this communicator (0..{comm.size - 1})")
    s_arr = r_arr = s_data = r_data = None
    if sendbuf is not None:
        s_arr, s_data = plain_bytes(sendbuf, "buf" if recvbuf is None else "sendbuf")
    if recvbuf is not None:
        r_arr, r_data = plain_bytes(recvbuf, "buf" if sendbuf is None else "recvbuf", writable=True)
    if dst == comm.rank or src == comm.rank:
        raise UsageError(f"rank {comm.rank} sends or receives a message to itself; copy the array instead")
    item = r_arr.dtype.itemsize if r_arr is not None else 1
    send_desc = recv_desc = describe(0, "")
    sent, received = comm._exec.sent, comm._exec.received
    if dst is not None:
        send_desc = describe_message(sent[dst] if numbered else 0, s_data.nbytes, s_arr.dtype, send_tag)
        if numbered:
            sent[dst] += 1
    if src is not None:
        recv_desc = describe_message(received[src] if numbered else 0, 0, r_arr.dtype, recv_tag)
        if numbered:
            received[src] += 1
    nbytes = s_data.nbytes if s_data is not None else 0
    capacity = r_data.nbytes if r_data is not None else 0
    # a lone send or receive works on the caller's memory itself when zero-copy pays; an exchange
    # where lending costs nothing (TCP) sends from sendbuf and receives into recvbuf, the second area
    lend = layout = out = None
    if recvbuf is None and lends_message(comm, nbytes):
        lend, layout = s_data, Layout(nbytes, 0, nbytes, lent="in")
    elif sendbuf is None and lends_message(comm, capacity):
        lend, layout = r_data, Layout(0, capacity, capacity, lent="out")
    elif sendbuf is not None and recvbuf is not None and lends_freely(comm) and nbytes and capacity \
            and not np.may_share_memory(s_data, r_data):
        lend, out, layout = s_data, r_data, Layout(nbytes, capacity, nbytes + capacity, lent="both")
    area = nbytes + capacity if lend is None else (nbytes or capacity)
    if layout is None:          # through the transport's buffer; what arrived is copied out by finish
        layout = Layout(nbytes, 0, area)

    def finish(work, schedule, received):
        if src is None:
            return None
        if received % item:
            raise UsageError(f"rank {src} sent {received} bytes, not whole {item}-byte elements of "
                             f"{r_arr.dtype}")
        if lend is None and received:
            r_data[:received] = work[nbytes:nbytes + received]
        return received // item
    plan = functools.partial(exchange.message, dst, nbytes, src, capacity, 0 if layout.lent == "out" else nbytes)
    return Spec([Run(plan, send_desc, layout, s_data, finish=finish, lend=lend, recv_tag=recv_desc, out=out)],
                collective=False)


def allreduce_direct(comm, area, op, algorithm):
    """allreduce in place on a work area that is not the transport's: ``area`` has the memory
    (``bytes``, a flat uint8 array that the transport sends from directly: GPU memory through
    pyrdma.cuda's DirectArea), ``count``, ``itemsize``, ``code``, the steps of op="avg"
    ``before(work)`` and ``after(work)`` (as Avg's), and is the kind of its memory
    (work.HostMemory's protocol, with its reductions ``reduce``)."""
    return Spec(allreduce_runs(comm, area, area, op, algorithm, area if op == "avg" else None, direct=True))


def broadcast_direct(comm, area, root, algorithm):
    """broadcast of ``area.bytes`` (flat uint8, GPU memory included; ``area`` is the kind of its
    memory, as allreduce_direct's) from root, sent from directly."""
    runs = []
    for lo, hi in work_pieces(comm, area.bytes.nbytes, 1):
        entry = algorithms.ALGORITHMS["broadcast"][rooted_algorithm(comm, algorithm, hi - lo)]
        plan = functools.partial(entry.planner, comm.size, comm.rank, hi - lo, 1, root=root)
        tag = describe_call(comm, "broadcast-direct", entry, dtype=dtype_field(area.dtype_name),
                            count=area.bytes.nbytes, root=root, lo=lo, hi=hi)
        runs.append(Run(plan, tag, Layout(hi - lo, hi - lo, hi - lo, lent="in"), lend=area.bytes, start=lo,
                        kind=area))
    return Spec(runs)
