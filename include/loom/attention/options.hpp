#pragma once

//! @file
//! Shapes, options and token coordinates of loom's exact attention.
//!
//! Layout: packed THD. q [Tq, Hq, Dqk], k [Tk, Hkv, Dqk], v [Tk, Hkv, Dv], out [Tq, Hq, Dv],
//! lse [Tq, Hq] in the accumulation type (float for float/bf16/fp16 storage, double for double).
//! Hq must be a multiple of Hkv (GQA/MQA: query head h reads kv head h / (Hq / Hkv)).
//!
//! Masks come from token coordinates: every token carries (document, position in its document).
//! A query (d, i) sees a key (d', j) iff d == d' and, FlashAttention's window_size = (left, right),
//!
//!   i - left <= j <= i + right      (left = -1 or right = -1: unbounded on that side)
//!
//! and, when causal, j <= i. So window {w, 0} (FlashAttention's (w, 0)) covers w + 1 keys, the
//! query's own included; {w, w} is symmetric; {-1, w} looks w keys ahead (with causal = false).
//! Documents packed with loom::segments give coordinates (segment, offset); a shard of a longer
//! sequence keeps the global ones, which is how ring attention masks the blocks it receives from
//! other ranks.

#include <loom/core/memory_space.hpp>
#include <loom/core/tensor_view.hpp>

#include <cstdint>
#include <optional>

namespace loom::attention {

//! FlashAttention's (left, right) window, in positions within a document; -1: unbounded.
struct window_size {
  index_t left = -1;
  index_t right = -1;
};

struct options {
  bool causal = true;
  window_size window{};         //!< see the file comment; values below -1 are rejected
  std::optional<double> scale;  //!< softmax scale (finite, > 0); none: 1 / sqrt(Dqk)
};

//! Tokens, heads and head dims of one local attention problem. keys() is tokens_k, or tokens
//! when tokens_k is -1 (queries and keys are the same tokens).
struct shape {
  index_t tokens = 0;  //!< query tokens Tq
  index_t heads_q = 0, heads_kv = 0, dim_qk = 0, dim_v = 0;
  index_t tokens_k = -1;  //!< key tokens Tk; -1: the same as tokens
  [[nodiscard]] constexpr index_t keys() const noexcept { return tokens_k < 0 ? tokens : tokens_k; }
};

//! Heads and head dims of a distributed attention layer (the tokens come from a shard::plan).
struct head_shape {
  index_t heads_q = 0, heads_kv = 0, dim_qk = 0, dim_v = 0;
};

//! Per-token (document, position) of a set of tokens, in the memory space of the data.
template <class Space = host_memory>
struct coords {
  tensor_view<const index_t, 1, Space> doc{};
  tensor_view<const index_t, 1, Space> pos{};
};

namespace detail {
//! The options as plain words without padding, for digests and cross-rank signatures (an
//! std::optional holds padding bytes, which must not be hashed).
struct options_words {
  std::int64_t causal, left, right;
  double scale;  //!< 0: the default 1 / sqrt(Dqk)
};
inline options_words words_of(const options& o) noexcept {
  return {o.causal ? 1 : 0, o.window.left, o.window.right, o.scale.value_or(0.0)};
}
}  // namespace detail

}  // namespace loom::attention
