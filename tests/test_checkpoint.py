"""Sharded checkpoints: atomic, pruned, resharded on resume, and surviving a rank that dies mid-step
or mid-save. (The dp2 x tp2 x pp2 ZeRO-3 run whose checkpoints the resharding tests resume is itself
held to one process by the equivalence matrix, tests/matrix.py's dp2-tp2-pp2, which also resumes one
at one process.)

The reference is one process that trains without interruption on the same global batch (batch_size 4
x 2 micro-batches; runs with 2 replicas take batch_size 2, with 4 replicas 1): every other run,
resumed or not, must have the reference's losses and gradient norms step for step and its weights
where both saved them (tests/dist_utils.py: the equivalence rule).
"""

import json
import os
import shutil

import pytest
import torch

import checkpoint
from dist_utils import (
    assert_same_losses_and_norms,
    assert_same_tensors,
    checkpoint_weights,
    run_train,
    train_in_process,
    train_on_ranks,
)

TINY = [
    "--n_layer=2",
    "--n_embd=64",
    "--n_head=4",
    "--n_kv_head=4",
    "--block_size=32",
    "--device=cpu",
    "--log_interval=1",
    "--eval_interval=1",
    "--eval_iters=1",
    "--warmup_iters=2",
    "--lr_decay_iters=10",
    "--learning_rate=3e-3",
    "--gradient_accumulation_steps=2",
    "--bucket_size_mb=0.01",
    # skips timing a CPU matmul on each rank at start-up
    "--peak_flops=1e12",
]
ONE_RANK = ["--batch_size=4"]
TWO_REPLICAS = ["--batch_size=2"]


# -----------------------------------------------------------------------------
# atomic writes and pruning (one process, checkpoint.py directly)


def _save(out_dir, step, keep_last_n=0):
    piece = {
        "tensor": torch.full((4,), float(step)),
        "full_shape": [4],
        "tp_dim": None,
        "tp_rank": 0,
        "tp_world": 1,
        "flat_range": [0, 4],
    }
    return checkpoint.save(
        str(out_dir), step, 0, 1, {"w": piece}, {}, {"adam_step": step}, keep_last_n=keep_last_n
    )


def test_keep_last_n_keeps_the_newest_n_complete_checkpoints(tmp_path):
    for step in (1, 2, 3, 4, 5):
        _save(tmp_path, step, keep_last_n=2)
    assert sorted(os.listdir(tmp_path)) == ["ckpt_0000004", "ckpt_0000005"]


def test_latest_checkpoint_ignores_a_partial_tmp_folder_and_a_truncated_rank_file(tmp_path):
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    # a save that crashed before every rank had written: never renamed
    os.makedirs(tmp_path / "ckpt_0000006.tmp")
    (tmp_path / "ckpt_0000006.tmp" / "rank00000.pt").write_bytes(b"partial")
    # a folder whose rank file is shorter than meta.json says (a disk that filled up, a copy cut
    # short)
    shutil.copytree(tmp_path / "ckpt_0000004", tmp_path / "ckpt_0000008")
    with open(tmp_path / "ckpt_0000008" / "rank00000.pt", "r+b") as f:
        f.truncate(10)
    assert checkpoint.latest_checkpoint(str(tmp_path)) == str(tmp_path / "ckpt_0000004")
    meta = json.loads((tmp_path / "ckpt_0000004" / "meta.json").read_text())
    assert meta["step"] == 4


def test_a_checkpoint_is_found_by_its_folder_its_name_with_or_without_zeros_or_its_step(tmp_path):
    for step in (100, 300):
        _save(tmp_path, step)
    want = str(tmp_path / "ckpt_0000300")
    for ckpt in (want, str(tmp_path / "ckpt_300"), "ckpt_300", "ckpt_0000300", "300"):
        assert checkpoint.find_checkpoint(ckpt, str(tmp_path)) == want, ckpt
    assert checkpoint.find_checkpoint("", str(tmp_path)) == want  # none named: the newest
    assert checkpoint.find_checkpoint("", want) == want  # out_dir naming one checkpoint: that one


def test_a_checkpoint_that_is_not_there_is_named_with_the_list_of_those_that_are(tmp_path):
    for step in (100, 200):
        _save(tmp_path, step)
    listed = f"; the complete checkpoints in {tmp_path} are ckpt_0000100, ckpt_0000200"
    for ckpt in (str(tmp_path / "ckpt_300"), "300"):
        with pytest.raises(FileNotFoundError) as error:
            checkpoint.find_checkpoint(ckpt, str(tmp_path))
        assert str(error.value) == (
            f"--ckpt={ckpt} is not a complete checkpoint (a ckpt_* folder with its meta.json "
            f"and every rank file): {tmp_path} has no ckpt_0000300{listed}"
        )
    with pytest.raises(
        FileNotFoundError, match="it is a run's folder, not one checkpoint.*" + listed
    ):
        checkpoint.find_checkpoint(str(tmp_path), "out")
    # one that is there but damaged says what is wrong with it
    (tmp_path / "ckpt_0000200" / "meta.json").unlink()
    with pytest.raises(
        FileNotFoundError,
        match=f"{tmp_path / 'ckpt_0000200'}: it has no meta.json; the complete "
        f"checkpoints in {tmp_path} are ckpt_0000100$",
    ):
        checkpoint.find_checkpoint("200", str(tmp_path))
    with pytest.raises(
        FileNotFoundError, match=f"no complete checkpoint in out_dir '{tmp_path / 'empty'}'"
    ):
        checkpoint.find_checkpoint("", str(tmp_path / "empty"))


# -----------------------------------------------------------------------------
# save at one layout, resume at others


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory):
    """One process, 10 steps, checkpoints at steps 5 and 10, here in the test process: the reference
    records and weights."""
    out = str(tmp_path_factory.mktemp("ref"))
    records = train_in_process(
        TINY
        + ONE_RANK
        + [
            f"--data_dir={data_dir}",
            f"--out_dir={out}",
            "--max_iters=10",
            "--checkpoint_interval=5",
        ]
    )
    return records, out


# name: (processes, the layout the step-3 checkpoint of the dp2 x tp2 x pp2 run resumes at)
RESUMES = {
    # the joined moments cut again
    "dp1_tp2_pp2_zero1": (4, ONE_RANK + ["--tp=2", "--pp=2", "--zero_stage=1"]),
    # 2 ZeRO-3 shards cut into 4
    "dp4_tp1_pp2_zero3": (8, ["--batch_size=1", "--tp=1", "--pp=2", "--zero_stage=3"]),
}


def resume_argv(data_dir, out, layout):
    """A resume to step 5 in out, where a later save that never completed (its .tmp folder was never
    renamed) must be ignored."""
    os.makedirs(out / "ckpt_0000004.tmp")
    (out / "ckpt_0000004.tmp" / "rank00000.pt").write_bytes(b"partial")
    return (
        TINY
        + layout
        + [
            f"--data_dir={data_dir}",
            f"--out_dir={out}",
            "--max_iters=5",
            "--checkpoint_interval=5",
            "--init_from=resume",
        ]
    )


@pytest.fixture(scope="module")
def eight_ranks(data_dir, tmp_path_factory):
    """One launch of 8 processes: 5 steps at dp2 x tp2 x pp2 with ZeRO-3 (tied embeddings: their
    shards summed across the two stages) and activation checkpointing (each block gathered again for
    its recompute), checkpoints at steps 3 and 5, each of the 8 ranks saving its own part of the
    weights and of the Adam moments; then the resumes of RESUMES at 8 processes from its step-3
    checkpoint. {"3d": (records, out_dir, stdout), name: ...}."""
    out = tmp_path_factory.mktemp("dp2_tp2_pp2")
    outs = {
        "3d": out,
        **{name: tmp_path_factory.mktemp(name) for name, (n, _) in RESUMES.items() if n == 8},
    }
    runs = [
        TINY
        + TWO_REPLICAS
        + [
            f"--data_dir={data_dir}",
            f"--out_dir={out}",
            "--max_iters=5",
            "--checkpoint_interval=3",
            "--tp=2",
            "--pp=2",
            "--zero_stage=3",
            "--activation_checkpointing=True",
        ]
    ]
    runs += [
        (resume_argv(data_dir, outs[name], RESUMES[name][1]), out / "ckpt_0000003")
        for name in list(outs)[1:]
    ]
    results = {
        name: (records, outs[name], stdout)
        for name, (records, stdout) in zip(outs, train_on_ranks(runs, 8))
    }
    stdout = results["3d"][2]
    assert "dp=2 x tp=2 x pp=2" in stdout and "ZeRO-3: the gradients are reduce-scattered" in stdout
    return results


@pytest.fixture(scope="module")
def four_ranks(eight_ranks, uninterrupted, data_dir, tmp_path_factory):
    """One launch of 4 processes: the resumes of RESUMES at 4 processes from the dp2 x tp2 x pp2
    run's step-3 checkpoint, then one process's step-5 checkpoint resumed at dp4 with ZeRO-3 to step
    7. {name: (records, out_dir, stdout)}, the last "one_process_to_dp4_zero3"."""
    outs = {name: tmp_path_factory.mktemp(name) for name, (n, _) in RESUMES.items() if n == 4}
    runs = [
        (resume_argv(data_dir, outs[name], RESUMES[name][1]), eight_ranks["3d"][1] / "ckpt_0000003")
        for name in outs
    ]
    outs["one_process_to_dp4_zero3"] = out = tmp_path_factory.mktemp("one_process_to_dp4_zero3")
    runs.append(
        (
            TINY
            + [
                "--batch_size=1",
                f"--data_dir={data_dir}",
                f"--out_dir={out}",
                "--max_iters=7",
                "--checkpoint_interval=7",
                "--init_from=resume",
                "--zero_stage=3",
            ],
            os.path.join(uninterrupted[1], "ckpt_0000005"),
        )
    )
    return {
        name: (records, outs[name], stdout)
        for name, (records, stdout) in zip(outs, train_on_ranks(runs, 4))
    }


@pytest.mark.parametrize("name", list(RESUMES))
def test_dp2_tp2_pp2_zero3_checkpoint_resumes_at_another_layout(name, request, uninterrupted):
    launch = request.getfixturevalue("eight_ranks" if RESUMES[name][0] == 8 else "four_ranks")
    records, out, stdout = launch[name]
    assert f"resumed from {out / 'ckpt_0000003'} at step 3" in stdout
    assert [r["step"] for r in records if "loss" in r] == [4, 5]
    ref_records, ref_out = uninterrupted
    assert_same_losses_and_norms(records, ref_records)
    assert_same_tensors(
        checkpoint_weights(out / "ckpt_0000005"),
        checkpoint_weights(os.path.join(ref_out, "ckpt_0000005")),
    )


def test_a_one_process_checkpoint_resumes_at_dp4_zero3(four_ranks, uninterrupted):
    """The reverse: whole weights and moments, from one process, cut into four ZeRO-3 shards."""
    records, _, stdout = four_ranks["one_process_to_dp4_zero3"]
    assert "dp=4 x tp=1 x pp=1" in stdout
    assert [r["step"] for r in records if "loss" in r] == [6, 7]
    ref_records, _ = uninterrupted
    assert_same_losses_and_norms(records, ref_records)


# -----------------------------------------------------------------------------
# a rank that dies mid-save, then mid-run: tests/crash_run.py stops it at a chosen point (no timing)


def test_a_run_whose_rank_dies_mid_save_then_mid_run_resumes_to_the_uninterrupted_run(
    data_dir, uninterrupted, tmp_path
):
    out = tmp_path / "run"
    run = TINY + TWO_REPLICAS + [f"--data_dir={data_dir}", f"--out_dir={out}"]
    run += ["--checkpoint_interval=2", "--max_iters=10", "--keep_last_n=2"]

    def crash_run(*argv):
        _, proc = run_train(run + list(argv), nproc=2, check=False, script="tests/crash_run.py")
        # torchrun saw the dead rank and stopped the other
        assert proc.returncode != 0, proc.stdout[-2000:]
        return proc

    # rank 1 writes its file of step 4's checkpoint and dies before rank 0 writes meta.json
    proc = crash_run("--zero_stage=0", "--crash=mid_save:4:1")
    assert "crash_run: rank 1 exits at mid_save of step 4" in proc.stdout
    assert (out / "ckpt_0000004.tmp" / "rank00001.pt").exists()
    assert (
        not (out / "ckpt_0000004.tmp" / "meta.json").exists()
        and not (out / "ckpt_0000004").exists()
    )
    assert checkpoint.latest_checkpoint(str(out)) == str(out / "ckpt_0000002")

    # resumed from step 2 with ZeRO-1 switched on (the saved moments cut into the replicas' shards);
    # it saves step 4 over the crashed save's leftovers, then rank 1 dies after step 5's update
    proc = crash_run("--zero_stage=1", "--init_from=resume", "--crash=after_step:5:1")
    assert f"resumed from {out / 'ckpt_0000002'} at step 2" in proc.stdout
    assert "crash_run: rank 1 exits at after_step of step 5" in proc.stdout
    assert checkpoint.latest_checkpoint(str(out)) == str(out / "ckpt_0000004")
    assert not (out / "ckpt_0000004.tmp").exists()

    # the last run finishes: one launch of our own (no rank dies, so torchrun is not needed)
    [(records, stdout)] = train_on_ranks([run + ["--zero_stage=1", "--init_from=resume"]], 2)
    assert f"resumed from {out / 'ckpt_0000004'} at step 4" in stdout
    # steps 1-4 come from the crashed runs' log, the rest from the last run: one run's records
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 11))
    ref_records, ref_out = uninterrupted
    assert_same_losses_and_norms(records, ref_records)
    ref_weights = checkpoint_weights(os.path.join(ref_out, "ckpt_0000010"))
    assert_same_tensors(checkpoint_weights(out / "ckpt_0000010"), ref_weights)
    # the optimizer state rank 0 logged: both AdamW moments of every parameter at ZeRO-0 (steps
    # 1-2), half of them from the resume with ZeRO-1 on (steps 3-10: the moments cut into shards)
    full = 2 * 4 * sum(p.numel() for p in ref_weights.values())
    state = {r["step"]: r["optimizer_state_bytes"] for r in records if "optimizer_state_bytes" in r}
    assert state == pytest.approx({s: full if s <= 2 else full / 2 for s in range(1, 11)}, rel=0.01)


# -----------------------------------------------------------------------------
# a checkpoint from before the model was built plain and the layout applied to it (commit 7e5f793)

OLD_TP2 = os.path.join(os.path.dirname(__file__), "checkpoints", "tp2_7e5f793")


def test_a_tp2_checkpoint_from_before_the_plain_model_resumes_at_one_process_as_the_unbroken_run(
    tmp_path,
):
    """tests/checkpoints/tp2_7e5f793: step 3 of a tp=2 run made by the code of commit 7e5f793 (2
    blocks, width 16, 2 query heads on 1 key/value head, so each tp rank read the replicated
    key/value head; a vocabulary of 150, padded to 256 at tp=2 and to 192 at one process), and
    unbroken.json, what that run logged at steps 4 to 6 without stopping. Today's one process
    resumes it (the parameter names, the replicated key/value weights, the vocabulary padding all
    read as they were written) and logs the same."""
    import matrix  # (tests/matrix.py's documents: the run's data, made again from its seed)

    data = matrix.make_matrix_data(str(tmp_path / "data"), n_tokens=20000, vocab_size=150)
    out = tmp_path / "run"
    shutil.copytree(os.path.join(OLD_TP2, "ckpt_0000003"), out / "ckpt_0000003")
    records = train_in_process(
        [
            f"--out_dir={out}",
            f"--data_dir={data}",
            "--init_from=resume",
            "--max_iters=6",
            "--tp=1",
            "--device=cpu",
        ]
    )
    unbroken = json.load(open(os.path.join(OLD_TP2, "unbroken.json")))
    assert_same_losses_and_norms(
        [r for r in records if r["step"] > 3], unbroken, label="the old tp=2 checkpoint"
    )
