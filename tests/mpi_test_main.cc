// The main of every multi-process test suite (see tests/mpi_test_main.h).
#include "tests/mpi_test_main.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

namespace cpd::test {
namespace {

std::unique_ptr<comm::Communicator> g_world;

// Ranks other than 0 print only their failures, each line naming the rank: the output reads like
// one process's, and a failure on any rank still shows where it happened.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  // The test's name is kept here: OnTestPartResult runs under GoogleTest's lock, where asking
  // the UnitTest for the current test would deadlock.
  void OnTestStart(const ::testing::TestInfo& test) override {
    test_ = std::string(test.test_suite_name()) + "." + test.name();
  }
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s: %s:%d: %s\n", rank_, test_.c_str(),
                 r.file_name() != nullptr ? r.file_name() : "?", r.line_number(), r.summary());
  }

 private:
  int rank_;
  std::string test_;
};

}  // namespace

comm::Communicator* World() { return g_world.get(); }
#if CPD_WITH_MPI
comm::MpiCommunicator* MpiWorld() { return static_cast<comm::MpiCommunicator*>(g_world.get()); }
#endif

}  // namespace cpd::test

int main(int argc, char** argv) {
  const char* program = argc > 0 ? argv[0] : "test";
#if CPD_WITH_MPI
  auto created = cpd::comm::MpiCommunicator::Create();
  if (!created.ok()) {
    std::fprintf(stderr, "%s: %s\n", program, created.status().ToString().c_str());
    return 1;
  }
  cpd::test::g_world = std::move(created).value();
#else
  cpd::test::g_world = std::make_unique<cpd::comm::SelfCommunicator>();
#endif
  cpd::comm::Communicator* world = cpd::test::g_world.get();
  ::testing::InitGoogleTest(&argc, argv);
  if (world->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new cpd::test::FailurePrinter(world->rank()));
  }
  // Every rank returns the same result: failed if any rank failed.
  std::int32_t failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  const cpd::Status s = world->AllReduce(&failed, 1, cpd::comm::ReduceOp::kMax);
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", program, s.ToString().c_str());
    failed = 1;
  }
  if (failed != 0 && world->rank() == 0) std::fprintf(stderr, "%s: FAILED on some rank\n", program);
  cpd::test::g_world.reset();  // finalises MPI
  return failed;
}
