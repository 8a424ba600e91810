/* Fused bfloat16 element-wise kernels for the CPU decoder layer: residual add + RMSNorm, RoPE,
 * SiLU(gate) * up, the causal softmax of bfloat16 prefill attention (and exact row copies for
 * the KV cache). Each replaces a chain of torch ops that, in bfloat16 on CPU, costs one dispatch
 * and one pass over memory per op; each keeps the chain's roundings, op by op:
 *
 *   add_rms_norm: h' = bf16(h + x); y = bf16(w * bf16(h' * rsqrt(mean(h'^2) + eps)))   (fp32 inside)
 *   rope:         out = bf16(bf16(q * cos) + bf16(rotate_half(q) * sin))               (HF's formula)
 *   silu_mul:     out = bf16(bf16(g / (1 + exp(-g))) * u)                              (torch's SiLU)
 *   causal_softmax: p = bf16(softmax(bf16(s * scale) + causal -inf mask)), float32 inside
 *
 * so they equal the torch ops up to the order of the float32 sum of squares and the last bit of
 * exp (torch uses SLEEF's; this a Cephes-style polynomial) before the bfloat16 rounding. Loaded
 * with cpu_decode.c by tpengine/backends/cpu/cpu_library.py, which registers them as torch ops and checks
 * shapes: row length % 16 == 0, head size % 32 == 0. Compiled for AVX512-BF16 or AVX2 + FMA (bf16.h);
 * with neither, only tpe_copy_rows is built and the callers keep torch's ops for the rest. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* Row copies: dst_a[dst_index[i]] = src_a[src_index ? src_index[i] : i], and the same from src_b to
 * dst_b, rows of row_bytes bytes, source rows src_stride bytes apart (any dtype). One call for the
 * K and V cache writes of a step (two index_copy_ in torch), one for the KV mirror's appends (two
 * index_select + two index_copy_). Every index is checked first (dst_index in [0, dst_rows),
 * src_index in [0, src_rows)) and nothing is copied if one is out of range: returns -1 when all
 * are in range, else i for a bad dst_index[i] or n + i for a bad src_index[i] (the first one). */
int64_t tpe_copy_rows(const char *src_a, const char *src_b, int64_t src_stride, const int64_t *src_index,
                      int64_t src_rows, char *dst_a, char *dst_b, const int64_t *dst_index, int64_t dst_rows,
                      int64_t n, int64_t row_bytes, int nthreads) {
    for (int64_t i = 0; i < n; i++)
        if ((uint64_t)dst_index[i] >= (uint64_t)dst_rows) return i;
    if (src_index)
        for (int64_t i = 0; i < n; i++)
            if ((uint64_t)src_index[i] >= (uint64_t)src_rows) return n + i;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (n * row_bytes >= (1 << 20))
    for (int64_t i = 0; i < n; i++) {
        const int64_t s = (src_index ? src_index[i] : i) * src_stride, d = dst_index[i] * row_bytes;
        memcpy(dst_a + d, src_a + s, (size_t)row_bytes);
        memcpy(dst_b + d, src_b + s, (size_t)row_bytes);
    }
    return -1;
}

#ifdef TPE_AVX512

/* h, x, h_out, y: [rows, n]; w: [n]; x may be NULL (no residual add; h_out unused). */
void tpe_add_rms_norm(const uint16_t *h, const uint16_t *x, const uint16_t *w, uint16_t *h_out, uint16_t *y,
                      int64_t rows, int64_t n, float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *src = h + r * n;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            __m512 v = ld(src + i);
            if (x) {
                v = rb(_mm512_add_ps(v, ld(x + r * n + i)));
                st(h_out + r * n + i, v);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        if (x) src = h_out + r * n;
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)n + eps));
        for (int64_t i = 0; i < n; i += 16)
            st(y + r * n + i, _mm512_mul_ps(ld(w + i), rb(_mm512_mul_ps(ld(src + i), inv))));
    }
}

/* In place on qk rows t = 0..T-1 at qk + t * row_stride, heads h = 0..H-1 of d values each;
 * cos, sin: [T, d]. */
void tpe_rope(uint16_t *qk, int64_t row_stride, int64_t heads, int64_t d, const uint16_t *cos_t,
              const uint16_t *sin_t, int64_t T, int nthreads) {
    const int64_t half = d / 2;
    const __m512 neg = _mm512_set1_ps(-0.f);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * heads * d >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *c = cos_t + t * d, *s = sin_t + t * d;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *q = qk + t * row_stride + h * d;
            for (int64_t i = 0; i < half; i += 16) {
                __m512 x1 = ld(q + i), x2 = ld(q + half + i);
                __m512 lo = rb(_mm512_add_ps(rb(_mm512_mul_ps(x1, ld(c + i))),
                                             rb(_mm512_mul_ps(_mm512_xor_ps(x2, neg), ld(s + i)))));
                __m512 hi = rb(_mm512_add_ps(rb(_mm512_mul_ps(x2, ld(c + half + i))),
                                             rb(_mm512_mul_ps(x1, ld(s + half + i)))));
                st(q + i, lo);
                st(q + half + i, hi);
            }
        }
    }
}

/* gate_up: [T, 2 * inter] (gate then up); out: [T, inter]. */
void tpe_silu_mul(const uint16_t *gate_up, uint16_t *out, int64_t T, int64_t inter, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * inter >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = gate_up + t * 2 * inter, *u = g + inter;
        for (int64_t i = 0; i < inter; i += 16) {
            __m512 x = ld(g + i);
            __m512 silu = rb(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_xor_ps(
                                                                                     x, _mm512_set1_ps(-0.f))))));
            st(out + t * inter + i, _mm512_mul_ps(silu, ld(u + i)));
        }
    }
}

/* In place on s: [blocks, n, n] bfloat16 scores of causal attention (query i of a block sees keys
 * j <= i): p = bf16(softmax_j(bf16(s * scale) masked)), as torch computes s.mul_(scale), the -inf
 * mask add and softmax (float32 inside) for bfloat16 -- masked keys get p = 0. */
void tpe_causal_softmax(uint16_t *s, int64_t blocks, int64_t n, float scale, int nthreads) {
    const __m512 vscale = _mm512_set1_ps(scale);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (blocks * n * n >= 65536)
    for (int64_t r = 0; r < blocks * n; r++) {
        uint16_t *x = s + r * n;
        const int64_t vis = r % n + 1;
        float buf[vis + 16];
        __m512 mx = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        for (int64_t j = 0; j < vis; j += 16) {
            const __mmask16 m = vis - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (vis - j)) - 1);
            __m512 v = rb(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                                              _mm256_maskz_loadu_epi16(m, x + j)), 16)), vscale));
            v = _mm512_mask_blend_ps(m, _mm512_set1_ps(-INFINITY), v);
            _mm512_storeu_ps(buf + j, v);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            mx = _mm512_max_ps(mx, v);
        }
        const float rmax = _mm512_reduce_max_ps(mx);
        if (nan || !isfinite(rmax)) { /* torch: x - max is NaN somewhere, so the whole row is NaN */
            for (int64_t j = 0; j < n; j++) x[j] = 0x7fc0;
            continue;
        }
        const __m512 vmax = _mm512_set1_ps(rmax);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < vis; j += 16) {
            __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(buf + j), vmax)); /* masked lanes: exp(-inf) = 0 */
            _mm512_storeu_ps(buf + j, e);
            sum = _mm512_add_ps(sum, e);
        }
        const __m512 vinv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum)); /* x * (1 / sum), as torch */
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 m = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
            __m512 p = j < vis ? _mm512_mul_ps(_mm512_loadu_ps(buf + j), vinv) : _mm512_setzero_ps();
            if (j < vis && vis - j < 16) p = _mm512_maskz_mov_ps((__mmask16)((1u << (vis - j)) - 1), p);
            _mm256_mask_storeu_epi16(x + j, m, _mm512_cvtepi32_epi16(rne(p)));
        }
    }
}

/* float32 twins of tpe_add_rms_norm and tpe_silu_mul (the same formulas with no bfloat16 rounding:
 * h' = h + x; y = w * (h' * (1 / sqrt(mean(h'^2) + eps))); out = (g / (1 + exp(-g))) * u), equal to
 * torch's float32 ops up to the order of the sum of squares and the last bit of exp. n % 16 == 0. */
void tpe_add_rms_norm_f32(const float *h, const float *x, const float *w, float *h_out, float *y, int64_t rows,
                          int64_t n, float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *src = h + r * n;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            __m512 v = _mm512_loadu_ps(src + i);
            if (x) {
                v = _mm512_add_ps(v, _mm512_loadu_ps(x + r * n + i));
                _mm512_storeu_ps(h_out + r * n + i, v);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        if (x) src = h_out + r * n;
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)n + eps));
        for (int64_t i = 0; i < n; i += 16)
            _mm512_storeu_ps(y + r * n + i, _mm512_mul_ps(_mm512_loadu_ps(w + i),
                                                          _mm512_mul_ps(_mm512_loadu_ps(src + i), inv)));
    }
}

void tpe_silu_mul_f32(const float *gate_up, float *out, int64_t T, int64_t inter, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * inter >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * inter, *u = g + inter;
        for (int64_t i = 0; i < inter; i += 16) {
            __m512 x = _mm512_loadu_ps(g + i);
            __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_xor_ps(
                                                                                 x, _mm512_set1_ps(-0.f)))));
            _mm512_storeu_ps(out + t * inter + i, _mm512_mul_ps(silu, _mm512_loadu_ps(u + i)));
        }
    }
}

#elif defined(TPE_AVX2)
/* The same kernels 8 lanes at a time (bf16.h's ld8 / st8 / rb8 / exp8): the same arithmetic, op by op,
 * up to the order of the float32 sums (sum of squares, softmax denominator). */

/* cpu_shm.c's AVX2 fused all-reduce + add + RMSNorm repeats this loop, so TP's fused norm equals this
 * one bit for bit. The sum of squares is kept as the two 8-lane halves of the AVX-512 path's 16
 * lanes and reduced as it reduces them (hsum16): the result equals the AVX-512 path's exactly. */
void tpe_add_rms_norm(const uint16_t *h, const uint16_t *x, const uint16_t *w, uint16_t *h_out, uint16_t *y,
                      int64_t rows, int64_t n, float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *src = h + r * n;
        __m256 ss[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t i = 0; i < n; i += 8) {
            __m256 v = ld8(src + i);
            if (x) {
                v = rb8(_mm256_add_ps(v, ld8(x + r * n + i)));
                st8(h_out + r * n + i, v);
            }
            ss[(i / 8) & 1] = _mm256_fmadd_ps(v, v, ss[(i / 8) & 1]);
        }
        if (x) src = h_out + r * n;
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum16(ss[0], ss[1]) / (float)n + eps));
        for (int64_t i = 0; i < n; i += 8)
            st8(y + r * n + i, _mm256_mul_ps(ld8(w + i), rb8(_mm256_mul_ps(ld8(src + i), inv))));
    }
}

void tpe_rope(uint16_t *qk, int64_t row_stride, int64_t heads, int64_t d, const uint16_t *cos_t,
              const uint16_t *sin_t, int64_t T, int nthreads) {
    const int64_t half = d / 2;
    const __m256 neg = _mm256_set1_ps(-0.f);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * heads * d >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *c = cos_t + t * d, *s = sin_t + t * d;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *q = qk + t * row_stride + h * d;
            for (int64_t i = 0; i < half; i += 8) {
                __m256 x1 = ld8(q + i), x2 = ld8(q + half + i);
                __m256 lo = rb8(_mm256_add_ps(rb8(_mm256_mul_ps(x1, ld8(c + i))),
                                              rb8(_mm256_mul_ps(_mm256_xor_ps(x2, neg), ld8(s + i)))));
                __m256 hi = rb8(_mm256_add_ps(rb8(_mm256_mul_ps(x2, ld8(c + half + i))),
                                              rb8(_mm256_mul_ps(x1, ld8(s + half + i)))));
                st8(q + i, lo);
                st8(q + half + i, hi);
            }
        }
    }
}

void tpe_silu_mul(const uint16_t *gate_up, uint16_t *out, int64_t T, int64_t inter, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * inter >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = gate_up + t * 2 * inter, *u = g + inter;
        for (int64_t i = 0; i < inter; i += 8) {
            const __m256 x = ld8(g + i);
            const __m256 silu = rb8(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f),
                                                                   exp8(_mm256_xor_ps(x, _mm256_set1_ps(-0.f))))));
            st8(out + t * inter + i, _mm256_mul_ps(silu, ld8(u + i)));
        }
    }
}

/* As the AVX-512 tpe_causal_softmax, to the bit: the scaled, rounded scores into a float32 buffer
 * (scalar), exp and the sum 8 lanes at a time (the buffer padded to whole 16s with -inf, whose exp is 0;
 * the sum kept as the AVX-512 path's 16 lanes), the rounding back scalar. */
void tpe_causal_softmax(uint16_t *s, int64_t blocks, int64_t n, float scale, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (blocks * n * n >= 65536)
    for (int64_t r = 0; r < blocks * n; r++) {
        uint16_t *x = s + r * n;
        const int64_t vis = r % n + 1, padded = (vis + 15) / 16 * 16;
        float buf[padded];
        float rmax = -INFINITY;
        int nan = 0;
        for (int64_t j = 0; j < vis; j++) {
            const float v = bf2f(f2bf(bf2f(x[j]) * scale));
            buf[j] = v;
            nan |= v != v;
            rmax = v > rmax ? v : rmax;
        }
        if (nan || !isfinite(rmax)) { /* torch: x - max is NaN somewhere, so the whole row is NaN */
            for (int64_t j = 0; j < n; j++) x[j] = 0x7fc0;
            continue;
        }
        for (int64_t j = vis; j < padded; j++) buf[j] = -INFINITY;
        const __m256 vmax = _mm256_set1_ps(rmax);
        __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}; /* the AVX-512 path's 16 lanes, as two halves */
        for (int64_t j = 0; j < padded; j += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(buf + j), vmax));
            _mm256_storeu_ps(buf + j, e);
            sum[(j / 8) & 1] = _mm256_add_ps(sum[(j / 8) & 1], e);
        }
        const float inv = 1.f / hsum16(sum[0], sum[1]); /* x * (1 / sum), as torch */
        for (int64_t j = 0; j < n; j++) x[j] = j < vis ? f2bf(buf[j] * inv) : 0;
    }
}

void tpe_add_rms_norm_f32(const float *h, const float *x, const float *w, float *h_out, float *y, int64_t rows,
                          int64_t n, float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *src = h + r * n;
        __m256 ss[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}; /* as in tpe_add_rms_norm */
        for (int64_t i = 0; i < n; i += 8) {
            __m256 v = _mm256_loadu_ps(src + i);
            if (x) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(x + r * n + i));
                _mm256_storeu_ps(h_out + r * n + i, v);
            }
            ss[(i / 8) & 1] = _mm256_fmadd_ps(v, v, ss[(i / 8) & 1]);
        }
        if (x) src = h_out + r * n;
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum16(ss[0], ss[1]) / (float)n + eps));
        for (int64_t i = 0; i < n; i += 8)
            _mm256_storeu_ps(y + r * n + i, _mm256_mul_ps(_mm256_loadu_ps(w + i),
                                                          _mm256_mul_ps(_mm256_loadu_ps(src + i), inv)));
    }
}

void tpe_silu_mul_f32(const float *gate_up, float *out, int64_t T, int64_t inter, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * inter >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * inter, *u = g + inter;
        for (int64_t i = 0; i < inter; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f),
                                                               exp8(_mm256_xor_ps(x, _mm256_set1_ps(-0.f)))));
            _mm256_storeu_ps(out + t * inter + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
    }
}
#endif /* neither path: these are left out of the build (cpu_library.has) */
