#pragma once

//! @file
//! How the slots of a launch share its work items. Host backends give a launch a counter that its
//! slots take items from, one at a time: a slot whose thread lost its core to another process then
//! delays the launch by the item it holds, not by its share of the items. Elsewhere (device code,
//! or no counter) slot s runs items s, s + slots, ... Either way each item computes alone, so the
//! bits of the results do not depend on which slot runs it.

#include <loom/backend/traits.hpp>
#include <loom/config.hpp>
#include <loom/core/tensor_view.hpp>

#include <atomic>

namespace loom::detail {

//! The item a slot takes next: the counter's value, advanced by one, where there is a counter
//! (host code), else `strided` (the slot's next item in the fixed order).
LOOM_HD inline index_t take_item(index_t* counter, index_t strided) {
#if !LOOM_IN_DEVICE_CODE
  if (counter) return std::atomic_ref<index_t>(*counter).fetch_add(1, std::memory_order_relaxed);
#else
  (void)counter;
#endif
  return strided;
}

//! Runs run(item) for every item [0, n) slot `slot` of `slots` takes (take_item).
template <class F>
LOOM_HD void take_items(index_t* counter, index_t slot, index_t slots, index_t n, const F& run) {
  for (index_t item = take_item(counter, slot); item < n; item = take_item(counter, item + slots)) run(item);
}

//! The shared item counter of one launch on backend B (host code): where B's memory is the host's
//! (its launches run there and complete on return) a counter from 0 that lives as long as this
//! object, else none (the slots keep the fixed order). One object per launch.
template <class B>
class launch_counter {
 public:
  [[nodiscard]] index_t* get() noexcept {
    if constexpr (backend_traits<B>::memory_space::host_accessible)
      return &value_;
    else
      return nullptr;
  }

 private:
  index_t value_ = 0;
};

}  // namespace loom::detail
