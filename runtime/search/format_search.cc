#include "runtime/search/format_search.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string_view>
#include <system_error>

#include "cpd/candidates.h"
#include "cpd/progress.h"
#include "runtime/search/search_files.h"

namespace cpd::runtime {

namespace {

using Clock = std::chrono::steady_clock;

std::string Errno() { return std::strerror(errno); }

std::string Number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

// A CSV field: quoted (format specs hold commas), quotes doubled.
std::string Quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

// Splits one CSV row into fields (quoted fields may hold commas and doubled quotes).
std::vector<std::string> SplitCsv(const std::string& row) {
  std::vector<std::string> out;
  std::string field;
  bool quoted = false;
  for (size_t i = 0; i < row.size(); ++i) {
    const char c = row[i];
    if (quoted) {
      if (c == '"' && i + 1 < row.size() && row[i + 1] == '"') {
        field += '"';
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        field += c;
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      out.push_back(field);
      field.clear();
    } else {
      field += c;
    }
  }
  out.push_back(field);
  return out;
}

// Welford's running mean and variance: one pass, in batch order (so deterministic).
struct Running {
  int64_t n = 0;
  double mean = 0, m2 = 0;
  void Add(double x) {
    ++n;
    const double d = x - mean;
    mean += d / double(n);
    m2 += d * (x - mean);
  }
  double std() const { return n > 1 ? std::sqrt(m2 / double(n - 1)) : 0.0; }
};

struct CandidateAccumulator {
  Running network[kNumSiteSets];
  std::vector<Running> layer[kNumSiteSets];
};

// Writes all of `text` to `fd`, then syncs: what is on disk is whole.
Status WriteAll(int fd, const std::string& text, const std::string& path) {
  size_t off = 0;
  while (off < text.size()) {
    const ssize_t w = ::write(fd, text.data() + off, text.size() - off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return Status::IoError("writing " + path + ": " + Errno());
    off += size_t(w);
  }
  if (::fsync(fd) != 0) return Status::IoError("writing " + path + ": " + Errno());
  return Status::Ok();
}

// The partial-results file (runtime/search/search_files.h): a settings line, the header, one
// row per finished candidate.
class PartialFile {
 public:
  // Reads what a previous run left (resume) or creates the file; rank 0 only.
  static Result<PartialFile> Open(const FormatSearchOptions& o,
                                  const std::vector<std::string>& layers,
                                  std::vector<CandidateResult>* done) {
    PartialFile f;
    f.path_ = o.partial_path;
    if (f.path_.empty()) return f;
    struct stat sb;
    if (::lstat(f.path_.c_str(), &sb) == 0) {
      if (!o.resume) {
        return Status::InvalidArgument(f.path_ +
                                       " exists: an interrupted search left it; --resume "
                                       "continues it (or remove the file to start again)");
      }
      CPD_ASSIGN_OR_RETURN(const std::string text,
                           ReadBoundedFile(f.path_, kMaxPartialFileBytes, "--resume: " + f.path_));
      CPD_ASSIGN_OR_RETURN(PartialResults read, ParsePartialResults(f.path_, text, o, layers));
      // A row a crash cut short goes, so that the next row starts on a line of its own.
      if (read.complete_bytes < text.size() &&
          ::truncate(f.path_.c_str(), off_t(read.complete_bytes)) != 0) {
        return Status::IoError("cannot cut the torn last row off " + f.path_ + ": " + Errno());
      }
      *done = std::move(read.rows);
    } else {
      CPD_RETURN_IF_ERROR(f.Create(PartialSettingsLine(o) + "\n" +
                                   ResultsCsvHeader(layers, o.indicator.sites) + "\n"));
    }
    return f;
  }

  // Appends and syncs: a row on disk is a finished candidate.
  Status Append(const std::string& text) const {
    if (path_.empty() || text.empty()) return Status::Ok();
    const int fd = ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
    if (fd < 0) return Status::IoError("cannot open " + path_ + ": " + Errno());
    Status s = WriteAll(fd, text, path_);
    if (::close(fd) != 0 && s.ok()) s = Status::IoError("writing " + path_ + ": " + Errno());
    return s;
  }

 private:
  // The file appears whole or not at all (a temporary, synced, then linked to its name: link
  // never replaces a file that appeared meanwhile), so a crash never leaves a file without its
  // settings line and header.
  Status Create(const std::string& head) const {
    const std::string tmp = path_ + ".tmp." + std::to_string(::getpid());
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return Status::IoError("cannot create " + tmp + ": " + Errno());
    Status s = WriteAll(fd, head, tmp);
    if (::close(fd) != 0 && s.ok()) s = Status::IoError("writing " + tmp + ": " + Errno());
    if (s.ok() && ::link(tmp.c_str(), path_.c_str()) != 0) {
      s = Status::IoError("cannot create " + path_ + ": " + Errno());
    }
    ::unlink(tmp.c_str());
    if (!s.ok()) return s;
    const size_t slash = path_.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : path_.substr(0, slash + 1);
    const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      ::fsync(dfd);  // best effort: the rows that follow are synced on their own
      ::close(dfd);
    }
    return Status::Ok();
  }

  std::string path_;
};

// Every rank's string, on every rank (an all-gather of variable-length payloads).
Result<std::vector<std::string>> GatherStrings(comm::Communicator* comm, const std::string& mine) {
  uint64_t len = mine.size();
  std::vector<uint64_t> lens(size_t(comm->size()));
  CPD_RETURN_IF_ERROR(comm->AllGatherBytes(reinterpret_cast<const uint8_t*>(&len),
                                           reinterpret_cast<uint8_t*>(lens.data()), sizeof len));
  const uint64_t longest = *std::max_element(lens.begin(), lens.end());
  std::vector<uint8_t> block(longest, 0), all(longest * size_t(comm->size()));
  std::copy(mine.begin(), mine.end(), block.begin());
  CPD_RETURN_IF_ERROR(comm->AllGatherBytes(block.data(), all.data(), longest));
  std::vector<std::string> out;
  for (int r = 0; r < comm->size(); ++r) {
    const char* p = reinterpret_cast<const char*>(all.data()) + size_t(r) * longest;
    out.emplace_back(p, lens[size_t(r)]);
  }
  return out;
}

// Rank 0's status, on every rank: the ranks fail (or go on) together, with rank 0's reason.
Status ShareFromRank0(comm::Communicator* comm, const Status& mine) {
  int32_t code = int32_t(mine.code());
  CPD_RETURN_IF_ERROR(comm->BroadcastBytes(reinterpret_cast<uint8_t*>(&code), sizeof code, 0));
  std::string message = mine.message();
  uint64_t len = message.size();
  CPD_RETURN_IF_ERROR(comm->BroadcastBytes(reinterpret_cast<uint8_t*>(&len), sizeof len, 0));
  message.resize(len);
  CPD_RETURN_IF_ERROR(
      comm->BroadcastBytes(reinterpret_cast<uint8_t*>(message.data()), message.size(), 0));
  switch (Status::Code(code)) {
    case Status::Code::kOk:
      return Status::Ok();
    case Status::Code::kInvalidArgument:
      return Status::InvalidArgument(message);
    case Status::Code::kCorruption:
      return Status::Corruption(message);
    default:
      return Status::IoError(message);
  }
}

// Rank 0's list, on every rank.
Result<std::vector<std::string>> BroadcastList(comm::Communicator* comm,
                                               const std::vector<std::string>& list) {
  std::string joined;
  for (const auto& s : list) joined += s + '\n';
  uint64_t len = joined.size();
  CPD_RETURN_IF_ERROR(comm->BroadcastBytes(reinterpret_cast<uint8_t*>(&len), sizeof len, 0));
  joined.resize(len);
  CPD_RETURN_IF_ERROR(
      comm->BroadcastBytes(reinterpret_cast<uint8_t*>(joined.data()), joined.size(), 0));
  std::vector<std::string> out;
  std::istringstream in(joined);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

std::string Duration(double s) {
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof buf, "%dh%02dm", int(s / 3600), int(std::fmod(s, 3600) / 60));
  } else if (s >= 60) {
    std::snprintf(buf, sizeof buf, "%dm%02ds", int(s / 60), int(std::fmod(s, 60)));
  } else {
    std::snprintf(buf, sizeof buf, "%.0fs", s);
  }
  return buf;
}

// One rank's group over all N batches.
Result<std::vector<CandidateResult>> EvaluateGroup(GradientAngleIndicator* indicator,
                                                   const std::vector<Format>& formats,
                                                   Device device, const Dataset& train,
                                                   const FormatSearchOptions& o) {
  std::vector<CandidateAccumulator> acc(formats.size());
  const size_t layers = indicator->layers().size();
  for (auto& a : acc) {
    for (auto& l : a.layer) l.assign(layers, Running{});
  }
  if (!formats.empty()) {
    BatchIterator it(train, o.batch_size, /*shuffle=*/true, /*augment=*/false, o.data_seed,
                     /*drop_last=*/true);
    int64_t epoch = 0;
    it.StartEpoch(epoch);
    Tensor x, x_device;
    std::vector<int32_t> y;
    for (int64_t b = 0; b < o.batches; ++b) {
      if (!it.Next(&x, &y)) {
        it.StartEpoch(++epoch);
        it.Next(&x, &y);
      }
      CPD_RETURN_IF_ERROR(indicator->BeginBatch(StagedOn(x, device, &x_device), y, b));
      CPD_ASSIGN_OR_RETURN(const std::vector<BatchAngles> angles, indicator->Evaluate(formats));
      for (size_t c = 0; c < formats.size(); ++c) {
        for (SiteSet s : o.indicator.sites) {
          acc[c].network[int(s)].Add(angles[c].network[int(s)]);
          for (size_t l = 0; l < layers; ++l)
            acc[c].layer[int(s)][l].Add(angles[c].layer[int(s)][l]);
        }
      }
    }
  }
  std::vector<CandidateResult> out(formats.size());
  for (size_t c = 0; c < formats.size(); ++c) {
    CandidateResult& r = out[c];
    r.spec = formats[c].spec();
    r.bits = formats[c].bits();
    r.family = CandidateFamily(formats[c]);
    for (SiteSet s : o.indicator.sites) {
      const int i = int(s);
      r.has[i] = true;
      r.mean[i] = acc[c].network[i].mean;
      r.std[i] = acc[c].network[i].std();
      for (const Running& l : acc[c].layer[i]) {
        r.layer_mean[i].push_back(l.mean);
        r.layer_std[i].push_back(l.std());
      }
    }
  }
  return out;
}

}  // namespace

std::string CandidateFamily(const Format& f) {
  switch (f.family()) {
    case FormatFamily::kFloat32:
      return "fp32";
    case FormatFamily::kFloat:
      return "float";
    case FormatFamily::kSharedShift:
      return f.scope() == ScaleScope::kBlock ? "block" : "shared-exponent";
    case FormatFamily::kBlockScaled:
      return "block";
    case FormatFamily::kIntSymmetric:
      return "int";
    case FormatFamily::kUintMinMax:
      return "uint";
    case FormatFamily::kBinades:
      return BinadeFamily(f.binade_mbits());
  }
  return "?";
}

Status CheckFormatSearch(const FormatSearchOptions& o) {
  if (o.candidates.empty()) return Status::InvalidArgument("no candidate format to evaluate");
  std::set<std::string> seen;
  for (const std::string& spec : o.candidates) {
    auto f = Format::Parse(spec);
    if (!f.ok()) return Status::InvalidArgument("candidate: " + f.status().message());
    if (!seen.insert(f->spec()).second) {
      return Status::InvalidArgument("candidate '" + spec + "' is listed twice");
    }
  }
  if (o.batches < 1) {
    return Status::InvalidArgument("--batches must be >= 1, got " + std::to_string(o.batches));
  }
  if (o.batch_size < 1) {
    return Status::InvalidArgument("--batch-size must be >= 1, got " +
                                   std::to_string(o.batch_size));
  }
  if (o.group < 1) {
    return Status::InvalidArgument("--group must be >= 1, got " + std::to_string(o.group));
  }
  if (o.indicator.sites.empty()) return Status::InvalidArgument("--sites: no site set");
  if (!o.settings.empty() && !nlohmann::json::parse(o.settings, nullptr, false).is_object()) {
    return Status::InvalidArgument("the search's settings are not a JSON object");
  }
  return Status::Ok();
}

std::string ResultsCsvHeader(const std::vector<std::string>& layers,
                             const std::vector<SiteSet>& sites) {
  std::string h = "spec,bits,family";
  for (SiteSet s : sites)
    h += std::string(",") + SiteSetName(s) + "_deg," + SiteSetName(s) + "_std";
  for (const auto& l : layers) {
    for (SiteSet s : sites) {
      h += "," + l + ":" + SiteSetName(s) + "_deg," + l + ":" + SiteSetName(s) + "_std";
    }
  }
  return h;
}

std::string ResultCsvRow(const CandidateResult& r, const std::vector<SiteSet>& sites) {
  std::string row = Quoted(r.spec) + "," + std::to_string(r.bits) + "," + r.family;
  for (SiteSet s : sites) row += "," + Number(r.mean[int(s)]) + "," + Number(r.std[int(s)]);
  const size_t layers = sites.empty() ? 0 : r.layer_mean[int(sites[0])].size();
  for (size_t l = 0; l < layers; ++l) {
    for (SiteSet s : sites) {
      row += "," + Number(r.layer_mean[int(s)][l]) + "," + Number(r.layer_std[int(s)][l]);
    }
  }
  return row;
}

Result<CandidateResult> ParseResultRow(const std::string& row,
                                       const std::vector<std::string>& layers,
                                       const std::vector<SiteSet>& sites) {
  const std::vector<std::string> f = SplitCsv(row);
  const size_t want = 3 + 2 * sites.size() * (1 + layers.size());
  if (f.size() != want) {
    return Status::InvalidArgument("a row of " + std::to_string(f.size()) + " fields, expected " +
                                   std::to_string(want));
  }
  CandidateResult r;
  auto format = Format::Parse(f[0]);
  if (!format.ok()) {
    return Status::InvalidArgument("spec " + QuoteForMessage(f[0]) + " is not a format spec");
  }
  r.spec = format->spec();
  const std::string& bits = f[1];
  const auto [bits_end, bits_ec] = std::from_chars(bits.data(), bits.data() + bits.size(), r.bits);
  if (bits.empty() || bits_ec != std::errc() || bits_end != bits.data() + bits.size()) {
    return Status::InvalidArgument("bits " + QuoteForMessage(bits) + " is not a whole number");
  }
  if (r.bits != format->bits()) {
    return Status::InvalidArgument("bits " + bits + " do not match " + r.spec + ", a " +
                                   std::to_string(format->bits()) + "-bit format");
  }
  r.family = f[2];
  static const std::set<std::string> kFamilies = {"fp32", "float",  "block", "shared-exponent",
                                                  "int",  "uint",   "fixed", "hybrid",
                                                  "log",  "binades"};
  if (kFamilies.count(r.family) == 0) {
    return Status::InvalidArgument("family " + QuoteForMessage(r.family) +
                                   " is unknown (known: fixed, float, hybrid, log, binades, "
                                   "shared-exponent, block, int, uint, fp32)");
  }
  if (r.family != CandidateFamily(*format)) {
    return Status::InvalidArgument("family " + r.family + " does not match " + r.spec +
                                   ", a format of family " + CandidateFamily(*format));
  }
  // An angle as GradientAngle gives it: a number to the field's end, in [0, 180] degrees. (A
  // spread of values in that range lies in it too.)
  size_t k = 3;
  auto angle = [&](const std::string& column, double* out) -> Status {
    const std::string& text = f[k++];
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
    if (text.empty() || ec != std::errc() || end != text.data() + text.size()) {
      return Status::InvalidArgument(column + " " + QuoteForMessage(text) + " is not a number");
    }
    if (!(*out >= 0.0 && *out <= 180.0)) {
      return Status::InvalidArgument(column + " is " + QuoteForMessage(text) +
                                     ": an angle lies in [0, 180] degrees");
    }
    return Status::Ok();
  };
  for (SiteSet s : sites) {
    const std::string name = SiteSetName(s);
    r.has[int(s)] = true;
    CPD_RETURN_IF_ERROR(angle(name + "_deg", &r.mean[int(s)]));
    CPD_RETURN_IF_ERROR(angle(name + "_std", &r.std[int(s)]));
  }
  for (const std::string& layer : layers) {
    for (SiteSet s : sites) {
      const std::string name = layer + ":" + SiteSetName(s);
      double mean = 0, spread = 0;
      CPD_RETURN_IF_ERROR(angle(name + "_deg", &mean));
      CPD_RETURN_IF_ERROR(angle(name + "_std", &spread));
      r.layer_mean[int(s)].push_back(mean);
      r.layer_std[int(s)].push_back(spread);
    }
  }
  return r;
}

Result<std::vector<CandidateResult>> RunFormatSearch(Sequential* model, Device device,
                                                     const Dataset& train, comm::Communicator* comm,
                                                     const FormatSearchOptions& o) {
  CPD_RETURN_IF_ERROR(CheckFormatSearch(o));
  CPD_ASSIGN_OR_RETURN(auto indicator, GradientAngleIndicator::Create(model, o.indicator));
  const bool lead = comm->rank() == 0;

  // Rank 0 reads what a previous run finished; every rank learns which candidates remain.
  std::vector<CandidateResult> finished;
  PartialFile partial;
  Status opened = Status::Ok();
  if (lead) {
    auto p = PartialFile::Open(o, indicator->layers(), &finished);
    if (p.ok()) {
      partial = std::move(p).value();
    } else {
      opened = p.status();
    }
  }
  CPD_RETURN_IF_ERROR(ShareFromRank0(comm, opened));
  std::vector<std::string> done_specs;
  for (const auto& r : finished) done_specs.push_back(r.spec);
  CPD_ASSIGN_OR_RETURN(done_specs, BroadcastList(comm, done_specs));
  const std::set<std::string> done(done_specs.begin(), done_specs.end());

  std::vector<Format> todo;
  for (const std::string& spec : o.candidates) {
    CPD_ASSIGN_OR_RETURN(Format f, Format::Parse(spec));
    if (done.count(f.spec()) == 0) todo.push_back(f);
  }
  const size_t groups = (todo.size() + size_t(o.group) - 1) / size_t(o.group);
  const size_t ranks = size_t(comm->size());
  const size_t rounds = (groups + ranks - 1) / ranks;
  if (lead && o.progress && !done.empty()) {
    std::printf("resuming: %zu candidate(s) already in %s, %zu to go\n", done.size(),
                o.partial_path.c_str(), todo.size());
    std::fflush(stdout);
  }
  std::map<std::string, CandidateResult> results;
  for (auto& r : finished) results[r.spec] = std::move(r);
  const auto start = Clock::now();
  ProgressLineRate line_rate(o.progress_interval_s, start);
  for (size_t round = 0; round < rounds; ++round) {
    const size_t g = round * ranks + size_t(comm->rank());
    std::vector<Format> mine;
    if (g < groups) {
      const size_t begin = g * size_t(o.group);
      const size_t end = std::min(todo.size(), begin + size_t(o.group));
      mine.assign(todo.begin() + long(begin), todo.begin() + long(end));
    }
    CPD_ASSIGN_OR_RETURN(const std::vector<CandidateResult> got,
                         EvaluateGroup(indicator.get(), mine, device, train, o));
    std::string rows;
    for (const auto& r : got) rows += ResultCsvRow(r, o.indicator.sites) + "\n";
    CPD_ASSIGN_OR_RETURN(const std::vector<std::string> all, GatherStrings(comm, rows));
    if (!lead) continue;
    std::string text;
    for (const std::string& part : all) text += part;  // rank order = group order
    CPD_RETURN_IF_ERROR(partial.Append(text));
    std::istringstream in(text);
    std::string last;
    for (std::string row; std::getline(in, row);) {
      CPD_ASSIGN_OR_RETURN(CandidateResult r,
                           ParseResultRow(row, indicator->layers(), o.indicator.sites));
      last = r.spec;
      results[r.spec] = std::move(r);
    }
    if (o.progress && line_rate.Due(int64_t(round + 1), int64_t(rounds), Clock::now())) {
      const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
      const double eta = elapsed / double(round + 1) * double(rounds - round - 1);
      std::printf("  round %zu/%zu: %zu/%zu candidates, last %s, %s elapsed, ETA %s\n", round + 1,
                  rounds, results.size(), o.candidates.size(), last.c_str(),
                  Duration(elapsed).c_str(), Duration(eta).c_str());
      std::fflush(stdout);
    }
  }
  if (!lead) return std::vector<CandidateResult>{};
  std::vector<CandidateResult> out;
  for (const std::string& spec : o.candidates) {
    CPD_ASSIGN_OR_RETURN(const Format f, Format::Parse(spec));
    out.push_back(results.at(f.spec()));
  }
  return out;
}

}  // namespace cpd::runtime
