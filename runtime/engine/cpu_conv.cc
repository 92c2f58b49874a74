// The CPU convolution front end (runtime/engine/cpu_conv.h): im2col/col2im, the path choice, and
// Conv2dForward/Backward, which run the im2col path here and hand the others to
// cpu_conv_direct.cc and dnnl_conv.cc.
#include "runtime/engine/cpu_conv.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "runtime/engine/cpu_conv_direct.h"
#include "runtime/engine/cpu_gemm.h"
#include "runtime/engine/cpu_internal.h"
#include "runtime/engine/dnnl_conv.h"

namespace cpd::runtime::cpu {

using internal::AddBias;
using internal::kParallelMacs;
using internal::Reserve;
using internal::SumF;
using internal::TeamSize;

namespace {

// Threads for a convolution over n images: small ones run on the calling thread, where waking
// the team would cost more than it saves (and, on a loaded machine, a descheduled team member
// stalls the whole region).
int ConvTeam(const ConvShape& s) {
  const double macs = double(s.n) * double(s.oc) * double(s.ohw()) * double(s.ckk());
  if (macs < kParallelMacs) return 1;
  return int(std::min<int64_t>(TeamSize(), std::max<int64_t>(s.n, 1)));
}

// [rows, cols] -> [cols, rows]. Small matrices only (weights), so no blocking.
void TransposeAdd(int64_t rows, int64_t cols, const float* src, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] += src[r * cols + c];
  }
}

}  // namespace

// ---- im2col -----------------------------------------------------------------------------------

// The column matrix is built and consumed in tiles of whole output rows (ConvTileRows) rather
// than per image: a tile stays in L2 between im2col and the GEMM, which on the 2-core reference
// machine (L2 writes at ~40 GB/s) made the first ResNet-20 stage ~10% faster than one
// image-sized column matrix.
//
// Stride 1 with "same" padding (ow == w), the common case of ResNets, is special-cased: each
// row of a tile is then a slice of the input plane shifted by a constant flat offset, so it is
// one long copy, after which the few entries that wrapped around a row edge are fixed up.
namespace {

// Output columns ox whose input column ox * stride - pad + kj lies inside [0, w): [lo, hi).
inline void ValidRange(int64_t out, int64_t in, int64_t stride, int64_t offset, int64_t* lo,
                       int64_t* hi) {
  // ix = ox * stride + offset; need 0 <= ix < in. (No divisions for stride 1: this runs per
  // kernel tap and tile.)
  int64_t l, h;
  if (stride == 1) {
    l = offset >= 0 ? 0 : -offset;
    h = in - offset;
  } else {
    l = offset >= 0 ? 0 : (-offset + stride - 1) / stride;
    h = in - offset <= 0 ? 0 : (in - 1 - offset) / stride + 1;
  }
  l = std::min(l, out);
  h = std::clamp(h, l, out);
  *lo = l;
  *hi = h;
}

inline bool SamePadStride1(const ConvShape& s) { return s.stride == 1 && s.ow == s.w; }

// Output rows per tile: about 256 output positions (measured best of 32..1024 for ResNet-20).
int64_t ConvTileRows(const ConvShape& s) {
  return std::clamp<int64_t>(256 / std::max<int64_t>(s.ow, 1), 1, std::max<int64_t>(s.oh, 1));
}

// Output rows [oy0, oy0 + rows) of the tile whose input row iy = oy * stride - pad + ki is
// inside the image: [r_lo, r_hi) relative to oy0.
inline void ValidRows(const ConvShape& s, int64_t oy0, int64_t rows, int64_t ki, int64_t* r_lo,
                      int64_t* r_hi) {
  int64_t lo, hi;
  ValidRange(s.oh, s.h, s.stride, ki - s.pad, &lo, &hi);
  *r_lo = std::clamp(lo - oy0, int64_t(0), rows);
  *r_hi = std::clamp(hi - oy0, *r_lo, rows);
}

}  // namespace

CPD_CLONES void Im2ColRows(const ConvShape& s, const float* x, int64_t oy0, int64_t rows,
                           float* col) {
  const int64_t k = s.k, st = s.stride, ow = s.ow, w = s.w, p = rows * ow;
  const bool same = SamePadStride1(s);
  for (int64_t ch = 0; ch < s.c; ++ch) {
    const float* plane = x + ch * s.h * w;
    for (int64_t ki = 0; ki < k; ++ki) {
      int64_t r_lo, r_hi;
      ValidRows(s, oy0, rows, ki, &r_lo, &r_hi);
      for (int64_t kj = 0; kj < k; ++kj) {
        float* row = col + ((ch * k + ki) * k + kj) * p;
        int64_t xlo, xhi;
        ValidRange(ow, w, st, kj - s.pad, &xlo, &xhi);
        if (r_hi <= r_lo || xhi <= xlo) {
          for (int64_t i = 0; i < p; ++i) row[i] = 0.f;
          continue;
        }
        for (int64_t i = 0; i < r_lo * ow; ++i) row[i] = 0.f;
        for (int64_t i = r_hi * ow; i < p; ++i) row[i] = 0.f;
        if (same) {
          // row[q] = plane[(oy0 * w + q) + off] for q in [first, last): in-range reads only.
          const float* in = plane + oy0 * w + (ki - s.pad) * w + (kj - s.pad);
          const int64_t first = r_lo * w + xlo, last = (r_hi - 1) * w + xhi;
#pragma omp simd
          for (int64_t q = first; q < last; ++q) row[q] = in[q];
          for (int64_t r = r_lo; r < r_hi; ++r) {
            for (int64_t ox = 0; ox < xlo; ++ox) row[r * w + ox] = 0.f;
            for (int64_t ox = xhi; ox < w; ++ox) row[r * w + ox] = 0.f;
          }
          continue;
        }
        for (int64_t r = r_lo; r < r_hi; ++r) {
          float* out = row + r * ow;
          const float* in = plane + ((oy0 + r) * st - s.pad + ki) * w + (kj - s.pad);
          for (int64_t ox = 0; ox < xlo; ++ox) out[ox] = 0.f;
          if (st == 1) {
#pragma omp simd
            for (int64_t ox = xlo; ox < xhi; ++ox) out[ox] = in[ox];
          } else {
            for (int64_t ox = xlo; ox < xhi; ++ox) out[ox] = in[ox * st];
          }
          for (int64_t ox = xhi; ox < ow; ++ox) out[ox] = 0.f;
        }
      }
    }
  }
}

CPD_CLONES void Col2ImRows(const ConvShape& s, float* col, int64_t oy0, int64_t rows, float* dx) {
  const int64_t k = s.k, st = s.stride, ow = s.ow, w = s.w, p = rows * ow;
  const bool same = SamePadStride1(s);
  for (int64_t ch = 0; ch < s.c; ++ch) {
    float* plane = dx + ch * s.h * w;
    for (int64_t ki = 0; ki < k; ++ki) {
      int64_t r_lo, r_hi;
      ValidRows(s, oy0, rows, ki, &r_lo, &r_hi);
      for (int64_t kj = 0; kj < k; ++kj) {
        float* row = col + ((ch * k + ki) * k + kj) * p;
        int64_t xlo, xhi;
        ValidRange(ow, w, st, kj - s.pad, &xlo, &xhi);
        if (r_hi <= r_lo || xhi <= xlo) continue;
        if (same) {
          // The mirror of Im2ColRows' flat copy: zero the wrapped entries of the (scratch)
          // column row, then one long add.
          for (int64_t r = r_lo; r < r_hi; ++r) {
            for (int64_t ox = 0; ox < xlo; ++ox) row[r * w + ox] = 0.f;
            for (int64_t ox = xhi; ox < w; ++ox) row[r * w + ox] = 0.f;
          }
          float* out = plane + oy0 * w + (ki - s.pad) * w + (kj - s.pad);
          const int64_t first = r_lo * w + xlo, last = (r_hi - 1) * w + xhi;
#pragma omp simd
          for (int64_t q = first; q < last; ++q) out[q] += row[q];
          continue;
        }
        for (int64_t r = r_lo; r < r_hi; ++r) {
          const float* in = row + r * ow;
          float* out = plane + ((oy0 + r) * st - s.pad + ki) * w + (kj - s.pad);
          if (st == 1) {
#pragma omp simd
            for (int64_t ox = xlo; ox < xhi; ++ox) out[ox] += in[ox];
          } else {
            for (int64_t ox = xlo; ox < xhi; ++ox) out[ox * st] += in[ox];
          }
        }
      }
    }
  }
}

void Im2Col(const ConvShape& s, const float* x, float* col) { Im2ColRows(s, x, 0, s.oh, col); }

void Col2Im(const ConvShape& s, float* col, float* dx) {
  std::memset(dx, 0, size_t(s.c * s.h * s.w) * sizeof(float));
  Col2ImRows(s, col, 0, s.oh, dx);
}

// ---- Path choice -----------------------------------------------------------------------------

namespace {

// OverrideConvPath: -1 for none, else the ConvPath.
std::atomic<int> g_path_override{-1};

// Where oneDNN's primitives beat im2col + OpenBLAS (forward + backward, reorders included),
// measured with benchmarks/bench_conv on the models' shapes at batch 1, 8 and 128 on 2 threads
// of an AVX2 EPYC (benchmarks/RESULTS.md): oneDNN wins every ResNet-20 convolution of at least
// 2^20 multiply-adds (0.47-0.92x of im2col's time; 0.65x summed over the network at batch
// 128); below that im2col runs on the calling thread and wins (1x1 stride-2 shortcuts at batch
// 1: 2-3.6x slower through oneDNN) or ties. Single-channel inputs (LeNet-5's conv1) lose at
// every batch size (oneDNN's weight gradient for one input channel: 1.05x at batch 8, 1.27x at
// 128; 2.3x with 16 outputs), so they stay on im2col.
bool DnnlConvPreferred(const ConvShape& s) {
  const double macs = double(s.n) * double(s.oc) * double(s.ohw()) * double(s.ckk());
  return s.c > 1 && macs >= double(1 << 20);
}

}  // namespace

const char* ConvPathName(ConvPath p) {
  switch (p) {
    case ConvPath::kDirect:
      return "direct";
    case ConvPath::kDnnl:
      return "onednn";
    case ConvPath::kIm2col:
      break;
  }
  return "im2col";
}

bool ConvPathRuns(ConvPath p, const ConvShape& s) {
  switch (p) {
    case ConvPath::kDirect:
      return internal::DirectEligible(s);
    case ConvPath::kDnnl:
      return s.n >= 1 && !omp_in_parallel() && onednn::Available();
    case ConvPath::kIm2col:
      break;
  }
  return true;
}

ConvPath Conv2dPath(const ConvShape& s) {
  const int forced = g_path_override.load(std::memory_order_relaxed);
  if (forced >= 0) return ConvPathRuns(ConvPath(forced), s) ? ConvPath(forced) : ConvPath::kIm2col;
  if (ConvPathRuns(ConvPath::kDirect, s)) return ConvPath::kDirect;
  if (ConvPathRuns(ConvPath::kDnnl, s) && DnnlConvPreferred(s)) return ConvPath::kDnnl;
  return ConvPath::kIm2col;
}

void OverrideConvPath(std::optional<ConvPath> p) {
  g_path_override.store(p.has_value() ? int(*p) : -1);
}

// ---- Forward and backward ----------------------------------------------------------------------

void Conv2dForward(const ConvShape& s, const float* x, const float* w, const float* bias, float* y,
                   ConvWorkspace* ws, const kernels::Accumulation* acc) {
  const int64_t ckk = s.ckk(), ohw = s.ohw(), in_size = s.c * s.h * s.w;
  const ConvPath path = acc != nullptr ? ConvPath::kIm2col : Conv2dPath(s);
  if (path == ConvPath::kDnnl && onednn::Conv2dForward(s, x, w, bias, y, ws)) return;
  const int team = ConvTeam(s);
  UseSingleThreadedBlas();
  if (path == ConvPath::kDirect) {
    internal::DirectConv2dForward(s, x, w, bias, y, ws, team);
    return;
  }
  const int64_t tile_rows = ConvTileRows(s), tile = ckk * tile_rows * s.ow;
  float* cols = s.pointwise() ? nullptr : Reserve(&ws->col, size_t(team * tile));
  // Images in parallel (no synchronisation between them); within an image, row tiles.
#pragma omp parallel num_threads(team)
  {
    float* col = cols == nullptr ? nullptr : cols + omp_get_thread_num() * tile;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < s.n; ++i) {
      const float* xi = x + i * in_size;
      float* yi = y + i * s.oc * ohw;
      if (col == nullptr) {
        Sgemm(false, false, s.oc, ohw, ckk, 1.f, w, ckk, xi, ohw, 0.f, yi, ohw, acc);
      } else {
        for (int64_t oy0 = 0; oy0 < s.oh; oy0 += tile_rows) {
          const int64_t rows = std::min(tile_rows, s.oh - oy0), p = rows * s.ow;
          Im2ColRows(s, xi, oy0, rows, col);
          Sgemm(false, false, s.oc, p, ckk, 1.f, w, ckk, col, p, 0.f, yi + oy0 * s.ow, ohw, acc);
        }
      }
      if (bias != nullptr) AddBias(bias, s.oc, ohw, yi);
    }
  }
}

void Conv2dBackward(const ConvShape& s, const float* x, const float* w, const float* dy, float* dx,
                    float* dw, float* db, ConvWorkspace* ws, const kernels::Accumulation* acc) {
  const ConvPath path = acc != nullptr ? ConvPath::kIm2col : Conv2dPath(s);
  if (path == ConvPath::kDnnl && onednn::Conv2dBackward(s, x, w, dy, dx, dw, db, ws)) return;
  const int64_t ckk = s.ckk(), ohw = s.ohw(), in_size = s.c * s.h * s.w, oc = s.oc;
  const int team = ConvTeam(s);
  const bool direct = path == ConvPath::kDirect;
  // Per thread: the weight gradient ([oc, ckk, 16 lanes] on the direct path; [ckk, oc] = dW^T
  // on the GEMM path, where col dy^T runs faster in OpenBLAS than dy col^T for these shapes:
  // few output channels, long reduction), then db [oc].
  const int64_t dw_part = direct ? 16 * ckk * oc : ckk * oc;
  const int64_t part = dw_part + oc;
  float* parts = Reserve(&ws->partial, size_t(team * part));
  std::memset(parts, 0, size_t(team * part) * sizeof(float));
  UseSingleThreadedBlas();
  if (direct) {
    internal::DirectConv2dBackward(s, x, w, dy, dx, dw, team, parts, part, ws);
  } else {
    const int64_t tile_rows = ConvTileRows(s), tile = ckk * tile_rows * s.ow;
    // Per thread: a column tile of x and one of the gradient (unless pointwise).
    const int64_t col_per = s.pointwise() ? 0 : 2 * tile;
    float* cols = col_per == 0 ? nullptr : Reserve(&ws->col, size_t(team * col_per));
#pragma omp parallel num_threads(team)
    {
      const int tid = omp_get_thread_num();
      float* dwt = parts + tid * part;
      float* dbt = dwt + ckk * oc;
      float* col = cols == nullptr ? nullptr : cols + tid * col_per;
      float* dcol = col == nullptr ? nullptr : col + tile;
#pragma omp for schedule(static)
      for (int64_t i = 0; i < s.n; ++i) {
        const float* xi = x + i * in_size;
        const float* dyi = dy + i * oc * ohw;
        float* dxi = dx == nullptr ? nullptr : dx + i * in_size;
        for (int64_t o = 0; o < oc; ++o) dbt[o] += SumF(dyi + o * ohw, ohw);
        if (col == nullptr) {
          Sgemm(false, true, ckk, oc, ohw, 1.f, xi, ohw, dyi, ohw, 1.f, dwt, oc, acc);
          if (dxi != nullptr) {
            Sgemm(true, false, s.c, ohw, oc, 1.f, w, s.c, dyi, ohw, 0.f, dxi, ohw, acc);
          }
          continue;
        }
        if (dxi != nullptr) std::memset(dxi, 0, size_t(in_size) * sizeof(float));
        for (int64_t oy0 = 0; oy0 < s.oh; oy0 += tile_rows) {
          const int64_t rows = std::min(tile_rows, s.oh - oy0), p = rows * s.ow;
          const float* dyt = dyi + oy0 * s.ow;
          Im2ColRows(s, xi, oy0, rows, col);
          Sgemm(false, true, ckk, oc, p, 1.f, col, p, dyt, ohw, 1.f, dwt, oc, acc);
          if (dxi != nullptr) {
            Sgemm(true, false, ckk, p, oc, 1.f, w, ckk, dyt, ohw, 0.f, dcol, p, acc);
            Col2ImRows(s, dcol, oy0, rows, dxi);
          }
        }
      }
    }
    std::memset(dw, 0, size_t(oc * ckk) * sizeof(float));
    for (int t = 0; t < team; ++t) TransposeAdd(ckk, oc, parts + t * part, dw);
  }
  if (db != nullptr) {
    for (int64_t o = 0; o < oc; ++o) {
      float sum = 0.f;
      for (int t = 0; t < team; ++t) sum += parts[t * part + dw_part + o];
      db[o] = sum;
    }
  }
}

}  // namespace cpd::runtime::cpu
