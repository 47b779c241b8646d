// Shared-memory transport. Each rank owns one segment:
//   [header | flags (one cache line each) | exchange records x2 | staging slots | channels]
// Every rank maps every segment; loads and stores go straight to the peer's memory. A
// segment is a memfd that never has a name: its fd travels to the peers over the FdChannel
// (SCM_RIGHTS), so nothing is left on any file system whenever a process dies, and the size
// of /dev/shm does not matter. Waits
// spin briefly, then sleep in FUTEX_WAIT on the shared word (not FUTEX_PRIVATE: the waker is
// another process) with a short timeout, re-checking the deadline and peer liveness.
#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <random>
#include <iomanip>
#include <sstream>
#include <thread>
#include <vector>

#include "../../core/convert.hpp"
#include "../../core/env.hpp"
#include "../../core/shared_counter.hpp"
#include "tide/error.hpp"
#include "tide/fd_channel.hpp"
#include "tide/host_transport.hpp"
#include "tide/reduce_kernels.hpp"
#include "tide/thread_pool.hpp"

namespace tide {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kMagic = 0x7469646573686d31ull;  // "tideshm1"
constexpr size_t kLine = 64;
constexpr size_t kPage = 4096;
constexpr size_t kMinPiece = 256 << 10;  // smallest piece worth handing to another thread
constexpr auto kShortSpin = std::chrono::microseconds(10);
constexpr auto kLongSpin = std::chrono::microseconds(200);
constexpr auto kNap = std::chrono::milliseconds(5);  // futex timeout between liveness checks

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

int available_cores() {
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::thread::hardware_concurrency());
}

struct alignas(kLine) FlagLine : SharedCounter {};
static_assert(sizeof(FlagLine) == kLine);
static_assert(std::atomic<uint32_t>::is_always_lock_free);

constexpr uint32_t kAbortWriting = 2, kAborted = 1;  // Header::aborted

struct Header {
  uint64_t magic;
  int32_t rank;
  int32_t pid;
  uint64_t self_addr;  // where this rank mapped its own segment (the CMA probe reads it)
  std::atomic<uint32_t> closed;  // the rank destroyed its communicator (it may live on)
  alignas(kLine) std::atomic<uint32_t> aborted;  // 0, kAbortWriting (abort_msg being written), kAborted
  char abort_msg[512];
};


// kill(pid, 0) succeeds on a zombie (dead, not yet reaped), so look at /proc too.
bool process_dead(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "re");
  if (!f) return false;
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* paren = std::strrchr(buf, ')');
  return paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

// Sizes for people: exact where round (16 MiB), else one decimal of the largest unit.
std::string mib(size_t bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (u < 5 && bytes >= (size_t{1024} << (10 * u))) ++u;
  const size_t unit = size_t{1} << (10 * u);
  std::ostringstream os;
  if (bytes % unit == 0) os << bytes / unit << ' ' << units[u];
  else os << std::fixed << std::setprecision(1) << static_cast<double>(bytes) / static_cast<double>(unit) << ' ' << units[u];
  return os.str();
}

// The layout every rank computes from the agreed sizes.
struct Layout {
  int world_size;
  size_t slot_bytes, num_slots, channel_bytes, channel_depth, record_bytes;
  size_t flags_off, records_off, staging_off, channels_off, total;

  Layout(int ws, size_t staging, size_t slot) : world_size(ws) {
    slot_bytes = slot;
    num_slots = staging / slot;
    channel_depth = 2;
    channel_bytes = std::clamp<size_t>(align_up(slot / 2, kLine), 1024, size_t{1} << 20);
    record_bytes = align_up(64 + 16 * static_cast<size_t>(ws), kLine);
    flags_off = align_up(sizeof(Header), kLine);
    records_off = flags_off + (Flag::kFixed + 2 * static_cast<size_t>(ws)) * kLine;
    staging_off = align_up(records_off + 2 * record_bytes, kPage);
    channels_off = staging_off + num_slots * slot_bytes;
    total = align_up(channels_off + static_cast<size_t>(ws) * channel_depth * channel_bytes, kPage);
  }
};

// What each rank publishes in the store at creation; one field per line (the group name
// inside the fd address may hold spaces).
struct Rendezvous {
  int pid = 0;
  size_t staging = 0, slot = 0;
  int world_size = 0;
  std::string host;        // host_identity(): ranks must share it
  std::string fd_address;  // FdChannel::address()
};

std::vector<uint8_t> encode(const Rendezvous& r) {
  std::string s = detail::concat(r.pid, '\n', r.staging, '\n', r.slot, '\n', r.world_size, '\n', r.host, '\n',
                                 r.fd_address);
  return {s.begin(), s.end()};
}

Rendezvous decode(const std::vector<uint8_t>& v) {
  std::istringstream is(std::string(v.begin(), v.end()));
  Rendezvous r;
  std::string line;
  std::getline(is, line), r.pid = std::stoi(line);
  std::getline(is, line), r.staging = std::stoull(line);
  std::getline(is, line), r.slot = std::stoull(line);
  std::getline(is, line), r.world_size = std::stoi(line);
  std::getline(is, r.host);
  std::getline(is, r.fd_address);
  return r;
}

// Bytes of memory a new shared segment can take: MemAvailable, or less under a cgroup
// (v2) memory limit. 0 when unknown.
size_t available_memory() {
  size_t avail = 0;
  if (FILE* f = std::fopen("/proc/meminfo", "re")) {
    char line[256];
    unsigned long long kb = 0;
    while (std::fgets(line, sizeof line, f))
      if (std::sscanf(line, "MemAvailable: %llu kB", &kb) == 1) avail = static_cast<size_t>(kb) << 10;
    std::fclose(f);
  }
  auto read_u64 = [](const char* path, size_t* out) {
    FILE* f = std::fopen(path, "re");
    if (!f) return false;
    unsigned long long v = 0;
    const bool ok = std::fscanf(f, "%llu", &v) == 1;  // "max" reads as no number: no limit
    std::fclose(f);
    *out = static_cast<size_t>(v);
    return ok;
  };
  size_t limit = 0, used = 0;
  if (read_u64("/sys/fs/cgroup/memory.max", &limit) && read_u64("/sys/fs/cgroup/memory.current", &used))
    avail = std::min(avail, limit > used ? limit - used : 0);
  return avail;
}

// A new anonymous shared segment of `bytes`, its pages reserved now: a machine short of
// memory fails here, naming the sizes, instead of with SIGBUS at the first touch.
int create_segment(const char* label, size_t bytes, const std::string& who) {
  const size_t avail = available_memory();
  TIDE_CHECK(avail == 0 || bytes <= avail, who, " needs ", mib(bytes), " of shared memory, but only ", mib(avail),
             " is available (MemAvailable, or the cgroup's memory.max); lower TIDE_SHM_STAGING_BYTES or free memory");
  const int fd = ::memfd_create(label, MFD_CLOEXEC);
  TIDE_CHECK(fd >= 0, who, ": memfd_create failed: ", std::strerror(errno));
  int err = 0;
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) err = errno;
  else err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (err) {
    ::close(fd);
    throw Error(detail::concat(who, " cannot reserve ", mib(bytes), " of shared memory (", mib(avail),
                               " available): ", std::strerror(err)));
  }
  return fd;
}

// Closes an fd when it goes out of scope.
struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

// Maps the whole of a segment fd (of `bytes`, checked); the caller keeps the fd.
std::byte* map_segment(int fd, size_t bytes, const std::string& what) {
  struct stat st {};
  int err = 0;
  if (::fstat(fd, &st) != 0) err = errno;
  else if (static_cast<size_t>(st.st_size) != bytes) err = EINVAL;
  void* p = err ? MAP_FAILED : ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (!err && p == MAP_FAILED) err = errno;
  TIDE_CHECK(p != MAP_FAILED, "tide host transport: cannot map ", what, " (", mib(bytes), ", the fd has ",
             static_cast<size_t>(st.st_size), " bytes): ", std::strerror(err));
  return static_cast<std::byte*>(p);
}

// One mapping per rank; the memory has no name, so it lives exactly as long as some
// process maps it. Unmapping is local: peers may have unmapped
// theirs already (or died), which does not affect this rank's mappings.
class ShmSymmetric final : public SymmetricBuffer {
 public:
  ShmSymmetric(int rank, std::vector<std::byte*> base, std::vector<size_t> bytes)
      : rank_(rank), base_(std::move(base)), bytes_(std::move(bytes)) {}
  ~ShmSymmetric() override {
    for (size_t r = 0; r < base_.size(); ++r)
      if (base_[r]) ::munmap(base_[r], bytes_[r]);
  }
  std::byte* local() override { return base_[rank_]; }
  std::byte* peer(int rank) override {
    TIDE_CHECK(rank >= 0 && static_cast<size_t>(rank) < base_.size(), "tide SymmetricBuffer::peer: rank ", rank,
               " out of range (world_size=", base_.size(), ")");
    return base_[rank];
  }
  size_t bytes(int rank) const override {
    TIDE_CHECK(rank >= 0 && static_cast<size_t>(rank) < bytes_.size(), "tide SymmetricBuffer::bytes: rank ", rank,
               " out of range (world_size=", bytes_.size(), ")");
    return bytes_[rank];
  }
  void release(size_t offset, size_t bytes) override {
    const size_t size = bytes_[rank_];
    TIDE_CHECK(offset <= size && bytes <= size - offset, "tide SymmetricBuffer::release: rank ", rank_,
               ": range [", offset, ", ", offset + bytes, ") is outside its ", size, " bytes");
    if (bytes == 0) return;
    std::byte* b = base_[rank_];
    const size_t end = offset + bytes;
    size_t lo = align_up(offset, kPage), hi = end / kPage * kPage;
    if (lo >= hi) {  // no whole page inside: just zero it
      std::memset(b + offset, 0, bytes);
      return;
    }
    std::memset(b + offset, 0, lo - offset);
    std::memset(b + hi, 0, end - hi);
    // MADV_REMOVE punches a hole in the shm object: the pages go back to the OS and read
    // as zeros for every rank mapping them, until written again.
    if (::madvise(b + lo, hi - lo, MADV_REMOVE) != 0) {
      const int err = errno;
      std::memset(b + lo, 0, hi - lo);
      throw Error(detail::concat("tide SymmetricBuffer::release: rank ", rank_, ": madvise(MADV_REMOVE) of ",
                                 hi - lo, " bytes at offset ", lo, " failed: ", std::strerror(err)));
    }
  }

 private:
  int rank_;
  std::vector<std::byte*> base_;
  std::vector<size_t> bytes_;
};

class ShmTransport final : public Transport {
 public:
  ShmTransport(Store& store, const std::string& ns, int rank, int ws, const CommOptions& opt)
      : rank_(rank), ws_(ws), timeout_(opt.timeout), layout_(ws, 0, 1), counter_start_(opt.counter_start),
        exchanges_(opt.counter_start), pids_(opt.pids) {
    size_t staging = opt.staging_bytes ? opt.staging_bytes
                                       : env::get_bytes("TIDE_SHM_STAGING_BYTES", kDefaultStagingBytes);
    size_t slot = env::get_bytes("TIDE_SHM_SLOT_BYTES", std::min<size_t>(staging / 2, size_t{2} << 20));
    // A slot must hold one 64-byte piece per rank; there must be two slots to pipeline.
    slot = std::max(align_up(slot, kLine), kLine * static_cast<size_t>(ws));
    staging = std::max(staging, 2 * slot);
    layout_ = Layout(ws, staging, slot);

    int threads = opt.num_threads;
    if (threads <= 0) threads = static_cast<int>(env::get_int("TIDE_NUM_THREADS", 0));
    if (threads <= 0) {
      int hw = static_cast<int>(std::thread::hardware_concurrency());
      threads = std::clamp(hw / ws, 1, 8);
    }
    pool_ = std::make_unique<ThreadPool>(threads);
    // The most processes we know of on this host: the group's ranks here, the launcher's.
    const int busy = std::max({opt.host_ranks, ws, static_cast<int>(env::get_int("LOCAL_WORLD_SIZE", 0))});
    spin_ = host_spin(busy, available_cores());

    base_.assign(ws, nullptr);
    try {
      rendezvous(store, ns, staging);
      probe_cma();
    } catch (const std::exception& e) {
      unmap_all();
      // Tell ranks still waiting in the store, so they fail now rather than at the timeout.
      try {
        std::string why = detail::concat("rank ", rank, ": ", e.what());
        store.set(ns + "/tide/host/failed", std::vector<uint8_t>(why.begin(), why.end()));
      } catch (...) {
      }
      throw;
    }
    env::log(detail::concat("host transport (posix shm): rank ", rank, "/", ws, ", ns '", ns, "', staging ",
                            mib(layout_.num_slots * slot), " (", layout_.num_slots, " x ", mib(slot),
                            " slots), p2p channels ", layout_.channel_depth, " x ", mib(layout_.channel_bytes),
                            ", threads ", threads, ", cma ", cma_ ? "on" : "off", " (", cma_why_, "), spin ",
                            spin_.count(), " us (", busy, " processes, ", available_cores(), " cores), timeout ",
                            timeout_.load().count(), " ms"));
  }

  ~ShmTransport() override {
    if (base_[rank_]) header(rank_)->closed.store(1, std::memory_order_release);
    unmap_all();
  }

  const char* name() const override { return "shm"; }
  int rank() const override { return rank_; }
  int world_size() const override { return ws_; }
  std::chrono::microseconds wait_spin() const override { return spin_; }
  int num_slots() const override { return static_cast<int>(layout_.num_slots); }
  size_t slot_bytes() const override { return layout_.slot_bytes; }
  std::byte* peer(int r, int slot) override {
    return base_[r] + layout_.staging_off + static_cast<size_t>(slot) * layout_.slot_bytes;
  }
  int channel_depth() const override { return static_cast<int>(layout_.channel_depth); }
  size_t channel_bytes() const override { return layout_.channel_bytes; }
  std::byte* channel(int sender, int receiver, int index) override {
    size_t i = static_cast<size_t>(receiver) * layout_.channel_depth + static_cast<size_t>(index);
    return base_[sender] + layout_.channels_off + i * layout_.channel_bytes;
  }

  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0 || dst == src) return;
    size_t pieces = std::min<size_t>(pool_->size(), std::max<size_t>(1, bytes / kMinPiece));
    if (pieces <= 1) {
      std::memcpy(dst, src, bytes);
      return;
    }
    size_t step = align_up((bytes + pieces - 1) / pieces, kPage);
    pool_->run(pieces, [&](size_t i) {
      size_t off = i * step;
      if (off < bytes) std::memcpy(static_cast<char*>(dst) + off, static_cast<const char*>(src) + off,
                                   std::min(step, bytes - off));
    });
  }

  void reduce(void* dst, DType dst_dtype, std::span<const void* const> srcs, DType src_dtype, size_t count,
              ReduceArgs args) override {
    const size_t in_es = dtype_size(src_dtype), out_es = dtype_size(dst_dtype);
    size_t pieces = std::min<size_t>(pool_->size(), std::max<size_t>(1, count * in_es * srcs.size() / kMinPiece));
    if (pieces <= 1) return reduce_kernel(dst, dst_dtype, srcs.data(), srcs.size(), src_dtype, count, args);
    size_t step = align_up((count + pieces - 1) / pieces, 64);
    pool_->run(pieces, [&](size_t i) {
      size_t off = i * step;
      if (off >= count) return;
      std::vector<const void*> s(srcs.size());
      for (size_t k = 0; k < s.size(); ++k) s[k] = static_cast<const char*>(srcs[k]) + off * in_es;
      reduce_kernel(static_cast<char*>(dst) + off * out_es, dst_dtype, s.data(), s.size(), src_dtype,
                    std::min(step, count - off), args);
    });
  }

  void convert(std::span<const StridedCopy> ops, DType dst_dtype, DType src_dtype) override {
    TIDE_CHECK(can_convert(src_dtype, dst_dtype), "tide ", collective_, ": rank ", rank_, " cannot convert ",
               dtype_name(src_dtype), " to ", dtype_name(dst_dtype), " (only equal types, f32 <-> bf16/f16)");
    const size_t des = dtype_size(dst_dtype), ses = dtype_size(src_dtype);
    // Element prefix sums over the ops; each worker takes an even share of the elements,
    // whatever runs they fall in.
    std::vector<size_t> start(ops.size() + 1, 0);
    for (size_t i = 0; i < ops.size(); ++i) start[i + 1] = start[i] + ops[i].run * ops[i].count;
    const size_t total = start.back();
    if (total == 0) return;
    const size_t pieces = std::min<size_t>(pool_->size(), std::max<size_t>(1, total * std::max(des, ses) / kMinPiece));
    const size_t step = align_up((total + pieces - 1) / pieces, 64);
    auto work = [&](size_t i) {
      size_t k = i * step;
      const size_t end = std::min(total, k + step);
      if (k >= end) return;
      size_t o = static_cast<size_t>(std::upper_bound(start.begin(), start.end(), k) - start.begin()) - 1;
      while (k < end) {
        const StridedCopy& op = ops[o];
        const size_t local = k - start[o];
        const size_t q = local / std::max<size_t>(op.run, 1), off = local % std::max<size_t>(op.run, 1);
        const size_t n = std::min(op.run - off, end - k);
        convert_kernel(static_cast<std::byte*>(op.dst) + (q * op.dst_stride + off) * des, dst_dtype,
                       static_cast<const std::byte*>(op.src) + (q * op.src_stride + off) * ses, src_dtype, n);
        k += n;
        while (o + 1 < ops.size() && k >= start[o + 1]) ++o;
      }
    };
    if (pieces <= 1) return work(0);
    pool_->run(pieces, work);
  }

  std::shared_ptr<SymmetricBuffer> allocate_symmetric(size_t bytes) override {
    // My segment (none for 0 bytes); sizes through the control exchange, fds over the
    // FdChannel under this allocation's own tag.
    const uint64_t tag = ++symmetric_allocations_;
    std::vector<std::byte*> base(ws_, nullptr);
    std::vector<size_t> sizes(ws_, 0);
    try {
      const std::string who = detail::concat("tide allocate_symmetric: rank ", rank_);
      FdGuard own{bytes > 0 ? create_segment(kSymmetricLabel, bytes, who) : -1};
      uint64_t mine = bytes;
      exchange(&mine, sizeof mine, sizes.data());
      if (own.fd >= 0) {
        base[rank_] = map_segment(own.fd, bytes, "this rank's symmetric segment");
        for (int r = 0; r < ws_; ++r)
          if (r != rank_) fd_channel_->send(r, tag, own.fd);
      }
      for (int r = 0; r < ws_; ++r) {
        if (r == rank_ || sizes[r] == 0) continue;
        FdGuard peer{fd_channel_->receive(r, tag, [&] { check_alive(r); })};
        base[r] = map_segment(peer.fd, sizes[r], detail::concat("rank ", r, "'s symmetric segment"));
      }
    } catch (...) {
      for (int r = 0; r < ws_; ++r)
        if (base[r]) ::munmap(base[r], sizes[r]);
      throw;
    }
    return std::make_shared<ShmSymmetric>(rank_, std::move(base), std::move(sizes));
  }

  bool can_get() const override { return cma_; }

  void get(int peer, void* dst, const void* remote, size_t bytes) override {
    if (bytes == 0) return;
    const pid_t pid = header(peer)->pid;
    size_t pieces = std::min<size_t>(pool_->size(), std::max<size_t>(1, bytes / kMinPiece));
    size_t step = align_up((bytes + pieces - 1) / pieces, kPage);
    std::atomic<int> err{0};
    pool_->run(pieces, [&](size_t i) {
      for (size_t off = i * step, end = std::min(bytes, off + step); off < end;) {
        iovec l{static_cast<char*>(dst) + off, end - off};
        iovec r{const_cast<char*>(static_cast<const char*>(remote)) + off, end - off};
        ssize_t n = ::process_vm_readv(pid, &l, 1, &r, 1, 0);
        if (n <= 0) {
          err = n < 0 ? errno : EIO;
          return;
        }
        off += static_cast<size_t>(n);
      }
    });
    if (err == 0) return;
    check_alive(peer);  // a dead peer is a TimeoutError like any other
    throw Error(detail::concat("tide ", collective_, ": rank ", rank_, " cannot read rank ", peer,
                               "'s buffer with process_vm_readv: ", std::strerror(err.load())));
  }

  uint64_t counter_start() const override { return counter_start_; }

  void post(Flag f, uint64_t value) override {
    flag(rank_, f).post(static_cast<uint32_t>(value));
  }

  void wait(int peer, Flag f, uint64_t counter) override {
    FlagLine& l = flag(peer, f);
    const uint32_t value = static_cast<uint32_t>(counter);
    if (l.reached(value) || l.spin(value, spin_)) return;
    const timespec nap{0, std::chrono::duration_cast<std::chrono::nanoseconds>(kNap).count()};
    for (;;) {
      if (l.sleep(value, nap)) return;
      check_alive(peer);
    }
  }


  bool wait_for(int peer, Flag f, uint64_t counter, std::chrono::microseconds at_most) override {
    FlagLine& l = flag(peer, f);
    const uint32_t value = static_cast<uint32_t>(counter);
    if (l.reached(value)) return true;
    if (at_most.count() <= 0) return false;
    if (l.spin(value, std::min(spin_, at_most))) return true;
    const auto slice = std::min<std::chrono::microseconds>(kNap, at_most);
    if (l.sleep(value, timespec{0, std::chrono::duration_cast<std::chrono::nanoseconds>(slice).count()})) return true;
    check_alive(peer);
    return false;
  }

  void exchange(const void* mine, size_t bytes, void* all) override {
    TIDE_CHECK(bytes <= layout_.record_bytes, "tide: control record of ", bytes, " bytes exceeds ",
               layout_.record_bytes);
    // Two records alternate: a peer reads my record k only before it posts k+1, and I pass
    // exchange k+1 only after every peer posted it, so record k is free again at k+2.
    const uint64_t k = ++exchanges_;
    auto record = [&](int r) { return base_[r] + layout_.records_off + (k & 1) * layout_.record_bytes; };
    if (bytes) std::memcpy(record(rank_), mine, bytes);
    post(Flag::control(), k);
    for (int i = 0; i < ws_; ++i) {
      int p = (rank_ + i) % ws_;
      if (p != rank_) wait(p, Flag::control(), k);
      if (bytes) std::memcpy(static_cast<char*>(all) + static_cast<size_t>(p) * bytes, record(p), bytes);
    }
  }

  void begin(const char* collective, std::string detail) override {
    collective_ = collective;
    detail_ = std::move(detail);
    if (Header* h = header(rank_); h && h->aborted.load(std::memory_order_acquire) == kAborted)
      throw TimeoutError(detail::concat("tide ", collective_, ": rank ", rank_, " aborted its communicator earlier: ",
                                        std::string(h->abort_msg, strnlen(h->abort_msg, sizeof h->abort_msg))));
    op_timeout_ = timeout_.load();
    deadline_ = Clock::now() + op_timeout_;
  }

  std::chrono::milliseconds timeout() const override { return timeout_.load(); }
  void set_timeout(std::chrono::milliseconds timeout) override {
    timeout_.store(timeout);
    fd_channel_->set_timeout(timeout);
  }

  void abort(const std::string& why) override {
    Header* h = header(rank_);
    uint32_t none = 0;  // the worker's failure and the caller's abort() may race: one writes
    if (!h->aborted.compare_exchange_strong(none, kAbortWriting)) return;
    std::snprintf(h->abort_msg, sizeof h->abort_msg, "%s", why.c_str());
    h->aborted.store(kAborted, std::memory_order_release);
  }

 private:
  Header* header(int r) { return reinterpret_cast<Header*>(base_[r]); }
  FlagLine& flag(int r, Flag f) {
    return reinterpret_cast<FlagLine*>(base_[r] + layout_.flags_off)[f.index];
  }

  // Between naps: the deadline, the awaited peer's death, and any rank's abort.
  void check_alive(int peer) {
    auto fail = [&](const std::string& what, bool with_detail) {
      std::string msg = detail::concat("tide ", collective_, ": rank ", rank_, " ", what);
      if (with_detail && !detail_.empty()) msg += " (" + detail_ + ")";
      abort(msg);
      throw TimeoutError(msg);
    };
    if (Header* h = header(rank_); h->aborted.load(std::memory_order_acquire) == kAborted)  // abort(), another thread
      fail(detail::concat("gave up waiting for rank ", peer, ": this rank aborted: ",
                          std::string(h->abort_msg, strnlen(h->abort_msg, sizeof h->abort_msg))), false);
    for (int r = 0; r < ws_; ++r) {
      Header* h = header(r);
      if (r == rank_ || h->aborted.load(std::memory_order_acquire) != kAborted) continue;
      fail(detail::concat("gave up waiting for rank ", peer, " because rank ", r, " aborted: ",
                          std::string(h->abort_msg, strnlen(h->abort_msg, sizeof h->abort_msg))), false);
    }
    // Only the awaited peer: others may close legitimately once their part is done.
    if (header(peer)->closed.load(std::memory_order_acquire))
      fail(detail::concat("was waiting for rank ", peer, ", but rank ", peer, " closed its communicator"), true);
    if (process_dead(header(peer)->pid))
      fail(detail::concat("was waiting for rank ", peer, ", but rank ", peer, " (pid ", header(peer)->pid, ") died"), true);
    if (Clock::now() >= deadline_)
      fail(detail::concat("timed out after ", op_timeout_.count(), " ms waiting for rank ", peer), true);
  }

  void rendezvous(Store& store, const std::string& ns, size_t staging) {
    const std::chrono::milliseconds timeout = timeout_.load();  // in the constructor: nobody sets it yet
    const std::string who = detail::concat("tide host transport: rank ", rank_, " of group '", ns, "'");
    fd_channel_ = std::make_unique<FdChannel>(ns + "/tide/host", rank_, ws_, timeout);
    FdGuard own{create_segment(kSegmentLabel, layout_.total, who)};
    base_[rank_] = map_segment(own.fd, layout_.total, "this rank's segment");
    Header* h = header(rank_);
    h->magic = kMagic;
    h->rank = rank_;
    h->pid = static_cast<int32_t>(::getpid());
    h->self_addr = reinterpret_cast<uint64_t>(base_[rank_]);
    for (uint32_t i = 0; i < Flag::kFixed + 2 * static_cast<uint32_t>(ws_); ++i)  // before any peer sees them
      flag(rank_, Flag{i}).value.store(static_cast<uint32_t>(counter_start_), std::memory_order_relaxed);

    const std::string prefix = ns + "/tide/host/";
    const std::string failed = ns + "/tide/host/failed";
    Rendezvous mine{h->pid, staging, layout_.slot_bytes, ws_, host_identity(), fd_channel_->address()};
    store.set(prefix + std::to_string(rank_), encode(mine));
    std::vector<Rendezvous> all;
    auto died = [&](const std::vector<int>& missing) {  // pids known from node discovery
      for (int r : missing)
        if (static_cast<size_t>(r) < pids_.size() && process_dead(pids_[r]))
          throw TimeoutError(detail::concat(who, " was waiting for rank ", r, " to join, but rank ", r, " (pid ",
                                            pids_[r], ") died"));
    };
    for (auto& v : await_ranks(store, prefix, ws_, failed, timeout, who, died)) all.push_back(decode(v));
    check_one_host(all);
    for (int r = 0; r < ws_; ++r) {
      if (all[r].staging == staging && all[r].slot == layout_.slot_bytes && all[r].world_size == ws_) continue;
      std::ostringstream os;
      os << "tide host transport: ranks disagree on the shared-memory configuration "
            "(TIDE_SHM_STAGING_BYTES / TIDE_SHM_SLOT_BYTES / world size):";
      for (int q = 0; q < ws_; ++q)
        os << (q ? ";" : "") << " rank " << q << ": staging=" << all[q].staging << " slot=" << all[q].slot
           << " world_size=" << all[q].world_size;
      throw Error(os.str());
    }
    std::vector<std::string> addresses;
    for (auto& r : all) addresses.push_back(r.fd_address);
    fd_channel_->connect(std::move(addresses));
    // My segment to every peer, then every peer's into my address space. A peer that dies
    // or fails meanwhile ends the wait (its pid, the failure key); so does the timeout.
    const auto deadline = Clock::now() + timeout;
    auto another_failed = [&] {  // the first failure explains the rest: report it
      if (!store.check(failed)) return;
      const std::vector<uint8_t> why = store.get(failed, timeout);
      throw TimeoutError(detail::concat(who, " gives up: another rank failed: ", std::string(why.begin(), why.end())));
    };
    auto between_polls = [&](int peer) {
      return [&, peer] {
        if (process_dead(all[peer].pid))
          throw TimeoutError(detail::concat(who, " was waiting for rank ", peer, "'s segment, but rank ", peer,
                                            " (pid ", all[peer].pid, ") died"));
        another_failed();
        if (Clock::now() >= deadline)
          throw TimeoutError(detail::concat(who, " timed out after ", timeout.count(), " ms waiting for rank ",
                                            peer, "'s segment"));
      };
    };
    for (int r = 0; r < ws_; ++r) {
      if (r == rank_) continue;
      try {
        fd_channel_->send(r, 0, own.fd);
      } catch (const TimeoutError&) {
        another_failed();
        throw;
      }
    }
    for (int r = 0; r < ws_; ++r) {
      if (r == rank_) continue;
      FdGuard peer{fd_channel_->receive(r, 0, between_polls(r))};
      base_[r] = map_segment(peer.fd, layout_.total, detail::concat("rank ", r, "'s segment"));
      TIDE_CHECK(header(r)->magic == kMagic && header(r)->rank == r, who, ": the segment received from rank ", r,
                 " is not rank ", r, "'s");
    }
  }

  // A group whose ranks are on several hosts cannot share memory: say so, with the hosts.
  void check_one_host(const std::vector<Rendezvous>& all) {
    if (std::all_of(all.begin(), all.end(), [&](const Rendezvous& r) { return r.host == all[0].host; })) return;
    std::vector<std::string> hosts;
    for (auto& r : all)
      if (std::find(hosts.begin(), hosts.end(), r.host) == hosts.end()) hosts.push_back(r.host);
    std::ostringstream os;
    os << "tide host transport: rank " << rank_ << ": the group's " << ws_ << " ranks are on " << hosts.size()
       << " hosts (";
    for (size_t i = 0; i < hosts.size(); ++i) {
      os << (i ? "; " : "") << "ranks";
      for (int r = 0; r < ws_; ++r)
        if (all[r].host == hosts[i]) os << ' ' << r;
      os << " on '" << hosts[i] << "'";
    }
    os << "), but the host transport needs all of them on one host (host id: hostname/boot id, or TIDE_HOST_ID)";
    throw Error(os.str());
  }

  // Linux CMA lets all_gather read peers' inputs directly (one copy instead of two). It
  // needs ptrace permission over the peer (same user, no restrictive Yama/seccomp), so
  // every rank probes every peer and all use it only if all succeed. Opt-in (TIDE_CMA=1):
  // on the 2-core dev VM the kernel's copy plus page pinning cost as much as the memcpy
  // it saves, so staging stays the default.
  void probe_cma() {
    uint8_t ok = 1;
    if (env::get_int("TIDE_CMA", 0) == 0) {
      ok = 0;
      cma_why_ = "off by default, TIDE_CMA=1 to probe";
    }
    for (int p = 0; p < ws_ && ok; ++p) {
      if (p == rank_) continue;
      uint64_t magic = 0;
      iovec l{&magic, sizeof magic}, r{reinterpret_cast<void*>(header(p)->self_addr), sizeof magic};
      if (::process_vm_readv(header(p)->pid, &l, 1, &r, 1, 0) != static_cast<ssize_t>(sizeof magic) || magic != kMagic) {
        ok = 0;
        cma_why_ = detail::concat("process_vm_readv of rank ", p, " failed: ", std::strerror(errno));
      }
    }
    begin("init", "");
    std::vector<uint8_t> all(ws_);
    exchange(&ok, 1, all.data());
    cma_ = ws_ > 1 && std::all_of(all.begin(), all.end(), [](uint8_t v) { return v == 1; });
    if (ws_ == 1) cma_why_ = "single rank";
    else if (ok && !cma_) cma_why_ = "another rank cannot use it";
    else if (cma_) cma_why_ = "process_vm_readv works for every peer";
  }

  void unmap_all() {
    for (auto& b : base_) {
      if (b) ::munmap(b, layout_.total);
      b = nullptr;
    }
  }

  int rank_, ws_;
  std::atomic<std::chrono::milliseconds> timeout_;  // set_timeout: for the collectives that begin after it
  std::chrono::milliseconds op_timeout_{};           // the running collective's
  std::chrono::microseconds spin_ = kShortSpin;  // host_spin()
  Layout layout_;
  std::unique_ptr<ThreadPool> pool_;
  std::vector<std::byte*> base_;
  std::unique_ptr<FdChannel> fd_channel_;
  uint64_t symmetric_allocations_ = 0;  // FdChannel tags: 0 is the segment at creation
  uint64_t counter_start_;
  uint64_t exchanges_;
  std::vector<int> pids_;  // CommOptions::pids: a rank that dies before it joins fails the wait at once
  bool cma_ = false;
  std::string cma_why_;
  const char* collective_ = "init";
  std::string detail_;
  Clock::time_point deadline_ = Clock::now();
};

}  // namespace

std::chrono::microseconds host_spin(int busy, int cores) {
  if (const int64_t us = env::get_int("TIDE_HOST_SPIN_US", -1); us >= 0) return std::chrono::microseconds(us);
  return busy <= cores ? kLongSpin : kShortSpin;
}

std::unique_ptr<Transport> make_host_transport(Store& store, const std::string& ns, int rank, int world_size,
                                               const CommOptions& options) {
  TIDE_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "tide host transport: invalid rank ", rank,
             " for world size ", world_size);
  return std::make_unique<ShmTransport>(store, ns, rank, world_size, options);
}

}  // namespace tide
