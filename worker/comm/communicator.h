// Tensor-parallel collectives between the worker processes of one model replica.
//
// Implementations: Local (world size 1, no-ops), Gloo (TCP, CPU tensors; the CPU path) and NCCL
// (device pointers; compiled when CUDA is on). Every rank must call the same collectives in the
// same order; the engine guarantees that by running the same Step on every rank.
// Thread-safety: one caller at a time (the engine's step thread).
#ifndef MOELORA_WORKER_COMM_COMMUNICATOR_H_
#define MOELORA_WORKER_COMM_COMMUNICATOR_H_

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moelora {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual const char* backend() const = 0;  // "local" | "gloo" | "nccl"
  // In-place sum over all ranks; every rank ends with the same bits. UNAVAILABLE when a peer is
  // gone or the timeout passes.
  [[nodiscard]] virtual absl::Status AllReduceSum(float* data, size_t count) = 0;
  [[nodiscard]] virtual absl::Status Barrier() = 0;
};

std::unique_ptr<Communicator> MakeLocalCommunicator();

struct RendezvousOptions {
  int rank = 0;
  int world_size = 1;
  // A directory every rank can read and write (gloo FileStore; NCCL unique id). Must be fresh
  // for each start of the group: stale keys from an earlier run would be read as current.
  std::string store_dir;
  std::string hostname = "127.0.0.1";  // this rank's address for the TCP transport
  std::chrono::milliseconds timeout{60000};
};

// Connects a full mesh over TCP. UNAVAILABLE naming the store when peers do not show up.
[[nodiscard]] absl::StatusOr<std::unique_ptr<Communicator>> MakeGlooCommunicator(
    const RendezvousOptions& o);

// NCCL over the given CUDA device. UNIMPLEMENTED when built without CUDA.
[[nodiscard]] absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(
    const RendezvousOptions& o, int cuda_device);

}  // namespace moelora

#endif  // MOELORA_WORKER_COMM_COMMUNICATOR_H_
