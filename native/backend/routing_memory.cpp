#include "backend/routing_memory.hpp"

#include <utility>

namespace ep::nvlink {
namespace {

// Inference tensors carry no version counter (in-place edits of a handle are not tracked then).
uint32_t versionOf(const at::Tensor& t) {
  return t.is_inference() ? 0 : t._version();
}

std::array<uint32_t, 3> versionsOf(const DispatchRouting& r) {
  return {versionOf(r.is_token_in_rank), versionOf(r.num_tokens_per_rank),
          versionOf(r.num_recv_tokens_per_rank)};
}

bool defined(const DispatchRouting& r) {
  return r.is_token_in_rank.defined() && r.num_tokens_per_rank.defined() &&
         r.num_recv_tokens_per_rank.defined();
}

bool alive(const KernelRouting& k) {
  return !k.is_token_in_rank.expired() && !k.num_tokens_per_rank.expired() &&
         !k.num_recv_tokens_per_rank.expired();
}

}  // namespace

void RoutingMemory::remember(const DispatchRouting& r, at::Tensor send_pos, at::Tensor recv_prefix,
                             std::vector<int64_t> host_counts) {
  if (!defined(r) || !send_pos.defined()) {
    return;
  }
  auto k = std::make_shared<KernelRouting>(r);
  k->versions = versionsOf(r);
  k->send_pos_version = versionOf(send_pos);
  k->send_pos = std::move(send_pos);
  k->recv_prefix = std::move(recv_prefix);
  k->host_counts = std::move(host_counts);
  const c10::TensorImpl* key = r.num_recv_tokens_per_rank.unsafeGetTensorImpl();
  std::lock_guard<std::mutex> lock(mutex_);
  if (auto it = by_counts_.find(key); it != by_counts_.end()) {
    entries_.erase(it->second);  // the same tensor again (only if a caller passed it in)
    by_counts_.erase(it);
  }
  entries_.push_front(std::move(k));
  by_counts_[key] = entries_.begin();
}

std::shared_ptr<const KernelRouting> RoutingMemory::recall(const DispatchRouting& r) const {
  if (!defined(r)) {
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = by_counts_.find(r.num_recv_tokens_per_rank.unsafeGetTensorImpl());
  if (it == by_counts_.end()) {
    return nullptr;
  }
  const KernelRouting& k = **it->second;
  // The weak references keep these addresses from being reused, so equal pointers are the very
  // same tensors; the version counters say whether they (or a given layout's send_pos) changed.
  const bool same =
      k.is_token_in_rank._unsafe_get_target() == r.is_token_in_rank.unsafeGetTensorImpl() &&
      k.num_tokens_per_rank._unsafe_get_target() == r.num_tokens_per_rank.unsafeGetTensorImpl() &&
      k.versions == versionsOf(r) && versionOf(k.send_pos) == k.send_pos_version;
  return same ? *it->second : nullptr;
}

void RoutingMemory::prune() {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto forget = [this](Entries::iterator it) {
    by_counts_.erase((*it)->num_recv_tokens_per_rank._unsafe_get_target());
    return entries_.erase(it);
  };
  for (auto it = entries_.begin(); it != entries_.end();) {
    it = alive(**it) ? std::next(it) : forget(it);
  }
  while (entries_.size() >= kMaxEntries) {
    forget(std::prev(entries_.end()));
  }
}

}  // namespace ep::nvlink
