// Shared part of the nvlink kernel harnesses (nvlink_test.cu, nvlink_bench.cu): the check
// bookkeeping, the CPU reference of the spec (make_case), the rank team with its buffers, and
// the enqueue/verify helpers. One process drives R ranks (one host thread per rank; ranks map
// round-robin onto the visible GPUs). Included by exactly one translation unit per binary.
#pragma once

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

// A case of the spec from its shape (the seed comes from the name).
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

// Every visible GPU may access every other one (the ranks of a team write into each other).
// Records the device count in g_num_devices.
void enable_peer_access() {
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
}

// Runs fn; an exception counts as a failure of `name` (a broken phase must not hide the others).
void run_phase(const char* name, const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    fail(std::string(name) + ": exception: " + e.what());
  }
}

// Ranks that share a GPU run as streams of this process. With the default 8 hardware queues,
// streams beyond 8 share queues, so a rank's spinning kernel can sit in front of the kernel of
// the rank it waits for (R=8 on one GPU timed out in notify). 32 queues keep every rank's
// stream on its own (call before the first CUDA call; a value set by the caller wins).
void use_one_queue_per_rank() {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
}

int report_summary() {
  std::printf("SUMMARY: %d checks, %d failures -> %s\n", g_checks.load(), g_failures.load(),
              g_failures == 0 ? "PASS" : "FAIL");
  return g_failures == 0 ? 0 : 1;
}

}  // namespace
