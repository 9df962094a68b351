"""Pipeline parallelism (parallel.py section 4): the schedules' action lists and the simulated
timeline they make (tools/timeline.py), and pipelined training equal to one process. The distributed
checks share one 4-rank launch (module fixture) and each test reads its part; train.py's pipelined
runs and resumes share one 2-rank launch."""

import functools
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tools import memory_plan
import metrics
import settings
import build
import train
import zero as zero_stages  # (zero is a local name below: the stage)
from dist_utils import (
    ROOT,
    assert_same_losses_and_norms,
    assert_same_tensors,
    build_model,
    checkpoint_weights,
    gather_full,
    gathered_parameters,
    run_ranks,
    train_in_process,
    train_on_ranks,
)
from model import ModelConfig, Transformer
from parallel import (
    ParallelLayout,
    PipelineComm,
    apply_pipeline,
    one_f_one_b_actions,
    run_schedule,
    stage_layers,
    sync_tied_grads,
    tied_weight_group,
)
from tools.timeline import describe_pipeline
from pipeline_schedules import (
    SCHEDULES,
    ScheduleExecutor,
    WeightGradStore,
    balanced_cut,
    check_schedule,
    chunk_modules,
    cost_cut,
    forward_only_actions,
    ideal_bubble,
    virtual_stages,
)
from settings import check_layout
import parallel
from parallel import _all_gather_single
from tools.timeline import ActivationMemory, bubble_fraction, format_timeline, schedule_timeline
from tools.timeline import main as timeline_main

CFG = ModelConfig(vocab_size=512, block_size=16, n_layer=6, n_head=4, n_kv_head=2, n_embd=64)
# pp4 x v2
CFG8 = ModelConfig(vocab_size=512, block_size=16, n_layer=8, n_head=4, n_kv_head=2, n_embd=64)
SEED, M, BATCH = 1234, 8, 2
AUX_WEIGHT = 0.01


# -----------------------------------------------------------------------------
# the action lists and the timeline simulated from them (no processes)


def grid(rows, chunks=1):
    label = lambda a: f"{a[0]}{a[1]}" + (f".{a[2]}" if chunks > 1 else "")
    return [" ".join("." if a is None else label(a) for a in row) for row in rows]


def test_1f1b_timeline_is_warmup_steady_cooldown():
    # a whole backward lasts two slots
    assert grid(schedule_timeline("1f1b", pp=3, m=4)) == [
        "F0 F1 F2 . . . . B0 B0 F3 B1 B1 . B2 B2 . B3 B3",
        ". F0 F1 . . B0 B0 F2 B1 B1 F3 B2 B2 . B3 B3 . .",
        ". . F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 . . . .",
    ]


def test_afab_timeline_is_all_forwards_then_all_backwards():
    assert grid(schedule_timeline("afab", pp=3, m=4)) == [
        "F0 F1 F2 F3 . . . . . . B0 B0 B1 B1 B2 B2 B3 B3",
        ". F0 F1 F2 F3 . . . B0 B0 B1 B1 B2 B2 B3 B3 . .",
        ". . F0 F1 F2 F3 B0 B0 B1 B1 B2 B2 B3 B3 . . . .",
    ]


def test_zero_bubble_timeline_puts_the_weight_gradients_in_1f1b_idle_slots():
    # B where 1F1B's backward was; stage s leaves its first s W's for the drain
    assert grid(schedule_timeline("zero_bubble", pp=3, m=4)) == [
        "F0 F1 F2 . . B0 W0 F3 B1 W1 B2 W2 B3 W3",
        ". F0 F1 . B0 F2 B1 W0 F3 B2 W1 B3 W2 W3",
        ". . F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3",
    ]


def test_interleaved_timeline_takes_each_group_of_pp_microbatches_round_the_ring_per_chunk():
    assert grid(schedule_timeline("interleaved_1f1b", pp=2, m=4, chunks=2), chunks=2) == [
        "F0.0 F1.0 F0.1 F1.1 . . B0.1 B0.1 F2.0 B1.1 B1.1 F3.0 B0.0 B0.0 F2.1 B1.0 B1.0 F3.1 B2.1 "
        "B2.1 . B3.1 B3.1 B2.0 B2.0 B3.0 B3.0",
        ". F0.0 F1.0 F0.1 B0.1 B0.1 F1.1 B1.1 B1.1 F2.0 B0.0 B0.0 F3.0 B1.0 B1.0 F2.1 B2.1 B2.1 "
        "F3.1 B3.1 B3.1 B2.0 B2.0 B3.0 B3.0 . .",
    ]


def allowed(schedule, pp, m, chunks):
    try:
        check_schedule(schedule, pp, m, chunks)
        return True
    except ValueError:
        return False


def test_every_schedule_runs_each_action_once_in_order_without_deadlock_with_the_papers_bubble():
    """pp 2..8, m 1..16, chunks 1..4 wherever check_schedule allows them: every rank's list holds
    one F and one B (and one W when split) per microbatch and chunk, F before B before W; the
    simulator, which models the executor's first-in first-out channels, places every action (else it
    raises); the drawn bubble is the paper's formula where the paper has one; evaluation's
    forward-only lists run too."""
    checked = 0
    for schedule in SCHEDULES:
        for pp in range(2, 9):
            for m in range(1, 17):
                for chunks in range(1, 5):
                    if not allowed(schedule, pp, m, chunks):
                        continue
                    lists = [SCHEDULES[schedule](pp, r, m, chunks) for r in range(pp)]
                    ops = "FBW" if schedule in ("zero_bubble", "zbv") else "FB"
                    for actions in lists:
                        assert sorted(actions) == sorted(
                            (op, i, c) for op in ops for i in range(m) for c in range(chunks)
                        ), (schedule, pp, m, chunks)
                        at = {a: k for k, a in enumerate(actions)}
                        assert all(
                            at[("F", i, c)] < at[("B", i, c)] < at.get(("W", i, c), len(actions))
                            for i in range(m)
                            for c in range(chunks)
                        )
                    rows = schedule_timeline(schedule, pp, m, chunks)
                    theory = ideal_bubble(schedule, pp, m, chunks)
                    if theory is not None:
                        assert bubble_fraction(rows) == pytest.approx(theory), (
                            schedule,
                            pp,
                            m,
                            chunks,
                        )
                    evaluation = [forward_only_actions(pp, r, m, chunks) for r in range(pp)]
                    schedule_timeline(schedule, pp, m, chunks, lists=evaluation)
                    checked += 1
    # afab, 1f1b, zero_bubble: one chunk; interleaved: m a multiple of pp, 1 to 4 chunks; zbv: two
    # chunks
    assert checked == 3 * 7 * 16 + 4 * sum(16 // pp for pp in range(2, 9)) + 7 * 16


def test_zbv_idles_only_the_fill_with_enough_microbatches():
    for pp in range(2, 9):
        for m in range(2 * pp, 17):
            assert bubble_fraction(schedule_timeline("zbv", pp, m, 2)) == pytest.approx(
                (pp - 1) / (6 * m + pp - 1)
            )


def test_the_simulator_fails_a_list_that_would_hang_or_mix_up_messages():
    lists = [SCHEDULES["1f1b"](3, r, 4) for r in range(3)]
    # rank 1 takes microbatch 1's activations before microbatch 0's: rank 0 sends 0 first
    swapped = [list(a) for a in lists]
    swapped[1][0], swapped[1][1] = swapped[1][1], swapped[1][0]
    with pytest.raises(
        RuntimeError,
        match="rank 0's message #0 of activations to rank 1 is F0 for stage 1, but rank 1 "
        "expects F1 for stage 1",
    ):
        schedule_timeline("1f1b", 3, 4, lists=swapped)
    # rank 0 waits for microbatch 0's gradient before sending microbatch 1 on, which rank 1 needs
    # first
    stuck = [list(a) for a in lists]
    stuck[0] = [("F", 0, 0), ("B", 0, 0)] + [
        a for a in lists[0] if a not in (("F", 0, 0), ("B", 0, 0))
    ]
    with pytest.raises(
        RuntimeError,
        match=r"1f1b deadlocks at pp=3, m=4, chunks=1: every rank waits on another "
        r"\(rank 0 at \('B', 0, 0\), rank 1 at \('F', 1, 0\)",
    ):
        schedule_timeline("1f1b", 3, 4, lists=stuck)
    # a backward before its own forward
    early = [list(a) for a in lists]
    early[2] = [("B", 0, 0)] + [a for a in lists[2] if a != ("B", 0, 0)]
    with pytest.raises(RuntimeError, match="rank 2 runs B0 of chunk 0 before its F0"):
        schedule_timeline("1f1b", 3, 4, lists=early)


def test_printed_timeline_shows_grid_and_bubble():
    text = format_timeline("1f1b", pp=4, m=8)
    assert (
        "rank 0 | F0 F1 F2 F3 .. .. .. .. .. .. B0 -- F4 B1 -- F5 B2 -- F6 B3 -- F7 B4 -- .. B5 -- "
        ".. B6 -- .. B7 --" in text
    )
    assert (
        "bubble: 27.3% of the slots idle (measured on this timeline); "
        "theory (pp - 1) / (m + pp - 1) = 3/11 = 27.3%" in text
    )
    assert "rank 0: 4, rank 1: 3, rank 2: 2, rank 3: 1" in text


def test_timeline_py_prints_the_interleaved_timeline_from_the_command_line():
    out = subprocess.run(
        [
            sys.executable,
            "tools/timeline.py",
            "--schedule",
            "interleaved_1f1b",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--chunks",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (
        "15.8% of the slots idle (measured on this timeline); "
        "theory (pp - 1) / (v m + pp - 1) = 3/19 = 15.8%" in out
    )
    # every slot names its chunk
    assert out.count("\nrank ") == 4 and "F0.0" in out and "B7.1" in out


@pytest.mark.parametrize(
    "schedule, chunks, bubble",
    [
        (
            "1f1b",
            None,
            "27.3% of the slots idle (measured on this timeline); "
            "theory (pp - 1) / (m + pp - 1) = 3/11 = 27.3%",
        ),
        (
            "interleaved_1f1b",
            4,
            "8.6% of the slots idle (measured on this timeline); "
            "theory (pp - 1) / (v m + pp - 1) = 3/35",
        ),
        (
            "zero_bubble",
            None,
            "11.1% of the slots idle (measured on this timeline); "
            "theory (pp - 1) / (3 m + pp - 1) = 3/27",
        ),
        ("zbv", 2, "5.9% of the slots idle (measured on this timeline); theory none in the paper"),
    ],
)
def test_timeline_py_prints_each_schedule(schedule, chunks, bubble, capsys):
    timeline_main(
        ["--schedule", schedule, "--pp", "4", "--microbatches", "8"]
        + (["--chunks", str(chunks)] if chunks else [])
    )
    out = capsys.readouterr().out
    assert bubble in out
    assert out.count("\nrank ") == 4


def test_timeline_py_refuses_a_microbatch_count_interleaving_cannot_take(capsys):
    with pytest.raises(SystemExit) as exit:
        timeline_main(["--schedule", "interleaved_1f1b", "--pp", "4", "--microbatches", "6"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert (
        "needs gradient_accumulation_steps (the microbatches, 6) to be a multiple of pp = 4" in err
    )
    assert "use 4 or 8" in err


@pytest.mark.parametrize(
    "schedule, pp, m, chunks, message",
    [
        ("interleaved_1f1b", 4, 6, 2, "to be a multiple of pp = 4"),
        (
            "1f1b",
            2,
            4,
            2,
            "pp_schedule='1f1b' runs one model chunk per rank; use --pp_schedule=interleaved_1f1b",
        ),
        ("zero_bubble", 2, 4, 3, "pp_schedule='zero_bubble' runs one model chunk per rank"),
        (
            "zbv",
            2,
            4,
            1,
            "pp_schedule='zbv' holds two model chunks on each rank (the V): set --pp_chunks=2",
        ),
        ("interleaved_1f1b", 1, 4, 2, "pp_chunks = 2 needs a pipeline"),
        (
            "gpipe",
            2,
            4,
            1,
            "pp_schedule must be one of 'afab', '1f1b', 'interleaved_1f1b', 'zero_bubble', 'zbv'",
        ),
    ],
)
def test_a_schedule_that_cannot_run_is_refused_before_anything_is_built(
    schedule, pp, m, chunks, message
):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_schedule(schedule, pp, m, chunks)


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="pp = 8 stages but only n_layer = 6"):
        check_layout(CFG, tp=1, pp=8)
    with pytest.raises(
        ValueError,
        match="pp = 4 ranks x pp_chunks = 2 chunks = 8 model stages but only n_layer = 6",
    ):
        check_layout(CFG, tp=1, pp=4, chunks=2)


def test_chunks_keep_the_whole_models_parameter_names_and_hold_the_blocks_of_their_cut():
    whole = dict(Transformer(CFG).named_parameters())
    ranks = [
        build_model(
            CFG, stages=virtual_stages("interleaved_1f1b", 2, r, 2), stage_blocks=(1, 2, 2, 1)
        )
        for r in range(2)
    ]
    # 6 blocks in 4 model stages: 0 | 1-2 | 3-4 | 5; rank 0 holds stages 0 and 2, rank 1 stages 1
    # and 3
    assert [[list(r) for r in model.chunk_layers] for model in ranks] == [
        [[0], [3, 4]],
        [[1, 2], [5]],
    ]
    names = [set(dict(model.named_parameters())) - set(model.tied_copies()) for model in ranks]
    assert names[0] | names[1] == set(whole) and not names[0] & names[1]
    # zbv: rank 0 holds model stages 0 and 3, both ends: the head is the embedding's own tensor
    # again
    v_rank0 = build_model(CFG, stages=virtual_stages("zbv", 2, 0), stage_blocks=(2, 1, 2, 1))
    assert v_rank0.lm_head.weight is v_rank0.tok_emb.weight and v_rank0.tied_copies() == {}


VARIANTS = {
    "dense": {},
    "moe": dict(n_expert=4, n_expert_per_token=1, n_shared_expert=1),
    "gelu_bias": dict(mlp="gelu", norm="layernorm", bias=True),
    "mla": dict(
        attention="mla", kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_split_backward_computes_the_gradients_of_one_backward(variant, dtype):
    """B (inside WeightGradStore.collect) then W (apply), microbatch by microbatch in the W order
    ZB-H1 uses, leaves the gradients a plain backward leaves: the weights' from the kept x and dy,
    the others' in B. bf16: under autocast, as F.linear casts."""
    cfg = ModelConfig(**{**CFG.__dict__, "n_layer": 2, **VARIANTS[variant]})
    plain, split = Transformer(cfg), Transformer(cfg)
    plain.init_weights(SEED), split.init_weights(SEED)
    store = WeightGradStore(chunk_modules(split, 0))
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16) if dtype == torch.bfloat16 else nullcontext()
    )
    batches = make_microbatches(3)
    for x, y in batches:
        with autocast:
            loss = plain(x, y)[1]
        (loss / 3).backward()
    for i, (x, y) in enumerate(batches):
        with autocast:
            loss = split(x, y)[1]
        with store.collect(i):
            (loss / 3).backward()
        if i >= 1:
            store.apply(i - 1)  # a W one microbatch late, as on a later stage
    store.apply(2)
    assert store.held == {} and store.held_bytes == 0
    deferred = {id(p) for p in store.params}
    assert any(id(p) in deferred for p in split.blocks["0"].parameters())
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-4)
    for (name, p), q in zip(plain.named_parameters(), split.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **tolerance, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_chunks_compute_the_whole_model_auxiliary_losses_included(variant):
    cfg = ModelConfig(**{**CFG.__dict__, **VARIANTS[variant]})
    whole = Transformer(cfg)
    whole.init_weights(SEED)
    chunks = [
        build_model(
            cfg,
            stages=virtual_stages("interleaved_1f1b", 2, r, 2),
            stage_blocks=build.stage_cut(cfg, "interleaved_1f1b", 2, 2),
            seed=SEED,
        )
        for r in range(2)
    ]
    x, y = make_microbatches(1)[0]
    h, total = x, 0.0
    # model stages 0..3: rank 0 chunk 0, rank 1 chunk 0, rank 0 chunk 1, rank 1 chunk 1
    for stage in range(4):
        out, loss = chunks[stage % 2](h, y if stage == 3 else None, chunk=stage // 2)
        total, h = total + (loss if loss is not None else 0.0), out
        # an MoE chunk returns its aux loss
        assert (loss is not None) == (stage == 3 or variant == "moe")
    torch.testing.assert_close(h, whole(x, y)[0])
    torch.testing.assert_close(total, whole(x, y)[1])


# -----------------------------------------------------------------------------
# the stages cut by their cost (pipeline_schedules.balanced_cut and cost_cut, build.stage_cut)


def every_cut(n_blocks, n_stages):
    """Every cut of n_blocks into n_stages runs of at least one block, as blocks per stage."""
    for bounds in itertools.combinations(range(1, n_blocks), n_stages - 1):
        yield tuple(b - a for a, b in zip((0, *bounds), (*bounds, n_blocks)))


def stage_costs(block_costs, sizes, first, last):
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    costs = [sum(block_costs[a : a + n]) for a, n in zip(starts, sizes)]
    costs[0] += first
    costs[-1] += last
    return costs


@pytest.mark.parametrize(
    "block_costs, n_stages, first, last, cut",
    [
        ([1] * 8, 2, 0, 4.8, (6, 2)),  # issue 28's shape: the head and loss are worth 4.8 blocks
        # GPT-2 small at pp=4: the head's stage sets the limit, the rest even
        ([1] * 12, 4, 0, 4.5, (3, 4, 4, 1)),
        # no head: as even as blocks go, the first stage lighter on a tie
        ([1] * 8, 3, 0, 0, (2, 3, 3)),
        ([1] * 4, 2, 2, 0, (1, 3)),  # an embedding worth two blocks
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, 0, 0, (5, 2, 2)),
        ([5], 1, 1, 1, (1,)),
    ],
)
def test_balanced_cut_gives_the_known_answers(block_costs, n_stages, first, last, cut):
    assert balanced_cut(block_costs, n_stages, first, last) == cut


def test_balanced_cut_makes_the_costliest_stage_the_cheapest_of_every_cut():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        k, costs = rng.randint(1, n), [rng.randint(0, 9) for _ in range(n)]
        first, last = rng.randint(0, 5), rng.randint(0, 30)
        cut = balanced_cut(costs, k, first, last)
        best = min(max(stage_costs(costs, sizes, first, last)) for sizes in every_cut(n, k))
        assert len(cut) == k and sum(cut) == n and min(cut) >= 1
        assert max(stage_costs(costs, cut, first, last)) == best, (costs, k, first, last, cut)


@pytest.mark.parametrize("pp", [2, 3])
def test_under_zbv_the_cut_balances_the_ranks_within_the_cheapest_costliest_stage(pp):
    """A ZB-V rank crosses its two stages back to back (rank 0 both ends of the model): of the cuts
    whose costliest stage is the cheapest (the head's sets it here), the one found leaves the
    costliest rank as cheap as any (every cut tried). Under interleaving the stages themselves must
    balance: balanced_cut's."""
    costs, cuts = (0, [1] * 10, 4.8), list(every_cut(10, 2 * pp))
    stages = lambda sizes: stage_costs(costs[1], sizes, 0, 4.8)
    ranks = lambda sizes: [
        sum(stages(sizes)[s] for s in virtual_stages("zbv", pp, p, 2)) for p in range(pp)
    ]
    cut, cheapest = cost_cut("zbv", pp, 2, costs), min(max(stages(c)) for c in cuts)
    assert max(stages(cut)) == cheapest
    assert max(ranks(cut)) == min(max(ranks(c)) for c in cuts if max(stages(c)) == cheapest)
    assert cost_cut("interleaved_1f1b", pp, 2, costs) == balanced_cut(costs[1], 2 * pp, 0, 4.8)


ISSUE_SHAPE = ModelConfig(
    n_layer=8, n_embd=256, n_head=8, n_kv_head=8, block_size=128, vocab_size=16384
)
QUICK_START = ModelConfig(
    n_layer=4, n_embd=128, n_head=4, n_kv_head=2, block_size=256, vocab_size=50304
)


def test_the_costs_are_the_flops_per_token_and_the_head_is_most_of_the_quick_starts():
    embedding, blocks, head = metrics.pipeline_costs(ISSUE_SHAPE)
    assert embedding + sum(blocks) + head == metrics.flops_per_token(ISSUE_SHAPE)
    assert (
        head == 6 * 256 * 16384
        and len(blocks) == 8
        and head / blocks[0] == pytest.approx(4.83, abs=0.01)
    )
    _, blocks, head = metrics.pipeline_costs(QUICK_START)
    assert head / (sum(blocks) + head) == pytest.approx(0.86, abs=0.01)


def test_the_start_up_line_gives_each_ranks_blocks_and_share_and_says_when_no_cut_can_balance():
    costs = metrics.pipeline_costs(ISSUE_SHAPE)
    line = describe_pipeline("1f1b", 2, 8, 1, build.stage_cut(ISSUE_SHAPE, "1f1b", 2), costs)
    assert line == (
        "pipeline: 1f1b, 8 microbatches, cut by cost, blocks per stage 0: 0-5 (47% of the work) | "
        "1: 6-7 (53%)"
    )
    line = describe_pipeline("1f1b", 2, 8, 1, (4, 4), costs)  # the even deal of the blocks, by hand
    assert "cut by pp_layers" in line and "gives a rank 69% of the work" in line and ": 6,2" in line
    # issue 29: zero_bubble at pp=2 measured "rank 0 91.1% | rank 1 2.2%" with no word of why
    line = describe_pipeline(
        "zero_bubble",
        2,
        8,
        1,
        build.stage_cut(QUICK_START, "zero_bubble", 2),
        metrics.pipeline_costs(QUICK_START),
    )
    assert "0: 0-2 (11% of the work) | 1: 3 (89%)" in line
    assert (
        "the head and the loss alone are 86% of the model's work, so the rank that holds them does "
        "at least 89%"
    ) in line
    assert "the least busy rank is idle about 88% of each step" in line
    assert "split the model with tp (which splits the head too) or dp rather than pp" in line
    # interleaved at the issue's shape: the head's chunk alone outweighs a quarter of the model
    line = describe_pipeline(
        "interleaved_1f1b", 2, 8, 2, build.stage_cut(ISSUE_SHAPE, "interleaved_1f1b", 2, 2), costs
    )
    assert (
        "no cut of the blocks brings every model stage within 115% of an even share of the work "
        "(25%)" in line
    )
    assert line.endswith("or use fewer chunks")


@pytest.mark.parametrize("bad", ["7,2", "8", "0,8", "7,x", "4,4,0"])
def test_pp_layers_that_do_not_cut_n_layer_into_the_stages_are_refused_naming_the_setting(
    bad, data_dir, tmp_path
):
    with pytest.raises(SystemExit) as exit:  # before any process starts
        train.main(
            [
                f"--data_dir={data_dir}",
                f"--out_dir={tmp_path}",
                "--n_layer=8",
                "--pp=2",
                f"--pp_layers={bad}",
            ]
        )
    assert exit.value.code.startswith(
        f"error: pp_layers = {bad!r} must be pp * pp_chunks = 2 whole numbers, each at "
        f"least 1, summing to n_layer = 8: the blocks of each model stage, first to last "
        f"(for example '4,4'; '' cuts the stages by their cost)"
    )


@pytest.mark.parametrize(
    "schedule, pp, chunks, pp_layers",
    [
        ("1f1b", 2, 1, ""),
        ("1f1b", 2, 1, "7,1"),
        ("interleaved_1f1b", 2, 2, ""),
        ("zbv", 2, 2, ""),
        ("1f1b", 4, 1, ""),
    ],
)
def test_the_model_the_memory_planner_and_the_start_up_line_hold_the_same_cut(
    schedule, pp, chunks, pp_layers
):
    cut = build.stage_cut(ISSUE_SHAPE, schedule, pp, chunks, pp_layers)
    assert sum(cut) == 8 and (pp_layers == "" or cut == (7, 1))
    line = describe_pipeline(schedule, pp, 8, chunks, cut, metrics.pipeline_costs(ISSUE_SHAPE))
    for rank in range(pp):
        stages = virtual_stages(schedule, pp, rank, chunks)
        blocks = [list(stage_layers(cut, s)) for s in stages]
        with torch.device("meta"):
            model = apply_pipeline(Transformer(ISSUE_SHAPE), cut, stages)
        assert [list(layers) for layers in model.chunk_layers] == blocks
        planned = memory_plan.stage_parameter_elements(
            ISSUE_SHAPE, 1, pp, rank, schedule, chunks, pp_layers=pp_layers
        )
        assert {int(name.split(".")[1]) for name in planned if name.startswith("blocks.")} == set(
            sum(blocks, [])
        )
        text = ", ".join(str(b[0]) if len(b) == 1 else f"{b[0]}-{b[-1]}" for b in blocks)
        assert f"{rank}: {text} (" in line


# -----------------------------------------------------------------------------
# one 4-rank launch. Per-stage gradients of one step (ScheduleExecutor directly): pp=4 (cut by cost:
# 1-2-2-1) and pp=2 x tp=2 with every schedule, auxiliary losses, fewer microbatches than stages,
# activation memory. Training steps through train.py's build and train_step: dp=2 x pp=2 with
# ZeRO-1, pp=4 x 2 chunks.


def make_microbatches(m, batch=BATCH, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, CFG.vocab_size, (batch, CFG.block_size), generator=g),
            torch.randint(0, CFG.vocab_size, (batch, CFG.block_size), generator=g),
        )
        for _ in range(m)
    ]


class WithAuxLoss(nn.Module):
    """A stage that returns an auxiliary loss of its output, as a non-last stage with
    mixture-of-experts blocks returns its router's balance loss (the pipeline must backpropagate it
    from this stage)."""

    def __init__(self, stage, chunk=0):
        super().__init__()
        self.stage, self.chunk = stage, chunk

    def forward(self, x, targets=None):
        out, loss = self.stage(x, targets, chunk=self.chunk)
        last = self.stage.chunk_layers[self.chunk][-1] == self.stage.cfg.n_layer - 1
        return (out, loss) if last else (out, AUX_WEIGHT * out.pow(2).mean())


class ToldReducer:
    """What the executor tells a data-parallel reducer, recorded: set_grad_sync's arguments and the
    parameters grad_ready announces (the W actions' gradients, accumulated by hand)."""

    def __init__(self):
        self.syncs, self.ready = [], []

    def set_grad_sync(self, sync):
        self.syncs.append(sync)

    def grad_ready(self, p):
        self.ready.append(p)

    def backward_done(self, op, chunk):
        pass


def _sum_tied_grads(model, layout, schedule, v):
    """Sum the tied embedding's and head's gradients between the ranks that hold the first and
    the last stage."""
    holders = [
        p
        for p in range(layout.pp)
        for s in virtual_stages(schedule, layout.pp, p, v)
        if s in (0, layout.pp * v - 1)
    ]
    group = tied_weight_group(layout, holders)
    held = (
        [model.tok_emb.weight]
        if model.tok_emb is not None
        else [model.lm_head.weight]
        if model.lm_head is not None
        else []
    )
    sync_tied_grads(held, group)


def _stage_step(layout, schedule, m, chunks=1, aux=False, cfg=CFG, checkpointing=False):
    """One step of this rank's chunks; returns its loss part, full grads by (original) name, peak
    activation bytes and the set_grad_sync calls."""
    v = 2 if schedule == "zbv" else chunks
    cut = build.stage_cut(cfg, schedule, layout.pp, v)  # as train.py cuts it
    model = build_model(
        cfg,
        tp_group=layout.tp_group,
        stages=virtual_stages(schedule, layout.pp, layout.pp_rank, v),
        stage_blocks=cut,
        activation_checkpointing=checkpointing,
        seed=SEED,
    )
    comm = PipelineComm.from_layout(
        layout,
        cfg.n_embd,
        "cpu",
        stages_of=lambda rank: virtual_stages(schedule, layout.pp, rank, v),
    )
    actions = SCHEDULES[schedule](layout.pp, layout.pp_rank, m, v)
    split = any(op == "W" for op, _, _ in actions)
    stores = [WeightGradStore(chunk_modules(model, c)) for c in range(v)] if split else None
    chunk_models = [
        (WithAuxLoss(model, c) if aux else functools.partial(model, chunk=c)) for c in range(v)
    ]
    told = ToldReducer()
    with ActivationMemory(model, stores or ()) as memory:
        loss = ScheduleExecutor(
            chunk_models,
            make_microbatches(m),
            comm,
            grad_sync=told,
            split_backward=stores,
            trace=memory,
        ).run(actions)
    syncs, ready = told.syncs, told.ready
    _sum_tied_grads(model, layout, schedule, v)
    # numpy: torch tensors would cross the result queue as shared memory, gone once the worker exits
    originals = model.tied_copies()
    grads = {
        originals.get(name, name): gather_full(p.grad, p, layout.tp_group).numpy()
        for name, p in model.named_parameters()
    }
    return {
        "loss": loss.item(),
        "grads": grads,
        "peak": memory.peak,
        "syncs": syncs,
        "ready": len(ready),
        "ready_distinct": len({id(p) for p in ready}),
        "deferred": sum(len(s.params) for s in stores) if stores else 0,
    }


# training steps through train.py

TRAIN = dict(
    n_layer=6,
    n_head=4,
    n_kv_head=2,
    n_embd=64,
    block_size=16,
    vocab_size=512,
    batch_size=4,
    gradient_accumulation_steps=4,
    learning_rate=1e-2,
    warmup_iters=1,
    lr_decay_iters=3,
    max_iters=3,
    device="cpu",
    bucket_size_mb=0.01,
    seed=SEED,
    data_dir=None,
)
STEPS = 3


def step_batches(cfg, layout, step):
    """The step's global batch, batch_size * m windows, cut as rank_microbatches cuts it: dp rank r
    takes the r-th contiguous slice, in m microbatches of batch_size / dp... here batch_size is per
    dp rank."""
    m, per_rank = cfg.gradient_accumulation_steps, cfg.batch_size * cfg.gradient_accumulation_steps
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(
        0, cfg.vocab_size, (per_rank * layout.dp, cfg.block_size + 1), generator=g
    )
    mine = tokens[layout.dp_rank * per_rank : (layout.dp_rank + 1) * per_rank]
    return [
        (
            mine[i * cfg.batch_size : (i + 1) * cfg.batch_size, :-1],
            mine[i * cfg.batch_size : (i + 1) * cfg.batch_size, 1:],
        )
        for i in range(m)
    ]


def whole_grads(grad_sync):
    """ZeRO-2/3: {parameter: its mean gradient}, all-gathered from the buckets' owned shards."""
    out = {}
    for b in grad_sync.buckets:
        flat = torch.empty(b.shard_size * b.world)
        _all_gather_single(flat, b.grad_shard, group=b.group)
        for p, start in zip(b.params, b.offsets):
            out[p] = flat[start : start + p.numel()].view_as(p)
    return out


def full_tensors(model, layout, which, zero, optimizer=None):
    """Every parameter's (or gradient's) full tensor by whole-model name, on data-parallel rank 0
    (None elsewhere). With ZeRO-1 each dp rank holds its own slice of the gradient, zero elsewhere:
    summed; with ZeRO-2/3 only the shards it owns: gathered; with ZeRO-3 the parameters are gathered
    too."""
    out, copies = {}, model.tied_copies()
    grads = whole_grads(optimizer.grad_sync) if which == "grads" and zero >= 2 else {}
    sharded = optimizer.grad_sync if which == "weights" and zero == 3 else None
    whole = gathered_parameters(sharded)
    for name, p in model.named_parameters():
        t = (grads.get(p, p.grad) if which == "grads" else whole.get(p, p).detach()).clone()
        if which == "grads" and zero == 1 and layout.dp_group is not None:
            dist.all_reduce(t, group=layout.dp_group)
        t = gather_full(t, p, layout.tp_group)
        out[copies.get(name, name)] = t.numpy()
    return out if layout.dp_rank == 0 else None


class AfterEachAction:
    """The executor's trace: after every action of the step, the parameters still holding a
    full-size p.grad and the bytes of the blocks' gathered parameters under ZeRO-3 (the root units
    are kept whole); the largest of each over the step."""

    def __init__(self, parts):
        self.params = list(parts.model.parameters())
        self.sharded = parts.grad_sync if hasattr(parts.grad_sync, "chunks") else None  # ZeRO-3's
        self.grads = self.gathered = 0

    @contextmanager
    def __call__(self, action):
        yield
        self.grads = max(self.grads, sum(p.grad is not None for p in self.params))
        if self.sharded is not None:
            self.gathered = max(
                self.gathered,
                sum(
                    b.param_full.untyped_storage().nbytes()
                    for blocks in self.sharded.chunks.values()
                    for _, block in blocks
                    for b in block
                ),
            )


def _logged_steps(cfg, layout, parts, seen, gathers):
    """STEPS steps of train.train_step: the logged loss and grad norm of each. The last step, under
    ZeRO-2/3, is traced by `seen` and appends to `gathers` once per all-gather (ZeRO-3 gathers
    units with it)."""
    all_gather = zero_stages._all_gather_single
    records = []
    for step in range(STEPS):
        last = step == STEPS - 1 and cfg.zero_stage >= 2
        if last:
            zero_stages._all_gather_single = lambda *a, **k: (
                gathers.append(1),
                all_gather(*a, **k),
            )[1]
        try:
            batches, lr = step_batches(cfg, layout, step), train.get_lr(step, cfg)
            trace = seen if last else None
            loss, norm = train.train_step(cfg, layout, parts, batches, lr, trace=trace)
        finally:
            zero_stages._all_gather_single = all_gather
        loss = train.mean_across_ranks(loss, layout).item()
        records.append({"step": step + 1, "loss": loss, "grad_norm": norm.item()})
    return records


def train_steps(**overrides):
    """STEPS optimizer steps of train.py's own build and train_step at a layout (world of this
    process): the logged loss and grad norm of each, the gradients the first step's AdamW used, the
    final weights, and the data-parallel collectives launched before finish() on the last step.
    ZeRO-2/3 (every micro-batch's gradients sent): the buckets each micro-batch must launch (one per
    backward action that writes it) and what AfterEachAction saw in the last step; ZeRO-3: that
    step's all-gathers, and the units."""
    cfg = SimpleNamespace(**{**settings.DEFAULTS, **TRAIN, **overrides})
    run = build.setup(cfg, training=False)
    parts = build.build(cfg, run)
    layout, zero = run.layout, cfg.zero_stage
    captured, launched, gathers = {}, [], []

    # the gradients AdamW steps with, first step only (a collective: every rank runs it)
    def capture(*_):
        if "grads" not in captured:
            captured["grads"] = full_tensors(parts.model, layout, "grads", zero, parts.optimizer)

    parts.optimizer.register_step_pre_hook(capture)
    # how many buckets the schedule had launched when finish() is called
    if parts.grad_sync is not None:
        finish = parts.grad_sync.finish
        parts.grad_sync.finish = lambda: (launched.append(parts.grad_sync.launched), finish())[1]
    seen = AfterEachAction(parts)
    records = _logged_steps(cfg, layout, parts, seen, gathers)
    grad_sync = parts.grad_sync
    if grad_sync is not None:  # ZeRO-1/2: the last step's gathers land before the weights are read
        parallel.wait_for_params(grad_sync.buckets)
    buckets = len(grad_sync.buckets) if grad_sync is not None else 0
    tied = bool(parts.pipeline and parts.pipeline.tied_copies) and layout.dp > 1
    sharded = grad_sync if zero == 3 else None
    return {
        "records": records,
        "grads": captured["grads"],
        "weights": full_tensors(parts.model, layout, "weights", zero, parts.optimizer),
        "launched": launched[-1] if launched else None,
        "buckets": buckets,
        "tied_bucket": tied,
        "pp_rank": layout.pp_rank,
        "m": cfg.gradient_accumulation_steps,
        "blocks": [list(layers) for layers in parts.model.chunk_layers],
        "launches_per_microbatch": sum(map(len, getattr(grad_sync, "phase_buckets", {}).values())),
        "grads_after_an_action": seen.grads,
        "gathered_after_an_action": seen.gathered,
        "gathers": len(gathers),
        "block_units": sum(len(block) for blocks in sharded.chunks.values() for _, block in blocks)
        if sharded
        else 0,
        "whole_units": len(sharded.whole) if sharded else 0,
    }


TRAIN_LAYOUTS = {
    "dp2_pp2_zero1_interleaved": dict(
        dp=2, pp=2, zero_stage=1, pp_schedule="interleaved_1f1b", pp_chunks=2, batch_size=2
    ),
    # (cut by hand: blocks 0-4 | 5; the others by cost)
    "dp2_pp2_zero1_zero_bubble": dict(
        dp=2, pp=2, zero_stage=1, pp_schedule="zero_bubble", batch_size=2, pp_layers="5,1"
    ),
    "dp2_pp2_zbv": dict(dp=2, pp=2, pp_schedule="zbv", pp_chunks=2, batch_size=2),
}
# ZeRO-2 and 3 under the schedules with chunks or a split backward (tied embeddings: the default;
# under zbv rank 0 holds both the embedding and the head)
SCHEDULE_CHUNKS = {
    "interleaved": ("interleaved_1f1b", 2),
    "zero_bubble": ("zero_bubble", 1),
    "zbv": ("zbv", 2),
}
ZERO23_LAYOUTS = [f"dp2_pp2_zero{z}_{s}" for s in SCHEDULE_CHUNKS for z in (2, 3)]
TRAIN_LAYOUTS.update(
    {
        f"dp2_pp2_zero{z}_{s}": dict(
            dp=2, pp=2, zero_stage=z, pp_schedule=schedule, pp_chunks=v, batch_size=2
        )
        for s, (schedule, v) in SCHEDULE_CHUNKS.items()
        for z in (2, 3)
    }
)


def _pipeline_worker(rank, world_size):
    out = {}
    pp4 = ParallelLayout(1, 1, 4, world_size, rank)
    out["pp4_one_microbatch"] = _stage_step(pp4, "afab", 1)
    for schedule in ("afab", "1f1b", "zero_bubble"):
        out[f"pp4_{schedule}"] = _stage_step(pp4, schedule, M)
    out["pp4_1f1b_aux"] = _stage_step(pp4, "1f1b", M, aux=True)
    out["pp4_zero_bubble_aux"] = _stage_step(pp4, "zero_bubble", M, aux=True)
    out["pp4_1f1b_m2"] = _stage_step(pp4, "1f1b", 2)
    out["pp4_zero_bubble_m2"] = _stage_step(pp4, "zero_bubble", 2)
    out["pp4_interleaved_v2"] = _stage_step(pp4, "interleaved_1f1b", M, chunks=2, cfg=CFG8)
    out["pp4_zbv"] = _stage_step(pp4, "zbv", M, cfg=CFG8)
    out["pp4_1f1b_cfg8"] = _stage_step(pp4, "1f1b", M, cfg=CFG8)
    out["pp4_zero_bubble_checkpointing"] = _stage_step(pp4, "zero_bubble", 4, checkpointing=True)
    pp2tp2 = ParallelLayout(1, 2, 2, world_size, rank)
    for schedule in ("afab", "1f1b", "zero_bubble", "zbv"):
        out[f"pp2_tp2_{schedule}"] = _stage_step(pp2tp2, schedule, M)
    out["pp2_tp2_interleaved_v2"] = _stage_step(pp2tp2, "interleaved_1f1b", M, chunks=2, aux=True)
    out["pp2_tp2_1f1b_checkpointed"] = _stage_step(pp2tp2, "1f1b", M, checkpointing=True)
    out["pp2_tp2_stage"] = pp2tp2.pp_rank
    for name, overrides in TRAIN_LAYOUTS.items():
        out[name] = train_steps(**overrides)
    out["pp4_interleaved_v2_train"] = train_steps(
        pp=4, pp_schedule="interleaved_1f1b", pp_chunks=2, n_layer=8, tie_embeddings=True
    )
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_pipeline_worker, 4)


def reference(m, aux_after_blocks=(), cfg=CFG):
    """One process, the whole model: each microbatch's loss / m backpropagated, plus AUX_WEIGHT *
    mean(h^2) of the hidden states after the given blocks (where a pipeline stage with WithAuxLoss
    would end)."""
    model = Transformer(cfg)
    model.init_weights(SEED)
    aux = []
    for j in aux_after_blocks:
        model.blocks[str(j)].register_forward_hook(
            lambda mod, inp, h: aux.append(AUX_WEIGHT * h.pow(2).mean())
        )
    total = 0.0
    for x, y in make_microbatches(m):
        aux.clear()
        loss = model(x, y)[1] + sum(aux)
        (loss / m).backward()
        total += loss.item() / m
    return total, {name: p.grad for name, p in model.named_parameters()}


def assert_grads_match(results, ref_grads, rtol=1e-5, atol=1e-6):
    """Every gradient, element by element: |a - b| <= atol + rtol |b|. Prints how much of that bound
    the worst element used (pytest -s)."""
    seen, worst = set(), (0.0, None)
    for r in results:
        for name, g in r["grads"].items():
            g = torch.from_numpy(g)
            torch.testing.assert_close(
                g, ref_grads[name], rtol=rtol, atol=atol, msg=lambda s: f"{name}: {s}"
            )
            used = (
                ((g - ref_grads[name]).abs() / (atol + rtol * ref_grads[name].abs())).max().item()
            )
            worst = max(worst, (used, name), key=lambda w: w[0])
            seen.add(name)
    assert seen == set(ref_grads)  # every parameter is on some stage
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    print(
        f"equivalence | {test} | gradients: the worst element uses {worst[0]:.2e} of |a-b| <= "
        f"{atol:.0e} + {rtol:.0e}|b| ({worst[1]})",
        flush=True,
    )


def pipeline_loss(results):
    """The logged loss: the stages' parts summed (over tp ranks 0 only: the others hold copies)."""
    return sum(r["loss"] for r in results)


@pytest.mark.parametrize(
    "key, cfg",
    [
        ("pp4_afab", CFG),
        ("pp4_1f1b", CFG),
        ("pp4_zero_bubble", CFG),
        ("pp4_interleaved_v2", CFG8),
        ("pp4_zbv", CFG8),
    ],
)
def test_pp4_matches_one_process(ranks, key, cfg):
    results = [r[key] for r in ranks]
    ref_loss, ref_grads = reference(M, cfg=cfg)
    assert pipeline_loss(results) == pytest.approx(ref_loss, rel=1e-6)
    assert_grads_match(results, ref_grads)
    # the tied embedding: its copies got the same summed gradient, wherever they sit
    holders = [r for r in results if "tok_emb.weight" in r["grads"]]
    # zbv: rank 0 holds both ends of the model
    assert len(holders) == (1 if key == "pp4_zbv" else 2)
    assert all(
        (h["grads"]["tok_emb.weight"] == holders[0]["grads"]["tok_emb.weight"]).all()
        for h in holders
    )


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_pp4_with_fewer_microbatches_than_stages_matches_one_process(ranks, schedule):
    results = [r[f"pp4_{schedule}_m2"] for r in ranks]
    ref_loss, ref_grads = reference(2)
    assert pipeline_loss(results) == pytest.approx(ref_loss, rel=1e-6)
    assert_grads_match(results, ref_grads)


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_pp4_auxiliary_loss_of_non_last_stages_is_backpropagated(ranks, schedule):
    results = [r[f"pp4_{schedule}_aux"] for r in ranks]
    ref_loss, ref_grads = reference(M, aux_after_blocks=(0, 2, 4))  # stages: blocks 0, 1-2, 3-4, 5
    assert pipeline_loss(results) == pytest.approx(ref_loss, rel=1e-6)
    assert_grads_match(results, ref_grads)
    assert results[0]["loss"] > 0  # a middle stage reports its part


def test_zero_bubble_with_activation_checkpointing_matches_one_process(ranks):
    results = [r["pp4_zero_bubble_checkpointing"] for r in ranks]
    ref_loss, ref_grads = reference(4)
    assert pipeline_loss(results) == pytest.approx(ref_loss, rel=1e-6)
    assert_grads_match(results, ref_grads)


@pytest.mark.parametrize("schedule", ["afab", "1f1b", "zero_bubble", "zbv", "interleaved_v2"])
def test_pp2_with_tp2_matches_one_process(ranks, schedule):
    results = [r[f"pp2_tp2_{schedule}"] for r in ranks]
    # interleaved: every chunk but the last adds an auxiliary loss (model stages 0 | 1-2 | 3-4 | 5)
    ref_loss, ref_grads = reference(
        M, aux_after_blocks=(0, 2, 4) if schedule == "interleaved_v2" else ()
    )
    # ranks (pp, tp): 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1)
    tp_rank0 = [
        results[0],
        results[2],
    ]
    assert [r["pp2_tp2_stage"] for r in ranks] == [0, 0, 1, 1]
    assert pipeline_loss(tp_rank0) == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_match(results, ref_grads)


def test_activation_checkpointing_at_pp2_with_tp2_matches_one_process(ranks):
    """Each block recomputed in backward, its tensor-parallel collectives run again there, on every
    stage: the same loss and gradients as one process without recomputation."""
    results = [r["pp2_tp2_1f1b_checkpointed"] for r in ranks]
    ref_loss, ref_grads = reference(M)
    assert pipeline_loss([results[0], results[2]]) == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_match(results, ref_grads)
    # it did recompute: each stage held less for backward than without checkpointing
    for stage in (
        0,
        2,
    ):
        assert results[stage]["peak"] < ranks[stage]["pp2_tp2_1f1b"]["peak"] / 2


def test_1f1b_holds_at_most_pp_minus_stage_microbatches_afab_all(ranks):
    for stage, r in enumerate(ranks):
        one = r["pp4_one_microbatch"]["peak"]
        assert one > 0
        assert r["pp4_1f1b"]["peak"] == (4 - stage) * one
        assert r["pp4_afab"]["peak"] == M * one


def test_zero_bubble_peak_activations_equal_1f1b_interleaved_within_the_papers_factor(ranks):
    """Measured bytes held for backward (saved tensors, plus W's x and dy), stage by stage (the
    stages hold 1, 2, 2 and 1 blocks): zero_bubble's first stage holds what 1F1B's does (pp
    microbatches), and no stage more than pp microbatches' worth; interleaving's largest, with even
    chunks, within (1 + (pp - 1) / (v pp)) of 1F1B's (Korthikanti et al. 2022)."""
    zb, ofob = [r["pp4_zero_bubble"]["peak"] for r in ranks], [r["pp4_1f1b"]["peak"] for r in ranks]
    one = [r["pp4_one_microbatch"]["peak"] for r in ranks]
    assert zb[0] == ofob[0] == 4 * one[0], (zb, ofob)
    assert all(z <= 4 * o for z, o in zip(zb, one))
    # the later stages keep x and dy of their delayed W's
    assert all(z >= o for z, o in zip(zb, ofob))
    interleaved, even = (
        [r["pp4_interleaved_v2"]["peak"] for r in ranks],
        [r["pp4_1f1b_cfg8"]["peak"] for r in ranks],
    )
    assert max(even) <= max(interleaved) <= (1 + 3 / 8) * max(even), (interleaved, even)


def test_grad_sync_is_requested_before_each_chunks_last_backward_only(ranks):
    for r in ranks:
        for key in ("pp4_afab", "pp4_1f1b", "pp2_tp2_1f1b"):
            assert r[key]["syncs"] == [False] * (M - 1) + [True]
        # before each B and each W: the last B's, the last W's
        syncs = r["pp4_zero_bubble"]["syncs"]
        assert len(syncs) == 2 * M and syncs.count(True) == 2 and syncs[-1]
        syncs = r["pp2_tp2_interleaved_v2"]["syncs"]  # two chunks: each one's last backward
        assert len(syncs) == 2 * M and syncs.count(True) == 2 and syncs[-1]


def test_weight_gradients_accumulated_by_hand_are_announced_by_every_w(ranks):
    for r in ranks:
        for key in ("pp4_zero_bubble", "pp2_tp2_zbv"):
            assert r[key]["deferred"] > 0 and r[key]["ready_distinct"] == r[key]["deferred"]
            # each W announces its chunk's, every microbatch
            assert r[key]["ready"] == M * r[key]["deferred"]
        assert r["pp4_1f1b"]["ready"] == 0


def merged(results, key):
    out = {}
    for r in results:
        if r[key] is not None:
            out.update(r[key])
    return out


@functools.lru_cache(maxsize=None)
def one_process_training(**overrides):
    """The reference of train_steps: the same steps in this process, at one rank (batch_size the
    global one, so the windows per microbatch are dp times those of a data-parallel rank). Computed
    once for the layouts that share it."""
    return train_steps(
        **{**overrides, "dp": 0, "pp": 1, "zero_stage": 0, "pp_schedule": "1f1b", "pp_chunks": 1}
    )


@pytest.mark.parametrize(
    "name",
    [
        "dp2_pp2_zero1_interleaved",
        "dp2_pp2_zero1_zero_bubble",
        "dp2_pp2_zbv",
        "pp4_interleaved_v2_train",
    ]
    + ZERO23_LAYOUTS,
)
def test_training_steps_match_one_process(ranks, name):
    """Losses and grad norms of every step, the gradients of the first step, the final weights: dp=2
    x pp=2 (with ZeRO-1, 2 and 3) and pp=4, 2 chunks per rank, tied embeddings (chunks cut by cost,
    1-2-2-1, at pp=2 x 2)."""
    results = [r[name] for r in ranks]
    if name == "pp4_interleaved_v2_train":
        ref = one_process_training(n_layer=8)
    else:
        ref = one_process_training(batch_size=2 * TRAIN_LAYOUTS[name]["batch_size"])
    # (train_step on synthetic batches: no data to evaluate; train.py's evaluation is compared in
    # test_train_py_*)
    assert_same_losses_and_norms(results[0]["records"], ref["records"], evaluated=False)
    assert_grads_match(
        [{"grads": merged(results, "grads")}],
        {k: torch.from_numpy(v) for k, v in ref["grads"].items()},
    )
    assert_same_tensors(merged(results, "weights"), ref["weights"])


def test_train_py_builds_the_stages_of_the_cut_by_cost_or_by_pp_layers(ranks):
    for name, overrides in {
        **TRAIN_LAYOUTS,
        "pp4_interleaved_v2_train": dict(
            pp=4, pp_chunks=2, n_layer=8, pp_schedule="interleaved_1f1b"
        ),
    }.items():
        cfg = SimpleNamespace(**{**settings.DEFAULTS, **TRAIN, **overrides})
        model_cfg = ModelConfig(
            **{
                k: getattr(cfg, k)
                for k in ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "vocab_size")
            }
        )
        cut = build.stage_cut(model_cfg, cfg.pp_schedule, cfg.pp, cfg.pp_chunks, cfg.pp_layers)
        assert (
            cut == (5, 1)
            if cfg.pp_layers
            else cut
            == cost_cut(cfg.pp_schedule, cfg.pp, cfg.pp_chunks, metrics.pipeline_costs(model_cfg))
        ), name
        for r in ranks:
            stages = virtual_stages(cfg.pp_schedule, cfg.pp, r[name]["pp_rank"], cfg.pp_chunks)
            assert r[name]["blocks"] == [list(stage_layers(cut, s)) for s in stages], name


@pytest.mark.parametrize(
    "name", ["dp2_pp2_zero1_interleaved", "dp2_pp2_zero1_zero_bubble", "dp2_pp2_zbv"]
)
def test_data_parallel_buckets_are_launched_by_the_schedule_not_left_to_finish(ranks, name):
    """By the end of the schedule every bucket's collective is in flight (backward hooks, and for
    the split backward the announced hand-accumulated W gradients), except the tied embedding's,
    which waits for the copies' sum."""
    for r in (r[name] for r in ranks):
        assert r["launched"] == r["buckets"] - (1 if r["tied_bucket"] else 0), r


@pytest.mark.parametrize("name", ZERO23_LAYOUTS)
def test_zero2_and_zero3_send_each_microbatchs_gradients_once_after_the_action_that_completes_them(
    ranks, name
):
    """Over the last step of each rank: every bucket launched once per micro-batch for each backward
    action that writes it (B, or W for the weights a split backward computes by hand; per chunk), no
    full-size p.grad left after any action; under ZeRO-3 no block left gathered after any action,
    and each block gathered twice per micro-batch (forward and B: W needs no weights), the root
    units once per step."""
    keys = (
        "pp_rank",
        "m",
        "launched",
        "launches_per_microbatch",
        "grads_after_an_action",
        "gathered_after_an_action",
        "gathers",
        "block_units",
        "whole_units",
    )
    for r in ({k: r[name][k] for k in keys} for r in ranks):
        assert r["launched"] == r["m"] * r["launches_per_microbatch"], r
        assert r["grads_after_an_action"] == 0, r
        if "zero3" in name:
            assert r["block_units"] > 0 and r["gathered_after_an_action"] == 0, r
            assert r["gathers"] == 2 * r["m"] * r["block_units"] + r["whole_units"], r


# -----------------------------------------------------------------------------
# through train.py


def test_plain_forward_backward_requests_grad_sync_before_its_last_backward_only():
    model = Transformer(CFG)
    model.init_weights(SEED)
    told = ToldReducer()
    train.forward_backward(model, make_microbatches(3), nullcontext(), 1.0, told)
    assert told.syncs == [False, False, True]


def one_stage_comm():
    """The channel of a one-stage pipeline in this process: no peer, nothing sent."""
    return PipelineComm(0, 1, [0], lambda x: (x.shape[0], x.shape[1], CFG.n_embd))


def whole_model():
    model = Transformer(CFG)
    model.init_weights(SEED)
    return model


def test_the_core_executor_on_one_stage_is_the_plain_accumulation_loop():
    """parallel.run_schedule with 1F1B's list on one stage: the loss and every gradient of
    train.py's loop over the micro-batches, to the bit (one scaling by m, one backward per
    micro-batch, in the same order)."""
    plain, staged, microbatches = whole_model(), whole_model(), make_microbatches(3)
    want = train.forward_backward(plain, microbatches, nullcontext(), 1.0, ToldReducer())
    told = ToldReducer()
    got = run_schedule(
        one_f_one_b_actions(1, 0, 3), staged, microbatches, one_stage_comm(), grad_sync=told
    )
    assert torch.equal(got, want) and told.syncs == [False, False, True]
    for (name, p), q in zip(plain.named_parameters(), staged.parameters()):
        assert torch.equal(q.grad, p.grad), name


def test_the_core_executor_refuses_a_w_action_naming_the_executor_that_runs_it():
    with pytest.raises(
        ValueError,
        match=r"\('W', 0, 0\): PipelineExecutor runs 'F' and 'B' only \('W': ScheduleExecutor\)",
    ):
        run_schedule(
            [("F", 0, 0), ("B", 0, 0), ("W", 0, 0)],
            whole_model(),
            make_microbatches(1),
            one_stage_comm(),
        )


def test_w_actions_without_a_split_backward_are_refused_naming_what_to_give():
    executor = ScheduleExecutor(whole_model(), make_microbatches(1), one_stage_comm())
    with pytest.raises(ValueError, match="split_backward, one WeightGradStore per chunk"):
        executor.run([("F", 0, 0), ("B", 0, 0), ("W", 0, 0)])


TRAIN_ARGS = [
    "--n_layer=6",
    "--n_head=4",
    "--n_kv_head=4",
    "--n_embd=64",
    "--block_size=32",
    "--batch_size=2",
    "--gradient_accumulation_steps=4",
    "--log_interval=1",
    "--eval_interval=4",
    "--eval_iters=2",
    "--warmup_iters=2",
    "--lr_decay_iters=8",
    "--learning_rate=1e-2",
    "--keep_last_n=0",
    # skips timing a CPU matmul on each rank at start-up
    "--peak_flops=1e12",
]


@pytest.fixture(scope="module")
def reference_run(data_dir, tmp_path_factory):
    """One process, 4 steps, a checkpoint at step 2, here in the test process."""
    out = tmp_path_factory.mktemp("pp_ref")
    records = train_in_process(
        [
            f"--data_dir={data_dir}",
            f"--out_dir={out}",
            *TRAIN_ARGS,
            "--max_iters=4",
            "--checkpoint_interval=2",
        ]
    )
    return records, out


RESUMES = {  # name: (the run whose step-2 checkpoint it resumes, its layout, processes)
    "interleaved_to_one_process": (
        "interleaved",
        ["--pp=1", "--pp_schedule=1f1b", "--pp_chunks=1"],
        1,
    ),
    # -> ZB-H1, one chunk per rank, cut by hand (blocks 0-4 | 5) where the checkpoint's was cut by
    # cost
    "interleaved_to_zero_bubble": (
        "interleaved",
        ["--pp=2", "--pp_schedule=zero_bubble", "--pp_chunks=1", "--pp_layers=5,1"],
        2,
    ),
    # one chunk -> a V
    "one_process_to_zbv": ("one process", ["--pp=2", "--pp_schedule=zbv", "--pp_chunks=2"], 2),
}


@pytest.fixture(scope="module")
def two_ranks(data_dir, reference_run, tmp_path_factory):
    """One launch of 2 processes: the interleaved run (pp=2 with 2 chunks per rank, cut by cost,
    unevenly: blocks 0, 3-4 | 1-2, 5; the trace of step 2, a checkpoint at 2), then the resumes of
    RESUMES at 2 processes, to step 4: {name: (records, out_dir, stdout)}."""
    outs = {"interleaved": tmp_path_factory.mktemp("pp_interleaved")}
    runs = [
        [
            f"--data_dir={data_dir}",
            f"--out_dir={outs['interleaved']}",
            *TRAIN_ARGS,
            "--max_iters=4",
            "--checkpoint_interval=2",
            "--pp=2",
            "--pp_schedule=interleaved_1f1b",
            "--pp_chunks=2",
            "--pp_trace=True",
        ]
    ]
    for name, (saved_by, layout, nproc) in RESUMES.items():
        if nproc == 2:
            outs[name] = tmp_path_factory.mktemp(name)
            source = outs["interleaved"] if saved_by == "interleaved" else reference_run[1]
            runs.append(
                (
                    [
                        f"--data_dir={data_dir}",
                        f"--out_dir={outs[name]}",
                        *TRAIN_ARGS,
                        "--max_iters=4",
                        "--checkpoint_interval=0",
                        "--init_from=resume",
                        *layout,
                    ],
                    source / "ckpt_0000002",
                )
            )
    return {
        name: (records, outs[name], stdout)
        for name, (records, stdout) in zip(outs, train_on_ranks(runs, 2))
    }


@pytest.fixture(scope="module")
def interleaved_run(two_ranks):
    return two_ranks["interleaved"]


def test_train_py_pipelined_matches_one_process(reference_run, interleaved_run):
    """pp=2 with 2 chunks per rank through train.py: each step's loss and gradient norm, the
    evaluation's losses and the final weights equal one process's."""
    ref, ref_out = reference_run
    records, out, stdout = interleaved_run
    assert_same_losses_and_norms(records, ref)
    assert_same_tensors(
        checkpoint_weights(out / "ckpt_0000004"), checkpoint_weights(ref_out / "ckpt_0000004")
    )
    val = lambda rs: [r["val_loss"] for r in rs if "val_loss" in r]
    assert val(records) == pytest.approx(val(ref), rel=1e-5) and val(ref)
    # the cut by cost, printed: rank 1 has the head and the loss
    assert (
        "cut by cost, blocks per rank (chunk by chunk) 0: 0, 3-4 (46% of the work) | 1: 1-2, 5 "
        "(54%)" in stdout
    )


@pytest.mark.parametrize("name", list(RESUMES))
def test_checkpoints_resume_across_chunkings_and_schedules(
    name, reference_run, two_ranks, data_dir, tmp_path, capsys
):
    ref, _ = reference_run
    saved_by, layout, nproc = RESUMES[name]
    if nproc == 1:  # here, in the test process
        shutil.copytree(two_ranks[saved_by][1] / "ckpt_0000002", tmp_path / "ckpt_0000002")
        records = train_in_process(
            [
                f"--data_dir={data_dir}",
                f"--out_dir={tmp_path}",
                *TRAIN_ARGS,
                "--max_iters=4",
                "--checkpoint_interval=0",
                "--init_from=resume",
                *layout,
            ]
        )
        stdout = capsys.readouterr().out
    else:
        records, _, stdout = two_ranks[name]
    assert "resumed from" in stdout
    # the checkpoint's stages were cut by cost (1-2-2-1 in chunks), these by hand
    if "--pp_layers=5,1" in layout:
        assert "cut by pp_layers, blocks per stage 0: 0-4 (" in stdout
    later = lambda rs: [r for r in rs if r["step"] > 2]
    assert_same_losses_and_norms(later(records), later(ref))
    val = lambda rs: [r["val_loss"] for r in rs if "val_loss" in r]
    assert val(records) == pytest.approx(val(ref), rel=1e-5) and val(records)


def test_pp_trace_writes_one_chrome_trace_of_every_rank_and_prints_the_measured_bubble(
    interleaved_run,
):
    _, out, stdout = interleaved_run
    trace = json.loads((out / "pp_trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    # every action of the step on every rank: 4 microbatches x 2 chunks x (F, B) x 2 ranks, rank =
    # process row
    assert sorted((e["pid"], e["cat"], e["args"]["microbatch"], e["tid"]) for e in spans) == sorted(
        (p, op, i, c) for p in range(2) for op in "FB" for i in range(4) for c in range(2)
    )
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in spans)
    names = {
        (e["pid"], e.get("tid")): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and "name" in e["args"]
    }
    assert names[(0, None)] == "pipeline rank 0" and names[(1, 1)] == "chunk 1 (model stage 3)"
    assert trace["otherData"]["step"] == 2 and trace["otherData"]["ideal_bubble"] == pytest.approx(
        1 / 9
    )
    assert f"pipeline trace of step 2 -> {out / 'pp_trace.json'}: measured bubble rank 0 " in stdout
    assert "ideal interleaved_1f1b 11.1% with forward = B = W in time" in stdout


def test_plot_py_draws_the_trace(interleaved_run, tmp_path):
    pytest.importorskip("matplotlib")
    _, out, _ = interleaved_run
    png = tmp_path / "trace.png"
    proc = subprocess.run(
        [sys.executable, "tools/plot.py", "--trace", str(out), f"--out={png}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_times_schedules_side_by_side_with_their_bubbles_and_activations(tmp_path):
    argv = [
        "--n_layer=4",
        "--n_embd=64",
        "--n_head=4",
        "--n_kv_head=4",
        "--block_size=16",
        "--vocab_size=512",
        "--batch_size=2",
        "--gradient_accumulation_steps=4",
        "--warmup_steps=1",
        "--bench_steps=1",
        "--pp=2",
        "--schedules=1f1b,zero_bubble,interleaved_1f1b:2",
        f"--trace={tmp_path / 'measured.json'}",
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "tools/bench.py",
            *argv,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bubble, measured" in proc.stdout and "activations (KiB)" in proc.stdout
    result = json.loads(proc.stdout.strip().splitlines()[-1][len("RESULT ") :])
    for name in ("1f1b", "zero_bubble", "interleaved_1f1b:2"):
        r = result["schedules"][name]
        assert (
            r["ms_per_step"] > 0
            and len(r["measured_bubble"]) == 2
            and all(0 <= b < 1 for b in r["measured_bubble"])
        )
        assert len(r["peak_activation_bytes"]) == 2 and min(r["peak_activation_bytes"]) > 0
    assert result["schedules"]["zero_bubble"]["ideal_bubble"] == pytest.approx(1 / 13)
    # --trace: one more step of the first schedule, every rank's actions in pp_trace's format
    trace = json.loads((tmp_path / "measured.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for r in range(2):
        names = sorted(e["name"] for e in spans if e["pid"] == r)
        assert names == sorted(f"{op}{i}" for op in "FB" for i in range(4)), r
    assert (
        trace["otherData"]["schedule"] == "1f1b" and len(trace["otherData"]["measured_bubble"]) == 2
    )


def test_train_py_refuses_a_schedule_that_cannot_run_in_one_line(data_dir, tmp_path):
    # before any process group: every rank would print the same
    with pytest.raises(SystemExit) as exit:
        train.main(
            [
                f"--data_dir={data_dir}",
                f"--out_dir={tmp_path}",
                "--pp=2",
                "--pp_schedule=interleaved_1f1b",
                "--pp_chunks=2",
                "--gradient_accumulation_steps=3",
            ]
        )
    assert exit.value.code == (
        "error: pp_schedule='interleaved_1f1b' needs gradient_accumulation_steps (the "
        "microbatches, 3) to be a multiple of pp = 2: they go round the ring of ranks in groups of "
        "pp (Megatron-LM's rule); use 2 or 4, adjusting batch_size to keep the batch"
    )
