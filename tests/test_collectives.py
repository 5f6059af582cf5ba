"""Collectives against numpy references, on both transports: TCP on the host, RDMA on the device.

Each test spawns one process per rank (tests/mp.py reaps them) and checks every rank's result."""

import numpy as np
import pytest

from mp import run_ranks
from pyrdma.testing import free_port

DTYPES = ["int8", "uint8", "int32", "int64", "float16", "float32", "float64"]
OPS = ["sum", "prod", "min", "max", "avg"]
TRANSPORTS = [pytest.param("tcp", id="tcp"), pytest.param("rdma", id="rdma", marks=pytest.mark.device)]


def make_input(rank, n, dtype, op, seed=0):
    rng = np.random.default_rng(seed * 1000 + rank * 7 + n)
    dt = np.dtype(dtype)
    if op == "prod":
        if dt.kind == "f":
            return rng.uniform(0.8, 1.25, n).astype(dt)
        return rng.integers(1, 4, n).astype(dt)
    if dt.kind == "f":
        return rng.uniform(-10, 10, n).astype(dt)
    info = np.iinfo(dt)
    return rng.integers(max(info.min, -100), min(info.max, 100), n, endpoint=True).astype(dt)


def reference(inputs, op):
    stack = np.stack(inputs)
    dt = stack.dtype
    if op in ("sum", "avg"):
        out = np.add.reduce(stack, axis=0, dtype=dt)
    elif op == "prod":
        out = np.multiply.reduce(stack, axis=0, dtype=dt)
    elif op == "min":
        out = np.minimum.reduce(stack, axis=0)
    else:
        out = np.maximum.reduce(stack, axis=0)
    if op == "avg":
        if dt.kind == "f":
            out = (out / np.asarray(len(inputs), dt)).astype(dt)
        else:
            out = np.fix(out.astype(np.float64) / len(inputs)).astype(dt)
    return out


def assert_matches(got, expected, dtype, context):
    dt = np.dtype(dtype)
    if dt.kind == "f":
        tol = {2: 2e-2, 4: 1e-5, 8: 1e-12}[dt.itemsize]
        np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), rtol=tol, atol=tol,
                                   err_msg=context)
    else:
        assert np.array_equal(got, expected), context


def _comm(rank, size, port, transport, **kw):
    from pyrdma.collectives import Communicator
    return Communicator(rank, size, f"127.0.0.1:{port}", transport=transport, timeout=kw.pop("timeout", 120), **kw)


def _matrix(rank, size, port, transport, cases, slot_bytes):
    results = []
    with _comm(rank, size, port, transport, slot_bytes=slot_bytes) as comm:
        for (n, dtype, op, algorithm) in cases:
            x = make_input(rank, n, dtype, op)
            out = np.empty_like(x)
            comm.allreduce(x, out=out, op=op, algorithm=algorithm)
            results.append(out)
    return results


def _cases(sizes, dtypes=DTYPES, ops=OPS, algorithms=("ring", "tree")):
    return [(n, d, o, a) for n in sizes for d in dtypes for o in ops for a in algorithms]


def check_matrix(size, transport, cases, slot_bytes=64 * 1024):
    results = run_ranks(_matrix, size, free_port(), transport, cases, slot_bytes)
    for i, (n, dtype, op, algorithm) in enumerate(cases):
        expected = reference([make_input(r, n, dtype, op) for r in range(size)], op)
        for r in range(size):
            assert_matches(results[r][i], expected, dtype, f"{size} ranks, n={n}, {dtype}, {op}, {algorithm}, rank {r}")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_allreduce_every_op_and_dtype(transport):
    # Fewer elements than ranks, not divisible by the rank count, and several chunks per segment.
    check_matrix(3, transport, _cases([1, 2, 5, 20011]), slot_bytes=4096)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("size", [2, 4, 8])
def test_allreduce_rank_counts(transport, size):
    check_matrix(size, transport, _cases([1, 7, 1000, 65537], dtypes=["int32", "float32"], ops=["sum", "max"]))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_allreduce_large(transport):
    # 16 MiB float32 and 24 MiB int64 through 256 KiB slots: many chunks per segment.
    check_matrix(2, transport, [(4 << 20, "float32", "sum", "ring"), (3 << 20, "int64", "sum", "ring"),
                                (3 << 20, "int64", "max", "auto")], slot_bytes=256 * 1024)


def _other_collectives(rank, size, port, transport):
    out = {}
    with _comm(rank, size, port, transport, slot_bytes=4096) as comm:
        b = np.full(5000, rank, np.int32)
        comm.broadcast(b, root=size - 1)
        out["broadcast"] = b
        r = make_input(rank, 3001, "float64", "sum")
        keep = r.copy()
        comm.reduce(r, root=1, op="max")
        out["reduce"] = r if rank == 1 else None
        out["reduce_input_kept"] = bool(rank == 1 or np.array_equal(r, keep))
        out["allgather"] = comm.allgather(np.full(1001, rank, np.int16 if False else np.int64))
        out["reduce_scatter"] = comm.reduce_scatter(make_input(rank, 10007, "int32", "sum"))
        out["bounds"] = comm.segment_bounds(10007)
        comm.barrier()
        h = comm.iallreduce(np.arange(100, dtype=np.float32) * rank)   # non-blocking
        busy = sum(i * i for i in range(10000))                       # overlap with computation
        assert busy > 0
        out["iallreduce"] = h.wait(timeout=120)
        out["test_after_wait"] = h.test()
        for i in range(1000):                                          # many small calls stay correct
            v = np.array([rank + i], np.int64)
            comm.allreduce(v)
            if v[0] != size * i + size * (size - 1) // 2:
                out["small_failed_at"] = i
                break
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("size", [2, 3])
def test_other_collectives(transport, size):
    res = run_ranks(_other_collectives, size, free_port(), transport)
    expected_max = reference([make_input(r, 3001, "float64", "sum") for r in range(size)], "max")
    assert np.array_equal(res[1]["reduce"], expected_max)
    full = reference([make_input(r, 10007, "int32", "sum") for r in range(size)], "sum")
    for rank, out in enumerate(res):
        assert (out["broadcast"] == size - 1).all()
        assert out["reduce_input_kept"]
        assert np.array_equal(out["allgather"], np.repeat(np.arange(size), 1001))
        start, stop = out["bounds"][rank]
        assert np.array_equal(out["reduce_scatter"], full[start:stop])
        assert np.allclose(out["iallreduce"], np.arange(100) * sum(range(size)))
        assert out["test_after_wait"]
        assert "small_failed_at" not in out, out.get("small_failed_at")


def _bad_inputs(rank, size, port, transport):
    import pyrdma as rd
    errors = {}
    with _comm(rank, size, port, transport) as comm:
        for name, call in {
            "noncontiguous": lambda: comm.allreduce(np.zeros((4, 4))[:, 0]),
            "dtype": lambda: comm.allreduce(np.zeros(4, np.complex64)),
            "op": lambda: comm.allreduce(np.zeros(4), op="xor"),
            "algorithm": lambda: comm.allreduce(np.zeros(4), algorithm="butterfly"),
            "readonly": lambda: comm.allreduce(np.zeros(4)[::1].copy().setflags(write=False) or
                                               np.frombuffer(b"\0" * 32, np.float64)),
            "out_size": lambda: comm.allreduce(np.zeros(4), out=np.zeros(5)),
            "root": lambda: comm.broadcast(np.zeros(4), root=size),
            "cuda_like": lambda: comm.allreduce(object()),
        }.items():
            try:
                call()
                errors[name] = None
            except rd.UsageError as exc:
                errors[name] = str(exc)
        # The ranks disagree on the size: the mismatch is reported, not silently reduced.
        try:
            comm.allreduce(np.zeros(100 + rank, np.float32), algorithm="ring")
            errors["mismatch"] = None
        except rd.RDMAError as exc:
            errors["mismatch"] = f"{type(exc).__name__}: {exc}"
    return errors


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bad_input_is_a_clear_error(transport):
    res = run_ranks(_bad_inputs, 2, free_port(), transport)
    for errors in res:
        assert "C-contiguous" in errors["noncontiguous"]
        assert "unsupported dtype" in errors["dtype"]
        assert "unsupported op" in errors["op"]
        assert "unknown algorithm" in errors["algorithm"]
        assert "read-only" in errors["readonly"]
        assert "bytes, expected" in errors["out_size"]
        assert "root" in errors["root"]
        assert "not an array" in errors["cuda_like"]
    assert any(e["mismatch"] and "disagree" in e["mismatch"] for e in res), res


def test_bootstrap_from_env_and_errors():
    import pyrdma as rd
    from pyrdma.collectives.bootstrap import MPIExchange, env_config, parse_address
    assert env_config({"MASTER_ADDR": "h", "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "4"}) == ("h", 29500, 1, 4)
    with pytest.raises(rd.UsageError, match="MASTER_PORT, RANK"):
        env_config({"MASTER_ADDR": "h"})
    with pytest.raises(rd.UsageError, match="not within"):
        env_config({"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(rd.UsageError, match="host:port"):
        parse_address("nohost")

    class FakeMPI:   # the two calls MPIExchange uses
        def Get_rank(self):
            return 1

        def Get_size(self):
            return 2

        def allgather(self, obj):
            return [b"zero", obj]
    assert MPIExchange(FakeMPI()).allgather(b"one") == [b"zero", b"one"]


def _from_env(rank, size, port):
    from pyrdma.collectives import init_from_env
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(size)}
    with init_from_env(environ=env, transport="tcp", timeout=60) as comm:
        x = np.full(3, rank + 1.0)
        comm.allreduce(x)
        return x


def test_torchrun_style_environment():
    res = run_ranks(_from_env, 3, free_port())
    for x in res:
        assert (x == 6.0).all()


def test_rendezvous_rejects_foreign_peer_and_times_out():
    import socket
    import threading

    import pyrdma as rd
    from pyrdma.collectives.bootstrap import TCPStore
    port = free_port()
    store = TCPStore("127.0.0.1", port, 0, 2, timeout=2)

    def intruder():
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(20))
    threading.Thread(target=intruder, daemon=True).start()
    # the stranger is dropped (the rendezvous goes on) and named when rank 1 never comes
    with pytest.raises(rd.RDMATimeoutError, match=r"ranks \[1\] did not join.*refused: .*not a pyrdma rendezvous peer"):
        store.allgather(b"rank0")
    store.close()
    lonely = TCPStore("127.0.0.1", free_port(), 0, 3, timeout=0.5)
    with pytest.raises(rd.RDMATimeoutError, match=r"ranks \[1, 2\] did not join"):
        lonely.allgather(b"x")
    lonely.close()


def test_cost_model_prefers_tree_small_ring_large():
    from pyrdma.collectives import CostModel
    m = CostModel(alpha=5e-6, beta=1e-10)
    assert m.choose(64, 8, 256 * 1024) == "tree"
    assert m.choose(64 << 20, 8, 256 * 1024) == "ring"
    assert m.choose(16, 2, 256 * 1024) == "tree"
