// The pieces under the host transport: the file store and the thread pool.
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <thread>

#include "test_host_harness.hpp"
#include "tide/error.hpp"
#include "tide/host_transport.hpp"
#include "tide/store.hpp"
#include "tide/thread_pool.hpp"

using namespace tide;

namespace {

struct TempDir {
  std::string path;
  TempDir() {
    char t[] = "/tmp/tide-store-XXXXXX";
    path = ::mkdtemp(t);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

TEST(HostFileStore, SetGetAddAndTimeout) {
  TempDir dir;
  auto store = make_file_store(dir.path);
  store->set("group/a", {1, 2, 3});
  EXPECT_EQ(store->get("group/a", std::chrono::milliseconds(100)), (std::vector<uint8_t>{1, 2, 3}));
  store->set("group/a", {9});
  EXPECT_EQ(store->get("group/a", std::chrono::milliseconds(100)), (std::vector<uint8_t>{9}));
  store->set("empty", {});
  EXPECT_TRUE(store->get("empty", std::chrono::milliseconds(100)).empty());
  EXPECT_EQ(store->add("n", 5), 5);
  EXPECT_EQ(store->add("n", -2), 3);
  auto t0 = std::chrono::steady_clock::now();
  try {
    store->get("missing", std::chrono::milliseconds(200));
    FAIL() << "no timeout";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("missing"), std::string::npos);
  }
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(200));
}

TEST(HostFileStore, ConcurrentAddsFromProcessesAreAtomic) {
  TempDir dir;
  auto out = test::run_ranks(4, [&](test::Rank& rk) {
    auto store = make_file_store(dir.path);
    for (int i = 0; i < 50; ++i) store->add("counter", 1);
    if (store->add("done", 1) == 4) store->set("all", {1});
    store->get("all", std::chrono::seconds(10));
    auto v = store->get("counter", std::chrono::seconds(1));
    TIDE_REQUIRE(std::string(v.begin(), v.end()) == "200", "counter=", std::string(v.begin(), v.end()));
  });
  EXPECT_TRUE(test::all_ok(out)) << test::describe(out);
  // A waiter is released by a later set from another process.
  auto store = make_file_store(dir.path);
  std::thread setter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    make_file_store(dir.path)->set("late", {42});
  });
  EXPECT_EQ(store->get("late", std::chrono::seconds(5)), std::vector<uint8_t>{42});
  setter.join();
}

TEST(HostSpin, LongWhereEveryProcessHasACoreShortWhereTheyShareAndTheVariableOverrides) {
  using std::chrono::microseconds;
  ::unsetenv("TIDE_HOST_SPIN_US");
  EXPECT_EQ(host_spin(2, 2), microseconds(200));
  EXPECT_EQ(host_spin(1, 16), microseconds(200));
  EXPECT_EQ(host_spin(6, 2), microseconds(10));  // 3 pseudo-nodes x 2 on 2 cores
  ::setenv("TIDE_HOST_SPIN_US", "0", 1);
  EXPECT_EQ(host_spin(2, 2), microseconds(0));
  ::unsetenv("TIDE_HOST_SPIN_US");
}

// What a host communicator tells its waiters outside the transport (TIDE-AG's node peers,
// whose progress words are theirs): the transport's spin, from the host's ranks.
TEST(HostSpin, TheCommunicatorsWaitSpinIsItsTransports) {
  using std::chrono::microseconds;
  TempDir dir;
  auto store = make_file_store(dir.path);
  CommOptions opts;
  opts.host_ranks = 1 << 20;  // more processes than any host has cores
  ::unsetenv("TIDE_HOST_SPIN_US");
  EXPECT_EQ(make_host_comm(*store, "spin-shared", 0, 1, opts)->wait_spin(), microseconds(10));
  ::setenv("TIDE_HOST_SPIN_US", "37", 1);
  EXPECT_EQ(make_host_comm(*store, "spin-override", 0, 1, opts)->wait_spin(), microseconds(37));
  ::unsetenv("TIDE_HOST_SPIN_US");
}

TEST(HostThreadPool, RunsEveryIndexOnceAcrossManyJobs) {
  for (int threads : {1, 2, 4}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (int job = 0; job < 200; ++job) {
      const size_t n = static_cast<size_t>(job % 9);
      std::vector<std::atomic<int>> hits(n);
      pool.run(n, [&](size_t i) { hits[i].fetch_add(1); });
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "threads=" << threads << " job=" << job;
    }
  }
}

}  // namespace
