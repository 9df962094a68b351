"""A run that survives its faults: a save killed at any moment, a rank killed mid-run under torchrun
--max-restarts with init_from=auto, SIGTERM, a hung peer, a diverged run, two torchrun agents as two
nodes.

Every fault is chosen from inside the process (tests/crash_run.py, or a patched step of
checkpoint.save), never by timing. The reference is one process training 6 steps without
interruption on the same global batch (tests/dist_utils.py: the equivalence rule).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import checkpoint
from conftest import ROOT
from faults import SAVED_ON_SIGTERM, SIGTERM_MARK
from dist_utils import (
    _free_port,
    assert_same_losses_and_norms,
    assert_same_tensors,
    checkpoint_weights,
    main_exit_and_output,
    read_records,
    run_ranks,
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
    "--lr_decay_iters=6",
    "--learning_rate=3e-3",
    "--gradient_accumulation_steps=2",
    "--bucket_size_mb=0.01",
    "--peak_flops=1e12",
    "--max_iters=6",
    "--checkpoint_interval=2",
]


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    """One process, here in the test process: (records, out_dir)."""
    out = str(tmp_path_factory.mktemp("ref"))
    return train_in_process(
        TINY + ["--batch_size=4", f"--data_dir={data_dir}", f"--out_dir={out}"]
    ), out


def assert_equals_reference(records, out, reference, steps=range(1, 7)):
    assert [r["step"] for r in records if "loss" in r] == list(steps)
    assert_same_losses_and_norms(records, reference[0])
    assert_same_tensors(
        checkpoint_weights(os.path.join(out, "ckpt_0000006")),
        checkpoint_weights(os.path.join(reference[1], "ckpt_0000006")),
    )


# -----------------------------------------------------------------------------
# a save killed at every moment of its own (one process; the two-rank moment is in
# test_checkpoint.py)


def _piece(value):
    return {
        "tensor": torch.full((4,), float(value)),
        "full_shape": [4],
        "tp_dim": None,
        "tp_rank": 0,
        "tp_world": 1,
        "flat_range": [0, 4],
    }


def _save(out_dir, step, value, keep_last_n=0):
    return checkpoint.save(
        str(out_dir),
        step,
        0,
        1,
        {"w": _piece(value)},
        {},
        {"adam_step": step},
        keep_last_n=keep_last_n,
    )


def _value(path):
    return float(checkpoint.CheckpointReader(path).files[0]["model"]["w"]["tensor"][0])


def _killed_save(out_dir, step, value, moment, keep_last_n=0):
    """checkpoint.save in a forked child that SIGKILLs itself at `moment`: the n-th call of
    os.rename (('rename', n)), inside the write of meta.json (('meta', 0)) or inside the removal of
    an old checkpoint (('rmtree', 0): after one file of it is gone)."""
    pid = os.fork()
    if pid == 0:
        try:
            kind, n = moment
            calls = [0]
            die = lambda: os.kill(os.getpid(), signal.SIGKILL)
            if kind == "rename":
                rename = os.rename

                def rename_then_die(a, b):
                    rename(a, b)
                    calls[0] += 1
                    if calls[0] == n:
                        die()

                os.rename = rename_then_die
            elif kind == "meta":

                def dump_half(obj, f, **kw):
                    f.write(json.dumps(obj)[:40])
                    f.flush()
                    die()

                json.dump = dump_half
            elif kind == "rmtree":

                def remove_one_then_die(path, ignore_errors=False):
                    if path.endswith(".old") or not os.path.exists(path):
                        return
                    os.remove(os.path.join(path, sorted(os.listdir(path))[0]))
                    die()

                checkpoint.shutil.rmtree = remove_one_then_die
            _save(out_dir, step, value, keep_last_n)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
        f"the save was not killed: {status}"
    )


# (moment, a fresh step or a re-save of the step, the step whose checkpoint must then be the newest)
MOMENTS = [
    # meta.json half written, in its .partial file: the save never happened
    (("meta", 0), "new", 2),
    (("rename", 1), "new", 4),  # meta.json committed, the folder not yet renamed: the .tmp counts
    (("rename", 2), "new", 4),  # renamed, rotation not begun
    (("rmtree", 0), "new", 4),  # rotation killed halfway through removing the oldest
    (("meta", 0), "resave", 2),  # a re-save of step 2 (a run resumed from an older checkpoint)
    # the old step-2 folder renamed aside, the new one not yet in place
    (("rename", 2), "resave", 2),
    (("rename", 3), "resave", 2),  # the new one in place, the old copy not yet removed
]


@pytest.mark.parametrize(
    "moment, kind, newest", MOMENTS, ids=[f"{k}_{m[0]}{m[1]}" for m, k, _ in MOMENTS]
)
def test_a_save_killed_at_any_moment_leaves_the_previous_checkpoint_or_the_new_one_complete(
    tmp_path, moment, kind, newest
):
    _save(tmp_path, 1, 1.0)
    _save(tmp_path, 2, 2.0)
    if kind == "new":
        _killed_save(tmp_path, 4, 4.0, moment, keep_last_n=2)
        values = {1: 1.0, 2: 2.0, 4: 4.0}
    else:
        _killed_save(tmp_path, 2, 20.0, moment)
        values = {1: 1.0, 2: 20.0 if moment[1] >= 2 else 2.0}
    latest = checkpoint.latest_checkpoint(str(tmp_path))
    assert checkpoint.step_of(latest) == newest, (os.listdir(tmp_path), latest)
    # every one that counts reads back whole
    for path in checkpoint.complete_checkpoints(str(tmp_path)):
        assert _value(path) == values[checkpoint.step_of(path)], (path, os.listdir(tmp_path))
    # the next save of that step, and one after it, clean up and succeed
    _save(tmp_path, newest, 30.0)
    _save(tmp_path, 6, 6.0, keep_last_n=2)
    assert sorted(os.listdir(tmp_path)) == [f"ckpt_{newest:07d}", "ckpt_0000006"]
    assert _value(checkpoint.latest_checkpoint(str(tmp_path))) == 6.0


def test_keep_last_n_keeps_what_it_is_told_to(tmp_path):
    _save(tmp_path, 1, 1.0)
    for step in (2, 3, 4):
        checkpoint.save(
            str(tmp_path),
            step,
            0,
            1,
            {"w": _piece(step)},
            {},
            {"adam_step": step},
            keep_last_n=2,
            keep=(str(tmp_path / "ckpt_0000001"),),
        )
    assert sorted(os.listdir(tmp_path)) == ["ckpt_0000001", "ckpt_0000003", "ckpt_0000004"]


# -----------------------------------------------------------------------------
# a rank killed mid-run: torchrun --max-restarts restarts the job, init_from=auto resumes it


def test_a_rank_killed_mid_run_is_recovered_by_torchrun_restarts_with_init_from_auto(
    data_dir, reference, tmp_path
):
    out = tmp_path / "run"
    records, proc = run_train(
        TINY
        + [
            "--batch_size=2",
            f"--data_dir={data_dir}",
            f"--out_dir={out}",
            "--init_from=auto",
            "--crash=after_step:5:1:once",
        ],
        nproc=2,
        script="tests/crash_run.py",
        torchrun=["--standalone", "--max-restarts=2", "--monitor-interval=0.5"],
    )
    text = proc.stdout + proc.stderr
    assert "crash_run: rank 1 exits at after_step of step 5" in text
    assert (
        "init_from='auto': out_dir" in text
        and "holds no complete checkpoint, starting from scratch" in text
    )
    assert f"resumed from {out / 'ckpt_0000004'} at step 4" in text
    assert_equals_reference(records, out, reference)


def test_sigterm_stops_every_rank_at_one_step_with_a_checkpoint_and_auto_continues(
    data_dir, reference, tmp_path
):
    out = tmp_path / "run"
    run = TINY + [
        "--batch_size=2",
        f"--data_dir={data_dir}",
        f"--out_dir={out}",
        "--init_from=auto",
    ]
    # rank 1 gets SIGTERM during step 3; the ranks' vote, read a step later, stops both after step 4
    _, proc = run_train(
        run + ["--checkpoint_interval=0", "--crash=sigterm:3:1"],
        nproc=2,
        script="tests/crash_run.py",
        check=False,
    )
    assert "stopped by SIGTERM: every rank finished step 4 and saved it" in proc.stdout, (
        proc.stdout[-2000:]
    )
    assert checkpoint.latest_checkpoint(str(out)) == str(out / "ckpt_0000004")
    # each rank exits SAVED_ON_SIGTERM, which torchrun reports as its own 1: rank 0's mark says it
    assert proc.returncode == 1 and proc.stderr.count(f"exitcode  : {SAVED_ON_SIGTERM} ") == 2, (
        proc.stderr[-3000:]
    )
    assert (out / SIGTERM_MARK).read_text() == "4\n"
    [(records, stdout)] = train_on_ranks([run], 2)
    assert f"resumed from {out / 'ckpt_0000004'} at step 4" in stdout
    # the launch that continues the run takes its mark away
    assert not (out / SIGTERM_MARK).exists()
    # a run stopped by SIGTERM saves at once, without the evaluation of its last step
    unevaluated = [r for r in reference[0] if not ("train_loss" in r and r["step"] == 4)]
    assert_equals_reference(records, out, (unevaluated, reference[1]))


def test_a_run_stopped_by_sigterm_exits_75_with_its_step_saved(data_dir, tmp_path):
    """75, not 0 (a finished run) nor 1 (an error): scripts/slurm.sh requeues the job on it."""
    out = tmp_path / "run"
    _, proc = run_train(
        TINY
        + [
            "--batch_size=4",
            f"--data_dir={data_dir}",
            f"--out_dir={out}",
            "--eval_interval=0",
            "--checkpoint_interval=0",
            "--crash=sigterm:2:0",
        ],
        script="tests/crash_run.py",
        check=False,
    )
    assert proc.returncode == 75, (proc.returncode, proc.stderr[-2000:])
    assert checkpoint.latest_checkpoint(str(out)) == str(out / "ckpt_0000002")
    assert (out / SIGTERM_MARK).read_text() == "2\n"


# scontrol and srun as scripts/slurm.sh calls them, recording what it asks
SLURM_STUBS = {
    "scontrol": "#!/bin/bash\n"
    'if [ "$1" = show ]; then echo node1; else echo "$@" >> "$STUB_LOG"; fi\n',
    "srun": "#!/bin/bash\n"
    '[ -z "$STUB_MARK" ] || { mkdir -p "$(dirname "$STUB_MARK")"; echo 4 > "$STUB_MARK"; }\n'
    'exit "$STUB_STATUS"\n',
}


@pytest.mark.parametrize(
    "status, marks, requeued",
    [(1, True, True), (75, False, True), (1, False, False), (0, False, False)],
)
def test_slurm_sh_requeues_the_job_after_a_sigterm_that_every_rank_saved_on(
    tmp_path, status, marks, requeued
):
    """Under torchrun (srun's status is torchrun's: 1) the mark in out_dir tells the stop; alone,
    status 75."""
    for name, text in SLURM_STUBS.items():
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    mark = tmp_path / "out" / "picotron" / SIGTERM_MARK  # OUT_DIR=out/${SLURM_JOB_NAME}
    mark.parent.mkdir(parents=True)
    mark.write_text("2\n")  # an earlier job's, which must not requeue this one
    env = {
        **os.environ,
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_JOB_ID": "123",
        "SLURM_JOB_NAME": "picotron",
        "SLURM_JOB_NUM_NODES": "1",
        "STUB_LOG": str(tmp_path / "log"),
        "STUB_STATUS": str(status),
        "STUB_MARK": str(mark) if marks else "",
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "slurm.sh")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == status, proc.stderr
    log = (tmp_path / "log").read_text() if (tmp_path / "log").exists() else ""
    assert log == ("requeue 123\n" if requeued else ""), (log, proc.stdout)


def test_the_stop_vote_puts_back_the_sigterm_handler_it_replaced():
    """A finished vote holds nothing past its run: the handler it installed holds the vote and its
    group."""
    from types import SimpleNamespace
    from faults import StopVote

    before = signal.getsignal(signal.SIGTERM)
    vote = StopVote(SimpleNamespace(world_size=1))
    assert signal.getsignal(signal.SIGTERM) == vote._ask
    vote.finish()
    assert signal.getsignal(signal.SIGTERM) is before


# -----------------------------------------------------------------------------
# a hung peer: the survivor stops within dist_timeout_s, saying what it waited for


def test_a_hung_peer_stops_the_survivor_within_dist_timeout_s_with_a_message(data_dir, tmp_path):
    port, procs = _free_port(), []
    argv = TINY + [
        "--batch_size=2",
        f"--data_dir={data_dir}",
        f"--out_dir={tmp_path}",
        "--dist_timeout_s=4",
        "--crash=sigstop:2:1",
    ]
    # what torchrun would start, without torchrun (which waits 30 s for a stopped rank)
    for rank in (
        0,
        1,
    ):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(ROOT / "tests/crash_run.py"), *argv],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        out, err = procs[0].communicate(timeout=120)
        stopped_at = time.time()
    finally:
        procs[1].kill()
    rank1 = procs[1].communicate()[0]
    assert procs[0].returncode == 1, (out[-2000:], err[-3000:])
    line = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert line and "rank 0 stopped in" in line[0] and "dist_timeout_s = 4 s" in line[0], err[
        -3000:
    ]
    # rank 1 stopped right after step 2's optimizer step: rank 0 waited in that step's log line
    assert "stopped in the log line of step 2 (an all-reduce of the loss)" in line[0], line
    # the wait gloo itself applied, as its error states it (not the wall clock, which a busy machine
    # stretches): 4 s, not torch's default of 30 minutes (communicate's 120 s bounds the rest)
    assert "Timed out waiting 4000ms" in line[0], line
    hung_at = float(rank1.split("stops itself after step 2 at ")[1].split()[0])
    print(f"the survivor exited {stopped_at - hung_at:.1f} s after its peer hung")


# -----------------------------------------------------------------------------
# the end of a finished script: a gloo worker still releasing a collective must not abort it

# Installed as sitecustomize.py (Python imports it at start-up): its exit handler, the last to run,
# leaves a gloo worker waiting for the GIL when the interpreter finalizes, every time: the state a
# busy machine left now and then at the end of a run (one abort in a suite run or two, "terminate
# called without an active exception", a finished run reported failed).
GIL_WAITER = """
import atexit, os, sys, time

def leave_a_gloo_worker_waiting_for_the_gil():
    import torch, torch.distributed as dist
    sys.setswitchinterval(100.0)  # no waiting thread gets the GIL before this one blocks
    if not dist.is_initialized():
        store = "file://" + os.environ["GIL_WAITER_STORE"]
        dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    # its worker holds the last references to the tensor
    dist.all_reduce(torch.ones(1), async_op=True)
    end = time.time() + 0.2  # the worker finishes and asks for the GIL, to release them
    while time.time() < end:
        pass

atexit.register(leave_a_gloo_worker_waiting_for_the_gil)
"""


@pytest.mark.parametrize("script", ["train.py", "tools/bench.py"])
def test_a_finished_script_exits_0_with_a_gloo_worker_still_releasing_a_collective(
    script, data_dir, tmp_path
):
    (tmp_path / "sitecustomize.py").write_text(GIL_WAITER)
    env = {"PYTHONPATH": str(tmp_path), "GIL_WAITER_STORE": str(tmp_path / "store")}
    argv = {
        "train.py": TINY
        + [
            "--batch_size=4",
            f"--data_dir={data_dir}",
            f"--out_dir={tmp_path / 'run'}",
            "--max_iters=1",
            "--eval_interval=0",
            "--checkpoint_interval=0",
        ],
        "tools/bench.py": [
            "--n_layer=1",
            "--n_embd=32",
            "--n_head=2",
            "--n_kv_head=2",
            "--block_size=16",
            "--vocab_size=64",
            "--batch_size=1",
            "--warmup_steps=0",
            "--bench_steps=1",
            "--peak_flops=1e12",
        ],
    }[script]
    _, proc = run_train(argv, env=env, check=False, script=script)
    assert proc.returncode == 0 and "terminate called" not in proc.stderr, (
        proc.returncode,
        proc.stderr[-2000:],
    )


def test_a_script_that_stops_with_an_error_exits_1_with_a_gloo_worker_still_releasing_a_collective(
    data_dir, tmp_path
):
    """An error ends past the teardown too: status 1 and the error line, not SIGABRT (-6)."""
    (tmp_path / "sitecustomize.py").write_text(GIL_WAITER)
    env = {"PYTHONPATH": str(tmp_path), "GIL_WAITER_STORE": str(tmp_path / "store")}
    _, proc = run_train(
        TINY
        + ["--batch_size=4", f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'run'}", "--tp=2"],
        env=env,
        check=False,
    )
    assert proc.returncode == 1 and "terminate called" not in proc.stderr, (
        proc.returncode,
        proc.stderr[-2000:],
    )
    assert proc.stderr.count("error: WORLD_SIZE = 1 process cannot be cut into tp = 2") == 1, (
        proc.stderr[-2000:]
    )


RANK_0_LATE = (
    "import os, time\nif os.environ.get('RANK') == '0':\n    time.sleep(3)\n"  # as sitecustomize.py
)


def test_a_layout_error_under_torchrun_is_one_line_by_rank_0_even_when_the_other_rank_stops_first(
    data_dir, tmp_path
):
    """A start-up error under torchrun: rank 0's `error:` line, naming the fix, is picotron's whole
    output, printed before torchrun's report of the failure (its traceback and summary, which no
    worker can shorten), where each rank's entry shows the same line. Rank 0 starts 3 s late: rank
    1, which finds the error first and leaves rank 0 to say it, must not be gone so soon that
    torchrun ends rank 0 before it has."""
    (tmp_path / "sitecustomize.py").write_text(RANK_0_LATE)
    _, proc = run_train(
        TINY
        + ["--batch_size=4", f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'run'}", "--tp=4"],
        nproc=2,
        check=False,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert proc.returncode == 1
    err = proc.stderr.splitlines()
    # torchrun's own, the only one
    torchrun_report = err.index("Traceback (most recent call last):")
    # not torchrun's log
    ours = [line for line in err[:torchrun_report] if not re.match(r"[IWE]\d{4} ", line)]
    assert ours == [
        "error: WORLD_SIZE = 2 processes cannot be cut into tp = 4 x pp = 1: the world size 2 is "
        "not divisible by tp * pp = 4 * 1; launch a multiple of 4 processes or change --tp/--pp"
    ], err
    assert proc.stderr.count("Traceback (most recent call last)") == 1
    assert (
        proc.stderr.count(f"traceback : {ours[0]}") == 2
        and "To enable traceback" not in proc.stderr
    ), err


# -----------------------------------------------------------------------------
# a full disk at a log line: rank 0 alone writes metrics.jsonl, every rank stops there, saving first
# if it can


def _fill_the_disk_at_the_log(at_append, save_too=False):
    """This process's disk fills at its at_append-th append to metrics.jsonl: from it on, each write
    there puts half its line in the file (a short write) and fails with ENOSPC, as a full disk does;
    with save_too, each checkpoint file's write from then on fails the same way
    (checkpoint._save_file). Patches metrics.py's `open` and checkpoint.py in this process only."""
    import builtins
    import errno

    appends = [0]

    def no_space():
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    class FullFile:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise no_space()

    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        if os.path.basename(path) == "metrics.jsonl" and mode == "a":
            appends[0] += 1
            return FullFile(f) if appends[0] >= at_append else f
        return f

    save_file = checkpoint._save_file

    def save_file_on_a_full_disk(obj, path):
        if appends[0] < at_append:
            return save_file(obj, path)
        builtins.open(path, "wb").close()
        raise no_space()

    import metrics

    metrics.open = open_on_a_full_disk
    if save_too:
        checkpoint._save_file = save_file_on_a_full_disk


def test_a_full_disk_at_a_log_line_saves_the_step_stops_in_one_line_and_auto_continues(
    data_dir, reference, tmp_path, capsys
):
    import metrics

    out = tmp_path / "run"
    argv = TINY + [
        "--batch_size=4",
        f"--data_dir={data_dir}",
        f"--out_dir={out}",
        "--init_from=auto",
    ]
    # step 3's log line (steps 1 and 2 each wrote a log and an eval line)
    _fill_the_disk_at_the_log(at_append=5)
    try:
        with pytest.raises(SystemExit) as stop:
            train_in_process(argv)
    finally:
        del metrics.open  # the disk has room again
    assert stop.value.code == (
        f"error: writing the log {out}/metrics.jsonl failed at step 3 (OSError: [Errno 28] No "
        f"space left on device): the run stopped at step 3 and saved {out}/ckpt_0000003. Free "
        f"space on the disk of out_dir '{out}' (or fix its permissions), then launch again with "
        f"--init_from=auto to continue from there"
    )
    capsys.readouterr()
    # the command the message gives: no step lost, the log reads as one run
    records = train_in_process(argv)
    assert (
        f"warning: the last line of {out}/metrics.jsonl (line 5) is cut short, as a kill in the "
        "middle of a write leaves it: dropped it"
    ) in capsys.readouterr().out
    # step 3's line: the one cut short
    assert_equals_reference(records, out, reference, steps=[1, 2, 4, 5, 6])


def _full_disk_on_rank_0(rank, world_size, argv):
    """run_ranks' worker: train.main(argv), rank 0's disk full from step 3's log line (its log and
    its save): (what each rank exited with, its stdout)."""
    if rank == 0:
        _fill_the_disk_at_the_log(at_append=5, save_too=True)
    return main_exit_and_output(argv)


def test_a_full_disk_at_a_log_line_at_dp2_stops_every_rank_there_with_rank_0_s_line(
    data_dir, tmp_path
):
    """Rank 0 alone writes the log; without the agreement it died alone and rank 1 reported a dead
    peer."""
    out = tmp_path / "run"
    argv = TINY + ["--batch_size=2", "--dp=2", f"--data_dir={data_dir}", f"--out_dir={out}"]
    (code0, _), (code1, printed1) = run_ranks(_full_disk_on_rank_0, 2, argv, timeout=240)
    assert code0.startswith(
        f"error: writing the log {out}/metrics.jsonl failed at step 3 (OSError: [Errno 28] No "
        f"space left on device), and saving step 3 failed too: saving checkpoint "
        f"{out}/ckpt_0000003 failed on rank 0: OSError: [Errno 28] No space left on device. "
    ), code0
    assert "the last complete checkpoint is " + str(out / "ckpt_0000002") in code0
    # stopped too, at the same line, without a word: run_script prints rank 0's line only
    assert code1.startswith("error: rank 0 could not write metrics.jsonl") and printed1 == "", code1
    assert sorted(os.listdir(out)) == ["ckpt_0000002", "metrics.jsonl"]


def test_an_error_line_that_torchrun_s_error_file_cannot_take_still_ends_in_that_line(
    tmp_path, monkeypatch, capsys
):
    """On a full disk torchrun's error file may not be writable either: the line must still be
    printed and the status be 1, not the OSError of that write."""
    from faults import end_with_error

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "no such folder" / "error.json"))
    monkeypatch.setenv("RANK", "0")
    assert end_with_error("error: the disk is full") == 1
    assert capsys.readouterr().err == "error: the disk is full\n"


# -----------------------------------------------------------------------------
# a diverged run


def test_a_huge_learning_rate_never_puts_a_nan_in_the_weights_and_stops_the_run(data_dir, tmp_path):
    argv = TINY + [
        "--batch_size=4",
        f"--data_dir={data_dir}",
        f"--out_dir={tmp_path}",
        "--learning_rate=1e3",
        "--max_iters=12",
        "--lr_decay_iters=12",
        "--keep_last_n=1",
    ]
    with pytest.raises(SystemExit) as stop:
        train_in_process(argv)
    assert "a non-finite gradient norm (max_bad_steps = 3 in a row" in str(stop.value.code), (
        stop.value.code
    )
    records = read_records(argv)
    skipped = [r["skipped_steps"] for r in records if "loss" in r]
    assert skipped[-1] >= 1 and skipped[0] == 0, skipped
    paths = checkpoint.complete_checkpoints(str(tmp_path))
    assert paths
    for path in paths:
        for name, w in checkpoint_weights(path).items():
            assert torch.isfinite(w).all(), f"{path}: {name} holds a non-finite value"


def test_zero1_adamw_skips_a_step_on_found_inf_and_equals_adamw_otherwise():
    from parallel import ShardedGradientBuckets, ZeroOneAdamW

    torch.manual_seed(0)
    ref = torch.nn.Parameter(torch.randn(8, 4))
    mine = torch.nn.Parameter(ref.detach().clone())
    adamw = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    zero = ZeroOneAdamW(
        [{"params": [mine], "weight_decay": 0.1}],
        ShardedGradientBuckets([mine], None),
        lr=1e-2,
        betas=(0.9, 0.95),
    )
    for step in range(4):
        grad = torch.randn(8, 4)
        bad = step == 2
        ref.grad, mine.grad = grad.clone(), grad.clone() * (float("nan") if bad else 1.0)
        before = mine.detach().clone()
        if not bad:
            adamw.step()
        zero.step(torch.tensor(1.0 if bad else 0.0))
        if bad:
            assert torch.equal(mine, before), "a skipped step changed the weights"
    assert_same_tensors({"w": mine.detach()}, {"w": ref.detach()}, rtol=1e-6)


# -----------------------------------------------------------------------------
# two torchrun agents as the two nodes of one job (c10d rendezvous on 127.0.0.1)


def test_two_torchrun_agents_as_two_nodes_give_one_process_s_run(data_dir, reference, tmp_path):
    port = _free_port()
    argv = TINY + ["--batch_size=4", "--tp=2", f"--data_dir={data_dir}", f"--out_dir={tmp_path}"]
    agents = []
    for node in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc_per_node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=two_nodes",
            str(ROOT / "train.py"),
            *argv,
        ]
        agents.append(
            subprocess.Popen(
                cmd,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                cwd=ROOT,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    outputs = [a.communicate(timeout=300)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    text = "".join(outputs)
    # tp = 2 over nodes of 1 process each: the one tensor-parallel group spans both, and says so
    assert (
        "warning: 1 tensor-parallel group(s) span two nodes (ranks [0, 1] with 1 process per node)"
        in text
    )
    assert_equals_reference(read_records(argv), tmp_path, reference)


def test_a_restart_at_another_world_size_keeps_the_global_batch_or_says_why():
    from configurator import ConfigError
    from settings import keep_global_batch

    values = {"batch_size": 2, "gradient_accumulation_steps": 2}  # 2 x 2 x dp 2 = 8 windows
    one = dict(values)
    notes = keep_global_batch(one, 8, dp=1)
    assert (one["batch_size"], one["gradient_accumulation_steps"]) == (2, 4), notes
    assert "keep the run's global batch of 8 windows" in notes[0]
    four = dict(values)
    keep_global_batch(four, 8, dp=4)
    assert (four["batch_size"], four["gradient_accumulation_steps"]) == (2, 1)
    eight = dict(values)
    keep_global_batch(eight, 8, dp=8)
    assert (eight["batch_size"], eight["gradient_accumulation_steps"]) == (1, 1)
    with pytest.raises(ConfigError, match="cannot keep"):
        keep_global_batch(dict(values), 8, dp=3)


CHAIN = TINY + [
    "--batch_size=2",
    "--gradient_accumulation_steps=1",
    "--eval_interval=2",
    "--eval_iters=2",
    "--lr_decay_iters=8",
    "--keep_last_n=0",
]


def test_a_chain_of_restarts_keeps_the_recipe_s_global_batch_and_evaluation(
    data_dir, tmp_path, capsys
):
    """2 -> 1 -> 1 -> 2 processes with the same command every time (--batch_size=2
    --gradient_accumulation_steps=1 --init_from=auto, as a config file or scripts/slurm.sh passes
    them): every step's loss and gradient norm, and every evaluation, equal one process training the
    recipe's global batch of 4 windows without a stop. The checkpoint of the launch at one process
    says gradient_accumulation_steps 2; the next launch compares what it is given with the recipe,
    not with that, and is not told the recipe changes. The first launch also names --dp=2: a resumed
    run's dp follows its world size. (The evaluation takes the global batch too, so its losses do
    not depend on how the batch is split.)"""
    reference = train_in_process(
        CHAIN
        + [
            "--gradient_accumulation_steps=2",
            "--max_iters=8",
            f"--data_dir={data_dir}",
            f"--out_dir={tmp_path / 'one_process'}",
        ]
    )
    capsys.readouterr()
    argv = CHAIN + ["--init_from=auto", f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'chain'}"]
    printed = []
    for nproc, steps, extra in ((2, 2, ["--dp=2"]), (1, 4, []), (1, 6, []), (2, 8, [])):
        if nproc == 1:
            train_in_process(argv + [f"--max_iters={steps}"] + extra)
            printed.append(capsys.readouterr().out)
        else:
            [(_, stdout)] = train_on_ranks([argv + [f"--max_iters={steps}"] + extra], nproc)
            printed.append(stdout)
    records = read_records(argv)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 9))
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4, 6, 8]
    assert_same_losses_and_norms(records, reference)
    for text in printed[1:]:
        assert "global batch" in text and "recipe changes" not in text, text
    assert (
        "batch_size 2 x gradient_accumulation_steps 2 keep the run's global batch of 4 windows"
        in printed[1]
    )


def _meta(**config):
    import settings

    layout = {k: config.get(k, 1) for k in ("cp", "tp", "pp", "ep")}
    layout["dp"] = config.pop("saved_dp")
    return {"config": {**settings.DEFAULTS, **config}, "layout": layout}


def _resume(meta, world_size, *argv):
    """settings.resume_settings for a launch of world_size processes given argv (names of settings
    given)."""
    import settings

    given = {"init_from", "out_dir"} | {a.split("=")[0].lstrip("-") for a in argv}
    values = dict(settings.DEFAULTS, init_from="resume", out_dir="out")
    values.update(
        {a.split("=")[0].lstrip("-"): int(a.split("=")[1]) for a in argv if "init_from" not in a}
    )
    if "--init_from=auto" in argv:
        values["init_from"] = "auto"
    return settings.resume_settings(values, given, meta, "out/ckpt_0000004", world_size)


def test_a_resumed_run_s_dp_follows_the_world_size_and_a_batch_change_is_said_only_when_real():
    # --dp=4 was given
    meta = _meta(dp=4, zero_stage=3, batch_size=2, gradient_accumulation_steps=1, saved_dp=4)
    values, notes = _resume(meta, 1, "--gradient_accumulation_steps=4")
    assert values["dp"] == 0 and values["zero_stage"] == 3
    assert not any("recipe changes" in n for n in notes), notes
    assert (
        "resume: batch_size 2 x gradient_accumulation_steps 4 x dp 1 keep the checkpoint's global "
        "batch of 8 windows" in notes
    )
    # resume keeps batch_size and gradient_accumulation_steps: a new batch
    values, notes = _resume(meta, 1)
    assert values["gradient_accumulation_steps"] == 1 and not any(
        "recipe changes" in n for n in notes
    )
    with pytest.raises(ValueError, match="the layout dp=4"):
        _resume(meta, 1, "--dp=4")  # given again: it must fit


def test_an_inherited_layout_that_does_not_fit_the_world_names_where_it_came_from_and_the_flags():
    from configurator import ConfigError

    meta = _meta(cp=2, tp=2, pp=2, saved_dp=1)
    with pytest.raises(
        ConfigError,
        match=r"cp = 2, tp = 2, pp = 2 came from the checkpoint out/ckpt_0000004 .*"
        r"for example --cp=1 --tp=1 --pp=1",
    ):
        _resume(meta, 1)
    # what is given is used; the rest inherited fits 4 processes
    values, _ = _resume(meta, 4, "--pp=1")
    assert (values["cp"], values["tp"], values["pp"], values["dp"]) == (2, 2, 1, 0)


def test_a_restart_on_fewer_ranks_lowers_an_inherited_ep_to_one_that_divides_dp():
    meta = _meta(ep=2, n_expert=4, saved_dp=2)
    values, notes = _resume(meta, 1, "--init_from=auto")
    assert values["ep"] == 1
    assert (
        "resume: ep = 1, the checkpoint's was 2, which does not divide dp = 1 at 1 process"
        in notes[0]
    )
    with pytest.raises(ValueError, match="ep = 2 must divide dp = 1"):
        _resume(meta, 1, "--init_from=auto", "--ep=2")
