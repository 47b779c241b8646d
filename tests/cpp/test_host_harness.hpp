// Multi-process test harness for the host communicator: fork one child per rank, each with
// a FileStore in a fresh temporary directory; the parent reaps them with a time limit and
// collects what each child reported through a pipe. Children leave with _exit, never
// returning into GoogleTest.
#pragma once
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tide/comm.hpp"
#include "tide/error.hpp"
#include "tide/store.hpp"

namespace tide::test {

struct Rank {
  int rank = 0, world_size = 1;
  std::string store_dir, ns;
  uint64_t seed = 0;  // same on every rank of one run, fresh per run
  int report_fd = -1;

  std::unique_ptr<Comm> comm(CommOptions opt = {}, const std::string& suffix = "") const {
    auto store = make_file_store(store_dir);
    return make_host_comm(*store, ns + suffix, rank, world_size, opt);
  }
  // Appends a line to what the parent sees for this rank.
  void report(const std::string& line) const {
    std::string s = line + "\n";
    (void)!::write(report_fd, s.data(), s.size());
  }
};

struct Outcome {
  int exit_code = -1;  // -1: killed by a signal or by the harness (see hung)
  int signal = 0;
  bool hung = false;
  std::string text;  // everything the rank reported
};

// Failed checks inside a child throw this; the child reports the message and exits 1.
#define TIDE_REQUIRE(cond, ...)                                                           \
  do {                                                                                    \
    if (!(cond))                                                                          \
      throw std::runtime_error(::tide::detail::concat(__FILE__, ":", __LINE__, ": ", #cond, \
                                                      " -- ", __VA_ARGS__));            \
  } while (0)

// TIDE_TEST_TIME_SCALE (default 3) stretches every harness deadline: a deadline only tells
// a hang from a slow machine, and a machine shared with other work is slow.
inline double time_scale() {
  const char* v = std::getenv("TIDE_TEST_TIME_SCALE");
  const double s = v && *v ? std::atof(v) : 3.0;
  return s > 0 ? s : 3.0;
}

// Lines of /proc/self/maps that map a memfd labelled `label` (the host transport's segments).
inline int memfd_mappings(const std::string& label) {
  FILE* f = std::fopen("/proc/self/maps", "re");
  if (!f) return -1;
  int n = 0;
  char line[512];
  const std::string needle = "/memfd:" + label + " ";
  while (std::fgets(line, sizeof line, f)) n += std::strstr(line, needle.c_str()) != nullptr;
  std::fclose(f);
  return n;
}

// Entries of /dev/shm whose name starts with "tide" (the transport never makes one).
inline std::vector<std::string> tide_shm_entries() {
  std::vector<std::string> found;
  for (auto& e : std::filesystem::directory_iterator("/dev/shm", std::filesystem::directory_options::skip_permission_denied))
    if (e.path().filename().string().rfind("tide", 0) == 0) found.push_back(e.path().filename().string());
  std::sort(found.begin(), found.end());
  return found;
}

inline std::vector<Outcome> run_ranks(int ws, const std::function<void(Rank&)>& fn,
                                      std::chrono::milliseconds base_limit = std::chrono::seconds(30)) {
  const auto limit = std::chrono::duration_cast<std::chrono::milliseconds>(base_limit * time_scale());
  char tmpl[] = "/tmp/tide-test-XXXXXX";
  const char* dir = ::mkdtemp(tmpl);
  if (!dir) throw std::runtime_error("mkdtemp failed");
  const uint64_t seed = std::random_device{}() ^ (static_cast<uint64_t>(std::random_device{}()) << 32);
  std::vector<pid_t> pids(ws);
  std::vector<int> fds(ws);
  std::fflush(nullptr);
  for (int r = 0; r < ws; ++r) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(p[0]);
      Rank rk{r, ws, dir, std::string("ns-") + std::to_string(::getppid()) + "-" + std::to_string(seed), seed, p[1]};
      int code = 0;
      try {
        fn(rk);
      } catch (const std::exception& e) {
        rk.report(std::string("FAILED: ") + e.what());
        code = 1;
      } catch (...) {
        rk.report("FAILED: unknown exception");
        code = 1;
      }
      std::fflush(nullptr);
      ::_exit(code);
    }
    ::close(p[1]);
    pids[r] = pid;
    fds[r] = p[0];
    ::fcntl(fds[r], F_SETFL, O_NONBLOCK);
  }
  std::vector<Outcome> out(ws);
  std::vector<bool> done(ws, false);
  auto drain = [&](int r) {
    char buf[4096];
    ssize_t n;
    while ((n = ::read(fds[r], buf, sizeof buf)) > 0) out[r].text.append(buf, n);
  };
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int left = ws;
  while (left > 0) {
    for (int r = 0; r < ws; ++r) {
      drain(r);
      if (done[r]) continue;
      int status = 0;
      if (::waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        done[r] = true;
        --left;
        if (WIFEXITED(status)) out[r].exit_code = WEXITSTATUS(status);
        if (WIFSIGNALED(status)) out[r].signal = WTERMSIG(status);
      }
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < ws; ++r)
        if (!done[r]) {
          ::kill(pids[r], SIGKILL);
          ::waitpid(pids[r], nullptr, 0);
          out[r].hung = true;
        }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  for (int r = 0; r < ws; ++r) {
    drain(r);
    ::close(fds[r]);
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return out;
}

inline std::string describe(const std::vector<Outcome>& out) {
  std::ostringstream os;
  for (size_t r = 0; r < out.size(); ++r)
    os << "rank " << r << ": exit=" << out[r].exit_code << " signal=" << out[r].signal
       << (out[r].hung ? " HUNG" : "") << "\n" << out[r].text;
  return os.str();
}

// Every rank exited 0.
inline bool all_ok(const std::vector<Outcome>& out) {
  for (auto& o : out)
    if (o.exit_code != 0 || o.hung) return false;
  return true;
}

}  // namespace tide::test
