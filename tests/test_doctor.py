"""pyrdma.doctor and the environment advice of errors (pyrdma.advice).

Host tests: the doctor on a machine without an RDMA device, without libibverbs.so.1 (PYRDMA_LIBIBVERBS
names a file that does not exist), under a small memlock limit; the advice of raise_errno.
Device tests (the VM): the doctor finds rxe0 and its GID; an ENOMEM registration says the limit.
"""
import errno
import json
import os
import resource
import subprocess
import sys
import textwrap

import pytest

from pyrdma import advice
from pyrdma.errors import RDMAError, raise_errno

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 120


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def _doctor(*args, prefix=(), env=None, limit=None):
    """Run ``python -m pyrdma.doctor`` in a child (``limit``: its RLIMIT_MEMLOCK soft and hard)."""
    def lower():
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, limit))
    return subprocess.run([*prefix, sys.executable, "-m", "pyrdma.doctor", *args], capture_output=True, text=True,
                          timeout=TIMEOUT, env=env or _env(), cwd=ROOT, preexec_fn=lower)


def _without_ipc_lock():
    """A command prefix that runs a child without CAP_IPC_LOCK (root keeps it otherwise, and then
    the kernel ignores RLIMIT_MEMLOCK)."""
    if not advice.has_ipc_lock():
        return []
    return ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", "--"]


def _host_has_rdma():
    return bool(os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"))


# ---- host -----------------------------------------------------------------------------------------

@pytest.mark.skipif(_host_has_rdma(), reason="this host has an RDMA device; the VM test covers that case")
def test_doctor_without_device_names_problem_and_fix():
    run = _doctor()
    assert run.returncode == 1, run.stdout + run.stderr
    out = run.stdout
    assert "kernel RDMA devices: none" in out
    assert "the kernel has no RDMA device" in out
    assert "modprobe rdma_rxe && rdma link add rxe0 type rxe netdev" in out
    assert "memlock: RLIMIT_MEMLOCK" in out
    assert "TCP between ranks of this machine, large messages copied out of the sender's memory" in out
    report = json.loads(_doctor("--json").stdout)
    assert report["kernel"]["devices"] == [] and report["devices"] == []
    # (this machine allows it: the TCP transport's tests see messages go by address)
    assert report["same_machine"]["process_vm_readv"] is True, report["same_machine"]
    fixes = [p["fix"] for p in report["problems"]]
    assert any("modprobe rdma_rxe" in f for f in fixes), fixes
    assert report["libraries"]["libibverbs.so.1"]["loaded"]


def test_doctor_and_import_without_libibverbs():
    # pyrdma opens rdma-core at run time: a path that does not exist is a machine without it
    env = _env(PYRDMA_LIBIBVERBS="/nonexistent/libibverbs.so.1", PYRDMA_LIBRDMACM="/nonexistent/librdmacm.so.1")
    run = _doctor(env=env)
    assert run.returncode == 1, run.stdout + run.stderr
    out = run.stdout
    assert "libibverbs.so.1        MISSING: /nonexistent/libibverbs.so.1: cannot open shared object file" in out
    assert "apt-get install libibverbs1 ibverbs-providers (Debian/Ubuntu) or dnf install rdma-core libibverbs" in out
    assert "apt-get install librdmacm1 (Debian/Ubuntu) or dnf install librdmacm (RHEL/Fedora)" in out
    assert "GPUs: skipped: pyrdma's extension or libibverbs.so.1 is not loaded" in out
    report = json.loads(_doctor("--json", env=env).stdout)
    assert not report["libraries"]["libibverbs.so.1"]["loaded"] and report["extension"]["pyrdma._verbs.device"]["loaded"]
    # the package imports; the first use of the verbs API says what to install
    probe = subprocess.run([sys.executable, "-c", "import pyrdma\ntry:\n    pyrdma.Context()\n"
                            "except pyrdma.MissingLibraryError as exc:\n    print(exc)"],
                           capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=ROOT)
    assert probe.returncode == 0, probe.stderr
    assert "ibv_open_device: cannot load libibverbs.so.1" in probe.stdout
    assert "apt-get install libibverbs1 ibverbs-providers" in probe.stdout


def test_doctor_memlock_too_small_for_1gib():
    run = _doctor("--json", prefix=_without_ipc_lock(), limit=64 << 10)
    report = json.loads(run.stdout)
    state = report["memlock"]
    assert state["soft"] == 64 << 10 and not state["cap_ipc_lock"] and not state["fits"]
    problem = next(p for p in report["problems"] if "RLIMIT_MEMLOCK" in p["problem"])
    assert "64 KiB" in problem["problem"] and "ENOMEM" in problem["problem"]
    assert "ulimit -l unlimited" in problem["fix"] and "--ulimit memlock=-1" in problem["fix"]
    assert "LimitMEMLOCK=infinity" in problem["fix"]


def test_enomem_from_registration_says_the_memlock_limit():
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    with pytest.raises(RDMAError) as info:
        raise_errno("ibv_reg_mr", errno.ENOMEM, "1073741824 bytes at 0x7f0000000000")
    text = str(info.value)
    assert info.value.errno == errno.ENOMEM and info.value.call == "ibv_reg_mr"
    assert f"RLIMIT_MEMLOCK, which is {advice.format_limit(soft)} here" in text
    assert "ulimit -l unlimited" in text and "--ulimit memlock=-1" in text
    # other calls and errors get no memlock advice
    with pytest.raises(RDMAError) as info:
        raise_errno("ibv_create_cq", errno.ENOMEM)
    assert "RLIMIT_MEMLOCK" not in str(info.value)


def test_device_open_errors_name_the_device_file(tmp_path, monkeypatch):
    uverbs = tmp_path / "class" / "infiniband_verbs" / "uverbs3"
    uverbs.mkdir(parents=True)
    (uverbs / "ibdev").write_text("mlx5_2\n")
    monkeypatch.setattr(advice, "SYSFS", str(tmp_path))
    for err in (errno.EACCES, errno.EPERM):
        with pytest.raises(RDMAError) as info:
            raise_errno("ibv_open_device", err, "mlx5_2")
        text = str(info.value)
        assert "needs read and write access to /dev/infiniband/uverbs3" in text
        assert "docker run --device=/dev/infiniband/uverbs3" in text
    with pytest.raises(RDMAError) as info:
        raise_errno("ibv_open_device", errno.ENODEV, "mlx5_2")
    assert "/dev/infiniband/uverbs3 is missing" in str(info.value)
    assert "modprobe ib_uverbs" in str(info.value)


def test_doctor_gpu_section_with_cupy(monkeypatch):
    """With CuPy: each GPU's dma-buf and nvidia-peermem support and, beside an RDMA device, what
    gpudirect_status picks; no GPUDirect path at all is a problem with its fix. (CuPy, the driver and
    the NIC are stand-ins here; scripts/gpu.sh runs on a GPU.)"""
    import contextlib
    import types
    import pyrdma
    import pyrdma.cuda
    from pyrdma import doctor
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 2,
                                    getDeviceProperties=lambda i: {"name": f"GPU model {i}".encode()})
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime)))
    driver = types.SimpleNamespace(dmabuf_supported=lambda ordinal: ordinal == 0)
    monkeypatch.setattr(pyrdma.cuda, "cuda_driver", lambda: driver)
    monkeypatch.setattr(pyrdma.cuda, "peermem_module", lambda sysfs_root="/": None)
    report = doctor.Report()                  # no RDMA device: the GPUs' own support
    doctor.check_gpus(pyrdma, report, [])
    gpus = report.sections["gpus"]["gpus"]
    assert [(g["name"], g["gpu_dmabuf"], g["peermem"]) for g in gpus] == [("GPU model 0", True, None),
                                                                          ("GPU model 1", False, None)]
    assert report.problems == []
    statuses = {0: pyrdma.cuda.GPUDirectStatus(True, True, None, "dmabuf"),
                1: pyrdma.cuda.GPUDirectStatus(True, False, None, None)}
    monkeypatch.setattr(pyrdma.cuda, "gpudirect_status", lambda pd, ordinal: statuses[ordinal])
    fake_rd = types.SimpleNamespace(RDMAError=pyrdma.RDMAError, Context=lambda name: contextlib.nullcontext(),
                                    ProtectionDomain=lambda ctx: contextlib.nullcontext())
    report = doctor.Report()
    report.sections["default"] = {"device": "mlx5_0", "port": 1, "gid_index": 3}
    doctor.check_gpus(fake_rd, report, [])
    assert [g["method"] for g in report.sections["gpus"]["gpus"]] == ["dmabuf", None]
    (problem,) = report.problems
    assert "GPU 1 (GPU model 1) and mlx5_0: no GPUDirect RDMA" in problem["problem"]
    assert "modprobe nvidia-peermem" in problem["fix"]
    text = doctor.render(_with_defaults(report))
    assert ("GPU 0 GPU model 0: dma-buf GPU yes, NIC mlx5_0 yes; nvidia-peermem not loaded; "
            "GPUDirect RDMA via dmabuf") in text


def _with_defaults(report):
    """The sections render() needs besides the GPUs, as diagnose() fills them on a host without devices."""
    from pyrdma import doctor
    full = doctor.diagnose()
    full.sections["gpus"] = report.sections["gpus"]
    full.problems = report.problems
    return full


# ---- device (the VM) ------------------------------------------------------------------------------

@pytest.mark.device
def test_doctor_finds_rxe0_and_its_gid(rdma_device_name):
    run = _doctor("--json")
    report = json.loads(run.stdout)
    devices = {d["name"]: d for d in report["devices"]}
    assert "rxe0" in devices, report
    port = devices["rxe0"]["ports"][0]
    assert port["port"] == 1 and port["state"] == "ACTIVE" and port["link_layer"] == "Ethernet"
    gids = {g["index"]: g for g in port["gids"]}
    assert gids[1]["type"] == "RoCEv2" and gids[1]["ipv4"] == "127.0.0.1"
    assert gids[1]["gid"] == "0000:0000:0000:0000:0000:ffff:7f00:0001"
    assert port["gid_index"] == 1
    assert report["default"] == {"device": "rxe0", "port": 1, "gid_index": 1}
    assert report["memlock"]["fits"]
    text = _doctor().stdout
    print(text)      # the doctor's output in the VM, for the log
    assert "<- pyrdma uses this" in text and "device rxe0" in text


_REGISTER_LARGE = textwrap.dedent("""
    import numpy as np, pyrdma as rd
    buf = np.zeros(64 << 20, np.uint8)
    with rd.Context() as ctx, rd.ProtectionDomain(ctx) as pd:
        try:
            rd.MemoryRegion(pd, buf)
        except rd.RDMAError as exc:
            print("errno", exc.errno)
            print(exc)
        else:
            print("registered")
""")


@pytest.mark.device
def test_enomem_registration_says_memlock_limit(rdma_device_name):
    # a child without CAP_IPC_LOCK, limited to 1 MiB of locked memory, registers 64 MiB
    run = subprocess.run([*_without_ipc_lock(), sys.executable, "-c", _REGISTER_LARGE], capture_output=True,
                         text=True, timeout=TIMEOUT, env=_env(), cwd=ROOT,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, 1 << 20)))
    assert run.returncode == 0, run.stderr
    assert f"errno {errno.ENOMEM}" in run.stdout, run.stdout
    assert "ibv_reg_mr" in run.stdout and "RLIMIT_MEMLOCK, which is 1 MiB here" in run.stdout
    assert "ulimit -l unlimited" in run.stdout and "--ulimit memlock=-1" in run.stdout
