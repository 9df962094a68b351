"""
The 3D core of picotron's parallelism, in plain torch.distributed: data, tensor and pipeline
parallelism, one numbered section each, in the order a reader learns them (the Ultra-Scale
Playbook's: data parallelism and ZeRO, then tensor and sequence parallelism, then the pipeline).

  1. The layout: how the world of ranks is cut into data-, context-, tensor- and pipeline-parallel
     groups (and the data-parallel ranks into expert-parallel groups); settings.py prints the grid.
  2. Data parallelism: gradients averaged in buckets launched from backward hooks
     (GradientBuckets), with the few named hooks the mechanisms that extend it override.
  3. ZeRO-1: the buckets reduce-scattered instead (ShardedGradientBuckets) and an AdamW whose states
     are split across the data-parallel ranks (ZeroOneAdamW), stepped by torch's fused kernel.
  4. Tensor parallelism (Megatron-LM): the communication operators as autograd functions, the
     layers built from them (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding) and
     the vocab-parallel cross-entropy.
  5. Sequence parallelism, tensor parallelism's option: the two operators that split the tokens
     between the tensor-parallel regions, and the layers that end and begin them that way.
  6. Pipeline parallelism: a schedule as every rank's ordered list of forward and backward actions
     (AFAB, 1F1B), the stages' cut, the channel between the ranks, the executor that walks such a
     list on a real rank (PipelineExecutor), the tied-weight sync, and a step's Pipeline.

Each mechanism beyond these is a file of its own, importing only torch and this file:
tensor_parallel.py (tensor and sequence parallelism applied to the model), context_parallel.py (the
zigzag split and ring attention), zero.py (ZeRO-2 and ZeRO-3), expert_parallel.py (the all-to-all),
pipeline_schedules.py (interleaved 1F1B, ZB-H1, ZB-V and the split backward); optim.py holds AdamW's
interface and Muon. A core piece knows nothing of them: an extension goes through these
hooks, every method (with its arguments) or attribute (in backquotes) of a class here that those
files override, call or set (tests/test_lift.py reads their code and fails on one missing here):
  GradientBuckets
    plan(params, bucket_size_mb)      the buckets, lists of parameters (ZeRO-2/3: by backward
                                      action, one per unit; Muon: one owner each)
    new_bucket(params)                the object each bucket is, its flat buffer made now or not
    set_grad_sync(sync)               before each backward (ZeRO-2: lands what is in flight)
    grad_ready(p)                     p.grad complete: the hook's, or by hand (split backward's W)
    full(bucket), copy_in(bucket, i)  a bucket complete; p.grad into it
    launch(bucket), land(bucket)      post its collective; what p.grad becomes after it
    finish()                          after backward: every collective waited for
    `hooks`                           {id(p): its hook}, taken out where autograd does not say when
                                      p.grad is complete (Reducers' late; the split backward's
                                      announced_by_hand)
    `replicas`                        what the sums are divided by (the experts': the dense group's)
  ShardedGradientBuckets  owned_slices(), owned_param(piece), owned_grad(piece), gather(bucket),
                          after_step()  what the optimizer uses
  Bucket, ShardedBucket   zeros(), owned()  the flat buffer, this rank's range of it
  ColumnParallelLinear, RowParallelLinear  `matmul`  their product (the split backward's
                                           WeightGradStore)
  ColumnParallelLinear  `weight`, `vocab_size`  a head's weight tied to the embedding's, and its
                                                real rows (tensor_parallel.apply_tensor_parallel)
What ZeRO-2/3 add, backward_done(op, chunk) after each backward action, the executor and train.py
call where a reducer has it.

The pipeline's hooks (section 6). PipelineExecutor does each part of a step in a method of its own:
  act(action, received, last)     one action's work (the core's: F and B)
  backpropagate(out, loss, grad)  a backward's roots: the output's gradient, and a stage's own loss
  backward_done(op, chunk)        after a backward action: the reducer told, if it sends per action
  wait(request, action, source)   an input's arrival: a dead or hung sender named
  `trace`                         a context manager around each action (tools/timeline.py's)
pipeline_schedules.py runs its schedules through subclasses of PipelineExecutor (ScheduleExecutor:
act runs W actions, the split backward around B and the hand-over between two chunks of one rank
around the core's act, and calls backward_done after a W) and of Pipeline (SchedulePipeline), which
override
  actions(m), evaluation_actions(m)  this rank's list for a step, and for evaluation
  executor(model, microbatches, autocast, loss_multiplier, grad_sync, trace)  what runs them
It calls run(actions), PipelineComm is_here(stage) (the hand-over) and, on the data-parallel
reducer, set_grad_sync and grad_ready.

Every piece works given only torch and a process group, so it can be lifted into another project.
group=None always means "not split" (one rank), never torch's default world group, wherever a group
is taken (here and in the files beyond): a layer or reducer given None computes what the one-process
torch code computes, and each collective helper (copy_to_tp, reduce_from_tp, gather_from_tp,
scatter_to_tp, gather_from_sp, reduce_scatter_to_sp, vocab_parallel_cross_entropy;
context_parallel.ring_attention, expert_parallel.dispatch_to_experts) returns its input's
one-process result. Apply an autograd Function through its helper: called directly with None, it
would hand None to torch, whose collectives read it as the default world group.

Each numbered section's header says which earlier sections it needs (`# Needs:`); every one needs
the top of the file (the imports, the two renamed collectives and at_least_fp32) and no
later section, so a section lifts with the ones it names (tests/test_lift.py lifts them so, and runs
them).

References: Li et al. 2020, "PyTorch Distributed" (section 3.2.3); Rajbhandari et al. 2020, "ZeRO"
(section 5.1); Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models
Using Model Parallelism" (the f and g operators, section 3); Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models" (sequence parallelism, section 4.2.2); Huang
et al. 2019, "GPipe" (all forward, all backward); Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM" (1F1B, section 2.2.1).
"""

import itertools
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.adamw import adamw


# torch 2.13 renamed the single-tensor collectives (the old names still warn): looked up at each
# call, so that a ledger wrapping torch.distributed (ledger.py) sees them.
def _reduce_scatter_single(*args, **kwargs):
    return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(*args, **kwargs)


def _all_gather_single(*args, **kwargs):
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(*args, **kwargs)


def at_least_fp32(dtype):
    """The dtype of the sums that must not be taken in half precision (norms, softmax, losses):
    fp32, or fp64 for a run in float64 (dtype='float64', CPU), which must not be rounded to fp32
    either."""
    return torch.promote_types(dtype, torch.float32)


# -----------------------------------------------------------------------------
# 1. The layout
# Needs: no other section.


def group_size(group):
    """The ranks of a process group (None: one). Read from the group itself, so that anything with
    size() and rank() stands for one where no process runs (tools/memory_plan.py builds a rank's
    model so)."""
    return group.size() if group is not None else 1


def group_rank(group):
    return group.rank() if group is not None else 0


def grid_rank(pp_rank, dp_rank, tp_rank, dp, tp, cp_rank=0, cp=1):
    """The global rank at a point of the dp x cp x tp x pp grid (see ParallelLayout for why this
    order)."""
    return ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank


def resolve_dp(world_size, dp, tp, pp, count_name="WORLD_SIZE", cp=1, ep=1):
    """The data-parallel size of a launch: dp = 0 means whatever the world leaves after cp * tp *
    pp; any other dp must make dp * cp * tp * pp the world size; and ep (expert parallelism,
    expert_parallel.py) must divide dp. The one place these rules live (train.py, tools/bench.py and
    tools/make_config.py, whose count_name is 'nproc', all come here)."""
    split = cp * tp * pp
    # a run that does not split the sequence gets the message it always had, without cp in it
    axes, product, names = f"tp = {tp} x pp = {pp}", f"tp * pp = {tp} * {pp}", "--tp/--pp"
    if cp > 1:
        axes, product, names = (
            f"cp = {cp} x " + axes,
            f"cp * tp * pp = {cp} * {tp} * {pp}",
            "--cp/--tp/--pp",
        )
    if world_size % split != 0:
        raise ValueError(
            f"{count_name} = {world_size} process{'es' if world_size != 1 else ''} cannot be cut "
            f"into {axes}: the world size {world_size} is not divisible by {product}; launch a "
            f"multiple of {split} processes or change {names}"
        )
    if dp == 0:
        dp = world_size // split
    elif dp * split != world_size:
        cut = f"dp={dp} x " + (f"cp={cp} x " if cp > 1 else "") + f"tp={tp} x pp={pp}"
        flags = "--dp, --cp, --tp and --pp" if cp > 1 else "--dp, --tp and --pp"
        raise ValueError(
            f"the layout {cut} = {dp * split} ranks does not match the world size {world_size}: "
            f"set {flags} so that their product is {world_size} (leave dp=0 to have it computed "
            f"as world_size / ({'cp * ' if cp > 1 else ''}tp * pp))"
        )
    if dp % ep != 0:
        raise ValueError(
            f"ep = {ep} must divide dp = {dp}: the experts are spread over ep of the data-parallel "
            f"ranks, so launch a multiple of ep * {product.split(' = ')[0]} = {ep * split} "
            f"processes or choose an ep that divides {dp}"
        )
    return dp


class ParallelLayout:
    """Cuts `world_size` ranks into a dp x cp x tp x pp grid and builds one process group per line
    of it.

    Ranks are numbered with tp fastest, then cp, then dp, then pp (Megatron-LM's order):
        rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank
    which at cp = 1 is (pp_rank * dp + dp_rank) * tp + tp_rank, the numbering of a run without cp.
    Tensor parallelism talks on every layer (several collectives per block), so its ranks are
    neighbours, which on a real cluster means the same node and its fast links: torchrun gives each
    node consecutive ranks, so a tp group stays inside a node whenever tp divides the processes per
    node (see settings.tp_groups_across_nodes). Context parallelism passes keys and values round a
    ring in every attention layer, the next chattiest; data parallelism talks once per step,
    pipeline parallelism only sends activations between neighbouring stages, so both can span nodes.

    `timeout` is how long a collective on these groups waits for its peers before it fails (a group
    does not inherit the default group's timeout from init_process_group: it must be passed to
    each). Each group is named after its axes (group_desc): NCCL's watchdog names the group in its
    timeout message.

    Groups: tp_group, cp_group, dp_group and pp_group, the lines along one axis; and dp_cp_group,
    the dp x cp ranks that hold the same parameters (same tp slice, same stage): gradients are
    averaged and ZeRO shards over it (at cp = 1 it is the dp group). A group of one rank is None.

    Expert parallelism (ep, expert_parallel.py) cuts each line of dp ranks into dp / ep blocks of ep
    neighbours: the ranks of a block (ep_group, ep_rank its index) hold different experts and
    exchange tokens twice per MoE layer, the chattiest group after tp and cp, so they are neighbours
    too; the ranks at the same place of every block, of every cp share (expert_dp_group, (dp / ep) *
    cp of them) hold the same experts and average their gradients. At ep = 1 the ep_group is None
    and the expert_dp_group is the dp_cp_group.

    With world_size 1 no group is built and every group is None: the single-process path (what None
    means: the module docstring).
    """

    def __init__(self, dp, tp, pp, world_size=1, rank=0, cp=1, ep=1, timeout=None):
        dp = resolve_dp(world_size, dp, tp, pp, cp=cp, ep=ep)
        self.dp, self.cp, self.tp, self.pp, self.ep = dp, cp, tp, pp, ep
        self.world_size, self.rank, self.timeout = world_size, rank, timeout
        self.tp_rank = rank % tp
        self.cp_rank = (rank // tp) % cp
        self.dp_rank = (rank // (tp * cp)) % dp
        self.pp_rank = rank // (tp * cp * dp)
        self.dp_cp, self.dp_cp_rank = dp * cp, self.dp_rank * cp + self.cp_rank
        self.ep_rank = self.dp_rank % ep
        self.tp_group = self.cp_group = self.dp_group = self.pp_group = self.dp_cp_group = None
        self.ep_group = self.expert_dp_group = None
        # the global ranks of the neighbouring pipeline stages
        stage = lambda p: grid_rank(p, self.dp_rank, self.tp_rank, dp, tp, self.cp_rank, cp)
        self.pp_prev = stage(self.pp_rank - 1) if self.pp_rank > 0 else None
        self.pp_next = stage(self.pp_rank + 1) if self.pp_rank < pp - 1 else None
        if world_size == 1:
            return
        # A group is a line of the grid: the ranks that differ along its axes only (none for an axis
        # of size 1). Each rank must create all of them, in the same order, even those it is not in.
        sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
        rank_at = lambda c: grid_rank(c["pp"], c["dp"], c["tp"], dp, tp, c["cp"], cp)
        # (dp, cp) is built at dp = 1 too, a group of the cp line's ranks: the gradients' averaging
        # then has a group of its own, which a ledger (ledger.py) tells from the ring exchange
        lines = [("tp",), ("cp",), ("dp",), ("pp",)] + ([("dp", "cp")] if cp > 1 else [])
        for axes in lines:
            if math.prod(sizes[a] for a in axes) == 1:
                continue
            fixed = [a for a in sizes if a not in axes]
            for at in itertools.product(*(range(sizes[a]) for a in fixed)):
                ranks = sorted(
                    rank_at({**dict(zip(fixed, at)), **dict(zip(axes, along))})
                    for along in itertools.product(*(range(sizes[a]) for a in axes))
                )
                group = dist.new_group(ranks, timeout=timeout, group_desc="_".join(axes))
                if rank in ranks:
                    setattr(self, f"{'_'.join(axes)}_group", group)
        # cp is 1: the dp line holds the same parameters
        if self.dp_cp_group is None:
            self.dp_cp_group = self.dp_group
        # the expert groups (where one of them is a line built above, that line)
        self.expert_dp_group = self.dp_cp_group if ep == 1 else None
        if ep > 1:
            self.ep_group = self.dp_group if ep == dp else None
            blocks, replicas = expert_groups(dp, tp, pp, cp, ep)
            for kind, groups in (
                ("ep_group", blocks if ep < dp else []),
                ("expert_dp_group", replicas if dp * cp > ep else []),
            ):
                for ranks in groups:
                    group = dist.new_group(ranks, timeout=timeout, group_desc=kind)
                    if rank in ranks:
                        setattr(self, kind, group)


def expert_groups(dp, tp, pp, cp, ep):
    """The expert-parallel blocks (ep neighbouring dp ranks at one cp share, tp slice and stage) and
    the expert replicas (the ranks at the same place of every block and cp share: they hold the same
    experts), as lists of global ranks."""
    blocks, replicas = [], []
    for p, t in itertools.product(range(pp), range(tp)):
        rank_of = lambda d, c: grid_rank(p, d, t, dp, tp, c, cp)
        blocks += [
            [rank_of(b * ep + e, c) for e in range(ep)] for c in range(cp) for b in range(dp // ep)
        ]
        replicas += [
            sorted(rank_of(b * ep + e, c) for b in range(dp // ep) for c in range(cp))
            for e in range(ep)
        ]
    return blocks, replicas


def init_distributed(dp, tp, pp, device_type, cp=1, ep=1, timeout_s=None):
    """Start torch.distributed when launched by torchrun (WORLD_SIZE set) and build the layout. dp=0
    means "whatever is left": world_size / (cp * tp * pp). timeout_s: how long any collective waits
    for its peers before it fails (None: torch's default, 10 minutes on gloo, 30 on NCCL)."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    # before any process group: a bad layout fails fast, alone
    dp = resolve_dp(world_size, dp, tp, pp, cp=cp, ep=ep)
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        store = _store_of_this_attempt(world_size, timeout)
        if store is None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend=backend, timeout=timeout, store=store, rank=rank, world_size=world_size
            )
    return ParallelLayout(dp, tp, pp, world_size, rank, cp=cp, ep=ep, timeout=timeout)


def _store_of_this_attempt(world_size, timeout):
    """Under torchrun, the key-value store the ranks meet in, with keys of this attempt only (None
    when not launched by torchrun's agent). torchrun keeps one store for the whole job, restarts
    included, and every process group publishes its ranks' addresses in it under the same keys at
    every attempt: a restarted rank could read a dead rank's address from the attempt before and
    fail to connect ('Connection refused'). A prefix per attempt (TORCHELASTIC_RESTART_COUNT) keeps
    each attempt's keys apart."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timeout or timedelta(minutes=10),
    )
    return dist.PrefixStore(f"picotron/attempt_{attempt}", store)


# -----------------------------------------------------------------------------
# 2. Data parallelism: gradients averaged in buckets, from backward hooks
# Needs: section 1 (group_size).
#
# Every data-parallel rank holds the same parameters and runs its own slice of the global batch, so
# its gradient is the mean over its slice; the mean over the whole batch is the average of the
# ranks' gradients. Averaging is one collective per bucket of parameters, launched from a backward
# hook the moment the bucket's last gradient is ready, so the communication of the layers near the
# output runs while backward is still computing the layers near the input (the overlap
# DistributedDataParallel has; Li et al. 2020, "PyTorch Distributed", section 3.2.3). Under context
# parallelism (context_parallel.py) the ranks of a cp group hold the same parameters too, each with
# the gradient of its share of every sequence: gradients are then averaged, and ZeRO shards, over
# the dp x cp ranks (layout.dp_cp_group), "dp" below its size.
#
# A bucket is one flat tensor, so it holds parameters of one dtype only: a parameter whose dtype
# differs from the one before it starts a new bucket. With gradient accumulation only the last
# micro-batch's backward communicates: the others just accumulate into p.grad.
#
# The buckets are launched in their order, the same on every rank, even when they fill in another
# order: collectives on a group must be issued in the same order by every rank, and the order
# gradients arrive in may depend on the data (a parameter that got no gradient on one rank has none
# until finish() there). A bucket that is full waits for the ones before it (as
# DistributedDataParallel's reducer does); out of order, two ranks would add up different buckets, a
# mismatch error when their sizes differ and silently wrong gradients when they do not.


class Bucket:
    """Parameters whose gradients travel as one flat tensor: `flat`, each parameter's elements at
    its offset, in order (allocated by the reducer: zeros()). `ready` holds the indices of those
    copied in, `work` the collective in flight. `group`: the ranks that average it."""

    def __init__(self, params, group):
        self.params, self.group = params, group
        self.offsets, n = [], 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel, self.flat = n, None
        self.ready, self.work = set(), None

    def zeros(self):
        return torch.zeros(self.numel, dtype=self.params[0].dtype, device=self.params[0].device)

    def views(self):
        """(param, its elements of flat, shaped like it)."""
        return [
            (p, self.flat[start : start + p.numel()].view_as(p))
            for p, start in zip(self.params, self.offsets)
        ]


class GradientBuckets:
    """Averages the gradients of `params` over the data-parallel `group`, in buckets of about
    bucket_size_mb launched asynchronously from backward hooks
    (Tensor.register_post_accumulate_grad_hook). Do not also wrap the model in
    DistributedDataParallel.

    Per step: before each micro-batch's backward call set_grad_sync(False) for the
    gradient-accumulation micro-steps (gradients just accumulate, nothing is sent) and
    set_grad_sync(True) before the last; after backward, finish() waits for the collectives and
    leaves the average gradient in every p.grad (zeros for a parameter that got none, as on every
    replica). A gradient accumulated outside autograd (no hook fires) is announced with
    grad_ready(p) once complete."""

    def __init__(self, params, group, bucket_size_mb=25.0):
        # replicas: what the summed gradients are divided by
        self.group, self.replicas = group, group_size(group)
        # launched: buckets sent since the last finish(), in order
        self.sync, self.launched = True, 0
        params = [p for p in params if p.requires_grad]
        self.buckets = [self.new_bucket(ps) for ps in self.plan(params, bucket_size_mb)]
        self.where = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self.hooks = {id(p): p.register_post_accumulate_grad_hook(self.grad_ready) for p in params}

    def plan(self, params, bucket_size_mb):
        """Backward produces gradients roughly in the reverse order of the forward pass: bucket them
        that way, a bucket closed once it holds bucket_size_mb, or when the next parameter's dtype
        differs."""
        capacity, buckets, current, size = max(1, int(bucket_size_mb * 2**20)), [], [], 0
        for p in reversed(params):
            if current and (p.dtype != current[0].dtype or size >= capacity):
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        return buckets + ([current] if current else [])

    def new_bucket(self, params):
        bucket = Bucket(params, self.group)
        bucket.flat = bucket.zeros()
        return bucket

    def set_grad_sync(self, sync):
        self.sync = sync

    def grad_ready(self, p):
        """p.grad is complete for this step: copy it into its bucket, then launch, in bucket order,
        every bucket that is full and has only launched buckets before it. Nothing in a
        gradient-accumulation micro-step (set_grad_sync(False)); a parameter it does not average
        (none with a single replica) needs nothing."""
        if not self.sync or p not in self.where:
            return
        bucket, i = self.where[p]
        if i in bucket.ready:
            raise RuntimeError(
                "a gradient became ready twice in one synchronised step: call set_grad_sync(False) "
                "before the backward of every micro-batch but the last"
            )
        self.copy_in(bucket, i)
        while self.launched < len(self.buckets) and self.full(self.buckets[self.launched]):
            self.launch(self.buckets[self.launched])
            self.launched += 1

    @staticmethod
    def full(bucket):
        return len(bucket.ready) == len(bucket.params)

    def copy_in(self, bucket, i):
        """p.grad into its place in the bucket (zeros for a parameter without a gradient)."""
        p, start = bucket.params[i], bucket.offsets[i]
        view = bucket.flat[start : start + p.numel()]
        view.copy_(p.grad.reshape(-1)) if p.grad is not None else view.zero_()
        bucket.ready.add(i)

    def launch(self, bucket):
        if bucket.flat.numel() and group_size(bucket.group) > 1:
            bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)

    def land(self, bucket):
        if self.replicas > 1:
            # the sum over the ranks / dp = the mean over the global batch
            bucket.flat.div_(self.replicas)
        for p, view in bucket.views():
            p.grad = view

    def finish(self):
        """Launch, in bucket order, what the hooks did not (parameters that got no gradient this
        step, the buckets after them), wait for every collective and land each bucket."""
        for bucket in self.buckets[self.launched :]:
            for i in range(len(bucket.params)):
                if i not in bucket.ready:
                    self.copy_in(bucket, i)
            self.launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()  # sync point: the gradient is needed from here on
            self.land(bucket)
            bucket.ready, bucket.work = set(), None
        self.sync, self.launched = True, 0


# -----------------------------------------------------------------------------
# 3. ZeRO-1: the optimizer states sharded across the data-parallel ranks
# Needs: sections 1 (group_size, group_rank) and 2 (Bucket, GradientBuckets).
#
# ZeRO stage 1 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
# Parameter Models", section 5.1) keeps data parallelism, but each rank keeps the AdamW moments of
# only 1/dp of the elements: the gradients are reduce-scattered (each rank receives the average of
# its own slice only), each rank updates its slice of the parameters, and the updated slices are
# all-gathered so that every rank holds the whole model again. Compared with all-reduce + AdamW the
# communication volume is the same (an all-reduce is a reduce-scatter followed by an all-gather),
# the optimizer memory is 1/dp. Gloo (CPU) has no reduce-scatter of its own (torch's emulation takes
# twice an all-reduce's time): there it is written out as point-to-point exchanges (SlicesExchange),
# with a reduce-scatter's bytes, half an all-reduce's.
#
# The slices are cut from each bucket's flat buffer, padded to a multiple of dp, not handed out
# tensor by tensor: every rank gets the same number of elements (within the padding), whatever the
# tensor sizes. zero.py goes on to ZeRO-2 (the gradients kept as shards too) and ZeRO-3 (the
# parameters as well); it reuses the pieces here that are not methods: ShardedBucket,
# post_reduce_scatter and summed_slice, owned_slices, gather_slices and wait_for_params.
#
# After the step the all-gather of the updated slices need not hold the step up: each bucket's
# gather is posted, and waited for only where its parameters are first read (Megatron-LM's
# --overlap-param-gather). zero.overlap_param_gather puts that wait in forward pre-hooks and marks
# the buckets it covers (`waited_by_hook`); anything else that reads the parameters (an evaluation,
# a save) calls wait_for_params first.


def reduce_scatter(out, flat, group):
    """Post out = this rank's slice (group rank r: the r-th of equal pieces) of the sum of flat over
    the group; returns its request. NCCL's reduce-scatter, or on gloo SlicesExchange (torch's
    emulation takes twice an all-reduce's time: 14 against 7 ms for 10 MB at 2 ranks)."""
    if dist.get_backend(group) != "gloo":
        return _reduce_scatter_single(out, flat, group=group, async_op=True)
    return SlicesExchange(out, flat, group)


class SlicesExchange:
    """A reduce-scatter on gloo, in dp - 1 steps of a ring's order: at step s rank r sends rank r +
    s the piece of flat that rank owns and receives its own piece from rank r - s, so each rank
    sends (dp - 1)/dp of flat, a reduce-scatter's bytes and half an all-reduce's (measured: 4.3
    against 10.2 ms for 10 MB at 2 ranks). Every step is posted at once: a ring proper forwards
    partial sums, each step waiting for the one before, which on gloo (no stream to queue them on)
    would take a thread to stay asynchronous; sent straight to their owners the pieces need none,
    for the same bytes. The first piece lands in out itself, the others (dp > 2) in buffers of their
    own; wait() adds this rank's own piece and those to it."""

    def __init__(self, out, flat, group):
        n, r = group_size(group), group_rank(group)
        pieces = flat.view(n, -1)
        self.out, self.mine = out, pieces[r]
        self.received = [out] + [torch.empty_like(out) for _ in range(2, n)]
        self.requests = [
            dist.isend(pieces[(r + s) % n], group=group, group_dst=(r + s) % n) for s in range(1, n)
        ]
        self.requests += [
            dist.irecv(self.received[s - 1], group=group, group_src=(r - s) % n)
            for s in range(1, n)
        ]

    def wait(self):
        """(Once: a point-to-point request waited for a second time never returns.)"""
        if self.requests:
            for request in self.requests:
                request.wait()
            self.out.add_(self.mine)
            for piece in self.received[1:]:
                self.out.add_(piece)
            self.requests = self.received = None


class ShardedBucket(Bucket):
    """A bucket whose flat buffer is padded to a multiple of the group's size and cut into equal
    slices, slice r owned by group rank r; `shard` receives this rank's slice of the sum, `values`
    (made by params_flat) is the parameters' flat buffer."""

    def __init__(self, params, group):
        self.world, self.rank = group_size(group), group_rank(group)
        # elements one rank owns
        self.shard_size = (sum(p.numel() for p in params) + self.world - 1) // self.world
        self.shard = self.values = None
        self.gathering = None  # after_step's all-gather, in flight
        self.waited_by_hook = False  # zero.overlap_param_gather: a forward pre-hook waits for it
        super().__init__(params, group)

    def zeros(self):
        p = self.params[0]
        return torch.zeros(self.shard_size * self.world, dtype=p.dtype, device=p.device)

    def owned(self):
        """The range of `flat` this rank owns."""
        return self.rank * self.shard_size, (self.rank + 1) * self.shard_size


def post_reduce_scatter(bucket):
    """Post the sum over the group of bucket.flat, of which this rank keeps its slice
    (summed_slice): a reduce-scatter into a new bucket.shard. One rank sends nothing."""
    if bucket.world == 1:
        return
    bucket.shard = bucket.flat.new_empty(bucket.shard_size)
    bucket.work = reduce_scatter(bucket.shard, bucket.flat, bucket.group)


def summed_slice(bucket):
    """This rank's slice of the sum post_reduce_scatter posted, once it has landed: bucket.shard, or
    with one rank its range of flat."""
    if bucket.work is not None:
        bucket.work.wait()  # sync point: the sum is needed now
        bucket.work = None
    if bucket.shard is not None:
        return bucket.shard
    lo, hi = bucket.owned()
    return bucket.flat[lo:hi]


def owned_slices(buckets):
    """(param, start, end, bucket, a, b): the elements start:end of each parameter (flattened) this
    rank owns, a:b of its bucket's owned range; at most one range each, a parameter being
    contiguous in its bucket."""
    pieces = []
    for bucket in buckets:
        lo, hi = bucket.owned()
        for p, start in zip(bucket.params, bucket.offsets):
            a, b = max(lo, start), min(hi, start + p.numel())
            if a < b:
                pieces.append((p, a - start, b - start, bucket, a - lo, b - lo))
    return pieces


def params_flat(bucket):
    """The bucket's parameters as one flat buffer, padded as its gradient is, each p.data a view of
    it: the all-gather after the step then lands in the parameters themselves, with no copy in or
    out. Made at the first step's end (between steps no autograd graph holds the old storage)."""
    if bucket.values is None:
        bucket.values = bucket.zeros()
        for p, start in zip(bucket.params, bucket.offsets):
            bucket.values[start : start + p.numel()].copy_(p.detach().reshape(-1))
            p.data = bucket.values[start : start + p.numel()].view_as(p)
    return bucket.values


def gather_slices(bucket):
    """Post the collective that gives every rank the bucket's updated parameters: the all-gather of
    every rank's owned slice into the parameters, in place (the input is this rank's slice of the
    output: NCCL documents this as its in-place all-gather, Megatron-LM's distributed optimizer
    gathers so, and the ZeRO tests hold gloo to it). A copy of the slice would be a fresh 1/dp of
    the bucket every step, page-faulted in: on a CPU, 4-5 ms of the quick start's dp=2 Muon step."""
    values = params_flat(bucket)
    lo, hi = bucket.owned()
    return _all_gather_single(values, values[lo:hi], group=bucket.group, async_op=True)


def post_gathers(buckets, gather):
    """After the step: post gather(bucket) for every bucket, in the order the next forward meets
    them (the buckets are in backward order), each into bucket.gathering; wait at once for those no
    forward hook waits for (sync point: parameters are read next)."""
    for bucket in reversed(buckets):
        if bucket.world > 1:
            bucket.gathering = gather(bucket)
    wait_for_params([b for b in buckets if not b.waited_by_hook])


def wait_for_params(buckets):
    """Wait for the buckets' gathers in flight (a bucket not ZeRO's has none): their parameters are
    whole."""
    for bucket in buckets:
        if getattr(bucket, "gathering", None) is not None:
            bucket.gathering.wait()
            bucket.gathering = None


def buckets_by_kind(params, bucket_size_mb, kind):
    """GradientBuckets.plan for reducers whose buckets must not mix kinds of parameters (zero.py's
    backward actions, optim.py's matrix owners): one bucket of each kind(p) filling at a time, in
    backward order, each closed once it holds bucket_size_mb or when the next parameter of its kind
    has another dtype; the buckets in the order they close, those left open last."""
    # filling: kind -> (params, bytes)
    capacity, buckets, filling = max(1, int(bucket_size_mb * 2**20)), [], {}
    for p in reversed(params):
        current, size = filling.get(kind(p), ([], 0))
        if current and p.dtype != current[0].dtype:  # one dtype per flat buffer
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= capacity:
            buckets.append(current)
            current, size = [], 0
        filling[kind(p)] = (current, size)
    return buckets + [current for current, _ in filling.values() if current]


class ShardedGradientBuckets(GradientBuckets):
    """GradientBuckets for ZeRO-1: the buckets are reduce-scattered instead of all-reduced, so
    finish() leaves in every p.grad the average gradient on the elements this rank owns and zero
    elsewhere; owned_slices() says which elements those are, and after the optimizer updated them,
    after_step() all-gathers every bucket's slices so that every rank holds the whole updated model
    (into the parameters themselves: from the first step's end they are views of one flat buffer per
    bucket). owned_param(p) and owned_grad(p) are this rank's elements of p and of its gradient
    (views: updating one updates p), and gather(bucket) posts a bucket's collective after the step
    (Muon's whole matrices override it)."""

    def new_bucket(self, params):
        bucket = ShardedBucket(params, self.group)
        bucket.flat = bucket.zeros()
        return bucket

    def launch(self, bucket):
        if bucket.world > 1:
            post_reduce_scatter(bucket)

    def land(self, bucket):
        """The mean on what this rank owns, zero elsewhere (the other ranks' parts)."""
        lo, hi = bucket.owned()
        if bucket.shard is not None:  # (with one rank the sum is flat itself)
            bucket.flat[lo:hi].copy_(summed_slice(bucket))
            bucket.shard = None
        if self.replicas > 1:
            bucket.flat[lo:hi].div_(self.replicas)
        bucket.flat[:lo].zero_()
        bucket.flat[hi:].zero_()
        for p, view in bucket.views():
            p.grad = view

    def owned_slices(self):
        return owned_slices(self.buckets)

    def owned_param(self, p, start, end, bucket, a, b):
        return p.detach().view(-1)[start:end]

    def owned_grad(self, p, start, end, bucket, a, b):
        return p.grad.view(-1)[start:end]

    def gather(self, bucket):
        return gather_slices(bucket)

    def after_step(self):
        """After each rank updated what it owns, give every rank the whole updated model: every
        bucket's all-gather posted at once, waited for before its parameters are read
        (post_gathers)."""
        post_gathers(self.buckets, self.gather)


class ZeroOneAdamW(torch.optim.Optimizer):
    """AdamW with its states partitioned across the data-parallel ranks (ZeRO stage 1): each rank
    keeps the moments of, and updates, only the elements `grad_sync` says it owns (its
    owned_slices()).

    Takes parameter groups like torch.optim.AdamW (per-group lr and weight_decay) and the sharded
    reducer that averages their gradients (ShardedGradientBuckets over the same parameters;
    zero.py's for ZeRO-2 and 3), which it steps with: do not also all-reduce the gradients, or wrap
    the model in DistributedDataParallel, or they are reduced twice. Per step:
        backward (hooks reduce-scatter the buckets) -> grad_sync.finish() -> [clip grads()]
        -> step(found_inf): AdamW on this rank's slice, then grad_sync.after_step(), the
           all-gather of the updated slices
    The update is torch.optim.AdamW's fused kernel on this rank's flat slices (adamw_step). The
    learning rate is read from self.param_groups at every step, so a schedule that writes
    group['lr'] reaches the update.

    step(found_inf) skips the update where found_inf (a 0-dim float tensor on the parameters'
    device) is 1: weights, moments and step counter stay exactly as they were. The choice is made on
    the device, so a step whose gradient is not finite is skipped without the host waiting for the
    device."""

    def __init__(self, params, grad_sync, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.grad_sync = grad_sync
        # the moments of this rank's slice only, made now so that start-up can report their size
        self.slices = {}
        for p, start, end, *where in grad_sync.owned_slices():
            self.slices[p] = (p, start, end, *where)
            self.state[p] = {
                "step": torch.zeros((), device=p.device),
                "flat_range": (start, end),
                "exp_avg": torch.zeros(end - start, dtype=p.dtype, device=p.device),
                "exp_avg_sq": torch.zeros(end - start, dtype=p.dtype, device=p.device),
            }

    def owned_param(self, p):
        """This rank's elements of p, flat: a view, so updating it updates p (ZeRO-3: p's shard)."""
        return self.grad_sync.owned_param(*self.slices[p])

    def grads(self):
        """[(param, gradient)]: every gradient element this rank holds, once: its owned slices."""
        return [(p, self.grad_sync.owned_grad(*self.slices[p])) for p in self.state]

    @torch.no_grad()
    def step(self, found_inf=None):
        # (the last gathers, if no forward waited: they write p too)
        wait_for_params(self.grad_sync.buckets)
        # one fused kernel per group over this rank's slices (views of p)
        for group in self.param_groups:
            mine = [p for p in group["params"] if p in self.slices]
            params = [self.owned_param(p) for p in mine]
            grads = [self.grad_sync.owned_grad(*self.slices[p]) for p in mine]
            adamw_step(params, grads, [self.state[p] for p in mine], group, found_inf)
        self.grad_sync.after_step()


def adamw_step(params, grads, states, group, found_inf=None):
    """AdamW's update of the tensors `params` with `grads`, in place (Loshchilov & Hutter 2019):
    decoupled weight decay p -= lr * wd * p, then p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 -
    beta2^t) + eps), with each state's exp_avg (m) and exp_avg_sq (v) shaped like its tensor and its
    step counter t (a 0-dim float32 tensor on the device), lr, betas, eps and weight_decay from the
    parameter `group`. It is torch's fused kernel, through torch.optim.adamw.adamw, its public
    functional form: one kernel for every tensor, whole parameters or flat slices of them alike.
    found_inf (0-dim, 1: the gradient is not finite) leaves every tensor, moment and step counter as
    it was, decided on the device (the argument torch's GradScaler hands the same kernel)."""
    if not params:
        return
    beta1, beta2 = group["betas"]
    adamw(
        params,
        grads,
        [s["exp_avg"] for s in states],
        [s["exp_avg_sq"] for s in states],
        [],
        [s["step"] for s in states],
        fused=True,
        found_inf=found_inf,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
    )


def optimizer_state_bytes(optimizer):
    """Bytes of every tensor in an optimizer's state on this rank (the moments; the step counters
    too)."""
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if torch.is_tensor(v)
    )


class Reducers:
    """Several reducers of the same kind over disjoint parameters, answering as one: each call goes
    to every part, or to the one holding the parameter, and what they hold reads as one list
    (buckets, owned slices). For the mechanisms that reduce some parameters apart: the experts over
    the ranks holding the same experts (expert_parallel.ExpertSplit), and `late`, a reducer of
    parameters whose gradient is complete only after backward (a weight tied across pipeline stages,
    whose copies the pipeline sums: build.make_grad_sync): its hooks are taken out and grad_ready
    passes it by, so that its finish(), after the others', sends them. The parts' own extensions
    (backward_done, unit_by_unit: zero.py) pass to the parts that have them."""

    def __init__(self, *parts, late=None):
        self.parts = parts + ((late,) if late is not None else ())
        self.group, self.replicas = parts[0].group, parts[0].replicas
        self.where = {p: at for r in self.parts for p, at in r.where.items()}
        # not late's parameters: grad_ready passes them by
        self.part_of = {p: r for r in parts for p in r.where}
        if late is not None:
            for key in list(late.hooks):
                late.hooks.pop(key).remove()

    def of(self, p):
        return self.part_of.get(p) or next(r for r in self.parts if p in r.where)

    @property
    def buckets(self):
        return [b for r in self.parts for b in r.buckets]

    @property
    def launched(self):
        return sum(r.launched for r in self.parts)

    @property
    def hooks(self):
        return {k: h for r in self.parts for k, h in r.hooks.items()}

    def set_grad_sync(self, sync):
        for r in self.parts:
            r.set_grad_sync(sync)

    def grad_ready(self, p):
        if p in self.part_of:
            self.part_of[p].grad_ready(p)

    def backward_done(self, op, chunk):
        for r in self.parts:
            if hasattr(r, "backward_done"):
                r.backward_done(op, chunk)

    def finish(self):
        for r in self.parts:
            r.finish()

    def owned_slices(self):
        return [piece for r in self.parts for piece in r.owned_slices()]

    def owned_param(self, p, *where):
        return self.of(p).owned_param(p, *where)

    def owned_grad(self, p, *where):
        return self.of(p).owned_grad(p, *where)

    def after_step(self):
        for r in self.parts:
            r.after_step()

    def unit_by_unit(self):
        for r in self.parts:
            yield from r.unit_by_unit()


# -----------------------------------------------------------------------------
# 4. Tensor parallelism: the communication operators
# Needs: section 1 (group_size, group_rank).
#
# A column-parallel linear splits its output features across ranks: every rank needs the whole
# input, produces a slice of the output. A row-parallel linear splits its input features: every rank
# holds a slice of the input, produces a partial sum of the whole output. Chaining column -> row
# (attention: QKV -> output projection; MLP: up -> down) needs exactly one all-reduce in the forward
# pass (g, after the row-parallel layer) and one in the backward pass (f, before the column-parallel
# layer). When several column-parallel layers read one input (q, k, v), f is applied once to that
# input (copy_input=False below).


class CopyToTensorParallelRegion(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward. Each rank used the same input for its
    own slice of the work, so the input's gradient is the sum of every rank's contribution."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # all-reduce a copy: it works in place and autograd may pass this gradient to other branches
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward. Each rank computed a partial sum of the
    output; the sum is the output, and its gradient flows unchanged to every partial."""

    @staticmethod
    def forward(ctx, x, group):
        # all_reduce works in place: leave the caller's x
        x = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _all_gather_along(x, group, dim):
    """Every rank's x, concatenated along dim in rank order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


class GatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather along `dim` (the last by default) forward; backward keeps only this rank's slice
    of the gradient. The backward assumes what follows the gather is the same computation on every
    rank (replicated), so every rank holds the same full gradient and its own slice of it is the
    whole story."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return (
            grad.chunk(group_size(ctx.group), dim=ctx.dim)[group_rank(ctx.group)].contiguous(),
            None,
            None,
        )


class ScatterToTensorParallelRegion(torch.autograd.Function):
    """Split: keep this rank's slice of `dim` (the last by default) forward; all-gather the gradient
    backward. The input is the same on every rank (replicated), so its gradient is every rank's
    slice gradient side by side."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return x.chunk(group_size(group), dim=dim)[group_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_along(grad, ctx.group, ctx.dim), None, None


# With no group (one rank) every operator is the identity, so the same model code runs unsplit.
def copy_to_tp(x, group):
    return CopyToTensorParallelRegion.apply(x, group) if group_size(group) > 1 else x


def reduce_from_tp(x, group):
    return ReduceFromTensorParallelRegion.apply(x, group) if group_size(group) > 1 else x


def gather_from_tp(x, group, dim=-1):
    return GatherFromTensorParallelRegion.apply(x, group, dim) if group_size(group) > 1 else x


def scatter_to_tp(x, group, dim=-1):
    return ScatterToTensorParallelRegion.apply(x, group, dim) if group_size(group) > 1 else x


# -----------------------------------------------------------------------------
# Tensor parallelism: the layers
#
# Each sharded parameter carries `tp_shard_dim` (the dimension it is split along) so that the
# model's initialisation, the checkpoint and the gradient-norm computation know which slice of the
# full tensor a rank holds. A parameter without it is replicated: every tensor-parallel rank holds
# the same copy.
#
# A layer's weights are created empty, as nn.Linear's are before their reset: picotron builds the
# model on the meta device, applies the layout, then gives each rank its shares and initialises them
# (init_shares below; a checkpoint or a transformers model loads them instead), so a 7B model is
# never materialised whole on one rank. Empty means whatever the memory held (a lifted weight once
# read 1.49e16): a layer used alone is filled before it computes (tensor_parallel.load_full, or
# shard_of of the full tensor). With group=None a layer is not split: it computes what nn.Linear /
# nn.Embedding compute.


def mark_sharded(param, dim, group):
    param.tp_shard_dim = dim
    param.tp_world = group_size(group)
    param.tp_rank = group_rank(group)
    return param


def shard_of(full, param):
    """The slice of a full tensor that `param` holds on this rank (the full tensor itself if
    replicated)."""
    dim = getattr(param, "tp_shard_dim", None)
    if dim is None:
        return full
    size = param.shape[dim]
    return full.narrow(dim, param.tp_rank * size, size)


def full_shape_of(param):
    shape = list(param.shape)
    dim = getattr(param, "tp_shard_dim", None)
    if dim is not None:
        shape[dim] *= param.tp_world
    return shape


def _divide(n, d, what):
    if n % d != 0:
        raise ValueError(f"{what} = {n} is not divisible by tp = {d}: choose a tp that divides it")
    return n // d


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by rows (output features) across the group: each rank computes
    out_features / tp of the outputs. With gather_output=False the output stays split, ready to feed
    a RowParallelLinear (or a per-head attention, or the vocab-parallel loss) with no communication.

    The input passes through f (copy_to_tp), whose backward sums the input's gradient across ranks.
    When several column-parallel layers read the same input (q, k and v; SwiGLU's gate and up),
    apply copy_to_tp once to that input and build the layers with copy_input=False: one all-reduce
    instead of one per layer (tensor_parallel.enter_region).

    The weight is created empty (see the section's note). group=None: not split (nn.Linear).

    Hook: `matmul(x, weight, bias)`, F.linear; the zero-bubble pipeline schedules replace it to
    split this layer's backward, the input's gradient now and the weight's later
    (pipeline_schedules.WeightGradStore)."""

    def __init__(
        self,
        in_features,
        out_features,
        bias=False,
        group=None,
        gather_output=False,
        copy_input=True,
    ):
        super().__init__()
        self.group, self.gather_output, self.copy_input = group, gather_output, copy_input
        rows = self.out_per_rank = _divide(out_features, group_size(group), "out_features")
        self.weight = mark_sharded(nn.Parameter(torch.empty(rows, in_features)), 0, group)
        self.bias = mark_sharded(nn.Parameter(torch.zeros(rows)), 0, group) if bias else None
        self.matmul = F.linear

    def forward(self, x):
        if self.copy_input:
            x = copy_to_tp(x, self.group)
        y = self.matmul(x, self.weight, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by columns (input features): each rank multiplies its slice of the
    input by its slice of W, and the partial outputs are summed (g). With input_is_parallel=False
    the full input is first cut into slices here. The bias is replicated and added once, after the
    sum (added before, it would be counted tp times). group=None: not split (nn.Linear).

    The weight is created empty, as in ColumnParallelLinear. Hooks: `matmul` as there (the bias,
    added after the sum, is not in it: it keeps its gradient in autograd), and combine(partial), the
    sum and the bias (sequence parallelism's SequenceParallelRowLinear reduce-scatters instead)."""

    def __init__(self, in_features, out_features, bias=False, group=None, input_is_parallel=True):
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        columns = self.in_per_rank = _divide(in_features, group_size(group), "in_features")
        self.weight = mark_sharded(nn.Parameter(torch.empty(out_features, columns)), 1, group)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.matmul = F.linear

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        return self.combine(self.matmul(x, self.weight, None))

    def combine(self, partial):
        y = reduce_from_tp(partial, self.group)
        return y + self.bias if self.bias is not None else y


def split_vocab_size(vocab_size, tp):
    """The vocabulary's rows under tensor parallelism: rounded up to split evenly across tp ranks,
    each share a multiple of 64, which keeps the embedding's and head's matmuls on fast kernel sizes
    (the model's own padding, model.padded_vocab_size, is this at tp = 1). The extra rows are never
    a target (vocab_parallel_cross_entropy takes only the valid columns) and never looked up: they
    stay zero."""
    multiple = 64 * tp
    return (vocab_size + multiple - 1) // multiple * multiple


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by rows (token ids) across the group. Each rank looks up the ids in its
    range, writes zeros for the others, and the all-reduce (g) assembles every token's vector. The
    table is padded to split_vocab_size rows (zero, never looked up). group=None: not split
    (nn.Embedding). Hook: combine(out), the all-reduce of the ranks' partial lookups (sequence
    parallelism's SequenceParallelEmbedding reduce-scatters instead)."""

    def __init__(self, vocab_size, dim, group=None):
        super().__init__()
        self.group, self.vocab_size = group, vocab_size
        self.rows_per_rank = split_vocab_size(vocab_size, group_size(group)) // group_size(group)
        self.vocab_start = group_rank(group) * self.rows_per_rank
        self.weight = mark_sharded(nn.Parameter(torch.empty(self.rows_per_rank, dim)), 0, group)
        # rows past it are padding: zero at init, never looked up
        self.weight.vocab_size = vocab_size

    def forward(self, idx):
        if group_size(self.group) == 1:
            return F.embedding(idx, self.weight)
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.combine(out.masked_fill(outside.unsqueeze(-1), 0.0))

    def combine(self, out):
        return reduce_from_tp(out, self.group)


def valid_vocab_columns(vocab_size, rows_per_rank, group):
    """How many of this rank's vocab columns are real tokens (the last may hold only padding)."""
    start = group_rank(group) * rows_per_rank
    return max(0, min(rows_per_rank, vocab_size - start))


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary across the group, without ever gathering them:
    the full-vocab logits of a 50k vocabulary are the largest tensor in a small model.

        loss = log(sum_v exp(z_v - m)) - (z_target - m),    m = max_v z_v  (for a stable exp)
    The max, the sum of exps and the target's logit are each all-reduced across ranks (three
    reductions of one number per token); every rank then holds the loss of every token, and the
    gradient of its own slice, softmax - onehot(target), needs no communication. A rank whose slice
    is empty (it holds only vocabulary padding, possible with a small vocabulary) contributes -inf
    to the max and 0 to the sums."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, ignore_index):
        logits = logits.to(at_least_fp32(logits.dtype))
        n, n_local = logits.shape
        # the target's logit lives on exactly one rank: the others contribute zero to the sum
        local_target = targets - vocab_start
        here = (local_target >= 0) & (local_target < n_local)
        local_target = local_target.masked_fill(~here, 0)
        if n_local > 0:
            max_logit = logits.max(dim=-1).values
            target_logit = (
                logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)
            )
        else:  # this rank holds only vocabulary padding
            max_logit = torch.full((n,), float("-inf"), dtype=logits.dtype, device=logits.device)
            target_logit = torch.zeros(n, dtype=logits.dtype, device=logits.device)
        dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=group)
        # lands while exp runs
        target_summed = dist.all_reduce(target_logit, group=group, async_op=True)
        # the one (N, V_local) temporary; becomes the softmax
        exp = (logits - max_logit.unsqueeze(-1)).exp_()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        target_summed.wait()
        loss = sum_exp.log() - (target_logit - max_logit)
        valid = targets != ignore_index
        loss = loss.masked_fill(~valid, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, here & valid, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, target_here, valid = ctx.saved_tensors
        grad = softmax  # d loss / d z = softmax - onehot(target); softmax is not needed after this
        if grad.shape[-1] > 0:  # scatter, not boolean indexing: no host-device sync on a GPU
            grad.scatter_add_(
                -1, local_target.unsqueeze(-1), -target_here.to(grad.dtype).unsqueeze(-1)
            )
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits, targets, vocab_start=0, group=None, ignore_index=-1):
    """Mean cross-entropy of (N, V_local) logits, this rank's vocabulary from global id vocab_start,
    against (N,) global target ids, ignored targets left out (all ignored: 0, where F.cross_entropy
    gives nan). With one rank it is F.cross_entropy."""
    if group_size(group) == 1:
        return F.cross_entropy(
            logits.to(at_least_fp32(logits.dtype)), targets, ignore_index=ignore_index
        )
    losses = VocabParallelCrossEntropy.apply(logits, targets, vocab_start, group, ignore_index)
    return losses.sum() / (targets != ignore_index).sum().clamp(min=1)


# -----------------------------------------------------------------------------
# 5. Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
# Transformer Models", section 4.2.2), an option of tensor parallelism.
# Needs: sections 1 (group_size), 3 (reduce_scatter) and 4 (RowParallelLinear,
# VocabParallelEmbedding, copy_to_tp, _all_gather_along).
#
# Between the tensor-parallel regions (the norms and the residual adds: everything outside attention
# and the MLP) every tp rank computes the same thing on the same tokens and holds the same (B, T, C)
# activations. Sequence parallelism splits them along the sequence instead: tp rank t holds tokens
# t*T/tp .. (t+1)*T/tp - 1 there, 1/tp of those activations, and works on them alone. Entering a
# region the tokens are all-gathered, and the backward reduce-scatters their gradient: each rank's
# column- parallel layers made a partial gradient for every token, and each rank needs the sum for
# its own tokens only (this replaces f). Leaving a region, the row-parallel layer's partial sums are
# reduce-scattered: each rank receives the whole sum for its own tokens, and the backward
# all-gathers the gradient (this replaces g). An all-reduce is a reduce-scatter followed by an
# all-gather, so the bytes on the wire are those of tensor parallelism without it; what falls is the
# memory between the regions, by tp.
#
# The cost is in the parameters every tp rank holds whole: the norm gains and the row-parallel
# biases now see only this rank's tokens, and the replicated weights inside a region (MLA's
# down-projections and latent norms) get only this rank's partial gradient, since no f sums it any
# more. A row-parallel bias passes through f itself (copy_to_tp on the parameter), whose backward
# sums its parts across the group; the others are summed once a step
# (tensor_parallel.sum_partial_grads: Megatron's all-reduce of the sequence-parallel gradients).
# Tensors are (B, T, ...): the sequence is dimension 1, T split in tp pieces.


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Entering a tensor-parallel region: all-gather the tokens along the sequence forward;
    reduce-scatter the gradient backward (the sum over ranks of every rank's partial gradient, this
    rank's tokens only)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_along(x, group, 1)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_along(grad, ctx.group, 1), None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Leaving a tensor-parallel region: reduce-scatter the partial sums along the sequence forward
    (this rank's tokens of the sum); all-gather the gradient backward (the region needs every
    token's)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_along(x, group, 1)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_along(grad, ctx.group, 1), None


def _reduce_scatter_along(x, group, dim):
    """This rank's chunk, along dim, of the sum over the group of every rank's x."""
    moved = x.movedim(dim, 0).contiguous()  # a reduce-scatter cuts along dimension 0
    out = moved.new_empty((moved.shape[0] // group_size(group), *moved.shape[1:]))
    # section 3's reduce_scatter: gloo's own takes twice as long
    reduce_scatter(out.view(-1), moved, group).wait()
    return out.movedim(0, dim)


def gather_from_sp(x, group):
    return GatherFromSequenceParallelRegion.apply(x, group) if group_size(group) > 1 else x


def reduce_scatter_to_sp(x, group):
    return ReduceScatterToSequenceParallelRegion.apply(x, group) if group_size(group) > 1 else x


class SequenceParallelRowLinear(RowParallelLinear):
    """RowParallelLinear leaving a tensor-parallel region into a sequence-parallel one: the partial
    outputs are reduce-scattered along the sequence instead of all-reduced (each rank gets the sum
    for its own tokens, (B, T/tp, out_features)), and the bias, added to this rank's tokens only,
    passes through f so that its gradient is summed over the ranks' tokens."""

    def combine(self, partial):
        y = reduce_scatter_to_sp(partial, self.group)
        return y + copy_to_tp(self.bias, self.group) if self.bias is not None else y


class SequenceParallelEmbedding(VocabParallelEmbedding):
    """VocabParallelEmbedding feeding a sequence-parallel region: the vectors are reduce-scattered
    along the sequence instead of all-reduced, so each rank gets its own tokens', (B, T/tp, dim)."""

    def combine(self, out):
        return reduce_scatter_to_sp(out, self.group)


# -----------------------------------------------------------------------------
# 6. Pipeline parallelism
# Needs: section 1 (grid_rank).
#
# Each stage holds a contiguous run of blocks (the first also the embedding, the last the final
# norm, the head and the loss), as many as make the stages cost alike (pipeline_schedules.cost_cut:
# at a real vocabulary the head is worth several blocks, and the slowest stage sets everyone's
# pace). A step's batch is cut into m microbatches, the gradient-accumulation steps, which go
# through the stages like work down an assembly line: a stage receives a microbatch's activations
# from the previous stage, runs its blocks, sends the result on; in the backward pass the gradient
# of those activations comes back from the next stage and the gradient of the stage's input goes to
# the previous. While the line fills and drains some stages wait: with every forward and backward
# taking the same time, the idle share of a step, the "bubble", is (pp - 1) / (m + pp - 1) (GPipe,
# section 2.2).
#
# A schedule is written once, as each pipeline rank's ordered list of actions (op, i, c): run op for
# microbatch i on the rank's model chunk c (one chunk here: c is 0). PipelineExecutor (run_schedule)
# walks that list on a real rank; tools/timeline.py places the very same lists in time slots for the
# printed picture. A rank keeps a microbatch's activations from its forward to its backward, so the
# order also decides the memory:
#   afab              all forward, all backward (GPipe): all m microbatches held at the turn
#   1f1b              one forward, one backward (PipeDream-Flush): the same bubble, pp - stage held
# pipeline_schedules.py adds interleaved 1F1B (several model chunks per rank) and the zero-bubble
# schedules ZB-H1 and ZB-V (the backward split into B and W), as more lists of the same kind for the
# same executor, which it extends, with the step's Pipeline, through the hooks the module docstring
# lists; it also holds every schedule's table (SCHEDULES), the rules that refuse a schedule that
# cannot run (check_schedule) and the bubbles (ideal_bubble). A training step of afab or 1f1b runs
# this section's code alone: Pipeline.forward_backward, PipelineExecutor, sync_tied_grads.
#
# The executor's exchanges. A rank sends what an action produced (a forward's output to the next
# stage, a backward's input gradient to the previous) as soon as the action ends, without waiting
# for the send to complete, and posts the receive of its next action's input before it runs the
# current one: a rank only ever waits for an input it needs now. Messages between two ranks travel
# in two first-in first-out channels, one per kind (activations on the default group, gradients on a
# second group, so NCCL, which has no tags, keeps them apart too); both ranks walk their lists in
# order, so what one sends k-th on a channel is what the other receives k-th: the lists themselves
# must agree on that order, which tools/timeline.py's simulator checks, together with "no rank waits
# forever", without processes. A message between two chunks of one rank is handed over in memory
# (pipeline_schedules.py). All sends are waited for at the end of the step.
#
# NCCL's rule: the first batch_isend_irecv that uses a process group must be joined by every rank of
# that group. PipelineComm's constructor therefore runs a barrier on each of its two groups, which
# every rank reaches while it builds its pipeline, so no point-to-point exchange is ever a group's
# first collective. Gloo has no such rule; the barriers cost nothing that matters.


def stage_layers(stage_blocks, stage):
    """The block indices of model stage `stage` in a cut of stage_blocks, the number of blocks of
    each stage (pipeline_schedules.cost_cut's, or the user's pp_layers)."""
    start = sum(stage_blocks[:stage])
    return range(start, start + stage_blocks[stage])


def apply_pipeline(model, stage_blocks, stages):
    """Keep, of a model.Transformer, what this rank's model stages run: their blocks (stage s holds
    stage_blocks[s] of them), the embedding if it runs stage 0, the final norm and the head if it
    runs the last. stages: the stages this rank runs, one per model chunk
    (pipeline_schedules.virtual_stages; (rank,) for AFAB and 1F1B); the model's forward(...,
    chunk=c) then runs stages[c] (model.Transformer.chunk_layers). Under tied embeddings a head
    without the embedding gets a weight of its own, a copy the training step keeps equal to the
    embedding (sync_tied_grads). Returns the model."""
    if len(stage_blocks) == 1:
        return model
    if sum(stage_blocks) != model.cfg.n_layer or min(stage_blocks) < 1:
        raise ValueError(
            f"apply_pipeline: stage_blocks must give every stage at least one block and sum to "
            f"n_layer = {model.cfg.n_layer}, not {stage_blocks} (build.stage_cut cuts them by cost)"
        )
    model.chunk_layers = [list(stage_layers(stage_blocks, s)) for s in stages]
    held = {str(i) for layers in model.chunk_layers for i in layers}
    for name in [name for name in model.blocks if name not in held]:
        del model.blocks[name]
    first, last = 0 in stages, len(stage_blocks) - 1 in stages
    if not last:
        model.norm = model.lm_head = None
    elif not first and model.cfg.tie_embeddings:
        # the head's copy of the tied weight: a parameter of its own, same shape and marks
        copy = nn.Parameter(torch.empty_like(model.lm_head.weight))
        copy.__dict__.update(model.lm_head.weight.__dict__)
        model.lm_head.weight = copy
    if not first:
        model.tok_emb = None
    return model


def message_route(op, stage, n_stages):
    """(the stage that action `op` on model stage `stage` receives its input from, the stage it
    sends its product to): a forward reads stage - 1's output and feeds stage + 1, a backward reads
    stage + 1's input gradient and feeds stage - 1. None past either end of the model (and for any
    other action). The executor and the timeline simulator (tools/timeline.py) both route by this,
    so what is drawn is what runs."""
    src, dst = {"F": (stage - 1, stage + 1), "B": (stage + 1, stage - 1)}.get(op, (-1, -1))
    return (src if 0 <= src < n_stages else None), (dst if 0 <= dst < n_stages else None)


def afab_actions(pp, stage, m, chunks=1):
    """GPipe, all forward then all backward: simple, but at the turn every stage holds the
    activations of all m microbatches."""
    return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]


def one_f_one_b_actions(pp, stage, m, chunks=1):
    """1F1B (PipeDream-Flush): a stage runs a microbatch's backward as soon as its gradient can have
    come back, so it never holds more than pp - stage microbatches' activations, whatever m is."""
    # warm-up: forwards only. Microbatch 0 must still go through the pp - stage - 1 later stages and
    # come back before its backward can run here: fill that wait with as many forwards (Megatron's
    # num_warmup_microbatches), or all m when there are fewer
    warmup = min(pp - stage - 1, m)
    actions = [("F", i, 0) for i in range(warmup)]
    # steady state: each new forward is followed by the oldest waiting backward
    for i in range(m - warmup):
        actions += [("F", warmup + i, 0), ("B", i, 0)]
    # cool-down: the backwards of the microbatches still in flight
    actions += [("B", i, 0) for i in range(m - warmup, m)]
    return actions


class PipelineComm:
    """What a pipeline rank needs to talk to the others: its index `stage` among the pp ranks, the
    global rank that holds each model stage (`stage_ranks`, pp * v of them), the model stage of each
    of its chunks (`chunk_stages`), and what travels between them: every message is a tensor of
    `dtype` and of the shape message_shape(x), x being the microbatch's token ids, which every stage
    has: so no shape or dtype is ever negotiated at run time. The caller chooses both; the model's
    is (batch, seq_len, hidden_size), which from_layout gives (seq_len that of x: under context
    parallelism this rank's T/cp tokens; under sequence parallelism a rank holds 1/tp of those
    between the tensor-parallel regions: seq_split = tp).

    The model's dtype is that of the residual stream, the parameters' dtype (fp32 under autocast
    too: the embedding output is fp32, and adding a bf16 sublayer output to it stays fp32). Sending
    bf16 instead would round the residual stream at every stage boundary, which one process never
    does.

    Activations travel on the default group, gradients on a second group of the whole world (the
    section's note). Every rank of the world must build its PipelineComm, in the same order: it
    builds that group and runs the barriers of NCCL's rule."""

    def __init__(
        self,
        stage,
        pp,
        stage_ranks,
        message_shape,
        dtype=torch.float32,
        device="cpu",
        chunk_stages=None,
        timeout=None,
    ):
        self.stage, self.pp, self.stage_ranks = stage, pp, list(stage_ranks)
        self.chunk_stages = tuple(chunk_stages) if chunk_stages is not None else (stage,)
        self.n_stages = len(self.stage_ranks)
        self.message_shape, self.dtype, self.device = message_shape, dtype, torch.device(device)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.groups = {"F": None, "B": None}  # None: the default group
        if dist.is_initialized():
            dist.barrier()  # the first collective of the world group: not a batch_isend_irecv
            self.groups["B"] = dist.new_group(
                list(range(dist.get_world_size())), timeout=timeout, group_desc="pipeline gradients"
            )
            dist.barrier(group=self.groups["B"])

    @classmethod
    def from_layout(
        cls,
        layout,
        hidden_size,
        device,
        dtype=torch.float32,
        stages_of=lambda rank: (rank,),
        seq_split=1,
    ):
        """The channel of this rank's pipeline (its dp, cp and tp rank). stages_of(pp_rank): the
        model stages that pipeline rank holds, one per chunk (one each here;
        pipeline_schedules.virtual_stages places several)."""
        stage_ranks = {}
        for p in range(layout.pp):
            for s in stages_of(p):
                stage_ranks[s] = grid_rank(
                    p,
                    layout.dp_rank,
                    layout.tp_rank,
                    layout.dp,
                    layout.tp,
                    layout.cp_rank,
                    layout.cp,
                )
        return cls(
            layout.pp_rank,
            layout.pp,
            [stage_ranks[s] for s in range(len(stage_ranks))],
            lambda x: (x.shape[0], x.shape[1] // seq_split, hidden_size),
            dtype,
            device,
            stages_of(layout.pp_rank),
            layout.timeout,
        )

    def is_here(self, stage):
        return self.stage_ranks[stage] == self.rank

    def send(self, tensor, kind, to_stage):
        """Post the send of a message of `kind` ('F': activations, 'B': gradients) to model stage
        to_stage; returns its request (wait for it before the step ends)."""
        op = dist.P2POp(
            dist.isend,
            tensor.to(self.dtype).contiguous(),
            self.stage_ranks[to_stage],
            self.groups[kind],
        )
        return dist.batch_isend_irecv([op])[0]

    def receive(self, kind, from_stage, x):
        """Post the receive of a message of `kind` from model stage from_stage, for the microbatch
        of token ids x; returns (the tensor it fills, its request)."""
        buffer = torch.empty(self.message_shape(x), dtype=self.dtype, device=self.device)
        op = dist.P2POp(dist.irecv, buffer, self.stage_ranks[from_stage], self.groups[kind])
        return buffer, dist.batch_isend_irecv([op])[0]


class PipelineExecutor:
    """One step of one pipeline rank: walks its list of actions over microbatches [(x, y), ...]
    (token ids and targets; every rank has them, the first stage uses x, the last y, all take the
    message shapes from x). Gradients accumulate in the rank's parameters; run(actions) returns this
    rank's part of the mean loss over the microbatches (a tensor, zero on a rank without the model's
    last stage): summed over the ranks it is the loss one process reports.

    `model` is the rank's stage, or a list of its chunks (comm.chunk_stages says which model stage
    each is): model(x, targets, ...) returns (output, loss), on the model's last stage the logits
    and the loss, elsewhere the hidden states and None. `grad_sync`, the data-parallel reducer
    (GradientBuckets), is told set_grad_sync(last) before each backward, True only before the
    chunk's last backward of the step (it communicates once per step). Without grad enabled
    (evaluation) give forwards only: nothing is kept for a backward. What else a step may need, each
    in one method:
      backpropagate   a stage before the last may return a loss of its own, not None (a mixture of
                      experts' balance loss): backpropagated with the output's gradient, counted in
                      the loss
      backward_done   after each backward the reducer is told backward_done(op, chunk) if it has it
                      (ZeRO-2/3, zero.py, send each microbatch's gradients then)
      wait            a sender that died or hung is named, its stage and rank (faults.peer_failure
                      knows the text)
      trace(action)   if given, a context manager around each action (tools/timeline.py:
                      PipelineTrace, ActivationMemory)"""

    def __init__(
        self,
        model,
        microbatches,
        comm,
        autocast=nullcontext(),
        loss_multiplier=1.0,
        grad_sync=None,
        trace=None,
    ):
        self.chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self.microbatches, self.comm, self.autocast = microbatches, comm, autocast
        self.loss_multiplier, self.grad_sync, self.trace = loss_multiplier, grad_sync, trace
        # (microbatch, chunk) -> (input, output, loss): what its backward needs, from its forward
        self.held = {}
        self.total = torch.zeros((), dtype=at_least_fp32(comm.dtype), device=comm.device)

    def forward(self, i, c, received):
        """Microbatch i through chunk c, from the previous stage's output (received) or, on the
        first stage, the token ids; returns what the next stage receives (None on the last)."""
        # (x, y, positions[, documents]) under context parallelism
        x, y, *context = self.microbatches[i]
        stage, last_stage = self.comm.chunk_stages[c], self.comm.n_stages - 1
        if stage > 0:
            x = received.requires_grad_(torch.is_grad_enabled())  # its .grad is what goes back
        with self.autocast:
            out, loss = self.chunks[c](x, y if stage == last_stage else None, *context)
        if loss is not None:
            # the mean over microbatches: the one place the loss is scaled
            loss = loss / len(self.microbatches)
            self.total += loss.detach().to(at_least_fp32(loss.dtype))
        if torch.is_grad_enabled():
            self.held[(i, c)] = x, (None if stage == last_stage else out), loss
        return None if stage == last_stage else out.detach()

    def backward(self, i, c, received, last):
        """Microbatch i back through chunk c, from its loss or from its output's gradient (received
        from the next stage); returns the gradient of its input, which the previous stage receives
        (None on the first). last: whether this is the chunk's last backward of the step."""
        x, out, loss = self.held.pop((i, c))
        if self.grad_sync is not None:
            self.grad_sync.set_grad_sync(last)
        self.backpropagate(out, loss, received)
        self.backward_done("B", c)
        return None if self.comm.chunk_stages[c] == 0 else x.grad

    def backpropagate(self, out, loss, grad):
        """The backward of one forward: from the loss on the model's last stage (out None),
        elsewhere from the output's gradient, grad, and from the stage's own loss if it returned
        one."""
        if out is None:
            (loss * self.loss_multiplier).backward()
        elif loss is None:
            out.backward(grad.to(out.dtype))
        else:  # both roots in one backward, as one process's backward of the sum reaches them
            torch.autograd.backward([out, loss * self.loss_multiplier], [grad.to(out.dtype), None])

    def backward_done(self, op, c):
        """A backward action (op, chunk c) has run: tell the reducer, if it sends per action."""
        if hasattr(self.grad_sync, "backward_done"):
            self.grad_sync.backward_done(op, c)

    def act(self, action, received, last):
        """Run one action (op, i, c) on its input, received (None where it has none: the first
        stage's forward, the last's backward); returns its product for the neighbouring stage, or
        None."""
        op, i, c = action
        if op not in ("F", "B"):
            raise ValueError(
                f"{action}: PipelineExecutor runs 'F' and 'B' only ('W': ScheduleExecutor)"
            )
        return self.forward(i, c, received) if op == "F" else self.backward(i, c, received, last)

    def post_receive(self, action):
        """Post the receive of action's input if another rank sends it: (buffer, request, from
        stage), or None."""
        op, i, c = action
        source, _ = message_route(op, self.comm.chunk_stages[c], self.comm.n_stages)
        # no other rank sends it (is_here: a chunk of this rank, pipeline_schedules.py)
        if source is None or self.comm.is_here(source):
            return None
        return *self.comm.receive(op, source, self.microbatches[i][0]), source

    def wait(self, request, action, source):
        """Wait for action's input, posted as `request`, from model stage `source`."""
        try:
            request.wait()  # sync point: the input must have arrived
        except RuntimeError as e:  # the sender died or hung: say which
            op, i, c = action
            here = f"pipeline stage {self.comm.chunk_stages[c]} (rank {self.comm.rank})"
            raise RuntimeError(
                f"{here} waited for the input of {op}{i} from stage {source} "
                f"(rank {self.comm.stage_ranks[source]}): {e}"
            ) from e

    def run(self, actions):
        """Walk the list: wait for each action's input, post the next one's receive, run the action,
        send its product on without waiting (the section's note); wait for every send at the end.
        Returns the loss."""
        comm, sends = self.comm, []  # sends: the requests in flight (each holds its tensor)
        # each op's last action on each chunk
        last = {(op, c): k for k, (op, _, c) in enumerate(actions)}
        posted = self.post_receive(actions[0]) if actions else None
        for k, (op, i, c) in enumerate(actions):
            received = None
            if posted is not None:
                received, request, source = posted
                self.wait(request, (op, i, c), source)
            # lands while this runs
            posted = self.post_receive(actions[k + 1]) if k + 1 < len(actions) else None
            with self.trace((op, i, c)) if self.trace is not None else nullcontext():
                product = self.act((op, i, c), received, k == last[(op, c)])
            # a forward's output to the next stage, a backward's input gradient back
            if product is not None:
                _, destination = message_route(op, comm.chunk_stages[c], comm.n_stages)
                # their buffers can go
                sends[:] = [request for request in sends if not request.is_completed()]
                sends.append(comm.send(product, op, destination))
        for request in sends:
            request.wait()
        return self.total


def run_schedule(
    actions, model, microbatches, comm, autocast=nullcontext(), loss_multiplier=1.0, grad_sync=None
):
    """Run one pipeline rank's list of actions (PipelineExecutor's arguments); returns this rank's
    part of the mean loss."""
    return PipelineExecutor(model, microbatches, comm, autocast, loss_multiplier, grad_sync).run(
        actions
    )


def tied_weight_group(layout, holder_stages):
    """The process group of the pipeline stages `holder_stages` (say the first and the last) of this
    rank's pipeline (same dp, cp and tp rank), or None when one stage holds every copy. Every rank
    must call this, in the same order: every group is built by every rank."""
    stages = sorted(set(holder_stages))
    group = None
    if len(stages) < 2:
        return None
    for d, c, t in itertools.product(range(layout.dp), range(layout.cp), range(layout.tp)):
        ranks = [grid_rank(s, d, t, layout.dp, layout.tp, c, layout.cp) for s in stages]
        g = dist.new_group(ranks, timeout=layout.timeout, group_desc="tied weight")
        if layout.rank in ranks:
            group = g
    return group


def sync_tied_grads(copies, group):
    """Make the copies of one tied weight take the same step, the step of the single shared matrix
    in one process: its gradient is the sum of every copy's (one from the input side, the embedding;
    one from the output side, the head). `copies` are the copies this rank holds (none, one, or
    several when one rank holds two model chunks that each have one), `group` the ranks holding the
    others (None: all are here). Call it after the step's last backward (and W), before the
    gradients are averaged across data-parallel ranks."""
    if not copies:
        return
    # a new tensor (sum starts from 0): the copies' own gradients are replaced, not reduced in place
    total = sum(w.grad if w.grad is not None else torch.zeros_like(w) for w in copies)
    if group is not None:
        dist.all_reduce(total, group=group)
    for i, w in enumerate(copies):
        w.grad = total if i == 0 else total.clone()


@dataclass
class Pipeline:
    """What a pipelined step needs beside the model (build.make_pipeline makes it): the channel to
    the other ranks (comm), the schedule, afab or 1f1b, and the copies of the tied embedding this
    rank holds with the group of the ranks holding the others (None: one stage holds them all),
    whose gradients the pipeline sums after backward (sums_tied; a reducer that sums their shards
    itself, ZeRO-2/3, turns it off). forward_backward is a training step's pipeline part, forward
    an evaluation's."""

    comm: PipelineComm
    schedule: str
    tied_copies: list = field(default_factory=list)
    tied_group: object = None
    sums_tied: bool = True

    def groups(self):
        """The process groups the pipeline sends on beyond the world's: its gradients' and the tied
        copies'."""
        return [g for g in (self.comm.groups["B"], self.tied_group) if g is not None]

    def actions(self, m):
        """This rank's list for a step of m microbatches."""
        schedule = {"afab": afab_actions, "1f1b": one_f_one_b_actions}[self.schedule]
        return schedule(self.comm.pp, self.comm.stage, m)

    def evaluation_actions(self, m):
        """Evaluation's list: the forwards alone, in order (nothing comes back to wait for)."""
        return [("F", i, 0) for i in range(m)]

    def executor(
        self, model, microbatches, autocast, loss_multiplier=1.0, grad_sync=None, trace=None
    ):
        return PipelineExecutor(
            model, microbatches, self.comm, autocast, loss_multiplier, grad_sync, trace
        )

    def forward_backward(
        self, model, microbatches, autocast, loss_multiplier, grad_sync, trace=None
    ):
        """The schedule's actions over the microbatches, then the tied copies' gradients summed.
        Returns this rank's part of the mean loss."""
        executor = self.executor(model, microbatches, autocast, loss_multiplier, grad_sync, trace)
        loss = executor.run(self.actions(len(microbatches)))
        if self.sums_tied:
            sync_tied_grads(self.tied_copies, self.tied_group)
        return loss

    @torch.no_grad()
    def forward(self, model, microbatches, autocast):
        """Forward only (evaluation): this rank's part of the mean loss over the microbatches."""
        executor = self.executor(model, microbatches, autocast)
        return executor.run(self.evaluation_actions(len(microbatches)))


# -----------------------------------------------------------------------------
