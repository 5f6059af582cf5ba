"""The one-call path's plans: the HostCalls that pyrdma._hostcalls.HostCollectives runs.

A HostCall is the general path's own spec (pyrdma.collectives.specs) of the call, prepared once
per shape: its one run's schedule as the engine's Program, its description, and its Layout (what
the run copies in and out, in terms of the shape alone), so both paths run the same plan message
for message. Each function below builds the spec from the arguments HostCollectives has and
returns None where the general path must run the call: a spec of several runs, a run that does
more than its Layout says (pieces given as a list; an op="avg" in the caller's memory), one in
the caller's memory where the one-call path does not lend it, and arguments the spec refuses (the
general path raises their error).
"""
import threading

import numpy as np

from pyrdma._hostcalls import (AVG_DIVIDE, AVG_NONE, AVG_SCALE, LENT_BOTH, LENT_IN, LENT_NONE, LENT_OUT, AlltoallvPlan,
                               HostCall)
from pyrdma.buffers import host_array
from pyrdma.collectives import specs
from pyrdma.errors import UsageError

_LENT = {None: LENT_NONE, "in": LENT_IN, "out": LENT_OUT, "both": LENT_BOTH}


class _Grows(Exception):
    """A call prepared beside queued ones needs the transport's own buffer grown."""


_beside = threading.local()     # .queued: this thread prepares beside queued calls (beside_queued)


def beside_queued(prepare, args):
    """``(prepare(*args),)`` made while calls are queued, one of which may be running on the
    communicator's thread meanwhile; or None where the call needs the transport's own buffer grown,
    which would close a region in use (its general run grows it, and the next call is prepared)."""
    _beside.queued = True
    try:
        return (prepare(*args),)
    except _Grows:
        return None
    finally:
        _beside.queued = False


def _own_region(t, nbytes):
    """The transport's own region of at least ``nbytes`` (beside queued calls only as it is)."""
    if getattr(_beside, "queued", False) and not t.own_fits(nbytes):
        raise _Grows
    return t.own_region(nbytes)


def _host_call(comm, make_spec, *args, receive=False, lends=True):
    """The HostCall of ``make_spec(comm, *args)``'s one run; None where the general path must run
    the call (also where the run would work in the caller's memory and ``lends`` is False).
    ``receive``: a lone receive, whose messages are expected with its receive description."""
    try:
        spec = make_spec(comm, *args)
    except UsageError:
        return None
    if len(spec.runs) != 1:
        return None
    run = spec.runs[0]
    layout, t = run.layout, comm.transport
    if run.fill is not None or (layout.lent and not lends):
        return None
    avg = (AVG_NONE, 0)
    if run.avg is not None:
        if layout.lent:         # through the transport's buffer only: a lent input must not be scaled
            return None
        avg = (AVG_SCALE if run.avg.scale else AVG_DIVIDE, run.avg.n)
    return _prepared(comm, run, run.recv_tag if receive else run.tag, layout.own, avg)



def _prepared(comm, run, tag, own, avg=(AVG_NONE, 0)):
    """The HostCall of ``run``, its messages described by ``tag``."""
    layout, t = run.layout, comm.transport
    schedule = run.plan(t.max_message)
    return HostCall(t.engine.program(schedule), tag, run.dtype, run.op,
                    layout.in_bytes, layout.result(schedule), layout.work_bytes,
                    None if layout.lent else _own_region(t, layout.work_bytes), own=own,
                    in_offset=layout.in_offset, out_bytes=layout.out_bytes, lent=_LENT[layout.lent], avg=avg)


def _elements(buf):
    """Whether ``buf`` holds any bytes (the one-call path runs no empty call)."""
    try:
        return memoryview(buf).nbytes > 0
    except (TypeError, ValueError):
        return False


def op_and_dtype(op):
    """(op, reduction dtype) of a reduction's op as HostCollectives keys it: ``op``, or
    (op, "bfloat16") for bfloat16 values held as uint16 bits (pyrdma._hostcalls.host_key)."""
    return op if type(op) is tuple else (op, None)


def allreduce(comm, buf, op, algorithm):
    """The HostCall of a blocking ``allreduce(buf, op=op, algorithm=algorithm)`` in place, again for
    every buffer of the same format and size (HostCollectives' cache key)."""
    op, dtype = op_and_dtype(op)
    return _host_call(comm, specs.allreduce, buf, None, op, algorithm, dtype) if _elements(buf) else None


def reduce(comm, buf, op, root, algorithm):
    """The HostCall of a blocking ``reduce(buf, op=op, root=root, algorithm=algorithm)`` in place
    (the result into buf on the root; the other ranks' buffers are read)."""
    op, dtype = op_and_dtype(op)
    return _host_call(comm, specs.reduce, buf, None, op, root, algorithm, dtype) if _elements(buf) else None


def broadcast(comm, buf, root, algorithm):
    """The HostCall of a blocking ``broadcast(buf, root=root, algorithm=algorithm)``, copied
    through the transport's buffer (below the zero-copy size; from it, in ``buf`` itself over TCP)."""
    return _host_call(comm, specs.broadcast, buf, root, algorithm, lends=specs.lends_freely(comm)) \
        if _elements(buf) else None


def allgather(comm, buf, out, op):
    """The HostCall of a blocking allgather of ``buf`` into ``out`` (size x its bytes), copied
    through the transport's buffer (below the zero-copy size). (``op``: None.)"""
    return _host_call(comm, specs.allgather, buf, out, lends=False) if _elements(buf) else None


def reduce_scatter(comm, buf, out, op):
    """The HostCall of a blocking ``reduce_scatter(buf, op=op)``: the input copied into the
    transport's buffer, this rank's segment (segment_bounds) out of it. (``out``: its shape is
    the call's.)"""
    op, dtype = op_and_dtype(op)
    return _host_call(comm, specs.reduce_scatter, buf, None, op, dtype) if _elements(buf) else None


def alltoall(comm, buf, out, op):
    """The HostCall of a blocking all-to-all of equal pieces, from the zero-copy size on sent from
    buf and received into out where they are. (``out``: its shape is the call's, and the one-call
    path lends no out that overlaps buf; ``op``: None.)"""
    return _host_call(comm, specs.alltoall, buf, None, None, None) if _elements(buf) else None


def alltoallv(comm, buf, written=None):
    """The AlltoallvPlan of blocking all-to-alls with counts (send and receive counts given) of
    ``buf``'s format: the general path's spec of one such call, planned with one element per
    piece, whose steps serve any counts whose every piece fits one message (max_message); its
    chunks tell which piece each one carries (p for rank p's send piece, size + q for rank q's
    receive piece). By the write algorithm, whose steps for a pair depend on whether its block is
    written (from the cost model's written_from on), the plan serves the calls whose written
    pieces are ``written`` (bytes: [p] send piece p, [n + q] receive piece q; None: none), planned
    with pieces of that many bytes."""
    n, mm = comm.size, comm.transport.max_message
    try:
        dtype = host_array(buf, "buf").dtype
        entry = specs.alltoall_entry(comm, None)
        least = comm.cost_model.written_from(mm) if entry.name == "write" else None
        counts = [1] * (2 * n)
        if written is not None:
            if least is None:
                return None         # (the model was changed since the calls were keyed)
            big = -(-least // dtype.itemsize)
            if len(written) != 2 * n or big * dtype.itemsize > mm:
                return None
            counts = [big if w else 1 for w in written]
        if least is not None and least <= dtype.itemsize:
            return None             # (a piece of one element would be written)
        send, recv = counts[:n], counts[n:]
        spec = specs.alltoall(comm, np.zeros(sum(send), dtype), np.zeros(sum(recv), dtype), send, recv)
    except UsageError:
        return None
    run = spec.runs[0]
    if len(spec.runs) != 1 or dtype.itemsize > mm:
        return None
    schedule = run.plan(mm)
    # the piece of each chunk, from its offset (every piece is one chunk: at most max_message)
    sb = np.cumsum([0] + send) * dtype.itemsize
    rb = np.cumsum([0] + recv) * dtype.itemsize
    at = schedule.chunks[:, 0]
    pieces = np.where(at < sb[-1], np.searchsorted(sb, at, "right") - 1,
                      n + np.searchsorted(rb, at - sb[-1], "right") - 1).astype(np.int64)
    total, each = specs.alltoall_lend_sizes(comm)
    return AlltoallvPlan(schedule.steps, pieces, run.tag, run.dtype, run.op, -1 if total is None else total,
                         -1 if each is None else each, -1 if least is None else least)


def rooted_copy(comm, kind, piece, full, root, algorithm):
    """A gather's or scatter's (``kind``) HostCall for this rank's ``piece`` (gather: its input,
    scatter: its output) and, on the root, ``full`` (a scatter's input; a gather's output is the
    call's shape)."""
    if kind == "gather":
        return _host_call(comm, specs.gather, piece, None, root, algorithm)
    return _host_call(comm, specs.scatter, full, piece, root, algorithm)


def scatter_parts(comm, pieces, out, root, algorithm):
    """The HostCalls of a scatter root's list of pieces that are each sent from where they lie
    (specs: one run per other rank, in the order of the runs), over TCP, where lending a piece
    costs nothing; None where the general path must run the call (over RDMA each piece would need
    its registration). The calls copy no own piece: HostCollectives copies the root's after the
    sends."""
    if not specs.lends_freely(comm):
        return None
    try:
        spec = specs.scatter(comm, pieces, out, root, algorithm)
    except UsageError:
        return None
    # a list is sent from where it lies only by those runs; below that size it is copied in (fill)
    if comm.rank != root or len(spec.runs) != comm.size - 1 or \
            any(run.lend is None or run.fill is not None for run in spec.runs):
        return None
    return tuple(_prepared(comm, run, run.tag, (0, 0, 0)) for run in spec.runs)


def message(comm, buf, peer, tag, receive):
    """The HostCall of a blocking send to or receive from ``peer`` with ``tag``; HostCollectives
    numbers each call's message. From the zero-copy size over TCP it is sent from and received
    into the caller's buffer."""
    lends = specs.lends_freely(comm)
    if receive:
        return _host_call(comm, specs.p2p, buf, None, peer, tag, False, receive=True, lends=lends)
    return _host_call(comm, specs.p2p, buf, peer, None, tag, False, lends=lends)


def exchange(comm, sendbuf, dst, recvbuf, src, send_tag, recv_tag):
    """The HostCall of a blocking exchange: ``sendbuf`` to ``dst`` while ``recvbuf`` receives from
    ``src`` (HostCollectives numbers each call's messages): over TCP sent from and received into
    the caller's arrays (specs.p2p's rule), over RDMA through the transport's buffer, the received
    message copied out from after the sent one."""
    try:
        spec = specs.p2p(comm, (sendbuf, recvbuf), dst, src, (send_tag, recv_tag), False)
    except UsageError:
        return None
    run, t = spec.runs[0], comm.transport
    layout = run.layout
    if layout.lent not in (None, "both"):
        return None
    nbytes, capacity = layout.in_bytes, layout.work_bytes - layout.in_bytes
    copy = layout.lent is None
    return HostCall(t.engine.program(run.plan(t.max_message)), run.tag, 0, 0, nbytes, nbytes if copy else 0,
                    layout.work_bytes, _own_region(t, layout.work_bytes) if copy else None, out_bytes=capacity,
                    lent=LENT_NONE if copy else LENT_BOTH, rdesc=run.recv_tag)


def barrier(comm):
    """The HostCall of barrier()."""
    return _host_call(comm, specs.barrier)


def registration(comm, buf):
    """The MemoryRegion of a host buffer that a call works on in place."""
    return comm.transport.registration(host_array(buf, "buf").reshape(-1).view(np.uint8))[0]
