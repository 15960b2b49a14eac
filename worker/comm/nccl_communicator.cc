// NCCL communicator: compiled when CUDA is on; runs on GPU machines (issue: GPU path). The
// unique id is exchanged through a file in the rendezvous directory (rank 0 writes it
// atomically, the others poll), the same directory the gloo store uses.
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

absl::Status NcclError(const char* what, ncclResult_t r) {
  return absl::UnavailableError(absl::StrCat(what, ": ", ncclGetErrorString(r)));
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int rank, int size) : comm_(comm), rank_(rank), size_(size) {}
  ~NcclCommunicator() override { ncclCommDestroy(comm_); }
  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  const char* backend() const override { return "nccl"; }
  absl::Status AllReduceSum(float* data, size_t count) override {
    ncclResult_t r = ncclAllReduce(data, data, count, ncclFloat32, ncclSum, comm_, nullptr);
    if (r != ncclSuccess) return NcclError("ncclAllReduce", r);
    if (cudaStreamSynchronize(nullptr) != cudaSuccess) {
      return absl::InternalError("cudaStreamSynchronize after ncclAllReduce failed");
    }
    return absl::OkStatus();
  }
  absl::Status Barrier() override {
    float dummy = 0;
    float* d = nullptr;
    if (cudaMalloc(&d, sizeof(float)) != cudaSuccess) return absl::InternalError("cudaMalloc");
    cudaMemcpy(d, &dummy, sizeof(float), cudaMemcpyHostToDevice);
    absl::Status s = AllReduceSum(d, 1);
    cudaFree(d);
    return s;
  }

 private:
  ncclComm_t comm_;
  int rank_, size_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(const RendezvousOptions& o,
                                                                   int cuda_device) {
  if (cudaSetDevice(cuda_device) != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("cudaSetDevice(", cuda_device, ") failed"));
  }
  ncclUniqueId id;
  const std::string path = o.store_dir + "/nccl_unique_id";
  if (o.rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) return NcclError("ncclGetUniqueId", r);
    const std::string tmp = path + ".tmp";
    std::ofstream(tmp, std::ios::binary).write(reinterpret_cast<const char*>(&id), sizeof(id));
    std::filesystem::rename(tmp, path);
  } else {
    const auto deadline = std::chrono::steady_clock::now() + o.timeout;
    while (true) {
      std::ifstream in(path, std::ios::binary);
      if (in && in.read(reinterpret_cast<char*>(&id), sizeof(id))) break;
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::UnavailableError(absl::StrCat("no NCCL unique id at ", path));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  ncclComm_t comm;
  ncclResult_t r = ncclCommInitRank(&comm, o.world_size, id, o.rank);
  if (r != ncclSuccess) return NcclError("ncclCommInitRank", r);
  return std::unique_ptr<Communicator>(new NcclCommunicator(comm, o.rank, o.world_size));
}

}  // namespace moelora
