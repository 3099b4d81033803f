// What the NVLink transport keeps per process group: its usability verdict, the runtime (IPC peer
// buffers, receive slabs) and the routings of the dispatch handles still alive. Only built with
// EP_WITH_CUDA.
#pragma once

#include <memory>
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
};

std::shared_ptr<GroupState> stateOf(EPProcessGroup& pg);

// The prefix of this transport's keys in the group's store.
std::string keyPrefix(EPProcessGroup& pg);

}  // namespace nvlink
}  // namespace ep
