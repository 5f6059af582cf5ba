"""The "pyrdma" torch backend against gloo, in the same processes and the same run:

    python3 bench/torch_backend_bench.py [--device cpu|cuda] [--ranks 2] [--sizes 8,65536,1048576]
        [--ops all_reduce,broadcast,all_to_all_single,reduce_scatter_tensor] [--iters 20] [--ddp-steps 10]
        [--json OUT]

``--ranks`` processes on this host join one job: the default group over pyrdma and a second group
over gloo. For each op and size (bytes of the op's input tensor) each backend runs the op
``--iters`` times after a warm-up, each call between a barrier (of gloo, on the CPU) and, for CUDA
tensors, torch.cuda.synchronize(); a backend's time is the slowest rank's median. The two backends
alternate per size, so drift affects both. Then a DDP step (``--layers`` x Linear(``--width``),
batch ``--batch``, SGD) over each backend from the same seed: median step time, and whether the two
models' parameters agree afterwards. Prints a table of pyrdma's time / gloo's (below 1: pyrdma is
faster) and writes the figures as JSON.

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
OPS = ("all_reduce", "broadcast", "all_to_all_single", "reduce_scatter_tensor")


def _tensors(op, nbytes, n, device):
    """(input, output) of ``op`` with an input of about ``nbytes`` (float32, a multiple of n elements)."""
    import torch
    count = max(n, (nbytes // 4) // n * n)
    x = torch.ones(count, dtype=torch.float32, device=device)
    if op == "all_to_all_single":
        return x, torch.empty_like(x)
    if op == "reduce_scatter_tensor":
        return x, torch.empty(count // n, dtype=torch.float32, device=device)
    return x, None


def _call(op, x, out, group):
    import torch.distributed as dist
    if op == "all_reduce":
        dist.all_reduce(x, group=group)
    elif op == "broadcast":
        dist.broadcast(x, src=0, group=group)
    elif op == "all_to_all_single":
        dist.all_to_all_single(out, x, group=group)
    else:
        dist.reduce_scatter_tensor(out, x, group=group)


def _time(op, nbytes, group, barrier, n, device, iters):
    import torch
    x, out = _tensors(op, nbytes, n, device)
    times = []
    for i in range(iters + 1):
        barrier()
        t0 = time.perf_counter()
        _call(op, x, out, group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _ddp(args, group, device):
    """(median step seconds, parameters after the steps) of a DDP model over ``group``."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(device)
    ddp = DDP(model, process_group=group, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    times = []
    for i in range(args.ddp_steps + 1):
        x = torch.randn(args.batch, args.width, generator=gen).to(device)
        torch.distributed.barrier(group=group)
        t0 = time.perf_counter()
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


def worker(rank, args, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.ranks))
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)     # reduce_scatter_tensor's new name
    import torch
    import torch.distributed as dist
    import pyrdma.torch  # noqa: F401 -- registers the backend
    n = args.ranks
    device = torch.device("cpu") if args.device == "cpu" else torch.device("cuda", rank % torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("pyrdma", rank=rank, world_size=n)
    gloo = dist.new_group(backend="gloo")
    groups = {"pyrdma": dist.group.WORLD, "gloo": gloo}

    def barrier():
        dist.barrier(group=gloo)
    mine = {"ops": {}, "ddp": {}}
    for op in args.ops:
        for k, nbytes in enumerate(args.sizes):
            order = ("pyrdma", "gloo") if k % 2 == 0 else ("gloo", "pyrdma")
            for name in order:
                try:
                    t = _time(op, nbytes, groups[name], barrier, n, device, args.iters)
                except Exception as exc:  # noqa: BLE001 -- a backend that lacks the op: reported, not fatal
                    t = f"{type(exc).__name__}: {exc}"[:200]
                mine["ops"][f"{op} {nbytes} {name}"] = t
    if args.ddp_steps:
        params = {}
        for name in ("pyrdma", "gloo"):
            mine["ddp"][name], params[name] = _ddp(args, groups[name], device)
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
    p.add_argument("--ddp-steps", type=int, default=10)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    unknown = set(args.ops) - set(OPS)
    if unknown:
        p.error(f"unknown ops {sorted(unknown)}; use {', '.join(OPS)}")
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
            times = {name: [per_rank[r]["ops"][f"{op} {nbytes} {name}"] for r in range(args.ranks)]
                     for name in ("pyrdma", "gloo")}
            slowest = {name: (max(v) if all(isinstance(t, float) for t in v) else next(t for t in v if isinstance(t, str)))
                       for name, v in times.items()}
            ratio = (slowest["pyrdma"] / slowest["gloo"] if all(isinstance(t, float) for t in slowest.values())
                     else None)
            rows.append({"op": op, "bytes": nbytes, "pyrdma_s": slowest["pyrdma"], "gloo_s": slowest["gloo"],
                         "pyrdma_vs_gloo": ratio})
            table.append(f"{op:<22} {nbytes:>10} {_us(slowest['pyrdma']):>12} {_us(slowest['gloo']):>12} "
                         f"{'' if ratio is None else f'{ratio:.2f}':>8}")
    report = {"device": args.device, "ranks": args.ranks, "iters": args.iters, "ops": rows}
    print(f"{'op':<22} {'bytes':>10} {'pyrdma us':>12} {'gloo us':>12} {'ratio':>8}")
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
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _us(t):
    return f"{t * 1e6:.1f}" if isinstance(t, float) else "error"


if __name__ == "__main__":
    sys.exit(main())
