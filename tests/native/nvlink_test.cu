// Standalone harness of the nvlink runtime: one process drives R ranks (one host thread per
// rank; ranks map round-robin onto the visible GPUs, so R = 4 or 8 also runs on 2 GPUs), checks
// every output bitwise against a CPU reference of the spec, then times dispatch/combine.
//
//   nvlink_test [--no-bench] [--bench-only] [--soak N] [--no-ipc]
//
// The bench needs 2 GPUs; HT_BENCH_ONE_GPU=1 runs it with both ranks on one (their peer writes
// then land in the same HBM: a same-session A/B of kernel variants, not an NVLink figure).
// Exit status 0 iff every check passed. The last line is the summary.
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "transports/nvlink/cuda/nvlink_device.cuh"
#include "transports/nvlink/cuda/nvlink_runtime.hpp"
#include "transports/nvlink/cuda/nvlink_timeline.hpp"

using ep::NvlinkCombineArgs;
using ep::NvlinkConfig;
using ep::NvlinkDispatchArgs;
using ep::NvlinkRuntime;

#define CUDA_CHECK(expr)                                                                   \
  do {                                                                                     \
    cudaError_t _e = (expr);                                                               \
    if (_e != cudaSuccess)                                                                 \
      throw std::runtime_error(std::string(#expr) + ": " + cudaGetErrorString(_e) + " @" + \
                               std::to_string(__LINE__));                                  \
  } while (0)

namespace {

// ------------------------------------------------------------------------------------------
// Bookkeeping
// ------------------------------------------------------------------------------------------

std::atomic<int> g_checks{0};
std::atomic<int> g_failures{0};
std::mutex g_print_mutex;

void fail(const std::string& what) {
  std::lock_guard<std::mutex> lock(g_print_mutex);
  ++g_failures;
  if (g_failures <= 40) std::printf("FAIL: %s\n", what.c_str());
}

template <typename T>
void check_equal(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  ++g_checks;
  if (got.size() != want.size()) {
    fail(what + ": size " + std::to_string(got.size()) + " != " + std::to_string(want.size()));
    return;
  }
  if (got.empty() || std::memcmp(got.data(), want.data(), got.size() * sizeof(T)) == 0) return;
  const uint8_t* a = reinterpret_cast<const uint8_t*>(got.data());
  const uint8_t* b = reinterpret_cast<const uint8_t*>(want.data());
  size_t i = 0;
  while (a[i] == b[i]) ++i;
  fail(what + ": first differing byte " + std::to_string(i) + " (element " +
       std::to_string(i / sizeof(T)) + "): got " + std::to_string(a[i]) + " want " +
       std::to_string(b[i]));
}

void check_true(bool ok, const std::string& what) {
  ++g_checks;
  if (!ok) fail(what);
}

// Runs fn(rank) on one thread per rank; rethrows the first exception.
void run_ranks(int R, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(R);
  for (int r = 0; r < R; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

float bf16_to_float(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE half, round to nearest even as cvt.rn.f16.f32 (subnormals kept, >= 65520 to infinity).
uint16_t float_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // 65520 and up round to infinity
  if (a >= 0x38800000u) {                       // normal: rebias the exponent, round 23 -> 10
    const uint32_t r = a - 0x38000000u;
    return sign | static_cast<uint16_t>((r + 0xFFFu + ((r >> 13) & 1u)) >> 13);
  }
  // Subnormal (or zero): units of 2^-24, rounded to nearest even (may become the least normal).
  return sign | static_cast<uint16_t>(std::nearbyint(std::fabs(double(f)) * 16777216.0));
}

float f16_to_float(uint16_t h) {
  const float sign = (h & 0x8000u) ? -1.0f : 1.0f;
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  if (e == 0) return sign * std::ldexp(float(m), -24);
  if (e == 31) return m ? std::nanf("") : sign * INFINITY;
  return sign * std::ldexp(float(1024 + m), e - 25);
}

// ------------------------------------------------------------------------------------------
// Cases, inputs and the CPU reference
// ------------------------------------------------------------------------------------------

struct CaseSpec {
  std::string name;
  int R = 2;
  std::vector<int> T;      // tokens per rank
  int hidden_bytes = 512;  // dispatch row bytes
  int S = 0;               // scales per row
  int K = 8;
  int E = 16;
  int idx_bytes = 8;
  bool weights = true;
  double p_none = 0.1;  // probability of a -1 entry
  int alignment = 1;
  int worst = 0;  // 0: normal mode; > 0: num_worst_tokens; -1: auto (max N + 7)
  ep::CombineElem comb = ep::CombineElem::kBFloat16;  // the combine's element type
  int comb_hidden = 256;                              // elements
  bool bias0 = false, bias1 = false;
  uint64_t seed = 1;
  bool expect_overflow = false;
  // Normal mode as the backend runs it: the dispatch is launched behind notify before the host
  // waits, and its outputs are this rank's receive slab 0, which the peers write in place.
  bool slab = false;
};

struct RankData {
  int T = 0;
  std::vector<uint8_t> x, x2;
  std::vector<float> scales, scales2, w;
  std::vector<int64_t> idx;            // stored as int64 always; uploaded per idx_bytes
  std::vector<uint8_t> idx_bytes_buf;  // as uploaded
  std::vector<uint8_t> bias0, bias1;   // [T, comb_hidden] of spec.comb
  // expected
  std::vector<int> per_rank, per_expert, send_pos;
  std::vector<uint8_t> in_rank;
  std::vector<int> recv_counts, recv_prefix, recv_per_expert;
  int N = 0, rows = 0;  // rows = N (normal) or num_worst_tokens
  std::vector<uint8_t> recv_x, recv_x2, recv_idx;
  std::vector<float> recv_scales, recv_scales2, recv_w;
  std::vector<int> src_idx, src_rank;
  std::vector<uint8_t> xc;              // combine input [rows, comb_hidden] of spec.comb
  std::vector<float> wc;                // [rows, K]
  std::vector<uint8_t> out, out_plain;  // combine with bias/weights, and plain
  std::vector<float> out_w;
};

struct CaseData {
  CaseSpec spec;
  int cap = 0;
  std::vector<RankData> r;
};

void fill_random_bytes(std::vector<uint8_t>& v, std::mt19937_64& rng) {
  for (size_t i = 0; i < v.size(); i += 8) {
    const uint64_t x = rng();
    std::memcpy(v.data() + i, &x, std::min<size_t>(8, v.size() - i));
  }
}

// Random finite values of type `type`, with some -0.0 and +0.0 to exercise the +0 start.
void fill_random_elems(std::vector<uint8_t>& v, ep::CombineElem type, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(-4.0, 4.0);
  const int elem = ep::combine_elem_bytes(type);
  const bool f16 = type == ep::CombineElem::kFloat16;
  const size_t n = v.size() / elem;
  for (size_t i = 0; i < n; ++i) {
    double d = u(rng);
    const uint64_t pick = rng() % 64;
    if (pick == 0) d = -0.0;
    if (pick == 1) d = 0.0;
    if (pick == 2) d *= f16 ? 1e-5 : 1e-30;  // tiny, exercises rounding/denormals
    if (pick == 3 && f16) d *= 16000.0;      // large: FP16 sums that overflow to infinity
    if (elem == 2 && f16) {
      const uint16_t b = float_to_f16(static_cast<float>(d));
      std::memcpy(v.data() + i * 2, &b, 2);
    } else if (elem == 2) {
      const uint16_t b = float_to_bf16(static_cast<float>(d));
      std::memcpy(v.data() + i * 2, &b, 2);
    } else if (elem == 4) {
      const float f = static_cast<float>(d);
      std::memcpy(v.data() + i * 4, &f, 4);
    } else {
      std::memcpy(v.data() + i * 8, &d, 8);
    }
  }
}

CaseData make_case(const CaseSpec& spec) {
  CaseData c;
  c.spec = spec;
  const int R = spec.R, K = spec.K, E = spec.E, E_loc = E / R, hb = spec.hidden_bytes, S = spec.S;
  std::mt19937_64 rng(spec.seed);
  c.r.resize(R);
  for (int s = 0; s < R; ++s) {
    RankData& d = c.r[s];
    d.T = spec.T[s];
    d.x.resize(size_t(d.T) * hb);
    d.x2.resize(size_t(d.T) * hb);
    fill_random_bytes(d.x, rng);
    fill_random_bytes(d.x2, rng);
    std::uniform_real_distribution<float> uf(-2.0f, 2.0f);
    d.scales.resize(size_t(d.T) * S);
    d.scales2.resize(size_t(d.T) * S);
    for (auto& v : d.scales) v = uf(rng);
    for (auto& v : d.scales2) v = uf(rng);
    d.w.resize(size_t(d.T) * K);
    for (auto& v : d.w) v = uf(rng);
    d.idx.assign(size_t(d.T) * K, -1);
    std::vector<int> perm(E);
    std::iota(perm.begin(), perm.end(), 0);
    std::uniform_real_distribution<double> u01(0, 1);
    for (int t = 0; t < d.T; ++t) {
      for (int k = 0; k < K; ++k) std::swap(perm[k], perm[k + rng() % (E - k)]);
      for (int k = 0; k < K; ++k) d.idx[size_t(t) * K + k] = u01(rng) < spec.p_none ? -1 : perm[k];
    }
    d.idx_bytes_buf.resize(size_t(d.T) * K * spec.idx_bytes);
    for (size_t i = 0; i < d.idx.size(); ++i) {
      if (spec.idx_bytes == 8) {
        std::memcpy(d.idx_bytes_buf.data() + i * 8, &d.idx[i], 8);
      } else {
        const int32_t v = static_cast<int32_t>(d.idx[i]);
        std::memcpy(d.idx_bytes_buf.data() + i * 4, &v, 4);
      }
    }
    const size_t chb = size_t(spec.comb_hidden) * ep::combine_elem_bytes(spec.comb);
    if (spec.bias0) {
      d.bias0.resize(size_t(d.T) * chb);
      fill_random_elems(d.bias0, spec.comb, rng);
    }
    if (spec.bias1) {
      d.bias1.resize(size_t(d.T) * chb);
      fill_random_elems(d.bias1, spec.comb, rng);
    }
    // layout
    d.per_rank.assign(R, 0);
    d.per_expert.assign(E, 0);
    d.in_rank.assign(size_t(d.T) * R, 0);
    d.send_pos.assign(size_t(d.T) * R, -1);
    for (int t = 0; t < d.T; ++t) {
      for (int k = 0; k < K; ++k) {
        const int64_t e = d.idx[size_t(t) * K + k];
        if (e < 0) continue;
        d.per_expert[e]++;
        d.in_rank[size_t(t) * R + e / E_loc] = 1;
      }
      for (int r = 0; r < R; ++r)
        if (d.in_rank[size_t(t) * R + r]) d.send_pos[size_t(t) * R + r] = d.per_rank[r]++;
    }
  }
  // receive side
  int max_n = 0;
  for (int me = 0; me < R; ++me) {
    RankData& d = c.r[me];
    d.recv_counts.assign(R, 0);
    d.recv_prefix.assign(R + 1, 0);
    for (int s = 0; s < R; ++s) {
      d.recv_counts[s] = c.r[s].per_rank[me];
      d.recv_prefix[s + 1] = d.recv_prefix[s] + d.recv_counts[s];
    }
    d.N = d.recv_prefix[R];
    max_n = std::max(max_n, d.N);
    d.recv_per_expert.assign(E_loc, 0);
    for (int s = 0; s < R; ++s)
      for (int e = 0; e < E_loc; ++e) d.recv_per_expert[e] += c.r[s].per_expert[me * E_loc + e];
    for (auto& v : d.recv_per_expert)
      v = (v + spec.alignment - 1) / spec.alignment * spec.alignment;
  }
  c.cap = spec.worst > 0 ? spec.worst : (spec.worst < 0 ? max_n + 7 : 0);
  for (int me = 0; me < R; ++me) {
    RankData& d = c.r[me];
    d.rows = c.cap > 0 ? c.cap : d.N;
    const int rows = d.rows;
    d.recv_x.assign(size_t(rows) * hb, 0);
    d.recv_x2.assign(size_t(rows) * hb, 0);
    d.recv_scales.assign(size_t(rows) * S, 0.0f);
    d.recv_scales2.assign(size_t(rows) * S, 0.0f);
    d.recv_idx.assign(size_t(rows) * K * spec.idx_bytes, 0xFF);  // -1 padding
    d.recv_w.assign(size_t(rows) * K, 0.0f);
    d.src_idx.assign(rows, -1);
    d.src_rank.assign(rows, -1);
    int row = 0;
    for (int s = 0; s < R; ++s) {
      const RankData& src = c.r[s];
      for (int t = 0; t < src.T; ++t) {
        if (!src.in_rank[size_t(t) * R + me]) continue;
        if (row < rows) {
          std::memcpy(&d.recv_x[size_t(row) * hb], &src.x[size_t(t) * hb], hb);
          std::memcpy(&d.recv_x2[size_t(row) * hb], &src.x2[size_t(t) * hb], hb);
          for (int j = 0; j < S; ++j) {
            d.recv_scales[size_t(row) * S + j] = src.scales[size_t(t) * S + j];
            d.recv_scales2[size_t(row) * S + j] = src.scales2[size_t(t) * S + j];
          }
          for (int k = 0; k < K; ++k) {
            const int64_t e = src.idx[size_t(t) * K + k];
            const int64_t local = (e >= 0 && e / E_loc == me) ? e - int64_t(me) * E_loc : -1;
            if (spec.idx_bytes == 8) {
              std::memcpy(&d.recv_idx[(size_t(row) * K + k) * 8], &local, 8);
            } else {
              const int32_t l32 = static_cast<int32_t>(local);
              std::memcpy(&d.recv_idx[(size_t(row) * K + k) * 4], &l32, 4);
            }
            d.recv_w[size_t(row) * K + k] =
                local >= 0 && spec.weights ? src.w[size_t(t) * K + k] : 0.0f;
          }
          d.src_idx[row] = t;
          d.src_rank[row] = s;
        }
        ++row;
      }
    }
    // combine input
    const size_t chb = size_t(spec.comb_hidden) * ep::combine_elem_bytes(spec.comb);
    d.xc.resize(size_t(rows) * chb);
    fill_random_elems(d.xc, spec.comb, rng);
    d.wc.resize(size_t(rows) * K);
    std::uniform_real_distribution<float> uf(-1.0f, 1.0f);
    for (auto& v : d.wc) v = uf(rng);
  }
  // combine expectations
  const int H = spec.comb_hidden, el = ep::combine_elem_bytes(spec.comb);
  const bool f16 = spec.comb == ep::CombineElem::kFloat16;
  for (int o = 0; o < R; ++o) {
    RankData& d = c.r[o];
    d.out.assign(size_t(d.T) * H * el, 0);
    d.out_plain.assign(size_t(d.T) * H * el, 0);
    d.out_w.assign(size_t(d.T) * K, 0.0f);
    for (int t = 0; t < d.T; ++t) {
      std::vector<const uint8_t*> rows;
      std::vector<const float*> wrows;
      for (int r = 0; r < R; ++r) {
        const int sp = d.send_pos[size_t(t) * R + r];
        if (sp < 0) continue;
        const int row = c.r[r].recv_prefix[o] + sp;
        if (row >= c.r[r].rows) continue;  // past an overflowed capacity: the row never existed
        rows.push_back(&c.r[r].xc[size_t(row) * H * el]);
        wrows.push_back(&c.r[r].wc[size_t(row) * K]);
      }
      for (int k = 0; k < K; ++k) {
        float acc = 0.0f;
        for (auto* wr : wrows) acc = acc + wr[k];
        d.out_w[size_t(t) * K + k] = acc;
      }
      for (int h = 0; h < H; ++h) {
        auto val = [&](const uint8_t* base) -> double {
          if (el == 2) {
            uint16_t b;
            std::memcpy(&b, base + size_t(h) * 2, 2);
            return f16 ? f16_to_float(b) : bf16_to_float(b);
          }
          if (el == 4) {
            float f;
            std::memcpy(&f, base + size_t(h) * 4, 4);
            return f;
          }
          double v;
          std::memcpy(&v, base + size_t(h) * 8, 8);
          return v;
        };
        auto store = [&](std::vector<uint8_t>& out, double accd, float accf) {
          uint8_t* p = &out[(size_t(t) * H + h) * el];
          if (el == 2) {
            const uint16_t b = f16 ? float_to_f16(accf) : float_to_bf16(accf);
            std::memcpy(p, &b, 2);
          } else if (el == 4) {
            std::memcpy(p, &accf, 4);
          } else {
            std::memcpy(p, &accd, 8);
          }
        };
        const uint8_t* b0 = spec.bias0 ? &d.bias0[size_t(t) * H * el] : nullptr;
        const uint8_t* b1 = spec.bias1 ? &d.bias1[size_t(t) * H * el] : nullptr;
        if (el == 8) {
          double acc = 0.0;
          for (auto* r : rows) acc = acc + val(r);
          store(d.out_plain, acc, 0.0f);
          if (b0) acc = acc + val(b0);
          if (b1) acc = acc + val(b1);
          store(d.out, acc, 0.0f);
        } else {
          float acc = 0.0f;
          for (auto* r : rows) acc = acc + static_cast<float>(val(r));
          store(d.out_plain, 0.0, acc);
          if (b0) acc = acc + static_cast<float>(val(b0));
          if (b1) acc = acc + static_cast<float>(val(b1));
          store(d.out, 0.0, acc);
        }
      }
    }
  }
  return c;
}

// ------------------------------------------------------------------------------------------
// Device side: a team of ranks, arenas, one rank's run
// ------------------------------------------------------------------------------------------

struct Arena {
  char* base = nullptr;
  size_t size = 0, used = 0;
  void* take(size_t n) {
    n = std::max<size_t>(n, 16);
    used = (used + 255) / 256 * 256;
    if (used + n > size) throw std::runtime_error("arena exhausted");
    void* p = base + used;
    used += n;
    return p;
  }
  void reset() { used = 0; }
};

// Pinned host staging. Pageable cudaMemcpyAsync goes through the context's shared staging
// buffer and can block a host thread until the stream's earlier work is done; with two ranks on
// one GPU, one rank's copy queued behind its spinning kernel would then stop the other rank from
// launching its kernel at all. Pinned copies are true async DMAs, so no host thread ever blocks.
struct PinnedStage {
  char* base = nullptr;
  size_t size = 0, used = 0;
  struct Pending {
    void* host;
    const void* staged;
    size_t bytes;
  };
  std::vector<Pending> pending;
  void* take(size_t n) {
    used = (used + 255) / 256 * 256;
    if (used + n > size) throw std::runtime_error("pinned stage exhausted");
    void* p = base + used;
    used += n;
    return p;
  }
  // Call after the stream is synchronised: delivers downloads, frees the stage.
  void finish() {
    for (auto& q : pending) std::memcpy(q.host, q.staged, q.bytes);
    pending.clear();
    used = 0;
  }
};
thread_local PinnedStage* g_stage = nullptr;

void copy_h2d(void* dev, const void* host, size_t n, cudaStream_t s) {
  if (n == 0) return;
  if (g_stage == nullptr) {
    CUDA_CHECK(cudaMemcpyAsync(dev, host, n, cudaMemcpyHostToDevice, s));
    return;
  }
  void* p = g_stage->take(n);
  std::memcpy(p, host, n);
  CUDA_CHECK(cudaMemcpyAsync(dev, p, n, cudaMemcpyHostToDevice, s));
}

void copy_d2h(void* host, const void* dev, size_t n, cudaStream_t s) {
  if (n == 0) return;
  if (g_stage == nullptr) {
    CUDA_CHECK(cudaMemcpyAsync(host, dev, n, cudaMemcpyDeviceToHost, s));
    return;
  }
  void* p = g_stage->take(n);
  CUDA_CHECK(cudaMemcpyAsync(p, dev, n, cudaMemcpyDeviceToHost, s));
  g_stage->pending.push_back({host, p, n});
}

// Synchronises the stream and delivers staged downloads.
void sync_stream(cudaStream_t s) {
  CUDA_CHECK(cudaStreamSynchronize(s));
  if (g_stage != nullptr) g_stage->finish();
}

struct Team {
  int R = 0;
  std::vector<int> device;
  std::vector<std::unique_ptr<NvlinkRuntime>> rt;
  std::vector<cudaStream_t> stream;
  std::vector<Arena> arena;
  std::vector<PinnedStage> stage;
  ~Team() {
    for (int r = 0; r < R; ++r) {
      cudaSetDevice(device[r]);
      cudaStreamSynchronize(stream[r]);
    }
    for (int r = 0; r < R; ++r) {
      cudaSetDevice(device[r]);
      rt[r].reset();
      cudaStreamDestroy(stream[r]);
      cudaFree(arena[r].base);
      if (stage[r].base != nullptr) cudaFreeHost(stage[r].base);
    }
  }
};

int g_num_devices = 1;

std::unique_ptr<Team> make_team(int R, const NvlinkConfig& cfg, size_t arena_bytes,
                                size_t stage_bytes = 0) {
  auto team = std::make_unique<Team>();
  team->R = R;
  team->device.resize(R);
  team->rt.resize(R);
  team->stream.resize(R);
  team->arena.resize(R);
  team->stage.resize(R);
  std::vector<void*> buffers(R), slabs(cfg.recv_slabs > 0 ? R : 0);
  for (int r = 0; r < R; ++r) {
    team->device[r] = r % g_num_devices;
    CUDA_CHECK(cudaSetDevice(team->device[r]));
    team->rt[r] = std::make_unique<NvlinkRuntime>(r, R, team->device[r], cfg);
    CUDA_CHECK(cudaStreamCreateWithFlags(&team->stream[r], cudaStreamNonBlocking));
    CUDA_CHECK(cudaMalloc(&team->arena[r].base, arena_bytes));
    team->arena[r].size = arena_bytes;
    if (stage_bytes > 0) {
      CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&team->stage[r].base), stage_bytes,
                               cudaHostAllocPortable));
      team->stage[r].size = stage_bytes;
    }
    buffers[r] = team->rt[r]->buffer();
    if (cfg.recv_slabs > 0) slabs[r] = team->rt[r]->recv_slab(0);
  }
  for (int r = 0; r < R; ++r) team->rt[r]->connect_local(buffers, slabs);
  return team;
}

struct RankResult {
  std::vector<int> per_rank, per_expert, send_pos, recv_counts, recv_prefix, recv_per_expert;
  std::vector<uint8_t> in_rank;
  int host_N = -1;
  std::vector<int> host_per_expert, host_per_rank;
  std::vector<uint8_t> recv_x, recv_x2, recv_idx;
  std::vector<float> recv_scales, recv_scales2, recv_w;
  std::vector<int> src_idx, src_rank;
  std::vector<uint8_t> out, out_plain;
  std::vector<float> out_w;
  std::string error;
  bool call_order_enforced = true;  // a call between notify(dispatch_follows) and dispatch threw
};

template <typename T>
T* upload(Arena& a, const std::vector<T>& v, cudaStream_t s) {
  T* p = static_cast<T*>(a.take(v.size() * sizeof(T)));
  copy_h2d(p, v.data(), v.size() * sizeof(T), s);
  return p;
}

template <typename T>
void download(std::vector<T>& v, const void* p, size_t n, cudaStream_t s) {
  v.resize(n);
  copy_d2h(v.data(), p, n * sizeof(T), s);
}

// Device buffers of one rank's run (kept for graph replays).
struct RankBuffers {
  void *x, *x2, *idx, *bias0, *bias1, *xc, *recv_x, *recv_x2, *recv_idx, *out, *out_plain;
  float *scales, *scales2, *w, *wc, *recv_scales, *recv_scales2, *recv_w, *out_w;
  int *per_rank, *per_expert, *send_pos, *recv_counts, *recv_prefix, *recv_per_expert, *src_idx,
      *src_rank;
  bool* in_rank;
  int* dest_slabs;  // [2R], slab mode
  // Slab mode's cached dispatch (into receive slab 1, behind its own notify): that notify's
  // outputs, [R + 1], [R], [2R] and [1].
  int *cached_prefix, *cached_counts, *cached_dest_slabs, *cached_per_expert;
};

void upload_inputs(const CaseData& c, const RankData& d, RankBuffers& b, cudaStream_t s) {
  auto put = [&](void* dst, const void* src, size_t n) { copy_h2d(dst, src, n, s); };
  put(b.x, d.x.data(), d.x.size());
  put(b.x2, d.x2.data(), d.x2.size());
  put(b.scales, d.scales.data(), d.scales.size() * 4);
  put(b.scales2, d.scales2.data(), d.scales2.size() * 4);
  put(b.w, d.w.data(), d.w.size() * 4);
  put(b.idx, d.idx_bytes_buf.data(), d.idx_bytes_buf.size());
  put(b.bias0, d.bias0.data(), d.bias0.size());
  put(b.bias1, d.bias1.data(), d.bias1.size());
  (void)c;
}

// Combine inputs live in the output allocation (their row count is known after notify).
void upload_combine_inputs(const RankData& d, RankBuffers& b, cudaStream_t s) {
  copy_h2d(b.xc, d.xc.data(), d.xc.size(), s);
  copy_h2d(b.wc, d.wc.data(), d.wc.size() * 4, s);
}

void alloc_inputs(const CaseData& c, const RankData& d, Arena& a, RankBuffers& b) {
  const CaseSpec& sp = c.spec;
  const int R = sp.R, T = d.T;
  b.x = a.take(d.x.size());
  b.x2 = a.take(d.x2.size());
  b.scales = static_cast<float*>(a.take(d.scales.size() * 4));
  b.scales2 = static_cast<float*>(a.take(d.scales2.size() * 4));
  b.w = static_cast<float*>(a.take(d.w.size() * 4));
  b.idx = a.take(d.idx_bytes_buf.size());
  b.bias0 = a.take(d.bias0.size());
  b.bias1 = a.take(d.bias1.size());
  b.per_rank = static_cast<int*>(a.take(R * 4));
  b.per_expert = static_cast<int*>(a.take(sp.E * 4));
  b.in_rank = static_cast<bool*>(a.take(size_t(T) * R));
  b.send_pos = static_cast<int*>(a.take(size_t(T) * R * 4));
  b.recv_counts = static_cast<int*>(a.take(R * 4));
  b.recv_prefix = static_cast<int*>(a.take((R + 1) * 4));
  b.recv_per_expert = static_cast<int*>(a.take(sp.E / R * 4));
  b.dest_slabs = static_cast<int*>(a.take(size_t(2) * R * 4));
  b.cached_prefix = static_cast<int*>(a.take((R + 1) * 4));
  b.cached_counts = static_cast<int*>(a.take(R * 4));
  b.cached_dest_slabs = static_cast<int*>(a.take(size_t(2) * R * 4));
  b.cached_per_expert = static_cast<int*>(a.take(4));
}

void alloc_outputs(const CaseData& c, const RankData& d, int rows, Arena& a, RankBuffers& b,
                   cudaStream_t s) {
  const CaseSpec& sp = c.spec;
  const size_t hb = sp.hidden_bytes, chb = size_t(sp.comb_hidden) * ep::combine_elem_bytes(sp.comb);
  b.recv_x = a.take(rows * hb);
  b.recv_x2 = a.take(rows * hb);
  b.recv_scales = static_cast<float*>(a.take(size_t(rows) * sp.S * 4));
  b.recv_scales2 = static_cast<float*>(a.take(size_t(rows) * sp.S * 4));
  b.recv_idx = a.take(size_t(rows) * sp.K * sp.idx_bytes);
  b.recv_w = static_cast<float*>(a.take(size_t(rows) * sp.K * 4));
  b.src_idx = static_cast<int*>(a.take(rows * 4));
  b.src_rank = static_cast<int*>(a.take(rows * 4));
  b.xc = a.take(size_t(rows) * chb);
  b.wc = static_cast<float*>(a.take(size_t(rows) * sp.K * 4));
  b.out = a.take(size_t(d.T) * chb);
  b.out_plain = a.take(size_t(d.T) * chb);
  b.out_w = static_cast<float*>(a.take(size_t(d.T) * sp.K * 4));
  // Garbage everywhere, so unwritten rows are caught.
  auto junk = [&](void* p, size_t n) {
    if (n) CUDA_CHECK(cudaMemsetAsync(p, 0xA7, n, s));
  };
  junk(b.recv_x, rows * hb);
  junk(b.recv_x2, rows * hb);
  junk(b.recv_scales, size_t(rows) * sp.S * 4);
  junk(b.recv_scales2, size_t(rows) * sp.S * 4);
  junk(b.recv_idx, size_t(rows) * sp.K * sp.idx_bytes);
  junk(b.recv_w, size_t(rows) * sp.K * 4);
  junk(b.src_idx, rows * 4);
  junk(b.src_rank, rows * 4);
  junk(b.out, size_t(d.T) * chb);
  junk(b.out_plain, size_t(d.T) * chb);
  junk(b.out_w, size_t(d.T) * sp.K * 4);
}

// Points the outputs of dispatch `a` (its row shape already set) at the arrays of rank `rt`'s
// receive slab 0, which that rank lent to the notify before (own_slab).
void use_own_slab(NvlinkDispatchArgs& a, const NvlinkRuntime& rt, const int* dest_slabs) {
  const ep::SlabLayout l =
      rt.recv_slab_layout(a.hidden_bytes, a.num_scales, a.num_topk, a.idx_bytes);
  char* slab = rt.recv_slab(0);
  a.recv_x = slab + l.x;
  a.recv_x_scales = a.num_scales ? reinterpret_cast<float*>(slab + l.scales) : nullptr;
  a.recv_topk_idx = slab + l.topk_idx;
  a.recv_topk_weights = reinterpret_cast<float*>(slab + l.topk_weights);
  a.recv_src_idx = reinterpret_cast<int*>(slab + l.src_idx);
  a.recv_src_rank = reinterpret_cast<int*>(slab + l.src_rank);
  a.dest_slabs = dest_slabs;
  a.own_slab = true;
}

// The dispatch of one rank's op sequence, into b's recv_* arrays.
NvlinkDispatchArgs dispatch_args_of(const CaseData& c, const RankData& d, const RankBuffers& b,
                                    int num_sms) {
  const CaseSpec& sp = c.spec;
  NvlinkDispatchArgs a;
  a.x = b.x;
  a.num_tokens = d.T;
  a.hidden_bytes = sp.hidden_bytes;
  a.x_scales = sp.S ? b.scales : nullptr;
  a.num_scales = sp.S;
  a.topk_idx = b.idx;
  a.idx_bytes = sp.idx_bytes;
  a.topk_weights = sp.weights ? b.w : nullptr;
  a.num_topk = sp.K;
  a.num_experts = sp.E;
  a.send_pos = b.send_pos;
  a.recv_prefix = b.recv_prefix;
  a.recv_x = b.recv_x;
  a.recv_x_scales = sp.S ? b.recv_scales : nullptr;
  a.recv_topk_idx = b.recv_idx;
  a.recv_topk_weights = b.recv_w;
  a.recv_src_idx = b.src_idx;
  a.recv_src_rank = b.src_rank;
  a.num_worst_tokens = c.cap;
  a.num_sms = num_sms;
  return a;
}

// Slab mode's cached dispatch as the backend runs it: a notify that announces the handle's
// per-rank counts (one dummy expert per rank) and lends receive slab 1, the cached dispatch
// behind it writing into that slab; b.recv_x2 / recv_scales2 then point into the slab.
void cached_dispatch_into_slab(NvlinkDispatchArgs a2, NvlinkRuntime& rt, RankBuffers& b, int R,
                               int rows, cudaStream_t s) {
  if (rt.recv_slab_count() < 2) throw std::runtime_error("slab mode needs two receive slabs");
  const ep::SlabLayout l = rt.cached_slab_layout(a2.hidden_bytes, a2.num_scales);
  char* slab = rt.recv_slab(1);
  // Garbage first (peers write only after our notify, which runs after these on our stream).
  CUDA_CHECK(cudaMemsetAsync(slab + l.x, 0xA7, size_t(rows) * a2.hidden_bytes, s));
  if (a2.num_scales)
    CUDA_CHECK(cudaMemsetAsync(slab + l.scales, 0xA7, size_t(rows) * a2.num_scales * 4, s));
  rt.notify(b.per_rank, b.per_rank, R, 1, 0, b.cached_counts, b.cached_prefix, b.cached_per_expert,
            false, s, nullptr, /*dispatch_follows=*/true, /*lend_slab=*/1, b.cached_dest_slabs);
  a2.recv_prefix = b.cached_prefix;
  a2.recv_x = slab + l.x;
  a2.recv_x_scales = a2.num_scales ? reinterpret_cast<float*>(slab + l.scales) : nullptr;
  a2.dest_slabs = b.cached_dest_slabs;
  a2.own_slab = true;
  a2.num_worst_tokens = 0;
  rt.cached_dispatch(a2, s);
  b.recv_x2 = a2.recv_x;
  if (a2.num_scales) b.recv_scales2 = a2.recv_x_scales;
}

// Enqueues the whole op sequence of one rank (after layout/notify when host counters are used);
// without the dispatch when `dispatched` (slab mode launched it behind notify; its cached
// dispatch then goes into slab 1 too).
void enqueue_ops(const CaseData& c, const RankData& d, int rank, NvlinkRuntime& rt, RankBuffers& b,
                 int rows, cudaStream_t s, int num_sms, bool dispatched = false) {
  const CaseSpec& sp = c.spec;
  if (!dispatched) rt.dispatch(dispatch_args_of(c, d, b, num_sms), s);

  NvlinkDispatchArgs a2;
  a2.x = b.x2;
  a2.num_tokens = d.T;
  a2.hidden_bytes = sp.hidden_bytes;
  a2.x_scales = sp.S ? b.scales2 : nullptr;
  a2.num_scales = sp.S;
  a2.send_pos = b.send_pos;
  a2.recv_prefix = b.recv_prefix;
  a2.recv_x = b.recv_x2;
  a2.recv_x_scales = sp.S ? b.recv_scales2 : nullptr;
  a2.num_worst_tokens = c.cap;
  a2.num_sms = num_sms;
  if (dispatched)
    cached_dispatch_into_slab(a2, rt, b, sp.R, rows, s);
  else
    rt.cached_dispatch(a2, s);

  NvlinkCombineArgs ca;
  ca.x = b.xc;
  ca.elem = sp.comb;
  ca.hidden = sp.comb_hidden;
  ca.num_recv_rows = rows;
  ca.topk_weights = b.wc;
  ca.num_topk = sp.K;
  ca.recv_prefix = b.recv_prefix;
  ca.send_pos = b.send_pos;
  ca.num_tokens = d.T;
  ca.bias0 = sp.bias0 ? b.bias0 : nullptr;
  ca.bias1 = sp.bias1 ? b.bias1 : nullptr;
  ca.out = b.out;
  ca.out_topk_weights = b.out_w;
  ca.num_sms = num_sms;
  rt.combine(ca, s);

  NvlinkCombineArgs cp = ca;  // plain: no weights, no bias
  cp.topk_weights = nullptr;
  cp.out_topk_weights = nullptr;
  cp.bias0 = cp.bias1 = nullptr;
  cp.out = b.out_plain;
  rt.combine(cp, s);
  (void)rank;
}

void download_results(const CaseData& c, const RankData& d, const RankBuffers& b, int rows,
                      cudaStream_t s, RankResult& out) {
  const CaseSpec& sp = c.spec;
  const int R = sp.R;
  const size_t hb = sp.hidden_bytes, chb = size_t(sp.comb_hidden) * ep::combine_elem_bytes(sp.comb);
  download(out.per_rank, b.per_rank, R, s);
  download(out.per_expert, b.per_expert, sp.E, s);
  download(out.in_rank, b.in_rank, size_t(d.T) * R, s);
  download(out.send_pos, b.send_pos, size_t(d.T) * R, s);
  download(out.recv_counts, b.recv_counts, R, s);
  download(out.recv_prefix, b.recv_prefix, R + 1, s);
  download(out.recv_per_expert, b.recv_per_expert, sp.E / R, s);
  download(out.recv_x, b.recv_x, rows * hb, s);
  download(out.recv_x2, b.recv_x2, rows * hb, s);
  download(out.recv_scales, b.recv_scales, size_t(rows) * sp.S, s);
  download(out.recv_scales2, b.recv_scales2, size_t(rows) * sp.S, s);
  download(out.recv_idx, b.recv_idx, size_t(rows) * sp.K * sp.idx_bytes, s);
  download(out.recv_w, b.recv_w, size_t(rows) * sp.K, s);
  download(out.src_idx, b.src_idx, rows, s);
  download(out.src_rank, b.src_rank, rows, s);
  download(out.out, b.out, size_t(d.T) * chb, s);
  download(out.out_plain, b.out_plain, size_t(d.T) * chb, s);
  download(out.out_w, b.out_w, size_t(d.T) * sp.K, s);
  sync_stream(s);
}

// Slab mode of run_rank (after its layout): notify lends receive slab 0 and the dispatch is
// launched behind it, into that slab (rows for every token of every rank), before the host waits
// for the counts; then the rest of the sequence, and the results read from the slab.
void run_rank_slab(const CaseData& c, int rank, NvlinkRuntime& rt, cudaStream_t s, Arena& arena,
                   RankBuffers& b, RankResult& out, int num_sms) {
  const CaseSpec& sp = c.spec;
  const RankData& d = c.r[rank];
  if (c.cap != 0) throw std::runtime_error("slab mode is a normal-mode case");
  if (rt.recv_slab_count() < 1) throw std::runtime_error("slab mode needs config.recv_slabs");
  int max_rows = 0;
  for (int t : sp.T) max_rows += t;
  const ep::SlabLayout l = rt.recv_slab_layout(sp.hidden_bytes, sp.S, sp.K, sp.idx_bytes);
  char* slab = rt.recv_slab(0);
  // Garbage in every row a peer could write (before notify: peers write only after it).
  auto junk = [&](size_t offset, size_t n) {
    if (n) CUDA_CHECK(cudaMemsetAsync(slab + offset, 0xA7, n, s));
  };
  junk(l.x, size_t(max_rows) * sp.hidden_bytes);
  junk(l.scales, size_t(max_rows) * sp.S * 4);
  junk(l.topk_idx, size_t(max_rows) * sp.K * sp.idx_bytes);
  junk(l.topk_weights, size_t(max_rows) * sp.K * 4);
  junk(l.src_idx, size_t(max_rows) * 4);
  junk(l.src_rank, size_t(max_rows) * 4);
  const int ticket = rt.notify(b.per_rank, b.per_expert, sp.E, sp.alignment, 0, b.recv_counts,
                               b.recv_prefix, b.recv_per_expert, true, s, nullptr,
                               /*dispatch_follows=*/true, /*lend_slab=*/0, b.dest_slabs);
  NvlinkDispatchArgs a = dispatch_args_of(c, d, b, num_sms);
  use_own_slab(a, rt, b.dest_slabs);
  rt.dispatch(a, s);
  const ep::NvlinkRecvCounts n = rt.wait_recv_counts(ticket);
  out.host_N = n.num_recv_tokens;
  out.host_per_expert = n.per_expert;
  out.host_per_rank = n.per_rank;
  const int rows = n.num_recv_tokens;
  if (rows != d.rows) throw std::runtime_error("host N differs from reference");
  alloc_outputs(c, d, rows, arena, b, s);
  b.recv_x = a.recv_x;
  if (sp.S) b.recv_scales = a.recv_x_scales;
  b.recv_idx = a.recv_topk_idx;
  b.recv_w = a.recv_topk_weights;
  b.src_idx = a.recv_src_idx;
  b.src_rank = a.recv_src_rank;
  upload_combine_inputs(d, b, s);
  enqueue_ops(c, d, rank, rt, b, rows, s, num_sms, /*dispatched=*/true);
  download_results(c, d, b, rows, s, out);
  out.error = rt.check_error();
}

// One rank's full op sequence: layout, notify (+ host wait), dispatch, cached dispatch, combines.
void run_rank(const CaseData& c, int rank, NvlinkRuntime& rt, cudaStream_t s, Arena& arena,
              RankResult& out, int num_sms) {
  const CaseSpec& sp = c.spec;
  const RankData& d = c.r[rank];
  arena.reset();
  RankBuffers b{};
  alloc_inputs(c, d, arena, b);
  upload_inputs(c, d, b, s);
  rt.layout(b.idx, sp.idx_bytes, d.T, sp.K, sp.E, b.per_rank, b.per_expert, b.in_rank, b.send_pos,
            s);
  if (sp.slab) {
    run_rank_slab(c, rank, rt, s, arena, b, out, num_sms);
    return;
  }
  const bool normal = c.cap == 0;
  // Worst-case mode: the dispatch kernel follows notify with no host step (launched behind it).
  const int ticket = rt.notify(b.per_rank, b.per_expert, sp.E, sp.alignment, c.cap, b.recv_counts,
                               b.recv_prefix, b.recv_per_expert, normal, s, nullptr, !normal);
  if (!normal) {
    // The notify above shares its sequence number with the dispatch that must come next.
    bool threw = false;
    try {
      rt.barrier(s);
    } catch (const std::logic_error&) {
      threw = true;
    }
    out.call_order_enforced = threw;
  }
  int rows = c.cap;
  if (normal) {
    ep::NvlinkRecvCounts n = rt.wait_recv_counts(ticket);
    out.host_N = n.num_recv_tokens;
    out.host_per_expert = n.per_expert;
    out.host_per_rank = n.per_rank;
    rows = n.num_recv_tokens;
    if (rows != d.rows) throw std::runtime_error("host N differs from reference");
  }
  alloc_outputs(c, d, rows, arena, b, s);
  upload_combine_inputs(d, b, s);
  enqueue_ops(c, d, rank, rt, b, rows, s, num_sms);
  download_results(c, d, b, rows, s, out);
  out.error = rt.check_error();
}

void verify_rank(const CaseData& c, int rank, const RankResult& g, const std::string& tag) {
  const RankData& d = c.r[rank];
  const std::string p = c.spec.name + tag + " rank " + std::to_string(rank) + ": ";
  check_true(g.error.empty(), p + "error record: " + g.error);
  check_true(g.call_order_enforced, p + "a call between notify and its dispatch did not throw");
  check_equal(g.per_rank, d.per_rank, p + "num_tokens_per_rank");
  check_equal(g.per_expert, d.per_expert, p + "num_tokens_per_expert");
  check_equal(g.in_rank, d.in_rank, p + "is_token_in_rank");
  check_equal(g.send_pos, d.send_pos, p + "send_pos");
  check_equal(g.recv_counts, d.recv_counts, p + "recv_counts");
  check_equal(g.recv_prefix, d.recv_prefix, p + "recv_prefix");
  check_equal(g.recv_per_expert, d.recv_per_expert, p + "num_recv_tokens_per_expert");
  if (g.host_N >= 0) {
    check_true(g.host_N == d.N, p + "host N");
    check_equal(g.host_per_expert, d.recv_per_expert, p + "host per-expert counts");
    check_equal(g.host_per_rank, d.recv_counts, p + "host per-rank counts");
  }
  check_equal(g.recv_x, d.recv_x, p + "recv_x");
  check_equal(g.recv_scales, d.recv_scales, p + "recv_scales");
  check_equal(g.recv_idx, d.recv_idx, p + "recv_topk_idx");
  check_equal(g.recv_w, d.recv_w, p + "recv_topk_weights");
  check_equal(g.src_idx, d.src_idx, p + "recv_src_idx");
  check_equal(g.src_rank, d.src_rank, p + "recv_src_rank");
  check_equal(g.recv_x2, d.recv_x2, p + "cached recv_x");
  check_equal(g.recv_scales2, d.recv_scales2, p + "cached recv_scales");
  check_equal(g.out, d.out, p + "combined_x (weights/bias)");
  check_equal(g.out_w, d.out_w, p + "combined_topk_weights");
  check_equal(g.out_plain, d.out_plain, p + "combined_x (plain)");
}

void run_case(Team& team, const CaseSpec& spec, int num_sms = 0) {
  if (spec.R != team.R) throw std::runtime_error("team size mismatch");
  CaseData c = make_case(spec);
  std::vector<RankResult> res(spec.R);
  run_ranks(spec.R, [&](int r) {
    CUDA_CHECK(cudaSetDevice(team.device[r]));
    g_stage = &team.stage[r];
    run_rank(c, r, *team.rt[r], team.stream[r], team.arena[r], res[r], num_sms);
    g_stage = nullptr;
  });
  for (int r = 0; r < spec.R; ++r) verify_rank(c, r, res[r], "");
}

// ------------------------------------------------------------------------------------------
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

// ------------------------------------------------------------------------------------------
// Benchmark
// ------------------------------------------------------------------------------------------

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct BenchShape {
  const char* name;
  int hidden_bytes;
  int S;
};

// -DEP_HT_TIMELINE builds: where the last call of a dispatch or combine kernel spent its time, per
// rank. For each role (senders, publisher, receivers): when its warps began real work (senders:
// first row after the peer's "entered" flag; receivers: first row arrived) and when they ended,
// as first/median/last over (block, warp), in us after the barrier kernel before the call ended
// (entry: a block's first instruction; exit: after its epoch bookkeeping). "skew" is the rank's
// barrier end minus rank 0's (%globaltimer; only as good as the clocks agree).
void print_ht_timeline(Team& team, int R, bool combine, int send_warps) {
  using namespace ep;
  std::vector<std::vector<uint64_t>> tl(R);
  for (int r = 0; r < R; ++r) {
    CUDA_CHECK(cudaSetDevice(team.device[r]));
    CUDA_CHECK(cudaDeviceSynchronize());
    tl[r].resize(size_t(kHtTimelineBlocks) * kHtTimelineSlots);
    const cudaError_t e = combine ? read_nvlink_combine_timeline(tl[r].data())
                                  : read_nvlink_dispatch_timeline(tl[r].data());
    if (e == cudaErrorNotSupported) return;  // not a timeline build
    CUDA_CHECK(e);
  }
  const int blocks = 24;  // the bench's num_sms
  // Times count from the end of the barrier kernel that precedes the timed call (its start event
  // follows it on the stream): entry shows the launch gap, exit the epoch bookkeeping.
  auto start_of = [&](int r) {
    CUDA_CHECK(cudaSetDevice(team.device[r]));
    uint64_t barrier_end = 0;
    CUDA_CHECK(read_nvlink_barrier_timeline(&barrier_end));
    return barrier_end;
  };
  const uint64_t t00 = start_of(0);
  for (int r = 0; r < R; ++r) {
    const uint64_t t0 = start_of(r);
    auto stat = [&](int slot_base, int w_begin, int w_end) {
      std::vector<double> v;
      for (int b = 0; b < blocks; ++b)
        for (int w = w_begin; w < w_end; ++w) {
          const uint64_t x = tl[r][size_t(b) * kHtTimelineSlots + slot_base + w];
          if (x >= t0) v.push_back((x - t0) / 1e3);
        }
      char buf[64];
      if (v.empty()) return std::string("-");
      std::sort(v.begin(), v.end());
      std::snprintf(buf, sizeof(buf), "%.1f/%.1f/%.1f", v.front(), v[v.size() / 2], v.back());
      return std::string(buf);
    };
    std::printf(
        "  timeline %s rank %d (skew %+.1f us, from barrier end): entry %s block start %s end %s"
        " exit %s | send first %s end %s | publish end %s | recv first %s end %s\n",
        combine ? "combine" : "dispatch", r, (double(t0) - double(t00)) / 1e3,
        stat(kHtKernelEntry, 0, 1).c_str(), stat(kHtBlockStart, 0, 1).c_str(),
        stat(kHtBlockEnd, 0, 1).c_str(), stat(kHtBlockExit, 0, 1).c_str(),
        stat(kHtFirstSlot, 0, send_warps).c_str(), stat(kHtEndSlot, 0, send_warps).c_str(),
        stat(kHtEndSlot, send_warps, send_warps + 1).c_str(),
        stat(kHtFirstSlot, send_warps + 1, 16).c_str(),
        stat(kHtEndSlot, send_warps + 1, 16).c_str());
    if (combine) continue;
    std::printf("           rank %d: senders saw entered %s, notified %s", r,
                stat(kHtEnteredSeen, 0, 1).c_str(), stat(kHtNotifiedSeen, 0, 1).c_str());
    // The notify before this call, if it ran after the barrier (a call behind its notify).
    uint64_t nt[kHtNotifySlots] = {};
    CUDA_CHECK(cudaSetDevice(team.device[r]));
    CUDA_CHECK(read_nvlink_notify_timeline(nt));
    if (nt[kHtNotifyEntry] >= t0) {
      auto at = [&](int slot) { return nt[slot] >= t0 ? (nt[slot] - t0) / 1e3 : -1.0; };
      std::printf(" | notify entry %.1f received %.1f released %.1f host %.1f", at(kHtNotifyEntry),
                  at(kHtNotifyReceived), at(kHtNotifyReleased), at(kHtNotifyHost));
    }
    std::printf("\n");
  }
}

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
  auto configure_claim = [&](int dw, int cw, bool dclaim) {
    for (int r = 0; r < R; ++r) {
      team->rt[r]->set_send_warps(dw, cw, dw);
      team->rt[r]->set_dispatch_claim(dclaim);
    }
  };
  // The defaults: dispatch warps by row size, `cw` combine warps (one_rank: with the rule for
  // groups of one rank, which overrides both counts there).
  auto configure_defaults = [&](int cw, bool one_rank = true) {
    for (int r = 0; r < R; ++r) {
      team->rt[r]->set_send_warps(
          defaults.dispatch_send_warps, cw, defaults.small_row_dispatch_send_warps,
          defaults.slab_dispatch_send_warps, one_rank && defaults.one_rank_send_warps);
      team->rt[r]->set_dispatch_claim(defaults.dispatch_claim);
    }
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
      for (int claim = 0; claim < 2; ++claim)
        for (int warps : dispatch_warps) {
          configure_claim(warps, default_combine_warps, claim != 0);
          char label[96];
          std::snprintf(label, sizeof(label), "dispatch kernel, %d send warps, %s", warps,
                        claim ? "claimed" : "round-robin");
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
    print_ht_timeline(*team, R, false, shape_warps);
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
    print_ht_timeline(*team, R, false, shape_warps);
    report("notify + dispatch kernel, receive slab", notify_then_dispatch(true), remote_bytes);
    print_ht_timeline(*team, R, false,
                      team->rt[0]->dispatch_send_warps(sh.hidden_bytes, sh.S, true));
    // With a slab the receive warps have nothing to copy; fewer senders contend less (the
    // default, NvlinkConfig::slab_dispatch_send_warps, came from this sweep).
    for (int warps : quick ? std::vector<int>{} : std::vector<int>{4, 5, 6, 8, 10, 12, 14}) {
      configure_claim(warps, default_combine_warps, true);
      char label[96];
      std::snprintf(label, sizeof(label), "dispatch kernel, receive slab, %d send warps", warps);
      report(label, time_op([&](int r, cudaStream_t s) { team->rt[r]->dispatch(slab_args(r), s); }),
             remote_bytes);
    }
    configure_defaults(default_combine_warps);
    if (sh.hidden_bytes <= ep::kStagedRowBytes && !quick) {
      for (int r = 0; r < R; ++r) team->rt[r]->set_dispatch_staging(false);
      for (int round = 0; round < rounds; ++round)
        report("dispatch kernel, register path (not staged)", time_op([&](int r, cudaStream_t s) {
                 team->rt[r]->dispatch(dispatch_args(r, 0), s);
               }),
               remote_bytes);
      for (int r = 0; r < R; ++r)
        team->rt[r]->set_dispatch_staging(defaults.stage_small_dispatch_rows);
    }
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
      if (round == 0 && warps == default_combine_warps) print_ht_timeline(*team, R, true, warps);
    }
  configure_defaults(default_combine_warps);
  if (team->rt[0]->combine_send_warps() != default_combine_warps) {  // the one-rank rule
    std::printf("  (below: default %d send warps)\n", team->rt[0]->combine_send_warps());
    report("combine", time_op(combine_op), comb_bytes);
  }
  for (int r = 0; r < R; ++r) {
    CUDA_CHECK(cudaSetDevice(team->device[r]));
    CUDA_CHECK(cudaFree(rb[r].flush));
  }
}

// ------------------------------------------------------------------------------------------

CaseSpec spec_of(const std::string& name, int R, std::vector<int> T, int hb, int S, int K, int E) {
  CaseSpec s;
  s.name = name;
  s.R = R;
  s.T = std::move(T);
  s.hidden_bytes = hb;
  s.S = S;
  s.K = K;
  s.E = E;
  s.seed = std::hash<std::string>()(name);
  return s;
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
    // Odd iterations: small rows take the register path instead of shared-memory staging.
    for (int r = 0; r < R; ++r) team->rt[r]->set_dispatch_staging(it % 2 == 0);
    run_case(*team, s, 1 + int(rng() % 24) % cfg.num_sms);
  }
  for (int r = 0; r < R; ++r) team->rt[r]->set_dispatch_staging(cfg.stage_small_dispatch_rows);
  std::printf("  R=%d%s %-28s %s (%d iterations)\n", R, mode, "soak",
              g_failures == before ? "ok" : "FAILED", soak_iters);
  std::printf("  R=%d%s suite took %.1f s\n", R, mode,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

}  // namespace

int main(int argc, char** argv) {
  bool do_bench = true, do_tests = true, do_ipc = true;
  int soak = 300, iters = 50;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--no-bench") do_bench = false;
    if (a == "--bench-only") do_tests = false, do_ipc = false;
    if (a == "--no-ipc") do_ipc = false;
    if (a == "--soak" && i + 1 < argc) soak = std::atoi(argv[++i]);
    if (a == "--iters" && i + 1 < argc) iters = std::atoi(argv[++i]);
  }
  setvbuf(stdout, nullptr, _IOLBF, 0);
  // Ranks that share a GPU run as streams of this process. With the default 8 hardware queues,
  // streams beyond 8 share queues, so a rank's spinning kernel can sit in front of the kernel of
  // the rank it waits for (R=8 on one GPU timed out in notify). 32 queues keep every rank's
  // stream on its own (before the first CUDA call; a value set by the caller wins).
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  int ipc_bad = 0;
  if (do_ipc) {  // before this process touches CUDA (fork + CUDA do not mix)
    ipc_bad = ipc_test(2);
    ++g_checks;
    if (ipc_bad) fail("ipc test: " + std::to_string(ipc_bad) + " child(ren) failed");
    std::printf("  R=2 %-28s %s\n", "multi-process CUDA IPC", ipc_bad ? "FAILED" : "ok");
  }
  try {
    CUDA_CHECK(cudaGetDeviceCount(&g_num_devices));
    std::printf("devices: %d\n", g_num_devices);
    for (int a = 0; a < g_num_devices; ++a) {
      CUDA_CHECK(cudaSetDevice(a));
      for (int b = 0; b < g_num_devices; ++b) {
        if (a == b) continue;
        int can = 0;
        CUDA_CHECK(cudaDeviceCanAccessPeer(&can, a, b));
        if (!can) throw std::runtime_error("no peer access between GPUs");
        cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
        if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) CUDA_CHECK(e);
        cudaGetLastError();
      }
    }
  } catch (const std::exception& e) {
    fail(std::string("exception: ") + e.what());
  }
  // Each phase on its own: a broken phase must not hide the others' results.
  auto phase = [](const char* name, const std::function<void()>& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      fail(std::string(name) + ": exception: " + e.what());
    }
  };
  if (do_tests) {
    phase("bf16 pair sum", [&] { bf16_pair_sum_test(); });
    for (int R : {1, 2, 4, 8})
      phase("suite", [&] { correctness_suite(R, R <= 2 ? soak : soak / (R == 4 ? 3 : 6)); });
    phase("timeout test", [&] { timeout_test(); });
  }
  const bool one_gpu_bench = std::getenv("HT_BENCH_ONE_GPU") != nullptr;
  if (do_bench && (g_num_devices >= 2 || one_gpu_bench)) phase("bench", [&] { bench(iters); });
  std::printf("SUMMARY: %d checks, %d failures -> %s\n", g_checks.load(), g_failures.load(),
              g_failures == 0 ? "PASS" : "FAIL");
  return g_failures == 0 ? 0 : 1;
}
