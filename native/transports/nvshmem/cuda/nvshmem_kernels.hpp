// Host launchers of the low-latency kernels (nvshmem_dispatch.cu, nvshmem_combine.cu). Torch-free
// and NVSHMEM-free as a header: only the .cu files include NVSHMEM's device API. The runtime
// (cuda/nvshmem_runtime.hpp) is the intended caller: it owns the symmetric region,
// validates arguments and fills the parameter blocks; these functions only launch.
//
// Every kernel runs kThreads threads per block, `num_blocks` blocks, as a cooperative launch (all
// blocks co-resident: receiving blocks spin while sending blocks of the same grid make progress).
#pragma once

#include <cuda_runtime_api.h>

#include "transports/nvshmem/cuda/nvshmem_common.hpp"

namespace ep {
namespace nvshmem {

// Dispatch: SEND (count signals, one message per (token, destination rank): FP8 quantisation or
// BF16, stores or puts) and/or RECV (wait for every source rank's counts, copy each message's row
// into its slots per expert in source-rank order, handle, stats).
cudaError_t launch_dispatch(const DispatchParams& p, int num_blocks, cudaStream_t stream);

// Combine: SEND (weights to every rank; one partial per (token, expert rank): the weighted float32
// sum of the token's entries there, in k order) and/or RECV (sum of the partials, one bf16
// rounding).
cudaError_t launch_combine(const CombineParams& p, int num_blocks, cudaStream_t stream);

// Largest grid a cooperative launch of each kernel accepts on the current device.
cudaError_t max_dispatch_blocks(int* blocks);

cudaError_t max_combine_blocks(int* blocks);

}  // namespace nvshmem
}  // namespace ep
