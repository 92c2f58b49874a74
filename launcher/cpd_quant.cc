// cpd-quant: inspect CPD number formats and quantise raw float32 streams.
//
//   cpd-quant info SPEC [--list]
//   cpd-quant quantize --format SPEC [--rounding nearest|stochastic|zero] [--seed N] [--stats]
//   cpd-quant candidates [--bits 8,7,6] [--specs]
//
// Errors (bad spec, truncated input) print one line to stderr, nothing to stdout, and exit 2.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cpd/candidates.h"
#include "cpd/config.h"
#include "cpd/format.h"
#include "cpd/quantize.h"
#include "launcher/cli.h"
#include "launcher/common.h"

namespace {

using cpd::launcher::kUsageError;

[[noreturn]] void Fail(const std::string& msg, int code = kUsageError) {
  cpd::launcher::FailWith("cpd-quant", msg, code);
}

// "0.015625 (2^-6)" for powers of two, plain %.9g otherwise.
std::string Describe(double v) {
  char buf[64];
  int e = 0;
  const double m = std::frexp(v, &e);
  if (v > 0 && m == 0.5) {
    std::snprintf(buf, sizeof(buf), "%.9g (2^%d)", v, e - 1);
  } else {
    std::snprintf(buf, sizeof(buf), "%.9g", v);
  }
  return buf;
}

int RunInfo(const std::string& spec, bool list) {
  auto f = cpd::Format::Parse(spec);
  if (!f.ok()) Fail(f.status().message());
  const cpd::FormatInfo info = f->Info();
  if (list && info.bits > 8) {  // checked first: an error leaves stdout empty
    Fail("--list prints formats of <= 8 bits; '" + f->spec() + "' has " +
         std::to_string(info.bits));
  }
  std::printf("format          %s\n", f->spec().c_str());
  std::printf("bits            %d\n", info.bits);
  std::printf("max finite      %s\n", Describe(info.max_finite).c_str());
  std::printf("min normal      %s\n",
              info.min_normal > 0 ? Describe(info.min_normal).c_str() : "none");
  std::printf("min subnormal   %s\n",
              info.min_subnormal > 0 ? Describe(info.min_subnormal).c_str() : "none");
  std::printf("distinct finite %llu\n", static_cast<unsigned long long>(info.distinct_finite));
  if (f->family() == cpd::FormatFamily::kBlockScaled) {
    if (f->whole_tensor_block()) {
      std::printf("block           tensor\n");
    } else {
      std::printf("block           %zux%zu\n", f->block_rows(), f->block_cols());
    }
  } else if (f->scope() == cpd::ScaleScope::kBlock) {
    std::printf("block           %zu\n", f->block_size());
  }
  if (!info.scale_note.empty()) std::printf("scale           %s\n", info.scale_note.c_str());
  if (list) {
    auto values = f->Values();
    if (!values.ok()) Fail(values.status().message());
    std::printf("values:\n");
    for (float v : *values) std::printf("%.9g\n", double(v));
  }
  return 0;
}

std::vector<unsigned char> ReadAll(FILE* in) {
  std::vector<unsigned char> data;
  unsigned char buf[1 << 16];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof(buf), in)) > 0) data.insert(data.end(), buf, buf + got);
  if (std::ferror(in)) Fail(std::string("reading stdin: ") + std::strerror(errno));
  return data;
}

// What `cpd-quant quantize` was asked.
struct QuantizeArgs {
  std::string spec;
  std::string rounding = "nearest";
  uint64_t seed = 0, step = 0;
  size_t channels = 1;
  size_t columns = 0;
  int threads = 0;
  bool stats = false;
};

int RunQuantize(const QuantizeArgs& args) {
  auto f = cpd::Format::Parse(args.spec);
  if (!f.ok()) Fail(f.status().message());
  auto r = cpd::ParseRounding(args.rounding);
  if (!r.ok()) Fail(r.status().message());
  if (isatty(STDIN_FILENO)) Fail("reads raw little-endian float32 from stdin; pipe data in");

  std::vector<unsigned char> raw = ReadAll(stdin);
  if (raw.size() % 4 != 0) {
    Fail("input is " + std::to_string(raw.size()) +
         " bytes, not a multiple of 4 (raw little-endian float32 expected)");
  }
  const size_t n = raw.size() / 4;
  std::vector<float> x(n);
  if (n > 0) std::memcpy(x.data(), raw.data(), raw.size());

  cpd::QuantizeOptions opts;
  opts.rounding = *r;
  opts.seed = args.seed;
  opts.step = args.step;
  opts.channels = args.channels;
  opts.columns = args.columns;
  opts.threads = args.threads;
  cpd::QuantStats st;
  cpd::Status s = cpd::Quantize(*f, x.data(), x.data(), n, opts, args.stats ? &st : nullptr);
  if (!s.ok()) Fail(s.message());
  if (n > 0 && std::fwrite(x.data(), 4, n, stdout) != n) Fail("writing stdout failed");
  if (std::fflush(stdout) != 0) Fail("writing stdout failed");
  if (args.stats) {
    const double denom = n > 0 ? double(n) : 1.0;
    std::fprintf(stderr,
                 "format %s rounding %s count %zu max_abs %.9g saturated %llu (%.4f%%) "
                 "flushed %llu (%.4f%%) nonfinite %llu rel_error %.6g sq_error %.9g\n",
                 f->spec().c_str(), cpd::RoundingName(*r), n, double(st.max_abs),
                 static_cast<unsigned long long>(st.saturated), 100.0 * st.saturated / denom,
                 static_cast<unsigned long long>(st.flushed), 100.0 * st.flushed / denom,
                 static_cast<unsigned long long>(st.nonfinite), st.relative_error(), st.sq_error);
  }
  return 0;
}

// The candidate formats of a data-format search (cpd/candidates.h states the rules): a table of
// bits, family, name, range and spec, or (--specs) one spec per line for --candidates-file.
int RunCandidates(const std::string& bits_list, bool specs_only) {
  auto listed = cpd::EnumerateBinadeCandidates(std::string_view(bits_list));
  if (!listed.ok()) Fail("--bits: " + listed.status().message());
  const std::vector<cpd::BinadeCandidate>& all = *listed;
  if (specs_only) {
    for (const auto& c : all) std::printf("%s\n", c.spec.c_str());
    return 0;
  }
  std::printf("%4s  %-7s %-24s %8s %9s  %s\n", "bits", "family", "name", "binades", "range",
              "spec");
  for (const auto& c : all) {
    const cpd::FormatInfo info = cpd::Format::Parse(c.spec)->Info();
    const double lowest = info.min_subnormal > 0 ? info.min_subnormal : info.min_normal;
    std::printf("%4d  %-7s %-24s %8zu %7.1f b  %s\n", c.bits, c.family.c_str(),
                c.name.size() > 24 ? (c.name.substr(0, 21) + "...").c_str() : c.name.c_str(),
                c.mbits.size(), std::log2(info.max_finite / lowest), c.spec.c_str());
  }
  std::printf("%zu candidates\n", all.size());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cpd-quant: inspect CPD number formats and quantise raw float32 streams.\n" +
               std::string(cpd::FormatSpecHelp())};
  app.set_version_flag("--version", std::string("cpd-quant ") + CPD_VERSION);
  app.require_subcommand(1);

  std::string info_spec;
  bool list = false;
  CLI::App* info = app.add_subcommand("info", "Print a format's bits, range and value count");
  info->add_option("SPEC", info_spec, "Format spec, e.g. e4m3, fp134, log4, mxfp4")->required();
  info->add_flag("--list", list, "Also print every distinct finite value (formats <= 8 bits)");

  QuantizeArgs q;
  CLI::App* quant = app.add_subcommand(
      "quantize", "Quantise raw little-endian float32 from stdin to stdout (one tensor)");
  quant->add_option("--format", q.spec, "Format spec")->required();
  quant->add_option("--rounding", q.rounding, "nearest (ties to even) | stochastic | zero")
      ->capture_default_str();
  quant->add_option("--seed", q.seed, "Seed of the stochastic-rounding stream")
      ->check(cpd::launcher::Uint64Number())
      ->capture_default_str();
  quant->add_option("--step", q.step, "Step number mixed into the stochastic stream")
      ->check(cpd::launcher::Uint64Number())
      ->capture_default_str();
  quant
      ->add_option("--channels", q.channels,
                   "View the input as this many equal rows (for :ch formats, log<b>:ch included)")
      ->capture_default_str()
      ->check(cpd::launcher::IntegerAtLeast(1));
  quant
      ->add_option("--columns", q.columns,
                   "Block-scaled formats (nvfp4, FLOAT:block=RxC): rows of this many elements "
                   "(0: the input length / --channels)")
      ->capture_default_str()
      ->check(cpd::launcher::IntegerAtLeast(0));
  quant->add_option("--threads", q.threads, "Worker threads (0 = all cores)")
      ->capture_default_str()
      ->check(cpd::launcher::ThreadCount());
  quant->add_flag("--stats", q.stats,
                  "Print statistics (max|x|, saturated, flushed, error) to stderr");

  std::string bits_list = "8,7,6";
  bool specs_only = false;
  CLI::App* cand = app.add_subcommand(
      "candidates",
      "List the candidate formats of a data-format search (per-binade lists under an exact code "
      "budget; the rules are in cpd/candidates.h and docs/formats.md)");
  cand->add_option("--bits", bits_list, "Comma-separated widths, each 2..16")
      ->capture_default_str();
  cand->add_flag("--specs", specs_only, "Print only the specs, one per line");

  if (const int code = cpd::launcher::ParseArgs(app, argc, argv, "cpd-quant"); code >= 0) {
    return code;
  }
  if (info->parsed()) return RunInfo(info_spec, list);
  if (cand->parsed()) return RunCandidates(bits_list, specs_only);
  return RunQuantize(q);
}
