/* Paged decode attention on CPU in one call per layer: RoPE on the step's new query and key heads,
 * the new keys and values written into the paged KV cache at their slots, and attention of each
 * query head over its sequence's cached keys read through the block table -- what
 * tpengine.backends.reference computes for a decode step (store_kvcache, then decode_attention),
 * for float32 (tpe_paged_decode_f32) and bfloat16 (tpe_paged_decode_bf16). The CPU twin of the
 * Triton paged kernel: no gather of the context into a contiguous copy, no per-op dispatch.
 *
 * Arithmetic, op by op as the torch path rounds it:
 *   rope (HF's formula):  f32: q*cos + rotate_half(q)*sin, each product and the sum rounded to
 *                          float32 (no fused multiply-add); bf16: each rounded to bfloat16.
 *   scores:                f32: dot(q, k) * scale; bf16: bf16(dot(q, k)) * scale in float32, the
 *                          dot by AVX512-BF16's vdpbf16ps (exact products, float32 sums of pairs).
 *   softmax (float32):     exp(s - max) / sum, with a Cephes-style exp (bf16.h's exp16).
 *   output:                sum_t p[t] * v[t] in float32 (bf16: p rounded to bfloat16 first, the sum
 *                          by vdpbf16ps over pairs of keys), then rounded to the dtype.
 * The float32 sums run in a different order than SDPA's, so results equal the torch path up to
 * float32 rounding (vdpbf16ps also flushes float32 denormals to zero).
 *
 * Layout (elements, not bytes): q [B, Hq, D] at q + b * q_stride; k, v [B, Hkv, D] at
 * k + b * k_stride, v + b * v_stride; cos, sin [B, D] (NULL: no RoPE); slots [B] (-1: not stored);
 * block_tables [B, max_blocks]; lens [B] (keys visible to the sequence, its new one included; 0
 * for a padding row, whose output is zero); caches [num_blocks, bs, Hkv, D]; q_to_kv [Hq];
 * out [B, Hq, D] contiguous; amx_min_batch: the fewest sequences at which the bfloat16 kernel takes its
 * AMX path (0: never; the caller's measured choice, tpengine/backends/cpu/cpu_paged.py choose_amx; where
 * tpe_paged_amx() is 0 the AVX-512 path runs whatever it is); window: the layer's sliding window w (0:
 * none): a sequence of L keys attends only to its last w (positions L - w .. L - 1), and only their blocks
 * are read (and checked: the entries before them may be anything, e.g. -1 for freed blocks; no AMX then);
 * softcap: the layer's attention-logit soft cap c (0: none): the scaled scores s become tanh(s / c) * c
 * (cap_scores, bf16.h) before the softmax. Needs D % 32 == 0 (RoPE rotates halves of whole 16-lane vectors).
 * Every slot, length and block id is checked before anything is written: returns -1, or the first
 * bad b (a slot), B + b (a length beyond the block table), 2B + b (a block id out of range) or 3B
 * (q_to_kv naming a KV head out of range, or more than MAX_G query heads on one KV head). Each KV
 * head's query heads are attended together, so every key and value row is read from memory once
 * per step: the scores of 16 keys at a time (reduced together, sum16), the block table walked
 * without divisions, the next key rows and the value rows of the same positions prefetched
 * together (bfloat16) while the scores run (a sequence's rows sit in blocks anywhere in the cache, which the
 * hardware prefetcher does not follow; the value rows are then read from L2); in bfloat16 with many sequences (B >= 4
 threads) a work item is one sequence, its rows read whole (every KV head), else -- and always in float32, where
 * the whole rows' prefetch bursts were slower from memory (docs/notes/kernels.md, 2026-12-07 session 12) -- one
 * (sequence, KV head). The AVX2 kernel below takes whole sequences at many sequences in both dtypes. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "amx.h"
#include "bf16.h"
#include "paged.h"

#define MAX_G 16 /* query heads per KV head (the caller checks) */
#define MAX_D 256

#if defined(TPE_AVX512) || defined(TPE_AVX2)
/* The most query heads on one KV head. */
static int64_t max_group(const int64_t *q_to_kv, int64_t hq, int64_t hkv) {
    int64_t gmax = 0;
    for (int64_t kv = 0; kv < hkv; kv++) {
        int64_t g = 0;
        for (int64_t h = 0; h < hq; h++) g += q_to_kv[h] == kv;
        if (g > gmax) gmax = g;
    }
    return gmax;
}

static int64_t check(const int64_t *slots, const int64_t *block_tables, int64_t max_blocks, const int64_t *lens,
                     int64_t B, int64_t num_blocks, int64_t bs, const int64_t *q_to_kv, int64_t hq, int64_t hkv,
                     int64_t gmax, int64_t window) {
    if (gmax > MAX_G) return 3 * B;
    return paged_check(slots, block_tables, max_blocks, lens, B, num_blocks, bs, q_to_kv, hq, hkv, window);
}

/* A step's first pass, the same on both paths (bf16.h's vf, rope_head_*): RoPE in place on each row
 * b's query heads, then its key heads (cos_t, sin_t [B, d]; NULL: no RoPE), then its key and value
 * rows stored at slots[b] of the caches (-1: not stored). */
#define PAGED_PROLOGUE(NAME, T, ROPE)                                                                           \
    static void NAME(T *q, int64_t q_stride, T *k, int64_t k_stride, const T *v, int64_t v_stride,            \
                     const T *cos_t, const T *sin_t, const int64_t *slots, T *k_cache, T *v_cache, int64_t hq,  \
                     int64_t hkv, int64_t d, int64_t B) {                                                      \
        const int64_t row = hkv * d;                                                                               \
        for (int64_t b = 0; b < B; b++) {                                                                       \
            if (cos_t)                                                                                          \
                for (int64_t h = 0; h < hq + hkv; h++)                                                          \
                    ROPE(h < hq ? q + b * q_stride + h * d : k + b * k_stride + (h - hq) * d, cos_t + b * d,    \
                         sin_t + b * d, d / 2);                                                                 \
            if (slots[b] >= 0) {                                                                                \
                memcpy(k_cache + slots[b] * row, k + b * k_stride, (size_t)row * sizeof(T));                   \
                memcpy(v_cache + slots[b] * row, v + b * v_stride, (size_t)row * sizeof(T));                   \
            }                                                                                                   \
        }                                                                                                       \
    }
PAGED_PROLOGUE(prologue_f32, float, rope_head_f32)
PAGED_PROLOGUE(prologue_bf16, uint16_t, rope_head_bf16)

/* The query heads on KV head kv into heads (at most MAX_G: check() refused more); returns their count. */
static inline int64_t kv_heads(const int64_t *q_to_kv, int64_t hq, int64_t kv, int64_t *heads) {
    int64_t g = 0;
    for (int64_t h = 0; h < hq && g < MAX_G; h++)
        if (q_to_kv[h] == kv) heads[g++] = h;
    return g;
}

#endif

#ifdef TPE_AVX512
#include <immintrin.h>

/* Prefetch the cache lines of one row of n bytes: the K/V rows of a sequence sit in blocks anywhere
 * in the cache, at a stride of all KV heads, which the hardware prefetcher does not follow. */
static inline void prefetch_row(const void *p, int64_t n) {
    for (int64_t o = 0; o < n; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T1);
}
#define VAHEAD 16 /* value rows prefetched ahead: one group of keys' worth, as for the keys */

/* The next work item's K/V rows, prefetched a few rows at a time while the current item computes
 * (ahead_step once per group of 16 keys of its score passes and once per 16 value rows of its P.V passes,
 * pv_bf16: spread over both, faster than over the scores alone, docs/notes/kernels.md 2026-12-07
 * session 12), so that memory keeps streaming during
 * the passes that read L2 only (the second and later KV heads of a whole-row item, the softmax, P.V)
 * and the next item starts on rows already in L2. k, v: the item's first head in the caches (bytes);
 * n: bytes of a row to fetch (every KV head, or one); left: rows still to fetch, per: rows a step. */
typedef struct {
    const char *k, *v;
    const int64_t *bt;
    int64_t bs, rowb, n, left, per, pb, po;
} ahead_t;
static inline void ahead_step(ahead_t *a) {
    for (int64_t i = 0; i < a->per && a->left > 0; i++, a->left--) {
        const int64_t off = (a->bt[a->pb] * a->bs + a->po) * a->rowb;
        prefetch_row(a->k + off, a->n);
        prefetch_row(a->v + off, a->n);
        if (++a->po == a->bs) a->po = 0, a->pb++;
    }
}
/* Bytes of the next item's rows that may be fetched ahead: a quarter of this core's L2 (the current
 * item's rows stay there too); 256 KiB where the OS does not say. */
static int64_t ahead_budget(void) {
    static int64_t budget = 0;
    if (!budget) {
        const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
        budget = l2 > 0 ? l2 / 4 : 256 * 1024;
    }
    return budget;
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
            if (pfn && j0 == 0 && u + VAHEAD < L) prefetch_row(vptr[u + VAHEAD], pfn);                               \
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

/* bfloat16: the 16 dot products q . k[kk] (kk < 16, D = 32 * NV32 elements each) by vdpbf16ps, pairs of
 * bfloat16 products summed into float32 lanes (the products are exact; each lane's sums rounded to
 * float32), the lanes then reduced by sum16. One instruction per 32 elements, against two loads to
 * widen and two fused multiply-adds in float32. NV32 is a constant at every call (inlined). */
static inline __attribute__((always_inline)) __m512 qk16_bf16(const uint16_t *q, const uint16_t *const *kp,
                                                              const int64_t NV32) {
    __m512i qv[MAX_D / 32];
    for (int64_t i = 0; i < NV32; i++) qv[i] = _mm512_loadu_si512(q + i * 32);
    __m512 a[16];
    for (int64_t kk = 0; kk < 16; kk++) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < NV32; i++)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)qv[i], (__m512bh)_mm512_loadu_si512(kp[kk] + i * 32));
        a[kk] = acc;
    }
    return sum16(a);
}

/* bfloat16: out[j] = sum_u p[j][u] v[u] for g query heads (p bfloat16 at pb + j * lp, lp even, zero
 * past L), two value rows at a time by vdpbf16ps: the rows u, u + 1 interleaved element by element
 * (unpacklo/hi within 128-bit lanes), each multiplied by the pair (p[u], p[u + 1]). Lane l of the
 * "lo" accumulator of 32 elements holds element 8 (l / 4) + l % 4, of "hi" that plus 4; the stores
 * put them back in order. p[j][u] may also sit at pb + j * lp + u * pu (pu > 1: the AMX path's
 * [keys, heads] layout). PJ heads at a time; the first pass prefetches the rows VAHEAD ahead (pfn bytes
 * of each; none if 0) and steps ah, the next item's fetch-ahead, once per 16 rows. A
 * missing row u + 1 (odd L) is a zero row. */
static const uint16_t zero_row[MAX_D] = {0};
static inline __attribute__((always_inline)) void pv_bf16(const uint16_t *const *vptr, int64_t L, const uint16_t *pb,
                                                          int64_t lp, int64_t pu, int64_t g, const int64_t *heads,
                                                          uint16_t *out, int64_t pfn, ahead_t *ah, const int64_t NV32,
                                                          const int64_t PJ) {
    const __m512i lo_idx = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i hi_idx = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    for (int64_t j0 = 0; j0 < g; j0 += PJ) {
        const int64_t nj = g - j0 < PJ ? g - j0 : PJ;
        __m512 a[4][2 * MAX_D / 32];
        for (int64_t jj = 0; jj < PJ; jj++)
            for (int64_t i = 0; i < 2 * NV32; i++) a[jj][i] = _mm512_setzero_ps();
        for (int64_t u = 0; u < L; u += 2) {
            if (j0 == 0 && (u & 15) == 0) ahead_step(ah);
            if (pfn && j0 == 0 && u + VAHEAD < L) {
                prefetch_row(vptr[u + VAHEAD], pfn);
                if (u + VAHEAD + 1 < L) prefetch_row(vptr[u + VAHEAD + 1], pfn);
            }
            const uint16_t *r0 = vptr[u], *r1 = u + 1 < L ? vptr[u + 1] : zero_row;
            __m512i lo[MAX_D / 32], hi[MAX_D / 32];
            for (int64_t i = 0; i < NV32; i++) {
                const __m512i x0 = _mm512_loadu_si512(r0 + i * 32), x1 = _mm512_loadu_si512(r1 + i * 32);
                lo[i] = _mm512_unpacklo_epi16(x0, x1);
                hi[i] = _mm512_unpackhi_epi16(x0, x1);
            }
            for (int64_t jj = 0; jj < PJ; jj++) {
                if (jj >= nj) break;
                uint32_t pair;
                const uint16_t *pj = pb + (j0 + jj) * lp + u * pu;
                if (pu == 1)
                    memcpy(&pair, pj, sizeof(pair));
                else
                    pair = (uint32_t)pj[0] | (uint32_t)pj[pu] << 16;
                const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int64_t i = 0; i < NV32; i++) {
                    a[jj][2 * i] = _mm512_dpbf16_ps(a[jj][2 * i], (__m512bh)lo[i], pp);
                    a[jj][2 * i + 1] = _mm512_dpbf16_ps(a[jj][2 * i + 1], (__m512bh)hi[i], pp);
                }
            }
        }
        for (int64_t jj = 0; jj < nj; jj++) {
            uint16_t *o = out + heads[j0 + jj] * NV32 * 32;
            for (int64_t i = 0; i < NV32; i++) {
                st(o + i * 32, _mm512_permutex2var_ps(a[jj][2 * i], lo_idx, a[jj][2 * i + 1]));
                st(o + i * 32 + 16, _mm512_permutex2var_ps(a[jj][2 * i], hi_idx, a[jj][2 * i + 1]));
            }
        }
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

/* AMX (Sapphire Rapids and later), bfloat16: the scores of 16 keys for all the KV head's query heads
 * in d / 32 tile multiplies (tdpbf16ps: A = the 16 key rows of one block, 32 elements of the head,
 * loaded straight from the cache at the row stride; B = the query heads' elements in pairs, the VNNI
 * layout, NP columns; C = [16 keys, NP heads] float32), instead of 16 dot products per head, each
 * reduced across lanes. The scores then sit [keys, NP heads] (NP = g rounded up to 4, 8 or 16; the
 * padding heads have zero queries), and the softmax runs on that layout, each lane's head's max and
 * sum gathered by rotating the lanes. Needs block_size % 16 == 0 and D <= 128 (d / 32 B tiles). */
#define HAVE_AMX 1

/* tmm0: scores [16, np] float32; tmm1: 16 key rows x 32 elements; tmm2..: the query pairs [16, np]. */
static void amx_config(int64_t np, int64_t nc) {
    tpe_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = 16, c.colsb[0] = (uint16_t)(np * 4);
    c.rows[1] = 16, c.colsb[1] = 64;
    for (int64_t i = 0; i < nc; i++) c.rows[2 + i] = 16, c.colsb[2 + i] = (uint16_t)(np * 4);
    _tile_loadconfig(&c);
}
static void amx_release(void) { _tile_release(); }

/* The lanes below n (n >= 1; all 16 from n >= 16). */
static inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

/* x's lanes combined per head, lane l holding head l % np (np = 4, 8 or 16): the max (is_max) or the
 * sum of the lanes of each head, in every lane of that head, by rotating the lanes by 8, then 4. */
static inline __m512 per_head(__m512 x, int64_t np, int is_max) {
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t r = 8; r >= np; r >>= 1) {
        const __m512 y = _mm512_permutexvar_ps(
            _mm512_and_si512(_mm512_add_epi32(lanes, _mm512_set1_epi32((int)r)), _mm512_set1_epi32(15)), x);
        x = is_max ? _mm512_max_ps(x, y) : _mm512_add_ps(x, y);
    }
    return x;
}

/* One (sequence, KV head) item by AMX: scores into sc [L (+ up to 15), np], softmax, p (bfloat16,
 * [L + 1, np]) into pbf, then p @ V by pv_bf16. q: the sequence's query row [Hq, D]; out: its output
 * row. The same roundings as the AVX-512 path: bf16(dot) * scale, p = bf16(exp(s - max) / sum). */
static void amx_item(const uint16_t *q, const int64_t *heads, int64_t g, int64_t np, int64_t d,
                     const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *bt, int64_t bs, int64_t row,
                     int64_t kv, int64_t L, float scale, float *sc, uint16_t *pbf, const uint16_t **vptr,
                     uint16_t *out, int64_t pfn, ahead_t *ah, float softcap) {
    const int64_t nc = d / 32;
    uint32_t qt[4][16][16]; /* [chunk][pair][head]: the B tiles */
    for (int64_t c = 0; c < nc; c++)
        for (int64_t r = 0; r < 16; r++)
            for (int64_t n = 0; n < np; n++) {
                uint32_t x = 0;
                if (n < g) memcpy(&x, q + heads[n] * d + c * 32 + 2 * r, sizeof(x));
                qt[c][r][n] = x;
            }
    const int64_t qs = 16 * sizeof(uint32_t), rb_ = row * (int64_t)sizeof(uint16_t), tb = np * 4;
    _tile_loadd(2, qt[0], qs);
    if (nc > 1) _tile_loadd(3, qt[1], qs);
    if (nc > 2) _tile_loadd(4, qt[2], qs);
    if (nc > 3) _tile_loadd(5, qt[3], qs);
    /* the prefetch cursor, 16 keys ahead after the first group; none (pfn 0: the rows were fetched ahead) */
    int64_t pt = pfn ? 0 : L, pb = 0, po = 0;
    for (; pt < 16 && pt < L; pt++) {
        prefetch_row(k_cache + (bt[pb] * bs + po) * row + kv * d, pfn);
        prefetch_row(v_cache + (bt[pb] * bs + po) * row + kv * d, pfn);
        if (++po == bs) po = 0, pb++;
    }
    for (int64_t t0 = 0, kb = 0, ko = 0; t0 < L; t0 += 16) {
        const uint16_t *kp = k_cache + (bt[kb] * bs + ko) * row + kv * d;
        if ((ko += 16) == bs) ko = 0, kb++;
        for (int64_t kk = 0; kk < 16 && pt < L; kk++, pt++) {
            prefetch_row(k_cache + (bt[pb] * bs + po) * row + kv * d, pfn);
            prefetch_row(v_cache + (bt[pb] * bs + po) * row + kv * d, pfn);
            if (++po == bs) po = 0, pb++;
        }
        ahead_step(ah);
        _tile_zero(0);
        _tile_loadd(1, kp, rb_);
        _tile_dpbf16ps(0, 1, 2);
        if (nc > 1) {
            _tile_loadd(1, kp + 32, rb_);
            _tile_dpbf16ps(0, 1, 3);
        }
        if (nc > 2) {
            _tile_loadd(1, kp + 64, rb_);
            _tile_dpbf16ps(0, 1, 4);
        }
        if (nc > 3) {
            _tile_loadd(1, kp + 96, rb_);
            _tile_dpbf16ps(0, 1, 5);
        }
        _tile_stored(0, sc + t0 * np, tb); /* rows past L (the last block's unused slots) are ignored */
    }
    /* softmax over keys, per head: lane l of a vector holds head l % np */
    const int64_t F = L * np;
    const __m512 vscale = _mm512_set1_ps(scale), vcap = _mm512_set1_ps(softcap);
    __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < F; i += 16) {
        const __mmask16 m = first_lanes(F - i);
        __m512 v = _mm512_mul_ps(rb(_mm512_maskz_loadu_ps(m, sc + i)), vscale);
        if (softcap > 0) v = _mm512_mul_ps(vf_tanh(_mm512_div_ps(v, vcap)), vcap); /* as cap_scores */
        _mm512_mask_storeu_ps(sc + i, m, v);
        mx = _mm512_mask_max_ps(mx, m, mx, v);
    }
    mx = per_head(mx, np, 1);
    for (int64_t i = 0; i < F; i += 16) {
        const __mmask16 m = first_lanes(F - i);
        const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + i), mx)));
        _mm512_mask_storeu_ps(sc + i, m, e);
        sum = _mm512_add_ps(sum, e);
    }
    sum = per_head(sum, np, 0);
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), sum);
    for (int64_t i = 0; i < F; i += 16) { /* p rounded to bfloat16: its top 16 bits */
        const __mmask16 m = first_lanes(F - i);
        const __m512 p = rb(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, sc + i), inv));
        _mm256_mask_storeu_epi16((__m256i *)(pbf + i), m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(p), 16)));
    }
    for (int64_t n = 0; n < np; n++) pbf[F + n] = 0; /* the pair of an odd L's last key */
    for (int64_t u = 0, vb = 0, vo = 0; u < L; u++) {
        vptr[u] = v_cache + (bt[vb] * bs + vo) * row + kv * d;
        if (++vo == bs) vo = 0, vb++;
    }
    for (int64_t u = 0; pfn && u < VAHEAD && u < L; u++) prefetch_row(vptr[u], pfn);
    switch (d / 16) {
    case 4: pv_bf16(vptr, L, pbf, 1, np, g, heads, out, pfn, ah, 2, 4); break;
    case 8: pv_bf16(vptr, L, pbf, 1, np, g, heads, out, pfn, ah, 4, 2); break;
    default: pv_bf16(vptr, L, pbf, 1, np, g, heads, out, pfn, ah, d / 32, 1); break;
    }
}
#else
#define HAVE_AMX 0
static void amx_config(int64_t np, int64_t nc) { (void)np, (void)nc; }
static void amx_release(void) {}
static void amx_item(const uint16_t *q, const int64_t *heads, int64_t g, int64_t np, int64_t d,
                     const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *bt, int64_t bs, int64_t row,
                     int64_t kv, int64_t L, float scale, float *sc, uint16_t *pbf, const uint16_t **vptr,
                     uint16_t *out, int64_t pfn, ahead_t *ah, float softcap) {}
#endif

/* 1 if the bfloat16 kernel's AMX path is available (built with AMX, allowed by the OS), else 0: then
 * the kernel takes its AVX-512 path whatever its amx_min_batch. */
int tpe_paged_amx(void) { return HAVE_AMX && tpe_amx_ok(); }

/* One dtype's kernel. LD(p): 16 elements -> __m512; ST(p, x): store 16 rounded; RND(x): x rounded
 * to the dtype, back as float32; T: the element type; BF: 1 for bfloat16 (scores and the weighted
 * sum of values by vdpbf16ps, qk16_bf16 and pv_bf16), 0 for float32; PRO: the dtype's prologue
 * (prologue_f32 / prologue_bf16, shared with the AVX2 kernel). */
#define PAGED_DECODE(NAME, T, LD, ST, RND, BF, PRO)                                                                \
    int64_t NAME(T *q, int64_t q_stride, T *k, int64_t k_stride, const T *v, int64_t v_stride, const T *cos_t,     \
                 const T *sin_t, const int64_t *slots, const int64_t *block_tables, int64_t max_blocks,             \
                 const int64_t *lens, T *k_cache, T *v_cache, int64_t num_blocks, int64_t bs,                       \
                 const int64_t *q_to_kv, int64_t hq, int64_t hkv, int64_t d, float scale, T *out, int64_t B,        \
                 int64_t amx_min_batch, int nthreads, int64_t window, float softcap) {                             \
        const int64_t gmax = max_group(q_to_kv, hq, hkv); /* (the AMX path pads to it) */         \
        int64_t bad = check(slots, block_tables, max_blocks, lens, B, num_blocks, bs, q_to_kv, hq, hkv, gmax, window); \
        if (bad >= 0) return bad;                                                                                   \
        const int64_t row = hkv * d;                                                                               \
        PRO(q, q_stride, k, k_stride, v, v_stride, cos_t, sin_t, slots, k_cache, v_cache, hq, hkv, d, B);          \
        int64_t work = 0;                                                                                           \
        /* bfloat16, many sequences: one item per sequence (its K/V rows read whole, every head); few, or float32: \
         * per (b, KV head), each row's d elements prefetched (float32's whole rows read slower from memory) */     \
        const int whole = BF && B >= 4 * nthreads;                                                                  \
        const int64_t np = gmax <= 4 ? 4 : gmax <= 8 ? 8 : 16;                                                      \
        const int use_amx = BF && HAVE_AMX && amx_min_batch > 0 && B >= amx_min_batch && bs % 16 == 0 && d <= 128  \
                            && window == 0 && tpe_amx_ok(); /* its 16-key tiles start at a block's 16-key group */     \
        const int64_t items = whole ? B : B * hkv;                                                                  \
        int64_t claim = 0; /* the next item to take */                                                              \
        for (int64_t b = 0; b < B; b++) work += lens[b] - win_lo(lens[b], window);                                  \
        _Pragma("omp parallel num_threads(nthreads) if (work * hq * d >= 32768)") {                               \
            float *sc = NULL;                                                                                       \
            const T **vptr = NULL;                                                                                  \
            uint16_t *pbf = NULL; /* bfloat16: the probabilities, each head's padded to an even count */             \
            int64_t cap = 0;                                                                                        \
            if (use_amx) amx_config(np, d / 32);                                                                    \
            /* items claimed one ahead (dynamic scheduling by hand), so the next one's rows can be fetched ahead */ \
            int64_t it = __atomic_fetch_add(&claim, 1, __ATOMIC_RELAXED);                                           \
            int pre = 0; /* this item's rows were fetched ahead */                                                  \
            while (it < items) {                                                                                    \
              const int64_t b = whole ? it : it / hkv, kv0 = whole ? 0 : it % hkv;                                  \
              const int64_t nx = __atomic_fetch_add(&claim, 1, __ATOMIC_RELAXED);                                   \
              ahead_t ah = {0};                                                                                     \
              if (BF && nx < items) { /* bfloat16 only: no gain measured in float32 */                              \
                  const int64_t bn = whole ? nx : nx / hkv, n = (whole ? row : d) * (int64_t)sizeof(T);             \
                  const int64_t lon = win_lo(lens[bn], window), ln = lens[bn] - lon; /* its window */              \
                  const int64_t groups = 2 * (whole ? hkv : 1) * ((lens[b] - win_lo(lens[b], window) + 15) / 16);       \
                  if (groups > 0 && 2 * n * ln <= ahead_budget()) {                                                 \
                      ah.k = (const char *)(k_cache + (whole ? 0 : (nx % hkv) * d));                                \
                      ah.v = (const char *)(v_cache + (whole ? 0 : (nx % hkv) * d));                                \
                      ah.bt = block_tables + bn * max_blocks + lon / bs, ah.po = lon % bs, ah.bs = bs;              \
                      ah.rowb = row * (int64_t)sizeof(T), ah.n = n, ah.left = ln, ah.per = (ln + groups - 1) / groups; \
                  }                                                                                                 \
              }                                                                                                     \
              for (int64_t kv = kv0; kv < (whole ? hkv : kv0 + 1); kv++) {                                          \
                /* the keys attended: lo .. lens[b] - 1, from offset o0 of the block-table entry bt[0] */          \
                const int64_t lo = win_lo(lens[b], window), L = lens[b] - lo, o0 = lo % bs;                         \
                /* whole rows (every KV head) are fetched with the first head: contiguous in a block */             \
                const int64_t pfn = pre ? 0 : (whole && kv == 0 ? row : d) * (int64_t)sizeof(T);                    \
                int64_t heads[MAX_G];                                                                              \
                const int64_t g = kv_heads(q_to_kv, hq, kv, heads);                                                \
                if (g == 0) continue;                                                                               \
                if (L == 0) {                                                                                       \
                    for (int64_t j = 0; j < g; j++) memset(out + (b * hq + heads[j]) * d, 0, (size_t)d * sizeof(T)); \
                    continue;                                                                                       \
                }                                                                                                   \
                if ((L + 16) * np > cap) {                                                                              \
                    free(sc);                                                                                       \
                    cap = (L + 16) * np + 64;                                                                           \
                    sc = (float *)malloc((size_t)cap * sizeof(float));                                              \
                    free(vptr);                                                                                     \
                    vptr = (const T **)malloc((size_t)cap * sizeof(*vptr));                                         \
                    free(pbf);                                                                                      \
                    pbf = BF ? (uint16_t *)malloc((size_t)cap * sizeof(uint16_t)) : NULL;                            \
                }                                                                                                   \
                const int64_t *bt = block_tables + b * max_blocks + lo / bs;                                        \
                const int64_t nv = d / 16;                                                                          \
                if (use_amx) {                                                                                      \
                    amx_item((const uint16_t *)(q + b * q_stride), heads, g, np, d, (const uint16_t *)k_cache,     \
                             (const uint16_t *)v_cache, bt, bs, row, kv, L, scale, sc, pbf,                         \
                             (const uint16_t **)vptr, (uint16_t *)(out + b * hq * d), pfn, &ah, softcap);                \
                    continue;                                                                                       \
                }                                                                                                   \
                __m512 qv[MAX_G][MAX_D / 16];                                                                       \
                float mx[MAX_G];                                                                                    \
                for (int64_t j = 0; j < g; j++) {                                                                   \
                    if (!BF)                                                                                        \
                        for (int64_t i = 0; i < nv; i++) qv[j][i] = LD(q + b * q_stride + heads[j] * d + i * 16);   \
                    mx[j] = -INFINITY;                                                                              \
                }                                                                                                   \
                const __m512 vscale = _mm512_set1_ps(scale);                                                \
                __m512 mxv[MAX_G];                                                                          \
                for (int64_t j = 0; j < g; j++) mxv[j] = _mm512_set1_ps(-INFINITY);                        \
                int64_t kb = 0, ko = o0; /* the next key's block-table index and offset in its block */     \
                int64_t pt = pfn ? 0 : L, pb = 0, po = o0; /* the prefetch cursor, 16 keys ahead; none: pfn 0 */ \
                for (; pt < 16 && pt < L; pt++) {                                                       \
                    prefetch_row(k_cache + (bt[pb] * bs + po) * row + kv * d, pfn);      \
                    if (BF) prefetch_row(v_cache + (bt[pb] * bs + po) * row + kv * d, pfn);      \
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
                        if (BF) prefetch_row(v_cache + (bt[pb] * bs + po) * row + kv * d, pfn);  \
                        if (++po == bs) po = 0, pb++;                                                       \
                    }                                                                                       \
                    ahead_step(&ah);                                                                                \
                    for (int64_t kk = nk; kk < 16; kk++) kp[kk] = kp[0];                                    \
                    if (BF) {                                                                                       \
                        const uint16_t *const *kq = (const uint16_t *const *)kp;                                    \
                        for (int64_t j = 0; j < g; j++) {                                                           \
                            const uint16_t *qj = (const uint16_t *)(q + b * q_stride + heads[j] * d);               \
                            const __m512 s = nv == 4 ? qk16_bf16(qj, kq, 2) : nv == 8 ? qk16_bf16(qj, kq, 4)        \
                                                                                   : qk16_bf16(qj, kq, nv / 2);     \
                            const __m512 sv = _mm512_mul_ps(RND(s), vscale);                                        \
                            _mm512_mask_storeu_ps(sc + j * L + t0, m, sv);                                          \
                            mxv[j] = _mm512_mask_max_ps(mxv[j], m, mxv[j], sv);                                     \
                        }                                                                                           \
                        continue;                                                                                   \
                    }                                                                                               \
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
                for (int64_t j = 0; j < g; j++)                                                                     \
                    mx[j] = softcap > 0 ? cap_scores(sc + j * L, L, softcap) : _mm512_reduce_max_ps(mxv[j]);        \
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
                    if (BF) { /* p is bfloat16-rounded: its top 16 bits are the bfloat16 */                        \
                        uint16_t *pj = pbf + j * (L + (L & 1));                                                      \
                        for (t = 0; t + 16 <= L; t += 16)                                                           \
                            _mm256_storeu_si256((__m256i *)(pj + t),                                                \
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(_mm512_loadu_ps(sj + t)), 16))); \
                        for (; t < L; t++) {                                                                        \
                            uint32_t u;                                                                             \
                            memcpy(&u, sj + t, 4);                                                                  \
                            pj[t] = (uint16_t)(u >> 16);                                                            \
                        }                                                                                           \
                        if (L & 1) pj[L] = 0;                                                                       \
                    }                                                                                               \
                }                                                                                                   \
                for (int64_t u = 0, vb = 0, vo = o0; u < L; u++) { /* the value rows, walked once */                \
                    vptr[u] = v_cache + (bt[vb] * bs + vo) * row + kv * d;                                          \
                    if (++vo == bs) vo = 0, vb++;                                                                   \
                }                                                                                                   \
                for (int64_t u = 0; pfn && u < VAHEAD && u < L; u++) prefetch_row(vptr[u], pfn);  \
                if (BF) {                                                                                           \
                    const uint16_t *const *vq = (const uint16_t *const *)vptr;                                      \
                    uint16_t *ob = (uint16_t *)(out + b * hq * d);                                                  \
                    const int64_t lp = L + (L & 1);                                                                 \
                    switch (nv) { /* the head size as a constant */                                                 \
                    case 4: pv_bf16(vq, L, pbf, lp, 1, g, heads, ob, pfn, &ah, 2, 4); break;                                 \
                    case 8: pv_bf16(vq, L, pbf, lp, 1, g, heads, ob, pfn, &ah, 4, 2); break;                                 \
                    case 16: pv_bf16(vq, L, pbf, lp, 1, g, heads, ob, pfn, &ah, 8, 1); break;                                \
                    default: pv_bf16(vq, L, pbf, lp, 1, g, heads, ob, pfn, &ah, nv / 2, 1); break;                           \
                    }                                                                                               \
                    continue;                                                                                       \
                }                                                                                                   \
                switch (nv) { /* the head size as a constant: the accumulators stay in registers */                 \
                case 2: PV_HEADS(T, LD, ST, 2, 4) break;                                                               \
                case 4: PV_HEADS(T, LD, ST, 4, 4) break;                                                               \
                case 8: PV_HEADS(T, LD, ST, 8, 2) break;                                                               \
                case 16: PV_HEADS(T, LD, ST, 16, 1) break;                                                             \
                default: PV_HEADS(T, LD, ST, nv, 1) break;                                                             \
                }                                                                                                   \
              }                                                                                                     \
              pre = ah.n > 0 && ah.left == 0;                                                                       \
              it = nx;                                                                                              \
            }                                                                                                       \
            if (use_amx) amx_release();                                                                             \
            free(sc);                                                                                               \
            free(vptr);                                                                                             \
            free(pbf);                                                                                              \
        }                                                                                                           \
        return -1;                                                                                                  \
    }

/* bf16.h's vf is __m512 here; float32's "rounding" is vf_keep: none, but an opaque barrier, so the
 * compiler cannot contract a product and the sum after it into one fused multiply-add (torch rounds
 * the product first). */
PAGED_DECODE(tpe_paged_decode_f32, float, vf_ldf, vf_stf, vf_keep, 0, prologue_f32)
PAGED_DECODE(tpe_paged_decode_bf16, uint16_t, vf_ldb, vf_stb, vf_rb, 1, prologue_bf16)

#elif defined(TPE_AVX2)
/* AVX2 + FMA: the same steps and the same roundings, op by op, in a plainer form -- 8 lanes, one work
 * item per (sequence, KV head) (dynamic schedule, ITEM8), each key row read once for the KV head's query
 * heads and each value row once a tile of 32 output lanes, an item's own rows prefetched PF_AHEAD
 * ahead (not the next item's, as above) and no AMX; with many sequences (B >= 4 threads) and every KV
 * head's query heads alike, one item per sequence (ROWS8): its rows read whole, in address order, the
 * next group's fetched piece by piece between the current group's arithmetic, each head's arithmetic
 * ITEM8's (the outputs equal bit for bit). The dot
 * products are float32 FMAs over the widened elements (bfloat16: products exact, as vdpbf16ps's; the
 * float32 sums in another order), 8 keys at a time, their 8-lane partial sums reduced together
 * (sum8x8); then, as above, bf16(dot) * scale (float32: dot * scale), the softmax with exp8, p
 * rounded to the dtype, sum_t p[t] * v[t] in float32, rounded to the dtype. The first pass (RoPE, the
 * KV store: prologue_*) and the checks are the AVX-512 kernel's; the item loop is this ISA's own, as
 * its float32 sums run in another order (8 lanes, sum8x8) and its tiles fit AVX2's 16 registers.
 * amx_min_batch is taken and ignored (no AMX path here). */

/* float32 "rounding": none, but an opaque barrier against contracting a product and the sum after
 * it into one fused multiply-add (torch rounds the product first), as bf16.h's vf_keep. */
static inline __m256 keep8(__m256 x) {
    __asm__("" : "+x"(x));
    return x;
}

/* Key or value rows prefetched this far ahead of the one being read: a sequence's rows sit in blocks
 * anywhere in the cache, one KV head's d elements at a stride of all of them, which the hardware
 * prefetcher does not follow. */
#define PF_AHEAD 16
/* Prefetch the d elements of KV head kv at the cursor (block pb, offset po of the block table bt),
 * then advance it: float32 rows into L2 (prefetcht1, as the AVX-512 kernel's: faster than into L1 at 64
 * sequences, docs/notes/kernels.md 2026-12-07 session 12), bfloat16 rows into L1. */
#define prefetch_rows(cache, bt, bs, row, kv, d, pb, po)                                                        \
    do {                                                                                                         \
        const char *p_ = (const char *)((cache) + ((bt)[*(pb)] * (bs) + *(po)) * (row) + (kv) * (d));           \
        for (int64_t o_ = 0; o_ < (d) * (int64_t)sizeof(*(cache)); o_ += 64) _mm_prefetch(p_ + o_, sizeof(*(cache)) == 4 ? _MM_HINT_T1 : _MM_HINT_T0); \
        if (++*(po) == (bs)) *(po) = 0, ++*(pb);                                                                 \
    } while (0)

/* out[.., i0 * 8 .. (i0 + W) * 8) of the item's g heads: sum_u p[j][u] v[u] over the L value rows, W
 * 8-lane columns at a time (the same FMA chain per lane as one column at a time). A statement inside
 * ITEM8's body: it reads that item's variables (g, L, bt, o0, sc, lp, heads, ob, ...) and, in the first
 * tile (i0 == 0), moves the value-row prefetch cursor (pt, pb, po) along. */
#define PV_TILE8(T, LD, ST, W)                                                                                     \
    do {                                                                                                            \
        __m256 acc[MAX_G][W];                                                                                       \
        for (int64_t j = 0; j < g; j++)                                                                             \
            for (int w = 0; w < W; w++) acc[j][w] = _mm256_setzero_ps();                                            \
        for (int64_t u = 0, vb = 0, vo = o0; u < L; u++) {                                                          \
            const T *vp = v_cache + (bt[vb] * bs + vo) * row + kv * d + i0 * 8;                                     \
            if (++vo == bs) vo = 0, vb++;                                                                           \
            if (i0 == 0 && pt < L) {                                                                                \
                prefetch_rows(v_cache, bt, bs, row, kv, d, &pb, &po);                                               \
                pt++;                                                                                               \
            }                                                                                                       \
            __m256 vr[W];                                                                                           \
            for (int w = 0; w < W; w++) vr[w] = LD(vp + w * 8);                                                     \
            for (int64_t j = 0; j < g; j++) {                                                                       \
                const __m256 pu = _mm256_set1_ps(sc[j * lp + u]);                                                   \
                for (int w = 0; w < W; w++) acc[j][w] = _mm256_fmadd_ps(pu, vr[w], acc[j][w]);                      \
            }                                                                                                       \
        }                                                                                                           \
        for (int64_t j = 0; j < g; j++)                                                                             \
            for (int w = 0; w < W; w++) ST(ob + heads[j] * d + (i0 + w) * 8, acc[j][w]);                            \
    } while (0)

/* One head's scores (sj [lp], the first L of them real; vmxj: their running max, unless the cap takes them) to
 * its softmax probabilities in place, each rounded as RND rounds the dtype (the padding's -inf: exp 0). A
 * statement inside ITEM8's and ROWS8's bodies (their L, lp, softcap). */
#define SOFTMAX8(SJ, VMXJ, RND)                                                                                    \
    do {                                                                                                            \
        float *sj = (SJ);                                                                                           \
        const float mxj = softcap > 0 ? cap_scores(sj, L, softcap) : hmax8(VMXJ);                                  \
        for (int64_t t = L; t < lp; t++) sj[t] = -INFINITY;                                                         \
        const __m256 vmax = _mm256_set1_ps(mxj);                                                                    \
        __m256 sum = _mm256_setzero_ps();                                                                           \
        for (int64_t t = 0; t < lp; t += 8) {                                                                       \
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sj + t), vmax));                                    \
            _mm256_storeu_ps(sj + t, e);                                                                            \
            sum = _mm256_add_ps(sum, e);                                                                            \
        }                                                                                                           \
        const __m256 inv = _mm256_set1_ps(1.f / hsum8(sum));                                                        \
        for (int64_t t = 0; t < lp; t += 8)                                                                         \
            _mm256_storeu_ps(sj + t, RND(_mm256_mul_ps(_mm256_loadu_ps(sj + t), inv)));                             \
    } while (0)

/* One work item (sequence b, KV head kv) of PAGED_DECODE8, as a function of the head count g and the head
 * size's 8-lane vectors nv, which the kernel passes as constants for the common shapes (inlined: every loop
 * over heads and lanes unrolls and the partial sums, query vectors and P.V accumulators live in registers or
 * at fixed stack slots; with a runtime g they were indexed arrays in memory, each FMA a load and a store).
 * The arithmetic is the same for any g, nv. qb: the sequence's query row [Hq, D]; ob: its output row; bt: the
 * block table from the item's first key, at offset o0; L keys, lp = L rounded up to 8; sc: [g, lp] floats. */
#define ITEM8(NAME, T, LD, ST, RND)                                                                                 \
    static inline __attribute__((always_inline)) void NAME(                                                        \
        const T *qb, const int64_t *heads, const int64_t g, const int64_t nv, const T *k_cache, const T *v_cache, \
        const int64_t *bt, int64_t bs, int64_t row, int64_t kv, int64_t d, int64_t L, int64_t o0, int64_t lp,      \
        float *sc, float scale, float softcap, T *ob) {                                                            \
        const __m256 ninf = _mm256_set1_ps(-INFINITY), vscale = _mm256_set1_ps(scale);                             \
        const __m256 lane8 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);                                               \
        __m256 qv[MAX_G][MAX_D / 8], part[MAX_G][8], vmx[MAX_G];                                                    \
        for (int64_t j = 0; j < g; j++)                                                                             \
            for (int64_t i = 0; i < nv; i++) qv[j][i] = LD(qb + heads[j] * d + i * 8);                              \
        for (int64_t j = 0; j < g; j++) vmx[j] = ninf;                                                              \
        int64_t pt = 0, pb = 0, po = o0; /* the prefetch cursor: PF_AHEAD key rows ahead */                       \
        for (; pt < L && pt < PF_AHEAD; pt++) prefetch_rows(k_cache, bt, bs, row, kv, d, &pb, &po);                 \
        for (int64_t t0 = 0, kb = 0, ko = o0; t0 < L; t0 += 8) { /* scores, 8 keys a step: each row read once */   \
            const int64_t nk = L - t0 < 8 ? L - t0 : 8;                                                             \
            for (int64_t e = 0; e < 8 && pt < L; e++, pt++) prefetch_rows(k_cache, bt, bs, row, kv, d, &pb, &po);   \
            for (int64_t kk = 0; kk < 8; kk++) { /* the 8-lane partial dots; past L: zero rows' 0 */              \
                const T *kp = kk < nk ? k_cache + (bt[kb] * bs + ko) * row + kv * d : NULL;                         \
                if (kk < nk && ++ko == bs) ko = 0, kb++;                                                            \
                __m256 kr[MAX_D / 8];                                                                               \
                for (int64_t i = 0; i < nv; i++) kr[i] = kp ? LD(kp + i * 8) : _mm256_setzero_ps();                \
                for (int64_t j = 0; j < g; j++) {                                                                   \
                    __m256 a = _mm256_mul_ps(qv[j][0], kr[0]);                                                      \
                    for (int64_t i = 1; i < nv; i++) a = _mm256_fmadd_ps(qv[j][i], kr[i], a);                       \
                    part[j][kk] = a;                                                                                \
                }                                                                                                   \
            }                                                                                                       \
            const __m256 valid = _mm256_cmp_ps(_mm256_set1_ps((float)nk), lane8, _CMP_GT_OQ);                     \
            for (int64_t j = 0; j < g; j++) { /* lane kk: key t0 + kk's dot, summed in hsum8's order */           \
                const __m256 sv = _mm256_mul_ps(RND(sum8x8(part[j])), vscale);                                      \
                _mm256_storeu_ps(sc + j * lp + t0, sv);                                                             \
                vmx[j] = _mm256_max_ps(vmx[j], _mm256_blendv_ps(ninf, sv, valid));                                  \
            }                                                                                                       \
        }                                                                                                           \
        for (int64_t j = 0; j < g; j++) SOFTMAX8(sc + j * lp, vmx[j], RND); /* p rounded as the dtype rounds it */  \
        pt = pb = 0, po = o0; /* the value rows: the first PF_AHEAD now, the rest along the first tile */          \
        for (; pt < L && pt < PF_AHEAD; pt++) prefetch_rows(v_cache, bt, bs, row, kv, d, &pb, &po);                 \
        /* P.V in tiles of 4 (then 1) 8-lane columns for all g heads, so that the accumulators stay in             \
         * registers (all of d at once for 3 heads would be 24): each value row read once a tile */               \
        int64_t i0 = 0;                                                                                             \
        for (; i0 + 4 <= nv; i0 += 4) PV_TILE8(T, LD, ST, 4);                                                       \
        for (; i0 < nv; i0++) PV_TILE8(T, LD, ST, 1);                                                               \
    }

/* A group of N rows of CACHE from key T0, the first n of them real: P[u] the rows (NULL past n), the block-table
 * cursor (BLK, OFF) moved past them; F[u] the next group's rows (NULL past L), which the group's arithmetic
 * prefetches. A statement inside ROWS8's body (its bt, bs, row, rb, o0, L). */
#define GROUP_ROWS(P, F, CACHE, N, T0, n, BLK, OFF)                                                                 \
    for (int64_t u_ = 0; u_ < (N); u_++) {                                                                          \
        P[u_] = u_ < (n) ? (CACHE) + (bt[BLK] * bs + (OFF)) * row : NULL;                                           \
        if (u_ < (n) && ++(OFF) == bs) (OFF) = 0, (BLK)++;                                                          \
        const int64_t t_ = (T0) + (N) + u_, f_ = o0 + t_;                                                           \
        F[u_] = t_ < L ? (const char *)(CACHE) + (bt[f_ / bs] * bs + f_ % bs) * rb : NULL;                          \
    }

#define ROWS_HQ 32 /* the most query heads a ROWS8 item takes (its vmx and hk arrays) */

/* One work item = one sequence, every KV head at once (ROWS8_CALL: hkv heads of g query heads each, uniform;
 * hk [hkv, g] their query heads): each key row and each value row is read once, whole, from its block in
 * address order, and the loads of the next group of rows are prefetched a piece at a time between the
 * current group's arithmetic (each (KV head, key) step fetches that head's d elements of the key one group
 * ahead; each value tile its 32 elements) -- not in bursts, which stall on the core's fill buffers. Per
 * head the arithmetic is ITEM8's op for op, in the same order (the P.V sums carried in `acc` between groups
 * of 16 value rows are float32 either way), so the outputs are ITEM8's bit for bit. Why every head's rows in
 * one stream, and what was measured against ITEM8's items: docs/notes/kernels.md, 2026-12-07 session 15. qf [hq, d]: the query heads widened to float32, in hk's order; sc [hq, lp];
 * acc [hq, d]. */
#define ROWS8(NAME, T, LD, ST, RND)                                                                                 \
    static inline __attribute__((always_inline)) void NAME(                                                        \
        const T *qb, const int64_t *hk, const int64_t g, const int64_t nv, const int64_t hkv, const T *k_cache,    \
        const T *v_cache, const int64_t *bt, int64_t bs, int64_t row, int64_t d, int64_t L, int64_t o0,            \
        int64_t lp, float *qf, float *sc, float *acc, float scale, float softcap, T *ob) {                         \
        const __m256 ninf = _mm256_set1_ps(-INFINITY), vscale = _mm256_set1_ps(scale);                             \
        const __m256 lane8 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);                                               \
        const int64_t rb = row * (int64_t)sizeof(T), db = d * (int64_t)sizeof(T);                                  \
        __m256 vmx[ROWS_HQ];                                                                                        \
        for (int64_t h = 0; h < hkv * g; h++) {                                                                     \
            vmx[h] = ninf;                                                                                          \
            for (int64_t i = 0; i < nv; i++) _mm256_storeu_ps(qf + h * d + i * 8, LD(qb + hk[h] * d + i * 8));    \
        }                                                                                                           \
        for (int64_t t0 = 0, kb = 0, ko = o0; t0 < L; t0 += 8) { /* scores, 8 keys a step */                      \
            const int64_t nk = L - t0 < 8 ? L - t0 : 8;                                                             \
            const T *kp[8];                                                                                         \
            const char *kf[8];                                                                                      \
            GROUP_ROWS(kp, kf, k_cache, 8, t0, nk, kb, ko);                                                         \
            const __m256 valid = _mm256_cmp_ps(_mm256_set1_ps((float)nk), lane8, _CMP_GT_OQ);                     \
            for (int64_t kv = 0; kv < hkv; kv++) {                                                                  \
                const float *qk = qf + kv * g * d;                                                                  \
                __m256 part[MAX_G][8];                                                                              \
                for (int64_t kk = 0; kk < 8; kk++) {                                                                \
                    if (kf[kk])                                                                                     \
                        for (int64_t o_ = 0; o_ < db; o_ += 64) _mm_prefetch(kf[kk] + kv * db + o_, _MM_HINT_T0);   \
                    __m256 kr[MAX_D / 8];                                                                           \
                    for (int64_t i = 0; i < nv; i++) kr[i] = kp[kk] ? LD(kp[kk] + kv * d + i * 8) : _mm256_setzero_ps(); \
                    for (int64_t j = 0; j < g; j++) {                                                               \
                        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qk + j * d), kr[0]);                               \
                        for (int64_t i = 1; i < nv; i++) a = _mm256_fmadd_ps(_mm256_loadu_ps(qk + j * d + i * 8), kr[i], a); \
                        part[j][kk] = a;                                                                            \
                    }                                                                                               \
                }                                                                                                   \
                for (int64_t j = 0; j < g; j++) {                                                                   \
                    const __m256 sv = _mm256_mul_ps(RND(sum8x8(part[j])), vscale);                                  \
                    _mm256_storeu_ps(sc + (kv * g + j) * lp + t0, sv);                                              \
                    vmx[kv * g + j] = _mm256_max_ps(vmx[kv * g + j], _mm256_blendv_ps(ninf, sv, valid));            \
                }                                                                                                   \
            }                                                                                                       \
        }                                                                                                           \
        for (int64_t h = 0; h < hkv * g; h++) SOFTMAX8(sc + h * lp, vmx[h], RND); /* as ITEM8's */                 \
        for (int64_t u0 = 0, vb = 0, vo = o0; u0 < L; u0 += 16) { /* P.V, 16 value rows a group */                \
            const int64_t nu = L - u0 < 16 ? L - u0 : 16;                                                           \
            const int last = u0 + 16 >= L;                                                                          \
            const T *vp[16];                                                                                        \
            const char *vf[16];                                                                                     \
            GROUP_ROWS(vp, vf, v_cache, 16, u0, nu, vb, vo);                                                        \
            for (int64_t kv = 0; kv < hkv; kv++) {                                                                  \
                const float *sk = sc + kv * g * lp + u0;                                                            \
                float *ak = acc + kv * g * d;                                                                       \
                const int64_t *hh = hk + kv * g;                                                                    \
                int64_t i0 = 0;                                                                                     \
                for (; i0 + 4 <= nv; i0 += 4) ROWS_TILE8(T, LD, ST, 4);                                             \
                for (; i0 < nv; i0++) ROWS_TILE8(T, LD, ST, 1);                                                     \
            }                                                                                                       \
        }                                                                                                           \
    }

/* ROWS8's P.V over one group of nu value rows for KV head kv's g heads, W 8-lane columns from i0 (each lane
 * the FMA chain of PV_TILE8 over the same keys in the same order): the sums carried in ak between groups (zero
 * before the first) and written to ob after the last; a tile of 4 columns prefetches its 32 elements of the
 * next group's rows. The g broadcasts are held and the value columns loaded one at a time, so that 3 heads x 4
 * columns of sums stay in AVX2's 16 registers. A statement inside ROWS8's body (its variables). */
#define ROWS_TILE8(T, LD, ST, W)                                                                                   \
    do {                                                                                                            \
        __m256 a[MAX_G][W];                                                                                         \
        for (int64_t j = 0; j < g; j++)                                                                             \
            for (int w = 0; w < W; w++)                                                                             \
                a[j][w] = u0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(ak + j * d + (i0 + w) * 8);              \
        for (int64_t u = 0; u < nu; u++) {                                                                          \
            if (W == 4 && vf[u])                                                                                    \
                for (int64_t o_ = 0; o_ < 32 * (int64_t)sizeof(T); o_ += 64)                                        \
                    _mm_prefetch(vf[u] + (kv * d + i0 * 8) * (int64_t)sizeof(T) + o_, _MM_HINT_T0);                \
            __m256 pu[MAX_G];                                                                                       \
            for (int64_t j = 0; j < g; j++) pu[j] = _mm256_set1_ps(sk[j * lp + u]);                                 \
            for (int w = 0; w < W; w++) {                                                                           \
                const __m256 vr = LD(vp[u] + kv * d + (i0 + w) * 8);                                                \
                for (int64_t j = 0; j < g; j++) a[j][w] = _mm256_fmadd_ps(pu[j], vr, a[j][w]);                      \
            }                                                                                                       \
        }                                                                                                           \
        for (int64_t j = 0; j < g; j++)                                                                             \
            for (int w = 0; w < W; w++) {                                                                           \
                if (last) ST(ob + hh[j] * d + (i0 + w) * 8, a[j][w]);                                               \
                else _mm256_storeu_ps(ak + j * d + (i0 + w) * 8, a[j][w]);                                          \
            }                                                                                                       \
    } while (0)


/* ROWS8 with g (1-4) and nv (8, 16) as constants (ROWS_CALL takes only those). */
#define ROWS8_CALL(FN, NVC)                                                                                         \
    switch (g) {                                                                                                    \
    case 1: FN(qb, hk, 1, NVC, hkv, k_cache, v_cache, bt, bs, row, d, L, o0, lp, qf, sc, acc, scale, softcap, ob); break; \
    case 2: FN(qb, hk, 2, NVC, hkv, k_cache, v_cache, bt, bs, row, d, L, o0, lp, qf, sc, acc, scale, softcap, ob); break; \
    case 3: FN(qb, hk, 3, NVC, hkv, k_cache, v_cache, bt, bs, row, d, L, o0, lp, qf, sc, acc, scale, softcap, ob); break; \
    case 4: FN(qb, hk, 4, NVC, hkv, k_cache, v_cache, bt, bs, row, d, L, o0, lp, qf, sc, acc, scale, softcap, ob); break; \
    }

/* ITEM8 with g (1-4) and nv (8, 16: heads of 64, 128) as constants where they are, else as variables. */
#define ITEM8_CALL(FN, NVC)                                                                                         \
    switch (g) {                                                                                                    \
    case 1: FN(qb, heads, 1, NVC, k_cache, v_cache, bt, bs, row, kv, d, L, o0, lp, sc, scale, softcap, ob); break; \
    case 2: FN(qb, heads, 2, NVC, k_cache, v_cache, bt, bs, row, kv, d, L, o0, lp, sc, scale, softcap, ob); break; \
    case 3: FN(qb, heads, 3, NVC, k_cache, v_cache, bt, bs, row, kv, d, L, o0, lp, sc, scale, softcap, ob); break; \
    case 4: FN(qb, heads, 4, NVC, k_cache, v_cache, bt, bs, row, kv, d, L, o0, lp, sc, scale, softcap, ob); break; \
    default: FN(qb, heads, g, NVC, k_cache, v_cache, bt, bs, row, kv, d, L, o0, lp, sc, scale, softcap, ob); break; \
    }

#define PAGED_DECODE8(NAME, ITEM, ROWS, T, PRO)                                                                           \
    int64_t NAME(T *q, int64_t q_stride, T *k, int64_t k_stride, const T *v, int64_t v_stride, const T *cos_t,     \
                 const T *sin_t, const int64_t *slots, const int64_t *block_tables, int64_t max_blocks,             \
                 const int64_t *lens, T *k_cache, T *v_cache, int64_t num_blocks, int64_t bs,                       \
                 const int64_t *q_to_kv, int64_t hq, int64_t hkv, int64_t d, float scale, T *out, int64_t B,        \
                 int64_t amx_min_batch, int nthreads, int64_t window, float softcap) {                             \
        const int64_t gmax = max_group(q_to_kv, hq, hkv);                                                          \
        const int64_t bad = check(slots, block_tables, max_blocks, lens, B, num_blocks, bs, q_to_kv, hq, hkv, gmax, \
                                  window);                                                                          \
        if (bad >= 0) return bad;                                                                                   \
        const int64_t row = hkv * d, nv = d / 8;                                                                   \
        (void)amx_min_batch; /* no AMX path here */                                                                \
        PRO(q, q_stride, k, k_stride, v, v_stride, cos_t, sin_t, slots, k_cache, v_cache, hq, hkv, d, B);          \
        int64_t work = 0;                                                                                           \
        for (int64_t b = 0; b < B; b++) work += lens[b] - win_lo(lens[b], window);                                  \
        /* many sequences (B >= 4 threads), every KV head with the same 1-4 query heads, heads of 64 or 128: one   \
         * item per sequence (ROWS8, its rows read whole); else one per (sequence, KV head) (ITEM8) */             \
        int64_t hk[ROWS_HQ];                                                                                        \
        const int64_t gu = hkv > 0 ? hq / hkv : 0;                                                                 \
        int whole = B >= 4 * nthreads && hq <= ROWS_HQ && gu >= 1 && gu <= 4 && gu * hkv == hq && (nv == 8 || nv == 16); \
        /* (each KV head's heads written at kv * gu: while every one before had gu, this one's fit below hq) */       \
        for (int64_t kv = 0; whole && kv < hkv; kv++) whole = kv_heads(q_to_kv, hq, kv, hk + kv * gu) == gu;        \
        if (whole) {                                                                                                \
            _Pragma("omp parallel num_threads(nthreads) if (work * hq * d >= 32768)") {                           \
                float *buf = NULL; /* qf [hq, d], acc [hq, d], then sc [hq, lp] */                                  \
                int64_t cap = 0;                                                                                    \
                _Pragma("omp for schedule(dynamic, 1)")                                                             \
                for (int64_t b = 0; b < B; b++) {                                                                   \
                    const int64_t lo = win_lo(lens[b], window), o0 = lo % bs, L = lens[b] - lo;                     \
                    const int64_t lp = (L + 7) / 8 * 8, g = gu;                                                     \
                    T *ob = out + b * hq * d;                                                                       \
                    if (L == 0) {                                                                                   \
                        memset(ob, 0, (size_t)(hq * d) * sizeof(T));                                               \
                        continue;                                                                                   \
                    }                                                                                               \
                    if (2 * hq * d + hq * lp > cap) {                                                               \
                        free(buf);                                                                                  \
                        cap = 2 * hq * d + hq * lp + 1024;                                                          \
                        buf = (float *)malloc((size_t)cap * sizeof(float));                                         \
                    }                                                                                               \
                    float *qf = buf, *acc = buf + hq * d, *sc = buf + 2 * hq * d;                                   \
                    const int64_t *bt = block_tables + b * max_blocks + lo / bs;                                    \
                    const T *qb = q + b * q_stride;                                                                 \
                    if (nv == 8) {                                                                                  \
                        ROWS8_CALL(ROWS, 8)                                                                         \
                    } else {                                                                                        \
                        ROWS8_CALL(ROWS, 16)                                                                        \
                    }                                                                                               \
                }                                                                                                   \
                free(buf);                                                                                          \
            }                                                                                                       \
            return -1;                                                                                              \
        }                                                                                                           \
        _Pragma("omp parallel num_threads(nthreads) if (work * hq * d >= 32768)") {                               \
            float *sc = NULL; /* the scores, then the probabilities: [g, lp] */                                     \
            int64_t cap = 0;                                                                                        \
            _Pragma("omp for schedule(dynamic, 1)")                                                                 \
            for (int64_t it = 0; it < B * hkv; it++) {                                                              \
                /* the keys attended: lo .. lens[b] - 1, from offset o0 of the block-table entry bt[0] */          \
                const int64_t b = it / hkv, kv = it % hkv, lo = win_lo(lens[b], window), o0 = lo % bs;              \
                const int64_t L = lens[b] - lo, lp = (L + 7) / 8 * 8;                                               \
                int64_t heads[MAX_G];                                                                              \
                const int64_t g = kv_heads(q_to_kv, hq, kv, heads);                                                \
                if (g == 0) continue;                                                                               \
                T *ob = out + b * hq * d;                                                                           \
                if (L == 0) {                                                                                       \
                    for (int64_t j = 0; j < g; j++) memset(ob + heads[j] * d, 0, (size_t)d * sizeof(T));            \
                    continue;                                                                                       \
                }                                                                                                   \
                if (g * lp > cap) {                                                                                 \
                    free(sc);                                                                                       \
                    cap = g * lp + 256;                                                                             \
                    sc = (float *)malloc((size_t)cap * sizeof(float));                                              \
                }                                                                                                   \
                const int64_t *bt = block_tables + b * max_blocks + lo / bs;                                        \
                const T *qb = q + b * q_stride;                                                                     \
                if (nv == 8) {                                                                                      \
                    ITEM8_CALL(ITEM, 8)                                                                             \
                } else if (nv == 16) {                                                                              \
                    ITEM8_CALL(ITEM, 16)                                                                            \
                } else {                                                                                            \
                    ITEM(qb, heads, g, nv, k_cache, v_cache, bt, bs, row, kv, d, L, o0, lp, sc, scale, softcap, ob); \
                }                                                                                                   \
            }                                                                                                       \
            free(sc);                                                                                               \
        }                                                                                                           \
        return -1;                                                                                                  \
    }

static inline void st8_f32(float *p, __m256 x) { _mm256_storeu_ps(p, x); }

ITEM8(item8_f32, float, _mm256_loadu_ps, st8_f32, keep8)
ITEM8(item8_bf16, uint16_t, ld8, st8, rb8)
ROWS8(rows8_f32, float, _mm256_loadu_ps, st8_f32, keep8)
ROWS8(rows8_bf16, uint16_t, ld8, st8, rb8)
PAGED_DECODE8(tpe_paged_decode_f32, item8_f32, rows8_f32, float, prologue_f32)
PAGED_DECODE8(tpe_paged_decode_bf16, item8_bf16, rows8_bf16, uint16_t, prologue_bf16)
#endif /* neither path: left out of the build; the callers keep torch (cpu_library.has) */
