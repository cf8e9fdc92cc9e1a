#pragma once

// Requiring a loom::error: its code and the parts its message must contain.

#include <loom/core/error.hpp>

#include <catch2/catch.hpp>

#include <initializer_list>
#include <string>
#include <string_view>

namespace loom::test {

//! Runs f and requires a loom::error with `code` whose what() contains every part (the call and
//! the names of the arguments); returns what() (empty when nothing was thrown).
template <class F>
std::string require_loom_error(F&& f, errc code, std::initializer_list<std::string_view> parts) {
  try {
    f();
  } catch (const loom::error& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(e.code() == code);
    for (auto p : parts) CHECK(what.find(p) != std::string::npos);
    return what;
  }
  FAIL("no loom::error was thrown");
  return {};
}

}  // namespace loom::test
