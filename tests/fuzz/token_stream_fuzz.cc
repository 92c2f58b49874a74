// The GPT-2 token files of --dataset tokens (runtime/train/token_data.h's ReadTokenFile): the
// input is the file's bytes, nanoGPT's raw uint16 or llm.c's header and tokens. Nothing may crash
// or throw; an accepted file gives exactly the tokens its bytes hold after the header, each below
// the vocabulary, and a pair of accepted streams gives windows whose labels are the next tokens;
// a refusal is one line starting with the path.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "runtime/train/data.h"
#include "runtime/train/token_data.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  const std::string path = cpd::fuzz::ScratchDir() + "/train.bin";
  cpd::fuzz::WriteFile(path, bytes);
  const auto r = cpd::runtime::ReadTokenFile(path);
  if (!r.ok()) {
    const std::string& m = r.status().message();
    CPD_FUZZ_CHECK(m.rfind(path + ": ", 0) == 0, m);
    CPD_FUZZ_CHECK(m.find('\n') == std::string::npos, m);
    return 0;
  }
  const std::vector<uint16_t>& tokens = *r;
  int32_t magic = 0;
  if (size >= 4) std::memcpy(&magic, data, 4);
  const size_t begin = size >= 4 && magic == cpd::runtime::kLlmcMagic ? 1024 : 0;
  CPD_FUZZ_CHECK(size == begin + 2 * tokens.size(), "the tokens do not account for the file");
  for (size_t i = 0; i < tokens.size(); ++i) {
    uint16_t t;
    std::memcpy(&t, data + begin + 2 * i, 2);
    CPD_FUZZ_CHECK(t == tokens[i] && t < cpd::runtime::kGpt2Vocab, "token " + std::to_string(i));
  }
  // The stream as both halves of a dataset: every label of a window is its next token.
  const int64_t block = 1 + int64_t(size % 7);
  auto pair = cpd::runtime::MakeTokenPair("fuzz", tokens, tokens, cpd::runtime::kGpt2Vocab, false,
                                          {block, 0});
  if (int64_t(tokens.size()) < block + 1) {
    CPD_FUZZ_CHECK(!pair.ok(), "a stream shorter than a window was accepted");
    return 0;
  }
  CPD_FUZZ_CHECK(pair.ok(), pair.status().message());
  for (const cpd::runtime::Dataset* d : {&pair->first, &pair->second}) {
    cpd::runtime::BatchIterator it(*d, 3, true, false, size, false);
    it.StartEpoch(0);
    cpd::runtime::Tensor x;
    std::vector<int32_t> y;
    CPD_FUZZ_CHECK(it.Next(&x, &y), "no batch");
    for (int64_t i = 0; i < x.dim(0); ++i) {
      for (int64_t t = 0; t + 1 < block; ++t) {
        CPD_FUZZ_CHECK(int32_t(x.data()[i * block + t + 1]) == y[size_t(i * block + t)],
                       "a label is not the next token");
      }
    }
  }
  return 0;
}
