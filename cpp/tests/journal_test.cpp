// The crash-safe journal (strideweave/carriers/journal.hpp, Note [A crash-safe tier] in carriers/journal.cpp):
// torn writes are made deterministically by the journal's crash hook (a write stops halfway and the journal is
// abandoned as a killed process leaves it), then the file is reopened.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "strideweave/carriers/checkpoint.hpp"
#include "strideweave/carriers/journal.hpp"
#include "strideweave/carriers/storage.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/io.hpp"
#include "test_support.hpp"

namespace sw {
namespace {

using namespace testing_support;

constexpr size_t kBytes = 64 * 1024;

struct Target {
  TempPath tmp{"sw-journal"};
  int fd = -1;
  explicit Target(char fill) {
    fd = ::open(tmp.path().c_str(), O_RDWR | O_CLOEXEC);
    std::vector<char> v(2 * kBytes, fill);
    EXPECT_EQ(::pwrite(fd, v.data(), v.size(), 0), static_cast<ssize_t>(v.size()));
  }
  ~Target() {
    if (fd >= 0) ::close(fd);
    ::unlink(Journal::path_for(tmp.path()).c_str());
  }
  const std::string& path() const { return tmp.path(); }
  std::vector<char> bytes(int64_t offset = 0, size_t n = 2 * kBytes) const {
    std::vector<char> v(n);
    EXPECT_EQ(::pread(fd, v.data(), n, offset), static_cast<ssize_t>(n));
    return v;
  }
};

bool all_of(const std::vector<char>& v, char c) {
  for (char x : v)
    if (x != c) return false;
  return true;
}

// A unit of two pieces, one per half of the file, of value `c`.
void write_unit(Journal& j, int64_t tile, char c, Journal::Crash crash = Journal::Crash::None) {
  static std::vector<char> a, b;
  a.assign(kBytes, c);
  b.assign(kBytes, c);
  j.crash_next(crash);
  j.write(tile, {{0, kBytes, a.data()}, {static_cast<int64_t>(kBytes), kBytes, b.data()}});
}

void crashed_unit(Journal& j, int64_t tile, char c, Journal::Crash crash) {
  EXPECT_THROW(write_unit(j, tile, c, crash), std::runtime_error);
}


bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(Journal, Crc32cOfTheStandardCheckString) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("56789", 5, crc32c("1234", 4)), 0xE3069283u);  // continued
}

TEST(Journal, WritesInPlaceAndACleanCloseRemovesTheJournal) {
  Target t('a');
  {
    Journal j(t.path(), t.fd, "test");
    EXPECT_TRUE(file_exists(j.path()));
    write_unit(j, 0, 'b');
    EXPECT_TRUE(all_of(t.bytes(), 'b'));
    EXPECT_EQ(j.stats().records, 1);
    EXPECT_EQ(j.stats().syncs, 1);
    EXPECT_GE(j.stats().bytes, static_cast<int64_t>(2 * kBytes));
    j.sync_target();
    EXPECT_EQ(j.stats().resets, 1);
  }
  EXPECT_FALSE(file_exists(Journal::path_for(t.path())));
}

TEST(Journal, ACrashInsideTheRecordLeavesTheFileUntouched) {
  Target t('a');
  {
    Journal j(t.path(), t.fd, "test");
    crashed_unit(j, 3, 'b', Journal::Crash::MidRecord);
  }
  EXPECT_TRUE(file_exists(Journal::path_for(t.path())));  // abandoned, as a killed process leaves it
  EXPECT_TRUE(all_of(t.bytes(), 'a'));
  Journal again(t.path(), t.fd, "test");
  EXPECT_EQ(again.stats().replayed, 0);  // the torn record is the tail: never replayed
  EXPECT_TRUE(all_of(t.bytes(), 'a'));
}

TEST(Journal, ATornTileIsRepairedWhenTheFileIsReopened) {
  for (auto crash : {Journal::Crash::MidInPlace, Journal::Crash::AfterRecord}) {
    Target t('a');
    {
      Journal j(t.path(), t.fd, "test");
      write_unit(j, 1, 'b');
      crashed_unit(j, 1, 'c', crash);
    }
    if (crash == Journal::Crash::MidInPlace) {
      // Torn: the first piece's first half is new, the rest old.
      EXPECT_TRUE(all_of(t.bytes(0, kBytes / 2), 'c'));
      EXPECT_TRUE(all_of(t.bytes(kBytes / 2, kBytes / 2), 'b'));
    }
    Journal again(t.path(), t.fd, "test");
    EXPECT_EQ(again.stats().replayed, 2);
    EXPECT_TRUE(all_of(t.bytes(), 'c'));  // the last complete unit, whole
  }
}

TEST(Journal, ADamagedRecordWithLaterRecordsNamesTheFileAndTile) {
  Target t('a');
  {
    Journal j(t.path(), t.fd, "test");
    write_unit(j, 7, 'b');
    crashed_unit(j, 8, 'c', Journal::Crash::AfterRecord);
  }
  // One byte of the first record's data flipped (not a crash: the disk, or someone else).
  int jfd = ::open(Journal::path_for(t.path()).c_str(), O_RDWR | O_CLOEXEC);
  char x = 'z';
  ASSERT_EQ(::pwrite(jfd, &x, 1, 32 + 48 + 32 + 100), 1);
  ::close(jfd);
  const auto before = t.bytes();
  const std::string m = runtime_error_of([&] { Journal again(t.path(), t.fd, "test"); });  // a damaged journal
  EXPECT_TRUE(contains(m, "record of tile 7")) << m;
  EXPECT_TRUE(contains(m, t.path())) << m;
  EXPECT_TRUE(contains(m, "cannot be repaired")) << m;
  EXPECT_EQ(t.bytes(), before);  // nothing replayed
}

TEST(Journal, AJournalOfAReplacedFileIsStaleAndNotReplayed) {
  Target t('a');
  {
    Journal j(t.path(), t.fd, "test");
    crashed_unit(j, 0, 'b', Journal::Crash::AfterRecord);
  }
  // A new file renamed over the name (as an atomic save does).
  const std::string fresh = t.path() + ".new";
  int nfd = ::open(fresh.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  std::vector<char> v(2 * kBytes, 'n');
  ASSERT_EQ(::pwrite(nfd, v.data(), v.size(), 0), static_cast<ssize_t>(v.size()));
  ASSERT_EQ(::rename(fresh.c_str(), t.path().c_str()), 0);
  EXPECT_NO_THROW(Journal::check_none_pending(t.path(), "test"));  // not this file's journal
  Journal again(t.path(), nfd, "test");
  EXPECT_EQ(again.stats().replayed, 0);
  std::vector<char> got(v.size());
  ASSERT_EQ(::pread(nfd, got.data(), got.size(), 0), static_cast<ssize_t>(got.size()));
  EXPECT_TRUE(all_of(got, 'n'));
  ::close(nfd);
}

TEST(Journal, OneCrashSafeWriterAtATime) {
  Target t('a');
  Journal j(t.path(), t.fd, "test");
  try {
    Journal second(t.path(), t.fd, "test");
    FAIL() << "a second journal over the file was opened";
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("in use by another crash-safe tier"), std::string::npos) << e.what();
  }
  write_unit(j, 0, 'b');  // the first is unharmed
  EXPECT_TRUE(all_of(t.bytes(), 'b'));
}

TEST(Journal, AFailedRecordWriteOrSyncLeavesTheFileUntouched) {
  for (io::Op op : {io::Op::Pwrite, io::Op::Fsync}) {
    Target t('a');
    Journal j(t.path(), t.fd, "test");
    for (int after : {0, 1, 2}) {
      if (op == io::Op::Fsync && after > 0) break;
      io::inject(op, op == io::Op::Pwrite ? ENOSPC : EIO, 1, after);
      try {
        write_unit(j, 0, 'b');
        FAIL() << "the injected fault did not fail the unit";
      } catch (const RuntimeError& e) {
        EXPECT_NE(std::string(e.what()).find(j.path()), std::string::npos) << e.what();
      }
      io::clear_faults();
      EXPECT_TRUE(all_of(t.bytes(), 'a'));
      EXPECT_EQ(j.stats().records, 0);
    }
    write_unit(j, 0, 'c');  // the journal goes on after the cut-off record
    EXPECT_TRUE(all_of(t.bytes(), 'c'));
  }
}

// Opening: the target's fstat, the journal's lock, then the journal's own fstat (replay). A failure of any of them
// opens nothing: the file is untouched, the journal (with the record a crash left) stays for the next opener, and
// nothing holds its lock.
TEST(Journal, AFailedStatOrLockOpensNothingAndKeepsTheJournal) {
  struct Case {
    io::Op op;
    int after, error;
    const char* words;
  };
  const Case cases[] = {{io::Op::Fstat, 0, EIO, "fstat of "}, {io::Op::Flock, 0, ENOLCK, "flock of "},
                        {io::Op::Fstat, 1, EIO, "fstat of "}};
  for (const Case& c : cases) {
    Target t('a');
    {
      Journal j(t.path(), t.fd, "test");
      write_unit(j, 1, 'b');
      crashed_unit(j, 1, 'c', Journal::Crash::MidInPlace);  // a record to replay, the file torn
    }
    const std::vector<char> torn = t.bytes();
    io::inject(c.op, c.error, 1, c.after);
    const std::string what = runtime_error_of([&] { Journal again(t.path(), t.fd, "test"); });
    io::clear_faults();
    EXPECT_TRUE(contains(what, c.words)) << what;
    EXPECT_TRUE(contains(what, c.after == 0 && c.op == io::Op::Fstat ? t.path() : Journal::path_for(t.path())))
        << what;
    EXPECT_TRUE(contains(what, std::strerror(c.error))) << what;
    EXPECT_EQ(t.bytes(), torn);  // nothing replayed
    Journal again(t.path(), t.fd, "test");  // the lock is free and the record still there
    EXPECT_EQ(again.stats().replayed, 2);
    EXPECT_TRUE(all_of(t.bytes(), 'c'));
  }
}

// Emptying the journal once the file is synced (sync_target, or a journal past its limit before the next record)
// truncates it; when that fails the records stay, still valid, and the journal goes on.
TEST(Journal, AFailedTruncateKeepsTheRecordsAndTheJournalGoesOn) {
  for (bool at_limit : {false, true}) {
    Target t('a');
    Journal j(t.path(), t.fd, "test");
    write_unit(j, 0, 'b');
    const JournalStats before = j.stats();
    io::inject(io::Op::Ftruncate, EIO, 1, 0);
    std::string what;
    if (at_limit) {
      j.set_limit(0);
      what = runtime_error_of([&] { write_unit(j, 1, 'c'); });
    } else {
      what = runtime_error_of([&] { j.sync_target(); });
    }
    io::clear_faults();
    EXPECT_TRUE(contains(what, "ftruncate of the crash-safe journal " + j.path())) << what;
    EXPECT_TRUE(contains(what, "(EIO)")) << what;
    const JournalStats after = j.stats();
    EXPECT_EQ(after.resets, before.resets);
    EXPECT_EQ(after.records, before.records);
    EXPECT_EQ(after.bytes, before.bytes);
    EXPECT_TRUE(all_of(t.bytes(), 'b'));  // the unit that failed to start wrote nothing
    j.set_limit(int64_t{1} << 40);
    write_unit(j, 1, 'd');
    EXPECT_TRUE(all_of(t.bytes(), 'd'));
    j.sync_target();
    EXPECT_EQ(j.stats().resets, before.resets + 1);
  }
}

// Reopening replays a crash's records into the file, then empties the journal; when that truncate fails the
// open fails, the file holds the replayed (whole) unit, and the records stay for the next opener.
TEST(Journal, AFailedTruncateAfterReplayKeepsTheRecordsForTheNextOpen) {
  Target t('a');
  {
    Journal j(t.path(), t.fd, "test");
    write_unit(j, 1, 'b');
    crashed_unit(j, 1, 'c', Journal::Crash::MidInPlace);
  }
  io::inject(io::Op::Ftruncate, EIO, 1, 0);
  const std::string what = runtime_error_of([&] { Journal again(t.path(), t.fd, "test"); });
  io::clear_faults();
  EXPECT_TRUE(contains(what, "ftruncate of the crash-safe journal " + Journal::path_for(t.path()))) << what;
  EXPECT_TRUE(all_of(t.bytes(), 'c'));  // replayed: whole
  Journal again(t.path(), t.fd, "test");
  EXPECT_EQ(again.stats().replayed, 2);  // the records were still there
  EXPECT_TRUE(all_of(t.bytes(), 'c'));
}

TEST(Journal, GrowingPastItsLimitSyncsTheFileAndEmptiesIt) {
  Target t('a');
  Journal j(t.path(), t.fd, "test");
  j.set_limit(3 * kBytes);
  for (int k = 0; k < 4; ++k) write_unit(j, k, static_cast<char>('b' + k));
  EXPECT_GE(j.stats().resets, 1);
  EXPECT_TRUE(all_of(t.bytes(), 'e'));
}

TEST(Journal, AForeignFileWhereTheJournalBelongsIsRefusedAndKept) {
  Target t('a');
  const std::string jpath = Journal::path_for(t.path());
  const std::string foreign(100, 'x');
  int fd = ::open(jpath.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_EQ(::pwrite(fd, foreign.data(), foreign.size(), 0), static_cast<ssize_t>(foreign.size()));
  ::close(fd);
  try {
    Journal j(t.path(), t.fd, "test");
    FAIL() << "a foreign file was taken for a journal";
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("is not a StrideWeave journal"), std::string::npos) << e.what();
  }
  std::string back(200, '\0');
  fd = ::open(jpath.c_str(), O_RDONLY | O_CLOEXEC);
  back.resize(static_cast<size_t>(::pread(fd, back.data(), back.size(), 0)));
  ::close(fd);
  EXPECT_EQ(back, foreign);  // left as it was
  EXPECT_TRUE(all_of(t.bytes(), 'a'));
}

TEST(Journal, ARecordPastTheEndOfATruncatedFileIsAnError) {
  Target t('a');
  {
    Journal j(t.path(), t.fd, "test");
    crashed_unit(j, 4, 'b', Journal::Crash::AfterRecord);
  }
  ASSERT_EQ(::ftruncate(t.fd, kBytes), 0);  // the second piece's range is gone
  const std::string m = runtime_error_of([&] { Journal again(t.path(), t.fd, "test"); });  // a record past the end
  EXPECT_TRUE(contains(m, "tile 4")) << m;
  EXPECT_TRUE(contains(m, "truncated since")) << m;
  struct stat st;
  ASSERT_EQ(::fstat(t.fd, &st), 0);
  EXPECT_EQ(st.st_size, static_cast<off_t>(kBytes));  // not re-extended
}

TEST(JournalCheckpoint, AReadOnlyCheckpointFileRefusesWhatACrashLeftAndAWritableOneRepairsIt) {
  Target t('a');
  {
    Journal j(t.path(), t.fd, "checkpoint");
    crashed_unit(j, 0, 'b', Journal::Crash::MidInPlace);
  }
  try {
    CheckpointFile ro(t.path(), false);
    FAIL() << "a read-only checkpoint file accepted a pending journal";
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("open the file writable once"), std::string::npos) << e.what();
  }
  { CheckpointFile rw(t.path(), true); }
  EXPECT_TRUE(all_of(t.bytes(), 'b'));
  EXPECT_FALSE(file_exists(Journal::path_for(t.path())));
}

TEST(JournalCheckpoint, OnlyAnInPlaceTierOverAWritableFileCanBeCrashSafe) {
  Target t('a');
  auto ro = std::make_shared<CheckpointFile>(t.path(), false);
  CheckpointCarrier overlay({{ro, 0, 16}}, DType::Float32(), CheckpointCarrier::Writes::Overlay);
  try {
    overlay.make_crash_safe();
    FAIL();
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("needs a checkpoint tier that writes in place"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(overlay.crash_safe());
  try {
    ro->enable_journal();
    FAIL();
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("opened read-only"), std::string::npos) << e.what();
  }
  EXPECT_EQ(ro->journal(), nullptr);
  EXPECT_FALSE(file_exists(Journal::path_for(t.path())));
}

TEST(JournalFileBacked, AReadOnlyOpenRefusesWhatACrashLeftAndAWritableOneRepairsIt) {
  Target t('a');
  {
    Journal j(t.path(), t.fd, "FileBacked");
    crashed_unit(j, 2, 'b', Journal::Crash::MidInPlace);
  }
  const auto torn = t.bytes();
  try {
    FileBackedCarrier ro(t.path(), DType::Float32(), false);
    FAIL() << "a read-only open accepted a pending journal";
  } catch (const RuntimeError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(t.path()), std::string::npos) << m;
    EXPECT_NE(m.find("crash-safe journal"), std::string::npos) << m;
    EXPECT_NE(m.find("open the file writable once"), std::string::npos) << m;
  }
  EXPECT_EQ(t.bytes(), torn);  // the refusal changed nothing
  {
    FileBackedCarrier rw(t.path(), DType::Float32(), true, /*crash_safe=*/true);
    EXPECT_TRUE(rw.crash_safe());
    EXPECT_EQ(rw.journal_stats().replayed, 1);
  }
  EXPECT_TRUE(all_of(t.bytes(), 'b'));
  EXPECT_FALSE(file_exists(Journal::path_for(t.path())));
  EXPECT_NO_THROW(FileBackedCarrier(t.path(), DType::Float32(), false));
}

TEST(JournalFileBacked, APlainWritableOpenRepairsToo) {
  Target t('a');
  {
    Journal j(t.path(), t.fd, "FileBacked");
    crashed_unit(j, 2, 'b', Journal::Crash::MidInPlace);
  }
  {
    FileBackedCarrier rw(t.path(), DType::Float32(), true);
    EXPECT_FALSE(rw.crash_safe());
  }
  EXPECT_TRUE(all_of(t.bytes(), 'b'));
  EXPECT_FALSE(file_exists(Journal::path_for(t.path())));
}

TEST(JournalFileBacked, CrashSafeNeedsANamedWritableFile) {
  EXPECT_THROW(FileBackedCarrier("", DType::Float32(), true, true), ValueError);
  Target t('a');
  try {
    FileBackedCarrier c(t.path(), DType::Float32(), false, true);
    FAIL();
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("read-only file is never written"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(file_exists(Journal::path_for(t.path())));
}

TEST(JournalFileBacked, WritesAreJournaledAndFlushEmptiesTheJournal) {
  Target t('a');
  FileBackedCarrier c(t.path(), DType::Float32(), true, true);
  std::vector<float> v(16, 2.0f);
  c.write_slots(4, 16, v.data());
  c.write_unit(5, {{0, 4, v.data()}, {100, 4, v.data()}});
  EXPECT_EQ(c.journal_stats().records, 2);
  c.flush();
  EXPECT_EQ(c.journal_stats().resets, 1);
  std::vector<float> got(4);
  c.read_slots(100, 4, got.data());
  EXPECT_EQ(got, std::vector<float>(4, 2.0f));
}

}  // namespace
}  // namespace sw
