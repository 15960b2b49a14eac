// libFuzzer: whole HTTP requests (method, path, headers, body, token) through the controller's
// real HTTP server and OpenAI API on loopback, over a real Controller whose worker group is the
// unit tests' fake (tokens come back without a model). Every input must be answered within 10 s
// with a well-formed status line, a JSON error body where the answer is an error, and nothing
// may crash (ASan+UBSan) or grow without bound (-rss_limit_mb).
//
// Input: byte 0 picks the Authorization header (none, the inference token, the admin token, or
// the first line of the rest as the header's value); then lines: method, path, headers ("Name:
// value", up to an empty line), and the body. Content-Length, Transfer-Encoding, Connection and
// Expect are the harness's own, so that every request is complete and deserves an answer.
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "controller/auth.h"
#include "controller/controller.h"
#include "controller/http_server.h"
#include "controller/openai_api.h"
#include "nlohmann/json.hpp"
#include "schema/model_info.h"
#include "tests/unit/controller/fake_worker_group.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace {

using namespace moelora;  // NOLINT

struct Service {
  std::string state_dir;
  std::unique_ptr<Registry> registry;
  ControllerMetrics metrics;
  SimulatedClock clock;
  testing::FakeWorkerGroup group{4, &clock};
  std::unique_ptr<Controller> controller;
  std::unique_ptr<TokenAuth> auth;
  std::unique_ptr<OpenAiApi> api;
  std::unique_ptr<HttpServer> http;

  Service() {
    char tmpl[] = "/tmp/http_fuzz.XXXXXX";
    state_dir = mkdtemp(tmpl);
    static std::string dir_to_remove = state_dir;
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(dir_to_remove, ec);
    });
    registry = *Registry::Open(state_dir);
    const std::string model = std::string(MOELORA_TEST_DATA_DIR) + "/qwen3_moe/model";
    ControllerOptions o;
    o.adapter_root = MOELORA_TEST_DATA_DIR;
    o.mixed = true;
    o.max_lora_rank = 16;
    o.clock = &clock;
    o.model = *ReadModelInfo(model);
    o.tokenizer = *tok::Tokenizer::Load(model);
    o.eos_token_ids = o.tokenizer->eos_token_ids();
    controller = std::make_unique<Controller>(o, registry.get(), &group, &metrics);
    if (!controller->OnGroupReady().ok()) std::abort();
    controller->Start();
    const std::string tokens = state_dir + "/tokens";
    std::ofstream(tokens) << "admin-token admin\ninference-token inference\n";
    auth = *TokenAuth::Load(tokens);
    OpenAiOptions oo;
    oo.served_model_name = "base";
    oo.model_path = model;
    oo.chat_template = *tok::ChatTemplate::Parse(*tok::ReadChatTemplate(model));
    oo.special_tokens = *tok::ReadSpecialTokenVariables(model);
    // Chat answers (the fake's tokens) through the output parsers too.
    oo.reasoning_parser = "qwen3";
    oo.tool_call_parser = "hermes";
    api = std::make_unique<OpenAiApi>(controller.get(), &metrics, auth.get(), oo);
    api->set_healthy(true);
    HttpServer::Options ho;
    ho.host = "127.0.0.1";
    ho.port = 0;
    ho.max_body_bytes = 1 << 20;
    ho.idle_timeout_s = 5;
    ho.header_timeout_s = 5;
    ho.admit = [a = api.get()](const HttpExchange& ex) { return a->Admit(ex); };
    http = *HttpServer::Start(
        ho, [a = api.get()](std::shared_ptr<HttpExchange> ex) { a->Handle(std::move(ex)); });
  }
};

Service& TheService() {
  static Service* s = new Service();  // never destroyed: libFuzzer exits without unwinding
  return *s;
}

std::string Clean(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c != '\r' && c != '\n' && c != '\0') out.push_back(c);
  }
  return out;
}

// A request token: no spaces or controls (else the request line is not one any more).
std::string Token(std::string_view s, const char* fallback) {
  std::string out;
  for (char c : s) {
    if (static_cast<unsigned char>(c) > 0x20 && c != 0x7f) out.push_back(c);
  }
  return out.empty() ? fallback : out;
}

std::string Exchange(int port, const std::string& request) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  // libFuzzer's -timeout is a SIGALRM every second: any of the calls below may return EINTR. An
  // interrupted connect goes on in the background; its outcome is read once the socket is
  // writable.
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    int err = errno;
    if (err == EINTR) {
      pollfd p{fd, POLLOUT, 0};
      int ready;
      do {
        ready = poll(&p, 1, 10000);
      } while (ready < 0 && errno == EINTR);
      socklen_t len = sizeof(err);
      if (ready != 1 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = ETIMEDOUT;
    }
    if (err != 0) {
      std::fprintf(stderr, "connect: %s\n", std::strerror(err));
      __builtin_trap();  // the server stopped listening
    }
  }
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // answered and closed early (a refusal at the headers)
    sent += static_cast<size_t>(n);
  }
  std::string out;
  char buf[65536];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n > 0) {
      out.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      std::fprintf(stderr, "no answer within 10 s to:\n%.2000s\n", request.c_str());
      __builtin_trap();  // a hang
    }
    break;
  }
  // Reset rather than close: thousands of connections a second would otherwise leave the
  // loopback's ports in TIME_WAIT until connect fails.
  linger reset{1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
  close(fd);
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Service& s = TheService();
  if (size == 0) return 0;
  std::string_view in(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::string authorization;
  switch (data[0] % 4) {
    case 0:
      break;
    case 1:
      authorization = "Bearer inference-token";
      break;
    case 2:
      authorization = "Bearer admin-token";
      break;
    default: {
      const size_t nl = in.find('\n');
      authorization = Clean(in.substr(0, nl));
      in = nl == std::string_view::npos ? std::string_view() : in.substr(nl + 1);
    }
  }
  auto next_line = [&in]() {
    const size_t nl = in.find('\n');
    std::string_view line = in.substr(0, nl);
    in = nl == std::string_view::npos ? std::string_view() : in.substr(nl + 1);
    return line;
  };
  const std::string method = Token(next_line(), "GET");
  const std::string path = Token(next_line(), "/");
  std::string headers;
  while (!in.empty()) {
    const std::string line = Clean(next_line());
    if (line.empty()) break;
    const std::string name = absl::AsciiStrToLower(line.substr(0, line.find(':')));
    if (line.find(':') == std::string::npos || name == "content-length" ||
        name == "transfer-encoding" || name == "connection" || name == "expect" || name == "host") {
      continue;
    }
    headers += line + "\r\n";
  }
  const std::string body(in);
  std::string request = method + " " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n";
  if (!authorization.empty()) request += "Authorization: " + authorization + "\r\n";
  request += headers + "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  const std::string answer = Exchange(s.http->port(), request);
  if (answer.empty()) return 0;  // closed without an answer: a request libmicrohttpd refused
  if (!absl::StartsWith(answer, "HTTP/1.1 ") && !absl::StartsWith(answer, "HTTP/1.0 ")) {
    __builtin_trap();
  }
  const int status = std::atoi(answer.c_str() + 9);
  if (status < 100 || status > 599) __builtin_trap();
  // Our own error answers are JSON in OpenAI's shape (libmicrohttpd's own 400s are HTML).
  const size_t end = answer.find("\r\n\r\n");
  if (status >= 400 && end != std::string::npos &&
      answer.substr(0, end).find("application/json") != std::string::npos) {
    const auto j = nlohmann::json::parse(answer.substr(end + 4), nullptr, false);
    if (j.is_discarded() || !j.contains("error") || !j["error"].contains("message")) {
      std::fprintf(stderr, "not an OpenAI error body:\n%.2000s\n", answer.c_str());
      __builtin_trap();
    }
  }
  return 0;
}
