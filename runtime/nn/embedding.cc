#include "runtime/nn/embedding.h"

#include <cmath>
#include <random>
#include <stdexcept>

#include "runtime/engine/cpu_ops.h"
#include "runtime/engine/cpu_transformer.h"
#include "runtime/engine/cuda_transformer.h"
#include "runtime/nn/layers_internal.h"

namespace cpd::runtime {

using internal::MakeParam;
using internal::Misfit;
using internal::RequireDevice;
using internal::RequireReady;
using internal::RequireShape;
using internal::WeightGradSite;
using internal::WeightSite;
using internal::Where;

namespace {

// GPT-2 initialises its embeddings with N(0, 0.02^2).
constexpr float kGpt2InitStd = 0.02f;

}  // namespace

// ---- TokenEmbedding ---------------------------------------------------------------------------

TokenEmbedding::TokenEmbedding(std::string name, int64_t vocab, int64_t embed, uint64_t seed)
    : ShapedLayer(std::move(name)), vocab_(vocab), embed_(embed) {
  if (vocab < 1 || vocab >= (int64_t(1) << 24) || embed < 1) {
    throw std::invalid_argument(this->name() +
                                " (TokenEmbedding): needs 1 <= vocab < 2^24 and embed >= 1, got " +
                                std::to_string(vocab) + " and " + std::to_string(embed));
  }
  weight_ = MakeParam(this->name() + ".weight", {vocab, embed}, true);
  std::mt19937_64 gen(seed);
  FillNormal(&weight_.value, kGpt2InitStd, &gen);
}

std::string TokenEmbedding::Describe() const {
  return "TokenEmbedding(vocab " + std::to_string(vocab_) + ", embed " + std::to_string(embed_) +
         ")";
}

std::vector<int64_t> TokenEmbedding::OutputShape(const std::vector<int64_t>& in) const {
  if (in.size() != 2) Misfit(*this, in, "[B, T] token ids");
  return {in[0], in[1], embed_};
}

Tensor TokenEmbedding::Forward(const Tensor& ids, bool train) {
  const Device dev = weight_.value.device();
  RequireDevice(*this, ids, "the input (token ids)", dev);
  const std::vector<int64_t> out_shape = OutputShape(ids.shape());
  // The ids are checked on the host (a copy of them for a GPU layer), so that an id outside the
  // table is this message, never a read outside the table on a device.
  const Tensor host_ids = OnHost(ids);
  ids_.resize(host_ids.numel());
  for (size_t i = 0; i < host_ids.numel(); ++i) {
    const float v = host_ids.data()[i];
    if (!(v >= 0.f && v < float(vocab_)) || v != std::floor(v)) {
      throw std::invalid_argument(Where(*this) + ": token id " + internal::FormatFloat(v) +
                                  " at position " + std::to_string(i) +
                                  " is not an integer in [0, " + std::to_string(vocab_) + ")");
    }
    ids_[i] = int32_t(v);
  }
  if (dev == Device::kCuda && !ids_.empty()) {
    ids_dev_.Reserve(ids_.size() * sizeof(int32_t), dev);
    ids_dev_.CopyFromHost(ids_.data(), ids_.size() * sizeof(int32_t));
  }
  const Tensor w = WeightSite(*this, hooks_, weight_.value, &w_q_);
  ResizeOn(&y_, out_shape, dev);
  CPD_DISPATCH(dev,
               EmbeddingForward(int64_t(ids_.size()), embed_, IdsOn(dev), w.data(), y_.data()));
  ready_ = train;
  in_shape_ = ids.shape();
  return y_;
}

const int32_t* TokenEmbedding::IdsOn(Device dev) const {
  if (dev == Device::kCpu || ids_.empty()) return ids_.data();
  return static_cast<const int32_t*>(ids_dev_.data());
}

Tensor TokenEmbedding::Backward(const Tensor& dy) {
  RequireReady(*this, ready_);
  const Device dev = y_.device();
  RequireShape(*this, dy, OutputShape(in_shape_), dev);
  ResizeOn(&dw_, {vocab_, embed_}, dev);
  CPD_DISPATCH(dev, EmbeddingBackward(int64_t(ids_.size()), embed_, vocab_, IdsOn(dev), dy.data(),
                                      dw_.data()));
  WeightGradSite(*this, hooks_, &dw_);
  RequireDevice(*this, weight_.grad, "the weight gradient", dev);
  CPD_DISPATCH(dev, AddInPlace(dw_.numel(), dw_.data(), weight_.grad.data()));
  ResizeOn(&dx_, in_shape_, dev);
  dx_.Zero();
  return dx_;
}

// ---- PositionEmbedding ------------------------------------------------------------------------

PositionEmbedding::PositionEmbedding(std::string name, int64_t block_size, int64_t embed,
                                     uint64_t seed)
    : ShapedLayer(std::move(name)), block_(block_size), embed_(embed) {
  if (block_ < 1 || embed_ < 1) {
    throw std::invalid_argument(this->name() +
                                " (PositionEmbedding): needs block_size >= 1 and embed >= 1, got " +
                                std::to_string(block_) + " and " + std::to_string(embed_));
  }
  weight_ = MakeParam(this->name() + ".weight", {block_, embed_}, true);
  std::mt19937_64 gen(seed);
  FillNormal(&weight_.value, kGpt2InitStd, &gen);
}

std::string PositionEmbedding::Describe() const {
  return "PositionEmbedding(block " + std::to_string(block_) + ", embed " + std::to_string(embed_) +
         ")";
}

std::vector<int64_t> PositionEmbedding::OutputShape(const std::vector<int64_t>& in) const {
  if (in.size() != 3 || in[1] < 1 || in[1] > block_ || in[2] != embed_) {
    Misfit(*this, in,
           "[B, T, " + std::to_string(embed_) + "] with 1 <= T <= " + std::to_string(block_));
  }
  return in;
}

Tensor PositionEmbedding::Forward(const Tensor& x, bool train) {
  const Device dev = weight_.value.device();
  RequireDevice(*this, x, "the input", dev);
  OutputShape(x.shape());
  const Tensor w = WeightSite(*this, hooks_, weight_.value, &w_q_);
  ResizeOn(&y_, x.shape(), dev);
  CPD_DISPATCH(dev, PositionAddForward(x.dim(0), x.dim(1), embed_, x.data(), w.data(), y_.data()));
  ready_ = train;
  shape_ = x.shape();
  return y_;
}

Tensor PositionEmbedding::Backward(const Tensor& dy) {
  RequireReady(*this, ready_);
  const Device dev = y_.device();
  RequireShape(*this, dy, shape_, dev);
  ResizeOn(&dw_, {block_, embed_}, dev);
  dw_.Zero();  // positions at and beyond T get no gradient
  CPD_DISPATCH(dev, PositionAddBackward(shape_[0], shape_[1], embed_, dy.data(), dw_.data()));
  WeightGradSite(*this, hooks_, &dw_);
  RequireDevice(*this, weight_.grad, "the weight gradient", dev);
  CPD_DISPATCH(dev, AddInPlace(dw_.numel(), dw_.data(), weight_.grad.data()));
  return dy;
}

}  // namespace cpd::runtime
