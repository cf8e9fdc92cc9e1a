#pragma once

//! @file
//! Cross-rank agreement before data moves: every rank validates its own arguments, then one small
//! all_gather tells every rank whether all of them accepted theirs and whether they were given
//! the same call (plan, shapes, options, offsets, ...). The outcome is the same on every rank:
//! either every rank goes on, or every rank throws the same loom::error naming the first rank that
//! rejected its arguments (with that rank's message and code) or the first rank whose call
//! differs and in what.
//!
//!   comm::agree(comm, "ring::forward(pass_kv)", [&] {
//!     pb = check_views(...);                            // may throw: becomes every rank's error
//!     return comm::signature{}.add("the plan", digest).add("the options", opt.causal, opt.window);
//!   });
//!
//! Cost: one all_gather of `agreement_bytes` (648) bytes per rank. A check that throws on one rank
//! can no longer leave the others waiting in a later collective (over MPI that was a hang).

#include <loom/comm/communicator.hpp>
#include <loom/comm/stream_order.hpp>
#include <loom/core/error.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace loom::comm {

//! A check of this rank's that checks nothing: the default of a plan maker's extra checks run
//! inside its agreement (a shard plan's runs, for the makers that take one).
struct no_check {
  void operator()() const {}
};

//! 64-bit FNV-1a over the bytes of trivially copyable values and ranges: equal inputs give equal
//! digests on every rank (same build, same byte order).
class hasher {
 public:
  hasher& bytes(const void* p, std::size_t n) noexcept {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i) h_ = (h_ ^ b[i]) * 0x100000001b3ULL;
    return *this;
  }
  template <class... T>
  hasher& add(const T&... values) noexcept {
    static_assert((std::is_trivially_copyable_v<T> && ...), "hasher::add: trivially copyable values only");
    (bytes(&values, sizeof(T)), ...);
    return *this;
  }
  //! The length, then the elements.
  template <class T>
  hasher& add_range(std::span<const T> values) noexcept {
    static_assert(std::is_trivially_copyable_v<T>, "hasher::add_range: trivially copyable elements only");
    add(static_cast<std::uint64_t>(values.size()));
    return bytes(values.data(), values.size_bytes());
  }
  hasher& add_string(std::string_view s) noexcept {
    add(static_cast<std::uint64_t>(s.size()));
    return bytes(s.data(), s.size());
  }
  [[nodiscard]] std::uint64_t value() const noexcept { return h_; }

 private:
  std::uint64_t h_ = 0xcbf29ce484222325ULL;
};

//! What one rank was given for a collective call, as named digests (at most `capacity`). The
//! names are the words of the error when ranks differ: "ranks disagree on <name>".
class signature {
 public:
  static constexpr std::size_t capacity = 16;

  //! Adds the field `name` (a string literal: only the view is kept), the digest of `values`.
  template <class... T>
  signature& add(std::string_view name, const T&... values) {
    return add_digest(name, hasher{}.add(values...).value());
  }
  template <class T>
  signature& add_range(std::string_view name, std::span<const T> values) {
    return add_digest(name, hasher{}.add_range(values).value());
  }
  signature& add_digest(std::string_view name, std::uint64_t digest) {
    LOOM_EXPECTS(size_ < capacity, errc::internal, "comm::signature: more than ", capacity, " fields");
    names_[size_] = name;
    digests_[size_++] = digest;
    return *this;
  }
  //! Two numbers of this rank that are exchanged but not compared (e.g. where its slice begins and
  //! ends): agree() returns every rank's, so the caller can check how they fit together.
  signature& local(std::uint64_t first, std::uint64_t second = 0) {
    local_ = {first, second};
    return *this;
  }
  [[nodiscard]] const std::array<std::uint64_t, 2>& local() const noexcept { return local_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::string_view name(std::size_t i) const { return names_[i]; }
  [[nodiscard]] std::uint64_t digest(std::size_t i) const { return digests_[i]; }

 private:
  std::array<std::string_view, capacity> names_{};
  std::array<std::uint64_t, capacity> digests_{};
  std::size_t size_ = 0;
  std::array<std::uint64_t, 2> local_{};
};

//! The error every rank throws when an agreement fails. It is a loom::error; a second agreement
//! (the hybrid grid's other group) passes it on unchanged instead of wrapping it again.
class agreement_error : public error {
 public:
  agreement_error(errc code, const std::string& message) : error(code, message), message_(message) {}
  [[nodiscard]] const std::string& message() const noexcept { return message_; }

 private:
  std::string message_;
};

namespace detail {
inline constexpr std::size_t agreement_text_words = 60;  //!< 480 bytes of a rank's error message
//! [0] status (0 accepted, 1 rejected, 2 passed on) [1] errc [2] rank label [3] call digest
//! [4] field count [5, 5 + capacity) field digests, two local numbers, then the message.
inline constexpr std::size_t agreement_fields = 5;
inline constexpr std::size_t agreement_locals = agreement_fields + signature::capacity;
inline constexpr std::size_t agreement_text = agreement_locals + 2;
inline constexpr std::size_t agreement_words = agreement_text + agreement_text_words;

//! The message of a loom::error without its "loom::<code>: " prefix.
inline std::string bare_message(const error& e) {
  std::string w = e.what();
  const std::string prefix = "loom::" + std::string(to_string(e.code())) + ": ";
  return w.rfind(prefix, 0) == 0 ? w.substr(prefix.size()) : w;
}
}  // namespace detail

//! Bytes each rank contributes to an agreement's all_gather.
inline constexpr std::size_t agreement_bytes = detail::agreement_words * sizeof(std::uint64_t);

//! Runs `check()` on this rank (local validation; it returns the signature of the call or
//! throws), then one all_gather over `comm`. Returns normally on every rank, or throws on every
//! rank the same loom::error (an agreement_error):
//!  - some rank's check threw: the code of the lowest such rank, and "on rank <r>: <its message>";
//!  - the ranks' signatures differ: errc::invalid_argument, "<call>: ranks disagree on <field>:
//!    rank <r> differs from rank <r0>", for the lowest rank r and its first differing field.
//! `label` is the number this rank is called by in messages (default: comm.rank(); a sub-group
//! passes the rank in the whole job). Collective: every rank of comm calls it, once per call site.
//! Returns every rank's signature::local() numbers, in rank order.
//! Cost: one all_gather of agreement_bytes per rank; the wait is the communicator's (bounded by
//! its timeout).
template <communicator C, class Check>
std::vector<std::array<std::uint64_t, 2>> agree(C& comm, std::string_view call, Check&& check, int label = -1) {
  std::array<std::uint64_t, detail::agreement_words> mine{};
  signature sig;
  std::string text;
  errc code = errc::internal;
  int status = 0;
  try {
    sig = check();
  } catch (const agreement_error& e) {
    status = 2;
    code = e.code();
    text = e.message();
  } catch (const error& e) {
    status = 1;
    code = e.code();
    text = detail::bare_message(e);
  } catch (const std::exception& e) {
    status = 1;
    text = std::string(call) + ": " + e.what();
  }
  mine[0] = static_cast<std::uint64_t>(status);
  mine[1] = static_cast<std::uint64_t>(code);
  mine[2] = static_cast<std::uint64_t>(static_cast<std::int64_t>(label >= 0 ? label : comm.rank()));
  mine[3] = hasher{}.add_string(call).value();
  mine[4] = sig.size();
  for (std::size_t i = 0; i < sig.size(); ++i) mine[detail::agreement_fields + i] = sig.digest(i);
  mine[detail::agreement_locals] = sig.local()[0];
  mine[detail::agreement_locals + 1] = sig.local()[1];
  const std::size_t room = detail::agreement_text_words * sizeof(std::uint64_t) - 1;
  std::memcpy(&mine[detail::agreement_text], text.data(), text.size() < room ? text.size() : room);

  const auto p = static_cast<std::size_t>(comm.size());
  std::vector<std::uint64_t> all(p * detail::agreement_words);
  host_all_gather(comm, std::span<const std::uint64_t>(mine), std::span<std::uint64_t>(all));
  auto rec = [&](std::size_t r) { return all.data() + r * detail::agreement_words; };
  auto label_of = [&](std::size_t r) { return static_cast<std::int64_t>(rec(r)[2]); };

  for (std::size_t r = 0; r < p; ++r)
    if (rec(r)[0] != 0) {
      char buf[detail::agreement_text_words * sizeof(std::uint64_t)];
      std::memcpy(buf, rec(r) + detail::agreement_text, sizeof buf);
      buf[sizeof buf - 1] = '\0';
      const auto c = static_cast<errc>(rec(r)[1]);
      if (rec(r)[0] == 2) throw agreement_error(c, buf);  // an earlier agreement's error, passed on
      throw agreement_error(c, ::loom::detail::concat("on rank ", label_of(r), ": ", static_cast<const char*>(buf)));
    }
  for (std::size_t r = 1; r < p; ++r) {
    std::string what;
    if (rec(r)[3] != rec(0)[3] || rec(r)[4] != rec(0)[4]) {
      what = "the call (another primitive, or another pass)";
    } else {
      for (std::size_t i = 0; i < sig.size() && what.empty(); ++i)
        if (rec(r)[detail::agreement_fields + i] != rec(0)[detail::agreement_fields + i]) what = sig.name(i);
    }
    if (!what.empty())
      throw agreement_error(errc::invalid_argument,
                            ::loom::detail::concat(call, ": ranks disagree on ", what, ": rank ", label_of(r),
                                                   " differs from rank ", label_of(0)));
  }
  std::vector<std::array<std::uint64_t, 2>> locals(p);
  for (std::size_t r = 0; r < p; ++r)
    locals[r] = {rec(r)[detail::agreement_locals], rec(r)[detail::agreement_locals + 1]};
  return locals;
}

//! agree() for calls whose checks run inside code that goes on to communicate: `body(agreed)` must
//! call `agreed(signature)` once its checks are done and before any other collective. A throw from
//! body before that point is exchanged like a failed check (every rank throws); a throw after it
//! (a failure while communicating) propagates unchanged.
template <communicator C, class Body>
void agree_within(C& comm, std::string_view call, Body&& body, int label = -1) {
  bool reached = false;
  auto agreed = [&](const signature& s) {
    reached = true;
    agree(
        comm, call, [&] { return s; }, label);
  };
  try {
    body(agreed);
  } catch (...) {
    if (reached) throw;
    agree(
        comm, call, []() -> signature { throw; }, label);
  }
  LOOM_EXPECTS(reached, errc::internal, call, ": returned without agreeing with the other ranks");
}

}  // namespace loom::comm
