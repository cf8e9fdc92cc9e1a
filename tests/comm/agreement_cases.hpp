#pragma once

// One rank of every distributed primitive given a different plan or a bad argument: every rank
// must throw the same loom::error, naming that rank (or the first rank that differs) and what is
// wrong, and nothing may hang. One body, run by agreement_test.cpp over comm::local (P = 2..4)
// and over comm::mpi under mpiexec -n 3.

#include <loom/attention/bidirectional.hpp>
#include <loom/attention/hybrid.hpp>
#include <loom/attention/ring.hpp>
#include <loom/attention/ulysses.hpp>
#include <loom/backend/serial.hpp>
#include <loom/linear_attention/lasp2.hpp>
#include <loom/rnn/cells.hpp>
#include <loom/rnn/distributed.hpp>
#include <loom/scan/distributed.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace loom::test::agreement {

namespace la = loom::attention;
namespace shard = loom::shard;

//! What one case expects every rank to throw.
struct expectation {
  std::string name;     //!< the case
  std::string text;     //!< a part of the message every rank must show
  errc code;            //!< the code every rank must throw
  std::string message;  //!< what this rank threw ("" when it returned normally)
  errc got = errc::internal;
  bool same = false;  //!< every rank threw exactly this message (compared through the communicator)
};

template <class C>
bool same_on_every_rank(C& comm, const std::string& s) {
  const std::uint64_t mine = comm::hasher{}.add_string(s).value();
  std::vector<std::uint64_t> all(static_cast<std::size_t>(comm.size()));
  comm.all_gather(std::span<const std::uint64_t>(&mine, 1), std::span<std::uint64_t>(all));
  for (auto h : all)
    if (h != mine) return false;
  return true;
}

template <class C>
void run_case(C& comm, std::vector<expectation>& out, std::string name, std::string text, errc code,
              const std::function<void()>& body) {
  expectation e{std::move(name), std::move(text), code, {}};
  try {
    body();
  } catch (const error& err) {
    e.message = err.what();
    e.got = err.code();
  }
  e.same = same_on_every_rank(comm, e.message);
  out.push_back(std::move(e));
}

//! Runs every case on this rank of comm (P >= 2); returns what this rank saw.
template <class C>
std::vector<expectation> run_all(C& comm) {
  const int p = comm.size(), r = comm.rank(), last = p - 1;
  const std::string last_s = std::to_string(last);
  std::vector<expectation> out;
  const serial b{};

  // --- ring attention: 3 documents, 4 query heads on 2 kv heads, dim 8 --------------------------
  const std::vector<index_t> cu{0, 37, 60, 131}, cu2{0, 50, 60, 131};  // same total, other documents
  const auto contiguous = shard::make_plan(loom::segments<>(std::span(cu)), p, shard::contiguous{});
  const auto zigzag = shard::make_plan(loom::segments<>(std::span(cu)), p, shard::zigzag{});
  const auto other_docs = shard::make_plan(loom::segments<>(std::span(cu2)), p, shard::contiguous{});
  auto attn = [&](const shard::plan& plan, auto variant, index_t q_rows, const la::options& opt) {
    const index_t n = plan.rank(r).tokens;
    std::vector<float> q(static_cast<std::size_t>(q_rows * 4 * 8)), kv(static_cast<std::size_t>(n * 2 * 8)),
        o(q.size()), lse(static_cast<std::size_t>(q_rows * 4));
    la::ring::forward(
        b, comm, variant, plan, tensor_view<const float, 3>(q.data(), {q_rows, 4, 8}),
        tensor_view<const float, 3>(kv.data(), {n, 2, 8}), tensor_view<const float, 3>(kv.data(), {n, 2, 8}),
        tensor_view<float, 3>(o.data(), {q_rows, 4, 8}), tensor_view<float, 2>(lse.data(), {q_rows, 4}), opt);
  };
  const index_t mine = contiguous.rank(r).tokens;
  run_case(comm, out, "ring pass_kv: zigzag on one rank, contiguous on the others", "ranks disagree on the plan",
           errc::invalid_argument, [&] {
             const auto& plan = r == 1 ? zigzag : contiguous;
             attn(plan, la::ring::pass_kv{}, plan.rank(r).tokens, {});
           });
  run_case(comm, out, "ring pass_q: other documents on one rank, same total", "ranks disagree on the plan",
           errc::invalid_argument, [&] {
             const auto& plan = r == last ? other_docs : contiguous;
             attn(plan, la::ring::pass_q{}, plan.rank(r).tokens, {});
           });
  run_case(comm, out, "ring all_gather_kv: one rank not causal", "ranks disagree on the options",
           errc::invalid_argument, [&] {
             la::options o{};
             o.causal = r != 0;
             attn(contiguous, la::ring::all_gather_kv{}, mine, o);
           });
  run_case(comm, out, "bidirectional ring: q of the wrong length on the last rank",
           "on rank " + last_s + ": ring::forward(bidirectional_kv): q holds", errc::shape_mismatch,
           [&] { attn(contiguous, la::ring::bidirectional_kv{}, r == last ? mine + 1 : mine, {}); });

  // --- Ulysses: the agreement runs in make_plan: other heads on one rank; other sharding ---------
  run_case(comm, out, "ulysses: other kv heads on rank 1", "ranks disagree on the shapes", errc::invalid_argument, [&] {
    (void)la::ulysses::make_plan<fp32>(b, comm, contiguous, {4, r == 1 ? index_t{4} : index_t{2}, 8, 8});
  });
  run_case(comm, out, "ulysses: zigzag on rank 0", "ranks disagree on the plan", errc::invalid_argument, [&] {
    (void)la::ulysses::make_plan<fp32>(b, comm, r == 0 ? zigzag : contiguous, {4, 2, 8, 8});
  });

  // --- hybrid: U x R = 2 x (P / 2) when P is even, 1 x P otherwise (R = the ring sharding's ranks) -
  const int ring_ranks = p % 2 == 0 ? p / 2 : p;
  const auto ring = shard::make_plan(loom::segments<>(std::span(cu)), ring_ranks, shard::zigzag{});
  const auto ring_other = shard::make_plan(loom::segments<>(std::span(cu2)), ring_ranks, shard::zigzag{});
  run_case(comm, out, "hybrid: not causal on the last rank", "ranks disagree on the options", errc::invalid_argument,
           [&] {
             la::options o{};
             o.causal = r != last;
             (void)la::hybrid::make_plan<fp32>(b, comm, ring, {4, 2, 8, 8}, o);
           });
  run_case(comm, out, "hybrid: other documents on the last rank", "ranks disagree on the plan", errc::invalid_argument,
           [&] {
             (void)la::hybrid::make_plan<fp32>(b, comm, r == last ? ring_other : ring, {4, 2, 8, 8});
           });

  // --- cross-rank scans: 10 + r elements on rank r ----------------------------------------------
  const index_t n = 10 + r;
  index_t total = 0;
  for (int q = 0; q < p; ++q) total += 10 + q;
  std::vector<double> x(static_cast<std::size_t>(n), 1.0), y(x.size());
  const std::vector<index_t> offs{0, 7, total}, offs2{0, 8, total};
  run_case(comm, out, "segmented scan: other offsets on rank 1", "ranks disagree on the document offsets",
           errc::invalid_argument, [&] {
             const auto& o = r == 1 ? offs2 : offs;
             scan::inclusive_scan(b, comm, scan::plus<double>{}, tensor_view<const double, 1>(x.data(), {n}),
                                  tensor_view<double, 1>(y.data(), {n}), loom::segments<>(std::span(o)));
           });
  run_case(comm, out, "scan: reverse on rank 0 only", "ranks disagree on the options", errc::invalid_argument, [&] {
    scan::options opt;
    if (r == 0) opt.dir = scan::direction::reverse;
    scan::inclusive_scan(b, comm, scan::plus<double>{}, tensor_view<const double, 1>(x.data(), {n}),
                         tensor_view<double, 1>(y.data(), {n}), opt);
  });
  run_case(comm, out, "scan plan: a negative length on the last rank", "on rank " + last_s + ": scan::make_plan",
           errc::invalid_argument,
           [&] { (void)scan::make_plan(b, comm, scan::plus<double>{}, r == last ? index_t{-1} : n); });
  std::vector<double> a(static_cast<std::size_t>(n * 3), 0.5), bv(a.size(), 1.0), h(a.size());
  run_case(comm, out, "linear recurrence: state width 3 on rank 1, 2 elsewhere", "ranks disagree on the shapes",
           errc::invalid_argument, [&] {
             const index_t d = r == 1 ? 3 : 2;
             scan::linear_recurrence(b, comm, scan::diagonal{}, tensor_view<const double, 2>(a.data(), {n, d}),
                                     tensor_view<const double, 2>(bv.data(), {n, d}),
                                     tensor_view<double, 2>(h.data(), {n, d}), loom::segments<>{},
                                     scan::states<double>{});
           });
  run_case(comm, out, "linear recurrence adjoint: other offsets on the last rank",
           "ranks disagree on the document offsets", errc::invalid_argument, [&] {
             const auto& o = r == last ? offs2 : offs;
             scan::linear_recurrence_adjoint(b, comm, scan::scalar{}, tensor_view<const double, 1>(a.data(), {n}),
                                             tensor_view<const double, 2>(bv.data(), {n, 1}),
                                             tensor_view<double, 2>(h.data(), {n, 1}), loom::segments<>(std::span(o)),
                                             scan::adjoint_states<double>{});
           });

  // --- LASP-2: slices of 10 + r tokens, 2 heads, d = 4 -------------------------------------------
  {
    namespace lin = loom::linear_attention;
    index_t begin = 0;
    for (int q = 0; q < r; ++q) begin += 10 + q;
    const index_t H = 2, d = 4;
    std::vector<float> q(static_cast<std::size_t>(n * H * d), 0.25f), o(q.size());
    const lin::operands<fp32> ops{tensor_view<const float, 3>(q.data(), {n, H, d}),
                                  tensor_view<const float, 3>(q.data(), {n, H, d}),
                                  tensor_view<const float, 3>(q.data(), {n, H, d})};
    run_case(comm, out, "LASP-2: other cu_seqlens on rank 1", "ranks disagree on cu_seqlens", errc::invalid_argument,
             [&] {
               const auto& c = r == 1 ? offs2 : offs;
               lin::lasp2::forward(b, comm, loom::segments<>(std::span(c)), begin, lin::no_decay{}, ops,
                                   tensor_view<float, 3>(o.data(), {n, H, d}));
             });
    run_case(comm, out, "LASP-2: a gap between the slices of ranks 0 and 1",
             "lasp2::forward: the slices must tile the sequence in rank order: rank 0 ends at token 10, rank 1 "
             "begins at 11",
             errc::invalid_argument, [&] {
               const index_t shift = r == 1 ? 1 : 0;
               const lin::operands<fp32> part{tensor_view<const float, 3>(q.data(), {n - shift, H, d}),
                                              tensor_view<const float, 3>(q.data(), {n - shift, H, d}),
                                              tensor_view<const float, 3>(q.data(), {n - shift, H, d})};
               lin::lasp2::forward(b, comm, loom::segments<>(std::span(offs)), begin + shift, lin::no_decay{}, part,
                                   tensor_view<float, 3>(o.data(), {n - shift, H, d}));
             });
    run_case(comm, out, "LASP-2: o of the wrong shape on rank 0",
             "on rank 0: lasp2::forward: o (the plan's [slice tokens, heads, dv])", errc::shape_mismatch, [&] {
               lin::lasp2::forward(b, comm, loom::segments<>(std::span(offs)), begin, lin::no_decay{}, ops,
                                   tensor_view<float, 3>(o.data(), {n, H, r == 0 ? d - 1 : d}));
             });
  }

  // --- the Newton solver: a GRU cell, d = 2 -------------------------------------------------------
  {
    std::vector<double> th(12, 0.1), xs(static_cast<std::size_t>(n * 6), 0.1), hs(static_cast<std::size_t>(n * 2));
    const rnn::para_gru<double> cell{th.data(), 2};
    run_case(comm, out, "rnn: other max_iterations on rank 1", "ranks disagree on the options", errc::invalid_argument,
             [&] {
               rnn::options opt;
               if (r == 1) opt.max_iterations = 7;
               (void)rnn::forward(b, comm, cell, tensor_view<const double, 2>(xs.data(), {n, 6}),
                                  tensor_view<const double, 2>{}, tensor_view<double, 2>(hs.data(), {n, 2}),
                                  loom::segments<>{}, opt);
             });
    run_case(comm, out, "rnn: a NaN input on the last rank",
             "rnn::forward: x holds non-finite values (NaN or inf) on rank " + last_s, errc::invalid_argument, [&] {
               if (r == last) xs[3] = std::nan("");
               (void)rnn::forward(b, comm, cell, tensor_view<const double, 2>(xs.data(), {n, 6}),
                                  tensor_view<const double, 2>{}, tensor_view<double, 2>(hs.data(), {n, 2}),
                                  loom::segments<>{});
             });
  }
  return out;
}

}  // namespace loom::test::agreement
