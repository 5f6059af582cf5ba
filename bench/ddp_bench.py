"""DDP and FSDP2 over the "pyrdma" torch backend against gloo, in one run (one VM boot):

    python3 -m pyrdma.testing.vm --hosts 2 --rwdir build/bench -- "$(python3 -c 'import sys;print(sys.executable)')" \
        bench/ddp_bench.py --out build/bench

For each backend, torchrun starts ``--ranks`` processes that train an MLP (``--hidden``: about
4.0 M parameters by default) on synthetic data with DistributedDataParallel and time each step
(median after one warm-up step), then the same with FSDP2 (``fully_shard`` on each Linear and the
root: an all-gather before each layer's forward and backward, a reduce-scatter after its backward),
then time an allreduce of one 25 MiB float32 bucket (DDP's default bucket size; median of
``--iters``). busbw = 2(n-1)/n * bytes / time, as nccl-tests; ib_write_bw's 8 MiB average on the same
device is the physical anchor. Writes ddp.json.

Where to expect what: on Soft-RoCE every RDMA byte is CPU work in the kernel on the same cores as
the ranks, and gloo's TCP over ``lo`` is a memcpy, so in the VM gloo may move 25 MiB faster than
rxe's own ib_write_bw can; pyrdma's step time can still win when its allreduces overlap the
backward pass. On a real NIC the order of the raw allreduce reverses.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET_BYTES = 25 << 20
sys.path.insert(0, ROOT)        # pyrdma from this checkout, for the launcher as for the workers


def mlp(args):
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(args.features, args.hidden), torch.nn.ReLU(),
                               torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                               torch.nn.Linear(args.hidden, 10))


def time_steps(args, model, rank):
    """Median step time (forward, backward, SGD step) after one warm-up step."""
    import torch
    import torch.distributed as dist
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    steps = []
    for _ in range(args.steps + 1):
        x, y = torch.randn(args.batch, args.features, generator=gen), torch.randint(0, 10, (args.batch,), generator=gen)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        steps.append(time.perf_counter() - t0)
    return statistics.median(steps[1:])


def worker(args):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    import pyrdma.torch  # noqa: F401 -- registers "pyrdma"

    hosts = test_bed_hosts(args)
    if hosts:                   # this rank's device, GID and address
        os.environ.update(hosts[int(os.environ["LOCAL_RANK"])].env())
    dist.init_process_group(args.backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    net = mlp(args)
    ddp_step = time_steps(args, torch.nn.parallel.DistributedDataParallel(net), rank)
    sharded = mlp(args)
    mesh = DeviceMesh.from_group(dist.distributed_c10d._get_default_group(), "cpu")
    for layer in sharded:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    fsdp_step = time_steps(args, sharded, rank)
    bucket = torch.ones(BUCKET_BYTES // 4)
    dist.all_reduce(bucket)                       # warm-up: registration, connections
    times = []
    for _ in range(args.iters):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(bucket)
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor([ddp_step, fsdp_step, statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        params = sum(p.numel() for p in net.parameters())
        step_s, fsdp2_step_s, allreduce_s = slowest.tolist()
        with open(os.path.join(args.out, f"ddp_{args.backend}.json"), "w") as f:
            json.dump(dict(backend=args.backend, ranks=size, params=params, batch=args.batch, step_s=step_s,
                           fsdp2_step_s=fsdp2_step_s, allreduce_25mib_s=allreduce_s,
                           busbw_gbs=2 * (size - 1) / size * BUCKET_BYTES / allreduce_s / 1e9), f)
    dist.destroy_process_group()


def test_bed_hosts(args):
    """The test bed's hosts the ranks run on (local rank k on host k), or [] (all on --dev)."""
    from pyrdma.testing import hosts as testbed
    hosts = testbed.load() if os.environ.get(testbed.HOSTS_ENV) else []
    return hosts[:args.ranks] if len(hosts) >= args.ranks else []


def run_backend(args, backend, extra):
    hosts = test_bed_hosts(args)
    if hosts:       # torch's store and the pyrdma rendezvous on host 0's address, as a second node sees them
        from pyrdma.testing import free_port
        launch = ["--nnodes=1", "--node-rank=0", f"--master-addr={hosts[0].address}",
                  f"--master-port={free_port(hosts[0].address)}"]
    else:
        launch = ["--standalone"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, f"--nproc-per-node={args.ranks}",
           os.path.abspath(__file__), "--worker", "--backend", backend, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run(cmd, check=True, timeout=args.timeout, env=env)
    with open(os.path.join(args.out, f"ddp_{backend}.json")) as f:
        return json.load(f)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "build", "bench"))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--features", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=1536, help="hidden width (1536 with 1024 features: 3.95 M parameters)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    p.add_argument("--iters", type=int, default=5, help="timed 25 MiB allreduces")
    p.add_argument("--dev", default="rxe0")
    p.add_argument("--gid", type=int, default=1)
    p.add_argument("--no-ib-write-bw", action="store_true")
    p.add_argument("--timeout", type=int, default=3000, help="seconds per backend run")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="pyrdma", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.worker:
        return worker(args)
    extra = ["--out", args.out, "--features", str(args.features), "--hidden", str(args.hidden), "--batch",
             str(args.batch), "--steps", str(args.steps), "--iters", str(args.iters)]
    rows = [run_backend(args, b, extra) for b in ("gloo", "pyrdma")]
    anchor = None
    if not args.no_ib_write_bw:
        from pyrdma.perf.allreduce_bench import ib_write_bw
        anchor = ib_write_bw(args.dev, args.gid, 8 << 20)
    print(f"# DDP and FSDP2, {rows[0]['ranks']} ranks, MLP of {rows[0]['params']:,} parameters, "
          f"batch {rows[0]['batch']}; "
          f"ib_write_bw 8 MiB: {anchor if anchor is None else f'{anchor:.4f}'} GB/s")
    print(f"{'backend':>8} {'DDP step s':>11} {'FSDP2 step s':>13} {'25MiB allreduce s':>18} {'busbw GB/s':>11} "
          f"{'vs ib_write_bw':>15}")
    for r in rows:
        r["vs_ib_write_bw"] = r["busbw_gbs"] / anchor if anchor else None
        vs = f"{r['vs_ib_write_bw']:.2f}" if anchor else "-"
        print(f"{r['backend']:>8} {r['step_s']:11.3f} {r['fsdp2_step_s']:13.3f} {r['allreduce_25mib_s']:18.3f} "
              f"{r['busbw_gbs']:11.4f} {vs:>15}")
    gloo, ours = rows
    for name, key in (("DDP", "step_s"), ("FSDP2", "fsdp2_step_s")):
        verdict = "MET" if ours[key] <= gloo[key] else "MISSED"
        print(f"# {name} step time pyrdma / gloo = {ours[key] / gloo[key]:.2f} (target <= 1.0: {verdict})")
    with open(os.path.join(args.out, "ddp.json"), "w") as f:
        json.dump(dict(rows=rows, ib_write_bw_gbs=anchor), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
