/* AMX tile state shared by the kernels that use tiles (cpu_paged.c's scores, cpu_blocked.c's GEMM): the 64-byte
 * operand of ldtilecfg, and whether Linux lets this process use tile data. The tile paths are compiled only where
 * the build has AMX (__AMX_TILE__ and __AMX_BF16__: -march=native on a CPU with it) and each asks tpe_amx_ok()
 * at run time too, since Linux may refuse the tile state (a kernel before 5.16); a build without AMX never calls
 * it (its HAVE_AMX / BLK_AMX is 0). */
#pragma once

#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tpe_tilecfg; /* ldtilecfg's 64-byte operand */

/* 1 if Linux lets this process use AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM = 0x1023 for XTILEDATA =
 * feature 18; asked once per source file), else 0. */
static inline int tpe_amx_ok(void) {
    static int perm = -1;
    if (perm < 0) perm = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return perm;
}
