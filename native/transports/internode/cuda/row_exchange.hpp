// RowExchange: the per-call agreement rows of a group whose ranks span several nodes, all-gathered
// on the GPU over NVSHMEM instead of over TCP (Gloo). It lives in libep_nvshmem.so beside the
// internode runtime, in the same NVSHMEM session, and serves the host's agreement step
// (backend/moe_validation.cpp, allGatherRows) through the internode transport.
//
// One gather: the host passes its row (up to kMaxWidth int64 words) as a kernel parameter; one
// block on the exchange's own stream (not ordered after the caller's work, so the host never waits
// for the model's kernels) puts the row to every rank with a signal carrying the gather's number,
// waits for every rank's signal, and copies the R rows to host-mapped memory with a ticket the
// host waits for. Rows alternate between two buffers by the gather's parity: a rank reaches
// gather n + 2 only after every rank sent its row of n + 1, which each sends only after its
// kernel of n finished reading, so a buffer is never rewritten while it is read.
//
// A rank whose row does not come within the timeout is reported by the kernel (the missing ranks,
// ascending); the exchange is then out of step for good (a late row would land in a later
// gather) and refuses further gathers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

namespace ep {

struct RowExchangeSetup {
  int rank = 0;
  int num_ranks = 0;
  int device = 0;
};

// What the kernel leaves in host-mapped memory, then the rows ([R][kMaxWidth] int64).
struct RowExchangeHost {
  uint64_t ticket = 0;  // the gather's number, written last
  int64_t missing = 0;  // ranks whose rows never came (0: all did)
  int64_t missing_ranks[8] = {};
};

class RowExchange {
 public:
  // Words of a row: the agreement's rows are 2R + 29 words wide, so groups of up to 113 ranks
  // agree here and larger ones through Gloo (the row travels as a kernel parameter, which is
  // limited to 4 KiB).
  static constexpr int kMaxWidth = 256;
  static constexpr int kMaxRanks = 1024;

  // Local: this rank's stream and host-mapped words; connect() makes the symmetric region.
  explicit RowExchange(const RowExchangeSetup& setup);
  ~RowExchange();
  RowExchange(const RowExchange&) = delete;
  RowExchange& operator=(const RowExchange&) = delete;

  static size_t symmetric_bytes(int num_ranks);

  void connect();           // collective (nvshmem_malloc)
  void destroy();           // collective (nvshmem_free) once connected; idempotent
  void abandon() noexcept;  // drops this rank's part without a collective (a failed setup)

  // All ranks' rows, rank-major, into out[R * width]; every rank calls it with the same width in
  // the same order. Returns "" or, when some rank's row did not come within `timeout_seconds`,
  // "rank(s) a, b" (those ranks, ascending); throws std::runtime_error on a CUDA error or when
  // the kernel itself did not finish (a hung put).
  std::string gather(const int64_t* row, int width, double timeout_seconds, int64_t* out);

 private:
  void release_local() noexcept;

  RowExchangeSetup setup_;
  char* region_ = nullptr;  // symmetric: send row, rows [2][R][kMaxWidth], signals [2][R]
  cudaStream_t stream_ = nullptr;
  RowExchangeHost* host_ = nullptr;  // host-mapped, then the rows
  RowExchangeHost* host_dev_ = nullptr;
  uint64_t gathers_ = 0;
  std::string failure_;  // set once a gather failed: the exchange is out of step
};

}  // namespace ep
