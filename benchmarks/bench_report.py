"""Markdown tables, results.json and the ratio bar chart."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from bench_common import Case, Ratio, SectionResult

__all__ = ["markdown", "write_json", "write_plot"]


def _fmt(x: float, digits: int = 3) -> str:
    if x == 0 or not math.isfinite(x):
        return str(x)
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def _limit_of(res: SectionResult, c: Case) -> Case | None:
    return res.get(f"{c.section}/{c.dataset}/memory/numpy-gather")


def case_table(res: SectionResult) -> list[str]:
    show_limit = res.name == "formats"
    head = "| case | ms/batch | records/s | MB/s |" + (" x limit |" if show_limit else "")
    head += " spread | batchesxrepeats | note |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in res.cases:
        ms = 1e3 * c.median_s / c.batches
        row = (
            f"| {c.dataset}/{c.layout}/{c.method} | {_fmt(ms)} | {c.records_per_s:,.0f} "
            f"| {_fmt(c.mb_per_s)} |"
        )
        if show_limit:
            limit = _limit_of(res, c)
            row += f" {_fmt(c.records_per_s / limit.records_per_s) if limit else '-'} |"
        row += f" {c.spread:.0%} | {c.batches}x{len(c.repeat_s)} | {c.note} |"
        lines.append(row)
    return lines


def ratio_table(ratios: list[Ratio]) -> list[str]:
    lines = ["| ratio | value | target | pass |", "|---|---|---|---|"]
    for r in ratios:
        target = "-" if r.target is None else f"≥{_fmt(r.target)}"
        ok = {None: "", True: "PASS", False: "**FAIL**"}[r.passed]
        lines.append(f"| {r.name} | {_fmt(r.value)}x | {target} | {ok} |")
    return lines


def markdown(sections: list[SectionResult], meta: dict[str, Any]) -> str:
    out = [f"# grain_replay benchmarks ({meta['mode']})", ""]
    out.append(
        f"datasets: {', '.join(meta['datasets'])}; batch {meta['batch_size']}; "
        f"{meta['repeats']} timed repeats after warm-up; medians; ratios are of rates "
        "(records/s) measured in this run."
    )
    out.append("")
    for res in sections:
        out.append(
            f"## {res.name}  (wall {res.wall_s:.0f}s, peak RssAnon {res.peak_rss_anon_mb:,.0f} MB)"
        )
        out.append("")
        out.extend(case_table(res))
        out.append("")
        if res.ratios:
            out.extend(ratio_table(res.ratios))
            out.append("")
        for note in res.notes:
            out.append(f"- {note}")
        if res.notes:
            out.append("")
    targets = [r for res in sections for r in res.ratios if r.target is not None]
    if targets:
        passed = sum(bool(r.passed) for r in targets)
        out.append(f"## targets: {passed}/{len(targets)} pass")
        out.append("")
        for r in targets:
            mark = "PASS" if r.passed else "FAIL"
            out.append(f"- {mark} {r.name}: {_fmt(r.value)}x (target ≥{_fmt(r.target or 0)})")
        out.append("")
    return "\n".join(out)


def write_json(path: str, sections: list[SectionResult], meta: dict[str, Any]) -> None:
    targets = [r for res in sections for r in res.ratios if r.target is not None]
    doc = {
        "meta": meta,
        "sections": {res.name: res.to_json() for res in sections},
        "targets": {
            "passed": sum(bool(r.passed) for r in targets),
            "failed": sum(not r.passed for r in targets),
            "list": [r.to_json() for r in targets],
        },
    }
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def write_plot(path: str, sections: list[SectionResult]) -> None:
    """Horizontal bars of every ratio (log scale): green pass, red fail, grey no target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_ratios = [s for s in sections if s.ratios]
    if not with_ratios:
        fig, ax = plt.subplots(figsize=(6, 2))
        ax.text(0.5, 0.5, "no ratios (filtered out)", ha="center", va="center")
        ax.axis("off")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return
    heights = [max(1.5, 0.22 * len(s.ratios) + 0.8) for s in with_ratios]
    fig, axes = plt.subplots(
        len(with_ratios),
        1,
        figsize=(12, sum(heights)),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    for ax, res in zip(axes[:, 0], with_ratios):
        names = [r.name for r in res.ratios][::-1]
        values = [max(r.value, 1e-6) for r in res.ratios][::-1]
        colors = [{None: "0.6", True: "tab:green", False: "tab:red"}[r.passed] for r in res.ratios][
            ::-1
        ]
        ys = range(len(names))
        ax.barh(ys, values, color=colors)
        for y, r in zip(ys, res.ratios[::-1]):
            if r.target is not None:
                ax.plot([r.target, r.target], [y - 0.4, y + 0.4], color="k", lw=1.5)
            ax.text(max(r.value, 1e-6), y, f" {_fmt(r.value)}x", va="center", fontsize=6)
        ax.set_xscale("log")
        ax.axvline(1.0, color="k", lw=0.5, ls="--")
        ax.set_yticks(list(ys))
        ax.set_yticklabels(names, fontsize=6)
        ax.set_title(f"{res.name}: ratios (black tick = target)", fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
