"""
Plot one or more training runs side by side from their metrics.jsonl: the loss (train, and the
evaluated val loss), the learning rate, the gradient norm and the throughput, against the step.

    python tools/plot.py out/run_a out/run_b --out=compare.png

Each run gets one colour in every panel, labelled with its folder name. With --trace, draw instead
the pipeline timeline a run measured with pp_trace=True (<out_dir>/pp_trace.json): a row per
pipeline rank and chunk, each action a bar from its start to its end, with each rank's measured
bubble:

    python tools/plot.py --trace out/run_a            # writes out/run_a/pp_trace.png

The same draws a step tools/bench.py --trace measured, or tools/step_time.py --trace predicted
(every rank's actions, each mechanism's exposed communication, the optimizer, the bubble), and with
--predicted the predicted step above the measured one, on one time axis in ms:

    python tools/plot.py --trace=measured.json --predicted=predicted.json --out=step.png

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


# forward, (input) backward, weight gradient; each mechanism's exposed communication, the
# optimizer and the idle time of a trace's spans (tools/timeline.py's chrome_trace)
OP_COLORS = {
    "F": "#4c72b0",
    "B": "#dd8452",
    "W": "#55a868",
    "tp": "#c44e52",
    "cp": "#8172b3",
    "ep": "#937860",
    "pp": "#da8bc3",
    "dp": "#8c8c8c",
    "zero_gather": "#ccb974",
    "grad_norm": "#64b5cd",
    "optimizer": "#222222",
    "bubble": "#f2f2f2",
}
CATEGORY_LABELS = {
    "F": "F forward",
    "W": "W weights' gradient",
    "tp": "tp (exposed)",
    "cp": "cp ring (exposed)",
    "ep": "ep all-to-all (exposed)",
    "pp": "pp transfer, tied sum",
    "dp": "dp/ZeRO reduction",
    "zero_gather": "ZeRO gather",
    "grad_norm": "grad norm, clip",
    "optimizer": "optimizer step",
    "bubble": "bubble (idle)",
}


def read_trace(run_dir):
    path = run_dir if run_dir.endswith(".json") else os.path.join(run_dir, "pp_trace.json")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"no pp_trace.json in '{run_dir}': give the out_dir of a run trained with "
            f"--pp_trace=True and pp > 1, or a .json that tools/bench.py --trace or "
            f"tools/step_time.py --trace wrote"
        )
    with open(path) as f:
        return json.load(f)


def idle_shares(spans):
    """{rank: its idle share of the step}: 1 - the time its spans work (all but the bubble's) over
    the step, from the first start to the last end over all ranks (timeline.measured_bubble's)."""
    begin = min(e["ts"] for e in spans)
    length = max(e["ts"] + e["dur"] for e in spans) - begin
    busy = {}
    for e in spans:
        busy[e["pid"]] = busy.get(e["pid"], 0.0) + e["dur"] * (e["cat"] != "bubble")
    return {r: 1 - b / length for r, b in busy.items()}


def lane_labels(lanes, bubble):
    """Each lane's label: its rank with its idle share on the rank's first lane, then the chunk."""
    first_chunk = {p: min(c for q, c in lanes if q == p) for p, _ in lanes}
    return [
        f"rank {p} (idle {bubble[p]:.0%}), chunk {c}" if c == first_chunk[p] else f"chunk {c}"
        for p, c in lanes
    ]


def trace_title(info, idle):
    """A panel's title: measured or predicted, the schedule, the step and the idle share."""
    mean = sum(idle.values()) / len(idle)
    schedule = (
        f"{info['schedule']}: pp={info['pp']}, m={info['microbatches']}, {info['chunks']} "
        f"chunk(s) per rank"
        if info["pp"] > 1
        else f"no pipeline, m={info['microbatches']}"
    )
    if info.get("predicted"):
        return (
            f"predicted: {schedule}, {info['layout']}, {info['step_s'] * 1e3:,.1f} ms on "
            f"{info['device']}; bubble (mean) {mean:.1%}"
        )
    ideal = info.get("ideal_bubble")
    return (
        f"measured: {schedule}, step {info['step']} on {info['device']}; idle (mean) {mean:.1%}"
        + (f", ideal {ideal:.1%}" if ideal is not None else "")
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


def draw_lanes(ax, trace):
    """One trace's spans on `ax`: a lane per (pipeline rank, chunk), rank 0 at the top, each span a
    bar in ms from the trace's first start. Returns (the boxes to label, the categories drawn,
    the last end in ms)."""
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    lanes = sorted({(e["pid"], e["tid"]) for e in spans})
    row = {lane: i for i, lane in enumerate(lanes)}
    start = min(e["ts"] for e in spans)
    boxes = []  # (lane, left, width, label) in ms
    for e in spans:
        y, left, width = row[(e["pid"], e["tid"])], (e["ts"] - start) / 1e3, e["dur"] / 1e3
        color = OP_COLORS.get(e["cat"], "grey")
        idle = e["cat"] == "bubble"
        ax.barh(
            y,
            width,
            left=left,
            height=0.8,
            color=color,
            edgecolor="black",
            linewidth=0.3 * (not idle),
        )
        if not idle:
            boxes.append((y, left, width, e["name"]))
    idle = idle_shares(spans)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(lane_labels(lanes, idle))
    ax.invert_yaxis()
    ax.set_title(trace_title(trace["otherData"], idle), fontsize="medium")
    ax.grid(axis="x", alpha=0.3)
    end = max(e["ts"] + e["dur"] for e in spans)
    return boxes, {e["cat"] for e in spans}, (end - start) / 1e3


def draw_trace(trace, predicted=None):
    """A step's timeline as a figure (draw_lanes), time in ms; with `predicted` (a trace that
    tools/step_time.py --trace wrote) that one above the measured one, on the same time axis. Each
    box is labelled (F3, B3, W3) only where the label fits inside it: a step has many short
    actions (a W is often a fraction of an F), whose labels would otherwise run into their
    neighbours'."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    traces = [predicted, trace] if predicted is not None else [trace]
    heights = [
        len({(e["pid"], e["tid"]) for e in t["traceEvents"] if e["ph"] == "X"}) for t in traces
    ]
    fig, axes = plt.subplots(
        len(traces),
        1,
        figsize=(14, 0.6 * sum(heights) + 1.8 * len(traces)),
        sharex=True,
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    drawn = [draw_lanes(ax, t) for ax, t in zip(axes[:, 0], traces)]
    axes[0, 0].set_xlim(0, max(end for _, _, end in drawn) * 1.01)
    axes[-1, 0].set_xlabel("ms since the step's start")
    categories = set().union(*(cats for _, cats, _ in drawn))
    split = "W" in categories
    labels = {**CATEGORY_LABELS, "B": "B input's gradient" if split else "B backward"}
    # beside the lanes, not over them: inside, it hides the last actions of rank 0
    axes[0, 0].legend(
        handles=[Patch(color=OP_COLORS[c], label=labels[c]) for c in OP_COLORS if c in categories],
        loc="upper left",
        bbox_to_anchor=(1.005, 1),
        fontsize="small",
    )
    fig.tight_layout()
    for ax, (boxes, _, _) in zip(axes[:, 0], drawn):
        label_boxes(fig, ax, boxes)
    return fig


def plot_trace(run_dir, out, predicted=None):
    """Draw a measured trace (a run's pp_trace=True, or tools/bench.py --trace), with `predicted`
    (tools/step_time.py --trace) above it, into the PNG `out`."""
    import matplotlib.pyplot as plt

    fig = draw_trace(read_trace(run_dir), predicted and read_trace(predicted))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("runs", nargs="*", help="out_dir of each run (holding metrics.jsonl)")
    parser.add_argument(
        "--trace",
        default=None,
        help="draw this step's trace: a run's out_dir or pp_trace.json, tools/bench.py's or "
        "tools/step_time.py's --trace file",
    )
    parser.add_argument(
        "--predicted",
        default=None,
        help="with --trace: also draw this trace (tools/step_time.py --trace) above it, on the "
        "same time axis",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="the PNG to write (default loss.png, or pp_trace.png beside the trace)",
    )
    args = parser.parse_args(argv)
    if not args.runs and args.trace is None:
        parser.error("give the out_dir of one or more runs, or --trace OUT_DIR")
    if args.predicted is not None and args.trace is None:
        parser.error("--predicted is drawn above a --trace: give --trace too")
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
            plot_trace(args.trace, out, args.predicted)
        else:
            out = args.out or "loss.png"
            plot_runs(args.runs, out)
    except (FileNotFoundError, LogError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
