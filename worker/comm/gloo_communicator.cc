#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>

#include <exception>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "worker/comm/communicator.h"

namespace moelora {
namespace {

class GlooCommunicator final : public Communicator {
 public:
  explicit GlooCommunicator(std::shared_ptr<gloo::rendezvous::Context> ctx)
      : ctx_(std::move(ctx)) {}
  int rank() const override { return ctx_->rank; }
  int world_size() const override { return ctx_->size; }
  const char* backend() const override { return "gloo"; }

  [[nodiscard]] absl::Status AllReduceSum(float* data, size_t count) override {
    if (count == 0) return absl::OkStatus();
    try {
      gloo::AllreduceOptions opts(ctx_);
      opts.setOutput(data, count);
      opts.setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
      gloo::allreduce(opts);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat(
          "gloo all-reduce of ", count, " floats failed (a peer rank is gone?): ", e.what()));
    }
    return absl::OkStatus();
  }

  [[nodiscard]] absl::Status Barrier() override {
    try {
      gloo::BarrierOptions opts(ctx_);
      gloo::barrier(opts);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("gloo barrier failed: ", e.what()));
    }
    return absl::OkStatus();
  }

 private:
  std::shared_ptr<gloo::rendezvous::Context> ctx_;
};

}  // namespace

[[nodiscard]] absl::StatusOr<std::unique_ptr<Communicator>> MakeGlooCommunicator(
    const RendezvousOptions& o) {
  if (o.world_size <= 1) return MakeLocalCommunicator();
  if (o.rank < 0 || o.rank >= o.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", o.rank, " outside world size ", o.world_size));
  }
  std::error_code ec;
  if (o.store_dir.empty() || !std::filesystem::is_directory(o.store_dir, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous directory \"", o.store_dir, "\" does not exist"));
  }
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = o.hostname;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::FileStore store(o.store_dir);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(o.rank, o.world_size);
    ctx->setTimeout(o.timeout);
    ctx->connectFullMesh(store, device);
    return std::unique_ptr<Communicator>(new GlooCommunicator(std::move(ctx)));
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("gloo rendezvous in ", o.store_dir, " as rank ",
                                               o.rank, "/", o.world_size, " failed: ", e.what()));
  }
}

}  // namespace moelora
