/* The fast path of tpengine.shm.ShmComm.all_reduce in one C call: publish this rank's tensor into its
 * slot of the shared-memory file, wait for every rank's generation counter, sum the slots in rank order
 * into the tensor. The same protocol, memory layout and arithmetic as the Python path it replaces
 * (tpengine/shm.py), so either path may serve any call:
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

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

int64_t tpe_shm_all_reduce(char *base, int64_t slot_bytes, int64_t size, int64_t rank, int64_t gen, void *t,
                           int64_t n, int64_t bf16, int64_t max_ns) {
    const int64_t es = bf16 ? 2 : 4;
    char *slots = base + HEADER + (gen % 2) * size * slot_bytes;
    if (!wait_all(base, size, gen - 1, max_ns)) return 1;
    memcpy(slots + rank * slot_bytes, t, (size_t)(n * es));
    __atomic_store_n((int64_t *)(base + 64 * rank), gen, __ATOMIC_RELEASE);
    if (!wait_all(base, size, gen, max_ns)) return 2;
    if (bf16) {
        uint16_t *o = (uint16_t *)t;
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
            __m512 acc = ld((const uint16_t *)slots + i);
            for (int64_t r = 1; r < size; r++) acc = rb(_mm512_add_ps(acc, ld((const uint16_t *)(slots + r * slot_bytes) + i)));
            st(o + i, acc);
        }
        for (; i < n; i++) {
            float acc = bf2f(((const uint16_t *)slots)[i]);
            for (int64_t r = 1; r < size; r++) acc = bf2f(f2bf(acc + bf2f(((const uint16_t *)(slots + r * slot_bytes))[i])));
            o[i] = f2bf(acc);
        }
    } else {
        float *o = (float *)t;
        for (int64_t i = 0; i < n; i++) {
            float acc = ((const float *)slots)[i];
            for (int64_t r = 1; r < size; r++) acc += ((const float *)(slots + r * slot_bytes))[i];
            o[i] = acc;
        }
    }
    return 0;
}

#else /* never called: tpe_fast() == 0 marks the library unavailable */
int64_t tpe_shm_all_reduce(void) { return 1; }
#endif
