// Shared by the C entry points of libep_nvshmem.so (nvshmem_capi.cpp, internode_capi.cpp), which
// ep_backend._C calls through dlsym: no C++ exception may cross that boundary, so each entry point
// runs its body through cEntryPoint, which turns an exception into -1 and a message.
#pragma once

#include <cstddef>
#include <cstdio>
#include <exception>
#include <string>

namespace ep::capi {

// Copies `message` into `out` (NUL-terminated, at most `out_len` bytes; nothing when out is null).
inline void copyMessage(const char* message, char* out, size_t out_len) {
  if (out != nullptr && out_len > 0) std::snprintf(out, out_len, "%s", message);
}

// Runs `body`: 0 when it returns, -1 with the exception's message in `err` when it throws.
template <typename Body>
int cEntryPoint(char* err, size_t err_len, Body&& body) noexcept {
  try {
    body();
    return 0;
  } catch (const std::exception& e) {
    copyMessage(e.what(), err, err_len);
  } catch (...) {
    copyMessage("unknown C++ exception", err, err_len);
  }
  return -1;
}

// The body of a runtime's check_error entry point: 1 with the runtime's error message in `msg`
// and *failed set when the runtime is unusable (0 when there is no error); building the message
// cannot throw across (a failure there is reported as an error too).
template <typename Runtime>
int checkErrorEntry(Runtime* runtime, char* msg, size_t msg_len, int* failed) noexcept {
  std::string e;
  const int rc = cEntryPoint(msg, msg_len, [&] {
    e = runtime->check_error();
    *failed = runtime->failed() ? 1 : 0;
  });
  if (rc != 0) {
    *failed = 1;
    return 1;
  }
  copyMessage(e.c_str(), msg, msg_len);
  return e.empty() ? 0 : 1;
}

// The body of a runtime's destroy entry point: frees its buffers, then the object.
template <typename Runtime>
int destroyEntry(Runtime* runtime, char* err, size_t err_len) noexcept {
  return cEntryPoint(err, err_len, [&] {
    runtime->destroy();
    delete runtime;
  });
}

}  // namespace ep::capi
