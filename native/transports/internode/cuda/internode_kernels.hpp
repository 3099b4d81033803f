// Launchers of the hierarchical internode kernels (internode_kernels.cu). Each returns the launch
// error of its last kernel (cudaSuccess when every launch was accepted). Torch-free.
#pragma once

#include <cuda_runtime_api.h>

#include "transports/internode/cuda/internode_common.hpp"

namespace ep {
namespace internode {

// Notify, the first kernel of a (cached) dispatch: the count exchange (NotifyParams). A rejected
// call (Control::call_ok = 0) makes the dispatch kernels after it move nothing.
cudaError_t launch_notify(const NotifyParams& p, cudaStream_t stream);

// Dispatch (also cached dispatch: topk_idx null): pack, RDMA leg, its signals, NVLink forwarding,
// node barrier. After it, this rank's rows are in nvl_recv[parity] rows [0, recv_rows).
cudaError_t launch_dispatch(const DispatchParams& p, int num_blocks, cudaStream_t stream);

// Combine (its first kernel starts the call): NVLink leg to the forwarders, node barrier, per-node
// reduction and RDMA leg, its signals, the source's sum over nodes (and biases) into out /
// out_weights.
cudaError_t launch_combine(const CombineParams& p, int num_blocks, cudaStream_t stream);

}  // namespace internode
}  // namespace ep
