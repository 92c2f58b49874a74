#include "runtime/train/evaluate.h"

#include <algorithm>
#include <vector>

#include "runtime/train/gradients.h"

namespace cpd::runtime {

Result<Evaluation> Evaluate(Sequential* model, SiteQuantizer* quant, const Dataset& test,
                            Device device, const Replicas& replicas, uint64_t seed) {
  quant->SetEval(true);
  // A language model's logits are [batch, T, vocab]: its batch keeps them near 2^24 floats
  // (64 MiB), at most 64 windows (one for GPT-2's 1024 x 50257).
  const int64_t batch =
      test.is_tokens()
          ? std::clamp<int64_t>((int64_t(1) << 24) / (test.block_size * test.classes), 1, 64)
          : 500;
  BatchIterator it(test, batch, /*shuffle=*/false, /*augment=*/false, seed, /*drop_last=*/false);
  CPD_RETURN_IF_ERROR(it.SetShard(replicas.rank(), replicas.size()));
  it.StartEpoch(0);
  Tensor x, x_device, dlogits;
  std::vector<int32_t> y;
  SoftmaxCrossEntropy ce;
  double loss_sum = 0;
  int64_t correct = 0, seen = 0;
  while (it.Next(&x, &y)) {
    if (y.empty()) continue;  // this rank's share of the last batch
    const Tensor logits = LossRows(model->Forward(StagedOn(x, device, &x_device), /*train=*/false));
    loss_sum += double(ce.Forward(logits, y, &dlogits)) * double(y.size());
    correct += SoftmaxCrossEntropy::CountCorrect(logits, y);
    seen += int64_t(y.size());
  }
  quant->SetEval(false);
  CPD_ASSIGN_OR_RETURN(const std::vector<float> sums,
                       replicas.SumInRankOrder({float(loss_sum), float(correct), float(seen)}));
  const double n = sums[2];
  Evaluation e;
  e.accuracy = n > 0 ? double(sums[1]) / n : 0.0;
  e.loss = n > 0 ? double(sums[0]) / n : 0.0;
  return e;
}

}  // namespace cpd::runtime
