#pragma once

//! @file
//! The monoid concept every loom scan is written against, and the monoids loom provides.
//! A monoid is an associative combine with an identity; commutativity is never assumed, so
//! combine(a, b) always means "a first, then b" in sequence order.

#include <loom/config.hpp>

#include <concepts>
#include <limits>
#include <type_traits>

namespace loom::scan {

//! M::value_type (trivially copyable, so aggregates can travel through communicators and device
//! memory), M::identity() and M::combine(a, b), both LOOM_HD and const.
template <class M>
concept monoid = std::copy_constructible<M> && std::is_trivially_copyable_v<typename M::value_type> &&
    requires(const M& m, const typename M::value_type& a) {
  { m.identity() } -> std::convertible_to<typename M::value_type>;
  { m.combine(a, a) } -> std::convertible_to<typename M::value_type>;
};

//! a + b.
template <class T>
struct plus {
  using value_type = T;
  LOOM_HD constexpr T identity() const noexcept { return T(0); }
  LOOM_HD constexpr T combine(const T& a, const T& b) const noexcept { return a + b; }
};

//! a * b.
template <class T>
struct multiplies {
  using value_type = T;
  LOOM_HD constexpr T identity() const noexcept { return T(1); }
  LOOM_HD constexpr T combine(const T& a, const T& b) const noexcept { return a * b; }
};

//! max(a, b), identity the lowest value of T.
template <class T>
struct maximum {
  using value_type = T;
  LOOM_HD constexpr T identity() const noexcept { return std::numeric_limits<T>::lowest(); }
  LOOM_HD constexpr T combine(const T& a, const T& b) const noexcept { return a < b ? b : a; }
};

//! min(a, b), identity the largest value of T.
template <class T>
struct minimum {
  using value_type = T;
  LOOM_HD constexpr T identity() const noexcept { return std::numeric_limits<T>::max(); }
  LOOM_HD constexpr T combine(const T& a, const T& b) const noexcept { return b < a ? b : a; }
};

//! One step x -> a x + b of a scalar affine recurrence.
template <class T>
struct affine_pair {
  T a, b;
};

//! Composition of scalar affine steps, "first, then second": (a2 a1, a2 b1 + b2). The inclusive
//! scan of steps (a_t, b_t) gives h_t = a_t h_{t-1} + b_t from h_{-1} = 0 in its .b member.
template <class T>
struct affine {
  using value_type = affine_pair<T>;
  LOOM_HD constexpr value_type identity() const noexcept { return {T(1), T(0)}; }
  LOOM_HD constexpr value_type combine(const value_type& first, const value_type& second) const noexcept {
    return {second.a * first.a, second.a * first.b + second.b};
  }
};

//! An element of a segmented scan: `head` marks that a segment starts at (or inside) it.
template <class T>
struct flagged {
  T value;
  bool head;
};

//! Lifts M to segmented values: a head discards everything before it. Associative whenever M is;
//! this is how segment resets survive block and rank boundaries.
template <monoid M>
struct segmented {
  using inner_value = typename M::value_type;
  using value_type = flagged<inner_value>;
  M inner{};
  LOOM_HD constexpr value_type identity() const { return {inner.identity(), false}; }
  LOOM_HD constexpr value_type combine(const value_type& first, const value_type& second) const {
    if (second.head) return second;
    return {inner.combine(first.value, second.value), first.head};
  }
};

//! M with its operands swapped: a reverse scan is a forward scan of the reversed sequence with
//! this monoid, so x[i] op x[i+1] keeps its sequence order.
template <monoid M>
struct flipped {
  using value_type = typename M::value_type;
  M inner{};
  LOOM_HD constexpr value_type identity() const { return inner.identity(); }
  LOOM_HD constexpr value_type combine(const value_type& a, const value_type& b) const { return inner.combine(b, a); }
};

}  // namespace loom::scan
