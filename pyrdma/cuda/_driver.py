"""The few CUDA driver calls pyrdma needs, through ctypes on libcuda.so.1 (no build-time dependency).

Also the one place that imports CuPy, so that a missing CuPy is reported the same way everywhere.
"""
import ctypes
import threading
from collections import namedtuple

from pyrdma.errors import RDMAError

LIBCUDA = "libcuda.so.1"

# cuda.h enums (stable ABI values)
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_NOT_SUPPORTED = 801
CU_POINTER_ATTRIBUTE_CONTEXT = 1
CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
CU_POINTER_ATTRIBUTE_IS_MANAGED = 8
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_MEMORYTYPE_HOST = 1
CU_MEMORYTYPE_DEVICE = 2
CU_MEMORYTYPE_ARRAY = 3
CU_MEMORYTYPE_UNIFIED = 4
CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124
CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1

MEMORY_TYPE_NAMES = {CU_MEMORYTYPE_HOST: "host", CU_MEMORYTYPE_DEVICE: "device",
                     CU_MEMORYTYPE_ARRAY: "array", CU_MEMORYTYPE_UNIFIED: "unified"}

PointerInfo = namedtuple("PointerInfo", "memory_type is_managed device_ordinal context")
PointerInfo.__doc__ = "What the CUDA driver knows about a pointer (CU_POINTER_ATTRIBUTE_*)."


class CudaDriver:
    """ctypes binding of the driver calls used for GPU memory registration.

    The interface (``pointer_info``, ``dmabuf_supported``, ``export_dmabuf``) is all the
    registration code uses, so tests can stand in a fake with the same three methods.
    """

    def __init__(self, libname=LIBCUDA):
        try:
            self._lib = ctypes.CDLL(libname)
        except OSError as exc:
            raise RDMAError(f"cannot load the CUDA driver library {libname} ({exc}); "
                            f"GPU memory needs the NVIDIA driver installed", call="dlopen") from None
        self._lock = threading.Lock()
        self._dmabuf_by_device = {}
        self._check(self._fn("cuInit")(ctypes.c_uint(0)), "cuInit")

    def _fn(self, name):
        try:
            fn = getattr(self._lib, name)
        except AttributeError:
            raise RDMAError(f"the CUDA driver has no {name}; it is too old for this feature "
                            f"(dma-buf export needs CUDA driver 11.7 or newer)", call=name) from None
        fn.restype = ctypes.c_int
        return fn

    def error_text(self, result):
        name = ctypes.c_char_p()
        text = ctypes.c_char_p()
        try:
            self._fn("cuGetErrorName")(ctypes.c_int(result), ctypes.byref(name))
            self._fn("cuGetErrorString")(ctypes.c_int(result), ctypes.byref(text))
        except RDMAError:
            pass
        n = name.value.decode() if name.value else f"CUresult {result}"
        return f"{n}: {text.value.decode()}" if text.value else n

    def _check(self, result, call, obj=None):
        if result != CUDA_SUCCESS:
            raise RDMAError(self.error_text(result), call=call, obj=obj)

    def _pointer_attribute(self, ctype, attribute, ptr):
        value = ctype()
        rc = self._fn("cuPointerGetAttribute")(ctypes.byref(value), ctypes.c_int(attribute),
                                              ctypes.c_uint64(ptr))
        return rc, value.value

    def pointer_info(self, ptr):
        """PointerInfo for ``ptr``; UsageError-worthy pointers come back as RDMAError with errno None."""
        rc, memory_type = self._pointer_attribute(ctypes.c_uint, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
        if rc == CUDA_ERROR_INVALID_VALUE:
            # CUDA does not know the address: plain host memory (or garbage)
            return PointerInfo(None, False, -1, None)
        self._check(rc, "cuPointerGetAttribute", f"pointer 0x{ptr:x}")
        rc, managed = self._pointer_attribute(ctypes.c_uint, CU_POINTER_ATTRIBUTE_IS_MANAGED, ptr)
        self._check(rc, "cuPointerGetAttribute", f"pointer 0x{ptr:x}")
        rc, ordinal = self._pointer_attribute(ctypes.c_int, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
        self._check(rc, "cuPointerGetAttribute", f"pointer 0x{ptr:x}")
        rc, context = self._pointer_attribute(ctypes.c_void_p, CU_POINTER_ATTRIBUTE_CONTEXT, ptr)
        self._check(rc, "cuPointerGetAttribute", f"pointer 0x{ptr:x}")
        return PointerInfo(memory_type, bool(managed), ordinal, context)

    def dmabuf_supported(self, device_ordinal):
        """CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED of a GPU (cached per device, as NCCL does)."""
        with self._lock:
            if device_ordinal in self._dmabuf_by_device:
                return self._dmabuf_by_device[device_ordinal]
        device = self._device(device_ordinal)
        flag = ctypes.c_int(0)
        rc = self._fn("cuDeviceGetAttribute")(ctypes.byref(flag),
                                              ctypes.c_int(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED), device)
        # an old driver does not know attribute 124 (CUDA_ERROR_INVALID_VALUE): no dma-buf there
        supported = rc == CUDA_SUCCESS and flag.value != 0
        with self._lock:
            self._dmabuf_by_device[device_ordinal] = supported
        return supported

    def _device(self, device_ordinal):
        device = ctypes.c_int()
        self._check(self._fn("cuDeviceGet")(ctypes.byref(device), ctypes.c_int(device_ordinal)),
                    "cuDeviceGet", f"GPU {device_ordinal}")
        return device

    def export_dmabuf(self, start, length, context=None, device_ordinal=None):
        """A dma-buf fd for the device range [start, start+length) (both host-page aligned).

        The caller owns (and must close) the fd. ``context`` is the CUcontext owning the memory
        (from pointer_info); it is made current for the call, so no CUDA context needs to be
        current in the calling thread. Memory with no context of its own (cuMemCreate/cuMemMap,
        memory pools) uses the primary context of ``device_ordinal``.
        """
        get_handle = self._fn("cuMemGetHandleForAddressRange")
        fd = ctypes.c_int(-1)
        retained = None
        if not context and device_ordinal is not None and device_ordinal >= 0:
            retained = self._device(device_ordinal)
            primary = ctypes.c_void_p()
            self._check(self._fn("cuDevicePrimaryCtxRetain")(ctypes.byref(primary), retained),
                        "cuDevicePrimaryCtxRetain", f"GPU {device_ordinal}")
            context = primary.value
        pushed = False
        try:
            if context:
                self._check(self._fn("cuCtxPushCurrent_v2")(ctypes.c_void_p(context)), "cuCtxPushCurrent")
                pushed = True
            # flags 0: the default mapping (NCCL asks for CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE
            # only on systems where the GPU is also attached over C2C)
            rc = get_handle(ctypes.byref(fd), ctypes.c_uint64(start), ctypes.c_size_t(length),
                            ctypes.c_int(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD), ctypes.c_ulonglong(0))
        finally:
            if pushed:
                popped = ctypes.c_void_p()
                self._fn("cuCtxPopCurrent_v2")(ctypes.byref(popped))
            if retained is not None:
                self._fn("cuDevicePrimaryCtxRelease_v2")(retained)
        self._check(rc, "cuMemGetHandleForAddressRange", f"range 0x{start:x}+{length}")
        return fd.value


_driver_lock = threading.Lock()
_driver_instance = None


def cuda_driver():
    """The process-wide CudaDriver (loaded on first use; RDMAError if libcuda is missing)."""
    global _driver_instance
    with _driver_lock:
        if _driver_instance is None:
            _driver_instance = CudaDriver()
        return _driver_instance


def import_cupy(feature):
    """Import CuPy for ``feature`` or raise RDMAError saying it is missing and how to get it."""
    try:
        import cupy
    except ImportError as exc:
        raise RDMAError(f"{feature} needs CuPy, which is not importable ({exc}); install the wheel for "
                        f"your CUDA version, e.g. `pip install cupy-cuda12x` (pyrdma[cuda])",
                        call="import cupy") from None
    return cupy
