#pragma once

//! @file
//! The shard planner of the attention module. Attention and the packers share one planner
//! (loom/packing/cp_shard.hpp): loom::shard::make_plan(cu_seqlens, P, shard::contiguous{} |
//! shard::zigzag{} | shard::per_document{}) gives, per rank, the token pieces, local cu_seqlens and
//! the maps between global and local positions that ring attention, Ulysses and the linear-attention
//! scans consume. This header exists so that attention code includes it under its own module.

#include <loom/packing/cp_shard.hpp>
