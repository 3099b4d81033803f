// C entry points of the internode runtime (see internode_capi.h): every function returns 0 on
// success or -1 with a message in `err`; no C++ exception crosses the boundary.
#include "transports/internode/cuda/internode_capi.h"

#include <type_traits>

#include "common/c_entry_point.hpp"
#include "transports/internode/cuda/internode_runtime.hpp"
#include "transports/internode/cuda/row_exchange.hpp"

namespace {

using ep::capi::cEntryPoint;
using ep::capi::copyMessage;

ep::InternodeRuntime* runtime(void* handle) {
  return static_cast<ep::InternodeRuntime*>(handle);
}

ep::RowExchange* exchange(void* handle) {
  return static_cast<ep::RowExchange*>(handle);
}

}  // namespace

extern "C" {

int ep_internode_abi_version() {
  return EP_INTERNODE_ABI_VERSION;
}

size_t ep_internode_symmetric_bytes(int num_nodes, int ranks_per_node,
                                    const ep::internode::Capacity* capacity) {
  return ep::InternodeRuntime::symmetric_bytes(num_nodes, ranks_per_node, *capacity);
}

int ep_internode_create(const ep::InternodeSetup* setup, void** out, char* err, size_t err_len) {
  return cEntryPoint(err, err_len, [&] { *out = new ep::InternodeRuntime(*setup); });
}

int ep_internode_connect(void* handle, char* err, size_t err_len) {
  return cEntryPoint(err, err_len, [&] { runtime(handle)->connect(); });
}

// Drops a runtime of a failed setup without a collective (see InternodeRuntime::abandon).
void ep_internode_abandon(void* handle) {
  ep::InternodeRuntime* rt = runtime(handle);
  rt->abandon();
  delete rt;
}

int ep_internode_notify(void* handle, const ep::InternodeNotifyArgs* args, cudaStream_t stream,
                        uint64_t* ticket, char* err, size_t err_len) {
  return cEntryPoint(err, err_len, [&] { *ticket = runtime(handle)->notify(*args, stream); });
}

// 1 once the notify of `ticket` finished (its count rows copied to `rows`, its per-expert
// receive counts to `per_expert`), else 0.
int ep_internode_notify_counts(void* handle, uint64_t ticket, int64_t* rows, int64_t* per_expert,
                               int num_local_experts) {
  return runtime(handle)->notify_counts(ticket, rows, per_expert, num_local_experts) ? 1 : 0;
}

// The latest rejected worst-case call not yet taken ("" when none).
void ep_internode_take_rejection(void* handle, char* msg, size_t msg_len) {
  std::string r;
  if (cEntryPoint(msg, msg_len, [&] { r = runtime(handle)->take_rejection(); }) == 0) {
    copyMessage(r.c_str(), msg, msg_len);
  }
}

int ep_internode_dispatch(void* handle, const ep::InternodeDispatchArgs* args, cudaStream_t stream,
                          char* err, size_t err_len) {
  return cEntryPoint(err, err_len, [&] { runtime(handle)->dispatch(*args, stream); });
}

int ep_internode_combine(void* handle, const ep::InternodeCombineArgs* args, cudaStream_t stream,
                         char* err, size_t err_len) {
  return cEntryPoint(err, err_len, [&] { runtime(handle)->combine(*args, stream); });
}

int ep_internode_check_error(void* handle, char* msg, size_t msg_len, int* failed) {
  return ep::capi::checkErrorEntry(runtime(handle), msg, msg_len, failed);
}

void ep_internode_progress(void* handle, char* msg, size_t msg_len) {
  std::string p;
  if (cEntryPoint(msg, msg_len, [&] { p = runtime(handle)->progress(); }) == 0) {
    copyMessage(p.c_str(), msg, msg_len);
  }
}

int ep_internode_destroy(void* handle, char* err, size_t err_len) {
  return ep::capi::destroyEntry(runtime(handle), err, err_len);
}

size_t ep_row_exchange_symmetric_bytes(int num_ranks) {
  return ep::RowExchange::symmetric_bytes(num_ranks);
}

int ep_row_exchange_create(const ep::RowExchangeSetup* setup, void** out, char* err,
                           size_t err_len) {
  return cEntryPoint(err, err_len, [&] { *out = new ep::RowExchange(*setup); });
}

int ep_row_exchange_connect(void* handle, char* err, size_t err_len) {
  return cEntryPoint(err, err_len, [&] { exchange(handle)->connect(); });
}

// Drops the exchange of a failed setup without a collective (see RowExchange::abandon).
void ep_row_exchange_abandon(void* handle) {
  ep::RowExchange* ex = exchange(handle);
  ex->abandon();
  delete ex;
}

// 0 with every rank's row in `out` ("" in `missing`), or with the ranks that never sent theirs
// named in `missing`; -1 with a message in `err` on any other failure.
int ep_row_exchange_gather(void* handle, const int64_t* row, int width, double timeout_seconds,
                           int64_t* out, char* missing, size_t missing_len, char* err,
                           size_t err_len) {
  return cEntryPoint(err, err_len, [&] {
    const std::string who = exchange(handle)->gather(row, width, timeout_seconds, out);
    copyMessage(who.c_str(), missing, missing_len);
  });
}

int ep_row_exchange_destroy(void* handle, char* err, size_t err_len) {
  return ep::capi::destroyEntry(exchange(handle), err, err_len);
}

}  // extern "C"

static_assert(std::is_same_v<decltype(&ep_internode_abi_version), ep_internode_abi_version_fn>);
static_assert(
    std::is_same_v<decltype(&ep_internode_symmetric_bytes), ep_internode_symmetric_bytes_fn>);
static_assert(std::is_same_v<decltype(&ep_internode_create), ep_internode_create_fn>);
static_assert(std::is_same_v<decltype(&ep_internode_connect), ep_internode_connect_fn>);
static_assert(std::is_same_v<decltype(&ep_internode_abandon), ep_internode_abandon_fn>);
static_assert(std::is_same_v<decltype(&ep_internode_notify), ep_internode_notify_fn>);
static_assert(std::is_same_v<decltype(&ep_internode_notify_counts), ep_internode_notify_counts_fn>);
static_assert(
    std::is_same_v<decltype(&ep_internode_take_rejection), ep_internode_take_rejection_fn>);
static_assert(std::is_same_v<decltype(&ep_internode_dispatch), ep_internode_dispatch_fn>);
static_assert(std::is_same_v<decltype(&ep_internode_combine), ep_internode_combine_fn>);
static_assert(std::is_same_v<decltype(&ep_internode_check_error), ep_internode_check_error_fn>);
static_assert(std::is_same_v<decltype(&ep_internode_destroy), ep_internode_destroy_fn>);
static_assert(std::is_same_v<decltype(&ep_internode_progress), ep_internode_progress_fn>);
static_assert(
    std::is_same_v<decltype(&ep_row_exchange_symmetric_bytes), ep_row_exchange_symmetric_bytes_fn>);
static_assert(std::is_same_v<decltype(&ep_row_exchange_create), ep_row_exchange_create_fn>);
static_assert(std::is_same_v<decltype(&ep_row_exchange_connect), ep_row_exchange_connect_fn>);
static_assert(std::is_same_v<decltype(&ep_row_exchange_abandon), ep_row_exchange_abandon_fn>);
static_assert(std::is_same_v<decltype(&ep_row_exchange_gather), ep_row_exchange_gather_fn>);
static_assert(std::is_same_v<decltype(&ep_row_exchange_destroy), ep_row_exchange_destroy_fn>);
