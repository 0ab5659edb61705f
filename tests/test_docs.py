"""The documentation's Python snippets run: every ```python block of README.md and docs/guide.md.

The blocks of one document run in order in one shared namespace (a later block
may use names an earlier one defined, as a reader would), in a temporary
working directory, with temporary files (tempfile and the engine's anonymous
FileBacked files, which follow TMPDIR) under pytest's tmp_path. A failing
block's traceback points at the document's own line numbers.
"""

from __future__ import annotations

import gc
import os
import re
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENTS = ["README.md", os.path.join("docs", "guide.md")]

# A fence opens with ```python at the start of a line and closes with the next ``` at the start of a line.
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(path: str) -> list[tuple[int, str]]:
    """(first line number of the code, code) for every ```python block of the file."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


def test_fence_extraction(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n```python\na = 1\n```\n```sh\nmake\n```\n\n```python\nb = a + 1\n```\n")
    assert python_blocks(str(doc)) == [(3, "a = 1\n"), (10, "b = a + 1\n")]


@pytest.mark.parametrize("document", DOCUMENTS)
def test_python_snippets_run(document, tmp_path, monkeypatch):
    path = os.path.join(ROOT, document)
    blocks = python_blocks(path)
    assert blocks, f"{document} has no ```python blocks"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    namespace = {"__name__": f"docs:{document}"}
    try:
        for line, code in blocks:
            # Padding keeps the document's line numbers in tracebacks.
            compiled = compile("\n" * (line - 1) + code, path, "exec")
            try:
                exec(compiled, namespace)
            except Exception as e:
                raise AssertionError(f"the ```python block at {document}:{line} fails: {type(e).__name__}: {e}") from e
    finally:
        namespace.clear()
        gc.collect()
