/* Weight-only int8 and int4 matrix-vector products for the few rows of a decode step, on the
 * layouts tpengine.quant.weights already holds (no second copy):
 *
 *   int8, per output channel: q int8 [n, k] row-major, scales [n]; y[r, o] = s[o] * sum_i x[r, i] q[o, i]
 *     (what torch._weight_int8pack_mm computes, up to the order of the float32 sum);
 *   int4, group-wise: torch's _convert_weight_to_int4pack_for_cpu layout of the 0..15 values, blocks
 *     of `block` output rows (64 where torch runs its AVX-512 code, 32 where it runs its AVX2 code);
 *     in a block, column i takes block / 2 bytes, byte j holding row j in its low nibble and row
 *     j + block / 2 in its high one; a last block of nb < block rows takes nb / 2 bytes a column,
 *     byte j holding rows 2j and 2j + 1), scales_and_zeros [groups, n_pad, 2];
 *     y[r, o] = sum_i x[r, i] ((q[o, i] - 8) s[g, o] + z[g, o]), computed per group g as
 *     s * (sum_i x q - 8 sum_i x) + z * sum_i x (what torch._weight_int4pack_mm_for_cpu computes,
 *     up to the order of the float32 sums);
 *   int4 with int8 zero codes: the same values, with scales [groups, n_pad] and zero codes c int8
 *     [groups, n_pad] instead of scales_and_zeros: zero = c * s / 16, computed (c * s) * 0.0625f
 *     (zc NULL: scales_and_zeros).
 *
 * Activations x [rows, k] and outputs y [rows, n] are bfloat16 (is_bf16) or float32, scales bfloat16
 * or float32 likewise; the sums are float32. Rows 1..8, k % 16 == 0 (int4: k % group == 0, group
 * % 16 == 0). A decode step at one row is bound by reading the weight: each weight byte is read
 * once for all rows of x, the output blocks split between the threads. The int8 kernel, which walks
 * weight rows a group at a time, prefetches the next group's rows as it reads a group (without it
 * the hardware prefetcher ramps up on each short row and a full model's int8 weights, read from
 * memory, streamed at about half the rate). Both have AVX-512 and AVX2 paths (bf16.h); the int4
 * AVX-512 path reads 64-row blocks (the layout torch packs on an AVX512 CPU), the AVX2 path both
 * (an AVX2 CPU's torch packs 32-row blocks; one with AVX-512F but not AVX512-BF16 runs this AVX2
 * path on torch's 64-row blocks). Python side: tpengine/backends/cpu/cpu_qgemv.py, which checks the
 * layout torch produced before using these. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define QMAX_ROWS 8
/* int4: how far ahead of the column being read its block's bytes are prefetched. One 4 KiB page: the
 * hardware prefetcher stops at page ends, so a model's weights read from memory (blocks of 64 rows
 * read one after another by each thread) stream slower without it; larger distances gained nothing
 * (figures: docs/notes/kernels.md, "Prefetching the int4 weights"). */
#define Q4_PREFETCH_BYTES 4096
/* The int4 x int8 kernel's weight prefetch goes to L2 (T1), not L1: its lines are read once, a page after
 * the prefetch, while x's int8 blocks and the output sums stay in L1 (docs/notes/kernels.md, "int8 and int4
 * at one row"). */
#define Q8_PREFETCH_HINT _MM_HINT_T1

#if defined(TPE_AVX512) || defined(TPE_AVX2)
#include <immintrin.h>

#include "gemv.h"

static inline float ldf(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void stf(void *p, int64_t i, float v, int is_bf16) {
    if (is_bf16)
        ((uint16_t *)p)[i] = f2bf(v);
    else
        ((float *)p)[i] = v;
}

/* x [rows, k] (bf16 or f32) -> xf [rows, k] float32 */
static void to_f32(const void *x, int64_t rows, int64_t k, int is_bf16, float *xf) {
    for (int64_t i = 0; i < rows * k; i++) xf[i] = ldf(x, i, is_bf16);
}

/* ------------------------------------------------------------------------------------- int8 */
static inline float same_i8(float f) { return f; }
#ifdef TPE_AVX512
static inline __m512 ld_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline __m512 mac_i8(__m512 acc, __m512 x, __m512 w) { return _mm512_fmadd_ps(x, w, acc); }

/* float32 x against int8 rows: the unscaled sums (the scale is applied per output row after) */
TPE_GEMV_FAMILY(q8, int8_t, float, float, 16, __m512, ld_i8, _mm512_loadu_ps, mac_i8, same_i8)
#else /* AVX2: 8 lanes */
static inline __m256 ld_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline __m256 mac_i8(__m256 acc, __m256 x, __m256 w) { return _mm256_fmadd_ps(x, w, acc); }

TPE_GEMV_FAMILY(q8, int8_t, float, float, 8, __m256, ld_i8, _mm256_loadu_ps, mac_i8, same_i8)
#endif

/* x [rows, k], q [n, k] int8, scales [n], y [rows, n]; returns 0, or -1 for rows outside 1..8. */
int64_t tpe_qgemv_int8(const void *x, int64_t rows, int64_t k, const int8_t *q, const void *scales, int64_t n,
                       void *y, int is_bf16, int nthreads) {
    if (rows < 1 || rows > QMAX_ROWS) return -1;
    float *xf = malloc(sizeof(float) * rows * k), *acc = malloc(sizeof(float) * rows * n);
    if (!xf || !acc) {
        free(xf);
        free(acc);
        return -2;
    }
    to_f32(x, rows, k, is_bf16, xf);
    const int64_t chunk = tpe_gemv_chunk(n, nthreads);
#pragma omp parallel for schedule(static, 1) num_threads(nthreads) if (nthreads > 1 && n * k >= 65536)
    for (int64_t o0 = 0; o0 < n; o0 += chunk) {
        const int64_t o1 = o0 + chunk < n ? o0 + chunk : n;
        q8_rows(xf, rows, k, q, o0, o1, acc, n);
        for (int64_t rr = 0; rr < rows; rr++)
            for (int64_t o = o0; o < o1; o++) stf(y, rr * n + o, acc[rr * n + o] * ldf(scales, o, is_bf16), is_bf16);
    }
    free(xf);
    free(acc);
    return 0;
}

/* ------------------------------------------------------------------------------ int4, shared */
/* scale and zero of element idx = g * n_pad + o: from scales_and_zeros [groups, n_pad, 2] (zc NULL), or
 * from scales [groups, n_pad] and the int8 zero codes zc [groups, n_pad] (zero = c * s / 16). */
static inline void q4_sz(const void *sz, const int8_t *zc, int64_t idx, int is_bf16, float *s, float *z) {
    if (zc) {
        *s = ldf(sz, idx, is_bf16);
        *z = ((float)zc[idx] * *s) * 0.0625f;
    } else {
        *s = ldf(sz, 2 * idx, is_bf16);
        *z = ldf(sz, 2 * idx + 1, is_bf16);
    }
}

/* Prefetch the scales (and codes) of the 64 outputs idx..idx + 63 (the next block's, in this group):
 * one strided line set a group, which the hardware prefetcher does not follow. */
static inline void q4_prefetch_sz(const void *sz, const int8_t *zc, int64_t idx, int is_bf16) {
    const int64_t es = is_bf16 ? 2 : 4, sbytes = (zc ? 64 : 128) * es;
    const char *s = (const char *)sz + (zc ? idx : 2 * idx) * es;
    for (int64_t b = 0; b < sbytes; b += 64) _mm_prefetch(s + b, _MM_HINT_T0);
    if (zc) _mm_prefetch((const char *)(zc + idx), _MM_HINT_T0);
}

/* The last block of nb < block rows (rows 2j and 2j + 1 in byte j of each column's nb / 2 bytes), scalar. */
static void q4_tail(const float *x, const float *xs, int64_t rows, int64_t k, int64_t gs, const uint8_t *blk,
                    int64_t nb, const void *sz, const int8_t *zc, int64_t n_pad, int64_t o0, int is_bf16, float *out,
                    int64_t ldo) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < nb; j++) {
            float total = 0.f;
            for (int64_t g = 0; g < k / gs; g++) {
                float acc = 0.f;
                for (int64_t i = g * gs; i < (g + 1) * gs; i++) {
                    const uint8_t b = blk[i * (nb / 2) + j / 2];
                    acc += x[r * k + i] * (float)((j & 1) ? b >> 4 : b & 15);
                }
                const float xsum = xs[r * (k / gs) + g];
                float sc, ze;
                q4_sz(sz, zc, g * n_pad + o0 + j, is_bf16, &sc, &ze);
                total += sc * acc + (ze - 8.f * sc) * xsum;
            }
            out[r * ldo + j] = total;
        }
}

/* The last block's dequantization (dequant_int4 below), scalar. */
static void q4_tail_dequant(const uint8_t *blk, int64_t nb, const void *sz, const int8_t *zc, int64_t gs, int64_t k,
                            int64_t n_pad, int64_t o0, void *wt, int is_bf16) {
    for (int64_t g = 0; g < k / gs; g++)
        for (int64_t j = 0; j < nb; j++) {
            float s, z;
            q4_sz(sz, zc, g * n_pad + o0 + j, is_bf16, &s, &z);
            z -= 8.f * s;
            for (int64_t i = g * gs; i < (g + 1) * gs; i++) {
                const uint8_t v = blk[i * (nb / 2) + j / 2];
                stf(wt, i * n_pad + o0 + j, (float)((j & 1) ? v >> 4 : v & 15) * s + z, is_bf16);
            }
        }
}

#ifdef TPE_AVX512 /* ------------------------------------------------------------- int4, 16 lanes */
/* The packed layouts read: torch's AVX-512 one (64-row blocks). */
static inline int q4_reads(int64_t block) { return block == 64; }

/* The scales and zeros of the 16 outputs idx..idx + 15 (idx = g * n_pad + o), as q4_sz computes them
 * one by one (the same float32 values): scales_and_zeros pairs de-interleaved, or scales and codes. */
static inline void q4_sz16(const void *sz, const int8_t *zc, int64_t idx, int is_bf16, __m512 *s, __m512 *z) {
    if (zc) {
        *s = is_bf16 ? ld((const uint16_t *)sz + idx) : _mm512_loadu_ps((const float *)sz + idx);
        const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(zc + idx))));
        *z = _mm512_mul_ps(_mm512_mul_ps(c, *s), _mm512_set1_ps(0.0625f));
    } else if (is_bf16) { /* 16 (scale, zero) bf16 pairs: one 32-bit lane each */
        const __m512i v = _mm512_loadu_si512((const uint16_t *)sz + 2 * idx);
        *s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        *z = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
    } else {
        const float *f = (const float *)sz + 2 * idx;
        const __m512 a = _mm512_loadu_ps(f), b = _mm512_loadu_ps(f + 16);
        const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        *s = _mm512_permutex2var_ps(a, even, b);
        *z = _mm512_permutex2var_ps(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b);
    }
}

/* The end of group g for R rows of x: res[r][v] += s * (acc[r][v] - off * xsum) + z * xsum over the 64
 * outputs idx..idx + 63 (off: the value offset the loop summed, 8 for (q - 8), 136 for the bfloat16 128 + q;
 * xs[r * xstride]: row r's sum of x over the group). */
static inline void q4_fold(int R, __m512 (*res)[4], __m512 (*acc)[4], const void *sz, const int8_t *zc, int64_t idx,
                           int is_bf16, const float *xs, int64_t xstride, float off) {
    q4_prefetch_sz(sz, zc, idx + 64, is_bf16); /* the next block's, this group */
    for (int v = 0; v < 4; v++) {
        __m512 sv, zv;
        q4_sz16(sz, zc, idx + 16 * v, is_bf16, &sv, &zv);
        for (int r = 0; r < R; r++) {
            const float xsum = xs[r * xstride];
            const __m512 t = _mm512_fmadd_ps(_mm512_set1_ps(-off * xsum), sv, _mm512_mul_ps(_mm512_set1_ps(xsum), zv));
            res[r][v] = _mm512_add_ps(res[r][v], _mm512_fmadd_ps(sv, acc[r][v], t));
        }
    }
}

/* a[r][v] = 0 for the R rows' four 16-output vectors (the block's sums, or one group's). */
#define Q4_ZERO(a, R)                                                                                          \
    for (int r_ = 0; r_ < (R); r_++)                                                                          \
        for (int v_ = 0; v_ < 4; v_++) (a)[r_][v_] = _mm512_setzero_ps()

/* One full 64-row block b, rows r0..r0+R-1 of x: out[r][0..63] = the block's outputs. */
#define Q4_ROWS(R)                                                                                              \
    static void q4_block_##R(const float *x, const float *xs, int64_t k, int64_t gs, const uint8_t *blk,       \
                             const void *sz, const int8_t *zc, int64_t n_pad, int64_t o0, int is_bf16, float *out, int64_t ldo) { \
        const __m128i m4 = _mm_set1_epi8(0x0f);                                                               \
        __m512 res[R][4];                                                                                     \
        Q4_ZERO(res, R);                                                                                      \
        for (int64_t g = 0; g < k / gs; g++) {                                                                \
            __m512 acc[R][4];                                                                                 \
            Q4_ZERO(acc, R);                                                                                  \
            for (int64_t i = g * gs; i < (g + 1) * gs; i++) {                                                 \
                if (!(i & 1)) _mm_prefetch((const char *)(blk + i * 32 + Q4_PREFETCH_BYTES), _MM_HINT_T0);     \
                const __m128i b0 = _mm_loadu_si128((const __m128i *)(blk + i * 32));                          \
                const __m128i b1 = _mm_loadu_si128((const __m128i *)(blk + i * 32 + 16));                     \
                const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b0, m4)));            \
                const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b1, m4)));            \
                const __m512 q2 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b0, 4), m4))); \
                const __m512 q3 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b1, 4), m4))); \
                for (int r = 0; r < R; r++) {                                                                 \
                    const __m512 xv = _mm512_set1_ps(x[r * k + i]);                                           \
                    acc[r][0] = _mm512_fmadd_ps(xv, q0, acc[r][0]);                                           \
                    acc[r][1] = _mm512_fmadd_ps(xv, q1, acc[r][1]);                                           \
                    acc[r][2] = _mm512_fmadd_ps(xv, q2, acc[r][2]);                                           \
                    acc[r][3] = _mm512_fmadd_ps(xv, q3, acc[r][3]);                                           \
                }                                                                                             \
            }                                                                                                 \
            q4_fold(R, res, acc, sz, zc, g * n_pad + o0, is_bf16, xs + g, k / gs, 8.f);                               \
        }                                                                                                     \
        for (int r = 0; r < R; r++)                                                                           \
            for (int v = 0; v < 4; v++) _mm512_storeu_ps(out + r * ldo + 16 * v, res[r][v]);                  \
    }

Q4_ROWS(1)
Q4_ROWS(2)
Q4_ROWS(4)

/* The same block for bfloat16 x, two columns at a time through vdpbf16ps (each 32-bit lane pairs one
 * row's values in columns i and i + 1, as x[i], x[i + 1] are broadcast). One vpermb (zeroing) puts the
 * bytes of 16 rows of both columns in those lanes; a value q then becomes the bfloat16 128 + q (bits
 * 0x4300 | q) with one ternary-logic op and no conversion, so a group's sum is sum x q + 128 sum x and
 * the scale step takes 136 sum x off where the float path takes 8 sum x (float32 sums; the offset costs
 * the sums ~7 of float32's 24 bits, far below the bfloat16 output's rounding). */
#define Q4B_ROWS(R)                                                                                             \
    static void q4b_block_##R(const uint16_t *x, const float *xs, int64_t k, int64_t gs, const uint8_t *blk,   \
                              const void *sz, const int8_t *zc, int64_t n_pad, int64_t o0, float *out,         \
                              int64_t ldo) {                                                                   \
        const __m512i m = _mm512_set1_epi32(0x000f000f), c = _mm512_set1_epi32(0x43004300);                  \
        uint8_t i1[64], i2[64];                                                                               \
        for (int l = 0; l < 16; l++) {                                                                        \
            i1[4 * l] = (uint8_t)l, i1[4 * l + 2] = (uint8_t)(32 + l);                                        \
            i2[4 * l] = (uint8_t)(16 + l), i2[4 * l + 2] = (uint8_t)(48 + l);                                 \
            i1[4 * l + 1] = i1[4 * l + 3] = i2[4 * l + 1] = i2[4 * l + 3] = 0;                                \
        }                                                                                                     \
        const __m512i p1 = _mm512_loadu_si512(i1), p2 = _mm512_loadu_si512(i2);                               \
        const __mmask64 even = 0x5555555555555555ull;                                                         \
        __m512 res[R][4];                                                                                     \
        Q4_ZERO(res, R);                                                                                      \
        for (int64_t g = 0; g < k / gs; g++) {                                                                \
            __m512 acc[R][4];                                                                                 \
            Q4_ZERO(acc, R);                                                                                  \
            for (int64_t i = g * gs; i < (g + 1) * gs; i += 2) {                                              \
                _mm_prefetch((const char *)(blk + i * 32 + Q4_PREFETCH_BYTES), _MM_HINT_T0);                  \
                const __m512i b = _mm512_loadu_si512(blk + i * 32);                                           \
                const __m512i a1 = _mm512_maskz_permutexvar_epi8(even, p1, b);                                \
                const __m512i a2 = _mm512_maskz_permutexvar_epi8(even, p2, b);                                \
                const __m512bh w0 = (__m512bh)_mm512_ternarylogic_epi32(a1, m, c, 0xEA);                      \
                const __m512bh w1 = (__m512bh)_mm512_ternarylogic_epi32(a2, m, c, 0xEA);                      \
                const __m512bh w2 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(a1, 4), m, c, 0xEA); \
                const __m512bh w3 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(a2, 4), m, c, 0xEA); \
                for (int r = 0; r < R; r++) {                                                                 \
                    int32_t pair;                                                                             \
                    memcpy(&pair, x + r * k + i, 4);                                                          \
                    const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);                                    \
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);                                          \
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);                                          \
                    acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xv, w2);                                          \
                    acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xv, w3);                                          \
                }                                                                                             \
            }                                                                                                 \
            q4_fold(R, res, acc, sz, zc, g * n_pad + o0, 1, xs + g, k / gs, 136.f);                                   \
        }                                                                                                     \
        for (int r = 0; r < R; r++)                                                                           \
            for (int v = 0; v < 4; v++) _mm512_storeu_ps(out + r * ldo + 16 * v, res[r][v]);                  \
    }

Q4B_ROWS(1)
Q4B_ROWS(2)

/* One full 64-row block at o0 (w == 64), every row of x: out[r * ldo + 0..63]. */
static void q4_unit(const void *x, const float *xf, const float *xs, int64_t rows, int64_t k, int64_t gs,
                    const uint8_t *packed, int64_t block, int64_t o0, int64_t w, const void *sz, const int8_t *zc,
                    int64_t n_pad, int is_bf16, float *out, int64_t ldo) {
    (void)block, (void)w;
    const uint8_t *blk = packed + o0 * k / 2;
    const int64_t groups = k / gs;
    int64_t r = 0;
    if (is_bf16 && rows < 4) { /* more rows: the float kernel's FMAs, on two ports, are faster */
        const uint16_t *xb = (const uint16_t *)x;
        for (; r + 2 <= rows; r += 2)
            q4b_block_2(xb + r * k, xs + r * groups, k, gs, blk, sz, zc, n_pad, o0, out + r * ldo, ldo);
        for (; r < rows; r++)
            q4b_block_1(xb + r * k, xs + r * groups, k, gs, blk, sz, zc, n_pad, o0, out + r * ldo, ldo);
    }
    for (; r + 4 <= rows; r += 4)
        q4_block_4(xf + r * k, xs + r * groups, k, gs, blk, sz, zc, n_pad, o0, is_bf16, out + r * ldo, ldo);
    for (; r + 2 <= rows; r += 2)
        q4_block_2(xf + r * k, xs + r * groups, k, gs, blk, sz, zc, n_pad, o0, is_bf16, out + r * ldo, ldo);
    for (; r < rows; r++)
        q4_block_1(xf + r * k, xs + r * groups, k, gs, blk, sz, zc, n_pad, o0, is_bf16, out + r * ldo, ldo);
}

/* wt[i, o0 + 0..63] of one full 64-row block (tpe_dequant_int4). */
static void q4_unit_dequant(const uint8_t *packed, int64_t block, int64_t o0, int64_t w, const void *sz,
                            const int8_t *zc, int64_t gs, int64_t k, int64_t n_pad, void *wt, int is_bf16) {
    (void)block, (void)w;
    const uint8_t *blk = packed + o0 * k / 2;
    const __m128i m4 = _mm_set1_epi8(0x0f);
    float s[64], z[64];
    for (int64_t g = 0; g < k / gs; g++) {
        for (int64_t j = 0; j < 64; j++) {
            q4_sz(sz, zc, g * n_pad + o0 + j, is_bf16, s + j, z + j);
            z[j] -= 8.f * s[j];
        }
        for (int64_t i = g * gs; i < (g + 1) * gs; i++) {
            const __m128i b0 = _mm_loadu_si128((const __m128i *)(blk + i * 32));
            const __m128i b1 = _mm_loadu_si128((const __m128i *)(blk + i * 32 + 16));
            const __m128i nib[4] = {_mm_and_si128(b0, m4), _mm_and_si128(b1, m4),
                                    _mm_and_si128(_mm_srli_epi16(b0, 4), m4), _mm_and_si128(_mm_srli_epi16(b1, 4), m4)};
            for (int v = 0; v < 4; v++) {
                const __m512 q = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nib[v])),
                                                 _mm512_loadu_ps(s + 16 * v), _mm512_loadu_ps(z + 16 * v));
                if (is_bf16)
                    st((uint16_t *)wt + i * n_pad + o0 + 16 * v, q);
                else
                    _mm512_storeu_ps((float *)wt + i * n_pad + o0 + 16 * v, q);
            }
        }
    }
}

#else /* TPE_AVX2 ---------------------------------------------------------------- int4, 8 lanes */
/* The packed layouts read: torch's AVX-512 one (64-row blocks) and its AVX2 one (32-row blocks). */
static inline int q4_reads(int64_t block) { return block == 64 || block == 32; }

/* The scales and zeros of the 8 outputs idx..idx + 7, as q4_sz computes them one by one. */
static inline void q4_sz8(const void *sz, const int8_t *zc, int64_t idx, int is_bf16, __m256 *s, __m256 *z) {
    if (zc) {
        *s = is_bf16 ? ld8((const uint16_t *)sz + idx) : _mm256_loadu_ps((const float *)sz + idx);
        const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(zc + idx))));
        *z = _mm256_mul_ps(_mm256_mul_ps(c, *s), _mm256_set1_ps(0.0625f));
    } else if (is_bf16) { /* 8 (scale, zero) bf16 pairs: one 32-bit lane each */
        const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)sz + 2 * idx));
        *s = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        *z = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
    } else { /* s0 z0 .. s3 z3, s4 z4 .. s7 z7: the even (odd) lanes of each 128-bit half, then the 64-bit pairs in order */
        const float *f = (const float *)sz + 2 * idx;
        const __m256 a = _mm256_loadu_ps(f), b = _mm256_loadu_ps(f + 8);
        *s = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0))),
                                                    _MM_SHUFFLE(3, 1, 2, 0)));
        *z = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))),
                                                    _MM_SHUFFLE(3, 1, 2, 0)));
    }
}

/* A unit of 64 outputs (32: a last lone 32-row block) read as nc chunks of 8 bytes a column, each
 * widened to 8 int32 lanes: chunk c of column i is the 8 bytes at p[c] + i * cs, their low nibbles
 * the unit's outputs lo[c]..lo[c] + 7 and their high ones hi[c]..hi[c] + 7. One 64-row block: the
 * column's 32 bytes, lo = 0, 8, 16, 24, hi = lo + 32; two 32-row blocks A, B: 16 bytes of each,
 * lo = 0, 8 (A), 32, 40 (B), hi = lo + 16. pf: the nf byte streams, prefetched ahead. */
typedef struct {
    const uint8_t *p[4], *pf[2];
    int64_t cs;
    int lo[4], hi[4], nc, nf;
} q4_unit_t;

static q4_unit_t q4_unit_at(const uint8_t *packed, int64_t k, int64_t block, int64_t o0, int64_t w) {
    q4_unit_t u = {.cs = block / 2, .nc = (int)(w / 16)};
    const uint8_t *blk = packed + o0 * k / 2;
    for (int c = 0; c < u.nc; c++) {
        if (block == 64) {
            u.p[c] = blk + 8 * c, u.lo[c] = 8 * c, u.hi[c] = 32 + 8 * c;
        } else {
            u.p[c] = blk + (c / 2) * 16 * k + 8 * (c % 2), u.lo[c] = 32 * (c / 2) + 8 * (c % 2), u.hi[c] = u.lo[c] + 16;
        }
    }
    u.pf[0] = blk, u.pf[1] = u.nc > 2 ? u.p[2] : blk, u.nf = block == 32 && u.nc > 2 ? 2 : 1;
    return u;
}

/* Rows r0..r0 + R - 1 of x against one unit: out[r * ldo + 0..16 nc - 1] = the unit's outputs. Each
 * group is read in passes of NC chunks, 2 NC accumulators a row (R * NC <= 4: the accumulators, x and
 * the widened bytes stay in the 16 registers), and a pass folds its sums into out, s * (acc - 8 xsum)
 * + z * xsum, the float AVX-512 path's fold. Widening the bytes costs more than the FMAs at one row,
 * so more rows a pass share it: 1 row reads 4 chunks a pass, 2 rows 2, 3 and 4 rows 1 (8 accumulators,
 * enough to cover the FMA latency on both pipes; each faster than the other splits measured,
 * docs/notes/avx2.md). The bytes are prefetched a page ahead, as in the AVX-512 path. */
#define Q4A_ROWS(R, NC)                                                                                        \
    static void q4a_rows_##R##_##NC(const float *x, const float *xs, int64_t k, int64_t gs, const q4_unit_t *u, \
                                    const void *sz, const int8_t *zc, int64_t n_pad, int64_t o0, int is_bf16,  \
                                    float *out, int64_t ldo) {                                                 \
        const __m256i m4 = _mm256_set1_epi32(15);                                                             \
        const int64_t groups = k / gs, cs = u->cs;                                                            \
        for (int r = 0; r < R; r++) memset(out + r * ldo, 0, sizeof(float) * 16 * u->nc);                    \
        for (int64_t g = 0; g < groups; g++) {                                                                \
            q4_prefetch_sz(sz, zc, g * n_pad + o0 + 64, is_bf16); /* the next unit's, this group */           \
            for (int c0 = 0; c0 < u->nc; c0 += NC) {                                                          \
                __m256 acc[R][NC][2];                                                                         \
                for (int r = 0; r < R; r++)                                                                   \
                    for (int c = 0; c < NC; c++) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();           \
                for (int64_t i = g * gs; i < (g + 1) * gs; i++) {                                             \
                    if (c0 == 0 && !((i * cs) & 63))                                                          \
                        for (int f = 0; f < u->nf; f++)                                                       \
                            _mm_prefetch((const char *)(u->pf[f] + i * cs + Q4_PREFETCH_BYTES), _MM_HINT_T0);  \
                    __m256 xv[R];                                                                             \
                    for (int r = 0; r < R; r++) xv[r] = _mm256_set1_ps(x[r * k + i]);                         \
                    for (int c = 0; c < NC; c++) {                                                            \
                        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u->p[c0 + c] + i * cs))); \
                        const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, m4));                        \
                        const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));                        \
                        for (int r = 0; r < R; r++) {                                                         \
                            acc[r][c][0] = _mm256_fmadd_ps(xv[r], lo, acc[r][c][0]);                          \
                            acc[r][c][1] = _mm256_fmadd_ps(xv[r], hi, acc[r][c][1]);                          \
                        }                                                                                     \
                    }                                                                                         \
                }                                                                                             \
                for (int c = 0; c < NC; c++)                                                                  \
                    for (int h = 0; h < 2; h++) {                                                             \
                        const int off = h ? u->hi[c0 + c] : u->lo[c0 + c];                                   \
                        __m256 sv, zv;                                                                        \
                        q4_sz8(sz, zc, g * n_pad + o0 + off, is_bf16, &sv, &zv);                              \
                        for (int r = 0; r < R; r++) {                                                         \
                            const float xsum = xs[r * groups + g];                                            \
                            const __m256 t = _mm256_fmadd_ps(_mm256_set1_ps(-8.f * xsum), sv,                 \
                                                             _mm256_mul_ps(_mm256_set1_ps(xsum), zv));        \
                            float *o = out + r * ldo + off;                                                   \
                            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), _mm256_fmadd_ps(sv, acc[r][c][h], t))); \
                        }                                                                                     \
                    }                                                                                         \
            }                                                                                                 \
        }                                                                                                     \
    }

Q4A_ROWS(1, 4)
Q4A_ROWS(1, 2)
Q4A_ROWS(2, 2)
Q4A_ROWS(3, 1)
Q4A_ROWS(4, 1)

/* One unit at o0 (w outputs: 64, or 32 for a lone 32-row block), every row of x (bfloat16 x is read
 * from xf, widened): out[r * ldo + 0..w - 1]. */
static void q4_unit(const void *x, const float *xf, const float *xs, int64_t rows, int64_t k, int64_t gs,
                    const uint8_t *packed, int64_t block, int64_t o0, int64_t w, const void *sz, const int8_t *zc,
                    int64_t n_pad, int is_bf16, float *out, int64_t ldo) {
    (void)x;
    const q4_unit_t u = q4_unit_at(packed, k, block, o0, w);
    const int64_t groups = k / gs;
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4)
        q4a_rows_4_1(xf + r * k, xs + r * groups, k, gs, &u, sz, zc, n_pad, o0, is_bf16, out + r * ldo, ldo);
    if (rows - r == 3)
        q4a_rows_3_1(xf + r * k, xs + r * groups, k, gs, &u, sz, zc, n_pad, o0, is_bf16, out + r * ldo, ldo);
    else if (rows - r == 2)
        q4a_rows_2_2(xf + r * k, xs + r * groups, k, gs, &u, sz, zc, n_pad, o0, is_bf16, out + r * ldo, ldo);
    else if (rows - r == 1)
        (u.nc == 4 ? q4a_rows_1_4 : q4a_rows_1_2)(xf + r * k, xs + r * groups, k, gs, &u, sz, zc, n_pad, o0, is_bf16,
                                                  out + r * ldo, ldo);
}

/* wt[i, o0 + 0..w - 1] of one unit (tpe_dequant_int4): each widened chunk, q * s + (z - 8 s) in one FMA. */
static void q4_unit_dequant(const uint8_t *packed, int64_t block, int64_t o0, int64_t w, const void *sz,
                            const int8_t *zc, int64_t gs, int64_t k, int64_t n_pad, void *wt, int is_bf16) {
    const q4_unit_t u = q4_unit_at(packed, k, block, o0, w);
    const __m256i m4 = _mm256_set1_epi32(15);
    float s[64], z[64];
    for (int64_t g = 0; g < k / gs; g++) {
        for (int64_t j = 0; j < w; j++) {
            q4_sz(sz, zc, g * n_pad + o0 + j, is_bf16, s + j, z + j);
            z[j] -= 8.f * s[j];
        }
        for (int64_t i = g * gs; i < (g + 1) * gs; i++)
            for (int c = 0; c < u.nc; c++) {
                const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u.p[c] + i * u.cs)));
                const __m256 nib[2] = {_mm256_cvtepi32_ps(_mm256_and_si256(v, m4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4))};
                for (int h = 0; h < 2; h++) {
                    const int off = h ? u.hi[c] : u.lo[c];
                    const __m256 q = _mm256_fmadd_ps(nib[h], _mm256_loadu_ps(s + off), _mm256_loadu_ps(z + off));
                    if (is_bf16)
                        st8((uint16_t *)wt + i * n_pad + o0 + off, q);
                    else
                        _mm256_storeu_ps((float *)wt + i * n_pad + o0 + off, q);
                }
            }
    }
}
#endif

/* x [rows, k]; packed: the int4 layout above for n_pad rows (a multiple of 16) in blocks of `block`
 * rows (one this build reads: q4_reads); sz [k / gs, n_pad, 2], or scales [k / gs, n_pad] with the
 * zero codes zc [k / gs, n_pad] (zc not NULL); y [rows, n] (the first n <= n_pad rows). The full
 * blocks are read as units of 64 outputs (two 32-row blocks, or a last lone one), the rows of the
 * last, shorter block scalar. Returns 0, or -1 for bad arguments (rows outside 1..8, k or gs not
 * multiples of 16, k % gs, n > n_pad, n_pad % 16, a block this build does not read). */
int64_t tpe_qgemv_int4(const void *x, int64_t rows, int64_t k, const uint8_t *packed, const void *sz,
                       const int8_t *zc, int64_t gs, int64_t n, int64_t n_pad, int64_t block, void *y, int is_bf16,
                       int nthreads) {
    if (rows < 1 || rows > QMAX_ROWS || k % 16 || gs % 16 || gs <= 0 || k % gs || n > n_pad || n_pad % 16 ||
        !q4_reads(block))
        return -1;
    const int64_t groups = k / gs, full = n_pad / block * block, units = (full + 63) / 64;
    float *xf = malloc(sizeof(float) * rows * k), *xs = malloc(sizeof(float) * rows * groups);
    float *out = malloc(sizeof(float) * rows * n_pad);
    if (!xf || !xs || !out) {
        free(xf);
        free(xs);
        free(out);
        return -2;
    }
    to_f32(x, rows, k, is_bf16, xf);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            float t = 0.f;
            for (int64_t i = g * gs; i < (g + 1) * gs; i++) t += xf[r * k + i];
            xs[r * groups + g] = t;
        }
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && n_pad * k >= 65536)
    for (int64_t b = 0; b < units + (full < n_pad); b++) {
        const int64_t o0 = b < units ? b * 64 : full, w = b < units ? (full - o0 < 64 ? full - o0 : 64) : n_pad - full;
        if (b < units)
            q4_unit(x, xf, xs, rows, k, gs, packed, block, o0, w, sz, zc, n_pad, is_bf16, out + o0, n_pad);
        else
            q4_tail(xf, xs, rows, k, gs, packed + o0 * k / 2, w, sz, zc, n_pad, o0, is_bf16, out + o0, n_pad);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t o = o0; o < o0 + w && o < n; o++) stf(y, r * n + o, out[r * n_pad + o], is_bf16);
    }
    free(xf);
    free(xs);
    free(out);
    return 0;
}

/* ------------------------------------------------------------------------ int4 -> float, transposed */
/* wt [k, n_pad] (bf16 or f32): wt[i, o] = (q[o, i] - 8) * s[g, o] + z[g, o], the int4 weight of the
 * layout above dequantized and transposed (each column of a unit gives its consecutive outputs), for a
 * prefill's GEMM: x @ wt, computed q * s + (z - 8 s). The last, shorter block is read scalar.
 * Returns 0, or -1 for bad arguments (gs not a positive multiple of 16, k % gs, n_pad % 16, a block
 * this build does not read). */
int64_t tpe_dequant_int4(const uint8_t *packed, const void *sz, const int8_t *zc, int64_t gs, int64_t k,
                         int64_t n_pad, int64_t block, void *wt, int is_bf16, int nthreads) {
    if (gs % 16 || gs <= 0 || k % gs || n_pad % 16 || !q4_reads(block)) return -1;
    const int64_t full = n_pad / block * block, units = (full + 63) / 64;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && n_pad * k >= 65536)
    for (int64_t b = 0; b < units + (full < n_pad); b++) {
        const int64_t o0 = b < units ? b * 64 : full, w = b < units ? (full - o0 < 64 ? full - o0 : 64) : n_pad - full;
        if (b < units)
            q4_unit_dequant(packed, block, o0, w, sz, zc, gs, k, n_pad, wt, is_bf16);
        else
            q4_tail_dequant(packed + o0 * k / 2, w, sz, zc, gs, k, n_pad, o0, wt, is_bf16);
    }
    return 0;
}

/* ------------------------------------------------------------------------ int4 rows, as stored */
/* out [m, k] (bf16 or f32): rows ids[0..m - 1] of an int4 weight of the layout above, dequantized --
 * out[j, i] = (q[ids[j], i] - 8) * s + z, the product rounded to float32 before the sum (torch's
 * order, which tpengine.model.quant.weights computes off this path): an embedding lookup in a
 * quantized vocabulary. Every id is checked before anything is written. Returns -1 when done, the
 * position j of the first id outside 0..n_pad - 1 (nothing written), or -2 for bad arguments (gs not
 * a positive multiple of 16, k % gs, n_pad % 16, a block this build does not read). */
int64_t tpe_int4_rows(const uint8_t *packed, const void *sz, const int8_t *zc, int64_t gs, int64_t k, int64_t n_pad,
                      int64_t block, const int64_t *ids, int64_t m, void *out, int is_bf16, int nthreads) {
    if (gs % 16 || gs <= 0 || k % gs || n_pad % 16 || !q4_reads(block)) return -2;
    for (int64_t j = 0; j < m; j++)
        if (ids[j] < 0 || ids[j] >= n_pad) return j;
    const int64_t full = n_pad / block * block, half = block / 2, tail_half = (n_pad - full) / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && m * k >= 65536)
    for (int64_t j = 0; j < m; j++) {
        const int64_t o = ids[j];
        const uint8_t *col; /* the byte of row o in column 0; column i's is i * stride further */
        int64_t stride;
        int shift;
        if (o < full) {
            const int64_t r = o % block;
            col = packed + (o - r) * k / 2 + r % half, stride = half, shift = r < half ? 0 : 4;
        } else {
            col = packed + full * k / 2 + (o - full) / 2, stride = tail_half, shift = (o - full) % 2 ? 4 : 0;
        }
        for (int64_t g = 0; g < k / gs; g++) {
            float s, z;
            q4_sz(sz, zc, g * n_pad + o, is_bf16, &s, &z);
            for (int64_t i = g * gs; i < (g + 1) * gs; i++) {
                float v = (float)(((col[i * stride] >> shift) & 15) - 8) * s;
                __asm__("" : "+x"(v)); /* rounded: no fused multiply-add with the sum */
                stf(out, j * k + i, v + z, is_bf16);
            }
        }
    }
    return -1;
}

/* ------------------------------------------------------------------ int4 x int8, integer products */
/* The same int4 weights against activations quantized to int8 in blocks of 32 (llama.cpp's q8 blocks, its
 * ggml_vec_dot_q4_1_q8_1 arithmetic): per row of x and block b of 32 columns, d = max |x| / 127 and
 * xq = x * (127 / max |x|) rounded to the nearest integer (ties to even), |xq| <= 127; then per output o
 *   y[o] = sum_b s[g(b), o] * d_b * (sum_{i in b} q[o, i] xq_i) + (z - 8 s)[g(b), o] * d_b * (sum_{i in b} xq_i),
 * i.e. exactly the float path's formula applied to the dequantized activations d_b xq_i, the inner sums in
 * int32 (a block's sum is exact). What it differs by from the float path is the activations' rounding,
 * |x_i - d_b xq_i| <= d_b / 2 (tests/test_cpu_qgemv.py bounds the product by it). The 0..15 values are
 * read as unsigned bytes against the signed xq (the -8 is in the zero term, as q4_1's min is): 4 columns
 * of a unit's 64 rows are regrouped so that each 32-bit lane holds one row's 4 values (AVX-512: two vpermt2b
 * per 128 bytes; AVX2: byte and word unpacks), multiplied and summed by vpdpbusd (AVX512-VNNI, or AVX-VNNI /
 * AVX512-VNNI on 256 bits) or by vpmaddubsw (AVX2), whose 16-bit sums hold a whole block (at most
 * 16 x 15 x 127 = 30480) before one vpmaddwd widens them. The AVX-512 path masks the high nibbles in
 * place (16 q: its sums are 32-bit) and folds 1/16 into the block's scale. With zero codes the AVX2 path
 * folds a block as s * (d * sum q xq + (c / 16 - 8) * sd) in three fused multiply-adds (q8_fold8), the
 * AVX-512 path as written above: the two builds' results differ by float32's rounding. Built where the
 * ISA has it: AVX-512 with VNNI and VBMI (64-row blocks), or AVX2 (64- and 32-row blocks, as tpe_qgemv_int4). */
#if (defined(TPE_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)) || defined(TPE_AVX2)
#define Q8_BLOCK 32

/* 8 float32 values of x at i (bfloat16 widened). */
static inline __m256 q8_ld8(const void *x, int64_t i, int is_bf16) {
    if (!is_bf16) return _mm256_loadu_ps((const float *)x + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* x [rows, k] -> xq int8 [rows, k], d [rows, k / 32] (the blocks' scales) and sd [rows, k / 32] (d * the
 * block's sum of xq: its dequantized sum, the zero term's factor). */
static void q8_quantize(const void *x, int64_t rows, int64_t k, int is_bf16, int8_t *xq, float *d, float *sd) {
    const int64_t nb = k / Q8_BLOCK;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t i0 = r * k + b * Q8_BLOCK;
            __m256 v[4], m = _mm256_setzero_ps();
            for (int t = 0; t < 4; t++) {
                v[t] = q8_ld8(x, i0 + 8 * t, is_bf16);
                m = _mm256_max_ps(m, _mm256_and_ps(v[t], absmask));
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            const float amax = _mm_cvtss_f32(h), id = amax > 0.f ? 127.f / amax : 0.f;
            __m256i q[4];
            for (int t = 0; t < 4; t++) q[t] = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], _mm256_set1_ps(id)));
            const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
            /* packs interleave the 128-bit halves: dwords q0[0..3] q1[0..3] q2 q3 | q0[4..7] ..., put back in order */
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(xq + i0), _mm256_permutevar8x32_epi32(p, order));
            d[r * nb + b] = amax / 127.f;
            sd[r * nb + b] = (amax / 127.f) * (float)_mm_cvtsi128_si32(s4);
        }
}

/* The last block of nb < 64 rows (rows 2j and 2j + 1 in byte j of each column's nb / 2 bytes), scalar. */
static void q8_tail(const int8_t *xq, const float *d, const float *sd, int64_t rows, int64_t k, int64_t gs,
                    const uint8_t *blk, int64_t nb, const void *sz, const int8_t *zc, int64_t n_pad, int64_t o0,
                    int is_bf16, float *out, int64_t ldo) {
    const int64_t nblk = k / Q8_BLOCK;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < nb; j++) {
            float total = 0.f;
            for (int64_t b = 0; b < nblk; b++) {
                int32_t acc = 0;
                for (int64_t i = b * Q8_BLOCK; i < (b + 1) * Q8_BLOCK; i++) {
                    const uint8_t v = blk[i * (nb / 2) + j / 2];
                    acc += (int32_t)((j & 1) ? v >> 4 : v & 15) * xq[r * k + i];
                }
                float s, z;
                q4_sz(sz, zc, (b * Q8_BLOCK / gs) * n_pad + o0 + j, is_bf16, &s, &z);
                total += s * ((float)acc * d[r * nblk + b]) + (z - 8.f * s) * sd[r * nblk + b];
            }
            out[r * ldo + j] = total;
        }
}

#if defined(TPE_AVX512)
/* Rows r0..r0 + R - 1 of x against block b (32 columns) of one 64-row unit p: out[r][0..63] +=
 * s * (d * sum q xq) + (z - 8 s) * sd, the scales s and zz = z - 8 s of the block's group given. */
static inline __attribute__((always_inline)) void q8_rows512(const int R, const int8_t *xq, const float *d,
                                                              const float *sd, int64_t k, int64_t b,
                                                              const uint8_t *p, const __m512 *s, const __m512 *zz,
                                                              int prefetch, float *out, int64_t ldo) {
    static const uint8_t i0[64] = {0,  32, 64, 96,  1,  33, 65, 97,  2,  34, 66, 98,  3,  35, 67, 99,
                                   4,  36, 68, 100, 5,  37, 69, 101, 6,  38, 70, 102, 7,  39, 71, 103,
                                   8,  40, 72, 104, 9,  41, 73, 105, 10, 42, 74, 106, 11, 43, 75, 107,
                                   12, 44, 76, 108, 13, 45, 77, 109, 14, 46, 78, 110, 15, 47, 79, 111};
    const __m512i p0 = _mm512_loadu_si512(i0), p1 = _mm512_add_epi8(p0, _mm512_set1_epi8(16));
    const __m512i mlo = _mm512_set1_epi8(0x0f), mhi = _mm512_set1_epi8((char)0xf0);
    const int64_t nblk = k / Q8_BLOCK;
    __m512i acc[4][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_si512();
    for (int st = 0; st < 8; st++) { /* 4 columns: 128 bytes */
        const uint8_t *c = p + st * 128;
        if (prefetch) {
            _mm_prefetch((const char *)(c + Q4_PREFETCH_BYTES), Q8_PREFETCH_HINT);
            _mm_prefetch((const char *)(c + Q4_PREFETCH_BYTES + 64), Q8_PREFETCH_HINT);
        }
        const __m512i a = _mm512_loadu_si512(c), e = _mm512_loadu_si512(c + 64);
        const __m512i t0 = _mm512_permutex2var_epi8(a, p0, e), t1 = _mm512_permutex2var_epi8(a, p1, e);
        const __m512i w[4] = {_mm512_and_si512(t0, mlo), _mm512_and_si512(t1, mlo), _mm512_and_si512(t0, mhi),
                              _mm512_and_si512(t1, mhi)};
        for (int r = 0; r < R; r++) {
            int32_t x4;
            memcpy(&x4, xq + r * k + b * Q8_BLOCK + 4 * st, 4);
            const __m512i xb = _mm512_set1_epi32(x4);
            for (int v = 0; v < 4; v++) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], w[v], xb);
        }
    }
    for (int r = 0; r < R; r++) {
        const float dr = d[r * nblk + b];
        const __m512 dl = _mm512_set1_ps(dr), dh = _mm512_set1_ps(dr * 0.0625f), sr = _mm512_set1_ps(sd[r * nblk + b]);
        for (int v = 0; v < 4; v++) {
            float *o = out + r * ldo + 16 * v;
            const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][v]), v < 2 ? dl : dh);
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_fmadd_ps(s[v], f, _mm512_mul_ps(zz[v], sr))));
        }
    }
}

/* One full 64-row unit at o0, every row of x, the column blocks b0..b1 - 1 (32 columns each): out[r * ldo +
 * 0..63] = their sum. */
static void q8_unit(const int8_t *xq, const float *d, const float *sd, int64_t rows, int64_t k, int64_t gs,
                    const uint8_t *packed, int64_t block, int64_t o0, int64_t w, const void *sz, const int8_t *zc,
                    int64_t n_pad, int is_bf16, int64_t b0, int64_t b1, float *out, int64_t ldo) {
    (void)block, (void)w; /* one 64-row block */
    const uint8_t *blk = packed + o0 * k / 2;
    const int64_t nblk = k / Q8_BLOCK;
    for (int64_t r = 0; r < rows; r++) memset(out + r * ldo, 0, sizeof(float) * 64);
    for (int64_t b = b0; b < b1; b++) {
        const int64_t idx = (b * Q8_BLOCK / gs) * n_pad + o0;
        __m512 s[4], zz[4];
        if ((b * Q8_BLOCK) % gs == 0) q4_prefetch_sz(sz, zc, idx + 64, is_bf16); /* the next unit's, this group */
        for (int v = 0; v < 4; v++) {
            q4_sz16(sz, zc, idx + 16 * v, is_bf16, &s[v], &zz[v]);
            zz[v] = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s[v], zz[v]);
        }
        const uint8_t *p = blk + b * Q8_BLOCK * 32;
        int64_t r = 0;
        for (; r + 4 <= rows; r += 4)
            q8_rows512(4, xq + r * k, d + r * nblk, sd + r * nblk, k, b, p, s, zz, r == 0, out + r * ldo, ldo);
        if (rows - r == 3)
            q8_rows512(3, xq + r * k, d + r * nblk, sd + r * nblk, k, b, p, s, zz, r == 0, out + r * ldo, ldo);
        else if (rows - r == 2)
            q8_rows512(2, xq + r * k, d + r * nblk, sd + r * nblk, k, b, p, s, zz, r == 0, out + r * ldo, ldo);
        else if (rows - r == 1)
            q8_rows512(1, xq + r * k, d + r * nblk, sd + r * nblk, k, b, p, s, zz, r == 0, out + r * ldo, ldo);
    }
}
#else /* TPE_AVX2: 8 lanes */
#if defined(__AVXVNNI__) && !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define Q8_DPBUSD(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_DPBUSD(acc, w, x) _mm256_dpbusd_epi32(acc, w, x)
#endif

/* The fold of 8 outputs' int32 sums a of one block b of x into out (o): with zero codes (zc), s and c the
 * outputs' scales and codes as float32 (z = c s / 16),
 *   o += s * (d * a + (c / 16 - 8) * sd)     in three fused multiply-adds (sd16 = sd / 16, m8sd = -8 sd),
 * the float path's s * (d * a) + (z - 8 s) * sd up to float32's rounding in fewer operations (no z, no z - 8 s,
 * no separate products); without codes (float zeros: c holds z - 8 s) o += s * (d * a) + c * sd. Every AVX2
 * pass folds through here, so a row's result is the same at every row count. */
static inline __attribute__((always_inline)) void q8_fold8(const __m256i a, __m256 s, __m256 c, int coded, __m256 dr,
                                                            __m256 sr, __m256 sd16, __m256 m8sd, float *o) {
    if (coded) {
        const __m256 u = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), dr, _mm256_fmadd_ps(c, sd16, m8sd));
        _mm256_storeu_ps(o, _mm256_fmadd_ps(s, u, _mm256_loadu_ps(o)));
    } else {
        const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(a), dr);
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), _mm256_fmadd_ps(s, f, _mm256_mul_ps(c, sr))));
    }
}

/* The scales s of 8 outputs at idx and, with zero codes, their codes as float32 (q8_fold8's c), else z - 8 s. */
static inline __attribute__((always_inline)) void q8_sc8(const void *sz, const int8_t *zc, int64_t idx, int is_bf16,
                                                          __m256 *s, __m256 *c) {
    if (zc) {
        *s = is_bf16 ? ld8((const uint16_t *)sz + idx) : _mm256_loadu_ps((const float *)sz + idx);
        *c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(zc + idx))));
    } else {
        q4_sz8(sz, zc, idx, is_bf16, s, c);
        *c = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), *s, *c);
    }
}

/* Rows r0..r0 + R - 1 of x against block b (32 columns) of one unit, one nibble h (0: low, 1: high):
 * out[r][off[t]..off[t] + 7] += the fold (q8_fold8) of sum q xq for t = 0..3 (s, c: those outputs' scales
 * and codes, or z - 8 s). A column's 32 bytes: one 64-row block's (pa; the unit's rows j and 32 + j in byte j), or
 * two 32-row blocks' 16 bytes each (pa, pb; rows j and 16 + j of each), as the lanes' halves. Each step's 4
 * columns are unpacked (bytes, then 16-bit pairs) into 4 vectors whose 32-bit lanes hold one row's 4
 * values: bytes {0-3, 16-19}, {4-7, 20-23}, {8-11, 24-27}, {12-15, 28-31} of the column, put back in order
 * (bytes 0-7, 8-15, 16-23, 24-31) after the block's sums. `nt`: the vectors stored (2: a lone 32-row block). */
static inline __attribute__((always_inline)) void q8_rows256(const int R, const int8_t *xq, const float *d,
                                                              const float *sd, int64_t k, int64_t b,
                                                              const uint8_t *pa, const uint8_t *pb, int64_t cs,
                                                              int h, const __m256 *s, const __m256 *c, int coded,
                                                              const int *off, int nt, int prefetch, float *out,
                                                              int64_t ldo) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const int64_t nblk = k / Q8_BLOCK;
    __m256i acc[2][4];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < 4; t++) acc[r][t] = _mm256_setzero_si256();
    for (int st = 0; st < 8; st++) {
        const int64_t col = b * Q8_BLOCK + 4 * st;
        if (prefetch) {
            _mm_prefetch((const char *)(pa + col * cs + Q4_PREFETCH_BYTES), _MM_HINT_T0);
            _mm_prefetch((const char *)(pa + col * cs + Q4_PREFETCH_BYTES + 64), _MM_HINT_T0);
            if (cs == 16) _mm_prefetch((const char *)(pb + col * cs + Q4_PREFETCH_BYTES), _MM_HINT_T0);
        }
        __m256i n[4];
        for (int j = 0; j < 4; j++) {
            const __m256i v = cs == 32 ? _mm256_loadu_si256((const __m256i *)(pa + (col + j) * 32))
                                       : _mm256_inserti128_si256(
                                             _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(pa + (col + j) * 16))),
                                             _mm_loadu_si128((const __m128i *)(pb + (col + j) * 16)), 1);
            n[j] = _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, m4);
        }
        const __m256i ab0 = _mm256_unpacklo_epi8(n[0], n[1]), ab1 = _mm256_unpackhi_epi8(n[0], n[1]);
        const __m256i cd0 = _mm256_unpacklo_epi8(n[2], n[3]), cd1 = _mm256_unpackhi_epi8(n[2], n[3]);
        const __m256i w[4] = {_mm256_unpacklo_epi16(ab0, cd0), _mm256_unpackhi_epi16(ab0, cd0),
                              _mm256_unpacklo_epi16(ab1, cd1), _mm256_unpackhi_epi16(ab1, cd1)};
        for (int r = 0; r < R; r++) {
            int32_t x4;
            memcpy(&x4, xq + r * k + col, 4);
            const __m256i xb = _mm256_set1_epi32(x4);
            for (int t = 0; t < 4; t++)
#ifdef Q8_DPBUSD
                acc[r][t] = Q8_DPBUSD(acc[r][t], w[t], xb);
#else
                acc[r][t] = _mm256_add_epi16(acc[r][t], _mm256_maddubs_epi16(w[t], xb));
#endif
        }
    }
    for (int r = 0; r < R; r++) {
        __m256i a[4];
        for (int t = 0; t < 4; t++)
#ifdef Q8_DPBUSD
            a[t] = acc[r][t];
#else
            a[t] = _mm256_madd_epi16(acc[r][t], _mm256_set1_epi16(1));
#endif
        const __m256i rows8[4] = {_mm256_permute2x128_si256(a[0], a[1], 0x20), _mm256_permute2x128_si256(a[2], a[3], 0x20),
                                  _mm256_permute2x128_si256(a[0], a[1], 0x31), _mm256_permute2x128_si256(a[2], a[3], 0x31)};
        const float sdr = sd[r * nblk + b];
        const __m256 dr = _mm256_set1_ps(d[r * nblk + b]), sr = _mm256_set1_ps(sdr);
        const __m256 sd16 = _mm256_set1_ps(sdr * 0.0625f), m8sd = _mm256_set1_ps(-8.f * sdr);
        for (int t = 0; t < nt; t++) q8_fold8(rows8[t], s[t], c[t], coded, dr, sr, sd16, m8sd, out + r * ldo + off[t]);
    }
}

/* One row of x against block b of one unit, both nibbles in one pass (q8_rows256 for R = 1 and h = 0, 1):
 * the bytes are unpacked once and their nibbles split after, 8 accumulators; the scales are loaded at the
 * fold (idx: the block's group's first scale of the unit). */
static void q8_row1_256(const int8_t *xq, const float *d, const float *sd, int64_t b, const uint8_t *pa,
                        const uint8_t *pb, int64_t cs, const int (*off)[4], int nt, const void *sz,
                        const int8_t *zc, int64_t idx, int is_bf16, float *out) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256i acc[2][4];
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 4; t++) acc[h][t] = _mm256_setzero_si256();
    for (int st = 0; st < 8; st++) {
        const int64_t col = b * Q8_BLOCK + 4 * st;
        _mm_prefetch((const char *)(pa + col * cs + Q4_PREFETCH_BYTES), _MM_HINT_T0);
        _mm_prefetch((const char *)(pa + col * cs + Q4_PREFETCH_BYTES + 64), _MM_HINT_T0);
        if (cs == 16) _mm_prefetch((const char *)(pb + col * cs + Q4_PREFETCH_BYTES), _MM_HINT_T0);
        __m256i n[4];
        for (int j = 0; j < 4; j++)
            n[j] = cs == 32 ? _mm256_loadu_si256((const __m256i *)(pa + (col + j) * 32))
                            : _mm256_inserti128_si256(
                                  _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(pa + (col + j) * 16))),
                                  _mm_loadu_si128((const __m128i *)(pb + (col + j) * 16)), 1);
        const __m256i ab0 = _mm256_unpacklo_epi8(n[0], n[1]), ab1 = _mm256_unpackhi_epi8(n[0], n[1]);
        const __m256i cd0 = _mm256_unpacklo_epi8(n[2], n[3]), cd1 = _mm256_unpackhi_epi8(n[2], n[3]);
        const __m256i w[4] = {_mm256_unpacklo_epi16(ab0, cd0), _mm256_unpackhi_epi16(ab0, cd0),
                              _mm256_unpacklo_epi16(ab1, cd1), _mm256_unpackhi_epi16(ab1, cd1)};
        int32_t x4;
        memcpy(&x4, xq + col, 4);
        const __m256i xb = _mm256_set1_epi32(x4);
        for (int t = 0; t < 4; t++) {
            const __m256i lo = _mm256_and_si256(w[t], m4), hi = _mm256_and_si256(_mm256_srli_epi16(w[t], 4), m4);
#ifdef Q8_DPBUSD
            acc[0][t] = Q8_DPBUSD(acc[0][t], lo, xb);
            acc[1][t] = Q8_DPBUSD(acc[1][t], hi, xb);
#else
            acc[0][t] = _mm256_add_epi16(acc[0][t], _mm256_maddubs_epi16(lo, xb));
            acc[1][t] = _mm256_add_epi16(acc[1][t], _mm256_maddubs_epi16(hi, xb));
#endif
        }
    }
    const __m256 dr = _mm256_set1_ps(d[b]), sr = _mm256_set1_ps(sd[b]);
    const __m256 sd16 = _mm256_set1_ps(sd[b] * 0.0625f), m8sd = _mm256_set1_ps(-8.f * sd[b]);
    for (int h = 0; h < 2; h++) {
        __m256i a[4];
        for (int t = 0; t < 4; t++)
#ifdef Q8_DPBUSD
            a[t] = acc[h][t];
#else
            a[t] = _mm256_madd_epi16(acc[h][t], _mm256_set1_epi16(1));
#endif
        const __m256i rows8[4] = {_mm256_permute2x128_si256(a[0], a[1], 0x20), _mm256_permute2x128_si256(a[2], a[3], 0x20),
                                  _mm256_permute2x128_si256(a[0], a[1], 0x31), _mm256_permute2x128_si256(a[2], a[3], 0x31)};
        for (int t = 0; t < nt; t++) {
            __m256 sv, cv;
            q8_sc8(sz, zc, idx + off[h][t], is_bf16, &sv, &cv);
            q8_fold8(rows8[t], sv, cv, zc != NULL, dr, sr, sd16, m8sd, out + off[h][t]);
        }
    }
}

/* q8_row1_256 for a unit of two 32-row blocks A, B (torch's AVX2 layout: pa, pb, 16 bytes a column), without
 * the 128-bit inserts: columns c, c + 1 of a block are 32 contiguous bytes, so each step loads [c | c + 1] and
 * [c + 2 | c + 3] of A and of B, and one byte unpack pairs c with c + 2 (low 128 bits) and c + 1 with c + 3
 * (high 128 bits) for 8 rows; x is broadcast to match ((x_c, x_c+2) pairs low, (x_c+1, x_c+3) high). Each
 * 16-bit lane then sums 8 steps' pairs (at most 8 x 2 x 15 x 127 = 30480), and the fold adds the two 128-bit
 * halves' lanes of a row after widening: the same int32 block sums as q8_row1_256, so the same result bit for
 * bit, with 4 unpacks a step instead of 8 unpacks and 4 inserts. Rows: A's bytes 0-7 / 8-15 are rows 0-7 /
 * 8-15 (low nibbles) and 16-23 / 24-31 (high), B's the same + 32. */
static void q8_row1_ab(const int8_t *xq, const float *d, const float *sd, int64_t b, const uint8_t *pa,
                       const uint8_t *pb, const void *sz, const int8_t *zc, int64_t idx, int is_bf16, float *out) {
    static const int off[2][4] = {{0, 8, 32, 40}, {16, 24, 48, 56}};
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i ctl = _mm256_setr_epi8(0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3,
                                         1, 3, 1, 3, 1, 3);
    __m256i acc[2][4];
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 4; t++) acc[h][t] = _mm256_setzero_si256();
    for (int st = 0; st < 8; st++) {
        const int64_t col = b * Q8_BLOCK + 4 * st;
        _mm_prefetch((const char *)(pa + col * 16 + Q4_PREFETCH_BYTES), Q8_PREFETCH_HINT);
        _mm_prefetch((const char *)(pb + col * 16 + Q4_PREFETCH_BYTES), Q8_PREFETCH_HINT);
        int32_t x4;
        memcpy(&x4, xq + col, 4);
        const __m256i xb = _mm256_shuffle_epi8(_mm256_set1_epi32(x4), ctl);
        for (int ab = 0; ab < 2; ab++) {
            const uint8_t *p = (ab ? pb : pa) + col * 16;
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)p), v1 = _mm256_loadu_si256((const __m256i *)(p + 32));
            const __m256i u[2] = {_mm256_unpacklo_epi8(v0, v1), _mm256_unpackhi_epi8(v0, v1)};
            for (int j = 0; j < 2; j++) {
                const int t = 2 * ab + j;
                const __m256i lo = _mm256_and_si256(u[j], m4), hi = _mm256_and_si256(_mm256_srli_epi16(u[j], 4), m4);
                acc[0][t] = _mm256_add_epi16(acc[0][t], _mm256_maddubs_epi16(lo, xb));
                acc[1][t] = _mm256_add_epi16(acc[1][t], _mm256_maddubs_epi16(hi, xb));
            }
        }
    }
    const __m256 dr = _mm256_set1_ps(d[b]), sr = _mm256_set1_ps(sd[b]);
    const __m256 sd16 = _mm256_set1_ps(sd[b] * 0.0625f), m8sd = _mm256_set1_ps(-8.f * sd[b]);
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 4; t++) {
            const __m256i a = _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc[h][t])),
                                               _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc[h][t], 1)));
            __m256 sv, cv;
            q8_sc8(sz, zc, idx + off[h][t], is_bf16, &sv, &cv);
            q8_fold8(a, sv, cv, zc != NULL, dr, sr, sd16, m8sd, out + off[h][t]);
        }
}

/* One unit at o0 (w outputs: 64, or 32 for a lone 32-row block) in blocks of `block` rows, every row of x, the
 * column blocks b0..b1 - 1 (32 columns each): out[r * ldo + 0..w - 1] = their sum. */
static void q8_unit(const int8_t *xq, const float *d, const float *sd, int64_t rows, int64_t k, int64_t gs,
                    const uint8_t *packed, int64_t block, int64_t o0, int64_t w, const void *sz, const int8_t *zc,
                    int64_t n_pad, int is_bf16, int64_t b0, int64_t b1, float *out, int64_t ldo) {
    static const int off64[2][4] = {{0, 8, 16, 24}, {32, 40, 48, 56}}, off32[2][4] = {{0, 8, 32, 40}, {16, 24, 48, 56}};
    const uint8_t *pa = packed + o0 * k / 2, *pb = block == 32 && w == 64 ? pa + 16 * k : pa;
    const int64_t nblk = k / Q8_BLOCK, cs = block / 2;
    const int nt = w == 64 ? 4 : 2;
    for (int64_t r = 0; r < rows; r++) memset(out + r * ldo, 0, sizeof(float) * w);
    for (int64_t b = b0; b < b1; b++) {
        const int64_t idx = (b * Q8_BLOCK / gs) * n_pad + o0;
        if ((b * Q8_BLOCK) % gs == 0) q4_prefetch_sz(sz, zc, idx + 64, is_bf16);
        if (rows == 1 && cs == 16 && w == 64) {
            q8_row1_ab(xq, d, sd, b, pa, pb, sz, zc, idx, is_bf16, out);
            continue;
        }
        if (rows == 1) {
            q8_row1_256(xq, d, sd, b, pa, pb, cs, block == 64 ? off64 : off32, nt, sz, zc, idx, is_bf16, out);
            continue;
        }
        for (int h = 0; h < 2; h++) {
            const int *off = block == 64 ? off64[h] : off32[h];
            __m256 s[4], c[4];
            for (int t = 0; t < nt; t++) q8_sc8(sz, zc, idx + off[t], is_bf16, &s[t], &c[t]);
            int64_t r = 0;
            for (; r + 2 <= rows; r += 2)
                q8_rows256(2, xq + r * k, d + r * nblk, sd + r * nblk, k, b, pa, pb, cs, h, s, c, zc != NULL, off, nt,
                           r == 0 && h == 0, out + r * ldo, ldo);
            if (r < rows)
                q8_rows256(1, xq + r * k, d + r * nblk, sd + r * nblk, k, b, pa, pb, cs, h, s, c, zc != NULL, off, nt,
                           r == 0 && h == 0, out + r * ldo, ldo);
        }
    }
}
#endif

/* x [rows, k] against the int4 weight of tpe_qgemv_int4 (the same arguments; block 64 only), the activations
 * quantized to int8 in blocks of 32 (above): y [rows, n]. Returns 0, or -1 for bad arguments (rows outside
 * 1..8, k or gs not multiples of 32, k % gs, n > n_pad, n_pad % 16, a block this build does not read), -2 out
 * of memory.
 *
 * The threads split halves of units, not units: each 64-row unit's columns are two items (column blocks
 * 0..nh - 1 and nh..nblk - 1, nh = nblk / 2), so an odd count of units (9 for 576 or 1536 -> 576) splits
 * evenly at 2 threads instead of 5 / 4. Each half's sums go to its own buffer (out, out2); the thread that
 * finishes a unit's second half (an atomic count per unit) writes y = out + out2, so the result is the same
 * for every thread count and schedule. The last, shorter block (q8_tail) is one item. */
int64_t tpe_qgemv_int4_q8(const void *x, int64_t rows, int64_t k, const uint8_t *packed, const void *sz,
                          const int8_t *zc, int64_t gs, int64_t n, int64_t n_pad, int64_t block, void *y, int is_bf16,
                          int nthreads) {
    if (rows < 1 || rows > QMAX_ROWS || k % Q8_BLOCK || gs % Q8_BLOCK || gs <= 0 || k % gs || n > n_pad ||
        n_pad % 16 || !q4_reads(block))
        return -1;
    const int64_t nblk = k / Q8_BLOCK, nh = nblk / 2, full = n_pad / block * block, units = (full + 63) / 64;
    int8_t *xq = malloc(rows * k + 64);
    float *d = malloc(sizeof(float) * rows * nblk), *sd = malloc(sizeof(float) * rows * nblk);
    float *out = malloc(sizeof(float) * 2 * rows * n_pad), *out2 = out + rows * n_pad;
    int *done = calloc(units + 1, sizeof(int));
    if (!xq || !d || !sd || !out || !done) {
        free(xq), free(d), free(sd), free(out), free(done);
        return -2;
    }
    q8_quantize(x, rows, k, is_bf16, xq, d, sd);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && n_pad * k >= 65536)
    for (int64_t it = 0; it < 2 * units + (full < n_pad); it++) {
        const int64_t u = it / 2, h = it % 2, o0 = u < units ? u * 64 : full;
        const int64_t w = u < units ? (full - o0 < 64 ? full - o0 : 64) : n_pad - full;
        if (u < units)
            q8_unit(xq, d, sd, rows, k, gs, packed, block, o0, w, sz, zc, n_pad, is_bf16, h ? nh : 0, h ? nblk : nh,
                    (h ? out2 : out) + o0, n_pad);
        else
            q8_tail(xq, d, sd, rows, k, gs, packed + o0 * k / 2, w, sz, zc, n_pad, o0, is_bf16, out + o0, n_pad);
        /* the unit's last half here: both halves' stores are seen (acquire-release on the count) */
        if (u < units && __atomic_add_fetch(&done[u], 1, __ATOMIC_ACQ_REL) < 2) continue;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t o = o0; o < o0 + w && o < n; o++)
                stf(y, r * n + o, u < units ? out[r * n_pad + o] + out2[r * n_pad + o] : out[r * n_pad + o], is_bf16);
    }
    free(xq), free(d), free(sd), free(out), free(done);
    return 0;
}

/* ------------------------------------------------------------------ int8 x int8, integer products */
/* The per-channel int8 weight of tpe_qgemv_int8 (q [n, k] row-major, scales [n]) against activations
 * quantized to int8 in blocks of 32 as above (q8_quantize: llama.cpp's q8_0 arithmetic, its
 * ggml_vec_dot_q8_0_q8_0):
 *   y[r, o] = s[o] * sum_b d_b * (sum_{i in b} q[o, i] xq_i),
 * the inner sums exact in int32, the sum over blocks in float32 (16 partial sums a row, then added),
 * one scaling by s[o] at the end. Each 32-bit lane holds 4 consecutive columns' products, so 8 lanes
 * make a block and a lane's float factor is its block's d (dl below: d per lane, built once a call).
 * AVX-512 VNNI: vpdpbusd multiplies unsigned by signed bytes, so the offset goes on the weight side:
 * u = q ^ 0x80 = q + 128, vpdpbusd(nc, u, xq) = sum q xq + 128 sum xq + nc with nc = -128 * (the lane's
 * sum of xq), set once a call, so each 64 weight bytes cost one xor, one vpdpbusd, one int -> float
 * conversion and one FMA (the float kernel: 4 widenings, 4 conversions, 4 FMAs). AVX2: llama.cpp's sign
 * trick, vpmaddubsw(|q|, sign(xq, q)) (pairs at most 2 x 128 x 127, no saturation) then vpmaddwd by 1;
 * vpdpbusd on 256 bits as AVX-512's where the build targets AVX-VNNI or AVX512-VNNI with VL. Weight
 * rows are walked J at a time for R rows of x (gemv.h's TPE_J*), prefetched ahead as a group is read
 * (AVX-512: each row's line two groups ahead into L2, I8Q8_AHEAD; AVX2: the next group's bytes in address
 * order into L1); the threads split the output rows (tpe_gemv_chunk). */
#define I8Q8_MAXJ 4
/* AVX-512: how many groups of J rows ahead of the group being read its rows are prefetched, and into which
 * cache: two groups, into L2 (each line is read once, a group later), streamed faster than the next group
 * row by row into L1 (figures: docs/notes/kernels.md, "int4 and int8 at one row, continued"). */
#define I8Q8_AHEAD 2
#define I8Q8_PREFETCH_HINT _MM_HINT_T1

/* xq [rows, kp] (zero past k), nc and dl [rows, kp / 4]: each 4-column lane's -128 * sum xq and its d. */
static void i8q8_lanes(const void *x, int64_t rows, int64_t k, int64_t kp, int is_bf16, int8_t *xq, int32_t *nc,
                       float *dl, float *d, float *sd) {
    const int64_t nb = k / Q8_BLOCK, es = is_bf16 ? 2 : 4;
    for (int64_t r = 0; r < rows; r++) {
        q8_quantize((const char *)x + r * k * es, 1, k, is_bf16, xq + r * kp, d + r * nb, sd + r * nb);
        memset(xq + r * kp + k, 0, kp - k);
        for (int64_t l = 0; l < kp / 4; l++) {
            const int8_t *c = xq + r * kp + 4 * l;
            nc[r * (kp / 4) + l] = -128 * ((int32_t)c[0] + c[1] + c[2] + c[3]);
            dl[r * (kp / 4) + l] = 4 * l < k ? d[r * nb + 4 * l / Q8_BLOCK] : 0.f;
        }
    }
}

#if defined(TPE_AVX512)
/* Weight rows o..o + J - 1 against R rows of x: acc[r * J + j] = sum_b d_b sum_{i in b} q[o + j, i] xq[r, i]. */
static inline __attribute__((always_inline)) void i8q8_group(const int R, const int J, const int8_t *xq,
                                                              const int32_t *nc, const float *dl, int64_t kp,
                                                              int64_t k, const int8_t *q, int64_t o, float *acc) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __mmask64 last = k % 64 ? ((__mmask64)1 << (k % 64)) - 1 : ~(__mmask64)0;
    const int64_t steps = kp / 64;
    __m512 f[QMAX_ROWS][I8Q8_MAXJ];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) f[r][j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < steps; c++) {
        __m512i w[I8Q8_MAXJ];
        for (int j = 0; j < J; j++) {
            const int8_t *p = q + (o + j) * k + 64 * c;
            _mm_prefetch((const char *)(p + I8Q8_AHEAD * J * k), I8Q8_PREFETCH_HINT); /* a later group's row */
            w[j] = _mm512_xor_si512(c + 1 < steps ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(last, p), flip);
        }
        for (int r = 0; r < R; r++) {
            const __m512i xb = _mm512_loadu_si512(xq + r * kp + 64 * c);
            const __m512i n0 = _mm512_loadu_si512(nc + r * (kp / 4) + 16 * c);
            const __m512 dv = _mm512_loadu_ps(dl + r * (kp / 4) + 16 * c);
            for (int j = 0; j < J; j++)
                f[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(n0, w[j], xb)), dv, f[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) acc[r * J + j] = _mm512_reduce_add_ps(f[r][j]);
}
#else /* TPE_AVX2: 32 columns a step */
static inline __attribute__((always_inline)) void i8q8_group(const int R, const int J, const int8_t *xq,
                                                              const int32_t *nc, const float *dl, int64_t kp,
                                                              int64_t k, const int8_t *q, int64_t o, float *acc) {
    __m256 f[QMAX_ROWS][I8Q8_MAXJ];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) f[r][j] = _mm256_setzero_ps();
    /* The next group's J rows are one contiguous run of J * k bytes: prefetched into L1 in address order,
     * J * 32 bytes a step as this group reads its J rows 32 bytes each: the same lines as each row's own line
     * a later group ahead, but as one sequence of addresses, which streams faster on Zen 3 (figures:
     * docs/notes/avx2.md, "AMD EPYC Zen 3"). */
    const char *next = (const char *)(q + (o + J) * k);
    for (int64_t c = 0; c < k / 32; c++) {
        __m256i w[I8Q8_MAXJ];
        for (int64_t b = c * J * 32; b < (c + 1) * J * 32; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
        for (int j = 0; j < J; j++) {
            const int8_t *p = q + (o + j) * k + 32 * c;
            w[j] = _mm256_loadu_si256((const __m256i *)p);
#ifdef Q8_DPBUSD
            w[j] = _mm256_xor_si256(w[j], _mm256_set1_epi8((char)0x80));
#endif
        }
        for (int r = 0; r < R; r++) {
            const __m256i xb = _mm256_loadu_si256((const __m256i *)(xq + r * kp + 32 * c));
            const __m256 dv = _mm256_loadu_ps(dl + r * (kp / 4) + 8 * c);
#ifdef Q8_DPBUSD
            const __m256i n0 = _mm256_loadu_si256((const __m256i *)(nc + r * (kp / 4) + 8 * c));
#endif
            for (int j = 0; j < J; j++) {
#ifdef Q8_DPBUSD
                const __m256i s = Q8_DPBUSD(n0, w[j], xb);
#else
                const __m256i s = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(_mm256_sign_epi8(w[j], w[j]), _mm256_sign_epi8(xb, w[j])), _mm256_set1_epi16(1));
#endif
                f[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), dv, f[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) acc[r * J + j] = hsum8(f[r][j]);
}
#endif

/* Output rows o0..o1 for R rows of x (J weight rows at a time, then one at a time): y[r, o] = s[o] * acc. */
#define I8Q8_ROWS(R, J)                                                                                         \
    static void i8q8_rows_##R(const int8_t *xq, const int32_t *nc, const float *dl, int64_t kp, int64_t k,      \
                              const int8_t *q, const void *scales, int64_t o0, int64_t o1, void *y, int64_t n,  \
                              int is_bf16) {                                                                    \
        float acc[R * J];                                                                                       \
        int64_t o = o0;                                                                                         \
        for (; o + J <= o1; o += J) {                                                                           \
            i8q8_group(R, J, xq, nc, dl, kp, k, q, o, acc);                                                     \
            for (int r = 0; r < R; r++)                                                                         \
                for (int j = 0; j < J; j++)                                                                     \
                    stf(y, r * n + o + j, acc[r * J + j] * ldf(scales, o + j, is_bf16), is_bf16);               \
        }                                                                                                       \
        for (; o < o1; o++) {                                                                                   \
            i8q8_group(R, 1, xq, nc, dl, kp, k, q, o, acc);                                                     \
            for (int r = 0; r < R; r++) stf(y, r * n + o, acc[r] * ldf(scales, o, is_bf16), is_bf16);           \
        }                                                                                                       \
    }
I8Q8_ROWS(1, TPE_J1)
I8Q8_ROWS(2, TPE_J2)
I8Q8_ROWS(4, TPE_J4)
I8Q8_ROWS(8, TPE_J8)

/* x [rows, k] (bf16 or f32) against q int8 [n, k] with scales [n] (tpe_qgemv_int8's arguments), the
 * activations quantized to int8 per 32 columns: y [rows, n]. Returns 0, or -1 for bad arguments (rows
 * outside 1..8, k not a positive multiple of 32, n < 1), -2 out of memory. */
int64_t tpe_qgemv_int8_q8(const void *x, int64_t rows, int64_t k, const int8_t *q, const void *scales, int64_t n,
                          void *y, int is_bf16, int nthreads) {
    if (rows < 1 || rows > QMAX_ROWS || k <= 0 || k % Q8_BLOCK || n < 1) return -1;
    const int64_t kp = (k + 63) / 64 * 64, nb = k / Q8_BLOCK, kl = kp / 4;
    char *buf = malloc(rows * kp + sizeof(float) * rows * (3 * kl + 2 * nb) + 64);
    if (!buf) return -2;
    int8_t *xq = (int8_t *)buf;
    int32_t *nc = (int32_t *)(buf + (rows * kp + 63) / 64 * 64);
    float *dl = (float *)(nc + rows * kl), *d = dl + rows * kl, *sd = d + rows * nb;
    i8q8_lanes(x, rows, k, kp, is_bf16, xq, nc, dl, d, sd);
    const int64_t chunk = tpe_gemv_chunk(n, nthreads), es = is_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static, 1) num_threads(nthreads) if (nthreads > 1 && n * k >= 65536)
    for (int64_t o0 = 0; o0 < n; o0 += chunk) {
        const int64_t o1 = o0 + chunk < n ? o0 + chunk : n;
        int64_t r = 0;
        for (; r + 8 <= rows; r += 8)
            i8q8_rows_8(xq + r * kp, nc + r * kl, dl + r * kl, kp, k, q, scales, o0, o1, (char *)y + r * n * es, n, is_bf16);
        for (; r + 4 <= rows; r += 4)
            i8q8_rows_4(xq + r * kp, nc + r * kl, dl + r * kl, kp, k, q, scales, o0, o1, (char *)y + r * n * es, n, is_bf16);
        for (; r + 2 <= rows; r += 2)
            i8q8_rows_2(xq + r * kp, nc + r * kl, dl + r * kl, kp, k, q, scales, o0, o1, (char *)y + r * n * es, n, is_bf16);
        for (; r < rows; r++)
            i8q8_rows_1(xq + r * kp, nc + r * kl, dl + r * kl, kp, k, q, scales, o0, o1, (char *)y + r * n * es, n, is_bf16);
    }
    free(buf);
    return 0;
}
#endif

#endif /* neither AVX-512 nor AVX2: left out of the build; the callers keep torch (cpu_library.has) */
