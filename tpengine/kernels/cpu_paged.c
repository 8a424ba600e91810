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
 * head's query heads are attended together, so every key and value row is read once per step. */
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
        for (int64_t b = 0; b < B; b++) work += lens[b];                                                            \
        _Pragma("omp parallel num_threads(nthreads) if (work * hq * d >= 32768)") {                               \
            float *sc = NULL;                                                                                       \
            int64_t cap = 0;                                                                                        \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t bk = 0; bk < B * hkv; bk++) {                   \
                const int64_t b = bk / hkv, kv = bk % hkv, L = lens[b];                                             \
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
                }                                                                                                   \
                const int64_t *bt = block_tables + b * max_blocks;                                                  \
                const int64_t nv = d / 16;                                                                          \
                __m512 qv[MAX_G][MAX_D / 16];                                                                       \
                float mx[MAX_G];                                                                                    \
                for (int64_t j = 0; j < g; j++) {                                                                   \
                    for (int64_t i = 0; i < nv; i++) qv[j][i] = LD(q + b * q_stride + heads[j] * d + i * 16);       \
                    mx[j] = -INFINITY;                                                                              \
                }                                                                                                   \
                for (int64_t t = 0; t < L; t++) { /* each key row read once for the g query heads */               \
                    const T *kt = k_cache + (bt[t / bs] * bs + t % bs) * row + kv * d;                              \
                    for (int64_t j = 0; j < g; j++) {                                                               \
                        __m512 acc = _mm512_mul_ps(qv[j][0], LD(kt));                                               \
                        for (int64_t i = 1; i < nv; i++) acc = _mm512_fmadd_ps(qv[j][i], LD(kt + i * 16), acc);     \
                        const float s = _mm512_cvtss_f32(RND(_mm512_set1_ps(_mm512_reduce_add_ps(acc)))) * scale;   \
                        sc[j * L + t] = s;                                                                          \
                        mx[j] = s > mx[j] ? s : mx[j];                                                              \
                    }                                                                                               \
                }                                                                                                   \
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
                __m512 acc[MAX_G][MAX_D / 16];                                                                      \
                for (int64_t j = 0; j < g; j++)                                                                     \
                    for (int64_t i = 0; i < nv; i++) acc[j][i] = _mm512_setzero_ps();                               \
                for (int64_t u = 0; u < L; u++) { /* each value row read once */                                   \
                    const T *vt = v_cache + (bt[u / bs] * bs + u % bs) * row + kv * d;                              \
                    for (int64_t i = 0; i < nv; i++) {                                                              \
                        const __m512 vv = LD(vt + i * 16);                                                          \
                        for (int64_t j = 0; j < g; j++)                                                             \
                            acc[j][i] = _mm512_fmadd_ps(_mm512_set1_ps(sc[j * L + u]), vv, acc[j][i]);              \
                    }                                                                                               \
                }                                                                                                   \
                for (int64_t j = 0; j < g; j++)                                                                     \
                    for (int64_t i = 0; i < nv; i++) ST(out + (b * hq + heads[j]) * d + i * 16, acc[j][i]);         \
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
