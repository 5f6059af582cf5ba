/* Element-wise reductions for the collectives: dst[i] = op(dst[i], src[i]).
 *
 * Plain loops over restrict pointers so gcc -O3 vectorises them. Integer arithmetic wraps
 * (done in the unsigned type, as numpy does); float16 uses _Float16 (each operation rounded to
 * half precision, as numpy computes it); bfloat16 is stored as uint16 and computed in float with
 * round-to-nearest-even back to bfloat16. Callers release the GIL around these.
 */
#ifndef PYRDMA_REDUCE_H
#define PYRDMA_REDUCE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum pyrdma_op { PYRDMA_SUM = 0, PYRDMA_PROD = 1, PYRDMA_MIN = 2, PYRDMA_MAX = 3 };
enum pyrdma_dtype {
    PYRDMA_INT8 = 0, PYRDMA_UINT8, PYRDMA_INT32, PYRDMA_INT64, PYRDMA_FLOAT16,
    PYRDMA_FLOAT32, PYRDMA_FLOAT64, PYRDMA_BFLOAT16, PYRDMA_NDTYPES
};

#define PYRDMA_MIN_OF(a, b) ((b) < (a) ? (b) : (a))
#define PYRDMA_MAX_OF(a, b) ((b) > (a) ? (b) : (a))

/* Integers: add and multiply in the unsigned type of the same width so overflow wraps. */
#define PYRDMA_INT_LOOPS(T, UT)                                                                    \
static void pyrdma_reduce_##T(T *restrict dst, const T *restrict src, size_t n, int op) {         \
    size_t i;                                                                                      \
    switch (op) {                                                                                  \
    case PYRDMA_SUM: for (i = 0; i < n; i++) dst[i] = (T)((UT)dst[i] + (UT)src[i]); break;        \
    case PYRDMA_PROD: for (i = 0; i < n; i++) dst[i] = (T)((UT)dst[i] * (UT)src[i]); break;       \
    case PYRDMA_MIN: for (i = 0; i < n; i++) dst[i] = PYRDMA_MIN_OF(dst[i], src[i]); break;       \
    case PYRDMA_MAX: for (i = 0; i < n; i++) dst[i] = PYRDMA_MAX_OF(dst[i], src[i]); break;       \
    }                                                                                              \
}

/* Floats: min/max propagate NaN like numpy.minimum/maximum. */
#define PYRDMA_FLOAT_LOOPS(NAME, T)                                                                \
static void pyrdma_reduce_##NAME(T *restrict dst, const T *restrict src, size_t n, int op) {      \
    size_t i;                                                                                      \
    switch (op) {                                                                                  \
    case PYRDMA_SUM: for (i = 0; i < n; i++) dst[i] = dst[i] + src[i]; break;                     \
    case PYRDMA_PROD: for (i = 0; i < n; i++) dst[i] = dst[i] * src[i]; break;                    \
    case PYRDMA_MIN:                                                                               \
        for (i = 0; i < n; i++) { T a = dst[i], b = src[i]; dst[i] = (a != a || a < b) ? a : b; } \
        break;                                                                                     \
    case PYRDMA_MAX:                                                                               \
        for (i = 0; i < n; i++) { T a = dst[i], b = src[i]; dst[i] = (a != a || a > b) ? a : b; } \
        break;                                                                                     \
    }                                                                                              \
}

PYRDMA_INT_LOOPS(int8_t, uint8_t)
PYRDMA_INT_LOOPS(uint8_t, uint8_t)
PYRDMA_INT_LOOPS(int32_t, uint32_t)
PYRDMA_INT_LOOPS(int64_t, uint64_t)
PYRDMA_FLOAT_LOOPS(float16, _Float16)
PYRDMA_FLOAT_LOOPS(float32, float)
PYRDMA_FLOAT_LOOPS(float64, double)

static inline float pyrdma_bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t pyrdma_float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u)          /* NaN: keep it quiet, keep the sign */
        return (uint16_t)((bits >> 16) | 0x0040u);
    bits += 0x7fffu + ((bits >> 16) & 1u);            /* round to nearest, ties to even */
    return (uint16_t)(bits >> 16);
}

static void pyrdma_reduce_bfloat16(uint16_t *restrict dst, const uint16_t *restrict src, size_t n, int op) {
    size_t i;
    for (i = 0; i < n; i++) {
        float a = pyrdma_bf16_to_float(dst[i]), b = pyrdma_bf16_to_float(src[i]), r;
        switch (op) {
        case PYRDMA_SUM: r = a + b; break;
        case PYRDMA_PROD: r = a * b; break;
        case PYRDMA_MIN: r = (a != a || a < b) ? a : b; break;
        default: r = (a != a || a > b) ? a : b; break;
        }
        dst[i] = pyrdma_float_to_bf16(r);
    }
}

/* dst = op(dst, src) over n elements of dtype; returns -1 for an unknown dtype or op. */
static int pyrdma_reduce(void *dst, const void *src, size_t n, int dtype, int op) {
    if (op < PYRDMA_SUM || op > PYRDMA_MAX) return -1;
    switch (dtype) {
    case PYRDMA_INT8: pyrdma_reduce_int8_t(dst, src, n, op); return 0;
    case PYRDMA_UINT8: pyrdma_reduce_uint8_t(dst, src, n, op); return 0;
    case PYRDMA_INT32: pyrdma_reduce_int32_t(dst, src, n, op); return 0;
    case PYRDMA_INT64: pyrdma_reduce_int64_t(dst, src, n, op); return 0;
    case PYRDMA_FLOAT16: pyrdma_reduce_float16(dst, src, n, op); return 0;
    case PYRDMA_FLOAT32: pyrdma_reduce_float32(dst, src, n, op); return 0;
    case PYRDMA_FLOAT64: pyrdma_reduce_float64(dst, src, n, op); return 0;
    case PYRDMA_BFLOAT16: pyrdma_reduce_bfloat16(dst, src, n, op); return 0;
    }
    return -1;
}

/* Average's final step: divide each element by n (integers truncate toward zero, as C and NCCL). */
#define PYRDMA_DIV_LOOP(T, CT) { T *restrict p = (T *)buf; for (i = 0; i < count; i++) p[i] = (T)((CT)p[i] / (CT)n); }
static int pyrdma_divide(void *buf, size_t count, int dtype, int64_t n) {
    size_t i;
    switch (dtype) {
    case PYRDMA_INT8: PYRDMA_DIV_LOOP(int8_t, int64_t) return 0;
    case PYRDMA_UINT8: PYRDMA_DIV_LOOP(uint8_t, int64_t) return 0;
    case PYRDMA_INT32: PYRDMA_DIV_LOOP(int32_t, int64_t) return 0;
    case PYRDMA_INT64: PYRDMA_DIV_LOOP(int64_t, int64_t) return 0;
    case PYRDMA_FLOAT16: PYRDMA_DIV_LOOP(_Float16, _Float16) return 0;
    case PYRDMA_FLOAT32: PYRDMA_DIV_LOOP(float, float) return 0;
    case PYRDMA_FLOAT64: PYRDMA_DIV_LOOP(double, double) return 0;
    case PYRDMA_BFLOAT16: {
        uint16_t *p = (uint16_t *)buf;
        for (i = 0; i < count; i++) p[i] = pyrdma_float_to_bf16(pyrdma_bf16_to_float(p[i]) / (float)n);
        return 0;
    }
    }
    return -1;
}

#endif
