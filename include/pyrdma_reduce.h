/* Element-wise reductions for the collectives, on CPU memory, called without the GIL.
 *
 *   pyrdma_reduce(dst, a, b, n, dtype, op):   dst[i] = op(a[i], b[i])   for i < n
 *
 * dst may be the same pointer as a or b (in place: dst = op(dst, src)), but must not otherwise
 * overlap them; the Cython wrapper checks that. The loops are written so gcc -O3 vectorises them
 * (`#pragma GCC ivdep` states the no-partial-overlap rule), and on x86-64 each kernel is also built
 * for AVX2 and picked at load time (target_clones), so the wheel stays baseline x86-64.
 *
 * Semantics, chosen to equal numpy's ufuncs element by element:
 * - integers: sum and prod wrap (computed in the unsigned type of the same width, as numpy does);
 *   min and max are exact.
 * - float32/float64: one IEEE operation per element, no contraction, no fast-math; min and max
 *   propagate NaN like numpy.minimum/numpy.maximum (a NaN on either side gives NaN).
 * - float16: both operands widened to float, one float operation, rounded back to half with
 *   round-to-nearest-even -- what numpy does. Rounding the float result again to half is exact
 *   rounding of the true result, because float has more than 2*11+2 significant bits. Uses F16C
 *   (vcvtph2ps/vcvtps2ph, 8 lanes) when the CPU has it, else portable bit-exact conversions.
 * - bfloat16 (uint16 storage): the same through float, rounded to nearest even; NaN stays a quiet
 *   NaN with its sign. This is what ml_dtypes.bfloat16 arithmetic does.
 *
 * Average is sum followed by pyrdma_divide(buf, count, dtype, n): floats divide (float16 and
 * bfloat16 through float, rounded once more to nearest even); integers divide with C truncation
 * toward zero, like NCCL's ncclAvg on integer types (sum first, wrapping, then divide).
 */
#ifndef PYRDMA_REDUCE_H
#define PYRDMA_REDUCE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#define PYRDMA_X86_GCC 1
#include <immintrin.h>
/* An AVX2 clone next to the baseline one; the loader's ifunc resolver picks per CPU. */
#define PYRDMA_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define PYRDMA_CLONES
#endif

#if defined(__GNUC__)
#define PYRDMA_IVDEP _Pragma("GCC ivdep")
#else
#define PYRDMA_IVDEP
#endif

enum pyrdma_op { PYRDMA_SUM = 0, PYRDMA_PROD = 1, PYRDMA_MIN = 2, PYRDMA_MAX = 3, PYRDMA_NOPS };
enum pyrdma_dtype {
    PYRDMA_INT8 = 0, PYRDMA_UINT8, PYRDMA_INT32, PYRDMA_INT64, PYRDMA_FLOAT16,
    PYRDMA_FLOAT32, PYRDMA_FLOAT64, PYRDMA_BFLOAT16, PYRDMA_NDTYPES
};

static const size_t pyrdma_itemsize[PYRDMA_NDTYPES] = {1, 1, 4, 8, 2, 4, 8, 2};

/* ---- integers ------------------------------------------------------------------------------ */

#define PYRDMA_INT_KERNEL(NAME, T, UT)                                                             \
PYRDMA_CLONES static void pyrdma_reduce_##NAME(T *dst, const T *a, const T *b, size_t n, int op) { \
    size_t i;                                                                                      \
    switch (op) {                                                                                  \
    case PYRDMA_SUM:                                                                               \
        PYRDMA_IVDEP for (i = 0; i < n; i++) dst[i] = (T)((UT)a[i] + (UT)b[i]);                   \
        break;                                                                                     \
    case PYRDMA_PROD:                                                                              \
        PYRDMA_IVDEP for (i = 0; i < n; i++) dst[i] = (T)((UT)a[i] * (UT)b[i]);                   \
        break;                                                                                     \
    case PYRDMA_MIN:                                                                               \
        PYRDMA_IVDEP for (i = 0; i < n; i++) dst[i] = b[i] < a[i] ? b[i] : a[i];                  \
        break;                                                                                     \
    case PYRDMA_MAX:                                                                               \
        PYRDMA_IVDEP for (i = 0; i < n; i++) dst[i] = b[i] > a[i] ? b[i] : a[i];                  \
        break;                                                                                     \
    }                                                                                              \
}

PYRDMA_INT_KERNEL(int8, int8_t, uint8_t)
PYRDMA_INT_KERNEL(uint8, uint8_t, uint8_t)
PYRDMA_INT_KERNEL(int32, int32_t, uint32_t)
PYRDMA_INT_KERNEL(int64, int64_t, uint64_t)

/* ---- float32 / float64 --------------------------------------------------------------------- */

/* numpy.minimum/maximum: NaN in a -> a; NaN in b -> the comparison is false -> b. */
#define PYRDMA_FMIN(x, y) (((x) != (x) || (x) < (y)) ? (x) : (y))
#define PYRDMA_FMAX(x, y) (((x) != (x) || (x) > (y)) ? (x) : (y))

#define PYRDMA_FLOAT_KERNEL(NAME, T)                                                               \
PYRDMA_CLONES static void pyrdma_reduce_##NAME(T *dst, const T *a, const T *b, size_t n, int op) { \
    size_t i;                                                                                      \
    switch (op) {                                                                                  \
    case PYRDMA_SUM: PYRDMA_IVDEP for (i = 0; i < n; i++) dst[i] = a[i] + b[i]; break;            \
    case PYRDMA_PROD: PYRDMA_IVDEP for (i = 0; i < n; i++) dst[i] = a[i] * b[i]; break;           \
    case PYRDMA_MIN:                                                                               \
        PYRDMA_IVDEP for (i = 0; i < n; i++) { T x = a[i], y = b[i]; dst[i] = PYRDMA_FMIN(x, y); } \
        break;                                                                                     \
    case PYRDMA_MAX:                                                                               \
        PYRDMA_IVDEP for (i = 0; i < n; i++) { T x = a[i], y = b[i]; dst[i] = PYRDMA_FMAX(x, y); } \
        break;                                                                                     \
    }                                                                                              \
}

PYRDMA_FLOAT_KERNEL(float32, float)
PYRDMA_FLOAT_KERNEL(float64, double)

/* ---- float16 and bfloat16 conversions (portable, bit-exact) --------------------------------- */

static inline float pyrdma_bits_to_float(uint32_t bits) { float f; memcpy(&f, &bits, 4); return f; }
static inline uint32_t pyrdma_float_to_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* IEEE half -> float, exact (subnormal halves become normal floats). */
static inline float pyrdma_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0x1f)                                   /* inf / NaN (payload kept) */
        return pyrdma_bits_to_float(sign | 0x7f800000u | (mant << 13));
    if (exp != 0)                                      /* normal: rebias 15 -> 127 */
        return pyrdma_bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
    /* zero or subnormal: mant * 2^-24, exact in float */
    return pyrdma_bits_to_float(sign) + (float)mant * (sign ? -5.9604644775390625e-08f : 5.9604644775390625e-08f);
}

/* float -> IEEE half, round to nearest, ties to even; overflow -> inf; NaN -> quiet NaN. */
static inline uint16_t pyrdma_float_to_half(float f) {
    uint32_t bits = pyrdma_float_to_bits(f);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    uint32_t abs = bits & 0x7fffffffu;
    if (abs >= 0x7f800000u)                            /* inf or NaN */
        return sign | (abs > 0x7f800000u ? (uint16_t)(0x7e00u | ((abs >> 13) & 0x3ffu)) : 0x7c00u);
    if (abs >= 0x477ff000u)                            /* >= 65520: rounds to inf */
        return sign | 0x7c00u;
    if (abs >= 0x38800000u) {                          /* normal half range (>= 2^-14) */
        uint32_t r = abs - 0x38000000u;                /* rebias 127 -> 15, still 23-bit mantissa */
        r += 0xfffu + ((r >> 13) & 1u);                /* round to nearest even at bit 13 */
        return sign | (uint16_t)(r >> 13);
    }
    if (abs < 0x33000000u)                             /* < 2^-25: rounds to zero */
        return sign;
    {   /* subnormal half: value = m * 2^-24, m = round(f * 2^24) with ties to even */
        uint32_t e = abs >> 23;                        /* 102..112 */
        uint32_t m = (abs & 0x7fffffu) | 0x800000u;    /* 24-bit significand */
        uint32_t shift = 126u - e;                     /* 14..24: bits below the half ulp */
        uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return sign | (uint16_t)q;
    }
}

static inline float pyrdma_bf16_to_float(uint16_t h) { return pyrdma_bits_to_float((uint32_t)h << 16); }

static inline uint16_t pyrdma_float_to_bf16(float f) {
    uint32_t bits = pyrdma_float_to_bits(f);
    uint32_t rounded = bits + 0x7fffu + ((bits >> 16) & 1u);     /* nearest, ties to even */
    uint32_t quiet = bits | 0x00400000u;                         /* NaN: keep it a (quiet) NaN */
    return (uint16_t)((((bits & 0x7fffffffu) > 0x7f800000u) ? quiet : rounded) >> 16);
}

/* ---- float16 / bfloat16 kernels ------------------------------------------------------------ */

#define PYRDMA_VIA_FLOAT_KERNEL(NAME, TO_F, FROM_F)                                                \
PYRDMA_CLONES static void pyrdma_reduce_##NAME##_generic(uint16_t *dst, const uint16_t *a,        \
                                                          const uint16_t *b, size_t n, int op) {   \
    size_t i;                                                                                      \
    switch (op) {                                                                                  \
    case PYRDMA_SUM:                                                                               \
        PYRDMA_IVDEP for (i = 0; i < n; i++) dst[i] = FROM_F(TO_F(a[i]) + TO_F(b[i]));            \
        break;                                                                                     \
    case PYRDMA_PROD:                                                                              \
        PYRDMA_IVDEP for (i = 0; i < n; i++) dst[i] = FROM_F(TO_F(a[i]) * TO_F(b[i]));            \
        break;                                                                                     \
    case PYRDMA_MIN:                                                                               \
        PYRDMA_IVDEP for (i = 0; i < n; i++) {                                                     \
            float x = TO_F(a[i]), y = TO_F(b[i]);                                                  \
            dst[i] = (x != x || x < y) ? a[i] : b[i];   /* min/max pick an operand: no rounding */ \
        }                                                                                          \
        break;                                                                                     \
    case PYRDMA_MAX:                                                                               \
        PYRDMA_IVDEP for (i = 0; i < n; i++) {                                                     \
            float x = TO_F(a[i]), y = TO_F(b[i]);                                                  \
            dst[i] = (x != x || x > y) ? a[i] : b[i];                                              \
        }                                                                                          \
        break;                                                                                     \
    }                                                                                              \
}

PYRDMA_VIA_FLOAT_KERNEL(float16, pyrdma_half_to_float, pyrdma_float_to_half)
PYRDMA_VIA_FLOAT_KERNEL(bfloat16, pyrdma_bf16_to_float, pyrdma_float_to_bf16)

#ifdef PYRDMA_X86_GCC
/* F16C: 8 halves per instruction each way; vcvtps2ph with imm 0 rounds to nearest even. */
__attribute__((target("avx,f16c")))
static void pyrdma_reduce_float16_f16c(uint16_t *dst, const uint16_t *a, const uint16_t *b, size_t n, int op) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));
        __m256 y = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i)));
        if (op >= PYRDMA_MIN) {
            /* numpy.minimum/maximum: take a where a is NaN or a < b (a > b), else b; the chosen
               operand's own 16 bits are stored, so nothing is rounded and NaN payloads survive. */
            __m256 better = op == PYRDMA_MIN ? _mm256_cmp_ps(x, y, _CMP_LT_OQ) : _mm256_cmp_ps(x, y, _CMP_GT_OQ);
            __m256 take_a = _mm256_or_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q), better);
            __m256i m32 = _mm256_castps_si256(take_a);
            __m128i mask = _mm_packs_epi32(_mm256_castsi256_si128(m32), _mm256_extractf128_si256(m32, 1));
            __m128i va = _mm_loadu_si128((const __m128i *)(a + i)), vb = _mm_loadu_si128((const __m128i *)(b + i));
            _mm_storeu_si128((__m128i *)(dst + i), _mm_or_si128(_mm_and_si128(mask, va), _mm_andnot_si128(mask, vb)));
        } else {
            __m256 r = op == PYRDMA_SUM ? _mm256_add_ps(x, y) : _mm256_mul_ps(x, y);
            _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT));
        }
    }
    if (i < n)
        pyrdma_reduce_float16_generic(dst + i, a + i, b + i, n - i, op);
}
#endif

/* 1 when the F16C path is used for float16 (the CPU has it and it was not switched off). */
static int pyrdma_f16c_enabled = -1;

static int pyrdma_have_f16c(void) {
    if (pyrdma_f16c_enabled < 0) {
#ifdef PYRDMA_X86_GCC
        __builtin_cpu_init();
        pyrdma_f16c_enabled = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
#else
        pyrdma_f16c_enabled = 0;
#endif
    }
    return pyrdma_f16c_enabled;
}

static void pyrdma_reduce_float16(uint16_t *dst, const uint16_t *a, const uint16_t *b, size_t n, int op) {
#ifdef PYRDMA_X86_GCC
    if (pyrdma_have_f16c()) {
        pyrdma_reduce_float16_f16c(dst, a, b, n, op);
        return;
    }
#endif
    pyrdma_reduce_float16_generic(dst, a, b, n, op);
}

/* ---- entry points -------------------------------------------------------------------------- */

/* dst = op(a, b) over n elements of dtype (dst may equal a or b); -1 for an unknown dtype or op. */
static int pyrdma_reduce(void *dst, const void *a, const void *b, size_t n, int dtype, int op) {
    if (op < 0 || op >= PYRDMA_NOPS) return -1;
    switch (dtype) {
    case PYRDMA_INT8: pyrdma_reduce_int8(dst, a, b, n, op); return 0;
    case PYRDMA_UINT8: pyrdma_reduce_uint8(dst, a, b, n, op); return 0;
    case PYRDMA_INT32: pyrdma_reduce_int32(dst, a, b, n, op); return 0;
    case PYRDMA_INT64: pyrdma_reduce_int64(dst, a, b, n, op); return 0;
    case PYRDMA_FLOAT16: pyrdma_reduce_float16(dst, a, b, n, op); return 0;
    case PYRDMA_FLOAT32: pyrdma_reduce_float32(dst, a, b, n, op); return 0;
    case PYRDMA_FLOAT64: pyrdma_reduce_float64(dst, a, b, n, op); return 0;
    case PYRDMA_BFLOAT16: pyrdma_reduce_bfloat16_generic(dst, a, b, n, op); return 0;
    }
    return -1;
}

/* The last step of 'avg': buf[i] /= n. Integers truncate toward zero (C division, as NCCL's
 * integer average); floats divide once, float16/bfloat16 through float rounded to nearest even. */
#define PYRDMA_INT_DIV(T, CT)                                                                      \
    { T *p = (T *)buf; CT d = (CT)n; for (i = 0; i < count; i++) p[i] = (T)((CT)p[i] / d); }
static int pyrdma_divide(void *buf, size_t count, int dtype, int64_t n) {
    size_t i;
    if (n <= 0) return -1;
    switch (dtype) {
    case PYRDMA_INT8: PYRDMA_INT_DIV(int8_t, int32_t) return 0;
    case PYRDMA_UINT8: PYRDMA_INT_DIV(uint8_t, uint32_t) return 0;
    case PYRDMA_INT32: PYRDMA_INT_DIV(int32_t, int64_t) return 0;
    case PYRDMA_INT64: PYRDMA_INT_DIV(int64_t, int64_t) return 0;
    case PYRDMA_FLOAT32: {
        float *p = (float *)buf, d = (float)n;
        for (i = 0; i < count; i++) p[i] = p[i] / d;
        return 0;
    }
    case PYRDMA_FLOAT64: {
        double *p = (double *)buf, d = (double)n;
        for (i = 0; i < count; i++) p[i] = p[i] / d;
        return 0;
    }
    case PYRDMA_FLOAT16: {
        uint16_t *p = (uint16_t *)buf;
        float d = (float)n;
        for (i = 0; i < count; i++) p[i] = pyrdma_float_to_half(pyrdma_half_to_float(p[i]) / d);
        return 0;
    }
    case PYRDMA_BFLOAT16: {
        uint16_t *p = (uint16_t *)buf;
        float d = (float)n;
        for (i = 0; i < count; i++) p[i] = pyrdma_float_to_bf16(pyrdma_bf16_to_float(p[i]) / d);
        return 0;
    }
    }
    return -1;
}

#endif
