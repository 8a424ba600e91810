/* Greedy token selection on CPU: the index of each row's (tpe_row_argmax_*) or each column's
 * (tpe_col_argmax_*) maximum of a logits matrix, as torch's max(dim) picks it: the *first* index
 * holding the maximum, NaN counting as larger than everything (the first NaN wins). One pass over
 * the logits, 16 lanes at a time (AVX-512; the AVX2 row argmax 8), each lane keeping its running
 * maximum, its index and whether it has seen a NaN; torch's blocked amax + argmax takes several
 * passes and a strided reduction.
 *
 * Layout: x [rows, cols], rows ld elements apart (ld >= cols), float32 or bfloat16 (widened exactly
 * to float32); idx int64.
 *   row argmax: idx [rows], the column of each row's maximum; rows split between the threads.
 *   col argmax: idx [cols], the row of each column's maximum (the transposed logits W @ h^T of a
 *               greedy LM head, [vocab, batch]); the rows split into one range per thread, whose
 *               partial results are merged in order (an earlier range wins a tie).
 * Needs rows, cols >= 1. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

/* Whether candidate (v, i, nan) beats the current (bv, bi, bnan) under torch's rule: NaN first,
 * then the larger value, then the smaller index. */
static inline int beats(float v, int64_t i, int isnan_, float bv, int64_t bi, int bnan) {
    if (bnan) return isnan_ && i < bi;
    if (isnan_) return 1;
    return v > bv || (v == bv && i < bi);
}

#ifdef TPE_AVX512
#include <immintrin.h>

static inline __m512 ld_f32(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 ld_bf16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

/* One lane state step: take x where it is larger than the running maximum or is the lane's first
 * NaN (never after a NaN: the first NaN stays). */
static inline void take(__m512 x, __m512i at, __m512 *mx, __m512i *ix, __mmask16 *nan, __mmask16 m) {
    const __mmask16 isnan = _mm512_mask_cmp_ps_mask(m & ~*nan, x, x, _CMP_UNORD_Q);
    const __mmask16 up = _mm512_mask_cmp_ps_mask(m & ~*nan, x, *mx, _CMP_GT_OQ) | isnan;
    *mx = _mm512_mask_mov_ps(*mx, up, x);
    *ix = _mm512_mask_mov_epi32(*ix, up, at);
    *nan |= isnan;
}

/* Each row in four interleaved lane sets (columns c + 16 k of every 64, k < 4: four independent
 * chains of compares), reduced at the end. */
#define ROW_ARGMAX(NAME, T, LD)                                                                                        \
    void NAME(const T *x, int64_t rows, int64_t cols, int64_t ld, int64_t *idx, int nthreads) {                        \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (rows > 1 && rows * cols >= 65536)")       \
        for (int64_t r = 0; r < rows; r++) {                                                                           \
            const T *p = x + r * ld;                                                                                   \
            const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);               \
            __m512 mx[4];                                                                                              \
            __m512i ix[4];                                                                                             \
            __mmask16 nan[4], seen[4]; /* seen: lanes with an element yet (a lane's first is always taken) */          \
            for (int k = 0; k < 4; k++)                                                                                \
                mx[k] = _mm512_set1_ps(-INFINITY), ix[k] = _mm512_set1_epi32(0), nan[k] = seen[k] = 0;                 \
            for (int64_t c = 0; c < cols; c += 64)                                                                     \
                for (int k = 0; k < 4; k++) {                                                                          \
                    const int64_t n = cols - c - 16 * k;                                                               \
                    const __mmask16 m = n >= 16 ? (__mmask16)0xffff : n > 0 ? (__mmask16)((1u << n) - 1) : 0;          \
                    const __m512 v = LD(p + c + 16 * k, m);                                                            \
                    const __m512i at = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(c + 16 * k)));                   \
                    const __mmask16 first = m & ~seen[k];                                                              \
                    mx[k] = _mm512_mask_mov_ps(mx[k], first, v);                                                       \
                    ix[k] = _mm512_mask_mov_epi32(ix[k], first, at);                                                   \
                    nan[k] |= _mm512_mask_cmp_ps_mask(first, v, v, _CMP_UNORD_Q);                                      \
                    take(v, at, &mx[k], &ix[k], &nan[k], m & seen[k]);                                                 \
                    seen[k] |= m;                                                                                      \
                }                                                                                                      \
            float mv[64];                                                                                              \
            int32_t iv[64];                                                                                            \
            for (int k = 0; k < 4; k++) _mm512_storeu_ps(mv + 16 * k, mx[k]), _mm512_storeu_si512(iv + 16 * k, ix[k]); \
            int best = 0; /* lane 0 of set 0 holds column 0: always seen */                                            \
            for (int l = 1; l < 64; l++) {                                                                             \
                const int k = l / 16, b = best / 16;                                                                   \
                if (((seen[k] >> (l % 16)) & 1) && beats(mv[l], iv[l], (nan[k] >> (l % 16)) & 1, mv[best],             \
                                                         iv[best], (nan[b] >> (best % 16)) & 1))                       \
                    best = l;                                                                                          \
            }                                                                                                          \
            idx[r] = iv[best];                                                                                         \
        }                                                                                                              \
    }

/* Columns c0 .. c0 + 64 (four groups of 16, masks m[g]; a group with mask 0 reads nothing) over rows
 * r0..r1 (r1 > r0), one pass over the rows: per column the first row of its maximum. */
#define COL_RANGE(NAME, T, LD)                                                                                         \
    static void NAME(const T *x, int64_t ld, int64_t r0, int64_t r1, int64_t c0, const __mmask16 *m,                   \
                     float *mv, int64_t *iv, uint16_t *nanv) {                                                         \
        __m512 mx[4];                                                                                                  \
        __m512i ix[4];                                                                                                 \
        __mmask16 nan[4];                                                                                              \
        for (int g = 0; g < 4; g++) {                                                                                  \
            mx[g] = LD(x + r0 * ld + c0 + 16 * g, m[g]);                                                               \
            ix[g] = _mm512_set1_epi32((int)r0);                                                                        \
            nan[g] = _mm512_mask_cmp_ps_mask(m[g], mx[g], mx[g], _CMP_UNORD_Q);                                        \
        }                                                                                                              \
        for (int64_t r = r0 + 1; r < r1; r++) {                                                                        \
            const __m512i at = _mm512_set1_epi32((int)r);                                                              \
            for (int g = 0; g < 4; g++) take(LD(x + r * ld + c0 + 16 * g, m[g]), at, &mx[g], &ix[g], &nan[g], m[g]);   \
        }                                                                                                              \
        for (int g = 0; g < 4; g++) {                                                                                  \
            int32_t i32[16];                                                                                           \
            _mm512_storeu_ps(mv + 16 * g, mx[g]);                                                                      \
            _mm512_storeu_si512(i32, ix[g]);                                                                           \
            for (int l = 0; l < 16; l++) iv[16 * g + l] = i32[l];                                                      \
            nanv[g] = nan[g];                                                                                          \
        }                                                                                                              \
    }

#define COL_ARGMAX(NAME, RANGE, T)                                                                                     \
    void NAME(const T *x, int64_t rows, int64_t cols, int64_t ld, int64_t *idx, int nthreads) {                        \
        int nt = rows * cols >= 65536 ? nthreads : 1;                                                                  \
        if (nt > rows) nt = (int)rows;                                                                                 \
        const int64_t groups = (cols + 15) / 16, groups4 = (groups + 3) / 4 * 4; /* 16-column groups */                \
        float *mv = malloc(sizeof(float) * 16 * groups4 * nt);                                                         \
        int64_t *iv = malloc(sizeof(int64_t) * 16 * groups4 * nt);                                                     \
        uint16_t *nanv = malloc(sizeof(uint16_t) * groups4 * nt);                                                      \
        _Pragma("omp parallel for schedule(static) num_threads(nt)") /* one row range per t, whatever the team */      \
        for (int t = 0; t < nt; t++) {                                                                                 \
            const int64_t r0 = rows * t / nt, r1 = rows * (t + 1) / nt;                                                \
            for (int64_t g0 = 0; g0 < groups; g0 += 4) {                                                               \
                __mmask16 m[4];                                                                                        \
                for (int g = 0; g < 4; g++) {                                                                          \
                    const int64_t n = cols - 16 * (g0 + g);                                                            \
                    m[g] = n >= 16 ? (__mmask16)0xffff : n > 0 ? (__mmask16)((1u << n) - 1) : 0;                       \
                }                                                                                                      \
                const int64_t o = t * groups4 + g0;                                                                    \
                RANGE(x, ld, r0, r1, 16 * g0, m, mv + 16 * o, iv + 16 * o, nanv + o);                                  \
            }                                                                                                          \
        }                                                                                                              \
        for (int64_t c = 0; c < cols; c++) { /* merge the ranges in row order */                                       \
            const int64_t gi = c / 16, l = c % 16;                                                                     \
            float bv = mv[16 * gi + l];                                                                                \
            int64_t bi = iv[16 * gi + l];                                                                              \
            int bn = (nanv[gi] >> l) & 1;                                                                              \
            for (int t = 1; t < nt; t++) {                                                                             \
                const int64_t o = t * groups4 + gi;                                                                    \
                const int n = (nanv[o] >> l) & 1;                                                                      \
                if (beats(mv[16 * o + l], iv[16 * o + l], n, bv, bi, bn))                                              \
                    bv = mv[16 * o + l], bi = iv[16 * o + l], bn = n;                                                  \
            }                                                                                                          \
            idx[c] = bi;                                                                                               \
        }                                                                                                              \
        free(mv);                                                                                                      \
        free(iv);                                                                                                      \
        free(nanv);                                                                                                    \
    }

ROW_ARGMAX(tpe_row_argmax_f32, float, ld_f32)
ROW_ARGMAX(tpe_row_argmax_bf16, uint16_t, ld_bf16)
COL_RANGE(col_range_f32, float, ld_f32)
COL_RANGE(col_range_bf16, uint16_t, ld_bf16)
COL_ARGMAX(tpe_col_argmax_f32, col_range_f32, float)
COL_ARGMAX(tpe_col_argmax_bf16, col_range_bf16, uint16_t)

#else
/* Every other build: portable C for the column argmax, which keeps one running maximum per column over
 * the rows in order (a loop the compiler vectorizes), the columns split between the threads; the row
 * argmax in 8-lane vectors on AVX2 (below), else portable C, one element at a time in the same order
 * (the first NaN, else the first maximum). */
static inline float ld_f32(const float *p) { return *p; }
static inline float ld_bf16(const uint16_t *p) { return bf2f(*p); }

#ifdef TPE_AVX2
#include <immintrin.h>

static inline __m256 ld8_f32(const float *p) { return _mm256_loadu_ps(p); }

/* One lane state step, as take() above with 8 lanes and every lane read: take x where it is larger
 * than the running maximum or is the lane's first NaN (never after a NaN: the first NaN stays). */
static inline void take8(__m256 x, __m256i at, __m256 *mx, __m256i *ix, __m256 *nan) {
    const __m256 isnan = _mm256_andnot_ps(*nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256 up = _mm256_or_ps(_mm256_andnot_ps(*nan, _mm256_cmp_ps(x, *mx, _CMP_GT_OQ)), isnan);
    *mx = _mm256_blendv_ps(*mx, x, up);
    *ix = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(*ix), _mm256_castsi256_ps(at), up));
    *nan = _mm256_or_ps(*nan, isnan);
}

/* Each row's first 32 * (cols / 32) columns in four interleaved lane sets (columns c + 8 k of every
 * 32, k < 4: four independent chains of compares, each lane starting at its first column), reduced
 * with beats(); then the last cols % 32 columns one at a time (later than every lane's: they win on
 * a larger value or the first NaN only). */
#define ROW_ARGMAX(NAME, T, LD, LD8)                                                                                   \
    void NAME(const T *x, int64_t rows, int64_t cols, int64_t ld, int64_t *idx, int nthreads) {                        \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (rows > 1 && rows * cols >= 65536)")       \
        for (int64_t r = 0; r < rows; r++) {                                                                           \
            const T *p = x + r * ld;                                                                                   \
            const int64_t vec = cols / 32 * 32;                                                                        \
            float best = LD(p);                                                                                        \
            int64_t at = 0, c = 1;                                                                                     \
            int bnan = best != best;                                                                                   \
            if (vec) {                                                                                                 \
                const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);                                        \
                __m256 mx[4], nan[4];                                                                                  \
                __m256i ix[4];                                                                                         \
                for (int k = 0; k < 4; k++) {                                                                          \
                    mx[k] = LD8(p + 8 * k);                                                                            \
                    ix[k] = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * k));                                          \
                    nan[k] = _mm256_cmp_ps(mx[k], mx[k], _CMP_UNORD_Q);                                                \
                }                                                                                                      \
                for (c = 32; c < vec; c += 32)                                                                         \
                    for (int k = 0; k < 4; k++)                                                                        \
                        take8(LD8(p + c + 8 * k), _mm256_add_epi32(lane, _mm256_set1_epi32((int)(c + 8 * k))), &mx[k], \
                              &ix[k], &nan[k]);                                                                        \
                float mv[32];                                                                                          \
                int32_t iv[32];                                                                                        \
                int nv = 0; /* bit l: lane l has seen a NaN */                                                         \
                for (int k = 0; k < 4; k++) {                                                                          \
                    _mm256_storeu_ps(mv + 8 * k, mx[k]);                                                               \
                    _mm256_storeu_si256((__m256i *)(iv + 8 * k), ix[k]);                                               \
                    nv |= _mm256_movemask_ps(nan[k]) << (8 * k);                                                       \
                }                                                                                                      \
                int b = 0;                                                                                             \
                for (int l = 1; l < 32; l++)                                                                           \
                    if (beats(mv[l], iv[l], (nv >> l) & 1, mv[b], iv[b], (nv >> b) & 1)) b = l;                        \
                best = mv[b], at = iv[b], bnan = (nv >> b) & 1;                                                        \
            }                                                                                                          \
            for (; c < cols && !bnan; c++) {                                                                           \
                const float v = LD(p + c);                                                                             \
                if (v != v) at = c, bnan = 1;                                                                          \
                else if (v > best) best = v, at = c;                                                                   \
            }                                                                                                          \
            idx[r] = at;                                                                                               \
        }                                                                                                              \
    }

ROW_ARGMAX(tpe_row_argmax_f32, float, ld_f32, ld8_f32)
ROW_ARGMAX(tpe_row_argmax_bf16, uint16_t, ld_bf16, ld8)
#else
#define ROW_ARGMAX(NAME, T, LD)                                                                                        \
    void NAME(const T *x, int64_t rows, int64_t cols, int64_t ld, int64_t *idx, int nthreads) {                        \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (rows > 1 && rows * cols >= 65536)")       \
        for (int64_t r = 0; r < rows; r++) {                                                                           \
            const T *p = x + r * ld;                                                                                   \
            float best = LD(p);                                                                                        \
            int64_t at = 0;                                                                                            \
            if (best == best)                                                                                          \
                for (int64_t c = 1; c < cols; c++) {                                                                   \
                    const float v = LD(p + c);                                                                         \
                    if (v != v) { at = c; break; }                                                                     \
                    if (v > best) best = v, at = c;                                                                    \
                }                                                                                                      \
            idx[r] = at;                                                                                               \
        }                                                                                                              \
    }

ROW_ARGMAX(tpe_row_argmax_f32, float, ld_f32)
ROW_ARGMAX(tpe_row_argmax_bf16, uint16_t, ld_bf16)
#endif

#define COL_BLOCK 256 /* columns per block: its running maxima stay in L1 */
#define COL_ARGMAX(NAME, T, LD)                                                                                        \
    void NAME(const T *x, int64_t rows, int64_t cols, int64_t ld, int64_t *idx, int nthreads) {                        \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (rows * cols >= 65536)")                   \
        for (int64_t c0 = 0; c0 < cols; c0 += COL_BLOCK) {                                                             \
            const int64_t nc = cols - c0 < COL_BLOCK ? cols - c0 : COL_BLOCK;                                          \
            float mx[COL_BLOCK];                                                                                       \
            int64_t ix[COL_BLOCK];                                                                                     \
            unsigned char nan[COL_BLOCK];                                                                              \
            for (int64_t c = 0; c < nc; c++) {                                                                         \
                mx[c] = LD(x + c0 + c), ix[c] = 0;                                                                     \
                nan[c] = mx[c] != mx[c];                                                                               \
            }                                                                                                          \
            for (int64_t r = 1; r < rows; r++)                                                                         \
                for (int64_t c = 0; c < nc; c++) {                                                                     \
                    const float v = LD(x + r * ld + c0 + c);                                                           \
                    const int up = !nan[c] && (v > mx[c] || v != v);                                                   \
                    nan[c] |= v != v;                                                                                  \
                    mx[c] = up ? v : mx[c];                                                                            \
                    ix[c] = up ? r : ix[c];                                                                            \
                }                                                                                                      \
            for (int64_t c = 0; c < nc; c++) idx[c0 + c] = ix[c];                                                      \
        }                                                                                                              \
    }

COL_ARGMAX(tpe_col_argmax_f32, float, ld_f32)
COL_ARGMAX(tpe_col_argmax_bf16, uint16_t, ld_bf16)
#endif
