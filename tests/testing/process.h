// A child process for integration tests: started with posix_spawn, stopped with SIGTERM (then
// SIGKILL) when the object dies. Used to run the real moelora binaries on loopback.
#ifndef MOELORA_TESTS_TESTING_PROCESS_H_
#define MOELORA_TESTS_TESTING_PROCESS_H_

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace moelora::testing {

class ChildProcess {
 public:
  // Starts `argv[0]` with `argv`; stdout and stderr go to `log_path`.
  ChildProcess(const std::vector<std::string>& argv, const std::string& log_path)
      : log_path_(log_path) {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    if (posix_spawn(&pid_, args[0], &fa, nullptr, args.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
  }
  ~ChildProcess() { Stop(); }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  bool started() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }
  void Signal(int sig) {
    if (pid_ > 0 && !exited_) kill(pid_, sig);
  }

  // Exit status once it has exited, -1 while running (waits up to `timeout`).
  int WaitExit(std::chrono::milliseconds timeout) {
    if (exited_) return status_;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      int st = 0;
      if (pid_ > 0 && waitpid(pid_, &st, WNOHANG) == pid_) {
        exited_ = true;
        status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        return status_;
      }
      if (std::chrono::steady_clock::now() > deadline) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  // SIGTERM, then SIGKILL after 15 s. Returns the exit status.
  int Stop() {
    if (pid_ <= 0 || exited_) return status_;
    kill(pid_, SIGTERM);
    if (WaitExit(std::chrono::seconds(15)) >= 0) return status_;
    kill(pid_, SIGKILL);
    return WaitExit(std::chrono::seconds(5));
  }

  std::string Log() const {
    std::ifstream in(log_path_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  std::string log_path_;
  pid_t pid_ = -1;
  bool exited_ = false;
  int status_ = -1;
};

// Polls for a file until it exists (port files are written atomically) or the timeout passes.
// Gives up early when `writer` (the process expected to write it) has exited.
inline std::string WaitForFile(const std::string& path, std::chrono::milliseconds timeout,
                               ChildProcess* writer = nullptr) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (writer && writer->WaitExit(std::chrono::milliseconds(0)) >= 0) return "";
    std::ifstream in(path);
    if (in) {
      std::stringstream ss;
      ss << in.rdbuf();
      return ss.str();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return "";
}

}  // namespace moelora::testing

#endif  // MOELORA_TESTS_TESTING_PROCESS_H_
