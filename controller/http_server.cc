#include "controller/http_server.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <unistd.h>

#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "nlohmann/json.hpp"

namespace moelora {

// libmicrohttpd's callbacks. Each request's exchange lives in a heap shared_ptr in *req_cls
// from the first call of OnRequest to OnCompleted; a stream's reader holds another.
struct HttpExchange::Callbacks {
  static MHD_Result OnRequest(void* cls, MHD_Connection* conn, const char* url, const char* method,
                              const char* /*version*/, const char* upload_data,
                              size_t* upload_data_size, void** req_cls) {
    auto* server = static_cast<HttpServer*>(cls);
    if (*req_cls == nullptr) {
      std::shared_ptr<HttpExchange> ex(new HttpExchange());
      ex->method_ = method;
      ex->path_ = url;
      if (const char* a = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Authorization")) {
        ex->authorization_ = a;
      }
      {
        MutexLock lock(&ex->mu_);
        ex->conn_ = conn;
      }
      {
        MutexLock lock(&server->mu_);
        server->live_.insert(ex.get());
      }
      *req_cls = new std::shared_ptr<HttpExchange>(std::move(ex));
      return MHD_YES;
    }
    HttpExchange* ex = static_cast<std::shared_ptr<HttpExchange>*>(*req_cls)->get();
    if (*upload_data_size > 0) {
      if (ex->body_.size() + *upload_data_size > server->max_body_bytes_) {
        ex->too_large_ = true;  // read and dropped: the answer is 413
      } else {
        ex->body_.append(upload_data, *upload_data_size);
      }
      *upload_data_size = 0;
      return MHD_YES;
    }
    if (!ex->dispatched_) {
      ex->dispatched_ = true;
      std::shared_ptr<HttpExchange> self = *static_cast<std::shared_ptr<HttpExchange>*>(*req_cls);
      if (ex->too_large_) {
        self->Respond(413, "application/json",
                      OpenAiErrorBody(absl::InvalidArgumentError(absl::StrCat(
                          "the request body is larger than ", server->max_body_bytes_, " bytes"))));
      } else {
        server->handler_(self);
      }
    }
    return QueueIfAnswered(*static_cast<std::shared_ptr<HttpExchange>*>(*req_cls));
  }

  // The server's thread: hands the answer to libmicrohttpd once there is one, else suspends
  // the connection until there is.
  static MHD_Result QueueIfAnswered(const std::shared_ptr<HttpExchange>& ex) {
    MutexLock lock(&ex->mu_);
    if (ex->queued_) return MHD_YES;
    if (!ex->answered_) {
      if (ex->stopping_) {
        ex->answered_ = ex->ended_ = true;
        ex->status_ = 503;
        ex->content_type_ = "application/json";
        ex->data_ = OpenAiErrorBody(absl::UnavailableError("the server is stopping"));
      } else {
        ex->suspended_ = true;
        MHD_suspend_connection(ex->conn_);
        return MHD_YES;
      }
    }
    ex->queued_ = true;
    MHD_Response* resp;
    if (ex->stream_) {
      resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 64 * 1024, &Read,
                                               new std::shared_ptr<HttpExchange>(ex), &FreeReader);
      MHD_add_response_header(resp, "Cache-Control", "no-cache");
    } else {
      resp = MHD_create_response_from_buffer(ex->data_.size(), ex->data_.data(),
                                             MHD_RESPMEM_MUST_COPY);
      ex->data_.clear();
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, ex->content_type_.c_str());
    const MHD_Result r = MHD_queue_response(ex->conn_, static_cast<unsigned>(ex->status_), resp);
    MHD_destroy_response(resp);
    return r;
  }

  // A stream's bytes as they come; with none, the connection waits suspended until Write or End.
  static ssize_t Read(void* cls, uint64_t /*pos*/, char* buf, size_t max) {
    HttpExchange* ex = static_cast<std::shared_ptr<HttpExchange>*>(cls)->get();
    MutexLock lock(&ex->mu_);
    const size_t have = ex->data_.size() - ex->sent_;
    if (have > 0) {
      const size_t n = std::min(have, max);
      std::memcpy(buf, ex->data_.data() + ex->sent_, n);
      ex->sent_ += n;
      if (ex->sent_ == ex->data_.size()) {
        ex->data_.clear();
        ex->sent_ = 0;
      }
      return static_cast<ssize_t>(n);
    }
    if (ex->ended_) return MHD_CONTENT_READER_END_OF_STREAM;
    if (ex->stopping_ || ex->conn_ == nullptr) return MHD_CONTENT_READER_END_WITH_ERROR;
    ex->suspended_ = true;
    MHD_suspend_connection(ex->conn_);
    return 0;
  }

  static void FreeReader(void* cls) { delete static_cast<std::shared_ptr<HttpExchange>*>(cls); }

  static void OnCompleted(void* cls, MHD_Connection* /*conn*/, void** req_cls,
                          MHD_RequestTerminationCode toe) {
    auto* holder = static_cast<std::shared_ptr<HttpExchange>*>(*req_cls);
    if (holder == nullptr) return;
    *req_cls = nullptr;
    std::shared_ptr<HttpExchange> ex = std::move(*holder);
    delete holder;
    // The callback goes in any case (it may hold the exchange's owner); it runs only when the
    // answer was cut short. Both outside the lock.
    std::function<void()> on_close;
    bool cut_short = false;
    {
      MutexLock lock(&ex->mu_);
      ex->conn_ = nullptr;
      ex->suspended_ = false;
      cut_short = toe != MHD_REQUEST_TERMINATED_COMPLETED_OK || !ex->ended_ || ex->stopping_;
      on_close = std::move(ex->on_close_);
      ex->on_close_ = nullptr;
    }
    auto* server = static_cast<HttpServer*>(cls);
    {
      MutexLock lock(&server->mu_);
      server->live_.erase(ex.get());
    }
    if (on_close && cut_short) on_close();
  }
};

void HttpExchange::WakeLocked() {
  // A stream that waits and is now told to stop ends at its next read.
  if (suspended_ && conn_ != nullptr) {
    suspended_ = false;
    MHD_resume_connection(conn_);
  }
}

void HttpExchange::Respond(int status, std::string content_type, std::string body) {
  MutexLock lock(&mu_);
  if (answered_ || conn_ == nullptr) return;
  answered_ = ended_ = true;
  status_ = status;
  content_type_ = std::move(content_type);
  data_ = std::move(body);
  WakeLocked();
}

void HttpExchange::StartStream(int status, std::string content_type) {
  MutexLock lock(&mu_);
  if (answered_ || conn_ == nullptr) return;
  answered_ = stream_ = true;
  status_ = status;
  content_type_ = std::move(content_type);
  WakeLocked();
}

void HttpExchange::Write(std::string data) {
  MutexLock lock(&mu_);
  if (!stream_ || ended_ || conn_ == nullptr) return;
  data_ += data;
  WakeLocked();
}

void HttpExchange::End() {
  MutexLock lock(&mu_);
  if (!stream_ || ended_) return;
  ended_ = true;
  WakeLocked();
}

void HttpExchange::SetOnClose(std::function<void()> fn) {
  {
    MutexLock lock(&mu_);
    if (conn_ != nullptr) {
      on_close_ = std::move(fn);
      return;
    }
  }
  fn();  // the request has completed already: it was cut short
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const Options& options,
                                                              Handler handler) {
  std::unique_ptr<HttpServer> s(new HttpServer(std::move(handler)));
  s->max_body_bytes_ = options.max_body_bytes;
  unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME |
                   MHD_USE_ERROR_LOG;
  // libmicrohttpd's messages (a client that left mid-stream, a bad TLS handshake) at VLOG(1).
  MHD_LogCallback logger = [](void*, const char* fmt, va_list ap) {
    if (!VLOG_IS_ON(1)) return;
    char buf[512];
    std::vsnprintf(buf, sizeof(buf), fmt, ap);
    VLOG(1) << "libmicrohttpd: " << buf;
  };
  sockaddr_in v4{};
  sockaddr_in6 v6{};
  const sockaddr* addr = nullptr;
  if (inet_pton(AF_INET, options.host.c_str(), &v4.sin_addr) == 1) {
    v4.sin_family = AF_INET;
    v4.sin_port = htons(static_cast<uint16_t>(options.port));
    addr = reinterpret_cast<const sockaddr*>(&v4);
  } else if (inet_pton(AF_INET6, options.host.c_str(), &v6.sin6_addr) == 1) {
    v6.sin6_family = AF_INET6;
    v6.sin6_port = htons(static_cast<uint16_t>(options.port));
    addr = reinterpret_cast<const sockaddr*>(&v6);
    flags |= MHD_USE_IPv6;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("HTTP host ", options.host, ": not an IPv4 or IPv6 address"));
  }
  const bool tls = !options.tls_cert.empty() && !options.tls_key.empty();
  if (tls) flags |= MHD_USE_TLS;
  // The option list is variadic: TLS adds two pairs before the end.
  s->daemon_ = MHD_start_daemon(
      flags, static_cast<uint16_t>(options.port), nullptr, nullptr,
      &HttpExchange::Callbacks::OnRequest, s.get(), MHD_OPTION_SOCK_ADDR, addr,
      MHD_OPTION_NOTIFY_COMPLETED, &HttpExchange::Callbacks::OnCompleted, s.get(),
      MHD_OPTION_THREAD_POOL_SIZE, static_cast<unsigned>(std::max(1, options.threads)),
      MHD_OPTION_CONNECTION_TIMEOUT, static_cast<unsigned>(options.idle_timeout_s),
      MHD_OPTION_CONNECTION_LIMIT, 16384u, MHD_OPTION_EXTERNAL_LOGGER, logger, nullptr,
      tls ? MHD_OPTION_HTTPS_MEM_CERT : MHD_OPTION_END, options.tls_cert.c_str(),
      MHD_OPTION_HTTPS_MEM_KEY, options.tls_key.c_str(), MHD_OPTION_END);
  if (s->daemon_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot serve HTTP on ", options.host, ":",
                                               options.port, tls ? " (TLS)" : ""));
  }
  const MHD_DaemonInfo* info = MHD_get_daemon_info(s->daemon_, MHD_DAEMON_INFO_BIND_PORT);
  s->port_ = info != nullptr ? info->port : options.port;
  return s;
}

void HttpServer::StopAccepting() {
  if (listen_fd_ < 0) listen_fd_ = MHD_quiesce_daemon(daemon_);
}

HttpServer::~HttpServer() {
  if (daemon_ == nullptr) return;
  StopAccepting();
  // libmicrohttpd must not stop with suspended connections: wake each, to end it (a waiting
  // answer becomes 503, a stream ends), and give them a moment to go out.
  {
    MutexLock lock(&mu_);
    for (HttpExchange* ex : live_) {
      MutexLock l(&ex->mu_);
      ex->stopping_ = true;
      ex->WakeLocked();
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (open_exchanges() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  MHD_stop_daemon(daemon_);
  if (listen_fd_ >= 0) close(listen_fd_);
}

size_t HttpServer::open_exchanges() const {
  MutexLock lock(&mu_);
  return live_.size();
}

int HttpStatusOf(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kAlreadyExists:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kUnavailable:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

std::string OpenAiErrorBody(const absl::Status& status, const std::string& param) {
  const int http = HttpStatusOf(status.code());
  const char* type = http == 400   ? "invalid_request_error"
                     : http == 401 ? "authentication_error"
                     : http == 403 ? "permission_error"
                     : http == 404 ? "not_found_error"
                     : http == 429 ? "rate_limit_error"
                     : http == 503 ? "service_unavailable_error"
                     : http == 504 ? "timeout_error"
                                   : "server_error";
  nlohmann::json e = {{"message", std::string(status.message())},
                      {"type", type},
                      {"param", param.empty() ? nlohmann::json() : nlohmann::json(param)},
                      {"code", http}};
  return nlohmann::json{{"error", std::move(e)}}.dump();
}

}  // namespace moelora
