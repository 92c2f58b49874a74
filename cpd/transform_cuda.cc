#include "cpd/transform_cuda.h"

#include <string>

#include "kernels/cuda/hadamard.h"
#include "kernels/grid.h"

namespace cpd {

Status HadamardAlongRowsCuda(const HadamardOptions& opts, float* d_x, size_t rows, size_t cols,
                             void* stream) {
  const uint32_t k = opts.block;
  if (k < 16 || k > 256 || (k & (k - 1)) != 0) {
    return Status::InvalidArgument("Hadamard block " + std::to_string(k) +
                                   " is not a power of two in 16..256");
  }
  if (rows * cols > 0 && d_x == nullptr) return Status::InvalidArgument("Hadamard: null buffer");
  const uint64_t key = opts.random_signs ? kernels::MakeRandomKey(opts.seed, opts.step) : 0;
  const kernels::cuda::CudaResult r = kernels::cuda::LaunchHadamardAlongRows(
      d_x, rows / k, cols, k, opts.random_signs, key, stream);
  if (r.ok()) return Status::Ok();
  return Status::Internal(std::string("CUDA error at ") + (r.file ? r.file : "?") + ":" +
                          std::to_string(r.line) + ": " + (r.expr ? r.expr : "?") + ": " +
                          (r.message ? r.message : "?") + " (" + std::to_string(r.code) + ")");
}

}  // namespace cpd
