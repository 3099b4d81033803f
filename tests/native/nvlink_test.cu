// Correctness harness of the nvlink runtime: one process drives R ranks (R = 1, 2, 4, 8; ranks
// map round-robin onto the visible GPUs, so R = 4 or 8 also runs on 2 GPUs) and checks every
// output bitwise against the CPU reference of the spec (nvlink_harness.cuh), plus the graph,
// overflow, timeout, validation, invalid-index, BF16 pair-sum and multi-process IPC cases.
// The kernel timings are nvlink_bench.cu's.
//
//   nvlink_test [--soak N] [--no-ipc]
//
// Exit status 0 iff every check passed. The last line is the summary.
#include "tests/native/nvlink_harness.cuh"

namespace {

// Special tests
// ------------------------------------------------------------------------------------------

// Worst-case path captured once in a CUDA graph per rank, replayed with new routing each time.
void graph_test(Team& team) {
  const int R = team.R;
  CaseSpec spec;
  spec.name = "graph";
  spec.R = R;
  spec.T.assign(R, 0);
  for (int r = 0; r < R; ++r) spec.T[r] = 100 + 37 * r;
  spec.hidden_bytes = 1024;
  spec.S = 3;
  spec.K = 6;
  spec.E = 8 * R;
  spec.worst = 100 * R + 37 * R * R;  // >= any N
  spec.comb = ep::CombineElem::kBFloat16;
  spec.comb_hidden = 512;
  spec.bias0 = true;
  const int replays = 4;
  std::vector<CaseData> data;
  for (int i = 0; i < replays; ++i) {
    spec.seed = 1000 + i;
    data.push_back(make_case(spec));
  }
  std::vector<std::vector<RankResult>> res(replays, std::vector<RankResult>(R));
  run_ranks(R, [&](int r) {
    CUDA_CHECK(cudaSetDevice(team.device[r]));
    g_stage = &team.stage[r];
    cudaStream_t s = team.stream[r];
    Arena& a = team.arena[r];
    a.reset();
    const CaseData& c0 = data[0];
    RankBuffers b{};
    alloc_inputs(c0, c0.r[r], a, b);
    alloc_outputs(c0, c0.r[r], c0.cap, a, b, s);
    sync_stream(s);
    NvlinkRuntime& rt = *team.rt[r];
    cudaGraph_t graph;
    CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    rt.layout(b.idx, spec.idx_bytes, c0.r[r].T, spec.K, spec.E, b.per_rank, b.per_expert, b.in_rank,
              b.send_pos, s);
    rt.notify(b.per_rank, b.per_expert, spec.E, spec.alignment, c0.cap, b.recv_counts,
              b.recv_prefix, b.recv_per_expert, false, s, nullptr, true);
    enqueue_ops(c0, c0.r[r], r, rt, b, c0.cap, s, 0);
    CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < replays; ++i) {
      upload_inputs(data[i], data[i].r[r], b, s);
      upload_combine_inputs(data[i].r[r], b, s);
      CUDA_CHECK(cudaGraphLaunch(exec, s));
      download_results(data[i], data[i].r[r], b, data[i].cap, s, res[i][r]);
      res[i][r].error = rt.check_error();
    }
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
    g_stage = nullptr;
  });
  for (int i = 0; i < replays; ++i)
    for (int r = 0; r < R; ++r) verify_rank(data[i], r, res[i][r], " replay " + std::to_string(i));
}

// num_worst_tokens too small: the error record says so, nothing is written out of bounds, and
// after clear_error() the runtime keeps working.
void overflow_test(Team& team) {
  const int R = team.R;
  CaseSpec spec;
  spec.name = "overflow";
  spec.R = R;
  spec.T.assign(R, 300);
  spec.hidden_bytes = 256;
  spec.K = 4;
  spec.E = 4 * R;
  spec.p_none = 0.0;
  spec.worst = 50;  // far below N
  CaseData c = make_case(spec);
  // Guard bytes after every output: must be untouched.
  std::vector<std::string> errors(R);
  std::vector<int> guard_ok(R, 0);
  run_ranks(R, [&](int r) {
    CUDA_CHECK(cudaSetDevice(team.device[r]));
    g_stage = &team.stage[r];
    cudaStream_t s = team.stream[r];
    Arena& a = team.arena[r];
    a.reset();
    const RankData& d = c.r[r];
    RankBuffers b{};
    alloc_inputs(c, d, a, b);
    // Allocate outputs with a guard region behind recv_x.
    const size_t hb = spec.hidden_bytes, guard = 1 << 20;
    char* recv_x = static_cast<char*>(a.take(c.cap * hb + guard));
    CUDA_CHECK(cudaMemsetAsync(recv_x, 0x5A, c.cap * hb + guard, s));
    alloc_outputs(c, d, c.cap, a, b, s);
    b.recv_x = recv_x;
    upload_inputs(c, d, b, s);
    upload_combine_inputs(d, b, s);
    NvlinkRuntime& rt = *team.rt[r];
    rt.layout(b.idx, spec.idx_bytes, d.T, spec.K, spec.E, b.per_rank, b.per_expert, b.in_rank,
              b.send_pos, s);
    rt.notify(b.per_rank, b.per_expert, spec.E, 1, c.cap, b.recv_counts, b.recv_prefix,
              b.recv_per_expert, false, s, nullptr, true);
    enqueue_ops(c, d, r, rt, b, c.cap, s, 0);
    std::vector<uint8_t> g(guard);
    copy_d2h(g.data(), recv_x + c.cap * hb, guard, s);
    sync_stream(s);
    g_stage = nullptr;
    guard_ok[r] = std::all_of(g.begin(), g.end(), [](uint8_t v) { return v == 0x5A; });
    errors[r] = rt.check_error();
  });
  for (int r = 0; r < R; ++r) {
    check_true(guard_ok[r] == 1, "overflow rank " + std::to_string(r) + ": wrote past capacity");
    check_true(errors[r].find("num_worst_tokens=50") != std::string::npos,
               "overflow rank " + std::to_string(r) + ": error message '" + errors[r] + "'");
    if (r == 0) std::printf("  overflow message: %s\n", errors[r].c_str());
    team.rt[r]->clear_error();
  }
  // The runtime must still work.
  spec.name = "after-overflow";
  spec.worst = 0;
  run_case(team, spec);
}

// One rank never calls dispatch: the other times out, records who it waited for, and returns.
void timeout_test() {
  NvlinkConfig cfg;
  cfg.max_tokens_per_rank = 64;
  cfg.max_hidden_bytes = 256;
  cfg.max_topk = 4;
  cfg.max_scales = 0;
  cfg.max_local_experts = 8;
  cfg.timeout_seconds = 1.5;
  auto team = make_team(2, cfg, 16 << 20);
  std::string msg;
  const auto t0 = std::chrono::steady_clock::now();
  run_ranks(2, [&](int r) {
    CUDA_CHECK(cudaSetDevice(team->device[r]));
    if (r == 1) return;  // rank 1 never shows up
    cudaStream_t s = team->stream[r];
    Arena& a = team->arena[r];
    int* send_pos = static_cast<int*>(a.take(64 * 2 * 4));
    int* prefix = static_cast<int*>(a.take(3 * 4));
    std::vector<int> sp(64 * 2);
    for (int t = 0; t < 64; ++t) {
      sp[t * 2] = t;
      sp[t * 2 + 1] = t;
    }
    std::vector<int> pre = {0, 64, 128};
    CUDA_CHECK(cudaMemcpyAsync(send_pos, sp.data(), sp.size() * 4, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaMemcpyAsync(prefix, pre.data(), 12, cudaMemcpyHostToDevice, s));
    void* x = a.take(64 * 256);
    void* rx = a.take(128 * 256);
    void* ridx = a.take(128 * 4 * 8);
    int64_t* idx = static_cast<int64_t*>(a.take(64 * 4 * 8));
    CUDA_CHECK(cudaMemsetAsync(idx, 0, 64 * 4 * 8, s));
    NvlinkDispatchArgs d;
    d.x = x;
    d.num_tokens = 64;
    d.hidden_bytes = 256;
    d.topk_idx = idx;
    d.num_topk = 4;
    d.num_experts = 16;
    d.send_pos = send_pos;
    d.recv_prefix = prefix;
    d.recv_x = rx;
    d.recv_topk_idx = ridx;
    team->rt[r]->dispatch(d, s);
    CUDA_CHECK(cudaStreamSynchronize(s));  // the kernel must return (no trap, no hang)
    msg = team->rt[r]->check_error();
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("  timeout message (after %.1f s): %s\n", secs, msg.c_str());
  check_true(msg == "ep dispatch: rank 0 timed out after 1.5 s waiting for rank 1",
             "timeout message: '" + msg + "'");
  check_true(team->rt[0]->failed(), "runtime must report failed() after a timeout");
  bool threw = false;
  try {
    team->rt[0]->barrier(team->stream[0]);
  } catch (const std::runtime_error&) {
    threw = true;
  }
  check_true(threw, "calls after a timeout must throw");
}

// Bad arguments are rejected on the host.
void validation_test(Team& team) {
  NvlinkRuntime& rt = *team.rt[0];
  auto expect_throw = [&](const std::function<void()>& f, const std::string& what) {
    bool threw = false;
    try {
      f();
    } catch (const std::invalid_argument&) {
      threw = true;
    }
    check_true(threw, "validation: " + what);
  };
  alignas(16) int dummy[64];
  NvlinkDispatchArgs a;
  a.x = dummy;
  a.num_tokens = 1;
  a.hidden_bytes = 24;  // not a multiple of 16
  a.topk_idx = dummy;
  a.num_topk = 1;
  a.num_experts = team.R;
  a.send_pos = dummy;
  a.recv_prefix = dummy;
  a.recv_x = dummy;
  a.recv_topk_idx = dummy;
  expect_throw([&] { rt.dispatch(a, team.stream[0]); }, "hidden bytes % 16");
  a.hidden_bytes = 16;
  a.num_tokens = rt.config().max_tokens_per_rank + 1;
  expect_throw([&] { rt.dispatch(a, team.stream[0]); }, "T above capacity");
  a.num_tokens = 1;
  a.num_topk = 33;
  expect_throw([&] { rt.dispatch(a, team.stream[0]); }, "K > 32");
  a.num_topk = 1;
  a.num_experts = team.R + 1;
  expect_throw([&] { rt.dispatch(a, team.stream[0]); }, "E % R");
}

// Out-of-range topk_idx: recorded by layout, treated as -1.
void invalid_idx_test(Team& team) {
  NvlinkRuntime& rt = *team.rt[0];
  cudaStream_t s = team.stream[0];
  CUDA_CHECK(cudaSetDevice(team.device[0]));
  Arena& a = team.arena[0];
  a.reset();
  std::vector<int64_t> idx = {0, 1, 999, -1};
  int64_t* d_idx = upload(a, idx, s);
  int* per_rank = static_cast<int*>(a.take(64));
  int* per_expert = static_cast<int*>(a.take(1024));
  bool* in_rank = static_cast<bool*>(a.take(64));
  int* send_pos = static_cast<int*>(a.take(64));
  rt.layout(d_idx, 8, 2, 2, 2 * team.R, per_rank, per_expert, in_rank, send_pos, s);
  CUDA_CHECK(cudaStreamSynchronize(s));
  const std::string e = rt.check_error();
  check_true(e.find("topk_idx value 999 at flat position 2") != std::string::npos,
             "invalid topk_idx message: '" + e + "'");
  rt.clear_error();
}

// Every pair of BF16 bit patterns (a, b) through device::bf16_pair_sum, the combine's fast path,
// against the spec's float32 reduction (+0 + a) + b rounded to nearest even: equal bits whenever
// the fast path reports no NaN, and a NaN in the spec's result whenever it does.
__global__ void bf16_pair_sum_kernel(unsigned long long* mismatches, unsigned long long* nans) {
  const uint32_t a = blockIdx.x;  // 65,536 blocks x 256 threads x 32 int4 = every b, 8 at a time
  unsigned long long bad = 0, nan_vectors = 0;
  for (int v = 0; v < 32; ++v) {
    const uint32_t b0 = (threadIdx.x * 32 + v) * 8;
    uint32_t bw[4], aw = a | (a << 16);
    for (int i = 0; i < 4; ++i) bw[i] = (b0 + 2 * i) | ((b0 + 2 * i + 1) << 16);
    int4 got;
    const bool ok =
        ep::device::bf16_pair_sum(make_int4(int(aw), int(aw), int(aw), int(aw)),
                                  make_int4(int(bw[0]), int(bw[1]), int(bw[2]), int(bw[3])), got);
    const uint32_t gw[4] = {uint32_t(got.x), uint32_t(got.y), uint32_t(got.z), uint32_t(got.w)};
    bool any_nan = false;
    for (int e = 0; e < 8; ++e) {
      const float sum = __fadd_rn(__fadd_rn(0.0f, ep::device::bf16_to_float(a)),
                                  ep::device::bf16_to_float(b0 + e));
      const uint16_t want = ep::device::float_to_bf16_rne(sum);
      any_nan |= sum != sum;
      if (ok && uint16_t(gw[e / 2] >> (16 * (e % 2))) != want) ++bad;
    }
    if (!ok) ++nan_vectors;
    if (!ok && !any_nan) ++bad;  // NaN reported where the spec has none
  }
  if (bad) atomicAdd(mismatches, bad);
  if (nan_vectors) atomicAdd(nans, nan_vectors);
}

void bf16_pair_sum_test() {
  CUDA_CHECK(cudaSetDevice(0));
  unsigned long long* d = nullptr;
  CUDA_CHECK(cudaMalloc(&d, 2 * sizeof(unsigned long long)));
  CUDA_CHECK(cudaMemset(d, 0, 2 * sizeof(unsigned long long)));
  bf16_pair_sum_kernel<<<65536, 256>>>(d, d + 1);
  CUDA_CHECK(cudaGetLastError());
  unsigned long long h[2];
  CUDA_CHECK(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaFree(d));
  check_true(h[0] == 0, "bf16 pair sum: " + std::to_string(h[0]) + " of 2^32 pairs differ");
  // NaN inputs exist in every a row: the fallback must have been exercised.
  check_true(h[1] > 0, "bf16 pair sum: no NaN result was ever reported");
  std::printf("  %-34s %s (%llu mismatches, %llu vectors with a NaN)\n",
              "bf16 pair sum, all 2^32 pairs", h[0] == 0 ? "ok" : "FAILED", h[0], h[1]);
}

// ------------------------------------------------------------------------------------------
// Multi-process (real CUDA IPC) test: fork one child per rank before CUDA is initialised.
// ------------------------------------------------------------------------------------------

int ipc_test(int R) {
  CaseSpec spec;
  spec.name = "ipc";
  spec.R = R;
  spec.T = {333, 251};
  spec.T.resize(R, 200);
  spec.hidden_bytes = 7168;
  spec.S = 56;
  spec.K = 8;
  spec.E = 32;
  spec.alignment = 4;
  spec.comb = ep::CombineElem::kBFloat16;
  spec.comb_hidden = 1024;
  spec.bias0 = spec.bias1 = true;
  std::vector<int> to_parent(2 * R), to_child(2 * R);
  for (int r = 0; r < R; ++r) {
    if (pipe(&to_parent[2 * r]) != 0 || pipe(&to_child[2 * r]) != 0) return 1;
  }
  std::vector<pid_t> pids(R);
  for (int r = 0; r < R; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      int rc = 0;
      try {
        int ndev = 0;
        CUDA_CHECK(cudaGetDeviceCount(&ndev));
        const int dev = r % ndev;
        CUDA_CHECK(cudaSetDevice(dev));
        NvlinkConfig cfg;
        cfg.max_tokens_per_rank = 512;
        cfg.max_hidden_bytes = 7168;
        cfg.max_topk = 8;
        cfg.max_scales = 56;
        cfg.max_local_experts = 32;
        cfg.timeout_seconds = 20;
        NvlinkRuntime rt(r, R, dev, cfg);
        std::vector<char> h = rt.ipc_handle();
        if (write(to_parent[2 * r + 1], h.data(), h.size()) != ssize_t(h.size()))
          throw std::runtime_error("write");
        std::vector<std::vector<char>> all(R, std::vector<char>(h.size()));
        for (int q = 0; q < R; ++q) {
          size_t got = 0;
          while (got < h.size()) {
            ssize_t n = read(to_child[2 * r], all[q].data() + got, h.size() - got);
            if (n <= 0) throw std::runtime_error("read");
            got += n;
          }
        }
        rt.connect(all);
        cudaStream_t s;
        CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        Arena arena;
        arena.size = 256 << 20;
        CUDA_CHECK(cudaMalloc(&arena.base, arena.size));
        PinnedStage stage;
        stage.size = 256 << 20;
        CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&stage.base), stage.size, 0));
        g_stage = &stage;
        CaseData c = make_case(spec);
        for (int iter = 0; iter < 3; ++iter) {
          RankResult res;
          run_rank(c, r, rt, s, arena, res, 0);
          verify_rank(c, r, res, " iter " + std::to_string(iter));
        }
        rt.barrier(s);
        CUDA_CHECK(cudaStreamSynchronize(s));
        rc = g_failures.load() == 0 ? 0 : 1;
        std::printf("  ipc child rank %d: %d checks, %d failures\n", r, g_checks.load(),
                    g_failures.load());
      } catch (const std::exception& e) {
        std::printf("  ipc child rank %d: exception %s\n", r, e.what());
        rc = 2;
      }
      std::fflush(stdout);
      _exit(rc);
    }
    pids[r] = pid;
  }
  // Parent: gather handles, broadcast.
  std::vector<std::vector<char>> handles(R, std::vector<char>(64));
  for (int r = 0; r < R; ++r) {
    size_t got = 0;
    while (got < 64) {
      ssize_t n = read(to_parent[2 * r], handles[r].data() + got, 64 - got);
      if (n <= 0) break;
      got += n;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < R; ++q)
      if (write(to_child[2 * r + 1], handles[q].data(), 64) != 64)
        std::printf("pipe write failed\n");
  int bad = 0;
  for (int r = 0; r < R; ++r) {
    int status = 0;
    waitpid(pids[r], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++bad;
  }
  return bad;
}

void correctness_suite(int R, int soak_iters) {
  NvlinkConfig cfg;
  cfg.max_tokens_per_rank = 700;
  cfg.max_hidden_bytes = 7168 * 2;
  cfg.max_topk = 32;
  cfg.max_scales = 56;
  cfg.max_local_experts = 128;
  cfg.timeout_seconds = 20;
  cfg.recv_slabs = 2;  // slab-mode cases: the dispatch into slab 0, its cached dispatch into 1
  // Every rank's blocks must be resident at once (they spin on each other): ranks that share a
  // GPU (R = 8 on one GPU) split its SMs.
  int sms = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int ranks_per_gpu = (R + g_num_devices - 1) / g_num_devices;
  cfg.num_sms = std::min(cfg.num_sms, sms / ranks_per_gpu);
  auto team = make_team(R, cfg, size_t(400) << 20, size_t(256) << 20);
  const char* mode = "";
  const auto t0 = std::chrono::steady_clock::now();
  const int E = 16 * R;
  std::vector<int> uneven(R);
  for (int r = 0; r < R; ++r) uneven[r] = (r == R - 1 && R > 1) ? 0 : 150 + (389 * (r + 1)) % 550;
  std::vector<CaseSpec> cases;
  {
    CaseSpec s = spec_of("bf16-H256-K8", R, uneven, 512, 0, 8, E);
    s.bias0 = true;
    cases.push_back(s);
  }
  {
    CaseSpec s = spec_of("f16-combine-H1000-K8", R, uneven, 512, 0, 8, E);
    s.comb = ep::CombineElem::kFloat16;
    s.comb_hidden = 1000;
    cases.push_back(s);
  }
  {
    CaseSpec s = spec_of("f16-combine-bias", R, uneven, 256, 0, 4, E);
    s.comb = ep::CombineElem::kFloat16;
    s.bias0 = s.bias1 = true;
    cases.push_back(s);
  }
  {
    CaseSpec s = spec_of("bf16-H7168-K1", R, uneven, 7168 * 2, 0, 1, E);
    s.comb_hidden = 7168;
    s.bias0 = s.bias1 = true;
    cases.push_back(s);
  }
  {
    CaseSpec s = spec_of("bf16-H200-K32-worst", R, uneven, 400, 0, 32, 32 * R);
    s.worst = -1;
    s.comb_hidden = 200;
    s.alignment = 8;
    cases.push_back(s);
  }
  {
    CaseSpec s = spec_of("fp8-H7168-S56-K8", R, uneven, 7168, 56, 8, 8 * R * 4);
    s.alignment = 128;
    s.comb_hidden = 7168;
    s.bias1 = true;
    cases.push_back(s);
  }
  {
    CaseSpec s = spec_of("fp8-H7168-S56-K8-worst", R, uneven, 7168, 56, 8, 8 * R * 4);
    s.worst = 700 * R;
    s.comb = ep::CombineElem::kFloat32;
    s.comb_hidden = 1000;
    s.bias0 = true;
    cases.push_back(s);
  }
  {
    CaseSpec s = spec_of("fp8-H208-S3-int32idx", R, uneven, 208, 3, 5, E);
    s.idx_bytes = 4;
    s.comb = ep::CombineElem::kFloat64;
    s.comb_hidden = 200;
    s.bias0 = s.bias1 = true;
    cases.push_back(s);
  }
  {
    CaseSpec s = spec_of("f64-combine-noweights", R, uneven, 1024, 0, 4, E);
    s.weights = false;
    s.comb = ep::CombineElem::kFloat64;
    s.comb_hidden = 1792;
    cases.push_back(s);
  }
  {
    CaseSpec s = spec_of("all-none", R, uneven, 256, 2, 4, E);
    s.p_none = 1.0;
    s.bias0 = true;
    cases.push_back(s);
  }
  {
    CaseSpec s = spec_of("all-empty", R, std::vector<int>(R, 0), 256, 0, 4, E);
    cases.push_back(s);
  }
  {
    CaseSpec s = spec_of("max-tokens-dense", R, std::vector<int>(R, 700), 2048, 8, 16, E);
    s.p_none = 0.02;
    cases.push_back(s);
  }
  // Every normal-mode case again as the backend runs it: overlapped with the host wait, outputs
  // written in place into the receiver's slab.
  const size_t num_plain = cases.size();
  for (size_t i = 0; i < num_plain; ++i) {
    if (cases[i].worst != 0) continue;
    CaseSpec s = cases[i];
    s.name += "-slab";
    s.slab = true;
    cases.push_back(s);
  }
  for (const CaseSpec& s : cases) {
    const int before = g_failures;
    run_case(*team, s);
    std::printf("  R=%d%s %-28s %s\n", R, mode, s.name.c_str(),
                g_failures == before ? "ok" : "FAILED");
  }
  {
    const int before = g_failures;
    run_case(*team, cases[0], 1);  // one SM: every warp serves many rows
    run_case(*team, cases[3], 7);
    std::printf("  R=%d%s %-28s %s\n", R, mode, "num_sms 1 / 7",
                g_failures == before ? "ok" : "FAILED");
  }
  {
    const int before = g_failures;
    graph_test(*team);
    std::printf("  R=%d%s %-28s %s\n", R, mode, "cuda graph replay",
                g_failures == before ? "ok" : "FAILED");
  }
  {
    const int before = g_failures;
    overflow_test(*team);
    std::printf("  R=%d%s %-28s %s\n", R, mode, "worst-case overflow",
                g_failures == before ? "ok" : "FAILED");
  }
  if (R == 2) {
    const int before = g_failures;
    validation_test(*team);
    invalid_idx_test(*team);
    std::printf("  R=%d%s %-28s %s\n", R, mode, "validation",
                g_failures == before ? "ok" : "FAILED");
  }
  // Soak: random shapes and modes, every iteration verified.
  std::mt19937_64 rng(4242 + R);
  const int before = g_failures;
  for (int it = 0; it < soak_iters && g_failures == before; ++it) {
    CaseSpec s;
    s.name = "soak" + std::to_string(it);
    s.R = R;
    s.T.resize(R);
    for (int r = 0; r < R; ++r) s.T[r] = rng() % 6 == 0 ? 0 : int(rng() % 400);
    const int hbs[] = {16, 256, 400, 1024, 2048};
    s.hidden_bytes = hbs[rng() % 5];
    s.S = rng() % 3 == 0 ? int(rng() % 9) : 0;
    const int ks[] = {1, 2, 8, 32};
    s.K = ks[rng() % 4];
    s.E = std::max(s.K, R) * (1 + rng() % 3);
    s.E = (s.E + R - 1) / R * R;
    s.idx_bytes = rng() % 4 == 0 ? 4 : 8;
    s.weights = rng() % 4 != 0;
    s.p_none = (rng() % 4) * 0.2;
    s.alignment = 1 + int(rng() % 3) * 3;
    s.worst = rng() % 3 == 0 ? -1 : 0;
    s.slab = s.worst == 0 && rng() % 2 == 0;
    const ep::CombineElem types[] = {ep::CombineElem::kBFloat16, ep::CombineElem::kBFloat16,
                                     ep::CombineElem::kFloat16, ep::CombineElem::kFloat32,
                                     ep::CombineElem::kFloat64};
    s.comb = types[rng() % 5];
    s.comb_hidden =
        s.comb == ep::CombineElem::kFloat64 ? 2 * (1 + rng() % 64) : 8 * (1 + rng() % 64);
    s.bias0 = rng() % 2;
    s.bias1 = rng() % 3 == 0;
    s.seed = rng();
    run_case(*team, s, 1 + int(rng() % 24) % cfg.num_sms);
  }
  std::printf("  R=%d%s %-28s %s (%d iterations)\n", R, mode, "soak",
              g_failures == before ? "ok" : "FAILED", soak_iters);
  std::printf("  R=%d%s suite took %.1f s\n", R, mode,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

}  // namespace

int main(int argc, char** argv) {
  bool do_ipc = true;
  int soak = 300;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--no-ipc") do_ipc = false;
    if (a == "--soak" && i + 1 < argc) soak = std::atoi(argv[++i]);
  }
  setvbuf(stdout, nullptr, _IOLBF, 0);
  use_one_queue_per_rank();
  if (do_ipc) {  // before this process touches CUDA (fork + CUDA do not mix)
    const int ipc_bad = ipc_test(2);
    ++g_checks;
    if (ipc_bad) fail("ipc test: " + std::to_string(ipc_bad) + " child(ren) failed");
    std::printf("  R=2 %-28s %s\n", "multi-process CUDA IPC", ipc_bad ? "FAILED" : "ok");
  }
  run_phase("devices", [] { enable_peer_access(); });
  run_phase("bf16 pair sum", [&] { bf16_pair_sum_test(); });
  for (int R : {1, 2, 4, 8})
    run_phase("suite", [&] { correctness_suite(R, R <= 2 ? soak : soak / (R == 4 ? 3 : 6)); });
  run_phase("timeout test", [&] { timeout_test(); });
  return report_summary();
}
