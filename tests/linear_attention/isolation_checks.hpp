#pragma once

// The checks shared by the document-isolation bodies of chunked linear attention
// (isolation_test.hpp) and LASP-2 (lasp2_isolation_test.hpp): which input is poisoned, the inputs
// rounded to a storage type, and what must hold after a run with one document poisoned.

#include <loom/core/tensor_view.hpp>

#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <optional>
#include <vector>

#include "../scan/poison.hpp"
#include "oracle.hpp"

namespace loom::test::la {

//! The input a run poisons.
enum class input { q, k, v, init, d_o, d_final };
inline const char* name(input i) {
  const char* n[] = {"q", "k", "v", "initial_state", "d_o", "d_final_state"};
  return n[static_cast<int>(i)];
}

//! x rounded to T and widened back.
template <class T>
std::vector<double> rounded_to(const std::vector<double>& x) {
  std::vector<double> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) r[i] = static_cast<double>(static_cast<T>(x[i]));
  return r;
}

//! A problem and its output gradients with `val` (as A) in input `in` of document s: at head n % H,
//! element n % width, and (per-token inputs) the token lp::row_in(cu, s, n % 3).
struct poisoned {
  problem p;
  std::vector<double> d_o, dfin;
  index_t token = -1, head = 0;
};
//! Empty when document s has no token and `in` is a per-token input (nothing to poison).
template <class A>
std::optional<poisoned> poison_input(const problem& clean, const std::vector<double>& d_o,
                                     const std::vector<double>& dfin, input in, index_t s, int n, poison::value val) {
  namespace lp = loom::test::poison;
  const index_t H = clean.H, dk = clean.dk, dv = clean.dv, sz = dk * dv;
  const auto& cu = clean.cu;
  const bool per_doc = in == input::init || in == input::d_final;
  const bool empty = cu[static_cast<std::size_t>(s)] == cu[static_cast<std::size_t>(s) + 1];
  if (empty && !per_doc) return std::nullopt;
  poisoned r{clean, d_o, dfin, empty ? -1 : lp::row_in(cu, s, n % 3), n % H};
  const double x = static_cast<double>(lp::make<A>(val));
  const auto row = static_cast<std::size_t>(r.token * H + r.head);
  const auto at = static_cast<std::size_t>(n);
  if (in == input::q) r.p.q[row * dk + at % dk] = x;
  if (in == input::k) r.p.k[row * dk + at % dk] = x;
  if (in == input::v) r.p.v[row * dv + at % dv] = x;
  if (in == input::d_o) r.d_o[row * dv + at % dv] = x;
  if (in == input::init) r.p.init[static_cast<std::size_t>((s * H + r.head) * sz) + at % sz] = x;
  if (in == input::d_final) r.dfin[static_cast<std::size_t>((s * H + r.head) * sz) + at % sz] = x;
  return r;
}

//! After a run with `val` in input `in` of document s (documents `cu`, H heads, widths dk, dv):
//! every other document's o, final state, dq, dk, dv, d log g and d initial state have the bits of
//! the clean run `want`, and document s shows the poison (non-finite; a NaN for a NaN) in the
//! outputs the poisoned input reaches.
inline void require_isolated(const result& got, const result& want, const std::vector<index_t>& cu, index_t s,
                             index_t H, index_t dk, index_t dv, input in, poison::value val) {
  namespace lp = loom::test::poison;
  const index_t sz = dk * dv;
  auto tok_doc = [&](index_t t) { return lp::doc_of(cu, t); };
  auto doc = [](index_t d) { return d; };
  lp::require_others_equal(got.o, want.o, H * dv, tok_doc, s, "o");
  lp::require_others_equal(got.fin, want.fin, H * sz, doc, s, "final_state");
  lp::require_others_equal(got.dq, want.dq, H * dk, tok_doc, s, "dq");
  lp::require_others_equal(got.dk, want.dk, H * dk, tok_doc, s, "dk");
  lp::require_others_equal(got.dv, want.dv, H * dv, tok_doc, s, "dv");
  lp::require_others_equal(got.dlg, want.dlg, H, tok_doc, s, "d_log_gate");
  lp::require_others_equal(got.dinit, want.dinit, H * sz, doc, s, "d_initial_state");
  const bool any = val != lp::value::nan;
  const index_t b0 = cu[static_cast<std::size_t>(s)], b1 = cu[static_cast<std::size_t>(s) + 1];
  if (in == input::q || in == input::k || in == input::v || in == input::init)
    CHECK((lp::rows_hold(got.o, H * dv, b0, b1, any) || lp::rows_hold(got.fin, H * sz, s, s + 1, any)));
  else
    CHECK((lp::rows_hold(got.dq, H * dk, b0, b1, any) || lp::rows_hold(got.dk, H * dk, b0, b1, any) ||
           lp::rows_hold(got.dinit, H * sz, s, s + 1, any)));
}

//! True when every output of r is finite.
inline bool all_finite(const result& r) {
  for (const auto* v : {&r.o, &r.fin, &r.dq, &r.dk, &r.dv, &r.dlg, &r.dinit})
    for (double x : *v)
      if (!std::isfinite(x)) return false;
  return true;
}

//! got against the fp64 oracle's `want` at precision P's scaled tolerances (d log g only for
//! scalar gates), after a full-decay run: every output finite.
template <class P>
void require_oracle_close(const result& got, const result& want, gating mode) {
  namespace lt = loom::test;
  CHECK(all_finite(got));
  lt::require_close(got.o, want.o, scaled_tol<P>(want.o), "o");
  lt::require_close(got.fin, want.fin, scaled_tol<P>(want.fin), "final state");
  require_gradients_close<P>(got, want, mode == gating::scalar);
}

}  // namespace loom::test::la
