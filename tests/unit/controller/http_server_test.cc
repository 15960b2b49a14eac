// HttpServer on loopback with handlers written for each case, and a raw-socket client: answers
// from another thread later, streams, a body over the limit, a client that leaves mid-stream,
// and a server destroyed while connections wait (none may hang).
#include "controller/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace moelora {
namespace {

using namespace std::chrono_literals;

int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  timeval tv{10, 0};  // a backstop: a hung server fails the test instead of hanging it
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  return fd;
}

void Send(int fd, const std::string& s) {
  ASSERT_EQ(write(fd, s.data(), s.size()), static_cast<ssize_t>(s.size()));
}

// HTTP/1.0: the server closes the connection after the answer, whose body is then raw bytes.
std::string ReadAll(int fd) {
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  close(fd);
  return out;
}

std::string Request(int port, const std::string& method, const std::string& body = "") {
  const int fd = Connect(port);
  Send(fd, method + " /x HTTP/1.0\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" +
               body);
  return ReadAll(fd);
}

std::string Body(const std::string& response) {
  const size_t at = response.find("\r\n\r\n");
  return at == std::string::npos ? "" : response.substr(at + 4);
}

HttpServer::Options Loopback() {
  HttpServer::Options o;
  o.host = "127.0.0.1";
  o.port = 0;
  return o;
}

TEST(HttpServerTest, AnswersFromAnotherThreadLater) {
  std::vector<std::thread> threads;
  auto server = HttpServer::Start(Loopback(), [&](std::shared_ptr<HttpExchange> ex) {
    threads.emplace_back([ex] {
      std::this_thread::sleep_for(50ms);
      ex->Respond(201, "text/plain", ex->method() + " " + ex->path() + " " + ex->body());
    });
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string r = Request((*server)->port(), "POST", "hello");
  EXPECT_EQ(r.substr(9, 3), "201") << r;
  EXPECT_EQ(Body(r), "POST /x hello");
  for (auto& t : threads) t.join();
}

TEST(HttpServerTest, StreamsWhatIsWrittenUntilTheEnd) {
  std::vector<std::thread> threads;
  auto server = HttpServer::Start(Loopback(), [&](std::shared_ptr<HttpExchange> ex) {
    ex->StartStream(200, "text/event-stream");
    threads.emplace_back([ex] {
      for (const char* part : {"data: a\n\n", "data: b\n\n", "data: [DONE]\n\n"}) {
        std::this_thread::sleep_for(20ms);
        ex->Write(part);
      }
      ex->End();
      ex->Write("after the end is dropped");
    });
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string r = Request((*server)->port(), "GET");
  EXPECT_NE(r.find("text/event-stream"), std::string::npos) << r;
  EXPECT_EQ(Body(r), "data: a\n\ndata: b\n\ndata: [DONE]\n\n");
  for (auto& t : threads) t.join();
}

TEST(HttpServerTest, ABodyOverTheLimitGets413) {
  HttpServer::Options o = Loopback();
  o.max_body_bytes = 16;
  std::atomic<int> handled{0};
  auto server = HttpServer::Start(o, [&](std::shared_ptr<HttpExchange> ex) {
    ++handled;
    ex->Respond(200, "text/plain", "");
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string r = Request((*server)->port(), "POST", std::string(100, 'x'));
  EXPECT_EQ(r.substr(9, 3), "413") << r;
  EXPECT_NE(Body(r).find("\"error\""), std::string::npos);
  EXPECT_EQ(handled, 0);
}

TEST(HttpServerTest, AClientThatLeavesMidStreamIsNoticed) {
  std::atomic<bool> closed{false}, stop{false};
  std::vector<std::thread> threads;
  auto server = HttpServer::Start(Loopback(), [&](std::shared_ptr<HttpExchange> ex) {
    ex->SetOnClose([&] { closed = true; });
    ex->StartStream(200, "text/event-stream");
    threads.emplace_back([ex, &stop] {
      while (!stop) {
        ex->Write(std::string(1024, 'x'));
        std::this_thread::sleep_for(5ms);
      }
    });
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const int fd = Connect((*server)->port());
  Send(fd, "GET /x HTTP/1.1\r\nHost: x\r\n\r\n");
  char buf[64];
  ASSERT_GT(read(fd, buf, sizeof(buf)), 0);
  close(fd);
  for (int i = 0; i < 500 && !closed; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(closed);
  stop = true;
  for (auto& t : threads) t.join();
  EXPECT_EQ((*server)->open_exchanges(), 0u);
}

TEST(HttpServerTest, StopsWhileAnswersAndStreamsWait) {
  std::vector<std::shared_ptr<HttpExchange>> kept;
  std::atomic<int> closes{0};
  std::mutex mu;
  auto server = HttpServer::Start(Loopback(), [&](std::shared_ptr<HttpExchange> ex) {
    ex->SetOnClose([&] { ++closes; });
    if (ex->method() == "GET") ex->StartStream(200, "text/event-stream");
    std::lock_guard<std::mutex> l(mu);
    kept.push_back(ex);  // never answered (POST) or never ended (GET)
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const int a = Connect((*server)->port());
  Send(a, "POST /x HTTP/1.0\r\nContent-Length: 0\r\n\r\n");
  const int b = Connect((*server)->port());
  Send(b, "GET /x HTTP/1.0\r\n\r\n");
  for (int i = 0; i < 500; ++i) {
    {
      std::lock_guard<std::mutex> l(mu);
      if (kept.size() == 2) break;
    }
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ((*server)->open_exchanges(), 2u);
  const auto t0 = std::chrono::steady_clock::now();
  server->reset();  // must not hang on the suspended connections
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  EXPECT_EQ(closes, 2);
  EXPECT_EQ(ReadAll(a).substr(9, 3), "503");
  ReadAll(b);
  // Answers after the server is gone go nowhere.
  for (auto& ex : kept) {
    ex->Respond(200, "text/plain", "late");
    ex->Write("late");
  }
}

// Reads the answer's status line within `timeout` ("" when none came).
std::string StatusWithin(int fd, std::chrono::seconds timeout) {
  timeval tv{static_cast<time_t>(timeout.count()), 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char buf[256];
  const ssize_t n = read(fd, buf, sizeof(buf));
  return n >= 12 ? std::string(buf, 12) : "";
}

TEST(HttpServerTest, AdmitRefusesAtTheHeadersBeforeAnyBodyIsRead) {
  HttpServer::Options o = Loopback();
  o.admit = [](const HttpExchange& ex) {
    return ex.authorization() == "Bearer ok" ? absl::OkStatus()
                                             : absl::UnauthenticatedError("no token");
  };
  std::atomic<int> handled{0};
  auto server = HttpServer::Start(o, [&](std::shared_ptr<HttpExchange> ex) {
    ++handled;
    ex->Respond(200, "text/plain", "");
  });
  ASSERT_TRUE(server.ok()) << server.status();
  // A body announced, never sent: the answer comes anyway.
  const int fd = Connect((*server)->port());
  Send(fd, "POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 30000000\r\n\r\n");
  EXPECT_EQ(StatusWithin(fd, 5s), "HTTP/1.1 401");
  close(fd);
  EXPECT_EQ(handled, 0);
  const int ok = Connect((*server)->port());
  Send(ok, "POST /x HTTP/1.0\r\nAuthorization: Bearer ok\r\nContent-Length: 2\r\n\r\nhi");
  EXPECT_EQ(ReadAll(ok).substr(9, 3), "200");
  EXPECT_EQ(handled, 1);
}

TEST(HttpServerTest, AContentLengthOverTheLimitIsRefusedBeforeTheBody) {
  HttpServer::Options o = Loopback();
  o.max_body_bytes = 1000;
  auto server = HttpServer::Start(
      o, [&](std::shared_ptr<HttpExchange> ex) { ex->Respond(200, "text/plain", ""); });
  ASSERT_TRUE(server.ok()) << server.status();
  const int fd = Connect((*server)->port());
  Send(fd, "POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n");
  EXPECT_EQ(StatusWithin(fd, 5s), "HTTP/1.1 413");
  close(fd);
}

TEST(HttpServerTest, BodiesHeldAtOnceAreBoundedPerClient) {
  HttpServer::Options o = Loopback();
  o.max_client_buffered_bytes = 100;
  std::vector<std::shared_ptr<HttpExchange>> kept;
  std::mutex mu;
  auto server = HttpServer::Start(o, [&](std::shared_ptr<HttpExchange> ex) {
    std::lock_guard<std::mutex> l(mu);
    kept.push_back(ex);  // its body stays held until taken
    if (ex->path() == "/take") {
      ex->TakeBody();
      ex->Respond(200, "text/plain", "");
    }
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const int first = Connect((*server)->port());
  Send(first, "POST /hold HTTP/1.0\r\nContent-Length: 80\r\n\r\n" + std::string(80, 'x'));
  for (int i = 0; i < 500; ++i) {
    {
      std::lock_guard<std::mutex> l(mu);
      if (!kept.empty()) break;
    }
    std::this_thread::sleep_for(10ms);
  }
  // 80 + 80 > 100: the second is refused at its headers.
  const int second = Connect((*server)->port());
  Send(second, "POST /take HTTP/1.0\r\nContent-Length: 80\r\n\r\n");
  EXPECT_EQ(StatusWithin(second, 5s).substr(9, 3), "429");
  close(second);
  {
    std::lock_guard<std::mutex> l(mu);
    kept[0]->TakeBody();  // released: the next one fits
  }
  const int third = Connect((*server)->port());
  Send(third, "POST /take HTTP/1.0\r\nContent-Length: 80\r\n\r\n" + std::string(80, 'y'));
  EXPECT_EQ(ReadAll(third).substr(9, 3), "200");
  kept[0]->Respond(200, "text/plain", "");
  ReadAll(first);
}

TEST(HttpServerTest, AHandlerThatThrowsIsAnswered500) {
  auto server = HttpServer::Start(
      Loopback(), [&](std::shared_ptr<HttpExchange>) { throw std::runtime_error("boom"); });
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string r = Request((*server)->port(), "POST", "x");
  EXPECT_EQ(r.substr(9, 3), "500") << r;
  EXPECT_EQ(Request((*server)->port(), "POST", "y").substr(9, 3), "500");  // still serving
}

TEST(HttpServerTest, AClientThatHangsUpWhileItsAnswerWaitsIsCutShort) {
  std::atomic<bool> closed{false};
  std::vector<std::shared_ptr<HttpExchange>> kept;
  std::mutex mu;
  auto server = HttpServer::Start(Loopback(), [&](std::shared_ptr<HttpExchange> ex) {
    ex->SetOnClose([&] { closed = true; });
    std::lock_guard<std::mutex> l(mu);
    kept.push_back(ex);  // never answered: the connection waits suspended
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const int fd = Connect((*server)->port());
  Send(fd, "POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n");
  for (int i = 0; i < 500; ++i) {
    {
      std::lock_guard<std::mutex> l(mu);
      if (!kept.empty()) break;
    }
    std::this_thread::sleep_for(10ms);
  }
  close(fd);
  for (int i = 0; i < 500 && !closed; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(closed);
  EXPECT_EQ((*server)->open_exchanges(), 0u);
}

TEST(HttpServerTest, ARequestOnAKeptAliveConnectionWhileStoppingGets503) {
  std::vector<std::shared_ptr<HttpExchange>> kept;
  std::mutex mu;
  auto server = HttpServer::Start(Loopback(), [&](std::shared_ptr<HttpExchange> ex) {
    if (ex->path() == "/now") return ex->Respond(200, "text/plain", "ok");
    std::lock_guard<std::mutex> l(mu);
    kept.push_back(ex);
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const int fd = Connect((*server)->port());
  Send(fd, "GET /now HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(StatusWithin(fd, 5s), "HTTP/1.1 200");
  (*server)->StopAccepting();
  // The same connection, kept alive: a new request is refused, never left waiting.
  Send(fd, "GET /wait HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(StatusWithin(fd, 5s), "HTTP/1.1 503");
  const auto t0 = std::chrono::steady_clock::now();
  server->reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  close(fd);
  std::lock_guard<std::mutex> l(mu);
  EXPECT_TRUE(kept.empty());
}

}  // namespace
}  // namespace moelora
