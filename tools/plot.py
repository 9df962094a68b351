"""
Plot one or more training runs side by side from their metrics.jsonl: the loss (train, and the
evaluated val loss), the learning rate, the gradient norm and the throughput, against the step.

    python tools/plot.py out/run_a out/run_b --out=compare.png

Each run gets one colour in every panel, labelled with its folder name. With --trace, draw instead
the pipeline timeline a run measured with pp_trace=True (<out_dir>/pp_trace.json): a row per
pipeline rank and chunk, each action a bar from its start to its end, with each rank's measured
bubble:

    python tools/plot.py --trace out/run_a            # writes out/run_a/pp_trace.png

matplotlib is needed only here: pip install matplotlib
"""

import argparse
import importlib.util
import json
import os
import sys

if __name__ == "__main__" and not __package__:  # python tools/X.py: import from the repository
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from metrics import LogError, read_log

PANELS = [  # (title, [(metrics key, line style, label suffix)], log scale)
    ("loss", [("loss", "-", "train"), ("val_loss", "--", "val")], False),
    ("learning rate", [("lr", "-", "")], False),
    ("gradient norm", [("grad_norm", "-", "")], True),
    ("tokens/s", [("tokens_per_sec", "-", "")], False),
]


def read_metrics(run_dir):
    path = run_dir if run_dir.endswith(".jsonl") else os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"no metrics.jsonl in '{run_dir}': give the out_dir of a training run"
        )
    return [record for _, record in read_log(path)]  # as the resume reads it


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
                    ax.plot(
                        steps,
                        values,
                        style,
                        color=color,
                        label=f"{name} {suffix}".strip(),
                        marker="o" if len(steps) < 3 else None,
                    )
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


# forward, (input) backward, weight gradient
OP_COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}


def read_trace(run_dir):
    path = run_dir if run_dir.endswith(".json") else os.path.join(run_dir, "pp_trace.json")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"no pp_trace.json in '{run_dir}': give the out_dir of a run trained with "
            f"--pp_trace=True and pp > 1"
        )
    with open(path) as f:
        return json.load(f)


def lane_labels(lanes, bubble):
    """Each lane's label: its rank with its measured idle share on the rank's first chunk, then
    the chunk."""
    first_chunk = {p: min(c for q, c in lanes if q == p) for p, _ in lanes}
    return [
        f"rank {p} (idle {bubble[p]:.0%}), chunk {c}" if c == first_chunk[p] else f"chunk {c}"
        for p, c in lanes
    ]


def trace_title(info):
    bubble, ideal = info["measured_bubble"], info.get("ideal_bubble")
    return (
        f"{info['schedule']}: pp={info['pp']}, m={info['microbatches']}, {info['chunks']} chunk(s) "
        f"per rank, step {info['step']} on {info['device']}; measured bubble (mean) "
        f"{sum(bubble) / len(bubble):.1%}, ideal "
        + (f"{ideal:.1%}" if ideal is not None else "n/a")
    )


def label_boxes(fig, ax, boxes):
    """Write each box's label (F3, B3, W3) where it fits inside the box; called once the layout has
    fixed how many pixels a millisecond is."""
    renderer = fig.canvas.get_renderer()
    for y, left, width, name in boxes:
        text = ax.text(
            left + width / 2, y, name, ha="center", va="center", fontsize=6, clip_on=True
        )
        x0, x1 = ax.transData.transform([(left, y), (left + width, y)])[:, 0]
        if text.get_window_extent(renderer).width > x1 - x0 - 2:  # 1 pixel clear of each edge
            text.remove()


def draw_trace(trace):
    """The measured pipeline timeline as a figure: one lane per (pipeline rank, chunk), rank 0 at
    the top, time in ms. Each box is labelled (F3, B3, W3) only where the label fits inside it: a
    step has many short actions (a W is often a fraction of an F), whose labels would otherwise run
    into their neighbours'."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    info, spans = trace["otherData"], [e for e in trace["traceEvents"] if e["ph"] == "X"]
    lanes = sorted({(e["pid"], e["tid"]) for e in spans})
    row = {lane: i for i, lane in enumerate(lanes)}
    start = min(e["ts"] for e in spans)
    end = max(e["ts"] + e["dur"] for e in spans)
    fig, ax = plt.subplots(figsize=(14, 0.6 * len(lanes) + 1.8))
    boxes = []  # (lane, left, width, label) in ms
    for e in spans:
        y, left, width = row[(e["pid"], e["tid"])], (e["ts"] - start) / 1e3, e["dur"] / 1e3
        color = OP_COLORS.get(e["cat"], "grey")
        ax.barh(y, width, left=left, height=0.8, color=color, edgecolor="black", linewidth=0.3)
        boxes.append((y, left, width, e["name"]))
    ax.set_xlim(0, (end - start) / 1e3 * 1.01)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(lane_labels(lanes, info["measured_bubble"]))
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's barrier")
    ax.set_title(trace_title(info))
    split = any(e["cat"] == "W" for e in spans)
    labels = {
        "F": "F forward",
        "B": "B input's gradient" if split else "B backward",
        "W": "W weights' gradient",
    }
    # beside the lanes, not over them: inside, it hides the last actions of rank 0
    ax.legend(
        handles=[Patch(color=OP_COLORS[op], label=labels[op]) for op in ("FBW" if split else "FB")],
        loc="upper left",
        bbox_to_anchor=(1.005, 1),
        fontsize="small",
    )
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    label_boxes(fig, ax, boxes)
    return fig


def plot_trace(run_dir, out):
    """Draw the trace a run measured with pp_trace=True into the PNG `out`."""
    import matplotlib.pyplot as plt

    fig = draw_trace(read_trace(run_dir))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("runs", nargs="*", help="out_dir of each run (holding metrics.jsonl)")
    parser.add_argument(
        "--trace",
        default=None,
        help="draw this run's pipeline trace (its out_dir or pp_trace.json)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="the PNG to write (default loss.png, or pp_trace.png beside the trace)",
    )
    args = parser.parse_args(argv)
    if not args.runs and args.trace is None:
        parser.error("give the out_dir of one or more runs, or --trace OUT_DIR")
    if importlib.util.find_spec("matplotlib") is None:
        sys.exit(
            "error: tools/plot.py needs matplotlib, which is not installed: pip install matplotlib"
        )
    try:
        if args.trace is not None:
            out = args.out or os.path.join(
                os.path.dirname(args.trace) if args.trace.endswith(".json") else args.trace,
                "pp_trace.png",
            )
            plot_trace(args.trace, out)
        else:
            out = args.out or "loss.png"
            plot_runs(args.runs, out)
    except (FileNotFoundError, LogError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
