// The worker's CoordinatorClient against the real cpd-coordinator (a subprocess on a loopback
// port, its SQLite file in a temporary directory): registration, reports, the bounded queue and
// its drop count, schedules pushed while connected, a coordinator that appears late, and a
// Finish() that never hangs when the coordinator is away. The operator's view is read through
// the real OperatorService.
#include "runtime/control/coordinator_client.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "proto/cpd/v1/coordinator.grpc.pb.h"
#include "tests/temp_dir.h"

namespace cpd::runtime {
namespace {

namespace v1 = ::cpd::v1;
using Clock = std::chrono::steady_clock;

// Polls `done` every 20 ms for at most `seconds`.
bool WaitFor(const std::function<bool()>& done, double seconds) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  while (Clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return done();
}

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

// cpd-coordinator as a child process on 127.0.0.1:port.
class Coordinator {
 public:
  Coordinator(int port, const std::string& dir, std::vector<std::string> extra = {}) {
    const std::string listen = "127.0.0.1:" + std::to_string(port);
    const std::string db = dir + "/coordinator.db", port_file = dir + "/port";
    std::filesystem::remove(port_file);
    pid_ = fork();
    if (pid_ == 0) {
      const std::string log = dir + "/coordinator.log";
      freopen(log.c_str(), "a", stdout);
      freopen(log.c_str(), "a", stderr);
      std::vector<std::string> args = {CPD_COORDINATOR_PATH, "--listen", listen, "--db", db,
                                       "--port-file",        port_file};
      args.insert(args.end(), extra.begin(), extra.end());
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(CPD_COORDINATOR_PATH, argv.data());
      _exit(127);
    }
    ready_ = WaitFor([&] { return std::filesystem::exists(port_file); }, 30);
  }
  ~Coordinator() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      waitpid(pid_, nullptr, 0);
    }
  }
  bool ready() const { return ready_; }

 private:
  pid_t pid_ = -1;
  bool ready_ = false;
};

class CoordinatorClientTest : public ::testing::Test {
 protected:
  CoordinatorClientTest() {
    port_ = FreePort();
    address_ = "127.0.0.1:" + std::to_string(port_);
    ops_ = v1::OperatorService::NewStub(
        grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  }

  CoordinatorOptions Options(const std::string& job) const {
    CoordinatorOptions o;
    o.address = address_;
    o.job_name = job;
    o.rpc_timeout_ms = 2000;
    o.backoff_max_ms = 300;
    return o;
  }

  static JobDescription Job() {
    JobDescription j;
    j.arch = "mlp";
    j.dataset = "synthetic";
    j.allreduce = "fp32";
    j.world_size = 2;
    j.epochs = 1;
    j.total_steps = 100;
    j.workers = {{0, "host0", 11}, {1, "host1", 12}};
    j.layers = {{"fc1", "Linear", true, 200960}, {"fc2", "Linear", true, 2570}};
    j.schedule.precision.global[int(Site::kWeight)].spec = "e4m3";
    j.schedule.set_by = "command line";
    return j;
  }

  static StepReport Report(int64_t step, bool with_layers) {
    StepReport r;
    r.step = step;
    r.epoch = 1;
    r.loss = 2.0 / double(step + 1);
    r.ranks_alive = 2;
    if (with_layers) {
      LayerReport l;
      l.layer = "fc1";
      l.site = "W";
      l.format = "e4m3";
      l.bits = 8;
      l.max_abs = 0.25;
      l.saturated = 0.001;
      l.rel_error = 0.03;
      r.layers.push_back(l);
      l.site = "comm";
      l.aps_shift = 9;
      r.layers.push_back(l);
    }
    return r;
  }

  // The coordinator's view of the job.
  bool Status(const std::string& job, v1::JobStatusResponse* out) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::JobRef ref;
    ref.set_job_name(job);
    return ops_->JobStatus(&ctx, ref, out).ok();
  }

  cpd::test::TempDir temp_{"cpd_coord_client_test"};
  const std::string dir_ = temp_.path();
  std::string address_;
  int port_ = 0;
  std::unique_ptr<v1::OperatorService::Stub> ops_;
};

TEST_F(CoordinatorClientTest, RegistersReportsAndTakesPushedSchedules) {
  Coordinator coordinator(port_, dir_);
  ASSERT_TRUE(coordinator.ready());
  auto client = CoordinatorClient::Start(Options("client-a"), Job());
  ASSERT_TRUE(client.ok()) << client.status().message();
  CoordinatorClient& c = **client;
  ASSERT_TRUE(WaitFor([&] { return c.job_id() > 0; }, 20)) << "never registered";
  EXPECT_TRUE(c.Report(Report(0, true)));
  // The end of a language model's epoch: its validation loss, perplexity and bits per byte.
  StepReport epoch_end = Report(1, false);
  epoch_end.test_accuracy = 0.125;
  epoch_end.test_loss = 1.75;
  epoch_end.test_perplexity = 5.75;
  epoch_end.test_bits_per_byte = 2.5;
  EXPECT_TRUE(c.Report(epoch_end));
  ASSERT_TRUE(WaitFor([&] { return c.sent() == 2; }, 20));

  v1::JobStatusResponse st;
  ASSERT_TRUE(WaitFor([&] { return Status("client-a", &st) && st.reports_stored() == 2; }, 20));
  EXPECT_EQ(st.job().world_size(), 2);
  EXPECT_EQ(st.workers_size(), 2);
  EXPECT_EQ(st.layers_size(), 2);
  EXPECT_EQ(st.schedule().version(), 1u);
  ASSERT_EQ(st.schedule().formats_size(), 1);
  EXPECT_EQ(st.schedule().formats(0).spec(), "e4m3");  // the command line's schedule
  EXPECT_EQ(st.test_accuracy(), 0.125);
  EXPECT_EQ(st.test_loss(), 1.75);
  EXPECT_EQ(st.test_perplexity(), 5.75);
  EXPECT_EQ(st.test_bits_per_byte(), 2.5);
  EXPECT_EQ(st.train_accuracy(), -1);  // not measured: StepReport's default

  // The latest layer rows, as sent.
  grpc::ClientContext ctx;
  v1::LayerStatsRequest lreq;
  lreq.mutable_job()->set_job_name("client-a");
  lreq.set_latest(true);
  v1::LayerStatsResponse lresp;
  ASSERT_TRUE(ops_->LayerStats(&ctx, lreq, &lresp).ok());
  ASSERT_EQ(lresp.reports_size(), 1);
  ASSERT_EQ(lresp.reports(0).layers_size(), 2);
  EXPECT_EQ(lresp.reports(0).layers(0).site(), v1::SITE_W);
  EXPECT_EQ(lresp.reports(0).layers(1).site(), v1::SITE_COMM);
  EXPECT_EQ(lresp.reports(0).layers(1).aps_shift(), 9);
  EXPECT_DOUBLE_EQ(lresp.reports(0).layers(0).rel_error(), 0.03);

  // An operator sets a CPT schedule with an override: the client hands it over.
  grpc::ClientContext sctx;
  v1::SetScheduleRequest sreq;
  sreq.mutable_job()->set_job_name("client-a");
  v1::PrecisionSchedule* s = sreq.mutable_schedule();
  s->set_effective_from_step(40);
  s->mutable_cyclic()->set_min_bits(3);
  s->mutable_cyclic()->set_max_bits(8);
  s->mutable_cyclic()->set_periods(8);
  s->set_grad_bits(6);
  v1::LayerOverride* ov = s->add_overrides();
  ov->set_layer("fc2");
  ov->set_site(v1::SITE_E);
  ov->set_spec("fp16");
  s->add_keep_fp32("last");
  sreq.set_expected_version(1);
  v1::SetScheduleResponse sresp;
  ASSERT_TRUE(ops_->SetSchedule(&sctx, sreq, &sresp).ok());
  std::optional<ScheduleUpdate> got;
  ASSERT_TRUE(WaitFor([&] { return (got = c.TakeSchedule()).has_value(); }, 20));
  EXPECT_EQ(got->version, 2u);
  EXPECT_EQ(got->effective_from_step, 40);
  ASSERT_TRUE(got->precision.cpt.has_value());
  EXPECT_EQ(got->precision.cpt->min_bits, 3);
  EXPECT_EQ(got->precision.cpt->max_bits, 8);
  EXPECT_EQ(got->precision.cpt->periods, 8);
  EXPECT_EQ(got->precision.grad_bits, 6);
  EXPECT_EQ(got->precision.overrides.at("fc2").at(Site::kError), "fp16");
  EXPECT_EQ(got->precision.keep_fp32, std::vector<std::string>{"last"});
  EXPECT_EQ(got->precision.global[int(Site::kWeight)].spec, "fp32");
  EXPECT_FALSE(c.TakeSchedule().has_value());  // handed over once
  c.Finish(5000);
}

// The study travels with the registration; a resumed run under another study is refused with
// the coordinator's reason (and keeps training: the client only retries).
TEST_F(CoordinatorClientTest, RegistersTheStudyAndSaysWhenAnotherIsRefused) {
  Coordinator coordinator(port_, dir_);
  ASSERT_TRUE(coordinator.ready());
  CoordinatorOptions o = Options("sweep.run-1");
  o.study = "sweep";
  auto first = CoordinatorClient::Start(o, Job());
  ASSERT_TRUE(first.ok()) << first.status().message();
  ASSERT_TRUE(WaitFor([&] { return (*first)->job_id() > 0; }, 20)) << "never registered";
  (*first)->Finish(2000);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::ListJobsRequest req;
  req.set_study("sweep");
  v1::ListJobsResponse jobs;
  ASSERT_TRUE(ops_->ListJobs(&ctx, req, &jobs).ok());
  ASSERT_EQ(jobs.jobs_size(), 1);
  EXPECT_EQ(jobs.jobs(0).job_name(), "sweep.run-1");
  EXPECT_EQ(jobs.jobs(0).study(), "sweep");

  o.study = "other";
  auto moved = CoordinatorClient::Start(o, Job());
  ASSERT_TRUE(moved.ok()) << moved.status().message();
  std::string said;
  ASSERT_TRUE(WaitFor(
      [&] {
        for (const auto& e : (*moved)->TakeEvents()) said += e + "\n";
        return said.find("refused the registration") != std::string::npos;
      },
      20))
      << said;
  EXPECT_NE(said.find("study: job 1 ('sweep.run-1') belongs to study 'sweep'"), std::string::npos)
      << said;
  EXPECT_EQ((*moved)->job_id(), 0);
  (*moved)->Finish(0);
}

TEST_F(CoordinatorClientTest, ALateCoordinatorGetsTheQueueAndTheDropCount) {
  CoordinatorOptions o = Options("client-late");
  o.queue_capacity = 3;
  auto client = CoordinatorClient::Start(o, Job());
  ASSERT_TRUE(client.ok());
  CoordinatorClient& c = **client;
  // Nobody listens yet: the queue holds 3 reports and drops the rest, counting them.
  int accepted = 0;
  for (int64_t step = 0; step < 8; ++step) accepted += c.Report(Report(step, step % 2 == 0));
  EXPECT_EQ(accepted, 3);
  EXPECT_EQ(c.dropped(), 5u);
  ASSERT_TRUE(WaitFor(
      [&] {
        for (const std::string& e : c.TakeEvents()) {
          if (e.find("unreachable") != std::string::npos) return true;
        }
        return false;
      },
      20))
      << "no 'unreachable' event";
  EXPECT_EQ(c.job_id(), 0);

  // The coordinator comes up: the client registers and delivers the three queued reports, each
  // telling the coordinator how many were dropped.
  Coordinator coordinator(port_, dir_);
  ASSERT_TRUE(coordinator.ready());
  ASSERT_TRUE(WaitFor([&] { return c.sent() == 3; }, 30)) << "sent " << c.sent();
  v1::JobStatusResponse st;
  ASSERT_TRUE(WaitFor([&] { return Status("client-late", &st) && st.reports_stored() == 3; }, 20));
  EXPECT_EQ(st.dropped_reports(), 5u);
  EXPECT_EQ(st.job().step(), 2);
  c.Finish(5000);
}

// A report carries the time it was made, not the time it was sent: reports queued while the
// coordinator is away arrive with the times they were made at (they used to all carry the few
// milliseconds in which the queue drained).
TEST_F(CoordinatorClientTest, ReportsQueuedThroughAnOutageKeepTheTimeTheyWereMade) {
  auto client = CoordinatorClient::Start(Options("client-times"), Job());
  ASSERT_TRUE(client.ok());
  CoordinatorClient& c = **client;
  ASSERT_TRUE(c.Report(Report(0, false)));
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  ASSERT_TRUE(c.Report(Report(1, false)));
  StepReport stamped = Report(2, false);
  stamped.time_ms = 1234567;  // made earlier by the caller: kept as it is
  ASSERT_TRUE(c.Report(stamped));
  std::this_thread::sleep_for(std::chrono::milliseconds(400));

  Coordinator coordinator(port_, dir_);
  ASSERT_TRUE(coordinator.ready());
  ASSERT_TRUE(WaitFor([&] { return c.sent() == 3; }, 30)) << "sent " << c.sent();
  c.Finish(5000);
  v1::JobStatusResponse st;
  ASSERT_TRUE(WaitFor([&] { return Status("client-times", &st) && st.reports_stored() == 3; }, 20));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::JobHistoryRequest req;
  req.mutable_job()->set_job_name("client-times");
  auto reader = ops_->JobHistory(&ctx, req);
  std::vector<int64_t> times;
  v1::StatsReport r;
  while (reader->Read(&r)) times.push_back(r.time_ms());
  ASSERT_TRUE(reader->Finish().ok());
  ASSERT_EQ(times.size(), 3u);
  EXPECT_GE(times[1] - times[0], 550) << "the second report was made 600 ms after the first";
  EXPECT_EQ(times[2], 1234567);
}

TEST_F(CoordinatorClientTest, FinishIsBoundedWhenTheCoordinatorIsAway) {
  auto client = CoordinatorClient::Start(Options("client-away"), Job());
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->Report(Report(0, false)));
  const auto t0 = Clock::now();
  (*client)->Finish(700);
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_LT(s, 0.7 + 2.0 + 1.0) << "Finish took " << s << " s";  // wait + one rpc deadline
  EXPECT_EQ((*client)->sent(), 0u);
  EXPECT_FALSE((*client)->Report(Report(1, false)));  // after Finish: dropped
}

TEST_F(CoordinatorClientTest, TalksTlsWithTheGivenRootAndItsToken) {
  // A self-signed certificate for 127.0.0.1, made by the openssl command-line tool.
  const std::string cert = dir_ + "/cert.pem", key = dir_ + "/key.pem", token = dir_ + "/token";
  const std::string cmd =
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost"
      " -addext subjectAltName=IP:127.0.0.1 -keyout " +
      key + " -out " + cert + " >/dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ofstream(token) << "tls-secret\n";
  Coordinator coordinator(port_, dir_,
                          {"--tls-cert", cert, "--tls-key", key, "--token-file", token});
  ASSERT_TRUE(coordinator.ready());
  std::ifstream in(cert);
  const std::string pem((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());

  CoordinatorOptions o = Options("client-tls");
  o.tls_ca_pem = pem;
  o.token = "tls-secret";
  auto client = CoordinatorClient::Start(o, Job());
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE(WaitFor([&] { return (*client)->job_id() > 0; }, 20)) << "no TLS registration";
  EXPECT_TRUE((*client)->Report(Report(0, true)));
  ASSERT_TRUE(WaitFor([&] { return (*client)->sent() == 1; }, 20));
  (*client)->Finish(2000);

  // Plaintext to a TLS coordinator, or TLS with a wrong token: never registers, says why.
  CoordinatorOptions plain = Options("client-plain");
  plain.token = "tls-secret";
  CoordinatorOptions wrong = Options("client-wrong-token");
  wrong.tls_ca_pem = pem;
  wrong.token = "guess";
  for (const CoordinatorOptions& bad : {plain, wrong}) {
    auto c = CoordinatorClient::Start(bad, Job());
    ASSERT_TRUE(c.ok());
    std::string said;
    ASSERT_TRUE(WaitFor(
        [&] {
          for (const std::string& e : (*c)->TakeEvents()) said += e;
          return !said.empty();
        },
        20));
    EXPECT_EQ((*c)->job_id(), 0) << bad.job_name;
    if (!bad.token.empty() && !bad.tls_ca_pem.empty()) {
      EXPECT_NE(said.find("refused the token"), std::string::npos) << said;
    } else {
      EXPECT_NE(said.find("unreachable"), std::string::npos) << said;
    }
    (*c)->Finish(0);
  }
}

TEST(CoordinatorOptions, BadOptionsAreRefusedByName) {
  CoordinatorOptions o;
  o.job_name = "job";
  EXPECT_NE(CheckCoordinatorOptions(o).message().find("--coordinator"), std::string::npos);
  o.address = "127.0.0.1:1";
  for (const char* bad : {"", "has space", "slash/name", "ünï"}) {
    o.job_name = bad;
    const Status s = CheckCoordinatorOptions(o);
    EXPECT_EQ(s.code(), Status::Code::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("--job-name"), std::string::npos) << s.message();
  }
  o.job_name = std::string(129, 'a');
  EXPECT_FALSE(CheckCoordinatorOptions(o).ok());
  o.job_name = std::string(128, 'a');
  EXPECT_TRUE(CheckCoordinatorOptions(o).ok());
  for (const std::string& bad : {std::string("has space"), std::string(65, 's')}) {
    o.study = bad;
    const Status s = CheckCoordinatorOptions(o);
    EXPECT_EQ(s.code(), Status::Code::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("--study"), std::string::npos) << s.message();
  }
  o.study = "S-1.b_" + std::string(58, 'x');
  EXPECT_TRUE(CheckCoordinatorOptions(o).ok());
}

}  // namespace
}  // namespace cpd::runtime
