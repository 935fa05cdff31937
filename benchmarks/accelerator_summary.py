"""Every accelerator target of issue 41 in one table, from the JSON the check's benchmarks wrote.

    python benchmarks/accelerator_summary.py OUT [--backend NAME] [--md FILE]

``OUT`` is the folder ``benchmarks/accelerator_check.sh`` writes: ``feed.json``
(``bench_feed.py --out``), ``device_replay.json`` (``bench_device_replay.py --out``),
``device_writes.json`` (``bench_device_writes.py --out``), ``device/results.json``
(``run.py --sections device``) and ``runs.tsv`` (each benchmark's name, exit status and
seconds), which says why a result is missing. The targets:

- the host-fed step / min(step, link) >= 0.9, mlp and conv, worker_count 0 and 4
  (``fed-w0-default``, ``fed-w4-default``: what a user gets);
- ``gr.DeviceReplay`` inside the step / the bare step: uniform >= 0.97, prioritized >= 0.9,
  mlp and conv;
- resident replay: the step fed by ``sharded_device_put(resident=True)`` / the step on
  device batches >= 0.95 (transitions: mlp, images: conv);
- device writes: the device_actor loop with writing / without >= 0.9;

and, below them, the device section's own GPU targets (issue 17). A row is judged (PASS or
FAIL) only when the backend its file records is an accelerator (tpu, gpu); on CPU it is
printed, not judged. Standard library only: it runs on any interpreter.

Exit status: 0 whatever the verdicts (a missed target is a finding); 2 when a file is not
what its benchmark writes (its rows say so; the others are still printed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

ACCELERATORS = ("tpu", "gpu", "cuda", "rocm")
FEED_TARGET = 0.9
UNIFORM_TARGET = 0.97
PRIORITIZED_TARGET = 0.9
RESIDENT_TARGET = 0.95
WRITES_TARGET = 0.9
# What each benchmark writes in OUT, and its name in runs.tsv.
FILES = {
    "bench_feed": "feed.json",
    "bench_device_replay": "device_replay.json",
    "bench_device_writes": "device_writes.json",
    "device_section": "device/results.json",
}
WORKLOADS = {"transitions": "mlp", "images": "conv"}  # the device section's datasets


class SummaryInputError(ValueError):
    """A result file that is not what its benchmark writes."""


@dataclasses.dataclass
class Row:
    issue: str
    target: str
    need: float
    ratio: float | None = None
    measured: str = ""
    backend: str | None = None
    missing: str = ""  # why there is no ratio

    def verdict(self) -> str:
        if self.ratio is None:
            return f"no result: {self.missing}"
        if self.backend not in ACCELERATORS:
            return f"not judged ({self.backend or 'backend unknown'})"
        return "PASS" if self.ratio >= self.need else "FAIL"


def read_runs(out: Path) -> dict[str, tuple[int, float]]:
    """``runs.tsv``: benchmark name -> (exit status, seconds); {} when absent."""
    path = out / "runs.tsv"
    if not path.exists():
        return {}
    runs = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        cells = line.split("\t")
        try:
            runs[cells[0]] = (int(cells[1]), float(cells[2]))
        except (IndexError, ValueError):
            raise SummaryInputError(
                f"{path}, line {n}: {line!r} is not 'name<TAB>exit status<TAB>seconds'. "
                "Fix: let benchmarks/accelerator_check.sh write it, or delete the file."
            ) from None
    return runs


def why_missing(bench: str, out: Path, runs: dict[str, tuple[int, float]]) -> str:
    """Why ``bench`` left no file: its exit status from runs.tsv, or that it did not run."""
    if bench not in runs:
        return f"{bench} did not run ({FILES[bench]} not in {out})"
    rc, seconds = runs[bench]
    if rc in (124, 137):
        return f"{bench} timed out after {seconds:.0f} s (logs/{bench}.log)"
    if rc != 0:
        return f"{bench} failed, exit status {rc} (logs/{bench}.log)"
    return f"{bench} exited 0 but wrote no {FILES[bench]}"


def load(bench: str, out: Path, runs: dict[str, tuple[int, float]]) -> tuple[Any, str]:
    """``(document, "")``, or ``(None, why there is none)``; raises on a malformed file."""
    path = out / FILES[bench]
    if not path.exists():
        return None, why_missing(bench, out, runs)
    try:
        doc = json.loads(path.read_text())
    except ValueError as e:
        raise SummaryInputError(
            f"{path} is not JSON ({e}). Fix: run {bench} again (a run cut short leaves a "
            "partial file), or delete the file."
        ) from None
    if not isinstance(doc, dict):
        raise SummaryInputError(
            f"{path} holds a {type(doc).__name__}, not the object {bench} writes. "
            f"Fix: run {bench} again with --out {path}."
        )
    return doc, ""


def _get(doc: Any, path: Path, *keys: str) -> Any:
    """``doc[k0][k1]...``, or None where a key is absent (that case did not run)."""
    for k in keys:
        if not isinstance(doc, dict) or k not in doc:
            return None
        doc = doc[k]
    return doc


def _number(value: Any, path: Path, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SummaryInputError(
            f"{path}: {where} is {value!r}, not a finite number. "
            "Fix: run the benchmark again; a file edited by hand must keep its numbers."
        )
    return float(value)


def _backend(doc: Any, default: str | None) -> str | None:
    found = doc.get("backend") if isinstance(doc, dict) else None
    return found if isinstance(found, str) else default


def feed_rows(doc: Any, why: str, path: Path, backend: str | None) -> list[Row]:
    rows = []
    for name in ("mlp", "conv"):
        for w in (0, 4):
            case = f"fed-w{w}-default"
            row = Row("#41", f"host-fed step / min(step, link): {name}, worker_count {w}",
                      FEED_TARGET, backend=_backend(doc, backend))  # fmt: skip
            rows.append(row)
            if doc is None:
                row.missing = why
                continue
            ratio = _get(doc, path, name, "ratios", case)
            if ratio is None:
                row.missing = f"no {name}.ratios.{case} in {path.name}"
                continue
            row.ratio = _number(ratio, path, f"{name}.ratios.{case}")
            rates = _get(doc, path, name, "rates")
            if isinstance(rates, dict) and case in rates and "step" in rates:
                link = _get(doc, path, name, "link")
                row.measured = f"fed {_number(rates[case], path, f'{name}.rates.{case}'):.1f}/s; "
                row.measured += f"step {_number(rates['step'], path, f'{name}.rates.step'):.1f}/s"
                if link is not None:
                    row.measured += f", link {_number(link, path, f'{name}.link'):.1f}/s"
    return rows


def replay_rows(doc: Any, why: str, path: Path, backend: str | None) -> list[Row]:
    rows = []
    for mode, need in (("uniform", UNIFORM_TARGET), ("prioritized", PRIORITIZED_TARGET)):
        for name in ("mlp", "conv"):
            row = Row("#41", f"DeviceReplay {mode} in the step / bare step: {name}", need,
                      backend=_backend(doc, backend))  # fmt: skip
            rows.append(row)
            if doc is None:
                row.missing = why
                continue
            rates = _get(doc, path, "workloads", name, "rates")
            if not isinstance(rates, dict) or mode not in rates or "bare" not in rates:
                row.missing = f"no workloads.{name}.rates.{mode} in {path.name}"
                continue
            at = f"workloads.{name}.rates"
            rate = _number(rates[mode], path, f"{at}.{mode}")
            bare = _number(rates["bare"], path, f"{at}.bare")
            row.ratio = rate / bare if bare > 0 else None
            row.missing = "" if bare > 0 else f"{at}.bare is 0"
            row.measured = f"{rate:.1f} vs bare {bare:.1f} steps/s"
            theirs = _get(doc, path, "peers", name, "rates", mode)
            if theirs is not None and _number(theirs, path, f"peers.{name}.rates.{mode}") > 0:
                row.measured += f"; flashbax {theirs:.1f}/s (ours/theirs {rate / theirs:.2f})"
    return rows


def device_rows(doc: Any, why: str, path: Path, backend: str | None) -> list[Row]:
    """Resident replay against the step (#41), then the section's own GPU targets (#17)."""
    section = _get(doc, path, "sections", "device")
    if doc is not None and not isinstance(section, dict):
        why = f"no device section in {path.name} (run.py --sections device)"
        doc = None
    found = _get(section, path, "jax", "backend") if doc is not None else None
    here = found if isinstance(found, str) else backend
    ratios = section.get("ratios", []) if doc is not None else []
    cases = {c.get("name"): c for c in section.get("cases", [])} if doc is not None else {}
    notes = "\n".join(section.get("notes", [])) if doc is not None else ""
    rows = []
    for ds, name in WORKLOADS.items():
        row = Row("#41", f"step fed by resident replay / step on device batches: {name}",
                  RESIDENT_TARGET, backend=here)  # fmt: skip
        rows.append(row)
        if doc is None:
            row.missing = why
            continue
        prefix = f"device/{ds}: step-fed-by-resident /"
        hit = next((r for r in ratios if str(r.get("name", "")).startswith(prefix)), None)
        if hit is None:
            skipped = f"{ds}: resident replay skipped"
            row.missing = (
                "resident replay skipped (over its device budget)"
                if skipped in notes
                else f"no ratio {prefix}... in {path.name}"
            )
            continue
        row.ratio = _number(hit.get("value"), path, f"ratio {hit.get('name')!r}")
        num, den = cases.get(hit.get("num")), cases.get(hit.get("den"))
        if num and den and "ms_per_batch" in num and "ms_per_batch" in den:
            row.measured = (
                f"{_number(num['ms_per_batch'], path, 'ms_per_batch'):.3g} ms/step fed, "
                f"{_number(den['ms_per_batch'], path, 'ms_per_batch'):.3g} on device batches"
            )
        ceiling = f"device/{ds}: step-fed-by-window-copies /"
        top = next((r for r in ratios if str(r.get("name", "")).startswith(ceiling)), None)
        if top is not None:  # the same outputs a dispatch with no gather: the host's bound
            value = _number(top.get("value"), path, f"ratio {top.get('name')!r}")
            row.measured = f"{row.measured}; ceiling (a window of copies, no gather) {value:.3f}"
    for t in section.get("gpu_targets", []) if doc is not None else []:
        rows.append(
            Row(
                "#17", f"device section: {t.get('name')}",
                _number(t.get("target"), path, f"gpu_targets {t.get('name')!r} target"),
                ratio=_number(t.get("value"), path, f"gpu_targets {t.get('name')!r} value"),
                backend=here,
            )
        )  # fmt: skip
    return rows


def writes_rows(doc: Any, why: str, path: Path, backend: str | None) -> list[Row]:
    row = Row("#41", "device_actor loop with writing / without", WRITES_TARGET,
              backend=_backend(doc, backend))  # fmt: skip
    if doc is None:
        row.missing = why
        return [row]
    rows = doc.get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise SummaryInputError(
            f"{path}: 'rows' is {type(rows).__name__}, not the list of rows "
            "bench_device_writes.py writes. Fix: run it again with --out."
        )
    by_name = {str(r.get("name", "")): r for r in rows}
    hit = next((r for n, r in by_name.items() if n.startswith("device writes: loop with")), None)
    if hit is None or hit.get("value") is None:
        row.missing = f"no 'device writes: loop with writing / without' value in {path.name}"
        return [row]
    row.ratio = _number(hit["value"], path, f"row {hit['name']!r}")
    off = by_name.get("device_actor loop without writing", {}).get("value")
    on = by_name.get("device_actor loop with writing", {}).get("value")
    if off is not None and on is not None:
        row.measured = f"{on:.4g} vs {off:.4g} steps/s"
    return [row]


def summarize(out: Path, backend: str | None) -> tuple[list[Row], list[str]]:
    """The rows, and the errors of files that were not what their benchmark writes."""
    errors: list[str] = []
    try:
        runs = read_runs(out)
    except SummaryInputError as e:
        errors.append(str(e))
        runs = {}
    rows: list[Row] = []
    makers = (
        ("bench_feed", feed_rows),
        ("bench_device_replay", replay_rows),
        ("device_section", device_rows),
        ("bench_device_writes", writes_rows),
    )
    for bench, make in makers:
        path = out / FILES[bench]
        unreadable = f"{path.name} is unreadable (the error is printed below the table)"
        try:
            doc, why = load(bench, out, runs)
        except SummaryInputError as e:
            errors.append(str(e))
            doc, why = None, unreadable
        try:
            rows += make(doc, why, path, backend)
        except SummaryInputError as e:  # a value that is not a number: every row says so
            errors.append(str(e))
            rows += make(None, unreadable, path, backend)
    # Issue 41's targets first, in the order above; the device section's own (#17) below.
    return sorted(rows, key=lambda r: r.issue != "#41"), errors


def markdown(rows: list[Row], backend: str | None) -> str:
    judged = [r for r in rows if r.ratio is not None and r.backend in ACCELERATORS]
    passed = sum(r.verdict() == "PASS" for r in judged)
    missing = sum(r.ratio is None for r in rows)
    lines = [
        f"## Accelerator targets (issue 41), backend {backend or 'unknown'}",
        "",
        "| issue | target | ratio | needs | measured | verdict |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ratio = "" if r.ratio is None else f"{r.ratio:.3f}"
        cells = (r.issue, r.target, ratio, f">= {r.need:.3g}", r.measured, r.verdict())
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    lines.append("")
    if judged:
        lines.append(f"{len(judged)} judged: {passed} PASS, {len(judged) - passed} FAIL; "
                     f"{missing} without a result.")  # fmt: skip
    else:
        lines.append(
            f"Nothing judged: targets are judged on an accelerator only; {missing} without "
            "a result."
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the folder accelerator_check.sh wrote (its --out)")
    p.add_argument("--backend", default=None, help="jax's backend, for files that do not record it")
    p.add_argument("--md", default=None, help="also write the table to this file")
    args = p.parse_args(argv)
    out = Path(args.out)
    if not out.is_dir():
        print(
            f"accelerator_summary: {out} is not a folder. Fix: pass the --out folder of "
            "benchmarks/accelerator_check.sh.",
            file=sys.stderr,
        )
        return 2
    rows, errors = summarize(out, args.backend)
    text = markdown(rows, args.backend)
    print(text, end="")
    if args.md:
        Path(args.md).write_text(text)
    for e in errors:
        print(f"accelerator_summary: {e}", file=sys.stderr)
    return 2 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
