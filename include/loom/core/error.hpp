#pragma once

//! @file
//! loom::error, loom::errc and the LOOM_EXPECTS precondition macro.

#include <loom/config.hpp>

#include <cstddef>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace loom {

//! What went wrong. Carried by every loom::error.
enum class errc {
  invalid_argument = 1,  //!< an argument's value is outside what the call accepts
  shape_mismatch,        //!< extents or strides of a tensor do not fit the call
  unsupported,           //!< a valid request this build or backend cannot serve
  comm_failure,          //!< a communicator operation failed or peers disagree
  timeout,               //!< a peer did not arrive in time
  not_converged,         //!< an iterative method stopped without meeting its tolerance
  internal,              //!< a broken invariant inside loom (a bug: please report)
};

//! The name of an error code, e.g. "shape_mismatch".
constexpr std::string_view to_string(errc code) noexcept {
  constexpr std::string_view names[] = {"invalid_argument", "shape_mismatch", "unsupported", "comm_failure",
                                        "timeout",          "not_converged",  "internal"};
  const int i = static_cast<int>(code) - static_cast<int>(errc::invalid_argument);
  return i >= 0 && i < static_cast<int>(std::size(names)) ? names[i] : "unknown";
}

//! The one exception type loom throws for host-side misuse and failures.
//! what() reads "loom::<code>: <message>"; the message names the argument and what was expected.
class error : public std::runtime_error {
 public:
  error(errc code, const std::string& message)
      : std::runtime_error("loom::" + std::string(to_string(code)) + ": " + message), code_(code) {}
  [[nodiscard]] errc code() const noexcept { return code_; }

 private:
  errc code_;
};

namespace detail {
//! Joins the streamable parts of a message; only evaluated on the failure path.
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

//! `file` without everything up to and including its last "include/" (or "include\\"): a loom
//! header prints as "loom/scan/scan.hpp" wherever it is installed. Other paths are returned whole.
constexpr const char* source_path(const char* file) noexcept {
  const char* rest = file;
  for (const char* p = file; *p != '\0'; ++p) {
    constexpr char word[] = "include";
    std::size_t k = 0;
    while (k + 1 < sizeof word && p[k] == word[k]) ++k;
    if (k + 1 == sizeof word && (p[k] == '/' || p[k] == '\\') && (p == file || p[-1] == '/' || p[-1] == '\\'))
      rest = p + k + 1;
  }
  return rest;
}

[[noreturn]] inline void fail(errc code, const std::string& message, const char* file, int line) {
  throw error(code, message + " [" + source_path(file) + ":" + std::to_string(line) + "]");
}
}  // namespace detail

}  // namespace loom

//! Host-side precondition: if `cond` is false, throws loom::error(code, message) where the
//! message is built from the remaining streamable arguments, e.g.
//! `LOOM_EXPECTS(n >= 0, errc::invalid_argument, "n must be >= 0, got ", n);`
#define LOOM_EXPECTS(cond, code, ...)                                                        \
  do {                                                                                       \
    if (!(cond)) [[unlikely]]                                                                \
      ::loom::detail::fail((code), ::loom::detail::concat(__VA_ARGS__), __FILE__, __LINE__); \
  } while (0)

//! Unconditional failure with the same message convention as LOOM_EXPECTS.
#define LOOM_FAIL(code, ...) ::loom::detail::fail((code), ::loom::detail::concat(__VA_ARGS__), __FILE__, __LINE__)
