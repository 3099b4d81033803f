#include "transports/nvshmem/nvshmem_transport.hpp"

#include <c10/util/Exception.h>

#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include "backend/aligned_rows.hpp"
#include "backend/ep_process_group.hpp"
#include "backend/group_state.hpp"
#include "backend/per_group_transport.hpp"
#include "backend/store_exchange.hpp"
#include "common/env.hpp"
#include "transports/nvshmem/nvshmem_session_plan.hpp"

#ifdef EP_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <sstream>
#include <thread>

#include "backend/carved_tensors.hpp"
#include "backend/gpu_identity.hpp"
#include "backend/host_stages.hpp"
#include "backend/kernel_image.hpp"
#include "backend/moe_validation.hpp"
#include "backend/peer_liveness.hpp"
#include "backend/rank_mask.hpp"
#include "backend/stream_capture.hpp"
#include "transports/nvshmem/cuda/nvshmem_capi.h"
#include "transports/nvshmem/cuda/nvshmem_runtime.hpp"
#endif

namespace ep::nvshmem {
namespace {

#ifdef EP_WITH_CUDA

// ---- libep_nvshmem.so, loaded once per process -------------------------------------------------

struct Library {
  bool ok = false;
  std::string error;  // why it is not usable
  ep_nvshmem_unique_id_fn unique_id = nullptr;
  ep_nvshmem_session_start_fn session_start = nullptr;
  ep_nvshmem_session_fn session = nullptr;
  ep_nvshmem_create_fn create = nullptr;
  ep_nvshmem_dispatch_fn dispatch = nullptr;
  ep_nvshmem_combine_fn combine = nullptr;
  ep_nvshmem_combine_buffer_fn combine_buffer = nullptr;
  ep_nvshmem_config_fn config = nullptr;
  ep_nvshmem_check_error_fn check_error = nullptr;
  ep_nvshmem_clear_error_fn clear_error = nullptr;
  ep_nvshmem_destroy_fn destroy = nullptr;
  ep_nvshmem_connect_fn connect = nullptr;
  ep_nvshmem_abandon_fn abandon = nullptr;
};

// Next to _C (the build copies it there), or EP_NVSHMEM_LIB.
std::string libraryPath() {
  if (const char* path = env::raw<env::kNvshmemLib>()) {
    return path;
  }
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&libraryPath), &info) == 0 || info.dli_fname == nullptr) {
    return "libep_nvshmem.so";
  }
  std::string self = info.dli_fname;
  const auto slash = self.rfind('/');
  return (slash == std::string::npos ? std::string() : self.substr(0, slash + 1)) +
         "libep_nvshmem.so";
}

template <typename Fn>
bool lookup(void* dl, const char* name, Fn& fn, std::string& error) {
  fn = reinterpret_cast<Fn>(dlsym(dl, name));
  if (fn == nullptr) {
    error = std::string("libep_nvshmem.so lacks ") + name;
  }
  return fn != nullptr;
}

const Library& library() {
  static const Library lib = [] {
    Library l;
    const std::string path = libraryPath();
    void* dl = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (dl == nullptr) {
      const char* e = dlerror();
      l.error = "cannot load " + path + " (" + (e ? e : "?") + ")";
      return l;
    }
    ep_nvshmem_abi_version_fn version = nullptr;
    if (!lookup(dl, "ep_nvshmem_abi_version", version, l.error)) {
      return l;
    }
    if (version() != EP_NVSHMEM_ABI_VERSION) {
      l.error = path + " was built for another version of ep_backend (rebuild it)";
      return l;
    }
    l.ok = lookup(dl, "ep_nvshmem_unique_id", l.unique_id, l.error) &&
           lookup(dl, "ep_nvshmem_session_start", l.session_start, l.error) &&
           lookup(dl, "ep_nvshmem_session", l.session, l.error) &&
           lookup(dl, "ep_nvshmem_create", l.create, l.error) &&
           lookup(dl, "ep_nvshmem_dispatch", l.dispatch, l.error) &&
           lookup(dl, "ep_nvshmem_combine", l.combine, l.error) &&
           lookup(dl, "ep_nvshmem_combine_buffer", l.combine_buffer, l.error) &&
           lookup(dl, "ep_nvshmem_config", l.config, l.error) &&
           lookup(dl, "ep_nvshmem_check_error", l.check_error, l.error) &&
           lookup(dl, "ep_nvshmem_clear_error", l.clear_error, l.error) &&
           lookup(dl, "ep_nvshmem_destroy", l.destroy, l.error) &&
           lookup(dl, "ep_nvshmem_connect", l.connect, l.error) &&
           lookup(dl, "ep_nvshmem_abandon", l.abandon, l.error);
    return l;  // the handle stays open for the life of the process
  }();
  return lib;
}

// Throws a c10::Error with the library's message when `rc` is non-zero.
void check(int rc, const char* what, const char* err) {
  TORCH_CHECK(rc == 0, "ep ", what, ": ", err);
}

// ---- the process's NVSHMEM session --------------------------------------------------------
//
// Started once per process, by the first group whose ranks use NVSHMEM, with those ranks as its
// PEs; never finalised (nvshmem_session_plan.hpp says why). Groups allocate and free their
// symmetric buffers in it. At a group's destruction its buffers are parked here, then freed
// (nvshmem_free, in this order) only if every rank of the group joins the teardown vote
// (joinCollectiveTeardown, bounded by the group timeout: nvshmem_free waits for every PE with no
// timeout, and after ep_backend.abort a peer may be dead). Otherwise the next group over the same
// PEs frees them once its setup exchange has shown every PE present (decide); where none comes
// (a PE died), they stay until the process exits.
struct SessionRecord {
  std::mutex mutex;
  std::string group;  // placesFingerprint of the group that started the session
  std::deque<std::function<void()>> parked;
};

SessionRecord& sessionRecord() {
  static auto* record = new SessionRecord;  // leaked: no NVSHMEM work from static destructors
  return *record;
}

SessionPost localSessionPost() {
  SessionPost post;
  if (!library().ok) return post;
  int pe = -1, pes = 0, device = -1;
  if (library().session(&pe, &pes, &device) == 0) return post;
  SessionRecord& rec = sessionRecord();
  std::lock_guard<std::mutex> lock(rec.mutex);
  post.started = true;
  post.pe = pe;
  post.num_pes = pes;
  post.group = rec.group;
  post.parked = static_cast<int64_t>(rec.parked.size());
  return post;
}

// Buffers awaiting their collective free.
size_t parkedBuffers() {
  SessionRecord& rec = sessionRecord();
  std::lock_guard<std::mutex> lock(rec.mutex);
  return rec.parked.size();
}

// Collective over the session's PEs (every rank of a group that decide() let reuse it, or of
// one whose teardown every rank joined): frees the buffers destroyed groups left.
void freeParkedBuffers() {
  std::deque<std::function<void()>> parked;
  {
    SessionRecord& rec = sessionRecord();
    std::lock_guard<std::mutex> lock(rec.mutex);
    parked.swap(rec.parked);
  }
  for (auto& free_buffers : parked) {
    free_buffers();
  }
}

// A dispatch handle's buffer, remembered so its combine finds the dispatch's NVSHMEM state.
struct RememberedHandle {
  at::Tensor layout_range;  // held: its address stays its own
  uint32_t version = 0;
  int buffer = 0;
  uint64_t seq = 0;        // the group's dispatch number
  int64_t num_tokens = 0;  // T and K of the dispatch: its combine must pass the same topk_idx
  int64_t num_topk = 0;
  bool combined = false;  // its combine ran: the buffer's dispatch state is spent
  // A send-only dispatch awaiting its receive phase: its arguments, and the tensors they point
  // into, kept alive until then.
  bool pending = false;
  ep::NvshmemDispatchArgs args;
  std::vector<at::Tensor> keep_alive;
  std::optional<c10::cuda::CUDAStream> stream;  // of the send phase: the receive runs there too
};

// The runtime alternates two buffers: a third dispatch would reuse the buffer of one still
// awaiting its receive.
constexpr int kMaxPendingReceives = 2;

constexpr size_t kRecentHandles = 8;

#endif  // EP_WITH_CUDA

struct GroupState {
  GroupVerdict usability;  // whether the group's low-latency calls run here, or why not
#ifdef EP_WITH_CUDA
  void* runtime = nullptr;
  NvshmemConfig config;
  int generation = 0;
  std::deque<RememberedHandle> recent;
  uint64_t dispatches = 0;  // kernel dispatches so far
  // A CUDA graph was captured with kernels on these buffers: a rebuild would free what it
  // replays into, so from then on there is none (an agreed field of every dispatch).
  bool graph_captured = false;
  // placesFingerprint of this group's ranks (decide): recorded as the session's if it starts it.
  std::string places;
#endif
};

// NVSHMEM is process-global: the one group whose low-latency ops use it.
std::mutex g_owner_mutex;
EPProcessGroup* g_owner = nullptr;

#ifdef EP_WITH_CUDA

// Waits until every other rank of the group posted `prefix + rank` in the store, or until
// `deadline`. False at the deadline, as soon as a rank posted anything but "1", or as soon as a
// rank it waits for is found dead (its process gone, on this host: looked up every 0.5 s).
bool everyRankPosted(EPProcessGroup& pg, const std::string& prefix,
                     std::chrono::steady_clock::time_point deadline) {
  std::vector<int> pending;
  for (int r = 0; r < pg.getSize(); ++r) {
    if (r != pg.getRank()) pending.push_back(r);
  }
  auto pause = std::chrono::microseconds(200);
  auto next_probe = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  while (!pending.empty()) {
    if (std::chrono::steady_clock::now() > next_probe) {
      next_probe += std::chrono::milliseconds(500);
      for (int64_t dead : deadPeers(pg)) {
        if (std::find(pending.begin(), pending.end(), dead) != pending.end()) return false;
      }
    }
    std::vector<int> still;
    for (int r : pending) {
      const std::string key = prefix + std::to_string(r);
      if (!pg.store()->check({key})) {
        still.push_back(r);
      } else if (pg.store()->get(key) != std::vector<uint8_t>{'1'}) {
        return false;
      }
    }
    pending.swap(still);
    if (pending.empty()) break;
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(20000));
  }
  return true;
}

// Whether every rank of the group takes part in the collective NVSHMEM teardown: nvshmem_free
// waits for every PE without a bound, so a rank that died (SIGKILL) or never
// tears its group down must make the others skip them instead of hanging there. Two rounds in
// the group's store, each bounded by the group timeout: every rank posts "here" and waits for
// everyone's; then posts whether it saw them all ("go" = 1/0) and waits for everyone's "go".
// Only ranks that saw every "go" = 1 free. (One round would let a rank whose wait ran out
// just before the last "here" arrived skip while the others free and hang; with two, that
// takes a rank that stalls for the whole group timeout between two store writes.) A rank that
// aborted the group still takes part: after ep_backend.abort on every live rank, the buffers are
// freed and a new group over the same ranks reuses the session. Any store error also means
// "skip".
bool joinCollectiveTeardown(EPProcessGroup& pg, int generation) {
  const std::string prefix =
      "ep_ll/" + pg.options()->group_name + "/teardown/" + std::to_string(generation) + "/";
  const auto timeout = pg.options()->timeout;
  const std::string me = std::to_string(pg.getRank());
  try {
    pg.store()->set(prefix + "here/" + me, std::vector<uint8_t>{'1'});
    const bool all_here =
        everyRankPosted(pg, prefix + "here/", std::chrono::steady_clock::now() + timeout);
    pg.store()->set(prefix + "go/" + me,
                    std::vector<uint8_t>{all_here ? uint8_t{'1'} : uint8_t{'0'}});
    return all_here &&
           everyRankPosted(pg, prefix + "go/", std::chrono::steady_clock::now() + timeout);
  } catch (const std::exception&) {
    return false;
  }
}
#endif

std::shared_ptr<GroupState> stateOf(EPProcessGroup& pg, bool create = true) {
  static auto* states = new GroupStates<GroupState>([](EPProcessGroup* key, GroupState& state) {
    {
      std::lock_guard<std::mutex> lock(g_owner_mutex);
      if (g_owner == key) {
        g_owner = nullptr;
      }
    }
#ifdef EP_WITH_CUDA
    if (state.runtime != nullptr) {
      // Parked first (SessionRecord): freed below with the other parked buffers if every rank
      // joins the teardown, else left for the next group over the session's PEs.
      parkCollectiveFree([rt = state.runtime] {
        char err[512] = {0};
        cudaDeviceSynchronize();
        if (library().destroy(rt, err, sizeof(err)) != 0) {
          TORCH_WARN("ep: freeing the NVSHMEM low-latency buffers of a destroyed group: ", err);
        }
      });
      state.runtime = nullptr;
    }
    // Only a group that used the session (its ranks are its PEs) frees its buffers.
    if (!state.usability.yes() || parkedBuffers() == 0) {
      return;
    }
    cudaDeviceSynchronize();  // our kernels end, by their kernel_timeout_s if a peer is gone
    if (!joinCollectiveTeardown(*key, state.generation)) {
      TORCH_WARN(
          "ep: group ", key->options()->group_name,
          ": its NVSHMEM buffers were not freed: a rank of the group did not join its teardown "
          "(it died, or did not tear the group down within the group timeout), and nvshmem_free "
          "would wait for it forever. They stay allocated; a later group over the same ranks "
          "frees them, and a group without that rank runs its low-latency ops on ATen (NVSHMEM "
          "is initialised once per process and cannot be restarted; restart the process to use "
          "it again)");
      return;
    }
    // Collective in NVSHMEM terms; every rank voted to tear its group down too. NVSHMEM itself
    // stays initialised: a later group over the same ranks reuses the session.
    freeParkedBuffers();
#else
    (void)key;
    (void)state;
#endif
  });
  return create ? states->of(pg) : states->find(pg);
}

#ifdef EP_WITH_CUDA

// The reason recorded when the user asked for the ATen path.
constexpr const char* kAskedAten = "EP_LOW_LATENCY=aten";

// Collective: every rank posts whether it can run the kernels, its GPU and its process's NVSHMEM
// session; usable only if all can, each on a GPU of its own, and the session is theirs or none
// has one (decideSession). A reused session's parked buffers are freed here.
Verdict decide(EPProcessGroup& pg, GroupState& st, const at::Device& device) {
  std::string why;
  if (env::equals<env::kLowLatency>("aten")) {
    why = kAskedAten;
  } else if (!library().ok) {
    why = library().error;
  } else if (std::string missing = kernelImageMissingFromArchList(device.index());
             !missing.empty()) {
    why = std::move(missing);
  } else {
    std::lock_guard<std::mutex> lock(g_owner_mutex);
    if (g_owner != nullptr && g_owner != &pg) {
      why = "another group of this process owns NVSHMEM (one group per process)";
    }
  }
  const std::string prefix = "ep_ll/" + pg.options()->group_name + "/decide/";
  // "flag|host|index|bus#session": neither a host name nor encodeSession holds '#'.
  const std::vector<std::string> posted =
      allGatherStrings(pg, prefix,
                       (why.empty() ? "1|" : "0|") + GpuPlace::of(device.index()).str() + "#" +
                           encodeSession(localSessionPost()),
                       "ep low_latency_dispatch (transport setup)");
  std::vector<std::string> places;
  std::vector<SessionPost> sessions;
  for (const std::string& s : posted) {
    const size_t hash = s.rfind('#');
    places.push_back(s.substr(2, hash - 2));
    sessions.push_back(decodeSession(s.substr(hash + 1)));
  }
  // Two ranks on one GPU share it. The same index on different GPUs of one host means
  // CUDA_VISIBLE_DEVICES differs per process, which NVSHMEM has not been tried with here: those
  // groups stay on ATen, and say so.
  std::vector<GpuPlace> seen;
  bool all = true;
  for (size_t r = 0; r < posted.size(); ++r) {
    all = all && posted[r][0] == '1';
    const GpuPlace where = GpuPlace::parse(places[r]);
    for (const auto& w : seen) {
      if (!why.empty() || w.host != where.host) continue;
      if (w.sameGpu(where)) {
        why = "ranks share a GPU (NVSHMEM needs one GPU per rank)";
      } else if (w.index == where.index) {
        why = "ranks see different GPUs (" + w.bus + ", " + where.bus + ") as the same device " +
              std::to_string(where.index) +
              " (CUDA_VISIBLE_DEVICES set per process), which ep does not start NVSHMEM with; "
              "make every GPU visible to every rank and pick one per rank with "
              "torch.cuda.set_device(local_rank)";
      }
    }
    seen.push_back(where);
  }
  if (why.empty() && !all) {
    why = "another rank cannot use NVSHMEM (see its low_latency_transport)";
  }
  st.places = placesFingerprint(places);
  const SessionDecision session = decideSession(sessions, st.places);
  if (why.empty() && session.action == SessionAction::kRefuse) {
    why = session.why;
  }
  // `why` may differ between ranks, the verdict cannot: it is a function of the posted flags, of
  // the (host, device) pairs and of the sessions, which every rank read alike.
  if (why.empty()) {
    {
      std::lock_guard<std::mutex> lock(g_owner_mutex);
      g_owner = &pg;
    }
    if (session.action == SessionAction::kReuse) {
      c10::cuda::CUDAGuard guard(device);
      freeParkedBuffers();  // every PE is here (it just posted) and frees the same buffers
    }
  }
  const bool requested = why == kAskedAten;
  return Verdict{std::move(why), requested};
}

bool fits(const NvshmemConfig& c, int64_t m, int64_t hidden, int64_t topk, int64_t experts) {
  return c.max_tokens_per_rank == m && c.max_hidden >= hidden && c.max_topk >= topk &&
         c.num_experts >= experts;
}

// The low-latency buffer sizes of a config for this group: M exactly, H, K, E at least.
NvshmemConfig configFor(EPProcessGroup& pg, int64_t m, int64_t hidden, int64_t topk,
                        int64_t experts) {
  NvshmemConfig cfg;
  cfg.max_tokens_per_rank = static_cast<int>(m);
  cfg.max_hidden = static_cast<int>(hidden);
  cfg.max_topk = static_cast<int>(std::max<int64_t>(topk, 1));
  cfg.num_experts = static_cast<int>(experts);
  cfg.num_ranks = static_cast<int>(pg.getSize());
  // Emulated nodes: the legs between them on the put path, as across hosts (docs/internode.md).
  cfg.emulated_ranks_per_node = pg.topology().emulated ? pg.topology().ranks_per_node : 0;
  cfg.timeout_seconds = pg.options()->kernel_timeout_s;
  return cfg;
}

// Collective (every rank of a group decide() let use NVSHMEM, each alike: the sessions were part
// of that agreement): starts the process's NVSHMEM session with the group's ranks as PEs unless
// it runs already. `cfg` sizes its initial heap (NvshmemRuntime::set_environment); it grows on
// demand where CUDA VMM is on.
void startSessionIfNone(EPProcessGroup& pg, GroupState& st, const at::Device& device,
                        const NvshmemConfig& cfg) {
  const Library& lib = library();
  if (lib.session(nullptr, nullptr, nullptr) != 0) {
    return;
  }
  char err[1024] = {0};
  const std::string key =
      "ep_ll/" + pg.options()->group_name + "/uid/" + std::to_string(++st.generation);
  if (pg.getRank() == 0) {
    std::array<uint8_t, 1024> uid{};
    size_t written = 0;
    const int rc = lib.unique_id(&cfg, uid.data(), uid.size(), &written, err, sizeof(err));
    // Posted even on failure (empty): the other ranks wait for this key, and would otherwise
    // wait out the store timeout.
    pg.store()->set(key, std::vector<uint8_t>(uid.begin(), uid.begin() + (rc == 0 ? written : 0)));
    check(rc, "low_latency setup", err);
  }
  waitForKeys(*pg.store(), {key}, pg.options()->timeout);  // not get's wait: see waitForKeys
  const std::vector<uint8_t> uid = pg.store()->get(key);
  TORCH_CHECK(!uid.empty(),
              "ep low_latency setup: rank 0 could not get an NVSHMEM unique id (see "
              "its error)");
  {
    SessionRecord& rec = sessionRecord();
    std::lock_guard<std::mutex> lock(rec.mutex);
    rec.group = st.places;
  }
  check(lib.session_start(pg.getRank(), pg.getSize(), device.index(), uid.data(), uid.size(), &cfg,
                          err, sizeof(err)),
        "low_latency setup", err);
}

// Set by failNextSetupForTest: the next agreedSetup of this process fails on this rank.
std::atomic<bool> g_fail_next_setup{false};

// One step of a collective buffer setup: every rank posts "" (done) or its error, within the
// group's timeout (a rank that never posts makes the others raise naming it). Returns "" when
// every rank succeeded, else which ranks failed and the first one's error.
std::string setupStepFailure(EPProcessGroup& pg, const std::string& prefix, const std::string& mine,
                             const char* op, const char* step) {
  const std::vector<std::string> all =
      allGatherStrings(pg, prefix, mine, std::string("ep ") + op + " (" + step + ")");
  std::ostringstream ranks;
  std::string first;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    ranks << (first.empty() ? "" : ", ") << r;
    if (first.empty()) first = all[r];
  }
  if (first.empty()) return "";
  return "rank(s) " + ranks.str() + " failed " + step + " the NVSHMEM buffers (first: " + first +
         ")";
}

// A new low-latency runtime of `cfg` in the process's session (see agreedSetup).
void* createAndConnect(EPProcessGroup& pg, GroupState& st, const at::Device& device,
                       const NvshmemConfig& cfg) {
  const Library& lib = library();
  // A number of its own per attempt (every rank counts alike): a retry after a failed setup
  // never reads the failed attempt's posts.
  const std::string prefix =
      "ep_ll/" + pg.options()->group_name + "/setup/" + std::to_string(++st.generation) + "/";
  return agreedSetup(
      pg, prefix, "low_latency setup", "the next low-latency call sets the buffers up again",
      [&](void** made, char* err, size_t err_len) {
        return lib.create(pg.getRank(), pg.getSize(), device.index(), &cfg, made, err, err_len);
      },
      lib.connect, lib.abandon);
}

// Collective: a runtime for this call's shape (M exactly; H, K, E at least), rebuilt when not
// (every input agreed, graph_captured included). Never while a CUDA graph is captured, nor after
// one was: that graph's kernels keep the buffers' addresses. A rebuild frees the old buffers,
// then allocates the new ones, in the same NVSHMEM session (never a restart: see SessionRecord).
void* ensureRuntime(EPProcessGroup& pg, GroupState& st, const at::Device& device, int64_t m,
                    int64_t hidden, int64_t topk, int64_t experts) {
  const bool capture = streamCapturing();
  if (st.runtime != nullptr && fits(st.config, m, hidden, topk, experts)) {
    st.graph_captured = st.graph_captured || capture;
    return st.runtime;
  }
  const auto shape = [&] {
    std::ostringstream os;
    os << "M=" << m << ", H=" << hidden << ", top-" << topk << ", E=" << experts;
    if (st.runtime != nullptr) {
      os << "; the buffers hold M=" << st.config.max_tokens_per_rank
         << ", H=" << st.config.max_hidden << ", top-" << st.config.max_topk
         << ", E=" << st.config.num_experts;
    }
    return os.str();
  };
  TORCH_CHECK(!capture, "ep low_latency_dispatch: the NVSHMEM buffers cannot be ",
              st.runtime != nullptr ? "rebuilt" : "set up", " while a CUDA graph is captured (",
              shape(), "); run one call of this shape before capturing (nothing was exchanged)");
  TORCH_CHECK(!st.graph_captured, "ep low_latency_dispatch: ", shape(),
              ": new NVSHMEM buffers would be needed, but a CUDA graph captured earlier replays "
              "kernels on these (M must stay the same, H, top-k and E within them; nothing was "
              "exchanged)");
  const Library& lib = library();
  char err[1024] = {0};
  if (st.runtime != nullptr) {
    hidden = std::max<int64_t>(hidden, st.config.max_hidden);
    topk = std::max<int64_t>(topk, st.config.max_topk);
    experts = std::max<int64_t>(experts, st.config.num_experts);
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    // Through the store, not Gloo (see the nvlink rebuild): bounded by the group's timeout, so
    // that no rank waits alone in nvshmem_free's barrier, which has none.
    allGatherStrings(
        pg, "ep_ll/" + pg.options()->group_name + "/rebuild/" + std::to_string(st.generation) + "/",
        "", "ep low_latency_dispatch: rebuilding the NVSHMEM buffers");
    ++st.generation;
    // Free before malloc: the heap can reuse the space. Other buffers of the session (the
    // internode transport's) stay where they are.
    const int rc = lib.destroy(st.runtime, err, sizeof(err));
    st.runtime = nullptr;
    st.recent.clear();
    check(rc, "low_latency rebuild", err);
  }
  const NvshmemConfig cfg = configFor(pg, m, hidden, topk, experts);
  startSessionIfNone(pg, st, device, cfg);
  st.runtime = createAndConnect(pg, st, device, cfg);
  lib.config(st.runtime, &st.config);
  return st.runtime;
}

// A kernel error of an earlier call (timeout naming the stalled peer, capacity), "" if none; a
// non-fatal one is forgotten once read. It is only ever seen by the rank that recorded it (and
// when the device got to write it), so callers pass it to the agreement as their local error:
// every rank then raises together instead of this one leaving its peers waiting in a collective.
std::string pendingError(GroupState& st, const char* op) {
  if (st.runtime == nullptr) {
    return "";
  }
  char msg[1024] = {0};
  int failed = 0;
  if (library().check_error(st.runtime, msg, sizeof(msg), &failed) == 0) {
    return "";
  }
  if (!failed) {
    C10_CUDA_CHECK(cudaDeviceSynchronize());  // clear_error needs an idle device
    char err[512] = {0};
    TORCH_CHECK(library().clear_error(st.runtime, err, sizeof(err)) == 0, "ep ", op,
                ": could not clear the low-latency runtime's error (", err, ") after: ", msg);
  }
  return std::string(msg) + " (reported by the next call, " + op + ")";
}

uint32_t versionOf(const at::Tensor& t) {
  return t.is_inference() ? 0 : t._version();
}

int pendingReceives(const GroupState& st) {
  int n = 0;
  for (const auto& h : st.recent) {
    n += h.pending ? 1 : 0;
  }
  return n;
}

// Inference tensors carry no version counter: such handles are remembered by identity alone.
void remember(GroupState& st, RememberedHandle h) {
  h.version = versionOf(h.layout_range);
  st.recent.push_front(std::move(h));
  // Forget the oldest handles beyond the limit, never one whose receive is still pending.
  for (size_t i = st.recent.size(); i > kRecentHandles; --i) {
    auto it = st.recent.begin() + static_cast<std::ptrdiff_t>(i - 1);
    if (!it->pending) {
      st.recent.erase(it);
    }
  }
}

RememberedHandle* find(GroupState& st, const at::Tensor& layout_range) {
  for (auto& h : st.recent) {
    if (h.layout_range.is_same(layout_range) && h.version == versionOf(layout_range)) {
      return &h;
    }
  }
  return nullptr;
}

// The buffer of a handle whose dispatch state is still in it: one of the group's last two
// dispatches (they alternate the two buffers; an older one's buffer has been reused since),
// received, and not combined yet (one combine per dispatch, as the kernels allow).
int recall(GroupState& st, const at::Tensor& layout_range) {
  const RememberedHandle* h = find(st, layout_range);
  return h != nullptr && !h->pending && !h->combined && h->seq + 1 >= st.dispatches ? h->buffer
                                                                                    : -1;
}

#endif  // EP_WITH_CUDA

}  // namespace

void receive(EPProcessGroup& pg, const at::Tensor& layout_range) {
  auto st = stateOf(pg);
  if (!st->usability.yes() || !layout_range.is_cuda()) {
    return;  // the ATen path (also CPU tensors of this group): the exchange completed already
  }
#ifdef EP_WITH_CUDA
  // By identity alone (the hook holds the dispatch's own tensor): a pending receive must run.
  RememberedHandle* h = nullptr;
  for (auto& r : st->recent) {
    if (r.layout_range.is_same(layout_range)) {
      h = &r;
      break;
    }
  }
  if (h == nullptr) {
    return;  // a dispatch that took the ATen path (sizes beyond the kernels' buffers)
  }
  TORCH_CHECK(h->pending,
              "ep low_latency_dispatch hook: this dispatch has no receive pending (was the hook "
              "called twice?)");
  // No pendingError() here: the hook is not collective, and a rank that skipped its receive would
  // leave the buffer's arrival counters unreset; an earlier kernel error surfaces at the group's
  // next dispatch or combine (a timeout makes the library refuse this call anyway).
  c10::cuda::CUDAGuard guard(layout_range.device());
  // The receive runs on the send's stream, so the runtime's calls stay in issue order whatever
  // stream the hook is called on; the caller's stream then waits for it.
  const c10::cuda::CUDAStream stream = *h->stream;
  int buffer = 0;
  char err[1024] = {0};
  check(library().dispatch(st->runtime, &h->args, stream.stream(), &buffer, err, sizeof(err)),
        "low_latency_dispatch hook", err);
  h->pending = false;
  // The stream still reads the inputs and writes the outputs: hand them to the allocator as
  // used on this stream before letting go.
  for (const auto& t : h->keep_alive) {
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
  }
  h->keep_alive.clear();
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(stream.device_index());
  if (current != stream) {
    cudaEvent_t received = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&received, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(received, stream.stream()));
    C10_CUDA_CHECK(cudaStreamWaitEvent(current.stream(), received, 0));
    C10_CUDA_CHECK(cudaEventDestroy(received));  // released once the wait is satisfied
  }
#endif
}

#ifdef EP_WITH_CUDA
void* agreedSetup(EPProcessGroup& pg, const std::string& prefix, const char* op, const char* retry,
                  const std::function<int(void**, char*, size_t)>& make,
                  const std::function<int(void*, char*, size_t)>& connect,
                  const std::function<void(void*)>& abandon) {
  // A C entry point's outcome: "" on success, else its message.
  const auto outcome = [](int rc, const char* err) {
    return rc == 0 ? std::string() : std::string(err[0] != 0 ? err : "failed");
  };
  char err[1024] = {0};
  void* rt = nullptr;
  std::string mine = outcome(make(&rt, err, sizeof(err)), err);
  if (!mine.empty()) {
    rt = nullptr;
  } else if (g_fail_next_setup.exchange(false)) {
    abandon(rt);
    rt = nullptr;
    mine = "a failure injected by a test (_fail_next_nvshmem_setup)";
  }
  // Every rank's outcome of one step: where any rank failed (or never posted), every rank drops
  // its new runtime without a collective and raises.
  const auto agreeOnStep = [&](const char* step, const std::string& outcome) {
    std::string failure;
    try {
      failure = setupStepFailure(pg, prefix + step + "/", outcome, op, step);
    } catch (...) {
      if (rt != nullptr) abandon(rt);
      throw;
    }
    if (failure.empty()) return;
    if (rt != nullptr) abandon(rt);
    TORCH_CHECK(false, "ep ", op, ": ", failure, "; no data moved, and ", retry);
  };
  agreeOnStep("making", mine);
  err[0] = 0;
  agreeOnStep("connecting", outcome(connect(rt, err, sizeof(err)), err));
  return rt;
}
#endif  // EP_WITH_CUDA

void failNextSetupForTest() {
#ifdef EP_WITH_CUDA
  g_fail_next_setup.store(true);
#endif
}

std::tuple<bool, int64_t, int64_t> sessionInfo() {
#ifdef EP_WITH_CUDA
  int pe = -1, pes = 0, device = -1;
  if (library().ok && library().session(&pe, &pes, &device) != 0) {
    return {true, pe, pes};
  }
#endif
  return {false, -1, 0};
}

at::Tensor combineBuffer(EPProcessGroup& pg, const at::Tensor& layout_range,
                         int64_t num_max_dispatch_tokens_per_rank, int64_t num_experts,
                         int64_t hidden) {
  const int64_t num_ranks = pg.getSize();
  TORCH_CHECK(num_experts > 0 && num_experts % num_ranks == 0 && hidden > 0 &&
                  num_max_dispatch_tokens_per_rank > 0,
              "ep low_latency combine buffer: bad handle");
  const std::vector<int64_t> shape{num_experts / num_ranks,
                                   num_ranks * num_max_dispatch_tokens_per_rank, hidden};
  const auto options = layout_range.options().dtype(at::kBFloat16);
#ifdef EP_WITH_CUDA
  auto st = stateOf(pg);
  const int buffer = st->usability.yes() ? recall(*st, layout_range) : -1;
  if (buffer >= 0 && st->config.max_tokens_per_rank == num_max_dispatch_tokens_per_rank) {
    ep::NvshmemBufferView view;
    char err[1024] = {0};
    check(library().combine_buffer(st->runtime, buffer, static_cast<int>(num_experts),
                                   static_cast<int>(hidden), &view, err, sizeof(err)),
          "low_latency combine buffer", err);
    return at::from_blob(view.ptr, shape, options);
  }
#endif
  return at::empty(shape, options);
}

#ifdef EP_WITH_CUDA

LowLatencyDispatchResult dispatch(EPProcessGroup& pg, const LowLatencyDispatchInputs& a,
                                  bool send_only) {
  HostStages stages("low_latency_dispatch");  // EP_PROFILE_HOST
  const int64_t num_ranks = pg.getSize();
  auto st = stateOf(pg);
  std::string error = pendingError(*st, "low_latency_dispatch");
  if (error.empty()) {
    error = validateLowLatencyDispatch(a, num_ranks);
  }
  if (error.empty() && pendingReceives(*st) >= kMaxPendingReceives) {
    error =
        "ep low_latency_dispatch: two dispatches still await their recv hook; call one "
        "before the next dispatch (their buffers alternate)";
  }
  const bool ok = error.empty();
  const int64_t m = a.num_max_dispatch_tokens_per_rank;
  std::vector<AgreedField> fields = lowLatencyDispatchFields(a, ok);
  fields.push_back({"a CUDA graph captured on the NVSHMEM buffers", st->graph_captured ? 1 : 0});
  const std::vector<int64_t> payload{ok ? a.topk_idx.size(1) : 0, pendingReceives(*st)};
  RankMaskSnapshot mask = rankMask(pg);
  stages.mark("validate");
  const AgreedRows g =
      agreeAmongLiveRanks(pg, "low_latency_dispatch", error, fields, payload, mask);
  stages.mark("agree");
  int64_t max_topk = 1;
  int64_t pending = 0;  // receives still awaited, over all ranks
  for (int64_t r = 0; r < g.rows(); ++r) {
    max_topk = std::max(max_topk, g(r, 0));
    pending += g(r, 1);
  }

  const int64_t hidden = a.x.size(1);
  // Sizes beyond what the kernels' buffers can ever hold: the ATen path, on every rank alike
  // (H and E are agreed). Its handle is unknown to the kernels, so its combine and hook do too.
  if (hidden > nvshmem::kMaxHidden || a.num_experts > nvshmem::kMaxExperts) {
    return atenTransport().lowLatencyDispatch(pg, a, /*send_only=*/false);
  }
  // A rebuild frees both buffers, and with them the rows of a dispatch awaiting its receive.
  // Every input of this decision is agreed, so every rank raises alike.
  TORCH_CHECK(st->runtime == nullptr || fits(st->config, m, hidden, max_topk, a.num_experts) ||
                  pending == 0,
              "ep low_latency_dispatch: M=", m, ", H=", hidden, ", top-k=", max_topk,
              ", E=", a.num_experts,
              " need new NVSHMEM buffers, but a dispatch still awaits its recv hook (on some "
              "rank); call the hooks first (nothing was exchanged)");

  // Building the buffers is collective over every rank (a barrier): not while one is masked.
  // With auto-masking on and nobody masked (the mask as this call's agreement left it), every
  // rank joined this call, so the first call (deep_ep's enable_shrink turns auto-masking on
  // before any) and a reshape still build them together.
  TORCH_CHECK(!mask.any_masked() ||
                  (st->runtime != nullptr && fits(st->config, m, hidden, max_topk, a.num_experts)),
              "ep low_latency_dispatch: M=", m, ", H=", hidden, ", top-k=", max_topk,
              ", E=", a.num_experts,
              " need new NVSHMEM buffers, which every rank must build together; not possible "
              "while ranks are masked (keep the shapes of the calls made before; nothing was "
              "exchanged)");
  const at::Device device = a.x.device();
  c10::cuda::CUDAGuard guard(device);
  void* rt = ensureRuntime(pg, *st, device, m, hidden, max_topk, a.num_experts);
  stages.mark("runtime");
  const at::Tensor x = alignedTo16(a.x);
  const int64_t experts_per_rank = a.num_experts / num_ranks;
  const int64_t slots = num_ranks * m;
  const auto opts = a.x.options();
  LowLatencyDispatchResult out;
  out.recv_x = at::empty({experts_per_rank, slots, hidden},
                         opts.dtype(a.use_fp8 ? at::kFloat8_e4m3fn : at::kBFloat16));
  // The small outputs in one allocation (recv_x, which a caller may drop first, in its own):
  // the FP8 scales, the per-expert counts, the source of each slot and the layout ranges.
  const CarvedShape scales = a.use_ue8m0
                                 ? CarvedShape{{experts_per_rank, slots, hidden / 512}, at::kInt}
                                 : CarvedShape{{experts_per_rank, slots, hidden / 128}, at::kFloat};
  auto small = carveTensors<4>(device, {a.use_fp8 ? scales : CarvedShape{{0}, at::kFloat},
                                        CarvedShape{{experts_per_rank}, at::kInt},
                                        CarvedShape{{experts_per_rank, slots}, at::kInt},
                                        CarvedShape{{experts_per_rank, num_ranks}, at::kLong}});
  if (a.use_fp8) out.recv_x_scales = small[0];
  out.recv_count = small[1];
  out.src_info = small[2];
  out.layout_range = small[3];

  ep::NvshmemDispatchArgs args;
  args.x = x.data_ptr();
  args.num_tokens = static_cast<int>(x.size(0));
  args.hidden = static_cast<int>(hidden);
  args.topk_idx = a.topk_idx.data_ptr();
  args.idx_bytes = static_cast<int>(a.topk_idx.element_size());
  args.num_topk = static_cast<int>(a.topk_idx.size(1));
  args.num_experts = static_cast<int>(a.num_experts);
  args.use_fp8 = a.use_fp8;
  args.round_scale = a.round_scale;
  args.use_ue8m0 = a.use_ue8m0;
  args.recv_x = out.recv_x.data_ptr();
  args.recv_x_scales = a.use_fp8 ? out.recv_x_scales->data_ptr() : nullptr;
  args.recv_count = out.recv_count.data_ptr<int>();
  args.src_info = out.src_info.data_ptr<int>();
  args.layout_range = out.layout_range.data_ptr<int64_t>();
  // Slots past recv_count are unspecified (docs/semantics.md), as in DeepEP: zero-filling them
  // would write up to E_loc*R*M*H*2 bytes per call (58 MB at M=256, H=7168, E_loc=8).
  args.zero_padding = false;
  args.phases = send_only ? nvshmem::kPhaseSend : nvshmem::kPhaseBoth;
  args.timeout_seconds = pg.options()->kernel_timeout_s;  // per call: settable live
  // Always the group's device mask (stable address): a graph captured now honours later masks.
  args.rank_mask = rankMaskDevice(pg, device).data_ptr<int>();
  int buffer = 0;
  char err[1024] = {0};
  stages.mark("alloc");
  check(library().dispatch(rt, &args, c10::cuda::getCurrentCUDAStream(device.index()).stream(),
                           &buffer, err, sizeof(err)),
        "low_latency_dispatch", err);
  stages.mark("launch");
  RememberedHandle h;
  h.layout_range = out.layout_range;
  h.buffer = buffer;
  h.seq = ++st->dispatches;
  h.num_tokens = a.topk_idx.size(0);
  h.num_topk = a.topk_idx.size(1);
  if (send_only) {
    h.pending = true;
    h.args = args;
    h.args.phases = nvshmem::kPhaseRecv;
    h.args.buffer_index = buffer;
    h.stream = c10::cuda::getCurrentCUDAStream(device.index());
    h.keep_alive = {x, a.topk_idx, out.recv_x, out.recv_count, out.src_info, out.layout_range};
    if (out.recv_x_scales) {
      h.keep_alive.push_back(*out.recv_x_scales);
    }
  }
  remember(*st, std::move(h));
  return out;
}

std::optional<at::Tensor> combine(EPProcessGroup& pg, const LowLatencyCombineInputs& a) {
  HostStages stages("low_latency_combine");  // EP_PROFILE_HOST
  const int64_t num_ranks = pg.getSize();
  auto st = stateOf(pg);
  std::string error = pendingError(*st, "low_latency_combine");
  if (error.empty()) {
    error = validateLowLatencyCombine(a, num_ranks);
  }
  const bool ok = error.empty();
  int buffer = ok ? recall(*st, a.layout_range) : -1;
  const RememberedHandle* handle = buffer >= 0 ? find(*st, a.layout_range) : nullptr;
  // Whatever the library would refuse after the agreement (on this rank only, leaving its peers
  // in the kernel until the timeout) takes the ATen path instead, on every rank alike: another
  // T or K than the dispatch's (the kernel reads the dispatch's send positions), an H beyond the
  // buffers, x not 16-byte aligned, topk_weights not contiguous (the kernel reads them [T, K]).
  bool zero_copy = false;
  if (handle != nullptr) {
    ep::NvshmemBufferView view;
    char err[1024] = {0};
    const bool fits_buffer =
        library().combine_buffer(st->runtime, buffer, static_cast<int>(a.x.size(0) * num_ranks),
                                 static_cast<int>(a.x.size(2)), &view, err, sizeof(err)) == 0;
    // x written straight into the send buffer (combineBuffer): no copy-in.
    zero_copy = fits_buffer && view.ptr == a.x.data_ptr();
    const bool aligned = reinterpret_cast<uintptr_t>(a.x.data_ptr()) % 16 == 0;
    if (!fits_buffer || a.topk_idx.size(0) != handle->num_tokens ||
        a.topk_idx.size(1) != handle->num_topk || !a.topk_weights.is_contiguous() ||
        !(zero_copy || aligned)) {
      buffer = -1;
    }
  }
  // Read once: the agreement and the launch see the same value, also if a thread sets it.
  const bool bf16_partials = pg.options()->low_latency_combine_bf16_partials;
  std::vector<AgreedField> fields{
      {"num_max_dispatch_tokens_per_rank", a.num_max_dispatch_tokens_per_rank},
      {"hidden size H", ok ? a.x.size(2) : -1},
      // The token side reads each partial in the format its expert rank wrote.
      {"Options.low_latency_combine_bf16_partials", bf16_partials},
  };
  // Every rank's buffer index and dispatch number: a handle this group's kernels did not make
  // on every rank (a copy, an older one, another dispatch's) sends every rank down the ATen path
  // together, which reads the same handle format.
  const int64_t seq = buffer >= 0 ? static_cast<int64_t>(handle->seq) : -1;
  RankMaskSnapshot mask = rankMask(pg);
  stages.mark("validate");
  const AgreedRows g =
      agreeAmongLiveRanks(pg, "low_latency_combine", error, fields, {buffer, seq}, mask);
  stages.mark("agree");
  for (int64_t r = 0; r < g.rows(); ++r) {
    if (mask.is_masked(r)) {
      continue;  // its row reads as zeros: it takes no part
    }
    if (g(r, 0) < 0 || g(r, 0) != buffer || g(r, 1) != seq) {
      return std::nullopt;  // every rank sees the same gathered rows: all take the ATen path
    }
  }
  const at::Device device = a.x.device();
  c10::cuda::CUDAGuard guard(device);
  const int64_t num_tokens = a.topk_idx.size(0);
  at::Tensor out = at::empty({num_tokens, a.x.size(2)}, a.x.options().dtype(at::kBFloat16));
  ep::NvshmemCombineArgs args;
  args.zero_copy = zero_copy;
  args.x = a.x.data_ptr();
  args.hidden = static_cast<int>(a.x.size(2));
  args.topk_weights = a.topk_weights.data_ptr<float>();
  args.num_tokens = static_cast<int>(num_tokens);
  args.num_topk = static_cast<int>(a.topk_idx.size(1));
  args.num_experts = static_cast<int>(a.x.size(0) * num_ranks);
  args.layout_range = a.layout_range.data_ptr<int64_t>();
  args.buffer_index = buffer;
  args.out = out.data_ptr();
  args.phases = nvshmem::kPhaseBoth;
  args.timeout_seconds = pg.options()->kernel_timeout_s;  // per call: settable live
  args.rank_mask = rankMaskDevice(pg, device).data_ptr<int>();
  args.bf16_partials = bf16_partials;
  char err[1024] = {0};
  stages.mark("alloc");
  check(
      library().combine(st->runtime, &args,
                        c10::cuda::getCurrentCUDAStream(device.index()).stream(), err, sizeof(err)),
      "low_latency_combine", err);
  stages.mark("launch");
  if (RememberedHandle* h = find(*st, a.layout_range)) {
    h->combined = true;
  }
  return out;
}

void* librarySymbol(const char* name, std::string* error) {
  const Library& lib = library();
  if (!lib.ok) {
    *error = lib.error;
    return nullptr;
  }
  // The library is loaded already: dlopen returns its handle (and takes one more reference,
  // which the process keeps, as library() does).
  void* dl = dlopen(libraryPath().c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  void* sym = dl != nullptr ? dlsym(dl, name) : nullptr;
  if (sym == nullptr) {
    *error = std::string("libep_nvshmem.so lacks ") + name + " (rebuild it)";
  }
  return sym;
}

void ensureSession(EPProcessGroup& pg, const at::Device& device, size_t extra_symmetric_bytes) {
  auto st = stateOf(pg);
  TORCH_CHECK(st->usability.yes(), "ep: the NVSHMEM session of this group is not usable");
  c10::cuda::CUDAGuard guard(device);
  // Started here for the internode transport: the heap sized for the smallest low-latency
  // buffers plus the caller's. A session running already keeps its heap, which grows on
  // nvshmem_malloc where CUDA VMM is on (NVSHMEM's default).
  NvshmemConfig cfg = configFor(pg, /*m=*/1, /*hidden=*/nvshmem::kGroupSize, /*topk=*/1,
                                /*experts=*/pg.getSize());
  cfg.extra_symmetric_bytes = extra_symmetric_bytes;
  startSessionIfNone(pg, *st, device, cfg);
}

void parkCollectiveFree(std::function<void()> free_buffers) {
  SessionRecord& rec = sessionRecord();
  std::lock_guard<std::mutex> lock(rec.mutex);
  rec.parked.push_back(std::move(free_buffers));
}

#endif  // EP_WITH_CUDA

}  // namespace ep::nvshmem

#ifdef EP_WITH_CUDA
namespace ep {
namespace {

// The NVSHMEM transport behind the Transport interface (backend/transport.hpp).
class NvshmemTransport final : public PerGroupTransport<nvshmem::GroupState> {
 public:
  TransportKind kind() const override { return TransportKind::kNvshmem; }
  bool serves(OpFamily family) const override { return family == OpFamily::kLowLatency; }
  LowLatencyDispatchResult lowLatencyDispatch(EPProcessGroup& pg,
                                              const LowLatencyDispatchInputs& args,
                                              bool send_only) override {
    return nvshmem::dispatch(pg, args, send_only);
  }
  std::optional<at::Tensor> lowLatencyCombine(EPProcessGroup& pg,
                                              const LowLatencyCombineInputs& args) override {
    return nvshmem::combine(pg, args);
  }

 private:
  std::shared_ptr<nvshmem::GroupState> stateOf(EPProcessGroup& pg) override {
    return nvshmem::stateOf(pg);
  }
  std::shared_ptr<nvshmem::GroupState> findState(EPProcessGroup& pg) override {
    return nvshmem::stateOf(pg, /*create=*/false);
  }
  Verdict decide(EPProcessGroup& pg, nvshmem::GroupState& st, const at::Device& device) override {
    return nvshmem::decide(pg, st, device);
  }
};

}  // namespace

Transport& nvshmemTransport() {
  static NvshmemTransport transport;
  return transport;
}

}  // namespace ep
#endif  // EP_WITH_CUDA
