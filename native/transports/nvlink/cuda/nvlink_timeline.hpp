// Host side of the optional nvlink kernel timeline (see nvlink_timeline.cuh). Torch-free.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ep {

constexpr int kHtTimelineBlocks = 64;  // blocks stamped
// Slots per block: [0, 16) warp w's first work, [16, 32) warp w's role ended, then block stamps.
constexpr int kHtFirstSlot = 0;
constexpr int kHtEndSlot = 16;
constexpr int kHtBlockStart = 32;
constexpr int kHtBlockEnd = 33;
constexpr int kHtKernelEntry = 34;   // thread 0's first instruction
constexpr int kHtBlockExit = 35;     // thread 0 after the block's epoch bookkeeping
constexpr int kHtEnteredSeen = 36;   // dispatch: warp 0 saw its first destinations' "entered"
constexpr int kHtNotifiedSeen = 37;  // dispatch: warp 0 saw notify's results (behind notify)
constexpr int kHtTimelineSlots = 38;
// Notify's stamps (one block): entry, every peer's slot read, results released to the dispatch
// behind it, host counters written.
constexpr int kHtNotifyEntry = 0;
constexpr int kHtNotifyReceived = 1;
constexpr int kHtNotifyReleased = 2;
constexpr int kHtNotifyHost = 3;
constexpr int kHtNotifySlots = 4;

// Copy the last call's stamps (kHtTimelineBlocks * kHtTimelineSlots words, %globaltimer ns) of
// the dispatch (normal and cached) or the combine kernel. cudaErrorNotSupported unless the
// kernels were built with -DEP_HT_TIMELINE.
cudaError_t read_nvlink_dispatch_timeline(uint64_t* out);
cudaError_t read_nvlink_combine_timeline(uint64_t* out);
// The last notify's kHtNotifySlots stamps.
cudaError_t read_nvlink_notify_timeline(uint64_t* out);
// %globaltimer when the last barrier kernel finished waiting (one word).
cudaError_t read_nvlink_barrier_timeline(uint64_t* out);

}  // namespace ep
