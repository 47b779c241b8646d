// TIDE_* environment variables and the debug log (internal to tide_core).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace tide::env {

// The variable as an integer, `fallback` when unset or empty; a malformed value throws
// tide::Error naming the variable.
int64_t get_int(const char* name, int64_t fallback);
// The variable's text, `fallback` when unset or empty.
std::string get_string(const char* name, const std::string& fallback);
// Byte sizes accept a K/M/G suffix (powers of two): TIDE_SHM_STAGING_BYTES=32M.
size_t get_bytes(const char* name, size_t fallback);
// TIDE_DEBUG=1.
bool debug();
// One line to stderr, prefixed "[tide]", when TIDE_DEBUG is set.
void log(const std::string& line);

}  // namespace tide::env
