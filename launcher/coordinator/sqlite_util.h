// The SQLite plumbing of the coordinator's store: errors that name the failing call, prepared
// statements, transactions and connections. Include only from the store's source files.
#pragma once

#include <sqlite3.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "cpd/status.h"

namespace cpd::coordinator {

// The database's own error text, the failing call and where it was made.
Status SqlError(sqlite3* db, int rc, const char* expr, const char* file, int line);

// Returns SqlError from the enclosing function unless `expr` (an sqlite3_* call) is SQLITE_OK.
#define CPD_SQL(db, expr)                                                        \
  do {                                                                           \
    const int _rc = (expr);                                                      \
    if (_rc != SQLITE_OK) return SqlError((db), _rc, #expr, __FILE__, __LINE__); \
  } while (0)

namespace internal {

// A prepared statement, finalised on scope exit.
class Stmt {
 public:
  Stmt() = default;
  ~Stmt() { sqlite3_finalize(stmt_); }
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;

  Status Prepare(sqlite3* db, const char* sql) {
    db_ = db;
    sqlite3_finalize(stmt_);
    stmt_ = nullptr;
    CPD_SQL(db, sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr));
    return Status::Ok();
  }
  sqlite3_stmt* get() const { return stmt_; }
  void Int(int i, int64_t v) { sqlite3_bind_int64(stmt_, i, v); }
  void Text(int i, std::string_view s) {
    sqlite3_bind_text(stmt_, i, s.data(), int(s.size()), SQLITE_TRANSIENT);
  }
  void Blob(int i, std::string_view s) {
    sqlite3_bind_blob(stmt_, i, s.data(), int(s.size()), SQLITE_STATIC);
  }
  // SQLITE_ROW -> true, SQLITE_DONE -> false, else the error.
  Result<bool> Step() {
    const int rc = sqlite3_step(stmt_);
    if (rc == SQLITE_ROW) return true;
    if (rc == SQLITE_DONE) return false;
    return SqlError(db_, rc, "sqlite3_step", __FILE__, __LINE__);
  }
  Status Run() {
    CPD_RETURN_IF_ERROR(Step().status());
    sqlite3_reset(stmt_);
    sqlite3_clear_bindings(stmt_);
    return Status::Ok();
  }
  int64_t ColInt(int c) const { return sqlite3_column_int64(stmt_, c); }
  std::string ColText(int c) const {
    const auto* p = reinterpret_cast<const char*>(sqlite3_column_text(stmt_, c));
    return p != nullptr ? std::string(p, size_t(sqlite3_column_bytes(stmt_, c))) : std::string();
  }
  std::string_view ColBlob(int c) const {
    const auto* p = static_cast<const char*>(sqlite3_column_blob(stmt_, c));
    return p != nullptr ? std::string_view(p, size_t(sqlite3_column_bytes(stmt_, c)))
                        : std::string_view();
  }

 private:
  sqlite3* db_ = nullptr;
  sqlite3_stmt* stmt_ = nullptr;
};

}  // namespace internal

using internal::Stmt;

// Runs `sql` (one or more statements without results).
Status Exec(sqlite3* db, const char* sql);

// Rolls back unless Commit() was reached.
class Transaction {
 public:
  explicit Transaction(sqlite3* db) : db_(db) {}
  ~Transaction() {
    if (open_) sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
  }
  Status Begin() {
    CPD_RETURN_IF_ERROR(Exec(db_, "BEGIN IMMEDIATE"));
    open_ = true;
    return Status::Ok();
  }
  Status Commit() {
    CPD_RETURN_IF_ERROR(Exec(db_, "COMMIT"));
    open_ = false;
    return Status::Ok();
  }

 private:
  sqlite3* db_;
  bool open_ = false;
};

// A connection to `path` (created when `create`) with the store's settings.
Result<sqlite3*> OpenConnection(const std::string& path, int busy_timeout_ms, bool create);

}  // namespace cpd::coordinator
