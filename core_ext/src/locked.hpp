// read_locked: one member of a data-plane object, copied under the object's mutex.
//
// Private to src/: the one-line getters of HandlePool, SpaceGroup, TensorSpace and HostBackend read a
// counter, flag or message that their operations change under `mu_`; the copy is made before the lock is
// released, as a getter that held a lock_guard and returned the member did.
#pragma once

#include <mutex>

namespace elastic_kv {

template <class T>
T read_locked(std::mutex& mu, const T& member) {
  std::lock_guard<std::mutex> lock(mu);
  return member;
}

}  // namespace elastic_kv
