// NCCL communicator: compiled when CUDA is on; runs on GPU machines. The unique id is exchanged
// through a file in the rendezvous directory (rank 0 writes it atomically, the others poll), the
// same directory the gloo store uses.
//
// Every NCCL call runs on a non-blocking communicator and is waited for by polling, with a
// deadline (RendezvousOptions::timeout): init, and each collective. A peer that died or hangs
// would otherwise block ncclAllReduce's stream forever; instead the deadline passes, the
// communicator is aborted (ncclCommAbort frees the stream) and the call returns UNAVAILABLE, as
// does every later call. The worker then exits so that the controller restarts the group.
// Collectives run on the legacy default stream, after the kernels that produced their input.
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "worker/comm/communicator.h"

namespace moelora {
namespace {

using Clock = std::chrono::steady_clock;

[[nodiscard]] absl::Status NcclError(const std::string& what, ncclResult_t r) {
  return absl::UnavailableError(absl::StrCat(what, ": ", ncclGetErrorString(r)));
}

// Sleeps a little longer each time: spins first (collectives of a decode step take
// microseconds), then backs off to 200 µs so that a hung peer does not burn a core.
class Backoff {
 public:
  void Wait() {
    if (++n_ < 2000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

 private:
  int n_ = 0;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int rank, int size, std::chrono::milliseconds timeout)
      : comm_(comm), rank_(rank), size_(size), timeout_(timeout) {
    cudaEventCreateWithFlags(&done_, cudaEventDisableTiming);
  }
  ~NcclCommunicator() override {
    if (done_) cudaEventDestroy(done_);
    if (aborted_) return;  // ncclCommAbort already freed it
    ncclCommDestroy(comm_);
  }
  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  const char* backend() const override { return "nccl"; }

  [[nodiscard]] absl::Status AllReduceSum(float* data, size_t count) override {
    if (aborted_) return Broken();
    const auto deadline = Clock::now() + timeout_;
    auto timed_out = [&] {
      return Abort(absl::UnavailableError(absl::StrCat(
          "ncclAllReduce of ", count, " floats did not finish within ", timeout_.count(),
          " ms: a peer rank is dead or hung; communicator aborted")));
    };
    ncclResult_t r = ncclAllReduce(data, data, count, ncclFloat32, ncclSum, comm_, nullptr);
    Backoff backoff;
    // A non-blocking communicator may return before the collective is enqueued; it must be
    // before the event is recorded behind it.
    while (r == ncclInProgress) {
      if (Clock::now() > deadline) return timed_out();
      backoff.Wait();
      ncclCommGetAsyncError(comm_, &r);
    }
    if (r != ncclSuccess) return Abort(NcclError("ncclAllReduce", r));
    if (cudaEventRecord(done_, nullptr) != cudaSuccess) {
      return Abort(absl::InternalError("cudaEventRecord after ncclAllReduce failed"));
    }
    while (true) {
      const cudaError_t q = cudaEventQuery(done_);
      if (q == cudaSuccess) return absl::OkStatus();
      if (q != cudaErrorNotReady) {
        return Abort(absl::InternalError(
            absl::StrCat("waiting for ncclAllReduce: ", cudaGetErrorString(q))));
      }
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        return Abort(NcclError("ncclAllReduce (asynchronous error)", async));
      }
      if (Clock::now() > deadline) return timed_out();
      backoff.Wait();
    }
  }

  [[nodiscard]] absl::Status Barrier() override {
    float* d = nullptr;
    if (cudaMalloc(&d, sizeof(float)) != cudaSuccess) return absl::InternalError("cudaMalloc");
    cudaMemset(d, 0, sizeof(float));
    absl::Status s = AllReduceSum(d, 1);
    cudaFree(d);
    return s;
  }

 private:
  [[nodiscard]] absl::Status Abort(absl::Status why) {
    ncclCommAbort(comm_);
    aborted_ = true;
    reason_ = std::string(why.message());
    return absl::UnavailableError(why.message());
  }
  [[nodiscard]] absl::Status Broken() const {
    return absl::UnavailableError(absl::StrCat("NCCL communicator aborted earlier: ", reason_));
  }

  ncclComm_t comm_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  cudaEvent_t done_ = nullptr;
  bool aborted_ = false;
  std::string reason_;
};

}  // namespace

[[nodiscard]] absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(
    const RendezvousOptions& o, int cuda_device) {
  if (cudaSetDevice(cuda_device) != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("cudaSetDevice(", cuda_device, ") failed"));
  }
  ncclUniqueId id;
  const std::string path = o.store_dir + "/nccl_unique_id";
  const auto deadline = Clock::now() + o.timeout;
  if (o.rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) return NcclError("ncclGetUniqueId", r);
    const std::string tmp = path + ".tmp";
    std::ofstream(tmp, std::ios::binary).write(reinterpret_cast<const char*>(&id), sizeof(id));
    std::error_code ec;
    std::filesystem::rename(tmp, path, ec);
    if (ec) return absl::UnavailableError(absl::StrCat("writing ", path, ": ", ec.message()));
  } else {
    while (true) {
      std::ifstream in(path, std::ios::binary);
      if (in && in.read(reinterpret_cast<char*>(&id), sizeof(id))) break;
      if (Clock::now() > deadline) {
        return absl::UnavailableError(absl::StrCat("no NCCL unique id at ", path, " after ",
                                                   o.timeout.count(), " ms (is rank 0 up?)"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // init and collectives return at once; we poll with a deadline
  ncclComm_t comm;
  ncclResult_t r = ncclCommInitRankConfig(&comm, o.world_size, id, o.rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) return NcclError("ncclCommInitRankConfig", r);
  Backoff backoff;
  while (true) {
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(comm, &state);
    if (state == ncclSuccess) break;
    if (state != ncclInProgress) {
      ncclCommAbort(comm);
      return NcclError(absl::StrCat("NCCL init of rank ", o.rank, " of ", o.world_size), state);
    }
    if (Clock::now() > deadline) {
      ncclCommAbort(comm);
      return absl::UnavailableError(absl::StrCat("NCCL init of rank ", o.rank, " of ", o.world_size,
                                                 " did not finish within ", o.timeout.count(),
                                                 " ms; aborted"));
    }
    backoff.Wait();
  }
  return std::unique_ptr<Communicator>(new NcclCommunicator(comm, o.rank, o.world_size, o.timeout));
}

}  // namespace moelora
