"""The Communicator against numpy references, over both transports with the same test bodies:
TCP on the host, RDMA (marker ``device``) on rxe0 in the Soft-RoCE VM.

Rank processes are spawned once per (transport, world size) and reused by the tests (see
test_collectives_world.World); tests that break a communicator on purpose get a world of their own.
Float inputs are chosen so that every reduction order gives the same exact result (small integers,
powers of two), so results are compared bit for bit, and every rank must hold the same bits.
"""
import array
import os
import time

import numpy as np
import pytest

from pyrdma.testing import free_port
from test_collectives_world import World, cached_worlds, world_params

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

DTYPES = ["int8", "uint8", "int32", "int64", "float16", "float32", "float64", "bfloat16"]
OPS = ["sum", "prod", "min", "max", "avg"]
ALGORITHMS = ["ring", "halving_doubling", "recursive_doubling", "auto"]
TRANSPORTS = [pytest.param("tcp", id="tcp"), pytest.param("rdma", id="rdma", marks=pytest.mark.device)]
# Small messages make even 1000-element buffers travel in several pipelined chunks.
MAX_MESSAGE = 2048
TIMEOUT = 30.0
START_TIMEOUT = 300.0   # Python starts slowly in the emulated VM


_world_params = world_params


@pytest.fixture(scope="module")
def worlds():
    yield from cached_worlds(timeout=TIMEOUT, start_timeout=START_TIMEOUT, max_message=MAX_MESSAGE)


# ---- inputs and references (computed the same way in the ranks and in the parent) ---------------

def bf16_bits(values):
    """float32 values -> bfloat16 bits, round to nearest even."""
    bits = np.asarray(values, np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def as_float32(bits):
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def make_input(rank, count, dtype, op, seed=0):
    """Rank ``rank``'s input; for bfloat16 the uint16 bits."""
    rng = np.random.default_rng([seed, rank, count, DTYPES.index(dtype), OPS.index(op)])
    if dtype in ("int8", "uint8", "int32", "int64"):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, count, endpoint=True, dtype=dtype)   # wraps: exact anyway
    if op == "sum":
        x = rng.integers(-16, 17, count).astype(np.float32)          # sums of <= 8 stay exact
    elif op == "avg":
        # avg scales each input by 1/n first: multiples of 3 divide exactly by 2, 3, 4 and 8 ranks,
        # and the scaled sums stay exact even in bfloat16's 8 bits
        x = (rng.integers(-4, 5, count) * 3).astype(np.float32)
    elif op == "prod":
        x = rng.choice(np.array([-2, -1, -0.5, 0.5, 1, 2], np.float32), count)   # powers of two: exact
    else:
        x = (rng.standard_normal(count) * 100).astype(np.float32)
        if count > 4:
            x[rng.integers(0, count, 2)] = np.array([np.nan, np.inf], np.float32)
    return bf16_bits(x) if dtype == "bfloat16" else x.astype(dtype)


def reference(inputs, dtype, op, size):
    if dtype == "bfloat16":
        vals = np.stack([as_float32(b) for b in inputs])
        ufunc = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
        r = ufunc.reduce(vals, axis=0)
        if op == "avg":
            r = (r / np.float32(size)).astype(np.float32)
        return bf16_bits(r)
    stack = np.stack(inputs)
    if op in ("sum", "avg"):
        r = np.add.reduce(stack, axis=0, dtype=stack.dtype)
    elif op == "prod":
        r = np.multiply.reduce(stack, axis=0, dtype=stack.dtype)
    else:
        r = (np.minimum if op == "min" else np.maximum).reduce(stack, axis=0)
    if op == "avg":
        if stack.dtype.kind == "f":
            r = (r / np.asarray(size, stack.dtype)).astype(stack.dtype)
        else:   # truncation toward zero, as C and NCCL
            wide = r.astype(np.int64)
            q = wide // size
            q[(wide % size != 0) & (wide < 0)] += 1
            r = q.astype(stack.dtype)
    return r


def comm_buffer(x, dtype):
    """What a rank passes in: ml_dtypes bfloat16 arrays when available, else uint16 + dtype=."""
    if dtype == "bfloat16" and ml_dtypes is not None:
        return x.view(ml_dtypes.bfloat16), None
    return x, ("bfloat16" if dtype == "bfloat16" else None)


def bits_of(x):
    x = np.ascontiguousarray(x)
    return x.view(np.uint16) if x.dtype.name == "bfloat16" else x


def assert_bits_equal(got, expected, context):
    got, expected = bits_of(got), bits_of(expected)
    if got.dtype.kind == "f" or got.dtype == np.uint16 and expected.dtype == np.uint16:
        g = got.astype(np.float64) if got.dtype.kind == "f" else as_float32(got).astype(np.float64)
        e = expected.astype(np.float64) if expected.dtype.kind == "f" else as_float32(expected).astype(np.float64)
        nan = np.isnan(e)
        assert np.array_equal(np.isnan(g), nan), context
        assert np.array_equal(got[~nan], expected[~nan]), f"{context}: got {g[~nan][:8]}, expected {e[~nan][:8]}"
    else:
        assert np.array_equal(got, expected), f"{context}: got {got[:8]}, expected {expected[:8]}"


# ---- allreduce ------------------------------------------------------------------------------------

def _allreduce_cases(comm, cases):
    out = []
    for i, (count, dtype, op, algorithm) in enumerate(cases):
        x = make_input(comm.rank, count, dtype, op)
        buf, dt = comm_buffer(x.copy(), dtype)
        if i % 2:
            res = comm.allreduce(buf, out=np.empty_like(buf), op=op, algorithm=algorithm, dtype=dt)
            assert bits_of(buf).tobytes() == x.tobytes(), "out-of-place allreduce changed its input"
        else:
            res = comm.allreduce(buf, op=op, algorithm=algorithm, dtype=dt)
            assert res is buf
        out.append(bits_of(res).copy())
    return out


def check_allreduce(world, cases):
    results = world.run(_allreduce_cases, cases)
    for i, (count, dtype, op, algorithm) in enumerate(cases):
        expected = reference([make_input(r, count, dtype, op) for r in range(world.size)], dtype, op, world.size)
        context = f"{world.size} ranks, {count} x {dtype}, {op}, {algorithm}"
        for r in range(world.size):
            assert results[r][i].tobytes() == results[0][i].tobytes(), f"{context}: ranks 0 and {r} differ"
        assert_bits_equal(results[0][i], expected, context)


@pytest.mark.parametrize("transport, size", _world_params([2, 3, 4, 8], [2, 3, 4]))
def test_allreduce_every_op_dtype_and_algorithm(worlds, transport, size):
    # fewer elements than ranks, not divisible by the rank count, several chunks per segment
    counts = sorted({1, max(1, size - 1), 7, 1003})
    cases = [(c, d, o, a) for c in counts for d in DTYPES for o in OPS for a in ALGORITHMS]
    check_allreduce(worlds(transport, size), cases)


def _large(comm, cases, max_work_bytes):
    out = []
    comm.max_work_bytes = max_work_bytes
    for count, dtype, op, algorithm in cases:
        x = make_input(comm.rank, count, dtype, op)
        comm.allreduce(x, op=op, algorithm=algorithm)
        out.append(x)
    comm.max_work_bytes = 64 << 20
    return out


@pytest.mark.parametrize("transport, size", _world_params([2, 4], [2]))
def test_allreduce_large_buffers_in_pieces(worlds, transport, size):
    world = worlds(transport, size)
    mib = 1 << 20
    cases = [(mib // 4 + 3, "float32", "sum", "ring"), (3 * mib // 8 + 1, "int64", "max", "halving_doubling"),
             (3 * mib // 4 + 5, "float32", "avg", "auto"), (mib // 2, "float16", "prod", "ring")]
    # 1 MiB work buffer: the larger buffers run as several allreduces of up to 1 MiB
    results = world.run(_large, cases, mib, timeout=300)
    for i, (count, dtype, op, algorithm) in enumerate(cases):
        expected = reference([make_input(r, count, dtype, op) for r in range(size)], dtype, op, size)
        for r in range(size):
            assert_bits_equal(results[r][i], expected, f"rank {r}: {count} x {dtype} {op} {algorithm}")


def _many_small(comm, n):
    for i in range(n):
        v = np.array([comm.rank + i], np.int64)
        comm.allreduce(v)
        if v[0] != comm.size * i + comm.size * (comm.size - 1) // 2:
            return i
    return None


@pytest.mark.parametrize("transport, size", _world_params([4], [3]))
def test_1000_small_allreduces_stay_correct(worlds, transport, size):
    assert worlds(transport, size).run(_many_small, 1000, timeout=300) == [None] * size


# ---- reduce, broadcast, allgather, reduce_scatter, barrier ---------------------------------------------

def _rooted(comm, counts):
    out = []
    for count in counts:
        for algorithm in ("chain", "binomial", "auto"):
            for root in range(comm.size):
                for op, dtype in (("sum", "int32"), ("max", "float64"), ("avg", "float32"), ("prod", "bfloat16")):
                    x = make_input(comm.rank, count, dtype, op)
                    buf, dt = comm_buffer(x.copy(), dtype)
                    res = comm.reduce(buf, op=op, root=root, algorithm=algorithm, dtype=dt)
                    if comm.rank == root:
                        out.append(bits_of(res).copy())
                    else:
                        assert res is None and bits_of(buf).tobytes() == x.tobytes(), "reduce changed a non-root buffer"
                b = np.full(count, comm.rank, np.int16) if count % 2 else np.full(count, comm.rank + 0.5)
                assert comm.broadcast(b, root=root, algorithm=algorithm) is b
                out.append(b.copy())
    return out


@pytest.mark.parametrize("transport, size", _world_params([3, 4], [3]))
def test_reduce_and_broadcast_every_root(worlds, transport, size):
    counts = [1, 5, 1001]
    results = worlds(transport, size).run(_rooted, counts)
    pos = {r: 0 for r in range(size)}
    for count in counts:
        for algorithm in ("chain", "binomial", "auto"):
            for root in range(size):
                for op, dtype in (("sum", "int32"), ("max", "float64"), ("avg", "float32"), ("prod", "bfloat16")):
                    expected = reference([make_input(r, count, dtype, op) for r in range(size)], dtype, op, size)
                    assert_bits_equal(results[root][pos[root]], expected, f"reduce {op} {dtype} root {root} {algorithm}")
                    pos[root] += 1
                for r in range(size):
                    b = results[r][pos[r]]
                    assert (b == (root if count % 2 else root + 0.5)).all(), f"broadcast root {root} {algorithm}"
                    pos[r] += 1


def _gather_scatter(comm, counts):
    out = []
    for count in counts:
        block = np.arange(count, dtype=np.int64) + 1000 * comm.rank
        g = comm.allgather(block)
        out.append(g)
        two_d = np.full((2, 3), comm.rank, np.float32)
        out.append(comm.allgather(two_d, out=np.empty(6 * comm.size, np.float32)))
        for op, dtype in (("sum", "int64"), ("min", "float16"), ("avg", "int8"), ("max", "bfloat16")):
            x = make_input(comm.rank, count * comm.size + 1, dtype, op)
            buf, dt = comm_buffer(x, dtype)
            out.append(bits_of(comm.reduce_scatter(buf, op=op, dtype=dt)).copy())
    comm.barrier()
    return out


@pytest.mark.parametrize("transport, size", _world_params([3, 4], [3]))
def test_allgather_and_reduce_scatter(worlds, transport, size):
    counts = [0, 1, 2, 333]
    results = worlds(transport, size).run(_gather_scatter, counts)
    from pyrdma.collectives import segment_bounds
    for r in range(size):
        pos = 0
        for count in counts:
            expected = np.concatenate([np.arange(count, dtype=np.int64) + 1000 * q for q in range(size)])
            assert np.array_equal(results[r][pos], expected) and results[r][pos].shape == (count * size,)
            assert np.array_equal(results[r][pos + 1], np.repeat(np.arange(size, dtype=np.float32), 6))
            pos += 2
            total = count * size + 1
            b = segment_bounds(total, size)
            for op, dtype in (("sum", "int64"), ("min", "float16"), ("avg", "int8"), ("max", "bfloat16")):
                full = reference([make_input(q, total, dtype, op) for q in range(size)], dtype, op, size)
                assert_bits_equal(results[r][pos], full[b[r]:b[r + 1]], f"reduce_scatter {op} {dtype} rank {r}")
                pos += 1


def _nonblocking(comm):
    import pyrdma
    out = {}
    handles = [comm.iallreduce(np.full(50000, comm.rank + k, np.float64), op="sum") for k in range(4)]
    handles.append(comm.ibroadcast(np.full(10, comm.rank, np.int32), root=1))
    handles.append(comm.iallgather(np.array([comm.rank], np.int32)))
    handles.append(comm.ireduce_scatter(np.ones(comm.size * 3, np.int32)))
    handles.append(comm.ireduce(np.ones(5, np.int32), root=0))
    handles.append(comm.ibarrier())
    blocking = np.ones(3, np.int64)
    comm.allreduce(blocking)                    # queued behind the non-blocking ones
    out["blocking"] = blocking
    out["results"] = [h.wait(timeout=60) for h in reversed(handles)][::-1]
    out["all_done"] = all(h.test() for h in handles)
    # a wait that times out says so and leaves the collective running
    big = np.ones(2 << 20, np.float32)
    h = comm.iallreduce(big, algorithm="ring")
    try:
        h.wait(timeout=0)
        out["timeout"] = "finished at once"
    except pyrdma.RDMATimeoutError:
        out["timeout"] = "timed out"
    h.wait(timeout=120)
    out["big_ok"] = bool((big == comm.size).all())
    return out


@pytest.mark.parametrize("transport, size", _world_params([3], [2]))
def test_nonblocking_collectives(worlds, transport, size):
    results = worlds(transport, size).run(_nonblocking, timeout=300)
    ranks_sum = sum(range(size))
    for r, out in enumerate(results):
        res = out["results"]
        for k in range(4):
            assert (res[k] == ranks_sum + size * k).all()
        assert (res[4] == 1).all()
        assert np.array_equal(res[5], np.arange(size))
        assert (res[6] == size).all()
        assert (res[7] == size).all() if r == 0 else res[7] is None
        assert (out["blocking"] == size).all()
        assert out["all_done"] and out["big_ok"]
        assert out["timeout"] in ("timed out", "finished at once")


class _DLPackOnly:
    """A CPU tensor that speaks only DLPack (as torch CPU tensors do)."""

    def __init__(self, arr):
        self._arr = arr

    def __dlpack__(self, **kw):
        return self._arr.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


def _buffer_kinds(comm):
    out = {}
    ba = bytearray([comm.rank + 1] * 5)
    comm.allreduce(ba)                                   # bytearray: uint8
    out["bytearray"] = bytes(ba)
    fa = array.array("f", [comm.rank, 1.0])
    comm.allreduce(memoryview(fa), op="max")             # memoryview of array.array('f'): float32
    out["array"] = fa.tolist()
    backing = np.full(4, comm.rank, np.int32)
    comm.allreduce(_DLPackOnly(backing))                 # DLPack, in place in the producer's memory
    out["dlpack"] = backing.copy()
    ro = np.frombuffer(np.full(3, comm.rank + 1, np.int64).tobytes(), np.int64)   # read-only input
    out["readonly_out"] = comm.allreduce(ro, out=np.empty(3, np.int64), op="prod")
    m = np.full((3, 2), comm.rank, np.float64)
    comm.allreduce(m, op="min")                          # any shape, C-contiguous
    out["2d"] = m
    empty = np.empty(0, np.float32)
    comm.allreduce(empty)                                # zero elements
    out["empty"] = empty.size
    out["scalar"] = comm.allreduce(np.array(comm.rank + 1, np.int32))
    return out


@pytest.mark.parametrize("transport, size", _world_params([3], [2]))
def test_any_buffer(worlds, transport, size):
    for r, out in enumerate(worlds(transport, size).run(_buffer_kinds)):
        assert out["bytearray"] == bytes([sum(range(1, size + 1))] * 5)
        assert out["array"] == [size - 1, 1.0]
        assert (out["dlpack"] == sum(range(size))).all()
        assert (out["readonly_out"] == np.prod(np.arange(1, size + 1))).all()
        assert (out["2d"] == 0).all() and out["2d"].shape == (3, 2)
        assert out["empty"] == 0
        assert out["scalar"] == sum(range(1, size + 1))


def collect_usage_errors(calls):
    """{name: the text of the UsageError the call raised, or None if it went through}."""
    import pyrdma
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except pyrdma.UsageError as exc:
            errors[name] = str(exc)
    return errors


def _usage_errors(comm):
    class FakeCuda:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}
    calls = {
        "noncontiguous": lambda: comm.allreduce(np.zeros((4, 4))[:, 0]),
        "dtype": lambda: comm.allreduce(np.zeros(4, np.complex64)),
        "dtype16": lambda: comm.allreduce(np.zeros(4, np.uint16)),
        "op": lambda: comm.allreduce(np.zeros(4), op="xor"),
        "algorithm": lambda: comm.allreduce(np.zeros(4), algorithm="butterfly"),
        "readonly": lambda: comm.allreduce(np.frombuffer(bytes(32), np.float64)),
        "out_size": lambda: comm.allreduce(np.zeros(4), out=np.zeros(5)),
        "out_dtype": lambda: comm.allreduce(np.zeros(4), out=np.zeros(4, np.float32)),
        "root": lambda: comm.broadcast(np.zeros(4), root=comm.size),
        "reduce_algorithm": lambda: comm.reduce(np.zeros(4), algorithm="ring"),
        "not_a_buffer": lambda: comm.allreduce(object()),
        "cuda_mixed": lambda: comm.allreduce(FakeCuda(), out=np.zeros(4)),
        "allgather_out": lambda: comm.allgather(np.zeros(4), out=np.zeros(4)),
        "reduce_scatter_out": lambda: comm.reduce_scatter(np.zeros(9), out=np.zeros(9)),
    }
    errors = collect_usage_errors(calls)
    # nothing was sent: the communicator still works
    x = np.ones(3)
    comm.allreduce(x)
    errors["still_works"] = bool((x == comm.size).all())
    return errors


@pytest.mark.parametrize("transport, size", _world_params([2], [2]))
def test_bad_input_is_a_clear_usage_error(worlds, transport, size):
    expected = {"noncontiguous": "C-contiguous", "dtype": "unsupported dtype", "dtype16": "unsupported dtype",
                "op": "unsupported op", "algorithm": "unknown algorithm", "readonly": "read-only",
                "out_size": "5 elements", "out_dtype": "dtype", "root": "root", "reduce_algorithm": "unknown algorithm",
                "not_a_buffer": "not an array", "cuda_mixed": "must both be CUDA arrays", "allgather_out": "out must hold",
                "reduce_scatter_out": "out must hold"}
    for errors in worlds(transport, size).run(_usage_errors):
        assert errors.pop("still_works")
        for name, text in expected.items():
            assert errors[name] is not None and text in errors[name], (name, errors[name])


# ---- failures: mismatched calls, dead and stalled ranks ----------------------------------------------

def fresh_comm(comm, port, **kwargs):
    """A second communicator among the same rank processes (for tests that break one on purpose)."""
    from pyrdma.collectives import Communicator
    kwargs.setdefault("timeout", TIMEOUT)
    kwargs.setdefault("max_message", MAX_MESSAGE)
    return Communicator(comm.rank, comm.size, f"127.0.0.1:{port}", transport=comm.transport_name, **kwargs)


def _mismatch(comm, ports, kinds):
    import pyrdma
    outcomes = []
    for k, kind in enumerate(kinds):
        with fresh_comm(comm, ports[k]) as c:
            start = time.monotonic()
            try:
                if kind == "size":
                    c.allreduce(np.zeros(100 + c.rank, np.float32), algorithm="ring")
                elif kind == "dtype":
                    c.allreduce(np.zeros(100, np.float32 if c.rank else np.int32))
                elif kind == "op":
                    c.allreduce(np.zeros(100), op="max" if c.rank else "min")
                elif kind == "collective":
                    c.barrier() if c.rank else c.allreduce(np.zeros(4))
                result = "no error"
            except pyrdma.RDMAError as exc:
                result = f"{type(exc).__name__}: {exc}"
            elapsed = time.monotonic() - start
            try:
                c.allreduce(np.zeros(1))
                after = "works"
            except pyrdma.RDMAError as exc:
                after = type(exc).__name__
        outcomes.append((result, elapsed, after))
    x = np.ones(2)
    comm.allreduce(x)            # the world's own communicator is unaffected
    return outcomes, float(x[0])


@pytest.mark.parametrize("transport, size", _world_params([3], [3]))
def test_mismatched_calls_fail_fast_on_every_rank(worlds, transport, size):
    kinds = ["size", "dtype", "op", "collective"]
    results = worlds(transport, size).run(_mismatch, [free_port() for _ in kinds], kinds, timeout=300)
    for outcomes, value in results:
        assert value == size
        for kind, (result, elapsed, after) in zip(kinds, outcomes):
            assert result.startswith("UsageError") and ("disagree" in result or "different collective" in result), \
                (kind, result)
            assert elapsed < TIMEOUT / 2, f"{kind}: the mismatch took {elapsed:.1f} s to surface"
            assert after == "UsageError", f"{kind}: a communicator that failed halfway must refuse further calls"


def _die_or_stall(comm, victim, how, iterations):
    import pyrdma
    x = np.ones(20000, np.float32)
    for i in range(iterations):
        if comm.rank == victim and i == iterations // 2:
            if how == "die":
                os._exit(3)              # no goodbye: the process is simply gone
            time.sleep(60)               # stalled: alive, silent
        start = time.monotonic()
        try:
            comm.allreduce(x, algorithm="ring")
        except pyrdma.PeerError as exc:
            return ("PeerError", exc.peer, start, time.monotonic() - start, str(exc))
    return ("no error", None, None, None, None)


@pytest.mark.parametrize("how", ["die", "stall"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_dead_or_stalled_rank_is_named_within_the_timeout(transport, how):
    timeout, victim, size = 4.0, 2, 4
    w = World(size, transport, timeout=timeout, start_timeout=START_TIMEOUT, max_message=MAX_MESSAGE)
    try:
        results = w.run(_die_or_stall, victim, how, 6, timeout=timeout * 4 + 20, expect_errors=True,
                        ignore=(victim,))
    finally:
        w.close()   # also kills the stalled rank
    spans = []
    for rank, (kind, value) in enumerate(results):
        if rank == victim:
            continue
        assert kind == "ok", value
        outcome, peer, start, elapsed, message = value
        assert outcome == "PeerError", value
        assert peer == victim, f"rank {rank} blamed rank {peer}: {message}"
        assert elapsed < timeout + 3, f"rank {rank} needed {elapsed:.1f} s (timeout {timeout} s)"
        spans.append((start, start + elapsed))
    # From the first survivor's failing call to the last survivor's error (one machine, so one
    # monotonic clock): the failure's news reaches everyone. The calls before the victim acts are
    # left out: they measure how fast this machine runs allreduces, not failure detection.
    news = max(end for _, end in spans) - min(start for start, _ in spans)
    assert news < timeout * 3 + 3, f"the last survivor raised {news:.1f} s after the first failing call began"


# ---- transport mechanics: registration reuse, flow control -------------------------------------------

def _reuse(comm):
    t = comm.transport
    x = np.ones(10000, np.float32)
    comm.allreduce(x)
    first = (id(t.buffer(0)), id(getattr(t, "_work_mr", None)), id(getattr(t, "slot_mr", None)))
    for _ in range(5):
        comm.allreduce(x, algorithm="ring")
        comm.allreduce(x[:100], algorithm="recursive_doubling")
    again = (id(t.buffer(0)), id(getattr(t, "_work_mr", None)), id(getattr(t, "slot_mr", None)))
    return first == again, float(x[0])


@pytest.mark.parametrize("transport, size", _world_params([2], [2]))
def test_work_buffer_is_registered_once_and_reused(worlds, transport, size):
    for same, value in worlds(transport, size).run(_reuse):
        assert same, "a same-size collective re-registered its buffers"


def _in_place(comm, count):
    """Every collective that can work on the caller's memory does (zero_copy_bytes=1), including
    pieces of a buffer larger than max_work_bytes; returns results and the registration cache."""
    t = comm.transport
    comm.zero_copy_bytes, comm.max_work_bytes = 1, 64 * 1024
    try:
        out = []
        for k, algorithm in enumerate(("ring", "halving_doubling", "recursive_doubling")):
            x = make_input(comm.rank, count, "int32", "sum")
            if k == 1:
                y = np.empty_like(x)
                comm.allreduce(x, out=y, algorithm=algorithm)
                out.append(y)
                out.append(x)                           # out of place: the input stays as it was
            else:
                for _ in range(3):                      # the same buffer again: one registration
                    x[:] = make_input(comm.rank, count, "int32", "sum")
                    comm.allreduce(x, algorithm=algorithm)
                out.append(x)
        x = make_input(comm.rank, count, "float64", "avg")
        comm.allreduce(x, op="avg", algorithm="ring")
        out.append(x)
        for root in range(comm.size):
            b = np.full(count, comm.rank, np.int16)
            if comm.rank == root:
                b.setflags(write=False)                 # the root only sends from it
            comm.broadcast(b, root=root)
            out.append(b)
        g = np.empty(count * comm.size, np.int64)
        comm.allgather(np.arange(count, dtype=np.int64) + comm.rank * count, out=g)
        out.append(g)
        cached = len(getattr(t, "_user_mrs", ()))
        for _ in range(12):                             # more buffers than the cache keeps
            comm.allreduce(np.ones(count, np.int32))
        return out, cached, len(getattr(t, "_user_mrs", ()))
    finally:
        comm.zero_copy_bytes, comm.max_work_bytes = 1 << 20, 64 << 20


@pytest.mark.parametrize("transport, size", _world_params([3], [3]))
def test_collectives_in_place_on_the_callers_memory(worlds, transport, size):
    count = 40003                     # int32: 160 KiB, three pieces of at most 64 KiB
    results = worlds(transport, size).run(_in_place, count, timeout=300)
    ints = reference([make_input(r, count, "int32", "sum") for r in range(size)], "int32", "sum", size)
    avg = reference([make_input(r, count, "float64", "avg") for r in range(size)], "float64", "avg", size)
    for r, (out, cached, after) in enumerate(results):
        assert np.array_equal(out[0], ints) and np.array_equal(out[1], ints) and np.array_equal(out[3], ints)
        assert np.array_equal(out[2], make_input(r, count, "int32", "sum")), "out-of-place changed its input"
        assert_bits_equal(out[4], avg, f"rank {r}: avg in place")
        for root in range(size):
            assert (out[5 + root] == root).all(), f"rank {r}: broadcast from {root}"
        assert np.array_equal(out[5 + size], np.arange(count * size))
        if transport == "rdma":
            from pyrdma.collectives.transport import USER_MR_CACHE
            # ring's buffer, halving-doubling's out, avg's, 3 broadcast buffers, allgather's out
            assert cached == 7, cached
            assert after == USER_MR_CACHE


def _after_in_place(comm, count):
    """An allreduce in place on the caller's array, then reduce and reduce_scatter of other arrays:
    those work in the transport's own buffer, never in the memory the allreduce was lent."""
    comm.zero_copy_bytes = 1
    try:
        x = make_input(comm.rank, count, "int32", "sum")
        comm.allreduce(x)
        result = x.copy()
        y = make_input(comm.rank, count // 2, "int32", "sum")
        comm.reduce(y, root=0)
        z = comm.reduce_scatter(make_input(comm.rank, count // 2, "int32", "sum"))
        return result, x, y, z
    finally:
        comm.zero_copy_bytes = 1 << 20


@pytest.mark.parametrize("transport, size", _world_params([3], [3]))
def test_rooted_collectives_leave_an_earlier_lent_buffer_alone(worlds, transport, size):
    count = 40003
    ints = reference([make_input(r, count, "int32", "sum") for r in range(size)], "int32", "sum", size)
    half = reference([make_input(r, count // 2, "int32", "sum") for r in range(size)], "int32", "sum", size)
    from pyrdma.collectives import segment_bounds
    bounds = segment_bounds(count // 2, size)
    for r, (result, x, y, z) in enumerate(worlds(transport, size).run(_after_in_place, count, timeout=300)):
        assert np.array_equal(result, ints), f"rank {r}: allreduce in place"
        assert np.array_equal(x, ints), f"rank {r}: a later reduce or reduce_scatter wrote into the allreduce's array"
        if r == 0:
            assert np.array_equal(y, half), "reduce at the root"
        assert np.array_equal(z, half[bounds[r]:bounds[r + 1]]), f"rank {r}: reduce_scatter"


SEQ_KINDS = ("allreduce", "allreduce_out", "iallreduce", "reduce", "reduce_out", "broadcast", "allgather",
             "allgather_out", "reduce_scatter", "reduce_scatter_out")


def _sequence(size, seed, steps):
    """The same random sequence of (kind, count, dtype, op, root) on every rank and in the parent;
    counts on both sides of zero_copy_bytes and max_work_bytes (set by _run_sequence)."""
    import random
    rng = random.Random(seed)
    return [(rng.choice(SEQ_KINDS), rng.choice((1, 7, 1000, 5003, 40003)), rng.choice(("int32", "int64", "float64")),
             rng.choice(("sum", "min", "max", "avg")), rng.randrange(size)) for _ in range(steps)]


def _run_sequence(comm, seed, steps):
    """Run the sequence; per step (result copied at once, every array the call was given or returned)."""
    comm.zero_copy_bytes, comm.max_work_bytes = 4096, 64 * 1024
    try:
        done = []
        for i, (kind, count, dtype, op, root) in enumerate(_sequence(comm.size, seed, steps)):
            x = make_input(comm.rank, count, dtype, op, seed=i)
            buf = x.copy()
            if kind == "allreduce":
                res = comm.allreduce(buf, op=op)
            elif kind == "allreduce_out":
                res = comm.allreduce(buf, out=np.empty_like(buf), op=op)
            elif kind == "iallreduce":
                res = comm.iallreduce(buf, op=op).wait(timeout=60)
            elif kind in ("reduce", "reduce_out"):
                out = np.empty_like(buf) if kind == "reduce_out" else None
                res = comm.reduce(buf, out=out, op=op, root=root)
                res = buf if res is None else res            # not the root: its input must stay as it was
            elif kind == "broadcast":
                res = comm.broadcast(buf, root=root)
            elif kind == "allgather":
                res = comm.allgather(buf)
            elif kind == "allgather_out":
                res = comm.allgather(buf, out=np.empty(count * comm.size, buf.dtype))
            elif kind == "reduce_scatter":
                res = comm.reduce_scatter(buf, op=op)
            else:
                from pyrdma.collectives import segment_bounds
                b = segment_bounds(count, comm.size)
                res = comm.reduce_scatter(buf, out=np.empty(b[comm.rank + 1] - b[comm.rank], buf.dtype), op=op)
            done.append((res.copy(), res, buf))
        return done
    finally:
        comm.zero_copy_bytes, comm.max_work_bytes = 1 << 20, 64 << 20


@pytest.mark.parametrize("transport, size", _world_params([3], [3]))
def test_a_random_sequence_of_collectives_is_right_and_leaves_earlier_arrays_alone(worlds, transport, size):
    """Every collective in a mixed sequence (in place, out=, non-blocking; pieces; zero copy or not) is
    right, its non-root input and out-of-place inputs are untouched, and no later call changes an array
    an earlier call returned: state carried from one collective to the next must never alias them."""
    from pyrdma.collectives import segment_bounds
    seed, steps = 17, 40
    results = worlds(transport, size).run(_run_sequence, seed, steps, timeout=300)
    for i, (kind, count, dtype, op, root) in enumerate(_sequence(size, seed, steps)):
        xs = [make_input(r, count, dtype, op, seed=i) for r in range(size)]
        red = reference(xs, dtype, op, size)
        b = segment_bounds(count, size)
        for r in range(size):
            first, later, given = results[r][i]
            if kind.startswith(("allreduce", "iallreduce")):
                want = red
            elif kind.startswith("reduce_scatter"):
                want = red[b[r]:b[r + 1]]
            elif kind.startswith("reduce"):
                want = red if r == root else xs[r]
            elif kind == "broadcast":
                want = xs[root]
            else:
                want = np.concatenate(xs)
            context = f"step {i} {kind} of {count} x {dtype} ({op}, root {root}), rank {r}"
            assert_bits_equal(first, want, context)
            assert_bits_equal(later, want, context + ": changed by a later collective")
            if kind.endswith("_out") or kind.startswith(("allgather", "reduce_scatter")) or \
                    kind.startswith("reduce") and r != root:
                assert_bits_equal(given, xs[r], context + ": its input changed")


def _ack_timeouts(comm, port):
    from pyrdma.collectives.transport import DEFAULT_QP_TIMEOUT
    default = {p: link.qp.query().timeout for p, link in comm.transport.links.items()}
    with fresh_comm(comm, port, qp_timeout=17) as c:
        x = np.full(10, c.rank + 1.0)
        c.allreduce(x)
        given = {p: link.qp.query().timeout for p, link in c.transport.links.items()}
    return DEFAULT_QP_TIMEOUT, default, given, x.tolist()


@pytest.mark.parametrize("transport, size", _world_params([], [2]))
def test_rdma_qps_use_the_ack_timeout_asked_for(worlds, transport, size):
    for r, (default_value, default, given, x) in enumerate(worlds(transport, size).run(_ack_timeouts, free_port())):
        assert default_value == 20
        assert default == {1 - r: 20}, (r, default)
        assert given == {1 - r: 17}, (r, given)
        assert x == [3.0] * 10


def _tight(comm, port, counts):
    out = []
    # slots=1: every message waits for the previous one's credit (RDMA); tiny messages, many chunks
    with fresh_comm(comm, port, max_message=256, slots=1) as c:
        for count in counts:
            for algorithm in ("ring", "halving_doubling", "recursive_doubling"):
                x = make_input(c.rank, count, "int64", "sum")
                c.allreduce(x, algorithm=algorithm)
                out.append(x)
            x = make_input(c.rank, count, "int64", "sum")
            c.reduce(x, root=c.size - 1, algorithm="chain")
            out.append(x)
    return out


@pytest.mark.parametrize("transport, size", _world_params([3], [3]))
def test_one_receive_slot_per_peer_still_flows(worlds, transport, size):
    counts = [3, 10007]
    results = worlds(transport, size).run(_tight, free_port(), counts, timeout=300)
    pos = 0
    for count in counts:
        expected = reference([make_input(r, count, "int64", "sum") for r in range(size)], "int64", "sum", size)
        for k in range(4):
            for r in range(size):
                if k < 3 or r == size - 1:
                    assert np.array_equal(results[r][pos + k], expected), (count, k, r)
        pos += 4
