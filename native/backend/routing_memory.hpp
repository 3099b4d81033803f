// What the NVLink kernels need of a dispatch handle (its send positions, receive prefix and, when
// the host saw them, its counts), remembered for as long as the handle lives, so that its combine
// and cached dispatch neither recompute it (several small kernels) nor read the handle's counts
// back to the host for the cross-rank check (a stream sync). A model's backward pass runs every
// MoE layer's combine and cached dispatch long after later layers dispatched: a fixed handful of
// remembered handles made each of those a stream sync.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>

#include <array>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "backend/moe_types.hpp"

namespace ep::nvlink {

struct KernelRouting {
  using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  explicit KernelRouting(const DispatchRouting& r)
      : is_token_in_rank(r.is_token_in_rank.getIntrusivePtr()),
        num_tokens_per_rank(r.num_tokens_per_rank.getIntrusivePtr()),
        num_recv_tokens_per_rank(r.num_recv_tokens_per_rank.getIntrusivePtr()) {}
  // The handle's tensors, held weakly: the entry must not keep a dead handle's memory, and while
  // it holds them their TensorImpl addresses cannot be reused by other tensors.
  WeakImpl is_token_in_rank;
  WeakImpl num_tokens_per_rank;
  WeakImpl num_recv_tokens_per_rank;
  std::array<uint32_t, 3> versions{};  // their version counters then: in-place edits invalidate
  at::Tensor send_pos;                 // [T, R] int32 (the caller's, when dispatch took a layout)
  uint32_t send_pos_version = 0;       // its version counter then
  at::Tensor recv_prefix;              // [R + 1] int32
  std::vector<int64_t> host_counts;    // routingCounts() order (2R); empty: never on the host
};

// Thread-safe (autograd runs backward ops on its own threads). Entries of freed handles are
// dropped by prune(); beyond kMaxEntries live handles the oldest are forgotten (their later
// combines then recompute the routing and read its counts back).
class RoutingMemory {
 public:
  static constexpr size_t kMaxEntries = 1024;

  // Remembers a dispatch's routing (not when a version counter is missing on a tensor that
  // should have one: inference tensors have none and are remembered by identity alone).
  void remember(const DispatchRouting& r, at::Tensor send_pos, at::Tensor recv_prefix,
                std::vector<int64_t> host_counts);
  // The remembered routing of this handle: made from the very same tensors, unmodified since.
  std::shared_ptr<const KernelRouting> recall(const DispatchRouting& r) const;
  // Drops the entries of freed handles, and the oldest so that one more fits. The dispatch calls
  // it before its count wait: freeing what they hold is host work the wait hides.
  void prune();

 private:
  using Entries = std::list<std::shared_ptr<const KernelRouting>>;  // most recent first
  mutable std::mutex mutex_;
  Entries entries_;
  // Keyed by the num_recv_tokens_per_rank tensor, which every dispatch makes afresh.
  std::unordered_map<const c10::TensorImpl*, Entries::iterator> by_counts_;
};

}  // namespace ep::nvlink
