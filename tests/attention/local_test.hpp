// Local exact attention and the merge: one body, instantiated per backend. Every result is
// compared with the fp64 oracle of tests/attention/oracle.hpp.

#include <loom/attention/local.hpp>
#include <loom/attention/merge.hpp>

#include <support/allocations.hpp>
#include <support/backends.hpp>
#include <support/convert.hpp>
#include <support/errors.hpp>
#include <support/random.hpp>
#include <support/tolerance.hpp>
#include <support/vector_switch.hpp>

#include <catch2/catch.hpp>

#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

#include "oracle.hpp"

using loom::index_t;
using loom::test::backend_under_test;
using loom::test::buffer;
using loom::test::make_backend;
using loom::test::vector_mode;
using loom::test::vector_switch;
namespace la = loom::attention;
namespace lt = loom::test;

using loom::test::cast;
using loom::test::widen;

namespace {

using loom::test::space;
using loom::test::view_of;

struct inputs {
  std::vector<double> q, k, v, dout;
};

// Random inputs, rounded through storage T so the oracle sees exactly what the kernel sees.
template <class T>
inputs make_inputs(const lt::attn_shape& s, std::uint64_t seed) {
  auto round = [](std::vector<double> x) { return widen(cast<T>(x)); };
  return {round(lt::uniform<double>(s.tq * s.hq * s.dk, -1, 1, seed)),
          round(lt::uniform<double>(s.tk * s.hkv * s.dk, -1, 1, seed + 1)),
          round(lt::uniform<double>(s.tk * s.hkv * s.dv, -1, 1, seed + 2)),
          round(lt::uniform<double>(s.tq * s.hq * s.dv, -1, 1, seed + 3))};
}

template <class T>
struct run_result {
  std::vector<double> out, lse, dq, dk, dv;
};

// The plan forms over segments of offset type I (int64 or int32), workspace allocated once. With
// `kcu`, a cross plan: queries of document d are [cu[d], cu[d + 1]), its keys [kcu[d], kcu[d + 1]);
// `splits` then receives the plan's split count (0: the tiled forward).
template <class T, class I = std::int64_t>
run_result<T> run_packed(const lt::attn_shape& s, const inputs& in, const std::vector<index_t>& cu, bool bwd,
                         const std::vector<index_t>* kcu = nullptr, index_t* splits = nullptr) {
  using Acc = loom::accum_t<T>;
  using P = loom::default_precision<T>;
  const auto b = make_backend();
  buffer<T> q(cast<T>(in.q)), k(cast<T>(in.k)), v(cast<T>(in.v)), dout(cast<T>(in.dout)),
      out(static_cast<std::size_t>(s.tq * s.hq * s.dv)), dq(static_cast<std::size_t>(s.tq * s.hq * s.dk)),
      dk(static_cast<std::size_t>(s.tk * s.hkv * s.dk)), dv(static_cast<std::size_t>(s.tk * s.hkv * s.dv));
  buffer<Acc> lse(static_cast<std::size_t>(s.tq * s.hq));
  buffer<I> cub(std::vector<I>(cu.begin(), cu.end()));
  buffer<I> kcub(kcu ? std::vector<I>(kcu->begin(), kcu->end()) : std::vector<I>{0});
  const la::options opt{s.causal, s.window, s.scale};
  const loom::segments docs(view_of<const I, 1>(cub, {static_cast<index_t>(cu.size())}));
  const loom::segments kdocs(view_of<const I, 1>(kcub, {kcu ? static_cast<index_t>(kcu->size()) : 1}));
  const auto plan = kcu ? la::make_plan<P>(b, docs, kdocs, {s.tq, s.hq, s.hkv, s.dk, s.dv, s.tk}, opt)
                        : la::make_plan<P>(b, docs, {s.tq, s.hq, s.hkv, s.dk, s.dv}, opt);
  if (splits) *splits = plan.split_keys() ? plan.split().splits : 0;
  const loom::temporary_buffer<backend_under_test, std::byte> ws(
      b, static_cast<index_t>(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes())));
  la::forward(b, plan, view_of<const T, 3>(q, {s.tq, s.hq, s.dk}), view_of<const T, 3>(k, {s.tk, s.hkv, s.dk}),
              view_of<const T, 3>(v, {s.tk, s.hkv, s.dv}), view_of<T, 3>(out, {s.tq, s.hq, s.dv}),
              view_of<Acc, 2>(lse, {s.tq, s.hq}), ws.bytes());
  run_result<T> r{widen(out.to_host()), widen(lse.to_host()), {}, {}, {}};
  if (bwd) {
    la::backward(b, plan, view_of<const T, 3>(q, {s.tq, s.hq, s.dk}), view_of<const T, 3>(k, {s.tk, s.hkv, s.dk}),
                 view_of<const T, 3>(v, {s.tk, s.hkv, s.dv}), view_of<const T, 3>(out, {s.tq, s.hq, s.dv}),
                 view_of<const Acc, 2>(lse, {s.tq, s.hq}), view_of<const T, 3>(dout, {s.tq, s.hq, s.dv}),
                 view_of<T, 3>(dq, {s.tq, s.hq, s.dk}), view_of<T, 3>(dk, {s.tk, s.hkv, s.dk}),
                 view_of<T, 3>(dv, {s.tk, s.hkv, s.dv}), ws.bytes());
    r.dq = widen(dq.to_host());
    r.dk = widen(dk.to_host());
    r.dv = widen(dv.to_host());
  }
  return r;
}

template <class T>
void require_oracle(const run_result<T>& got, const lt::attn_result& want, bool bwd) {
  // fp64 ≤ 1e-10; fp32 ≤ 2e-5 relative; bf16 ≤ 2e-2 (the tolerances), on O(1) values.
  const lt::tolerance tol = std::is_same_v<T, double>  ? lt::tolerance{1e-10, 1e-10}
                            : std::is_same_v<T, float> ? lt::tolerance{2e-5, 2e-5}
                                                       : lt::tolerance{2e-2, 2e-2};
  lt::require_close(got.out, want.out, tol, "out");
  std::vector<double> lse_ok(want.lse), lse_got(got.lse);  // -inf rows must match exactly
  for (std::size_t i = 0; i < lse_ok.size(); ++i) {
    REQUIRE(std::isinf(lse_ok[i]) == std::isinf(lse_got[i]));
    if (std::isinf(lse_ok[i])) lse_ok[i] = lse_got[i] = 0;
  }
  lt::require_close(lse_got, lse_ok, tol, "lse");
  if (!bwd) return;
  lt::require_close(got.dq, want.dq, tol, "dq");
  lt::require_close(got.dk, want.dk, tol, "dk");
  lt::require_close(got.dv, want.dv, tol, "dv");
}

// Forward and backward of packed documents in precision P against the oracle.
template <class P, class I = std::int64_t>
void check_packed(lt::attn_shape s, const std::vector<index_t>& cu, std::uint64_t seed, bool bwd = true) {
  using T = typename P::storage_type;
  s.tk = s.tq = cu.back();
  const auto in = make_inputs<T>(s, seed);
  const auto c = lt::packed(cu);
  const auto want = lt::attention_oracle(s, in.q, in.k, in.v, c, c, bwd ? in.dout : std::vector<double>{});
  const auto got = run_packed<T, I>(s, in, cu, bwd);
  INFO("tokens " << s.tq << " heads " << s.hq << "/" << s.hkv << " dims " << s.dk << "/" << s.dv << " causal "
                 << s.causal << " window (" << s.window.left << ", " << s.window.right << ") offsets " << sizeof(I) * 8
                 << " bit " << loom::precision_name<P>());
  require_oracle<T>(got, want, bwd);
}

// The queries of each document bottom-right aligned with its keys: query i of Lq at Lk - Lq + i.
lt::attn_coords bottom_right(const std::vector<index_t>& qcu, const std::vector<index_t>& kcu) {
  lt::attn_coords c;
  for (std::size_t d = 0; d + 1 < qcu.size(); ++d) {
    const index_t lq = qcu[d + 1] - qcu[d], lk = kcu[d + 1] - kcu[d];
    for (index_t i = 0; i < lq; ++i) {
      c.doc.push_back(static_cast<index_t>(d));
      c.pos.push_back(lk - lq + i);
    }
  }
  return c;
}

// Each document's queries (qcu) over its keys (kcu), forward (split-KV when `split`) and backward,
// against the oracle. Returns the plan's split count.
template <class P, class I = std::int64_t>
index_t check_cross(lt::attn_shape s, const std::vector<index_t>& qcu, const std::vector<index_t>& kcu,
                    std::uint64_t seed, bool split, bool bwd = true) {
  using T = typename P::storage_type;
  s.tq = qcu.back();
  s.tk = kcu.back();
  const auto in = make_inputs<T>(s, seed);
  const auto want = lt::attention_oracle(s, in.q, in.k, in.v, bottom_right(qcu, kcu), lt::packed(kcu),
                                         bwd ? in.dout : std::vector<double>{});
  index_t splits = -1;
  const auto got = run_packed<T, I>(s, in, qcu, bwd, &kcu, &splits);
  INFO("queries " << s.tq << " keys " << s.tk << " documents " << qcu.size() - 1 << " heads " << s.hq << "/" << s.hkv
                  << " dims " << s.dk << "/" << s.dv << " causal " << s.causal << " window (" << s.window.left << ", "
                  << s.window.right << ") splits " << splits << " " << loom::precision_name<P>());
  CHECK((splits > 0) == split);
  require_oracle<T>(got, want, bwd);
  return splits;
}

}  // namespace

TEST_CASE("attention: packed documents, GQA, dims 64 and 96, causal and full, fp64" LOOM_BACKEND_TAG,
          "[attention][local]") {
  const std::vector<index_t> docs{0, 1, 8, 138, 141, lt::long_document_end};  // lengths 1, 7, 130, 3, 1000 (400)
  for (index_t hkv : {index_t{8}, index_t{2}, index_t{1}})
    if (!lt::sanitized || hkv == 2)  // sanitizer builds: one GQA ratio of the full-size sweep
      check_packed<loom::fp64>({0, 0, 8, hkv, 64, 64, true}, docs, 10 + static_cast<std::uint64_t>(hkv));
  check_packed<loom::fp64>({0, 0, 8, 2, 96, 96, false}, docs, 20);
  check_packed<loom::fp64, std::int32_t>({0, 0, 4, 1, 96, 40, true, {}, 0.3}, {0, 131},
                                         21);  // dim_v != dim_qk, a given scale
  for (index_t n : {index_t{1}, index_t{7}, index_t{131}, index_t{1021}})
    check_packed<loom::fp64>({0, 0, 2, 1, 64, 64, true}, {0, n}, 30 + static_cast<std::uint64_t>(n), n < 1000);
}

TEST_CASE("attention: sliding window, empty documents, fp32 and bf16" LOOM_BACKEND_TAG, "[attention][local]") {
  // Host x86: the widest vector products (AVX-512 tile products where the CPU has them), the AVX2
  // floor, then the portable ones.
  const vector_switch switched(GENERATE(vector_mode::widest, vector_mode::avx2, vector_mode::portable));
  const std::vector<index_t> docs{
      0, 0, 1, 8, 8, 138, 141, lt::long_document_end, lt::long_document_end};  // empty documents too
  check_packed<loom::fp64>({0, 0, 4, 2, 64, 64, true, {36, 0}}, docs, 40);
  check_packed<loom::fp64, std::int32_t>({0, 0, 2, 2, 32, 16, false, {49, -1}}, {0, 300}, 41);
  check_packed<loom::fp32, std::int32_t>({0, 0, 8, 2, 64, 64, true}, docs, 42);
  check_packed<loom::fp32>({0, 0, 2, 1, 96, 96, false}, {0, 1021}, 43);
  check_packed<loom::bf16>({0, 0, 4, 1, 64, 64, true}, docs, 44);
  // Odd dims: column blocks of 16, then a lane remainder; prime document lengths: row remainders.
  check_packed<loom::fp32>({0, 0, 3, 1, 36, 20, true}, {0, 7, 300, 1021}, 45);
  check_packed<loom::fp32>({0, 0, 2, 2, 24, 43, false, {29, 3}}, {0, 131, 257}, 46);
  // bfloat16 storage with head dims the pair products take (even dk, dv <= dk; on CPUs with
  // AVX512_BF16) and ones they leave to the float products (odd dk; dv > dk); odd key tiles.
  check_packed<loom::bf16>({0, 0, 3, 1, 36, 20, true}, {0, 7, 300, 1021}, 47);
  check_packed<loom::bf16>({0, 0, 2, 2, 24, 24, false, {29, 3}}, {0, 131, 257}, 48);
  check_packed<loom::bf16>({0, 0, 2, 1, 25, 16, true}, {0, 131}, 49);
  check_packed<loom::bf16>({0, 0, 2, 1, 16, 32, true}, {0, 131}, 50);
}

TEST_CASE(
    "attention: the fused backward (dQ summed by key stripes) and the two-pass one give the same bits, the query "
    "side packed or not" LOOM_BACKEND_TAG,
    "[attention][local][backward]") {
  // Few slots take the fused schedule (one pass over key tiles, dQ summed per stripe, then over
  // stripes); many take the two-pass one, which sums dQ in the same order. Each with the query
  // side packed once (the default at this size) and loaded per tile pair (a bound of 0 bytes).
  // Against the oracle, then bit for bit, overwriting and accumulating, with a NaN in one
  // document's K.
  if constexpr (!space::host_accessible) {  // device backends: the two-pass schedule, loading the query side
    const la::detail::problem pb{557, 557, 6, 2, 40, 24, true, 200, 0};
    const auto l = la::detail::layout_of<float>(pb, true, la::detail::slot_cap(make_backend()));
    REQUIRE(!l.fused);
    REQUIRE(!l.packed);
    return;
  }
  using T = float;
  const vector_switch switched(GENERATE(true, false));
  const bool poisoned = GENERATE(false, true);
  // 557 tokens: 9 key tiles in 4 stripes, groups of 3, 2, 2 and 2 key tiles; 1031 tokens: 17 key
  // tiles, groups of 4 and 1 in stripe 0 and of 4 in the others (kv_group = 4).
  const index_t n = GENERATE(index_t{557}, index_t{1031});
  const std::vector<index_t> cu =
      n == 557 ? std::vector<index_t>{0, 5, 300, 301, 557} : std::vector<index_t>{0, 5, 300, 301, 557, 1031};
  lt::attn_shape s{n, n, 6, 2, 40, 24, true, {200, 0}};
  auto in = make_inputs<T>(s, 140);
  if (poisoned) in.k[(10 * s.hkv + 1) * s.dk + 3] = std::numeric_limits<double>::quiet_NaN();  // document 1
  const auto c = lt::packed(cu);
  const auto b = make_backend();
  buffer<T> q(cast<T>(in.q)), k(cast<T>(in.k)), v(cast<T>(in.v)), dout(cast<T>(in.dout)),
      out(static_cast<std::size_t>(s.tq * s.hq * s.dv));
  buffer<float> lse(static_cast<std::size_t>(s.tq * s.hq));
  buffer<index_t> doc(c.doc), pos(c.pos);
  const la::coords<space> cv{view_of<const index_t, 1>(doc, {s.tq}), view_of<const index_t, 1>(pos, {s.tq})};
  const la::options opt{s.causal, s.window, s.scale};
  la::forward(b, view_of<const T, 3>(q, {s.tq, s.hq, s.dk}), view_of<const T, 3>(k, {s.tk, s.hkv, s.dk}),
              view_of<const T, 3>(v, {s.tk, s.hkv, s.dv}), cv, cv, view_of<T, 3>(out, {s.tq, s.hq, s.dv}),
              view_of<float, 2>(lse, {s.tq, s.hq}), opt);
  const la::detail::problem pb{s.tq, s.tk, s.hq, s.hkv, s.dk, s.dv, s.causal, s.window.left, s.window.right};
  REQUIRE(la::detail::stripes_of(pb) == 4);
  auto run = [&](index_t cap, bool accumulate, bool pack) {
    const std::size_t pack_max = pack ? la::detail::packed_query_max_bytes : 0;
    const auto l = la::detail::layout_of<float>(pb, true, cap, pack_max);
    REQUIRE(l.packed == pack);
    buffer<T> dq(std::vector<T>(static_cast<std::size_t>(s.tq * s.hq * s.dk), T(0.5))),
        dk(std::vector<T>(static_cast<std::size_t>(s.tk * s.hkv * s.dk), T(0.25))),
        dv(std::vector<T>(static_cast<std::size_t>(s.tk * s.hkv * s.dv), T(-1)));
    const loom::temporary_buffer<backend_under_test, std::byte> ws(b, static_cast<index_t>(l.bytes));
    la::detail::backward_on<float>(
        b, pb, static_cast<float>(1.0 / std::sqrt(double(s.dk))), view_of<const T, 3>(q, {s.tq, s.hq, s.dk}),
        view_of<const T, 3>(k, {s.tk, s.hkv, s.dk}), view_of<const T, 3>(v, {s.tk, s.hkv, s.dv}),
        la::detail::coords_of(cv), la::detail::coords_of(cv), view_of<const T, 3>(out, {s.tq, s.hq, s.dv}),
        view_of<const float, 2>(lse, {s.tq, s.hq}), view_of<const T, 3>(dout, {s.tq, s.hq, s.dv}),
        view_of<T, 3>(dq, {s.tq, s.hq, s.dk}), view_of<T, 3>(dk, {s.tk, s.hkv, s.dk}),
        view_of<T, 3>(dv, {s.tk, s.hkv, s.dv}), accumulate, ws.bytes(), cap, pack_max);
    loom::fence(b);
    return std::make_pair(l.fused, std::array<std::vector<T>, 3>{dq.to_host(), dk.to_host(), dv.to_host()});
  };
  for (bool accumulate : {false, true}) {
    INFO("accumulate " << accumulate << " poisoned " << poisoned);
    const index_t many = index_t{1} << 20;
    const auto [fused, a] = run(1, accumulate, true);
    REQUIRE(fused);
    for (const auto& [cap, pack] : {std::pair{index_t{1}, false}, std::pair{many, true}, std::pair{many, false}}) {
      INFO("cap " << cap << " packed " << pack);
      const auto [other_fused, z] = run(cap, accumulate, pack);
      REQUIRE(other_fused == (cap == 1));
      for (int g = 0; g < 3; ++g) {
        REQUIRE(a[g].size() == z[g].size());
        CHECK(std::memcmp(a[g].data(), z[g].data(), a[g].size() * sizeof(T)) == 0);
      }
    }
    if (poisoned) {  // the NaN stays in document 1 (tokens [5, 300)) of every gradient
      const auto outside = [&](const std::vector<T>& x, index_t row, index_t t0, index_t t1) {
        for (index_t t = 0; t < s.tq; ++t)
          if (t < t0 || t >= t1)
            for (index_t e = 0; e < row; ++e) REQUIRE(std::isfinite(x[static_cast<std::size_t>(t * row + e)]));
      };
      outside(a[0], s.hq * s.dk, 5, 300);
      outside(a[1], s.hkv * s.dk, 5, 300);
      outside(a[2], s.hkv * s.dv, 5, 300);
    } else if (!accumulate) {
      const auto want = lt::attention_oracle(s, widen(cast<T>(in.q)), widen(cast<T>(in.k)), widen(cast<T>(in.v)), c, c,
                                             widen(cast<T>(in.dout)));
      lt::require_close(widen(a[0]), want.dq, {2e-5, 2e-5}, "dq");
      lt::require_close(widen(a[1]), want.dk, {2e-5, 2e-5}, "dk");
      lt::require_close(widen(a[2]), want.dv, {2e-5, 2e-5}, "dv");
    }
  }
}

TEST_CASE(
    "attention: the forward gives the same bits with one query head per item and with a group per "
    "item" LOOM_BACKEND_TAG,
    "[attention][local]") {
  // Few slots put the query heads of one kv head into one item (each key tile read once for
  // them); many slots keep one head per item. Both against the oracle, then bit for bit, with a
  // NaN in one document's K and an infinite score in a fully visible tile of another.
  if constexpr (!space::host_accessible) {
    SUCCEED("device backends take one query head per item only");
    return;
  }
  using T = float;
  const vector_switch switched(GENERATE(true, false));
  const bool poisoned = GENERATE(false, true);
  const std::vector<index_t> cu{0, 5, 300, 301, 557};  // 557 tokens: 9 query tiles
  lt::attn_shape s{557, 557, 6, 2, 40, 24, true, {200, 0}};
  auto in = make_inputs<T>(s, 141);
  if (poisoned) {
    in.k[(10 * s.hkv + 1) * s.dk + 3] = std::numeric_limits<double>::quiet_NaN();  // document 1
    in.q[(500 * s.hq + 4) * s.dk] = std::numeric_limits<double>::infinity();       // document 3, head 4
  }
  const auto c = lt::packed(cu);
  const auto b = make_backend();
  buffer<T> q(cast<T>(in.q)), k(cast<T>(in.k)), v(cast<T>(in.v));
  buffer<index_t> doc(c.doc), pos(c.pos);
  const la::coords<space> cv{view_of<const index_t, 1>(doc, {s.tq}), view_of<const index_t, 1>(pos, {s.tq})};
  const la::detail::problem pb{s.tq, s.tk, s.hq, s.hkv, s.dk, s.dv, s.causal, s.window.left, s.window.right};
  auto run = [&](index_t cap) {
    const auto l = la::detail::layout_of<float>(pb, false, cap);
    buffer<T> out(std::vector<T>(static_cast<std::size_t>(s.tq * s.hq * s.dv), T(7)));
    buffer<float> lse(std::vector<float>(static_cast<std::size_t>(s.tq * s.hq), 7.0f));
    const loom::temporary_buffer<backend_under_test, std::byte> ws(b, static_cast<index_t>(l.bytes));
    la::detail::forward_on<float>(
        b, pb, static_cast<float>(1.0 / std::sqrt(double(s.dk))), view_of<const T, 3>(q, {s.tq, s.hq, s.dk}),
        view_of<const T, 3>(k, {s.tk, s.hkv, s.dk}), view_of<const T, 3>(v, {s.tk, s.hkv, s.dv}),
        la::detail::coords_of(cv), la::detail::coords_of(cv), view_of<T, 3>(out, {s.tq, s.hq, s.dv}),
        view_of<float, 2>(lse, {s.tq, s.hq}), ws.bytes(), cap);
    loom::fence(b);
    return std::make_tuple(l.heads, out.to_host(), lse.to_host());
  };
  const auto [grouped, a_out, a_lse] = run(1);
  const auto [single, z_out, z_lse] = run(index_t{1} << 20);
  REQUIRE(grouped == 3);
  REQUIRE(single == 1);
  CHECK(std::memcmp(a_out.data(), z_out.data(), a_out.size() * sizeof(T)) == 0);
  CHECK(std::memcmp(a_lse.data(), z_lse.data(), a_lse.size() * sizeof(float)) == 0);
  if (poisoned) {
    // The queries that see token 10 (document 1, window 200: tokens 10..210) in the heads of kv
    // head 1 are NaN, and so is row 500 of head 4; every other row is finite.
    for (index_t t = 0; t < s.tq; ++t)
      for (index_t h = 0; h < s.hq; ++h) {
        const bool nan = (t >= 10 && t <= 210 && h >= 3) || (t == 500 && h == 4);
        INFO("token " << t << " head " << h);
        REQUIRE(std::isnan(a_lse[static_cast<std::size_t>(t * s.hq + h)]) == nan);
        REQUIRE(std::isfinite(a_lse[static_cast<std::size_t>(t * s.hq + h)]) == !nan);
      }
  } else {
    const auto want = lt::attention_oracle(s, widen(cast<T>(in.q)), widen(cast<T>(in.k)), widen(cast<T>(in.v)), c, c);
    lt::require_close(widen(a_out), want.out, {2e-5, 2e-5}, "out");
    lt::require_close(widen(a_lse), want.lse, {2e-5, 2e-5}, "lse");
  }
}

TEST_CASE("attention: merge of partial results over split key sets" LOOM_BACKEND_TAG, "[attention][merge]") {
  {  // every backend: the partials are computed on the host, merged on the backend under test
    const auto b = make_backend();
    // o, l = merge((o, l), (o2, l2)) on the backend: uploaded, merged, read back.
    auto merge_on = [&b](auto& o, auto& l, const auto& o2, const auto& l2, index_t t, index_t h, index_t d) {
      using T = typename std::decay_t<decltype(o)>::value_type;
      buffer<T> ob(o), lb(l), o2b(o2), l2b(l2);
      la::merge(b, view_of<T, 3>(ob, {t, h, d}), view_of<T, 2>(lb, {t, h}), view_of<const T, 3>(o2b, {t, h, d}),
                view_of<const T, 2>(l2b, {t, h}));
      o = ob.to_host();
      l = lb.to_host();
    };
    const lt::attn_shape s{257, 257, 4, 2, 64, 48, true};
    const auto in = make_inputs<double>(s, 60);
    const auto c = lt::packed({0, 100, 257});
    const auto want = lt::attention_oracle(s, in.q, in.k, in.v, c, c);
    // Keys split in two interleaved halves (even and odd tokens): two partials, then merge.
    std::vector<double> out_a(want.out.size()), out_b(want.out.size()), lse_a(want.lse.size()), lse_b(lse_a.size());
    for (int part = 0; part < 2; ++part) {
      std::vector<double> k, v;
      lt::attn_coords kc;
      for (index_t j = part; j < s.tk; j += 2) {
        k.insert(k.end(), in.k.begin() + j * s.hkv * s.dk, in.k.begin() + (j + 1) * s.hkv * s.dk);
        v.insert(v.end(), in.v.begin() + j * s.hkv * s.dv, in.v.begin() + (j + 1) * s.hkv * s.dv);
        kc.doc.push_back(c.doc[j]);
        kc.pos.push_back(c.pos[j]);
      }
      const index_t nk = static_cast<index_t>(kc.doc.size());
      la::coords<> qcv{loom::tensor_view<const index_t, 1>(c.doc.data(), {s.tq}),
                       loom::tensor_view<const index_t, 1>(c.pos.data(), {s.tq})};
      la::coords<> kcv{loom::tensor_view<const index_t, 1>(kc.doc.data(), {nk}),
                       loom::tensor_view<const index_t, 1>(kc.pos.data(), {nk})};
      auto& o = part ? out_b : out_a;
      auto& l = part ? lse_b : lse_a;
      la::forward(loom::serial{}, loom::tensor_view<const double, 3>(in.q.data(), {s.tq, s.hq, s.dk}),
                  loom::tensor_view<const double, 3>(k.data(), {nk, s.hkv, s.dk}),
                  loom::tensor_view<const double, 3>(v.data(), {nk, s.hkv, s.dv}), qcv, kcv,
                  loom::tensor_view<double, 3>(o.data(), {s.tq, s.hq, s.dv}),
                  loom::tensor_view<double, 2>(l.data(), {s.tq, s.hq}));
    }
    merge_on(out_a, lse_a, out_b, lse_b, s.tq, s.hq, s.dv);
    lt::require_close(out_a, want.out, {1e-12, 1e-12}, "merged out");
    lt::require_close(lse_a, want.lse, {1e-12, 1e-12}, "merged lse");
    // Large log-sum-exps in float: the stable form neither overflows nor loses the smaller part.
    std::vector<float> oa{1.0f, 2.0f}, ob{3.0f, 5.0f}, lsa{200.0f}, lsb{201.0f};  // exp(201) overflows float
    merge_on(oa, lsa, ob, lsb, 1, 1, 2);
    const double wa = 1.0 / (1.0 + std::exp(1.0)), wb = 1.0 - wa;
    CHECK(std::abs(oa[0] - (wa * 1 + wb * 3)) < 1e-4);  // float lse of 200: ulp 1.5e-5
    CHECK(std::abs(oa[1] - (wa * 2 + wb * 5)) < 1e-4);
    CHECK(std::isfinite(lsa[0]));
    CHECK(std::abs(lsa[0] - (201.0 + std::log1p(std::exp(-1.0)))) < 1e-4);
    // -inf rows are the identity.
    std::vector<float> oc{7.0f}, od{9.0f}, lc{-INFINITY}, ld{0.5f};
    merge_on(oc, lc, od, ld, 1, 1, 1);
    CHECK(oc[0] == 9.0f);
    CHECK(lc[0] == 0.5f);
  }
}

TEST_CASE("attention: rejections" LOOM_BACKEND_TAG, "[attention][errors]") {
  const auto b = make_backend();
  buffer<float> q(std::vector<float>(10 * 6 * 8)), k(std::vector<float>(10 * 4 * 8)), v(k.size()), o(q.size()),
      l(std::vector<float>(60));
  const std::vector<index_t> cu{0, 10};
  buffer<index_t> cub(cu);
  const loom::segments docs(view_of<const index_t, 1>(cub, {2}));
  const auto qv = view_of<const float, 3>(q, {10, 6, 8});
  const auto ov = view_of<float, 3>(o, {10, 6, 8});
  const auto lv = view_of<float, 2>(l, {10, 6});
  CHECK_THROWS_WITH(
      la::forward(b, docs, qv, view_of<const float, 3>(k, {10, 4, 8}), view_of<const float, 3>(v, {10, 4, 8}), ov, lv),
      Catch::Contains("q heads (6) must be a multiple of kv heads (4)"));
  CHECK_THROWS_WITH(la::forward(b, docs, qv, view_of<const float, 3>(k, {10, 2, 16}),
                                view_of<const float, 3>(v, {10, 2, 16}), ov, lv),
                    Catch::Contains("shape_mismatch") && Catch::Contains("k must be [10, 2, 8], got [10, 2, 16]"));
  const auto kv = view_of<const float, 3>(k, {10, 2, 8});
  CHECK_THROWS_WITH(la::forward(b, docs, qv, kv, kv, view_of<float, 3>(o, {10, 6, 7}), lv),
                    Catch::Contains("out must be [10, 6, 8]"));
  CHECK_THROWS_WITH(la::forward(b, docs, qv, kv, kv, ov, view_of<float, 2>(l, {6, 10})),
                    Catch::Contains("lse must be [10, 6]"));
  // Plans: bad shapes and options are rejected by make_plan, with the option's name.
  lt::require_loom_error(
      [&] {
        (void)la::make_plan(b, {10, 0, 1, 8, 8});
      },
      loom::errc::invalid_argument, {"attention::make_plan: heads must be >= 1"});
  lt::require_loom_error(
      [&] {
        (void)la::make_plan(b, {10, 2, 1, 0, 8});
      },
      loom::errc::invalid_argument, {"head dims must be >= 1"});
  for (la::window_size w : {la::window_size{-2, 0}, la::window_size{0, -5}}) {
    la::options bad;
    bad.window = w;
    lt::require_loom_error(
        [&] {
          (void)la::make_plan(b, docs, {10, 6, 2, 8, 8}, bad);
        },
        loom::errc::invalid_argument, {"options.window (left, right) must each be >= -1"});
  }
  for (double sc : {0.0, -1.0, std::numeric_limits<double>::infinity()}) {
    la::options bad;
    bad.scale = sc;
    lt::require_loom_error(
        [&] {
          (void)la::make_plan(b, {10, 6, 2, 8, 8}, bad);
        },
        loom::errc::invalid_argument, {"options.scale must be finite and > 0"});
  }
  lt::require_loom_error(
      [&] {
        (void)la::make_plan(b, docs, {10, 6, 2, 8, 8, 9});
      },
      loom::errc::invalid_argument, {"with segments, queries and keys are the same tokens"});
  if constexpr (space::host_accessible)  // offsets in device memory are the caller's contract (check_segments)
    lt::require_loom_error(
        [&] {
          (void)la::make_plan(b, docs, {11, 6, 2, 8, 8});
        },
        loom::errc::invalid_argument, {"(the last offset) must equal the token count 11"});
  // Per call: the plan's kind, the workspace, the views against the plan.
  const auto packed = la::make_plan(b, docs, {10, 6, 2, 8, 8});
  const auto free = la::make_plan(b, {10, 6, 2, 8, 8});
  const loom::temporary_buffer<backend_under_test, std::byte> ws(
      b, static_cast<index_t>(packed.workspace_bytes() + loom::workspace_alignment));
  lt::require_loom_error([&] { la::forward(b, free, qv, kv, kv, ov, lv, ws.bytes()); }, loom::errc::invalid_argument,
                         {"attention::forward: the plan was made without segments"});
  lt::require_loom_error([&] { la::forward(b, packed, qv, kv, kv, ov, lv, ws.bytes().first(64)); },
                         loom::errc::invalid_argument, {"attention::forward: workspace must hold at least"});
  lt::require_loom_error([&] { la::forward(b, packed, qv, kv, kv, ov, lv, ws.bytes().subspan(8)); },
                         loom::errc::invalid_argument, {"workspace must start on a 64-byte boundary"});
  lt::require_loom_error(
      [&] {
        la::forward(b, packed, view_of<const float, 3>(q, {5, 6, 8}), kv, kv, ov, lv, ws.bytes());
      },
      loom::errc::shape_mismatch, {"attention::forward: q must be [10, 6, 8], got [5, 6, 8]"});
  if constexpr (space::host_accessible) {
    const std::vector<index_t> doc(10), pos(10);
    const la::coords<space> c{loom::tensor_view<const index_t, 1, space>(doc.data(), {10}),
                              loom::tensor_view<const index_t, 1, space>(pos.data(), {10})};
    lt::require_loom_error([&] { la::forward(b, packed, qv, kv, kv, c, c, ov, lv, ws.bytes()); },
                           loom::errc::invalid_argument, {"the plan was made with segments"});
    const la::coords<space> short_c{loom::tensor_view<const index_t, 1, space>(doc.data(), {9}),
                                    loom::tensor_view<const index_t, 1, space>(pos.data(), {9})};
    lt::require_loom_error([&] { la::forward(b, free, qv, kv, kv, short_c, c, ov, lv, ws.bytes()); },
                           loom::errc::shape_mismatch, {"query coordinates must have one entry per token (10)"});
  }
  {
    // Host offsets are checked value by value (device ones by count only).
    std::vector<float> hq(10 * 6 * 8), hk(10 * 2 * 8), ho(hq.size()), hl(60);
    auto bad = [&](std::vector<std::int32_t> c32, const char* what) {
      const loom::segments s32{std::span<const std::int32_t>(c32)};
      lt::require_loom_error(
          [&] {
            la::forward(loom::serial{}, s32, loom::tensor_view<const float, 3>(hq.data(), {10, 6, 8}),
                        loom::tensor_view<const float, 3>(hk.data(), {10, 2, 8}),
                        loom::tensor_view<const float, 3>(hk.data(), {10, 2, 8}),
                        loom::tensor_view<float, 3>(ho.data(), {10, 6, 8}),
                        loom::tensor_view<float, 2>(hl.data(), {10, 6}));
          },
          loom::errc::invalid_argument, {what});
    };
    bad({0, 6, 4, 10}, "segments must be non-decreasing");
    bad({0, 4, 9}, "must equal the token count 10");
    bad({2, 10}, "segments[0] must be 0");
  }
}

namespace {

// One non-finite value in one input of one document: every other document's out, lse and
// gradients are bitwise those of the clean run, and the poisoned document shows it.
template <class P>
void check_isolated(lt::attn_shape s, const std::vector<index_t>& cu, std::uint64_t seed) {
  using T = typename P::storage_type;
  s.tk = s.tq = cu.back();
  const auto in = make_inputs<T>(s, seed);
  const auto clean = run_packed<T>(s, in, cu, true);
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  for (std::size_t d = 0; d + 1 < cu.size(); ++d) {
    const index_t begin = cu[d], end = cu[d + 1];
    if (begin == end) continue;
    const index_t t = begin + (end - begin) / 3;  // the poisoned token, and one that sees it:
    const index_t last = s.window.left >= 0 ? std::min(end - 1, t + s.window.left) : end - 1;
    for (int which = 0; which < 4; ++which)
      for (double bad : {nan, inf, -inf}) {
        INFO("document " << d << " input "
                         << "qkvd"[which] << " value " << bad << " causal " << s.causal << " "
                         << loom::precision_name<P>());
        inputs dirty = in;
        // Element 1 of head 1 (query side) or kv head 0 (key side) of token t.
        if (which == 0) dirty.q[(t * s.hq + 1) * s.dk + 1] = bad;
        if (which == 1) dirty.k[(t * s.hkv) * s.dk + 1] = bad;
        if (which == 2) dirty.v[(t * s.hkv) * s.dv + 1] = bad;
        if (which == 3) dirty.dout[(t * s.hq + 1) * s.dv + 1] = bad;
        const auto got = run_packed<T>(s, dirty, cu, true);
        lt::require_same_outside(got.out, clean.out, s.hq * s.dv, begin, end, "out");
        lt::require_same_outside(got.lse, clean.lse, s.hq, begin, end, "lse");
        lt::require_same_outside(got.dq, clean.dq, s.hq * s.dk, begin, end, "dq");
        lt::require_same_outside(got.dk, clean.dk, s.hkv * s.dk, begin, end, "dk");
        lt::require_same_outside(got.dv, clean.dv, s.hkv * s.dv, begin, end, "dv");
        // Visible where it lands: a bad query or key makes the log-sum-exp of the rows that read
        // it NaN (never the "no key" -inf); a bad value or output gradient makes them non-finite.
        if (which == 0) CHECK(std::isnan(got.lse[t * s.hq + 1]));
        if (which == 1) CHECK(std::isnan(got.lse[last * s.hq + 0]));
        if (which == 2) CHECK(!std::isfinite(got.out[(last * s.hq + 0) * s.dv + 1]));
        if (which == 3) CHECK(!std::isfinite(got.dq[(t * s.hq + 1) * s.dk + 1]));
      }
  }
}

}  // namespace

TEST_CASE("attention: a non-finite input stays in its document, forward and backward" LOOM_BACKEND_TAG,
          "[attention][local][nonfinite]") {
  // Documents of 40, 61, 62 tokens: tiles of 64 straddle every boundary.
  const vector_switch switched(GENERATE(true, false));
  const std::vector<index_t> docs{0, 40, 101, 163};
  check_isolated<loom::fp32>({0, 0, 4, 2, 32, 24, true}, docs, 70);
  check_isolated<loom::fp32>({0, 0, 2, 1, 16, 16, false}, docs, 71);
  check_isolated<loom::fp64>({0, 0, 4, 2, 32, 24, true, {22, 0}}, docs, 72);
  check_isolated<loom::bf16>({0, 0, 2, 2, 16, 16, true}, {0, 1, 100, 163}, 73);
}

TEST_CASE("attention: overflowing scores and a stale lse are visible" LOOM_BACKEND_TAG,
          "[attention][local][nonfinite]") {
  using Acc = float;
  const lt::attn_shape s{163, 163, 2, 1, 16, 16, true};
  const std::vector<index_t> cu{0, 40, 101, 163};
  auto in = make_inputs<float>(s, 80);
  const auto clean = run_packed<float>(s, in, cu, true);
  // Document 1's queries and keys near 1e20: scores near 1e40 overflow float. Its rows come back
  // NaN (never out = 0, lse = -inf, which a merge would drop); the others are untouched.
  inputs big = in;
  for (index_t t = 40; t < 101; ++t) {
    for (index_t e = 0; e < s.hq * s.dk; ++e) big.q[t * s.hq * s.dk + e] = 1e20;
    for (index_t e = 0; e < s.hkv * s.dk; ++e) big.k[t * s.hkv * s.dk + e] = 1e20;
  }
  const auto got = run_packed<float>(s, big, cu, false);
  lt::require_same_outside(got.lse, clean.lse, s.hq, 40, 101, "lse");
  for (index_t e = 40 * s.hq; e < 101 * s.hq; ++e) CHECK(std::isnan(got.lse[e]));
  // Backward given a stale lse (200 below the true one: exp overflows) or a non-finite one: the
  // gradients of that row are non-finite, never finite garbage.
  const auto b = make_backend();
  for (double stale : {-200.0, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    INFO("lse of token 50, head 0 replaced with " << stale);
    std::vector<Acc> lse_h(clean.lse.size());
    for (std::size_t i = 0; i < lse_h.size(); ++i) lse_h[i] = static_cast<Acc>(clean.lse[i]);
    lse_h[50 * s.hq] = std::isfinite(stale) ? lse_h[50 * s.hq] + static_cast<Acc>(stale) : static_cast<Acc>(stale);
    buffer<float> q(cast<float>(in.q)), k(cast<float>(in.k)), v(cast<float>(in.v)), dout(cast<float>(in.dout)),
        out(cast<float>(clean.out)), dq(in.q.size()), dk(in.k.size()), dv(in.v.size());
    buffer<Acc> lse(lse_h);
    buffer<index_t> cub(cu);
    la::backward(b, loom::segments(view_of<const index_t, 1>(cub, {4})), view_of<const float, 3>(q, {s.tq, s.hq, s.dk}),
                 view_of<const float, 3>(k, {s.tk, s.hkv, s.dk}), view_of<const float, 3>(v, {s.tk, s.hkv, s.dv}),
                 view_of<const float, 3>(out, {s.tq, s.hq, s.dv}), view_of<const Acc, 2>(lse, {s.tq, s.hq}),
                 view_of<const float, 3>(dout, {s.tq, s.hq, s.dv}), view_of<float, 3>(dq, {s.tq, s.hq, s.dk}),
                 view_of<float, 3>(dk, {s.tk, s.hkv, s.dk}), view_of<float, 3>(dv, {s.tk, s.hkv, s.dv}));
    const auto dqh = widen(dq.to_host());
    bool any_bad = false;
    for (index_t c = 0; c < s.dk; ++c) any_bad |= !std::isfinite(dqh[(50 * s.hq) * s.dk + c]);
    CHECK(any_bad);
    lt::require_same_outside(widen(dq.to_host()), clean.dq, s.hq * s.dk, 40, 101, "dq");
  }
}

TEST_CASE("attention: fast_exp against std::exp, and its non-finite cases" LOOM_BACKEND_TAG, "[attention][local]") {
  using la::detail::fast_exp;
  // Every 2^-10 step of [-90, 90], plus the edges of the range.
  double worst = 0;
  std::size_t bad_special = 0;
  for (int i = -90 * 1024; i <= 90 * 1024; ++i) {
    const float x = static_cast<float>(i) / 1024.0f;
    const float got = fast_exp(x);
    if (x <= -87.0f) {
      bad_special += got != 0.0f;
    } else if (x > 88.37f) {
      bad_special += !(std::isinf(got) && got > 0);
    } else {
      const double want = std::exp(static_cast<double>(x));
      worst = std::max(worst, std::abs(static_cast<double>(got) - want) / want);
    }
  }
  INFO("largest relative error " << worst);
  CHECK(worst < 3e-7);  // the documented bound (measured: 1e-7)
  CHECK(bad_special == 0);
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(std::isnan(fast_exp(std::numeric_limits<float>::quiet_NaN())));
  CHECK(fast_exp(-inf) == 0.0f);
  CHECK(fast_exp(inf) == inf);
  CHECK(fast_exp(-1e30f) == 0.0f);
  CHECK(fast_exp(1e30f) == inf);
  CHECK(fast_exp(0.0f) == 1.0f);
  CHECK(fast_exp(-0.0f) == 1.0f);
#if defined(LOOM_X86_KERNELS)
  // The AVX2 form (8 lanes) on the same grid and the same special values, where the CPU has it.
  if (loom::detail::x86::avx2_cpu()) {
    std::vector<float> x;
    for (int i = -90 * 1024; i <= 90 * 1024; ++i) x.push_back(static_cast<float>(i) / 1024.0f);
    for (float v : {std::numeric_limits<float>::quiet_NaN(), -inf, inf, -1e30f, 1e30f, 0.0f, -0.0f}) x.push_back(v);
    while (x.size() % 8) x.push_back(0.0f);
    std::vector<float> y(x.size());
    la::detail::x86::exp_array(x.data(), y.data(), static_cast<index_t>(x.size()));
    double vworst = 0;
    std::size_t vbad = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float xi = x[i], yi = y[i];
      if (std::isnan(xi)) {
        vbad += !std::isnan(yi);
      } else if (xi <= -87.0f) {
        vbad += yi != 0.0f;
      } else if (xi > 88.37f) {
        vbad += !(std::isinf(yi) && yi > 0);
      } else {
        const double want = std::exp(static_cast<double>(xi));
        vworst = std::max(vworst, std::abs(static_cast<double>(yi) - want) / want);
      }
    }
    INFO("AVX2 exp: largest relative error " << vworst);
    CHECK(vworst < 3e-7);
    CHECK(vbad == 0);
  }
  // A row form's finite check and rescale on lengths 1 to 41 with random values, and the finite
  // check with +-inf or NaN at every position: the number of wrong answers.
  const auto finite_and_scale_errors = [&](auto finite, auto scale, auto& gen) {
    std::uniform_real_distribution<double> values(-2.0, 2.0);
    std::size_t wrong = 0;
    for (index_t n = 1; n <= 41; ++n) {
      std::vector<float> x(static_cast<std::size_t>(n));
      for (auto& v : x) v = static_cast<float>(values(gen));
      wrong += !finite(x.data(), n);
      for (index_t at = 0; at < n; ++at)
        for (const float bad : {inf, -inf, std::numeric_limits<float>::quiet_NaN()}) {
          std::vector<float> y(x);
          y[static_cast<std::size_t>(at)] = bad;
          wrong += finite(y.data(), n);
        }
      std::vector<float> a(x), want(x);
      for (auto& v : want) v *= 0.75f;
      scale(a.data(), n, 0.75f);
      wrong += a != want;
    }
    return wrong;
  };
  // The AVX2 rows: the finite check and the rescale on odd lengths, a non-finite value at every
  // position; the four-row step (finiteness of [0, nk) and maxima in one pass) against the per-row
  // finite check and row_max, a non-finite value before nk (the step declines) or past it (filled
  // -inf: ignored), and the AVX-512 step's answers where the CPU has it.
  if (loom::detail::x86::avx2_cpu()) {
    namespace ax = la::detail::x86;
    constexpr index_t w = la::detail::tile_k;
    auto g = loom::test::rng(78);
    std::uniform_real_distribution<double> scores(-30.0, 30.0);
    std::size_t wrong = finite_and_scale_errors(ax::finite_row8, ax::scale_row8, g);
    for (int trial = 0; trial < 60; ++trial) {
      const index_t nk = trial % 3 == 0 ? w : 1 + (trial * 13) % w;
      std::vector<float> rows(static_cast<std::size_t>(4 * w));
      for (auto& x : rows) x = static_cast<float>(scores(g));
      const std::size_t at = static_cast<std::size_t>((trial * 29) % (4 * w));
      const int kind = (trial / 3) % 3;  // every kind of bad value with nk = w and with nk < w
      const float bad = kind == 0 ? inf : kind == 1 ? -inf : std::numeric_limits<float>::quiet_NaN();
      if (trial % 2) rows[at] = bad;
      const float m[4] = {-inf, 12.5f, -3.0f, trial % 4 == 1 ? 40.0f : -inf};
      std::vector<float> want(rows);
      bool finite = true;
      float want_mx[4];
      for (index_t r = 0; r < 4; ++r) {
        float* row = want.data() + r * w;
        finite = finite && ax::finite_row8(row, nk);
        for (index_t j = nk; j < w; ++j) row[j] = -inf;
        want_mx[r] = ax::row_max(row, w, m[r]);
      }
      std::vector<float> got(rows);
      float mx[4];
      const bool ok = ax::rows_max4_avx2<w>(got.data(), nk, m, mx);
      wrong += ok != finite;
      for (std::size_t e = 0; e < got.size(); ++e)
        wrong += la::detail::float_to_bits(got[e]) != la::detail::float_to_bits(want[e]);
      if (ok)
        for (int r = 0; r < 4; ++r) wrong += la::detail::float_to_bits(mx[r]) != la::detail::float_to_bits(want_mx[r]);
      if (loom::detail::x86::avx512_cpu()) {
        std::vector<float> got16(rows);
        float mx16[4];
        const bool ok16 = ax::rows_max4<w>(got16.data(), nk, m, mx16);
        wrong += ok16 != finite;
        for (std::size_t e = 0; e < got.size(); ++e)
          wrong += la::detail::float_to_bits(got16[e]) != la::detail::float_to_bits(got[e]);
        if (ok16)
          for (int r = 0; r < 4; ++r) wrong += la::detail::float_to_bits(mx16[r]) != la::detail::float_to_bits(mx[r]);
      }
    }
    CHECK(wrong == 0);
  }
  // The 16-lane softmax rows (AVX-512) give the 8-lane ones' bits: max, probabilities and sum,
  // with and without the full-row poisoning, every nk, and the backward's rows of P and dS; the
  // finite check and the rescale on odd lengths, a non-finite value at every position.
  if (loom::detail::x86::avx512_cpu() && loom::detail::x86::avx2_cpu()) {
    namespace ax = la::detail::x86;
    constexpr index_t w = la::detail::tile_k;
    auto g = loom::test::rng(77);
    std::uniform_real_distribution<double> scores(-30.0, 30.0), values(-2.0, 2.0);
    std::size_t mismatches = 0;
    for (int trial = 0; trial < 40; ++trial) {
      std::vector<float> row(w);
      for (auto& x : row) x = static_cast<float>(scores(g));
      if (trial % 4 == 1) row[static_cast<std::size_t>(trial) % w] = -inf;
      if (trial % 4 == 2) row[static_cast<std::size_t>(trial * 7) % w] = std::numeric_limits<float>::quiet_NaN();
      if (trial % 4 == 3) row[static_cast<std::size_t>(trial * 3) % w] = inf;
      const float init = trial % 2 ? -inf : 12.5f;
      const float m8 = ax::row_max(row.data(), w, init), m16 = ax::row_max16(row.data(), w, init);
      mismatches += la::detail::float_to_bits(m8) != la::detail::float_to_bits(m16);
      for (const bool full : {false, true}) {
        const index_t nk = 1 + (trial * 13) % w;
        std::vector<float> r8(row), r16(row);
        const float s8 = ax::exp_row(r8.data(), w, nk, full, m8), s16 = ax::exp_row16(r16.data(), w, nk, full, m8);
        mismatches += la::detail::float_to_bits(s8) != la::detail::float_to_bits(s16);
        for (std::size_t j = 0; j < r8.size(); ++j)
          mismatches += la::detail::float_to_bits(r8[j]) != la::detail::float_to_bits(r16[j]);
        // The backward's probability and score-gradient row: against a finite lse, a NaN one
        // (the caller's stand-in for +inf, which it never passes) and one too small for the
        // scores (overflow to +inf).
        std::vector<float> dp(w);
        for (auto& x : dp) x = static_cast<float>(values(g));
        if (trial % 5 == 4) dp[static_cast<std::size_t>(trial * 11) % w] = inf;
        const float lse = trial % 7 == 3   ? std::numeric_limits<float>::quiet_NaN()
                          : trial % 7 == 5 ? -95.0f
                                           : (std::isfinite(m8) ? m8 : 30.0f) + 1.5f;
        std::vector<float> p8(row), p16(row), d8(dp), d16(dp);
        ax::backward_row(p8.data(), d8.data(), w, nk, full, lse, 0.375f);
        ax::backward_row16(p16.data(), d16.data(), w, nk, full, lse, 0.375f);
        for (std::size_t j = 0; j < p8.size(); ++j) {
          mismatches += la::detail::float_to_bits(p8[j]) != la::detail::float_to_bits(p16[j]);
          mismatches += la::detail::float_to_bits(d8[j]) != la::detail::float_to_bits(d16[j]);
        }
      }
    }
    CHECK(mismatches == 0);
    std::size_t wrong = finite_and_scale_errors(ax::finite_row16, ax::scale_row16, g);
    CHECK(wrong == 0);
  }
#endif
}

TEST_CASE("attention: bfloat16 pair products run where the CPU has them and they beat its float FMAs" LOOM_BACKEND_TAG,
          "[attention][local][bf16]") {
#if defined(LOOM_X86_KERNELS)
  namespace x86 = loom::detail::x86;
  const double speedup = x86::bf16_pair_speedup();
  INFO("vdpbf16ps FLOP rate / FMA FLOP rate on this CPU: " << speedup);
  if (!x86::avx512_bf16_cpu()) {
    CHECK(speedup == 0.0);
    CHECK_FALSE(x86::avx512_bf16_pairs_available());
    return;
  }
  // A timing, so no exact figure; the rates of real CPUs lie between a quarter and four times.
  CHECK(speedup > 0.25);
  CHECK(speedup < 4.0);
  CHECK(x86::bf16_pair_speedup() == speedup);  // measured once
  REQUIRE(x86::bf16_pair_policy() == x86::bf16_pairs::measured);
  CHECK(x86::avx512_bf16_pairs_available() == (speedup > x86::bf16_pair_threshold));
  {
    const loom::test::vector_switch widest(loom::test::vector_mode::widest);
    CHECK(x86::avx512_bf16_pairs_available());
  }
  for (const auto mode : {loom::test::vector_mode::avx2, loom::test::vector_mode::portable}) {
    const loom::test::vector_switch narrower(mode);
    CHECK_FALSE(x86::avx512_bf16_pairs_available());
  }
  x86::bf16_pair_policy() = x86::bf16_pairs::never;
  CHECK_FALSE(x86::avx512_bf16_pairs_available());
  x86::bf16_pair_policy() = x86::bf16_pairs::measured;
#else
  SUCCEED("no x86 vector kernels in this build");
#endif
}

TEST_CASE("attention: windows (left, right): left-only, right-only, symmetric, causal or not" LOOM_BACKEND_TAG,
          "[attention][local][window]") {
  // Odd and prime lengths; documents shorter and longer than a tile and than the windows.
  const std::vector<index_t> docs{0, 3, 70, 71, 268, 409};
  const std::vector<la::window_size> windows{{0, 0},   {5, 0},   {63, 0},  {0, 7},  {-1, 13}, {17, 17},
                                             {64, 64}, {100, 3}, {2, 130}, {-1, 0}, {0, -1}};
  std::uint64_t seed = 90;
  for (const auto w : windows)
    for (bool causal : {true, false}) {
      if (lt::sanitized && seed % 3 != 0) {
        ++seed;
        continue;
      }
      check_packed<loom::fp64>({0, 0, 4, 2, 16, 24, causal, w}, docs, seed, true);
      check_packed<loom::fp32, std::int32_t>({0, 0, 2, 1, 32, 32, causal, w}, {0, 131}, seed + 1000, false);
      ++seed;
    }
}

TEST_CASE("attention: a plan allocates nothing per call and is reusable across calls and threads" LOOM_BACKEND_TAG,
          "[attention][local][plan]") {
  using T = float;
  const lt::attn_shape s{173, 173, 4, 2, 32, 16, true, {40, 3}};
  const std::vector<index_t> cu{0, 61, 62, 173};
  const auto in = make_inputs<T>(s, 95);
  const auto b = make_backend();
  buffer<T> q(cast<T>(in.q)), k(cast<T>(in.k)), v(cast<T>(in.v)), dout(cast<T>(in.dout));
  buffer<std::int32_t> cub(std::vector<std::int32_t>(cu.begin(), cu.end()));
  const loom::segments docs(view_of<const std::int32_t, 1>(cub, {4}));
  const la::options opt{s.causal, s.window, s.scale};
  const auto plan = la::make_plan(b, docs, {s.tq, s.hq, s.hkv, s.dk, s.dv}, opt);
  const std::size_t bytes = std::max(plan.workspace_bytes(), plan.backward_workspace_bytes());
  // One run on its own workspace and outputs: out, lse, dq, dk, dv as host vectors.
  auto run = [&](const decltype(plan)& p, lt::allocation_report* count) {
    const loom::temporary_buffer<backend_under_test, std::byte> ws(b, static_cast<index_t>(bytes));
    buffer<T> out(in.dout.size()), dq(in.q.size()), dk(in.k.size()), dv(in.v.size());
    buffer<float> lse(static_cast<std::size_t>(s.tq * s.hq));
    const auto call = [&] {
      for (int rep = 0; rep < 2; ++rep) {
        la::forward(b, p, view_of<const T, 3>(q, {s.tq, s.hq, s.dk}), view_of<const T, 3>(k, {s.tk, s.hkv, s.dk}),
                    view_of<const T, 3>(v, {s.tk, s.hkv, s.dv}), view_of<T, 3>(out, {s.tq, s.hq, s.dv}),
                    view_of<float, 2>(lse, {s.tq, s.hq}), ws.bytes());
        la::backward(b, p, view_of<const T, 3>(q, {s.tq, s.hq, s.dk}), view_of<const T, 3>(k, {s.tk, s.hkv, s.dk}),
                     view_of<const T, 3>(v, {s.tk, s.hkv, s.dv}), view_of<const T, 3>(out, {s.tq, s.hq, s.dv}),
                     view_of<const float, 2>(lse, {s.tq, s.hq}), view_of<const T, 3>(dout, {s.tq, s.hq, s.dv}),
                     view_of<T, 3>(dq, {s.tq, s.hq, s.dk}), view_of<T, 3>(dk, {s.tk, s.hkv, s.dk}),
                     view_of<T, 3>(dv, {s.tk, s.hkv, s.dv}), ws.bytes());
      }
    };
    if (count)
      *count = lt::count_allocations(call);  // checked by the caller (Catch2 assertions stay on one thread)
    else
      call();
    return std::vector<std::vector<T>>{out.to_host(), lse.to_host(), dq.to_host(), dk.to_host(), dv.to_host()};
  };
  const auto fresh = run(la::make_plan(b, docs, {s.tq, s.hq, s.hkv, s.dk, s.dv}, opt), nullptr);
  lt::allocation_report a;
  const auto reused = run(plan, &a);
  CHECK(a.heap == 0);
  CHECK(a.temporaries == 0);
  auto same = [](const std::vector<std::vector<T>>& x, const std::vector<std::vector<T>>& y) {
    for (std::size_t i = 0; i < x.size(); ++i)
      if (x[i].size() != y[i].size() || std::memcmp(x[i].data(), y[i].data(), x[i].size() * sizeof(T)) != 0)
        return false;
    return true;
  };
  CHECK(same(fresh, reused));
  // int64 offsets give the same bits.
  buffer<std::int64_t> cu64(std::vector<std::int64_t>(cu.begin(), cu.end()));
  CHECK(same(fresh, run(la::make_plan(b, loom::segments(view_of<const std::int64_t, 1>(cu64, {4})),
                                      {s.tq, s.hq, s.hkv, s.dk, s.dv}, opt),
                        nullptr)));
  const auto want = lt::attention_oracle(s, in.q, in.k, in.v, lt::packed(cu), lt::packed(cu), in.dout);
  lt::require_close(widen(reused[0]), want.out, {2e-5, 2e-5}, "out");
  if constexpr (space::host_accessible) {
    // Two threads share one const plan, each with its own workspace and outputs.
    std::vector<std::vector<T>> r1, r2;
    lt::allocation_report a1, a2;
    std::thread t1([&] { r1 = run(plan, &a1); }), t2([&] { r2 = run(plan, &a2); });
    t1.join();
    t2.join();
    CHECK(same(fresh, r1));
    CHECK(same(fresh, r2));
    CHECK(a1.heap + a2.heap == 0);  // per thread (the temporaries count is the process's)
  }
}

TEST_CASE(
    "attention: queries against longer key histories (decode, KV-cache prefill), split-KV and tiled" LOOM_BACKEND_TAG,
    "[attention][local][decode]") {
  // Decode: one query per document (one document without queries, one without keys: its query
  // sees nothing), dims that leave a tail of the 16-lane products. Host x86: the AVX2 products
  // (head dims multiples of 8) and the portable ones (vector kernels switched off; dims 36 / 20).
  const std::vector<index_t> q1{0, 1, 2, 2, 3, 4, 5}, k1{0, 37, 38, 43, 343, 343, 1343};
  const bool vectors = GENERATE(true, false);
  const vector_switch switched(vectors);
  check_cross<loom::fp64>({0, 0, 6, 3, 36, 20, true}, q1, k1, 109, true);
  check_cross<loom::fp32>({0, 0, 6, 3, 36, 20, true, {100, 0}}, q1, k1, 108, true);
  for (bool causal : {true, false}) {
    check_cross<loom::fp64>({0, 0, 8, 2, 80, 40, causal}, q1, k1, 110 + causal, true);
    check_cross<loom::fp64, std::int32_t>({0, 0, 8, 2, 80, 40, causal, {50, 0}}, q1, k1, 112 + causal, true);
  }
  // One long document and one kv head: the keys split (several partials merged), GQA 5, three queries.
  CHECK(check_cross<loom::fp64>({0, 0, 5, 1, 64, 64, true}, {0, 3}, {0, 3001}, 114, true) > 1);
  CHECK(check_cross<loom::fp64>({0, 0, 5, 1, 64, 64, true, {700, 0}}, {0, 3}, {0, 3001}, 115, true) > 1);
  // Up to 16 queries per document take the split path (a document whose queries are all its keys,
  // prefill without a cache, included); 17 take the tiled kernels on the documents' coordinates.
  check_cross<loom::fp64>({0, 0, 4, 2, 32, 24, true}, {0, 16, 21}, {0, 216, 221}, 116, true);
  check_cross<loom::fp64>({0, 0, 4, 2, 32, 24, true}, {0, 16, 21}, {0, 16, 21}, 117, true);
  check_cross<loom::fp64>({0, 0, 4, 2, 32, 24, true}, {0, 17, 19}, {0, 300, 340}, 118, false);
  check_cross<loom::fp64>({0, 0, 4, 2, 32, 24, false, {5, 9}}, {0, 17, 19}, {0, 300, 340}, 119, false);
  // More queries than keys: the first ones sit before the document and see nothing when causal.
  check_cross<loom::fp64>({0, 0, 2, 1, 16, 16, true}, {0, 5, 7}, {0, 3, 70}, 120, true);
  check_cross<loom::fp32>({0, 0, 8, 2, 128, 128, true}, q1, k1, 121, true);
  check_cross<loom::fp32, std::int32_t>({0, 0, 4, 4, 96, 96, true}, {0, 2, 4}, {0, 1500, 2600}, 122, true);
  check_cross<loom::bf16>({0, 0, 8, 2, 64, 64, true}, q1, k1, 123, true);
}

TEST_CASE(
    "attention: split-KV keeps a non-finite input in its document, allocates nothing, rejects bad "
    "offsets" LOOM_BACKEND_TAG,
    "[attention][local][decode][nonfinite]") {
  using T = float;
  const std::vector<index_t> qcu{0, 2, 3, 5}, kcu{0, 700, 1000, 1301};
  lt::attn_shape s{qcu.back(), kcu.back(), 4, 2, 32, 24, true};
  const auto in = make_inputs<T>(s, 130);
  index_t splits = 0;
  const auto clean = run_packed<T>(s, in, qcu, false, &kcu, &splits);
  REQUIRE(splits > 1);
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  for (std::size_t d = 0; d + 1 < qcu.size(); ++d)
    for (int which = 0; which < 3; ++which)
      for (double bad : {nan, inf}) {
        INFO("document " << d << " input "
                         << "qkv"[which] << " value " << bad);
        inputs dirty = in;
        const index_t tq = qcu[d + 1] - 1, tk = kcu[d] + (kcu[d + 1] - kcu[d]) / 2;  // the last query sees it
        if (which == 0) dirty.q[(tq * s.hq + 1) * s.dk + 1] = bad;
        if (which == 1) dirty.k[(tk * s.hkv) * s.dk + 1] = bad;
        if (which == 2) dirty.v[(tk * s.hkv) * s.dv + 1] = bad;
        const auto got = run_packed<T>(s, dirty, qcu, false, &kcu);
        lt::require_same_outside(got.out, clean.out, s.hq * s.dv, qcu[d], qcu[d + 1], "out");
        lt::require_same_outside(got.lse, clean.lse, s.hq, qcu[d], qcu[d + 1], "lse");
        if (which == 0) CHECK(std::isnan(got.lse[tq * s.hq + 1]));
        if (which == 1) CHECK(std::isnan(got.lse[tq * s.hq + 0]));
        if (which == 2) CHECK(!std::isfinite(got.out[(tq * s.hq + 0) * s.dv + 1]));
      }
  // The plan form allocates nothing and gives the same bits on every call.
  const auto b = make_backend();
  buffer<T> q(cast<T>(in.q)), k(cast<T>(in.k)), v(cast<T>(in.v)), out(in.dout.size());
  buffer<float> lse(static_cast<std::size_t>(s.tq * s.hq));
  buffer<index_t> qb(qcu), kb(kcu);
  const loom::segments qd(view_of<const index_t, 1>(qb, {4})), kd(view_of<const index_t, 1>(kb, {4}));
  const auto plan = la::make_plan(b, qd, kd, {s.tq, s.hq, s.hkv, s.dk, s.dv, s.tk});
  CHECK(plan.split_keys());
  const loom::temporary_buffer<backend_under_test, std::byte> ws(b, static_cast<index_t>(plan.workspace_bytes()));
  const auto call = [&] {
    la::forward(b, plan, view_of<const T, 3>(q, {s.tq, s.hq, s.dk}), view_of<const T, 3>(k, {s.tk, s.hkv, s.dk}),
                view_of<const T, 3>(v, {s.tk, s.hkv, s.dv}), view_of<T, 3>(out, {s.tq, s.hq, s.dv}),
                view_of<float, 2>(lse, {s.tq, s.hq}), ws.bytes());
  };
  const lt::allocation_report a = lt::count_allocations(call);
  CHECK(a.heap == 0);
  CHECK(a.temporaries == 0);
  const auto first = out.to_host();
  call();
  CHECK(std::memcmp(first.data(), out.to_host().data(), first.size() * sizeof(T)) == 0);
  CHECK(widen(first) == clean.out);
  // Rejections: document counts that differ, key offsets that do not end at the key count.
  buffer<index_t> k3(std::vector<index_t>{0, 700, 1301});
  lt::require_loom_error(
      [&] {
        (void)la::make_plan(b, qd, loom::segments(view_of<const index_t, 1>(k3, {3})),
                            {s.tq, s.hq, s.hkv, s.dk, s.dv, s.tk});
      },
      loom::errc::shape_mismatch, {"q_segments and k_segments must hold the same documents, got 3 and 2 documents"});
  lt::require_loom_error(
      [&] {
        (void)la::make_plan(b, qd, kd, {s.tq, s.hq, s.hkv, s.dk, s.dv, s.tk + 1});
      },
      loom::errc::invalid_argument, {"k_segments[3] (the last offset) must equal the token count 1302"});
}
