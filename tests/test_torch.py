"""The torch.distributed backend "pyrdma" (pyrdma.torch), run by torchrun itself.

Host tests use the TCP transport (no RDMA device needed); the device tests run the same checks
over RDMA (rxe0 in the Soft-RoCE VM). tests/torch_scripts/check_backend.py does the work inside
each rank: every collective against gloo's result in the same processes, async forms, and DDP
trained over both backends from the same seed; here we assert on what each rank wrote.
"""
import json
import os
import signal
import subprocess
import sys

import pytest

from mp import free_port

if os.environ.get("PYRDMA_REQUIRE_TORCH"):     # CI: a missing torch is a failure, not a skip
    import torch  # noqa: F401
else:
    pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "torch_scripts")


def _env(transport, **extra):
    env = dict(os.environ, PYRDMA_TRANSPORT=transport, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _run(cmd, env, timeout):
    """Run ``cmd`` in its own session; on timeout or failure kill the whole group (torchrun's
    workers included). Returns (returncode, output)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s:\n{out[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    return proc.returncode, out


def _torchrun(nproc, tmp_path, transport, *args, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(SCRIPTS, "check_backend.py"), str(tmp_path), *args]
    code, out = _run(cmd, _env(transport), timeout)
    assert code == 0, out[-6000:]
    reports = []
    for rank in range(nproc):
        with open(tmp_path / f"rank{rank}.json") as f:
            reports.append(json.load(f))
    return reports


def _assert_all_passed(reports, transport):
    for rep in reports:
        failed = {name: why for name, why in rep["checks"].items()
                  if why is not True and name not in ("transport", "gid indices")}
        assert not failed, f"rank {rep['rank']}: {failed}"
        assert rep["checks"]["transport"] == transport


@pytest.mark.parametrize("nproc", [2, 4])
def test_torchrun_collectives_ddp_and_a_dead_rank_over_tcp(tmp_path, nproc):
    reports = _torchrun(nproc, tmp_path, "tcp", "--dead-rank")
    _assert_all_passed(reports, "tcp")
    assert len(reports[0]["checks"]) > 30        # the collectives ran, not only DDP
    _assert_dead_rank_named(tmp_path, nproc - 1)


def _assert_dead_rank_named(tmp_path, dead):
    with open(tmp_path / "dead_rank.json") as f:
        outcome = json.load(f)
    assert outcome["error"], f"all_reduce with a dead rank returned {outcome}"
    assert f"rank {dead}" in outcome["error"], outcome["error"]
    assert outcome["seconds"] < 15 + 10, outcome


# Over RDMA in the emulated VM each torchrun spends minutes importing torch per process, which does
# not fit the CI budget next to everything else: scripts/test.sh deselects the "torch_vm" marker and
# these run on demand (python -m pyrdma.testing.vm -- python -m pytest -m torch_vm tests/test_torch.py).
@pytest.mark.device
@pytest.mark.torch_vm
def test_torchrun_collectives_ddp_and_a_dead_rank_over_rdma(tmp_path):
    # one torchrun for everything: importing torch in the emulated VM takes about a minute per process
    _assert_all_passed(_torchrun(2, tmp_path, "rdma", "--dead-rank"), "rdma")
    _assert_dead_rank_named(tmp_path, 1)


@pytest.mark.device
@pytest.mark.torch_vm
def test_torchrun_ddp_four_ranks_over_rdma(tmp_path):
    _assert_all_passed(_torchrun(4, tmp_path, "rdma", "--only", "ddp", "--steps", "2"), "rdma")


@pytest.mark.device
@pytest.mark.torch_vm
def test_ddp_with_ranks_on_two_hosts_master_addr_on_the_other(tmp_path):
    """The multi-host test bed (python -m pyrdma.testing.vm --hosts N): rank 0 on host 1, rank 1 on host 2,
    each started as torchrun starts a node's worker (env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE;
    no agent, whose own torch import would cost another minute), with its host's device and address.
    MASTER_ADDR is host 1's address, so rank 1 reaches torch's store on another host, and the pyrdma
    rendezvous goes through that store. DDP over pyrdma must match DDP over gloo, and the bytes must
    cross both hosts' wires (their veths' counters)."""
    from pyrdma.testing import hosts as testbed
    hosts = testbed.load()
    if len(hosts) < 2:
        pytest.skip("PYRDMA_TEST_HOSTS is unset: run inside python -m pyrdma.testing.vm --hosts 2")
    hosts = hosts[:2]
    port = free_port(hosts[0].address)
    before = [testbed.tx_bytes(h.netdev) for h in hosts]
    procs = []
    try:
        for rank, host in enumerate(hosts):
            env = host.full_env(_env("rdma"), MASTER_ADDR=hosts[0].address, MASTER_PORT=port, RANK=rank,
                                LOCAL_RANK=0, WORLD_SIZE=len(hosts))
            procs.append(subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "check_backend.py"), str(tmp_path),
                                           "--only", "ddp", "--steps", "2"], stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                                          start_new_session=True))
        outs = [p.communicate(timeout=CROSS_HOST_TIMEOUT)[0] for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail(f"the two ranks did not finish within {CROSS_HOST_TIMEOUT} s")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate(timeout=30)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-6000:]
    reports = []
    for rank in range(len(hosts)):
        with open(tmp_path / f"rank{rank}.json") as f:
            reports.append(json.load(f))
    _assert_all_passed(reports, "rdma")
    for rep, host in zip(reports, hosts):
        assert rep["checks"]["gid indices"] == [host.gid_index], (host, rep["checks"]["gid indices"])
    for host, b in zip(hosts, before):
        assert testbed.tx_bytes(host.netdev) - b > 64 << 10, f"{host.name}'s veth carried too little"
    print("phases (s) per rank:", [rep["phases"] for rep in reports])


CROSS_HOST_TIMEOUT = 300


def _dead_rank(transport, timeout_s):
    port = free_port()
    procs = []
    try:
        for rank in range(2):
            env = _env(transport, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
            procs.append(subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "dead_rank.py"), str(timeout_s)],
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                          cwd=ROOT, start_new_session=True))
        out, _ = procs[0].communicate(timeout=timeout_s + 240)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate(timeout=30)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, out[-4000:]
    return json.loads(lines[-1])


def test_a_killed_rank_is_an_error_within_the_timeout():
    timeout_s = 15.0
    outcome = _dead_rank("tcp", timeout_s)
    assert outcome["error"], f"all_reduce with a dead rank returned {outcome}"
    assert "rank 1" in outcome["error"], outcome["error"]
    assert outcome["seconds"] < timeout_s + 10, outcome


def test_import_pyrdma_works_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import pyrdma, pyrdma.collectives\n"
            "try:\n    import pyrdma.torch\nexcept ImportError as exc:\n    print('refused:', exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_env("tcp"),
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "refused: pyrdma.torch needs PyTorch" in out.stdout


def test_unsupported_dtype_and_op_are_named():
    import torch
    from pyrdma.torch import _host_array, _op

    with pytest.raises(ValueError, match="complex64"):
        _host_array(torch.zeros(2, dtype=torch.complex64))

    class Opts:
        reduceOp = torch.distributed.ReduceOp.BAND
    with pytest.raises(ValueError, match="all_reduce with BAND is not supported"):
        _op(Opts, "all_reduce")
