#include "backend/moe_validation.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "backend/dispatch_layout.hpp"
#include "backend/ep_process_group.hpp"
#include "backend/group_state.hpp"
#include "backend/host_exchange.hpp"
#include "backend/peer_liveness.hpp"
#include "backend/rank_mask.hpp"
#include "backend/row_gather.hpp"
#include "backend/store_exchange.hpp"

namespace ep {
namespace {

constexpr int64_t kMaxTopk = 32;

// Collects the first failed check as a message.
class Checker {
 public:
  explicit Checker(const char* op) : op_(op) {}

  template <typename... Args>
  Checker& require(bool ok, const Args&... parts) {
    if (!ok && message_.empty()) {
      std::ostringstream os;
      os << "ep " << op_ << ": ";
      (os << ... << parts);
      message_ = os.str();
    }
    return *this;
  }
  bool failed() const { return !message_.empty(); }
  std::string message() const { return message_; }

 private:
  const char* op_;
  std::string message_;
};

// A tensor's shape as a part of a check's message. Formatted only when printed: Checker::require
// (and TORCH_CHECK) print their parts only when the check fails, and the checks below run on every
// call, where a std::string built up front cost one ostringstream per check.
struct ShapeOf {
  const at::Tensor& tensor;
};

std::ostream& operator<<(std::ostream& os, const ShapeOf& shape) {
  return os << shape.tensor.sizes();
}

ShapeOf shapeOf(const at::Tensor& t) {
  return ShapeOf{t};
}

bool isPayloadDtype(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kFloat8_e4m3fn || t == at::kFloat || t == at::kDouble ||
         t == at::kHalf;
}

bool isReducibleDtype(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kFloat || t == at::kDouble || t == at::kHalf;
}

// Checks topk_idx [T, K] (and its values when `check_values`: a host read on GPU tensors).
void checkTopk(Checker& c, const at::Tensor& topk_idx, int64_t num_tokens, const at::Device& device,
               int64_t num_experts, bool check_values) {
  c.require(topk_idx.defined(), "topk_idx is required");
  if (c.failed()) {
    return;
  }
  c.require(topk_idx.scalar_type() == at::kLong || topk_idx.scalar_type() == at::kInt,
            "topk_idx must be int64 or int32, got ", topk_idx.scalar_type())
      .require(topk_idx.dim() == 2, "topk_idx must be 2-D [T, K], got shape ", shapeOf(topk_idx))
      .require(topk_idx.device() == device, "topk_idx is on ", topk_idx.device(), ", x on ", device)
      .require(topk_idx.is_contiguous(), "topk_idx must be contiguous");
  if (c.failed()) {
    return;
  }
  c.require(topk_idx.size(0) == num_tokens, "topk_idx has ", topk_idx.size(0), " rows but x has ",
            num_tokens, " tokens")
      .require(topk_idx.size(1) >= 1 && topk_idx.size(1) <= kMaxTopk, "top-k must be in [1, ",
               kMaxTopk, "], got ", topk_idx.size(1));
  if (c.failed() || !check_values || topk_idx.numel() == 0) {
    return;
  }
  // One device-to-host read for both bounds (on CUDA each read is a stream sync).
  at::Tensor bounds = at::stack({topk_idx.min(), topk_idx.max()}).to(at::kCPU, at::kLong);
  const int64_t lo = bounds[0].item<int64_t>();
  const int64_t hi = bounds[1].item<int64_t>();
  c.require(lo >= -1 && hi < num_experts,
            "topk_idx values must be in [-1, num_experts=", num_experts, "), got min ", lo, " max ",
            hi);
}

void checkWeights(Checker& c, const std::optional<at::Tensor>& w, const at::Tensor& topk_idx,
                  const at::Device& device) {
  if (!w.has_value()) {
    return;
  }
  c.require(w->scalar_type() == at::kFloat, "topk_weights must be float32, got ", w->scalar_type())
      .require(w->sizes() == topk_idx.sizes(), "topk_weights must have the shape of topk_idx ",
               shapeOf(topk_idx), ", got ", shapeOf(*w))
      .require(w->device() == device, "topk_weights is on ", w->device(), ", x on ", device)
      .require(w->is_contiguous(), "topk_weights must be contiguous");
}

void checkX(Checker& c, const at::Tensor& x, const char* name) {
  c.require(x.defined(), name, " is required");
  if (c.failed()) {
    return;
  }
  c.require(x.dim() == 2, name, " must be 2-D [rows, H], got shape ", shapeOf(x))
      .require(x.is_contiguous(), name, " must be contiguous")
      .require(x.device().is_cpu() || x.device().is_cuda(), name, " must be on CPU or CUDA, got ",
               x.device());
}

void checkScales(Checker& c, const at::Tensor& x, const std::optional<at::Tensor>& scales) {
  const bool fp8 = x.scalar_type() == at::kFloat8_e4m3fn;
  c.require(!fp8 || scales.has_value(), "FP8 x needs x_scales [T, H/128]")
      .require(fp8 || !scales.has_value(), "x_scales are only accepted with FP8 x");
  if (c.failed() || !scales.has_value()) {
    return;
  }
  c.require(scales->scalar_type() == at::kFloat || scales->scalar_type() == at::kInt,
            "x_scales must be float32 or int32 (packed UE8M0), got ", scales->scalar_type())
      .require(scales->dim() == 2, "x_scales must be 2-D [T, S], got shape ", shapeOf(*scales))
      .require(scales->device() == x.device(), "x_scales is on ", scales->device(), ", x on ",
               x.device());
  if (c.failed()) {
    return;
  }
  c.require(scales->size(0) == x.size(0), "x_scales has ", scales->size(0), " rows but x has ",
            x.size(0))
      .require(scales->size(1) >= 1, "x_scales needs at least one column");
}

// Checks a layout passed to dispatch (LayoutTensors order) against the call's shapes; with
// `check_values` (CPU) also that it is the layout of topk_idx.
void checkLayout(Checker& c, const std::vector<at::Tensor>& layout, const DispatchArgs& a,
                 int64_t num_ranks, bool check_values) {
  if (layout.empty()) {
    return;
  }
  c.require(layout.size() == 4,
            "layout must be get_dispatch_layout's (num_tokens_per_rank, num_tokens_per_expert, "
            "is_token_in_rank, send_pos), got ",
            layout.size(), " tensors");
  if (c.failed()) {
    return;
  }
  const int64_t T = a.x.size(0);
  const char* names[4] = {"num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank",
                          "send_pos"};
  // The expected shapes, without a heap allocation per call: [R], [E], [T, R], [T, R].
  const int64_t dims[4][2] = {{num_ranks, 0}, {a.num_experts, 0}, {T, num_ranks}, {T, num_ranks}};
  const size_t ranks[4] = {1, 1, 2, 2};
  for (int i = 0; i < 4; ++i) {
    const at::Tensor& t = layout[i];
    const at::IntArrayRef shape(dims[i], ranks[i]);
    const at::ScalarType want = i == 2 ? at::kBool : at::kInt;
    c.require(t.defined(), "layout.", names[i], " is missing");
    if (c.failed()) {
      return;
    }
    c.require(t.scalar_type() == want, "layout.", names[i], " must be ", want, ", got ",
              t.scalar_type())
        .require(t.sizes() == shape, "layout.", names[i], " must have shape ", shape,
                 " for this call, got ", shapeOf(t),
                 " (was it computed for another topk_idx, num_experts or group?)")
        .require(t.device() == a.x.device(), "layout.", names[i], " is on ", t.device(), ", x on ",
                 a.x.device())
        .require(t.is_contiguous(), "layout.", names[i], " must be contiguous");
  }
  if (c.failed() || !check_values) {
    return;
  }
  const LayoutTensors own = computeDispatchLayout(a.topk_idx, a.num_experts, num_ranks);
  c.require(at::equal(layout[0], std::get<0>(own)) && at::equal(layout[1], std::get<1>(own)) &&
                at::equal(layout[2], std::get<2>(own)) && at::equal(layout[3], std::get<3>(own)),
            "layout is not the layout of this topk_idx (compute it with "
            "get_dispatch_layout(topk_idx, num_experts))");
}

}  // namespace

std::string validateDispatch(const DispatchArgs& a, int64_t num_ranks,
                             std::optional<bool> check_values) {
  Checker c("dispatch");
  checkX(c, a.x, "x");
  if (c.failed()) {
    return c.message();
  }
  c.require(isPayloadDtype(a.x.scalar_type()),
            "x must be bfloat16, float8_e4m3fn, float16, float32 or float64, got ",
            a.x.scalar_type())
      .require((a.x.size(1) * a.x.element_size()) % 16 == 0,
               "a row of x must be a multiple of 16 bytes (H * element size), got H=", a.x.size(1),
               " of ", a.x.element_size(), "-byte elements")
      .require(a.x.size(1) > 0, "hidden size must be positive")
      .require(a.num_experts > 0, "num_experts must be positive, got ", a.num_experts)
      .require(a.num_experts % num_ranks == 0, "num_experts=", a.num_experts,
               " is not a multiple of the group size ", num_ranks)
      .require(a.expert_alignment >= 1, "expert_alignment must be >= 1, got ", a.expert_alignment)
      .require(a.num_worst_tokens >= 0, "num_worst_tokens must be >= 0, got ", a.num_worst_tokens);
  checkScales(c, a.x, a.x_scales);
  // Values of topk_idx are checked here on CPU; the CUDA kernels check them on the device.
  checkTopk(c, a.topk_idx, a.x.size(0), a.x.device(), a.num_experts,
            check_values.value_or(a.x.device().is_cpu()));
  if (!c.failed()) {
    checkWeights(c, a.topk_weights, a.topk_idx, a.x.device());
  }
  if (!c.failed()) {
    checkLayout(c, a.layout, a, num_ranks, check_values.value_or(a.x.device().is_cpu()));
  }
  return c.message();
}

namespace {

// A well-formed handle's counts (routingCounts() order) in one copy to the host, checked into
// `c` against its send map and received rows: free on CPU; on CUDA a stream sync, made only for a
// handle the process's dispatch did not make (checkedRoutingCounts). A handle whose send map and
// counts disagree would post mismatched exchanges.
std::vector<int64_t> readRoutingCounts(Checker& c, const DispatchRouting& r) {
  const int64_t R = r.num_tokens_per_rank.numel();
  const at::Tensor host =
      at::cat({r.is_token_in_rank.sum(0).to(at::kLong), r.num_tokens_per_rank.to(at::kLong),
               r.num_recv_tokens_per_rank.to(at::kLong)})
          .to(at::kCPU);
  const int64_t* v = host.data_ptr<int64_t>();
  int64_t received = 0;
  bool negative = false;
  for (int64_t i = 0; i < R; ++i) {
    received += v[2 * R + i];
    negative = negative || v[2 * R + i] < 0;
  }
  c.require(std::equal(v, v + R, v + R),
            "the handle's num_tokens_per_rank does not match its is_token_in_rank")
      .require(!negative && received <= r.recv_src_idx.size(0),
               "the handle's num_recv_tokens_per_rank does not fit its ", r.recv_src_idx.size(0),
               " received rows");
  return std::vector<int64_t>(v + R, v + 3 * R);
}

// Checks a handle's routing tensors into `c` (so messages carry the calling op's name); they
// must be on `device`, the call's (the kernels read them there).
void checkRouting(Checker& c, const DispatchRouting& r, int64_t num_ranks, int64_t num_tokens,
                  const at::Device& device) {
  c.require(r.is_token_in_rank.defined() && r.is_token_in_rank.dim() == 2 &&
                r.is_token_in_rank.scalar_type() == at::kBool,
            "is_token_in_rank must be bool [T, R]")
      .require(r.num_tokens_per_rank.defined() && r.num_recv_tokens_per_rank.defined() &&
                   r.recv_src_idx.defined() && r.recv_src_rank.defined(),
               "the handle is incomplete");
  if (c.failed()) {
    return;
  }
  for (const at::Tensor* t : {&r.is_token_in_rank, &r.num_tokens_per_rank,
                              &r.num_recv_tokens_per_rank, &r.recv_src_idx, &r.recv_src_rank}) {
    c.require(t->device() == device, "the handle's tensors are on ", t->device(), ", x on ",
              device);
    if (c.failed()) {
      return;
    }
  }
  c.require(r.is_token_in_rank.size(1) == num_ranks, "the handle was made on a group of ",
            r.is_token_in_rank.size(1), " ranks, this group has ", num_ranks)
      .require(r.is_token_in_rank.size(0) == num_tokens, "the handle was made for ",
               r.is_token_in_rank.size(0), " tokens, this call has ", num_tokens)
      .require(r.num_tokens_per_rank.numel() == num_ranks &&
                   r.num_recv_tokens_per_rank.numel() == num_ranks,
               "the handle's per-rank counts do not have R entries")
      .require(r.recv_src_idx.dim() == 1 && r.recv_src_rank.sizes() == r.recv_src_idx.sizes(),
               "the handle's recv_src_idx/recv_src_rank do not match");
  if (c.failed() || !r.is_token_in_rank.device().is_cpu()) {
    return;
  }
  readRoutingCounts(c, r);
}

}  // namespace

std::vector<int64_t> checkedRoutingCounts(const char* op, const DispatchRouting& r,
                                          std::string& error) {
  Checker c(op);
  std::vector<int64_t> counts = readRoutingCounts(c, r);
  error = c.message();
  return counts;
}

std::string validateCachedDispatch(const at::Tensor& x, const std::optional<at::Tensor>& x_scales,
                                   const DispatchRouting& routing, int64_t num_ranks) {
  Checker c("cached dispatch");
  checkX(c, x, "x");
  if (c.failed()) {
    return c.message();
  }
  c.require(isPayloadDtype(x.scalar_type()), "unsupported dtype ", x.scalar_type())
      .require((x.size(1) * x.element_size()) % 16 == 0,
               "a row of x must be a multiple of 16 bytes, got H=", x.size(1));
  checkScales(c, x, x_scales);
  if (c.failed()) {
    return c.message();
  }
  checkRouting(c, routing, num_ranks, x.size(0), x.device());
  return c.message();
}

std::string validateCombine(const CombineArgs& a, int64_t num_ranks) {
  Checker c("combine");
  checkX(c, a.x, "x");
  if (c.failed()) {
    return c.message();
  }
  c.require(isReducibleDtype(a.x.scalar_type()),
            "x must be bfloat16, float16, float32 or float64 (combine sums rows), got ",
            a.x.scalar_type());
  const auto& r = a.routing;
  checkRouting(c, r, num_ranks, r.is_token_in_rank.defined() ? r.is_token_in_rank.size(0) : 0,
               a.x.device());
  if (c.failed()) {
    return c.message();
  }
  c.require(a.x.size(0) == r.recv_src_idx.size(0), "x has ", a.x.size(0),
            " rows but the dispatch that made the handle returned ", r.recv_src_idx.size(0));
  if (a.topk_weights.has_value()) {
    const auto& w = *a.topk_weights;
    c.require(w.scalar_type() == at::kFloat, "topk_weights must be float32")
        .require(w.dim() == 2 && w.size(0) == a.x.size(0), "topk_weights must be [N, K]")
        .require(w.device() == a.x.device(), "topk_weights must be on the device of x")
        .require(w.is_contiguous(), "topk_weights must be contiguous");
  }
  for (const auto* b : {&a.bias0, &a.bias1}) {
    if (!b->has_value()) {
      continue;
    }
    c.require((*b)->sizes() == at::IntArrayRef({r.is_token_in_rank.size(0), a.x.size(1)}),
              "bias must be [T, H] = [", r.is_token_in_rank.size(0), ", ", a.x.size(1), "], got ",
              shapeOf(**b))
        .require(isReducibleDtype((*b)->scalar_type()),
                 "bias must be bfloat16, float16, float32 or float64, got ", (*b)->scalar_type())
        .require((*b)->device() == a.x.device(), "bias must be on the device of x");
  }
  return c.message();
}

std::string validateLowLatencyDispatch(const LowLatencyDispatchInputs& a, int64_t num_ranks) {
  Checker c("low_latency_dispatch");
  checkX(c, a.x, "x");
  if (c.failed()) {
    return c.message();
  }
  const int64_t hidden = a.x.size(1);
  c.require(a.x.scalar_type() == at::kBFloat16, "x must be bfloat16, got ", a.x.scalar_type())
      .require(a.num_max_dispatch_tokens_per_rank > 0,
               "num_max_dispatch_tokens_per_rank must be positive")
      .require(
          a.x.size(0) <= a.num_max_dispatch_tokens_per_rank, "T=", a.x.size(0),
          " tokens exceed num_max_dispatch_tokens_per_rank=", a.num_max_dispatch_tokens_per_rank)
      .require(hidden > 0 && hidden % 128 == 0, "H must be a positive multiple of 128, got ",
               hidden)
      .require(a.num_experts > 0 && a.num_experts % num_ranks == 0, "num_experts=", a.num_experts,
               " must be a positive multiple of the group size ", num_ranks)
      .require(!a.use_ue8m0 || a.use_fp8, "use_ue8m0 requires use_fp8")
      .require(!a.use_ue8m0 || a.round_scale, "use_ue8m0 requires round_scale")
      .require(!a.use_ue8m0 || hidden % 512 == 0, "use_ue8m0 needs H % 512 == 0, got ", hidden);
  checkTopk(c, a.topk_idx, a.x.size(0), a.x.device(), a.num_experts, a.x.device().is_cpu());
  return c.message();
}

std::string validateLowLatencyCombine(const LowLatencyCombineInputs& a, int64_t num_ranks) {
  Checker c("low_latency_combine");
  c.require(a.x.defined() && a.x.dim() == 3, "x must be [E_loc, R*M, H]");
  if (c.failed()) {
    return c.message();
  }
  const int64_t slots = num_ranks * a.num_max_dispatch_tokens_per_rank;
  c.require(a.x.scalar_type() == at::kBFloat16, "x must be bfloat16, got ", a.x.scalar_type())
      .require(a.x.is_contiguous(), "x must be contiguous")
      .require(a.src_info.defined() && a.src_info.dim() == 2 && a.layout_range.defined() &&
                   a.layout_range.dim() == 2,
               "the handle is incomplete")
      .require(a.x.size(1) == slots, "x has ", a.x.size(1),
               " slots per expert, the handle expects R*M=", slots);
  if (c.failed()) {
    return c.message();
  }
  c.require(a.src_info.sizes() == at::IntArrayRef({a.x.size(0), slots}) &&
                a.layout_range.sizes() == at::IntArrayRef({a.x.size(0), num_ranks}),
            "the handle does not match x of shape ", shapeOf(a.x))
      .require(a.topk_idx.defined() && a.topk_idx.dim() == 2, "topk_idx must be [T, K]")
      .require(a.topk_weights.defined() && a.topk_weights.sizes() == a.topk_idx.sizes() &&
                   a.topk_weights.scalar_type() == at::kFloat,
               "topk_weights must be float32 with the shape of topk_idx")
      .require(a.topk_idx.device() == a.x.device() && a.topk_weights.device() == a.x.device(),
               "topk_idx and topk_weights must be on the device of x");
  if (c.failed()) {
    return c.message();
  }
  // The ids must be those given to the dispatch: at least their range is checked (on CPU).
  checkTopk(c, a.topk_idx, a.topk_idx.size(0), a.x.device(), a.x.size(0) * num_ranks,
            a.x.device().is_cpu());
  return c.message();
}

namespace {

// Fields of the fixed-width header row: error flag, op kind, call number, field count, payload
// size, fields.
constexpr int64_t kHeaderFixed = 5;
constexpr int64_t kMaxAgreedFields = 16;
constexpr int64_t kHeaderWidth = kHeaderFixed + kMaxAgreedFields;
// Payload slots in the header row beyond 2R (per-rank counts both ways plus a few scalars).
constexpr int64_t kInlineExtra = 8;

// A stable id of the collective's name (FNV-1a), so that ranks in different collectives notice.
int64_t opId(const char* op) {
  uint64_t h = 1469598103934665603ULL;
  for (const char* p = op; *p != '\0'; ++p) {
    h ^= static_cast<unsigned char>(*p);
    h *= 1099511628211ULL;
  }
  return static_cast<int64_t>(h >> 2);
}

// The name of an op id seen in a peer's row, for the message naming both calls.
std::string opName(int64_t id) {
  static const char* const kOps[] = {
      "dispatch", "cached dispatch", "combine", "low_latency_dispatch", "low_latency_combine",
      "reserve"};
  for (const char* op : kOps) {
    if (opId(op) == id) {
      return op;
    }
  }
  return "an unknown collective";
}

// After a timed-out agreement: every rank that was there marks call `call` in the store, waits a
// moment for the others that timed out too, and names the ranks that never marked it.
std::string stalledRanks(EPProcessGroup& pg, uint64_t call) {
  try {
    const std::string prefix =
        "ep_stall/" + pg.options()->group_name + "/" + std::to_string(call) + "/";
    pg.store()->set(prefix + std::to_string(pg.getRank()), std::vector<uint8_t>{1});
    std::this_thread::sleep_for(std::chrono::seconds(2));
    std::string missing;
    for (int r = 0; r < pg.getSize(); ++r) {
      if (!pg.store()->check({prefix + std::to_string(r)})) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
    }
    return missing.empty() ? "every rank arrived, but the exchange failed"
                           : "rank(s) " + missing + " never joined it";
  } catch (const std::exception&) {
    return "the stalled rank could not be determined";
  }
}

// Per group: the shared-memory exchange when every rank is on one host (decided collectively at
// the group's first MoE call), else null and the agreement goes through Gloo; a transport's own
// gather (useRowGather) once it installed one.
struct ExchangeState {
  bool decided = false;
  std::unique_ptr<HostExchange> exchange;
  std::shared_ptr<RowGather> transport_gather;
};

GroupStates<ExchangeState>& exchangeStates() {
  static auto* states = new GroupStates<ExchangeState>();
  return *states;
}

// A failed exchange of call `call` leaves the ranks' calls out of step: this rank's later MoE
// calls raise at once, and its peers learn it at their next call (on this host through the
// shared-memory exchange, elsewhere through the store when their Gloo exchange fails).
[[noreturn]] void giveUp(EPProcessGroup& pg, ExchangeState* state, const char* op, uint64_t call,
                         const std::string& message) {
  pg.markMoeUnusable("call #" + std::to_string(call) + " (" + op + ") failed: " + message);
  if (state != nullptr && state->exchange) {
    state->exchange->abandon();
  }
  postGaveUp(pg);  // rows too wide for the shared-memory exchange go through Gloo there too
  TORCH_CHECK(false, message);
}

// Time past the group's timeout that allGatherRows waits for its Gloo allgather: Gloo's timeout
// applies once the work runs, so a later raise from Gloo itself (naming its cause) comes first.
constexpr std::chrono::milliseconds kGlooQueueMargin{5000};
// After a failed Gloo exchange: how often and how many times allGatherRows looks for peers of this
// host whose process is gone (a process that is exiting is not yet a zombie).
constexpr std::chrono::milliseconds kDeadPeerLookEvery{25};
constexpr int kDeadPeerLooks = 10;

thread_local double last_agreement_wait_us = 0.0;

// Sets last_agreement_wait_us to the time from its construction to its destruction.
class AgreementWaitClock {
 public:
  AgreementWaitClock() : start_(std::chrono::steady_clock::now()) {}
  ~AgreementWaitClock() {
    last_agreement_wait_us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start_)
            .count();
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

AgreedRows allGatherRows(EPProcessGroup& pg, const char* op, uint64_t call,
                         const std::vector<int64_t>& row) {
  const int64_t num_ranks = pg.getSize();
  const int64_t width = static_cast<int64_t>(row.size());
  if (num_ranks == 1) {  // nobody to agree with: skip the round trip through Gloo's worker thread
    AgreedRows mine(1, width);
    std::copy(row.begin(), row.end(), mine.data());
    return mine;
  }
  auto state = exchangeStates().of(pg);
  if (!state->decided) {
    announceProcess(pg);  // so that a peer's death can be named (peer_liveness.hpp)
    state->exchange = HostExchange::connect(pg, std::string("ep ") + op);
    if (state->exchange) {
      EPProcessGroup* group = &pg;  // outlives the state: released by the group's shutdown
      state->exchange->setDeadPeerProbe([group] { return deadPeers(*group); });
    }
    state->decided = true;
  }
  if (state->transport_gather && state->transport_gather->fits(width)) {
    AgreedRows all(num_ranks, width);
    const auto timeout = pg.options()->timeout;
    std::string missing;
    try {
      AgreementWaitClock clock;
      missing = state->transport_gather->gather(row, all.data(), timeout);
    } catch (const std::exception& e) {
      giveUp(pg, state.get(), op, call,
             std::string("ep ") + op + ": rank " + std::to_string(pg.getRank()) +
                 ": the agreement exchange failed: " + messageWithoutTrace(e));
    }
    if (!missing.empty()) {
      std::ostringstream message;
      message << "ep " << op << ": rank " << pg.getRank() << " waited "
              << std::chrono::duration_cast<std::chrono::seconds>(timeout).count()
              << " s for the other ranks of the group to join this call; " << missing
              << " never joined it";
      giveUp(pg, state.get(), op, call, message.str());
    }
    return all;
  }
  if (state->exchange && HostExchange::fits(width)) {
    AgreedRows all(num_ranks, width);
    try {
      state->exchange->gather(row, all.data(), op, pg.options()->timeout);
      last_agreement_wait_us = state->exchange->lastWaitUs();
    } catch (const std::exception& e) {
      giveUp(pg, state.get(), op, call, messageWithoutTrace(e));
    }
    return all;
  }
  at::Tensor mine = at::tensor(row, at::kLong);
  at::Tensor all = at::empty({num_ranks * width}, at::kLong);
  c10d::AllgatherOptions opts;
  opts.timeout = pg.options()->timeout;
  const auto started = std::chrono::steady_clock::now();
  try {
    AgreementWaitClock clock;
    // Gloo's own timeout counts from when its worker thread starts the allgather; a work queued
    // behind a stuck one would never start. The bounded wait makes this rank raise anyway.
    pg.innerBackend(c10::DeviceType::CPU, op)
        ->_allgather_base(all, mine, opts)
        ->wait(opts.timeout + kGlooQueueMargin);
  } catch (const std::exception& e) {
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - started);
    std::ostringstream message;
    // Peers on this host whose process is gone, named as the shared-memory exchange names them:
    // first, as a peer that gave up may have done so because of them. A killed process closes
    // its sockets (which failed this exchange) before it turns into a zombie: look again for a
    // moment before concluding that none died.
    std::vector<int64_t> dead = deadPeers(pg);
    for (int i = 0; dead.empty() && i < kDeadPeerLooks; ++i) {
      std::this_thread::sleep_for(kDeadPeerLookEvery);
      dead = deadPeers(pg);
    }
    if (!dead.empty()) {
      giveUp(
          pg, state.get(), op, call,
          deadPeersMessage(op, dead, pg.getRank(), waited) + " (" + messageWithoutTrace(e) + ")");
    }
    const std::vector<int64_t> gave_up = peersThatGaveUp(pg);
    if (!gave_up.empty()) giveUp(pg, state.get(), op, call, gaveUpMessage(op, gave_up));
    message << "ep " << op << ": rank " << pg.getRank();
    if (waited + std::chrono::seconds(1) < opts.timeout) {  // failed before the timeout
      message << ": the exchange with the other ranks of the group failed after "
              << static_cast<double>(waited.count()) / 1000.0 << " s; ";
    } else {
      message << " waited "
              << std::chrono::duration_cast<std::chrono::seconds>(opts.timeout).count()
              << " s for the other ranks of the group to join this call; ";
    }
    message << stalledRanks(pg, call) << " (" << messageWithoutTrace(e) << ")";
    giveUp(pg, state.get(), op, call, message.str());
  }
  return AgreedRows::of(all.view({num_ranks, width}));
}

// A key of the live-only agreement in the group's store: `what` of `rank` in call `call`.
std::string liveKey(EPProcessGroup& pg, uint64_t call, const std::string& what, int64_t rank) {
  return "ep_live/" + pg.options()->group_name + "/" + std::to_string(call) + "/" + what + "/" +
         std::to_string(rank);
}

// Posts this rank's `what` of call `call` and drops its post of call - 2: every live peer has
// read that one (it posted its call - 1 rows, which this rank read, only after finishing
// call - 2). A store without deleteKey keeps the old key (a few hundred bytes per masked call).
void postLive(EPProcessGroup& pg, uint64_t call, const std::string& what,
              const std::vector<uint8_t>& bytes) {
  const int64_t rank = pg.getRank();
  pg.store()->set(liveKey(pg, call, what, rank), bytes);
  if (call >= 2) {
    try {
      pg.store()->deleteKey(liveKey(pg, call - 2, what, rank));
    } catch (const std::exception&) {
    }
  }
}

// With auto-masking, after the rows of a live-only agreement: every live rank posts the ranks it
// found missing (`missing`, ascending) and reads the posts of the ranks it did not; returns the
// union (a rank whose post does not come within the auto-mask timeout is in it too). Raises,
// marking the group's MoE calls over, when the union holds this rank: its peers masked it (it
// joined after their auto-mask timeout) and go on without it.
// Only peers whose row agreed on the masking (`same_masking`) are waited for: one that did not
// (e.g. auto-masking off there) posts nothing, and the call raises on the disagreement anyway.
std::vector<int64_t> agreeOnMissing(EPProcessGroup& pg, const char* op, uint64_t call, int phase,
                                    const RankMaskSnapshot& mask, std::vector<int64_t> missing,
                                    const std::vector<uint8_t>& same_masking,
                                    std::chrono::steady_clock::time_point deadline) {
  const int64_t num_ranks = pg.getSize();
  const int64_t rank = pg.getRank();
  const auto& store = pg.store();
  const std::string what = "missing" + std::to_string(phase);
  auto key = [&](int64_t r) { return liveKey(pg, call, what, r); };
  std::vector<uint8_t> mine(static_cast<size_t>(num_ranks), 0);
  for (int64_t p : missing) mine[static_cast<size_t>(p)] = 1;
  postLive(pg, call, what, mine);
  std::vector<uint8_t> all_missing = mine;
  std::vector<int64_t> masked_me;
  // Their posts come right after their rows: the same deadline, at least one more timeout.
  const auto until = std::max(deadline, std::chrono::steady_clock::now()) + mask.auto_timeout;
  for (int64_t p = 0; p < num_ranks; ++p) {
    if (p == rank || mask.is_masked(p) || mine[static_cast<size_t>(p)] ||
        !same_masking[static_cast<size_t>(p)]) {
      continue;
    }
    const auto left = std::max(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   until - std::chrono::steady_clock::now()),
                               std::chrono::milliseconds(1));
    std::vector<uint8_t> theirs;
    try {
      waitForKeys(*store, {key(p)}, left);
      theirs = store->get(key(p));
    } catch (const std::exception&) {
      all_missing[static_cast<size_t>(p)] = 1;  // gone after its row: masked as well
      continue;
    }
    for (int64_t q = 0; q < num_ranks && q < static_cast<int64_t>(theirs.size()); ++q) {
      if (!theirs[static_cast<size_t>(q)]) continue;
      if (q == rank) {
        masked_me.push_back(p);
      } else {
        all_missing[static_cast<size_t>(q)] = 1;
      }
    }
  }
  if (!masked_me.empty()) {
    std::ostringstream message;
    message << "ep " << op << ": rank " << rank << " was masked by rank(s) ";
    for (size_t i = 0; i < masked_me.size(); ++i) message << (i ? ", " : "") << masked_me[i];
    message << ": it joined this call after their auto-mask timeout of "
            << std::chrono::duration_cast<std::chrono::milliseconds>(mask.auto_timeout).count()
            << " ms, and they go on without it; a masked rank makes no more MoE calls on this "
               "group (abort it and create a new one to bring this rank back)";
    pg.markMoeUnusable("call #" + std::to_string(call) + " (" + op + ") failed: " + message.str());
    TORCH_CHECK(false, message.str());
  }
  std::vector<int64_t> out;
  for (int64_t p = 0; p < num_ranks; ++p) {
    if (all_missing[static_cast<size_t>(p)]) out.push_back(p);
  }
  return out;
}

// The agreement among the live ranks of a masked low-latency call (RankMaskSnapshot::live_only):
// each live rank posts its row in the group's store and reads its live peers' rows there, so a
// masked rank, which makes no call, is never waited for. (Not Gloo point-to-point: a Gloo receive
// that times out closes every connection of its context, and auto-masking must time out on a
// peer and go on.) A masked rank's row reads as `masked_row`. With auto-masking, a peer whose
// row does not come within the auto-mask timeout is masked (in `mask` and in the group's mask)
// and reads as `masked_row` too; without it, the call fails naming the peer, as the all-rank
// agreement does. `masking_col`: the row's column of the masking fingerprint (-1: none; a
// phase-2 row, after phase 1 agreed on it).
AgreedRows gatherAmongLiveRanks(EPProcessGroup& pg, const char* op, uint64_t call, int phase,
                                const std::vector<int64_t>& row,
                                const std::vector<int64_t>& masked_row, RankMaskSnapshot& mask,
                                int64_t masking_col) {
  const int64_t num_ranks = pg.getSize();
  const int64_t rank = pg.getRank();
  const int64_t width = static_cast<int64_t>(row.size());
  const auto& store = pg.store();
  const std::string what = std::to_string(phase);
  auto key = [&](int64_t r) { return liveKey(pg, call, what, r); };
  const auto* first = reinterpret_cast<const uint8_t*>(row.data());
  postLive(pg, call, what, std::vector<uint8_t>(first, first + row.size() * sizeof(int64_t)));
  TORCH_INTERNAL_ASSERT(masked_row.size() == row.size(), "a masked rank's row has the row's width");
  AgreedRows all(num_ranks, width);
  const auto timeout = mask.auto_mask ? mask.auto_timeout : pg.options()->timeout;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<int64_t> missing;
  std::vector<uint8_t> same_masking(static_cast<size_t>(num_ranks), 0);
  for (int64_t p = 0; p < num_ranks; ++p) {
    const std::vector<int64_t>* source = &masked_row;
    std::vector<int64_t> theirs;
    if (p == rank) {
      source = &row;
    } else if (!mask.is_masked(p)) {
      const auto left = std::max(std::chrono::duration_cast<std::chrono::milliseconds>(
                                     deadline - std::chrono::steady_clock::now()),
                                 std::chrono::milliseconds(1));
      try {
        waitForKeys(*store, {key(p)}, left);
        const std::vector<uint8_t> bytes = store->get(key(p));
        TORCH_CHECK(bytes.size() == row.size() * sizeof(int64_t), "ep ", op, ": rank ", p,
                    " posted a row of ", bytes.size(), " bytes, this rank expects ",
                    row.size() * sizeof(int64_t));
        theirs.resize(row.size());
        std::memcpy(theirs.data(), bytes.data(), bytes.size());
        source = &theirs;
        same_masking[static_cast<size_t>(p)] =
            masking_col < 0 ||
            theirs[static_cast<size_t>(masking_col)] == row[static_cast<size_t>(masking_col)];
      } catch (const c10::Error& e) {
        if (std::string(e.what()).find("posted a row") != std::string::npos) throw;
        missing.push_back(p);
      } catch (const std::exception&) {
        missing.push_back(p);
      }
    }
    std::copy(source->begin(), source->end(), all.row(p));
  }
  if (mask.auto_mask) {
    // Each rank masks on its own deadline: a peer whose row came just before one rank's
    // deadline and just after another's would be masked by one and waited for by the other.
    // One more round makes every live rank mask the same ranks: each posts the ranks it
    // found missing, and all take the union (a rank that then finds itself masked raises).
    missing = agreeOnMissing(pg, op, call, phase, mask, std::move(missing), same_masking, deadline);
  }
  if (missing.empty()) {
    return all;
  }
  std::ostringstream names;
  for (size_t i = 0; i < missing.size(); ++i) names << (i ? ", " : "") << missing[i];
  if (!mask.auto_mask) {
    std::ostringstream message;
    message << "ep " << op << ": rank " << rank << " waited "
            << std::chrono::duration_cast<std::chrono::seconds>(timeout).count()
            << " s for the live ranks of the group to join this call; rank(s) " << names.str()
            << " never joined it";
    pg.markMoeUnusable("call #" + std::to_string(call) + " (" + op + ") failed: " + message.str());
    TORCH_CHECK(false, message.str());
  }
  for (int64_t p : missing) {
    updateRankMask(pg, p, true);
    mask.masked[static_cast<size_t>(p)] = 1;
    std::copy(masked_row.begin(), masked_row.end(), all.row(p));
  }
  return all;
}

}  // namespace

namespace {
std::atomic<int64_t> count_inflation{0};
std::atomic<int64_t> exchange_delay_ms{0};
}  // namespace

void setTestExchangeDelay(int64_t milliseconds) {
  exchange_delay_ms.store(milliseconds, std::memory_order_relaxed);
}

int64_t testExchangeDelay() {
  return exchange_delay_ms.load(std::memory_order_relaxed);
}

void setTestCountInflation(int64_t rows) {
  count_inflation.store(rows, std::memory_order_relaxed);
}

int64_t testCountInflation() {
  return count_inflation.load(std::memory_order_relaxed);
}

void abandonMoeAgreement(EPProcessGroup& pg) {
  if (pg.getSize() == 1) {
    return;
  }
  auto state = exchangeStates().find(pg);
  if (state && state->exchange) {
    state->exchange->abandon();
  }
  if (state && state->decided) {
    postGaveUp(pg);
  }
}

std::string moeAgreementTransport(EPProcessGroup& pg) {
  if (pg.getSize() == 1) {
    return "none (one rank)";
  }
  auto state = exchangeStates().of(pg);
  if (state->transport_gather) {
    return state->transport_gather->name();
  }
  if (!state->decided) {
    return "undecided";
  }
  return state->exchange ? "shared memory" : "gloo";
}

namespace {

AgreedRows agree(EPProcessGroup& pg, const char* op, const std::string& local_error,
                 const std::vector<AgreedField>& fields_in, const std::vector<int64_t>& payload,
                 RankMaskSnapshot* mask) {
  const bool live_only = mask != nullptr && mask->live_only();
  // The live ranks must mask the same ranks: one more field then (only then: a copy of the
  // fields on every call would cost an allocation on the hot path).
  std::vector<AgreedField> with_mask;
  if (live_only) {
    with_mask = fields_in;
    with_mask.push_back(
        {"the masked ranks and auto-masking (ep_backend.low_latency_update_mask / "
         "low_latency_auto_mask)",
         mask->fingerprint()});
  }
  const std::vector<AgreedField>& fields = live_only ? with_mask : fields_in;
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(fields.size()) <= kMaxAgreedFields);
  if (C10_UNLIKELY(!pg.moeUsable())) {
    TORCH_CHECK(false, "ep ", op, ": this group's MoE calls cannot go on: ", pg.moeUnusableReason(),
                ". Call ep_backend.abort(group) on every rank and create a new group");
  }
  const int64_t num_ranks = pg.getSize();
  const int64_t rank = pg.getRank();
  const uint64_t call = pg.nextMoeCall();
  // Phase 1: a row of the same width on every rank and in every collective of this group
  // (header + 2R + 8 payload slots), so that ranks whose inputs, collectives or payload sizes
  // differ never post mismatched exchanges. A payload of up to 2R + 8 entries (every collective
  // but a low-latency dispatch with many experts per rank) travels in it, so the agreement is
  // one all-gather; a longer one follows in phase 2, once its size is agreed.
  const int64_t inline_width = 2 * num_ranks + kInlineExtra;
  const int64_t payload_size = static_cast<int64_t>(payload.size());
  const bool inline_payload = payload_size <= inline_width;
  std::vector<int64_t> header(kHeaderWidth + inline_width, 0);
  header[0] = local_error.empty() ? 0 : 1;
  header[1] = opId(op);
  header[2] = static_cast<int64_t>(call);
  header[3] = static_cast<int64_t>(fields.size());
  header[4] = payload_size;
  for (size_t f = 0; f < fields.size(); ++f) {
    header[kHeaderFixed + f] = fields[f].value;
  }
  if (inline_payload) {
    std::copy(payload.begin(), payload.end(), header.begin() + kHeaderWidth);
  }
  AgreedRows all;
  if (live_only) {
    // A masked rank's row: this rank's own header, without an error and with an empty payload,
    // so it passes every check and announces no rows.
    std::vector<int64_t> absent_header(header.begin(), header.begin() + kHeaderWidth);
    absent_header[0] = 0;
    absent_header.resize(header.size(), 0);
    all = gatherAmongLiveRanks(pg, op, call, 0, header, absent_header, *mask,
                               kHeaderFixed + static_cast<int64_t>(fields.size()) - 1);
  } else {
    all = allGatherRows(pg, op, call, header);
  }
  const AgreedRows& acc = all;

  // Calls of different kinds or numbers never pair: every rank names both (before any rank's
  // own input error, which belongs to a call its peers are not in).
  for (int64_t r = 0; r < num_ranks; ++r) {
    if (acc(r, 1) != header[1] || acc(r, 2) != header[2]) {
      TORCH_CHECK(false, "ep ", op, ": rank ", r, " is in call #", acc(r, 2), " (",
                  opName(acc(r, 1)), "), this rank (", rank, ") in call #", call, " (", op,
                  "); the ranks must call the same MoE collectives in the same order; nothing "
                  "was exchanged");
    }
  }
  std::vector<int64_t> bad_ranks;
  for (int64_t r = 0; r < num_ranks; ++r) {
    if (acc(r, 0) != 0) {
      bad_ranks.push_back(r);
    }
  }
  if (!local_error.empty()) {
    TORCH_CHECK(false, local_error, " (rank ", rank, "; nothing was exchanged)");
  }
  if (!bad_ranks.empty()) {
    raiseRejectedBy(op, bad_ranks);
  }
  for (int64_t r = 0; r < num_ranks; ++r) {
    TORCH_CHECK(acc(r, 3) == header[3], "ep ", op, ": ranks disagree on the number of checked ",
                "fields (rank ", rank, " has ", header[3], ", rank ", r, " has ", acc(r, 3),
                "); nothing was exchanged");
  }
  for (size_t f = 0; f < fields.size(); ++f) {
    for (int64_t r = 0; r < num_ranks; ++r) {
      if (acc(r, kHeaderFixed + f) != fields[f].value) {
        TORCH_CHECK(false, "ep ", op, ": ranks disagree on ", fields[f].name, " (rank ", rank,
                    " has ", fields[f].value, ", rank ", r, " has ", acc(r, kHeaderFixed + f),
                    "); nothing was exchanged");
      }
    }
  }
  for (int64_t r = 0; r < num_ranks; ++r) {
    TORCH_CHECK(acc(r, 4) == header[4], "ep ", op,
                ": ranks disagree on the size of the routing metadata (rank ", rank, " has ",
                header[4], ", rank ", r, " has ", acc(r, 4), "); nothing was exchanged");
  }
  if (inline_payload) {
    return all.columns(kHeaderWidth, payload_size);
  }
  // Phase 2: a longer payload, now known to have the same size everywhere (and to belong to
  // the same call: phase 1 agreed on it).
  if (live_only) {
    return gatherAmongLiveRanks(pg, op, call, 1, payload, std::vector<int64_t>(payload.size(), 0),
                                *mask, -1);
  }
  return allGatherRows(pg, op, call, payload);
}

}  // namespace

void useRowGather(EPProcessGroup& pg, std::shared_ptr<RowGather> gather) {
  exchangeStates().of(pg)->transport_gather = std::move(gather);
}

at::Tensor agreeAcrossRanks(EPProcessGroup& pg, const char* op, const std::string& local_error,
                            const std::vector<AgreedField>& fields,
                            const std::vector<int64_t>& payload) {
  return agree(pg, op, local_error, fields, payload, nullptr).toTensor();
}

AgreedRows agreeRowsAcrossRanks(EPProcessGroup& pg, const char* op, const std::string& local_error,
                                const std::vector<AgreedField>& fields,
                                const std::vector<int64_t>& payload) {
  return agree(pg, op, local_error, fields, payload, nullptr);
}

double lastAgreementWaitUs() {
  return last_agreement_wait_us;
}

AgreedRows agreeAmongLiveRanks(EPProcessGroup& pg, const char* op, const std::string& local_error,
                               const std::vector<AgreedField>& fields,
                               const std::vector<int64_t>& payload, RankMaskSnapshot& mask) {
  return agree(pg, op, local_error, fields, payload, &mask);
}

void rejectCollectively(EPProcessGroup& pg, const char* op, const std::string& message) {
  agreeAcrossRanks(pg, op, message.empty() ? std::string("invalid arguments") : message, {}, {});
}

std::vector<AgreedField> dispatchFields(const DispatchArgs& a, bool ok) {
  const bool has_scales = a.x_scales.has_value();
  return {
      {"num_experts", a.num_experts},
      {"hidden size H", ok ? a.x.size(1) : -1},
      {"x dtype", ok ? static_cast<int64_t>(a.x.scalar_type()) : -1},
      {"top-k", ok ? a.topk_idx.size(1) : -1},
      {"topk_idx dtype", ok ? static_cast<int64_t>(a.topk_idx.scalar_type()) : -1},
      {"x_scales columns", ok && has_scales ? a.x_scales->size(1) : 0},
      {"x_scales dtype", ok && has_scales ? static_cast<int64_t>(a.x_scales->scalar_type()) : -1},
      {"presence of topk_weights", a.topk_weights.has_value() ? 1 : 0},
      {"expert_alignment", a.expert_alignment},
      {"num_worst_tokens", a.num_worst_tokens},
  };
}

std::vector<AgreedField> cachedDispatchFields(const at::Tensor& x,
                                              const std::optional<at::Tensor>& x_scales, bool ok) {
  return {
      {"hidden size H", ok ? x.size(1) : -1},
      {"x dtype", ok ? static_cast<int64_t>(x.scalar_type()) : -1},
      {"x_scales columns", ok && x_scales ? x_scales->size(1) : 0},
  };
}

std::vector<AgreedField> combineFields(const CombineArgs& a, bool ok) {
  const bool has_weights = a.topk_weights.has_value();
  return {
      {"hidden size H", ok ? a.x.size(1) : -1},
      {"x dtype", ok ? static_cast<int64_t>(a.x.scalar_type()) : -1},
      {"presence of topk_weights", has_weights ? 1 : 0},
      {"top-k of topk_weights", ok && has_weights ? a.topk_weights->size(1) : 0},
  };
}

std::vector<AgreedField> lowLatencyDispatchFields(const LowLatencyDispatchInputs& a, bool ok) {
  return {
      {"num_max_dispatch_tokens_per_rank", a.num_max_dispatch_tokens_per_rank},
      {"num_experts", a.num_experts},
      {"hidden size H", ok ? a.x.size(1) : -1},
      {"use_fp8", a.use_fp8},
      {"round_scale", a.round_scale},
      {"use_ue8m0", a.use_ue8m0},
  };
}

std::vector<int64_t> routingCounts(const DispatchRouting& r, int64_t num_ranks) {
  auto counts = [num_ranks](const at::Tensor& t) {
    if (!t.defined() || t.numel() != num_ranks) {
      return std::vector<int64_t>(num_ranks, 0);
    }
    at::Tensor c = t.to(at::kCPU).to(at::kLong).contiguous();
    return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + num_ranks);
  };
  std::vector<int64_t> out = counts(r.num_tokens_per_rank);
  std::vector<int64_t> recv = counts(r.num_recv_tokens_per_rank);
  out.insert(out.end(), recv.begin(), recv.end());
  return out;
}

std::string validateReserve(int64_t num_tokens, int64_t hidden_bytes, int64_t topk,
                            int64_t num_scales, int64_t num_experts, int64_t num_ranks) {
  std::ostringstream error;
  if (num_tokens < 1) {
    error << "num_tokens must be positive, got " << num_tokens;
  } else if (hidden_bytes < 16 || hidden_bytes % 16 != 0) {
    error << "a row (hidden * element size) must be a positive multiple of 16 bytes, got "
          << hidden_bytes;
  } else if (topk < 1 || topk > 32) {
    error << "num_topk must be in [1, 32], got " << topk;
  } else if (num_scales < 0) {
    error << "num_scales must be >= 0, got " << num_scales;
  } else if (num_experts < num_ranks || num_experts % num_ranks != 0) {
    error << "num_experts must be a positive multiple of the group size " << num_ranks << ", got "
          << num_experts;
  }
  return error.str();
}

void checkRoutingAgrees(const char* op, const AgreedRows& gathered, int64_t offset, int64_t rank,
                        int64_t known_column) {
  const int64_t num_ranks = gathered.rows();
  const auto known = [&](int64_t r) { return known_column < 0 || gathered(r, known_column) == 1; };
  for (int64_t s = 0; s < num_ranks; ++s) {
    for (int64_t d = 0; d < num_ranks; ++d) {
      if (!known(s) || !known(d)) continue;
      const int64_t sent = gathered(s, offset + d);
      const int64_t expected = gathered(d, offset + num_ranks + s);
      TORCH_CHECK(
          sent == expected, "ep ", op, ": the handle does not match across ranks (rank ", s,
          " sent ", sent, " rows to rank ", d, ", which expects ", expected,
          "); was it made by another dispatch or group? Nothing was exchanged (seen on rank ", rank,
          ")");
    }
  }
}

void checkRoutingAgrees(const char* op, const at::Tensor& gathered, int64_t offset, int64_t rank,
                        int64_t known_column) {
  checkRoutingAgrees(op, AgreedRows::of(gathered), offset, rank, known_column);
}

AgreedRows AgreedRows::of(const at::Tensor& rows) {
  TORCH_INTERNAL_ASSERT(rows.dim() == 2 && rows.scalar_type() == at::kLong && rows.is_cpu());
  AgreedRows out(rows.size(0), rows.size(1));
  const at::Tensor dense = rows.contiguous();
  std::copy(dense.data_ptr<int64_t>(), dense.data_ptr<int64_t>() + dense.numel(), out.data());
  return out;
}

AgreedRows AgreedRows::columns(int64_t first, int64_t count) const {
  TORCH_INTERNAL_ASSERT(first >= 0 && count >= 0 && first + count <= cols_);
  AgreedRows out(rows_, count);
  for (int64_t r = 0; r < rows_; ++r) {
    const int64_t* from = data_.data() + r * cols_ + first;
    std::copy(from, from + count, out.row(r));
  }
  return out;
}

at::Tensor AgreedRows::toTensor() const {
  at::Tensor out = at::empty({rows_, cols_}, at::kLong);
  std::copy(data_.begin(), data_.end(), out.data_ptr<int64_t>());
  return out;
}

void raiseRejectedBy(const char* op, const std::vector<int64_t>& bad_ranks) {
  std::ostringstream os;
  for (size_t i = 0; i < bad_ranks.size(); ++i) {
    os << (i ? ", " : "") << bad_ranks[i];
  }
  TORCH_CHECK(false, "ep ", op, ": rank(s) ", os.str(),
              " rejected their inputs (see their error); nothing was exchanged");
}

void checkDispatchLayoutArgs(const at::Tensor& topk_idx, int64_t num_experts, int64_t num_ranks) {
  TORCH_CHECK(topk_idx.dim() == 2, "ep get_dispatch_layout: topk_idx must be [T, K]");
  TORCH_CHECK(topk_idx.scalar_type() == at::kLong || topk_idx.scalar_type() == at::kInt,
              "ep get_dispatch_layout: topk_idx must be int64 or int32");
  TORCH_CHECK(num_experts > 0 && num_ranks > 0 && num_experts % num_ranks == 0,
              "ep get_dispatch_layout: num_experts=", num_experts,
              " must be a positive multiple of num_ranks=", num_ranks);
}

}  // namespace ep
