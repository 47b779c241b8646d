// File descriptors between the processes of one host (include/tide/fd_channel.hpp).
#include "tide/fd_channel.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstddef>
#include <cstring>
#include <thread>

#include "tide/error.hpp"
#include "tide/hash.hpp"

namespace tide {
namespace {

struct Header {
  uint64_t tag;
  int32_t sender;
  int32_t pad;
};

sockaddr_un make_address(const std::string& name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  // Abstract namespace: sun_path starts with NUL; the length says where the name ends.
  TIDE_CHECK(name.size() + 1 <= sizeof a.sun_path, "tide: fd channel name too long: ", name);
  std::memcpy(a.sun_path + 1, name.data(), name.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return a;
}

}  // namespace

FdChannel::FdChannel(const std::string& ns, int rank, int world_size, std::chrono::milliseconds timeout)
    : rank_(rank), world_size_(world_size), timeout_(timeout), addresses_(world_size) {
  TIDE_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "tide: fd channel: bad rank ", rank,
             " of world size ", world_size);
  sock_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  TIDE_CHECK(sock_ >= 0, "tide: fd channel: rank ", rank, ": socket failed: ", std::strerror(errno));
  // The kernel attaches each sender's credentials: only this user's processes are heard.
  const int on = 1;
  if (::setsockopt(sock_, SOL_SOCKET, SO_PASSCRED, &on, sizeof on) != 0) {
    const int err = errno;
    ::close(sock_);
    throw Error(detail::concat("tide: fd channel: rank ", rank, ": SO_PASSCRED failed: ", std::strerror(err)));
  }
  // Unique per channel (a process may hold two channels of one group name, the old one not
  // yet destroyed) and short (sun_path holds 107 bytes) whatever the group's name.
  static std::atomic<uint64_t> channels{0};
  uint64_t h = kFnvBasis;
  for (unsigned char c : ns) h = fnv(h, c);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  const std::string mine = detail::concat("tide-fd/", hex, "/", rank, "/", ::getpid(), "/", ++channels);
  socklen_t len = 0;
  sockaddr_un addr = make_address(mine, &len);
  if (::bind(sock_, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    const int err = errno;
    ::close(sock_);
    throw Error(detail::concat("tide: fd channel: rank ", rank, ": bind '", mine, "' failed: ", std::strerror(err)));
  }
  addresses_[rank] = mine;
}

FdChannel::FdChannel(Store& store, const std::string& ns, int rank, int world_size,
                     std::chrono::milliseconds timeout)
    : FdChannel(ns, rank, world_size, timeout) {
  // The delegated constructor finished, so the destructor closes the socket if this throws.
  const std::string key = "tide-fd/" + ns + "/";
  store.set(key + std::to_string(rank), std::vector<uint8_t>(address().begin(), address().end()));
  std::vector<std::string> all;
  for (auto& v : await_ranks(store, key, world_size, "", timeout,
                             detail::concat("tide: fd channel: rank ", rank, " of '", ns, "'")))
    all.emplace_back(v.begin(), v.end());
  connect(std::move(all));
}

void FdChannel::connect(std::vector<std::string> addresses) {
  TIDE_CHECK(addresses.size() == static_cast<size_t>(world_size_) && addresses[rank_] == addresses_[rank_],
             "tide: fd channel: rank ", rank_, ": connect() needs every rank's address, this rank's own included");
  addresses_ = std::move(addresses);
}

FdChannel::~FdChannel() {
  for (auto& [k, fd] : early_) ::close(fd);
  if (sock_ >= 0) ::close(sock_);
}

void FdChannel::send(int peer, uint64_t tag, int fd) {
  TIDE_CHECK(peer >= 0 && peer < world_size_ && peer != rank_, "tide: fd channel: rank ", rank_, ": bad peer ", peer);
  socklen_t len = 0;
  sockaddr_un to = make_address(addresses_[peer], &len);
  Header h{tag, rank_, 0};
  iovec iov{&h, sizeof h};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_name = &to;
  msg.msg_namelen = len;
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  // Non-blocking with a deadline: a peer whose queue is full (or that is gone) must not
  // hang this rank.
  const std::chrono::milliseconds timeout = timeout_.load();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto nap = std::chrono::microseconds(50);
  for (;;) {
    if (::sendmsg(sock_, &msg, MSG_DONTWAIT | MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof h)) return;
    const int err = errno;
    // Addresses are published only once bound, so a refusal means the peer's socket is gone.
    if (err == ECONNREFUSED)
      throw TimeoutError(detail::concat("tide: fd channel: rank ", rank_, ": rank ", peer,
                                        " has closed its channel (did the process exit?) before taking tag ", tag));
    if (err != EAGAIN && err != EWOULDBLOCK && err != EINTR)
      throw Error(detail::concat("tide: fd channel: rank ", rank_, ": sending tag ", tag, " to rank ", peer,
                                 " failed: ", std::strerror(err)));
    if (std::chrono::steady_clock::now() > deadline)
      throw TimeoutError(detail::concat("tide: fd channel: rank ", rank_, ": rank ", peer, " did not take tag ", tag,
                                        " within ", timeout.count(), " ms (", std::strerror(err), ")"));
    // The peer's queue is full, perhaps because it is itself stuck sending to us: take what
    // is waiting here, so that every rank sending to every other cannot deadlock.
    while (take_one()) {
    }
    std::this_thread::sleep_for(nap);
    if (nap < std::chrono::milliseconds(2)) nap *= 2;
  }
}

int FdChannel::receive(int peer, uint64_t tag, const std::function<void()>& between_polls) {
  TIDE_CHECK(peer >= 0 && peer < world_size_ && peer != rank_, "tide: fd channel: rank ", rank_, ": bad peer ", peer);
  const std::chrono::milliseconds timeout = timeout_.load();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (auto it = early_.find({tag, peer}); it != early_.end()) {
      const int fd = it->second;
      early_.erase(it);
      return fd;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0)
      throw TimeoutError(detail::concat("tide: fd channel: rank ", rank_, ": nothing from rank ", peer, " under tag ",
                                        tag, " within ", timeout.count(), " ms"));
    pollfd p{sock_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count() + 1, between_polls ? 10 : 1000))) > 0)
      take_one();
    else if (between_polls)
      between_polls();
  }
}

bool FdChannel::take_one() {
  Header h{};
  iovec iov{&h, sizeof h};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int)) + CMSG_SPACE(sizeof(ucred))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  const ssize_t n = ::recvmsg(sock_, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return false;
    throw Error(detail::concat("tide: fd channel: rank ", rank_, ": recvmsg failed: ", std::strerror(errno)));
  }
  int fd = -1;
  bool same_user = false;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET) continue;
    if (c->cmsg_type == SCM_RIGHTS && fd < 0) std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
    if (c->cmsg_type == SCM_CREDENTIALS) {
      ucred cred{};
      std::memcpy(&cred, CMSG_DATA(c), sizeof cred);
      same_user = cred.uid == ::getuid();
    }
  }
  if (n != static_cast<ssize_t>(sizeof h) || fd < 0 || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
    if (fd >= 0) ::close(fd);
    throw Error(detail::concat("tide: fd channel: rank ", rank_, ": a malformed message (", n, " bytes)"));
  }
  if (!same_user) {  // not one of ours: drop it, keep listening
    ::close(fd);
    return true;
  }
  if (auto [it, fresh] = early_.emplace(std::make_pair(h.tag, static_cast<int>(h.sender)), fd); !fresh)
    ::close(fd);  // a duplicate (tag, sender): keep the first
  return true;
}

}  // namespace tide
