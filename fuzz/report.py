"""The table of a `make fuzz` run (docs/reliability.md, "Coverage-guided fuzzing").

Usage: report.py BUILD_DIR TARGET...; reads BUILD_DIR/<target>.log (libFuzzer's or atheris's output) and
BUILD_DIR/<target>.rc ("exit-status start end"), prints a Markdown table and writes it to BUILD_DIR/report.md.
Columns: seconds run, inputs executed, the last coverage figures libFuzzer printed (cov: edges of the
instrumented code reached; ft: features, edges with hit counts and value profiles), the corpus it ended with
(inputs), and crashes (inputs saved under BUILD_DIR/artifacts/).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

STATUS = re.compile(r"^#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)/")
EXECUTED = re.compile(r"stat::number_of_executed_units: (\d+)")
ARTIFACT = re.compile(r"Test unit written to (\S+)")


def row(build: Path, target: str) -> dict:
    log = (build / f"{target}.log").read_text(errors="replace") if (build / f"{target}.log").exists() else ""
    rc, start, end = (build / f"{target}.rc").read_text().split() if (build / f"{target}.rc").exists() else ("-", 0, 0)
    r = {"target": target, "seconds": f"{float(end) - float(start):.0f}", "executions": "-", "cov": "-", "ft": "-",
         "corpus": "-", "crashes": 0, "rc": rc}
    for line in log.splitlines():
        if m := STATUS.match(line):
            r["executions"], r["cov"], r["ft"], r["corpus"] = m.groups()
        if m := EXECUTED.search(line):
            r["executions"] = m.group(1)
    r["crashes"] = len(ARTIFACT.findall(log)) or (0 if rc == "0" else 1)
    return r


def main() -> int:
    build = Path(sys.argv[1])
    rows = [row(build, t) for t in sys.argv[2:]]
    lines = ["| target | seconds | executions | cov | ft | corpus | crashes |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['target']} | {r['seconds']} | {r['executions']} | {r['cov']} | {r['ft']} | {r['corpus']} "
                     f"| {r['crashes']} |")
    text = "\n".join(lines) + "\n"
    (build / "report.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
