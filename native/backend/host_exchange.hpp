// HostExchange: an all-gather of small fixed-width int64 rows among the ranks of one group that
// share a host, through a POSIX shared-memory segment. It carries the per-call agreement of the
// MoE collectives (a few hundred bytes per rank) in about a microsecond, where a Gloo all-gather
// over loopback TCP costs tens to hundreds of microseconds.
//
// Protocol: rank r owns two slots (by call parity), each a sequence word followed by the row.
// A call writes its row into slot[call % 2], then publishes the call number with a release
// store; readers wait (acquire) until every rank's slot holds that call number. A rank cannot
// get two calls ahead of a peer (call n+1 waits for every rank to publish n+1, which each does
// only after reading call n), so the slot of the parity being read is never overwritten.
//
// Every rank must call gather() with the same call number sequence and the same row width.
// A rank that does not arrive within the timeout is named in the error; a rank that gave up on
// the group (abandon()) is named at once, a rank whose process is gone within kProbeEvery.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace ep {

class EPProcessGroup;

class HostExchange {
 public:
  // Words of a row the segment holds; wider rows go through Gloo (callers check fits()).
  static constexpr int64_t kCapacityWords = 256;

  // Collective over the group's store: returns null (on every rank alike) when the ranks are not
  // all on one host or shared memory cannot be set up, in which case callers use Gloo.
  // `what` names the call for the error raised when a rank never takes part.
  static std::unique_ptr<HostExchange> connect(EPProcessGroup& pg, const std::string& what);

  ~HostExchange();
  HostExchange(const HostExchange&) = delete;
  HostExchange& operator=(const HostExchange&) = delete;

  static bool fits(int64_t width) { return width <= kCapacityWords; }

  // All ranks' rows, rank-major, into `out` ([R * width] words: the caller's tensor, so that a
  // call copies the rows once). Throws c10::Error naming the ranks that did not arrive within
  // `timeout`.
  void gather(const std::vector<int64_t>& row, int64_t* out, const char* op,
              std::chrono::milliseconds timeout);

  // How to find peers whose process is gone (peer_liveness.hpp): a wait that lasts longer than
  // kProbeEvery asks it every kProbeEvery, and fails at once naming the dead ranks it waits for,
  // instead of waiting out the timeout for ranks that can never arrive.
  void setDeadPeerProbe(std::function<std::vector<int64_t>()> probe) { probe_ = std::move(probe); }

  // µs the last gather() spent waiting for its peers' rows after posting its own.
  double lastWaitUs() const { return last_wait_us_; }
  static constexpr std::chrono::milliseconds kProbeEvery{500};

  // Marks both of this rank's slots "gave up": a peer waiting for, or later reaching, a call this
  // rank will never make raises at once, naming this rank, instead of reading a stale row or
  // waiting for its timeout. Called after this rank's agreement timed out or the group aborted.
  void abandon();

  struct Slot;  // one rank's row for one call parity (public for the layout's static_assert)

 private:
  HostExchange(int rank, int num_ranks, void* base, size_t bytes);
  Slot* slot(int rank, int parity) const;

  int rank_;
  int num_ranks_;
  void* base_;
  size_t bytes_;
  uint64_t calls_ = 0;
  std::function<std::vector<int64_t>()> probe_;
  double last_wait_us_ = 0.0;
};

}  // namespace ep
