// strideweave/fork.hpp — what a child made by fork() inherits, and what it does with it.
//
// Note [Fork safety]: fork() copies the whole address space but only the
// calling thread. Everything the engine's own threads (I/O, device reads,
// selection, moves, the mapping cache's trimmer) were doing at that moment is
// copied half-done into the child, where no thread will ever finish it:
//
//  - A mutex one of them held stays locked in the child. So each mutex a pool
//    thread may hold is taken by the forking thread before fork() and let go
//    of on both sides after it (pthread_atfork prepare/parent/child), in one
//    fixed order, outermost first, that matches how the engine nests them:
//      ForkLevel::TileTables    every TiledEvictable's tile table (a thread
//                               holding one may next set a completion or
//                               take a cached mapping),
//      ForkLevel::SmallLocks    the striped locks of completions, of
//                               carriers' claim state and of residency
//                               budgets (nothing is taken under them),
//      ForkLevel::Executors     the process pools' queues,
//      ForkLevel::MappingCache  the mapping cache (native.cpp),
//      ForkLevel::TestGate      the test-only I/O gate (io.cpp), which I/O
//                               threads pass with no other lock held.
//    Every one of these critical sections is short and never waits for I/O,
//    for the GIL or for another request, so the forking thread waits only
//    for the sections that were running. The locks of work in flight (a
//    request's staging lock, a projection's error lock) are not taken: only
//    that work uses them, and it never runs in the child. Not covered either:
//    the BlockDevice read-modify-write lock and an Evictable's lock, held
//    across I/O (taking them could keep fork() waiting on a device), and the
//    process-wide registries of routes, backends and the move node hook; a
//    child forked while another thread held one of those blocks on it.
//  - Condition variables keep waiters that do not exist in the child: glibc
//    then hands a notify_one to a phantom waiter, and destroying such a
//    condition variable blocks for ever. Each one the child may use is made
//    afresh in the child (never destroyed: its old state is just dropped).
//  - Work in flight at fork() (queued, or running on a pool thread) runs only
//    in the parent. In the child every pool starts afresh (no threads yet, an
//    empty queue: the parent's queued work is dropped without being run or
//    destroyed, since destroying it could run anything), and a completion
//    created before fork() that was not yet set fails there, the first time
//    anything touches it (done, wait, wait_for, help, then, error), with
//    RuntimeError "created before fork"; its continuations and help, the
//    parent's work too, are dropped the same way. A completion already set
//    before fork() keeps its value. A set arriving later for a completion
//    failed this way is ignored.
//  - The tile tables forget the requests and work in flight: their pending
//    marks and pins are cleared in the child (their transfers never run there,
//    so each tile keeps its state from before the request, as after a failed
//    one), and the child's own requests may use those tiles.
//  - Claims that work in flight held on ordinary carriers (a projection's
//    destination, a scatter's compact tensor, a move's source) stay taken in
//    the child: it cannot tell them from claims its own code holds.
//
// fork_generation() tells the copies apart: 0 in a process that was not
// forked, one more in each child (so a grandchild's own completions are again
// "new"). Only the child handler changes it, before any other thread exists.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>

namespace sw {

namespace detail {
extern std::atomic<uint64_t> g_fork_generation;
}  // namespace detail

// Which fork() this process is a child of (Note [Fork safety]): 0 in one that was not forked.
inline uint64_t fork_generation() noexcept { return detail::g_fork_generation.load(std::memory_order_relaxed); }

// The order in which the prepare steps take their locks, outermost first (Note [Fork safety]).
enum class ForkLevel : int { TileTables = 0, SmallLocks = 1, Executors = 2, MappingCache = 3, TestGate = 4 };

// Registers the steps of one level (once per level; takes no lock). `prepare` runs in the
// forking thread before fork(), levels in ascending order; `parent` and `child` run after it, in descending
// order, `child` in the new process before anything else. The first call installs the pthread_atfork handlers.
void on_fork(ForkLevel level, void (*prepare)(), void (*parent)(), void (*child)());

namespace detail {
// The striped locks of ForkLevel::SmallLocks: one of a fixed set, chosen by the address of the object it
// guards. Only for critical sections that take no other lock of the same table.
std::mutex& completion_lock(const void* object) noexcept;
std::mutex& carrier_state_lock(const void* object) noexcept;
// A residency budget's lock (its sections take no other lock; a tile table's lock may be held around them).
std::mutex& budget_lock(const void* object) noexcept;
}  // namespace detail

// Note [Locks held for a whole call]: some objects run one call at a time (a SparseMoE's forward, backward and
// prefetch), under a lock held for the whole call, across tile I/O and waits for other requests. fork()'s
// prepare step cannot take such a lock (fork() would wait for a whole call, or for ever for a call that waits
// on the forking thread), and a std::mutex that another thread held at the fork stays locked in the child, where
// that thread does not exist: the child's first call on the object blocked for ever (seen: a child forked
// while a daemon thread ran an offloaded model's forward). A CallMutex records which process took it (its fork
// generation). In a child, one taken by another thread of an ancestor is never released, and the call that
// would wait for it raises RuntimeError "created before fork" instead: like a request in flight at the fork
// (above), that call's work exists only in the parent and left the object half-way through it, so the object
// cannot be used in the child; the child makes its own. One that was free at the fork works as a plain mutex in
// the child (one the forking thread itself held is released there by that thread; until then other threads of
// the child get the error too).
class CallMutex {
 public:
  // `what` names the object in the error, e.g. "SparseMoE".
  explicit CallMutex(const char* what) noexcept : what_(what) {}
  CallMutex(const CallMutex&) = delete;
  CallMutex& operator=(const CallMutex&) = delete;

  void lock();  // raises RuntimeError in a child when another thread of an ancestor held it at the fork
  void unlock() noexcept;

 private:
  // 0: free; else which process took it: 1 + its fork generation (31 bits: a futex word).
  std::atomic<uint32_t> state_{0};
  const char* what_;
};

}  // namespace sw
