"""Expert parallelism (parallel.py section 6) and dropless routing against one process (CPU, gloo,
fp32).

Every layout (ep with dp, tp, pp, cp, ZeRO-1, activation checkpointing) trains the same tiny mixture
of experts for five steps with train.py's own build and step, and is compared with one process that
sees the same global batch: the layout's batch_size, with as many micro-batches as all the
data-parallel ranks together (capacity and the auxiliary losses are per micro-batch, so the
micro-batches must stay the same size). Compared: every step's loss and global gradient norm (a
factor-ep error in the experts' gradients barely moves the losses under AdamW and clipping, but
moves the norm), every gradient of step 1 (gathered from the ranks that hold it), the final weights,
the tokens each expert took in step 1 (integers: the same tokens dropped) and the all-to-all bytes
counted against the analytic figure for that routing. The numerics share one 2-rank and one 4-rank
launch; train.py runs one checkpoint chain across ep values.
"""

import shutil
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import metrics
import settings
from data import context_split, load_data, read_data_meta
import build
import train
from dist_utils import (
    GRAD_NORM_RTOL,
    LOSS_RTOL,
    assert_same_losses_and_norms,
    assert_same_tensors,
    checkpoint_weights,
    gather_full,
    gathered_parameters,
    make_token_data,
    run_ranks,
    train_in_process,
    train_on_ranks,
)
from settings import check_layout
from model import ModelConfig
from parallel import ParallelLayout, full_shape_of, resolve_dp, shard_of
from settings import format_grid

STEPS = 5
MODEL = dict(
    vocab_size=128,
    block_size=16,
    n_layer=2,
    n_head=2,
    n_kv_head=2,
    n_embd=32,
    n_expert=8,
    n_expert_per_token=2,
    capacity_factor=1.0,
    n_shared_expert=0,
    aux_loss_coef=0.01,
    router_z_loss_coef=1e-3,
)
RUN = dict(
    batch_size=2,
    learning_rate=3e-3,
    warmup_iters=2,
    lr_decay_iters=10,
    min_lr=1e-4,
    bucket_size_mb=0.01,
    attn_impl="sdpa",
    seed=1234,
    eval_iters=2,
)

# many experts for few tokens: in most micro-batches some expert of some rank gets no row (ZeRO-2/3
# must still reduce-scatter, and gather, in one order on every rank); three blocks, so that ZeRO-3's
# prefetched gathers interleave with the reduce-scatters
IDLE = dict(n_expert=32, n_expert_per_token=1, n_layer=3)
# name: (dp, tp, pp, ep, settings); the model settings override MODEL, the rest RUN.
# gradient_accumulation_steps is per rank: the reference runs dp times as many.
TWO_RANKS = {
    "ep2_capacity_top2_shared": (
        2,
        1,
        1,
        2,
        dict(n_shared_expert=1, gradient_accumulation_steps=2),
    ),
    "ep2_dropless_top1": (2, 1, 1, 2, dict(capacity_factor=0.0, n_expert_per_token=1)),
    "ep2_capacity_top1_checkpointing": (
        2,
        1,
        1,
        2,
        dict(n_expert_per_token=1, activation_checkpointing=True, gradient_accumulation_steps=2),
    ),
    "ep2_zero1_dropless": (
        2,
        1,
        1,
        2,
        dict(capacity_factor=0.0, zero_stage=1, gradient_accumulation_steps=2),
    ),
    # 32 experts, top-1, 64 assignments per micro-batch across the ep group: some get no token (IDLE
    # below)
    "ep2_zero2_idle": (2, 1, 1, 2, dict(IDLE, zero_stage=2, gradient_accumulation_steps=2)),
    "ep2_zero3_idle_checkpointing": (
        2,
        1,
        1,
        2,
        dict(IDLE, zero_stage=3, gradient_accumulation_steps=2, activation_checkpointing=True),
    ),
}
FOUR_RANKS = {
    "ep4_capacity_top2_shared": (4, 1, 1, 4, dict(n_shared_expert=1)),
    "ep4_dropless_top1": (4, 1, 1, 4, dict(capacity_factor=0.0, n_expert_per_token=1)),
    "ep2_dp4": (4, 1, 1, 2, dict(n_shared_expert=1)),
    "ep2_dp4_zero1": (4, 1, 1, 2, dict(n_shared_expert=1, zero_stage=1)),
    # expert replicas: the experts' gradients (and, at ZeRO-3, parameters) sharded over 2 ranks, the
    # rest over 4
    "ep2_dp4_zero2": (4, 1, 1, 2, dict(n_shared_expert=1, zero_stage=2)),
    "ep2_dp4_zero3_idle": (4, 1, 1, 2, dict(IDLE, zero_stage=3)),
    "ep2_tp2": (2, 2, 1, 2, dict(n_shared_expert=1, gradient_accumulation_steps=2)),
    "ep2_pp2": (2, 1, 2, 2, dict(gradient_accumulation_steps=4)),
    "ep2_pp2_zero_bubble": (
        2,
        1,
        2,
        2,
        dict(
            pp_schedule="zero_bubble",
            n_shared_expert=1,
            capacity_factor=0.0,
            gradient_accumulation_steps=4,
        ),
    ),
    "ep2_cp2": (2, 1, 1, 2, dict(cp=2, n_shared_expert=1, gradient_accumulation_steps=2)),
}
# a collapsed router (its weights zero: every token's scores tie, and top-k picks experts 2 and 3,
# rank 1's at ep = 2): rank 0's local experts get no row at all, and it sends and receives empty
# splits
COLLAPSED = dict(n_expert=4, n_expert_per_token=2, capacity_factor=1.0)
TWO_RANKS.update(
    {
        "ep2_collapsed_router": (2, 1, 1, 2, dict(COLLAPSED)),
        "ep2_zero3_collapsed_router": (
            2,
            1,
            1,
            2,
            dict(COLLAPSED, zero_stage=3, gradient_accumulation_steps=2),
        ),
    }
)
CASES = {**TWO_RANKS, **FOUR_RANKS}


def case_settings(name, reference=False):
    """(cfg, model_cfg, layout sizes) of a case; the reference: one process, dp times the
    micro-batches."""
    dp, tp, pp, ep, given = CASES[name]
    values = {
        **settings.DEFAULTS,
        **RUN,
        **{k: v for k, v in MODEL.items()},
        "gradient_accumulation_steps": 1,
        **given,
        "dp": dp,
        "tp": tp,
        "pp": pp,
        "ep": ep,
        "collapsed_router": "collapsed_router" in name,
    }
    if reference:
        values.update(
            dp=1,
            tp=1,
            pp=1,
            cp=1,
            ep=1,
            zero_stage=0,
            activation_checkpointing=False,
            gradient_accumulation_steps=dp * values["gradient_accumulation_steps"],
        )
    cfg = SimpleNamespace(**values)
    model_cfg = ModelConfig(**{k: values[k] for k in ModelConfig.__dataclass_fields__})
    return cfg, model_cfg


def global_microbatches(cfg, model_cfg, dp, step):
    """The step's global batch: dp * gradient_accumulation_steps micro-batches of batch_size
    sequences."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(
        0,
        model_cfg.vocab_size,
        (dp * cfg.gradient_accumulation_steps, cfg.batch_size, model_cfg.block_size + 1),
        generator=g,
    )
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


@torch.no_grad()
def large_experts(model, only=None, std=0.2):
    """Redraw every expert's weights (by name, the same full tensors at every layout; or those in
    `only`) ten times larger than the initialisation draws them: the experts' gradients are then a
    sizeable part of the gradient norm, so an expert gradient off by a factor moves the norm well
    past its tolerance."""
    for name, p in model.expert_parameters().items():
        if only is not None and not any(p is q for q in only):
            continue
        full = torch.randn(
            full_shape_of(p), generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))
        )
        p.copy_(shard_of(full * std, p))


@torch.no_grad()
def collapse_routers(model, only=None):
    """Zero every router's weights (or those in `only`): every token's expert scores tie."""
    for moe in model.moe_layers().values():
        if only is None or any(moe.router.weight is q for q in only):
            moe.router.weight.zero_()


def build_with_large_experts(cfg, model_cfg, layout, data_dir):
    """train.py's build on this rank, with data_dir's validation split to evaluate on, its experts
    made large (and its routers collapsed where cfg asks): (run, parts)."""
    meta = read_data_meta(data_dir)
    run = SimpleNamespace(
        dev=torch.device("cpu"),
        dtype=torch.float32,
        layout=layout,
        model_cfg=model_cfg,
        attn_impl=cfg.attn_impl,
        hf_dir=None,
        datasets={"val": load_data(data_dir, "val", cfg.block_size, model_cfg.vocab_size, meta)},
    )
    parts = build.build(cfg, run)
    # ZeRO-3: each unit gathered to be written, kept sliced
    sharded = parts.grad_sync if cfg.zero_stage == 3 else None
    for params in sharded.unit_by_unit() if sharded is not None else [None]:
        large_experts(parts.model, params)
        if cfg.collapsed_router:
            collapse_routers(parts.model, params)
    return run, parts


def train_five_steps(cfg, model_cfg, layout, dp_of_batch, data_dir):
    """train.py's build and five train_steps on this rank's slice of each step's global batch, then
    train.py's evaluation on the validation split of data_dir. Returns the losses (job-wide), the
    norms, step 1's gradients (before clipping) and final weights as full tensors by name, the
    tokens each expert took in step 1 (this rank's, by layer), moe_metrics of step 1, the evaluated
    loss, and whether the evaluation left the all-to-all byte counts of training as they were."""
    run, parts = build_with_large_experts(cfg, model_cfg, layout, data_dir)
    model, copies = parts.model, parts.model.tied_copies()
    sharded = parts.grad_sync if cfg.zero_stage == 3 else None

    def full(tensor, p):  # numpy: torch tensors would cross the result queue as shared memory
        return gather_full(tensor.detach().clone(), p, layout.tp_group).numpy()

    grads = {}
    norm_of = train.global_grad_norm

    # the gradients the norm is taken of, then the norm
    def capture(model_, layout_, grads_, dp_sharded=False):
        if not grads and not dp_sharded:
            grads.update(
                {n: full(p.grad, p) for n, p in model_.named_parameters() if n not in copies}
            )
        return norm_of(model_, layout_, grads_, dp_sharded)

    train.global_grad_norm = capture
    losses, norms, loads, stats = [], [], None, None
    g = cfg.gradient_accumulation_steps
    try:
        for step in range(STEPS):
            micro = global_microbatches(cfg, model_cfg, dp_of_batch, step)[
                layout.dp_rank * g : (layout.dp_rank + 1) * g
            ]
            micro = [context_split(batch, layout) for batch in micro]  # (this cp rank's share)
            loss, norm = train.train_step(cfg, layout, parts, micro, train.get_lr(step, cfg))
            losses.append(train.mean_across_ranks(loss, layout).item())
            norms.append(norm.item())
            if step == 0:
                loads = {i: list(m.step_load) for i, m in model.moe_layers().items()}
                stats = metrics.moe_metrics(model, layout, steps=1)
    finally:
        train.global_grad_norm = norm_of
    sent = [m.dispatch.bytes_sent for m in model.moe_layers().values()]
    evaluated = train.evaluate(cfg, run, parts)["val"]
    whole = gathered_parameters(sharded)
    weights = {n: full(whole.get(p, p), p) for n, p in model.named_parameters() if n not in copies}
    return dict(
        losses=losses,
        norms=norms,
        grads=grads,
        weights=weights,
        loads=loads,
        stats=stats,
        at=(layout.dp_rank, layout.tp_rank, layout.pp_rank),
        val_loss=evaluated,
        eval_left_a2a_bytes=sent == [m.dispatch.bytes_sent for m in model.moe_layers().values()],
    )


def _worker(rank, world_size, names, data_dir):
    out = {}
    for name in names:
        dp, tp, pp, ep, _ = CASES[name]
        cfg, model_cfg = case_settings(name)
        layout = ParallelLayout(dp, tp, pp, world_size, rank, cp=cfg.cp, ep=ep)
        out[name] = train_five_steps(cfg, model_cfg, layout, dp, data_dir)
    return out


@pytest.fixture(scope="module")
def moe_data(tmp_path_factory):
    return make_token_data(str(tmp_path_factory.mktemp("moe_data")), vocab_size=MODEL["vocab_size"])


@pytest.fixture(scope="module")
def two_ranks(moe_data):
    return run_ranks(_worker, 2, list(TWO_RANKS), moe_data)


@pytest.fixture(scope="module")
def four_ranks(moe_data):
    return run_ranks(_worker, 4, list(FOUR_RANKS), moe_data)


def reference(name, data_dir):
    """One process, the same global batch; also every micro-batch's tokens per expert in step 1, by
    layer."""
    cfg, model_cfg = case_settings(name, reference=True)
    loads = []  # (micro-batch, layer, assignments per expert), in the order they ran
    hooks = []
    result = {}

    def record(module, inputs, output):
        loads.append(list(module.last_load))

    original_build = build.build

    def build_and_hook(cfg_, run_):
        parts = original_build(cfg_, run_)
        for m in parts.model.moe_layers().values():
            hooks.append(m.register_forward_hook(record))
        return parts

    build.build = build_and_hook
    try:
        result = train_five_steps(cfg, model_cfg, ParallelLayout(1, 1, 1), 1, data_dir)
    finally:
        build.build = original_build
    n_layer, micro = model_cfg.n_layer, cfg.gradient_accumulation_steps
    # the first step's forwards, micro-batch by micro-batch, layer by layer
    step1 = loads[: micro * n_layer]
    result["micro_loads"] = np.array(step1).reshape(micro, n_layer, -1)
    return result


@pytest.fixture(scope="module")
def references():
    return {}


def results_of(name, request):
    """Each rank's results of a case, from the launch that ran it (launched when first needed)."""
    return [
        r[name] for r in request.getfixturevalue("two_ranks" if name in TWO_RANKS else "four_ranks")
    ]


def merged(per_rank, key):
    """One full tensor per name from the ranks that hold it (replicas must agree exactly)."""
    out = {}
    for r in per_rank:
        for n, t in r[key].items():
            if n in out:
                assert np.array_equal(out[n], t), (
                    f"{key} of {n} differs between the ranks holding it"
                )
            out[n] = t
    return out


IDLE_CASES = [name for name in CASES if "idle" in name]


def idle_local_experts(name, micro_loads):
    """(step-1 micro-step, layer, expert) where the expert got no row from any rank of its ep group
    (the group of dp ranks 0 .. ep - 1; micro_loads: the reference's step-1 assignments per
    micro-batch)."""
    dp, _, _, ep, given = CASES[name]
    g = given.get("gradient_accumulation_steps", 1)
    idle = []
    for s in range(g):
        # (layer, expert), micro-batch r * g + s on dp rank r
        rows = sum(micro_loads[r * g + s] for r in range(ep))
        idle += [(s, layer, e) for layer, e in zip(*np.nonzero(rows == 0))]
    return idle


@pytest.mark.parametrize("name", list(CASES))
def test_layout_trains_like_one_process(name, request, references, moe_data):
    ranks = results_of(name, request)
    ref = references.setdefault(name, reference(name, moe_data))
    for r in ranks:
        for key, rtol in (("losses", LOSS_RTOL), ("norms", GRAD_NORM_RTOL)):
            worst = max(abs(a - b) / abs(b) for a, b in zip(r[key], ref[key]))
            assert worst <= rtol, (
                f"{name}: {key} differ by {worst:.1e} relative: {r[key]} against {ref[key]}"
            )
    if name in IDLE_CASES:  # the case at hand: a rank's expert got no row in some micro-batch
        assert idle_local_experts(name, ref["micro_loads"]), (
            f"{name}: every expert got rows in every micro-batch"
        )
    # every local expert of ep rank 0 got no row in some micro-step and layer
    if "collapsed_router" in name:
        idle = idle_local_experts(name, ref["micro_loads"])
        assert any({(s, layer, e) for e in (0, 1)} <= set(idle) for s, layer, _ in idle), (
            f"{name}: {idle}"
        )
    for r in ranks:  # the evaluation sees the global batch, as one process does
        assert abs(r["val_loss"] - ref["val_loss"]) <= LOSS_RTOL * abs(ref["val_loss"]), (
            f"{name}: val_loss {r['val_loss']} against one process's {ref['val_loss']}"
        )
        assert r["eval_left_a2a_bytes"], (
            f"{name}: the evaluation's all-to-alls were counted as training's"
        )
    # (under ZeRO each rank holds the gradient of its own elements)
    if CASES[name][4].get("zero_stage", 0) == 0:
        grads = merged(ranks, "grads")
        assert set(grads) == set(ref["grads"])
        for n, g in grads.items():
            np.testing.assert_allclose(
                g, ref["grads"][n], rtol=1e-5, atol=1e-6, err_msg=f"{name}: gradient of {n}"
            )
    assert_same_tensors(merged(ranks, "weights"), ref["weights"])


@pytest.mark.parametrize("name", list(CASES))
def test_routing_and_all_to_all_bytes_are_one_process_routing(name, request, references, moe_data):
    """Each expert took, in step 1, exactly the tokens it took in one process (so the same ones were
    dropped), and the bytes the all-to-alls moved are the analytic figure for that routing: every
    row routed to an expert on another rank of the ep group crosses twice forward (the token, its
    output) and twice backward (their gradients), once more each way forward when the block is
    recomputed, on every tensor-parallel rank (each context-parallel rank sends its own tokens'
    rows)."""
    ranks = results_of(name, request)
    ref = references.setdefault(name, reference(name, moe_data))
    dp, tp, pp, ep, given = CASES[name]
    cfg, model_cfg = case_settings(name)
    micro_loads = ref["micro_loads"]  # (dp * g, n_layer, n_expert)
    total = {}
    for r in ranks:
        if r["at"][1] == 0:  # tp rank 0 (the others route the same tokens)
            for layer, load in r["loads"].items():
                total[layer] = total.get(layer, 0) + np.array(load)
    assert sorted(total) == list(range(model_cfg.n_layer))
    for layer, load in total.items():
        np.testing.assert_array_equal(
            load, micro_loads[:, layer].sum(0), err_msg=f"{name}: layer {layer}"
        )
    stats = ranks[0]["stats"]
    assert (stats["expert_load_min"], stats["expert_load_max"]) == (
        micro_loads.sum(0).min(),
        micro_loads.sum(0).max(),
    )

    per_rank = model_cfg.n_expert // ep
    g = cfg.gradient_accumulation_steps
    crossing_rows = 0  # rows sent to an expert on another rank, over micro-batches and layers
    for m, load in enumerate(micro_loads):
        ep_rank = (m // g) % ep  # micro-batch m runs on dp rank m // g
        crossing_rows += sum(
            load[:, e].sum() for e in range(model_cfg.n_expert) if e // per_rank != ep_rank
        )
    crossings = 6 if cfg.activation_checkpointing else 4
    expected = crossings * crossing_rows * model_cfg.n_embd * 4 * tp  # fp32 rows of n_embd
    assert crossing_rows > 0 and stats["a2a_bytes"] == expected, (
        f"{name}: {stats['a2a_bytes']} against {expected}"
    )


def test_dropless_routing_drops_nothing_and_capacity_drops(two_ranks, references, moe_data):
    ref = references.setdefault("ep2_dropless_top1", reference("ep2_dropless_top1", moe_data))
    assert (
        ref["stats"]["moe_dropped_frac"] == 0
        and two_ranks[0]["ep2_dropless_top1"]["stats"]["moe_dropped_frac"] == 0
    )
    assert two_ranks[0]["ep2_capacity_top2_shared"]["stats"]["moe_dropped_frac"] > 0


# -----------------------------------------------------------------------------
# checkpoints reshard between ep values, through train.py

CHAIN_STEPS = 10
CHAIN = [
    "--n_layer=2",
    "--n_embd=32",
    "--n_head=2",
    "--n_kv_head=2",
    "--block_size=16",
    "--batch_size=2",
    "--n_expert=4",
    "--n_expert_per_token=2",
    "--capacity_factor=1.0",
    "--n_shared_expert=1",
    "--device=cpu",
    "--log_interval=1",
    "--eval_interval=1",
    "--eval_iters=1",
    "--checkpoint_interval=2",
    "--keep_last_n=0",
    "--warmup_iters=2",
    f"--lr_decay_iters={CHAIN_STEPS}",
    "--learning_rate=3e-3",
    "--bucket_size_mb=0.01",
    "--peak_flops=1e12",
]
# the global batch is 4 micro-batches of 2 sequences at every layout: one process takes 4, each of 4
# replicas 1
SEGMENTS = [
    ["--ep=2", "--zero_stage=3"],  # one process -> ep=2 (two expert replicas), ZeRO-3
    ["--ep=4", "--zero_stage=1"],  # ep=2 ZeRO-3 -> ep=4, ZeRO-1
    # ep=4 ZeRO-1 -> ep=2, ZeRO-3; then its checkpoint -> one process
    ["--ep=2", "--zero_stage=3"],
]


def test_checkpoints_reshard_between_ep_values(tmp_path):
    """One process trains ten steps; a chain resumes its step-2 checkpoint at dp=4 with ep=2
    (ZeRO-3), that one's step 4 at ep=4 (ZeRO-1), that one's step 6 at ep=2 (ZeRO-3), the three in
    one launch of 4 processes, and that one's step 8 at one process: every step of the chain equals
    the uninterrupted run (loss, gradient norm), and so do the final weights. The experts are saved
    by their global index whichever rank holds them, the AdamW moments with them (ZeRO-3: each
    rank's flat shards of both)."""
    data = make_token_data(str(tmp_path / "data"))
    ref_out = tmp_path / "one_process"
    reference = train_in_process(
        CHAIN
        + [
            "--gradient_accumulation_steps=4",
            f"--max_iters={CHAIN_STEPS}",
            f"--data_dir={data}",
            f"--out_dir={ref_out}",
        ]
    )
    runs, previous, step = [], ref_out, 2
    for i, layout in enumerate(SEGMENTS):
        out = tmp_path / f"segment{i}"
        runs.append(
            (
                CHAIN
                + layout
                + [
                    "--gradient_accumulation_steps=1",
                    f"--max_iters={step + 2}",
                    "--init_from=resume",
                    f"--data_dir={data}",
                    f"--out_dir={out}",
                ],
                previous / f"ckpt_{step:07d}",
            )
        )
        previous, step = out, step + 2
    segments = [records for records, _ in train_on_ranks(runs, 4)]
    out = tmp_path / "segment3"
    shutil.copytree(previous / f"ckpt_{step:07d}", out / f"ckpt_{step:07d}")
    segments.append(
        train_in_process(
            CHAIN
            + [
                "--ep=1",
                "--gradient_accumulation_steps=4",
                "--init_from=resume",
                f"--max_iters={step + 2}",
                f"--data_dir={data}",
                f"--out_dir={out}",
            ]
        )
    )
    for i, records in enumerate(segments):
        resumed_at = 2 + 2 * i
        assert [r["step"] for r in records if "loss" in r] == [resumed_at + 1, resumed_at + 2]
        assert_same_losses_and_norms(
            records, reference, label=f"segment {i} resumed at step {resumed_at}"
        )
    assert_same_tensors(
        checkpoint_weights(out / f"ckpt_{CHAIN_STEPS:07d}"),
        checkpoint_weights(ref_out / f"ckpt_{CHAIN_STEPS:07d}"),
    )


# -----------------------------------------------------------------------------
# the layout and its checks


def test_the_grid_prints_each_replicas_experts_and_the_expert_groups():
    text = format_grid(4, 2, 1, ep=2, n_expert=8)
    assert "stage 0 replica 1: ranks [2, 3], experts 4-7" in text
    assert "stage 0 replica 2: ranks [4, 5], experts 0-3" in text
    assert (
        "expert-parallel groups (ep=2, tokens sent to their experts all-to-all): "
        "[0, 2] [4, 6] [1, 3] [5, 7]" in text
    )
    assert (
        "expert replicas (the same experts, gradients averaged): [0, 4] [2, 6] [1, 5] [3, 7]"
        in text
    )
    assert "none, every expert is on one rank" in format_grid(2, 1, 1, ep=2, n_expert=4)


def test_ep_must_divide_dp_and_n_expert():
    with pytest.raises(ValueError, match="ep = 3 must divide dp = 4"):
        resolve_dp(4, 0, 1, 1, ep=3)
    with pytest.raises(ValueError, match="n_expert = 6 must be divisible by ep = 4"):
        check_layout(ModelConfig(n_expert=6), ep=4)
    with pytest.raises(ValueError, match="ep = 2 spreads the experts .* but n_expert = 0"):
        check_layout(ModelConfig(), ep=2)
