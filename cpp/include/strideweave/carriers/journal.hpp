// strideweave/carriers/journal.hpp — crash-safe writes of in-place tiers
// (Note [A crash-safe tier] in journal.cpp; docs/reliability.md, "Crash-safe tiers and atomic saves").
//
// Journal        the write-ahead journal of one file written in place
//                (FileBacked, a checkpoint tier with mutable=True): each unit
//                of writes (one tile's runs) is appended, with its offsets and
//                checksums, and fsynced before it is written in place; a tier
//                opened over the file replays what a crash left, so a tile is
//                never torn. flush() fsyncs the file and empties the journal.
// AtomicSlotWrites  the face TiledEvictable sees: a tier that writes a
//                tile's runs as one unit when it is crash-safe.
//
// Thread-safety: one mutex per journal serialises its units (writes to one
// file serialise on its inode lock anyway: Note [One writer per file]).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace sw {

// Slots [start, start + count) to receive `data` (count slots of the tier's dtype).
struct SlotPiece {
  int64_t start;
  int64_t count;
  const void* data;
};

class AtomicSlotWrites {
 public:
  virtual ~AtomicSlotWrites() = default;
  // Whether writes go through a journal (the tier was opened crash_safe).
  virtual bool crash_safe() const noexcept = 0;
  // Writes every piece as one unit: after a crash, the tier reopened holds all of them or none. `tile` names the
  // unit in messages (a TiledEvictable's tile index; -1 for a plain write).
  virtual void write_unit(int64_t tile, const std::vector<SlotPiece>& pieces) = 0;
};

// Bytes [offset, offset + bytes) of the journaled file receive `data`.
struct JournalPiece {
  int64_t offset;
  size_t bytes;
  const void* data;
};

struct JournalStats {
  int64_t records = 0;        // units journaled since the journal was opened
  int64_t bytes = 0;          // bytes written to the journal (headers, offsets and data)
  int64_t syncs = 0;          // fsyncs of the journal
  int64_t resets = 0;         // times it was emptied after the file was fsynced (flush, or grown past its limit)
  int64_t replayed = 0;       // records replayed into the file when it was opened
  int64_t replayed_bytes = 0; // their data bytes
};

// CRC-32C (Castagnoli) of `bytes`, continuing `crc` (0 to start); hardware instructions where the CPU has them.
uint32_t crc32c(const void* data, size_t bytes, uint32_t crc = 0);

class Journal {
 public:
  // Where the journal of `target` lives: beside its canonical path (symlinks, ".." and "." resolved; Note [One
  // journal per file] in journal.cpp), "<realpath(target)>.swjournal"; beside `target` when it does not resolve.
  static std::string path_for(const std::string& target);

  // Opens (creating it when absent) the journal of `target`, which the caller has open read-write as `target_fd`,
  // and locks it and the file (flock) for this process: RuntimeError naming the file and the other opener when
  // another crash-safe tier holds the file through any name, and naming the journal when it is not a regular file
  // with one name owned by this user (a symlink is never followed). Complete records a
  // crash left are replayed into the file, which is then fsynced, and the journal emptied. `what` names the tier
  // in messages ("FileBacked", "checkpoint"). RuntimeError naming the journal, the file and the tile when a record
  // is damaged while later records follow (that tile cannot be repaired), or when the journal is not one.
  Journal(const std::string& target, int target_fd, const char* what);
  ~Journal();  // with records: fsync of the file, then the journal is removed (best effort; else replayed later)
  Journal(const Journal&) = delete;
  Journal& operator=(const Journal&) = delete;

  // One unit: the record is appended and fsynced, then each piece written in place. RuntimeError in a process
  // forked from the one that opened the journal (it would interleave its records with the parent's). A failure before the record is
  // durable leaves the file untouched (the record is cut off again); after it, the file may hold part of the unit
  // and the record repairs it when the file is next opened. Either way RuntimeError (io.hpp's message).
  void write(int64_t tile, const std::vector<JournalPiece>& pieces);
  // fsync of the file, then the journal is emptied (its records are in the file for good). What flush() does.
  void sync_target();

  // For an opener that will not write `target` (read-only): RuntimeError naming both files when a journal with
  // records lies beside it and no live tier holds it (a crash left units that only a writable open can replay).
  static void check_none_pending(const std::string& target, const char* what);

  JournalStats stats() const;
  const std::string& path() const noexcept { return path_; }

  // Test-only: the next write() stops as a crash would (the journal is then abandoned: the destructor neither
  // syncs nor removes it) and throws std::runtime_error("simulated crash").
  enum class Crash { None, MidRecord, AfterRecord, MidInPlace };
  void crash_next(Crash c) { crash_ = c; }
  // Test-only: records beyond this many bytes make the next write sync the file and empty the journal first.
  void set_limit(int64_t bytes) { limit_ = bytes; }

 private:
  void open_journal();  // fd_, checked (Note [One journal per file])
  void replay();
  void reset_locked();
  void write_header();
  void cut_back() noexcept;
  [[noreturn]] void simulated_crash();
  void check_owner() const;  // RuntimeError in a forked child

  std::string target_, path_;
  const char* what_;
  int target_fd_;
  int pid_;  // the process that opened it: a forked child neither writes, syncs nor removes it
  int fd_ = -1;
  uint64_t dev_ = 0, ino_ = 0;
  int64_t end_ = 0;     // where the next record goes
  uint64_t seq_ = 0;
  int64_t limit_ = int64_t{1} << 30;
  bool abandoned_ = false;
  Crash crash_ = Crash::None;
  mutable std::mutex mutex_;
  JournalStats stats_;
};

}  // namespace sw
