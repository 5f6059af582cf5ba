"""The one-call path's plans: the HostCalls that pyrdma._hostcalls.HostCollectives runs.

Each function prepares one blocking call of host memory over RDMA for a buffer's format and size
(HostCollectives caches the result per shape) with the same plan, description and work area as the
general path's spec (pyrdma.collectives.specs), so both paths interoperate message for message; it
returns None where the general path must run the call (and raise the errors of bad arguments).
"""
import numpy as np

from pyrdma import _reduce
from pyrdma._hostcalls import LENT_BOTH, LENT_IN, LENT_NONE, LENT_OUT, HostCall
from pyrdma.buffers import host_array
from pyrdma.collectives import algorithms, specs
from pyrdma.collectives.algorithms import exchange
from pyrdma.collectives.pieces import segment_bounds
from pyrdma.collectives.specs import ALGORITHMS, OPS
from pyrdma.collectives.transport import NO_ROOT, describe_message
from pyrdma.collectives.work import Operand, plain_bytes
from pyrdma.errors import UsageError


def allreduce(comm, buf, op, algorithm):
    """What HostCollectives needs to run ``allreduce(buf, op=op, algorithm=algorithm)`` as one C
    call, again for every buffer of the same format and size (its cache key): a HostCall, with the
    same plan, description and work area as the general path (specs.allreduce); or None where the
    general path must run it (avg, one piece too many, arguments it rejects with their error)."""
    if algorithm not in ALGORITHMS:
        return None
    src = _reduction(buf, op, True)
    if src is None or src.nbytes > comm.max_work_bytes:
        return None
    plan = specs.allreduce_plan(comm, src, op, specs.check_algorithm(algorithm))
    if len(plan) != 1:
        return None
    (lo, hi, entry, tag), = plan
    t = comm.transport
    schedule = entry.planner(comm.size, comm.rank, src.count, src.itemsize, t.max_message)
    in_place, work_bytes = specs.allreduce_work(comm, entry, src.nbytes)
    return HostCall(t.engine.program(schedule), tag, src.code, specs.op_code(op), src.nbytes, schedule.result_offset,
                    work_bytes, None if in_place else t.own_region(work_bytes))


def _reduction(buf, op, writable):
    """The Operand of a reduction's input that the one-call path runs, or None (avg, bfloat16, no
    elements, or a buffer the general path refuses with its error)."""
    if op not in OPS or op == "avg":
        return None
    try:
        src = Operand(buf, "buf", writable=writable)
    except UsageError:
        return None
    return None if src.count == 0 or src.code == _reduce.BFLOAT16 else src


def reduce(comm, buf, op, root, algorithm):
    """The HostCall of a blocking ``reduce(buf, op=op, root=root, algorithm=algorithm)`` in place
    (the result into buf on the root; the other ranks' buffers are read): the same plan and
    description as the general path's (specs.reduce); or None where that one must run it."""
    src = _reduction(buf, op, comm.rank == root)
    if src is None or src.nbytes > comm.max_work_bytes:
        return None
    try:
        entry = algorithms.ALGORITHMS["reduce"][specs.rooted_algorithm(comm, algorithm, src.nbytes)]
    except UsageError:
        return None
    t = comm.transport
    schedule = entry.planner(comm.size, comm.rank, src.count, src.itemsize, t.max_message, root=root)
    tag = specs.describe_call(comm, "reduce", entry, op=op, dtype=src.code, count=src.count, root=root, lo=0,
                              hi=src.count)
    return HostCall(t.engine.program(schedule), tag, src.code, specs.op_code(op), src.nbytes, 0, src.nbytes,
                    t.own_region(src.nbytes), out_bytes=src.nbytes if comm.rank == root else 0)


def broadcast(comm, buf, root, algorithm):
    """The HostCall of a blocking ``broadcast(buf, root=root, algorithm=algorithm)`` copied through the
    transport's buffer (below the zero-copy size): the same plan and description as the general
    path's (specs.broadcast); or None."""
    is_root = comm.rank == root
    try:
        arr, data = plain_bytes(buf, "buf", writable=not is_root)
        entry = algorithms.ALGORITHMS["broadcast"][specs.rooted_algorithm(comm, algorithm, data.nbytes)]
    except UsageError:
        return None
    nbytes = data.nbytes
    if not nbytes or nbytes > comm.max_work_bytes or specs.zero_copy(comm, nbytes):
        return None
    t = comm.transport
    schedule = entry.planner(comm.size, comm.rank, nbytes, 1, t.max_message, root=root)
    tag = specs.describe_call(comm, "broadcast", entry, dtype=arr.dtype, count=nbytes, root=root, lo=0, hi=nbytes)
    return HostCall(t.engine.program(schedule), tag, 0, 0, nbytes if is_root else 0, 0, nbytes,
                    t.own_region(nbytes), out_bytes=0 if is_root else nbytes)


def allgather(comm, buf):
    """The HostCall of a blocking allgather of ``buf`` into a buffer of size x its bytes, copied
    through the transport's buffer (below the zero-copy size): the same plan and description as the
    general path's (specs.allgather); or None."""
    try:
        arr, data = plain_bytes(buf, "buf")
    except UsageError:
        return None
    n, r, block = comm.size, comm.rank, data.nbytes
    total = n * block
    if not block or specs.zero_copy(comm, total):
        return None
    t = comm.transport
    entry = algorithms.only("allgather")
    schedule = entry.planner(n, r, total, 1, t.max_message, bounds=tuple(i * block for i in range(n + 1)))
    tag = specs.describe_call(comm, "allgather", entry, dtype=arr.dtype, count=arr.size)
    return HostCall(t.engine.program(schedule), tag, 0, 0, block, 0, total, t.own_region(total),
                    in_offset=r * block, out_bytes=total)


def reduce_scatter(comm, buf, op):
    """The HostCall of a blocking ``reduce_scatter(buf, op=op)``: the input copied into the
    transport's buffer, this rank's segment (segment_bounds) out of it; the same plan and
    description as the general path's (specs.reduce_scatter); or None."""
    src = _reduction(buf, op, False)
    if src is None:
        return None
    bounds = segment_bounds(src.count, comm.size)
    a, b = bounds[comm.rank] * src.itemsize, bounds[comm.rank + 1] * src.itemsize
    t = comm.transport
    entry = algorithms.only("reduce_scatter")
    schedule = entry.planner(comm.size, comm.rank, src.count, src.itemsize, t.max_message, bounds=tuple(bounds))
    tag = specs.describe_call(comm, "reduce_scatter", entry, op=op, dtype=src.code, count=src.count)
    return HostCall(t.engine.program(schedule), tag, src.code, specs.op_code(op), src.nbytes, a, src.nbytes,
                    t.own_region(src.nbytes), out_bytes=b - a)


def alltoall(comm, buf):
    """The HostCall of a blocking all-to-all of equal pieces (see allreduce): the
    same plan and description as the general path's (specs.alltoall), from the zero-copy size on
    sent from buf and received into out where they are, as there; or None where that one must run
    it."""
    try:
        arr, data = plain_bytes(buf, "buf")
    except UsageError:
        return None
    n, r = comm.size, comm.rank
    if arr.size % n or not data.nbytes:
        return None
    piece = data.nbytes // n
    bounds = tuple(i * piece for i in range(n + 1))
    t = comm.transport
    try:
        entry = specs.alltoall_entry(comm, piece)
    except UsageError:
        return None
    schedule = entry.planner(n, r, bounds, bounds, data.nbytes, t.max_message)
    tag = specs.describe_call(comm, "alltoall", entry, dtype=arr.dtype, count=arr.size)
    if specs.zero_copy(comm, 2 * data.nbytes):
        return HostCall(t.engine.program(schedule), tag, 0, 0, data.nbytes, 0, 2 * data.nbytes, None,
                        own=(r * piece, r * piece, piece), out_bytes=data.nbytes, lent=LENT_BOTH)
    return HostCall(t.engine.program(schedule), tag, 0, 0, data.nbytes, data.nbytes, 2 * data.nbytes,
                    t.own_region(2 * data.nbytes), own=(r * piece, data.nbytes + r * piece, piece))


def rooted_copy(comm, kind, piece, root, algorithm):
    """A gather's or scatter's (``kind``) HostCall for this rank's ``piece`` (gather: its input,
    scatter: its output): the same plan, description and work area as the general path's
    (specs.rooted_copy, whose ``lend`` the zero-copy size decides here alike); or None."""
    try:
        arr, data = plain_bytes(piece, "buf")
        algo = specs.copy_algorithm(comm, kind, algorithm, data.nbytes)
    except UsageError:
        return None
    n, r, block = comm.size, comm.rank, data.nbytes
    entry = algorithms.ALGORITHMS[kind][algo]
    full = entry.full_area or r == root
    at = r * block if full else 0
    t = comm.transport
    schedule = entry.planner(n, r, root, block, t.max_message)
    tag = specs.describe_call(comm, kind, entry, dtype=arr.dtype, count=arr.size, root=root)
    area = n * block if full else block
    lent = LENT_NONE
    if specs.zero_copy(comm, area):      # the caller's memory is the work area where specs' lend says so
        if kind == "gather":
            lent = LENT_OUT if r == root else (LENT_IN if not full else LENT_NONE)
        else:                            # (the read algorithm's root offers its own, remotely readable, buffer)
            lent = (LENT_IN if algo != "read" else LENT_NONE) if r == root else (LENT_OUT if not full else LENT_NONE)
    prog = t.engine.program(schedule)
    if lent != LENT_NONE and kind == "gather":
        return HostCall(prog, tag, 0, 0, block, 0, n * block if r == root else block, None, lent=lent,
                        own=(0, at, block) if r == root else (0, 0, 0), out_bytes=n * block if r == root else 0)
    if lent != LENT_NONE:
        return HostCall(prog, tag, 0, 0, n * block if r == root else 0, 0, n * block if r == root else block, None,
                        lent=lent, own=(at, 0, block) if r == root else (0, 0, 0), out_bytes=block)
    if kind == "gather":          # in: this rank's block; out: all of them, on the root
        return HostCall(prog, tag, 0, 0, block, 0, area, t.own_region(area), in_offset=at,
                        out_bytes=n * block if r == root else 0)
    return HostCall(prog, tag, 0, 0, n * block if r == root else 0, at, area, t.own_region(area), out_bytes=block)


def message(comm, buf, peer, tag, receive):
    """The HostCall of a blocking send to or receive from ``peer`` with ``tag``,
    copied through the transport's buffer: the same plan and description as the general path's
    (specs.p2p), whose message number HostCollectives fills in per call; or None."""
    if not 0 <= tag < NO_ROOT:
        return None
    try:
        arr, data = plain_bytes(buf, "buf", writable=receive)
    except UsageError:
        return None
    t, nbytes = comm.transport, data.nbytes
    if receive:
        schedule = exchange.message(None, 0, peer, nbytes, 0, t.max_message)
        desc = describe_message(0, 0, arr.dtype, tag)
        return HostCall(t.engine.program(schedule), desc, 0, 0, 0, 0, nbytes, t.own_region(nbytes), out_bytes=0)
    schedule = exchange.message(peer, nbytes, None, 0, nbytes, t.max_message)
    desc = describe_message(0, nbytes, arr.dtype, tag)
    return HostCall(t.engine.program(schedule), desc, 0, 0, nbytes, 0, nbytes, t.own_region(nbytes), out_bytes=0)


def barrier(comm):
    """The HostCall of barrier() (see allreduce): the same plan and description
    as the general path's."""
    t, entry = comm.transport, algorithms.only("barrier")
    return HostCall(t.engine.program(entry.planner(comm.size, comm.rank)), specs.describe_call(comm, "barrier", entry),
                    0, 0, 0, 0, 0, t.own_region(0))


def registration(comm, buf):
    """The MemoryRegion of a host buffer that an allreduce works on in place."""
    return comm.transport.registration(host_array(buf, "buf").reshape(-1).view(np.uint8))[0]
