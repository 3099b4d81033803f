// Host helpers shared by the torch-free runtimes (nvlink_runtime, nvshmem_runtime): CUDA error
// and argument checks that throw with the component's name, and a scoped device switch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace ep::runtime {

// Throws std::runtime_error "<component>: <what> failed: <CUDA error>".
inline void cuda_check(cudaError_t e, const char* component, const char* what) {
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string(component) + ": " + what +
                             " failed: " + cudaGetErrorString(e));
  }
}

// Throws std::invalid_argument "<component>: <message>".
inline void require(bool ok, const char* component, const std::string& message) {
  if (!ok) throw std::invalid_argument(std::string(component) + ": " + message);
}

// The checks above bound to one runtime's name, so its messages say which runtime failed.
// The launch paths run a few dozen checks per call: with a literal message (and an op name for a
// prefix) no std::string is built unless the check fails.
class Checks {
 public:
  explicit constexpr Checks(const char* component) : component_(component) {}
  void cuda(cudaError_t e, const char* what) const { cuda_check(e, component_, what); }
  void require(bool ok, const char* message) const {
    if (!ok) runtime::require(false, component_, message);
  }
  void require(bool ok, const std::string& message) const {
    runtime::require(ok, component_, message);
  }
  // Throws "<component>: <op>: <message>".
  void require(bool ok, const char* op, const char* message) const {
    if (!ok) runtime::require(false, component_, std::string(op) + ": " + message);
  }

 private:
  const char* component_;
};

// Allocates `bytes` of zeroed host memory mapped into the device's address space (portable: any
// context may use it): *host is the host's pointer, *dev the kernels' view of the same bytes, so
// that kernels post error records and progress marks the host reads without a copy. Free *host
// with cudaFreeHost. Throws through `checks`, naming `what`.
template <typename T>
void allocMappedHost(const Checks& checks, const char* what, size_t bytes, T** host, T** dev) {
  const std::string name = std::string("(") + what + ")";
  checks.cuda(cudaHostAlloc(reinterpret_cast<void**>(host), bytes,
                            cudaHostAllocMapped | cudaHostAllocPortable),
              ("cudaHostAlloc" + name).c_str());
  std::memset(static_cast<void*>(*host), 0, bytes);
  checks.cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(dev), *host, 0),
              ("cudaHostGetDevicePointer" + name).c_str());
}

inline bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Makes `device` current for a scope and restores the caller's device after it.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) cuda_check(cudaSetDevice(device), "ep", "cudaSetDevice");
  }
  ~DeviceGuard() {
    int current = -1;
    cudaGetDevice(&current);
    if (current != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace ep::runtime
