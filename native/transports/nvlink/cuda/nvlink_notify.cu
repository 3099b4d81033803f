// Notify: every rank tells every rank (itself included) how many tokens it will send there and
// how many (t, k) entries target each of the receiver's local experts; each receiver then knows
// its rows per source (recv_counts), where each source's rows start (recv_prefix) and its
// per-local-expert counts. In normal mode the totals also go to host-mapped memory, tagged with a
// ticket, so the host can size the outputs without a stream synchronisation.
//
// A rank whose layout kernel found an invalid topk_idx value (its error record says so: the
// runtime's own, or p.layout_error for a layout the caller computed earlier) sets bit
// 31 of every token count it announces; receivers report those ranks to the host, which then
// raises on every rank, and to the control block, where the dispatch kernel (launched before the
// host looked, when the host wait overlaps it) finds them and moves nothing. Normal mode only:
// worst-case mode has no host step, and its layout treated the values as -1.
//
// Each source also announces its token counts to every rank and the receive slab it lends the
// dispatch that follows (-1: none); from them every rank derives, for each destination, where
// its rows start in that rank's outputs and which slab to write them into (p.dest_slabs).
//
// Protocol: each value travels as one 64-bit word (sequence << 32 | value) written with a relaxed
// system-scope store, so every word is self-validating and no fence or flag is needed. The slots
// alternate by sequence parity: a peer may already run the next notify while we still read this
// one, but it cannot get two sequence numbers ahead (each kernel waits on every peer), so it never
// overwrites the parity we are reading.
//
// Paired with its dispatch (p.dispatch_follows, the worst-case and overlapped modes, where no host
// step sits between them): the dispatch kernel is launched behind this one with programmatic
// dependent launch and starts while this one runs, so its senders' first remote rows overlap the
// count exchange. The two share one sequence number: this kernel leaves the epoch alone and the
// dispatch, which waits for this kernel before it ends, advances it. A peer therefore still
// cannot reach our next-but-one notify before this one has finished.
#include "common/dynamic_smem.hpp"
#include "transports/nvlink/cuda/nvlink_device.cuh"
#include "transports/nvlink/cuda/nvlink_kernels.hpp"

namespace ep {
namespace {

constexpr int kNotifyThreads = 512;

__global__ void __launch_bounds__(kNotifyThreads, 1) nvlink_notify_kernel(NotifyParams p) {
  extern __shared__ int values[];  // [R][words]: what each source announced (untagged)
  __shared__ uint64_t s_seq;
  __shared__ int s_failed;
  __shared__ uint32_t s_rejected;  // kNotifyRejected when this rank's layout found an invalid id
  // A dispatch launched behind this kernel may start now: it needs our results only for its
  // local rows and receivers, and waits for them there.
  device::launch_dependents();
  const CommContext& c = p.comm;
  const int R = c.num_ranks, me = c.rank, tid = threadIdx.x;
  ControlBlock* ctrl = reinterpret_cast<ControlBlock*>(c.buffers.ptr[me]);
  const int E_loc = p.experts_per_rank;
  // [count][per local expert x E_loc][our counts to every rank x R][our lent slab]
  const NotifyWords nw = NotifyWords::make(E_loc, R);
  const int words = nw.total;
  const int sent_word = nw.sent, slab_word = nw.slab;
  // Word i of what we announce (i = dst * words + w), without the sequence tag.
  const auto announced = [&](int i) {
    const int dst = i / words, w = i % words;
    return w == 0 ? uint32_t(p.num_tokens_per_rank[dst])
           : w < sent_word
               ? uint32_t(p.num_tokens_per_expert[dst * E_loc + w - NotifyWords::per_expert])
           : w < slab_word ? uint32_t(p.num_tokens_per_rank[w - sent_word])
                           : uint32_t(p.lend_slab);
  };
  // This thread's first word is loaded while thread 0 reads the sequence (one memory latency
  // less before the exchange).
  const uint32_t first_word = tid < R * words ? announced(tid) : 0u;
  if (tid == 0) {
    // The lock (device memory; ours shares the sequence's line) says whether any error was
    // recorded; only then is the host-mapped record read: a PCIe round trip, otherwise paid
    // before the first send on every call.
    const bool own = p.layout_error == nullptr;
    const int locked =
        *static_cast<const volatile int*>(own ? &ctrl->error_lock : p.layout_error_lock);
    s_seq = device::read_sequence(ctrl);
    s_failed = 0;
    uint32_t rejected = 0;
    if (locked != 0) {
      const volatile ErrorRecord* err = own ? c.error : p.layout_error;
      rejected = err->code == kErrorInvalidTopkIdx && err->op == kOpLayout ? kNotifyRejected : 0u;
    }
    s_rejected = rejected;
  }
  __syncthreads();
  const uint64_t seq = s_seq;
  const uint32_t seq32 = static_cast<uint32_t>(seq);
  const uint64_t tag = static_cast<uint64_t>(seq32) << 32;
  const int parity = static_cast<int>(seq & 1);
  const device::WaitContext ctx{ctrl, c.error, c.timeout_cycles, kOpNotify, me};

  if (!device::aborted(ctx)) {
    // Send: slot (parity, me) of every rank's buffer.
    for (int i = tid; i < R * words; i += kNotifyThreads) {
      const int dst = i / words, w = i % words;
      const uint32_t v = (i == tid ? first_word : announced(i)) | (w == 0 ? s_rejected : 0u);
      uint64_t* slot = reinterpret_cast<uint64_t*>(c.buffers.ptr[dst] + c.layout.notify_offset) +
                       c.layout.notify_slot(parity, me) + w;
      device::st_relaxed_sys(slot, tag | v);
    }
    // Receive: every source's slot in our buffer.
    const uint64_t* area =
        reinterpret_cast<const uint64_t*>(c.buffers.ptr[me] + c.layout.notify_offset);
    for (int i = tid; i < R * words; i += kNotifyThreads) {
      const int src = i / words, w = i % words;
      const uint64_t* slot = area + c.layout.notify_slot(parity, src) + w;
      uint64_t v = 0;
      const bool ok = device::spin_wait(ctx, src, [&] {
        v = device::ld_relaxed_sys(slot);
        return static_cast<uint32_t>(v >> 32) == seq32;
      });
      if (!ok) s_failed = 1;
      values[i] = ok ? static_cast<int>(static_cast<uint32_t>(v)) : 0;
    }
  }
  __syncthreads();

  const bool write_host = p.host != nullptr && !s_failed;
  if (tid == 0) {
    int total = 0, rejected = 0;
    for (int s = 0; s < R; ++s) {
      const uint32_t word = static_cast<uint32_t>(values[s * words]);
      if (word & kNotifyRejected) rejected |= 1 << s;
      const int n = static_cast<int>(word & ~kNotifyRejected);
      p.recv_counts[s] = n;
      p.recv_prefix[s] = total;
      total += n;
    }
    p.recv_prefix[R] = total;
    // Where our rows start in every rank's output (the rows of lower ranks come first) and the
    // slab it lent: senders write into a lent slab directly.
    if (p.dest_slabs != nullptr) {
      for (int d = 0; d < R; ++d) {
        int base = 0;
        for (int s = 0; s < me; ++s) base += values[s * words + sent_word + d];
        p.dest_slabs[2 * d] = base;
        p.dest_slabs[2 * d + 1] = s_failed ? -1 : values[d * words + slab_word];
      }
    }
    ctrl->rejected_ranks = p.host != nullptr ? rejected : 0;
    // The dispatch behind us needs only the prefix and the verdict: let it go before the
    // per-expert counts and the host-mapped copies (whose system fences take microseconds).
    if (p.dispatch_follows) ptx::st_release_gpu(&ctrl->notified, seq);
    if (write_host) {  // after the release: its fence need not wait for these PCIe writes
      for (int s = 0; s < R; ++s) {
        p.host->num_recv_tokens_per_rank[s] =
            static_cast<int>(static_cast<uint32_t>(values[s * words]) & ~kNotifyRejected);
        // What we announced to s (our own slot), not a reload of the layout's counts.
        p.host->num_send_tokens_per_rank[s] = values[me * words + sent_word + s];
      }
      p.host->num_recv_tokens = total;
      p.host->rejected_ranks = rejected;
    }
    if (p.num_worst_tokens > 0 && total > p.num_worst_tokens) {
      device::WaitContext dispatch_ctx = ctx;  // the user-facing op is the dispatch
      dispatch_ctx.op = kOpDispatch;
      device::report_error(dispatch_ctx, kErrorCapacity, -1, total, p.num_worst_tokens);
    }
  }
  for (int e = tid; e < E_loc; e += kNotifyThreads) {
    int n = 0;
    for (int s = 0; s < R; ++s) n += values[s * words + NotifyWords::per_expert + e];
    const int a = p.expert_alignment;
    n = (n + a - 1) / a * a;
    p.num_recv_tokens_per_expert[e] = n;
    if (write_host) p.host_per_expert[e] = n;
  }
  __syncthreads();
  if (tid == 0) {
    if (write_host) {
      __threadfence_system();  // counters before the ticket
      p.host->ready_ticket = p.host_ticket;
      __threadfence_system();
    }
    // Paired with a dispatch: the pair shares one sequence number and the dispatch advances
    // the epoch (it may already have read it: advancing it here would race with that read).
    if (!p.dispatch_follows) device::finish_block(ctrl, seq);
  }
}

}  // namespace

cudaError_t preload_nvlink_notify() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, nvlink_notify_kernel);
}

cudaError_t launch_nvlink_notify(const NotifyParams& p, cudaStream_t stream) {
  const size_t smem = size_t(p.comm.num_ranks) *
                      NotifyWords::make(p.experts_per_rank, p.comm.num_ranks).total * sizeof(int);
  static std::atomic<size_t> allowed[64];
  const cudaError_t e = allow_dynamic_smem(nvlink_notify_kernel, smem, allowed);
  if (e != cudaSuccess) return e;
  nvlink_notify_kernel<<<1, kNotifyThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace ep
