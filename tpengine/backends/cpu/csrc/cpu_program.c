/* A batch-1 decode step of a decoder stack as one C call: a list of kernel calls, each one of the
 * library's own C functions (add + RMSNorm, GEMV, quantized GEMV, the paged decode attention, the
 * MLP's activation) with its arguments fixed when the program is built (cpu_program.py), run back to
 * back.
 *
 * Why: at one token a step, the kernels of a decoder layer take microseconds each, and the Python
 * between them (the layer's forward, argument checks, ctypes' conversion of every argument, a tensor
 * for every output) costs as much as they do (docs/notes/kernels.md). The program makes the same
 * calls, with the same arguments and in the same order, as the stack's forward does through the
 * layers' bound kernels, so its result is bit for bit theirs.
 *
 * An op is TPE_OP_WORDS int64 words: its signature (SIG_*, which C prototype `fn` has), a mask whose
 * bit i says that argument i is a per-step value (an index into `params`, set by the caller each step:
 * RoPE tables, slot mapping, block table, context lengths, the input row) rather than a literal, the
 * function's address, then its arguments in order (pointers and integers as they are; a float as the
 * bits of a double). The program runs from op `start` and returns -1 at the end; else op i's
 * `i << 2 | code`: code 0, the kernel refused its arguments (the paged kernel's index checks, a quantized
 * GEMV's status); 1 or 2, a shared-memory all-reduce (tp > 1, cpu_shm.c) stopped waiting for its peers
 * after its spin (1: not yet published, 2: published), which the caller finishes with its bounded,
 * peer-checking wait before it resumes at op i + 1.
 *
 * A greedy step (tp = 1) may end with the tied LM head's one-row product and the row argmax
 * (cpu_argmax.c) of its logits: the same calls, on the same rows, as the head's bound product and its
 * greedy pick make from Python (cpu_program.py, Program.bind_greedy).
 *
 * No vector code here: the ISA paths are the called kernels' (bf16.h), so both builds compile it. */
#include <stdint.h>
#include <string.h>

#define TPE_OP_WORDS 32
#define TPE_OP_ARGS (TPE_OP_WORDS - 3)

enum { SIG_NORM = 1, SIG_LIN = 2, SIG_Q8 = 3, SIG_Q4 = 4, SIG_ACT = 5, SIG_PAGED = 6, SIG_PAGED_I8 = 7, SIG_SHM_NORM = 8,
       SIG_ARGMAX = 9 };
/* the params slot holding the generation of the step's first shared-memory all-reduce (cpu_program.py's GEN) */
#define GEN_SLOT 7

typedef void *P;
typedef int64_t L;
typedef void (*norm_fn)(P, P, P, P, P, L, L, float, int);
typedef void (*lin_fn)(P, L, L, P, L, P, int);
typedef L (*q8_fn)(P, L, L, P, P, L, P, int, int);
typedef L (*q4_fn)(P, L, L, P, P, P, L, L, L, L, P, int, int);
typedef void (*act_fn)(P, P, L, L, int);
typedef void (*argmax_fn)(P, L, L, L, P, int);
typedef L (*paged_fn)(P, L, P, L, P, L, P, P, P, P, L, P, P, P, L, L, P, L, L, L, float, P, L, L, int, L, float);
typedef L (*shm_norm_fn)(P, L, L, L, L, P, L, L, L, L, P, P, P, P, float, int);
typedef L (*paged_i8_fn)(P, L, P, L, P, L, P, P, P, P, L, P, P, P, P, P, L, L, P, L, L, L, float, P, L, int, L,
                         float);

static inline float f32(int64_t bits) {
    double d;
    memcpy(&d, &bits, sizeof d);
    return (float)d;
}

int64_t tpe_program_run(const int64_t *ops, int64_t n_ops, const int64_t *params, int64_t start) {
    for (int64_t i = start; i < n_ops; i++) {
        const int64_t *op = ops + i * TPE_OP_WORDS, mask = op[1];
        int64_t a[TPE_OP_ARGS];
        for (int j = 0; j < TPE_OP_ARGS; j++) a[j] = (mask >> j) & 1 ? params[op[3 + j]] : op[3 + j];
        void *fn = (void *)(intptr_t)op[2];
#define p(j) ((P)(intptr_t)a[j])
        L bad = -1; /* the paged kernel: -1 or the bad argument's position; a quantized GEMV: 0 or its status */
        switch (op[0]) {
            case SIG_NORM:
                ((norm_fn)fn)(p(0), p(1), p(2), p(3), p(4), a[5], a[6], f32(a[7]), (int)a[8]);
                break;
            case SIG_LIN:
                ((lin_fn)fn)(p(0), a[1], a[2], p(3), a[4], p(5), (int)a[6]);
                break;
            case SIG_Q8:
                bad = ((q8_fn)fn)(p(0), a[1], a[2], p(3), p(4), a[5], p(6), (int)a[7], (int)a[8]) ? 0 : -1;
                break;
            case SIG_Q4:
                bad = ((q4_fn)fn)(p(0), a[1], a[2], p(3), p(4), p(5), a[6], a[7], a[8], a[9], p(10), (int)a[11],
                                  (int)a[12]) ? 0 : -1;
                break;
            case SIG_ACT:
                ((act_fn)fn)(p(0), p(1), a[2], a[3], (int)a[4]);
                break;
            case SIG_ARGMAX:
                ((argmax_fn)fn)(p(0), a[1], a[2], a[3], p(4), (int)a[5]);
                break;
            case SIG_PAGED:
                bad = ((paged_fn)fn)(p(0), a[1], p(2), a[3], p(4), a[5], p(6), p(7), p(8), p(9), a[10], p(11), p(12),
                                     p(13), a[14], a[15], p(16), a[17], a[18], a[19], f32(a[20]), p(21), a[22], a[23],
                                     (int)a[24], a[25], f32(a[26]));
                break;
            case SIG_PAGED_I8:
                bad = ((paged_i8_fn)fn)(p(0), a[1], p(2), a[3], p(4), a[5], p(6), p(7), p(8), p(9), a[10], p(11),
                                        p(12), p(13), p(14), p(15), a[16], a[17], p(18), a[19], a[20], a[21],
                                        f32(a[22]), p(23), a[24], (int)a[25], a[26], f32(a[27]));
                break;
            case SIG_SHM_NORM: { /* its generation: the step's first one + this op's ordinal (argument 4) */
                const L done = ((shm_norm_fn)fn)(p(0), a[1], a[2], a[3], params[GEN_SLOT] + a[4], p(5), a[6], a[7],
                                                 a[8], a[9], p(10), p(11), p(12), p(13), f32(a[14]), (int)a[15]);
                if (done == 1 || done == 2) return i << 2 | done; /* the caller finishes the wait, then resumes */
                if (done) return i << 2;
                break;
            }
            default:
                return i << 2;
        }
#undef p
        if (bad >= 0) return i << 2;
    }
    return -1;
}
