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
#include <string.h>

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
#include <omp.h>
/* AVX2 + FMA: the same outer products, 8 rows of x per vector, each output the same single FMA chain over k
 * in order, so the results equal the AVX-512 path's bit for bit. The panel is split into 4 passes of 16
 * rows, [pass][k][16], and a block of NR = 6 weight rows runs every pass while its rows are in L1:
 * 6 x 2 accumulators (12 of AVX2's 16 registers), 2 vector loads of the panel and 6 broadcasts per 12
 * FMAs, so the panel (streamed from L2 once per pass) and the broadcasts stay below the FMA rate, and
 * every weight element is read from memory once per 64 rows of x.
 *
 * tpe_gemm_bf16 takes a bfloat16 weight (and x, y) on CPUs without a bfloat16 GEMM: each block's 6
 * weight rows are widened to float32 once into the thread's scratch (exact), then run the same
 * micro-kernel; the products are float32's, each output rounded once to bfloat16 (nearest even). */
#include "bf16.h"
#define TPE_GEMM_M 64
#define TPE_GEMM_PASS 16
#define TPE_GEMM_NR 6

/* out[r][8 j + lane] = sum_k w[r][k] * xt[k][8 j + lane] for the 6 rows w[r] (ldw apart), 16 (MV = 2) or 8
 * (MV = 1) rows of x. The accumulators are named variables, not an array: GCC keeps an array of vectors in
 * memory and stores all of it every iteration. pf (unless NULL): 6 rows of es-byte elements, pfld bytes
 * apart (the next block's weight rows), prefetched a cache line at a time along with the loop: six short
 * streams the hardware prefetcher does not follow, fetched while this block computes. */
#define TPE_PREFETCH                                                                                              \
    if (pf && ((i * es) & 63) == 0)                                                                               \
        for (int r = 0; r < TPE_GEMM_NR; r++) _mm_prefetch(pf + r * pfld + i * es, _MM_HINT_T0);
#define TPE_ACC2(r) __m256 a##r##0 = _mm256_setzero_ps(), a##r##1 = _mm256_setzero_ps();
#define TPE_FMA2(r)                                                                                               \
    {                                                                                                             \
        const __m256 b = _mm256_broadcast_ss(w + r * ldw + i);                                                    \
        a##r##0 = _mm256_fmadd_ps(b, x0, a##r##0);                                                                \
        a##r##1 = _mm256_fmadd_ps(b, x1, a##r##1);                                                                \
    }
#define TPE_OUT2(r) _mm256_store_ps(out[r], a##r##0), _mm256_store_ps(out[r] + 8, a##r##1);
static void gemm_pass_2(const float *restrict xt, const float *restrict w, int64_t ldw, int64_t k,
                        float out[TPE_GEMM_NR][TPE_GEMM_PASS], const char *pf, int64_t pfld, int es) {
    TPE_ACC2(0) TPE_ACC2(1) TPE_ACC2(2) TPE_ACC2(3) TPE_ACC2(4) TPE_ACC2(5)
    for (int64_t i = 0; i < k; i++) {
        TPE_PREFETCH
        const __m256 x0 = _mm256_load_ps(xt + i * TPE_GEMM_PASS), x1 = _mm256_load_ps(xt + i * TPE_GEMM_PASS + 8);
        TPE_FMA2(0) TPE_FMA2(1) TPE_FMA2(2) TPE_FMA2(3) TPE_FMA2(4) TPE_FMA2(5)
    }
    TPE_OUT2(0) TPE_OUT2(1) TPE_OUT2(2) TPE_OUT2(3) TPE_OUT2(4) TPE_OUT2(5)
}

#define TPE_ACC1(r) __m256 a##r##0 = _mm256_setzero_ps();
#define TPE_FMA1(r) a##r##0 = _mm256_fmadd_ps(_mm256_broadcast_ss(w + r * ldw + i), x0, a##r##0);
#define TPE_OUT1(r) _mm256_store_ps(out[r], a##r##0);
static void gemm_pass_1(const float *restrict xt, const float *restrict w, int64_t ldw, int64_t k,
                        float out[TPE_GEMM_NR][TPE_GEMM_PASS], const char *pf, int64_t pfld, int es) {
    TPE_ACC1(0) TPE_ACC1(1) TPE_ACC1(2) TPE_ACC1(3) TPE_ACC1(4) TPE_ACC1(5)
    for (int64_t i = 0; i < k; i++) {
        TPE_PREFETCH
        const __m256 x0 = _mm256_load_ps(xt + i * TPE_GEMM_PASS);
        TPE_FMA1(0) TPE_FMA1(1) TPE_FMA1(2) TPE_FMA1(3) TPE_FMA1(4) TPE_FMA1(5)
    }
    TPE_OUT1(0) TPE_OUT1(1) TPE_OUT1(2) TPE_OUT1(3) TPE_OUT1(4) TPE_OUT1(5)
}

/* dst[c * TPE_GEMM_PASS + j] = x[j * k + c] for 8 rows j (zero from row nrow on) and 8 columns c, as floats:
 * 8 row loads, the 8 x 8 transpose in registers (unpack, shuffle, 128-bit permute), 8 aligned column stores,
 * where the scalar loop read each element at a stride of k. Only moves (and bfloat16's exact widening), so
 * the panel, hence every product, is unchanged. LD: 8 elements at p -> float32. */
#define TPE_GEMM_TILE(X, LD)                                                                                      \
    static inline void tile_##X(const X *x, int64_t k, int nrow, float *dst) {                                    \
        __m256 r[8];                                                                                              \
        for (int j = 0; j < 8; j++) r[j] = j < nrow ? LD(x + j * k) : _mm256_setzero_ps();                       \
        const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);                   \
        const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);                   \
        const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);                   \
        const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);                   \
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);                 \
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);                 \
        const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);                 \
        const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);                 \
        _mm256_store_ps(dst + 0 * TPE_GEMM_PASS, _mm256_permute2f128_ps(u0, u4, 0x20));                          \
        _mm256_store_ps(dst + 1 * TPE_GEMM_PASS, _mm256_permute2f128_ps(u1, u5, 0x20));                          \
        _mm256_store_ps(dst + 2 * TPE_GEMM_PASS, _mm256_permute2f128_ps(u2, u6, 0x20));                          \
        _mm256_store_ps(dst + 3 * TPE_GEMM_PASS, _mm256_permute2f128_ps(u3, u7, 0x20));                          \
        _mm256_store_ps(dst + 4 * TPE_GEMM_PASS, _mm256_permute2f128_ps(u0, u4, 0x31));                          \
        _mm256_store_ps(dst + 5 * TPE_GEMM_PASS, _mm256_permute2f128_ps(u1, u5, 0x31));                          \
        _mm256_store_ps(dst + 6 * TPE_GEMM_PASS, _mm256_permute2f128_ps(u2, u6, 0x31));                          \
        _mm256_store_ps(dst + 7 * TPE_GEMM_PASS, _mm256_permute2f128_ps(u3, u7, 0x31));                          \
    }
TPE_GEMM_TILE(float, _mm256_loadu_ps)
TPE_GEMM_TILE(uint16_t, ld8)

/* The panel of rows m0.. (at most 64): xt[p][i][r] = x[m0 + 16 p + r][i], zero past the rows; run by every thread
 * of the team (omp for, 16 columns of x a chunk). X is float or uint16_t (bfloat16, widened exactly). Each pass's
 * two halves of 8 rows are moved in 8 x 8 tiles (tile_X), the last k % 8 columns one element at a time. */
#define TPE_GEMM_PANEL(X, CVT)                                                                                    \
    static void panel_##X(const X *x, int64_t k, int rows, float *xt) {                                           \
        const int passes = (rows + TPE_GEMM_PASS - 1) / TPE_GEMM_PASS;                                           \
        _Pragma("omp for schedule(static)") for (int64_t i0 = 0; i0 < k; i0 += 16) {                              \
            const int64_t i1 = i0 + 16 < k ? i0 + 16 : k;                                                        \
            for (int p = 0; p < passes; p++)                                                                      \
                for (int h = 0; h < TPE_GEMM_PASS; h += 8) {                                                      \
                    const int row0 = TPE_GEMM_PASS * p + h, left = rows - row0, nrow = left < 8 ? left : 8;       \
                    float *dst = xt + p * k * TPE_GEMM_PASS + h;                                                  \
                    int64_t i = i0;                                                                               \
                    if (nrow > 0)                                                                                 \
                        for (; i + 8 <= i1; i += 8) tile_##X(x + row0 * k + i, k, nrow, dst + i * TPE_GEMM_PASS); \
                    for (; i < i1; i++)                                                                           \
                        for (int r = 0; r < 8; r++)                                                               \
                            dst[i * TPE_GEMM_PASS + r] = r < nrow ? CVT(x[(row0 + r) * k + i]) : 0.f;             \
                }                                                                                                 \
        }                                                                                                         \
    }
#define TPE_ID(v) (v)
TPE_GEMM_PANEL(float, TPE_ID)
TPE_GEMM_PANEL(uint16_t, bf2f)

/* ob[r][0..n - 1] = out[r][0..n - 1] rounded to bfloat16 (st8: nearest even, as f2bf), r < nr. Not inlined:
 * its constants would otherwise stay in registers across the micro-kernel the caller inlines, which then
 * spills its accumulators (docs/notes/avx2.md). */
static __attribute__((noinline)) void round_block(const float out[TPE_GEMM_NR][TPE_GEMM_PASS],
                                                  uint16_t ob[TPE_GEMM_NR][TPE_GEMM_PASS], int nr, int n) {
    for (int r = 0; r < nr; r++) {
        st8(ob[r], _mm256_load_ps(out[r]));
        if (n > 8) st8(ob[r] + 8, _mm256_load_ps(out[r] + 8));
    }
}

/* One block of nr (<= 6) weight rows n0.. (float32 rows w at stride k) against every pass of the panel,
 * y[m][n0 + r] for the rows of x; Y float (each pass's outputs stored from out) or uint16_t (ROUND first
 * rounds them to bfloat16 into ob, 8 at a time: round_block). The first pass prefetches pf (see gemm_pass_2). */
#define TPE_GEMM_STORE(Y, RES, ROUND)                                                                             \
    static void block_##Y(const float *xt, const float *w, int64_t k, Y *y, int64_t ldy, int64_t n0, int nr,      \
                          int rows, const char *pf, int64_t pfld, int es) {                                       \
        float out[TPE_GEMM_NR][TPE_GEMM_PASS] __attribute__((aligned(32)));                                       \
        for (int p = 0; p * TPE_GEMM_PASS < rows; p++) {                                                          \
            const int left = rows - p * TPE_GEMM_PASS, n = left < TPE_GEMM_PASS ? left : TPE_GEMM_PASS;           \
            const char *f = p == 0 ? pf : NULL;                                                                   \
            if (n > 8) gemm_pass_2(xt + p * k * TPE_GEMM_PASS, w, k, k, out, f, pfld, es);                        \
            else gemm_pass_1(xt + p * k * TPE_GEMM_PASS, w, k, k, out, f, pfld, es);                              \
            ROUND;                                                                                                \
            for (int m = 0; m < n; m++)                                                                           \
                for (int r = 0; r < nr; r++) y[(p * TPE_GEMM_PASS + m) * ldy + n0 + r] = RES[r][m];               \
        }                                                                                                         \
    }
TPE_GEMM_STORE(float, out, (void)0)
TPE_GEMM_STORE(uint16_t, ob, uint16_t ob[TPE_GEMM_NR][TPE_GEMM_PASS]; round_block(out, ob, nr, n))

/* The float32 rows of weight block n0 (nr <= 6 rows, the last standing in for missing ones) for the
 * micro-kernel: a full float32 block is read in place; otherwise the rows are copied (float32) or widened
 * (bfloat16, exact) into the thread's rows of the scratch, wb. */
static const float *rows_float(const float *w, int64_t k, int64_t n0, int nr, float *wb) {
    if (nr == TPE_GEMM_NR) return w + n0 * k;
    for (int r = 0; r < TPE_GEMM_NR; r++) memcpy(wb + r * k, w + (n0 + (r < nr ? r : nr - 1)) * k, sizeof(float) * k);
    return wb;
}
static const float *rows_uint16_t(const uint16_t *w, int64_t k, int64_t n0, int nr, float *wb) {
    for (int r = 0; r < TPE_GEMM_NR; r++) {
        const uint16_t *src = w + (n0 + (r < nr ? r : nr - 1)) * k;
        int64_t i = 0;
        for (; i + 8 <= k; i += 8) _mm256_storeu_ps(wb + r * k + i, ld8(src + i));
        for (; i < k; i++) wb[r * k + i] = bf2f(src[i]);
    }
    return wb;
}

/* x [m, k], w [n, k], y [m, n], all contiguous T (float32, or bfloat16 as uint16_t); scratch: k * (64 + 6 *
 * nthreads) floats, 32-byte aligned (the panel, then each thread's 6 weight rows where a block is copied or
 * widened). Passes of 64 rows of x; in each, the panel, then the weight blocks split between the threads,
 * the next block's rows prefetched along the first pass of this one (a short last block prefetches none). */
#define TPE_GEMM_CALL(NAME, T)                                                                                    \
    void NAME(const T *x, int64_t m, int64_t k, const T *w, int64_t n, T *y, float *scratch, int nthreads) {     \
        const int64_t nblocks = (n + TPE_GEMM_NR - 1) / TPE_GEMM_NR;                                              \
        for (int64_t m0 = 0; m0 < m; m0 += TPE_GEMM_M) {                                                          \
            const int rows = m - m0 < TPE_GEMM_M ? (int)(m - m0) : TPE_GEMM_M;                                    \
            _Pragma("omp parallel num_threads(nthreads) if (nthreads > 1 && n * k >= 65536)") {                   \
                float *wb = scratch + k * (TPE_GEMM_M + TPE_GEMM_NR * (int64_t)omp_get_thread_num());             \
                panel_##T(x + m0 * k, k, rows, scratch);                                                          \
                _Pragma("omp for schedule(static)") for (int64_t b = 0; b < nblocks; b++) {                       \
                    const int64_t n0 = b * TPE_GEMM_NR;                                                           \
                    const int nr = n - n0 < TPE_GEMM_NR ? (int)(n - n0) : TPE_GEMM_NR;                            \
                    const char *pf = n0 + 2 * TPE_GEMM_NR <= n ? (const char *)(w + (n0 + TPE_GEMM_NR) * k) : NULL; \
                    block_##T(scratch, rows_##T(w, k, n0, nr, wb), k, y + m0 * n, n, n0, nr, rows, pf,            \
                              k * (int64_t)sizeof(T), (int)sizeof(T));                                             \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
    }
TPE_GEMM_CALL(tpe_gemm_f32, float)
TPE_GEMM_CALL(tpe_gemm_bf16, uint16_t)
#endif /* neither path: left out of the build; the callers keep torch (cpu_library.has) */

/* float32 GEMM on tpengine's blocked weight layout (cpu_blocked.c: w [n/16][k][16], each k step of a block of 16
 * weight rows one 64-byte line) for many rows of x: a decode batch's 64, a prefill's thousands. y = x @ w^T,
 * x [rows, k], y [rows, n], row-major; any rows, n % 16 == 0.
 *
 * The same products as tpe_blocked_gemm_f32 (each output the FMA chain over k in order from zero, x[r][p]
 * broadcast against the weight's line), so the outputs are that kernel's bit for bit; what differs is the
 * order the tiles run in. That kernel runs, for each panel of blocks, every row of x, so at a prefill's rows
 * x is streamed from beyond L2 once per panel of 32 outputs. Here the rows are taken in chunks whose rows of x
 * fit half the L2 (GB_CHUNK: from the cache size the C library reports), and each chunk runs every panel of
 * the thread's blocks, so x comes from L2 and the weight is what streams. The register tile is R rows x J
 * blocks: AVX-512 6 x 4 (24 accumulators; 4 loads of the weight and 6 broadcasts of x per 24 FMAs), AVX2 6 x 1
 * (a block is two ymm: 12 accumulators, 2 loads and 6 broadcasts per 12 FMAs). The first row tile of a chunk
 * prefetches the panel's lines 1 KiB ahead (the weight's one pass from memory; the later tiles find it in L2).
 * In a call's first chunk (a decode batch's only one) every tile of a panel also prefetches a share of the next
 * panel's lines into L2, one line every s steps of k (s: the chunk's tiles over the next panel's blocks, so the
 * panel's tiles cover it): the weight's stream from memory then runs under this panel's FMAs instead of
 * stalling the next panel's first tile, which at a decode batch's rows is a large part of a panel's time. A
 * prefill's later chunks keep the 1 KiB prefetch alone (docs/notes/kernels.md). Prefetches change no output.
 * The blocks are split evenly between the threads (a thread's last blocks in panels of 2 or 1). */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include <unistd.h>
#ifdef __AVX512F__
#define GB_NV 1 /* vectors per block line */
#define GB_VL 16
#define GB_J 4 /* blocks per tile */
#define GB_V __m512
#define GB_LOAD _mm512_loadu_ps
#define GB_SET1 _mm512_set1_ps
#define GB_FMA _mm512_fmadd_ps
#define GB_ZERO _mm512_setzero_ps
#define GB_STORE _mm512_storeu_ps
#else
#define GB_NV 2
#define GB_VL 8
#define GB_J 1
#define GB_V __m256
#define GB_LOAD _mm256_loadu_ps
#define GB_SET1 _mm256_set1_ps
#define GB_FMA _mm256_fmadd_ps
#define GB_ZERO _mm256_setzero_ps
#define GB_STORE _mm256_storeu_ps
#endif
#define GB_R 6        /* rows per tile */
#define GB_PF 256     /* prefetch distance in floats (1 KiB) */

/* y[r][16 (b + j) + i], r < R, j < J: rows of x at x + r k, blocks b.. of w, rows of y n apart; pf: prefetch.
 * nx (or NULL): the next panel's 64-byte lines, lines li.. of which it prefetches into L2, one every s steps. */
#define GB_KERNEL(R, J)                                                                                          \
    static void gb_##R##_##J(const float *x, int64_t k, const float *w, int64_t b, float *y, int64_t n, int pf,   \
                             const char *nx, int64_t li, int64_t lines, int s) {                                \
        const float *wb = w + b * 16 * k;                                                                       \
        GB_V acc[R][J][GB_NV];                                                                                  \
        for (int r = 0; r < R; r++)                                                                             \
            for (int j = 0; j < J; j++)                                                                         \
                for (int h = 0; h < GB_NV; h++) acc[r][j][h] = GB_ZERO();                                       \
        int due = s;                                                                                            \
        for (int64_t p = 0; p < k; p++) {                                                                       \
            if (nx && --due == 0) {                                                                             \
                due = s;                                                                                        \
                if (li < lines) _mm_prefetch(nx + 64 * li, _MM_HINT_T1);                                        \
                li++;                                                                                           \
            }                                                                                                   \
            GB_V wv[J][GB_NV];                                                                                  \
            for (int j = 0; j < J; j++) {                                                                       \
                if (pf) _mm_prefetch((const char *)(wb + j * 16 * k + p * 16 + GB_PF), _MM_HINT_T0);            \
                for (int h = 0; h < GB_NV; h++) wv[j][h] = GB_LOAD(wb + j * 16 * k + p * 16 + h * GB_VL);       \
            }                                                                                                   \
            for (int r = 0; r < R; r++) {                                                                       \
                const GB_V xv = GB_SET1(x[r * k + p]);                                                          \
                for (int j = 0; j < J; j++)                                                                     \
                    for (int h = 0; h < GB_NV; h++) acc[r][j][h] = GB_FMA(wv[j][h], xv, acc[r][j][h]);          \
            }                                                                                                   \
        }                                                                                                       \
        for (int r = 0; r < R; r++)                                                                             \
            for (int j = 0; j < J; j++)                                                                         \
                for (int h = 0; h < GB_NV; h++) GB_STORE(y + r * n + (b + j) * 16 + h * GB_VL, acc[r][j][h]);   \
    }
#define GB_ROWS(J) GB_KERNEL(1, J) GB_KERNEL(2, J) GB_KERNEL(3, J) GB_KERNEL(4, J) GB_KERNEL(5, J) GB_KERNEL(6, J)
typedef void (*gb_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, int, const char *, int64_t,
                      int64_t, int);
GB_ROWS(1)
#if GB_J == 4
GB_ROWS(2)
GB_ROWS(4)
static const gb_fn gb_wide[GB_R + 1] = {0, gb_1_4, gb_2_4, gb_3_4, gb_4_4, gb_5_4, gb_6_4};
static const gb_fn gb_two[GB_R + 1] = {0, gb_1_2, gb_2_2, gb_3_2, gb_4_2, gb_5_2, gb_6_2};
#endif
static const gb_fn gb_one[GB_R + 1] = {0, gb_1_1, gb_2_1, gb_3_1, gb_4_1, gb_5_1, gb_6_1};

/* Rows of x per chunk: as many as fill half the L2 with k floats each (at least one tile), whole tiles. */
static int64_t gb_chunk(int64_t k) {
    static int64_t l2 = -1;
    if (l2 < 0) {
        const long s = sysconf(_SC_LEVEL2_CACHE_SIZE);
        l2 = s > 0 ? s : 1 << 20; /* not reported: 1 MiB, the smallest L2 of the CPUs with these ISAs */
    }
    const int64_t rows = l2 / 2 / (4 * k);
    return rows < GB_R ? GB_R : rows / GB_R * GB_R;
}

/* Rows m0..m1 of x against blocks b0..b1 of w: each panel of J blocks (the last ones 2 or 1 at a time), tiles of
 * R rows (the last one shorter); ahead: the tiles prefetch the next panel (up to J blocks, within b1). */
static void gb_range(const float *x, int64_t m0, int64_t m1, int64_t k, const float *w, int64_t b0, int64_t b1,
                     float *y, int64_t n, int ahead) {
    const int64_t tiles = (m1 - m0 + GB_R - 1) / GB_R;
    for (int64_t b = b0; b < b1;) {
        const gb_fn *fns = gb_one;
        int nb = 1;
#if GB_J == 4
        const int64_t left = b1 - b;
        if (left >= 4) fns = gb_wide, nb = 4;
        else if (left >= 2) fns = gb_two, nb = 2;
#endif
        const int64_t next = ahead ? (b1 - b - nb < GB_J ? b1 - b - nb : GB_J) : 0; /* the next panel's blocks */
        const char *nx = next > 0 ? (const char *)(w + (b + nb) * 16 * k) : NULL;
        const int s = next > 0 && tiles >= next ? (int)(tiles / next) : 1;
        int64_t li = 0;
        for (int64_t r = m0; r < m1; r += GB_R, li += k / s) {
            const int rr = m1 - r < GB_R ? (int)(m1 - r) : GB_R;
            fns[rr](x + r * k, k, w, b, y + r * n, n, r == m0, li < next * k ? nx : NULL, li, next * k, s);
        }
        b += nb;
    }
}

/* y [rows, n] = x [rows, k] @ w^T, w blocked float32 [n/16][k][16]; any rows. */
void tpe_gemm_blocked_f32(const float *x, int64_t rows, int64_t k, const float *w, int64_t n, float *y, int nthreads) {
    const int64_t blocks = n / 16, chunk = gb_chunk(k);
    if (rows <= 0 || blocks <= 0) return;
    const int nt = nthreads > 1 && n * k >= 65536 ? nthreads : 1;
    const int64_t per = (blocks + nt - 1) / nt; /* blocks per thread */
#pragma omp parallel for schedule(static, 1) num_threads(nt) if (nt > 1)
    for (int t = 0; t < nt; t++) {
        const int64_t b0 = t * per, b1 = b0 + per < blocks ? b0 + per : blocks;
        for (int64_t m0 = 0; b0 < b1 && m0 < rows; m0 += chunk)
            gb_range(x, m0, m0 + chunk < rows ? m0 + chunk : rows, k, w, b0, b1, y, n, m0 == 0);
    }
}
#endif
