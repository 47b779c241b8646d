// GoogleTest-free runner of the CUDA scenarios (the H200 machine has no GoogleTest):
//   tide_cuda_selftest [--strict] [--limit S] [--only a,b] [probe | ws ...]   (default ws 1 2 4)
// Each scenario runs as one process per rank (cuda_harness.hpp), killed after S seconds
// (default 30), so one hang costs S, not the whole run. Prints PASS / FAIL per scenario and
// world size. Without a usable device it says why (the device-count child's own exit and
// output: a driver/runtime mismatch is not "no GPU") and lists every check it could not
// run; that is exit 77 ("SKIP"), or, with --strict (what tests/gpu/run.sh uses), exit 1.
// An unknown --only name is exit 2.
#include <cstdio>
#include <cstdlib>
#include <set>
#include <sstream>

#include "cuda_harness.hpp"
#include "cuda_scenarios.hpp"

int main(int argc, char** argv) {
  tide::cudatest::child_main_if_requested();
  bool strict = false, probe_only = false;
  int limit = 30;
  std::set<std::string> only;
  std::vector<int> sizes;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--strict") {
      strict = true;
    } else if (a == "--limit" && i + 1 < argc) {
      limit = std::atoi(argv[++i]);
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

  std::string why_no_device;
  if (tide::cudatest::device_count(none, &why_no_device) == 0) {
    std::printf("%s: no usable CUDA device: %s\n", strict ? "FAIL" : "SKIP", why_no_device.c_str());
    std::printf("not run: probe");
    if (!probe_only)
      for (int ws : sizes)
        for (const std::string& n : names) std::printf(", %s ws=%d", n.c_str(), ws);
    std::printf("\n");
    return strict ? 1 : 77;
  }
  int failed = 0, passed = 0;
  auto probe = tide::cudatest::run_ranks("probe", 1, none, seconds);
  std::printf("%s probe: %s", tide::cudatest::all_ok(probe) ? "PASS" : "FAIL", tide::cudatest::summary(probe).c_str());
  tide::cudatest::all_ok(probe) ? ++passed : ++failed;
  std::fflush(stdout);
  for (int ws : probe_only ? std::vector<int>{} : sizes)
    for (const std::string& name : names) {
      auto out = tide::cudatest::run_ranks(name, ws, none, seconds);
      const bool ok = tide::cudatest::all_ok(out);
      std::printf("%s %s ws=%d\n", ok ? "PASS" : "FAIL", name.c_str(), ws);
      if (!ok) std::printf("%s", tide::cudatest::summary(out).c_str());
      std::fflush(stdout);
      ok ? ++passed : ++failed;
    }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
