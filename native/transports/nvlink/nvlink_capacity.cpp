#ifdef EP_WITH_CUDA

#include "transports/nvlink/nvlink_capacity.hpp"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "backend/ep_process_group.hpp"
#include "backend/host_stages.hpp"
#include "backend/store_exchange.hpp"
#include "backend/stream_capture.hpp"
#include "transports/nvlink/nvlink_slab_pool.hpp"
#include "transports/nvlink/nvlink_transport.hpp"
#include "transports/nvlink/nvlink_tuning.hpp"

namespace ep::nvlink {
namespace {

int roundUpPow2(int v, int floor) {
  int p = floor;
  while (p < v) {
    p *= 2;
  }
  return p;
}

bool fits(const NvlinkConfig& c, const Needs& n) {
  return n.tokens <= c.max_tokens_per_rank && n.hidden_bytes <= c.max_hidden_bytes &&
         n.topk <= c.max_topk && n.scales <= c.max_scales && n.local_experts <= c.max_local_experts;
}

std::string describe(const Needs& n) {
  std::ostringstream os;
  os << n.tokens << " tokens per rank, " << n.hidden_bytes << " bytes per row, top-" << n.topk
     << ", " << n.scales << " scales per row, " << n.local_experts << " experts per rank";
  return os.str();
}

Needs capacityOf(const NvlinkConfig& c) {
  return Needs{c.max_tokens_per_rank, c.max_hidden_bytes, c.max_topk, c.max_scales,
               c.max_local_experts};
}

}  // namespace

AgreedField graphCapturedField(const GroupState& st) {
  return {"a CUDA graph captured on the NVLink transport", st.graph_captured ? 1 : 0};
}

NvlinkRuntime& ensureRuntime(EPProcessGroup& pg, GroupState& st, const at::Device& device,
                             Needs needs, const char* op, bool capture, int agreed_recv_slabs) {
  const bool slabs_kept =
      agreed_recv_slabs < 0 || (st.runtime && st.runtime->config().recv_slabs == agreed_recv_slabs);
  if (st.runtime && fits(st.runtime->config(), needs) && slabs_kept) {
    st.graph_captured = st.graph_captured || capture;
    // Options.kernel_timeout_s may change on a live group: it applies from this call on.
    if (st.runtime->config().timeout_seconds != pg.options()->kernel_timeout_s) {
      st.runtime->set_timeout_seconds(pg.options()->kernel_timeout_s);
    }
    return *st.runtime;
  }
  TORCH_CHECK(!st.runtime || slabs_kept || !(capture || st.graph_captured), "ep ", op,
              ": Options.recv_slabs is now ", agreed_recv_slabs, " but the NVLink transport was ",
              "built with ", st.runtime ? st.runtime->config().recv_slabs : 0,
              ", and it cannot be rebuilt during or after a CUDA graph capture (the graph ",
              "replays kernels on its buffers). Set recv_slabs before capturing. Nothing was ",
              "exchanged.");
  const char* how =
      " Size it before capturing: ep_backend.reserve(num_tokens, hidden, num_topk, num_experts) "
      "with the largest shapes, or run the largest call once first.";
  TORCH_CHECK(
      !capture, "ep ", op, ": the NVLink transport cannot be ", st.runtime ? "grown" : "set up",
      " while a CUDA graph is captured (this call needs ", describe(needs),
      st.runtime ? "; it holds " + describe(capacityOf(st.runtime->config())) : std::string(),
      "). Nothing was exchanged.", how);
  TORCH_CHECK(!st.graph_captured, "ep ", op, ": this call needs ", describe(needs),
              ", more than the NVLink transport holds (",
              describe(capacityOf(st.runtime->config())),
              "), and a CUDA graph captured earlier replays kernels on it: growing it would free "
              "the buffers that graph uses. Nothing was exchanged.",
              how);
  NvlinkConfig cfg;
  if (st.runtime) {
    const auto& old = st.runtime->config();
    needs.tokens = std::max<int64_t>(needs.tokens, old.max_tokens_per_rank);
    needs.hidden_bytes = std::max<int64_t>(needs.hidden_bytes, old.max_hidden_bytes);
    needs.topk = std::max<int64_t>(needs.topk, old.max_topk);
    needs.scales = std::max<int64_t>(needs.scales, old.max_scales);
    needs.local_experts = std::max<int64_t>(needs.local_experts, old.max_local_experts);
    if (profilingHost()) {
      std::fprintf(stderr,
                   "ep nvlink: rebuilding the transport (needs %lld tokens, %lld "
                   "hidden bytes, top-%lld, %lld scales, %lld local experts)\n",
                   static_cast<long long>(needs.tokens), static_cast<long long>(needs.hidden_bytes),
                   static_cast<long long>(needs.topk), static_cast<long long>(needs.scales),
                   static_cast<long long>(needs.local_experts));
    }
    // Peers may still run kernels on the old buffers: drain, then agree, then free. The barrier
    // goes through the store, not Gloo: both ranks of a 2-rank soak sometimes waited in Gloo's
    // barrier for the whole group timeout (one H100, ranks sharing it; cause not found).
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    traceHost("rebuild: device synchronized");
    allGatherStrings(pg, keyPrefix(pg) + "rebuild/" + std::to_string(st.generation) + "/", "",
                     std::string("ep ") + op + ": rebuilding the NVLink transport");
    traceHost("rebuild: barrier passed");
    st.runtime->destroy();
    st.runtime.reset();
    st.slabs.reset();  // outputs still viewing an old slab keep its memory
    traceHost("rebuild: old transport freed");
  }
  cfg.max_tokens_per_rank = roundUpPow2(static_cast<int>(needs.tokens), 1024);
  cfg.max_hidden_bytes = static_cast<int>(std::max<int64_t>(needs.hidden_bytes, 16));
  cfg.max_topk = static_cast<int>(std::max<int64_t>(needs.topk, 8));
  cfg.max_scales = static_cast<int>(std::max<int64_t>(needs.scales, 1));
  cfg.max_local_experts = static_cast<int>(std::max<int64_t>(needs.local_experts, 1));
  cfg.timeout_seconds = pg.options()->kernel_timeout_s;
  cfg.num_sms = static_cast<int>(pg.options()->num_sms);
  applySendWarpOverrides(cfg);
  cfg.recv_slabs = recvSlabs(pg);
  st.runtime = std::make_unique<NvlinkRuntime>(pg.getRank(), pg.getSize(), device.index(), cfg);
  traceHost("transport: buffers allocated");
  if (cfg.recv_slabs > 0) {
    st.slabs =
        std::make_shared<SlabPool>(cfg.recv_slabs, device.index(), st.runtime->recv_slab_owner());
  }
  const std::string prefix = keyPrefix(pg) + "ipc/" + std::to_string(++st.generation) + "/";
  auto handle = st.runtime->ipc_handle();
  pg.store()->set(prefix + std::to_string(pg.getRank()),
                  std::vector<uint8_t>(handle.begin(), handle.end()));
  std::vector<std::vector<char>> all(pg.getSize());
  std::vector<std::string> keys;
  for (int r = 0; r < pg.getSize(); ++r) {
    keys.push_back(prefix + std::to_string(r));
  }
  waitForKeys(*pg.store(), keys, pg.options()->timeout);  // not get's wait: see waitForKeys
  for (int r = 0; r < pg.getSize(); ++r) {
    auto v = pg.store()->get(prefix + std::to_string(r));
    all[r] = std::vector<char>(v.begin(), v.end());
  }
  traceHost("transport: handles exchanged");
  st.runtime->connect(all);
  traceHost("transport: peers mapped");
  return *st.runtime;
}

Needs maxNeeds(const AgreedRows& gathered) {
  // gathered [R, >=5]: tokens, hidden bytes, top-k, scales, local experts. A plain loop: an ATen
  // reduction here woke the intra-op thread pool and cost milliseconds per call on the GPU host.
  int64_t m[5] = {0, 0, 0, 0, 0};
  for (int64_t r = 0; r < gathered.rows(); ++r) {
    for (int c = 0; c < 5; ++c) {
      m[c] = std::max(m[c], gathered(r, c));
    }
  }
  Needs n;
  n.tokens = m[0];
  n.hidden_bytes = m[1];
  n.topk = m[2];
  n.scales = m[3];
  n.local_experts = m[4];
  return n;
}

int64_t worstCaseRows(const AgreedRows& gathered) {
  int64_t rows = 0;
  for (int64_t r = 0; r < gathered.rows(); ++r) {
    rows += gathered(r, 0);
  }
  return rows;
}

std::vector<int64_t> reserve(EPProcessGroup& pg, const at::Device& device,
                             const at::Tensor& gathered) {
  auto st = stateOf(pg);
  c10::cuda::CUDAGuard guard(device);
  const NvlinkConfig& cfg = ensureRuntime(pg, *st, device, maxNeeds(AgreedRows::of(gathered)),
                                          "reserve", streamCapturing(), -1)
                                .config();
  return {cfg.max_tokens_per_rank, cfg.max_hidden_bytes,  cfg.max_topk,
          cfg.max_scales,          cfg.max_local_experts, cfg.recv_slabs};
}

}  // namespace ep::nvlink

#endif  // EP_WITH_CUDA
