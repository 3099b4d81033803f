// The all-to-all kernel of the nvlink runtime: every rank's bytes for every other rank stream
// through staging rings in the destination's buffer (BufferLayout::a2a_*), and this rank's own
// segment is copied straight from input to output.
//
// Blocks: [(R-1) x lanes senders][(R-1) x lanes receivers][kA2ASelfBlocks self copies]. Sender
// lane j of the pair (me -> d) first waits until receiver lane j at d is done with the previous
// all-to-all (a credit word in the sender's buffer, (seq << 32 | kA2ADone)), then writes its
// header line at d: the bytes the pair moves, flagged with this call's value (see the lines
// below). A pair of at most kA2ALinesMaxBytes (host splits) then goes by flagged lines: each
// lane writes its share of the bytes as 16-byte lines {4 bytes, flag, 4 bytes, flag} into the
// pair's line region at d, and receiver lane j polls each line until both flags match, copies
// its 8 bytes out and returns a done credit. No fence is on that path: an 8-byte half of a line
// lands whole, and a stale line carries an older call's flag.
// Larger pairs (and all device-split calls) stream through the staging ring: lane j pushes
// chunks j, j + lanes, ... into its ring of kA2ASlots slots at d and flags each slot with
// (seq << 32 | k + 1), k counting the lane's chunks of this call; the receiver waits for the flag,
// copies the chunk to the output (HBM) and returns the slot with a credit (same encoding). The
// chunk size is the pair's (a2a_chunk_bytes of the bytes the header announces, so a receiver
// never cuts the stream elsewhere than its sender). The header also decides the protocol, so
// ranks whose split sizes disagree still agree on it (the receiver then drops the bytes and
// records the mismatch).
//
// Every call also announces (seq; with device splits the row counts per local expert) from every
// rank to every rank, in a slot of the call's parity. Waiting for all announcements is the
// handshake that keeps ranks at most one call apart, which is what makes two parities enough: a
// rank writing call n's announcement finished call n - 1, whose handshake saw every peer in call n
// - 1, so every peer has read call n - 2's.
//
// Why staging and not a direct write into the peer's output: the output is a tensor of the
// caching allocator, whose address changes every call; mapping it into the peers would take a
// host exchange of IPC handles per call (tens of microseconds, and no CUDA graph). The staging
// copy runs out of HBM (~2 TB/s) while NVLink (~350 GB/s) is the bottleneck, and the ring
// pipelines the two, so it costs SM time, not transfer time.
#include "transports/nvlink/cuda/nvlink_device.cuh"
#include "transports/nvlink/cuda/nvlink_kernels.hpp"

namespace ep {
namespace {

using device::fence_acq_rel_sys;
using device::ld_acquire_sys;
using device::ld_relaxed_sys;
using device::st_release_sys;
using device::WaitContext;

__device__ __forceinline__ uint64_t* word_at(char* buffer, size_t offset, size_t index) {
  return reinterpret_cast<uint64_t*>(buffer + offset) + index;
}

__device__ __forceinline__ uint64_t tag(uint64_t seq, uint64_t count) {
  return (seq << 32) | count;
}

// 16, 4 or 1 bytes, from local memory (input) or from the staging ring (written by a peer during
// this kernel: L2 loads, never a stale L1 line of the slot's previous chunk).
template <bool kFromPeer>
__device__ __forceinline__ int4 load16(const int4* p) {
  if constexpr (kFromPeer) {
    return ptx::ld_cg_v4(p);
  } else {
    return ptx::ld_nc_v4_no_l2_prefetch(p);
  }
}

template <bool kFromPeer>
__device__ __forceinline__ int load4(const int* p) {
  if constexpr (kFromPeer) {
    return ptx::ld_cg_s32(p);
  } else {
    return *p;
  }
}

template <bool kFromPeer>
__device__ __forceinline__ char load1(const char* p) {
  if constexpr (kFromPeer) {
    return *reinterpret_cast<const volatile char*>(p);
  } else {
    return *p;
  }
}

// The block copies n bytes: 16-byte vectors (four in flight per thread) when both ends are
// 16-byte aligned, else 4-byte words when they are 4-byte aligned, and single bytes for the rest.
template <bool kFromPeer>
__device__ void block_copy(char* dst, const char* src, long long n) {
  const int t = threadIdx.x, nt = blockDim.x;
  const uintptr_t ends = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  long long done = 0;
  if ((ends & 15) == 0) {
    constexpr int kUnroll = 4;
    const long long nv = n >> 4;
    const int4* s4 = reinterpret_cast<const int4*>(src);
    int4* d4 = reinterpret_cast<int4*>(dst);
    long long i = t;
    for (; i + (kUnroll - 1) * nt < nv; i += kUnroll * nt) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = load16<kFromPeer>(s4 + i + u * nt);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) d4[i + u * nt] = v[u];
    }
    for (; i < nv; i += nt) d4[i] = load16<kFromPeer>(s4 + i);
    done = nv << 4;
  } else if ((ends & 3) == 0) {
    const long long nw = n >> 2;
    const int* s4 = reinterpret_cast<const int*>(src);
    int* d4 = reinterpret_cast<int*>(dst);
    for (long long i = t; i < nw; i += nt) d4[i] = load4<kFromPeer>(s4 + i);
    done = nw << 2;
  }
  for (long long i = done + t; i < n; i += nt) dst[i] = load1<kFromPeer>(src + i);
}

// What every block of one call shares: its sequence number, the previous all-to-all's, the
// announcement parity, and (device splits) the row counts and output offsets.
struct Shared {
  uint64_t seq;
  uint64_t prev;
  uint64_t calls;
  int fail;
  long long pair_bytes;  // host splits, receivers: the bytes the source sends (its header line)
  int valid;             // device splits: this rank's splits are valid
  long long min_split;
  long long total_send;                     // device splits: rows this rank's splits send in all
  unsigned long long send_rows[kMaxRanks];  // device splits: rows this rank sends to each rank
  long long send_start[kMaxRanks];          // their first input row
  long long total_rows;                     // device splits: rows this rank receives in all
  long long src_rows[kMaxRanks];            // rows from each source
  long long counts[kMaxRanks * kA2AMaxLocalExperts];    // [s][e] rows from s for expert e
  long long out_rows[kMaxRanks * kA2AMaxLocalExperts];  // [s][e] their first output row
  long long expert_rows[kA2AMaxLocalExperts];
};

// Device splits: the rows this rank sends to each rank, where they start in the input, and
// whether the splits are valid (none negative, their sum within the input).
__device__ void plan_sends(const AllToAllParams& p, Shared& sh, int R) {
  const int t = threadIdx.x, E = p.num_local_experts;
  if (t < kMaxRanks) sh.send_rows[t] = 0;
  if (t == 0) sh.min_split = 0;
  __syncthreads();
  for (int i = t; i < R * E; i += blockDim.x) {
    const long long v = p.splits[i];
    if (v < 0) {
      atomicMin(&sh.min_split, v);
    } else {
      atomicAdd(&sh.send_rows[i / E], static_cast<unsigned long long>(v));
    }
  }
  __syncthreads();
  if (t == 0) {
    long long start = 0;
    for (int d = 0; d < R; ++d) {
      sh.send_start[d] = start;
      start += static_cast<long long>(sh.send_rows[d]);
    }
    sh.total_send = start;
    sh.valid = sh.min_split >= 0 && start <= p.input_rows;
    if (!sh.valid) {
      for (int d = 0; d < R; ++d) sh.send_rows[d] = 0;
    }
  }
  __syncthreads();
}

// The bytes this rank sends to rank `d` and their first input byte: from the device splits
// (planned here) or from the host's byte counts.
__device__ __forceinline__ void send_segment(const AllToAllParams& p, Shared& sh, int R, int d,
                                             long long& bytes, long long& offset) {
  if (p.splits != nullptr) {
    plan_sends(p, sh, R);
    bytes = static_cast<long long>(sh.send_rows[d]) * p.row_bytes;
    offset = sh.send_start[d] * p.row_bytes;
  } else {
    bytes = p.send_bytes[d];
    offset = p.send_offset[d];
  }
}

// The announcement slot (parity, src) in `buffer`: [seq][rows per local expert].
__device__ __forceinline__ uint64_t* announce_slot(const CommContext& c, char* buffer, int parity,
                                                   int src) {
  return word_at(buffer, c.layout.a2a_announce_offset,
                 (size_t(parity) * c.num_ranks + src) * (1 + kA2AMaxLocalExperts));
}

// Tells rank d this call started (and, with device splits, the rows it gets per local expert).
__device__ void announce(const AllToAllParams& p, const Shared& sh, int d, int parity) {
  const CommContext& c = p.comm;
  uint64_t* slot = announce_slot(c, c.buffers.ptr[d], parity, c.rank);
  if (p.splits != nullptr) {
    const int E = p.num_local_experts;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      const long long v = sh.valid ? p.splits[d * E + e] : 0;
      device::st_relaxed_sys(slot + 1 + e, static_cast<uint64_t>(v));
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_sys();
    st_release_sys(slot, sh.seq);
  }
}

// Waits for every rank's announcement of this call; with device splits then fills the counts and
// the output offsets (grouped by local expert, then by source). False on timeout or abort.
__device__ bool gather_announcements(const AllToAllParams& p, Shared& sh, const WaitContext& ctx,
                                     int parity) {
  const CommContext& c = p.comm;
  const int t = threadIdx.x, R = c.num_ranks, E = p.num_local_experts;
  char* mine = c.buffers.ptr[c.rank];
  if (t < R) {
    const uint64_t* slot = announce_slot(c, mine, parity, t);
    if (!device::spin_wait(ctx, t, [&] { return device::flag_arrived(slot, sh.seq); }))
      atomicExch(&sh.fail, 1);
  }
  __syncthreads();
  if (sh.fail) return false;
  if (p.splits == nullptr) return true;
  for (int i = t; i < R * E; i += blockDim.x) {
    const int s = i / E, e = i % E;
    sh.counts[i] =
        static_cast<long long>(ld_relaxed_sys(announce_slot(c, mine, parity, s) + 1 + e));
  }
  __syncthreads();
  for (int e = t; e < E; e += blockDim.x) {
    long long rows = 0;
    for (int s = 0; s < R; ++s) rows += sh.counts[s * E + e];
    sh.expert_rows[e] = rows;
  }
  if (t < R) {
    long long rows = 0;
    for (int e = 0; e < E; ++e) rows += sh.counts[t * E + e];
    sh.src_rows[t] = rows;
  }
  __syncthreads();
  if (t == 0) {
    long long start = 0;
    for (int e = 0; e < E; ++e) {
      const long long rows = sh.expert_rows[e];
      sh.expert_rows[e] = start;
      start += rows;
    }
    sh.total_rows = start;
  }
  __syncthreads();
  for (int e = t; e < E; e += blockDim.x) {
    long long row = sh.expert_rows[e];
    for (int s = 0; s < R; ++s) {
      sh.out_rows[s * E + e] = row;
      row += sh.counts[s * E + e];
    }
  }
  __syncthreads();
  return true;
}

// Copies bytes [pos, pos + len) of the stream from source s (its segments for this rank, in
// order) from `src` to where they belong in the output. Device splits: the stream is E segments
// (one per local expert) placed at out_rows; `cursor_e` / `cursor_start` walk them (a lane's
// chunks come in increasing order).
template <bool kFromPeer>
__device__ void place(const AllToAllParams& p, const Shared& sh, int s, const char* src,
                      long long pos, long long len, int& cursor_e, long long& cursor_start) {
  if (p.splits == nullptr) {
    block_copy<kFromPeer>(p.output + p.recv_offset[s] + pos, src, len);
    return;
  }
  const int E = p.num_local_experts;
  const long long rb = p.row_bytes;
  const long long end = pos + len;
  while (cursor_e < E && cursor_start + sh.counts[s * E + cursor_e] * rb <= pos) {
    cursor_start += sh.counts[s * E + cursor_e] * rb;
    ++cursor_e;
  }
  long long seg_start = cursor_start;
  for (int e = cursor_e; e < E && seg_start < end; ++e) {
    const long long seg = sh.counts[s * E + e] * rb;
    const long long from = pos > seg_start ? pos : seg_start;
    const long long to = end < seg_start + seg ? end : seg_start + seg;
    if (to > from) {
      block_copy<kFromPeer>(p.output + sh.out_rows[s * E + e] * rb + (from - seg_start),
                            src + (from - pos), to - from);
    }
    seg_start += seg;
  }
}

// ---- flagged lines (a2a_lines_*): a line is {data[0:4], flag, data[4:8], flag}, one 16-byte store
__device__ __forceinline__ void store_line(char* line, uint64_t v, uint32_t flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(line),
               "r"(static_cast<uint32_t>(v)), "r"(flag), "r"(static_cast<uint32_t>(v >> 32)),
               "r"(flag)
               : "memory");
}

// True once the line carries `flag` in both halves; then `v` is its 8 data bytes.
__device__ __forceinline__ bool load_line(const char* line, uint32_t flag, uint64_t& v) {
  uint32_t a, b, c, d;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(a), "=r"(b), "=r"(c), "=r"(d)
               : "l"(line)
               : "memory");
  v = static_cast<uint64_t>(a) | (static_cast<uint64_t>(c) << 32);
  return b == flag && d == flag;
}

// `n` (1..8) bytes at `src` as the low bytes of a word (any alignment).
__device__ __forceinline__ uint64_t gather_bytes(const char* src, int n) {
  if (n == 8 && (reinterpret_cast<uintptr_t>(src) & 7) == 0) {
    return *reinterpret_cast<const uint64_t*>(src);
  }
  uint64_t v = 0;
  for (int i = 0; i < n; ++i)
    v |= static_cast<uint64_t>(static_cast<unsigned char>(src[i])) << (8 * i);
  return v;
}

__device__ __forceinline__ void scatter_bytes(char* dst, uint64_t v, int n) {
  if (n == 8 && (reinterpret_cast<uintptr_t>(dst) & 7) == 0) {
    *reinterpret_cast<uint64_t*>(dst) = v;
    return;
  }
  for (int i = 0; i < n; ++i) dst[i] = static_cast<char>(v >> (8 * i));
}

// The line region of source `src` in `buffer` (a receiver's): header lines, then data lines.
__device__ __forceinline__ char* lines_region(const CommContext& c, char* buffer, int region) {
  return buffer + c.layout.a2a_lines_offset + size_t(region) * c.layout.a2a_lines_region_bytes;
}

// Whether a pair moving `bytes` goes by flagged lines (host splits only: with device splits the
// receiver places rows per expert, which the ring's chunk copies do).
__device__ __forceinline__ bool by_lines(const AllToAllParams& p, long long bytes) {
  return p.splits == nullptr && bytes <= kA2ALinesMaxBytes;
}

// The payload lines [first, last) of `lane` of a pair moving `bytes` (8 bytes a line).
__device__ __forceinline__ void lane_lines(long long bytes, int lane, int lanes, long long& first,
                                           long long& last) {
  const long long units = (bytes + 7) / 8;
  first = units * lane / lanes;
  last = units * (lane + 1) / lanes;
}

// Host splits: the bytes source s sends this rank, from this lane's header line. They decide the
// protocol and the ring's chunking (the sender's), so a rank whose split sizes disagree with its
// peer's still reads exactly what it is sent; it then writes none of it (`drop`) and records the
// mismatch, which the next call on the group raises. False on timeout or abort.
__device__ bool header_bytes(const AllToAllParams& p, Shared& sh, const WaitContext& ctx, int s,
                             int pair, int lane, uint32_t flag, long long& bytes, bool& drop) {
  const CommContext& c = p.comm;
  const char* header = lines_region(c, c.buffers.ptr[c.rank], pair) + size_t(lane) * 16;
  if (threadIdx.x == 0) {
    uint64_t v = 0;
    if (!device::spin_wait(ctx, s, [&] { return load_line(header, flag, v); })) sh.fail = 1;
    sh.pair_bytes = static_cast<long long>(v);
  }
  __syncthreads();
  if (sh.fail) return false;
  bytes = sh.pair_bytes;
  drop = bytes != p.recv_bytes[s];
  if (drop && threadIdx.x == 0) {
    device::report_error(ctx, kErrorSplitMismatch, s, bytes, p.recv_bytes[s]);
  }
  return true;
}

__device__ void run_sender(const AllToAllParams& p, Shared& sh, const WaitContext& ctx, int pair,
                           int lane, int parity) {
  const CommContext& c = p.comm;
  const int me = c.rank, R = c.num_ranks, L = c.layout.a2a_lanes, t = threadIdx.x;
  const int d = (me + 1 + pair) % R;
  long long bytes, offset;
  send_segment(p, sh, R, d, bytes, offset);
  if (lane == 0) announce(p, sh, d, parity);
  const uint64_t seq = sh.seq;
  const uint32_t flag = a2a_line_flag(seq);
  const uint64_t* credit = word_at(c.buffers.ptr[me], c.layout.a2a_credit_offset, d * L + lane);
  // The receiver's lane must be done with the previous all-to-all (its header line, lines and
  // slots) before anything of this call lands there.
  if (t == 0 && sh.prev != 0) {
    const uint64_t need = tag(sh.prev, kA2ADone);
    if (!device::spin_wait(ctx, d, [&] { return ld_acquire_sys(credit) >= need; })) sh.fail = 1;
  }
  __syncthreads();
  if (sh.fail) return;
  char* lines = lines_region(c, c.buffers.ptr[d], c.layout.region_index(me, d));
  if (t == 0) store_line(lines + size_t(lane) * 16, static_cast<uint64_t>(bytes), flag);
  if (by_lines(p, bytes)) {
    long long first, last;
    lane_lines(bytes, lane, L, first, last);
    const char* src = p.input + offset;
    char* data = lines + size_t(L) * 16;
    for (long long u = first + t; u < last; u += blockDim.x) {
      const int n = bytes - 8 * u < 8 ? static_cast<int>(bytes - 8 * u) : 8;
      store_line(data + size_t(u) * 16, gather_bytes(src + 8 * u, n), flag);
    }
    return;
  }
  const size_t ring = size_t(c.layout.region_index(me, d)) * L + lane;
  char* stage =
      c.buffers.ptr[d] + c.layout.a2a_staging_offset + ring * kA2ASlots * kA2AMaxChunkBytes;
  uint64_t* flags = word_at(c.buffers.ptr[d], c.layout.a2a_flags_offset, ring * kA2ASlots);
  const long long chunk = a2a_chunk_bytes(bytes, L);
  const long long chunks = (bytes + chunk - 1) / chunk;
  int k = 0;
  for (long long ch = lane; ch < chunks; ch += L, ++k) {
    const int slot = k % kA2ASlots;
    if (t == 0 && k >= kA2ASlots) {
      const uint64_t need = tag(seq, k - kA2ASlots + 1);
      if (!device::spin_wait(ctx, d, [&] { return ld_acquire_sys(credit) >= need; })) sh.fail = 1;
    }
    __syncthreads();
    if (sh.fail) return;
    const long long pos = ch * chunk;
    const long long len = bytes - pos < chunk ? bytes - pos : chunk;
    block_copy<false>(stage + size_t(slot) * kA2AMaxChunkBytes, p.input + offset + pos, len);
    __syncthreads();
    if (t == 0) {
      fence_acq_rel_sys();
      st_release_sys(flags + slot, tag(seq, k + 1));
    }
  }
}

__device__ void run_receiver(const AllToAllParams& p, Shared& sh, const WaitContext& ctx, int pair,
                             int lane, int parity) {
  const CommContext& c = p.comm;
  const int me = c.rank, R = c.num_ranks, L = c.layout.a2a_lanes, t = threadIdx.x;
  const int s = (me + 1 + pair) % R;  // region_index(s, me) == pair
  const uint64_t seq = sh.seq;
  const uint32_t flag = a2a_line_flag(seq);
  uint64_t* credit = word_at(c.buffers.ptr[s], c.layout.a2a_credit_offset, me * L + lane);
  long long bytes = 0;
  bool drop = false;
  if (p.splits != nullptr) {
    if (!gather_announcements(p, sh, ctx, parity)) return;
    bytes = sh.src_rows[s] * p.row_bytes;
    drop = sh.total_rows > p.capacity_rows;  // overflow: consume the chunks, write nothing
  } else if (!header_bytes(p, sh, ctx, s, pair, lane, flag, bytes, drop)) {
    return;
  }
  if (by_lines(p, bytes)) {
    if (!drop) {
      long long first, last;
      lane_lines(bytes, lane, L, first, last);
      const char* data = lines_region(c, c.buffers.ptr[me], pair) + size_t(L) * 16;
      char* dst = p.output + p.recv_offset[s];
      for (long long u = first + t; u < last; u += blockDim.x) {
        uint64_t v = 0;
        const char* line = data + size_t(u) * 16;
        if (!device::spin_wait(ctx, s, [&] { return load_line(line, flag, v); })) {
          sh.fail = 1;
          break;
        }
        scatter_bytes(dst + 8 * u, v, bytes - 8 * u < 8 ? static_cast<int>(bytes - 8 * u) : 8);
      }
    }
    __syncthreads();
    if (sh.fail) return;
    if (t == 0) st_release_sys(credit, tag(seq, kA2ADone));
    return;
  }
  const size_t ring = size_t(pair) * L + lane;
  const char* stage =
      c.buffers.ptr[me] + c.layout.a2a_staging_offset + ring * kA2ASlots * kA2AMaxChunkBytes;
  const uint64_t* flags = word_at(c.buffers.ptr[me], c.layout.a2a_flags_offset, ring * kA2ASlots);
  const long long chunk = a2a_chunk_bytes(bytes, L);
  const long long chunks = (bytes + chunk - 1) / chunk;
  int cursor_e = 0;
  long long cursor_start = 0;
  int k = 0;
  for (long long ch = lane; ch < chunks; ch += L, ++k) {
    const int slot = k % kA2ASlots;
    if (t == 0) {
      const uint64_t want = tag(seq, k + 1);
      if (!device::spin_wait(ctx, s, [&] { return device::flag_arrived(flags + slot, want); }))
        sh.fail = 1;
    }
    __syncthreads();
    if (sh.fail) return;
    const long long pos = ch * chunk;
    const long long len = bytes - pos < chunk ? bytes - pos : chunk;
    if (!drop) {
      place<true>(p, sh, s, stage + size_t(slot) * kA2AMaxChunkBytes, pos, len, cursor_e,
                  cursor_start);
    }
    __syncthreads();
    if (t == 0) st_release_sys(credit, tag(seq, k + 1));
  }
  __syncthreads();
  if (t == 0) st_release_sys(credit, tag(seq, kA2ADone));
}

// This rank's own segment (input -> output, HBM); block 0 also announces to this rank, takes the
// handshake, and with device splits writes recv_splits / recv_offsets and reports errors.
__device__ void run_self(const AllToAllParams& p, Shared& sh, const WaitContext& ctx, int index,
                         int parity) {
  const CommContext& c = p.comm;
  const int me = c.rank, R = c.num_ranks, t = threadIdx.x, E = p.num_local_experts;
  long long bytes, offset;
  send_segment(p, sh, R, me, bytes, offset);
  if (index == 0) announce(p, sh, me, parity);
  bool drop = false;
  if (index == 0 || p.splits != nullptr) {
    if (!gather_announcements(p, sh, ctx, parity)) return;
  }
  if (p.splits != nullptr) {
    drop = sh.total_rows > p.capacity_rows;
    if (index == 0) {
      for (int i = t; i < R * E; i += blockDim.x) {
        const int s = i / E, e = i % E;
        p.recv_splits[e * R + s] = sh.counts[i];
        p.recv_offsets[e * R + s] = sh.out_rows[i];
      }
      if (t == 0 && !sh.valid) {
        device::report_error(ctx, kErrorInvalidSplits, -1,
                             sh.min_split < 0 ? sh.min_split : sh.total_send, p.input_rows);
      }
      if (t == 0 && drop) {
        device::report_error(ctx, kErrorCapacity, -1, sh.total_rows, p.capacity_rows);
      }
    }
  }
  if (drop) return;
  const long long chunks = (bytes + kA2ASelfChunkBytes - 1) / kA2ASelfChunkBytes;
  int cursor_e = 0;
  long long cursor_start = 0;
  for (long long ch = index; ch < chunks; ch += kA2ASelfBlocks) {
    const long long pos = ch * kA2ASelfChunkBytes;
    const long long len = bytes - pos < kA2ASelfChunkBytes ? bytes - pos : kA2ASelfChunkBytes;
    place<false>(p, sh, me, p.input + offset + pos, pos, len, cursor_e, cursor_start);
  }
}

__global__ void __launch_bounds__(kA2AThreads, 1) nvlink_all_to_all_kernel(AllToAllParams p) {
  const CommContext& c = p.comm;
  const int me = c.rank, R = c.num_ranks, L = c.layout.a2a_lanes;
  char* mine = c.buffers.ptr[me];
  ControlBlock* ctrl = reinterpret_cast<ControlBlock*>(mine);
  uint64_t* private_words = word_at(mine, c.layout.a2a_private_offset, 0);
  __shared__ Shared sh;
  if (threadIdx.x == 0) {
    sh.seq = device::read_sequence(ctrl);
    sh.prev = ld_relaxed_sys(private_words);
    sh.calls = ld_relaxed_sys(private_words + 1);
    sh.fail = 0;
    sh.valid = 1;
  }
  __syncthreads();
  const WaitContext ctx{ctrl, c.error, c.timeout_cycles, kOpAllToAll, me};
  const int parity = static_cast<int>(sh.calls & 1);
  const int pairs = (R - 1) * L;
  const int b = blockIdx.x;
  if (!device::aborted(ctx)) {
    if (b < pairs) {
      run_sender(p, sh, ctx, b / L, b % L, parity);
    } else if (b < 2 * pairs) {
      run_receiver(p, sh, ctx, (b - pairs) / L, (b - pairs) % L, parity);
    } else {
      run_self(p, sh, ctx, b - 2 * pairs, parity);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint64_t seq = sh.seq, calls = sh.calls;
    device::finish_block(ctrl, seq, [&] {
      private_words[0] = seq;
      private_words[1] = calls + 1;
    });
  }
}

}  // namespace

cudaError_t preload_nvlink_all_to_all() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, nvlink_all_to_all_kernel);
}

cudaError_t launch_nvlink_all_to_all(const AllToAllParams& p, cudaStream_t stream) {
  const int pairs = (p.comm.num_ranks - 1) * p.comm.layout.a2a_lanes;
  nvlink_all_to_all_kernel<<<2 * pairs + kA2ASelfBlocks, kA2AThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace ep
