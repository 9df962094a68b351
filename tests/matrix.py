"""The equivalence matrix: the declared list of layouts that tests/test_matrix.py trains against one
process.

Each case is a layout (dp, tp with or without sequence parallelism, cp, pp with a schedule, ep, the
ZeRO stage) and a feature set (the optimizer, the model, document masking, activation checkpointing,
gradient accumulation). The cases are not picked by hand: `pairwise_cases` chooses them greedily so
that every value of every axis and every pair of values of two axes is in at least one case (a
pairwise covering set, as AETG and PICT build them), among the combinations picotron accepts on 2 to
4 processes. A pair that only combinations picotron refuses can hold (Muon with ZeRO-3, say) is
covered by a refused case instead, one that breaks that rule alone: it must be refused with the
rule's message. After them come a few larger cases by name (8 ranks, dp=4), float64 runs held to
1e-12, FP8 runs (fp8.py), and runs resumed at another layout mid-run.

    python tests/matrix.py                                   the cases, one a line, what they cover
    python -m pytest tests/test_matrix.py [--write-matrix]   run them (and rewrite the page
                                                             docs/equivalence.md)

Every case trains STEPS steps of a tiny model on data with short documents, evaluates at steps 3 and
6 and saves at both; its one-process reference (reference_values) sees the same global batch.
"""

import itertools
import json
import os
import shutil
import sys
import time
import traceback
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np

from dist_utils import FLOAT64_RTOL, FP8_RTOL, GRAD_NORM_RTOL, LOSS_RTOL, WEIGHT_RTOL

ROOT = Path(__file__).resolve().parent.parent
STEPS, RESUME_AT = 6, 3

# -----------------------------------------------------------------------------
# the axes and what picotron refuses

AXES = {
    "dp": (1, 2),
    "tp": (1, 2),
    "sp": (False, True),  # sequence parallelism (needs tp > 1)
    "cp": (1, 2),
    # 1: no pipeline; a schedule: pp=2
    "pp": (1, "afab", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"),
    "ep": (1, 2),
    "zero_stage": (0, 1, 2, 3),
    "optimizer": ("adamw", "muon"),
    "model": ("dense_gqa", "tied_layernorm_gelu", "mla", "moe_capacity", "moe_dropless"),
    "doc_mask": (False, True),
    "activation_checkpointing": (False, True),
    "gradient_accumulation_steps": (1, 2),  # micro-batches per data-parallel rank
}

# the tiny model every case trains: 4 blocks (interleaved 1F1B and ZB-V cut it into 2 x 2 chunks)
BASE = dict(n_layer=4, n_embd=32, n_head=4, block_size=16, batch_size=2, intermediate_size=64)
MODELS = {
    "dense_gqa": dict(n_kv_head=2, tie_embeddings=False),
    # (without biases: the key projection's bias has a zero gradient in exact arithmetic, as it adds
    # the same q.b to every score of a query, and AdamW's normalised step turns its rounding into
    # full-size updates)
    "tied_layernorm_gelu": dict(n_kv_head=4, tie_embeddings=True, norm="layernorm", mlp="gelu"),
    "mla": dict(
        n_kv_head=4,
        attention="mla",
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=8,
    ),
    # capacity: an expert takes at most ceil(1.0 * tokens * 2 / 4) assignments, so some are dropped
    "moe_capacity": dict(
        n_kv_head=2,
        n_expert=4,
        n_expert_per_token=2,
        capacity_factor=1.0,
        n_shared_expert=1,
        aux_loss_coef=0.01,
        router_z_loss_coef=1e-3,
    ),
    # dropless and without the auxiliary losses: then nothing depends on how the batch is cut into
    # micro-batches (reference_values), and the evaluation compares at every dp
    "moe_dropless": dict(
        n_kv_head=2,
        n_expert=4,
        n_expert_per_token=1,
        capacity_factor=0.0,
        aux_loss_coef=0.0,
        router_z_loss_coef=0.0,
    ),
}
MODEL_NAMES = {
    "dense_gqa": "dense GQA",
    "tied_layernorm_gelu": "tied LayerNorm/GELU",
    "mla": "MLA",
    "moe_capacity": "MoE capacity",
    "moe_dropless": "MoE dropless",
}


def is_moe(case):
    return case["model"].startswith("moe")


def pp_size(case):
    return 1 if case["pp"] == 1 else 2


def world_size(case):
    return case["dp"] * case["tp"] * case["cp"] * pp_size(case)


# What picotron refuses, in the order it checks (build.setup, pipeline_schedules.check_schedule and
# resolve_dp, settings.check_layout), each with the words its message must contain.
REFUSALS = [
    (
        lambda c: c["pp"] == "zbv" and c.get("pp_chunks", 2) != 2,
        "pp_schedule='zbv' holds two model chunks",
    ),
    (
        lambda c: c["pp"] == "interleaved_1f1b" and c["gradient_accumulation_steps"] % pp_size(c),
        "pp_schedule='interleaved_1f1b' needs gradient_accumulation_steps",
    ),
    (lambda c: c["dp"] % c["ep"], "ep = 2 must divide dp = 1"),
    (lambda c: c["sp"] and c["tp"] == 1, "sequence_parallel=True needs tp > 1"),
    (
        lambda c: c["ep"] > 1 and not is_moe(c),
        "spreads the experts of a mixture of experts over ranks, but n_expert = 0",
    ),
]


def refusals(case):
    """The messages of the rules the case breaks, in picotron's order (the first is the one it must
    give)."""
    return [message for broken, message in REFUSALS if broken(case)]


# -----------------------------------------------------------------------------
# the pairwise covering set


def value_pairs(case):
    """Every pair of (axis, value) of two axes that the case holds."""
    items = [(axis, case[axis]) for axis in AXES]
    return set(itertools.combinations(items, 2))


ALL_PAIRS = {
    pair
    for a, b in itertools.combinations(AXES, 2)
    for pair in itertools.product([(a, v) for v in AXES[a]], [(b, v) for v in AXES[b]])
}


def pairwise_cases(max_world=4):
    """(run, refused): the greedy covering set. Candidates are every combination of the axes' values
    on 2 to max_world processes. Each pick is the candidate that covers the most pairs not yet
    covered (ties: the fewer processes, then the first in AXES order), until every pair some
    accepted candidate holds is covered; then the same among candidates that break exactly one rule,
    for the pairs only refused combinations hold."""
    candidates = [dict(zip(AXES, values)) for values in itertools.product(*AXES.values())]
    candidates = [c for c in candidates if 2 <= world_size(c) <= max_world]
    index = {pair: i for i, pair in enumerate(sorted(ALL_PAIRS, key=repr))}
    mask = lambda c: sum(1 << index[p] for p in value_pairs(c))

    def cover(pool, wanted):
        masks, chosen = [mask(c) for c in pool], []
        while wanted:
            best = max(
                range(len(pool)),
                key=lambda i: ((masks[i] & wanted).bit_count(), -world_size(pool[i]), -i),
            )
            if not masks[best] & wanted:
                break
            chosen.append(pool[best])
            wanted &= ~masks[best]
        return chosen, wanted

    accepted = [c for c in candidates if not refusals(c)]
    reachable = 0
    for c in accepted:
        reachable |= mask(c)
    run, _ = cover(accepted, reachable)
    refused, left = cover(
        [c for c in candidates if len(refusals(c)) == 1], ((1 << len(index)) - 1) & ~reachable
    )
    assert not left, "a pair no candidate holds"
    return run, refused


# -----------------------------------------------------------------------------
# the declared cases


def _case(**values):
    """A case by what it changes from one process, ZeRO off, AdamW, the dense model, one
    micro-batch."""
    case = {
        "dp": 1,
        "tp": 1,
        "sp": False,
        "cp": 1,
        "pp": 1,
        "ep": 1,
        "zero_stage": 0,
        "optimizer": "adamw",
        "model": "dense_gqa",
        "doc_mask": False,
        "activation_checkpointing": False,
        "gradient_accumulation_steps": 1,
    }
    case.update(values)
    return case


RUN, REFUSED = pairwise_cases()

# larger layouts, by name: the dp=4 with ZeRO-1/2/3 and ep=2, and the 3-D layouts at 8 ranks
NAMED = {
    "dp4-ep2-zero1": _case(
        dp=4, ep=2, zero_stage=1, model="moe_capacity", gradient_accumulation_steps=2
    ),
    "dp4-ep2-zero2": _case(dp=4, ep=2, zero_stage=2, model="moe_dropless", doc_mask=True),
    "dp4-ep2-zero3": _case(
        dp=4, ep=2, zero_stage=3, model="moe_capacity", activation_checkpointing=True
    ),
    "dp2-tp2-pp2": _case(
        dp=2,
        tp=2,
        sp=True,
        pp="1f1b",
        zero_stage=3,
        model="tied_layernorm_gelu",
        activation_checkpointing=True,
        gradient_accumulation_steps=2,
    ),
    "cp2-tp2-pp2": _case(
        cp=2,
        tp=2,
        sp=True,
        pp="interleaved_1f1b",
        model="dense_gqa",
        doc_mask=True,
        gradient_accumulation_steps=2,
    ),
    "dp2-cp2-pp2-zbv-ep2": _case(
        dp=2,
        cp=2,
        pp="zbv",
        ep=2,
        zero_stage=2,
        model="moe_dropless",
        gradient_accumulation_steps=2,
    ),
    # Muon's ZeRO-1 deals whole matrices to the replicas, each split between its two tp ranks
    "muon-dp2-tp2-zero1": _case(dp=2, tp=2, zero_stage=1, optimizer="muon", model="dense_gqa"),
    # Muon at every ZeRO stage, the experts' matrices dealt over the ranks holding them (ZeRO-3:
    # each matrix stored, gathered and stepped by its owner): what the pairwise rows leave out
    "muon-dp2-zero1-ep2": _case(dp=2, ep=2, zero_stage=1, optimizer="muon", model="moe_dropless"),
    "muon-dp2-tp2-zero2": _case(
        dp=2, tp=2, zero_stage=2, optimizer="muon", gradient_accumulation_steps=2
    ),
    "muon-cp2-zero3": _case(cp=2, zero_stage=3, optimizer="muon", doc_mask=True),
    "muon-dp2-zero3-ep2": _case(
        dp=2,
        ep=2,
        zero_stage=3,
        optimizer="muon",
        model="moe_capacity",
        gradient_accumulation_steps=2,
    ),
    "muon-dp2-tp2-zero3-ep2": _case(
        dp=2,
        tp=2,
        sp=True,
        ep=2,
        zero_stage=3,
        optimizer="muon",
        model="moe_dropless",
        activation_checkpointing=True,
    ),
    # everything in float64 (model, collectives, optimizer): layouts agree to 1e-13 at most, held to
    # 1e-12
    "float64-tp2-sp-muon": _case(
        tp=2, sp=True, optimizer="muon", model="moe_dropless", dtype="float64"
    ),
    "float64-dp2-zero1-pp2-zbv": _case(
        dp=2,
        pp="zbv",
        zero_stage=1,
        model="tied_layernorm_gelu",
        dtype="float64",
        gradient_accumulation_steps=2,
    ),
    "float64-cp2-tp2-mla": _case(cp=2, tp=2, sp=True, model="mla", doc_mask=True, dtype="float64"),
    # the layout whose fp32 weights part most from one process (tests/dist_utils.py): exact in
    # float64
    "float64-dp2-tp2-ep2-zero3": _case(
        dp=2, tp=2, sp=True, ep=2, zero_stage=3, model="moe_dropless", dtype="float64"
    ),
    # FP8 (fp8.py) against one process with fp8 on: each layout splits or joins what a scale reduces
    # over. Under a pipeline, tensorwise flips FP8 roundings more (its scale, 448 / amax, moves with
    # the last bit of amax, rowwise's power of two does not): one flipped element moves a 32 x 32
    # gradient by ~1e-3
    "fp8-tp2": _case(tp=2, fp8="tensorwise"),
    "fp8-tp2-pp2-1f1b": _case(tp=2, pp="1f1b", fp8="rowwise", gradient_accumulation_steps=2),
    "fp8-tp2-sp-cp2": _case(tp=2, sp=True, cp=2, fp8="tensorwise", doc_mask=True),
    "fp8-dp2-zero1-pp2-zbv": _case(
        dp=2, zero_stage=1, pp="zbv", fp8="rowwise", gradient_accumulation_steps=2
    ),
    "fp8-dp2-zero3-ep2": _case(dp=2, zero_stage=3, ep=2, model="moe_dropless", fp8="tensorwise"),
}
# refusals no pair brings out: a setting the generator never varies
NAMED_REFUSED = {
    "zbv-pp_chunks1": _case(pp="zbv", pp_chunks=1),
}


def _first(cases, **wanted):
    """The first generated case with these values (the resumed runs start from one)."""
    found = [name for name, c in cases.items() if all(c[k] == v for k, v in wanted.items())]
    assert found, f"no generated case has {wanted}"
    return found[0]


CASES = {f"pairwise-{i + 1:02d}": case for i, case in enumerate(RUN)}
CASES.update(NAMED)
CASES.update({f"refused-{i + 1}": case for i, case in enumerate(REFUSED)})
CASES.update(NAMED_REFUSED)
for case in CASES.values():
    case["refused"] = refusals(case)[0] if refusals(case) else None

# Resumed runs: the case's step-3 checkpoint resumed at another layout (the same global batch) to
# step 6. One at one process (after every launch), the others at a world size whose launch comes
# after the first run's (launches go 2, 4, 8 processes; a launch runs its own cases before its
# resumed ones).
RESUMES = {  # name: (the first run, the layout its step-3 checkpoint resumes at)
    "resume-1": (
        "dp2-tp2-pp2",
        dict(dp=1, tp=1, sp=False, pp=1, zero_stage=0, activation_checkpointing=False),
    ),
    "resume-2": (
        _first(CASES, zero_stage=3, dp=2, cp=1, optimizer="adamw", ep=1),
        dict(dp=1, tp=1, sp=False, cp=2, pp="zbv", zero_stage=0),
    ),
    "resume-3": (
        _first(CASES, ep=2, gradient_accumulation_steps=2),
        dict(dp=4, tp=1, sp=False, cp=1, pp=1, ep=4, zero_stage=1),
    ),
    "resume-4": (
        _first(CASES, cp=2, dp=1, ep=1, optimizer="adamw", gradient_accumulation_steps=2),
        dict(dp=2, cp=1, tp=2, sp=True, pp="1f1b", zero_stage=1),
    ),
    "resume-5": ("muon-dp2-tp2-zero1", dict(dp=1, tp=1, zero_stage=0)),
    # a ZeRO-3 Muon checkpoint (each matrix and its momentum saved by its owner alone) at one
    # process, and at ZeRO-1 with the experts' matrices dealt over every data-parallel rank
    "resume-6": ("muon-dp2-zero3-ep2", dict(dp=1, ep=1, zero_stage=0)),
    "resume-7": ("muon-dp2-zero3-ep2", dict(dp=2, ep=1, zero_stage=1)),
}
for name, (source, layout) in RESUMES.items():
    case = {**CASES[source], **layout, "resume_from": source, "refused": None}
    # the same global batch: batch_size is fixed, so the micro-batches per rank follow dp
    microbatches = CASES[source]["gradient_accumulation_steps"] * CASES[source]["dp"]
    case["gradient_accumulation_steps"] = microbatches // case["dp"]
    assert not refusals(case), (name, refusals(case))
    CASES[name] = case
for name, case in CASES.items():
    if "resume_from" in case:
        source = world_size(CASES[case["resume_from"]])
        assert world_size(case) == 1 or world_size(case) >= source, (
            f"{name}: resumed before its run exists"
        )


# -----------------------------------------------------------------------------
# settings: the case, and its one-process reference


def settings_of(case):
    """The case's train.py settings (BASE, the model, the layout)."""
    values = {**BASE, **MODELS[case["model"]]}
    pp = pp_size(case)
    values.update(
        dp=case["dp"],
        tp=case["tp"],
        sequence_parallel=case["sp"],
        cp=case["cp"],
        pp=pp,
        ep=case["ep"],
        zero_stage=case["zero_stage"],
        optimizer=case["optimizer"],
        doc_mask=case["doc_mask"],
        activation_checkpointing=case["activation_checkpointing"],
        gradient_accumulation_steps=case["gradient_accumulation_steps"],
    )
    if pp > 1:
        values["pp_schedule"] = case["pp"]
        values["pp_chunks"] = case.get(
            "pp_chunks", 2 if case["pp"] in ("interleaved_1f1b", "zbv") else 1
        )
    if "dtype" in case:
        values["dtype"] = case["dtype"]
    if "fp8" in case:
        values["fp8"] = case["fp8"]
    return values


def reference_values(case):
    """One process on the case's global batch, batch_size x gradient_accumulation_steps x dp
    windows. A mixture with capacity drops tokens per micro-batch and its auxiliary loss is per
    micro-batch, so its reference keeps batch_size and runs dp times the micro-batches (replica r's
    are the reference's r * g .. r * g + g - 1), and so does an FP8 run (a scale is per micro-batch,
    as fp8.py says); every other model takes the whole step in dp times larger micro-batches. The
    evaluation takes whole global batches in micro-batches of batch_size (train.evaluate), so it
    compares either way."""
    values = settings_of(case)
    dp = case["dp"]
    values.update(
        dp=1,
        tp=1,
        sequence_parallel=False,
        cp=1,
        pp=1,
        ep=1,
        zero_stage=0,
        activation_checkpointing=False,
    )
    values.pop("pp_schedule", None), values.pop("pp_chunks", None)
    if case["model"] == "moe_capacity" or "fp8" in case:
        values["gradient_accumulation_steps"] *= dp
    else:
        values["batch_size"] *= dp
    return values


def argv_of(values, data_dir, out_dir, resume=False):
    """train.py's command line for these settings."""
    run = dict(
        device="cpu",
        max_iters=STEPS,
        log_interval=1,
        eval_interval=RESUME_AT,
        eval_iters=2,
        checkpoint_interval=RESUME_AT,
        warmup_iters=2,
        lr_decay_iters=10,
        learning_rate=3e-3,
        min_lr=1e-4,
        # tiny buckets: several per step, launched in hook order
        bucket_size_mb=0.01,
        seed=1234,
        peak_flops=1e12,
        dist_timeout_s=120.0,
        data_dir=data_dir,
        out_dir=out_dir,
        init_from="resume" if resume else "scratch",
    )
    return [f"--{k}={v}" for k, v in {**run, **values}.items()]


# -----------------------------------------------------------------------------
# how a case is written in the page


def layout_text(case):
    """`dp=2 zero=1 tp=2 sp cp=2 pp=2 zbv ep=2`: the axes above 1."""
    parts = [f"dp={case['dp']}"] if case["dp"] > 1 else []
    parts += [f"zero={case['zero_stage']}"] if case["zero_stage"] else []
    parts += [f"tp={case['tp']}"] if case["tp"] > 1 else []
    parts += ["sp"] if case["sp"] else []
    parts += [f"cp={case['cp']}"] if case["cp"] > 1 else []
    parts += [f"pp=2 {case['pp']}"] if case["pp"] != 1 else []
    parts += [f"pp_chunks={case['pp_chunks']}"] if "pp_chunks" in case else []
    parts += [f"ep={case['ep']}"] if case["ep"] > 1 else []
    return " ".join(parts) or "one process"


def features_text(case):
    parts = [MODEL_NAMES[case["model"]], case["optimizer"]]
    parts += ["doc_mask"] if case["doc_mask"] else []
    parts += ["checkpointing"] if case["activation_checkpointing"] else []
    parts += (
        [f"accumulation {case['gradient_accumulation_steps']}"]
        if case["gradient_accumulation_steps"] > 1
        else []
    )
    parts += [case["dtype"]] if "dtype" in case else []
    parts += [f"fp8 {case['fp8']}"] if "fp8" in case else []
    return ", ".join(parts)


def coverage():
    """(pairs of values in all, covered by a run, covered only by a refused case)."""
    ran = set().union(*(value_pairs(c) for c in RUN))
    refused = set().union(*(value_pairs(c) for c in REFUSED)) - ran
    return len(ALL_PAIRS), len(ran & ALL_PAIRS), len(refused & ALL_PAIRS)


PAGE_HEADER = (
    "| case | layout | features | loss | grad norm | eval | weights | optimizer state | result |"
)


def write_page(path, results, seconds=None):
    """docs/equivalence.md: one row per case, with the largest relative differences it measured."""
    total, ran, refused = coverage()
    tol = lambda t: f"{t:.0e}".replace("e-0", "e-")
    fmt = lambda v: "n/a" if v is None else f"{v:.1e}"
    lines = [
        "# The equivalence matrix",
        "",
        "Every row is a layout that `tests/test_matrix.py` trains on CPU (gloo) against one "
        f"process on the same global batch, {STEPS} steps of a tiny model: the loss of every step "
        f"(tolerance {tol(LOSS_RTOL)} relative), the global gradient norm of every step "
        f"({tol(GRAD_NORM_RTOL)}), the evaluated train and val losses at steps 3 and 6 "
        f"({tol(LOSS_RTOL)}), the final weights and the optimizer's final state per tensor by "
        f"||a - b|| / ||b|| ({tol(WEIGHT_RTOL)}; tests/dist_utils.py says why). The float64 rows "
        f"are held to {tol(FLOAT64_RTOL)} on all of them. The fp8 rows compare with one process "
        f"with the same recipe (fp8.py), its losses held to {tol(FP8_RTOL['loss'])} and gradient "
        f"norms to {tol(FP8_RTOL['grad_norm'])}: where two layouts' fp32 sums differ in their last "
        "bit an FP8 rounding may flip; fp8 itself moves this model's loss from the fp32 run's far "
        "more (docs/training.md#fp8). The pipeline's fp8 rows run rowwise: tensorwise's scale "
        "moves with an amax's last bit and flips more (there one process parts from itself as far, "
        "given another attention kernel). The numbers are each row's largest relative difference "
        "(n/a: not measured: a refused case).",
        "",
        "The pairwise rows are generated (tests/matrix.py, `pairwise_cases`): every value of every "
        f"axis and every pair of values of two axes is in one of them, {ran} of the {total} pairs "
        f"in a run and the {refused} that picotron refuses in a refused row, which passes when "
        "picotron stops with that rule's message. Then the larger layouts by name, float64, and "
        "runs resumed at another layout at step 3.",
        "",
        "Regenerate: `python -m pytest tests/test_matrix.py --write-matrix`"
        + (f" (last run: {seconds / 60:.1f} minutes on a 2-core machine)." if seconds else "."),
        "",
        PAGE_HEADER,
        "|---" * (PAGE_HEADER.count("|") - 1) + "|",
    ]
    for name, case in CASES.items():
        r = results.get(name, {})
        if case["refused"]:
            cells = [f"refused: {case['refused']}"] + [""] * 4
        else:
            cells = [fmt(r.get(k)) for k in ("loss", "grad_norm", "eval", "weights", "state")]
        lines.append("| " + " | ".join([*row_key(name), *cells, r.get("result", "not run")]) + " |")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")


def row_key(name):
    """(name, layout, features): what a row of the page says the case is. A resumed case's layout is
    the first run's, then the one it resumed at."""
    case = CASES[name]
    layout = layout_text(case)
    if "resume_from" in case:
        layout = f"{layout_text(CASES[case['resume_from']])} then {layout}"
    return name, layout, features_text(case)


def page_rows(path):
    """The (name, layout, features) of every row of the page's table."""
    rows = [
        line
        for line in Path(path).read_text().splitlines()
        if line.startswith("| ") and line != PAGE_HEADER
    ]
    return [tuple(cell.strip() for cell in row.split("|")[1:4]) for row in rows]


# -----------------------------------------------------------------------------
# data, and running the cases


def make_matrix_data(data_dir, n_tokens=20000, vocab_size=128, seed=0):
    """Token bins of short documents (3 to 12 tokens, each ended by the end-of-text id vocab_size -
    1), so that document masking cuts every window several times; tokens follow a simple pattern
    plus noise."""
    os.makedirs(data_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    eot = vocab_size - 1
    for split, n in (("train", n_tokens), ("val", n_tokens // 10)):
        tokens = np.where(rng.random(n) < 0.7, np.arange(n) % 97, rng.integers(0, eot, size=n))
        ends = np.cumsum(rng.integers(3, 13, size=n))
        tokens[ends[ends < n]] = eot
        tokens.astype(np.uint16).tofile(os.path.join(data_dir, f"{split}.bin"))
    meta = {
        "tokenizer": "gpt2",
        "vocab_size": vocab_size,
        "dtype": "uint16",
        "eot_token": eot,
        "train_tokens": n_tokens,
        "val_tokens": n_tokens // 10,
    }
    Path(data_dir, "meta.json").write_text(json.dumps(meta))
    return data_dir


def run_one(argv, copy_from=None, log_path=None):
    """train.py's run of argv in this process, on the process group already there (one case of a
    launch): configure_run, setup (which builds the layout's groups anew), train. copy_from: a
    checkpoint folder to put into out_dir first (a resumed case). Returns None, or the error's text
    ('Type: message', with the traceback after a blank line) on every rank that raised.

    The first step runs without train.py's memory measurement (metrics.measure_step_memory, which
    tests/test_memory.py tests): its tracker sees every tensor op of the step, which made the step
    30 times slower and the matrix 3 times; it only observes, so the numbers are the same."""
    import torch.distributed as dist

    import metrics
    import build
    import train

    rank = dist.get_rank() if dist.is_initialized() else 0
    out_dir = next(a.split("=", 1)[1] for a in argv if a.startswith("--out_dir="))
    if copy_from and rank == 0:
        shutil.copytree(copy_from, os.path.join(out_dir, os.path.basename(copy_from)))
    if dist.is_initialized():
        dist.barrier()
    measure = metrics.measure_step_memory
    metrics.measure_step_memory = lambda step, dev, compiled=False: step() or 0
    with open(log_path or os.devnull, "w") as log, redirect_stdout(log):
        try:
            cfg, _, resume_path = train.configure_run(argv)
            train.train(cfg, build.setup(cfg), resume_path)
            return None
        except Exception as e:  # a refusal (the message is checked), or a failure the test reports
            return f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}"
        finally:
            metrics.measure_step_memory = measure


def run_launch(rank, world_size, jobs):
    """One launch's cases in turn (tests/dist_utils.run_ranks calls it on every rank): jobs are
    (name, argv, checkpoint to copy or None, log path). Returns {name: (error or None, seconds)}.
    After a case that failed on some ranks only, the others fail too (their collectives time out:
    dist_timeout_s), and the launch goes on with the next case."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    results = {}
    for name, argv, copy_from, log_path in jobs:
        start = time.time()
        results[name] = run_one(argv, copy_from, log_path.format(rank=rank)), time.time() - start
        dist.barrier()
    return results


def main():
    total, ran, refused = coverage()
    for name, case in CASES.items():
        what = f"refused: {case['refused']}" if case["refused"] else features_text(case)
        print(f"{name:34s} {world_size(case)} ranks  {layout_text(case):34s} {what}")
    print(
        f"{len(CASES)} cases ({len(RUN)} pairwise, {len(REFUSED) + len(NAMED_REFUSED)} refused, "
        f"{len(NAMED)} named, {len(RESUMES)} resumed); {total} pairs of values: {ran} covered by a "
        f"run, {refused} by a refused case"
    )


if __name__ == "__main__":
    sys.exit(main())
