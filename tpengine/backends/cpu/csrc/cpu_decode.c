/* Decode attention over contiguous bfloat16 K/V on CPU: the two matmuls of one query token per
 * sequence, as tpengine.backends.reference computes them with torch.bmm (scores rounded to
 * bfloat16, then scaled in float32; p @ V accumulated in float32, rounded to bfloat16), but
 * without oneDNN's per-matrix overhead: torch.bmm on [B*Hkv] small matrices (a few query heads
 * against a few hundred keys) reads K well below the rate a plain read streams at (figures:
 * docs/notes/kernels.md, docs/notes/cpu-paths.md). Built and loaded at run time by
 * tpengine/backends/cpu/cpu_decode.py (cc -O3 -march=native -fopenmp); OpenMP threads come from the
 * libgomp torch has already loaded.
 *
 * Layout: q [N, G, D], k and v [N, cap, D] (N = B * Hkv rows; row n belongs to sequence n / hkv),
 * scores and p [N, G, cap], out [N, G, D]; lens [B] int64 (keys visible to each sequence; a
 * length-0 padding row sees key 0, as the torch path does). bfloat16 is passed as uint16.
 * The AVX512-BF16 path (dpbf16 dot products) needs D % 32 == 0 for the
 * scores and D % 16 == 0 for p @ V; G <= 8, D <= 256 always (checked by the caller). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

static inline int visible(int64_t len) { return len > 0 ? (int)len : 1; }

#ifdef TPE_AVX512
#include <immintrin.h>
#define TPE_FAST 1

/* Prefetch the key/value row PF rows ahead, continuing into the next row of the batch once this
 * one's visible keys end: the hardware prefetcher restarts at every sequence (each skips its masked
 * tail), which cuts the read rate at the short contexts of decode. 96 rows (12 KB) ahead: the best of
 * the distances measured (docs/notes/kernels.md). Prefetches never fault. */
#define PF 96
static inline void prefetch_row(const uint16_t *cur, const uint16_t *next, int t, int L, int d) {
    const char *a = (const char *)(t + PF < L ? cur + (int64_t)(t + PF) * d : next + (int64_t)(t + PF - L) * d);
    for (int off = 0; off < d * 2; off += 64) /* asm: gcc 12 dropped _mm_prefetch here */
        __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)(a + off)));
}

static inline __attribute__((always_inline)) void scores_impl(const uint16_t *qn, const uint16_t *kn,
                                                              const uint16_t *knext, float *sn, int L, const int g,
                                                              int64_t cap, const int d, float scale) {
    const int nc = d / 32;
    __m512bh qv[8][8];
    for (int j = 0; j < g; j++)
        for (int c = 0; c < nc; c++) qv[j][c] = (__m512bh)_mm512_loadu_si512(qn + j * d + 32 * c);
    for (int t = 0; t < L; t++) { /* float32 dot products, one horizontal sum each */
        const uint16_t *kt = kn + t * d;
        prefetch_row(kn, knext, t, L, d);
        __m512bh kv[8];
        for (int c = 0; c < nc; c++) kv[c] = (__m512bh)_mm512_loadu_si512(kt + 32 * c);
        for (int j = 0; j < g; j++) {
            __m512 a = _mm512_setzero_ps();
            for (int c = 0; c < nc; c++) a = _mm512_dpbf16_ps(a, qv[j][c], kv[c]);
            sn[j * cap + t] = _mm512_reduce_add_ps(a);
        }
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int j = 0; j < g; j++) /* then rounded to bfloat16 and scaled, 16 at a time, in L1 */
        for (int t = 0; t < L; t += 16) {
            const __mmask16 m = L - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (L - t)) - 1);
            __m512 x = _mm512_maskz_loadu_ps(m, sn + j * cap + t);
            _mm512_mask_storeu_ps(sn + j * cap + t, m, _mm512_mul_ps(rb(x), vscale));
        }
}

static inline __attribute__((always_inline)) void pv_impl(const uint16_t *pn, const uint16_t *vn,
                                                          const uint16_t *vnext, uint16_t *on, int L, const int g,
                                                          int64_t cap, const int d) {
    const int nc = d / 16;
    __m512 acc[8][16];
    for (int j = 0; j < g; j++)
        for (int c = 0; c < nc; c++) acc[j][c] = _mm512_setzero_ps();
    for (int t = 0; t < L; t++) {
        const uint16_t *vt = vn + t * d;
        prefetch_row(vn, vnext, t, L, d);
        __m512 vf[16];
        for (int c = 0; c < nc; c++)
            vf[c] = ld(vt + 16 * c);
        for (int j = 0; j < g; j++) {
            const __m512 pj = _mm512_set1_ps(bf2f(pn[j * cap + t]));
            for (int c = 0; c < nc; c++) acc[j][c] = _mm512_fmadd_ps(pj, vf[c], acc[j][c]);
        }
    }
    float tmp[16];
    for (int j = 0; j < g; j++)
        for (int c = 0; c < nc; c++) {
            _mm512_storeu_ps(tmp, acc[j][c]);
            for (int i = 0; i < 16; i++) on[j * d + 16 * c + i] = f2bf(tmp[i]);
        }
}

/* Specialised copies for the common (G, D), so the accumulators stay in registers. */
#define TPE_CASES(X) X(1, 64) X(2, 64) X(3, 64) X(4, 64) X(5, 64) X(6, 64) X(7, 64) X(8, 64) \
    X(1, 128) X(2, 128) X(3, 128) X(4, 128) X(5, 128) X(6, 128) X(7, 128) X(8, 128)
#define TPE_S(G, D)                                                                                     \
    static void scores_##G##_##D(const uint16_t *qn, const uint16_t *kn, const uint16_t *knext, float *sn, int L, \
                                 int64_t cap, float scale) { scores_impl(qn, kn, knext, sn, L, G, cap, D, scale); }
#define TPE_P(G, D)                                                                                     \
    static void pv_##G##_##D(const uint16_t *pn, const uint16_t *vn, const uint16_t *vnext, uint16_t *on, int L, \
                             int64_t cap) { pv_impl(pn, vn, vnext, on, L, G, cap, D); }
TPE_CASES(TPE_S)
TPE_CASES(TPE_P)

static void scores_row_fast(const uint16_t *qn, const uint16_t *kn, const uint16_t *knext, float *sn, int L, int g,
                            int64_t cap, int d, float scale) {
#define TPE_SC(G, D) \
    if (g == G && d == D) return scores_##G##_##D(qn, kn, knext, sn, L, cap, scale);
    TPE_CASES(TPE_SC)
    scores_impl(qn, kn, knext, sn, L, g, cap, d, scale);
}

static void pv_row_fast(const uint16_t *pn, const uint16_t *vn, const uint16_t *vnext, uint16_t *on, int L, int g,
                        int64_t cap, int d) {
#define TPE_PC(G, D) \
    if (g == G && d == D) return pv_##G##_##D(pn, vn, vnext, on, L, cap);
    TPE_CASES(TPE_PC)
    pv_impl(pn, vn, vnext, on, L, g, cap, d);
}
#endif

/* The vector path the library was built with (bf16.h; cpu_library.isa()): "avx512bf16" (with "+amx"
 * when the paged kernel's AMX tiles were compiled in; they still check the CPU and OS at run time,
 * tpe_paged_amx), "avx2" (AVX2 + FMA), or "generic" (portable C only: most kernels left out). */
const char *tpe_isa(void) {
#if defined(TPE_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
    return "avx512bf16+amx";
#elif defined(TPE_AVX512)
    return "avx512bf16";
#elif defined(TPE_AVX2)
    return "avx2";
#else
    return "generic";
#endif
}

#ifdef TPE_FAST /* only the AVX512-BF16 path beats torch.bmm: without it both are left out (cpu_library.has) */
/* The first b with lens[b] outside [0, cap], or -1: checked before any key is read. */
static int64_t bad_len(const int64_t *lens, int64_t n_rows, int64_t hkv, int64_t cap) {
    for (int64_t b = 0; b < n_rows / hkv; b++)
        if (lens[b] < 0 || lens[b] > cap) return b;
    return -1;
}

/* scores[n, j, t] = float(bf16(q[n, j] . k[n, t])) * scale for t < visible(lens[n / hkv]), -inf after.
 * Returns -1, or the first sequence b whose lens[b] is outside [0, cap] (then nothing is written). */
int64_t tpe_decode_scores(const uint16_t *q, const uint16_t *k, const int64_t *lens, float *scores, int64_t n_rows,
                          int64_t hkv, int g, int64_t cap, int d, float scale, int nthreads) {
    const int64_t bad = bad_len(lens, n_rows, hkv, cap);
    if (bad >= 0) return bad;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < n_rows; n++) {
        const int L = visible(lens[n / hkv]);
        const uint16_t *qn = q + n * g * d, *kn = k + n * cap * d;
        float *sn = scores + n * g * cap;
#ifdef TPE_FAST
        if (d % 32 == 0) {
            scores_row_fast(qn, kn, kn + cap * d, sn, L, g, cap, d, scale);
        } else
#endif
        {
            float qf[8 * 256], kf[256];
            for (int i = 0; i < g * d; i++) qf[i] = bf2f(qn[i]);
            for (int t = 0; t < L; t++) {
                for (int i = 0; i < d; i++) kf[i] = bf2f(kn[t * d + i]);
                for (int j = 0; j < g; j++) {
                    float acc = 0.f;
                    for (int i = 0; i < d; i++) acc += qf[j * d + i] * kf[i];
                    sn[j * cap + t] = bf2f(f2bf(acc)) * scale;
                }
            }
        }
        for (int j = 0; j < g; j++)
            for (int64_t t = L; t < cap; t++) sn[j * cap + t] = -INFINITY;
    }
    return -1;
}

/* out[n, j] = bf16(sum over t < visible(lens[n / hkv]) of p[n, j, t] * v[n, t]), float32 accumulation.
 * Returns -1, or the first sequence b whose lens[b] is outside [0, cap] (then nothing is written). */
int64_t tpe_decode_pv(const uint16_t *p, const uint16_t *v, const int64_t *lens, uint16_t *out, int64_t n_rows,
                      int64_t hkv, int g, int64_t cap, int d, int nthreads) {
    const int64_t bad = bad_len(lens, n_rows, hkv, cap);
    if (bad >= 0) return bad;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < n_rows; n++) {
        const int L = visible(lens[n / hkv]);
        const uint16_t *pn = p + n * g * cap, *vn = v + n * cap * d;
        uint16_t *on = out + n * g * d;
#ifdef TPE_FAST
        if (d % 16 == 0) {
            pv_row_fast(pn, vn, vn + cap * d, on, L, g, cap, d);
            continue;
        }
#endif
        float acc[8 * 256];
        for (int i = 0; i < g * d; i++) acc[i] = 0.f;
        for (int t = 0; t < L; t++)
            for (int j = 0; j < g; j++) {
                const float pj = bf2f(pn[j * cap + t]);
                for (int i = 0; i < d; i++) acc[j * d + i] += pj * bf2f(vn[t * d + i]);
            }
        for (int i = 0; i < g * d; i++) on[i] = f2bf(acc[i]);
    }
    return -1;
}
#endif
