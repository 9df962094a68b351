"""
What a learner reads for each mechanism, traced from real runs.

Lines read: the lines of the functions train.py enters at the mechanism's layout beyond those it
enters at one process.

    python scripts/reading_path.py           the table, in markdown (the README shows it)
    python scripts/reading_path.py --show    and under it, per row, each function counted, by file
    python scripts/reading_path.py --write   rewrite the README's copy of the table

The runs. A row is train.py on 2 processes (gloo, CPU): the tiny model of TINY, two steps on small
random token bins written here, evaluated once at the end, no checkpoint. Its one-process run is the
same at one process (BASELINES). One torchrun launch of 2 ranks runs every row one after another:
each rank calls train.py's configure_run, build.py's setup and train.py's train for each row,
in-process, on the one process group the launch starts (as tests/dist_utils.py's train_on_ranks
does). train.main is those three calls, its error messages, and the process group destroyed at its
end, which the next row needs. The one-process runs run in this process meanwhile.

Two things part from a run launched alone. The first step's memory measurement is left out of every
run (metrics.measure_step_memory, as the tests leave it out): on CPU its dispatch mode sees every
op, which made the runs several times slower; it observes a step whatever the layout, and the table
came out the same with it when this was written. And what a process caches (functools' lru_cache,
tools/step_time.py's _SCHEDULES) is computed by the first run in it that needs it, later runs
skipping the functions that compute it. The cached functions a row enters today are entered by its
one-process run too, so the lines read do not change; the tools' figures do: step_time's routing
(tools/timeline.py's route_messages and check_channels) is entered by the tensor parallel row, the
first without a pipeline, and by the 1F1B row only.

What is counted. Every function (a code object: file, first line, name) that Python enters during a
run, on any rank, is recorded (sys.settrace's 'call' events, and threading.settrace's in threads the
run starts). The functions of picotron's own files count: the .py files at the top of the repository
(not tests/ or scripts/), but not the tools (TOOLS: planning, benchmarks, interop, plots, and
ledger.py's communication ledger), whose lines a run entered (the start-up plan and predicted step,
the ledger's counts) --show lists apart. A function entered
counts whole: all the non-blank lines of its def, decorators, docstring and comments inside
included. Lines read: the (file, line) pairs of all the functions the row's run entered, less those
of the functions its one-process run entered, each pair once (a nested def lies within its outer
def's lines). A module's or a class body's own code is no function and is not counted.
"""

import argparse
import ast
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (imported before any trace starts: importing is not what a run enters)
import build  # noqa: E402
import metrics  # noqa: E402
import train  # noqa: E402

# the tools: planning, benchmarks, interop and plots, apart from what trains. A path ending in "/"
# is a folder
# the tools' folder, and the communication ledger: applied from outside a step (it wraps
# torch.distributed in the run's first step and before log lines), it is no mechanism's reading
TOOLS = {"tools/", "ledger.py"}

# every run: the tiny model, two steps, one evaluation batch at the end, no checkpoint, on CPU
TINY = [
    "--n_layer=4",
    "--n_head=4",
    "--n_kv_head=2",
    "--n_embd=32",
    "--block_size=64",
    "--batch_size=2",
    "--max_iters=2",
    "--eval_iters=1",
    "--checkpoint_interval=0",
    "--device=cpu",
]
# the one-process runs the rows are measured against: a config file and settings
BASELINES = {
    "dense": ["config/tiny_fineweb.py"],
    "MoE": ["config/moe.py"],
    "Muon": ["config/tiny_fineweb.py", "--optimizer=muon"],
}
# a row: the mechanism, its one-process run, the settings its 2-process run adds
ROWS = [
    ("tensor parallel", "dense", ["--tp=2"]),
    ("data parallel", "dense", ["--dp=2"]),
    ("ZeRO-1", "dense", ["--dp=2", "--zero_stage=1"]),
    ("1F1B", "dense", ["--pp=2", "--pp_schedule=1f1b"]),
    ("ring attention", "dense", ["--cp=2"]),
    ("ZeRO-3", "dense", ["--dp=2", "--zero_stage=3"]),
    ("expert parallel", "MoE", ["--ep=2"]),
    ("Muon", "Muon", ["--dp=2", "--zero_stage=1"]),
]
NPROC = 2
COMPREHENSIONS = {
    ast.ListComp: "<listcomp>",
    ast.SetComp: "<setcomp>",
    ast.DictComp: "<dictcomp>",
    ast.GeneratorExp: "<genexpr>",
}

# -----------------------------------------------------------------------------
# the counting rule: the functions entered, to the lines they hold


def is_tool(file):
    return any(file == t or (t.endswith("/") and file.startswith(t)) for t in TOOLS)


def project_files(root):
    """{path relative to root: text} of picotron's own files: the .py files at its top, and the
    tools' (those in a folder of TOOLS)."""
    paths = list(root.glob("*.py"))
    paths += [p for t in TOOLS if t.endswith("/") for p in (root / t).rglob("*.py")]
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(paths)}


def function_spans(text):
    """{(first line, code name): (qualified name, its non-blank lines)} of each function of a file,
    keyed as its code object is (co_firstlineno: the first decorator's line); lambdas too, and the
    comprehensions inside a def (code objects of their own in Python 3.11), which lie within it."""
    lines, spans = text.splitlines(), {}

    def add(node, first, name, qualname):
        span = {k for k in range(first, node.end_lineno + 1) if lines[k - 1].strip()}
        spans[(first, name)] = (qualname, span)

    def visit(node, prefix, in_def):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([d.lineno for d in child.decorator_list] + [child.lineno])
                add(child, first, child.name, prefix + child.name)
                visit(child, f"{prefix}{child.name}.", True)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", in_def)
            else:
                lambda_ = isinstance(child, ast.Lambda)
                name = "<lambda>" if lambda_ else COMPREHENSIONS.get(type(child))
                if lambda_ or (name and in_def):
                    add(child, child.lineno, name, f"{prefix}{name} (line {child.lineno})")
                visit(child, prefix, in_def)

    visit(ast.parse(text), "", False)
    return spans


def load(root):
    """{file: function_spans} of picotron's own files."""
    return {file: function_spans(text) for file, text in project_files(root).items()}


def entered_lines(spans, entered):
    """{(file, line)} of the functions entered ((file, first line, code name)), each whole; a code
    object that is no function (a module's, a class body's) is left out."""
    found = set()
    for file, first, name in entered:
        span = spans.get(file, {}).get((first, name))
        if span is not None:
            found |= {(file, k) for k in span[1]}
    return found


def count(spans, entered, baseline):
    """(lines read, tools' lines entered), each {(file, line)}: the lines of the functions of
    picotron's files but the tools' that `entered` holds beyond `baseline`; the tools' it holds."""
    lines = entered_lines(spans, entered)
    read = {(f, k) for f, k in lines - entered_lines(spans, baseline) if not is_tool(f)}
    return read, {(f, k) for f, k in lines if is_tool(f)}


def by_function(spans, entered, lines):
    """{file: [(qualified name, n)]}: each line of `lines` given to the outermost function of
    `entered` holding it (a nested def's lines are its outer def's), n the lines each was given."""
    given, out = set(), {}
    found = [e for e in entered if e[1:] in spans.get(e[0], {})]
    for file, first, name in sorted(found, key=lambda e: (e[0], e[1], -len(spans[e[0]][e[1:]][1]))):
        qualname, span = spans[file][(first, name)]
        new = {(file, k) for k in span} & lines - given
        given |= new
        if new:
            out.setdefault(file, []).append((qualname, len(new)))
    return out


# -----------------------------------------------------------------------------
# the runs, traced


def skip_memory_measurement(step, dev, compiled=False):
    """metrics.measure_step_memory without the measurement: the step, and a peak of 0."""
    step()
    return 0


def traced(argv):
    """{(file, first line, code name)} of the functions of picotron's files (file relative to the
    repository) that train.py's run of argv enters in this process (its process group, if any,
    already started)."""
    codes, out = set(), io.StringIO()
    measure, metrics.measure_step_memory = metrics.measure_step_memory, skip_memory_measurement

    def tracer(frame, event, arg):  # 'call' events only: returning None asks for no line events
        codes.add(frame.f_code)

    sys.settrace(tracer)
    threading.settrace(tracer)
    try:
        with redirect_stdout(out):
            cfg, _, resume_path = train.configure_run(argv)
            train.train(cfg, build.setup(cfg), resume_path)
    except BaseException as e:
        output = out.getvalue()
        raise RuntimeError(f"train.py {' '.join(argv)} failed; its output:\n{output}") from e
    finally:
        sys.settrace(None)
        threading.settrace(None)
        metrics.measure_step_memory = measure
    files = set(project_files(ROOT))
    where = {
        name: os.path.relpath(os.path.realpath(name), os.path.realpath(ROOT))
        for name in {c.co_filename for c in codes}
    }
    return {
        (where[c.co_filename], c.co_firstlineno, c.co_name)
        for c in codes
        if where[c.co_filename] in files
    }


def run_argv(work, base, settings, name):
    config, *given = BASELINES[base]
    return [
        str(ROOT / config),
        *given,
        *TINY,
        *settings,
        f"--data_dir={work}/data",
        f"--out_dir={work}/{name}",
    ]


def trace_rows(work):
    """One rank of the launch: every row's run, one after another on the one process group, traced;
    writes {row: [[file, first line, name], ...]} to <work>/rank<rank>.json."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    entered = {}
    for k, (row, base, settings) in enumerate(ROWS):
        dist.barrier()
        entered[row] = sorted(traced(run_argv(work, base, settings, f"row{k}")))
    (Path(work) / f"rank{dist.get_rank()}.json").write_text(json.dumps(entered))
    dist.destroy_process_group()


def write_tokens(folder, n_tokens=8192, vocab_size=512):
    """Random token bins (train and val) and their meta.json, as prepare_data.py writes them."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", n_tokens), ("val", n_tokens // 4)):
        rng.integers(0, vocab_size, n, dtype=np.uint16).tofile(folder / f"{split}.bin")
    meta = {
        "tokenizer": "gpt2",
        "vocab_size": vocab_size,
        "dtype": "uint16",
        "eot_token": vocab_size - 1,
        "train_tokens": n_tokens,
        "val_tokens": n_tokens // 4,
    }
    (folder / "meta.json").write_text(json.dumps(meta))


def launch_ranks(work):
    """torchrun of NPROC ranks running trace_rows, its output in <work>/launch.log: the Popen."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={NPROC}",
        str(Path(__file__).resolve()),
        f"--ranks_of={work}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(Path(work) / "launch.log", "w") as log:  # (the launch writes to its own copy)
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def trace_all():
    """({row: the functions its 2-process run entered}, {one-process run: the functions it
    entered}): the launch of the rows, and meanwhile the one-process runs here, one by one."""
    torch.set_num_threads(1)  # (as each rank: the launch has the machine's cores)
    with tempfile.TemporaryDirectory() as work:
        write_tokens(Path(work) / "data")
        launch = launch_ranks(work)
        try:
            alone = {base: traced(run_argv(work, base, [], f"one_{base}")) for base in BASELINES}
            launch.wait(timeout=600)
        finally:
            if launch.poll() is None:  # (a run here failed: torchrun ends its ranks on SIGTERM)
                launch.terminate()
                launch.wait(timeout=30)
        if launch.returncode != 0:
            log = (Path(work) / "launch.log").read_text()
            raise SystemExit(f"the launch of the rows failed ({launch.returncode}):\n{log[-6000:]}")
        ranks = [json.loads((Path(work) / f"rank{r}.json").read_text()) for r in range(NPROC)]
    return {row: {tuple(e) for rank in ranks for e in rank[row]} for row, _, _ in ROWS}, alone


# -----------------------------------------------------------------------------
# the table

HEADER = "| mechanism | layout | lines read |\n|---|---|---|"


def layout_cell(base, settings):
    """The row's settings beyond the tiny dense run's: its config file when another, its own."""
    config, *given = BASELINES[base]
    shown = ([] if config == BASELINES["dense"][0] else [config]) + given + settings
    return f"`{' '.join(shown)}`"


def table(spans, rows, alone):
    out = [HEADER]
    for row, base, settings in ROWS:
        read, _ = count(spans, rows[row], alone[base])  # (the tools' lines entered: --show)
        out.append(f"| {row} | {layout_cell(base, settings)} | {len(read)} |")
    return "\n".join(out)


def listing(spans, entered, lines, indent="  "):
    """The functions of `entered` that `lines` holds, by file, with the lines each was given."""
    out = []
    for file, functions in by_function(spans, entered, lines).items():
        out.append(f"{indent}{file}: {sum(n for _, n in functions)}")
        out += [f"{indent}    {name}: {n}" for name, n in functions]
    return out


def details(spans, rows, alone):
    """Per row, each function counted, by file, then the tools' functions its run entered; last,
    the tools' functions each one-process run entered."""
    out = []
    for row, base, settings in ROWS:
        read, tools = count(spans, rows[row], alone[base])
        out.append(
            f"\n## {row}: {layout_cell(base, settings)} on {NPROC} processes against one: "
            f"{len(read)} lines read"
        )
        out += listing(spans, rows[row], read)
        out.append(f"  tools entered: {len(tools)} lines")
        out += listing(spans, rows[row], tools, "    ")
    for base in BASELINES:
        _, tools = count(spans, alone[base], ())
        out.append(
            f"\n## one process, `{' '.join(BASELINES[base])}`: tools entered: {len(tools)} lines"
        )
        out += listing(spans, alone[base], tools)
    return "\n".join(out)


def with_table(readme, new):
    """The README's text with its table (from HEADER's first line to the first line not in a table)
    new."""
    lines = readme.splitlines(keepends=True)
    first = HEADER.splitlines()[0]
    start = next((k for k, line in enumerate(lines) if line.rstrip("\n") == first), None)
    if start is None:
        raise SystemExit(
            f"README.md has no line {first!r}: put the table where it belongs once by "
            f"hand (python scripts/reading_path.py prints it), then --write keeps it"
        )
    end = next((k for k in range(start, len(lines)) if not lines[k].startswith("|")), len(lines))
    return "".join(lines[:start]) + new + "\n" + "".join(lines[end:])


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.strip().splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--show", action="store_true", help="list each function counted, per row")
    parser.add_argument("--write", action="store_true", help="rewrite the table in README.md")
    parser.add_argument("--ranks_of", help=argparse.SUPPRESS)  # (a rank of the launch: its folder)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # (train.py and the files it imports)
    if args.ranks_of:
        return trace_rows(args.ranks_of)
    start = time.time()
    rows, alone = trace_all()
    spans = load(ROOT)
    text = table(spans, rows, alone)
    print(text)
    if args.show:
        print(details(spans, rows, alone))
    print(f"traced in {time.time() - start:.0f} s", file=sys.stderr)
    if args.write:
        readme = ROOT / "README.md"
        readme.write_text(with_table(readme.read_text(), text))
        print(f"wrote {readme.relative_to(ROOT)}'s table", file=sys.stderr)


if __name__ == "__main__":
    main()
