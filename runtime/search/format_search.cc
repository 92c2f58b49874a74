#include "runtime/search/format_search.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "cpd/candidates.h"

namespace cpd::runtime {

namespace {

using Clock = std::chrono::steady_clock;

constexpr char kSettingsPrefix[] = "# cpd-format-search: ";

std::string Errno() { return std::strerror(errno); }

bool Exists(const std::string& path) {
  struct stat sb;
  return ::stat(path.c_str(), &sb) == 0;
}

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

// The partial-results file: a settings line, the header, one row per finished candidate.
class PartialFile {
 public:
  // Reads what a previous run left (resume) or creates the file; rank 0 only.
  static Result<PartialFile> Open(const FormatSearchOptions& o, const std::string& header,
                                  size_t layers, std::vector<CandidateResult>* done) {
    PartialFile f;
    f.path_ = o.partial_path;
    if (f.path_.empty()) return f;
    if (Exists(f.path_)) {
      if (!o.resume) {
        return Status::InvalidArgument(f.path_ +
                                       " exists: an interrupted search left it; --resume "
                                       "continues it (or remove the file to start again)");
      }
      CPD_RETURN_IF_ERROR(Read(o, header, layers, done));
    } else {
      std::string head = kSettingsPrefix + o.settings + "\n" + header + "\n";
      CPD_RETURN_IF_ERROR(f.Append(head));
    }
    return f;
  }

  // Appends and syncs: a row on disk is a finished candidate.
  Status Append(const std::string& text) const {
    if (path_.empty() || text.empty()) return Status::Ok();
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) return Status::IoError("cannot open " + path_ + ": " + Errno());
    size_t off = 0;
    while (off < text.size()) {
      const ssize_t w = ::write(fd, text.data() + off, text.size() - off);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        const std::string err = Errno();
        ::close(fd);
        return Status::IoError("writing " + path_ + ": " + err);
      }
      off += size_t(w);
    }
    const bool synced = ::fsync(fd) == 0;
    const std::string err = synced ? "" : Errno();
    if (::close(fd) != 0 || !synced) {
      return Status::IoError("writing " + path_ + ": " + (synced ? Errno() : err));
    }
    return Status::Ok();
  }

 private:
  static Status Read(const FormatSearchOptions& o, const std::string& header, size_t layers,
                     std::vector<CandidateResult>* done) {
    std::ifstream in(o.partial_path);
    if (!in) return Status::IoError("cannot read " + o.partial_path + ": " + Errno());
    std::string settings, head, row;
    std::getline(in, settings);
    std::getline(in, head);
    if (settings != kSettingsPrefix + o.settings || head != header) {
      return Status::InvalidArgument(o.partial_path + " holds a search with other settings (" +
                                     settings.substr(0, 200) +
                                     "); give another --out, or remove the file to start again");
    }
    int line = 2;
    while (std::getline(in, row)) {
      ++line;
      if (row.empty()) continue;
      auto r = ParseResultRow(row, layers, o.indicator.sites);
      // A row cut short by a crash is the only row that can be bad: the last one.
      if (!r.ok()) {
        if (in.peek() == EOF) break;
        return Status::Corruption(o.partial_path + ":" + std::to_string(line) + ": " +
                                  r.status().message());
      }
      done->push_back(std::move(r).value());
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

Result<CandidateResult> ParseResultRow(const std::string& row, size_t layers,
                                       const std::vector<SiteSet>& sites) {
  const std::vector<std::string> f = SplitCsv(row);
  const size_t want = 3 + 2 * sites.size() * (1 + layers);
  if (f.size() != want) {
    return Status::Corruption("a row of " + std::to_string(f.size()) + " fields, expected " +
                              std::to_string(want));
  }
  CandidateResult r;
  r.spec = f[0];
  r.family = f[2];
  try {
    size_t k = 1;
    r.bits = std::stoi(f[k++]);
    ++k;  // family
    for (SiteSet s : sites) {
      r.has[int(s)] = true;
      r.mean[int(s)] = std::stod(f[k++]);
      r.std[int(s)] = std::stod(f[k++]);
    }
    for (size_t l = 0; l < layers; ++l) {
      for (SiteSet s : sites) {
        r.layer_mean[int(s)].push_back(std::stod(f[k++]));
        r.layer_std[int(s)].push_back(std::stod(f[k++]));
      }
    }
  } catch (const std::exception&) {
    return Status::Corruption("a field of the row is not a number");
  }
  return r;
}

Result<std::vector<CandidateResult>> RunFormatSearch(Sequential* model, Device device,
                                                     const Dataset& train, comm::Communicator* comm,
                                                     const FormatSearchOptions& o) {
  CPD_RETURN_IF_ERROR(CheckFormatSearch(o));
  CPD_ASSIGN_OR_RETURN(auto indicator, GradientAngleIndicator::Create(model, o.indicator));
  const std::string header = ResultsCsvHeader(indicator->layers(), o.indicator.sites);
  const bool lead = comm->rank() == 0;

  // Rank 0 reads what a previous run finished; every rank learns which candidates remain.
  std::vector<CandidateResult> finished;
  PartialFile partial;
  Status opened = Status::Ok();
  if (lead) {
    auto p = PartialFile::Open(o, header, indicator->layers().size(), &finished);
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
                           ParseResultRow(row, indicator->layers().size(), o.indicator.sites));
      last = r.spec;
      results[r.spec] = std::move(r);
    }
    if (o.progress) {
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
