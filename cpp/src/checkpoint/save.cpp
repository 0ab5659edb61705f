// Writing a safetensors file (Note [Saving a checkpoint] in strideweave/checkpoint/safetensors.hpp).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

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

// Removes the temporary file unless disarmed.
struct TempFile {
  std::string path;
  int fd = -1;
  bool keep = false;
  ~TempFile() {
    if (fd >= 0) ::close(fd);
    if (!keep) ::unlink(path.c_str());
  }
};

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

void save(const std::string& path, const std::vector<std::pair<std::string, TensorPtr>>& tensors,
          const std::map<std::string, std::string>& metadata) {
  io::check_path(path, "safetensors path");
  std::vector<TensorSpec> specs;
  for (const auto& [name, t] : tensors) {
    if (name.empty()) raise<ValueError>("safetensors.save: a tensor name must not be empty");
    if (!t) raise<ValueError>("safetensors.save: tensor '", name, "' is None");
    t->carrier->check_live("save it");
    specs.push_back({name, std::string(element_type_of(t->dtype())), t->layout.shape().extents()});
  }
  std::vector<std::pair<uint64_t, uint64_t>> offsets;
  const std::string header = encode_header(specs, metadata, offsets);  // ValueError for repeated names

  const std::filesystem::path target(path);
  // The temporary file is this save's own (process id and a per-process counter, created exclusively): saves of
  // one path from several threads never write into one another's file, so each rename moves a whole file.
  static std::atomic<uint64_t> saves{0};
  TempFile tmp;
  std::string temp_name(".");
  temp_name.append(target.filename().string()).append(".tmp-").append(std::to_string(::getpid()));
  temp_name.append("-").append(std::to_string(saves.fetch_add(1, std::memory_order_relaxed)));
  tmp.path = (target.parent_path() / temp_name).string();
  tmp.fd = io::open_file(tmp.path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  io::pwrite_full(tmp.fd, header.data(), header.size(), 0, tmp.path);
  const int64_t data_start = static_cast<int64_t>(header.size());
  std::vector<std::byte> buf;
  for (size_t k = 0; k < tensors.size(); ++k) {
    const TensorImpl& t = *tensors[k].second;
    const size_t w = slot_bytes(t.dtype());
    buf.resize(std::min(kChunkBytes, std::max<size_t>(w, static_cast<size_t>(t.size()) * w)));
    size_t filled = 0;
    int64_t at = data_start + static_cast<int64_t>(offsets[k].first);
    auto drain = [&] {
      io::pwrite_full(tmp.fd, buf.data(), filled, at, tmp.path);
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
  io::fsync_file(tmp.fd, tmp.path);
  ::close(tmp.fd);
  tmp.fd = -1;
  if (::rename(tmp.path.c_str(), path.c_str()) != 0)
    raise<RuntimeError>("rename of ", tmp.path, " to ", path, " failed: ", std::strerror(errno));
  tmp.keep = true;
  const std::string dir = target.parent_path().empty() ? "." : target.parent_path().string();
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {  // the rename is durable once the folder is synced
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace sw::safetensors
