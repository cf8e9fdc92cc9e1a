#pragma once

// Helpers of the document-isolation tests: the packed documents they use, where a non-finite value
// is injected, and the bitwise comparison of the rows of every other document.

#include <loom/core/tensor_view.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace loom::test::poison {

enum class value { nan, pos_inf, neg_inf };
inline constexpr value all_values[] = {value::nan, value::pos_inf, value::neg_inf};

inline const char* name(value v) { return v == value::nan ? "NaN" : v == value::pos_inf ? "+inf" : "-inf"; }

//! A view of A with the rank of structure St, in memory space Space.
template <class St, class Space = host_memory, class T>
auto a_view(T* p, index_t n, index_t d) {
  if constexpr (St::a_rank == 1)
    return tensor_view<T, 1, Space>(p, {n});
  else if constexpr (St::a_rank == 2)
    return tensor_view<T, 2, Space>(p, {n, d});
  else if constexpr (St::a_rank == 4)
    return tensor_view<T, 4, Space>(
        p, {n, d / St::block, static_cast<index_t>(St::block), static_cast<index_t>(St::block)});
  else
    return tensor_view<T, 3, Space>(p, {n, d, d});
}

template <class T>
T make(value v) {
  if (v == value::nan) return static_cast<T>(std::numeric_limits<double>::quiet_NaN());
  return static_cast<T>(v == value::pos_inf ? std::numeric_limits<double>::infinity()
                                            : -std::numeric_limits<double>::infinity());
}

//! Offsets of n >= 16 tokens: an empty document, a single token, a long one, an empty one, two
//! long ones, a short one and a single last token, so documents span blocks, start and end inside
//! blocks, and (over ranks) cross slices.
inline std::vector<index_t> documents(index_t n) { return {0, 0, 1, n / 8, n / 8, 2 * n / 5, 3 * n / 4 + 3, n - 1, n}; }

inline index_t docs(const std::vector<index_t>& off) { return static_cast<index_t>(off.size()) - 1; }

//! A token of non-empty document s: its first (where = 0), a middle (1) or its last (2) one.
inline index_t row_in(const std::vector<index_t>& off, index_t s, int where) {
  const index_t b = off[static_cast<std::size_t>(s)], e = off[static_cast<std::size_t>(s) + 1];
  return where == 0 ? b : where == 1 ? b + (e - b) / 2 : e - 1;
}

//! The document holding token t.
inline index_t doc_of(const std::vector<index_t>& off, index_t t) {
  index_t s = 0;
  while (off[static_cast<std::size_t>(s) + 1] <= t) ++s;
  return s;
}

template <class T>
bool is_nan(T x) {
  return std::isnan(static_cast<double>(x));
}
template <class T>
bool is_finite(T x) {
  return std::isfinite(static_cast<double>(x));
}

//! `got` and `want` hold `rows` rows of `width` values, row r belonging to document owner(r): every
//! row of a document other than `poisoned` must have the same bits in both.
template <class T, class Owner>
void require_others_equal(const std::vector<T>& got, const std::vector<T>& want, index_t width, Owner owner,
                          index_t poisoned, const std::string& what) {
  REQUIRE(got.size() == want.size());
  const index_t rows = width > 0 ? static_cast<index_t>(want.size()) / width : 0;
  for (index_t r = 0; r < rows; ++r) {
    if (owner(r) == poisoned) continue;
    const std::size_t at = static_cast<std::size_t>(r * width);
    if (std::memcmp(got.data() + at, want.data() + at, sizeof(T) * static_cast<std::size_t>(width)) != 0) {
      std::ostringstream os;
      os << what << ": row " << r << " (document " << owner(r) << ", not the poisoned " << poisoned
         << ") differs from the clean run:";
      if constexpr (requires(const T& x) { static_cast<double>(x); })
        for (index_t c = 0; c < width; ++c)
          os << ' ' << static_cast<double>(got[at + static_cast<std::size_t>(c)]) << '/'
             << static_cast<double>(want[at + static_cast<std::size_t>(c)]);
      FAIL(os.str());
    }
  }
}

//! Whether rows [r0, r1) of a [rows, width] array hold a NaN (or, with `any_nonfinite`, any
//! non-finite value).
template <class T>
bool rows_hold(const std::vector<T>& x, index_t width, index_t r0, index_t r1, bool any_nonfinite) {
  for (index_t i = r0 * width; i < r1 * width; ++i)
    if (any_nonfinite ? !is_finite(x[static_cast<std::size_t>(i)]) : is_nan(x[static_cast<std::size_t>(i)]))
      return true;
  return false;
}

}  // namespace loom::test::poison
