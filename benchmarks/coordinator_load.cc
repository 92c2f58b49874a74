// cpd-coordinator-load: W simulated workers (J jobs x R ranks) each calling ReportStats with L
// layer rows at H Hz for S seconds against one cpd-coordinator, with gRPC's callback client API
// on a few threads (not one thread per worker).
//
// Two rows in one run: a baseline with 0 layer rows (the bare RPC cost) and the L-row load. Each
// row gets a fresh coordinator subprocess on a temporary database (unless --coordinator names
// a running one), so its peak RSS (VmHWM) and CPU time belong to that row. "stored" is read back
// from the coordinator (the sum of JobStatus.reports_stored) after its queue has drained: it
// must equal the reports it acknowledged.
//
//   build/bin/cpd-coordinator-load                        # 512 = 64 x 8 workers, 100 layers, 10
//   Hz, 30 s build/bin/cpd-coordinator-load --seconds 5 --jobs 16 --workers 128
#include <fcntl.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "benchmarks/bench_util.h"
#include "cpd/config.h"
#include "launcher/cli.h"
#include "proto/cpd/v1/coordinator.grpc.pb.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr const char* kTool = "cpd-coordinator-load";

[[noreturn]] void Fail(const std::string& msg, int code = 1) {
  cpd::launcher::FailWith(kTool, msg, code);
}

struct Options {
  int workers = 512;
  int jobs = 64;
  int layers = 100;
  double hz = 10;
  double seconds = 30;
  double warmup = 2;
  int threads = 1;
  int channels = 0;  // 0: one per job
  std::string coordinator;
  std::string coordinator_bin;
  std::string coordinator_args;  // extra flags for the started coordinator, space-separated
  std::string token_file;
  std::string token;
  bool baseline = true;
  int deadline_ms = 10000;
};

// ---- The coordinator under test
// ------------------------------------------------------------------

class Spawned {
 public:
  Spawned(const std::string& bin, const std::string& extra, const std::string& dir) : dir_(dir) {
    const std::string port_file = dir + "/port";
    std::vector<std::string> args = {bin,  "--listen",    "127.0.0.1:0", "--db",
                                     db(), "--port-file", port_file};
    std::istringstream more(extra);
    for (std::string a; more >> a;) args.push_back(a);
    pid_ = fork();
    if (pid_ == 0) {
      const int null = open("/dev/null", O_WRONLY);
      const int err = open((dir + "/stderr").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      dup2(null, 1);
      dup2(err, 2);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      std::fprintf(stderr, "%s: cannot run %s: %s\n", kTool, bin.c_str(), std::strerror(errno));
      _exit(127);
    }
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    while (Clock::now() < deadline) {
      std::ifstream in(port_file);
      if (in >> port_ && port_ > 0) return;
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        Fail("the coordinator (" + bin + ") exited before listening");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    Fail("the coordinator did not write its port file within 30 s");
  }
  ~Spawned() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  // SIGTERM and wait: true when it exited 0 (every acknowledged report stored).
  bool Stop() {
    kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  pid_t pid() const { return pid_; }
  std::string db() const { return dir_ + "/load.db"; }

 private:
  std::string dir_;
  pid_t pid_ = -1;
  int port_ = 0;
};

// kB value of a "Key:   N kB" line of /proc/PID/status (-1 when unavailable).
double ProcStatusMiB(pid_t pid, const char* key) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::stod(line.substr(std::strlen(key))) / 1024.0;
  }
  return -1;
}

// utime + stime of a process, seconds.
double ProcCpuSeconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = s.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream rest(s.substr(close + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::stod(field);
  }
  return ticks / double(sysconf(_SC_CLK_TCK));
}

double SelfCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

std::string LoadAvg() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return a + " " + b + " " + c;
}

double DirMiB(const std::string& dir) {
  double bytes = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (e.is_regular_file(ec)) bytes += double(e.file_size(ec));
  }
  return bytes / (1024.0 * 1024.0);
}

// ---- One row
// -------------------------------------------------------------------------------------

struct Row {
  std::string name;
  int layers = 0;
  uint64_t sent = 0, ok = 0, stored = 0, errors = 0;
  double p50 = 0, p99 = 0, max = 0;
  double rss_peak = -1, cpu = -1, db_mib = -1;
  uint64_t late = 0;
  double max_lag_ms = 0, driver_cpu = 0;
  std::string first_error;
  bool clean_exit = true;
};

struct Call {
  grpc::ClientContext ctx;
  grpc::ByteBuffer req, resp;
  Clock::time_point start;
  size_t index = 0;
};

// The wire bytes of one report: the worker's fixed part (serialized once, shared, not copied)
// followed by this call's step and time_ms. Protobuf parses concatenated encodings as one
// message, so the coordinator receives exactly the StatsReport it would from a real client,
// while the driver, which shares the machine with it, spends no CPU re-serializing 100 rows.
grpc::ByteBuffer ReportBytes(const std::string& fixed, int64_t step, int64_t time_ms) {
  cpd::v1::StatsReport tail;
  tail.set_step(step);
  tail.set_time_ms(time_ms);
  grpc::Slice slices[2] = {grpc::Slice(fixed.data(), fixed.size(), grpc::Slice::STATIC_SLICE),
                           grpc::Slice(tail.SerializeAsString())};
  return grpc::ByteBuffer(slices, 2);
}

double Percentile(std::vector<float>& v, double p) {
  if (v.empty()) return 0;
  const size_t k = std::min(v.size() - 1, size_t(p * double(v.size() - 1) + 0.5));
  std::nth_element(v.begin(), v.begin() + long(k), v.end());
  return v[k];
}

// The driver's gRPC connections to the coordinator: nchan channels, jobs spread over them.
struct Clients {
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<cpd::v1::WorkerService::Stub>> stubs;
  std::vector<std::unique_ptr<grpc::GenericStub>> generic;
};

Clients Connect(const std::string& address, int nchan) {
  Clients c;
  for (int i = 0; i < nchan; ++i) {
    grpc::ChannelArguments args;
    // Each channel its own connection, like separate jobs' workers.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("cpd.load.channel", i);
    c.channels.push_back(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
    c.stubs.push_back(cpd::v1::WorkerService::NewStub(c.channels.back()));
    c.generic.push_back(std::make_unique<grpc::GenericStub>(c.channels.back()));
  }
  return c;
}

// A context for one blocking call: its deadline and the token.
std::unique_ptr<grpc::ClientContext> CallContext(const Options& o, int ms) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(ms));
  if (!o.token.empty()) ctx->AddMetadata("authorization", "Bearer " + o.token);
  return ctx;
}

// Registers o.jobs jobs of `layers` layers, named after the row and this process; their ids.
std::vector<int64_t> RegisterJobs(const Options& o, const std::string& name, int layers,
                                  const Clients& clients) {
  const int ranks = o.workers / o.jobs;
  const size_t nchan = clients.stubs.size();
  std::vector<int64_t> job_ids(size_t(o.jobs));
  const std::string prefix = "load-" + name + "-" + std::to_string(getpid()) + "-";
  for (int j = 0; j < o.jobs; ++j) {
    cpd::v1::RegisterJobRequest req;
    req.set_job_name(prefix + std::to_string(j));
    req.set_world_size(ranks);
    for (int l = 0; l < layers; ++l) {
      auto* li = req.add_layers();
      li->set_name("layer" + std::to_string(l));
      li->set_kind(l % 3 == 0 ? "Conv2d" : "Linear");
      li->set_quantizable(true);
      li->set_params(1000 + l);
    }
    auto* f = req.mutable_schedule()->add_formats();
    f->set_site(cpd::v1::SITE_W);
    f->set_spec("e4m3");
    cpd::v1::RegisterJobResponse resp;
    grpc::Status s =
        clients.stubs[size_t(j) % nchan]->RegisterJob(CallContext(o, 30000).get(), req, &resp);
    if (!s.ok()) Fail("RegisterJob: " + s.error_message());
    job_ids[size_t(j)] = resp.job_id();
  }
  return job_ids;
}

// The report of worker `w` without step and time_ms: its job, rank and `layers` layer rows.
cpd::v1::StatsReport FixedReport(const std::vector<int64_t>& job_ids, int ranks, int w,
                                 int layers) {
  cpd::v1::StatsReport r;
  r.set_job_id(job_ids[size_t(w / ranks)]);
  r.set_rank(w % ranks);
  r.set_epoch(1);
  r.set_loss(0.5);
  r.set_lr(0.05);
  r.set_bits(6);
  r.set_schedule_version(1);
  r.set_images_per_s(5000);
  r.set_ranks_alive(ranks);
  r.set_train_accuracy(-1);
  r.set_test_accuracy(-1);
  for (int l = 0; l < layers; ++l) {
    auto* s = r.add_layers();
    s->set_layer("layer" + std::to_string(l));
    s->set_site(cpd::v1::Site(1 + l % 4));
    s->set_format("e4m3");
    s->set_bits(8);
    s->set_aps_shift(l % 5);
    s->set_max_abs(0.25 * (1 + l));
    s->set_saturated(1e-4 * l);
    s->set_flushed(1e-3);
    s->set_rel_error(0.031 + 1e-4 * l);
    s->set_flips(uint64_t(l));
  }
  return r;
}

// Fails unless ReportBytes of `fixed` (r serialized) parses as r with a step and time_ms: the
// concatenation is the message a client would send.
void CheckReportBytes(cpd::v1::StatsReport r, const std::string& fixed) {
  r.set_step(7);
  r.set_time_ms(8);
  std::vector<grpc::Slice> sl;
  if (!ReportBytes(fixed, 7, 8).Dump(&sl).ok()) Fail("ByteBuffer::Dump");
  std::string bytes;
  for (const auto& x : sl) bytes.append(reinterpret_cast<const char*>(x.begin()), x.size());
  cpd::v1::StatsReport back;
  if (!back.ParseFromString(bytes) || back.SerializeAsString() != r.SerializeAsString()) {
    Fail("the pre-serialized report does not parse back to the intended message");
  }
}

// Every worker's serialized fixed report (ReportBytes appends each call's step and time).
std::vector<std::string> FixedReports(const Options& o, const std::vector<int64_t>& job_ids,
                                      int layers) {
  const int ranks = o.workers / o.jobs;
  std::vector<std::string> fixed(size_t(o.workers));
  for (int w = 0; w < o.workers; ++w) {
    const cpd::v1::StatsReport r = FixedReport(job_ids, ranks, w, layers);
    fixed[size_t(w)] = r.SerializeAsString();
    if (w == 0) CheckReportBytes(r, fixed[0]);
  }
  return fixed;
}

// The load's schedule: event n goes to worker n % W at t0 + n / (W * hz), every worker at hz,
// evenly staggered; the first `warm` events are the warm-up.
struct Schedule {
  uint64_t per_second = 0, warm = 0, total = 0;
};

Schedule MakeSchedule(const Options& o) {
  Schedule s;
  s.per_second = uint64_t(std::llround(double(o.workers) * o.hz));
  s.warm = uint64_t(std::llround(o.warmup * double(s.per_second)));
  s.total = s.warm + uint64_t(std::llround(o.seconds * double(s.per_second)));
  return s;
}

// What the senders and the calls' callbacks record, shared by them.
struct LoadCounters {
  explicit LoadCounters(uint64_t total) : latency(total, -1.0f) {}
  std::vector<float> latency;  // ms per event, -1 where the call failed
  std::atomic<uint64_t> ok{0}, errors{0}, completed{0};
  std::mutex err_mu;
  std::string first_error;
  std::mutex done_mu;
  std::condition_variable done_cv;
  std::atomic<uint64_t> late{0};  // sends more than 5 ms after their time
  std::atomic<int64_t> max_lag_us{0};
};

// Sender `tid` of o.threads: sleeps until each of its events' time and starts its call.
void SendEvents(const Options& o, const Schedule& sched, const std::vector<std::string>& fixed,
                const Clients& clients, Clock::time_point t0, int tid, LoadCounters* c) {
  const int ranks = o.workers / o.jobs;
  const size_t nchan = clients.generic.size();
  const uint64_t total = sched.total;
  for (uint64_t n = uint64_t(tid); n < total; n += uint64_t(o.threads)) {
    const auto when =
        t0 + std::chrono::nanoseconds(int64_t(1e9 * double(n) / double(sched.per_second)));
    std::this_thread::sleep_until(when);
    const int64_t lag =
        std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - when).count();
    if (lag > 5000) c->late.fetch_add(1);
    int64_t prev = c->max_lag_us.load();
    while (lag > prev && !c->max_lag_us.compare_exchange_weak(prev, lag)) {
    }
    const size_t w = size_t(n % uint64_t(o.workers));
    auto* call = new Call;
    call->req = ReportBytes(fixed[w], int64_t(n / uint64_t(o.workers)), int64_t(n));
    call->index = size_t(n);
    call->ctx.set_deadline(std::chrono::system_clock::now() +
                           std::chrono::milliseconds(o.deadline_ms));
    if (!o.token.empty()) call->ctx.AddMetadata("authorization", "Bearer " + o.token);
    call->start = Clock::now();
    const size_t job = w / size_t(ranks);
    clients.generic[job % nchan]->UnaryCall(
        &call->ctx, "/cpd.v1.WorkerService/ReportStats", grpc::StubOptions(), &call->req,
        &call->resp, [c, call, total](grpc::Status s) {
          const auto end = Clock::now();
          if (s.ok()) {
            c->latency[call->index] =
                float(std::chrono::duration<double, std::milli>(end - call->start).count());
            c->ok.fetch_add(1);
          } else {
            c->errors.fetch_add(1);
            std::lock_guard<std::mutex> l(c->err_mu);
            if (c->first_error.empty()) {
              c->first_error = std::to_string(int(s.error_code())) + " " + s.error_message();
            }
          }
          delete call;
          if (c->completed.fetch_add(1) + 1 == total) {
            std::lock_guard<std::mutex> l(c->done_mu);
            c->done_cv.notify_all();
          }
        });
  }
}

// Runs the senders from t0 on and waits for every call's answer (or fails).
void RunLoad(const Options& o, const Schedule& sched, const std::vector<std::string>& fixed,
             const Clients& clients, Clock::time_point t0, LoadCounters* c) {
  std::vector<std::thread> threads;
  for (int t = 0; t < o.threads; ++t) {
    threads.emplace_back([&, t] { SendEvents(o, sched, fixed, clients, t0, t, c); });
  }
  for (auto& t : threads) t.join();
  {
    std::unique_lock<std::mutex> l(c->done_mu);
    c->done_cv.wait_for(l, std::chrono::milliseconds(o.deadline_ms + 30000),
                        [&] { return c->completed.load() == sched.total; });
  }
  if (c->completed.load() != sched.total) Fail("calls did not complete within their deadline");
}

// The reports the coordinator has stored for the jobs, polled until it reaches `acknowledged` or
// stops moving for 5 s (2 minutes at most).
uint64_t PollStored(const Options& o, const Clients& clients, const std::vector<int64_t>& job_ids,
                    uint64_t acknowledged) {
  auto op = cpd::v1::OperatorService::NewStub(clients.channels[0]);
  uint64_t stored = 0, last = UINT64_MAX;
  auto still = Clock::now();
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  while (Clock::now() < deadline) {
    stored = 0;
    for (int64_t id : job_ids) {
      cpd::v1::JobRef ref;
      ref.set_job_id(id);
      cpd::v1::JobStatusResponse st;
      grpc::Status s = op->JobStatus(CallContext(o, 30000).get(), ref, &st);
      if (!s.ok()) Fail("JobStatus: " + s.error_message());
      stored += st.reports_stored();
    }
    if (stored == acknowledged) break;
    if (stored != last) {
      last = stored;
      still = Clock::now();
    } else if (Clock::now() - still > std::chrono::seconds(5)) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return stored;
}

// The latencies of the measured (not warm-up) calls that succeeded: max, p50, p99.
void SetLatencies(const std::vector<float>& latency, uint64_t warm, Row* row) {
  std::vector<float> measured;
  measured.reserve(latency.size());
  for (uint64_t n = warm; n < latency.size(); ++n) {
    if (latency[n] >= 0) measured.push_back(latency[n]);
  }
  if (!measured.empty()) {
    row->max = *std::max_element(measured.begin(), measured.end());
    row->p50 = Percentile(measured, 0.50);
    row->p99 = Percentile(measured, 0.99);
  }
}

// One row: registers the jobs, sends the load, reads back what was stored and, where this
// program started the coordinator (pid > 0), its CPU time, peak RSS and database size.
Row RunRow(const Options& o, const std::string& name, int layers, const std::string& address,
           pid_t pid, const std::string& dir) {
  Row row;
  row.name = name;
  row.layers = layers;
  const Clients clients = Connect(address, o.channels > 0 ? o.channels : o.jobs);
  const std::vector<int64_t> job_ids = RegisterJobs(o, name, layers, clients);
  const std::vector<std::string> fixed = FixedReports(o, job_ids, layers);
  const Schedule sched = MakeSchedule(o);
  LoadCounters counters(sched.total);

  const double cpu0 = pid > 0 ? ProcCpuSeconds(pid) : -1;
  const double self0 = SelfCpuSeconds();
  RunLoad(o, sched, fixed, clients, Clock::now() + std::chrono::milliseconds(100), &counters);
  row.driver_cpu = SelfCpuSeconds() - self0;
  row.late = counters.late.load();
  row.max_lag_ms = double(counters.max_lag_us.load()) / 1000.0;
  row.sent = sched.total;
  row.ok = counters.ok.load();
  row.errors = counters.errors.load();
  row.first_error = counters.first_error;

  row.stored = PollStored(o, clients, job_ids, row.ok);
  if (pid > 0) {
    row.cpu = ProcCpuSeconds(pid) - cpu0;
    row.rss_peak = ProcStatusMiB(pid, "VmHWM:");
    row.db_mib = DirMiB(dir);
  }
  SetLatencies(counters.latency, sched.warm, &row);
  return row;
}

// A row against a coordinator of its own, started on a temporary database and stopped after
// the row (its stderr shown when it did not exit cleanly).
Row RunRowOnOwnCoordinator(const Options& o, const std::string& name, int layers) {
  char tmpl[] = "/tmp/cpd_coord_load_XXXXXX";
  const char* dir = mkdtemp(tmpl);
  if (dir == nullptr) Fail(std::string("mkdtemp: ") + std::strerror(errno));
  Row r;
  {
    Spawned c(o.coordinator_bin, o.coordinator_args, dir);
    r = RunRow(o, name, layers, c.address(), c.pid(), dir);
    r.clean_exit = c.Stop();
  }
  if (!r.clean_exit) {
    std::ifstream in(std::string(dir) + "/stderr");
    std::fprintf(stderr, "%s: the coordinator's stderr:\n%s\n", kTool,
                 std::string(std::istreambuf_iterator<char>(in), {}).c_str());
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return r;
}

// The table and a note per row; false when a row lost reports, saw errors or its coordinator
// did not exit cleanly.
bool PrintRows(const Options& o, const std::vector<Row>& rows) {
  const double base_p99 = o.baseline ? rows.front().p99 : 0;
  std::printf("%-9s %7s %6s %7s %5s %9s %9s %9s %7s %7s %7s %8s %7s %7s %8s\n", "row", "workers",
              "layers", "rate/s", "secs", "sent", "ok", "stored", "p50_ms", "p99_ms", "max_ms",
              "rss_MiB", "cpu_s", "db_MiB", "p99/base");
  for (const Row& r : rows) {
    char ratio[32] = "-";
    if (base_p99 > 0) std::snprintf(ratio, sizeof(ratio), "%.2f", r.p99 / base_p99);
    auto num = [](double v, const char* fmt) {
      char b[32];
      if (v < 0) return std::string("-");
      std::snprintf(b, sizeof(b), fmt, v);
      return std::string(b);
    };
    std::printf("%-9s %7d %6d %7.0f %5.0f %9llu %9llu %9llu %7.2f %7.2f %7.1f %8s %7s %7s %8s\n",
                r.name.c_str(), o.workers, r.layers, double(o.workers) * o.hz, o.seconds,
                static_cast<unsigned long long>(r.sent), static_cast<unsigned long long>(r.ok),
                static_cast<unsigned long long>(r.stored), r.p50, r.p99, r.max,
                num(r.rss_peak, "%.1f").c_str(), num(r.cpu, "%.1f").c_str(),
                num(r.db_mib, "%.0f").c_str(), ratio);
  }
  bool good = true;
  for (const Row& r : rows) {
    std::printf("# %s: driver CPU %.1f s, %llu sends > 5 ms late (max lag %.1f ms)%s%s%s\n",
                r.name.c_str(), r.driver_cpu, static_cast<unsigned long long>(r.late), r.max_lag_ms,
                r.errors > 0 ? ", first error: " : "", r.first_error.c_str(),
                r.clean_exit ? "" : "; the coordinator did NOT exit cleanly");
    if (r.stored != r.ok && !o.coordinator_args.empty()) {
      std::printf(
          "# %s: %llu acknowledged, %llu stored: --coordinator-args may set retention, "
          "which deletes reports by design\n",
          r.name.c_str(), static_cast<unsigned long long>(r.ok),
          static_cast<unsigned long long>(r.stored));
    } else if (r.stored != r.ok) {
      std::printf("# %s: MISMATCH: %llu acknowledged, %llu stored\n", r.name.c_str(),
                  static_cast<unsigned long long>(r.ok), static_cast<unsigned long long>(r.stored));
      good = false;
    }
    good = good && r.clean_exit && r.errors == 0;
  }
  return good;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{
      "cpd-coordinator-load: simulated workers report per-layer statistics to one "
      "cpd-coordinator; prints reports sent/acknowledged/stored, RPC latency percentiles, the "
      "coordinator's peak RSS and CPU, for a 0-layer baseline and the layer load.",
      kTool};
  app.add_option("--workers", o.workers, "simulated workers (jobs x ranks)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--jobs", o.jobs, "jobs the workers are split into (workers / jobs ranks each)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--layers", o.layers, "layer rows per report in the load row")
      ->capture_default_str()
      ->check(CLI::Range(0, 4096));
  app.add_option("--hz", o.hz, "reports per second per worker")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--seconds", o.seconds, "measured seconds per row")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup,
                 "seconds of the same load before measuring (sent and "
                 "stored include them; latencies do not)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--threads", o.threads, "sender threads (calls are asynchronous)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("--channels", o.channels, "gRPC connections (0: one per job)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--coordinator", o.coordinator,
                 "HOST:PORT of a running coordinator (default: start one per row on a "
                 "temporary database; only then are its RSS, CPU and DB size reported)");
  app.add_option("--coordinator-bin", o.coordinator_bin,
                 "the cpd-coordinator to start (default: beside this program)");
  app.add_option("--coordinator-args", o.coordinator_args,
                 "extra flags for the started coordinator, e.g. \"--keep-full 200 "
                 "--retention-every 2\" to load it while retention runs");
  app.add_option("--token-file", o.token_file, "token for --coordinator (first line)")
      ->check(CLI::ExistingFile);
  app.add_flag("!--no-baseline", o.baseline, "skip the 0-layer baseline row");
  app.add_option("--deadline-ms", o.deadline_ms, "per-call deadline")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  if (int rc = cpd::launcher::ParseArgs(app, argc, argv, kTool); rc >= 0) return rc;
  if (o.workers % o.jobs != 0) {
    cpd::launcher::FailWith(kTool, "--workers " + std::to_string(o.workers) +
                                       " is not a multiple of --jobs " + std::to_string(o.jobs));
  }
  if (!o.token_file.empty()) {
    std::ifstream in(o.token_file);
    std::getline(in, o.token);
    o.token.erase(0, o.token.find_first_not_of(" \t\r"));
    o.token.erase(o.token.find_last_not_of(" \t\r") + 1);
  }
  if (o.coordinator.empty() && o.coordinator_bin.empty()) {
    o.coordinator_bin =
        std::filesystem::read_symlink("/proc/self/exe").parent_path().string() + "/cpd-coordinator";
  }

  cpd::bench::WarnIfUnoptimised();
  std::printf(
      "# %s: %d workers (%d jobs x %d ranks), %g Hz each, %g s measured after %g s "
      "warm-up, %d sender thread(s), %d connection(s); %ld CPUs, loadavg %s\n",
      kTool, o.workers, o.jobs, o.workers / o.jobs, o.hz, o.seconds, o.warmup, o.threads,
      o.channels > 0 ? o.channels : o.jobs, sysconf(_SC_NPROCESSORS_ONLN), LoadAvg().c_str());
  std::fflush(stdout);

  std::vector<Row> rows;
  std::vector<std::pair<std::string, int>> plan;
  if (o.baseline) plan.push_back({"baseline", 0});
  plan.push_back({"layers", o.layers});
  for (const auto& [name, layers] : plan) {
    rows.push_back(o.coordinator.empty() ? RunRowOnOwnCoordinator(o, name, layers)
                                         : RunRow(o, name, layers, o.coordinator, -1, ""));
  }

  const bool good = PrintRows(o, rows);
  std::printf("# loadavg at the end: %s\n", LoadAvg().c_str());
  return good ? 0 : 1;
}
