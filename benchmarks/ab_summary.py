"""``python -m benchmarks.ab_summary OUTDIR``: compare the runs of
``benchmarks/ab_commits.sh``: per store, system and operation, the median MB/s of the old
and the new library over every timed run of every round, each with its min-max, and
whether new is slower than old beyond the spread (new's max below old's min).

Writes ``OUTDIR/summary.md`` and prints it.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

__all__ = ["main", "summarize"]


def _mbps(case: dict) -> list[float]:
    """MB/s of each timed run of a case (its state bytes over its seconds)."""
    return [case["state_bytes"] / s / 1e6 for s in case["summary"]["seconds_all"]]


def summarize(out: Path) -> str:
    """The comparison as Markdown."""
    speeds: dict[tuple[str, str, str], dict[str, list[float]]] = defaultdict(
        lambda: {"old": [], "new": []})
    for results in sorted(out.glob("*-*/*/results.json")):
        side = results.parent.parent.name.split("-")[0]
        for case in json.loads(results.read_text())["cases"]:
            if case["system"].startswith("dcpstore") and case["summary"].get("ok"):
                key = (case["store"], case["system"], case["op"])
                speeds[key][side] += _mbps(case)
    commits = (out / "commits.txt").read_text().strip() if (out / "commits.txt").exists() \
        else "?"
    lines = [f"# A/B: {commits}", "",
             "MB/s, median (min-max) over every timed run of every round.", "",
             "| store | system | op | old | new | new/old | slower beyond the spread |",
             "|---|---|---|--:|--:|--:|:-:|"]
    for (store, system, op), s in sorted(speeds.items()):
        if not (s["old"] and s["new"]):
            continue
        old, new = statistics.median(s["old"]), statistics.median(s["new"])
        slower = max(s["new"]) < min(s["old"])
        lines.append(f"| {store} | {system} | {op} | {old:.0f} ({min(s['old']):.0f}-"
                     f"{max(s['old']):.0f}) | {new:.0f} ({min(s['new']):.0f}-"
                     f"{max(s['new']):.0f}) | {new / old:.2f}x | "
                     f"{'**yes**' if slower else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write and print the summary of ``argv[0]`` (an ``ab_commits.sh`` output)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__)
        return 2
    out = Path(args[0])
    text = summarize(out)
    (out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
