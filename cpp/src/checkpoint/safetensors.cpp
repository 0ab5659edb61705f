// The safetensors header: reading, validating (Note [A header is checked
// before any read] in strideweave/checkpoint/safetensors.hpp) and writing.
#include "strideweave/checkpoint/safetensors.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "strideweave/errors.hpp"
#include "strideweave/io.hpp"

namespace sw::safetensors {

namespace {

using json = nlohmann::json;

constexpr std::array<ElementType, 15> kElementTypes{{
    {"BOOL", 1}, {"U8", 1}, {"I8", 1}, {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
    {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4}, {"F64", 8}, {"I64", 8}, {"U64", 8},
}};

constexpr const char* kMetadataKey = "__metadata__";

// Closes a descriptor on every path.
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

uint64_t read_le64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

// Parses JSON, refusing a key that occurs twice in one object (nlohmann::json would keep the last silently, and a
// hostile file could show one range to one reader and another to the next).
json parse_json(std::string_view text, const std::string& where) {
  std::vector<std::set<std::string>> keys;  // one set per open object
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) {
    (void)depth;
    switch (event) {
      case json::parse_event_t::object_start: keys.emplace_back(); break;
      case json::parse_event_t::object_end: keys.pop_back(); break;
      case json::parse_event_t::key:
        if (!keys.back().insert(parsed.get<std::string>()).second)
          raise<ValueError>(where, ": the header names ", parsed.dump(), " twice");
        break;
      default: break;
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), callback);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number beyond double ("1E400")
    raise<ValueError>(where, ": the header is not well-formed JSON (", e.what(), ")");
  }
}

uint64_t unsigned_of(const json& v, const std::string& where, const char* what) {
  if (!v.is_number_unsigned()) raise<ValueError>(where, ": ", what, " must be a non-negative integer, got ", v.dump());
  return v.get<uint64_t>();
}

TensorInfo tensor_of(const std::string& name, const json& entry, uint64_t data_size, const std::string& file) {
  const std::string where = file + ": tensor '" + name + "'";
  if (!entry.is_object()) raise<ValueError>(where, " must be an object, got ", entry.dump());
  for (const auto& [key, _] : entry.items())
    if (key != "dtype" && key != "shape" && key != "data_offsets")
      raise<ValueError>(where, " has an unknown field '", key, "'");
  for (const char* key : {"dtype", "shape", "data_offsets"})
    if (!entry.contains(key)) raise<ValueError>(where, " has no '", key, "'");
  TensorInfo t;
  t.name = name;
  const json& dtype = entry["dtype"];
  if (!dtype.is_string()) raise<ValueError>(where, ": dtype must be a string, got ", dtype.dump());
  t.dtype = dtype.get<std::string>();
  const ElementType* type = element_type(t.dtype);
  if (!type) raise<ValueError>(where, " has an unknown dtype '", t.dtype, "'");
  t.itemsize = type->itemsize;
  const json& shape = entry["shape"];
  if (!shape.is_array()) raise<ValueError>(where, ": shape must be a list, got ", shape.dump());
  uint64_t bytes = static_cast<uint64_t>(t.itemsize);
  for (const json& e : shape) {
    uint64_t extent = unsigned_of(e, where, "a shape extent");
    if (extent > static_cast<uint64_t>(INT64_MAX) || __builtin_mul_overflow(bytes, extent, &bytes))
      raise<ValueError>(where, ": shape ", shape.dump(), " holds more bytes than a file can");
    t.shape.push_back(static_cast<int64_t>(extent));
  }
  const json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2)
    raise<ValueError>(where, ": data_offsets must be [begin, end], got ", offsets.dump());
  uint64_t begin = unsigned_of(offsets[0], where, "data_offsets[0]");
  uint64_t end = unsigned_of(offsets[1], where, "data_offsets[1]");
  if (begin > end) raise<ValueError>(where, ": data_offsets [", begin, ", ", end, "] end before they begin");
  if (end > data_size)
    raise<ValueError>(where, ": data_offsets [", begin, ", ", end, "] run past the end of the data area (",
                      data_size, " bytes)");
  if (end - begin != bytes)
    raise<ValueError>(where, ": shape ", shape.dump(), " of ", t.dtype, " needs ", bytes, " bytes but data_offsets [",
                      begin, ", ", end, "] hold ", end - begin);
  t.begin = begin;
  t.end = end;
  return t;
}

}  // namespace

int64_t TensorInfo::elements() const {
  int64_t n = 1;
  for (int64_t e : shape) n *= e;
  return n;
}

const ElementType* element_type(std::string_view name) {
  for (const ElementType& t : kElementTypes)
    if (t.name == name) return &t;
  return nullptr;
}

const TensorInfo* Header::find(const std::string& name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const TensorInfo& t, const std::string& n) { return t.name < n; });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

const TensorInfo& Header::tensor(const std::string& name) const {
  if (const TensorInfo* t = find(name)) return *t;
  raise<ValueError>(path, " holds no tensor named '", name, "'");
}

Header parse_header(std::string_view prefix, uint64_t file_size, const std::string& path) {
  if (file_size < 8 || prefix.size() < 8)
    raise<ValueError>(path, ": not a safetensors file: ", file_size, " bytes, fewer than the 8-byte header length");
  const uint64_t n = read_le64(prefix.data());
  if (n > kMaxHeaderBytes)
    raise<ValueError>(path, ": the header length ", n, " exceeds the limit of ", kMaxHeaderBytes, " bytes");
  if (n > file_size - 8)
    raise<ValueError>(path, ": the header length ", n, " runs past the end of the file (", file_size, " bytes)");
  if (prefix.size() < 8 + n) raise<ValueError>(path, ": the header was cut short while it was read");
  json root = parse_json(prefix.substr(8, n), path);
  if (!root.is_object()) raise<ValueError>(path, ": the header must be a JSON object, got ", root.type_name());
  Header h;
  h.path = path;
  h.file_size = file_size;
  h.data_start = 8 + n;
  const uint64_t data_size = file_size - h.data_start;
  for (const auto& [key, value] : root.items()) {
    if (key == kMetadataKey) {
      if (!value.is_object()) raise<ValueError>(path, ": __metadata__ must map strings to strings");
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string())
          raise<ValueError>(path, ": __metadata__ must map strings to strings; '", mk, "' holds ", mv.dump());
        h.metadata.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    h.tensors.push_back(tensor_of(key, value, data_size, path));
  }
  // nlohmann::json keeps object keys sorted, so tensors are sorted by name already; sort anyway so the
  // lookup does not rest on a library detail.
  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
  std::vector<const TensorInfo*> by_offset;
  for (const TensorInfo& t : h.tensors)
    if (t.end > t.begin) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i]->begin < by_offset[i - 1]->end)
      raise<ValueError>(path, ": tensors '", by_offset[i - 1]->name, "' [", by_offset[i - 1]->begin, ", ",
                        by_offset[i - 1]->end, ") and '", by_offset[i]->name, "' [", by_offset[i]->begin, ", ",
                        by_offset[i]->end, ") overlap");
  for (TensorInfo& t : h.tensors) {
    t.begin += h.data_start;
    t.end += h.data_start;
  }
  return h;
}

Header read_header(const std::string& path) {
  io::check_path(path, "safetensors path");
  Fd f{io::open_file(path, O_RDONLY | O_CLOEXEC)};
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) raise<RuntimeError>("fstat of ", path, " failed: ", std::strerror(errno));
  if (!S_ISREG(st.st_mode)) raise<ValueError>(path, ": not a regular file");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) return parse_header(std::string_view(), size, path);  // raises with the file's size
  char len[8];
  io::pread_full(f.fd, len, 8, 0, path);
  const uint64_t n = read_le64(len);
  if (n > kMaxHeaderBytes || n > size - 8) return parse_header(std::string_view(len, 8), size, path);  // raises
  std::string prefix(8 + n, '\0');
  std::memcpy(prefix.data(), len, 8);
  if (n) io::pread_full(f.fd, prefix.data() + 8, n, 8, path);
  return parse_header(prefix, size, path);
}

std::map<std::string, std::string> read_index(const std::string& path) {
  io::check_path(path, "safetensors index path");
  Fd f{io::open_file(path, O_RDONLY | O_CLOEXEC)};
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) raise<RuntimeError>("fstat of ", path, " failed: ", std::strerror(errno));
  if (static_cast<uint64_t>(st.st_size) > kMaxHeaderBytes)
    raise<ValueError>(path, ": the index is larger than ", kMaxHeaderBytes, " bytes");
  std::string text(static_cast<size_t>(st.st_size), '\0');
  if (!text.empty()) io::pread_full(f.fd, text.data(), text.size(), 0, path);
  json root = parse_json(text, path);
  if (!root.is_object() || !root.contains("weight_map") || !root["weight_map"].is_object())
    raise<ValueError>(path, ": an index must be a JSON object with a 'weight_map' object");
  std::map<std::string, std::string> out;
  for (const auto& [name, file] : root["weight_map"].items()) {
    if (!file.is_string()) raise<ValueError>(path, ": weight_map['", name, "'] must be a file name, got ", file.dump());
    std::string f_name = file.get<std::string>();
    if (f_name.empty() || f_name.find('/') != std::string::npos || f_name == "." || f_name == "..")
      raise<ValueError>(path, ": weight_map['", name, "'] must name a file in the index's folder, got '", f_name, "'");
    out.emplace(name, std::move(f_name));
  }
  return out;
}

std::string encode_header(const std::vector<TensorSpec>& tensors, const std::map<std::string, std::string>& metadata,
                          std::vector<std::pair<uint64_t, uint64_t>>& offsets) {
  json root = json::object();
  if (!metadata.empty()) root[kMetadataKey] = metadata;
  offsets.clear();
  uint64_t at = 0;
  for (const TensorSpec& t : tensors) {
    if (t.name == kMetadataKey) raise<ValueError>("safetensors: the tensor name '", kMetadataKey, "' is reserved");
    if (root.contains(t.name)) raise<ValueError>("safetensors: the tensor name '", t.name, "' occurs twice");
    const ElementType* type = element_type(t.dtype);
    if (!type) raise<ValueError>("safetensors: tensor '", t.name, "' has an unknown dtype '", t.dtype, "'");
    uint64_t bytes = static_cast<uint64_t>(type->itemsize);
    for (int64_t e : t.shape) {
      if (e < 0) raise<ValueError>("safetensors: tensor '", t.name, "' has a negative extent");
      if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(e), &bytes))
        raise<ValueError>("safetensors: tensor '", t.name, "' is too large");
    }
    offsets.emplace_back(at, at + bytes);
    root[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {at, at + bytes}}};
    at += bytes;
  }
  std::string text = root.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + text;
}

}  // namespace sw::safetensors
