"""
Plot one or more training runs side by side from their metrics.jsonl: the loss (train, and the evaluated
val loss), the learning rate, the gradient norm and the throughput, against the step.

    python plot.py out/run_a out/run_b --out=compare.png

Each run gets one colour in every panel, labelled with its folder name. matplotlib is needed only here:
pip install matplotlib
"""
import argparse
import importlib.util
import json
import os
import sys

PANELS = [  # (title, [(metrics key, line style, label suffix)], log scale)
    ("loss", [("loss", "-", "train"), ("val_loss", "--", "val")], False),
    ("learning rate", [("lr", "-", "")], False),
    ("gradient norm", [("grad_norm", "-", "")], True),
    ("tokens/s", [("tokens_per_sec", "-", "")], False),
]


def read_metrics(run_dir):
    path = run_dir if run_dir.endswith(".jsonl") else os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no metrics.jsonl in '{run_dir}': give the out_dir of a training run")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def series(records, key):
    points = [(r["step"], r[key]) for r in records if key in r]
    return [s for s, _ in points], [v for _, v in points]


def plot_runs(run_dirs, out):
    import matplotlib
    matplotlib.use("Agg")  # write a file; no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for i, run_dir in enumerate(run_dirs):
        records = read_metrics(run_dir)
        name = os.path.basename(os.path.normpath(run_dir))
        color = f"C{i % 10}"
        for ax, (title, lines, log) in zip(axes.flat, PANELS):
            for key, style, suffix in lines:
                steps, values = series(records, key)
                if steps:
                    ax.plot(steps, values, style, color=color, label=f"{name} {suffix}".strip(),
                            marker="o" if len(steps) < 3 else None)
            ax.set_title(title)
            ax.set_xlabel("step")
            if log:
                ax.set_yscale("log")
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="out_dir of each run (holding metrics.jsonl)")
    parser.add_argument("--out", default="loss.png", help="the PNG to write")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        sys.exit("error: plot.py needs matplotlib, which is not installed: pip install matplotlib")
    try:
        plot_runs(args.runs, args.out)
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
