// The record a kernel leaves for its host when it hits an error, shared by the nvlink and
// low-latency kernel families. Torch-free and includable from plain C++.
#pragma once

namespace ep {

enum ErrorCode : int {
  kErrorNone = 0,
  kErrorTimeout = 1,         // peer = the rank waited for; value_a = the timeout (nvlink: cycles,
                             // low latency: ns)
  kErrorCapacity = 2,        // value_a = rows needed, value_b = room (nvlink: rows to receive and
                             // num_worst_tokens; low latency: rows for one expert and M)
  kErrorInvalidTopkIdx = 3,  // value_a = offending value, value_b = flat (t*K+k) position
  kErrorInvalidSplits = 4,   // all-to-all device splits: value_a = rows they send (or the
                             // negative split), value_b = rows of the input
  kErrorOutOfStep = 5,       // internode: a peer's signal carries another call's number;
                             // peer = its rank, value_a = that number, value_b = this call's
  kErrorSplitMismatch = 6,   // all-to-all host splits: peer = the source rank, value_a = bytes
                             // it sends this rank, value_b = bytes this rank expects from it
};

// Host-mapped (cudaHostAllocMapped) record of the first error a kernel hit. `code` is written
// last, so a non-zero code means the other fields are complete.
struct ErrorRecord {
  int code;
  int op;
  int rank;
  int peer;
  long long value_a;
  long long value_b;
};

#ifdef __CUDACC__
// Fills a record from the kernel that won its error lock: the fields first, `code` last, each
// fenced at system scope, so the host never sees a half-written record.
__device__ __forceinline__ void publish_error_record(volatile ErrorRecord* e, int op, int rank,
                                                     int code, int peer, long long a, long long b) {
  e->op = op;
  e->rank = rank;
  e->peer = peer;
  e->value_a = a;
  e->value_b = b;
  __threadfence_system();
  e->code = code;
  __threadfence_system();
}
#endif

}  // namespace ep
