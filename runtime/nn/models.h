// The model zoo of cpd-train, built from runtime/nn/layers.h, and static reports on models.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cpd/status.h"
#include "runtime/nn/layers.h"

namespace cpd::runtime {

// Builds an architecture for inputs [N, in_channels, image_size, image_size] and `classes`
// outputs (logits), initialised from `seed` (layer X from LayerSeed(seed, X), so the same
// seed gives the same weights on every machine). Accepted `arch`:
//  * "mlp": flatten, fc1 (in*H*W -> 256), relu1, fc2 (256 -> 256), relu2, fc3 (256 -> classes).
//  * "lenet5": conv1 (in -> 6, 5x5, padding 2 when image_size == 28 else 0), relu1, pool1
//    (max 2x2), conv2 (6 -> 16, 5x5), relu2, pool2, flatten, fc1 (16*s*s -> 120, s = 5 for 28
//    and 32 pixel images), relu3, fc2 (120 -> 84), relu4, fc3 (84 -> classes).
//  * "resnet<depth>", depth = 6n + 2 (resnet20, 32, 44, 56, 74, 110, ...): the CIFAR ResNet of
//    He et al. (2016): conv1 (3x3, in -> 16, no bias), bn1, relu, stages layer1..layer3 of n
//    BasicBlocks with 16/32/64 channels (blocks layerS.I; stride 2 in the first block of
//    layer2 and layer3, with a 1x1 projection shortcut), avgpool (global), fc (64 -> classes).
// Layer names are stable: "conv1", "bn1", "layer1.0.conv1", "layer2.0.shortcut.conv", "fc".
// The root's name is `arch`, and its input_shape() is {in_channels, image_size, image_size}.
// Errors: InvalidArgument for an unknown arch, a depth not of the form 6n + 2, non-positive
// sizes, or an image too small for the architecture.
Result<std::unique_ptr<Sequential>> BuildModel(const std::string& arch, int in_channels,
                                               int image_size, int classes, uint64_t seed);

// A language model's shape (cpd-train's --n-layer, --n-head, --n-embd, --block-size, --dropout,
// --untied-head; the vocabulary is the dataset's).
struct LanguageModelShape {
  int64_t vocab = 0, block_size = 0;
  int64_t n_layer = 0, n_head = 1, n_embd = 0;
  double dropout = 0;
  bool tied_head = true;
};

// A language model mapping token ids [N, T] (floats, T <= block_size) to logits [N, T, vocab],
// initialised from `seed`. Accepted `arch`:
//  * "gpt": runtime/nn/transformer.h's BuildGpt (nanoGPT's GPT; layers wte, wpe, h<i>..., ln_f,
//    lm_head; biases in every Linear but lm_head). input_shape() is {block_size}.
//  * "lstm": runtime/nn/recurrent.h's BuildLstm (wte, drop, lstm, lstm_drop, lm_head) with
//    embed = hidden = n_embd, n_layer layers, dropout, tied or untied; n_head is not used.
//    input_shape() is {block_size} (the sequence length of a window).
// Errors: InvalidArgument for another arch or a shape BuildGpt refuses.
Result<std::unique_ptr<Sequential>> BuildLanguageModel(const std::string& arch,
                                                       const LanguageModelShape& shape,
                                                       uint64_t seed);

// The number of trainable values (sum of Param sizes).
int64_t CountParams(Layer& model);

// A table with one line per layer (Flatten() order, indented by depth): name, kind, output
// shape (when the model's input_shape() is known; batch 1), parameter count, and the layer's
// Describe(); then the total parameter count. For cpd-train --print-model.
std::string DescribeModel(Sequential& model);

// Multiply-accumulates of one forward pass, per quantisable layer (Flatten() order), for an
// input of shape `input_shape` (batch dimension included). Backward costs about twice as much
// (dX and dW). Throws std::invalid_argument when the shape does not fit the model.
std::vector<std::pair<std::string, double>> LayerMacs(Sequential& model,
                                                      std::vector<int64_t> input_shape);

}  // namespace cpd::runtime
