// The checkpoint reader on raw files: any bytes. Almost every input dies at the magic or the
// CRC; the structure-aware target (checkpoint_fuzz.cc) gets past them. Nothing may crash, throw
// or hang, and a refusal is always the one "checkpoint FILE is corrupt: ...; refusing it".
#include <cstdint>
#include <string>

#include "runtime/train/checkpoint.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = cpd::fuzz::ScratchDir() + "/raw.cpd";
  cpd::fuzz::WriteFile(path, std::string(reinterpret_cast<const char*>(data), size));
  auto ck = cpd::runtime::ReadCheckpoint(path);
  if (!ck.ok()) {
    CPD_FUZZ_CHECK(ck.status().code() == cpd::Status::Code::kCorruption, ck.status().message());
    CPD_FUZZ_CHECK(ck.status().message().find(" is corrupt: ") != std::string::npos,
                   ck.status().message());
  }
  return 0;
}
