"""Where a GPU array's memory is: parsing ``__cuda_array_interface__`` and DLPack without CuPy.

``device_buffer(obj)`` turns a CuPy array, a PyTorch CUDA tensor, a Numba device array or any other
object exporting either protocol into a ``DeviceBuffer`` (pointer, byte length, dtype, device).
It reads the DLPack capsule with ctypes and does not consume it: the capsule's own destructor
releases the producer's reference, while the memory stays owned by ``obj``.
"""
import ctypes
from dataclasses import dataclass

import numpy as np

from pyrdma.errors import UsageError

# DLPack DLDeviceType values (dlpack.h)
DL_CPU = 1
DL_CUDA = 2
DL_CUDA_HOST = 3
DL_ROCM = 10
DL_ROCM_HOST = 11
DL_CUDA_MANAGED = 13
DEVICE_TYPE_NAMES = {DL_CPU: "cpu", DL_CUDA: "cuda", DL_CUDA_HOST: "cuda_host", DL_ROCM: "rocm",
                     DL_ROCM_HOST: "rocm_host", DL_CUDA_MANAGED: "cuda_managed"}
# DLDataTypeCode values
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BFLOAT, _DL_COMPLEX, _DL_BOOL = 0, 1, 2, 4, 5, 6
_DL_FLAG_READ_ONLY = 1
# dtypes numpy lacks, by the numpy dtype that holds their bits (collectives move and stage those)
BIT_TWINS = {"bfloat16": np.dtype(np.uint16)}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_is_valid.restype = ctypes.c_int
_capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_get_pointer.restype = ctypes.c_void_p


@dataclass(frozen=True)
class DeviceBuffer:
    """The memory behind an array-like object.

    ``ptr``/``nbytes``: the contiguous byte range; ``dtype`` a numpy dtype, or None for a type numpy
    lacks (``dtype_name`` then says which, e.g. "bfloat16"); ``device_type`` "cuda", "cuda_managed",
    "cuda_host", "cpu", ...; ``device_id`` the GPU ordinal (None when the protocol does not say:
    ``__cuda_array_interface__`` has no device field); ``interface`` which protocol was read.
    """
    ptr: int
    nbytes: int
    shape: tuple
    dtype: object
    dtype_name: str
    device_type: str
    device_id: object
    itemsize: int
    readonly: bool
    interface: str


def _prod(shape):
    n = 1
    for s in shape:
        n *= int(s)
    return n


def is_c_contiguous(shape, strides, itemsize):
    """True when byte ``strides`` (None = C order) describe a C-contiguous layout of ``shape``."""
    if strides is None:
        return True
    if len(strides) != len(shape):
        return False
    if _prod(shape) == 0:
        return True
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def _dtype_from_typestr(typestr):
    try:
        dt = np.dtype(typestr)
    except TypeError:
        raise UsageError(f"__cuda_array_interface__ typestr {typestr!r} is not a dtype numpy knows") from None
    return dt, dt.name


def _parse_cuda_array_interface(cai):
    if not isinstance(cai, dict) or "data" not in cai or "shape" not in cai or "typestr" not in cai:
        raise UsageError("__cuda_array_interface__ must be a dict with data, shape and typestr")
    if cai.get("mask") is not None:
        raise UsageError("masked __cuda_array_interface__ arrays are not supported")
    ptr, readonly = cai["data"]
    shape = tuple(int(s) for s in cai["shape"])
    dtype, name = _dtype_from_typestr(cai["typestr"])
    strides = cai.get("strides")
    if not is_c_contiguous(shape, None if strides is None else tuple(strides), dtype.itemsize):
        raise UsageError(f"the CUDA array is not C-contiguous (shape {shape}, strides {tuple(strides)}); "
                         f"pass a contiguous copy (e.g. cupy.ascontiguousarray)")
    return DeviceBuffer(ptr=int(ptr or 0), nbytes=_prod(shape) * dtype.itemsize, shape=shape, dtype=dtype,
                        dtype_name=name, device_type="cuda", device_id=None, itemsize=dtype.itemsize,
                        readonly=bool(readonly),
                        interface="cuda_array_interface")


def _dl_dtype(dl):
    bits = dl.bits * max(1, dl.lanes)
    if dl.lanes > 1:
        return None, f"vector<{dl.code},{dl.bits}x{dl.lanes}>", (bits + 7) // 8
    kinds = {_DL_INT: "i", _DL_UINT: "u", _DL_FLOAT: "f", _DL_COMPLEX: "c"}
    if dl.code in kinds and dl.bits % 8 == 0:
        try:
            dt = np.dtype(f"{kinds[dl.code]}{dl.bits // 8}")
            return dt, dt.name, dt.itemsize
        except TypeError:
            pass
    if dl.code == _DL_BOOL and dl.bits == 8:
        return np.dtype(np.bool_), "bool", 1
    if dl.code == _DL_BFLOAT and dl.bits == 16:
        return None, "bfloat16", 2
    return None, f"dlpack<code={dl.code},bits={dl.bits}>", (dl.bits + 7) // 8


def parse_dlpack_capsule(capsule):
    """DeviceBuffer described by a DLPack capsule ("dltensor" or "dltensor_versioned"), not consumed."""
    flags = 0
    if _capsule_is_valid(capsule, b"dltensor"):
        managed = ctypes.cast(_capsule_get_pointer(capsule, b"dltensor"),
                              ctypes.POINTER(_DLManagedTensor)).contents
        tensor = managed.dl_tensor
    elif _capsule_is_valid(capsule, b"dltensor_versioned"):
        managed = ctypes.cast(_capsule_get_pointer(capsule, b"dltensor_versioned"),
                              ctypes.POINTER(_DLManagedTensorVersioned)).contents
        if managed.version.major != 1:
            raise UsageError(f"DLPack major version {managed.version.major} is not supported (only 1)")
        tensor = managed.dl_tensor
        flags = managed.flags
    else:
        raise UsageError("__dlpack__() did not return an unconsumed DLPack capsule")
    ndim = tensor.ndim
    shape = tuple(int(tensor.shape[i]) for i in range(ndim))
    dtype, name, itemsize = _dl_dtype(tensor.dtype)
    if tensor.strides:
        strides = tuple(int(tensor.strides[i]) * itemsize for i in range(ndim))   # DLPack counts elements
        if not is_c_contiguous(shape, strides, itemsize):
            raise UsageError(f"the DLPack tensor is not C-contiguous (shape {shape}, element strides "
                             f"{tuple(int(tensor.strides[i]) for i in range(ndim))}); pass a contiguous copy")
    device_type = tensor.device.device_type
    return DeviceBuffer(ptr=(tensor.data or 0) + tensor.byte_offset, nbytes=_prod(shape) * itemsize,
                        shape=shape, dtype=dtype, dtype_name=name,
                        device_type=DEVICE_TYPE_NAMES.get(device_type, f"dlpack-device-{device_type}"),
                        device_id=int(tensor.device.device_id), itemsize=itemsize,
                        readonly=bool(flags & _DL_FLAG_READ_ONLY), interface="dlpack")


def _cuda_array_interface(obj):
    try:
        return obj.__cuda_array_interface__
    except (AttributeError, TypeError):
        # a PyTorch CPU tensor raises AttributeError from the property, a bfloat16 CUDA one TypeError
        # (the protocol has no typestr for it): DLPack describes both
        return None


def dlpack_device(obj):
    """``obj.__dlpack_device__()`` as (device_type, device_id), or None when obj has no DLPack."""
    fn = getattr(obj, "__dlpack_device__", None)
    if fn is None:
        return None
    device_type, device_id = fn()
    return int(device_type), int(device_id)


def is_cuda_array(obj):
    """True for objects whose memory is on a CUDA GPU (device or managed), without importing CuPy."""
    if isinstance(obj, np.ndarray):
        return False
    if _cuda_array_interface(obj) is not None:
        return True
    try:
        dev = dlpack_device(obj)
    except Exception:
        return False
    return dev is not None and dev[0] in (DL_CUDA, DL_CUDA_MANAGED)


def device_buffer(obj, require_cuda=True, allow_empty=False):
    """Describe the memory of ``obj`` through ``__cuda_array_interface__`` (preferred) or DLPack.

    With ``require_cuda`` (the default) anything not in CUDA device or managed memory is a UsageError;
    so are non-contiguous arrays, and empty ones unless ``allow_empty``. A DLPack exporter that also reports its device has it
    checked before the capsule is made.
    """
    cai = _cuda_array_interface(obj)
    # __cuda_array_interface__ has no typestr for bfloat16 (PyTorch says "|V2"): DLPack knows the type
    if cai is not None and not (str(cai.get("typestr", "")).lstrip("<>|=").startswith("V")
                                and hasattr(obj, "__dlpack__")):
        buf = _parse_cuda_array_interface(cai)
    elif hasattr(obj, "__dlpack__"):
        dev = dlpack_device(obj)
        if require_cuda and dev is not None and dev[0] not in (DL_CUDA, DL_CUDA_MANAGED):
            _not_cuda(obj, DEVICE_TYPE_NAMES.get(dev[0], f"DLPack device type {dev[0]}"))
        buf = parse_dlpack_capsule(obj.__dlpack__())
    else:
        raise UsageError(f"{type(obj).__name__} exports neither __cuda_array_interface__ nor DLPack; "
                         f"pass a CuPy array or another CUDA array object")
    if require_cuda and buf.device_type not in ("cuda", "cuda_managed"):
        _not_cuda(obj, buf.device_type)
    if buf.nbytes == 0 and not allow_empty:
        raise UsageError("the GPU array is empty")
    return buf


def _not_cuda(obj, where):
    hint = " (register host memory with pyrdma.MemoryRegion(pd, array))" if where in ("cpu", "cuda_host") else ""
    raise UsageError(f"{type(obj).__name__} lives in {where} memory, not on a CUDA GPU{hint}")
