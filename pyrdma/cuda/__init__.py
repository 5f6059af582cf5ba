"""GPU buffers for pyrdma: GPUDirect RDMA registration, CUDA reductions, host staging.

CuPy is optional. Importing this package needs neither CuPy nor a GPU; each function that needs one
raises RDMAError naming what is missing (``call="import cupy"`` or ``call="dlopen"`` for libcuda).

- ``register_gpu_array(pd, array, access)``: MemoryRegion over GPU memory (dma-buf, else nvidia-peermem);
  ``gpudirect_status(pd)`` says which will be used; ``gpu_array_offset(mr, array)``.
  Needs libcuda.so.1, not CuPy.
- ``reduce_into(dst, src, op, stream)`` / ``finalize_avg(dst, count)``: CUDA reduction kernels (CuPy).
- ``HostStagingPipeline`` / ``staged_allreduce(comm, array, op)``: chunked device<->pinned-host staging
  overlapped with a host-side collective, for when GPUDirect RDMA is unavailable (CuPy).
- ``device_buffer(obj)`` / ``is_cuda_array(obj)``: pointer, size and device of any
  ``__cuda_array_interface__`` or DLPack object (no CuPy needed).
"""
from pyrdma.cuda._driver import CudaDriver, cuda_driver
from pyrdma.cuda.buffers import DeviceBuffer, device_buffer, is_cuda_array
from pyrdma.cuda.registration import (GPUDirectStatus, dmabuf_range, gpu_array_offset, gpudirect_status,
                                      nic_supports_dmabuf, peermem_module, register_gpu_array)
from pyrdma.cuda.reduce import REDUCE_DTYPES, REDUCE_OPS, finalize_avg, reduce_into
from pyrdma.cuda.staging import (DEFAULT_CHUNK_BYTES, DEFAULT_DEPTH, CupyStagingBackend, HostStagingPipeline,
                                 chunk_spans, default_pipeline, staged_allreduce)


def cupy_available():
    """True when CuPy imports and sees at least one GPU (what the GPU paths need)."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:    # ImportError, or CUDARuntimeError without a driver/GPU
        return False


__all__ = ["CudaDriver", "cuda_driver", "DeviceBuffer", "device_buffer", "is_cuda_array", "GPUDirectStatus",
           "dmabuf_range", "gpu_array_offset", "gpudirect_status", "nic_supports_dmabuf", "peermem_module",
           "register_gpu_array", "REDUCE_DTYPES", "REDUCE_OPS", "finalize_avg", "reduce_into",
           "DEFAULT_CHUNK_BYTES", "DEFAULT_DEPTH", "CupyStagingBackend", "HostStagingPipeline", "chunk_spans",
           "default_pipeline", "staged_allreduce", "cupy_available"]
