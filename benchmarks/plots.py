"""PNG plots of a sweep: peak memory and step time against sequence length, one line per layout."""

from __future__ import annotations

from pathlib import Path

MiB = 2**20


def _series(rows: list[dict], devices: int, value) -> dict[str, tuple[list[int], list[float]]]:
    out: dict[str, tuple[list[int], list[float]]] = {}
    for r in sorted(rows, key=lambda r: r["seq_len"]):
        if r["status"] == "ok" and r["devices"] in (devices, 1):
            xs, ys = out.setdefault(r["layout"], ([], []))
            xs.append(r["seq_len"])
            ys.append(value(r))
    return out


def _training_peak(row: dict) -> float:
    m = row["memory_bytes"]
    return (m["params"] + m["optimizer"] + m["peak_delta"]) / MiB


def write_plots(rows: list[dict], out_dir: str | Path) -> list[Path]:
    """Per device count D: ``peak_memory_D{D}.png`` (per rank at the step's peak: parameters and
    optimizer state held before the step plus the peak above it, MiB) and ``step_time_D{D}.png``
    (median step seconds), against sequence length; ``single`` on each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    metrics = {
        "peak_memory": ("training memory per rank at peak (MiB)", _training_peak),
        "step_time": ("median step time (s)", lambda r: r["step_seconds"]),
    }
    for D in sorted({r["devices"] for r in rows if r["devices"] > 1}):
        for name, (label, value) in metrics.items():
            fig, ax = plt.subplots(figsize=(6, 4))
            for layout, (xs, ys) in _series(rows, D, value).items():
                ax.plot(xs, ys, marker="o", label=layout)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length")
            ax.set_ylabel(label)
            ax.set_title(f"D = {D}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
            path = out_dir / f"{name}_D{D}.png"
            fig.tight_layout()
            fig.savefig(path, dpi=120)
            plt.close(fig)
            written.append(path)
    return written
