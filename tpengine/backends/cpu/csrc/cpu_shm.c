/* The fast path of tpengine.backends.cpu.shm.ShmComm.all_reduce in one C call: publish this rank's tensor into its
 * slot of the shared-memory file, wait for every rank's generation counter, sum the slots in rank order
 * into the tensor. The same protocol, memory layout and arithmetic as the Python path it replaces
 * (tpengine/backends/cpu/shm.py), so either path may serve any call:
 *
 *   base:   the mapped file: HEADER bytes of flags (rank r's int64 counter at base + 64 r), then two
 *           buffers of `size` slots of `slot_bytes` each (slot (g % 2, r) at
 *           HEADER + ((g % 2) * size + r) * slot_bytes).
 *   call g: wait until every flag >= g - 1 (nobody still reads buffer g % 2), copy t into slot
 *           (g % 2, rank), store flag[rank] = g (release), wait until every flag >= g (acquire),
 *           t = ((s_0 + s_1) + s_2) + ..., each sum rounded to the dtype (bfloat16: as torch.add).
 *
 * Each wait spins at most max_ns nanoseconds: returns 0 when the call is complete, 1 when the first
 * wait ran out (nothing was written), 2 when the second did (this rank's slot and flag are published,
 * t is not summed); the caller then waits in Python, where the peers' liveness and the collective
 * timeout are checked, and finishes the call. n: elements of t (float32 or bfloat16, contiguous). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sched.h>
#include <time.h>

#include "bf16.h"

#define HEADER 4096

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* 1 once every rank's flag is >= gen, 0 if max_ns passed first. */
static int wait_all(char *base, int64_t size, int64_t gen, int64_t max_ns) {
    int64_t deadline = -1;
    for (int64_t spins = 0;; spins++) {
        int ok = 1;
        for (int64_t r = 0; r < size && ok; r++) ok = __atomic_load_n((int64_t *)(base + 64 * r), __ATOMIC_ACQUIRE) >= gen;
        if (ok) return 1;
        if ((spins & 255) == 255) { /* every ~10 us: give the core back if another process wants it */
            sched_yield();
            const int64_t t = now_ns();
            if (deadline < 0) deadline = t + max_ns;
            else if (t > deadline) return 0;
        }
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
    }
}

/* Steps 1-4 of call gen (header comment): 0 when every rank's slot is published, else 1 or 2 as
 * tpe_shm_all_reduce returns. */
static int64_t publish(char *base, int64_t slot_bytes, int64_t size, int64_t rank, int64_t gen, const void *t,
                       int64_t bytes, int64_t max_ns) {
    char *slots = base + HEADER + (gen % 2) * size * slot_bytes;
    if (!wait_all(base, size, gen - 1, max_ns)) return 1;
    memcpy(slots + rank * slot_bytes, t, (size_t)bytes);
    __atomic_store_n((int64_t *)(base + 64 * rank), gen, __ATOMIC_RELEASE);
    if (!wait_all(base, size, gen, max_ns)) return 2;
    return 0;
}

/* Element i of the rank-order sum of the slots, each sum rounded to the dtype: the scalar form of
 * the vector sums below, for the tail of a tensor whose size is not a multiple of the lanes. */
static inline void sum_tail(const char *slots, int64_t slot_bytes, int64_t size, void *t, int64_t i, int64_t bf16) {
    if (bf16) {
        float acc = bf2f(((const uint16_t *)slots)[i]);
        for (int64_t r = 1; r < size; r++) acc = bf2f(f2bf(acc + bf2f(((const uint16_t *)(slots + r * slot_bytes))[i])));
        ((uint16_t *)t)[i] = f2bf(acc);
    } else {
        float acc = ((const float *)slots)[i];
        for (int64_t r = 1; r < size; r++) acc += ((const float *)(slots + r * slot_bytes))[i];
        ((float *)t)[i] = acc;
    }
}

#ifdef TPE_AVX512

/* 16 elements at i of the rank-order sum of the slots, each sum rounded to bfloat16 (as torch.add). */
static inline __m512 sum_bf16(const char *slots, int64_t slot_bytes, int64_t size, int64_t i) {
    __m512 acc = ld((const uint16_t *)slots + i);
    for (int64_t r = 1; r < size; r++) acc = rb(_mm512_add_ps(acc, ld((const uint16_t *)(slots + r * slot_bytes) + i)));
    return acc;
}

static inline __m512 sum_f32(const char *slots, int64_t slot_bytes, int64_t size, int64_t i) {
    __m512 acc = _mm512_loadu_ps((const float *)slots + i);
    for (int64_t r = 1; r < size; r++) acc = _mm512_add_ps(acc, _mm512_loadu_ps((const float *)(slots + r * slot_bytes) + i));
    return acc;
}

int64_t tpe_shm_all_reduce(char *base, int64_t slot_bytes, int64_t size, int64_t rank, int64_t gen, void *t,
                           int64_t n, int64_t bf16, int64_t max_ns) {
    const int64_t rc = publish(base, slot_bytes, size, rank, gen, t, n * (bf16 ? 2 : 4), max_ns);
    if (rc) return rc;
    const char *slots = base + HEADER + (gen % 2) * size * slot_bytes;
    int64_t i = 0;
    if (bf16) {
        uint16_t *o = (uint16_t *)t;
        for (; i + 16 <= n; i += 16) st(o + i, sum_bf16(slots, slot_bytes, size, i));
    } else {
        float *o = (float *)t;
        for (; i + 16 <= n; i += 16) _mm512_storeu_ps(o + i, sum_f32(slots, slot_bytes, size, i));
    }
    for (; i < n; i++) sum_tail(slots, slot_bytes, size, t, i, bf16);
    return 0;
}

/* The all-reduce of t [rows, n] fused with the residual add and RMSNorm after it: x = the rank-order sum
 * of the slots (as tpe_shm_all_reduce would leave in t; t itself is not written), then exactly
 * tpe_add_rms_norm's (bf16) / tpe_add_rms_norm_f32's arithmetic on (h, x): h_out = h + x,
 * y = w * rms_norm(h_out). n % 16 == 0. The rows are split over nthreads once every slot is in. */
int64_t tpe_shm_all_reduce_add_rms_norm(char *base, int64_t slot_bytes, int64_t size, int64_t rank, int64_t gen,
                                        const void *t, int64_t rows, int64_t n, int64_t bf16, int64_t max_ns,
                                        const void *h, const void *w, void *h_out, void *y, float eps, int nthreads) {
    const int64_t rc = publish(base, slot_bytes, size, rank, gen, t, rows * n * (bf16 ? 2 : 4), max_ns);
    if (rc) return rc;
    const char *slots = base + HEADER + (gen % 2) * size * slot_bytes;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        __m512 ss = _mm512_setzero_ps();
        if (bf16) {
            const uint16_t *hr = (const uint16_t *)h + r * n, *wr = (const uint16_t *)w;
            uint16_t *hor = (uint16_t *)h_out + r * n, *yr = (uint16_t *)y + r * n;
            for (int64_t i = 0; i < n; i += 16) {
                const __m512 v = rb(_mm512_add_ps(ld(hr + i), sum_bf16(slots, slot_bytes, size, r * n + i)));
                st(hor + i, v);
                ss = _mm512_fmadd_ps(v, v, ss);
            }
            const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)n + eps));
            for (int64_t i = 0; i < n; i += 16) st(yr + i, _mm512_mul_ps(ld(wr + i), rb(_mm512_mul_ps(ld(hor + i), inv))));
        } else {
            const float *hr = (const float *)h + r * n, *wr = (const float *)w;
            float *hor = (float *)h_out + r * n, *yr = (float *)y + r * n;
            for (int64_t i = 0; i < n; i += 16) {
                const __m512 v = _mm512_add_ps(_mm512_loadu_ps(hr + i), sum_f32(slots, slot_bytes, size, r * n + i));
                _mm512_storeu_ps(hor + i, v);
                ss = _mm512_fmadd_ps(v, v, ss);
            }
            const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)n + eps));
            for (int64_t i = 0; i < n; i += 16)
                _mm512_storeu_ps(yr + i, _mm512_mul_ps(_mm512_loadu_ps(wr + i), _mm512_mul_ps(_mm512_loadu_ps(hor + i), inv)));
        }
    }
    return 0;
}

#elif defined(TPE_AVX2)
/* The same, 8 lanes at a time: the same rank-order sums (element-wise, so bit for bit the AVX-512
 * path's), and the fused norm with cpu_fused.c's AVX2 tpe_add_rms_norm loop (the same sum of squares). */
static inline __m256 sum_bf16(const char *slots, int64_t slot_bytes, int64_t size, int64_t i) {
    __m256 acc = ld8((const uint16_t *)slots + i);
    for (int64_t r = 1; r < size; r++) acc = rb8(_mm256_add_ps(acc, ld8((const uint16_t *)(slots + r * slot_bytes) + i)));
    return acc;
}

static inline __m256 sum_f32(const char *slots, int64_t slot_bytes, int64_t size, int64_t i) {
    __m256 acc = _mm256_loadu_ps((const float *)slots + i);
    for (int64_t r = 1; r < size; r++) acc = _mm256_add_ps(acc, _mm256_loadu_ps((const float *)(slots + r * slot_bytes) + i));
    return acc;
}

int64_t tpe_shm_all_reduce(char *base, int64_t slot_bytes, int64_t size, int64_t rank, int64_t gen, void *t,
                           int64_t n, int64_t bf16, int64_t max_ns) {
    const int64_t rc = publish(base, slot_bytes, size, rank, gen, t, n * (bf16 ? 2 : 4), max_ns);
    if (rc) return rc;
    const char *slots = base + HEADER + (gen % 2) * size * slot_bytes;
    int64_t i = 0;
    if (bf16)
        for (; i + 8 <= n; i += 8) st8((uint16_t *)t + i, sum_bf16(slots, slot_bytes, size, i));
    else
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps((float *)t + i, sum_f32(slots, slot_bytes, size, i));
    for (; i < n; i++) sum_tail(slots, slot_bytes, size, t, i, bf16);
    return 0;
}

int64_t tpe_shm_all_reduce_add_rms_norm(char *base, int64_t slot_bytes, int64_t size, int64_t rank, int64_t gen,
                                        const void *t, int64_t rows, int64_t n, int64_t bf16, int64_t max_ns,
                                        const void *h, const void *w, void *h_out, void *y, float eps, int nthreads) {
    const int64_t rc = publish(base, slot_bytes, size, rank, gen, t, rows * n * (bf16 ? 2 : 4), max_ns);
    if (rc) return rc;
    const char *slots = base + HEADER + (gen % 2) * size * slot_bytes;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        __m256 ss[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        if (bf16) {
            const uint16_t *hr = (const uint16_t *)h + r * n, *wr = (const uint16_t *)w;
            uint16_t *hor = (uint16_t *)h_out + r * n, *yr = (uint16_t *)y + r * n;
            for (int64_t i = 0; i < n; i += 8) {
                const __m256 v = rb8(_mm256_add_ps(ld8(hr + i), sum_bf16(slots, slot_bytes, size, r * n + i)));
                st8(hor + i, v);
                ss[(i / 8) & 1] = _mm256_fmadd_ps(v, v, ss[(i / 8) & 1]);
            }
            const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum16(ss[0], ss[1]) / (float)n + eps));
            for (int64_t i = 0; i < n; i += 8) st8(yr + i, _mm256_mul_ps(ld8(wr + i), rb8(_mm256_mul_ps(ld8(hor + i), inv))));
        } else {
            const float *hr = (const float *)h + r * n, *wr = (const float *)w;
            float *hor = (float *)h_out + r * n, *yr = (float *)y + r * n;
            for (int64_t i = 0; i < n; i += 8) {
                const __m256 v = _mm256_add_ps(_mm256_loadu_ps(hr + i), sum_f32(slots, slot_bytes, size, r * n + i));
                _mm256_storeu_ps(hor + i, v);
                ss[(i / 8) & 1] = _mm256_fmadd_ps(v, v, ss[(i / 8) & 1]);
            }
            const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum16(ss[0], ss[1]) / (float)n + eps));
            for (int64_t i = 0; i < n; i += 8)
                _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_loadu_ps(wr + i), _mm256_mul_ps(_mm256_loadu_ps(hor + i), inv)));
        }
    }
    return 0;
}
#endif /* neither path: left out of the build; shm.py keeps its Python all-reduce (cpu_library.has) */
