// Safetensors checkpoints (strideweave/checkpoint/safetensors.hpp): the Checkpoint, its tier's carrier, open and
// save. strideweave/safetensors.py is the public face (sw.safetensors.open / save); everything here is C++.
#include <nanobind/ndarray.h>
#include <cstring>
#include <optional>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "common.hpp"
#include "strideweave/carriers/native.hpp"
#include "strideweave/checkpoint/quantized.hpp"
#include "strideweave/checkpoint/safetensors.hpp"
#include "strideweave/errors.hpp"
#include "typing.hpp"

namespace swpy {

namespace {

using sw::CheckpointCarrier;
using sw::safetensors::Checkpoint;
using Writes = CheckpointCarrier::Writes;
using IntsTuple = nb::typed<nb::tuple, int, nb::ellipsis>;

IntsTuple ints_tuple(const std::vector<int64_t>& v) {
  nb::list out;
  for (int64_t x : v) out.append(x);
  return nb::borrow<IntsTuple>(nb::tuple(out));
}

// A str argument as UTF-8. A str holding a lone surrogate (U+D800..U+DFFF: what surrogateescape makes of bytes
// that are not UTF-8) has no UTF-8 form: ValueError naming the argument and where the surrogate is.
std::string str_arg(nb::handle h, const char* what) {
  if (!PyUnicode_Check(h.ptr()))
    sw::raise<sw::TypeError>(what, " must be a str, got ", nb::type_name(h.type()).c_str());
  Py_ssize_t size = 0;
  if (const char* utf8 = PyUnicode_AsUTF8AndSize(h.ptr(), &size)) return std::string(utf8, static_cast<size_t>(size));
  PyErr_Clear();
  const Py_ssize_t n = PyUnicode_GetLength(h.ptr());
  Py_ssize_t at = 0;
  Py_UCS4 c = 0;
  for (; at < n; ++at) {
    c = PyUnicode_ReadChar(h.ptr(), at);
    if (c >= 0xD800 && c <= 0xDFFF) break;
  }
  char code[8];
  std::snprintf(code, sizeof code, "%04X", static_cast<unsigned>(c));
  sw::raise<sw::ValueError>(what, " must be text UTF-8 can encode; it holds a lone surrogate U+", code,
                            " at index ", at, " (a safetensors header is UTF-8 JSON)");
}

// A path argument (os.fspath already applied): a str, encoded as the file system encodes names (so a name with
// bytes that are not UTF-8, decoded with surrogateescape, names the same file), or bytes.
std::string path_arg(nb::handle h, const char* what) {
  if (PyBytes_Check(h.ptr())) return std::string(PyBytes_AS_STRING(h.ptr()), static_cast<size_t>(PyBytes_GET_SIZE(h.ptr())));
  if (!PyUnicode_Check(h.ptr()))
    sw::raise<sw::TypeError>(what, " must be a str, bytes or os.PathLike, got ", nb::type_name(h.type()).c_str());
  nb::object bytes = nb::steal(PyUnicode_EncodeFSDefault(h.ptr()));
  if (!bytes.is_valid()) {
    PyErr_Clear();
    sw::raise<sw::ValueError>(what, " cannot be encoded as a file name");
  }
  return std::string(PyBytes_AS_STRING(bytes.ptr()), static_cast<size_t>(PyBytes_GET_SIZE(bytes.ptr())));
}

using sw::safetensors::Quantization;
using Format = sw::QuantizedRange::Format;

// Options of tiled(): dtype=, scales=, block= (Note [Quantized tensors of a checkpoint]).
sw::safetensors::TierOptions tier_options(nb::handle dtype, nb::handle scales, nb::handle block, bool one_name) {
  sw::safetensors::TierOptions o;
  if (!dtype.is_none()) o.dtype = &to_dtype(dtype, "tiled: dtype must be a DType or None");
  if (!scales.is_none()) {
    if (PyUnicode_Check(scales.ptr())) {
      o.scales.push_back(str_arg(scales, "tiled: scales"));
    } else {
      if (!nb::isinstance<nb::iterable>(scales) || one_name)
        sw::raise<sw::TypeError>("tiled: scales must be ", one_name ? "a tensor name (str)" : "a sequence of tensor names",
                                 " or None, got ", nb::type_name(scales.type()).c_str());
      for (nb::handle h : scales) o.scales.push_back(str_arg(h, "each scale tensor name"));
    }
  }
  if (!block.is_none()) {
    if (!nb::isinstance<nb::tuple>(block) || nb::len(block) != 2 || !PyLong_Check(block[0].ptr()) ||
        !PyLong_Check(block[1].ptr()) || PyBool_Check(block[0].ptr()) || PyBool_Check(block[1].ptr()))
      sw::raise<sw::TypeError>("tiled: block must be a tuple of two ints (rows, cols) or None");
    o.block_rows = nb::cast<int64_t>(block[0]);
    o.block_cols = nb::cast<int64_t>(block[1]);
    if (o.block_rows < 1 || o.block_cols < 1)
      sw::raise<sw::ValueError>("tiled: block=(", o.block_rows, ", ", o.block_cols, ") must be at least (1, 1)");
  }
  return o;
}

std::string describe(const Quantization& q) {
  std::string out = q.format == Format::FP8 ? "F8_E4M3 with " : "E2M1 (MXFP4) with ";
  out += q.scale_dtype + " scales per ";
  out += q.format == Format::FP8 ? std::to_string(q.block_rows) + "x" + std::to_string(q.block_cols) + " block"
                                 : std::string("32 values");
  return out + " (" + q.scale + ")";
}

using Bytes = nb::ndarray<nb::c_contig, nb::device::cpu>;

sw::QuantizedRange::Scale scale_kind(const std::string& s) {
  if (s == "F32") return sw::QuantizedRange::Scale::F32;
  if (s == "BF16") return sw::QuantizedRange::Scale::BF16;
  if (s == "E8M0") return sw::QuantizedRange::Scale::E8M0;
  sw::raise<sw::ValueError>("a scale kind is F32, BF16 or E8M0, not ", s);
}

}  // namespace

void bind_checkpoint(nb::module_& m) {
  nb::class_<Quantization>(m, "Quantized",
                           "How a checkpoint tensor is quantized (Checkpoint.dtype of an FP8 block-scaled or MXFP4 "
                           "tensor): its tiles are dequantized on promotion (tiled(..., dtype=...)).")
      .def("__init__", [](Quantization*, nb::args, nb::kwargs) {
        sw::raise<sw::TypeError>("Quantized is not constructible directly; Checkpoint.dtype returns it");
      })
      .def_prop_ro("format", [](const Quantization& q) { return q.format == Format::FP8 ? "fp8" : "mxfp4"; },
                   "\"fp8\" (block-scaled F8_E4M3) or \"mxfp4\".")
      .def_prop_ro("element", [](const Quantization& q) { return q.format == Format::FP8 ? "F8_E4M3" : "E2M1"; },
                   "The quantized elements' format.")
      .def_prop_ro("block", [](const Quantization& q) { return nb::make_tuple(q.block_rows, q.block_cols); },
                   nb::sig("def block(self) -> tuple[int, int]"),
                   "The values one scale covers: (rows, cols); (1, 32) for MXFP4.")
      .def_prop_ro("data", [](const Quantization& q) { return q.data; }, "The quantized elements' tensor.")
      .def_prop_ro("scale", [](const Quantization& q) { return q.scale; }, "The scales' tensor.")
      .def_prop_ro("scale_dtype", [](const Quantization& q) { return q.scale_dtype; },
                   "The scales' element type: F32, BF16, F8_E8M0 or U8 (e8m0 exponents).")
      .def_prop_ro("shape", [](const Quantization& q) { return ints_tuple(q.shape); },
                   nb::sig("def shape(self) -> tuple[int, ...]"), "The dequantized values' shape.")
      .def_prop_ro("name", [](const Quantization& q) { return describe(q); }, "The format in words.")
      .def("__eq__", [](const Quantization& a, nb::handle b) {
        return nb::isinstance<Quantization>(b) && a == nb::cast<const Quantization&>(b);
      }, nb::arg("other").none(), nb::sig("def __eq__(self, other: object) -> bool"))
      .def("__hash__", [](const Quantization& q) { return nb::hash(nb::str(describe(q).c_str())); })
      .def("__str__", [](const Quantization& q) { return describe(q); })
      .def("__repr__", [](const Quantization& q) { return "Quantized(" + describe(q) + ")"; });

  nb::class_<CheckpointCarrier, sw::Carrier>(m, "CheckpointCarrier", nb::is_final(),
                                             "The checkpoint tier: slots that are byte ranges of existing files, where "
                                             "they lie (made by sw.safetensors; docs/guide.md, \"Opening a Hugging Face "
                                             "checkpoint\").")
      .def("__init__", [](CheckpointCarrier*, nb::args, nb::kwargs) {
        sw::raise<sw::TypeError>("CheckpointCarrier is not constructible directly; use sw.safetensors.open");
      })
      .def_prop_ro("writes", [](const CheckpointCarrier& c) {
        return c.writes() == Writes::InPlace ? "in_place" : "overlay";
      }, "'overlay' (writes go to a scratch copy; the files are never written) or 'in_place'.")
      .def_prop_ro("crash_safe", &CheckpointCarrier::crash_safe,
                   "Whether in-place writes go through each file's journal (tiled(..., mutable=True, crash_safe=True)).")
      .def_prop_ro("range_count", [](const CheckpointCarrier& c) { return c.ranges().size(); },
                   "The number of byte ranges (tiles of a tiled checkpoint tensor).")
      .def_prop_ro("overlaid_ranges", &CheckpointCarrier::overlaid_ranges,
                   "Ranges whose values now live in the scratch overlay (writes='overlay').")
      .def("promotion_stats", [](const CheckpointCarrier& c) {
        const sw::PromotionStats s = c.promotion_stats();
        nb::typed<nb::dict, std::string, int64_t> d;
        d["mapped"] = s.mapped;
        d["mapped_huge"] = s.mapped_huge;
        d["read"] = s.read;
        d["read_reused"] = s.read_reused;
        d["map_ns_per_mib"] = s.map_ns_per_mib;
        d["unmap_ns_per_mib"] = s.unmap_ns_per_mib;
        d["read_ns_per_mib"] = s.read_ns_per_mib;
        d["mapped_live_bytes"] = s.mapped_live_bytes;
        d["mapped_peak_bytes"] = s.mapped_peak_bytes;
        d["read_live_bytes"] = s.read_live_bytes;
        d["read_peak_bytes"] = s.read_peak_bytes;
        return d;
      }, "Tiles of 1 MiB and more this read-only tier promoted, by path (Note [Promotion by the cheaper path] in "
         "cpp/src/carriers/checkpoint.cpp): 'mapped' (the file's pages mapped copy-on-write), of which "
         "'mapped_huge' came wholly in 2 MiB page-table entries, and 'read' (read into a buffer of the tile's own), "
         "of which 'read_reused' went into a buffer already faulted in (a recycled one from the mapping cache). "
         "Smaller tiles, and tiers written in place, are read by the engine and not counted here. "
         "'map_ns_per_mib', 'unmap_ns_per_mib' and 'read_ns_per_mib' are the moving averages of each path's cost "
         "that 'auto' compares (-1 until measured). 'mapped_live_bytes'/'read_live_bytes' are the bytes of the "
         "buffers these promotions made that are still alive (a resident tile's, or held past its eviction), and "
         "'mapped_peak_bytes'/'read_peak_bytes' their peaks.");
  m.def("_set_promotion_path", [](nb::handle path) {
    const std::string p = str_arg(path, "a promotion path");
    sw::PromotionPath want;
    if (p == "auto") want = sw::PromotionPath::Auto;
    else if (p == "map") want = sw::PromotionPath::Map;
    else if (p == "read") want = sw::PromotionPath::Read;
    else sw::raise<sw::ValueError>("set_promotion_path takes 'auto', 'map' or 'read', got '", p, "'");
    switch (sw::set_promotion_path(want)) {
      case sw::PromotionPath::Map: return std::string("map");
      case sw::PromotionPath::Read: return std::string("read");
      default: return std::string("auto");
    }
  }, nb::arg("path"), nb::sig("def _set_promotion_path(path: str) -> str"));

  nb::class_<Checkpoint>(m, "Checkpoint",
                         "A safetensors checkpoint opened where it lies (sw.safetensors.open): headers read and "
                         "validated, no tensor byte read until a tensor or tile is.")
      .def("__init__", [](Checkpoint*, nb::args, nb::kwargs) {
        sw::raise<sw::TypeError>("Checkpoint is not constructible directly; use sw.safetensors.open");
      })
      .def("keys", [](const Checkpoint& c) { return c.keys(); }, "The tensor names, sorted.")
      .def("__contains__", [](const Checkpoint& c, nb::handle name) {
        return PyUnicode_Check(name.ptr()) && c.contains(nb::cast<std::string>(name));
      }, nb::arg("name").none(), nb::sig("def __contains__(self, name: object) -> bool"))
      .def("__len__", [](const Checkpoint& c) { return c.keys().size(); })
      .def("dtype", [](const Checkpoint& c, nb::handle name) -> nb::object {
        const std::string n = str_arg(name, "a tensor name");
        if (std::optional<Quantization> q = c.quantization(n)) return nb::cast(std::move(*q));
        return nb::cast(c.dtype(n), nb::rv_policy::reference);
      }, nb::arg("name"), nb::sig("def dtype(self, name: str) -> DType | Quantized"),
         "The tensor's DType, or how it is quantized (a Quantized: FP8 block-scaled F8_E4M3 with its scales, or "
         "MXFP4 \"X_blocks\"/\"X_scales\", named \"X_blocks\" or \"X\"). ValueError naming the tensor and "
         "its file for quantized tensors whose scales are missing or malformed; TypeError for an element type "
         "StrideWeave has no DType for.")
      .def("shape", [](const Checkpoint& c, nb::handle name) { return ints_tuple(c.info(str_arg(name, "a tensor name")).shape); },
           nb::arg("name"), nb::sig("def shape(self, name: str) -> tuple[int, ...]"))
      .def("file_of", [](const Checkpoint& c, nb::handle name) { return c.file_of(str_arg(name, "a tensor name")); },
           nb::arg("name"), nb::sig("def file_of(self, name: str) -> str"), "The file holding the tensor.")
      .def_prop_ro("metadata", [](const Checkpoint& c) {
        nb::dict d;
        for (const auto& [k, v] : c.metadata()) d[nb::str(k.c_str())] = nb::str(v.c_str());
        return nb::borrow<nb::typed<nb::dict, nb::str, nb::str>>(d);
      }, "The files' __metadata__ (str -> str; the first file's value wins).")
      .def("_set_fp8_block", &Checkpoint::set_fp8_block, nb::arg("rows"), nb::arg("cols"),
           "The FP8 block of the checkpoint's quantized tensors (sw.safetensors.open(fp8_block=)).")
      .def_prop_ro("bytes_read", &Checkpoint::bytes_read,
                   "Bytes read from the checkpoint's files so far, by every tensor and tier over it.")
      .def("tensor", [](Checkpoint& c, nb::handle name) {
        std::string n = str_arg(name, "a tensor name");
        GilRelease nogil;
        return c.tensor(n);
      }, nb::arg("name"), nb::sig("def tensor(self, name: str) -> Tensor"),
         "The tensor over its byte range, of its own shape with row-major strides; no copy. Writes go to a scratch "
         "overlay, never to the file.")
      .def("tiled", [](Checkpoint& c, nb::handle names, nb::handle primary, nb::handle policy, bool is_mutable,
                       bool crash_safe, nb::handle tiles_arg, nb::handle dtype_arg, nb::handle scales_arg,
                       nb::handle block_arg) {
        const sw::safetensors::TierOptions options =
            tier_options(dtype_arg, scales_arg, block_arg, PyUnicode_Check(names.ptr()));
        // tiles: how many equal slabs one tensor's first axis is split into (None: shape[0]). Checked before any
        // file is opened; the count against the tensor's first extent in split_tier.
        std::optional<int64_t> tiles;
        if (!tiles_arg.is_none()) {
          if (!PyLong_Check(tiles_arg.ptr()) || PyBool_Check(tiles_arg.ptr()))
            sw::raise<sw::TypeError>("tiled: tiles must be an int or None, got ", nb::type_name(tiles_arg.type()).c_str());
          if (!PyUnicode_Check(names.ptr()))
            sw::raise<sw::TypeError>("tiled: tiles applies to one tensor name (a fused tensor split along its first "
                                     "axis), not to a sequence of names (each name is one tile)");
          int overflow = 0;
          const long long n = PyLong_AsLongLongAndOverflow(tiles_arg.ptr(), &overflow);
          if (overflow != 0)
            sw::raise<sw::ValueError>("tiled: tiles=", nb::str(tiles_arg).c_str(), " is out of range for tensor '",
                                      str_arg(names, "a tensor name"), "'");
          tiles = static_cast<int64_t>(n);
        }
        if (crash_safe && !is_mutable)
          sw::raise<sw::ValueError>("tiled(crash_safe=True) needs mutable=True: a read-only tier writes a scratch "
                                    "overlay, never the checkpoint's files");
        // Note [A checkpoint's tiled tensor] (strideweave/checkpoint/safetensors.hpp). The TiledEvictable is built
        // by its Python class, which wraps the residency policy; the tier and the geometry come from the core.
        const Writes w = is_mutable ? Writes::InPlace : Writes::Overlay;
        std::shared_ptr<CheckpointCarrier> tier;
        std::vector<int64_t> shape;
        if (PyUnicode_Check(names.ptr())) {  // one fused tensor, split along its first axis
          const std::string n = nb::cast<std::string>(names);
          {
            GilRelease nogil;
            tier = c.split_tier(n, w, tiles, options);
          }
          shape = c.split_shape(n, tiles, options);
        } else {
          if (!nb::isinstance<nb::iterable>(names))
            sw::raise<sw::TypeError>("tiled takes a tensor name or a sequence of names, got ",
                                     nb::type_name(names.type()).c_str());
          std::vector<std::string> list;
          for (nb::handle h : names) list.push_back(str_arg(h, "each tensor name"));
          if (list.empty()) sw::raise<sw::ValueError>("tiled needs at least one tensor name");
          {
            GilRelease nogil;
            tier = c.tier(list, w, options);
          }
          const std::optional<Quantization> q =
              c.quantization(list[0], options.scales.empty() ? std::string() : options.scales[0], options.block_rows,
                             options.block_cols);
          shape = q ? q->shape : c.info(list[0]).shape;
        }
        if (crash_safe) {
          GilRelease nogil;
          tier->make_crash_safe();  // opens each file's journal (Note [A crash-safe tier] in carriers/journal.cpp)
        }
        const sw::safetensors::TiledView v = sw::safetensors::tiled_view(shape, static_cast<int64_t>(tier->ranges().size()));
        if (!primary.is_none() && !nb::isinstance<sw::Carrier>(primary))
          sw::raise<sw::TypeError>("tiled: primary must be a Carrier or None");
        nb::object prim = primary.is_none()
                              ? nb::cast(sw::CarrierPtr(std::make_shared<sw::CPUCarrier>(0, tier->dtype(), true, false)))
                              : nb::borrow(primary);
        nb::object carrier = nb::type<sw::TiledEvictable>()(prim, nb::cast(sw::CarrierPtr(tier)), ints_tuple(v.grid),
                                                            ints_tuple(v.tile), nb::arg("residency_policy") = policy);
        return sw::make_tensor(nb::cast<sw::CarrierPtr>(carrier), 0, v.layout);
      }, nb::arg("names"), nb::arg("primary") = nb::none(), nb::arg("residency_policy") = nb::none(),
         nb::arg("mutable") = false, nb::arg("crash_safe") = false, nb::kw_only(), nb::arg("tiles") = nb::none(),
         nb::arg("dtype") = nb::none(), nb::arg("scales") = nb::none(), nb::arg("block") = nb::none(),
         nb::sig("def tiled(self, names: str | collections.abc.Sequence[str], primary: Carrier | None = None, "
                 "residency_policy: strideweave.carriers.tiled_evictable.ResidencyPolicy | None = None, "
                 "mutable: bool = False, crash_safe: bool = False, *, tiles: int | None = None, "
                 "dtype: DType | None = None, scales: str | collections.abc.Sequence[str] | None = None, "
                 "block: tuple[int, int] | None = None) -> Tensor"),
         "Same-shape, same-dtype tensors (or the first-axis slabs of one tensor, given its name alone) as the tiles "
         "of one full tensor of shape (*shape, tiles) over a TiledEvictable; each tile's bytes where they lie. "
         "With one name, tiles=N splits its first axis into N equal slabs of shape (shape[0] / N, *shape[1:]), "
         "or shape[1:] for slabs of one row (None: shape[0] slabs, one row each). Quantized tensors (FP8 "
         "block-scaled, MXFP4: see dtype()) need dtype=BFloat16 or Float32: each promotion reads the tile's quantized "
         "bytes and scales and dequantizes them into the tile; scales= names the scale tensors, block= FP8's block.")
      .def("__repr__", [](const Checkpoint& c) {
        return "Checkpoint(" + std::to_string(c.keys().size()) + " tensors)";
      });

  m.def("_safetensors_open", [](nb::handle path_list) {
    std::vector<std::string> paths;
    for (nb::handle p : path_list) paths.push_back(path_arg(p, "a checkpoint path"));
    GilRelease nogil;
    return Checkpoint::open(paths);
  }, nb::arg("paths"), nb::sig("def _safetensors_open(paths: collections.abc.Sequence[str | bytes]) -> Checkpoint"));

  // The kernels over NumPy buffers (sw.safetensors.dequantize / quantize check shapes and allocate the outputs).
  m.def("_quant_dequantize", [](const std::string& format, Bytes values, Bytes scales, const std::string& kind,
                                int64_t rows, int64_t cols, int64_t br, int64_t bc, Bytes out, bool out_bf16) {
    const auto sk = scale_kind(kind);
    const size_t sitem = sk == sw::QuantizedRange::Scale::F32 ? 4 : sk == sw::QuantizedRange::Scale::BF16 ? 2 : 1;
    const size_t oitem = out_bf16 ? 2 : 4;
    if (rows < 0 || cols < 0 || br < 1 || bc < 1) sw::raise<sw::ValueError>("dequantize: bad sizes");
    const bool fp8 = format == "fp8";
    if (!fp8 && format != "mxfp4") sw::raise<sw::ValueError>("dequantize: format is \"fp8\" or \"mxfp4\"");
    const int64_t n = rows * cols;
    const int64_t sr = fp8 ? (rows + br - 1) / br : rows, sc = fp8 ? (cols + bc - 1) / bc : cols / 32;
    if (values.nbytes() != static_cast<size_t>(fp8 ? n : n / 2) || scales.nbytes() != static_cast<size_t>(sr * sc) * sitem ||
        out.nbytes() != static_cast<size_t>(n) * oitem || (!fp8 && (cols % 32 != 0 || sk != sw::QuantizedRange::Scale::E8M0)))
      sw::raise<sw::ValueError>("dequantize: buffer sizes do not match ", rows, " x ", cols, " values");
    const auto* q = static_cast<const uint8_t*>(values.data());
    const auto* raw = static_cast<const std::byte*>(scales.data());
    GilRelease nogil;
    if (fp8) {
      std::vector<float> f(static_cast<size_t>(sr * sc));
      sw::quant::scales_to_float(raw, sk, sr * sc, f.data());
      sw::quant::dequantize_fp8(q, rows, cols, 0, f.data(), sc, br, bc, out.data(),
                                out_bf16 ? sw::quant::Out::BFloat16 : sw::quant::Out::Float32);
    } else {
      sw::quant::dequantize_mxfp4(q, reinterpret_cast<const uint8_t*>(raw), n / 32, out.data(),
                                  out_bf16 ? sw::quant::Out::BFloat16 : sw::quant::Out::Float32);
    }
  }, nb::arg("format"), nb::arg("values"), nb::arg("scales"), nb::arg("kind"), nb::arg("rows"), nb::arg("cols"),
     nb::arg("block_rows"), nb::arg("block_cols"), nb::arg("out"), nb::arg("out_bf16"));
  m.def("_quant_quantize", [](const std::string& format, Bytes values, bool in_bf16, int64_t rows, int64_t cols,
                              int64_t br, int64_t bc, Bytes q, Bytes scales) {
    const bool fp8 = format == "fp8";
    if (!fp8 && format != "mxfp4") sw::raise<sw::ValueError>("quantize: format is \"fp8\" or \"mxfp4\"");
    if (rows < 0 || cols < 0 || br < 1 || bc < 1 || (!fp8 && cols % 32 != 0)) sw::raise<sw::ValueError>("quantize: bad sizes");
    const int64_t n = rows * cols;
    const int64_t sr = fp8 ? (rows + br - 1) / br : rows, sc = fp8 ? (cols + bc - 1) / bc : cols / 32;
    if (values.nbytes() != static_cast<size_t>(n) * (in_bf16 ? 2 : 4) || q.nbytes() != static_cast<size_t>(fp8 ? n : n / 2) ||
        scales.nbytes() != static_cast<size_t>(sr * sc) * (fp8 ? 4 : 1))
      sw::raise<sw::ValueError>("quantize: buffer sizes do not match ", rows, " x ", cols, " values");
    GilRelease nogil;
    if (fp8) {
      sw::quant::quantize_fp8(values.data(), in_bf16, rows, cols, br, bc, static_cast<uint8_t*>(q.data()),
                              static_cast<float*>(scales.data()));
      return true;
    }
    return sw::quant::quantize_mxfp4(values.data(), in_bf16, n / 32, static_cast<uint8_t*>(q.data()),
                                     static_cast<uint8_t*>(scales.data()));
  }, nb::arg("format"), nb::arg("values"), nb::arg("in_bf16"), nb::arg("rows"), nb::arg("cols"), nb::arg("block_rows"),
     nb::arg("block_cols"), nb::arg("q"), nb::arg("scales"));
  m.def("_quant_uses_avx512", &sw::quant::uses_avx512);

  m.def("_safetensors_save", [](nb::handle path_arg_, nb::handle tensors, nb::handle metadata, nb::handle quantize) {
    const std::string path = path_arg(path_arg_, "the safetensors path");
    if (!nb::hasattr(tensors, "items")) sw::raise<sw::TypeError>("safetensors.save takes a dict of name -> Tensor");
    std::vector<std::pair<std::string, sw::TensorPtr>> list;
    for (nb::handle item : tensors.attr("items")()) {
      nb::object name = item[0], value = item[1];
      std::string n = str_arg(name, "a tensor name");
      if (!nb::isinstance<sw::TensorImpl>(value))
        sw::raise<sw::TypeError>("safetensors.save: tensor '", n, "' is a ", nb::type_name(value.type()).c_str(),
                                 ", not a Tensor");
      list.emplace_back(std::move(n), nb::cast<sw::TensorPtr>(value));
    }
    std::map<std::string, std::string> meta;
    if (!metadata.is_none()) {
      if (!nb::hasattr(metadata, "items")) sw::raise<sw::TypeError>("safetensors.save: metadata must be a dict of str -> str");
      for (nb::handle item : metadata.attr("items")())
        meta[str_arg(item[0], "a metadata key")] = str_arg(item[1], "a metadata value");
    }
    // quantize: name -> "fp8" | ("fp8", (rows, cols)) | "mxfp4" (Note [Saving a checkpoint]).
    std::map<std::string, sw::safetensors::SaveQuantization> quant;
    if (!quantize.is_none()) {
      if (!nb::hasattr(quantize, "items"))
        sw::raise<sw::TypeError>("safetensors.save: quantize must be a dict of tensor name -> \"fp8\", (\"fp8\", "
                                 "(rows, cols)) or \"mxfp4\"");
      for (nb::handle item : quantize.attr("items")()) {
        const std::string n = str_arg(item[0], "a tensor name in quantize");
        nb::handle how = item[1];
        sw::safetensors::SaveQuantization q;
        nb::handle fmt = how;
        if (nb::isinstance<nb::tuple>(how) && nb::len(how) == 2) {
          fmt = how[0];
          nb::handle b = how[1];
          if (!nb::isinstance<nb::tuple>(b) || nb::len(b) != 2 || !PyLong_Check(b[0].ptr()) || !PyLong_Check(b[1].ptr()))
            sw::raise<sw::TypeError>("safetensors.save: quantize['", n, "'] must be (\"fp8\", (rows, cols))");
          q.block_rows = nb::cast<int64_t>(b[0]);
          q.block_cols = nb::cast<int64_t>(b[1]);
        }
        const std::string f = str_arg(fmt, "a quantization format");
        if (f == "mxfp4" && fmt.ptr() == how.ptr()) q.format = Format::MXFP4;
        else if (f == "fp8") q.format = Format::FP8;
        else
          sw::raise<sw::ValueError>("safetensors.save: quantize['", n, "'] is \"", f, "\"; the formats are \"fp8\" "
                                    "(block-scaled, (\"fp8\", (rows, cols)) for another block) and \"mxfp4\"");
        quant[n] = q;
      }
    }
    GilRelease nogil;
    sw::safetensors::save(path, list, meta, quant);
  }, nb::arg("path"), nb::arg("tensors"), nb::arg("metadata").none(), nb::arg("quantize").none() = nb::none(),
     nb::sig("def _safetensors_save(path: str | bytes, tensors: object, metadata: object | None, "
             "quantize: object | None = None) -> None"));

  m.def("_install_folder", [](nb::handle temp, nb::handle target) {
    const std::string t = path_arg(temp, "the temporary folder"), g = path_arg(target, "the target folder");
    GilRelease nogil;
    sw::safetensors::install_folder(t, g);
  }, nb::arg("temp"), nb::arg("target"), nb::sig("def _install_folder(temp: str | bytes, target: str | bytes) -> None"));
  m.def("_remove_stale_folders", [](nb::handle target) {
    const std::string g = path_arg(target, "the target folder");
    GilRelease nogil;
    sw::safetensors::remove_stale_folders(g);
  }, nb::arg("target"), nb::sig("def _remove_stale_folders(target: str | bytes) -> None"));
}

}  // namespace swpy
