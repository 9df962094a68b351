"""
The run set up and the model built: everything a training step needs, made once per launch.

  setup        what can fail because of the config or the data, before anything trains: the
               device and dtype, the process groups (parallel.init_distributed), the data, the
               attention kernel and the model's config (a Run); it prints the layout's lines
  build        this rank's model, pipeline, gradient reducer, optimizer, autocast and loss scaler
               (Parts)
  build_model  the whole model built on the meta device, the layout applied to it in one fixed
               order (apply_pipeline, apply_expert_parallel, apply_tensor_parallel,
               apply_context_parallel, apply_fp8, activation checkpointing), then this rank's share
               materialized; init_shares draws it from (seed, name), the same at every layout

train.py trains with what this makes; tools/bench.py times it and tools/memory_plan.py counts it.
"""

import faulthandler
import importlib.util
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, fields
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn

import checkpoint
import import_hf
import metrics
import settings
from configurator import make_folder
from data import load_data, read_data_meta
from context_parallel import apply_context_parallel
from expert_parallel import ExpertSplit, apply_expert_parallel
from fp8 import apply_fp8, check_fp8, count_fp8
from faults import BadSteps
from model import (
    ModelConfig,
    Transformer,
    apply_activation_checkpointing,
    choose_attn_impl,
    choose_device_and_dtype,
    compile_blocks,
    takes_muon,
)
from optim import TP_LINK_BUSBW, AdamW, DynamicLossScaler, Muon, describe_optimizer, muon_buckets
from parallel import (
    GradientBuckets,
    ParallelLayout,
    Pipeline,
    PipelineComm,
    Reducers,
    ShardedGradientBuckets,
    ZeroOneAdamW,
    apply_pipeline,
    full_shape_of,
    group_size,
    init_distributed,
    shard_of,
    tied_weight_group,
)
from pipeline_schedules import (
    SCHEDULES,
    SchedulePipeline,
    WeightGradStore,
    announced_by_hand,
    check_schedule,
    chunk_modules,
    chunk_parameters,
    cost_cut,
    virtual_stages,
)
from settings import check_layout, describe_layout
from tensor_parallel import apply_tensor_parallel
from zero import (
    FullyShardedParameters,
    GradientShards,
    backward_phases,
    overlap_param_gather,
    zero3_units,
)

# -----------------------------------------------------------------------------
# setup


def print0(layout, *args):
    if layout.rank == 0:
        print(*args, flush=True)


@dataclass
class Run:
    """What setup finds: where and how the run computes, its ranks, its model's settings and its
    data."""

    dev: torch.device
    dtype: torch.dtype  # what the blocks compute in (choose_device_and_dtype)
    layout: ParallelLayout
    model_cfg: ModelConfig
    attn_impl: str  # the attention kernel choose_attn_impl chose
    # split -> load_data's (path, dtype, tokens, vocabulary size); empty without data
    datasets: dict
    tokenizer: str  # what sample.py decodes with (None: it asks)
    hf_dir: str = None  # init_from=<a transformers model folder>, else None
    phase: str = "start-up"  # what the run is doing now: a failed peer's message names it
    # the batch the run was first given, which its checkpoints carry on (settings.batch_recipe)
    recipe: dict = None
    # what train sets once the model is built, for the log lines: the global batch's tokens, the
    # training split's, the model's FLOPs per token and the device's peak (metrics.PeakFlops)
    tokens_per_step: int = 0
    train_tokens: int = 0
    model_flops: float = 0.0
    peak: object = None
    # {mechanism: ms waited on communication} in the step before the log line
    exposed_comm_ms: dict = None
    # tools/step_time.py's, printed at start-up and beside a log line's measure
    predicted_step_s: float = None
    # the step measured_step tracked (slower): the measure beside the prediction comes after it
    memory_step: int = 0


def check_log_packages(cfg):
    """wandb_log and tensorboard_log need their packages installed."""
    for flag, package in (("wandb_log", "wandb"), ("tensorboard_log", "tensorboard")):
        if getattr(cfg, flag) and importlib.util.find_spec(package) is None:
            raise ValueError(
                f"{flag}=True needs the {package} package, which is not installed: pip install "
                f"{package} (or set --{flag}=False)"
            )


def check_out_dir(cfg):
    """out_dir made, and refused when it holds checkpoints a new run would overwrite."""
    make_folder("out_dir", cfg.out_dir)
    if cfg.init_from not in ("resume", "auto") and checkpoint.latest_checkpoint(cfg.out_dir):
        raise FileExistsError(
            f"out_dir '{cfg.out_dir}' already holds checkpoints and init_from={cfg.init_from!r} "
            f"would overwrite them: use --init_from=resume to continue, or choose another --out_dir"
        )


def model_config(cfg, data_meta):
    """The ModelConfig of the settings, the vocabulary and end-of-text token from the data's
    meta.json unless set (else GPT-2's vocabulary, and -1: no end-of-text token known)."""
    vocab = cfg.vocab_size or data_meta.get("vocab_size", 50257)
    eot = cfg.eot_token if cfg.eot_token is not None else data_meta.get("eot_token", -1)
    names = [f.name for f in fields(ModelConfig) if f.name not in ("vocab_size", "eot_token")]
    return ModelConfig(**{n: getattr(cfg, n) for n in names}, vocab_size=vocab, eot_token=eot)


def check_hf_folder(cfg, hf_dir, model_cfg, data_meta, layout):
    """A transformers model folder's weights checked against the model config, on every rank alike
    (a bad folder stops all of them); returns the tokenizer the run takes from it."""
    import_hf.check_weights(hf_dir, model_cfg)
    tokenizer, warning = import_hf.run_tokenizer(hf_dir, data_meta, cfg.data_dir)
    if warning:
        print0(layout, warning)
    return tokenizer


def setup(cfg, training=True):
    """Everything that can fail because of the config or the data, before any training starts: the
    device and dtype, the process groups, the data, the attention kernel and the model config.
    Returns them as a Run. tools/bench.py calls it with training=False: out_dir is not checked, and
    with data_dir=None no data is read (the vocabulary is then vocab_size, or GPT-2's)."""
    check_log_packages(cfg)
    check_schedule(cfg.pp_schedule, cfg.pp, cfg.gradient_accumulation_steps, cfg.pp_chunks)
    # a transformers model folder
    hf_dir = None if cfg.init_from in ("scratch", "resume", "auto") else cfg.init_from
    if training:
        check_out_dir(cfg)
    dev, ptdtype, dtype_why = choose_device_and_dtype(cfg.device, cfg.dtype)
    check_fp8(cfg.fp8, dev, ptdtype)
    # (convert the model and exit: no data needed)
    converting = hf_dir is not None and cfg.max_iters == 0
    data_meta, datasets = {}, {}
    if cfg.data_dir is not None and not converting:
        data_meta = read_data_meta(cfg.data_dir)
    model_cfg = model_config(cfg, data_meta)
    attn, attn_why = choose_attn_impl(cfg.attn_impl, dev.type, ptdtype, cfg.attn_softcap)
    layout = init_distributed(
        cfg.dp, cfg.tp, cfg.pp, dev.type, cp=cfg.cp, ep=cfg.ep, timeout_s=cfg.dist_timeout_s
    )
    if dev.type == "cuda":
        # NCCL's watchdog ends a rank whose collective timed out from C++ (an abort), past any
        # Python handler: faulthandler then prints every thread's Python stack, the line the rank
        # was waiting in (to the process's own stderr: sys.stderr may be a capture, with no fileno)
        faulthandler.enable(sys.__stderr__)
    check_layout(
        model_cfg,
        layout.tp,
        layout.pp,
        layout.cp,
        cfg.sequence_parallel,
        cfg.pp_chunks,
        ep=layout.ep,
    )
    tokenizer = data_meta.get("tokenizer", "gpt2")
    if hf_dir is not None:
        tokenizer = check_hf_folder(cfg, hf_dir, model_cfg, data_meta, layout)
    if dev.type == "cuda" and layout.world_size > 1:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
    if data_meta:
        datasets = load_splits(cfg, model_cfg.vocab_size, data_meta, layout)
    print0(
        layout,
        f"device: {dev}, dtype: {str(ptdtype).replace('torch.', '')} ({dtype_why}), "
        f"attention: {attn} ({attn_why})",
    )
    describe_run_layout(cfg, layout, model_cfg, attn, converting)
    return Run(
        dev=dev,
        dtype=ptdtype,
        layout=layout,
        model_cfg=model_cfg,
        attn_impl=attn,
        datasets=datasets,
        tokenizer=tokenizer,
        hf_dir=hf_dir,
    )


def load_splits(cfg, vocab, data_meta, layout):
    """{split: load_data's} of the data: train, and val unless it is absent or empty."""
    datasets = {"train": load_data(cfg.data_dir, "train", cfg.block_size, vocab, data_meta)}
    val_path = os.path.join(cfg.data_dir, "val.bin")
    # a corrupt val.bin stops the run
    if os.path.exists(val_path) and os.path.getsize(val_path) > 0:
        datasets["val"] = load_data(cfg.data_dir, "val", cfg.block_size, vocab, data_meta)
    else:  # a corpus of one document has no validation split: evaluate on train only
        print0(
            layout,
            f"no validation loss: {val_path} is absent or empty (a corpus of one document has no "
            f"validation split)",
        )
    return datasets


def describe_run_layout(cfg, layout, model_cfg, attn, converting):
    """The start-up lines of the layout: context parallelism's split, the rank grid, the pipeline's
    cut."""
    if layout.cp > 1:
        print0(
            layout,
            f"context parallelism: each sequence of {cfg.block_size} tokens split across cp = "
            f"{layout.cp} ranks ({cfg.block_size // layout.cp} each, two zigzag chunks); "
            f"attention is ring attention, whose own blockwise kernel replaces {attn}",
        )
    if cfg.chunked_loss and layout.tp > 1:
        print0(
            layout,
            f"chunked_loss: not at tp = {layout.tp} (the vocab-parallel loss never gathers the "
            f"logits anyway): the loss is computed from the logits",
        )
    # torchrun's processes on this node
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", layout.world_size))
    first, _, grid = describe_layout(
        layout, cfg.sequence_parallel, model_cfg.n_expert, per_node
    ).partition("\n")
    print0(
        layout,
        first
        + ("" if converting else f"; {settings.global_batch(vars(cfg), layout.dp)}")
        + "\n"
        + grid,
    )
    if layout.pp == 1 and cfg.pp_trace:
        print0(
            layout, "pp_trace: nothing to trace with pp = 1 (no pipeline); the run goes on untraced"
        )


@dataclass
class Parts:
    """What build makes: everything a training step needs."""

    model: Transformer
    optimizer: object  # optim.AdamW, parallel.ZeroOneAdamW or optim.Muon: grads(), step(found_inf)
    grad_sync: object  # the data-parallel reducer (parallel.GradientBuckets or an extension)
    pipeline: Pipeline  # None with pp = 1
    autocast: object  # torch.autocast of the run's dtype, or nullcontext() in fp32 and fp64
    scaler: DynamicLossScaler
    bad_steps: BadSteps
    compiled: bool  # whether the blocks run torch.compile'd (compile=True, until a compile fails)
    # init_from=<a transformers folder>: seconds, bytes_read, file_bytes
    loaded: SimpleNamespace = None


def build(cfg, run):
    """This rank's model (initialised, on its device), the pipeline, the gradient averaging across
    data-parallel ranks, the optimizer, the autocast context and the loss scaler: everything a
    training step needs. tools/bench.py builds through here too, so it times exactly what train.py
    runs."""
    layout = run.layout
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, run.model_cfg, layout, run.attn_impl, run.dev)
    loaded = None
    # a transformers model: each rank reads only its own slices of the weights
    if run.hf_dir is not None:
        start = time.time()
        read, total = import_hf.load_weights(model, run.hf_dir)
        loaded = SimpleNamespace(seconds=time.time() - start, bytes_read=read, file_bytes=total)
    else:
        # each full tensor drawn from (seed, name), this rank's share kept
        init_shares(model, cfg.seed)
    # float64 (a check on CPU): the parameters, and so everything computed from them, in float64;
    # the initial weights are the fp32 draws, the same at every layout. Other dtypes keep fp32
    # parameters and compute in the autocast dtype
    model.to(run.dev, dtype=torch.float64 if run.dtype == torch.float64 else None)
    pipeline = make_pipeline(cfg, layout, model, run.dev)
    grad_sync = make_grad_sync(model, cfg, layout, pipeline)
    # each gather waited for where forward reads it
    if cfg.overlap_param_gather and cfg.zero_stage in (1, 2):
        overlap_param_gather(model, grad_sync)
    optimizer = make_optimizer(model, cfg, layout, grad_sync)
    print0(layout, describe_optimizer(optimizer, model, cfg, layout))
    if cfg.fp8 != "none":
        print0(layout, f"fp8: {count_fp8(model)} linears ({cfg.fp8})")
    if model.cfg.n_expert > 0:
        expert_params, expert_state = metrics.expert_memory_bytes(model, optimizer)
        held = [int(e) for e in next(iter(model.moe_layers().values())).experts]
        print0(
            layout,
            f"experts: rank 0 holds experts {held[0]}-{held[-1]} of "
            f"{model.cfg.n_expert} in each layer (ep={layout.ep}): "
            f"{expert_params / 2**20:.2f} MiB of parameters, "
            f"{expert_state / 2**20:.2f} MiB of optimizer state",
        )
    if cfg.compile:
        print0(layout, "compiling each block with torch.compile (the first steps are slow)")
    fp16 = run.dtype == torch.float16
    autocast = (
        torch.autocast(run.dev.type, dtype=run.dtype)
        if run.dtype in (torch.bfloat16, torch.float16)
        else nullcontext()
    )
    return Parts(
        model=model,
        optimizer=optimizer,
        grad_sync=grad_sync,
        pipeline=pipeline,
        autocast=autocast,
        scaler=DynamicLossScaler(enabled=fp16),
        bad_steps=BadSteps(run.dev, cfg.max_bad_steps, enabled=not fp16),
        compiled=cfg.compile and compile_blocks(model),
        loaded=loaded,
    )


def stage_cut(cfg, schedule, pp, chunks=1, pp_layers=""):
    """The number of blocks of each of the pp * chunks model stages, first to last: the pp_layers
    setting's numbers when it is set ("7,1"; settings.check_values checked them), else the cut by
    the blocks' costs (cost_cut, by metrics.pipeline_costs). model.Transformer, the memory planner
    and the start-up line all take their cut from here."""
    if pp_layers:
        return tuple(int(n) for n in pp_layers.split(","))
    return cost_cut(schedule, pp, chunks, metrics.pipeline_costs(cfg))


def build_model(cfg, model_cfg, layout, attn_impl, dev):
    """This rank's model, uninitialised on dev: the whole model built on the meta device (no
    memory), the layout applied to it in one fixed order, each mechanism swapping in its own parts,
    then this rank's share materialized. tools/bench.py, tools/memory_plan.py and scripts/compare.py
    build through here too."""
    with torch.device("meta"):
        model = Transformer(model_cfg, attn_impl=attn_impl, chunked_loss=cfg.chunked_loss)
    # this rank's model chunks: the model cut into pp * pp_chunks stages (stage_cut)
    cut = stage_cut(model_cfg, cfg.pp_schedule, layout.pp, cfg.pp_chunks, cfg.pp_layers)
    apply_pipeline(
        model, cut, virtual_stages(cfg.pp_schedule, layout.pp, layout.pp_rank, cfg.pp_chunks)
    )
    apply_expert_parallel(model, layout.ep_group)  # this rank's experts
    apply_tensor_parallel(model, layout.tp_group, cfg.sequence_parallel)  # its slice of every layer
    # ring attention over its share of every sequence
    apply_context_parallel(model, layout.cp_group)
    # FP8 linears; the head and the router keep the run's dtype: the loss and routing stay precise
    apply_fp8(
        model,
        cfg.fp8,
        keep=lambda name, _: name == "lm_head" or name.endswith(".router"),
        token_group=layout.cp_group,
        device_type=torch.device(dev).type,
    )
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    return materialize(model, dev)


def materialize(model, device):
    """Give every parameter of a model built on the meta device memory on `device`, uninitialised:
    only this rank's shares exist by now, so that is all a rank allocates. The Parameter objects
    stay the same (their contents are swapped in), so what the layout marked on them (the shard a
    tensor-parallel weight is, the hooks that sum a gradient) stays. Initialise next (init_shares),
    or load a checkpoint."""
    for p in model.parameters():
        if p.is_meta:
            marks, hooks = dict(p.__dict__), list((p._backward_hooks or {}).values())
            real = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
            torch.utils.swap_tensors(p, real)
            p.__dict__.update(marks)
            # autograd's gradient hooks went with the old contents: register them on the new ones
            p._backward_hooks = None
            for hook in hooks:
                p.register_hook(hook)
    return model


def init_shares(model, seed):
    """model.init_weights with this layout's shares: each full tensor drawn, then cut to this rank's
    slice (shard_of). Returns the model."""
    model.init_weights(seed, full_shape=full_shape_of, share=shard_of)
    return model


def make_pipeline(cfg, layout, model, dev):
    """The Pipeline of this rank (None with pp = 1): parallel.Pipeline for afab and 1f1b, which
    runs parallel.PipelineExecutor; pipeline_schedules.SchedulePipeline for the schedules with
    chunks or a split backward. Every rank must call it: it builds process groups and runs the
    world's first collective (PipelineComm)."""
    if layout.pp == 1:
        return None
    schedule, v = cfg.pp_schedule, cfg.pp_chunks
    stages_of = lambda rank: virtual_stages(schedule, layout.pp, rank, v)  # afab, 1f1b: (rank,)
    # what travels: the hidden states of this rank's tokens, (B, T, n_embd) for token ids x of
    # (B, T), T being this rank's T/cp under context parallelism, T/tp of those under sequence
    # parallelism; in the residual stream's dtype, the parameters' (PipelineComm): fp32 or fp64
    dtype, seq_split = next(model.parameters()).dtype, layout.tp if cfg.sequence_parallel else 1
    comm = PipelineComm.from_layout(
        layout, model.cfg.n_embd, dev, dtype=dtype, stages_of=stages_of, seq_split=seq_split
    )
    tied_group, tied_copies = None, []
    # the embedding with stage 0, its copy (or itself) as the last's head
    if model.cfg.tie_embeddings:
        holders = [p for p in range(layout.pp) for s in stages_of(p) if s in (0, layout.pp * v - 1)]
        tied_group = tied_weight_group(layout, holders)
        tied_copies = (
            [model.tok_emb.weight]
            if model.tok_emb is not None
            else [model.lm_head.weight]
            if model.lm_head is not None
            else []
        )
    tied = dict(tied_copies=tied_copies, tied_group=tied_group, sums_tied=cfg.zero_stage < 2)
    if schedule in ("afab", "1f1b"):
        return Pipeline(comm, schedule, **tied)
    actions = SCHEDULES[schedule](layout.pp, layout.pp_rank, cfg.gradient_accumulation_steps, v)
    split = any(op == "W" for op, _, _ in actions)  # (zero_bubble, zbv)
    stores = [WeightGradStore(chunk_modules(model, c)) for c in range(v)] if split else None
    return SchedulePipeline(comm, schedule, **tied, chunks=v, weight_grad_stores=stores)


def make_grad_sync(model, cfg, layout, pipeline):
    """What averages the gradients across the ranks that hold the same parameters, dp x cp (each cp
    rank has the gradient of its share of every sequence), by ZeRO stage: GradientBuckets'
    all-reduce (0; of no parameter with a single replica), ShardedGradientBuckets' reduce-scatter
    (1), zero.GradientShards (2), zero.FullyShardedParameters (3); with Muon at 1, 2 and 3 its
    matrices dealt whole (optim.muon_buckets). Under expert parallelism the experts get a reducer of
    their own kind over the ranks that hold the same experts (expert_parallel.ExpertSplit). A tied
    weight's gradient changes after backward (its copies are summed by the pipeline): ZeRO-0 and 1
    average it in finish(), after that sum, by a reducer of its own without hooks (Reducers' late);
    ZeRO-2 and 3 sum the copies' shards themselves (tied). The split backward's W gradients are
    announced by hand (pipeline_schedules.announced_by_hand)."""
    zero, group, size = cfg.zero_stage, layout.dp_cp_group, cfg.bucket_size_mb
    if zero == 0 and group is None:
        # one replica: nothing to average (a reducer of no parameters)
        return GradientBuckets([], None)
    stores = getattr(pipeline, "weight_grad_stores", None)  # the split backward's: SchedulePipeline
    tied = (pipeline.tied_copies, pipeline.tied_group) if pipeline is not None else ((), None)
    phases = None
    if zero >= 2:  # the backward actions that write each parameter's gradient, by model chunk
        chunks = [chunk_parameters(model, c) for c in range(len(model.chunk_layers))]
        phases = backward_phases(chunks, stores)
    units = zero3_units(model, tied[0], phases) if zero == 3 else None
    matrices = (
        [p for name, p in model.named_parameters() if takes_muon(name, p)]
        if cfg.optimizer == "muon"
        else []
    )

    def reducer(params, group, tied=((), None)):
        keep = {id(p) for p in params}
        if zero == 0:
            return GradientBuckets(params, group, size)
        here = [(m, [p for p in ps if id(p) in keep], c) for m, ps, c in units] if units else None
        if matrices:
            mine = [p for p in matrices if id(p) in keep]
            return muon_buckets(params, mine, group, size, zero, phases, tied, here, model)
        if zero == 1:
            return ShardedGradientBuckets(params, group, size)
        if zero == 2:
            return GradientShards(params, group, size, phases, tied)
        return FullyShardedParameters(params, group, here, model, phases, tied)

    experts = (
        {id(p) for p in model.expert_parameters().values()}
        if layout.expert_dp_group is not group
        else set()
    )
    # ZeRO-0/1: a tied weight's copies, sent in finish()
    late = {id(p) for p in tied[0]} if zero <= 1 else set()
    grad_sync = reducer([p for p in model.parameters() if id(p) not in experts | late], group, tied)
    if late:
        grad_sync = Reducers(grad_sync, late=reducer(list(tied[0]), group))
    if experts:
        grad_sync = ExpertSplit(
            grad_sync,
            reducer([p for p in model.parameters() if id(p) in experts], layout.expert_dp_group),
        )
    if stores:  # W accumulates these outside autograd and announces them (ScheduleExecutor)
        announced_by_hand(grad_sync, [p for store in stores for p in store.params])
    return grad_sync


def muon_tp_rates(cfg, layout, dev):
    """optim.Muon's tp_rates where muon_tp_mode='auto' prices its tp split (optim.split_pays):
    the FLOP/s Newton-Schulz runs at (fp32 matmuls: the peak_flops setting where given, else the
    GPU's fp32 datasheet figure or the CPU probe, metrics.device_peak_flops) and the tp link
    (optim.TP_LINK_BUSBW). The slowest rank's rate (one all-reduce over the world), so that every tp
    rank deals the matrices alike (a CPU probe differs from process to process) and every replica
    as rank 0 says it does. None where not needed, or where the rate is unknown (every matrix then
    replicates, as before the mode existed)."""
    tp_group = getattr(layout, "tp_group", None)
    if cfg.muon_tp_mode != "auto" or group_size(tp_group) == 1 or dev.type not in TP_LINK_BUSBW:
        return None
    flops, _ = metrics.device_peak_flops(cfg.peak_flops, dev, torch.float32)
    rate = torch.tensor(float(flops or 0.0), device=dev)
    dist.all_reduce(rate, dist.ReduceOp.MIN)  # (every rank has tp > 1 here, so every rank calls it)
    return dict(flops=rate.item(), busbw=TP_LINK_BUSBW[dev.type]) if rate.item() > 0 else None


def make_optimizer(model, cfg, layout, grad_sync):
    """AdamW; weight decay on matrices (linears, embeddings) only, not on norm gains and biases.
    With zero_stage=1, 2 or 3, ZeroOneAdamW: the same update on the elements this rank owns,
    stepping with the sharded reducer. With optimizer='muon', optim.Muon: Muon for the blocks'
    matrices (takes_muon), with the same weight decay, AdamW as above for the rest (under ZeRO:
    with its reducer; under tp, who runs Newton-Schulz as muon_tp_mode says, at muon_tp_rates)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "muon":
        matrices = [p for name, p in model.named_parameters() if takes_muon(name, p)]
        chosen = {id(p) for p in matrices}
        groups = [{"params": matrices, "weight_decay": cfg.weight_decay, "muon": True}] + [
            dict(g, params=[p for p in g["params"] if id(p) not in chosen]) for g in groups
        ]
        return Muon(
            groups,
            lr=cfg.learning_rate,
            momentum=cfg.muon_momentum,
            ns_steps=cfg.muon_ns_steps,
            betas=betas,
            tp_group=layout.tp_group,
            grad_sync=grad_sync if cfg.zero_stage >= 1 else None,
            tp_mode=cfg.muon_tp_mode,
            tp_rates=muon_tp_rates(cfg, layout, next(model.parameters()).device),
        )
    if cfg.zero_stage >= 1:
        return ZeroOneAdamW(groups, grad_sync, lr=cfg.learning_rate, betas=betas)
    return AdamW(groups, lr=cfg.learning_rate, betas=betas)
