"""Registering GPU memory for RDMA (GPUDirect RDMA): dma-buf first, nvidia-peermem as the fallback.

The order follows NCCL: when both the RDMA device (an ``ibv_reg_dmabuf_mr`` probe with fd -1, made
once per Context) and the GPU (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED) support dma-buf, the
page-aligned range holding the buffer is exported with ``cuMemGetHandleForAddressRange`` and
registered with ``ibv_reg_dmabuf_mr`` (iova = the range's virtual address, so work requests use
the buffer's own device pointers); the fd is closed once registered. Otherwise, when the
nvidia-peermem (or legacy nv_peer_mem) kernel module is loaded, the device pointer goes to plain
``ibv_reg_mr``. When neither works, RDMAError says why for each path.
"""
import os
import threading
import weakref
from collections import namedtuple

from pyrdma.errors import RDMAError, UsageError
from pyrdma._verbs.mr import (MemoryRegion, probe_dmabuf, ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE,
                              ACCESS_REMOTE_ATOMIC)
from pyrdma.cuda import _driver
from pyrdma.cuda._driver import cuda_driver
from pyrdma.cuda.buffers import device_buffer

_WRITE_BITS = ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE | ACCESS_REMOTE_ATOMIC

# Where a loaded peer-memory client shows in sysfs (nvidia-peermem, and the older Mellanox nv_peer_mem).
PEERMEM_PATHS = ("sys/module/nvidia_peermem", "sys/module/nv_peer_mem",
                 "sys/kernel/mm/memory_peers/nv_mem/version", "sys/kernel/mm/memory_peers/nv_mem_nc/version")
METHODS = ("auto", "dmabuf", "peermem")

GPUDirectStatus = namedtuple("GPUDirectStatus", "nic_dmabuf gpu_dmabuf peermem method")
GPUDirectStatus.__doc__ = ("What GPUDirect RDMA can use here: ``nic_dmabuf``/``gpu_dmabuf`` bools, ``peermem`` "
                           "the sysfs path of the loaded module or None, ``method`` 'dmabuf', 'peermem' or None.")


def host_page_size():
    return os.sysconf("SC_PAGESIZE")


def dmabuf_range(ptr, nbytes, page_size=None):
    """(start, length) of the smallest host-page-aligned range holding [ptr, ptr+nbytes).

    cuMemGetHandleForAddressRange wants both ends aligned to the host page size, and the MR
    then covers whole pages, as NCCL registers them.
    """
    page = page_size or host_page_size()
    if page <= 0 or page & (page - 1):
        raise UsageError(f"page size must be a power of two, got {page}")
    if nbytes <= 0:
        raise UsageError("cannot register an empty range")
    start = ptr & ~(page - 1)
    end = (ptr + nbytes + page - 1) & ~(page - 1)
    return start, end - start


def peermem_module(sysfs_root="/"):
    """The sysfs path showing a loaded nvidia-peermem / nv_peer_mem module, or None."""
    for rel in PEERMEM_PATHS:
        path = os.path.join(sysfs_root, rel)
        if os.path.exists(path):
            return path
    return None


_probe_lock = threading.Lock()
_nic_dmabuf_by_context = weakref.WeakKeyDictionary()


def nic_supports_dmabuf(pd):
    """Whether the RDMA device of ``pd`` implements ibv_reg_dmabuf_mr; probed once per Context."""
    ctx = pd.context
    with _probe_lock:
        cached = _nic_dmabuf_by_context.get(ctx)
    if cached is not None:
        return cached
    supported = bool(probe_dmabuf(pd))
    with _probe_lock:
        _nic_dmabuf_by_context[ctx] = supported
    return supported


def gpudirect_status(pd, device_ordinal=0, sysfs_root="/"):
    """GPUDirectStatus for RDMA device ``pd.context`` and GPU ``device_ordinal``.

    Collectives can use it to pick registration (``method`` not None) or host staging.
    """
    nic = nic_supports_dmabuf(pd)
    try:
        gpu = cuda_driver().dmabuf_supported(device_ordinal)
    except RDMAError:
        gpu = False
    module = peermem_module(sysfs_root)
    method = "dmabuf" if nic and gpu else ("peermem" if module else None)
    return GPUDirectStatus(nic, gpu, module, method)


def register_gpu_array(pd, array, access=ACCESS_LOCAL_WRITE, method="auto", sysfs_root="/"):
    """Register the GPU memory of ``array`` (CuPy, or any __cuda_array_interface__/DLPack CUDA object).

    ``method``: "auto" (dma-buf, then nvidia-peermem), "dmabuf" or "peermem" only.
    Returns a MemoryRegion that keeps ``array`` alive. With dma-buf the region covers the whole
    host pages around the array, so ``mr.addr`` may be below the array: its data sits at
    ``gpu_array_offset(mr, array)`` within the region (and at its own device address for remote
    peers, since the iova is the virtual address).
    """
    if method not in METHODS:
        raise UsageError(f"method must be one of {METHODS}, got {method!r}")
    buf = device_buffer(array)
    if buf.readonly and access & _WRITE_BITS:
        raise UsageError("the GPU array is read-only, but the access flags ask for write access")
    drv = cuda_driver()
    info = drv.pointer_info(buf.ptr)
    where = f"{buf.nbytes} bytes at 0x{buf.ptr:x}"
    if info.memory_type is None:
        raise UsageError(f"{where} is not memory the CUDA driver knows")
    if info.is_managed or info.memory_type == _driver.CU_MEMORYTYPE_UNIFIED:
        raise UsageError(f"{where} is CUDA managed memory, which GPUDirect RDMA cannot register; "
                         f"use device memory (cudaMalloc, CuPy's default allocator) or stage through the host")
    if info.memory_type != _driver.CU_MEMORYTYPE_DEVICE:
        kind = _driver.MEMORY_TYPE_NAMES.get(info.memory_type, str(info.memory_type))
        raise UsageError(f"{where} is CUDA {kind} memory, not device memory; register pinned host memory "
                         f"with pyrdma.MemoryRegion (or MemoryRegion.from_pointer)")

    reasons = []
    last_errno = None
    if method in ("auto", "dmabuf"):
        if not nic_supports_dmabuf(pd):
            reasons.append(f"RDMA device {pd.context.name} does not support dma-buf "
                           f"(ibv_reg_dmabuf_mr probe)")
        elif not drv.dmabuf_supported(info.device_ordinal):
            reasons.append(f"GPU {info.device_ordinal} cannot export dma-buf "
                           f"(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0; it needs the open GPU kernel modules)")
        else:
            try:
                return _register_dmabuf(pd, drv, buf, info, access, array)
            except RDMAError as exc:
                reasons.append(f"dma-buf registration failed: {exc}")
                last_errno = exc.errno
    if method in ("auto", "peermem"):
        module = peermem_module(sysfs_root)
        if module is None:
            reasons.append("the nvidia-peermem module is not loaded (no " +
                           ", ".join("/" + p for p in PEERMEM_PATHS[:2]) + ")")
        if module is not None or method == "peermem":
            try:
                return MemoryRegion.from_pointer(pd, buf.ptr, buf.nbytes, access, owner=array)
            except RDMAError as exc:
                reasons.append(f"ibv_reg_mr of the device pointer failed: {exc}")
                last_errno = exc.errno
    err = RDMAError("cannot register GPU memory for RDMA: " + "; ".join(reasons) +
                    ". Load nvidia-peermem (modprobe nvidia-peermem), use a dma-buf capable NIC and GPU "
                    "driver, or stage through host memory (pyrdma.cuda.HostStagingPipeline)",
                    call="register_gpu_array", obj=f"{where} on GPU {info.device_ordinal}")
    err.errno = last_errno     # set after: the reasons above already spell the errno out
    raise err


def _register_dmabuf(pd, drv, buf, info, access, owner):
    start, length = dmabuf_range(buf.ptr, buf.nbytes)
    fd = drv.export_dmabuf(start, length, info.context, info.device_ordinal)
    try:
        # the dma-buf covers exactly [start, start+length): offset 0 in it, iova = its virtual address
        return MemoryRegion.from_dmabuf(pd, fd, 0, length, start, access, owner=owner)
    finally:
        # the MR holds its own reference to the dma-buf; the fd is no longer needed
        os.close(fd)


def gpu_array_offset(mr, array):
    """Byte offset of ``array``'s data inside ``mr`` (for SGEs and post_* offsets)."""
    buf = device_buffer(array)
    offset = buf.ptr - mr.addr
    if offset < 0 or offset + buf.nbytes > mr.length:
        raise UsageError(f"the array ({buf.nbytes} bytes at 0x{buf.ptr:x}) is not inside {mr!r}")
    return offset
