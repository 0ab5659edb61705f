"""Writes hand-made seeds into fuzz/corpus/<target>/ (seed-*): well-formed safetensors files, headers and indexes,
small layout, tile and provider scripts. `make fuzz` grows each corpus from them, and `make fuzz-corpus` keeps the
fewest inputs that reach every edge reached (libFuzzer -merge=1), seeds included only where they add one. Rerun
after changing how a target decodes its input (python fuzz/make_seeds.py), then make fuzz and make fuzz-corpus."""

from __future__ import annotations

import json
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parent / "corpus"


def st_file(tensors: dict, metadata: dict | None = None, pad: int = 0) -> bytes:
    """A safetensors file: {name: (dtype, shape, itemsize)} laid out in order, data bytes counting up."""
    header, at = {}, 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, (dtype, shape, itemsize) in tensors.items():
        n = itemsize
        for e in shape:
            n *= e
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8 + pad)
    return struct.pack("<Q", len(text)) + text + bytes((i * 7 + 1) & 0xFF for i in range(at))


def write(target: str, name: str, data: bytes) -> None:
    d = ROOT / target
    d.mkdir(parents=True, exist_ok=True)
    (d / f"seed-{name}").write_bytes(data)


def main() -> None:
    # safetensors_fuzz: first byte % 4 = 0 raw file, 1 JSON under a correct length, 2 built header, 3 index JSON
    files = {
        "bf16": st_file({"w": ("BF16", [2, 3], 2)}),
        "experts": st_file({f"model.layers.0.experts.{e}.w1.weight": ("BF16", [4, 2], 2) for e in range(3)},
                           metadata={"format": "pt"}),
        "mixed": st_file({"a": ("F32", [3], 4), "b": ("I64", [1, 2], 8), "c": ("F16", [0], 2), "d": ("BOOL", [], 1),
                          "e": ("F8_E4M3", [2], 1), "f": ("U8", [5], 1)}),
        "empty": st_file({}),
    }
    for name, data in files.items():
        write("safetensors_fuzz", f"raw-{name}", b"\x00" + data)
    write("safetensors_fuzz", "json", b"\x01" + json.dumps(
        {"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "__metadata__": {"k": "v"}}).encode())
    write("safetensors_fuzz", "built", b"\x02" + bytes(range(1, 64)))
    write("safetensors_fuzz", "index", b"\x03" + json.dumps(
        {"metadata": {"total_size": 8}, "weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"}}).encode())
    # layout_fuzz: rank, mode trees, strides, coordinates, views
    for k, data in enumerate([b"\x02\x01\x02\x01\x03\x05\x01\x02\x00\x00\x01\x02\x03",
                              b"\x03\x04\x02\x01\x02\x01\x03\x04\x05\x01\x01\x00\x02\x01\x02\x03\x00\x01\x02",
                              b"\x01\x00\x02\x02\x03\x01\x05\x07\x01\x02\x03\x01\x01\x00\x00\x02\x01",
                              b"\x04\x01\x02\x01\x03\x01\x04\x01\x05" + b"\x01\x02\x03\x04" * 6]):
        write("layout_fuzz", f"views-{k}", data)
    # tiles_fuzz: rank, grid, tile, tile sets, selection, policy script, steps
    for k, data in enumerate([b"\x01\x03\x02\x02\x02\x01\x00\x01\x01\x01\x00\x02\x00\x01\x00\x01\x00",
                              b"\x02\x02\x02\x02\x01\x01\x02\x03\x00\x01\x01\x00\x02\x01\x00\x01\x01\x08\x00\x02\x00",
                              b"\x00\x04\x01\x04\x02\x02\x00\x01\x02\x03\x01\x05\x02\x02\x02\x00\x01\x01\x00\x01"]):
        write("tiles_fuzz", f"project-{k}", data)
    # extension_fuzz: behaviours (all "ok" = 0..3), then steps
    for k, data in enumerate([bytes(11) + bytes(11) + b"\x02\x01\x04\x01\x02\x03\x00\x01",
                              bytes(11) + bytes(11) + b"\x03\x03\x02\x01\x01\x01\x00\x01\x00\x02\x01",
                              b"\x07" * 11 + bytes(11) + b"\x02\x01\x03\x01\x02\x03\x00\x01"]):
        write("extension_fuzz", f"moves-{k}", data)


if __name__ == "__main__":
    main()
