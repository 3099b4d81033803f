// Whether the NVLink kernels can serve a group: every rank on one host, each GPU with peer access
// to the others, a kernel image for this GPU in the build, and not turned off by
// EP_HIGH_THROUGHPUT=aten. Only built with EP_WITH_CUDA.
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace ep {

class EPProcessGroup;

namespace nvlink {

// The reason recorded when the user asked for the ATen path.
constexpr const char* kAskedAten = "EP_HIGH_THROUGHPUT=aten";

// Every rank decides with the same inputs (all ranks' host names, GPUs and peer-access verdicts):
// "" when the NVLink kernels can serve the group, else why not (this rank's words; the verdict
// itself is the same on every rank). Collective.
std::string decideUsable(EPProcessGroup& pg, const at::Device& device);

}  // namespace nvlink
}  // namespace ep
