#pragma once

// Per-precision tolerances, written once. Results are compared with an fp64 serial oracle:
// |actual - oracle| <= abs + rel * |oracle| element-wise. The numbers are a few units in the
// last place of the storage type, scaled for the accumulations loom's primitives do.

#include <loom/core/precision.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <sstream>
#include <string>

namespace loom::test {

//! True in sanitizer builds (LOOM_SANITIZE): the largest sweeps run a subset of their cases there.
#if defined(LOOM_TEST_SANITIZED)
inline constexpr bool sanitized = true;
#else
inline constexpr bool sanitized = false;
#endif

//! The end of the long document of the packed-document sweeps (141 + 1000 tokens; 141 + 400 in
//! sanitizer builds, where the fp64 oracle's quadratic cost dominates the run and a shorter
//! document reaches the same block and remainder paths).
inline constexpr long long long_document_end = sanitized ? 541 : 1141;

struct tolerance {
  double rel;
  double abs;
};

template <precision_policy P>
constexpr tolerance tolerance_for() {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  if constexpr (std::is_same_v<S, double>)
    return {1e-12, 1e-12};
  else if constexpr (std::is_same_v<S, float> && std::is_same_v<A, float>)
    return {2e-5, 2e-6};
  else if constexpr (std::is_same_v<S, half>)
    return {4e-3, 1e-3};  // 2^-10 unit roundoff
  else if constexpr (std::is_same_v<S, bfloat16>)
    return {3e-2, 8e-3};  // 2^-7 unit roundoff
  else
    return {2e-5, 2e-6};
}

//! Compares element-wise; on failure reports the worst element, its index and the tolerance.
template <class Actual, class Oracle>
void require_close(const Actual& actual, const Oracle& oracle, tolerance tol, const std::string& what) {
  REQUIRE(actual.size() == oracle.size());
  double worst = 0;
  std::size_t at = 0;
  bool ok = true;
  for (std::size_t i = 0; i < oracle.size(); ++i) {
    const double a = static_cast<double>(actual[i]), o = static_cast<double>(oracle[i]);
    const double err = std::abs(a - o), allowed = tol.abs + tol.rel * std::abs(o);
    if (!(err <= allowed)) {  // also catches NaN
      if (ok || err / allowed > worst) {
        worst = err / allowed;
        at = i;
      }
      ok = false;
    }
  }
  if (!ok) {
    std::ostringstream os;
    os << what << ": element " << at << " = " << static_cast<double>(actual[at]) << ", oracle "
       << static_cast<double>(oracle[at]) << ", error " << worst << "x the tolerance (rel " << tol.rel << ", abs "
       << tol.abs << ")";
    FAIL(os.str());
  }
  SUCCEED(what << ": " << oracle.size() << " elements within tolerance");
}

}  // namespace loom::test
