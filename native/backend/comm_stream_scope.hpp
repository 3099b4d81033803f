// The stream switch of an async_op call (ep_backend/_streams.py, `_run`), in two crossings from
// Python instead of the dozen torch.cuda calls (current_stream, Stream.wait_stream, the
// torch.cuda.stream context, record_stream per tensor) that cost more host time than the op's own
// C++ on a cold host.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include <c10/core/Stream.h>

namespace ep {

// Makes `comm` the current stream of its device and returns the stream it replaced. With
// `wait_current`, `comm` first waits for the work queued so far on that stream (an event recorded
// there); without it the caller has made `comm` wait for what it must (previous_event).
c10::Stream enterCommStream(const c10::Stream& comm, bool wait_current);

// Undoes enterCommStream (`previous`: what it returned), then records `inputs` as used on `comm`
// and `outputs` as used on `previous` (ep_backend.record_stream of each), so the caching
// allocator reuses neither before the stream that reads it is done.
void exitCommStream(const c10::Stream& previous, const c10::Stream& comm,
                    const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs);

}  // namespace ep
