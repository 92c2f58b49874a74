// The CPU convolution front end (part of runtime/engine/cpu_ops.h, which includes it):
// im2col/col2im, the choice between the three ways of computing a convolution (im2col + OpenBLAS
// here, CPD's direct AVX-512 kernels in cpu_conv_direct.cc, oneDNN in runtime/engine/dnnl_conv.h)
// and Conv2dForward/Backward, which run the chosen one. Threading, determinism and layout as in
// runtime/cpu_ops.h.
#pragma once

#include <cstdint>
#include <optional>

#include "kernels/accumulate.h"
#include "runtime/engine/conv_shape.h"

namespace cpd::runtime::cpu {

// One image [c, h, w] -> its column matrix [c * k * k, oh * ow] (zeros where the kernel
// overlaps the padding).
void Im2Col(const ConvShape& s, const float* x, float* col);
// The adjoint of Im2Col: sums a column matrix into one image gradient [c, h, w] (written, not
// accumulated). `col` is scratch: entries that fall into the padding may be overwritten.
void Col2Im(const ConvShape& s, float* col, float* dx);
// The same for output rows [oy0, oy0 + rows) only: a column tile [c * k * k, rows * ow].
// Col2ImRows ADDS into dx (tiles overlap in the input), and may overwrite `col` as Col2Im.
void Im2ColRows(const ConvShape& s, const float* x, int64_t oy0, int64_t rows, float* col);
void Col2ImRows(const ConvShape& s, float* col, int64_t oy0, int64_t rows, float* dx);

// How Conv2dForward/Backward compute a shape. Which one is chosen (Conv2dPath) depends only on
// the shape, the CPU, the build, the thread count and OverrideConvPath, never on timings, so
// that a run repeats bit for bit. The paths sum in different orders, so results differ between
// them in the last bits.
enum class ConvPath {
  kIm2col,  // im2col in row tiles + OpenBLAS GEMMs (every shape, every CPU)
  kDirect,  // CPD's direct AVX-512 3x3 kernels (see Conv2dPath)
  kDnnl,    // oneDNN's convolution primitives (builds with CPD_WITH_DNNL; see Conv2dPath)
};
const char* ConvPathName(ConvPath p);  // "im2col", "direct", "onednn"

// The path Conv2dForward and Conv2dBackward take for `s` with omp_get_max_threads() threads:
//  * direct: 3x3, stride 1, padding 1, width 8 or a multiple of 16, channel counts divisible by
//    the register tile, on a CPU with AVX-512F and FMA;
//  * onednn: otherwise, in a build with oneDNN, outside an OpenMP parallel region, for the
//    shapes where it measured faster than im2col (the rule and its measurements:
//    DnnlConvPreferred in cpu_conv.cc, benchmarks/RESULTS.md);
//  * im2col: everything else (and where oneDNN has only its reference code for a shape).
ConvPath Conv2dPath(const ConvShape& s);
// Whether `p` can compute `s` here (CPU, build, shape; onednn also needs n >= 1 and a call from
// outside a parallel region), whatever Conv2dPath would choose.
bool ConvPathRuns(ConvPath p, const ConvShape& s);
// For tests and benchmarks that compare the paths on one machine: with a path, Conv2dPath
// returns it for every shape it can run (im2col for the others) instead of its own choice;
// with nullopt (the default) it chooses again. Thread-safe; takes effect at the next call.
void OverrideConvPath(std::optional<ConvPath> p);

// y = conv(x, w) + bias (bias may be null). The path of Conv2dPath: direct and im2col run the
// images in parallel (per image the direct kernel, or im2col in row tiles + OpenBLAS GEMMs);
// oneDNN parallelises inside its primitives. With `acc` (cpd-train --accumulate) the im2col
// path runs whatever Conv2dPath says, its GEMMs accumulating as kernels/accumulate.h emulates.
void Conv2dForward(const ConvShape& s, const float* x, const float* w, const float* bias, float* y,
                   ConvWorkspace* ws, const kernels::Accumulation* acc = nullptr);

// Given dy [n, oc, oh, ow]: writes dw [oc, c, k, k] and, when non-null, db [oc] (the batch's
// gradients, not accumulated) and dx [n, c, h, w] (computed with `w`).
// REQUIRED: when x and w are the pointers of this workspace's last Conv2dForward (same shape),
// their contents must not have changed since: the oneDNN path then reuses the copy of x it
// re-laid out in that forward. (Conv2d calls it so: its Backward uses the tensors of its last
// training forward, which must stay unchanged.)
// With `acc` as Conv2dForward. The weight gradient's products then run per row tile of one image
// (Conv2dForward's tiles), each tile's sum promoted into the float32 gradient: a sum never spans
// more than one tile, whatever `every` says.
void Conv2dBackward(const ConvShape& s, const float* x, const float* w, const float* dy, float* dx,
                    float* dw, float* db, ConvWorkspace* ws,
                    const kernels::Accumulation* acc = nullptr);

}  // namespace cpd::runtime::cpu
