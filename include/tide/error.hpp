// Errors raised by the core. Messages name the collective, the rank and the sizes, so a
// user reading one line knows what went wrong where. The torch adapter surfaces them as
// RuntimeError.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace tide {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A peer died or did not arrive within the timeout; the communicator is unusable after it.
struct TimeoutError : Error {
  using Error::Error;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail
}  // namespace tide

#define TIDE_CHECK(cond, ...)                                              \
  do {                                                                     \
    if (!(cond)) throw ::tide::Error(::tide::detail::concat(__VA_ARGS__)); \
  } while (0)
