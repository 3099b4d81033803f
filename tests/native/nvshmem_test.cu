// Torch-free 2-process harness of the low-latency runtime (cuda/nvshmem_runtime.hpp).
// The launcher forks one process per rank (GPU = rank % device count); rank 0 writes the NVSHMEM
// unique id to a file in /tmp, rank 1 reads it. Every rank checks what it received against a CPU
// implementation of ep_backend/reference.py (low_latency_dispatch / low_latency_combine, FP8
// per-128 quantisation with round_scale / UE8M0): dispatch bitwise; combine within
// float32-accumulation tolerance (the kernel adds the same float32 products per expert rank
// first, then the ranks) and bitwise identical from run to run.
//
// Usage: nvshmem_test [--timeout-test] [--no-p2p] [--soak N] [--graph N] [--quick] [--no-bench]
//                     [--bench-only] [--no-recreate]
// (--bench-only: latency only, no correctness cases, for trying kernel variants)
// Prints one line per case, timings, and "ALL PASSED" when both ranks pass.
#include <cuda_runtime.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "transports/nvshmem/cuda/nvshmem_kernels.hpp"
#include "transports/nvshmem/cuda/nvshmem_runtime.hpp"

namespace {

constexpr int kRanks = 2;
constexpr int kM = 128;
constexpr int kMaxH = 8192;
constexpr int kMaxK = 32;
constexpr int kMaxE = 64;

#define CUDA_OK(expr)                                                                            \
  do {                                                                                           \
    cudaError_t e_ = (expr);                                                                     \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(2);                                                                              \
    }                                                                                            \
  } while (0)

// cudaMemcpy that skips empty copies (an empty std::vector may hand out a null data()).
void copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (bytes != 0) CUDA_OK(cudaMemcpy(dst, src, bytes, kind));
}

// ---- CPU reference -------------------------------------------------------------------------

uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

float bf2f(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Reference combine value of one output: the float32 products w_k * y_k, their exact sum and the
// sum of their magnitudes (the scale of any float32 reordering error).
struct CombineTerm {
  double exact = 0.0;
  double magnitude = 0.0;
  void add(float product) {
    exact += double(product);
    magnitude += std::fabs(double(product));
  }
};

// A combine output is within float32-accumulation tolerance when it is at most one BF16 ulp
// (of the larger magnitude) plus 2 K 2^-24 sum|products| away from the exact sum.
bool combine_close(uint16_t got, const CombineTerm& want, int K) {
  const double g = bf2f(got);
  const double mag = std::max(std::fabs(g), std::fabs(want.exact));
  const double ulp = mag > 0 ? std::ldexp(1.0, std::ilogb(mag) - 7) : 0.0;
  return std::fabs(g - want.exact) <= ulp + 2.0 * K * std::ldexp(want.magnitude, -24);
}

uint32_t fbits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float bitsf(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float8_e4m3fn, round to nearest even, input already within [-448, 448].
struct E4M3 {
  float mag[127];  // codes 0x00 .. 0x7E, increasing
  E4M3() {
    for (int c = 0; c < 127; ++c) {
      const int e = (c >> 3) & 0xF, m = c & 7;
      mag[c] = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
    }
  }
  uint8_t encode(float v) const {
    const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
    const float a = std::fabs(v);
    const int hi = int(std::lower_bound(mag, mag + 127, a) - mag);  // first >= a
    int c;
    if (hi == 0) {
      c = 0;
    } else if (hi == 127) {
      c = 126;
    } else {
      const float dl = a - mag[hi - 1], dh = mag[hi] - a;
      c = dl < dh ? hi - 1 : (dh < dl ? hi : ((hi - 1) % 2 == 0 ? hi - 1 : hi));
    }
    return sign | uint8_t(c);
  }
};
const E4M3 kE4M3;

enum Mode { kBf16 = 0, kFp8 = 1, kFp8Round = 2, kFp8Ue8m0 = 3 };
const char* mode_name(int m) {
  static const char* names[] = {"bf16", "fp8", "fp8_round", "fp8_ue8m0"};
  return names[m];
}

// quantize_fp8_per128 of one row: q bytes [H], scale words (float bits or packed UE8M0).
void quantize_row(const uint16_t* x, int H, int mode, uint8_t* q, std::vector<uint32_t>& words) {
  const int groups = H / 128;
  std::vector<float> scales(groups);
  for (int g = 0; g < groups; ++g) {
    float amax = 0.0f;
    for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(bf2f(x[g * 128 + i])));
    amax = std::max(amax, 1e-4f);
    volatile float num = amax;
    float scale = num / 448.0f;
    if (mode != kFp8) scale = bitsf((fbits(scale) + 0x7FFFFFu) & 0x7F800000u);
    volatile float one = 1.0f;
    const float inv = one / scale;
    for (int i = 0; i < 128; ++i) {
      float v = bf2f(x[g * 128 + i]) * inv;
      v = std::min(448.0f, std::max(-448.0f, v));
      q[g * 128 + i] = kE4M3.encode(v);
    }
    scales[g] = scale;
  }
  words.clear();
  if (mode == kFp8Ue8m0) {
    for (int i = 0; i < groups / 4; ++i) {
      uint32_t w = 0;
      for (int j = 0; j < 4; ++j) w |= ((fbits(scales[4 * i + j]) >> 23) & 0xFFu) << (8 * j);
      words.push_back(w);
    }
  } else {
    for (float s : scales) words.push_back(fbits(s));
  }
}

struct Lcg {
  uint64_t s;
  explicit Lcg(uint64_t seed) : s(seed * 6364136223846793005ull + 1442695040888963407ull) {}
  uint32_t next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return uint32_t(s >> 33);
  }
  float uniform() { return (next() & 0xFFFFFF) / float(1 << 24); }
};

struct Case {
  std::string name;
  int mode = kBf16;
  int H = 7168;
  int K = 8;
  int E = 16;
  int T = 128;  // of rank 0; rank 1 gets T1
  int T1 = 128;
  bool hook = false;
  bool zero_copy = false;
  bool weighted = true;
  bool dup = false;  // allow repeated experts in a row
  bool idx32 = false;
  bool stats = false;
  uint64_t seed = 1;
};

// One rank's inputs, regenerated identically on every rank.
struct Inputs {
  int T = 0;
  std::vector<uint16_t> x;     // [T, H]
  std::vector<int64_t> idx;    // [T, K]
  std::vector<float> weights;  // [T, K]
};

Inputs make_inputs(const Case& c, int rank) {
  Inputs in;
  in.T = rank == 0 ? c.T : c.T1;
  Lcg g(c.seed * 1000003ull + rank * 7919ull + 17);
  in.x.resize(size_t(in.T) * c.H);
  for (auto& v : in.x) {
    const float u = (g.uniform() - 0.5f) * 8.0f;
    v = f2bf(g.uniform() < 0.01f ? u * 100.0f : u);
  }
  in.idx.assign(size_t(in.T) * c.K, -1);
  in.weights.resize(size_t(in.T) * c.K);
  for (int t = 0; t < in.T; ++t) {
    std::vector<int> pool(c.E);
    for (int e = 0; e < c.E; ++e) pool[e] = e;
    for (int k = 0; k < c.K; ++k) {
      int e;
      if (c.dup) {
        e = int(g.next() % c.E);
      } else {
        const int j = k + int(g.next() % (c.E - k));
        std::swap(pool[k], pool[j]);
        e = pool[k];
      }
      if (g.uniform() < 0.1f) e = -1;
      in.idx[size_t(t) * c.K + k] = e;
      in.weights[size_t(t) * c.K + k] = c.weighted ? g.uniform() : 1.0f;
    }
  }
  return in;
}

// Expert output of slot (le, j) on rank d (what the "experts" write for combine).
uint16_t expert_value(int d, int le, int j, int h, uint64_t seed) {
  uint64_t z = seed ^ (uint64_t(d) << 56) ^ (uint64_t(le) << 40) ^ (uint64_t(j) << 20) ^ h;
  z = (z ^ (z >> 31)) * 0x9E3779B97F4A7C15ull;
  z ^= z >> 29;
  return f2bf((float((z >> 40) & 0xFFFF) / 65536.0f - 0.5f) * 4.0f);
}

struct Entry {
  int src, t, k;
};

// Reference receive layout on rank d: for each local expert, the entries in slot order.
std::vector<std::vector<Entry>> reference_slots(const Case& c, const std::vector<Inputs>& all,
                                                int d) {
  const int E_loc = c.E / kRanks;
  std::vector<std::vector<Entry>> slots(E_loc);
  for (int le = 0; le < E_loc; ++le) {
    const int e = d * E_loc + le;
    for (int s = 0; s < kRanks; ++s)
      for (int t = 0; t < all[s].T; ++t)
        for (int k = 0; k < c.K; ++k)
          if (all[s].idx[size_t(t) * c.K + k] == e) slots[le].push_back({s, t, k});
  }
  return slots;
}

// ---- device buffers ----------------------------------------------------------------------

struct DeviceBuffers {
  void* x;
  void* idx;
  float* weights;
  void* recv_x;
  void* recv_scales;
  int* recv_count;
  int* src_info;
  int64_t* layout_range;
  int* stats;
  void* y;
  void* out;
  void alloc() {
    const size_t slots = size_t(kMaxE / kRanks) * kRanks * kM;
    CUDA_OK(cudaMalloc(&x, size_t(kM) * kMaxH * 2));
    CUDA_OK(cudaMalloc(&idx, size_t(kM) * kMaxK * 8));
    CUDA_OK(cudaMalloc(&weights, size_t(kM) * kMaxK * 4));
    CUDA_OK(cudaMalloc(&recv_x, slots * kMaxH * 2));
    CUDA_OK(cudaMalloc(&recv_scales, slots * (kMaxH / 128) * 4));
    CUDA_OK(cudaMalloc(&recv_count, kMaxE * 4));
    CUDA_OK(cudaMalloc(&src_info, slots * 4));
    CUDA_OK(cudaMalloc(&layout_range, kMaxE * kRanks * 8));
    CUDA_OK(cudaMalloc(&stats, kMaxE * 4));
    CUDA_OK(cudaMalloc(&y, slots * kMaxH * 2));
    CUDA_OK(cudaMalloc(&out, size_t(kM) * kMaxH * 2));
  }
};

struct Harness {
  int rank = 0;
  ep::NvshmemRuntime* rt = nullptr;
  DeviceBuffers buf{};
  cudaStream_t stream{};
  int failures = 0;

  void upload(const Case& c, const Inputs& in) {
    copy(buf.x, in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice);
    if (c.idx32) {
      std::vector<int32_t> i32(in.idx.begin(), in.idx.end());
      copy(buf.idx, i32.data(), i32.size() * 4, cudaMemcpyHostToDevice);
    } else {
      copy(buf.idx, in.idx.data(), in.idx.size() * 8, cudaMemcpyHostToDevice);
    }
    copy(buf.weights, in.weights.data(), in.weights.size() * 4, cudaMemcpyHostToDevice);
  }

  ep::NvshmemDispatchArgs dispatch_args(const Case& c, const Inputs& in) const {
    ep::NvshmemDispatchArgs a;
    a.x = buf.x;
    a.num_tokens = in.T;
    a.hidden = c.H;
    a.topk_idx = buf.idx;
    a.idx_bytes = c.idx32 ? 4 : 8;
    a.num_topk = c.K;
    a.num_experts = c.E;
    a.use_fp8 = c.mode != kBf16;
    a.round_scale = c.mode == kFp8Round || c.mode == kFp8Ue8m0;
    a.use_ue8m0 = c.mode == kFp8Ue8m0;
    a.recv_x = buf.recv_x;
    a.recv_x_scales = a.use_fp8 ? buf.recv_scales : nullptr;
    a.recv_count = buf.recv_count;
    a.src_info = buf.src_info;
    a.layout_range = buf.layout_range;
    a.cumulative_local_expert_recv_stats = c.stats ? buf.stats : nullptr;
    return a;
  }

  ep::NvshmemCombineArgs combine_args(const Case& c, const Inputs& in, int b) const {
    ep::NvshmemCombineArgs a;
    a.x = buf.y;
    a.hidden = c.H;
    a.topk_weights = c.weighted ? buf.weights : nullptr;
    a.num_tokens = in.T;
    a.num_topk = c.K;
    a.num_experts = c.E;
    a.layout_range = buf.layout_range;
    a.buffer_index = b;
    a.out = buf.out;
    return a;
  }

  bool fail(const Case& c, const std::string& what) {
    std::printf("[rank %d] FAIL %s: %s\n", rank, c.name.c_str(), what.c_str());
    std::fflush(stdout);
    ++failures;
    return false;
  }

  // Checks the dispatch outputs currently on the device against the reference.
  bool check_dispatch(const Case& c, const std::vector<Inputs>& all) {
    const int E_loc = c.E / kRanks, slots = kRanks * kM;
    const bool fp8 = c.mode != kBf16;
    const int row_bytes = fp8 ? c.H : c.H * 2;
    const int words = !fp8 ? 0 : (c.mode == kFp8Ue8m0 ? c.H / 512 : c.H / 128);
    std::vector<int> count(E_loc), src(size_t(E_loc) * slots);
    std::vector<int64_t> range(size_t(E_loc) * kRanks);
    std::vector<uint8_t> rx(size_t(E_loc) * slots * row_bytes);
    std::vector<uint32_t> rs(size_t(E_loc) * slots * std::max(words, 1));
    CUDA_OK(cudaMemcpy(count.data(), buf.recv_count, E_loc * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(src.data(), buf.src_info, src.size() * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(range.data(), buf.layout_range, range.size() * 8, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(rx.data(), buf.recv_x, rx.size(), cudaMemcpyDeviceToHost));
    if (words > 0)
      CUDA_OK(cudaMemcpy(rs.data(), buf.recv_scales, size_t(E_loc) * slots * words * 4,
                         cudaMemcpyDeviceToHost));
    const auto ref = reference_slots(c, all, rank);
    std::vector<uint8_t> q(c.H);
    std::vector<uint32_t> w;
    for (int le = 0; le < E_loc; ++le) {
      const auto& sl = ref[le];
      if (count[le] != int(sl.size()))
        return fail(c, "recv_count[" + std::to_string(le) + "] = " + std::to_string(count[le]) +
                           ", expected " + std::to_string(sl.size()));
      int begin = 0;
      for (int s = 0; s < kRanks; ++s) {
        int n = 0;
        for (const auto& en : sl) n += en.src == s;
        const int64_t want = (int64_t(begin) << 32) | n;
        if (range[size_t(le) * kRanks + s] != want)
          return fail(c, "layout_range mismatch at expert " + std::to_string(le));
        begin += n;
      }
      for (int j = 0; j < slots; ++j) {
        const int want = j < int(sl.size()) ? sl[j].t : -1;
        if (src[size_t(le) * slots + j] != want)
          return fail(c, "src_info[" + std::to_string(le) + "," + std::to_string(j) +
                             "] = " + std::to_string(src[size_t(le) * slots + j]) + ", expected " +
                             std::to_string(want));
      }
      for (int j = 0; j < int(sl.size()); ++j) {
        const Inputs& in = all[sl[j].src];
        const uint16_t* xr = in.x.data() + size_t(sl[j].t) * c.H;
        const uint8_t* got = rx.data() + (size_t(le) * slots + j) * row_bytes;
        if (!fp8) {
          if (std::memcmp(got, xr, row_bytes) != 0)
            return fail(c, "BF16 row differs at expert " + std::to_string(le) + " slot " +
                               std::to_string(j));
        } else {
          quantize_row(xr, c.H, c.mode, q.data(), w);
          if (std::memcmp(got, q.data(), c.H) != 0) {
            int at = 0;
            while (got[at] == q[at]) ++at;
            return fail(c, "FP8 row differs at expert " + std::to_string(le) + " slot " +
                               std::to_string(j) + " channel " + std::to_string(at) + ": got " +
                               std::to_string(got[at]) + ", expected " + std::to_string(q[at]));
          }
          if (std::memcmp(rs.data() + (size_t(le) * slots + j) * words, w.data(), words * 4) != 0)
            return fail(
                c, "scales differ at expert " + std::to_string(le) + " slot " + std::to_string(j));
        }
      }
    }
    return true;
  }

  // Fills y on the host: expert_value for valid slots (garbage-free zeros elsewhere).
  std::vector<uint16_t> make_y(const Case& c) {
    const int E_loc = c.E / kRanks, slots = kRanks * kM;
    std::vector<uint16_t> y(size_t(E_loc) * slots * c.H, 0);
    for (int le = 0; le < E_loc; ++le)
      for (int j = 0; j < slots; ++j)
        for (int h = 0; h < c.H; ++h)
          y[(size_t(le) * slots + j) * c.H + h] = expert_value(rank, le, j, h, c.seed);
    return y;
  }

  bool check_combine(const Case& c, const std::vector<Inputs>& all) {
    const Inputs& mine = all[rank];
    std::vector<uint16_t> got(size_t(mine.T) * c.H);
    copy(got.data(), buf.out, got.size() * 2, cudaMemcpyDeviceToHost);
    // Where did each of my (t, k) land? Slot j of expert le on rank d.
    const int E_loc = c.E / kRanks;
    std::vector<int> where(size_t(mine.T) * c.K, -1);
    for (int d = 0; d < kRanks; ++d) {
      const auto ref = reference_slots(c, all, d);
      for (int le = 0; le < E_loc; ++le)
        for (int j = 0; j < int(ref[le].size()); ++j)
          if (ref[le][j].src == rank) where[size_t(ref[le][j].t) * c.K + ref[le][j].k] = j;
    }
    for (int t = 0; t < mine.T; ++t) {
      for (int h = 0; h < c.H; ++h) {
        CombineTerm want;
        for (int k = 0; k < c.K; ++k) {
          const int64_t e = mine.idx[size_t(t) * c.K + k];
          if (e < 0) continue;
          const int j = where[size_t(t) * c.K + k];
          const float y = bf2f(expert_value(int(e / E_loc), int(e % E_loc), j, h, c.seed));
          volatile float prod = mine.weights[size_t(t) * c.K + k] * y;
          want.add(prod);
        }
        if (!combine_close(got[size_t(t) * c.H + h], want, c.K))
          return fail(c, "combine out[" + std::to_string(t) + "," + std::to_string(h) +
                             "] = " + std::to_string(bf2f(got[size_t(t) * c.H + h])) +
                             ", expected " + std::to_string(want.exact) + " (sum of |w y| " +
                             std::to_string(want.magnitude) + ")");
      }
    }
    return true;
  }

  void sync_and_check_error(const Case& c, const char* where) {
    CUDA_OK(cudaStreamSynchronize(stream));
    const std::string err = rt->check_error();
    if (!err.empty()) {
      fail(c, std::string(where) + ": " + err);
      std::fflush(stdout);
      std::exit(1);  // a timeout leaves the runtime unusable
    }
  }

  // One case: dispatch (optionally hook), check, experts write y, combine, check.
  void run_case(const Case& c) {
    std::vector<Inputs> all;
    for (int r = 0; r < kRanks; ++r) all.push_back(make_inputs(c, r));
    const Inputs& mine = all[rank];
    upload(c, mine);
    if (c.stats) CUDA_OK(cudaMemset(buf.stats, 0, kMaxE * 4));
    ep::NvshmemDispatchArgs da = dispatch_args(c, mine);
    int b;
    if (c.hook) {
      da.phases = ep::nvshmem::kPhaseSend;
      b = rt->dispatch(da, stream);
      sync_and_check_error(c, "dispatch send");  // the "compute" in between
      da.phases = ep::nvshmem::kPhaseRecv;
      da.buffer_index = b;
      rt->dispatch(da, stream);
    } else {
      b = rt->dispatch(da, stream);
    }
    sync_and_check_error(c, "dispatch");
    bool ok = check_dispatch(c, all);
    if (ok && c.stats) {
      std::vector<int> st(c.E / kRanks), cnt(c.E / kRanks);
      CUDA_OK(cudaMemcpy(st.data(), buf.stats, st.size() * 4, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(cnt.data(), buf.recv_count, cnt.size() * 4, cudaMemcpyDeviceToHost));
      if (st != cnt) ok = fail(c, "cumulative stats differ from recv_count");
    }
    const std::vector<uint16_t> y = make_y(c);
    ep::NvshmemCombineArgs ca = combine_args(c, mine, b);
    if (c.zero_copy) {
      const ep::NvshmemBufferView v = rt->combine_buffer(b, c.E, c.H);
      CUDA_OK(cudaMemcpy(v.ptr, y.data(), y.size() * 2, cudaMemcpyHostToDevice));
      ca.zero_copy = true;
      ca.x = nullptr;
    } else {
      CUDA_OK(cudaMemcpy(buf.y, y.data(), y.size() * 2, cudaMemcpyHostToDevice));
    }
    if (c.hook) {
      ca.phases = ep::nvshmem::kPhaseSend;
      rt->combine(ca, stream);
      sync_and_check_error(c, "combine send");
      ca.phases = ep::nvshmem::kPhaseRecv;
      rt->combine(ca, stream);
    } else {
      rt->combine(ca, stream);
    }
    sync_and_check_error(c, "combine");
    if (ok) ok = check_combine(c, all);
    rt->barrier();
    if (ok && rank == 0) {
      std::printf("ok  %-44s H=%-5d K=%-2d E=%-3d T=%d/%d\n", c.name.c_str(), c.H, c.K, c.E, c.T,
                  c.T1);
      std::fflush(stdout);
    }
  }

  // Two dispatches in a row (buffers 0 and 1), then both combines. With `hooks`, the
  // two-micro-batch pattern: SEND 1, SEND 2, RECV 1, RECV 2, then combine SEND 1, SEND 2,
  // RECV 1, RECV 2 (two calls in flight, one per buffer).
  void run_consecutive(Case c1, Case c2, bool hooks) {
    std::vector<Inputs> a1, a2;
    for (int r = 0; r < kRanks; ++r) a1.push_back(make_inputs(c1, r));
    for (int r = 0; r < kRanks; ++r) a2.push_back(make_inputs(c2, r));
    const int send = hooks ? ep::nvshmem::kPhaseSend : ep::nvshmem::kPhaseBoth;
    // The routing of call 1 is kept on the host: the harness has one set of device buffers.
    upload(c1, a1[rank]);
    ep::NvshmemDispatchArgs d1 = dispatch_args(c1, a1[rank]);
    d1.phases = send;
    const int b1 = rt->dispatch(d1, stream);
    sync_and_check_error(c1, "dispatch 1");
    upload(c2, a2[rank]);
    ep::NvshmemDispatchArgs d2 = dispatch_args(c2, a2[rank]);
    d2.phases = send;
    int b2 = b1;
    bool ok = true;
    std::vector<int64_t> range1(kMaxE * kRanks), range2(kMaxE * kRanks);
    if (hooks) {
      b2 = rt->dispatch(d2, stream);
      sync_and_check_error(c2, "dispatch 2 send");
      d1.phases = ep::nvshmem::kPhaseRecv;
      d1.buffer_index = b1;
      rt->dispatch(d1, stream);
      sync_and_check_error(c1, "dispatch 1 recv");
    }
    ok = check_dispatch(c1, a1);
    copy(range1.data(), buf.layout_range, range1.size() * 8, cudaMemcpyDeviceToHost);
    if (hooks) {
      d2.phases = ep::nvshmem::kPhaseRecv;
      d2.buffer_index = b2;
      rt->dispatch(d2, stream);
    } else {
      b2 = rt->dispatch(d2, stream);
    }
    sync_and_check_error(c2, "dispatch 2");
    if (b1 == b2) ok = fail(c2, "consecutive dispatches used the same buffer");
    if (ok) ok = check_dispatch(c2, a2);
    copy(range2.data(), buf.layout_range, range2.size() * 8, cudaMemcpyDeviceToHost);
    const std::vector<uint16_t> y1 = make_y(c1), y2 = make_y(c2);
    auto combine = [&](const Case& c, const std::vector<Inputs>& all, int b, int phases,
                       const std::vector<int64_t>& range, const std::vector<uint16_t>& y) {
      upload(c, all[rank]);  // idx and weights of this call
      copy(buf.layout_range, range.data(), range.size() * 8, cudaMemcpyHostToDevice);
      copy(buf.y, y.data(), y.size() * 2, cudaMemcpyHostToDevice);
      ep::NvshmemCombineArgs ca = combine_args(c, all[rank], b);
      ca.phases = phases;
      rt->combine(ca, stream);
      sync_and_check_error(c, phases == ep::nvshmem::kPhaseSend ? "combine send" : "combine");
    };
    if (hooks) {
      combine(c1, a1, b1, ep::nvshmem::kPhaseSend, range1, y1);
      combine(c2, a2, b2, ep::nvshmem::kPhaseSend, range2, y2);
      combine(c1, a1, b1, ep::nvshmem::kPhaseRecv, range1, y1);
      if (ok) ok = check_combine(c1, a1);
      combine(c2, a2, b2, ep::nvshmem::kPhaseRecv, range2, y2);
      if (ok) ok = check_combine(c2, a2);
    } else {
      combine(c1, a1, b1, ep::nvshmem::kPhaseBoth, range1, y1);
      if (ok) ok = check_combine(c1, a1);
      combine(c2, a2, b2, ep::nvshmem::kPhaseBoth, range2, y2);
      if (ok) ok = check_combine(c2, a2);
    }
    rt->barrier();
    if (ok && rank == 0)
      std::printf("ok  two consecutive dispatches, then both combines%s\n",
                  hooks ? " (hooks: two calls in flight)" : "");
  }

  // Input sets of the soaks and, per set, this rank's expected combine output for y = recv_x
  // (BF16): out[t] ~ sum_k w_k * x[t] (combine_close). In set 3 rank 0 routes nothing to rank 1, so
  // rank 1 sends rank 0 no combine rows (the case the combine handshake unit exists for).
  struct SoakSets {
    Case c;
    std::vector<std::vector<Inputs>> inputs;
    std::vector<std::vector<CombineTerm>> want;
    std::vector<std::vector<uint16_t>> first;  // the first result of each set: later ones equal it
    // Checks `got` (this rank's output for set s) and that it is bitwise the set's first result.
    std::string check(int s, const std::vector<uint16_t>& got) {
      const auto& want_s = want[s];
      for (size_t i = 0; i < want_s.size(); ++i)
        if (!combine_close(got[i], want_s[i], c.K))
          return "out[" + std::to_string(i / c.H) + "," + std::to_string(i % c.H) +
                 "] = " + std::to_string(bf2f(got[i])) + ", expected " +
                 std::to_string(want_s[i].exact);
      if (first[s].empty()) {
        first[s].assign(got.begin(), got.begin() + want_s.size());
      } else if (std::memcmp(first[s].data(), got.data(), want_s.size() * 2) != 0) {
        return "not bitwise identical to the first run of the same inputs";
      }
      return "";
    }
  };
  SoakSets soak_sets(const char* name, int T0, int T1) const {
    SoakSets ss;
    Case& c = ss.c;
    c.name = name;
    c.H = 7168;
    c.K = 8;
    c.E = 16;
    c.T = T0;
    c.T1 = T1;
    const int sets = 4;
    ss.inputs.resize(sets);
    ss.want.resize(sets);
    ss.first.resize(sets);
    for (int s = 0; s < sets; ++s) {
      c.seed = 1000 + s;
      for (int r = 0; r < kRanks; ++r) ss.inputs[s].push_back(make_inputs(c, r));
      if (s == 3)
        for (auto& e : ss.inputs[s][0].idx)
          if (e >= c.E / kRanks) e = -1;
      const Inputs& in = ss.inputs[s][rank];
      ss.want[s].resize(size_t(in.T) * c.H);
      for (int t = 0; t < in.T; ++t)
        for (int h = 0; h < c.H; ++h) {
          CombineTerm& want = ss.want[s][size_t(t) * c.H + h];
          for (int k = 0; k < c.K; ++k) {
            if (in.idx[size_t(t) * c.K + k] < 0) continue;
            volatile float prod = in.weights[size_t(t) * c.K + k] * bf2f(in.x[size_t(t) * c.H + h]);
            want.add(prod);
          }
        }
    }
    return ss;
  }

  // Round trips with y = recv_x (BF16): out must equal the reference of sum_k w_k * x[t].
  void soak(int iterations) {
    SoakSets ss = soak_sets("soak", kM, kM);
    Case& c = ss.c;
    const int sets = static_cast<int>(ss.inputs.size());
    std::vector<uint16_t> got(size_t(kM) * c.H);
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iterations; ++i) {
      const int s = i % sets;
      c.seed = 1000 + s;
      const Inputs& in = ss.inputs[s][rank];
      upload(c, in);
      ep::NvshmemDispatchArgs da = dispatch_args(c, in);
      const int b = rt->dispatch(da, stream);
      ep::NvshmemCombineArgs ca = combine_args(c, in, b);
      ca.x = buf.recv_x;
      rt->combine(ca, stream);
      sync_and_check_error(c, "soak");
      copy(got.data(), buf.out, size_t(in.T) * c.H * 2, cudaMemcpyDeviceToHost);
      const std::string bad = ss.check(s, got);
      if (!bad.empty()) {
        fail(c, "iteration " + std::to_string(i) + ": combined " + bad);
        return;
      }
    }
    rt->barrier();
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (rank == 0)
      std::printf("ok  soak: %d dispatch+combine round trips (T=128 H=7168 K=8 E=16), %.1f s\n",
                  iterations, secs);
  }

  // CUDA graph: one dispatch + combine pair captured once, so its buffer index is frozen and
  // every replay reuses ONE buffer; the ranks are not kept in step between replays. Inputs
  // change between replays (same device pointers) and every replay is checked. Rank 1 has
  // fewer tokens than rank 0 (T differs per rank, fixed in the graph).
  void graph_soak(int iterations) {
    SoakSets ss = soak_sets("graph replay", kM, 96);
    Case& c = ss.c;
    const int before = failures;
    const int sets = static_cast<int>(ss.inputs.size());
    upload(c, ss.inputs[0][rank]);
    CUDA_OK(cudaStreamSynchronize(stream));
    const Inputs& in0 = ss.inputs[0][rank];
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    const int b = rt->dispatch(dispatch_args(c, in0), stream);
    ep::NvshmemCombineArgs ca = combine_args(c, in0, b);
    ca.x = buf.recv_x;
    rt->combine(ca, stream);
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    std::vector<uint16_t> got(size_t(kM) * c.H);
    for (int i = 0; i < iterations; ++i) {
      const int s = i % sets;
      const Inputs& in = ss.inputs[s][rank];
      upload(c, in);  // legacy-stream copies; `stream` is blocking, so they are ordered with it
      CUDA_OK(cudaGraphLaunch(exec, stream));
      sync_and_check_error(c, "graph replay");
      copy(got.data(), buf.out, size_t(in.T) * c.H * 2, cudaMemcpyDeviceToHost);
      const std::string bad = ss.check(s, got);
      if (!bad.empty()) {
        fail(c, "replay " + std::to_string(i) + " (buffer " + std::to_string(b) + "): combined " +
                    bad);
        break;
      }
    }
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    rt->barrier();
    if (rank == 0 && failures == before)
      std::printf("ok  graph: %d replays of one captured dispatch+combine (one buffer)\n",
                  iterations);
  }

  // Median time of `n` calls after warm-up (CUDA events around each call).
  template <typename F>
  double median_us(int n, F call) {
    cudaEvent_t a, b;
    CUDA_OK(cudaEventCreate(&a));
    CUDA_OK(cudaEventCreate(&b));
    std::vector<float> ms;
    for (int i = 0; i < n + 20; ++i) {
      CUDA_OK(cudaEventRecord(a, stream));
      call();
      CUDA_OK(cudaEventRecord(b, stream));
      CUDA_OK(cudaEventSynchronize(b));
      float t = 0;
      CUDA_OK(cudaEventElapsedTime(&t, a, b));
      if (i >= 20) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2] * 1000.0;
  }

  // Per-call time of `calls` calls captured back to back in one CUDA graph (median of 11 replays;
  // ranks start each replay together after a host barrier).
  template <typename F>
  double graph_us(int calls, F body) {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < calls; ++i) body();
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t a, b;
    CUDA_OK(cudaEventCreate(&a));
    CUDA_OK(cudaEventCreate(&b));
    std::vector<float> ms;
    for (int r = 0; r < 14; ++r) {
      rt->barrier();
      CUDA_OK(cudaEventRecord(a, stream));
      CUDA_OK(cudaGraphLaunch(exec, stream));
      CUDA_OK(cudaEventRecord(b, stream));
      CUDA_OK(cudaEventSynchronize(b));
      float t = 0;
      CUDA_OK(cudaEventElapsedTime(&t, a, b));
      if (r >= 3) ms.push_back(t);
    }
    CUDA_OK(cudaEventDestroy(a));
    CUDA_OK(cudaEventDestroy(b));
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2] * 1000.0 / calls;
  }

  void bench() {
    for (int mode : {kBf16, kFp8}) {
      Case c;
      c.name = "bench";
      c.mode = mode;
      c.H = 7168;
      c.K = 8;
      c.E = 16;
      c.T = c.T1 = kM;
      std::vector<Inputs> all;
      for (int r = 0; r < kRanks; ++r) all.push_back(make_inputs(c, r));
      upload(c, all[rank]);
      ep::NvshmemDispatchArgs da = dispatch_args(c, all[rank]);
      int b = 0;
      // Dispatch alone may repeat (each dispatch waits for every rank); combine is timed inside
      // dispatch/combine pairs, events around the combine only.
      const double dd_us = median_us(200, [&] { b = rt->dispatch(da, stream); });
      const std::vector<uint16_t> y = make_y(c);
      CUDA_OK(cudaMemcpy(buf.y, y.data(), y.size() * 2, cudaMemcpyHostToDevice));
      ep::NvshmemCombineArgs ca = combine_args(c, all[rank], b);
      cudaEvent_t e0, e1;
      CUDA_OK(cudaEventCreate(&e0));
      CUDA_OK(cudaEventCreate(&e1));
      std::vector<float> cms;
      for (int i = 0; i < 220; ++i) {
        ca.buffer_index = rt->dispatch(da, stream);
        CUDA_OK(cudaEventRecord(e0, stream));
        rt->combine(ca, stream);
        CUDA_OK(cudaEventRecord(e1, stream));
        CUDA_OK(cudaEventSynchronize(e1));
        float ms = 0;
        CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 20) cms.push_back(ms);
      }
      std::sort(cms.begin(), cms.end());
      const double c_us = cms[cms.size() / 2] * 1000.0;
      sync_and_check_error(c, "bench");
      // Bytes: rows received by this rank x message bytes.
      std::vector<int> cnt(c.E / kRanks);
      CUDA_OK(cudaMemcpy(cnt.data(), buf.recv_count, cnt.size() * 4, cudaMemcpyDeviceToHost));
      long rows = 0;
      for (int v : cnt) rows += v;
      const double row_bytes = mode == kBf16 ? c.H * 2.0 : c.H + c.H / 128 * 4.0;
      // Launched one by one, each call's time includes this VM's host launch gap (~20 us).
      // Captured back to back in a CUDA graph, the GPU never idles: that is the kernels' time.
      const int calls = 32;  // even: the buffers alternate and the graph replays from buffer 0
      const double gd_us = graph_us(calls, [&] {
        da.buffer_index = -1;
        rt->dispatch(da, stream);
      });
      const double gp_us = graph_us(calls, [&] {
        da.buffer_index = -1;
        ca.buffer_index = rt->dispatch(da, stream);
        rt->combine(ca, stream);
      });
      sync_and_check_error(c, "bench (graphs)");
      rt->barrier();
      if (rank == 0)
        std::printf(
            "bench %s T=128 H=7168 top-8 of 16 experts: dispatch %.1f us (%.1f GB/s logical), "
            "combine (BF16) %.1f us, medians of 200 calls launched one by one\n"
            "bench %s graph of %d calls: dispatch %.1f us, dispatch+combine %.1f us, "
            "combine (difference) %.1f us per call\n",
            mode_name(mode), dd_us, rows * row_bytes / dd_us / 1e3, c_us, mode_name(mode), calls,
            gd_us, gp_us, gp_us - gd_us);
    }
  }
};

// Rank 0 publishes the unique id (write + rename); rank 1 polls for it.
std::vector<uint8_t> exchange_uid(int rank, const std::string& path, const ep::NvshmemConfig& cfg) {
  if (rank == 0) {
    std::vector<uint8_t> uid = ep::NvshmemRuntime::unique_id(cfg);
    const std::string tmp = path + ".tmp";
    {
      std::ofstream f(tmp, std::ios::binary);
      f.write(reinterpret_cast<const char*>(uid.data()), std::streamsize(uid.size()));
    }
    std::rename(tmp.c_str(), path.c_str());
    return uid;
  }
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    std::ifstream f(path, std::ios::binary);
    if (f) {
      std::vector<uint8_t> uid(128);
      f.read(reinterpret_cast<char*>(uid.data()), 128);
      if (f.gcount() == 128) return uid;
    }
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(120)) {
      std::fprintf(stderr, "rank %d: no unique id at %s\n", rank, path.c_str());
      std::exit(2);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

struct Options {
  bool timeout_test = false;
  bool p2p = true;
  bool quick = false;
  bool bench = true;
  bool bench_only = false;  // latency only (trying kernel variants): no correctness cases
  bool recreate = true;
  int soak = 2000;
  int graph = 400;
};

int run_rank(int rank, const Options& opt, const std::string& tag) {
  int devices = 0;
  CUDA_OK(cudaGetDeviceCount(&devices));
  const int device = rank % std::max(devices, 1);
  CUDA_OK(cudaSetDevice(device));
  ep::NvshmemConfig cfg;
  cfg.max_tokens_per_rank = kM;
  cfg.max_hidden = kMaxH;
  cfg.max_topk = kMaxK;
  cfg.num_experts = kMaxE;
  cfg.num_ranks = kRanks;
  cfg.p2p_fast_path = opt.p2p;
  cfg.timeout_seconds = opt.timeout_test ? 3.0 : 60.0;
  std::vector<uint8_t> uid = exchange_uid(rank, "/tmp/ep_nvshmem_uid_" + tag + "_a", cfg);
  Harness hx;
  hx.rank = rank;
  ep::NvshmemRuntime::start_session(rank, kRanks, device, uid, cfg);  // once per process
  hx.rt = new ep::NvshmemRuntime(rank, kRanks, device, cfg);
  // Both ranks made their part (a failure ends the process): the symmetric region, then the
  // barrier the product takes through the store before any rank signals into a peer's region.
  hx.rt->connect();
  hx.rt->barrier();
  // A blocking stream: the harness's cudaMemcpy calls (legacy stream) are ordered with it.
  CUDA_OK(cudaStreamCreate(&hx.stream));
  hx.buf.alloc();
  if (rank == 0)
    std::printf("rank 0: device %d, peer 1 %s\n", device,
                hx.rt->peer_is_p2p(1) ? "P2P (nvshmem_ptr fast path)" : "via NVSHMEM puts");

  if (opt.timeout_test) {
    Case c;
    c.name = "timeout";
    const std::vector<Inputs> all = {make_inputs(c, 0), make_inputs(c, 1)};
    int rc = 0;
    if (rank == 0) {
      hx.upload(c, all[0]);
      const auto start = std::chrono::steady_clock::now();
      hx.rt->dispatch(hx.dispatch_args(c, all[0]), hx.stream);  // rank 1 skips this call
      CUDA_OK(cudaStreamSynchronize(hx.stream));
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const std::string err = hx.rt->check_error();
      const bool ok = err.find("ep low_latency_dispatch: rank 0 timed out") == 0 &&
                      err.find("waiting for rank 1") != std::string::npos && hx.rt->failed();
      std::printf("%s timeout test: \"%s\" after %.1f s\n", ok ? "ok " : "FAIL", err.c_str(), s);
      rc = ok ? 0 : 1;
    }
    hx.rt->destroy();
    delete hx.rt;
    return rc;
  }

  std::vector<Case> cases;
  uint64_t seed = 1;
  const int Ts[] = {0, 1, 77, kM};
  const int Hs[] = {128, 2048, 7168, 8192};
  const int Ks[] = {1, 8, 32};
  for (int mode : {kBf16, kFp8, kFp8Round, kFp8Ue8m0}) {
    for (int H : Hs) {
      if (mode == kFp8Ue8m0 && H % 512 != 0) continue;
      for (int K : Ks) {
        for (int T : Ts) {
          const bool full = mode <= kFp8 || (K == 8 && (T == 77 || T == kM));
          if (!full || (opt.quick && !(H == 7168 && K == 8))) continue;
          Case c;
          c.mode = mode;
          c.H = H;
          c.K = K;
          c.E = K == 32 ? 64 : 16;
          c.T = T;
          c.T1 = T == kM ? kM : (T * 3) / 4;
          c.seed = seed++;
          c.name = std::string(mode_name(mode));
          cases.push_back(c);
        }
      }
    }
  }
  auto special = [&](const char* name, auto tweak) {
    Case c;
    c.mode = kFp8;
    c.name = name;
    c.seed = seed++;
    tweak(c);
    cases.push_back(c);
  };
  special("hook mode (send, recv later; both ops)", [](Case& c) { c.hook = true; });
  special("hook mode bf16", [](Case& c) {
    c.hook = true;
    c.mode = kBf16;
  });
  special("zero-copy combine", [](Case& c) { c.zero_copy = true; });
  special("zero-copy combine + hook", [](Case& c) {
    c.zero_copy = true;
    c.hook = true;
  });
  special("unweighted combine (weights null)", [](Case& c) { c.weighted = false; });
  special("int32 topk_idx", [](Case& c) { c.idx32 = true; });
  special("repeated experts in a row", [](Case& c) { c.dup = true; });
  special("cumulative recv stats", [](Case& c) { c.stats = true; });
  special("rank 1 has no tokens", [](Case& c) { c.T1 = 0; });
  special("rank 0 has no tokens", [](Case& c) {
    c.T = 0;
    c.T1 = 50;
  });

  if (opt.bench_only) cases.clear();
  for (const Case& c : cases) hx.run_case(c);
  if (!opt.bench_only) {
    Case c1, c2;
    c1.name = "consecutive 1";
    c1.seed = 900;
    c2.name = "consecutive 2";
    c2.seed = 901;
    c2.mode = kFp8;
    c2.T = 100;
    c2.T1 = 60;
    hx.run_consecutive(c1, c2, false);
    c1.name = "consecutive hooks 1";
    c1.seed = 902;
    c2.name = "consecutive hooks 2";
    c2.seed = 903;
    hx.run_consecutive(c1, c2, true);
  }
  if (opt.soak > 0 && !opt.bench_only) hx.soak(opt.soak);
  if (opt.graph > 0 && !opt.bench_only) hx.graph_soak(opt.graph);
  if (opt.bench) hx.bench();
  const std::string err = hx.rt->check_error();
  if (!err.empty()) {
    std::printf("[rank %d] FAIL error record: %s\n", rank, err.c_str());
    ++hx.failures;
  }
  hx.rt->destroy();
  delete hx.rt;
  if (opt.recreate) {
    // Buffers freed, the session kept: new buffers of another size in the same session must
    // work (NVSHMEM is never re-initialised in a process).
    cfg.max_hidden = 2048;
    hx.rt = new ep::NvshmemRuntime(rank, kRanks, device, cfg);
    hx.rt->connect();
    hx.rt->barrier();
    Case c;
    c.name = "after destroy + re-creation";
    c.mode = kFp8;
    c.H = 2048;
    c.seed = 4242;
    const int before = hx.failures;
    hx.run_case(c);
    if (hx.failures != before && rank == 0) std::printf("FAIL re-creation\n");
    hx.rt->destroy();
    delete hx.rt;
  }
  std::fflush(stdout);
  return hx.failures == 0 ? 0 : 1;
}

}  // namespace

// CPU self-check hook (no GPU needed): writes a random BF16 row block and its quantisation in
// every FP8 mode to `path`, for comparison with ep_backend.reference.quantize_fp8_per128.
int cpu_dump(const std::string& path) {
  Case c;
  c.H = 2048;
  c.T = c.T1 = 64;
  c.seed = 77;
  const Inputs in = make_inputs(c, 0);
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(in.x.data()), std::streamsize(in.x.size() * 2));
  std::vector<uint8_t> q(c.H);
  std::vector<uint32_t> w;
  for (int mode : {kFp8, kFp8Round, kFp8Ue8m0}) {
    for (int t = 0; t < in.T; ++t) {
      quantize_row(in.x.data() + size_t(t) * c.H, c.H, mode, q.data(), w);
      f.write(reinterpret_cast<const char*>(q.data()), c.H);
      f.write(reinterpret_cast<const char*>(w.data()), std::streamsize(w.size() * 4));
    }
  }
  return 0;
}

// A rank that dies (crash, exit on a failed check) would leave the other one blocked forever in
// an NVSHMEM host barrier, which has no timeout. Rank 1 gets SIGKILL when rank 0 dies
// (PR_SET_PDEATHSIG); in rank 0 a watchdog thread waits for rank 1 and ends the process when
// rank 1 dies with a failure. A thread, not a SIGCHLD handler: a signal could interrupt a poll()
// inside NVSHMEM's socket bootstrap with EINTR.
std::atomic<int> g_child_status{-1};

void watch_child(pid_t child) {
  int st = 0;
  while (waitpid(child, &st, 0) < 0 && errno == EINTR) {
  }
  if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
    std::fprintf(stderr, "[rank 0] rank 1 died or failed (status %d); stopping rank 0\n", st);
    std::fflush(stdout);
    std::_Exit(1);
  }
  g_child_status.store(st);
}

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--cpu-dump" && i + 1 < argc) return cpu_dump(argv[i + 1]);
    if (a == "--timeout-test") {
      opt.timeout_test = true;
    } else if (a == "--no-p2p") {
      opt.p2p = false;
    } else if (a == "--quick") {
      opt.quick = true;
      opt.soak = 200;
      opt.graph = 100;
    } else if (a == "--no-bench") {
      opt.bench = false;
    } else if (a == "--bench-only") {
      opt.bench_only = true;
      opt.recreate = false;
    } else if (a == "--no-recreate") {
      opt.recreate = false;
    } else if (a == "--soak" && i + 1 < argc) {
      opt.soak = std::atoi(argv[++i]);
    } else if (a == "--graph" && i + 1 < argc) {
      opt.graph = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: %s [--timeout-test] [--no-p2p] [--quick] [--no-bench] [--bench-only] "
                   "[--no-recreate] "
                   "[--soak N] [--graph N]\n",
                   argv[0]);
      return 2;
    }
  }
  // Fork before any CUDA call: one process per rank.
  const std::string tag = std::to_string(getpid());
  std::fflush(stdout);
  const pid_t child = fork();
  if (child < 0) {
    std::perror("fork");
    return 2;
  }
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() == 1) std::_Exit(1);  // the parent is already gone
    int crc = 1;
    try {
      crc = run_rank(1, opt, tag);
    } catch (const std::exception& e) {
      std::printf("[rank 1] FAIL exception: %s\n", e.what());
    }
    std::fflush(stdout);
    std::_Exit(crc);
  }
  std::thread watchdog(watch_child, child);
  int rc = 2;
  try {
    rc = run_rank(0, opt, tag);
  } catch (const std::exception& e) {
    std::printf("[rank 0] FAIL exception: %s\n", e.what());
    std::fflush(stdout);
    kill(child, SIGKILL);  // it may be blocked in a collective rank 0 will never join
    rc = 1;                // (the watchdog then ends this process)
  }
  watchdog.join();
  const int status = g_child_status.load();
  const int child_rc = WIFEXITED(status) ? WEXITSTATUS(status) : 3;
  std::remove(("/tmp/ep_nvshmem_uid_" + tag + "_a").c_str());
  std::remove(("/tmp/ep_nvshmem_uid_" + tag + "_b").c_str());
  if (rc == 0 && child_rc == 0) {
    std::printf(opt.timeout_test ? "TIMEOUT TEST PASSED\n" : "ALL PASSED\n");
    return 0;
  }
  std::printf("FAILED (rank 0 exit %d, rank 1 exit %d)\n", rc, child_rc);
  return 1;
}
