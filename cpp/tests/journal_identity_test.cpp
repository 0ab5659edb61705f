// One crash-safe journal per file, whatever its name, and a journal that is really one (Note [One journal per
// file] in carriers/journal.cpp). The Python side (killed writers, FileBacked): tests/test_journal_identity.py.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "strideweave/carriers/journal.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/io.hpp"
#include "test_support.hpp"

namespace sw {
namespace {

using namespace testing_support;

constexpr size_t kBytes = 4096;

// A data file of kBytes bytes of `fill`, with a symlink and a hard link to it; all removed at the end.
struct Names {
  TempPath tmp{"sw-journal-identity"};
  std::string link, hard;
  explicit Names(char fill) : link(tmp.path() + ".link"), hard(tmp.path() + ".hard") {
    const int fd = ::open(tmp.path().c_str(), O_RDWR | O_CLOEXEC);
    std::vector<char> v(kBytes, fill);
    EXPECT_EQ(::pwrite(fd, v.data(), v.size(), 0), static_cast<ssize_t>(v.size()));
    ::close(fd);
    EXPECT_EQ(::symlink(tmp.path().c_str(), link.c_str()), 0);
    EXPECT_EQ(::link(tmp.path().c_str(), hard.c_str()), 0);
  }
  ~Names() {
    ::unlink(link.c_str());
    ::unlink(hard.c_str());
    ::unlink((link + ".swjournal").c_str());
    ::unlink((hard + ".swjournal").c_str());
    ::unlink(Journal::path_for(tmp.path()).c_str());
  }
  const std::string& path() const { return tmp.path(); }
};

// An open description of its own, closed at the end.
struct Fd {
  int fd;
  explicit Fd(const std::string& path) : fd(::open(path.c_str(), O_RDWR | O_CLOEXEC)) { EXPECT_GE(fd, 0); }
  ~Fd() { ::close(fd); }
};


bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(JournalIdentity, ASymlinkAndItsTargetShareOneJournal) {
  Names n('a');
  EXPECT_EQ(Journal::path_for(n.link), Journal::path_for(n.path()));
  const std::string dir = n.path().substr(0, n.path().rfind('/'));
  const std::string dotted = dir + "/../" + dir.substr(dir.rfind('/') + 1) + "/." + n.path().substr(dir.size());
  EXPECT_EQ(Journal::path_for(dotted), Journal::path_for(n.path())) << dotted;
  EXPECT_NE(Journal::path_for(n.hard), Journal::path_for(n.path()));  // a hard link has no canonical name
}

TEST(JournalIdentity, ASecondWriterThroughAnyNameIsRefusedAndTheFirstKeepsItsLocks) {
  Names n('a');
  Fd first(n.path());
  auto j = std::make_unique<Journal>(n.path(), first.fd, "test");
  for (const std::string* name : std::vector<const std::string*>{&n.link, &n.hard, &n.path()}) {
    Fd second(*name);
    const std::string what = runtime_error_of([&] { Journal again(*name, second.fd, "test"); });
    EXPECT_TRUE(contains(what, "in use by another crash-safe tier")) << what;
    EXPECT_TRUE(contains(what, *name) && contains(what, "opened as test file " + n.path() + " in this process"))
        << what;
  }
  // The same open description (flock alone would not conflict): refused, and the refusal lets go of nothing.
  EXPECT_TRUE(contains(runtime_error_of([&] { Journal again(n.path(), first.fd, "test"); }), "in use by another"));
  Fd probe(n.hard);
  EXPECT_EQ(::flock(probe.fd, LOCK_EX | LOCK_NB), -1) << "the first journal's lock on the file was dropped";
  EXPECT_EQ(errno, EWOULDBLOCK);
  j.reset();  // a clean close lets go of the file
  Fd again_fd(n.hard);
  EXPECT_NO_THROW(Journal again(n.hard, again_fd.fd, "test"));
}

// A failed flock of the file opens nothing: no journal, no lock, no registered opener.
TEST(JournalIdentity, AFailedLockOfTheFileOpensNothing) {
  Names n('a');
  Fd fd(n.path());
  io::inject(io::Op::Flock, ENOLCK, 1, 0);
  const std::string what = runtime_error_of([&] { Journal j(n.path(), fd.fd, "test"); });
  io::clear_faults();
  EXPECT_TRUE(contains(what, "flock of " + n.path()) && contains(what, std::strerror(ENOLCK))) << what;
  EXPECT_FALSE(file_exists(Journal::path_for(n.path())));
  EXPECT_NO_THROW(Journal j(n.path(), fd.fd, "test"));
}

TEST(JournalIdentity, ASymlinkAtTheJournalIsNeverFollowed) {
  Names n('a');
  TempPath victim{"sw-journal-victim"};
  ASSERT_EQ(::truncate(victim.path().c_str(), 7), 0);
  const std::string journal = Journal::path_for(n.path());
  ASSERT_EQ(::symlink(victim.path().c_str(), journal.c_str()), 0);
  Fd fd(n.path());
  const std::string what = runtime_error_of([&] { Journal j(n.path(), fd.fd, "test"); });
  EXPECT_TRUE(contains(what, journal) && contains(what, "symbolic link")) << what;
  struct stat st;
  ASSERT_EQ(::stat(victim.path().c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 7);  // neither truncated nor given a header
  struct stat link_st;
  ASSERT_EQ(::lstat(journal.c_str(), &link_st), 0);
  EXPECT_TRUE(S_ISLNK(link_st.st_mode));
  EXPECT_NO_THROW(Journal::check_none_pending(n.path(), "test"));  // a read-only opener ignores it
  ::unlink(journal.c_str());
  EXPECT_NO_THROW(Journal j(n.path(), fd.fd, "test"));  // the lock was let go of
}

}  // namespace
}  // namespace sw
