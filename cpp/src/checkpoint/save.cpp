// Writing a safetensors file (Note [Saving a checkpoint] in strideweave/checkpoint/safetensors.hpp).
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string_view>
#include <vector>

#include "strideweave/checkpoint/quantized.hpp"
#include "strideweave/checkpoint/safetensors.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/io.hpp"

namespace sw::safetensors {

namespace {

constexpr size_t kChunkBytes = size_t{8} << 20;

// The tensor's layout with its top-level modes reversed: its colex order is the row-major order of the original.
Layout reversed_modes(const Layout& l) {
  std::vector<IntTuple> shape, stride;
  for (size_t k = l.rank(); k-- > 0;) {
    shape.push_back(l.shape().tree().children()[k]);
    stride.push_back(l.stride().tree().children()[k]);
  }
  return Layout(Shape(IntTuple::tuple(std::move(shape))), Stride(IntTuple::tuple(std::move(stride))));
}

// Note [A save leaves no temporary]: a save writes its file under no name at all (O_TMPFILE in the target's
// folder: a file the kernel frees when its last descriptor closes, so a save killed at any point before the end,
// even by SIGKILL, leaves nothing), and only once it is whole and synced links it under its temporary name
// (linkat through /proc/self/fd) and renames that over the target: a named temporary exists for two system calls.
// Where the file system or the kernel has no O_TMPFILE (or /proc is not mounted), the temporary is named from the
// start, as ".<target>.tmp-<pid>-<n>". Either way a save first removes the temporaries of the same target left by
// writers that are gone (a process that no longer exists: kill(pid, 0) says ESRCH); a live writer's, this
// process's included, is left alone.
struct TempFile {
  std::string path;  // the temporary name; empty while the file has none
  int fd = -1;
  bool keep = false;
  ~TempFile() {
    if (fd >= 0) ::close(fd);
    if (!keep && !path.empty()) ::unlink(path.c_str());
  }
};

// ".<filename>.tmp-<pid>-<n>" of a writer that is gone (kill(pid, 0) says ESRCH; this process's own and a live
// writer's are not).
bool dead_writers_temporary(std::string_view name, const std::string& prefix) {
  if (name.size() <= prefix.size() || name.substr(0, prefix.size()) != prefix) return false;
  const std::string_view rest = name.substr(prefix.size());
  const size_t dash = rest.find('-');
  if (dash == 0 || dash == std::string_view::npos || dash > 9 || dash + 1 == rest.size()) return false;
  auto digits = [](std::string_view v) {
    return std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  if (!digits(rest.substr(0, dash)) || !digits(rest.substr(dash + 1))) return false;
  const pid_t pid = static_cast<pid_t>(std::stol(std::string(rest.substr(0, dash))));
  if (pid <= 0 || pid == ::getpid()) return false;
  return ::kill(pid, 0) != 0 && errno == ESRCH;
}

// Removes ".<filename>.tmp-<pid>-<n>" in `dir` for every pid that is not a live process.
void remove_stale_temporaries(const std::string& dir, const std::string& filename) {
  const std::string prefix = "." + filename + ".tmp-";
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;  // the open of the temporary reports a folder that cannot be used
  while (const dirent* e = ::readdir(d))
    if (dead_writers_temporary(e->d_name, prefix)) ::unlinkat(::dirfd(d), e->d_name, 0);
  ::closedir(d);
}

void sync_folder(const std::string& dir) {
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

bool proc_fd_links() {
  static const bool ok = ::access("/proc/self/fd", X_OK) == 0;
  return ok;
}

}  // namespace

std::string_view element_type_of(const DType& dtype) {
  switch (dtype.id()) {
    case DTypeId::Float32: return "F32";
    case DTypeId::Int32: return "I32";
    case DTypeId::Bool: return "BOOL";
    case DTypeId::Float64: return "F64";
    case DTypeId::BFloat16: return "BF16";
    case DTypeId::Float16: return "F16";
  }
  raise<TypeError>("safetensors cannot hold ", dtype.name(), " elements");
}

std::string quantized_scale_name(const std::string& name, QuantizedRange::Format format) {
  if (format == QuantizedRange::Format::MXFP4) return name + "_scales";
  if (name.size() > 7 && name.ends_with(".weight")) return name.substr(0, name.size() - 6) + "weight_scale_inv";
  return name + "_scale_inv";
}

namespace {

// Where a quantized tensor's two file tensors start (relative to the data area) and how it is cut.
struct QuantizedOut {
  SaveQuantization how;
  int64_t rows = 0, cols = 0;  // FP8: one matrix; MXFP4: cols = the last extent
  uint64_t data_at = 0, scale_at = 0;
};

// Reads tensor `t` in row-major order and writes it quantized (Note [Saving a checkpoint]): FP8 one matrix at a
// time (its values, its bytes and its scales), MXFP4 whole groups in chunks of about kChunkBytes.
void write_quantized(int fd, const std::string& what, int64_t data_start, const std::string& name, const TensorImpl& t,
                     const QuantizedOut& q) {
  const size_t w = slot_bytes(t.dtype());
  const bool bf16 = &t.dtype() == &DType::BFloat16();
  const bool fp8 = q.how.format == QuantizedRange::Format::FP8;
  // Values per unit: an FP8 matrix, or a chunk of MXFP4 groups.
  const int64_t unit = fp8 ? q.rows * q.cols : std::max<int64_t>(32, static_cast<int64_t>(kChunkBytes / w) / 32 * 32);
  std::vector<std::byte> values(static_cast<size_t>(std::min<int64_t>(unit, t.size())) * w);
  std::vector<uint8_t> bytes;
  std::vector<std::byte> scales;
  int64_t filled = 0, done = 0;  // values in the buffer; values already written
  auto flush = [&] {
    if (filled == 0) return;
    if (fp8) {
      const int64_t sr = (q.rows + q.how.block_rows - 1) / q.how.block_rows;
      const int64_t sc = (q.cols + q.how.block_cols - 1) / q.how.block_cols;
      bytes.resize(static_cast<size_t>(filled));
      scales.resize(static_cast<size_t>(sr * sc) * 4);
      quant::quantize_fp8(values.data(), bf16, q.rows, q.cols, q.how.block_rows, q.how.block_cols, bytes.data(),
                          reinterpret_cast<float*>(scales.data()));
      const int64_t m = done / (q.rows * q.cols);
      io::pwrite_full(fd, bytes.data(), bytes.size(), data_start + static_cast<int64_t>(q.data_at) + done, what);
      io::pwrite_full(fd, scales.data(), scales.size(),
                      data_start + static_cast<int64_t>(q.scale_at) + m * static_cast<int64_t>(scales.size()), what);
    } else {
      const int64_t groups = filled / 32;
      bytes.resize(static_cast<size_t>(groups) * 16);
      scales.resize(static_cast<size_t>(groups));
      if (!quant::quantize_mxfp4(values.data(), bf16, groups, bytes.data(), reinterpret_cast<uint8_t*>(scales.data())))
        raise<ValueError>("safetensors.save: tensor '", name, "' holds a NaN, which MXFP4 cannot hold (it has no NaN); "
                          "nothing was written");
      io::pwrite_full(fd, bytes.data(), bytes.size(), data_start + static_cast<int64_t>(q.data_at) + done / 2, what);
      io::pwrite_full(fd, scales.data(), scales.size(), data_start + static_cast<int64_t>(q.scale_at) + done / 32, what);
    }
    done += filled;
    filled = 0;
  };
  const int64_t capacity = static_cast<int64_t>(values.size() / w);
  for (const Run& run : reversed_modes(t.layout).runs()) {
    int64_t slot = t.offset + run.offset, left = run.length;
    while (left > 0) {
      const int64_t n = std::min(left, capacity - filled);
      t.carrier->read_slots(slot, n, values.data() + static_cast<size_t>(filled) * w);
      filled += n;
      slot += n;
      left -= n;
      if (filled == capacity) flush();
    }
  }
  flush();
}

}  // namespace

void save(const std::string& path, const std::vector<std::pair<std::string, TensorPtr>>& tensors,
          const std::map<std::string, std::string>& metadata,
          const std::map<std::string, SaveQuantization>& quantize) {
  io::check_path(path, "safetensors path");
  for (const auto& [name, how] : quantize)
    if (std::none_of(tensors.begin(), tensors.end(), [&](const auto& e) { return e.first == name; }))
      raise<ValueError>("safetensors.save: quantize names tensor '", name, "', which is not among the tensors saved");
  std::vector<TensorSpec> specs;
  std::vector<std::optional<QuantizedOut>> quantized(tensors.size());  // per tensor; its specs are two
  // Each tensor's carrier is claimed for the whole save (the caller may have released the GIL): another thread's
  // release() then raises "... owned by sw.safetensors.save ... (wait for it)" instead of freeing the storage the
  // save is reading, and public writes to it wait for the save too.
  std::vector<Carrier::Claim> claims;
  claims.reserve(tensors.size());
  const std::string owner = "sw.safetensors.save to " + path;
  for (const auto& [name, t] : tensors) {
    if (name.empty()) raise<ValueError>("safetensors.save: a tensor name must not be empty");
    if (!t) raise<ValueError>("safetensors.save: tensor '", name, "' is None");
    if (t->carrier->is_released())
      raise<RuntimeError>("safetensors.save: tensor '", name, "' is over a released ", t->carrier->kind_name(),
                          " carrier; it has no values to save");
    claims.push_back(t->carrier->claim(owner));
    const std::vector<int64_t> extents = t->layout.shape().extents();
    auto how = quantize.find(name);
    if (how == quantize.end()) {
      specs.push_back({name, std::string(element_type_of(t->dtype())), extents});
      continue;
    }
    if (&t->dtype() != &DType::BFloat16() && &t->dtype() != &DType::Float32())
      raise<TypeError>("safetensors.save: tensor '", name, "' is ", t->dtype().name(), "; it is quantized from "
                       "BFloat16 or Float32 values");
    QuantizedOut q{how->second};
    const int64_t C = extents.back();
    if (q.how.format == QuantizedRange::Format::FP8) {
      if (extents.size() < 2 || q.how.block_rows < 1 || q.how.block_cols < 1)
        raise<ValueError>("safetensors.save: tensor '", name, "' of rank ", extents.size(), " cannot be FP8 "
                          "block-scaled (a matrix or a stack of matrices, blocks of at least 1 x 1)");
      q.rows = extents[extents.size() - 2];
      q.cols = C;
      std::vector<int64_t> scale_shape(extents.begin(), extents.end() - 2);
      scale_shape.push_back((q.rows + q.how.block_rows - 1) / q.how.block_rows);
      scale_shape.push_back((C + q.how.block_cols - 1) / q.how.block_cols);
      specs.push_back({name, "F8_E4M3", extents});
      specs.push_back({quantized_scale_name(name, q.how.format), "F32", scale_shape});
    } else {
      if (C % 32 != 0)
        raise<ValueError>("safetensors.save: tensor '", name, "' has a last extent of ", C, ", which is not a multiple "
                          "of 32: MXFP4 quantizes groups of 32 values along the last axis");
      q.cols = C;
      std::vector<int64_t> blocks(extents.begin(), extents.end() - 1), scales = blocks;
      blocks.push_back(C / 32);
      blocks.push_back(16);
      scales.push_back(C / 32);
      specs.push_back({name + "_blocks", "U8", blocks});
      specs.push_back({quantized_scale_name(name, q.how.format), "U8", scales});
    }
    quantized[claims.size() - 1] = q;
  }
  // An FP8 block the reader would not infer from the scales' shape (Note [Quantized tensors of a checkpoint]) is
  // recorded in the metadata, under "fp8_block_size:<scale name>".
  std::map<std::string, std::string> meta = metadata;
  for (size_t k = 0; k < tensors.size(); ++k) {
    if (!quantized[k] || quantized[k]->how.format != QuantizedRange::Format::FP8) continue;
    const QuantizedOut& q = *quantized[k];
    if (fp8_block_by_shape(q.rows, q.cols, (q.rows + q.how.block_rows - 1) / q.how.block_rows,
                           (q.cols + q.how.block_cols - 1) / q.how.block_cols) !=
        std::pair<int64_t, int64_t>{q.how.block_rows, q.how.block_cols})
      meta[std::string(kFp8BlockKey) + quantized_scale_name(tensors[k].first, q.how.format)] =
          "[" + std::to_string(q.how.block_rows) + ", " + std::to_string(q.how.block_cols) + "]";
  }
  std::vector<std::pair<uint64_t, uint64_t>> offsets;
  const std::string header = encode_header(specs, meta, offsets);  // ValueError for repeated names

  const std::filesystem::path target(path);
  const std::string dir = target.parent_path().empty() ? "." : target.parent_path().string();
  // The temporary file is this save's own (process id and a per-process counter, created exclusively): saves of
  // one path from several threads never write into one another's file, so each rename moves a whole file.
  static std::atomic<uint64_t> saves{0};
  std::string temp_name(".");
  temp_name.append(target.filename().string()).append(".tmp-").append(std::to_string(::getpid()));
  temp_name.append("-").append(std::to_string(saves.fetch_add(1, std::memory_order_relaxed)));
  const std::string temp_path = (target.parent_path() / temp_name).string();
  remove_stale_temporaries(dir, target.filename().string());  // Note [A save leaves no temporary]
  TempFile tmp;
  std::string what = temp_path;  // the file's name in messages
  if (proc_fd_links()) {
    const int fd = io::try_open_file(dir, O_TMPFILE | O_WRONLY | O_CLOEXEC, 0644);
    if (fd >= 0) {
      tmp.fd = fd;
      what = "an unnamed temporary file in " + dir;
    } else if (fd != -EOPNOTSUPP && fd != -EISDIR && fd != -EINVAL) {
      io::raise_failure(io::Op::Open, dir, -fd);
    }
  }
  if (tmp.fd < 0) {
    tmp.fd = io::open_file(temp_path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    tmp.path = temp_path;
  }
  io::pwrite_full(tmp.fd, header.data(), header.size(), 0, what);
  const int64_t data_start = static_cast<int64_t>(header.size());
  std::vector<std::byte> buf;
  for (size_t k = 0, spec = 0; k < tensors.size(); ++k, ++spec) {
    const TensorImpl& t = *tensors[k].second;
    if (quantized[k]) {
      QuantizedOut& q = *quantized[k];
      q.data_at = offsets[spec].first;
      q.scale_at = offsets[++spec].first;
      write_quantized(tmp.fd, what, data_start, tensors[k].first, t, q);
      continue;
    }
    const size_t w = slot_bytes(t.dtype());
    buf.resize(std::min(kChunkBytes, std::max<size_t>(w, static_cast<size_t>(t.size()) * w)));
    size_t filled = 0;
    int64_t at = data_start + static_cast<int64_t>(offsets[spec].first);
    auto drain = [&] {
      io::pwrite_full(tmp.fd, buf.data(), filled, at, what);
      at += static_cast<int64_t>(filled);
      filled = 0;
    };
    for (const Run& run : reversed_modes(t.layout).runs()) {
      int64_t slot = t.offset + run.offset, left = run.length;
      while (left > 0) {
        const int64_t n = std::min<int64_t>(left, static_cast<int64_t>((buf.size() - filled) / w));
        t.carrier->read_slots(slot, n, buf.data() + filled);
        filled += static_cast<size_t>(n) * w;
        slot += n;
        left -= n;
        if (filled + w > buf.size()) drain();
      }
    }
    if (filled) drain();
  }
  io::fsync_file(tmp.fd, what);
  claims.clear();  // every value is read
  if (tmp.path.empty()) {  // whole and synced: named now, for the rename below
    const std::string proc = "/proc/self/fd/" + std::to_string(tmp.fd);
    if (::linkat(AT_FDCWD, proc.c_str(), AT_FDCWD, temp_path.c_str(), AT_SYMLINK_FOLLOW) != 0)
      raise<RuntimeError>("linking ", what, " as ", temp_path, " failed: ", std::strerror(errno));
    tmp.path = temp_path;
  }
  ::close(tmp.fd);
  tmp.fd = -1;
  if (::rename(tmp.path.c_str(), path.c_str()) != 0)
    raise<RuntimeError>("rename of ", tmp.path, " to ", path, " failed: ", std::strerror(errno));
  tmp.keep = true;
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {  // the rename is durable once the folder is synced
    ::fsync(dfd);
    ::close(dfd);
  }
}

// Note [Replacing a folder whole]: install_folder moves a finished temporary folder (written beside `target`, in
// the same file system) to `target` in one rename, so `target` is at every moment either the old folder or the new
// one, never a mix and never absent. A new target: renameat2(RENAME_NOREPLACE), which refuses to land on a folder
// that appeared meanwhile (rename(2) would silently replace an empty one). An existing target folder:
// renameat2(RENAME_EXCHANGE) swaps the two folders atomically; the old one, now under the temporary's name, is then
// removed (a crash before that leaves it as a dead writer's temporary, removed by the next save of `target`). The
// temporary and the parent are synced first and after, so the new folder is durable once this returns. A file
// system without RENAME_EXCHANGE (EINVAL) gets two renames instead: the old folder to ".<name>.tmp-<pid>-<n>",
// then the new one to `target`; a crash between them leaves no `target` (the old folder under that name, until
// the next save of `target` removes it).
void install_folder(const std::string& temp, const std::string& target) {
  io::check_path(temp, "temporary folder");
  io::check_path(target, "target folder");
  const std::filesystem::path tpath(target);
  const std::string parent = tpath.parent_path().empty() ? "." : tpath.parent_path().string();
  sync_folder(temp);
  if (::renameat2(AT_FDCWD, temp.c_str(), AT_FDCWD, target.c_str(), RENAME_NOREPLACE) == 0) {
    sync_folder(parent);
    return;
  }
  int e = errno;
  if (e == EINVAL || e == ENOSYS) {  // no RENAME_NOREPLACE here: a target that exists is handled below
    struct stat st;
    if (::lstat(target.c_str(), &st) != 0 && errno == ENOENT) {
      if (::rename(temp.c_str(), target.c_str()) != 0)
        raise<RuntimeError>("rename of ", temp, " to ", target, " failed: ", std::strerror(errno));
      sync_folder(parent);
      return;
    }
    e = EEXIST;
  }
  if (e != EEXIST) raise<RuntimeError>("rename of ", temp, " to ", target, " failed: ", std::strerror(e));
  struct stat st;
  if (::lstat(target.c_str(), &st) != 0)
    raise<RuntimeError>("stat of ", target, " failed: ", std::strerror(errno));
  if (!S_ISDIR(st.st_mode))
    raise<ValueError>(target, " exists and is not a folder; a checkpoint folder replaces only a folder");
  if (::renameat2(AT_FDCWD, temp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
    sync_folder(parent);
    std::error_code ec;
    std::filesystem::remove_all(temp, ec);  // the old folder; a leftover is a dead writer's temporary later
    return;
  }
  e = errno;
  if (e != EINVAL && e != ENOSYS) raise<RuntimeError>("exchange of ", temp, " and ", target, " failed: ", std::strerror(e));
  // The old folder's name follows the temporaries' pattern (a counter of its own, far above the callers'), so a
  // crash that leaves it lets the next save remove it.
  static std::atomic<uint64_t> olds{uint64_t{1} << 40};
  const std::string old = (tpath.parent_path() / ("." + tpath.filename().string() + ".tmp-" +
                                                  std::to_string(::getpid()) + "-" +
                                                  std::to_string(olds.fetch_add(1)))).string();
  std::error_code ec;
  std::filesystem::remove_all(old, ec);
  if (::rename(target.c_str(), old.c_str()) != 0)
    raise<RuntimeError>("rename of ", target, " to ", old, " failed: ", std::strerror(errno));
  if (::rename(temp.c_str(), target.c_str()) != 0) {
    e = errno;
    ::rename(old.c_str(), target.c_str());  // the old folder back
    raise<RuntimeError>("rename of ", temp, " to ", target, " failed: ", std::strerror(e));
  }
  sync_folder(parent);
  std::filesystem::remove_all(old, ec);
}

void remove_stale_folders(const std::string& target) {
  io::check_path(target, "target folder");
  const std::filesystem::path tpath(target);
  const std::string dir = tpath.parent_path().empty() ? "." : tpath.parent_path().string();
  const std::string prefix = "." + tpath.filename().string() + ".tmp-";
  std::vector<std::string> stale;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d))
      if (dead_writers_temporary(e->d_name, prefix)) stale.emplace_back(e->d_name);
    ::closedir(d);
  }
  for (const std::string& name : stale) {
    std::error_code ec;
    std::filesystem::remove_all(std::filesystem::path(dir) / name, ec);  // best effort: another may remove it too
  }
}

}  // namespace sw::safetensors
