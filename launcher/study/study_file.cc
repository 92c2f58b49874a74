#include "launcher/study/study_file.h"

#include <yaml-cpp/yaml.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <map>
#include <set>

#include "cpd/tag.h"
#include "launcher/cli.h"

namespace cpd::launcher::study {

namespace {

Status Bad(const std::string& path, const std::string& msg) {
  return Status::InvalidArgument(path + ": " + msg);
}

// `s` as a message may show it: printable ASCII, other bytes as \\xHH, at most `max` characters
// (a key or a parser's message quotes the user's text, and a control byte or a megabyte of it
// must not reach the terminal).
std::string Shown(const std::string& s, size_t max = 40) {
  std::string out;
  for (unsigned char c : s) {
    if (out.size() >= max) return out + "...";
    if (c >= 0x20 && c < 0x7f) {
      out += char(c);
    } else {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    }
  }
  return out;
}

// yaml-cpp keeps every pair of a mapping but looks a key up by its first one, so a repeated key
// (`lr` twice in the grid, a second `name`) would silently lose its later values. Every mapping
// of the file, at any depth, is checked here before anything reads it. Lines are 1-based.
Status CheckRepeatedKeys(const YAML::Node& node, const std::string& path, int depth) {
  // Deeper than any study file goes; bounds the recursion on hostile input.
  if (depth > 64) return Bad(path, "nested more than 64 levels deep");
  if (node.IsSequence()) {
    for (const auto& item : node) CPD_RETURN_IF_ERROR(CheckRepeatedKeys(item, path, depth + 1));
  } else if (node.IsMap()) {
    std::map<std::string, int> first_line;
    for (const auto& kv : node) {
      if (!kv.first.IsScalar()) {
        return Bad(path, "line " + std::to_string(kv.first.Mark().line + 1) +
                             ": a key must be a plain name, not a list or mapping");
      }
      const int line = kv.first.Mark().line + 1;
      auto [it, added] = first_line.try_emplace(kv.first.Scalar(), line);
      if (!added) {
        return Bad(path, "line " + std::to_string(line) + ": key '" + Shown(kv.first.Scalar()) +
                             "' is repeated (first at line " + std::to_string(it->second) +
                             "); give each key once");
      }
      CPD_RETURN_IF_ERROR(CheckRepeatedKeys(kv.second, path, depth + 1));
    }
  }
  return Status::Ok();
}

// The flag's option in cpd-train's option set, or null when cpd-train has no such flag.
const CLI::Option* FindFlag(const CLI::App& app, const std::string& key) {
  try {
    return app.get_option("--" + key);
  } catch (const CLI::OptionNotFound&) {
    return nullptr;
  }
}

// true/false (and YAML's other spellings) -> "true"/"false"; "" when not a boolean.
std::string NormalBool(const std::string& s) {
  static const std::set<std::string> kTrue = {"true", "True", "TRUE", "yes", "Yes", "on", "On"};
  static const std::set<std::string> kFalse = {"false", "False", "FALSE", "no", "No", "off", "Off"};
  if (kTrue.count(s)) return "true";
  if (kFalse.count(s)) return "false";
  return "";
}

// A scalar, or a list of scalars, as the values given to a flag.
Result<FlagValue> ReadValue(const YAML::Node& n, const std::string& path, const std::string& what,
                            bool boolean) {
  if (boolean && !n.IsScalar()) return Bad(path, what + ": expected true or false");
  auto values = FlagValuesOf(n);
  if (!values.ok()) return Bad(path, what + ": " + values.status().message());
  FlagValue v = std::move(values).value();
  if (v.empty()) return Bad(path, what + ": an empty list");
  if (boolean) {
    v[0] = NormalBool(v[0]);
    if (v[0].empty()) return Bad(path, what + ": expected true or false (a boolean flag)");
  }
  return v;
}

Result<long long> ReadInt(const YAML::Node& n, const std::string& path, const std::string& what,
                          long long lo) {
  long long x = 0;
  if (!n.IsScalar() || !YAML::convert<long long>::decode(n, x) || x < lo) {
    return Bad(path, what + ": expected a whole number >= " + std::to_string(lo));
  }
  return x;
}

// A value of "workers": a whole number >= 1 that divides over the study's ranks.
Status CheckWorkers(const YAML::Node& n, const Study& s, const std::string& what) {
  CPD_ASSIGN_OR_RETURN(const long long w, ReadInt(n, s.path, what, 1));
  if (w % s.ranks != 0) {
    return Bad(s.path, what + ": " + std::to_string(w) + " workers do not divide over ranks " +
                           std::to_string(s.ranks));
  }
  return Status::Ok();
}

// A flag the study may set: cpd-train has it and cpd-study does not own it.
Status CheckKey(const CLI::App& app, const std::string& path, const std::string& where,
                const std::string& key, bool* boolean) {
  *boolean = false;
  if (key == kWorkersKey) return Status::Ok();
  if (key == "seed") return Bad(path, where + " 'seed': give the seeds in 'seeds:'");
  // Flags with which cpd-train exits 0 without training: such a run would end "done" with no
  // epochs, a result that is not one.
  if (key == "print-model" || key == "help" || key == "version") {
    return Bad(path, where + " '" + key + "': cpd-train --" + key +
                         " trains nothing, so a study run with it would be done with 0 epochs; "
                         "run cpd-train --" +
                         key + " by itself");
  }
  const auto& owned = DriverOwnedFlags();
  if (std::find(owned.begin(), owned.end(), key) != owned.end()) {
    return Bad(path, where + " '" + key + "': cpd-study sets --" + key + " itself");
  }
  const CLI::Option* opt = FindFlag(app, key);
  if (opt == nullptr) {
    return Bad(path, where + " '" + Shown(key) + "': cpd-train has no flag --" + Shown(key) +
                         " (keys are its long flag names without dashes, or 'workers')");
  }
  *boolean = opt->get_expected_max() == 0;  // add_flag: takes no value
  return Status::Ok();
}

Status ReadBase(const YAML::Node& node, const CLI::App& app, Study* s) {
  if (!node.IsMap()) return Bad(s->path, "base: expected a mapping of flag: value");
  for (const auto& kv : node) {
    const std::string key = kv.first.as<std::string>();
    bool boolean = false;
    CPD_RETURN_IF_ERROR(CheckKey(app, s->path, "base:", key, &boolean));
    CPD_ASSIGN_OR_RETURN(FlagValue v,
                         ReadValue(kv.second, s->path, "base: '" + key + "'", boolean));
    if (key == kWorkersKey) CPD_RETURN_IF_ERROR(CheckWorkers(kv.second, *s, "base: 'workers'"));
    s->base.push_back({key, std::move(v)});
    s->base_boolean.push_back(boolean);
  }
  return Status::Ok();
}

Status ReadGrid(const YAML::Node& node, const CLI::App& app, Study* s) {
  if (!node.IsMap() || node.size() == 0) {
    return Bad(s->path, "grid: expected a non-empty mapping of flag: [values]");
  }
  for (const auto& kv : node) {
    Axis a;
    a.name = kv.first.as<std::string>();
    const std::string where = "grid: '" + a.name + "'";
    CPD_RETURN_IF_ERROR(CheckKey(app, s->path, "grid:", a.name, &a.boolean));
    for (const auto& b : s->base) {
      if (b.key == a.name) return Bad(s->path, where + " is also in base: give it in one place");
    }
    if (!kv.second.IsSequence() || kv.second.size() == 0) {
      return Bad(s->path, where + ": expected a non-empty list of values");
    }
    std::set<std::string> labels;
    for (size_t i = 0; i < kv.second.size(); ++i) {
      const std::string what = where + " value " + std::to_string(i + 1);
      CPD_ASSIGN_OR_RETURN(FlagValue v, ReadValue(kv.second[i], s->path, what, a.boolean));
      if (a.name == kWorkersKey) CPD_RETURN_IF_ERROR(CheckWorkers(kv.second[i], *s, what));
      if (!labels.insert(ValueLabel(v, a.boolean)).second) {
        return Bad(s->path, what + ": '" + ValueLabel(v, a.boolean) +
                                "' repeats a value (as run names spell it)");
      }
      a.values.push_back(std::move(v));
    }
    s->axes.push_back(std::move(a));
  }
  return Status::Ok();
}

Status ReadSeeds(const YAML::Node& node, Study* s) {
  if (!node.IsSequence() || node.size() == 0) {
    return Bad(s->path, "seeds: expected a non-empty list of whole numbers");
  }
  for (size_t i = 0; i < node.size(); ++i) {
    CPD_ASSIGN_OR_RETURN(const long long seed,
                         ReadInt(node[i], s->path, "seeds: value " + std::to_string(i + 1), 0));
    if (std::find(s->seeds.begin(), s->seeds.end(), seed) != s->seeds.end()) {
      return Bad(s->path, "seeds: " + std::to_string(seed) + " is listed twice");
    }
    s->seeds.push_back(seed);
  }
  return Status::Ok();
}

Status ReadExclude(const YAML::Node& node, Study* s) {
  if (!node.IsSequence()) return Bad(s->path, "exclude: expected a list of {axis: value} entries");
  for (size_t i = 0; i < node.size(); ++i) {
    const std::string where = "exclude: entry " + std::to_string(i + 1);
    if (!node[i].IsMap() || node[i].size() == 0) {
      return Bad(s->path, where + ": expected a non-empty mapping of axis: value");
    }
    Exclusion e;
    for (const auto& kv : node[i]) {
      const std::string key = kv.first.as<std::string>();
      if (key == "seed") {
        CPD_ASSIGN_OR_RETURN(const long long seed,
                             ReadInt(kv.second, s->path, where + " 'seed'", 0));
        e.match.push_back({key, std::to_string(seed)});
        continue;
      }
      auto axis = std::find_if(s->axes.begin(), s->axes.end(),
                               [&](const Axis& a) { return a.name == key; });
      if (axis == s->axes.end()) {
        return Bad(s->path, where + ": '" + key + "' is not an axis of the grid (or 'seed')");
      }
      CPD_ASSIGN_OR_RETURN(FlagValue v,
                           ReadValue(kv.second, s->path, where + " '" + key + "'", axis->boolean));
      const std::string label = ValueLabel(v, axis->boolean);
      bool known = false;
      for (const auto& av : axis->values) known = known || ValueLabel(av, axis->boolean) == label;
      if (!known) {
        return Bad(s->path, where + " '" + key + "': '" + label + "' is not one of its values");
      }
      e.match.push_back({key, label});
    }
    s->exclude.push_back(std::move(e));
  }
  return Status::Ok();
}

Status ReadStudy(const YAML::Node& root, Study* s) {
  if (!root.IsMap()) return Bad(s->path, "expected a mapping (name, ranks, base, grid, seeds)");
  CPD_RETURN_IF_ERROR(CheckRepeatedKeys(root, s->path, 0));
  static const std::set<std::string> kKeys = {"name", "ranks", "base", "grid", "seeds", "exclude"};
  for (const auto& kv : root) {
    const std::string key = kv.first.as<std::string>();
    if (!kKeys.count(key)) {
      return Bad(s->path, "unknown key '" + Shown(key) +
                              "' (accepted: name, ranks, base, grid, seeds, exclude)");
    }
  }
  // The study's name is its coordinator tag.
  if (!root["name"] || !root["name"].IsScalar() ||
      !IsTag(root["name"].as<std::string>(), kMaxStudyNameLength)) {
    return Bad(s->path, "name: expected 1 to " + std::to_string(kMaxStudyNameLength) + " of " +
                            kTagCharacters);
  }
  s->name = root["name"].as<std::string>();
  // The name is a folder (studies/<name>) and a file-name prefix: "." and ".." are tag
  // characters but would put the runs and the report into an existing folder.
  if (s->name == "." || s->name == "..") {
    return Bad(s->path, "name: '" + s->name +
                            "' is not a folder name of its own (the output goes to "
                            "studies/<name>); use letters, digits, '_' or '-' too");
  }
  if (root["ranks"]) {
    CPD_ASSIGN_OR_RETURN(const long long r, ReadInt(root["ranks"], s->path, "ranks", 1));
    if (r > 4096) return Bad(s->path, "ranks: expected a whole number from 1 to 4096");
    s->ranks = int(r);
  }
  CLI::App app;
  TrainFlags flags;
  runtime::TrainOptions options;
  AddTrainOptions(&app, &options, &flags);
  if (root["base"]) CPD_RETURN_IF_ERROR(ReadBase(root["base"], app, s));
  if (!root["grid"]) return Bad(s->path, "grid: missing (a mapping of flag: [values])");
  CPD_RETURN_IF_ERROR(ReadGrid(root["grid"], app, s));
  bool workers = false, emulate = false;
  for (const auto& b : s->base) {
    workers = workers || b.key == kWorkersKey;
    emulate = emulate || b.key == "emulate-ranks";
  }
  for (const auto& a : s->axes) {
    workers = workers || a.name == kWorkersKey;
    emulate = emulate || a.name == "emulate-ranks";
  }
  if (workers && emulate) {
    return Bad(s->path,
               "'workers' and 'emulate-ranks' exclude each other (workers sets "
               "--emulate-ranks to workers / ranks)");
  }
  if (root["seeds"]) {
    CPD_RETURN_IF_ERROR(ReadSeeds(root["seeds"], s));
  } else {
    s->seeds = {1};
  }
  if (root["exclude"]) CPD_RETURN_IF_ERROR(ReadExclude(root["exclude"], s));
  return Status::Ok();
}

}  // namespace

const std::vector<std::string>& DriverOwnedFlags() {
  static const std::vector<std::string> kOwned = {
      "config", "resume", "checkpoint-dir", "metrics-out", "coordinator", "job-name", "study"};
  return kOwned;
}

std::string ValueLabel(const FlagValue& v, bool boolean) {
  if (boolean) return v[0] == "true" ? "on" : "off";
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) out += '-';
    for (char c : v[i]) {
      const bool keep = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') ||
                        (c >= '0' && c <= '9') || c == '.' || c == '-';
      out += keep ? c : '-';
    }
  }
  return out.empty() ? "-" : out;
}

Result<Study> ParseStudy(const std::string& yaml, const std::string& path) {
  Study s;
  s.path = path;
  try {
    CPD_RETURN_IF_ERROR(ReadStudy(YAML::Load(yaml), &s));
  } catch (const YAML::Exception& e) {
    // yaml-cpp quotes the offending byte ("unknown escape character: " and a newline).
    return Bad(path, Shown(e.what(), 200));
  }
  return s;
}

Result<Study> LoadStudy(const std::string& path) {
  auto text = ReadWholeFile(path);
  if (!text.ok()) return Status::InvalidArgument(text.status().message());
  return ParseStudy(*text, path);
}

}  // namespace cpd::launcher::study
