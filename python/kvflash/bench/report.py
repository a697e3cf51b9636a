"""Results and their rendering: llama-bench-style markdown, csv, json, and the --out folder."""
from __future__ import annotations

import csv
import dataclasses
import io
import json
from pathlib import Path
from typing import Any, Optional

from .common import fmt_num, fmt_stat, is_stat


@dataclasses.dataclass
class Result:
    """One routine's output: display rows (stats as {median,min,max,n} dicts), raw per-repeat records."""

    routine: str
    title: str
    columns: list                # (key, header) pairs, in display order
    rows: list = dataclasses.field(default_factory=list)
    raw: list = dataclasses.field(default_factory=list)
    notes: list = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        return {"routine": self.routine, "title": self.title, "columns": [k for k, _ in self.columns],
                "rows": self.rows, "raw": self.raw, "notes": self.notes}


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if is_stat(v):
        return fmt_stat(v)
    if isinstance(v, float):
        return fmt_num(v)
    return str(v)


def to_markdown(results: list, config: dict, machine: dict) -> str:
    out = io.StringIO()
    threads = config.get("threads_used") or config.get("threads")
    dirty = {True: " (dirty tree)", False: "", None: " (tree state unknown)"}.get(machine.get("kvflash_dirty"), "")
    out.write(f"<!-- kvflash {str(machine.get('kvflash_commit'))[:12]}{dirty}, {machine.get('time')}, "
              f"`{' '.join(['python -m kvflash.bench'] + list(config.get('argv') or []))}` -->\n")
    out.write(f"<!-- kvflash bench, preset {config.get('preset')}: {machine.get('cpu')}, "
              f"{machine.get('physical_cores')} cores, backend {machine.get('backend')}, "
              f"ggml {machine.get('ggml_version')} ({machine.get('ggml_commit')}), threads {threads} -->\n")
    b = machine.get("build") or {}
    if b:
        out.write(f"<!-- build: native {b.get('native')}, {b.get('compiler')}, ggml-cpu features "
                  f"{' '.join(b.get('cpu_features') or [])}; extra weight buffers "
                  f"{', '.join(b.get('cpu_extra_buffer_types') or []) or 'none'}, repack {b.get('repack')}; weights: " +
                  ("; ".join(f"{k}: {' | '.join(v)}" for k, v in (machine.get("weight_placement") or {}).items())
                   or "-") + " -->\n")
    for r in results:
        out.write(f"\n### {r.title}\n\n")
        heads = [h for _, h in r.columns]
        rows = [[_cell(row.get(k)) for k, _ in r.columns] for row in r.rows]
        widths = [max(len(h), *(len(x[i]) for x in rows)) if rows else len(h) for i, h in enumerate(heads)]
        numeric = [all(_is_numeric_cell(x[i]) for x in rows) if rows else False for i in range(len(heads))]
        out.write("| " + " | ".join(h.ljust(w) for h, w in zip(heads, widths)) + " |\n")
        out.write("| " + " | ".join(("-" * (w - 1) + ":") if num else "-" * w
                                    for w, num in zip(widths, numeric)) + " |\n")
        for x in rows:
            out.write("| " + " | ".join(c.rjust(w) if num else c.ljust(w)
                                        for c, w, num in zip(x, widths, numeric)) + " |\n")
        if r.notes:
            out.write("\n")
            for n in r.notes:
                out.write(f"- {n}\n")
    return out.getvalue()


def _is_numeric_cell(s: str) -> bool:
    head = s.split(" ")[0].replace(".", "", 1).replace("-", "", 1).replace("x", "")
    return head.isdigit() or s == "-"


def _flat(row: dict) -> dict:
    flat = {}
    for k, v in row.items():
        if is_stat(v):
            for sk in ("median", "min", "max", "n"):
                flat[f"{k}_{sk}"] = v[sk]
        elif isinstance(v, (list, dict)):
            flat[k] = json.dumps(v)
        else:
            flat[k] = v
    return flat


def to_csv(records: list) -> str:
    flat = [_flat(r) for r in records]
    keys: list = []
    for f in flat:
        for k in f:
            if k not in keys:
                keys.append(k)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for f in flat:
        w.writerow(f)
    return buf.getvalue()


def rows_csv(results: list) -> str:
    return to_csv([{"routine": r.routine, **row} for r in results for row in r.rows])


def raw_csv(results: list) -> str:
    return to_csv([{"routine": r.routine, **row} for r in results for row in r.raw])


def to_json(results: list, config: dict, machine: dict) -> str:
    return json.dumps({"config": config, "machine": machine, "results": [r.to_dict() for r in results]},
                      indent=2, default=str)


def render(fmt: str, results: list, config: dict, machine: dict) -> str:
    if fmt == "json":
        return to_json(results, config, machine) + "\n"
    if fmt == "csv":
        return rows_csv(results)
    return to_markdown(results, config, machine)


def write_out(folder: Path, results: list, config: dict, machine: dict) -> list:
    """The table, the raw per-repeat numbers, the configuration and the machine, as files."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        "table.md": to_markdown(results, config, machine),
        "results.json": to_json(results, config, machine) + "\n",
        "rows.csv": rows_csv(results),
        "raw.csv": raw_csv(results),
        "config.json": json.dumps(config, indent=2, default=str) + "\n",
        "machine.json": json.dumps(machine, indent=2, default=str) + "\n",
    }
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return [folder / n for n in files]


def load_results(path: Path) -> tuple[list, dict, dict]:
    """Read a results.json back (for --plot on committed results)."""
    d = json.loads(Path(path).read_text())
    res = [Result(routine=r["routine"], title=r["title"], columns=[(k, k) for k in r["columns"]],
                  rows=r["rows"], raw=r["raw"], notes=r["notes"]) for r in d["results"]]
    return res, d["config"], d["machine"]
