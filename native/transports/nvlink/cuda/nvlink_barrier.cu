// Device-side barrier across the ranks of a runtime: each rank announces the sequence number to
// every peer ("entered" flags, the same ones dispatch/combine use) and waits until every peer has
// announced it too. Used to line up the ranks' streams (e.g. before timing) without the host.
#include "transports/nvlink/cuda/nvlink_device.cuh"
#include "transports/nvlink/cuda/nvlink_kernels.hpp"

namespace ep {
namespace {

__global__ void __launch_bounds__(32, 1) nvlink_barrier_kernel(BarrierParams p) {
  const CommContext& c = p.comm;
  const int me = c.rank, R = c.num_ranks, lane = threadIdx.x;
  ControlBlock* ctrl = reinterpret_cast<ControlBlock*>(c.buffers.ptr[me]);
  const uint64_t seq = __shfl_sync(0xffffffffu, lane == 0 ? device::read_sequence(ctrl) : 0, 0);
  const device::WaitContext ctx{ctrl, c.error, c.timeout_cycles, kOpBarrier, me};
  if (lane < R && lane != me) {
    device::st_release_sys(
        reinterpret_cast<uint64_t*>(c.buffers.ptr[lane] + c.layout.entered_offset) + me, seq);
    const uint64_t* entered =
        reinterpret_cast<const uint64_t*>(c.buffers.ptr[me] + c.layout.entered_offset) + lane;
    if (!device::aborted(ctx))
      device::spin_wait(ctx, lane, [&] { return device::ld_acquire_sys(entered) >= seq; });
  }
  __syncwarp();
  if (lane == 0) device::finish_block(ctrl, seq);
}

}  // namespace

cudaError_t preload_nvlink_barrier() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, nvlink_barrier_kernel);
}

cudaError_t launch_nvlink_barrier(const BarrierParams& p, cudaStream_t stream) {
  nvlink_barrier_kernel<<<1, 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace ep
