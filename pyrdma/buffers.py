"""The one buffer getter (as mpi4py's asbuffer): what memory a Python object offers.

    host_array(obj, name) -> a numpy array over obj's memory, never a copy: a numpy array as it is,
        else a CPU DLPack tensor (np.from_dlpack), else the buffer protocol. A CUDA array (DLPack
        CUDA device, __cuda_array_interface__) or another device raises UsageError naming it.
    is_cuda_array(obj) -> whether obj's memory is on a CUDA GPU, without importing CuPy
        (pyrdma.cuda.buffers reads __cuda_array_interface__ and DLPack capsules for the GPU paths).
"""
import numpy as np

from pyrdma.cuda.buffers import is_cuda_array  # noqa: F401 - part of this module's interface
from pyrdma.errors import UsageError

_DL_CPU = 1


def host_array(obj, name):
    if isinstance(obj, np.ndarray):
        return obj
    if hasattr(obj, "__dlpack_device__") and hasattr(obj, "__dlpack__"):
        device_type = obj.__dlpack_device__()[0]
        if device_type != _DL_CPU:
            raise UsageError(f"{name} is not in CPU memory (DLPack device type {device_type}); CUDA arrays go to "
                             f"the collectives' GPU paths, other devices are not supported")
        return np.from_dlpack(obj)
    try:
        return np.asarray(memoryview(obj))
    except (TypeError, ValueError):
        raise UsageError(f"{name} ({type(obj).__name__}) is not an array (numpy, DLPack) and not a buffer") from None
