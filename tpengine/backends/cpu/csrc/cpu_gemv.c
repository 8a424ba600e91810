/* bfloat16 and float32 matrix-vector products for the few rows of a decode step: y = x @ w^T with x [rows, k],
 * w [n, k] row-major (the plain layout of a linear weight), y [rows, n], float32 accumulation
 * (AVX512-BF16 dot products of bfloat16 pairs, vdpbf16ps), rounded once to bfloat16 -- what
 * F.linear computes, up to the order of the float32 sum (float32: x, w and y float32, FMA
 * accumulation in 16 lanes per weight row). The AVX2 path widens bfloat16 to float32 and uses FMA,
 * 8 lanes. A decode step at one row is bound by
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
/* bfloat16 widened to float32 in registers (ld8), then FMA: the same products and float32 sums as
 * vdpbf16ps up to their order. */
static inline __m256 mac_ps(__m256 acc, __m256 x, __m256 w) { return _mm256_fmadd_ps(x, w, acc); }
static inline float same(float f) { return f; }

TPE_GEMV_FAMILY(gemv_bf16, uint16_t, uint16_t, uint16_t, 8, __m256, ld8, ld8, mac_ps, f2bf)
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
