// Which physical GPU a rank runs on, as the peers can compare it. CUDA builds only.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace ep {

// The device's PCI bus id ("0000:18:00.0"): the same GPU reads the same in every process,
// whatever CUDA_VISIBLE_DEVICES made its index. "?" when CUDA cannot tell (never seen).
inline std::string gpuBusId(int device) {
  char id[32] = {0};
  if (cudaDeviceGetPCIBusId(id, sizeof(id), device) != cudaSuccess) {
    cudaGetLastError();  // not sticky; leave no error for the next CUDA call to find
    return "?";
  }
  return id;
}

}  // namespace ep
