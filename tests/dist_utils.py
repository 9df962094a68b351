"""Helpers for tests that need several processes: CPU, gloo, tiny models.

run_ranks(fn, world_size, *args) runs fn(rank, world_size, *args) in world_size new processes with
torch.distributed initialised (gloo) and returns each rank's return value, in rank order.
run_train(argv, nproc) runs train.py under torchrun and returns the records of its metrics.jsonl;
train_in_process(argv) runs a one-process train.main here; train_on_ranks(runs, nproc) runs several
train.py runs one after another in one launch. make_token_data(dir) writes small random token bins
with a meta.json, as prepare_data.py would. assert_same_losses_and_norms, assert_same_tensors: the
equivalence rule (a run against its one-process reference), with the tolerances below; each returns
the largest differences it found. checkpoint_weights and checkpoint_optimizer_states read a
checkpoint's weights and optimizer states at one process.
"""

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import traceback
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import checkpoint
import metrics
import build
import train
from context_parallel import apply_context_parallel
from expert_parallel import apply_expert_parallel
from model import Transformer, apply_activation_checkpointing, model_config_from
from parallel import apply_pipeline
from tensor_parallel import apply_tensor_parallel, sum_partial_grads
from build import init_shares, materialize

ROOT = Path(__file__).resolve().parent.parent


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, env, cwd):
    # the test process's environment and folder now, as a spawned process would have them
    os.environ.clear()
    os.environ.update(
        env,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    os.chdir(cwd)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# The workers are forked from a server process that has imported torch, torch._dynamo (which
# torch.optim imports when an optimizer is built) and picotron once, at the first launch: a fresh
# interpreter spends about 4 s of CPU importing them, which, over the suite's launches, was minutes
# of its time. The server forks before any test's work has started threads in it, which fork would
# not copy.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy", "dist_utils"]


def run_ranks(fn, world_size, *args, timeout=300):
    """fn must be a module-level function (it is pickled into the worker processes)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, fn, args, queue, dict(os.environ), os.getcwd()),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]


def run_train(argv, nproc=1, check=True, env=None, timeout=600, script="train.py", torchrun=None):
    """Run train.py, or another script given relative to the checkout (tools/bench.py,
    tests/crash_run.py), under torchrun when nproc > 1 or torchrun (its arguments, replacing
    --standalone) is given; returns (metrics records, completed process)."""
    if nproc == 1 and torchrun is None:
        cmd = [sys.executable, str(ROOT / script)]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *(torchrun or ["--standalone"]),
            f"--nproc_per_node={nproc}",
            str(ROOT / script),
        ]
    # env may override OMP_NUM_THREADS
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(
        cmd + list(argv), capture_output=True, text=True, env=full_env, timeout=timeout, cwd=ROOT
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return read_records(argv), proc


@contextmanager
def without_memory_measurement():
    """train.py's first step without its memory measurement (metrics.measure_step_memory, which
    tests/test_memory.py tests through tools/bench.py, and tests/test_bench.py through train.main):
    on CPU its tracker sees every tensor op of the step and sums every live storage of the process
    after each one, which made a tiny mixture of experts' run ten times slower, and more in the test
    process, which holds the tensors of other tests. It only observes: the run is the same."""
    measure = metrics.measure_step_memory
    metrics.measure_step_memory = lambda step, dev, compiled=False: step() or 0
    try:
        yield
    finally:
        metrics.measure_step_memory = measure


def train_in_process(argv):
    """train.main(argv) in this process, without the memory measurement: a one-process run without
    the start-up of another interpreter and torch. Returns the records of its metrics.jsonl."""
    with without_memory_measurement():
        train.main(list(argv))
    return read_records(argv)


def main_exit_and_output(argv):
    """train.main(argv) in this process: (what it exited with, or None when it returned; its
    stdout)."""
    with redirect_stdout(io.StringIO()) as out:
        try:
            train.main(argv)
            code = None
        except SystemExit as e:
            code = e.code
    return code, out.getvalue()


def _train_runs(rank, world_size, runs):
    """run_ranks' worker for train_on_ranks: each run's configure_run, setup and train on the
    process group the worker already has (train.main would tear it down after the first run).
    Returns rank 0's stdout of each run."""
    outputs = []
    for argv, copy_from in runs:
        if copy_from is not None and rank == 0:
            out_dir = next(a.split("=", 1)[1] for a in argv if a.startswith("--out_dir="))
            shutil.copytree(copy_from, os.path.join(out_dir, os.path.basename(copy_from)))
        dist.barrier()
        with redirect_stdout(io.StringIO()) as out, without_memory_measurement():
            cfg, notes, resume_path = train.configure_run(argv)
            if notes and rank == 0:
                print("\n".join(notes))
            train.train(cfg, build.setup(cfg), resume_path)
        outputs.append(out.getvalue())
        dist.barrier()
    return outputs


def train_on_ranks(runs, nproc, timeout=600):
    """train.py's runs one after another in one launch of nproc processes (run_ranks), without the
    memory measurement: the start-up of the processes and of torch is paid once, where torchrun pays
    it for every run. Each run is an argv list, or (argv, a checkpoint folder that rank 0 copies
    into the run's out_dir before it starts: one an earlier run of the launch saved). Returns each
    run's (records of its metrics.jsonl, rank 0's stdout)."""
    runs = [
        (list(run), None) if isinstance(run, list) else (list(run[0]), str(run[1])) for run in runs
    ]
    outputs = run_ranks(_train_runs, nproc, runs, timeout=timeout)[0]
    return [(read_records(argv), out) for (argv, _), out in zip(runs, outputs)]


def read_records(argv):
    """The records of the metrics.jsonl in the --out_dir of argv ([] when there is none)."""
    out_dir = next((a.split("=", 1)[1] for a in argv if a.startswith("--out_dir=")), None)
    if not out_dir or not os.path.exists(os.path.join(out_dir, "metrics.jsonl")):
        return []
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_losses(records):
    return [r["loss"] for r in records if "loss" in r]


def make_token_data(data_dir, n_tokens=20000, vocab_size=512, seed=0):
    """Random token bins (train and val) and a meta.json, like prepare_data.py writes. Tokens follow
    a simple repeating pattern plus noise so that a model can learn something in a few steps."""
    os.makedirs(data_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_tokens), ("val", n_tokens // 10)):
        base = np.arange(n) % 97
        noise = rng.integers(0, vocab_size, size=n)
        tokens = np.where(rng.random(n) < 0.7, base, noise).astype(np.uint16)
        tokens.tofile(os.path.join(data_dir, f"{split}.bin"))
    meta = {
        "tokenizer": "gpt2",
        "vocab_size": vocab_size,
        "dtype": "uint16",
        "eot_token": vocab_size - 1,
        "train_tokens": n_tokens,
        "val_tokens": n_tokens // 10,
    }
    with open(os.path.join(data_dir, "meta.json"), "w") as f:
        json.dump(meta, f)
    return data_dir


def gather_full(tensor, param, group):
    """The full tensor of a tensor-parallel parameter (or its gradient) from every rank's slice,
    with the padded vocabulary rows cut off so that layouts with different padding compare."""
    dim = getattr(param, "tp_shard_dim", None)
    if dim is not None and group is not None:
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        tensor = torch.cat(parts, dim=dim)
    vocab = getattr(param, "vocab_size", None)
    return tensor[:vocab] if vocab is not None else tensor


# -----------------------------------------------------------------------------
# comparing a run with its one-process reference: one rule for every equivalence test
#
# fp32 on CPU, different layouts sum in different orders, and AdamW amplifies those roundings a
# little each step; the tolerances hold on CPUs with and without AVX-512 and catch a real error:
#   losses            relative 1e-5 each logged step (the train loss, and the evaluated losses)
#   global grad norm  relative 1e-4 each logged step (losses barely move when a gradient is off by
#                     a constant factor under AdamW with clipping; the norm moves with it)
#   final weights     per tensor, ||a - b|| / ||b|| <= 1e-3, and the optimizer's state alike. AdamW
#                     moves an element whose gradient is at the level of rounding by about its
#                     learning rate, either way, so a tensor with many such elements parts by more
#                     than its gradients: the MoE at dp2 x tp2 + SP x ep2 parted by 1.7e-4 on an AMD
#                     EPYC (3e-5 on another CPU) in one tensor, where one process in fp32 is itself
#                     1.0e-4 from the float64 run and the layout 7e-5 (the matrix's float64 rows
#                     hold the layouts to 1e-12). A real error moves most elements of a tensor by
#                     about the update: 1e-2 and more.
# Each comparison prints its largest difference (pytest -s shows them): the margin each test has.
LOSS_RTOL, GRAD_NORM_RTOL, WEIGHT_RTOL = 1e-5, 1e-4, 1e-3
FLOAT64_RTOL = (
    1e-12  # every tolerance, in a run all in float64: layouts agree there to 1e-13 at most
)
# FP8 (fp8.py): the scales are the same at every layout, but where two layouts' fp32 sums differ in
# their last bit an FP8 rounding downstream may flip (one element by an FP8 step, 6%): losses 1e-4,
# gradient norms 1e-3
FP8_RTOL = {"loss": 1e-4, "grad_norm": 1e-3, "train_loss": 1e-4, "val_loss": 1e-4}
LOGGED = (
    ("loss", LOSS_RTOL),
    ("grad_norm", GRAD_NORM_RTOL),
    ("train_loss", LOSS_RTOL),
    ("val_loss", LOSS_RTOL),
)


def _report(what, worst, where, rtol, label):
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0] + (f" {label}" if label else "")
    print(
        f"equivalence | {test} | {what}: largest relative difference {worst:.2e} ({where}), "
        f"tolerance {rtol:.0e}",
        flush=True,
    )


def assert_same_losses_and_norms(records, reference, label=None, rtol=None, evaluated=True):
    """The loss and global gradient norm of every logged step, and the evaluated losses (train_loss,
    and val_loss where the data has a validation split), against the reference run's records of the
    same steps (a resumed run logs only its own). The evaluation is part of the equivalence: with
    the same global batch, train and val loss do not depend on the layout, so a run must have
    evaluated (eval_interval) unless evaluated=False says it cannot. label names the run in the
    printed report when a test compares several; rtol, when given, replaces every tolerance (float64
    runs), or those it names (a dict: FP8_RTOL). Returns {key: largest relative difference} of the
    keys compared."""
    trained = {r["step"] for r in records if "loss" in r}
    worst = {}
    rtol = rtol if isinstance(rtol, dict) else {key: rtol for key, _ in LOGGED if rtol}
    for key, tolerance in ((key, rtol.get(key, default)) for key, default in LOGGED):
        got = {r["step"]: r[key] for r in records if key in r}
        want = {r["step"]: r[key] for r in reference if key in r}
        if key in ("loss", "grad_norm") or (key == "train_loss" and evaluated):
            assert got, f"the run logged no {key}" + (
                " (give it an eval_interval)" if key == "train_loss" else ""
            )
        missing = sorted(s for s in want if s in trained and s not in got)
        assert not missing, f"the reference logged {key} at steps {missing}, the run did not"
        if not got:
            continue
        assert set(got) <= set(want), (
            f"{key} logged at steps {sorted(set(got) - set(want))}, not in the reference"
        )
        diffs = {s: abs(v - want[s]) / max(abs(want[s]), 1e-12) for s, v in got.items()}
        step = max(diffs, key=diffs.get)
        _report(key, diffs[step], f"step {step}", tolerance, label)
        assert diffs[step] <= tolerance, (
            f"{label + ': ' if label else ''}{key} differs from one process by "
            f"{diffs[step]:.2e} relative at step {step} (tolerance {tolerance:.0e}): "
            f"{[got[s] for s in sorted(got)]} against {[want[s] for s in sorted(got)]}"
        )
        worst[key] = diffs[step]
    return worst


def relative_difference(a, b):
    """||a - b|| / ||b||, the per-tensor measure of how far a is from b."""
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def assert_same_tensors(got, want, rtol=WEIGHT_RTOL, what="weights", label=None):
    """Every tensor of `want` (a dict) is in `got` with the same shape and within rtol by the
    per-tensor relative norm; the failure lists every tensor outside it with its difference. Returns
    the largest."""
    assert set(got) == set(want), f"{what}: {sorted(set(got) ^ set(want))} on one side only"
    shapes = {
        n: (tuple(got[n].shape), tuple(w.shape))
        for n, w in want.items()
        if tuple(got[n].shape) != tuple(w.shape)
    }
    assert not shapes, f"{what}: shapes differ (got, want): {shapes}"
    diffs = {name: relative_difference(got[name], w) for name, w in want.items()}
    worst = max(diffs, key=diffs.get)
    _report(what, diffs[worst], worst, rtol, label)
    bad = {name: d for name, d in diffs.items() if d > rtol}
    assert not bad, (
        f"{label + ': ' if label else ''}{what} outside ||a-b||/||b|| <= {rtol:.0e}: "
        + ", ".join(f"{n}: {d:.2e}" for n, d in bad.items())
    )
    return diffs[worst]


def backward(loss, model):
    """loss.backward(), then the once-a-step sum over tp of the gradients of the parameters each tp
    rank holds whole (tensor_parallel.sum_partial_grads, as train.train_step sums them): the
    gradients of one process."""
    loss.backward()
    sum_partial_grads([(p, p.grad) for p in model.parameters() if p.grad is not None])


def build_model(
    cfg,
    *,
    tp_group=None,
    stages=(0,),
    stage_blocks=None,
    cp_group=None,
    sequence_parallel=False,
    ep_group=None,
    attn_impl="auto",
    activation_checkpointing=False,
    chunked_loss=False,
    seed=0,
):
    """A rank's model, built the way build.build_model builds it: the whole model on the meta
    device, the layout applied in train.py's order (stage_blocks: the pipeline's cut, with this
    rank's stages), this rank's share materialized on the CPU and initialised from seed (None: left
    uninitialised)."""
    with torch.device("meta"):
        model = Transformer(cfg, attn_impl=attn_impl, chunked_loss=chunked_loss)
    if stage_blocks is not None:
        apply_pipeline(model, stage_blocks, stages)
    apply_expert_parallel(model, ep_group)
    apply_tensor_parallel(model, tp_group, sequence_parallel)
    apply_context_parallel(model, cp_group)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    materialize(model, "cpu")
    return model if seed is None else init_shares(model, seed)


def gathered_parameters(grad_sync):
    """ZeRO-3 (a zero.FullyShardedParameters, or an ExpertSplit of two): {parameter: a copy of its
    whole value}, gathered unit by unit (unit_by_unit: a collective, every rank calls it); {} for
    None."""
    if grad_sync is None:
        return {}
    return {p: p.detach().clone() for params in grad_sync.unit_by_unit() for p in params}


def _one_process_model(reader):
    """A single-process model of a checkpoint's architecture, in the dtype its run trained in
    (float64 runs save float64 weights)."""
    model = Transformer(model_config_from(reader.meta["model"]))
    return model.double() if reader.meta["config"].get("dtype") == "float64" else model


def checkpoint_weights(ckpt_path):
    """A checkpoint's weights, loaded into a single-process model (whatever layout saved them)."""
    reader = checkpoint.CheckpointReader(ckpt_path)
    model = _one_process_model(reader)
    checkpoint.load_model(model, reader)
    return {name: p.detach() for name, p in model.named_parameters()}


def checkpoint_optimizer_states(ckpt_path):
    """A checkpoint's optimizer states as full tensors, {'<parameter> <state>': tensor} (AdamW's
    exp_avg and exp_avg_sq, Muon's momentum_buffer), whatever layout and ZeRO stage saved them. A
    gradient off by a constant factor barely moves AdamW's weights (its update is scale-free); its
    moments move with it."""
    reader = checkpoint.CheckpointReader(ckpt_path)
    model = _one_process_model(reader)
    states, copies = {}, model.tied_copies()
    for name, p in model.named_parameters():
        for key in checkpoint.STATE_KEYS:
            try:
                states[f"{name} {key}"] = reader.optimizer_tensor(copies.get(name, name), p, key)
            except (KeyError, checkpoint.CheckpointError):  # (the states another optimizer keeps)
                continue
    return states
