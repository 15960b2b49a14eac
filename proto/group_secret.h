// The secret a controller shares with the workers it spawns: the workers' port is plaintext on
// loopback, so without it any local process could send a worker a step (with a larger epoch,
// taking the worker from its controller) or stage adapters. The controller draws a fresh secret
// per spawned group and hands it over in the environment (kGroupSecretEnv: not in argv, which
// every local user can read in /proc); the worker then refuses (UNAUTHENTICATED) every call but
// Health that does not carry it in kGroupSecretMetadata. Workers started by hand (--workers
// mode, tests) have none and rely on mutual TLS.
#ifndef MOELORA_PROTO_GROUP_SECRET_H_
#define MOELORA_PROTO_GROUP_SECRET_H_

#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <string_view>

namespace moelora {

inline constexpr char kGroupSecretEnv[] = "MOELORA_GROUP_SECRET";
inline constexpr char kGroupSecretMetadata[] = "x-moelora-group-secret";

// 32 random bytes as hex.
inline std::string NewGroupSecret() {
  std::random_device rd;
  std::string s;
  char buf[9];
  for (int i = 0; i < 8; ++i) {
    std::snprintf(buf, sizeof(buf), "%08x", static_cast<unsigned>(rd()));
    s += buf;
  }
  return s;
}

// Equal, in time that depends on the lengths only.
inline bool SameSecret(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = a.size() < b.size() ? a.size() : b.size();
  for (size_t i = 0; i < n; ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace moelora

#endif  // MOELORA_PROTO_GROUP_SECRET_H_
