#include "backend/host_exchange.hpp"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <sstream>
#include <thread>

#include "backend/ep_process_group.hpp"
#include "backend/peer_liveness.hpp"
#include "backend/store_exchange.hpp"
#include "common/env.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define EP_CPU_RELAX() _mm_pause()
#else
#define EP_CPU_RELAX() ((void)0)
#endif

namespace ep {

struct HostExchange::Slot {
  alignas(64) uint64_t call;  // call number + 1 of the row below (0: never written)
  char pad[56];
  int64_t row[kCapacityWords];
};
static_assert(sizeof(HostExchange::Slot) % 64 == 0, "slots stay cache-line aligned");

namespace {

// The call word of an abandoned slot: above every call number, so waiting readers stop.
constexpr uint64_t kAbandoned = ~uint64_t{0};

std::vector<uint8_t> bytesOf(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

std::string stringOf(const std::vector<uint8_t>& v) {
  return std::string(v.begin(), v.end());
}

}  // namespace

std::unique_ptr<HostExchange> HostExchange::connect(EPProcessGroup& pg, const std::string& what) {
  const int rank = pg.getRank();
  const int n = pg.getSize();
  // Nodes that are emulated on one host agree through Gloo, as nodes on different hosts must.
  const bool allowed = !env::equals<env::kHostExchange>("gloo") && pg.topology().num_nodes == 1;
  const std::string prefix = "ep_hostx/" + pg.options()->group_name + "/";
  // Phase 1: one host, and shared memory wanted everywhere?
  const auto hosts =
      allGatherStrings(pg, prefix + "host/", (allowed ? "1|" : "0|") + hostName(), what);
  bool usable = n > 1;
  for (const auto& h : hosts) {
    usable = usable && h == hosts[0] && h[0] == '1';
  }
  if (!usable) {
    return nullptr;
  }
  // Phase 2: rank 0 creates the segment under a fresh name; everyone maps it and reports.
  const size_t bytes = sizeof(Slot) * 2 * static_cast<size_t>(n);
  std::string name;
  if (rank == 0) {
    std::random_device rd;
    std::ostringstream os;
    os << "/ep_hx_" << getpid() << "_" << std::hex << rd() << rd();
    name = os.str();
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    const bool ok = fd >= 0 && ftruncate(fd, static_cast<off_t>(bytes)) == 0;
    if (fd >= 0) {
      close(fd);
    }
    pg.store()->set(prefix + "name", bytesOf(ok ? name : std::string()));
  } else {
    waitForKeys(*pg.store(), {prefix + "name"}, pg.options()->timeout);
    name = stringOf(pg.store()->get(prefix + "name"));
  }
  void* base = MAP_FAILED;
  if (!name.empty()) {
    const int fd = shm_open(name.c_str(), O_RDWR, 0600);
    if (fd >= 0) {
      base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      close(fd);
    }
  }
  const auto mapped =
      allGatherStrings(pg, prefix + "mapped/", base != MAP_FAILED ? "1" : "0", what);
  if (rank == 0 && !name.empty()) {
    shm_unlink(name.c_str());  // every rank has it mapped (or gave up): nothing left in /dev/shm
  }
  bool all = true;
  for (const auto& m : mapped) {
    all = all && m == "1";
  }
  if (!all) {
    if (base != MAP_FAILED) {
      munmap(base, bytes);
    }
    return nullptr;
  }
  return std::unique_ptr<HostExchange>(new HostExchange(rank, n, base, bytes));
}

HostExchange::HostExchange(int rank, int num_ranks, void* base, size_t bytes)
    : rank_(rank), num_ranks_(num_ranks), base_(base), bytes_(bytes) {}

HostExchange::~HostExchange() {
  munmap(base_, bytes_);
}

void HostExchange::abandon() {
  for (int parity = 0; parity < 2; ++parity) {
    __atomic_store_n(&slot(rank_, parity)->call, kAbandoned, __ATOMIC_RELEASE);
  }
}

HostExchange::Slot* HostExchange::slot(int rank, int parity) const {
  return static_cast<Slot*>(base_) + (static_cast<size_t>(rank) * 2 + parity);
}

void HostExchange::gather(const std::vector<int64_t>& row, int64_t* out, const char* op,
                          std::chrono::milliseconds timeout) {
  const int64_t width = static_cast<int64_t>(row.size());
  TORCH_INTERNAL_ASSERT(fits(width));
  const uint64_t call = ++calls_;  // stored as call number + 1: a zeroed slot means "never"
  const int parity = static_cast<int>(call & 1);
  Slot* mine = slot(rank_, parity);
  std::memcpy(mine->row, row.data(), row.size() * sizeof(int64_t));
  __atomic_store_n(&mine->call, call, __ATOMIC_RELEASE);

  const auto start = std::chrono::steady_clock::now();
  std::chrono::steady_clock::duration next_probe = kProbeEvery;
  for (int r = 0; r < num_ranks_; ++r) {
    Slot* s = slot(r, parity);
    uint64_t seen = 0;
    for (uint64_t spins = 0;; ++spins) {
      seen = __atomic_load_n(&s->call, __ATOMIC_ACQUIRE);
      if (seen >= call) {
        break;
      }
      // Spin briefly (peers usually arrive within microseconds), then yield the core (ranks
      // may outnumber cores), then sleep; look at the clock every 256 rounds.
      if (spins < 4096) {
        EP_CPU_RELAX();
      } else if ((spins & 255) != 0) {
        sched_yield();
      } else {
        const auto waited = std::chrono::steady_clock::now() - start;
        if (probe_ && waited > next_probe) {
          next_probe += kProbeEvery;
          std::vector<int64_t> dead;
          for (int64_t q : probe_()) {
            if (__atomic_load_n(&slot(static_cast<int>(q), parity)->call, __ATOMIC_ACQUIRE) <
                call) {
              dead.push_back(q);
            }
          }
          TORCH_CHECK(
              dead.empty(),
              deadPeersMessage(op, dead, rank_,
                               std::chrono::duration_cast<std::chrono::milliseconds>(waited)));
        }
        if (waited > timeout) {
          std::string missing;
          for (int q = 0; q < num_ranks_; ++q) {
            if (__atomic_load_n(&slot(q, parity)->call, __ATOMIC_ACQUIRE) < call) {
              missing += (missing.empty() ? "" : ", ") + std::to_string(q);
            }
          }
          TORCH_CHECK(false, "ep ", op, ": rank ", rank_, " waited ",
                      std::chrono::duration_cast<std::chrono::seconds>(timeout).count(),
                      " s for the other ranks of the group to join this call; rank(s) ", missing,
                      " never joined it");
        }
        if (waited > std::chrono::milliseconds(1)) {
          std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
      }
    }
    TORCH_CHECK(seen != kAbandoned, gaveUpMessage(op, {r}));
    TORCH_CHECK(seen == call, "ep ", op, ": rank ", r, " is ", seen - call,
                " MoE call(s) ahead of rank ", rank_,
                " (an earlier call timed out or failed on some ranks); the group's MoE calls "
                "are out of step");
    std::memcpy(out + r * width, s->row, row.size() * sizeof(int64_t));
  }
  last_wait_us_ =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace ep
