"""pyrdma.cuda: GPU array parsing, GPUDirect registration choices, reductions, host staging.

Most of it runs on any CPU host: the CUDA pieces are replaced by fakes that still exercise the real
logic (a compiled fake libcuda for the ctypes calls, a fake driver and MemoryRegion for the
dma-buf/peermem choice, a simulated stream/event backend that runs copies in adversarial orders for
the staging pipeline). Tests marked ``gpu`` need CuPy and a GPU and skip, saying so, without them;
the ``device`` tests need an RDMA device (rxe0 in the Soft-RoCE VM) but no GPU.
"""
import collections
import contextlib
import ctypes
import errno
import os
import shutil
import subprocess
import sys
import time
import weakref

import numpy as np
import pytest

import pyrdma as rd
import pyrdma.cuda as gpu
from pyrdma.cuda import _driver, buffers, reduce as gpu_reduce, registration

PAGE = os.sysconf("SC_PAGESIZE")


# --------------------------------------------------------------------------------------------------
# Fake CUDA arrays: the protocols over host memory, so the pointer arithmetic is real
# --------------------------------------------------------------------------------------------------

class FakeCudaArray:
    """Exports __cuda_array_interface__ (v3) for a numpy array, as a CUDA library would."""

    def __init__(self, host, readonly=False, strides=None, mask=None, extra=None):
        self.host = host
        self._cai = {"shape": host.shape, "typestr": host.dtype.str, "data": (host.ctypes.data, readonly),
                     "version": 3, "strides": strides, "stream": 1}
        if mask is not None:
            self._cai["mask"] = mask
        self._cai.update(extra or {})

    @property
    def __cuda_array_interface__(self):
        return self._cai


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class FakeDLPackCuda:
    """A DLPack producer claiming kDLCUDA memory, with a hand-built DLManagedTensor."""

    def __init__(self, ptr, shape, code=2, bits=32, byte_offset=0, strides=None, device=(2, 3), lanes=1):
        self.ptr = ptr
        self.device = device
        self.shape_arr = (ctypes.c_int64 * len(shape))(*shape)
        self.strides_arr = (ctypes.c_int64 * len(shape))(*strides) if strides else None
        self.managed = buffers._DLManagedTensor()
        t = self.managed.dl_tensor
        t.data = ptr
        t.device.device_type, t.device.device_id = device
        t.ndim = len(shape)
        t.dtype.code, t.dtype.bits, t.dtype.lanes = code, bits, lanes
        t.shape = ctypes.cast(self.shape_arr, ctypes.POINTER(ctypes.c_int64))
        if self.strides_arr is not None:
            t.strides = ctypes.cast(self.strides_arr, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = byte_offset
        self.name = b"dltensor"       # the capsule keeps a pointer to the name: keep it alive

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None):
        return _PyCapsule_New(ctypes.addressof(self.managed), self.name, None)


# --------------------------------------------------------------------------------------------------
# Optional CuPy: the package imports without it, functions say what is missing
# --------------------------------------------------------------------------------------------------

def test_import_without_cupy_and_clear_errors():
    code = (
        "import sys\n"
        "sys.modules['cupy'] = None\n"           # makes `import cupy` fail even where CuPy is installed
        "import pyrdma, pyrdma.cuda as g, numpy as np\n"
        "assert not g.cupy_available()\n"
        "for fn, args in ((g.reduce_into, (1, 2)), (g.finalize_avg, (1, 2))):\n"
        "    try:\n"
        "        fn(*args)\n"
        "    except pyrdma.RDMAError as e:\n"
        "        assert e.call == 'import cupy' and 'CuPy' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError('no error')\n"
        "try:\n"
        "    g.HostStagingPipeline().backend\n"
        "except pyrdma.RDMAError as e:\n"
        "    assert 'CuPy' in str(e)\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_staging_backend_is_cupy_else_torch_and_says_what_is_missing(monkeypatch):
    from pyrdma.cuda import staging
    monkeypatch.setenv("PYRDMA_STAGING", "numba")
    with pytest.raises(rd.UsageError, match="PYRDMA_STAGING='numba'; use one of cupy, torch"):
        staging.staging_backend()
    if gpu.cupy_available():
        pytest.skip("CuPy is installed: the fallbacks below are for machines without it")
    monkeypatch.setenv("PYRDMA_STAGING", "cupy")
    with pytest.raises(rd.RDMAError, match="needs CuPy"):
        staging.staging_backend()
    monkeypatch.delenv("PYRDMA_STAGING")
    try:
        import torch
        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if cuda:
        assert type(staging.staging_backend()).__name__ == "TorchStagingBackend"
    else:
        with pytest.raises(rd.RDMAError, match="needs CuPy .* or PyTorch with CUDA"):
            staging.staging_backend()


def test_staging_chunk_size_from_the_environment(monkeypatch):
    from pyrdma.cuda import staging
    monkeypatch.setattr(staging, "_default_pipeline", None)
    monkeypatch.setenv("PYRDMA_STAGING_CHUNK", "0x10000")
    assert gpu.default_pipeline().chunk_bytes == 1 << 16
    monkeypatch.setattr(staging, "_default_pipeline", None)
    monkeypatch.setenv("PYRDMA_STAGING_CHUNK", "4MiB")
    with pytest.raises(rd.UsageError, match="PYRDMA_STAGING_CHUNK='4MiB' is not a positive number of bytes"):
        gpu.default_pipeline()
    monkeypatch.delenv("PYRDMA_STAGING_CHUNK")
    assert gpu.default_pipeline().chunk_bytes == gpu.DEFAULT_CHUNK_BYTES


def test_import_pyrdma_does_not_import_cupy():
    out = subprocess.run([sys.executable, "-c", "import sys, pyrdma, pyrdma.cuda; print('cupy' in sys.modules)"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_missing_libcuda_is_an_rdma_error():
    with pytest.raises(rd.RDMAError, match="cannot load the CUDA driver library") as info:
        _driver.CudaDriver("libcuda-that-does-not-exist.so.1")
    assert info.value.call == "dlopen"


# --------------------------------------------------------------------------------------------------
# __cuda_array_interface__ and DLPack parsing
# --------------------------------------------------------------------------------------------------

def test_cuda_array_interface_parsing():
    host = np.zeros((4, 6), np.float32)
    buf = gpu.device_buffer(FakeCudaArray(host))
    assert (buf.ptr, buf.nbytes, buf.shape, buf.dtype, buf.itemsize) == (host.ctypes.data, 96, (4, 6),
                                                                         np.float32, 4)
    assert buf.device_type == "cuda" and buf.device_id is None and not buf.readonly
    assert buf.interface == "cuda_array_interface"
    assert gpu.device_buffer(FakeCudaArray(host, readonly=True)).readonly
    # explicit C strides are contiguous; a size-1 dimension may carry any stride
    assert gpu.device_buffer(FakeCudaArray(host, strides=(24, 4))).nbytes == 96
    assert gpu.device_buffer(FakeCudaArray(np.zeros((4, 1), np.int64), strides=(8, 999))).nbytes == 32
    with pytest.raises(rd.UsageError, match="not C-contiguous"):
        gpu.device_buffer(FakeCudaArray(host, strides=(4, 16)))       # Fortran order
    with pytest.raises(rd.UsageError, match="masked"):
        gpu.device_buffer(FakeCudaArray(host, mask=object()))
    with pytest.raises(rd.UsageError, match="empty"):
        gpu.device_buffer(FakeCudaArray(np.zeros((0, 3), np.float32)))
    with pytest.raises(rd.UsageError, match="neither"):
        gpu.device_buffer(object())


def test_is_c_contiguous():
    assert buffers.is_c_contiguous((2, 3), None, 4)
    assert buffers.is_c_contiguous((2, 3), (12, 4), 4)
    assert not buffers.is_c_contiguous((2, 3), (4, 8), 4)
    assert buffers.is_c_contiguous((0, 3), (4, 8), 4)
    assert not buffers.is_c_contiguous((2, 3), (12,), 4)


def test_dlpack_parsing_of_host_arrays():
    a = np.arange(24, dtype=np.int16).reshape(4, 6)
    for capsule in (a.__dlpack__(), a.__dlpack__(max_version=(1, 0))):
        buf = buffers.parse_dlpack_capsule(capsule)
        assert (buf.ptr, buf.nbytes, buf.shape, buf.dtype, buf.device_type) == (a.ctypes.data, 48, (4, 6),
                                                                                np.int16, "cpu")
    ro = a.copy()
    ro.flags.writeable = False
    assert buffers.parse_dlpack_capsule(ro.__dlpack__(max_version=(1, 0))).readonly
    with pytest.raises(rd.UsageError, match="not C-contiguous"):
        buffers.parse_dlpack_capsule(a[:, ::2].__dlpack__())
    # a view with an offset start is still described by its own first byte
    assert buffers.parse_dlpack_capsule(a[1:].__dlpack__()).ptr == a.ctypes.data + 12
    with pytest.raises(rd.UsageError, match="cpu memory, not on a CUDA GPU"):
        gpu.device_buffer(a)
    assert not gpu.is_cuda_array(a)


def test_dlpack_parsing_of_cuda_tensors():
    t = FakeDLPackCuda(0x7f0000001000, (8, 16), byte_offset=256)
    assert gpu.is_cuda_array(t)
    buf = gpu.device_buffer(t)
    assert buf.ptr == 0x7f0000001100 and buf.nbytes == 512 and buf.dtype == np.float32
    assert (buf.device_type, buf.device_id, buf.interface) == ("cuda", 3, "dlpack")
    bf16 = gpu.device_buffer(FakeDLPackCuda(0x7f0000000000, (10,), code=4, bits=16))
    assert bf16.dtype is None and bf16.dtype_name == "bfloat16" and bf16.nbytes == 20
    managed = gpu.device_buffer(FakeDLPackCuda(0x7f0000000000, (4,), device=(13, 0)))
    assert managed.device_type == "cuda_managed"
    # element strides (DLPack) of a transposed tensor
    with pytest.raises(rd.UsageError, match="not C-contiguous"):
        gpu.device_buffer(FakeDLPackCuda(0x7f0000000000, (4, 8), strides=(1, 4)))
    assert gpu.device_buffer(FakeDLPackCuda(0x7f0000000000, (4, 8), strides=(8, 1))).nbytes == 128
    # the device is checked before a capsule is asked for
    pinned = FakeDLPackCuda(0x7f0000000000, (4,), device=(3, 0))
    assert not gpu.is_cuda_array(pinned)
    with pytest.raises(rd.UsageError, match="cuda_host memory"):
        gpu.device_buffer(pinned)


# --------------------------------------------------------------------------------------------------
# GPUDirect registration: the page-aligned dma-buf range, peermem detection, the choice of path
# --------------------------------------------------------------------------------------------------

def test_dmabuf_range_is_the_smallest_page_aligned_cover():
    rng = np.random.default_rng(7)
    cases = [(0x10000, 1), (0x10000, PAGE), (0x10001, PAGE), (0x10fff, 2), (0x7f00_0000_0000 + 5, 3 * PAGE)]
    cases += [(int(p), int(n)) for p, n in zip(rng.integers(1 << 20, 1 << 40, 200), rng.integers(1, 1 << 22, 200))]
    for ptr, nbytes in cases:
        start, length = gpu.dmabuf_range(ptr, nbytes)
        assert start % PAGE == 0 and length % PAGE == 0
        assert start <= ptr < start + PAGE
        assert ptr + nbytes <= start + length < ptr + nbytes + PAGE
    assert gpu.dmabuf_range(0x20000 + 100, 200, page_size=65536) == (0x20000, 65536)
    assert gpu.dmabuf_range(0x2ff00, 0x200, page_size=0x10000) == (0x20000, 0x20000)
    with pytest.raises(rd.UsageError):
        gpu.dmabuf_range(0x1000, 0)
    with pytest.raises(rd.UsageError):
        gpu.dmabuf_range(0x1000, 10, page_size=3000)


def test_peermem_detection(tmp_path):
    assert gpu.peermem_module(str(tmp_path)) is None
    (tmp_path / "sys/module/nv_peer_mem").mkdir(parents=True)
    assert gpu.peermem_module(str(tmp_path)).endswith("sys/module/nv_peer_mem")
    (tmp_path / "sys/module/nvidia_peermem").mkdir(parents=True)
    assert gpu.peermem_module(str(tmp_path)).endswith("sys/module/nvidia_peermem")


class FakeContext:
    def __init__(self, name="mlx5_0"):
        self.name = name


class FakePD:
    def __init__(self, context):
        self.context = context


class FakeDriver:
    """The three CudaDriver methods the registration uses, over a pretend device memory map."""

    def __init__(self, gpu_dmabuf=True, export_error=None, ranges=None):
        self.gpu_dmabuf = gpu_dmabuf
        self.export_error = export_error
        # (start, end) -> PointerInfo
        self.ranges = ranges or {}
        self.exports = []
        self.fds = []

    def pointer_info(self, ptr):
        for (lo, hi), info in self.ranges.items():
            if lo <= ptr < hi:
                return info
        return _driver.PointerInfo(None, False, -1, None)

    def dmabuf_supported(self, ordinal):
        return self.gpu_dmabuf

    def export_dmabuf(self, start, length, context=None, device_ordinal=None):
        self.exports.append((start, length, context, device_ordinal))
        if self.export_error:
            raise rd.RDMAError(self.export_error, call="cuMemGetHandleForAddressRange")
        fd = os.open(os.devnull, os.O_RDONLY)
        self.fds.append(fd)
        return fd


class FakeMR:
    def __init__(self, kind, addr, length, owner):
        self.kind, self.addr, self.length, self.owner = kind, addr, length, owner


class FakeMemoryRegion:
    """Stands in for MemoryRegion's two device-memory constructors and records their arguments."""
    calls = []
    dmabuf_error = None
    pointer_error = None

    @classmethod
    def reset(cls, dmabuf_error=None, pointer_error=None):
        cls.calls = []
        cls.dmabuf_error, cls.pointer_error = dmabuf_error, pointer_error

    @staticmethod
    def from_dmabuf(pd, fd, offset, length, iova, access=rd.ACCESS_LOCAL_WRITE, owner=None):
        os.fstat(fd)      # the fd must still be open while registering
        FakeMemoryRegion.calls.append(("dmabuf", fd, offset, length, iova, access))
        if FakeMemoryRegion.dmabuf_error:
            raise rd.RDMAError("Operation not supported", errno=FakeMemoryRegion.dmabuf_error,
                               call="ibv_reg_dmabuf_mr")
        return FakeMR("dmabuf", iova, length, owner)

    @staticmethod
    def from_pointer(pd, addr, length, access=rd.ACCESS_LOCAL_WRITE, owner=None):
        FakeMemoryRegion.calls.append(("pointer", addr, length, access))
        if FakeMemoryRegion.pointer_error:
            raise rd.RDMAError("Bad address", errno=FakeMemoryRegion.pointer_error, call="ibv_reg_mr")
        return FakeMR("pointer", addr, length, owner)


DEV_LO, DEV_HI = 0x7f00_0000_0000, 0x7f00_4000_0000
MANAGED_LO, MANAGED_HI = 0x7e00_0000_0000, 0x7e00_4000_0000
DEVICE_INFO = _driver.PointerInfo(_driver.CU_MEMORYTYPE_DEVICE, False, 1, 0xC0FFEE)
RANGES = {(DEV_LO, DEV_HI): DEVICE_INFO,
          (MANAGED_LO, MANAGED_HI): _driver.PointerInfo(_driver.CU_MEMORYTYPE_DEVICE, True, 0, 0xC0FFEE),
          (0x5000_0000, 0x6000_0000): _driver.PointerInfo(_driver.CU_MEMORYTYPE_HOST, False, 0, 0xC0FFEE)}


@pytest.fixture
def fake_gpudirect(monkeypatch, tmp_path):
    """Fake driver, MemoryRegion and NIC probe wired into pyrdma.cuda.registration."""
    state = {"nic_dmabuf": True, "probes": 0, "driver": FakeDriver(ranges=RANGES)}

    def probe(pd):
        state["probes"] += 1
        return state["nic_dmabuf"]

    FakeMemoryRegion.reset()
    monkeypatch.setattr(registration, "MemoryRegion", FakeMemoryRegion)
    monkeypatch.setattr(registration, "probe_dmabuf", probe)
    monkeypatch.setattr(registration, "cuda_driver", lambda: state["driver"])
    state["sysfs"] = str(tmp_path)
    state["pd"] = FakePD(FakeContext())
    yield state
    for fd in getattr(state["driver"], "fds", []):
        with pytest.raises(OSError) as info:
            os.fstat(fd)                      # every exported fd was closed
        assert info.value.errno == errno.EBADF


def _gpu_array(ptr, nbytes):
    """A DLPack CUDA uint8 array at a chosen device address."""
    return FakeDLPackCuda(ptr, (nbytes,), code=1, bits=8)


def test_nic_dmabuf_probe_is_once_per_context(fake_gpudirect):
    ctx_a, ctx_b = FakeContext("a"), FakeContext("b")
    assert gpu.nic_supports_dmabuf(FakePD(ctx_a)) is True
    assert gpu.nic_supports_dmabuf(FakePD(ctx_a)) is True
    assert fake_gpudirect["probes"] == 1
    fake_gpudirect["nic_dmabuf"] = False
    assert gpu.nic_supports_dmabuf(FakePD(ctx_b)) is False
    assert fake_gpudirect["probes"] == 2
    ref = weakref.ref(ctx_a)
    del ctx_a
    assert ref() is None                    # the cache does not keep a Context alive


def test_register_prefers_dmabuf_over_the_page_aligned_range(fake_gpudirect):
    ptr, nbytes = DEV_LO + 3 * PAGE + 100, 2 * PAGE + 50
    arr = _gpu_array(ptr, nbytes)
    access = rd.ACCESS_LOCAL_WRITE | rd.ACCESS_REMOTE_WRITE
    mr = gpu.register_gpu_array(fake_gpudirect["pd"], arr, access, sysfs_root=fake_gpudirect["sysfs"])
    start, length = DEV_LO + 3 * PAGE, 3 * PAGE
    assert fake_gpudirect["driver"].exports == [(start, length, 0xC0FFEE, 1)]
    kind, fd, offset, reg_len, iova, reg_access = FakeMemoryRegion.calls[0]
    assert (kind, offset, reg_len, iova, reg_access) == ("dmabuf", 0, length, start, access)
    assert fd == fake_gpudirect["driver"].fds[0]
    assert mr.owner is arr
    assert gpu.gpu_array_offset(mr, arr) == 100
    assert len(FakeMemoryRegion.calls) == 1


def test_register_falls_back_to_peermem_when_dmabuf_registration_fails(fake_gpudirect, tmp_path):
    (tmp_path / "sys/module/nvidia_peermem").mkdir(parents=True)
    FakeMemoryRegion.reset(dmabuf_error=errno.EOPNOTSUPP)
    arr = _gpu_array(DEV_LO + 64, 1000)
    mr = gpu.register_gpu_array(fake_gpudirect["pd"], arr, sysfs_root=str(tmp_path))
    assert [c[0] for c in FakeMemoryRegion.calls] == ["dmabuf", "pointer"]
    assert FakeMemoryRegion.calls[1][1:3] == (DEV_LO + 64, 1000)
    assert mr.owner is arr and gpu.gpu_array_offset(mr, arr) == 0


@pytest.mark.parametrize("nic, gpu_ok, export_error", [(False, True, None), (True, False, None),
                                                        (True, True, "CUDA_ERROR_NOT_SUPPORTED")])
def test_register_uses_peermem_when_dmabuf_is_unavailable(fake_gpudirect, tmp_path, nic, gpu_ok, export_error):
    (tmp_path / "sys/kernel/mm/memory_peers/nv_mem").mkdir(parents=True)
    (tmp_path / "sys/kernel/mm/memory_peers/nv_mem/version").write_text("1.0\n")
    fake_gpudirect["nic_dmabuf"] = nic
    fake_gpudirect["driver"] = FakeDriver(gpu_dmabuf=gpu_ok, export_error=export_error, ranges=RANGES)
    mr = gpu.register_gpu_array(fake_gpudirect["pd"], _gpu_array(DEV_LO, 4096), sysfs_root=str(tmp_path))
    assert mr.kind == "pointer"
    assert [c[0] for c in FakeMemoryRegion.calls] == ["pointer"]


def test_register_without_dmabuf_or_peermem_says_why(fake_gpudirect):
    fake_gpudirect["nic_dmabuf"] = False
    with pytest.raises(rd.RDMAError) as info:
        gpu.register_gpu_array(fake_gpudirect["pd"], _gpu_array(DEV_LO, 4096), sysfs_root=fake_gpudirect["sysfs"])
    text = str(info.value)
    assert "mlx5_0 does not support dma-buf" in text and "nvidia-peermem module is not loaded" in text
    assert "HostStagingPipeline" in text and info.value.call == "register_gpu_array"
    assert not isinstance(info.value, rd.UsageError)
    assert FakeMemoryRegion.calls == []

    fake_gpudirect["nic_dmabuf"] = True
    fake_gpudirect["driver"] = FakeDriver(gpu_dmabuf=False, ranges=RANGES)
    # a new context, or the cached probe answer from above would be reused
    with pytest.raises(rd.RDMAError, match="GPU 1 cannot export dma-buf"):
        gpu.register_gpu_array(FakePD(FakeContext()), _gpu_array(DEV_LO, 4096), sysfs_root=fake_gpudirect["sysfs"])


def test_register_forced_methods(fake_gpudirect, tmp_path):
    (tmp_path / "sys/module/nvidia_peermem").mkdir(parents=True)
    FakeMemoryRegion.reset(dmabuf_error=errno.EINVAL)
    with pytest.raises(rd.RDMAError, match="dma-buf registration failed") as info:
        gpu.register_gpu_array(fake_gpudirect["pd"], _gpu_array(DEV_LO, 64), method="dmabuf",
                               sysfs_root=str(tmp_path))
    assert info.value.errno == errno.EINVAL
    assert [c[0] for c in FakeMemoryRegion.calls] == ["dmabuf"]       # no peermem attempt
    FakeMemoryRegion.reset(pointer_error=errno.EFAULT)
    with pytest.raises(rd.RDMAError, match="not loaded.*ibv_reg_mr of the device pointer failed") as info:
        gpu.register_gpu_array(fake_gpudirect["pd"], _gpu_array(DEV_LO, 64), method="peermem",
                               sysfs_root=str(tmp_path / "empty"))
    assert info.value.errno == errno.EFAULT
    assert [c[0] for c in FakeMemoryRegion.calls] == ["pointer"]      # forced: tried even without the module
    with pytest.raises(rd.UsageError, match="method must be"):
        gpu.register_gpu_array(fake_gpudirect["pd"], _gpu_array(DEV_LO, 64), method="gdrcopy")


def test_register_rejects_memory_gpudirect_cannot_take(fake_gpudirect):
    pd = fake_gpudirect["pd"]
    with pytest.raises(rd.UsageError, match="managed memory"):
        gpu.register_gpu_array(pd, _gpu_array(MANAGED_LO, 64))
    with pytest.raises(rd.UsageError, match="host memory, not device memory"):
        gpu.register_gpu_array(pd, _gpu_array(0x5000_1000, 64))
    with pytest.raises(rd.UsageError, match="not memory the CUDA driver knows"):
        gpu.register_gpu_array(pd, _gpu_array(0x1000, 64))
    ro = FakeCudaArray(np.zeros(16, np.uint8), readonly=True)
    with pytest.raises(rd.UsageError, match="read-only"):
        gpu.register_gpu_array(pd, ro, rd.ACCESS_LOCAL_WRITE)
    with pytest.raises(rd.UsageError, match="cpu memory"):
        gpu.register_gpu_array(pd, np.zeros(16))
    assert FakeMemoryRegion.calls == []


def test_gpudirect_status(fake_gpudirect, tmp_path):
    st = gpu.gpudirect_status(fake_gpudirect["pd"], 1, sysfs_root=str(tmp_path))
    assert st == gpu.GPUDirectStatus(True, True, None, "dmabuf")
    fake_gpudirect["driver"] = FakeDriver(gpu_dmabuf=False)
    (tmp_path / "sys/module/nvidia_peermem").mkdir(parents=True)
    st = gpu.gpudirect_status(fake_gpudirect["pd"], 1, sysfs_root=str(tmp_path))
    assert st.method == "peermem" and st.peermem.endswith("nvidia_peermem")


# --------------------------------------------------------------------------------------------------
# The ctypes layer against a compiled fake libcuda (argument types, context push/pop, error names)
# --------------------------------------------------------------------------------------------------

FAKE_LIBCUDA = r"""
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#define DEV 0x7f0000000000ULL
#define MANAGED 0x7e0000000000ULL
#define SIZE 0x40000000ULL
static int inited, depth;
static void *current;
uint64_t last_start; size_t last_size; unsigned long long last_flags;
int fake_depth(void) { return depth; }
int cuInit(unsigned int flags) { inited = (flags == 0); return flags ? 1 : 0; }
int cuGetErrorName(int e, const char **s) {
    *s = e == 801 ? "CUDA_ERROR_NOT_SUPPORTED" : e == 201 ? "CUDA_ERROR_INVALID_CONTEXT" : "CUDA_ERROR_INVALID_VALUE";
    return 0;
}
int cuGetErrorString(int e, const char **s) { *s = e == 801 ? "operation not supported" : "invalid"; return 0; }
int cuPointerGetAttribute(void *data, int attr, uint64_t p) {
    int dev = p >= DEV && p < DEV + SIZE, man = p >= MANAGED && p < MANAGED + SIZE;
    if (!inited) return 3;
    if (!dev && !man) return 1;
    switch (attr) {
    case 1: *(void **)data = (void *)0xC0FFEE; return 0;
    case 2: *(unsigned int *)data = 2; return 0;
    case 8: *(unsigned int *)data = man; return 0;
    case 9: *(int *)data = dev ? 1 : 0; return 0;
    }
    return 1;
}
int cuDeviceGet(int *d, int ordinal) { *d = 100 + ordinal; return 0; }
int cuDeviceGetAttribute(int *v, int attr, int d) { if (attr != 124) return 1; *v = d == 101; return 0; }
int retained;
int fake_retained(void) { return retained; }
int cuDevicePrimaryCtxRetain(void **ctx, int d) {
    if (d != 101) return 101;
    *ctx = (void *)0xC0FFEE;
    retained++;
    return 0;
}
int cuDevicePrimaryCtxRelease_v2(int d) { retained--; return 0; }
int cuCtxPushCurrent_v2(void *ctx) { current = ctx; depth++; return 0; }
int cuCtxPopCurrent_v2(void **ctx) { *ctx = current; current = 0; depth--; return 0; }
int cuMemGetHandleForAddressRange(void *handle, uint64_t start, size_t size, int type, unsigned long long flags) {
    last_start = start; last_size = size; last_flags = flags;
    if (current != (void *)0xC0FFEE) return 201;
    if (type != 1 || start % 4096 || size % 4096) return 1;
    if (start >= DEV + SIZE / 2) return 801;
    *(int *)handle = open("/dev/null", O_RDONLY);
    return 0;
}
"""


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler to build the fake libcuda")
    d = tmp_path_factory.mktemp("fakecuda")
    src = d / "fakecuda.c"
    src.write_text(FAKE_LIBCUDA)
    lib = d / "libfakecuda.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)], check=True)
    return str(lib)


def test_ctypes_driver_against_fake_libcuda(fake_libcuda):
    drv = _driver.CudaDriver(fake_libcuda)
    lib = ctypes.CDLL(fake_libcuda)
    info = drv.pointer_info(DEV_LO + 12345)
    assert info == _driver.PointerInfo(_driver.CU_MEMORYTYPE_DEVICE, False, 1, 0xC0FFEE)
    assert drv.pointer_info(MANAGED_LO).is_managed
    assert drv.pointer_info(0x1000).memory_type is None
    assert drv.dmabuf_supported(1) and not drv.dmabuf_supported(0)
    fd = drv.export_dmabuf(DEV_LO + PAGE, 2 * PAGE, 0xC0FFEE)
    try:
        assert os.fstat(fd) is not None
    finally:
        os.close(fd)
    assert ctypes.c_uint64.in_dll(lib, "last_start").value == DEV_LO + PAGE
    assert ctypes.c_size_t.in_dll(lib, "last_size").value == 2 * PAGE
    assert lib.fake_depth() == 0                       # pushed and popped the pointer's context
    with pytest.raises(rd.RDMAError, match="CUDA_ERROR_NOT_SUPPORTED") as e:
        drv.export_dmabuf(DEV_LO + (1 << 29), PAGE, 0xC0FFEE)
    assert e.value.call == "cuMemGetHandleForAddressRange"
    assert lib.fake_depth() == 0
    # memory without a context of its own (VMM): the device's primary context is retained and released
    fd = drv.export_dmabuf(DEV_LO, PAGE, None, 1)
    os.close(fd)
    assert lib.fake_depth() == 0 and lib.fake_retained() == 0
    with pytest.raises(rd.RDMAError, match="cuMemGetHandleForAddressRange.*CUDA_ERROR_INVALID_CONTEXT"):
        drv.export_dmabuf(DEV_LO, PAGE, None, None)     # no context at all
    with pytest.raises(rd.RDMAError, match="has no cuNoSuchCall"):
        drv._fn("cuNoSuchCall")


def test_registration_through_the_ctypes_driver(fake_libcuda, fake_gpudirect):
    fake_gpudirect["driver"] = _driver.CudaDriver(fake_libcuda)
    arr = _gpu_array(DEV_LO + 10, 3 * PAGE)
    mr = gpu.register_gpu_array(fake_gpudirect["pd"], arr)
    assert mr.kind == "dmabuf" and mr.addr == DEV_LO and mr.length == 4 * PAGE
    fd = FakeMemoryRegion.calls[0][1]
    with pytest.raises(OSError):
        os.fstat(fd)                                   # closed after registering


# --------------------------------------------------------------------------------------------------
# Reductions: op/dtype validation and stream handling (kernels themselves need a GPU, below)
# --------------------------------------------------------------------------------------------------

def test_reduce_ops_and_dtypes():
    assert gpu_reduce.normalize_op("SUM") == "sum"
    assert gpu_reduce.normalize_op(collections.namedtuple("Op", "name")("max")) == "max"
    with pytest.raises(rd.UsageError, match="unknown reduction op"):
        gpu_reduce.normalize_op("xor")
    for dt in ("int8", "uint8", "int32", "int64", "float16", "float32", "float64"):
        assert gpu_reduce.check_dtype(dt) == np.dtype(dt)
    with pytest.raises(rd.UsageError, match="bfloat16 reductions need a bfloat16 dtype in CuPy"):
        gpu_reduce.check_dtype("bfloat16")
    with pytest.raises(rd.UsageError, match="bfloat16"):
        gpu_reduce.check_dtype(type("TorchDtype", (), {"__str__": lambda s: "torch.bfloat16"})())
    for bad in ("complex64", "uint16", "bool", None, "not-a-dtype"):
        with pytest.raises(rd.UsageError, match="not supported"):
            gpu_reduce.check_dtype(bad)
    # integers need no NaN test; floats propagate NaN like numpy.minimum/maximum
    assert "isnan" not in gpu_reduce.kernel_source("min", "int32")
    assert "isnan" in gpu_reduce.kernel_source("max", "float16")
    assert gpu_reduce.kernel_source("avg", "float32") == gpu_reduce.kernel_source("sum", "float32")
    # the vector kernel: float16 computed in float32, NaN tested without a math header
    src, name = gpu_reduce.vector_kernel_source("max", "float16")
    assert name == "pyrdma_reduce_max_float16" and "typedef float C" in src and "cvt.rn.f16.f32" in src
    assert "(x != x)" in src and "isnan" not in src
    src, _ = gpu_reduce.vector_kernel_source("prod", "int8")
    assert "typedef signed char T" in src and "typedef signed char C" in src and "y = y * x" in src


class _FakeCupyStreams:
    """Just enough of cupy.cuda for as_stream."""

    class Stream:
        pass

    class ExternalStream:
        def __init__(self, ptr):
            self.ptr = ptr

    current = Stream()

    @classmethod
    def get_current_stream(cls):
        return cls.current


def test_as_stream_accepts_the_usual_stream_objects():
    cp = type("cp", (), {"cuda": _FakeCupyStreams})
    assert gpu_reduce.as_stream(cp, None) is _FakeCupyStreams.current
    s = _FakeCupyStreams.Stream()
    assert gpu_reduce.as_stream(cp, s) is s
    assert gpu_reduce.as_stream(cp, 0x1234).ptr == 0x1234
    protocol = type("S", (), {"__cuda_stream__": lambda self: (0, 0x55)})()
    assert gpu_reduce.as_stream(cp, protocol).ptr == 0x55
    torch_like = type("T", (), {"cuda_stream": 0x66})()
    assert gpu_reduce.as_stream(cp, torch_like).ptr == 0x66
    with pytest.raises(rd.UsageError, match="cannot use str as a CUDA stream"):
        gpu_reduce.as_stream(cp, "stream")


class FakeCupy:
    """Enough of CuPy to check reduce_into's wiring on the CPU: which array is the kernel's input and
    which its in-place output, on which device and stream, compiled once per op. The "kernels" apply
    the numpy equivalent named by the kernel; the CUDA source itself is only run by the gpu tests."""

    class ndarray(np.ndarray):
        def __array_finalize__(self, obj):
            self.gpu = getattr(obj, "gpu", None)

        @property
        def data(self):              # CuPy's MemoryPointer: just the address
            return type("MemoryPointer", (), {"ptr": self.ctypes.data})()

        @property
        def device(self):            # (numpy 2 has a read-only ndarray.device of its own)
            return self.gpu

    class Device:
        def __init__(self, id):
            self.id = id
            self.entered = 0

        def __enter__(self):
            self.entered += 1
            FakeCupy.current_device.append(self)

        def __exit__(self, *exc):
            FakeCupy.current_device.pop()

    class cuda(_FakeCupyStreams):
        class Stream(_FakeCupyStreams.Stream):
            def __enter__(self):
                FakeCupy.current_stream.append(self)

            def __exit__(self, *exc):
                FakeCupy.current_stream.pop()

        current = Stream()

        class runtime:
            @staticmethod
            def getDeviceProperties(device_id):
                return {"multiProcessorCount": 4}

    current_device, current_stream, launches = [], [], []
    NUMPY = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum, "avg": np.add}

    class ElementwiseKernel:
        def __init__(self, in_params, out_params, body, name):
            self.params, self.body, self.name = (in_params, out_params), body, name

        def __call__(self, x, y):
            FakeCupy.launches.append((self, FakeCupy.current_device[-1].id, FakeCupy.current_stream[-1]))
            op = self.name.split("_")[2]
            if self.name.startswith("pyrdma_avg"):
                y[...] = (np.trunc(y / x) if y.dtype.kind in "iu" else y / x).astype(y.dtype)
            else:
                with np.errstate(over="ignore"):
                    FakeCupy.NUMPY[op](y, x, out=y)

    class RawKernel:
        def __init__(self, source, name):
            self.source, self.name, self.params = source, name, "vector"

        def __call__(self, grid, block, args):
            FakeCupy.launches.append((self, FakeCupy.current_device[-1].id, FakeCupy.current_stream[-1]))
            y, x, n, nvec = args
            assert 1 <= grid[0] and block == (256,) and 0 <= nvec * (16 // y.itemsize) <= n == y.size
            with np.errstate(over="ignore"):
                FakeCupy.NUMPY[self.name.split("_")[2]](y.ravel(), x.ravel(), out=y.ravel())

    @classmethod
    def asarray(cls, obj):           # CuPy views __cuda_array_interface__ memory without copying
        a = obj.host.view(cls.ndarray)
        a.gpu = cls.Device(0)
        return a

    @classmethod
    def array(cls, values, device=0):
        a = np.array(values).view(cls.ndarray)
        a.gpu = cls.Device(device)
        return a


def test_reduce_into_wiring_with_a_fake_cupy(monkeypatch):
    monkeypatch.setattr(gpu_reduce, "import_cupy", lambda feature: FakeCupy)
    monkeypatch.setattr(gpu_reduce, "_kernels", {})
    FakeCupy.launches.clear()
    dst = FakeCupy.array(np.arange(6, dtype=np.int32).reshape(2, 3))
    src = FakeCupy.array(np.full(6, 10, np.int32))            # same size, other shape: viewed as dst's
    stream = FakeCupy.cuda.Stream()
    assert gpu.reduce_into(dst, src, "sum", stream=stream) is dst
    assert dst.ravel().tolist() == [10, 11, 12, 13, 14, 15] and src.tolist() == [10] * 6
    kernel, device, used_stream = FakeCupy.launches[-1]
    assert (kernel.params, device, used_stream) == ("vector", 0, stream) and dst.device.entered == 1
    assert kernel.name == "pyrdma_reduce_sum_int32"
    gpu.reduce_into(dst, src, "SUM")                          # the current stream, the cached kernel
    assert FakeCupy.launches[-1][0] is kernel and FakeCupy.launches[-1][2] is FakeCupy.cuda.current
    gpu.reduce_into(dst, FakeCupy.array(np.full(6, 12, np.int32)).reshape(2, 3), "min")
    assert dst.ravel().tolist() == [12] * 6
    gpu.finalize_avg(dst, 5)
    assert dst.ravel().tolist() == [2] * 6
    floats = FakeCupy.array(np.array([1.0, -7.0], np.float32))
    gpu.finalize_avg(floats, 2)
    assert floats.tolist() == [0.5, -3.5]
    with pytest.raises(rd.UsageError, match="dtypes differ"):
        gpu.reduce_into(dst, FakeCupy.array(np.zeros(6, np.int64)))
    with pytest.raises(rd.UsageError, match="sizes differ"):
        gpu.reduce_into(dst, FakeCupy.array(np.zeros(5, np.int32)))
    with pytest.raises(rd.UsageError, match="not both contiguous"):
        gpu.reduce_into(FakeCupy.array(np.zeros((3, 4), np.int32))[:, :2], FakeCupy.array(np.zeros(6, np.int32)))
    with pytest.raises(rd.UsageError, match="on GPU 1"):
        gpu.reduce_into(dst, FakeCupy.array(np.zeros((2, 3), np.int32), device=1))
    with pytest.raises(rd.UsageError, match="numpy array"):
        gpu.reduce_into(np.zeros(3), np.zeros(3))
    with pytest.raises(rd.UsageError, match="not a CUDA array"):
        gpu.reduce_into(FakeDLPackCuda(0x1000, (3,), device=(1, 0)), FakeCupy.array(np.zeros(3, np.float32)))
    with pytest.raises(rd.UsageError, match="not supported"):
        gpu.reduce_into(FakeCupy.array(np.zeros(3, np.complex64)), FakeCupy.array(np.zeros(3, np.complex64)))
    # strided views take the elementwise kernel
    wide = FakeCupy.array(np.zeros((3, 4), np.int32))
    gpu.reduce_into(wide[:, :2], FakeCupy.array(np.ones((3, 2), np.int32)))
    assert FakeCupy.launches[-1][0].params == ("T x", "T y") and wide.sum() == 6 and wide[:, 2:].sum() == 0
    # a foreign CUDA array (__cuda_array_interface__) is reduced in its own memory
    host = np.ones(4, np.float64)
    foreign = FakeCudaArray(host)
    assert gpu.reduce_into(foreign, FakeCupy.array(np.full(4, 2.0)), "max") is foreign
    assert host.tolist() == [2.0] * 4


def test_reduce_into_rejects_bad_arguments_before_cupy(monkeypatch):
    with pytest.raises(rd.UsageError, match="unknown reduction op"):
        gpu.reduce_into(None, None, "xor")
    with pytest.raises(rd.UsageError, match="count must be positive"):
        gpu.finalize_avg(None, 0)


# --------------------------------------------------------------------------------------------------
# Host staging pipeline, on a simulated CUDA stream/event backend
# --------------------------------------------------------------------------------------------------

class SimStream:
    def __init__(self, name):
        self.name = name
        self.ops = collections.deque()


class SimEvent:
    def __init__(self):
        self.recorded = 0      # records enqueued so far
        self.completed = 0     # the last record that has executed


class SimBackend:
    """CUDA semantics without a GPU: streams run their ops in order, a wait blocks its stream until the
    event's latest record (at wait time) has executed, copies happen (ctypes.memmove) only when run.

    Nothing runs until the host synchronizes. ``priority`` picks which stream runs first when several
    can; ``eager`` runs everything runnable after each host sync (copy streams race ahead as far as
    they can, exposing a missing wait), while lazy runs only what the sync needs (exposing a missing
    sync). Between them they play the orders a GPU may choose.
    """

    def __init__(self, priority=("d2h", "h2d", "user"), eager=True):
        self.priority = priority
        self.eager = eager
        self.user = SimStream("user")
        self.streams = {"user": self.user}
        self.allocated, self.freed = [], []
        self.copies = []          # (direction, nbytes) in execution order
        self.max_queued = 0

    # pipeline interface
    def device_of(self, ptr):
        return 0

    def device(self, device_id):
        return contextlib.nullcontext()

    def user_stream(self, stream):
        return stream or self.user

    def new_stream(self):
        name = "d2h" if "d2h" not in self.streams else "h2d"
        self.streams[name] = SimStream(name)
        return self.streams[name]

    def new_event(self):
        return SimEvent()

    def alloc_host(self, nbytes):
        host = rd.aligned_empty(nbytes)
        host[:] = 0xEE
        self.allocated.append(host)
        return host

    def free_host(self, host):
        self.freed.append(host)

    def copy_d2h(self, host, dev_ptr, nbytes, stream):
        stream.ops.append(("copy", "d2h", host.ctypes.data, dev_ptr, nbytes))
        self.max_queued = max(self.max_queued, len(stream.ops))

    def copy_h2d(self, dev_ptr, host, nbytes, stream):
        stream.ops.append(("copy", "h2d", dev_ptr, host.ctypes.data, nbytes))

    def copy_d2d(self, dst_ptr, src_ptr, nbytes, stream):
        stream.ops.append(("copy", "d2d", dst_ptr, src_ptr, nbytes))

    def device_array(self, host, device_id):
        return FakeCudaArray(np.array(host))

    def empty_device(self, shape, dtype, device_id):
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return FakeCudaArray(np.full(nbytes, 0xEE, np.uint8).view(dtype).reshape(shape))

    def record(self, event, stream):
        event.recorded += 1
        stream.ops.append(("record", event, event.recorded))

    def wait(self, stream, event):
        stream.ops.append(("wait", event, event.recorded))

    def synchronize(self, event):
        target = event.recorded
        self._run_until(lambda: event.completed >= target)

    def synchronize_stream(self, stream):
        self._run_until(lambda: not stream.ops)

    # the simulated GPU
    def _step(self):
        for name in self.priority:
            stream = self.streams.get(name)
            if not stream or not stream.ops:
                continue
            op = stream.ops[0]
            if op[0] == "wait" and op[1].completed < op[2]:
                continue
            stream.ops.popleft()
            if op[0] == "copy":
                ctypes.memmove(op[2], op[3], op[4])
                self.copies.append((op[1], op[4]))
            elif op[0] == "record":
                op[1].completed = op[2]
            return True
        return False

    def _run_until(self, done):
        while not done():
            if not self._step():
                raise AssertionError("simulated GPU deadlocked: a wait can never be satisfied")
        while self.eager and self._step():
            pass

    def idle(self):
        return all(not s.ops for s in self.streams.values())


SCHEDULES = [(p, e) for p in (("d2h", "h2d", "user"), ("h2d", "d2h", "user"), ("user", "h2d", "d2h"))
             for e in (True, False)]


def _staged(values, chunk_bytes, depth, host_op, priority, eager, stream=None):
    backend = SimBackend(priority, eager)
    dev = FakeCudaArray(values)
    pipe = gpu.HostStagingPipeline(chunk_bytes, depth, backend=backend)
    assert pipe.run(dev, host_op, stream) is dev
    backend.synchronize_stream(backend.user)     # what the caller's stream would see
    return backend, pipe


def test_chunk_spans():
    assert gpu.chunk_spans(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert gpu.chunk_spans(24, 10, 4) == [(0, 8), (8, 8), (16, 8)]
    assert gpu.chunk_spans(8, 100, 8) == [(0, 8)]
    assert gpu.chunk_spans(0, 4) == []
    spans = gpu.chunk_spans(1000 * 8, 4096, 8)
    assert sum(n for _, n in spans) == 8000 and all(o % 8 == 0 and n % 8 == 0 for o, n in spans)
    assert all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:]))
    with pytest.raises(rd.UsageError, match="smaller than one 8-byte item"):
        gpu.chunk_spans(64, 4, 8)
    with pytest.raises(rd.UsageError, match="whole number"):
        gpu.chunk_spans(10, 4, 4)


@pytest.mark.parametrize("priority, eager", SCHEDULES)
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_pipeline_result_is_right_under_any_schedule(priority, eager, depth):
    values = np.arange(1000, dtype=np.float32)
    seen = []

    def host_op(chunk):
        seen.append(chunk.copy())            # what the host saw must be the device data, not a stale slot
        chunk *= 3

    backend, pipe = _staged(values, 256, depth, host_op, priority, eager)
    np.testing.assert_array_equal(values, np.arange(1000, dtype=np.float32) * 3)
    np.testing.assert_array_equal(np.concatenate(seen), np.arange(1000, dtype=np.float32))
    assert [len(c) for c in seen] == [64] * 15 + [40]
    assert backend.idle()
    assert len(backend.allocated) == depth and all(h.nbytes == 256 for h in backend.allocated)
    assert len(pipe.host_slots(0)) == depth


def test_pipeline_overlaps_copies_with_host_work():
    # with depth 3, chunks 1 and 2 are queued for copy-in while the host works on chunk 0
    backend = SimBackend(eager=False)
    queued_during_op = []

    def host_op(chunk):
        queued_during_op.append(sum(op[0] == "copy" for op in backend.streams["d2h"].ops))
        chunk += 1

    pipe = gpu.HostStagingPipeline(64, 3, backend=backend)
    values = np.zeros(64, np.int64)
    pipe.run(FakeCudaArray(values), host_op)
    backend.synchronize_stream(backend.user)
    assert queued_during_op[0] == 2          # chunks 1, 2 in flight while chunk 0 is on the host
    assert values.tolist() == [1] * 64


class NoSlotWaitBackend(SimBackend):
    """A deliberately broken pipeline: the copy-in stream ignores the wait for a slot's copy-back."""

    def record(self, event, stream):
        event.stream = stream
        super().record(event, stream)

    def wait(self, stream, event):
        if stream is self.streams.get("d2h") and getattr(event, "stream", None) is self.streams.get("h2d"):
            return
        super().wait(stream, event)


class NoHostSyncBackend(SimBackend):
    """A deliberately broken pipeline: the host does not wait for a chunk's copy-in."""

    def synchronize(self, event):
        pass


@pytest.mark.parametrize("broken, eager", [(NoSlotWaitBackend, True), (NoHostSyncBackend, False)])
def test_simulator_catches_a_broken_pipeline(broken, eager):
    """The simulated GPU is adversarial enough that dropping either dependency corrupts the result."""
    backend = broken(("d2h", "h2d", "user"), eager=eager)
    values = np.arange(512, dtype=np.int32)
    gpu.HostStagingPipeline(64, 2, backend=backend).run(FakeCudaArray(values), lambda c: c.__imul__(2))
    backend.synchronize_stream(backend.user)
    for stream in list(backend.streams.values()):
        backend.synchronize_stream(stream)
    assert not np.array_equal(values, np.arange(512, dtype=np.int32) * 2)


def test_pipeline_waits_for_the_callers_stream_and_makes_it_wait():
    backend = SimBackend(("d2h", "h2d", "user"), eager=False)
    values = np.zeros(128, np.uint8)
    caller = SimStream("caller")
    backend.streams["caller"] = caller
    backend.priority = ("d2h", "h2d", "caller")
    # the producer of the data is still queued on the caller's stream
    src = np.full(128, 7, np.uint8)
    caller.ops.append(("copy", "produce", values.ctypes.data, src.ctypes.data, 128))
    pipe = gpu.HostStagingPipeline(32, 2, backend=backend)
    pipe.run(FakeCudaArray(values), lambda c: c.__iadd__(1), stream=caller)
    assert caller.ops[-1][0] == "wait"            # later work on the caller's stream waits for the copies back
    backend.synchronize_stream(caller)
    assert values.tolist() == [8] * 128
    assert backend.copies[0] == ("produce", 128)


def test_host_op_may_return_a_new_array():
    values = np.arange(100, dtype=np.int64)
    _staged(values, 80, 2, lambda c: c[::-1] * 2, ("h2d", "d2h", "user"), True)
    expected = np.concatenate([np.arange(i, min(i + 10, 100))[::-1] * 2 for i in range(0, 100, 10)])
    np.testing.assert_array_equal(values, expected)
    with pytest.raises(rd.UsageError, match="returned shape"):
        _staged(np.zeros(16, np.float64), 64, 2, lambda c: c[:3], ("d2h", "h2d", "user"), True)


def test_host_op_failure_drains_the_copies():
    backend = SimBackend(eager=False)
    pipe = gpu.HostStagingPipeline(64, 3, backend=backend)
    calls = []

    def host_op(chunk):
        calls.append(len(chunk))
        if len(calls) == 2:
            raise rd.PeerError("rank 1 died", peer=1)
        chunk += 1

    values = np.zeros(64, np.int16)
    with pytest.raises(rd.PeerError):
        pipe.run(FakeCudaArray(values), host_op)
    assert not backend.streams["d2h"].ops and not backend.streams["h2d"].ops
    assert values[:32].tolist() == [1] * 32 and values[32:].tolist() == [0] * 32
    # the pipeline stays usable
    pipe.run(FakeCudaArray(values), lambda c: c.__iadd__(1))
    backend.synchronize_stream(backend.user)
    assert values.tolist() == [2] * 32 + [1] * 32


def test_pipeline_reuses_slots_and_close_frees_them():
    backend = SimBackend()
    with gpu.HostStagingPipeline(128, 2, backend=backend) as pipe:
        for n in (10, 300, 7):
            values = np.ones(n, np.float64)
            pipe.run(FakeCudaArray(values), lambda c: c.__imul__(5))
            backend.synchronize_stream(backend.user)
            assert values.tolist() == [5.0] * n
        slots = pipe.host_slots(0)
        assert len(backend.allocated) == 2 and all(s.ctypes.data % 4096 == 0 for s in slots)
    assert len(backend.freed) == 2 and backend.idle()
    with pytest.raises(rd.UsageError, match="closed"):
        pipe.run(FakeCudaArray(np.ones(4)), lambda c: None)
    pipe.close()


def test_pipeline_rejects_what_it_cannot_stage():
    pipe = gpu.HostStagingPipeline(64, 2, backend=SimBackend())
    with pytest.raises(rd.UsageError, match="read-only"):
        pipe.run(FakeCudaArray(np.zeros(8), readonly=True), lambda c: None)
    bits = np.arange(8, dtype=np.uint16)          # bfloat16 (numpy has none) is staged as its bits
    seen = []
    pipe.run(FakeDLPackCuda(bits.ctypes.data, (8,), code=4, bits=16), lambda c: seen.append(c.dtype))
    pipe.backend.synchronize_stream(pipe.backend.user)
    assert seen == [np.uint16]
    with pytest.raises(rd.UsageError, match="cpu memory"):
        pipe.run(np.zeros(8), lambda c: None)
    with pytest.raises(rd.UsageError, match="smaller than one"):
        gpu.HostStagingPipeline(4, 2, backend=SimBackend()).run(FakeCudaArray(np.zeros(8)), lambda c: None)
    with pytest.raises(rd.UsageError):
        gpu.HostStagingPipeline(0)
    with pytest.raises(rd.UsageError):
        gpu.HostStagingPipeline(64, 0)


class FakeCommunicator:
    """A host allreduce over `nranks` identical ranks: sum multiplies by nranks."""

    def __init__(self, nranks):
        self.nranks = nranks
        self.calls = []

    def allreduce(self, buf, op="sum"):
        self.calls.append((buf.dtype, buf.size, op))
        if op == "sum":
            buf *= self.nranks
        return buf


def test_staged_allreduce_uses_the_communicators_host_allreduce():
    comm = FakeCommunicator(4)
    values = np.arange(3000, dtype=np.float64)
    pipe = gpu.HostStagingPipeline(8 * 1024, 2, backend=SimBackend())
    gpu.staged_allreduce(comm, FakeCudaArray(values), "sum", pipeline=pipe)
    pipe.backend.synchronize_stream(pipe.backend.user)
    np.testing.assert_array_equal(values, np.arange(3000) * 4.0)
    assert comm.calls == [(np.float64, 1024, "sum")] * 2 + [(np.float64, 952, "sum")]


def _stage_on(comm, pipe):
    """Make this rank process stage fake CUDA arrays (HostCupy) through ``pipe`` on the simulated
    GPU, and return the list every host run of ``comm`` (its spec) is appended to."""
    from pyrdma.cuda import collectives as gc
    gc.import_cupy = lambda feature: HostCupy           # a rank process of its own: nothing to restore
    gc.default_pipeline = lambda: pipe
    runs = []
    run_spec = comm._run_spec

    def counting_run_spec(spec, *args, **kwargs):
        runs.append(spec)
        return run_spec(spec, *args, **kwargs)
    comm._run_spec = counting_run_spec
    return runs


def _staged_through_the_communicator(comm, chunk_bytes):
    """A rank's blocking allreduce, reduce and broadcast of fake CUDA arrays, staged by the pipeline on
    the simulated GPU: the Communicator hands pyrdma.cuda its own host call for each chunk."""
    pipe = gpu.HostStagingPipeline(chunk_bytes, 2, backend=SimBackend())
    runs = _stage_on(comm, pipe)

    def calls(since=(0, 0)):
        """the elements of each chunk copied down (8-byte ones) since (copies, runs), if one host
        run each"""
        down = [n // 8 for d, n in pipe.backend.copies[since[0]:] if d == "d2h"]
        return down if len(down) == len(runs) - since[1] else ("runs", len(runs) - since[1], "chunks", down)
    out = {}
    values = np.arange(3000, dtype=np.float64) + comm.rank
    dev = FakeCudaArray(values)
    assert comm.allreduce(dev, op="max") is dev
    pipe.backend.synchronize_stream(pipe.backend.user)
    out["allreduce"], out["calls"] = values.copy(), calls()

    values = np.arange(3000, dtype=np.int32) * (comm.rank + 1)
    dev = FakeCudaArray(values)
    got = comm.reduce(dev, op="sum", root=1)
    pipe.backend.synchronize_stream(pipe.backend.user)
    out["reduce"], out["reduce_returned"] = values.copy(), got is dev

    values = np.full(5000, comm.rank, np.uint8)
    comm.broadcast(FakeCudaArray(values), root=1)
    pipe.backend.synchronize_stream(pipe.backend.user)
    out["broadcast"] = values.copy()

    # out of place: out takes a copy of buf on the GPU first, then the chunks of out are staged
    seen = (len(pipe.backend.copies), len(runs))
    values, result = np.arange(100, dtype=np.int64) * (comm.rank + 1), np.zeros(100, np.int64)
    dev, into = FakeCudaArray(values), FakeCudaArray(result)
    assert comm.allreduce(dev, out=into, op="sum") is into
    pipe.backend.synchronize_stream(pipe.backend.user)
    out["allreduce_out"] = (values.copy(), result.copy(), calls(seen))

    # non-blocking calls queued while the earlier ones run, at each rank's own pace: each chunk's
    # messages carry its own call's number
    arrays = [np.arange(3000, dtype=np.float64) * (k + 1) + comm.rank for k in range(3)]
    handles = []
    for call in [lambda a=a: comm.iallreduce(FakeCudaArray(a)) for a in arrays] + [
            lambda: comm.ibroadcast(FakeCudaArray(arrays[0]), root=1)]:
        handles.append(call())
        time.sleep(0.05 * comm.rank)
    for h in handles:
        h.wait(timeout=30)
    out["queued"] = [a.copy() for a in arrays]
    return out


class HostCupy:
    """CuPy as pyrdma.cuda.collectives stages with it, over host memory: a "device" array is a
    FakeCudaArray, CuPy's views of it numpy views with get/set (counted: ``uploads``), pinned memory
    a bytearray, streams and devices no-ops. What it checks is the staging's logic (what is copied
    down, what comes back up, which array the caller gets); the gpu tests run the real thing."""
    uploads = 0

    class _View(np.ndarray):
        def get(self, out=None):
            if out is None:
                return np.array(self)        # (CuPy's get(): a new host array)
            out[...] = self
            return out

        def set(self, host):
            HostCupy.uploads += 1
            self[...] = host

    @staticmethod
    def ndarray(shape, dtype, memptr):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        raw = (ctypes.c_char * max(n, 1)).from_address(memptr.ptr)
        return np.frombuffer(raw, np.uint8, n).view(dtype).reshape(shape).view(HostCupy._View)

    @staticmethod
    def asarray(host):
        return FakeCudaArray(np.array(host))          # a new device array: a copy, as cupy.asarray

    class cuda(_FakeCupyStreams):
        class Stream(_FakeCupyStreams.Stream):
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return None

            def synchronize(self):
                pass

        current = Stream()

        class UnownedMemory:
            def __init__(self, ptr, size, owner, device_id=None):
                self.ptr, self.owner = ptr, owner

        class MemoryPointer:
            def __init__(self, mem, offset):
                self.ptr, self.mem = mem.ptr + offset, mem

        class Device(contextlib.nullcontext):
            pass

        class runtime:
            @staticmethod
            def pointerGetAttributes(ptr):
                return type("Attributes", (), {"device": 0})()

        @staticmethod
        def alloc_pinned_memory(nbytes):
            return bytearray(nbytes)


def _stage_every_call(comm):
    """A rank's copying collectives, point-to-point and non-blocking allreduce and broadcast of fake
    CUDA arrays, staged through HostCupy and the simulated GPU; each result next to the numpy
    path's, and the bytes each call copied down and up."""
    backend = SimBackend()
    _stage_on(comm, gpu.HostStagingPipeline(1 << 20, 2, backend=backend))
    n, r = comm.size, comm.rank
    got = {}

    def dev(values, readonly=False):
        return FakeCudaArray(np.array(values), readonly=readonly)

    def copied(call):
        """(what call() returned, bytes copied down, bytes copied up)"""
        before = len(backend.copies)
        value = call()
        moved = backend.copies[before:]
        return value, sum(b for d, b in moved if d == "d2h"), sum(b for d, b in moved if d == "h2d")
    x = (np.arange(10, dtype=np.int32) + 100 * r).reshape(5, 2)
    new = comm.allgather(dev(x))
    got["allgather_new"] = (type(new).__name__, new.host.tobytes(), comm.allgather(x).tobytes())
    out = dev(np.zeros((5 * n, 2), np.int32))
    same, down, up = copied(lambda: comm.allgather(dev(x), out=out))
    got["allgather_out"] = (same is out, down, up, out.host.tobytes() == comm.allgather(x).tobytes())
    y = np.arange(7, dtype=np.float64) * (r + 1)
    got["reduce_scatter"] = (comm.reduce_scatter(dev(y), op="max").host.tobytes(),
                             comm.reduce_scatter(y, op="max").tobytes())
    # one element over three ranks: two of them receive none, into an out= of no elements
    empty = dev(np.zeros(1 if r == 0 else 0))
    got["reduce_scatter_empty_out"] = comm.reduce_scatter(dev(np.ones(1)), out=empty) is empty
    g = comm.gather(dev(x), root=1)
    got["gather"] = (g if g is None else g.host.tobytes(), (lambda h: h if h is None else h.tobytes())(
        comm.gather(x, root=1)))
    src = np.arange(4 * n, dtype=np.int16) if r == 0 else None
    mine = dev(np.zeros(4, np.int16))
    same, down, up = copied(lambda: comm.scatter(dev(src) if src is not None else None, out=mine, root=0))
    got["scatter"] = (mine.host.tobytes(), comm.scatter(src, out=np.zeros(4, np.int16), root=0).tobytes())
    got["scatter_copies"] = (same is mine, down, up)
    counts = [(r + p) % 3 for p in range(n)]
    a = np.arange(sum(counts), dtype=np.uint8) + 10 * r
    got["alltoall"] = (comm.alltoall(dev(a), send_counts=counts).host.tobytes(),
                       comm.alltoall(a, send_counts=counts).tobytes())
    b = dev(np.arange(9, dtype=np.int64) + r)
    same, down, up = copied(lambda: comm.alltoall(b, out=dev(np.zeros(9, np.int64))))
    got["alltoall_copies"] = (down, up)
    right, left = (r + 1) % n, (r - 1) % n
    recv = dev(np.zeros(6, np.int64))
    count = comm.sendrecv(dev(np.arange(4, dtype=np.int64) + r), right, recv, left)
    got["sendrecv"] = (count, recv.host.tolist())
    z = dev(np.full(3, r + 1.0))
    got["iallreduce"] = (comm.iallreduce(z).wait(timeout=30) is z, z.host.tolist())
    w = dev(np.full(5, r, np.int32))
    same, down, up = copied(lambda: comm.ibroadcast(w, root=2).wait(timeout=30))
    got["ibroadcast"] = (same is w, w.host.tolist(), down, up)
    errors = {}
    for name, call in (("read-only out", lambda: comm.allgather(dev(x), out=dev(np.zeros((5 * n, 2), np.int32),
                                                                                  readonly=True))),
                       ("mixed pair", lambda: comm.iallgather(dev(x), out=np.zeros((5 * n, 2), np.int32)))):
        try:
            call()
            errors[name] = None
        except rd.UsageError as exc:
            errors[name] = str(exc)
    got["errors"] = errors
    return got


def test_every_staged_call_gives_the_numpy_paths_result_on_a_fake_gpu():
    from test_collectives_world import World
    with World(3, "tcp", timeout=30.0) as w:
        results = w.run(_stage_every_call, timeout=60)
    for r, got in enumerate(results):
        kind, staged, host = got["allgather_new"]
        assert kind == "FakeCudaArray" and staged == host          # a new result comes back as a device array
        # the input goes down and the output up, nothing else
        assert got["allgather_out"] == (True, 40, 3 * 40, True), got["allgather_out"]
        for name in ("reduce_scatter", "gather", "scatter", "alltoall"):
            assert got[name][0] == got[name][1], (r, name)
        assert got["reduce_scatter_empty_out"] is True, r     # out= given is what comes back, empty too
        assert (got["gather"][0] is None) == (r != 1)
        assert got["scatter_copies"] == (True, 3 * 8 if r == 0 else 0, 8), got["scatter_copies"]
        assert got["alltoall_copies"] == (72, 72), got["alltoall_copies"]     # the output never goes down
        left = (r - 1) % 3
        assert got["sendrecv"] == (4, [left, left + 1, left + 2, left + 3, 0, 0])
        assert got["iallreduce"] == (True, [6.0, 6.0, 6.0])
        # pipelined: only the root's data goes down, and only the receivers' comes up
        assert got["ibroadcast"] == (True, [2] * 5, 20 if r == 2 else 0, 0 if r == 2 else 20), got["ibroadcast"]
        assert "read-only" in got["errors"]["read-only out"], got["errors"]
        assert "must both be CUDA arrays" in got["errors"]["mixed pair"], got["errors"]


def _direct_broadcast(comm):
    """A blocking broadcast of a fake CUDA array with gpu_path "direct": in place in the array's
    memory (its DirectArea), nothing staged."""
    backend = SimBackend()
    runs = _stage_on(comm, gpu.HostStagingPipeline(1 << 20, 2, backend=backend))
    values = np.full(5000, comm.rank, np.uint8)
    dev = FakeCudaArray(values)
    same = comm.broadcast(dev, root=1) is dev
    kinds = [type(run.kind).__name__ for spec in runs for run in spec.runs]
    return same, values.tolist() == [1] * 5000, kinds, len(backend.copies)


def test_the_direct_path_broadcasts_in_the_arrays_own_memory_on_a_fake_gpu():
    from test_collectives_world import World
    with World(2, "tcp", timeout=30.0, gpu_path="direct") as w:
        results = w.run(_direct_broadcast, timeout=60)
    assert results == [(True, True, ["DirectArea"], 0)] * 2, results


def _torch_backend_on_a_fake_gpu(comm):
    """A rank's torch backend collectives on torch tensors that say they are CUDA tensors (CPU
    tensors whose ``device`` is cuda:0 and which export __cuda_array_interface__ over their memory),
    through the backend's CUDA path and the Communicator's staging on the simulated GPU: values,
    the tensors each Work gives back, and the bytes copied down and up."""
    import datetime
    import torch
    import torch.distributed as dist
    import pyrdma.torch as pt
    from pyrdma.cuda import collectives as gc
    backend = SimBackend()
    pipe = gpu.HostStagingPipeline(4096, 2, backend=backend)
    gc.default_pipeline = lambda: pipe            # a rank process of its own: nothing to restore

    class FakeCudaTensor(torch.Tensor):
        @property
        def device(self):
            return torch.device("cuda", 0)

        @property
        def __cuda_array_interface__(self):
            return {"shape": tuple(self.shape), "typestr": np.dtype(str(self.dtype).split(".")[1]).str,
                    "data": (self.data_ptr(), False), "version": 3, "strides": None}

    def fake(t):
        return torch.Tensor._make_subclass(FakeCudaTensor, t)

    def copied(call):
        """(what the Work gave back, bytes copied down, bytes copied up)"""
        before = len(backend.copies)
        work = call()
        work.wait()
        moved = backend.copies[before:]
        return work.result(), sum(b for d, b in moved if d == "d2h"), sum(b for d, b in moved if d == "h2d")
    n, r = comm.size, comm.rank
    pg = pt.ProcessGroupPyrdma(None, r, n, datetime.timedelta(seconds=30), comm=comm)
    got = {}
    x = fake(torch.arange(3000, dtype=torch.float32) * (r + 1))          # three staging chunks
    res, down, up = copied(lambda: pg.allreduce([x], dist.AllreduceOptions()))
    got["allreduce"] = (res[0] is x, x.sum().item(), down, up)
    b = fake(torch.full((10,), float(r)))
    opts = dist.BroadcastOptions()
    opts.rootRank = 1
    res, down, up = copied(lambda: pg.broadcast([b], opts))
    got["broadcast"] = (res[0] is b, b.tolist(), down, up)
    src, out = fake(torch.arange(4 * n, dtype=torch.int64) + 100 * r), fake(torch.zeros(4 * n, dtype=torch.int64))
    res, down, up = copied(lambda: pg.alltoall_base(out, src, [], [], dist.AllToAllOptions()))
    got["alltoall"] = (res is out, out.tolist(), down, up)
    inp, seg = fake(torch.ones(3 * n, dtype=torch.float64) * (r + 1)), fake(torch.zeros(3, dtype=torch.float64))
    res, down, up = copied(lambda: pg._reduce_scatter_base(seg, inp, dist.ReduceScatterOptions()))
    got["reduce_scatter"] = (res is seg, seg.tolist(), down, up)
    mine, whole = fake(torch.full((2,), r, dtype=torch.int32)), fake(torch.zeros(2 * n, dtype=torch.int32))
    res, down, up = copied(lambda: pg._allgather_base(whole, mine))
    got["allgather"] = (res is whole, whole.tolist(), down, up)
    # larger than a slot, uneven pieces: piece by piece, bit for bit what CPU tensors get
    g = torch.Generator().manual_seed(r)
    for name, n_in, n_out, call in (
            ("all_to_all_single", n * 1001, n * 1001, lambda o, i: pg.alltoall_base(o, i, [], [], dist.AllToAllOptions())),
            ("reduce_scatter_tensor", n * 1001, 1001, lambda o, i: pg._reduce_scatter_base(o, i, dist.ReduceScatterOptions())),
            ("all_gather_into_tensor", 1001, n * 1001, lambda o, i: pg._allgather_base(o, i))):
        values = torch.randn(n_in, generator=g)
        out, cpu_out = fake(torch.zeros(n_out)), torch.zeros(n_out)
        before = len(backend.copies)
        res, down, up = copied(lambda: call(out, fake(values.clone())))
        pieces = sum(d == "d2h" for d, _ in backend.copies[before:])
        call(cpu_out, values.clone()).wait()
        got[name] = (res is out, out.numpy().tobytes() == cpu_out.numpy().tobytes(), down == 4 * n_in,
                     up == 4 * n_out, pieces > 1)
    return got


def test_torch_backend_stages_cuda_tensors_on_a_fake_gpu():
    from test_collectives_world import World
    if not os.environ.get("PYRDMA_REQUIRE_TORCH"):
        pytest.importorskip("torch")
    with World(2, "tcp", timeout=30.0) as w:
        results = w.run(_torch_backend_on_a_fake_gpu, timeout=120)
    for r, got in enumerate(results):
        # each Work gives back the caller's own tensors, which hold the result; what the call reads
        # goes down, what it writes comes up, and nothing else
        assert got["allreduce"] == (True, 3 * 3000 * 2999 / 2, 12000, 12000), got["allreduce"]
        assert got["broadcast"] == (True, [1.0] * 10, 40 if r == 1 else 0, 0 if r == 1 else 40), got["broadcast"]
        want = [100 * p + 4 * r + k for p in range(2) for k in range(4)]
        assert got["alltoall"] == (True, want, 64, 64), got["alltoall"]
        assert got["reduce_scatter"] == (True, [3.0] * 3, 48, 24), got["reduce_scatter"]
        assert got["allgather"] == (True, [0, 0, 1, 1], 8, 16), got["allgather"]
        for name in ("all_to_all_single", "reduce_scatter_tensor", "all_gather_into_tensor"):
            assert got[name] == (True,) * 5, (name, got[name])


def test_pyrdma_cuda_does_not_import_the_collectives():
    """pyrdma.cuda gives the Communicator work areas and staging; the host calls come in as
    arguments, so the layering has one direction (a CUDA module importing the collectives back
    would be a cycle waiting to happen)."""
    import ast
    import pathlib
    offenders = []
    for path in sorted(pathlib.Path(gpu.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}:{node.lineno} {n}" for n in names
                          if n.startswith(("pyrdma.collectives", "pyrdma.torch"))]
    assert offenders == []


def test_the_communicator_stages_cuda_arrays_by_its_own_host_calls():
    from test_collectives_world import World
    with World(2, "tcp", timeout=30.0) as w:
        results = w.run(_staged_through_the_communicator, 8 * 1024, timeout=60)
    for rank, got in enumerate(results):
        np.testing.assert_array_equal(got["allreduce"], np.arange(3000) + 1.0)
        # one host run of the call per chunk
        assert got["calls"] == [1024, 1024, 952]
        np.testing.assert_array_equal(got["reduce"], np.arange(3000) * (3 if rank == 1 else rank + 1))
        assert got["reduce_returned"] == (rank == 1)
        np.testing.assert_array_equal(got["broadcast"], np.full(5000, 1, np.uint8))
        unchanged, result, calls = got["allreduce_out"]
        assert calls == [100]
        np.testing.assert_array_equal(unchanged, np.arange(100) * (rank + 1))
        np.testing.assert_array_equal(result, np.arange(100) * 3)
        sums = [np.arange(3000) * (k + 1) * 2 + 1.0 for k in range(3)]
        for k, want in enumerate([sums[0]] + sums[1:]):
            np.testing.assert_array_equal(got["queued"][k], want)


# --------------------------------------------------------------------------------------------------
# Blockwise collectives (allgather, reduce_scatter, all-to-all) piece by piece
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("per_rank", [0, 1, 2, 5, 37])
@pytest.mark.parametrize("itemsize, chunk_bytes", [(1, 64), (2, 96), (8, 100), (8, 1 << 20)])
def test_block_pieces_are_calls_of_the_collective(size, per_rank, itemsize, chunk_bytes):
    """Every piece moves sub-block i of every block, the pieces cover each block once in order, a
    reduce_scatter's piece splits as the host's segment_bounds of its length, and a piece fits its
    slot (unless one item per block does not)."""
    from pyrdma.collectives.pieces import segment_bounds
    from pyrdma.cuda.staging import block_pieces
    equal = [p * per_rank * itemsize for p in range(size + 1)]
    segments = [b * itemsize for b in segment_bounds(per_rank * size + size // 2, size)]
    layouts = {"allgather": ([0, per_rank * itemsize], equal), "alltoall": (equal, equal)}
    for r in range(size):
        layouts[f"reduce_scatter {r}"] = (segments, [0, segments[r + 1] - segments[r]])
    for name, (src, dst) in layouts.items():
        pieces = block_pieces(src, dst, itemsize, chunk_bytes)
        assert pieces, name
        for bounds, side in ((src, "down"), (dst, "up")):
            for k, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
                spans = [getattr(p, side)[k] for p in pieces]
                assert spans[0][0] == lo and all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:])), name
                assert spans[-1][0] + spans[-1][1] == hi and all(n % itemsize == 0 for _, n in spans), name
        if name.startswith("reduce_scatter"):
            r = int(name.split()[1])
            for p in pieces:
                items = [n // itemsize for _, n in p.down]
                assert items == list(np.diff(segment_bounds(sum(items), size))), (name, items)
                assert p.up[0][1] == p.down[r][1]
        need = max(-(-sum(n for _, n in p.down) // 64) * 64 + sum(n for _, n in p.up) for p in pieces)
        assert need <= chunk_bytes or all(n <= itemsize + itemsize for p in pieces[:-1] for _, n in p.down), name
        blocks = list(np.diff(src)) + list(np.diff(dst))
        if max(blocks) + itemsize <= (chunk_bytes - 64) // len(blocks):
            assert len(pieces) == 1, name          # what fits is one piece


@pytest.mark.parametrize("priority, eager", SCHEDULES)
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_blockwise_run_is_right_under_any_schedule(priority, eager, depth):
    """An allgather-like and an all-to-all-like run of three blocks: each piece's input is the
    device data of its sub-blocks, and its output lands at its sub-blocks of the result."""
    backend = SimBackend(priority, eager)
    pipe = gpu.HostStagingPipeline(100, depth, backend=backend)
    x = np.arange(37, dtype=np.int32) + 1
    for src, dst, bounds, host, want in (
            (x, np.zeros(3 * 37, np.int32), ([0, 148], [0, 148, 296, 444]), lambda a: np.tile(a, 3), np.tile(x, 3)),
            (np.tile(x, 3), np.zeros(3 * 37, np.int32), ([0, 148, 296, 444],) * 2, lambda a: -a, -np.tile(x, 3))):
        prepared = pipe.prepare(FakeCudaArray(src), FakeCudaArray(dst), bounds)
        seen = []

        def host_op(i):
            inp, out = prepared.views[i]
            seen.append(inp.copy())
            out[...] = host(inp)
        prepared.run(host_op)
        backend.synchronize_stream(backend.user)
        assert len(seen) > 3 and dst.tolist() == want.tolist()
        blocks = len(bounds[0]) - 1
        assert np.concatenate([c.reshape(blocks, -1) for c in seen], axis=1).reshape(-1).tolist() == src.tolist()
    assert backend.idle() and len(backend.allocated) == depth


def _blockwise_on_a_fake_gpu(comm, chunk_bytes, eager):
    """A rank's allgather, reduce_scatter and all-to-all of fake CUDA arrays piece by piece (pieces
    of a few items), blocking and queued non-blocking, with and without out=, uneven, empty and
    bfloat16: each result's bytes next to the numpy path's, the host runs each call made and the
    bytes it copied down and up."""
    backend = SimBackend(("h2d", "d2h", "user"), eager=eager)
    pipe = gpu.HostStagingPipeline(chunk_bytes, 2, backend=backend)
    runs = _stage_on(comm, pipe)
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(r)
    keep = []           # the host memory of DLPack arrays, alive until the calls ran

    def bf16(values):
        keep.append(values)
        return FakeDLPackCuda(values.ctypes.data, values.shape, code=4, bits=16, device=(2, 0))

    def host_of(dev):
        return dev.host if isinstance(dev, FakeCudaArray) else keep[-1]
    cases = []
    for count in (0, 1, 7, 50):
        for dtype in (np.int32, np.float64, np.float16):
            x = (rng.standard_normal(count * 3) * 100).astype(dtype).reshape(count, 3)
            cases.append(("allgather", x, np.zeros((count * n, 3), dtype), {}))
            cases.append(("alltoall", x.reshape(-1).repeat(n), np.zeros(count * 3 * n, dtype), {}))
    for count, op in ((0, "sum"), (1, "max"), (2 * n + 1, "sum"), (101, "avg"), (64, "min")):
        for dtype in (np.float32, np.float16, np.int64):
            y = (rng.standard_normal(count) * 100).astype(dtype)
            lo, hi = comm.segment_bounds(count)[r]
            cases.append(("reduce_scatter", y, np.zeros(hi - lo, dtype), {"op": op}))
    calls = []
    for blocking in (True, False):
        for given in (True, False):
            for kind, values, out, kw in cases:
                calls.append((kind, blocking, FakeCudaArray(values.copy()),
                              FakeCudaArray(out.copy()) if given else None, kw, values, out))
    got = {"bf16": [], "calls": []}
    pending = []
    for kind, blocking, dev, dev_out, kw, values, out in calls:
        before = (len(backend.copies), len(runs))
        if blocking:
            result = getattr(comm, kind)(dev, out=dev_out, **kw)
            moved = backend.copies[before[0]:]
            # (host runs, bytes down, bytes up)
            moved = (len(runs) - before[1], sum(b for d, b in moved if d == "d2h"),
                     sum(b for d, b in moved if d == "h2d"))
        else:       # queued: their copies and runs interleave
            result, moved = getattr(comm, "i" + kind)(dev, out=dev_out, **kw), None
        pending.append((kind, dev_out, kw, values, out, moved, result))
    # the queued calls done before this thread runs the simulated GPU again (it has one driver)
    pending = [p[:-1] + (p[-1] if p[-2] is not None else p[-1].wait(timeout=30),) for p in pending]
    backend.synchronize_stream(backend.user)
    for kind, dev_out, kw, values, out, moved, result in pending:
        want = getattr(comm, kind)(values, out=out.copy(), **kw)
        entry = [kind, values.dtype.str, values.size, moved is not None, dev_out is not None,
                 dev_out is None or result is dev_out, type(result).__name__, result.host.shape == want.shape,
                 result.host.tobytes() == want.tobytes()]
        if moved is not None:
            entry += [*moved, values.nbytes, want.nbytes]
        got["calls"].append(entry)
    # bfloat16 (DLPack): its bits go through, reduced as bfloat16
    bits = (rng.standard_normal(45).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    lo, hi = comm.segment_bounds(bits.size)[r]
    into = np.zeros(hi - lo, np.uint16)
    for given in (True, False):
        into[:] = 0
        result = comm.reduce_scatter(bf16(bits.copy()), out=bf16(into) if given else None, op="sum")
        host = into if given else result.host
        want = comm.reduce_scatter(bits, op="sum", dtype="bfloat16")
        got["bf16"].append((host.dtype.str, host.tobytes() == want.tobytes()))
    got["slots"] = [s.nbytes for s in pipe.host_slots(0)]
    return got


@pytest.mark.parametrize("size, chunk_bytes, eager", [(2, 96, False), (3, 48, True)])
def test_blockwise_calls_go_piece_by_piece_on_a_fake_gpu(size, chunk_bytes, eager):
    from test_collectives_world import World
    with World(size, "tcp", timeout=30.0) as w:
        results = w.run(_blockwise_on_a_fake_gpu, chunk_bytes, eager, timeout=120)
    for r, got in enumerate(results):
        for entry in got["calls"]:
            kind, dtype, count, blocking, given, same, kind_of, shape, equal = entry[:9]
            # bit for bit the numpy path's; out= given is what comes back; a new result is a device array of its shape
            assert equal and same and shape and kind_of == "FakeCudaArray", (r, entry)
            if blocking:
                pieces, down, up, nbytes_in, nbytes_out = entry[9:]
                assert (down, up) == (nbytes_in, nbytes_out), (r, entry)    # the input down once, the output up once
                # one host run per piece: several where the call outgrows a slot, one where it has no elements
                assert pieces > 1 if nbytes_in + nbytes_out > chunk_bytes else pieces >= 1, (r, entry)
                assert pieces == 1 or count, (r, entry)
        assert sum(1 for e in got["calls"] if len(e) > 9 and e[9] > 3) > 10      # several pieces, often
        assert got["bf16"] == [("<u2", True)] * 2, got["bf16"]
        # a piece of one item per block over three ranks needs more than 48 bytes: the slots grew
        assert all(n >= chunk_bytes for n in got["slots"]) and (size == 2) == (got["slots"] == [96, 96]), got["slots"]


# --------------------------------------------------------------------------------------------------
# RDMA device (rxe0 in the VM; no GPU needed): the probe and the fallback against the real binding
# --------------------------------------------------------------------------------------------------

@pytest.mark.device
def test_dmabuf_probe_on_a_real_device_is_cached(monkeypatch):
    calls = []
    real_probe = registration.probe_dmabuf
    monkeypatch.setattr(registration, "probe_dmabuf", lambda pd: calls.append(pd) or real_probe(pd))
    with rd.Context() as ctx:
        pd = rd.ProtectionDomain(ctx)
        first = gpu.nic_supports_dmabuf(pd)
        assert isinstance(first, bool)
        assert gpu.nic_supports_dmabuf(rd.ProtectionDomain(ctx)) is first
        assert len(calls) == 1


@pytest.mark.device
def test_real_dmabuf_failure_falls_back_to_plain_registration(monkeypatch, tmp_path):
    """Real ibv_reg_dmabuf_mr on a memfd (not a dma-buf) fails; the fd is closed and the fallback
    ibv_reg_mr goes through the real MemoryRegion.from_pointer (host memory standing in for the GPU)."""
    host = rd.aligned_empty(3 * PAGE)
    host[:] = 1
    ptr = host.ctypes.data
    exported = []

    class MemfdDriver(FakeDriver):
        def export_dmabuf(self, start, length, context=None, device_ordinal=None):
            fd = os.memfd_create("not-a-dmabuf")
            exported.append(fd)
            return fd

    (tmp_path / "sys/module/nvidia_peermem").mkdir(parents=True)
    monkeypatch.setattr(registration, "cuda_driver",
                        lambda: MemfdDriver(ranges={(ptr, ptr + 3 * PAGE): DEVICE_INFO}))
    monkeypatch.setattr(registration, "nic_supports_dmabuf", lambda pd: True)
    arr = FakeCudaArray(host)
    with rd.Context() as ctx:
        pd = rd.ProtectionDomain(ctx)
        mr = gpu.register_gpu_array(pd, arr, rd.ACCESS_LOCAL_WRITE | rd.ACCESS_REMOTE_WRITE,
                                    sysfs_root=str(tmp_path))
        assert mr.addr == ptr and mr.length == 3 * PAGE and mr.buffer is arr and mr.is_device_memory
        assert gpu.gpu_array_offset(mr, arr) == 0
        mr.close()
    assert len(exported) == 1
    with pytest.raises(OSError):
        os.fstat(exported[0])


# --------------------------------------------------------------------------------------------------
# On a GPU (skipped without CuPy and a GPU)
# --------------------------------------------------------------------------------------------------

GPU_DTYPES = ["int8", "uint8", "int32", "int64", "float16", "float32", "float64"]


def _reference(op, a, b):
    with np.errstate(over="ignore"):
        return {"sum": a + b, "avg": a + b, "prod": a * b, "min": np.minimum(a, b), "max": np.maximum(a, b)}[op]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("op", ["sum", "prod", "min", "max", "avg"])
def test_gpu_reduce_into_matches_numpy(op, dtype):
    import cupy as cp
    rng = np.random.default_rng(1)
    a = (rng.integers(-50, 50, 10001) if np.dtype(dtype).kind == "i" else rng.integers(0, 100, 10001)).astype(dtype)
    b = (rng.integers(-50, 50, 10001) if np.dtype(dtype).kind == "i" else rng.integers(0, 100, 10001)).astype(dtype)
    if np.dtype(dtype).kind == "f":
        a[5], b[7] = np.nan, np.nan
    d, s = cp.asarray(a), cp.asarray(b)
    stream = cp.cuda.Stream(non_blocking=True)
    assert gpu.reduce_into(d, s, op, stream=stream) is d
    stream.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(d), _reference(op, a, b))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["int8", "float16", "float32", "float64"])
@pytest.mark.parametrize("dst_at, src_at", [(1, 1), (0, 1), (1, 0), (3, 5)])
def test_gpu_reduce_into_unaligned_views(dtype, dst_at, src_at):
    """Views that start off the kernel's 16-byte vector boundary (scripts/gpu.sh also runs this under
    compute-sanitizer's memcheck): the result is numpy's, and nothing outside the views changes."""
    import cupy as cp
    n = 4099
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, 100, n + 8).astype(dtype), rng.integers(0, 100, n + 8).astype(dtype)
    d, s = cp.asarray(a), cp.asarray(b)
    gpu.reduce_into(d[dst_at:dst_at + n], s[src_at:src_at + n], "sum")
    cp.cuda.Device().synchronize()
    expected = a.copy()
    expected[dst_at:dst_at + n] = _reference("sum", a[dst_at:dst_at + n], b[src_at:src_at + n])
    np.testing.assert_array_equal(cp.asnumpy(d), expected)
    np.testing.assert_array_equal(cp.asnumpy(s), b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_finalize_avg(dtype):
    import cupy as cp
    a = np.arange(-20, 20).astype(dtype) if np.dtype(dtype).kind == "i" else np.arange(40).astype(dtype)
    d = cp.asarray(a)
    gpu.finalize_avg(d, 3)
    expected = (np.trunc(a.astype(np.float64) / 3) if a.dtype.kind in "iu" else a / np.array(3, a.dtype))
    np.testing.assert_array_equal(cp.asnumpy(d), expected.astype(dtype))


@pytest.mark.gpu
def test_gpu_reduce_into_errors():
    import cupy as cp
    with pytest.raises(rd.UsageError, match="dtypes differ"):
        gpu.reduce_into(cp.zeros(4, cp.float32), cp.zeros(4, cp.float64))
    with pytest.raises(rd.UsageError, match="sizes differ"):
        gpu.reduce_into(cp.zeros(4), cp.zeros(5))
    with pytest.raises(rd.UsageError, match="not supported"):
        gpu.reduce_into(cp.zeros(4, cp.complex64), cp.zeros(4, cp.complex64))
    with pytest.raises(rd.UsageError, match="numpy array"):
        gpu.reduce_into(np.zeros(4), np.zeros(4))
    d = cp.ones((2, 3), cp.float32)
    gpu.reduce_into(d, cp.ones(6, cp.float32))            # same size, both contiguous
    assert float(d.sum()) == 12.0


@pytest.mark.gpu
@pytest.mark.parametrize("nbytes", [8, 4 << 20, (4 << 20) * 3 + 1000 * 8])
def test_gpu_host_staging_pipeline(nbytes):
    import cupy as cp
    x = cp.arange(nbytes // 8, dtype=cp.float64)
    stream = cp.cuda.Stream(non_blocking=True)
    with gpu.HostStagingPipeline(1 << 20, 3) as pipe:
        with stream:
            x *= 2                                         # producer on the caller's stream
        pipe.run(x, lambda c: c.__iadd__(1), stream=stream)
        stream.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(x), np.arange(nbytes // 8) * 2.0 + 1)


@pytest.mark.gpu
def test_gpu_dmabuf_export_of_cupy_memory():
    """The dma-buf half of GPUDirect, which needs no NIC: export a CuPy array's pages as a dma-buf."""
    import cupy as cp
    x = cp.arange(3 * PAGE // 4 + 5, dtype=cp.float32)[1:]      # not page aligned at either end
    drv = gpu.cuda_driver()
    info = drv.pointer_info(x.data.ptr)
    assert info.memory_type == _driver.CU_MEMORYTYPE_DEVICE and not info.is_managed
    assert info.device_ordinal == x.device.id
    start, length = gpu.dmabuf_range(x.data.ptr, x.nbytes)
    if not drv.dmabuf_supported(info.device_ordinal):
        with pytest.raises(rd.RDMAError, match="cuMemGetHandleForAddressRange"):
            drv.export_dmabuf(start, length, info.context, info.device_ordinal)
        pytest.xfail("this GPU's driver does not export dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0)")
    fd = drv.export_dmabuf(start, length, info.context, info.device_ordinal)
    try:
        assert fd >= 0
        # a dma-buf's size is where lseek(SEEK_END) lands: the whole page-aligned range
        assert os.lseek(fd, 0, os.SEEK_END) == length
    finally:
        os.close(fd)
    # memory with no context of its own (a CuPy memory pool in async mode, cuMemMap) uses the primary one
    fd = drv.export_dmabuf(start, length, None, info.device_ordinal)
    os.close(fd)


@pytest.mark.gpu
@pytest.mark.device
def test_gpu_register_cupy_array():
    import cupy as cp
    x = cp.zeros(1 << 20, cp.float32)
    with rd.Context() as ctx:
        pd = rd.ProtectionDomain(ctx)
        status = gpu.gpudirect_status(pd, x.device.id)
        if status.method is None:
            with pytest.raises(rd.RDMAError, match="cannot register GPU memory"):
                gpu.register_gpu_array(pd, x)
            return
        mr = gpu.register_gpu_array(pd, x, rd.ACCESS_LOCAL_WRITE | rd.ACCESS_REMOTE_WRITE)
        assert mr.is_device_memory and mr.buffer is x
        assert mr.addr <= x.data.ptr and gpu.gpu_array_offset(mr, x) + x.nbytes <= mr.length
        mr.close()


# --------------------------------------------------------------------------------------------------
# gpu_path "direct" over RDMA: the transport's GPU work area (registration and stream sync), faked
# --------------------------------------------------------------------------------------------------

class FakeGpuBytes:
    """A flat uint8 CuPy-like array: an address and a length, sliceable."""

    def __init__(self, ptr, nbytes):
        self.data = type("MemoryPointer", (), {"ptr": ptr})()
        self.nbytes = nbytes

    def __getitem__(self, key):
        start, stop, _ = key.indices(self.nbytes)
        return FakeGpuBytes(self.data.ptr + start, stop - start)


def test_rdma_transport_registers_a_gpu_work_area_once_and_syncs_before_sending(monkeypatch):
    # the GPU memory comes with its kind (pyrdma.cuda's DirectArea): the transport registers and
    # syncs through it, never importing pyrdma.cuda itself
    import types
    from pyrdma.collectives import transport as tr
    from pyrdma.collectives.work import HOST
    from pyrdma.cuda import collectives as gcoll, registration
    registered, synced, closed = [], [], []

    class FakeMR:
        def close(self):
            closed.append(self)

    monkeypatch.setattr(registration, "register_gpu_array",
                        lambda pd, arr, access: registered.append((pd, arr, access)) or FakeMR())
    monkeypatch.setattr(registration, "gpu_array_offset", lambda mr, arr: 96)     # dma-buf MRs start at a page
    device = object.__new__(gcoll.DirectArea)
    stream = types.SimpleNamespace(synchronize=lambda: synced.append(1))
    device.cp = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=lambda: stream))
    t = object.__new__(tr.RdmaTransport)       # just the state work_area touches
    t.pd, t._user_mrs, t._sync, t._parked = "pd", collections.OrderedDict(), None, {}
    t._own, t._own_mr = np.zeros(64, np.uint8), "own MR"        # buffer() goes back to it
    whole = FakeGpuBytes(0x7f0000010000, 8192)
    with pytest.raises(rd.UsageError, match="is not host memory; it needs its kind"):
        t.work_area(200, whole, 100)
    t.work_area(200, whole, 100, device)
    assert registered == [("pd", whole, 0)]              # local read only: it is sent from
    assert t._work_offset == 96 + 100 and t._work.nbytes == 200 and t._work_mr is not t._own_mr
    t._sync()
    assert synced == [1]
    t.buffer(0)
    assert t._sync is HOST.sync and t._work_mr == "own MR"
    t.work_area(8, whole[1024:2048], 8, device)        # inside the cached registration: no new one
    assert len(registered) == 1 and t._work_offset == 96 + 1024 + 8
    for i in range(tr.USER_MR_CACHE):                    # the cache keeps the most recent few
        t.work_area(4096, FakeGpuBytes(0x7f1000000000 + i * 65536, 4096), 0, device)
    assert len(registered) == 1 + tr.USER_MR_CACHE and len(closed) == 1
