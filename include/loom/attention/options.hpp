#pragma once

//! @file
//! Options and token coordinates of loom's exact attention.
//!
//! Layout: packed THD. q [Tq, Hq, Dqk], k [Tk, Hkv, Dqk], v [Tk, Hkv, Dv], out [Tq, Hq, Dv],
//! lse [Tq, Hq] in the accumulation type (float for float/bf16/fp16 storage, double for double).
//! Hq must be a multiple of Hkv (GQA/MQA: query head h reads kv head h / (Hq / Hkv)).
//!
//! Masks come from token coordinates: every token carries (document, position in its document).
//! A query (d, p) sees a key (d', p') iff d == d', and p' <= p when causal, and p - p' < window when
//! a window is set. Documents packed with cu_seqlens give coordinates (segment, offset); a shard
//! of a longer sequence keeps the global ones, which is how ring attention masks the blocks it
//! receives from other ranks.

#include <loom/core/memory_space.hpp>
#include <loom/core/tensor_view.hpp>

namespace loom::attention {

struct options {
  bool causal = true;
  index_t window = 0;  //!< > 0: a query sees only the `window` most recent positions (itself included)
  double scale = 0;    //!< softmax scale; 0 means 1 / sqrt(Dqk)
};

//! Per-token (document, position) of a set of tokens, in the memory space of the data.
template <class Space = host_memory>
struct coords {
  tensor_view<const index_t, 1, Space> doc{};
  tensor_view<const index_t, 1, Space> pos{};
};

}  // namespace loom::attention
