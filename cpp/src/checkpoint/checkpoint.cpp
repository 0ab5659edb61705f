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

void Checkpoint::add_file(const std::string& path, const std::map<std::string, std::string>* expected) {
  Header h = read_header(path);
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

const DType& Checkpoint::dtype(const std::string& name) const {
  const TensorInfo& t = info(name);
  if (const DType* d = dtype_of(t.dtype)) return *d;
  raise<TypeError>("tensor '", name, "' holds ", t.dtype, " elements, which StrideWeave has no dtype for");
}

const std::shared_ptr<CheckpointFile>& Checkpoint::file(size_t index, bool writable) {
  std::lock_guard lock(mutex_);
  auto& slot = writable ? writers_[index] : readers_[index];
  if (!slot) slot = std::make_shared<CheckpointFile>(headers_[index].path, writable);
  return slot;
}

std::shared_ptr<CheckpointCarrier> Checkpoint::tier(const std::vector<std::string>& names,
                                                    CheckpointCarrier::Writes writes) {
  if (names.empty()) raise<ValueError>("a checkpoint tier needs at least one tensor name");
  const TensorInfo& first = info(names[0]);
  const DType& d = dtype(names[0]);
  std::vector<std::string> sorted = names;
  std::sort(sorted.begin(), sorted.end());
  if (auto dup = std::adjacent_find(sorted.begin(), sorted.end()); dup != sorted.end())
    raise<ValueError>("tensor '", *dup, "' is named twice; each tile is a distinct tensor");
  std::vector<CheckpointCarrier::Range> ranges;
  ranges.reserve(names.size());
  const bool in_place = writes == CheckpointCarrier::Writes::InPlace;
  for (const std::string& name : names) {
    const TensorInfo& t = info(name);
    if (t.dtype != first.dtype || t.shape != first.shape)
      raise<ValueError>("tensor '", name, "' (", t.dtype, " ", shape_str(t.shape), ") differs from '", names[0], "' (",
                        first.dtype, " ", shape_str(first.shape), "): the tiles of one tensor share dtype and shape");
    ranges.push_back({file(where_.at(name), in_place), t.begin, t.elements()});
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
