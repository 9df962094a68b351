"""
What a training run measures, and where the measurements go. train.py and bench.py both use it.

  1. FLOPs per token of a model config (the numerator of MFU).
  2. The device's peak FLOP/s: a table of GPU datasheet figures, or a measured matmul probe on CPU.
  3. MFU and peak memory.
  4. The log: metrics.jsonl (always), and the optional W&B and TensorBoard backends, imported only when a
     run asks for them.
  5. The pipeline measured: a step's actions timed on every rank (pp_trace.json, Chrome's trace format)
     and the activation memory a rank holds for backward.
  6. Memory: the planner (each rank's bytes of every kind, per pipeline stage, before anything runs) and
     the measured peak of one step (CUDA's allocator, or on CPU a tracker of live tensor storages).
"""
import functools
import json
import math
import os
import re
import resource
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from model import Transformer, attention_head_dim, loss_chunk_size, mlp_hidden_size, takes_muon
from optim import deal_whole
from parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, full_shape_of, padded_vocab_size,
                      stage_layers)
from pipeline_schedules import SCHEDULES, ideal_bubble, virtual_stages


# -----------------------------------------------------------------------------
# 1. FLOPs per token


def flops_per_token(cfg):
    """Training FLOPs per token: 6 per matmul weight a token passes through (2 forward, 4 backward), plus
    the attention scores and their weighted sum, 6 * n_layer * block_size * n_head * (qk_dim + v_dim)
    (Kaplan et al. 2020, table 1; PaLM appendix B; with qk_dim = v_dim = head_dim this is the familiar
    12 * L * H * D * T). Counts only the weights a token uses: the head but not the embedding lookup, and in a
    Mixture-of-Experts layer the router plus the shared and top-k experts. Norms, RoPE and softmax are left
    out, as is usual."""
    C, H, T = cfg.n_embd, cfg.n_head, cfg.block_size
    if cfg.attention == "mla":  # DeepSeek-V2 multi-head latent attention
        nope, rope, v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk_dim, q_lora = nope + rope, cfg.q_lora_rank
        q = C * q_lora + q_lora * H * qk_dim if q_lora > 0 else C * H * qk_dim
        attn = q + C * (cfg.kv_lora_rank + rope) + cfg.kv_lora_rank * H * (nope + v_dim) + H * v_dim * C
    else:  # multi-head, grouped-query or multi-query attention; heads of head_dim (n_embd / n_head by default)
        qk_dim = v_dim = attention_head_dim(cfg)
        attn = C * H * qk_dim + 2 * C * cfg.n_kv_head * qk_dim + H * v_dim * C
    # two matrices in GELU's MLP, three in SwiGLU's, of the hidden width (intermediate_size when set)
    mlp = (2 if cfg.mlp == "gelu" else 3) * C * mlp_hidden_size(cfg)
    if cfg.n_expert > 0:
        mlp = C * cfg.n_expert + (cfg.n_expert_per_token + cfg.n_shared_expert) * mlp
    matmul_weights = cfg.n_layer * (attn + mlp) + C * cfg.vocab_size
    return 6 * matmul_weights + 6 * cfg.n_layer * T * H * (qk_dim + v_dim)


def full_param_count(model, layout):
    """Parameters of the whole model (vocabulary padding included), whatever the layout: each rank counts
    the full tensors of its stage (a tied copy once), and every dp x cp x tp replica of a stage counts them;
    an expert has (dp / ep) x cp x tp replicas (expert parallelism: the other ranks of its ep group hold
    others)."""
    copies, experts = model.tied_copies(), model.expert_parameters()
    n = sum(math.prod(full_shape_of(p)) * (layout.ep if name in experts else 1)
            for name, p in model.named_parameters() if name not in copies)
    n = torch.tensor(float(n), dtype=torch.float64)
    if layout.world_size > 1:
        dist.all_reduce(n)
        n /= layout.dp * layout.cp * layout.tp
    return round(n.item())


# -----------------------------------------------------------------------------
# 2. The peak, 3. MFU and memory
#
# MFU = model FLOPs per second / the devices' peak FLOP/s (PaLM, Chowdhery et al. 2022, appendix B). The
# model's FLOPs per token come from flops_per_token above; the peak from the table below, the peak_flops
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
def measure_cpu_peak_flops(dtype, sizes=(256, 512, 1024), repeats=3, budget_s=1.0):
    """The best FLOP/s of a few square matmuls in dtype with this process's threads: about what the model's
    own matmuls can reach here (there is no table for CPUs). Measured once per process and dtype, within
    about budget_s: a dtype with no fast kernel here (bf16 on a CPU without native bf16 is ~100x slower
    than fp32) stops at the size where the budget runs out rather than holding up the start for a minute."""
    best, spent = 0.0, 0.0
    for n in sizes:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        start = time.perf_counter()
        a @ b  # warm-up: thread pool, kernel selection
        spent += time.perf_counter() - start
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            took = time.perf_counter() - start
            spent += took
            best = max(best, 2 * n ** 3 / took)
        if spent * 8 > budget_s:  # the next size costs 8x this one
            break
    return best


def device_peak_flops(setting, dev, dtype):
    """(peak FLOP/s of one device, where it comes from), or (None, why) when it is not known: MFU is then
    reported as not available rather than guessed.

    On CPU the peak is measured in the run's dtype and in fp32, and the larger counts: under bf16 autocast
    some operations stay in fp32, so a run can go faster than a slow bf16 kernel alone, and MFU must not
    pass 100%. Where the run's dtype is slower than fp32 (no native bf16 on this CPU), `why` says so."""
    if setting > 0:
        return setting, "the peak_flops setting"
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        peak = gpu_peak_flops(name, dtype)
        if peak is None:
            return None, f"no peak figure for {name} in {str(dtype).replace('torch.', '')}: set --peak_flops"
        return peak, f"{name}, datasheet"
    if dev.type == "cpu":
        threads = torch.get_num_threads()
        fp32 = measure_cpu_peak_flops(torch.float32)
        if dtype == torch.float32:
            return fp32, f"measured: best square fp32 matmul, {threads} threads"
        own, name = measure_cpu_peak_flops(dtype), str(dtype).replace("torch.", "")
        why = f"measured: best square matmul in {name} and fp32, {threads} threads"
        if own < fp32:
            why += (f"; note: {name} has no fast matmul kernel on this CPU ({own / 1e9:.0f} GFLOP/s against "
                    f"{fp32 / 1e9:.0f} in float32): --dtype=float32 is faster here")
        return max(own, fp32), why
    return None, f"no peak figure for device type {dev.type}: set --peak_flops"


def mfu(flops_per_token, tokens_per_sec, peak, n_devices):
    """Model FLOPs utilisation of n_devices, or None when the peak is unknown."""
    return flops_per_token * tokens_per_sec / (peak * n_devices) if peak else None


def format_mfu(value):
    return f"{100 * value:.1f}%" if value is not None else "n/a"


def rank_peak_memory_bytes(dev):
    """The most memory this rank has held: the CUDA allocator's peak on GPU, the process's peak resident
    set (max RSS) on CPU."""
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev)
    # ru_maxrss is in KiB on Linux, in bytes on macOS
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def peak_memory_bytes(dev, layout):
    """The most memory any rank has held (rank_peak_memory_bytes): an all-reduce when there are several."""
    peak = rank_peak_memory_bytes(dev)
    if layout.world_size > 1:
        peak = torch.tensor(peak, dtype=torch.int64, device=dev)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        peak = int(peak.item())
    return peak


# -----------------------------------------------------------------------------
# 4. The log


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


def moe_metrics(model, layout, steps=1):
    """MoE statistics for the log. Of the step's last micro-batch: aux_loss, the weighted auxiliary loss
    that was added to the training loss (summed over the MoE layers, mean over data-parallel ranks), and
    moe_dropped_frac, the fraction of token-to-expert assignments dropped for capacity (mean over layers
    and ranks). Per step, over the `steps` training steps since the last call (which this call resets):
    expert_load_min and expert_load_max, the fewest and most token assignments an expert of any layer
    processed in a step (the whole global batch: summed over micro-batches and data-parallel ranks), and
    a2a_bytes, the bytes the expert-parallel all-to-alls sent between ranks in a step (forward, backward and
    any recomputation; all ranks together), counted from the split sizes the host already holds. Every
    rank joins the one all-reduce; each stage's layers are held by dp * cp * tp ranks (each cp rank's
    auxiliary loss is its share: their mean is the microbatch's; each counts its own tokens' load)."""
    dev = next(model.parameters()).device
    layers = model.moe_layers()
    n_layer, n_expert = model.cfg.n_layer, model.cfg.n_expert
    stats = torch.zeros(4 + n_layer * n_expert, device=dev, dtype=torch.float64)  # the byte counts need float64
    load = stats[4:].view(n_layer, n_expert)  # each stage fills its own layers' rows
    for i, m in layers.items():
        if m.aux_loss is not None:
            stats[:3] += torch.stack([m.aux_loss.detach(), m.last_dropped_frac, torch.ones((), device=dev)]).double()
        stats[3] += m.a2a_sent.bytes
        load[i] = torch.tensor(m.step_load, dtype=torch.float64, device=dev)
        m.step_load, m.a2a_sent.bytes = [0] * n_expert, 0
    if layout.world_size > 1:
        dist.all_reduce(stats)
    load = load / (layout.tp * max(steps, 1))  # tp ranks count the same tokens
    return {"aux_loss": (stats[0] / (layout.dp * layout.cp * layout.tp)).item(),
            "moe_dropped_frac": (stats[1] / stats[2].clamp(min=1)).item(),
            "expert_load_min": load.min().item(), "expert_load_max": load.max().item(),
            "a2a_bytes": (stats[3] / max(steps, 1)).item()}


def expert_memory_bytes(model, optimizer):
    """(bytes of the routed experts' parameters, bytes of their optimizer state) on this rank: what expert
    parallelism divides by ep (and ZeRO-1 the moments further by the expert replicas). Every optimizer's
    states exist from the start."""
    params = model.expert_parameters().values()
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    state = [v for p in params if p in optimizer.state for v in optimizer.state[p].values() if torch.is_tensor(v)]
    return param_bytes, sum(v.numel() * v.element_size() for v in state if v.dim() > 0)


def format_duration(seconds):
    """3725 -> '1h02m', 95 -> '1m35s', 7 -> '7s'."""
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


# -----------------------------------------------------------------------------
# 5. The pipeline measured


class PipelineTrace:
    """Every pipeline action's start and end on this rank during one step (pass it as run_schedule's
    trace). Time zero is the end of a barrier every rank joins when the trace is made, so the ranks' clocks
    agree to within the barrier's own skew (a fraction of a millisecond on one machine). On a GPU each time
    is a CUDA event recorded on the stream: the host only sees kernels being launched, the events see them
    run. times() reads them (on a GPU after a synchronize, so call it after the step)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.events = []  # (action, start, end): CUDA events, or seconds since time zero
        if dist.is_initialized():
            dist.barrier()
        if self.cuda:
            torch.cuda.synchronize(device)
            self.zero = torch.cuda.Event(enable_timing=True)
            self.zero.record()
        else:
            self.zero = time.perf_counter()

    def __call__(self, action):
        return self._timed(action)

    @contextmanager
    def _timed(self, action):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((action, start, end))
        else:
            start = time.perf_counter() - self.zero
            yield
            self.events.append((action, start, time.perf_counter() - self.zero))

    def times(self):
        """[(op, microbatch, chunk, start seconds, end seconds)] in the order the actions ran."""
        if self.cuda:
            torch.cuda.synchronize()
            return [(*a, self.zero.elapsed_time(s) / 1e3, self.zero.elapsed_time(e) / 1e3) for a, s, e in self.events]
        return [(*a, s, e) for a, s, e in self.events]


def measured_bubble(times_by_rank):
    """Each rank's idle share of the step: 1 - (its actions' time) / (first start to last end, over all ranks)."""
    spans = [t for times in times_by_rank for t in times]
    begin, finish = min(t[3] for t in spans), max(t[4] for t in spans)
    return [1 - sum(t[4] - t[3] for t in times) / (finish - begin) for times in times_by_rank]


def pipeline_values(value, layout):
    """[value of pipeline rank 0, 1, ...] of one pipeline (the ranks of data- and tensor-parallel rank 0), on
    every rank: a gather of Python objects, which every rank must join."""
    if not dist.is_initialized():
        return [value]
    gathered = [None] * layout.world_size
    dist.all_gather_object(gathered, (layout.pp_rank, value) if layout.dp_rank == 0 and layout.tp_rank == 0 else None)
    by_rank = dict(g for g in gathered if g is not None)
    return [by_rank[r] for r in range(layout.pp)]


def write_pipeline_trace(trace, layout, cfg, step):
    """Gather one pipeline's trace and write it, on rank 0, to <out_dir>/pp_trace.json in Chrome's trace
    format (chrome://tracing, https://ui.perfetto.dev): a process row per pipeline rank, a thread row per
    chunk, an event per action. Every rank must call it (a gather). Returns, on rank 0, the summary line to
    print: each rank's measured bubble beside the schedule's ideal one."""
    times_by_rank = pipeline_values(trace.times(), layout)
    if layout.rank != 0:
        return None
    bubbles = measured_bubble(times_by_rank)
    m, chunks = cfg.gradient_accumulation_steps, cfg.pp_chunks
    ideal = ideal_bubble(cfg.pp_schedule, layout.pp, m, chunks)
    events = []
    for r in range(layout.pp):
        stages = virtual_stages(cfg.pp_schedule, layout.pp, r, chunks)
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"pipeline rank {r}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r, "args": {"sort_index": r}})
        for c, stage in enumerate(stages):
            events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": c,
                           "args": {"name": f"chunk {c} (model stage {stage})"}})
        for op, i, c, start, end in times_by_rank[r]:
            events.append({"name": f"{op}{i}", "cat": op, "ph": "X", "pid": r, "tid": c, "ts": start * 1e6,
                           "dur": (end - start) * 1e6, "args": {"microbatch": i, "chunk": c, "stage": stages[c]}})
    summary = {"step": step, "schedule": cfg.pp_schedule, "pp": layout.pp, "microbatches": m, "chunks": chunks,
               "measured_bubble": bubbles, "ideal_bubble": ideal, "device": "cuda" if trace.cuda else "cpu"}
    path = os.path.join(cfg.out_dir, "pp_trace.json")
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms", "otherData": summary}, f)
    return (f"pipeline trace of step {step} -> {path}: measured bubble "
            + " | ".join(f"rank {r} {b:.1%}" for r, b in enumerate(bubbles))
            + f" (mean {sum(bubbles) / len(bubbles):.1%}); ideal {cfg.pp_schedule} "
            + (f"{ideal:.1%}" if ideal is not None else "(no formula)") + " with forward = B = W in time")


class ActivationMemory:
    """The bytes this rank holds for backward, live and at peak: the floating-point tensors autograd saves
    (seen through saved-tensor hooks; parameters and integer index tensors such as token ids are left out,
    and a tensor saved by two operations counts twice), plus what zero-bubble WeightGradStores keep between a
    microbatch's B and its W. Use it as a context around the step; sampled at every save and, passed as
    run_schedule's trace, at the end of every action."""

    def __init__(self, model, stores=()):
        self.params = {p.data_ptr() for p in model.parameters()}
        self.stores, self.live, self.peak = list(stores), 0, 0

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    def _pack(self, t):
        if not t.is_floating_point() or t.data_ptr() in self.params:
            return t
        return _Saved(t, self)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def sample(self):
        self.peak = max(self.peak, self.live + sum(store.held_bytes for store in self.stores))

    @contextmanager
    def __call__(self, action):
        yield
        self.sample()


class _Saved:
    """A tensor autograd saved, counted in an ActivationMemory while autograd holds it."""

    def __init__(self, tensor, counter):
        self.tensor, self.counter, self.nbytes = tensor, counter, tensor.numel() * tensor.element_size()
        counter.live += self.nbytes
        counter.sample()

    def __del__(self):
        self.counter.live -= self.nbytes


# -----------------------------------------------------------------------------
# 6. Memory
#
# The planner counts, for one rank of each pipeline stage, the bytes that are alive at the step's peak,
# from shapes and dtypes alone (no constant fitted to a measurement):
#   parameters   the stage's tensors, this tp rank's slice (vocabulary padded as the layers pad it);
#                ZeRO-3: the 1/dp shards, plus the root unit (embedding, final norm, head) whole and two
#                gathered blocks (the one computing, the one prefetched)
#   gradients    ZeRO-0/1: autograd's p.grad, accumulated over the micro-batches, plus the buckets' flat
#                copies when there are data-parallel replicas (dp x cp > 1, or ZeRO-1); ZeRO-2/3: the 1/dp
#                shards plus three buckets (units) in flight (the one filling, two being reduce-scattered)
#   optimizer    AdamW's two moments per element (1/dp of them under ZeRO, padded); Muon's one momentum per
#                element of a block's matrix (AdamW's two for the rest), ZeRO-1 dealing the matrices whole:
#                a rank's share is what optim.deal_whole gives it, not 1/dp
#   activations  what autograd saves per block and micro-batch (counted from the block's code below, in
#                the activation dtype), held from a chunk's forward to its backward; with activation
#                checkpointing only each block's input, plus one block recomputed. Under the zero-bubble
#                schedules B frees them but for the linears' x and dy, which W frees
#   loss         the last stage: the chunked loss keeps its input and weight gradients (N x C and V x C,
#                fp32) from forward to backward, and one chunk's logits while it runs; without it
#                (tp > 1) the vocab-parallel logits and their softmax
#   buffers      at the end of a backward: the gradients in flight (autograd's new gradient of the
#                largest parameter, three of them for a weight tied within the stage; ZeRO-2/3 also two
#                buckets or units of flat gradients)
#   step         the optimizer step's temporaries (none for torch's fused AdamW): adamw_update's six
#                slices of the largest tensor it updates; Muon's, for the largest matrix a rank updates, its
#                new momentum and Nesterov step, the matrix gathered across tp, Newton-Schulz in fp32
# Expert parallelism: each rank holds n_expert / ep experts of each layer, their gradients and optimizer
# state; under ZeRO those are sharded over the expert replicas ((dp / ep) x cp ranks) and the rest over
# dp x cp, and ZeRO-3 gathers a block's experts as a unit of their own. The experts' activations are
# counted on the rows a rank receives at the capacity bound (expert_rows: up to ep times its own tokens'
# assignments when dropless), and while an MoE layer's outputs travel back, the all-to-all buffers
# (the rows sent, received, computed and reordered) are alive beside the activations. Muon: one momentum
# per element of a block's matrix, AdamW's two for the rest; ZeRO-1 deals the matrices whole
# (optim.deal_whole), so a rank's share of them is what the deal gives it, not 1/dp.
# The peak is found by walking the rank's actions of the schedule (pipeline_schedules.SCHEDULES: the same lists the
# executor runs; with pp = 1 each micro-batch's forward, then its backward): the states (parameters,
# gradients, optimizer), plus at the end of each forward what is then held (the activations and the
# loss's tensors of every micro-batch between its forward and its backward, and ZeRO-0/1's accumulated
# p.grad once a backward has run), and at the end of each backward or W what is still held and the
# buffers. So AFAB holds all m micro-batches, 1F1B pp - stage, interleaved 1F1B its chunks' share of
# more, with no count written per schedule. Then the optimizer step: the states, the gradients once
# (p.grad is a view of the buckets by then) and the step's temporaries. Not modelled, said where it
# applies: fp16/bf16 autocast's cast copies (counted at the activation dtype), the eager attention's
# (B, H, T, T) scores, MLA, context parallelism's ring buffers.


def stage_parameter_elements(model_cfg, tp, pp, stage, schedule="1f1b", chunks=1, ep=1, shapes=None):
    """{name: elements this tp rank holds} of pipeline rank `stage`'s parameters (its chunks' under the
    interleaved and V schedules): built on the meta device (no memory) at tp = 1, each tensor-parallel
    layer's tensors then cut as that layer cuts them. Under expert parallelism a rank holds n_expert / ep
    experts of each layer (the first ep rank's are named). shapes: a dict, filled with each parameter's
    full shape (Muon orthogonalises the full matrix)."""
    with torch.device("meta"):
        model = Transformer(model_cfg, None, pp * chunks, virtual_stages(schedule, pp, stage, chunks))
    held = model_cfg.n_expert // ep if model_cfg.n_expert else 0
    out = {}
    for mod_name, module in model.named_modules():
        if is_expert(mod_name) and int(mod_name.split(".mlp.experts.")[1].split(".")[0]) >= held:
            continue  # another ep rank's expert
        for name, p in module.named_parameters(recurse=False):
            full = f"{mod_name}.{name}" if mod_name else name
            n = p.numel()
            if isinstance(module, VocabParallelEmbedding) or getattr(p, "vocab_size", None) is not None:
                n = padded_vocab_size(model_cfg.vocab_size, tp) // tp * p.shape[1]
            elif isinstance(module, ColumnParallelLinear):
                kv_whole = mod_name.endswith(("k_proj", "v_proj")) and model_cfg.n_kv_head % tp != 0
                n = n if kv_whole else n // tp
            elif isinstance(module, RowParallelLinear) and name == "weight":
                n //= tp
            out.setdefault(full, n)
            if shapes is not None:
                shapes.setdefault(full, tuple(p.shape))
    if model_cfg.tie_embeddings and model.is_first and model.is_last:
        out.pop("lm_head.weight", None)  # the embedding itself
    return out


def is_expert(name):
    """A parameter (or module) of a routed expert: held by its ep rank only, averaged over its replicas."""
    return ".mlp.experts." in name


def expert_rows(model_cfg, tokens, ep=1):
    """(kept, received): the most token-to-expert assignments one rank keeps of its `tokens` (its sent
    rows) and the most rows its local experts receive from the ep ranks, at the capacity bound: each
    source rank sends an expert at most its capacity ceil(capacity_factor * N * k / E) (dropless: every
    assignment, all of them possibly to this rank's experts). At ep = 1 the two are the same."""
    E, k, N = model_cfg.n_expert, model_cfg.n_expert_per_token, tokens
    if model_cfg.capacity_factor == 0:
        return N * k, ep * N * k
    capacity = math.ceil(model_cfg.capacity_factor * N * k / E)
    return min(N * k, E * capacity), min(ep * N * k, E * capacity)


def block_activation_elements(model_cfg, tokens, tp, sequence_parallel=False, ep=1):
    """Elements autograd saves for one block's backward, for `tokens` tokens of a micro-batch (this rank's),
    counted from model.py's Block: the residual input and the residual between attention and MLP, each
    norm's rsqrt, normalised input and output, attention's rotated q, k, v (k and v repeated to the query
    heads under GQA), its output and log-sum-exp, the MLP's hidden tensors (SwiGLU: gate, silu, up, their
    product; GELU: up and gelu), or a Mixture-of-Experts layer at its capacity bound (under expert
    parallelism the local experts' inputs and hidden tensors on the rows they receive, expert_rows)."""
    C, D = model_cfg.n_embd, attention_head_dim(model_cfg)
    H = model_cfg.n_head // tp
    H_kv = model_cfg.n_kv_head // tp if model_cfg.n_kv_head % tp == 0 else 1
    N = tokens
    n_local = N // tp if sequence_parallel else N  # between the tensor-parallel regions
    norm = n_local + 2 * n_local * C  # rsqrt, x * rsqrt, * gain (its output: what the next layer saves)
    if sequence_parallel:
        norm += N * C - n_local * C  # the gathered input of attention / the MLP
    kv_heads = H if H > H_kv else H_kv
    attn = N * H * D + 2 * N * kv_heads * D + N * H * D + N * H  # q, k, v, output, log-sum-exp
    F = mlp_hidden_size(model_cfg) // tp
    per_token_mlp = (4 if model_cfg.mlp == "swiglu" else 2) * F
    if model_cfg.n_expert > 0:
        E = model_cfg.n_expert
        kept, received = expert_rows(model_cfg, N, ep)
        # tokens reordered (N x C), router logits and probabilities (N x E, fp32), each received row's input
        # and hidden tensors, each kept assignment's output (back on this rank), the combined output; the
        # shared experts on every token
        mlp = N * C + 2 * N * E + received * (C + per_token_mlp) + kept * C + 2 * N * C
        mlp += model_cfg.n_shared_expert * N * (C + per_token_mlp)
    else:
        mlp = N * per_token_mlp
    blocks_norms = 1 if model_cfg.parallel_block else 2
    residual = n_local * C * (1 if model_cfg.parallel_block else 2)  # the block's input; the mid-block sum
    return residual + blocks_norms * norm + attn + mlp


def bucket_elements(param_elements, capacity):
    """The elements of each gradient bucket parallel.GradientBuckets makes of parameters of these sizes
    (one dtype): filled in backward order, closed once they reach capacity."""
    sizes, current = [], 0
    for n in reversed(param_elements):
        current += n
        if current >= capacity:
            sizes.append(current)
            current = 0
    return sizes + ([current] if current else [])


def weight_grad_residual_elements(model_cfg, tokens, tp):
    """Elements one block keeps for a micro-batch between a zero-bubble B and its W (pipeline_schedules.WeightGradStore):
    each tensor-parallel linear's input x (q, k and v read one tensor, as the MLP's gate and up do) and its
    output's gradient dy. Counted for the dense attention and MLP."""
    C, D = model_cfg.n_embd, attention_head_dim(model_cfg)
    H = model_cfg.n_head // tp
    kv = model_cfg.n_kv_head // tp if model_cfg.n_kv_head % tp == 0 else model_cfg.n_kv_head
    F = mlp_hidden_size(model_cfg) // tp
    attn = C + H * D + 2 * kv * D + H * D + C  # q/k/v's x, their dy; o's x and dy
    mlp = C + (2 if model_cfg.mlp == "swiglu" else 1) * F + F + C  # gate/up's x and dy; down's x and dy
    return tokens * (attn + mlp)


def schedule_moments(schedule, pp, stage, m, chunks, chunk_blocks, head_chunk, saved, residual):
    """Walks pipeline rank `stage`'s actions (pipeline_schedules.SCHEDULES; with pp = 1 each micro-batch's forward and
    backward in turn) and yields, after each, (op, its chunk, activation elements held, micro-batches the
    head's chunk holds, backwards so far). A forward of chunk c adds `saved` per block of the chunk
    (chunk_blocks[c] of them); its backward takes them away, except that under the zero-bubble schedules
    (whose W actions are separate) B leaves `residual` per block until W. head_chunk: the chunk holding the
    head and the loss, or None."""
    if pp == 1:
        actions = [(op, i, 0) for i in range(m) for op in "FB"]
    else:
        actions = SCHEDULES[schedule](pp, stage, m, chunks)
    split = any(op == "W" for op, _, _ in actions)
    held, head, backwards = 0, 0, 0
    for op, _, c in actions:
        blocks = chunk_blocks[c]
        if op == "F":
            held += blocks * saved
            head += c == head_chunk
        elif op == "B":
            held += blocks * ((residual if split else 0) - saved)
            head -= c == head_chunk
            backwards += 1
        else:
            held -= blocks * residual
        yield op, c, held, head, backwards


def plan_memory(model_cfg, dp=1, tp=1, pp=1, cp=1, zero_stage=0, batch_size=1, block_size=None,
                microbatches=1, schedule="1f1b", activation_checkpointing=False, chunked_loss=True,
                sequence_parallel=False, bucket_size_mb=25.0, param_bytes=4, act_bytes=4, chunks=1, ep=1,
                optimizer="adamw", dp_rank=None):
    """For each pipeline stage, one rank's bytes: {'stage', 'parameters', 'gradients', 'optimizer',
    'activations', 'loss', 'buffers', 'step', 'peak'} (see above; ZeRO-3's gathered root unit and blocks are
    under 'parameters'; activations and loss are their largest over the step). dp_rank: the data-parallel
    (dp x cp) rank, where ranks differ (Muon's ZeRO-1 deals whole matrices); None: the largest of them."""
    T = block_size or model_cfg.block_size
    replicas, expert_replicas = dp * cp, dp // ep * cp  # the ranks that shard a parameter, an expert
    N = batch_size * T // cp  # this rank's tokens per micro-batch
    C, V = model_cfg.n_embd, padded_vocab_size(model_cfg.vocab_size, tp)
    bucket = max(1, int(bucket_size_mb * 2 ** 20))
    muon = optimizer == "muon"
    n_stages = pp * chunks  # the model's stages; this rank holds `chunks` of them
    stages = []
    for stage in range(pp):
        here = virtual_stages(schedule, pp, stage, chunks)
        shapes = {}
        elements = stage_parameter_elements(model_cfg, tp, pp, stage, schedule, chunks, ep, shapes)
        P = sum(elements.values())
        chunk_layers = [stage_layers(model_cfg.n_layer, n_stages, s) for s in here]
        # ZeRO-3's units: each block's dense part over dp x cp, its experts over their own replicas
        block_units = [[sum(n for name, n in elements.items() if name.startswith(f"blocks.{i}.") and
                            is_expert(name) == expert) for expert in (False, True)]
                       for layers in chunk_layers for i in layers]
        blocks = len(block_units)
        root = P - sum(map(sum, block_units))
        biggest_block = max(map(sum, block_units), default=0)
        shard = lambda n, r=replicas: -(-n // r)
        sharded = sum(shard(dense) + shard(experts, expert_replicas) for dense, experts in block_units) + shard(root)
        params = P * param_bytes
        if zero_stage == 3:
            params = sharded * param_bytes + (root + min(2, blocks) * biggest_block) * param_bytes
        # at the end of backward: autograd's new gradient of the largest parameter before it is added
        # into p.grad or copied into its bucket; for a weight tied within the stage the head's part, the
        # embedding's part and their sum
        head_chunk = here.index(n_stages - 1) if n_stages - 1 in here else None
        tied_here = model_cfg.tie_embeddings and head_chunk is not None and 0 in here
        largest = max(elements.values()) * (3 if tied_here else 1)
        buffers = largest * param_bytes
        if zero_stage >= 2:
            grads = sharded * param_bytes
            # and in flight with it: its bucket's flat buffer, and the bucket launched before it
            if zero_stage == 3:
                sizes = sorted([n for unit in block_units for n in unit if n] + [root], reverse=True)
            else:  # the experts fill buckets of their own
                sizes = sorted(sum((bucket_elements([n for name, n in elements.items() if is_expert(name) == e],
                                                    bucket // param_bytes) for e in (False, True)), []), reverse=True)
            buffers += (sizes[0] + (sizes[1] if len(sizes) > 1 else 0)) * param_bytes
        else:
            grads = P * param_bytes * (2 if (replicas > 1 or zero_stage == 1) else 1)
        # the optimizer's state: AdamW's two moments per element; Muon's one momentum per matrix element
        # (AdamW's two for the rest); under ZeRO 1/dp of them (the experts' over their replicas), except
        # Muon's matrices, dealt whole (optim.deal_whole): this rank's share is what the deal gives it
        matrices = [name for name in elements if takes_muon(name, torch.empty(shapes[name], device="meta"))] if muon else []
        M = sum(elements[name] for name in matrices)
        adamw_elements = [sum(n for name, n in elements.items() if is_expert(name) == e and name not in matrices)
                          for e in (False, True)]  # dense, experts
        if zero_stage == 0:
            state = 2 * (P - M) + M
            owned = matrices
        else:
            state = 2 * (shard(adamw_elements[0]) + shard(adamw_elements[1], expert_replicas))
            owners = deal_whole(reversed([torch.empty(elements[name], device="meta") for name in matrices]), replicas)
            share = [[] for _ in range(replicas)]
            for name, owner in zip(reversed(matrices), owners.values()):
                share[owner].append(name)
            owned = share[dp_rank] if dp_rank is not None else max(share, key=lambda ns: sum(elements[n] for n in ns))
            state += sum(elements[name] for name in owned)
        optimizer_bytes = state * param_bytes
        # the optimizer step's temporaries (torch.optim.AdamW's fused kernel makes none): adamw_update's
        # (new moments, denominator, new parameter and the two terms of its update: six of the largest
        # slice); Muon's, for the largest matrix it owns: the new momentum and its Nesterov step (its tp
        # slice), the matrix gathered whole across tp, and Newton-Schulz on it in fp32 (the normalised X;
        # then at most X's next iterate, X X^T, the polynomial's terms: see newton_schulz)
        step_temps = 0
        if zero_stage >= 1 or muon:
            adamw_slices = [shard(n, expert_replicas if is_expert(name) else replicas) if zero_stage else n
                            for name, n in elements.items() if name not in matrices]
            step_temps = 6 * max(adamw_slices, default=0) * param_bytes
        if owned:
            big = max(owned, key=lambda name: math.prod(shapes[name]))
            F, a = math.prod(shapes[big]), min(shapes[big])
            gathered = F * param_bytes if tp > 1 and elements[big] < F else 0
            newton_schulz_bytes = (F + max(F + 4 * a * a, 3 * F + 2 * a * a)) * 4
            step_temps = max(step_temps, 2 * elements[big] * param_bytes + gathered + newton_schulz_bytes)
        per_block = block_activation_elements(model_cfg, N, tp, sequence_parallel, ep)
        # ZeRO-1: each bucket's reduce-scatter output (this rank's slice) lives from its launch in the last
        # backward until finish(): at the end of it, every bucket's but the one of the largest gradient,
        # the last to fill (Muon's whole matrices are reduced into the flat buffer itself)
        if zero_stage == 1:
            biggest_name = max(elements, key=elements.get)
            launched = [n - (elements[biggest_name] if is_expert(biggest_name) == e and biggest_name not in matrices
                             else 0) for e, n in enumerate(adamw_elements)]
            buffers += ((shard(launched[0]) if replicas > 1 else 0)
                        + (shard(launched[1], expert_replicas) if expert_replicas > 1 else 0)) * param_bytes
        # expert parallelism: while an MoE layer's outputs travel back, the rows it sent, the rows it
        # received, its experts' outputs and their reordered copy (expert_parallel.dispatch_to_experts), beside
        # the activations saved so far
        exchange = 0
        if ep > 1 and model_cfg.n_expert > 0 and blocks:
            kept, received = expert_rows(model_cfg, N, ep)
            exchange = (kept + 3 * received) * C * act_bytes
        n_local = N // tp if sequence_parallel else N
        # with activation checkpointing a block keeps its input, and one block is recomputed at a time
        saved = n_local * C if activation_checkpointing else per_block
        recompute = per_block if activation_checkpointing else 0
        loss_held = loss_once = 0  # per micro-batch the head's chunk holds; while the loss runs
        if head_chunk is not None:
            final_norm = n_local + 2 * n_local * C
            if chunked_loss and tp == 1:
                loss_held = final_norm * act_bytes + (N * C + V * C) * 4
                loss_once = min(N, loss_chunk_size(model_cfg.vocab_size)) * model_cfg.vocab_size * 4
            else:
                loss_held = final_norm * act_bytes + N * C * act_bytes + N * (V // tp) * 4
                loss_once = 2 * N * (V // tp) * 4
        # The step walked action by action. At the end of a forward: what is held, the block just computed
        # under activation checkpointing, the loss's chunk on the head's chunk (or, if larger, an MoE
        # layer's all-to-all buffers in that forward), and ZeRO-0/1's p.grad once a backward has run. At
        # the end of a backward or W: what is still held, and the gradients in flight (for ZeRO-0/1 from the
        # second backward on: the first writes p.grad without a copy).
        accumulated = P * param_bytes if zero_stage < 2 else 0  # autograd's p.grad (ZeRO-0/1)
        top = activations = loss = 0
        for op, c, held, held_head, backwards in schedule_moments(
                schedule, pp, stage, microbatches, chunks, [len(layers) for layers in chunk_layers], head_chunk,
                saved, weight_grad_residual_elements(model_cfg, N, tp)):
            if op == "F":
                act = (held + recompute) * act_bytes
                loss_now = held_head * loss_held + (loss_once if c == head_chunk else 0)
                now = act + max(loss_now, held_head * loss_held + exchange) + (accumulated if backwards else 0)
            else:
                act, loss_now = held * act_bytes, held_head * loss_held
                now = act + loss_now + accumulated + (buffers if zero_stage >= 2 or backwards > 1 else 0)
            top = max(top, now)
            activations, loss = max(activations, act), max(loss, loss_now)
        peak = params + (grads - accumulated) + optimizer_bytes + top
        at_step = params + (grads if zero_stage >= 2 else P * param_bytes) + optimizer_bytes + step_temps
        stages.append({"stage": stage, "parameters": params, "gradients": grads, "optimizer": optimizer_bytes,
                       "activations": activations, "loss": loss, "buffers": buffers, "step": step_temps,
                       "peak": max(peak, at_step)})
    return stages


def plan_for(cfg, model_cfg, layout_dims, dp_rank=None):
    """plan_memory for a run's settings (train.py's cfg) at layout_dims = (dp, tp, pp, cp); dp_rank: see
    plan_memory."""
    dp, tp, pp, cp = layout_dims
    return plan_memory(model_cfg, dp, tp, pp, cp, cfg.zero_stage, cfg.batch_size, cfg.block_size,
                       cfg.gradient_accumulation_steps, cfg.pp_schedule, cfg.activation_checkpointing,
                       cfg.chunked_loss, cfg.sequence_parallel, cfg.bucket_size_mb, chunks=cfg.pp_chunks, ep=cfg.ep,
                       optimizer=cfg.optimizer, dp_rank=dp_rank)


def format_plan(stages, gpu_mem_gb=None):
    """The plan as lines of text, one per stage, the largest named; with gpu_mem_gb what to change when it
    does not fit."""
    mib = lambda b: f"{b / 2**20:,.1f}"
    lines = ["memory per rank (MiB): stage | parameters gradients optimizer activations loss buffers step | peak"]
    for s in stages:
        lines.append(f"  stage {s['stage']} | {mib(s['parameters'])} {mib(s['gradients'])} {mib(s['optimizer'])} "
                     f"{mib(s['activations'])} {mib(s['loss'])} {mib(s['buffers'])} {mib(s['step'])} | {mib(s['peak'])}")
    top = max(stages, key=lambda s: s["peak"])
    lines.append(f"  largest: stage {top['stage']}, {top['peak'] / 2**30:.2f} GiB")
    if gpu_mem_gb is not None and top["peak"] > gpu_mem_gb * 2**30:
        kinds = {k: top[k] for k in ("parameters", "gradients", "optimizer", "activations", "loss")}
        worst = max(kinds, key=kinds.get)
        advice = {"parameters": "raise zero_stage to 3 or tp/pp", "gradients": "raise zero_stage to 2",
                  "optimizer": "raise zero_stage (1 shards the optimizer state) or dp",
                  "activations": "turn on activation_checkpointing, lower batch_size, or use 1f1b",
                  "loss": "keep chunked_loss on (tp = 1) or lower batch_size"}[worst]
        lines.append(f"  does not fit {gpu_mem_gb} GB: stage {top['stage']} needs {top['peak'] / 2**30:.2f} GiB, most "
                     f"of it {worst}: {advice}")
    return "\n".join(lines)


class LiveTensorBytes(TorchDispatchMode):
    """The peak of live tensor bytes on CPU while it is active, not the process RSS (which holds the
    interpreter and libraries). Every aten operation passes through __torch_dispatch__; the storages of its
    outputs are kept in a weak dictionary, so a storage leaves it when its last tensor, autograd's saved
    copies included, is gone (torch keeps one Python object per storage while the storage lives). It
    starts from the tensors already alive (found by the garbage collector: parameters, gradients,
    optimizer states), counts each storage once however many views share it, and reads every storage's
    size after each operation, so a storage resized in place (ZeRO-3's freed blocks) is followed."""

    def __init__(self):
        super().__init__()
        self.live = WeakIdKeyDictionary()
        import gc
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                try:
                    if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                        self.live[obj.untyped_storage()] = True
                except (ReferenceError, RuntimeError, NotImplementedError):
                    pass  # a dead weak proxy; a tensor without a storage of its own (sparse, meta-like)
        self.peak = self.now()

    def now(self):
        return sum(storage.nbytes() for storage in self.live.keys())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self.live[t.untyped_storage()] = True
        self.peak = max(self.peak, self.now())
        return out


def measure_step_memory(step, dev):
    """This rank's peak bytes during step() (call it on an untimed step): the CUDA allocator's peak, or
    on CPU LiveTensorBytes'."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        step()
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev)
    with LiveTensorBytes() as tracker:
        step()
    return tracker.peak
