// The recurrent layers of a language model: a multi-layer LSTM with PyTorch's nn.LSTM semantics
// (batch_first = true) and the LSTM language model built on it (the "medium" model of Zaremba et
// al., "Recurrent Neural Network Regularization", 2014, is 2 layers of 650). Contracts as in
// runtime/nn/layers.h (workspaces, accumulation into Param::grad, deterministic initialisation
// from a seed, devices: each layer computes where its parameters live, on the CPU or through
// runtime/engine/cuda_recurrent.h on a GPU, and refuses tensors on another device).
//
// Quantisation sites: every matrix product is one. Each LSTM layer k has two quantisable child
// layers, so that the precision policy and per-layer overrides address them by name:
//   NAME.l<k>.ih  the input projection x W_ih^T + b_ih, one product over all timesteps (an
//                 InputProjection): W = weight_ih_l<k>, A = the layer's input sequence (one
//                 call), E = the gradient of the gate pre-activations over all timesteps (one
//                 call), G = its weight gradient;
//   NAME.l<k>.hh  the recurrent projection h_{t-1} W_hh^T + b_hh at each timestep (a
//                 RecurrentProduct): W = weight_hh_l<k> (once per forward), A = h_{t-1} (one
//                 call per timestep), E = the gradient of the gate pre-activations at t (one call
//                 per timestep, in the backward through time, before it flows on into h_{t-1}),
//                 G = its weight gradient (once, summed over all timesteps).
// E.g. --layer-format lstm.l0.hh.W=e4m3. The biases are not quantised (as Linear's are not).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/nn/layers.h"

namespace cpd::runtime {

// The input projection of one LSTM layer as a quantisation site: z [T, B, 4H] = x [T, B, in] W_ih^T
// + b_ih for every timestep at once (one product over all T B rows), with W_ih [4H, in]. Linear's
// computation and sites (W, A, E over all timesteps, G; the bias gradient not quantised), but its
// products split their output columns into blocks of a fixed width (cpu::ColumnBlockedSgemm), so
// that every result, the weight gradient included, is the same for every thread count.
// Parameters: `weight_name` [4H, in] (weight decay on) and `bias_name` [4H] (off), zero until the
// parent initialises them.
class InputProjection : public ShapedLayer {
 public:
  InputProjection(std::string name, int64_t in, int64_t out, const std::string& weight_name,
                  const std::string& bias_name);

  const char* kind() const override { return "InputProjection"; }
  std::string Describe() const override;
  Tensor Forward(const Tensor& x, bool train) override;
  Tensor Backward(const Tensor& dy) override;
  std::vector<Param*> Params() override { return {&weight_, &bias_}; }
  bool Quantizable() const override { return true; }
  // [..., in] -> [..., out].
  std::vector<int64_t> OutputShape(const std::vector<int64_t>& in) const override;
  double ForwardMacs(const std::vector<int64_t>& in) const override;

  Param& weight() { return weight_; }
  Param& bias() { return bias_; }

 private:
  int64_t in_, out_;
  Param weight_, bias_;
  bool ready_ = false;
  Tensor x_saved_, w_saved_;  // the operands of the last training forward (handles)
  Tensor x_q_, w_q_, dy_q_;   // hook copies
  Tensor y_, dx_, dw_, db_;
};

// The recurrent product of one LSTM layer as a quantisation site: for each timestep t of a
// sequence, gh_t [B, 4H] = h_{t-1} [B, H] W_hh^T + b_hh with W_hh [4H, H]. Each step's operand
// is the previous step's output, so its parent drives it step by step through the calls below;
// the one-input Forward and Backward of Layer throw std::logic_error. Quantizable, with the sites
// W (W_hh, once per forward), A (h_{t-1}, per step), E (dL/dgh_t, per step) and G (dW_hh, once per
// backward). Parameters: `weight_name` [4H, H] (weight decay on) and `bias_name` [4H] (off),
// zero until the parent initialises them.
class RecurrentProduct : public Layer {
 public:
  RecurrentProduct(std::string name, int64_t hidden, const std::string& weight_name,
                   const std::string& bias_name);

  const char* kind() const override { return "RecurrentProduct"; }
  std::string Describe() const override;
  Tensor Forward(const Tensor& x, bool train) override;
  Tensor Backward(const Tensor& dy) override;
  std::vector<Param*> Params() override { return {&weight_, &bias_}; }
  bool Quantizable() const override { return true; }

  // Forward over a sequence: ForwardBegin once (the W site), then ForwardStep(t) for t = 0 ..
  // T - 1 in order. h [T, B, H] holds the operands: block t is h_{t-1}, which the caller writes
  // before ForwardStep(t) and leaves unchanged until the backward has run (a handle is kept).
  void ForwardBegin(const Tensor& h, bool train);
  // gh_t [B, 4H] (the layer's workspace, valid until the next step).
  Tensor ForwardStep(int64_t t);
  // Backward through time: BackwardBegin once, then BackwardStep(t) for t = T - 1 down to 0, then
  // BackwardEnd. dz [T, B, 4H] holds dL/dgh: block t is written by the caller before
  // BackwardStep(t) and left unchanged until BackwardEnd (a handle is kept).
  void BackwardBegin(const Tensor& dz);
  // dL/dh_{t-1} [B, H] = E(dz_t) W_hh (the layer's workspace, valid until the next step), or an
  // empty tensor without want_dh (h_{-1} is the zero initial state: nothing to send back).
  Tensor BackwardStep(int64_t t, bool want_dh);
  // dW_hh = sum over t of E(dz_t)^T A(h_{t-1}) (one product over all timesteps), through the G
  // site, and db_hh = sum of E(dz_t), added to the gradients.
  void BackwardEnd();

  int64_t hidden() const { return hidden_; }
  Param& weight() { return weight_; }
  Param& bias() { return bias_; }

 private:
  int64_t hidden_;
  Param weight_, bias_;
  bool train_ = false, ready_ = false;
  bool hooked_a_ = false, hooked_e_ = false;  // whether this sequence ran the A and E sites
  int64_t steps_ = 0, batch_ = 0;
  Tensor h_, w_used_, dz_;  // handles: the operand sequence, W as used, the caller's dz
  Tensor hq_, w_q_, dzq_;   // the A, W and E sites' copies (with hooks)
  Tensor gh_, dh_, dw_, db_;
};

// The shape of a multi-layer LSTM (torch.nn.LSTM's input_size, hidden_size, num_layers,
// dropout; always with biases and batch_first = true).
struct LstmOptions {
  int64_t input = 0;   // C, the width of each input vector; REQUIRED: >= 1
  int64_t hidden = 0;  // H; REQUIRED: >= 1
  int64_t layers = 1;  // stacked layers, each feeding the next; REQUIRED: >= 1
  double dropout = 0;  // dropout on the output of each layer but the last, in [0, 1)
};

// x [B, T, C] -> y [B, T, H], the output h_t of the last layer at every timestep, as
// torch.nn.LSTM(C, H, layers, dropout = dropout, batch_first = True) with zero initial states.
// Layer k (input x for k = 0, else the previous layer's output after dropout):
//   z_t = x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh, gates i, f, g, o in blocks of H of z_t
//   (PyTorch's order), i, f, o = sigmoid, g = tanh, c_t = f c_{t-1} + i g, h_t = o tanh(c_t),
//   h_{-1} = c_{-1} = 0.
// Every sequence starts from the zero state: training is truncated backpropagation through time
// over each batch's T steps, with no state carried from one batch to the next (carrying it
// would be an option for contiguous-stream batching; not done yet).
//
// Children, in Flatten order: NAME.l<k>.ih (InputProjection, C or H -> 4H), NAME.l<k>.hh
// (RecurrentProduct), NAME.l<k>.dropout (Dropout, for k < layers - 1). Parameters carry
// PyTorch's names, in its order, so that weights map one to one: NAME.weight_ih_l<k> [4H, in],
// NAME.weight_hh_l<k> [4H, H], NAME.bias_ih_l<k> [4H], NAME.bias_hh_l<k> [4H] for each k.
// Initialisation: PyTorch's, every parameter ~ U(-1/sqrt(H), 1/sqrt(H)) (FillUniform; the ih
// child's weight and bias from LayerSeed(seed, NAME.l<k>.ih), the hh child's likewise).
//
// Cost: the input projection of each layer is one product over all B * T rows; the recurrence
// is one [B, H] x [H, 4H] product per timestep (its columns spread over the threads), then the
// gates in one fused pass; the backward mirrors it, and each weight gradient is one product over
// all timesteps. Internally the sequence runs time-major ([T, B, .]), so that each timestep is
// a contiguous block. Results do not depend on the thread count.
class Lstm : public ShapedLayer {
 public:
  Lstm(std::string name, const LstmOptions& options, uint64_t seed);
  ~Lstm() override;

  const char* kind() const override { return "LSTM"; }
  std::string Describe() const override;
  Tensor Forward(const Tensor& x, bool train) override;
  Tensor Backward(const Tensor& dy) override;
  std::vector<Param*> Params() override;
  void SetQuantHooks(QuantHooks* hooks) override;
  std::vector<Layer*> Flatten() override;
  void SetStep(uint64_t step) override;
  std::vector<int64_t> OutputShape(const std::vector<int64_t>& in) const override;
  std::vector<int64_t> TraceShapes(const std::vector<int64_t>& in,
                                   std::vector<LayerShapeRecord>* out) override;

  const LstmOptions& options() const { return options_; }
  InputProjection& ih(int64_t layer);
  RecurrentProduct& hh(int64_t layer);

 private:
  struct Stage;  // one layer's children and workspaces (recurrent.cc)

  std::vector<Layer*> Children() const;
  // One layer over a time-major sequence x [T, B, in]: returns h [T, B, H] (a view of the
  // stage's workspace); and its backward from dL/dh, returning dL/dx [T, B, in].
  Tensor StageForward(Stage& s, const Tensor& x, bool train);
  Tensor StageBackward(Stage& s, const Tensor& dy);

  LstmOptions options_;
  std::vector<std::unique_ptr<Stage>> stages_;
  bool ready_ = false;
  int64_t b_ = 0, t_ = 0;  // the last training forward's batch and sequence length
  Tensor x_tm_, y_, dy_tm_, dx_;
};

// An LSTM language model's hyper-parameters.
struct LstmLmOptions {
  int64_t vocab = 0;   // REQUIRED: >= 1
  int64_t embed = 0;   // the token embedding width; REQUIRED: >= 1
  int64_t hidden = 0;  // the LSTM's width; 0: the same as embed
  int64_t layers = 1;  // stacked LSTM layers; REQUIRED: >= 1
  double dropout = 0;  // on the embeddings, between LSTM layers and on the LSTM output
  bool tied_head =
      true;  // lm_head uses wte's table (Press and Wolf 2017); REQUIRED: hidden = embed
  int64_t block_size = 0;  // the sequence length the model is described with (0: not recorded)
};

// wte (TokenEmbedding), drop (Dropout), lstm (Lstm), lstm_drop (Dropout), lm_head (Linear, no
// bias; tied to wte's table, or its own): a Sequential named "lstm_lm" mapping token ids [B, T]
// (floats, see TokenEmbedding) to logits [B, T, vocab], as BuildGpt's (transformer.h): the
// per-token loss is SoftmaxCrossEntropy on logits.Reshaped({B * T, vocab}). Initialisation as
// PyTorch's word_language_model example: wte and an untied lm_head ~ U(-0.1, 0.1), the LSTM as
// Lstm's. The medium PTB model is {vocab 10000, embed 650, layers 2, dropout 0.5}. Throws
// std::invalid_argument on options that do not fit.
std::unique_ptr<Sequential> BuildLstm(const LstmLmOptions& options, uint64_t seed);

}  // namespace cpd::runtime
