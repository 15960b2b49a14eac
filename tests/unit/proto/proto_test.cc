// The public API names the issue pins: checked through the compiled descriptors.
#include <gtest/gtest.h>

#include "moelora/v1/controller.grpc.pb.h"
#include "moelora/v1/worker.grpc.pb.h"

namespace moelora {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;

void ExpectField(const Descriptor* d, const char* name, FieldDescriptor::Type type, bool repeated) {
  const FieldDescriptor* f = d->FindFieldByName(name);
  ASSERT_NE(f, nullptr) << d->full_name() << "." << name;
  EXPECT_EQ(f->type(), type) << d->full_name() << "." << name;
  EXPECT_EQ(f->is_repeated(), repeated) << d->full_name() << "." << name;
}

const google::protobuf::ServiceDescriptor* Service(const char* name) {
  return google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(name);
}

TEST(Proto, PublicApiNamesArePinned) {
  EXPECT_STREQ(v1::Controller::service_full_name(), "moelora.v1.Controller");
  const auto* fmt = v1::AdapterFormat_descriptor();
  EXPECT_EQ(fmt->FindValueByName("FORMAT_UNSPECIFIED")->number(), 0);
  EXPECT_EQ(fmt->FindValueByName("FORMAT_2D")->number(), 1);
  EXPECT_EQ(fmt->FindValueByName("FORMAT_3D")->number(), 2);
  const Descriptor* load = v1::LoadAdapterRequest::descriptor();
  ExpectField(load, "name", FieldDescriptor::TYPE_STRING, false);
  ExpectField(load, "path", FieldDescriptor::TYPE_STRING, false);
  ExpectField(load, "format", FieldDescriptor::TYPE_ENUM, false);
  const Descriptor* gen = v1::GenerateRequest::descriptor();
  ExpectField(gen, "adapter", FieldDescriptor::TYPE_STRING, false);
  ExpectField(gen, "prompt_token_ids", FieldDescriptor::TYPE_INT32, true);
  ExpectField(gen, "max_tokens", FieldDescriptor::TYPE_INT32, false);
  ExpectField(gen, "temperature", FieldDescriptor::TYPE_FLOAT, false);
  ExpectField(gen, "return_logprobs", FieldDescriptor::TYPE_BOOL, false);
  const Descriptor* out = v1::GenerateResponse::descriptor();
  ExpectField(out, "token_ids", FieldDescriptor::TYPE_INT32, true);
  ExpectField(out, "logprobs", FieldDescriptor::TYPE_FLOAT, true);
  ExpectField(out, "finish_reason", FieldDescriptor::TYPE_STRING, false);
  const auto* cs = Service("moelora.v1.Controller");
  ASSERT_NE(cs, nullptr);
  for (const char* m : {"LoadAdapter", "UnloadAdapter", "ListAdapters", "GetAdapter", "Generate",
                        "GenerateStream"}) {
    EXPECT_NE(cs->FindMethodByName(m), nullptr) << m;
  }
  ASSERT_NE(v1::StepRequest::descriptor(), nullptr);  // pulls worker.pb.o into the link
  const auto* ws = Service("moelora.v1.Worker");
  ASSERT_NE(ws, nullptr);
  for (const char* m : {"StageAdapter", "CommitAdapter", "AbortAdapter", "UnloadAdapter", "Step",
                        "Health", "Info"}) {
    EXPECT_NE(ws->FindMethodByName(m), nullptr) << m;
  }
}

}  // namespace
}  // namespace moelora
