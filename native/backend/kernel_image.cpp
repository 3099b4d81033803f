#ifdef EP_WITH_CUDA

#include "backend/kernel_image.hpp"

#include <cctype>
#include <map>
#include <mutex>
#include <utility>

// The CUDA architectures of the build (CMake passes EP_CUDA_ARCHS, e.g. "90a,100a").
#ifndef EP_CUDA_ARCHS
#define EP_CUDA_ARCHS "90a"
#endif

namespace ep {
namespace {

std::pair<int, int> computeCapability(int device) {
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  return {major, minor};
}

std::string noImageReason(int device) {
  const auto [major, minor] = computeCapability(device);
  return "ep's kernels were built for the CUDA architectures " EP_CUDA_ARCHS "; this GPU is sm_" +
         std::to_string(major) + std::to_string(minor);
}

bool archListServes(const char* list, int major, int minor) {
  const int cc = major * 10 + minor;
  for (const char* p = list; *p != '\0';) {
    int arch = 0;
    while (std::isdigit(static_cast<unsigned char>(*p))) arch = arch * 10 + (*p++ - '0');
    const char suffix = std::isalpha(static_cast<unsigned char>(*p)) ? *p++ : '\0';
    while (*p != '\0' && *p != ',' && *p != ';') ++p;
    if (*p != '\0') ++p;
    if (arch == 0) continue;
    if (suffix == 'a' && arch == cc) return true;
    if (suffix == 'f' && arch / 10 == major && arch <= cc) return true;
    if (suffix == '\0' && arch <= cc) return true;
  }
  return false;
}

}  // namespace

std::string kernelImageMissing(int device, cudaError_t (*probe)()) {
  static std::mutex mutex;
  static std::map<std::pair<int, cudaError_t (*)()>, std::string> verdicts;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device, probe);
  auto it = verdicts.find(key);
  if (it != verdicts.end()) return it->second;
  std::string why;
  const cudaError_t e = probe();
  if (e == cudaErrorInvalidDeviceFunction || e == cudaErrorNoKernelImageForDevice) {
    cudaGetLastError();  // not sticky
    why = noImageReason(device);
  }
  verdicts.emplace(key, why);
  return why;
}

std::string kernelImageMissingFromArchList(int device) {
  const auto [major, minor] = computeCapability(device);
  return archListServes(EP_CUDA_ARCHS, major, minor) ? "" : noImageReason(device);
}

const char* builtCudaArchitectures() {
  return EP_CUDA_ARCHS;
}

}  // namespace ep

#endif  // EP_WITH_CUDA
