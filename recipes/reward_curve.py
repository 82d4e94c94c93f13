"""The reward curve of a ``grpo.py`` run: one JSON (the run's arguments, every step's row, the
held-out reward before and after) and a PNG (reward per step with its running mean, the held-out
reward before and after; KL and completion length below).

    python recipes/reward_curve.py outputs/grpo --json curve.json --png curve.png
"""

from __future__ import annotations

import argparse
import json
import os


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="a grpo.py --output-dir")
    p.add_argument("--json", required=True, help="where to write the collected JSON")
    p.add_argument("--png", required=True, help="where to write the plot")
    p.add_argument("--window", type=int, default=10, help="steps in the running mean")
    return p.parse_args(argv)


def collect(run: str) -> dict:
    """The run's ``run_args.json``, ``metrics.jsonl`` rows and ``final_eval.json``."""
    with open(os.path.join(run, "run_args.json")) as f:
        settings = json.load(f)
    with open(os.path.join(run, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    with open(os.path.join(run, "final_eval.json")) as f:
        final = json.load(f)
    return {"settings": settings, "final_eval": final, "steps": steps}


def running_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the ``window - 1`` before it (fewer at the start)."""
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / min(i + 1, window) for i in range(len(values))
    ]


def plot(curve: dict, path: str, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in curve["steps"]]
    reward = [r["reward"] for r in curve["steps"]]
    final, settings = curve["final_eval"], curve["settings"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    top.plot(steps, reward, ".", alpha=0.4, label="reward (mean of the step's completions)")
    top.plot(steps, running_mean(reward, window), label=f"running mean, {window} steps")
    held_out = ([0, steps[-1]], [final["eval_reward_before"], final["eval_reward"]])
    top.plot(*held_out, "s", color="black", label="held-out prompts, before / after")
    top.set_ylabel("reward")
    top.set_ylim(-0.05, 1.05 + settings.get("format_reward", 0.0))
    top.grid(alpha=0.3)
    top.legend(fontsize=8, loc="lower right")
    top.set_title(
        f"GRPO, {os.path.basename(settings['model'])}, task {settings['task']}, "
        f"TSP D = {settings['tsp_size']}, LoRA r = {settings['lora_r']}",
        fontsize=9,
    )
    length = [r["completions/mean_length"] for r in curve["steps"]]
    bottom.plot(steps, length, color="tab:green", label="mean completion length (tokens)")
    bottom.set_ylabel("tokens")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    if all(r.get("kl") is not None for r in curve["steps"]):
        kl = bottom.twinx()
        kl.plot(steps, [r["kl"] for r in curve["steps"]], color="tab:red", label="KL")
        kl.set_ylabel("KL to the reference")
        kl.legend(fontsize=8, loc="upper right")
    bottom.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    curve = collect(args.run)
    with open(args.json, "w") as f:
        json.dump(curve, f, indent=1)
    plot(curve, args.png, args.window)
    print(f"{len(curve['steps'])} steps: {args.json}, {args.png}")


if __name__ == "__main__":
    main()
