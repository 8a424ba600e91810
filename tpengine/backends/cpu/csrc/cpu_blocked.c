/* The "blocked" bfloat16 weight layout and its kernels (tpengine.backends.cpu.cpu_blocked).
 *
 * A linear weight w [n, k] (n % 16 == 0, k even) is stored as [n / 16][k / 2][16][2]: for each block of 16
 * output rows, the k inputs in pairs, each pair of all 16 rows side by side -- the operand order of
 * AVX512-BF16's vdpbf16ps, which multiplies 16 rows' pairs by one broadcast pair of x and adds into 16
 * float32 lanes, one lane per output row. A decode step's GEMV then reads the weight as one sequential
 * stream with no horizontal sums (the plain layout's GEMV, cpu_gemv.c, reduces 16 lanes per output row),
 * which is what the oneDNN's packed layout does too; the layout is ours so that the kernels below can
 * also run a mixture-of-experts block's routed experts in one call (grouped) and fold their weighted sum
 * into it. Each output is a float32 sum of products of bfloat16 pairs, rounded once to bfloat16 (to
 * nearest even) -- F.linear's arithmetic up to the order of the float32 sum.
 *
 * Kernels: R rows of x against J blocks at once (R x J accumulators; the J blocks' next cache lines are
 * prefetched a kilobyte ahead); a call splits its blocks evenly between the threads; rows past 8 run in
 * passes of 8 over a panel of 2 blocks (the panel stays in the cache between passes).
 *
 * AVX2 (no bfloat16 dot product): the same layout, each pair step of a block two 32-byte loads (rows 0-7,
 * rows 8-15), each 8 lanes of (w[2p], w[2p + 1]) pairs widened to float32 by a 16-bit left shift (the even
 * element) and a mask of the high half (the odd one) -- no shuffle -- and two FMAs with x[2p], x[2p + 1]
 * broadcast, even first, into 8 float32 lanes, one per output row: still one sequential stream and no
 * horizontal sums. Its accumulators are 2 halves per block, so rows past 4 run in passes of 4 over a panel
 * of 1 block (the float32 layout's AVX2 path: passes of 6). Each output is float32 FMAs over k in order -- vdpbf16ps's
 * products and sum up to their order and rounding -- rounded once to bfloat16. Without either path the
 * functions are left out of the build (cpu_library.has is False) and the layout is never chosen. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "amx.h"
#include "bf16.h"

#if defined(TPE_AVX512) || defined(TPE_AVX2)

#define TPE_BLK_PF 512 /* prefetch distance in elements (1 KiB) */

#ifdef TPE_AVX512

/* y[r, 16 (b + j) + i] for r < R, j < J: x rows at x + r * k, blocks b.. of w, y rows n apart. */
#define TPE_BLK_KERNEL(NAME, R, J)                                                                            \
    static void NAME(const uint16_t *x, int64_t k, const uint16_t *w, int64_t b, uint16_t *y, int64_t n) {    \
        const int64_t half = k / 2;                                                                          \
        const uint32_t *xp = (const uint32_t *)x;                                                            \
        const uint16_t *wb = w + b * 16 * k;                                                                 \
        __m512 acc[R][J];                                                                                    \
        for (int r = 0; r < R; r++)                                                                          \
            for (int j = 0; j < J; j++) acc[r][j] = _mm512_setzero_ps();                                     \
        for (int64_t p = 0; p < half; p++) {                                                                 \
            __m512bh wv[J];                                                                                  \
            for (int j = 0; j < J; j++) {                                                                    \
                _mm_prefetch((const char *)(wb + j * 16 * k + p * 32 + TPE_BLK_PF), _MM_HINT_T0);            \
                wv[j] = (__m512bh)_mm512_loadu_si512(wb + j * 16 * k + p * 32);                              \
            }                                                                                                \
            for (int r = 0; r < R; r++) {                                                                    \
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[r * half + p]);                      \
                for (int j = 0; j < J; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xv);              \
            }                                                                                                \
        }                                                                                                    \
        for (int r = 0; r < R; r++)                                                                          \
            for (int j = 0; j < J; j++) st(y + r * n + (b + j) * 16, acc[r][j]);                             \
    }

TPE_BLK_KERNEL(blk_1x4, 1, 4)
TPE_BLK_KERNEL(blk_1x2, 1, 2)
TPE_BLK_KERNEL(blk_1x1, 1, 1)
TPE_BLK_KERNEL(blk_2x2, 2, 2)
TPE_BLK_KERNEL(blk_2x1, 2, 1)
TPE_BLK_KERNEL(blk_4x2, 4, 2)
TPE_BLK_KERNEL(blk_4x1, 4, 1)
TPE_BLK_KERNEL(blk_8x2, 8, 2)
TPE_BLK_KERNEL(blk_8x1, 8, 1)

/* Every row of x against one panel of 2 blocks (pair) or 1 block at b. */
static void blk_panel(const uint16_t *x, int64_t rows, int64_t k, const uint16_t *w, int64_t b, int pair,
                      uint16_t *y, int64_t n) {
    int64_t r = 0;
    for (; r + 8 <= rows; r += 8) (pair ? blk_8x2 : blk_8x1)(x + r * k, k, w, b, y + r * n, n);
    for (; r + 4 <= rows; r += 4) (pair ? blk_4x2 : blk_4x1)(x + r * k, k, w, b, y + r * n, n);
    for (; r + 2 <= rows; r += 2) (pair ? blk_2x2 : blk_2x1)(x + r * k, k, w, b, y + r * n, n);
    for (; r < rows; r++) (pair ? blk_1x2 : blk_1x1)(x + r * k, k, w, b, y + r * n, n);
}

/* Blocks b0..b1 of w for `rows` rows of x. */
static void blk_range(const uint16_t *x, int64_t rows, int64_t k, const uint16_t *w, int64_t b0, int64_t b1,
                      uint16_t *y, int64_t n) {
    int64_t b = b0;
    if (rows == 1)
        for (; b + 4 <= b1; b += 4) blk_1x4(x, k, w, b, y, n);
    for (; b + 2 <= b1; b += 2) blk_panel(x, rows, k, w, b, 1, y, n);
    for (; b < b1; b++) blk_panel(x, rows, k, w, b, 0, y, n);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <string.h>

/* AMX (Sapphire Rapids and later): from blk_amx_min rows on (the caller's measured choice, cpu_blocked.py
 * choose_amx; 0: never) the GEMM takes tile multiplies. The layout's 32 values of k of one block are 16 pairs
 * of 16 rows' (w[2p], w[2p + 1]) -- 16 lines of 64 bytes, contiguous: tdpbf16ps's B tile (the VNNI pair
 * layout) as it lies, so the weight is loaded with no reorder. A tiles: 16 rows x 32 values of k of x, copied
 * chunk by chunk of rows (below) into the thread's buffer of tiles of 1 KiB each (blk_amx_pack_rows: [rows / 16]
 * [k / 32][16][32], the last tile's missing rows zero), so each tile load reads one contiguous kilobyte as the
 * weight's do (at x's row stride the 16 rows are 16 strided lines) from the L2 the copy just wrote, loaded
 * with the streaming hint (tileloaddt1) so that the panel's B tiles, read again
 * by every row tile, stay in the L1. C: float32 [16 rows][16 outputs]; 2 x 2 of them (32 rows x 2 blocks) per
 * pass over k: tmm0..3 C, tmm4..5 A, tmm6..7 B, every tile 16 x 64 bytes (one tile configuration, loaded
 * at the entry of each thread's share, since oneDNN's AMX kernels in the same process configure the tiles
 * their own way, and released after). Tails: the last rows (rows % 16) sit in a zero-padded tile (no second
 * configuration; its padding rows are dropped), the last k % 32 values of k (the layout
 * promises only k even) added to the stored C rows by vdpbf16ps, pair by pair after the tiles' pairs. Each
 * output is the float32 sum of the pairs' products in k's order, rounded once (st) -- whether that equals
 * the vdpbf16ps path bit for bit is the hardware's (docs/notes/kernels.md: measured; tests/test_blocked_amx.py).
 * Rows are taken in chunks whose x fits half the L2 (from the size the C library reports), each chunk running
 * every panel of 2 blocks of the thread's share, so x comes from L2 and the weight is what streams; a y larger
 * than the L2 is written with non-temporal stores, so that it does not evict x's chunk (docs/notes/kernels.md).
 * The threads split the blocks, or, where each one's share of the rows fills a chunk, the rows. Outputs: a
 * piece of 2 blocks without a tail of k is rounded two blocks a row at once (vcvtne2ps2bf16) into one 64-byte
 * store. */
#define BLK_AMX 1

static void blk_amx_config(void) {
    tpe_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.rows[i] = 16, c.colsb[i] = 64;
    _tile_loadconfig(&c);
}

/* The L2's bytes, as the C library reports them (not reported: 1 MiB, the smallest L2 of the CPUs with AMX). */
static int64_t blk_l2(void) {
    static int64_t l2 = -1;
    if (l2 < 0) {
        const long s = sysconf(_SC_LEVEL2_CACHE_SIZE);
        l2 = s > 0 ? s : 1 << 20;
    }
    return l2;
}

/* Rows of x per chunk: as many as fill half the L2 with k bfloat16 each, whole pairs of tiles (>= 32). */
static int64_t blk_amx_chunk(int64_t k) {
    const int64_t rows = (blk_l2() / 2 / (2 * k)) & ~(int64_t)31;
    return rows > 32 ? rows : 32;
}

/* A finished 32 x 32 (or smaller) piece of y whose float32 tiles sit in c: rows r.. (up to 16 nr, below m1), blocks
 * b.. (nb) of the weight's blocks at w0, w1. */
typedef struct {
    int64_t r, m1, b;
    int nr, nb;
    const uint16_t *w0, *w1;
    float (*c)[2][16][16];
} blk_amx_piece;

/* Rows j0..j1 (of 32: row tile j / 16, row j % 16) of a piece of 2 blocks without a tail of k: each row's 32
 * outputs are 64 bytes of y, rounded two blocks at once (vcvtne2ps2bf16: to nearest even as rne() does, a NaN
 * quieted the same way; it reads a subnormal float32 as zero, but the tile multiply never leaves one: it
 * flushes them to zero, as vdpbf16ps does, docs/notes/kernels.md) and written in one store. */
static inline void blk_amx_out_rows(const blk_amx_piece *d, int64_t j0, int64_t j1, uint16_t *y, int64_t n, int nt) {
    const int64_t end = d->m1 - d->r < 16 * d->nr ? d->m1 - d->r : 16 * d->nr;
    if (j1 > end) j1 = end;
    for (int64_t j = j0; j < j1; j++) {
        uint16_t *o = y + (d->r + j) * n + d->b * 16;
        const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(d->c[j >> 4][1][j & 15]),
                                                      _mm512_load_ps(d->c[j >> 4][0][j & 15]));
        if (nt && !((uintptr_t)o & 63)) _mm512_stream_si512((__m512i *)o, v);
        else _mm512_storeu_si512(o, v);
    }
}

/* A piece's outputs: k's tail (the last k % 32 values, past k32: vdpbf16ps pair by pair, in order, after the
 * tiles' pairs) added and each rounded once to bfloat16 into y (rows n apart); without a tail, 2 blocks by
 * blk_amx_out_rows. */
static void blk_amx_out(const blk_amx_piece *d, const uint32_t *xp, int64_t k32, int64_t half, uint16_t *y,
                        int64_t n, int nt) {
    if (k32 == 2 * half && d->nb == 2) {
        blk_amx_out_rows(d, 0, 32, y, n, nt);
        return;
    }
    for (int t = 0; t < d->nr; t++)
        for (int64_t i = 0; i < 16 && d->r + 16 * t + i < d->m1; i++) {
            const int64_t row = d->r + 16 * t + i;
            for (int j = 0; j < d->nb; j++) {
                __m512 acc = _mm512_load_ps(d->c[t][j][i]);
                const uint16_t *wj = j ? d->w1 : d->w0;
                for (int64_t p = k32 / 2; p < half; p++)
                    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(wj + p * 32),
                                           (__m512bh)_mm512_set1_epi32((int)xp[row * half + p]));
                uint16_t *o = y + row * n + (d->b + j) * 16;
                if (nt && !((uintptr_t)o & 31))
                    _mm256_stream_si256((__m256i *)o, _mm512_cvtepi32_epi16(rne(acc)));
                else
                    st(o, acc);
            }
        }
}

/* Rows j0..j1 of a chunk x [rows, k] (rows past `rows` zero) into its A tiles xt [ceil(rows / 16)][k / 32][16][32]:
 * the first k32 = k - k % 32 values of each row, 64 bytes to each of its tiles along k. */
static inline void blk_amx_pack_rows(const uint16_t *x, int64_t rows, int64_t k, uint16_t *xt, int64_t j0, int64_t j1) {
    const int64_t kb = k / 32;
    for (int64_t j = j0; j < j1; j++) {
        uint16_t *o = xt + ((j >> 4) * kb * 16 + (j & 15)) * 32;
        if (j < rows)
            for (int64_t c = 0; c < kb; c++) _mm512_store_si512(o + c * 512, _mm512_loadu_si512(x + j * k + c * 32));
        else
            for (int64_t c = 0; c < kb; c++) _mm512_store_si512(o + c * 512, _mm512_setzero_si512());
    }
}

/* A copy of rows into A tiles left to do (blk_amx_pack_rows' arguments), a few rows after each step of a piece's
 * tile multiplies. */
typedef struct {
    const uint16_t *x;
    int64_t rows, k, j0, j1;
    uint16_t *xt;
} blk_amx_copy;

/* Up to 2 row tiles (a0, a1: blk_amx_pack_rows' tiles of 16 rows) x NB (1, 2) blocks at w0, w1: the k32 tile values
 * of k into c[t][j] ([16][16] float32 each); pf (or NULL): the next panel, whose 2 blocks' lines are fetched into
 * the L2 along the way (the weight's one pass from memory). The previous piece (prev, or NULL; its tiles stored
 * in another buffer) is written out meanwhile, so that its vector work runs while the tile unit multiplies: a
 * piece of 2 blocks without a tail of k a few rows after each step's multiplies (blk_amx_out_rows; all of it
 * after the last step stalled the next piece's multiplies, docs/notes/kernels.md), another after the last step
 * (blk_amx_out). NR, NB are constants at each call (inlined). */
static inline __attribute__((always_inline)) void blk_amx_tiles(const uint16_t *a0, const uint16_t *a1,
                                                                const uint16_t *w0, const uint16_t *w1, int64_t k32,
                                                                const uint16_t *pf, int64_t k, float c[2][2][16][16],
                                                                const blk_amx_piece *prev, const uint32_t *xp,
                                                                uint16_t *y, int64_t n, int nt, blk_amx_copy *cp,
                                                                const int NR, const int NB) {
    _tile_zero(0);
    if (NB > 1) _tile_zero(1);
    if (NR > 1) _tile_zero(2);
    if (NR > 1 && NB > 1) _tile_zero(3);
    /* the previous piece's rows spread over the steps: per a step (32 rows in all) */
    const int spread = prev && prev->nb == 2 && k32 == k;
    const int64_t per = spread ? (32 + k32 / 32 - 1) / (k32 / 32) : 0;
    int64_t done = 0;
    const int64_t cper = cp ? (cp->j1 - cp->j0 + k32 / 32 - 1) / (k32 / 32) : 0;
    for (int64_t kk = 0; kk < k32; kk += 32) {
        if (pf)
            for (int l = 0; l < 16; l++) {
                _mm_prefetch((const char *)(pf + kk * 16 + l * 32), _MM_HINT_T1);
                _mm_prefetch((const char *)(pf + 16 * k + kk * 16 + l * 32), _MM_HINT_T1);
            }
        _tile_loadd(6, w0 + kk * 16, 64);
        _tile_stream_loadd(4, a0 + kk * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (NB > 1) {
            _tile_loadd(7, w1 + kk * 16, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (NR > 1) {
            _tile_stream_loadd(5, a1 + kk * 16, 64);
            _tile_dpbf16ps(2, 5, 6);
            if (NB > 1) _tile_dpbf16ps(3, 5, 7);
        }
        if (spread) blk_amx_out_rows(prev, done, done + per, y, n, nt), done += per;
        if (cp) {
            const int64_t to = cp->j0 + cper < cp->j1 ? cp->j0 + cper : cp->j1;
            blk_amx_pack_rows(cp->x, cp->rows, cp->k, cp->xt, cp->j0, to);
            cp->j0 = to;
        }
    }
    if (prev && !spread) blk_amx_out(prev, xp, k32, k / 2, y, n, nt);
    _tile_stored(0, c[0][0], 64);
    if (NB > 1) _tile_stored(1, c[0][1], 64);
    if (NR > 1) _tile_stored(2, c[1][0], 64);
    if (NR > 1 && NB > 1) _tile_stored(3, c[1][1], 64);
}

/* Blocks b0..b1 of w for `rows` rows of x by AMX (rows >= 1), y rows n apart; nt: y written past the caches. Each
 * chunk of rows is copied into A tiles (blk_amx_pack_rows) in this thread's buffer by its first panel, each row
 * pair's rows while the pair before multiplies (the first pair's before), so that they are in its L2 when the
 * other panels read them and the copy's vector work runs beside the tile unit's. */
static void blk_amx_range(const uint16_t *x, int64_t rows, int64_t k, const uint16_t *w, int64_t b0, int64_t b1,
                          uint16_t *y, int64_t n, int nt) {
    const int64_t k32 = k & ~(int64_t)31, half = k / 2, chunk = blk_amx_chunk(k);
    const uint32_t *xp = (const uint32_t *)x;
    float c[2][2][2][16][16] __attribute__((aligned(64))); /* this piece's tiles and the previous one's */
    uint16_t *xt = k32 ? (uint16_t *)aligned_alloc(64, (size_t)((rows < chunk ? rows : chunk) + 15) / 16 * 16 * k32 * 2)
                       : NULL;
    blk_amx_piece prev;
    int have = 0, cur = 0;
    blk_amx_config();
    for (int64_t m0 = 0; m0 < rows; m0 += chunk) {
        const int64_t m1 = m0 + chunk < rows ? m0 + chunk : rows;
        const int64_t tiled = (m1 - m0 + 15) & ~(int64_t)15; /* the chunk's rows in whole tiles */
        if (xt) blk_amx_pack_rows(x + m0 * k, m1 - m0, k, xt, 0, tiled < 32 ? tiled : 32);
        for (int64_t b = b0; b < b1; b += 2) {
            const int nb = b + 2 <= b1 ? 2 : 1;
            const uint16_t *w0 = w + b * 16 * k, *w1 = w0 + 16 * k;
            for (int64_t r = m0; r < m1; r += 32) {
                const int nr = r + 16 < m1 ? 2 : 1;
                const uint16_t *a0 = xt ? xt + (r - m0) * k32 : NULL, *a1 = xt ? xt + (r - m0 + 16) * k32 : NULL;
                const uint16_t *pf = r == m0 && b + 2 < b1 ? w0 + 32 * k : NULL; /* (a prefetch past w is harmless) */
                const blk_amx_piece *pp = have ? &prev : NULL;
                /* the first panel copies the next row pair's rows into A tiles while this pair multiplies */
                blk_amx_copy next = {x + m0 * k, m1 - m0, k, r - m0 + 32, r - m0 + 64 < tiled ? r - m0 + 64 : tiled, xt};
                blk_amx_copy *cp = xt && b == b0 && next.j0 < next.j1 ? &next : NULL;
                if (nr == 2 && nb == 2) blk_amx_tiles(a0, a1, w0, w1, k32, pf, k, c[cur], pp, xp, y, n, nt, cp, 2, 2);
                else if (nr == 2) blk_amx_tiles(a0, a1, w0, w1, k32, pf, k, c[cur], pp, xp, y, n, nt, cp, 2, 1);
                else if (nb == 2) blk_amx_tiles(a0, a1, w0, w1, k32, pf, k, c[cur], pp, xp, y, n, nt, cp, 1, 2);
                else blk_amx_tiles(a0, a1, w0, w1, k32, pf, k, c[cur], pp, xp, y, n, nt, cp, 1, 1);
                if (cp) blk_amx_pack_rows(next.x, next.rows, k, xt, next.j0, next.j1); /* (what the steps left) */
                prev = (blk_amx_piece){r, m1, b, nr, nb, w0, w1, c[cur]};
                have = 1, cur ^= 1;
            }
        }
    }
    if (have) blk_amx_out(&prev, xp, k32, half, y, n, nt);
    if (nt) _mm_sfence();
    _tile_release();
    free(xt);
}
#endif /* AMX: else the stubs below */

#else /* AVX2: pairs widened by shift / mask, two 8-lane halves a block */

/* y[r, 16 (b + j) + i] for r < R, j < J: x rows at x + r * k, blocks b.. of w, y rows n apart. */
#define TPE_BLK_KERNEL(NAME, R, J)                                                                            \
    static void NAME(const uint16_t *x, int64_t k, const uint16_t *w, int64_t b, uint16_t *y, int64_t n) {    \
        const int64_t half = k / 2;                                                                          \
        const uint32_t *xp = (const uint32_t *)x;                                                            \
        const uint16_t *wb = w + b * 16 * k;                                                                 \
        const __m256i odd = _mm256_set1_epi32((int)0xffff0000u);                                             \
        __m256 acc[R][J][2];                                                                                 \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                                  \
            _Pragma("GCC unroll 4") for (int j = 0; j < J; j++) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps(); \
        for (int64_t p = 0; p < half; p++) {                                                                 \
            __m256i wv[J][2];                                                                                \
            _Pragma("GCC unroll 4") for (int j = 0; j < J; j++) {                                            \
                _mm_prefetch((const char *)(wb + j * 16 * k + p * 32 + TPE_BLK_PF), _MM_HINT_T0);            \
                wv[j][0] = _mm256_loadu_si256((const __m256i *)(wb + j * 16 * k + p * 32));                  \
                wv[j][1] = _mm256_loadu_si256((const __m256i *)(wb + j * 16 * k + p * 32 + 16));             \
            }                                                                                                \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                            \
                const __m256i xv = _mm256_set1_epi32((int)xp[r * half + p]);                                 \
                const __m256 xe = _mm256_castsi256_ps(_mm256_slli_epi32(xv, 16));                            \
                const __m256 xo = _mm256_castsi256_ps(_mm256_and_si256(xv, odd));                            \
                _Pragma("GCC unroll 4") for (int j = 0; j < J; j++)                                          \
                    _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {                                    \
                        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(wv[j][h], 16));              \
                        const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(wv[j][h], odd));              \
                        acc[r][j][h] = _mm256_fmadd_ps(wo, xo, _mm256_fmadd_ps(we, xe, acc[r][j][h]));       \
                    }                                                                                        \
            }                                                                                                \
        }                                                                                                    \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                                  \
            _Pragma("GCC unroll 4") for (int j = 0; j < J; j++) {                                            \
                st8(y + r * n + (b + j) * 16, acc[r][j][0]);                                                 \
                st8(y + r * n + (b + j) * 16 + 8, acc[r][j][1]);                                             \
            }                                                                                                \
    }

TPE_BLK_KERNEL(blk_1x4, 1, 4)
TPE_BLK_KERNEL(blk_1x2, 1, 2)
TPE_BLK_KERNEL(blk_1x1, 1, 1)
TPE_BLK_KERNEL(blk_2x2, 2, 2)
TPE_BLK_KERNEL(blk_2x1, 2, 1)
TPE_BLK_KERNEL(blk_4x1, 4, 1)

/* Every row of x against one block at b: passes of 4, 2, 1 rows (4 x 2 halves of accumulators). */
static void blk_panel(const uint16_t *x, int64_t rows, int64_t k, const uint16_t *w, int64_t b, uint16_t *y,
                      int64_t n) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) blk_4x1(x + r * k, k, w, b, y + r * n, n);
    for (; r + 2 <= rows; r += 2) blk_2x1(x + r * k, k, w, b, y + r * n, n);
    for (; r < rows; r++) blk_1x1(x + r * k, k, w, b, y + r * n, n);
}

/* Blocks b0..b1 of w for `rows` rows of x: one row 4 blocks at a time, 2 rows 2, more in panels of 1. */
static void blk_range(const uint16_t *x, int64_t rows, int64_t k, const uint16_t *w, int64_t b0, int64_t b1,
                      uint16_t *y, int64_t n) {
    int64_t b = b0;
    if (rows == 1) {
        for (; b + 4 <= b1; b += 4) blk_1x4(x, k, w, b, y, n);
        for (; b + 2 <= b1; b += 2) blk_1x2(x, k, w, b, y, n);
    } else if (rows == 2) {
        for (; b + 2 <= b1; b += 2) blk_2x2(x, k, w, b, y, n);
    }
    for (; b < b1; b++) blk_panel(x, rows, k, w, b, y, n);
}

/* Past two passes of 4 rows (rows > 8) each pass would widen the block again: instead x is widened once to
 * float32 (xf [rows][k]) and each block once to the float32 layout's block (wf [k][16]: step 2p the pairs'
 * even elements, 2p + 1 the odd ones), multiplied by the float32 layout's panel kernel (blk32_panel, below) into
 * yf [rows][16] and rounded to bfloat16 -- each output the same FMA chain (2p, then 2p + 1, p in order) as
 * blk_*'s, so the same bits. */
static void blk32_panel(const float *x, int64_t rows, int64_t k, const float *w, int64_t b, int nb, float *y,
                        int64_t n);

static void blk_range_wide(const uint16_t *x, int64_t rows, int64_t k, const uint16_t *w, int64_t b0, int64_t b1,
                           uint16_t *y, int64_t n) {
    float *xf = (float *)malloc((size_t)(rows * k + 16 * k + rows * 16) * sizeof(float)), *wf = xf + rows * k,
          *yf = wf + 16 * k;
    const __m256i odd = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t i = 0; i < rows * k; i++) xf[i] = bf2f(x[i]);
    for (int64_t b = b0; b < b1; b++) {
        const uint16_t *wb = w + b * 16 * k;
        for (int64_t p = 0; p < k / 2; p++)
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + p * 32 + h * 16));
                _mm256_storeu_ps(wf + 2 * p * 16 + h * 8, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
                _mm256_storeu_ps(wf + (2 * p + 1) * 16 + h * 8, _mm256_castsi256_ps(_mm256_and_si256(v, odd)));
            }
        blk32_panel(xf, rows, k, wf, 0, 1, yf, 16);
        for (int64_t r = 0; r < rows; r++)
            for (int h = 0; h < 2; h++) st8(y + r * n + b * 16 + h * 8, _mm256_loadu_ps(yf + r * 16 + h * 8));
    }
    free(xf);
}
#endif

/* Blocks per thread: an even split (a share that is not a whole number of groups ends in smaller ones:
 * blk_range's tails). */
static inline int64_t blk_chunk(int64_t blocks, int nthreads, int64_t rows) {
    (void)rows;
    return (blocks + nthreads - 1) / nthreads;
}

/* w [n, k] row-major -> out [n / 16][k / 2][16][2]; n % 16 == 0, k % 2 == 0. */
void tpe_blocked_pack_bf16(const uint16_t *w, int64_t n, int64_t k, uint16_t *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && n * k >= 65536)
    for (int64_t b = 0; b < n / 16; b++)
        for (int64_t p = 0; p < k / 2; p++)
            for (int i = 0; i < 16; i++) {
                out[((b * (k / 2) + p) * 16 + i) * 2] = w[(b * 16 + i) * k + 2 * p];
                out[((b * (k / 2) + p) * 16 + i) * 2 + 1] = w[(b * 16 + i) * k + 2 * p + 1];
            }
}

#ifndef BLK_AMX
#define BLK_AMX 0 /* no AMX path: the AVX2 build, or an AVX-512 one without AMX */
static int64_t blk_l2(void) { return 0; }
static int64_t blk_amx_chunk(int64_t k) {
    (void)k;
    return 0;
}
static void blk_amx_range(const uint16_t *x, int64_t rows, int64_t k, const uint16_t *w, int64_t b0, int64_t b1,
                          uint16_t *y, int64_t n, int nt) {
    (void)x, (void)rows, (void)k, (void)w, (void)b0, (void)b1, (void)y, (void)n, (void)nt;
}
#endif

/* The fewest rows from which tpe_blocked_gemm_bf16 takes its AMX path (0: never), set by
 * tpe_blocked_amx_rows; a process-wide setting, as the paged kernel's amx_min_batch is per call. */
static int64_t blk_amx_min = 0;

/* 1 if the AMX path is available (built with AMX-BF16, and the OS lets the process use tile data), else 0:
 * then tpe_blocked_gemm_bf16 keeps its vector path whatever tpe_blocked_amx_rows set. */
int tpe_blocked_amx(void) { return BLK_AMX && tpe_amx_ok(); }

/* Take the AMX path from `rows` rows on (0: never; where tpe_blocked_amx() is 0, ignored). */
void tpe_blocked_amx_rows(int64_t rows) { blk_amx_min = rows > 0 ? rows : 0; }

/* y [rows, n] = x [rows, k] @ w^T, w blocked. From blk_amx_min rows on (where AMX runs) by tile multiplies. */
void tpe_blocked_gemm_bf16(const uint16_t *x, int64_t rows, int64_t k, const uint16_t *w, int64_t n, uint16_t *y,
                           int nthreads) {
    const int64_t blocks = n / 16, chunk = blk_chunk(blocks, nthreads, rows);
    const int amx = BLK_AMX && blk_amx_min > 0 && rows >= blk_amx_min && tpe_amx_ok();
    const int nt = amx && rows * n * 2 > blk_l2(); /* y larger than the L2: stored past the caches (x's chunk stays) */
    if (amx && nthreads > 1 && rows >= nthreads * blk_amx_chunk(k)) {
        /* Each thread's share of the rows fills its chunk of the L2 at least once: the threads split the rows
         * (multiples of 32), each running every block, so each copies only its own rows into A tiles and
         * reads the weight once a chunk as splitting the blocks would (there every thread copies every row). */
        const int64_t per = ((rows + nthreads - 1) / nthreads + 31) & ~(int64_t)31;
#pragma omp parallel for schedule(static, 1) num_threads(nthreads)
        for (int64_t r0 = 0; r0 < rows; r0 += per)
            blk_amx_range(x + r0 * k, r0 + per < rows ? per : rows - r0, k, w, 0, blocks, y + r0 * n, n, nt);
        return;
    }
#pragma omp parallel for schedule(static, 1) num_threads(nthreads) if (nthreads > 1 && n * k >= 65536)
    for (int64_t b0 = 0; b0 < blocks; b0 += chunk) {
        const int64_t b1 = b0 + chunk < blocks ? b0 + chunk : blocks;
        if (amx) {
            blk_amx_range(x, rows, k, w, b0, b1, y, n, nt);
            continue;
        }
#ifdef TPE_AVX2
        if (rows > 8) {
            blk_range_wide(x, rows, k, w, b0, b1, y, n);
            continue;
        }
#endif
        blk_range(x, rows, k, w, b0, b1, y, n);
    }
}

/* A mixture-of-experts decode step's gate/up projections: g blocked weights w_i [n, k] (`w`: their
 * addresses), one row x_i = x + i * xs each (xs 0: the one x of all), y [g, n]; the g * n / 16 blocks are
 * split evenly between the threads across the experts' boundaries. */
void tpe_blocked_group_bf16(const uint16_t *x, int64_t xs, int64_t k, const int64_t *w, int64_t g, int64_t n,
                            uint16_t *y, int nthreads) {
    const int64_t nb = n / 16, total = g * nb, chunk = blk_chunk(total, nthreads, 1);
#pragma omp parallel for schedule(static, 1) num_threads(nthreads) if (nthreads > 1)
    for (int64_t lo = 0; lo < total; lo += chunk) {
        const int64_t hi = lo + chunk < total ? lo + chunk : total;
        for (int64_t i = lo / nb; i < g && i * nb < hi; i++) {
            const int64_t b0 = lo > i * nb ? lo - i * nb : 0, b1 = hi < (i + 1) * nb ? hi - i * nb : nb;
            blk_range(x + i * xs, 1, k, (const uint16_t *)(intptr_t)w[i], b0, b1, y + i * n, n);
        }
    }
}

/* Its down projections and weighted sum: out [n] = sum over i in order of s[i] * (h_i @ w_i^T), h_i = h + i * k,
 * each expert's product rounded to bfloat16, scaled in float32 and rounded, then added and rounded, as
 * torch's `out += (y_i * s_i).to(bfloat16)` from zeros (HF's Mixtral / Qwen3-MoE combine). The output blocks
 * are split between the threads; each runs every expert over its share. */
void tpe_blocked_moe_down_bf16(const uint16_t *h, int64_t k, const int64_t *w, int64_t g, int64_t n,
                               const float *s, uint16_t *out, int nthreads) {
    const int64_t nb = n / 16, chunk = blk_chunk(nb, nthreads, 1);
#pragma omp parallel for schedule(static, 1) num_threads(nthreads) if (nthreads > 1)
    for (int64_t b0 = 0; b0 < nb; b0 += chunk) {
        const int64_t b1 = b0 + chunk < nb ? b0 + chunk : nb;
        uint16_t *y = (uint16_t *)malloc((size_t)n * sizeof(uint16_t));
        for (int64_t o = b0 * 16; o < b1 * 16; o++) out[o] = 0;
        for (int64_t i = 0; i < g; i++) {
            blk_range(h + i * k, 1, k, (const uint16_t *)(intptr_t)w[i], b0, b1, y, n);
            const vf si = vf_set1(s[i]);
            for (int64_t o = b0 * 16; o < b1 * 16; o += 16)
                vf_stb(out + o, vf_add(vf_ldb(out + o), vf_rb(vf_mul(vf_ldb(y + o), si))));
        }
        free(y);
    }
}

/* The activations (cpu_fused.c) and the router's GEMV (cpu_gemv.c) of the same library. */
void tpe_silu_mul(const uint16_t *gate_up, uint16_t *out, int64_t tokens, int64_t inter, int nthreads);
void tpe_gelu_tanh_mul(const uint16_t *gate_up, uint16_t *out, int64_t tokens, int64_t inter, int nthreads);
void tpe_gemv_bf16(const uint16_t *x, int64_t rows, int64_t k, const uint16_t *w, int64_t n, uint16_t *y,
                   int nthreads);

/* A mixture-of-experts block's whole one-token step on this rank, in one call: the router (logits = x @ router^T
 * rounded to bfloat16 as F.linear's; softmax over all `ne` experts in float32; the `k` largest, the first index
 * among equals; divided by their sum where `renorm`; rounded to bfloat16 where `in_dtype`: HF's Mixtral /
 * Qwen3-MoE arithmetic, the exp and the sums in C's order, so a routing weight may differ from torch's in its
 * last bit), then of the routed experts this rank holds (global indices first .. first + count - 1, blocked
 * weights at gate_up[i] [2 inter, hidden] and down[i] [hidden, inter]) in ascending index: the grouped gate/up
 * GEMV, the activation (act 0: SiLU, 1: tanh GELU; times up), and the down projections summed with their
 * weights (tpe_blocked_moe_down_bf16). out [hidden] (zeros when none is here). Returns how many experts ran. */
int64_t tpe_moe_decode_bf16(const uint16_t *x, int64_t hidden, const uint16_t *router, int64_t ne, int64_t k,
                            int renorm, int in_dtype, int64_t first, int64_t count, const int64_t *gate_up,
                            const int64_t *down, int64_t inter, int act, uint16_t *out, int nthreads) {
    uint16_t logits16[256];
    float p[256], mx = -INFINITY, sum = 0.f;
    int64_t ids[64];
    float ws[64];
    if (ne > 256 || k > 64 || k > ne) return -1;
    tpe_gemv_bf16(x, 1, hidden, router, ne, logits16, 1);
    for (int64_t e = 0; e < ne; e++) mx = bf2f(logits16[e]) > mx ? bf2f(logits16[e]) : mx;
    for (int64_t e = 0; e < ne; e++) sum += (p[e] = expf(bf2f(logits16[e]) - mx));
    for (int64_t e = 0; e < ne; e++) p[e] /= sum;
    float picked = 0.f;
    for (int64_t j = 0; j < k; j++) { /* the j-th largest, the first index among equals */
        int64_t best = -1;
        for (int64_t e = 0; e < ne; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        ids[j] = best, ws[j] = p[best], picked += p[best];
    }
    int64_t g = 0;
    int64_t sel[64];
    float sw[64];
    for (int64_t j = 0; j < k; j++) {
        float w = renorm ? ws[j] / picked : ws[j];
        if (in_dtype) w = bf2f(f2bf(w));
        if (ids[j] < first || ids[j] >= first + count) continue;
        int64_t at = g++; /* insertion by ascending expert index */
        while (at > 0 && sel[at - 1] > ids[j] - first) sel[at] = sel[at - 1], sw[at] = sw[at - 1], at--;
        sel[at] = ids[j] - first, sw[at] = w;
    }
    if (!g) {
        for (int64_t o = 0; o < hidden; o++) out[o] = 0;
        return 0;
    }
    int64_t gu[64], dw[64];
    for (int64_t i = 0; i < g; i++) gu[i] = gate_up[sel[i]], dw[i] = down[sel[i]];
    uint16_t *y = (uint16_t *)malloc((size_t)(g * 3 * inter) * sizeof(uint16_t)), *h = y + g * 2 * inter;
    tpe_blocked_group_bf16(x, 0, hidden, gu, g, 2 * inter, y, nthreads);
    (act ? tpe_gelu_tanh_mul : tpe_silu_mul)(y, h, g, inter, nthreads);
    tpe_blocked_moe_down_bf16(h, inter, dw, g, hidden, sw, out, nthreads);
    free(y);
    return g;
}

#endif /* neither path: left out of the build (cpu_library.has) */

/* The float32 blocked layout: w [n, k] (n % 16 == 0, any k) stored as [n / 16][k][16], for each block of 16
 * output rows the k inputs in order, each step the 16 rows' weights side by side (one 64-byte line). A
 * product step is one load of those 16 weights (two 8-lane halves on AVX2) and one FMA with x[k] broadcast,
 * into 16 float32 lanes, one lane per output row: the weight is read as one sequential stream with no
 * horizontal sums (the plain layout's float32 GEMV, cpu_gemv.c, reduces 16 lanes per output row). Each
 * output is the FMA chain over k in order, x[0] first -- the same sum on both vector paths, so an AVX2
 * build's result equals the AVX-512 one's bit for bit; F.linear's up to the order of the float32 sum.
 * Kernels as the bfloat16 ones above: R rows x J blocks of accumulators, the J blocks' lines prefetched a
 * kilobyte ahead, the blocks split evenly between the threads; rows past 8 (AVX2: 6, whose 16 registers hold
 * 6 x 2 halves of accumulators, the two weight halves and the broadcast) run in passes over a panel of 2
 * blocks (AVX2: 1) that stays in the cache. A pass's rows only group the FMAs: every output is the same
 * chain whatever the pass. */
#if defined(TPE_AVX512) || defined(TPE_AVX2)

#define TPE_BLK32_PF 256 /* prefetch distance in floats (1 KiB) */

#ifdef TPE_AVX512
#define B32_NV 1 /* vectors per 16 lanes */
#define B32_VL 16
#define B32_V __m512
#define B32_LOAD _mm512_loadu_ps
#define B32_SET1 _mm512_set1_ps
#define B32_FMA _mm512_fmadd_ps
#define B32_ZERO _mm512_setzero_ps
#define B32_STORE _mm512_storeu_ps
#else
#define B32_NV 2
#define B32_VL 8
#define B32_V __m256
#define B32_LOAD _mm256_loadu_ps
#define B32_SET1 _mm256_set1_ps
#define B32_FMA _mm256_fmadd_ps
#define B32_ZERO _mm256_setzero_ps
#define B32_STORE _mm256_storeu_ps
#endif

/* y[r, 16 (b + j) + i] for r < R, j < J: x rows at x + r * k, blocks b.. of w, y rows n apart. */
#define TPE_BLK32_KERNEL(NAME, R, J)                                                                          \
    static void NAME(const float *x, int64_t k, const float *w, int64_t b, float *y, int64_t n) {             \
        const float *wb = w + b * 16 * k;                                                                    \
        B32_V acc[R][J][B32_NV];                                                                             \
        for (int r = 0; r < R; r++)                                                                          \
            for (int j = 0; j < J; j++)                                                                      \
                for (int h = 0; h < B32_NV; h++) acc[r][j][h] = B32_ZERO();                                  \
        for (int64_t p = 0; p < k; p++) {                                                                    \
            B32_V wv[J][B32_NV];                                                                             \
            for (int j = 0; j < J; j++) {                                                                    \
                _mm_prefetch((const char *)(wb + j * 16 * k + p * 16 + TPE_BLK32_PF), _MM_HINT_T0);          \
                for (int h = 0; h < B32_NV; h++) wv[j][h] = B32_LOAD(wb + j * 16 * k + p * 16 + h * B32_VL); \
            }                                                                                                \
            for (int r = 0; r < R; r++) {                                                                    \
                const B32_V xv = B32_SET1(x[r * k + p]);                                                     \
                for (int j = 0; j < J; j++)                                                                  \
                    for (int h = 0; h < B32_NV; h++) acc[r][j][h] = B32_FMA(wv[j][h], xv, acc[r][j][h]);     \
            }                                                                                                \
        }                                                                                                    \
        for (int r = 0; r < R; r++)                                                                          \
            for (int j = 0; j < J; j++)                                                                      \
                for (int h = 0; h < B32_NV; h++) B32_STORE(y + r * n + (b + j) * 16 + h * B32_VL, acc[r][j][h]); \
    }

TPE_BLK32_KERNEL(blk32_1x4, 1, 4)
TPE_BLK32_KERNEL(blk32_1x2, 1, 2)
TPE_BLK32_KERNEL(blk32_1x1, 1, 1)
TPE_BLK32_KERNEL(blk32_2x2, 2, 2)
TPE_BLK32_KERNEL(blk32_2x1, 2, 1)
TPE_BLK32_KERNEL(blk32_4x1, 4, 1)
#ifdef TPE_AVX512
TPE_BLK32_KERNEL(blk32_4x2, 4, 2)
TPE_BLK32_KERNEL(blk32_8x2, 8, 2)
#define B32_PANEL 2 /* blocks per panel */
#else
/* 12 accumulators, not 8: two FMA units of 4 cycles' latency keep 8 chains busy with no slack, and a
 * pass of 6 reads the panel's weight line once per 6 rows (docs/notes/kernels.md) */
TPE_BLK32_KERNEL(blk32_6x1, 6, 1)
#define B32_PANEL 1
#endif

/* Every row of x against the panel of `nb` blocks (1 or B32_PANEL) at b. */
static void blk32_panel(const float *x, int64_t rows, int64_t k, const float *w, int64_t b, int nb, float *y,
                        int64_t n) {
    int64_t r = 0;
#ifdef TPE_AVX512
    if (nb == 2) {
        for (; r + 8 <= rows; r += 8) blk32_8x2(x + r * k, k, w, b, y + r * n, n);
        for (; r + 4 <= rows; r += 4) blk32_4x2(x + r * k, k, w, b, y + r * n, n);
        for (; r + 2 <= rows; r += 2) blk32_2x2(x + r * k, k, w, b, y + r * n, n);
        for (; r < rows; r++) blk32_1x2(x + r * k, k, w, b, y + r * n, n);
        return;
    }
#endif
    (void)nb;
#ifndef TPE_AVX512
    for (; r + 6 <= rows; r += 6) blk32_6x1(x + r * k, k, w, b, y + r * n, n);
#endif
    for (; r + 4 <= rows; r += 4) blk32_4x1(x + r * k, k, w, b, y + r * n, n);
    for (; r + 2 <= rows; r += 2) blk32_2x1(x + r * k, k, w, b, y + r * n, n);
    for (; r < rows; r++) blk32_1x1(x + r * k, k, w, b, y + r * n, n);
}

/* Blocks b0..b1 of w for `rows` rows of x: one row 4 blocks at a time, 2 rows 2, more in panels. */
static void blk32_range(const float *x, int64_t rows, int64_t k, const float *w, int64_t b0, int64_t b1, float *y,
                        int64_t n) {
    int64_t b = b0;
    if (rows == 1) {
        for (; b + 4 <= b1; b += 4) blk32_1x4(x, k, w, b, y, n);
        for (; b + 2 <= b1; b += 2) blk32_1x2(x, k, w, b, y, n);
    } else if (rows == 2) {
        for (; b + 2 <= b1; b += 2) blk32_2x2(x, k, w, b, y, n);
    }
    for (; b + B32_PANEL <= b1; b += B32_PANEL) blk32_panel(x, rows, k, w, b, B32_PANEL, y, n);
    for (; b < b1; b++) blk32_panel(x, rows, k, w, b, 1, y, n);
}

/* w [n, k] row-major -> out [n / 16][k][16]; n % 16 == 0. */
void tpe_blocked_pack_f32(const float *w, int64_t n, int64_t k, float *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && n * k >= 65536)
    for (int64_t b = 0; b < n / 16; b++)
        for (int64_t p = 0; p < k; p++)
            for (int i = 0; i < 16; i++) out[(b * k + p) * 16 + i] = w[(b * 16 + i) * k + p];
}

/* y [rows, n] = x [rows, k] @ w^T, w blocked float32; any rows. */
void tpe_blocked_gemm_f32(const float *x, int64_t rows, int64_t k, const float *w, int64_t n, float *y,
                          int nthreads) {
    const int64_t blocks = n / 16, chunk = (blocks + nthreads - 1) / nthreads;
#pragma omp parallel for schedule(static, 1) num_threads(nthreads) if (nthreads > 1 && n * k >= 65536)
    for (int64_t b0 = 0; b0 < blocks; b0 += chunk)
        blk32_range(x, rows, k, w, b0, b0 + chunk < blocks ? b0 + chunk : blocks, y, n);
}

#endif /* neither path: left out of the build (cpu_library.has) */
