"""What people train with beyond DDP, run by check_backend.py in the same torchrun (one torch import):
FSDP2, pipelining, tensor parallel, mixture-of-experts all-to-all, batched send/recv, gather,
scatter and all_to_all. Each function takes the pyrdma group (None: the default one) and the gloo
group of the same ranks, and fills ``checks`` ("name": True, or what differed).

pyrdma's tensors and models live on ``device``; gloo's references stay on the CPU (gloo has no CUDA
reduce-scatter or all-to-all).
"""
import copy

import torch
import torch.distributed as dist

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}     # CPU against CPU (GPU against CPU: run_all loosens it)


def _close(a, b):
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} and {tuple(b.shape)}"
    return bool(torch.allclose(a, b, **TOLERANCE)) or f"max difference {(a - b).abs().max().item()}"


def _mesh(group, device_type):
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh.from_group(group or dist.distributed_c10d._get_default_group(), device_type)


# ---- FSDP2 -------------------------------------------------------------------------------------

def fsdp_model():
    torch.manual_seed(99)
    # 5 outputs: dim 0 does not split evenly over 2 or 4 ranks, so FSDP2 pads its shards
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 5))


def fsdp2_train(group, rank, steps, device):
    """fully_shard on each Linear and on the root, ``steps`` SGD steps on rank-dependent data; the
    full parameters (all-gathered by full_tensor()) flattened."""
    from torch.distributed.fsdp import fully_shard
    mesh = _mesh(group, device.type)
    net = fsdp_model().to(device)
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=gen).to(device), torch.randn(8, 5, generator=gen).to(device)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return torch.cat([p.full_tensor().detach().reshape(-1).cpu() for p in net.parameters()])


def fsdp2(group, gloo, rank, checks, device, steps=3):
    params = fsdp2_train(group, rank, steps, device)
    params_gloo = fsdp2_train(gloo, rank, steps, torch.device("cpu"))
    checks["fsdp2 matches gloo"] = _close(params, params_gloo)
    initial = torch.cat([p.detach().reshape(-1) for p in fsdp_model().parameters()])
    checks["fsdp2 trained"] = not torch.allclose(params, initial)


# ---- pipelining --------------------------------------------------------------------------------

def pipeline(group, rank, size, checks, device, microbatches=4):
    """One stage per rank (a Linear+Tanh each), ScheduleGPipe and Schedule1F1B: the last stage's
    microbatch losses equal the unsplit model's, and every stage's gradients the unsplit model's."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    torch.manual_seed(7)
    full = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(size)])
    gen = torch.Generator().manual_seed(11)
    x, y = torch.randn(2 * microbatches, 16, generator=gen), torch.randn(2 * microbatches, 16, generator=gen)
    mse = torch.nn.functional.mse_loss
    ref_losses = [mse(full(xm), ym) for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches))]
    (sum(ref_losses) / microbatches).backward()     # the schedules scale gradients by 1/microbatches
    ref_grads = [p.grad for p in full[rank].parameters()]
    for schedule in (ScheduleGPipe, Schedule1F1B):
        name = f"pipeline {schedule.__name__}"
        part = copy.deepcopy(full[rank]).to(device)
        part.zero_grad(set_to_none=True)
        stage = PipelineStage(part, stage_index=rank, num_stages=size, device=device, group=group)
        sched = schedule(stage, n_microbatches=microbatches, loss_fn=mse)
        losses = []
        if rank == 0:
            sched.step(x.to(device))
        elif rank == size - 1:
            sched.step(target=y.to(device), losses=losses)
        else:
            sched.step()
        if rank == size - 1:
            checks[f"{name} loss"] = _close(torch.stack([loss.detach() for loss in losses]),
                                            torch.stack([loss.detach() for loss in ref_losses]))
        grads = [p.grad for p in part.parameters()]
        checks[f"{name} gradients"] = all(g is not None for g in grads) and \
            _close(torch.cat([g.reshape(-1) for g in grads]), torch.cat([g.reshape(-1) for g in ref_grads]))


# ---- tensor parallel ---------------------------------------------------------------------------

def tensor_parallel(group, rank, size, checks, device):
    """parallelize_module with ColwiseParallel then RowwiseParallel: the output and the gradients
    equal the unsharded module's."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.manual_seed(3)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 8 * size), torch.nn.ReLU(), torch.nn.Linear(8 * size, 16))
    net = parallelize_module(copy.deepcopy(ref).to(device), _mesh(group, device.type),
                             {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    out, ref_out = net(x.to(device)), ref(x)
    checks["tensor parallel output"] = _close(out, ref_out)
    out.square().sum().backward()
    ref_out.square().sum().backward()
    checks["tensor parallel gradients"] = all(
        _close(p.grad.full_tensor(), q.grad) is True for p, q in zip(net.parameters(), ref.parameters()))


# ---- mixture-of-experts dispatch -----------------------------------------------------------------

def moe_splits(rank, size):
    """Rows this rank sends to each rank, and receives from each: uneven, rank-dependent, some 0."""
    send = [(2 * rank + j) % 3 for j in range(size)]
    recv = [(2 * j + rank) % 3 for j in range(size)]
    return send, recv


def moe_dispatch(group, rank, size, device):
    from torch.distributed.nn.functional import all_to_all_single
    send, recv = moe_splits(rank, size)
    x = (torch.arange(sum(send) * 6, dtype=torch.float32).reshape(-1, 6) + 100 * rank).to(device).requires_grad_()
    out = all_to_all_single(torch.empty(sum(recv), 6, device=device), x, recv, send, group=group)
    weights = torch.arange(out.numel(), dtype=torch.float32, device=device).reshape(out.shape) + 1
    (out * weights).sum().backward()
    return out.detach().cpu(), x.grad.cpu()


def moe(group, gloo, rank, size, checks, device):
    out, grad = moe_dispatch(group, rank, size, device)
    out_gloo, grad_gloo = moe_dispatch(gloo, rank, size, torch.device("cpu"))
    checks["moe all_to_all_single forward"] = _close(out, out_gloo)
    checks["moe all_to_all_single backward"] = _close(grad, grad_gloo)
    checks["moe splits have zeros"] = 0 in moe_splits(rank, size)[0] + moe_splits(rank, size)[1]


# ---- point to point, rooted, all_to_all lists -----------------------------------------------------

def ring_values(rank, n):
    return torch.arange(n, dtype=torch.float32) * (rank + 1)


def point_to_point(group, rank, size, checks, device):
    right, left = (rank + 1) % size, (rank - 1) % size
    for n in (5, 100_000):         # small, and larger than one message
        got = torch.zeros(n, device=device)
        ops = [dist.P2POp(dist.isend, ring_values(rank, n).to(device), right, group),
               dist.P2POp(dist.irecv, got, left, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        checks[f"batch_isend_irecv ring {n}"] = _close(got, ring_values(left, n))
    # every rank posts its receive first, then its send (2.4 MB: straight from the tensor). Issued one
    # by one the Communicator would run each rank's receive first and wait for ever; they go as one batch.
    n = 600_000
    got = torch.zeros(n, device=device)
    works = [dist.irecv(got, left, group=group), dist.isend(ring_values(rank, n).to(device), right, group=group)]
    for work in works:
        work.wait()
    checks["irecv then isend ring 600000"] = _close(got, ring_values(left, n))
    # blocking send/recv in both orders, two tags in flight
    if rank in (0, 1) and size > 1:
        peer = 1 - rank
        a, b = torch.zeros(7, device=device), torch.zeros(3, device=device)
        if rank == 0:
            dist.send(ring_values(0, 7).to(device), peer, group=group, tag=1)
            dist.send(ring_values(10, 3).to(device), peer, group=group, tag=2)
            dist.recv(a, peer, group=group)
            checks["send/recv"] = _close(a, ring_values(1, 7))
        else:
            dist.recv(a, peer, group=group, tag=1)
            dist.recv(b, peer, group=group, tag=2)
            dist.send(ring_values(1, 7).to(device), peer, group=group)
            checks["send/recv"] = _close(a, ring_values(0, 7)) is True and _close(b, ring_values(10, 3))
        # a message shorter than the tensor: wait() raises, naming both sizes
        if rank == 0:
            dist.send(ring_values(0, 3).to(device), peer, group=group)
        else:
            try:
                dist.recv(torch.zeros(7, device=device), peer, group=group)
                checks["short message refused"] = "a 3-element message filled a 7-element tensor"
            except Exception as exc:     # noqa: BLE001 -- the message is what is checked
                checks["short message refused"] = "got 3 elements for a tensor of 7" in str(exc) or str(exc)
    try:
        dist.recv(torch.zeros(1, device=device), group=group)          # no src: recv_anysource
        checks["recv_anysource refused"] = "recv without src was accepted"
    except Exception as exc:     # noqa: BLE001 -- the message is what is checked
        checks["recv_anysource refused"] = "recv_anysource" in str(exc) or str(exc)


def rooted_and_all_to_all(group, rank, size, checks, device):
    root = size - 1
    mine = ring_values(rank, 9)
    gathered = [torch.zeros(9, device=device) for _ in range(size)] if rank == root else None
    dist.gather(mine.to(device), gathered, dst=root, group=group)
    if rank == root:
        checks["gather"] = _close(torch.stack(gathered), torch.stack([ring_values(r, 9) for r in range(size)]))
    got = torch.zeros(9, device=device)
    pieces = [ring_values(10 + r, 9).to(device) for r in range(size)] if rank == 0 else None
    dist.scatter(got, pieces, src=0, group=group)
    checks["scatter"] = _close(got, ring_values(10 + rank, 9))
    # all_to_all lists: rank r sends r + j + 1 elements to rank j
    ins = [torch.full((rank + j + 1,), float(100 * rank + j), device=device) for j in range(size)]
    outs = [torch.zeros(j + rank + 1, device=device) for j in range(size)]
    dist.all_to_all(outs, ins, group=group)
    checks["all_to_all lists"] = all(_close(o, torch.full((j + rank + 1,), float(100 * j + rank))) is True
                                     for j, o in enumerate(outs))
    # all_to_all lists of equal pieces (the Communicator's equal form)
    ins = [torch.full((3,), float(100 * rank + j), device=device) for j in range(size)]
    outs = [torch.zeros(3, device=device) for _ in range(size)]
    dist.all_to_all(outs, ins, group=group)
    checks["all_to_all equal lists"] = all(_close(o, torch.full((3,), float(100 * j + rank))) is True
                                           for j, o in enumerate(outs))
    # all_to_all_single, equal pieces
    out = torch.zeros(size * 4, device=device)
    dist.all_to_all_single(out, (torch.arange(size * 4, dtype=torch.float32) + 1000 * rank).to(device), group=group)
    checks["all_to_all_single equal"] = _close(
        out, torch.cat([torch.arange(rank * 4, rank * 4 + 4, dtype=torch.float32) + 1000 * j for j in range(size)]))
    # async: both in flight, then waited on. (On torch 2.14 the Work a Python backend returns is
    # wrapped, and the wrapper's is_completed() stays False: its get_future() is what completes.)
    swapped = torch.zeros(size * 2, device=device)
    works = [dist.all_to_all_single(swapped, torch.full((size * 2,), float(rank), device=device), group=group,
                                    async_op=True),
             dist.gather(ring_values(rank + 5, 9).to(device), gathered, dst=root, group=group, async_op=True)]
    for w in works:
        w.wait()
    checks["async all_to_all_single and gather"] = all(w.get_future().done() for w in works) and \
        _close(swapped, torch.arange(size, dtype=torch.float32).repeat_interleave(2)) is True and \
        (rank != root or _close(torch.stack(gathered), torch.stack([ring_values(r + 5, 9) for r in range(size)])))


def coalesced(group, rank, size, checks, device):
    """The coalesced forms: through _coalescing_manager (start/end_coalescing, FSDP1's and
    batch_isend_irecv's path), the functional collectives (DTensor's), and all_gather_coalesced."""
    import torch.distributed._functional_collectives as funcol
    pieces = [ring_values(rank, 3), ring_values(rank + 1, 5)]
    expected = [torch.cat([ring_values(r, 3) for r in range(size)]), torch.cat([ring_values(r + 1, 5)
                                                                                 for r in range(size)])]
    outs = [torch.zeros(size * 3, device=device), torch.zeros(size * 5, device=device)]
    with dist._coalescing_manager(group=group, device=device, async_ops=True) as cm:
        for out, piece in zip(outs, pieces):
            dist.all_gather_into_tensor(out, piece.to(device), group=group)
    cm.wait()
    checks["coalescing manager all_gather_into_tensor"] = all(_close(o, e) is True for o, e in zip(outs, expected))
    reduced = [torch.zeros(2, device=device), torch.zeros(4, device=device)]
    with dist._coalescing_manager(group=group, device=device):
        for out in reduced:
            dist.reduce_scatter_tensor(out, torch.arange(size * out.numel(), dtype=torch.float32, device=device),
                                       group=group)
    checks["coalescing manager reduce_scatter_tensor"] = all(
        _close(o, size * torch.arange(rank * o.numel(), (rank + 1) * o.numel(), dtype=torch.float32)) is True
        for o in reduced)
    pg = group or dist.distributed_c10d._get_default_group()
    got = funcol.all_gather_into_tensor_coalesced([p.to(device) for p in pieces], pg)
    checks["functional all_gather_into_tensor_coalesced"] = all(_close(o, e) is True for o, e in zip(got, expected))
    got = funcol.reduce_scatter_tensor_coalesced(
        [torch.arange(size * 2, dtype=torch.float32, device=device)] * 2, "sum", [0, 0], pg)
    checks["functional reduce_scatter_tensor_coalesced"] = all(
        _close(o, size * torch.arange(rank * 2, rank * 2 + 2, dtype=torch.float32)) is True for o in got)
    lists = [[torch.zeros(3, device=device) for _ in range(size)], [torch.zeros(5, device=device) for _ in range(size)]]
    dist.all_gather_coalesced(lists, [p.to(device) for p in pieces], group=group)
    checks["all_gather_coalesced"] = all(_close(torch.cat(lst), e) is True for lst, e in zip(lists, expected))


def run_all(group, gloo, rank, size, checks, device, phase):
    """Every workload above; one that raises is recorded as its failed check (and the run goes on:
    the other checks still say what works). ``phase(name)`` records how long each took."""
    if device.type != "cpu":     # the GPU's matrix products sum in another order than the CPU's
        TOLERANCE.update(rtol=1e-4, atol=1e-5)
    workloads = [("fsdp2", lambda: fsdp2(group, gloo, rank, checks, device)),
                 ("pipelining", lambda: pipeline(group, rank, size, checks, device)),
                 ("tensor parallel", lambda: tensor_parallel(group, rank, size, checks, device)),
                 ("moe", lambda: moe(group, gloo, rank, size, checks, device)),
                 ("point to point", lambda: point_to_point(group, rank, size, checks, device)),
                 ("rooted and all_to_all", lambda: rooted_and_all_to_all(group, rank, size, checks, device)),
                 ("coalesced", lambda: coalesced(group, rank, size, checks, device))]
    for name, run in workloads:
        try:
            run()
        except Exception as exc:     # noqa: BLE001 -- recorded as the failed check
            checks[f"{name} raised"] = f"{type(exc).__name__}: {exc}"
            print(f"workloads rank {rank}: {name} raised {checks[f'{name} raised']}", flush=True)
        phase(name)


def fsdp2_dead_rank_step(group, rank, size, device):
    """An FSDP2 model on ``group``: one step with every rank, then the last rank exits without a word;
    returns a function that runs the next step (where the others must fail naming it)."""
    from torch.distributed.fsdp import fully_shard
    mesh = _mesh(group, device.type)
    net = fsdp_model().to(device)
    fully_shard(net[0], mesh=mesh)
    fully_shard(net, mesh=mesh)
    x = torch.randn(4, 16, device=device)

    def step():
        net(x).sum().backward()
    step()
    return step
