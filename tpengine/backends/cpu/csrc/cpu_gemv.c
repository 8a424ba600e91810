/* bfloat16 and float32 matrix-vector products for the few rows of a decode step: y = x @ w^T with x [rows, k],
 * w [n, k] row-major (the plain layout of a linear weight), y [rows, n], float32 accumulation
 * (AVX512-BF16 dot products of bfloat16 pairs, vdpbf16ps), rounded once to bfloat16 -- what
 * F.linear computes, up to the order of the float32 sum (float32: x, w and y float32, FMA
 * accumulation in 16 lanes per weight row). The AVX2 path widens bfloat16 to float32 by pairs (a shift and
 * a mask, below) and uses FMA, 8 lanes. A decode step at one row is bound by
 * reading the weight: this streams each weight row once for all rows of x (up to 8; 4 or 2 weight
 * rows at a time, prefetching the next group of weight rows while it reads one), the output rows
 * split between the threads. Needs k % 32 == 0 (float32: k % 16 == 0) and rows <= 8 (the caller
 * checks); tpengine.backends.cpu.linear_layout measures it against the other paths per shape. */
#include <stdint.h>

#include "bf16.h"

#if defined(TPE_AVX512) || defined(TPE_AVX2)
#include "gemv.h"
#endif

#ifdef TPE_AVX512
static inline __m512bh ld_bh(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }
static inline __m512 mac_bh(__m512 acc, __m512bh x, __m512bh w) { return _mm512_dpbf16_ps(acc, x, w); }
static inline __m512 mac_ps(__m512 acc, __m512 x, __m512 w) { return _mm512_fmadd_ps(x, w, acc); }
static inline float same(float f) { return f; }

TPE_GEMV_FAMILY(gemv_bf16, uint16_t, uint16_t, uint16_t, 32, __m512bh, ld_bh, ld_bh, mac_bh, f2bf)
TPE_GEMV_FAMILY(gemv_f32, float, float, float, 16, __m512, _mm512_loadu_ps, _mm512_loadu_ps, mac_ps, same)
#elif defined(TPE_AVX2)
static inline __m256 mac_ps(__m256 acc, __m256 x, __m256 w) { return _mm256_fmadd_ps(x, w, acc); }
static inline float same(float f) { return f; }

/* bfloat16 widened to float32 in registers, then FMA: the same products and float32 sums as vdpbf16ps up
 * to their order. By pairs: 16 bfloat16 loaded as 8 32-bit lanes, each lane a pair (w[2l], w[2l + 1]); a 16-bit
 * left shift makes the even elements float32 and masking off the low half the odd ones (vpslld, vpand: no
 * shuffle, which vpmovzxwd is), each times the same of x into its own accumulator (even, odd: 2 chains a
 * weight row, so the FMAs' latency is hidden by half as many weight rows). Each output is
 * hsum8(even + odd), the two chains over k in order -- the same sum whatever R and J, so a row's result
 * does not depend on the other rows of its call. R rows of x against J weight rows at o (R * J * 2
 * accumulators: R J in {1 4, 2 2, 4 1}, 8 of AVX2's 16 registers); `pf`: prefetch the weight rows 4
 * ahead (the next group of 4) once per cache line. */
#define TPE_PAIR_KERNEL(NAME, R, J)                                                                           \
    static void NAME(const uint16_t *x, int64_t k, const uint16_t *w, int64_t o, uint16_t *y, int64_t n, int pf) { \
        const __m256i odd = _mm256_set1_epi32((int)0xffff0000u);                                             \
        __m256 acc[R][J][2];                                                                                 \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                                  \
            _Pragma("GCC unroll 4") for (int j = 0; j < J; j++) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();                   \
        for (int64_t i = 0; i < k; i += 16) {                                                                \
            if (pf && ((i * 2) & 63) == 0)                                                                   \
                _Pragma("GCC unroll 4") for (int j = 0; j < J; j++) _mm_prefetch((const char *)(w + (o + 4 + j) * k + i), _MM_HINT_T0); \
            __m256i wv[J];                                                                                   \
            _Pragma("GCC unroll 4") for (int j = 0; j < J; j++) wv[j] = _mm256_loadu_si256((const __m256i *)(w + (o + j) * k + i));  \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                            \
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + r * k + i));                     \
                const __m256 xe = _mm256_castsi256_ps(_mm256_slli_epi32(xv, 16));                            \
                const __m256 xo = _mm256_castsi256_ps(_mm256_and_si256(xv, odd));                            \
                _Pragma("GCC unroll 4") for (int j = 0; j < J; j++) {                                        \
                    acc[r][j][0] = _mm256_fmadd_ps(xe, _mm256_castsi256_ps(_mm256_slli_epi32(wv[j], 16)), acc[r][j][0]); \
                    acc[r][j][1] = _mm256_fmadd_ps(xo, _mm256_castsi256_ps(_mm256_and_si256(wv[j], odd)), acc[r][j][1]); \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                                  \
            _Pragma("GCC unroll 4") for (int j = 0; j < J; j++) y[r * n + o + j] = f2bf(hsum8(_mm256_add_ps(acc[r][j][0], acc[r][j][1]))); \
    }

TPE_PAIR_KERNEL(pair_1x4, 1, 4)
TPE_PAIR_KERNEL(pair_1x1, 1, 1)
TPE_PAIR_KERNEL(pair_2x2, 2, 2)
TPE_PAIR_KERNEL(pair_2x1, 2, 1)
TPE_PAIR_KERNEL(pair_4x1, 4, 1)

/* Output rows o0..o1 for `rows` rows of x: groups of 4 weight rows, each read from memory once (the first
 * pass over it prefetches the next group) for every row of x in passes of 4, 2, 1 rows (a later pass finds
 * the group in the cache), then the last rows of w one at a time. */
static void gemv_bf16_rows(const uint16_t *x, int64_t rows, int64_t k, const uint16_t *w, int64_t o0, int64_t o1,
                           uint16_t *y, int64_t n) {
    int64_t o = o0;
    for (; o + 4 <= o1; o += 4) {
        int64_t r = 0;
        for (; r + 4 <= rows; r += 4)
            for (int j = 0; j < 4; j++) pair_4x1(x + r * k, k, w, o + j, y + r * n, n, r == 0);
        for (; r + 2 <= rows; r += 2)
            for (int j = 0; j < 4; j += 2) pair_2x2(x + r * k, k, w, o + j, y + r * n, n, r == 0);
        for (; r < rows; r++) pair_1x4(x + r * k, k, w, o, y + r * n, n, r == 0);
    }
    for (; o < o1; o++) {
        int64_t r = 0;
        for (; r + 2 <= rows; r += 2) pair_2x1(x + r * k, k, w, o, y + r * n, n, 0);
        for (; r < rows; r++) pair_1x1(x + r * k, k, w, o, y + r * n, n, 0);
    }
}
/* float32 at one row: 8 weight rows a group, so that each step reads 4 cache lines as the AVX-512 path's
 * 4 rows of 16 lanes do (more lines in flight, so more of the memory's bandwidth; bfloat16, whose
 * widening costs more per byte, gained nothing from 8; figures: docs/notes/avx2.md). */
TPE_GEMV_FAMILY_J(gemv_f32, 8, float, float, float, 8, __m256, _mm256_loadu_ps, _mm256_loadu_ps, mac_ps, same)
#endif

#if defined(TPE_AVX512) || defined(TPE_AVX2)

/* x [rows, k], w [n, k], y [rows, n]; rows in 1..8 (bfloat16: k % 32 == 0; float32: k % 16 == 0). */
void tpe_gemv_bf16(const uint16_t *x, int64_t rows, int64_t k, const uint16_t *w, int64_t n, uint16_t *y,
                   int nthreads) {
    const int64_t chunk = tpe_gemv_chunk(n, nthreads);
#pragma omp parallel for schedule(static, 1) num_threads(nthreads) if (nthreads > 1 && n * k >= 65536)
    for (int64_t o0 = 0; o0 < n; o0 += chunk) gemv_bf16_rows(x, rows, k, w, o0, o0 + chunk < n ? o0 + chunk : n, y, n);
}

void tpe_gemv_f32(const float *x, int64_t rows, int64_t k, const float *w, int64_t n, float *y, int nthreads) {
    const int64_t chunk = tpe_gemv_chunk(n, nthreads);
#pragma omp parallel for schedule(static, 1) num_threads(nthreads) if (nthreads > 1 && n * k >= 65536)
    for (int64_t o0 = 0; o0 < n; o0 += chunk) gemv_f32_rows(x, rows, k, w, o0, o0 + chunk < n ? o0 + chunk : n, y, n);
}

#endif /* neither path: left out of the build (cpu_library.has) */
