"""Several ``eval_long.py`` runs side by side: one JSON, two plots and the markdown tables.

    python recipes/long_context_report.py outputs/eval-long/original outputs/eval-long/yarn \\
        --fine-tune outputs/long --json long_context.json --ppl-png ppl.png \\
        --passkey-png passkey.png

Tables (printed): perplexity by position bucket, a column per run; passkey accuracy by length
(the mean over depths), a row per run. The runs keep the order given. ``--fine-tune`` adds a
``finetune_long_llama.py`` run's record (its before / after evaluation, memory and step rows).
"""

from __future__ import annotations

import argparse
import json
import os

from _long_plots import plot_passkey, plot_ppl


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="eval_long.py output directories (or their JSON)")
    p.add_argument("--fine-tune", default=None, help="a finetune_long_llama.py --output-dir")
    p.add_argument("--json", required=True, help="where to write the runs (and the fine-tune)")
    p.add_argument("--ppl-png", default=None, help="perplexity by position, a line per run")
    p.add_argument("--passkey-png", default=None, help="the passkey grids, a heat map per run")
    return p.parse_args(argv)


def load(path: str) -> dict:
    """One run's JSON (a directory's ``eval_long.json``)."""
    if os.path.isdir(path):
        path = os.path.join(path, "eval_long.json")
    with open(path) as f:
        return json.load(f)


def fine_tune_record(out_dir: str) -> dict:
    """A fine-tuning run's ``fine_tuning.json``, ``memory.json`` and ``metrics.jsonl`` rows."""
    record = {}
    for name in ("fine_tuning", "memory"):
        with open(os.path.join(out_dir, f"{name}.json")) as f:
            record[name] = json.load(f)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        record["steps"] = [json.loads(line) for line in f]
    return record


def ppl_table(runs: list[dict]) -> list[str]:
    """Markdown: a row per position bucket, a perplexity column per run (the runs' buckets must
    be the same)."""
    buckets = [[(b["start"], b["end"]) for b in r["ppl"]["buckets"]] for r in runs]
    if any(b != buckets[0] for b in buckets):
        raise SystemExit("the runs' perplexity buckets differ: evaluate them at the same lengths")
    lines = ["| positions | " + " | ".join(r["label"] for r in runs) + " |"]
    lines.append("|---" * (len(runs) + 1) + "|")
    for i, (start, end) in enumerate(buckets[0]):
        cells = [f"{r['ppl']['buckets'][i]['ppl']:.2f}" for r in runs]
        lines.append(f"| {start}–{end} | " + " | ".join(cells) + " |")
    return lines


def passkey_table(runs: list[dict]) -> list[str]:
    """Markdown: a row per run, its passkey accuracy at each length (the mean over depths)."""
    lengths = runs[0]["passkey"]["lengths"]
    lines = ["| model | " + " | ".join(str(n) for n in lengths) + " |"]
    lines.append("|---" * (len(lengths) + 1) + "|")
    for run in runs:
        grid = run["passkey"]
        if grid["lengths"] != lengths:
            raise SystemExit("the runs' passkey lengths differ: evaluate them at the same lengths")
        cells = [f"{sum(row) / len(row):.2f}" for row in grid["accuracy"]]
        lines.append(f"| {run['label']} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    runs = [load(path) for path in args.runs]
    report = {"runs": runs}
    if args.fine_tune:
        report["fine_tune"] = fine_tune_record(args.fine_tune)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    with_ppl = [r for r in runs if "ppl" in r]
    with_passkey = [r for r in runs if "passkey" in r]
    if with_ppl:
        print("\n".join(ppl_table(with_ppl)) + "\n")
        if args.ppl_png:
            plot_ppl(with_ppl, args.ppl_png)
    if with_passkey:
        print("\n".join(passkey_table(with_passkey)))
        if args.passkey_png:
            plot_passkey(with_passkey, args.passkey_png)


if __name__ == "__main__":
    main()
