// Per-group state of one component of the backend (the NVLink transport, the NVSHMEM transport,
// the agreement exchange): created at the group's first use, released by the group's shutdown
// hook (which also runs when the backend is destroyed or its resources released). Components
// keep one registry for the life of the process, leaked on purpose so that no CUDA work runs
// from static destructors at exit:
//   GroupStates<State>& states() { static auto* s = new GroupStates<State>(release); return *s; }
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include "backend/ep_process_group.hpp"

namespace ep {

template <class State>
class GroupStates {
 public:
  // `release` runs once per group at its shutdown, outside the registry's lock (it may do CUDA or
  // NVSHMEM work); callers that hold a state keep it alive until they let go.
  explicit GroupStates(std::function<void(EPProcessGroup*, State&)> release = {})
      : release_(std::move(release)) {}

  // The group's state if it has one (never creates it).
  std::shared_ptr<State> find(EPProcessGroup& pg) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = states_.find(&pg);
    return it == states_.end() ? nullptr : it->second;
  }

  std::shared_ptr<State> of(EPProcessGroup& pg) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& entry = states_[&pg];
    if (!entry) {
      entry = std::make_shared<State>();
      EPProcessGroup* key = &pg;
      pg.addShutdownHook([this, key] {
        std::shared_ptr<State> state;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          auto it = states_.find(key);
          if (it == states_.end()) {
            return;
          }
          state = std::move(it->second);
          states_.erase(it);
        }
        if (release_) {
          release_(key, *state);
        }
      });
    }
    return entry;
  }

 private:
  std::function<void(EPProcessGroup*, State&)> release_;
  std::mutex mutex_;
  std::map<EPProcessGroup*, std::shared_ptr<State>> states_;
};

}  // namespace ep
