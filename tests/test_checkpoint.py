"""Sharded checkpoints: atomic, pruned, resharded on resume, and surviving a killed rank; and the
dp2 x tp2 x pp2 run whose checkpoints the resharding tests resume, which must itself equal one process.

The reference is one process that trains without interruption on the same global batch (batch_size 4 x 2
micro-batches; runs with 2 replicas take batch_size 2, with 4 replicas 1): every other run's losses must be
the reference's, step for step.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import checkpoint
from dist_utils import (ROOT, assert_same_losses_and_norms, assert_same_tensors, make_token_data, run_train,
                        train_losses)
from model import Transformer, model_config_from

TINY = ["--n_layer=2", "--n_embd=64", "--n_head=4", "--n_kv_head=4", "--block_size=32", "--device=cpu",
        "--log_interval=1", "--eval_interval=0", "--warmup_iters=2", "--lr_decay_iters=10",
        "--learning_rate=3e-3", "--gradient_accumulation_steps=2", "--bucket_size_mb=0.01"]
ONE_RANK = ["--batch_size=4"]
TWO_REPLICAS = ["--batch_size=2"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_token_data(str(tmp_path_factory.mktemp("data")))


# -----------------------------------------------------------------------------
# atomic writes and pruning (one process, checkpoint.py directly)


def _save(out_dir, step, keep_last_n=0):
    piece = {"tensor": torch.full((4,), float(step)), "full_shape": [4], "tp_dim": None, "tp_rank": 0,
             "tp_world": 1, "flat_range": [0, 4]}
    return checkpoint.save(str(out_dir), step, 0, 1, {"w": piece}, {}, {"adam_step": step}, keep_last_n=keep_last_n)


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
    # a folder whose rank file is shorter than meta.json says (a disk that filled up, a copy cut short)
    shutil.copytree(tmp_path / "ckpt_0000004", tmp_path / "ckpt_0000008")
    with open(tmp_path / "ckpt_0000008" / "rank00000.pt", "r+b") as f:
        f.truncate(10)
    assert checkpoint.latest_checkpoint(str(tmp_path)) == str(tmp_path / "ckpt_0000004")
    meta = json.loads((tmp_path / "ckpt_0000004" / "meta.json").read_text())
    assert meta["step"] == 4


# -----------------------------------------------------------------------------
# save at one layout, resume at others


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory):
    """One process, 10 steps, a checkpoint at step 5: the reference losses and final weights."""
    out = str(tmp_path_factory.mktemp("ref"))
    records, _ = run_train(TINY + ONE_RANK + [f"--data_dir={data_dir}", f"--out_dir={out}", "--max_iters=10",
                                             "--checkpoint_interval=5"])
    return train_losses(records), os.path.join(out, "ckpt_0000005"), records


@pytest.fixture(scope="module")
def run_3d(data_dir, tmp_path_factory):
    """5 steps at dp2 x tp2 x pp2 with ZeRO-1, checkpoints at steps 3 and 5: each of the 8 ranks saves its
    own part of the weights and of the Adam moments."""
    out = str(tmp_path_factory.mktemp("dp2_tp2_pp2"))
    records, proc = run_train(TINY + TWO_REPLICAS + [f"--data_dir={data_dir}", f"--out_dir={out}", "--max_iters=5",
                                                     "--checkpoint_interval=3", "--tp=2", "--pp=2", "--zero_stage=1"],
                              nproc=8)
    assert "dp=2 x tp=2 x pp=2" in proc.stdout
    return train_losses(records), out, records


def weights(ckpt_path):
    """A checkpoint's weights, loaded into a single-process model (whatever layout saved them)."""
    reader = checkpoint.CheckpointReader(ckpt_path)
    model = Transformer(model_config_from(reader.meta["model"]))
    checkpoint.load_model(model, reader)
    return dict(model.named_parameters())


def test_dp2_tp2_pp2_zero1_gives_the_losses_and_final_weights_of_one_process(run_3d, uninterrupted):
    (losses, out, records), (ref_losses, ref_ckpt, ref_records) = run_3d, uninterrupted
    # the logged norm is the global one (every dp shard, tp slice and pp stage), the norm that was clipped
    assert_same_losses_and_norms(records, ref_records)
    assert_same_tensors(weights(os.path.join(out, "ckpt_0000005")), weights(ref_ckpt))


@pytest.mark.parametrize("layout, nproc", [
    (ONE_RANK + ["--tp=1", "--pp=1", "--zero_stage=1"], 1),  # the 2 moment shards (and tp slices) joined into 1
    (ONE_RANK + ["--tp=2", "--pp=2", "--zero_stage=0"], 4),  # ZeRO off: AdamW's moments from the ZeRO pieces
    (["--batch_size=1", "--tp=1", "--pp=2", "--zero_stage=1"], 8),  # dp4: the 2 moment shards cut into 4
], ids=["dp1_tp1_pp1_zero1", "dp1_tp2_pp2_zero0", "dp4_tp1_pp2_zero1"])
def test_dp2_tp2_pp2_zero1_checkpoint_resumes_at_another_layout(layout, nproc, run_3d, uninterrupted, data_dir,
                                                                tmp_path):
    shutil.copytree(os.path.join(run_3d[1], "ckpt_0000003"), tmp_path / "ckpt_0000003")
    # a later save that never completed (its .tmp folder was never renamed) must be ignored
    os.makedirs(tmp_path / "ckpt_0000005.tmp")
    (tmp_path / "ckpt_0000005.tmp" / "rank00000.pt").write_bytes(b"partial")
    records, proc = run_train(TINY + layout + [f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=6",
                                               "--checkpoint_interval=0", "--init_from=resume"], nproc=nproc)
    assert f"resumed from {tmp_path / 'ckpt_0000003'} at step 3" in proc.stdout
    assert [r["step"] for r in records if "loss" in r] == [4, 5, 6]
    assert train_losses(records) == pytest.approx(uninterrupted[0][3:6], rel=1e-5)


# -----------------------------------------------------------------------------
# a rank killed mid-run


def _children(pid):
    """Direct child processes of pid, from /proc (no psutil)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    kids.append(int(entry))
            except OSError:
                pass
    return kids


def _rank_of(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return int(env[b"RANK"]) if b"RANK" in env else None


def test_a_rank_killed_mid_run_loses_only_the_steps_since_the_last_complete_checkpoint(data_dir, uninterrupted,
                                                                                      tmp_path):
    reference = uninterrupted[0]
    out = str(tmp_path / "run")
    run = TINY + TWO_REPLICAS + [f"--data_dir={data_dir}", f"--out_dir={out}", "--checkpoint_interval=2"]
    argv = run + ["--zero_stage=0", "--max_iters=100000", "--keep_last_n=2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py")] + argv
    torchrun = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 180
        while not ((latest := checkpoint.latest_checkpoint(out)) and int(latest.rsplit("_", 1)[1]) >= 4):
            assert torchrun.poll() is None and time.time() < deadline, "the run ended before its second checkpoint"
            time.sleep(0.01)
        victim = next(pid for pid in _children(torchrun.pid) if _rank_of(pid) == 1)
        os.kill(victim, signal.SIGKILL)
        assert torchrun.wait(timeout=120) != 0  # torchrun sees the dead rank and stops the others
    finally:
        if torchrun.poll() is None:
            os.killpg(torchrun.pid, signal.SIGKILL)
            torchrun.wait()
    last = int(checkpoint.latest_checkpoint(out).rsplit("_", 1)[1])
    assert 4 <= last < len(reference), "the kill came too late for the reference run to cover the rerun"

    # the rerun also switches ZeRO-1 on: the saved AdamW moments are cut into the two replicas' shards
    steps = len(reference)
    records, proc = run_train(run + [f"--max_iters={steps}", "--init_from=resume", "--zero_stage=1"], nproc=2)
    assert f"resumed from {os.path.join(out, f'ckpt_{last:07d}')} at step {last}" in proc.stdout
    # steps 1..last come from the killed run's log, the rest from the resumed run: one run's worth of losses
    assert [r["step"] for r in records if "loss" in r] == list(range(1, steps + 1))
    assert train_losses(records) == pytest.approx(reference, rel=1e-5)
