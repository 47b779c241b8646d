// A Store over a directory: one file per key, written to a temporary name and renamed so a
// reader sees all of a value or nothing; `add` serialises through flock on a lock file.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <random>
#include <string>
#include <thread>

#include "tide/error.hpp"
#include "tide/store.hpp"

namespace tide {
namespace {

// Keys may hold '/', so every byte outside [A-Za-z0-9._-] becomes %XX.
std::string encode(const std::string& key) {
  static const char* hex = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '_' || c == '-' || (c == '.' && !out.empty())) {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

bool read_file(const std::string& path, std::vector<uint8_t>& out) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  out.clear();
  uint8_t buf[4096];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.insert(out.end(), buf, buf + n);
  }
  ::close(fd);
  return true;
}

class FileStore final : public Store {
 public:
  explicit FileStore(std::string dir) : dir_(std::move(dir)) {
    if (::mkdir(dir_.c_str(), 0700) != 0 && errno != EEXIST)
      throw Error(detail::concat("tide file store: cannot create ", dir_, ": ", std::strerror(errno)));
  }

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    std::string tmp = detail::concat(dir_, "/.tmp.", ::getpid(), ".", rng_());
    int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) throw Error(detail::concat("tide file store: cannot write ", tmp, ": ", std::strerror(errno)));
    size_t off = 0;
    while (off < value.size()) {
      ssize_t n = ::write(fd, value.data() + off, value.size() - off);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        ::close(fd);
        ::unlink(tmp.c_str());
        throw Error(detail::concat("tide file store: write failed for key '", key, "'"));
      }
      off += static_cast<size_t>(n);
    }
    ::close(fd);
    if (::rename(tmp.c_str(), path(key).c_str()) != 0) {
      ::unlink(tmp.c_str());
      throw Error(detail::concat("tide file store: rename failed for key '", key, "': ", std::strerror(errno)));
    }
  }

  std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    auto nap = std::chrono::microseconds(50);
    std::vector<uint8_t> out;
    for (;;) {
      if (read_file(path(key), out)) return out;
      if (std::chrono::steady_clock::now() >= deadline)
        throw TimeoutError(detail::concat("tide file store: key '", key, "' not set after ",
                                          timeout.count(), " ms"));
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(5000));
    }
  }

  bool check(const std::string& key) override { return ::access(path(key).c_str(), F_OK) == 0; }

  int64_t add(const std::string& key, int64_t delta) override {
    std::string lock = path(key) + ".lock";
    int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) throw Error(detail::concat("tide file store: cannot open ", lock, ": ", std::strerror(errno)));
    while (::flock(fd, LOCK_EX) != 0 && errno == EINTR) {
    }
    int64_t value = delta;
    std::vector<uint8_t> cur;
    try {
      if (read_file(path(key), cur)) value += std::stoll(std::string(cur.begin(), cur.end()));
      std::string s = std::to_string(value);
      set(key, std::vector<uint8_t>(s.begin(), s.end()));
    } catch (...) {
      ::close(fd);  // closing drops the lock
      throw;
    }
    ::close(fd);
    return value;
  }

 private:
  std::string path(const std::string& key) const { return dir_ + "/" + encode(key); }
  std::string dir_;
  std::mt19937_64 rng_{std::random_device{}()};
};

}  // namespace

std::unique_ptr<Store> make_file_store(const std::string& directory) {
  return std::make_unique<FileStore>(directory);
}

}  // namespace tide
