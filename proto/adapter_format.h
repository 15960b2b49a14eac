// lora::AdapterFormat <-> moelora.v1.AdapterFormat, for the controller and the worker service.
// Header-only: its users link both lora/ and proto/ (neither library depends on the other).
#ifndef MOELORA_PROTO_ADAPTER_FORMAT_H_
#define MOELORA_PROTO_ADAPTER_FORMAT_H_

#include <optional>

#include "lora/adapter.h"
#include "moelora/v1/controller.pb.h"

namespace moelora {

inline v1::AdapterFormat AdapterFormatToProto(AdapterFormat f) {
  switch (f) {
    case AdapterFormat::k2D:
      return v1::FORMAT_2D;
    case AdapterFormat::k3D:
      return v1::FORMAT_3D;
    case AdapterFormat::kDense:
      return v1::FORMAT_DENSE;
  }
  return v1::FORMAT_UNSPECIFIED;
}

// nullopt for FORMAT_UNSPECIFIED (detect) and unknown values.
inline std::optional<AdapterFormat> AdapterFormatFromProto(int f) {
  switch (f) {
    case v1::FORMAT_2D:
      return AdapterFormat::k2D;
    case v1::FORMAT_3D:
      return AdapterFormat::k3D;
    case v1::FORMAT_DENSE:
      return AdapterFormat::kDense;
    default:
      return std::nullopt;
  }
}

}  // namespace moelora

#endif  // MOELORA_PROTO_ADAPTER_FORMAT_H_
