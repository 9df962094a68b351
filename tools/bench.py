r"""
Time picotron's training step: tokens/s, ms/step, MFU and peak memory, for any config and layout.

    python tools/bench.py config/tiny_fineweb.py
    python tools/bench.py config/tiny_fineweb.py --compile=True --bench_steps=20
    python tools/bench.py --n_layer=6 --n_head=6 --n_kv_head=6 --n_embd=384 --reference=True
    python tools/bench.py config/tiny_fineweb.py --optimizer=muon --compare_optimizer=adamw
    torchrun --nproc_per_node=2 tools/bench.py config/tiny_fineweb.py --zero_stage=1 \
        --compare_zero_stage=0
    python tools/bench.py config/tiny_fineweb.py --data_dir=data/fineweb_edu --doc_mask=True \
        --compare_doc_mask=True
    python tools/bench.py config/tiny_fineweb.py --fp8=tensorwise --compare_fp8=True
    torchrun --nproc_per_node=4 tools/bench.py config/tiny_fineweb.py --tp=2 --dp=2
    torchrun --nproc_per_node=4 tools/bench.py config/tiny_fineweb.py --cp=2 --tp=2 \
        --sequence_parallel=True --block_size=1024
    torchrun --nproc_per_node=2 tools/bench.py --pp=2 --gradient_accumulation_steps=8 \
        --schedules=1f1b,zero_bubble,interleaved_1f1b:2,zbv:2

Every training setting works here (settings.py), and the model, optimizer and step are train.py's
own (setup, build, train_step), so this times exactly what training runs, in whatever layouts
train.py supports. What the bench's own settings (listed by --help) compare is timed step by step in
turn, so every column sees the same machine: the plain GPT at the end of this file at the same size
(--reference), pipeline schedules (--schedules, each its own model, with its bubble measured from a
traced step and its peak activations per rank), another optimizer, ZeRO stage, doc_mask or fp8
(--compare_*), the same step inside the communication ledger (--ledger_overhead).
--profile_steps adds steps under torch.profiler (where a step's time goes; --profile_trace also
writes them as a Chrome trace); --trace one more step's actions (trace_step), in the format of
tools/step_time.py --trace, for tools/plot.py --trace to draw. Tokens are random
unless --data_dir is given on the command line (doc_mask needs its eot_token: from the data's
meta.json, or --eot_token).

The last line printed is `RESULT {json}`, for scripts: first_step_s is the first step's time, which
holds the compilation with compile=True; exposed_comm_ms, {mechanism: ms}, what a rank stood waiting
on communication in a step (one more step, its waits counted by metrics.exposed_comm; the mean over
the ranks), and each comparison's as compare_exposed_comm_ms; that step's communication ledger
(ledger.py), rank 0's: comm_ledger, {mechanism: {op: {calls, bytes, waited_ms}}}, and comm_bytes,
{mechanism: bytes sent}. With --ledger_overhead, ledger_ms_per_step is the median step with the
ledger recording and ledger_overhead its cost as a share of the plain step (ledger_ms_per_step /
ms_per_step - 1); off, the ledger wraps nothing and costs nothing.
"""

import dataclasses
import json
import math
import os
import statistics
import sys
import time
from types import SimpleNamespace

if __name__ == "__main__" and not __package__:  # python tools/X.py: import from the repository
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import metrics
import settings
from data import TRAIN_STREAM, context_split, document_end, rank_microbatches
import build
import train
from configurator import ConfigError, Setting, configure, section
from faults import run_script
from fp8 import check_fp8
from settings import check_layout
from pipeline_schedules import check_schedule, ideal_bubble
from ledger import CommLedger, layout_groups
from tools import machines, memory_plan, step_time, timeline

BENCH = section(
    "tools/bench.py's own",
    Setting("warmup_steps", 3, "untimed steps first (compiling, allocator and thread warm-up)"),
    Setting("bench_steps", 10, "timed steps; the median is reported"),
    Setting(
        "reference",
        False,
        "also time the plain GPT at the end of tools/bench.py, step by step in turn",
    ),
    Setting(
        "schedules",
        "",
        "pp > 1: pipeline schedules to time side by side in turn, comma-separated, each "
        "pp_schedule or pp_schedule:pp_chunks (1f1b,zero_bubble,interleaved_1f1b:2,zbv:2)",
    ),
    Setting(
        "profile_steps",
        0,
        "after the timed steps, this many more under torch.profiler: prints where the time goes",
    ),
    Setting(
        "profile_trace",
        "",
        "with profile_steps: also write the profile here as a Chrome trace (.json or "
        ".json.gz; PATH.rankN.json for each rank of several)",
    ),
    Setting(
        "compare_optimizer",
        "",
        "also time train.py's step with this optimizer ('adamw' or 'muon') instead of "
        "--optimizer, step by step in turn",
    ),
    Setting(
        "compare_zero_stage",
        -1,
        "also time train.py's step at this ZeRO stage (0-3) instead of --zero_stage, "
        "step by step in turn (-1: off)",
    ),
    Setting(
        "compare_doc_mask",
        False,
        "also time train.py's step with doc_mask the other way, step by step in turn",
    ),
    Setting(
        "machine",
        "auto",
        "the machine tools/step_time.py predicts the step for: 'auto' (this one, measured: a "
        "matmul at the model's shapes, an all-reduce over the ranks), a named one or a .json file",
    ),
    Setting(
        "trace",
        "",
        "after the timed steps, one more timed action by action, written here as a Chrome trace "
        "(.json; with pp > 1 every pipeline rank's actions, without rank 0's forward, backward "
        "and optimizer): tools/plot.py --trace draws it, over tools/step_time.py --trace's",
    ),
    Setting(
        "compare_fp8",
        False,
        "also time train.py's step with fp8 the other way ('none' against the run's "
        "recipe; a run without fp8 against 'tensorwise'), step by step in turn",
    ),
    Setting(
        "ledger_overhead",
        False,
        "also time picotron's step with the communication ledger (ledger.py) recording, step by "
        "step in turn with it off: RESULT's ledger_overhead, the share of a step it costs",
    ),
)


def parse_args(argv):
    """tools/bench.py's settings and the training settings, from one command line."""
    values, _ = configure(settings.TRAINING + BENCH, argv, usage=__doc__)
    warnings = settings.check_values(values)
    if warnings and int(os.environ.get("RANK", 0)) == 0:
        print("\n".join(warnings), flush=True)
    if values["compare_zero_stage"] != -1 and values["compare_optimizer"]:
        raise ConfigError(
            f"compare_zero_stage = {values['compare_zero_stage']} and "
            f"compare_optimizer = {values['compare_optimizer']!r}: give one of them "
            f"(both report compare_tokens_per_sec): --compare_zero_stage=-1 or "
            f"--compare_optimizer=''"
        )
    if values["bench_steps"] < 1 or values["warmup_steps"] < 0 or values["profile_steps"] < 0:
        raise ConfigError(
            f"bench_steps = {values['bench_steps']} must be >= 1, warmup_steps = "
            f"{values['warmup_steps']} and profile_steps = {values['profile_steps']} >= 0"
        )
    bench = SimpleNamespace(**{s.name: values.pop(s.name) for s in BENCH})
    if bench.machine != "auto":  # a machine file read now stops a bad one before the timed steps
        try:
            machines.load_machine(bench.machine)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    cfg = SimpleNamespace(**values)
    if not any(a.startswith("--data_dir=") for a in argv):
        cfg.data_dir = None  # random tokens: a config file's data_dir is not needed to time a step
    bench.variants = schedule_variants(cfg, bench.schedules)
    bench.compared = compared_settings(cfg, bench)
    return cfg, bench


def checked_variant(cfg, flag, value, **changes):
    """The run's settings with `changes`, asked for by --flag=value, checked by
    settings.check_values: the very function train.py checks a run's settings with (configure_run).
    Settings train.py would refuse stop here, before anything runs, in its words."""
    variant = SimpleNamespace(**{**vars(cfg), **changes})
    try:
        settings.check_values(vars(variant))  # (its warnings are the run's own, printed already)
    except ConfigError as e:
        raise ConfigError(refused(flag, value, changes, e)) from None
    return variant


def refused(flag, value, changes, why):
    """The error line of a column that --flag=value asked for, with `changes` to the run's settings,
    which train.py's checks refuse for `why` (whose fix names the run's setting, not the flag)."""
    changed = ", ".join(f"{k}={v!r}" for k, v in changes.items())
    return (
        f"--{flag}={value} would time {changed}, which train.py refuses: {why} "
        f"(for the comparison, change --{flag})"
    )


# each --compare_*: the setting it changes, and its column's label, read from the settings that
# the column runs with (not from the flag: the label names what ran)
COMPARISONS = {
    "compare_optimizer": ("optimizer", lambda c: c.optimizer),
    "compare_zero_stage": ("zero_stage", lambda c: f"ZeRO-{c.zero_stage}"),
    "compare_doc_mask": ("doc_mask", lambda c: f"doc_mask={c.doc_mask}"),
    "compare_fp8": ("fp8", lambda c: f"fp8={c.fp8}"),
}


def compared_settings(cfg, bench):
    """{flag: (label, settings)} of each --compare_* given: the first column's settings (the run's,
    or its first schedule's) with that one changed, each checked as train.py checks its own."""
    first = bench.variants[0][1] if bench.variants else cfg
    other_fp8 = "tensorwise" if cfg.fp8 == "none" else "none"
    zero_stage = bench.compare_zero_stage
    asked = {
        "compare_optimizer": bench.compare_optimizer or None,
        "compare_zero_stage": None if zero_stage == -1 else zero_stage,
        "compare_doc_mask": (not cfg.doc_mask) if bench.compare_doc_mask else None,
        "compare_fp8": other_fp8 if bench.compare_fp8 else None,
    }
    compared = {}
    for flag, value in asked.items():
        if value is not None:
            name, label = COMPARISONS[flag]
            other = checked_variant(first, flag, getattr(bench, flag), **{name: value})
            compared[flag] = (label(other), other)
    return compared


def schedule_variants(cfg, schedules):
    """[(label, cfg with that pp_schedule and pp_chunks)] from --schedules, each checked as train.py
    would."""
    variants = []
    for item in filter(None, (part.strip() for part in schedules.split(","))):
        name, _, chunks = item.partition(":")
        if chunks and not chunks.isdigit():
            raise ConfigError(
                f"schedules: {item!r} is not pp_schedule or pp_schedule:pp_chunks (a number)"
            )
        if cfg.pp == 1:
            raise ConfigError("schedules compares pipeline schedules: set --pp to 2 or more")
        if item in (label for label, _ in variants):  # (a second column of a label hides the first)
            raise ConfigError(f"schedules: {item!r} is given twice: name each schedule once")
        chunks = int(chunks or 1)
        variant = checked_variant(cfg, "schedules", item, pp_schedule=name, pp_chunks=chunks)
        check_schedule(name, cfg.pp, cfg.gradient_accumulation_steps, variant.pp_chunks)
        variants.append((item, variant))
    return variants


def random_microbatches(cfg, layout, model_cfg, step, device):
    """Random (x, y) micro-batches, the same on every tensor- and pipeline-parallel rank of a
    data-parallel rank (as real batches are), different across data-parallel ranks and steps; under
    context parallelism each cp rank's share of them, as train.py's batches (context_split; with
    doc_mask, document ids at the random eot tokens)."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009 + layout.dp_rank)
    out = []
    for _ in range(cfg.gradient_accumulation_steps):
        tokens = torch.randint(
            0, model_cfg.vocab_size, (cfg.batch_size, cfg.block_size + 1), generator=g
        )
        x, y, *rest = context_split(
            (tokens[:, :-1], tokens[:, 1:]), layout, document_end(model_cfg)
        )
        out.append((x.to(device), y.to(device), *rest))
    return out


class Picotron:
    """train.py's training step, one call per step."""

    def __init__(self, cfg, run, name="picotron"):
        self.name, self.cfg, self.run, self.dev, self.layout = name, cfg, run, run.dev, run.layout
        # the pipeline's channel runs the world's first collective (NCCL)
        self.parts = build.build(cfg, run)
        self.autocast = self.parts.autocast
        self.flops_per_token = metrics.flops_per_token(run.model_cfg)
        # each optimizer step timed, as train_step calls it (RESULT's optimizer_ms): between two
        # marks that wait for nothing, so the timed steps keep their pace
        self.optimizer_marks, step, dev = [], self.parts.optimizer.step, run.dev

        def timed_step(*args, **kwargs):
            start = time_mark(dev)
            out = step(*args, **kwargs)
            self.optimizer_marks.append((start, time_mark(dev)))
            return out

        self.parts.optimizer.step = timed_step

    def batches(self, step):
        if self.run.datasets:
            return rank_microbatches(
                self.cfg,
                self.layout,
                self.run.datasets["train"],
                TRAIN_STREAM,
                step,
                self.cfg.gradient_accumulation_steps,
                self.dev,
                document_end(self.run.model_cfg),
            )
        return random_microbatches(self.cfg, self.layout, self.run.model_cfg, step, self.dev)

    def step(self, i, trace=None):
        """One training step; returns its loss as a float, which waits for the device (and every
        rank)."""
        loss, _ = train.train_step(
            self.cfg, self.layout, self.parts, self.batches(i), train.get_lr(i, self.cfg), trace
        )
        return train.mean_across_ranks(loss, self.layout).item()

    def measure_pipeline(self, i):
        """Two more steps: one traced (each pipeline rank's measured bubble), one counting the
        activations held for backward (each rank's peak bytes). Lists by pipeline rank, on every
        rank."""
        trace = timeline.PipelineTrace(self.dev)
        self.step(i, trace)
        bubble = timeline.measured_bubble(timeline.pipeline_values(trace.times(), self.layout))
        with timeline.ActivationMemory(
            self.parts.model, getattr(self.parts.pipeline, "weight_grad_stores", None) or ()
        ) as memory:
            self.step(i + 1, memory)
        return {
            "measured_bubble": bubble,
            "peak_activation_bytes": timeline.pipeline_values(memory.peak, self.layout),
            "ideal_bubble": ideal_bubble(
                self.cfg.pp_schedule,
                self.layout.pp,
                self.cfg.gradient_accumulation_steps,
                self.cfg.pp_chunks,
            ),
        }


class Ledgered:
    """A Picotron's own step (its model, its optimizer) inside a communication ledger (ledger.py),
    for --ledger_overhead: timed in turn with the plain step, its column is what recording every
    collective costs."""

    name = "with ledger"

    def __init__(self, picotron):
        self.picotron, self.flops_per_token = picotron, picotron.flops_per_token
        self.groups = layout_groups(picotron.layout, picotron.parts.pipeline)

    def step(self, i):
        with CommLedger(self.groups):
            return self.picotron.step(i)


class ReferenceGPT:
    """The plain GPT below at the same size, on the same batches, one process."""

    name = "reference GPT"

    def __init__(self, picotron):
        cfg, mc = picotron.cfg, picotron.run.model_cfg
        torch.manual_seed(cfg.seed)
        self.picotron = picotron
        self.model = GPT(mc.vocab_size, mc.block_size, mc.n_layer, mc.n_head, mc.n_embd).to(
            picotron.dev
        )
        self.optimizer = reference_optimizer(self.model, cfg.learning_rate, cfg.weight_decay)
        self.step_model = torch.compile(self.model) if cfg.compile else self.model
        self.flops_per_token = self.model.flops_per_token()

    def step(self, i):
        p = self.picotron
        loss = 0.0
        for x, y, *_ in p.batches(i):  # (plain causal attention: positions and documents unused)
            with p.autocast:
                _, micro_loss = self.step_model(x, y)
            micro_loss = micro_loss / p.cfg.gradient_accumulation_steps
            micro_loss.backward()
            loss += micro_loss.detach()
        if p.cfg.grad_clip > 0:  # as nanoGPT does, and picotron's step
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), p.cfg.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = train.get_lr(i, p.cfg)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def reset_peak_memory(dev):
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


def timed_columns(cfg, bench, setup):
    """[(label, settings, Run)] of the steps timed side by side: picotron's (one per schedule), then
    each it is compared with. Each passes the checks build.setup gives the run's own (column_run),
    here in main's try: a column that cannot run ends in one line before any model is built."""
    asked = [("schedules", label, label, other) for label, other in bench.variants]
    asked = asked or [(None, None, "picotron", cfg)]  # (the run's own: build.setup checked it)
    asked += [
        (flag, getattr(bench, flag), label, other)
        for flag, (label, other) in bench.compared.items()
    ]
    columns = []
    for flag, value, label, other in asked:
        try:
            columns.append((label, other, column_run(other, setup)))
        except ValueError as e:
            if flag is None:
                raise
            changes = {k: v for k, v in vars(other).items() if getattr(cfg, k) != v}
            raise ValueError(refused(flag, value, changes, e)) from None
    return columns


def column_run(other, setup):
    """setup's Run for other settings: the model's settings read from them as build.setup reads the
    run's, and build.setup's checks on them (a schedule's chunks against the layout setup built,
    doc_mask against the vocabulary, fp8 against the device and dtype)."""
    # (vocab_size and eot_token from the data, as setup's)
    model = {
        f.name: getattr(other, f.name)
        for f in dataclasses.fields(setup.model_cfg)
        if f.name not in ("vocab_size", "eot_token")
    }
    model_cfg = dataclasses.replace(setup.model_cfg, **model)
    layout = setup.layout
    check_layout(
        model_cfg,
        layout.tp,
        layout.pp,
        layout.cp,
        other.sequence_parallel,
        other.pp_chunks,
        ep=layout.ep,
    )
    check_fp8(other.fp8, setup.dev, setup.dtype)
    if model_cfg == setup.model_cfg:
        return setup
    return SimpleNamespace(**{**vars(setup), "model_cfg": model_cfg})


def make_runners(columns, bench):
    """A Picotron for each of timed_columns, in order, then the plain GPT (--reference), then the
    first one's step inside the ledger (--ledger_overhead)."""
    runners = [Picotron(other, run, label) for label, other, run in columns]
    if bench.reference:
        runners.append(ReferenceGPT(runners[0]))
    if bench.ledger_overhead:
        runners.append(Ledgered(runners[0]))
    return runners


def warm_up(runners, bench):
    """Each runner's untimed warm-up steps (compiling, allocating); {name: seconds of its first
    step}."""
    first_step_s = {}
    for r in runners:
        for i in range(bench.warmup_steps):
            start = time.perf_counter()
            r.step(i)
            first_step_s.setdefault(r.name, time.perf_counter() - start)
    return first_step_s


def timed_steps(runners, bench, probe=None):
    """The timed steps after the warm-up: ({name: [seconds of each step]}, {name: its last step's
    loss}, [seconds of each pass of probe]). probe (machines.linear_pass's one_pass) runs three
    times after each step."""
    # the runners take turns step by step, so a machine that speeds up or slows down affects them
    # alike; so does the step-time prediction's matmul probe on CPU: this host runs 25% faster or
    # slower from one second to the next, and probed after the steps, the probe read other seconds
    # than they ran in
    times = {r.name: [] for r in runners}
    losses, passes = {}, []
    for i in range(bench.warmup_steps, bench.warmup_steps + bench.bench_steps):
        for r in runners:
            start = time.perf_counter()
            losses[r.name] = r.step(i)
            times[r.name].append(time.perf_counter() - start)
        passes += [probe() for _ in range(3)] if probe else []
    return times, losses, passes


def speed_results(
    runners, times, losses, first_step_s, pipeline, tokens_per_step, peak, world_size
):
    """{name: speed, loss and MFU} of each runner, from the median of its timed steps."""
    results = {}
    for r in runners:
        seconds = statistics.median(times[r.name])
        tokens_per_sec = tokens_per_step / seconds
        results[r.name] = {
            "tokens_per_sec": tokens_per_sec,
            "ms_per_step": 1000 * seconds,
            "ms_per_step_min": 1000 * min(times[r.name]),
            "ms_per_step_max": 1000 * max(times[r.name]),
            "flops_per_token": r.flops_per_token,
            "loss": losses[r.name],
            "first_step_s": first_step_s.get(r.name),
        }
        results[r.name].update(pipeline.get(r.name, {}))
    # the fastest first: if it makes the peak probe again, the others divide by the same final peak
    for name in sorted(
        results, key=lambda n: -results[n]["flops_per_token"] * results[n]["tokens_per_sec"]
    ):
        results[name].update(
            peak.mfu(results[name]["flops_per_token"], results[name]["tokens_per_sec"], world_size)
        )
    return results


def measure_after(cfg, bench, setup, runners, step):
    """The untimed measurements after the timed steps, from step on: each schedule's pipeline (two
    steps), each Picotron's exposed communication (one), the profile and the memory (one).
    Returns (pipeline, exposed, profile, memory)."""
    layout = setup.layout
    pipeline = {r.name: r.measure_pipeline(step) for r in runners if bench.variants}
    step += 2 if bench.variants else 0  # (measure_pipeline ran two more steps)
    exposed = {
        r.name: metrics.exposed_comm(lambda: r.step(step), layout, r.parts.pipeline)
        for r in runners
        if isinstance(r, Picotron)
    }
    step += 1
    if bench.trace:
        line = trace_step(runners[0], step, bench.trace)
        if layout.rank == 0:
            print(line, flush=True)
        step += 1
    profile = None
    if bench.profile_steps:
        profile = profile_steps(runners[0], step, bench.profile_steps, bench.profile_trace)
    memory = measure_memory(cfg, setup, runners[0], step)
    return pipeline, exposed, profile, memory


def trace_step(picotron, step, path):
    """One more step, timed action by action and written to `path` in timeline.chrome_trace's
    format, the one tools/step_time.py --trace writes its prediction in. With pp > 1 the pipeline's
    own trace (timeline.PipelineTrace: every pipeline rank's actions); without, rank 0's phases
    (phase_spans). Every rank must call it (the pipeline's is gathered). Returns rank 0's line."""
    layout, cfg = picotron.layout, picotron.cfg
    if layout.pp > 1:
        trace = timeline.PipelineTrace(picotron.dev)
        picotron.step(step, trace)
        return timeline.write_pipeline_trace(trace, layout, cfg, step, path)
    if dist.is_initialized():
        dist.barrier()  # (the ranks start the step together, as the pipeline's trace does)
    spans = phase_spans(picotron, step)
    end = spans[-1][4]
    idle = 1 - sum(e - s for _, _, _, s, e, _ in spans) / end
    summary = {
        "step": step,
        "schedule": "none",
        "pp": 1,
        "microbatches": cfg.gradient_accumulation_steps,
        "chunks": 1,
        "measured_bubble": [idle],
        "ideal_bubble": None,
        "device": picotron.dev.type,
    }
    if layout.rank == 0:
        with open(path, "w") as f:
            json.dump(timeline.chrome_trace([spans], [{0: "rank 0"}], summary), f)
    return f"step {step} traced -> {path}: {end * 1e3:,.1f} ms, rank 0's phases"


# a phase_spans mark: the span it starts, up to the next mark (None: none, the forward's end)
PHASES = {
    "forward": ("F", "F"),
    "backward": ("B", "B"),
    "finish": ("dp reduction", "dp"),
    "norm": ("grad norm, clip", "grad_norm"),
    "optimizer": ("optimizer", "optimizer"),
}


def phase_spans(picotron, step):
    """One step without a pipeline in timeline.chrome_trace's spans: each micro-batch's forward (F3:
    the model's forward, loss included) and backward (B3: to the next forward, the last one's to the
    reducer's finish), the reducer's finish (the exposed dp reduction), the gradient norm and
    clipping, the optimizer step. Times are taken at hooks put on from outside for this step (the
    model's forward hooks, the reducer's set_grad_sync and finish, the optimizer's step), each
    after a wait for the device, which a GPU's step does not have: it runs a little slower."""
    parts, sync, marks = picotron.parts, machines.device_sync(picotron.dev), []
    zero = time.perf_counter()

    def mark(what):
        sync()
        marks.append((what, time.perf_counter() - zero))

    def before(obj, name, what, after=None):
        """Mark `what` before each call of obj.name (and `after` after it); returns the undo."""
        original, own = getattr(obj, name), name in vars(obj)  # (Picotron's own optimizer.step)

        def wrapped(*args, **kwargs):
            mark(what)
            out = original(*args, **kwargs)
            if after:
                mark(after)
            return out

        setattr(obj, name, wrapped)
        return (lambda: setattr(obj, name, original)) if own else (lambda: delattr(obj, name))

    hooks = [
        parts.model.register_forward_pre_hook(lambda *_: mark("forward")),
        parts.model.register_forward_hook(lambda *_: mark(None)),
    ]
    restore = [
        before(parts.grad_sync, "set_grad_sync", "backward"),
        before(parts.grad_sync, "finish", "finish", "norm"),
        before(parts.optimizer, "step", "optimizer", "end"),
    ]
    try:
        picotron.step(step)
    finally:
        for h in hooks:
            h.remove()
        for undo in restore:
            undo()
    return phases_of(marks)


def phases_of(marks):
    """phase_spans' spans from its marks [(what, seconds)] in time order: each PHASES mark starts
    a span that ends at the next mark; the micro-batch counted at each forward."""
    spans, i = [], -1
    for (what, start), (_, end) in zip(marks, marks[1:]):
        i += what == "forward"
        if what in PHASES:
            name, category = PHASES[what]
            name = f"{name}{i}" if category in ("F", "B") else name
            spans.append((name, category, 0, start, end, {"microbatch": i} if i >= 0 else {}))
    return spans


def time_mark(dev):
    """A point in time that waits for nothing: on CUDA an event recorded on the stream (the host
    runs ahead of the GPU), else the host's clock."""
    if dev.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def ms_between(start, end):
    """Milliseconds between two time_marks (a CUDA pair waits for the later one)."""
    if isinstance(start, float):
        return 1e3 * (end - start)
    end.synchronize()
    return start.elapsed_time(end)


def optimizer_results(runners, layout, steps):
    """{name: {optimizer_ms, newton_schulz_flops}} of each picotron runner, each a list with one
    value per rank: the median of its optimizer steps over the last `steps` (the timed ones), and
    the Newton-Schulz FLOPs of a step (optim.Muon counts them; 0 for AdamW). Muon's deal of the
    matrices balances the second across the data-parallel ranks (optim.deal_whole)."""
    out = {}
    for r in runners:
        if not isinstance(r, Picotron):
            continue
        ms = statistics.median(ms_between(*marks) for marks in r.optimizer_marks[-steps:])
        flops = getattr(r.parts.optimizer, "newton_schulz_flops", 0) // len(r.optimizer_marks)
        every = [None] * layout.world_size
        if layout.world_size > 1:
            dist.all_gather_object(every, (ms, flops))
        else:
            every = [(ms, flops)]
        out[r.name] = {
            "optimizer_ms": [m for m, _ in every],
            "newton_schulz_flops": [f for _, f in every],
        }
    return out


def moe_results(picotron, layout, moe_stats):
    """The RESULT fields of an MoE model: the expert parallelism, the all-to-all bytes and the
    experts' load per timed step, and the experts' parameter and optimizer bytes on this rank."""
    params, state = metrics.expert_memory_bytes(picotron.parts.model, picotron.parts.optimizer)
    return dict(
        ep=layout.ep,
        a2a_bytes=moe_stats["a2a_bytes"],
        expert_load_min=moe_stats["expert_load_min"],
        expert_load_max=moe_stats["expert_load_max"],
        expert_param_bytes=params,
        expert_optimizer_bytes=state,
    )


def run(cfg, bench, setup, columns):
    """The benchmark of timed_columns: warm up, time the steps, then measure the pipeline, the
    profile and the memory; rank 0 prints the table and the RESULT line. Returns {name: results} of
    each runner."""
    dev, ptdtype, layout, model_cfg = setup.dev, setup.dtype, setup.layout, setup.model_cfg
    runners = make_runners(columns, bench)
    first_step_s = warm_up(runners, bench)
    moe = model_cfg.n_expert > 0
    if moe:  # (resets the step counts: only timed steps below)
        metrics.moe_metrics(runners[0].parts.model, layout)
    reset_peak_memory(dev)
    # the step-time prediction's matmul probe runs between the timed steps on CPU (timed_steps says
    # why); on a GPU, which holds its pace, it runs later: its tensors would count in the peak
    flops, probe = 0, None
    if bench.machine == "auto" and dev.type == "cpu":
        tokens = machines.probe_tokens(cfg, dev)
        flops, probe = machines.linear_pass(model_cfg, ptdtype, dev, tokens, layout.tp)
    times, losses, passes = timed_steps(runners, bench, probe)
    # (the ledger's column steps the first runner's model too: twice its steps a round)
    rounds = bench.bench_steps * (2 if bench.ledger_overhead else 1)
    optimizer = optimizer_results(runners, layout, rounds)
    del probe  # (its tensors, before the memory is measured)
    peak_mem = metrics.peak_memory_bytes(dev, layout)
    # MoE: the load and the all-to-all bytes per timed step (the first runner's steps only, before
    # any pipeline measurement runs more)
    moe_stats = metrics.moe_metrics(runners[0].parts.model, layout, steps=rounds) if moe else {}
    step = bench.warmup_steps + bench.bench_steps
    pipeline, exposed, profile, memory = measure_after(cfg, bench, setup, runners, step)

    tokens_per_step = cfg.batch_size * cfg.gradient_accumulation_steps * layout.dp * cfg.block_size
    peak = metrics.PeakFlops(cfg.peak_flops, dev, ptdtype)
    results = speed_results(
        runners, times, losses, first_step_s, pipeline, tokens_per_step, peak, layout.world_size
    )
    main = runners[0].name
    # the step predicted (tools/step_time.py) beside the measured; `python tools/step_time.py
    # --machine=FILE` given the machine in the RESULT reproduces it
    rate = flops / statistics.median(passes) if passes else None
    results[main].update(
        step_time.run_prediction(cfg, model_cfg, layout, dev, ptdtype, bench.machine, rate)[2]
    )
    # the process's peak: with the reference alongside, both models'
    results[main]["peak_mem_bytes"] = peak_mem
    for name, (_, waited, ledger) in exposed.items():
        results[name]["exposed_comm_ms"] = waited
        results[name]["comm_ledger"] = ledger.summary()  # this rank's (rank 0's in RESULT)
        results[name]["comm_bytes"] = ledger.bytes_sent()
    for name, fields in optimizer.items():
        results[name].update(fields)
    if bench.ledger_overhead:  # (medians of steps taken in turn: noise can make it negative)
        on = results[Ledgered.name]["ms_per_step"]
        results[main].update(
            ledger_ms_per_step=on, ledger_overhead=on / results[main]["ms_per_step"] - 1
        )
    if moe:
        results[main].update(moe_results(runners[0], layout, moe_stats))

    if layout.rank == 0:
        report(cfg, bench, setup, runners, results, peak, tokens_per_step, memory, profile)
    return results


def report(cfg, bench, setup, runners, results, peak, tokens_per_step, memory, profile):
    """Rank 0's output: the table, each comparison in a line, and the RESULT line that tests and
    scripts parse."""
    dev, ptdtype, layout, model_cfg = setup.dev, setup.dtype, setup.layout, setup.model_cfg
    main = runners[0].name
    print_table(
        cfg, bench, dev, ptdtype, layout, model_cfg, results, peak, step_model_kind(runners[0])
    )
    if bench.reference or len(runners) > 1:
        print("(peak memory is the whole process's: every model, as they ran side by side)")
    result = dict(
        results[main],
        device=str(dev),
        dtype=str(ptdtype).replace("torch.", ""),
        world_size=layout.world_size,
        dp=layout.dp,
        cp=layout.cp,
        tp=layout.tp,
        pp=layout.pp,
        sequence_parallel=cfg.sequence_parallel,
        compiled=step_model_kind(runners[0]) == "compiled",
        peak_flops=peak.flops,
        tokens_per_step=tokens_per_step,
        threads=torch.get_num_threads(),
        zero_stage=cfg.zero_stage,
        memory=memory,
    )
    result.update(report_comparisons(bench, runners[0], results, dev))
    if bench.ledger_overhead:
        print(
            f"ledger on against off: {result['ledger_ms_per_step']:,.1f} against "
            f"{result['ms_per_step']:,.1f} ms/step (median), overhead "
            f"{result['ledger_overhead']:+.1%} of a step"
        )
    if profile is not None:
        result["profile"] = profile
    if bench.reference:
        ref = results["reference GPT"]
        result.update(
            reference_tokens_per_sec=ref["tokens_per_sec"],
            reference_ms_per_step=ref["ms_per_step"],
            reference_mfu=ref["mfu"],
            speedup_vs_reference=results[main]["tokens_per_sec"] / ref["tokens_per_sec"],
        )
    if bench.variants:
        result["schedules"] = {name: results[name] for name, _ in bench.variants}
    print("RESULT " + json.dumps(result), flush=True)


def report_comparisons(bench, first, results, dev):
    """Each --compare_*'s line: the first column against the compared one, each named by the
    settings it ran with (bench.compared). Returns the RESULT fields they add."""
    ours, mine, fields = first.cfg, results[first.name], {}
    for flag, (label, theirs) in bench.compared.items():
        other = results[label]
        ms, other_ms = mine["ms_per_step"], other["ms_per_step"]
        times = f"{ms:,.1f} against {other_ms:,.1f} ms/step (median), {ms / other_ms:.3f}x the time"
        if flag == "compare_optimizer":
            print(f"optimizer {ours.optimizer} against {theirs.optimizer}: {times}")
            fields.update(
                optimizer=ours.optimizer,
                compare_optimizer=theirs.optimizer,
                compare_ms_per_step=other_ms,
                compare_loss=other["loss"],
                compare_tokens_per_sec=other["tokens_per_sec"],
            )
        if flag == "compare_zero_stage":
            speed, other_speed = mine["tokens_per_sec"], other["tokens_per_sec"]
            print(
                f"ZeRO-{ours.zero_stage} against ZeRO-{theirs.zero_stage}: {speed:,.0f} against "
                f"{other_speed:,.0f} tokens/s (median), {speed / other_speed:.3f}x the speed"
            )
            fields.update(
                compare_zero_stage=theirs.zero_stage,
                compare_ms_per_step=other_ms,
                compare_tokens_per_sec=other_speed,
                compare_loss=other["loss"],
                compare_exposed_comm_ms=other["exposed_comm_ms"],
            )
        if flag == "compare_doc_mask":
            print(f"doc_mask={ours.doc_mask} against doc_mask={theirs.doc_mask}: {times}")
            fields.update(
                doc_mask=ours.doc_mask,
                compare_doc_mask_ms_per_step=other_ms,
                compare_doc_mask_tokens_per_sec=other["tokens_per_sec"],
            )
        if flag == "compare_fp8":
            cpu = " (on CPU FP8 proves the numerics, not the speed: it is slower)"
            print(f"fp8={ours.fp8} against fp8={theirs.fp8}: {times}" + cpu * (dev.type == "cpu"))
            fields.update(
                fp8=ours.fp8,
                compare_fp8=theirs.fp8,
                compare_fp8_ms_per_step=other_ms,
                compare_fp8_tokens_per_sec=other["tokens_per_sec"],
                compare_fp8_loss=other["loss"],
            )
    return fields


def measure_memory(cfg, setup, picotron, step):
    """One more, untimed step, its peak measured on every rank (metrics.measure_step_memory) beside
    the planner's prediction for the rank's stage: [{rank, dp_rank, cp_rank, tp_rank, pp_rank,
    predicted_bytes, measured_bytes, ...the planned parts}] for every rank, on rank 0."""
    layout = setup.layout
    plan = memory_plan.plan_for(
        cfg, setup.model_cfg, (layout.dp, layout.tp, layout.pp, layout.cp), layout.dp_cp_rank
    )[layout.pp_rank]
    measured = metrics.measure_step_memory(
        lambda: picotron.step(step), setup.dev, compiled=picotron.parts.compiled
    )
    return memory_plan.memory_rows(
        layout,
        plan["peak"],
        measured,
        planned={k: int(v) for k, v in plan.items() if k not in ("stage", "peak")},
    )


def step_model_kind(picotron):
    return "compiled" if picotron.parts.compiled else "eager"


# what a kernel (GPU) or operator (CPU) is, from its name: the first kind whose name part matches
PROFILE_KINDS = (
    ("attention", ("flash", "fmha", "attention", "scaled_dot_product", "sdpa")),
    (
        "matmul",
        (
            "gemm",
            "nvjet",
            "cutlass",
            "xmma",
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
            "aten::matmul",
        ),
    ),
    ("optimizer", ("adam",)),
    ("compiled fusions", ("triton",)),
    ("copies", ("memcpy", "memset", "aten::copy_", "aten::to")),
)


def profile_kind(name):
    lowered = name.lower()
    return next(
        (kind for kind, parts in PROFILE_KINDS if any(p in lowered for p in parts)), "other"
    )


def profile_steps(picotron, first_step, n_steps, trace_path=""):
    """Where a step's time goes: n_steps more steps under torch.profiler. On GPU it sums the time of
    every kernel the device ran, by kind (matmul, attention, compiled fusions, optimizer, copies,
    other: the eager elementwise kernels, norms and the loss), and how busy the device was (kernel
    time over wall time; idle time is the host running behind: launches, Python, syncs). On CPU the
    same for each operator's own time. Prints the kinds and the top kernels; returns {"device_busy":
    ..., "kinds": {kind: share}}."""
    on_gpu = picotron.dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for i in range(first_step, first_step + n_steps):
            picotron.step(i)  # returns the loss as a float: the device has finished when it returns
        wall_us = 1e6 * (time.perf_counter() - start)
    if trace_path and dist.is_initialized() and dist.get_world_size() > 1:
        # each rank its own file: one path would be written twice
        stem, dot, ext = trace_path.partition(".json")
        trace_path = f"{stem}.rank{dist.get_rank()}{dot}{ext}"
    if trace_path:
        prof.export_chrome_trace(trace_path)
    if on_gpu:  # every kernel launch is an event of device type CUDA, lasting its time on the GPU
        events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        timed = [(e.name, e.time_range.elapsed_us()) for e in events]
    else:  # operators nest (aten::linear calls aten::mm): their own time only, none counted twice
        timed = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    total = sum(t for _, t in timed) or 1.0
    by_kind, by_name = {}, {}
    for name, t in timed:
        by_kind[profile_kind(name)] = by_kind.get(profile_kind(name), 0.0) + t
        by_name[name] = by_name.get(name, 0.0) + t
    busy = total / wall_us
    if picotron.layout.rank == 0:
        what = "kernel time on the GPU" if on_gpu else "operators' own CPU time"
        print(
            f"\nprofile of {n_steps} step(s): {what} {total / 1e3 / n_steps:,.1f} ms per step, "
            f"{wall_us / 1e3 / n_steps:,.1f} ms wall (busy {100 * busy:.0f}%; the profiler itself "
            f"slows the host)"
        )
        for kind, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
            print(f"  {kind:18s} {100 * t / total:5.1f}%")
        print("top kernels:" if on_gpu else "top operators:")
        for name, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:12]:
            print(f"  {100 * t / total:5.1f}%  {profile_kind(name):17s} {name[:90]}")
        if trace_path:
            print(f"trace: {trace_path}")
    return {"device_busy": busy, "kinds": {k: t / total for k, t in by_kind.items()}}


def describe_bench(cfg, bench, dev, ptdtype, layout, model_cfg, kind):
    """The table's first line: the model, the batch, the device, the layout and the steps."""
    mc, threads = model_cfg, torch.get_num_threads()
    sp = " sequence-parallel" if cfg.sequence_parallel else ""
    tokens = f"data {cfg.data_dir}" if cfg.data_dir else "random tokens"
    pipeline = ""
    if layout.pp > 1 and not bench.variants:
        pipeline = f"pipeline {cfg.pp_schedule}, {cfg.pp_chunks} chunk(s) per rank; "
    return (
        f"bench: {mc.n_layer} layers, {mc.n_head} heads ({mc.n_kv_head} kv), width {mc.n_embd}, "
        f"block {mc.block_size}, vocab {mc.vocab_size}, batch {cfg.batch_size} x "
        f"{cfg.gradient_accumulation_steps} micro x dp {layout.dp}; {dev}, "
        f"{str(ptdtype).replace('torch.', '')}, {kind}, {threads} thread{'s' * (threads != 1)}; "
        f"layout dp={layout.dp} cp={layout.cp} tp={layout.tp}{sp} pp={layout.pp} ep={layout.ep}; "
        f"activation_checkpointing={cfg.activation_checkpointing}, "
        f"chunked_loss={cfg.chunked_loss}; {tokens}; {pipeline}"
        f"{bench.warmup_steps} warm-up + {bench.bench_steps} timed steps (median)"
    )


def mib(n, digits=0):
    return f"{n / 2**20:,.{digits}f}"


def joined(values, form):
    """A cell of several figures (by rank, by mechanism), "-" when there are none."""
    return " ".join(form(v) for v in values) or "-"


def communication_rows():
    """table_rows' rows of each rank's communication and optimizer step."""
    return [
        (
            "comm waited ms/step",
            lambda r: joined(
                [f"{k} {v:.1f}" for k, v in r.get("exposed_comm_ms", {}).items() if v], str
            ),
        ),
        (
            "comm sent MiB/step",
            lambda r: joined(
                [f"{m} {b / 2**20:.2f}" for m, b in sorted(r.get("comm_bytes", {}).items()) if b],
                str,
            ),
        ),
        ("optimizer ms by rank", lambda r: joined(r.get("optimizer_ms", []), "{:.1f}".format)),
        (
            "Newton-Schulz GFLOP by rank",
            lambda r: joined(r.get("newton_schulz_flops", []), lambda f: f"{f / 1e9:.2f}"),
        ),
    ]


def table_rows(bench):
    """[(label, a function of one runner's results giving its cell)], top to bottom; "-" where a
    runner has no such figure."""
    rows = [
        ("tokens/s", lambda r: f"{r['tokens_per_sec']:,.0f}"),
        ("ms/step (median)", lambda r: f"{r['ms_per_step']:,.1f}"),
        ("ms/step (min-max)", lambda r: f"{r['ms_per_step_min']:,.0f}-{r['ms_per_step_max']:,.0f}"),
        ("MFLOP/token", lambda r: f"{r['flops_per_token'] / 1e6:,.1f}"),
        ("MFU", lambda r: metrics.format_mfu(r["mfu"])),
        ("peak memory (MiB)", lambda r: mib(r["peak_mem_bytes"]) if "peak_mem_bytes" in r else "-"),
        (
            "experts MiB (rank 0)",
            lambda r: (
                f"{mib(r['expert_param_bytes'], 2)} + {mib(r['expert_optimizer_bytes'], 2)}"
                if "expert_param_bytes" in r
                else "-"
            ),
        ),
        ("all-to-all MiB/step", lambda r: mib(r["a2a_bytes"], 2) if "a2a_bytes" in r else "-"),
        (
            "expert load min-max",
            lambda r: (
                f"{r['expert_load_min']:,.0f}-{r['expert_load_max']:,.0f}"
                if "expert_load_min" in r
                else "-"
            ),
        ),
        *communication_rows(),
        ("loss (last step)", lambda r: f"{r['loss']:.4f}"),
    ]
    if bench.variants:  # per pipeline rank, rank 0 first
        rows += [
            (
                "bubble, ideal",
                lambda r: f"{r['ideal_bubble']:.1%}" if r["ideal_bubble"] is not None else "-",
            ),
            ("bubble, measured", lambda r: " ".join(f"{b:.0%}" for b in r["measured_bubble"])),
            (
                "activations (KiB)",
                lambda r: " ".join(f"{b / 2**10:.0f}" for b in r["peak_activation_bytes"]),
            ),
        ]
    return rows


def print_table(cfg, bench, dev, ptdtype, layout, model_cfg, results, peak, kind):
    print("\n" + describe_bench(cfg, bench, dev, ptdtype, layout, model_cfg, kind))
    print(f"peak: {peak}")
    names, rows = list(results), table_rows(bench)
    width = max(
        16,
        *(len(n) + 2 for n in names),
        *(len(fmt(results[n])) + 2 for _, fmt in rows for n in names),
    )
    print(f"{'':20s}" + "".join(f"{n:>{width}s}" for n in names))
    for label, fmt in rows:
        print(f"{label:20s}" + "".join(f"{fmt(results[n]):>{width}s}" for n in names))
    for n in names:  # metrics.PeakFlops: a new probe of the peak, or an MFU capped at 100%
        if results[n].get("mfu_note"):
            print(f"MFU of {n}: {results[n]['mfu_note']}")


def main(argv):
    try:
        cfg, bench = parse_args(argv)
        setup = build.setup(cfg, training=False)
        if bench.reference and setup.layout.world_size > 1:
            raise ValueError(
                "reference=True times a single-process GPT beside picotron: run it without torchrun"
            )
        columns = timed_columns(cfg, bench, setup)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")  # printed by rank 0 (faults.run_script)
    try:
        return run(cfg, bench, setup, columns)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# -----------------------------------------------------------------------------

# A straightforward GPT-2 (nanoGPT-style), the yardstick tools/bench.py --reference=True times
# picotron against.
#
# Written the plain way on purpose: learned positions, LayerNorm, one fused qkv projection, PyTorch
# SDPA, a 4x GELU MLP, tied embeddings, the vocabulary padded to a multiple of 64, the full (B, T,
# V) logits into F.cross_entropy, and fused AdamW. Nothing here is tuned for this machine: it is
# what someone would write first, and picotron's training step should be no slower than it at the
# same size.


class SelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, H, T, D)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = SelfAttention(n_embd, n_head)
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.fc_proj = nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.vocab_size = vocab_size
        padded = (vocab_size + 63) // 64 * 64  # nanoGPT's 50257 -> 50304: fast matmul sizes
        self.wte = nn.Embedding(padded, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, padded, bias=False)
        self.lm_head.weight = self.wte.weight
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        self.block_size = block_size
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = (
                    0.02 / math.sqrt(2 * n_layer)
                    if name.endswith(("proj.weight", "fc_proj.weight"))
                    else 0.02
                )
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))[..., : self.vocab_size]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)
            )
        return logits, loss

    def flops_per_token(self):
        """6 FLOPs per matmul parameter (forward 2, backward 4) plus the attention scores and their
        use: 6 * n_layer * T * 2 * n_embd (Kaplan et al. 2020; nanoGPT's estimate_mfu)."""
        matmul_params = sum(p.numel() for p in self.blocks.parameters() if p.dim() >= 2)
        matmul_params += self.n_embd * self.vocab_size  # the head, not its padding
        return 6 * matmul_params + 12 * self.n_layer * self.n_embd * self.block_size


def reference_optimizer(model, lr=1e-3, weight_decay=0.1):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=True)


if __name__ == "__main__":
    run_script(main, sys.argv[1:])
