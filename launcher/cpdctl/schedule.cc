// cpdctl schedule get, cpdctl schedule set.
#include <pwd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "launcher/common.h"
#include "launcher/cpdctl/commands.h"
#include "launcher/cpdctl/output.h"
#include "launcher/cpdctl/schedule_edits.h"

namespace cpd::ctl {

int RunScheduleGet(const Globals& g, const std::string& job, bool history) {
  MakeRef(job);
  Connection c(g);
  const v1::GetScheduleResponse resp = ReadSchedule(c, job);
  if (g.json) {
    PrintJson(ToJson(resp));
    return 0;
  }
  Print("job " + job + "\n" + ScheduleDetails(resp.schedule()));
  if (history) {
    using A = Table::Align;
    Table t({{"VERSION", A::kRight},
             {"FROM STEP", A::kRight},
             {"SET BY", A::kLeft},
             {"SET AT", A::kLeft},
             {"SCHEDULE", A::kLeft}});
    for (const auto& h : resp.history()) {
      t.AddRow({std::to_string(h.version()), std::to_string(h.effective_from_step()),
                h.set_by().empty() ? "-" : h.set_by(), FormatTime(h.set_at_ms()),
                ScheduleSummary(h)});
    }
    Print("\n" + t.Render());
  }
  FlushStdout();
  return 0;
}

namespace {

// "cpdctl USER@HOST" for the schedule's set_by; the account from the password database when
// $USER is unset (as under sudo or in containers).
std::string WhoAmI() {
  std::string user;
  if (const char* env = std::getenv("USER"); env != nullptr && *env) user = env;
  if (user.empty()) {
    if (const passwd* pw = getpwuid(geteuid()); pw != nullptr && pw->pw_name != nullptr) {
      user = pw->pw_name;
    }
  }
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  return "cpdctl " + (user.empty() ? std::string("?") : user) + "@" + (host[0] ? host : "?");
}

// Whether the edits name layers (a per-layer --format, --keep-fp32, --allreduce-layer-format),
// which are checked against the job's layers.
bool NamesLayers(const ScheduleEdits& e) {
  if (e.keep_fp32 || !e.allreduce_layers.empty()) return true;
  return std::any_of(e.formats.begin(), e.formats.end(), [](const std::string& f) {
    const std::string lhs = f.substr(0, f.find('='));
    return !ParseSite(lhs);
  });
}

}  // namespace

int RunScheduleSet(const Globals& g, const std::string& job, const ScheduleEdits& e,
                   uint64_t expect_version) {
  // Everything checkable without the coordinator fails here, before any call.
  if (const Status s = ValidateScheduleEdits(e); !s.ok()) Usage(s.message());
  const v1::JobRef ref = MakeRef(job);
  Connection c(g);
  const bool names_layers = NamesLayers(e);
  v1::JobStatusResponse st;
  if (names_layers || e.from_step) st = GetStatus(c, job);
  // A schedule from a step the job never reaches would be stored and never take effect.
  if (e.from_step && st.job().total_steps() > 0 && *e.from_step >= st.job().total_steps()) {
    Usage("--from-step " + std::to_string(*e.from_step) + " is beyond the " +
          std::to_string(st.job().total_steps()) + " steps of job " +
          cpd::launcher::QuoteForMessage(job) + "; accepted: 0.." +
          std::to_string(st.job().total_steps() - 1));
  }
  const v1::GetScheduleResponse cur = ReadSchedule(c, job);
  v1::PrecisionSchedule next = cur.schedule();
  if (const Status s = ApplyScheduleEdits(e, names_layers ? &st.layers() : nullptr, &next);
      !s.ok()) {
    Usage(s.message());
  }
  v1::SetScheduleRequest req;
  *req.mutable_job() = ref;
  *req.mutable_schedule() = next;
  const uint64_t expected = expect_version > 0 ? expect_version : cur.schedule().version();
  req.set_expected_version(expected);
  req.set_set_by(WhoAmI());
  grpc::ClientContext ctx;
  c.Prepare(&ctx);
  v1::SetScheduleResponse resp;
  const grpc::Status s = c.ops().SetSchedule(&ctx, req, &resp);
  if (s.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
    Fail("the schedule of job '" + job + "' is no longer version " + std::to_string(expected) +
         " (changed by someone else); nothing was written: run the command again (" +
         OneLine(s.error_message()) + ")");
  }
  if (!s.ok()) c.FailCall(s, "SetSchedule", job);
  if (g.json) {
    PrintJson(ToJson(resp));
    return 0;
  }
  Print("job " + job + ": schedule version " + std::to_string(cur.schedule().version()) + " -> " +
        std::to_string(resp.schedule().version()) + ", effective from step " +
        std::to_string(resp.schedule().effective_from_step()) + "\n" +
        ScheduleDetails(resp.schedule()));
  FlushStdout();
  return 0;
}

}  // namespace cpd::ctl
