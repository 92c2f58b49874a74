// The coordinator's one validating path (launcher/coordinator/validate.*) on every request a
// client can send: the first byte picks the request, the rest is its protobuf wire form. Each
// is checked with the function the service calls for it. Nothing may crash or throw, and a
// refusal is always InvalidArgument: Internal means a fast check refused what no described
// check does (validate.cc's own consistency alarm).
#include <google/protobuf/stubs/logging.h>

#include <cstdint>
#include <string>

#include "launcher/coordinator/validate.h"
#include "proto/cpd/v1/coordinator.pb.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

namespace v1 = cpd::v1;
using cpd::Status;
using cpd::coordinator::LayerNames;
using cpd::coordinator::Limits;

void Expect(const Status& s, const char* request) {
  CPD_FUZZ_CHECK(s.ok() || s.code() == Status::Code::kInvalidArgument,
                 std::string(request) + ": " + s.message());
}

template <typename M>
bool Parse(M* m, const std::string& bytes) {
  return m->ParseFromString(bytes);
}

}  // namespace

// Protobuf logs every string field that is not UTF-8 as an ERROR line: millions of lines.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const Limits limits;
  const std::string bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 9) {
    case 0: {
      v1::RegisterJobRequest r;
      if (Parse(&r, bytes)) Expect(cpd::coordinator::ValidateRegister(r, limits), "RegisterJob");
      break;
    }
    case 1: {
      v1::StatsReport r;
      if (Parse(&r, bytes)) Expect(cpd::coordinator::ValidateReport(r, limits), "ReportStats");
      break;
    }
    case 2:
    case 3: {
      // SetSchedule, against a job that registered no layers and one that registered some.
      v1::SetScheduleRequest r;
      if (!Parse(&r, bytes)) break;
      Expect(cpd::coordinator::ValidateJobRef(r.job(), "job", limits), "SetSchedule.job");
      const LayerNames names = data[0] % 9 == 2 ? LayerNames{} : LayerNames{"fc1", "fc2", "conv1"};
      Expect(cpd::coordinator::ValidateSchedule(r.schedule(), "schedule", names, limits),
             "SetSchedule.schedule");
      break;
    }
    case 4: {
      v1::LayerStatsRequest r;
      if (Parse(&r, bytes)) {
        Expect(cpd::coordinator::ValidateLayerStatsRequest(r, limits), "LayerStats");
      }
      break;
    }
    case 5: {
      v1::JobHistoryRequest r;
      if (Parse(&r, bytes)) {
        Expect(cpd::coordinator::ValidateJobHistoryRequest(r, limits), "JobHistory");
      }
      break;
    }
    case 6: {
      // JobStatus, GetSchedule and WatchJob name their job by a JobRef.
      v1::JobRef r;
      if (Parse(&r, bytes)) Expect(cpd::coordinator::ValidateJobRef(r, "job", limits), "JobRef");
      break;
    }
    case 7: {
      v1::RegisterJobRequest r;  // a schedule as a worker registers it
      if (Parse(&r, bytes)) {
        Expect(cpd::coordinator::ValidateSchedule(r.schedule(), "schedule", {}, limits),
               "RegisterJob.schedule");
      }
      break;
    }
    default:
      Expect(cpd::coordinator::ValidateJobName(bytes, limits), "job_name");
      break;
  }
  return 0;
}
