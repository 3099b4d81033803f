// Error and diagnostic messages for the runtimes inside libep_nvshmem.so, built from std::string
// and snprintf instead of iostreams. That library is dlopen'ed RTLD_LOCAL beside NVSHMEM's
// host library, and there std::ostringstream's number formatting faults (SIGSEGV inside
// ostream::_M_insert, cause not understood) when built with GCC 13; snprintf touches no C++
// locale facet.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

namespace ep::runtime {

// `value` in hexadecimal with a 0x prefix.
struct Hex {
  uint64_t value;
};

inline void appendTo(std::string& out, const char* text) {
  out += text;
}
inline void appendTo(std::string& out, const std::string& text) {
  out += text;
}
inline void appendTo(std::string& out, char c) {
  out += c;
}
inline void appendTo(std::string& out, Hex h) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(h.value));
  out += buf;
}
// Integers in decimal; floating point as %g (4 not 4.000000, as an ostream prints it).
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
void appendTo(std::string& out, T value) {
  if constexpr (std::is_floating_point_v<T>) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(value));
    out += buf;
  } else {
    out += std::to_string(value);
  }
}

// The concatenation of `parts` (strings, numbers, Hex).
template <typename... Parts>
std::string strCat(const Parts&... parts) {
  std::string out;
  (appendTo(out, parts), ...);
  return out;
}

}  // namespace ep::runtime
