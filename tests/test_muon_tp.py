"""Muon under tensor parallelism: who runs Newton-Schulz (muon_tp_mode, optim.py's note).

The rule: 'auto' splits a matrix where its Newton-Schulz time exceeds the scatter split adds (the
matrix's bytes over the tp link), which splits every matrix of an 8B model on H100s at tp = 8 and
of the quick start on a CPU; the deal gives each tp rank a share of the work and never deals a
matrix the tp ranks hold whole. Then through train.py, in one launch of four ranks: dp2 x tp2 with
ZeRO-1 under 'split' (the bench's layout), at ZeRO-0 and ZeRO-2 under 'split', tp2 x pp2 under
'auto' at a rate where the attention's matrices split and the MLP's replicate, and tp2 x pp2 under
'replicate', each against one process: losses, gradient norms, final weights and optimizer states
(Muon's momentum among them). Every run's first step also holds the orthogonalisations to
ledger.py's count, the dealt matrices once per tp group. The model is multi-query (n_kv_head = 1),
so k and v are replicated across the tp ranks beside the split matrices."""

import os

import pytest
import torch

import settings
from configurator import configure
from dist_utils import (
    assert_same_losses_and_norms,
    assert_same_tensors,
    checkpoint_optimizer_states,
    checkpoint_weights,
    train_in_process,
    train_on_ranks,
)
from model import ModelConfig, Transformer, takes_muon
from optim import TP_LINK_BUSBW, deal_tp, split_pays
from tools.machines import CPU_GLOO_LINK, MACHINES
from tools.step_time import model_config_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# -----------------------------------------------------------------------------
# the rule and the deal, on one process


def muon_shapes(model_cfg):
    """The full shapes of the matrices Muon steps in one block of the model (built on meta)."""
    with torch.device("meta"):
        model = Transformer(model_cfg)
    return [
        tuple(p.shape)
        for name, p in model.named_parameters()
        if takes_muon(name, p) and name.startswith("blocks.0.")
    ]


def ns_flops_by_hand(shape):
    """Newton-Schulz's 5 iterations on A x B, A <= B: X X^T, its square, times X."""
    a, b = sorted(shape)
    return 5 * (2 * a * a * b + 2 * a**3 + 2 * a * a * b)


def test_split_pays_where_newton_schulz_outlasts_the_matrix_over_the_link():
    shape, busbw = (96, 160), 2e9
    at_par = ns_flops_by_hand(shape) / (96 * 160 * 4 / busbw)  # the FLOP/s where the two are equal
    assert split_pays(shape, 4, dict(busbw=busbw, flops=0.99 * at_par))
    assert not split_pays(shape, 4, dict(busbw=busbw, flops=1.01 * at_par))
    # in bf16 the same matrix is half the bytes: it pays up to twice the rate
    assert split_pays(shape, 2, dict(busbw=busbw, flops=1.99 * at_par))


def test_auto_splits_an_8b_model_on_h100s_at_tp8():
    shapes = muon_shapes(
        ModelConfig(
            vocab_size=128,
            block_size=16,
            n_layer=1,
            n_head=32,
            n_kv_head=8,
            n_embd=4096,
            intermediate_size=14336,
        )
    )
    assert sorted(set(shapes)) == [(1024, 4096), (4096, 4096), (4096, 14336), (14336, 4096)]
    h100 = dict(busbw=TP_LINK_BUSBW["cuda"], flops=MACHINES["h100"]["matmul_flops"]["float32"])
    assert all(split_pays(s, 4, h100) for s in shapes)


def test_auto_splits_the_quick_start_on_a_cpu():
    values, _ = configure(settings.TRAINING, [os.path.join(ROOT, "config/tiny_fineweb.py")])
    shapes = muon_shapes(model_config_of(values))
    assert max(max(s) for s in shapes) == 384  # n_embd 128, the MLP 384 wide
    # 77 GFLOP/s: the fp32 matmul probe of one process on the 2-core machine this was written on
    cpu = dict(busbw=TP_LINK_BUSBW["cpu"], flops=77e9)
    assert all(split_pays(s, 4, cpu) for s in shapes)


def test_the_tp_links_are_tools_machines_figures():
    assert TP_LINK_BUSBW["cuda"] == MACHINES["h100"]["node"]["busbw"]
    assert TP_LINK_BUSBW["cpu"] == CPU_GLOO_LINK["busbw"]


class FakeGroup:
    """A process group's size and rank, which is all deal_tp reads of it."""

    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size

    def rank(self):
        return 0


def sharded(rows, cols, dim, tp):
    """A tensor-parallel slice of a rows x cols matrix along dim, marked as mark_sharded marks."""
    shape = [rows, cols]
    shape[dim] //= tp
    p = torch.empty(shape)
    p.tp_shard_dim, p.tp_world, p.tp_rank = dim, tp, 0
    return p


def test_split_deals_the_sharded_matrices_by_work_and_never_a_replicated_one():
    tp = 2
    # the same bytes (64 KiB whole), but the square matrix is 2.7 times the work
    wide = [sharded(64, 256, 0, tp) for _ in range(2)]  # 64 x 256 whole: 23.6 MFLOP each
    square = [sharded(128, 128, 1, tp) for _ in range(2)]  # 128 x 128 whole: 62.9 MFLOP each
    replicated = [torch.empty(16, 128) for _ in range(2)]  # MQA's k and v: whole on each rank
    matrices = [(p, 5) for p in wide + square + replicated]
    owners = deal_tp(matrices, FakeGroup(tp), "split")
    assert {id(p) for p in owners} == {id(p) for p in wide + square}
    # by work, not by size: one square matrix and one wide one for each rank
    for rank in range(tp):
        mine = {id(p) for p, r in owners.items() if r == rank}
        assert len(mine & {id(p) for p in square}) == 1 and len(mine & {id(p) for p in wide}) == 1
    assert deal_tp(matrices, FakeGroup(tp), "replicate") == {}
    assert deal_tp(matrices, FakeGroup(tp), "auto", rates=None) == {}  # no rates: replicate
    assert deal_tp(matrices, FakeGroup(1), "split") == {}  # no tensor parallelism
    # at a rate where only the square ones pay: 64 KiB take 49 us over gloo, the time of 23.6
    # MFLOP at 486 GFLOP/s and of 62.9 at 1296
    rates = dict(busbw=TP_LINK_BUSBW["cpu"], flops=800e9)
    assert {id(p) for p in deal_tp(matrices, FakeGroup(tp), "auto", rates)} == {
        id(p) for p in square
    }
    with pytest.raises(ValueError, match="tp_mode = 'half' must be one of 'auto', 'split'"):
        deal_tp(matrices, FakeGroup(tp), "half")


def test_muon_tp_mode_takes_one_of_its_words():
    with pytest.raises(ValueError, match=r"muon_tp_mode = 'half' must be one of 'auto', 'split'"):
        settings.check_values({**settings.DEFAULTS, "muon_tp_mode": "half"})
    assert settings.DEFAULTS["muon_tp_mode"] == "auto"


# -----------------------------------------------------------------------------
# through train.py: one launch of four ranks, against one process

STEPS = 4
TINY = [
    "--n_layer=2",
    "--n_embd=64",
    "--n_head=4",
    "--n_kv_head=1",  # multi-query: k and v replicated across the tp ranks, never dealt
    "--block_size=32",
    "--device=cpu",
    f"--max_iters={STEPS}",
    "--log_interval=1",
    "--eval_interval=2",
    "--eval_iters=1",
    "--warmup_iters=2",
    "--learning_rate=3e-3",
    "--gradient_accumulation_steps=2",
    "--optimizer=muon",
    "--bucket_size_mb=0.01",
    f"--checkpoint_interval={STEPS}",
]
ONE_REPLICA, TWO_REPLICAS = ["--batch_size=4"], ["--batch_size=2"]
# --peak_flops is Newton-Schulz's rate for 'auto' too: over gloo's 1.35 GB/s, q and o (64 x 64:
# 7.9 MFLOP, 16 KiB) split below 648 GFLOP/s, the MLP's (192 x 64: 18.4 MFLOP, 48 KiB) below 504;
# 1e12 (no probe at start-up) replicates every matrix of this model under 'auto' (test_muon.py's)
RUNS = {
    "dp2_tp2_zero1_split": TWO_REPLICAS
    + ["--tp=2", "--zero_stage=1", "--muon_tp_mode=split", "--peak_flops=1e12"],
    "dp2_tp2_zero0_split": TWO_REPLICAS
    + ["--tp=2", "--zero_stage=0", "--muon_tp_mode=split", "--peak_flops=1e12"],
    "dp2_tp2_zero2_split": TWO_REPLICAS
    + ["--tp=2", "--zero_stage=2", "--muon_tp_mode=split", "--peak_flops=1e12"],
    "tp2_pp2_auto_attention_split": ONE_REPLICA
    + ["--tp=2", "--pp=2", "--muon_tp_mode=auto", "--peak_flops=5.8e11"],
    "tp2_pp2_replicate": ONE_REPLICA
    + ["--tp=2", "--pp=2", "--muon_tp_mode=replicate", "--peak_flops=1e12"],
}
# on rank 0, how many of its matrices' Newton-Schulz it deals over the tp ranks: dp2 x tp2 (q, o,
# gate, up, down in each of 2 blocks, less at ZeRO-1, where rank 0 steps only the matrices dealt
# to its replica), tp2 x pp2 (rank 0's one block: q and o under auto)
DEALT_ON_RANK_0 = {
    "dp2_tp2_zero0_split": 10,
    "tp2_pp2_auto_attention_split": 2,
    "tp2_pp2_replicate": 0,
}


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    """One process, in the test process: (records, its final checkpoint)."""
    out = str(tmp_path_factory.mktemp("one_process"))
    records = train_in_process(
        TINY + ONE_REPLICA + ["--peak_flops=1e12", f"--data_dir={data_dir}", f"--out_dir={out}"]
    )
    return records, os.path.join(out, f"ckpt_{STEPS:07d}")


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    """Every run of RUNS, one after another in one launch of four ranks: {name: (records,
    checkpoint, rank 0's stdout)}."""
    outs = {name: str(tmp_path_factory.mktemp(name)) for name in RUNS}
    argv = [
        TINY + layout + [f"--data_dir={data_dir}", f"--out_dir={outs[name]}"]
        for name, layout in RUNS.items()
    ]
    done = train_on_ranks(argv, 4)
    return {
        name: (records, os.path.join(outs[name], f"ckpt_{STEPS:07d}"), stdout)
        for name, (records, stdout) in zip(RUNS, done)
    }


@pytest.mark.parametrize("name", list(RUNS))
def test_each_mode_equals_one_process(name, runs, reference):
    records, ckpt, stdout = runs[name]
    mode = next(a.split("=")[1] for a in RUNS[name] if a.startswith("--muon_tp_mode="))
    assert f"muon_tp_mode='{mode}': rank 0 deals" in stdout
    if name in DEALT_ON_RANK_0:
        assert f"rank 0 deals {DEALT_ON_RANK_0[name]} matrices'" in stdout
    assert_same_losses_and_norms(records, reference[0], label=name)
    assert_same_tensors(checkpoint_weights(ckpt), checkpoint_weights(reference[1]), label=name)
    assert_same_tensors(
        checkpoint_optimizer_states(ckpt),
        checkpoint_optimizer_states(reference[1]),
        what="optimizer states",
        label=name,
    )


def test_split_at_zero1_deals_each_replicas_matrices_over_its_tp_ranks(runs):
    """At dp2 x tp2 ZeRO-1 rank 0's replica steps about half the 10 tp-split matrices (the deal
    over dp balances work, not count): rank 0 deals all of those, at least one, fewer than 10."""
    stdout = runs["dp2_tp2_zero1_split"][2]
    dealt = int(stdout.split("rank 0 deals ")[1].split(" ")[0])
    assert 0 < dealt < 10
