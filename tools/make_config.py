r"""
Write a starter config for a model size and a parallel layout, checked before anything runs.

    python tools/make_config.py --n_layer=12 --n_embd=768 --n_head=12 --tp=2 --pp=2 --nproc=8 \
        --out=config/my.py
    torchrun --nproc_per_node=8 train.py config/my.py

Every training setting can be given (--key=value, or a config file to start from), plus `nproc`, the
number of processes the run will have, and `out`, the file to write (an existing one is refused
unless --force=True). The layout is checked with train.py's own rules (dp x cp x tp x pp must be
nproc, and settings.check_layout: heads, key/value heads, MLP width and blocks must split,
block_size into context parallelism's 2*cp chunks; the pipeline schedule's rules), so a layout that
does not divide the model is refused here rather than after the job waited in a queue. The file
states the parameter count and the global batch in tokens, then the settings that were asked for
(and the few this script chose, each saying why), with their meanings from settings.py; every other
setting keeps its default. Its launch line starts nproc processes on nodes of the machine's GPUs (or
--gpus_per_node): above one node, torchrun on each node with a c10d rendezvous, as scripts/slurm.sh
starts it.
"""

import functools
import itertools
import json
import os
import sys
from dataclasses import fields

if __name__ == "__main__" and not __package__:  # python tools/X.py: import from the repository
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch

import build
import metrics
import settings
from tools.step_time import model_config_of
from configurator import ConfigError, Setting, configure, section
from model import ModelConfig, Transformer, attention_head_dim
from settings import check_layout
from parallel import resolve_dp
from tools.timeline import describe_pipeline
from pipeline_schedules import check_schedule
from tools import machines, memory_plan, step_time

OWN = section(
    "tools/make_config.py's own",
    Setting("nproc", 1, "processes the run will have (torchrun --nproc_per_node x nodes)"),
    Setting("out", "config/my.py", "the config file to write"),
    Setting("force", False, "overwrite --out if it exists (else an existing file is refused)"),
    Setting(
        "gpu_mem_gib",
        0.0,
        "the memory of one GPU in GiB (2**30 bytes, the plan's unit): say which stage does "
        "not fit it, and what to change (0: no check; --choose: the machine's)",
    ),
    Setting(
        "choose",
        False,
        "rank every layout that fits by its predicted step time (tools/step_time.py) and write the "
        "fastest; a layout setting given on the command line is held, the others chosen",
    ),
    Setting(
        "global_batch",
        0,
        "--choose: sequences per step, held while the layouts vary (0: batch_size x "
        "gradient_accumulation_steps x the dp of the layout given)",
    ),
    Setting(
        "machine",
        "h100",
        "the machine the run is for (tools/step_time.py's a100, h100, l4, or a "
        ".json file): its GPUs per node cut the launch line into nodes; "
        "--choose predicts on it",
    ),
    Setting(
        "gpus_per_node",
        0,
        "devices per node (0: the machine's): the launch line's "
        "--nproc_per_node above one node; --choose keeps tensor "
        "parallelism inside a node unless --tp is given",
    ),
)


def machine_of(cfg):
    """The machine the run is planned for: a named one (machines.MACHINES) or a .json file of
    its fields. Not 'auto': that measures the machine a tool runs on, and a config is planned
    before its run."""
    name = cfg["machine"]
    if name not in machines.MACHINES and not (name.endswith(".json") and os.path.exists(name)):
        raise ConfigError(
            f"machine = {name!r} is not one tools/make_config.py can plan for: --choose (which "
            f"ranks layouts on it) and the launch line (its GPUs per node) need a named machine: "
            f"{', '.join(machines.MACHINES)}, or a .json file that exists with "
            f"machines.MACHINES' fields; 'auto' measures the machine a tool runs on, which "
            f"tools/step_time.py and tools/bench.py do"
        )
    return machines.load_machine(name)


def gpus_per_node_of(cfg):
    """(devices per node, where that comes from): --gpus_per_node, else the machine's."""
    if cfg["gpus_per_node"]:
        return cfg["gpus_per_node"], f"--gpus_per_node={cfg['gpus_per_node']}"
    return machine_of(cfg)["gpus_per_node"], f"{cfg['machine']}'s"


def launch_lines(cfg):
    """How to start the run: python for one process, torchrun for one node, and above one node
    torchrun on each node with a c10d rendezvous, as scripts/slurm.sh starts it. Above one node
    nproc must fill whole nodes (torchrun starts --nproc_per_node on each), else a ConfigError."""
    nproc, out = cfg["nproc"], cfg["out"]
    if nproc == 1:
        return [f"python train.py {out}"]
    per_node, source = gpus_per_node_of(cfg)
    if nproc <= per_node:
        return [f"torchrun --nproc_per_node={nproc} train.py {out}"]
    nodes = nproc // per_node
    if nproc % per_node:
        raise ConfigError(
            f"nproc = {nproc} is more than one node of {per_node} GPUs ({source}) but not a "
            f"multiple of {per_node}: torchrun starts as many processes on every node; set "
            f"--nproc={nodes * per_node} or {(nodes + 1) * per_node}, or --gpus_per_node to "
            f"your nodes' count"
        )
    return [
        f"torchrun --nnodes={nodes} --nproc_per_node={per_node} --rdzv-id=my_run "
        f"--rdzv-backend=c10d --rdzv-endpoint=HOST:29500 train.py {out}",
        f"(the same on each of the {nodes} nodes, HOST the first node's address; on SLURM,",
        f"sbatch scripts/slurm.sh with --nodes={nodes} --gpus-per-node={per_node},",
        f'GPUS_PER_NODE={per_node}, CONFIG={out} and ARGS="": the layout is in the config)',
    ]


def count_parameters(model_cfg):
    """(all parameters, those in embedding tables), without the vocabulary's padding rows. The model
    is built on the meta device: shapes only, no memory, so any size can be counted."""
    with torch.device("meta"):
        model = Transformer(model_cfg)
    total = embeddings = 0
    for name, p in model.named_parameters():  # a tied head is the embedding's tensor, counted once
        n = getattr(p, "vocab_size", p.shape[0]) * (p.numel() // p.shape[0])
        total += n
        embeddings += n if name in ("tok_emb.weight", "lm_head.weight") else 0
    return total, embeddings


def choices(cfg, given, dp):
    """The settings this script fills in beyond what was asked, {name: (value, why)}: the ones whose
    default would mean something nobody asked for at this size or layout."""
    nproc, cp, tp, pp = cfg["nproc"], cfg["cp"], cfg["tp"], cfg["pp"]
    if cp > 1:
        chosen = {"dp": (dp, f"nproc / (cp * tp * pp) = {nproc} / ({cp} * {tp} * {pp})")}
    else:
        chosen = {"dp": (dp, f"nproc / (tp * pp) = {nproc} / ({tp} * {pp})")}
    if "n_kv_head" not in given and cfg["n_kv_head"] != cfg["n_head"]:
        # the default n_kv_head fits the default n_head only: at another n_head it would be
        # grouped-query attention nobody requested
        chosen["n_kv_head"] = (
            cfg["n_head"],
            "= n_head: multi-head attention (set n_kv_head for GQA)",
        )
    if pp > 1 and "gradient_accumulation_steps" not in given:
        m = 4 * pp
        chosen["gradient_accumulation_steps"] = (
            m,
            f"4 x pp microbatches keep the pipeline bubble, (pp - 1) / "
            f"(m + pp - 1), at {(pp - 1) / (m + pp - 1):.0%}",
        )
    return chosen


def literal(value):
    return json.dumps(value) if isinstance(value, str) else repr(value)


def settings_block(cfg, given, chosen):
    """The asked-for and chosen settings under their banners, each with its meaning."""
    lines, current = [], None
    for s in settings.TRAINING:
        if s.name not in given and s.name not in chosen:
            continue
        if s.section != current:
            current = s.section
            lines.append(f"\n# {current}")
        why = f" ({chosen[s.name][1]})" if s.name in chosen else ""
        lines.append(f"{s.name} = {literal(cfg[s.name])}  # {s.meaning}{why}")
    lines.append("\n# every other setting keeps its default: python train.py --help lists them all")
    return "\n".join(lines).lstrip("\n")


def plan_of(cfg, model_cfg, layout, act_bytes, device):
    """memory_plan.plan_memory of a layout (a dict of LAYOUT_SETTINGS) for cfg's model and batch;
    device: where attention runs, which decides whether it keeps its scores."""
    return memory_plan.plan_memory(
        model_cfg,
        layout["dp"],
        layout["tp"],
        layout["pp"],
        layout["cp"],
        layout["zero_stage"],
        layout["batch_size"],
        cfg["block_size"],
        layout["gradient_accumulation_steps"],
        layout["pp_schedule"],
        layout["activation_checkpointing"],
        cfg["chunked_loss"],
        layout["sequence_parallel"],
        cfg["bucket_size_mb"],
        act_bytes=act_bytes,
        chunks=layout["pp_chunks"],
        ep=layout["ep"],
        optimizer=cfg["optimizer"],
        pp_layers=cfg["pp_layers"],
        attention_scores=memory_plan.attention_saves_scores(
            model_cfg, cfg["attn_impl"], device, cfg["dtype"]
        ),
    )


def summary_lines(cfg, launch, mc, vocab_source, dp):
    """The header's lines on the model (mc, its ModelConfig), the layout, the batch, the run and its
    launch."""
    n_params, n_embedding = count_parameters(mc)
    sequences = cfg["batch_size"] * cfg["gradient_accumulation_steps"] * dp
    tokens_per_step = sequences * cfg["block_size"]
    total_tokens = tokens_per_step * cfg["max_iters"]
    layout = (
        f"dp {dp} x "
        + (f"cp {cfg['cp']} x " if cfg["cp"] > 1 else "")
        + f"tp {cfg['tp']}"
        + (" (sequence parallel)" if cfg["sequence_parallel"] else "")
        + f" x pp {cfg['pp']}"
    )
    plural, tied = ("", "tied") if mc.tie_embeddings else ("s", "untied")
    return [
        f"model:  {n_params / 1e6:.2f}M parameters ({(n_params - n_embedding) / 1e6:.2f}M without "
        f"the embedding{plural}), {mc.n_layer} layers, width {mc.n_embd}, {mc.n_head} heads "
        f"({mc.n_kv_head} key/value) of size {attention_head_dim(mc)}",
        f"        vocabulary {mc.vocab_size} ({vocab_source}), {tied} input and output embeddings",
        f"layout: {cfg['nproc']} processes = {layout} (checked: the model splits this way)",
        f"batch:  {cfg['batch_size']} sequences x {cfg['gradient_accumulation_steps']} "
        f"micro-batches x {dp} data-parallel ranks = {sequences} sequences of "
        f"{cfg['block_size']} tokens = {tokens_per_step:,} tokens per step",
        f"run:    {cfg['max_iters']:,} steps = {total_tokens / 1e6:,.1f}M tokens, "
        f"{total_tokens / n_params:.3g} tokens per parameter "
        f"(Chinchilla's compute-optimal ratio is about 20)",
        f"launch: {launch[0]}",
        *(f"        {line}" for line in launch[1:]),
    ]


def make_config(cfg, given, argv, launch):
    """The config file's (header, settings); raises ValueError when the layout does not divide the
    model. launch: the lines that start the run (launch_lines)."""
    tp, pp, cp = cfg["tp"], cfg["pp"], cfg["cp"]
    dp = resolve_dp(cfg["nproc"], cfg["dp"], tp, pp, count_name="nproc", cp=cp, ep=cfg["ep"])
    chosen = choices(cfg, given, dp)
    cfg = dict(cfg, **{k: v for k, (v, _) in chosen.items()})
    vocab, vocab_source = step_time.vocab_size_of(cfg)
    model_cfg = ModelConfig(
        **{f.name: cfg[f.name] for f in fields(ModelConfig) if f.name != "vocab_size"},
        vocab_size=vocab,
    )
    check_layout(model_cfg, tp, pp, cp, cfg["sequence_parallel"], cfg["pp_chunks"], ep=cfg["ep"])
    check_schedule(cfg["pp_schedule"], pp, cfg["gradient_accumulation_steps"], cfg["pp_chunks"])
    lines = summary_lines(cfg, launch, model_cfg, vocab_source, dp)
    if pp > 1:  # the stages' cut and each rank's share of the work, as train.py prints them
        cut = build.stage_cut(model_cfg, cfg["pp_schedule"], pp, cfg["pp_chunks"], cfg["pp_layers"])
        costs = metrics.pipeline_costs(model_cfg)
        m, chunks = cfg["gradient_accumulation_steps"], cfg["pp_chunks"]
        lines += describe_pipeline(cfg["pp_schedule"], pp, m, chunks, cut, costs).splitlines()
    act_bytes = memory_plan.compute_bytes(cfg["dtype"], cfg["device"])
    plan = plan_of(cfg, model_cfg, dict(cfg, dp=dp), act_bytes, cfg["device"])
    lines += memory_plan.format_plan(plan, cfg["gpu_mem_gib"] or None).splitlines()
    header = f"# Written by: python tools/make_config.py {' '.join(argv)}\n#\n"
    header += "".join(f"# {line}\n" for line in lines)
    return header, settings_block(cfg, given, chosen) + "\n", chosen


# -----------------------------------------------------------------------------
# --choose: every layout of nproc devices that fits, ranked by its predicted step time
# (tools/step_time.py)

LAYOUT_SETTINGS = (
    "dp",
    "tp",
    "pp",
    "cp",
    "ep",
    "zero_stage",
    "pp_schedule",
    "pp_chunks",
    "batch_size",
    "gradient_accumulation_steps",
    "activation_checkpointing",
    "sequence_parallel",
)


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def held_or(cfg, given, name, options):
    """A layout setting's options: the value given on the command line (held), else every one of
    options."""
    return [cfg[name]] if name in given else options


def grids(cfg, given, model_cfg, gpus_per_node):
    """(dp, tp, pp, cp, sequence_parallel) of every cut of nproc that divides the model
    (settings.check_layout), tp within a node unless --tp is given, cp at most 8, sequence
    parallelism on wherever tp > 1 allows it (it moves the same bytes as tp alone and holds less).
    """
    nproc = cfg["nproc"]
    held = functools.partial(held_or, cfg, given)
    for tp, pp, cp in itertools.product(
        held("tp", [d for d in divisors(nproc) if d <= gpus_per_node]),
        held("pp", [d for d in divisors(nproc) if d <= model_cfg.n_layer]),
        held("cp", [d for d in divisors(nproc) if d <= 8]),
    ):
        if nproc % (tp * pp * cp):
            continue
        for sp in held("sequence_parallel", [True, False] if tp > 1 else [False]):
            try:
                check_layout(model_cfg, tp, pp, cp, sp, 1)
            except ValueError:
                continue
            yield nproc // (tp * pp * cp), tp, pp, cp, sp
            break  # sequence parallelism where it divides, else without


def candidates(cfg, given, model_cfg, global_batch, gpus_per_node):
    """Every layout (a dict of LAYOUT_SETTINGS) of nproc devices for global_batch sequences per
    step: the grids, expert parallelism over divisors of dp, ZeRO 0 to 3, micro-batches that divide
    each replica's sequences, the schedules (pp > 1: 1f1b, interleaved_1f1b over 2 chunks,
    zero_bubble, zbv), activation checkpointing off and on; each that
    pipeline_schedules.check_schedule and settings.check_layout accept."""
    held = functools.partial(held_or, cfg, given)
    for dp, tp, pp, cp, sp in grids(cfg, given, model_cfg, gpus_per_node):
        if global_batch % dp:
            continue
        per_replica = global_batch // dp
        eps = (
            [d for d in divisors(dp) if model_cfg.n_expert % d == 0] if model_cfg.n_expert else [1]
        )
        schedules = (
            [(cfg["pp_schedule"], cfg["pp_chunks"])]
            if "pp_schedule" in given
            else [("1f1b", 1)]
            + ([("interleaved_1f1b", 2), ("zero_bubble", 1), ("zbv", 2)] if pp > 1 else [])
        )
        for ep, zero, b, (schedule, chunks), ac in itertools.product(
            held("ep", eps),
            held("zero_stage", [0, 1, 2, 3] if dp * cp > 1 else [0]),
            held("batch_size", [d for d in divisors(per_replica) if d <= 32]),
            schedules,
            held("activation_checkpointing", [False, True]),
        ):
            if per_replica % b:
                continue
            try:
                check_schedule(schedule, pp, per_replica // b, chunks)
                check_layout(model_cfg, tp, pp, cp, sp, chunks, ep=ep)
            except ValueError:
                continue
            yield dict(
                dp=dp,
                tp=tp,
                pp=pp,
                cp=cp,
                ep=ep,
                zero_stage=zero,
                pp_schedule=schedule,
                pp_chunks=chunks,
                batch_size=b,
                gradient_accumulation_steps=per_replica // b,
                activation_checkpointing=ac,
                sequence_parallel=sp,
            )


def states_bytes(model_cfg, layout):
    """A lower bound on a rank's bytes, to skip a layout before planning it: its stage's parameters
    (fp32), gradients and AdamW's two moments, shared as the ZeRO stage shares them (16 bytes a
    parameter at ZeRO-0)."""
    block, root = step_time.parameter_pieces(model_cfg, layout["tp"], layout["ep"])
    params = (sum(block.values()) * model_cfg.n_layer + sum(root.values())) / layout["pp"]
    n = layout["dp"] * layout["cp"]
    per_param = {0: 16, 1: 8 + 8 / n, 2: 4 + 12 / n, 3: 16 / n}[layout["zero_stage"]]
    return params * per_param


def plan_peak(cfg, model_cfg, layout, act_bytes):
    """The largest rank's predicted peak bytes (memory_plan.plan_memory) of a layout on a GPU."""
    return max(stage["peak"] for stage in plan_of(cfg, model_cfg, layout, act_bytes, "cuda"))


def choose(cfg, given, model_cfg):
    """[(prediction, layout, peak bytes)] of the fastest ten layouts that fit, fastest first, and
    how many were ranked; raises ValueError when none fits."""
    machine = machine_of(cfg)
    gpus_per_node, _ = gpus_per_node_of(cfg)
    limit = (cfg["gpu_mem_gib"] or machine["memory_gib"]) * 2**30
    dp = resolve_dp(
        cfg["nproc"],
        cfg["dp"],
        cfg["tp"],
        cfg["pp"],
        count_name="nproc",
        cp=cfg["cp"],
        ep=cfg["ep"],
    )
    global_batch = (
        cfg["global_batch"] or cfg["batch_size"] * cfg["gradient_accumulation_steps"] * dp
    )
    ranked = []
    for layout in candidates(cfg, given, model_cfg, global_batch, gpus_per_node):
        if states_bytes(model_cfg, layout) <= limit:
            run = step_time.run_of({**cfg, **layout})
            ranked.append((step_time.predict(model_cfg, run, machine, gpus_per_node), layout))
    # equal times (the model sees no difference) go to the simpler layout: fewer axes, less
    # sharding, no recomputation, fewer and larger micro-batches
    ranked.sort(
        key=lambda pair: (
            round(pair[0]["step_s"], 9),
            pair[1]["cp"],
            pair[1]["pp"],
            pair[1]["tp"],
            pair[1]["zero_stage"],
            pair[1]["activation_checkpointing"],
            -pair[1]["batch_size"],
        )
    )
    best = []
    act_bytes = memory_plan.compute_bytes(
        step_time.dtype_of(step_time.run_of(cfg), machine), "cuda"
    )
    for prediction, layout in ranked:
        peak = plan_peak(cfg, model_cfg, layout, act_bytes)
        if peak <= limit:
            best.append((prediction, layout, peak))
        if len(best) == 10:
            break
    if not best:
        raise ValueError(
            f"no layout of nproc = {cfg['nproc']} devices fits {limit / 2**30:g} GiB at "
            f"global_batch = {global_batch} sequences ({len(ranked)} ranked): use more devices, a "
            f"machine with more memory, or a smaller global_batch or block_size"
        )
    return best, len(ranked), global_batch


def format_choice(best, count, global_batch, nproc, machine):
    """The ranked list as lines: each layout, its step and where its time goes."""
    lines = [
        f"{count} layouts of {nproc} devices for {global_batch} sequences per step ranked on "
        f"{machine}; the fastest {len(best)} that fit memory:"
    ]
    for i, (p, layout, peak) in enumerate(best):
        shown = {k: v for k, v in p["parts"].items() if v > 0.005 * p["step_s"]}
        sp = " (sp)" if layout["sequence_parallel"] else ""
        schedule = f"{layout['pp_schedule']} x{layout['pp_chunks']}, " if layout["pp"] > 1 else ""
        checkpointed = ", checkpointed" if layout["activation_checkpointing"] else ""
        lines.append(
            f"{i + 1:2d}. {p['step_s'] * 1e3:9.4g} ms  dp {layout['dp']} cp {layout['cp']} "
            f"tp {layout['tp']}{sp} pp {layout['pp']} ep {layout['ep']}, {schedule}"
            f"ZeRO-{layout['zero_stage']}, micro-batch {layout['batch_size']} x "
            f"{layout['gradient_accumulation_steps']}{checkpointed}; {peak / 2**30:.1f} GiB; MFU "
            f"{metrics.format_mfu(p['mfu'])}\n      "
            + ", ".join(f"{k} {v / p['step_s']:.0%}" for k, v in shown.items())
        )
    return "\n".join(lines)


def main(argv):
    try:
        values, given = configure(settings.TRAINING + OWN, argv, usage=__doc__)
        warnings = settings.check_values(values)
        step_time.check_counts(values)
        launch = launch_lines(values)  # before --choose: a count that fills no nodes stops here
        ranking = ""
        # every layout ranked; the fastest that fits written, every layout setting with it
        if values["choose"]:
            best, count, global_batch = choose(values, given, model_config_of(values))
            ranking = format_choice(best, count, global_batch, values["nproc"], values["machine"])
            values.update(best[0][1])
            # dtype=auto resolved and written out: the plan below counts the activations in it
            if values["dtype"] == "auto":
                values["dtype"] = step_time.dtype_of(
                    step_time.run_of(values), machines.load_machine(values["machine"])
                )
            given = set(given) | set(LAYOUT_SETTINGS) | {"dtype"}
        header, body, chosen = make_config(values, given, argv, launch)
        out, existed = values["out"], os.path.exists(values["out"])
        if existed and not values["force"]:
            raise ConfigError(
                f"out = {out!r} exists: choose another --out, or pass --force=True to overwrite it"
            )
        try:
            if os.path.dirname(out):
                os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(out, "w") as f:
                f.write(header + "\n" + body)
        except OSError as e:
            raise ConfigError(
                f"out = {out!r} cannot be written ({e.strerror}): choose another --out"
            )
    except (ConfigError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(
        "\n".join(
            warnings
            + ([ranking] if ranking else [])
            + [line[2:] for line in header.splitlines()[2:]]
        )
    )
    for name, (value, why) in chosen.items():
        print(f"chose {name} = {value}: {why}")
    # the default --out is relative to the current folder: say where the file went
    where = out if os.path.isabs(out) else f"{out} ({os.path.abspath(out)})"
    print(
        f"{'overwrote' if existed else 'wrote'} {where}"
        + ("" if "out" in given else ": the default --out; --out=PATH writes elsewhere")
    )


if __name__ == "__main__":
    main(sys.argv[1:])
