#pragma once

// Element-wise conversions between the fp64 vectors of the oracles and a precision's types.

#include <cstddef>
#include <vector>

namespace loom::test {

//! x converted element by element to T (rounded as T's conversion from double rounds).
template <class T>
std::vector<T> cast(const std::vector<double>& x) {
  std::vector<T> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) r[i] = static_cast<T>(x[i]);
  return r;
}

//! x widened to double: exact and one to one (also for -0 and the infinities), so equal bits stay
//! equal.
template <class T>
std::vector<double> widen(const std::vector<T>& x) {
  std::vector<double> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) r[i] = static_cast<double>(x[i]);
  return r;
}

}  // namespace loom::test
