// StoreRowGather: a RowGather (row_gather.hpp) through the group's c10d store, one key per rank
// and gather. It serves the tests of the agreement's transport-gather path on CPU (the same
// path the internode transport's GPU exchange takes), installed by the test hook
// EPProcessGroup._use_store_row_gather().
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "backend/row_gather.hpp"

namespace ep {

class StoreRowGather final : public RowGather {
 public:
  // `pg` outlives the gather (the group's shutdown releases it).
  explicit StoreRowGather(EPProcessGroup& pg) : pg_(pg) {}
  const char* name() const override { return "store"; }
  bool fits(int64_t) const override { return true; }
  // allGatherStrings under a key per gather: waits the group's timeout and raises naming the
  // ranks that never posted (so it never returns a non-empty string).
  std::string gather(const std::vector<int64_t>& row, int64_t* out,
                     std::chrono::milliseconds timeout) override;

 private:
  std::string prefix(uint64_t gather) const;

  EPProcessGroup& pg_;
  uint64_t gathers_ = 0;
};

}  // namespace ep
