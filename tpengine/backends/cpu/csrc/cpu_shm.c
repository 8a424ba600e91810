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
        if ((spins & 255) == 255) { /* every 256 spins: give the core back if another process wants it */
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

#if defined(TPE_AVX512) || defined(TPE_AVX2)
/* Written once over bf16.h's vf (16 float32 lanes): the sums are element-wise, so the AVX-512 and AVX2
 * builds compute them alike, and the fused norm runs cpu_fused.c's ADD_RMS_NORM loop (the same sum
 * of squares, reduced by vf_sum). */

/* 16 elements at i of the rank-order sum of the slots, each sum rounded to bfloat16 (as torch.add). */
static inline vf sum_bf16(const char *slots, int64_t slot_bytes, int64_t size, int64_t i) {
    vf acc = vf_ldb((const uint16_t *)slots + i);
    for (int64_t r = 1; r < size; r++) acc = vf_rb(vf_add(acc, vf_ldb((const uint16_t *)(slots + r * slot_bytes) + i)));
    return acc;
}

static inline vf sum_f32(const char *slots, int64_t slot_bytes, int64_t size, int64_t i) {
    vf acc = vf_ldf((const float *)slots + i);
    for (int64_t r = 1; r < size; r++) acc = vf_add(acc, vf_ldf((const float *)(slots + r * slot_bytes) + i));
    return acc;
}

int64_t tpe_shm_all_reduce(char *base, int64_t slot_bytes, int64_t size, int64_t rank, int64_t gen, void *t,
                           int64_t n, int64_t bf16, int64_t max_ns) {
    const int64_t rc = publish(base, slot_bytes, size, rank, gen, t, n * (bf16 ? 2 : 4), max_ns);
    if (rc) return rc;
    const char *slots = base + HEADER + (gen % 2) * size * slot_bytes;
    int64_t i = 0;
    if (bf16)
        for (; i + 16 <= n; i += 16) vf_stb((uint16_t *)t + i, sum_bf16(slots, slot_bytes, size, i));
    else
        for (; i + 16 <= n; i += 16) vf_stf((float *)t + i, sum_f32(slots, slot_bytes, size, i));
    for (; i < n; i++) sum_tail(slots, slot_bytes, size, t, i, bf16);
    return 0;
}

/* Row r of the fused norm below, for one dtype: LD / ST / R as in cpu_fused.c's ADD_RMS_NORM, SUM the
 * slots' sum above. */
#define NORM_ROW(T, LD, ST, R, SUM)                                                                             \
    do {                                                                                                        \
        const T *hr = (const T *)h + r * n, *wr = (const T *)w;                                                 \
        T *hor = (T *)h_out + r * n, *yr = (T *)y + r * n;                                                      \
        vf ss = vf_zero();                                                                                      \
        for (int64_t i = 0; i < n; i += 16) {                                                                   \
            const vf v = R(vf_add(LD(hr + i), SUM(slots, slot_bytes, size, r * n + i)));                        \
            ST(hor + i, v);                                                                                     \
            ss = vf_fmadd(v, v, ss);                                                                            \
        }                                                                                                       \
        const vf inv = vf_set1(1.0f / sqrtf(vf_sum(ss) / (float)n + eps));                                      \
        for (int64_t i = 0; i < n; i += 16) ST(yr + i, vf_mul(LD(wr + i), R(vf_mul(LD(hor + i), inv))));        \
    } while (0)

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
        if (bf16)
            NORM_ROW(uint16_t, vf_ldb, vf_stb, vf_rb, sum_bf16);
        else
            NORM_ROW(float, vf_ldf, vf_stf, vf_same, sum_f32);
    }
    return 0;
}
#endif /* neither path: left out of the build; shm.py keeps its Python all-reduce (cpu_library.has) */
