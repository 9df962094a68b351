r"""
Pretrain a Llama-style model on token bins written by prepare_data.py.

One process:            python train.py config/tiny_fineweb.py --max_iters=200
Several (any layout):   torchrun --nproc_per_node=8 train.py config/tiny_fineweb.py --tp=2 --pp=2
From a transformers model folder (import_hf.py), converted once, then trained:
    torchrun --nproc_per_node=2 train.py --init_from=hf/SmolLM2-135M --tp=2 --max_iters=0 \
        --out_dir=out/smol
    torchrun --nproc_per_node=2 train.py --init_from=resume --out_dir=out/smol --tp=2 \
        --data_dir=... --max_iters=500
Long sequences:
    torchrun --nproc_per_node=8 train.py config/tiny_fineweb.py --cp=2 --tp=2 --pp=2 \
        --block_size=1024
Long runs (a killed rank restarts the job, which resumes from its last checkpoint by itself):
    torchrun --nproc_per_node=8 --max-restarts=3 train.py config/tiny_fineweb.py --init_from=auto \
        --tp=2

Every setting, its default and its meaning is in settings.py (`python train.py --help` lists them);
a config file and --key=value overrides replace the defaults (configurator.py). Read top to bottom:
the settings, the step, evaluation and checkpoints, then the loop; the run is set up and the model
built by build.py, the batches come from data.py.
"""

import math
import os
import sys
import time
from dataclasses import asdict
from types import SimpleNamespace

import torch
import torch.distributed as dist

import checkpoint
import import_hf
import metrics
import settings
from build import build, print0, setup, stage_cut
from configurator import ConfigError, configure
from data import EVAL_STREAM, TRAIN_STREAM, DataError, document_end, rank_microbatches
from faults import StopVote, TooManyBadSteps, end_of_run, end_on_dead_peer, peer_failure, run_script
from model import takes_muon, uncompile_blocks
from optim import stepped_without_newton_schulz
from fp8 import count_fp8, fp8_calls
from ledger import (
    CommLedger,
    MechanismNotRun,
    format_ledger,
    layout_groups,
    unproven,
    world_totals,
)
from parallel import at_least_fp32, optimizer_state_bytes, wait_for_params
from tensor_parallel import sum_partial_grads

# The tools (tools/): the start-up memory plan, predicted step and pipeline description, the
# pipeline trace. Training never needs them: without the folder a run trains alike and says at
# start-up what it skipped.
try:
    from tools import memory_plan, step_time, timeline
except ModuleNotFoundError as missing:
    if not (missing.name or "").startswith("tools"):
        raise
    memory_plan = step_time = timeline = None

# -----------------------------------------------------------------------------
# settings


def configure_run(argv):
    """The run's settings from the command line (config files, then --key=value), checked. With
    init_from= 'resume' or 'auto' the ones left out come from the checkpoint, with init_from=<a
    transformers model folder> the architecture from its config.json, by settings.py's rules
    (resume_settings: the layout and the batch too). Returns (cfg, notes to print, the checkpoint to
    resume or None)."""
    values, given = configure(settings.TRAINING, argv, usage=__doc__)
    notes, path = [], None
    if values["init_from"] in ("resume", "auto"):
        path = checkpoint.latest_checkpoint(values["out_dir"])
        folders = checkpoint.checkpoint_folders(values["out_dir"])
        # the folders after the newest complete checkpoint: incomplete or damaged
        newer = (
            [p for p in folders if checkpoint.step_of(p) > checkpoint.step_of(path)]
            if path
            else folders
        )
        damaged = [f"{p} cannot be used: {checkpoint.why_incomplete(p)}" for p in newer]
        if path is None and values["init_from"] == "resume":
            raise FileNotFoundError(
                f"init_from='resume' but out_dir '{values['out_dir']}' holds no complete "
                f"checkpoint"
                + "".join(f" ({d})" for d in damaged)
                + ": use --init_from=scratch to start a new run"
            )
        if path is None:
            notes.append(
                f"init_from='auto': out_dir '{values['out_dir']}' holds no complete checkpoint"
                + "".join(f" ({d})" for d in damaged)
                + ", starting from scratch"
            )
        else:
            world_size = int(os.environ.get("WORLD_SIZE", 1))
            meta = checkpoint.read_meta(path)
            values, notes = settings.resume_settings(values, given, meta, path, world_size)
            notes = [
                f"resume: {d}; the newest complete checkpoint is {path}" for d in damaged
            ] + notes
    elif values["init_from"] != "scratch":
        model, _, notes = import_hf.model_settings(values["init_from"])
        values, changes = settings.resume_values(
            values, given, model, source=f"{values['init_from']}/config.json"
        )
        notes += changes
    notes += settings.check_values(values)  # (its warnings)
    return SimpleNamespace(**values), notes, path


# -----------------------------------------------------------------------------
# the step


def get_lr(step, cfg):
    """The learning rate of step `step` (from 0). Both schedules warm up linearly to learning_rate
    over warmup_iters steps and reach min_lr at lr_decay_iters, where they stay. In between:
        cosine  half a cosine from learning_rate down to min_lr (Loshchilov & Hutter 2017)
        wsd     warmup-stable-decay: learning_rate held, then over the last decay_frac of
                lr_decay_iters a decay to min_lr, linear or 1-sqrt:
                lr = learning_rate - (learning_rate - min_lr) * f(progress), f(x) = x or sqrt(x)
                (Hu et al. 2024, "MiniCPM"; Hägele et al. 2024, "Scaling Laws and Compute-Optimal
                Training Beyond Fixed Training Durations", whose 1-sqrt decay did best).
                While the peak is held the lr does not depend on lr_decay_iters, so a run resumed
                there with a larger lr_decay_iters (an allowed change) goes on as if planned so.
    """
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_iters + 1)
    if step >= cfg.lr_decay_iters:
        return cfg.min_lr
    if cfg.lr_schedule == "wsd":
        decay_start = max(cfg.warmup_iters, cfg.lr_decay_iters * (1 - cfg.decay_frac))
        if step < decay_start:
            return cfg.learning_rate
        progress = (step - decay_start) / (cfg.lr_decay_iters - decay_start)
        f = progress if cfg.decay_shape == "linear" else math.sqrt(progress)
        return cfg.learning_rate - (cfg.learning_rate - cfg.min_lr) * f
    progress = (step - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (
        cfg.learning_rate - cfg.min_lr
    )


def forward_backward(model, microbatches, autocast, loss_multiplier, grad_sync):
    """Run every micro-batch forward and backward, accumulating gradients. Each micro-batch's mean
    loss is divided by the number of micro-batches here, and only here, so the gradient is that of
    the mean loss over the whole batch. Returns that mean loss (a tensor: reading it is a
    host-device sync). The data-parallel reducer is told before each backward whether it is the last
    (it communicates only then) and after each that it ran (ZeRO-2/3 send every micro-batch's
    gradients), as the pipeline tells it."""
    total = 0.0
    # (x, y), or (x, y, positions) under context parallelism
    for i, batch in enumerate(microbatches):
        with autocast:
            # (not the logits: kept in a name, they would outlive the backward)
            loss = model(*batch)[1]
        loss = loss / len(microbatches)
        grad_sync.set_grad_sync(i == len(microbatches) - 1)
        (loss * loss_multiplier).backward()
        # ZeRO-2/3 (zero.py) send every micro-batch's gradients
        if hasattr(grad_sync, "backward_done"):
            grad_sync.backward_done("B", 0)
        total += loss.detach()
    return total


def forward_backward_step(parts, microbatches, trace=None):
    """Forward and backward of the step's micro-batches (through the pipeline schedule when pp > 1:
    the tied copies' gradients summed there), then the data-parallel average (grad_sync.finish:
    every parameter that got no gradient gets a zero one, as on every replica). Returns the loss
    (this rank's part of it with pp > 1). trace: see parallel.PipelineExecutor (pipeline only)."""
    args = (parts.model, microbatches, parts.autocast, parts.scaler.loss_multiplier())
    if parts.pipeline is not None:
        loss = parts.pipeline.forward_backward(*args, parts.grad_sync, trace)
    else:
        loss = forward_backward(*args, parts.grad_sync)
    parts.grad_sync.finish()  # waits for the data-parallel averaging launched during backward
    return loss


def global_grad_norm(model, layout, grads, dp_sharded=False):
    """The norm of the whole model's gradient, the same on every rank whatever the layout.
    Tensor-sharded parameters contribute their slice on each tp rank; replicated ones (norms) are
    counted on tp rank 0 only; pipeline stages hold disjoint blocks (a tied head's copy is not
    counted twice); data- and context-parallel replicas hold the same (already averaged) gradient
    and are counted once: a parameter is held by dp x cp replicas, an expert under expert
    parallelism by (dp / ep) x cp (each rank of an ep group holds other experts). Under ZeRO
    (dp_sharded) each replica holds the gradient of its own elements only: they add up. `grads`: the
    optimizer's grads()."""
    copies = {id(p) for name, p in model.named_parameters() if name in model.tied_copies()}
    experts = {id(p) for p in model.expert_parameters().values()}
    param = next(model.parameters())
    dev, dtype = param.device, at_least_fp32(param.dtype)
    sq = {is_expert: torch.zeros((), dtype=dtype, device=dev) for is_expert in (False, True)}
    for p, grad in grads:
        if id(p) in copies or (getattr(p, "tp_shard_dim", None) is None and layout.tp_rank != 0):
            continue
        sq[id(p) in experts] += grad.detach().to(dtype).pow(2).sum()
    if layout.world_size == 1:
        return (sq[False] + sq[True]).sqrt()
    replicas = (1, 1) if dp_sharded else (layout.dp_cp, layout.dp_cp // layout.ep)
    total = sq[False] / replicas[0] + sq[True] / replicas[1]
    dist.all_reduce(total)
    return total.sqrt()


def train_step(cfg, layout, parts, microbatches, lr, trace=None, step=0):
    """One optimizer step (the run's step-th, counted from 1): forward and backward of every
    micro-batch, unscaling (fp16), the global gradient norm and clipping, the optimizer. Returns
    (loss, grad norm), both tensors: nothing here waits for the device except fp16 loss scaling,
    which must read the norm to change its scale. trace: the pipeline actions' timer
    (timeline.PipelineTrace) or memory sampler, or None.

    A step whose global gradient norm is not finite (inf or NaN, the same on every rank: the norm is
    all-reduced) is skipped on the device: the optimizer gets found_inf, as torch's GradScaler hands
    it to the fused kernel, and leaves weights, moments and step counter as they were;
    parts.bad_steps counts it (faults.BadSteps, read at log lines), except under fp16, whose scaler
    skips its overflows itself (a lower scale is the cure there).

    torch.compile compiles inside the first forward and backward, so that is where it fails (no C
    compiler, an op it cannot trace): on one rank the step is then run again eagerly, and the blocks
    stay eager from then on (parts.compiled is False). (With pp > 1 or dp > 1 the ranks may already
    have communicated: the error stops the run.)"""
    optimizer, scaler = parts.optimizer, parts.scaler
    for group in optimizer.param_groups:
        group["lr"] = lr
    try:
        loss = forward_backward_step(parts, microbatches, trace)
    except Exception as e:
        if not parts.compiled or layout.pp > 1 or layout.dp_cp > 1:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print0(layout, f"torch.compile failed ({type(e).__name__}: {first}); continuing without it")
        optimizer.zero_grad(set_to_none=True)  # whatever the failed attempt accumulated
        parts.compiled = uncompile_blocks(parts.model)
        loss = forward_backward_step(parts, microbatches, trace)
    grads = optimizer.grads()
    # tensor parallelism's replicated parameters: each rank's part of their gradient
    sum_partial_grads(grads)
    scaler.unscale(grads)
    grad_norm = global_grad_norm(parts.model, layout, grads, dp_sharded=cfg.zero_stage >= 1)
    if cfg.grad_clip > 0:
        for _, grad in grads:
            grad.mul_((cfg.grad_clip / (grad_norm + 1e-6)).clamp(max=1.0))
    found_inf = (~torch.isfinite(grad_norm)).float()  # 0-dim, on the device: no sync
    scaler.update(found_inf)  # (fp16 only: reads it)
    optimizer.step(found_inf)
    if cfg.optimizer == "muon":
        check_muon_step(parts)
    parts.bad_steps.record(found_inf, step)
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


# -----------------------------------------------------------------------------
# evaluation


def rank_batch(cfg, run, data, stream, index):
    """This rank's micro-batches of global batch `index` of `stream` (data.rank_microbatches)."""
    return rank_microbatches(
        cfg,
        run.layout,
        data,
        stream,
        index,
        cfg.gradient_accumulation_steps,
        run.dev,
        document_end(run.model_cfg),
    )


@torch.no_grad()
def evaluate(cfg, run, parts):
    """Mean loss over eval_iters fixed batches of each split (the same batches at every evaluation).
    Each batch is a global batch, batch_size x gradient_accumulation_steps x dp windows, this rank
    taking its slice as training does (rank_microbatches): so every layout with the same global
    batch sees the same windows and reports the same losses. With pp > 1 the micro-batches go
    through the pipeline's stages, forward only. The evaluation's all-to-alls (expert parallelism)
    are not counted in the training log's a2a_bytes, which is the training step's traffic."""
    model, layout = parts.model, run.layout
    # ZeRO-1/2: the last step's gathers, if still in flight
    wait_for_params(parts.grad_sync.buckets)
    moe = list(model.moe_layers().values())
    sent = [m.dispatch.bytes_sent for m in moe]
    model.eval()
    out = {}
    for split, data in run.datasets.items():
        total = 0.0
        for i in range(cfg.eval_iters):
            micro = rank_batch(cfg, run, data, EVAL_STREAM, i)
            # the loss on the last stage (the mean over the micro-batches)
            if parts.pipeline is not None:
                loss = parts.pipeline.forward(model, micro, parts.autocast)
            else:
                loss = 0.0
                for batch in micro:
                    with parts.autocast:
                        loss = loss + model(*batch)[1].to(at_least_fp32(run.dtype)) / len(micro)
            total += loss / cfg.eval_iters
        out[split] = mean_across_ranks(total, layout).item()
    model.train()
    for m, before in zip(moe, sent):
        m.dispatch.bytes_sent = before
    return out


def mean_across_ranks(value, layout):
    """The job-wide mean of a per-rank loss: equal on tp ranks, different on each dp rank, each cp
    rank's its share (their mean is the loss: context_parallel.loss_share), and with pp > 1 in parts
    summed over the stages (the last stage's loss, the others' auxiliary losses or zero:
    parallel.PipelineExecutor). One all-reduce over the whole world, rank 0 and everyone get it."""
    if layout.world_size == 1:
        return value
    value = value.detach().to(at_least_fp32(value.dtype)) * (
        1.0 / layout.dp_cp if layout.tp_rank == 0 else 0.0
    )
    dist.all_reduce(value)
    return value


# -----------------------------------------------------------------------------
# checkpoints


def save_checkpoint(cfg, run, parts, step, converted=False):
    """converted: the model just loaded from a transformers folder (max_iters=0). Its checkpoint
    records the architecture as its settings and nothing of this launch's run: resuming it takes
    max_iters, the schedule and the data from its own command line, and starts a fresh optimizer
    (see resume). keep_last_n never removes the last checkpoint before a streak of skipped steps
    began (parts.bad_steps.keep)."""
    parts.bad_steps.check(cfg.out_dir, step)  # never save the state of a run that must stop
    # ZeRO-1/2: the parameters whole before they are written
    wait_for_params(parts.grad_sync.buckets)
    layout, model, optimizer = run.layout, parts.model, parts.optimizer
    config = vars(cfg)
    if converted:
        config = {
            k: v for k, v in asdict(run.model_cfg).items() if k not in import_hf.NOT_ARCHITECTURE
        }
    meta = {
        "config": config,
        "model": asdict(run.model_cfg),
        "tokenizer": run.tokenizer,
        "layout": {k: getattr(layout, k) for k in ("dp", "cp", "tp", "pp", "ep")},
        "adam_step": checkpoint.adamw_step_count(optimizer),
        "loss_scale": parts.scaler.scale,
    }
    if converted:
        meta["converted_from"] = os.path.abspath(cfg.init_from)
    else:
        meta["recipe"] = run.recipe
    extra = {"torch_rng": torch.get_rng_state()}
    if torch.cuda.is_available():
        extra["cuda_rng"] = torch.cuda.get_rng_state()
    # ZeRO-3: each rank saves the slices of the parameters it stores (flat ranges, as the moments)
    shards = {p: optimizer.owned_param(p) for p in optimizer.state} if cfg.zero_stage == 3 else None
    return checkpoint.save(
        cfg.out_dir,
        step,
        layout.rank,
        layout.world_size,
        checkpoint.model_pieces(model, layout, shards, optimizer),
        {} if converted else checkpoint.optimizer_pieces(optimizer, model, layout),
        meta,
        extra,
        cfg.keep_last_n,
        parts.bad_steps.keep(cfg.out_dir),
    )


def write_log(cfg, run, parts, log, record):
    """log.write(record), on every rank. When rank 0 cannot (a full disk: every rank learns it in
    the write), every rank saves this step if the disk lets it, and stops with rank 0's line saying
    what to do."""
    try:
        log.write(record)
    except metrics.LogError as e:
        step = record["step"]
        run.phase = f"saving the checkpoint of step {step} (the log could not be written)"
        try:
            path = save_checkpoint(cfg, run, parts, step)
        except checkpoint.CheckpointError as failed:
            raise metrics.LogError(f"{e}, and saving step {step} failed too: {failed}") from None
        raise metrics.LogError(
            f"{e}: the run stopped at step {step} and saved {path}. Free space on the disk of "
            f"out_dir '{cfg.out_dir}' (or fix its permissions), then launch again with "
            f"--init_from=auto to continue from there"
        ) from None


# -----------------------------------------------------------------------------
# the loop


def open_log(cfg, layout, resume_step, vote):
    """The run's metrics.MetricsLog (its backends on rank 0), every rank told of a failed write
    through the stop vote."""
    backends = metrics.open_log_backends(cfg) if layout.rank == 0 else []
    return metrics.MetricsLog(cfg.out_dir, layout.rank, resume_step, backends, vote.any_rank)


def checkpoint_due(cfg, step, last):
    """Whether step `step` is saved: every checkpoint_interval steps and the last (0: never)."""
    return cfg.checkpoint_interval > 0 and (step % cfg.checkpoint_interval == 0 or last)


def stopped_line(step):
    return (
        f"step {step:6d} | stopped by SIGTERM: every rank finished step {step} and saved it; "
        f"launch again with --init_from=auto (or resume) to continue from there"
    )


def train(cfg, run, resume_path=None):
    """Build the model (or convert a transformers folder and stop), start at step 0 or resume, then
    the loop: a step, then at their intervals its log line, an evaluation and a checkpoint, until
    max_iters or a SIGTERM every rank agreed to stop on. Returns the model."""
    layout = run.layout
    parts = build(cfg, run)
    if run.hf_dir is not None and cfg.max_iters == 0:
        return convert(cfg, run, parts)
    describe_training(cfg, run, parts)
    step = start_step(cfg, run, parts, resume_path)
    vote = StopVote(layout, layout.timeout, cfg.out_dir)
    log = open_log(cfg, layout, step if resume_path else None, vote)
    timer, timed_steps, logged = time.time(), 0, step
    # what the end of the run reports
    started, first_step, evals, newest, stopping = timer, step, [], resume_path, False
    micro = rank_batch(cfg, run, run.datasets["train"], TRAIN_STREAM, step)
    traced = cfg.pp_trace and parts.pipeline is not None and timeline is not None
    trace_step = min(step + 2, cfg.max_iters) if traced else None
    measured = None
    while step < cfg.max_iters:
        lr = get_lr(step, cfg)
        # pp_trace: the second step of this run (the first warms up), clocks set at a barrier
        trace = timeline.PipelineTrace(run.dev) if step + 1 == trace_step else None
        run.phase = f"training step {step + 1} (forward, backward, gradient averaging and norm)"
        loss, grad_norm, measured = one_step(cfg, run, parts, micro, lr, trace, step + 1, measured)
        step, timed_steps = step + 1, timed_steps + 1
        if trace is not None:
            print0(layout, timeline.write_pipeline_trace(trace, layout, cfg, step))
        run.phase = f"the stop vote after step {step} (a gloo all-reduce)"
        stopping = vote.agreed()
        end, last = step == cfg.max_iters, step == cfg.max_iters or stopping
        if not last:  # read the next batch now, while the GPU still works through this step
            micro = rank_batch(cfg, run, run.datasets["train"], TRAIN_STREAM, step)
        if step % cfg.log_interval == 0 or last:
            run.phase = f"the log line of step {step} (an all-reduce of the loss)"
            since = (time.time() - timer, timed_steps, logged)
            record = step_record(cfg, run, parts, step, loss, grad_norm, lr, since)
            if measured and step == measured[0]["step"]:
                record["memory"] = measured  # every rank's predicted and measured peak, once
            write_log(cfg, run, parts, log, record)
            timer, timed_steps, logged = time.time(), 0, step
        if cfg.eval_interval > 0 and (step % cfg.eval_interval == 0 or end) and not stopping:
            run.phase = f"the evaluation at step {step}"
            evals.append((step, evaluate_and_log(cfg, run, parts, log, step)))
            timer, timed_steps = time.time(), 0
        if checkpoint_due(cfg, step, last) or stopping:
            run.phase = f"saving the checkpoint of step {step}"
            newest = save_checkpoint(cfg, run, parts, step)
            print0(layout, f"step {step:6d} | saved {newest}")
            timer, timed_steps = time.time(), 0
        if stopping:
            print0(layout, stopped_line(step))
            break
    vote.finish()
    wait_for_params(parts.grad_sync.buckets)  # the model returned whole
    log.close()
    elapsed = time.time() - started
    tokens = run.tokens_per_step
    print0(layout, end_of_run(cfg, layout, first_step, step, tokens, elapsed, evals, newest))
    if stopping:
        # the status scripts/slurm.sh requeues the job on (faults.SAVED_ON_SIGTERM)
        vote.exit_saved(step)
    return parts.model


def describe_training(cfg, run, parts):
    """What the run's log lines need (the global batch's tokens, the training split's, the FLOPs per
    token, the device's peak), set on run; and their start-up lines, with the memory each rank is
    predicted to need."""
    layout = run.layout
    print0(layout, model_line(run, parts))
    if parts.loaded is not None:
        print0(
            layout,
            f"loaded {run.hf_dir} in {parts.loaded.seconds:.1f} s (rank 0 read "
            f"{parts.loaded.bytes_read / 2**20:,.1f} MiB of the files' "
            f"{parts.loaded.file_bytes / 2**20:,.1f})",
        )
    run.tokens_per_step = (
        cfg.batch_size * cfg.gradient_accumulation_steps * layout.dp * cfg.block_size
    )
    run.model_flops = metrics.flops_per_token(run.model_cfg)
    # (asked for the MFU of each log line)
    run.peak = metrics.PeakFlops(cfg.peak_flops, run.dev, run.dtype)
    print0(layout, f"{run.model_flops / 1e6:.1f} MFLOP per token; peak {run.peak}")
    run.train_tokens = run.datasets["train"][2]  # the training split's tokens (load_data)
    if cfg.max_iters * run.tokens_per_step > 4 * run.train_tokens:
        print0(
            layout, metrics.repeats_warning(cfg.max_iters, run.tokens_per_step, run.train_tokens)
        )
    if memory_plan is None:
        print0(
            layout,
            "tools/ is not here: no predicted memory or step at start-up, no measured peak beside "
            "a prediction"
            + (", no pipeline description" if layout.pp > 1 else "")
            + (", no pp_trace" if cfg.pp_trace else ""),
        )
        return
    if layout.pp > 1:
        cut = stage_cut(run.model_cfg, cfg.pp_schedule, layout.pp, cfg.pp_chunks, cfg.pp_layers)
        m, costs = cfg.gradient_accumulation_steps, metrics.pipeline_costs(run.model_cfg)
        print0(
            layout,
            timeline.describe_pipeline(cfg.pp_schedule, layout.pp, m, cfg.pp_chunks, cut, costs),
        )
    plan = memory_plan.plan_for(cfg, run.model_cfg, (layout.dp, layout.tp, layout.pp, layout.cp))
    print0(layout, "predicted " + memory_plan.format_plan(plan))
    run.predicted_step_s, lines, _ = step_time.run_prediction(
        cfg, run.model_cfg, layout, run.dev, run.dtype
    )
    print0(layout, lines)


def model_line(run, parts):
    m, params = run.model_cfg, metrics.full_param_count(parts.model, run.layout)
    return (
        f"model: {params / 1e6:.2f}M parameters (vocabulary padded), {m.n_layer} layers, "
        f"{m.n_head} heads ({m.n_kv_head} kv), width {m.n_embd}"
    )


def evaluate_and_log(cfg, run, parts, log, step):
    """evaluate, its line printed and its record logged; returns {split: loss}."""
    losses = evaluate(cfg, run, parts)
    record = {"step": step, **{f"{split}_loss": v for split, v in losses.items()}}
    print0(
        run.layout,
        f"step {step:6d} | eval "
        + " | ".join(f"{k} {v:.4f}" for k, v in record.items() if k != "step"),
    )
    write_log(cfg, run, parts, log, record)
    return losses


def start_step(cfg, run, parts, resume_path):
    """The step training starts from: 0, or the checkpoint's it resumes, whose batch recipe it
    carries on."""
    layout = run.layout
    # the batch this run was first given, which its checkpoints carry on (resume_settings): this
    # launch's, unless it resumed a run with the same global batch
    run.recipe = {
        "batch_size": cfg.batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "windows": cfg.batch_size * cfg.gradient_accumulation_steps * layout.dp,
    }
    if resume_path is None:
        return 0
    step, path, saved = checkpoint.resume_run(
        resume_path, cfg, run, parts, lambda text: print0(layout, text)
    )
    if settings.batch_recipe(saved)["windows"] == run.recipe["windows"]:
        run.recipe = settings.batch_recipe(saved)
    print0(
        layout,
        f"resumed from {path} at step {step}"
        + (
            f", which is max_iters = {cfg.max_iters} already: "
            f"nothing to train (raise --max_iters to go on)"
            if step >= cfg.max_iters
            else ""
        ),
    )
    if note := settings.global_batch_change(saved, run.tokens_per_step):
        print0(layout, note)
    return step


def one_step(cfg, run, parts, micro, lr, trace, step, measured):
    """train_step for step `step`: (loss, grad norm, measured). The run's first has every rank's
    peak memory measured (measured: None until then; its time includes the CPU tracker's). It and,
    with several ranks, the step before each log line run inside a communication ledger: the first
    is held to the settings (prove_mechanisms), the others' waits go to the log line
    (run.exposed_comm_ms)."""
    layout, first = run.layout, measured is None
    if not first and (layout.world_size == 1 or step % cfg.log_interval != 0):
        return (*train_step(cfg, layout, parts, micro, lr, trace, step=step), measured)
    graphs = compiled_graphs()
    with CommLedger(layout_groups(layout, parts.pipeline)) as ledger:
        if first:
            out = measured_step(cfg, run, parts, micro, lr, trace, step)
        else:
            out = (*train_step(cfg, layout, parts, micro, lr, trace, step=step), measured)
    run.exposed_comm_ms = ledger.waits() if layout.world_size > 1 else None
    if first:
        prove_mechanisms(cfg, run, parts, ledger, step, compiled_graphs() - graphs)
    return out


def check_muon_step(parts):
    """Stop the run naming the matrices that this step updated without Newton-Schulz
    (optim.stepped_without_newton_schulz): Muon silently off is AdamW or SGD, and trains on."""
    named = [(n, p) for n, p in parts.model.named_parameters() if takes_muon(n, p)]
    if missed := stepped_without_newton_schulz(parts.optimizer, named):
        raise MechanismNotRun(
            f"optimizer = 'muon': this step updated {len(missed)} of its matrices without "
            f"Newton-Schulz ({', '.join(missed[:3])}{', ...' if len(missed) > 3 else ''}): Muon is "
            f"not wired into the step. This is picotron's fault, not the settings': report it, "
            f"and train with optimizer = 'adamw' meanwhile"
        )


def compiled_graphs():
    """The graphs torch.compile has made in this process."""
    dynamo = sys.modules.get("torch._dynamo")  # (imported by the first torch.compile)
    return dynamo.utils.counters["stats"]["unique_graphs"] if dynamo is not None else 0


def prove_mechanisms(cfg, run, parts, ledger, step, compiled):
    """Stop the run (MechanismNotRun) when a mechanism its settings turned on did nothing in its
    first step, summed over the ranks (ledger.unproven); with comm_ledger, print the ledger.
    compiled: the graphs torch.compile made in the step."""
    layout = run.layout
    # compiled FP8 products run inside the graph, where nothing counts them: the linears are
    fp8 = count_fp8(parts.model) if parts.compiled else fp8_calls(parts.model)
    experts = {id(p) for p in parts.model.expert_parameters().values()}
    muon = {
        "newton_schulz": getattr(parts.optimizer, "orthogonalized", 0),
        "muon_matrices": len(getattr(parts.optimizer, "matrices", [])),
        "muon_expert_matrices": sum(
            id(p) in experts for p in getattr(parts.optimizer, "matrices", [])
        ),
        "muon_dealt": len(getattr(parts.optimizer, "tp_owners", {})),
    }
    counts = {**muon, "fp8_matmuls": fp8, "compiled_graphs": compiled}
    calls, counts = world_totals(ledger, counts, layout, run.dev)
    if problems := unproven(cfg, layout, calls, counts):
        raise MechanismNotRun("\n".join(problems))
    if cfg.comm_ledger:
        print0(layout, format_ledger(ledger.summary(), step, layout.rank))


def measured_step(cfg, run, parts, micro, lr, trace, step):
    """train_step with its peak memory measured (the first step of a run): (loss, grad norm, every
    rank's predicted and measured peak, memory_plan.memory_rows), the rows printed."""
    layout, out, run.memory_step = run.layout, [], step
    if memory_plan is None:  # (no plan to hold the measure to: describe_training said so)
        return (*train_step(cfg, layout, parts, micro, lr, trace, step=step), [])
    rank_plan = memory_plan.plan_for(
        cfg, run.model_cfg, (layout.dp, layout.tp, layout.pp, layout.cp), layout.dp_cp_rank
    )
    peak_bytes = metrics.measure_step_memory(
        lambda: out.append(train_step(cfg, layout, parts, micro, lr, trace, step=step)),
        run.dev,
        compiled=parts.compiled,
    )
    ((loss, grad_norm),) = out
    measured = memory_plan.memory_rows(
        layout, rank_plan[layout.pp_rank]["peak"], peak_bytes, step=step
    )
    print0(layout, memory_plan.format_memory_rows(measured, run.dev if parts.compiled else None))
    return loss, grad_norm, measured


def step_record(cfg, run, parts, step, loss, grad_norm, lr, since):
    """The log record of a training step, its line printed. since: (seconds, training steps and the
    step at the last log line): the speed is over the steps since, evaluations and saves left out.
    """
    layout, (elapsed, timed_steps, logged) = run.layout, since
    loss_value = mean_across_ranks(loss, layout).item()  # host-device sync, once per log interval
    skipped = parts.bad_steps.check(cfg.out_dir, step)
    record = {
        "step": step,
        "loss": loss_value,
        "lr": lr,
        "grad_norm": grad_norm.item(),
        "skipped_steps": skipped,
        "tokens_per_sec": run.tokens_per_step * timed_steps / elapsed,
        "ms_per_step": 1000 * elapsed / timed_steps,
        "optimizer_state_bytes": optimizer_state_bytes(parts.optimizer),  # on rank 0
        # passes over the training split so far
        "epoch": step * run.tokens_per_step / run.train_tokens,
    }
    record.update(run.peak.mfu(run.model_flops, record["tokens_per_sec"], layout.world_size))
    record["peak_mem_bytes"] = metrics.peak_memory_bytes(run.dev, layout)
    if run.exposed_comm_ms is not None and step % cfg.log_interval == 0:  # (this step's, counted)
        record["exposed_comm_ms"] = metrics.mean_waits(run.exposed_comm_ms, layout)
    if run.model_cfg.n_expert > 0:
        record.update(metrics.moe_metrics(parts.model, layout, steps=step - logged))
    # training steps only: evals and saves come on top
    eta = (cfg.max_iters - step) * elapsed / timed_steps
    print0(layout, metrics.format_log_line(record, eta, run.dev))
    # the predicted step time beside the measured one, once, past measured_step
    if run.predicted_step_s and (logged >= run.memory_step or step == cfg.max_iters):
        print0(
            layout,
            f"step time: predicted {run.predicted_step_s * 1e3:,.1f} ms, measured "
            f"{record['ms_per_step']:,.1f} ms (steps {logged + 1}-{step})",
        )
        run.predicted_step_s = None
    return record


def convert(cfg, run, parts):
    """init_from=<a transformers model folder> with max_iters=0: write the model just loaded as the
    step-0 checkpoint of out_dir, at this launch's layout, and say what each rank read and held
    (import_hf)."""
    print0(run.layout, model_line(run, parts))
    start = time.time()
    path = save_checkpoint(cfg, run, parts, 0, converted=True)
    print0(
        run.layout,
        import_hf.conversion_report(
            run.layout,
            run.hf_dir,
            parts.loaded,
            time.time() - start,
            path,
            metrics.rank_peak_memory_bytes(run.dev),
        ),
    )
    return parts.model


def main(argv):
    """Run training. Every error the user can fix ends in one line, printed once: by rank 0, since
    every rank finds the same configuration, data, layout or checkpoint problem (a bad batch is
    checked by every rank, a failed save or log line is reported to every rank), not a traceback
    from each of them."""
    rank = int(os.environ.get("RANK", 0))
    try:
        try:
            cfg, notes, resume_path = configure_run(argv)
            if rank == 0 and notes:
                print("\n".join(notes), flush=True)
            run = setup(cfg)
        except (
            ConfigError,
            ValueError,
            FileNotFoundError,
            FileExistsError,
            checkpoint.CheckpointError,
        ) as e:
            sys.exit(f"error: {e}")  # printed by rank 0 (faults.run_script)
        try:
            return train(cfg, run, resume_path)
        except (
            ConfigError,
            DataError,
            checkpoint.CheckpointError,
            TooManyBadSteps,
            metrics.LogError,
            MechanismNotRun,
        ) as e:
            sys.exit(f"error: {e}")  # printed by rank 0 (faults.run_script)
        except RuntimeError as e:
            if not peer_failure(e):
                raise
            # every survivor says it, and exits
            end_on_dead_peer(e, rank, run.phase, cfg.dist_timeout_s)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    run_script(main, sys.argv[1:])
