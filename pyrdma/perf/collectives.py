"""nccl-tests' collective benchmarks, run with pyrdma's Communicator (``pyrdma-perf all_reduce_perf ...``).

    pyrdma-perf all_reduce_perf -b 8 -e 128M -f 2 --np 2 --transport rdma     # local processes
    mpirun -np 4 python3 -m pyrdma.perf alltoall_perf -b 1K -e 1M -f 4          # Communicator.from_mpi
    torchrun --nproc-per-node 2 -m pyrdma.perf sendrecv_perf -b 8 -e 8M -f 8   # Communicator.from_env

Tests: all_reduce_perf, all_gather_perf, reduce_scatter_perf, alltoall_perf, broadcast_perf,
reduce_perf, gather_perf, scatter_perf, sendrecv_perf. Flags are nccl-tests': ``-b``/``-e`` the
smallest and largest size (bytes; K, M, G suffixes), ``-f`` the step factor (or ``-i`` a step in
bytes), ``-n`` iterations, ``-w`` warm-up iterations, ``-c`` check the data (0/1), ``-d`` the type
(int8, uint8, int32, uint32, int64, uint64, half, float, double, bfloat16 or all), ``-o`` the op
(sum, prod, min, max, avg or all), ``-r`` the root (-1: every rank in turn), ``-a`` how the ranks'
times combine (0 rank 0, 1 average, 2 min, 3 max).

The columns and arithmetic are nccl-tests' (its doc/PERFORMANCE.md and src/*.cu): ``size`` is the
larger of the send and receive buffers in bytes, ``count`` the elements each rank contributes,
``time`` the average of ``-n`` back-to-back iterations (us), then combined over the ranks (``-a``),
``algbw = size / time`` (GB/s, 1e9) and ``busbw = algbw * factor``: 2(n-1)/n for all-reduce, (n-1)/n
for all-gather, reduce-scatter, all-to-all, gather and scatter, 1 for broadcast, reduce and
send/recv. ``#wrong`` counts the elements of every rank that differ from a numpy reference, after
one more call on freshly written data (``-c 0``: N/A). Sizes whose per-rank count rounds down to
zero elements are skipped. One group of columns, not nccl-tests' two: all-reduce, reduce and
broadcast run in place (the result in the input buffer: the Communicator's fast path), the others
out of place (their only form). Send/recv: each rank sends to rank+1 and receives from rank-1
(``Communicator.sendrecv``), as nccl-tests' sendrecv_perf.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

from pyrdma import testing


@dataclass(frozen=True)
class Collective:
    name: str           # nccl-tests' name of the collective
    reduces: bool       # takes an op
    rooted: bool        # takes a root
    per_rank: bool      # -b/-e are the whole buffer; each rank's piece is size / n
    busbw: str          # the factor's formula, for the JSON

    def factor(self, n):
        return {"2(n-1)/n": 2 * (n - 1) / n, "(n-1)/n": (n - 1) / n, "1": 1.0}[self.busbw]


TESTS = {
    "all_reduce_perf": Collective("AllReduce", True, False, False, "2(n-1)/n"),
    "all_gather_perf": Collective("AllGather", False, False, True, "(n-1)/n"),
    "reduce_scatter_perf": Collective("ReduceScatter", True, False, True, "(n-1)/n"),
    "alltoall_perf": Collective("AlltoAll", False, False, True, "(n-1)/n"),
    "broadcast_perf": Collective("Broadcast", False, True, False, "1"),
    "reduce_perf": Collective("Reduce", True, True, False, "1"),
    "gather_perf": Collective("Gather", False, True, True, "(n-1)/n"),
    "scatter_perf": Collective("Scatter", False, True, True, "(n-1)/n"),
    "sendrecv_perf": Collective("SendRecv", False, False, False, "1"),
}
# nccl-tests' type names -> numpy's; the reductions take the ones pyrdma._reduce has
TYPES = {"int8": "int8", "uint8": "uint8", "int32": "int32", "uint32": "uint32", "int64": "int64",
         "uint64": "uint64", "half": "float16", "float": "float32", "double": "float64", "bfloat16": "bfloat16"}
TYPE_ALIASES = {"char": "int8", "int": "int32", "float16": "half", "float32": "float", "float64": "double",
                "bf16": "bfloat16"}
REDUCTION_TYPES = ("int8", "uint8", "int32", "int64", "half", "float", "double", "bfloat16")
OPS = ("sum", "prod", "min", "max", "avg")
AVERAGES = {0: "rank 0", 1: "average", 2: "min", 3: "max"}
# relative tolerance of a floating-point result (avg is inexact: each input is scaled by 1/n first)
TOLERANCE = {"float16": 1e-2, "bfloat16": 2e-2, "float32": 1e-5, "float64": 1e-12}
LAUNCH_ENV = "PYRDMA_PERF_LAUNCHED"       # set in the ranks that --np spawned
MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")


def canonical(name):
    """The test's name in TESTS (``alltoall`` and ``alltoall_perf`` alike), or None."""
    name = name.strip().replace("-", "_")
    if name in TESTS:
        return name
    return name + "_perf" if name + "_perf" in TESTS else None


def parse_size(text):
    """nccl-tests' sizes: bytes, with an optional K, M or G (powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)[bB]?\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, or a number with K, M or G)")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def build_parser():
    p = argparse.ArgumentParser(
        prog="pyrdma-perf <collective>_perf",
        description="nccl-tests' collective benchmarks run with pyrdma's Communicator.",
        epilog="Tests: " + ", ".join(TESTS) + ". Launch: --np N (local processes), mpirun, or torchrun.")
    p.add_argument("test", help=", ".join(TESTS))
    p.add_argument("-b", "--minbytes", type=parse_size, default=32 << 20, help="smallest size (default 32M)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=32 << 20, help="largest size (default 32M)")
    p.add_argument("-f", "--stepfactor", type=int, default=1, help="multiply the size by this each step")
    p.add_argument("-i", "--stepbytes", type=parse_size, default=1 << 20,
                   help="add this many bytes each step when -f is 1 (default 1M)")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size (default 20)")
    p.add_argument("-w", "--warmup_iters", "--warmup-iters", dest="warmup_iters", type=int, default=5,
                   help="untimed iterations before each size (default 5)")
    p.add_argument("-c", "--check", type=int, default=1, choices=(0, 1), help="check the data (default 1)")
    p.add_argument("-d", "--datatype", default="float", help="type, or all (default float)")
    p.add_argument("-o", "--op", default="sum", help="sum, prod, min, max, avg or all (default sum)")
    p.add_argument("-r", "--root", type=int, default=0, help="root rank, -1 for every rank (default 0)")
    p.add_argument("-a", "--average", type=int, default=1, choices=sorted(AVERAGES),
                   help="the time reported: 0 rank 0's, 1 the ranks' average, 2 min, 3 max (default 1)")
    p.add_argument("--np", type=int, default=None,
                   help="spawn this many local ranks (TCPStore rendezvous on 127.0.0.1); without it the "
                        "ranks come from mpirun's or torchrun's environment, else one rank")
    p.add_argument("--transport", choices=("auto", "rdma", "tcp"), default="auto")
    p.add_argument("--ib-dev", "--ib_dev", dest="ib_dev", default=None, help="RDMA device (default: first ACTIVE)")
    p.add_argument("--timeout", type=float, default=120.0, help="the Communicator's timeout, seconds")
    p.add_argument("--json", dest="json_path", default=None, help="rank 0 writes the rows here as JSON")
    return p


@dataclass
class Settings:
    test: str
    collective: Collective
    sizes: list
    types: list
    ops: list
    roots: list         # [-1] for collectives without a root; else explicit ranks, or None for "all"
    args: argparse.Namespace


def settings(args):
    """Checked and expanded arguments; SystemExit with a message for bad ones."""
    test = canonical(args.test)
    if test is None:
        raise SystemExit(f"pyrdma-perf: unknown collective test {args.test!r}; choose from {', '.join(TESTS)}")
    coll = TESTS[test]
    if args.minbytes > args.maxbytes:
        raise SystemExit(f"pyrdma-perf: -b {args.minbytes} is larger than -e {args.maxbytes}")
    if args.stepfactor < 1 or (args.stepfactor == 1 and args.stepbytes < 1):
        raise SystemExit("pyrdma-perf: -f must be >= 1, and -i >= 1 when -f is 1")
    if args.iters < 1 or args.warmup_iters < 0:
        raise SystemExit("pyrdma-perf: need -n >= 1 and -w >= 0")
    if args.np is not None and args.np < 1:
        raise SystemExit("pyrdma-perf: --np must be at least 1")
    if not args.timeout > 0:
        raise SystemExit("pyrdma-perf: --timeout must be a positive number of seconds")
    sizes, size = [], args.minbytes
    while size <= args.maxbytes:
        sizes.append(size)
        if args.stepfactor > 1:
            size *= args.stepfactor
        else:
            size += args.stepbytes
        if len(sizes) > 1000:
            raise SystemExit("pyrdma-perf: more than 1000 sizes; raise -f or -i")
    allowed = REDUCTION_TYPES if coll.reduces else tuple(TYPES)
    if args.datatype == "all":
        types = list(allowed)
    else:
        name = TYPE_ALIASES.get(args.datatype, args.datatype)
        if name not in TYPES:
            raise SystemExit(f"pyrdma-perf: unknown type {args.datatype!r}; use one of {', '.join(TYPES)} or all")
        if name not in allowed:
            raise SystemExit(f"pyrdma-perf: {test} reduces, and pyrdma's reductions take {', '.join(allowed)}, "
                             f"not {name}")
        types = [name]
    if "bfloat16" in types:
        try:
            import ml_dtypes  # noqa: F401
        except ImportError:
            if args.datatype == "all":
                types.remove("bfloat16")
            else:
                raise SystemExit("pyrdma-perf: bfloat16 needs the ml_dtypes package (pip install ml_dtypes)")
    if not coll.reduces:
        ops = ["none"]
    elif args.op == "all":
        ops = list(OPS)
    elif args.op in OPS:
        ops = [args.op]
    else:
        raise SystemExit(f"pyrdma-perf: unknown op {args.op!r}; use one of {', '.join(OPS)} or all")
    if not coll.rooted:
        roots = [-1]
    elif args.root == -1:
        roots = None
    elif args.root >= 0:
        roots = [args.root]
    else:
        raise SystemExit(f"pyrdma-perf: bad root {args.root} (a rank, or -1 for every rank)")
    return Settings(test, coll, sizes, types, ops, roots, args)


def numpy_dtype(name):
    """The numpy dtype of nccl-tests' type ``name`` (bfloat16: ml_dtypes')."""
    np_name = TYPES[name]
    if np_name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np_name)


def counts(coll, nbytes, itemsize, n):
    """(send elements, receive elements, count per rank) of a ``nbytes`` test, as nccl-tests'
    *GetCollByteCount: the per-rank collectives split the buffer in n whole pieces."""
    count = nbytes // itemsize
    if not coll.per_rank:
        return count, count, count
    piece = count // n
    if coll.name == "AllGather" or coll.name == "Gather":
        return piece, piece * n, piece
    if coll.name == "ReduceScatter" or coll.name == "Scatter":
        return piece * n, piece, piece
    return piece * n, piece * n, piece           # AlltoAll


def pattern(rank, count, dtype, op="sum", offset=0):
    """Rank ``rank``'s input: small whole numbers (exact in every type, and in their sums and
    products over up to 8 ranks), different on every rank and element."""
    k = np.arange(offset, offset + count, dtype=np.int64)
    if op == "prod":
        values = (rank + k) % 2 + 1
    else:
        values = (rank * 7 + k * 3) % 5 + 1
    return values.astype(dtype)


def reference(op, inputs, dtype, n):
    """The reduction of ``inputs`` (one array per rank) by ``op`` as pyrdma computes it: integers
    in their own type (wrapping as C does), floating point in float64 (compared with TOLERANCE)."""
    floating = dtype.kind == "f" or dtype.name == "bfloat16"
    stack = np.stack([x.astype(np.float64) if floating else x for x in inputs])
    if op in ("sum", "avg"):
        out = np.add.reduce(stack, axis=0, dtype=None if floating else dtype)
        if op == "avg":
            out = out / n if floating else out // n
    elif op == "prod":
        out = np.multiply.reduce(stack, axis=0, dtype=None if floating else dtype)
    elif op == "min":
        out = stack.min(axis=0)
    else:
        out = stack.max(axis=0)
    return out


def wrong(got, want, dtype):
    """How many elements of ``got`` differ from ``want``."""
    name = dtype.name
    if name in TOLERANCE:
        g = np.asarray(got).astype(np.float64)
        w = np.asarray(want, np.float64)
        return int(np.count_nonzero(~(np.abs(g - w) <= TOLERANCE[name] * np.maximum(1.0, np.abs(w)))))
    return int(np.count_nonzero(np.asarray(got) != np.asarray(want)))


class Case:
    """One (test, type, op, root, size) on this rank: its buffers, ``run()`` (one call of the
    collective) and ``check()`` (write fresh inputs, one call, the count of wrong elements here)."""

    def __init__(self, comm, coll, dtype, op, root, nbytes):
        self.comm, self.coll, self.dtype, self.op, self.root = comm, coll, dtype, op, root
        n, r = comm.size, comm.rank
        self.send_count, self.recv_count, self.count = counts(coll, nbytes, dtype.itemsize, n)
        self.nbytes = max(self.send_count, self.recv_count) * dtype.itemsize
        # collectives that run in place work on x; the others read x and write y
        self.x = pattern(r, self.send_count, dtype, op)
        in_place = coll.name in ("AllReduce", "Reduce", "Broadcast")
        self.y = None if in_place else np.zeros(self.recv_count, dtype)
        if coll.name in ("Gather",) and r != root:
            self.y = None
        self.run = self._call()

    def _call(self):
        c, x, y, op, root, n, r = self.comm, self.x, self.y, self.op, self.root, self.comm.size, self.comm.rank
        name = self.coll.name
        if name == "AllReduce":
            return lambda: c.allreduce(x, op=op)
        if name == "Reduce":
            return lambda: c.reduce(x, op=op, root=root)
        if name == "Broadcast":
            return lambda: c.broadcast(x, root=root)
        if name == "AllGather":
            return lambda: c.allgather(x, out=y)
        if name == "ReduceScatter":
            return lambda: c.reduce_scatter(x, out=y, op=op)
        if name == "AlltoAll":
            return lambda: c.alltoall(x, out=y)
        if name == "Gather":
            return lambda: c.gather(x, out=y, root=root)
        if name == "Scatter":
            return lambda: c.scatter(x if r == root else None, out=y, root=root)
        if n == 1:
            raise SystemExit("pyrdma-perf: sendrecv_perf needs at least 2 ranks (a rank does not send to itself)")
        return lambda: c.sendrecv(x, (r + 1) % n, y, (r - 1) % n)

    def expected(self):
        """(array to compare, what it must hold) on this rank."""
        n, r, dt, op, root = self.comm.size, self.comm.rank, self.dtype, self.op, self.root
        name, piece = self.coll.name, self.count
        inputs = lambda count: [pattern(q, count, dt, op) for q in range(n)]   # noqa: E731
        if name == "AllReduce":
            return self.x, reference(op, inputs(self.send_count), dt, n)
        if name == "Reduce":
            want = reference(op, inputs(self.send_count), dt, n) if r == root else pattern(r, self.send_count, dt, op)
            return self.x, want
        if name == "Broadcast":
            return self.x, pattern(root, self.send_count, dt, op)
        if name == "AllGather":
            return self.y, np.concatenate(inputs(piece))
        if name == "ReduceScatter":
            return self.y, reference(op, inputs(self.send_count), dt, n)[r * piece:(r + 1) * piece]
        if name == "AlltoAll":
            return self.y, np.concatenate([pattern(q, self.send_count, dt)[r * piece:(r + 1) * piece]
                                           for q in range(n)])
        if name == "Gather":
            return (self.y, np.concatenate(inputs(piece))) if r == root else (None, None)
        if name == "Scatter":
            return self.y, pattern(root, self.send_count, dt)[r * piece:(r + 1) * piece]
        return self.y, pattern((r - 1) % n, self.send_count, dt)

    def check(self):
        self.x[:] = pattern(self.comm.rank, self.send_count, self.dtype, self.op)
        if self.y is not None:
            self.y[:] = 0
        self.run()
        got, want = self.expected()
        return 0 if got is None else wrong(got, want, self.dtype)


def timed(case, iters, warmup):
    """Seconds per iteration of ``iters`` back-to-back calls after ``warmup`` untimed ones and a
    barrier (nccl-tests' loop)."""
    for _ in range(warmup):
        case.run()
    case.comm.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        case.run()
    return (time.perf_counter() - t0) / iters


def combine(comm, seconds, average):
    """The ranks' times combined as nccl-tests' -a: rank 0's, the average, the min or the max."""
    times = comm.allgather(np.array([seconds], np.float64))
    return float({0: times[0], 1: times.mean(), 2: times.min(), 3: times.max()}[average])


HEADER = ("#       size         count      type   redop    root     time   algbw   busbw #wrong\n"
          "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)       ")


def row_text(row):
    wrong_text = "N/A" if row["wrong"] is None else str(row["wrong"])
    return (f"{row['size']:12d}  {row['count']:12d}  {row['type']:>8s}  {row['redop']:>6s}  {row['root']:6d}  "
            f"{row['time_us']:7.2f}  {row['algbw']:6.2f}  {row['busbw']:6.2f}  {wrong_text:>5s}")


def run_rank(comm, st, out=sys.stdout):
    """Every row of the test on this rank; rank 0 prints the table. Returns (rows, wrong total)."""
    args, coll, n = st.args, st.collective, comm.size
    lead = comm.rank == 0

    def say(text):
        if lead:
            print(text, file=out, flush=True)
    step = f"{args.stepfactor}(factor)" if args.stepfactor > 1 else f"{args.stepbytes}(bytes)"
    say(f"# nThread 1 nGpus 1 minBytes {args.minbytes} maxBytes {args.maxbytes} step: {step} warmup iters: "
        f"{args.warmup_iters} iters: {args.iters} agg iters: 1 validation: {args.check} graph: 0")
    say("#")
    say(f"# Using devices (pyrdma {coll.name}, transport {comm.transport_name}, time: "
        f"{AVERAGES[args.average]} over the ranks)")
    me = f"{socket.gethostname()}|{os.getpid()}|{_device_name(comm)}".encode()[:200]
    who = comm.allgather(np.frombuffer(me.ljust(200, b"\0"), np.uint8)).reshape(n, 200)
    for r in range(n):
        host, pid, dev = bytes(who[r]).rstrip(b"\0").decode(errors="replace").split("|")
        say(f"#  Rank {r:2d} Group  0 Pid {int(pid):6d} on {host:>10s} device {dev}")
    say("#")
    say(HEADER)
    rows, total_wrong = [], 0
    roots = st.roots if st.roots is not None else list(range(n))
    for root in roots:
        if root >= n:
            raise SystemExit(f"pyrdma-perf: root {root} is not a rank of {n}")
    for type_name in st.types:
        dtype = numpy_dtype(type_name)
        for op in st.ops:
            for root in roots:
                for nbytes in st.sizes:
                    case = Case(comm, coll, dtype, op, max(root, 0), nbytes)
                    if case.count == 0:
                        say(f"# {nbytes} B: less than one {type_name} per rank, skipped")
                        continue
                    seconds = combine(comm, timed(case, args.iters, args.warmup_iters), args.average)
                    bad = None
                    if args.check:
                        mine = np.array([case.check()], np.int64)
                        bad = int(comm.allgather(mine).sum())
                        total_wrong += bad
                    algbw = case.nbytes / seconds / 1e9
                    row = dict(size=case.nbytes, count=case.count, type=type_name, redop=op, root=root,
                               time_us=seconds * 1e6, algbw=algbw, busbw=algbw * coll.factor(n), wrong=bad)
                    rows.append(row)
                    say(row_text(row))
    avg_busbw = sum(r["busbw"] for r in rows) / len(rows) if rows else 0.0
    say(f"# Out of bounds values : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}")
    say(f"# Avg bus bandwidth    : {avg_busbw:g}")
    say("#")
    if lead and args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(dict(tool="pyrdma-perf", test=st.test, collective=coll.name, ranks=n,
                           transport=comm.transport_name, busbw_factor=coll.busbw, iters=args.iters,
                           warmup_iters=args.warmup_iters, average=AVERAGES[args.average],
                           units=dict(size="bytes", time="us", algbw="GB/s (1e9)", busbw="GB/s (1e9)"),
                           rows=rows, wrong=total_wrong), fh, indent=1)
    return rows, total_wrong


def _device_name(comm):
    if comm.transport_name != "rdma":
        return comm.transport_name
    ctx = getattr(comm.transport, "ctx", None)
    return f"{getattr(ctx, 'name', '?')} (rdma)"


def launcher(environ=None):
    """"mpi" under mpirun (its environment), "env" under torchrun (RANK and WORLD_SIZE), else None."""
    environ = os.environ if environ is None else environ
    if any(k in environ for k in MPI_ENV):
        return "mpi"
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return "env"
    return None


def communicator(args, environ=None):
    """This process's Communicator, formed the way it was launched."""
    from pyrdma.collectives import Communicator
    kw = dict(transport=args.transport, timeout=args.timeout, device=args.ib_dev)
    how = launcher(environ)
    if how == "mpi":
        try:
            from mpi4py import MPI  # noqa: F401
        except ImportError:
            raise SystemExit("pyrdma-perf: started by mpirun, but this Python cannot import mpi4py "
                             f"({sys.executable}); install mpi4py for it, or use --np N") from None
        return Communicator.from_mpi(**kw)
    if how == "env":
        return Communicator.from_env(environ, **kw)
    return Communicator(0, 1, "127.0.0.1:0", **kw)


def spawn(argv, np_ranks, timeout):
    """Run this command in ``np_ranks`` local processes, torchrun-style (RANK, WORLD_SIZE,
    MASTER_ADDR/PORT; rank 0 serves the TCPStore rendezvous); the worst exit status. When a rank
    fails the others get the Communicator's timeout to fail too, then are killed."""
    from pyrdma.testing import free_port
    port = free_port()
    procs = []
    try:
        for r in range(np_ranks):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(np_ranks), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), **{LAUNCH_ENV: "1"})
            for k in MPI_ENV:
                env.pop(k, None)
            procs.append(subprocess.Popen([sys.executable, "-m", "pyrdma.perf", *argv], env=env))
        failed_at = None
        while any(p.poll() is None for p in procs):
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > timeout + 5:
                break
            time.sleep(0.05)
        codes = [p.returncode for p in procs]
        if any(c is None for c in codes):
            print(f"pyrdma-perf: ranks {[r for r, c in enumerate(codes) if c is None]} did not exit after "
                  f"another rank failed; killed", file=sys.stderr)
            return 1
        return max(codes, key=abs)
    except KeyboardInterrupt:
        return 130
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    st = settings(args)
    if args.np is not None and not os.environ.get(LAUNCH_ENV):
        if launcher():
            raise SystemExit("pyrdma-perf: --np spawns the ranks itself; drop it under mpirun or torchrun")
        return spawn(argv, args.np, args.timeout)
    from pyrdma.errors import RDMAError
    try:
        with communicator(args) as comm:
            _, bad = run_rank(comm, st)
    except (RDMAError, OSError) as exc:
        print(f"pyrdma-perf: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 1 if bad else 0


# ---- the side-by-side bench's pyrdma side (pyrdma.perf.collectives_bench) -----------------------

def count_python_calls(fn):
    """How many Python frames ``fn()`` runs below ``fn`` itself (the caller's lambda is not the
    collective's; a method that is a C function runs none)."""
    return testing.count_python_calls(fn) - 1


def per_peer_call(comm, name, piece):
    """(call, check) of collective ``name`` ("alltoall", "alltoallv": the same blocks given as
    counts, "gather", "scatter") with ``piece`` bytes per peer, root 0, on uint8 buffers; check()
    says whether the last call's result is right."""
    n, r = comm.size, comm.rank
    if name in ("alltoall", "alltoallv"):
        x = np.concatenate([np.full(piece, (r * 16 + j) & 0xFF, np.uint8) for j in range(n)])
        y = np.empty_like(x)
        want = np.concatenate([np.full(piece, (i * 16 + r) & 0xFF, np.uint8) for i in range(n)])
        counts = [piece] * n
        if name == "alltoallv":
            return (lambda: comm.alltoall(x, out=y, send_counts=counts, recv_counts=counts)), \
                (lambda: np.array_equal(y, want))
        return (lambda: comm.alltoall(x, out=y)), (lambda: np.array_equal(y, want))
    if name == "gather":
        x = np.full(piece, r + 1, np.uint8)
        y = np.empty(n * piece, np.uint8) if r == 0 else None
        want = np.repeat(np.arange(1, n + 1, dtype=np.uint8), piece)
        return (lambda: comm.gather(x, out=y, root=0)), (lambda: r != 0 or np.array_equal(y, want))
    if name == "scatter":
        x = np.repeat(np.arange(1, n + 1, dtype=np.uint8), piece) if r == 0 else None
        y = np.empty(piece, np.uint8)
        return (lambda: comm.scatter(x, out=y, root=0)), (lambda: bool((y == r + 1).all()))
    raise ValueError(f"unknown collective {name!r}")


def pingpong(comm, nbytes, iters, send, recv):
    """Half round trips (seconds, one per iteration) of ``nbytes`` between ranks 0 and 1, measured
    on rank 0 (None elsewhere). ``send(buf, peer)`` and ``recv(buf, peer)`` are the library's."""
    buf = np.zeros(max(nbytes, 1), np.uint8)[:nbytes]
    times = []
    rank = comm.rank                            # a local, as mpi_collectives.py's loop has it
    for i in range(iters + 10):                 # 10 warm-up round trips
        if rank == 0:
            t0 = time.perf_counter()
            send(buf, 1)
            recv(buf, 1)
            if i >= 10:
                times.append((time.perf_counter() - t0) / 2)
        elif rank == 1:
            recv(buf, 0)
            send(buf, 0)
    return times if rank == 0 else None


def stream(comm, nbytes, messages, send, recv, barrier):
    """Bytes per second of ``messages`` back-to-back messages of ``nbytes`` from rank 0 to rank 1:
    from a barrier to rank 0's receipt of rank 1's one-byte acknowledgement of the last (rank 0's
    figure; None elsewhere)."""
    buf = np.zeros(nbytes, np.uint8)
    ack = np.zeros(1, np.uint8)
    if comm.rank == 1:
        buf[:] = 0
    barrier()
    t0 = time.perf_counter()
    if comm.rank == 0:
        for _ in range(messages):
            send(buf, 1)
        recv(ack, 1)
        return messages * nbytes / (time.perf_counter() - t0)
    if comm.rank == 1:
        for _ in range(messages):
            recv(buf, 0)
        send(ack, 0)
    return None


def engine_timer(comm):
    """Wrap ``comm.transport.run`` (the engine's run of a schedule: the messages, without the GIL)
    in a timer, for a breakdown of a call's time; returns [seconds spent in it so far]. The
    instance's attribute only: other communicators are untouched."""
    t = comm.transport
    inner = t.run
    spent = [0.0]

    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0
    t.run = run
    return spent


def bench_rank(rank, size, master, plan):
    """The pyrdma side of pyrdma.perf.collectives_bench in one rank (allreduce_bench.spawn_ranks
    runs it). ``plan``: dict(collectives=[name], pieces=[bytes per peer], iters, transport,
    pingpong=(bytes, iters) or None, stream=(bytes, messages, repeats) or None, count_calls=[bytes
    per peer] or None, breakdown: whether to time the engine's part of each call in a second pass;
    a call of the one-call path, one C call, has no Python part to split off: its part is None).
    The loop is mpi_collectives.py's: per iteration a barrier, the call, its time. Returns a dict."""
    from pyrdma.collectives import Communicator
    out = dict(rows=[], wrong=[], pingpong=None, stream=None, python_calls=None, breakdown=[])
    with Communicator(rank, size, master, transport=plan.get("transport", "rdma"), timeout=300) as comm:
        for name in plan["collectives"]:
            for piece in plan["pieces"]:
                call, check = per_peer_call(comm, name, piece)
                call()                                   # warm-up: registration, connections
                if not check():
                    out["wrong"].append((name, piece))
                times = []
                for _ in range(plan["iters"]):
                    comm.barrier()
                    t0 = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - t0)
                out["rows"].append((name, piece, times))
        if plan.get("breakdown"):
            # a pass of its own, after the timed one: the timer's wrapper stays out of those figures
            spent = engine_timer(comm)
            for name in plan["collectives"]:
                for piece in plan["pieces"]:
                    call, _ = per_peer_call(comm, name, piece)
                    call()
                    pairs = []
                    engine = comm.transport.engine
                    for _ in range(plan["iters"]):
                        comm.barrier()
                        before, runs = spent[0], engine.runs
                        t0 = time.perf_counter()
                        call()
                        took = time.perf_counter() - t0
                        # the one-call path runs the engine from C, past the timer: no split (None)
                        one_call = spent[0] == before and engine.runs != runs
                        pairs.append((took, None if one_call else spent[0] - before))
                    out["breakdown"].append((name, piece, pairs))
            del comm.transport.run                       # the class's own again
        if plan.get("count_calls"):
            counted = {}
            for piece in plan["count_calls"] * 2:        # the second pass counts (caches warm)
                call, _ = per_peer_call(comm, "alltoall", piece)
                call()
                counted[piece] = count_python_calls(call)
            out["python_calls"] = counted
        if plan.get("pingpong") and size >= 2:
            nbytes, iters = plan["pingpong"]
            comm.barrier()
            out["pingpong"] = pingpong(comm, nbytes, iters, comm.send, comm.recv)
        if plan.get("stream") and size >= 2:
            nbytes, messages, repeats = plan["stream"]
            out["stream"] = [stream(comm, nbytes, messages, comm.send, comm.recv, comm.barrier)
                             for _ in range(repeats)]
        comm.barrier()
    return out
