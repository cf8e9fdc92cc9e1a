#pragma once

//! @file
//! Local attention over packed documents on loom::cuda through cuDNN's fused attention (the cuDNN
//! frontend's SDPA graphs: tensor cores, flash-style tiling), with loom's call shape:
//!
//!   auto plan = loom::attention::cudnn::make_plan(b, docs, {tokens, heads_q, heads_kv, dim_qk, dim_v}, opts);
//!   loom::workspace_buffer<loom::cuda_memory> ws(...)  // max(plan.workspace_bytes(), plan.backward_workspace_bytes())
//!   loom::attention::cudnn::forward(b, plan, q, k, v, out, lse, ws.span());       allocates nothing
//!   loom::attention::cudnn::backward(b, plan, q, k, v, out, lse, dout, dq, dk, dv, ws.span());
//!   loom::attention::cudnn::forward(b, docs, q, k, v, out, lse, opts);            convenience
//!
//! Link loom::cudnn (present when CMake finds cuDNN and the cuDNN frontend's headers, e.g. from
//! the Python-registry package nvidia-cudnn-frontend). The inputs and results are those of
//! loom::attention::forward / backward on a segments plan (options.hpp: packed THD layout,
//! GQA/MQA, causal, FlashAttention's (left, right) window, lse = m + log l per row and head),
//! for bfloat16 or half storage with float lse; every view must be dense ([T, H, D] with strides
//! (H D, D, 1), lse (H, 1)).
//!
//! How it runs: make_plan derives from the document offsets (read to the host once, at plan time)
//! the fused blocks of detail/fused_blocks.hpp, one per document (its rows cropped to those that
//! see a key, its mask as cuDNN's top-left diagonal band), and groups blocks with the same bounds
//! into ragged batches. Each batch is one cuDNN graph (Q, K, V, O and lse addressed through
//! per-document ragged offsets and sequence lengths that the plan keeps in device memory), built
//! once when the plan is made and reused by every call; a call runs one graph per batch on the
//! backend's stream. Each distinct band is its own batch: a causal or unmasked layer is one (and
//! one more for one-token documents, which need no mask); a window shorter than some documents and
//! longer than others gives two or three.
//!
//! Plans: make_plan checks the arguments before touching the device (dims multiples of 8 and at
//! most 256, bfloat16 or half precision, window values >= -1, a finite scale > 0, offsets that
//! fit the token count, documents under 2^31 tokens), then creates a cuDNN handle on the current
//! device, the tables and the graphs; a configuration cuDNN does not support on this device is
//! loom::error(unsupported) naming cuDNN's reason (when only the backward is rejected, backward
//! raises it and the forward still runs). A plan is immutable and may be shared by threads (calls
//! on one plan are serialised on its handle while they are enqueued); calls must run with the
//! plan's device current. The plan owns its device tables and graphs and must outlive the stream
//! work of its calls; the offsets need not outlive make_plan.
//!
//! Workspace: cuDNN's own (the largest graph's), in device memory, on loom::workspace_alignment.
//! Completion: stream-ordered on b.stream, no host sync; the convenience forms fence.
//! Results: cuDNN's order of summation, not loom's. The [gpu] case of tests/attention/cudnn_test.cpp
//! compares them with the fp64 oracle at bfloat16 tolerances (docs/gpu.md: on an H200, 2026-11-28, commit 29324c3,
//! it found the s = 1 graphs' lse, see make_plan; the fix has not run on a GPU yet). The backward's
//! deterministic algorithm is not requested: by the
//! frontend's own checks, on sm_90 before cuDNN 9.25 it takes a workspace of batch x heads x Lq x
//! Lk x 2 bytes (by that formula 34 GB for one document of 32768 tokens and 16 heads), so dQ need
//! not repeat bit for bit.

#include <loom/attention/detail/fused_blocks.hpp>
#include <loom/attention/local.hpp>
#include <loom/backend/copy.hpp>
#include <loom/backend/cuda.hpp>
#include <loom/backend/detail/cuda_vendor.hpp>
#include <loom/core/error.hpp>
#include <loom/core/float16.hpp>
#include <loom/core/precision.hpp>
#include <loom/core/segments.hpp>
#include <loom/core/workspace.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cudnn.h>
#include <cudnn_frontend.h>
#include <initializer_list>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace loom::attention::cudnn {

//! Selects cuDNN's fused attention as the local step of a distributed attention plan
//! (ulysses_cudnn.cuh, ring_cudnn.cuh).
struct fused {};

namespace detail {

using attention::detail::block_kind;
using attention::detail::fused_block;
using attention::detail::fused_element;
using attention::detail::fused_pass;
using attention::detail::graph_key;

template <class T>
inline constexpr bool storable = std::is_same_v<T, bfloat16> || std::is_same_v<T, half>;

template <class T>
constexpr fused_element element_of() {
  return std::is_same_v<T, bfloat16> ? fused_element::bf16 : fused_element::fp16;
}

//! The checks make_plan makes before it touches the device (host-testable).
inline attention::detail::problem check_arguments(const shape& s, const options& opt, std::string_view call) {
  const attention::detail::problem pb = attention::detail::check_problem(s, opt, call);
  LOOM_EXPECTS(s.tokens_k < 0 || s.tokens_k == s.tokens, errc::invalid_argument, call,
               ": queries and keys are the same tokens (shape.tokens_k -1 or ", s.tokens, "), got ", s.tokens_k);
  for (const auto& [name, d] : {std::pair<std::string_view, index_t>{"dim_qk", s.dim_qk}, {"dim_v", s.dim_v}})
    LOOM_EXPECTS(d % 8 == 0 && d <= 256, errc::unsupported, call, ": cuDNN's fused attention needs shape.", name,
                 " a multiple of 8 and at most 256, got ", d, " (use loom::attention::forward for other dims)");
  return pb;
}

//! The blocks of self-attention over packed documents `cu` (host offsets, checked): one per
//! non-empty document (every row sees at least itself, so nothing is cropped away).
inline std::vector<fused_block> document_blocks(const segments<host_memory>& cu, const options& opt) {
  std::vector<fused_block> out;
  for (index_t d = 0; d < cu.count(); ++d) {
    const index_t n = cu.length(d);
    LOOM_EXPECTS(n <= std::numeric_limits<std::int32_t>::max(), errc::unsupported,
                 "attention::cudnn::make_plan: cuDNN's sequence lengths are int32: document ", d, " of segments has ",
                 n, " tokens");
    if (auto b = attention::detail::fuse_block(opt, 0, n, cu[d], 0, n, cu[d])) {
      b->document = d;
      out.push_back(*b);
    }
  }
  return out;
}

//! The ragged tables of a batch (fused_blocks.hpp): cuDNN reads them from device memory.
using tables = attention::detail::fused_tables;
using attention::detail::tables_of;

namespace fe = cudnn_frontend;

enum uid : std::int64_t {
  u_q = 1,
  u_k,
  u_v,
  u_o,
  u_lse,
  u_do,
  u_dq,
  u_dk,
  u_dv,
  u_rq,
  u_rk,
  u_rv,
  u_ro,
  u_rlse,
  u_len_q,
  u_len_k,
};

inline void check_fe(fe::error_t e, std::string_view call, std::string_view what) {
  if (e.is_bad())
    loom::detail::fail(errc::unsupported, loom::detail::concat(call, ": cuDNN ", what, ": ", e.get_message()), __FILE__,
                       __LINE__);
}
inline void check_cudnn(cudnnStatus_t st, std::string_view call, std::string_view what) {
  if (st != CUDNN_STATUS_SUCCESS)
    loom::detail::fail(errc::internal, loom::detail::concat(call, ": ", what, " failed: ", cudnnGetErrorString(st)),
                       __FILE__, __LINE__);
}

//! A built graph and its workspace bytes.
struct built {
  std::shared_ptr<fe::graph::Graph> graph;
  std::int64_t workspace = 0;
};

//! The graph of one ragged batch named by `key` (dims from the key, masks from its bounds).
inline built build_graph(cudnnHandle_t handle, const graph_key& key, fe::AttentionImplementation_t impl,
                         std::string_view call) {
  auto g = std::make_shared<fe::graph::Graph>();
  const auto io = key.element == fused_element::bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF;
  g->set_io_data_type(io)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const std::int64_t b = key.batch, hq = key.heads_q, hk = key.heads_kv, dk = key.dim_qk, dv = key.dim_v;
  const std::int64_t sq = key.max_q, sk = key.max_k;
  auto offsets = [&](std::int64_t id, const char* name) {
    return g->tensor(fe::graph::Tensor_attributes()
                         .set_name(name)
                         .set_uid(id)
                         .set_dim({b + 1, 1, 1, 1})
                         .set_stride({1, 1, 1, 1})
                         .set_data_type(fe::DataType_t::INT64));
  };
  auto lengths = [&](std::int64_t id, const char* name) {
    return g->tensor(fe::graph::Tensor_attributes()
                         .set_name(name)
                         .set_uid(id)
                         .set_dim({b, 1, 1, 1})
                         .set_stride({1, 1, 1, 1})
                         .set_data_type(fe::DataType_t::INT32));
  };
  // THD rows: [batch, heads, tokens, dim] with strides (-, dim, heads * dim, 1), each document
  // starting at its ragged offset.
  auto thd = [&](std::int64_t id, const char* name, std::int64_t h, std::int64_t s, std::int64_t d,
                 const std::shared_ptr<fe::graph::Tensor_attributes>& ragged) {
    return g->tensor(fe::graph::Tensor_attributes()
                         .set_name(name)
                         .set_uid(id)
                         .set_dim({b, h, s, d})
                         .set_stride({s * h * d, d, h * d, 1})
                         .set_ragged_offset(ragged));
  };
  const auto rq = offsets(u_rq, "ragged_q"), rk = offsets(u_rk, "ragged_k"), rv = offsets(u_rv, "ragged_v");
  const auto ro = offsets(u_ro, "ragged_o"), rl = offsets(u_rlse, "ragged_lse");
  const auto len_q = lengths(u_len_q, "seq_len_q"), len_k = lengths(u_len_k, "seq_len_kv");
  const auto q = thd(u_q, "q", hq, sq, dk, rq), k = thd(u_k, "k", hk, sk, dk, rk), v = thd(u_v, "v", hk, sk, dv, rv);
  const float scale = static_cast<float>(std::bit_cast<double>(key.scale_bits));
  auto band = [&](auto& a) {
    a.set_attn_scale(scale).set_padding_mask(true).set_seq_len_q(len_q).set_seq_len_kv(len_k);
    a.set_max_total_seq_len_q(key.total_q).set_max_total_seq_len_kv(key.total_k);
    a.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT);
    if (key.left_bound >= 0) a.set_diagonal_band_left_bound(static_cast<int>(key.left_bound));
    if (key.right_bound >= 0) a.set_diagonal_band_right_bound(static_cast<int>(key.right_bound));
  };
  if (key.pass == fused_pass::forward) {
    auto a = fe::graph::SDPA_attributes().set_name("loom_sdpa").set_generate_stats(true).set_implementation(impl);
    band(a);
    auto [o, lse] = g->sdpa(q, k, v, a);
    o->set_output(true).set_uid(u_o).set_dim({b, hq, sq, dv}).set_stride({sq * hq * dv, dv, hq * dv, 1});
    o->set_ragged_offset(ro);
    lse->set_output(true)
        .set_uid(u_lse)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim({b, hq, sq, 1})
        .set_stride({sq * hq, 1, hq, 1});
    lse->set_ragged_offset(rl);
  } else {
    const auto o = thd(u_o, "o", hq, sq, dv, ro), dout = thd(u_do, "dout", hq, sq, dv, ro);
    const auto lse = g->tensor(fe::graph::Tensor_attributes()
                                   .set_name("lse")
                                   .set_uid(u_lse)
                                   .set_dim({b, hq, sq, 1})
                                   .set_stride({sq * hq, 1, hq, 1})
                                   .set_data_type(fe::DataType_t::FLOAT)
                                   .set_ragged_offset(rl));
    auto a = fe::graph::SDPA_backward_attributes().set_name("loom_sdpa_backward");
    band(a);
    auto [dq, dk_, dv_] = g->sdpa_backward(q, k, v, o, dout, lse, a);
    dq->set_output(true).set_uid(u_dq).set_dim({b, hq, sq, dk}).set_stride({sq * hq * dk, dk, hq * dk, 1});
    dq->set_ragged_offset(rq);
    dk_->set_output(true).set_uid(u_dk).set_dim({b, hk, sk, dk}).set_stride({sk * hk * dk, dk, hk * dk, 1});
    dk_->set_ragged_offset(rk);
    dv_->set_output(true).set_uid(u_dv).set_dim({b, hk, sk, dv}).set_stride({sk * hk * dv, dv, hk * dv, 1});
    dv_->set_ragged_offset(rv);
  }
  check_fe(g->validate(), call, "graph validation");
  check_fe(g->build_operation_graph(handle), call, "operation graph");
  check_fe(g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), call, "execution plans");
  check_fe(g->check_support(handle), call, "support check");
  check_fe(g->build_plans(handle), call, "plan build");
  built out{g, 0};
  check_fe(g->get_workspace_size(out.workspace), call, "workspace size");
  return out;
}

//! build_graph with cuDNN's own choice of implementation; a forward it rejects is tried again
//! with the composite implementation before the plan gives up (both reasons quoted).
inline built build_any(cudnnHandle_t handle, const graph_key& key, std::string_view call) {
  if (key.pass == fused_pass::backward) return build_graph(handle, key, fe::AttentionImplementation_t::AUTO, call);
  try {
    return build_graph(handle, key, fe::AttentionImplementation_t::AUTO, call);
  } catch (const loom::error& first) {
    if (first.code() != errc::unsupported) throw;
    try {
      return build_graph(handle, key, fe::AttentionImplementation_t::COMPOSITE, call);
    } catch (const loom::error& second) {
      if (second.code() != errc::unsupported) throw;
      loom::detail::fail(errc::unsupported,
                         loom::detail::concat(first.what(), "; with the composite implementation: ", second.what()),
                         __FILE__, __LINE__);
    }
  }
}

//! One ragged batch: its graphs and its variant pack (every uid of either graph: the device
//! pointers of the batch's tables, filled by make_plan; the views', set by each call under the
//! plan's lock, so a call inserts nothing and allocates nothing).
struct batch {
  std::shared_ptr<built> forward, backward;
  std::unordered_map<std::int64_t, void*> pack;
};

//! The cuDNN handle and the device tables of a plan, released after its graphs (a member declared
//! before them). cudaFree waits for the device's work in flight.
struct device_resources {
  cudnnHandle_t handle = nullptr;
  std::int64_t* device_tables = nullptr;
  int device = -1;  // the device current at make_plan
  device_resources() = default;
  device_resources(const device_resources&) = delete;
  device_resources& operator=(const device_resources&) = delete;
  ~device_resources() {
    if (device_tables) cudaFree(device_tables);
    if (handle) cudnnDestroy(handle);
  }
};

//! What a plan owns on the device: the cuDNN handle, the tables, the graphs.
struct state : device_resources {
  std::vector<batch> batches;
  attention::detail::graph_cache<built> cache;
  std::mutex enqueue;                // cudnnSetStream + execute on the shared handle
  std::string backward_unsupported;  // why cuDNN cannot run the backward here (empty: it can)
};

//! Builds (or takes from st.cache) the forward and backward graphs of each group of blocks as one
//! ragged batch and appends the batches to st, their variant packs holding every uid (null until
//! set). Graphs are built for each batch exactly: its entry count, its largest block (at least
//! 2 on each side, see below) and the packed token counts total_q / total_k the tables may
//! address. A backward cuDNN rejects is recorded in st.backward_unsupported (the forward still
//! runs). Returns the workspace bytes of the forward and of the backward, rounded.
inline std::pair<std::size_t, std::size_t> add_batches(state& st, const std::vector<std::vector<fused_block>>& groups,
                                                       const head_shape& hs, double scale, fused_element element,
                                                       index_t total_q, index_t total_k, std::string_view call) {
  auto build = [&](const graph_key& k) { return build_any(st.handle, k, call); };
  std::int64_t fwd = 0, bwd = 0;
  for (const auto& g : groups) {
    auto key = attention::detail::key_of(fused_pass::forward, element, hs, scale, g);
    key.batch = static_cast<index_t>(g.size());
    // At least 2 on each side: cuDNN takes s_q = s_kv = 1 (a batch of one-token documents) to a
    // kernel that, measured on an H200 with cuDNN 9.19 (docs/gpu.md, 2026-11-28, commit 29324c3), writes the lse of
    // only the first query head of each kv group, and it has no backward for it; one-token entries of a graph sized 2
    // are padded entries like any shorter document of a batch. (A sequence of one token in all
    // still gets s = 1: its lse is exact only where each kv head serves one query head.)
    key.max_q = std::min<index_t>(2, total_q);
    key.max_k = std::min<index_t>(2, total_k);
    for (const auto& blk : g) {
      LOOM_EXPECTS(blk.q_count <= std::numeric_limits<std::int32_t>::max() &&
                       blk.k_count <= std::numeric_limits<std::int32_t>::max(),
                   errc::unsupported, call, ": cuDNN's sequence lengths are int32: a block of ", blk.q_count,
                   " queries and ", blk.k_count, " keys");
      key.max_q = std::max(key.max_q, blk.q_count), key.max_k = std::max(key.max_k, blk.k_count);
    }
    key.total_q = total_q;
    key.total_k = total_k;
    batch& bt = st.batches.emplace_back();
    for (std::int64_t uid = u_q; uid <= u_len_k; ++uid) bt.pack[uid] = nullptr;
    bt.forward = st.cache.get(key, build);
    fwd = std::max(fwd, bt.forward->workspace);
    if (!st.backward_unsupported.empty()) continue;
    key.pass = fused_pass::backward;
    try {  // a device where cuDNN rejects only the backward still runs the forward
      bt.backward = st.cache.get(key, build);
      bwd = std::max(bwd, bt.backward->workspace);
    } catch (const loom::error& e) {
      if (e.code() != errc::unsupported) throw;
      st.backward_unsupported = e.what();
    }
  }
  return {workspace_round(static_cast<std::size_t>(fwd)), workspace_round(static_cast<std::size_t>(bwd))};
}

}  // namespace detail

//! A plan of cuDNN fused attention over packed documents (see the file comment). P: loom::bf16
//! or loom::fp16.
template <precision_policy P>
class plan : public precision_types<P> {
  static_assert(detail::storable<typename P::storage_type>,
                "attention::cudnn: the fused kernels take bfloat16 or half storage (loom::bf16, loom::fp16)");

 public:
  using backend_type = loom::cuda;
  [[nodiscard]] const shape& dims() const noexcept { return shape_; }
  [[nodiscard]] const options& opts() const noexcept { return opt_; }
  [[nodiscard]] float scale() const noexcept { return scale_; }
  //! The checked problem (extents and mask) for loom's own callers.
  [[nodiscard]] const attention::detail::problem& problem() const noexcept { return pb_; }
  //! False when cuDNN cannot run this plan's backward on this device (backward says why).
  [[nodiscard]] bool backward_supported() const noexcept { return !st_ || st_->backward_unsupported.empty(); }
  //! Ragged batches (cuDNN graph runs) per call.
  [[nodiscard]] std::size_t batches() const noexcept { return st_ ? st_->batches.size() : 0; }
  [[nodiscard]] std::size_t workspace_bytes() const noexcept { return fwd_bytes_; }
  [[nodiscard]] std::size_t backward_workspace_bytes() const noexcept { return bwd_bytes_; }
  //! The state (handle, tables, graphs) for loom's own callers.
  //! @throws loom::error(invalid_argument) for a plan not made by make_plan (default-constructed).
  [[nodiscard]] detail::state& device_state(std::string_view call) const {
    LOOM_EXPECTS(st_ != nullptr, errc::invalid_argument, call,
                 ": the plan was not made by attention::cudnn::make_plan (default-constructed)");
    return *st_;
  }

 private:
  shape shape_{};
  options opt_{};
  attention::detail::problem pb_{};
  float scale_ = 0;
  std::shared_ptr<detail::state> st_;
  std::size_t fwd_bytes_ = 0, bwd_bytes_ = 0;

  template <precision_policy Q, memory_space S>
  friend plan<Q> make_plan(const loom::cuda&, const segments<S>&, const shape&, const options&);
};

//! Plans fused attention over the documents `docs` (int32 or int64 offsets, device or host
//! memory, bound to shape.tokens). @throws loom::error(invalid_argument / shape_mismatch) for the
//! shape, options or offsets (as attention::make_plan); (unsupported) for dims cuDNN's fused
//! kernels do not take, and for a configuration cuDNN rejects on this device (its reason
//! quoted); (internal) for a failing CUDA or cuDNN call.
template <precision_policy P = bf16, memory_space Space>
plan<P> make_plan(const loom::cuda& b, const segments<Space>& docs, const shape& s, const options& opt = {}) {
  constexpr std::string_view call = "attention::cudnn::make_plan";
  const attention::detail::problem pb = detail::check_arguments(s, opt, call);
  const std::vector<detail::fused_block> blocks =
      loom::detail::with_host_segments(b, docs, [&](const segments<host_memory>& h) {
        return detail::document_blocks(check_segments(h, s.tokens, call, "segments"), opt);
      });
  plan<P> p;
  p.shape_ = s;
  p.opt_ = opt;
  p.pb_ = pb;
  p.scale_ = attention::detail::scale_of<float>(opt, s.dim_qk);
  p.st_ = std::make_shared<detail::state>();
  detail::state& st = *p.st_;
  const auto groups = attention::detail::batches_of(blocks);
  if (groups.empty()) return p;  // no tokens: nothing to run
  st.device = loom::detail::current_cuda_device();
  detail::check_cudnn(cudnnCreate(&st.handle), call, "cudnnCreate");
  // Every batch's tables in one device buffer, each batch's on a 256-byte boundary.
  std::vector<std::int64_t> host;
  std::vector<std::size_t> at;
  for (const auto& g : groups) {
    at.push_back(host.size());
    const detail::tables t = detail::tables_of(g, s);
    host.insert(host.end(), t.words.begin(), t.words.end());
  }
  LOOM_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&st.device_tables), host.size() * sizeof(std::int64_t)));
  LOOM_CUDA_TRY(cudaMemcpy(st.device_tables, host.data(), host.size() * sizeof(std::int64_t), cudaMemcpyHostToDevice));
  const head_shape hs{s.heads_q, s.heads_kv, s.dim_qk, s.dim_v};
  const auto [fwd, bwd] = detail::add_batches(st, groups, hs, static_cast<double>(p.scale_),
                                              detail::element_of<typename P::storage_type>(), s.tokens, s.tokens, call);
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const detail::tables layout{static_cast<index_t>(groups[i].size()), {}};
    std::int64_t* t = st.device_tables + at[i];
    auto& pack = st.batches[i].pack;
    for (int w = 0; w < 5; ++w) pack[detail::u_rq + w] = t + layout.ragged(w);
    pack[detail::u_len_q] = t + layout.lengths(0);
    pack[detail::u_len_k] = t + layout.lengths(1);
  }
  p.fwd_bytes_ = fwd;
  p.bwd_bytes_ = bwd;
  return p;
}

namespace detail {

using attention::detail::expect_dense;

template <class P, class... V>
constexpr void expect_storage() {
  static_assert((std::is_same_v<std::remove_cv_t<typename V::value_type>, typename P::storage_type> && ...),
                "attention::cudnn: q, k, v, out and the gradients hold the plan's storage type");
}

//! The checks forward and backward share: element types, then extents and dense strides of q, k,
//! v, out and lse.
template <class P, class Q, class K, class V, class O, class L>
void check_inputs(const attention::detail::problem& pb, const Q& q, const K& k, const V& v, const O& out, const L& lse,
                  std::string_view call) {
  expect_storage<P, Q, K, V, O>();
  attention::detail::check_lse<P, L>();
  attention::detail::check_views(pb, q, k, v, out, lse, call);
  expect_dense(q, call, "q"), expect_dense(k, call, "k"), expect_dense(v, call, "v");
  expect_dense(out, call, "out"), expect_dense(lse, call, "lse");
}

//! A view's data as the untyped pointer of cuDNN's variant pack.
template <class V>
void* address(const V& v) {
  return const_cast<void*>(static_cast<const void*>(v.data()));
}

//! The device current at the call must be the plan's (its handle, tables and graphs live there).
inline void check_device(const state& st, std::string_view call) {
  if (st.handle == nullptr) return;  // a plan of no tokens runs nothing
  loom::detail::check_plan_device(st.device, call);
}

//! Executes one batch's graph of `pass` on b.stream with the call's pointers (uid, pointer); the
//! caller holds st.enqueue and has set the handle's stream.
inline void run_batch(state& st, batch& bt, fused_pass pass,
                      std::initializer_list<std::pair<std::int64_t, void*>> views, std::span<std::byte> ws,
                      std::string_view call) {
  for (const auto& [uid, ptr] : views) bt.pack.at(uid) = ptr;
  const built& g = pass == fused_pass::forward ? *bt.forward : *bt.backward;
  check_fe(g.graph->execute(st.handle, bt.pack, ws.data()), call, "execute");
}

//! Executes every batch's graph of `pass` on b.stream with the call's views (uid, pointer).
inline void run(state& st, const loom::cuda& b, fused_pass pass,
                std::initializer_list<std::pair<std::int64_t, void*>> views, std::span<std::byte> ws,
                std::string_view call) {
  if (st.batches.empty()) return;  // a plan of no tokens
  std::lock_guard lock(st.enqueue);
  check_cudnn(cudnnSetStream(st.handle, b.stream), call, "cudnnSetStream");
  for (auto& bt : st.batches) run_batch(st, bt, pass, views, ws, call);
}

}  // namespace detail

//! Forward: out [T, Hq, Dv] and lse [T, Hq] (float) of the plan's documents. Stream-ordered,
//! allocates nothing. `workspace`: plan.workspace_bytes() of device memory, aligned.
//! @throws loom::error(shape_mismatch) views not of the plan's extents; (invalid_argument) views
//! not dense, a short or misaligned workspace; (unsupported) cuDNN failing to run a graph.
template <precision_policy P, class Q, class K, class V, class O, class L>
void forward(const loom::cuda& b, const plan<P>& p, Q q, K k, V v, O out, L lse, std::span<std::byte> workspace) {
  constexpr std::string_view call = "attention::cudnn::forward";
  detail::state& st = p.device_state(call);
  detail::check_inputs<P>(p.problem(), q, k, v, out, lse, call);
  check_workspace(workspace, p.workspace_bytes(), call);
  detail::check_device(st, call);
  detail::run(st, b, detail::fused_pass::forward,
              {{detail::u_q, detail::address(q)},
               {detail::u_k, detail::address(k)},
               {detail::u_v, detail::address(v)},
               {detail::u_o, detail::address(out)},
               {detail::u_lse, detail::address(lse)}},
              workspace, call);
}

//! Backward: dq, dk, dv (overwritten) from the forward's out and lse and dout. Stream-ordered,
//! allocates nothing. `workspace`: plan.backward_workspace_bytes(). @throws as forward.
template <precision_policy P, class Q, class K, class V, class O, class L, class DO, class DQ, class DK, class DV>
void backward(const loom::cuda& b, const plan<P>& p, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk, DV dv,
              std::span<std::byte> workspace) {
  constexpr std::string_view call = "attention::cudnn::backward";
  detail::state& st = p.device_state(call);
  detail::check_inputs<P>(p.problem(), q, k, v, out, lse, call);
  detail::expect_storage<P, DO, DQ>();
  attention::detail::check_gradients(p.problem(), dout, dq, dk, dv, call);
  detail::expect_dense(dout, call, "dout"), detail::expect_dense(dq, call, "dq");
  detail::expect_dense(dk, call, "dk"), detail::expect_dense(dv, call, "dv");
  detail::check_device(st, call);
  LOOM_EXPECTS(st.backward_unsupported.empty(), errc::unsupported, call,
               ": cuDNN has no backward for this plan on this device (", st.backward_unsupported,
               "); loom::attention::backward runs it");
  check_workspace(workspace, p.backward_workspace_bytes(), call, "plan.backward_workspace_bytes()");
  detail::run(st, b, detail::fused_pass::backward,
              {{detail::u_q, detail::address(q)},
               {detail::u_k, detail::address(k)},
               {detail::u_v, detail::address(v)},
               {detail::u_o, detail::address(out)},
               {detail::u_lse, detail::address(lse)},
               {detail::u_do, detail::address(dout)},
               {detail::u_dq, detail::address(dq)},
               {detail::u_dk, detail::address(dk)},
               {detail::u_dv, detail::address(dv)}},
              workspace, call);
}

//! Convenience forward: make_plan (precision from q), a temporary workspace, the plan form, fence.
template <memory_space Space, class Q, class K, class V, class O, class L>
void forward(const loom::cuda& b, const segments<Space>& docs, Q q, K k, V v, O out, L lse, const options& opt = {}) {
  const auto p = make_plan<default_precision<std::remove_cv_t<typename Q::value_type>>>(
      b, docs, attention::detail::shape_of(q, k, v), opt);
  loom::detail::with_temporary_workspace(b, p.workspace_bytes(),
                                         [&](std::span<std::byte> ws) { forward(b, p, q, k, v, out, lse, ws); });
}

//! Convenience backward.
template <memory_space Space, class Q, class K, class V, class O, class L, class DO, class DQ, class DK, class DV>
void backward(const loom::cuda& b, const segments<Space>& docs, Q q, K k, V v, O out, L lse, DO dout, DQ dq, DK dk,
              DV dv, const options& opt = {}) {
  const auto p = make_plan<default_precision<std::remove_cv_t<typename Q::value_type>>>(
      b, docs, attention::detail::shape_of(q, k, v), opt);
  loom::detail::with_temporary_workspace(b, p.backward_workspace_bytes(), [&](std::span<std::byte> ws) {
    backward(b, p, q, k, v, out, lse, dout, dq, dk, dv, ws);
  });
}

}  // namespace loom::attention::cudnn
