"""
What a training run measures, and where the measurements go. train.py and tools/bench.py both use
it.

  1. FLOPs per token of a model config (MFU's numerator), and the pipeline's stages cut by them.
  2. The device's peak FLOP/s: a table of GPU datasheet figures, or a measured matmul probe on CPU,
     probed again when a run comes near it (PeakFlops, which both ask for the MFU).
  3. MFU and peak memory.
  4. The log: metrics.jsonl (always; the resume and tools/plot.py read it back with read_log), and
     the optional W&B and TensorBoard backends, imported only when a run asks for them.
  5. The memory of one step, measured: CUDA's allocator, or on CPU a tracker of live tensor
     storages. What tools/memory_plan.py predicts is held to it (memory_plan.memory_rows).
"""

import functools
import gc
import itertools
import json
import math
import os
import re
import resource
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from configurator import ConfigError
from model import attention_dims, mlp_hidden_size
from ledger import MECHANISMS, CommLedger, layout_groups
from parallel import full_shape_of


# -----------------------------------------------------------------------------
# 1. FLOPs per token


def pipeline_costs(cfg):
    """(embedding, [each block], the final norm, head and loss): the training FLOPs per token of
    each piece a pipeline stage can hold, at block_size, forward and backward (a matmul weight costs
    2 FLOPs per token forward and 4 backward, the 3x rule). A block: 6 per matmul weight a token
    passes through, plus the attention scores and their weighted sum, 6 * block_size * n_head *
    (qk_dim + v_dim) (Kaplan et al. 2020, table 1; PaLM appendix B; with qk_dim = v_dim = head_dim
    the familiar 12 * H * D * T per layer). The head: 6 * n_embd * vocab_size. The embedding: 0 (a
    lookup, no matmul). Counts only the weights a token uses: in a Mixture-of-Experts layer the
    router plus the shared and top-k experts. Norms, RoPE, softmax and the loss's other elementwise
    work are left out, as is usual."""
    C, H, T = cfg.n_embd, cfg.n_head, cfg.block_size
    if cfg.attention == "mla":  # DeepSeek-V2 multi-head latent attention
        nope, rope, v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk_dim, q_lora = attention_dims(cfg)[0], cfg.q_lora_rank
        q = C * q_lora + q_lora * H * qk_dim if q_lora > 0 else C * H * qk_dim
        attn = (
            q
            + C * (cfg.kv_lora_rank + rope)
            + cfg.kv_lora_rank * H * (nope + v_dim)
            + H * v_dim * C
        )
    # multi-head, grouped-query or multi-query attention; heads of head_dim (n_embd / n_head by
    # default)
    else:
        qk_dim, v_dim = attention_dims(cfg)
        attn = C * H * qk_dim + 2 * C * cfg.n_kv_head * qk_dim + H * v_dim * C
    # two matrices in GELU's MLP, three in SwiGLU's, of the hidden width (intermediate_size when
    # set)
    mlp = (2 if cfg.mlp == "gelu" else 3) * C * mlp_hidden_size(cfg)
    if cfg.n_expert > 0:
        mlp = C * cfg.n_expert + (cfg.n_expert_per_token + cfg.n_shared_expert) * mlp
    block = 6 * (attn + mlp) + 6 * T * H * (qk_dim + v_dim)
    return 0, [block] * cfg.n_layer, 6 * C * cfg.vocab_size


def flops_per_token(cfg):
    """Training FLOPs per token of the whole model (the numerator of MFU): the sum of
    pipeline_costs."""
    embedding, blocks, head = pipeline_costs(cfg)
    return embedding + sum(blocks) + head


def full_param_count(model, layout):
    """Parameters of the whole model (vocabulary padding included), whatever the layout: each rank
    counts the full tensors of its stage (a tied copy once), and every dp x cp x tp replica of a
    stage counts them; an expert has (dp / ep) x cp x tp replicas (expert parallelism: the other
    ranks of its ep group hold others)."""
    copies, experts = model.tied_copies(), model.expert_parameters()
    n = sum(
        math.prod(full_shape_of(p)) * (layout.ep if name in experts else 1)
        for name, p in model.named_parameters()
        if name not in copies
    )
    n = torch.tensor(float(n), dtype=torch.float64)
    if layout.world_size > 1:
        dist.all_reduce(n)
        n /= layout.dp * layout.cp * layout.tp
    return round(n.item())


# -----------------------------------------------------------------------------
# 2. The peak, 3. MFU and memory
#
# MFU = model FLOPs per second / the devices' peak FLOP/s (PaLM, Chowdhery et al. 2022, appendix B).
# The model's FLOPs per token come from flops_per_token above; the peak from the table below, the
# peak_flops setting, or on CPU a short matmul probe.

# Dense (no sparsity) peak FLOP/s as (bf16, fp16, fp32) from NVIDIA's datasheets; None: no such
# tensor-core path. bf16/fp16 are tensor-core figures with fp32 accumulation (what PyTorch uses;
# GeForce cards run that at half their fp16-accumulate rate, i.e. twice their fp32 rate); fp32 is
# plain fp32, not TF32. Matched against torch.cuda.get_device_name() in order, so longer names come
# before their prefixes; GeForce names must end there (a "Laptop GPU" or "SUPER" is another chip and
# is left unknown rather than guessed).
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
    """The table's peak FLOP/s for this GPU name and dtype, or None when the GPU (or the dtype on
    it) is unknown."""
    column = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}[dtype]
    for row in GPU_PEAK_FLOPS:
        if re.search(row[0], device_name.strip()):
            return row[column]
    return None


@functools.lru_cache(maxsize=None)
def measure_cpu_peak_flops(dtype, sizes=(256, 512, 1024), repeats=3, budget_s=1.0):
    """The best FLOP/s of a few square matmuls in dtype with this process's threads: about what the
    model's own matmuls can reach here (there is no table for CPUs). Measured once per process and
    dtype, within about budget_s: a dtype with no fast kernel here (bf16 on a CPU without native
    bf16 is ~100x slower than fp32) stops at the size where the budget runs out rather than holding
    up the start for a minute."""
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
            best = max(best, 2 * n**3 / took)
        if spent * 8 > budget_s:  # the next size costs 8x this one
            break
    return best


def device_peak_flops(setting, dev, dtype):
    """(peak FLOP/s of one device, where it comes from), or (None, why) when it is not known: MFU is
    then reported as not available rather than guessed.

    On CPU the peak is measured in the run's dtype and in fp32, and the larger counts: under bf16
    autocast some operations stay in fp32, so a run can go faster than a slow bf16 kernel alone, and
    MFU must not pass 100%. Where the run's dtype is slower than fp32 (no native bf16 on this CPU),
    `why` says so."""
    if setting > 0:
        return setting, "the peak_flops setting"
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        peak = gpu_peak_flops(name, dtype)
        if peak is None:
            dtype_name = str(dtype).replace("torch.", "")
            return None, f"no peak figure for {name} in {dtype_name}: set --peak_flops"
        return peak, f"{name}, datasheet"
    if dev.type == "cpu":
        threads = f"{torch.get_num_threads()} thread" + "s" * (torch.get_num_threads() != 1)
        fp32 = measure_cpu_peak_flops(torch.float32)
        if dtype == torch.float32:
            return fp32, f"measured: best square fp32 matmul, {threads}"
        own, name = measure_cpu_peak_flops(dtype), str(dtype).replace("torch.", "")
        why = f"measured: best square matmul in {name} and fp32, {threads}"
        if own < fp32:
            why += (
                f"; note: {name} has no fast matmul kernel on this CPU "
                f"({own / 1e9:.0f} GFLOP/s against {fp32 / 1e9:.0f} in float32): "
                f"--dtype=float32 is faster here"
            )
        return max(own, fp32), why
    return None, f"no peak figure for device type {dev.type}: set --peak_flops"


def mfu(flops_per_token, tokens_per_sec, peak, n_devices):
    """Model FLOPs utilisation of n_devices, or None when the peak is unknown."""
    return flops_per_token * tokens_per_sec / (peak * n_devices) if peak else None


def format_mfu(value):
    return f"{100 * value:.1f}%" if value is not None else "n/a"


# A CPU probe is taken under whatever else the machine runs: on a loaded machine it reads low, and
# an MFU against it reads high (one measured 0.0169 TFLOP/s and reported 79% where the run beside it
# said 56.8%). A run whose achieved FLOP/s per device reaches this share of the peak is evidence of
# that.
REPROBE_AT = 0.9


class PeakFlops:
    """The peak FLOP/s of one device that MFU divides by, and the one rule for it: train.py's log
    line and tools/bench.py both ask it for their MFU. It starts from device_peak_flops (the
    setting, a datasheet figure, or on CPU the probe). Where the peak is a probe, mfu() probes again
    when the achieved FLOP/s per device comes to REPROBE_AT of it, keeps the best peak seen, and
    says so in the note it returns; only at a new high of the achieved FLOP/s, so that a run that
    really is near the peak probes a few times, not at every log line. The MFU it returns is never
    above 100% (capped, with a note, if the run still outran every probe, or the setting)."""

    def __init__(self, setting, dev, dtype):
        self.setting, self.dev, self.dtype = setting, dev, dtype
        self.flops, self.why = device_peak_flops(setting, dev, dtype)
        # probes taken (0: not a probe)
        self.probes = 1 if setting <= 0 and dev.type == "cpu" else 0
        self.probed_at = 0.0  # the achieved FLOP/s per device that made the last probe

    def __str__(self):
        """The start-up line's account: '1 TFLOP/s per device (the peak_flops setting)'."""
        peak = f"{self.flops / 1e12:.3g} TFLOP/s" if self.flops else "unknown"
        return f"{peak} per device ({self.why})"

    def mfu(self, flops_per_token, tokens_per_sec, n_devices):
        """{'mfu': model FLOPs utilisation of n_devices, at most 1 (None when the peak is unknown),
        'peak_flops': the peak it divides by, and 'mfu_note' when this call probed again or capped}.
        """
        if not self.flops:
            return {"mfu": None, "peak_flops": None}
        achieved = flops_per_token * tokens_per_sec / n_devices  # FLOP/s per device
        notes = []
        if self.probes and achieved >= REPROBE_AT * self.flops and achieved > self.probed_at:
            measure_cpu_peak_flops.cache_clear()  # (it keeps the probe in question)
            again, _ = device_peak_flops(self.setting, self.dev, self.dtype)
            self.probes, self.probed_at = self.probes + 1, achieved
            before, self.flops = self.flops, max(self.flops, again)
            notes.append(
                f"the run reached {achieved / before:.0%} of the peak: probed again, the best of "
                f"{self.probes} probes is {self.flops / 1e9:,.1f} GFLOP/s"
            )
        value = achieved / self.flops
        if value > 1:
            notes.append(
                f"capped at 100%: {value:.0%} of {'the best probe' if self.probes else self.why}"
            )
        return {
            "mfu": min(value, 1.0),
            "peak_flops": self.flops,
            **({"mfu_note": "; ".join(notes)} if notes else {}),
        }


def rank_peak_memory_bytes(dev):
    """The most memory this rank has held: the CUDA allocator's peak on GPU, the process's peak
    resident set (max RSS) on CPU."""
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev)
    # ru_maxrss is in KiB on Linux, in bytes on macOS
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (
        1 if sys.platform == "darwin" else 1024
    )


def peak_memory_bytes(dev, layout):
    """The most memory any rank has held (rank_peak_memory_bytes): an all-reduce when there are
    several."""
    peak = rank_peak_memory_bytes(dev)
    if layout.world_size > 1:
        peak = torch.tensor(peak, dtype=torch.int64, device=dev)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        peak = int(peak.item())
    return peak


# -----------------------------------------------------------------------------
# 4. The log


class LogError(RuntimeError):
    """metrics.jsonl cannot be read back or written; rank 0's message says which line or why, and
    what to do."""


class MetricsLog:
    """One JSON object per line in <out_dir>/metrics.jsonl, written by rank 0. On resume, the lines
    of steps after the checkpoint (from the crashed run) are dropped, so the file reads as one run;
    a new run moves an earlier run's file aside. Every record also goes to the backends given (W&B,
    TensorBoard: see open_log_backends), on rank 0 only.

    Only rank 0 touches the file, but every rank makes the log and calls write() at the same points,
    and learns there through any_rank (faults.StopVote.any_rank: true on every rank when it is on
    one) whether rank 0 failed (a full disk, a damaged file): every rank then raises LogError at the
    same line, rank 0's saying why, rather than rank 0 dying alone and the others reporting a dead
    peer."""

    def __init__(
        self, out_dir, rank, resume_step=None, backends=(), any_rank=lambda failed: failed
    ):
        self.backends = list(backends) if rank == 0 else []
        self.path = os.path.join(out_dir, "metrics.jsonl") if rank == 0 else None
        self.any_rank, self.error = any_rank, None
        if self.path:
            try:
                self._start(resume_step)
            except LogError as e:
                self.error = str(e)
            except OSError as e:
                self.error = (
                    f"cannot write the log {self.path} ({type(e).__name__}: {e}): free space on "
                    f"its disk (or fix the permissions of out_dir), then launch again"
                )
        self._stop_if_failed()

    def _start(self, resume_step):
        if os.path.exists(self.path) and resume_step is None:
            # A new run (init_from scratch, or auto with no checkpoint yet) keeps the earlier run's
            # log, moved aside, rather than refusing to start: torchrun --max-restarts with
            # --init_from=auto restarts a run that died before its first save as a new run in the
            # same out_dir, which a refusal would end; torchtitan likewise gives each launch its own
            # log folder (tb/<date-time>). Never overwrites. (An earlier run's checkpoints are
            # refused instead, in build.setup: a later --init_from=auto would resume the wrong
            # run's.)
            aside = next(
                p
                for n in itertools.count(1)
                if not os.path.exists(
                    p := os.path.join(os.path.dirname(self.path), f"metrics.{n}.jsonl")
                )
            )
            os.rename(self.path, aside)
            print(
                f"log: {self.path} held an earlier run's log (out_dir has no checkpoint to "
                f"resume): moved it to {aside}",
                flush=True,
            )
        keep = _lines_up_to(self.path, resume_step) if os.path.exists(self.path) else []
        # written aside, then renamed: a kill now leaves the file as it was
        with open(self.path + ".tmp", "w") as f:
            f.writelines(keep)
        os.replace(self.path + ".tmp", self.path)

    def _stop_if_failed(self):
        if self.any_rank(self.error is not None):
            raise LogError(
                self.error or "rank 0 could not write metrics.jsonl (its message says why)"
            )

    def write(self, record):
        if self.path:
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as e:
                self.error = (
                    f"writing the log {self.path} failed at step {record['step']} "
                    f"({type(e).__name__}: {e})"
                )
        self._stop_if_failed()
        for backend in self.backends:
            backend.log(record)

    def close(self):
        for backend in self.backends:
            backend.close()


def read_log(path):
    """The log at `path` as [(line, record)]: each line as written, and the record it holds. A last
    line that is not a whole record is what a kill (or a full disk) in the middle of a write leaves:
    it is dropped, with a warning. One in the middle is damage that no reader can mend: LogError
    names its line. The resume (MetricsLog) and tools/plot.py both read the log here."""
    with open(path) as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    records = []
    for n, line in lines:
        try:
            record = json.loads(line)
            record["step"]
        except (ValueError, KeyError, TypeError):  # not JSON; not a record with a step
            if n == lines[-1][0]:
                print(
                    f"warning: the last line of {path} (line {n}) is cut short, as a kill in the "
                    f"middle of a write leaves it: dropped it",
                    flush=True,
                )
                break
            raise LogError(
                f"{path} line {n} is not a whole record (it begins {line.strip()[:40]!r}), and "
                f"records follow it: the file is damaged. Delete or mend that line"
            ) from None
        records.append((line, record))
    return records


def _lines_up_to(path, step):
    """The lines of the log at `path` (read_log) of steps up to `step`, each ending in a newline."""
    try:
        records = read_log(path)
    except LogError as e:
        raise LogError(
            f"{e}, or move the file aside to start a new log, then resume again"
        ) from None
    # (a whole last line may have lost only its newline)
    return [line.rstrip("\n") + "\n" for line, record in records if record["step"] <= step]


class WandbLog:
    def __init__(self, cfg):
        # optional: imported only when wandb_log is set (setup() checked it is installed)
        import wandb

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
            # scalars only: TensorBoard plots numbers
            if k != "step" and isinstance(v, (int, float)):
                self.writer.add_scalar(k, v, record["step"])
        self.writer.flush()  # once per log interval: a crash loses nothing that metrics.jsonl has

    def close(self):
        self.writer.close()


def open_log_backends(cfg):
    """The optional logging backends the settings ask for (call on rank 0 only). A backend that
    cannot start (W&B without a login, say) stops the run in one line, before the first step."""
    try:
        backends = [WandbLog(cfg)] if cfg.wandb_log else []
        if cfg.tensorboard_log:
            backends.append(TensorBoardLog(os.path.join(cfg.out_dir, "tensorboard")))
        return backends
    except Exception as e:  # each backend raises its own kinds; all mean "cannot log there"
        first = (str(e).strip().splitlines() or [""])[0]
        off = " or ".join(
            f"--{flag}=False" for flag in ("wandb_log", "tensorboard_log") if getattr(cfg, flag)
        )
        raise ConfigError(
            f"logging cannot start ({type(e).__name__}: {first}): fix that, or turn it off ({off})"
        ) from e


# -----------------------------------------------------------------------------
# Where a step waited: a communication ledger (ledger.py) times every wait on communication by its
# mechanism, so a log line shows what no computation hid (tools/bench.py's exposed_comm_ms,
# train.py's).


def exposed_comm(step, layout, pipeline=None):
    """Run step() inside a ledger of the layout's groups; returns (what it returned, mean_waits of
    the milliseconds this rank stood waiting, the ledger)."""
    with CommLedger(layout_groups(layout, pipeline)) as ledger:
        out = step()
    return out, mean_waits(ledger.waits(), layout), ledger


def mean_waits(waits, layout):
    """{mechanism: ms} of a ledger's waits, every mechanism named, the mean over the world's
    ranks (every rank calls it: one all-reduce)."""
    waited = {m: waits.get(m, 0.0) for m in MECHANISMS}
    if layout.world_size > 1:
        mean = torch.tensor(list(waited.values()), dtype=torch.float64) / layout.world_size
        dist.all_reduce(mean)
        waited = dict(zip(waited, mean.tolist()))
    return waited


def moe_metrics(model, layout, steps=1):
    """MoE statistics for the log. Of the step's last micro-batch: aux_loss, the weighted auxiliary
    loss that was added to the training loss (summed over the MoE layers, mean over data-parallel
    ranks), and moe_dropped_frac, the fraction of token-to-expert assignments dropped for capacity
    (mean over layers and ranks). Per step, over the `steps` training steps since the last call
    (which this call resets): expert_load_min and expert_load_max, the fewest and most token
    assignments an expert of any layer processed in a step (the whole global batch: summed over
    micro-batches and data-parallel ranks), and a2a_bytes, the bytes the expert-parallel all-to-alls
    sent between ranks in a step (forward, backward and any recomputation; all ranks together),
    counted from the split sizes the host already holds. Every rank joins the one all-reduce; each
    stage's layers are held by dp * cp * tp ranks (each cp rank's auxiliary loss is its share: their
    mean is the microbatch's; each counts its own tokens' load)."""
    dev = next(model.parameters()).device
    layers = model.moe_layers()
    n_layer, n_expert = model.cfg.n_layer, model.cfg.n_expert
    # the byte counts need float64
    stats = torch.zeros(4 + n_layer * n_expert, device=dev, dtype=torch.float64)
    load = stats[4:].view(n_layer, n_expert)  # each stage fills its own layers' rows
    for i, m in layers.items():
        if m.aux_loss is not None:
            stats[:3] += torch.stack(
                [m.aux_loss.detach(), m.last_dropped_frac, torch.ones((), device=dev)]
            ).double()
        stats[3] += m.dispatch.bytes_sent
        load[i] = torch.tensor(m.step_load, dtype=torch.float64, device=dev)
        m.step_load, m.dispatch.bytes_sent = [0] * n_expert, 0
    if layout.world_size > 1:
        dist.all_reduce(stats)
    load = load / (layout.tp * max(steps, 1))  # tp ranks count the same tokens
    return {
        "aux_loss": (stats[0] / (layout.dp * layout.cp * layout.tp)).item(),
        "moe_dropped_frac": (stats[1] / stats[2].clamp(min=1)).item(),
        "expert_load_min": load.min().item(),
        "expert_load_max": load.max().item(),
        "a2a_bytes": (stats[3] / max(steps, 1)).item(),
    }


def expert_memory_bytes(model, optimizer):
    """(bytes of the routed experts' parameters, bytes of their optimizer state) on this rank: what
    expert parallelism divides by ep (and ZeRO-1 the moments further by the expert replicas). Every
    optimizer's states exist from the start."""
    params = model.expert_parameters().values()
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    state = [
        v
        for p in params
        if p in optimizer.state
        for v in optimizer.state[p].values()
        if torch.is_tensor(v)
    ]
    return param_bytes, sum(v.numel() * v.element_size() for v in state if v.dim() > 0)


def format_duration(seconds):
    """3725 -> '1h02m', 95 -> '1m35s', 7 -> '7s'."""
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def repeats_warning(max_iters, tokens_per_step, train_tokens):
    """The warning of a run that reads its training split several times over (the windows are drawn
    at random, so a pass is a mean: its tokens seen about once each)."""
    passes = max_iters * tokens_per_step / train_tokens
    return (
        f"warning: {max_iters} steps read {max_iters * tokens_per_step:,} tokens, "
        f"{passes:.1f} passes over the training split's {train_tokens:,}: the train loss will fall "
        f"below the val loss as the model learns this data by heart; prepare more text "
        f"(prepare_data.py --max_tokens) or lower max_iters (the log's epoch says which pass a "
        f"step is in)"
    )


def format_log_line(record, eta, dev):
    """The console line of a logged training step (record: the metrics.jsonl record). Its memory is
    the process's peak (peak_memory_bytes: the CPU's resident set, or CUDA's allocated bytes), which
    counts more than the live tensors the start-up line's plan is held to."""
    memory = "peak RSS" if dev.type == "cpu" else "peak allocated"
    # PeakFlops' remark on the MFU: a new probe, a cap
    mfu_note = f" ({record['mfu_note']})" if record.get("mfu_note") else ""
    line = (
        f"step {record['step']:6d} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
        f"grad norm {record['grad_norm']:.3f} | {record['tokens_per_sec']:,.0f} tok/s | "
        f"{record['ms_per_step']:.0f} ms/step | MFU {format_mfu(record['mfu'])}{mfu_note} | "
        f"{memory} {record['peak_mem_bytes'] / 2**20:,.0f} MiB | epoch {record['epoch']:.2f} | "
        f"eta {format_duration(eta)}"
    )
    if record["skipped_steps"]:
        line += f" | skipped {record['skipped_steps']}"
    if "exposed_comm_ms" in record:
        line += f" | comm waited {sum(record['exposed_comm_ms'].values()):.1f} ms"
    if "aux_loss" in record:
        line += (
            f" | aux {record['aux_loss']:.4f} dropped {record['moe_dropped_frac']:.3f} | "
            f"expert load {record['expert_load_min']:,.0f}-{record['expert_load_max']:,.0f} | "
            f"all-to-all {record['a2a_bytes'] / 2**20:,.2f} MiB"
        )
    return line


# -----------------------------------------------------------------------------
# 5. The memory of one step, measured
#
# What tools/memory_plan.py's prediction is held to (tests/test_memory.py): this rank's peak bytes
# during one step, from CUDA's allocator or, on CPU, from the live tensor storages.


def live_cpu_storages():
    """The storages of every CPU tensor alive now (found by the garbage collector: parameters,
    gradients, optimizer states), each once however many views share it, in a weak dictionary. A
    tensor whose storage is not on the CPU is left out: the FakeTensors that torch.compile keeps in
    its caches say device 'cpu' but hold a meta storage, no memory (counted, they made a compiled
    run's live bytes 500 MiB too many)."""
    gc.collect()  # (tensors in cycles nothing reaches any more: garbage, not alive)
    live = WeakIdKeyDictionary()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.untyped_storage().device.type == "cpu":
                    live[obj.untyped_storage()] = True
            except (ReferenceError, RuntimeError, NotImplementedError):
                pass  # a dead weak proxy; a tensor without a storage of its own (sparse, meta-like)
    return live


class LiveTensorBytes(TorchDispatchMode):
    """The peak of live tensor bytes on CPU while it is active, not the process RSS (which holds the
    interpreter and libraries). Every aten operation passes through __torch_dispatch__; the storages
    of its outputs are kept in a weak dictionary, so a storage leaves it when its last tensor,
    autograd's saved copies included, is gone (torch keeps one Python object per storage while the
    storage lives). It starts from the tensors already alive (live_cpu_storages), and reads every
    storage's size after each operation, so a storage resized in place (ZeRO-3's freed blocks) is
    followed. Not for compiled code: see measure_step_memory."""

    def __init__(self):
        super().__init__()
        self.live = live_cpu_storages()
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


def allocated_peak_bytes(step):
    """The peak of CPU tensor bytes during step(), from the CPU allocator rather than a dispatch
    mode: the storages alive before it (live_cpu_storages) plus the most that torch.profiler's
    memory events (every allocation and free through the CPU allocator, in order) add to them. For
    compiled code, which no dispatch mode can measure (see measure_step_memory). A block allocated
    before the step and freed in it is not subtracted (the profiler never saw its size): the few
    such in a step err high."""
    before = sum(storage.nbytes() for storage in live_cpu_storages().keys())
    profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    # Out of sight: kineto's own start and stop lines, and the allocator's warning about a block
    # freed that was allocated before profiling (once per thousand such frees: spent here on a block
    # of our own)
    before_profiling = [torch.empty(1)]
    _without_stderr(lambda: (profiler.__enter__(), before_profiling.clear()))
    try:
        step()
    finally:
        _without_stderr(lambda: profiler.__exit__(None, None, None))
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in profiler.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    # each event's bytes: an allocation's, or a free's negative; the most held is their running
    # sum's top
    return before + max(itertools.accumulate((nbytes for _, nbytes in events), initial=0))


def _without_stderr(fn):
    """fn() with file descriptor 2 sent to /dev/null (what C++ libraries print there; Python's
    exceptions still propagate)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            return fn()
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def measure_step_memory(step, dev, compiled=False):
    """This rank's peak bytes during step() (call it on an untimed step): the CUDA allocator's peak,
    or on CPU LiveTensorBytes', or with compiled blocks (compiled=True) allocated_peak_bytes'. A
    dispatch mode cannot measure compiled code: dynamo skips every frame it meets under a
    TorchDispatchMode, and marks it never to be compiled again (the first step measured so left
    compile=True running eager for good), and inside a compiled graph the generated code allocates
    its buffers outside the dispatcher, where no mode sees them. The CPU allocator sees every tensor
    either way; on eager steps the two agree (the quick start's first step: 322.2 MiB both), and the
    dispatch mode stays their measure, as it needs no profiler."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        step()
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev)
    if compiled:
        return allocated_peak_bytes(step)
    with LiveTensorBytes() as tracker:
        step()
    return tracker.peak
