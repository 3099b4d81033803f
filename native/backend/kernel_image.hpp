// Whether this build holds a kernel image for a GPU. A transport whose kernels have none says no
// with this reason, so the call takes the ATen path with its FallbackWarning instead of failing at
// launch. CUDA builds only.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace ep {

// "" when `probe` (cudaFuncGetAttributes on one of the transport's kernels, in this process)
// finds an image for `device`, else why not. Cached per device and probe.
std::string kernelImageMissing(int device, cudaError_t (*probe)());

// The same verdict from the build's architecture list (EP_CUDA_ARCHS) alone, for kernels of a
// library loaded later (libep_nvshmem.so, built for the same list): "90a" (arch-specific) and
// "100f" (family) images run on those GPUs only, a plain "90" also on later ones (its PTX).
std::string kernelImageMissingFromArchList(int device);

// The build's CUDA architectures, as CMake passed them (e.g. "90a,100a").
const char* builtCudaArchitectures();

}  // namespace ep
