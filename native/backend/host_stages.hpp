// Host-side profiling of the MoE ops' transports (EP_PROFILE_HOST): where a call's host time goes,
// and with EP_PROFILE_HOST=trace where a stuck call stands. Inline: the ops construct a HostStages
// and mark stages on every call, which costs one flag test each when profiling is off.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "common/env.hpp"

namespace ep {

inline bool profilingHost() {
  return env::isSet<env::kProfileHost>();
}

// EP_PROFILE_HOST=trace: also one line per stage as it ends, flushed (where a stuck call stands).
inline bool tracingHost() {
  static const bool on = env::equals<env::kProfileHost>("trace");
  return on;
}

// One flushed line "ep trace pid P: what[ detail]" when tracing.
inline void traceHost(const char* what, const char* detail = nullptr) {
  if (tracingHost()) {
    std::fprintf(stderr, "ep trace pid %d: %s%s%s\n", static_cast<int>(getpid()), what,
                 detail != nullptr ? " " : "", detail != nullptr ? detail : "");
    std::fflush(stderr);
  }
}

// EP_PROFILE_HOST=1: one line per call on stderr with the host time of each stage (µs), to find
// where a call's host time goes.
class HostStages {
 public:
  explicit HostStages(const char* op) : op_(op), on_(enabled()), last_(now()), first_(last_) {
    if (on_) traceHost(op_, "begins");
  }
  void mark(const char* stage) {
    if (!on_) {
      return;
    }
    traceHost(op_, stage);  // the stage has ended
    const auto t = now();
    line_ += std::string(" ") + stage + "=" +
             std::to_string(std::chrono::duration<double, std::micro>(t - last_).count());
    last_ = t;
  }
  // A figure of this call that is not a stage (e.g. the part of a stage spent waiting), written
  // as " key=value" after the stages marked so far.
  void note(const char* key, double value) {
    if (on_) {
      line_ += std::string(" ") + key + "=" + std::to_string(value);
    }
  }
  ~HostStages() {
    if (on_) {
      const double total = std::chrono::duration<double, std::micro>(now() - first_).count();
      // start_ns: CLOCK_MONOTONIC (Python's time.monotonic_ns), to line stages up with others.
      const long long start_ns =
          std::chrono::duration_cast<std::chrono::nanoseconds>(first_.time_since_epoch()).count();
      // pid: which rank's process (benchmarks/stage_medians.py lines the ranks' calls up).
      char tail[96];
      std::snprintf(tail, sizeof(tail), " total=%.1f start_ns=%lld pid=%d\n", total, start_ns,
                    static_cast<int>(getpid()));
      // One write(2) per line: the ranks of a bench share one stderr file, and a line written in
      // pieces (stdio's unbuffered stderr) comes out interleaved with other ranks' bytes.
      const std::string text = std::string("ep ") + op_ + " host us:" + line_ + tail;
      [[maybe_unused]] const ssize_t written = ::write(STDERR_FILENO, text.data(), text.size());
    }
  }

 private:
  static bool enabled() { return profilingHost(); }
  static std::chrono::steady_clock::time_point now() { return std::chrono::steady_clock::now(); }
  const char* op_;
  bool on_;
  std::chrono::steady_clock::time_point last_, first_;
  std::string line_;
};

}  // namespace ep
