// Internal: the compute threads behind parallel_for.
//
// Note [Compute pool]: kernels split large work over the cores. Starting a
// thread per part and call costs tens of microseconds each time (about 3% of
// a Mixture-of-Experts step, which runs thousands of sub-millisecond
// kernels), so the parts run on hardware_concurrency() - 1 persistent threads
// plus the caller. Idle workers block on a condition variable: they never
// spin, so they take no core from I/O threads or other libraries between
// kernels. One parallel region runs at a time; a second caller, a call from
// inside a region (a worker or the caller's own part), and any call in a
// child after fork() run every part on the calling thread instead.
#pragma once

#include <cstdint>

namespace sw::detail {

// Calls part(i) for every i in [0, parts), part 0 on the calling thread, and
// returns when all have finished. `part` must not throw.
void run_parts(int64_t parts, void (*part)(void* ctx, int64_t i), void* ctx);

// Threads the pool can run parts on at once (the caller included).
int64_t compute_threads();

}  // namespace sw::detail
