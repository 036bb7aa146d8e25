// Permission to use AMX tiles (HALSTM_AMX, precision "bf16" on a CPU: the
// products of the forward and of the backward run on them).
// Part of the driver: included once, by driver.cpp.

#if HALSTM_AMX
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
