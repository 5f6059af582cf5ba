# Type stubs of pyrdma._reduce (pyx/reduce.pyx), checked against the built module by mypy.stubtest.
from typing import Any, Dict, Optional, Tuple, TypeVar

from pyrdma.errors import UsageError as UsageError

_B = TypeVar("_B")

SUM: int
PROD: int
MIN: int
MAX: int
OPS: Dict[str, int]
INT8: int
UINT8: int
INT32: int
INT64: int
FLOAT16: int
FLOAT32: int
FLOAT64: int
BFLOAT16: int
DTYPE_NAMES: Tuple[str, ...]
ITEMSIZE: Tuple[int, ...]
SUPPORTED_DTYPES: Tuple[str, ...]
STORAGE: Tuple[type, ...]

def dtype_code(dtype: Any) -> int: ...
def op_code(op: Any) -> int: ...
def reduce_into(dst: _B, src: Any, op: str = ..., dtype: Any = ...) -> _B: ...
def reduce_out(dst: _B, a: Any, b: Any, op: str = ..., dtype: Any = ...) -> _B: ...
def divide(buf: _B, n: int, dtype: Any = ...) -> _B: ...
def reduce_bytes(dst: Any, a: Any, b: Any, dtype: int, op: int) -> None: ...
def divide_bytes(buf: Any, dtype: int, n: int) -> None: ...
def simd_float16(enabled: Optional[bool] = ...) -> bool: ...
