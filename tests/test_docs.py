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


def test_the_family_table_is_the_declared_families():
    """docs/guide.md's family table ("Opening a Hugging Face MoE bigger than RAM") lists exactly the families of
    strideweave.torch.families, in order; a family is "yes" under Tested exactly when tests/hf_families.py's zoo
    (which tests/test_hf_families.py runs) has a model of it; its on-disk form names the tensors the declaration
    looks for."""
    import sys
    from strideweave.torch import families
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import hf_families

    with open(os.path.join(ROOT, "docs", "guide.md"), encoding="utf-8") as fh:
        text = fh.read()
    start = text.index("| Family | Tested | On-disk form |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    assert [r[0] for r in rows] == [f.name for f in families.FAMILIES]
    for (name, tested, form), family in zip(rows, families.FAMILIES):
        in_zoo = any(t in hf_families.ZOO for t in family.model_types)
        assert tested == ("yes" if in_zoo else "no"), name
        declared = family.forms[0]
        first = declared.gate if isinstance(declared, families.Separate) else declared.gate_up
        # the name of the gate (or fused gate/up) tensor, without the expert index and ".weight"
        stem = first.replace("{e}.", "").replace(".weight", "")
        assert f"`{stem}`" in form or f"`{stem}`/" in form or stem in form, (name, stem, form)
