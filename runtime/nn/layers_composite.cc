// The composite layers of runtime/nn/layers.h: Sequential and BasicBlock.
#include <stdexcept>

#include "runtime/nn/layers.h"
#include "runtime/nn/layers_internal.h"

namespace cpd::runtime {

using internal::Misfit;
using internal::RequireReady;
using internal::RequireShape;
using internal::Where;

// ---- Sequential ---------------------------------------------------------------------------------

Layer* Sequential::Add(std::unique_ptr<Layer> layer) {
  if (layer == nullptr) throw std::invalid_argument(Where(*this) + ": Add(nullptr)");
  layer->SetQuantHooks(hooks_);
  children_.push_back(std::move(layer));
  return children_.back().get();
}

std::string Sequential::Describe() const {
  return "Sequential(" + std::to_string(children_.size()) + " layers)";
}

Tensor Sequential::Forward(const Tensor& x, bool train) {
  Tensor h = x;
  for (auto& c : children_) h = c->Forward(h, train);
  return h;
}

Tensor Sequential::Backward(const Tensor& dy) {
  Tensor g = dy;
  for (auto it = children_.rbegin(); it != children_.rend(); ++it) g = (*it)->Backward(g);
  return g;
}

std::vector<Param*> Sequential::Params() {
  std::vector<Param*> out;
  for (auto& c : children_) {
    for (Param* p : c->Params()) out.push_back(p);
  }
  return out;
}

std::vector<std::pair<std::string, Tensor*>> Sequential::Buffers() {
  std::vector<std::pair<std::string, Tensor*>> out;
  for (auto& c : children_) {
    for (auto& b : c->Buffers()) out.push_back(b);
  }
  return out;
}

void Sequential::SetQuantHooks(QuantHooks* hooks) {
  hooks_ = hooks;
  for (auto& c : children_) c->SetQuantHooks(hooks);
}

std::vector<Layer*> Sequential::Flatten() {
  std::vector<Layer*> out = {this};
  for (auto& c : children_) {
    for (Layer* l : c->Flatten()) out.push_back(l);
  }
  return out;
}

void Sequential::SetStep(uint64_t step) {
  for (auto& c : children_) c->SetStep(step);
}

namespace {

ShapedLayer* AsShaped(const Layer& parent, Layer* child) {
  auto* s = dynamic_cast<ShapedLayer*>(child);
  if (s == nullptr) {
    throw std::invalid_argument(Where(parent) + ": child " + Where(*child) +
                                " cannot infer shapes (not a ShapedLayer)");
  }
  return s;
}

}  // namespace

std::vector<int64_t> Sequential::OutputShape(const std::vector<int64_t>& in) const {
  std::vector<int64_t> shape = in;
  for (const auto& c : children_) shape = AsShaped(*this, c.get())->OutputShape(shape);
  return shape;
}

std::vector<int64_t> Sequential::TraceShapes(const std::vector<int64_t>& in,
                                             std::vector<LayerShapeRecord>* out) {
  const size_t self = out->size();
  out->push_back({this, in, {}, 0});
  std::vector<int64_t> shape = in;
  for (auto& c : children_) shape = AsShaped(*this, c.get())->TraceShapes(shape, out);
  double macs = 0;
  for (size_t i = self + 1; i < out->size(); ++i) {
    if ((*out)[i].layer->Quantizable()) macs += (*out)[i].macs;
  }
  (*out)[self].output = shape;
  (*out)[self].macs = macs;
  return shape;
}

// ---- BasicBlock ---------------------------------------------------------------------------------

BasicBlock::BasicBlock(std::string name, int64_t in_channels, int64_t out_channels, int64_t stride,
                       uint64_t seed)
    : ShapedLayer(std::move(name)), in_(in_channels), out_(out_channels), stride_(stride) {
  const std::string& n = this->name();
  conv1_ = std::make_unique<Conv2d>(n + ".conv1", in_, out_, 3, stride_, 1, false,
                                    LayerSeed(seed, n + ".conv1"));
  bn1_ = std::make_unique<BatchNorm>(n + ".bn1", out_);
  bn1_->set_fused_relu(true);
  conv2_ = std::make_unique<Conv2d>(n + ".conv2", out_, out_, 3, 1, 1, false,
                                    LayerSeed(seed, n + ".conv2"));
  bn2_ = std::make_unique<BatchNorm>(n + ".bn2", out_);
  if (stride_ != 1 || in_ != out_) {
    sc_conv_ = std::make_unique<Conv2d>(n + ".shortcut.conv", in_, out_, 1, stride_, 0, false,
                                        LayerSeed(seed, n + ".shortcut.conv"));
    sc_bn_ = std::make_unique<BatchNorm>(n + ".shortcut.bn", out_);
  }
}

std::string BasicBlock::Describe() const {
  return "BasicBlock(" + std::to_string(in_) + " -> " + std::to_string(out_) + ", stride " +
         std::to_string(stride_) + (sc_conv_ ? ", projection shortcut)" : ", identity shortcut)");
}

std::vector<ShapedLayer*> BasicBlock::Children() const {
  std::vector<ShapedLayer*> c = {conv1_.get(), bn1_.get(), conv2_.get(), bn2_.get()};
  if (sc_conv_) {
    c.push_back(sc_conv_.get());
    c.push_back(sc_bn_.get());
  }
  return c;
}

std::vector<Param*> BasicBlock::Params() {
  std::vector<Param*> out;
  for (ShapedLayer* c : Children()) {
    for (Param* p : c->Params()) out.push_back(p);
  }
  return out;
}

std::vector<std::pair<std::string, Tensor*>> BasicBlock::Buffers() {
  std::vector<std::pair<std::string, Tensor*>> out;
  for (ShapedLayer* c : Children()) {
    for (auto& b : c->Buffers()) out.push_back(b);
  }
  return out;
}

void BasicBlock::SetQuantHooks(QuantHooks* hooks) {
  hooks_ = hooks;
  for (ShapedLayer* c : Children()) c->SetQuantHooks(hooks);
}

std::vector<Layer*> BasicBlock::Flatten() {
  std::vector<Layer*> out = {this};
  for (ShapedLayer* c : Children()) out.push_back(c);
  return out;
}

std::vector<int64_t> BasicBlock::OutputShape(const std::vector<int64_t>& in) const {
  if (in.size() != 4 || in[1] != in_) {
    Misfit(*this, in, "[N, " + std::to_string(in_) + ", H, W]");
  }
  return conv1_->OutputShape(in);
}

std::vector<int64_t> BasicBlock::TraceShapes(const std::vector<int64_t>& in,
                                             std::vector<LayerShapeRecord>* out) {
  const std::vector<int64_t> shape = OutputShape(in);
  const size_t self = out->size();
  out->push_back({this, in, shape, 0});
  std::vector<int64_t> h = conv1_->TraceShapes(in, out);
  h = bn1_->TraceShapes(h, out);
  h = conv2_->TraceShapes(h, out);
  bn2_->TraceShapes(h, out);
  if (sc_conv_) sc_bn_->TraceShapes(sc_conv_->TraceShapes(in, out), out);
  for (size_t i = self + 1; i < out->size(); ++i) (*out)[self].macs += (*out)[i].macs;
  return shape;
}

Tensor BasicBlock::Forward(const Tensor& x, bool train) {
  OutputShape(x.shape());
  const Tensor h = bn1_->Forward(conv1_->Forward(x, train), train);  // ReLU fused in bn1
  const Tensor b = bn2_->Forward(conv2_->Forward(h, train), train);
  const Tensor s = sc_conv_ ? sc_bn_->Forward(sc_conv_->Forward(x, train), train) : x;
  ResizeOn(&y_, b.shape(), b.device());
  CPD_DISPATCH(b.device(), AddRelu(b.numel(), b.data(), s.data(), y_.data()));
  ready_ = train;
  return y_;
}

Tensor BasicBlock::Backward(const Tensor& dy) {
  RequireReady(*this, ready_);
  const Device dev = y_.device();
  RequireShape(*this, dy, y_.shape(), dev);
  ResizeOn(&g_, dy.shape(), dev);
  CPD_DISPATCH(dev, ReluBackward(dy.numel(), y_.data(), dy.data(), g_.data()));
  const Tensor dh = conv2_->Backward(bn2_->Backward(g_));
  const Tensor dx_main = conv1_->Backward(bn1_->Backward(dh));
  const Tensor dx_short = sc_conv_ ? sc_conv_->Backward(sc_bn_->Backward(g_)) : g_;
  ResizeOn(&dx_, dx_main.shape(), dev);
  CPD_DISPATCH(dev, Add(dx_main.numel(), dx_main.data(), dx_short.data(), dx_.data()));
  return dx_;
}

}  // namespace cpd::runtime
