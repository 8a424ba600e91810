/* bfloat16 and float32 matrix-vector products for the few rows of a decode step: y = x @ w^T with x [rows, k],
 * w [n, k] row-major (the plain layout of a linear weight), y [rows, n], float32 accumulation
 * (AVX512-BF16 dot products of bfloat16 pairs, vdpbf16ps), rounded once to bfloat16 -- what
 * F.linear computes, up to the order of the float32 sum (float32: x, w and y float32, FMA
 * accumulation in 16 lanes per weight row). A decode step at one row is bound by
 * reading the weight: this streams each weight row once for all rows of x (up to 8; 4 or 2 weight
 * rows at a time, prefetching the next group of weight rows while it reads one), the output rows
 * split between the threads. Needs k % 32 == 0 (float32: k % 16 == 0) and rows <= 8 (the caller
 * checks); tpengine.kernels.linear_layout measures it against the other paths per shape. */
#include <stdint.h>

#include "bf16.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define GEMV_ROWS(R, J)                                                                                             \
    static void gemv_##R(const uint16_t *x, int64_t k, const uint16_t *w, int64_t o0, int64_t o1, uint16_t *y,   \
                         int64_t n) {                                                                             \
        int64_t o = o0;                                                                                           \
        for (; o + J <= o1; o += J) {                                                                             \
            __m512 acc[R][J];                                                                                     \
            for (int r = 0; r < R; r++)                                                                           \
                for (int j = 0; j < J; j++) acc[r][j] = _mm512_setzero_ps();                                      \
            for (int64_t i = 0; i < k; i += 32) {                                                                 \
                __m512bh wv[J];                                                                                   \
                if ((i & 31) == 0)                                                                                \
                    for (int j = 0; j < J; j++) _mm_prefetch((const char *)(w + (o + J + j) * k + i), _MM_HINT_T0); \
                for (int j = 0; j < J; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + (o + j) * k + i);            \
                for (int r = 0; r < R; r++) {                                                                     \
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * k + i);                              \
                    for (int j = 0; j < J; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);               \
                }                                                                                                 \
            }                                                                                                     \
            for (int r = 0; r < R; r++)                                                                           \
                for (int j = 0; j < J; j++) y[r * n + o + j] = f2bf(_mm512_reduce_add_ps(acc[r][j]));             \
        }                                                                                                         \
        for (; o < o1; o++) {                                                                                     \
            __m512 acc[R];                                                                                        \
            for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                                             \
            for (int64_t i = 0; i < k; i += 32) {                                                                 \
                const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + o * k + i);                                  \
                for (int r = 0; r < R; r++)                                                                       \
                    acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(x + r * k + i), wv);           \
            }                                                                                                     \
            for (int r = 0; r < R; r++) y[r * n + o] = f2bf(_mm512_reduce_add_ps(acc[r]));                        \
        }                                                                                                         \
    }

GEMV_ROWS(1, 4)
GEMV_ROWS(2, 4)
GEMV_ROWS(4, 4)
GEMV_ROWS(8, 2)

/* x [rows, k], w [n, k], y [rows, n]; rows in 1..8 (8 at once against 2 weight rows, else 4, 2 and 1
 * at a time against 4 weight rows). */
void tpe_gemv_bf16(const uint16_t *x, int64_t rows, int64_t k, const uint16_t *w, int64_t n, uint16_t *y,
                   int nthreads) {
    const int64_t chunk = ((n + nthreads - 1) / nthreads + 3) / 4 * 4; /* whole groups of 4 rows per thread */
#pragma omp parallel for schedule(static, 1) num_threads(nthreads) if (nthreads > 1 && n * k >= 65536)
    for (int64_t o0 = 0; o0 < n; o0 += chunk) {
        const int64_t o1 = o0 + chunk < n ? o0 + chunk : n;
        int64_t r = 0;
        for (; r + 8 <= rows; r += 8) gemv_8(x + r * k, k, w, o0, o1, y + r * n, n);
        for (; r + 4 <= rows; r += 4) gemv_4(x + r * k, k, w, o0, o1, y + r * n, n);
        for (; r + 2 <= rows; r += 2) gemv_2(x + r * k, k, w, o0, o1, y + r * n, n);
        for (; r < rows; r++) gemv_1(x + r * k, k, w, o0, o1, y + r * n, n);
    }
}

#define GEMV_F32_ROWS(R, J)                                                                                         \
    static void gemv_f32_##R(const float *x, int64_t k, const float *w, int64_t o0, int64_t o1, float *y,       \
                             int64_t n) {                                                                         \
        int64_t o = o0;                                                                                           \
        for (; o + J <= o1; o += J) {                                                                             \
            __m512 acc[R][J];                                                                                     \
            for (int r = 0; r < R; r++)                                                                           \
                for (int j = 0; j < J; j++) acc[r][j] = _mm512_setzero_ps();                                      \
            for (int64_t i = 0; i < k; i += 16) {                                                                 \
                __m512 wv[J];                                                                                     \
                for (int j = 0; j < J; j++) _mm_prefetch((const char *)(w + (o + J + j) * k + i), _MM_HINT_T0);   \
                for (int j = 0; j < J; j++) wv[j] = _mm512_loadu_ps(w + (o + j) * k + i);                         \
                for (int r = 0; r < R; r++) {                                                                     \
                    const __m512 xv = _mm512_loadu_ps(x + r * k + i);                                             \
                    for (int j = 0; j < J; j++) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);                \
                }                                                                                                 \
            }                                                                                                     \
            for (int r = 0; r < R; r++)                                                                           \
                for (int j = 0; j < J; j++) y[r * n + o + j] = _mm512_reduce_add_ps(acc[r][j]);                   \
        }                                                                                                         \
        for (; o < o1; o++) {                                                                                     \
            __m512 acc[R];                                                                                        \
            for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                                             \
            for (int64_t i = 0; i < k; i += 16) {                                                                 \
                const __m512 wv = _mm512_loadu_ps(w + o * k + i);                                                 \
                for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * k + i), wv, acc[r]); \
            }                                                                                                     \
            for (int r = 0; r < R; r++) y[r * n + o] = _mm512_reduce_add_ps(acc[r]);                              \
        }                                                                                                         \
    }

GEMV_F32_ROWS(1, 4)
GEMV_F32_ROWS(2, 4)
GEMV_F32_ROWS(4, 4)
GEMV_F32_ROWS(8, 2)

/* float32: x [rows, k], w [n, k], y [rows, n]; rows in 1..8, k % 16 == 0. */
void tpe_gemv_f32(const float *x, int64_t rows, int64_t k, const float *w, int64_t n, float *y, int nthreads) {
    const int64_t chunk = ((n + nthreads - 1) / nthreads + 3) / 4 * 4;
#pragma omp parallel for schedule(static, 1) num_threads(nthreads) if (nthreads > 1 && n * k >= 65536)
    for (int64_t o0 = 0; o0 < n; o0 += chunk) {
        const int64_t o1 = o0 + chunk < n ? o0 + chunk : n;
        int64_t r = 0;
        for (; r + 8 <= rows; r += 8) gemv_f32_8(x + r * k, k, w, o0, o1, y + r * n, n);
        for (; r + 4 <= rows; r += 4) gemv_f32_4(x + r * k, k, w, o0, o1, y + r * n, n);
        for (; r + 2 <= rows; r += 2) gemv_f32_2(x + r * k, k, w, o0, o1, y + r * n, n);
        for (; r < rows; r++) gemv_f32_1(x + r * k, k, w, o0, o1, y + r * n, n);
    }
}

#else /* never called: tpe_fast() == 0 marks the library unavailable */
void tpe_gemv_bf16(void) {}
void tpe_gemv_f32(void) {}
#endif
