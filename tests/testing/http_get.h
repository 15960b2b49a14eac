// A minimal HTTP/1.0 client over loopback for tests (reading /metrics, posting JSON). Tests only:
// the product itself serves HTTP through prometheus-cpp and never acts as an HTTP client.
#ifndef MOELORA_TESTS_TESTING_HTTP_GET_H_
#define MOELORA_TESTS_TESTING_HTTP_GET_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

namespace moelora::testing {

// The response body of one HTTP/1.0 request ("" on any error): `body` is sent as JSON when set.
inline std::string HttpRequest(int port, const std::string& method, const std::string& path,
                               const std::string& body = "") {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  std::string req = method + " " + path + " HTTP/1.0\r\nHost: localhost\r\n";
  if (!body.empty()) {
    req +=
        "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  }
  req += "\r\n" + body;
  for (size_t sent = 0; sent < req.size();) {
    const ssize_t n = send(fd, req.data() + sent, req.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) {
      close(fd);
      return "";
    }
    sent += static_cast<size_t>(n);
  }
  std::string resp;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) resp.append(buf, n);
  close(fd);
  const size_t at = resp.find("\r\n\r\n");
  return at == std::string::npos ? "" : resp.substr(at + 4);
}

inline std::string HttpGet(int port, const std::string& path) {
  return HttpRequest(port, "GET", path);
}

}  // namespace moelora::testing

#endif  // MOELORA_TESTS_TESTING_HTTP_GET_H_
