r"""
Where two runs part: train two layouts (or any two settings) from the same seed on CPU and say
whether their difference is rounding or real.

    python scripts/compare.py config/tiny_fineweb.py --a="--tp=2" \
        --b="--pp=2 --pp_schedule=zbv --pp_chunks=2"

The settings before --a and --b are common to both runs, as train.py takes them (config files, then
--key=value); each side's own go on top. This script's defaults, 10 steps without evaluation
(--max_iters=10 --eval_interval=0), come after the config files, and any you give replace them. Each
side is launched with the processes its layout needs (dp * cp * tp * pp; give --dp for data
parallelism), under torchrun when that is more than one; the two sides run at the same time.
Printed:
  - a line as each run starts, and one for each step it finishes;
  - every step's two losses and global gradient norms, and their relative differences;
  - where the runs part beyond picotron's tolerances (tests/dist_utils.py: loss 1e-5, gradient
    norm 1e-4 relative): the first such step, and the parameters whose step-1 gradients differ
    most;
  - the verdict, from the same pair run again in float64 (model, collectives and optimizer; CPU):
    layouts that only round differently agree there to about 1e-15, so a float64 difference below
    1e-10 is "rounding", and above it "a real difference", with the parameters whose gradients
    still differ. It is given also when the float32 runs agree within the tolerances: a small real
    difference (a missing scale on one small tensor, say) can hide under them. The float64 pair
    runs the first 3 steps (step 1's gradients, and two updates by the optimizer), or up to the
    step where the float32 pair parted: a float64 step costs about three float32 ones on CPU.

The step-1 gradients are read back from each run's step-1 checkpoint, which any layout saves as full
tensors: after one step AdamW's first moment is (1 - beta1) * g and Muon's momentum is g, with g the
clipped gradient, unclipped here by the logged norm. Options of this script:
    --a, --b        each side's settings (quoted: --a="--tp=2 --sequence_parallel=True")
    --script        the training script both sides run (default train.py): a copy you changed,
                    to see where it parts from picotron's
    --work_dir      where the four runs write, each with its output in <run>.log (default: a
                    temporary folder, removed at the end)
Exit status, also said in the last line printed: 0 for rounding (the same model), 1 for a real
difference, 2 when the comparison could not be made (a bad setting, a run that failed: its output
shown; fp8, which has no float64 pair: the float32 table is still printed).
"""

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import checkpoint  # noqa: E402
import settings  # noqa: E402
from configurator import ConfigError, Setting, configure  # noqa: E402
from model import Transformer, model_config_from  # noqa: E402

OPTIONS = [
    Setting("a", "", "side a's settings, on top of the common ones"),
    Setting("b", "", "side b's settings, on top of the common ones"),
    Setting("script", "train.py", "the training script both sides run"),
    Setting("work_dir", "", "where the runs write; '' = a temporary folder, removed at the end"),
]
# what a side may change (put after the config files: see with_defaults), and what this script sets:
# CPU, a log line and a checkpoint every step
DEFAULTS = ["--device=cpu", "--max_iters=10", "--eval_interval=0"]
FORCED = [
    "--device=cpu",
    "--log_interval=1",
    "--checkpoint_interval=1",
    "--keep_last_n=0",
    "--init_from=scratch",
]
LOSS_RTOL, GRAD_NORM_RTOL = 1e-5, 1e-4  # tests/dist_utils.py's, for float32
FLOAT64_ROUNDING = 1e-10  # float64 layouts agree to ~1e-15; a real difference stays at its own size
# the float64 pair's steps, or up to the step where the float32 pair parted: see the docstring
FLOAT64_STEPS = 3
SHOWN = 5  # parameters listed
ROUNDING, REAL_DIFFERENCE, FAILED = 0, 1, 2  # the exit statuses
OUTCOMES = {
    ROUNDING: "the same model up to rounding",
    REAL_DIFFERENCE: "a real difference",
    FAILED: "the comparison could not be made",
}


class LaunchFailed(Exception):
    pass


def split_argv(argv):
    """(common train.py arguments, this script's options)."""
    mine = {s.name for s in OPTIONS}
    ours = [a for a in argv if a.startswith("--") and a[2:].partition("=")[0] in mine]
    options, _ = configure(OPTIONS, ours)
    return [a for a in argv if a not in ours], options


def processes(argv):
    """The number of processes a layout needs: dp * cp * tp * pp (dp = 0, the default, counts as
    1)."""
    values, _ = configure(settings.TRAINING, argv)
    return max(values["dp"], 1) * values["cp"] * values["tp"] * values["pp"]


def with_defaults(argv):
    """train.py's arguments with this script's DEFAULTS put after the last config file, where a
    config's own max_iters (300 for tiny_fineweb) cannot undo them, and without those the user
    gives, wherever given."""
    given = {a[2:].partition("=")[0] for a in argv if a.startswith("--")}
    files = [i for i, a in enumerate(argv) if not a.startswith("--")]
    cut = files[-1] + 1 if files else 0
    return argv[:cut] + [d for d in DEFAULTS if d[2:].partition("=")[0] not in given] + argv[cut:]


def launch(script, argv, out_dir, name):
    """One run of the script started, under torchrun when its layout has more than one process, its
    output to <out_dir>.log. The two sides run at once: a side's processes spend most of their start
    importing, which the other's can use the cores for."""
    argv = with_defaults(argv) + FORCED + [f"--out_dir={out_dir}"]
    n = processes(argv)
    cmd = (
        [sys.executable, str(ROOT / script)]
        if n == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={n}",
            str(ROOT / script),
        ]
    )
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print(
        f"{name}: {n} process{'es' if n > 1 else ''}, {' '.join(argv)} (its output: {out_dir}.log)",
        flush=True,
    )
    with open(out_dir + ".log", "w") as log:
        proc = subprocess.Popen(
            cmd + argv, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
        )
    return {
        "name": name,
        "proc": proc,
        "argv": argv,
        "out_dir": out_dir,
        "processes": n,
        "records": {},
        "max_iters": configure(settings.TRAINING, argv)[0]["max_iters"],
    }


def read_steps(run):
    """The run's metrics records by step, from the complete lines of its metrics.jsonl so far;
    prints each step not printed before."""
    path = os.path.join(run["out_dir"], "metrics.jsonl")
    # the last may be half-written
    lines = Path(path).read_text().split("\n")[:-1] if os.path.exists(path) else []
    for record in map(json.loads, filter(str.strip, lines)):
        if "loss" in record and record["step"] not in run["records"]:
            run["records"][record["step"]] = record
            step, loss = record["step"], record["loss"]
            print(f"{run['name']}: step {step} of {run['max_iters']}, loss {loss:.4f}", flush=True)
    return run["records"]


def wait_for(runs):
    """Wait for the runs, printing their steps as they come; a failed run stops the others and the
    comparison (LaunchFailed, with its output), as does an interruption."""
    try:
        while True:
            time.sleep(0.5)
            for run in runs:
                read_steps(run)
            failed = [run for run in runs if run["proc"].poll() not in (None, 0)]
            if failed:
                run = failed[0]
                raise LaunchFailed(
                    f"the run {run['name']} failed (exit status {run['proc'].returncode}): "
                    f"{' '.join(run['argv'])}\n{Path(run['out_dir'] + '.log').read_text()[-6000:]}"
                )
            if all(run["proc"].returncode == 0 for run in runs):
                return [read_steps(run) for run in runs]
    finally:
        for run in runs:  # SIGTERM: torchrun ends its workers, which are not in its process group
            if run["proc"].poll() is None:
                run["proc"].terminate()
        for run in runs:
            run["proc"].wait()


def step1_gradients(out_dir, grad_norm):
    """{parameter name: its step-1 gradient, whole}, from the step-1 checkpoint's optimizer state
    (see the docstring), unclipped by the step's logged global norm."""
    reader = checkpoint.CheckpointReader(os.path.join(out_dir, f"ckpt_{1:07d}"))
    config = {**settings.DEFAULTS, **reader.meta["config"]}
    model = Transformer(model_config_from(reader.meta["model"]))
    if config["dtype"] == "float64":
        model.double()
    clip = min(1.0, config["grad_clip"] / (grad_norm + 1e-6)) if config["grad_clip"] > 0 else 1.0
    grads, copies = {}, model.tied_copies()
    for name, p in model.named_parameters():
        name = copies.get(name, name)
        try:
            # Muon: M = g
            grads[name] = reader.optimizer_tensor(name, p, "momentum_buffer").double() / clip
        except (KeyError, checkpoint.CheckpointError):
            grads[name] = reader.optimizer_tensor(name, p, "exp_avg").double() / (
                (1 - config["beta1"]) * clip
            )
    return grads


def relative(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def gradient_differences(dir_a, dir_b, norm_a, norm_b):
    """[(relative difference ||ga - gb|| / ||gb||, name)] of the step-1 gradients, largest first."""
    ga, gb = step1_gradients(dir_a, norm_a), step1_gradients(dir_b, norm_b)
    diffs = [((ga[n] - gb[n]).norm().item() / max(gb[n].norm().item(), 1e-30), n) for n in gb]
    return sorted(diffs, reverse=True)


def run_pair(script, common, side_a, side_b, work_dir, dtype, extra=()):
    """Both sides in one dtype (extra: settings on top of each side's); prints the step table.
    Returns (the step-1 gradients' differences, largest first; the largest loss and gradient norm
    differences; the first step beyond the tolerances, or None; the last step)."""
    extra = [f"--dtype={dtype}", *extra]
    dir_a, dir_b = (os.path.join(work_dir, f"{dtype}_{side}") for side in "ab")
    runs = [
        launch(script, common + side_a + extra, dir_a, f"{dtype} a"),
        launch(script, common + side_b + extra, dir_b, f"{dtype} b"),
    ]
    a, b = wait_for(runs)
    na, nb = (run["processes"] for run in runs)
    print(f"\n{dtype}: a on {na} process{'es' if na > 1 else ''}, b on {nb}")
    print(
        f"{'step':>5} {'loss a':>15} {'loss b':>15} {'rel diff':>9}  {'grad norm a':>15} "
        f"{'grad norm b':>15} {'rel diff':>9}"
    )
    worst_loss = worst_norm = 0.0
    parted = None
    for step in sorted(set(a) & set(b)):
        dl, dn = (
            relative(a[step]["loss"], b[step]["loss"]),
            relative(a[step]["grad_norm"], b[step]["grad_norm"]),
        )
        worst_loss, worst_norm = max(worst_loss, dl), max(worst_norm, dn)
        if parted is None and (dl > LOSS_RTOL or dn > GRAD_NORM_RTOL or not math.isfinite(dl + dn)):
            parted = step
        print(
            f"{step:5d} {a[step]['loss']:15.10f} {b[step]['loss']:15.10f} {dl:9.1e}  "
            f"{a[step]['grad_norm']:15.10f} {b[step]['grad_norm']:15.10f} {dn:9.1e}"
        )
    grads = gradient_differences(dir_a, dir_b, a[1]["grad_norm"], b[1]["grad_norm"])
    return grads, worst_loss, worst_norm, parted, max(set(a) & set(b))


def compare(script, common, side_a, side_b, work_dir):
    """The float32 pair, then the float64 pair and the verdict: ROUNDING or REAL_DIFFERENCE."""
    grads, worst_loss, worst_norm, parted, steps = run_pair(
        script, common, side_a, side_b, work_dir, "float32"
    )
    if parted is None:
        print(
            f"float32: the runs agree within the tolerances (loss {LOSS_RTOL:.0e}, gradient norm "
            f"{GRAD_NORM_RTOL:.0e}): at most {worst_loss:.1e} and {worst_norm:.1e}"
        )
    else:
        print(f"float32: the runs part at step {parted}; the step-1 gradients that differ most:")
        for d, name in grads[:SHOWN]:
            print(f"  {name}: {d:.1e}")
    if any(
        configure(settings.TRAINING, with_defaults(common + side))[0]["fp8"] != "none"
        for side in (side_a, side_b)
    ):
        print(
            "no float64 verdict: fp8's matmuls give fp32 at most, so the pair cannot run in "
            "float64; how far two fp8 runs part on rounding alone: docs/training.md#fp8"
        )
        return FAILED
    # a float64 step costs about three float32 ones
    steps64 = min(steps, max(FLOAT64_STEPS, parted or 0))
    grads64, loss64, norm64, _, _ = run_pair(
        script, common, side_a, side_b, work_dir, "float64", [f"--max_iters={steps64}"]
    )
    worst64 = max(loss64, norm64, grads64[0][0])
    print(
        f"float64: largest relative differences: loss {loss64:.1e}, gradient norm {norm64:.1e}, "
        f"step-1 gradient {grads64[0][0]:.1e} ({grads64[0][1]}); in float32 {worst_loss:.1e}, "
        f"{worst_norm:.1e} and {grads[0][0]:.1e}"
    )
    if worst64 < FLOAT64_ROUNDING:
        print(
            f"verdict: rounding (in float64 the runs agree to {worst64:.1e}, below "
            f"{FLOAT64_ROUNDING:.0e})"
        )
        return ROUNDING
    differ = [(d, name) for d, name in grads64 if d >= FLOAT64_ROUNDING]
    print(
        f"verdict: a real difference (in float64 the runs still differ by {worst64:.1e}); the "
        f"step-1 gradients that differ"
        + (":" if differ else ": none (the difference comes after step 1)")
    )
    for d, name in differ[:SHOWN]:
        print(f"  {name}: {d:.1e}")
    if len(differ) > SHOWN:
        print(f"  and {len(differ) - SHOWN} more")
    return REAL_DIFFERENCE


def main(argv):
    """Compare; returns the exit status (ROUNDING, REAL_DIFFERENCE or FAILED), said in the last
    line."""
    if "--help" in argv or "-h" in argv:
        print(__doc__.strip())
        return 0
    status, work_dir = FAILED, None
    try:
        common, options = split_argv(argv)
        side_a, side_b = shlex.split(options["a"]), shlex.split(options["b"])
        if not (ROOT / options["script"]).is_file():
            raise ConfigError(
                f"script = {options['script']!r}: no such file in {ROOT}; give --script a path "
                f"relative to it (default train.py)"
            )
        for side in (side_a, side_b):
            processes(with_defaults(common + side))  # a bad setting stops here, before any run
        work_dir = options["work_dir"] or tempfile.mkdtemp(prefix="picotron_compare_")
        os.makedirs(work_dir, exist_ok=True)
        status = compare(options["script"], common, side_a, side_b, work_dir)
    except (ConfigError, LaunchFailed) as e:
        print(f"error: {e}", file=sys.stderr)
    except Exception:  # a fault of this script's own: its traceback, and still exit status 2
        traceback.print_exc()
    finally:
        if work_dir and not options["work_dir"]:
            shutil.rmtree(work_dir, ignore_errors=True)
    sys.stderr.flush()
    print(f"compare: exit {status}: {OUTCOMES[status]}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
