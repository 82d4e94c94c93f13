"""The plots of ``eval_long.py`` runs: perplexity by position (one curve per run) and the
passkey grid (a heat map per run)."""

from __future__ import annotations


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ppl(runs: list[dict], path: str) -> None:
    """Perplexity against position (each bucket's midpoint), one line per run, log scale; a
    dotted vertical line at each run's max_position_embeddings that falls inside the buckets."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        buckets = run["ppl"]["buckets"]
        mid = [(b["start"] + b["end"]) / 2 for b in buckets]
        (line,) = ax.plot(mid, [b["ppl"] for b in buckets], "o-", label=run["label"])
        if run["max_position_embeddings"] < buckets[-1]["end"]:  # inside the plotted range
            ax.axvline(run["max_position_embeddings"], color=line.get_color(), ls=":", alpha=0.6)
    ax.set_yscale("log")
    ax.set_xlabel("position (bucket midpoint)")
    ax.set_ylabel("perplexity")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title("perplexity by position (dotted: a model's max_position_embeddings)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_passkey(runs: dict | list[dict], path: str) -> None:
    """Passkey accuracy by length (rows) and depth (columns), one heat map per run."""
    runs = [runs] if isinstance(runs, dict) else runs
    plt = _pyplot()
    fig, axes = plt.subplots(
        1, len(runs), figsize=(3.2 * len(runs) + 0.8, 3.2), squeeze=False, sharey=True
    )
    for ax, run in zip(axes[0], runs):
        grid = run["passkey"]
        image = ax.imshow(grid["accuracy"], vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(grid["depths"])), [f"{d:g}" for d in grid["depths"]])
        ax.set_yticks(range(len(grid["lengths"])), [str(n) for n in grid["lengths"]])
        ax.tick_params(labelleft=ax is axes[0][0])
        ax.set_xlabel("depth (%)")
        ax.set_title(run["label"], fontsize=9)
        for i, row in enumerate(grid["accuracy"]):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.2g}", ha="center", va="center", fontsize=7)
    axes[0][0].set_ylabel("length (tokens)")
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
