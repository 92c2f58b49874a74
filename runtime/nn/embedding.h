// The embeddings of a language model (GPT-2; nanoGPT's transformer.wte and transformer.wpe):
// token ids to vectors, and a learned position embedding added to them. Contracts as in
// runtime/nn/layers.h (workspaces, accumulation into Param::grad, determinism, devices: each
// computes where its table lives, on the CPU or through runtime/engine/cuda_transformer.h on a
// GPU, and refuses an input on another device).
//
// Both are quantisation sites with W (the table as used in forward) and G (the table's gradient
// before it is added to Param::grad), as Linear's; they have no A site (token ids and the
// residual stream are not a product's operand here) and no E site (the backward is a
// scatter-add of dy, whose quantisation G covers).
//
// Initialisation: GPT-2's, N(0, 0.02^2) per element (FillNormal from std::mt19937_64(seed)).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/nn/layers.h"

namespace cpd::runtime {

// y [B, T, embed] = table[ids] for a float tensor [B, T] of token ids. Each id must be an exact
// integer in [0, vocab) (vocab < 2^24, so every id is exact in float): anything else throws
// std::invalid_argument naming the layer, the position and the value. The table [vocab, embed]
// is the Param "NAME.weight" (weight decay on, as nanoGPT decays its 2-D parameters). Backward
// scatter-adds dy into the table's gradient (deterministic: each element summed in token order,
// the same bits on the CPU and a GPU) and returns a zero tensor [B, T]: the loss is piecewise
// constant in the ids. On a GPU the ids (a CUDA tensor) are copied to the host and checked there
// before the forward's gather, which waits for them: one small copy each way per forward.
class TokenEmbedding : public ShapedLayer {
 public:
  TokenEmbedding(std::string name, int64_t vocab, int64_t embed, uint64_t seed = 0);

  const char* kind() const override { return "TokenEmbedding"; }
  std::string Describe() const override;
  Tensor Forward(const Tensor& ids, bool train) override;
  Tensor Backward(const Tensor& dy) override;
  std::vector<Param*> Params() override { return {&weight_}; }
  bool Quantizable() const override { return true; }
  std::vector<int64_t> OutputShape(const std::vector<int64_t>& in) const override;

  int64_t vocab() const { return vocab_; }
  int64_t embed() const { return embed_; }
  Param& weight() { return weight_; }

 private:
  int64_t vocab_, embed_;
  Param weight_;
  bool ready_ = false;
  // The last forward's ids, as used on `dev`: ids_ on the CPU, their copy in ids_dev_ on a GPU.
  const int32_t* IdsOn(Device dev) const;

  std::vector<int32_t> ids_;  // the last training forward's ids
  RawBuffer ids_dev_;         // the same on the GPU (int32)
  std::vector<int64_t> in_shape_;
  Tensor w_q_, y_, dx_, dw_;
};

// y [B, T, embed] = x + table[0:T] (GPT-2's learned absolute position embedding, added to the
// token embedding), for T <= block_size. The table [block_size, embed] is "NAME.weight".
// Backward: dL/dx = dy (a handle to it), and the table's gradient sums dy over the batch.
class PositionEmbedding : public ShapedLayer {
 public:
  PositionEmbedding(std::string name, int64_t block_size, int64_t embed, uint64_t seed = 0);

  const char* kind() const override { return "PositionEmbedding"; }
  std::string Describe() const override;
  Tensor Forward(const Tensor& x, bool train) override;
  Tensor Backward(const Tensor& dy) override;
  std::vector<Param*> Params() override { return {&weight_}; }
  bool Quantizable() const override { return true; }
  std::vector<int64_t> OutputShape(const std::vector<int64_t>& in) const override;

  int64_t block_size() const { return block_; }
  Param& weight() { return weight_; }

 private:
  int64_t block_, embed_;
  Param weight_;
  bool ready_ = false;
  std::vector<int64_t> shape_;  // the last training forward's input shape
  Tensor w_q_, y_, dw_;
};

}  // namespace cpd::runtime
