// The coordinator service in-process: real gRPC on a loopback ephemeral port, real SQLite in a
// temporary directory. Round trips with every field checked, schedule versioning and push,
// WatchJob, every rejection class, token and TLS, restart on the same database, backpressure,
// and shutdown with open streams and queued reports.
#include <google/protobuf/util/message_differencer.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sqlite3.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "launcher/coordinator/server.h"
#include "tests/launcher/coordinator_test_util.h"
#include "tests/subprocess.h"

namespace cpd::test {
namespace {

using coordinator::CoordinatorServer;
using coordinator::ServerOptions;
using google::protobuf::util::MessageDifferencer;
using grpc::StatusCode;

std::string Diff(const google::protobuf::Message& a, const google::protobuf::Message& b) {
  std::string report;
  MessageDifferencer d;
  d.ReportDifferencesToString(&report);
  return d.Compare(a, b) ? "" : report;
}

class CoordinatorTest : public ::testing::Test {
 protected:
  // Starts (or restarts) the server on the test's database.
  void Start(ServerOptions opt = {}) {
    opt.listen = "127.0.0.1:0";
    if (opt.store.path.empty()) opt.store.path = dir_.File("coord.db");
    auto s = CoordinatorServer::Start(opt);
    ASSERT_TRUE(s.ok()) << s.status().message();
    server_ = std::move(s).value();
    ASSERT_GT(server_->port(), 0);
    Connect(grpc::InsecureChannelCredentials(), "127.0.0.1");
  }
  void Connect(std::shared_ptr<grpc::ChannelCredentials> creds, const std::string& host,
               const grpc::ChannelArguments& args = {}) {
    channel_ = grpc::CreateCustomChannel(host + ":" + std::to_string(server_->port()), creds, args);
    worker_ = v1::WorkerService::NewStub(channel_);
    op_ = v1::OperatorService::NewStub(channel_);
  }
  void Stop() {
    worker_.reset();
    op_.reset();
    channel_.reset();
    server_.reset();
  }

  int64_t Register(const v1::RegisterJobRequest& req, v1::RegisterJobResponse* resp = nullptr) {
    v1::RegisterJobResponse r;
    grpc::Status s = worker_->RegisterJob(Ctx().get(), req, &r);
    EXPECT_TRUE(s.ok()) << s.error_message();
    if (resp != nullptr) *resp = r;
    return r.job_id();
  }
  grpc::Status Send(const v1::StatsReport& rep, v1::ReportStatsResponse* resp = nullptr) {
    v1::ReportStatsResponse r;
    grpc::Status s = worker_->ReportStats(Ctx().get(), rep, &r);
    if (resp != nullptr) *resp = r;
    return s;
  }
  v1::JobStatusResponse Status(int64_t id) {
    v1::JobRef ref;
    ref.set_job_id(id);
    v1::JobStatusResponse r;
    grpc::Status s = op_->JobStatus(Ctx().get(), ref, &r);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return r;
  }
  std::vector<v1::StatsReport> History(int64_t id, bool with_layers, int64_t from = 0,
                                       int64_t to = 0) {
    v1::JobHistoryRequest req;
    req.mutable_job()->set_job_id(id);
    req.set_with_layers(with_layers);
    req.set_from_step(from);
    req.set_to_step(to);
    auto ctx = Ctx();
    auto reader = op_->JobHistory(ctx.get(), req);
    std::vector<v1::StatsReport> out;
    v1::StatsReport r;
    while (reader->Read(&r)) out.push_back(r);
    grpc::Status s = reader->Finish();
    EXPECT_TRUE(s.ok()) << s.error_message();
    return out;
  }
  v1::GetScheduleResponse GetSchedule(int64_t id) {
    v1::GetScheduleRequest req;
    req.mutable_job()->set_job_id(id);
    v1::GetScheduleResponse r;
    grpc::Status s = op_->GetSchedule(Ctx().get(), req, &r);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return r;
  }
  grpc::Status SetSchedule(int64_t id, const v1::PrecisionSchedule& sched, uint64_t expected,
                           v1::SetScheduleResponse* resp = nullptr) {
    v1::SetScheduleRequest req;
    req.mutable_job()->set_job_id(id);
    *req.mutable_schedule() = sched;
    req.set_expected_version(expected);
    req.set_set_by("cpdctl");
    v1::SetScheduleResponse r;
    grpc::Status s = op_->SetSchedule(Ctx().get(), req, &r);
    if (resp != nullptr) *resp = r;
    return s;
  }

  TempDir dir_;
  std::unique_ptr<CoordinatorServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::WorkerService::Stub> worker_;
  std::unique_ptr<v1::OperatorService::Stub> op_;
};

// A schedule equals the one sent, plus the coordinator's bookkeeping.
void ExpectSchedule(const v1::PrecisionSchedule& got, const v1::PrecisionSchedule& sent,
                    uint64_t version, const std::string& set_by) {
  v1::PrecisionSchedule want = sent;
  want.set_version(version);
  want.set_set_at_ms(got.set_at_ms());
  want.set_set_by(set_by);
  EXPECT_EQ(Diff(got, want), "");
  const int64_t now = coordinator::NowMs();
  EXPECT_GT(got.set_at_ms(), now - 60000);
  EXPECT_LE(got.set_at_ms(), now);
}

TEST(CoordinatorProto, RoundTripsEveryMessage) {
  // Every field set to a non-default value survives serialisation (the store keeps reports and
  // schedules as serialized messages).
  v1::RegisterJobRequest reg = LenetJob("roundtrip", 3);
  v1::StatsReport rep = Report(7, 936, 2, 9);
  rep.set_finished(true);
  rep.set_train_accuracy(0.91);
  rep.set_test_accuracy(0.89);
  rep.set_test_loss(1.25);
  rep.set_test_perplexity(3.4903429574618414);
  rep.set_test_bits_per_byte(1.8033688011112042);
  v1::JobStatusResponse st;
  st.mutable_job()->set_job_id(7);
  st.mutable_job()->set_state("stale");
  st.set_last_report_age_ms(-1);
  st.set_reports_stored(1ull << 40);
  st.set_test_loss(1.25);
  st.set_test_perplexity(3.5);
  st.set_test_bits_per_byte(1.8);
  st.mutable_job()->set_test_perplexity(3.5);
  st.mutable_job()->set_test_bits_per_byte(1.8);
  *st.mutable_schedule() = reg.schedule();
  *st.add_layers() = reg.layers(0);
  *st.add_workers() = reg.workers(1);
  for (const google::protobuf::Message* m :
       std::initializer_list<const google::protobuf::Message*>{&reg, &rep, &st}) {
    std::string bytes;
    ASSERT_TRUE(m->SerializeToString(&bytes));
    std::unique_ptr<google::protobuf::Message> back(m->New());
    ASSERT_TRUE(back->ParseFromString(bytes));
    EXPECT_EQ(Diff(*m, *back), "") << m->GetTypeName();
  }
}

TEST_F(CoordinatorTest, RegisterReportQueryRoundTrip) {
  Start();
  const v1::RegisterJobRequest req = LenetJob("lenet-cpt", 2);
  v1::RegisterJobResponse reg;
  const int64_t id = Register(req, &reg);
  ASSERT_GT(id, 0);
  EXPECT_FALSE(reg.existed());
  ExpectSchedule(reg.schedule(), req.schedule(), 1, "register");

  // Steps 0..19 from both ranks; layer rows every 5 steps; accuracies at step 19.
  std::vector<v1::StatsReport> sent;
  for (int step = 0; step < 20; ++step) {
    for (int rank = 0; rank < 2; ++rank) {
      v1::StatsReport r = Report(id, step, rank, step % 5 == 0 ? 12 : 0);
      r.set_ranks_alive(2);
      if (step == 19) {
        r.set_train_accuracy(0.875);
        r.set_test_accuracy(0.8125);
      }
      v1::ReportStatsResponse resp;
      grpc::Status s = Send(r, &resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(resp.schedule_version(), 1u);
      sent.push_back(r);
    }
  }
  server_->store()->Flush();

  v1::JobStatusResponse st = Status(id);
  EXPECT_EQ(st.job().job_id(), id);
  EXPECT_EQ(st.job().job_name(), "lenet-cpt");
  EXPECT_EQ(st.job().state(), "running");
  EXPECT_EQ(st.job().world_size(), 2);
  EXPECT_EQ(st.job().step(), 19);
  EXPECT_EQ(st.job().total_steps(), 4680);
  EXPECT_GT(st.job().registered_ms(), 0);
  EXPECT_GE(st.job().last_report_ms(), st.job().registered_ms());
  EXPECT_EQ(st.job().arch(), "lenet5");
  EXPECT_EQ(st.job().dataset(), "fashion-mnist");
  const v1::StatsReport& last = sent.back();
  EXPECT_EQ(st.epoch(), last.epoch());
  EXPECT_EQ(st.epochs(), 10);
  EXPECT_EQ(st.bits(), last.bits());
  EXPECT_EQ(st.loss(), last.loss());
  EXPECT_EQ(st.train_accuracy(), 0.875);
  EXPECT_EQ(st.test_accuracy(), 0.8125);
  EXPECT_EQ(st.ranks_alive(), 2);
  EXPECT_GE(st.last_report_age_ms(), 0);
  EXPECT_LT(st.last_report_age_ms(), 60000);
  EXPECT_EQ(st.images_per_s(), last.images_per_s());
  ExpectSchedule(st.schedule(), req.schedule(), 1, "register");
  ASSERT_EQ(st.workers_size(), 2);
  for (int i = 0; i < 2; ++i) EXPECT_EQ(Diff(st.workers(i), req.workers(i)), "");
  ASSERT_EQ(st.layers_size(), req.layers_size());
  for (int i = 0; i < req.layers_size(); ++i) EXPECT_EQ(Diff(st.layers(i), req.layers(i)), "");
  EXPECT_EQ(st.reports_stored(), 40u);
  EXPECT_EQ(st.dropped_reports(), last.dropped_reports());
  EXPECT_EQ(st.allreduce(), "packed e4m3 +APS");
  EXPECT_EQ(st.skipped_steps(), last.skipped_steps());

  // LayerStats: latest = both ranks' reports at step 15; a range; one step; a limit.
  v1::LayerStatsRequest lreq;
  lreq.mutable_job()->set_job_name("lenet-cpt");
  lreq.set_latest(true);
  v1::LayerStatsResponse lresp;
  ASSERT_TRUE(op_->LayerStats(Ctx().get(), lreq, &lresp).ok());
  ASSERT_EQ(lresp.reports_size(), 2);
  EXPECT_EQ(Diff(lresp.reports(0), sent[30]), "");
  EXPECT_EQ(Diff(lresp.reports(1), sent[31]), "");
  lreq.set_latest(false);
  lreq.set_from_step(3);
  lreq.set_to_step(12);
  lresp.Clear();
  ASSERT_TRUE(op_->LayerStats(Ctx().get(), lreq, &lresp).ok());
  ASSERT_EQ(lresp.reports_size(), 4);  // steps 5 and 10, two ranks each
  EXPECT_EQ(Diff(lresp.reports(0), sent[10]), "");
  EXPECT_EQ(Diff(lresp.reports(3), sent[21]), "");
  lreq.set_from_step(4);
  lreq.set_to_step(4);
  lresp.Clear();
  ASSERT_TRUE(op_->LayerStats(Ctx().get(), lreq, &lresp).ok());
  EXPECT_EQ(lresp.reports_size(), 0);  // step 4 carries no layer rows
  lreq.set_from_step(0);
  lreq.set_to_step(100);
  lreq.set_limit(3);
  lresp.Clear();
  ASSERT_TRUE(op_->LayerStats(Ctx().get(), lreq, &lresp).ok());
  EXPECT_EQ(lresp.reports_size(), 3);

  // JobHistory: every report in step order, with and without layer rows, and a step range.
  std::vector<v1::StatsReport> h = History(id, true);
  ASSERT_EQ(h.size(), sent.size());
  for (size_t i = 0; i < h.size(); ++i) EXPECT_EQ(Diff(h[i], sent[i]), "") << i;
  h = History(id, false);
  ASSERT_EQ(h.size(), sent.size());
  for (size_t i = 0; i < h.size(); ++i) {
    v1::StatsReport want = sent[i];
    want.clear_layers();
    EXPECT_EQ(Diff(h[i], want), "") << i;
  }
  h = History(id, false, 7, 9);
  ASSERT_EQ(h.size(), 6u);
  EXPECT_EQ(h.front().step(), 7);
  EXPECT_EQ(h.back().step(), 9);

  v1::ListJobsResponse jobs;
  ASSERT_TRUE(op_->ListJobs(Ctx().get(), {}, &jobs).ok());
  ASSERT_EQ(jobs.jobs_size(), 1);
  EXPECT_EQ(Diff(jobs.jobs(0), st.job()), "");
}

TEST_F(CoordinatorTest, LongHistoryStreamsInPages) {
  // More reports than one page (256) of the history stream, in step order.
  Start();
  const int64_t id = Register(LenetJob("long", 1));
  for (int step = 999; step >= 0; --step) ASSERT_TRUE(Send(Report(id, step)).ok());
  server_->store()->Flush();
  std::vector<v1::StatsReport> h = History(id, false);
  ASSERT_EQ(h.size(), 1000u);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(h[size_t(i)].step(), i);
  EXPECT_EQ(Status(id).job().step(), 999);
}

TEST_F(CoordinatorTest, LayerStatsAnswerIsBoundedInBytes) {
  // Reports are added to a LayerStats answer while it stays within the byte cap (the rest is
  // asked for from the next step); at least one report is always returned.
  ServerOptions opt;
  opt.coordinator.max_response_bytes = 20000;
  Start(opt);
  const int64_t id = Register(LenetJob("bounded", 1));
  const size_t one = Report(id, 0, 0, 100).ByteSizeLong();
  ASSERT_GT(one, 6000u);
  ASSERT_LT(one, 10000u);
  for (int step = 0; step < 10; ++step) ASSERT_TRUE(Send(Report(id, step, 0, 100)).ok());
  server_->store()->Flush();
  v1::LayerStatsRequest req;
  req.mutable_job()->set_job_id(id);
  req.set_from_step(0);
  req.set_to_step(9);
  v1::LayerStatsResponse resp;
  ASSERT_TRUE(op_->LayerStats(Ctx().get(), req, &resp).ok());
  EXPECT_EQ(size_t(resp.reports_size()), 20000 / (one + 16));
  EXPECT_LE(resp.ByteSizeLong(), 20000u);
  req.set_from_step(resp.reports(resp.reports_size() - 1).step() + 1);
  resp.Clear();
  ASSERT_TRUE(op_->LayerStats(Ctx().get(), req, &resp).ok());
  EXPECT_EQ(resp.reports(0).step(), req.from_step());
}

TEST_F(CoordinatorTest, NonFiniteLossIsStoredAsIs) {
  Start();
  const int64_t id = Register(LenetJob("nan-loss", 1));
  v1::StatsReport r = Report(id, 3, 0, 2);
  r.set_loss(std::numeric_limits<double>::quiet_NaN());
  r.mutable_layers(0)->set_max_abs(std::numeric_limits<double>::infinity());
  ASSERT_TRUE(Send(r).ok());
  r = Report(id, 4);
  r.set_loss(-std::numeric_limits<double>::infinity());
  ASSERT_TRUE(Send(r).ok());
  server_->store()->Flush();
  std::vector<v1::StatsReport> h = History(id, true);
  ASSERT_EQ(h.size(), 2u);
  EXPECT_TRUE(std::isnan(h[0].loss()));
  EXPECT_TRUE(std::isinf(h[0].layers(0).max_abs()));
  EXPECT_EQ(h[1].loss(), -std::numeric_limits<double>::infinity());
  EXPECT_EQ(Status(id).loss(), -std::numeric_limits<double>::infinity());
  // A language model that diverged: its validation loss and perplexity too.
  r = Report(id, 5);
  r.set_test_loss(std::numeric_limits<double>::quiet_NaN());
  r.set_test_perplexity(std::numeric_limits<double>::infinity());
  ASSERT_TRUE(Send(r).ok());
  const v1::JobStatusResponse st = Status(id);
  EXPECT_TRUE(std::isnan(st.test_loss()));
  EXPECT_EQ(st.test_perplexity(), std::numeric_limits<double>::infinity());
  EXPECT_EQ(st.test_bits_per_byte(), -1);
}

TEST_F(CoordinatorTest, ReRegisterReturnsSameJobAndCurrentSchedule) {
  Start();
  v1::RegisterJobRequest req = LenetJob("resumable", 2);
  const int64_t id = Register(req);
  v1::PrecisionSchedule changed = req.schedule();
  changed.set_grad_bits(6);
  ASSERT_TRUE(SetSchedule(id, changed, 1).ok());
  // The run is resumed with its command-line schedule: the operator's schedule wins.
  req.set_start_step(500);
  req.set_world_size(4);
  req.clear_workers();
  for (int i = 0; i < 4; ++i) {
    auto* w = req.add_workers();
    w->set_rank(i);
    w->set_host("other" + std::to_string(i));
  }
  v1::RegisterJobResponse again;
  EXPECT_EQ(Register(req, &again), id);
  EXPECT_TRUE(again.existed());
  ExpectSchedule(again.schedule(), changed, 2, "cpdctl");
  v1::JobStatusResponse st = Status(id);
  EXPECT_EQ(st.job().world_size(), 4);
  ASSERT_EQ(st.workers_size(), 4);
  EXPECT_EQ(st.workers(3).host(), "other3");
  EXPECT_EQ(st.layers_size(), 5);   // not re-sent: kept
  EXPECT_EQ(st.job().step(), 500);  // no report yet since the resume
  // A second job gets another id.
  EXPECT_NE(Register(LenetJob("other-job")), id);
}

TEST_F(CoordinatorTest, ScheduleVersionsHistoryAndPushToWatchers) {
  Start();
  const v1::RegisterJobRequest req = LenetJob("sched", 1);
  const int64_t id = Register(req);

  v1::WatchScheduleRequest wreq;
  wreq.set_job_id(id);
  auto wctx = Ctx(30);
  auto watch = worker_->WatchSchedule(wctx.get(), wreq);
  v1::PrecisionSchedule got;
  ASSERT_TRUE(watch->Read(&got));  // the current one first
  EXPECT_EQ(got.version(), 1u);

  v1::PrecisionSchedule next = req.schedule();
  next.clear_cyclic();
  next.set_effective_from_step(100);
  next.mutable_formats(0)->set_spec("e4m3");
  v1::SetScheduleResponse sresp;
  ASSERT_TRUE(SetSchedule(id, next, 1, &sresp).ok());
  ExpectSchedule(sresp.schedule(), next, 2, "cpdctl");
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(watch->Read(&got));  // pushed
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_EQ(Diff(got, sresp.schedule()), "");

  // A stale expected_version is refused and changes nothing.
  grpc::Status s = SetSchedule(id, req.schedule(), 1);
  EXPECT_EQ(s.error_code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find("version 2"), std::string::npos) << s.error_message();
  // expected_version 0: no check.
  ASSERT_TRUE(SetSchedule(id, req.schedule(), 0, &sresp).ok());
  EXPECT_EQ(sresp.schedule().version(), 3u);
  ASSERT_TRUE(watch->Read(&got));
  EXPECT_EQ(got.version(), 3u);

  // A worker that already has version 3 hears only of later ones.
  v1::WatchScheduleRequest late;
  late.set_job_id(id);
  late.set_after_version(3);
  auto lctx = Ctx(30);
  auto watch2 = worker_->WatchSchedule(lctx.get(), late);
  ASSERT_TRUE(SetSchedule(id, next, 3, &sresp).ok());
  ASSERT_TRUE(watch2->Read(&got));
  EXPECT_EQ(got.version(), 4u);
  ASSERT_TRUE(watch->Read(&got));
  EXPECT_EQ(got.version(), 4u);

  // A worker claiming a version the job never had gets the current one.
  v1::WatchScheduleRequest future;
  future.set_job_id(id);
  future.set_after_version(99);
  auto fctx = Ctx(30);
  auto watch3 = worker_->WatchSchedule(fctx.get(), future);
  ASSERT_TRUE(watch3->Read(&got));
  EXPECT_EQ(got.version(), 4u);
  fctx->TryCancel();
  watch3->Finish();

  // Reports answer with the current version.
  v1::ReportStatsResponse rresp;
  ASSERT_TRUE(Send(Report(id, 1), &rresp).ok());
  EXPECT_EQ(rresp.schedule_version(), 4u);

  v1::GetScheduleResponse all = GetSchedule(id);
  EXPECT_EQ(all.schedule().version(), 4u);
  ASSERT_EQ(all.history_size(), 4);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(all.history(i).version(), uint64_t(i + 1));
  ExpectSchedule(all.history(0), req.schedule(), 1, "register");
  ExpectSchedule(all.history(1), next, 2, "cpdctl");
  EXPECT_EQ(Diff(all.history(3), all.schedule()), "");

  wctx->TryCancel();
  lctx->TryCancel();
  EXPECT_EQ(watch->Finish().error_code(), StatusCode::CANCELLED);
  EXPECT_EQ(watch2->Finish().error_code(), StatusCode::CANCELLED);
  // The server forgets cancelled streams.
  for (int i = 0; i < 200 && server_->coordinator()->open_streams() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  EXPECT_EQ(server_->coordinator()->open_streams(), 0u);
}

// Per-layer all-reduce formats (hybrid precision) in a schedule: validated like keep_fp32 (rule
// names first/last/bn, or the job's layers; specs parse), stored in order, pushed to the workers.
TEST_F(CoordinatorTest, ScheduleCarriesPerLayerAllReduceFormats) {
  Start();
  const v1::RegisterJobRequest req = LenetJob("hybrid", 1);
  const int64_t id = Register(req);
  v1::WatchScheduleRequest wreq;
  wreq.set_job_id(id);
  wreq.set_after_version(1);
  auto wctx = Ctx(30);
  auto watch = worker_->WatchSchedule(wctx.get(), wreq);

  v1::PrecisionSchedule next = req.schedule();
  for (const auto& [layer, spec] : std::vector<std::pair<std::string, std::string>>{
           {"first", "fp32"}, {"bn", "e5m2"}, {req.layers(0).name(), "int8"}, {"last", "fp32"}}) {
    auto* a = next.add_allreduce_layers();
    a->set_layer(layer);
    a->set_spec(spec);
  }
  v1::SetScheduleResponse sresp;
  grpc::Status s = SetSchedule(id, next, 1, &sresp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ExpectSchedule(sresp.schedule(), next, 2, "cpdctl");
  v1::PrecisionSchedule got;
  ASSERT_TRUE(watch->Read(&got));
  ASSERT_EQ(got.allreduce_layers_size(), 4);
  EXPECT_EQ(got.allreduce_layers(1).layer(), "bn");
  EXPECT_EQ(got.allreduce_layers(2).spec(), "int8");
  EXPECT_EQ(Diff(got, sresp.schedule()), "");
  EXPECT_EQ(Diff(GetSchedule(id).schedule(), sresp.schedule()), "");

  // An unknown layer or a bad spec is refused, naming the field; nothing is written.
  v1::PrecisionSchedule bad = next;
  bad.mutable_allreduce_layers(2)->set_layer("conv9");
  s = SetSchedule(id, bad, 2);
  EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("allreduce_layers[2].layer"), std::string::npos)
      << s.error_message();
  bad = next;
  bad.mutable_allreduce_layers(0)->set_spec("e4m3:bogus");
  s = SetSchedule(id, bad, 2);
  EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("allreduce_layers[0].spec"), std::string::npos)
      << s.error_message();
  EXPECT_EQ(GetSchedule(id).schedule().version(), 2u);
  wctx->TryCancel();
  watch->Finish();
}

TEST_F(CoordinatorTest, WatchJobStreamsReportsAndEndsWithTheJob) {
  Start();
  const int64_t id = Register(LenetJob("watched", 1));
  ASSERT_TRUE(Send(Report(id, 0, 0, 3)).ok());
  v1::WatchJobRequest req;
  req.mutable_job()->set_job_id(id);
  req.set_with_layers(false);
  auto ctx = Ctx(30);
  auto watch = op_->WatchJob(ctx.get(), req);
  v1::StatsReport got;
  ASSERT_TRUE(watch->Read(&got));  // the latest one first, without layer rows
  EXPECT_EQ(got.step(), 0);
  EXPECT_EQ(got.layers_size(), 0);
  for (int step = 1; step <= 5; ++step) {
    v1::StatsReport r = Report(id, step, 0, 2);
    r.set_finished(step == 5);
    ASSERT_TRUE(Send(r).ok());
    ASSERT_TRUE(watch->Read(&got));
    EXPECT_EQ(got.step(), step);
    EXPECT_EQ(got.finished(), step == 5);
    EXPECT_EQ(got.layers_size(), 0);
  }
  EXPECT_FALSE(watch->Read(&got));  // the job finished: the stream ends
  EXPECT_TRUE(watch->Finish().ok());
  EXPECT_EQ(Status(id).job().state(), "finished");

  // With layers, on a finished job: the final report, then the end.
  req.set_with_layers(true);
  auto ctx2 = Ctx(30);
  auto watch2 = op_->WatchJob(ctx2.get(), req);
  ASSERT_TRUE(watch2->Read(&got));
  EXPECT_EQ(got.step(), 5);
  EXPECT_EQ(got.layers_size(), 2);
  EXPECT_FALSE(watch2->Read(&got));
  EXPECT_TRUE(watch2->Finish().ok());
}

TEST_F(CoordinatorTest, WatchJobFansOutAndASlowReaderGetsTheNewest) {
  ServerOptions opt;
  opt.coordinator.watch_buffer = 8;
  Start(opt);
  const int64_t id = Register(LenetJob("fanout", 1));
  v1::WatchJobRequest req;
  req.mutable_job()->set_job_id(id);
  std::vector<std::unique_ptr<grpc::ClientContext>> ctxs;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::StatsReport>>> readers;
  // The slow readers' connection has a small flow-control window and no BDP probing, so that
  // unread messages back up into the coordinator instead of the client's socket buffers.
  grpc::ChannelArguments small;
  small.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  small.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 16 << 10);
  small.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto slow_channel = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(server_->port()),
                                                grpc::InsecureChannelCredentials(), small);
  auto slow = v1::OperatorService::NewStub(slow_channel);
  for (int i = 0; i < 6; ++i) {
    req.set_with_layers(i % 2 == 0);
    ctxs.push_back(Ctx(60));
    readers.push_back((i < 4 ? op_ : slow)->WatchJob(ctxs.back().get(), req));
  }
  for (int i = 0; i < 200 && server_->coordinator()->open_streams() < 6; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(server_->coordinator()->open_streams(), 6u);
  // Readers 0-3 keep up; 4 and 5 read nothing until the end. 400 reports of 100 rows (~3 MB)
  // are more than HTTP/2 flow control lets through unread.
  constexpr int kReports = 400;
  for (int step = 0; step < kReports; ++step) {
    ASSERT_TRUE(Send(Report(id, step, 0, 100)).ok());
    for (int i = 0; i < 4; ++i) {
      v1::StatsReport got;
      ASSERT_TRUE(readers[size_t(i)]->Read(&got));
      ASSERT_EQ(got.step(), step);
      ASSERT_EQ(got.layers_size(), i % 2 == 0 ? 100 : 0);
    }
  }
  for (int i = 4; i < 6; ++i) {
    v1::StatsReport got;
    int received = 0;
    int64_t last = -1;
    while (last != kReports - 1 && readers[size_t(i)]->Read(&got)) {
      EXPECT_GT(got.step(), last);
      last = got.step();
      ++received;
    }
    EXPECT_EQ(last, kReports - 1) << "the newest report reaches a slow reader";
    EXPECT_LT(received, kReports) << "a slow reader's buffer is bounded (oldest dropped)";
  }
  for (auto& c : ctxs) c->TryCancel();
  for (auto& r : readers) r->Finish();
}

TEST_F(CoordinatorTest, HundredsOfWatchersShareAFewThreads) {
  Start();
  const int64_t id = Register(LenetJob("popular", 1));
  auto threads = [] {
    std::ifstream in("/proc/self/status");
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
    }
    return -1;
  };
  const int before = threads();
  constexpr int kWatchers = 300;
  std::vector<std::unique_ptr<grpc::ClientContext>> ctxs;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::PrecisionSchedule>>> readers;
  v1::WatchScheduleRequest req;
  req.set_job_id(id);
  for (int i = 0; i < kWatchers; ++i) {
    ctxs.push_back(Ctx(60));
    readers.push_back(worker_->WatchSchedule(ctxs.back().get(), req));
  }
  v1::PrecisionSchedule got;
  for (auto& r : readers) {
    ASSERT_TRUE(r->Read(&got));
    ASSERT_EQ(got.version(), 1u);
  }
  EXPECT_EQ(server_->coordinator()->open_streams(), size_t(kWatchers));
  const int during = threads();
  EXPECT_LT(during - before, 50) << before << " threads before, " << during << " with " << kWatchers
                                 << " streams";
  v1::PrecisionSchedule next = LenetJob("x").schedule();
  next.set_grad_bits(4);
  ASSERT_TRUE(SetSchedule(id, next, 1).ok());
  for (auto& r : readers) {
    ASSERT_TRUE(r->Read(&got));
    ASSERT_EQ(got.version(), 2u);
  }
  for (auto& c : ctxs) c->TryCancel();
  for (auto& r : readers) r->Finish();
}

// ---- Rejections
// ----------------------------------------------------------------------------------

struct BadRegister {
  const char* what;
  std::function<void(v1::RegisterJobRequest*)> edit;
  const char* field;  // expected in the message
};

TEST_F(CoordinatorTest, RejectsMalformedRegistrations) {
  Start();
  const std::vector<BadRegister> cases = {
      {"empty name", [](auto* r) { r->set_job_name(""); }, "job_name"},
      {"space in name", [](auto* r) { r->set_job_name("my job"); }, "job_name"},
      {"slash in name", [](auto* r) { r->set_job_name("a/b"); }, "job_name"},
      {"129-char name", [](auto* r) { r->set_job_name(std::string(129, 'a')); }, "job_name"},
      {"world 0", [](auto* r) { r->set_world_size(0); }, "world_size"},
      {"world 65537", [](auto* r) { r->set_world_size(65537); }, "world_size"},
      {"negative emulated", [](auto* r) { r->set_emulated_workers_per_rank(-1); },
       "emulated_workers_per_rank"},
      {"worker rank out of range", [](auto* r) { r->mutable_workers(1)->set_rank(2); },
       "workers[1].rank"},
      {"duplicate worker", [](auto* r) { r->mutable_workers(1)->set_rank(0); }, "workers[1].rank"},
      {"duplicate layer", [](auto* r) { r->mutable_layers(2)->set_name("conv1"); },
       "layers[2].name"},
      {"too many layers",
       [](auto* r) {
         r->clear_layers();
         r->mutable_schedule()->clear_overrides();
         for (int i = 0; i < 10001; ++i)
           *r->add_layers() = Layer("l" + std::to_string(i), "Linear", 1);
       },
       "layers"},
      {"long layer name", [](auto* r) { r->mutable_layers(0)->set_name(std::string(257, 'x')); },
       "layers[0].name"},
      {"negative params", [](auto* r) { r->mutable_layers(0)->set_params(-1); },
       "layers[0].params"},
      {"bad spec", [](auto* r) { r->mutable_schedule()->mutable_formats(0)->set_spec("e9m9"); },
       "schedule.formats[0].spec"},
      {"empty spec", [](auto* r) { r->mutable_schedule()->mutable_formats(0)->set_spec(""); },
       "schedule.formats[0].spec"},
      {"bad rounding",
       [](auto* r) { r->mutable_schedule()->mutable_formats(1)->set_rounding("up"); },
       "schedule.formats[1].rounding"},
      {"unknown site",
       [](auto* r) { r->mutable_schedule()->mutable_formats(0)->set_site(v1::Site(42)); },
       "schedule.formats[0].site"},
      {"comm site",
       [](auto* r) { r->mutable_schedule()->mutable_formats(0)->set_site(v1::SITE_COMM); },
       "schedule.formats[0].site"},
      {"site twice",
       [](auto* r) { r->mutable_schedule()->mutable_formats(1)->set_site(v1::SITE_W); },
       "schedule.formats[1].site"},
      {"cpt min 1", [](auto* r) { r->mutable_schedule()->mutable_cyclic()->set_min_bits(1); },
       "schedule.cyclic.min_bits"},
      {"cpt max < min", [](auto* r) { r->mutable_schedule()->mutable_cyclic()->set_max_bits(2); },
       "schedule.cyclic.max_bits"},
      {"cpt max 17", [](auto* r) { r->mutable_schedule()->mutable_cyclic()->set_max_bits(17); },
       "schedule.cyclic.max_bits"},
      {"cpt periods 0", [](auto* r) { r->mutable_schedule()->mutable_cyclic()->set_periods(0); },
       "schedule.cyclic.periods"},
      {"grad_bits 1", [](auto* r) { r->mutable_schedule()->set_grad_bits(1); },
       "schedule.grad_bits"},
      {"grad_bits 17", [](auto* r) { r->mutable_schedule()->set_grad_bits(17); },
       "schedule.grad_bits"},
      {"negative effective step",
       [](auto* r) { r->mutable_schedule()->set_effective_from_step(-1); },
       "schedule.effective_from_step"},
      {"override of unknown layer",
       [](auto* r) { r->mutable_schedule()->mutable_overrides(0)->set_layer("conv9"); },
       "schedule.overrides[0].layer"},
      {"override bad spec",
       [](auto* r) { r->mutable_schedule()->mutable_overrides(0)->set_spec("int99"); },
       "schedule.overrides[0].spec"},
      {"keep_fp32 unknown layer", [](auto* r) { r->mutable_schedule()->add_keep_fp32("fc9"); },
       "schedule.keep_fp32[1]"},
      {"all-reduce format of unknown layer",
       [](auto* r) {
         auto* a = r->mutable_schedule()->add_allreduce_layers();
         a->set_layer("fc9");
         a->set_spec("fp32");
       },
       "schedule.allreduce_layers[0].layer"},
      {"all-reduce format bad spec",
       [](auto* r) {
         auto* a = r->mutable_schedule()->add_allreduce_layers();
         a->set_layer("first");
         a->set_spec("e9m9");
       },
       "schedule.allreduce_layers[0].spec"},
      {"all-reduce format empty spec",
       [](auto* r) { r->mutable_schedule()->add_allreduce_layers()->set_layer("bn"); },
       "schedule.allreduce_layers[0].spec"},
      {"negative total_steps", [](auto* r) { r->set_total_steps(-5); }, "total_steps"},
      {"negative start_step", [](auto* r) { r->set_start_step(-1); }, "start_step"},
      {"control char in arch", [](auto* r) { r->set_arch(std::string("le\nnet")); }, "arch"},
      {"space in study", [](auto* r) { r->set_study("my study"); }, "study"},
      {"65-char study", [](auto* r) { r->set_study(std::string(65, 's')); }, "study"},
  };
  for (const BadRegister& c : cases) {
    v1::RegisterJobRequest req = LenetJob("good-name", 2);
    c.edit(&req);
    v1::RegisterJobResponse resp;
    grpc::Status s = worker_->RegisterJob(Ctx().get(), req, &resp);
    EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT) << c.what << ": " << s.error_message();
    EXPECT_EQ(s.error_message().rfind(c.field, 0), 0u)
        << c.what << ": message should start with the field '" << c.field
        << "': " << s.error_message();
  }
  // Nothing was created.
  v1::ListJobsResponse jobs;
  ASSERT_TRUE(op_->ListJobs(Ctx().get(), {}, &jobs).ok());
  EXPECT_EQ(jobs.jobs_size(), 0);
  // The edges of the ranges are accepted.
  v1::RegisterJobRequest edge = LenetJob(std::string(128, 'Z'), 1);
  edge.set_job_name("A-z_0.9" + std::string(121, 'q'));
  edge.mutable_schedule()->mutable_cyclic()->set_min_bits(2);
  edge.mutable_schedule()->mutable_cyclic()->set_max_bits(16);
  edge.mutable_schedule()->set_grad_bits(16);
  edge.set_world_size(65536);
  edge.set_emulated_workers_per_rank(0);
  edge.set_study("S-1.b_" + std::string(58, 'x'));
  EXPECT_GT(Register(edge), 0);
}

TEST_F(CoordinatorTest, RejectsBadReportsAndQueries) {
  Start();
  const int64_t id = Register(LenetJob("target", 2));
  struct Case {
    const char* what;
    std::function<void(v1::StatsReport*)> edit;
    StatusCode code;
    const char* field;
  };
  const std::vector<Case> cases = {
      {"job_id 0", [](auto* r) { r->set_job_id(0); }, StatusCode::INVALID_ARGUMENT, "job_id"},
      {"unknown job", [](auto* r) { r->set_job_id(987654); }, StatusCode::NOT_FOUND,
       "no job with job_id 987654"},
      {"rank = world", [](auto* r) { r->set_rank(2); }, StatusCode::INVALID_ARGUMENT, "rank"},
      {"negative rank", [](auto* r) { r->set_rank(-1); }, StatusCode::INVALID_ARGUMENT, "rank"},
      {"negative step", [](auto* r) { r->set_step(-1); }, StatusCode::INVALID_ARGUMENT, "step"},
      {"ranks_alive > world", [](auto* r) { r->set_ranks_alive(3); }, StatusCode::INVALID_ARGUMENT,
       "ranks_alive"},
      {"accuracy 1.5", [](auto* r) { r->set_test_accuracy(1.5); }, StatusCode::INVALID_ARGUMENT,
       "test_accuracy"},
      {"NaN accuracy", [](auto* r) { r->set_train_accuracy(std::nan("")); },
       StatusCode::INVALID_ARGUMENT, "train_accuracy"},
      {"perplexity 0.5", [](auto* r) { r->set_test_perplexity(0.5); }, StatusCode::INVALID_ARGUMENT,
       "test_perplexity: 0.500000 is not a perplexity (>= 1"},
      {"negative rate", [](auto* r) { r->set_images_per_s(-1); }, StatusCode::INVALID_ARGUMENT,
       "images_per_s"},
      {"4097 layer rows",
       [](auto* r) {
         for (int i = 0; i < 4097; ++i) r->add_layers()->CopyFrom(Report(1, 0, 0, 1).layers(0));
       },
       StatusCode::INVALID_ARGUMENT, "layers"},
      {"layer without name", [](auto* r) { r->mutable_layers(1)->set_layer(""); },
       StatusCode::INVALID_ARGUMENT, "layers[1].layer"},
      {"stat site unset", [](auto* r) { r->mutable_layers(0)->set_site(v1::SITE_UNSPECIFIED); },
       StatusCode::INVALID_ARGUMENT, "layers[0].site"},
      {"saturated 1.5", [](auto* r) { r->mutable_layers(2)->set_saturated(1.5); },
       StatusCode::INVALID_ARGUMENT, "layers[2].saturated"},
      {"flushed NaN", [](auto* r) { r->mutable_layers(2)->set_flushed(std::nan("")); },
       StatusCode::INVALID_ARGUMENT, "layers[2].flushed"},
      {"negative max_abs", [](auto* r) { r->mutable_layers(0)->set_max_abs(-2); },
       StatusCode::INVALID_ARGUMENT, "layers[0].max_abs"},
      // Impossible values cpdctl printed as they came (step INT64_MAX: "-1.44e+19 %").
      {"step INT64_MAX", [](auto* r) { r->set_step(INT64_MAX); }, StatusCode::INVALID_ARGUMENT,
       "step: 9223372036854775807 is out of range; accepted: 0..9007199254740992"},
      {"step = total_steps", [](auto* r) { r->set_step(4680); }, StatusCode::INVALID_ARGUMENT,
       "step: 4680 is beyond the 4680 steps of job "},
      {"negative skipped_steps", [](auto* r) { r->set_skipped_steps(uint64_t(-1)); },
       StatusCode::INVALID_ARGUMENT, "skipped_steps: 18446744073709551615 is not a count"},
      {"skipped_steps > total_steps", [](auto* r) { r->set_skipped_steps(4681); },
       StatusCode::INVALID_ARGUMENT, "skipped_steps: 4681 exceeds the 4680 steps"},
      {"negative dropped_reports", [](auto* r) { r->set_dropped_reports(uint64_t(-3)); },
       StatusCode::INVALID_ARGUMENT, "dropped_reports"},
      {"negative schedule_version", [](auto* r) { r->set_schedule_version(uint64_t(-1)); },
       StatusCode::INVALID_ARGUMENT, "schedule_version"},
      {"time_ms INT64_MAX", [](auto* r) { r->set_time_ms(INT64_MAX); },
       StatusCode::INVALID_ARGUMENT, "time_ms"},
      {"negative flips", [](auto* r) { r->mutable_layers(1)->set_flips(uint64_t(-1)); },
       StatusCode::INVALID_ARGUMENT, "layers[1].flips"},
      {"negative nonfinite", [](auto* r) { r->mutable_layers(2)->set_nonfinite(uint64_t(-7)); },
       StatusCode::INVALID_ARGUMENT, "layers[2].nonfinite"},
  };
  for (const Case& c : cases) {
    v1::StatsReport r = Report(id, 10, 1, 3);
    c.edit(&r);
    grpc::Status s = Send(r);
    EXPECT_EQ(s.error_code(), c.code) << c.what << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(c.field), std::string::npos)
        << c.what << ": " << s.error_message();
  }
  server_->store()->Flush();
  EXPECT_EQ(Status(id).reports_stored(), 0u);

  // A request larger than --max-message-mib is refused by gRPC itself.
  v1::StatsReport huge = Report(id, 1);
  huge.mutable_layers()->Clear();
  huge.add_layers()->set_layer(std::string(5 << 20, 'x'));
  EXPECT_EQ(Send(huge).error_code(), StatusCode::RESOURCE_EXHAUSTED);

  // JobRefs: neither, both, bad name, unknown id and name.
  v1::JobStatusResponse st;
  v1::JobRef ref;
  EXPECT_EQ(op_->JobStatus(Ctx().get(), ref, &st).error_code(), StatusCode::INVALID_ARGUMENT);
  ref.set_job_id(id);
  ref.set_job_name("target");
  EXPECT_EQ(op_->JobStatus(Ctx().get(), ref, &st).error_code(), StatusCode::INVALID_ARGUMENT);
  ref.Clear();
  ref.set_job_name("bad name!");
  EXPECT_EQ(op_->JobStatus(Ctx().get(), ref, &st).error_code(), StatusCode::INVALID_ARGUMENT);
  ref.set_job_name("nobody");
  grpc::Status s = op_->JobStatus(Ctx().get(), ref, &st);
  EXPECT_EQ(s.error_code(), StatusCode::NOT_FOUND);
  EXPECT_NE(s.error_message().find("'nobody'"), std::string::npos) << s.error_message();
  ref.Clear();
  ref.set_job_id(id + 100);
  EXPECT_EQ(op_->JobStatus(Ctx().get(), ref, &st).error_code(), StatusCode::NOT_FOUND);
  ref.set_job_id(-3);
  EXPECT_EQ(op_->JobStatus(Ctx().get(), ref, &st).error_code(), StatusCode::INVALID_ARGUMENT);

  v1::GetScheduleRequest gs;
  v1::GetScheduleResponse gsr;
  gs.mutable_job()->set_job_name("nobody");
  EXPECT_EQ(op_->GetSchedule(Ctx().get(), gs, &gsr).error_code(), StatusCode::NOT_FOUND);

  v1::SetScheduleRequest ss;
  v1::SetScheduleResponse ssr;
  ss.mutable_job()->set_job_name("nobody");
  EXPECT_EQ(op_->SetSchedule(Ctx().get(), ss, &ssr).error_code(), StatusCode::NOT_FOUND);
  ss.mutable_job()->set_job_name("target");
  ss.mutable_schedule()->add_formats()->set_spec("fp8");
  ss.mutable_schedule()->mutable_formats(0)->set_site(v1::SITE_A);
  s = op_->SetSchedule(Ctx().get(), ss, &ssr);
  EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message().rfind("schedule.formats[0].spec", 0), 0u) << s.error_message();
  EXPECT_EQ(GetSchedule(id).history_size(), 1);

  v1::LayerStatsRequest ls;
  v1::LayerStatsResponse lsr;
  ls.mutable_job()->set_job_id(id);
  ls.set_from_step(10);
  ls.set_to_step(5);
  EXPECT_EQ(op_->LayerStats(Ctx().get(), ls, &lsr).error_code(), StatusCode::INVALID_ARGUMENT);
  ls.set_latest(true);
  EXPECT_EQ(op_->LayerStats(Ctx().get(), ls, &lsr).error_code(), StatusCode::INVALID_ARGUMENT);
  ls.set_from_step(0);
  ls.set_to_step(0);
  ls.set_limit(-1);
  EXPECT_EQ(op_->LayerStats(Ctx().get(), ls, &lsr).error_code(), StatusCode::INVALID_ARGUMENT);
  ls.set_limit(10001);
  EXPECT_EQ(op_->LayerStats(Ctx().get(), ls, &lsr).error_code(), StatusCode::INVALID_ARGUMENT);

  // Streams: unknown jobs and bad requests end with the status before any message.
  {
    v1::WatchScheduleRequest w;
    w.set_job_id(id + 100);
    auto ctx = Ctx();
    auto r = worker_->WatchSchedule(ctx.get(), w);
    v1::PrecisionSchedule m;
    EXPECT_FALSE(r->Read(&m));
    EXPECT_EQ(r->Finish().error_code(), StatusCode::NOT_FOUND);
  }
  {
    v1::WatchScheduleRequest w;
    w.set_job_id(0);
    auto ctx = Ctx();
    auto r = worker_->WatchSchedule(ctx.get(), w);
    v1::PrecisionSchedule m;
    EXPECT_FALSE(r->Read(&m));
    EXPECT_EQ(r->Finish().error_code(), StatusCode::INVALID_ARGUMENT);
  }
  {
    v1::WatchJobRequest w;
    w.mutable_job()->set_job_name("nobody");
    auto ctx = Ctx();
    auto r = op_->WatchJob(ctx.get(), w);
    v1::StatsReport m;
    EXPECT_FALSE(r->Read(&m));
    EXPECT_EQ(r->Finish().error_code(), StatusCode::NOT_FOUND);
  }
  {
    v1::JobHistoryRequest h;
    h.mutable_job()->set_job_id(id);
    h.set_from_step(9);
    h.set_to_step(3);
    auto ctx = Ctx();
    auto r = op_->JobHistory(ctx.get(), h);
    v1::StatsReport m;
    EXPECT_FALSE(r->Read(&m));
    EXPECT_EQ(r->Finish().error_code(), StatusCode::INVALID_ARGUMENT);
  }
  {
    v1::JobHistoryRequest h;
    h.mutable_job()->set_job_name("nobody");
    auto ctx = Ctx();
    auto r = op_->JobHistory(ctx.get(), h);
    v1::StatsReport m;
    EXPECT_FALSE(r->Read(&m));
    EXPECT_EQ(r->Finish().error_code(), StatusCode::NOT_FOUND);
  }
  // Still serving.
  ASSERT_TRUE(Send(Report(id, 11)).ok());
}

TEST_F(CoordinatorTest, SurvivesGarbageBytes) {
  // Bytes that are not the request message: refused by the call, the server keeps serving.
  Start();
  const int64_t id = Register(LenetJob("robust", 1));
  grpc::GenericStub generic(channel_);
  std::mt19937 rng(7);
  const char* methods[] = {"/cpd.v1.WorkerService/ReportStats", "/cpd.v1.WorkerService/RegisterJob",
                           "/cpd.v1.OperatorService/SetSchedule",
                           "/cpd.v1.OperatorService/JobStatus"};
  int refused = 0;
  for (int i = 0; i < 200; ++i) {
    std::string bytes(size_t(1 + rng() % 300), '\0');
    for (char& c : bytes) c = char(rng());
    grpc::Slice slice(bytes);
    grpc::ByteBuffer req(&slice, 1), resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    grpc::Status status;
    generic.UnaryCall(&ctx, methods[i % 4], grpc::StubOptions(), &req, &resp, [&](grpc::Status s) {
      std::lock_guard<std::mutex> l(mu);
      status = s;
      done = true;
      cv.notify_one();
    });
    std::unique_lock<std::mutex> l(mu);
    ASSERT_TRUE(cv.wait_for(l, std::chrono::seconds(15), [&] { return done; }));
    // Random bytes may happen to parse as a valid (e.g. empty) message; then the call is
    // validated like any other.
    if (!status.ok()) ++refused;
    EXPECT_NE(status.error_code(), StatusCode::UNAVAILABLE) << status.error_message();
  }
  EXPECT_GT(refused, 150);
  ASSERT_TRUE(Send(Report(id, 1)).ok());
}

// ---- Auth and TLS
// --------------------------------------------------------------------------------

TEST_F(CoordinatorTest, TokenIsRequiredWhenConfigured) {
  ServerOptions opt;
  opt.coordinator.token = "s3cret-token";
  Start(opt);
  v1::RegisterJobResponse resp;
  grpc::Status s = worker_->RegisterJob(Ctx().get(), LenetJob("authed"), &resp);
  EXPECT_EQ(s.error_code(), StatusCode::UNAUTHENTICATED);
  EXPECT_NE(s.error_message().find("authorization"), std::string::npos) << s.error_message();
  s = worker_->RegisterJob(Ctx(10, "s3cret-tokeN").get(), LenetJob("authed"), &resp);
  EXPECT_EQ(s.error_code(), StatusCode::UNAUTHENTICATED);
  s = worker_->RegisterJob(Ctx(10, "s3cret-token-and-more").get(), LenetJob("authed"), &resp);
  EXPECT_EQ(s.error_code(), StatusCode::UNAUTHENTICATED);
  {
    auto ctx = Ctx();
    ctx->AddMetadata("authorization", "s3cret-token");  // no "Bearer "
    s = worker_->RegisterJob(ctx.get(), LenetJob("authed"), &resp);
    EXPECT_EQ(s.error_code(), StatusCode::UNAUTHENTICATED);
  }
  s = worker_->RegisterJob(Ctx(10, "s3cret-token").get(), LenetJob("authed"), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  v1::ListJobsResponse jobs;
  EXPECT_EQ(op_->ListJobs(Ctx().get(), {}, &jobs).error_code(), StatusCode::UNAUTHENTICATED);
  ASSERT_TRUE(op_->ListJobs(Ctx(10, "s3cret-token").get(), {}, &jobs).ok());
  EXPECT_EQ(jobs.jobs_size(), 1);
  v1::ReportStatsResponse rresp;
  EXPECT_EQ(worker_->ReportStats(Ctx().get(), Report(resp.job_id(), 0), &rresp).error_code(),
            StatusCode::UNAUTHENTICATED);
  // Streams too.
  v1::WatchScheduleRequest w;
  w.set_job_id(resp.job_id());
  auto ctx = Ctx();
  auto r = worker_->WatchSchedule(ctx.get(), w);
  v1::PrecisionSchedule m;
  EXPECT_FALSE(r->Read(&m));
  EXPECT_EQ(r->Finish().error_code(), StatusCode::UNAUTHENTICATED);
  auto ctx2 = Ctx(10, "s3cret-token");
  auto r2 = worker_->WatchSchedule(ctx2.get(), w);
  EXPECT_TRUE(r2->Read(&m));
  ctx2->TryCancel();
  r2->Finish();
}

TEST_F(CoordinatorTest, ServesTls) {
  const std::string cert = dir_.File("cert.pem"), key = dir_.File("key.pem");
  const std::string cmd =
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost "
      "-addext subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout " +
      key + " -out " + cert + " >/dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  ServerOptions opt;
  opt.tls_cert_pem = ReadFile(cert);
  opt.tls_key_pem = ReadFile(key);
  Start(opt);
  // A plaintext client cannot talk to it.
  v1::ListJobsResponse jobs;
  EXPECT_FALSE(op_->ListJobs(Ctx(5).get(), {}, &jobs).ok());
  // A client that trusts the certificate can.
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = opt.tls_cert_pem;
  Connect(grpc::SslCredentials(ssl), "localhost");
  const int64_t id = Register(LenetJob("over-tls"));
  EXPECT_GT(id, 0);
  ASSERT_TRUE(Send(Report(id, 0, 0, 4)).ok());
  ASSERT_TRUE(op_->ListJobs(Ctx().get(), {}, &jobs).ok());
  EXPECT_EQ(jobs.jobs_size(), 1);
  // A client with another root does not.
  grpc::SslCredentialsOptions other;
  other.pem_root_certs = ReadFile("/etc/ssl/certs/ca-certificates.crt");
  Connect(grpc::SslCredentials(other), "localhost");
  EXPECT_FALSE(op_->ListJobs(Ctx(5).get(), {}, &jobs).ok());
}

// ---- Persistence, backpressure, shutdown
// ---------------------------------------------------------

TEST_F(CoordinatorTest, RestartOnTheSameDatabaseKeepsEverything) {
  Start();
  const v1::RegisterJobRequest a = LenetJob("job-a", 2), b = LenetJob("job-b", 1);
  const int64_t ida = Register(a), idb = Register(b);
  v1::PrecisionSchedule changed = a.schedule();
  changed.set_grad_bits(5);
  ASSERT_TRUE(SetSchedule(ida, changed, 1).ok());
  for (int step = 0; step < 30; ++step) {
    v1::StatsReport r = Report(ida, step, step % 2, step % 10 == 0 ? 6 : 0);
    if (step == 25) r.set_test_accuracy(0.7);
    if (step == 27) r.set_train_accuracy(0.75);
    ASSERT_TRUE(Send(r).ok());
  }
  v1::StatsReport fin = Report(idb, 3);
  fin.set_finished(true);
  ASSERT_TRUE(Send(fin).ok());

  v1::ListJobsResponse jobs_before;
  ASSERT_TRUE(op_->ListJobs(Ctx().get(), {}, &jobs_before).ok());
  Stop();  // shutdown stores every accepted report
  Start();

  v1::ListJobsResponse jobs_after;
  ASSERT_TRUE(op_->ListJobs(Ctx().get(), {}, &jobs_after).ok());
  EXPECT_EQ(Diff(jobs_after, jobs_before), "");
  v1::JobStatusResponse st = Status(ida);
  EXPECT_EQ(st.job().step(), 29);
  EXPECT_EQ(st.reports_stored(), 30u);
  EXPECT_EQ(st.test_accuracy(), 0.7);
  EXPECT_EQ(st.train_accuracy(), 0.75);
  EXPECT_EQ(st.workers_size(), 2);
  EXPECT_EQ(st.layers_size(), 5);
  EXPECT_EQ(st.schedule().version(), 2u);
  EXPECT_EQ(st.schedule().grad_bits(), 5);
  EXPECT_EQ(Status(idb).job().state(), "finished");
  v1::GetScheduleResponse sched = GetSchedule(ida);
  ASSERT_EQ(sched.history_size(), 2);
  ExpectSchedule(sched.history(0), a.schedule(), 1, "register");
  ExpectSchedule(sched.history(1), changed, 2, "cpdctl");
  std::vector<v1::StatsReport> h = History(ida, true);
  ASSERT_EQ(h.size(), 30u);
  EXPECT_EQ(h[20].layers_size(), 6);
  v1::LayerStatsRequest lreq;
  lreq.mutable_job()->set_job_id(ida);
  lreq.set_latest(true);
  v1::LayerStatsResponse lresp;
  ASSERT_TRUE(op_->LayerStats(Ctx().get(), lreq, &lresp).ok());
  ASSERT_EQ(lresp.reports_size(), 1);
  EXPECT_EQ(lresp.reports(0).step(), 20);

  // The same names map to the same ids; the coordinator's schedule wins; ids are not reused.
  v1::RegisterJobResponse again;
  EXPECT_EQ(Register(a, &again), ida);
  EXPECT_TRUE(again.existed());
  EXPECT_EQ(again.schedule().version(), 2u);
  EXPECT_GT(Register(LenetJob("job-c")), idb);
}

TEST_F(CoordinatorTest, FullQueueShedsLoadAndEveryAcceptedReportIsStored) {
  ServerOptions opt;
  opt.store.queue_max_reports = 8;
  opt.store.busy_timeout_ms = 60000;
  Start(opt);
  const int64_t id = Register(LenetJob("flood", 1));
  // Another connection holds the database's write lock: the writer thread cannot commit.
  sqlite3* blocker = nullptr;
  ASSERT_EQ(sqlite3_open(dir_.File("coord.db").c_str(), &blocker), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(blocker, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr), SQLITE_OK);
  int accepted = 0, shed = 0;
  for (int step = 0; step < 60; ++step) {
    grpc::Status s = Send(Report(id, step, 0, 5));
    if (s.ok()) {
      ++accepted;
    } else {
      EXPECT_EQ(s.error_code(), StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
      EXPECT_NE(s.error_message().find("queue is full"), std::string::npos);
      ++shed;
    }
  }
  EXPECT_GT(shed, 0);
  EXPECT_GE(accepted, 8);
  // Shut down while the accepted reports wait; release the lock a moment later.
  std::thread release([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    sqlite3_exec(blocker, "ROLLBACK", nullptr, nullptr, nullptr);
  });
  Stop();
  release.join();
  sqlite3_close(blocker);
  Start();
  EXPECT_EQ(Status(id).reports_stored(), uint64_t(accepted));
  EXPECT_EQ(History(id, false).size(), size_t(accepted));
}

TEST_F(CoordinatorTest, ShutdownEndsOpenStreamsPromptly) {
  Start();
  const int64_t id = Register(LenetJob("streams", 1));
  v1::WatchScheduleRequest w;
  w.set_job_id(id);
  auto c1 = Ctx(60);
  auto s1 = worker_->WatchSchedule(c1.get(), w);
  v1::WatchJobRequest wj;
  wj.mutable_job()->set_job_id(id);
  auto c2 = Ctx(60);
  auto s2 = op_->WatchJob(c2.get(), wj);
  v1::PrecisionSchedule m;
  ASSERT_TRUE(s1->Read(&m));
  for (int i = 0; i < 200 && server_->coordinator()->open_streams() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(server_->coordinator()->open_streams(), 2u);
  const auto t0 = std::chrono::steady_clock::now();
  server_->Shutdown(/*grace_ms=*/5000);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
  EXPECT_FALSE(s1->Read(&m));
  grpc::Status st = s1->Finish();
  EXPECT_EQ(st.error_code(), StatusCode::UNAVAILABLE) << st.error_message();
  v1::StatsReport r;
  EXPECT_FALSE(s2->Read(&r));
  EXPECT_EQ(s2->Finish().error_code(), StatusCode::UNAVAILABLE);
}

TEST_F(CoordinatorTest, StaleAfterSilence) {
  ServerOptions opt;
  opt.coordinator.stale_after_ms = 300;
  Start(opt);
  const int64_t id = Register(LenetJob("quiet", 1));
  ASSERT_TRUE(Send(Report(id, 1)).ok());
  EXPECT_EQ(Status(id).job().state(), "running");
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  EXPECT_EQ(Status(id).job().state(), "stale");
  ASSERT_TRUE(Send(Report(id, 2)).ok());
  EXPECT_EQ(Status(id).job().state(), "running");
}

// ---- Studies ------------------------------------------------------------------------------------

// A report at the end of `epoch` with `loss` and a measured test accuracy.
v1::StatsReport EpochEnd(int64_t id, int64_t step, int epoch, double loss, double test_acc) {
  v1::StatsReport r = Report(id, step);
  r.set_epoch(epoch);
  r.set_loss(loss);
  r.set_test_accuracy(test_acc);
  return r;
}

v1::ListJobsResponse ListStudy(v1::OperatorService::Stub* op, const std::string& study) {
  v1::ListJobsRequest req;
  req.set_study(study);
  v1::ListJobsResponse resp;
  const grpc::Status s = op->ListJobs(Ctx().get(), req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return resp;
}

TEST_F(CoordinatorTest, StudyRunsAreListedWithStateAndAccuracyAndKeptAcrossRestarts) {
  Start();
  v1::RegisterJobRequest a = LenetJob("s1.lr-0.1", 1), b = LenetJob("s1.lr-0.2", 1),
                         other = LenetJob("s2.lr-0.1", 1), loose = LenetJob("untagged", 1);
  a.set_study("s1");
  b.set_study("s1");
  other.set_study("s2");
  const int64_t ida = Register(a), idb = Register(b), ido = Register(other);
  const int64_t idl = Register(loose);
  ASSERT_TRUE(Send(EpochEnd(ida, 467, 0, 0.75, 0.625)).ok());
  ASSERT_TRUE(Send(Report(ida, 500)).ok());  // a later step without an accuracy
  v1::StatsReport fin = EpochEnd(idb, 935, 1, 0.5, 0.8125);
  fin.set_finished(true);
  ASSERT_TRUE(Send(fin).ok());
  ASSERT_TRUE(Send(Report(ido, 3)).ok());

  v1::ListJobsResponse s1 = ListStudy(op_.get(), "s1");
  ASSERT_EQ(s1.jobs_size(), 2);
  const v1::JobSummary &ja = s1.jobs(0), &jb = s1.jobs(1);
  EXPECT_EQ(ja.job_id(), ida);
  EXPECT_EQ(ja.study(), "s1");
  EXPECT_EQ(ja.state(), "running");
  EXPECT_EQ(ja.step(), 500);
  EXPECT_EQ(ja.epoch(), 1);  // Report() derives the epoch from the step: 500 / 468
  EXPECT_EQ(ja.epochs(), 10);
  EXPECT_EQ(ja.loss(), 2.3 / 501.0);
  EXPECT_EQ(ja.test_accuracy(), 0.625);
  EXPECT_EQ(jb.job_id(), idb);
  EXPECT_EQ(jb.state(), "finished");
  EXPECT_EQ(jb.step(), 935);
  EXPECT_EQ(jb.epoch(), 1);
  EXPECT_EQ(jb.loss(), 0.5);
  EXPECT_EQ(jb.test_accuracy(), 0.8125);
  EXPECT_EQ(ListStudy(op_.get(), "s2").jobs_size(), 1);
  EXPECT_EQ(ListStudy(op_.get(), "no-such-study").jobs_size(), 0);
  v1::ListJobsResponse all = ListStudy(op_.get(), "");
  ASSERT_EQ(all.jobs_size(), 4);
  EXPECT_EQ(all.jobs(3).job_id(), idl);
  EXPECT_EQ(all.jobs(3).study(), "");
  EXPECT_EQ(all.jobs(3).test_accuracy(), -1);  // none measured yet

  // A resumed run without --study keeps the tag; another study is refused by field; an untagged
  // job takes the tag of its re-registration.
  a.clear_study();
  a.set_start_step(501);
  v1::RegisterJobResponse again;
  EXPECT_EQ(Register(a, &again), ida);
  EXPECT_TRUE(again.existed());
  a.set_study("s2");
  grpc::Status moved = worker_->RegisterJob(Ctx().get(), a, &again);
  EXPECT_EQ(moved.error_code(), StatusCode::FAILED_PRECONDITION) << moved.error_message();
  EXPECT_EQ(moved.error_message().rfind("study: job " + std::to_string(ida), 0), 0u)
      << moved.error_message();
  EXPECT_NE(moved.error_message().find("'s1'"), std::string::npos) << moved.error_message();
  loose.set_study("s2");
  EXPECT_EQ(Register(loose), idl);
  EXPECT_EQ(ListStudy(op_.get(), "s2").jobs_size(), 2);
  ASSERT_TRUE(Send(Report(ida, 501)).ok());  // the resumed run reports
  s1 = ListStudy(op_.get(), "s1");
  ASSERT_EQ(s1.jobs_size(), 2);
  EXPECT_EQ(s1.jobs(0).study(), "s1");
  EXPECT_EQ(s1.jobs(0).step(), 501);
  EXPECT_EQ(s1.jobs(0).test_accuracy(), 0.625);  // the resume keeps the last measured accuracy

  // A bad filter is refused by field.
  v1::ListJobsRequest bad;
  bad.set_study("no spaces");
  v1::ListJobsResponse none;
  grpc::Status st = op_->ListJobs(Ctx().get(), bad, &none);
  EXPECT_EQ(st.error_code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(st.error_message().rfind("study: ", 0), 0u) << st.error_message();

  // Restarted on the same database: the same runs, tags, states, epochs, losses and accuracies.
  all = ListStudy(op_.get(), "");
  Stop();
  Start();
  EXPECT_EQ(Diff(ListStudy(op_.get(), ""), all), "");
  EXPECT_EQ(Diff(ListStudy(op_.get(), "s1"), s1), "");
  EXPECT_EQ(ListStudy(op_.get(), "s2").jobs_size(), 2);
}

// ---- Language models ---------------------------------------------------------------------------

// The end of a language model's epoch as cpd-train reports it: the next-token accuracies, the
// validation loss per token, the perplexity exp(loss) and the bits per byte loss / ln 2.
v1::StatsReport LmEpochEnd(int64_t id, int64_t step, int epoch, double test_loss) {
  v1::StatsReport r = Report(id, step);
  r.set_epoch(epoch);
  r.set_train_accuracy(0.25);
  r.set_test_accuracy(0.125);
  r.set_test_loss(test_loss);
  r.set_test_perplexity(std::exp(test_loss));
  r.set_test_bits_per_byte(test_loss / std::log(2.0));
  return r;
}

// Validation loss, perplexity and bits per byte go from a worker's report through the store to
// JobStatus, ListJobs and JobHistory, survive retention and a restart; a vision job has none.
TEST_F(CoordinatorTest, LanguageModelValidationFiguresAreStoredAndKeptAcrossRestarts) {
  ServerOptions opt;
  // All but the newest 2 reports are thinned to steps that are multiples of 1000.
  opt.store.retention.keep_full = 2;
  opt.store.retention.thin_every = 1000;
  opt.store.retention.interval_ms = 3600000;
  Start(opt);
  const int64_t lm = Register(GptJob("gpt-text")), vision = Register(LenetJob("lenet", 1));
  // Epoch 1 ends at step 15 in a report with no accuracy (perplexity alone marks it an epoch's
  // end), epoch 2 at step 31 as cpd-train reports it; steps 32..35 measure nothing.
  std::vector<v1::StatsReport> sent;
  for (int step = 0; step < 36; ++step) {
    v1::StatsReport r = step == 31 ? LmEpochEnd(lm, 31, 2, 1.75) : Report(lm, step);
    if (step == 15) {
      r = LmEpochEnd(lm, 15, 1, 2.5);
      r.set_train_accuracy(-1);
      r.set_test_accuracy(-1);
    }
    ASSERT_TRUE(Send(r).ok());
    sent.push_back(r);
  }
  ASSERT_TRUE(Send(EpochEnd(vision, 467, 1, 0.5, 0.75)).ok());
  server_->store()->Flush();
  ASSERT_TRUE(server_->store()->ApplyRetention().ok());

  const v1::JobStatusResponse st = Status(lm);
  EXPECT_EQ(st.test_loss(), 1.75);
  EXPECT_EQ(st.test_perplexity(), std::exp(1.75));
  EXPECT_EQ(st.test_bits_per_byte(), 1.75 / std::log(2.0));
  EXPECT_EQ(st.test_accuracy(), 0.125);
  EXPECT_EQ(st.job().test_perplexity(), std::exp(1.75));
  EXPECT_EQ(st.job().test_bits_per_byte(), 1.75 / std::log(2.0));
  EXPECT_EQ(st.job().step(), 35);
  const v1::JobStatusResponse vs = Status(vision);
  EXPECT_EQ(vs.test_accuracy(), 0.75);
  EXPECT_EQ(vs.test_loss(), -1);
  EXPECT_EQ(vs.test_perplexity(), -1);
  EXPECT_EQ(vs.test_bits_per_byte(), -1);
  EXPECT_EQ(vs.job().test_perplexity(), -1);
  EXPECT_EQ(vs.job().test_bits_per_byte(), -1);

  // Both epochs' ends outlive the thinning (step 0 is a multiple, 34 and 35 the newest), every
  // figure as sent.
  const std::vector<v1::StatsReport> h = History(lm, false);
  std::vector<int64_t> steps;
  for (const auto& r : h) steps.push_back(r.step());
  EXPECT_EQ(steps, (std::vector<int64_t>{0, 15, 31, 34, 35}));
  for (const auto& r : h) EXPECT_EQ(Diff(r, sent[size_t(r.step())]), "") << r.step();

  v1::ListJobsResponse before;
  ASSERT_TRUE(op_->ListJobs(Ctx().get(), {}, &before).ok());
  ASSERT_EQ(before.jobs_size(), 2);
  EXPECT_EQ(before.jobs(0).test_perplexity(), std::exp(1.75));
  Stop();
  Start(opt);
  v1::ListJobsResponse after;
  ASSERT_TRUE(op_->ListJobs(Ctx().get(), {}, &after).ok());
  EXPECT_EQ(Diff(after, before), "");
  const v1::JobStatusResponse again = Status(lm);
  EXPECT_EQ(again.test_loss(), 1.75);
  EXPECT_EQ(again.test_perplexity(), std::exp(1.75));
  EXPECT_EQ(again.test_bits_per_byte(), 1.75 / std::log(2.0));
  EXPECT_EQ(Status(vision).test_perplexity(), -1);
}

// The first schema (version 1) as cpd-coordinator wrote it, without jobs.study.
constexpr const char* kSchemaV1 = R"sql(
CREATE TABLE jobs(
  job_id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL UNIQUE,
  registered_ms INTEGER NOT NULL, updated_ms INTEGER NOT NULL, world_size INTEGER NOT NULL,
  emulated_workers_per_rank INTEGER NOT NULL, arch TEXT NOT NULL, dataset TEXT NOT NULL,
  total_steps INTEGER NOT NULL, epochs INTEGER NOT NULL, start_step INTEGER NOT NULL,
  allreduce TEXT NOT NULL);
CREATE TABLE workers(
  job_id INTEGER NOT NULL, rank INTEGER NOT NULL, host TEXT NOT NULL, pid INTEGER NOT NULL,
  PRIMARY KEY(job_id, rank)) WITHOUT ROWID;
CREATE TABLE layers(
  job_id INTEGER NOT NULL, idx INTEGER NOT NULL, name TEXT NOT NULL, kind TEXT NOT NULL,
  quantizable INTEGER NOT NULL, params INTEGER NOT NULL,
  PRIMARY KEY(job_id, idx)) WITHOUT ROWID;
CREATE TABLE schedules(
  job_id INTEGER NOT NULL, version INTEGER NOT NULL, set_at_ms INTEGER NOT NULL,
  set_by TEXT NOT NULL, schedule BLOB NOT NULL,
  PRIMARY KEY(job_id, version)) WITHOUT ROWID;
CREATE TABLE reports(
  id INTEGER PRIMARY KEY, job_id INTEGER NOT NULL, step INTEGER NOT NULL, rank INTEGER NOT NULL,
  has_layers INTEGER NOT NULL, keep INTEGER NOT NULL, finished INTEGER NOT NULL,
  time_ms INTEGER NOT NULL, received_ms INTEGER NOT NULL, report BLOB NOT NULL);
CREATE INDEX reports_job_step ON reports(job_id, step);
INSERT INTO jobs VALUES(7, 'old-job', 1700000000000, 1700000000000, 1, 1, 'mlp', 'synthetic',
                        100, 2, 0, 'ring');
PRAGMA user_version = 1;
)sql";

// Runs `sql` with one bound blob (?1) when `blob` is not empty.
void Sql(sqlite3* db, const std::string& sql, const std::string& blob = "") {
  sqlite3_stmt* st = nullptr;
  ASSERT_EQ(sqlite3_prepare_v2(db, sql.c_str(), -1, &st, nullptr), SQLITE_OK) << sqlite3_errmsg(db);
  if (!blob.empty()) sqlite3_bind_blob(st, 1, blob.data(), int(blob.size()), SQLITE_TRANSIENT);
  EXPECT_EQ(sqlite3_step(st), SQLITE_DONE) << sqlite3_errmsg(db);
  sqlite3_finalize(st);
}

int64_t UserVersion(const std::string& path) {
  sqlite3* db = nullptr;
  EXPECT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  sqlite3_stmt* st = nullptr;
  int64_t v = -1;
  if (sqlite3_prepare_v2(db, "PRAGMA user_version", -1, &st, nullptr) == SQLITE_OK &&
      sqlite3_step(st) == SQLITE_ROW) {
    v = sqlite3_column_int64(st, 0);
  }
  sqlite3_finalize(st);
  sqlite3_close(db);
  return v;
}

TEST_F(CoordinatorTest, OldSchemaDatabaseMigratesAndKeepsItsJobs) {
  const std::string path = dir_.File("v1.db");
  {
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
    ASSERT_EQ(sqlite3_exec(db, kSchemaV1, nullptr, nullptr, nullptr), SQLITE_OK)
        << sqlite3_errmsg(db);
    v1::PrecisionSchedule sched;
    sched.set_version(1);
    sched.set_set_by("register");
    Sql(db, "INSERT INTO schedules VALUES(7, 1, 1700000000000, 'register', ?1)",
        sched.SerializeAsString());
    Sql(db, "INSERT INTO reports VALUES(1, 7, 41, 0, 0, 1, 0, 1700000000001, 1700000000002, ?1)",
        EpochEnd(7, 41, 1, 0.25, 0.5).SerializeAsString());
    sqlite3_close(db);
  }
  ASSERT_EQ(UserVersion(path), 1);
  ServerOptions opt;
  opt.store.path = path;
  Start(opt);
  v1::ListJobsResponse all = ListStudy(op_.get(), "");
  ASSERT_EQ(all.jobs_size(), 1);
  EXPECT_EQ(all.jobs(0).job_id(), 7);
  EXPECT_EQ(all.jobs(0).job_name(), "old-job");
  EXPECT_EQ(all.jobs(0).study(), "");
  EXPECT_EQ(all.jobs(0).step(), 41);
  EXPECT_EQ(all.jobs(0).epoch(), 1);
  EXPECT_EQ(all.jobs(0).test_accuracy(), 0.5);
  // Its report predates the validation figures (read as 0): none measured, not 0.
  EXPECT_EQ(all.jobs(0).test_perplexity(), -1);
  EXPECT_EQ(all.jobs(0).test_bits_per_byte(), -1);
  EXPECT_EQ(Status(7).test_loss(), -1);
  // The old job can be resumed into a study; new jobs get ids after it.
  v1::RegisterJobRequest old = LenetJob("old-job", 1);
  old.set_study("migrated");
  EXPECT_EQ(Register(old), 7);
  v1::RegisterJobRequest fresh = GptJob("migrated.new");
  fresh.set_study("migrated");
  const int64_t lm = Register(fresh);
  EXPECT_GT(lm, 7);
  ASSERT_TRUE(Send(LmEpochEnd(lm, 31, 2, 1.5)).ok());
  Stop();
  EXPECT_EQ(UserVersion(path), 2);
  Start(opt);
  const v1::ListJobsResponse study = ListStudy(op_.get(), "migrated");
  ASSERT_EQ(study.jobs_size(), 2);
  EXPECT_EQ(study.jobs(0).job_name(), "old-job");
  EXPECT_EQ(study.jobs(1).job_name(), "migrated.new");
  EXPECT_EQ(study.jobs(0).test_perplexity(), -1);
  EXPECT_EQ(study.jobs(1).test_perplexity(), std::exp(1.5));
  EXPECT_EQ(study.jobs(1).test_bits_per_byte(), 1.5 / std::log(2.0));
  EXPECT_EQ(Status(lm).test_loss(), 1.5);
}

// ---- The store on its own: retention and opening errors ----------------------------------------

std::vector<int64_t> StoredSteps(coordinator::Store* store, int64_t job) {
  std::vector<int64_t> steps;
  coordinator::ReportQuery q;
  q.job_id = job;
  Status s = store->QueryReports(q, [&](const coordinator::StoredReport& r) {
    steps.push_back(r.step);
    return true;
  });
  EXPECT_TRUE(s.ok()) << s.message();
  return steps;
}

void EnqueueSteps(coordinator::Store* store, int64_t job, int64_t from, int64_t to,
                  const std::set<int64_t>& keep = {}) {
  for (int64_t step = from; step < to; ++step) {
    coordinator::ReportRow row;
    row.job_id = job;
    row.step = step;
    row.keep = keep.count(step) > 0;
    row.blob = std::make_shared<const std::string>(Report(job, step).SerializeAsString());
    ASSERT_TRUE(store->Enqueue(row));
  }
  store->Flush();
}

TEST(CoordinatorStore, RetentionThinsOldReportsAndCapsEachJob) {
  TempDir dir;
  coordinator::StoreOptions opt;
  opt.path = dir.File("r.db");
  opt.retention.keep_full = 20;
  opt.retention.thin_every = 5;
  opt.retention.max_reports_per_job = 0;
  opt.retention.interval_ms = 0;  // only when asked
  std::vector<int64_t> want;
  {
    auto store = coordinator::Store::Open(opt);
    ASSERT_TRUE(store.ok()) << store.status().message();
    coordinator::Store* s = store->get();
    EnqueueSteps(s, 1, 0, 100, /*keep=*/{33});
    EnqueueSteps(s, 2, 0, 10);  // below keep_full: untouched
    ASSERT_EQ(s->ReportsStored(1), 100u);
    ASSERT_TRUE(s->ApplyRetention().ok());
    // The newest 20 in full, older ones at multiples of 5, and the end-of-epoch report 33.
    for (int64_t step = 0; step < 80; step += 5) {
      want.push_back(step);
      if (step == 30) want.push_back(33);
    }
    for (int64_t step = 80; step < 100; ++step) want.push_back(step);
    EXPECT_EQ(StoredSteps(s, 1), want);
    EXPECT_EQ(s->ReportsStored(1), want.size());
    EXPECT_EQ(s->ReportsStored(2), 10u);
    EXPECT_EQ(s->stats().thinned, 100u - want.size());
    // A second pass changes nothing; new reports move the window.
    ASSERT_TRUE(s->ApplyRetention().ok());
    EXPECT_EQ(StoredSteps(s, 1), want);
    EnqueueSteps(s, 1, 100, 110);
    ASSERT_TRUE(s->ApplyRetention().ok());
    want.clear();
    for (int64_t step = 0; step < 90; step += 5) {
      want.push_back(step);
      if (step == 30) want.push_back(33);
    }
    for (int64_t step = 90; step < 110; ++step) want.push_back(step);
    EXPECT_EQ(StoredSteps(s, 1), want);
  }
  // Reopened with a hard cap: the oldest go, whatever they are; the count survives the reopen.
  opt.retention.max_reports_per_job = 25;
  auto store = coordinator::Store::Open(opt);
  ASSERT_TRUE(store.ok()) << store.status().message();
  coordinator::Store* s = store->get();
  EXPECT_EQ(s->ReportsStored(1), want.size());
  ASSERT_TRUE(s->ApplyRetention().ok());
  want.erase(want.begin(), want.end() - 25);
  EXPECT_EQ(want.front(), 65);  // 90..109 and 65, 70, 75, 80, 85
  EXPECT_EQ(StoredSteps(s, 1), want);
  EXPECT_EQ(s->ReportsStored(1), 25u);
  EXPECT_EQ(s->ReportsStored(2), 10u);
}

TEST(CoordinatorStore, RetentionOfALongJobRunsInBoundedSteps) {
  // 12,000 reports: thinning and the cap each take several transactions of <= 4096 rows; the
  // result is the same as one pass would give.
  TempDir dir;
  coordinator::StoreOptions opt;
  opt.path = dir.File("long.db");
  opt.retention.keep_full = 100;
  opt.retention.thin_every = 7;
  opt.retention.max_reports_per_job = 0;
  opt.retention.interval_ms = 0;
  {
    auto store = coordinator::Store::Open(opt);
    ASSERT_TRUE(store.ok()) << store.status().message();
    coordinator::Store* s = store->get();
    EnqueueSteps(s, 3, 0, 12000);
    ASSERT_TRUE(s->ApplyRetention().ok());
    std::vector<int64_t> want;
    for (int64_t step = 0; step < 11900; step += 7) want.push_back(step);
    for (int64_t step = 11900; step < 12000; ++step) want.push_back(step);
    EXPECT_EQ(StoredSteps(s, 3), want);
    EXPECT_EQ(s->ReportsStored(3), want.size());
  }
  opt.retention.thin_every = 1;
  opt.retention.max_reports_per_job = 150;
  auto store = coordinator::Store::Open(opt);
  ASSERT_TRUE(store.ok()) << store.status().message();
  EnqueueSteps(store->get(), 4, 0, 10000);  // 9,850 over the cap: three transactions
  ASSERT_TRUE((*store)->ApplyRetention().ok());
  const std::vector<int64_t> steps = StoredSteps(store->get(), 3);
  ASSERT_EQ(steps.size(), 150u);
  EXPECT_EQ(steps.back(), 11999);
  EXPECT_EQ(steps.front(), 11900 - 50 * 7);
  const std::vector<int64_t> steps4 = StoredSteps(store->get(), 4);
  ASSERT_EQ(steps4.size(), 150u);
  EXPECT_EQ(steps4.front(), 9850);
  EXPECT_EQ((*store)->ReportsStored(4), 150u);
}

TEST(CoordinatorStore, WriterAppliesRetentionPeriodically) {
  TempDir dir;
  coordinator::StoreOptions opt;
  opt.path = dir.File("p.db");
  opt.retention.keep_full = 10;
  opt.retention.thin_every = 1000;
  opt.retention.max_reports_per_job = 50;
  opt.retention.interval_ms = 50;
  auto store = coordinator::Store::Open(opt);
  ASSERT_TRUE(store.ok()) << store.status().message();
  coordinator::Store* s = store->get();
  EnqueueSteps(s, 9, 1, 500);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (s->ReportsStored(9) > 10 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Steps 1..489 thinned to multiples of 1000 (none), then 490..499 kept.
  const std::vector<int64_t> steps = StoredSteps(s, 9);
  ASSERT_EQ(steps.size(), 10u);
  EXPECT_EQ(steps.front(), 490);
  EXPECT_EQ(steps.back(), 499);
}

TEST(CoordinatorStore, OpeningErrorsNameTheFile) {
  TempDir dir;
  coordinator::StoreOptions opt;
  opt.path = dir.File("missing-dir/x.db");
  auto s = coordinator::Store::Open(opt);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find(opt.path), std::string::npos) << s.status().message();
  opt.path = dir.File("not-a-db");
  {
    std::ofstream f(opt.path);
    f << std::string(8192, 'x');
  }
  s = coordinator::Store::Open(opt);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find(opt.path), std::string::npos) << s.status().message();
  // One coordinator per database.
  opt.path = dir.File("shared.db");
  auto first = coordinator::Store::Open(opt);
  ASSERT_TRUE(first.ok()) << first.status().message();
  s = coordinator::Store::Open(opt);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("in use by another cpd-coordinator"), std::string::npos)
      << s.status().message();
  first = Status::Unavailable("closed");
  s = coordinator::Store::Open(opt);
  EXPECT_TRUE(s.ok()) << s.status().message();
}

}  // namespace
}  // namespace cpd::test
