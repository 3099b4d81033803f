#include "backend/rank_mask.hpp"

#include <c10/util/Exception.h>

#include <map>
#include <mutex>

#include "backend/ep_process_group.hpp"
#include "backend/group_state.hpp"

namespace ep {
namespace {

struct RankMaskState {
  std::mutex mutex;
  std::vector<uint8_t> masked;
  std::optional<std::chrono::milliseconds> auto_timeout;
  std::map<c10::DeviceIndex, at::Tensor> device;  // CUDA device index -> int32 [R]
};

GroupStates<RankMaskState>& maskStates() {
  static auto* states = new GroupStates<RankMaskState>();
  return *states;
}

std::shared_ptr<RankMaskState> stateOf(EPProcessGroup& pg) {
  auto st = maskStates().of(pg);
  std::lock_guard<std::mutex> lock(st->mutex);
  if (st->masked.empty()) {
    st->masked.assign(static_cast<size_t>(pg.getSize()), 0);
  }
  return st;
}

// The device copies follow the host mask: a one-element fill on the current stream of their
// device, ordered before the next kernel launched there (no host sync).
void setOnDevices(RankMaskState& st, int64_t rank, int value) {
  for (auto& [index, tensor] : st.device) {
    tensor.narrow(0, rank, 1).fill_(value);
  }
}

}  // namespace

bool RankMaskSnapshot::any_masked() const {
  for (uint8_t m : masked) {
    if (m != 0) {
      return true;
    }
  }
  return false;
}

bool RankMaskSnapshot::live_only() const {
  return auto_mask || any_masked();
}

int64_t RankMaskSnapshot::fingerprint() const {
  uint64_t h = 1469598103934665603ULL;  // FNV-1a over the mask bytes and the auto-masking flag
  for (uint8_t m : masked) {
    h ^= m;
    h *= 1099511628211ULL;
  }
  h ^= auto_mask ? 1u : 0u;  // every rank must have it on or off (its agreement has one more round)
  h *= 1099511628211ULL;
  return static_cast<int64_t>(h >> 2);
}

RankMaskSnapshot rankMask(EPProcessGroup& pg) {
  RankMaskSnapshot snap;
  auto found = maskStates().find(pg);
  if (!found) {  // never touched: nothing masked, no auto-masking (the common case, no lock)
    snap.masked.assign(static_cast<size_t>(pg.getSize()), 0);
    return snap;
  }
  std::lock_guard<std::mutex> lock(found->mutex);
  snap.masked = found->masked;
  snap.auto_mask = found->auto_timeout.has_value();
  snap.auto_timeout = found->auto_timeout.value_or(std::chrono::milliseconds(0));
  return snap;
}

void updateRankMask(EPProcessGroup& pg, int64_t rank, bool masked) {
  TORCH_CHECK_VALUE(rank >= 0 && rank < pg.getSize(), "ep low_latency_update_mask: rank ", rank,
                    " is not in the group (size ", pg.getSize(), ")");
  TORCH_CHECK_VALUE(!masked || rank != pg.getRank(), "ep low_latency_update_mask: rank ", rank,
                    " cannot mask itself");
  auto st = stateOf(pg);
  std::lock_guard<std::mutex> lock(st->mutex);
  st->masked[static_cast<size_t>(rank)] = masked ? 1 : 0;
  setOnDevices(*st, rank, masked ? 1 : 0);
}

void cleanRankMask(EPProcessGroup& pg) {
  auto st = stateOf(pg);
  std::lock_guard<std::mutex> lock(st->mutex);
  std::fill(st->masked.begin(), st->masked.end(), 0);
  for (auto& [index, tensor] : st->device) {
    tensor.zero_();
  }
}

void setAutoMask(EPProcessGroup& pg, std::optional<std::chrono::milliseconds> timeout) {
  TORCH_CHECK_VALUE(!timeout || timeout->count() > 0,
                    "ep low_latency auto-mask: the timeout must be positive");
  auto st = stateOf(pg);
  std::lock_guard<std::mutex> lock(st->mutex);
  st->auto_timeout = timeout;
}

at::Tensor rankMaskDevice(EPProcessGroup& pg, const at::Device& device) {
  auto st = stateOf(pg);
  std::lock_guard<std::mutex> lock(st->mutex);
  auto& tensor = st->device[device.index()];
  if (!tensor.defined()) {
    at::Tensor host = at::empty({pg.getSize()}, at::kInt);
    for (int64_t r = 0; r < pg.getSize(); ++r) {
      host[r] = static_cast<int>(st->masked[static_cast<size_t>(r)]);
    }
    tensor = host.to(device);
  }
  return tensor;
}

}  // namespace ep
