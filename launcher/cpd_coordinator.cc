// cpd-coordinator: CPD's control plane. A gRPC service (cpd.v1) that pushes each job's precision
// schedule to its workers and keeps their per-layer statistics in a SQLite file.
//
//   cpd-coordinator [--listen 127.0.0.1:50051] [--db cpd-coordinator.db] [--token-file F]
//                   [--tls-cert F --tls-key F] [--port-file F] [retention flags ...]
//
// Prints "cpd-coordinator: listening on HOST:PORT (db FILE)" once serving; SIGINT/SIGTERM stop
// it after every accepted report is stored. Bad flags: one line on stderr, exit 2 (a
// non-loopback --listen without --token-file too, unless --allow-unauthenticated); a database
// or address that cannot be used, or reports lost at shutdown: one line, exit 1.
#include <absl/synchronization/mutex.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "cpd/config.h"
#include "launcher/cli.h"
#include "launcher/common.h"
#include "launcher/coordinator/server.h"

namespace {

constexpr const char* kTool = "cpd-coordinator";

[[noreturn]] void Fail(const std::string& msg, int code = cpd::launcher::kUsageError) {
  cpd::launcher::FailWith(kTool, msg, code);
}

// Writes all of `text` to `fd`, however many calls write() takes; false with errno set.
bool WriteAll(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = EIO;
      return false;
    }
    done += size_t(n);
  }
  return true;
}

// Writes `text` to `path` atomically: a temporary beside it, fsync, rename.
bool WriteFileAtomically(const std::string& path, const std::string& text, std::string* err) {
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) {
    *err = tmp + ": " + std::strerror(errno);
    return false;
  }
  bool ok = WriteAll(fd, text) && fsync(fd) == 0;
  int saved = errno;
  if (close(fd) != 0 && ok) {
    ok = false;
    saved = errno;
  }
  if (!ok || rename(tmp.c_str(), path.c_str()) != 0) {
    *err = path + ": " + std::strerror(ok ? errno : saved);
    unlink(tmp.c_str());  // best effort: the error above is what the caller reports
    return false;
  }
  return true;
}

// The command line as parsed.
struct Flags {
  std::string listen = "127.0.0.1:50051", db = "cpd-coordinator.db", token_file, tls_cert, tls_key,
              port_file;
  bool allow_unauthenticated = false;
  int max_message_mib = 4, queue_mib = 64;
  double stale_after_s = 60, retention_every_s = 30;
  int64_t keep_full = 10000, thin_every = 10, max_reports = 100000;
  size_t watch_buffer = 64;
};

void AddOptions(CLI::App* app, Flags* f) {
  app->add_option("--listen", f->listen,
                  "HOST:PORT to serve on; port 0 picks a free one (see --port-file). Binds "
                  "loopback by default: use --token-file (and TLS) before listening on 0.0.0.0")
      ->capture_default_str();
  app->add_option("--db", f->db,
                  "SQLite database file (WAL mode; created if missing): jobs, workers, layers, "
                  "every schedule version and the reports. A restart on the same file brings "
                  "every job and its history back")
      ->capture_default_str();
  app->add_option("--token-file", f->token_file,
                  "require every call to carry metadata 'authorization: Bearer <token>', the "
                  "token being this file's first line (whitespace trimmed); wrong or missing -> "
                  "UNAUTHENTICATED")
      ->check(CLI::ExistingFile);
  app->add_option("--tls-cert", f->tls_cert, "TLS certificate chain (PEM); needs --tls-key")
      ->check(CLI::ExistingFile);
  app->add_option("--tls-key", f->tls_key, "TLS private key (PEM); needs --tls-cert")
      ->check(CLI::ExistingFile);
  app->add_flag("--allow-unauthenticated", f->allow_unauthenticated,
                "serve a non-loopback --listen address without --token-file (anyone who can reach "
                "it may read every job and change its schedule); refused without this flag");
  app->add_option("--port-file", f->port_file,
                  "once listening, write the bound port to this file (atomically: temp, fsync, "
                  "rename)");
  app->add_option("--max-message-mib", f->max_message_mib,
                  "largest request accepted, MiB; larger -> RESOURCE_EXHAUSTED. Also caps one "
                  "LayerStats answer")
      ->capture_default_str()
      ->check(cpd::launcher::IntegerIn(1, 1024));
  app->add_option("--stale-after", f->stale_after_s,
                  "seconds without a report after which a running job shows as 'stale'")
      ->capture_default_str()
      ->check(cpd::launcher::PositiveNumber());
  app->add_option("--keep-full", f->keep_full,
                  "retention: the newest N reports of each job stay at full resolution (0: all)")
      ->capture_default_str()
      ->check(cpd::launcher::IntegerAtLeast(0));
  app->add_option("--thin-every", f->thin_every,
                  "retention: older reports are thinned to the steps that are multiples of K "
                  "(end-of-epoch and final reports always stay; 1: no thinning)")
      ->capture_default_str()
      ->check(cpd::launcher::IntegerAtLeast(1));
  app->add_option("--max-reports-per-job", f->max_reports,
                  "retention: hard cap per job; the oldest reports beyond it are deleted (0: no "
                  "cap)")
      ->capture_default_str()
      ->check(cpd::launcher::IntegerAtLeast(0));
  app->add_option("--retention-every", f->retention_every_s,
                  "seconds between retention passes of the writer thread")
      ->capture_default_str()
      ->check(cpd::launcher::PositiveNumber());
  app->add_option("--queue-mib", f->queue_mib,
                  "reports waiting for the disk are held in at most this much memory; when full, "
                  "ReportStats answers RESOURCE_EXHAUSTED")
      ->capture_default_str()
      ->check(cpd::launcher::IntegerIn(1, 65536));
  app->add_option("--watch-buffer", f->watch_buffer,
                  "reports buffered per WatchJob stream for a slow reader (the oldest are "
                  "dropped)")
      ->capture_default_str()
      ->check(cpd::launcher::IntegerIn(1, 1 << 20));
}

// The server's options from the flags, with the token and the TLS files read (exit 2 when they
// cannot be).
cpd::coordinator::ServerOptions ToServerOptions(const Flags& f) {
  cpd::coordinator::ServerOptions opt;
  opt.listen = f.listen;
  opt.store.path = f.db;
  opt.store.queue_max_bytes = size_t(f.queue_mib) << 20;
  opt.store.retention.keep_full = f.keep_full;
  opt.store.retention.thin_every = f.thin_every;
  opt.store.retention.max_reports_per_job = f.max_reports;
  opt.store.retention.interval_ms = int64_t(f.retention_every_s * 1000);
  opt.coordinator.stale_after_ms = int64_t(f.stale_after_s * 1000);
  opt.coordinator.watch_buffer = f.watch_buffer;
  opt.max_receive_bytes = f.max_message_mib << 20;
  opt.coordinator.max_response_bytes = size_t(opt.max_receive_bytes);
  if (!f.token_file.empty()) {
    opt.coordinator.token = cpd::launcher::ReadTokenFileOrExit(kTool, "--token-file", f.token_file,
                                                               cpd::launcher::kUsageError);
  }
  if (!f.tls_cert.empty()) {
    opt.tls_cert_pem = cpd::launcher::ReadPemFileOrExit(kTool, "--tls-cert", f.tls_cert,
                                                        "CERTIFICATE", cpd::launcher::kUsageError);
    opt.tls_key_pem = cpd::launcher::ReadPemFileOrExit(kTool, "--tls-key", f.tls_key, "PRIVATE KEY",
                                                       cpd::launcher::kUsageError);
  }
  return opt;
}

// SIGINT and SIGTERM, blocked in every thread (they are taken by sigwait in Serve); SIGPIPE
// ignored. Call before gRPC and the store's writer start threads, which inherit the mask.
sigset_t BlockStopSignals() {
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  if (const int rc = pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr); rc != 0) {
    Fail(std::string("cannot block SIGINT/SIGTERM: ") + std::strerror(rc), 1);
  }
  if (signal(SIGPIPE, SIG_IGN) == SIG_ERR) {
    Fail(std::string("cannot ignore SIGPIPE: ") + std::strerror(errno), 1);
  }
  return stop_signals;
}

// Starts the server, announces it, serves until SIGINT/SIGTERM, then stops it after storing
// every accepted report. Returns the exit code: 1 when reports were lost.
int Serve(const Flags& f, const std::string& host, const cpd::coordinator::ServerOptions& opt) {
  const sigset_t stop_signals = BlockStopSignals();
  auto started = cpd::coordinator::CoordinatorServer::Start(opt);
  if (!started.ok()) Fail(started.status().message(), 1);
  std::unique_ptr<cpd::coordinator::CoordinatorServer> server = std::move(started).value();
  const int port = server->port();
  if (!f.port_file.empty()) {
    std::string err;
    if (!WriteFileAtomically(f.port_file, std::to_string(port) + "\n", &err)) {
      Fail("--port-file " + err, 1);
    }
  }
  // For whoever started the coordinator; a closed stdout must not stop a serving coordinator, so
  // the result of this write is not checked.
  std::printf("%s: listening on %s:%d (db %s)\n", kTool, host.c_str(), port, f.db.c_str());
  std::fflush(stdout);

  int sig = 0;
  if (const int rc = sigwait(&stop_signals, &sig); rc != 0) {
    std::fprintf(stderr, "%s: waiting for SIGINT/SIGTERM failed (%s); stopping\n", kTool,
                 std::strerror(rc));
  } else {
    std::fprintf(stderr, "%s: %s received; storing queued reports and stopping\n", kTool,
                 sig == SIGINT ? "SIGINT" : "SIGTERM");
  }
  server->Shutdown();
  const cpd::coordinator::StoreStats st = server->store()->stats();
  std::fprintf(stderr, "%s: stopped; %llu reports stored this run%s\n", kTool,
               static_cast<unsigned long long>(st.stored),
               st.lost > 0 ? (", " + std::to_string(st.lost) + " LOST (see above)").c_str() : "");
  server.reset();
  return st.lost > 0 ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "cpd-coordinator: CPD's control plane. Pushes each job's precision schedule to its "
      "workers (WatchSchedule) and keeps their per-layer statistics (ReportStats) in a SQLite "
      "file; cpdctl reads and changes them. It never sees gradients.",
      kTool};
  app.set_version_flag("--version", std::string(kTool) + " " CPD_VERSION);
  Flags f;
  AddOptions(&app, &f);
  if (int rc = cpd::launcher::ParseArgs(app, argc, argv, kTool); rc >= 0) return rc;

  std::string host;
  int want_port = 0;
  if (!cpd::launcher::SplitHostPort(f.listen, &host, &want_port)) {
    Fail("--listen " + cpd::launcher::QuoteForMessage(f.listen) +
         ": expected HOST:PORT, e.g. 127.0.0.1:50051 (port 0: any free)");
  }
  // Anyone who reaches a non-loopback address could read every job and change its schedule.
  if (!cpd::launcher::IsLoopbackHost(host) && f.token_file.empty()) {
    if (!f.allow_unauthenticated) {
      Fail("--listen " + f.listen +
           " is not a loopback address and there is no --token-file: anyone who can reach it "
           "could change every job's schedule. Give --token-file FILE (and --tls-cert/--tls-key), "
           "or --allow-unauthenticated on a trusted network");
    }
    std::fprintf(stderr,
                 "%s: WARNING: serving %s WITHOUT AUTHENTICATION (--allow-unauthenticated): "
                 "anyone who can reach it can read every job and change its schedule\n",
                 kTool, f.listen.c_str());
  }
  if (f.tls_cert.empty() != f.tls_key.empty()) {
    Fail("--tls-cert and --tls-key go together (got only " +
         std::string(f.tls_cert.empty() ? "--tls-key" : "--tls-cert") + ")");
  }
  const cpd::coordinator::ServerOptions opt = ToServerOptions(f);
  // Debian's Abseil checks every absl::Mutex (used throughout gRPC) for lock-order cycles: ~3% of
  // the coordinator's CPU under load (perf), for a debugging aid.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return Serve(f, host, opt);
}
