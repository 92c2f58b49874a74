// A cheap success-or-error value for library code (after leveldb's Status). Exceptions and exit
// codes belong at program edges only.
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace cpd {

class Status {
 public:
  enum class Code {
    kOk = 0,
    kInvalidArgument,
    kOutOfRange,
    kNotFound,
    kIoError,
    kCorruption,
    kUnavailable,
    kInternal
  };

  Status() = default;
  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string msg) {
    return Status(Code::kInvalidArgument, std::move(msg));
  }
  static Status OutOfRange(std::string msg) { return Status(Code::kOutOfRange, std::move(msg)); }
  static Status NotFound(std::string msg) { return Status(Code::kNotFound, std::move(msg)); }
  static Status IoError(std::string msg) { return Status(Code::kIoError, std::move(msg)); }
  static Status Corruption(std::string msg) { return Status(Code::kCorruption, std::move(msg)); }
  static Status Unavailable(std::string msg) { return Status(Code::kUnavailable, std::move(msg)); }
  static Status Internal(std::string msg) { return Status(Code::kInternal, std::move(msg)); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const { return ok() ? "OK" : message_; }

 private:
  Status(Code code, std::string msg) : code_(code), message_(std::move(msg)) {}
  Code code_ = Code::kOk;
  std::string message_;
};

// A value or the Status explaining why there is none.
template <typename T>
class Result {
 public:
  Result(T value) : v_(std::move(value)) {}         // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {}  // NOLINT: must not be ok()
  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  const T& value() const& { return std::get<T>(v_); }
  T& value() & { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  const T& operator*() const& { return value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

#define CPD_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::cpd::Status _cpd_status = (expr);        \
    if (!_cpd_status.ok()) return _cpd_status; \
  } while (0)

// Evaluates `expr`, a Result<T>: on error, returns its Status from the enclosing function (which
// returns a Status or a Result); else declares or assigns `lhs` from the value:
//   CPD_ASSIGN_OR_RETURN(auto model, BuildModel(...));
//   CPD_ASSIGN_OR_RETURN(run.device, ResolveDevice(flag));
// It expands to several statements: not for the body of an unbraced if or loop.
#define CPD_ASSIGN_OR_RETURN(lhs, expr) \
  CPD_ASSIGN_OR_RETURN_IMPL_(CPD_STATUS_CONCAT_(_cpd_result_, __LINE__), lhs, expr)
#define CPD_ASSIGN_OR_RETURN_IMPL_(result, lhs, expr) \
  auto result = (expr);                               \
  if (!result.ok()) return result.status();           \
  lhs = std::move(result).value()
#define CPD_STATUS_CONCAT_(a, b) CPD_STATUS_CONCAT_INNER_(a, b)
#define CPD_STATUS_CONCAT_INNER_(a, b) a##b

}  // namespace cpd
