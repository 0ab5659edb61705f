// Opening a safetensors checkpoint (Note [Opening a checkpoint] in
// strideweave/checkpoint/safetensors.hpp) and its tiers.
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>

#include "strideweave/checkpoint/safetensors.hpp"
#include "strideweave/errors.hpp"

namespace sw::safetensors {

namespace fs = std::filesystem;

namespace {
constexpr const char* kIndexName = "model.safetensors.index.json";

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

bool is_directory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
}  // namespace

const DType* dtype_of(std::string_view element_type) {
  if (element_type == "F32") return &DType::Float32();
  if (element_type == "I32") return &DType::Int32();
  if (element_type == "BOOL") return &DType::Bool();
  if (element_type == "BF16") return &DType::BFloat16();
  if (element_type == "F16") return &DType::Float16();
  return nullptr;
}

// Note [A checkpoint is the file it parsed]: a header's offsets describe one version of one file. Another save of
// the same path (a temporary file renamed over it) puts a different file, with different offsets, at that name; a
// tier opened by name after that would read garbage and, writing in place, write the new file's header over.
// So a checkpoint records the identity (device, inode, size, modification time) of each file it read a header
// from (stat before and after the read: a file changed during the read is refused), and every file it opens later
// (lazily: readers for tensor() and tiled(), a writer for tiled(mutable=True)) must be that file, its name must
// still lead to it, and it must be unchanged, else RuntimeError naming the file and what could not be done;
// nothing is opened for writing or written. The modification time is compared until this checkpoint opens the
// file for writing (its own in-place writes and a journal's replay change it). A tier made earlier keeps the file
// it opened: an overlay tier reads the version it parsed; an in-place tier refuses promotion, eviction and flush
// once the name leads elsewhere (CheckpointCarrier::read_slots, check_storage_intact).
void Checkpoint::add_file(const std::string& path, const std::map<std::string, std::string>* expected) {
  const std::optional<FileIdentity> before = identity_at(path);
  Header h = read_header(path);
  const std::optional<FileIdentity> after = identity_at(path);
  if (!before || !after || !(*before == *after))
    raise<RuntimeError>("checkpoint file ", path, " changed while its header was read (another program wrote, "
                        "replaced or removed it); open it again");
  const size_t index = headers_.size();
  for (const TensorInfo& t : h.tensors) {
    auto [it, fresh] = where_.emplace(t.name, index);
    if (!fresh)
      raise<ValueError>("tensor '", t.name, "' is held by both ", headers_[it->second].path, " and ", path,
                        "; a checkpoint holds each name once");
  }
  if (expected)
    for (const auto& [name, file] : *expected) {
      auto it = where_.find(name);
      if (fs::path(path).filename() == file && (it == where_.end() || it->second != index))
        raise<ValueError>(kIndexName, " places tensor '", name, "' in ", path, ", which does not hold it");
    }
  for (const auto& [k, v] : h.metadata) metadata_.emplace(k, v);  // the first file's value wins
  headers_.push_back(std::move(h));
  identities_.push_back(*after);
  readers_.push_back(nullptr);
  writers_.push_back(nullptr);
}

std::shared_ptr<Checkpoint> Checkpoint::open(const std::vector<std::string>& paths) {
  if (paths.empty()) raise<ValueError>("safetensors.open needs a file, a list of files or a folder");
  std::shared_ptr<Checkpoint> c(new Checkpoint());
  if (paths.size() == 1 && is_directory(paths[0])) {
    const fs::path dir(paths[0]);
    const fs::path index = dir / kIndexName;
    if (fs::exists(index)) {
      const auto map = read_index(index.string());
      std::vector<std::string> files;
      for (const auto& [name, file] : map) files.push_back(file);
      std::sort(files.begin(), files.end());
      files.erase(std::unique(files.begin(), files.end()), files.end());
      for (const std::string& f : files) c->add_file((dir / f).string(), &map);
      for (const auto& [name, file] : map)
        if (!c->contains(name))
          raise<ValueError>(index.string(), " names tensor '", name, "' in ", file, ", which does not hold it");
    } else {
      std::vector<std::string> files;
      for (const auto& e : fs::directory_iterator(dir))
        if (e.path().extension() == ".safetensors") files.push_back(e.path().string());
      if (files.empty())
        raise<ValueError>(paths[0], " holds neither ", kIndexName, " nor any .safetensors file");
      std::sort(files.begin(), files.end());
      for (const std::string& f : files) c->add_file(f, nullptr);
    }
  } else {
    for (const std::string& p : paths) {
      if (is_directory(p)) raise<ValueError>(p, " is a folder; give a folder alone, or a list of files");
      c->add_file(p, nullptr);
    }
  }
  for (const auto& [name, _] : c->where_) c->keys_.push_back(name);
  return c;
}

const TensorInfo& Checkpoint::info(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) {
    const std::string where = headers_.size() == 1 ? headers_[0].path : std::to_string(headers_.size()) + " files";
    raise<ValueError>("the checkpoint (", where, ") holds no tensor named '", name, "'");
  }
  return headers_[it->second].tensor(name);
}

const std::string& Checkpoint::file_of(const std::string& name) const {
  info(name);
  return headers_[where_.at(name)].path;
}

std::shared_ptr<CheckpointFile> Checkpoint::file(size_t index, bool writable, const char* action) {
  std::lock_guard lock(mutex_);
  const std::string& path = headers_[index].path;
  const FileIdentity& parsed = identities_[index];
  // Note [A checkpoint is the file it parsed].
  auto check = [&](const FileIdentity& now, bool written) {
    if (!now.same_file(parsed))
      raise<RuntimeError>("checkpoint file ", path, " was replaced by another file since sw.safetensors.open read its "
                          "header; cannot ", action, ": its tensors' offsets describe the file it replaced (open it "
                          "again)");
    if (now.size != parsed.size)
      raise<RuntimeError>("checkpoint file ", path, " changed size since sw.safetensors.open read its header (",
                          parsed.size, " bytes then, ", now.size, " now); cannot ", action, " (open it again)");
    if (!written && now.mtime_ns != parsed.mtime_ns)
      raise<RuntimeError>("checkpoint file ", path, " was modified since sw.safetensors.open read its header; cannot ",
                          action, ": its header may no longer describe it (open it again)");
  };
  auto& slot = writable ? writers_[index] : readers_[index];
  if (!slot) {
    auto f = std::make_shared<CheckpointFile>(path, writable);  // a writer replays a crash's journal here
    check(f->identity_at_open(), writers_[index] != nullptr);
    slot = std::move(f);
  }
  const std::optional<FileIdentity> now = identity_at(path);
  if (!now)
    raise<RuntimeError>("checkpoint file ", path, " is no longer there (removed or renamed since sw.safetensors.open "
                        "read its header); cannot ", action);
  check(*now, writers_[index] != nullptr);
  return slot;
}

const DType& Checkpoint::dtype(const std::string& name) const {
  const TensorInfo& t = info(name);
  if (const DType* d = dtype_of(t.dtype)) return *d;
  if (t.dtype == "F8_E4M3" || (t.dtype == "U8" && name.size() > 7 && name.ends_with("_blocks")))
    raise<TypeError>("tensor '", name, "' holds quantized ", t.dtype, " elements, which StrideWeave dequantizes on "
                     "promotion: open it with tiled(..., dtype=BFloat16 or Float32)");
  raise<TypeError>("tensor '", name, "' holds ", t.dtype, " elements, which StrideWeave has no dtype for");
}

std::shared_ptr<CheckpointCarrier> Checkpoint::tier(const std::vector<std::string>& names,
                                                    CheckpointCarrier::Writes writes, const TierOptions& options) {
  if (names.empty()) raise<ValueError>("a checkpoint tier needs at least one tensor name");
  if (!options.scales.empty() && options.scales.size() != names.size())
    raise<ValueError>("scales names ", options.scales.size(), " tensors for ", names.size(), " tensor names; give one "
                      "scale tensor per name");
  std::vector<std::string> sorted = names;
  std::sort(sorted.begin(), sorted.end());
  if (auto dup = std::adjacent_find(sorted.begin(), sorted.end()); dup != sorted.end())
    raise<ValueError>("tensor '", *dup, "' is named twice; each tile is a distinct tensor");
  auto scale_of = [&](size_t i) { return options.scales.empty() ? std::string() : options.scales[i]; };
  // Note [Quantized tensors of a checkpoint]: every name checked (headers only) before any scale is read.
  if (std::optional<Quantization> q0 = quantization(names[0], scale_of(0), options.block_rows, options.block_cols)) {
    const DType& d = quantized_dtype(*q0, writes, options);
    if (q0->format == QuantizedRange::Format::FP8 && q0->shape.size() != 2)
      raise<ValueError>("tensor '", q0->data, "' (FP8 of shape ", shape_str(q0->shape), ") is a stack of matrices: "
                        "give its name alone to split it into one tile per matrix, or name matrices");
    std::vector<Quantization> qs{*q0};
    for (size_t i = 1; i < names.size(); ++i) {
      std::optional<Quantization> q = quantization(names[i], scale_of(i), options.block_rows, options.block_cols);
      if (!q || q->format != q0->format || q->shape != q0->shape || q->block_rows != q0->block_rows ||
          q->block_cols != q0->block_cols)
        raise<ValueError>("tensor '", names[i], "' (", q ? "quantized as another" : "not quantized", ", shape ",
                          shape_str(q ? q->shape : info(names[i]).shape), ") differs from '", names[0], "' (",
                          shape_str(q0->shape), "): the tiles of one tensor share format and shape");
      qs.push_back(std::move(*q));
    }
    std::vector<CheckpointCarrier::Range> ranges;
    ranges.reserve(qs.size());
    for (const Quantization& q : qs) ranges.push_back(quantized_range(q, 0, 1));
    return std::make_shared<CheckpointCarrier>(std::move(ranges), d, writes);
  }
  const TensorInfo& first = info(names[0]);
  const DType& d = dtype(names[0]);
  if (options.dtype && options.dtype != &d)
    raise<TypeError>("tensor '", names[0], "' is ", d.name(), ", not ", options.dtype->name(), ": nothing converts "
                     "implicitly (give its own dtype, or none)");
  std::vector<CheckpointCarrier::Range> ranges;
  ranges.reserve(names.size());
  const bool in_place = writes == CheckpointCarrier::Writes::InPlace;
  for (const std::string& name : names) {
    const TensorInfo& t = info(name);
    if (t.dtype != first.dtype || t.shape != first.shape)
      raise<ValueError>("tensor '", name, "' (", t.dtype, " ", shape_str(t.shape), ") differs from '", names[0], "' (",
                        first.dtype, " ", shape_str(first.shape), "): the tiles of one tensor share dtype and shape");
    ranges.push_back({file(where_.at(name), in_place, "make a tier over it"), t.begin, t.elements(), nullptr});
  }
  return std::make_shared<CheckpointCarrier>(std::move(ranges), d, writes);
}

uint64_t Checkpoint::bytes_read() const {
  std::lock_guard lock(mutex_);
  uint64_t n = 0;
  for (const auto& f : readers_)
    if (f) n += f->bytes_read();
  for (const auto& f : writers_)
    if (f) n += f->bytes_read();
  return n;
}

}  // namespace sw::safetensors
