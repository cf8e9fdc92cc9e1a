#pragma once

// Running a body on in-process ranks and checking what each rank threw. Catch's assertions are not
// thread-safe, so rank threads only record their errors; the test asserts on its own thread.

#include <loom/comm/local.hpp>
#include <loom/core/error.hpp>

#include <string>
#include <vector>

namespace loom::test {

//! Runs fn(comm) on p in-process ranks; element r is what rank r threw (loom::error::what()), or
//! empty if it returned normally.
template <class F>
std::vector<std::string> errors_on_ranks(int p, F&& fn) {
  std::vector<std::string> what(static_cast<std::size_t>(p));
  loom::comm::run_local(p, [&](loom::comm::local& comm) {
    try {
      fn(comm);
    } catch (const loom::error& e) {
      what[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  return what;
}

//! True when every element contains `part`.
inline bool all_contain(const std::vector<std::string>& what, const std::string& part) {
  for (const auto& w : what)
    if (w.find(part) == std::string::npos) return false;
  return !what.empty();
}

}  // namespace loom::test
