#include "worker/comm/communicator.h"

namespace moelora {
namespace {

class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  const char* backend() const override { return "local"; }
  [[nodiscard]] absl::Status AllReduceSum(float*, size_t) override { return absl::OkStatus(); }
  [[nodiscard]] absl::Status Barrier() override { return absl::OkStatus(); }
};

}  // namespace

std::unique_ptr<Communicator> MakeLocalCommunicator() {
  return std::make_unique<LocalCommunicator>();
}

}  // namespace moelora
