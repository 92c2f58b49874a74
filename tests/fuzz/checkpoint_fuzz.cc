// Checkpoints past the CRC: the input is the JSON header, a 0 byte and the payload; the target
// writes them as a checkpoint file with the magic, the header length and a valid CRC-32, then
// reads it and restores it into a small model (two Linear layers, SGD with momentum, an
// iterator over 64 synthetic samples) through Checkpointer::Restore, the path of --resume.
// Invariants: nothing crashes or throws; a refusal names the file; a checkpoint that is accepted
// leaves every parameter, buffer and momentum finite, the iterator in range and the step >= 0.
#include <zlib.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "runtime/nn/layers.h"
#include "runtime/nn/optimizer.h"
#include "runtime/nn/quant_sites.h"
#include "runtime/train/checkpoint.h"
#include "runtime/train/checkpointer.h"
#include "runtime/train/data.h"
#include "runtime/train/replicas.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using namespace cpd::runtime;  // NOLINT: a test of this namespace

// Everything a resumed run restores into, built once.
struct Run {
  Run() {
    options.arch = "tiny";
    options.dataset = "synthetic";
    options.epochs = 3;
    data = MakeSynthetic(64, 1, 2, 2, 2, 1).value();
    model = std::make_unique<Sequential>("tiny");
    model->Emplace<Flatten>("flatten");
    model->Emplace<Linear>("fc1", 4, 3, true, 1);
    model->Emplace<ReLU>("relu1");
    model->Emplace<Linear>("fc2", 3, 2, true, 2);
    for (Layer* l : model->Flatten()) {
      if (l->Quantizable()) layers.push_back(l);
    }
    PrecisionConfig pc;
    pc.hysteresis = true;
    pc.global[int(Site::kWeight)].spec = "log4";
    quant = SiteQuantizer::Create(pc, layers).value();
    OptimizerOptions oo;
    oo.momentum = 0.9;
    optimizer = std::make_unique<Optimizer>(model->Params(), oo);
    iterator = std::make_unique<BatchIterator>(data, 16, true, false, 1, false);
    replicas = std::make_unique<Replicas>(&self);
    TrainingState state{model.get(), optimizer.get(), quant.get(), iterator.get(), nullptr};
    checkpointer = std::make_unique<Checkpointer>(options, 16, iterator->batches_per_epoch(), state,
                                                  replicas.get());
  }

  CheckpointOptions options;
  Dataset data;
  std::unique_ptr<Sequential> model;
  std::vector<Layer*> layers;
  std::unique_ptr<SiteQuantizer> quant;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<BatchIterator> iterator;
  cpd::comm::SelfCommunicator self;
  std::unique_ptr<Replicas> replicas;
  std::unique_ptr<Checkpointer> checkpointer;
};

bool Finite(const Tensor& t) {
  const Tensor h = OnHost(t);
  for (size_t i = 0; i < h.numel(); ++i) {
    if (!std::isfinite(h.data()[i])) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Run* run = new Run();  // lives for the whole process
  cpd::fuzz::Input in(data, size);
  const std::string header = in.TakeString();
  const std::string payload = in.Rest();
  std::string file = "CPDCKPT1";
  for (int i = 0; i < 8; ++i) file.push_back(char((uint64_t(header.size()) >> (8 * i)) & 0xff));
  file += header;
  file += payload;
  const uLong crc = crc32(0L, reinterpret_cast<const Bytef*>(file.data()), uInt(file.size()));
  for (int i = 0; i < 4; ++i) file.push_back(char((crc >> (8 * i)) & 0xff));
  const std::string path = cpd::fuzz::ScratchDir() + "/structured.cpd";
  cpd::fuzz::WriteFile(path, file);

  auto point = run->checkpointer->Restore(path);
  if (!point.ok()) {
    CPD_FUZZ_CHECK(point.status().message().find(path) != std::string::npos,
                   "a refusal that does not name the file: " + point.status().message());
    return 0;
  }
  CPD_FUZZ_CHECK(point->step >= 0, "accepted a negative step");
  CPD_FUZZ_CHECK(point->epoch >= 0 && point->epoch <= run->options.epochs, "epoch out of range");
  const IteratorState it = run->iterator->state();
  CPD_FUZZ_CHECK(
      it.epoch >= 0 && it.next_batch >= 0 && it.next_batch <= run->iterator->batches_per_epoch(),
      "iterator out of range");
  for (Param* p : run->model->Params()) CPD_FUZZ_CHECK(Finite(p->value), p->name);
  for (auto& [name, t] : run->model->Buffers()) CPD_FUZZ_CHECK(Finite(*t), name);
  for (auto& [name, t] : run->optimizer->State()) CPD_FUZZ_CHECK(Finite(*t), name);
  for (auto& [layer, q] : run->quant->HysteresisState()) {
    for (float v : *q) CPD_FUZZ_CHECK(std::isfinite(v), "hysteresis state of " + layer);
  }
  return 0;
}
