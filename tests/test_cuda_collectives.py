"""Collectives on CUDA arrays (marker ``gpu``): every collective, op and dtype on CuPy arrays (and
bfloat16 PyTorch CUDA tensors) gives bit for bit what the same Communicator gives on numpy arrays.

Three rank processes share the machine's GPU and talk over TCP (a GPU machine here has no RDMA NIC);
the staging code is the same whatever the transport. The inputs are test_collectives_comm's.
"""
import numpy as np
import pytest

from test_collectives_comm import DTYPES, OPS, collect_usage_errors, make_input
from test_collectives_world import World

pytestmark = pytest.mark.gpu
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def world():
    w = World(3, "tcp", timeout=TIMEOUT, start_timeout=300.0)
    yield w
    w.close()


@pytest.fixture(scope="module")
def direct_world():
    """gpu_path "direct": the algorithms run in GPU memory with CUDA-kernel reductions (over TCP here,
    where the transport copies each message out of and into GPU memory; over RDMA the NIC would)."""
    w = World(3, "tcp", timeout=TIMEOUT, start_timeout=300.0, max_message=4096, gpu_path="direct")
    yield w
    w.close()


class _Cupy:
    """numpy bits <-> a CUDA array: CuPy, or a PyTorch tensor for bfloat16 (CuPy has no bfloat16)."""

    def __init__(self, dtype):
        import cupy
        self.cp, self.bf16 = cupy, dtype == "bfloat16"
        if self.bf16:
            import torch
            self.torch = torch

    def up(self, x):
        if self.bf16:
            return self.torch.from_numpy(x.view(np.int16).copy()).cuda().view(self.torch.bfloat16)
        return self.cp.asarray(x)

    def empty(self, n):
        if self.bf16:
            return self.torch.empty(n, dtype=self.torch.bfloat16, device="cuda")
        return None      # let the collective allocate

    def down(self, g):
        if self.bf16:
            return g.view(self.torch.int16).cpu().numpy().view(np.uint16)
        return self.cp.asnumpy(g)


def _host_and_gpu(comm, cases):
    """For each case, the host results and the GPU results of every collective, as bytes."""
    out = []
    root = comm.size - 1
    for count, dtype, op in cases:
        x = make_input(comm.rank, count, dtype, op)
        dt = "bfloat16" if dtype == "bfloat16" else None
        host, gpu = {}, {}
        h = x.copy()
        comm.allreduce(h, op=op, dtype=dt)
        host["allreduce"] = host["allreduce_out"] = h
        h = x.copy()
        comm.reduce(h, op=op, root=root, dtype=dt)
        host["reduce"] = h
        h = x.copy()
        comm.broadcast(h, root=root)
        host["broadcast"] = h
        host["allgather"] = comm.allgather(x)
        host["reduce_scatter"] = comm.reduce_scatter(x, op=op, dtype=dt)

        c = _Cupy(dtype)
        g = c.up(x)
        assert comm.allreduce(g, op=op) is g
        gpu["allreduce"] = c.down(g)
        g, o = c.up(x), c.up(np.zeros_like(x))
        assert comm.allreduce(g, out=o, op=op) is o
        assert c.down(g).tobytes() == x.tobytes(), "out-of-place allreduce changed its input"
        gpu["allreduce_out"] = c.down(o)
        g = c.up(x)
        assert (comm.reduce(g, op=op, root=root) is g) == (comm.rank == root)
        gpu["reduce"] = c.down(g)
        g = c.up(x)
        assert comm.broadcast(g, root=root) is g
        gpu["broadcast"] = c.down(g)
        gpu["allgather"] = c.down(comm.allgather(c.up(x), out=c.empty(count * comm.size)))
        gpu["reduce_scatter"] = c.down(comm.reduce_scatter(c.up(x), op=op, out=c.empty(len(host["reduce_scatter"]))))
        out.append({k: (host[k].tobytes(), gpu[k].tobytes()) for k in host})
    return out


def _check(world, cases):
    results = world.run(_host_and_gpu, cases, timeout=600)
    for r, per_rank in enumerate(results):
        for (count, dtype, op), got in zip(cases, per_rank):
            for name, (host, gpu) in got.items():
                assert gpu == host, f"rank {r}: {name} of {count} x {dtype} ({op}) differs from the numpy path"


def test_every_collective_op_and_dtype_matches_the_numpy_path(world):
    # fewer elements than ranks, not divisible by 3, and more than one staging chunk (4 MiB)
    cases = [(c, d, o) for c in (1, 1003) for d in DTYPES for o in OPS] + [(1_500_001, "float32", "sum")]
    _check(world, cases)


def _usage_errors(comm):
    import cupy as cp
    calls = {"out_size": lambda: comm.allreduce(cp.zeros(4), out=cp.zeros(5)),
             "out_dtype": lambda: comm.allreduce(cp.zeros(4), out=cp.zeros(4, cp.float32)),
             "noncontiguous": lambda: comm.allreduce(cp.zeros((4, 4))[:, 0]),
             "allgather_out": lambda: comm.allgather(cp.zeros(4), out=cp.zeros(4)),
             "complex": lambda: comm.allreduce(cp.zeros(4, cp.complex64))}
    errors = collect_usage_errors(calls)
    x = cp.ones(3)
    comm.allreduce(x)
    errors["still_works"] = float(x.sum())
    return errors


def test_bad_cuda_input_is_a_usage_error(world):
    expected = {"out_size": "out must match", "out_dtype": "out must match", "noncontiguous": "C-contiguous",
                "allgather_out": "out must hold", "complex": "unsupported dtype"}
    for errors in world.run(_usage_errors):
        assert errors.pop("still_works") == 9.0
        for name, text in expected.items():
            assert errors[name] is not None and text in errors[name], (name, errors[name])


def _direct_cases(comm, cases):
    """allreduce (in place and into out=) and broadcast of each case on the direct path, with the
    numpy path's results alongside, and whether the staging pipeline was ever used."""
    import pyrdma.cuda as gpu
    out = []
    root = 1
    for count, dtype, op, algorithm in cases:
        x = make_input(comm.rank, count, dtype, op)
        h = x.copy()
        comm.allreduce(h, op=op, algorithm=algorithm, dtype="bfloat16" if dtype == "bfloat16" else None)
        b = x.copy()
        comm.broadcast(b, root=root)
        c = _Cupy(dtype)
        g = c.up(x)
        assert comm.allreduce(g, op=op, algorithm=algorithm) is g
        g2, o = c.up(x), c.up(np.zeros_like(x))
        assert comm.allreduce(g2, out=o, op=op, algorithm=algorithm) is o
        assert c.down(g2).tobytes() == x.tobytes(), "out-of-place allreduce changed its input"
        gb = c.up(x)
        assert comm.broadcast(gb, root=root) is gb
        out.append((h.tobytes(), c.down(g).tobytes(), c.down(o).tobytes(), b.tobytes(), c.down(gb).tobytes()))
    return out, gpu.default_pipeline().host_slots(0) != []


def test_direct_path_matches_the_numpy_path(direct_world):
    # several 4 KiB messages per step, every op and dtype, both in-place algorithms
    cases = [(c, d, o, a) for c in (1, 5003) for d in DTYPES if d != "bfloat16" for o in OPS
             for a in ("ring", "halving_doubling")]
    for r, (per_rank, staged) in enumerate(direct_world.run(_direct_cases, cases, timeout=600)):
        assert not staged, f"rank {r}: the direct path went through host staging"
        for (count, dtype, op, algorithm), (host, gpu, gpu_out, host_b, gpu_b) in zip(cases, per_rank):
            what = f"rank {r}: {count} x {dtype} ({op}, {algorithm})"
            assert gpu == host and gpu_out == host, f"{what}: allreduce differs from the numpy path"
            assert gpu_b == host_b, f"{what}: broadcast differs from the numpy path"
    # bfloat16 has no GPU kernel: the direct path stages it, with the same results
    per_rank, staged = direct_world.run(_direct_cases, [(1003, "bfloat16", "sum", "ring")])[0]
    assert staged and per_rank[0][0] == per_rank[0][1] == per_rank[0][2]


def _copy_collectives_on_gpu(comm):
    """gather, scatter, alltoall (equal and uneven) and send/recv of CuPy arrays, staged: the same
    values as the numpy path; the non-blocking forms and batch as well."""
    import cupy as cp
    import pyrdma
    from test_collectives_p2p import piece, uneven
    n, r = comm.size, comm.rank
    for dtype in ("int8", "float16", "float32", "int64"):
        mine = piece(r, 0, 300, dtype)
        got = comm.gather(cp.asarray(mine), root=1)
        want = np.concatenate([piece(p, 0, 300, dtype) for p in range(n)])
        assert (got is None) if r != 1 else (isinstance(got, cp.ndarray) and np.array_equal(cp.asnumpy(got), want))
        out = cp.zeros(300, dtype)
        assert comm.scatter(cp.asarray(want), out=out, root=0) is out
        assert np.array_equal(cp.asnumpy(out), piece(r, 0, 300, dtype))
        send = [uneven(r, p, n) for p in range(n)]
        buf = np.concatenate([piece(r, p, send[p], dtype) for p in range(n)])
        got = comm.alltoall(cp.asarray(buf), send_counts=send)
        want = np.concatenate([piece(p, r, uneven(p, r, n), dtype) for p in range(n)])
        assert isinstance(got, cp.ndarray) and np.array_equal(cp.asnumpy(got), want), dtype
        y = cp.zeros(500, dtype)
        right, left = (r + 1) % n, (r - 1) % n
        count = comm.sendrecv(cp.asarray(piece(r, right, 400, dtype)), right, y, left)
        assert count == 400 and np.array_equal(cp.asnumpy(y[:400]), piece(left, r, 400, dtype))
        assert not cp.asnumpy(y[400:]).any()
    # the non-blocking forms stage too: copied down at the call, uploaded when wait() returns
    x = cp.arange(1000, dtype=cp.float32) * (r + 1)
    assert comm.iallreduce(x).wait(timeout=120) is x
    assert np.array_equal(cp.asnumpy(x), np.arange(1000, dtype=np.float32) * (n * (n + 1) // 2))
    y = cp.zeros(500, "int32")
    h = comm.batch([("recv", y, left), ("send", cp.asarray(piece(r, right, 300, "int32")), right)])
    assert h.wait(timeout=120)[0] == 300 and np.array_equal(cp.asnumpy(y[:300]), piece(left, r, 300, "int32"))
    assert not cp.asnumpy(y[300:]).any()
    got = comm.igather(cp.asarray(piece(r, 0, 70, "float64")), root=0).wait(timeout=120)
    want = np.concatenate([piece(p, 0, 70, "float64") for p in range(n)])
    assert (got is None) if r else np.array_equal(cp.asnumpy(got), want)
    # a bfloat16 DLPack tensor is reduced as bfloat16, not as the uint16 bits its host copy holds
    import torch
    t = torch.full((64,), 1.5, dtype=torch.bfloat16, device="cuda")
    comm.iallreduce(t).wait(timeout=120)
    assert bool(torch.all(t == 1.5 * n)), t[:4]
    with pytest.raises(pyrdma.UsageError, match="does not match"):
        comm.iallreduce(t, dtype="float16")
    return True


def test_gather_scatter_alltoall_and_send_recv_of_cuda_arrays(world):
    assert all(world.run(_copy_collectives_on_gpu, timeout=300))
