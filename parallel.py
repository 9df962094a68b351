"""
Every parallel mechanism of picotron, in plain torch.distributed: one self-contained section each, in the
order a reader learns them.

  1. The layout: how the world of ranks is cut into data-, context-, tensor- and pipeline-parallel groups
     (and the data-parallel ranks into expert-parallel groups), the printed rank grid, and which
     tensor-parallel groups would span two nodes.
  2. Tensor parallelism (Megatron-LM): the four communication operators as autograd functions, the layers
     built from them (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding) and the
     vocab-parallel cross-entropy; with sequence parallelism, the two operators that split the tokens
     between the tensor-parallel regions.
  3. Context parallelism: the zigzag split of every sequence across ranks and ring attention (the keys
     and values travel round the ranks; a custom autograd function, forward and backward).
  4. Pipeline parallelism: each schedule (AFAB, 1F1B, interleaved 1F1B, zero bubble ZB-H1, ZB-V) written
     once as every rank's ordered list of forward, backward and weight-gradient actions on its model
     chunks, the backward split into its input and weight halves (WeightGradStore), one executor that walks
     the list on a real rank, and the tied-weight sync.
  5. Data parallelism and ZeRO: gradients averaged in buckets from backward hooks (GradientBuckets), an
     AdamW whose states are split across data-parallel ranks (ZeroOneAdamW, ZeRO-1), the gradients kept
     as shards too (ZeRO-2), and the parameters, gathered block by block around their use
     (FullyShardedParameters, ZeRO-3).
  6. Expert parallelism: a mixture of experts' experts spread over data-parallel ranks, each token sent to
     its experts' rank and back with two all-to-alls (an autograd function, forward and backward).
  7. Muon: Newton-Schulz orthogonalised momentum for the matrices, AdamW for the rest, in one optimizer,
     with each matrix orthogonalised whole under tensor parallelism and dealt whole to one rank by ZeRO-1.
  Last, the timeline printer: the same action lists placed in time by a simulator of the executor's
     exchanges (python parallel.py --schedule zero_bubble --pp 4 --microbatches 8; --chunks for
     interleaved_1f1b).

Every piece here works on its own, given only torch and a process group (None means "not split"), so it
can be lifted into another project.

References: Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using
Model Parallelism" (the f and g operators, section 3); Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models" (sequence parallelism, section 4.2.2); Liu et al. 2023, "Ring
Attention with Blockwise Transformers for Near-Infinite Context"; Dubey et al. 2024, "The Llama 3 Herd of
Models" (the load-balanced split, section 3.3.2); Huang et al. 2019, "GPipe" (all forward, all backward);
Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
(1F1B and interleaved 1F1B, sections 2.2.1-2.2.2); Qi et al. 2023, "Zero Bubble Pipeline Parallelism"
(ZB-H1, ZB-V); Rajbhandari et al. 2020, "ZeRO" (sections 5.1-5.3); Zhao et al. 2023, "PyTorch
FSDP: Experiences on Scaling Fully Sharded Data Parallel"; Lepikhin et al. 2020, "GShard" (experts
spread over devices, all-to-all dispatch, section 2.2); Fedus et al. 2021, "Switch Transformers" (section
5.4); Jordan et al. 2024, "Muon"; Liu et al. 2025, "Muon is Scalable for LLM Training".
"""
import argparse
import itertools
import math
import os
import sys
from collections import namedtuple
from contextlib import contextmanager, nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# torch 2.13 renamed the single-tensor collectives (the old names still work, with a warning)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def at_least_fp32(dtype):
    """The dtype of the sums that must not be taken in half precision (norms, softmax, losses): fp32, or
    fp64 for a run in float64 (dtype='float64', CPU), which must not be rounded to fp32 either."""
    return torch.promote_types(dtype, torch.float32)

# -----------------------------------------------------------------------------
# 1. The layout


def group_size(group):
    return dist.get_world_size(group) if group is not None else 1


def group_rank(group):
    return dist.get_rank(group) if group is not None else 0


def grid_rank(pp_rank, dp_rank, tp_rank, dp, tp, cp_rank=0, cp=1):
    """The global rank at a point of the dp x cp x tp x pp grid (see ParallelLayout for why this order)."""
    return ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank


def resolve_dp(world_size, dp, tp, pp, count_name="WORLD_SIZE", cp=1, ep=1):
    """The data-parallel size of a launch: dp = 0 means whatever the world leaves after cp * tp * pp; any
    other dp must make dp * cp * tp * pp the world size; and ep (expert parallelism, section 6) must divide
    dp. The one place these rules live (train.py, bench.py and make_config.py, whose count_name is 'nproc',
    all come here)."""
    split = cp * tp * pp
    # a run that does not split the sequence gets the message it always had, without cp in it
    axes, product, names = f"tp = {tp} x pp = {pp}", f"tp * pp = {tp} * {pp}", "--tp/--pp"
    if cp > 1:
        axes, product, names = f"cp = {cp} x " + axes, f"cp * tp * pp = {cp} * {tp} * {pp}", "--cp/--tp/--pp"
    if world_size % split != 0:
        raise ValueError(f"{count_name} = {world_size} processes cannot be cut into {axes}: the world size "
                         f"{world_size} is not divisible by {product}; launch a multiple of {split} processes or "
                         f"change {names}")
    if dp == 0:
        dp = world_size // split
    elif dp * split != world_size:
        cut = f"dp={dp} x cp={cp} x tp={tp} x pp={pp}" if cp > 1 else f"dp={dp} x tp={tp} x pp={pp}"
        flags = "--dp, --cp, --tp and --pp" if cp > 1 else "--dp, --tp and --pp"
        raise ValueError(f"the layout {cut} = {dp * split} ranks does not match the world size {world_size}: set "
                         f"{flags} so that their product is {world_size} (leave dp=0 to have it computed as "
                         f"world_size / ({'cp * ' if cp > 1 else ''}tp * pp))")
    if dp % ep != 0:
        raise ValueError(f"ep = {ep} must divide dp = {dp}: the experts are spread over ep of the data-parallel "
                         f"ranks, so launch a multiple of ep * {product.split(' = ')[0]} = {ep * split} processes "
                         f"or choose an ep that divides {dp}")
    return dp


class ParallelLayout:
    """Cuts `world_size` ranks into a dp x cp x tp x pp grid and builds one process group per line of it.

    Ranks are numbered with tp fastest, then cp, then dp, then pp (Megatron-LM's order):
        rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank
    which at cp = 1 is (pp_rank * dp + dp_rank) * tp + tp_rank, the numbering of a run without cp.
    Tensor parallelism talks on every layer (several collectives per block), so its ranks are neighbours,
    which on a real cluster means the same node and its fast links: torchrun gives each node consecutive
    ranks, so a tp group stays inside a node whenever tp divides the processes per node (see
    tp_groups_across_nodes). Context parallelism passes keys and values round a ring in every attention
    layer, the next chattiest; data parallelism talks once per step, pipeline parallelism only sends
    activations between neighbouring stages, so both can span nodes.

    `timeout` is how long a collective on these groups waits for its peers before it fails (a group does
    not inherit the default group's timeout from init_process_group: it must be passed to each). Each group
    is named after its axes (group_desc): NCCL's watchdog names the group in its timeout message.

    Groups: tp_group, cp_group, dp_group and pp_group, the lines along one axis; and dp_cp_group, the dp x cp
    ranks that hold the same parameters (same tp slice, same stage): gradients are averaged and ZeRO shards
    over it (at cp = 1 it is the dp group). A group of one rank is None.

    Expert parallelism (ep, section 6) cuts each line of dp ranks into dp / ep blocks of ep neighbours: the
    ranks of a block (ep_group, ep_rank its index) hold different experts and exchange tokens twice per MoE
    layer, the chattiest group after tp and cp, so they are neighbours too; the ranks at the same place of
    every block, of every cp share (expert_dp_group, (dp / ep) * cp of them) hold the same experts and
    average their gradients. At ep = 1 the ep_group is None and the expert_dp_group is the dp_cp_group.

    With world_size 1 no group is built and every group is None: the single-process path.
    """

    def __init__(self, dp, tp, pp, world_size=1, rank=0, cp=1, ep=1, timeout=None):
        dp = resolve_dp(world_size, dp, tp, pp, cp=cp, ep=ep)
        self.dp, self.cp, self.tp, self.pp, self.world_size, self.rank = dp, cp, tp, pp, world_size, rank
        self.ep, self.timeout = ep, timeout
        self.tp_rank = rank % tp
        self.cp_rank = (rank // tp) % cp
        self.dp_rank = (rank // (tp * cp)) % dp
        self.pp_rank = rank // (tp * cp * dp)
        self.dp_cp, self.dp_cp_rank = dp * cp, self.dp_rank * cp + self.cp_rank
        self.ep_rank = self.dp_rank % ep
        self.tp_group = self.cp_group = self.dp_group = self.pp_group = self.dp_cp_group = None
        self.ep_group = self.expert_dp_group = None
        self.pp_prev = self.pp_next = None  # global ranks of the neighbouring pipeline stages
        if world_size == 1:
            return
        # A group is a line of the grid: the ranks that differ along its axes only. Every rank must create
        # every group, in the same order, even the groups it is not in. An axis of size 1 has no group.
        sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
        rank_at = lambda c: grid_rank(c["pp"], c["dp"], c["tp"], dp, tp, c["cp"], cp)
        lines = [("tp",), ("cp",), ("dp",), ("pp",)] + ([("dp", "cp")] if dp > 1 and cp > 1 else [])
        for axes in lines:
            if math.prod(sizes[a] for a in axes) == 1:
                continue
            fixed = [a for a in sizes if a not in axes]
            for at in itertools.product(*(range(sizes[a]) for a in fixed)):
                ranks = sorted(rank_at({**dict(zip(fixed, at)), **dict(zip(axes, along))})
                               for along in itertools.product(*(range(sizes[a]) for a in axes)))
                group = dist.new_group(ranks, timeout=timeout, group_desc="_".join(axes))
                if rank in ranks:
                    setattr(self, f"{'_'.join(axes)}_group", group)
        if self.dp_cp_group is None:  # one of dp and cp is 1: the other's group holds the same parameters
            self.dp_cp_group = self.dp_group if cp == 1 else self.cp_group
        # the expert groups (where one of them is a line built above, that line)
        self.expert_dp_group = self.dp_cp_group if ep == 1 else None
        if ep > 1:
            self.ep_group = self.dp_group if ep == dp else None
            blocks, replicas = expert_groups(dp, tp, pp, cp, ep)
            for kind, groups in (("ep_group", blocks if ep < dp else []),
                                 ("expert_dp_group", replicas if dp * cp > ep else [])):
                for ranks in groups:
                    group = dist.new_group(ranks, timeout=timeout, group_desc=kind)
                    if rank in ranks:
                        setattr(self, kind, group)
        if self.pp_rank > 0:
            self.pp_prev = grid_rank(self.pp_rank - 1, self.dp_rank, self.tp_rank, dp, tp, self.cp_rank, cp)
        if self.pp_rank < pp - 1:
            self.pp_next = grid_rank(self.pp_rank + 1, self.dp_rank, self.tp_rank, dp, tp, self.cp_rank, cp)

    @property
    def is_first_stage(self):
        return self.pp_rank == 0

    @property
    def is_last_stage(self):
        return self.pp_rank == self.pp - 1


def expert_groups(dp, tp, pp, cp, ep):
    """The expert-parallel blocks (ep neighbouring dp ranks at one cp share, tp slice and stage) and the
    expert replicas (the ranks at the same place of every block and cp share: they hold the same experts),
    as lists of global ranks."""
    blocks, replicas = [], []
    for p, t in itertools.product(range(pp), range(tp)):
        rank_of = lambda d, c: grid_rank(p, d, t, dp, tp, c, cp)
        blocks += [[rank_of(b * ep + e, c) for e in range(ep)] for c in range(cp) for b in range(dp // ep)]
        replicas += [sorted(rank_of(b * ep + e, c) for b in range(dp // ep) for c in range(cp)) for e in range(ep)]
    return blocks, replicas


def init_distributed(dp, tp, pp, device_type, cp=1, ep=1, timeout_s=None):
    """Start torch.distributed when launched by torchrun (WORLD_SIZE set) and build the layout.
    dp=0 means "whatever is left": world_size / (cp * tp * pp). timeout_s: how long any collective waits
    for its peers before it fails (None: torch's default, 10 minutes on gloo, 30 on NCCL)."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    dp = resolve_dp(world_size, dp, tp, pp, cp=cp, ep=ep)  # before any process group: a bad layout fails fast, alone
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        store = _store_of_this_attempt(world_size, timeout)
        if store is None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, timeout=timeout, store=store, rank=rank, world_size=world_size)
    return ParallelLayout(dp, tp, pp, world_size, rank, cp=cp, ep=ep, timeout=timeout)


def _store_of_this_attempt(world_size, timeout):
    """Under torchrun, the key-value store the ranks meet in, with keys of this attempt only (None when not
    launched by torchrun's agent). torchrun keeps one store for the whole job, restarts included, and every
    process group publishes its ranks' addresses in it under the same keys at every attempt: a restarted
    rank could read a dead rank's address from the attempt before and fail to connect ('Connection
    refused'). A prefix per attempt (TORCHELASTIC_RESTART_COUNT) keeps each attempt's keys apart."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout or timedelta(minutes=10))
    return dist.PrefixStore(f"picotron/attempt_{attempt}", store)


def tp_groups_across_nodes(dp, tp, pp, local_world_size, cp=1):
    """The tensor-parallel groups (lists of global ranks) that are not all on one node, when every node
    runs local_world_size processes with consecutive ranks, as torchrun numbers them (LOCAL_WORLD_SIZE).
    A tp group is tp consecutive ranks (tp fastest), so none spans two nodes when tp divides
    local_world_size; otherwise its all-reduces, several per layer, cross the network between nodes."""
    spanning = []
    for p, d, c in itertools.product(range(pp), range(dp), range(cp)):
        ranks = [grid_rank(p, d, t, dp, tp, c, cp) for t in range(tp)]
        if len({r // local_world_size for r in ranks}) > 1:
            spanning.append(ranks)
    return spanning


def format_grid(dp, tp, pp, cp=1, ep=1, n_expert=0):
    """The rank layout as text, one line per (pipeline stage, data-parallel replica), and under context
    parallelism per share of the sequence too: which global ranks hold the tensor-parallel slices of it;
    under expert parallelism which experts each replica holds, followed by the expert groups."""
    lines = []
    for p in range(pp):
        for d in range(dp):
            for c in range(cp):
                ranks = [grid_rank(p, d, t, dp, tp, c, cp) for t in range(tp)]
                share = f" sequence share {c} (chunks {c}, {2 * cp - 1 - c})" if cp > 1 else ""
                held = ""
                if ep > 1:
                    first, n = (d % ep) * (n_expert // ep), n_expert // ep
                    held = f", experts {first}-{first + n - 1}" if n > 1 else f", expert {first}"
                lines.append(f"  stage {p} replica {d}{share}: ranks {ranks}{held}")
    if ep > 1:
        blocks, replicas = expert_groups(dp, tp, pp, cp, ep)
        lines.append(f"  expert-parallel groups (ep={ep}, tokens sent to their experts all-to-all): "
                     + " ".join(map(str, blocks)))
        lines.append("  expert replicas (the same experts, gradients averaged): "
                     + (" ".join(map(str, replicas)) if dp * cp > ep else "none, every expert is on one rank"))
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# 2. Tensor parallelism: the communication operators
#
# A column-parallel linear splits its output features across ranks: every rank needs the whole input,
# produces a slice of the output. A row-parallel linear splits its input features: every rank holds a
# slice of the input, produces a partial sum of the whole output. Chaining column -> row (attention:
# QKV -> output projection; MLP: up -> down) needs exactly one all-reduce in the forward pass (g, after
# the row-parallel layer) and one in the backward pass (f, before the column-parallel layer). When several
# column-parallel layers read one input (q, k, v), f is applied once to that input (copy_input=False below).


class CopyToTensorParallelRegion(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward. Each rank used the same input for its own
    slice of the work, so the input's gradient is the sum of every rank's contribution."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # all_reduce works in place, and autograd may hand the same gradient tensor to other branches too
        # (an addition passes its output's gradient to both inputs): reduce a copy
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward. Each rank computed a partial sum of the
    output; the sum is the output, and its gradient flows unchanged to every partial."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone(memory_format=torch.contiguous_format)  # all_reduce works in place: leave the caller's x
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


def _reduce_scatter_along(x, group, dim):
    """This rank's chunk, along dim, of the sum over the group of every rank's x."""
    moved = x.movedim(dim, 0).contiguous()  # reduce_scatter_tensor cuts along dimension 0
    out = moved.new_empty((moved.shape[0] // group_size(group), *moved.shape[1:]))
    _reduce_scatter_single(out, moved, group=group)
    return out.movedim(0, dim)


class GatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather along `dim` (the last by default) forward; backward keeps only this rank's slice of the
    gradient. The backward assumes what follows the gather is the same computation on every rank
    (replicated), so every rank holds the same full gradient and its own slice of it is the whole story."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather_along(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(group_size(ctx.group), dim=ctx.dim)[group_rank(ctx.group)].contiguous(), None, None


class ScatterToTensorParallelRegion(torch.autograd.Function):
    """Split: keep this rank's slice of `dim` (the last by default) forward; all-gather the gradient
    backward. The input is the same on every rank (replicated), so its gradient is every rank's slice
    gradient side by side."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return x.chunk(group_size(group), dim=dim)[group_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_along(grad, ctx.group, ctx.dim), None, None


# -----------------------------------------------------------------------------
# Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
# Models", section 4.2.2), an option of tensor parallelism.
#
# Between the tensor-parallel regions (the norms and the residual adds: everything outside attention and
# the MLP) every tp rank computes the same thing on the same tokens and holds the same (B, T, C)
# activations. Sequence parallelism splits them along the sequence instead: tp rank t holds tokens
# t*T/tp .. (t+1)*T/tp - 1 there, 1/tp of those activations, and works on them alone. Entering a region
# the tokens are all-gathered, and the backward reduce-scatters their gradient: each rank's column-
# parallel layers made a partial gradient for every token, and each rank needs the sum for its own tokens
# only (this replaces f). Leaving a region, the row-parallel layer's partial sums are reduce-scattered:
# each rank receives the whole sum for its own tokens, and the backward all-gathers the gradient (this
# replaces g). An all-reduce is a reduce-scatter followed by an all-gather, so the bytes on the wire are
# those of tensor parallelism without it; what falls is the memory between the regions, by tp.
#
# The cost is in the parameters every tp rank holds whole: the norm gains and the row-parallel biases now
# see only this rank's tokens, and the replicated weights inside a region (MLA's down-projections and
# latent norms) get only this rank's partial gradient, since no f sums it any more. Each passes through f
# itself (copy_to_tp on the parameter), whose backward sums the parts across the tp group: Megatron's
# all-reduce of the sequence-parallel gradients, done where the parameter is used. Tensors are
# (B, T, ...): the sequence is dimension 1, and T must split into tp equal pieces.


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Entering a tensor-parallel region: all-gather the tokens along the sequence forward; reduce-scatter
    the gradient backward (the sum over ranks of every rank's partial gradient, this rank's tokens only)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_along(x, group, 1)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_along(grad, ctx.group, 1), None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Leaving a tensor-parallel region: reduce-scatter the partial sums along the sequence forward (this
    rank's tokens of the sum); all-gather the gradient backward (the region needs every token's)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_along(x, group, 1)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_along(grad, ctx.group, 1), None


# With no group (one rank) every operator is the identity, so the same model code runs unsplit.
def copy_to_tp(x, group):
    return CopyToTensorParallelRegion.apply(x, group) if group_size(group) > 1 else x


def reduce_from_tp(x, group):
    return ReduceFromTensorParallelRegion.apply(x, group) if group_size(group) > 1 else x


def gather_from_tp(x, group, dim=-1):
    return GatherFromTensorParallelRegion.apply(x, group, dim) if group_size(group) > 1 else x


def scatter_to_tp(x, group, dim=-1):
    return ScatterToTensorParallelRegion.apply(x, group, dim) if group_size(group) > 1 else x


def gather_from_sp(x, group):
    return GatherFromSequenceParallelRegion.apply(x, group) if group_size(group) > 1 else x


def reduce_scatter_to_sp(x, group):
    return ReduceScatterToSequenceParallelRegion.apply(x, group) if group_size(group) > 1 else x


# -----------------------------------------------------------------------------
# Tensor parallelism: the layers
#
# Each sharded parameter carries `tp_shard_dim` (the dimension it is split along) so that the model's
# initialisation, the checkpoint and the gradient-norm computation know which slice of the full tensor a
# rank holds. A parameter without it is replicated: every tensor-parallel rank holds the same copy.
#
# A layer's weights are created empty (a 7B model is never materialised whole on one rank); fill them with
# `layer.load_full(weight, bias)`, where each of weight and bias is either the full tensor (drawn, or from
# another layout's checkpoint) or a reader of slices, `read(dim, start, size)` returning that slice of the
# full tensor (so a rank reads only its shard of a safetensors file). With group=None a layer is not split:
# it computes what nn.Linear / nn.Embedding compute, with the same fill (the embedding's rows are still
# padded, to a multiple of 64).


def mark_sharded(param, dim, group):
    param.tp_shard_dim = dim
    param.tp_world = group_size(group)
    param.tp_rank = group_rank(group)
    return param


def shard_of(full, param):
    """The slice of a full tensor that `param` holds on this rank (the full tensor itself if replicated)."""
    dim = getattr(param, "tp_shard_dim", None)
    if dim is None:
        return full
    size = param.shape[dim]
    return full.narrow(dim, param.tp_rank * size, size)


def load_shard(param, source):
    """Fill `param` with its slice of a full tensor. `source` is the full tensor, or a reader
    read(dim, start, size) of slices of it (dim None: the whole tensor). A vocabulary-padded table reads
    only the real rows (rows past `vocab_size` stay zero), so the source needs no padding, or any padding."""
    dim = getattr(param, "tp_shard_dim", None)
    read = source if callable(source) else (lambda d, start, size: source if d is None else source.narrow(d, start, size))
    with torch.no_grad():
        if dim is None:
            param.copy_(read(None, 0, None))
            return param
        size = param.shape[dim]
        start = param.tp_rank * size
        real = max(0, min(size, getattr(param, "vocab_size", start + size) - start))  # < size only in padded tables
        param.narrow(dim, real, size - real).zero_()
        if real > 0:
            param.narrow(dim, 0, real).copy_(read(dim, start, real))
    return param


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
    out_features / tp of the outputs. With gather_output=False the output stays split, ready to feed a
    RowParallelLinear (or a per-head attention, or the vocab-parallel loss) with no communication.

    The input passes through f (copy_to_tp), whose backward sums the input's gradient across ranks. When
    several column-parallel layers read the same input (q, k and v; SwiGLU's gate and up), apply
    copy_to_tp once to that input and build the layers with copy_input=False: one all-reduce instead of
    one per layer. Under sequence parallelism the input comes from gather_from_sp, whose backward already
    sums the gradient: build the layer with copy_input=False then too.

    The weight is created empty: fill it with load_full (see the section's note).

    `weight_grad_store` (None: a plain linear) is what the zero-bubble pipeline schedules set to split this
    layer's backward, the input's gradient now and the weight's later (section 4, WeightGradStore)."""

    def __init__(self, in_features, out_features, bias=False, group=None, gather_output=False, copy_input=True):
        super().__init__()
        self.group, self.gather_output, self.copy_input = group, gather_output, copy_input
        self.out_per_rank = _divide(out_features, group_size(group), "out_features")
        self.weight = mark_sharded(nn.Parameter(torch.empty(self.out_per_rank, in_features)), 0, group)
        self.bias = mark_sharded(nn.Parameter(torch.zeros(self.out_per_rank)), 0, group) if bias else None
        self.weight_grad_store = None

    def load_full(self, weight, bias=None):
        """weight (out_features, in_features) and bias (out_features,): full tensors or slice readers."""
        load_shard(self.weight, weight)
        if bias is not None:
            load_shard(self.bias, bias)

    def forward(self, x):
        if self.copy_input:
            x = copy_to_tp(x, self.group)
        store = self.weight_grad_store
        y = F.linear(x, self.weight, self.bias) if store is None else store.linear(x, self.weight, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by columns (input features): each rank multiplies its slice of the
    input by its slice of W, and the partial outputs are summed (g). With input_is_parallel=False the full
    input is first cut into slices here. The bias is replicated and added once, after the sum (added
    before, it would be counted tp times).

    sequence_parallel=True: the partial outputs are reduce-scattered along the sequence instead (each rank
    gets the sum for its own tokens, (B, T/tp, out_features)), and the bias, added to this rank's tokens
    only, passes through f so that its gradient is summed over the ranks' tokens.

    The weight is created empty, as in ColumnParallelLinear: fill it with load_full; weight_grad_store as
    there (the bias, added after the sum, keeps its gradient in autograd)."""

    def __init__(self, in_features, out_features, bias=False, group=None, input_is_parallel=True,
                 sequence_parallel=False):
        super().__init__()
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, sequence_parallel
        self.in_per_rank = _divide(in_features, group_size(group), "in_features")
        self.weight = mark_sharded(nn.Parameter(torch.empty(out_features, self.in_per_rank)), 1, group)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.weight_grad_store = None

    def load_full(self, weight, bias=None):
        """weight (out_features, in_features) and bias (out_features,): full tensors or slice readers."""
        load_shard(self.weight, weight)
        if bias is not None:
            load_shard(self.bias, bias)

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        store = self.weight_grad_store
        partial = F.linear(x, self.weight) if store is None else store.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sp(partial, self.group)
            return y + copy_to_tp(self.bias, self.group) if self.bias is not None else y
        y = reduce_from_tp(partial, self.group)
        return y + self.bias if self.bias is not None else y


def padded_vocab_size(vocab_size, tp):
    """Round the vocabulary up so it splits evenly across tp ranks, and to a multiple of 64 per rank,
    which keeps the embedding and output matmuls on fast kernel sizes (nanoGPT's 50257 -> 50304).
    The extra rows are never a target: Transformer.forward cuts their logits off before the loss, the
    embedding never looks them up, so they stay zero and take no gradient."""
    multiple = 64 * tp
    return (vocab_size + multiple - 1) // multiple * multiple


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by rows (token ids) across the group. Each rank looks up the ids in its
    range, writes zeros for the others, and the all-reduce (g) assembles every token's vector. The table is
    padded to padded_vocab_size rows (zero, never looked up); fill it with load_full(weight), weight being
    the (vocab_size, dim) table or a slice reader. sequence_parallel=True reduce-scatters instead: each
    rank gets its own tokens' vectors, (B, T/tp, dim), for the sequence-parallel region that follows."""

    def __init__(self, vocab_size, dim, group=None, sequence_parallel=False):
        super().__init__()
        self.group, self.vocab_size, self.sequence_parallel = group, vocab_size, sequence_parallel
        self.rows_per_rank = padded_vocab_size(vocab_size, group_size(group)) // group_size(group)
        self.vocab_start = group_rank(group) * self.rows_per_rank
        self.weight = mark_sharded(nn.Parameter(torch.empty(self.rows_per_rank, dim)), 0, self.group)
        self.weight.vocab_size = vocab_size  # rows past it are padding: zero at init, never looked up

    def load_full(self, weight):
        load_shard(self.weight, weight)

    def forward(self, idx):
        if group_size(self.group) == 1:
            return F.embedding(idx, self.weight)
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sp(out, self.group)
        return reduce_from_tp(out, self.group)


def valid_vocab_columns(vocab_size, rows_per_rank, group):
    """How many of this rank's vocab columns are real tokens (the last ranks may hold only padding)."""
    start = group_rank(group) * rows_per_rank
    return max(0, min(rows_per_rank, vocab_size - start))


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary across the group, without ever gathering them:
    the full-vocab logits of a 50k vocabulary are the largest tensor in a small model.

        loss = log(sum_v exp(z_v - m)) - (z_target - m),    m = max_v z_v  (for a stable exp)
    The max, the sum of exps and the target's logit are each all-reduced across ranks (three reductions of
    one number per token); every rank then holds the loss of every token, and the gradient of its own
    slice, softmax - onehot(target), needs no communication. A rank whose slice is empty (it holds only
    vocabulary padding, possible with a small vocabulary) contributes -inf to the max and 0 to the sums."""

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
            target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)
        else:  # this rank holds only vocabulary padding
            max_logit = torch.full((n,), float("-inf"), dtype=logits.dtype, device=logits.device)
            target_logit = torch.zeros(n, dtype=logits.dtype, device=logits.device)
        dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(target_logit, group=group)
        exp = (logits - max_logit.unsqueeze(-1)).exp_()  # the one (N, V_local) temporary; becomes the softmax
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
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
            grad.scatter_add_(-1, local_target.unsqueeze(-1), -target_here.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits, targets, vocab_start=0, group=None, ignore_index=-1):
    """Mean cross-entropy of (N, V_local) logits, this rank's vocabulary columns starting at global id
    vocab_start, against (N,) global target ids; ignored targets are left out of the mean (if every target
    is ignored the loss is 0, where F.cross_entropy gives nan). With one rank it is F.cross_entropy."""
    if group_size(group) == 1:
        return F.cross_entropy(logits.to(at_least_fp32(logits.dtype)), targets, ignore_index=ignore_index)
    losses = VocabParallelCrossEntropy.apply(logits, targets, vocab_start, group, ignore_index)
    return losses.sum() / (targets != ignore_index).sum().clamp(min=1)


# -----------------------------------------------------------------------------
# 3. Context parallelism: the zigzag split and ring attention
#
# Context parallelism splits the sequence. Each of the cp ranks of a context-parallel group holds T/cp of
# every window's tokens, and with them T/cp of every activation: the embedding, the norms, the MLP and the
# loss work token by token, so they run on the local tokens unchanged. Attention alone needs other ranks'
# tokens, because a query reads the keys and values of every earlier token.
#
# Every cp rank holds the whole model, the same parameters, and computes the gradient of its own tokens'
# part of the loss: the gradients are averaged over the dp x cp ranks that hold the same parameters
# (section 5), and each rank's loss is its tokens' summed loss over the microbatch's token count, times cp,
# so that the mean over the cp ranks is the microbatch's mean loss and the average of their gradients its
# gradient (a factor cp off would hardly show in the losses under AdamW, only in the gradient norm). A
# mixture-of-experts layer, whose expert capacity couples every token of a microbatch, gathers its routing
# decisions from the whole window (all_gather_context) to queue them as one process would.
#
# The split. Causal attention's work is a triangle: a query late in the window sees many keys, an early one
# few. Cut into contiguous pieces, rank r's queries would see r whole pieces of keys and half its own, so
# the last rank would do 2cp-1 times the work of the first, which waits. So each window is cut into 2*cp
# chunks and rank r holds chunk r and its mirror, chunk 2cp-1-r (the split of Llama 3's context
# parallelism, Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.2). Query chunk i sees key
# chunks 0..i, i of them whole and the diagonal one half, so rank r's two chunks see r + (2cp-1-r) =
# 2cp-1 whole chunks and two diagonal halves: the same for every rank. RoPE and the mask use the tokens'
# global positions, built on the host from the whole window and split the same way as the tokens. The mask
# is "key position <= query position", so it holds for any split; every rank is given every rank's
# positions (a few integers per token, on the host), so it decides which blocks to skip there, without a
# device sync, and no positions need to travel with the keys.
#
# Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context").
# The key/value blocks travel round the group: at each of cp steps a rank attends its queries to the block
# it holds while, point to point, it passes that block on to rank r+1 and receives the next from rank r-1;
# the transfer is posted before the block is computed, so it overlaps the compute. The partial outputs of
# the cp blocks are merged by their log-sum-exp. Each rank's two chunks against the visiting two chunks
# make four chunk pairs: those the causal mask fully hides are skipped, those it fully shows need no mask,
# the others (the diagonal) are masked.
#
# Backward (a custom autograd function, as FlashAttention does it: Dao et al. 2022, "FlashAttention",
# section 3.1 and appendix B) saves q, k, v, the output and the log-sum-exp, never the probabilities, and
# recomputes each block's probabilities from them. The key/value blocks make the same trip round the ring
# again; each carries with it an fp32 accumulator of its own gradients, which every rank it visits adds to,
# and one more step brings the accumulator home to the rank that owns those keys.
#
# Collectives, per attention layer, with S = B * (T/cp) * H_kv * (D + D_v) elements of k and v per rank:
# forward cp-1 ring steps of S elements in k/v's dtype; backward cp-1 such steps plus cp steps of the
# gradients, S elements in fp32 (see ring_attention_bytes). Each is one dist.batch_isend_irecv of sends to
# the next rank and receives from the previous, so no pair of neighbours can deadlock by both sending first.
#
# Memory: activations per rank fall by cp, attention's too: besides q, k, v and the output it keeps one
# fp32 log-sum-exp per query and head; the largest transients are one chunk pair's fp32 scores and
# probabilities, (B, H, T/2cp, T/2cp) each.
# The ring holds two k/v blocks (the one computed, the one arriving), and in backward two gradient blocks.
#
# Variants. GQA and MQA: the H_kv key/value heads travel, each serving H/H_kv query heads; their gradients
# are the sums over those query heads. MLA: what travels is the per-head keys and values, H * (qk_nope +
# qk_rope + v_head) numbers per token (320 for config/mla.py), not the compressed latent (kv_lora_rank +
# qk_rope = 80): sending the latent would cost 4x fewer bytes, but every rank would then run kv_up, the
# QK-norm and RoPE on each visiting block and sum kv_up's weight gradient over the blocks; left for later.
# QK-norm and RoPE act on each token before attention, so they need nothing here. Attention soft-capping
# (Gemma 2) is applied to each block's scores. Document masking: pass each token's document id beside its
# position; a key is then visible when it is in the same document and not later.


def check_context_split(seq_len, cp, tp=1):
    """The zigzag split needs 2*cp equal chunks; with sequence parallelism (tp > 1 here) each rank's tokens
    are split again across the tensor-parallel group, so the length must split into 2*cp*tp pieces (tp
    pieces without context parallelism, cp = 1)."""
    pieces = (2 * cp if cp > 1 else 1) * tp
    if seq_len % pieces == 0:
        return
    lower, upper = seq_len // pieces * pieces, (seq_len // pieces + 1) * pieces
    fix = f"Set block_size to a multiple of {pieces} (e.g. {lower or upper} or {upper})"
    if cp == 1:
        raise ValueError(f"block_size = {seq_len} does not split into tp = {tp} equal pieces: sequence parallelism "
                         f"gives each tensor-parallel rank 1/tp of the tokens between the tensor-parallel regions. "
                         f"{fix}, or change tp")
    why = (f"2 * cp * tp = {pieces} (cp = {cp}, tp = {tp}: sequence parallelism splits each rank's tokens "
           f"again across tp)" if tp > 1 else f"2 * cp = {pieces} (cp = {cp})")
    raise ValueError(f"block_size = {seq_len} does not split into {why} equal chunks: context parallelism "
                     f"gives each rank chunk r and chunk 2*cp-1-r of every window. {fix}, or change cp")


def zigzag_split(x, cp, cp_rank, dim=1):
    """cp rank cp_rank's tokens of x: chunks cp_rank and 2*cp-1-cp_rank of 2*cp along dim, concatenated."""
    check_context_split(x.shape[dim], cp)
    chunk = x.shape[dim] // (2 * cp)
    return torch.cat([x.narrow(dim, cp_rank * chunk, chunk), x.narrow(dim, (2 * cp - 1 - cp_rank) * chunk, chunk)],
                     dim=dim)


def zigzag_gather(parts, dim=1):
    """The inverse: the whole sequence from every cp rank's zigzag_split, given in rank order."""
    halves = [p.chunk(2, dim=dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


def all_gather_context(x, group, dim=1):
    """The whole window of x, from every cp rank's zigzag share of it (an all-gather, then zigzag_gather),
    with no gradient. A mixture-of-experts layer gathers its chosen expert ids this way (small integers)
    to queue them in the window's order, as one process does."""
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x, group=group)
    return zigzag_gather(parts, dim)


def split_for_every_rank(x, cp, split=zigzag_split):
    """Every cp rank's share of the last dim of x, stacked: (T,) -> (cp, T/cp), (B, T) -> (cp, B, T/cp).
    This is how ring_attention takes positions (and document ids): a rank knows which keys of a visiting
    block it may see without being sent anything, since it built the whole window's positions itself."""
    return torch.stack([split(x, cp, r, dim=-1) for r in range(cp)])


# The plan: which chunk pairs each ring step computes, decided on the host.
#
# Whether a pair of chunks is hidden, fully visible or partly visible follows from the positions' minima and
# maxima. Taken from device tensors, each such test would be a .item(), a host-device sync that stalls the
# GPU's queue, cp * 4 times per layer. The positions are built on the host (from the whole window), so the
# plan is made there from the host copy of every rank's positions: no sync, and nothing to send with the
# keys. Only the masks of the partly visible pairs are built on the device, from a device copy.


def _chunk_slices(seq_len, chunks):
    n = min(chunks, seq_len)
    edges = [i * seq_len // n for i in range(n + 1)]
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:])]


def _pair_kind(q_pos, kv_pos, q_doc, kv_doc):
    """'hidden', 'full' or 'masked' for queries at q_pos against keys at kv_pos, both (B, n): the test is
    per batch row, and a pair is hidden or full only when it is so in every row. With document ids a pair
    whose ranges of ids do not overlap is hidden too, and a pair is full only inside one document."""
    q_lo, q_hi = q_pos.amin(-1), q_pos.amax(-1)  # (B,)
    kv_lo, kv_hi = kv_pos.amin(-1), kv_pos.amax(-1)
    hidden, full = kv_lo > q_hi, kv_hi <= q_lo
    if q_doc is not None:
        qd_lo, qd_hi, kd_lo, kd_hi = q_doc.amin(-1), q_doc.amax(-1), kv_doc.amin(-1), kv_doc.amax(-1)
        hidden = hidden | (kd_lo > qd_hi) | (kd_hi < qd_lo)
        full = full & (qd_lo == qd_hi) & (kd_lo == kd_hi) & (qd_lo == kd_lo)  # all one document
    if bool(hidden.all()):
        return "hidden"
    return "full" if bool(full.all()) else "masked"


def block_plan(positions, documents, rank, chunks=2):
    """For each ring step, the (query slice, key slice, 'full' or 'masked') pairs that rank computes; the
    hidden ones are left out. positions and documents are (cp, B, T_local) host tensors (see
    split_for_every_rank); at step i the block of rank (rank - i) % cp is visiting."""
    cp, T = positions.shape[0], positions.shape[-1]
    slices = _chunk_slices(T, chunks)
    doc = (lambda r, s: documents[r][..., s]) if documents is not None else (lambda r, s: None)
    plan = []
    for step in range(cp):
        source = (rank - step) % cp
        pairs = []
        for qs in slices:
            for ks in slices:
                kind = _pair_kind(positions[rank][..., qs], positions[source][..., ks], doc(rank, qs),
                                  doc(source, ks))
                if kind != "hidden":
                    pairs.append((qs, ks, kind))
        plan.append(pairs)
    return plan


def attention_work(positions, documents=None, chunks=2):
    """Per rank, the chunk pairs computed and the score elements computed (per batch row and head) over one
    ring pass: the attention work each rank does. positions as for ring_attention."""
    positions = positions if positions.dim() == 3 else positions[:, None]
    documents = documents if documents is None or documents.dim() == 3 else documents[:, None]
    work = []
    for rank in range(positions.shape[0]):
        pairs = [pair for step in block_plan(positions, documents, rank, chunks) for pair in step]
        scores = sum((qs.stop - qs.start) * (ks.stop - ks.start) for qs, ks, _ in pairs)
        work.append({"blocks": len(pairs), "scores": scores})
    return work


def ring_attention_bytes(batch, seq_len_local, n_kv_head, head_dim, v_head_dim, cp, element_size=4):
    """Bytes one rank sends in one attention layer's forward and backward (a dict). One ring step sends
    the held k and v: batch * seq_len_local * n_kv_head * (head_dim + v_head_dim) elements. Forward takes
    cp - 1 steps (the last block is not passed on). Backward sends k and v again cp - 1 times, and the
    fp32 gradient accumulators cp times: the extra step takes them home."""
    step_elements = batch * seq_len_local * n_kv_head * (head_dim + v_head_dim)
    if cp == 1:
        return {"forward": 0, "backward": 0, "step": 0}
    kv = (cp - 1) * step_elements * element_size
    return {"forward": kv, "backward": kv + cp * step_elements * 4, "step": step_elements * element_size}


# -----------------------------------------------------------------------------
# One chunk pair, forward and backward. Query heads are grouped by the key/value head they read:
# q is (B, H_kv, G, Tq, D) with G = H / H_kv, k is (B, H_kv, 1, Tk, D), and broadcasting does the rest.


def _scores(q, k, scale, softcap):
    """fp32 scores q k^T * scale, soft-capped to cap * tanh(s / cap); also the tanh, for the derivative."""
    s = (q @ k.transpose(-2, -1)) * scale  # (B, H_kv, G, Tq, Tk)
    if not softcap:
        return s, None
    t = torch.tanh(s / softcap)
    return softcap * t, t


def _finite(lse):
    """A row with no visible key has lse = -inf; exp(s - lse) would be exp(-inf + inf) = nan. Against 0 it
    is exp(-inf) = 0: the row gets zero probabilities, a zero output and zero gradients."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _block_forward(q, k, v, visible, scale, softcap):
    """This block's normalised output and log-sum-exp: (B, H_kv, G, Tq, D_v) and (B, H_kv, G, Tq)."""
    s, _ = _scores(q, k, scale, softcap)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse)[..., None])
    return p @ v, lse


def _merge(out, lse, block_out, block_lse):
    """Two softmax-weighted averages over disjoint sets of keys, combined into the one over both:
    lse = log(e^lse1 + e^lse2), out = e^(lse1 - lse) out1 + e^(lse2 - lse) out2. Each weight is the share
    of the softmax denominator its keys hold (Milakov & Gimelshein 2018, "Online normalizer calculation
    for softmax"). Rows that have seen no visible key yet have lse = -inf and stay zero."""
    new_lse = torch.logaddexp(lse, block_lse)
    safe = _finite(new_lse)[..., None]
    return torch.exp(lse[..., None] - safe) * out + torch.exp(block_lse[..., None] - safe) * block_out, new_lse


def _block_backward(q, k, v, dout, lse, delta, visible, scale, softcap, dq, dk, dv):
    """Adds this block's gradients into dq (B, H_kv, G, Tq, D), dk (B, H_kv, Tk, D), dv (B, H_kv, Tk, D_v).
    With p = softmax(s) recomputed from the saved lse, and delta = rowsum(dout * out):
        dv = p^T dout,  dp = dout v^T,  ds = p * (dp - delta),  then through the cap and the scale,
        dq = ds k,  dk = ds^T q."""
    s, t = _scores(q, k, scale, softcap)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    p = torch.exp(s - _finite(lse)[..., None])  # (B, H_kv, G, Tq, Tk); hidden keys give exactly 0
    dv += (p.transpose(-2, -1) @ dout).sum(2)  # summed over the G query heads that read each kv head
    ds = p * (dout @ v.transpose(-2, -1) - delta[..., None])
    if softcap:
        ds = ds * (1 - t * t)  # d/ds cap * tanh(s / cap) = 1 - tanh^2
    ds = ds * scale
    dq += ds @ k
    dk += (ds.transpose(-2, -1) @ q).sum(2)


# -----------------------------------------------------------------------------
# The ring


def _query_heads(x, n_kv_head):
    B, T, H, D = x.shape
    x = x.to(at_least_fp32(x.dtype))
    return x.view(B, T, n_kv_head, H // n_kv_head, D).permute(0, 2, 3, 1, 4)  # (B, H_kv, G, T, D)


def _kv_heads(x):
    return x.to(at_least_fp32(x.dtype)).permute(0, 2, 1, 3)[:, :, None]  # (B, T, H_kv, D) -> (B, H_kv, 1, T, D)


def _post_ring_exchange(tensors, group):
    """Post, in one batch, the sends of `tensors` to the next rank of the ring and the receives of tensors
    of the same shapes from the previous one. Returns (the receive buffers, the requests); not waited for,
    so the caller computes while they travel."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    next_rank = dist.get_global_rank(group, (rank + 1) % cp)  # a P2POp's peer is a global rank
    prev_rank = dist.get_global_rank(group, (rank - 1) % cp)
    tensors = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in tensors]
    ops = ([dist.P2POp(dist.isend, t, next_rank, group) for t in tensors]
           + [dist.P2POp(dist.irecv, t, prev_rank, group) for t in received])
    return received, dist.batch_isend_irecv(ops)


def _wait(requests):
    for request in requests:
        request.wait()


def _visible(pos, doc, rank, source, qs, ks):
    """Which keys each query sees, (B or 1, 1, 1, Tq, Tk): key position <= query position (and, with
    document ids, the same document)."""
    q_pos, kv_pos = pos[rank][..., qs], pos[source][..., ks]  # (B or 1, Tq), (B or 1, Tk)
    visible = kv_pos[:, None, :] <= q_pos[:, :, None]
    if doc is not None:
        visible = visible & (doc[source][..., ks][:, None, :] == doc[rank][..., qs][:, :, None])
    return visible[:, None, None]


class RingAttention(torch.autograd.Function):
    """Attention of this rank's queries over every cp rank's keys and values, which travel round the ring.
    See ring_attention for the arguments."""

    @staticmethod
    def forward(ctx, q, k, v, positions, documents, group, softcap, scale, chunks):
        cp, rank = group_size(group), group_rank(group)
        B, T, H, _ = q.shape
        n_kv_head = k.shape[2]
        plan = block_plan(positions, documents, rank, chunks)
        # the masks of the partly visible pairs are built from a device copy; non_blocking, since a blocking
        # host-to-device copy waits for the GPU's queue to drain, the sync the host-side plan avoids
        pos = positions.to(q.device, non_blocking=True)
        doc = documents.to(q.device, non_blocking=True) if documents is not None else None

        qh = _query_heads(q, n_kv_head)
        out = q.new_zeros(*qh.shape[:-1], v.shape[-1], dtype=qh.dtype)  # (B, H_kv, G, T, D_v), fp32 (fp64)
        lse = q.new_full(qh.shape[:-1], float("-inf"), dtype=qh.dtype)  # (B, H_kv, G, T)
        k_block, v_block = k, v
        for step in range(cp):
            if step < cp - 1:  # the next block sets off before this one is computed
                (k_next, v_next), requests = _post_ring_exchange([k_block, v_block], group)
            source = (rank - step) % cp
            kh, vh = _kv_heads(k_block), _kv_heads(v_block)
            for qs, ks, kind in plan[step]:
                visible = _visible(pos, doc, rank, source, qs, ks) if kind == "masked" else None
                block_out, block_lse = _block_forward(qh[..., qs, :], kh[..., ks, :], vh[..., ks, :], visible,
                                                      scale, softcap)
                out[..., qs, :], lse[..., qs] = _merge(out[..., qs, :], lse[..., qs], block_out, block_lse)
            if step < cp - 1:
                _wait(requests)
                k_block, v_block = k_next, v_next

        out = out.permute(0, 3, 1, 2, 4).reshape(B, T, H, v.shape[-1]).to(q.dtype)  # (B, T, H, D_v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.pos, ctx.doc, ctx.group, ctx.softcap, ctx.scale = plan, pos, doc, group, softcap, scale
        ctx.cp, ctx.rank = cp, rank
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, rank, group = ctx.cp, ctx.rank, ctx.group
        n_kv_head = k.shape[2]
        qh, dh = _query_heads(q, n_kv_head), _query_heads(dout, n_kv_head)
        delta = (dh * _query_heads(out, n_kv_head)).sum(-1)  # (B, H_kv, G, T): rowsum(dout * out)
        dq = torch.zeros_like(qh)
        # The gradients of a visiting block's keys and values come from every rank's queries, so they cannot
        # be finished where they are computed: an fp32 accumulator travels with each block, every rank adds
        # its part, and after the cp-th rank one more step brings the sum home to the block's owner.
        k_block, v_block = k, v
        grads_home = None  # the accumulators arriving for the next visiting block, and their requests
        for step in range(cp):
            if step < cp - 1:
                (k_next, v_next), kv_requests = _post_ring_exchange([k_block, v_block], group)
            source = (rank - step) % cp
            kh, vh = _kv_heads(k_block), _kv_heads(v_block)
            dk_block, dv_block = torch.zeros_like(kh[:, :, 0]), torch.zeros_like(vh[:, :, 0])  # (B, H_kv, T, D)
            for qs, ks, kind in ctx.plan[step]:
                visible = _visible(ctx.pos, ctx.doc, rank, source, qs, ks) if kind == "masked" else None
                _block_backward(qh[..., qs, :], kh[..., ks, :], vh[..., ks, :], dh[..., qs, :], lse[..., qs],
                                delta[..., qs], visible, ctx.scale, ctx.softcap,
                                dq[..., qs, :], dk_block[..., ks, :], dv_block[..., ks, :])
            if grads_home is not None:  # add what the previous ranks gathered for this block
                (dk_before, dv_before), grad_requests = grads_home
                _wait(grad_requests)
                dk_block, dv_block = dk_block + dk_before, dv_block + dv_before
            if cp > 1:
                grads_home = _post_ring_exchange([dk_block, dv_block], group)
            if step < cp - 1:
                _wait(kv_requests)
                k_block, v_block = k_next, v_next
        if cp > 1:  # after cp steps the accumulators that arrive are this rank's own keys' and values'
            (dk_block, dv_block), grad_requests = grads_home
            _wait(grad_requests)

        B, T, H, D = q.shape
        dq = dq.permute(0, 3, 1, 2, 4).reshape(B, T, H, D).to(q.dtype)  # (B, T, H, D)
        dk = dk_block.transpose(1, 2).to(k.dtype)  # (B, T, H_kv, D)
        dv = dv_block.transpose(1, 2).to(v.dtype)  # (B, T, H_kv, D_v)
        return dq, dk, dv, None, None, None, None, None, None


@torch.compiler.disable  # host-side plans and point-to-point messages: torch.compile runs around it, not through
def ring_attention(q, k, v, positions, group=None, softcap=0.0, scale=None, documents=None, chunks=2):
    """Causal attention of this rank's queries over the keys and values of every rank of the cp group.

    q: (B, T_local, H, D), k: (B, T_local, H_kv, D), v: (B, T_local, H_kv, D_v), H a multiple of H_kv
    (D_v may differ from D, as in MLA). positions: every cp rank's global token positions, on the host,
    (cp, T_local) or (cp, B, T_local) (split_for_every_rank builds it); this rank's queries are row
    `rank`, and a key is visible to a query when its position is not greater. documents (optional, same
    shape): document ids; a key is then visible only within its document (the positions then restart at
    0 with each document, as RoPE wants).
    Scores are q k^T * scale (default 1/sqrt(D)), soft-capped to softcap * tanh(s / softcap) when
    softcap > 0. chunks: the pieces each rank's tokens are cut into when deciding which pairs to skip (2:
    the zigzag's two chunks). group None is one process: ordinary causal attention.
    Returns (B, T_local, H, D_v); a query that sees no key gets zeros."""
    cp = group_size(group)
    B, T, H, D = q.shape
    if k.shape[:2] != (B, T) or v.shape[:3] != k.shape[:3] or k.shape[-1] != D or H % k.shape[2] != 0:
        raise ValueError(f"ring_attention wants q (B, T, H, D), k (B, T, H_kv, D), v (B, T, H_kv, D_v) with H a "
                         f"multiple of H_kv; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    for name, x in (("positions", positions), ("documents", documents)):
        if x is None:
            continue
        if x.device.type != "cpu":
            raise ValueError(f"{name} must be on the host (device cpu, got {x.device}): which blocks to skip is "
                             f"decided from it there, without a device sync")
        if x.shape not in ((cp, T), (cp, B, T)):
            raise ValueError(f"{name} must be (cp, T_local) = ({cp}, {T}) or (cp, B, T_local) = ({cp}, {B}, {T}), "
                             f"one row per cp rank (see split_for_every_rank); got {tuple(x.shape)}")
    positions = positions if positions.dim() == 3 else positions[:, None]  # (cp, B or 1, T_local)
    if documents is not None and documents.dim() == 2:
        documents = documents[:, None]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    return RingAttention.apply(q, k, v, positions, documents, group, softcap, scale, chunks)


# -----------------------------------------------------------------------------
# 4. Pipeline parallelism
#
# Each stage holds a contiguous run of blocks (the first also the embedding, the last the final norm, the
# head and the loss). A step's batch is cut into m microbatches, the gradient-accumulation steps, which go
# through the stages like work down an assembly line: a stage receives a microbatch's activations from the
# previous stage, runs its blocks, sends the result on; in the backward pass the gradient of those
# activations comes back from the next stage and the gradient of the stage's input goes to the previous.
# While the line fills and drains some stages wait: with every forward and backward taking the same time,
# the idle share of a step, the "bubble", is (pp - 1) / (m + pp - 1) (GPipe, section 2.2).
#
# A schedule is written once, as each pipeline rank's ordered list of actions (op, i, c): run op for
# microbatch i on the rank's model chunk c. `run_schedule` walks that list on a real rank; `schedule_timeline`
# (at the end of this file) places the very same lists in time slots for the printed picture. A rank keeps
# a microbatch's activations from its forward to its backward, so the order also decides the memory:
#   afab              all forward, all backward (GPipe): all m microbatches held at the turn
#   1f1b              one forward, one backward (PipeDream-Flush): the same bubble, pp - stage held
#   interleaved_1f1b  v chunks per rank: the bubble (pp - 1) / (v m + pp - 1) (Narayanan et al. 2021,
#                     section 2.2.2)
#   zero_bubble       ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.1): the backward
#                     split in two, and the weights' half fills 1F1B's idle slots: (pp - 1) / (3 m + pp - 1)
#   zbv               ZB-V (same paper, section 6): two chunks per rank in a V, only the fill's pp - 1
#                     chunk-slots idle (with forward = input backward = weight backward in time)
#
# Chunks ("virtual stages"). With v chunks per rank the layers are cut into pp * v model stages and rank r
# holds stages r, r + pp, r + 2 pp, ... (zbv: r and 2 pp - 1 - r, so the last rank turns the V round and
# rank 0 holds both ends of the model). A microbatch then goes round the ring of ranks v times, each time
# through a v-th of the layers: the fill and the drain take chunk-sized slots, a v-th of a stage's, for v
# times the point-to-point messages. A rank's chunks are one Transformer (model.py) whose parameters keep
# their whole-model names, so the optimizer, the gradient norm and the checkpoints see one set of parameters
# whatever v is, and a checkpoint moves between any chunkings.
#
# The split backward (zero_bubble, zbv). A backward computes the gradient of the stage's input, which the
# previous stage waits for, and the gradients of the weights, which nothing needs before the optimizer step.
# For a linear layer y = x W^T they are dx = dy W and dW = dy^T x. The action 'B' computes dx and keeps x and
# dy; 'W' computes dW from them later (WeightGradStore below): the same matmuls as one backward, none twice.
# Parameters other than the tensor-parallel linears' weights (norm gains, the embedding, a router, a
# row-parallel bias) are cheap and get their gradients in B. In a list without 'W' actions, 'B' is the
# whole backward.
#
# The executor's exchanges. A rank sends what an action produced (a forward's output to the next stage, a
# backward's input gradient to the previous) as soon as the action ends, without waiting for the send to
# complete, and posts the receive of its next action's input before it runs the current one: a rank only
# ever waits for an input it needs now. Messages between two ranks travel in two first-in first-out
# channels, one per kind (activations on the default group, gradients on a second group, so NCCL, which has
# no tags, keeps them apart too); both ranks walk their lists in order, so what one sends k-th on a channel
# is what the other receives k-th: the lists themselves must agree on that order, which schedule_timeline
# checks, together with "no rank waits forever", without processes. Between two chunks of one rank (the V's
# turn) the message is handed over in memory. All sends are waited for at the end of the step.
#
# NCCL's rule: the first batch_isend_irecv that uses a process group must be joined by every rank of that
# group. PipelineComm's constructor therefore runs a barrier on each of its two groups, which every rank
# reaches while it builds its pipeline, so no point-to-point exchange is ever a group's first collective.
# Gloo has no such rule; the barriers cost nothing that matters.


def virtual_stages(schedule, pp, rank, chunks=1):
    """The model stages (of pp * chunks) that pipeline rank `rank` holds, one per chunk in chunk order:
    rank, rank + pp, rank + 2 pp, ..., or for zbv's V rank and 2 pp - 1 - rank."""
    if schedule == "zbv":
        return (rank, 2 * pp - 1 - rank)
    return tuple(rank + c * pp for c in range(chunks))


def message_route(op, stage, n_stages):
    """(the stage that action `op` on model stage `stage` receives its input from, the stage it sends its
    product to): a forward reads stage - 1's output and feeds stage + 1, a backward reads stage + 1's input
    gradient and feeds stage - 1, a weight-gradient action neither. None past either end of the model. The
    executor and the timeline simulator both route by this, so what is drawn is what runs."""
    if op == "W":
        return None, None
    src, dst = (stage - 1, stage + 1) if op == "F" else (stage + 1, stage - 1)
    return (src if 0 <= src < n_stages else None), (dst if 0 <= dst < n_stages else None)


def afab_actions(pp, stage, m, chunks=1):
    """GPipe, all forward then all backward: simple, but at the turn every stage holds the activations of
    all m microbatches."""
    return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]


def one_f_one_b_actions(pp, stage, m, chunks=1):
    """1F1B (PipeDream-Flush): a stage runs a microbatch's backward as soon as its gradient can have come
    back, so it never holds more than pp - stage microbatches' activations, whatever m is."""
    # warm-up: forwards only. Microbatch 0 must still go through the pp - stage - 1 later stages and come
    # back before its backward can run here: fill that wait with as many forwards (Megatron's
    # num_warmup_microbatches), or all m when there are fewer
    warmup = min(pp - stage - 1, m)
    actions = [("F", i, 0) for i in range(warmup)]
    # steady state: each new forward is followed by the oldest waiting backward
    for i in range(m - warmup):
        actions += [("F", warmup + i, 0), ("B", i, 0)]
    # cool-down: the backwards of the microbatches still in flight
    actions += [("B", i, 0) for i in range(m - warmup, m)]
    return actions


def interleaved_order(pp, m, chunks):
    """The order of a rank's forwards under interleaving, as (microbatch, chunk): microbatches in groups of
    pp, each group through chunk 0, then chunk 1, ... A group of pp fills the ring exactly: when the rank has
    sent the group's last microbatch on, the first is back from its lap, ready for the next chunk. (With m
    not a multiple of pp the last group is smaller: evaluation's forwards only.)"""
    order = []
    for start in range(0, m, pp):
        group = range(start, min(start + pp, m))
        order += [(i, c) for c in range(chunks) for i in group]
    return order


def interleaved_1f1b_actions(pp, stage, m, chunks):
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2): 1F1B over chunk-sized work. The k-th forward
    is interleaved_order's k-th; the k-th backward takes the same microbatch through the chunks in reverse,
    the last chunk first. m must be a multiple of pp (check_schedule): a smaller last group would reach a
    chunk before the previous lap's microbatches have come round."""
    order = interleaved_order(pp, m, chunks)
    forwards = [("F", i, c) for i, c in order]
    backwards = [("B", i, chunks - 1 - c) for i, c in order]
    # warm-up: microbatch 0 makes v - 1 laps of the ring (pp forwards each) before its last chunk, then, as
    # in 1F1B, goes through the pp - stage - 1 later ranks and back. Megatron's warm-up has 2 (pp - stage - 1)
    # for this last part: slack for its synchronous sends, which the executor here does not need (it never
    # waits for a send); with the smaller warm-up the first rank holds v pp chunk-sized microbatches, the pp
    # whole ones of 1F1B, where Megatron's holds (1 + (pp - 1) / (v pp)) times that (Korthikanti et al. 2022,
    # "Reducing Activation Recomputation in Large Transformer Models", section 4.2.3). The bubble is the same.
    warmup = min((chunks - 1) * pp + pp - stage - 1, len(order))
    actions = forwards[:warmup]
    for k in range(len(order) - warmup):
        actions += [forwards[warmup + k], backwards[k]]
    return actions + backwards[len(order) - warmup:]


def zero_bubble_actions(pp, stage, m, chunks=1):
    """ZB-H1 (Qi et al. 2023, section 3.1): 1F1B with each backward split into B (the input's gradient, which
    the previous stage waits for) and W (the weights' gradients). B runs where 1F1B's backward ran; W waits:
    stage s leaves its first s microbatches' W for the end, where 1F1B's cool-down leaves the later stages
    idle, and runs each later W right after its B. With forward = B = W in time the bubble is
    (pp - 1) / (3 m + pp - 1) for m >= pp, a third of 1F1B's; a stage holds at most pp microbatches between
    F and W (1F1B's first stage's count), and what it holds after B is only the linears' x and dy."""
    warmup = min(pp - stage - 1, m)
    actions = [("F", i, 0) for i in range(warmup)]
    f, b, w = warmup, 0, 0
    delayed = min(stage, m - warmup)  # the microbatches whose W is left for the cool-down
    for _ in range(delayed):
        actions += [("F", f, 0), ("B", b, 0)]
        f, b = f + 1, b + 1
    while f < m:  # steady state: F B W
        actions += [("F", f, 0), ("B", b, 0), ("W", w, 0)]
        f, b, w = f + 1, b + 1, w + 1
    while b < m:  # cool-down: the remaining backwards, each with a W
        actions += [("B", b, 0), ("W", w, 0)]
        b, w = b + 1, w + 1
    return actions + [("W", i, 0) for i in range(w, m)]  # the delayed W's, in the drain's idle slots


def zbv_actions(pp, stage, m, chunks=2):
    """ZB-V (Qi et al. 2023, section 6): two chunks per rank in a V (virtual_stages), the backward split as in
    zero_bubble. Rank r's chunk 0 is model stage r, its chunk 1 stage 2 pp - 1 - r: microbatches go down the
    ranks through the chunks 0 and come back up through the chunks 1, so the last rank runs both halves of the
    turn and rank 0 both ends of the model. In phases (with forward = B = W in time each slot is filled):
      1. 2 (pp - r) - 1 forwards of chunk 0 (the deeper the rank, the sooner its chunk 1 gets work);
      2. r pairs (chunk 1 forward, chunk 0 forward) while the V's second arm fills;
      3. pp - r triples (chunk 1 forward, B, W): the turn comes back;
      4. steady state: chunk 0's F, B, W, then chunk 1's, until every forward is done;
      5. cool-down: r pairs of B (chunks 0 and 1), then pp - r of (chunk 0's B, W), then the rest of the W's.
    The phases are written for at least 2 pp - 1 microbatches; with fewer, the actions of the microbatches
    that do not exist are left out (schedule_timeline checks the rest still runs)."""
    n = max(m, 2 * pp - 1)
    count = {(op, c): 0 for op in "FBW" for c in (0, 1)}  # the next microbatch of each op on each chunk
    actions = []

    def add(op, c, microbatch=None):
        i = count[(op, c)] if microbatch is None else microbatch
        count[(op, c)] = i + 1
        actions.append((op, i, c))

    for _ in range(2 * (pp - stage) - 1):
        add("F", 0)
    for _ in range(stage):
        add("F", 1), add("F", 0)
    for _ in range(pp - stage):
        add("F", 1), add("B", 1), add("W", 1)
    while count[("F", 1)] < count[("F", 0)] or count[("F", 0)] < n:
        if count[("F", 0)] < n:
            add("F", 0)
        add("B", 0), add("W", 0), add("F", 1), add("B", 1), add("W", 1)
    for _ in range(stage):
        add("B", 0), add("B", 1)
    for _ in range(pp - stage):
        add("B", 0), add("W", 0)
    while count[("W", 1)] < count[("B", 1)]:
        add("W", 1)
    while count[("W", 0)] < count[("B", 0)]:
        add("W", 0)
    return [a for a in actions if a[1] < m]


SCHEDULES = {"afab": afab_actions, "1f1b": one_f_one_b_actions, "interleaved_1f1b": interleaved_1f1b_actions,
             "zero_bubble": zero_bubble_actions, "zbv": zbv_actions}


def check_schedule(schedule, pp, m, chunks=1):
    """Stop before anything is built when a schedule cannot run this way (a wrong list would hang between
    ranks, or send a microbatch's activations to another's), saying what must hold and what to change."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pp_schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")
    if pp == 1:
        if chunks > 1:
            raise ValueError(f"pp_chunks = {chunks} needs a pipeline: with pp = 1 one rank holds the whole model "
                             f"(set --pp to 2 or more, or --pp_chunks=1)")
        return
    if schedule == "zbv" and chunks != 2:
        raise ValueError(f"pp_schedule='zbv' holds two model chunks on each rank (the V): set --pp_chunks=2 "
                         f"(got {chunks})")
    if schedule in ("afab", "1f1b", "zero_bubble") and chunks != 1:
        raise ValueError(f"pp_chunks = {chunks}: pp_schedule={schedule!r} runs one model chunk per rank; use "
                         f"--pp_schedule=interleaved_1f1b for {chunks} chunks per rank (or --pp_chunks=1)")
    if schedule == "interleaved_1f1b" and m % pp:
        lower, upper = max(pp, m // pp * pp), (m // pp + 1) * pp
        raise ValueError(f"pp_schedule='interleaved_1f1b' needs gradient_accumulation_steps (the microbatches, "
                         f"{m}) to be a multiple of pp = {pp}: they go round the ring of ranks in groups of pp "
                         f"(Megatron-LM's rule); use {lower}" + (f" or {upper}" if upper != lower else "")
                         + ", adjusting batch_size to keep the batch")


def ideal_bubble(schedule, pp, m, chunks=1):
    """The paper's idle share of a step, with forward = B = W in time (an unsplit backward twice a
    forward), or None where the paper gives no formula (zbv; zero_bubble with m < pp)."""
    if schedule in ("afab", "1f1b"):
        return (pp - 1) / (m + pp - 1)
    if schedule == "interleaved_1f1b":
        return (pp - 1) / (chunks * m + pp - 1)
    if schedule == "zero_bubble" and m >= pp:
        return (pp - 1) / (3 * m + pp - 1)
    return None


def forward_only_actions(pp, stage, m, chunks=1):
    """Evaluation's forwards, for any m: in interleaved_order, which with one chunk is 0, 1, ..., m - 1."""
    return [("F", i, c) for i, c in interleaved_order(pp, m, chunks)]


class _LinearSplitBackward(torch.autograd.Function):
    """y = x W^T + b whose backward computes dx = dy W only, leaving (x, dy) in store.collecting for a later
    dW = dy^T x (and db = the sum of dy): WeightGradStore.linear. With store.collecting None (a backward outside
    a zero-bubble B action) it computes the weight's gradient at once, as a plain linear. Under autocast it
    computes in the autocast dtype, casting what F.linear's autocast would cast."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        with torch.autocast(device, enabled=False):
            x_c, w_c = x.to(dtype), weight.to(dtype)
            y = F.linear(x_c, w_c, None if bias is None else bias.to(dtype))
        ctx.save_for_backward(x_c, w_c)
        ctx.weight, ctx.bias, ctx.store = weight, bias, store
        return y

    @staticmethod
    def backward(ctx, dy):
        x_c, w_c = ctx.saved_tensors
        dy = dy.to(w_c.dtype)
        dx = dy @ w_c if ctx.needs_input_grad[0] else None  # (..., in): autograd casts it to x's dtype
        if ctx.store.collecting is not None:
            ctx.store.collecting.append((ctx.weight, ctx.bias, x_c, dy))
            return dx, None, None, None
        dw, db = WeightGradStore.weight_grads(x_c, dy, ctx.bias is not None)
        return dx, dw.to(ctx.weight.dtype), None if db is None else db.to(ctx.bias.dtype), None


class WeightGradStore:
    """The split backward of a model chunk's ColumnParallelLinear and RowParallelLinear layers (their
    `weight_grad_store`): between a microbatch's B and its W, each layer's input x and output gradient dy.

    run_schedule runs a B inside `collect(i)`, which keeps what the chunk's layers' backward leaves for
    microbatch i, and a W as `apply(i)`, which accumulates dW = dy^T x (db = sum of dy) into .grad by hand:
    no backward hook fires for those, so the caller is told (run_schedule's weight_grad_ready). `params`
    lists, in a fixed order, every parameter whose gradient W computes."""

    def __init__(self, modules):
        self.params, self.held, self.collecting = [], {}, None
        self.held_bytes = 0  # of the x and dy kept (each counted per layer): metrics.ActivationMemory reads it
        for module in modules:
            for layer in module.modules():
                if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
                    layer.weight_grad_store = self
                    self.params.append(layer.weight)
                    if isinstance(layer, ColumnParallelLinear) and layer.bias is not None:
                        self.params.append(layer.bias)
        self.params = list({id(p): p for p in self.params}.values())  # a tied head's weight is the embedding's

    def linear(self, x, weight, bias=None):
        if not torch.is_grad_enabled():  # evaluation: nothing to split
            return F.linear(x, weight, bias)
        return _LinearSplitBackward.apply(x, weight, bias, self)

    @contextmanager
    def collect(self, microbatch):
        self.collecting = []
        try:
            yield
            self.held[microbatch] = self.collecting
            self.held_bytes += sum(x.numel() * x.element_size() + dy.numel() * dy.element_size()
                                   for _, _, x, dy in self.collecting)
        finally:
            self.collecting = None

    @staticmethod
    def weight_grads(x, dy, with_bias):
        """dW = dy^T x over every token, (out, in), and db = the sum of dy over the tokens (None without bias)."""
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        return dy2.t() @ x2, (dy2.sum(0) if with_bias else None)

    @torch.no_grad()
    def apply(self, microbatch, ready=None):
        """W for one microbatch: accumulate each layer's dW (db) into .grad, calling ready(p), if given, as
        soon as p's gradient for this microbatch is in (after the last layer that uses p)."""
        held = self.held.pop(microbatch)
        last = {id(p): j for j, (weight, bias, _, _) in enumerate(held) for p in (weight, bias) if p is not None}
        for j, (weight, bias, x, dy) in enumerate(held):
            self.held_bytes -= x.numel() * x.element_size() + dy.numel() * dy.element_size()
            dw, db = self.weight_grads(x, dy, bias is not None)
            for p, g in ((weight, dw), (bias, db)):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g.to(p.dtype)
                else:
                    p.grad.add_(g.to(p.dtype))
                if ready is not None and last[id(p)] == j:
                    ready(p)


class PipelineComm:
    """What a pipeline rank needs to talk to the others: its index `stage` among the pp ranks, the global
    rank that holds each model stage (`stage_ranks`, pp * v of them), the model stage of each of its chunks
    (`chunk_stages`), and what travels between them: every message is a tensor of `dtype` and of the shape
    message_shape(x), x being the microbatch's token ids, which every stage has: so no shape or dtype is ever
    negotiated at run time. The caller chooses both; the model's is (batch, seq_len, hidden_size), which
    from_layout gives (seq_len that of x: under context parallelism this rank's T/cp tokens; under sequence
    parallelism a rank holds 1/tp of those between the tensor-parallel regions: seq_split = tp).

    The model's dtype is that of the residual stream, the parameters' dtype (fp32 under autocast too: the
    embedding output is fp32, and adding a bf16 sublayer output to it stays fp32). Sending bf16 instead would
    round the residual stream at every stage boundary, which one process never does.

    Activations travel on the default group, gradients on a second group of the whole world (the section's
    note). Every rank of the world must build its PipelineComm, in the same order: it builds that group and
    runs the barriers of NCCL's rule."""

    def __init__(self, stage, pp, stage_ranks, message_shape, dtype=torch.float32, device="cpu", chunk_stages=None,
                 timeout=None):
        self.stage, self.pp, self.stage_ranks = stage, pp, list(stage_ranks)
        self.chunk_stages = tuple(chunk_stages) if chunk_stages is not None else (stage,)
        self.n_stages = len(self.stage_ranks)
        self.message_shape, self.dtype, self.device = message_shape, dtype, torch.device(device)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.groups = {"F": None, "B": None}  # None: the default group
        if dist.is_initialized():
            dist.barrier()  # the first collective of the world group: not a batch_isend_irecv
            self.groups["B"] = dist.new_group(list(range(dist.get_world_size())), timeout=timeout,
                                              group_desc="pipeline gradients")
            dist.barrier(group=self.groups["B"])

    @classmethod
    def from_layout(cls, layout, hidden_size, device, dtype=torch.float32, schedule="1f1b", chunks=1, seq_split=1):
        """The channel of this rank's pipeline (its dp, cp and tp rank) under a schedule's chunk placement."""
        stage_ranks = {}
        for p in range(layout.pp):
            for s in virtual_stages(schedule, layout.pp, p, chunks):
                stage_ranks[s] = grid_rank(p, layout.dp_rank, layout.tp_rank, layout.dp, layout.tp,
                                           layout.cp_rank, layout.cp)
        return cls(layout.pp_rank, layout.pp, [stage_ranks[s] for s in range(len(stage_ranks))],
                   lambda x: (x.shape[0], x.shape[1] // seq_split, hidden_size), dtype, device,
                   virtual_stages(schedule, layout.pp, layout.pp_rank, chunks), layout.timeout)

    def is_here(self, stage):
        return self.stage_ranks[stage] == self.rank

    def send(self, tensor, kind, to_stage):
        """Post the send of a message of `kind` ('F': activations, 'B': gradients) to model stage to_stage;
        returns its request (wait for it before the step ends)."""
        op = dist.P2POp(dist.isend, tensor.to(self.dtype).contiguous(), self.stage_ranks[to_stage], self.groups[kind])
        return dist.batch_isend_irecv([op])[0]

    def receive(self, kind, from_stage, x):
        """Post the receive of a message of `kind` from model stage from_stage, for the microbatch of token ids
        x; returns (the tensor it fills, its request)."""
        buffer = torch.empty(self.message_shape(x), dtype=self.dtype, device=self.device)
        op = dist.P2POp(dist.irecv, buffer, self.stage_ranks[from_stage], self.groups[kind])
        return buffer, dist.batch_isend_irecv([op])[0]


def run_schedule(actions, model, microbatches, comm, autocast=nullcontext(), loss_multiplier=1.0,
                 set_grad_sync=None, weight_grad_stores=None, weight_grad_ready=None, trace=None, backward_done=None):
    """Run one pipeline rank's list of actions over microbatches [(x, y), ...] (token ids and targets; every
    rank has them, the first stage uses x, the last y, all take the message shapes from x). A microbatch may
    carry more, (x, y, positions) under context parallelism: every stage passes it on, chunk(x, y,
    positions), since every stage's attention needs the tokens' positions. Gradients accumulate in the
    rank's parameters. Returns this rank's part of the mean loss over the microbatches (a tensor): the loss
    on the chunk that ends the model, the auxiliary losses of the others (zero without one); summed over the
    ranks it is the loss one process reports.

    `model` is the rank's chunk, or a list of its chunks (comm.chunk_stages says which model stage each is):
    chunk(x, targets, *context) returns (output, loss): on the model's last stage the logits and the loss (cross-entropy
    plus any auxiliary loss of its blocks), elsewhere the hidden states and an auxiliary loss or None (a
    mixture-of-experts router's balance loss), which must be backpropagated from here.

    `set_grad_sync(bool)` is called before each backward action, B or W, True only before the last of its
    kind in its chunk: a data-parallel gradient reducer hooks in there to communicate once per step. A list
    with 'W' actions splits every backward: it needs `weight_grad_stores` (one WeightGradStore per chunk), and
    each W calls weight_grad_ready(p) for each parameter whose gradient it accumulated by hand, which no
    backward hook announces, as soon as it is in. `backward_done(op, c)` is called after every B and W
    action: ZeRO-2 and 3 reduce-scatter there each micro-batch's gradients that the action completed and
    nobody announced (parameters of chunk c; under a split backward, B's without and W's with
    weight_grad_stores[c].params). `trace(action)`, if given, returns a context manager wrapped around each
    action's computation (metrics.PipelineTrace times them). Without grad enabled (evaluation) give
    forwards only: nothing is kept for a backward."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    m, last_stage = len(microbatches), comm.n_stages - 1
    last_backward = {c: k for k, (op, _, c) in enumerate(actions) if op == "B"}  # each chunk's last
    last_weight = {c: k for k, (op, _, c) in enumerate(actions) if op == "W"}
    if last_weight and weight_grad_stores is None:
        raise ValueError("these actions split the backward into B and W: give run_schedule weight_grad_stores, one "
                         "WeightGradStore per chunk (built before the chunk's first forward)")
    inputs, outputs = {}, {}  # (microbatch, chunk) -> what its backward needs, from its forward until then
    here = {}  # messages from one chunk of this rank to another (the V's turn), by (kind, microbatch, stage)
    sends = []  # the requests of the sends in flight (each holds its tensor), waited for at the end
    total = torch.zeros((), dtype=at_least_fp32(comm.dtype), device=comm.device)

    def post_receive(action):
        """Post the receive of action's input if another rank sends it: (buffer, request) or None."""
        op, i, c = action
        source, _ = message_route(op, comm.chunk_stages[c], comm.n_stages)
        if source is None or comm.is_here(source):
            return None
        return comm.receive(op, source, microbatches[i][0])

    def take_input(action, posted):
        """Action's input: received (waiting for it now), handed over from this rank's other chunk, or None."""
        op, i, c = action
        if posted is not None:
            buffer, request = posted
            try:
                request.wait()  # sync point: the input must have arrived
            except RuntimeError as e:  # the sending rank died or stopped answering: say which, and what for
                source, _ = message_route(op, comm.chunk_stages[c], comm.n_stages)
                what = "activations" if op == "F" else "output gradient"
                raise RuntimeError(f"pipeline stage {comm.chunk_stages[c]} (rank {comm.rank}) waited for the {what} "
                                   f"of microbatch {i} from stage {source} (rank {comm.stage_ranks[source]}): {e}") from e
            return buffer
        return here.pop((op, i, comm.chunk_stages[c]), None)

    def deliver(action, product):
        op, i, c = action
        _, destination = message_route(op, comm.chunk_stages[c], comm.n_stages)
        if destination is None or product is None:
            return
        if comm.is_here(destination):
            here[(op, i, destination)] = product
        else:
            sends[:] = [request for request in sends if not request.is_completed()]  # their buffers can go
            sends.append(comm.send(product, op, destination))

    posted = post_receive(actions[0]) if actions else None
    for k, action in enumerate(actions):
        op, i, c = action
        stage = comm.chunk_stages[c]
        received = take_input(action, posted)
        posted = post_receive(actions[k + 1]) if k + 1 < len(actions) else None  # lands while this one runs
        product = None
        with trace(action) if trace is not None else nullcontext():
            if op == "F":
                x, y, *context = microbatches[i]
                if stage > 0:
                    x = received.requires_grad_(torch.is_grad_enabled())  # its .grad is what goes back
                with autocast:
                    out, loss = chunks[c](x, y if stage == last_stage else None, *context)
                if loss is not None:
                    loss = loss / m  # the mean over microbatches: the one place the loss is scaled
                    total += loss.detach().to(at_least_fp32(loss.dtype))
                if torch.is_grad_enabled():
                    inputs[(i, c)], outputs[(i, c)] = x, (None if stage == last_stage else out, loss)
                product = None if stage == last_stage else out.detach()
            elif op == "B":
                if set_grad_sync is not None:
                    set_grad_sync(k == last_backward[c])
                x, (out, loss) = inputs.pop((i, c)), outputs.pop((i, c))
                split = weight_grad_stores[c].collect(i) if c in last_weight else nullcontext()
                with split:
                    if stage == last_stage:
                        (loss * loss_multiplier).backward()
                    else:
                        # the output's gradient from the next stage, plus this stage's own auxiliary loss if any
                        tensors, grads = [out], [received.to(out.dtype)]
                        if loss is not None:
                            tensors, grads = tensors + [loss * loss_multiplier], grads + [None]
                        torch.autograd.backward(tensors, grads)
                product = None if stage == 0 else x.grad
            else:  # W: the weights' gradients from what B kept
                if set_grad_sync is not None:
                    set_grad_sync(k == last_weight[c])
                weight_grad_stores[c].apply(i, weight_grad_ready)
            if op != "F" and backward_done is not None:
                backward_done(op, c)
        deliver(action, product)
    for request in sends:
        request.wait()
    return total


@torch.no_grad()
def pipeline_forward(model, microbatches, comm, autocast=nullcontext()):
    """Forward only (evaluation): every microbatch through the stages; returns this rank's part of the
    mean loss, as run_schedule (model: the rank's chunk or list of chunks, as there)."""
    actions = forward_only_actions(comm.pp, comm.stage, len(microbatches), len(comm.chunk_stages))
    return run_schedule(actions, model, microbatches, comm, autocast)


def tied_weight_group(layout, holder_stages):
    """The process group of the pipeline stages `holder_stages` (say the first and the last) of this rank's
    pipeline (same dp, cp and tp rank), or None when one stage holds every copy. Every rank must call this, in
    the same order: every group is built by every rank."""
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
    """Make the copies of one tied weight take the same step, the step of the single shared matrix in one
    process: its gradient is the sum of every copy's (one from the input side, the embedding; one from the
    output side, the head). `copies` are the copies this rank holds (none, one, or several when one rank
    holds two model chunks that each have one), `group` the ranks holding the others (None: all are here).
    Call it after the step's last backward (and W), before the gradients are averaged across data-parallel
    ranks."""
    if not copies:
        return
    # a new tensor (sum starts from 0): the copies' own gradients are replaced, never reduced in place
    total = sum(w.grad if w.grad is not None else torch.zeros_like(w) for w in copies)
    if group is not None:
        dist.all_reduce(total, group=group)
    for i, w in enumerate(copies):
        w.grad = total if i == 0 else total.clone()


# -----------------------------------------------------------------------------
# 5. Data parallelism and ZeRO-1, 2, 3
#
# Every data-parallel rank holds the same parameters and runs its own slice of the global batch, so its
# gradient is the mean over its slice; the mean over the whole batch is the average of the ranks'
# gradients. Averaging is one collective per bucket of parameters, launched from a backward hook the
# moment the bucket's last gradient is ready, so the communication of the layers near the output runs
# while backward is still computing the layers near the input (the overlap DistributedDataParallel has;
# Li et al. 2020, "PyTorch Distributed", section 3.2.3). Under context parallelism (section 3) the ranks of a
# cp group hold the same parameters too, each with the gradient of its share of every sequence: gradients
# are then averaged, and ZeRO shards, over the dp x cp ranks (layout.dp_cp_group), "dp" below its size.
#
# ZeRO stage 1 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
# Models", section 5.1) keeps that, but each rank keeps the AdamW moments of only 1/dp of the elements:
# the gradients are reduce-scattered (each rank receives the average of its own slice only), each rank
# updates its slice of the parameters, and the updated slices are all-gathered so that every rank holds
# the whole model again. Compared with all-reduce + AdamW the communication volume is the same (an
# all-reduce is a reduce-scatter followed by an all-gather), the optimizer memory is 1/dp. Gloo (CPU) has
# no native reduce-scatter: since torch 2.3 torch runs it there as an all-reduce followed by keeping one
# chunk, so on CPU the gradient step costs what plain data parallelism's does, on NCCL half of it.
#
# The slices are cut from each bucket's flat buffer, padded to a multiple of dp, not handed out tensor by
# tensor: every rank gets the same number of elements (within the padding), whatever the tensor sizes.
#
# ZeRO stage 2 (section 5.2) keeps only the owned slice of the gradients as well. Holding them whole
# until the last micro-batch would be ZeRO-1's memory, so every micro-batch's gradients are
# reduce-scattered and added into the slice (DeepSpeed's way: with m micro-batches, m times ZeRO-1's
# reduce traffic); each bucket's flat buffer lives only from its first gradient until its reduce-scatter
# has landed (at most two launched buckets are waited for at a time), and p.grad is dropped the moment it
# is copied into its bucket. After the step the updated slices are all-gathered, as in ZeRO-1, two
# buckets at a time. ZeRO-3 (section 5.3) follows, after GradientBuckets.
#
# Under a pipeline schedule (section 4) a micro-batch's gradient of a parameter is complete after the
# backward action that writes it, and that is when it is sent: each action (op, chunk) is a "phase", a
# bucket holds the parameters of one phase only, and after every B and W action the executor calls
# backward_done(op, chunk), which launches the buckets of that phase the hooks did not. So:
#   afab, 1f1b        one chunk, B the whole backward: every bucket after each micro-batch's B
#   interleaved_1f1b  B of chunk c sends chunk c's buckets: each chunk's buckets are its own, and a
#                     micro-batch's are sent v times over, a chunk at a time
#   zero_bubble, zbv  B sends the parameters autograd gives gradients to (norm gains, the embedding, the
#                     chunked loss's head, biases of row-parallel layers); W sends the tensor-parallel
#                     linears' weights it computes (WeightGradStore.params), when it runs, however late
# Every bucket is thus launched once per micro-batch for each action that writes it, in the same order on
# every rank (the ranks of a dp group run the same action list). One parameter is written by two actions:
# under zbv with tied embeddings rank 0 holds both ends of the model, and its one embedding-and-head
# matrix, alone in a bucket, is sent after each of them (each part once).
#
# A bucket is one flat tensor, so it holds parameters of one dtype only: a parameter whose dtype differs
# from the one before it starts a new bucket. Its collective runs over one group: parameters that are
# averaged over another group than the data-parallel one (the experts under expert parallelism, section 6)
# fill buckets of their own.
#
# The buckets are launched in their order, the same on every rank, even when they fill in another order:
# collectives on a group must be issued in the same order by every rank, and the order gradients arrive
# in depends on the data (an MoE expert that got tokens on one replica and none on another has a gradient
# during backward on the first, only in finish() on the second). A bucket that is full waits for the ones
# before it (as DistributedDataParallel's reducer does); out of order, two ranks would add up different
# buckets, a mismatch error when their sizes differ and silently wrong gradients when they do not.


class _Bucket:
    """A group of parameters whose gradients travel as one flat tensor over `group`. Under sharding it is
    either sliced evenly across the group's ranks (padded to a multiple of its size: ZeRO-1), or it has an
    `owner`, the one rank of the group that gets all of it (whole matrices for Muon, section 7).
    transient (ZeRO-2 and ZeRO-3, even slices only): the flat gradient exists only from the first gradient
    copied in until its reduce-scatter has finished; what persists is `grad_shard`, this rank's slice of
    the mean gradient. Under ZeRO-3 a bucket is also a unit of parameters: `param_shard` the elements this
    rank stores, `param_full` the gathered whole (its storage empty between uses)."""

    def __init__(self, params, group, owner=None, transient=False):
        if owner is not None and transient:
            raise ValueError("a bucket reduced whole to one owner keeps its flat gradient: it cannot be transient")
        self.params, self.group, self.owner = params, group, owner
        self.world, self.rank = group_size(group), group_rank(group)
        self.offsets, n = [], 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.shard_size = (n + self.world - 1) // self.world if owner is None else n  # elements one rank owns
        self.flat = None if transient else self.new_flat()
        self.grad_shard = None
        self.param_shard = self.param_full = self.gather = None
        self.keep_whole = self.in_backward = False
        self.phases = frozenset()  # the backward actions that write its gradients (GradientBuckets sets them)
        self.reset()

    def new_flat(self):
        size = self.shard_size * self.world if self.owner is None else self.numel
        return torch.zeros(size, dtype=self.params[0].dtype, device=self.params[0].device)

    def owned(self):
        """The range of `flat` this rank owns under sharding (empty on a whole bucket's other ranks)."""
        if self.owner is None:
            return self.rank * self.shard_size, (self.rank + 1) * self.shard_size
        return (0, self.numel) if self.rank == self.owner else (0, 0)

    def reset(self):
        self.ready = set()  # indices of the parameters whose gradient is in `flat`
        self.work = None  # the in-flight collective
        self.shard = None  # with even slices: the reduced gradient of this rank's slice


class GradientBuckets:
    """Averages the gradients of `params` across the data-parallel `group`, in buckets of about
    bucket_size_mb launched asynchronously from backward hooks (Tensor.register_post_accumulate_grad_hook).

    Before each micro-batch's backward, call set_grad_sync(False) for the gradient-accumulation micro-steps
    (gradients just accumulate locally, no communication) and set_grad_sync(True) for the last one. After
    backward, finish() waits for the collectives and leaves in every p.grad:
        shard=False: the average gradient (all-reduce);
        shard=True:  the average gradient on the elements this rank owns, zero elsewhere (reduce-scatter),
                     for ZeRO-1; `owned_pieces()` says which elements those are.
    `deferred` parameters are not synced from the hooks but in finish(): a gradient that still changes
    after backward (a tied embedding whose pipeline stages add their copies' gradients) must be complete
    before it is reduced, so call finish() after that addition.

    A gradient accumulated by hand, outside autograd (the zero-bubble schedules' W actions), is announced
    instead: name those parameters with by_hand(params) (autograd still runs their hooks during B, with
    no gradient or a partial one: those hooks are removed), then call grad_ready(p) once p's gradient is
    complete (set_grad_sync(True) before the action that completes it, as for a backward), on every
    data-parallel rank in the same order.

    `expert_params` are summed over `expert_group` instead (expert parallelism, section 6: the ranks that
    hold the same experts), and divided by the size of `group` too: an expert's gradient on each rank is
    already the sum over the ep ranks that sent it tokens, so its sum over expert_group is the sum over all
    of `group`. With expert_group the same as group they are buckets like any other.

    `owners` ({param: rank of group}, with shard=True) sends those parameters' gradients whole to one rank
    each instead of slicing them: they travel in buckets of their own, one owner per bucket, reduced to the
    owner (dist.reduce) instead of reduce-scattered. After the optimizer step, gather_params() brings every
    rank the parameters the others updated.

    every_microbatch=True (ZeRO-2 and 3, with shard=True, no owners): every micro-batch's gradients are
    reduce-scattered, each added into the bucket's `grad_shard`, and p.grad is dropped as soon as it is
    copied into its bucket, so that no full-size gradient lives beyond the two buckets in flight
    (set_grad_sync's argument is ignored: calling it before a backward lands the buckets still in flight,
    whose flat buffers would otherwise add to that backward's peak). Call backward_done(op, chunk) after
    each backward action: `phases` ({param: the actions (op, chunk) that write its gradient}; by default
    ("B", 0) for all, one plain backward) says which buckets each action completes, and no bucket mixes
    parameters of different phases; the hooks (and grad_ready for a gradient accumulated by hand) launch
    the buckets that fill during the action, backward_done the rest; a parameter that two actions write,
    alone in its bucket, is sent by backward_done after each. p.grad is None after finish(): the
    gradients are the grad_shards. `units` (ZeRO-3): lists of parameters, in forward order, one bucket
    each, each of one phase (two where a unit holds experts over their own group: the experts, then the
    rest). `alone`: parameters that get a bucket of their own (a tied weight whose shards are summed
    across pipeline stages: both copies must be cut the same way)."""

    def __init__(self, params, group, bucket_size_mb=25.0, shard=False, deferred=(), expert_params=(),
                 expert_group=None, owners=None, every_microbatch=False, units=None, alone=(), phases=None):
        if every_microbatch and owners:
            raise ValueError("GradientBuckets: every_microbatch (ZeRO-2/3) keeps even slices only, not whole owners")
        self.group, self.shard, self.every_microbatch = group, shard, every_microbatch
        self.dp, self.dp_rank = group_size(group), group_rank(group)
        self.sync = True
        self.on_launch = None  # ZeRO-3: frees a unit's gathered parameters once its gradients are sent
        deferred_ids = self.deferred_ids = {id(p) for p in deferred}
        alone_ids = {id(p) for p in alone}
        expert_ids = {id(p) for p in expert_params} if expert_group is not group else set()
        params = [p for p in params if p.requires_grad]

        def phase_of(p):
            if phases is not None and not phases.get(p):
                raise ValueError(f"GradientBuckets: phases names no backward action for a parameter of shape "
                                 f"{tuple(p.shape)}")
            return frozenset(phases[p]) if phases is not None else frozenset({("B", 0)})

        early = [p for p in params if id(p) not in deferred_ids]
        late = [p for p in params if id(p) in deferred_ids]
        make = lambda ps, group, owner=None: _Bucket(ps, group, owner, transient=every_microbatch)
        # backward produces gradients roughly in the reverse order of the forward pass: bucket them that way,
        # filling one bucket for each kind (its group, its owner if it goes whole to one rank, the actions
        # that write it) at a time, in the order the buckets fill up
        owners = owners or {}
        self.buckets, capacity = [], max(1, int(bucket_size_mb * 2 ** 20))
        if units is not None:  # one bucket per unit, in backward order; a unit's experts (over expert_group)
            for u in reversed(units):  # in one of their own, first: their gradients come first in its backward
                experts, rest = [p for p in u if id(p) in expert_ids], [p for p in u if id(p) not in expert_ids]
                self.buckets += [make(ps, g) for ps, g in ((experts, expert_group), (rest, group)) if ps]
        filling = {}  # (group, owner, phases) -> (its parameters so far, their bytes)
        for p in reversed(early) if units is None else []:
            kind = (expert_group if id(p) in expert_ids else group, owners.get(p), phase_of(p))
            current, size = filling.get(kind, ([], 0))
            if current and (p.dtype != current[0].dtype or id(p) in alone_ids):  # one dtype per flat buffer
                self.buckets.append(make(current, *kind[:2]))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= capacity or id(p) in alone_ids:
                self.buckets.append(make(current, *kind[:2]))
                current, size = [], 0
            filling[kind] = (current, size)
        self.buckets += [make(current, *kind[:2]) for kind, (current, _) in filling.items() if current]
        for owner in dict.fromkeys(owners.get(p) for p in late):
            mine = [p for p in late if owners.get(p) == owner]
            for dtype in dict.fromkeys(p.dtype for p in mine):
                self.buckets.append(make([p for p in mine if p.dtype == dtype], group, owner))
        self.where = {}
        for b in self.buckets:
            b.phases = phase_of(b.params[0])
            if any(phase_of(p) != b.phases for p in b.params):
                raise ValueError("GradientBuckets: a unit mixes parameters that different backward actions complete")
            for i, p in enumerate(b.params):
                self.where[p] = (b, i)
        # each phase's buckets in bucket order (a parameter written by two actions, alone, is in both), and
        # the next of them to launch in the action now running
        self.phase_buckets = {}
        for b in self.buckets:
            for phase in sorted(b.phases):
                self.phase_buckets.setdefault(phase, []).append(b)
        self.next = dict.fromkeys(self.phase_buckets, 0)
        self.in_flight = []  # every_microbatch: launched buckets not yet added into their grad_shard
        self.hooks = {id(p): p.register_post_accumulate_grad_hook(self.grad_ready) for p in early}
        self.launched = 0  # collectives launched since the last finish(); tests read it

    def set_grad_sync(self, sync):
        self.sync = sync
        if self.every_microbatch:  # a backward begins: land what the last one left in flight, before its peak
            for bucket in self.in_flight:
                self._settle(bucket)
            self.in_flight = []

    def by_hand(self, params):
        for p in params:
            hook = self.hooks.pop(id(p), None)
            if hook is not None:
                hook.remove()

    def grad_ready(self, p):
        """p.grad is complete for this step (every_microbatch: for this micro-batch), said by its hook or by
        hand: copy it into its bucket, launching the bucket once it is full. Nothing in a gradient-accumulation
        micro-step (set_grad_sync(False)); a deferred parameter waits for finish(), one that two actions write
        for backward_done."""
        if not (self.sync or self.every_microbatch) or id(p) in self.deferred_ids:
            return
        bucket, i = self.where[p]
        if len(bucket.phases) > 1:
            return
        if i in bucket.ready:
            raise RuntimeError("a gradient became ready twice in one synchronised step: call set_grad_sync(False) "
                               "before the backward of every micro-batch but the last")
        self._copy_in(bucket, i)
        # launch, in its phase's bucket order, every bucket that is full and has only launched buckets before it
        (phase,) = bucket.phases
        buckets = self.phase_buckets[phase]
        while self.next[phase] < len(buckets) and self._full(buckets[self.next[phase]]):
            self.next[phase] += 1
            self._launch(buckets[self.next[phase] - 1])

    def backward_done(self, op, chunk):
        """every_microbatch: the backward action (op, chunk) of a micro-batch has run: launch, in order, the
        buckets of its phase that its hooks did not (a parameter without a gradient sends zeros). Every
        rank launches every bucket once per action that writes it, whatever its data did."""
        if not self.every_microbatch:
            return
        phase = (op, chunk)
        self._launch_the_rest(self.phase_buckets.get(phase, [])[self.next.get(phase, 0):])
        self.next[phase] = 0

    @staticmethod
    def _full(bucket):
        return len(bucket.ready) == len(bucket.params)

    def _copy_in(self, bucket, i):
        p, start = bucket.params[i], bucket.offsets[i]
        if bucket.shard is not None and self.every_microbatch:  # its last launch must land before it refills
            self._settle(bucket)
        if bucket.flat is None:
            bucket.flat = bucket.new_flat()
        view = bucket.flat[start:start + p.numel()]
        view.copy_(p.grad.reshape(-1)) if p.grad is not None else view.zero_()
        if self.every_microbatch:
            p.grad = None  # its elements are in the bucket now: the full-size gradient is not kept
        bucket.ready.add(i)

    def _launch(self, bucket):
        self.launched += 1
        if self.every_microbatch:
            # keep at most two buckets' full gradients in flight: settle the ones before the previous
            while len(self.in_flight) >= 2:
                self._settle(self.in_flight.pop(0))
            bucket.shard = torch.empty(bucket.shard_size, dtype=bucket.flat.dtype, device=bucket.flat.device)
            if bucket.world == 1:
                bucket.shard.copy_(bucket.flat)
            else:
                bucket.work = _reduce_scatter_single(bucket.shard, bucket.flat, group=bucket.group, async_op=True)
            self.in_flight.append(bucket)
            bucket.ready = set()  # sent: the next action that writes it starts it afresh
            if self.on_launch is not None:
                self.on_launch(bucket)
            return
        if bucket.world == 1:
            return
        if self.shard and bucket.owner is not None:  # the sum lands on the owner only
            owner = dist.get_global_rank(bucket.group, bucket.owner)
            bucket.work = dist.reduce(bucket.flat, owner, group=bucket.group, async_op=True)
        elif self.shard:
            bucket.shard = torch.empty(bucket.shard_size, dtype=bucket.flat.dtype, device=bucket.flat.device)
            bucket.work = _reduce_scatter_single(bucket.shard, bucket.flat, group=bucket.group, async_op=True)
        else:
            bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)

    def _settle(self, bucket):
        """ZeRO-2/3: wait for a bucket's reduce-scatter, add this micro-batch's mean into grad_shard, drop
        the flat gradient."""
        if bucket.shard is None:
            return
        if bucket.work is not None:
            bucket.work.wait()  # sync point: the flat gradient can only be freed once it is sent
        bucket.shard.div_(self.dp)  # the sum over ranks / dp = the mean over the global batch
        bucket.grad_shard = bucket.shard if bucket.grad_shard is None else bucket.grad_shard.add_(bucket.shard)
        bucket.flat = bucket.shard = bucket.work = None

    def _launch_the_rest(self, buckets):
        """Launch these buckets in order, each parameter the hooks did not copy in from its p.grad, or as
        zeros where it has none."""
        for bucket in buckets:
            for i in range(len(bucket.params)):
                if i not in bucket.ready:
                    self._copy_in(bucket, i)
            self._launch(bucket)

    def finish(self):
        """Wait for every bucket's collective (launching the ones the hooks did not, in bucket order:
        deferred parameters, parameters that got no gradient this step, the buckets after them) and point
        each p.grad at its part of the result (ZeRO-2/3: leave it in the buckets' grad_shard, every action
        having been closed by backward_done)."""
        if self.every_microbatch:
            if any(b.ready for b in self.buckets) or any(p.grad is not None for p in self.where):
                raise RuntimeError("GradientBuckets.finish: gradients were never sent: with every_microbatch, call "
                                   "backward_done(op, chunk) after each backward action")
            for bucket in self.in_flight:
                self._settle(bucket)
            self.in_flight, self.next, self.launched = [], dict.fromkeys(self.next, 0), 0
            return
        self._launch_the_rest(self.buckets[self.launched:])
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()  # sync point: the gradient is needed from here on
            # the sum over ranks / dp = the mean gradient over the global batch
            if self.shard:  # the mean on what this rank owns, zero elsewhere (the other ranks' parts)
                lo, hi = bucket.owned()
                if bucket.world > 1 and bucket.owner is None:  # a reduce-scatter's output; a reduce leaves the sum in flat
                    bucket.flat[lo:hi].copy_(bucket.shard)
                if self.dp > 1:
                    bucket.flat[lo:hi].div_(self.dp)
                bucket.flat[:lo].zero_()
                bucket.flat[hi:].zero_()
            elif self.dp > 1:
                bucket.flat.div_(self.dp)
            for p, start in zip(bucket.params, bucket.offsets):
                p.grad = bucket.flat[start:start + p.numel()].view_as(p)
            bucket.reset()
        self.sync, self.launched, self.next = True, 0, dict.fromkeys(self.next, 0)

    def owned_slices(self):
        """(param, start, end, bucket, a, b): the range start:end of each parameter's flattened elements
        this rank owns under sharding, which is a:b of its bucket's shard. Each parameter has at most one
        range: it is contiguous in its bucket, so is the slice (a parameter of a whole bucket is all or
        nothing)."""
        pieces = []
        for bucket in self.buckets:
            lo, hi = bucket.owned()
            for p, start in zip(bucket.params, bucket.offsets):
                a, b = max(lo, start), min(hi, start + p.numel())
                if a < b:
                    pieces.append((p, a - start, b - start, bucket, a - lo, b - lo))
        return pieces

    def owned_pieces(self):
        """(param, start, end) of owned_slices()."""
        return [piece[:3] for piece in self.owned_slices()]

    def bucket_of(self, p):
        return self.where[p][0]


    def gather_params(self):
        """After each rank updated what it owns under sharding, give every rank the whole updated model: an
        all-gather of each evenly sliced bucket, a broadcast from its owner of each whole one. Two buckets
        in flight at a time: ZeRO-2 keeps no full-size flat buffer, and must not make one for every bucket
        here."""
        gathered = []
        for bucket in [b for b in self.buckets if b.world > 1] + [None]:
            if bucket is not None:
                full = bucket.new_flat()
                for p, start in zip(bucket.params, bucket.offsets):
                    full[start:start + p.numel()].copy_(p.detach().reshape(-1))
                if bucket.owner is None:
                    lo, hi = bucket.owned()
                    work = _all_gather_single(full, full[lo:hi].clone(), group=bucket.group, async_op=True)
                else:
                    work = dist.broadcast(full, dist.get_global_rank(bucket.group, bucket.owner),
                                          group=bucket.group, async_op=True)
                gathered.append((bucket, full, work))
            if len(gathered) == 2 or bucket is None:
                for done, full, work in gathered[:len(gathered) - (bucket is not None)]:
                    work.wait()
                    for p, start in zip(done.params, done.offsets):
                        p.detach().copy_(full[start:start + p.numel()].view_as(p))
                gathered = gathered[len(gathered) - (bucket is not None):]

# ZeRO-3 (Rajbhandari et al. 2020, section 5.3; Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling
# Fully Sharded Data Parallel"). The parameters are cut into units: one per transformer block, and the
# stage's other parameters (embedding, final norm, head) as the root unit, with a tied weight in a unit of
# its own. Under expert parallelism (section 6) a block's experts are a unit of their own, sharded,
# gathered and reduce-scattered over the ranks that hold the same experts (expert_group), beside the
# block's other parameters over the data-parallel group: the block's hooks gather and free both. Each
# unit is one flat tensor padded to a multiple of dp, and each rank stores only its slice (param_shard):
# 1/dp of the parameters, of the gradients (reduce-scattered into grad_shard, as ZeRO-2) and of the
# optimizer state. A parameter is a view into its unit's gathered buffer (param_full), whose
# storage is empty except while the unit is in use. The rhythm, per block and per micro-batch:
#
#     forward:  all-gather the block (posted early: the previous block's forward prefetched it) ->
#               post the all-gather of the next block -> compute -> free the storage
#     backward: all-gather the block again (the later block's backward prefetched it) -> post the gather
#               of the block before it -> recompute (activation checkpointing) and backward -> copy the
#               gradients into the flat buffer and reduce-scatter it -> free the storage
#
# Freeing is the storage itself (untyped_storage().resize_(0)), not a reference: what autograd saved for
# backward are views of the same storage, so they hold no memory in between and see the regathered values.
# The root unit stays whole from the step's first forward until the optimizer step (it is used at both
# ends of the model: the embedding first, the head last). The gathers, like the reduce-scatters (every
# bucket once per micro-batch, GradientBuckets._flush), are unconditional and in the same order on every
# rank of the group: a block runs forward and backward on every rank, even one whose MoE experts got no
# token. A pipeline stage gathers each block again for every micro-batch (twice: forward and backward);
# with pp stages and m micro-batches, 2m all-gathers and m reduce-scatters of each unit per step, each
# unit's bytes times (dp - 1)/dp on the wire. Memory at a time: the shards, plus about two gathered
# blocks (the one computing, the one prefetched), the root unit, and two buckets of gradients in flight.
#
# What each schedule gathers, per block and micro-batch: afab and 1f1b as above, forward and backward.
# interleaved_1f1b the same, chunk by chunk: a block prefetches the next block of its own chunk only (the
# root's hook, the chunk's first), since another chunk's block runs only after other actions. zero_bubble
# and zbv gather before F and before B, free after each, and gather nothing for W: W computes
# dW = dy^T x from the x and dy that B kept and needs no weight, so no block stays gathered from B to W.
# Their blocks are two units each, phases of their own (the weights W computes, the rest that B does):
# gathered and freed together, two all-gathers per gather; each part's gradients reduce-scattered after
# its action. Under zbv rank 0's root unit (the embedding, the final norm, the head) is whole all step.


class FullyShardedParameters:
    """ZeRO-3's parameter side over the buckets of a GradientBuckets built with `units`: `units` is
    [(module, params, chunk)] in forward order; module None marks a unit kept whole through the step
    (gathered by the model's forward, freed by free_all()), else the module whose forward and backward use
    the unit: a block, whose units (one per phase: a split backward's B and W parts) are gathered and freed
    together. A unit is one bucket, or two when it holds experts under expert parallelism: those are
    sharded, gathered and reduce-scattered over their own group (the ranks that hold the same experts),
    the rest over the data-parallel group. `chunk` is the model chunk the block runs in (the model's
    forward takes chunk=c): a block prefetches the next block of its own chunk only, the one that runs
    next. Moves each unit's parameters into its flat shards and registers the hooks."""

    def __init__(self, grad_sync, units, model):
        self.whole, self.chunks, self.block_of = [], {}, {}  # chunk -> [block: [its buckets]] in order
        self.ends_backward = {}  # id(block) -> the bucket whose launch says the block's B is over
        with torch.no_grad():
            for module, params, chunk in units:
                if not params:
                    continue
                unit = list(dict.fromkeys(grad_sync.bucket_of(p) for p in params))
                for b in unit:
                    full = torch.zeros(b.shard_size * b.world, dtype=b.params[0].dtype, device=b.params[0].device)
                    for p, start in zip(b.params, b.offsets):
                        full[start:start + p.numel()].copy_(p.reshape(-1))
                        p.data = full[start:start + p.numel()].view_as(p)  # p now lives in the gathered buffer
                    lo = b.rank * b.shard_size
                    b.param_shard, b.param_full = full[lo:lo + b.shard_size].clone(), full
                    b.keep_whole = module is None
                    self._free([b])
                if module is None:
                    self.whole += unit
                    continue
                blocks = self.chunks.setdefault(chunk, [])
                if not blocks or blocks[-1][0] is not module:  # a new block: its hooks
                    blocks.append((module, []))
                    c, i = chunk, len(blocks) - 1
                    module.register_forward_pre_hook(lambda mod, args, c=c, i=i: self._pre_forward(c, i))
                    module.register_forward_hook(lambda mod, args, out, c=c, i=i: self._post_forward(c, i, out))
                block = blocks[-1][1]
                block += unit
                for b in unit:
                    self.block_of[id(b)] = block
        # a block's B is over when the last of its buckets that B completes is launched (the buckets launch in
        # their order): an expert bucket launched earlier, mid-backward, frees only itself
        order = {id(b): k for k, b in enumerate(grad_sync.buckets)}
        for blocks in self.chunks.values():
            for _, block in blocks:
                in_b = [b for b in block if any(op == "B" for op, _ in b.phases)]
                if in_b:
                    self.ends_backward[id(block)] = max(in_b, key=lambda b: order[id(b)])
        model.register_forward_pre_hook(lambda mod, args, kwargs: self._gather_whole(kwargs.get("chunk", 0)),
                                        with_kwargs=True)
        grad_sync.on_launch = self._post_backward

    def _units(self):
        return self.whole + [b for blocks in self.chunks.values() for _, block in blocks for b in block]

    # the three states of a bucket's parameters: storage empty (gather None, no bytes), gathering (gather =
    # the work), whole (gather True). A block is the list of its buckets; each is gathered over its group.
    def _gather(self, block):
        for b in block:
            if b.gather is not None:
                continue
            full = b.param_full
            full.untyped_storage().resize_(full.numel() * full.element_size())
            if b.world == 1:
                full.copy_(b.param_shard)
                b.gather = True
            else:
                b.gather = _all_gather_single(full, b.param_shard, group=b.group, async_op=True)

    def _wait(self, block):
        self._gather(block)
        for b in block:
            if b.gather is not True:
                b.gather.wait()  # sync point: the block's parameters are needed now
                b.gather = True

    def _free(self, block):
        for b in block:
            if b.gather is not None and b.gather is not True:
                b.gather.wait()  # a prefetch nobody used: it must land before its buffer goes
            b.param_full.untyped_storage().resize_(0)
            b.gather, b.in_backward = None, False

    def _block(self, c, i):
        return self.chunks[c][i][1]

    def _gather_whole(self, chunk):
        self._wait(self.whole)
        if self.chunks.get(chunk):
            self._gather(self._block(chunk, 0))  # prefetch the chunk's first block while the embedding computes

    def _pre_forward(self, c, i):
        block = self._block(c, i)
        self._wait(block)
        if i + 1 < len(self.chunks[c]) and not block[0].in_backward:  # (not while recomputing in backward)
            self._gather(self._block(c, i + 1))

    def _post_forward(self, c, i, out):
        block = self._block(c, i)
        if not block[0].in_backward:  # a recompute in backward keeps the block for its backward
            self._free(block)
        if torch.is_grad_enabled() and torch.is_tensor(out) and out.requires_grad:
            out.register_hook(lambda grad, c=c, i=i: self._pre_backward(c, i))

    def _pre_backward(self, c, i):
        block = self._block(c, i)
        for b in block:
            b.in_backward = True
        self._wait(block)
        if i > 0:
            self._gather(self._block(c, i - 1))

    def _post_backward(self, bucket):
        """GradientBuckets launched a bucket's reduce-scatter: its gradients are all in: free it. If it is the
        last its block's B completes, the backward of the block has run: free the whole block (a split
        backward's W needs no weights, dW = dy^T x; the W part's own launch, after W, finds it free)."""
        if bucket.keep_whole:
            return
        block = self.block_of[id(bucket)]
        self._free(block if self.ends_backward.get(id(block)) is bucket else [bucket])

    def free_all(self):
        """After the optimizer stepped the shards: every gathered copy is stale."""
        self._free(self._units())

    @contextmanager
    def whole_model(self):
        """Every unit gathered, to read the whole model (a test comparing weights)."""
        self._wait(self._units())
        try:
            yield
        finally:
            self.free_all()

    def unit_by_unit(self):
        """Yields each bucket's parameters gathered, one at a time (a block's experts and its other parameters
        one after the other), then copies this rank's slice of what was written into them back into its
        shard and frees it: a checkpoint loads this way holding one unit whole, not the model (which may
        not fit on one device: that is why it is sharded)."""
        for b in self._units():
            self._wait([b])
            yield b.params
            lo = b.rank * b.shard_size
            b.param_shard.copy_(b.param_full[lo:lo + b.shard_size])
            self._free([b])


def sum_tied_grad_shards(grad_sync, copies, group):
    """ZeRO-2/3 with pp > 1 and tied embeddings: the first stage's embedding and the last stage's head
    each sit alone in a bucket, cut the same way, so the owned shards of their gradients are summed
    across the two stages directly (the mean over dp commutes with the sum)."""
    if group is None:
        return
    for p in copies:
        dist.all_reduce(grad_sync.bucket_of(p).grad_shard, group=group)


class ZeroOneAdamW(torch.optim.Optimizer):
    """AdamW with its states partitioned across the data-parallel group (ZeRO stage 1; stages 2 and 3
    with zero_stage).

    Takes parameter groups like torch.optim.AdamW (per-group lr and weight_decay) and owns the gradient
    averaging too (`self.grad_sync`, a sharded GradientBuckets): do not also all-reduce the gradients, or
    wrap the model in DistributedDataParallel, or they are reduced twice. Per step:
        backward (hooks reduce-scatter the buckets) -> grad_sync.finish() -> [clip] -> step() (AdamW on this
        rank's slice, then all-gather the updated slices)
    zero_stage=2: the gradients are reduce-scattered every micro-batch and kept as shards only.
    zero_stage=3: also the parameters (`units`: [(module or None, params, chunk)], see
    FullyShardedParameters; `model` gets the root hook); step() updates the shards, and nothing is
    all-gathered after it. `phases` (ZeRO-2/3): see GradientBuckets.
    The update is torch.optim.AdamW's, element for element: decoupled weight decay p -= lr * wd * p, then
    p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps) (Loshchilov & Hutter 2019).
    The learning rate is read from self.param_groups at every step, so a schedule that writes
    group['lr'] reaches the update. `expert_params` and `expert_group`: see GradientBuckets; their states
    are split across expert_group, the ranks that hold the same experts (ZeRO-2/3: their gradients and
    parameters too).

    step(found_inf) skips the update where found_inf (a 0-dim float tensor on the parameters' device, the
    argument torch's fused AdamW takes) is 1: weights, moments and step counter stay exactly as they were.
    The choice is made on the device (torch.where), so a step whose gradient is not finite is skipped
    without the host waiting for the device; the step counter lives on the device for the same reason,
    and the bias corrections are computed there from it."""

    def __init__(self, params, group=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 bucket_size_mb=25.0, deferred=(), expert_params=(), expert_group=None, zero_stage=1, units=None,
                 model=None, phases=None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.group, self.zero_stage = group, zero_stage
        all_params = [p for g in self.param_groups for p in g["params"]]
        self.grad_sync = GradientBuckets(all_params, group, bucket_size_mb, shard=True,
                                         deferred=deferred if zero_stage == 1 else (),
                                         expert_params=expert_params, expert_group=expert_group,
                                         every_microbatch=zero_stage >= 2,
                                         units=[ps for _, ps, _ in units] if zero_stage == 3 else None,
                                         alone=deferred if zero_stage == 2 else (),
                                         phases=phases if zero_stage >= 2 else None)
        self.sharded = FullyShardedParameters(self.grad_sync, units, model) if zero_stage == 3 else None
        self.group_of = {p: g for g in self.param_groups for p in g["params"]}
        # the moments of this rank's slice only, created now so that their size can be reported at start-up
        self.slices = {}
        for p, start, end, bucket, a, b in self.grad_sync.owned_slices():
            self.slices[p] = (bucket, a, b)
            self.state[p] = {"step": torch.zeros((), device=p.device), "flat_range": (start, end),
                             "exp_avg": torch.zeros(end - start, dtype=p.dtype, device=p.device),
                             "exp_avg_sq": torch.zeros(end - start, dtype=p.dtype, device=p.device)}

    def owned_param(self, p):
        """This rank's elements of p, flat: a view, so updating it updates p (ZeRO-3: p's shard)."""
        start, end = self.state[p]["flat_range"]
        bucket, a, b = self.slices[p]
        return bucket.param_shard[a:b] if self.zero_stage == 3 else p.detach().view(-1)[start:end]

    def owned_grad(self, p):
        start, end = self.state[p]["flat_range"]
        bucket, a, b = self.slices[p]
        return p.grad.view(-1)[start:end] if self.zero_stage == 1 else bucket.grad_shard[a:b]

    def grads(self):
        """[(param, gradient tensor)]: every gradient element this rank holds, each once (ZeRO-1: whole
        p.grad, zero off the owned range; ZeRO-2/3: the owned slices of the grad shards)."""
        if self.zero_stage == 1:
            return [(p, p.grad) for p in self.group_of if p.grad is not None]
        return [(p, self.owned_grad(p)) for p in self.state]

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none)
        for bucket in self.grad_sync.buckets:
            bucket.grad_shard = None

    @torch.no_grad()
    def step(self, found_inf=None):
        for p, state in self.state.items():
            group = self.group_of[p]
            # views: updating them updates p (ZeRO-3: p's shard)
            adamw_update(self.owned_param(p), self.owned_grad(p), state, group["lr"], group["weight_decay"],
                         group["betas"], group["eps"], found_inf)
        if self.sharded is not None:
            self.sharded.free_all()  # the next forward gathers the updated shards
        else:
            self.grad_sync.gather_params()


def adamw_update(param, grad, state, lr, weight_decay, betas, eps, found_inf=None):
    """torch.optim.AdamW's update of one tensor, in place (Loshchilov & Hutter 2019): decoupled weight decay
    p -= lr * wd * p, then p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps), with
    state's exp_avg (m) and exp_avg_sq (v) shaped like param and its step counter t (a 0-dim tensor on the
    device, so the bias corrections need no host read). found_inf (0-dim, 1 to skip) keeps every old value
    where it is set, chosen on the device (torch.where): a NaN in the new values is never selected."""
    beta1, beta2 = betas
    exp_avg, exp_avg_sq, t = state["exp_avg"], state["exp_avg_sq"], state["step"] + 1
    t_in_dtype = t.to(at_least_fp32(param.dtype))  # the bias corrections in the update's precision
    new_avg = exp_avg.lerp(grad, 1 - beta1)
    new_avg_sq = (exp_avg_sq * beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (new_avg_sq.sqrt() / (1 - beta2 ** t_in_dtype).sqrt()).add_(eps)
    new_param = (param * (1 - lr * weight_decay)).sub_(lr / (1 - beta1 ** t_in_dtype) * new_avg / denom)
    updates = ((param, new_param), (exp_avg, new_avg), (exp_avg_sq, new_avg_sq), (state["step"], t))
    for old, new in updates:
        old.copy_(new if found_inf is None else torch.where(found_inf.bool(), old, new))


def optimizer_state_bytes(optimizer):
    """Bytes of every tensor in an optimizer's state on this rank (the moments; the step counters too)."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if torch.is_tensor(v))


# -----------------------------------------------------------------------------
# 6. Expert parallelism
#
# A mixture-of-experts layer holds n_expert MLPs, but each token uses only k of them. Splitting every
# expert across the tensor-parallel ranks (section 2) keeps every expert on every rank; expert parallelism
# (GShard, section 2.2; Switch Transformer, section 5.4) instead places whole experts on different ranks, so
# the number of experts can grow with the number of ranks. ep neighbouring data-parallel ranks form an
# expert-parallel group (the layout, section 1): rank r of the group holds experts r * n_expert / ep up to
# (r + 1) * n_expert / ep - 1, every rank still holds all the other parameters (attention, router, shared
# experts), and every rank still runs its own micro-batch.
#
# Each rank routes its own tokens as one process would (the capacity too, before anything moves), then:
#   1. counts: how many of its assignments go to each expert; the counts are exchanged first (an
#      all-to-all of n_expert integers), so every rank knows how many rows it will receive from whom.
#      Both are read back to the host once: all_to_all_single needs its split sizes as numbers.
#   2. dispatch: the token rows, sorted by expert and so by destination rank, go to the ranks of their
#      experts (all_to_all_single with uneven splits).
#   3. each rank runs its local experts, each on its contiguous group of rows (the received rows are
#      sorted from source-rank-major to expert-major first, and back after).
#   4. return: a second all-to-all, the reverse of the first, sends every output row to its token's rank,
#      where the router weights combine them (model.MixtureOfExperts).
# Backward runs the same two exchanges in reverse (AllToAll's backward), so each expert's weight gradient
# sums the contributions of every rank that sent it tokens: the gradient of the ep ranks' summed losses. The
# ranks holding the same experts (the expert_dp_group: dp / ep of them, times cp under context parallelism)
# add theirs, and dividing by dp (dp * cp) gives the mean over the global batch that one process computes
# (GradientBuckets' expert_params).
#
# Cost: each rank sends every token row routed to another rank's expert twice forward (the token, its
# output) and twice backward (their gradients): 4 * rows * n_embd * bytes per element per layer, plus the
# counts; none of it overlaps with compute here. Memory: each rank holds n_expert / ep experts' weights,
# gradients and AdamW moments (ZeRO-1 shards the moments over the expert_dp_group, ZeRO-2 the gradients
# too, ZeRO-3 the weights as well: section 5). With tp > 1 every
# tensor-parallel rank exchanges the same rows with its own ep group (each keeps its slice of the experts).
# An expert that receives no rows still runs, on zero rows: its zero gradient arrives during backward as a
# busy expert's does, so the gradient buckets (section 5) fill at the same point on every rank.

ExpertSplits = namedtuple("ExpertSplits", "send recv recv_counts")


class ByteCount:
    """The bytes a rank has sent to other ranks (AllToAll adds to it, forward and backward)."""

    def __init__(self):
        self.bytes = 0


def exchange_expert_counts(counts, group):
    """counts: (n_expert,) int64 on the device, this rank's assignments per (global) expert, the experts of
    group rank j being the j-th block of n_expert / ep. Returns ExpertSplits:
        send        counts as a host list
        recv        host list of lists: recv[j][e] rows rank j sends to this rank's local expert e
        recv_counts the same on the device, (ep, n_expert / ep)
    The one host read-back of a mixture-of-experts layer: the split sizes of the all-to-alls."""
    ep = group_size(group)
    if ep == 1:
        recv_counts = counts.view(1, -1)
        send = counts.tolist()  # host-device sync
        return ExpertSplits(send, [send], recv_counts)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # equal splits: n_expert / ep counts to each rank
    both = torch.cat([counts, recv_counts]).tolist()  # host-device sync
    n = len(both) // 2
    return ExpertSplits(both[:n], [both[n + j * n // ep:n + (j + 1) * n // ep] for j in range(ep)],
                        recv_counts.view(ep, -1))


class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits: this rank sends send_splits[j] rows of x (in order, rank 0's
    first) to group rank j and receives recv_splits[j] rows from it, stacked in rank order. Its backward is
    the same exchange reversed: every received row's gradient goes back to the rank that sent the row, into
    the place the row came from (the send and receive sizes swap). `sent` (a ByteCount) adds the bytes this
    rank sends to other ranks, both ways."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group, sent):
        ctx.splits, ctx.group, ctx.sent = (send_splits, recv_splits), group, sent
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        sent.bytes += _bytes_to_others(x, send_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        grad_x = grad.new_empty((sum(send_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_x, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        ctx.sent.bytes += _bytes_to_others(grad, recv_splits, ctx.group)
        return grad_x, None, None, None, None


def _bytes_to_others(x, splits, group):
    row = x[0].numel() * x.element_size() if x.dim() > 1 else x.element_size()
    return (sum(splits) - splits[group_rank(group)]) * row


def dispatch_to_experts(rows, splits, run_local_experts, group, sent):
    """rows: (n, C), this rank's kept token-to-expert assignments sorted by expert (n = sum(splits.send));
    splits from exchange_expert_counts. run_local_experts(x, sizes) runs this rank's experts in order, the
    e-th on the next sizes[e] rows of x, and returns their outputs stacked the same way. Returns the (n, C')
    outputs in the order of `rows`. With group None (ep = 1) this is run_local_experts(rows, splits.send)."""
    ep = group_size(group)
    if ep == 1:
        return run_local_experts(rows, splits.send)
    n_local = len(splits.recv[0])
    send = [sum(splits.send[j * n_local:(j + 1) * n_local]) for j in range(ep)]  # rows to each rank
    recv = [sum(r) for r in splits.recv]  # rows from each rank
    received = AllToAll.apply(rows, send, recv, group, sent)  # source-rank-major, expert-sorted within
    # expert-major: the local expert of every received row, then a stable sort keeps the sources in order
    expert_of_row = torch.arange(n_local, device=rows.device).repeat(ep).repeat_interleave(
        splits.recv_counts.reshape(-1), output_size=sum(recv))
    order = expert_of_row.argsort(stable=True)
    sizes = [sum(r[e] for r in splits.recv) for e in range(n_local)]
    out = run_local_experts(received[order], sizes)
    back = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))
    return AllToAll.apply(out[back], recv, send, group, sent)  # each output row to its token's rank
# 7. Muon: whole matrices across tensor- and data-parallel ranks
#
# Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks") steps a weight
# matrix along its momentum made orthogonal: the momentum M = U S V^T is replaced by about U V^T, so that
# every direction of the matrix moves by the same amount, where a gradient step moves mostly along its
# few largest singular directions. U V^T comes without an SVD, from five iterations of a quintic
# Newton-Schulz polynomial: matmuls only. Liu et al. 2025 ("Muon is Scalable for LLM Training", Moonshot
# AI, section 2.2) scale the update of an A x B matrix by 0.2 * sqrt(max(A, B)): U V^T has RMS
# 1 / sqrt(max(A, B)), so the update's RMS is 0.2, about AdamW's, and an AdamW recipe's learning rate and
# decoupled weight decay carry over. Muon is for the matrices that map hidden states to hidden states;
# the embedding, the head, the router, the norms and the biases stay on AdamW (Jordan et al. and Liu et
# al. both keep the embedding and head on AdamW): one optimizer, with parameter groups.
#
# Orthogonalising is not elementwise, as AdamW is: it needs the whole matrix, which tensor parallelism and
# ZeRO-1 both cut. What each rank holds and which collectives run, for each:
#   Tensor parallelism: each rank keeps the momentum of its own slice (momentum is elementwise); the tp
#     ranks all-gather the slices of the Nesterov momentum, every rank orthogonalises the full matrix and
#     keeps its slice of the result. Gathering is one all-gather per matrix on the fastest links, with no
#     extra process group and no scatter back; its price is Newton-Schulz run tp times over (dealing
#     whole matrices to tp ranks would split that work, at the cost of a gather to each owner and a
#     scatter back). A matrix replicated across the tp ranks (key and value weights with fewer heads than
#     ranks, MQA; MLA's down-projections) already has its complete gradient on every rank (copy_to_tp
#     summed it), so every rank computes the same update with no collective.
#   ZeRO-1 (zero=True): even flat slices would cut matrices, so the matrices are dealt whole instead, over
#     the ranks that hold the same parameters (dp x cp under context parallelism, as for ZeroOneAdamW;
#     "dp" below). In backward order, each goes to the dp rank whose even share of all their elements
#     holds its middle element: ZeRO-1's cut, moved to the nearest matrix boundary (a rank's share is off
#     by at most about one matrix). They travel in GradientBuckets of their own, one owner each: the gradient is reduced to
#     the owner (instead of reduce-scattered), the owner keeps the momentum, runs Newton-Schulz, and
#     broadcasts the updated matrix (instead of the all-gather). The AdamW parameters keep ZeRO-1's even
#     slices. With tp as well, the tp ranks of the owner do the tp all-gather among themselves.
# What it costs. Bytes: across dp, what AdamW moves (a reduce plus a broadcast move what a reduce-scatter
# plus an all-gather move); across tp, one all-gather of each matrix. Memory: one momentum per element
# where AdamW keeps two, 1/dp of them with ZeRO-1. Compute: Newton-Schulz for an A x B matrix, A <= B, is
# 5 x (X X^T: 2 A^2 B, its square: 2 A^3, times X: 2 A^2 B) = 20 A^2 B + 10 A^3 FLOPs a step; for m x m
# matrices that is 5 m / (tokens per step) of the training FLOPs (6 m^2 per token), tp times over. It runs
# in fp32, so that every layout's update equals one process's to fp32 rounding (Jordan et al. run it in
# bf16 on GPUs, faster).
#
# The 2-D weights must be plain matrices (out, in), as nn.Linear keeps them: an expert stored as one 3-D
# tensor would need its own loop here.

NEWTON_SCHULZ_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Jordan et al. 2024


def newton_schulz(G, steps=5, eps=1e-7):
    """About U V^T for G = U S V^T. G is scaled to Frobenius norm 1, so every singular value is at most 1;
    then each iteration X <- a X + b (X X^T) X + c (X X^T)^2 X maps every singular value s to
    a s + b s^3 + c s^5 and leaves U and V alone. Jordan et al.'s (a, b, c) buy a steep start (a = 3.4:
    small singular values grow fast) with not converging to exactly 1: after 5 iterations every singular
    value from 0.01 of the norm up lands in [0.68, 1.13], which the update tolerates. In fp32 (fp64 in a
    float64 run); the Gram matrix X X^T is taken on the shorter side."""
    a, b, c = NEWTON_SCHULZ_COEFFICIENTS
    X = G.to(at_least_fp32(G.dtype))
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (X.norm() + eps)
    for _ in range(steps):
        gram = X @ X.T  # (rows, rows), rows <= cols
        X = a * X + (b * gram + c * gram @ gram) @ X
    return X.T if tall else X


def deal_whole(params, n):
    """{param: rank}: the params, in order, cut into n runs of about equal numbers of elements, each param
    whole: a param goes to the rank whose even share of them all holds its middle element."""
    params = list(params)
    total, seen, owners = sum(p.numel() for p in params), 0, {}
    for p in params:
        owners[p] = (2 * seen + p.numel()) * n // (2 * total)  # the middle element's share, 0 .. n - 1
        seen += p.numel()
    return owners


def gather_tp_slices(x, param, group):
    """The full matrix of which x is this rank's tensor-parallel slice (shaped like param); x itself when
    param is replicated (no tp_shard_dim) or the group is one rank."""
    dim = getattr(param, "tp_shard_dim", None)
    if dim is None or group_size(group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class Muon(torch.optim.Optimizer):
    """Muon for the parameter groups with muon=True (2-D matrices), AdamW for the others: one optimizer,
    whose param_groups' lr the schedule writes at each step. Muon's update of an A x B matrix W with
    gradient G (Nesterov momentum; Liu et al. 2025's scale and decoupled weight decay):
        M <- mu M + G;   O = newton_schulz(G + mu M)
        W <- W - lr * wd * W - lr * 0.2 * sqrt(max(A, B)) * O
    where A x B is the full matrix's shape, on a rank that holds a tensor-parallel slice of it too.
    The other groups take adamw_update, torch.optim.AdamW's update.

    tp_group: matrices split across it (parameters marked by mark_sharded) are orthogonalised whole, see
    the section's note. zero=True: ZeRO-1 over dp_group (train.py gives it the dp x cp group), with the
    matrices dealt whole; the optimizer then
    owns the gradient averaging (`self.grad_sync`, as ZeroOneAdamW: do not also all-reduce the gradients).
    Per step: backward -> grad_sync.finish() -> [clip] -> step() (AdamW on this rank's slices, Muon on its
    matrices, then grad_sync.gather_params()). Every state exists from the start (its size is reported
    before the first step): AdamW's moments flat over the elements this rank updates (`flat_range` under
    ZeRO-1), Muon's momentum shaped like the matrix (its tp slice)."""

    def __init__(self, params, lr=1e-3, momentum=0.95, ns_steps=5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                 tp_group=None, zero=False, dp_group=None, bucket_size_mb=25.0, deferred=()):
        super().__init__(params, dict(lr=lr, momentum=momentum, ns_steps=ns_steps, betas=betas, eps=eps,
                                      weight_decay=weight_decay, muon=False))
        self.tp_group = tp_group
        self.group_of = {p: g for g in self.param_groups for p in g["params"]}
        self.matrices = [p for g in self.param_groups if g["muon"] for p in g["params"]]
        if any(p.dim() != 2 for p in self.matrices):
            raise ValueError(f"Muon orthogonalises 2-D matrices; its groups hold tensors of shapes "
                             f"{sorted({tuple(p.shape) for p in self.matrices if p.dim() != 2})}")
        all_params = [p for g in self.param_groups for p in g["params"]]
        self.grad_sync = None
        if zero:
            owners = deal_whole(reversed(self.matrices), group_size(dp_group))  # backward order, as the buckets
            self.grad_sync = GradientBuckets(all_params, dp_group, bucket_size_mb, shard=True, deferred=deferred,
                                             owners=owners)
            pieces = self.grad_sync.owned_pieces()
        else:
            pieces = [(p, 0, p.numel()) for p in all_params]
        for p, start, end in pieces:
            if self.group_of[p]["muon"]:
                self.state[p] = {"momentum_buffer": torch.zeros_like(p)}
            else:
                self.state[p] = {"step": torch.zeros((), device=p.device),
                                 "exp_avg": torch.zeros(end - start, dtype=p.dtype, device=p.device),
                                 "exp_avg_sq": torch.zeros(end - start, dtype=p.dtype, device=p.device)}
            if zero:
                self.state[p]["flat_range"] = (start, end)

    @torch.no_grad()
    def step(self, found_inf=None):
        """found_inf: as ZeroOneAdamW.step's (a step whose gradient is not finite changes nothing)."""
        for p, state in self.state.items():
            group = self.group_of[p]
            if group["muon"] or not state:
                continue
            start, end = state.get("flat_range", (0, p.numel()))
            adamw_update(p.view(-1)[start:end], p.grad.reshape(-1)[start:end], state, group["lr"],
                         group["weight_decay"], group["betas"], group["eps"], found_inf)
        for p in self.matrices:  # the same order on every rank: the tp all-gathers match
            state = self.state.get(p)
            if not state:
                continue  # another data-parallel rank owns it (ZeRO-1)
            group = self.group_of[p]
            lr, mu = group["lr"], group["momentum"]
            momentum = state["momentum_buffer"]
            new_momentum = momentum.mul(mu).add_(p.grad)
            nesterov = p.grad.add(new_momentum, alpha=mu)  # the gradient plus the momentum's next step
            full = gather_tp_slices(nesterov, p, self.tp_group)  # (A, B): the whole matrix
            orthogonal = shard_of(newton_schulz(full, group["ns_steps"]), p).to(p.dtype)
            scale = -lr * 0.2 * math.sqrt(max(full.shape))
            new_p = (p * (1 - lr * group["weight_decay"])).add_(orthogonal, alpha=scale)
            for old, new in ((p, new_p), (momentum, new_momentum)):  # found_inf: see adamw_update
                old.copy_(new if found_inf is None else torch.where(found_inf.bool(), old, new))
        if self.grad_sync is not None:
            self.grad_sync.gather_params()


# -----------------------------------------------------------------------------
# The timeline printer: the pipeline schedules' action lists (section 4), placed in time slots by a
# simulator of the executor's exchanges.

ACTION_TIME = {"F": 1, "B": 2, "W": 1}  # in slots; a backward split into B and W takes 1 + 1


def action_times(actions):
    """Each op's duration in a list: forward = B = W = 1 slot, a backward that is not split (no W in the
    list) 2 slots, as the whole backward of a layer is about twice its forward's matmuls."""
    split = any(op == "W" for op, _, _ in actions)
    return {**ACTION_TIME, "B": 1 if split else 2}


def schedule_timeline(schedule, pp, m, chunks=1, lists=None):
    """Place every rank's actions in time slots as run_schedule would run them, or raise RuntimeError where
    real processes would hang or mix up messages. Returns one row per rank: the action in each slot (an
    action lasting two slots fills two), None where the rank is idle.

    The model of the executor: a rank runs its actions in order, each as soon as the previous one ended and
    its input has been sent (a send never waits for its receiver); messages between two ranks go through one
    first-in first-out channel per direction and kind, so the k-th message a rank sends on a channel is the
    k-th that the other receives on it, and both must be the same microbatch's, for the same stage. `lists`
    (default: the schedule's own) lets a test hand in a broken one."""
    chunks = 2 if schedule == "zbv" else chunks
    lists = lists if lists is not None else [SCHEDULES[schedule](pp, r, m, chunks) for r in range(pp)]
    stages = [virtual_stages(schedule, pp, r, chunks) for r in range(pp)]
    n_stages = pp * chunks
    owner = {s: r for r in range(pp) for s in stages[r]}
    sent, expected = {}, {}  # channel (from rank, to rank, kind) -> messages in order: (message, rank, index)
    needs = []  # needs[r][k]: (channel, position) of the message action k waits for, or None
    before = {"B": "F", "W": "B"}  # on its own rank, a backward follows its forward, a W its backward
    for r, actions in enumerate(lists):
        produced, done, row = set(), set(), []
        for k, (op, i, c) in enumerate(actions):
            if op in before and (before[op], i, c) not in done:
                raise RuntimeError(f"{schedule} at pp={pp}, m={m}: rank {r} runs {op}{i} of chunk {c} before its "
                                   f"{before[op]}{i}")
            done.add((op, i, c))
            source, destination = message_route(op, stages[r][c], n_stages)
            wait = None
            if source is not None:
                message = (op, i, stages[r][c])
                if owner[source] == r:  # handed over in memory: its producer must come first
                    if message not in produced:
                        raise RuntimeError(f"{schedule} at pp={pp}, m={m}: rank {r} runs {op}{i} of chunk {c} "
                                           f"before its own action that produces its input")
                else:
                    channel = (owner[source], r, op)
                    expected.setdefault(channel, []).append(message)
                    wait = (channel, len(expected[channel]) - 1)
            if destination is not None:
                message = (op, i, destination)
                if owner[destination] == r:
                    produced.add(message)
                else:
                    sent.setdefault((r, owner[destination], op), []).append((message, r, k))
            row.append(wait)
        needs.append(row)
    kinds = {"F": "activations", "B": "gradients"}
    for channel in sorted(set(sent) | set(expected)):
        out, into = [s[0] for s in sent.get(channel, [])], expected.get(channel, [])
        if out != into:
            j = next(j for j in range(max(len(out), len(into))) if j >= len(out) or j >= len(into) or out[j] != into[j])
            what = lambda msg: f"{msg[0]}{msg[1]} for stage {msg[2]}" if msg else "nothing"
            raise RuntimeError(f"{schedule} at pp={pp}, m={m}: rank {channel[0]}'s message #{j} of {kinds[channel[2]]} "
                               f"to rank {channel[1]} is {what(out[j] if j < len(out) else None)}, but rank "
                               f"{channel[1]} expects {what(into[j] if j < len(into) else None)}: the lists "
                               f"disagree on the order")
    times = [action_times(actions) for actions in lists]
    start, end = {}, {}
    position, free = [0] * pp, [0] * pp
    while any(position[r] < len(lists[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while position[r] < len(lists[r]):
                k = position[r]
                ready = 0
                if needs[r][k] is not None:
                    channel, j = needs[r][k]
                    _, sender, sender_k = sent[channel][j]
                    if (sender, sender_k) not in end:
                        break  # its input has not been sent yet
                    ready = end[(sender, sender_k)]
                start[(r, k)] = max(free[r], ready)
                end[(r, k)] = free[r] = start[(r, k)] + times[r][lists[r][k][0]]
                position[r] += 1
                progressed = True
        if not progressed:
            waiting = ", ".join(f"rank {r} at {lists[r][position[r]]}" for r in range(pp) if position[r] < len(lists[r]))
            raise RuntimeError(f"{schedule} deadlocks at pp={pp}, m={m}, chunks={chunks}: every rank waits on "
                               f"another ({waiting})")
    rows = [[None] * max(free) for _ in range(pp)]
    for (r, k), t in start.items():
        for slot in range(t, end[(r, k)]):
            rows[r][slot] = lists[r][k]
    return rows


def bubble_fraction(rows):
    """The share of rank-time slots spent idle."""
    return sum(row.count(None) for row in rows) / sum(len(row) for row in rows)


def held_microbatches(actions, chunks=1):
    """The most microbatches a rank holds at once, in whole stages' worth (a chunk's microbatch is 1/chunks
    of one): from a microbatch's forward to the end of its backward, its W when the backward is split."""
    split = any(op == "W" for op, _, _ in actions)
    alive = peak = 0
    for op, _, _ in actions:
        alive += 1 if op == "F" else -1 if op == ("W" if split else "B") else 0
        peak = max(peak, alive)
    return peak / chunks


def bubble_formula(schedule, pp, m, chunks=1):
    """The paper's formula as text, for the printed timeline."""
    if ideal_bubble(schedule, pp, m, chunks) is None:
        return ("none in the paper for m < pp" if schedule == "zero_bubble" else
                "none in the paper (idle only in the first fill, pp - 1 slots, when m >= 2 pp)")
    numerator, denominator = {"afab": (pp - 1, m + pp - 1), "1f1b": (pp - 1, m + pp - 1),
                              "interleaved_1f1b": (pp - 1, chunks * m + pp - 1),
                              "zero_bubble": (pp - 1, 3 * m + pp - 1)}[schedule]
    text = {"afab": "(pp - 1) / (m + pp - 1)", "1f1b": "(pp - 1) / (m + pp - 1)",
            "interleaved_1f1b": "(pp - 1) / (v m + pp - 1)", "zero_bubble": "(pp - 1) / (3 m + pp - 1)"}[schedule]
    return f"{text} = {numerator}/{denominator} = {numerator / denominator:.1%}"


def format_timeline(schedule, pp, m, chunks=1):
    """The timeline as text, one row per rank, with the microbatches each rank holds and the bubble."""
    if schedule == "zbv":
        chunks = 2
    rows = schedule_timeline(schedule, pp, m, chunks)
    label = lambda a: f"{a[0]}{a[1]}" + (f".{a[2]}" if chunks > 1 else "")
    width = max(len(label((op, m - 1, chunks - 1))) for op in "FBW")
    lines = [f"{schedule}: pp={pp} ranks, m={m} microbatches" + (f", {chunks} chunks per rank" if chunks > 1 else "")
             + "; a slot per forward (F), backward (B, two slots when not split into B and W) or weight gradient "
             + "(W)" + (", .c the chunk" if chunks > 1 else "") + "; .. idle"]
    for r, row in enumerate(rows):
        cells = []
        for slot, a in enumerate(row):
            if a is None:
                cells.append("." * width)
            elif slot > 0 and row[slot - 1] is a:
                cells.append("-" * width)  # the action of the slot before, still running
            else:
                cells.append(label(a).ljust(width))
        lines.append(f"rank {r} | " + " ".join(cells))
    lists = [SCHEDULES[schedule](pp, r, m, chunks) for r in range(pp)]
    held = [held_microbatches(actions, chunks) for actions in lists]
    lines.append("activations held at most (microbatches of a stage, F to the end of the backward): "
                 + ", ".join(f"rank {r}: {h:g}" for r, h in enumerate(held)))
    lines.append(f"bubble: {bubble_fraction(rows):.1%} of the slots idle (measured on this timeline); "
                 f"theory {bubble_formula(schedule, pp, m, chunks)}")
    return "\n".join(lines)


def main(argv):
    parser = argparse.ArgumentParser(description="Print a pipeline schedule as a timeline, one row per rank.")
    parser.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b")
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per step (m)")
    parser.add_argument("--chunks", type=int, default=None,
                        help="model chunks per rank (v): interleaved_1f1b any (default 2), zbv 2, the others 1")
    args = parser.parse_args(argv)
    chunks = args.chunks or (2 if args.schedule in ("interleaved_1f1b", "zbv") else 1)
    try:
        check_schedule(args.schedule, args.pp, args.microbatches, chunks)
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")
    print(format_timeline(args.schedule, args.pp, args.microbatches, chunks))


if __name__ == "__main__":
    main(sys.argv[1:])
