#include "controller/http_server.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "controller/json_input.h"
#include "nlohmann/json.hpp"

namespace moelora {

namespace {

// The peer's address as text ("" when libmicrohttpd cannot say).
std::string ClientAddress(MHD_Connection* conn) {
  const MHD_ConnectionInfo* info =
      MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
  if (info == nullptr || info->client_addr == nullptr) return "";
  char buf[INET6_ADDRSTRLEN] = {0};
  const sockaddr* a = info->client_addr;
  if (a->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a)->sin_addr, buf, sizeof(buf));
  } else if (a->sa_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr, buf, sizeof(buf));
  }
  return buf;
}

// Content-Length as sent: -1 when absent, SIZE_MAX-ish when it does not parse as a number.
int64_t ContentLength(MHD_Connection* conn) {
  const char* v = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Length");
  if (v == nullptr) return -1;
  int64_t n = 0;
  for (const char* p = v; *p != 0; ++p) {
    if (*p < '0' || *p > '9' || n > (INT64_MAX - 9) / 10) return INT64_MAX;
    n = n * 10 + (*p - '0');
  }
  return n;
}

}  // namespace

absl::Status BodyBudget::Reserve(const std::string& client, size_t bytes) {
  MutexLock lock(&mu_);
  size_t& mine = by_client_[client];
  if (mine + bytes > per_client_) {
    if (mine == 0) by_client_.erase(client);
    return absl::ResourceExhaustedError(absl::StrCat(
        "this client's request bodies would hold more than ", per_client_,
        " bytes at once (--http-max-client-buffered-bytes): retry when its requests are read"));
  }
  if (held_ + bytes > total_) {
    if (mine == 0) by_client_.erase(client);
    return absl::UnavailableError(
        absl::StrCat("request bodies would hold more than ", total_,
                     " bytes at once (--http-max-buffered-bytes): retry later"));
  }
  mine += bytes;
  held_ += bytes;
  return absl::OkStatus();
}

void BodyBudget::Release(const std::string& client, size_t bytes) {
  if (bytes == 0) return;
  MutexLock lock(&mu_);
  auto it = by_client_.find(client);
  if (it != by_client_.end()) {
    it->second -= std::min(it->second, bytes);
    if (it->second == 0) by_client_.erase(it);
  }
  held_ -= std::min(held_, bytes);
}

std::string HttpExchange::TakeBody() {
  std::string b = std::move(body_);
  body_.clear();
  body_.shrink_to_fit();
  if (budget_) budget_->Release(client_, reserved_.exchange(0));
  return b;
}

// libmicrohttpd's callbacks. Each request's exchange lives in a heap shared_ptr in *req_cls
// from the first call of OnRequest to OnCompleted; a stream's reader holds another.
struct HttpExchange::Callbacks {
  static MHD_Result OnRequest(void* cls, MHD_Connection* conn, const char* url, const char* method,
                              const char* /*version*/, const char* upload_data,
                              size_t* upload_data_size, void** req_cls) {
    auto* server = static_cast<HttpServer*>(cls);
    if (*req_cls == nullptr) return OnHeaders(server, conn, url, method, req_cls);
    HttpExchange* ex = static_cast<std::shared_ptr<HttpExchange>*>(*req_cls)->get();
    if (*upload_data_size > 0) {
      const size_t n = *upload_data_size;
      *upload_data_size = 0;
      if (ex->dispatched_ || ex->too_large_ || !ex->refused_.ok()) return MHD_YES;  // dropped
      const size_t need = ex->body_.size() + n;
      if (need > server->options_.max_body_bytes) {
        ex->too_large_ = true;  // the answer is 413
        ex->TakeBody();
        return MHD_YES;
      }
      if (need > ex->reserved_) {  // a body without Content-Length: reserved as it comes
        const size_t more = std::max(need - ex->reserved_, size_t{64} << 10);
        if (absl::Status s = ex->budget_->Reserve(ex->client_, more); !s.ok()) {
          ex->refused_ = s;
          ex->TakeBody();
          return MHD_YES;
        }
        ex->reserved_ += more;
      }
      ex->body_.append(upload_data, n);
      return MHD_YES;
    }
    if (!ex->dispatched_) {
      ex->dispatched_ = true;
      std::shared_ptr<HttpExchange> self = *static_cast<std::shared_ptr<HttpExchange>*>(*req_cls);
      if (ex->too_large_) {
        self->Respond(413, "application/json",
                      OpenAiErrorBody(absl::InvalidArgumentError(absl::StrCat(
                          "the request body is larger than ", server->options_.max_body_bytes,
                          " bytes (--http-max-body-bytes)"))));
      } else if (!ex->refused_.ok()) {
        self->Respond(HttpStatusOf(ex->refused_), "application/json",
                      OpenAiErrorBody(ex->refused_));
      } else {
        Dispatch(server, self);
      }
    }
    return QueueIfAnswered(*static_cast<std::shared_ptr<HttpExchange>*>(*req_cls));
  }

  // The first call: the headers are in, the body not yet read. What is refused here is answered
  // at once, and libmicrohttpd then reads none of the body.
  static MHD_Result OnHeaders(HttpServer* server, MHD_Connection* conn, const char* url,
                              const char* method, void** req_cls) {
    std::shared_ptr<HttpExchange> ex(new HttpExchange());
    ex->method_ = method;
    ex->path_ = url;
    if (const char* a = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Authorization")) {
      ex->authorization_ = a;
    }
    ex->client_ = ClientAddress(conn);
    ex->budget_ = server->budget_;
    // From its first request on, a connection waits for the next one up to the idle timeout.
    MHD_set_connection_option(conn, MHD_CONNECTION_OPTION_TIMEOUT,
                              static_cast<unsigned>(server->options_.idle_timeout_s));
    bool stopping = false;
    {
      MutexLock lock(&server->mu_);
      server->live_.insert(ex.get());
      stopping = server->stopping_ || server->draining_;
      MutexLock l(&ex->mu_);
      ex->conn_ = conn;
    }
    *req_cls = new std::shared_ptr<HttpExchange>(ex);
    absl::Status refused;
    if (stopping) {
      refused = absl::UnavailableError("the server is stopping");
    } else if (server->options_.admit) {
      refused = Guarded([&] { return server->options_.admit(*ex); });
    }
    const int64_t length = ContentLength(conn);
    if (refused.ok() && length > static_cast<int64_t>(server->options_.max_body_bytes)) {
      ex->dispatched_ = true;
      ex->Respond(413, "application/json",
                  OpenAiErrorBody(absl::InvalidArgumentError(absl::StrCat(
                      "the request body (Content-Length ", length, ") is larger than ",
                      server->options_.max_body_bytes, " bytes (--http-max-body-bytes)"))));
      return QueueIfAnswered(ex);
    }
    if (refused.ok() && length > 0) {
      refused = ex->budget_->Reserve(ex->client_, static_cast<size_t>(length));
      if (refused.ok()) ex->reserved_ = static_cast<size_t>(length);
    }
    if (refused.ok()) return MHD_YES;  // the body comes next
    ex->dispatched_ = true;
    ex->Respond(HttpStatusOf(refused), "application/json", OpenAiErrorBody(refused));
    return QueueIfAnswered(ex);
  }

  // fn(), with any exception turned into INTERNAL (and logged): no exception leaves a callback.
  template <typename Fn>
  static absl::Status Guarded(Fn&& fn) {
    try {
      return fn();
    } catch (const std::exception& e) {
      LOG(ERROR) << "HTTP: exception: " << e.what();
      return absl::InternalError(absl::StrCat("internal error: ", e.what()));
    } catch (...) {
      LOG(ERROR) << "HTTP: unknown exception";
      return absl::InternalError("internal error");
    }
  }

  static void Dispatch(HttpServer* server, const std::shared_ptr<HttpExchange>& ex) {
    absl::Status s = Guarded([&] {
      server->handler_(ex);
      return absl::OkStatus();
    });
    if (!s.ok()) ex->Respond(500, "application/json", OpenAiErrorBody(s));
  }

  // The server's thread: hands the answer to libmicrohttpd once there is one, else suspends
  // the connection until there is.
  static MHD_Result QueueIfAnswered(const std::shared_ptr<HttpExchange>& ex) {
    MutexLock lock(&ex->mu_);
    if (ex->queued_) return MHD_YES;
    if (!ex->answered_) {
      if (ex->stopping_ || ex->client_left_) {
        // No one reads a hung-up client's answer: it only lets libmicrohttpd end the request.
        ex->answered_ = ex->ended_ = true;
        ex->status_ = 503;
        ex->content_type_ = "application/json";
        ex->data_ = OpenAiErrorBody(absl::UnavailableError(ex->stopping_ ? "the server is stopping"
                                                                         : "the client hung up"));
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
    if (ex->stopping_ || ex->client_left_ || ex->conn_ == nullptr) {
      return MHD_CONTENT_READER_END_WITH_ERROR;
    }
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
      ex->data_.clear();
      cut_short = toe != MHD_REQUEST_TERMINATED_COMPLETED_OK || !ex->ended_ || ex->stopping_ ||
                  ex->client_left_;
      on_close = std::move(ex->on_close_);
      ex->on_close_ = nullptr;
    }
    if (ex->budget_) ex->budget_->Release(ex->client_, ex->reserved_.exchange(0));
    auto* server = static_cast<HttpServer*>(cls);
    {
      MutexLock lock(&server->mu_);
      server->live_.erase(ex.get());
    }
    if (on_close && cut_short) {
      if (absl::Status s = Guarded([&] {
            on_close();
            return absl::OkStatus();
          });
          !s.ok()) {
        LOG(ERROR) << "HTTP close callback: " << s;
      }
    }
  }

  // A new connection: until its first request's headers are in, it may be quiet at most
  // header_timeout_s.
  static void OnConnection(void* cls, MHD_Connection* conn, void** /*socket_context*/,
                           MHD_ConnectionNotificationCode code) {
    if (code != MHD_CONNECTION_NOTIFY_STARTED) return;
    auto* server = static_cast<HttpServer*>(cls);
    MHD_set_connection_option(conn, MHD_CONNECTION_OPTION_TIMEOUT,
                              static_cast<unsigned>(server->options_.header_timeout_s));
  }
};

void HttpServer::WatchHangUps() {
  MutexLock lock(&mu_);
  while (!stopping_) {
    stop_cv_.WaitFor(&mu_, std::chrono::milliseconds(100));
    if (stopping_) break;
    for (HttpExchange* ex : live_) {
      MutexLock l(&ex->mu_);
      if (!ex->suspended_ || ex->conn_ == nullptr || ex->client_left_) continue;
      // While suspended, libmicrohttpd neither reads nor closes the socket: the peer's end of
      // the stream (POLLRDHUP, seen even with bytes still unread before it, such as TLS's
      // close_notify) or an error means the client is gone. Bytes alone (a pipelined request)
      // are not an end.
      const MHD_ConnectionInfo* info =
          MHD_get_connection_info(ex->conn_, MHD_CONNECTION_INFO_CONNECTION_FD);
      if (info == nullptr) continue;
      pollfd p{info->connect_fd, POLLRDHUP, 0};
      if (poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
        ex->client_left_ = true;
        ex->WakeLocked();
      }
    }
  }
}

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
  s->options_ = options;
  s->budget_ =
      std::make_shared<BodyBudget>(options.max_buffered_bytes, options.max_client_buffered_bytes);
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
      MHD_OPTION_NOTIFY_CONNECTION, &HttpExchange::Callbacks::OnConnection, s.get(),
      MHD_OPTION_CONNECTION_TIMEOUT, static_cast<unsigned>(options.idle_timeout_s),
      MHD_OPTION_CONNECTION_LIMIT, options.max_connections, MHD_OPTION_PER_IP_CONNECTION_LIMIT,
      options.max_client_connections, MHD_OPTION_EXTERNAL_LOGGER, logger, nullptr,
      tls ? MHD_OPTION_HTTPS_MEM_CERT : MHD_OPTION_END, options.tls_cert.c_str(),
      MHD_OPTION_HTTPS_MEM_KEY, options.tls_key.c_str(), MHD_OPTION_END);
  if (s->daemon_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot serve HTTP on ", options.host, ":",
                                               options.port, tls ? " (TLS)" : ""));
  }
  const MHD_DaemonInfo* info = MHD_get_daemon_info(s->daemon_, MHD_DAEMON_INFO_BIND_PORT);
  s->port_ = info != nullptr ? info->port : options.port;
  s->watcher_ = std::thread([server = s.get()] { server->WatchHangUps(); });
  return s;
}

void HttpServer::StopAccepting() {
  {
    MutexLock lock(&mu_);
    draining_ = true;
  }
  if (listen_fd_ < 0) listen_fd_ = MHD_quiesce_daemon(daemon_);
}

HttpServer::~HttpServer() {
  if (daemon_ == nullptr) return;
  StopAccepting();
  // libmicrohttpd must not stop with suspended connections (it aborts): from here no exchange
  // suspends (a request that starts now, on a kept-alive connection, is answered 503 at once),
  // and each that waits is woken to end (a waiting answer becomes 503, a stream ends).
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    for (HttpExchange* ex : live_) {
      MutexLock l(&ex->mu_);
      ex->stopping_ = true;
      ex->WakeLocked();
    }
  }
  stop_cv_.SignalAll();
  watcher_.join();
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

absl::Status MarkFinal(absl::Status s) {
  if (!s.ok()) s.SetPayload(kFinalPayload, absl::Cord("1"));
  return s;
}

int HttpStatusOf(const absl::Status& status) {
  if (status.GetPayload(kFinalPayload).has_value()) return 400;
  return HttpStatusOf(status.code());
}

std::string OpenAiErrorBody(const absl::Status& status, const std::string& param) {
  const int http = HttpStatusOf(status);
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
  return JsonText(nlohmann::json{{"error", std::move(e)}});
}

}  // namespace moelora
