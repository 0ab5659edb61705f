// A checkpoint's quantized tensors (Note [Quantized tensors of a checkpoint] in strideweave/checkpoint/safetensors.hpp)
// and the ranges of the tiers over them (Note [A quantized checkpoint tier] in strideweave/carriers/checkpoint.hpp).
#include <cmath>
#include <cstdio>
#include <tuple>
#include <cstring>
#include <vector>

#include "strideweave/checkpoint/quantized.hpp"
#include "strideweave/checkpoint/safetensors.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/io.hpp"

namespace sw::safetensors {

namespace {

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

QuantizedRange::Scale scale_type_of(const std::string& element) {
  if (element == "F32") return QuantizedRange::Scale::F32;
  if (element == "BF16") return QuantizedRange::Scale::BF16;
  return QuantizedRange::Scale::E8M0;  // F8_E8M0, or U8 holding e8m0 exponents
}

}  // namespace

std::pair<int64_t, int64_t> fp8_block_by_shape(int64_t rows, int64_t cols, int64_t sr, int64_t sc) {
  if (sr == ceil_div(rows, 128) && sc == ceil_div(cols, 128)) return {128, 128};
  if (sr > 0 && sc > 0 && rows % sr == 0 && cols % sc == 0) return {rows / sr, cols / sc};
  return {0, 0};
}

void Checkpoint::set_fp8_block(int64_t rows, int64_t cols) {
  if (rows < 1 || cols < 1) raise<ValueError>("an FP8 block is at least 1 x 1, got ", rows, " x ", cols);
  fp8_block_rows_ = rows;
  fp8_block_cols_ = cols;
}

std::optional<Quantization> Checkpoint::quantization(const std::string& name, const std::string& scale_name,
                                                     int64_t block_rows, int64_t block_cols) const {
  std::string data = name;
  if (!contains(name) && contains(name + "_blocks")) data = name + "_blocks";  // MXFP4 by its parameter's name
  const TensorInfo& t = info(data);  // ValueError for an unknown name
  const bool fp8 = t.dtype == "F8_E4M3", mxfp4 = t.dtype == "U8" && ends_with(data, "_blocks");
  if (!fp8 && !mxfp4) {
    if (data != name) info(name);  // "X" names no tensor; "X_blocks" is not MXFP4
    if (!scale_name.empty())
      raise<ValueError>("tensor '", name, "' in ", file_of(name), " holds ", t.dtype, " values, not quantized ones; ",
                        "it takes no scales ('", scale_name, "' given)");
    return std::nullopt;
  }
  const std::string& path = file_of(data);
  auto fail = [&](auto&&... parts) -> void {
    raise<ValueError>("tensor '", data, "' in ", path, ": ", std::forward<decltype(parts)>(parts)...);
  };
  Quantization q;
  q.data = data;
  const std::vector<int64_t>& s = t.shape;
  if (fp8) {
    q.format = QuantizedRange::Format::FP8;
    if (s.size() < 2)
      fail("an F8_E4M3 tensor of shape ", shape_text(s), " is not block-scaled (quantized weights are matrices, "
           "or stacks of them)");
    std::vector<std::string> candidates;
    if (!scale_name.empty()) {
      candidates.push_back(scale_name);
    } else if (ends_with(data, ".weight")) {
      const std::string stem = data.substr(0, data.size() - 6);
      candidates = {stem + "weight_scale_inv", stem + "weight_scale"};
    } else {
      candidates = {data + "_scale_inv", data + "_scale"};
    }
    for (const std::string& c : candidates)
      if (contains(c)) {
        q.scale = c;
        break;
      }
    if (q.scale.empty()) {
      if (!scale_name.empty()) fail("its scale tensor '", scale_name, "' is missing from the checkpoint");
      fail("its scales are missing: the checkpoint holds neither '", candidates[0], "' nor '", candidates[1], "'");
    }
    const TensorInfo& st = info(q.scale);
    q.scale_dtype = st.dtype;
    if (st.dtype != "F32" && st.dtype != "BF16" && st.dtype != "F8_E8M0")
      fail("its scale tensor '", q.scale, "' holds ", st.dtype, " elements; FP8 block scales are F32, BF16 or F8_E8M0");
    const int64_t R = s[s.size() - 2], C = s.back();
    const std::vector<int64_t>& ss = st.shape;
    const bool leading = ss.size() == s.size() && std::equal(s.begin(), s.end() - 2, ss.begin());
    const int64_t sr = leading ? ss[ss.size() - 2] : -1, sc = leading ? ss.back() : -1;
    int64_t br = block_rows, bc = block_cols;
    if (br < 0 || bc < 0 || (br == 0) != (bc == 0))
      raise<ValueError>("tensor '", data, "': block=(", block_rows, ", ", block_cols, ") is not a block");
    if (br == 0) {
      // The block the file records (save(quantize=) writes it where the shape rule would not find it), else the
      // checkpoint's block (the model's quantization_config, set_fp8_block) where the scales' shape fits it, else
      // the shape rule: 128 x 128, or transformers' rule, the block the scale grid divides the matrix into.
      auto recorded = metadata_.find(std::string(kFp8BlockKey) + q.scale);
      long long r = 0, c = 0;
      if (recorded != metadata_.end()) {
        if (std::sscanf(recorded->second.c_str(), "[%lld, %lld]", &r, &c) != 2 || r < 1 || c < 1)
          fail("its metadata records the block '", recorded->second, "' for '", q.scale, "', which is not [rows, cols]");
        br = r;
        bc = c;
      } else if (leading && fp8_block_rows_ > 0 && sr == ceil_div(R, fp8_block_rows_) &&
                 sc == ceil_div(C, fp8_block_cols_)) {
        br = fp8_block_rows_;
        bc = fp8_block_cols_;
      } else if (leading) {
        std::tie(br, bc) = fp8_block_by_shape(R, C, sr, sc);
      }
      if (br == 0) br = bc = 128;  // reported as a shape mismatch below
    }
    std::vector<int64_t> want(s.begin(), s.end() - 2);
    want.push_back(ceil_div(R, br));
    want.push_back(ceil_div(C, bc));
    if (ss != want)
      fail("its scale tensor '", q.scale, "' has shape ", shape_text(ss), ", but one scale per ", br, "x", bc,
           " block of ", shape_text(s), " is ", shape_text(want));
    q.block_rows = br;
    q.block_cols = bc;
    q.shape = s;
  } else {
    q.format = QuantizedRange::Format::MXFP4;
    if (s.size() < 2 || s.back() != 16)
      fail("MXFP4 blocks have shape (..., groups, 16) (32 values of 4 bits per group), but it has ", shape_text(s));
    const std::string stem = data.substr(0, data.size() - 7);
    q.scale = scale_name.empty() ? stem + "_scales" : scale_name;
    if (!contains(q.scale)) fail("its scale tensor '", q.scale, "' is missing from the checkpoint");
    const TensorInfo& st = info(q.scale);
    q.scale_dtype = st.dtype;
    if (st.dtype != "U8" && st.dtype != "F8_E8M0")
      fail("its scale tensor '", q.scale, "' holds ", st.dtype, " elements; MXFP4 scales are e8m0 (U8 or F8_E8M0)");
    const std::vector<int64_t> groups(s.begin(), s.end() - 1);
    if (st.shape != groups)
      fail("its blocks count does not match its scales: ", shape_text(s), " holds groups ", shape_text(groups),
           ", but its scale tensor '", q.scale, "' has shape ", shape_text(st.shape));
    q.block_rows = 1;
    q.block_cols = 32;
    q.shape.assign(s.begin(), s.end() - 2);
    q.shape.push_back(s[s.size() - 2] * 32);
  }
  return q;
}

const DType& Checkpoint::quantized_dtype(const Quantization& q, CheckpointCarrier::Writes writes,
                                         const TierOptions& options) const {
  const char* format = q.format == QuantizedRange::Format::FP8 ? "FP8 (F8_E4M3, block-scaled)" : "MXFP4";
  if (!options.dtype)
    raise<TypeError>("tensor '", q.data, "' is quantized (", format, " with ", q.scale_dtype, " scales '", q.scale,
                     "'): give dtype=BFloat16 or Float32, the dtype its tiles are dequantized into on promotion");
  if (options.dtype != &DType::BFloat16() && options.dtype != &DType::Float32())
    raise<TypeError>("tensor '", q.data, "' is quantized (", format, "): it is dequantized into BFloat16 or Float32, "
                     "not ", options.dtype->name());
  if (writes == CheckpointCarrier::Writes::InPlace)
    raise<ValueError>("tensor '", q.data, "' in ", file_of(q.data), " is quantized (", format, "): a tier over it "
                      "cannot write in place (mutable=True); its writes go to a scratch overlay in ",
                      options.dtype->name(), " and the checkpoint is never written");
  return *options.dtype;
}

CheckpointCarrier::Range Checkpoint::quantized_range(const Quantization& q, int64_t index, int64_t slabs) {
  const TensorInfo& t = info(q.data);
  const TensorInfo& st = info(q.scale);
  auto qr = std::make_shared<QuantizedRange>();
  qr->format = q.format;
  qr->scale_type = scale_type_of(q.scale_dtype);
  qr->block_rows = q.block_rows;
  qr->block_cols = q.block_cols;
  qr->cols = q.shape.back();
  int64_t values = 1;
  for (int64_t e : q.shape) values *= e;
  values /= slabs;
  qr->rows = values / qr->cols;
  const uint64_t data_bytes = (t.end - t.begin) / static_cast<uint64_t>(slabs);
  const uint64_t scale_bytes = (st.end - st.begin) / static_cast<uint64_t>(slabs);
  CheckpointCarrier::Range r{file(where_.at(q.data), false, "make a tier over it"),
                             t.begin + static_cast<uint64_t>(index) * data_bytes, values, nullptr};
  qr->scale_file = file(where_.at(q.scale), false, "make a tier over it");
  qr->scale_offset = st.begin + static_cast<uint64_t>(index) * scale_bytes;
  if (qr->data_bytes() != data_bytes || qr->scale_bytes() != scale_bytes)
    raise<ValueError>("tensor '", q.data, "' in ", file_of(q.data), ": slab ", index, " of ", slabs, " does not hold "
                      "whole quantized matrices");
  // Every scale the range will use, read once and checked: a NaN (or infinite) scale makes every value of its
  // block NaN (or infinite), which no computation recovers from.
  const size_t item = qr->scale_itemsize();
  const int64_t count = qr->scale_count(), sc = qr->scale_cols();
  std::vector<std::byte> raw;
  std::vector<float> as_float;
  constexpr int64_t kChunk = int64_t{1} << 20;
  for (int64_t k0 = 0; k0 < count; k0 += kChunk) {
    const int64_t n = std::min(kChunk, count - k0);
    raw.resize(static_cast<size_t>(n) * item);
    io::pread_full(qr->scale_file->fd(), raw.data(), raw.size(),
                   static_cast<int64_t>(qr->scale_offset + static_cast<uint64_t>(k0) * item), qr->scale_file->path());
    qr->scale_file->count_read(raw.size());
    as_float.resize(static_cast<size_t>(n));
    quant::scales_to_float(raw.data(), qr->scale_type, n, as_float.data());
    for (int64_t k = 0; k < n; ++k) {
      const float v = as_float[static_cast<size_t>(k)];
      if (std::isfinite(v)) continue;
      const int64_t at = k0 + k;
      const std::string slab = slabs > 1 ? " of slab " + std::to_string(index) : std::string();
      raise<ValueError>("tensor '", q.data, "' in ", file_of(q.data), ": its scale tensor '", q.scale, "' (",
                        file_of(q.scale), ") holds a ", std::isnan(v) ? "NaN" : "infinite", " scale (",
                        q.format == QuantizedRange::Format::FP8 ? "block (" : "group (", at / sc, ", ", at % sc, ")",
                        slab, "): every value it scales would be ", std::isnan(v) ? "NaN" : "infinite");
    }
  }
  r.quant = std::move(qr);
  return r;
}

}  // namespace sw::safetensors
