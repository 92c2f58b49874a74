#include "launcher/study/out_dir.h"

#include <filesystem>
#include <set>

#include "launcher/files.h"

namespace cpd::launcher::study {

namespace {

namespace fs = std::filesystem;

// Whether `dir` holds only what a cpd-study without the marker wrote: a runs/ folder, perhaps
// report/ and slurm/ folders, nothing else.
bool LooksLikeEarlierOutput(const std::string& dir) {
  static const std::set<std::string> kOurs = {"runs", "report", "slurm"};
  std::error_code ec;
  bool runs = false;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    std::error_code type_ec;
    if (!kOurs.count(name) || !e.is_directory(type_ec) || e.is_symlink(type_ec)) return false;
    runs = runs || name == "runs";
  }
  return !ec && runs;
}

}  // namespace

Status ClaimOutDir(const std::string& out, const std::string& study_name) {
  const std::string marker = out + "/" + kOutMarker;
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(out, ec);
  if (fs::exists(st) && !fs::is_directory(fs::status(out, ec))) {
    return Status::InvalidArgument("--out " + out + ": exists and is not a folder");
  }
  if (fs::is_regular_file(fs::symlink_status(marker, ec))) return Status::Ok();
  if (fs::exists(st)) {
    const bool empty = fs::is_empty(out, ec);
    if (ec) return Status::IoError("cannot read the folder " + out + ": " + ec.message());
    if (!empty && !LooksLikeEarlierOutput(out)) {
      return Status::InvalidArgument(
          "--out " + out +
          ": the folder exists, is not empty and was not created by cpd-study (no " + kOutMarker +
          " in it); cpd-study writes only into its own folders: give --out a new or "
          "empty folder");
    }
  } else {
    fs::create_directories(out, ec);
    if (ec) return Status::IoError("cannot create " + out + ": " + ec.message());
  }
  return WriteFileAtomically(marker, "cpd-study output of study " + study_name + "\n");
}

}  // namespace cpd::launcher::study
