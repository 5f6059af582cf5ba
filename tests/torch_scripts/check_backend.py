"""Run under torchrun: the "pyrdma" backend against gloo in the same processes.

    torchrun --nproc-per-node N tests/torch_scripts/check_backend.py OUT_DIR [--steps K] [--only ddp]
        [--dead-rank [--dead-rank-timeout S]] [--test-bed] [--device cuda]

Each rank writes OUT_DIR/rank<r>.json: the checks it made ("name": true/false or a message) and
the DDP parameters' checksums; the caller (tests/test_torch.py) asserts on them. DDP trains the
same small model from the same seed twice, once over pyrdma and once over gloo. With --device cuda
pyrdma's tensors, and both DDP models, live on the GPU; gloo's collective references stay on the CPU
(gloo has no CUDA reduce, all_gather or reduce_scatter).
"""
import time

T0 = time.monotonic()   # before torch's import, which dominates a rank's start-up under emulation

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import pyrdma.cuda  # noqa: E402
import pyrdma.torch  # noqa: F401,E402 -- registers the backend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads  # noqa: E402 -- FSDP2, pipelining, tensor parallel, all-to-all, p2p

PHASES = {"import": time.monotonic() - T0}
DEVICE = torch.device("cpu")     # where pyrdma's tensors and the DDP models live (--device)


def here(t):
    return t.to(DEVICE)


def phase(name, since):
    """Record and print how long ``name`` took (seconds since ``since``); returns now."""
    now = time.monotonic()
    PHASES[name] = round(now - since, 3)
    print(f"check_backend rank {os.environ.get('RANK')}: {name} {now - since:.1f} s", flush=True)
    return now

OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
       "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def model():
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def train(group, steps, rank):
    net = model().to(DEVICE)
    # small buckets: several allreduces per step, overlapping the backward pass
    ddp = torch.nn.parallel.DistributedDataParallel(net, process_group=group, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    start = time.perf_counter()
    for _ in range(steps):
        x, y = here(torch.randn(16, 32, generator=gen)), here(torch.randn(16, 8, generator=gen))
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).cpu(), time.perf_counter() - start


def values(rank, n, dtype):
    """Small integers, exactly representable in every dtype, different on every rank."""
    base = torch.arange(n, dtype=torch.float64) % 7 + rank + 1
    return base.to(dtype)


def collectives(gloo, rank, size, checks):
    def same(name, a, b):
        a, b = a.cpu(), b.cpu()
        checks[name] = bool(torch.equal(a, b)) or f"pyrdma {a[:6].tolist()} gloo {b[:6].tolist()}"

    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.float16, torch.bfloat16):
        for opname, op in OPS.items():
            if opname == "avg" or (opname == "product" and dtype in (torch.float16, torch.bfloat16)):
                continue     # gloo has no AVG; checked below against the sum
            a, b = here(values(rank, 1000, dtype)), values(rank, 1000, dtype)
            dist.all_reduce(a, op=op)
            ref = b.float() if dtype in (torch.float16, torch.bfloat16) else b   # gloo: no half reductions
            dist.all_reduce(ref, op=op, group=gloo)
            same(f"all_reduce {opname} {dtype}", a, ref.to(dtype))
    a = here(values(rank, 999, torch.float32))
    s = values(rank, 999, torch.float32)
    dist.all_reduce(a, op=dist.ReduceOp.AVG)
    dist.all_reduce(s, group=gloo)
    a = a.cpu()
    checks["all_reduce avg float32"] = bool(torch.allclose(a, s / size)) or f"{a[:4].tolist()} vs {(s / size)[:4]}"
    # async, several in flight, then waited on in reverse order
    ts = [here(values(rank, 4096 + i, torch.float32)) for i in range(4)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in reversed(works):
        w.wait()
    refs = [values(rank, 4096 + i, torch.float32) for i in range(4)]
    for r in refs:
        dist.all_reduce(r, group=gloo)
    checks["async all_reduce x4"] = all(torch.equal(t.cpu(), r) for t, r in zip(ts, refs))
    fut = dist.all_reduce(here(values(rank, 10, torch.float32)), async_op=True).get_future()
    checks["get_future"] = bool(torch.equal(fut.wait()[0].cpu(), refs[0][:0].new_tensor(
        [sum((i % 7) + r + 1 for r in range(size)) for i in range(10)], dtype=torch.float32)))
    # non-contiguous tensor: goes through a copy written back
    m = here(values(rank, 64, torch.float32)).reshape(8, 8).t()
    mr = values(rank, 64, torch.float32).reshape(8, 8).t()
    dist.all_reduce(m)
    dist.all_reduce(mr, group=gloo)
    same("all_reduce non-contiguous", m, mr)
    # broadcast from every root
    for root in range(size):
        a, b = here(values(rank, 300, torch.float32)), values(rank, 300, torch.float32)
        dist.broadcast(a, src=root)
        dist.broadcast(b, src=root, group=gloo)
        same(f"broadcast root {root}", a, b)
    # reduce to the last rank
    a, b = here(values(rank, 257, torch.int64)), values(rank, 257, torch.int64)
    dist.reduce(a, dst=size - 1, op=dist.ReduceOp.MAX)
    dist.reduce(b, dst=size - 1, op=dist.ReduceOp.MAX, group=gloo)
    if rank == size - 1:     # elsewhere torch leaves the tensor undefined (gloo writes partial results)
        same("reduce max", a, b)
    else:
        same("reduce leaves non-root tensors alone", a, values(rank, 257, torch.int64))
    # all_gather (list) and all_gather_into_tensor
    x = values(rank, 33, torch.float32)
    outs, refs = [here(torch.zeros(33)) for _ in range(size)], [torch.zeros(33) for _ in range(size)]
    dist.all_gather(outs, here(x))
    dist.all_gather(refs, x, group=gloo)
    same("all_gather", torch.stack(outs), torch.stack(refs))
    big, bigref = here(torch.zeros(size * 33)), torch.zeros(size * 33)
    dist.all_gather_into_tensor(big, here(x))
    dist.all_gather_into_tensor(bigref, x, group=gloo)
    same("all_gather_into_tensor", big, bigref)
    bf = here(values(rank, 40, torch.bfloat16))
    bouts = here(torch.zeros(size * 40, dtype=torch.bfloat16))
    dist.all_gather_into_tensor(bouts, bf)
    same("all_gather_into_tensor bfloat16", bouts, torch.cat([values(r, 40, torch.bfloat16) for r in range(size)]))
    # reduce_scatter (list) and reduce_scatter_tensor
    ins = [values(rank + i, 50, torch.float32) for i in range(size)]
    out, ref = here(torch.zeros(50)), torch.zeros(50)
    dist.reduce_scatter(out, [here(t) for t in ins])
    dist.reduce_scatter_tensor(ref, torch.cat(ins), group=gloo)
    same("reduce_scatter", out, ref)
    out = here(torch.zeros(50))
    dist.reduce_scatter_tensor(out, here(torch.cat(ins)))
    same("reduce_scatter_tensor", out, ref)
    dist.barrier()
    checks["barrier"] = True
    if DEVICE.type == "cpu":
        waited_at_once(rank, size, checks)
        leaves_no_garbage(rank, size, checks)


def leaves_no_garbage(rank, size, checks):
    """Collectives, blocking and async, and sends and receives leave no reference cycle: each would
    wait for the garbage collector, whose passes over torch's objects cost tens of us a call."""
    import gc
    x, out = here(torch.ones(64 * 1024)), here(torch.zeros(64 * 1024))
    calls = [lambda: dist.all_reduce(x), lambda: dist.all_reduce(x, async_op=True).wait(),
             lambda: dist.broadcast(x, 0, async_op=True).wait(), lambda: dist.all_to_all_single(out, x),
             lambda: [w.wait() for w in dist.batch_isend_irecv(
                 [dist.P2POp(dist.isend, x, (rank + 1) % size), dist.P2POp(dist.irecv, out, (rank - 1) % size)])]]
    for call in calls:
        call()
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            for call in calls:
                call()
        found = gc.collect()
    finally:
        gc.enable()
    checks["no reference cycles"] = found == 0 or f"{found} objects left to the garbage collector"


def waited_at_once(rank, size, checks):
    """Host-tensor calls that the caller waits for at once (async_op=False), larger than what runs
    inline anyway, and a blocking send/recv, run on the caller's thread: nothing is queued on the
    communicator's thread (pyrdma.torch: INLINE_BYTES, asyncOp); an async_op=True call of that
    size is."""
    pg = dist.distributed_c10d._get_default_group()
    ex = (pg if isinstance(pg, pyrdma.torch.ProcessGroupPyrdma) else pg._get_backend(torch.device("cpu"))).comm._exec
    n = 4 * pyrdma.torch.INLINE_BYTES // 4 // size * size
    x, out = torch.ones(n), torch.zeros(n)
    queued = []
    put = ex.queue.put
    ex.queue.put = lambda job: (queued.append(1), put(job))[1]
    try:
        dist.all_reduce(x)
        dist.broadcast(x, src=0)
        dist.reduce(x, dst=0)
        dist.all_to_all_single(out, x)
        dist.gather(x, [torch.zeros(n) for _ in range(size)] if rank == 0 else None, dst=0)
        dist.scatter(out, [x] * size if rank == 0 else None, src=0)
        if rank < 2:
            (dist.send if rank == 0 else dist.recv)(x, 1 - rank)
        checks["waited calls run at once"] = not queued or f"{len(queued)} calls were queued"
        dist.all_reduce(x, async_op=True).wait()
        checks["an async call of that size is queued"] = len(queued) == 1 or f"{len(queued)} calls were queued"
    finally:
        del ex.queue.put                     # the class's own again


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", choices=["ddp", "all"], default="all")
    ap.add_argument("--dead-rank", action="store_true",
                    help="at the end the last rank exits without a word; rank 0's next all_reduce in a group "
                         "with a --dead-rank-timeout timeout must fail naming it (written to dead_rank.json)")
    ap.add_argument("--dead-rank-timeout", type=float, default=15.0)
    ap.add_argument("--test-bed", action="store_true",
                    help="on the multi-host test bed (PYRDMA_TEST_HOSTS): local rank k runs on host k+1 (its "
                         "device, GID and address), as one worker per node would")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where pyrdma's tensors and the DDP models live (cuda: this rank's LOCAL_RANK GPU)")
    args = ap.parse_args()
    global DEVICE
    if args.device == "cuda":
        DEVICE = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(DEVICE)
    host = None
    if args.test_bed:
        from pyrdma.testing import hosts as testbed
        host = testbed.load()[int(os.environ["LOCAL_RANK"])]
        os.environ.update(host.env())
    t = phase("import", T0)
    dist.init_process_group("pyrdma", timeout=datetime.timedelta(seconds=120))
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    t = phase("init", t)
    pg = dist.distributed_c10d._get_default_group()
    # torch 2.13: the group is the backend; 2.14: a ProcessGroup holding it per device
    comm = (pg if isinstance(pg, pyrdma.torch.ProcessGroupPyrdma) else pg._get_backend(torch.device("cpu"))).comm
    checks = {"backend": dist.get_backend() == "pyrdma" or dist.get_backend(), "transport": comm.transport_name,
              "device": str(DEVICE)}
    if comm.transport_name == "rdma":    # the GID index each QP uses (the test bed checks it is its host's)
        checks["gid indices"] = sorted({link.qp.gid_index for link in comm.transport.links.values()})
    if host is not None:
        checks["host"] = host.name
    if DEVICE.type == "cuda":       # CUDA tensors stage through CuPy's streams, or torch's without it
        checks["staging"] = type(pyrdma.cuda.default_pipeline().backend).__name__
    if args.only == "all":
        collectives(gloo, rank, size, checks)
        t = phase("collectives", t)
        since = [t]

        def workload_phase(name):
            since[0] = phase(name, since[0])
        workloads.run_all(None, gloo, rank, size, checks, DEVICE, workload_phase)
        t = since[0]
    params, t_pyrdma = train(None, args.steps, rank)
    params_gloo, t_gloo = train(gloo, args.steps, rank)
    t = phase("ddp", t)
    everyone = [torch.zeros_like(params) for _ in range(size)]
    dist.all_gather(everyone, params, group=gloo)
    checks["ddp identical on every rank"] = all(torch.equal(p, params) for p in everyone)
    checks["ddp matches gloo"] = bool(torch.allclose(params, params_gloo, rtol=1e-5, atol=1e-6)) or \
        f"max difference {(params - params_gloo).abs().max().item()}"
    checks["ddp trained"] = not torch.equal(params, torch.cat([p.reshape(-1) for p in model().parameters()]))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "size": size, "checks": checks, "seconds": {"pyrdma": t_pyrdma, "gloo": t_gloo},
                   "phases": PHASES},
                  f, indent=1)
    if args.dead_rank:
        dead_rank(rank, size, args.out, t, args.dead_rank_timeout, fsdp2=args.only == "all")
    dist.destroy_process_group()
    return 0


def dead_rank(rank, size, out, t, timeout_s, fsdp2):
    """The last rank exits without a word; rank 0's next step (an FSDP2 step with ``fsdp2``, else an
    all_reduce) in a group with a ``timeout_s`` timeout must fail naming it."""
    # the ranks enter the short group's rendezvous together: its timeout bounds the dead rank's
    # detection, not how far apart the ranks finished their workloads (seconds, in the emulated VM)
    dist.barrier()
    short = dist.new_group(backend="pyrdma", timeout=datetime.timedelta(seconds=timeout_s))
    if fsdp2:
        step = workloads.fsdp2_dead_rank_step(short, rank, size, DEVICE)    # one step with every rank
    else:
        dist.all_reduce(torch.ones(10), group=short)          # every rank is connected

        def step():
            dist.all_reduce(torch.ones(1000), group=short)
    dist.barrier()
    phase("dead-rank group", t)
    if rank == size - 1:
        os._exit(0)
    start = time.monotonic()
    try:
        step()
        outcome = {"error": None}
    except Exception as exc:     # noqa: BLE001 -- the message is the result
        outcome = {"error": f"{type(exc).__name__}: {exc}"}
    outcome["seconds"] = time.monotonic() - start
    outcome["step"] = "fsdp2" if fsdp2 else "all_reduce"
    if rank == 0:
        with open(os.path.join(out, "dead_rank.json"), "w") as f:
            json.dump(outcome, f)
    os._exit(0)                  # the groups are broken: no goodbyes


if __name__ == "__main__":
    sys.exit(main())
