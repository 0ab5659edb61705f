// Safetensors header parsing (strideweave/checkpoint/safetensors.hpp, Note [A header is checked before any read])
// and the checkpoints and indexes built on it, under libFuzzer. The first byte picks the form of the input: raw
// file bytes, hostile JSON under a correct length prefix, a header built from decisions (truncated, oversized
// lengths, overlapping or misaligned ranges, unknown dtypes, ...) or an index. A parse either raises ValueError or
// returns a header whose ranges lie in the data area, do not overlap and hold shape * itemsize bytes; an accepted
// file opens as a Checkpoint whose tensors read back the file's bytes (docs/reliability.md, "Coverage-guided
// fuzzing").
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_input.hpp"
#include "strideweave/checkpoint/safetensors.hpp"

using namespace sw;
using namespace sw::safetensors;
using fuzz::Input;

namespace {

const char* const kDtypes[] = {"BF16", "F32", "F16", "F64", "I32", "I64", "U8", "I8", "BOOL", "U16", "I16", "U32",
                               "U64", "F8_E5M2", "F8_E4M3", "bf16", "F128", "", "C64"};

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

std::string json_string(Input& in) {
  static const char* const names[] = {"a", "b", "w", "__metadata__", "", "a\\u0000b", "model.layers.0.w", "\\ud800",
                                      "\\u00e9"};
  return std::string("\"") + names[in.below(std::size(names))] + "\"";
}

// A header whose form comes from the input: mostly well formed, with every rule broken now and then.
std::string built_file(Input& in) {
  const size_t count = in.below(5);
  uint64_t at = 0;
  std::string json = "{";
  std::vector<std::string> used;
  for (size_t k = 0; k < count; ++k) {
    std::string name = "t" + std::to_string(k);
    if (in.byte() > 240) name = used.empty() ? "__metadata__" : used[in.below(used.size())];
    used.push_back(name);
    const char* dtype = in.byte() < 200 ? kDtypes[in.below(5)] : kDtypes[in.below(std::size(kDtypes))];
    const ElementType* type = element_type(dtype);
    const uint64_t itemsize = type ? type->itemsize : 4;
    std::vector<int64_t> shape(in.below(4));
    uint64_t bytes = itemsize;
    for (auto& e : shape) bytes *= static_cast<uint64_t>(e = in.extent(5) & 0xffff);
    uint64_t begin = at, end = at + bytes;
    switch (in.byte() % 12) {
      case 0: begin += in.below(3); end += in.below(3); break;   // misaligned, sized wrongly
      case 1: begin = begin >= 2 ? begin - 2 : 0; end = begin + bytes; break;  // overlapping
      case 2: std::swap(begin, end); break;
      case 3: end = begin + static_cast<uint64_t>(in.extent(1000)); break;
      default: break;
    }
    at = end > at ? end : at;
    if (!json.empty() && json.back() != '{') json += ",";
    json += "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":[";
    for (size_t j = 0; j < shape.size(); ++j) json += (j ? "," : "") + std::to_string(shape[j]);
    json += "],\"data_offsets\":[" + std::to_string(begin) + "," + std::to_string(end) + "]";
    switch (in.byte() % 16) {
      case 0: json += ",\"extra\":1"; break;
      case 1: json += ",\"shape\":[1]"; break;
      default: break;
    }
    json += "}";
  }
  if (in.byte() % 4 == 0) json += std::string(json.size() > 1 ? "," : "") + "\"__metadata__\":{" + json_string(in) +
                                  ":" + (in.flag() ? json_string(in) : std::string("1")) + "}";
  json += "}";
  json.append(in.below(8), ' ');
  uint64_t n = json.size();
  switch (in.byte() % 10) {
    case 0: n += in.below(16); break;                 // runs past the JSON
    case 1: n = n > 4 ? n - in.below(5) : n; break;   // cuts the JSON short
    case 2: n = static_cast<uint64_t>(in.extent(200)) | (uint64_t{1} << in.below(64)); break;  // oversized
    default: break;
  }
  std::string file = le64(n) + json;
  std::string body(at < 4096 ? at : 4096, '\0');
  for (size_t i = 0; i < body.size(); ++i) body[i] = static_cast<char>(i * 7 + 1);
  file += body;
  if (in.byte() % 8 == 0) file.resize(file.size() - std::min<size_t>(file.size(), in.below(32)));  // truncated
  return file;
}

struct TempFile {
  std::string path;
  explicit TempFile(const std::string& bytes) {
    char name[] = "/dev/shm/sw-fuzz-XXXXXX";
    int fd = ::mkstemp(name);
    if (fd < 0) fuzz::finding("TempFile", "mkstemp failed");
    path = name;
    if (::write(fd, bytes.data(), bytes.size()) != static_cast<ssize_t>(bytes.size())) fuzz::finding("TempFile", "write");
    ::close(fd);
  }
  ~TempFile() { ::unlink(path.c_str()); }
};

void check_header(const Header& h, const std::string& file) {
  FUZZ_CHECK(h.file_size == file.size() && h.data_start >= 8 && h.data_start <= h.file_size, "sizes");
  std::vector<const TensorInfo*> by_begin;
  for (size_t k = 0; k < h.tensors.size(); ++k) {
    const TensorInfo& t = h.tensors[k];
    FUZZ_CHECK(k == 0 || h.tensors[k - 1].name < t.name, "tensors not sorted by name at ", t.name);
    FUZZ_CHECK(h.find(t.name) == &t, "find ", t.name);
    const ElementType* type = element_type(t.dtype);
    FUZZ_CHECK(type && type->itemsize == t.itemsize, "dtype ", t.dtype);
    FUZZ_CHECK(t.begin >= h.data_start && t.begin <= t.end && t.end <= h.file_size, t.name, " outside the data");
    uint64_t bytes = static_cast<uint64_t>(t.itemsize);
    for (int64_t e : t.shape) {
      FUZZ_CHECK(e >= 0, t.name, " extent ", e);
      bytes *= static_cast<uint64_t>(e);
    }
    FUZZ_CHECK(t.end - t.begin == bytes, t.name, " holds ", t.end - t.begin, " bytes for ", bytes);
    if (t.end > t.begin) by_begin.push_back(&t);
  }
  std::sort(by_begin.begin(), by_begin.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  for (size_t k = 1; k < by_begin.size(); ++k)
    FUZZ_CHECK(by_begin[k - 1]->end <= by_begin[k]->begin, by_begin[k - 1]->name, " overlaps ", by_begin[k]->name);
}

// The accepted file as a checkpoint: every tensor with a dtype and no empty extent reads back the file's bytes.
void check_checkpoint(const Header& h, const std::string& file, Input& in) {
  TempFile tmp(file);
  std::shared_ptr<Checkpoint> ck;
  const auto refusals = {ErrorKind::Value, ErrorKind::Type};
  if (!fuzz::attempt("Checkpoint::open", refusals, [&] { ck = Checkpoint::open({tmp.path}); }))
    fuzz::finding("Checkpoint::open", "refused a header parse_header accepted");
  for (const TensorInfo& t : h.tensors) {
    TensorPtr tensor;
    if (!fuzz::attempt("Checkpoint::tensor", refusals, [&] { tensor = ck->tensor(t.name); })) continue;
    const DType* dtype = dtype_of(t.dtype);
    FUZZ_CHECK(dtype && t.elements() > 0, t.name, " opened");
    FUZZ_CHECK(tensor->size() == t.elements(), t.name, " size");
    const int64_t n = std::min<int64_t>(t.elements(), 256);
    std::vector<std::byte> raw(static_cast<size_t>(dtype->itemsize()));
    const int64_t isz = static_cast<int64_t>(dtype->itemsize());
    for (int64_t s = 0; s < n; ++s) {
      std::memcpy(raw.data(), file.data() + t.begin + s * isz, raw.size());
      const Value want = load_value(*dtype, raw.data()), got = tensor->carrier->read_value(tensor->offset + s);
      FUZZ_CHECK(got == want || (got.kind == Value::Kind::Float && got.f != got.f && want.f != want.f), t.name,
                 " slot ", s);
    }
    if (in.flag() && !t.shape.empty()) {
      fuzz::attempt("Checkpoint::split_tier", refusals, [&] {
        auto tier = ck->split_tier(t.name, CheckpointCarrier::Writes::Overlay);
        FUZZ_CHECK(tier->size() == t.elements(), t.name, " split tier size");
      });
    }
  }
}

void check_index(const std::string& text) {
  TempFile tmp(text);
  std::map<std::string, std::string> index;
  if (!fuzz::attempt("read_index", {ErrorKind::Value}, [&] { index = read_index(tmp.path); })) return;
  for (const auto& [name, file] : index)
    FUZZ_CHECK(!file.empty() && file.find('/') == std::string::npos && file != "." && file != "..", file);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  std::string file;
  switch (in.byte() % 4) {
    case 0: file = in.bytes(in.left()); break;  // raw bytes
    case 1: {                                  // hostile JSON under a correct length
      const std::string json = in.bytes(in.left());
      file = le64(json.size()) + json;
      break;
    }
    case 2: file = built_file(in); break;
    default: check_index(in.bytes(in.left())); return 0;
  }
  Header h;
  if (!fuzz::attempt("parse_header", {ErrorKind::Value}, [&] { h = parse_header(file, file.size(), "fuzz"); }))
    return 0;
  check_header(h, file);
  check_checkpoint(h, file, in);
  return 0;
}
