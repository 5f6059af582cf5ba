"""The C reduction kernels (pyrdma._reduce) against numpy's ufuncs, element by element."""
import array

import numpy as np
import pytest

import pyrdma
from pyrdma import _reduce as R

try:
    import ml_dtypes
except ImportError:   # optional: bfloat16 is then tested through uint16 storage only
    ml_dtypes = None

OPS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
NUMPY_DTYPES = ["int8", "uint8", "int32", "int64", "float16", "float32", "float64"]
SIZES = [0, 1, 7, 8, 9, 31, 1000, 4099]


def random_array(rng, dtype, n, special=True):
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, n, endpoint=True, dtype=dt)
    with np.errstate(all="ignore"):
        x = (rng.standard_normal(n) * rng.choice([1e-6, 1e-2, 1, 100, 3e4], n)).astype(dt)
    if special and n >= 8:
        x[rng.integers(0, n, 3)] = np.array([np.nan, np.inf, -np.inf], dt)
        x[rng.integers(0, n)] = -0.0
        if dt == np.float16:
            x[rng.integers(0, n)] = np.float16(6e-8)   # subnormal
    return x


def assert_same(got, expected, op):
    """Bit-exact, except that NaN equals NaN whatever its payload, and -0 equals +0 for min/max
    (numpy itself returns either zero there depending on its SIMD path)."""
    got = np.asarray(got)
    if got.dtype.kind == "f" or got.dtype.name == "bfloat16":
        g, e = got.astype(np.float64), expected.astype(np.float64)
        both_nan = np.isnan(g) & np.isnan(e)
        if op in ("sum", "prod"):
            bits_g = got.view(f"u{got.dtype.itemsize}")
            bits_e = expected.view(f"u{expected.dtype.itemsize}")
            assert np.array_equal(np.where(both_nan, 0, bits_g), np.where(both_nan, 0, bits_e)), op
        else:
            assert np.array_equal(np.where(both_nan, 0, g), np.where(both_nan, 0, e)), op
    else:
        assert np.array_equal(got, expected), op


@pytest.fixture(params=[True, False], ids=["simd", "portable"])
def float16_path(request):
    """Run float16 through the F16C kernels (where the CPU has them) and the portable ones."""
    before = R.simd_float16()
    R.simd_float16(request.param)
    yield request.param
    R.simd_float16(before)


def _cases():
    # every dtype on the default path, and float16 once more through the portable conversions
    return ([pytest.param(d, True, id=d) for d in NUMPY_DTYPES] +
            [pytest.param("float16", False, id="float16-portable")])


@pytest.mark.parametrize("dtype, simd", _cases())
@pytest.mark.parametrize("op", list(OPS))
def test_reduce_into_equals_numpy(dtype, simd, op):
    before = R.simd_float16()
    R.simd_float16(simd)
    try:
        _check_against_numpy(dtype, op)
    finally:
        R.simd_float16(before)


def _check_against_numpy(dtype, op):
    rng = np.random.default_rng(hash((dtype, op)) % 2**32)
    for n in SIZES:
        a, b = random_array(rng, dtype, n), random_array(rng, dtype, n)
        with np.errstate(all="ignore"):
            expected = OPS[op](a, b)
        dst = a.copy()
        assert R.reduce_into(dst, b, op) is dst
        assert_same(dst, expected, op)
        out = np.empty_like(a)
        R.reduce_out(out, a, b, op)
        assert_same(out, expected, op)
        # dst may be the second operand too: dst = op(a, dst)
        dst2 = b.copy()
        R.reduce_out(dst2, a, dst2, op)
        assert_same(dst2, expected, op)


def test_float16_every_value_pair_rounds_like_numpy(float16_path):
    # All 65536 halves against a shuffled copy: covers subnormals, ties, overflow to inf, NaNs.
    a = np.arange(65536, dtype=np.uint16).view(np.float16)
    rng = np.random.default_rng(3)
    for _ in range(3):
        b = rng.permutation(a)
        for op, f in OPS.items():
            dst = a.copy()
            R.reduce_into(dst, b, op)
            with np.errstate(all="ignore"):
                assert_same(dst, f(a, b), op)


def _bf16_reference(a_bits, b_bits, op):
    """bfloat16 reference from numpy alone: widen to float32, one float32 op, round to nearest even."""
    fa = (a_bits.astype(np.uint32) << 16).view(np.float32)
    fb = (b_bits.astype(np.uint32) << 16).view(np.float32)
    with np.errstate(all="ignore"):
        r = OPS[op](fa, fb).astype(np.float32)
    bits = r.view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(r)
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16), nan


@pytest.mark.parametrize("op", list(OPS))
def test_bfloat16_on_uint16_storage(op):
    rng = np.random.default_rng(11)
    a = rng.integers(0, 65536, 20000, dtype=np.uint16)
    b = rng.integers(0, 65536, 20000, dtype=np.uint16)
    expected, nan = _bf16_reference(a, b, op)
    dst = a.copy()
    R.reduce_into(dst, b, op, dtype="bfloat16")
    got_nan = ((dst & 0x7F80) == 0x7F80) & ((dst & 0x7F) != 0)
    assert np.array_equal(got_nan, nan)
    if op in ("min", "max"):   # an operand's own bits, NaN payload included
        assert np.array_equal(dst[~nan], expected[~nan])
    else:
        assert np.array_equal(dst[~nan], expected[~nan])


@pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes not installed")
@pytest.mark.parametrize("op", list(OPS))
def test_bfloat16_ml_dtypes_arrays_equal_ml_dtypes_arithmetic(op):
    rng = np.random.default_rng(5)
    a = (rng.standard_normal(3001) * 50).astype(ml_dtypes.bfloat16)
    b = (rng.standard_normal(3001) * 50).astype(ml_dtypes.bfloat16)
    a[3], b[4] = np.nan, np.inf
    dst = a.copy()
    R.reduce_into(dst, b, op)
    with np.errstate(all="ignore"):
        expected = OPS[op](a, b)
    assert_same(dst, expected, op)
    assert R.dtype_code(a.dtype) == R.BFLOAT16


@pytest.mark.parametrize("dtype", NUMPY_DTYPES + ["bfloat16"])
def test_divide_is_average_with_truncation(dtype):
    rng = np.random.default_rng(1)
    if dtype == "bfloat16":
        bits = rng.integers(0, 65536, 999, dtype=np.uint16)
        values = (bits.astype(np.uint32) << 16).view(np.float32)
        R.divide(bits, 3, dtype="bfloat16")
        with np.errstate(all="ignore"):
            quotient = (values / np.float32(3)).view(np.uint32)
        expected = ((quotient + 0x7FFF + ((quotient >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(values)
        assert np.array_equal(bits[~nan], expected[~nan])
        assert np.isnan((bits[nan].astype(np.uint32) << 16).view(np.float32)).all()
        return
    x = random_array(rng, dtype, 999, special=False)
    for n in (1, 2, 3, 7):
        buf = x.copy()
        R.divide(buf, n)
        if np.dtype(dtype).kind == "f":
            expected = (x / np.asarray(n, dtype)).astype(dtype)
            assert_same(buf, expected, "sum")
        else:
            wide = x.astype(np.int64)
            q = wide // n
            q[(wide % n != 0) & (wide < 0)] += 1          # C truncation toward zero
            assert np.array_equal(buf, q.astype(dtype))


def test_integer_sum_and_prod_wrap_like_numpy():
    a = np.array([127, -128, 100], np.int8)
    b = np.array([1, -1, 100], np.int8)
    dst = a.copy()
    R.reduce_into(dst, b, "sum")
    assert dst.tolist() == [-128, 127, -56]
    dst = a.copy()
    R.reduce_into(dst, b, "prod")
    assert dst.tolist() == (a * b).tolist()
    big = np.array([2**62, -(2**63)], np.int64)
    dst = big.copy()
    R.reduce_into(dst, big, "sum")
    assert dst.tolist() == (big + big).tolist()


def test_min_max_propagate_nan():
    a = np.array([np.nan, 1.0, 2.0, np.nan], np.float32)
    b = np.array([1.0, np.nan, 3.0, np.nan], np.float32)
    for op in ("min", "max"):
        dst = a.copy()
        R.reduce_into(dst, b, op)
        assert np.isnan(dst[:2]).all() and np.isnan(dst[3])
        assert dst[2] == (2.0 if op == "min" else 3.0)


def test_buffer_protocol_and_shapes():
    dst = bytearray(b"\x01\x02\x03")
    R.reduce_into(dst, b"\x01\x01\x01", "sum")
    assert dst == bytearray(b"\x02\x03\x04")
    f = array.array("f", [1.0, 2.0])
    R.reduce_into(f, array.array("f", [3.0, 4.0]), "prod")
    assert f.tolist() == [3.0, 8.0]
    m = np.ones((3, 4), np.float64)
    R.reduce_into(m, np.full(12, 2.0), "max")   # same element count, other shape
    assert (m == 2).all()
    scalar = np.array(5, np.int32)
    R.reduce_into(scalar, np.array(7, np.int32), "min")
    assert scalar == 5


def test_overlapping_operands_behave_like_numpy():
    x = np.arange(10, dtype=np.int32)
    expected = x[:8] + x[2:]
    R.reduce_into(x[:8], x[2:], "sum")   # partial overlap: src is copied first
    assert np.array_equal(x[:8], expected)
    y = np.arange(5, dtype=np.float64)
    R.reduce_into(y, y, "sum")           # identical operands
    assert np.array_equal(y, np.arange(5) * 2.0)


def test_reduce_bytes_fast_path():
    a = np.arange(6, dtype=np.float32)
    b = np.ones(6, np.float32)
    out = np.empty(6, np.float32)
    R.reduce_bytes(out.view(np.uint8), a.view(np.uint8), b.view(np.uint8), R.FLOAT32, R.SUM)
    assert np.array_equal(out, a + 1)
    ro = np.frombuffer(b.tobytes(), np.uint8)            # read-only source is fine
    R.reduce_bytes(a.view(np.uint8), a.view(np.uint8), ro, R.FLOAT32, R.MAX)
    assert np.array_equal(a, np.maximum(np.arange(6), 1))
    with pytest.raises(pyrdma.UsageError, match="size mismatch"):
        R.reduce_bytes(out.view(np.uint8), a.view(np.uint8)[:8], b.view(np.uint8), R.FLOAT32, R.SUM)
    with pytest.raises(pyrdma.UsageError, match="whole number"):
        R.reduce_bytes(out.view(np.uint8)[:6], a.view(np.uint8)[:6], b.view(np.uint8)[:6], R.FLOAT32, R.SUM)
    with pytest.raises(pyrdma.UsageError, match="partly overlaps"):
        R.reduce_bytes(out.view(np.uint8)[4:], out.view(np.uint8)[:20], b.view(np.uint8)[:20], R.FLOAT32, R.SUM)


@pytest.mark.parametrize("call, match", [
    (lambda: R.reduce_into(np.zeros(4), np.zeros(4, np.float32)), "dtype mismatch"),
    (lambda: R.reduce_into(np.zeros(4), np.zeros(5)), "size mismatch"),
    (lambda: R.reduce_into(np.zeros((4, 4))[:, 0], np.zeros(4)), "C-contiguous"),
    (lambda: R.reduce_into(np.zeros(4), np.zeros((4, 4))[:, 0]), "C-contiguous"),
    (lambda: R.reduce_into(np.frombuffer(bytes(32)), np.zeros(4)), "read-only"),
    (lambda: R.reduce_into(np.zeros(4, np.complex64), np.zeros(4, np.complex64)), "unsupported dtype"),
    (lambda: R.reduce_into(np.zeros(4, np.uint16), np.zeros(4, np.uint16)), "unsupported dtype"),
    (lambda: R.reduce_into(np.zeros(4, ">f4"), np.zeros(4, ">f4")), "byte order"),
    (lambda: R.reduce_into(np.zeros(4), np.zeros(4), "xor"), "unsupported op"),
    (lambda: R.reduce_into(np.zeros(4), np.zeros(4), "avg"), "divide"),
    (lambda: R.reduce_into(np.zeros(4, np.float32), np.zeros(4, np.float32), dtype="bfloat16"), "2-byte"),
    (lambda: R.reduce_into(object(), np.zeros(4)), "not a buffer"),
    (lambda: R.divide(np.zeros(4), 0), "divide by 0"),
])
def test_bad_input_is_a_usage_error(call, match):
    with pytest.raises(pyrdma.UsageError, match=match):
        call()


def test_large_arrays_release_the_gil():
    # A reduction of a large array must not hold the GIL: another thread keeps running meanwhile.
    import threading
    import time
    a = np.ones(1 << 24, np.float32)
    b = np.ones(1 << 24, np.float32)
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)
    t = threading.Thread(target=ticker)
    t.start()
    try:
        time.sleep(0.01)
        before = len(ticks)
        start = time.perf_counter()
        for _ in range(5):
            R.reduce_into(a, b, "sum")
        elapsed = time.perf_counter() - start
        during = len(ticks) - before
    finally:
        stop.set()
        t.join()
    assert a[0] == 6.0
    if elapsed > 0.05:   # only meaningful when the reductions took a while
        assert during > 3, (during, elapsed)
