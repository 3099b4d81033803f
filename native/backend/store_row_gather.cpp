#include "backend/store_row_gather.hpp"

#include <c10/util/Exception.h>

#include <cstring>

#include "backend/ep_process_group.hpp"
#include "backend/store_exchange.hpp"

namespace ep {

std::string StoreRowGather::key(uint64_t gather, int64_t rank) const {
  return "ep_row_gather/" + pg_.options()->group_name + "/" + std::to_string(gather) + "/" +
         std::to_string(rank);
}

std::string StoreRowGather::gather(const std::vector<int64_t>& row, int64_t* out,
                                   std::chrono::milliseconds timeout) {
  const uint64_t n = ++gathers_;
  const int64_t rank = pg_.getRank();
  const int64_t num_ranks = pg_.getSize();
  const auto& store = pg_.store();
  std::vector<uint8_t> bytes(row.size() * sizeof(int64_t));
  std::memcpy(bytes.data(), row.data(), bytes.size());
  store->set(key(n, rank), bytes);
  std::vector<std::string> keys;
  for (int64_t r = 0; r < num_ranks; ++r) keys.push_back(key(n, r));
  try {
    waitForKeys(*store, keys, timeout);
  } catch (const std::exception&) {
    std::string missing;
    for (int64_t r = 0; r < num_ranks; ++r) {
      if (!store->check({keys[static_cast<size_t>(r)]})) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
    }
    if (!missing.empty()) return "rank(s) " + missing;
    throw;
  }
  for (int64_t r = 0; r < num_ranks; ++r) {
    const std::vector<uint8_t> theirs = store->get(keys[static_cast<size_t>(r)]);
    TORCH_CHECK(theirs.size() == bytes.size(), "ep: rank ", r, " gathered a row of ",
                theirs.size() / sizeof(int64_t), " words, this rank one of ", row.size());
    std::memcpy(out + r * static_cast<int64_t>(row.size()), theirs.data(), theirs.size());
  }
  // Every rank read gather n - 1 before posting n: its key of n - 2 is read by everyone.
  if (n >= 2) {
    try {
      store->deleteKey(key(n - 2, rank));
    } catch (const std::exception&) {
    }
  }
  return "";
}

}  // namespace ep
