/* What the paged decode kernels (cpu_paged.c: float32 / bfloat16 caches, cpu_paged_i8.c: int8) share: the
 * sliding window's first key, and the checks of a step's arguments made before anything is written. */
#ifndef TPE_PAGED_H
#define TPE_PAGED_H
#include <stdint.h>

/* The first key position a sequence of L keys attends to under a sliding window (0: no window). */
static inline int64_t win_lo(int64_t L, int64_t window) { return window > 0 && L > window ? L - window : 0; }

/* q_to_kv [hq] in [0, hkv), slots [B] in [-1, num_blocks * bs), lens [B] in [0, max_blocks * bs], and the block ids
 * of each sequence's visible keys (under `window`) in [0, num_blocks): -1, or the first bad b (a slot), B + b (a
 * length), 2B + b (a block id) or 3B (q_to_kv). */
static inline int64_t paged_check(const int64_t *slots, const int64_t *block_tables, int64_t max_blocks,
                                  const int64_t *lens, int64_t B, int64_t num_blocks, int64_t bs,
                                  const int64_t *q_to_kv, int64_t hq, int64_t hkv, int64_t window) {
    for (int64_t h = 0; h < hq; h++)
        if ((uint64_t)q_to_kv[h] >= (uint64_t)hkv) return 3 * B;
    for (int64_t b = 0; b < B; b++)
        if (slots[b] < -1 || slots[b] >= num_blocks * bs) return b;
    for (int64_t b = 0; b < B; b++)
        if (lens[b] < 0 || lens[b] > max_blocks * bs) return B + b;
    for (int64_t b = 0; b < B; b++)
        for (int64_t j = win_lo(lens[b], window) / bs; j * bs < lens[b]; j++)
            if ((uint64_t)block_tables[b * max_blocks + j] >= (uint64_t)num_blocks) return 2 * B + b;
    return -1;
}
#endif
