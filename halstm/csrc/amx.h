// Permission to use AMX tiles (HALSTM_AMX_TILES: precision "bf16" on a CPU
// with AMX, HALSTM_CPU_BF16, whose products run on them; without AMX they
// run in vector registers and need no permission).
// Part of the driver: included once, by driver.cpp.

#if HALSTM_AMX_TILES
// Linux lets a process use AMX's tile data only once it asked for it
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); every thread
// of the process may then. Asked once; 0, or -1 with the error set.
int amx_permitted() {
    static const long rc = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                   18 /* XFEATURE_XTILEDATA */);
    if (rc) halide_error(nullptr, "halstm: the kernel refused AMX tile data "
                                  "(arch_prctl ARCH_REQ_XCOMP_PERM); precision 'bf16' "
                                  "needs Linux 5.16 or later on a CPU with AMX\n");
    return rc ? -1 : 0;
}
#endif
