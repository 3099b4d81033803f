// What the NVLink transport keeps per process group: its usability verdict, the runtime (IPC peer
// buffers, receive slabs) and the routings of the dispatch handles still alive. Only built with
// EP_WITH_CUDA.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <optional>
#include <string>

#include "backend/per_group_transport.hpp"
#include "backend/routing_memory.hpp"
#include "transports/nvlink/cuda/nvlink_runtime.hpp"
#include "transports/nvlink/nvlink_slab_pool.hpp"

namespace ep {

class EPProcessGroup;

namespace nvlink {

// Per-group transport state; created on a group's first CUDA MoE call, freed at its shutdown.
struct GroupState {
  GroupVerdict usability;  // whether the group's CUDA calls run here, or why they take ATen
  int generation = 0;
  std::unique_ptr<NvlinkRuntime> runtime;
  std::shared_ptr<SlabPool> slabs;  // the runtime's receive slabs (null: none)
  RoutingMemory routings;           // of the dispatch handles still alive
  // A CUDA graph was captured with kernels on this transport: rebuilding it would free buffers
  // those graphs replay into, so from then on it never grows (an agreed field of every call).
  bool graph_captured = false;
  // All-to-all calls run one at a time per rank: the stream of the last one, and an event that
  // orders a call on another stream behind it (recorded only when the stream changes).
  std::optional<c10::cuda::CUDAStream> a2a_last_stream;
  // Events created at first use and kept for the group's life (two per group).
  cudaEvent_t a2a_order = nullptr;
  cudaEvent_t a2a_comm_ready = nullptr;  // the comm stream waits for the caller's stream
  // The stream async_op all-to-alls run on (one per group, so they stay in order).
  std::optional<c10::cuda::CUDAStream> a2a_comm_stream;
};

// The group's state; with create=false null where the group has none yet.
std::shared_ptr<GroupState> stateOf(EPProcessGroup& pg, bool create = true);

// The prefix of this transport's keys in the group's store.
std::string keyPrefix(EPProcessGroup& pg);

}  // namespace nvlink
}  // namespace ep
