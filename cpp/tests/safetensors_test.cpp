// The safetensors header: every rule of Note [A header is checked before any
// read] has a hostile file that breaks it, and a well-formed header round-trips.
#include "strideweave/checkpoint/safetensors.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "strideweave/carriers/native.hpp"
#include "strideweave/carriers/storage.hpp"
#include "strideweave/io.hpp"
#include "strideweave/tiled/tiled_evictable.hpp"
#include "test_support.hpp"

using namespace sw;
using namespace sw::testing_support;
namespace st = sw::safetensors;

namespace {


// A file of: the length of `header`, `header`, then `data_bytes` zero bytes.
std::string file_bytes(const std::string& header, uint64_t data_bytes) {
  return le64(header.size()) + header + std::string(data_bytes, '\0');
}

st::Header parse(const std::string& bytes) { return st::parse_header(bytes, bytes.size(), "ckpt.safetensors"); }

std::string contents_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

TEST(Safetensors, ParsesTensorsMetadataAndAbsoluteOffsets) {
  std::string h = R"({"__metadata__":{"format":"pt"},)"
                  R"("b":{"dtype":"BF16","shape":[2,3],"data_offsets":[16,28]},)"
                  R"("a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})";
  st::Header hdr = parse(file_bytes(h, 28));
  EXPECT_EQ(hdr.data_start, 8 + h.size());
  EXPECT_EQ(hdr.metadata.at("format"), "pt");
  ASSERT_EQ(hdr.tensors.size(), 2u);
  const st::TensorInfo& a = hdr.tensor("a");
  EXPECT_EQ(a.dtype, "F32");
  EXPECT_EQ(a.itemsize, 4);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{4}));
  EXPECT_EQ(a.begin, hdr.data_start);
  EXPECT_EQ(a.end, hdr.data_start + 16);
  const st::TensorInfo& b = hdr.tensor("b");
  EXPECT_EQ(b.itemsize, 2);
  EXPECT_EQ(b.elements(), 6);
  EXPECT_EQ(b.begin, hdr.data_start + 16);
  EXPECT_EQ(hdr.tensors[0].name, "a");  // sorted by name
  EXPECT_SW_THROW(ValueError, "holds no tensor named 'c'", hdr.tensor("c"));
}

TEST(Safetensors, EncodedHeaderRoundTripsThroughAFile) {
  std::vector<std::pair<uint64_t, uint64_t>> offsets;
  std::string header = st::encode_header(
      {{"w1", "BF16", {3, 5}}, {"w2", "F16", {5, 3}}, {"s", "F32", {}}, {"e", "I32", {0, 4}}}, {{"k", "v"}}, offsets);
  EXPECT_EQ(header.size() % 8, 0u);  // padded so the data area is 8-byte aligned
  ASSERT_EQ(offsets.size(), 4u);
  EXPECT_EQ(offsets[0], (std::pair<uint64_t, uint64_t>{0, 30}));
  EXPECT_EQ(offsets[1], (std::pair<uint64_t, uint64_t>{30, 60}));
  EXPECT_EQ(offsets[2], (std::pair<uint64_t, uint64_t>{60, 64}));
  EXPECT_EQ(offsets[3], (std::pair<uint64_t, uint64_t>{64, 64}));
  TempPath file("sw-st");
  write_file(file.path(), header + std::string(64, '\x7f'));
  st::Header h = st::read_header(file.path());
  EXPECT_EQ(h.data_start, header.size());
  EXPECT_EQ(h.metadata.at("k"), "v");
  EXPECT_EQ(h.tensor("w2").shape, (std::vector<int64_t>{5, 3}));
  EXPECT_EQ(h.tensor("w2").begin, header.size() + 30);
  EXPECT_EQ(h.tensor("s").shape.size(), 0u);
  EXPECT_EQ(h.tensor("e").begin, h.tensor("e").end);
}

TEST(Safetensors, EncodeRefusesUnknownDtypesAndRepeatedOrReservedNames) {
  std::vector<std::pair<uint64_t, uint64_t>> offsets;
  EXPECT_SW_THROW(ValueError, "unknown dtype 'F128'", st::encode_header({{"x", "F128", {1}}}, {}, offsets));
  EXPECT_SW_THROW(ValueError, "'x' occurs twice",
                  st::encode_header({{"x", "F32", {1}}, {"x", "F32", {1}}}, {}, offsets));
  EXPECT_SW_THROW(ValueError, "is reserved", st::encode_header({{"__metadata__", "F32", {1}}}, {}, offsets));
}

// Each hostile file breaks one rule and raises ValueError naming the file (and the tensor, where one is at fault).
struct Hostile {
  const char* what;
  std::string bytes;
  const char* fragment;
};

TEST(Safetensors, HostileHeadersRaiseValueErrorNamingFileAndTensor) {
  const std::string ok_entry = R"("t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  std::vector<Hostile> cases = {
      {"truncated before the length", std::string("\x10\x00\x00", 3), "fewer than the 8-byte header length"},
      {"length past the end", le64(1000) + "{}", "runs past the end of the file"},
      {"oversized length", le64(uint64_t{1} << 40) + "{}", "exceeds the limit"},
      {"not JSON", file_bytes("{\"t\": [", 0), "not well-formed JSON"},
      {"not an object", file_bytes("[1,2]", 0), "must be a JSON object"},
      {"duplicate key", file_bytes("{" + ok_entry + "," + ok_entry + "}", 8), "names \"t\" twice"},
      {"unknown dtype", file_bytes(R"({"t":{"dtype":"F128","shape":[2],"data_offsets":[0,8]}})", 8),
       "tensor 't' has an unknown dtype 'F128'"},
      {"shape/size mismatch", file_bytes(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 12),
       "tensor 't': shape [3] of F32 needs 12 bytes but data_offsets [0, 8] hold 8"},
      {"range past the end", file_bytes(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 8),
       "tensor 't': data_offsets [4, 12] run past the end of the data area (8 bytes)"},
      {"overlap", file_bytes(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("u":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
       "tensors 't' [0, 8) and 'u' [4, 12) overlap"},
      {"end before begin", file_bytes(R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", 8),
       "end before they begin"},
      {"negative offset", file_bytes(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", 8),
       "data_offsets[0] must be a non-negative integer"},
      {"fractional extent", file_bytes(R"({"t":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8),
       "a shape extent must be a non-negative integer"},
      {"overflowing shape", file_bytes(R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8),
       "holds more bytes than a file can"},
      {"missing field", file_bytes(R"({"t":{"dtype":"F32","shape":[2]}})", 8), "tensor 't' has no 'data_offsets'"},
      {"unknown field", file_bytes(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", 8),
       "tensor 't' has an unknown field 'x'"},
      {"metadata not strings", file_bytes(R"({"__metadata__":{"a":1}})", 0), "__metadata__ must map strings to strings"},
  };
  for (const Hostile& c : cases) {
    SCOPED_TRACE(c.what);
    EXPECT_SW_THROW(ValueError, c.fragment, parse(c.bytes));
    EXPECT_SW_THROW(ValueError, "ckpt.safetensors", parse(c.bytes));
  }
}

TEST(Safetensors, ReadHeaderOnHostileFilesNamesThePathAndReadsOnlyTheHeader) {
  TempPath file("sw-st-hostile");
  write_file(file.path(), le64(1000) + "{}");
  EXPECT_SW_THROW(ValueError, file.path() + ": the header length 1000 runs past the end of the file (10 bytes)",
                  st::read_header(file.path()));
  write_file(file.path(), "abc");
  EXPECT_SW_THROW(ValueError, "fewer than the 8-byte header length", st::read_header(file.path()));
  EXPECT_SW_THROW(RuntimeError, "/nonexistent/x.safetensors", st::read_header("/nonexistent/x.safetensors"));
}

TEST(Safetensors, IndexMapsNamesToFilesInItsFolder) {
  TempPath file("sw-st-index");
  write_file(file.path(), R"({"metadata":{"total_size":8},"weight_map":{"a":"m-1.safetensors","b":"m-2.safetensors"}})");
  auto index = st::read_index(file.path());
  EXPECT_EQ(index.at("a"), "m-1.safetensors");
  EXPECT_EQ(index.at("b"), "m-2.safetensors");
  write_file(file.path(), R"({"weight_map":{"a":"../etc/passwd"}})");
  EXPECT_SW_THROW(ValueError, "must name a file in the index's folder", st::read_index(file.path()));
  write_file(file.path(), R"({"metadata":{}})");
  EXPECT_SW_THROW(ValueError, "'weight_map' object", st::read_index(file.path()));
}

// ---------------------------------------------------------------- checkpoints (Note [Opening a checkpoint])

namespace {

// A safetensors file of Float32 tensors (name, shape); element e of tensor k holds 1000 * k + e.
void write_checkpoint(const std::string& path, const std::vector<std::pair<std::string, std::vector<int64_t>>>& ts,
                      const std::string& dtype = "F32") {
  std::vector<st::TensorSpec> specs;
  for (const auto& [name, shape] : ts) specs.push_back({name, dtype, shape});
  std::vector<std::pair<uint64_t, uint64_t>> offsets;
  std::string bytes = st::encode_header(specs, {{"format", "pt"}}, offsets);
  for (size_t k = 0; k < ts.size(); ++k)
    for (uint64_t e = 0; e < (offsets[k].second - offsets[k].first) / 4; ++e) {
      const float f = static_cast<float>(1000 * k + e);
      bytes.append(reinterpret_cast<const char*>(&f), 4);
    }
  write_file(path, bytes);
}

std::string make_dir() {
  std::string pattern = temp_dir() + "/sw-ckpt-dir-XXXXXX";
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  if (!::mkdtemp(buf.data())) throw std::runtime_error("mkdtemp failed");
  return buf.data();
}

struct TempDir {
  std::string path = make_dir();
  ~TempDir() { std::filesystem::remove_all(path); }
};

}  // namespace

TEST(Checkpoint, OpensOneFileAndBuildsATierOverNamedTensors) {
  TempPath file("sw-ckpt");
  write_checkpoint(file.path(), {{"e0.w", {2, 3}}, {"e1.w", {2, 3}}, {"e2.w", {3, 2}}, {"bias", {4}}});
  auto ck = st::Checkpoint::open({file.path()});
  EXPECT_EQ(ck->keys(), (std::vector<std::string>{"bias", "e0.w", "e1.w", "e2.w"}));
  EXPECT_EQ(&ck->dtype("e1.w"), &DType::Float32());
  EXPECT_EQ(ck->info("e2.w").shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(ck->metadata().at("format"), "pt");
  EXPECT_EQ(ck->bytes_read(), 0u);  // opening reads headers only
  auto tier = ck->tier({"e1.w", "e0.w"}, CheckpointCarrier::Writes::Overlay);
  ASSERT_EQ(tier->size(), 12);
  std::vector<float> v(12);
  tier->read_slots(0, 12, v.data());
  EXPECT_EQ(v, (std::vector<float>{1000, 1001, 1002, 1003, 1004, 1005, 0, 1, 2, 3, 4, 5}));  // e1.w, then e0.w
  EXPECT_EQ(ck->bytes_read(), 48u);
  EXPECT_SW_THROW(ValueError, "tensor 'e2.w' (F32 [3, 2]) differs from 'e0.w' (F32 [2, 3])",
                  ck->tier({"e0.w", "e2.w"}, CheckpointCarrier::Writes::Overlay));
  EXPECT_SW_THROW(ValueError, "'e0.w' is named twice", ck->tier({"e0.w", "e0.w"}, CheckpointCarrier::Writes::Overlay));
  EXPECT_SW_THROW(ValueError, "holds no tensor named 'e9.w'", ck->info("e9.w"));
}

TEST(Checkpoint, ElementTypesWithoutADtypeAreTypeErrors) {
  TempPath file("sw-ckpt");
  write_checkpoint(file.path(), {{"ids", {2}}}, "I64");
  auto ck = st::Checkpoint::open({file.path()});
  EXPECT_EQ(ck->info("ids").dtype, "I64");
  EXPECT_SW_THROW(TypeError, "tensor 'ids' holds I64 elements", ck->dtype("ids"));
}

TEST(Checkpoint, OpensAShardedFolderThroughItsIndex) {
  TempDir dir;
  write_checkpoint(dir.path + "/model-00001-of-00002.safetensors", {{"a", {2}}, {"b", {2}}});
  write_checkpoint(dir.path + "/model-00002-of-00002.safetensors", {{"c", {2}}});
  write_file(dir.path + "/model.safetensors.index.json",
             R"({"metadata":{},"weight_map":{"a":"model-00001-of-00002.safetensors",)"
             R"("b":"model-00001-of-00002.safetensors","c":"model-00002-of-00002.safetensors"}})");
  auto ck = st::Checkpoint::open({dir.path});
  EXPECT_EQ(ck->keys(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(ck->file_of("c"), dir.path + "/model-00002-of-00002.safetensors");
  auto tier = ck->tier({"c", "a"}, CheckpointCarrier::Writes::Overlay);
  std::vector<float> v(4);
  tier->read_slots(0, 4, v.data());
  EXPECT_EQ(v, (std::vector<float>{0, 1, 0, 1}));  // each file's first tensor holds 0, 1
  // An index that places a tensor in a file that does not hold it.
  write_file(dir.path + "/model.safetensors.index.json",
             R"({"weight_map":{"a":"model-00002-of-00002.safetensors","c":"model-00002-of-00002.safetensors"}})");
  EXPECT_SW_THROW(ValueError, "places tensor 'a' in", st::Checkpoint::open({dir.path}));
}

TEST(Checkpoint, RefusesANameHeldByTwoFilesAndAnEmptyFolder) {
  TempDir dir;
  write_checkpoint(dir.path + "/x.safetensors", {{"a", {2}}});
  write_checkpoint(dir.path + "/y.safetensors", {{"a", {2}}});
  EXPECT_SW_THROW(ValueError, "tensor 'a' is held by both", st::Checkpoint::open({dir.path}));
  EXPECT_SW_THROW(ValueError, "tensor 'a' is held by both",
                  st::Checkpoint::open({dir.path + "/x.safetensors", dir.path + "/y.safetensors"}));
  TempDir empty;
  EXPECT_SW_THROW(ValueError, "holds neither model.safetensors.index.json nor any .safetensors file",
                  st::Checkpoint::open({empty.path}));
  EXPECT_SW_THROW(ValueError, "needs a file", st::Checkpoint::open({}));
}

// ---------------------------------------------------------------- saving (Note [Saving a checkpoint])

namespace {

// The tensor's values in row-major order of its (flat) top-level modes, through checked element access.
std::vector<double> row_major_values(const TensorPtr& t) {
  const std::vector<int64_t> ext = t->layout.shape().extents();
  std::vector<double> out;
  std::vector<int64_t> c(ext.size(), 0);
  for (int64_t n = 0; n < t->size(); ++n) {
    std::vector<IntTuple> kids(c.begin(), c.end());
    const Value v = t->get(IntTuple::tuple(kids));
    out.push_back(v.kind == Value::Kind::Int ? static_cast<double>(v.i) : v.f);
    for (size_t k = ext.size(); k-- > 0;) {
      if (++c[k] < ext[k]) break;
      c[k] = 0;
    }
  }
  return out;
}

std::vector<double> saved_values(const st::Checkpoint& ck, const std::string& name) {
  const st::TensorInfo& info = ck.info(name);
  auto file = std::make_shared<CheckpointFile>(ck.file_of(name), false);
  auto t = make_tensor(std::make_shared<CheckpointCarrier>(
                           std::vector<CheckpointCarrier::Range>{{file, info.begin, info.elements()}}, ck.dtype(name),
                           CheckpointCarrier::Writes::Overlay),
                       0, row_major(Shape::flat(info.shape)));
  return row_major_values(t);
}

}  // namespace

TEST(SafetensorsSave, WritesRowMajorValuesOfAnyLayoutAndCarrier) {
  auto dense = make_tensor(std::make_shared<CPUCarrier>(6, DType::Float32(), true, false), 0,
                           column_major(Shape::flat({2, 3})));
  fill_slots(*dense->carrier, 10);
  // A transposed view: shape (3, 2) over the same slots.
  auto transposed = make_tensor(dense->carrier, 0, Layout(Shape::flat({3, 2}), Stride::flat({2, 1})));
  auto ints = make_tensor(std::make_shared<CPUCarrier>(4, DType::Int32(), true, false), 0,
                          column_major(Shape::flat({4})));
  fill_slots(*ints->carrier, 3);
  // A tiled tensor with one tile evicted: read from the secondary tier without moving it.
  auto te = std::make_shared<TiledEvictable>(std::make_shared<CPUCarrier>(8, DType::Float32(), true, false),
                                             std::make_shared<FileBackedCarrier>("", DType::Float32(), true),
                                             std::vector<int64_t>{2}, std::vector<int64_t>{4}, nullptr);
  fill_slots(*te, 50);
  te->evict_async({0})->value();
  auto tiled = make_tensor(te, 0, column_major(Shape::flat({4, 2})));
  const TiledStats before = te->stats();
  TempPath file("sw-save");
  st::save(file.path(), {{"dense", dense}, {"transposed", transposed}, {"ints", ints}, {"tiled", tiled}},
           {{"who", "test"}});
  EXPECT_EQ(te->stats().promotions, before.promotions);
  auto ck = st::Checkpoint::open({file.path()});
  EXPECT_EQ(ck->keys(), (std::vector<std::string>{"dense", "ints", "tiled", "transposed"}));
  EXPECT_EQ(ck->metadata().at("who"), "test");
  EXPECT_EQ(ck->info("transposed").shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(ck->info("ints").dtype, "I32");
  for (const auto& [name, t] : std::vector<std::pair<std::string, TensorPtr>>{
           {"dense", dense}, {"transposed", transposed}, {"ints", ints}, {"tiled", tiled}}) {
    SCOPED_TRACE(name);
    EXPECT_EQ(saved_values(*ck, name), row_major_values(t));
  }
}

TEST(SafetensorsSave, AFailedSaveLeavesTheOldFileAndNoTemporary) {
  TempDir dir;
  const std::string path = dir.path + "/model.safetensors";
  write_file(path, "old contents");
  auto t = make_tensor(std::make_shared<CPUCarrier>(4, DType::Float32(), true, false), 0,
                       column_major(Shape::flat({4})));
  EXPECT_SW_THROW(ValueError, "'x' occurs twice", st::save(path, {{"x", t}, {"x", t}}, {}));
  io::inject(io::Op::Pwrite, ENOSPC, 1, 1);  // the header is written, the first data chunk fails
  EXPECT_SW_THROW(RuntimeError, "No space left on device", st::save(path, {{"x", t}}, {}));
  io::clear_faults();
  EXPECT_EQ(contents_of(path), "old contents");
  size_t entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path)) entries += e.is_regular_file();
  EXPECT_EQ(entries, 1u);
  st::save(path, {{"x", t}}, {});
  EXPECT_EQ(st::Checkpoint::open({path})->info("x").shape, (std::vector<int64_t>{4}));
}
