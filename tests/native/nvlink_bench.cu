// Kernel benchmark of the nvlink runtime (T=4096, H=7168, top-8 of 256 experts): each dispatch
// and combine configuration timed as the ops run it (alone, behind notify, into a receive slab),
// the send-warp sweeps the NvlinkConfig defaults come from, and the combine per element type.
// Inputs come from the spec's case generator (nvlink_harness.cuh); an error a rank's runtime
// reports fails the run.
//
//   nvlink_bench [--iters N]
//
// Needs 2 GPUs; HT_BENCH_ONE_GPU=1 runs both ranks on one (their peer writes then land in the
// same HBM: a same-session A/B of kernel variants, not an NVLink figure), HT_BENCH_RANKS=1 one
// rank, HT_BENCH_QUICK=1 the default configuration's rows only, HT_COMBINE_WARPS="3,4,6" those
// combine send-warp splits. Exit status 0 iff every check passed. The last line is the summary.
#include "tests/native/nvlink_harness.cuh"

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct BenchShape {
  const char* name;
  int hidden_bytes;
  int S;
};

void bench(int iters) {
  // HT_BENCH_RANKS=1: one rank (a local permutation), to compare with the torch op's rows on one
  // GPU, where two ranks of a process would share it.
  const char* ranks_env = std::getenv("HT_BENCH_RANKS");
  const int R = ranks_env != nullptr ? std::atoi(ranks_env) : 2;
  const int T = 4096, H = 7168, K = 8, E = 256;
  if (R < 1 || R > 2) throw std::runtime_error("bench: HT_BENCH_RANKS must be 1 or 2");
  NvlinkConfig cfg;
  cfg.max_tokens_per_rank = T;
  cfg.max_hidden_bytes = H * 2;
  cfg.max_topk = K;
  cfg.max_scales = 56;
  cfg.max_local_experts = E / R;
  cfg.timeout_seconds = 30;
  cfg.recv_slabs = 2;  // the "receive slab" rows: outputs written in place by the senders
  auto team = make_team(R, cfg, size_t(1) << 30);
  std::printf("bench: R=%d T=%d H=%d K=%d E=%d, buffer %.1f MB/rank, devices:", R, T, H, K, E,
              NvlinkRuntime::buffer_bytes(cfg, R) / 1e6);
  for (int r = 0; r < R; ++r) std::printf(" %d", team->device[r]);
  std::printf("\n");

  // Routing: every token picks K distinct experts uniformly (no -1), like a random router.
  CaseSpec spec;
  spec.name = "bench";
  spec.R = R;
  spec.T.assign(R, T);
  spec.hidden_bytes = 2 * H;
  spec.S = 0;
  spec.K = K;
  spec.E = E;
  spec.p_none = 0.0;
  spec.comb_hidden = 8;  // combine inputs generated separately
  spec.seed = 77;
  CaseData c = make_case(spec);

  struct RankBench {
    RankBuffers b{};
    void* flush = nullptr;
    void* recv_x = nullptr;
    float* recv_scales = nullptr;
    void* xc = nullptr;
    void* out = nullptr;
    int* dest_slabs = nullptr;  // [2R] from notify: every rank lends its slab 0
    int N = 0;
  };
  std::vector<RankBench> rb(R);
  const size_t flush_bytes = size_t(256) << 20;
  run_ranks(R, [&](int r) {
    CUDA_CHECK(cudaSetDevice(team->device[r]));
    cudaStream_t s = team->stream[r];
    Arena& a = team->arena[r];
    RankBench& m = rb[r];
    const RankData& d = c.r[r];
    alloc_inputs(c, d, a, m.b);
    CUDA_CHECK(cudaMemcpyAsync(m.b.idx, d.idx_bytes_buf.data(), d.idx_bytes_buf.size(),
                               cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(m.b.x, d.x.data(), d.x.size(), cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(m.b.w, d.w.data(), d.w.size() * 4, cudaMemcpyHostToDevice, s));
    m.b.scales = static_cast<float*>(a.take(size_t(T) * 56 * 4));
    CUDA_CHECK(cudaMemsetAsync(m.b.scales, 0x3F, size_t(T) * 56 * 4, s));
    m.N = d.N;
    m.recv_x = a.take(size_t(R) * T * H * 2);
    m.b.recv_idx = a.take(size_t(R) * T * K * 8);
    m.b.recv_w = static_cast<float*>(a.take(size_t(R) * T * K * 4));
    m.b.src_idx = static_cast<int*>(a.take(size_t(R) * T * 4));
    m.b.src_rank = static_cast<int*>(a.take(size_t(R) * T * 4));
    m.recv_scales = static_cast<float*>(a.take(size_t(R) * T * 56 * 4));
    m.xc = a.take(size_t(R) * T * H * 2);
    CUDA_CHECK(cudaMemsetAsync(m.xc, 0x3C, size_t(R) * T * H * 2, s));
    m.out = a.take(size_t(T) * H * 2);
    m.dest_slabs = static_cast<int*>(a.take(size_t(2) * R * 4));
    CUDA_CHECK(cudaMalloc(&m.flush, flush_bytes));
    CUDA_CHECK(cudaStreamSynchronize(s));
  });

  std::vector<long long> remote_tokens(R, 0);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T && R == 2; ++t)
      remote_tokens[r] += c.r[r].in_rank[size_t(t) * R + (1 - r)];
  std::printf("bench: remote tokens per rank:");
  for (int r = 0; r < R; ++r) std::printf(" %lld (N = %d)", remote_tokens[r], c.r[r].N);
  std::printf("\n");

  // Times `op` on every rank: flush L2, device barrier, events around op. Returns per-rank medians.
  auto time_op = [&](const std::function<void(int, cudaStream_t)>& op) {
    std::vector<std::vector<double>> times(R);
    run_ranks(R, [&](int r) {
      CUDA_CHECK(cudaSetDevice(team->device[r]));
      cudaStream_t s = team->stream[r];
      cudaEvent_t e0, e1;
      CUDA_CHECK(cudaEventCreate(&e0));
      CUDA_CHECK(cudaEventCreate(&e1));
      const int warmup = 5;
      for (int i = 0; i < warmup + iters; ++i) {
        CUDA_CHECK(cudaMemsetAsync(rb[r].flush, i & 0xFF, flush_bytes, s));
        team->rt[r]->barrier(s);
        CUDA_CHECK(cudaEventRecord(e0, s));
        op(r, s);
        CUDA_CHECK(cudaEventRecord(e1, s));
        CUDA_CHECK(cudaEventSynchronize(e1));
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= warmup) times[r].push_back(ms * 1000.0);
      }
      CUDA_CHECK(cudaEventDestroy(e0));
      CUDA_CHECK(cudaEventDestroy(e1));
      const std::string err = team->rt[r]->check_error();
      if (!err.empty()) fail("bench: " + err);
    });
    std::vector<double> med(R);
    for (int r = 0; r < R; ++r) med[r] = median(times[r]);
    return med;
  };
  auto report = [&](const char* what, const std::vector<double>& med, double bytes_per_rank) {
    const double worst = *std::max_element(med.begin(), med.end());
    std::printf("  %-46s %8.1f us (ranks:", what, worst);
    for (double m : med) std::printf(" %.1f", m);
    std::printf(")");
    if (bytes_per_rank > 0) std::printf("  %6.1f GB/s remote", bytes_per_rank / worst * 1e-3);
    std::printf("\n");
  };

  // HT_BENCH_QUICK=1: the default configuration's rows only (no send-warp sweeps), for A/Bs of
  // kernel variants (scripts/ht_variants.sh) that need many runs within one device call.
  const bool quick = std::getenv("HT_BENCH_QUICK") != nullptr;
  std::vector<int> dispatch_warps = {8, 9, 10, 11, 12, 14};
  if (quick) dispatch_warps.clear();
  // HT_COMBINE_WARPS="3,4,6" sweeps other splits (default: 4 and 5).
  std::vector<int> combine_warps = {4, 5};
  if (const char* env = std::getenv("HT_COMBINE_WARPS")) {
    combine_warps.clear();
    for (const char* q = env; *q != '\0';) {
      combine_warps.push_back(std::atoi(q));
      while (*q != '\0' && *q != ',') ++q;
      if (*q == ',') ++q;
    }
  }
  const int rounds = 2;  // each configuration twice, alternating: run-to-run spread is visible
  const int default_combine_warps = cfg.combine_send_warps;
  const NvlinkConfig defaults = cfg;
  auto configure_send_warps = [&](int dw, int cw) {
    for (int r = 0; r < R; ++r) team->rt[r]->set_send_warps(dw, cw, dw);
  };
  // The defaults: dispatch warps by row size, `cw` combine warps (one_rank: with the rules for
  // groups of one rank, which override both counts there, and of 3 or more ranks, which sets the
  // combine's).
  auto configure_defaults = [&](int cw, bool one_rank = true) {
    for (int r = 0; r < R; ++r)
      team->rt[r]->set_send_warps(
          defaults.dispatch_send_warps, cw, defaults.small_row_dispatch_send_warps,
          defaults.slab_dispatch_send_warps, one_rank && defaults.one_rank_send_warps,
          one_rank ? defaults.combine_send_warps_many_ranks : 0);
  };

  // Layout (local) and notify once, for the routing used below.
  auto layout_op = [&](int r, cudaStream_t s) {
    RankBuffers& b = rb[r].b;
    team->rt[r]->layout(b.idx, 8, T, K, E, b.per_rank, b.per_expert, b.in_rank, b.send_pos, s);
  };
  report("layout", time_op(layout_op), 0);
  run_ranks(R, [&](int r) {
    CUDA_CHECK(cudaSetDevice(team->device[r]));
    RankBuffers& b = rb[r].b;
    const int t = team->rt[r]->notify(b.per_rank, b.per_expert, E, 1, 0, b.recv_counts,
                                      b.recv_prefix, b.recv_per_expert, true, team->stream[r],
                                      nullptr, false, /*lend_slab=*/0, rb[r].dest_slabs);
    team->rt[r]->wait_recv_counts(t);
  });

  const BenchShape shapes[2] = {{"BF16", 2 * H, 0}, {"FP8+scales", H, 56}};
  for (const BenchShape& sh : shapes) {
    const double remote_bytes =
        double(*std::max_element(remote_tokens.begin(), remote_tokens.end())) *
        (sh.hidden_bytes + sh.S * 4);
    auto dispatch_args = [&](int r, int cap) {
      RankBuffers& b = rb[r].b;
      NvlinkDispatchArgs a;
      a.x = b.x;
      a.num_tokens = T;
      a.hidden_bytes = sh.hidden_bytes;
      a.x_scales = sh.S ? b.scales : nullptr;
      a.num_scales = sh.S;
      a.topk_idx = b.idx;
      a.idx_bytes = 8;
      a.topk_weights = b.w;
      a.num_topk = K;
      a.num_experts = E;
      a.send_pos = b.send_pos;
      a.recv_prefix = b.recv_prefix;
      a.recv_x = rb[r].recv_x;
      a.recv_x_scales = sh.S ? rb[r].recv_scales : nullptr;
      a.recv_topk_idx = b.recv_idx;
      a.recv_topk_weights = b.recv_w;
      a.recv_src_idx = b.src_idx;
      a.recv_src_rank = b.src_rank;
      a.num_worst_tokens = cap;
      return a;
    };
    std::printf("%s dispatch (num_sms=24; remote bytes = rows x %d B):\n", sh.name,
                sh.hidden_bytes + sh.S * 4);
    for (int round = 0; round < rounds; ++round)
      for (int warps : dispatch_warps) {
        configure_send_warps(warps, default_combine_warps);
        char label[96];
        std::snprintf(label, sizeof(label), "dispatch kernel, %d send warps", warps);
        report(label, time_op([&](int r, cudaStream_t s) {
                 team->rt[r]->dispatch(dispatch_args(r, 0), s);
               }),
               remote_bytes);
      }
    configure_defaults(default_combine_warps);
    const int shape_warps = team->rt[0]->dispatch_send_warps(sh.hidden_bytes, sh.S);
    std::printf("  (below: default %d send warps)\n", shape_warps);
    report("dispatch kernel",
           time_op([&](int r, cudaStream_t s) { team->rt[r]->dispatch(dispatch_args(r, 0), s); }),
           remote_bytes);
    // Outputs in the lent slab: peers write them in place, receivers only wait for the flags.
    auto slab_args = [&](int r) {
      NvlinkDispatchArgs a = dispatch_args(r, 0);
      use_own_slab(a, *team->rt[r], rb[r].dest_slabs);
      return a;
    };
    for (int round = 0; round < rounds; ++round) {
      report("dispatch kernel, receive slab",
             time_op([&](int r, cudaStream_t s) { team->rt[r]->dispatch(slab_args(r), s); }),
             remote_bytes);
      report("dispatch kernel (again)",
             time_op([&](int r, cudaStream_t s) { team->rt[r]->dispatch(dispatch_args(r, 0), s); }),
             remote_bytes);
    }
    // As the op runs it: behind its notify (programmatic dependent launch), which exchanges the
    // counts and lends the slab while the dispatch kernel starts.
    auto notify_then_dispatch = [&](bool slab) {
      return time_op([&](int r, cudaStream_t s) {
        RankBuffers& b = rb[r].b;
        team->rt[r]->notify(b.per_rank, b.per_expert, E, 1, 0, b.recv_counts, b.recv_prefix,
                            b.recv_per_expert, false, s, nullptr, /*dispatch_follows=*/true,
                            slab ? 0 : -1, rb[r].dest_slabs);
        team->rt[r]->dispatch(slab ? slab_args(r) : dispatch_args(r, 0), s);
      });
    };
    report("notify + dispatch kernel", notify_then_dispatch(false), remote_bytes);
    report("notify + dispatch kernel, receive slab", notify_then_dispatch(true), remote_bytes);
    // With a slab the receive warps have nothing to copy; fewer senders contend less (the
    // default, NvlinkConfig::slab_dispatch_send_warps, came from this sweep).
    for (int warps : quick ? std::vector<int>{} : std::vector<int>{4, 5, 6, 8, 10, 12, 14}) {
      configure_send_warps(warps, default_combine_warps);
      char label[96];
      std::snprintf(label, sizeof(label), "dispatch kernel, receive slab, %d send warps", warps);
      report(label, time_op([&](int r, cudaStream_t s) { team->rt[r]->dispatch(slab_args(r), s); }),
             remote_bytes);
    }
    configure_defaults(default_combine_warps);
    report("cached dispatch", time_op([&](int r, cudaStream_t s) {
             team->rt[r]->cached_dispatch(dispatch_args(r, 0), s);
           }),
           remote_bytes);
    // As the backend runs a cached dispatch with slabs: behind a notify that lends slab 1.
    report("notify + cached dispatch kernel, receive slab", time_op([&](int r, cudaStream_t s) {
             RankBuffers& b = rb[r].b;
             NvlinkRuntime& rt = *team->rt[r];
             rt.notify(b.per_rank, b.per_rank, R, 1, 0, b.cached_counts, b.cached_prefix,
                       b.cached_per_expert, false, s, nullptr, true, 1, b.cached_dest_slabs);
             NvlinkDispatchArgs a = dispatch_args(r, 0);
             const ep::SlabLayout l = rt.cached_slab_layout(a.hidden_bytes, a.num_scales);
             a.topk_idx = nullptr;
             a.recv_prefix = b.cached_prefix;
             a.recv_x = rt.recv_slab(1) + l.x;
             a.recv_x_scales =
                 a.num_scales ? reinterpret_cast<float*>(rt.recv_slab(1) + l.scales) : nullptr;
             a.dest_slabs = b.cached_dest_slabs;
             a.own_slab = true;
             rt.cached_dispatch(a, s);
           }),
           remote_bytes);
    report("notify + dispatch, worst-case (no host sync)", time_op([&](int r, cudaStream_t s) {
             RankBuffers& b = rb[r].b;
             team->rt[r]->notify(b.per_rank, b.per_expert, E, 1, R * T, b.recv_counts,
                                 b.recv_prefix, b.recv_per_expert, false, s, nullptr, true);
             team->rt[r]->dispatch(dispatch_args(r, R * T), s);
           }),
           remote_bytes);
    report("notify + dispatch, worst-case, not overlapped", time_op([&](int r, cudaStream_t s) {
             RankBuffers& b = rb[r].b;
             team->rt[r]->notify(b.per_rank, b.per_expert, E, 1, R * T, b.recv_counts,
                                 b.recv_prefix, b.recv_per_expert, false, s);
             team->rt[r]->dispatch(dispatch_args(r, R * T), s);
           }),
           remote_bytes);
    report("notify + host wait + dispatch (normal)", time_op([&](int r, cudaStream_t s) {
             RankBuffers& b = rb[r].b;
             const int t = team->rt[r]->notify(b.per_rank, b.per_expert, E, 1, 0, b.recv_counts,
                                               b.recv_prefix, b.recv_per_expert, true, s);
             team->rt[r]->wait_recv_counts(t);
             team->rt[r]->dispatch(dispatch_args(r, 0), s);
           }),
           remote_bytes);
    // What the backend does by default: launch first (outputs sized for every row any rank
    // could send, R * T here), read the counts on the host afterwards.
    report("notify + dispatch + host wait (normal, overlapped)",
           time_op([&](int r, cudaStream_t s) {
             RankBuffers& b = rb[r].b;
             const int t =
                 team->rt[r]->notify(b.per_rank, b.per_expert, E, 1, 0, b.recv_counts,
                                     b.recv_prefix, b.recv_per_expert, true, s, nullptr, true);
             team->rt[r]->dispatch(dispatch_args(r, 0), s);
             team->rt[r]->wait_recv_counts(t);
           }),
           remote_bytes);
  }
  // Normal-mode notify leaves recv_prefix for N rows; combine on that layout.
  const double comb_bytes =
      R == 2 ? double(std::max(c.r[0].recv_counts[1], c.r[1].recv_counts[0])) * H * 2 : 0.0;
  std::printf("BF16 combine (num_sms=24; remote bytes = rows x %d B):\n", H * 2);
  const auto combine_op = [&](int r, cudaStream_t s) {
    NvlinkCombineArgs a;
    a.x = rb[r].xc;
    a.elem = ep::CombineElem::kBFloat16;
    a.hidden = H;
    a.num_recv_rows = rb[r].N;
    a.recv_prefix = rb[r].b.recv_prefix;
    a.send_pos = rb[r].b.send_pos;
    a.num_tokens = T;
    a.out = rb[r].out;
    team->rt[r]->combine(a, s);
  };
  for (int round = 0; round < rounds; ++round)
    for (int warps : combine_warps) {
      configure_defaults(warps, /*one_rank=*/false);
      char label[96];
      std::snprintf(label, sizeof(label), "combine, %d send warps", warps);
      report(label, time_op(combine_op), comb_bytes);
    }
  configure_defaults(default_combine_warps);
  if (team->rt[0]->combine_send_warps() != default_combine_warps) {  // the rank-count rules
    std::printf("  (below: default %d send warps)\n", team->rt[0]->combine_send_warps());
    report("combine", time_op(combine_op), comb_bytes);
  }
  for (int r = 0; r < R; ++r) {
    CUDA_CHECK(cudaSetDevice(team->device[r]));
    CUDA_CHECK(cudaFree(rb[r].flush));
  }
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 50;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc) iters = std::atoi(argv[++i]);
  }
  setvbuf(stdout, nullptr, _IOLBF, 0);
  use_one_queue_per_rank();
  run_phase("devices", [] { enable_peer_access(); });
  const bool one_gpu_bench = std::getenv("HT_BENCH_ONE_GPU") != nullptr;
  if (g_num_devices >= 2 || one_gpu_bench)
    run_phase("bench", [&] { bench(iters); });
  else
    fail("bench: needs 2 GPUs (HT_BENCH_ONE_GPU=1: both ranks on one)");
  return report_summary();
}
