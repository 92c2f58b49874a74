#include "runtime/train/evaluate.h"

#include <vector>

namespace cpd::runtime {

Result<Evaluation> Evaluate(Sequential* model, SiteQuantizer* quant, const Dataset& test,
                            Device device, const Replicas& replicas, uint64_t seed) {
  quant->SetEval(true);
  BatchIterator it(test, 500, /*shuffle=*/false, /*augment=*/false, seed, /*drop_last=*/false);
  CPD_RETURN_IF_ERROR(it.SetShard(replicas.rank(), replicas.size()));
  it.StartEpoch(0);
  Tensor x, x_device, dlogits;
  std::vector<int32_t> y;
  SoftmaxCrossEntropy ce;
  double loss_sum = 0;
  int64_t correct = 0, seen = 0;
  while (it.Next(&x, &y)) {
    if (y.empty()) continue;  // this rank's share of the last batch
    const Tensor logits = model->Forward(StagedOn(x, device, &x_device), /*train=*/false);
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
