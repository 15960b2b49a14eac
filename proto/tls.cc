#include "proto/tls.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace moelora {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& flag, const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  if (!in || !(ss << in.rdbuf())) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": cannot be read"));
  }
  if (ss.str().find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": not a PEM file"));
  }
  return ss.str();
}

// The certificate chain and private key `f` names.
absl::Status ReadPair(const TlsFiles& f, std::string* cert, std::string* key) {
  absl::StatusOr<std::string> c = ReadPem(f.flag_prefix + "tls-cert-file", f.cert);
  if (!c.ok()) return c.status();
  absl::StatusOr<std::string> k = ReadPem(f.flag_prefix + "tls-key-file", f.key);
  if (!k.ok()) return k.status();
  *cert = *std::move(c);
  *key = *std::move(k);
  return absl::OkStatus();
}

}  // namespace

absl::Status ServerPemFrom(const TlsFiles& f, std::string* cert, std::string* key) {
  // The same rules as ServerCredentialsFrom (checked there first, at start-up).
  if (f.cert.empty() && f.key.empty()) return absl::OkStatus();
  return ReadPair(f, cert, key);
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFrom(const TlsFiles& f) {
  const std::string& p = f.flag_prefix;
  if (f.cert.empty() && f.key.empty()) {
    if (!f.ca.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(p, "tls-ca-file needs ", p, "tls-cert-file and ", p, "tls-key-file"));
    }
    return grpc::InsecureServerCredentials();
  }
  if (f.cert.empty() || f.key.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(p, "tls-cert-file and ", p, "tls-key-file go together"));
  }
  grpc::SslServerCredentialsOptions tls;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  if (absl::Status s = ReadPair(f, &pair.cert_chain, &pair.private_key); !s.ok()) return s;
  tls.pem_key_cert_pairs.push_back(std::move(pair));
  if (!f.ca.empty()) {
    absl::StatusOr<std::string> ca = ReadPem(p + "tls-ca-file", f.ca);
    if (!ca.ok()) return ca.status();
    tls.pem_root_certs = *std::move(ca);
    tls.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(tls);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFrom(
    const TlsFiles& f) {
  const std::string& p = f.flag_prefix;
  if (f.cert.empty() && f.key.empty() && f.ca.empty()) return grpc::InsecureChannelCredentials();
  if (f.cert.empty() != f.key.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(p, "tls-cert-file and ", p, "tls-key-file go together"));
  }
  grpc::SslCredentialsOptions tls;
  if (!f.ca.empty()) {
    absl::StatusOr<std::string> ca = ReadPem(p + "tls-ca-file", f.ca);
    if (!ca.ok()) return ca.status();
    tls.pem_root_certs = *std::move(ca);
  }
  if (!f.cert.empty()) {
    if (absl::Status s = ReadPair(f, &tls.pem_cert_chain, &tls.pem_private_key); !s.ok()) return s;
  }
  return grpc::SslCredentials(tls);
}

}  // namespace moelora
