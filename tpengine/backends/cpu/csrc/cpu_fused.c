/* Fused bfloat16 element-wise kernels for the CPU decoder layer: residual add + RMSNorm, RoPE,
 * SiLU(gate) * up, the causal softmax of bfloat16 prefill attention (and exact row copies for
 * the KV cache). Each replaces a chain of torch ops that, in bfloat16 on CPU, costs one dispatch
 * and one pass over memory per op; each keeps the chain's roundings, op by op:
 *
 *   add_rms_norm: h' = bf16(h + x); y = bf16(w * bf16(h' * rsqrt(mean(h'^2) + eps)))   (fp32 inside)
 *   rope:         out = bf16(bf16(q * cos) + bf16(rotate_half(q) * sin))               (HF's formula;
 *                 tpe_rope_f32: float32, each product rounded before the sum)
 *   silu_mul:     out = bf16(bf16(g / (1 + exp(-g))) * u)                              (torch's SiLU)
 *   gelu_tanh_mul: out = bf16(bf16(0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))) * u)  (torch's GELU, tanh)
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

#if defined(TPE_AVX512) || defined(TPE_AVX2)
/* Each kernel below is written once over bf16.h's vf (16 float32 lanes: one AVX-512 vector, or two
 * AVX2 halves), so both builds compute it bit for bit alike; the float32 twins of add_rms_norm and
 * silu_mul are the same macro with no bfloat16 rounding (R: vf_same). */
/* h, x, h_out, y: [rows, n]; w: [n]; x may be NULL (no residual add; h_out unused). The sum of squares
 * in 16 lanes, reduced by vf_sum; cpu_shm.c's fused all-reduce + norm runs the same loop, so TP's
 * fused norm equals this one bit for bit. LD / ST: 16 elements of T as float32 / rounded back; R: the
 * rounding of an intermediate to T. */
#define ADD_RMS_NORM(NAME, T, LD, ST, R) ADD_RMS_NORM_W(NAME, T, LD, ST, R, T, LD, R)
/* WT / LDW / RN: the weight's type and loader, and the rounding of the normalized value before the
 * weight multiplies it (Llama's: to T; a float32 weight beside bfloat16 activations: none, the product
 * rounded once, as Gemma's and OLMo 2's norms compute). */
#define ADD_RMS_NORM_W(NAME, T, LD, ST, R, WT, LDW, RN)                                                         \
    void NAME(const T *h, const T *x, const WT *w, T *h_out, T *y, int64_t rows, int64_t n, float eps,           \
              int nthreads) {                                                                                   \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (rows * n >= 65536)")               \
        for (int64_t r = 0; r < rows; r++) {                                                                    \
            const T *src = h + r * n;                                                                           \
            vf ss = vf_zero();                                                                                  \
            for (int64_t i = 0; i < n; i += 16) {                                                               \
                vf v = LD(src + i);                                                                             \
                if (x) {                                                                                        \
                    v = R(vf_add(v, LD(x + r * n + i)));                                                        \
                    ST(h_out + r * n + i, v);                                                                   \
                }                                                                                               \
                ss = vf_fmadd(v, v, ss);                                                                        \
            }                                                                                                   \
            if (x) src = h_out + r * n;                                                                         \
            const vf inv = vf_set1(1.0f / sqrtf(vf_sum(ss) / (float)n + eps));                                  \
            for (int64_t i = 0; i < n; i += 16) ST(y + r * n + i, vf_mul(LDW(w + i), RN(vf_mul(LD(src + i), inv)))); \
        }                                                                                                       \
    }

/* Per-head RMSNorm in place (Qwen3's and Gemma 3's q_norm / k_norm): qkv holds `tokens` rows of `heads` head
 * vectors of d values each; heads first .. first + count - 1 of every token are normalized with the weight
 * w [d], as ADD_RMS_NORM without a residual (the same loop, so the same bits as the norm on those rows). */
#define HEAD_RMS_NORM(NAME, T, LD, ST, R)                                                                       \
    void NAME(T *qkv, int64_t tokens, int64_t heads, int64_t first, int64_t count, const T *w, int64_t d,       \
              float eps, int nthreads) {                                                                        \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (tokens * count * d >= 65536)")     \
        for (int64_t r = 0; r < tokens * count; r++) {                                                          \
            T *src = qkv + ((r / count) * heads + first + r % count) * d;                                       \
            vf ss = vf_zero();                                                                                  \
            for (int64_t i = 0; i < d; i += 16) {                                                               \
                const vf v = LD(src + i);                                                                       \
                ss = vf_fmadd(v, v, ss);                                                                        \
            }                                                                                                   \
            const vf inv = vf_set1(1.0f / sqrtf(vf_sum(ss) / (float)d + eps));                                  \
            for (int64_t i = 0; i < d; i += 16) ST(src + i, vf_mul(LD(w + i), R(vf_mul(LD(src + i), inv))));   \
        }                                                                                                       \
    }

/* gate_up: [T, 2 * inter] (gate then up); out: [T, inter]. */
#define SILU_MUL(NAME, T, LD, ST, R)                                                                            \
    void NAME(const T *gate_up, T *out, int64_t tokens, int64_t inter, int nthreads) {                          \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (tokens * inter >= 65536)")         \
        for (int64_t t = 0; t < tokens; t++) {                                                                  \
            const T *g = gate_up + t * 2 * inter, *u = g + inter;                                               \
            for (int64_t i = 0; i < inter; i += 16) {                                                           \
                const vf x = LD(g + i);                                                                         \
                const vf silu = R(vf_div(x, vf_add(vf_set1(1.f), vf_exp(vf_neg(x)))));                          \
                ST(out + t * inter + i, vf_mul(silu, LD(u + i)));                                               \
            }                                                                                                   \
        }                                                                                                       \
    }

/* gate_up: [T, 2 * inter] (gate then up); out: [T, inter] = R(gelu_tanh(g)) * u, torch's tanh-approximate GELU
 * op by op (ATen's vectorized GeluKernel: inner = beta * (x + kappa * ((x * x) * x)), 0.5 * x * (1 + tanh(inner)),
 * float32 inside; Gemma's GeGLU, HF's gelu_pytorch_tanh). */
#define GELU_TANH_MUL(NAME, T, LD, ST, R)                                                                       \
    void NAME(const T *gate_up, T *out, int64_t tokens, int64_t inter, int nthreads) {                          \
        const vf beta = vf_set1((float)(M_SQRT2 * M_2_SQRTPI * 0.5)), kappa = vf_set1(0.044715f);               \
        const vf half = vf_set1(0.5f), one = vf_set1(1.f);                                                      \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (tokens * inter >= 65536)")         \
        for (int64_t t = 0; t < tokens; t++) {                                                                  \
            const T *g = gate_up + t * 2 * inter, *u = g + inter;                                               \
            for (int64_t i = 0; i < inter; i += 16) {                                                           \
                const vf x = LD(g + i);                                                                         \
                const vf inner = vf_mul(beta, vf_add(x, vf_mul(kappa, vf_mul(vf_mul(x, x), x))));               \
                const vf gelu = R(vf_mul(vf_mul(half, x), vf_add(one, vf_tanh(inner))));                        \
                ST(out + t * inter + i, vf_mul(gelu, LD(u + i)));                                               \
            }                                                                                                   \
        }                                                                                                       \
    }

ADD_RMS_NORM(tpe_add_rms_norm, uint16_t, vf_ldb, vf_stb, vf_rb)
HEAD_RMS_NORM(tpe_head_rms_norm, uint16_t, vf_ldb, vf_stb, vf_rb)
HEAD_RMS_NORM(tpe_head_rms_norm_f32, float, vf_ldf, vf_stf, vf_same)
GELU_TANH_MUL(tpe_gelu_tanh_mul, uint16_t, vf_ldb, vf_stb, vf_rb)
GELU_TANH_MUL(tpe_gelu_tanh_mul_f32, float, vf_ldf, vf_stf, vf_same)
SILU_MUL(tpe_silu_mul, uint16_t, vf_ldb, vf_stb, vf_rb)
/* float32 twins (the same formulas with no bfloat16 rounding: h' = h + x; y = w * (h' * (1 / sqrt(mean(h'^2)
 * + eps))); out = (g / (1 + exp(-g))) * u), equal to torch's float32 ops up to the order of the sum of
 * squares and the last bit of exp. n % 16 == 0. */
ADD_RMS_NORM(tpe_add_rms_norm_f32, float, vf_ldf, vf_stf, vf_same)
/* bfloat16 activations, a float32 weight: h' = bf16(h + x); y = bf16(w * (h' * rsqrt(mean(h'^2) + eps))),
 * one rounding after the weight (Gemma's and OLMo 2's norms; torch: F.rms_norm(h'.float(), w).bfloat16()). */
ADD_RMS_NORM_W(tpe_add_rms_norm_w32, uint16_t, vf_ldb, vf_stb, vf_rb, float, vf_ldf, vf_same)
SILU_MUL(tpe_silu_mul_f32, float, vf_ldf, vf_stf, vf_same)

/* A soft cap in place, x = bf16(bf16(tanh(bf16(x / cap))) * cap) over n bfloat16 values (Gemma 2's final
 * logits: HF's three bfloat16 ops, each rounded; tanh is bf16.h's vf_tanh, torch's up to its last float32
 * bits before the rounding). Any n: the tail through the masked loads and stores. */
void tpe_soft_cap(uint16_t *x, int64_t n, float cap, int nthreads) {
    const vf c = vf_set1(cap);
    const int64_t full = n / 16 * 16;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (n >= 65536)
    for (int64_t i = 0; i < full; i += 16)
        vf_stb(x + i, vf_mul(vf_rb(vf_tanh(vf_rb(vf_div(vf_ldb(x + i), c)))), c));
    if (full < n)
        vf_stb_n(x + full, vf_mul(vf_rb(vf_tanh(vf_rb(vf_div(vf_ldb_n(x + full, n - full), c)))), c), n - full);
}

/* In place on qk rows t = 0..T-1 at qk + t * row_stride, heads h = 0..H-1 of d values each;
 * cos, sin: [T, d]. */
void tpe_rope(uint16_t *qk, int64_t row_stride, int64_t heads, int64_t d, const uint16_t *cos_t,
              const uint16_t *sin_t, int64_t T, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * heads * d >= 65536)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < heads; h++) rope_head_bf16(qk + t * row_stride + h * d, cos_t + t * d, sin_t + t * d, d / 2);
}
/* tpe_rope's float32 twin (a float32 prefill: torch's chain of five ops and three new tensors before): HF's
 * formula as rope_head_f32 computes it, each product rounded to float32 before the sum (no fused
 * multiply-add), so the result equals torch's float32 ops bit for bit. */
void tpe_rope_f32(float *qk, int64_t row_stride, int64_t heads, int64_t d, const float *cos_t, const float *sin_t,
                  int64_t T, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * heads * d >= 65536)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < heads; h++) rope_head_f32(qk + t * row_stride + h * d, cos_t + t * d, sin_t + t * d, d / 2);
}

/* In place on s: [blocks, n, n] bfloat16 scores of causal attention (query i of a block sees keys
 * j <= i): p = bf16(softmax_j(bf16(s * scale) masked)), as torch computes s.mul_(scale), the -inf
 * mask add and softmax (float32 inside) for bfloat16 -- masked keys get p = 0. The visible scores,
 * scaled and rounded, go to a float32 buffer padded to whole 16s with -inf (whose exp is 0); the
 * sum of exp runs in 16 lanes. */
void tpe_causal_softmax(uint16_t *s, int64_t blocks, int64_t n, float scale, int nthreads) {
    const vf vscale = vf_set1(scale), ninf = vf_set1(-INFINITY);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (blocks * n * n >= 65536)
    for (int64_t r = 0; r < blocks * n; r++) {
        uint16_t *x = s + r * n;
        const int64_t vis = r % n + 1;
        float buf[vis + 16];
        vf mx = ninf;
        int nan = 0;
        for (int64_t j = 0; j < vis; j += 16) {
            const vf v = vf_first(vf_rb(vf_mul(vf_ldb_n(x + j, vis - j), vscale)), vis - j, ninf);
            vf_stf(buf + j, v);
            nan |= vf_nan(v);
            mx = vf_max(mx, v);
        }
        const float rmax = vf_hmax(mx);
        if (nan || !isfinite(rmax)) { /* torch: x - max is NaN somewhere, so the whole row is NaN */
            for (int64_t j = 0; j < n; j++) x[j] = 0x7fc0;
            continue;
        }
        const vf vmax = vf_set1(rmax);
        vf sum = vf_zero();
        for (int64_t j = 0; j < vis; j += 16) {
            const vf e = vf_exp(vf_sub(vf_ldf(buf + j), vmax)); /* masked lanes: exp(-inf) = 0 */
            vf_stf(buf + j, e);
            sum = vf_add(sum, e);
        }
        const vf vinv = vf_set1(1.f / vf_sum(sum)); /* x * (1 / sum), as torch */
        for (int64_t j = 0; j < n; j += 16) {
            const vf p = j < vis ? vf_first(vf_mul(vf_ldf(buf + j), vinv), vis - j, vf_zero()) : vf_zero();
            vf_stb_n(x + j, p, n - j);
        }
    }
}
#endif /* neither path: these are left out of the build (cpu_library.has) */
