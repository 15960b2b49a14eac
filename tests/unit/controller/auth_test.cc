// TokenAuth: the tokens file's format, roles, and a reload that keeps the tokens in force when
// the new file does not parse.
#include "controller/auth.h"

#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace moelora {
namespace {

using ::moelora::testing::TempDir;
using ::testing::HasSubstr;

void Write(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

TEST(TokenAuthTest, RolesDecideWhatATokenMayCall) {
  TempDir dir;
  const std::string f = dir.path() + "/tokens";
  Write(f, "# comment\n\nadm1n admin\n  user-1   inference  \n");
  auto a = TokenAuth::Load(f);
  ASSERT_OK(a);
  EXPECT_EQ((*a)->size(), 2u);
  EXPECT_OK((*a)->Check("Bearer adm1n", true));
  EXPECT_OK((*a)->Check("Bearer adm1n", false));
  EXPECT_OK((*a)->Check("Bearer user-1", false));
  EXPECT_EQ((*a)->Check("Bearer user-1", true).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ((*a)->Check("Bearer nope", false).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ((*a)->Check("", false).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ((*a)->Check("adm1n", true).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ((*a)->Check("Bearer adm1", true).code(), absl::StatusCode::kUnauthenticated);
}

TEST(TokenAuthTest, ABadFileIsRefusedNamingTheLineAndAReloadKeepsTheTokensInForce) {
  TempDir dir;
  const std::string f = dir.path() + "/tokens";
  for (const auto& [text, why] : std::vector<std::pair<std::string, std::string>>{
           {"t1 admin\nt2\n", ":2: expected \"TOKEN ROLE\""},
           {"t1 root\n", ":1: role \"root\""},
           {"t1 admin\nt1 inference\n", ":2: the token is listed twice"}}) {
    Write(f, text);
    auto a = TokenAuth::Load(f);
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(std::string(a.status().message()), HasSubstr(f + why)) << text;
  }
  EXPECT_EQ(TokenAuth::Load(dir.path() + "/absent").status().code(), absl::StatusCode::kNotFound);
  Write(f, "old admin\n");
  auto a = TokenAuth::Load(f);
  ASSERT_OK(a);
  Write(f, "new admin\nbroken\n");
  EXPECT_EQ((*a)->Reload().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_OK((*a)->Check("Bearer old", true)) << "kept";
  Write(f, "new admin\n");
  EXPECT_OK((*a)->Reload());
  EXPECT_EQ((*a)->Check("Bearer old", true).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_OK((*a)->Check("Bearer new", true));
}

}  // namespace
}  // namespace moelora
