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
 * bad b (a slot), B + b (a length beyond the block table) or 2B + b (a block id out of range). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

static int64_t check(const int64_t *slots, const int64_t *block_tables, int64_t max_blocks, const int64_t *lens,
                     int64_t B, int64_t num_blocks, int64_t bs) {
    for (int64_t b = 0; b < B; b++)
        if (slots[b] < -1 || slots[b] >= num_blocks * bs) return b;
    for (int64_t b = 0; b < B; b++)
        if (lens[b] < 0 || lens[b] > max_blocks * bs) return B + b;
    for (int64_t b = 0; b < B; b++)
        for (int64_t j = 0; j * bs < lens[b]; j++)
            if ((uint64_t)block_tables[b * max_blocks + j] >= (uint64_t)num_blocks) return 2 * B + b;
    return -1;
}

/* One dtype's kernel. LD(p): 16 elements -> __m512; ST(p, x): store 16 rounded; RND(x): x rounded
 * to the dtype, back as float32; T: the element type. */
#define PAGED_DECODE(NAME, T, LD, ST, RND)                                                                         \
    int64_t NAME(T *q, int64_t q_stride, T *k, int64_t k_stride, const T *v, int64_t v_stride, const T *cos_t,     \
                 const T *sin_t, const int64_t *slots, const int64_t *block_tables, int64_t max_blocks,             \
                 const int64_t *lens, T *k_cache, T *v_cache, int64_t num_blocks, int64_t bs,                       \
                 const int64_t *q_to_kv, int64_t hq, int64_t hkv, int64_t d, float scale, T *out, int64_t B,        \
                 int nthreads) {                                                                                    \
        int64_t bad = check(slots, block_tables, max_blocks, lens, B, num_blocks, bs);                             \
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
        for (int64_t b = 0; b < B; b++) work += lens[b];                                                            \
        _Pragma("omp parallel num_threads(nthreads) if (work * hq * d >= 32768)") {                               \
            float *sc = NULL;                                                                                       \
            int64_t cap = 0;                                                                                        \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t bh = 0; bh < B * hq; bh++) {                    \
                const int64_t b = bh / hq, h = bh % hq, L = lens[b], kv = q_to_kv[h];                               \
                T *o = out + bh * d;                                                                                \
                if (L == 0) {                                                                                       \
                    memset(o, 0, (size_t)d * sizeof(T));                                                            \
                    continue;                                                                                       \
                }                                                                                                   \
                if (L > cap) {                                                                                      \
                    free(sc);                                                                                       \
                    cap = L + 64;                                                                                   \
                    sc = (float *)malloc((size_t)cap * sizeof(float));                                              \
                }                                                                                                   \
                const T *qh = q + b * q_stride + h * d;                                                             \
                const int64_t *bt = block_tables + b * max_blocks;                                                  \
                __m512 qv[16];                                                                                      \
                for (int64_t i = 0; i < d; i += 16) qv[i / 16] = LD(qh + i);                                        \
                float mx = -INFINITY;                                                                               \
                for (int64_t t = 0; t < L; t++) {                                                                   \
                    const T *kt = k_cache + (bt[t / bs] * bs + t % bs) * row + kv * d;                              \
                    __m512 acc = _mm512_mul_ps(qv[0], LD(kt));                                                      \
                    for (int64_t i = 16; i < d; i += 16) acc = _mm512_fmadd_ps(qv[i / 16], LD(kt + i), acc);        \
                    float s = _mm512_reduce_add_ps(acc);                                                            \
                    s = _mm512_cvtss_f32(RND(_mm512_set1_ps(s))) * scale;                                          \
                    sc[t] = s;                                                                                      \
                    mx = s > mx ? s : mx;                                                                           \
                }                                                                                                   \
                __m512 sum = _mm512_setzero_ps();                                                                   \
                const __m512 vmax = _mm512_set1_ps(mx);                                                             \
                int64_t t = 0;                                                                                      \
                for (; t + 16 <= L; t += 16) {                                                                      \
                    __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + t), vmax));                                 \
                    _mm512_storeu_ps(sc + t, e);                                                                    \
                    sum = _mm512_add_ps(sum, e);                                                                    \
                }                                                                                                   \
                if (t < L) {                                                                                        \
                    const __mmask16 m = (__mmask16)((1u << (L - t)) - 1);                                           \
                    __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + t), vmax))); \
                    _mm512_mask_storeu_ps(sc + t, m, e);                                                            \
                    sum = _mm512_add_ps(sum, e);                                                                    \
                }                                                                                                   \
                const float inv = 1.f / _mm512_reduce_add_ps(sum);                                                  \
                __m512 acc[16];                                                                                     \
                for (int64_t i = 0; i < d; i += 16) acc[i / 16] = _mm512_setzero_ps();                              \
                for (int64_t u = 0; u < L; u++) {                                                                   \
                    const __m512 p = RND(_mm512_set1_ps(sc[u] * inv));                                              \
                    const T *vt = v_cache + (bt[u / bs] * bs + u % bs) * row + kv * d;                              \
                    for (int64_t i = 0; i < d; i += 16) acc[i / 16] = _mm512_fmadd_ps(p, LD(vt + i), acc[i / 16]); \
                }                                                                                                   \
                for (int64_t i = 0; i < d; i += 16) ST(o + i, acc[i / 16]);                                         \
            }                                                                                                       \
            free(sc);                                                                                               \
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
