#include "schema/formats.h"

namespace moelora {

const char* AdapterFormatName(AdapterFormat f) {
  switch (f) {
    case AdapterFormat::kDense:
      return "dense";
    case AdapterFormat::k2D:
      return "2d";
    case AdapterFormat::k3D:
      return "3d";
  }
  return "?";
}

}  // namespace moelora
