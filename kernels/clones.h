// CPD_CLONES: a hot loop compiled for baseline x86-64, AVX2 and AVX-512, the loader picking the
// best one for the machine (GCC function multi-versioning). The loops are written branch-free so
// that GCC vectorises them; -ffp-contract=off keeps CPU results identical to the CUDA kernels.
// What a clone calls must be inlined into it (always_inline) to be compiled for its ISA.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CPD_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define CPD_CLONES
#endif
