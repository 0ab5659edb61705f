// strideweave/io.hpp — the system-call sites of file-backed storage, with
// test-only fault injection.
//
// Every open/pread/pwrite/fsync of FileBacked and BlockDevice, and the
// ftruncate/flock/fstat of the crash-safe journal, goes through these wrappers. Tests arm a fault with `io::inject(op, errno, count, after)`:
// the next `count` calls of `op` (after skipping `after` calls) fail with that
// errno instead of reaching the kernel. Failures raise RuntimeError naming the
// operation, the file and strerror ("pwrite of /tmp/x failed: No space left on
// device (ENOSPC)"). Full reads and writes loop over short transfers and EINTR;
// a read that meets the end of the file early fails (the file was truncated).
//
// Thread-safety: the fault table is atomic; wrappers are safe from any thread.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace sw::io {

enum class Op { Open = 0, Pread = 1, Pwrite = 2, Fsync = 3, Ftruncate = 4, Flock = 5, Fstat = 6 };
inline constexpr size_t kOpCount = 7;

// Arms a fault: after `after` more successful calls of `op`, the next `count`
// calls fail with `error`. count < 0 fails every call until cleared.
void inject(Op op, int error, int count = 1, int after = 0);
void clear_faults();
// Calls of `op` so far (successful or injected).
int64_t calls(Op op);
// Test-only gate, so that tests can keep an asynchronous request pending
// deterministically: while `op` is held, every call of it blocks before
// reaching the kernel (or an injected fault) until unhold() or clear_faults();
// a held call gives up waiting after 60 s so that a faulty test cannot hang
// the process. held_waiting(op) counts the calls blocked right now.
void hold(Op op);
void unhold();
int64_t held_waiting(Op op);
// Blocks until at least `n` calls of `op` are blocked at the gate (true) or `timeout_s` seconds pass (false): a
// test waits for its request to reach the gate without polling.
bool wait_held(Op op, int64_t n, double timeout_s);

// ValueError when `path` holds an embedded NUL byte (the kernel would see only the part before it, another
// file); `what` names the argument ("FileBacked filename"). Every open below checks it too.
void check_path(const std::string& path, const char* what);
int open_file(const std::string& path, int flags, int mode = 0644);
// As open_file, but a failure returns -errno instead of raising (for callers
// that handle one errno themselves); raise_failure raises the usual error.
// Neither blocks in open(2): a FIFO or a socket at `path` is a ValueError
// naming it (Note [Opening never blocks] in io.cpp).
int try_open_file(const std::string& path, int flags, int mode = 0644);
[[noreturn]] void raise_failure(Op op, const std::string& what, int error);
// Reads `bytes` at `offset`; the end of the file before the last of them is an error (RuntimeError naming the
// file, the offset and the bytes expected and got: Note [A short read is an error] in io.cpp). With `direct_fd` (the same file
// opened with O_DIRECT), a read of at least kDirectMin bytes that the page cache holds none of bypasses it
// (Note [Cold reads bypass the page cache] in io.cpp). One call counts as one pread for faults and the gate.
inline constexpr size_t kDirectMin = size_t{1} << 20;
// True when the page cache holds less than half of [offset, offset + bytes) (cachestat(2); false where the kernel
// cannot say): such a read goes direct when it can.
bool mostly_uncached(int fd, size_t bytes, int64_t offset);
// Whether the page cache holds every page of the byte range (cachestat(2)); nullopt where the kernel lacks it
// (before Linux 6.5) or refuses the call.
std::optional<bool> fully_cached(int fd, size_t bytes, int64_t offset);
void pread_full(int fd, void* buf, size_t bytes, int64_t offset, const std::string& what, int direct_fd = -1);
void pwrite_full(int fd, const void* buf, size_t bytes, int64_t offset, const std::string& what);
void fsync_file(int fd, const std::string& what);
// ftruncate(2) and fstat(2), raising RuntimeError as above ("ftruncate of <what> failed: ...").
void ftruncate_file(int fd, int64_t length, const std::string& what);
void fstat_file(int fd, struct ::stat& st, const std::string& what);
// flock(2) with `operation` (LOCK_EX | LOCK_NB, ...): 0, or -errno (an injected one too) for the caller to word,
// as EWOULDBLOCK means another holder rather than a failure.
int try_flock(int fd, int operation);

}  // namespace sw::io
