"""
What a long run does when a step, a peer or the job's time goes wrong (settings.py's "faults"
section):

  a non-finite step   skipped on the device, counted without a host sync (BadSteps); max_bad_steps
                      in a row stop the run naming the last checkpoint before the trouble
                      (TooManyBadSteps)
  SIGTERM             SLURM's notice before the job's time runs out: every rank stops at the same
                      step, saves, exits SAVED_ON_SIGTERM (StopVote), and --init_from=auto continues
                      from there
  a dead or hung peer every survivor says which rank it is, what it waited in and how to continue
                      (peer_failure tells such an error from the others; end_on_dead_peer), within
                      dist_timeout_s
  the end of a script train.py and tools/bench.py end by run_script, past the interpreter's
                      teardown, where torch's gloo threads can abort a process: 0 finished, 1 an
                      error (said once, by rank 0), 75 stopped and saved by SIGTERM
  a full disk at      rank 0 alone writes metrics.jsonl: every rank learns of its failure at the
  a log line          same line (StopVote.any_rank), saves if it can and stops with rank 0's one
                      line (train.write_log)
  a damaged           `python checkpoint.py --verify OUT_DIR` checks every checkpoint of a run
  checkpoint          offline (sizes and crc32s) and names the newest intact one with its resume
                      command (checkpoint.verify)
  the end of a run    finished or stopped, it says what it trained and how to go on from its newest
                      checkpoint (end_of_run)

A crash mid-save never costs the last good checkpoint (checkpoint.py writes each one in a .tmp
folder and renames it when every rank has finished); a killed rank under torchrun --max-restarts
restarts the job, which resumes from its last checkpoint by itself (init_from='auto':
settings.resume_settings).
"""

import atexit
import json
import os
import shlex
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

import checkpoint
from metrics import format_duration


class BadSteps:
    """The skipped steps of a run, counted on the device (no host sync per step): `total` since the
    start of this launch, the current `streak` in a row, the step it `began` at, and `tripped`, the
    first step of the first streak that reached max_bad_steps (0: none). read() is one host sync,
    done at log lines. With enabled=False (fp16: its loss scaler skips its overflows itself, a lower
    scale is the cure there) nothing is counted."""

    def __init__(self, device, max_bad_steps, enabled=True):
        self.max_bad_steps, self.enabled = max_bad_steps, enabled
        self.counts = torch.zeros(4, device=device)  # total, streak, began, tripped

    def record(self, found_inf, step):
        if not self.enabled:
            return
        total, streak, began, tripped = self.counts.unbind()
        streak = (streak + 1) * found_inf
        began = torch.where(streak == 1, float(step), began)
        tripped = torch.where((tripped == 0) & (streak >= self.max_bad_steps), began, tripped)
        self.counts = torch.stack([total + found_inf, streak, began, tripped])

    def read(self):
        """(total, streak, began, tripped) as ints: a host-device sync."""
        return [int(v) for v in self.counts.tolist()]

    def check(self, out_dir, step):
        """The number of skipped steps so far (a host-device sync: call it at log lines and saves);
        raises TooManyBadSteps, naming the steps and the checkpoint to resume from, once
        max_bad_steps came in a row."""
        total, _, _, tripped = self.read()
        if tripped:
            done = checkpoint.complete_checkpoints(out_dir)
            good = [p for p in done if checkpoint.step_of(p) < tripped]
            last_good = good[-1] if good else "none (start again with --init_from=scratch)"
            raise TooManyBadSteps(
                f"steps {tripped} to {tripped + self.max_bad_steps - 1} all had a non-finite "
                f"gradient norm (max_bad_steps = {self.max_bad_steps} in a row; each was skipped, "
                f"so the weights are those of step {tripped - 1}): the run diverged, stopped at "
                f"step {step}. The last checkpoint written before the trouble is {last_good}: "
                f"resume from it with a lower --learning_rate (--init_from=resume takes the newest "
                f"complete checkpoint in out_dir; those after step {tripped - 1} hold the same "
                f"weights)"
            )
        return total

    def keep(self, out_dir):
        """The checkpoint keep_last_n must keep while a streak of skipped steps goes on: the last
        one written before it began (none when the last step was good)."""
        _, streak, began, _ = self.read()
        if not streak:
            return ()
        good = [
            p for p in checkpoint.complete_checkpoints(out_dir) if checkpoint.step_of(p) < began
        ]
        return tuple(good[-1:])


class TooManyBadSteps(RuntimeError):
    pass


# The exit status of a run that SIGTERM stopped after every rank saved: sysexits.h's EX_TEMPFAIL ("a
# temporary failure: try again"), neither a finished run (0) nor an error (1). torchrun turns any
# worker's status but 0 into its own 1, and ends with 1 after a SIGTERM of its own, so under it the
# stop is also told by the file SIGTERM_MARK that rank 0 leaves in out_dir: scripts/slurm.sh
# requeues the job on either.
SAVED_ON_SIGTERM = 75
SIGTERM_MARK = "stopped_by_sigterm"


class StopVote:
    """SIGTERM (SLURM's notice before the end of a job's time, or torchrun passing on its own) asks
    the run to stop cleanly: finish the step, save, exit 75. Ranks get the signal at different
    moments, so they vote: at the end of every step each rank starts an all-reduce (MAX) of its flag
    on a CPU gloo group, without waiting, and reads the previous step's result, long finished. Every
    rank reads the same vote at the same step, so all stop at the same step, one step after the
    first of them got the signal; the vote is a few bytes between CPUs, overlapped with a step, and
    never syncs the host with the device. finish() puts the SIGTERM handler it replaced back: the
    handler holds the vote and its group, which would otherwise live until the interpreter's
    teardown (see run_script)."""

    def __init__(self, layout, timeout=None, out_dir=None):
        self.requested, self.pending = False, None
        self.group = (
            dist.new_group(backend="gloo", timeout=timeout, group_desc="stop vote")
            if layout.world_size > 1
            else None
        )
        self.replaced = signal.signal(signal.SIGTERM, self._ask)
        self.mark = os.path.join(out_dir, SIGTERM_MARK) if out_dir and layout.rank == 0 else None
        # a mark an earlier launch left: this one goes on from there
        if self.mark and os.path.exists(self.mark):
            os.remove(self.mark)

    def _ask(self, signum, frame):
        self.requested = True

    def finish(self):
        if self.pending is not None:
            self.pending[0].wait()
            self.pending = None
        signal.signal(signal.SIGTERM, self.replaced)

    def agreed(self):
        """Called by every rank at the end of every step: whether the run stops now."""
        if self.group is None:
            return self.requested
        stop = False
        if self.pending is not None:
            work, flag = self.pending
            work.wait()
            stop = bool(flag.item())  # a CPU tensor: no device sync
        if not stop:
            flag = torch.tensor([1.0 if self.requested else 0.0])
            self.pending = (
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True),
                flag,
            )
        return stop

    def any_rank(self, failed):
        """Whether `failed` is true on any rank, known to every rank now: the vote's all-reduce, but
        waited for. For a fault only one rank sees at a point every rank passes, such as rank 0's
        write of metrics.jsonl on a full disk (metrics.MetricsLog): every rank stops there, none is
        left waiting for the one that stopped, and none reports it as a dead peer. A few bytes
        between CPUs, no device sync."""
        if self.group is None:
            return failed
        flag = torch.tensor([1.0 if failed else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def exit_saved(self, step):
        """Once every rank has saved the step the vote stopped at: rank 0 leaves SIGTERM_MARK (the
        step) in out_dir, and every rank exits with SAVED_ON_SIGTERM."""
        if self.mark:
            with open(self.mark, "w") as f:
                f.write(f"{step}\n")
        sys.exit(SAVED_ON_SIGTERM)


def peer_failure(e):
    """Whether a RuntimeError is a collective that lost its peers: gloo's read errors and timeouts
    and NCCL's errors are plain RuntimeErrors (or torch.distributed.DistError), told apart by their
    text."""
    return isinstance(e, dist.DistError) or any(
        w in str(e) for w in ("gloo", "Timed out", "NCCL", "pipeline stage")
    )


def end_on_dead_peer(e, rank, phase, timeout_s):
    """What every survivor of a dead or hung peer does (rank 0 may be the rank that died): say which
    rank it is, what it waited in (phase) and how to continue, and exit with status 1, without a
    traceback."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    print(
        f"error: rank {rank} stopped in {phase}: a peer died or did not answer within "
        f"dist_timeout_s = {timeout_s:g} s ({first}). Launched with torchrun --max-restarts=N "
        f"--init_from=auto, the job restarts from its last checkpoint by itself; else launch it "
        f"again with --init_from=auto",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    # no clean-up: tearing down the process groups would wait for the peer that is gone (the stop
    # vote's all-reduce in flight), until the timeout, and torchrun would restart the job that late
    os._exit(1)


def run_script(main, argv):
    """Run a script's main(argv) and end the process with its status, past the interpreter's
    teardown: 0 when main returns, SystemExit's own (a string is an error line: status 1), 1 after
    any other exception (its traceback printed). Why past the teardown: a gloo worker thread
    releases a collective's tensors after the collective has finished, and that takes the GIL; a
    worker that asks for it once the interpreter has begun to finalize is ended by Python mid-C++,
    which aborts the process ("terminate called without an active exception", SIGABRT): torchrun
    then reports a finished run, saved and logged, as failed, and an error as a crash. A busy
    machine makes it likely. Nothing is left to do by then but what this does: the exit handlers
    (atexit: W&B's, logging's) run first, and stdout and stderr are flushed. An error line is
    printed by rank 0 only (every rank finds the same configuration or layout problem) and written
    by every rank to its torchrun error file (end_with_error)."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    silent = False  # an error line that rank 0 prints
    try:
        main(argv)
        status = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            status = stop.code or 0
        else:
            status, silent = end_with_error(str(stop.code)), rank != 0
    except Exception as e:
        traceback.print_exc()
        status = end_with_error(f"{type(e).__name__}: {e}", traceback.format_exc())
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if silent and world_size > 1:
        outlive_rank_0(status)
    os._exit(status)


def outlive_rank_0(status, seconds=10.0):
    """A rank that stops on an error line it leaves rank 0 to print waits, up to `seconds`, for
    torchrun to end it: torchrun ends every rank once one has exited, so a silent rank gone first
    would have rank 0 ended before it printed the line (a loaded machine starts the ranks seconds
    apart). Rank 0 exiting is what sends the SIGTERM, so the wait is short when rank 0 found the
    error too."""
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(status))
    time.sleep(seconds)


def end_with_error(line, callstack=None):
    """Say why a script failed: an error line (callstack None) is printed by rank 0, and under
    torchrun every rank writes it, or the traceback already printed, to its error file
    (TORCHELASTIC_ERROR_FILE, in torch's ErrorHandler format), which torchrun's failure summary
    shows as the rank's "traceback" (else a link to its docs), whichever rank torchrun saw fail
    first. Returns the status: 1."""
    if callstack is None and int(os.environ.get("RANK", 0)) == 0:
        print(line, file=sys.stderr, flush=True)
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        try:
            with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
                json.dump(
                    {
                        "message": {
                            "message": line,
                            "extraInfo": {
                                "py_callstack": callstack or line,
                                "timestamp": str(int(time.time())),
                            },
                        }
                    },
                    f,
                )
        except (
            OSError
        ):  # a full disk (the error may be that): the line is printed, torchrun links its docs
            pass
    return 1


def end_of_run(cfg, layout, first_step, step, tokens_per_step, seconds, evals, newest):
    """The lines a run ends with: the steps and tokens it trained and how long it took, its
    evaluations' last and best validation loss (evals: [(step, {split: loss})]), its newest
    checkpoint and the commands that take it further, written for this run's out_dir."""
    trained = step - first_step
    lines = [
        f"finished: steps {first_step} -> {step} ({trained} steps, "
        f"{trained * tokens_per_step:,} tokens) in {format_duration(seconds)}"
    ]
    if evals:
        # a corpus of one document has no validation split
        split = "val" if "val" in evals[-1][1] else "train"
        (last, losses), best = evals[-1], min(evals, key=lambda e: e[1][split])
        lines.append(
            f"{'validation' if split == 'val' else 'no validation split: training-set'} loss "
            f"{losses[split]:.4f} at step {last}, the best {best[1][split]:.4f} at step {best[0]}"
        )
    else:
        lines.append("no evaluation in this launch (eval_interval = 0, or the run stopped first)")
    if newest is None:
        return "\n".join(
            lines
            + ["no checkpoint (checkpoint_interval = 0): nothing to sample from, resume or export"]
        )
    out, name = shlex.quote(cfg.out_dir), os.path.basename(os.path.normpath(cfg.out_dir))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", layout.world_size))
    more = (
        ""
        if step < cfg.max_iters
        else f" --max_iters={2 * cfg.max_iters}"
        + (f" --lr_decay_iters={2 * cfg.max_iters}" if cfg.lr_decay_iters == cfg.max_iters else "")
    )
    commands = [
        (f'python sample.py --out_dir={out} --start="The history of"', "text from it"),
        (checkpoint.resume_command(cfg.out_dir, layout.world_size, per_node) + more, "train on"),
        (
            f"python export_hf.py --out_dir={out} --hf_dir={shlex.quote('hf/' + name)}",
            "a transformers folder",
        ),
    ]
    width = max(len(command) for command, _ in commands)
    return "\n".join(
        lines
        + [f"checkpoint: {newest}", "next:"]
        + [f"  {command.ljust(width)}  # {why}" for command, why in commands]
    )
