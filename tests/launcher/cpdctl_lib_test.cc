// cpdctl's pieces that need no coordinator: the table formatter, numbers for humans, CSV fields,
// proto messages as JSON, the ordering of per-layer rows, study tallies, and the schedule edits of
// `cpdctl schedule set` (local validation and application to a schedule).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "launcher/common.h"
#include "launcher/cpdctl/output.h"
#include "launcher/cpdctl/schedule_edits.h"

namespace cpd::ctl {
namespace {

using cpd::v1::LayerStat;
using cpd::v1::PrecisionSchedule;
using cpd::v1::StatsReport;

TEST(CpdctlTable, ColumnsAlignAndLinesHaveNoTrailingBlanks) {
  Table t({{"NAME", Table::Align::kLeft}, {"N", Table::Align::kRight}, {"X", Table::Align::kLeft}});
  t.AddRow({"conv1", "7", ""});
  t.AddRow({"fc", "1234", "e4m3"});
  EXPECT_EQ(t.Render(),
            "NAME      N  X\n"
            "conv1     7\n"
            "fc     1234  e4m3\n");
  EXPECT_EQ(t.Render(1), "NAME   N  X\nconv1  7\n");  // widths of the rows shown
  EXPECT_EQ(t.rows(), 2u);
}

TEST(CpdctlNumbers, HumanFormats) {
  EXPECT_EQ(FormatG(0.000123456), "0.000123");
  EXPECT_EQ(FormatG(123456.0), "1.23e+05");
  EXPECT_EQ(FormatPercent(0), "0%");
  EXPECT_EQ(FormatPercent(0.0123), "1.23%");
  EXPECT_EQ(FormatPercent(1), "100%");
  EXPECT_EQ(FormatPercent(2.5e-7), "2.5e-05%");
  EXPECT_EQ(FormatAccuracy(0.8521), "85.21%");
  EXPECT_EQ(FormatAccuracy(-1), "-");
  EXPECT_EQ(FormatDuration(850), "850 ms");
  EXPECT_EQ(FormatDuration(12'340), "12.3 s");
  EXPECT_EQ(FormatDuration(245'000), "4 min 05 s");
  EXPECT_EQ(FormatDuration(7'800'000), "2 h 10 min");
  EXPECT_EQ(FormatDuration(-1), "-");
  EXPECT_EQ(FormatTime(0), "-");
}

// A language model's validation figures: negative (none) and 0 (an older worker or
// coordinator) are not measured; NaN and inf (a model that diverged) are.
TEST(CpdctlNumbers, ValidationFigures) {
  EXPECT_FALSE(Measured(-1));
  EXPECT_FALSE(Measured(0));
  EXPECT_TRUE(Measured(1e-300));
  EXPECT_TRUE(Measured(std::nan("")));
  EXPECT_TRUE(Measured(std::numeric_limits<double>::infinity()));
  EXPECT_EQ(FormatMeasured(5.754602676, 2), "5.75");
  EXPECT_EQ(FormatMeasured(0, 2), "-");
  EXPECT_EQ(FormatMeasured(std::nan(""), 2), "nan");
  EXPECT_EQ(FormatMeasured(std::numeric_limits<double>::infinity(), 3), "inf");
  EXPECT_EQ(ValidationSummary(5.754602676, 2.524706, 1.75),
            "5.75 (validation; 2.525 bits/byte, loss 1.7500)");
  EXPECT_EQ(ValidationSummary(5.754602676, -1, 1.75), "5.75 (validation; loss 1.7500)");
  EXPECT_EQ(ValidationSummary(5.754602676, 0, 0), "5.75 (validation)");
}

TEST(CpdctlNumbers, ShortestDoubleReadsBackExactly) {
  for (double v : {0.1, 1.0 / 3.0, 2.5e-300, 123456789.125, -0.0, 6.02214076e23}) {
    const std::string s = ShortestDouble(v);
    EXPECT_EQ(std::strtod(s.c_str(), nullptr), v) << s;
  }
  EXPECT_EQ(ShortestDouble(0.1), "0.1");
  EXPECT_EQ(ShortestDouble(3), "3");
}

TEST(CpdctlCsv, FieldsAreQuotedOnlyWhenNeeded) {
  EXPECT_EQ(launcher::CsvField("conv1"), "conv1");
  EXPECT_EQ(launcher::CsvField("uint4:minmax:ch"), "uint4:minmax:ch");
  EXPECT_EQ(launcher::CsvField("a,b"), "\"a,b\"");
  EXPECT_EQ(launcher::CsvField("say \"hi\""), "\"say \"\"hi\"\"\"");
  EXPECT_EQ(launcher::CsvField("two\nlines"), "\"two\nlines\"");
}

// The one quoting helper of the launcher's messages (issue 26 item 15: garbage echoed raw, a
// NUL cutting a message short, a 400 KB one-line error).
TEST(LauncherMessages, QuoteForMessageShortensAndEscapes) {
  using launcher::QuoteForMessage;
  EXPECT_EQ(QuoteForMessage("conv1"), "'conv1'");
  EXPECT_EQ(QuoteForMessage(""), "''");
  EXPECT_EQ(QuoteForMessage(std::string("a\0b\tc\nd\\e\x01\xff", 11)),
            "'a\\0b\\tc\\nd\\\\e\\x01\\xff'");
  EXPECT_EQ(QuoteForMessage("caf\xc3\xa9"), "'caf\\xc3\\xa9'");
  const std::string big(400000, 'x');
  EXPECT_EQ(QuoteForMessage(big), "'" + std::string(60, 'x') + "'... (400000 bytes)");
  EXPECT_EQ(QuoteForMessage("abcdef", 3), "'abc'... (6 bytes)");
  EXPECT_EQ(QuoteForMessage("abc", 3), "'abc'");
}

TEST(LauncherMessages, MessageLineIsOneBoundedLine) {
  using launcher::MessageLine;
  EXPECT_EQ(MessageLine("plain text, caf\xc3\xa9 C:\\dir"), "plain text, caf\xc3\xa9 C:\\dir");
  EXPECT_EQ(MessageLine(std::string("two\nlines\0after NUL", 19)), "two\\nlines\\0after NUL");
  const std::string m = MessageLine(std::string(400000, 'y'));
  EXPECT_EQ(m, std::string(2000, 'y') + "... (400000 bytes)");
}

// The token reader of every program (issue 26 item 1): gRPC's rule for metadata values, the
// column of the first byte it refuses, never the token in the message.
TEST(LauncherMessages, TokenFromFileTextFollowsGrpcsRule) {
  using launcher::TokenFromFileText;
  EXPECT_EQ(*TokenFromFileText("  s3cret token \r\nline 2\n", "f"), "s3cret token");
  EXPECT_EQ(*TokenFromFileText("~!x", "f"), "~!x");
  EXPECT_EQ(*TokenFromFileText(std::string(4096, 't'), "f"), std::string(4096, 't'));
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"\n", "f: the first line is empty"},
      {" \t \r\ntoken", "f: the first line is empty"},
      {"ab\tSECRET", "f: a tab at column 3 of the first line"},
      {" ab\x02SECRET", "f: a control character at column 4"},
      {"ab\x7fSECRET", "f: a control character at column 3"},
      {"ab\xc3\xa9SECRET", "f: a non-ASCII byte at column 3"},
      {std::string("ab\0SECRET", 9), "f: a NUL byte at column 3"},
      {"ab\vSECRET", "f: a control character at column 3"},
      {std::string(4097, 't'), "f: the token on the first line is longer than 4096 bytes"},
  };
  for (const auto& [text, want] : bad) {
    const auto t = TokenFromFileText(text, "f");
    ASSERT_FALSE(t.ok()) << want;
    EXPECT_EQ(t.status().code(), Status::Code::kInvalidArgument);
    EXPECT_EQ(t.status().message().rfind(want, 0), 0u) << t.status().message();
    EXPECT_EQ(t.status().message().find("SECRET"), std::string::npos) << t.status().message();
  }
}

TEST(CpdctlSites, NamesRoundTrip) {
  for (auto s :
       {cpd::v1::SITE_W, cpd::v1::SITE_A, cpd::v1::SITE_E, cpd::v1::SITE_G, cpd::v1::SITE_COMM}) {
    EXPECT_EQ(ParseSite(SiteName(s)), s);
  }
  EXPECT_EQ(ParseSite("comm"), cpd::v1::SITE_COMM);
  EXPECT_FALSE(ParseSite("X").has_value());
  EXPECT_EQ(SiteName(cpd::v1::SITE_UNSPECIFIED), "?");
}

TEST(CpdctlJson, EveryFieldWith64BitNumbersAndEnumNames) {
  StatsReport r;
  r.set_job_id(int64_t(1) << 40);
  r.set_step(12);
  r.set_loss(0.25);
  r.set_dropped_reports(uint64_t(1) << 63);
  auto* l = r.add_layers();
  l->set_layer("block1.conv1");
  l->set_site(cpd::v1::SITE_COMM);
  l->set_aps_shift(-3);
  const nlohmann::json j = ToJson(r);
  EXPECT_EQ(j["job_id"], int64_t(1) << 40);
  EXPECT_TRUE(j["job_id"].is_number_integer());
  EXPECT_EQ(j["dropped_reports"].get<uint64_t>(), uint64_t(1) << 63);
  EXPECT_EQ(j["loss"], 0.25);
  EXPECT_EQ(j["finished"], false);      // defaults are present
  EXPECT_EQ(j["train_accuracy"], 0.0);  // ... numbers too
  ASSERT_EQ(j["layers"].size(), 1u);
  EXPECT_EQ(j["layers"][0]["site"], "SITE_COMM");
  EXPECT_EQ(j["layers"][0]["aps_shift"], -3);
  EXPECT_EQ(j["layers"][0]["layer"], "block1.conv1");
  // Round trip through text.
  EXPECT_EQ(nlohmann::json::parse(j.dump()), j);
}

// A report with rows (layer, site, max, saturated, flushed, error, shift) in the model's order.
StatsReport MakeReport(int64_t step) {
  StatsReport r;
  r.set_step(step);
  struct Row {
    const char* layer;
    cpd::v1::Site site;
    double max, sat, flushed, err;
    int shift;
  };
  const Row rows[] = {
      {"conv1", cpd::v1::SITE_W, 0.5, 0.0, 0.01, 0.02, 0},
      {"conv1", cpd::v1::SITE_A, 3.0, 0.2, 0.0, -1, 0},
      {"conv1", cpd::v1::SITE_COMM, 1e-3, 0.0, 0.3, 0.05, 7},
      {"b.fc", cpd::v1::SITE_E, 1e-6, 0.0, 0.9, 0.5, 0},
      {"b.fc", cpd::v1::SITE_COMM, 2e-2, 0.1, 0.0, 0.01, 2},
  };
  for (const Row& x : rows) {
    LayerStat* l = r.add_layers();
    l->set_layer(x.layer);
    l->set_site(x.site);
    l->set_max_abs(x.max);
    l->set_saturated(x.sat);
    l->set_flushed(x.flushed);
    l->set_rel_error(x.err);
    l->set_aps_shift(x.shift);
  }
  return r;
}

std::vector<std::string> Order(const StatsReport& r, const std::string& key) {
  std::vector<LayerRow> rows;
  for (int i = 0; i < r.layers_size(); ++i) rows.push_back({&r, &r.layers(i), size_t(i)});
  const Status s = SortLayerRows(&rows, key);
  EXPECT_TRUE(s.ok()) << s.message();
  std::vector<std::string> out;
  for (const auto& row : rows) out.push_back(row.stat->layer() + "." + SiteName(row.stat->site()));
  return out;
}

TEST(CpdctlStudies, TallyCountsRunsPerStateByStudyName) {
  cpd::v1::ListJobsResponse jobs;
  const std::vector<std::pair<std::string, std::string>> runs = {
      {"zeta", "running"}, {"", "running"},      {"alpha", "finished"},
      {"zeta", "stale"},   {"zeta", "finished"}, {"alpha", "finished"}};
  for (const auto& [study, state] : runs) {
    auto* j = jobs.add_jobs();
    j->set_study(study);
    j->set_state(state);
  }
  const std::vector<StudyTally> t = TallyStudies(jobs);
  ASSERT_EQ(t.size(), 2u);  // the untagged job is in no study
  EXPECT_EQ(t[0].study, "alpha");
  EXPECT_EQ(t[0].runs, 2);
  EXPECT_EQ(t[0].finished, 2);
  EXPECT_EQ(t[0].running + t[0].stale, 0);
  EXPECT_EQ(t[1].study, "zeta");
  EXPECT_EQ(t[1].runs, 3);
  EXPECT_EQ(t[1].running, 1);
  EXPECT_EQ(t[1].stale, 1);
  EXPECT_EQ(t[1].finished, 1);
  EXPECT_TRUE(TallyStudies(cpd::v1::ListJobsResponse()).empty());
}

TEST(CpdctlLayers, SortKeys) {
  const StatsReport r = MakeReport(5);
  using V = std::vector<std::string>;
  EXPECT_EQ(Order(r, "layer"), (V{"b.fc.E", "b.fc.COMM", "conv1.W", "conv1.A", "conv1.COMM"}));
  EXPECT_EQ(Order(r, "site"), (V{"conv1.W", "conv1.A", "b.fc.E", "conv1.COMM", "b.fc.COMM"}));
  EXPECT_EQ(Order(r, "max"), (V{"conv1.A", "conv1.W", "b.fc.COMM", "conv1.COMM", "b.fc.E"}));
  // Ties (0) keep the model's order.
  EXPECT_EQ(Order(r, "saturated"), (V{"conv1.A", "b.fc.COMM", "conv1.W", "conv1.COMM", "b.fc.E"}));
  EXPECT_EQ(Order(r, "flushed"), (V{"b.fc.E", "conv1.COMM", "conv1.W", "conv1.A", "b.fc.COMM"}));
  // Unmeasured (-1) last.
  EXPECT_EQ(Order(r, "error"), (V{"b.fc.E", "conv1.COMM", "conv1.W", "b.fc.COMM", "conv1.A"}));
  // Only COMM rows have a shift; the others follow in the model's order.
  EXPECT_EQ(Order(r, "shift"), (V{"conv1.COMM", "b.fc.COMM", "conv1.W", "conv1.A", "b.fc.E"}));

  std::vector<LayerRow> rows;
  const Status bad = SortLayerRows(&rows, "size");
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("'size'"), std::string::npos);
  EXPECT_NE(bad.message().find("flushed"), std::string::npos);
}

TEST(CpdctlLayers, EarlierStepsFirstAndTableCells) {
  const StatsReport a = MakeReport(10), b = MakeReport(3);
  std::vector<LayerRow> rows;
  size_t order = 0;
  for (const StatsReport* r : {&a, &b}) {
    for (const auto& l : r->layers()) rows.push_back({r, &l, order++});
  }
  ASSERT_TRUE(SortLayerRows(&rows, "max").ok());
  EXPECT_EQ(rows.front().report->step(), 3);
  EXPECT_EQ(rows.back().report->step(), 10);
  const std::string text = LayerTable(rows, true).Render();
  EXPECT_EQ(text.rfind("STEP  LAYER", 0), 0u) << text;
  // b.fc.E: flushed 90%, max 1e-06, rel error 0.5; conv1.A's unmeasured error is "-".
  EXPECT_NE(text.find("90%"), std::string::npos) << text;
  EXPECT_NE(text.find("1e-06"), std::string::npos) << text;
  EXPECT_NE(text.find("COMM"), std::string::npos) << text;
  EXPECT_EQ(LayerTable(rows, false).Render().rfind("LAYER", 0), 0u);
}

// ---- Schedule edits ---------------------------------------------------------------------------

testing::AssertionResult IsOk(const Status& s) {
  if (s.ok()) return testing::AssertionSuccess();
  return testing::AssertionFailure() << s.message();
}

PrecisionSchedule BaseSchedule() {
  PrecisionSchedule s;
  s.set_version(4);
  s.set_effective_from_step(100);
  s.set_set_by("register");
  s.set_set_at_ms(123);
  auto* w = s.add_formats();
  w->set_site(cpd::v1::SITE_W);
  w->set_spec("e4m3");
  w->set_rounding("stochastic");
  return s;
}

google::protobuf::RepeatedPtrField<cpd::v1::LayerInfo> Layers() {
  google::protobuf::RepeatedPtrField<cpd::v1::LayerInfo> out;
  for (auto [name, q] : std::initializer_list<std::pair<const char*, bool>>{
           {"conv1", true}, {"block1.conv1", true}, {"bn1", false}, {"fc", true}}) {
    auto* l = out.Add();
    l->set_name(name);
    l->set_quantizable(q);
    l->set_kind(q ? "Conv2d" : "BatchNorm");
  }
  return out;
}

TEST(CpdctlSchedule, ValidationNamesTheFlagAndCarriesTheFormatMessage) {
  auto msg = [](const ScheduleEdits& e) { return ValidateScheduleEdits(e).message(); };
  ScheduleEdits e;
  EXPECT_NE(msg(e).find("nothing to change"), std::string::npos);
  e.formats = {"W=e9m1"};
  EXPECT_NE(msg(e).find("--format 'W=e9m1': bad format spec 'e9m1'"), std::string::npos) << msg(e);
  // A spec Format::Parse would echo whole: quoted, shortened, escaped.
  e.formats = {"W=" + std::string(400000, 'e')};
  EXPECT_LT(msg(e).size(), 400u) << msg(e).substr(0, 400);
  EXPECT_NE(msg(e).find("is not a format spec"), std::string::npos) << msg(e).substr(0, 400);
  e.formats = {std::string("W=e4m3\x01\n", 8)};
  EXPECT_NE(msg(e).find("'e4m3\\x01\\n' is not a format spec"), std::string::npos) << msg(e);
  e.formats = {"conv1.X=e4m3"};
  EXPECT_NE(msg(e).find("site 'X'"), std::string::npos) << msg(e);
  e.formats = {"COMM=e4m3"};  // statistics only
  EXPECT_FALSE(ValidateScheduleEdits(e).ok());
  e.formats = {"W"};
  EXPECT_NE(msg(e).find("SITE=SPEC"), std::string::npos) << msg(e);
  e.formats = {"block1.conv1.G=int8"};
  EXPECT_TRUE(ValidateScheduleEdits(e).ok()) << msg(e);
  e.roundings = {"W=up"};
  EXPECT_NE(msg(e).find("--rounding 'W=up'"), std::string::npos) << msg(e);
  e.roundings.clear();
  e.cyclic_bits = {{1, 8}};
  EXPECT_NE(msg(e).find("--cyclic-bits MIN 1"), std::string::npos) << msg(e);
  e.cyclic_bits = {{6, 5}};
  EXPECT_FALSE(ValidateScheduleEdits(e).ok());
  e.cyclic_bits = {{3, 8}};
  e.grad_bits = 17;
  EXPECT_NE(msg(e).find("--grad-bits 17"), std::string::npos) << msg(e);
  e.grad_bits = 8;
  e.make_static = true;
  EXPECT_NE(msg(e).find("--static"), std::string::npos) << msg(e);
  e.make_static = false;
  e.hysteresis = "yes";
  EXPECT_NE(msg(e).find("'yes'"), std::string::npos);
  e.hysteresis = "on";
  EXPECT_TRUE(ValidateScheduleEdits(e).ok()) << msg(e);
}

TEST(CpdctlSchedule, CyclicAndGlobalFormatsKeepWhatIsNotEdited) {
  PrecisionSchedule s = BaseSchedule();
  ScheduleEdits e;
  e.cyclic_bits = {{3, 8}};
  e.grad_bits = 6;
  e.formats = {"W=e4m3:nosub:inf", "A=fp134:room=1"};  // canonical spelling is stored
  ASSERT_TRUE(IsOk(ApplyScheduleEdits(e, nullptr, &s)));
  EXPECT_TRUE(s.has_cyclic());
  EXPECT_EQ(s.cyclic().min_bits(), 3);
  EXPECT_EQ(s.cyclic().max_bits(), 8);
  EXPECT_EQ(s.cyclic().periods(), 32);  // a new CPT gets cpd-train's default
  EXPECT_EQ(s.grad_bits(), 6);
  ASSERT_EQ(s.formats_size(), 2);
  EXPECT_EQ(s.formats(0).spec(), "e4m3:inf:nosub");
  EXPECT_EQ(s.formats(0).rounding(), "stochastic");  // kept
  EXPECT_EQ(s.formats(1).site(), cpd::v1::SITE_A);
  EXPECT_EQ(s.formats(1).spec(), "fp134");
  // Bookkeeping is the coordinator's; no --from-step means "the next step" (0 = passed).
  EXPECT_EQ(s.version(), 0u);
  EXPECT_EQ(s.set_at_ms(), 0);
  EXPECT_EQ(s.set_by(), "");
  EXPECT_EQ(s.effective_from_step(), 0);

  ScheduleEdits p;
  p.cyclic_periods = 4;
  p.from_step = 500;
  p.roundings = {"a=zero"};
  ASSERT_TRUE(IsOk(ApplyScheduleEdits(p, nullptr, &s)));
  EXPECT_EQ(s.cyclic().periods(), 4);
  EXPECT_EQ(s.cyclic().min_bits(), 3);
  EXPECT_EQ(s.formats(1).rounding(), "zero");
  EXPECT_EQ(s.effective_from_step(), 500);

  ScheduleEdits st;
  st.make_static = true;
  ASSERT_TRUE(IsOk(ApplyScheduleEdits(st, nullptr, &s)));
  EXPECT_FALSE(s.has_cyclic());
  EXPECT_EQ(s.grad_bits(), 0);
  EXPECT_EQ(s.formats_size(), 2);

  // Periods alone need a CPT to change; rounding needs a format at that site.
  ScheduleEdits bad;
  bad.cyclic_periods = 8;
  EXPECT_NE(ApplyScheduleEdits(bad, nullptr, &s).message().find("--cyclic-bits"),
            std::string::npos);
  ScheduleEdits r;
  r.roundings = {"G=stochastic"};
  EXPECT_NE(ApplyScheduleEdits(r, nullptr, &s).message().find("--format G=SPEC"),
            std::string::npos);
}

TEST(CpdctlSchedule, OverridesAreCheckedAgainstTheJobsLayers) {
  const auto layers = Layers();
  PrecisionSchedule s = BaseSchedule();
  ScheduleEdits e;
  e.formats = {"block1.conv1.W=fp32", "conv1.E=e5m2"};
  ASSERT_TRUE(IsOk(ApplyScheduleEdits(e, &layers, &s)));
  ASSERT_EQ(s.overrides_size(), 2);
  EXPECT_EQ(s.overrides(0).layer(), "block1.conv1");  // the layer name keeps its dot
  EXPECT_EQ(s.overrides(0).site(), cpd::v1::SITE_W);
  EXPECT_EQ(s.overrides(0).spec(), "fp32");
  // The same layer and site again replaces it.
  e.formats = {"conv1.E=e4m3"};
  ASSERT_TRUE(IsOk(ApplyScheduleEdits(e, &layers, &s)));
  ASSERT_EQ(s.overrides_size(), 2);
  EXPECT_EQ(s.overrides(1).spec(), "e4m3");

  e.formats = {"conv9.W=e4m3"};
  const Status unknown = ApplyScheduleEdits(e, &layers, &s);
  EXPECT_NE(unknown.message().find("no layer 'conv9'"), std::string::npos) << unknown.message();
  EXPECT_NE(unknown.message().find("block1.conv1"), std::string::npos) << unknown.message();
  e.formats = {"bn1.W=e4m3"};
  EXPECT_NE(ApplyScheduleEdits(e, &layers, &s).message().find("no quantisation sites"),
            std::string::npos);

  ScheduleEdits d;
  d.drop_overrides = {"block1.conv1.W"};
  ASSERT_TRUE(IsOk(ApplyScheduleEdits(d, &layers, &s)));
  ASSERT_EQ(s.overrides_size(), 1);
  EXPECT_EQ(s.overrides(0).layer(), "conv1");
  EXPECT_FALSE(ApplyScheduleEdits(d, &layers, &s).ok());  // no longer there

  ScheduleEdits k;
  k.keep_fp32 = "first,fc";
  k.hysteresis = "on";
  ASSERT_TRUE(IsOk(ApplyScheduleEdits(k, &layers, &s)));
  ASSERT_EQ(s.keep_fp32_size(), 2);
  EXPECT_EQ(s.keep_fp32(1), "fc");
  EXPECT_TRUE(s.hysteresis());
  k.keep_fp32 = "none";
  k.hysteresis = "off";
  ASSERT_TRUE(IsOk(ApplyScheduleEdits(k, &layers, &s)));
  EXPECT_EQ(s.keep_fp32_size(), 0);
  EXPECT_FALSE(s.hysteresis());
  k.keep_fp32 = "last,conv7";
  EXPECT_NE(ApplyScheduleEdits(k, &layers, &s).message().find("'conv7'"), std::string::npos);
}

TEST(CpdctlSchedule, SummaryAndDetails) {
  PrecisionSchedule s = BaseSchedule();
  EXPECT_EQ(ScheduleSummary(s), "W=e4m3/stochastic");
  s.mutable_cyclic()->set_min_bits(3);
  s.mutable_cyclic()->set_max_bits(8);
  s.mutable_cyclic()->set_periods(32);
  s.set_grad_bits(8);
  s.add_keep_fp32("last");
  s.set_hysteresis(true);
  EXPECT_EQ(ScheduleSummary(s),
            "CPT 3-8 bits x32, E 8 bits; W=e4m3/stochastic; fp32: last; hysteresis");
  const std::string d = ScheduleDetails(s);
  EXPECT_NE(d.find("version         4\n"), std::string::npos) << d;
  EXPECT_NE(d.find("cyclic          3-8 bits, 32 periods"), std::string::npos) << d;
  EXPECT_NE(d.find("format A        fp32\n"), std::string::npos) << d;
  EXPECT_EQ(ScheduleSummary(PrecisionSchedule()), "fp32");
}

}  // namespace
}  // namespace cpd::ctl
