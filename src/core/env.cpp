#include "env.hpp"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "tide/error.hpp"

namespace tide::env {

int64_t get_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  long long x = std::strtoll(v, &end, 0);
  TIDE_CHECK(end && *end == '\0', "tide: ", name, "='", v, "' is not an integer");
  return x;
}

std::string get_string(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

size_t get_bytes(const char* name, size_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  unsigned long long x = std::strtoull(v, &end, 0);
  TIDE_CHECK(end && end != v, "tide: ", name, "='", v, "' is not a byte count");
  std::string suffix(end);
  if (suffix == "K" || suffix == "k" || suffix == "KiB") x <<= 10;
  else if (suffix == "M" || suffix == "m" || suffix == "MiB") x <<= 20;
  else if (suffix == "G" || suffix == "g" || suffix == "GiB") x <<= 30;
  else TIDE_CHECK(suffix.empty(), "tide: ", name, "='", v, "' is not a byte count (use e.g. 16M)");
  return x;
}

bool debug() {
  static const bool on = get_int("TIDE_DEBUG", 0) != 0;
  return on;
}

void log(const std::string& line) {
  if (debug()) std::fprintf(stderr, "[tide] %s\n", line.c_str());
}

}  // namespace tide::env
