// Host launchers of the nvlink kernels (one kernel family per .cu file). Torch-free.
// The runtime (nvlink_runtime.hpp) is the intended caller: it owns the buffers,
// validates arguments and fills the parameter blocks; these functions only launch.
#pragma once

#include <cuda_runtime_api.h>

#include "transports/nvlink/cuda/nvlink_common.hpp"

namespace ep {

// Threads per block of the dispatch and combine kernels: 16 warps = senders, one publisher,
// receivers.
constexpr int kNvlinkThreads = 512;
constexpr int kNvlinkMaxSendWarps = kNvlinkThreads / 32 - 2;

// nvlink_layout.cu: per-rank/per-expert counts, is_token_in_rank, send_pos. Local only.
// Fills p.epoch. With p.workspace (nvlink_layout_workspace_bytes(T, E) bytes, 0 = not needed)
// one block per 1,024 tokens, else one block.
cudaError_t launch_nvlink_layout(LayoutParams p, cudaStream_t stream);
size_t nvlink_layout_workspace_bytes(int num_tokens, int num_experts);

// nvlink_notify.cu: exchanges counts with every peer (one block).
cudaError_t launch_nvlink_notify(const NotifyParams& p, cudaStream_t stream);

// nvlink_dispatch.cu: pushes rows to peers and copies received rows out; num_sms blocks.
cudaError_t launch_nvlink_dispatch(const DispatchParams& p, int num_sms, cudaStream_t stream);
size_t nvlink_dispatch_stage_bytes(int hidden_bytes, int num_send_warps);

// nvlink_combine.cu: returns rows to their owners and reduces them; num_sms blocks.
cudaError_t launch_nvlink_combine(const CombineParams& p, int num_sms, cudaStream_t stream);

// nvlink_barrier.cu: all ranks' streams meet (a device-side barrier, no host involvement).
cudaError_t launch_nvlink_barrier(const BarrierParams& p, cudaStream_t stream);

// nvlink_all_to_all.cu: an all-to-all of raw bytes through the staging rings.
cudaError_t launch_nvlink_all_to_all(const AllToAllParams& p, cudaStream_t stream);

// Forces the kernels of each file to load now. With lazy module loading (the CUDA default), the
// first launch of a kernel may wait for kernels already running on the device; a spinning
// communication kernel of another rank on the same GPU would then never finish: deadlock.
cudaError_t preload_nvlink_layout();
cudaError_t preload_nvlink_notify();
cudaError_t preload_nvlink_dispatch();
cudaError_t preload_nvlink_combine();
cudaError_t preload_nvlink_barrier();
cudaError_t preload_nvlink_all_to_all();

}  // namespace ep
