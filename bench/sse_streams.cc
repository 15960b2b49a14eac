// bench/sse_streams: what N concurrent server-sent-event streams cost an HTTP server library,
// the measurement behind the HTTP API's choice of libmicrohttpd. Each server, in this process,
// sends every stream E events I ms apart; one client thread (libcurl multi) opens all N streams
// at once and reads them to the end. Printed per server: the wall time against the ideal
// E x I, the most threads the process had beyond its count before the server started (sampled
// every 5 ms), and the resident memory that grew meanwhile.
//   - libmicrohttpd through controller/http_server.h (2 polling threads; a stream waiting for
//     its next event is a suspended connection, and one ticker thread writes the events);
//   - cpp-httplib (Debian's libcpp-httplib) with its default thread pool, and with a pool of N:
//     a chunked content provider runs on the connection's pool thread and holds it while it
//     waits for the next event.
//
//   sse_streams [--streams N] [--events E] [--interval-ms I]
#include <curl/curl.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "controller/http_server.h"

namespace {

using Clock = std::chrono::steady_clock;

long ProcStatus(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(key, 0) == 0) return std::atol(line.c_str() + std::strlen(key));
  }
  return 0;
}

size_t Discard(char*, size_t size, size_t n, void* bytes) {
  *static_cast<size_t*>(bytes) += size * n;
  return size * n;
}

struct Result {
  double seconds = 0;
  long extra_threads = 0;
  long rss_kb = 0;
  int complete = 0;  // streams that received every event
};

// Opens `n` streams at once from this thread and reads them to the end.
Result Drive(int port, int n, int events, long base_threads, long base_rss) {
  const std::string url = "http://127.0.0.1:" + std::to_string(port) + "/events";
  CURLM* multi = curl_multi_init();
  std::vector<CURL*> handles(n);
  std::vector<size_t> bytes(n, 0);
  for (int i = 0; i < n; ++i) {
    handles[i] = curl_easy_init();
    curl_easy_setopt(handles[i], CURLOPT_URL, url.c_str());
    curl_easy_setopt(handles[i], CURLOPT_WRITEFUNCTION, &Discard);
    curl_easy_setopt(handles[i], CURLOPT_WRITEDATA, &bytes[i]);
    curl_easy_setopt(handles[i], CURLOPT_TIMEOUT, 600L);
    curl_easy_setopt(handles[i], CURLOPT_FORBID_REUSE,
                     1L);  // a stream's connection closes after it
    curl_multi_add_handle(multi, handles[i]);
  }
  std::atomic<bool> done{false};
  Result r;
  std::thread sampler([&] {
    while (!done) {
      r.extra_threads = std::max(r.extra_threads, ProcStatus("Threads:") - base_threads);
      r.rss_kb = std::max(r.rss_kb, ProcStatus("VmRSS:") - base_rss);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  const auto t0 = Clock::now();
  int running = n;
  while (running > 0) {
    curl_multi_perform(multi, &running);
    curl_multi_poll(multi, nullptr, 0, 100, nullptr);
  }
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  done = true;
  sampler.join();
  r.extra_threads -= 1;  // the sampler
  const size_t want = static_cast<size_t>(events) * std::strlen("data: {\"n\": 00000}\n\n");
  for (int i = 0; i < n; ++i) {
    if (bytes[i] == want) ++r.complete;
    curl_multi_remove_handle(multi, handles[i]);
    curl_easy_cleanup(handles[i]);
  }
  curl_multi_cleanup(multi);
  return r;
}

std::string Event(int k) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "data: {\"n\": %05d}\n\n", k);
  return buf;
}

Result Microhttpd(int n, int events, int interval_ms) {
  const long base_threads = ProcStatus("Threads:"), base_rss = ProcStatus("VmRSS:");
  struct Stream {
    std::shared_ptr<moelora::HttpExchange> ex;
    int sent = 0;
  };
  std::mutex mu;
  std::vector<Stream> streams;
  moelora::HttpServer::Options o;
  o.host = "127.0.0.1";
  o.port = 0;
  auto server = moelora::HttpServer::Start(o, [&](std::shared_ptr<moelora::HttpExchange> ex) {
    ex->StartStream(200, "text/event-stream");
    std::lock_guard<std::mutex> l(mu);
    streams.push_back({std::move(ex), 0});
  });
  if (!server.ok()) std::abort();
  // One ticker writes every stream's next event (as the controller's pump threads do).
  std::atomic<bool> stop{false};
  std::thread ticker([&] {
    while (!stop) {
      std::this_thread::sleep_for(std::chrono::milliseconds(interval_ms));
      std::lock_guard<std::mutex> l(mu);
      for (Stream& s : streams) {
        if (s.sent == events) continue;
        s.ex->Write(Event(s.sent));
        if (++s.sent == events) s.ex->End();
      }
    }
  });
  Result r = Drive((*server)->port(), n, events, base_threads, base_rss);
  stop = true;
  ticker.join();
  return r;
}

Result Httplib(int n, int events, int interval_ms, int pool) {
  const long base_threads = ProcStatus("Threads:"), base_rss = ProcStatus("VmRSS:");
  httplib::Server svr;
  if (pool > 0) svr.new_task_queue = [pool] { return new httplib::ThreadPool(pool); };
  svr.Get("/events", [&](const httplib::Request&, httplib::Response& res) {
    res.set_chunked_content_provider(
        "text/event-stream", [&, k = 0](size_t, httplib::DataSink& sink) mutable {
          std::this_thread::sleep_for(std::chrono::milliseconds(interval_ms));
          const std::string e = Event(k);
          sink.write(e.data(), e.size());
          if (++k == events) sink.done();
          return true;
        });
  });
  const int port = svr.bind_to_any_port("127.0.0.1");
  std::thread listener([&] { svr.listen_after_bind(); });
  while (!svr.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  Result r = Drive(port, n, events, base_threads, base_rss);
  svr.stop();
  listener.join();
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  int n = 300, events = 20, interval_ms = 50;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--help" || i + 1 >= argc) {
      std::printf("usage: sse_streams [--streams N] [--events E] [--interval-ms I]\n");
      return f == "--help" ? 0 : 2;
    }
    const int v = std::atoi(argv[++i]);
    if (f == "--streams") {
      n = v;
    } else if (f == "--events") {
      events = v;
    } else if (f == "--interval-ms") {
      interval_ms = v;
    } else {
      std::fprintf(stderr, "unknown flag %s\n", f.c_str());
      return 2;
    }
  }
  curl_global_init(CURL_GLOBAL_DEFAULT);
  std::printf("sse_streams: %d streams x %d events, %d ms apart (ideal %.2f s)\n", n, events,
              interval_ms, events * interval_ms / 1e3);
  auto print = [&](const char* name, const Result& r) {
    std::printf("  %-34s %7.2f s  %5ld extra threads  %7.1f MB RSS  %d/%d complete\n", name,
                r.seconds, r.extra_threads, r.rss_kb / 1024.0, r.complete, n);
  };
  print("libmicrohttpd (2 threads, suspend)", Microhttpd(n, events, interval_ms));
  print("cpp-httplib (default pool)", Httplib(n, events, interval_ms, 0));
  const std::string pooled = "cpp-httplib (pool of " + std::to_string(n) + ")";
  print(pooled.c_str(), Httplib(n, events, interval_ms, n));
  curl_global_cleanup();
  return 0;
}
