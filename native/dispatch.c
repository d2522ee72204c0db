/* ISA choice for every kernel: the best the CPU offers, found once, overridable for tests. */
#include "lever_kernels.h"

#if defined(LEVER_HAVE_NEON) && defined(__linux__)
#include <sys/auxv.h>
/* The NEON kernels use dot products (SDOT) and float16 arithmetic: Armv8.2's dotprod and fp16,
 * which phones' big cores have and older cores (Cortex-A53, A72, A73) do not. Built for them,
 * the library must still ask the CPU: on those cores every NEON kernel would be an illegal
 * instruction. Values from the kernel's uapi hwcap.h, spelled out for older libc headers. */
#define LEVER_HWCAP_ASIMDHP (1UL << 10)
#define LEVER_HWCAP_ASIMDDP (1UL << 20)
static int neon_usable(void) {
    unsigned long hw = getauxval(AT_HWCAP);
    return (hw & LEVER_HWCAP_ASIMDDP) && (hw & LEVER_HWCAP_ASIMDHP);
}
#elif defined(LEVER_HAVE_NEON)
static int neon_usable(void) { return 1; } /* Apple silicon: every M-series and A14+ core has both */
#endif

static int g_isa = -1;

int lever_isa_best(void) {
#if defined(LEVER_HAVE_X86)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vnni"))
        return LEVER_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return LEVER_ISA_AVX2;
    return LEVER_ISA_SCALAR;
#elif defined(LEVER_HAVE_NEON)
    return neon_usable() ? LEVER_ISA_NEON : LEVER_ISA_SCALAR;
#else
    return LEVER_ISA_SCALAR;
#endif
}

int lever_get_isa(void) {
    if (g_isa < 0) g_isa = lever_isa_best();
    return g_isa;
}

int lever_set_isa(int isa) {
    int best = lever_isa_best();
    if (isa == LEVER_ISA_SCALAR) g_isa = isa;
#if defined(LEVER_HAVE_X86)
    else if (isa == LEVER_ISA_AVX2 && best >= LEVER_ISA_AVX2) g_isa = isa;
    else if (isa == LEVER_ISA_AVX512 && best == LEVER_ISA_AVX512) g_isa = isa;
#elif defined(LEVER_HAVE_NEON)
    else if (isa == LEVER_ISA_NEON && best == LEVER_ISA_NEON) g_isa = isa;
#endif
    else g_isa = best;
    return g_isa;
}
