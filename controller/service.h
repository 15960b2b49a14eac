// moelora.v1.Controller over a Controller (controller.h). Thread-safety: as Controller.
#ifndef MOELORA_CONTROLLER_SERVICE_H_
#define MOELORA_CONTROLLER_SERVICE_H_

#include "controller/auth.h"
#include "controller/controller.h"
#include "controller/metrics.h"
#include "moelora/v1/controller.grpc.pb.h"

namespace moelora {

class ControllerService final : public v1::Controller::Service {
 public:
  ControllerService(Controller* controller, ControllerMetrics* metrics)
      : controller_(controller), metrics_(metrics) {}
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
  grpc::Status Generate(grpc::ServerContext*, const v1::GenerateRequest*,
                        v1::GenerateResponse*) override;
  grpc::Status GenerateStream(grpc::ServerContext*, const v1::GenerateRequest*,
                              grpc::ServerWriter<v1::GenerateResponse>*) override;

 private:
  using TokenSink = std::function<bool(const std::vector<int32_t>&, const std::vector<float>&,
                                       const std::string& text)>;
  // Submits and waits, calling `on_tokens` (without any lock held) whenever tokens arrive
  // (stream) with their text delta; it returns false when the client is gone. With a tokenizer,
  // detokenizes incrementally here (the RPC thread) and ends the request at a stop string.
  grpc::Status Run(grpc::ServerContext* ctx, const v1::GenerateRequest& req,
                   v1::GenerateResponse* final_chunk, const TokenSink& on_tokens);
  // OK, or the call's UNAUTHENTICATED / PERMISSION_DENIED (counted) when tokens are asked.
  grpc::Status Authorize(const grpc::ServerContext* ctx, bool admin) const;
  Controller* controller_;
  ControllerMetrics* metrics_;
  const TokenAuth* auth_ = nullptr;
};

}  // namespace moelora

#endif  // MOELORA_CONTROLLER_SERVICE_H_
