/* The row-blocked GEMV shared by cpu_gemv.c (bfloat16, float32) and cpu_qgemv.c (int8): y = x @ w^T
 * over output rows o0..o1 of w [n, k] (row-major), for R rows of x at once, J weight rows at a time
 * (then one at a time for the tail), float32 accumulators per (row, weight row) reduced at the end.
 * Each weight row is read once for all R rows of x, and the next group of J weight rows is
 * prefetched once per cache line while a group is read. Instantiated per element type with:
 *   TW, TX, TY  the weight, x and y element types;   STEP  elements of k per step (one vector);
 *   VEC         the vector type WLOAD and XLOAD give; WLOAD(p), XLOAD(p): one step's vector;
 *   MAC(acc, xv, wv): acc + xv * wv in float32;       OUT(f): the float32 sum stored as TY.
 * The accumulators are TPE_ACC vectors: 16 float32 lanes on the AVX-512 path, 8 on AVX2 (bf16.h's
 * TPE_AVX512 / TPE_AVX2; include bf16.h first), where the row counts pair with fewer weight rows so
 * that the accumulators stay in AVX2's 16 registers. */
#ifndef TPE_GEMV_H
#define TPE_GEMV_H
#include <immintrin.h>
#include <stdint.h>

#ifdef TPE_AVX512
#define TPE_ACC __m512
#define TPE_ACC_ZERO _mm512_setzero_ps
#define TPE_ACC_SUM _mm512_reduce_add_ps
#define TPE_J1 4 /* weight rows per group at 1, 2, 4 and 8 rows of x */
#define TPE_J2 4
#define TPE_J4 4
#define TPE_J8 2
#else
#define TPE_ACC __m256
#define TPE_ACC_ZERO _mm256_setzero_ps
#define TPE_ACC_SUM hsum8
#define TPE_J1 4
#define TPE_J2 4
#define TPE_J4 2
#define TPE_J8 1
#endif

#define TPE_GEMV_ROWS(NAME, R, J, TW, TX, TY, STEP, VEC, WLOAD, XLOAD, MAC, OUT)                              \
    static void NAME(const TX *x, int64_t k, const TW *w, int64_t o0, int64_t o1, TY *y, int64_t n) {         \
        int64_t o = o0;                                                                                       \
        for (; o + J <= o1; o += J) {                                                                         \
            TPE_ACC acc[R][J];                                                                                     \
            for (int r = 0; r < R; r++)                                                                       \
                for (int j = 0; j < J; j++) acc[r][j] = TPE_ACC_ZERO();                                      \
            for (int64_t i = 0; i < k; i += STEP) {                                                           \
                VEC wv[J];                                                                                    \
                if (((i * (int64_t)sizeof(TW)) & 63) == 0)                                                    \
                    for (int j = 0; j < J; j++) _mm_prefetch((const char *)(w + (o + J + j) * k + i), _MM_HINT_T0); \
                for (int j = 0; j < J; j++) wv[j] = WLOAD(w + (o + j) * k + i);                               \
                for (int r = 0; r < R; r++) {                                                                 \
                    const VEC xv = XLOAD(x + r * k + i);                                                      \
                    for (int j = 0; j < J; j++) acc[r][j] = MAC(acc[r][j], xv, wv[j]);                        \
                }                                                                                             \
            }                                                                                                 \
            for (int r = 0; r < R; r++)                                                                       \
                for (int j = 0; j < J; j++) y[r * n + o + j] = OUT(TPE_ACC_SUM(acc[r][j]));                   \
        }                                                                                                     \
        for (; o < o1; o++) {                                                                                 \
            TPE_ACC acc[R];                                                                                   \
            for (int r = 0; r < R; r++) acc[r] = TPE_ACC_ZERO();                                              \
            for (int64_t i = 0; i < k; i += STEP) {                                                           \
                const VEC wv = WLOAD(w + o * k + i);                                                          \
                for (int r = 0; r < R; r++) acc[r] = MAC(acc[r], XLOAD(x + r * k + i), wv);                   \
            }                                                                                                 \
            for (int r = 0; r < R; r++) y[r * n + o] = OUT(TPE_ACC_SUM(acc[r]));                              \
        }                                                                                                     \
    }

/* The four row counts one call is split into (AVX-512: 8 rows against 2 weight rows, else 4, 2, 1 against 4),
 * all named PREFIX_R, and the call over output rows o0..o1 for `rows` rows of x. TPE_GEMV_FAMILY_J takes
 * the weight rows per group at one row of x, J1, where a type reads better with another than TPE_J1. */
#define TPE_GEMV_FAMILY(PREFIX, TW, TX, TY, STEP, VEC, WLOAD, XLOAD, MAC, OUT)                                \
    TPE_GEMV_FAMILY_J(PREFIX, TPE_J1, TW, TX, TY, STEP, VEC, WLOAD, XLOAD, MAC, OUT)
#define TPE_GEMV_FAMILY_J(PREFIX, J1, TW, TX, TY, STEP, VEC, WLOAD, XLOAD, MAC, OUT)                          \
    TPE_GEMV_ROWS(PREFIX##_1, 1, J1, TW, TX, TY, STEP, VEC, WLOAD, XLOAD, MAC, OUT)                                \
    TPE_GEMV_ROWS(PREFIX##_2, 2, TPE_J2, TW, TX, TY, STEP, VEC, WLOAD, XLOAD, MAC, OUT)                            \
    TPE_GEMV_ROWS(PREFIX##_4, 4, TPE_J4, TW, TX, TY, STEP, VEC, WLOAD, XLOAD, MAC, OUT)                            \
    TPE_GEMV_ROWS(PREFIX##_8, 8, TPE_J8, TW, TX, TY, STEP, VEC, WLOAD, XLOAD, MAC, OUT)                            \
    static void PREFIX##_rows(const TX *x, int64_t rows, int64_t k, const TW *w, int64_t o0, int64_t o1, TY *y, \
                              int64_t n) {                                                                    \
        int64_t r = 0;                                                                                        \
        for (; r + 8 <= rows; r += 8) PREFIX##_8(x + r * k, k, w, o0, o1, y + r * n, n);                      \
        for (; r + 4 <= rows; r += 4) PREFIX##_4(x + r * k, k, w, o0, o1, y + r * n, n);                      \
        for (; r + 2 <= rows; r += 2) PREFIX##_2(x + r * k, k, w, o0, o1, y + r * n, n);                      \
        for (; r < rows; r++) PREFIX##_1(x + r * k, k, w, o0, o1, y + r * n, n);                              \
    }

/* Output rows per thread: whole groups of 4. */
static inline int64_t tpe_gemv_chunk(int64_t n, int nthreads) { return ((n + nthreads - 1) / nthreads + 3) / 4 * 4; }

#endif
