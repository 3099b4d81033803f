// Receive slabs lent to a dispatch's outputs (NvlinkConfig::recv_slabs): the pool that tracks
// which are lent, the lease that gives one back when the last output viewing it is freed, and the
// tensors that view a slab. Only built with EP_WITH_CUDA.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Stream.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "transports/nvlink/cuda/nvlink_runtime.hpp"

namespace ep::nvlink {

// The receive slabs of one runtime: which are lent, and for a returned one the events recorded
// when its last output tensor was freed, one on each stream its outputs were used on (the
// dispatch's, and those named by recordSlabStream). Thread-safe: tensors are freed on any thread
// (autograd's too).
class SlabPool {
 public:
  SlabPool(int count, int device, std::shared_ptr<char> memory);
  ~SlabPool();
  SlabPool(const SlabPool&) = delete;
  SlabPool& operator=(const SlabPool&) = delete;

  // A free slab for a dispatch on `stream` (-1: none free). The stream first waits for the work
  // queued on the returning outputs' streams when they were freed, as the caching allocator
  // orders a block's reuse; not when that work is done (a wait queued ahead of notify may delay
  // its start), and only for events not yet complete.
  int lend(cudaStream_t stream);
  // Slab i's outputs are all freed: records an event on each of `streams`. If one cannot be
  // recorded (CUDA gone at exit, a destroyed stream) the slab stays lent: its next lend could
  // not be ordered after that stream's work.
  void give_back(int i, const std::vector<cudaStream_t>& streams) noexcept;

 private:
  std::mutex mutex_;
  int device_;
  std::shared_ptr<char> memory_;  // keeps the slabs mapped while outputs view them
  std::vector<bool> lent_;
  std::vector<std::vector<cudaEvent_t>> returned_;  // per slab, reused across returns
  std::vector<int> counts_;  // per slab: events of its last return (the first counts_[i])
};

// One dispatch's hold on a slab: every output tensor viewing it shares this (through a
// SlabView); the last one freed gives the slab back, ordered after every stream named here.
class SlabLease {
 public:
  SlabLease(std::shared_ptr<SlabPool> p, int i, cudaStream_t s)
      : pool_(std::move(p)), index_(i), streams_{s} {}
  SlabLease(const SlabLease&) = delete;  // exactly one lease gives the slab back
  SlabLease& operator=(const SlabLease&) = delete;
  ~SlabLease() { pool_->give_back(index_, streams_); }
  int index() const { return index_; }
  void add_stream(cudaStream_t s);

 private:
  const std::shared_ptr<SlabPool> pool_;
  const int index_;
  std::mutex mutex_;
  std::vector<cudaStream_t> streams_;
};

// A slab of the group's pool for outputs on `stream` (null: none free, or the group has none).
std::shared_ptr<SlabLease> lendSlab(const std::shared_ptr<SlabPool>& pool, cudaStream_t stream);

// An output array at `offset` of the lent slab (a view that keeps the lease), else a fresh tensor.
at::Tensor slabOutput(NvlinkRuntime& rt, const std::shared_ptr<SlabLease>& lease, size_t offset,
                      at::IntArrayRef sizes, const at::TensorOptions& opts);

}  // namespace ep::nvlink
