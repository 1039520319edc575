// Loading a driver library at run time (dlopen), so that one build of the module serves every driver version
// and machines without a GPU: nothing from CUDA or ROCm is needed at build or link time.
//
// The library handle is deliberately never dlclose()d: libcuda/libamdhip64 cannot be unloaded safely while
// other users in the process (torch, NCCL) hold contexts on it, and the dynamic loader shares one instance
// anyway. A SharedLibrary object therefore only names the loaded library; it owns nothing to free.
#pragma once

#include <string>

namespace elastic_kv {

class SharedLibrary {
 public:
  // dlopen(RTLD_NOW | RTLD_LOCAL); throws ConfigurationError naming the library and dlerror() on failure.
  explicit SharedLibrary(const std::string& name);

  const std::string& name() const noexcept { return name_; }
  // dlsym; nullptr if absent.
  void* find(const char* symbol) const noexcept;
  // dlsym; throws ConfigurationError if absent.
  void* require(const char* symbol) const;

 private:
  std::string name_;
  void* handle_;
};

}  // namespace elastic_kv
