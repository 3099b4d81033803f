// RowExchange (row_exchange.hpp): the agreement rows all-gathered by one block over NVSHMEM
// put-with-signal, and its host side.
#include "transports/internode/cuda/row_exchange.hpp"

#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "common/ptx.cuh"
#include "common/runtime_util.hpp"
#include "common/str_cat.hpp"

namespace ep {
namespace {

constexpr runtime::Checks kChecks{"ep agreement exchange"};
constexpr int kThreads = 256;
constexpr int kListed = static_cast<int>(sizeof(RowExchangeHost::missing_ranks) / sizeof(int64_t));
// Past the kernel's own timeout, how long the host waits for its ticket before concluding that
// the kernel itself hangs (a put that never completes) rather than a peer being late.
constexpr double kHostMarginSeconds = 10.0;

struct RowExchangeParams {
  char* region;
  RowExchangeHost* host;
  long long timeout_ns;
  uint64_t seq;
  int rank;
  int num_ranks;
  int width;
  int64_t row[RowExchange::kMaxWidth];
};
static_assert(sizeof(RowExchangeParams) <= 4096, "kernel parameters are limited to 4 KiB");

// The symmetric region: this rank's outgoing row, then every rank's row per parity, then one
// signal word per (parity, source rank).
__host__ __device__ constexpr size_t rowsOffset() {
  return sizeof(int64_t) * RowExchange::kMaxWidth;
}
__host__ __device__ constexpr size_t signalsOffset(int num_ranks) {
  return rowsOffset() +
         sizeof(int64_t) * 2 * static_cast<size_t>(num_ranks) * RowExchange::kMaxWidth;
}
constexpr size_t regionBytes(int num_ranks) {
  return signalsOffset(num_ranks) + sizeof(uint64_t) * 2 * static_cast<size_t>(num_ranks);
}
size_t hostBytes(int num_ranks) {
  return sizeof(RowExchangeHost) +
         sizeof(int64_t) * static_cast<size_t>(num_ranks) * RowExchange::kMaxWidth;
}

__global__ void __launch_bounds__(kThreads)
    row_exchange_kernel(const __grid_constant__ RowExchangeParams p) {
  const int R = p.num_ranks;
  const int parity = static_cast<int>(p.seq & 1);
  int64_t* send = reinterpret_cast<int64_t*>(p.region);
  int64_t* rows = reinterpret_cast<int64_t*>(p.region + rowsOffset()) +
                  static_cast<int64_t>(parity) * R * RowExchange::kMaxWidth;
  uint64_t* signals = reinterpret_cast<uint64_t*>(p.region + signalsOffset(R)) + parity * R;
  __shared__ unsigned char missing[RowExchange::kMaxRanks];
  for (int i = static_cast<int>(threadIdx.x); i < p.width; i += kThreads) send[i] = p.row[i];
  for (int s = static_cast<int>(threadIdx.x); s < R; s += kThreads) missing[s] = 0;
  // The row is read by warp 0's puts (over RDMA, by the NIC).
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < 32) {
    for (int d = 0; d < R; ++d) {
      nvshmemx_putmem_signal_nbi_warp(rows + static_cast<int64_t>(p.rank) * RowExchange::kMaxWidth,
                                      send, sizeof(int64_t) * static_cast<size_t>(p.width),
                                      signals + p.rank, p.seq, NVSHMEM_SIGNAL_SET, d);
    }
    __syncwarp();
    // The next gather rewrites `send`: this one's puts complete before the kernel ends.
    if (threadIdx.x == 0) nvshmem_quiet();
  }
  for (int s = static_cast<int>(threadIdx.x); s < R; s += kThreads) {
    const uint64_t start = ptx::global_timer_ns();
    for (uint32_t iter = 0; ptx::ld_acquire_sys(signals + s) < p.seq; ++iter) {
      if ((iter & 255u) == 255u &&
          static_cast<long long>(ptx::global_timer_ns() - start) > p.timeout_ns) {
        missing[s] = 1;
        break;
      }
    }
  }
  __threadfence();
  __syncthreads();
  int64_t* out =
      reinterpret_cast<int64_t*>(reinterpret_cast<char*>(p.host) + sizeof(RowExchangeHost));
  for (int i = static_cast<int>(threadIdx.x); i < R * p.width; i += kThreads) {
    const int s = i / p.width;
    out[i] = reinterpret_cast<const volatile int64_t*>(
        rows)[static_cast<int64_t>(s) * RowExchange::kMaxWidth + i % p.width];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    volatile RowExchangeHost* h = p.host;
    int64_t count = 0;
    for (int s = 0; s < R; ++s) {
      if (!missing[s]) continue;
      if (count < kListed) h->missing_ranks[count] = s;
      ++count;
    }
    h->missing = count;
    __threadfence_system();  // the rows and the verdict before the ticket the host reads them by
    h->ticket = p.seq;
  }
}

}  // namespace

size_t RowExchange::symmetric_bytes(int num_ranks) {
  return regionBytes(num_ranks);
}

RowExchange::RowExchange(const RowExchangeSetup& setup) : setup_(setup) {
  kChecks.require(setup.num_ranks >= 1 && setup.num_ranks <= kMaxRanks,
                  "the number of ranks must be in [1, 1024]");
  kChecks.require(setup.rank >= 0 && setup.rank < setup.num_ranks, "rank out of range");
  kChecks.require(nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED,
                  "NVSHMEM is not initialised (NvshmemRuntime::start_session starts it)");
  kChecks.require(nvshmem_n_pes() == setup.num_ranks && nvshmem_my_pe() == setup.rank,
                  "the NVSHMEM session has other PEs than this group");
  try {
    runtime::DeviceGuard guard(setup.device);
    int least = 0;
    int greatest = 0;
    kChecks.cuda(cudaDeviceGetStreamPriorityRange(&least, &greatest),
                 "cudaDeviceGetStreamPriorityRange");
    // Highest priority: the exchange's one block is scheduled ahead of queued model work.
    kChecks.cuda(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest),
                 "cudaStreamCreateWithPriority");
    runtime::allocMappedHost(kChecks, "rows", hostBytes(setup.num_ranks), &host_, &host_dev_);
  } catch (...) {
    release_local();
    throw;
  }
}

RowExchange::~RowExchange() {
  try {
    destroy();
  } catch (...) {
  }
}

void RowExchange::connect() {
  kChecks.require(host_ != nullptr && region_ == nullptr, "connect: once, after construction");
  runtime::DeviceGuard guard(setup_.device);
  const size_t bytes = regionBytes(setup_.num_ranks);
  region_ = static_cast<char*>(nvshmem_malloc(bytes));
  if (region_ == nullptr) {
    throw std::runtime_error(runtime::strCat("ep agreement exchange: nvshmem_malloc(", bytes,
                                             ") failed: the symmetric heap cannot hold it"));
  }
  kChecks.cuda(cudaMemset(region_, 0, bytes), "cudaMemset(region)");
  // Zeroed before any peer signals into it: the caller's agreement that every rank connected
  // is the barrier.
  kChecks.cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

void RowExchange::destroy() {
  if (region_ == nullptr && host_ == nullptr && stream_ == nullptr) return;
  runtime::DeviceGuard guard(setup_.device);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  if (region_ != nullptr) nvshmem_free(region_);  // collective
  region_ = nullptr;
  release_local();
}

void RowExchange::abandon() noexcept {
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(setup_.device);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  region_ = nullptr;  // left in the session's heap: nvshmem_free would wait for every PE
  release_local();
  cudaSetDevice(previous);
}

void RowExchange::release_local() noexcept {
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  if (host_ != nullptr) cudaFreeHost(host_);
  stream_ = nullptr;
  host_ = host_dev_ = nullptr;
}

std::string RowExchange::gather(const int64_t* row, int width, double timeout_seconds,
                                int64_t* out) {
  if (!failure_.empty()) throw std::runtime_error(failure_);
  kChecks.require(region_ != nullptr, "gather on an exchange that is not connected");
  kChecks.require(width >= 1 && width <= kMaxWidth, "a row is 1 to 256 words");
  runtime::DeviceGuard guard(setup_.device);
  RowExchangeParams p{};
  p.region = region_;
  p.host = host_dev_;
  p.timeout_ns = static_cast<long long>(timeout_seconds * 1e9);
  p.seq = ++gathers_;
  p.rank = setup_.rank;
  p.num_ranks = setup_.num_ranks;
  p.width = width;
  std::memcpy(p.row, row, sizeof(int64_t) * static_cast<size_t>(width));
  row_exchange_kernel<<<1, kThreads, 0, stream_>>>(p);
  const cudaError_t launched = cudaGetLastError();
  if (launched != cudaSuccess) {
    failure_ = runtime::strCat("ep agreement exchange: launching its kernel failed: ",
                               cudaGetErrorString(launched));
    throw std::runtime_error(failure_);
  }
  const volatile RowExchangeHost* h = host_;
  const auto start = std::chrono::steady_clock::now();
  const auto spin_until = start + std::chrono::milliseconds(1);
  const auto limit = std::chrono::duration<double>(timeout_seconds + kHostMarginSeconds);
  while (h->ticket != p.seq) {
    const auto now = std::chrono::steady_clock::now();
    if (now - start > limit) {
      failure_ = runtime::strCat("ep agreement exchange: its kernel did not finish ",
                                 timeout_seconds + kHostMarginSeconds,
                                 " s after its launch (its wait for the peers gives up after ",
                                 timeout_seconds, " s: an NVSHMEM put or the GPU hangs)");
      throw std::runtime_error(failure_);
    }
    if (now >= spin_until) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  const int64_t missing = h->missing;
  if (missing > 0) {
    std::string who = "rank(s) ";
    const int64_t listed = std::min<int64_t>(missing, kListed);
    for (int64_t i = 0; i < listed; ++i) {
      who += runtime::strCat(i == 0 ? "" : ", ", static_cast<int64_t>(h->missing_ranks[i]));
    }
    if (missing > listed) who += runtime::strCat(" and ", missing - listed, " more");
    failure_ = runtime::strCat("ep agreement exchange: ", who,
                               " never joined an earlier gather (the exchange is out of step)");
    return who;
  }
  const volatile int64_t* rows = reinterpret_cast<const volatile int64_t*>(
      reinterpret_cast<const char*>(host_) + sizeof(RowExchangeHost));
  const int64_t n = static_cast<int64_t>(setup_.num_ranks) * width;
  for (int64_t i = 0; i < n; ++i) out[i] = rows[i];
  return "";
}

}  // namespace ep
