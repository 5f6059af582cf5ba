"""The "pyrdma" torch backend against gloo, in the same processes and the same run:

    python3 bench/torch_backend_bench.py [--device cpu|cuda] [--ranks 2] [--sizes 8,65536,1048576]
        [--ops all_reduce,broadcast,...] [--iters 20] [--rounds 1] [--ddp-steps 10] [--async] [--json OUT]

``--ranks`` processes on this host join one job: the default group over pyrdma and a second group
over gloo. For each op and size (bytes of the op's input tensor) each backend runs the op
``--iters`` times after a warm-up, each call between a barrier (of gloo, on the CPU) and, for CUDA
tensors, torch.cuda.synchronize(); a backend's time is the slowest rank's median. The two backends
alternate per size and per round, so drift affects both; with ``--rounds`` R every cell is measured R
times (all ops and sizes once per round) and its ratio is the median of the per-round ratios, as
bench/collectives_bench.py reports them (on a noisy machine one round's small cells move by +-30%).
With ``--async`` each collective is
called with async_op=True and its Work waited for at once (numpy_allreduce: iallreduce), which
runs it on the backend's communicator thread instead of the caller's. Then a DDP step (``--layers`` x Linear(``--width``),
batch ``--batch``, SGD) over each backend from the same seed: median step time, and whether the two
models' parameters agree afterwards. Prints a table of pyrdma's time / gloo's (below 1: pyrdma is
faster) and the targets with their verdicts (the issue's: every cell <= 1.0x gloo, all_reduce <= 0.7x
from 16 MiB, the DDP step <= 1.0x with equal parameters), and writes all of it as JSON.

The ops (``--ops``, default all): the collectives of the torch API by their names (gather and
scatter to and from rank 0); ``all_to_all_splits``, all_to_all_single with uneven split sizes
(as MoE layers exchange tokens; each rank's input about the size given); ``batch_isend_irecv``,
each rank's tensor to the next rank while it receives the previous one's (a pipeline's exchange);
``send_recv``, a ping-pong of ranks 0 and 1 (the time of a round
trip; the other ranks wait at the barrier); and ``numpy_allreduce``, on pyrdma's side the
Communicator's own allreduce of a numpy array (the backend's Communicator, no torch in the call)
against gloo's all_reduce of a CPU tensor of the same bytes.

With CUDA tensors every rank uses GPU ``rank % device_count``; without an RDMA device pyrdma runs
over TCP (PYRDMA_TRANSPORT as for the backend), as gloo does.
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)        # pyrdma from this checkout, in the launcher and the ranks alike
OPS = ("all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor",
       "all_to_all_single", "all_to_all_splits", "all_to_all", "gather", "scatter", "send_recv", "batch_isend_irecv",
       "numpy_allreduce")
RATIO_TARGET = 1.0              # every cell: our time / gloo's
LARGE_ALLREDUCE = (16 << 20, 0.7)   # all_reduce from this many bytes: at most this ratio


def _tensors(op, nbytes, n, rank, device):
    """(input, output) of ``op`` with an input of about ``nbytes`` (float32, a multiple of n elements);
    gather's and scatter's lists on rank 0."""
    import torch
    count = max(n, (nbytes // 4) // n * n)
    x = torch.ones(count, dtype=torch.float32, device=device)
    if op in ("all_to_all_single",):
        return x, torch.empty_like(x)
    if op == "all_to_all_splits":      # MoE's token exchange: each pair's own count, half to 1.5x even
        def split(a, b):
            return max(1, count // n * (1 + (a + 2 * b) % 3) // 2)
        send, recv = [split(rank, p) for p in range(n)], [split(p, rank) for p in range(n)]
        return torch.ones(sum(send), dtype=torch.float32, device=device), \
            (torch.empty(sum(recv), dtype=torch.float32, device=device), recv, send)
    if op == "reduce_scatter_tensor":
        return x, torch.empty(count // n, dtype=torch.float32, device=device)
    if op == "all_gather_into_tensor":
        return x, torch.empty(count * n, dtype=torch.float32, device=device)
    if op == "all_gather":
        return x, [torch.empty_like(x) for _ in range(n)]
    if op == "all_to_all":
        return list(x.chunk(n)), [torch.empty(count // n, dtype=torch.float32, device=device) for _ in range(n)]
    if op == "gather":
        return x, [torch.empty_like(x) for _ in range(n)] if rank == 0 else None
    if op == "scatter":
        return x, [torch.ones_like(x) for _ in range(n)] if rank == 0 else None
    if op == "numpy_allreduce":
        return x, x.numpy() if device.type == "cpu" else None
    if op == "batch_isend_irecv":
        return x, torch.empty_like(x)
    return x, None


def _call(op, x, out, group, comm, async_op=False):
    """One call of ``op``; ``async_op``: the collectives' async form, waited for at once."""
    import torch.distributed as dist
    a, work = async_op, None
    if op == "all_reduce" or (op == "numpy_allreduce" and comm is None):
        work = dist.all_reduce(x, group=group, async_op=a)
    elif op == "numpy_allreduce":
        work = comm.iallreduce(out) if a else comm.allreduce(out)
    elif op == "broadcast":
        work = dist.broadcast(x, src=0, group=group, async_op=a)
    elif op == "reduce":
        work = dist.reduce(x, dst=0, group=group, async_op=a)
    elif op == "all_gather_into_tensor":
        work = dist.all_gather_into_tensor(out, x, group=group, async_op=a)
    elif op == "all_gather":
        work = dist.all_gather(out, x, group=group, async_op=a)
    elif op == "all_to_all_single":
        work = dist.all_to_all_single(out, x, group=group, async_op=a)
    elif op == "all_to_all_splits":
        work = dist.all_to_all_single(out[0], x, out[1], out[2], group=group, async_op=a)
    elif op == "all_to_all":
        work = dist.all_to_all(out, x, group=group, async_op=a)
    elif op == "reduce_scatter_tensor":
        work = dist.reduce_scatter_tensor(out, x, group=group, async_op=a)
    elif op == "gather":
        work = dist.gather(x, out, dst=0, group=group, async_op=a)
    elif op == "scatter":
        work = dist.scatter(x, out, src=0, group=group, async_op=a)
    elif op == "batch_isend_irecv":
        rank, n = dist.get_rank(), dist.get_world_size()
        # (waited here, whatever async_op: gloo's receive Work waits for a second message when
        # waited for twice)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (rank + 1) % n, group=group),
                                         dist.P2POp(dist.irecv, out, (rank - 1) % n, group=group)]):
            w.wait()
    elif op == "send_recv":
        rank = dist.get_rank()
        if rank == 0:
            dist.send(x, 1, group=group)
            dist.recv(x, 1, group=group)
        elif rank == 1:
            dist.recv(x, 0, group=group)
            dist.send(x, 0, group=group)
    else:
        raise ValueError(op)
    if a and work is not None:
        work.wait()


def _time(op, nbytes, group, barrier, n, device, iters, comm, async_op=False):
    import torch
    x, out = _tensors(op, nbytes, n, torch.distributed.get_rank(), device)
    if op == "numpy_allreduce" and device.type != "cpu":
        raise ValueError("numpy_allreduce runs on CPU tensors only (--device cpu)")
    times = []
    for i in range(iters + 1):
        barrier()
        t0 = time.perf_counter()
        _call(op, x, out, group, comm, async_op)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _ddp(args, groups, device):
    """{backend: median step seconds}, {backend: parameters after the steps}: one DDP model per
    backend, trained in lockstep and in alternating order (a 2-core machine drifts by more than the
    difference between two backends in a run of one after the other)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    nets, opts, gens, times = {}, {}, {}, {}
    for name, group in groups.items():
        torch.manual_seed(0)
        layers = []
        for _ in range(args.layers):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers).to(device)
        nets[name] = DDP(model, process_group=group, device_ids=[device.index] if device.type == "cuda" else None)
        opts[name] = torch.optim.SGD(nets[name].parameters(), lr=0.01)
        gens[name] = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
        times[name] = []
    names = list(groups)
    for i in range(args.ddp_steps + 1):
        for name in (names if i % 2 == 0 else names[::-1]):
            x = torch.randn(args.batch, args.width, generator=gens[name]).to(device)
            torch.distributed.barrier(group=groups["gloo"])
            t0 = time.perf_counter()
            opts[name].zero_grad()
            nets[name](x).square().mean().backward()
            opts[name].step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                times[name].append(time.perf_counter() - t0)
    return ({name: statistics.median(t) for name, t in times.items()},
            {name: torch.cat([p.detach().reshape(-1).cpu() for p in nets[name].module.parameters()]) for name in names})


def worker(rank, args, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.ranks))
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)     # reduce_scatter_tensor's new name
    import torch
    import torch.distributed as dist
    import pyrdma.torch  # registers the backend
    n = args.ranks
    device = torch.device("cpu") if args.device == "cpu" else torch.device("cuda", rank % torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("pyrdma", rank=rank, world_size=n)
    gloo = dist.new_group(backend="gloo")
    groups = {"pyrdma": dist.group.WORLD, "gloo": gloo}
    pg = dist.distributed_c10d._get_default_group()       # 2.13: the backend; 2.14: a ProcessGroup holding it
    ours = (pg if isinstance(pg, pyrdma.torch.ProcessGroupPyrdma) else pg._get_backend(torch.device("cpu"))).comm

    def barrier():
        dist.barrier(group=gloo)
    mine = {"ops": {}, "ddp": {}}
    for rnd in range(args.rounds):
        for op in args.ops:
            for k, nbytes in enumerate(args.sizes):
                order = ("pyrdma", "gloo") if (k + rnd) % 2 == 0 else ("gloo", "pyrdma")
                for name in order:
                    try:
                        t = _time(op, nbytes, groups[name], barrier, n, device, args.iters,
                                  ours if name == "pyrdma" else None, args.async_op)
                    except Exception as exc:  # noqa: BLE001 -- a backend that lacks the op: reported, not fatal
                        t = f"{type(exc).__name__}: {exc}"[:200]
                    mine["ops"].setdefault(f"{op} {nbytes} {name}", []).append(t)
    if args.ddp_steps:
        step, params = _ddp(args, groups, device)
        mine["ddp"].update(step)
        mine["ddp"]["params_equal"] = bool(torch.allclose(params["pyrdma"], params["gloo"], rtol=1e-5, atol=1e-6))
    results.put((rank, mine))
    dist.barrier(group=gloo)
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes", default="8,65536,1048576,16777216,134217728",
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--ops", default=",".join(OPS), type=lambda s: s.split(","))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--ddp-steps", type=int, default=10)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--json", default=None)
    p.add_argument("--async", dest="async_op", action="store_true",
                   help="the collectives' async_op=True form, waited for at once (the communicator's thread)")
    args = p.parse_args(argv)
    unknown = set(args.ops) - set(OPS)
    if unknown:
        p.error(f"unknown ops {sorted(unknown)}; use {', '.join(OPS)}")
    if args.rounds < 1 or args.iters < 1:
        p.error("--rounds and --iters must be at least 1")
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(worker, args=(args, port, results), nprocs=args.ranks, join=True, start_method="spawn")
    per_rank = dict(results.get() for _ in range(args.ranks))
    rows, table = [], []
    for op in args.ops:
        for nbytes in args.sizes:
            row = _cell(op, nbytes, [[per_rank[r]["ops"][f"{op} {nbytes} {name}"] for r in range(args.ranks)]
                                     for name in ("pyrdma", "gloo")])
            rows.append(row)
            spread = (f"{min(row['round_ratios']):.2f}-{max(row['round_ratios']):.2f}"
                      if len(row["round_ratios"]) > 1 else "")
            ratio = "" if row["pyrdma_vs_gloo"] is None else f"{row['pyrdma_vs_gloo']:.2f}"
            table.append(f"{op:<22} {nbytes:>10} {_us(row['pyrdma_s']):>12} {_us(row['gloo_s']):>12} "
                         f"{ratio:>8} {spread:>11}")
    report = {"device": args.device, "ranks": args.ranks, "iters": args.iters, "rounds": args.rounds,
              "async_op": args.async_op, "ops": rows}
    print(f"{'op':<22} {'bytes':>10} {'pyrdma us':>12} {'gloo us':>12} {'ratio':>8} {'rounds':>11}")
    print("\n".join(table))
    if args.ddp_steps:
        ddp = {name: max(per_rank[r]["ddp"][name] for r in range(args.ranks)) for name in ("pyrdma", "gloo")}
        equal = all(per_rank[r]["ddp"]["params_equal"] for r in range(args.ranks))
        report["ddp"] = {"layers": args.layers, "width": args.width, "batch": args.batch,
                         "pyrdma_s": ddp["pyrdma"], "gloo_s": ddp["gloo"],
                         "pyrdma_vs_gloo": ddp["pyrdma"] / ddp["gloo"], "params_equal": equal}
        print(f"DDP step ({args.layers} x Linear({args.width}), batch {args.batch}): pyrdma {ddp['pyrdma'] * 1e3:.2f} ms, "
              f"gloo {ddp['gloo'] * 1e3:.2f} ms, ratio {ddp['pyrdma'] / ddp['gloo']:.2f}, parameters equal: {equal}")
    for row in rows:
        for name in ("pyrdma", "gloo"):
            if isinstance(row[f"{name}_s"], str):
                print(f"{row['op']} {row['bytes']} {name}: {row[f'{name}_s']}")
    report["targets"] = targets(rows, report.get("ddp"))
    for t in report["targets"]:
        print(f"# target {t['target']}: {t['verdict']} ({t['detail']})")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _cell(op, nbytes, times):
    """The row of one op and size from ``times`` [[pyrdma's rounds per rank], [gloo's]]: each backend's
    time is the median over rounds of the slowest rank's median, the ratio the median of the
    per-round ratios of those; an error string in place of the times where a backend failed."""
    row = {"op": op, "bytes": nbytes, "round_ratios": []}
    slowest = {}
    for name, per_rank in zip(("pyrdma", "gloo"), times):
        error = next((t for ts in per_rank for t in ts if isinstance(t, str)), None)
        slowest[name] = error or [max(ts[k] for ts in per_rank) for k in range(len(per_rank[0]))]
        row[f"{name}_s"] = error or statistics.median(slowest[name])
    if all(isinstance(v, list) for v in slowest.values()):
        row["round_ratios"] = [a / b for a, b in zip(slowest["pyrdma"], slowest["gloo"])]
    row["pyrdma_vs_gloo"] = statistics.median(row["round_ratios"]) if row["round_ratios"] else None
    return row


def targets(rows, ddp):
    """The issue's targets with verdicts: [{target, verdict, detail}] (detail: the cells that miss)."""
    out = []

    def add(target, cells, limit):
        missed = [f"{r['op']} {r['bytes']} B: " + ("error" if r["pyrdma_vs_gloo"] is None else f"{r['pyrdma_vs_gloo']:.2f}")
                  for r in cells if r["pyrdma_vs_gloo"] is None or r["pyrdma_vs_gloo"] > limit]
        worst = max((r["pyrdma_vs_gloo"] for r in cells if r["pyrdma_vs_gloo"] is not None), default=None)
        out.append(dict(target=target, verdict=("PASS" if not missed else "FAIL") if cells else "not measured",
                        detail=(f"worst {worst:.2f}" if worst is not None else "no cells")
                        + (f"; missed: {', '.join(missed)}" if missed else "")))
    add(f"every cell <= {RATIO_TARGET}x gloo", rows, RATIO_TARGET)
    big, limit = LARGE_ALLREDUCE
    add(f"all_reduce from {big >> 20} MiB <= {limit}x gloo",
        [r for r in rows if r["op"] == "all_reduce" and r["bytes"] >= big], limit)
    if ddp is not None:
        ok = ddp["pyrdma_vs_gloo"] <= RATIO_TARGET and ddp["params_equal"]
        out.append(dict(target=f"DDP step <= {RATIO_TARGET}x gloo, parameters equal", verdict="PASS" if ok else "FAIL",
                        detail=f"{ddp['pyrdma_vs_gloo']:.2f}, parameters equal: {ddp['params_equal']}"))
    return out


def _us(t):
    return f"{t * 1e6:.1f}" if isinstance(t, float) else "error"


if __name__ == "__main__":
    sys.exit(main())
