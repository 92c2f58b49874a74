#include "runtime/cpu_ops.h"

#include <cblas.h>
#include <omp.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/grid.h"
#include "runtime/dnnl_conv.h"

// Hot loops are compiled for baseline x86-64, AVX2 and AVX-512 and picked at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CPD_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define CPD_CLONES
#endif

namespace cpd::runtime::cpu {

namespace {

// Below this many elements an elementwise pass costs less than waking the thread team (a few
// microseconds on an idle machine; up to a scheduler time slice on a loaded one, where a team
// member may be descheduled).
constexpr size_t kParallelElements = size_t(1) << 17;
// Below this many multiply-adds a GEMM or convolution is not worth splitting across threads.
constexpr double kParallelMacs = double(1 << 22);

// Threads for a parallel region started here: 1 when already inside one (nested regions would
// oversubscribe the cores).
int TeamSize() { return omp_in_parallel() ? 1 : omp_get_max_threads(); }

// Threads for a convolution over n images: small ones run on the calling thread, where waking
// the team would cost more than it saves (and, on a loaded machine, a descheduled team member
// stalls the whole region).
int ConvTeam(const ConvShape& s) {
  const double macs = double(s.n) * double(s.oc) * double(s.ohw()) * double(s.ckk());
  if (macs < kParallelMacs) return 1;
  return int(std::min<int64_t>(TeamSize(), std::max<int64_t>(s.n, 1)));
}

// Grows `t` to hold at least `n` floats; keeps the storage when it is already large enough.
float* Reserve(Tensor* t, size_t n) {
  if (t->numel() < n || t->device() != Device::kCpu) *t = Tensor({int64_t(n)});
  return t->data();
}

float SumF(const float* x, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i];
  return s;
}

// [rows, cols] -> [cols, rows]. Small matrices only (weights), so no blocking.
void TransposeAdd(int64_t rows, int64_t cols, const float* src, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] += src[r * cols + c];
  }
}

}  // namespace

void UseSingleThreadedBlas() {
  if (openblas_get_num_threads() != 1) openblas_set_num_threads(1);
}

// ---- GEMM -------------------------------------------------------------------------------------

void Sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    // BLAS leaves C untouched only for beta = 1; make the empty sum explicit.
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.f ? 0.f : beta * c[i * ldc + j];
    }
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, blasint(m), blasint(n), blasint(k), alpha, a,
              blasint(lda), b, blasint(ldb), beta, c, blasint(ldc));
}

void ParallelSgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                   const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                   int64_t ldc) {
  const int team = TeamSize();
  const double macs = double(m) * double(n) * double(k);
  if (team <= 1 || macs < kParallelMacs || m < 2 * 16) {
    UseSingleThreadedBlas();
    Sgemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  UseSingleThreadedBlas();
  // Row blocks in multiples of 16 (the micro-kernel height), as even as that allows.
  const int64_t blocks = std::min<int64_t>(team, m / 16);
  const int64_t per = ((m + blocks - 1) / blocks + 15) / 16 * 16;
#pragma omp parallel for num_threads(int(blocks)) schedule(static, 1)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t r0 = blk * per;
    const int64_t rows = std::min(per, m - r0);
    if (rows <= 0) continue;
    // Rows r0.. of op(A): rows of A, or columns of A when it is transposed.
    const float* a_blk = trans_a ? a + r0 : a + r0 * lda;
    Sgemm(trans_a, trans_b, rows, n, k, alpha, a_blk, lda, b, ldb, beta, c + r0 * ldc, ldc);
  }
}

// ---- Convolution ------------------------------------------------------------------------------

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

}  // namespace

// The column matrix is built and consumed in tiles of whole output rows (ConvTileRows) rather
// than per image: a tile stays in L2 between im2col and the GEMM, which on the 2-core reference
// machine (L2 writes at ~40 GB/s) made the first ResNet-20 stage ~10% faster than one
// image-sized column matrix.
//
// Stride 1 with "same" padding (ow == w), the common case of ResNets, is special-cased: each
// row of a tile is then a slice of the input plane shifted by a constant flat offset, so it is
// one long copy, after which the few entries that wrapped around a row edge are fixed up.
namespace {

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

// ---- Direct 3x3 convolution (AVX-512) ---------------------------------------------------------
// 3x3, stride 1, padding 1 convolutions (all but two of a CIFAR ResNet's) on images whose
// width is a multiple of 16, or exactly 8, run without a column matrix on CPUs with AVX-512:
// a register tile of R vectors x OB output channels (16 accumulators) takes, per input channel
// and tap, R vector loads and OB weight broadcasts for 16 FMAs. A vector is 16 columns of one
// row (VR = 1), or, for 8-pixel-wide images, 8 columns of two consecutive rows (VR = 2: the
// rows are adjacent in memory, so one load covers both). Image borders: masked loads drop the
// column left of 0 and right of w - 1; rows above and below the image come from a zero row
// (VR = 1) or a copy of the image with a zero row above and below (VR = 2, 8 x 8 images are
// small). On the reference machine this reaches ~160 GFLOP/s per core against ~70 for im2col
// + OpenBLAS at these sizes. The input gradient is the same kernel on dy with the weights
// transposed and flipped; the weight gradient has its own kernel (9 taps x 2 output channels
// of per-lane accumulators, summed once per batch). Other shapes and CPUs use the im2col path.
// The two paths sum in different orders, so results may differ in the last bits between
// machines with and without AVX-512.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CPD_DIRECT_CONV 1
#define CPD_AVX512 __attribute__((target("avx512f,fma")))
#define CPD_AVX512_LAMBDA __attribute__((target("avx512f,fma"), always_inline))
#else
#define CPD_DIRECT_CONV 0
#endif

namespace {

constexpr int64_t kMaxDirectWidth = 4096;

bool HasAvx512() {
#if CPD_DIRECT_CONV
  static const bool has = [] {
    __builtin_cpu_init();  // may run before libgcc's constructor has
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  }();
  return has;
#else
  return false;
#endif
}

// OverrideConvPath: -1 for none, else the ConvPath.
std::atomic<int> g_path_override{-1};

// Rows per vector: 1 for widths that are a multiple of 16, 2 for width 8, 0 otherwise.
int DirectRowsPerVector(int64_t w) {
  if (w == 8) return 2;
  return w % 16 == 0 && w <= kMaxDirectWidth ? 1 : 0;
}

// Output-channel block OB of the register tile (R = 16 / OB vectors) for `oc` outputs on `h`
// rows, or 0 when no tile fits.
int DirectBlock(int64_t oc, int64_t h, int vr) {
  if (vr == 0) return 0;
  if (h % (4 * vr) == 0 && oc % 4 == 0) return 4;
  if (h % (2 * vr) == 0 && oc % 8 == 0) return 8;
  if (h % vr == 0 && oc % 16 == 0) return 16;
  return 0;
}

bool DirectEligible(const ConvShape& s) {
  const int vr = DirectRowsPerVector(s.w);
  return HasAvx512() && s.k == 3 && s.stride == 1 && s.pad == 1 && vr != 0 &&
         DirectBlock(s.oc, s.h, vr) != 0 && DirectBlock(s.c, s.h, vr) != 0 && s.oc % 2 == 0;
}

// w [oc][c][3][3] -> [oc / ob][c][9][ob] (forward), or, for the input gradient, the transposed
// and flipped kernel w'[c][o][t] = w[o][c][8 - t] as [c / ob][oc][9][ob].
void PackDirect(const float* w, int64_t oc, int64_t c, int64_t ob, bool backward, float* out) {
  for (int64_t o = 0; o < oc; ++o) {
    for (int64_t ch = 0; ch < c; ++ch) {
      for (int64_t t = 0; t < 9; ++t) {
        if (backward) {
          out[(((ch / ob) * oc + o) * 9 + t) * ob + ch % ob] = w[(o * c + ch) * 9 + (8 - t)];
        } else {
          out[(((o / ob) * c + ch) * 9 + t) * ob + o % ob] = w[(o * c + ch) * 9 + t];
        }
      }
    }
  }
}

// [c][h][8] -> [c][h + 2][8] with zero rows -1 and h (the VR = 2 kernels' input).
void PadRows8(const float* x, int64_t c, int64_t h, float* out) {
  for (int64_t ch = 0; ch < c; ++ch) {
    float* o = out + ch * (h + 2) * 8;
    std::memset(o, 0, 8 * sizeof(float));
    std::memcpy(o + 8, x + ch * h * 8, size_t(h * 8) * sizeof(float));
    std::memset(o + (h + 1) * 8, 0, 8 * sizeof(float));
  }
}

#if CPD_DIRECT_CONV
// A zero row for the rows above and below the image (VR = 1; only its first w + 17 floats
// are read).
alignas(64) const float kZeroRow[kMaxDirectWidth + 64] = {};

// Pointer to column -1 of input row iy of channel plane `p` (VR = 1: the image, rows outside
// it read the zero row; VR = 2: the row-padded image, which has rows -1 .. h).
template <int VR>
inline const float* RowPtr(const float* p, int64_t iy, int64_t h, int64_t w) {
  if constexpr (VR == 1) return (iy >= 0 && iy < h ? p + iy * w : kZeroRow + 16) - 1;
  return p + (iy + 1) * 8 - 1;
}

// y [oc][h][w] = conv3x3(x, packed weights) for one image; x as RowPtr<VR> expects.
template <int VR, int R, int OB>
CPD_AVX512 void DirectConvImage(const float* x, int64_t c, int64_t h, int64_t w, const float* wpk,
                                int64_t oc, float* y) {
  const int64_t xplane = VR == 1 ? h * w : (h + 2) * 8;
  constexpr int64_t kVw = 16 / VR;  // columns per vector
  for (int64_t ob = 0; ob < oc / OB; ++ob) {
    const float* wb = wpk + ob * c * 9 * OB;
    for (int64_t oy = 0; oy < h; oy += R * VR) {
      for (int64_t ox0 = 0; ox0 < w; ox0 += kVw) {
        // Tap kj = 0 reads column ox0 - 1, kj = 2 column ox0 + kVw: masked at the edges.
        const __mmask16 m0 = VR == 2 ? 0xFEFE : ox0 == 0 ? 0xFFFE : 0xFFFF;
        const __mmask16 m2 = VR == 2 ? 0x7F7F : ox0 + 16 == w ? 0x7FFF : 0xFFFF;
        __m512 acc[OB][R];
#pragma GCC unroll 16
        for (int o = 0; o < OB; ++o) {
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) acc[o][r] = _mm512_setzero_ps();
        }
        for (int64_t ch = 0; ch < c; ++ch) {
          // Input rows oy - 1 .. oy + R * VR, pointing at column ox0 - 1.
          const float* rows[R * VR + 2];
#pragma GCC unroll 10
          for (int i = 0; i < R * VR + 2; ++i) {
            rows[i] = RowPtr<VR>(x + ch * xplane, oy - 1 + i, h, w) + ox0;
          }
          const float* wc = wb + ch * 9 * OB;
#pragma GCC unroll 3
          for (int ki = 0; ki < 3; ++ki) {
#pragma GCC unroll 3
            for (int kj = 0; kj < 3; ++kj) {
              const __mmask16 m = kj == 0 ? m0 : kj == 2 ? m2 : __mmask16(0xFFFF);
              __m512 xv[R];
#pragma GCC unroll 4
              for (int r = 0; r < R; ++r) {
                xv[r] = _mm512_maskz_loadu_ps(m, rows[r * VR + ki] + kj);
              }
              const float* wt = wc + (ki * 3 + kj) * OB;
#pragma GCC unroll 16
              for (int o = 0; o < OB; ++o) {
                const __m512 wv = _mm512_set1_ps(wt[o]);
#pragma GCC unroll 4
                for (int r = 0; r < R; ++r) acc[o][r] = _mm512_fmadd_ps(wv, xv[r], acc[o][r]);
              }
            }
          }
        }
#pragma GCC unroll 16
        for (int o = 0; o < OB; ++o) {
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            _mm512_storeu_ps(y + ((ob * OB + o) * h + oy + r * VR) * w + ox0, acc[o][r]);
          }
        }
      }
    }
  }
}

// dw16 [oc][c][9][16] += the weight gradient of `g` images per lane (the lanes are summed
// once per batch): dys[i] [oc][h][w], xs[i] as RowPtr<VR> expects. The accumulators of a
// (2 output channels, 1 input channel) block stay in registers across the g images, so small
// images (8 x 8: 4 vectors each) do not pay a flush per image.
template <int VR>
CPD_AVX512 void DirectWeightGradImages(const float* const* xs, const float* const* dys, int64_t g,
                                       int64_t c, int64_t h, int64_t w, int64_t oc, float* dw16) {
  const int64_t xplane = VR == 1 ? h * w : (h + 2) * 8, plane = h * w;
  constexpr int64_t kVw = 16 / VR;
  for (int64_t o0 = 0; o0 < oc; o0 += 2) {
    for (int64_t ch = 0; ch < c; ++ch) {
      __m512 acc[2][9];
#pragma GCC unroll 2
      for (int o = 0; o < 2; ++o) {
#pragma GCC unroll 9
        for (int t = 0; t < 9; ++t) acc[o][t] = _mm512_setzero_ps();
      }
      for (int64_t img = 0; img < g; ++img) {
        const float* xp = xs[img] + ch * xplane;
        const float* gp = dys[img] + o0 * plane;
        // Column chunks outside, rows inside: consecutive output rows share input rows, so
        // the tap vectors of input rows oy - 1 .. oy + 1 rotate through registers and each
        // step loads only VR new rows (3 loads per row instead of 9).
        for (int64_t ox0 = 0; ox0 < w; ox0 += kVw) {
          const __mmask16 m0 = VR == 2 ? 0xFEFE : ox0 == 0 ? 0xFFFE : 0xFFFF;
          const __mmask16 m2 = VR == 2 ? 0x7F7F : ox0 + 16 == w ? 0x7FFF : 0xFFFF;
          __m512 xv[3][3];  // [input row oy - 1 + ki][kj]
          auto load_row = [&](int ki, int64_t iy) CPD_AVX512_LAMBDA {
            const float* r = RowPtr<VR>(xp, iy, h, w) + ox0;
            xv[ki][0] = _mm512_maskz_loadu_ps(m0, r);
            xv[ki][1] = _mm512_loadu_ps(r + 1);
            xv[ki][2] = _mm512_maskz_loadu_ps(m2, r + 2);
          };
#pragma GCC unroll 3
          for (int ki = 0; ki < 3; ++ki) load_row(ki, ki - 1);
          for (int64_t oy = 0; oy < h; oy += VR) {
            const float* g0 = gp + oy * w + ox0;
#pragma GCC unroll 2
            for (int o = 0; o < 2; ++o) {
              const __m512 gv = _mm512_loadu_ps(g0 + o * plane);
#pragma GCC unroll 3
              for (int ki = 0; ki < 3; ++ki) {
#pragma GCC unroll 3
                for (int kj = 0; kj < 3; ++kj) {
                  acc[o][ki * 3 + kj] = _mm512_fmadd_ps(gv, xv[ki][kj], acc[o][ki * 3 + kj]);
                }
              }
            }
            if (oy + VR >= h) break;
            if constexpr (VR == 1) {
#pragma GCC unroll 3
              for (int kj = 0; kj < 3; ++kj) {
                xv[0][kj] = xv[1][kj];
                xv[1][kj] = xv[2][kj];
              }
              load_row(2, oy + 2);
            } else {
#pragma GCC unroll 3
              for (int kj = 0; kj < 3; ++kj) xv[0][kj] = xv[2][kj];
              load_row(1, oy + 2);
              load_row(2, oy + 3);
            }
          }
        }
      }
#pragma GCC unroll 2
      for (int o = 0; o < 2; ++o) {
#pragma GCC unroll 9
        for (int t = 0; t < 9; ++t) {
          float* d = dw16 + (((o0 + o) * c + ch) * 9 + t) * 16;
          _mm512_storeu_ps(d, _mm512_add_ps(_mm512_loadu_ps(d), acc[o][t]));
        }
      }
    }
  }
}

template <int VR>
void DirectConvDispatch(const float* x, int64_t c, int64_t h, int64_t w, const float* wpk,
                        int64_t oc, float* y) {
  switch (DirectBlock(oc, h, VR)) {
    case 4:
      DirectConvImage<VR, 4, 4>(x, c, h, w, wpk, oc, y);
      return;
    case 8:
      DirectConvImage<VR, 2, 8>(x, c, h, w, wpk, oc, y);
      return;
    default:
      DirectConvImage<VR, 1, 16>(x, c, h, w, wpk, oc, y);
      return;
  }
}
#endif  // CPD_DIRECT_CONV

// One image through the direct kernel (x as RowPtr expects for the width's VR).
void DirectConv(const float* x, int64_t c, int64_t h, int64_t w, const float* wpk, int64_t oc,
                float* y) {
#if CPD_DIRECT_CONV
  if (DirectRowsPerVector(w) == 2) {
    DirectConvDispatch<2>(x, c, h, w, wpk, oc, y);
  } else {
    DirectConvDispatch<1>(x, c, h, w, wpk, oc, y);
  }
#else
  (void)x, (void)c, (void)h, (void)w, (void)wpk, (void)oc, (void)y;
#endif
}

void DirectWeightGrad(const float* const* xs, const float* const* dys, int64_t g, int64_t c,
                      int64_t h, int64_t w, int64_t oc, float* dw16) {
#if CPD_DIRECT_CONV
  if (DirectRowsPerVector(w) == 2) {
    DirectWeightGradImages<2>(xs, dys, g, c, h, w, oc, dw16);
  } else {
    DirectWeightGradImages<1>(xs, dys, g, c, h, w, oc, dw16);
  }
#else
  (void)xs, (void)dys, (void)g, (void)c, (void)h, (void)w, (void)oc, (void)dw16;
#endif
}

// Images per weight-gradient group: about 1024 output positions.
constexpr int64_t kMaxGroup = 16;
int64_t DirectGroup(const ConvShape& s) {
  return std::clamp<int64_t>(1024 / std::max<int64_t>(s.h * s.w, 1), 1, kMaxGroup);
}

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

void AddBias(const float* bias, int64_t oc, int64_t ohw, float* y) {
  for (int64_t o = 0; o < oc; ++o) {
    const float bo = bias[o];
    float* row = y + o * ohw;
#pragma omp simd
    for (int64_t q = 0; q < ohw; ++q) row[q] += bo;
  }
}

}  // namespace

void Conv2dForward(const ConvShape& s, const float* x, const float* w, const float* bias, float* y,
                   ConvWorkspace* ws) {
  const int64_t ckk = s.ckk(), ohw = s.ohw(), in_size = s.c * s.h * s.w;
  const ConvPath path = Conv2dPath(s);
  if (path == ConvPath::kDnnl && onednn::Conv2dForward(s, x, w, bias, y, ws)) return;
  const int team = ConvTeam(s);
  UseSingleThreadedBlas();
  if (path == ConvPath::kDirect) {
    const int vr = DirectRowsPerVector(s.w);
    float* wpk = Reserve(&ws->packed, size_t(s.oc * ckk));
    PackDirect(w, s.oc, s.c, DirectBlock(s.oc, s.h, vr), false, wpk);
    // Per thread, for 8-pixel-wide images: the image with a zero row above and below.
    const int64_t pad_per = vr == 2 ? s.c * (s.h + 2) * 8 : 0;
    float* pads = pad_per == 0 ? nullptr : Reserve(&ws->col, size_t(team * pad_per));
#pragma omp parallel num_threads(team)
    {
      float* pad = pads == nullptr ? nullptr : pads + omp_get_thread_num() * pad_per;
#pragma omp for schedule(static)
      for (int64_t i = 0; i < s.n; ++i) {
        const float* xi = x + i * in_size;
        if (pad != nullptr) {
          PadRows8(xi, s.c, s.h, pad);
          xi = pad;
        }
        float* yi = y + i * s.oc * ohw;
        DirectConv(xi, s.c, s.h, s.w, wpk, s.oc, yi);
        if (bias != nullptr) AddBias(bias, s.oc, ohw, yi);
      }
    }
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
        Sgemm(false, false, s.oc, ohw, ckk, 1.f, w, ckk, xi, ohw, 0.f, yi, ohw);
      } else {
        for (int64_t oy0 = 0; oy0 < s.oh; oy0 += tile_rows) {
          const int64_t rows = std::min(tile_rows, s.oh - oy0), p = rows * s.ow;
          Im2ColRows(s, xi, oy0, rows, col);
          Sgemm(false, false, s.oc, p, ckk, 1.f, w, ckk, col, p, 0.f, yi + oy0 * s.ow, ohw);
        }
      }
      if (bias != nullptr) AddBias(bias, s.oc, ohw, yi);
    }
  }
}

void Conv2dBackward(const ConvShape& s, const float* x, const float* w, const float* dy, float* dx,
                    float* dw, float* db, ConvWorkspace* ws) {
  const ConvPath path = Conv2dPath(s);
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
    const int vr = DirectRowsPerVector(s.w);
    float* wpk = Reserve(&ws->packed, size_t(oc * ckk));
    if (dx != nullptr) PackDirect(w, oc, s.c, DirectBlock(s.c, s.h, vr), true, wpk);
    // Images go in groups (DirectGroup) through the weight-gradient kernel. For 8-pixel-wide
    // images each thread keeps row-padded copies of its group's x and of one image's dy.
    const int64_t group = DirectGroup(s), groups = (s.n + group - 1) / group;
    const int64_t xpad_size = s.c * (s.h + 2) * 8, dypad_size = oc * (s.h + 2) * 8;
    const int64_t pad_per = vr == 2 ? group * xpad_size + dypad_size : 0;
    float* pads = pad_per == 0 ? nullptr : Reserve(&ws->col, size_t(team * pad_per));
#pragma omp parallel num_threads(team)
    {
      const int tid = omp_get_thread_num();
      float* dwp = parts + tid * part;
      float* dbt = dwp + dw_part;
      float* xpad = pads == nullptr ? nullptr : pads + tid * pad_per;
      float* dypad = xpad == nullptr ? nullptr : xpad + group * xpad_size;
      const float* xs[kMaxGroup];
      const float* dys[kMaxGroup];
#pragma omp for schedule(static)
      for (int64_t gi = 0; gi < groups; ++gi) {
        const int64_t i0 = gi * group, g = std::min(group, s.n - i0);
        for (int64_t j = 0; j < g; ++j) {
          const int64_t i = i0 + j;
          dys[j] = dy + i * oc * ohw;
          for (int64_t o = 0; o < oc; ++o) dbt[o] += SumF(dys[j] + o * ohw, ohw);
          xs[j] = x + i * in_size;
          if (xpad != nullptr) {
            PadRows8(xs[j], s.c, s.h, xpad + j * xpad_size);
            xs[j] = xpad + j * xpad_size;
          }
          if (dx != nullptr) {
            const float* dy_in = dys[j];
            if (dypad != nullptr) {
              PadRows8(dys[j], oc, s.h, dypad);
              dy_in = dypad;
            }
            DirectConv(dy_in, oc, s.h, s.w, wpk, s.c, dx + i * in_size);
          }
        }
        DirectWeightGrad(xs, dys, g, s.c, s.h, s.w, oc, dwp);
      }
    }
    for (int64_t j = 0; j < oc * ckk; ++j) {
      float sum = 0.f;
      for (int t = 0; t < team; ++t) {
        const float* lanes = parts + t * part + j * 16;
        for (int l = 0; l < 16; ++l) sum += lanes[l];
      }
      dw[j] = sum;
    }
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
          Sgemm(false, true, ckk, oc, ohw, 1.f, xi, ohw, dyi, ohw, 1.f, dwt, oc);
          if (dxi != nullptr) {
            Sgemm(true, false, s.c, ohw, oc, 1.f, w, s.c, dyi, ohw, 0.f, dxi, ohw);
          }
          continue;
        }
        if (dxi != nullptr) std::memset(dxi, 0, size_t(in_size) * sizeof(float));
        for (int64_t oy0 = 0; oy0 < s.oh; oy0 += tile_rows) {
          const int64_t rows = std::min(tile_rows, s.oh - oy0), p = rows * s.ow;
          const float* dyt = dyi + oy0 * s.ow;
          Im2ColRows(s, xi, oy0, rows, col);
          Sgemm(false, true, ckk, oc, p, 1.f, col, p, dyt, ohw, 1.f, dwt, oc);
          if (dxi != nullptr) {
            Sgemm(true, false, ckk, p, oc, 1.f, w, ckk, dyt, ohw, 0.f, dcol, p);
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
      return DirectEligible(s);
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

// ---- Fully connected --------------------------------------------------------------------------

void LinearForward(int64_t n, int64_t in, int64_t out, const float* x, const float* w,
                   const float* bias, float* y) {
  ParallelSgemm(false, true, n, out, in, 1.f, x, in, w, in, 0.f, y, out);
  if (bias == nullptr) return;
  for (int64_t i = 0; i < n; ++i) {
    float* row = y + i * out;
#pragma omp simd
    for (int64_t o = 0; o < out; ++o) row[o] += bias[o];
  }
}

void LinearBackward(int64_t n, int64_t in, int64_t out, const float* x, const float* w,
                    const float* dy, float* dx, float* dw, float* db) {
  ParallelSgemm(true, false, out, in, n, 1.f, dy, out, x, in, 0.f, dw, in);
  if (db != nullptr) {
    std::fill(db, db + out, 0.f);
    for (int64_t i = 0; i < n; ++i) {
      const float* row = dy + i * out;
#pragma omp simd
      for (int64_t o = 0; o < out; ++o) db[o] += row[o];
    }
  }
  if (dx != nullptr) ParallelSgemm(false, false, n, in, out, 1.f, dy, out, w, in, 0.f, dx, in);
}

// ---- Batch normalisation ----------------------------------------------------------------------

namespace {

// Shifted sums of one channel segment: sum(x - k) and sum((x - k)^2).
CPD_CLONES void ShiftedSums(const float* x, int64_t n, float k, float* s1, float* s2) {
  float a = 0.f, b = 0.f;
#pragma omp simd reduction(+ : a, b)
  for (int64_t i = 0; i < n; ++i) {
    const float d = x[i] - k;
    a += d;
    b += d * d;
  }
  *s1 = a;
  *s2 = b;
}

// y = (x - m) * scale + b (not x * scale + (b - m * scale), which cancels when |m| >> std).
CPD_CLONES void ScaleShift(const float* x, int64_t n, float m, float scale, float b, bool relu,
                           float* y) {
  if (relu) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float v = (x[i] - m) * scale + b;
      y[i] = v < 0.f ? 0.f : v;
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - m) * scale + b;
  }
}

}  // namespace

void BatchNormTrainForward(int64_t n, int64_t c, int64_t hw, const float* x, const float* gamma,
                           const float* beta, float eps, bool relu, float* y, float* mean,
                           float* var, float* invstd) {
  const double count = double(n) * double(hw);
  const bool parallel = size_t(n * c * hw) >= kParallelElements && c > 1;
  // One channel per iteration: its n * hw values (at most a few hundred KiB in the models
  // here) stay in L2 between the statistics and the normalisation pass. The statistics take
  // one pass, as sums of x - k and (x - k)^2 with k = the channel's first value: shifting by a
  // sample keeps E[(x-k)^2] - E[x-k]^2 from cancelling when |mean| >> std.
#pragma omp parallel for schedule(static) if (parallel) num_threads(TeamSize())
  for (int64_t ch = 0; ch < c; ++ch) {
    const float k = x[ch * hw];
    double s1 = 0, s2 = 0;
    for (int64_t i = 0; i < n; ++i) {
      float a, b;
      ShiftedSums(x + (i * c + ch) * hw, hw, k, &a, &b);
      s1 += a;
      s2 += b;
    }
    const double d = s1 / count;
    const double v = std::max(s2 / count - d * d, 0.0);
    const float m = float(double(k) + d);
    const float is = float(1.0 / std::sqrt(v + double(eps)));
    mean[ch] = m;
    var[ch] = float(v);
    invstd[ch] = is;
    const float scale = gamma[ch] * is;
    for (int64_t i = 0; i < n; ++i) {
      ScaleShift(x + (i * c + ch) * hw, hw, m, scale, beta[ch], relu, y + (i * c + ch) * hw);
    }
  }
}

void BatchNormEvalForward(int64_t n, int64_t c, int64_t hw, const float* x, const float* gamma,
                          const float* beta, const float* mean, const float* var, float eps,
                          bool relu, float* y) {
  const bool parallel = size_t(n * c * hw) >= kParallelElements;
#pragma omp parallel for schedule(static) if (parallel) num_threads(TeamSize())
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t ch = 0; ch < c; ++ch) {
      const float scale = gamma[ch] * float(1.0 / std::sqrt(double(var[ch]) + double(eps)));
      ScaleShift(x + (i * c + ch) * hw, hw, mean[ch], scale, beta[ch], relu, y + (i * c + ch) * hw);
    }
  }
}

namespace {

// sum(g) and sum(g * (x - m)) of one segment, g = dy (masked by y > 0 when y is non-null).
CPD_CLONES void BackwardSums(const float* x, const float* dy, const float* y, int64_t n, float m,
                             float* s1, float* s2) {
  float a = 0.f, b = 0.f;
  if (y != nullptr) {
#pragma omp simd reduction(+ : a, b)
    for (int64_t i = 0; i < n; ++i) {
      const float g0 = dy[i];
      const float g = y[i] > 0.f ? g0 : 0.f;
      a += g;
      b += g * (x[i] - m);
    }
  } else {
#pragma omp simd reduction(+ : a, b)
    for (int64_t i = 0; i < n; ++i) {
      a += dy[i];
      b += dy[i] * (x[i] - m);
    }
  }
  *s1 = a;
  *s2 = b;
}

CPD_CLONES void BackwardApply(const float* x, const float* dy, const float* y, int64_t n, float m,
                              float k1, float k2, float k3, float* dx) {
  if (y != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float g0 = dy[i];
      const float g = y[i] > 0.f ? g0 : 0.f;
      dx[i] = k1 * g - k2 * (x[i] - m) - k3;
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dx[i] = k1 * dy[i] - k2 * (x[i] - m) - k3;
  }
}

}  // namespace

void BatchNormBackward(int64_t n, int64_t c, int64_t hw, const float* x, const float* dy,
                       const float* relu_y, const float* gamma, const float* mean,
                       const float* invstd, float* dx, float* dgamma, float* dbeta) {
  const double count = double(n) * double(hw);
  const bool parallel = size_t(n * c * hw) >= kParallelElements && c > 1;
#pragma omp parallel for schedule(static) if (parallel) num_threads(TeamSize())
  for (int64_t ch = 0; ch < c; ++ch) {
    const float m = mean[ch];
    double sum_dy = 0, sum_dy_xc = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t off = (i * c + ch) * hw;
      float a, b;
      BackwardSums(x + off, dy + off, relu_y == nullptr ? nullptr : relu_y + off, hw, m, &a, &b);
      sum_dy += a;
      sum_dy_xc += b;
    }
    const double is = invstd[ch];
    dbeta[ch] = float(sum_dy);
    dgamma[ch] = float(sum_dy_xc * is);
    // dx = gamma * invstd * (dy - mean(dy) - xhat * mean(dy * xhat)), with xhat = (x - m) * is:
    // dx = k1 * dy - k2 * (x - m) - k3.
    const double k1 = double(gamma[ch]) * is;
    const float k2 = float(k1 * is * is * sum_dy_xc / count);
    const float k3 = float(k1 * sum_dy / count);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t off = (i * c + ch) * hw;
      BackwardApply(x + off, dy + off, relu_y == nullptr ? nullptr : relu_y + off, hw, m, float(k1),
                    k2, k3, dx + off);
    }
  }
}

// ---- Pooling ----------------------------------------------------------------------------------

// The common 2x2 / stride-2 window without branches, so that the compiler vectorises across
// output columns. Same semantics as the general loop: the first maximum in (row, column) order
// wins, and a NaN wins over any number and stays.
CPD_CLONES void MaxPool2x2Forward(int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow,
                                  const float* x, float* y, int32_t* argmax, bool parallel) {
#pragma omp parallel for schedule(static) if (parallel) num_threads(TeamSize())
  for (int64_t pl = 0; pl < planes; ++pl) {
    const float* xp = x + pl * h * w;
    for (int64_t oy = 0; oy < oh; ++oy) {
      const float* r0 = xp + 2 * oy * w;
      const float* r1 = r0 + w;
      float* yr = y + (pl * oh + oy) * ow;
      int32_t* ar = argmax + (pl * oh + oy) * ow;
      const int32_t row0 = int32_t(2 * oy * w), row1 = int32_t((2 * oy + 1) * w);
#pragma omp simd
      for (int64_t ox = 0; ox < ow; ++ox) {
        const float a = r0[2 * ox], b = r0[2 * ox + 1], c = r1[2 * ox], d = r1[2 * ox + 1];
        float bv = a;
        int32_t bi = row0 + int32_t(2 * ox);
        bool up = (b > bv) | ((b != b) & (bv == bv));
        bv = up ? b : bv;
        bi = up ? row0 + int32_t(2 * ox + 1) : bi;
        up = (c > bv) | ((c != c) & (bv == bv));
        bv = up ? c : bv;
        bi = up ? row1 + int32_t(2 * ox) : bi;
        up = (d > bv) | ((d != d) & (bv == bv));
        bv = up ? d : bv;
        bi = up ? row1 + int32_t(2 * ox + 1) : bi;
        yr[ox] = bv;
        ar[ox] = bi;
      }
    }
  }
}

#if CPD_DIRECT_CONV
// The 2x2 / stride-2 window with AVX-512: 16 output columns per step, each input row pair
// de-interleaved into even and odd columns; the same compare chain as MaxPool2x2Forward, so
// the results (argmax included) are identical. Tails use masked loads and stores.
CPD_AVX512 void MaxPool2x2ForwardAvx512(int64_t planes, int64_t h, int64_t w, int64_t oh,
                                        int64_t ow, const float* x, float* y, int32_t* argmax,
                                        bool parallel) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
#pragma omp parallel for schedule(static) if (parallel) num_threads(TeamSize())
  for (int64_t pl = 0; pl < planes; ++pl) {
    const float* xp = x + pl * h * w;
    for (int64_t oy = 0; oy < oh; ++oy) {
      const float* r0 = xp + 2 * oy * w;
      const float* r1 = r0 + w;
      float* yr = y + (pl * oh + oy) * ow;
      int32_t* ar = argmax + (pl * oh + oy) * ow;
      const __m512i row0 = _mm512_set1_epi32(int32_t(2 * oy * w));
      const __m512i row1 = _mm512_set1_epi32(int32_t((2 * oy + 1) * w));
      for (int64_t ox = 0; ox < ow; ox += 16) {
        const int64_t n = std::min<int64_t>(16, ow - ox);  // output columns in this step
        const __mmask16 out_mask = __mmask16((1u << n) - 1u);
        const int64_t in_n = 2 * n;  // input floats per row
        const __mmask16 lo_mask = __mmask16(in_n >= 16 ? 0xFFFFu : (1u << in_n) - 1u);
        const __mmask16 hi_mask = __mmask16(in_n >= 32  ? 0xFFFFu
                                            : in_n > 16 ? (1u << (in_n - 16)) - 1u
                                                        : 0u);
        const float* p0 = r0 + 2 * ox;
        const float* p1 = r1 + 2 * ox;
        const __m512 l0 = _mm512_maskz_loadu_ps(lo_mask, p0),
                     h0 = _mm512_maskz_loadu_ps(hi_mask, p0 + 16);
        const __m512 l1 = _mm512_maskz_loadu_ps(lo_mask, p1),
                     h1 = _mm512_maskz_loadu_ps(hi_mask, p1 + 16);
        const __m512 a = _mm512_permutex2var_ps(l0, even, h0),
                     b = _mm512_permutex2var_ps(l0, odd, h0);
        const __m512 c = _mm512_permutex2var_ps(l1, even, h1),
                     d = _mm512_permutex2var_ps(l1, odd, h1);
        const __m512i col = _mm512_add_epi32(_mm512_set1_epi32(int32_t(2 * ox)), even);
        __m512 bv = a;
        __m512i bi = _mm512_add_epi32(row0, col);
        auto step = [&](__m512 v, __m512i idx) CPD_AVX512_LAMBDA {
          const __mmask16 up =
              _mm512_cmp_ps_mask(v, bv, _CMP_GT_OQ) |
              (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) & _mm512_cmp_ps_mask(bv, bv, _CMP_ORD_Q));
          bv = _mm512_mask_blend_ps(up, bv, v);
          bi = _mm512_mask_blend_epi32(up, bi, idx);
        };
        const __m512i one = _mm512_set1_epi32(1);
        step(b, _mm512_add_epi32(_mm512_add_epi32(row0, col), one));
        step(c, _mm512_add_epi32(row1, col));
        step(d, _mm512_add_epi32(_mm512_add_epi32(row1, col), one));
        _mm512_mask_storeu_ps(yr + ox, out_mask, bv);
        _mm512_mask_storeu_epi32(ar + ox, out_mask, bi);
      }
    }
  }
}
#endif

void MaxPool2dForward(int64_t planes, int64_t h, int64_t w, int64_t k, int64_t stride, int64_t oh,
                      int64_t ow, const float* x, float* y, int32_t* argmax) {
  const bool parallel = size_t(planes * h * w) >= kParallelElements;
  if (k == 2 && stride == 2) {
#if CPD_DIRECT_CONV
    if (HasAvx512()) {
      MaxPool2x2ForwardAvx512(planes, h, w, oh, ow, x, y, argmax, parallel);
      return;
    }
#endif
    MaxPool2x2Forward(planes, h, w, oh, ow, x, y, argmax, parallel);
    return;
  }
#pragma omp parallel for schedule(static) if (parallel) num_threads(TeamSize())
  for (int64_t pl = 0; pl < planes; ++pl) {
    const float* xp = x + pl * h * w;
    float* yp = y + pl * oh * ow;
    int32_t* ap = argmax + pl * oh * ow;
    for (int64_t oy = 0; oy < oh; ++oy) {
      for (int64_t ox = 0; ox < ow; ++ox) {
        int64_t best = oy * stride * w + ox * stride;
        float bv = xp[best];
        for (int64_t ki = 0; ki < k; ++ki) {
          for (int64_t kj = 0; kj < k; ++kj) {
            const int64_t idx = (oy * stride + ki) * w + ox * stride + kj;
            // NaN wins (and stays), as in PyTorch: a NaN input must not vanish silently.
            if (xp[idx] > bv || (std::isnan(xp[idx]) && !std::isnan(bv))) {
              bv = xp[idx];
              best = idx;
            }
          }
        }
        yp[oy * ow + ox] = bv;
        ap[oy * ow + ox] = int32_t(best);
      }
    }
  }
}

void MaxPool2dBackward(int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow,
                       const float* dy, const int32_t* argmax, float* dx) {
  const bool parallel = size_t(planes * h * w) >= kParallelElements;
#pragma omp parallel for schedule(static) if (parallel) num_threads(TeamSize())
  for (int64_t pl = 0; pl < planes; ++pl) {
    float* dp = dx + pl * h * w;
    std::memset(dp, 0, size_t(h * w) * sizeof(float));
    const float* gp = dy + pl * oh * ow;
    const int32_t* ap = argmax + pl * oh * ow;
    for (int64_t j = 0; j < oh * ow; ++j) dp[ap[j]] += gp[j];
  }
}

void AvgPool2dForward(int64_t planes, int64_t h, int64_t w, int64_t k, int64_t stride, int64_t oh,
                      int64_t ow, const float* x, float* y) {
  const float inv = 1.f / float(k * k);
  const bool parallel = size_t(planes * h * w) >= kParallelElements;
#pragma omp parallel for schedule(static) if (parallel) num_threads(TeamSize())
  for (int64_t pl = 0; pl < planes; ++pl) {
    const float* xp = x + pl * h * w;
    float* yp = y + pl * oh * ow;
    for (int64_t oy = 0; oy < oh; ++oy) {
      for (int64_t ox = 0; ox < ow; ++ox) {
        float s = 0.f;
        for (int64_t ki = 0; ki < k; ++ki) {
          const float* row = xp + (oy * stride + ki) * w + ox * stride;
          for (int64_t kj = 0; kj < k; ++kj) s += row[kj];
        }
        yp[oy * ow + ox] = s * inv;
      }
    }
  }
}

void AvgPool2dBackward(int64_t planes, int64_t h, int64_t w, int64_t k, int64_t stride, int64_t oh,
                       int64_t ow, const float* dy, float* dx) {
  const float inv = 1.f / float(k * k);
  const bool parallel = size_t(planes * h * w) >= kParallelElements;
#pragma omp parallel for schedule(static) if (parallel) num_threads(TeamSize())
  for (int64_t pl = 0; pl < planes; ++pl) {
    float* dp = dx + pl * h * w;
    std::memset(dp, 0, size_t(h * w) * sizeof(float));
    const float* gp = dy + pl * oh * ow;
    for (int64_t oy = 0; oy < oh; ++oy) {
      for (int64_t ox = 0; ox < ow; ++ox) {
        const float g = gp[oy * ow + ox] * inv;
        for (int64_t ki = 0; ki < k; ++ki) {
          float* row = dp + (oy * stride + ki) * w + ox * stride;
          for (int64_t kj = 0; kj < k; ++kj) row[kj] += g;
        }
      }
    }
  }
}

void GlobalAvgPoolForward(int64_t planes, int64_t hw, const float* x, float* y) {
  const bool parallel = size_t(planes * hw) >= kParallelElements;
#pragma omp parallel for schedule(static) if (parallel) num_threads(TeamSize())
  for (int64_t pl = 0; pl < planes; ++pl) {
    y[pl] = float(double(SumF(x + pl * hw, hw)) / double(hw));
  }
}

void GlobalAvgPoolBackward(int64_t planes, int64_t hw, const float* dy, float* dx) {
  const float inv = 1.f / float(hw);
  const bool parallel = size_t(planes * hw) >= kParallelElements;
#pragma omp parallel for schedule(static) if (parallel) num_threads(TeamSize())
  for (int64_t pl = 0; pl < planes; ++pl) {
    const float g = dy[pl] * inv;
    float* dp = dx + pl * hw;
#pragma omp simd
    for (int64_t p = 0; p < hw; ++p) dp[p] = g;
  }
}

// ---- Elementwise ------------------------------------------------------------------------------

void Relu(size_t n, const float* x, float* y) {
  // `x < 0 ? 0 : x` keeps NaN (std::max(x, 0.f) would too, but not max(0.f, x)).
#pragma omp parallel for simd schedule(static) if (n >= kParallelElements) num_threads(TeamSize())
  for (size_t i = 0; i < n; ++i) y[i] = x[i] < 0.f ? 0.f : x[i];
}

void ReluBackward(size_t n, const float* y, const float* dy, float* dx) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelElements) num_threads(TeamSize())
  for (size_t i = 0; i < n; ++i) {
    // Both loads unconditional, so that the select vectorises (a conditional load does not).
    const float g = dy[i];
    dx[i] = y[i] > 0.f ? g : 0.f;
  }
}

void AddRelu(size_t n, const float* a, const float* b, float* y) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelElements) num_threads(TeamSize())
  for (size_t i = 0; i < n; ++i) {
    const float s = a[i] + b[i];
    y[i] = s < 0.f ? 0.f : s;
  }
}

void Add(size_t n, const float* a, const float* b, float* y) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelElements) num_threads(TeamSize())
  for (size_t i = 0; i < n; ++i) y[i] = a[i] + b[i];
}

void AddInPlace(size_t n, const float* x, float* y) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelElements) num_threads(TeamSize())
  for (size_t i = 0; i < n; ++i) y[i] += x[i];
}

void DropoutApply(size_t n, uint64_t key, uint32_t threshold, float scale, const float* x,
                  float* y) {
#pragma omp parallel for schedule(static) if (n >= kParallelElements) num_threads(TeamSize())
  for (size_t i = 0; i < n; ++i) {
    const float v = x[i] * scale;
    y[i] = kernels::RandomBits(key, uint64_t(i)) >= threshold ? v : 0.f;
  }
}

// ---- Loss -------------------------------------------------------------------------------------

double SoftmaxCrossEntropy(int64_t n, int64_t k, const float* logits, const int32_t* labels,
                           float* dlogits) {
  double total = 0;
  const double inv_n = 1.0 / double(n);
  for (int64_t i = 0; i < n; ++i) {
    const float* row = logits + i * k;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < k; ++j) mx = std::max(mx, row[j]);
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += std::exp(double(row[j]) - double(mx));
    const double log_sum = std::log(sum);
    total += log_sum - (double(row[labels[i]]) - double(mx));
    if (dlogits != nullptr) {
      float* d = dlogits + i * k;
      for (int64_t j = 0; j < k; ++j) {
        const double p = std::exp(double(row[j]) - double(mx) - log_sum);
        d[j] = float((p - (j == labels[i] ? 1.0 : 0.0)) * inv_n);
      }
    }
  }
  return total * inv_n;
}

}  // namespace cpd::runtime::cpu
