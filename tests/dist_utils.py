"""Helpers for tests that need several processes: CPU, gloo, tiny models.

run_ranks(fn, world_size, *args) runs fn(rank, world_size, *args) in world_size fresh processes with
torch.distributed initialised (gloo) and returns each rank's return value, in rank order.
run_train(argv, nproc) runs train.py under torchrun and returns the records of its metrics.jsonl.
make_token_data(dir) writes small random token bins with a meta.json, as prepare_data.py would.
"""
import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
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


def run_ranks(fn, world_size, *args, timeout=300):
    """fn must be a module-level function (it is pickled into the worker processes)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
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


def run_train(argv, nproc=1, check=True, env=None, timeout=600):
    """Run train.py (under torchrun when nproc > 1); returns (metrics records, completed process)."""
    if nproc == 1:
        cmd = [sys.executable, str(ROOT / "train.py")]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(ROOT / "train.py")]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}  # env may override OMP_NUM_THREADS
    proc = subprocess.run(cmd + list(argv), capture_output=True, text=True, env=full_env, timeout=timeout, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    out_dir = next((a.split("=", 1)[1] for a in argv if a.startswith("--out_dir=")), None)
    records = []
    if out_dir and os.path.exists(os.path.join(out_dir, "metrics.jsonl")):
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
    return records, proc


def train_losses(records):
    return [r["loss"] for r in records if "loss" in r]


def make_token_data(data_dir, n_tokens=20000, vocab_size=512, seed=0):
    """Random token bins (train and val) and a meta.json, like prepare_data.py writes. Tokens follow a
    simple repeating pattern plus noise so that a model can learn something in a few steps."""
    os.makedirs(data_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_tokens), ("val", n_tokens // 10)):
        base = np.arange(n) % 97
        noise = rng.integers(0, vocab_size, size=n)
        tokens = np.where(rng.random(n) < 0.7, base, noise).astype(np.uint16)
        tokens.tofile(os.path.join(data_dir, f"{split}.bin"))
    meta = {"tokenizer": "gpt2", "vocab_size": vocab_size, "dtype": "uint16", "eot_token": vocab_size - 1,
            "train_tokens": n_tokens, "val_tokens": n_tokens // 10}
    with open(os.path.join(data_dir, "meta.json"), "w") as f:
        json.dump(meta, f)
    return data_dir


def gather_full(tensor, param, group):
    """The full tensor of a tensor-parallel parameter (or its gradient) from every rank's slice, with the
    padded vocabulary rows cut off so that layouts with different padding compare."""
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
# fp32 on CPU, different layouts sum in different orders, and AdamW amplifies those roundings a little
# each step; the tolerances hold on CPUs with and without AVX-512 and still catch a real error:
#   losses             relative 1e-5 each step
#   global grad norm   relative 1e-4 each step (losses barely move when a gradient is off by a constant
#                      factor under AdamW with clipping; the norm moves with it)
#   final weights      per tensor, ||a - b|| / ||b|| <= 1e-4 (one element can be off by 1e-5 absolute
#                      on one CPU where the tensor as a whole agrees to 1e-5)
LOSS_RTOL, GRAD_NORM_RTOL, WEIGHT_RTOL = 1e-5, 1e-4, 1e-4


def _worst(got, want, rtol):
    """The largest relative difference of two lists of numbers, and where it is."""
    assert len(got) == len(want), f"{len(got)} values against the reference's {len(want)}"
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want)]
    k = max(range(len(diffs)), key=diffs.__getitem__) if diffs else 0
    return (diffs[k] if diffs else 0.0), k


def assert_same_losses_and_norms(records, reference):
    """Loss and global gradient norm of every logged step, against the reference run's records."""
    for key, rtol in (("loss", LOSS_RTOL), ("grad_norm", GRAD_NORM_RTOL)):
        got = [r[key] for r in records if key in r]
        want = [r[key] for r in reference if key in r][:len(got)]
        worst, k = _worst(got, want, rtol)
        assert got and worst <= rtol, (f"{key} differs from one process by {worst:.2e} relative at logged step "
                                       f"{k + 1} (tolerance {rtol:.0e}): {got} against {want}")


def relative_difference(a, b):
    """||a - b|| / ||b||, the per-tensor measure of how far a is from b."""
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def assert_same_tensors(got, want, rtol=WEIGHT_RTOL, what="weights"):
    """Every tensor of `want` (a dict) is in `got` with the same shape and within rtol by the per-tensor
    relative norm; the failure lists every tensor outside it with its difference."""
    assert set(got) == set(want), f"{what}: {sorted(set(got) ^ set(want))} on one side only"
    bad = {name: relative_difference(got[name], w) for name, w in want.items()
           if tuple(got[name].shape) != tuple(w.shape) or relative_difference(got[name], w) > rtol}
    assert not bad, f"{what} outside ||a-b||/||b|| <= {rtol:.0e}: " + ", ".join(f"{n}: {d:.2e}" for n, d in bad.items())
