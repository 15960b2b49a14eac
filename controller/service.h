// moelora.v1.Controller over a Controller (controller.h). Thread-safety: as Controller.
//
// Generate and GenerateStream use gRPC's callback API: a call waiting in the queue or decoding
// holds no thread. The scheduler's progress reaches the call through its request's listener,
// and a few pump threads (WorkPool) detokenize and write for every call; so 2,000 open streams
// are 2,000 small objects, not 2,000 threads. The adapter RPCs stay synchronous (short, rare).
//
// Generate and GenerateStream take their request as bytes (gRPC's raw callback methods): the
// wire format is scanned for counts (stop strings, images) before protobuf builds the message,
// which would otherwise turn a 64 MiB message of empty strings into gigabytes before any check.
#ifndef MOELORA_CONTROLLER_SERVICE_H_
#define MOELORA_CONTROLLER_SERVICE_H_

#include <memory>

#include "common/work_pool.h"
#include "controller/auth.h"
#include "controller/controller.h"
#include "controller/metrics.h"
#include "moelora/v1/controller.grpc.pb.h"

namespace moelora {

class ControllerService final
    : public v1::Controller::WithRawCallbackMethod_Generate<
          v1::Controller::WithRawCallbackMethod_GenerateStream<v1::Controller::Service>> {
 public:
  // `pump_threads`: the threads that turn tokens into responses for all calls.
  ControllerService(Controller* controller, ControllerMetrics* metrics, int pump_threads = 4)
      : controller_(controller), metrics_(metrics), pump_(pump_threads) {}
  // Tokens every call must carry (null: none asked); outlives the service.
  void set_auth(const TokenAuth* auth) { auth_ = auth; }

  grpc::Status LoadAdapter(grpc::ServerContext*, const v1::LoadAdapterRequest*,
                           v1::Adapter*) override;
  grpc::Status UnloadAdapter(grpc::ServerContext*, const v1::UnloadAdapterRequest*,
                             v1::UnloadAdapterResponse*) override;
  grpc::Status ListAdapters(grpc::ServerContext*, const v1::ListAdaptersRequest*,
                            v1::ListAdaptersResponse*) override;
  grpc::Status GetAdapter(grpc::ServerContext*, const v1::GetAdapterRequest*,
                          v1::Adapter*) override;
  grpc::ServerUnaryReactor* Generate(grpc::CallbackServerContext*, const grpc::ByteBuffer*,
                                     grpc::ByteBuffer*) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* GenerateStream(grpc::CallbackServerContext*,
                                                             const grpc::ByteBuffer*) override;

 private:
  class Call;
  class StreamReactor;
  class UnaryReactor;
  // OK, or the call's UNAUTHENTICATED / PERMISSION_DENIED (counted) when tokens are asked.
  grpc::Status Authorize(const grpc::ServerContextBase* ctx, bool admin) const;
  Controller* controller_;
  ControllerMetrics* metrics_;
  const TokenAuth* auth_ = nullptr;
  WorkPool pump_;
};

}  // namespace moelora

#endif  // MOELORA_CONTROLLER_SERVICE_H_
