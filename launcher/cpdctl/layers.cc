// cpdctl layers: per-layer, per-site statistics of one report or a range of steps.
#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "launcher/cpdctl/commands.h"
#include "launcher/cpdctl/output.h"

namespace cpd::ctl {

std::vector<LayerRow> SelectRows(const v1::LayerStatsResponse& resp, const std::string& site,
                                 const std::string& sort, int top) {
  std::optional<v1::Site> want;
  if (!site.empty()) want = ParseSite(site);
  std::vector<LayerRow> rows;
  size_t order = 0;
  for (const auto& r : resp.reports()) {
    for (const auto& l : r.layers()) {
      if (want && l.site() != *want) continue;
      rows.push_back({&r, &l, order++});
    }
  }
  if (!sort.empty()) {
    const Status s = SortLayerRows(&rows, sort);
    if (!s.ok()) Usage(s.message());
  }
  if (top > 0) {
    std::vector<LayerRow> kept;
    const v1::StatsReport* cur = nullptr;
    int n = 0;
    for (const auto& row : rows) {
      if (row.report != cur) {
        cur = row.report;
        n = 0;
      }
      if (n++ < top) kept.push_back(row);
    }
    rows = std::move(kept);
  }
  return rows;
}

std::string ReportHeadline(const std::string& job, const v1::StatsReport& r) {
  std::string h = "job " + job + "  step " + std::to_string(r.step()) + "  epoch " +
                  std::to_string(r.epoch()) + "  loss " + FormatG(r.loss(), 5) + "  schedule v" +
                  std::to_string(r.schedule_version());
  if (r.bits() > 0) h += "  bits " + std::to_string(r.bits());
  return h + "\n";
}

namespace {

bool WantsLatest(const LayersArgs& a) { return a.step < 0 && a.from < 0 && a.to < 0; }

v1::LayerStatsRequest LayersRequest(const LayersArgs& a, const v1::JobRef& ref) {
  v1::LayerStatsRequest req;
  *req.mutable_job() = ref;
  req.set_limit(a.limit);
  if (WantsLatest(a)) {
    req.set_latest(true);
  } else if (a.step >= 0) {
    req.set_from_step(a.step);
    req.set_to_step(a.step);
  } else {
    req.set_from_step(std::max<int64_t>(a.from, 0));
    req.set_to_step(a.to >= 0 ? a.to : std::numeric_limits<int64_t>::max());
  }
  return req;
}

// The coordinator caps one answer's size; a range is read in pages, each starting again at the
// last step received (whose reports may have been cut) and skipping what was already read.
v1::LayerStatsResponse ReadLayerStats(Connection& c, const LayersArgs& a,
                                      v1::LayerStatsRequest req) {
  v1::LayerStatsResponse resp;
  for (;;) {
    grpc::ClientContext ctx;
    c.Prepare(&ctx);
    v1::LayerStatsResponse page;
    const grpc::Status s = c.ops().LayerStats(&ctx, req, &page);
    if (!s.ok()) c.FailCall(s, "LayerStats", a.job);
    if (WantsLatest(a) || a.step >= 0) {
      resp = std::move(page);
      break;
    }
    int skip = 0;  // reports at the first step of this page that the previous pages hold
    if (resp.reports_size() > 0) {
      const int64_t last = resp.reports(resp.reports_size() - 1).step();
      for (const auto& r : resp.reports()) skip += r.step() == last ? 1 : 0;
    }
    int added = 0;
    for (auto& r : *page.mutable_reports()) {
      if (skip > 0 && resp.reports_size() > 0 &&
          r.step() == resp.reports(resp.reports_size() - 1).step()) {
        --skip;
        continue;
      }
      *resp.add_reports() = std::move(r);
      ++added;
    }
    if (added == 0 || (a.limit > 0 && resp.reports_size() >= a.limit)) break;
    const int64_t last = resp.reports(resp.reports_size() - 1).step();
    req.set_from_step(last);
    if (a.limit > 0) {
      // The page repeats the reports at `last` that are already here.
      int again = 0;
      for (const auto& r : resp.reports()) again += r.step() == last ? 1 : 0;
      req.set_limit(std::min(a.limit - resp.reports_size() + again, 10000));
    }
  }
  if (a.limit > 0 && resp.reports_size() > a.limit) {
    resp.mutable_reports()->DeleteSubrange(a.limit, resp.reports_size() - a.limit);
  }
  return resp;
}

void PrintLayersJson(const LayersArgs& a, const v1::LayerStatsResponse& resp,
                     const std::vector<LayerRow>& rows) {
  nlohmann::json out = {{"job", a.job}, {"reports", nlohmann::json::array()}};
  for (const auto& r : resp.reports()) {
    nlohmann::json jr = ToJson(r);
    jr["layers"] = nlohmann::json::array();
    for (const auto& row : rows) {
      if (row.report == &r) jr["layers"].push_back(ToJson(*row.stat));
    }
    out["reports"].push_back(std::move(jr));
  }
  PrintJson(out);
}

void PrintLayersTable(const LayersArgs& a, const v1::LayerStatsResponse& resp,
                      const std::vector<LayerRow>& rows) {
  if (resp.reports().empty()) {
    if (WantsLatest(a)) {
      Print("job " + a.job + " has no layer statistics yet\n");
      FlushStdout();
      return;
    }
    Fail("job " + a.job + " has no layer statistics " +
         (a.step >= 0 ? "at step " + std::to_string(a.step)
                      : "in steps " + std::to_string(std::max<int64_t>(a.from, 0)) + ".." +
                            (a.to >= 0 ? std::to_string(a.to) : std::string("end"))));
  }
  const bool many = resp.reports_size() > 1;
  if (many) {
    Print("job " + a.job + "  steps " + std::to_string(resp.reports(0).step()) + ".." +
          std::to_string(resp.reports(resp.reports_size() - 1).step()) + "  (" +
          std::to_string(resp.reports_size()) + " reports)\n");
  } else {
    Print(ReportHeadline(a.job, resp.reports(0)));
  }
  Print(LayerTable(rows, many).Render());
  FlushStdout();
}

}  // namespace

int RunLayers(const Globals& g, const LayersArgs& a) {
  if (a.step >= 0 && (a.from >= 0 || a.to >= 0)) Usage("--step excludes --from/--to");
  if (a.from >= 0 && a.to >= 0 && a.to < a.from) {
    Usage("--from " + std::to_string(a.from) + " --to " + std::to_string(a.to) +
          ": an empty range");
  }
  const v1::JobRef ref = MakeRef(a.job);
  Connection c(g);
  const v1::LayerStatsResponse resp = ReadLayerStats(c, a, LayersRequest(a, ref));
  const auto rows = SelectRows(resp, a.site, a.sort, a.top);
  if (g.json) {
    PrintLayersJson(a, resp, rows);
  } else {
    PrintLayersTable(a, resp, rows);
  }
  return 0;
}

}  // namespace cpd::ctl
