#ifdef EP_WITH_CUDA

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "backend/aligned_rows.hpp"
#include "backend/ep_process_group.hpp"
#include "backend/moe_validation.hpp"
#include "backend/stream_capture.hpp"
#include "transports/nvlink/nvlink_capacity.hpp"
#include "transports/nvlink/nvlink_handle_routing.hpp"
#include "transports/nvlink/nvlink_pending_error.hpp"
#include "transports/nvlink/nvlink_slab_pool.hpp"
#include "transports/nvlink/nvlink_transport.hpp"
#include "transports/nvlink/nvlink_tuning.hpp"

namespace ep::nvlink {

std::pair<at::Tensor, std::optional<at::Tensor>> cachedDispatch(
    EPProcessGroup& pg, const at::Tensor& x, const std::optional<at::Tensor>& x_scales,
    const DispatchRouting& routing) {
  const int64_t num_ranks = pg.getSize();
  auto st = stateOf(pg);
  const std::string pending = pendingErrorToAgree(*st, "cached dispatch");
  std::string input_error = validateCachedDispatch(x, x_scales, routing, num_ranks);
  const std::shared_ptr<const KernelRouting> known = st->routings.recall(routing);
  const bool capture = streamCapturing();
  const HandleCounts handle = handleCounts(known.get(), routing, num_ranks, capture,
                                           input_error.empty(), "cached dispatch");
  if (input_error.empty()) input_error = handle.error;
  const bool ok = input_error.empty();
  const std::string& error = pending.empty() ? input_error : pending;
  std::vector<AgreedField> fields = cachedDispatchFields(x, x_scales, ok);
  // Whether the peers write our rows into a receive slab is decided alike on every rank (a
  // notify runs first then, a collective kernel).
  fields.push_back({"Options.recv_slabs (or EP_RECV_SLABS)", recvSlabs(pg)});
  fields.push_back({"CUDA graph capture", capture ? 1 : 0});
  fields.push_back(graphCapturedField(*st));
  // One local expert: the notify that lends slabs announces one (dummy) count per rank.
  std::vector<int64_t> payload{ok ? x.size(0) : 0, ok ? x.size(1) * x.element_size() : 0, 0,
                               ok && x_scales ? x_scales->size(1) : 0, 1};
  payload.insert(payload.end(), handle.counts.begin(), handle.counts.end());
  const int64_t rows = ok ? routing.recv_src_idx.size(0) : 0;
  payload.push_back(rows);
  payload.push_back(handle.known ? 1 : 0);
  const AgreedRows gathered = agreeRowsAcrossRanks(pg, "cached dispatch", error, fields, payload);
  const int64_t known_column = 5 + 2 * num_ranks + 1;
  checkRoutingAgrees("cached dispatch", gathered, 5, pg.getRank(), known_column);

  const at::Device device = x.device();
  c10::cuda::CUDAGuard guard(device);
  NvlinkRuntime& rt =
      ensureRuntime(pg, *st, device, maxNeeds(gathered), "cached dispatch", capture, recvSlabs(pg));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  // Receive slabs as in dispatch (peers write the outputs in place, no copy out of the buffer),
  // which takes a notify to lend them: not while capturing, and not for a num_worst_tokens handle
  // with padding rows (nobody writes those in a slab). Every rank reads the same gathered table.
  bool via_slabs = st->slabs != nullptr && !capture;
  {
    const AgreedRows& g = gathered;
    for (int64_t r = 0; r < num_ranks && via_slabs; ++r) {
      int64_t received = 0;
      for (int64_t s = 0; s < num_ranks; ++s) received += g(r, 5 + num_ranks + s);
      via_slabs = g(r, known_column) == 1 && g(r, 5 + 2 * num_ranks) == received;
    }
  }
  // Behind a slab-lending notify the kernel reads that notify's prefix, not the handle's.
  auto [send_pos, recv_prefix] =
      routingFor(known.get(), routing, c10::cuda::getCurrentCUDAStream(device.index()), !via_slabs);
  std::shared_ptr<SlabLease> lease;
  at::Tensor dest_slabs;
  if (via_slabs) {
    lease = lendSlab(st->slabs, stream);
    // The handle's counts announced again (per expert: unused, one dummy expert per rank); the
    // notify's prefix equals the handle's and is what the kernel reads behind it.
    const at::Tensor per_rank = routing.num_tokens_per_rank.to(at::kInt).contiguous();
    const auto align4 = [](int64_t n) { return (n + 3) / 4 * 4; };
    at::Tensor small =
        at::empty({align4(num_ranks + 1) + align4(2 * num_ranks) + align4(num_ranks) + 4},
                  per_rank.options());
    recv_prefix = small.narrow(0, 0, num_ranks + 1);
    dest_slabs = small.narrow(0, align4(num_ranks + 1), 2 * num_ranks);
    at::Tensor recv_counts =
        small.narrow(0, align4(num_ranks + 1) + align4(2 * num_ranks), num_ranks);
    at::Tensor per_expert_out = small.narrow(0, small.numel() - 4, 1);
    rt.notify(per_rank.data_ptr<int>(), per_rank.data_ptr<int>(), static_cast<int>(num_ranks), 1, 0,
              recv_counts.data_ptr<int>(), recv_prefix.data_ptr<int>(),
              per_expert_out.data_ptr<int>(), /*host_counters=*/false, stream, nullptr,
              /*dispatch_follows=*/true, lease ? lease->index() : -1, dest_slabs.data_ptr<int>());
  }
  const int hidden_bytes = static_cast<int>(x.size(1) * x.element_size());
  const int num_scales = x_scales ? static_cast<int>(x_scales->size(1)) : 0;
  const SlabLayout slab = rt.cached_slab_layout(hidden_bytes, num_scales);
  at::Tensor recv_x = slabOutput(rt, lease, slab.x, {rows, x.size(1)}, x.options());
  std::optional<at::Tensor> recv_scales;
  if (x_scales) {
    recv_scales =
        slabOutput(rt, lease, slab.scales, {rows, x_scales->size(1)}, x_scales->options());
  }
  const at::Tensor x_rows = alignedTo16(x);
  NvlinkDispatchArgs args;
  args.x = x_rows.data_ptr();
  args.num_tokens = static_cast<int>(x.size(0));
  args.hidden_bytes = hidden_bytes;
  args.x_scales = x_scales ? static_cast<const float*>(x_scales->data_ptr()) : nullptr;
  args.num_scales = num_scales;
  args.send_pos = send_pos.data_ptr<int>();
  args.recv_prefix = recv_prefix.data_ptr<int>();
  args.recv_x = recv_x.data_ptr();
  args.recv_x_scales = recv_scales ? static_cast<float*>(recv_scales->data_ptr()) : nullptr;
  // Rows past the valid count (a num_worst_tokens handle) are written as padding.
  args.num_worst_tokens = via_slabs ? 0 : static_cast<int>(rows);
  args.dest_slabs = via_slabs ? dest_slabs.data_ptr<int>() : nullptr;
  args.own_slab = lease != nullptr;
  args.num_sms = static_cast<int>(pg.options()->num_sms);  // per call: settable live
  rt.cached_dispatch(args, stream);
  return {recv_x, recv_scales};
}

}  // namespace ep::nvlink

#endif  // EP_WITH_CUDA
