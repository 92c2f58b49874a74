#include "runtime/nn/models.h"

#include <cstdio>
#include <exception>
#include <map>
#include <stdexcept>

#include "runtime/nn/recurrent.h"
#include "runtime/nn/transformer.h"

namespace cpd::runtime {

namespace {

std::string Str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

// "1,234,567".
std::string Grouped(int64_t v) {
  std::string digits = std::to_string(v < 0 ? -v : v), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return v < 0 ? "-" + out : out;
}

std::unique_ptr<Sequential> Mlp(int in_channels, int size, int classes, uint64_t seed) {
  auto m = std::make_unique<Sequential>("mlp");
  const int64_t in = int64_t(in_channels) * size * size;
  m->Emplace<Flatten>("flatten");
  m->Emplace<Linear>("fc1", in, 256, true, LayerSeed(seed, "fc1"));
  m->Emplace<ReLU>("relu1");
  m->Emplace<Linear>("fc2", 256, 256, true, LayerSeed(seed, "fc2"));
  m->Emplace<ReLU>("relu2");
  m->Emplace<Linear>("fc3", 256, classes, true, LayerSeed(seed, "fc3"));
  return m;
}

Result<std::unique_ptr<Sequential>> LeNet5(int in_channels, int size, int classes, uint64_t seed) {
  const int pad = size == 28 ? 2 : 0;
  // conv 5x5 -> pool 2 -> conv 5x5 -> pool 2.
  const int64_t s1 = (size + 2 * pad - 4) / 2;
  const int64_t s2 = (s1 - 4) / 2;
  if (size + 2 * pad < 5 || s1 < 5 || s2 < 1) {
    return Status::InvalidArgument(
        "lenet5 needs images of at least 16x16 pixels (28 and 32 are "
        "the usual sizes), got image size " +
        std::to_string(size));
  }
  auto m = std::make_unique<Sequential>("lenet5");
  m->Emplace<Conv2d>("conv1", in_channels, 6, 5, 1, pad, true, LayerSeed(seed, "conv1"));
  m->Emplace<ReLU>("relu1");
  m->Emplace<MaxPool2d>("pool1", 2, 2);
  m->Emplace<Conv2d>("conv2", 6, 16, 5, 1, 0, true, LayerSeed(seed, "conv2"));
  m->Emplace<ReLU>("relu2");
  m->Emplace<MaxPool2d>("pool2", 2, 2);
  m->Emplace<Flatten>("flatten");
  m->Emplace<Linear>("fc1", 16 * s2 * s2, 120, true, LayerSeed(seed, "fc1"));
  m->Emplace<ReLU>("relu3");
  m->Emplace<Linear>("fc2", 120, 84, true, LayerSeed(seed, "fc2"));
  m->Emplace<ReLU>("relu4");
  m->Emplace<Linear>("fc3", 84, classes, true, LayerSeed(seed, "fc3"));
  return m;
}

std::unique_ptr<Sequential> ResNetCifar(const std::string& arch, int depth, int in_channels,
                                        int classes, uint64_t seed) {
  const int n = (depth - 2) / 6;
  auto m = std::make_unique<Sequential>(arch);
  m->Emplace<Conv2d>("conv1", in_channels, 16, 3, 1, 1, false, LayerSeed(seed, "conv1"));
  m->Emplace<BatchNorm>("bn1", 16);
  m->Emplace<ReLU>("relu");
  int64_t in = 16;
  const int64_t widths[3] = {16, 32, 64};
  for (int stage = 0; stage < 3; ++stage) {
    for (int i = 0; i < n; ++i) {
      const int64_t stride = stage > 0 && i == 0 ? 2 : 1;
      const std::string name = "layer" + std::to_string(stage + 1) + "." + std::to_string(i);
      m->Emplace<BasicBlock>(name, in, widths[stage], stride, seed);
      in = widths[stage];
    }
  }
  m->Emplace<GlobalAvgPool>("avgpool");
  m->Emplace<Linear>("fc", 64, classes, true, LayerSeed(seed, "fc"));
  return m;
}

// Nesting depth of every layer of a model, from the composites' children.
void Depths(Layer* layer, int depth, std::map<const Layer*, int>* out) {
  (*out)[layer] = depth;
  const std::vector<Layer*> sub = layer->Flatten();
  for (size_t i = 1; i < sub.size(); ++i) {
    if (out->count(sub[i]) == 0) Depths(sub[i], depth + 1, out);
  }
}

}  // namespace

Result<std::unique_ptr<Sequential>> BuildModel(const std::string& arch, int in_channels,
                                               int image_size, int classes, uint64_t seed) {
  if (in_channels < 1 || image_size < 1 || classes < 1) {
    return Status::InvalidArgument("model '" + arch +
                                   "': in_channels, image_size and classes must be >= 1, got " +
                                   std::to_string(in_channels) + ", " + std::to_string(image_size) +
                                   ", " + std::to_string(classes));
  }
  std::unique_ptr<Sequential> model;
  if (arch == "mlp") {
    model = Mlp(in_channels, image_size, classes, seed);
  } else if (arch == "lenet5") {
    CPD_ASSIGN_OR_RETURN(model, LeNet5(in_channels, image_size, classes, seed));
  } else if (arch.rfind("resnet", 0) == 0) {
    const std::string digits = arch.substr(6);
    const bool numeric = !digits.empty() && digits.size() <= 4 &&
                         digits.find_first_not_of("0123456789") == std::string::npos;
    const int depth = numeric ? std::stoi(digits) : -1;
    if (depth < 8 || (depth - 2) % 6 != 0) {
      return Status::InvalidArgument(
          "model '" + arch +
          "': the CIFAR ResNet depth must be 6n + 2 with n >= 1 (resnet8, "
          "resnet14, resnet20, resnet32, resnet44, resnet56, resnet74, resnet110, ...)");
    }
    model = ResNetCifar(arch, depth, in_channels, classes, seed);
  } else {
    return Status::InvalidArgument("unknown model '" + arch +
                                   "' (accepted: mlp, lenet5, resnet<6n+2> such as resnet20, "
                                   "resnet32, resnet56, resnet110)");
  }
  model->set_input_shape({in_channels, image_size, image_size});
  return model;
}

Result<std::unique_ptr<Sequential>> BuildLanguageModel(const std::string& arch,
                                                       const LanguageModelShape& shape,
                                                       uint64_t seed) {
  if (arch == "lstm") {
    LstmLmOptions l;
    l.vocab = shape.vocab;
    l.embed = shape.n_embd;
    l.hidden = shape.n_embd;
    l.layers = shape.n_layer;
    l.dropout = shape.dropout;
    l.tied_head = shape.tied_head;
    l.block_size = shape.block_size;
    try {
      auto model = BuildLstm(l, seed);
      model->set_input_shape({shape.block_size});
      return model;
    } catch (const std::invalid_argument& e) {
      return Status::InvalidArgument(std::string("model 'lstm': ") + e.what());
    }
  }
  if (arch != "gpt") {
    return Status::InvalidArgument("unknown language model '" + arch + "' (accepted: gpt, lstm)");
  }
  GptOptions g;
  g.vocab = shape.vocab;
  g.block_size = shape.block_size;
  g.transformer.embed = shape.n_embd;
  g.transformer.heads = shape.n_head;
  g.transformer.layers = shape.n_layer;
  g.transformer.dropout = shape.dropout;
  g.tied_head = shape.tied_head;
  try {
    return BuildGpt(g, seed);
  } catch (const std::invalid_argument& e) {
    return Status::InvalidArgument(std::string("model 'gpt': ") + e.what());
  }
}

int64_t CountParams(Layer& model) {
  int64_t n = 0;
  for (Param* p : model.Params()) n += int64_t(p->value.numel());
  return n;
}

std::string DescribeModel(Sequential& model) {
  std::map<const Layer*, std::vector<int64_t>> shapes;
  std::string note;
  if (!model.input_shape().empty()) {
    std::vector<int64_t> in = {1};
    in.insert(in.end(), model.input_shape().begin(), model.input_shape().end());
    try {
      std::vector<LayerShapeRecord> trace;
      model.TraceShapes(in, &trace);
      for (const auto& r : trace) shapes[r.layer] = r.output;
    } catch (const std::exception& e) {
      note = std::string("(output shapes unavailable: ") + e.what() + ")\n";
    }
  }
  std::map<const Layer*, int> depth;
  Depths(&model, 0, &depth);
  std::string out;
  char line[512];
  std::snprintf(line, sizeof(line), "%-28s %-14s %-18s %12s  %s\n", "layer", "kind", "output",
                "params", "description");
  out += line;
  for (Layer* l : model.Flatten()) {
    const std::string name = std::string(size_t(2 * depth[l]), ' ') + l->name();
    const auto it = shapes.find(l);
    const std::string shape = it == shapes.end() ? "-" : Str(it->second);
    std::snprintf(line, sizeof(line), "%-28s %-14s %-18s %12s  %s\n", name.c_str(), l->kind(),
                  shape.c_str(), Grouped(CountParams(*l)).c_str(), l->Describe().c_str());
    out += line;
  }
  out += note;
  out += "total parameters: " + Grouped(CountParams(model)) + "\n";
  return out;
}

std::vector<std::pair<std::string, double>> LayerMacs(Sequential& model,
                                                      std::vector<int64_t> input_shape) {
  std::vector<LayerShapeRecord> trace;
  model.TraceShapes(input_shape, &trace);
  std::vector<std::pair<std::string, double>> out;
  for (const auto& r : trace) {
    if (r.layer->Quantizable()) out.emplace_back(r.layer->name(), r.macs);
  }
  return out;
}

}  // namespace cpd::runtime
