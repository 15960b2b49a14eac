// An HTTP/1.1 server on GNU libmicrohttpd for the controller's OpenAI-compatible API.
//
// libmicrohttpd polls every connection from a few threads (epoll) and lets a connection be
// suspended while it has nothing to send: a request whose answer is not ready, or a stream
// (server-sent events) waiting for its next tokens, holds no thread, so hundreds of open
// streams cost memory, not threads (docs/decisions: the library was chosen by measuring that).
// A handler gets an HttpExchange and answers from any thread, now or later: Respond once, or
// StartStream, Write any number of times, End.
//
// Hostile clients: the request's headers are checked (Options::admit, Content-Length, the
// buffered-body budgets) before any of its body is read; bodies held at once are bounded in all
// and per client address, connections too; a connection that goes quiet before its headers end
// is closed after header_timeout_s. A client that hangs up while its answer is not ready is seen
// (the suspended sockets are polled for the peer's end) and its exchange cut short, so that what it
// asked for stops. No exception from a handler escapes: it is answered 500.
//
// Thread-safety: HttpExchange's methods may be called from any thread. The handler and the
// close callbacks run on the server's threads: they must only hand work on.
#ifndef MOELORA_CONTROLLER_HTTP_SERVER_H_
#define MOELORA_CONTROLLER_HTTP_SERVER_H_

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"

struct MHD_Connection;
struct MHD_Daemon;

namespace moelora {

class HttpServer;

// Bytes of request bodies held at once, in all and per client address.
class BodyBudget {
 public:
  BodyBudget(size_t total, size_t per_client) : total_(total), per_client_(per_client) {}
  // OK, or RESOURCE_EXHAUSTED (this client's share) / UNAVAILABLE (the server's) saying which.
  absl::Status Reserve(const std::string& client, size_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  void Release(const std::string& client, size_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const size_t total_, per_client_;
  Mutex mu_;
  size_t held_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, size_t> by_client_ ABSL_GUARDED_BY(mu_);
};

class HttpExchange {
 public:
  const std::string& method() const { return method_; }
  const std::string& path() const { return path_; }  // without the query string
  const std::string& body() const { return body_; }
  const std::string& authorization() const { return authorization_; }  // the header, or ""
  const std::string& client() const { return client_; }                // the peer's address
  // The body, moved out (it no longer counts against the buffered-body budgets). Once.
  std::string TakeBody();

  // The whole answer (the first answer wins; later ones and answers after the client left are
  // dropped).
  void Respond(int status, std::string content_type, std::string body) ABSL_LOCKS_EXCLUDED(mu_);
  // Starts an answer of unknown length (chunked): then Write, then End.
  void StartStream(int status, std::string content_type) ABSL_LOCKS_EXCLUDED(mu_);
  void Write(std::string data) ABSL_LOCKS_EXCLUDED(mu_);
  void End() ABSL_LOCKS_EXCLUDED(mu_);
  // Called once, on a server thread, when the connection ends before the answer was complete
  // (the client left, or the server stops); at once, on this thread, when that happened
  // already. Set it before answering. It is dropped when the request completes either way, so
  // it may hold what must live as long as the request.
  void SetOnClose(std::function<void()> fn) ABSL_LOCKS_EXCLUDED(mu_);

  // The server's callbacks (http_server.cc); not for handlers.
  struct Callbacks;

 private:
  friend class HttpServer;
  friend struct Callbacks;
  HttpExchange() = default;
  // Resumes the connection if it waits (mu_ held).
  void WakeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Set before the handler runs, then only read (body_ until TakeBody).
  std::string method_, path_, authorization_, body_, client_;
  bool too_large_ = false;
  absl::Status refused_;     // the headers were refused (admit, budget): the answer, body dropped
  bool dispatched_ = false;  // the handler ran (only the connection's server thread reads it)
  std::shared_ptr<BodyBudget> budget_;
  std::atomic<size_t> reserved_{0};  // bytes of budget_ this exchange holds

  Mutex mu_;
  MHD_Connection* conn_ ABSL_GUARDED_BY(mu_) = nullptr;  // null once the request completed
  bool suspended_ ABSL_GUARDED_BY(mu_) = false;
  bool answered_ ABSL_GUARDED_BY(mu_) = false;  // Respond or StartStream was called
  bool queued_ ABSL_GUARDED_BY(mu_) = false;    // the answer went to libmicrohttpd
  bool stream_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;        // End was called (or Respond)
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;     // the server stops: end now
  bool client_left_ ABSL_GUARDED_BY(mu_) = false;  // seen gone while suspended: end now
  int status_ ABSL_GUARDED_BY(mu_) = 0;
  std::string content_type_ ABSL_GUARDED_BY(mu_);
  std::string data_ ABSL_GUARDED_BY(mu_);  // the body, or stream bytes not yet sent
  size_t sent_ ABSL_GUARDED_BY(mu_) = 0;   // of a stream's data_
  std::function<void()> on_close_ ABSL_GUARDED_BY(mu_);
};

class HttpServer {
 public:
  using Handler = std::function<void(std::shared_ptr<HttpExchange>)>;
  struct Options {
    std::string host = "0.0.0.0";  // an IPv4 or IPv6 address
    int port = 8000;               // 0: any free port
    int threads = 2;               // polling threads
    // PEM text; both set: HTTPS.
    std::string tls_cert, tls_key;
    size_t max_body_bytes = 32u << 20;  // a larger body gets 413
    int idle_timeout_s = 300;           // an idle keep-alive connection is closed after this
    int header_timeout_s = 30;          // a new connection quiet this long before its headers
    // Bodies held at once (being read, or handed to the handler and not yet taken), in all (a
    // request past it: 503) and per client address (429).
    size_t max_buffered_bytes = 512u << 20;
    size_t max_client_buffered_bytes = 128u << 20;
    unsigned max_connections = 16384;
    unsigned max_client_connections = 0;  // per client address; 0: no bound but the total
    // Runs on the server's thread once a request's headers are in, before its body is read: a
    // status other than OK is the answer (the body is never read). Unset: every request goes on.
    std::function<absl::Status(const HttpExchange&)> admit;
  };
  // Listens and serves until destroyed. UNAVAILABLE naming the address when it cannot listen.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const Options& options,
                                                                         Handler handler);
  // Stops accepting, ends waiting answers (503) and open streams, and joins the threads.
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // New connections are refused from now on, and new requests on kept-alive ones answered 503
  // (draining); requests in flight go on.
  void StopAccepting();
  int port() const { return port_; }
  size_t open_exchanges() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend struct HttpExchange::Callbacks;
  explicit HttpServer(Handler handler) : handler_(std::move(handler)) {}
  // Every 100 ms: a suspended exchange whose client hung up (POLLRDHUP) is ended (its close
  // callback runs).
  void WatchHangUps() ABSL_LOCKS_EXCLUDED(mu_);

  Handler handler_;
  Options options_;
  std::shared_ptr<BodyBudget> budget_;
  MHD_Daemon* daemon_ = nullptr;
  int port_ = 0;
  int listen_fd_ = -1;  // after StopAccepting: closed once the daemon stopped
  mutable Mutex mu_;
  CondVar stop_cv_;
  absl::flat_hash_set<HttpExchange*> live_ ABSL_GUARDED_BY(mu_);
  bool draining_ ABSL_GUARDED_BY(mu_) = false;  // StopAccepting: new requests get 503
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;  // the destructor runs
  std::thread watcher_;
};

// The OpenAI error body {"error": {"message", "type", "param", "code"}} (the message's invalid
// UTF-8 replaced) and the HTTP status of an absl status code (INVALID_ARGUMENT,
// FAILED_PRECONDITION, OUT_OF_RANGE, ALREADY_EXISTS 400, UNAUTHENTICATED 401, PERMISSION_DENIED
// 403, NOT_FOUND 404, RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, DEADLINE_EXCEEDED 504, else 500).
// A status with the kFinalPayload payload is about the request itself, whatever its code (a
// RESOURCE_EXHAUSTED adapter rank above --max-lora-rank): 400, not 429, which clients retry.
inline constexpr char kFinalPayload[] = "type.moelora.dev/final";
absl::Status MarkFinal(absl::Status s);
int HttpStatusOf(absl::StatusCode code);
int HttpStatusOf(const absl::Status& status);
std::string OpenAiErrorBody(const absl::Status& status, const std::string& param = "");

}  // namespace moelora

#endif  // MOELORA_CONTROLLER_HTTP_SERVER_H_
