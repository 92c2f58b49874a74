// The direct path of cpu::Conv2dForward/Backward (runtime/engine/cpu_conv.h).
//
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
#include "runtime/engine/cpu_conv_direct.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "runtime/engine/cpu_internal.h"

namespace cpd::runtime::cpu::internal {

namespace {

constexpr int64_t kMaxDirectWidth = 4096;

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

}  // namespace

bool DirectEligible(const ConvShape& s) {
  const int vr = DirectRowsPerVector(s.w);
  return HasAvx512() && s.k == 3 && s.stride == 1 && s.pad == 1 && vr != 0 &&
         DirectBlock(s.oc, s.h, vr) != 0 && DirectBlock(s.c, s.h, vr) != 0 && s.oc % 2 == 0;
}

void DirectConv2dForward(const ConvShape& s, const float* x, const float* w, const float* bias,
                         float* y, ConvWorkspace* ws, int team) {
  const int64_t ckk = s.ckk(), ohw = s.ohw(), in_size = s.c * s.h * s.w;
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
}

void DirectConv2dBackward(const ConvShape& s, const float* x, const float* w, const float* dy,
                          float* dx, float* dw, int team, float* parts, int64_t part,
                          ConvWorkspace* ws) {
  const int64_t ckk = s.ckk(), ohw = s.ohw(), in_size = s.c * s.h * s.w, oc = s.oc;
  const int64_t dw_part = 16 * ckk * oc;
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
}

}  // namespace cpd::runtime::cpu::internal
