#include "elastic_kv/dynlib.hpp"

#include <dlfcn.h>

#include "elastic_kv/errors.hpp"

namespace elastic_kv {

SharedLibrary::SharedLibrary(const std::string& name)
    : name_(name), handle_(dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL)) {
  if (handle_ == nullptr) {
    const char* why = dlerror();
    throw ConfigurationError("cannot load " + name + ": " + (why != nullptr ? why : "unknown dlopen error"));
  }
}

void* SharedLibrary::find(const char* symbol) const noexcept { return dlsym(handle_, symbol); }

void* SharedLibrary::require(const char* symbol) const {
  void* p = find(symbol);
  if (p == nullptr) throw ConfigurationError(name_ + " does not export " + symbol + " (driver too old?)");
  return p;
}

}  // namespace elastic_kv
