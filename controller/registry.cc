#include "controller/registry.h"

#include <sqlite3.h>

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace moelora {
namespace {

// RAII for a prepared statement.
class Stmt {
 public:
  Stmt(sqlite3* db, const char* sql) {
    ok_ = sqlite3_prepare_v2(db, sql, -1, &s_, nullptr) == SQLITE_OK;
  }
  ~Stmt() { sqlite3_finalize(s_); }
  bool ok() const { return ok_; }
  sqlite3_stmt* get() { return s_; }

 private:
  sqlite3_stmt* s_ = nullptr;
  bool ok_ = false;
};

constexpr const char* kColumns =
    "id, name, path, resolved_path, requested_format, detected_format, converted_to_2d, rank, "
    "max_rank, alpha, scaling, target_modules, num_experts, bytes, load_seconds, pinned";

AdapterRecord Read(sqlite3_stmt* s) {
  AdapterRecord r;
  auto text = [&](int i) {
    const unsigned char* t = sqlite3_column_text(s, i);
    return t ? std::string(reinterpret_cast<const char*>(t)) : std::string();
  };
  r.id = sqlite3_column_int64(s, 0);
  r.name = text(1);
  r.path = text(2);
  r.resolved_path = text(3);
  r.requested_format = sqlite3_column_int(s, 4);
  r.detected_format = sqlite3_column_int(s, 5);
  r.converted_to_2d = sqlite3_column_int(s, 6) != 0;
  r.rank = sqlite3_column_int(s, 7);
  r.max_rank = sqlite3_column_int(s, 8);
  r.alpha = sqlite3_column_double(s, 9);
  r.scaling = sqlite3_column_double(s, 10);
  const nlohmann::json tm = nlohmann::json::parse(text(11), nullptr, /*allow_exceptions=*/false);
  if (tm.is_array()) {
    for (const auto& m : tm) {
      if (m.is_string()) r.target_modules.push_back(m.get<std::string>());
    }
  }
  r.num_experts = sqlite3_column_int(s, 12);
  r.bytes = sqlite3_column_int64(s, 13);
  r.load_seconds = sqlite3_column_double(s, 14);
  r.pinned = sqlite3_column_int(s, 15) != 0;
  return r;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Registry>> Registry::Open(const std::string& state_dir) {
  std::error_code ec;
  std::filesystem::create_directories(state_dir, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("--state-dir ", state_dir, ": ", ec.message()));
  }
  auto r = std::unique_ptr<Registry>(new Registry());
  r->path_ = state_dir + "/registry.sqlite3";
  MutexLock lock(&r->mu_);  // not shared yet; for the annotations
  if (sqlite3_open(r->path_.c_str(), &r->db_) != SQLITE_OK) {
    return absl::InternalError(absl::StrCat(r->path_, ": ", sqlite3_errmsg(r->db_)));
  }
  const char* schema =
      "PRAGMA journal_mode=WAL;"
      "PRAGMA synchronous=FULL;"
      "CREATE TABLE IF NOT EXISTS adapters ("
      " id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT UNIQUE NOT NULL, path TEXT NOT NULL,"
      " resolved_path TEXT NOT NULL, requested_format INTEGER, detected_format INTEGER,"
      " converted_to_2d INTEGER, rank INTEGER, max_rank INTEGER, alpha REAL, scaling REAL,"
      " target_modules TEXT, num_experts INTEGER, bytes INTEGER, load_seconds REAL,"
      " pinned INTEGER);";
  char* err = nullptr;
  if (sqlite3_exec(r->db_, schema, nullptr, nullptr, &err) != SQLITE_OK) {
    std::string msg = err ? err : "unknown";
    sqlite3_free(err);
    return r->Corrupt(msg);
  }
  // A file that opens but is damaged: refuse it now, not at the first request.
  std::string check;
  sqlite3_exec(
      r->db_, "PRAGMA quick_check;",
      [](void* out, int, char** v, char**) {
        *static_cast<std::string*>(out) += v[0] ? v[0] : "";
        return 0;
      },
      &check, nullptr);
  if (check != "ok") return r->Corrupt(check.empty() ? sqlite3_errmsg(r->db_) : check);
  return r;
}

absl::Status Registry::Corrupt(const std::string& why) const {
  return absl::DataLossError(absl::StrCat(
      "the adapter registry ", path_, " cannot be used (", why,
      "); it is kept as it is for inspection: move it away to start with an empty registry"));
}

absl::Status Registry::Error() const {
  const int rc = sqlite3_extended_errcode(db_) & 0xff;
  const std::string msg = absl::StrCat(path_, ": ", sqlite3_errmsg(db_));
  if (rc == SQLITE_FULL) {
    return absl::ResourceExhaustedError(absl::StrCat(msg, " (the disk under --state-dir is full)"));
  }
  if (rc == SQLITE_CORRUPT || rc == SQLITE_NOTADB) return Corrupt(sqlite3_errmsg(db_));
  return absl::InternalError(msg);
}

Registry::~Registry() { sqlite3_close(db_); }

absl::StatusOr<int64_t> Registry::Insert(const AdapterRecord& a) {
  MutexLock lock(&mu_);
  Stmt s(db_,
         "INSERT INTO adapters (name, path, resolved_path, requested_format, detected_format,"
         " converted_to_2d, rank, max_rank, alpha, scaling, target_modules, num_experts, bytes,"
         " load_seconds, pinned) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)");
  if (!s.ok()) return Error();
  const std::string tm = nlohmann::json(a.target_modules).dump();
  sqlite3_bind_text(s.get(), 1, a.name.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_text(s.get(), 2, a.path.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_text(s.get(), 3, a.resolved_path.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_int(s.get(), 4, a.requested_format);
  sqlite3_bind_int(s.get(), 5, a.detected_format);
  sqlite3_bind_int(s.get(), 6, a.converted_to_2d);
  sqlite3_bind_int(s.get(), 7, a.rank);
  sqlite3_bind_int(s.get(), 8, a.max_rank);
  sqlite3_bind_double(s.get(), 9, a.alpha);
  sqlite3_bind_double(s.get(), 10, a.scaling);
  sqlite3_bind_text(s.get(), 11, tm.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_int(s.get(), 12, a.num_experts);
  sqlite3_bind_int64(s.get(), 13, a.bytes);
  sqlite3_bind_double(s.get(), 14, a.load_seconds);
  sqlite3_bind_int(s.get(), 15, a.pinned);
  const int rc = sqlite3_step(s.get());
  if (rc == SQLITE_CONSTRAINT) {
    return absl::AlreadyExistsError(absl::StrCat("adapter \"", a.name, "\" is already registered"));
  }
  if (rc != SQLITE_DONE) return Error();
  return sqlite3_last_insert_rowid(db_);
}

absl::Status Registry::Update(const AdapterRecord& a) {
  MutexLock lock(&mu_);
  Stmt s(db_,
         "UPDATE adapters SET path=?, resolved_path=?, requested_format=?, detected_format=?,"
         " converted_to_2d=?, rank=?, max_rank=?, alpha=?, scaling=?, target_modules=?,"
         " num_experts=?, bytes=?, load_seconds=?, pinned=? WHERE name=?");
  if (!s.ok()) return Error();
  const std::string tm = nlohmann::json(a.target_modules).dump();
  sqlite3_bind_text(s.get(), 1, a.path.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_text(s.get(), 2, a.resolved_path.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_int(s.get(), 3, a.requested_format);
  sqlite3_bind_int(s.get(), 4, a.detected_format);
  sqlite3_bind_int(s.get(), 5, a.converted_to_2d);
  sqlite3_bind_int(s.get(), 6, a.rank);
  sqlite3_bind_int(s.get(), 7, a.max_rank);
  sqlite3_bind_double(s.get(), 8, a.alpha);
  sqlite3_bind_double(s.get(), 9, a.scaling);
  sqlite3_bind_text(s.get(), 10, tm.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_int(s.get(), 11, a.num_experts);
  sqlite3_bind_int64(s.get(), 12, a.bytes);
  sqlite3_bind_double(s.get(), 13, a.load_seconds);
  sqlite3_bind_int(s.get(), 14, a.pinned);
  sqlite3_bind_text(s.get(), 15, a.name.c_str(), -1, SQLITE_TRANSIENT);
  if (sqlite3_step(s.get()) != SQLITE_DONE) {
    return Error();
  }
  if (sqlite3_changes(db_) == 0) {
    return absl::NotFoundError(absl::StrCat("adapter \"", a.name, "\" is not registered"));
  }
  return absl::OkStatus();
}

absl::Status Registry::Remove(const std::string& name) {
  MutexLock lock(&mu_);
  Stmt s(db_, "DELETE FROM adapters WHERE name = ?");
  if (!s.ok()) return Error();
  sqlite3_bind_text(s.get(), 1, name.c_str(), -1, SQLITE_TRANSIENT);
  if (sqlite3_step(s.get()) != SQLITE_DONE) {
    return Error();
  }
  if (sqlite3_changes(db_) == 0) {
    return absl::NotFoundError(absl::StrCat("adapter \"", name, "\" is not registered"));
  }
  return absl::OkStatus();
}

std::optional<AdapterRecord> Registry::Get(const std::string& name) const {
  MutexLock lock(&mu_);
  Stmt s(db_, absl::StrCat("SELECT ", kColumns, " FROM adapters WHERE name = ?").c_str());
  if (!s.ok()) return std::nullopt;
  sqlite3_bind_text(s.get(), 1, name.c_str(), -1, SQLITE_TRANSIENT);
  if (sqlite3_step(s.get()) != SQLITE_ROW) return std::nullopt;
  return Read(s.get());
}

std::vector<AdapterRecord> Registry::List() const {
  MutexLock lock(&mu_);
  std::vector<AdapterRecord> out;
  Stmt s(db_, absl::StrCat("SELECT ", kColumns, " FROM adapters ORDER BY id").c_str());
  if (!s.ok()) return out;
  while (sqlite3_step(s.get()) == SQLITE_ROW) out.push_back(Read(s.get()));
  return out;
}

}  // namespace moelora
