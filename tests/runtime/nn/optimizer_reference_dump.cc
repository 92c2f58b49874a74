// Writes AdamW steps and gradient clipping on fixed params and gradients to a JSON file, for
// optimizer_torch_test.py to recompute with torch.optim.AdamW and
// torch.nn.utils.clip_grad_norm_ from the same values:
//
//   optimizer_reference_dump OUT.json
//
// Params: a weight matrix that spans two of the optimiser's 16 Ki-element chunks, a bias, an
// embedding table and a LayerNorm weight (decayed: the two with Param::weight_decay). Cases, each
// six steps with a warm-up-then-cosine lr per step, as the trainer gives it:
//   adamw        torch's default betas (0.9, 0.999), eps 1e-8, weight decay 0.1, no clipping;
//   adamw-clip   nanoGPT's betas (0.9, 0.95), eps 1e-6, weight decay 0.01, clipping at 1 (the
//                gradients' norms are ~3-30, so every step clips);
//   clip-only    clipping without an update at max_norm 10 (norms ~23 and ~7: above and below).
// Per step: the gradient before clipping, the lr, the pre-clip norm, the gradient after it and
// the params after the step; at the end the moments m and v and the step count.
#include <cmath>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "runtime/nn/layers.h"
#include "runtime/nn/optimizer.h"

namespace cpd::runtime {
namespace {

using nlohmann::json;

json ToJson(const Tensor& t) {
  const Tensor h = OnHost(t);
  return {{"shape", h.shape()}, {"data", std::vector<float>(h.data(), h.data() + h.numel())}};
}

struct Spec {
  const char* name;
  std::vector<int64_t> shape;
  bool decay;
};

const Spec kSpecs[] = {{"fc.weight", {130, 130}, true},
                       {"fc.bias", {130}, false},
                       {"wte.weight", {50, 12}, true},
                       {"ln.weight", {12}, false}};

std::vector<std::unique_ptr<Param>> MakeParams() {
  std::vector<std::unique_ptr<Param>> out;
  std::mt19937_64 g(3);
  for (const Spec& s : kSpecs) {
    auto p = std::make_unique<Param>();
    p->name = s.name;
    p->value = Tensor(s.shape);
    p->grad = Tensor(s.shape);
    p->weight_decay = s.decay;
    FillNormal(&p->value, 0.5f, &g);
    out.push_back(std::move(p));
  }
  return out;
}

// Step s's gradients: normal, with a scale that varies by param and step (so that v's bias
// correction and the per-element denominators matter), a few exact zeros.
void SetGrads(const std::vector<std::unique_ptr<Param>>& params, int s, float scale) {
  std::mt19937_64 g(100 + uint64_t(s));
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor& grad = params[i]->grad;
    FillNormal(&grad, scale * float(1 + i) * (s % 2 == 0 ? 1.0f : 0.3f), &g);
    for (size_t k = 0; k < grad.numel(); k += 97) grad.data()[k] = 0.0f;
  }
}

// lr at step s of 6: linear warm-up over 2 steps, then cosine to 0 (cpd/schedule.h's shape).
double LrAt(double base, int s) {
  if (s < 2) return base * double(s + 1) / 2.0;
  const double pi = std::acos(-1.0);
  return base * 0.5 * (1.0 + std::cos(pi * double(s - 2) / 4.0));
}

json RunCase(const std::string& name, const OptimizerOptions& oo, double base_lr, double max_norm,
             float grad_scale, bool update) {
  auto params = MakeParams();
  std::vector<Param*> ptrs;
  for (auto& p : params) ptrs.push_back(p.get());
  Optimizer opt(ptrs, oo);
  json c = {{"name", name},        {"update", update}, {"beta1", oo.beta1},
            {"beta2", oo.beta2},   {"eps", oo.eps},    {"weight_decay", oo.weight_decay},
            {"max_norm", max_norm}};
  json init = json::object(), decay = json::object();
  for (const auto& p : params) {
    init[p->name] = ToJson(p->value);
    decay[p->name] = p->weight_decay;
  }
  c["params"] = init;
  c["decay"] = decay;
  json steps = json::array();
  for (int s = 0; s < 6; ++s) {
    SetGrads(params, s, grad_scale);
    json st = {{"lr", LrAt(base_lr, s)}};
    json grads = json::object(), clipped = json::object(), after = json::object();
    for (const auto& p : params) grads[p->name] = ToJson(p->grad);
    st["norm"] = opt.ClipGradNorm(max_norm);
    for (const auto& p : params) clipped[p->name] = ToJson(p->grad);
    if (update) opt.Step(LrAt(base_lr, s));
    for (const auto& p : params) after[p->name] = ToJson(p->value);
    st["grads"] = grads;
    st["clipped"] = clipped;
    st["params"] = after;
    steps.push_back(st);
  }
  c["steps"] = steps;
  json state = json::object();
  for (const auto& [key, t] : opt.State()) state[key] = ToJson(*t);
  c["state"] = state;
  c["adam_steps"] = opt.adam_steps();
  return c;
}

int Main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: optimizer_reference_dump OUT.json\n";
    return 2;
  }
  OptimizerOptions adamw;
  adamw.kind = OptimizerKind::kAdamW;
  adamw.weight_decay = 0.1;
  OptimizerOptions nanogpt = adamw;
  nanogpt.beta2 = 0.95;
  nanogpt.eps = 1e-6;
  nanogpt.weight_decay = 0.01;
  json cases = json::array();
  cases.push_back(RunCase("adamw", adamw, 0.02, 0.0, 0.05f, true));
  cases.push_back(RunCase("adamw-clip", nanogpt, 0.02, 1.0, 0.05f, true));
  cases.push_back(RunCase("clip-only", adamw, 0.02, 10.0, 0.15f, false));
  std::ofstream out(argv[1]);
  out << json{{"cases", cases}}.dump();
  return out.good() ? 0 : 1;
}

}  // namespace
}  // namespace cpd::runtime

int main(int argc, char** argv) { return cpd::runtime::Main(argc, argv); }
