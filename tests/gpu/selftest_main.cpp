// GoogleTest-free runner of the CUDA scenarios (the H200 machine has no GoogleTest):
//   tide_cuda_selftest [--strict] [--limit S] [--jobs N] [--batch] [--only a,b] [--jsonl FILE]
//                      [--expect flags=device,copies=batched,memory=vmm] [probe | ws ...]
// (default ws 1 2 4). Each scenario runs as one process per rank (cuda_harness.hpp), killed
// after S seconds (default 30; the ranks' groups time out after S/2 and report their flags),
// N scenarios at a time (default 1); --batch: all scenarios of a world size in one set of
// rank processes, one after another (N world sizes at a time). Prints PASS / FAIL per scenario and world size, and
// appends one JSON line per result to FILE as it comes. --expect: the modes every group must
// have taken (each scenario reports them; "_hostsync" scenarios ask for host flags and are
// held to that instead); a group that fell back fails its scenario. Without a usable device
// it says why (the device-count child's own exit and output: a driver/runtime mismatch is
// not "no GPU") and lists every check it could not run; that is exit 77 ("SKIP"), or, with
// --strict (what tests/gpu/run.sh uses), exit 1. An unknown --only name is exit 2.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "cuda_harness.hpp"
#include "cuda_scenarios.hpp"

namespace {

std::string json_escape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    if (ch == '"' || ch == '\\') o += '\\', o += ch;
    else if (ch == '\n') o += "\\n";
    else if (static_cast<unsigned char>(ch) < 0x20) o += ' ';
    else o += ch;
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  tide::cudatest::child_main_if_requested();
  bool strict = false, probe_only = false, batch = false;
  int limit = 30, jobs = 1;
  std::set<std::string> only;
  std::vector<int> sizes;
  std::string jsonl;
  std::map<std::string, std::string> expect;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--strict") {
      strict = true;
    } else if (a == "--limit" && i + 1 < argc) {
      limit = std::atoi(argv[++i]);
    } else if (a == "--batch") {
      batch = true;
    } else if (a == "--jobs" && i + 1 < argc) {
      jobs = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--jsonl" && i + 1 < argc) {
      jsonl = argv[++i];
    } else if (a == "--expect" && i + 1 < argc) {
      expect = tide::cudatest::parse_modes(argv[++i], ',');
    } else if (a == "--only" && i + 1 < argc) {
      std::istringstream is(argv[++i]);
      for (std::string n; std::getline(is, n, ',');) only.insert(n);
    } else if (a == "probe") {
      probe_only = true;
    } else {
      sizes.push_back(std::atoi(a.c_str()));
    }
  }
  if (sizes.empty()) sizes = {1, 2, 4};
  std::vector<std::string> names;
  for (const std::string& n : tide::cudatest::scenario_names())
    if (only.empty() || only.erase(n)) names.push_back(n);
  if (!only.empty()) {  // a misspelt check must not pass by running nothing
    std::printf("FAIL: unknown scenario %s\n", only.begin()->c_str());
    return 2;
  }
  const std::vector<std::string> none;
  const auto seconds = std::chrono::seconds(limit);
  std::mutex out_mutex;
  FILE* json = jsonl.empty() ? nullptr : std::fopen(jsonl.c_str(), "a");
  const char* symmetric = std::getenv("TIDE_CUDA_SYMMETRIC");
  auto record = [&](const std::string& name, int ws, bool ok, double secs, const std::string& text) {
    std::lock_guard<std::mutex> lock(out_mutex);
    std::printf("%s %s ws=%d (%.1f s)\n%s", ok ? "PASS" : "FAIL", name.c_str(), ws, secs, text.c_str());
    std::fflush(stdout);
    if (json) {
      std::fprintf(json,
                   "{\"step\": \"cuda scenarios\", \"scenario\": \"%s\", \"ws\": %d, \"symmetric\": \"%s\", "
                   "\"ok\": %s, \"seconds\": %.2f, \"text\": \"%s\"}\n",
                   name.c_str(), ws, symmetric ? symmetric : "auto", ok ? "true" : "false", secs,
                   json_escape(text).c_str());
      std::fflush(json);
    }
  };

  std::string why_no_device;
  if (tide::cudatest::device_count(none, &why_no_device) == 0) {
    std::printf("%s: no usable CUDA device: %s\n", strict ? "FAIL" : "SKIP", why_no_device.c_str());
    std::string not_run = "probe";
    if (!probe_only)
      for (int ws : sizes)
        for (const std::string& n : names) not_run += ", " + n + " ws=" + std::to_string(ws);
    std::printf("not run: %s\n", not_run.c_str());
    record("no device", 0, false, 0, why_no_device + "; not run: " + not_run + "\n");
    return strict ? 1 : 77;
  }
  std::atomic<int> failed{0}, passed{0};
  auto run_one = [&](const std::string& name, int ws) {
    const auto t0 = std::chrono::steady_clock::now();
    auto out = tide::cudatest::run_ranks(name, ws, none, seconds);
    bool ok = tide::cudatest::all_ok(out);
    std::string text;
    for (size_t r = 0; ok && r < out.size(); ++r) {
      const std::string why = tide::cudatest::modes_mismatch(name, out[r].text, expect);
      if (!why.empty()) {
        ok = false;
        text += "rank " + std::to_string(r) + " fell back:" + why + "\n";
      }
    }
    text += ok ? "  " + out[0].text : tide::cudatest::summary(out);
    record(name, ws, ok, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), text);
    ok ? ++passed : ++failed;
  };
  // --batch: every scenario of one world size in the same rank processes, one after another
  // (a process's CUDA context costs about a second on the H200 machine, so a process per
  // scenario spent the lease starting them). Each scenario is reported as soon as every rank
  // has reported it; one that no rank reached fails naming why (a hang, a crash).
  auto run_batch = [&](int ws) {
    std::string list;
    for (const std::string& n : names) list += (list.empty() ? "" : ",") + n;
    std::set<std::string> reported;
    auto t0 = std::chrono::steady_clock::now();
    auto line_of = [](const std::string& text, const std::string& name) -> std::string {
      std::istringstream is(text);
      for (std::string l; std::getline(is, l);)
        if (l.rfind(name + " ", 0) == 0) return l.substr(name.size() + 1);
      return "";
    };
    auto report_ready = [&](const std::vector<tide::cudatest::Outcome>& out, bool final) {
      for (const std::string& name : names) {
        if (reported.count(name)) continue;
        bool all = true, ok = true;
        std::string text, why;
        for (size_t r = 0; r < out.size(); ++r) {
          const std::string l = line_of(out[r].text, name);
          if (l.empty()) {
            all = false;
            continue;
          }
          if (l.rfind("OK", 0) != 0) ok = false;
          const std::string mismatch = tide::cudatest::modes_mismatch(name, l, expect);
          if (!mismatch.empty()) ok = false, why += "rank " + std::to_string(r) + " fell back:" + mismatch + "\n";
          text += "  rank " + std::to_string(r) + ": " + l + "\n";
        }
        if (!all && !final) return;  // in order: later scenarios wait for this one
        if (!all) {
          ok = false;
          why += "not reached by every rank: " + tide::cudatest::summary(out);
        }
        const auto now = std::chrono::steady_clock::now();
        record(name, ws, ok, std::chrono::duration<double>(now - t0).count(), why + text);
        t0 = now;
        reported.insert(name);
        ok ? ++passed : ++failed;
      }
    };
    auto out = tide::cudatest::run_ranks(list, ws, none, seconds * static_cast<int>(names.size()),
                                         [&](const auto& o) { report_ready(o, false); }, seconds / 2);
    report_ready(out, true);
  };
  run_one("probe", 1);
  std::vector<std::pair<std::string, int>> work;
  for (int ws : probe_only ? std::vector<int>{} : sizes)
    if (batch) work.emplace_back("", ws);
    else
      for (const std::string& name : names) work.emplace_back(name, ws);
  // N workers take the next scenario (or batch): the parent only forks and waits (no CUDA here).
  std::atomic<size_t> next{0};
  std::vector<std::thread> workers;
  for (int j = 0; j < jobs; ++j)
    workers.emplace_back([&] {
      for (size_t i; (i = next++) < work.size();)
        batch ? run_batch(work[i].second) : run_one(work[i].first, work[i].second);
    });
  for (auto& w : workers) w.join();
  std::printf("%d passed, %d failed\n", passed.load(), failed.load());
  if (json) std::fclose(json);
  return failed ? 1 : 0;
}
