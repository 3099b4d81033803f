#ifdef EP_WITH_CUDA

#include "transports/nvlink/nvlink_usability.hpp"

#include <cuda_runtime_api.h>

#include <vector>

#include "backend/ep_process_group.hpp"
#include "backend/gpu_identity.hpp"
#include "backend/kernel_image.hpp"
#include "backend/store_exchange.hpp"
#include "common/env.hpp"
#include "transports/nvlink/cuda/nvlink_kernels.hpp"
#include "transports/nvlink/nvlink_group_state.hpp"

namespace ep::nvlink {

std::string decideUsable(EPProcessGroup& pg, const at::Device& device) {
  const int num_ranks = pg.getSize();
  const int rank = pg.getRank();
  // A group of one rank (EP=1 beside TP/DP) runs the kernels too: its dispatch is a local
  // permutation, which the ATen path did with host syncs at ~1 ms per call.
  if (num_ranks > kMaxRanks) {
    return "the group has " + std::to_string(num_ranks) +
           " ranks; the NVLink kernels serve at most " + std::to_string(kMaxRanks);
  }
  // Several nodes (found from the hosts, or emulated by Options.ranks_per_node): the legs
  // between them must take the internode path, never NVLink, even where one host could map them.
  // Every rank holds the same topology, so every rank returns here alike.
  const Topology& topology = pg.topology();
  if (topology.num_nodes > 1) {
    return "the group spans " + std::to_string(topology.num_nodes) + " nodes" +
           (topology.emulated
                ? " (emulated: ranks_per_node=" + std::to_string(topology.ranks_per_node) + ")"
                : "") +
           "; the NVLink kernels serve one node" +
           (topology.problem.empty() ? "" : " (and " + topology.problem + ")");
  }
  const bool asked_aten = env::equals<env::kHighThroughput>("aten");
  const std::string prefix = keyPrefix(pg) + "topology/";
  const std::vector<std::string> posted = allGatherStrings(
      pg, prefix, GpuPlace::of(device.index()).str(), "ep dispatch (transport setup)");
  std::vector<GpuPlace> places(num_ranks);
  for (int r = 0; r < num_ranks; ++r) places[r] = GpuPlace::parse(posted[r]);
  const GpuPlace& mine = places[rank];
  std::string why =
      asked_aten ? kAskedAten : kernelImageMissing(device.index(), &preload_nvlink_layout);
  for (int r = 0; r < num_ranks && why.empty(); ++r) {
    if (places[r].host != places[0].host) {
      why = "ranks 0 and " + std::to_string(r) + " are on different hosts (" + places[0].host +
            ", " + places[r].host + "); the NVLink kernels need every rank on one host";
      continue;
    }
    // The same GPU (ranks sharing one: CUDA IPC within the device) needs no peer access.
    if (r == rank || places[r].sameGpu(mine)) continue;
    // The peer's GPU as this process numbers it (indices differ between processes where
    // CUDA_VISIBLE_DEVICES does); invisible here: nothing to ask, CUDA IPC maps its memory all
    // the same.
    int local = places[r].index;
    if (places[r].knownBus() &&
        cudaDeviceGetByPCIBusId(&local, places[r].bus.c_str()) != cudaSuccess) {
      cudaGetLastError();  // not sticky
      continue;
    }
    int can = 0;
    cudaDeviceCanAccessPeer(&can, device.index(), local);
    if (!can) {
      why = "GPU " + std::to_string(mine.index) + " (" + mine.bus +
            ") has no peer access to rank " + std::to_string(r) + "'s GPU (" + places[r].bus + ")";
    }
  }
  bool all = true;
  int first_refusing = -1;
  const std::vector<std::string> verdicts = allGatherStrings(
      pg, prefix + "ok/", why.empty() ? "1" : "0", "ep dispatch (transport setup)");
  for (int r = 0; r < num_ranks; ++r) {
    if (verdicts[r] != "1" && first_refusing < 0) first_refusing = r;
    all = all && verdicts[r] == "1";
  }
  if (all) return "";
  return why.empty() ? "rank " + std::to_string(first_refusing) +
                           " cannot use them (see its high_throughput_transport)"
                     : why;
}

}  // namespace ep::nvlink

#endif  // EP_WITH_CUDA
