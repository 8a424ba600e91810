/* bfloat16 <-> float32 helpers (and a float32 exp) shared by the C kernels (bfloat16 is passed as uint16).
 * Rounding is to nearest even, as torch rounds; a NaN stays a (quiet) NaN. */
#ifndef TPE_BF16_H
#define TPE_BF16_H
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

#if defined(__AVX512BF16__) && defined(__AVX512F__)
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
#endif
#endif
