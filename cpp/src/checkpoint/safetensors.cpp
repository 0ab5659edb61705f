// The safetensors header: reading, validating (Note [A header is checked
// before any read] in strideweave/checkpoint/safetensors.hpp) and writing.
#include "strideweave/checkpoint/safetensors.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>

#include "strideweave/errors.hpp"
#include "strideweave/io.hpp"

namespace sw::safetensors {

namespace {

using json = nlohmann::json;

constexpr std::array<ElementType, 16> kElementTypes{{
    {"BOOL", 1}, {"U8", 1}, {"I8", 1}, {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"F8_E8M0", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
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

// Note [A header is parsed in linear time and bounded depth]: a header is
// parsed by nlohmann::json's SAX parser (iterative: no recursion however deep
// the text nests) into a document built here, not by its DOM parser with a
// callback. That callback parser, after every object ends, scans the
// enclosing object from its start for a discarded value: quadratic in the
// number of tensors (20,000 tensors took 6 s to open, a crafted header of
// 300,000 empty entries did not finish in 200 s). Building the document here
// costs one map insertion per key, which also finds a key given twice (the
// DOM parser would keep the last silently, and a hostile file could show one
// range to one reader and another to the next). Nesting deeper than
// kMaxJsonDepth is refused while parsing, before any value that deep exists:
// every recursive walk of the document (dump, comparisons) is then bounded,
// where a value nested 100,000 deep once overflowed the stack while its error
// message was formatted. A well-formed safetensors header nests 3 deep (the
// header, an entry, its shape), an index 3 (weight_map; metadata); the bound
// is serde_json's, which the reference implementation parses with. Values
// and names quoted in messages are cut to kQuoteChars (quote(), clip()).
constexpr size_t kMaxJsonDepth = 128;
constexpr size_t kQuoteChars = 200;

// `text` cut to about kQuoteChars bytes at a UTF-8 character boundary, saying how much was left out.
std::string clip(const std::string& text) {
  if (text.size() <= kQuoteChars) return text;
  size_t cut = kQuoteChars;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;  // not inside a character
  return text.substr(0, cut) + "... (" + std::to_string(text.size()) + " bytes)";
}

// Appends at most about `limit` characters of `v` as JSON (ASCII only: non-ASCII characters escaped).
void quote_into(const json& v, std::string& out, size_t limit) {
  if (out.size() >= limit) return;
  switch (v.type()) {
    case json::value_t::object: {
      out += '{';
      bool first = true;
      for (const auto& [k, x] : v.items()) {
        if (out.size() >= limit) break;
        if (!first) out += ", ";
        first = false;
        quote_into(json(k.size() > limit ? k.substr(0, limit) : k), out, limit);
        out += ": ";
        quote_into(x, out, limit);
      }
      out += '}';
      return;
    }
    case json::value_t::array: {
      out += '[';
      bool first = true;
      for (const json& x : v) {
        if (out.size() >= limit) break;
        if (!first) out += ", ";
        first = false;
        quote_into(x, out, limit);
      }
      out += ']';
      return;
    }
    case json::value_t::string: {
      const auto& str = v.get_ref<const std::string&>();
      out += json(str.size() > limit ? str.substr(0, limit) : str).dump(-1, ' ', true, json::error_handler_t::replace);
      return;
    }
    default: out += v.dump(); return;  // a number, a boolean or null: short
  }
}

// `v` as JSON for a message: at most about kQuoteChars characters ("..." where it was cut).
std::string quote(const json& v) {
  std::string out;
  quote_into(v, out, kQuoteChars);
  if (out.size() > kQuoteChars) {
    out.resize(kQuoteChars);
    out += "...";
  }
  return out;
}

// A member of the root object, handed over as soon as it is parsed (its key and value may be moved from).
using MemberSink = std::function<void(std::string& key, json& value)>;

// Builds the document of Note [A header is parsed in linear time and bounded depth]. With a MemberSink, the root
// object's members are handed to it one by one and not kept in the root (a header's tensors go straight to their
// TensorInfo: no document of 20,000 entries is built, sorted and destroyed); the sink then finds a key given twice.
class HeaderBuilder final : public nlohmann::json_sax<json> {
 public:
  HeaderBuilder(json& root, const std::string& where, MemberSink sink)
      : root_(root), where_(where), sink_(std::move(sink)) {}

  bool null() override { return put(json(nullptr)); }
  bool boolean(bool v) override { return put(json(v)); }
  bool number_integer(number_integer_t v) override { return put(json(v)); }
  bool number_unsigned(number_unsigned_t v) override { return put(json(v)); }
  bool number_float(number_float_t v, const string_t&) override { return put(json(v)); }
  bool string(string_t& v) override { return put(json(std::move(v))); }
  bool binary(binary_t&) override { return false; }  // JSON text has none
  bool start_object(std::size_t) override { return open(json::object()); }
  bool start_array(std::size_t) override { return open(json::array()); }
  bool end_object() override { return close(); }
  bool end_array() override { return close(); }
  bool key(string_t& k) override {
    if (streaming()) {
      member_key_ = std::move(k);
      slot_ = &member_;
      return true;
    }
    auto [it, fresh] = stack_.back()->get_ref<json::object_t&>().emplace(std::move(k), nullptr);
    if (!fresh) raise<ValueError>(where_, ": the header names ", quote(json(it->first)), " twice");
    slot_ = &it->second;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    raise<ValueError>(where_, ": the header is not well-formed JSON (", clip(e.what()), ")");
  }

 private:
  // Whether the value being parsed is a member of the root object that goes to the sink.
  bool streaming() const { return sink_ && stack_.size() == 1 && stack_.back() == &root_ && root_.is_object(); }
  // The place of the next value: the root, the slot of the last key, or a new element of the open array.
  json& place() {
    if (stack_.empty()) return root_;
    json& top = *stack_.back();
    if (top.is_array()) {
      top.get_ref<json::array_t&>().emplace_back(nullptr);
      return top.get_ref<json::array_t&>().back();
    }
    return *slot_;
  }
  bool put(json&& v) {
    const bool member = streaming();
    place() = std::move(v);
    if (member) hand_over();
    return true;
  }
  bool open(json&& v) {
    if (stack_.size() >= kMaxJsonDepth)
      raise<ValueError>(where_, ": the header nests objects and lists deeper than ", kMaxJsonDepth, " levels");
    json& at = place();
    at = std::move(v);
    stack_.push_back(&at);  // stays valid: a value's address changes only while it is an open array's last element,
    return true;            // and an open array gains no element while a value inside it is open
  }
  bool close() {
    stack_.pop_back();
    if (streaming()) hand_over();  // the member just closed was the root's
    return true;
  }
  void hand_over() {
    sink_(member_key_, member_);
    member_ = json();
  }

  json& root_;
  const std::string& where_;
  MemberSink sink_;
  std::vector<json*> stack_;  // the open objects and arrays, outermost first
  json* slot_ = nullptr;      // the value of the open object's last key
  std::string member_key_;    // with a sink: the root member being parsed
  json member_;
};

// Parses `text` (ValueError naming `where` when it is not well-formed JSON, nests too deep, or gives a key twice;
// with a sink, a key of the root object given twice is the sink's to find).
json parse_json(std::string_view text, const std::string& where, MemberSink sink = nullptr) {
  json root;
  HeaderBuilder builder(root, where, std::move(sink));
  try {
    json::sax_parse(text.begin(), text.end(), &builder);
  } catch (const json::exception& e) {
    raise<ValueError>(where, ": the header is not well-formed JSON (", clip(e.what()), ")");
  }
  return root;
}

uint64_t unsigned_of(const json& v, const std::string& where, const char* what) {
  if (!v.is_number_unsigned()) raise<ValueError>(where, ": ", what, " must be a non-negative integer, got ", quote(v));
  return v.get<uint64_t>();
}

// `name` is moved from.
TensorInfo tensor_of(std::string& name, const json& entry, uint64_t data_size, const std::string& file) {
  const std::string where = file + ": tensor '" + clip(name) + "'";
  if (!entry.is_object()) raise<ValueError>(where, " must be an object, got ", quote(entry));
  for (const auto& [key, _] : entry.items())
    if (key != "dtype" && key != "shape" && key != "data_offsets")
      raise<ValueError>(where, " has an unknown field '", clip(key), "'");
  for (const char* key : {"dtype", "shape", "data_offsets"})
    if (!entry.contains(key)) raise<ValueError>(where, " has no '", key, "'");
  TensorInfo t;
  const json& dtype = entry["dtype"];
  if (!dtype.is_string()) raise<ValueError>(where, ": dtype must be a string, got ", quote(dtype));
  t.dtype = dtype.get<std::string>();
  const ElementType* type = element_type(t.dtype);
  if (!type) raise<ValueError>(where, " has an unknown dtype '", clip(t.dtype), "'");
  t.itemsize = type->itemsize;
  const json& shape = entry["shape"];
  if (!shape.is_array()) raise<ValueError>(where, ": shape must be a list, got ", quote(shape));
  uint64_t bytes = static_cast<uint64_t>(t.itemsize);
  for (const json& e : shape) {
    uint64_t extent = unsigned_of(e, where, "a shape extent");
    if (extent > static_cast<uint64_t>(INT64_MAX) || __builtin_mul_overflow(bytes, extent, &bytes))
      raise<ValueError>(where, ": shape ", quote(shape), " holds more bytes than a file can");
    t.shape.push_back(static_cast<int64_t>(extent));
  }
  const json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2)
    raise<ValueError>(where, ": data_offsets must be [begin, end], got ", quote(offsets));
  uint64_t begin = unsigned_of(offsets[0], where, "data_offsets[0]");
  uint64_t end = unsigned_of(offsets[1], where, "data_offsets[1]");
  if (begin > end) raise<ValueError>(where, ": data_offsets [", begin, ", ", end, "] end before they begin");
  if (end > data_size)
    raise<ValueError>(where, ": data_offsets [", begin, ", ", end, "] run past the end of the data area (",
                      data_size, " bytes)");
  if (end - begin != bytes)
    raise<ValueError>(where, ": shape ", quote(shape), " of ", t.dtype, " needs ", bytes, " bytes but data_offsets [",
                      begin, ", ", end, "] hold ", end - begin);
  t.begin = begin;
  t.end = end;
  t.name = std::move(name);
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
  Header h;
  h.path = path;
  h.file_size = file_size;
  h.data_start = 8 + n;
  const uint64_t data_size = file_size - h.data_start;
  bool has_metadata = false;
  // Note [A header is parsed in linear time and bounded depth]: each entry is checked as soon as it is parsed.
  json root = parse_json(prefix.substr(8, n), path, [&](std::string& key, json& value) {
    if (key == kMetadataKey) {
      if (has_metadata) raise<ValueError>(path, ": the header names \"", kMetadataKey, "\" twice");
      has_metadata = true;
      if (!value.is_object()) raise<ValueError>(path, ": __metadata__ must map strings to strings");
      for (auto& [mk, mv] : value.items()) {
        if (!mv.is_string())
          raise<ValueError>(path, ": __metadata__ must map strings to strings; '", clip(mk), "' holds ", quote(mv));
        h.metadata.emplace(mk, std::move(mv.get_ref<std::string&>()));
      }
      return;
    }
    h.tensors.push_back(tensor_of(key, value, data_size, path));
  });
  if (!root.is_object()) raise<ValueError>(path, ": the header must be a JSON object, got ", root.type_name());
  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
  for (size_t i = 1; i < h.tensors.size(); ++i)
    if (h.tensors[i].name == h.tensors[i - 1].name)
      raise<ValueError>(path, ": the header names ", quote(json(h.tensors[i].name)), " twice");
  std::vector<const TensorInfo*> by_offset;
  for (const TensorInfo& t : h.tensors)
    if (t.end > t.begin) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i]->begin < by_offset[i - 1]->end)
      raise<ValueError>(path, ": tensors '", clip(by_offset[i - 1]->name), "' [", by_offset[i - 1]->begin, ", ",
                        by_offset[i - 1]->end, ") and '", clip(by_offset[i]->name), "' [", by_offset[i]->begin, ", ",
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
    if (!file.is_string()) raise<ValueError>(path, ": weight_map['", clip(name), "'] must be a file name, got ", quote(file));
    std::string f_name = file.get<std::string>();
    if (f_name.empty() || f_name.find('/') != std::string::npos || f_name == "." || f_name == "..")
      raise<ValueError>(path, ": weight_map['", clip(name), "'] must name a file in the index's folder, got '",
                        clip(f_name), "'");
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
