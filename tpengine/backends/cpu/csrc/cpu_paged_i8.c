/* Paged decode attention over an int8 KV cache (kv_cache_dtype "int8", tpengine/backends/kv_quant.py), in one
 * call per layer as cpu_paged.c does for float32 / bfloat16 caches: RoPE on the step's new query and key heads,
 * the new keys and values quantized into the cache at their slots (codes and a float32 scale per token and KV
 * head), and attention of each query head over its sequence's cached keys read through the block table.
 * tpe_paged_decode_i8_f32 takes float32 queries / keys / values and output, tpe_paged_decode_i8_bf16 bfloat16.
 *
 * The softmax and the stores are written over bf16.h's 16-lane `vf` layer; the scores and P.V run in integers,
 * per ISA (AVX-512 VNNI: vpdpbusd / vpdpwssd; AVX2 (TPENGINE_ISA=avx2): maddubs / madd) with the same exact
 * integer sums, so both builds give the same results.
 *
 * Arithmetic (the int8 x int8 dot of llama.cpp's q8_0 for the scores, here over per-row scales):
 *   rope:     as cpu_paged.c (bf16.h's rope_head_*), in the input dtype.
 *   store:    per (token, KV head) row x of d elements, in float32: amax = max |x|, codes = clamp(
 *             nearbyint(x * (127 / amax)), -127, 127) (round half to even), scale = amax / 127; an all-zero row
 *             gets zero codes and scale 0 -- kv_quant.quantize's operations, so the codes are the torch path's.
 *   query:    each query head quantized the same way (codes qc, scale q_scale), once per step.
 *   scores:   s = float(dot(qc, codes_k)) * (k_scale * (q_scale * scale)) in float32, the dot an exact int32
 *             sum; soft cap as cap_scores.
 *   softmax:  e = exp(s - max) in float32 (vf_exp); the weights w = e * v_scale rounded to 15 bits, wq =
 *             nearbyint(w * (32767 / max w)).
 *   output:   sum_t wq[t] * codes_v[t] exact in int32 per 512 keys, those sums added in float32, times
 *             max w / 32767 / sum e, rounded to the dtype once.
 * So the result is attention over the dequantized rows (codes * scale) with the query rounded to int8 and the
 * weights to 15 bits: tests compare it with a torch reference of this arithmetic (tests/test_kv_int8.py).
 *
 * Layout (elements): q [B, Hq, D] at q + b * q_stride; k, v [B, Hkv, D] at k + b * k_stride, v + b * v_stride;
 * cos, sin [B, D] (NULL: no RoPE); slots [B] (-1: not stored); block_tables [B, max_blocks]; lens [B] (keys
 * visible, the new one included; 0: a padding row, output zero); k_cache, v_cache [num_blocks, bs, Hkv, D] int8;
 * k_scale, v_scale [num_blocks, bs, Hkv] float32; q_to_kv [Hq]; out [B, Hq, D] contiguous; window: sliding window
 * (0: none; only its blocks are read and checked); softcap (0: none). D % 32 == 0, D <= 256, at most 16 query heads
 * on one KV head. Every slot, length and block id is checked before anything is written: returns -1, or the first
 * bad b (a slot), B + b (a length), 2B + b (a block id) or 3B (q_to_kv) -- cpu_paged.c's codes. One work item per
 * (sequence, KV head), dynamic schedule; each key and value row is read from memory once per step for all the
 * KV head's query heads, the rows AHEAD keys on prefetched while the current 16 are scored, the scales SAHEAD
 * blocks on while the block table is walked. Where the items would leave threads idle (fewer than 2 x threads and
 * not a multiple of them, e.g. 3 KV heads on 2 threads at batch 1) each is split into spans of >= SPLIT_MIN keys
 * whose softmax partials (max, sum, P.V sums) are merged after, as flash-decoding's split-K does: each span rounds
 * its weights to its own largest, so such a call's result depends on the thread count within that rounding. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "paged.h"

/* The AVX-512 path's integer products need AVX512-VNNI and AVX512-BW (every AVX512-BF16 CPU has them). */
#if (defined(TPE_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512BW__)) || defined(TPE_AVX2)
#define MAX_G 16
#define MAX_D 256
/* Key (and value) rows prefetched this far ahead of the 16 being scored: a sequence's rows sit in blocks
 * anywhere in the cache, which the hardware prefetcher does not follow; the value rows then wait in L2 for
 * the P.V pass (an item's rows: 2 x L x d bytes, 512 KiB at L = 4096, d = 64). */
#define AHEAD 48
#define SAHEAD 4 /* blocks whose scales are prefetched ahead of the walk that reads them */
#define SPLIT_MIN 512 /* the fewest keys of a span when a call splits its work items */

static int64_t check_i8(const int64_t *slots, const int64_t *block_tables, int64_t max_blocks, const int64_t *lens,
                        int64_t B, int64_t num_blocks, int64_t bs, const int64_t *q_to_kv, int64_t hq, int64_t hkv,
                        int64_t window) {
    for (int64_t kv = 0; kv < hkv; kv++) {
        int64_t g = 0;
        for (int64_t h = 0; h < hq; h++) g += q_to_kv[h] == kv;
        if (g > MAX_G) return 3 * B;
    }
    return paged_check(slots, block_tables, max_blocks, lens, B, num_blocks, bs, q_to_kv, hq, hkv, window);
}

/* One row of d float32 -> d int8 codes and its scale (the header's "store"). */
static inline void quant_row(const float *x, int64_t d, int8_t *codes, float *scale) {
    float amax = 0.f;
    for (int64_t i = 0; i < d; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int64_t i = 0; i < d; i++) {
        float r = nearbyintf(x[i] * inv);
        codes[i] = (int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
    }
    *scale = amax / 127.f;
}
static inline void widen_f32(const float *x, int64_t d, float *y) { memcpy(y, x, (size_t)d * sizeof(float)); }
static inline void widen_bf16(const uint16_t *x, int64_t d, float *y) {
    for (int64_t i = 0; i < d; i++) y[i] = bf2f(x[i]);
}

/* RoPE in place on each row's query and key heads, then its key and value heads quantized into the caches. */
#define PROLOGUE_I8(NAME, T, ROPE, WIDEN)                                                                       \
    static void NAME(T *q, int64_t q_stride, T *k, int64_t k_stride, const T *v, int64_t v_stride,            \
                     const T *cos_t, const T *sin_t, const int64_t *slots, int8_t *k_cache, int8_t *v_cache,  \
                     float *k_scale, float *v_scale, int64_t hq, int64_t hkv, int64_t d, int64_t B) {          \
        float row[MAX_D];                                                                                      \
        for (int64_t b = 0; b < B; b++) {                                                                      \
            if (cos_t)                                                                                         \
                for (int64_t h = 0; h < hq + hkv; h++)                                                         \
                    ROPE(h < hq ? q + b * q_stride + h * d : k + b * k_stride + (h - hq) * d, cos_t + b * d,   \
                         sin_t + b * d, d / 2);                                                                \
            if (slots[b] < 0) continue;                                                                        \
            for (int64_t h = 0; h < hkv; h++) {                                                                \
                const int64_t r = slots[b] * hkv + h;                                                          \
                WIDEN(k + b * k_stride + h * d, d, row);                                                       \
                quant_row(row, d, k_cache + r * d, k_scale + r);                                               \
                WIDEN(v + b * v_stride + h * d, d, row);                                                       \
                quant_row(row, d, v_cache + r * d, v_scale + r);                                               \
            }                                                                                                  \
        }                                                                                                      \
    }
PROLOGUE_I8(prologue_i8_f32, float, rope_head_f32, widen_f32)
PROLOGUE_I8(prologue_i8_bf16, uint16_t, rope_head_bf16, widen_bf16)

/* One query head x [d] (after RoPE) -> its codes as quant_row makes them (q4: d / 4 groups of 4 codes, zero past
 * d), the codes' sum and qs = the query's scale x the softmax scale. */
#define QUANT_Q(NAME, T, WIDEN)                                                                                 \
    static inline void NAME(const T *x, int64_t d, float scale, int32_t *q4, int32_t *qsum, float *qs) {      \
        float row[MAX_D];                                                                                      \
        int8_t codes[MAX_D] = {0};                                                                             \
        WIDEN(x, d, row);                                                                                      \
        quant_row(row, d, codes, qs);                                                                          \
        int32_t sum = 0;                                                                                       \
        for (int64_t i = 0; i < d; i++) sum += codes[i];                                                       \
        memcpy(q4, codes, sizeof(codes));                                                                      \
        *qsum = sum, *qs *= scale;                                                                             \
    }
QUANT_Q(quant_q_f32, float, widen_f32)
QUANT_Q(quant_q_bf16, uint16_t, widen_bf16)

/* The scores' integer dot products (q quantized per head, see the header): 16 keys at a time, key kk's row at
 * kp[kk], the heads' codes q4[j] as d / 4 groups of 4 bytes, acc[j] lane kk = dot(q codes_j, k codes of key kk)
 * exactly (|dot| <= 127 x 127 x 256 < 2^24: exact in float32 too). Each 64-byte (AVX2: 32-byte) piece of the 16
 * rows is transposed to 4-byte groups (lane kk = key kk's group i), so every product instruction takes one group
 * of the query broadcast and no horizontal sum is left. */
#if defined(TPE_AVX512)
/* r[i] lane l <- r[l] lane i (16 x 16 32-bit lanes): unpack 32 / 64 bits, then 128-bit quarters twice. */
static inline __attribute__((always_inline)) void tr16x16(__m512i *r) {
    __m512i a[16], b[16];
    for (int k = 0; k < 8; k++)
        a[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]), a[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    for (int k = 0; k < 4; k++) {
        b[4 * k] = _mm512_unpacklo_epi64(a[4 * k], a[4 * k + 2]), b[4 * k + 1] = _mm512_unpackhi_epi64(a[4 * k], a[4 * k + 2]);
        b[4 * k + 2] = _mm512_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
        b[4 * k + 3] = _mm512_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
    }
    for (int m = 0; m < 4; m++) { /* b[4k + m] quarter L = rows 4k..4k+3, group 4L + m */
        a[m] = _mm512_shuffle_i32x4(b[m], b[4 + m], 0x88), a[4 + m] = _mm512_shuffle_i32x4(b[m], b[4 + m], 0xdd);
        a[8 + m] = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0x88);
        a[12 + m] = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0xdd);
    }
    for (int x = 0; x < 8; x++) /* a[x] quarters: rows 0-3 / 4-7 (a[8 + x]: 8-11 / 12-15) of groups x, 8 + x */
        r[x] = _mm512_shuffle_i32x4(a[x], a[8 + x], 0x88), r[8 + x] = _mm512_shuffle_i32x4(a[x], a[8 + x], 0xdd);
}
/* vpdpbusd multiplies unsigned by signed bytes: the key codes + 128 (xor 0x80, in [1, 255]) against the signed
 * query codes, then 128 x sum(q codes) (qsum[j]) taken off. */
static inline __attribute__((always_inline)) void dots16(const int8_t *const *kp, int64_t N32, int32_t (*q4)[MAX_D / 4],
                                                         const int32_t *qsum, int64_t g, vf *out) {
    __m512i acc[MAX_G];
    for (int64_t j = 0; j < g; j++) acc[j] = _mm512_set1_epi32(-128 * qsum[j]);
    for (int64_t c = 0; 2 * c < N32; c++) {
        __m512i r[16]; /* a last half piece (d % 64 == 32) loads 32 bytes: its other groups meet zero query codes */
        const __mmask64 m = 2 * c + 1 < N32 ? ~(__mmask64)0 : (__mmask64)0xffffffffu;
        for (int kk = 0; kk < 16; kk++)
            r[kk] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, kp[kk] + 64 * c), _mm512_set1_epi8((char)0x80));
        tr16x16(r);
        for (int64_t j = 0; j < g; j++) {
            const int32_t *qj = q4[j] + 16 * c;
            __m512i s0 = acc[j], s1 = _mm512_setzero_si512(), s2 = _mm512_setzero_si512(), s3 = _mm512_setzero_si512();
            for (int i = 0; i < 16; i += 4) {
                s0 = _mm512_dpbusd_epi32(s0, r[i], _mm512_set1_epi32(qj[i]));
                s1 = _mm512_dpbusd_epi32(s1, r[i + 1], _mm512_set1_epi32(qj[i + 1]));
                s2 = _mm512_dpbusd_epi32(s2, r[i + 2], _mm512_set1_epi32(qj[i + 2]));
                s3 = _mm512_dpbusd_epi32(s3, r[i + 3], _mm512_set1_epi32(qj[i + 3]));
            }
            acc[j] = _mm512_add_epi32(_mm512_add_epi32(s0, s1), _mm512_add_epi32(s2, s3));
        }
    }
    for (int64_t j = 0; j < g; j++) out[j] = _mm512_cvtepi32_ps(acc[j]);
}
#else
/* r[i] lane l <- r[l] lane i (8 x 8 32-bit lanes). */
static inline __attribute__((always_inline)) void tr8x8(__m256i *r) {
    __m256i a[8], b[8];
    for (int k = 0; k < 4; k++)
        a[2 * k] = _mm256_unpacklo_epi32(r[2 * k], r[2 * k + 1]), a[2 * k + 1] = _mm256_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    for (int k = 0; k < 2; k++) {
        b[4 * k] = _mm256_unpacklo_epi64(a[4 * k], a[4 * k + 2]), b[4 * k + 1] = _mm256_unpackhi_epi64(a[4 * k], a[4 * k + 2]);
        b[4 * k + 2] = _mm256_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
        b[4 * k + 3] = _mm256_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
    }
    for (int m = 0; m < 4; m++) /* b[4k + m] half L = rows 4k..4k+3, group 4L + m */
        r[m] = _mm256_permute2x128_si256(b[m], b[4 + m], 0x20), r[4 + m] = _mm256_permute2x128_si256(b[m], b[4 + m], 0x31);
}
/* maddubs multiplies unsigned by signed bytes into saturating 16-bit pairs: |k| against q with k's sign
 * (llama.cpp's sign trick; each pair <= 2 x 127 x 127, no saturation), the pairs widened by madd. */
static inline __attribute__((always_inline)) void dots16(const int8_t *const *kp, int64_t N32, int32_t (*q4)[MAX_D / 4],
                                                         const int32_t *qsum, int64_t g, vf *out) {
    (void)qsum;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {
        __m256i acc[MAX_G];
        for (int64_t j = 0; j < g; j++) acc[j] = _mm256_setzero_si256();
        for (int64_t c = 0; c < N32; c++) {
            __m256i r[8], ar[8];
            for (int kk = 0; kk < 8; kk++) r[kk] = _mm256_loadu_si256((const __m256i *)(kp[8 * h + kk] + 32 * c));
            tr8x8(r);
            for (int i = 0; i < 8; i++) ar[i] = _mm256_abs_epi8(r[i]);
            for (int64_t j = 0; j < g; j++) {
                const int32_t *qj = q4[j] + 8 * c;
                __m256i s0 = acc[j], s1 = _mm256_setzero_si256();
                for (int i = 0; i < 8; i += 2) {
                    s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(ar[i], _mm256_sign_epi8(_mm256_set1_epi32(qj[i]), r[i])), ones));
                    s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(ar[i + 1], _mm256_sign_epi8(_mm256_set1_epi32(qj[i + 1]), r[i + 1])), ones));
                }
                acc[j] = _mm256_add_epi32(s0, s1);
            }
        }
        for (int64_t j = 0; j < g; j++) {
            if (h == 0) out[j].lo = _mm256_cvtepi32_ps(acc[j]);
            else out[j].hi = _mm256_cvtepi32_ps(acc[j]);
        }
    }
}
#endif

/* The scores of one item: sc[j * lp + t] = dot(qc_j, codes_k[t]) * (k_scale[t] * qs[j]) for its g heads (q4, qsum:
 * the heads' int8 codes and their sums; qs[j]: the query's scale times the softmax scale), 16 keys at a time, each
 * key row loaded once for every head; krow[t]: the row index (block * bs + offset) * hkv + kv of key t. The rows
 * of the keys and values AHEAD on are prefetched. */
static inline __attribute__((always_inline)) void scores_i8(int32_t (*q4)[MAX_D / 4], const int32_t *qsum,
                                                            const float *qs, int64_t g, const int64_t N32,
                                                            const int8_t *k_cache, const int8_t *v_cache,
                                                            const float *ksc, const int64_t *krow, int64_t L,
                                                            int64_t lp, int64_t d, float *sc) {
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const int64_t nk = L - t0 < 16 ? L - t0 : 16;
        for (int64_t kk = 0; kk < 16 && t0 + AHEAD + kk < L; kk++) { /* the key and value rows AHEAD on */
            const char *p = (const char *)(k_cache + krow[t0 + AHEAD + kk] * d);
            const char *pv = (const char *)(v_cache + krow[t0 + AHEAD + kk] * d);
            for (int64_t o = 0; o < 32 * N32; o += 64) __builtin_prefetch(p + o, 0, 1), __builtin_prefetch(pv + o, 0, 1);
        }
        const int8_t *kp[16];
        for (int64_t kk = 0; kk < 16; kk++) /* keys past L: key t0's row again (scale 0, masked by the softmax) */
            kp[kk] = k_cache + krow[t0 + (kk < nk ? kk : 0)] * d;
        vf dot[MAX_G];
        dots16(kp, N32, q4, qsum, g, dot);
        const vf kv = vf_ldf(ksc + t0);
        for (int64_t j = 0; j < g; j++) vf_stf(sc + j * lp + t0, vf_mul(dot[j], vf_mul(kv, vf_set1(qs[j]))));
    }
}

/* P.V in integers: each head's weights w[t] = p[t] x v_scale[t] rounded to 15 bits (wq[t] = nearbyint(w[t] x
 * 32767 / max w), int16; a pair of keys per 32-bit group) times the value codes widened to int16, two keys'
 * interleaved to a 32-bit lane: vpdpwssd (AVX2: madd + add), one instruction per 16 (AVX2: 8) elements, pair of
 * keys and head, into int32 sums flushed to float32 every FLUSH keys (127 x 32767 x FLUSH < 2^31), in the same
 * windows on both ISAs, so their results are equal. The byte interleave keeps each 128-bit quarter's elements
 * together: lane l of sum vector m holds element pv_elem(m, l) of the row. */
#define FLUSH 512
#define PV_NJ 4 /* the most heads summed together (each value row pair widened once for them) */
#if defined(TPE_AVX512)
#define PV_LANES 16
/* sum vectors per head: 4 per (started) 64 elements */
static inline int64_t pv_nvec(int64_t n32) { return 4 * ((n32 + 1) / 2); }
static inline int64_t pv_elem(int64_t m, int64_t l) {
    return 64 * (m / 4) + 16 * (2 * (m & 1) + l / 8) + 8 * ((m & 3) >> 1) + l % 8;
}
#else
#define PV_LANES 8
static inline int64_t pv_nvec(int64_t n32) { return 4 * n32; } /* 4 per 32 elements */
static inline int64_t pv_elem(int64_t m, int64_t l) { return 32 * (m / 4) + 16 * (m & 1) + 8 * ((m & 3) >> 1) + l; }
#endif
/* facc[jj][m * PV_LANES + l] += the int32 sums of heads j0 .. j0 + nj - 1 over keys u0 .. u1 - 1 (u1 - u0 even,
 * <= FLUSH; key L, if reached, has weight 0 and reads key u's row); wq: the heads' weights, lp each, read in pairs. */
static inline int32_t ld32(const int16_t *p) { int32_t v; memcpy(&v, p, 4); return v; }
static inline __attribute__((always_inline)) void pv_span(const int16_t *wq, int64_t lp, int64_t j0, const int64_t nj,
                                                          const int8_t *v_cache, const int64_t *vrow, int64_t L,
                                                          int64_t u0, int64_t u1, int64_t d, const int64_t N32,
                                                          float (*facc)[MAX_D]) {
    const int64_t NM = pv_nvec(N32);
#if defined(TPE_AVX512)
    __m512i acc[PV_NJ][MAX_D / 16], x[MAX_D / 16];
    for (int64_t jj = 0; jj < nj; jj++)
        for (int64_t m = 0; m < NM; m++) acc[jj][m] = _mm512_setzero_si512();
#else
    __m256i acc[PV_NJ][MAX_D / 8], x[MAX_D / 8];
    for (int64_t jj = 0; jj < nj; jj++)
        for (int64_t m = 0; m < NM; m++) acc[jj][m] = _mm256_setzero_si256();
    const __m256i *xa;
#endif
    for (int64_t u = u0; u < u1; u += 2) {
        if (j0 == 0 && u + 17 < L) /* the value rows 16 keys on (by the first group of heads) */
            for (int64_t o = 0; o < 32 * N32; o += 64)
                __builtin_prefetch(v_cache + vrow[u + 16] * d + o, 0, 1), __builtin_prefetch(v_cache + vrow[u + 17] * d + o, 0, 1);
        const int8_t *a = v_cache + vrow[u] * d, *b = v_cache + vrow[u + 1 < L ? u + 1 : u] * d;
#if defined(TPE_AVX512)
        for (int64_t c = 0; 2 * c < N32; c++) { /* a last half piece loads 32 bytes: its other vectors are 0 */
            const __mmask64 k = 2 * c + 1 < N32 ? ~(__mmask64)0 : (__mmask64)0xffffffffu;
            const __m512i ra = _mm512_maskz_loadu_epi8(k, a + 64 * c), rb = _mm512_maskz_loadu_epi8(k, b + 64 * c);
            const __m512i lo = _mm512_unpacklo_epi8(ra, rb), hi = _mm512_unpackhi_epi8(ra, rb);
            x[4 * c] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(lo));
            x[4 * c + 1] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(lo, 1));
            x[4 * c + 2] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(hi));
            x[4 * c + 3] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(hi, 1));
        }
        for (int64_t jj = 0; jj < nj; jj++) {
            const __m512i w = _mm512_set1_epi32(ld32(wq + (j0 + jj) * lp + u));
            for (int64_t m = 0; m < NM; m++) acc[jj][m] = _mm512_dpwssd_epi32(acc[jj][m], x[m], w);
        }
#else
        for (int64_t p = 0; p < N32; p++) {
            const __m256i ra = _mm256_loadu_si256((const __m256i *)(a + 32 * p));
            const __m256i rb = _mm256_loadu_si256((const __m256i *)(b + 32 * p));
            const __m256i lo = _mm256_unpacklo_epi8(ra, rb), hi = _mm256_unpackhi_epi8(ra, rb);
            x[4 * p] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(lo));
            x[4 * p + 1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(lo, 1));
            x[4 * p + 2] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(hi));
            x[4 * p + 3] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(hi, 1));
        }
        xa = x;
        for (int64_t jj = 0; jj < nj; jj++) {
            const __m256i w = _mm256_set1_epi32(ld32(wq + (j0 + jj) * lp + u));
            for (int64_t m = 0; m < NM; m++) acc[jj][m] = _mm256_add_epi32(acc[jj][m], _mm256_madd_epi16(xa[m], w));
        }
#endif
    }
    for (int64_t jj = 0; jj < nj; jj++)
        for (int64_t m = 0; m < NM; m++) {
            float *f = facc[jj] + m * PV_LANES;
#if defined(TPE_AVX512)
            _mm512_storeu_ps(f, _mm512_add_ps(_mm512_loadu_ps(f), _mm512_cvtepi32_ps(acc[jj][m])));
#else
            _mm256_storeu_ps(f, _mm256_add_ps(_mm256_loadu_ps(f), _mm256_cvtepi32_ps(acc[jj][m])));
#endif
        }
}

/* res[j][0 .. d) = sum_t wq_j[t] codes_v[t] (float32 over the int32 windows) for the g heads, up to PV_NJ heads at a
 * time (fewer where the head size's sums fill the registers). */
static inline __attribute__((always_inline)) void pv_i8(const int16_t *wq, int64_t lp, int64_t g, const int8_t *v_cache,
                                                        const int64_t *vrow, int64_t L, int64_t d, const int64_t N32,
                                                        float (*res)[MAX_D]) {
    const int64_t NM = pv_nvec(N32), njmax = 16 / NM < 1 ? 1 : 16 / NM > PV_NJ ? PV_NJ : 16 / NM;
    for (int64_t j0 = 0; j0 < g; j0 += njmax) {
        const int64_t nj = g - j0 < njmax ? g - j0 : njmax;
        float facc[PV_NJ][MAX_D];
        memset(facc, 0, sizeof(facc));
        for (int64_t u0 = 0; u0 < L; u0 += FLUSH) {
            const int64_t u1 = u0 + FLUSH < L ? u0 + FLUSH : (L + 1) / 2 * 2;
            switch (nj) { /* the heads as a constant: the sums stay in registers */
            case 1: pv_span(wq, lp, j0, 1, v_cache, vrow, L, u0, u1, d, N32, facc); break;
            case 2: pv_span(wq, lp, j0, 2, v_cache, vrow, L, u0, u1, d, N32, facc); break;
            case 3: pv_span(wq, lp, j0, 3, v_cache, vrow, L, u0, u1, d, N32, facc); break;
            default: pv_span(wq, lp, j0, 4, v_cache, vrow, L, u0, u1, d, N32, facc); break;
            }
        }
        for (int64_t jj = 0; jj < nj; jj++)
            for (int64_t m = 0; m < NM; m++)
                for (int64_t l = 0; l < PV_LANES; l++) {
                    const int64_t e = pv_elem(m, l);
                    if (e < d) res[j0 + jj][e] = facc[jj][m * PV_LANES + l];
                }
    }
}

/* 16 float32 weights (in [0, 32767]) -> 16 int16, rounded to nearest even (the MXCSR default). */
static inline void vf_sti16(int16_t *p, vf x) {
#if defined(TPE_AVX512)
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(x)));
#else
    const __m256i s = _mm256_packs_epi32(_mm256_cvtps_epi32(x.lo), _mm256_cvtps_epi32(x.hi));
    _mm256_storeu_si256((__m256i *)p, _mm256_permute4x64_epi64(s, 0xd8));
#endif
}

/* A span's softmax statistics per head: the largest score, sum exp(s - mx), max w / 32767 (the weights' step). */
typedef struct { float mx, sum, step; } span_stat;

/* Softmax of head j's L scores sj (padding to lp: weight 0), then its P.V weights wq [lp] (above); returns its
 * statistics (the output = step / sum x the P.V sums; step 0 if every weight is 0). */
static inline span_stat softmax_i8(float *sj, int64_t L, int64_t lp, float softcap, const float *vs, int16_t *wq) {
    float mx;
    if (softcap > 0)
        mx = cap_scores(sj, L, softcap);
    else {
        vf m = vf_set1(-INFINITY);
        int64_t t = 0;
        for (; t + 16 <= L; t += 16) m = vf_max(m, vf_ldf(sj + t));
        mx = vf_hmax(m);
        for (; t < L; t++) mx = fmaxf(mx, sj[t]);
    }
    for (int64_t t = L; t < lp; t++) sj[t] = -INFINITY;
    const vf vmax = vf_set1(mx);
    vf sum = vf_zero(), wmax = vf_zero();
    for (int64_t t = 0; t < lp; t += 16) {
        const vf e = vf_exp(vf_sub(vf_ldf(sj + t), vmax)), w = vf_mul(e, vf_ldf(vs + t));
        vf_stf(sj + t, w);
        sum = vf_add(sum, e), wmax = vf_max(wmax, w);
    }
    const float wm = vf_hmax(wmax);
    const vf inv = vf_set1(wm > 0.f ? 32767.f / wm : 0.f);
    for (int64_t t = 0; t < lp; t += 16) vf_sti16(wq + t, vf_mul(vf_ldf(sj + t), inv));
    const span_stat st = {mx, vf_sum(sum), wm / 32767.f};
    return st;
}

/* Prefetch the n scales of a block (block id blk) of both scale arrays: a sequence's blocks sit anywhere in the
 * cache, and its scales with them, which the hardware prefetcher does not follow. */
static inline void scale_lines(const float *k_scale, const float *v_scale, int64_t blk, int64_t n) {
    const float *k = k_scale + blk * n, *v = v_scale + blk * n;
    for (int64_t o = 0; o < n; o += 16) __builtin_prefetch(k + o, 0, 1), __builtin_prefetch(v + o, 0, 1);
    __builtin_prefetch(k + n - 1, 0, 1), __builtin_prefetch(v + n - 1, 0, 1);
}

/* A thread's buffers for its spans, grown as needed: scores (g x lp), the scales (values', then keys'; 2 x cap),
 * the row indices (cap), then the weights (g x lp int16, in the rows' second half). */
typedef struct { float *sc, *vs; int64_t *rows, cap; } span_buf;

static int span_grow(span_buf *w, int64_t n) {
    if (n <= w->cap) return 1;
    free(w->sc), free(w->vs), free(w->rows);
    w->cap = n + 256;
    w->sc = (float *)malloc((size_t)w->cap * sizeof(float));
    w->vs = (float *)malloc((size_t)w->cap * 2 * sizeof(float));
    w->rows = (int64_t *)malloc((size_t)w->cap * 2 * sizeof(int64_t));
    if (w->sc && w->vs && w->rows) return 1;
    free(w->sc), free(w->vs), free(w->rows);
    w->sc = w->vs = NULL, w->rows = NULL, w->cap = 0;
    return 0;
}

/* Key positions p0 .. p1 - 1 of one sequence (its block table row bt) for KV head kv and its g query heads (their
 * codes q4, sums qsum, scales qs): res[j] = the P.V sums, st[j] = the softmax statistics. Returns 0 if a buffer
 * could not be allocated (res, st untouched). */
static int span_i8(int32_t (*q4)[MAX_D / 4], const int32_t *qsum, const float *qs, int64_t g, const int64_t *bt,
                   int64_t p0, int64_t p1, int64_t bs, int64_t hkv, int64_t kv, const int8_t *k_cache,
                   const int8_t *v_cache, const float *k_scale, const float *v_scale, int64_t d, float softcap,
                   span_buf *w, float (*res)[MAX_D], span_stat *st) {
    const int64_t L = p1 - p0, lp = (L + 15) / 16 * 16;
    if (!span_grow(w, g * lp + 16)) return 0;
    float *sc = w->sc, *vs = w->vs;
    int64_t *rows = w->rows, cap = w->cap;
    bt += p0 / bs;
    const int64_t nblk = (p1 - 1) / bs - p0 / bs + 1;
    for (int64_t kb = 0; kb < SAHEAD && kb < nblk; kb++) scale_lines(k_scale, v_scale, bt[kb], bs * hkv);
    for (int64_t t = 0, kb = 0, ko = p0 % bs; t < L; t++) { /* the rows and their scales, walked once */
        rows[t] = (bt[kb] * bs + ko) * hkv + kv;
        vs[t] = v_scale[rows[t]], vs[cap + t] = k_scale[rows[t]];
        if (++ko == bs) {
            ko = 0, kb++;
            if (kb + SAHEAD < nblk) scale_lines(k_scale, v_scale, bt[kb + SAHEAD], bs * hkv);
        }
    }
    for (int64_t t = L; t < lp; t++) vs[t] = vs[cap + t] = 0.f;
    switch (d) { /* the head size as a constant */
    case 64: scores_i8(q4, qsum, qs, g, 2, k_cache, v_cache, vs + cap, rows, L, lp, d, sc); break;
    case 128: scores_i8(q4, qsum, qs, g, 4, k_cache, v_cache, vs + cap, rows, L, lp, d, sc); break;
    default: scores_i8(q4, qsum, qs, g, d / 32, k_cache, v_cache, vs + cap, rows, L, lp, d, sc); break;
    }
    int16_t *wq = (int16_t *)(rows + cap);
    for (int64_t j = 0; j < g; j++) st[j] = softmax_i8(sc + j * lp, L, lp, softcap, vs, wq + j * lp);
    switch (d) {
    case 64: pv_i8(wq, lp, g, v_cache, rows, L, d, 2, res); break;
    case 128: pv_i8(wq, lp, g, v_cache, rows, L, d, 4, res); break;
    default: pv_i8(wq, lp, g, v_cache, rows, L, d, d / 32, res); break;
    }
    return 1;
}

/* Spans of one sequence of L keys when the call splits its work items ns ways: each at least SPLIT_MIN keys. */
static inline int64_t nsplit(int64_t ns, int64_t L) {
    const int64_t n = L / SPLIT_MIN;
    return n < 1 ? 1 : n < ns ? n : ns;
}

/* One head's output row from its nsb spans' partials (pp: per span mx, sum, step, -, then the d P.V sums; span s
 * at pp + s * (d + 4)): sum_s sums_s x step_s x exp(mx_s - M) / sum_s sum_s x exp(mx_s - M), M = max mx_s. */
static inline void merge_spans(const float *pp, int64_t nsb, int64_t d, float *row) {
    float M = -INFINITY, den = 0.f;
    for (int64_t s = 0; s < nsb; s++) M = fmaxf(M, pp[s * (d + 4)]);
    for (int64_t e = 0; e < d; e++) row[e] = 0.f;
    for (int64_t s = 0; s < nsb; s++) {
        const float *q = pp + s * (d + 4), a = expf(q[0] - M), c = q[2] * a;
        den += q[1] * a;
        for (int64_t e = 0; e < d; e++) row[e] += q[4 + e] * c;
    }
    const float inv = 1.f / den;
    for (int64_t e = 0; e < d; e++) row[e] *= inv;
}

/* quant_q: one query head -> its int8 codes (quant_q_f32 / quant_q_bf16). Work items: (sequence, KV head), each
 * split into nsplit spans when the items alone would leave threads idle (fewer items than 2 x threads and not a
 * multiple of them: SmolLM2's 3 KV heads on 2 threads), the spans' partials merged after (merge_spans). */
#define PAGED_DECODE_I8(NAME, T, quant_q, PRO, ST)                                                                      \
    int64_t NAME(T *q, int64_t q_stride, T *k, int64_t k_stride, const T *v, int64_t v_stride, const T *cos_t,      \
                 const T *sin_t, const int64_t *slots, const int64_t *block_tables, int64_t max_blocks,              \
                 const int64_t *lens, int8_t *k_cache, int8_t *v_cache, float *k_scale, float *v_scale,              \
                 int64_t num_blocks, int64_t bs, const int64_t *q_to_kv, int64_t hq, int64_t hkv, int64_t d,         \
                 float scale, T *out, int64_t B, int nthreads, int64_t window, float softcap) {                     \
        const int64_t bad = check_i8(slots, block_tables, max_blocks, lens, B, num_blocks, bs, q_to_kv, hq, hkv,     \
                                     window);                                                                        \
        if (bad >= 0) return bad;                                                                                    \
        PRO(q, q_stride, k, k_stride, v, v_stride, cos_t, sin_t, slots, k_cache, v_cache, k_scale, v_scale, hq,     \
            hkv, d, B);                                                                                              \
        int64_t work = 0, items = B * hkv, ns = 1;                                                                   \
        for (int64_t b = 0; b < B; b++) work += lens[b] - win_lo(lens[b], window);                                   \
        const int par = work * hq * d >= 32768;                                                                      \
        if (par && nthreads > 1 && items % nthreads && items < 2 * nthreads) ns = (2 * nthreads + items - 1) / items;\
        float *part = ns > 1 ? (float *)malloc((size_t)(B * hq * ns * (d + 4)) * sizeof(float)) : NULL;              \
        if (!part) ns = 1;                                                                                           \
        _Pragma("omp parallel num_threads(nthreads) if (par)") {                                                     \
            span_buf w = {NULL, NULL, NULL, 0};                                                                      \
            _Pragma("omp for schedule(dynamic, 1)")                                                                  \
            for (int64_t it = 0; it < items * ns; it++) {                                                            \
                const int64_t b = it / (hkv * ns), kv = it / ns % hkv, sp = it % ns, lo = win_lo(lens[b], window);   \
                const int64_t L = lens[b] - lo, nsb = nsplit(ns, L);                                                 \
                int64_t heads[MAX_G], g = 0;                                                                         \
                for (int64_t h = 0; h < hq && g < MAX_G; h++)                                                        \
                    if (q_to_kv[h] == kv) heads[g++] = h;                                                            \
                if (g == 0 || sp >= nsb) continue;                                                                   \
                T *ob = out + b * hq * d;                                                                            \
                const int64_t chunk = ((L + nsb - 1) / nsb + 15) / 16 * 16;                                          \
                const int64_t p0 = lo + (sp * chunk < L ? sp * chunk : L), p1 = lo + ((sp + 1) * chunk < L ? (sp + 1) * chunk : L); \
                float res[MAX_G][MAX_D];                                                                             \
                span_stat st[MAX_G];                                                                                 \
                int32_t q4[MAX_G][MAX_D / 4], qsum[MAX_G];                                                           \
                float qs[MAX_G];                                                                                     \
                for (int64_t j = 0; j < g; j++)                                                                      \
                    quant_q(q + b * q_stride + heads[j] * d, d, scale, q4[j], qsum + j, qs + j);                     \
                if (p0 >= p1 || !span_i8(q4, qsum, qs, g, block_tables + b * max_blocks, p0, p1, bs, hkv, kv,        \
                                         k_cache, v_cache, k_scale, v_scale, d, softcap, &w, res, st))               \
                    for (int64_t j = 0; j < g; j++) { /* no keys (a padding row): zeros */                           \
                        const span_stat none = {-INFINITY, 0.f, 0.f};                                                \
                        st[j] = none;                                                                                \
                        memset(res[j], 0, sizeof(res[j]));                                                          \
                    }                                                                                                \
                for (int64_t j = 0; j < g; j++) {                                                                    \
                    if (nsb > 1) {                                                                                   \
                        float *pp = part + ((b * hq + heads[j]) * ns + sp) * (d + 4);                                \
                        pp[0] = st[j].mx, pp[1] = st[j].sum, pp[2] = st[j].step;                                     \
                        memcpy(pp + 4, res[j], (size_t)d * sizeof(float));                                           \
                        continue;                                                                                    \
                    }                                                                                                \
                    const vf fj = vf_set1(st[j].sum > 0.f ? st[j].step / st[j].sum : 0.f);                           \
                    for (int64_t i = 0; i < d; i += 16) ST(ob + heads[j] * d + i, vf_mul(vf_ldf(res[j] + i), fj));   \
                }                                                                                                    \
            }                                                                                                        \
            free(w.sc), free(w.vs), free(w.rows);                                                                    \
            if (ns > 1) {                                                                                            \
                _Pragma("omp for schedule(static)")                                                                  \
                for (int64_t bh = 0; bh < B * hq; bh++) {                                                            \
                    const int64_t b = bh / hq, nsb = nsplit(ns, lens[b] - win_lo(lens[b], window));                  \
                    float row[MAX_D];                                                                                \
                    if (nsb == 1) continue;                                                                          \
                    merge_spans(part + bh * ns * (d + 4), nsb, d, row);                                              \
                    for (int64_t i = 0; i < d; i += 16) ST(out + bh * d + i, vf_ldf(row + i));                       \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        free(part);                                                                                                  \
        return -1;                                                                                                   \
    }

PAGED_DECODE_I8(tpe_paged_decode_i8_f32, float, quant_q_f32, prologue_i8_f32, vf_stf)
PAGED_DECODE_I8(tpe_paged_decode_i8_bf16, uint16_t, quant_q_bf16, prologue_i8_bf16, vf_stb)
#endif /* neither path: left out of the build; the callers keep torch (cpu_library.has) */
