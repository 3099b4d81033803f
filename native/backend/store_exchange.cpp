#include "backend/store_exchange.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/utils/cpp_stacktraces.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "backend/ep_process_group.hpp"

namespace ep {

void waitForKeys(c10d::Store& store, const std::vector<std::string>& keys,
                 std::chrono::milliseconds timeout) {
  const auto start = std::chrono::steady_clock::now();
  // A peer usually posts within microseconds to milliseconds: short sleeps first, then up to 2 ms
  // (a TCPStore check is one round trip to the store's server).
  auto pause = std::chrono::microseconds(20);
  while (!store.check(keys)) {
    if (std::chrono::steady_clock::now() - start > timeout) {
      C10_THROW_ERROR(DistStoreError, "wait timeout after " + std::to_string(timeout.count()) +
                                          "ms, keys: " + keys.front() +
                                          (keys.size() > 1 ? " ..." : ""));
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(2000));
  }
}

std::vector<std::string> readAllStrings(EPProcessGroup& pg, const std::string& prefix,
                                        const std::string& what) {
  const int n = pg.getSize();
  std::vector<std::string> keys;
  for (int r = 0; r < n; ++r) {
    keys.push_back(prefix + std::to_string(r));
  }
  const auto timeout = pg.options()->timeout;
  try {
    waitForKeys(*pg.store(), keys, timeout);
  } catch (const std::exception& e) {
    std::string missing;
    for (int r = 0; r < n; ++r) {
      if (!pg.store()->check({keys[r]})) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
    }
    TORCH_CHECK(false, what, ": rank ", pg.getRank(), " waited ",
                std::chrono::duration_cast<std::chrono::seconds>(timeout).count(),
                " s for the other ranks of the group to join this call; rank(s) ",
                missing.empty() ? std::string("?") : missing, " never joined it (",
                messageWithoutTrace(e), ")");
  }
  std::vector<std::string> values;
  for (const auto& k : keys) {
    const std::vector<uint8_t> v = pg.store()->get(k);
    values.emplace_back(v.begin(), v.end());
  }
  return values;
}

std::vector<std::string> allGatherStrings(EPProcessGroup& pg, const std::string& prefix,
                                          const std::string& mine, const std::string& what) {
  pg.store()->set(prefix + std::to_string(pg.getRank()),
                  std::vector<uint8_t>(mine.begin(), mine.end()));
  return readAllStrings(pg, prefix, what);
}

std::string messageWithoutTrace(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
    return torch::get_cpp_stacktraces_enabled() ? error->what() : error->what_without_backtrace();
  }
  return e.what();
}

std::string hostName() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return host;
}

}  // namespace ep
