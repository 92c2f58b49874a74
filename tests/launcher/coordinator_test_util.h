// Helpers for the coordinator tests: temporary directories, client contexts with deadlines,
// and well-formed requests to start from.
#pragma once

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>

#include "proto/cpd/v1/coordinator.grpc.pb.h"
#include "tests/temp_dir.h"

namespace cpd::test {

// Every call in the tests has a deadline, so a bug fails a test instead of hanging it.
inline std::unique_ptr<grpc::ClientContext> Ctx(int seconds = 10, const std::string& token = "") {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
  return ctx;
}

inline v1::LayerInfo Layer(const std::string& name, const std::string& kind, int64_t params) {
  v1::LayerInfo l;
  l.set_name(name);
  l.set_kind(kind);
  l.set_quantizable(kind != "BatchNorm2d");
  l.set_params(params);
  return l;
}

// A LeNet-5-like job on `world` ranks with a CPT schedule.
inline v1::RegisterJobRequest LenetJob(const std::string& name, int world = 2) {
  v1::RegisterJobRequest r;
  r.set_job_name(name);
  r.set_world_size(world);
  r.set_emulated_workers_per_rank(4);
  for (int i = 0; i < world; ++i) {
    auto* w = r.add_workers();
    w->set_rank(i);
    w->set_host("node" + std::to_string(i));
    w->set_pid(1000 + i);
  }
  *r.add_layers() = Layer("conv1", "Conv2d", 156);
  *r.add_layers() = Layer("conv2", "Conv2d", 2416);
  *r.add_layers() = Layer("fc1", "Linear", 48120);
  *r.add_layers() = Layer("fc2", "Linear", 10164);
  *r.add_layers() = Layer("fc3", "Linear", 850);
  v1::PrecisionSchedule* s = r.mutable_schedule();
  s->set_effective_from_step(0);
  auto* f = s->add_formats();
  f->set_site(v1::SITE_W);
  f->set_spec("uint8:minmax:ch");
  f = s->add_formats();
  f->set_site(v1::SITE_E);
  f->set_spec("e5m2");
  f->set_rounding("stochastic");
  s->mutable_cyclic()->set_min_bits(3);
  s->mutable_cyclic()->set_max_bits(8);
  s->mutable_cyclic()->set_periods(32);
  s->set_grad_bits(8);
  auto* o = s->add_overrides();
  o->set_layer("conv1");
  o->set_site(v1::SITE_A);
  o->set_spec("fp32");
  s->add_keep_fp32("last");
  s->set_hysteresis(true);
  r.set_arch("lenet5");
  r.set_dataset("fashion-mnist");
  r.set_total_steps(4680);
  r.set_epochs(10);
  r.set_start_step(0);
  r.set_allreduce("packed e4m3 +APS");
  return r;
}

// A GPT on byte-level text (cpd-train --arch gpt --dataset text): a language model.
inline v1::RegisterJobRequest GptJob(const std::string& name) {
  v1::RegisterJobRequest r;
  r.set_job_name(name);
  r.set_world_size(1);
  r.set_emulated_workers_per_rank(1);
  auto* w = r.add_workers();
  w->set_rank(0);
  w->set_host("node0");
  w->set_pid(1000);
  *r.add_layers() = Layer("h0.attn.qkv", "Linear", 816);
  *r.add_layers() = Layer("lm_head", "Linear", 4096);
  r.mutable_schedule()->set_effective_from_step(0);
  r.set_arch("gpt");
  r.set_dataset("text");
  r.set_total_steps(64);
  r.set_epochs(2);
  r.set_allreduce("fp32");
  return r;
}

// A report at `step`; `layers` rows when > 0.
inline v1::StatsReport Report(int64_t job_id, int64_t step, int rank = 0, int layers = 0) {
  v1::StatsReport r;
  r.set_job_id(job_id);
  r.set_rank(rank);
  r.set_step(step);
  r.set_epoch(int32_t(step / 468));
  r.set_loss(2.3 / double(1 + step));
  r.set_lr(0.1);
  r.set_bits(3 + int32_t(step % 6));
  r.set_schedule_version(1);
  r.set_images_per_s(12345.5);
  r.set_ranks_alive(1);
  r.set_skipped_steps(uint64_t(step / 100));
  r.set_dropped_reports(uint64_t(step / 50));
  r.set_train_accuracy(-1);
  r.set_test_accuracy(-1);
  r.set_test_loss(-1);
  r.set_test_perplexity(-1);
  r.set_test_bits_per_byte(-1);
  r.set_time_ms(1700000000000 + step);
  for (int i = 0; i < layers; ++i) {
    auto* l = r.add_layers();
    l->set_layer("layer" + std::to_string(i));
    l->set_site(v1::Site(1 + i % 5));
    l->set_format("e4m3");
    l->set_bits(8);
    l->set_aps_shift(i % 7 - 3);
    l->set_max_abs(0.5 + i);
    l->set_saturated(0.001 * (i % 10));
    l->set_flushed(0.01);
    l->set_rel_error(i % 4 == 0 ? -1 : 0.03);
    l->set_flips(uint64_t(i));
    l->set_nonfinite(0);
  }
  return r;
}

}  // namespace cpd::test
