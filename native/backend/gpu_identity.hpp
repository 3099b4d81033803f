// Where a rank runs (host, device index, the GPU's PCI bus id), as the peers can compare it.
// CUDA builds only.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "backend/store_exchange.hpp"

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

struct GpuPlace {
  std::string host;
  int index = -1;   // in the rank's own process (CUDA_VISIBLE_DEVICES may differ per process)
  std::string bus;  // "?" if unknown

  static GpuPlace of(int device) { return {hostName(), device, gpuBusId(device)}; }

  // "host|index|bus": what a rank posts (allGatherStrings); host names hold no '|'.
  std::string str() const { return host + "|" + std::to_string(index) + "|" + bus; }
  static GpuPlace parse(const std::string& s) {
    const auto bus_bar = s.rfind('|');
    const auto bar = s.rfind('|', bus_bar - 1);
    return {s.substr(0, bar), std::stoi(s.substr(bar + 1, bus_bar - bar - 1)),
            s.substr(bus_bar + 1)};
  }

  bool knownBus() const { return bus != "?"; }
  // One GPU: the same host and bus id (the same index where a bus id is unknown).
  bool sameGpu(const GpuPlace& o) const {
    return host == o.host && (knownBus() && o.knownBus() ? bus == o.bus : index == o.index);
  }
};

}  // namespace ep
