// safetensors reader/writer: round trip and every malformed input the reader must reject.
#include "common/safetensors.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <limits>

#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace moelora {
namespace {

using ::moelora::testing::IsOk;
using ::moelora::testing::StatusIs;
using ::testing::HasSubstr;

// A file from a raw header string and data section.
std::string Raw(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

[[nodiscard]] absl::StatusOr<std::unique_ptr<SafetensorsFile>> Parse(const std::string& bytes) {
  return SafetensorsFile::FromBuffer(
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()),
      "mem.safetensors");
}

TEST(Safetensors, RoundTripKeepsBytesShapesAndMetadata) {
  testing::TempDir dir;
  std::vector<float> f32 = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, -1.0f};
  std::vector<uint16_t> bf16 = {0x3f80, 0xc000, 0x4040};
  std::vector<int64_t> i64 = {1, -2};
  uint8_t f4[2] = {0x12, 0x34};  // 4 F4 elements
  std::vector<TensorToWrite> ts = {
      {"a.weight", DType::kF32, {2, 3}, f32.data(), f32.size() * 4},
      {"b", DType::kBF16, {3}, bf16.data(), bf16.size() * 2},
      {"c", DType::kI64, {2, 1}, i64.data(), 16},
      {"packed", DType::kF4, {4}, f4, 2},
      {"empty", DType::kF32, {0, 4}, nullptr, 0},
  };
  const std::string path = dir.Sub("x.safetensors");
  ASSERT_THAT(WriteSafetensors(path, ts, {{"format", "pt"}}), IsOk());
  auto file = SafetensorsFile::Open(path);
  ASSERT_THAT(file, IsOk());
  const auto& f = **file;
  EXPECT_EQ(f.tensors().size(), 5u);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  const TensorView* a = f.Find("a.weight");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a->dtype, DType::kF32);
  EXPECT_EQ(std::memcmp(a->data, f32.data(), 24), 0);
  EXPECT_EQ(f.Find("b")->dtype, DType::kBF16);
  EXPECT_EQ(std::memcmp(f.Find("b")->data, bf16.data(), 6), 0);
  EXPECT_EQ(f.Find("packed")->nbytes, 2u);
  EXPECT_EQ(f.Find("empty")->nbytes, 0u);
  EXPECT_EQ(f.Find("nope"), nullptr);
  // Header is padded to 8 bytes as the reference writer does.
  std::string bytes = testing::ReadFile(path);
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ((8 + n) % 8, 0u);
}

TEST(Safetensors, EveryDTypeNameParses) {
  for (const char* name : {"BOOL",    "F4",      "F6_E2M3", "F6_E3M2", "U8",  "I8",   "F8_E5M2",
                           "F8_E4M3", "F8_E8M0", "I16",     "U16",     "F16", "BF16", "I32",
                           "U32",     "F32",     "C64",     "F64",     "I64", "U64"}) {
    auto d = ParseDType(name);
    ASSERT_THAT(d, IsOk()) << name;
    EXPECT_EQ(DTypeName(*d), name);
  }
  EXPECT_THAT(ParseDType("F128"), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(Safetensors, AcceptsValidHandWrittenFile) {
  // The buffer must outlive the file's views (found by ASan: a temporary was passed here).
  const std::string raw = Raw(
      R"({"x":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"__metadata__":{"k":"v"}}  )", "ab");
  auto f = Parse(raw);
  ASSERT_THAT(f, IsOk());
  EXPECT_EQ((*f)->Find("x")->data[1], 'b');
}

struct BadCase {
  const char* label;
  std::string bytes;
  const char* message;
};

TEST(Safetensors, RejectsMalformedInputWithClearErrors) {
  std::string u64max(8, '\xff');
  std::string huge(8, '\0');
  uint64_t over = kMaxSafetensorsHeaderBytes + 1;
  std::memcpy(huge.data(), &over, 8);
  std::string past(8, '\0');
  uint64_t ten = 10;
  std::memcpy(past.data(), &ten, 8);
  past += "{}";
  const std::vector<BadCase> cases = {
      {"shorter than 8 bytes", "abc", "shorter than the 8-byte"},
      {"empty", "", "shorter than the 8-byte"},
      {"header length u64 max", u64max + "{}", "exceeds"},
      {"header length over 100 MB", huge + "{}", "exceeds"},
      {"header length past end", past, "runs past the end"},
      {"not JSON", Raw("{not json", ""), "not valid JSON"},
      {"not an object", Raw("[1,2]", ""), "JSON object"},
      {"unknown dtype", Raw(R"({"x":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}})", "a"),
       "unknown dtype"},
      {"duplicate names",
       Raw(R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"x":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
           "ab"),
       "duplicate key 'x'"},
      {"overlap",
       Raw(R"({"x":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"y":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})",
           "abc"),
       "overlap"},
      {"gap",
       Raw(R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"y":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}})",
           "abc"),
       "gap"},
      {"does not start at 0", Raw(R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})", "ab"),
       "gap"},
      {"out of range", Raw(R"({"x":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", "ab"),
       "out of range"},
      {"trailing bytes", Raw(R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "ab"),
       "trailing"},
      {"shape product overflows",
       Raw(R"({"x":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,4]}})",
           "abcd"),
       "overflows"},
      {"shape x dtype != span",
       Raw(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "abcd"),
       "is 8 bytes but data_offsets span 4"},
      {"end before begin", Raw(R"({"x":{"dtype":"U8","shape":[0],"data_offsets":[2,1]}})", ""),
       "end 1 < begin 2"},
      {"negative dim", Raw(R"({"x":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", "a"),
       "non-negative"},
      {"float dim", Raw(R"({"x":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}})", "a"),
       "non-negative"},
      {"missing offsets", Raw(R"({"x":{"dtype":"U8","shape":[1]}})", "a"), "data_offsets"},
      {"metadata not strings", Raw(R"({"__metadata__":{"k":1}})", ""), "not a string"},
      {"sub-byte not whole bytes",
       Raw(R"({"x":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", "ab"),
       "whole number of bytes"},
      {"header does not start with {", Raw(R"( {"x":1})", ""), "must start with"},
      {"invalid UTF-8", Raw("{\"\xff\xfe\":{}}", ""), "not valid JSON"},
  };
  for (const auto& c : cases) {
    auto f = Parse(c.bytes);
    EXPECT_THAT(f, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.message))) << c.label;
    if (!f.ok()) {
      EXPECT_THAT(std::string(f.status().message()), HasSubstr("mem.safetensors")) << c.label;
    }
  }
}

TEST(Safetensors, TruncatedFileOnDiskIsRejected) {
  testing::TempDir dir;
  std::vector<float> data(64, 1.0f);
  const std::string path = dir.Sub("t.safetensors");
  ASSERT_THAT(WriteSafetensors(path, {{"w", DType::kF32, {8, 8}, data.data(), 256}}), IsOk());
  std::string bytes = testing::ReadFile(path);
  testing::WriteFile(path, bytes.substr(0, bytes.size() - 7));
  EXPECT_THAT(SafetensorsFile::Open(path), StatusIs(absl::StatusCode::kInvalidArgument,
                                                    HasSubstr("out of range or file truncated")));
}

TEST(Safetensors, MissingFileIsNotFound) {
  EXPECT_THAT(SafetensorsFile::Open("/nonexistent/x.safetensors"),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST(Safetensors, WriterRejectsSizeMismatchAndDuplicates) {
  float x[2] = {1, 2};
  EXPECT_THAT(SerializeSafetensors({{"a", DType::kF32, {3}, x, 8}}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(SerializeSafetensors({{"a", DType::kF32, {2}, x, 8}, {"a", DType::kF32, {2}, x, 8}}),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(Safetensors, ReleasePagesKeepsViewsReadable) {
  testing::TempDir dir;
  std::vector<float> data(1 << 16);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<float>(i);
  const std::string path = dir.Sub("r.safetensors");
  ASSERT_THAT(
      WriteSafetensors(path, {{"w", DType::kF32, {256, 256}, data.data(), data.size() * 4}}),
      IsOk());
  auto f = SafetensorsFile::Open(path);
  ASSERT_THAT(f, IsOk());
  const TensorView* w = (*f)->Find("w");
  (*f)->ReleasePages(*w);
  EXPECT_EQ(std::memcmp(w->data, data.data(), w->nbytes), 0);
}

// A file truncated while mapped: reading past its new end would end the process with SIGBUS.
// The read goes on (zeros) and CheckIntact names the file; a file rewritten in place (same size,
// new modification time) is reported too; an untouched one is intact.
TEST(Safetensors, AFileTruncatedWhileMappedFailsItsLoadNotTheProcess) {
  testing::TempDir dir;
  std::vector<float> data(1 << 16, 1.0f);
  const std::string path = dir.Sub("cut.safetensors");
  ASSERT_THAT(
      WriteSafetensors(path, {{"w", DType::kF32, {256, 256}, data.data(), data.size() * 4}}),
      IsOk());
  auto f = SafetensorsFile::Open(path);
  ASSERT_THAT(f, IsOk());
  EXPECT_THAT((*f)->CheckIntact(), IsOk());
  ASSERT_EQ(::truncate(path.c_str(), 4096), 0);
  const TensorView* w = (*f)->Find("w");
  const auto* bytes = static_cast<const unsigned char*>(w->data);
  unsigned sum = 0;
  for (size_t i = 0; i < w->nbytes; i += 4096)
    sum += bytes[i];  // past the end: SIGBUS without the guard
  (void)sum;
  EXPECT_THAT((*f)->CheckIntact(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cut.safetensors")));
  f->reset();  // unmapped (and unguarded) cleanly

  const std::string other = dir.Sub("rewritten.safetensors");
  ASSERT_THAT(WriteSafetensors(other, {{"w", DType::kF32, {8}, data.data(), 32}}), IsOk());
  auto g = SafetensorsFile::Open(other);
  ASSERT_THAT(g, IsOk());
  struct timespec later[2] = {{0, UTIME_OMIT}, {1, 0}};  // a new modification time
  ASSERT_EQ(::utimensat(AT_FDCWD, other.c_str(), later, 0), 0);
  EXPECT_THAT((*g)->CheckIntact(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("changed while it was read")));
}

}  // namespace
}  // namespace moelora
