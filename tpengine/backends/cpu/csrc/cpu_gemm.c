/* float32 GEMM for a decode batch on a linear layer's plain weight: y = x @ w^T with x [m, k], w [n, k]
 * row-major (the plain layout: no packed copy), y [m, n].
 *
 * It computes y^T = w x^T as outer products: x is first transposed into a [k][64] panel (64 rows of x
 * per pass, zero-padded to whole vectors of 16), then each block of NR weight rows keeps NR x MV
 * accumulator vectors (16 rows of x each) and, for every k, broadcasts w[n][k] against the panel's
 * k-th row: one broadcast feeds MV FMAs, so with MV = 4 the loop is bound by the FMA units, not by
 * loads -- the form of Goto & van de Geijn's micro-kernel (ACM TOMS 34(3), 2008) with the roles of
 * the operands swapped so that the weight is read in its own row-major layout. Every weight element
 * is read from memory once per 64 rows of x. The NR rows of a block are NR short streams the
 * hardware prefetcher does not follow, so each block prefetches the next block's rows once per
 * cache line. Each output is one FMA chain over k in order, whatever m, the block or the thread
 * count: a row's result does not depend on the batch it is in. The blocks of weight rows are split
 * between the threads. */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#define TPE_GEMM_M 64 /* rows of x per pass (4 vectors) */

/* acc[r][j] = sum_k w[n0 + r][k] * xt[k][16 j + lane] for the nr (<= NR) weight rows n0.., then y[m][n0 + r]. */
#define TPE_GEMM_BLOCK(NR, MV)                                                                                    \
    static void gemm_block_##NR##_##MV(const float *restrict xt, const float *restrict w, int64_t k, float *y,    \
                                       int64_t ldy, int64_t n0, int nr, int rows, int prefetch) {                 \
        __m512 acc[NR][MV];                                                                                       \
        const float *wr[NR];                                                                                      \
        for (int r = 0; r < NR; r++) {                                                                            \
            wr[r] = w + (n0 + (r < nr ? r : nr - 1)) * k;                                                         \
            for (int j = 0; j < MV; j++) acc[r][j] = _mm512_setzero_ps();                                         \
        }                                                                                                         \
        for (int64_t i = 0; i < k; i++) {                                                                         \
            if (prefetch && (i & 15) == 0)                                                                        \
                for (int r = 0; r < NR; r++) _mm_prefetch((const char *)(wr[r] + NR * k + i), _MM_HINT_T0);       \
            __m512 xv[MV];                                                                                        \
            for (int j = 0; j < MV; j++) xv[j] = _mm512_load_ps(xt + i * TPE_GEMM_M + 16 * j);                    \
            for (int r = 0; r < NR; r++) {                                                                        \
                const __m512 b = _mm512_set1_ps(wr[r][i]);                                                        \
                for (int j = 0; j < MV; j++) acc[r][j] = _mm512_fmadd_ps(b, xv[j], acc[r][j]);                    \
            }                                                                                                     \
        }                                                                                                         \
        float out[NR][16 * MV] __attribute__((aligned(64)));                                                      \
        for (int r = 0; r < NR; r++)                                                                              \
            for (int j = 0; j < MV; j++) _mm512_store_ps(out[r] + 16 * j, acc[r][j]);                             \
        for (int m = 0; m < rows; m++)                                                                            \
            for (int r = 0; r < nr; r++) y[m * ldy + n0 + r] = out[r][m];                                         \
    }

/* NR x MV = 24 accumulators; fewer vectors of x rows take more weight rows per block. */
TPE_GEMM_BLOCK(24, 1)
TPE_GEMM_BLOCK(12, 2)
TPE_GEMM_BLOCK(8, 3)
TPE_GEMM_BLOCK(6, 4)

typedef void (*gemm_block_fn)(const float *, const float *, int64_t, float *, int64_t, int64_t, int, int, int);

/* x [m, k], w [n, k], y [m, n], all contiguous float32; xt: scratch of k * 64 floats, 64-byte aligned. */
void tpe_gemm_f32(const float *x, int64_t m, int64_t k, const float *w, int64_t n, float *y, float *xt,
                  int nthreads) {
    static const int block_rows[5] = {0, 24, 12, 8, 6};
    static const gemm_block_fn blocks[5] = {0, gemm_block_24_1, gemm_block_12_2, gemm_block_8_3, gemm_block_6_4};
    for (int64_t m0 = 0; m0 < m; m0 += TPE_GEMM_M) {
        const int rows = m - m0 < TPE_GEMM_M ? (int)(m - m0) : TPE_GEMM_M, mv = (rows + 15) / 16;
        const int nr = block_rows[mv];
        const gemm_block_fn block = blocks[mv];
        const int64_t nblocks = (n + nr - 1) / nr;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && n * k >= 65536)
        {
#pragma omp for schedule(static)
            for (int64_t i0 = 0; i0 < k; i0 += 16) { /* the panel: xt[i][r] = x[m0 + r][i], zero past the rows */
                const int64_t i1 = i0 + 16 < k ? i0 + 16 : k;
                for (int r = 0; r < 16 * mv; r++)
                    for (int64_t i = i0; i < i1; i++) xt[i * TPE_GEMM_M + r] = r < rows ? x[(m0 + r) * k + i] : 0.f;
            }
#pragma omp for schedule(static)
            for (int64_t b = 0; b < nblocks; b++) {
                const int64_t n0 = b * nr;
                block(xt, w, k, y + m0 * n, n, n0, n - n0 < nr ? (int)(n - n0) : nr, rows, n0 + 2 * nr <= n);
            }
        }
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* AVX2 + FMA: the same panel (64 rows of x per pass, [k][64]) and the same outer products, 8 rows of x
 * per vector: each output is the same single FMA chain over k in order, so the results equal the
 * AVX-512 path's bit for bit. NR x MV8 accumulators, about 12 of AVX2's 16 registers. */
#define TPE_GEMM_M 64

#define TPE_GEMM_BLOCK8(NR, MV)                                                                                   \
    static void gemm_block_##NR##_##MV(const float *restrict xt, const float *restrict w, int64_t k, float *y,    \
                                       int64_t ldy, int64_t n0, int nr, int rows, int prefetch) {                 \
        __m256 acc[NR][MV];                                                                                       \
        const float *wr[NR];                                                                                      \
        for (int r = 0; r < NR; r++) {                                                                            \
            wr[r] = w + (n0 + (r < nr ? r : nr - 1)) * k;                                                         \
            for (int j = 0; j < MV; j++) acc[r][j] = _mm256_setzero_ps();                                         \
        }                                                                                                         \
        for (int64_t i = 0; i < k; i++) {                                                                         \
            if (prefetch && (i & 15) == 0)                                                                        \
                for (int r = 0; r < NR; r++) _mm_prefetch((const char *)(wr[r] + NR * k + i), _MM_HINT_T0);       \
            __m256 xv[MV];                                                                                        \
            for (int j = 0; j < MV; j++) xv[j] = _mm256_load_ps(xt + i * TPE_GEMM_M + 8 * j);                     \
            for (int r = 0; r < NR; r++) {                                                                        \
                const __m256 b = _mm256_set1_ps(wr[r][i]);                                                        \
                for (int j = 0; j < MV; j++) acc[r][j] = _mm256_fmadd_ps(b, xv[j], acc[r][j]);                    \
            }                                                                                                     \
        }                                                                                                         \
        float out[NR][8 * MV] __attribute__((aligned(32)));                                                       \
        for (int r = 0; r < NR; r++)                                                                              \
            for (int j = 0; j < MV; j++) _mm256_store_ps(out[r] + 8 * j, acc[r][j]);                              \
        for (int m = 0; m < rows; m++)                                                                            \
            for (int r = 0; r < nr; r++) y[m * ldy + n0 + r] = out[r][m];                                         \
    }

TPE_GEMM_BLOCK8(12, 1)
TPE_GEMM_BLOCK8(6, 2)
TPE_GEMM_BLOCK8(4, 3)
TPE_GEMM_BLOCK8(3, 4)
TPE_GEMM_BLOCK8(2, 5)
TPE_GEMM_BLOCK8(2, 6)
TPE_GEMM_BLOCK8(1, 7)
TPE_GEMM_BLOCK8(1, 8)

typedef void (*gemm_block_fn)(const float *, const float *, int64_t, float *, int64_t, int64_t, int, int, int);

void tpe_gemm_f32(const float *x, int64_t m, int64_t k, const float *w, int64_t n, float *y, float *xt,
                  int nthreads) {
    static const int block_rows[9] = {0, 12, 6, 4, 3, 2, 2, 1, 1};
    static const gemm_block_fn blocks[9] = {0, gemm_block_12_1, gemm_block_6_2, gemm_block_4_3, gemm_block_3_4,
                                            gemm_block_2_5, gemm_block_2_6, gemm_block_1_7, gemm_block_1_8};
    for (int64_t m0 = 0; m0 < m; m0 += TPE_GEMM_M) {
        const int rows = m - m0 < TPE_GEMM_M ? (int)(m - m0) : TPE_GEMM_M, mv = (rows + 7) / 8;
        const int nr = block_rows[mv];
        const gemm_block_fn block = blocks[mv];
        const int64_t nblocks = (n + nr - 1) / nr;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && n * k >= 65536)
        {
#pragma omp for schedule(static)
            for (int64_t i0 = 0; i0 < k; i0 += 16) { /* the panel: xt[i][r] = x[m0 + r][i], zero past the rows */
                const int64_t i1 = i0 + 16 < k ? i0 + 16 : k;
                for (int r = 0; r < 8 * mv; r++)
                    for (int64_t i = i0; i < i1; i++) xt[i * TPE_GEMM_M + r] = r < rows ? x[(m0 + r) * k + i] : 0.f;
            }
#pragma omp for schedule(static)
            for (int64_t b = 0; b < nblocks; b++) {
                const int64_t n0 = b * nr;
                block(xt, w, k, y + m0 * n, n, n0, n - n0 < nr ? (int)(n - n0) : nr, rows, n0 + 2 * nr <= n);
            }
        }
    }
}
#endif /* neither path: left out of the build; the callers keep torch (cpu_library.has) */
