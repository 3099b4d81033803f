#include "backend/store_row_gather.hpp"

#include <c10/util/Exception.h>

#include <cstring>

#include "backend/ep_process_group.hpp"
#include "backend/store_exchange.hpp"

namespace ep {

std::string StoreRowGather::prefix(uint64_t gather) const {
  return "ep_row_gather/" + pg_.options()->group_name + "/" + std::to_string(gather) + "/";
}

std::string StoreRowGather::gather(const std::vector<int64_t>& row, int64_t* out,
                                   std::chrono::milliseconds) {
  const uint64_t n = ++gathers_;
  std::string mine(row.size() * sizeof(int64_t), '\0');
  std::memcpy(mine.data(), row.data(), mine.size());
  // Waits the group timeout; a rank that never posts is named in the error it raises.
  const std::vector<std::string> all = allGatherStrings(pg_, prefix(n), mine, "ep agreement");
  for (size_t r = 0; r < all.size(); ++r) {
    TORCH_CHECK(all[r].size() == mine.size(), "ep: rank ", r, " gathered a row of ",
                all[r].size() / sizeof(int64_t), " words, this rank one of ", row.size());
    std::memcpy(out + r * row.size(), all[r].data(), mine.size());
  }
  // Every rank read gather n - 1 before posting n: its key of n - 2 is read by everyone.
  if (n >= 2) {
    try {
      pg_.store()->deleteKey(prefix(n - 2) + std::to_string(pg_.getRank()));
    } catch (const std::exception&) {
    }
  }
  return "";
}

}  // namespace ep
