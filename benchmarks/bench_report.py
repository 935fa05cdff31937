"""Markdown tables, results.json, the headline figure (plot.png) and every ratio (plot_detail.png).

A quick run (``--quick``, or sizes below the full run's) reports its ratios and
the targets they are held to at full size, without judging them: tiny stores
on a shared machine say nothing about a regression.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

from bench_common import Case, Ratio, SectionResult

__all__ = ["headline", "judged", "markdown", "write_json", "write_plot", "write_plots"]

# The headline: per workload, grain_replay against the peer a user would pick
# instead, and against the limit (the fastest a copy of the same bytes goes).
# Regular expressions over ratio names; the first match wins, a workload with
# neither ratio (filtered out with --only or --sections) is left out.
HEADLINE: tuple[tuple[str, str | None, str | None], ...] = (
    ("transitions, random batches (.npy)",
     r"formats/transitions: npy read_batch / best grain\+ArrayRecord",
     r"formats/transitions: npy read_batch / numpy gather"),
    ("images, random batches (.npy)",
     r"formats/images: npy read_batch / best grain\+ArrayRecord",
     r"formats/images: npy read_batch / numpy gather"),
    ("transitions, HDF5 gzip chunks",
     r"formats/transitions: hdf5-gzip read_batch / h5py sorted read \(default",
     r"formats/transitions: hdf5-gzip read_batch / numpy gather"),
    ("images, HDF5 gzip chunks",
     r"formats/images: hdf5-gzip read_batch / h5py sorted read \(default",
     r"formats/images: hdf5-gzip read_batch / numpy gather"),
    ("transitions, Zarr zstd chunks",
     r"formats/transitions: zarr-zstd read_batch / zarr oindex \(default",
     r"formats/transitions: zarr-zstd read_batch / numpy gather"),
    ("images, Zarr zstd chunks",
     r"formats/images: zarr-zstd read_batch / zarr oindex \(default",
     r"formats/images: zarr-zstd read_batch / numpy gather"),
    ("loader, 2 workers (.npy)",
     r"pipeline/transitions: npy workers=2: grain_replay / grain's worker iterator",
     r"pipeline/transitions: npy make_data_loader / read_batch"),
    ("loader + device put (.npy)",
     r"pipeline/transitions: npy full / grain\+h5py per-record",
     r"pipeline/transitions: npy full / min\(loader, device_put-only\)"),
    ("cold reads, images (.npy)", None, r"cold/images: npy read_batch / best raw gather"),
    ("4-frame stacks (.npy)", None, r"4-frame stacks: npy / pre-stacked gather"),
    ("action chunks (.npy)", None, r"2 obs \+ 16 actions: npy / gather"),
    ("write (.npy)", None, r"write/transitions: gr.write npy / np.save\+fsync"),
    ("training step fed by the loader", None,
     r"device/transitions: step-fed-by-loader / step on device batches"),
)  # fmt: skip


def judged(meta: dict[str, Any]) -> bool:
    """Whether the run's ratios are held to their targets (a full-size run's are)."""
    return meta.get("mode") == "full"


def _all_ratios(sections: list[SectionResult]) -> list[Ratio]:
    return [r for res in sections for r in res.ratios]


def headline(sections: list[SectionResult]) -> list[tuple[str, Ratio | None, Ratio | None]]:
    """``(workload, ratio against the peer, ratio against the limit)`` per workload that ran."""
    ratios = _all_ratios(sections)

    def find(pattern: str | None) -> Ratio | None:
        if pattern is None:
            return None
        return next((r for r in ratios if re.match(pattern, r.name)), None)

    rows = [(name, find(peer), find(limit)) for name, peer, limit in HEADLINE]
    return [row for row in rows if row[1] is not None or row[2] is not None]


def _peer_label(r: Ratio) -> str:
    """The denominator of a ratio's name, without its last note: ``a / b (c)`` -> ``b``."""
    return re.sub(r"\s+\([^()]*\)$", "", r.name.split(" / ", 1)[-1])


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


def ratio_table(ratios: list[Ratio], judge: bool = True) -> list[str]:
    if not judge:  # the targets are those of a full-size run: shown, not applied
        lines = ["| ratio | value | full-size target |", "|---|---|---|"]
        for r in ratios:
            target = "-" if r.target is None else f"≥{_fmt(r.target)}"
            lines.append(f"| {r.name} | {_fmt(r.value)}x | {target} |")
        return lines
    lines = ["| ratio | value | target | pass |", "|---|---|---|---|"]
    for r in ratios:
        target = "-" if r.target is None else f"≥{_fmt(r.target)}"
        ok = {None: "", True: "PASS", False: "**FAIL**"}[r.passed]
        lines.append(f"| {r.name} | {_fmt(r.value)}x | {target} | {ok} |")
    return lines


def headline_table(sections: list[SectionResult]) -> list[str]:
    lines = [
        "| workload | x the peer a user would pick instead | x the limit |",
        "|---|---|---|",
    ]
    for name, peer, limit in headline(sections):
        cells = [
            "-" if r is None else f"{_fmt(r.value)}x ({_peer_label(r)})" for r in (peer, limit)
        ]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    return lines


def markdown(sections: list[SectionResult], meta: dict[str, Any]) -> str:
    out = [f"# grain_replay benchmarks ({meta['mode']})", ""]
    out.append(
        f"datasets: {', '.join(meta['datasets'])}; batch {meta['batch_size']}; "
        f"{meta['repeats']} timed repeats after warm-up; medians; ratios are of rates "
        "(records/s) measured in this run."
    )
    out.append("")
    judge = judged(meta)
    if not judge:
        out.append(
            "Quick run: the ratios are reported, not judged. Its stores are tiny and "
            "timings on a shared machine are noise; the targets (shown) hold for the "
            "full-size run (`make bench`)."
        )
        out.append("")
    if headline(sections):
        out.append("## at a glance")
        out.append("")
        out.extend(headline_table(sections))
        out.append("")
    for res in sections:
        out.append(
            f"## {res.name}  (wall {res.wall_s:.0f}s, peak RssAnon {res.peak_rss_anon_mb:,.0f} MB)"
        )
        out.append("")
        out.extend(case_table(res))
        out.append("")
        if res.ratios:
            out.extend(ratio_table(res.ratios, judge))
            out.append("")
        for note in res.notes:
            out.append(f"- {note}")
        if res.notes:
            out.append("")
    targets = [r for res in sections for r in res.ratios if r.target is not None]
    if targets and not judge:
        out.append(f"## targets: {len(targets)} full-size targets, not judged in a quick run")
        out.append("")
    elif targets:
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
    judge = judged(meta)
    listed = [r.to_json() for r in targets]
    if not judge:
        for d in listed:
            d["passed"] = None
    doc = {
        "meta": meta,
        "sections": {res.name: res.to_json() for res in sections},
        "headline": [
            {
                "workload": name,
                "vs_peer": None if peer is None else peer.to_json(),
                "vs_limit": None if limit is None else limit.to_json(),
            }
            for name, peer, limit in headline(sections)
        ],
        "targets": {
            "judged": judge,
            "count": len(targets),
            "passed": sum(bool(r.passed) for r in targets) if judge else 0,
            "failed": sum(not r.passed for r in targets) if judge else 0,
            "list": listed,
        },
    }
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def write_plots(path: str, sections: list[SectionResult], meta: dict[str, Any]) -> tuple[str, str]:
    """The headline figure at ``path`` and every ratio beside it (``*_detail.png``)."""
    root, ext = os.path.splitext(path)
    detail = f"{root}_detail{ext or '.png'}"
    write_headline(path, sections, judged(meta))
    write_plot(detail, sections, judged(meta))
    return path, detail


def write_headline(path: str, sections: list[SectionResult], judge: bool = True) -> None:
    """One row per workload: x the peer (blue) and x the limit (orange), log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = headline(sections)
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.62 * max(1, len(rows))))
    if not rows:
        ax.text(0.5, 0.5, "no headline ratios (filtered out)", ha="center", va="center")
        ax.axis("off")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return
    colors = {"peer": "tab:blue", "limit": "tab:orange"}
    values = [r.value for _, p, lim in rows for r in (p, lim) if r is not None]
    lo, hi = min(min(values), 0.5) / 3, max(max(values), 2.0) * 40
    for y, (_, peer, limit) in enumerate(rows):
        for kind, r, dy in (("peer", peer, -0.19), ("limit", limit, 0.19)):
            if r is None:
                continue
            v = max(r.value, lo)
            ax.barh(y + dy, v, height=0.36, left=lo, color=colors[kind])
            mark = ""
            if judge and r.passed is not None:
                mark = "  PASS" if r.passed else "  FAIL"
            ax.text(max(v, r.target or 0) * 1.1, y + dy, f"{_fmt(r.value)}x {_peer_label(r)}{mark}",
                    va="center", fontsize=7.5)  # fmt: skip
            if r.target is not None:
                ax.plot([r.target] * 2, [y + dy - 0.18, y + dy + 0.18], color="k", lw=1.6)
    ax.set_xscale("log")
    ax.set_xlim(lo, hi)
    ax.axvline(1.0, color="k", lw=0.8, ls="--")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([name for name, _, _ in rows], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("ratio of rates, same run (log; right of the dashed line: faster)", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    legend = [
        plt.Rectangle((0, 0), 1, 1, color=colors["peer"], label="x the peer a user would pick"),
        plt.Rectangle((0, 0), 1, 1, color=colors["limit"], label="x the limit (a bare copy)"),
        plt.Line2D([0], [0], color="k", lw=1.6, label="target"),
    ]
    ax.legend(handles=legend, loc="lower right", fontsize=8, framealpha=0.9)
    mode = "full run" if judge else "quick run: reported, not judged; targets hold at full size"
    ax.set_title(f"grain_replay at a glance ({mode})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plot(path: str, sections: list[SectionResult], judge: bool = True) -> None:
    """Horizontal bars of every ratio (log scale): green pass, red fail, grey no target or a
    quick run (not judged)."""
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
        colors = [
            {None: "0.6", True: "tab:green", False: "tab:red"}[r.passed if judge else None]
            for r in res.ratios
        ][::-1]
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
