// Multi-process harness for the CUDA tests (GoogleTest and the GoogleTest-free selftest).
//
// CUDA must not be used in a child forked from a process that already initialised CUDA, and
// the test binary's parent may have (other tests, the device check). So each rank is a fresh
// process: fork, then exec /proc/self/exe with TIDE_CUDA_TEST_CHILD set; the child runs one
// scenario (cuda_scenarios.hpp) for its rank, sets device 0, rendezvous through a FileStore
// in a fresh temporary directory, reports "OK ..." or "FAIL ..." through a pipe and _exits.
// The parent never calls CUDA here.
#pragma once
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace tide::cudatest {

struct RankCtx {
  std::string scenario;
  int rank = 0, ws = 1;
  std::string dir;
  uint64_t seed = 0;
  int64_t timeout_ms = 60000;  // the groups' timeout: half the harness's kill, so a hang reports
};

struct Outcome {
  int exit_code = -1;
  bool hung = false;
  std::string text;
};

// Runs in the child: returns a line of text for the parent, throws on failure.
std::string run_scenario(const RankCtx& ctx);

// The child side: when TIDE_CUDA_TEST_CHILD is set, run the scenario and _exit. Call first
// thing in main (selftest) or in a dedicated test (GoogleTest).
inline void child_main_if_requested() {
  const char* v = std::getenv("TIDE_CUDA_TEST_CHILD");
  if (!v || !*v) return;
  RankCtx c;
  int fd = -1;
  {
    std::istringstream is(v);
    std::string f;
    std::vector<std::string> parts;
    while (std::getline(is, f, ';')) parts.push_back(f);
    if (parts.size() != 7) _exit(3);
    c.scenario = parts[0];
    c.rank = std::atoi(parts[1].c_str());
    c.ws = std::atoi(parts[2].c_str());
    c.dir = parts[3];
    c.seed = std::strtoull(parts[4].c_str(), nullptr, 10);
    fd = std::atoi(parts[5].c_str());
    c.timeout_ms = std::strtoll(parts[6].c_str(), nullptr, 10);
  }
  auto run_one = [&c](const RankCtx& one) -> std::pair<bool, std::string> {
    try {
      return {true, "OK " + run_scenario(one)};
    } catch (const std::exception& e) {
      return {false, std::string("FAIL rank ") + std::to_string(c.rank) + ": " + e.what()};
    } catch (...) {
      return {false, "FAIL rank " + std::to_string(c.rank) + ": unknown exception"};
    }
  };
  int code = 0;
  if (c.scenario.find(',') == std::string::npos) {
    auto [ok, msg] = run_one(c);
    msg += "\n";
    (void)!::write(fd, msg.data(), msg.size());
    code = ok ? 0 : 1;
  } else {
    // A batch (run_batch): the scenarios one after another in this process (one CUDA context
    // for all of them), each over a store of its own, a line "<name> OK ..." / "<name> FAIL
    // ..." per scenario the moment it ends.
    std::istringstream names(c.scenario);
    for (std::string name; std::getline(names, name, ',');) {
      RankCtx one = c;
      one.scenario = name;
      one.dir = c.dir + "/" + name;
      auto [ok, msg] = run_one(one);
      for (char& ch : msg)
        if (ch == '\n') ch = ' ';
      msg = name + " " + msg + "\n";
      (void)!::write(fd, msg.data(), msg.size());
      if (!ok) code = 1;
    }
  }
  std::fflush(nullptr);
  _exit(code);
}

// The parent side: one fresh process per rank, killed after `limit` (the ranks' groups time
// out after `group_timeout`, default half of it, so a hang reports each rank's flags before
// the kill). `scenario` may be a comma-separated batch (run one after another in the same
// processes). `progress` sees what the ranks reported so far, every few milliseconds.
// `child_args` are extra argv entries for the re-executed binary. Safe to call from several
// threads at once (the parent never touches CUDA).
inline std::vector<Outcome> run_ranks(const std::string& scenario, int ws, const std::vector<std::string>& child_args,
                                      std::chrono::seconds limit = std::chrono::seconds(120),
                                      const std::function<void(const std::vector<Outcome>&)>& progress = {},
                                      std::chrono::milliseconds group_timeout = {}) {
  if (group_timeout.count() <= 0) group_timeout = std::chrono::milliseconds(limit) / 2;
  char tmpl[] = "/tmp/tide-cuda-test-XXXXXX";
  const char* dir = ::mkdtemp(tmpl);
  if (!dir) throw std::runtime_error("mkdtemp failed");
  const uint64_t seed = (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
  std::vector<pid_t> pids(ws, -1);
  std::vector<int> fds(ws, -1);
  std::vector<Outcome> out(ws);
  std::fflush(nullptr);
  for (int r = 0; r < ws; ++r) {
    int p[2];
    // Both ends close on exec: a rank process of a scenario run from another thread must
    // not hold this pipe open (its reader waits for the end of it).
    if (::pipe2(p, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
    const std::string env = scenario + ";" + std::to_string(r) + ";" + std::to_string(ws) + ";" + dir + ";" +
                            std::to_string(seed) + ";" + std::to_string(p[1]) + ";" +
                            std::to_string(group_timeout.count());
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(p[0]);
      ::fcntl(p[1], F_SETFD, 0);  // this rank's own end survives its exec
      ::setenv("TIDE_CUDA_TEST_CHILD", env.c_str(), 1);
      int devnull = ::open("/dev/null", O_WRONLY);
      if (devnull >= 0) ::dup2(devnull, 1);  // the re-executed test binary's banners
      std::vector<std::string> args{"/proc/self/exe"};
      args.insert(args.end(), child_args.begin(), child_args.end());
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv("/proc/self/exe", argv.data());
      _exit(4);
    }
    ::close(p[1]);
    pids[r] = pid;
    fds[r] = p[0];
  }
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int left = ws;
  std::vector<bool> done(ws, false);
  while (left > 0) {
    for (int r = 0; r < ws; ++r) {
      if (done[r]) continue;
      char buf[4096];
      for (;;) {
        pollfd pf{fds[r], POLLIN, 0};
        if (::poll(&pf, 1, 0) <= 0) break;
        ssize_t n = ::read(fds[r], buf, sizeof buf);
        if (n <= 0) break;
        out[r].text.append(buf, static_cast<size_t>(n));
      }
      int st = 0;
      if (::waitpid(pids[r], &st, WNOHANG) == pids[r]) {
        ssize_t n;
        while ((n = ::read(fds[r], buf, sizeof buf)) > 0) out[r].text.append(buf, static_cast<size_t>(n));
        out[r].exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        if (WIFSIGNALED(st)) out[r].text += "killed by signal " + std::to_string(WTERMSIG(st)) + "\n";
        done[r] = true;
        --left;
      }
    }
    if (progress) progress(out);  // what the ranks reported so far
    if (left > 0 && std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < ws; ++r)
        if (!done[r]) {
          ::kill(pids[r], SIGKILL);
          ::waitpid(pids[r], nullptr, 0);
          out[r].hung = true;
          out[r].text += "hung: killed after " + std::to_string(limit.count()) + " s\n";
        }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  for (int fd : fds) ::close(fd);
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  return out;
}

// Number of CUDA devices, asked of a fresh child process (the parent stays CUDA-free).
// When 0, `why` (if given) says what the child reported: no device, or its failure (a
// driver/runtime mismatch, a crash), which a caller must not mistake for "no GPU".
inline int device_count(const std::vector<std::string>& child_args, std::string* why = nullptr) {
  static int cached = -1;
  static std::string reason;
  if (cached < 0) {
    std::vector<Outcome> o = run_ranks("count", 1, child_args, std::chrono::seconds(60));
    cached = 0;
    if (o[0].exit_code == 0 && o[0].text.rfind("OK ", 0) == 0) cached = std::atoi(o[0].text.c_str() + 3);
    if (cached == 0) {
      reason = o[0].exit_code == 0 ? "the device-count child found 0 devices"
                                   : "the device-count child failed (exit " + std::to_string(o[0].exit_code) +
                                         (o[0].hung ? ", hung" : "") + ")";
      std::string text = o[0].text;
      while (!text.empty() && text.back() == '\n') text.pop_back();
      if (!text.empty()) reason += ": " + text;
    }
  }
  if (why) *why = reason;
  return cached;
}

// "key=value,key=value" -> map.
inline std::map<std::string, std::string> parse_modes(const std::string& text, char sep) {
  std::map<std::string, std::string> m;
  std::istringstream is(text);
  for (std::string kv; std::getline(is, kv, sep);) {
    const auto eq = kv.find('=');
    if (eq != std::string::npos) m[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return m;
}

// Why a rank's reported modes ("[modes: flags=device copies=batched memory=vmm]" in its
// result line) differ from the expected ones ("" when they agree). Every scenario but the
// probe (which makes no group) must report them; "_hostsync" scenarios ask for host flags
// and are held to that instead.
inline std::string modes_mismatch(const std::string& scenario, const std::string& text,
                                  std::map<std::string, std::string> want) {
  if (want.empty() || scenario == "probe") return "";
  const auto at = text.find("[modes: ");
  if (at == std::string::npos) return " no modes reported";
  const auto end = text.find(']', at);
  const auto got = parse_modes(text.substr(at + 8, end - at - 8), ' ');
  if (scenario.size() > 9 && scenario.compare(scenario.size() - 9, 9, "_hostsync") == 0) want["flags"] = "host";
  std::string why;
  for (const auto& [k, v] : want) {
    const auto it = got.find(k);
    if (it == got.end() || it->second != v)
      why += " " + k + "=" + (it == got.end() ? std::string("?") : it->second) + " (expected " + v + ")";
  }
  return why;
}

inline std::string summary(const std::vector<Outcome>& o) {
  std::string s;
  for (size_t r = 0; r < o.size(); ++r)
    s += "rank " + std::to_string(r) + " exit " + std::to_string(o[r].exit_code) + (o[r].hung ? " (hung)" : "") + ": " +
         o[r].text;
  return s;
}

inline bool all_ok(const std::vector<Outcome>& o) {
  for (const Outcome& x : o)
    if (x.exit_code != 0 || x.hung || x.text.rfind("OK", 0) != 0) return false;
  return true;
}

}  // namespace tide::cudatest
