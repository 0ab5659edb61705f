"""loss.png: the loss per step, drawn by matplotlib when it is installed, else by a small PNG writer here (the
axes' frame and the curve, no text: the numbers are in loss.csv)."""

from __future__ import annotations

import struct
import zlib

import numpy as np


def plot_loss(path: str, steps: list, losses: list) -> str:
    """Writes the plot to `path`; returns "matplotlib" or "builtin" (which drew it)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        write_png(path, draw(steps, losses))
        return "builtin"
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    ax.plot(steps, losses, marker="." if len(steps) < 50 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("fine-tuning loss")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return "matplotlib"


def draw(steps: list, losses: list, width: int = 640, height: int = 400) -> np.ndarray:
    """(height, width, 3) uint8: white, a grey frame 40 px inside the edges, the curve in blue."""
    img = np.full((height, width, 3), 255, dtype=np.uint8)
    m = 40
    img[m, m:width - m] = img[height - m, m:width - m] = 160
    img[m:height - m + 1, m] = img[m:height - m + 1, width - m] = 160
    if not steps:
        return img
    xs, ys = np.asarray(steps, dtype=np.float64), np.asarray(losses, dtype=np.float64)
    x0, x1 = float(xs.min()), float(xs.max())
    finite = ys[np.isfinite(ys)]
    y0, y1 = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    px = m + (xs - x0) / ((x1 - x0) or 1.0) * (width - 2 * m)
    py = height - m - (np.nan_to_num(ys, nan=y1, posinf=y1, neginf=y0) - y0) / ((y1 - y0) or 1.0) * (height - 2 * m)
    points = list(zip(px.round().astype(int), py.round().astype(int)))
    blue = (31, 119, 180)
    for (ax, ay), (bx, by) in zip(points, points[1:] or points):
        n = max(abs(bx - ax), abs(by - ay), 1)
        for t in range(n + 1):
            x, y = ax + (bx - ax) * t // n, ay + (by - ay) * t // n
            img[max(y - 1, 0):y + 2, max(x - 1, 0):x + 2] = blue
    return img


def write_png(path: str, img: np.ndarray) -> None:
    """An 8-bit RGB PNG of `img` (filter 0 on every row, one zlib stream)."""
    height, width, _ = img.shape
    raw = b"".join(b"\x00" + img[r].tobytes() for r in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
