"""
Pretrain a Llama-style model on token bins written by prepare_data.py.

One process:            python train.py config/tiny_fineweb.py --max_iters=200
Several (any layout):   torchrun --nproc_per_node=8 train.py config/tiny_fineweb.py --tp=2 --pp=2

Every setting is a variable below; a config file and --key=value overrides replace them (configurator.py).
"""
import functools
import importlib.util
import json
import math
import os
import re
import resource
import sys
import time
from types import SimpleNamespace
from contextlib import nullcontext
from dataclasses import fields

import numpy as np
import torch
import torch.distributed as dist

import checkpoint
from configurator import ConfigError, configure
from model import (MixtureOfExperts, ModelConfig, Transformer, check_layout, choose_attn_impl, flops_per_token,
                   stage_layers)
from parallel import (SCHEDULES, GradientBuckets, PipelineComm, ZeroOneAdamW, all_forward_all_backward,
                      all_reduce_tied_grad, format_grid, full_shape_of, init_distributed, one_f_one_b,
                      optimizer_state_bytes, pipeline_forward, tied_embedding_group)

# -----------------------------------------------------------------------------
# default config values
# I/O
out_dir = "out"  # checkpoints and metrics.jsonl go here
data_dir = "data/fineweb_edu"  # train.bin, val.bin and meta.json from prepare_data.py
init_from = "scratch"  # 'scratch' or 'resume' (from the newest complete checkpoint in out_dir)
seed = 1337  # fixes the initial weights and the data order (a pure function of seed and step)
log_interval = 10  # steps between log lines (each one reads the loss back: a host-device sync)
eval_interval = 100  # steps between evaluations of train/val loss (0 = never)
eval_iters = 20  # batches per evaluation (the same fixed batches every time)
checkpoint_interval = 100  # steps between checkpoints, plus one at the end (0 = never)
keep_last_n = 3  # complete checkpoints kept in out_dir (0 keeps all)
# logging: metrics.jsonl always; these optional backends get the same records
wandb_log = False  # Weights & Biases (pip install wandb; WANDB_MODE=offline works without a network)
wandb_project = "picotron"  # W&B project
wandb_run_name = "picotron"  # W&B run name
tensorboard_log = False  # event files in <out_dir>/tensorboard (pip install tensorboard)
# hardware
device = "auto"  # 'auto' (CUDA when present), 'cpu', 'cuda', 'cuda:1', ...
dtype = "auto"  # 'auto' (bf16 on Ampere+, fp16 before, fp32 on CPU), 'float32', 'bfloat16', 'float16'
attn_impl = "auto"  # 'auto', 'sdpa', 'flash', 'eager'
compile = False  # torch.compile the model (falls back to eager, with a log line, where compiling fails)
activation_checkpointing = False  # recompute each block's activations in backward: less memory, ~1/3 more compute
chunked_loss = True  # tp=1: the loss a chunk of tokens at a time, never the whole (tokens, vocab) logits
peak_flops = 0.0  # the device's peak FLOP/s for MFU; 0 = from the GPU table, or measured on CPU
# model
n_layer = 4  # transformer blocks
n_head = 4  # query heads
n_kv_head = 4  # key/value heads: n_head is MHA, fewer is GQA, 1 is MQA
n_embd = 128  # model width
block_size = 256  # context length in tokens
vocab_size = None  # from the data's meta.json unless set
tie_embeddings = True  # the output head shares the token embedding matrix
rope_theta = 10000.0  # RoPE base frequency
norm_eps = 1e-5  # epsilon of the norms
# model variants (model.py explains each, with its paper)
attention = "mha"  # 'mha' (n_kv_head < n_head makes it GQA, 1 MQA) or 'mla' (DeepSeek-V2 latent attention)
kv_lora_rank = 64  # mla: width of the compressed key/value latent that a KV cache would store
q_lora_rank = 0  # mla: width of the compressed query latent; 0 = full-rank queries
qk_rope_head_dim = 16  # mla: query/key dims per head that carry RoPE (the key part is shared by all heads)
qk_nope_head_dim = 32  # mla: query/key dims per head without positions
v_head_dim = 32  # mla: value dims per head
qk_norm = False  # RMSNorm on each query and key head before RoPE
attn_softcap = 0.0  # cap * tanh(score / cap) on attention scores (Gemma 2: 50); 0 = off; not on SDPA
final_softcap = 0.0  # the same on the output logits (Gemma 2: 30); 0 = off
parallel_block = False  # x + attn(norm(x)) + mlp(norm(x)) (GPT-J, PaLM) instead of one after the other
norm = "rmsnorm"  # 'rmsnorm' or 'layernorm'
mlp = "swiglu"  # 'swiglu' (hidden ~8/3 n_embd) or 'gelu' (hidden 4 n_embd, GPT-2)
bias = False  # biases in the attention and MLP linears and in LayerNorm
n_expert = 0  # Mixture-of-Experts: routed experts per MLP layer; 0 = dense MLP
n_expert_per_token = 2  # top-k: experts each token is sent to
capacity_factor = 1.25  # an expert takes at most ceil(capacity_factor * tokens * k / n_expert) tokens
aux_loss_coef = 0.01  # weight of each MoE layer's load-balancing loss (Switch Transformer)
n_shared_expert = 0  # experts every token also goes through (DeepSeekMoE)
router_z_loss_coef = 0.0  # weight of the router z-loss (ST-MoE used 1e-3); 0 = off
# batch: one step sees batch_size * gradient_accumulation_steps * dp windows of block_size tokens
batch_size = 8  # micro-batch per data-parallel rank
gradient_accumulation_steps = 1  # micro-batches per step (the pipeline's microbatches when pp > 1)
# AdamW and the learning-rate schedule: linear warmup, then cosine decay to min_lr
max_iters = 1000  # optimizer steps in the run
learning_rate = 1e-3  # peak learning rate, reached after warmup
min_lr = 1e-4  # learning rate at the end of the cosine decay
warmup_iters = 50  # steps of linear warmup
lr_decay_iters = 1000  # step where the cosine decay reaches min_lr (usually max_iters)
weight_decay = 0.1  # AdamW decoupled weight decay, on matrices only (not norms, biases)
beta1 = 0.9  # AdamW beta1
beta2 = 0.95  # AdamW beta2
grad_clip = 1.0  # clip the global gradient norm to this (0 disables)
# parallelism: dp * tp * pp processes
dp = 0  # data-parallel ranks; 0 means world_size / (tp * pp)
tp = 1  # tensor-parallel ranks
pp = 1  # pipeline stages
pp_schedule = "1f1b"  # '1f1b' or 'afab'
zero_stage = 0  # 1 shards the optimizer states across data-parallel ranks
bucket_size_mb = 25.0  # data-parallel gradients are averaged in buckets of about this size
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in dict(globals()).items()
            if not k.startswith("_") and k.islower() and isinstance(v, (int, float, bool, str, type(None)))}


# -----------------------------------------------------------------------------
# data: a pure function of (seed, step), so every layout sees the same global batch


def _prepare_hint(data_dir):
    return f"run: python prepare_data.py --out_dir={data_dir} (see the README)"


def read_data_meta(data_dir):
    meta_path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"no meta.json in data_dir '{data_dir}': the token bins have not been prepared; "
                                f"{_prepare_hint(data_dir)}")
    with open(meta_path) as f:
        return json.load(f)


def load_data(data_dir, split, block_size, vocab_size, meta):
    """Open <data_dir>/<split>.bin as a memmap, after checking that it is there and makes sense."""
    hint, meta_path = _prepare_hint(data_dir), os.path.join(data_dir, "meta.json")
    path = os.path.join(data_dir, f"{split}.bin")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {split}.bin in data_dir '{data_dir}'; {hint}")
    if meta.get("dtype") not in ("uint16", "uint32"):
        raise ValueError(f"{meta_path} says dtype {meta.get('dtype')!r}; expected 'uint16' or 'uint32'. {hint}")
    itemsize = np.dtype(meta["dtype"]).itemsize
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"{path} is empty (0 tokens)")
    if size % itemsize:
        raise ValueError(f"{path} has {size} bytes, not a whole number of {meta['dtype']} tokens: the file is "
                         f"corrupt or was written with another dtype; {hint}")
    data = np.memmap(path, dtype=meta["dtype"], mode="r")
    if len(data) < block_size + 1:
        raise ValueError(f"{path} has {len(data)} tokens, fewer than block_size + 1 = {block_size + 1}: prepare "
                         f"more text or lower block_size")
    sample = np.concatenate([data[:1 << 20], data[-(1 << 20):]])
    if vocab_size is not None and sample.max() >= vocab_size:
        raise ValueError(f"{path} holds token id {int(sample.max())} but the vocabulary has {vocab_size} tokens: "
                         f"the bins do not match meta.json (dtype {meta['dtype']}) or the vocab_size setting; {hint}")
    return path, meta["dtype"], len(data)


TRAIN_STREAM, EVAL_STREAM = 0, 1


def window_starts(seed, stream, step, n_tokens, block_size, n_windows):
    """Where each of the n_windows windows of a step starts: a pure function of (seed, stream, step).
    Evaluation draws from its own stream, so its batches are fixed and independent of training's."""
    rng = np.random.default_rng([seed, stream, step])
    return rng.integers(0, n_tokens - block_size, size=n_windows)


def get_batch(data, starts, block_size, device):
    path, dtype, _ = data
    # a fresh memmap per batch: keeping one open leaks memory (nanoGPT's note on np.memmap)
    tokens = np.memmap(path, dtype=dtype, mode="r")
    x = torch.from_numpy(np.stack([tokens[s:s + block_size].astype(np.int64) for s in starts]))
    y = torch.from_numpy(np.stack([tokens[s + 1:s + 1 + block_size].astype(np.int64) for s in starts]))
    if device.type == "cuda":  # pinned memory lets the copy overlap the GPU's work
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def rank_microbatches(cfg, layout, data, stream, step, n_micro, device):
    """This data-parallel rank's n_micro micro-batches of a step. The step's global batch is
    batch_size * n_micro * dp windows; dp rank r takes the r-th contiguous slice of it, so the same
    windows are seen whatever the layout."""
    per_rank = cfg.batch_size * n_micro
    starts = window_starts(cfg.seed, stream, step, data[2], cfg.block_size, per_rank * layout.dp)
    mine = starts[layout.dp_rank * per_rank:(layout.dp_rank + 1) * per_rank]
    return [get_batch(data, mine[i * cfg.batch_size:(i + 1) * cfg.batch_size], cfg.block_size, device)
            for i in range(n_micro)]


# -----------------------------------------------------------------------------
# precision


def choose_device_and_dtype(device_name, dtype_name):
    """Returns (device, dtype, reason). fp32 on CPU (CPUs have no fast fp16 and bf16 is opt-in),
    bf16 on CUDA compute capability 8.0+ (Ampere), fp16 with a loss scaler before it."""
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device_name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device='{device_name}' but CUDA is not available here: use --device=cpu or --device=auto")
    if dtype_name == "auto":
        if dev.type != "cuda":
            return dev, torch.float32, "auto: CPU, so float32"
        major, minor = torch.cuda.get_device_capability(dev)
        if major >= 8:
            return dev, torch.bfloat16, f"auto: compute capability {major}.{minor} >= 8.0 has bf16"
        return dev, torch.float16, f"auto: compute capability {major}.{minor} < 8.0, so fp16 with a loss scaler"
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype_name not in dtypes:
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype_name!r}")
    if dtype_name == "float16" and dev.type == "cpu":
        raise ValueError("dtype='float16' on CPU has no fast kernels: use 'float32' or 'bfloat16'")
    return dev, dtypes[dtype_name], "requested"


class DynamicLossScaler:
    """fp16 has a narrow range: gradients of small losses underflow to zero. Multiply the loss by a large
    scale before backward and divide the gradients by it after. A step whose gradient norm is inf/nan is
    skipped and the scale halved; after `growth_interval` good steps it doubles (Micikevicius et al. 2017).
    The overflow check uses the global gradient norm, already reduced across every rank, so all ranks
    agree on skipping a step. With enabled=False (bf16, fp32) it does nothing."""

    def __init__(self, enabled, scale=2.0 ** 16, growth_interval=2000):
        self.enabled, self.scale, self.growth_interval, self.good_steps = enabled, scale, growth_interval, 0

    def loss_multiplier(self):
        return self.scale if self.enabled else 1.0

    def update(self, grad_norm):
        """Call with the unscaled global gradient norm; returns whether to take the optimizer step."""
        if not self.enabled:
            return True
        if not math.isfinite(grad_norm):
            self.scale /= 2
            self.good_steps = 0
            return False
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2
        return True


# -----------------------------------------------------------------------------
# optimizer and schedule


def make_optimizer(model, cfg, device, layout=None):
    """AdamW; weight decay on matrices (linears, embeddings) only, not on norm gains and biases. With
    zero_stage=1, ZeroOneAdamW: the same update, its states split across the data-parallel group."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.zero_stage == 1:
        return ZeroOneAdamW(groups, layout.dp_group if layout else None, lr=cfg.learning_rate,
                            betas=(cfg.beta1, cfg.beta2), bucket_size_mb=cfg.bucket_size_mb,
                            deferred=late_synced_params(model, layout))
    # one kernel for the whole update; on CPU (torch >= 2.4) it was a third of a small model's step unfused
    fused = device.type == "cuda" or tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 4)
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=fused)


def late_synced_params(model, layout):
    """A tied embedding split across pipeline stages gets its other copy's gradient added after backward:
    it is averaged across data-parallel ranks in grad_sync.finish(), after that addition, not from the
    backward hooks."""
    split = layout is not None and layout.pp > 1 and model.cfg.tie_embeddings
    return [p for name, p in model.named_parameters()
            if hasattr(p, "init_name") or (split and name == "tok_emb.weight")]


def make_grad_sync(model, cfg, layout, optimizer):
    """What averages the gradients across data-parallel ranks: ZeroOneAdamW's own sharded buckets, plain
    all-reduce buckets, or nothing with a single replica."""
    if isinstance(optimizer, ZeroOneAdamW):
        return optimizer.grad_sync
    if layout.dp_group is None:
        return None
    return GradientBuckets(list(model.parameters()), layout.dp_group, cfg.bucket_size_mb,
                           deferred=late_synced_params(model, layout))


def get_lr(step, cfg):
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_iters + 1)
    if step >= cfg.lr_decay_iters:
        return cfg.min_lr
    progress = (step - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


# -----------------------------------------------------------------------------
# gradient norm and clipping across every rank


def global_grad_norm(model, layout, dp_sharded=False):
    """The norm of the whole model's gradient, the same on every rank whatever the layout. Tensor-sharded
    parameters contribute their slice on each tp rank; replicated ones (norms) are counted on tp rank 0
    only; pipeline stages hold disjoint blocks (a tied head's copy is not counted twice); data-parallel
    replicas hold the same (already averaged) gradient and are counted once. With ZeRO-1 (dp_sharded)
    each data-parallel rank holds the gradient of its own elements only (zero elsewhere): they add up."""
    sq = torch.zeros((), device=next(model.parameters()).device, dtype=torch.float32)
    for p in model.parameters():
        if p.grad is None or hasattr(p, "init_name"):
            continue
        if getattr(p, "tp_shard_dim", None) is None and layout.tp_rank != 0:
            continue
        sq += p.grad.detach().float().pow(2).sum()
    if layout.world_size > 1:
        if not dp_sharded:
            sq /= layout.dp  # every dp replica adds the same amount
        dist.all_reduce(sq)
    return sq.sqrt()


def scale_grads(model, factor):
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(factor)


# -----------------------------------------------------------------------------
# forward and backward of one step


def forward_backward(model, microbatches, autocast, loss_multiplier, set_grad_sync=None):
    """Run every micro-batch forward and backward, accumulating gradients. Each micro-batch's mean loss is
    divided by the number of micro-batches here, and only here, so the gradient is that of the mean loss
    over the whole batch. Returns that mean loss (a tensor: reading it is a host-device sync).
    set_grad_sync(bool) is called before each backward, True before the last (see parallel.run_schedule):
    data parallelism communicates only then."""
    total = 0.0
    for i, (x, y) in enumerate(microbatches):
        with autocast:
            _, loss = model(x, y)
        loss = loss / len(microbatches)
        if set_grad_sync is not None:
            set_grad_sync(i == len(microbatches) - 1)
        (loss * loss_multiplier).backward()
        total += loss.detach()
    return total


@torch.no_grad()
def evaluate(model, cfg, layout, datasets, device, autocast, pipeline=None):
    """Mean loss over eval_iters fixed batches of each split (the same batches at every evaluation).
    With pp > 1, `pipeline` is make_pipeline's: the batches go through its stages, forward only."""
    model.eval()
    out = {}
    for split, data in datasets.items():
        total = 0.0
        if pipeline is not None:  # each batch a microbatch through the pipeline; the loss on the last stage
            batches = [rank_microbatches(cfg, layout, data, EVAL_STREAM, i, 1, device)[0] for i in range(cfg.eval_iters)]
            total = pipeline_forward(model, batches, pipeline.pipe, autocast)
        else:
            for i in range(cfg.eval_iters):
                (x, y), = rank_microbatches(cfg, layout, data, EVAL_STREAM, i, 1, device)
                with autocast:
                    _, loss = model(x, y)
                total += loss.float() / cfg.eval_iters
        out[split] = mean_across_ranks(total, layout).item()
    model.train()
    return out


def mean_across_ranks(value, layout):
    """The job-wide mean of a per-rank loss: equal on tp ranks, different on each dp rank, and with pp > 1
    in parts summed over the stages (the last stage's loss, the others' auxiliary losses or zero: see
    parallel.run_schedule). One all-reduce over the whole world, rank 0 and everyone get it."""
    if layout.world_size == 1:
        return value
    counts = layout.tp_rank == 0
    value = value.detach().float() * (1.0 / layout.dp if counts else 0.0)
    dist.all_reduce(value)
    return value


def moe_metrics(model, layout):
    """MoE statistics of the step's last micro-batch, for the log: aux_loss, the weighted auxiliary loss
    that was added to the training loss (summed over the MoE layers, mean over data-parallel ranks), and
    moe_dropped_frac, the fraction of token-to-expert assignments dropped for capacity (mean over layers
    and ranks). Every rank joins the all-reduce; each stage's layers are held by dp * tp ranks."""
    dev = next(model.parameters()).device
    stats = torch.zeros(3, device=dev)
    for m in model.modules():
        if isinstance(m, MixtureOfExperts) and m.aux_loss is not None:
            stats += torch.stack([m.aux_loss.detach().float(), m.last_dropped_frac.float(), torch.ones((), device=dev)])
    if layout.world_size > 1:
        dist.all_reduce(stats)
    return {"aux_loss": (stats[0] / (layout.dp * layout.tp)).item(),
            "moe_dropped_frac": (stats[1] / stats[2].clamp(min=1)).item()}


# -----------------------------------------------------------------------------
# checkpoints


def save_checkpoint(cfg, layout, model, optimizer, step, scaler, model_cfg, tokenizer):
    meta = {"config": vars(cfg), "model": vars(model_cfg), "tokenizer": tokenizer,
            "layout": {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp},
            "adam_step": checkpoint.adamw_step_count(optimizer), "loss_scale": scaler.scale}
    extra = {"torch_rng": torch.get_rng_state()}
    if torch.cuda.is_available():
        extra["cuda_rng"] = torch.cuda.get_rng_state()
    return checkpoint.save(cfg.out_dir, step, layout.rank, layout.world_size, checkpoint.model_pieces(model, layout),
                           checkpoint.optimizer_pieces(optimizer, model, layout), meta, extra, cfg.keep_last_n)


def resume(cfg, layout, model, optimizer, scaler):
    """Load the newest complete checkpoint in out_dir (saved at any layout); returns its step."""
    path = checkpoint.latest_checkpoint(cfg.out_dir)
    if path is None:
        raise FileNotFoundError(f"init_from='resume' but out_dir '{cfg.out_dir}' holds no complete checkpoint: "
                                f"use --init_from=scratch to start a new run")
    reader = checkpoint.load_model(model, path)
    # the moments are assembled from whatever pieces were saved (ZeRO-1 or not, any dp): zero_stage can change
    (checkpoint.load_zero if isinstance(optimizer, ZeroOneAdamW) else checkpoint.load_adamw)(optimizer, model, reader)
    scaler.scale = reader.meta["loss_scale"]
    extra = reader.rank_state(layout.rank)
    if extra:  # RNG states only mean something for the same rank in the same world
        torch.set_rng_state(extra["torch_rng"])
        if "cuda_rng" in extra and torch.cuda.is_available():
            torch.cuda.set_rng_state(extra["cuda_rng"])
    return reader.meta["step"], path


# -----------------------------------------------------------------------------
# speed: model FLOPs utilisation (MFU) and peak memory
#
# MFU = model FLOPs per second / the devices' peak FLOP/s (PaLM, Chowdhery et al. 2022, appendix B). The
# model's FLOPs per token come from model.flops_per_token; the peak from the table below, the peak_flops
# setting, or on CPU a short matmul probe.

# Dense (no sparsity) peak FLOP/s as (bf16, fp16, fp32) from NVIDIA's datasheets; None: no such tensor-core
# path. bf16/fp16 are tensor-core figures with fp32 accumulation (what PyTorch uses; GeForce cards run that at
# half their fp16-accumulate rate, i.e. twice their fp32 rate); fp32 is plain fp32, not TF32. Matched against
# torch.cuda.get_device_name() in order, so longer names come before their prefixes; GeForce names must end
# there (a "Laptop GPU" or "SUPER" is another chip and is left unknown rather than guessed).
GPU_PEAK_FLOPS = [
    (r"H200 NVL", 835e12, 835e12, 60e12),
    (r"H200", 989e12, 989e12, 67e12),
    (r"H100 NVL", 835e12, 835e12, 60e12),
    (r"H100 PCIe", 756e12, 756e12, 51e12),
    (r"H100", 989e12, 989e12, 67e12),  # SXM
    (r"A100", 312e12, 312e12, 19.5e12),
    (r"L40S", 362e12, 362e12, 91.6e12),
    (r"L40\b", 181e12, 181e12, 90.5e12),
    (r"L4\b", 121e12, 121e12, 30.3e12),
    (r"A10\b", 125e12, 125e12, 31.2e12),
    (r"V100S", None, 130e12, 16.4e12),
    (r"V100-PCIE", None, 112e12, 14e12),
    (r"V100", None, 125e12, 15.7e12),  # SXM2
    (r"T4\b", None, 65e12, 8.1e12),
    (r"RTX 4090$", 165.2e12, 165.2e12, 82.6e12),
    (r"RTX 4080$", 97.5e12, 97.5e12, 48.7e12),
    (r"RTX 4070 Ti$", 80.2e12, 80.2e12, 40.1e12),
    (r"RTX 4070$", 58.3e12, 58.3e12, 29.1e12),
    (r"RTX 4060 Ti$", 44.1e12, 44.1e12, 22.1e12),
    (r"RTX 4060$", 30.2e12, 30.2e12, 15.1e12),
    (r"RTX 3090 Ti$", 80e12, 80e12, 40e12),
    (r"RTX 3090$", 71e12, 71e12, 35.6e12),
    (r"RTX 3080 Ti$", 68.2e12, 68.2e12, 34.1e12),
    (r"RTX 3080$", 59.5e12, 59.5e12, 29.8e12),
    (r"RTX 3070 Ti$", 43.5e12, 43.5e12, 21.7e12),
    (r"RTX 3070$", 40.6e12, 40.6e12, 20.3e12),
    (r"RTX 3060 Ti$", 32.4e12, 32.4e12, 16.2e12),
    (r"RTX 3060$", 25.4e12, 25.4e12, 12.7e12),
]


def gpu_peak_flops(device_name, dtype):
    """The table's peak FLOP/s for this GPU name and dtype, or None when the GPU (or the dtype on it) is unknown."""
    column = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}[dtype]
    for row in GPU_PEAK_FLOPS:
        if re.search(row[0], device_name.strip()):
            return row[column]
    return None


@functools.lru_cache(maxsize=None)
def measure_cpu_peak_flops(dtype, n=1024, repeats=3):
    """The best FLOP/s of a few n x n matmuls in dtype with this process's threads: about what the model's
    own matmuls can reach here (there is no table for CPUs). Measured once per process."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up: thread pool, kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


def device_peak_flops(setting, dev, dtype):
    """(peak FLOP/s of one device, where it comes from), or (None, why) when it is not known: MFU is then
    reported as not available rather than guessed."""
    if setting > 0:
        return setting, "the peak_flops setting"
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        peak = gpu_peak_flops(name, dtype)
        if peak is None:
            return None, f"no peak figure for {name} in {str(dtype).replace('torch.', '')}: set --peak_flops"
        return peak, f"{name}, datasheet"
    if dev.type == "cpu":
        return measure_cpu_peak_flops(dtype), f"measured: best 1024x1024 matmul, {torch.get_num_threads()} threads"
    return None, f"no peak figure for device type {dev.type}: set --peak_flops"


def mfu(flops_per_token, tokens_per_sec, peak, n_devices):
    """Model FLOPs utilisation of n_devices, or None when the peak is unknown."""
    return flops_per_token * tokens_per_sec / (peak * n_devices) if peak else None


def format_mfu(value):
    return f"{100 * value:.1f}%" if value is not None else "n/a"


def peak_memory_bytes(dev, layout):
    """The most memory any rank has held: the CUDA allocator's peak on GPU, the process's peak resident set
    (max RSS) on CPU. An all-reduce when there are several ranks."""
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev)
    else:  # ru_maxrss is in KiB on Linux, in bytes on macOS
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    if layout.world_size > 1:
        peak = torch.tensor(peak, dtype=torch.int64, device=dev)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        peak = int(peak.item())
    return peak


# -----------------------------------------------------------------------------
# the run


def print0(layout, *args):
    if layout.rank == 0:
        print(*args, flush=True)


def format_duration(seconds):
    """3725 -> '1h02m', 95 -> '1m35s', 7 -> '7s'."""
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class MetricsLog:
    """One JSON object per line in <out_dir>/metrics.jsonl, written by rank 0. On resume, the lines of
    steps after the checkpoint (from the crashed run) are dropped, so the file reads as one run. Every
    record also goes to the backends given (W&B, TensorBoard: see open_log_backends), on rank 0 only."""

    def __init__(self, out_dir, rank, resume_step=None, backends=()):
        self.backends = list(backends) if rank == 0 else []
        self.path = os.path.join(out_dir, "metrics.jsonl") if rank == 0 else None
        if self.path and resume_step is not None and os.path.exists(self.path):
            with open(self.path) as f:
                keep = [line for line in f if line.strip() and json.loads(line)["step"] <= resume_step]
            with open(self.path, "w") as f:
                f.writelines(keep)
        elif self.path:
            open(self.path, "w").close()

    def write(self, record):
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        for backend in self.backends:
            backend.log(record)

    def close(self):
        for backend in self.backends:
            backend.close()


class WandbLog:
    def __init__(self, cfg):
        import wandb  # optional: imported only when wandb_log is set (setup() checked it is installed)
        self.run = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=vars(cfg))

    def log(self, record):
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self):
        self.run.finish()


class TensorBoardLog:
    def __init__(self, log_dir):
        from torch.utils.tensorboard import SummaryWriter  # optional: needs the tensorboard package
        self.writer = SummaryWriter(log_dir)

    def log(self, record):
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)):  # scalars only: TensorBoard plots numbers
                self.writer.add_scalar(k, v, record["step"])
        self.writer.flush()  # once per log interval: a crash loses nothing that metrics.jsonl has

    def close(self):
        self.writer.close()


def open_log_backends(cfg):
    """The optional logging backends the settings ask for (call on rank 0 only)."""
    backends = [WandbLog(cfg)] if cfg.wandb_log else []
    if cfg.tensorboard_log:
        backends.append(TensorBoardLog(os.path.join(cfg.out_dir, "tensorboard")))
    return backends


def setup(cfg, training=True):
    """Everything that can fail because of the config or the data, before any training starts.
    bench.py calls it with training=False: out_dir is not checked, and with data_dir=None no data is read
    (the vocabulary is then vocab_size, or GPT-2's)."""
    for flag, package in (("wandb_log", "wandb"), ("tensorboard_log", "tensorboard")):
        if getattr(cfg, flag) and importlib.util.find_spec(package) is None:
            raise ValueError(f"{flag}=True needs the {package} package, which is not installed: pip install "
                             f"{package} (or set --{flag}=False)")
    dev, ptdtype, dtype_why = choose_device_and_dtype(cfg.device, cfg.dtype)
    layout = init_distributed(cfg.dp, cfg.tp, cfg.pp, dev.type)
    if dev.type == "cuda" and layout.world_size > 1:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
    if cfg.zero_stage not in (0, 1):
        raise ValueError(f"zero_stage must be 0 (plain AdamW) or 1 (optimizer states sharded across data-parallel "
                         f"ranks), got {cfg.zero_stage}")
    if cfg.pp_schedule not in SCHEDULES:
        raise ValueError(f"pp_schedule must be '1f1b' or 'afab', got {cfg.pp_schedule!r}")
    if cfg.init_from not in ("scratch", "resume"):
        raise ValueError(f"init_from must be 'scratch' or 'resume', got {cfg.init_from!r}")
    if training and cfg.init_from == "scratch" and checkpoint.latest_checkpoint(cfg.out_dir):
        raise FileExistsError(f"out_dir '{cfg.out_dir}' already holds checkpoints and init_from='scratch' would "
                              f"overwrite them: use --init_from=resume to continue, or choose another --out_dir")
    data_meta, datasets = {}, {}
    if training or cfg.data_dir is not None:
        data_meta = read_data_meta(cfg.data_dir)
    vocab = cfg.vocab_size or data_meta.get("vocab_size", 50257)
    if data_meta:
        datasets["train"] = load_data(cfg.data_dir, "train", cfg.block_size, vocab, data_meta)
        try:
            datasets["val"] = load_data(cfg.data_dir, "val", cfg.block_size, vocab, data_meta)
        except ValueError as e:  # a corpus of one document has no validation split: evaluate on train only
            print0(layout, f"no validation loss: {e}")
    attn, attn_why = choose_attn_impl(cfg.attn_impl, dev.type, ptdtype, cfg.attn_softcap)
    # every ModelConfig field is a setting of the same name above
    model_cfg = ModelConfig(**{f.name: getattr(cfg, f.name) for f in fields(ModelConfig)
                               if f.name not in ("vocab_size", "attn_impl")}, vocab_size=vocab, attn_impl=attn)
    check_layout(model_cfg, layout.tp, layout.pp)
    if layout.pp > 1:
        stages = [stage_layers(model_cfg.n_layer, layout.pp, s) for s in range(layout.pp)]
        print0(layout, f"pipeline: {cfg.pp_schedule}, {cfg.gradient_accumulation_steps} microbatches, blocks per stage "
                       + " | ".join(f"{s}: {r.start}" + (f"-{r.stop - 1}" if len(r) > 1 else "") for s, r in enumerate(stages)))
        if cfg.gradient_accumulation_steps < layout.pp:
            m = cfg.gradient_accumulation_steps
            print0(layout, f"warning: gradient_accumulation_steps = {m} microbatches for pp = {layout.pp} stages: the "
                           f"stages are idle {(layout.pp - 1) / (m + layout.pp - 1):.0%} of each step (the bubble, "
                           f"(pp - 1) / (m + pp - 1)); raise gradient_accumulation_steps (lowering batch_size to keep the "
                           f"batch): {4 * layout.pp} microbatches bring the bubble under 20%")
    print0(layout, f"device: {dev}, dtype: {str(ptdtype).replace('torch.', '')} ({dtype_why}), "
                   f"attention: {attn} ({attn_why})")
    print0(layout, f"layout: dp={layout.dp} x tp={layout.tp} x pp={layout.pp} = {layout.world_size} processes\n"
                   + format_grid(layout.dp, layout.tp, layout.pp))
    return dev, ptdtype, layout, datasets, model_cfg, data_meta.get("tokenizer", "gpt2")


def full_param_count(model, layout):
    n = torch.tensor(float(sum(math.prod(full_shape_of(p)) for p in model.parameters() if not hasattr(p, "init_name"))))
    if layout.world_size > 1:
        dist.all_reduce(n)  # every dp x tp replica of a stage counts the stage's whole parameters
        n /= layout.dp * layout.tp
    return int(n)


def build(cfg, dev, ptdtype, layout, model_cfg):
    """This rank's model (initialised, on dev), its AdamW, the autocast context and the loss scaler: what a
    training step needs. bench.py builds through here too, so it times exactly what train.py runs."""
    torch.manual_seed(cfg.seed)
    model = Transformer(model_cfg, layout.tp_group, layout.pp, layout.pp_rank)
    model.init_weights(cfg.seed)
    model.to(dev)
    optimizer = make_optimizer(model, cfg, dev, layout)
    zero = isinstance(optimizer, ZeroOneAdamW)
    # AdamW creates its two moments per parameter element at the first step; ZeroOneAdamW its slice's now
    unsharded = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    print0(layout, f"optimizer: ZeroOneAdamW, state {optimizer_state_bytes(optimizer) / 2**20:.2f} MiB on rank 0, about "
                   f"1/{layout.dp} of the unsharded {unsharded / 2**20:.2f} MiB" if zero else
                   f"optimizer: AdamW, state {unsharded / 2**20:.2f} MiB per rank")
    scaler = DynamicLossScaler(enabled=ptdtype == torch.float16)
    autocast = torch.autocast(dev.type, dtype=ptdtype) if ptdtype != torch.float32 else nullcontext()
    return model, optimizer, autocast, scaler


def compile_model(model, cfg, layout):
    """The model the training step runs: torch.compile(model) with compile=True, else the model itself."""
    if not cfg.compile:
        return model
    print0(layout, "compiling the model with torch.compile (the first steps are slow)")
    return torch.compile(model)


def make_pipeline(cfg, layout, model, model_cfg, dev):
    """What a pipeline-parallel step needs beside the model (None with pp = 1): the p2p channel to the
    neighbouring stages, the schedule, and the tied embedding's group and weight on the stages holding it."""
    if layout.pp == 1:
        return None
    pipe = PipelineComm.from_layout(layout, model_cfg.n_embd, dev)
    schedule = {"afab": all_forward_all_backward, "1f1b": one_f_one_b}[cfg.pp_schedule]
    # tied embeddings split over two stages: the embedding and the head's copy of it (collective: every rank)
    tied_group = tied_embedding_group(layout) if model_cfg.tie_embeddings else None
    tied_weight = model.tok_emb.weight if layout.is_first_stage else model.lm_head.weight if layout.is_last_stage else None
    return SimpleNamespace(pipe=pipe, schedule=schedule, tied_group=tied_group, tied_weight=tied_weight)


def forward_backward_step(step_model, microbatches, autocast, scaler, pipeline, grad_sync):
    set_grad_sync = grad_sync.set_grad_sync if grad_sync is not None else None
    if pipeline is not None:
        loss = pipeline.schedule(step_model, microbatches, pipeline.pipe, autocast, scaler.loss_multiplier(),
                                 set_grad_sync)
        if pipeline.tied_group is not None:
            all_reduce_tied_grad(pipeline.tied_weight, pipeline.tied_group)
    else:
        loss = forward_backward(step_model, microbatches, autocast, scaler.loss_multiplier(), set_grad_sync)
    if grad_sync is not None:
        grad_sync.finish()  # waits for the data-parallel averaging launched during backward (after the tied sum)
    return loss


def train_step(cfg, layout, model, step_model, optimizer, scaler, autocast, microbatches, lr, pipeline=None,
               grad_sync=None):
    """One optimizer step: forward and backward of every micro-batch through step_model (the compiled
    model, or the model itself; through the pipeline schedule when pp > 1; gradients averaged across
    data-parallel ranks by grad_sync), unscaling, the global gradient norm and clipping, AdamW. Returns (loss, grad norm, step_model for the next steps), loss and norm as
    tensors: nothing here waits for the device except fp16 loss scaling, which must read the norm to decide
    whether to skip the step.

    torch.compile compiles inside the first forward and backward, so that is where it fails (no C compiler,
    an op it cannot trace): on one rank the step is then run again eagerly and the eager model is used from
    then on. (With pp > 1 or dp > 1 the ranks may already have communicated: the error stops the run.)"""
    for group in optimizer.param_groups:
        group["lr"] = lr
    try:
        loss = forward_backward_step(step_model, microbatches, autocast, scaler, pipeline, grad_sync)
    except Exception as e:
        if step_model is model or pipeline is not None or grad_sync is not None:
            raise
        print0(layout, f"torch.compile failed ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}); "
                       f"continuing without it")
        optimizer.zero_grad(set_to_none=True)  # whatever the failed attempt accumulated
        step_model = model
        loss = forward_backward_step(model, microbatches, autocast, scaler, pipeline, grad_sync)
    if scaler.enabled:
        scale_grads(model, 1.0 / scaler.scale)
    grad_norm = global_grad_norm(model, layout, dp_sharded=isinstance(optimizer, ZeroOneAdamW))
    if cfg.grad_clip > 0:
        scale_grads(model, (cfg.grad_clip / (grad_norm + 1e-6)).clamp(max=1.0))
    if scaler.update(grad_norm.item() if scaler.enabled else 0.0):  # host-device sync with fp16 only
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm, step_model


def train(cfg, dev, ptdtype, layout, datasets, model_cfg, tokenizer):
    os.makedirs(cfg.out_dir, exist_ok=True)
    model, optimizer, autocast, scaler = build(cfg, dev, ptdtype, layout, model_cfg)
    grad_sync = make_grad_sync(model, cfg, layout, optimizer)
    print0(layout, f"model: {full_param_count(model, layout) / 1e6:.2f}M parameters (vocabulary padded), "
                   f"{model_cfg.n_layer} layers, {model_cfg.n_head} heads ({model_cfg.n_kv_head} kv), width {model_cfg.n_embd}")
    step = 0
    if cfg.init_from == "resume":
        step, path = resume(cfg, layout, model, optimizer, scaler)
        print0(layout, f"resumed from {path} at step {step}")
    metrics = MetricsLog(cfg.out_dir, layout.rank, step if cfg.init_from == "resume" else None,
                         open_log_backends(cfg) if layout.rank == 0 else [])
    step_model = compile_model(model, cfg, layout)
    model_flops = flops_per_token(model_cfg)
    peak, peak_why = device_peak_flops(cfg.peak_flops, dev, ptdtype)
    print0(layout, f"{model_flops / 1e6:.1f} MFLOP per token; peak {f'{peak / 1e12:.3g} TFLOP/s' if peak else 'unknown'} "
                   f"per device ({peak_why})")

    pipeline = make_pipeline(cfg, layout, model, model_cfg, dev)
    tokens_per_step = cfg.batch_size * cfg.gradient_accumulation_steps * layout.dp * cfg.block_size
    timer, timed_steps = time.time(), 0
    micro = rank_microbatches(cfg, layout, datasets["train"], TRAIN_STREAM, step, cfg.gradient_accumulation_steps, dev)
    while step < cfg.max_iters:
        lr = get_lr(step, cfg)
        loss, grad_norm, step_model = train_step(cfg, layout, model, step_model, optimizer, scaler, autocast, micro, lr,
                                                 pipeline, grad_sync)
        step += 1
        timed_steps += 1
        if step < cfg.max_iters:  # read the next batch now, while the GPU still works through this step
            micro = rank_microbatches(cfg, layout, datasets["train"], TRAIN_STREAM, step, cfg.gradient_accumulation_steps, dev)

        last = step == cfg.max_iters
        if step % cfg.log_interval == 0 or last:
            loss_value = mean_across_ranks(loss, layout).item()  # host-device sync, once per log interval
            elapsed = time.time() - timer
            record = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm.item(),
                      "tokens_per_sec": tokens_per_step * timed_steps / elapsed, "ms_per_step": 1000 * elapsed / timed_steps,
                      "optimizer_state_bytes": optimizer_state_bytes(optimizer)}  # on rank 0
            record["mfu"] = mfu(model_flops, record["tokens_per_sec"], peak, layout.world_size)
            record["peak_mem_bytes"] = peak_memory_bytes(dev, layout)
            if model_cfg.n_expert > 0:
                record.update(moe_metrics(model, layout))
            eta = (cfg.max_iters - step) * elapsed / timed_steps  # training steps only: evals and saves come on top
            print0(layout, f"step {step:6d} | loss {loss_value:.4f} | lr {lr:.2e} | grad norm {record['grad_norm']:.3f} | "
                           f"{record['tokens_per_sec']:,.0f} tok/s | {record['ms_per_step']:.0f} ms/step | "
                           f"MFU {format_mfu(record['mfu'])} | peak mem {record['peak_mem_bytes'] / 2**20:,.0f} MiB | "
                           f"eta {format_duration(eta)}"
                           + (f" | aux {record['aux_loss']:.4f} dropped {record['moe_dropped_frac']:.3f}"
                              if model_cfg.n_expert > 0 else ""))
            metrics.write(record)
            timer, timed_steps = time.time(), 0
        if cfg.eval_interval > 0 and (step % cfg.eval_interval == 0 or last):
            losses = evaluate(model, cfg, layout, datasets, dev, autocast, pipeline)
            record = {"step": step, **{f"{split}_loss": v for split, v in losses.items()}}
            print0(layout, f"step {step:6d} | eval " + " | ".join(f"{k} {v:.4f}" for k, v in record.items() if k != "step"))
            metrics.write(record)
            timer, timed_steps = time.time(), 0
        if cfg.checkpoint_interval > 0 and (step % cfg.checkpoint_interval == 0 or last):
            path = save_checkpoint(cfg, layout, model, optimizer, step, scaler, model_cfg, tokenizer)
            print0(layout, f"step {step:6d} | saved {path}")
            timer, timed_steps = time.time(), 0
    metrics.close()
    return model


def main(argv):
    try:
        cfg = SimpleNamespace(**configure(DEFAULTS, argv))
        dev, ptdtype, layout, datasets, model_cfg, tokenizer = setup(cfg)
    except (ConfigError, ValueError, FileNotFoundError, FileExistsError) as e:
        sys.exit(f"error: {e}")
    try:
        return train(cfg, dev, ptdtype, layout, datasets, model_cfg, tokenizer)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
