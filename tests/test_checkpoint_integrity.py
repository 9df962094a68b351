"""Checkpoints whose bytes are not what was saved, and weights that must not be saved: each rank
file's crc32 is recorded as it is written and checked by every rank that reads it; a save refuses
non-finite weights; `python checkpoint.py --verify` checks a run's checkpoints offline. One 2-rank
launch (run_ranks) holds the multi-rank cases; the rest run here, at one process, on checkpoint.py
directly or on train.main.
"""

import errno
import json
import os
import zlib
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist

import checkpoint
import train
from dist_utils import run_ranks, train_in_process, without_memory_measurement
from model import ModelConfig

TINY = [
    "--n_layer=2",
    "--n_embd=64",
    "--n_head=4",
    "--n_kv_head=4",
    "--block_size=32",
    "--device=cpu",
    "--batch_size=2",
    "--log_interval=1",
    "--eval_interval=0",
    "--peak_flops=1e12",
]
NUMEL = 65536  # 256 KiB of float32: 4 KiB in the middle of the file land in a tensor's bytes


def _piece(value):
    return {
        "tensor": torch.full((NUMEL,), float(value)),
        "full_shape": [NUMEL],
        "tp_dim": None,
        "tp_rank": 0,
        "tp_world": 1,
        "flat_range": [0, NUMEL],
    }


def _save(out_dir, step, value=None, rank=0, world_size=1):
    meta = {"adam_step": step, "model": asdict(ModelConfig())}
    return checkpoint.save(
        str(out_dir),
        step,
        rank,
        world_size,
        {f"w{rank}": _piece(step if value is None else value)},
        {},
        meta,
    )


def _damage(path):
    """4 KiB of 0xff written in the middle of a file: its size is unchanged, and 0xffffffff is a
    float32 NaN."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\xff" * 4096)
    assert os.path.getsize(path) == size


def test_meta_json_records_the_crc32_of_each_file_as_written(tmp_path):
    path = _save(tmp_path, 1)
    meta = json.loads((tmp_path / "ckpt_0000001" / "meta.json").read_text())
    with open(os.path.join(path, "rank00000.pt"), "rb") as f:
        assert meta["file_crc32"] == [zlib.crc32(f.read())]


def test_every_file_and_folder_is_on_the_disk_before_the_checkpoint_is_published(
    tmp_path, monkeypatch
):
    """A power cut, not only a crash: the rank file and meta.json are fsynced before meta.json's
    rename commits the save, and the folders after each rename, before an older checkpoint is
    pruned."""
    events, fsync, rename = [], os.fsync, os.rename

    def fsync_recorded(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        fsync(fd)

    def rename_recorded(src, dst):
        events.append(("rename", os.path.basename(dst)))
        rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync_recorded)
    monkeypatch.setattr(os, "rename", rename_recorded)
    _save(tmp_path, 1)
    assert events == [
        ("fsync", "rank00000.pt"),
        ("fsync", "meta.json.partial"),
        ("rename", "meta.json"),
        ("fsync", "ckpt_0000001.tmp"),
        ("rename", "ckpt_0000001"),
        ("fsync", tmp_path.name),
    ]


def test_a_file_damaged_at_the_same_size_stops_the_resume_naming_it_at_one_process(
    data_dir, tmp_path
):
    """The issue's case: today the NaN loads silently and the run later blames a divergence."""
    argv = TINY + [
        f"--data_dir={data_dir}",
        f"--out_dir={tmp_path}",
        "--max_iters=2",
        "--checkpoint_interval=1",
    ]
    train_in_process(argv)
    damaged = tmp_path / "ckpt_0000002" / "rank00000.pt"
    _damage(damaged)
    with without_memory_measurement(), pytest.raises(SystemExit) as stop:
        train.main(argv[:-2] + ["--max_iters=3", "--init_from=resume"])
    assert stop.value.code.startswith(
        f"error: {damaged} is corrupted, not diverged: its bytes' crc32 is "
    ), stop.value.code
    assert (
        f"mv {tmp_path / 'ckpt_0000002'} {tmp_path / 'ckpt_0000002'}.damaged" in stop.value.code
        and f"the newest intact checkpoint, {tmp_path / 'ckpt_0000001'}" in stop.value.code
    ), stop.value.code


def test_a_checkpoint_written_before_checksums_loads_with_a_note(tmp_path):
    path = _save(tmp_path, 1, value=7.0)
    meta_file = tmp_path / "ckpt_0000001" / "meta.json"
    meta = json.loads(meta_file.read_text())
    # as saved before
    meta_file.write_text(json.dumps({k: v for k, v in meta.items() if k != "file_crc32"}))
    notes = []
    reader = checkpoint.open_for_resume(path, ModelConfig(), notes.append)
    assert torch.equal(reader.files[0]["model"]["w0"]["tensor"], torch.full((NUMEL,), 7.0))
    assert notes == [
        f"checkpoint {path} was written before checkpoints had checksums: its files' sizes are "
        f"checked, not their bytes"
    ]


def test_weights_that_are_not_finite_are_never_saved(tmp_path):
    _save(tmp_path, 2)
    with pytest.raises(checkpoint.CheckpointError) as refused:
        _save(tmp_path, 4, value=float("nan"))
    assert str(refused.value) == (
        "the weights are not finite at step 4 (rank 0: w0): checkpoint "
        f"{tmp_path / 'ckpt_0000004'} was not written. Either the run diverged (resume with a "
        "lower --learning_rate) or it was given bad input (a damaged data file or checkpoint: "
        f"python checkpoint.py --verify {tmp_path}). The last finite checkpoint is "
        f"{tmp_path / 'ckpt_0000002'}: resume from it with --init_from=resume"
    )
    assert sorted(os.listdir(tmp_path)) == ["ckpt_0000002"]  # no ckpt_0000004, no .tmp folder


def test_a_save_that_finds_the_disk_full_names_the_checkpoints_older_than_the_newest_intact_one(
    tmp_path, monkeypatch
):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    # complete, not intact: ckpt_0000002 is the one to keep
    _damage(tmp_path / "ckpt_0000003" / "rank00000.pt")

    def full_disk(obj, f):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    with pytest.raises(checkpoint.CheckpointError) as failed:
        _save(tmp_path, 4)
    old = tmp_path / "ckpt_0000001"
    freed = sum(os.path.getsize(old / name) for name in os.listdir(old)) / 2**20
    assert str(failed.value).endswith(
        f"The checkpoints older than the newest intact one "
        f"({tmp_path / 'ckpt_0000002'}) can be deleted to free "
        f"{freed:,.1f} MiB: rm -r {old}; then resume with --init_from=resume"
    ), str(failed.value)


def _verify(out_dir, capsys):
    code = checkpoint.verify_main(["--verify", str(out_dir)])
    return code, capsys.readouterr().out


def test_verify_names_the_newest_checkpoint_intact_and_exits_0(tmp_path, capsys):
    for step in (1, 2):
        _save(tmp_path, step)
    code, out = _verify(tmp_path, capsys)
    assert code == 0, out
    assert out.splitlines()[-2:] == [
        f"the newest intact checkpoint is {tmp_path / 'ckpt_0000002'} (saved by 1 process); resume "
        "from it with:",
        f"  python train.py --init_from=resume --out_dir={tmp_path}",
    ]


def test_verify_exits_1_when_the_newest_is_damaged_and_2_when_there_is_none(tmp_path, capsys):
    for step in (1, 2):
        _save(tmp_path, step)
    _damage(tmp_path / "ckpt_0000002" / "rank00000.pt")
    code, out = _verify(tmp_path, capsys)
    newest = tmp_path / "ckpt_0000002"
    assert code == 1, out
    assert f"{newest}: {newest / 'rank00000.pt'} is corrupted, not diverged" in out
    assert (
        f"the newest intact checkpoint is {tmp_path / 'ckpt_0000001'} (saved by 1 process), older "
        f"than the damaged {newest}: move it aside first (mv {newest} {newest}.damaged)"
    ) in out
    assert _verify(tmp_path / "empty", capsys)[0] == 2


# --- two ranks: one launch ------------------------------------------------------------------------


def _stop_of(call):
    """(the error's type name, its message) of what call() raised, or None."""
    try:
        call()
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _two_rank_cases(rank, world_size, out_dir):
    """A 2-rank run's checkpoints at steps 1 and 2; rank 0 damages rank 1's file of step 2, which
    both ranks then read. Then step 1 read by both, where only rank 1 finds a wrong crc32, and a
    save of step 3 where only rank 1's weights are not finite, and one where rank 0 cannot make the
    save's folder. Each case: what each rank raised."""
    for step in (1, 2):
        _save(out_dir, step, rank=rank, world_size=world_size)
    if rank == 0:
        _damage(os.path.join(out_dir, "ckpt_0000002", "rank00001.pt"))
    dist.barrier()
    results = {
        "damaged": _stop_of(
            lambda: checkpoint.open_for_resume(os.path.join(out_dir, "ckpt_0000002"), None)
        )
    }
    crc32 = checkpoint.file_crc32
    if rank == 1:
        checkpoint.file_crc32 = lambda path: 0
    results["rank_1_only"] = _stop_of(
        lambda: checkpoint.open_for_resume(os.path.join(out_dir, "ckpt_0000001"), None)
    )
    checkpoint.file_crc32 = crc32
    results["not_finite"] = _stop_of(
        lambda: _save(out_dir, 3, float("nan") if rank == 1 else 3.0, rank, world_size)
    )
    makedirs = os.makedirs
    if rank == 0:  # rank 0 alone makes the .tmp folder every rank writes into
        os.makedirs = _no_space
    results["no_folder"] = _stop_of(lambda: _save(out_dir, 4, 4.0, rank, world_size))
    os.makedirs = makedirs
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("two_ranks")
    return out_dir, run_ranks(_two_rank_cases, 2, str(out_dir), timeout=120)


def test_a_damaged_file_stops_every_rank_naming_it(two_ranks):
    out_dir, results = two_ranks
    for rank, result in enumerate(results):
        kind, text = result["damaged"]
        assert kind == "CorruptedCheckpoint", (rank, result)
        assert text.startswith(
            f"{out_dir / 'ckpt_0000002' / 'rank00001.pt'} is corrupted, not diverged"
        ), text


def test_a_file_only_one_rank_reads_wrong_stops_every_rank(two_ranks):
    _, results = two_ranks
    assert [r["rank_1_only"][0] for r in results] == ["CorruptedCheckpoint"] * 2
    assert all("(found by rank 1)" in r["rank_1_only"][1] for r in results), results


def test_weights_not_finite_on_one_rank_stop_every_rank_without_a_save(two_ranks):
    out_dir, results = two_ranks
    assert [r["not_finite"] for r in results] == [results[0]["not_finite"]] * 2
    assert results[0]["not_finite"][1].startswith(
        "the weights are not finite at step 3 (rank 1: w1)"
    )
    assert results[0]["not_finite"][1].endswith(
        f"The last finite checkpoint is {out_dir / 'ckpt_0000001'}: resume "
        f"from it with --init_from=resume"
    )
    assert not os.path.exists(out_dir / "ckpt_0000003") and not os.path.exists(
        out_dir / "ckpt_0000003.tmp"
    )


def test_verify_gives_the_torchrun_command_of_a_two_rank_checkpoint(two_ranks, capsys):
    out_dir, _ = two_ranks
    code, out = _verify(out_dir, capsys)
    assert code == 1, out  # its step-2 checkpoint is damaged
    assert (
        out.splitlines()[-1]
        == f"  torchrun --nproc_per_node=2 train.py --init_from=resume --out_dir={out_dir}"
    )


def test_a_save_whose_folder_rank_0_cannot_make_stops_every_rank_with_the_same_error(two_ranks):
    out_dir, results = two_ranks
    assert [r["no_folder"] for r in results] == [results[0]["no_folder"]] * 2, results
    kind, text = results[0]["no_folder"]
    assert kind == "CheckpointError" and text.startswith(
        f"saving checkpoint {out_dir / 'ckpt_0000004'} failed on "
        f"rank 0: OSError: [Errno 28] No space left on device"
    ), text
