// CUDA kernel of the block Hadamard transform (cpd/transform.h, kernels/hadamard.h): a launcher
// callable from plain C++, in the style of kernels/cuda/quantize.h (whose CudaResult it returns).
// It checks its arguments, launches on `stream` (a cudaStream_t; nullptr = the legacy default
// stream), never synchronises and never aborts; the cpd layer (cpd/transform_cuda.cc) turns the
// result into a cpd::Status.
//
// Bit for bit the CPU's HadamardAlongRows: each element goes through the same sequence of
// correctly rounded float32 operations (kernels/hadamard.h's butterflies, shared with the CPU
// loop; built with -fmad=false), stage h = 1, 2, ..., k/2 on rows (r, r + h), r & h == 0, the
// signs multiplied in at the first stage and the scale at the last.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/quantize.h"

namespace cpd::kernels::cuda {

// Transforms x (row-major, rows x cols, device memory) in place: each of the first `groups`
// groups of k consecutive rows, down every column; rows past them are not touched. k is a power
// of two in 16..256. Signs HadamardSign(key, i) when random_signs, else +1; the scale
// HadamardScale(k).
CudaResult LaunchHadamardAlongRows(float* x, size_t groups, size_t cols, uint32_t k,
                                   bool random_signs, uint64_t key, void* stream);

}  // namespace cpd::kernels::cuda
