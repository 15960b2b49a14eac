// Registry (SQLite) and the adapter-root path policy.
#include "controller/registry.h"

#include <filesystem>
#include <fstream>

#include "common/path_policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace moelora {
namespace {

namespace fs = std::filesystem;
using ::moelora::testing::StatusIs;
using ::moelora::testing::TempDir;
using ::testing::HasSubstr;

AdapterRecord Rec(const std::string& name) {
  AdapterRecord r;
  r.name = name;
  r.path = name + "/dir";
  r.resolved_path = "/abs/" + name;
  r.requested_format = 2;
  r.detected_format = 2;
  r.converted_to_2d = true;
  r.rank = 4;
  r.max_rank = 4;
  r.alpha = 8;
  r.scaling = 2;
  r.target_modules = {"experts", "q_proj"};
  r.num_experts = 4;
  r.bytes = 1234;
  r.load_seconds = 0.5;
  return r;
}

TEST(RegistryTest, PersistsAcrossReopenWithStableIds) {
  TempDir t;
  int64_t id_a = 0, id_b = 0;
  {
    auto reg = Registry::Open(t.path() + "/state");
    ASSERT_OK(reg);
    auto a = (*reg)->Insert(Rec("a"));
    auto b = (*reg)->Insert(Rec("b"));
    ASSERT_OK(a);
    ASSERT_OK(b);
    id_a = *a, id_b = *b;
    EXPECT_NE(id_a, id_b);
    EXPECT_THAT((*reg)->Insert(Rec("a")).status(), StatusIs(absl::StatusCode::kAlreadyExists));
    AdapterRecord upd = Rec("b");
    upd.load_seconds = 1.25;
    ASSERT_OK((*reg)->Update(upd));
  }
  auto reg = Registry::Open(t.path() + "/state");
  ASSERT_OK(reg);
  auto list = (*reg)->List();
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0].id, id_a);
  EXPECT_EQ(list[1].id, id_b);
  EXPECT_EQ(list[1].load_seconds, 1.25);
  EXPECT_EQ(list[0].target_modules, (std::vector<std::string>{"experts", "q_proj"}));
  EXPECT_TRUE(list[0].converted_to_2d);
  ASSERT_OK((*reg)->Remove("a"));
  EXPECT_THAT((*reg)->Remove("a"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_FALSE((*reg)->Get("a").has_value());
  // Ids are never reused (AUTOINCREMENT): a new "a" gets a fresh id.
  auto again = (*reg)->Insert(Rec("a"));
  ASSERT_OK(again);
  EXPECT_GT(*again, id_b);
}

TEST(RegistryTest, UnwritableStateDirIsAnError) {
  EXPECT_FALSE(Registry::Open("/proc/moelora-cannot-write-here").ok());
}

TEST(PathPolicyTest, LexicallyInsideLooksAtTheSpellingOnly) {
  EXPECT_TRUE(LexicallyInside("/srv/adapters", "/srv/adapters/a"));
  EXPECT_TRUE(LexicallyInside("/srv/adapters/", "a/b"));
  EXPECT_TRUE(LexicallyInside("/srv/adapters", "/srv/adapters/x/../a"));
  EXPECT_FALSE(LexicallyInside("/srv/adapters", "/srv/adapters/../etc"));
  EXPECT_FALSE(LexicallyInside("/srv/adapters", "../etc"));
  EXPECT_FALSE(LexicallyInside("/srv/adapters", "/srv/adapters2/a"));
  EXPECT_FALSE(LexicallyInside("", "/srv/adapters/a"));
}

TEST(PathPolicyTest, OnlyInsideTheRootAfterResolvingSymlinks) {
  TempDir t;
  const std::string root = t.path() + "/root";
  fs::create_directories(root + "/ok/sub");
  fs::create_directories(t.path() + "/outside");
  fs::create_directory_symlink(t.path() + "/outside", root + "/escape");
  fs::create_directory_symlink(root + "/ok", root + "/alias");
  std::ofstream(root + "/file") << "x";
  auto ok = ResolveAdapterPath(root, "ok");
  ASSERT_OK(ok);
  EXPECT_EQ(*ok, fs::canonical(root + "/ok").string());
  ASSERT_OK(ResolveAdapterPath(root, "ok/sub/.."));
  ASSERT_OK(ResolveAdapterPath(root, "alias"));  // a symlink that stays inside
  ASSERT_OK(ResolveAdapterPath(root, root + "/ok"));
  EXPECT_THAT(ResolveAdapterPath(root, "../outside").status(),
              StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(ResolveAdapterPath(root, "ok/../../outside").status(),
              StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(ResolveAdapterPath(root, "/etc").status(),
              StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(ResolveAdapterPath(root, "escape").status(),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("symlink")));
  EXPECT_THAT(ResolveAdapterPath(root + "/", "../rootx").status(),
              StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(ResolveAdapterPath(root, "nope").status(), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(ResolveAdapterPath(root, "file").status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ResolveAdapterPath(root, "").status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ResolveAdapterPath(root, std::string("ok\0x", 4)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("NUL")));
  EXPECT_THAT(ResolveAdapterPath(root, std::string(300, 'a')).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("255")));
  EXPECT_THAT(ResolveAdapterPath("", "ok").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  // A sibling directory sharing the root's name as a prefix is outside.
  fs::create_directories(t.path() + "/rootx/a");
  EXPECT_THAT(ResolveAdapterPath(root, t.path() + "/rootx/a").status(),
              StatusIs(absl::StatusCode::kPermissionDenied));
}

}  // namespace
// A damaged registry file: DATA_LOSS naming the file, and the file is left as it was.
TEST(RegistryTest, CorruptedFileIsRefusedNamingItAndKept) {
  TempDir t;
  std::filesystem::create_directories(t.path() + "/state");
  const std::string file = t.path() + "/state/registry.sqlite3";
  const std::string garbage(8192, 'x');
  std::ofstream(file, std::ios::binary) << garbage;
  auto reg = Registry::Open(t.path() + "/state");
  ASSERT_FALSE(reg.ok());
  EXPECT_EQ(reg.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(reg.status().message()), ::testing::HasSubstr(file));
  EXPECT_THAT(std::string(reg.status().message()), ::testing::HasSubstr("kept"));
  std::ifstream in(file, std::ios::binary);
  std::string after((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(after, garbage);
}

}  // namespace moelora
