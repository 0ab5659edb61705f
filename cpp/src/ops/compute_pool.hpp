// Internal: the compute threads behind parallel_for.
//
// Note [Compute pool]: kernels split large work over the cores. Starting a
// thread per part and call costs tens of microseconds each time (about 3% of
// a Mixture-of-Experts step, which runs thousands of sub-millisecond
// kernels), so the parts run on hardware_concurrency() - 1 persistent threads
// plus the caller. One parallel region runs at a time; a second caller, a call
// from inside a region (a worker or the caller's own part), and any call in a
// child after fork() run every part on the calling thread instead.
//
// Between regions an idle worker spins for a short while (200 microseconds
// unless set_compute_spin_us says otherwise) before it sleeps on a condition
// variable, and so does a caller whose parts finished before a worker's. A
// Mixture-of-Experts step runs its products back to back, a few tens of
// microseconds apart: with workers that slept at once, every region paid a
// futex wake-up on the caller's side and a scheduler wake-up (tens of
// microseconds on a virtual machine) before the worker took its half, and
// the caller then often took that half itself (measured: about 1.2 s of the
// caller's 10 s asleep in those waits, 5-8% of the step's time). The spin is
// bounded, unlike a BLAS library's or an OpenMP runtime's long spin, so
// workers still leave the cores to I/O threads and other libraries once the
// kernels stop; and between rounds of pauses the spinning thread yields, so a
// thread that is ready to run on its core (NumPy's BLAS call interleaved with
// ours, an I/O thread) takes the core at once instead of after the spin.
//
// Parts are claimed through one atomic word holding the region's number, its
// number of parts and the next part, so a worker that wakes late can never run
// a part of a region that has ended or not begun.
#pragma once

#include <cstdint>

namespace sw::detail {

// Calls part(i) for every i in [0, parts), part 0 on the calling thread, and
// returns when all have finished. `part` must not throw.
void run_parts(int64_t parts, void (*part)(void* ctx, int64_t i), void* ctx);

// Threads the pool can run parts on at once (the caller included).
int64_t compute_threads();

// How long an idle pool thread spins before it sleeps, in microseconds (0:
// sleep at once); returns the previous value. For tests and measurements.
int64_t set_compute_spin_us(int64_t us);

}  // namespace sw::detail
