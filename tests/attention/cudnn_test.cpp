// attention::cudnn: local attention over packed documents through cuDNN's fused SDPA graphs.
// [host] cases run anywhere (argument checks made before the device is touched; the ragged
// tables a plan gives cuDNN, decoded back to token rows and checked against the coordinate mask);
// the others need a GPU and compare cuDNN's results with the fp64 oracle.

#define LOOM_TEST_BACKEND_CUDA 1
#include <loom/attention/cudnn.hpp>

#include <support/backends.hpp>
#include <support/errors.hpp>
#include <support/random.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "oracle.hpp"

using namespace loom;
using loom::attention::cudnn::detail::tables;

namespace {

segments<host_memory> host_segments(const std::vector<std::int64_t>& cu) {
  return segments<host_memory>(std::span<const std::int64_t>(cu));
}

// The window settings every case is swept over: causal, causal with a window shorter than some
// documents, unmasked, symmetric, look-ahead only.
std::vector<attention::options> mask_cases() {
  return {
      {true, {-1, -1}, {}}, {true, {50, 0}, {}}, {false, {-1, -1}, {}}, {false, {20, 20}, {}}, {false, {-1, 30}, 0.07}};
}

}  // namespace

TEST_CASE("attention::cudnn: make_plan rejects dims, shapes, windows and offsets before touching the device",
          "[attention][cudnn][host]") {
  const std::vector<std::int64_t> cu = {0, 5, 12};
  const auto seg = host_segments(cu);
  const loom::cuda b{};
  using test::require_loom_error;
  require_loom_error(
      [&] {
        (void)attention::cudnn::make_plan(b, seg, {12, 4, 2, 60, 64});
      },
      errc::unsupported, {"attention::cudnn::make_plan", "dim_qk", "multiple of 8", "60"});
  require_loom_error(
      [&] {
        (void)attention::cudnn::make_plan(b, seg, {12, 4, 2, 64, 264});
      },
      errc::unsupported, {"attention::cudnn::make_plan", "dim_v", "at most 256", "264"});
  require_loom_error(
      [&] {
        (void)attention::cudnn::make_plan(b, seg, {12, 4, 3, 64, 64});
      },
      errc::invalid_argument, {"attention::cudnn::make_plan", "multiple of kv heads"});
  require_loom_error(
      [&] {
        (void)attention::cudnn::make_plan(b, seg, {12, 4, 2, 64, 64, 9});
      },
      errc::invalid_argument, {"attention::cudnn::make_plan", "tokens_k"});
  attention::options bad;
  bad.window = {-2, 0};
  require_loom_error(
      [&] {
        (void)attention::cudnn::make_plan(b, seg, {12, 4, 2, 64, 64}, bad);
      },
      errc::invalid_argument, {"attention::cudnn::make_plan", "options.window"});
  bad = {};
  bad.scale = -1.0;
  require_loom_error(
      [&] {
        (void)attention::cudnn::make_plan(b, seg, {12, 4, 2, 64, 64}, bad);
      },
      errc::invalid_argument, {"attention::cudnn::make_plan", "options.scale"});
  // Offsets that end short of the tokens.
  require_loom_error(
      [&] {
        (void)attention::cudnn::make_plan(b, seg, {13, 4, 2, 64, 64});
      },
      errc::invalid_argument, {"attention::cudnn::make_plan", "segments"});
  const std::vector<std::int64_t> down = {0, 7, 5, 12};
  require_loom_error(
      [&] {
        (void)attention::cudnn::make_plan(b, host_segments(down), {12, 4, 2, 64, 64});
      },
      errc::invalid_argument, {"attention::cudnn::make_plan", "segments"});
}

TEST_CASE("attention::cudnn: forward and backward reject views, plans and documents before touching the device",
          "[attention][cudnn][host]") {
  // A plan of no tokens needs no device (no graph runs), so every check of the calls runs here.
  const std::vector<std::int64_t> none = {0};
  const loom::cuda b{};
  const auto p = attention::cudnn::make_plan(b, host_segments(none), {0, 4, 2, 64, 64});
  CHECK(p.batches() == 0);
  using cv3 = tensor_view<const bfloat16, 3, cuda_memory>;
  using v3 = tensor_view<bfloat16, 3, cuda_memory>;
  const cv3 q(nullptr, {0, 4, 64}), k(nullptr, {0, 2, 64}), v(nullptr, {0, 2, 64}), dout(nullptr, {0, 4, 64});
  const v3 out(nullptr, {0, 4, 64}), dq(nullptr, {0, 4, 64}), dk(nullptr, {0, 2, 64}), dv(nullptr, {0, 2, 64});
  const tensor_view<float, 2, cuda_memory> lse(nullptr, {0, 4});
  attention::cudnn::forward(b, p, q, k, v, out, lse, {});  // nothing to run
  attention::cudnn::backward(b, p, q, k, v, out, lse, dout, dq, dk, dv, {});
  using test::require_loom_error;
  constexpr auto fwd = "attention::cudnn::forward", bwd = "attention::cudnn::backward";
  require_loom_error(
      [&] {
        attention::cudnn::forward(b, p, cv3(nullptr, {1, 4, 64}), k, v, out, lse, {});
      },
      errc::shape_mismatch, {fwd, "q"});
  require_loom_error(
      [&] {
        attention::cudnn::forward(b, p, q, k, v, out, tensor_view<float, 2, cuda_memory>(nullptr, {0, 3}), {});
      },
      errc::shape_mismatch, {fwd, "lse"});
  // Right extents, strides that are not dense.
  require_loom_error(
      [&] {
        attention::cudnn::forward(b, p, q, cv3(nullptr, {0, 2, 64}, {256, 128, 1}), v, out, lse, {});
      },
      errc::invalid_argument, {fwd, "k", "dense"});
  require_loom_error(
      [&] {
        attention::cudnn::forward(b, p, q, k, v, v3(nullptr, {0, 4, 64}, {512, 64, 1}), lse, {});
      },
      errc::invalid_argument, {fwd, "out", "dense"});
  require_loom_error(
      [&] {
        attention::cudnn::forward(b, p, q, k, v, out, tensor_view<float, 2, cuda_memory>(nullptr, {0, 4}, {8, 1}), {});
      },
      errc::invalid_argument, {fwd, "lse", "dense"});
  require_loom_error(
      [&] {
        attention::cudnn::backward(b, p, q, k, v, out, lse, dout, v3(nullptr, {0, 4, 63}), dk, dv, {});
      },
      errc::shape_mismatch, {bwd, "dq"});
  require_loom_error(
      [&] {
        attention::cudnn::backward(b, p, q, k, v, out, lse, cv3(nullptr, {0, 4, 64}, {256, 128, 1}), dq, dk, dv, {});
      },
      errc::invalid_argument, {bwd, "dout", "dense"});
  require_loom_error(
      [&] {
        attention::cudnn::backward(b, p, q, k, v, out, lse, dout, dq, dk, v3(nullptr, {0, 2, 64}, {64, 64, 1}), {});
      },
      errc::invalid_argument, {bwd, "dv", "dense"});
  // A plan that make_plan did not make.
  const attention::cudnn::plan<loom::bf16> blank{};
  require_loom_error([&] { attention::cudnn::forward(b, blank, q, k, v, out, lse, {}); }, errc::invalid_argument,
                     {fwd, "not made by"});
  require_loom_error([&] { attention::cudnn::backward(b, blank, q, k, v, out, lse, dout, dq, dk, dv, {}); },
                     errc::invalid_argument, {bwd, "not made by"});
  // A document too long for cuDNN's int32 counts (offsets only: nothing is allocated).
  const std::vector<std::int64_t> huge = {0, std::int64_t{1} << 31};
  require_loom_error(
      [&] {
        (void)attention::cudnn::make_plan(b, host_segments(huge), {std::int64_t{1} << 31, 1, 1, 64, 64});
      },
      errc::unsupported, {"attention::cudnn::make_plan", "int32", "document 0"});
}

TEST_CASE("attention::cudnn: the ragged tables of a plan address exactly the rows and keys each query sees",
          "[attention][cudnn][host]") {
  using namespace loom::attention::detail;
  namespace cd = loom::attention::cudnn::detail;
  // Prime and odd lengths, an empty document, a one-token document.
  const std::vector<std::int64_t> cu = {0, 1, 38, 38, 168, 423, 424, 625};
  const attention::shape s{625, 6, 2, 8, 16};
  const test::attn_coords c = test::packed(std::vector<index_t>(cu.begin(), cu.end()));
  for (const auto& opt : mask_cases()) {
    INFO("causal " << opt.causal << " window (" << opt.window.left << ", " << opt.window.right << ")");
    const test::attn_shape as{s.tokens, s.tokens, s.heads_q, s.heads_kv, s.dim_qk, s.dim_v, opt.causal, opt.window};
    const auto blocks = cd::document_blocks(host_segments(cu), opt);
    const auto groups = batches_of(blocks);
    // seen[i * T + j]: how many batch entries make key j visible to query i.
    std::vector<int> seen(static_cast<std::size_t>(s.tokens * s.tokens), 0);
    std::vector<int> rows(static_cast<std::size_t>(s.tokens), 0);
    for (const auto& g : groups) {
      const graph_key key =
          key_of(fused_pass::forward, fused_element::bf16, {s.heads_q, s.heads_kv, s.dim_qk, s.dim_v}, 0.125, g);
      const tables t = cd::tables_of(g, s);
      REQUIRE(t.batch == static_cast<index_t>(g.size()));
      REQUIRE(t.words.size() == tables::size_of(t.batch));
      const std::int64_t per_token[5] = {s.heads_q * s.dim_qk, s.heads_kv * s.dim_qk, s.heads_kv * s.dim_v,
                                         s.heads_q * s.dim_v, s.heads_q};
      for (index_t e = 0; e < t.batch; ++e) {
        const index_t nq = t.count(0, e), nk = t.count(1, e);
        REQUIRE(nq >= 1);
        REQUIRE(nk >= 1);
        // Every table of an entry names the same first row: q, out, lse the query row; k, v the key.
        std::int64_t row[5];
        for (int w = 0; w < 5; ++w) {
          const std::int64_t off = t.words[t.ragged(w) + static_cast<std::size_t>(e)];
          REQUIRE(off % per_token[w] == 0);
          row[w] = off / per_token[w];
        }
        CHECK(row[3] == row[0]);
        CHECK(row[4] == row[0]);
        CHECK(row[2] == row[1]);
        // cuDNN's top-left band on entry-local rows i and keys j: j > i - left_bound, j <= i + right_bound.
        for (index_t i = 0; i < nq; ++i) {
          ++rows[static_cast<std::size_t>(row[0] + i)];
          for (index_t j = 0; j < nk; ++j) {
            const bool in =
                (key.left_bound < 0 || j > i - key.left_bound) && (key.right_bound < 0 || j <= i + key.right_bound);
            if (in) ++seen[static_cast<std::size_t>((row[0] + i) * s.tokens + row[1] + j)];
          }
        }
      }
      // The last offset of each table bounds every entry's rows and lies within the tensor.
      for (int w = 0; w < 5; ++w) {
        const std::int64_t end = t.words[t.ragged(w) + g.size()];
        CHECK(end % per_token[w] == 0);
        CHECK(end / per_token[w] <= s.tokens);
        for (index_t e = 0; e < t.batch; ++e) {
          const std::int64_t first = t.words[t.ragged(w) + static_cast<std::size_t>(e)] / per_token[w];
          CHECK(first + (w == 0 || w == 3 || w == 4 ? t.count(0, e) : t.count(1, e)) <= end / per_token[w]);
        }
      }
    }
    for (index_t i = 0; i < s.tokens; ++i) {
      // Every query row is computed by exactly one entry (the graphs write each row once).
      CHECK(rows[static_cast<std::size_t>(i)] == 1);
      for (index_t j = 0; j < s.tokens; ++j)
        if (seen[static_cast<std::size_t>(i * s.tokens + j)] != (test::attn_visible(as, c, i, c, j) ? 1 : 0)) {
          INFO("query " << i << " key " << j);
          CHECK(seen[static_cast<std::size_t>(i * s.tokens + j)] == (test::attn_visible(as, c, i, c, j) ? 1 : 0));
        }
    }
  }
}

namespace {

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

template <class T>
std::vector<double> widen(const std::vector<T>& v) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<double>(static_cast<float>(v[i]));
  return out;
}

// |got - want| <= abs + rel * max|want| element by element (bf16 storage: 8 significant bits).
// A miss is named by (token, column) with `per_token` values per token; the first 12 are listed.
void require_close(const std::vector<double>& got, const std::vector<double>& want, double abs, double rel,
                   const char* what, std::size_t per_token) {
  REQUIRE(got.size() == want.size());
  double scale = 0;
  for (double w : want)
    if (std::isfinite(w)) scale = std::max(scale, std::abs(w));
  std::size_t bad = 0;
  std::ostringstream misses;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const bool ok = std::isinf(want[i]) ? got[i] == want[i] : std::abs(got[i] - want[i]) <= abs + rel * scale;
    if (!ok && bad++ < 12)
      misses << " (" << i / per_token << ", " << i % per_token << "): got " << got[i] << " want " << want[i] << ";";
  }
  INFO(what << ": " << bad << " of " << got.size() << " outside tolerance (scale " << scale
            << "); (token, column):" << misses.str());
  CHECK(bad == 0);
}

}  // namespace

TEMPLATE_TEST_CASE("attention::cudnn: forward and backward agree with the fp64 oracle, plan and convenience forms",
                   "[attention][cudnn][gpu]", loom::bfloat16, loom::half) {
  using S = TestType;
  using P = default_precision<S>;
  if (!have_gpu()) {
    WARN("no CUDA device: skipped");
    return;
  }
  const std::vector<std::int64_t> cu = {0, 1, 38, 38, 168, 423, 424, 625};
  const attention::shape s{625, 6, 2, 64, 64};
  const index_t n = s.tokens;
  const auto q0 = test::uniform<float>(n * s.heads_q * s.dim_qk, -1, 1, 1);
  const auto k0 = test::uniform<float>(n * s.heads_kv * s.dim_qk, -1, 1, 2);
  const auto v0 = test::uniform<float>(n * s.heads_kv * s.dim_v, -1, 1, 3);
  const auto g0 = test::uniform<float>(n * s.heads_q * s.dim_v, -1, 1, 4);
  auto to_storage = [](const std::vector<float>& x) {
    std::vector<S> y(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) y[i] = S(x[i]);
    return y;
  };
  const auto qh = to_storage(q0), kh = to_storage(k0), vh = to_storage(v0), gh = to_storage(g0);
  // Every buffer holds `tail` rows past the n tokens: NaN in the inputs (a read past the documents
  // would poison rows), a sentinel in the outputs (a write past them would change it).
  constexpr index_t tail = 64;
  const S nan(std::numeric_limits<float>::quiet_NaN()), sentinel(7.0f);
  auto padded = [&](std::vector<S> x, S fill) {
    x.resize(x.size() + static_cast<std::size_t>(tail) * (x.size() / static_cast<std::size_t>(n)), fill);
    return x;
  };
  auto outputs = [&](index_t per_row) {
    return padded(std::vector<S>(static_cast<std::size_t>(n * per_row), S(0.0f)), sentinel);
  };
  // The first `count` values widened, after checking that the rest still hold the sentinel.
  auto body = [&](const std::vector<S>& x, std::size_t count, const char* what) {
    std::size_t changed = 0;
    for (std::size_t i = count; i < x.size(); ++i) changed += static_cast<float>(x[i]) != 7.0f;
    INFO(what << ": values written past the last token");
    CHECK(changed == 0);
    return widen(std::vector<S>(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(count)));
  };
  test::buffer<S> q(padded(qh, nan)), k(padded(kh, nan)), v(padded(vh, nan)), dout(padded(gh, nan));
  test::buffer<std::int64_t> offsets(cu);
  const segments<cuda_memory> docs(
      tensor_view<const std::int64_t, 1, cuda_memory>(offsets.data(), {static_cast<index_t>(cu.size())}));
  const test::attn_coords c = test::packed(std::vector<index_t>(cu.begin(), cu.end()));
  const loom::cuda b{};
  const auto view3 = [](const test::buffer<S>& x, index_t t, index_t h, index_t d) {
    return test::view_of<S, 3>(x, {t, h, d});
  };
  const auto cview3 = [](const test::buffer<S>& x, index_t t, index_t h, index_t d) {
    return test::view_of<const S, 3>(x, {t, h, d});
  };
  for (const auto& opt : mask_cases()) {
    INFO("causal " << opt.causal << " window (" << opt.window.left << ", " << opt.window.right << ")");
    test::attn_shape as{n, n, s.heads_q, s.heads_kv, s.dim_qk, s.dim_v, opt.causal, opt.window, opt.scale};
    const auto want = test::attention_oracle(as, widen(qh), widen(kh), widen(vh), c, c, widen(gh));

    const auto p = attention::cudnn::make_plan<P>(b, docs, s, opt);
    test::workspace ws(std::max(p.workspace_bytes(), p.backward_workspace_bytes()));
    test::buffer<S> out(outputs(s.heads_q * s.dim_v));
    test::buffer<float> lse(std::vector<float>(static_cast<std::size_t>((n + tail) * s.heads_q), 7.0f));
    test::buffer<S> dq(outputs(s.heads_q * s.dim_qk)), dk(outputs(s.heads_kv * s.dim_qk)),
        dv(outputs(s.heads_kv * s.dim_v));
    attention::cudnn::forward(b, p, cview3(q, n, s.heads_q, s.dim_qk), cview3(k, n, s.heads_kv, s.dim_qk),
                              cview3(v, n, s.heads_kv, s.dim_v), view3(out, n, s.heads_q, s.dim_v),
                              test::view_of<float, 2>(lse, {n, s.heads_q}), ws.span());
    const auto out_h = body(out.to_host(), static_cast<std::size_t>(n * s.heads_q * s.dim_v), "out");
    const auto lse_f = lse.to_host();
    const std::vector<double> lse_h(lse_f.begin(), lse_f.begin() + n * s.heads_q);
    CHECK(std::count(lse_f.begin() + n * s.heads_q, lse_f.end(), 7.0f) == tail * s.heads_q);
    require_close(out_h, want.out, 1e-2, 1e-2, "out vs fp64", static_cast<std::size_t>(s.heads_q * s.dim_v));
    require_close(lse_h, want.lse, 1e-3, 2e-3, "lse vs fp64", static_cast<std::size_t>(s.heads_q));
    const auto run_backward = [&] {
      attention::cudnn::backward(b, p, cview3(q, n, s.heads_q, s.dim_qk), cview3(k, n, s.heads_kv, s.dim_qk),
                                 cview3(v, n, s.heads_kv, s.dim_v), cview3(out, n, s.heads_q, s.dim_v),
                                 test::view_of<const float, 2>(lse, {n, s.heads_q}),
                                 cview3(dout, n, s.heads_q, s.dim_v), view3(dq, n, s.heads_q, s.dim_qk),
                                 view3(dk, n, s.heads_kv, s.dim_qk), view3(dv, n, s.heads_kv, s.dim_v), ws.span());
    };
    if (!p.backward_supported()) {
      std::string reason;  // cuDNN's, as backward quotes it
      test::require_loom_error(
          [&] {
            try {
              run_backward();
            } catch (const loom::error& e) {
              reason = e.what();
              throw;
            }
          },
          errc::unsupported, {"attention::cudnn::backward", "no backward"});
      WARN("cuDNN has no backward for this plan on this device: only its rejection is checked (" << reason << ")");
      continue;
    }
    run_backward();
    const auto dq_h = body(dq.to_host(), qh.size(), "dq"), dk_h = body(dk.to_host(), kh.size(), "dk"),
               dv_h = body(dv.to_host(), vh.size(), "dv");
    require_close(dq_h, want.dq, 1e-2, 2e-2, "dq vs fp64", static_cast<std::size_t>(s.heads_q * s.dim_qk));
    require_close(dk_h, want.dk, 1e-2, 2e-2, "dk vs fp64", static_cast<std::size_t>(s.heads_kv * s.dim_qk));
    require_close(dv_h, want.dv, 1e-2, 2e-2, "dv vs fp64", static_cast<std::size_t>(s.heads_kv * s.dim_v));

    // The convenience forms (a plan and a workspace of their own, then a fence).
    test::buffer<S> out2(outputs(s.heads_q * s.dim_v)), dq2(outputs(s.heads_q * s.dim_qk));
    test::buffer<S> dk2(outputs(s.heads_kv * s.dim_qk)), dv2(outputs(s.heads_kv * s.dim_v));
    test::buffer<float> lse2(std::vector<float>(static_cast<std::size_t>((n + tail) * s.heads_q), 7.0f));
    attention::cudnn::forward(b, docs, cview3(q, n, s.heads_q, s.dim_qk), cview3(k, n, s.heads_kv, s.dim_qk),
                              cview3(v, n, s.heads_kv, s.dim_v), view3(out2, n, s.heads_q, s.dim_v),
                              test::view_of<float, 2>(lse2, {n, s.heads_q}), opt);
    attention::cudnn::backward(b, docs, cview3(q, n, s.heads_q, s.dim_qk), cview3(k, n, s.heads_kv, s.dim_qk),
                               cview3(v, n, s.heads_kv, s.dim_v), cview3(out2, n, s.heads_q, s.dim_v),
                               test::view_of<const float, 2>(lse2, {n, s.heads_q}), cview3(dout, n, s.heads_q, s.dim_v),
                               view3(dq2, n, s.heads_q, s.dim_qk), view3(dk2, n, s.heads_kv, s.dim_qk),
                               view3(dv2, n, s.heads_kv, s.dim_v), opt);
    require_close(body(out2.to_host(), static_cast<std::size_t>(n * s.heads_q * s.dim_v), "out"), want.out, 1e-2, 1e-2,
                  "convenience out vs fp64", static_cast<std::size_t>(s.heads_q * s.dim_v));
    require_close(body(dq2.to_host(), qh.size(), "dq"), want.dq, 1e-2, 2e-2, "convenience dq vs fp64",
                  static_cast<std::size_t>(s.heads_q * s.dim_qk));
    require_close(body(dk2.to_host(), kh.size(), "dk"), want.dk, 1e-2, 2e-2, "convenience dk vs fp64",
                  static_cast<std::size_t>(s.heads_kv * s.dim_qk));
    require_close(body(dv2.to_host(), vh.size(), "dv"), want.dv, 1e-2, 2e-2, "convenience dv vs fp64",
                  static_cast<std::size_t>(s.heads_kv * s.dim_v));
  }
}

TEST_CASE("attention::cudnn: the calls reject views and workspaces that do not fit the plan",
          "[attention][cudnn][gpu]") {
  if (!have_gpu()) {
    WARN("no CUDA device: skipped");
    return;
  }
  const std::vector<std::int64_t> cu = {0, 17, 40};
  const attention::shape s{40, 4, 2, 64, 64};
  test::buffer<std::int64_t> offsets(cu);
  const segments<cuda_memory> docs(
      tensor_view<const std::int64_t, 1, cuda_memory>(offsets.data(), {static_cast<index_t>(cu.size())}));
  const loom::cuda b{};
  const auto p = attention::cudnn::make_plan<loom::bf16>(b, docs, s);
  test::buffer<bfloat16> q(40 * 4 * 64), k(40 * 2 * 64), v(40 * 2 * 64), out(40 * 4 * 64);
  test::buffer<float> lse(40 * 4);
  test::workspace ws(p.workspace_bytes() + 64);
  auto qv = test::view_of<const bfloat16, 3>(q, {40, 4, 64});
  auto kv = test::view_of<const bfloat16, 3>(k, {40, 2, 64});
  auto vv = test::view_of<const bfloat16, 3>(v, {40, 2, 64});
  auto ov = test::view_of<bfloat16, 3>(out, {40, 4, 64});
  auto lv = test::view_of<float, 2>(lse, {40, 4});
  using test::require_loom_error;
  require_loom_error(
      [&] {
        attention::cudnn::forward(b, p, test::view_of<const bfloat16, 3>(q, {39, 4, 64}), kv, vv, ov, lv, ws.span());
      },
      errc::shape_mismatch, {"attention::cudnn::forward", "q"});
  // A strided view of the right extents: heads 2 apart in a [40, 8, 32] buffer is not dense.
  const tensor_view<const bfloat16, 3, cuda_memory> strided(q.data(), {40, 2, 64}, {4 * 64, 128, 1});
  require_loom_error([&] { attention::cudnn::forward(b, p, qv, strided, vv, ov, lv, ws.span()); },
                     errc::invalid_argument, {"attention::cudnn::forward", "k", "dense"});
  if (p.workspace_bytes() > 0) {
    require_loom_error([&] { attention::cudnn::forward(b, p, qv, kv, vv, ov, lv, ws.span(8)); }, errc::invalid_argument,
                       {"attention::cudnn::forward", "workspace"});
    require_loom_error(
        [&] { attention::cudnn::forward(b, p, qv, kv, vv, ov, lv, ws.span().first(p.workspace_bytes() - 1)); },
        errc::invalid_argument, {"attention::cudnn::forward", "workspace"});
  }
}
