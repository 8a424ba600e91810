/* Paged decode attention on CPU in one call per layer: RoPE on the step's new query and key heads,
 * the new keys and values written into the paged KV cache at their slots, and attention of each
 * query head over its sequence's cached keys read through the block table -- what
 * tpengine.kernels.reference computes for a decode step (store_kvcache, then decode_attention),
 * for float32 (tpe_paged_decode_f32) and bfloat16 (tpe_paged_decode_bf16). The CPU twin of the
 * Triton paged kernel: no gather of the context into a contiguous copy, no per-op dispatch.
 *
 * Arithmetic, op by op as the torch path rounds it:
 *   rope (HF's formula):  f32: q*cos + rotate_half(q)*sin, each product and the sum rounded to
 *                          float32 (no fused multiply-add); bf16: each rounded to bfloat16.
 *   scores:                f32: dot(q, k) * scale; bf16: bf16(dot(q, k)) * scale in float32.
 *   softmax (float32):     exp(s - max) / sum, with a Cephes-style exp (bf16.h's exp16).
 *   output:                sum_t p[t] * v[t] in float32 (bf16: p rounded to bfloat16 first), then
 *                          rounded to the dtype.
 * The float32 sums run in a different order than SDPA's, so results equal the torch path up to
 * float32 rounding.
 *
 * Layout (elements, not bytes): q [B, Hq, D] at q + b * q_stride; k, v [B, Hkv, D] at
 * k + b * k_stride, v + b * v_stride; cos, sin [B, D] (NULL: no RoPE); slots [B] (-1: not stored);
 * block_tables [B, max_blocks]; lens [B] (keys visible to the sequence, its new one included; 0
 * for a padding row, whose output is zero); caches [num_blocks, bs, Hkv, D]; q_to_kv [Hq];
 * out [B, Hq, D] contiguous. Needs D % 32 == 0 (RoPE rotates halves of whole 16-lane vectors).
 * Every slot, length and block id is checked before anything is written: returns -1, or the first
 * bad b (a slot), B + b (a length beyond the block table), 2B + b (a block id out of range) or 3B
 * (q_to_kv naming a KV head out of range, or more than MAX_G query heads on one KV head). Each KV
 * head's query heads are attended together, so every key and value row is read from memory once
 * per step: the scores of 16 keys at a time (reduced together, sum16), the block table walked
 * without divisions, the next rows prefetched (a sequence's rows sit in blocks anywhere in the
 * cache); with many sequences (B >= 4 threads) a work item is one sequence, its rows read whole
 * (every KV head), else one (sequence, KV head). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MAX_G 16 /* query heads per KV head (the caller checks) */
#define MAX_D 256

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

static int64_t check(const int64_t *slots, const int64_t *block_tables, int64_t max_blocks, const int64_t *lens,
                     int64_t B, int64_t num_blocks, int64_t bs, const int64_t *q_to_kv, int64_t hq, int64_t hkv) {
    for (int64_t kv = 0; kv < hkv; kv++) {
        int64_t g = 0;
        for (int64_t h = 0; h < hq; h++) g += q_to_kv[h] == kv;
        if (g > MAX_G) return 3 * B;
    }
    for (int64_t h = 0; h < hq; h++)
        if ((uint64_t)q_to_kv[h] >= (uint64_t)hkv) return 3 * B;
    for (int64_t b = 0; b < B; b++)
        if (slots[b] < -1 || slots[b] >= num_blocks * bs) return b;
    for (int64_t b = 0; b < B; b++)
        if (lens[b] < 0 || lens[b] > max_blocks * bs) return B + b;
    for (int64_t b = 0; b < B; b++)
        for (int64_t j = 0; j * bs < lens[b]; j++)
            if ((uint64_t)block_tables[b * max_blocks + j] >= (uint64_t)num_blocks) return 2 * B + b;
    return -1;
}

/* Prefetch the cache lines of one row of n bytes: the K/V rows of a sequence sit in blocks anywhere
 * in the cache, at a stride of all KV heads, which the hardware prefetcher does not follow. */
static inline void prefetch_row(const void *p, int64_t n) {
    for (int64_t o = 0; o < n; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T1);
}
#define VAHEAD 16 /* value rows prefetched ahead: one group of keys' worth, as for the keys */

/* The 16 horizontal sums of a[0..15], lane l = sum of a[l]'s 16 lanes: a transpose-and-add tree
 * (pairs of floats, pairs of pairs, then 128-bit quarters), 15 adds instead of 16 full reductions. */
static inline __m512 sum16(const __m512 *a) {
    __m512 w[8], x[4], y[2];
    for (int k = 0; k < 8; k++)
        w[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
    for (int k = 0; k < 4; k++)
        x[k] = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(w[2 * k]), _mm512_castps_pd(w[2 * k + 1]))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(w[2 * k]), _mm512_castps_pd(w[2 * k + 1]))));
    for (int k = 0; k < 2; k++)
        y[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xdd));
}

/* sum_u p[j][u] * v[u] for each of the g query heads (NV 16-lane vectors of the head), p[j] = sc + j * L,
 * v[u] = vptr[u]: PJ heads at a time, so each value row is loaded (and widened) once for all of them;
 * each head's sum still runs over u in order, the same float32 operations as one head at a time. The
 * first pass prefetches the value rows VAHEAD ahead. */
#define PV_HEADS(T, LD, ST, NV, PJ)                                                                              \
    for (int64_t j0 = 0; j0 < g; j0 += (PJ)) {                                                                 \
        const int64_t nj = g - j0 < (PJ) ? g - j0 : (PJ);                                                      \
        __m512 a[PJ][MAX_D / 16];                                                                              \
        for (int64_t jj = 0; jj < (PJ); jj++)                                                                  \
            for (int64_t i = 0; i < (NV); i++) a[jj][i] = _mm512_setzero_ps();                                 \
        for (int64_t u = 0; u < L; u++) {                                                                      \
            if (j0 == 0 && u + VAHEAD < L) prefetch_row(vptr[u + VAHEAD], pfn);                               \
            const T *vt = vptr[u];                                                                             \
            __m512 vv[MAX_D / 16];                                                                             \
            for (int64_t i = 0; i < (NV); i++) vv[i] = LD(vt + i * 16);                                        \
            for (int64_t jj = 0; jj < (PJ); jj++) {                                                            \
                if (jj >= nj) break;                                                                           \
                const __m512 pu = _mm512_set1_ps(sc[(j0 + jj) * L + u]);                                       \
                for (int64_t i = 0; i < (NV); i++) a[jj][i] = _mm512_fmadd_ps(pu, vv[i], a[jj][i]);            \
            }                                                                                                  \
        }                                                                                                      \
        for (int64_t jj = 0; jj < nj; jj++)                                                                    \
            for (int64_t i = 0; i < (NV); i++) ST(out + (b * hq + heads[j0 + jj]) * d + i * 16, a[jj][i]);     \
    }

/* One dtype's kernel. LD(p): 16 elements -> __m512; ST(p, x): store 16 rounded; RND(x): x rounded
 * to the dtype, back as float32; T: the element type. */
#define PAGED_DECODE(NAME, T, LD, ST, RND)                                                                         \
    int64_t NAME(T *q, int64_t q_stride, T *k, int64_t k_stride, const T *v, int64_t v_stride, const T *cos_t,     \
                 const T *sin_t, const int64_t *slots, const int64_t *block_tables, int64_t max_blocks,             \
                 const int64_t *lens, T *k_cache, T *v_cache, int64_t num_blocks, int64_t bs,                       \
                 const int64_t *q_to_kv, int64_t hq, int64_t hkv, int64_t d, float scale, T *out, int64_t B,        \
                 int nthreads) {                                                                                    \
        int64_t bad = check(slots, block_tables, max_blocks, lens, B, num_blocks, bs, q_to_kv, hq, hkv);                             \
        if (bad >= 0) return bad;                                                                                   \
        const int64_t half = d / 2, row = hkv * d;                                                                  \
        const __m512 neg = _mm512_set1_ps(-0.f);                                                                    \
        for (int64_t b = 0; b < B; b++) {                                                                          \
            if (cos_t) { /* RoPE in place on the query heads, then the key heads */                              \
                const T *c = cos_t + b * d, *s = sin_t + b * d;                                                     \
                for (int64_t h = 0; h < hq + hkv; h++) {                                                            \
                    T *x = h < hq ? q + b * q_stride + h * d : k + b * k_stride + (h - hq) * d;                     \
                    for (int64_t i = 0; i < half; i += 16) {                                                        \
                        __m512 x1 = LD(x + i), x2 = LD(x + half + i);                                               \
                        __m512 lo = _mm512_add_ps(RND(_mm512_mul_ps(x1, LD(c + i))),                                \
                                                  RND(_mm512_mul_ps(_mm512_xor_ps(x2, neg), LD(s + i))));           \
                        __m512 hi = _mm512_add_ps(RND(_mm512_mul_ps(x2, LD(c + half + i))),                         \
                                                  RND(_mm512_mul_ps(x1, LD(s + half + i))));                        \
                        ST(x + i, lo);                                                                              \
                        ST(x + half + i, hi);                                                                       \
                    }                                                                                               \
                }                                                                                                   \
            }                                                                                                       \
            if (slots[b] >= 0) {                                                                                    \
                memcpy(k_cache + slots[b] * row, k + b * k_stride, (size_t)row * sizeof(T));                       \
                memcpy(v_cache + slots[b] * row, v + b * v_stride, (size_t)row * sizeof(T));                       \
            }                                                                                                       \
        }                                                                                                           \
        int64_t work = 0;                                                                                           \
        /* many sequences: one item per sequence (its K/V rows read whole, every head); few: per (b, KV head) */    \
        const int whole = B >= 4 * nthreads;                                                                        \
        const int64_t items = whole ? B : B * hkv;                                                                  \
        for (int64_t b = 0; b < B; b++) work += lens[b];                                                            \
        _Pragma("omp parallel num_threads(nthreads) if (work * hq * d >= 32768)") {                               \
            float *sc = NULL;                                                                                       \
            const T **vptr = NULL;                                                                                  \
            int64_t cap = 0;                                                                                        \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t it = 0; it < items; it++) {                        \
              const int64_t b = whole ? it : it / hkv, kv0 = whole ? 0 : it % hkv;                                  \
              for (int64_t kv = kv0; kv < (whole ? hkv : kv0 + 1); kv++) {                                          \
                const int64_t L = lens[b];                                                                          \
                /* whole rows (every KV head) are fetched with the first head: contiguous in a block */             \
                const int64_t pfn = (whole && kv == 0 ? row : d) * (int64_t)sizeof(T);                              \
                int64_t heads[MAX_G], g = 0;                                                                        \
                for (int64_t h = 0; h < hq && g < MAX_G; h++)                                                       \
                    if (q_to_kv[h] == kv) heads[g++] = h;                                                           \
                if (g == 0) continue;                                                                               \
                if (L == 0) {                                                                                       \
                    for (int64_t j = 0; j < g; j++) memset(out + (b * hq + heads[j]) * d, 0, (size_t)d * sizeof(T)); \
                    continue;                                                                                       \
                }                                                                                                   \
                if (L * g > cap) {                                                                                  \
                    free(sc);                                                                                       \
                    cap = L * g + 64;                                                                               \
                    sc = (float *)malloc((size_t)cap * sizeof(float));                                              \
                    free(vptr);                                                                                     \
                    vptr = (const T **)malloc((size_t)cap * sizeof(*vptr));                                         \
                }                                                                                                   \
                const int64_t *bt = block_tables + b * max_blocks;                                                  \
                const int64_t nv = d / 16;                                                                          \
                __m512 qv[MAX_G][MAX_D / 16];                                                                       \
                float mx[MAX_G];                                                                                    \
                for (int64_t j = 0; j < g; j++) {                                                                   \
                    for (int64_t i = 0; i < nv; i++) qv[j][i] = LD(q + b * q_stride + heads[j] * d + i * 16);       \
                    mx[j] = -INFINITY;                                                                              \
                }                                                                                                   \
                const __m512 vscale = _mm512_set1_ps(scale);                                                \
                __m512 mxv[MAX_G];                                                                          \
                for (int64_t j = 0; j < g; j++) mxv[j] = _mm512_set1_ps(-INFINITY);                        \
                int64_t kb = 0, ko = 0; /* the next key's block-table index and offset in its block */      \
                int64_t pt = 0, pb = 0, po = 0; /* the prefetch cursor, 16 keys ahead after the first group */ \
                for (; pt < 16 && pt < L; pt++) {                                                           \
                    prefetch_row(k_cache + (bt[pb] * bs + po) * row + kv * d, pfn);      \
                    if (++po == bs) po = 0, pb++;                                                           \
                }                                                                                           \
                for (int64_t t0 = 0; t0 < L; t0 += 16) { /* 16 keys at a time, each read from memory once */ \
                    const int64_t nk = L - t0 < 16 ? L - t0 : 16;                                           \
                    const __mmask16 m = nk == 16 ? (__mmask16)0xffff : (__mmask16)((1u << nk) - 1);        \
                    const T *kp[16];                                                                        \
                    for (int64_t kk = 0; kk < nk; kk++) { /* no division: walk (block, offset) */           \
                        kp[kk] = k_cache + (bt[kb] * bs + ko) * row + kv * d;                               \
                        if (++ko == bs) ko = 0, kb++;                                                       \
                    }                                                                                       \
                    for (int64_t kk = 0; kk < 16 && pt < L; kk++, pt++) { /* the next 16 keys: prefetch */  \
                        prefetch_row(k_cache + (bt[pb] * bs + po) * row + kv * d, pfn);  \
                        if (++po == bs) po = 0, pb++;                                                       \
                    }                                                                                       \
                    for (int64_t kk = nk; kk < 16; kk++) kp[kk] = kp[0];                                    \
                    __m512 a[MAX_G][16];                                                                            \
                    for (int64_t kk = 0; kk < 16; kk++) { /* each key row loaded (and widened) once */              \
                        __m512 kr[MAX_D / 16];                                                                      \
                        for (int64_t i = 0; i < nv; i++) kr[i] = LD(kp[kk] + i * 16);                               \
                        for (int64_t j = 0; j < g; j++) {                                                           \
                            __m512 acc = _mm512_mul_ps(qv[j][0], kr[0]);                                            \
                            for (int64_t i = 1; i < nv; i++) acc = _mm512_fmadd_ps(qv[j][i], kr[i], acc);           \
                            a[j][kk] = acc;                                                                         \
                        }                                                                                           \
                    }                                                                                               \
                    for (int64_t j = 0; j < g; j++) {                                                               \
                        const __m512 sv = _mm512_mul_ps(RND(sum16(a[j])), vscale);                                  \
                        _mm512_mask_storeu_ps(sc + j * L + t0, m, sv);                                              \
                        mxv[j] = _mm512_mask_max_ps(mxv[j], m, mxv[j], sv);                                         \
                    }                                                                                               \
                }                                                                                                   \
                for (int64_t j = 0; j < g; j++) mx[j] = _mm512_reduce_max_ps(mxv[j]);                       \
                for (int64_t j = 0; j < g; j++) { /* softmax, then p rounded as the dtype rounds it */             \
                    float *sj = sc + j * L;                                                                         \
                    __m512 sum = _mm512_setzero_ps();                                                               \
                    const __m512 vmax = _mm512_set1_ps(mx[j]);                                                      \
                    int64_t t = 0;                                                                                  \
                    for (; t + 16 <= L; t += 16) {                                                                  \
                        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sj + t), vmax));                             \
                        _mm512_storeu_ps(sj + t, e);                                                                \
                        sum = _mm512_add_ps(sum, e);                                                                \
                    }                                                                                               \
                    if (t < L) {                                                                                    \
                        const __mmask16 m = (__mmask16)((1u << (L - t)) - 1);                                       \
                        __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sj + t), vmax))); \
                        _mm512_mask_storeu_ps(sj + t, m, e);                                                        \
                        sum = _mm512_add_ps(sum, e);                                                                \
                    }                                                                                               \
                    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));                             \
                    for (t = 0; t + 16 <= L; t += 16)                                                               \
                        _mm512_storeu_ps(sj + t, RND(_mm512_mul_ps(_mm512_loadu_ps(sj + t), inv)));                 \
                    for (; t < L; t++) sj[t] = _mm512_cvtss_f32(RND(_mm512_set1_ps(sj[t] * _mm512_cvtss_f32(inv)))); \
                }                                                                                                   \
                for (int64_t u = 0, vb = 0, vo = 0; u < L; u++) { /* the value rows, walked once */                 \
                    vptr[u] = v_cache + (bt[vb] * bs + vo) * row + kv * d;                                          \
                    if (++vo == bs) vo = 0, vb++;                                                                   \
                }                                                                                                   \
                for (int64_t u = 0; u < VAHEAD && u < L; u++) prefetch_row(vptr[u], pfn);        \
                switch (nv) { /* the head size as a constant: the accumulators stay in registers */                 \
                case 2: PV_HEADS(T, LD, ST, 2, 4) break;                                                               \
                case 4: PV_HEADS(T, LD, ST, 4, 4) break;                                                               \
                case 8: PV_HEADS(T, LD, ST, 8, 2) break;                                                               \
                case 16: PV_HEADS(T, LD, ST, 16, 1) break;                                                             \
                default: PV_HEADS(T, LD, ST, nv, 1) break;                                                             \
                }                                                                                                   \
              }                                                                                                     \
            }                                                                                                       \
            free(sc);                                                                                               \
            free(vptr);                                                                                             \
        }                                                                                                           \
        return -1;                                                                                                  \
    }

static inline __m512 ld32(const float *p) { return _mm512_loadu_ps(p); }
static inline void st32(float *p, __m512 x) { _mm512_storeu_ps(p, x); }
/* float32 "rounding": none, but an opaque barrier, so the compiler cannot contract a product and
 * the sum after it into one fused multiply-add (torch rounds the product first). */
static inline __m512 keep32(__m512 x) {
    __asm__("" : "+v"(x));
    return x;
}

PAGED_DECODE(tpe_paged_decode_f32, float, ld32, st32, keep32)
PAGED_DECODE(tpe_paged_decode_bf16, uint16_t, ld, st, rb)

#else /* never called: tpe_fast() == 0 marks the library unavailable */
int64_t tpe_paged_decode_f32(void) { return -1; }
int64_t tpe_paged_decode_bf16(void) { return -1; }
#endif
