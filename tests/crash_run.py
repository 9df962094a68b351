"""train.py that crashes at a chosen point, for tests/test_checkpoint.py: one rank stops there as a
killed process would (os._exit: no exception handler, no cleanup, no collective), at the same point
every run, whatever the machine's speed.

    torchrun --nproc_per_node=2 tests/crash_run.py --crash=STAGE:STEP:RANK[:once] <train.py's args>

STAGE is one of
  after_step   optimizer step STEP is taken (counted from the start of the run, a resumed one
               included), before it is logged or saved
  mid_save     inside the save of step STEP: this rank has written its file, rank 0 has not yet
               written meta.json nor renamed the folder (the checkpoint stays ckpt_<STEP>.tmp)
  sigterm      after optimizer step STEP the rank sends itself SIGTERM (as SLURM would), goes on
  sigstop      after optimizer step STEP the rank stops itself with SIGSTOP (a hung rank: it never
               answers again), after printing its pid
With `once`, the rank does it only the first time (a marker file in out_dir remembers it), so that a
run restarted by torchrun --max-restarts, resumed from its checkpoint, goes past the same step. Only
rank RANK crashes; torchrun then stops the others. The hooks are monkeypatches of train.py and
checkpoint.py in this process only: the product code carries no test hooks.
"""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import checkpoint  # noqa: E402
import train  # noqa: E402

CRASH_EXIT_CODE = 43


def crash(stage, at_step, crash_rank, marker):
    """This rank does `stage` now: a signal to itself, or an exit with no cleanup."""
    if marker is not None:
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        open(marker, "w").close()
    if stage == "sigterm":
        print(
            f"crash_run: rank {crash_rank} sends itself SIGTERM after step {at_step}",
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if stage == "sigstop":
        print(
            f"crash_run: rank {crash_rank} (pid {os.getpid()}) stops itself after step {at_step} "
            f"at {time.time():.3f}",
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    print(
        f"crash_run: rank {crash_rank} exits at {stage} of step {at_step} at {time.time():.3f}",
        flush=True,
    )
    os._exit(CRASH_EXIT_CODE)


def install_crash(stage, at_step, crash_rank, marker=None):
    here = int(os.environ.get("RANK", 0)) == crash_rank
    if marker is not None and os.path.exists(marker):
        here = False  # `once`: done in an earlier launch

    if stage in ("after_step", "sigterm", "sigstop"):
        resume, train_step, step = checkpoint.resume_run, train.train_step, [0]

        def resume_counting(*args, **kwargs):
            out = resume(*args, **kwargs)
            step[0] = out[0]  # the resumed run counts on from the checkpoint's step
            return out

        def train_step_then_crash(*args, **kwargs):
            out = train_step(*args, **kwargs)
            step[0] += 1
            if here and step[0] == at_step:
                crash(stage, at_step, crash_rank, marker)
            return out

        checkpoint.resume_run, train.train_step = resume_counting, train_step_then_crash
    elif stage == "mid_save":
        save, gather, saving = checkpoint.save, checkpoint._gather, [None]

        def save_noting_the_step(out_dir, step, *args, **kwargs):
            saving[0] = step
            try:
                return save(out_dir, step, *args, **kwargs)
            finally:
                saving[0] = None

        def gather_or_crash(obj):
            # save's first gather comes right after this rank's torch.save: its file is on disk
            if here and saving[0] == at_step:
                crash(stage, at_step, crash_rank, marker)
            return gather(obj)

        checkpoint.save, checkpoint._gather = save_noting_the_step, gather_or_crash
    else:
        sys.exit(f"crash_run: unknown stage {stage!r}: after_step, mid_save, sigterm or sigstop")


if __name__ == "__main__":
    argv = sys.argv[1:]
    crash_args = [a for a in argv if a.startswith("--crash=")]
    if len(crash_args) != 1:
        sys.exit("usage: tests/crash_run.py --crash=STAGE:STEP:RANK <train.py's arguments>")
    stage, at_step, crash_rank, *once = crash_args[0].split("=", 1)[1].split(":")
    out_dir = [a.split("=", 1)[1] for a in argv if a.startswith("--out_dir=")]
    marker = (
        os.path.join(out_dir[-1], f"crash_run_{stage}_{at_step}_{crash_rank}") if once else None
    )
    install_crash(stage, int(at_step), int(crash_rank), marker)
    train.run_script(train.main, [a for a in argv if a not in crash_args])  # as train.py ends
