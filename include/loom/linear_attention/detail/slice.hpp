#pragma once

//! @file
//! One rank's slice [begin, end) of a packed sequence under LASP-2: its local segments (the slice
//! cut at document starts), the global document of each, and which documents' final state and
//! initial-state gradient the rank owns.

#include <loom/core/error.hpp>
#include <loom/core/tensor_view.hpp>

#include <algorithm>
#include <span>
#include <vector>

namespace loom::linear_attention::detail {

struct slice_info {
  index_t begin = 0, end = 0, tokens = 0;
  std::vector<index_t> local_cu;                  //!< segment offsets, relative to begin
  std::vector<index_t> seg_doc;                   //!< global document of each segment
  bool continues_left = false;                    //!< segment 0 continues a document begun on an earlier rank
  bool continues_right = false;                   //!< the last segment's document goes on past `end`
  std::vector<index_t> owned_final, owned_start;  //!< documents whose final state / d initial state this rank writes

  index_t segments() const { return static_cast<index_t>(seg_doc.size()); }
};

inline slice_info make_slice(std::span<const index_t> cu, index_t begin, index_t tokens, int rank, int ranks) {
  const index_t total = cu.back(), docs = static_cast<index_t>(cu.size()) - 1;
  LOOM_EXPECTS(begin >= 0 && tokens >= 0 && begin + tokens <= total, errc::invalid_argument,
               "token_begin: expected the slice [", begin, ", ", begin + tokens, ") inside [0, ", total, ")");
  LOOM_EXPECTS(rank != 0 || begin == 0, errc::invalid_argument,
               "token_begin: expected rank 0 to start at token 0, got ", begin);
  LOOM_EXPECTS(rank != ranks - 1 || begin + tokens == total, errc::invalid_argument,
               "token_begin: expected the last rank's slice to end at token ", total, ", got ", begin + tokens);
  slice_info s;
  s.begin = begin, s.end = begin + tokens, s.tokens = tokens;
  // The document holding token t: the last d with cu[d] <= t (so empty documents are skipped).
  auto doc_of = [&](index_t t) {
    return static_cast<index_t>(std::upper_bound(cu.begin(), cu.end(), t) - cu.begin()) - 1;
  };
  if (tokens > 0) {
    index_t d = doc_of(begin);
    s.continues_left = cu[static_cast<std::size_t>(d)] < begin;
    s.local_cu.push_back(0);
    s.seg_doc.push_back(d);
    for (index_t e = d + 1; e < docs && cu[static_cast<std::size_t>(e)] < s.end; ++e)
      if (cu[static_cast<std::size_t>(e) + 1] > cu[static_cast<std::size_t>(e)]) {
        s.local_cu.push_back(cu[static_cast<std::size_t>(e)] - begin);
        s.seg_doc.push_back(e);
      }
    s.local_cu.push_back(tokens);
    s.continues_right = cu[static_cast<std::size_t>(s.seg_doc.back()) + 1] > s.end;
  } else {
    s.local_cu = {0, 0};
    s.seg_doc = {-1};  // one empty segment, owned by nobody
  }
  for (index_t d = 0; d < docs; ++d) {
    const index_t b = cu[static_cast<std::size_t>(d)], e = cu[static_cast<std::size_t>(d) + 1];
    if (b == e) {
      if ((begin <= b && b < s.end) || (b == total && rank == ranks - 1)) {
        s.owned_final.push_back(d);
        s.owned_start.push_back(d);
      }
      continue;
    }
    if (begin < e && e <= s.end) s.owned_final.push_back(d);
    if (begin <= b && b < s.end) s.owned_start.push_back(d);
  }
  return s;
}

}  // namespace loom::linear_attention::detail
