"""Pipeline parallelism (parallel.py section 4): the schedules' timelines, and pipelined training equal to
one process. The distributed checks share one 4-rank launch (module fixture) and each test reads its part."""
import os
from contextlib import nullcontext

import pytest
import torch
import torch.nn as nn

import train
from dist_utils import (assert_same_losses_and_norms, assert_same_tensors, checkpoint_weights, gather_full,
                        make_token_data, run_ranks, run_train, train_losses)
from model import ModelConfig, Transformer, check_layout
from parallel import (SCHEDULES, ParallelLayout, PipelineComm, bubble_fraction, format_timeline, run_schedule,
                      schedule_timeline, sync_tied_grads, tied_weight_group)

CFG = ModelConfig(vocab_size=512, block_size=16, n_layer=6, n_head=4, n_kv_head=2, n_embd=64)
SEED, M, BATCH = 1234, 8, 2
AUX_WEIGHT = 0.01


# -----------------------------------------------------------------------------
# the timeline, from the same action lists the executor walks


def test_1f1b_timeline_is_warmup_steady_cooldown():
    grid = ["F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3",
            ".  F0 F1 .  B0 F2 B1 F3 B2 .  B3 . ",
            ".  .  F0 B0 F1 B1 F2 B2 F3 B3 .  . "]
    rows = schedule_timeline("1f1b", pp=3, m=4)
    assert [" ".join(f"{a[0]}{a[1]}" if a else ". " for a in row) for row in rows] == grid


def test_afab_timeline_is_all_forwards_then_all_backwards():
    grid = ["F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3",
            ".  F0 F1 F2 F3 .  .  B0 B1 B2 B3 . ",
            ".  .  F0 F1 F2 F3 B0 B1 B2 B3 .  . "]
    rows = schedule_timeline("afab", pp=3, m=4)
    assert [" ".join(f"{a[0]}{a[1]}" if a else ". " for a in row) for row in rows] == grid


@pytest.mark.parametrize("schedule", ["afab", "1f1b"])
def test_timeline_bubble_equals_theory(schedule):
    for pp in range(1, 7):
        for m in range(1, 13):  # m < pp included: 1F1B then runs every forward first on the early stages
            assert bubble_fraction(schedule_timeline(schedule, pp, m)) == pytest.approx((pp - 1) / (m + pp - 1))


def test_printed_timeline_shows_grid_and_bubble():
    text = format_timeline("1f1b", pp=4, m=8)
    assert "stage 0 | F0 F1 F2 F3 .. .. .. B0 F4 B1 F5 B2 F6 B3 F7 B4 .. B5 .. B6 .. B7" in text
    assert "stage 3 | .. .. .. F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .. .. .." in text
    assert "bubble: 27.3% of the slots idle (measured on this timeline); theory (pp - 1) / (m + pp - 1) = 3/11 = 27.3%" in text
    assert "stage 0: 4, stage 1: 3, stage 2: 2, stage 3: 1" in text


@pytest.mark.parametrize("schedule", ["afab", "1f1b"])
def test_schedule_runs_each_forward_and_backward_once_forward_first(schedule):
    for pp in range(1, 6):
        for stage in range(pp):
            for m in range(1, 10):
                actions = SCHEDULES[schedule](pp, stage, m)
                assert sorted(actions) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
                assert all(actions.index(("F", i)) < actions.index(("B", i)) for i in range(m))


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="pp = 8 stages but only n_layer = 6"):
        check_layout(CFG, tp=1, pp=8)


# -----------------------------------------------------------------------------
# one 4-rank launch: pp=4 (uneven split 2-2-1-1) with both schedules, with a stage's auxiliary loss, with
# fewer microbatches than stages; pp=2 x tp=2, with and without activation checkpointing


def make_microbatches(m):
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size), generator=g),
             torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size), generator=g)) for _ in range(m)]


class WithAuxLoss(nn.Module):
    """A stage that returns an auxiliary loss of its output, as a non-last stage with mixture-of-experts
    blocks returns its router's balance loss (the pipeline must backpropagate it from this stage)."""

    def __init__(self, stage):
        super().__init__()
        self.stage = stage

    def forward(self, x, targets=None):
        out, loss = self.stage(x, targets)
        return (out, AUX_WEIGHT * out.pow(2).mean()) if not self.stage.is_last else (out, loss)


class SavedActivations:
    """Bytes autograd holds for backward (parameters excluded), live and at peak, through saved-tensor
    hooks: a saved tensor is counted when packed and uncounted when autograd lets go of it."""

    def __init__(self, model):
        self.params = {p.data_ptr() for p in model.parameters()}
        self.live = self.peak = 0

    def pack(self, t):
        if t.data_ptr() in self.params:
            return t
        return _Held(t, self)

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda h: h.t if isinstance(h, _Held) else h)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


class _Held:
    def __init__(self, t, counter):
        self.t, self.counter, self.nbytes = t, counter, t.numel() * t.element_size()
        counter.live += self.nbytes
        counter.peak = max(counter.peak, counter.live)

    def __del__(self):
        self.counter.live -= self.nbytes


def _stage_step(layout, schedule, m, aux=False, activation_checkpointing=False):
    """One step of this rank's stage; returns its loss part, full grads by (original) name, peak saved bytes
    and the set_grad_sync calls."""
    model = Transformer(CFG, layout.tp_group, layout.pp, layout.pp_rank,
                        activation_checkpointing=activation_checkpointing)
    model.init_weights(SEED)
    comm = PipelineComm.from_layout(layout, CFG.n_embd, "cpu")
    syncs = []
    actions = SCHEDULES[schedule](layout.pp, layout.pp_rank, m)
    with SavedActivations(model) as saved:
        loss = run_schedule(actions, WithAuxLoss(model) if aux else model, make_microbatches(m), comm,
                            set_grad_sync=syncs.append)
    group = tied_weight_group(layout, [0, layout.pp - 1])
    copies = [model.tok_emb.weight] if layout.is_first_stage else [model.lm_head.weight] if layout.is_last_stage else []
    sync_tied_grads(copies, group)
    # numpy: torch tensors would cross the result queue as shared memory, gone once the worker exits
    originals = model.tied_copies()
    grads = {originals.get(name, name): gather_full(p.grad, p, layout.tp_group).numpy()
             for name, p in model.named_parameters()}
    return {"loss": loss.item(), "grads": grads, "peak": saved.peak, "syncs": syncs}


def _pipeline_worker(rank, world_size):
    out = {}
    pp4 = ParallelLayout(1, 1, 4, world_size, rank)
    out["pp4_one_microbatch"] = _stage_step(pp4, "afab", 1)
    out["pp4_afab"] = _stage_step(pp4, "afab", M)
    out["pp4_1f1b"] = _stage_step(pp4, "1f1b", M)
    out["pp4_1f1b_aux"] = _stage_step(pp4, "1f1b", M, aux=True)
    out["pp4_1f1b_m2"] = _stage_step(pp4, "1f1b", 2)
    pp2tp2 = ParallelLayout(1, 2, 2, world_size, rank)
    out["pp2_tp2_afab"] = _stage_step(pp2tp2, "afab", M)
    out["pp2_tp2_1f1b"] = _stage_step(pp2tp2, "1f1b", M)
    out["pp2_tp2_1f1b_checkpointed"] = _stage_step(pp2tp2, "1f1b", M, activation_checkpointing=True)
    out["pp2_tp2_stage"] = pp2tp2.pp_rank
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_pipeline_worker, 4)


def reference(m, aux_after_blocks=()):
    """One process, the whole model: each microbatch's loss / m backpropagated, plus AUX_WEIGHT * mean(h^2)
    of the hidden states after the given blocks (where a pipeline stage with WithAuxLoss would end)."""
    model = Transformer(CFG)
    model.init_weights(SEED)
    aux = []
    for j in aux_after_blocks:
        model.blocks[str(j)].register_forward_hook(lambda mod, inp, h: aux.append(AUX_WEIGHT * h.pow(2).mean()))
    total = 0.0
    for x, y in make_microbatches(m):
        aux.clear()
        loss = model(x, y)[1] + sum(aux)
        (loss / m).backward()
        total += loss.item() / m
    return total, {name: p.grad for name, p in model.named_parameters()}


def assert_grads_match(results, ref_grads, rtol=1e-5, atol=1e-6):
    """Every gradient, element by element: |a - b| <= atol + rtol |b|. Prints how much of that bound the
    worst element used (pytest -s)."""
    seen, worst = set(), (0.0, None)
    for r in results:
        for name, g in r["grads"].items():
            g = torch.from_numpy(g)
            torch.testing.assert_close(g, ref_grads[name], rtol=rtol, atol=atol, msg=lambda s: f"{name}: {s}")
            used = ((g - ref_grads[name]).abs() / (atol + rtol * ref_grads[name].abs())).max().item()
            worst = max(worst, (used, name), key=lambda w: w[0])
            seen.add(name)
    assert seen == set(ref_grads)  # every parameter is on some stage
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    print(f"equivalence | {test} | gradients: the worst element uses {worst[0]:.2e} of |a-b| <= {atol:.0e} + "
          f"{rtol:.0e}|b| ({worst[1]})", flush=True)


def pipeline_loss(results):
    """The logged loss: the stages' parts summed (over tp ranks 0 only: the others hold copies)."""
    return sum(r["loss"] for r in results)


@pytest.mark.parametrize("schedule", ["afab", "1f1b"])
def test_pp4_uneven_split_matches_one_process(ranks, schedule):
    results = [r[f"pp4_{schedule}"] for r in ranks]
    ref_loss, ref_grads = reference(M)
    assert pipeline_loss(results) == pytest.approx(ref_loss, rel=1e-6)
    assert_grads_match(results, ref_grads)
    # the tied embedding: the first stage's table and the last stage's head got the same summed gradient
    assert (results[0]["grads"]["tok_emb.weight"] == results[3]["grads"]["tok_emb.weight"]).all()


def test_pp4_1f1b_with_fewer_microbatches_than_stages_matches_one_process(ranks):
    results = [r["pp4_1f1b_m2"] for r in ranks]
    ref_loss, ref_grads = reference(2)
    assert pipeline_loss(results) == pytest.approx(ref_loss, rel=1e-6)
    assert_grads_match(results, ref_grads)


def test_pp4_auxiliary_loss_of_non_last_stages_is_backpropagated(ranks):
    results = [r["pp4_1f1b_aux"] for r in ranks]
    ref_loss, ref_grads = reference(M, aux_after_blocks=(1, 3, 4))  # stages: blocks 0-1, 2-3, 4, 5
    assert pipeline_loss(results) == pytest.approx(ref_loss, rel=1e-6)
    assert_grads_match(results, ref_grads)
    assert results[0]["loss"] > 0  # a middle stage reports its part


@pytest.mark.parametrize("schedule", ["afab", "1f1b"])
def test_pp2_with_tp2_matches_one_process(ranks, schedule):
    results = [r[f"pp2_tp2_{schedule}"] for r in ranks]
    ref_loss, ref_grads = reference(M)
    tp_rank0 = [results[0], results[2]]  # ranks (pp, tp): 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1)
    assert [r["pp2_tp2_stage"] for r in ranks] == [0, 0, 1, 1]
    assert pipeline_loss(tp_rank0) == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_match(results, ref_grads)


def test_activation_checkpointing_at_pp2_with_tp2_matches_one_process(ranks):
    """Each block recomputed in backward, its tensor-parallel collectives run again there, on every stage:
    the same loss and gradients as one process without recomputation."""
    results = [r["pp2_tp2_1f1b_checkpointed"] for r in ranks]
    ref_loss, ref_grads = reference(M)
    assert pipeline_loss([results[0], results[2]]) == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_match(results, ref_grads)
    for stage in (0, 2):  # it did recompute: each stage held less for backward than without checkpointing
        assert results[stage]["peak"] < ranks[stage]["pp2_tp2_1f1b"]["peak"] / 2


def test_1f1b_holds_at_most_pp_minus_stage_microbatches_afab_all(ranks):
    for stage, r in enumerate(ranks):
        one = r["pp4_one_microbatch"]["peak"]
        assert one > 0
        assert r["pp4_1f1b"]["peak"] == (4 - stage) * one
        assert r["pp4_afab"]["peak"] == M * one


def test_grad_sync_is_requested_before_the_last_backward_only(ranks):
    for r in ranks:
        for key in ("pp4_afab", "pp4_1f1b", "pp2_tp2_1f1b"):
            assert r[key]["syncs"] == [False] * (M - 1) + [True]


# -----------------------------------------------------------------------------
# through train.py


def test_plain_forward_backward_requests_grad_sync_before_its_last_backward_only():
    model = Transformer(CFG)
    model.init_weights(SEED)
    syncs = []
    train.forward_backward(model, make_microbatches(3), nullcontext(), 1.0, set_grad_sync=syncs.append)
    assert syncs == [False, False, True]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_token_data(str(tmp_path_factory.mktemp("pp_data")))


TRAIN_ARGS = ["--n_layer=6", "--n_head=4", "--n_kv_head=4", "--n_embd=64", "--block_size=32", "--batch_size=2",
              "--gradient_accumulation_steps=4", "--max_iters=5", "--log_interval=1", "--eval_interval=5",
              "--eval_iters=2", "--checkpoint_interval=5", "--warmup_iters=2", "--learning_rate=1e-2",
              "--peak_flops=1e12"]  # skips timing a CPU matmul on each rank at start-up


def test_train_py_pipelined_matches_one_process(data_dir, tmp_path):
    """pp=2 (AFAB) and pp=4 (1F1B, uneven split): each step's loss and gradient norm, the evaluation's
    losses and the final weights equal one process's."""
    def run(nproc, *extra):
        out = tmp_path / "_".join(extra or ["one_process"])
        records, proc = run_train([f"--data_dir={data_dir}", f"--out_dir={out}", *TRAIN_ARGS, *extra], nproc)
        return records, checkpoint_weights(out / "ckpt_0000005"), proc.stdout

    ref_records, ref_weights, _ = run(1)
    assert len(train_losses(ref_records)) == 5 and [r["step"] for r in ref_records if "val_loss" in r] == [5]
    for nproc, extra in ((2, ("--pp=2", "--pp_schedule=afab")), (4, ("--pp=4", "--pp_schedule=1f1b"))):
        records, weights, stdout = run(nproc, *extra)
        assert_same_losses_and_norms(records, ref_records, label=" ".join(extra))
        assert_same_tensors(weights, ref_weights, label=" ".join(extra))
        assert "blocks per stage" in stdout
    assert "blocks per stage 0: 0-1 | 1: 2-3 | 2: 4 | 3: 5" in stdout  # the uneven split, first stages heavier
