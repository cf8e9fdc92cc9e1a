// expect: the communicator cannot move buffers of the backend's memory space
// A cross-rank scan of stand-in (device) memory over comm::local, a communicator of host memory.
#include <loom/backend/standin.hpp>
#include <loom/comm/local.hpp>
#include <loom/scan/distributed.hpp>

void f(loom::comm::local& comm, loom::tensor_view<const float, 1, loom::standin_memory> in,
       loom::tensor_view<float, 1, loom::standin_memory> out) {
  loom::scan::inclusive_scan(loom::standin{}, comm, loom::scan::plus<float>{}, in, out);
}
