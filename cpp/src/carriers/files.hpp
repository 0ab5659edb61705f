// Internal: file helpers shared by the file-backed tiers (FileBacked in
// storage.cpp, the checkpoint tier in checkpoint.cpp).
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <string>

namespace sw {
class DType;
}

namespace sw::detail {

// The dtypes FileBacked stores.
bool file_dtype(const DType& d);

// TMPDIR, or /tmp.
std::string temp_dir();
// A file with no name in `dir` (Note [Anonymous files leave no name] in storage.cpp), opened read-write; `name`
// receives what the kernel calls it ("/tmp/#1234 (deleted)").
int open_anonymous(const std::string& dir, std::string& name);
struct stat stat_open_file(int fd, const std::string& name);
// RuntimeError naming `what` file `name` and `action` when the name no longer leads to the open file or the file
// holds fewer than `need_bytes` (Note [Files changed under a carrier] in storage.cpp).
void check_file_intact(int fd, const std::string& name, const std::string& absolute, int64_t need_bytes,
                       const char* what, const char* action);
// `path` made absolute, so that a later chdir does not change what it names.
std::string absolute_path(const std::string& path);

}  // namespace sw::detail
