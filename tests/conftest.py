"""Shared test setup.

Markers: ``device`` (needs a real RDMA device; scripts/test.sh runs these inside the Soft-RoCE VM) and
``gpu`` (needs CUDA and CuPy). A device test skips when no RDMA device has an ACTIVE port, except when
the environment says one is required (PYRDMA_REQUIRE_DEVICE=1, as scripts/test.sh sets for the VM
run): then it fails, so a broken test bed can never pass as a row of skips. GPU tests likewise skip
without CuPy and a GPU, and fail instead under PYRDMA_REQUIRE_GPU=1 (scripts/gpu.sh, on a GPU machine).

Fixtures: ``rdma_device_name`` (first device with an ACTIVE port, from sysfs, so it works before the
binding is built) and ``gid_index`` (the GID index to use on its port 1).
"""
import glob
import os

import pytest

REQUIRE_DEVICE = os.environ.get("PYRDMA_REQUIRE_DEVICE") == "1"
REQUIRE_GPU = os.environ.get("PYRDMA_REQUIRE_GPU") == "1"
SYSFS_INFINIBAND = "/sys/class/infiniband"


def pytest_configure(config):
    # Also in pyproject.toml; repeated here so the markers exist whatever config file pytest picks.
    config.addinivalue_line("markers", "device: needs a real RDMA device (runs inside the Soft-RoCE VM in CI)")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and CuPy")
    config.addinivalue_line("markers", "torch_vm: 4-worker torchrun over RDMA (over 5 minutes in the emulated VM; not in CI)")


def active_rdma_devices(sysfs=SYSFS_INFINIBAND):
    """Devices with an ACTIVE port, from sysfs. (pyrdma.testing.vm has the same; importing it would
    import pyrdma and so need the built extension, which these fixtures must not.)"""
    names = []
    for state in sorted(glob.glob(os.path.join(sysfs, "*", "ports", "*", "state"))):
        try:
            with open(state) as f:
                active = "ACTIVE" in f.read()
        except OSError:
            continue
        name = state.split(os.sep)[-4]
        if active and name not in names:
            names.append(name)
    return names


def require_device():
    """The first device with an ACTIVE port; else fail (PYRDMA_REQUIRE_DEVICE=1) or skip, saying why."""
    names = active_rdma_devices(SYSFS_INFINIBAND)
    if names:
        return names[0]
    why = f"no RDMA device with an ACTIVE port in {SYSFS_INFINIBAND}"
    if REQUIRE_DEVICE:
        pytest.fail(f"PYRDMA_REQUIRE_DEVICE=1 but {why}", pytrace=False)
    pytest.skip(f"{why} (run device tests with: python3 -m pyrdma.testing.vm -- python3 -m pytest -m device)")


_gpu_missing = []    # why GPU tests cannot run here, once known ("" when they can)


def require_gpu():
    """Skip (or fail, under PYRDMA_REQUIRE_GPU=1) unless CuPy imports and sees a GPU."""
    if not _gpu_missing:
        try:
            import cupy
            count = cupy.cuda.runtime.getDeviceCount()
            if os.environ.get("PYRDMA_CUDA_NO_POOL") == "1":
                cupy.cuda.set_allocator(None)    # each array its own cudaMalloc: memcheck sees its bounds
            _gpu_missing.append("" if count > 0 else "CuPy sees no CUDA GPU")
        except Exception as exc:    # ImportError, or CUDARuntimeError without a driver
            _gpu_missing.append(f"needs CuPy and a CUDA GPU ({type(exc).__name__}: {exc})")
    why = _gpu_missing[0]
    if why:
        if REQUIRE_GPU:
            pytest.fail(f"PYRDMA_REQUIRE_GPU=1 but {why}", pytrace=False)
        pytest.skip(why)


def pytest_runtest_setup(item):
    # Every device (gpu) test, whether or not it asks for a fixture, needs the device (GPU).
    if item.get_closest_marker("device") is not None:
        require_device()
    if item.get_closest_marker("gpu") is not None:
        require_gpu()


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def sysfs_best_gid_index(device, port=1, sysfs=SYSFS_INFINIBAND):
    """Like Context.best_gid_index, from sysfs: InfiniBand -> 0; RoCE -> RoCEv2 first, then reachable
    (not link-local or loopback), then IPv4-mapped, then the lowest index."""
    base = os.path.join(sysfs, device, "ports", str(port))
    if _read(os.path.join(base, "link_layer")) == "InfiniBand":
        return 0
    ranked = []
    for path in glob.glob(os.path.join(base, "gids", "*")):
        index = int(os.path.basename(path))
        gid = _read(path)
        if not gid or set(gid) <= {"0", ":"}:
            continue
        v2 = _read(os.path.join(base, "gid_attrs", "types", str(index))) == "RoCE v2"
        ipv4 = gid.startswith("0000:0000:0000:0000:0000:ffff:")
        local = bool(gid.startswith("fe8") or gid == "0000:0000:0000:0000:0000:0000:0000:0001"
                 or ipv4 and (gid[30:32] == "7f" or gid[30:34] == "a9fe"))    # ::1, fe80::/10, 127/8, 169.254/16
        ranked.append((not v2, local, not ipv4, index))
    return min(ranked)[-1] if ranked else 0


@pytest.fixture(scope="session")
def rdma_device_name():
    return require_device()


@pytest.fixture(scope="session")
def gid_index(rdma_device_name):
    """The GID index to use on port 1 (rxe0 on lo: 1, the RoCEv2 IPv4-mapped 127.0.0.1)."""
    try:
        import pyrdma
    except ImportError:   # the binding is not built: sysfs tells the same story
        return sysfs_best_gid_index(rdma_device_name)
    with pyrdma.Context(rdma_device_name) as ctx:
        return ctx.best_gid_index(1)
