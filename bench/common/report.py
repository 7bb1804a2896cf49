"""The one report writer, and the plain-text tables every benchmark prints.

A report is a JSON-able dict that starts with :meth:`RunRecord.head`: which
benchmark, when, and on what machine. :func:`publish` prints the benchmark's
table and writes the report as ``<name>-<device>-<stamp>.json`` and
``<name>-<device>-latest.json`` under ``bench/results/``: the stamped file keeps
the history, the latest one is what documentation and code comments cite.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common.machine import BENCH_DIR, load_average, machine_info, path_placeholders, scrub_paths

RESULTS_DIR = BENCH_DIR / "results"
SCHEMA_VERSION = 1


def _now() -> dt.datetime:
    return dt.datetime.now().astimezone()


@dataclasses.dataclass
class RunRecord:
    """When and where a benchmark run started: the head of its report. Made at
    the start of the run, so that the load average before it is on record."""

    benchmark: str
    device: str
    started: dt.datetime = dataclasses.field(default_factory=_now)
    load_average_start: list[float] | None = dataclasses.field(default_factory=load_average)

    @property
    def stamp(self) -> str:
        return self.started.strftime("%Y%m%d-%H%M%S")

    def head(self, **machine_extra: Any) -> dict[str, Any]:
        """The report's first fields, made at the end of the run: its duration,
        and the machine record (plus ``machine_extra``) with the load average
        before and after."""
        return {
            "benchmark": self.benchmark,
            "schema_version": SCHEMA_VERSION,
            "started_at": self.started.isoformat(timespec="seconds"),
            "run_stamp": self.stamp,
            "duration_seconds": round((_now() - self.started).total_seconds(), 2),
            "machine": {**machine_info(self.device), **machine_extra,
                        "load_average_start": self.load_average_start, "load_average_end": load_average()},
        }


def write_report(report: dict[str, Any], name: str, out_dir: Path = RESULTS_DIR) -> tuple[Path, Path]:
    """Write ``report`` (paths scrubbed) as ``<name>-<device>-<stamp>.json`` and
    overwrite ``<name>-<device>-latest.json``; each file appears whole (written to
    ``.tmp``, then renamed), so a reader never sees half a report."""
    out_dir.mkdir(parents=True, exist_ok=True)
    device = report["machine"]["device"].replace(":", "")
    text = json.dumps(scrub_paths(report, path_placeholders()), indent=2, default=str) + "\n"
    paths = (out_dir / f"{name}-{device}-{report['run_stamp']}.json", out_dir / f"{name}-{device}-latest.json")
    for path in paths:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return paths


def publish(report: dict[str, Any], name: str, table: str, out_dir: Path | None = RESULTS_DIR) -> None:
    """Print ``table``, then write the report (unless ``out_dir`` is None) and
    print where it went."""
    print(table)
    if out_dir is None:
        return
    stamped, latest = (_shown(p) for p in write_report(report, name, out_dir))
    print(f"\nresults: {stamped}\n         {latest}")


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it."""
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else rel


def fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    """A table cell: ``value`` to ``digits`` decimals, or ``n/a``."""
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain-text columns: text left-aligned, numbers right-aligned."""

    def numeric(cell: str) -> bool:
        return cell.rstrip("x%").replace(".", "", 1).replace("-", "", 1).isdigit()

    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    right = [all(numeric(r[i]) or r[i] in ("-", "n/a") for r in rows) and bool(rows) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(c).rjust(w) if r else str(c).ljust(w) for c, w, r in zip(cells, widths, right)
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown (GitHub) table, ready to paste into the README: text columns
    left-aligned, numeric ones right-aligned."""

    def numeric(cell: str) -> bool:
        return cell.rstrip("x%s").replace(".", "", 1).replace("-", "", 1).isdigit()

    right = [bool(rows) and all(numeric(str(r[i])) or r[i] in ("-", "n/a") for r in rows)
             for i in range(len(headers))]
    rule = ["---:" if r else "---" for r in right]
    return "\n".join("| " + " | ".join(str(c) for c in cells) + " |" for cells in [headers, rule, *rows])
