// Input validation of the MoE collectives, and the agreement step that makes every rank raise
// together: a rank that rejects its input must not leave its peers waiting in an exchange.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

#include "backend/moe_types.hpp"

namespace ep {

// Each returns "" when the call is valid on this rank, else a message for the user.
// `check_values` reads topk_idx on the host (default: only for CPU tensors).
std::string validateDispatch(const DispatchArgs& args, int64_t num_ranks,
                             std::optional<bool> check_values = std::nullopt);
// A handle's counts (routingCounts() order) read to the host in one copy, with `error` set where
// they do not fit its is_token_in_rank or received rows. The handle must have passed validation
// (on CUDA tensors that validation checks no values: this is a stream sync).
std::vector<int64_t> checkedRoutingCounts(const char* op, const DispatchRouting& routing,
                                          std::string& error);
std::string validateCachedDispatch(const at::Tensor& x, const std::optional<at::Tensor>& x_scales,
                                   const DispatchRouting& routing, int64_t num_ranks);
std::string validateCombine(const CombineArgs& args, int64_t num_ranks);
std::string validateLowLatencyDispatch(const LowLatencyDispatchInputs& args, int64_t num_ranks);
std::string validateLowLatencyCombine(const LowLatencyCombineInputs& args, int64_t num_ranks);

// One named integer every rank must agree on (e.g. the hidden size).
struct AgreedField {
  const char* name;
  int64_t value;
};

// Every rank's row of an agreement, rank-major: rows() = R, cols() = the row's width. A plain
// host array rather than a tensor: the agreement runs in every MoE call, and each ATen op on CPU
// tensors (an allocation, a narrow) costs microseconds of host time there.
class AgreedRows {
 public:
  AgreedRows() = default;
  AgreedRows(int64_t rows, int64_t cols)
      : rows_(rows), cols_(cols), data_(static_cast<size_t>(rows * cols), 0) {}
  // A copy of an int64 [R, W] CPU tensor.
  static AgreedRows of(const at::Tensor& rows);
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  int64_t operator()(int64_t r, int64_t c) const {
    return data_[static_cast<size_t>(r * cols_ + c)];
  }
  int64_t* row(int64_t r) { return data_.data() + r * cols_; }
  int64_t* data() { return data_.data(); }
  // Columns [first, first + count) of every row, as a new table.
  AgreedRows columns(int64_t first, int64_t count) const;
  // An int64 [rows, cols] CPU tensor holding a copy.
  at::Tensor toTensor() const;

 private:
  int64_t rows_ = 0;
  int64_t cols_ = 0;
  std::vector<int64_t> data_;
};

// The agreement step, over the group's CPU backend. All-gathers a row of a fixed width (the
// same in every collective of the group, so ranks never post exchanges of different sizes):
// [error flag, id of `op`, this rank's call number in the group, #fields, #payload, 16 field
// slots, 2R + 8 payload slots]; throws on every rank if the ranks are in calls of different
// numbers or kinds (naming both: "rank 1 is in call #12 (combine), this rank (0) in call #12
// (dispatch)"), any rank had an error, or the fields or payload sizes differ. A timed-out
// exchange makes the group's later MoE calls on this rank raise at once (see
// EPProcessGroup::markMoeUnusable) and tells its peers on this host (HostExchange::abandon).
// Returns the payloads as int64 [R, payload.size()] (a payload longer than 2R + 8 entries takes a
// second all-gather). At most 16 fields.
at::Tensor agreeAcrossRanks(EPProcessGroup& pg, const char* op, const std::string& local_error,
                            const std::vector<AgreedField>& fields,
                            const std::vector<int64_t>& payload);
// agreeAcrossRanks with the payloads as a host table (the ops on the hot path).
AgreedRows agreeRowsAcrossRanks(EPProcessGroup& pg, const char* op, const std::string& local_error,
                                const std::vector<AgreedField>& fields,
                                const std::vector<int64_t>& payload);

// agreeAcrossRanks for the low-latency ops, which honour rank masking: with ranks masked or
// auto-masking on (RankMaskSnapshot::live_only), the row goes point-to-point among the live ranks
// only, a masked rank's payload reads as zeros, and the ranks must agree on the mask. A peer that
// misses the call is masked (into `mask` too) when auto-masking is on.
struct RankMaskSnapshot;
AgreedRows agreeAmongLiveRanks(EPProcessGroup& pg, const char* op, const std::string& local_error,
                               const std::vector<AgreedField>& fields,
                               const std::vector<int64_t>& payload, RankMaskSnapshot& mask);

// µs the calling thread's last agreement step spent waiting for its peers' rows once its own
// was posted (the Gloo path: the whole all-gather); EP_PROFILE_HOST lines report it next to
// the "agree" stage, whose rest is this rank's own work.
double lastAgreementWaitUs();

// Test hook (adversarial tests): rows this rank adds to every send count it announces in a
// dispatch's agreement, as a faulty or malicious peer would; 0 (the default) in real use.
void setTestCountInflation(int64_t rows);
int64_t testCountInflation();

// Test hook (tests of a rank that dies mid-call): milliseconds this rank sleeps after a call's
// agreement, before its data exchange on the ATen path, so that a test can kill it there while
// its peers wait in the exchange; 0 (the default) in real use.
void setTestExchangeDelay(int64_t milliseconds);
int64_t testExchangeDelay();

// Marks this rank's side of the group's agreement "gave up", so that peers on this host waiting
// in (or later reaching) an MoE call raise at once naming this rank (ep_backend.abort).
void abandonMoeAgreement(EPProcessGroup& pg);

// How this group's MoE calls agree across ranks: "shared memory" (every rank on one host),
// "gloo", or "undecided" before the group's first MoE call.
std::string moeAgreementTransport(EPProcessGroup& pg);

// The agreement step of a rank whose inputs were rejected before it reached the C++ op (by
// the Python layer): its peers in `op` (or any other MoE collective) raise "rank(s) ...
// rejected their inputs"; this rank raises RuntimeError with `message`.
void rejectCollectively(EPProcessGroup& pg, const char* op, const std::string& message);

// Raises on a rank whose own input was fine: "ep <op>: rank(s) <bad_ranks> rejected their inputs".
[[noreturn]] void raiseRejectedBy(const char* op, const std::vector<int64_t>& bad_ranks);

// Arguments of get_dispatch_layout: topk_idx 2-D int64/int32, E a positive multiple of R.
void checkDispatchLayoutArgs(const at::Tensor& topk_idx, int64_t num_experts, int64_t num_ranks);

// The fields every rank must agree on for each collective (`ok`: this rank's input is valid, so
// its shapes may be read).
std::vector<AgreedField> dispatchFields(const DispatchArgs& args, bool ok);
std::vector<AgreedField> cachedDispatchFields(const at::Tensor& x,
                                              const std::optional<at::Tensor>& x_scales, bool ok);
std::vector<AgreedField> combineFields(const CombineArgs& args, bool ok);
std::vector<AgreedField> lowLatencyDispatchFields(const LowLatencyDispatchInputs& args, bool ok);

// (rows sent to each rank, rows received from each rank) of a handle, 2R values (zeros when the
// handle is malformed: validation reports that).
std::vector<int64_t> routingCounts(const DispatchRouting& routing, int64_t num_ranks);

// ep_backend.reserve's sizes: "" when valid, else a message. The payload of its agreement step
// is {num_tokens, hidden_bytes, topk, num_scales, num_experts / num_ranks} (zeros when invalid),
// the column order maxNeeds reads.
std::string validateReserve(int64_t num_tokens, int64_t hidden_bytes, int64_t topk,
                            int64_t num_scales, int64_t num_experts, int64_t num_ranks);

// Throws on every rank unless what each rank sent (gathered[s, offset + d]) is what its peer
// expects to receive (gathered[d, offset + R + s]): a handle from another dispatch or group.
// With known_column >= 0, a pair is checked only where both ranks have 1 there (a rank whose
// handle's counts are not on the host sends zeros and 0).
void checkRoutingAgrees(const char* op, const AgreedRows& gathered, int64_t offset, int64_t rank,
                        int64_t known_column = -1);
void checkRoutingAgrees(const char* op, const at::Tensor& gathered, int64_t offset, int64_t rank,
                        int64_t known_column = -1);

}  // namespace ep
