// Passing file descriptors between the processes of one host. CUDA's shareable handles
// (cuMemCreate with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) are fds
// that only mean something in the process that holds them, so a peer must be handed the fd
// itself: SCM_RIGHTS over a Unix datagram socket. (pidfd_getfd would need ptrace rights
// over a sibling process, which Yama's default ptrace_scope=1 refuses.)
//
// Each rank binds a socket in the abstract namespace (nothing on the file system; it goes
// with the process), named after the group, the rank and the pid, and publishes the name
// through the store. Every message carries a tag and the sender's rank, so a fast rank's
// next exchange is kept aside, never mistaken for the current one. The kernel's
// credentials on each message (SO_PASSCRED) must name this process's user: another user's
// process cannot inject a descriptor (the same user's processes are trusted, as with the
// store itself). Sends and receives give
// up with tide::TimeoutError naming the rank, the peer and the tag.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tide/store.hpp"

namespace tide {

class FdChannel {
 public:
  // Collective over the group's `world_size` ranks (each publishes its address, then reads
  // every peer's).
  FdChannel(Store& store, const std::string& ns, int rank, int world_size,
            std::chrono::milliseconds timeout);
  // In two steps, for a caller that publishes the address in its own rendezvous: bind here,
  // then connect() with every rank's address().
  FdChannel(const std::string& ns, int rank, int world_size, std::chrono::milliseconds timeout);
  const std::string& address() const { return addresses_[rank_]; }
  void connect(std::vector<std::string> addresses);
  ~FdChannel();
  FdChannel(const FdChannel&) = delete;
  FdChannel& operator=(const FdChannel&) = delete;

  // Sends a duplicate of `fd` (the caller keeps its own) to `peer` under `tag`.
  void send(int peer, uint64_t tag, int fd);
  // The fd `peer` sent under `tag`; the caller owns it (close it). `between_polls`, when
  // given, runs about every 10 ms while waiting (it throws to give up early, e.g. when the
  // peer died).
  int receive(int peer, uint64_t tag, const std::function<void()>& between_polls = {});

  int rank() const { return rank_; }
  // For the sends and receives that start after it; any thread may call it.
  void set_timeout(std::chrono::milliseconds timeout) { timeout_.store(timeout); }

 private:
  bool take_one();  // one waiting message into early_; false when none is waiting

  int rank_, world_size_;
  std::atomic<std::chrono::milliseconds> timeout_;
  int sock_ = -1;
  std::vector<std::string> addresses_;          // abstract names, without the leading NUL
  std::map<std::pair<uint64_t, int>, int> early_;  // (tag, sender) -> fd, received ahead
};

}  // namespace tide
