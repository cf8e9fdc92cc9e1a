#pragma once

//! @file
//! Chunked linear attention's forward and backward on loom::cuda through cuBLAS's strided-batched
//! products (tensor cores for bfloat16 and half storage), with loom's call shape:
//!
//!   auto plan = loom::linear_attention::cublas::make_plan<loom::bf16>(b, docs, {T, H, dk, dv}, {.chunk = 64});
//!   loom::temporary_buffer<loom::cuda, std::byte> ws(b, plan.workspace_bytes());   // or the caller's memory
//!   loom::linear_attention::cublas::forward(b, plan, gating, x, o, final_state, ws.bytes());   // allocates nothing
//!   loom::linear_attention::cublas::forward(b, docs, gating, x, o, final_state, opts);          // convenience
//!   loom::temporary_buffer<loom::cuda, std::byte> bws(b, plan.backward_workspace_bytes());
//!   loom::linear_attention::cublas::backward(b, plan, gating, x, d_o, d_final_state, g, bws.bytes());
//!   loom::linear_attention::cublas::backward(b, docs, gating, x, d_o, d_final_state, g, opts);   // convenience
//!
//! Compile with nvcc and link loom::cublas (the CUDA toolkit's cuBLAS). Inputs, gates, options and
//! results are those of loom::linear_attention::forward and backward (chunked.hpp): packed THD
//! layout, documents as loom::segments, no_decay / fixed_decay / scalar_gate (full decay
//! included), an initial and a final state per document and head; the backward's gradients of q,
//! k, v, the log-gates (scalar_gate) and the initial state (optional), from d o and an optional
//! d final state. Storage float, double, bfloat16 or half; accumulation float (double for double).
//!
//! How it runs (detail/gemm_engine.hpp): every (head, chunk) is one entry of strided batches of
//! C-row products (forward: the chunk states Ks^T V, the scores Q K^T, the inter-chunk term Q S0
//! and the masked P V; the backward recomputes those, then the chunks' adjoint sums, dO V^T and the
//! products of dq, dk and dv), with loom's LOOM_HD passes between them (gates, gather into a
//! zero-padded layout, the passes over chunk states and adjoints per document and head, mask and
//! scale, the gate gradient, scatter). The products read operands in the storage type (S0, the
//! adjoints and the masked scores rounded to it, as tensor cores take them) and accumulate in the
//! accumulation type; fp32 storage runs in fp32 unless the caller's cuBLAS math mode allows TF32.
//! The same engine runs on the CPU in loom's tests with a reference provider, against the fp64
//! oracle and (backward) loom's tiled backward.
//!
//! Plans: make_plan makes loom::linear_attention's plan (the chunk table; base(), which also runs
//! loom::linear_attention's own kernels) and a cuBLAS handle on the current device. A plan is
//! immutable and may be shared by threads (calls are serialised on its handle while they are
//! enqueued); calls must run with the plan's device current; the plan must outlive the stream work
//! of its calls. Workspace: plan.workspace_bytes() of device memory for the forward (the padded
//! operands, the chunk states and the scores: about H x T x (3 dk + dv + 2 C) elements plus
//! H x chunks x dk x dv states), plan.backward_workspace_bytes() for the backward (the forward's
//! and about H x T x (3 dk + 2 dv) elements more, plus H x chunks x dk x dv adjoints). Completion:
//! stream-ordered on b.stream, no host sync; the convenience forms fence.
//! On an H200 (docs/gpu.md, 2026-11-28, commit 29324c3) the forward's GPU test passed and the forward ran at 0.1-0.2 %
//! of the bf16 peak (loom.bench.cuda --linear), unprofiled. The backward has not run on a GPU (the last GPU
//! run, docs/gpu.md: NVIDIA H200, 2026-11-28, commit 29324c3, predates it): it is
//! tested on the CPU through the reference provider (and compiled by nvcc); its GPU test is written.

#include <loom/backend/cuda.hpp>
#include <loom/backend/detail/cublas_handle.hpp>
#include <loom/backend/detail/cuda_vendor.hpp>
#include <loom/backend/temporary.hpp>
#include <loom/core/error.hpp>
#include <loom/core/float16.hpp>
#include <loom/core/precision.hpp>
#include <loom/core/segments.hpp>
#include <loom/linear_attention/detail/gemm_engine.hpp>
#include <loom/linear_attention/plan.hpp>
#include <loom/linear_attention/types.hpp>

#include <cublas_v2.h>
#include <limits>
#include <memory>
#include <mutex>
#include <span>
#include <string_view>
#include <type_traits>

namespace loom::linear_attention::cublas {

namespace detail {

using linear_attention::detail::gemm_op;

using loom::detail::cuda_data_type;

template <class S>
inline constexpr bool storable = loom::detail::cuda_library_type<S>;

using loom::detail::check_cublas;

//! The engine's product provider: row-major c = alpha op(a) op(b) + beta c per batch entry as
//! cuBLAS's column-major c^T = op(b)^T op(a)^T (the operands swapped, the same op flags).
struct cublas_gemm {
  cublasHandle_t handle;
  std::string_view call;
  template <class TS, class TC>
  void operator()(gemm_op ta, gemm_op tb, index_t m, index_t n, index_t k, TC alpha, const TS* a, index_t lda,
                  index_t sa, const TS* b, index_t ldb, index_t sb, TC beta, TC* c, index_t ldc, index_t sc,
                  index_t batch) const {
    if (batch == 0 || m == 0 || n == 0) return;
    const auto op = [](gemm_op o) { return o == gemm_op::n ? CUBLAS_OP_N : CUBLAS_OP_T; };
    const cublasComputeType_t compute = std::is_same_v<TC, double> ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F;
    check_cublas(
        cublasGemmStridedBatchedEx(handle, op(tb), op(ta), static_cast<int>(n), static_cast<int>(m),
                                   static_cast<int>(k), &alpha, b, cuda_data_type<TS>(), static_cast<int>(ldb),
                                   static_cast<long long>(sb), a, cuda_data_type<TS>(), static_cast<int>(lda),
                                   static_cast<long long>(sa), &beta, c, cuda_data_type<TC>(), static_cast<int>(ldc),
                                   static_cast<long long>(sc), static_cast<int>(batch), compute, CUBLAS_GEMM_DEFAULT),
        call, "cublasGemmStridedBatchedEx");
  }
};

//! A plan's cuBLAS handle and the device it lives on.
struct state {
  explicit state(std::string_view call) : handle(call), device(loom::detail::current_cuda_device()) {}
  loom::detail::cublas_handle handle;
  int device;
  std::mutex enqueue;  // cublasSetStream and the call's products on the shared handle
  //! A call's entry: the device check, then the handle's stream set to b's under the lock, held
  //! (returned) while the call enqueues its products.
  std::unique_lock<std::mutex> enter(const loom::cuda& b, std::string_view call) {
    loom::detail::check_plan_device(device, call);
    std::unique_lock lock(enqueue);
    check_cublas(cublasSetStream(handle.get(), b.stream), call, "cublasSetStream");
    return lock;
  }
};

}  // namespace detail

//! A plan (see the file comment). P: loom::fp32, loom::fp64, loom::bf16, loom::fp16 (or any
//! precision<S, A> with S one of those and A the accumulation cuBLAS takes for it).
template <precision_policy P>
class plan {
  using S = typename P::storage_type;
  using A = typename P::accum_type;
  static_assert(detail::storable<S>, "linear_attention::cublas: storage float, double, bfloat16 or half");
  static_assert(std::is_same_v<A, std::conditional_t<std::is_same_v<S, double>, double, float>>,
                "linear_attention::cublas: accumulation float (double for double storage)");

 public:
  using precision = P;
  using backend_type = loom::cuda;
  //! loom::linear_attention's plan of the same documents and shape (its chunk table; loom's own
  //! kernels run with it).
  [[nodiscard]] const linear_attention::plan<P>& base() const noexcept { return base_; }
  [[nodiscard]] std::size_t workspace_bytes() const noexcept { return layout_.bytes; }
  [[nodiscard]] std::size_t backward_workspace_bytes() const noexcept { return backward_layout_.bytes; }
  [[nodiscard]] const linear_attention::detail::gemm_layout& layout() const noexcept { return layout_; }
  [[nodiscard]] const linear_attention::detail::gemm_backward_layout& backward_layout() const noexcept {
    return backward_layout_;
  }
  //! @throws loom::error(invalid_argument) for a plan not made by make_plan.
  [[nodiscard]] detail::state& device_state(std::string_view call) const {
    LOOM_EXPECTS(st_ != nullptr, errc::invalid_argument, call,
                 ": the plan was not made by linear_attention::cublas::make_plan (default-constructed)");
    return *st_;
  }

 private:
  linear_attention::plan<P> base_;
  linear_attention::detail::gemm_layout layout_;
  linear_attention::detail::gemm_backward_layout backward_layout_;
  std::shared_ptr<detail::state> st_;

  template <precision_policy Q, memory_space D>
  friend plan<Q> make_plan(const loom::cuda&, const segments<D>&, const shape&, const options&);
};

//! Plans the forward and backward of documents `docs` (as linear_attention::make_plan) on the
//! current device.
//! @throws as linear_attention::make_plan; loom::error(unsupported) for more than 2^31 - 1
//!   (head, chunk) pairs; (internal, unsupported) a failing CUDA or cuBLAS call.
template <precision_policy P = fp32, memory_space D = host_memory>
plan<P> make_plan(const loom::cuda& b, const segments<D>& docs, const shape& sh, const options& opt = {}) {
  constexpr std::string_view call = "linear_attention::cublas::make_plan";
  plan<P> p;
  p.base_ = linear_attention::make_plan<P>(b, docs, sh, opt);
  p.layout_ = linear_attention::detail::make_gemm_layout<typename P::storage_type, typename P::accum_type>(p.base_);
  p.backward_layout_ =
      linear_attention::detail::make_gemm_backward_layout<typename P::storage_type, typename P::accum_type>(p.base_);
  LOOM_EXPECTS(p.layout_.batch <= std::numeric_limits<int>::max(), errc::unsupported, call, ": ", p.layout_.batch,
               " (head, chunk) pairs; cuBLAS's batch count takes at most 2^31 - 1 (raise options.chunk)");
  p.st_ = std::make_shared<detail::state>(call);
  return p;
}

//! The forward (as linear_attention::forward) with a caller's workspace of plan.workspace_bytes()
//! device bytes, aligned to loom::workspace_alignment. Stream-ordered on b.stream; allocates nothing.
//! @throws as linear_attention::forward; loom::error(invalid_argument) for a plan not made by
//!   make_plan or a device other than the plan's; (internal, unsupported) cuBLAS failing.
template <precision_policy P, class Gating>
void forward(const loom::cuda& b, const plan<P>& p, const Gating& gating, const operands<P, cuda_memory>& x,
             tensor_view<typename P::storage_type, 3, cuda_memory> o,
             tensor_view<typename P::accum_type, 4, cuda_memory> final_state, std::span<std::byte> workspace) {
  constexpr std::string_view call = "linear_attention::cublas::forward";
  detail::state& st = p.device_state(call);
  const auto lock = st.enter(b, call);
  linear_attention::detail::gemm_forward(b, detail::cublas_gemm{st.handle.get(), call}, p.base(), p.layout(), gating, x,
                                         o, final_state, workspace, call);
}

//! The backward (as linear_attention::backward) with a caller's workspace of
//! plan.backward_workspace_bytes() device bytes, aligned to loom::workspace_alignment.
//! Stream-ordered on b.stream; allocates nothing.
//! @throws as linear_attention::backward; loom::error(invalid_argument) for a plan not made by
//!   make_plan or a device other than the plan's; (internal, unsupported) cuBLAS failing.
template <precision_policy P, class Gating>
void backward(const loom::cuda& b, const plan<P>& p, const Gating& gating, const operands<P, cuda_memory>& x,
              tensor_view<const typename P::storage_type, 3, cuda_memory> d_o,
              tensor_view<const typename P::accum_type, 4, cuda_memory> d_final_state,
              const gradients<P, cuda_memory>& g, std::span<std::byte> workspace) {
  constexpr std::string_view call = "linear_attention::cublas::backward";
  detail::state& st = p.device_state(call);
  const auto lock = st.enter(b, call);
  linear_attention::detail::gemm_backward(b, detail::cublas_gemm{st.handle.get(), call}, p.base(), p.backward_layout(),
                                          gating, x, d_o, d_final_state, g, workspace, call);
}

//! LASP-2's local steps on cuBLAS: lasp2::make_plan<P>(b, comm, cublas::batched{}, docs,
//! token_begin, slice, opts) (lasp2.hpp) makes a LASP-2 plan whose forward and backward run the
//! batched engine (gemm_engine.hpp) on its own cuBLAS handle: forward, the chunk states before the
//! exchange, document 0's again from the incoming state after it, then the outputs; backward,
//! gemm_backward on the slice (the segments' final states kept for the correction by the incoming
//! adjoint) before the exchange. Stream-ordered as lasp2::forward and lasp2::backward; the products
//! of a call are enqueued under the engine's lock (the forward holds it through the call's
//! exchange). The backward has not run on a GPU (docs/gpu.md: the H200 run of 2026-11-28, commit
//! 29324c3, predates it): tested on the CPU through the reference provider.
struct batched {
  template <class P>
  struct engine {
    static_assert(detail::storable<typename P::storage_type>,
                  "linear_attention::cublas: storage float, double, bfloat16 or half");
    linear_attention::detail::gemm_layout layout;
    linear_attention::detail::gemm_backward_layout backward_layout;
    std::shared_ptr<detail::state> st;

    static std::shared_ptr<const engine> make(const loom::cuda&, const linear_attention::plan<P>& pl,
                                              std::string_view call) {
      using S = typename P::storage_type;
      using A = typename P::accum_type;
      auto e = std::make_shared<engine>();
      e->layout = linear_attention::detail::make_gemm_layout<S, A>(pl);
      e->backward_layout = linear_attention::detail::make_gemm_backward_layout<S, A>(pl);
      LOOM_EXPECTS(e->layout.batch <= std::numeric_limits<int>::max(), errc::unsupported, call, ": ", e->layout.batch,
                   " (head, chunk) pairs; cuBLAS's batch count takes at most 2^31 - 1 (raise options.chunk)");
      e->st = std::make_shared<detail::state>(call);
      return e;
    }
    [[nodiscard]] std::size_t workspace_bytes() const noexcept { return layout.bytes; }
    [[nodiscard]] std::size_t backward_workspace_bytes() const noexcept { return backward_layout.bytes; }

    template <class Gating>
    void forward(const loom::cuda& b, const linear_attention::plan<P>& pl, const Gating& gating,
                 const operands<P, cuda_memory>& x, tensor_view<typename P::storage_type, 3, cuda_memory> o,
                 tensor_view<typename P::accum_type, 4, cuda_memory> fin, std::span<std::byte> ws,
                 std::string_view call) const {
      const auto lock = st->enter(b, call);
      linear_attention::detail::gemm_forward(b, detail::cublas_gemm{st->handle.get(), call}, pl, layout, gating, x, o,
                                             fin, ws, call);
    }
    template <class Gating, class Post, class Finish>
    bool forward_incoming(const loom::cuda& b, const linear_attention::plan<P>& pl, const Gating& gating,
                          const operands<P, cuda_memory>& x, tensor_view<typename P::storage_type, 3, cuda_memory> o,
                          tensor_view<typename P::accum_type, 4, cuda_memory> fin, std::span<std::byte> ws,
                          typename P::accum_type* end_state, linear_attention::detail::incoming_roles roles,
                          Post&& post, Finish&& finish, std::string_view call) const {
      const auto lock = st->enter(b, call);
      return linear_attention::detail::gemm_forward_incoming(
          b, detail::cublas_gemm{st->handle.get(), call}, pl, layout, gating, x, o, fin, ws, end_state, roles,
          std::forward<Post>(post), std::forward<Finish>(finish), call);
    }
    template <class Gating>
    void backward(const loom::cuda& b, const linear_attention::plan<P>& pl, const Gating& gating,
                  const operands<P, cuda_memory>& x, tensor_view<const typename P::storage_type, 3, cuda_memory> d_o,
                  tensor_view<const typename P::accum_type, 4, cuda_memory> dfin,
                  const gradients<P, cuda_memory>& grads, std::span<std::byte> ws, typename P::accum_type* fin_out,
                  std::string_view call) const {
      const auto lock = st->enter(b, call);
      linear_attention::detail::gemm_backward(b, detail::cublas_gemm{st->handle.get(), call}, pl, backward_layout,
                                              gating, x, d_o, dfin, grads, ws, call, fin_out);
    }
  };
};

//! Convenience form: make_plan (precision of the operands), a temporary workspace, the plan form,
//! fence.
template <memory_space D = host_memory, class Gating, precision_policy P>
void forward(const loom::cuda& b, const segments<D>& docs, const Gating& gating, const operands<P, cuda_memory>& x,
             tensor_view<typename P::storage_type, 3, cuda_memory> o,
             tensor_view<typename P::accum_type, 4, cuda_memory> final_state = {}, const options& opt = {}) {
  const auto p = make_plan<P>(b, docs, {x.q.extent(0), x.q.extent(1), x.q.extent(2), x.v.extent(2)}, opt);
  loom::detail::with_temporary_workspace(
      b, p.workspace_bytes(), [&](std::span<std::byte> ws) { forward(b, p, gating, x, o, final_state, ws); });
}

//! Convenience form of backward: make_plan (precision of the operands), a temporary workspace, the
//! plan form, fence.
template <memory_space D = host_memory, class Gating, precision_policy P>
void backward(const loom::cuda& b, const segments<D>& docs, const Gating& gating, const operands<P, cuda_memory>& x,
              tensor_view<const typename P::storage_type, 3, cuda_memory> d_o,
              tensor_view<const typename P::accum_type, 4, cuda_memory> d_final_state,
              const gradients<P, cuda_memory>& g, const options& opt = {}) {
  const auto p = make_plan<P>(b, docs, {x.q.extent(0), x.q.extent(1), x.q.extent(2), x.v.extent(2)}, opt);
  loom::detail::with_temporary_workspace(b, p.backward_workspace_bytes(), [&](std::span<std::byte> ws) {
    backward(b, p, gating, x, d_o, d_final_state, g, ws);
  });
}

}  // namespace loom::linear_attention::cublas
