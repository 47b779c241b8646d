// Failure behaviour of the host communicator: mismatched arguments raise tide::Error on every
// rank; a dead, killed or silent peer raises TimeoutError on every survivor within the
// timeout; an error breaks the communicator; nothing leaks (no /dev/shm names, no fds,
// no mappings).
#include <dirent.h>
#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <cstdio>

#include "test_host_harness.hpp"
#include "tide/host_transport.hpp"

using namespace tide;
using namespace tide::test;
using Clock = std::chrono::steady_clock;

namespace {

CommOptions opts(int timeout_ms) {
  CommOptions o;
  o.timeout = std::chrono::milliseconds(timeout_ms);
  o.staging_bytes = 64 << 10;
  o.num_threads = 1;
  return o;
}

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// Runs `call`, requires it to throw E whose message contains every string in `needles`,
// and returns the elapsed milliseconds.
template <class E>
double expect_throw(const std::function<void()>& call, std::vector<std::string> needles) {
  auto t0 = Clock::now();
  try {
    call();
  } catch (const E& e) {
    std::string msg = e.what();
    if constexpr (std::is_same_v<E, Error>)
      TIDE_REQUIRE(dynamic_cast<const TimeoutError*>(&e) == nullptr, "expected Error, got TimeoutError: ", msg);
    for (auto& n : needles) TIDE_REQUIRE(msg.find(n) != std::string::npos, "message lacks '", n, "': ", msg);
    return ms_since(t0);
  } catch (const std::exception& e) {
    TIDE_REQUIRE(false, "wrong exception type: ", e.what());
  }
  TIDE_REQUIRE(false, "no exception");
  return 0;
}

int count_fds() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  while (dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
  ::closedir(d);
  return n - 1;  // the directory stream itself
}

TEST(HostFailures, MismatchedCountsRaiseOnEveryRankWithAllSizes) {
  for (int ws : {2, 3}) {
    auto out = run_ranks(ws, [](Rank& rk) {
      auto comm = rk.comm(opts(10000));
      const size_t count = rk.rank == 1 ? 512 : 1024;
      std::vector<float> in(count, 1.0f);
      std::vector<std::vector<float>> outs(rk.world_size, std::vector<float>(1024));
      std::vector<void*> ptrs;
      for (auto& o : outs) ptrs.push_back(o.data());
      double ms = expect_throw<Error>([&] { comm->all_gather(in.data(), ptrs, count, DType::f32); },
                                      {"tide all_gather: ranks disagree on the arguments: rank 0: count=1024 dtype=f32; "
                                       "rank 1: count=512 dtype=f32"});
      TIDE_REQUIRE(ms < 2000, "took ", ms, " ms");
      // The communicator is broken from now on.
      expect_throw<Error>([&] { comm->barrier(); }, {"tide barrier: the communicator is unusable"});
    });
    EXPECT_TRUE(all_ok(out)) << describe(out);
  }
}

TEST(HostFailures, MismatchedDtypesKindsAndRootsRaiseOnEveryRank) {
  auto out = run_ranks(3, [](Rank& rk) {
    {
      auto comm = rk.comm(opts(10000), "/dtype");
      DType in = rk.rank == 2 ? DType::f32 : DType::bf16;
      std::vector<float> buf(3 * 64), res(64);
      std::vector<const void*> ins{buf.data(), buf.data() + 64, buf.data() + 128};
      expect_throw<Error>([&] { comm->reduce_scatter(ins, res.data(), 64, in, DType::f32, {}); },
                          {"tide reduce_scatter: ranks disagree", "rank 0: count=64 dtype=bf16->f32 op=sum",
                           "rank 2: count=64 dtype=f32 op=sum"});
    }
    {
      auto comm = rk.comm(opts(10000), "/kind");
      std::vector<float> buf(16, 1.0f);
      if (rk.rank == 0)
        expect_throw<Error>([&] { comm->broadcast(buf.data(), 64, 0); },
                            {"tide broadcast: ranks disagree", "rank 0: broadcast bytes=64 root=0",
                             "rank 1: all_reduce count=16 dtype=f32 op=sum"});
      else
        expect_throw<Error>([&] { comm->all_reduce(buf.data(), 16, DType::f32, {}); },
                            {"tide all_reduce: ranks disagree", "rank 0: broadcast bytes=64 root=0"});
    }
    {
      auto comm = rk.comm(opts(10000), "/root");
      std::vector<uint8_t> buf(10);
      expect_throw<Error>([&] { comm->broadcast(buf.data(), 10, rk.rank == 0 ? 1 : 0); },
                          {"rank 0: bytes=10 root=1; rank 1: bytes=10 root=0"});
    }
  });
  EXPECT_TRUE(all_ok(out)) << describe(out);
}

TEST(HostFailures, LocalArgumentErrorFailsFastEverywhere) {
  auto out = run_ranks(3, [](Rank& rk) {
    auto comm = rk.comm(opts(20000));
    std::vector<float> in(8, 1.0f), o0(8), o1(8), o2(8);
    std::vector<void*> ptrs{o0.data(), o1.data(), o2.data()};
    if (rk.rank == 1) {
      ptrs.pop_back();
      expect_throw<Error>([&] { comm->all_gather(in.data(), ptrs, 8, DType::f32); },
                          {"tide all_gather: rank 1 passed 2 outputs, expected world_size=3"});
      expect_throw<Error>([&] { comm->broadcast(in.data(), 4, 7); }, {"unusable"});
    } else {
      // The others learn from rank 1's abort flag, long before the 20 s timeout.
      double ms = expect_throw<TimeoutError>([&] { comm->all_gather(in.data(), ptrs, 8, DType::f32); },
                                             {"tide all_gather:", "rank 1 aborted", "passed 2 outputs"});
      TIDE_REQUIRE(ms < 3000, "took ", ms, " ms");
    }
  });
  EXPECT_TRUE(all_ok(out)) << describe(out);
  // Purely local checks on one rank (world size 1 has no peers to disagree with).
  auto solo = run_ranks(1, [](Rank& rk) {
    std::vector<float> x(4);
    expect_throw<Error>([&] { rk.comm(opts(1000))->reduce(x.data(), 4, DType::f32, {}, 1); },
                        {"tide reduce: rank 0 got root 1 (world_size=1)"});
    expect_throw<Error>([&] { rk.comm(opts(1000), "/b")->all_reduce(nullptr, 4, DType::f32, {}); },
                        {"tide all_reduce: rank 0 passed a null buffer"});
    expect_throw<Error>([&] { rk.comm(opts(1000), "/c")->all_reduce(x.data(), 4, DType::boolean, {ReduceOp::avg}); },
                        {"tide all_reduce: rank 0: avg is not defined for bool"});
    expect_throw<Error>([&] { rk.comm(opts(1000), "/d")->send(x.data(), 4, 0, 0); }, {"tide send: rank 0 got peer 0"});
  });
  EXPECT_TRUE(all_ok(solo)) << describe(solo);
}

// A rank that leaves (_exit) or is SIGKILLed after joining: every survivor throws
// TimeoutError naming the dead rank, well within the timeout.
void dead_peer_case(int ws, bool sigkill, bool after_one_collective) {
  const auto shm_before = tide_shm_entries();
  auto out = run_ranks(ws, [&](Rank& rk) {
    auto comm = rk.comm(opts(10000));
    std::vector<float> buf(100000, 1.0f);
    if (after_one_collective) comm->all_reduce(buf.data(), buf.size(), DType::f32, {});
    const int victim = ws - 1;
    if (rk.rank == victim) {
      if (sigkill) ::raise(SIGKILL);
      ::_exit(7);
    }
    double ms = expect_throw<TimeoutError>([&] { comm->all_reduce(buf.data(), buf.size(), DType::f32, {}); },
                                           {"tide all_reduce: rank " + std::to_string(rk.rank),
                                            "rank " + std::to_string(victim) + " (pid", "died"});
    TIDE_REQUIRE(ms < 2000, "took ", ms, " ms");
    expect_throw<TimeoutError>([&] { comm->barrier(); }, {"unusable"});
  });
  for (int r = 0; r < ws - 1; ++r) EXPECT_EQ(out[r].exit_code, 0) << describe(out);
  if (sigkill) EXPECT_EQ(out[ws - 1].signal, SIGKILL) << describe(out);
  else EXPECT_EQ(out[ws - 1].exit_code, 7) << describe(out);
  EXPECT_EQ(tide_shm_entries(), shm_before);
}

TEST(HostFailures, ExitedPeerMakesSurvivorsThrow) {
  dead_peer_case(2, false, false);
  dead_peer_case(3, false, true);
}

TEST(HostFailures, SigkilledPeerMakesSurvivorsThrow) {
  dead_peer_case(2, true, true);
  dead_peer_case(4, true, false);
}

TEST(HostFailures, SilentPeerTimesOut) {
  auto out = run_ranks(3, [](Rank& rk) {
    auto comm = rk.comm(opts(1000));
    std::vector<uint16_t> in(1024), o(3 * 1024);
    std::vector<void*> ptrs{o.data(), o.data() + 1024, o.data() + 2048};
    if (rk.rank == 2) {  // alive but never calls
      std::this_thread::sleep_for(std::chrono::milliseconds(2500));
      return;
    }
    // The first survivor to time out aborts, so the other may report that instead.
    double ms = expect_throw<TimeoutError>([&] { comm->all_gather(in.data(), ptrs, 1024, DType::bf16); },
                                           {"tide all_gather: rank " + std::to_string(rk.rank),
                                            " timed out after 1000 ms waiting for rank 2 (count=1024 dtype=bf16)"});
    TIDE_REQUIRE(ms >= 990 && ms < 2400, "took ", ms, " ms");
  });
  EXPECT_TRUE(all_ok(out)) << describe(out);
}

// The group's setTimeout: a collective takes the timeout of the moment it begins.
TEST(HostFailures, TimeoutSetAfterCreationTakesEffectAtTheNextCollective) {
  auto out = run_ranks(2, [](Rank& rk) {
    auto comm = rk.comm(opts(500));
    std::vector<float> v(256, 1.0f);
    comm->set_timeout(std::chrono::milliseconds(5000));  // lengthened: a peer 1.2 s late is fine
    TIDE_REQUIRE(comm->timeout() == std::chrono::milliseconds(5000), "timeout() ", comm->timeout().count());
    if (rk.rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1200));
    auto t0 = Clock::now();
    comm->all_reduce(v.data(), v.size(), DType::f32, {});
    TIDE_REQUIRE(v[0] == 2.0f, "sum ", v[0]);
    if (rk.rank == 0) TIDE_REQUIRE(ms_since(t0) > 1000, "rank 0 waited only ", ms_since(t0), " ms");
    comm->set_timeout(std::chrono::milliseconds(400));  // shortened: a silent peer fails it soon
    if (rk.rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2000));
      return;
    }
    double ms = expect_throw<TimeoutError>([&] { comm->all_reduce(v.data(), v.size(), DType::f32, {}); },
                                           {"timed out after 400 ms waiting for rank 1"});
    TIDE_REQUIRE(ms >= 390 && ms < 1900, "took ", ms, " ms");
  });
  EXPECT_TRUE(all_ok(out)) << describe(out);
}

TEST(HostFailures, PeerThatClosedItsCommunicatorIsReported) {
  auto out = run_ranks(2, [](Rank& rk) {
    auto comm = rk.comm(opts(10000));
    std::vector<float> x(64, 1.0f);
    comm->all_reduce(x.data(), 64, DType::f32, {});
    if (rk.rank == 1) {
      comm.reset();  // closes, but the process lives on past the survivor's check
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      return;
    }
    double ms = expect_throw<TimeoutError>([&] { comm->all_reduce(x.data(), 64, DType::f32, {}); },
                                           {"tide all_reduce: rank 0 was waiting for rank 1, but rank 1 closed its "
                                            "communicator"});
    TIDE_REQUIRE(ms < 1000, "took ", ms, " ms");
  });
  EXPECT_TRUE(all_ok(out)) << describe(out);
}

TEST(HostFailures, SendRecvTagMismatchRaisesOnBothSides) {
  auto out = run_ranks(2, [](Rank& rk) {
    auto comm = rk.comm(opts(10000));
    std::vector<uint8_t> buf(100);
    if (rk.rank == 0) {
      comm->send(buf.data(), 100, 1, 5);  // eager: returns before the receiver looks
      expect_throw<TimeoutError>([&] { comm->barrier(); }, {"rank 1 aborted", "tag 6"});
    } else {
      expect_throw<Error>([&] { comm->recv(buf.data(), 100, 0, 6); },
                          {"tide recv: rank 1 expected 100 bytes with tag 6 from rank 0, but rank 0 sent 100 bytes "
                           "with tag 5"});
    }
  });
  EXPECT_TRUE(all_ok(out)) << describe(out);
}

TEST(HostFailures, StagingConfigurationMustAgree) {
  const auto shm_before = tide_shm_entries();
  auto out = run_ranks(2, [](Rank& rk) {
    CommOptions o = opts(5000);
    o.staging_bytes = rk.rank == 0 ? (64 << 10) : (128 << 10);
    expect_throw<Error>([&] { rk.comm(o); }, {"ranks disagree on the shared-memory configuration", "rank 0: staging=65536",
                                               "rank 1: staging=131072"});
  });
  EXPECT_TRUE(all_ok(out)) << describe(out);
  EXPECT_EQ(tide_shm_entries(), shm_before);
}

TEST(HostFailures, RankMissingFromRendezvousTimesOutAndAFailedJoinIsReported) {
  auto out = run_ranks(3, [](Rank& rk) {
    if (rk.rank == 2) {
      // A rank that fails to join (here: a world size nobody else uses) tells the others.
      expect_throw<Error>([&] { make_host_comm(*make_file_store(rk.store_dir), rk.ns, 2, 2, opts(5000)); },
                          {"invalid rank 2 for world size 2"});
      return;
    }
    // Ranks 0 and 1 wait for rank 2's key; it never comes (rank 2 failed before publishing).
    double ms = expect_throw<TimeoutError>([&] { rk.comm(opts(1000)); },
                                           {"tide host transport: rank " + std::to_string(rk.rank),
                                            " timed out after 1000 ms waiting for ranks [2] to join"});
    TIDE_REQUIRE(ms < 2500, "took ", ms, " ms");
  });
  EXPECT_TRUE(all_ok(out)) << describe(out);
  // A rank that fails after the others started waiting publishes why (as the transport
  // does when its own join fails); the waiters give up at once instead of at the timeout.
  auto out2 = run_ranks(3, [](Rank& rk) {
    if (rk.rank == 2) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      std::string why = "rank 2: cannot map 16 MiB of shared memory";
      make_file_store(rk.store_dir)->set(rk.ns + "/tide/host/failed", std::vector<uint8_t>(why.begin(), why.end()));
      return;
    }
    double ms = expect_throw<TimeoutError>([&] { rk.comm(opts(20000)); },
                                           {"gives up waiting for ranks [2]: another rank failed: rank 2: cannot map 16 MiB"});
    TIDE_REQUIRE(ms < 2000, "took ", ms, " ms");
  });
  EXPECT_TRUE(all_ok(out2)) << describe(out2);
}

// A rank that dies after publishing its record but before handing over its segment: the
// others notice its death (not the timeout), and nothing is left behind.
TEST(HostFailures, RankDyingDuringCreationIsNoticed) {
  const auto shm_before = tide_shm_entries();
  auto out = run_ranks(3, [](Rank& rk) {
    ::setenv("TIDE_HOST_ID", "this-host", 1);
    if (rk.rank == 2) {
      // Publish a record as the transport would, then die without sending a segment.
      auto store = make_file_store(rk.store_dir);
      std::string rec = std::to_string(::getpid()) + "\n65536\n32768\n3\nthis-host\nno-such-socket";
      store->set(rk.ns + "/tide/host/2", std::vector<uint8_t>(rec.begin(), rec.end()));
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      ::raise(SIGKILL);
    }
    const double ms = expect_throw<TimeoutError>([&] { rk.comm(opts(20000)); }, {"rank 2"});
    TIDE_REQUIRE(ms < 5000, "took ", ms, " ms");
  });
  EXPECT_EQ(out[2].signal, SIGKILL) << describe(out);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(out[r].exit_code, 0) << describe(out);
  EXPECT_EQ(tide_shm_entries(), shm_before);
}

TEST(HostFailures, RanksOnSeveralHostsAreRefusedAtCreation) {
  auto out = run_ranks(3, [](Rank& rk) {
    ::setenv("TIDE_HOST_ID", rk.rank == 1 ? "node-b" : "node-a", 1);
    expect_throw<Error>([&] { rk.comm(opts(5000)); },
                        {"the group's 3 ranks are on 2 hosts (ranks 0 2 on 'node-a'; ranks 1 on 'node-b')",
                         "needs all of them on one host"});
  });
  EXPECT_TRUE(all_ok(out)) << describe(out);
}

// Pages are reserved at creation: too little memory is an exception with the sizes (not a
// SIGBUS at the first touch), and the peers are told.
TEST(HostFailures, TooLittleMemoryIsAClearError) {
  auto out = run_ranks(2, [](Rank& rk) {
    CommOptions o = opts(5000);
    o.staging_bytes = size_t{1} << 50;  // 1 PiB: more than any machine has
    try {
      rk.comm(o);
      TIDE_REQUIRE(false, "no exception");
    } catch (const std::exception& e) {
      const std::string msg = e.what();  // its own shortage, or the peer's reported to it
      TIDE_REQUIRE(msg.find("needs 1.0 PiB of shared memory, but only ") != std::string::npos &&
                       msg.find(" is available") != std::string::npos, msg);
    }
  });
  EXPECT_TRUE(all_ok(out)) << describe(out);
}

TEST(HostLeaks, NoShmNamesNoFdsAndNoMappingsRemain) {
  const auto shm_before = tide_shm_entries();
  auto out = run_ranks(3, [](Rank& rk) {
    const int fds_before = count_fds();
    for (int round = 0; round < 3; ++round) {
      {
        auto comm = rk.comm(opts(10000), "/" + std::to_string(round));
        TIDE_REQUIRE(memfd_mappings(kSegmentLabel) == rk.world_size, "segments mapped: ", memfd_mappings(kSegmentLabel));
        std::vector<float> x(5000, 1.0f);
        comm->all_reduce(x.data(), x.size(), DType::f32, {});
        TIDE_REQUIRE(x[17] == static_cast<float>(rk.world_size), "all_reduce");
      }
      TIDE_REQUIRE(memfd_mappings(kSegmentLabel) == 0, "mappings left: ", memfd_mappings(kSegmentLabel));
    }
    TIDE_REQUIRE(count_fds() == fds_before, "fds before ", fds_before, ", after ", count_fds());
  });
  EXPECT_TRUE(all_ok(out)) << describe(out);
  EXPECT_EQ(tide_shm_entries(), shm_before);
}

TEST(HostDebug, TideDebugPrintsTheChosenTransport) {
  auto out = run_ranks(2, [](Rank& rk) {
    ::setenv("TIDE_DEBUG", "1", 1);
    char path[] = "/tmp/tide-debug-XXXXXX";
    int fd = ::mkstemp(path);
    ::dup2(fd, 2);
    rk.comm(opts(5000));
    std::fflush(stderr);
    std::string text(4096, '\0');
    text.resize(::pread(fd, text.data(), text.size(), 0));
    ::unlink(path);
    TIDE_REQUIRE(text.find("[tide] host transport (posix shm): rank " + std::to_string(rk.rank) + "/2") != std::string::npos &&
                     text.find("threads 1") != std::string::npos && text.find("staging 64 KiB") != std::string::npos,
                 "debug output: ", text);
  });
  EXPECT_TRUE(all_ok(out)) << describe(out);
}

}  // namespace
