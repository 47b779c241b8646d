// FdChannel: file descriptors passed between rank processes (the carrier of CUDA's
// shareable memory handles), checked with memfds whose contents name their sender.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <filesystem>

#include "test_host_harness.hpp"
#include "tide/fd_channel.hpp"

using namespace tide;
using namespace std::chrono_literals;

namespace {

int open_fd_count() {
  int n = 0;
  for ([[maybe_unused]] auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

int memfd_with(const std::string& text) {
  const int fd = ::memfd_create("tide-fd-test", MFD_CLOEXEC);
  if (fd < 0 || ::write(fd, text.data(), text.size()) != static_cast<ssize_t>(text.size()))
    throw std::runtime_error("memfd");
  return fd;
}

std::string contents(int fd) {
  char buf[128] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf, 0);
  return n > 0 ? std::string(buf, n) : std::string();
}

TEST(FdChannel, EveryPairExchangesUnderTagsInAnyOrder) {
  for (int ws : {2, 3, 4, 12}) {  // 12: more messages than a socket queues (max_dgram_qlen)
    auto out = test::run_ranks(ws, [](test::Rank& rk) {
      const int before = open_fd_count();
      {
        auto store = make_file_store(rk.store_dir);
        FdChannel ch(*store, rk.ns, rk.rank, rk.world_size, 10s);
        // Two tags, sent in reverse order of receipt: tag 2 arrives first and waits aside.
        for (uint64_t tag : {2u, 1u}) {
          for (int p = 0; p < rk.world_size; ++p) {
            if (p == rk.rank) continue;
            const int fd = memfd_with(detail::concat("from ", rk.rank, " to ", p, " tag ", tag, " seed ", rk.seed));
            ch.send(p, tag, fd);
            ::close(fd);  // the peer holds its own duplicate
          }
        }
        for (uint64_t tag : {1u, 2u}) {
          for (int p = 0; p < rk.world_size; ++p) {
            if (p == rk.rank) continue;
            const int fd = ch.receive(p, tag);
            const std::string want = detail::concat("from ", p, " to ", rk.rank, " tag ", tag, " seed ", rk.seed);
            const std::string got = contents(fd);
            ::close(fd);
            TIDE_REQUIRE(got == want, "got '", got, "' want '", want, "'");
          }
        }
      }
      TIDE_REQUIRE(open_fd_count() == before, "fds leaked: ", before, " before, ", open_fd_count(), " after");
    });
    EXPECT_TRUE(test::all_ok(out)) << "ws=" << ws << "\n" << test::describe(out);
  }
}

TEST(FdChannel, MissingSenderTimesOutNamingPeerAndTag) {
  auto out = test::run_ranks(2, [](test::Rank& rk) {
    auto store = make_file_store(rk.store_dir);
    FdChannel ch(*store, rk.ns, rk.rank, rk.world_size, 300ms);
    if (rk.rank == 1) return;  // never sends
    const auto start = std::chrono::steady_clock::now();
    try {
      ch.receive(1, 7);
    } catch (const TimeoutError& e) {
      const std::string what = e.what();
      TIDE_REQUIRE(what.find("rank 1") != std::string::npos && what.find("tag 7") != std::string::npos, what);
      TIDE_REQUIRE(std::chrono::steady_clock::now() - start < 5s, "took too long");
      return;
    }
    TIDE_REQUIRE(false, "no timeout");
  });
  EXPECT_TRUE(test::all_ok(out)) << test::describe(out);
}

}  // namespace
