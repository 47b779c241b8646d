// GoogleTest-free runner of the CUDA scenarios (for the H200 machine, which has no
// GoogleTest): tide_cuda_selftest [ws ...]  (default 1 2 4). Exit 0: all passed or no
// device (prints "SKIP: no CUDA device"); 1: a failure.
#include <cstdio>
#include <cstdlib>

#include "cuda_harness.hpp"
#include "cuda_scenarios.hpp"

int main(int argc, char** argv) {
  tide::cudatest::child_main_if_requested();
  const std::vector<std::string> none;
  if (tide::cudatest::device_count(none) == 0) {
    std::printf("SKIP: no CUDA device\n");
    return 0;
  }
  const bool probe_only = argc > 1 && std::string(argv[1]) == "probe";
  std::vector<int> sizes;
  for (int i = 1; i < argc && !probe_only; ++i) sizes.push_back(std::atoi(argv[i]));
  if (sizes.empty() && !probe_only) sizes = {1, 2, 4};
  int failed = 0, passed = 0;
  auto probe = tide::cudatest::run_ranks("probe", 1, none);
  std::printf("probe: %s", tide::cudatest::summary(probe).c_str());
  if (!tide::cudatest::all_ok(probe)) ++failed;
  for (int ws : sizes)
    for (const std::string& name : tide::cudatest::scenario_names()) {
      auto out = tide::cudatest::run_ranks(name, ws, none);
      const bool ok = tide::cudatest::all_ok(out);
      std::printf("%s %s ws=%d\n", ok ? "PASS" : "FAIL", name.c_str(), ws);
      if (!ok) std::printf("%s", tide::cudatest::summary(out).c_str());
      std::fflush(stdout);
      ok ? ++passed : ++failed;
    }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
