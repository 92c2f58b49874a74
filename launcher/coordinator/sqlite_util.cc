#include "launcher/coordinator/sqlite_util.h"

#include <cstring>
#include <utility>

namespace cpd::coordinator {

Status SqlError(sqlite3* db, int rc, const char* expr, const char* file, int line) {
  const char* msg = db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
  const char* base = std::strrchr(file, '/');
  std::string where = std::string(base != nullptr ? base + 1 : file) + ":" + std::to_string(line);
  std::string text = std::string("database: ") + msg + " (" + expr + " at " + where + ")";
  if (rc == SQLITE_FULL) text += "; the disk is full: free space or lower --max-reports-per-job";
  if (rc == SQLITE_BUSY) text += "; another process holds the database";
  return Status::IoError(std::move(text));
}

Status Exec(sqlite3* db, const char* sql) {
  char* err = nullptr;
  const int rc = sqlite3_exec(db, sql, nullptr, nullptr, &err);
  if (rc != SQLITE_OK) {
    std::string msg = std::string("database: ") + (err != nullptr ? err : sqlite3_errstr(rc)) +
                      " (in: " + sql + ")";
    sqlite3_free(err);
    if (rc == SQLITE_FULL) msg += "; the disk is full";
    return Status::IoError(std::move(msg));
  }
  return Status::Ok();
}

Result<sqlite3*> OpenConnection(const std::string& path, int busy_timeout_ms, bool create) {
  sqlite3* db = nullptr;
  const int flags = SQLITE_OPEN_READWRITE | (create ? SQLITE_OPEN_CREATE : 0) | SQLITE_OPEN_NOMUTEX;
  const int rc = sqlite3_open_v2(path.c_str(), &db, flags, nullptr);
  if (rc != SQLITE_OK) {
    std::string msg = "cannot open database '" + path +
                      "': " + (db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc));
    sqlite3_close(db);
    return Status::IoError(msg + " (check that the directory exists and is writable)");
  }
  sqlite3_busy_timeout(db, busy_timeout_ms);
  sqlite3_extended_result_codes(db, 0);
  return db;
}

}  // namespace cpd::coordinator
