#include "worker/comm/communicator.h"

namespace moelora {

[[nodiscard]] absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(
    const RendezvousOptions&, int) {
  return absl::UnimplementedError("built without CUDA: no NCCL communicator (use --device cpu)");
}

}  // namespace moelora
