/* bfloat16 <-> float32 helpers (and a float32 exp) shared by the C kernels (bfloat16 is passed as uint16).
 * Rounding is to nearest even, as torch rounds; a NaN stays a (quiet) NaN. */
#ifndef TPE_BF16_H
#define TPE_BF16_H
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf2f(uint16_t x) { uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t f2bf(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* The vector path each kernel compiles, from the compiler's target macros (-march=native, or
 * -march=x86-64-v3 under TPENGINE_ISA=avx2; cpu_library.py): TPE_AVX512 (AVX-512F + AVX512-BF16,
 * 16 float32 lanes) or else TPE_AVX2 (AVX2 + FMA, 8 lanes; bfloat16 is widened to float32 in registers
 * and rounded back to nearest even, the same arithmetic as the AVX-512 path up to the order of
 * sums). A kernel with neither path is left out of the build, and Python sees it missing
 * (cpu_library.has). tpe_isa() (cpu_decode.c) names the path. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define TPE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define TPE_AVX2 1
#endif

#ifdef TPE_AVX512
#include <immintrin.h>

static inline __m512 ld(const uint16_t *p) { /* 16 bfloat16 -> float32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512i rne(__m512 x) { /* float32 -> bfloat16 bits (low half of each lane), to nearest even */
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
}

static inline void st(uint16_t *p, __m512 x) { _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(rne(x))); }

/* bfloat16(x) back as float32, 16 lanes */
static inline __m512 rb(__m512 x) { return _mm512_castsi512_ps(_mm512_slli_epi32(rne(x), 16)); }

/* exp(x), float32: x = n ln2 + r, |r| <= ln2 / 2, e^r by the Cephes expf polynomial, times 2^n
 * (scalef: overflow to inf, underflow to 0). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(104.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

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
#endif

#ifdef TPE_AVX2
#include <immintrin.h>

static inline __m256 ld8(const uint16_t *p) { /* 8 bfloat16 -> float32 */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline __m256i rne8(__m256 x) { /* float32 -> bfloat16 bits (low half of each lane), to nearest even */
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)); /* NaN: quiet */
    return _mm256_blendv_epi8(r, q, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

static inline void st8(uint16_t *p, __m256 x) { /* 8 float32 -> bfloat16, rounded to nearest even */
    const __m256i r = rne8(x); /* each lane in 0..0xffff: the unsigned saturating pack keeps it */
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

/* bfloat16(x) back as float32, 8 lanes */
static inline __m256 rb8(__m256 x) { return _mm256_castsi256_ps(_mm256_slli_epi32(rne8(x), 16)); }

/* The sum of the 8 lanes: (l0 + l4) + (l2 + l6) ... pairwise, one fixed order. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* _mm512_reduce_add_ps of the 16 lanes lo[0..7], hi[0..7] (GCC's association: halves, quarters,
 * pairs), so a sum kept as two 8-lane halves of the AVX-512 path's 16 lanes equals its sum bit for bit. */
static inline float hsum16(__m256 lo, __m256 hi) { return hsum8(_mm256_add_ps(hi, lo)); }

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x), float32, 8 lanes: exp16's reduction and polynomial; 2^n (n in [-150, 150]) is applied as
 * two factors 2^(n/2) and 2^(n - n/2), each a normal float32, so the product overflows to inf and
 * underflows to 0 as scalef does. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.f)), _mm256_set1_ps(104.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23)));
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23)));
}

/* The 8 sums of a[0..7]'s lanes, lane kk = hsum8(a[kk]) bit for bit (the same association: halves,
 * then (0 + 2) + (1 + 3)), by a transpose-and-add tree: 21 instructions for the 8 sums. */
static inline __m256 sum8x8(const __m256 *a) {
    __m256 v[4];
    for (int kk = 0; kk < 4; kk++) /* [lo(a[kk]) + hi(a[kk]) | lo(a[kk + 4]) + hi(a[kk + 4])] */
        v[kk] = _mm256_add_ps(_mm256_permute2f128_ps(a[kk], a[kk + 4], 0x20), _mm256_permute2f128_ps(a[kk], a[kk + 4], 0x31));
    const __m256 p = _mm256_add_ps(_mm256_unpacklo_ps(v[0], v[1]), _mm256_unpackhi_ps(v[0], v[1]));
    const __m256 q = _mm256_add_ps(_mm256_unpacklo_ps(v[2], v[3]), _mm256_unpackhi_ps(v[2], v[3]));
    return _mm256_add_ps(_mm256_shuffle_ps(p, q, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(p, q, _MM_SHUFFLE(3, 2, 3, 2)));
}
#endif

/* The vector-width layer: `vf`, 16 float32 lanes, the width every kernel written once over it steps by.
 * On the AVX-512 path a vf is one __m512 and each op below is the one intrinsic the per-ISA copies
 * used; on the AVX2 path it is two __m256 halves (lanes 0-7, 8-15), each op applied to both. The
 * element-wise ops round exactly as the 16-lane ones do (ld8 / st8 / rb8 / exp8 equal ld / st / rb /
 * exp16 lane for lane), and vf_sum reduces the 16 lanes in _mm512_reduce_add_ps's order (hsum16), so
 * a kernel written over vf computes on the AVX2 build, bit for bit, what it computes on the AVX-512
 * build. Ops: vf_zero, vf_set1(f), vf_ldf / vf_stf (16 float32), vf_ldb / vf_stb (16 bfloat16, stored
 * rounded to nearest even), vf_rb (rounded to bfloat16, back as float32), vf_add / vf_sub / vf_mul /
 * vf_div / vf_max, vf_fmadd(a, b, c) = a * b + c (one rounding), vf_neg, vf_exp (exp16), vf_sum,
 * vf_hmax; on partial vectors: vf_ldb_n / vf_stb_n (the first n < 16 lanes; the others load as 0, are
 * not stored), vf_first(x, n, fill) (the lanes from n on replaced by fill), vf_nan (1 if a lane is
 * NaN), vf_abs, vf_select_lt(a, b, x, y) (x in the lanes where a < b, else y); vf_keep(x): x, behind an opaque barrier, so that the compiler cannot contract a float32
 * product and the sum after it into one fused multiply-add where torch rounds the product first;
 * vf_same(x): x (a float32 kernel's "round to the dtype"). */
#if defined(TPE_AVX512)
typedef __m512 vf;
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float f) { return _mm512_set1_ps(f); }
static inline vf vf_ldf(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_stf(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf vf_ldb(const uint16_t *p) { return ld(p); }
static inline void vf_stb(uint16_t *p, vf x) { st(p, x); }
static inline vf vf_rb(vf x) { return rb(x); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_neg(vf x) { return _mm512_xor_ps(x, _mm512_set1_ps(-0.f)); }
static inline vf vf_exp(vf x) { return exp16(x); }
static inline float vf_sum(vf x) { return _mm512_reduce_add_ps(x); }
static inline float vf_hmax(vf x) { return _mm512_reduce_max_ps(x); }
static inline __mmask16 vf_mask(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }
static inline vf vf_ldb_n(const uint16_t *p, int64_t n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(vf_mask(n), p)), 16));
}
static inline void vf_stb_n(uint16_t *p, vf x, int64_t n) { _mm256_mask_storeu_epi16(p, vf_mask(n), _mm512_cvtepi32_epi16(rne(x))); }
static inline vf vf_first(vf x, int64_t n, vf fill) { return _mm512_mask_blend_ps(vf_mask(n), fill, x); }
static inline vf vf_abs(vf x) { return _mm512_abs_ps(x); }
static inline vf vf_select_lt(vf a, vf b, vf x, vf y) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), y, x); }
static inline int vf_nan(vf x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) != 0; }
static inline vf vf_keep(vf x) {
    __asm__("" : "+v"(x));
    return x;
}
#elif defined(TPE_AVX2)
typedef struct { __m256 lo, hi; } vf;
static inline vf vf_two(__m256 lo, __m256 hi) { vf r = {lo, hi}; return r; }
static inline vf vf_zero(void) { return vf_two(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline vf vf_set1(float f) { return vf_two(_mm256_set1_ps(f), _mm256_set1_ps(f)); }
static inline vf vf_ldf(const float *p) { return vf_two(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void vf_stf(float *p, vf x) { _mm256_storeu_ps(p, x.lo), _mm256_storeu_ps(p + 8, x.hi); }
static inline vf vf_ldb(const uint16_t *p) { return vf_two(ld8(p), ld8(p + 8)); }
static inline void vf_stb(uint16_t *p, vf x) { st8(p, x.lo), st8(p + 8, x.hi); }
static inline vf vf_rb(vf x) { return vf_two(rb8(x.lo), rb8(x.hi)); }
static inline vf vf_add(vf a, vf b) { return vf_two(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
static inline vf vf_sub(vf a, vf b) { return vf_two(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
static inline vf vf_mul(vf a, vf b) { return vf_two(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
static inline vf vf_div(vf a, vf b) { return vf_two(_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)); }
static inline vf vf_max(vf a, vf b) { return vf_two(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }
static inline vf vf_fmadd(vf a, vf b, vf c) {
    return vf_two(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline vf vf_neg(vf x) { return vf_two(_mm256_xor_ps(x.lo, _mm256_set1_ps(-0.f)), _mm256_xor_ps(x.hi, _mm256_set1_ps(-0.f))); }
static inline vf vf_exp(vf x) { return vf_two(exp8(x.lo), exp8(x.hi)); }
static inline float vf_sum(vf x) { return hsum16(x.lo, x.hi); }
static inline float vf_hmax(vf x) { return hmax8(_mm256_max_ps(x.lo, x.hi)); }
/* AVX2 has no masked 16-bit loads or stores: a partial one (n < 16) goes through a 16-element copy. */
static inline vf vf_ldb_n(const uint16_t *p, int64_t n) {
    if (n >= 16) return vf_ldb(p);
    uint16_t t[16] = {0};
    memcpy(t, p, (size_t)n * sizeof(uint16_t));
    return vf_ldb(t);
}
static inline void vf_stb_n(uint16_t *p, vf x, int64_t n) {
    if (n >= 16) {
        vf_stb(p, x);
        return;
    }
    uint16_t t[16];
    vf_stb(t, x);
    memcpy(p, t, (size_t)n * sizeof(uint16_t));
}
static inline vf vf_first(vf x, int64_t n, vf fill) {
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), nf = _mm256_set1_ps((float)(n < 16 ? n : 16));
    return vf_two(_mm256_blendv_ps(fill.lo, x.lo, _mm256_cmp_ps(nf, lane, _CMP_GT_OQ)),
                  _mm256_blendv_ps(fill.hi, x.hi, _mm256_cmp_ps(_mm256_sub_ps(nf, _mm256_set1_ps(8.f)), lane, _CMP_GT_OQ)));
}
static inline vf vf_abs(vf x) {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    return vf_two(_mm256_and_ps(x.lo, m), _mm256_and_ps(x.hi, m));
}
static inline vf vf_select_lt(vf a, vf b, vf x, vf y) {
    return vf_two(_mm256_blendv_ps(y.lo, x.lo, _mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ)),
                  _mm256_blendv_ps(y.hi, x.hi, _mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ)));
}
static inline int vf_nan(vf x) {
    return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(x.lo, x.lo, _CMP_UNORD_Q), _mm256_cmp_ps(x.hi, x.hi, _CMP_UNORD_Q))) != 0;
}
static inline vf vf_keep(vf x) {
    __asm__("" : "+x"(x.lo), "+x"(x.hi));
    return x;
}
#endif

#if defined(TPE_AVX512) || defined(TPE_AVX2)
static inline vf vf_same(vf x) { return x; } /* float32's "rounding to the dtype" */

/* RoPE (HF's formula) in place on one head x of 2 * half elements, cos / sin c, s [2 * half], half % 16
 * == 0: x1, x2 = the halves; x1' = R(x1 c1) + R(-x2 s1), x2' = R(x2 c2) + R(x1 s2), each product
 * rounded to the dtype (R), the sum rounded as it is stored. bfloat16 (tpe_rope, the paged kernel) and
 * float32 (the paged kernel; R: vf_keep, float32 products not fused into the sum). */
static inline void rope_head_bf16(uint16_t *x, const uint16_t *c, const uint16_t *s, int64_t half) {
    for (int64_t i = 0; i < half; i += 16) {
        const vf x1 = vf_ldb(x + i), x2 = vf_ldb(x + half + i);
        vf_stb(x + i, vf_add(vf_rb(vf_mul(x1, vf_ldb(c + i))), vf_rb(vf_mul(vf_neg(x2), vf_ldb(s + i)))));
        vf_stb(x + half + i, vf_add(vf_rb(vf_mul(x2, vf_ldb(c + half + i))), vf_rb(vf_mul(x1, vf_ldb(s + half + i)))));
    }
}
/* tanh(x), float32, as Cephes' tanhf: x + x^3 P(x^2) for |x| < 0.625, else 1 - 2 / (exp(2|x|) + 1) with
 * x's sign (exp by exp16 / exp8), and exactly +-1 for |x| > 8.664339742 as SLEEF's tanhf (torch's vectorized
 * tanh) returns there. Within a few ulps of torch's tanh. */
static inline vf vf_tanh(vf x) {
    const vf a = vf_abs(x), z = vf_mul(x, x), one = vf_set1(1.f);
    vf p = vf_set1(-5.70498872745E-3f);
    p = vf_fmadd(p, z, vf_set1(2.06390887954E-2f));
    p = vf_fmadd(p, z, vf_set1(-5.37397155531E-2f));
    p = vf_fmadd(p, z, vf_set1(1.33314422036E-1f));
    p = vf_fmadd(p, z, vf_set1(-3.33332819422E-1f));
    const vf small = vf_fmadd(vf_mul(p, z), x, x);
    const vf big = vf_select_lt(vf_set1(8.664339742f), a, one, /* (NaN: the formula's NaN) */
                                vf_sub(one, vf_div(vf_set1(2.f), vf_add(vf_exp(vf_add(a, a)), one))));
    return vf_select_lt(a, vf_set1(0.625f), small, vf_select_lt(x, vf_zero(), vf_neg(big), big));
}

/* Attention-logit soft-capping of n float32 scores in place, s = tanh(s / cap) * cap (divide, tanh,
 * multiply, as torch computes it; Gemma 2's attn_logit_softcapping); returns the largest capped score. */
static inline float cap_scores(float *s, int64_t n, float cap) {
    const vf c = vf_set1(cap);
    vf mx = vf_set1(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
        const vf x = vf_mul(vf_tanh(vf_div(vf_ldf(s + t), c)), c);
        vf_stf(s + t, x);
        mx = vf_max(mx, x);
    }
    if (t < n) { /* the tail through a 16-float copy */
        float tail[16] = {0};
        memcpy(tail, s + t, (size_t)(n - t) * sizeof(float));
        const vf x = vf_mul(vf_tanh(vf_div(vf_ldf(tail), c)), c);
        vf_stf(tail, x);
        memcpy(s + t, tail, (size_t)(n - t) * sizeof(float));
        mx = vf_max(mx, vf_first(x, n - t, vf_set1(-INFINITY)));
    }
    return vf_hmax(mx);
}

static inline void rope_head_f32(float *x, const float *c, const float *s, int64_t half) {
    for (int64_t i = 0; i < half; i += 16) {
        const vf x1 = vf_ldf(x + i), x2 = vf_ldf(x + half + i);
        vf_stf(x + i, vf_add(vf_keep(vf_mul(x1, vf_ldf(c + i))), vf_keep(vf_mul(vf_neg(x2), vf_ldf(s + i)))));
        vf_stf(x + half + i, vf_add(vf_keep(vf_mul(x2, vf_ldf(c + half + i))), vf_keep(vf_mul(x1, vf_ldf(s + half + i)))));
    }
}
#endif
#endif
