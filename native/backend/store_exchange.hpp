// Small collective exchanges through the group's store, for one-time setup decisions (which
// transport a group uses, IPC handles, shared-memory names): every rank posts a string under
// `prefix + rank` and reads everyone's.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <exception>
#include <string>
#include <vector>

namespace ep {

class EPProcessGroup;

// Waits until every key is in `store`, by polling check(): never Store::wait, which holds a
// TCPStore client's lock for the whole wait, so a second thread of the process using the same
// store (another group's call, waiting for a peer that waits for this thread's keys) could not
// post its own keys, and the ranks would deadlock. Throws c10::DistStoreError after `timeout`.
void waitForKeys(c10d::Store& store, const std::vector<std::string>& keys,
                 std::chrono::milliseconds timeout);

// All ranks' strings, in rank order (ours included). Collective. A rank that never posts makes
// the others raise, after the group timeout, "<what>: rank r waited N s ...; rank(s) X never
// joined it".
std::vector<std::string> allGatherStrings(EPProcessGroup& pg, const std::string& prefix,
                                          const std::string& mine, const std::string& what);

// Reads the strings of every rank under `prefix` (posted by allGatherStrings or by hand),
// waiting as allGatherStrings does.
std::vector<std::string> readAllStrings(EPProcessGroup& pg, const std::string& prefix,
                                        const std::string& what);

std::string hostName();

// The message of `e` as a user should see it inside another error: a c10::Error without the
// C++ stack trace torch appends to it, unless TORCH_SHOW_CPP_STACKTRACES=1 asks for traces.
std::string messageWithoutTrace(const std::exception& e);

}  // namespace ep
