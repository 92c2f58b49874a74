#include "runtime/engine/dnnl_conv.h"

#include "cpd/config.h"

#if CPD_WITH_DNNL
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <oneapi/dnnl/dnnl.hpp>
#include <stdexcept>
#include <unordered_map>
#include <utility>
#include <vector>
#endif

namespace cpd::runtime::cpu {

#if CPD_WITH_DNNL

namespace {

using dnnl::memory;
using Desc = memory::desc;
using Tag = memory::format_tag;
constexpr memory::data_type kF32 = memory::data_type::f32;

std::string ShapeString(const ConvShape& s) {
  return "x [" + std::to_string(s.n) + ", " + std::to_string(s.c) + ", " + std::to_string(s.h) +
         ", " + std::to_string(s.w) + "], " + std::to_string(s.oc) + " outputs, kernel " +
         std::to_string(s.k) + ", stride " + std::to_string(s.stride) + ", padding " +
         std::to_string(s.pad);
}

[[noreturn]] void Fail(const ConvShape& s, const char* what, const dnnl::error& e) {
  throw std::runtime_error(std::string("oneDNN convolution (") + ShapeString(s) + "): " + what +
                           ": " + e.what() + " (status " + std::to_string(int(e.status)) + ")");
}

// The CPU engine, created once and kept for the life of the process (thread-local streams and
// cached primitives refer to it until exit), or null when oneDNN cannot create one.
const dnnl::engine* Engine() {
  static const dnnl::engine* eng = []() -> const dnnl::engine* {
    try {
      return new dnnl::engine(dnnl::engine::kind::cpu, 0);
    } catch (const dnnl::error&) {
      return nullptr;
    }
  }();
  return eng;
}

// oneDNN wants its buffers 64-byte aligned.
constexpr size_t kAlign = 64;
size_t Aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Per thread: a stream and the arena for the blocked operands that do not outlive a call.
struct ThreadState {
  dnnl::stream stream;
  std::unique_ptr<char, decltype(&std::free)> arena{nullptr, &std::free};
  size_t bytes = 0;

  explicit ThreadState(const dnnl::engine& eng) : stream(eng) {}
  char* Reserve(size_t n) {
    if (n > bytes) {
      arena.reset(static_cast<char*>(std::aligned_alloc(kAlign, Aligned(n))));
      if (arena == nullptr) throw std::bad_alloc();
      bytes = Aligned(n);
    }
    return arena.get();
  }
};

ThreadState& Local() {
  thread_local ThreadState t(*Engine());
  return t;
}

// Hands out 64-byte aligned pieces of the thread's arena for one call.
class ArenaLayout {
 public:
  // Reserves room for `d` unless `needed` is false; returns its offset.
  size_t Add(const Desc& d, bool needed = true) {
    const size_t at = size_;
    if (needed) size_ += Aligned(d.get_size());
    return at;
  }
  size_t size() const { return size_; }

 private:
  size_t size_ = 0;
};

bool IsReference(const char* impl) { return std::string(impl).rfind("ref", 0) == 0; }

}  // namespace

// Everything the oneDNN path keeps for one (shape, bias, thread count).
struct DnnlConv {
  ConvShape s;
  bool bias = false;
  int threads = 0;
  bool supported = false;  // false: oneDNN only has its reference code for this shape
  std::string impl[3];     // forward, backward-data, backward-weights

  dnnl::convolution_forward fwd;
  dnnl::convolution_backward_data bwd_data;
  dnnl::convolution_backward_weights bwd_weights;
  Desc x_user, w_user, y_user, b_user;  // NCHW, OIHW, NCHW, X
  Desc x_fwd, w_fwd, y_fwd;             // what the primitives want
  Desc dy_bd, w_bd, dx_bd;
  Desc x_bw, dy_bw, dw_bw;
  size_t scratchpad = 0;

  // x re-laid out by the last forward (x_fwd != x_user only), and the x it was made from.
  memory x_blk;
  const float* fwd_x = nullptr;

  // Reorders between layouts, created at first use.
  std::vector<std::pair<std::pair<Desc, Desc>, dnnl::reorder>> reorders;

  bool Matches(const ConvShape& o, bool b, int t) const {
    return s.n == o.n && s.c == o.c && s.h == o.h && s.w == o.w && s.oc == o.oc && s.k == o.k &&
           s.stride == o.stride && s.pad == o.pad && bias == b && threads == t;
  }

  dnnl::reorder& Reorder(const Desc& from, const Desc& to) {
    for (auto& [key, r] : reorders) {
      if (key.first == from && key.second == to) return r;
    }
    const dnnl::engine& eng = *Engine();
    reorders.emplace_back(std::make_pair(from, to),
                          dnnl::reorder(dnnl::reorder::primitive_desc(eng, from, eng, to)));
    return reorders.back().second;
  }

  // Copies `from` (layout from.get_desc()) into `to` (another layout) on the stream.
  void Run(dnnl::stream& st, const memory& from, const memory& to) {
    Reorder(from.get_desc(), to.get_desc()).execute(st, {{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, to}});
  }
};

namespace {

void Build(DnnlConv* c) {
  const ConvShape& s = c->s;
  const dnnl::engine& eng = *Engine();
  const memory::dims x_dims{s.n, s.c, s.h, s.w}, w_dims{s.oc, s.c, s.k, s.k},
      y_dims{s.n, s.oc, s.oh, s.ow}, b_dims{s.oc}, strides{s.stride, s.stride}, pad{s.pad, s.pad};
  c->x_user = Desc(x_dims, kF32, Tag::nchw);
  c->w_user = Desc(w_dims, kF32, Tag::oihw);
  c->y_user = Desc(y_dims, kF32, Tag::nchw);
  c->b_user = Desc(b_dims, kF32, Tag::x);
  const Desc x_any(x_dims, kF32, Tag::any), w_any(w_dims, kF32, Tag::any),
      y_any(y_dims, kF32, Tag::any);
  // Direct convolution only: convolution_auto may pick Winograd on some CPUs, which rounds
  // differently from a direct sum.
  const auto alg = dnnl::algorithm::convolution_direct;
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);

  const auto fwd_desc =
      c->bias ? dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, alg, x_any,
                                                w_any, c->b_user, y_any, strides, pad, pad)
              : dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, alg, x_any,
                                                w_any, y_any, strides, pad, pad);
  const dnnl::convolution_forward::primitive_desc fpd(fwd_desc, attr, eng);
  const dnnl::convolution_backward_data::primitive_desc bdpd(
      dnnl::convolution_backward_data::desc(alg, x_any, w_any, y_any, strides, pad, pad), attr, eng,
      fpd);
  const auto bw_desc = c->bias ? dnnl::convolution_backward_weights::desc(
                                     alg, x_any, w_any, c->b_user, y_any, strides, pad, pad)
                               : dnnl::convolution_backward_weights::desc(alg, x_any, w_any, y_any,
                                                                          strides, pad, pad);
  const dnnl::convolution_backward_weights::primitive_desc bwpd(bw_desc, attr, eng, fpd);
  c->impl[0] = fpd.impl_info_str();
  c->impl[1] = bdpd.impl_info_str();
  c->impl[2] = bwpd.impl_info_str();
  c->supported = !IsReference(fpd.impl_info_str()) && !IsReference(bdpd.impl_info_str()) &&
                 !IsReference(bwpd.impl_info_str());
  if (!c->supported) return;
  c->x_fwd = fpd.src_desc();
  c->w_fwd = fpd.weights_desc();
  c->y_fwd = fpd.dst_desc();
  c->dy_bd = bdpd.diff_dst_desc();
  c->w_bd = bdpd.weights_desc();
  c->dx_bd = bdpd.diff_src_desc();
  c->x_bw = bwpd.src_desc();
  c->dy_bw = bwpd.diff_dst_desc();
  c->dw_bw = bwpd.diff_weights_desc();
  c->scratchpad = std::max({fpd.scratchpad_desc().get_size(), bdpd.scratchpad_desc().get_size(),
                            bwpd.scratchpad_desc().get_size()});
  c->fwd = dnnl::convolution_forward(fpd);
  c->bwd_data = dnnl::convolution_backward_data(bdpd);
  c->bwd_weights = dnnl::convolution_backward_weights(bwpd);
  if (c->x_fwd != c->x_user) c->x_blk = memory(c->x_fwd, eng);
}

// The workspace's state for this call, (re)built when the shape, bias or thread count changed.
DnnlConv* StateFor(const ConvShape& s, bool bias, ConvWorkspace* ws) {
  const int threads = omp_get_max_threads();
  if (ws->dnnl == nullptr || !ws->dnnl->Matches(s, bias, threads)) {
    auto c = std::make_shared<DnnlConv>();
    c->s = s;
    c->bias = bias;
    c->threads = threads;
    try {
      Build(c.get());
    } catch (const dnnl::error& e) {
      if (e.status != dnnl_unimplemented) Fail(s, "creating the primitives", e);
      c->supported = false;
    }
    ws->dnnl = std::move(c);
  }
  return ws->dnnl->supported ? ws->dnnl.get() : nullptr;
}

memory Wrap(const Desc& d, const float* p) { return memory(d, *Engine(), const_cast<float*>(p)); }

}  // namespace

namespace onednn {

bool Available() { return Engine() != nullptr; }

bool Conv2dForward(const ConvShape& s, const float* x, const float* w, const float* bias, float* y,
                   ConvWorkspace* ws) {
  DnnlConv* c = StateFor(s, bias != nullptr, ws);
  if (c == nullptr) return false;
  try {
    ThreadState& t = Local();
    ArenaLayout lay;
    const bool w_re = c->w_fwd != c->w_user, y_re = c->y_fwd != c->y_user;
    const size_t w_at = lay.Add(c->w_fwd, w_re), y_at = lay.Add(c->y_fwd, y_re);
    const size_t pad_at =
        lay.Add(Desc({memory::dim(c->scratchpad)}, memory::data_type::u8, Tag::x));
    char* arena = t.Reserve(lay.size());
    const dnnl::engine& eng = *Engine();

    const memory xu = Wrap(c->x_user, x), wu = Wrap(c->w_user, w), yu = Wrap(c->y_user, y);
    memory xm = xu, wm = wu, ym = yu;
    c->fwd_x = nullptr;  // x_blk is about to change
    if (c->x_fwd != c->x_user) {
      xm = c->x_blk;
      c->Run(t.stream, xu, xm);
    }
    if (w_re) {
      wm = memory(c->w_fwd, eng, arena + w_at);
      c->Run(t.stream, wu, wm);
    }
    if (y_re) ym = memory(c->y_fwd, eng, arena + y_at);
    const memory pad(Desc({memory::dim(c->scratchpad)}, memory::data_type::u8, Tag::x), eng,
                     arena + pad_at);
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, ym}, {DNNL_ARG_SCRATCHPAD, pad}};
    if (bias != nullptr) args.emplace(DNNL_ARG_BIAS, Wrap(c->b_user, bias));
    c->fwd.execute(t.stream, args);
    if (y_re) c->Run(t.stream, ym, yu);
    t.stream.wait();
    c->fwd_x = x;
  } catch (const dnnl::error& e) {
    c->fwd_x = nullptr;
    Fail(s, "forward", e);
  }
  return true;
}

bool Conv2dBackward(const ConvShape& s, const float* x, const float* w, const float* dy, float* dx,
                    float* dw, float* db, ConvWorkspace* ws) {
  // A state built by a forward with the other bias setting is rebuilt (dropping its blocked x).
  DnnlConv* c = StateFor(s, db != nullptr, ws);
  if (c == nullptr) return false;
  try {
    ThreadState& t = Local();
    const dnnl::engine& eng = *Engine();
    // x as the weight gradient wants it: the forward's blocked copy when it is of this x.
    const bool x_kept = c->x_bw == c->x_fwd && c->x_blk && c->fwd_x == x;
    const bool data = dx != nullptr;
    const bool dy_bd_re = data && c->dy_bd != c->y_user, w_bd_re = data && c->w_bd != c->w_user,
               dx_re = data && c->dx_bd != c->x_user;
    const bool dy_shared = data && c->dy_bw == c->dy_bd;  // the weight gradient reuses dy_bd
    const bool dy_bw_re = !dy_shared && c->dy_bw != c->y_user;
    const bool x_bw_re = !x_kept && c->x_bw != c->x_user, dw_re = c->dw_bw != c->w_user;
    ArenaLayout lay;
    const size_t dy_bd_at = lay.Add(c->dy_bd, dy_bd_re), w_bd_at = lay.Add(c->w_bd, w_bd_re),
                 dx_at = lay.Add(c->dx_bd, dx_re), dy_bw_at = lay.Add(c->dy_bw, dy_bw_re),
                 x_bw_at = lay.Add(c->x_bw, x_bw_re), dw_at = lay.Add(c->dw_bw, dw_re);
    const Desc pad_desc({memory::dim(c->scratchpad)}, memory::data_type::u8, Tag::x);
    const size_t pad_at = lay.Add(pad_desc);
    char* arena = t.Reserve(lay.size());
    const memory pad(pad_desc, eng, arena + pad_at);

    const memory dyu = Wrap(c->y_user, dy);
    memory dy_bd = dyu;
    if (data) {
      if (dy_bd_re) {
        dy_bd = memory(c->dy_bd, eng, arena + dy_bd_at);
        c->Run(t.stream, dyu, dy_bd);
      }
      const memory wu = Wrap(c->w_user, w);
      memory wm = wu;
      if (w_bd_re) {
        wm = memory(c->w_bd, eng, arena + w_bd_at);
        c->Run(t.stream, wu, wm);
      }
      const memory dxu = Wrap(c->x_user, dx);
      const memory dxm = dx_re ? memory(c->dx_bd, eng, arena + dx_at) : dxu;
      c->bwd_data.execute(t.stream, {{DNNL_ARG_DIFF_DST, dy_bd},
                                     {DNNL_ARG_WEIGHTS, wm},
                                     {DNNL_ARG_DIFF_SRC, dxm},
                                     {DNNL_ARG_SCRATCHPAD, pad}});
      if (dx_re) c->Run(t.stream, dxm, dxu);
    }
    memory dy_bw = dy_shared ? dy_bd : dyu;
    if (dy_bw_re) {
      dy_bw = memory(c->dy_bw, eng, arena + dy_bw_at);
      c->Run(t.stream, dyu, dy_bw);
    }
    const memory xu = Wrap(c->x_user, x);
    memory xm = x_kept ? c->x_blk : xu;
    if (x_bw_re) {
      xm = memory(c->x_bw, eng, arena + x_bw_at);
      c->Run(t.stream, xu, xm);
    }
    const memory dwu = Wrap(c->w_user, dw);
    const memory dwm = dw_re ? memory(c->dw_bw, eng, arena + dw_at) : dwu;
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, xm},
                                         {DNNL_ARG_DIFF_DST, dy_bw},
                                         {DNNL_ARG_DIFF_WEIGHTS, dwm},
                                         {DNNL_ARG_SCRATCHPAD, pad}};
    if (db != nullptr) args.emplace(DNNL_ARG_DIFF_BIAS, Wrap(c->b_user, db));
    c->bwd_weights.execute(t.stream, args);
    if (dw_re) c->Run(t.stream, dwm, dwu);
    t.stream.wait();
  } catch (const dnnl::error& e) {
    Fail(s, "backward", e);
  }
  return true;
}

std::string Describe(const ConvShape& s, bool bias) {
  if (!Available()) return "oneDNN: no CPU engine";
  ConvWorkspace ws;
  const bool ok = StateFor(s, bias, &ws) != nullptr;
  const DnnlConv& c = *ws.dnnl;
  return std::string(ok ? "" : "reference only (not used): ") + "fwd " + c.impl[0] + ", bwd_data " +
         c.impl[1] + ", bwd_weights " + c.impl[2];
}

}  // namespace onednn

#else  // !CPD_WITH_DNNL

struct DnnlConv {};

namespace onednn {

bool Available() { return false; }

bool Conv2dForward(const ConvShape&, const float*, const float*, const float*, float*,
                   ConvWorkspace*) {
  return false;
}

bool Conv2dBackward(const ConvShape&, const float*, const float*, const float*, float*, float*,
                    float*, ConvWorkspace*) {
  return false;
}

std::string Describe(const ConvShape&, bool) { return "oneDNN: not in this build"; }

}  // namespace onednn

#endif  // CPD_WITH_DNNL

}  // namespace cpd::runtime::cpu
