"""
Every parallel mechanism of picotron, in plain torch.distributed: one self-contained section each, in the
order a reader learns them.

  1. The layout: how the world of ranks is cut into data-, tensor- and pipeline-parallel groups, the
     printed rank grid, and which tensor-parallel groups would span two nodes.
  2. Tensor parallelism (Megatron-LM): the four communication operators as autograd functions, the layers
     built from them (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding) and the
     vocab-parallel cross-entropy.
  3. Pipeline parallelism: each schedule written once as every stage's ordered list of forward and
     backward actions, one executor that walks the list on a real stage, and the tied-weight sync.
  4. Data parallelism and ZeRO-1: gradients averaged in buckets from backward hooks (GradientBuckets), and
     an AdamW whose states are split across data-parallel ranks (ZeroOneAdamW).
  Last, the timeline printer: the same action lists drawn in time slots
     (python parallel.py --schedule 1f1b --pp 4 --microbatches 8).

Every piece here works on its own, given only torch and a process group (None means "not split"), so it
can be lifted into another project.

References: Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using
Model Parallelism" (the f and g operators, section 3); Huang et al. 2019, "GPipe" (all forward, all
backward); Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (1F1B, section 2.2.1); Rajbhandari et al. 2020, "ZeRO" (section 5.1).
"""
import argparse
import math
import os
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# 1. The layout


def group_size(group):
    return dist.get_world_size(group) if group is not None else 1


def group_rank(group):
    return dist.get_rank(group) if group is not None else 0


def grid_rank(pp_rank, dp_rank, tp_rank, dp, tp):
    """The global rank at a point of the dp x tp x pp grid (see ParallelLayout for why this order)."""
    return (pp_rank * dp + dp_rank) * tp + tp_rank


def resolve_dp(world_size, dp, tp, pp, count_name="WORLD_SIZE"):
    """The data-parallel size of a launch: dp = 0 means whatever the world leaves after tp * pp; any other
    dp must make dp * tp * pp the world size. The one place this rule lives (train.py, bench.py and
    make_config.py, whose count_name is 'nproc', all come here)."""
    if world_size % (tp * pp) != 0:
        raise ValueError(f"{count_name} = {world_size} processes cannot be cut into tp = {tp} x pp = {pp}: the world "
                         f"size {world_size} is not divisible by tp * pp = {tp} * {pp}; launch a multiple of "
                         f"{tp * pp} processes or change --tp/--pp")
    if dp == 0:
        return world_size // (tp * pp)
    if dp * tp * pp != world_size:
        raise ValueError(f"the layout dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} ranks does not match the "
                         f"world size {world_size}: set --dp, --tp and --pp so that their product is {world_size} "
                         f"(leave dp=0 to have it computed as world_size / (tp * pp))")
    return dp


class ParallelLayout:
    """Cuts `world_size` ranks into a dp x tp x pp grid and builds one process group per row of it.

    Ranks are numbered with tp fastest, then dp, then pp:  rank = (pp_rank * dp + dp_rank) * tp + tp_rank.
    Tensor parallelism talks on every layer (several collectives per block), so its ranks are neighbours,
    which on a real cluster means the same node and its fast links: torchrun gives each node consecutive
    ranks, so a tp group stays inside a node whenever tp divides the processes per node (see
    tp_groups_across_nodes). Data parallelism talks once per step, pipeline parallelism only sends
    activations between neighbouring stages, so both can span nodes.

    `timeout` is how long a collective on these groups waits for its peers before it fails (a group does
    not inherit the default group's timeout from init_process_group: it must be passed to each). Each group
    is named after its axis (group_desc): NCCL's watchdog names the group in its timeout message.

    With world_size 1 no group is built and every group is None: the single-process path.
    """

    def __init__(self, dp, tp, pp, world_size=1, rank=0, timeout=None):
        dp = resolve_dp(world_size, dp, tp, pp)
        self.dp, self.tp, self.pp, self.world_size, self.rank = dp, tp, pp, world_size, rank
        self.timeout = timeout
        self.tp_rank = rank % tp
        self.dp_rank = (rank // tp) % dp
        self.pp_rank = rank // (tp * dp)
        self.tp_group = self.dp_group = self.pp_group = None
        self.pp_prev = self.pp_next = None  # global ranks of the neighbouring pipeline stages
        if world_size == 1:
            return
        # A group is a line of the grid: the ranks that differ along one axis only. Every rank must create
        # every group, in the same order, even the groups it is not in.
        sizes = {"pp": pp, "dp": dp, "tp": tp}
        rank_at = lambda c: grid_rank(c["pp"], c["dp"], c["tp"], dp, tp)
        for axis in ("tp", "dp", "pp"):
            first, second = [a for a in ("pp", "dp", "tp") if a != axis]
            for i in range(sizes[first]):
                for j in range(sizes[second]):
                    ranks = [rank_at({first: i, second: j, axis: k}) for k in range(sizes[axis])]
                    group = dist.new_group(ranks, timeout=timeout, group_desc=axis)
                    if rank in ranks:
                        setattr(self, f"{axis}_group", group if sizes[axis] > 1 else None)
        if self.pp_rank > 0:
            self.pp_prev = grid_rank(self.pp_rank - 1, self.dp_rank, self.tp_rank, dp, tp)
        if self.pp_rank < pp - 1:
            self.pp_next = grid_rank(self.pp_rank + 1, self.dp_rank, self.tp_rank, dp, tp)

    @property
    def is_first_stage(self):
        return self.pp_rank == 0

    @property
    def is_last_stage(self):
        return self.pp_rank == self.pp - 1


def init_distributed(dp, tp, pp, device_type, timeout_s=None):
    """Start torch.distributed when launched by torchrun (WORLD_SIZE set) and build the layout.
    dp=0 means "whatever is left": world_size / (tp * pp). timeout_s: how long any collective waits for
    its peers before it fails (None: torch's default, 10 or 30 minutes)."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    dp = resolve_dp(world_size, dp, tp, pp)  # before any process group: a bad layout fails fast, alone
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timeout)
    return ParallelLayout(dp, tp, pp, world_size, rank, timeout)


def tp_groups_across_nodes(dp, tp, pp, local_world_size):
    """The tensor-parallel groups (lists of global ranks) that are not all on one node, when every node
    runs local_world_size processes with consecutive ranks, as torchrun numbers them (LOCAL_WORLD_SIZE).
    A tp group is tp consecutive ranks (tp fastest), so none spans two nodes when tp divides
    local_world_size; otherwise its all-reduces, several per layer, cross the network between nodes."""
    spanning = []
    for p in range(pp):
        for d in range(dp):
            ranks = [grid_rank(p, d, t, dp, tp) for t in range(tp)]
            if len({r // local_world_size for r in ranks}) > 1:
                spanning.append(ranks)
    return spanning


def format_grid(dp, tp, pp):
    """The rank layout as text, one line per (pipeline stage, data-parallel replica): which global ranks
    hold the tensor-parallel slices of it."""
    lines = []
    for p in range(pp):
        for d in range(dp):
            ranks = [grid_rank(p, d, t, dp, tp) for t in range(tp)]
            lines.append(f"  stage {p} replica {d}: ranks {ranks}")
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


class GatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather along the last dimension forward; backward keeps only this rank's slice of the gradient.
    The backward assumes what follows the gather is the same computation on every rank (replicated), so
    every rank holds the same full gradient and its own slice of it is the whole story."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(group_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(group_size(ctx.group), dim=-1)[group_rank(ctx.group)].contiguous(), None


class ScatterToTensorParallelRegion(torch.autograd.Function):
    """Split: keep this rank's slice of the last dimension forward; all-gather the gradient backward. The input
    is the same on every rank (replicated), so its gradient is every rank's slice gradient side by side."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.chunk(group_size(group), dim=-1)[group_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        parts = [torch.empty_like(grad) for _ in range(group_size(ctx.group))]
        dist.all_gather(parts, grad, group=ctx.group)
        return torch.cat(parts, dim=-1), None


# With no group (one rank) every operator is the identity, so the same model code runs unsplit.
def copy_to_tp(x, group):
    return CopyToTensorParallelRegion.apply(x, group) if group_size(group) > 1 else x


def reduce_from_tp(x, group):
    return ReduceFromTensorParallelRegion.apply(x, group) if group_size(group) > 1 else x


def gather_from_tp(x, group):
    return GatherFromTensorParallelRegion.apply(x, group) if group_size(group) > 1 else x


def scatter_to_tp(x, group):
    return ScatterToTensorParallelRegion.apply(x, group) if group_size(group) > 1 else x


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
    one per layer.

    The weight is created empty: fill it with load_full (see the section's note)."""

    def __init__(self, in_features, out_features, bias=False, group=None, gather_output=False, copy_input=True):
        super().__init__()
        self.group, self.gather_output, self.copy_input = group, gather_output, copy_input
        self.out_per_rank = _divide(out_features, group_size(group), "out_features")
        self.weight = mark_sharded(nn.Parameter(torch.empty(self.out_per_rank, in_features)), 0, group)
        self.bias = mark_sharded(nn.Parameter(torch.zeros(self.out_per_rank)), 0, group) if bias else None

    def load_full(self, weight, bias=None):
        """weight (out_features, in_features) and bias (out_features,): full tensors or slice readers."""
        load_shard(self.weight, weight)
        if bias is not None:
            load_shard(self.bias, bias)

    def forward(self, x):
        if self.copy_input:
            x = copy_to_tp(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by columns (input features): each rank multiplies its slice of the
    input by its slice of W, and the partial outputs are summed (g). With input_is_parallel=False the full
    input is first cut into slices here. The bias is replicated and added once, after the sum (added
    before, it would be counted tp times).

    The weight is created empty, as in ColumnParallelLinear: fill it with load_full."""

    def __init__(self, in_features, out_features, bias=False, group=None, input_is_parallel=True):
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        self.in_per_rank = _divide(in_features, group_size(group), "in_features")
        self.weight = mark_sharded(nn.Parameter(torch.empty(out_features, self.in_per_rank)), 1, group)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def load_full(self, weight, bias=None):
        """weight (out_features, in_features) and bias (out_features,): full tensors or slice readers."""
        load_shard(self.weight, weight)
        if bias is not None:
            load_shard(self.bias, bias)

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
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
    the (vocab_size, dim) table or a slice reader."""

    def __init__(self, vocab_size, dim, group=None):
        super().__init__()
        self.group, self.vocab_size = group, vocab_size
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
        logits = logits.float()
        n, n_local = logits.shape
        # the target's logit lives on exactly one rank: the others contribute zero to the sum
        local_target = targets - vocab_start
        here = (local_target >= 0) & (local_target < n_local)
        local_target = local_target.masked_fill(~here, 0)
        if n_local > 0:
            max_logit = logits.max(dim=-1).values
            target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)
        else:  # this rank holds only vocabulary padding
            max_logit = torch.full((n,), float("-inf"), device=logits.device)
            target_logit = torch.zeros(n, device=logits.device)
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
        return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index)
    losses = VocabParallelCrossEntropy.apply(logits, targets, vocab_start, group, ignore_index)
    return losses.sum() / (targets != ignore_index).sum().clamp(min=1)


# -----------------------------------------------------------------------------
# 3. Pipeline parallelism
#
# Each stage holds a contiguous run of blocks (the first also the embedding, the last the final norm, the
# head and the loss). A step's batch is cut into m microbatches, the gradient-accumulation steps, which go
# through the stages like work down an assembly line: a stage receives a microbatch's activations from the
# previous stage, runs its blocks, sends the result on; in the backward pass the gradient of those
# activations comes back from the next stage and the gradient of the stage's input goes to the previous.
# While the line fills and drains some stages wait: with every forward and backward taking the same time,
# the idle share of a step, the "bubble", is (pp - 1) / (m + pp - 1) (GPipe, section 2.2).
#
# A schedule is written once, as each stage's ordered list of actions ('F', i) and ('B', i): run
# microbatch i's forward or backward. `run_schedule` walks that list on a real stage; `schedule_timeline`
# (at the end of this file) places the very same lists in time slots for the printed picture. Both
# schedules below have the same bubble; they differ in memory: a stage keeps a microbatch's activations
# from its forward to its backward.
#
# The executor's one invariant: after action k a stage sends what action k produced (a forward's output
# to the next stage, a backward's input gradient to the previous) and posts the receive that action k+1
# needs, both in one batch_isend_irecv. Each direction between two neighbours is first in, first out, and
# both walk their lists in order, so what one side sends k-th is what the other receives k-th: neighbours
# always agree on which microbatch a message belongs to, with no tag or header.
#
# NCCL's rule: the first batch_isend_irecv that uses a process group must be joined by every rank of that
# group (here the default group, the whole world). PipelineComm's constructor therefore runs a barrier on
# the world, which every rank reaches while it builds its pipeline, so the first point-to-point exchange is
# never a group's first collective. Gloo has no such rule; the barrier costs nothing that matters.


def afab_actions(pp, stage, m):
    """GPipe, all forward then all backward: simple, but at the turn every stage holds the activations of
    all m microbatches."""
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b_actions(pp, stage, m):
    """1F1B (PipeDream-Flush): a stage runs a microbatch's backward as soon as its gradient can have come
    back, so it never holds more than pp - stage microbatches' activations, whatever m is."""
    # warm-up: forwards only. Microbatch 0 must still go through the pp - stage - 1 later stages and come
    # back before its backward can run here: fill that wait with as many forwards (Megatron's
    # num_warmup_microbatches), or all m when there are fewer
    warmup = min(pp - stage - 1, m)
    actions = [("F", i) for i in range(warmup)]
    # steady state: each new forward is followed by the oldest waiting backward
    for i in range(m - warmup):
        actions += [("F", warmup + i), ("B", i)]
    # cool-down: the backwards of the microbatches still in flight
    actions += [("B", i) for i in range(m - warmup, m)]
    return actions


SCHEDULES = {"afab": afab_actions, "1f1b": one_f_one_b_actions}


class PipelineComm:
    """What a stage needs to talk to its neighbours: its index, the number of stages, the global ranks of
    the previous and next stage (None at either end), and what travels between them: every message is a
    tensor of `dtype` and of the shape message_shape(x), x being the microbatch's token ids, which every
    stage has: so no shape or dtype is ever negotiated at run time. The caller chooses both; the model's is
    (batch, seq_len, hidden_size), which from_layout gives.

    The model's dtype is that of the residual stream, the parameters' dtype (fp32 under autocast too: the
    embedding output is fp32, and adding a bf16 sublayer output to it stays fp32). Sending bf16 instead would
    round the residual stream at every stage boundary, which one process never does.

    Every rank of the world must build its PipelineComm (the barrier below: see NCCL's rule above)."""

    def __init__(self, stage, pp, prev_rank, next_rank, message_shape, dtype=torch.float32, device="cpu"):
        self.stage, self.pp, self.prev_rank, self.next_rank = stage, pp, prev_rank, next_rank
        self.message_shape, self.dtype, self.device = message_shape, dtype, torch.device(device)
        if dist.is_initialized():
            dist.barrier()  # the first collective of the world group: not a batch_isend_irecv

    @classmethod
    def from_layout(cls, layout, hidden_size, device, dtype=torch.float32):
        return cls(layout.pp_rank, layout.pp, layout.pp_prev, layout.pp_next,
                   lambda x: (*x.shape, hidden_size), dtype, device)

    @property
    def is_first(self):
        return self.prev_rank is None

    @property
    def is_last(self):
        return self.next_rank is None

    def exchange(self, send, send_to, recv_for, microbatches):
        """Send `send` (or nothing) to rank `send_to`, and receive the input of the action `recv_for` (or
        nothing): activations from the previous stage for a forward, the output's gradient from the next
        stage for a backward. Both go in one batch_isend_irecv, waited for together. A send does not
        complete before its receiver has posted the matching receive (so with gloo, measured here, and
        NCCL), so a send then a receive, one after the other, would deadlock wherever two neighbours each
        send first (1F1B's steady state: one sends activations forward while the other sends gradients
        back); posted together, they cannot."""
        ops, received = [], None
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send.to(self.dtype).contiguous(), send_to))
        if recv_for is not None:
            op, i = recv_for
            peer = self.prev_rank if op == "F" else self.next_rank
            if peer is not None:
                shape = self.message_shape(microbatches[i][0])
                received = torch.empty(shape, dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, received, peer))
        if ops:
            try:
                for request in dist.batch_isend_irecv(ops):
                    request.wait()
            except RuntimeError as e:  # a neighbour died or stopped answering: say which, and what was awaited
                waits = [f"send to rank {send_to} (stage {self._stage_of(send_to)})"] if send is not None else []
                if received is not None:
                    what = "activations" if recv_for[0] == "F" else "output gradient"
                    waits.append(f"receive the {what} of microbatch {recv_for[1]} from rank {peer} "
                                 f"(stage {self._stage_of(peer)})")
                raise RuntimeError(f"pipeline stage {self.stage} waited to {' and '.join(waits)}: {e}") from e
        return received

    def _stage_of(self, rank):
        return self.stage - 1 if rank == self.prev_rank else self.stage + 1


def run_schedule(actions, model, microbatches, comm, autocast=nullcontext(), loss_multiplier=1.0,
                 set_grad_sync=None):
    """Run one stage's list of actions over microbatches [(x, y), ...] (token ids and targets; every stage
    has them, the first uses x, the last y, all take the message shapes from x). Gradients accumulate in
    the stage's parameters. Returns this stage's part of the mean loss over the microbatches (a tensor): on
    the last stage the loss, on the others their auxiliary loss (zero without one); summed over the stages
    it is the loss one process reports.

    `model(x, targets)` returns (output, loss): on the last stage the logits and the loss (cross-entropy
    plus any auxiliary loss of its blocks), on the others the hidden states and an auxiliary loss or None
    (a mixture-of-experts router's balance loss), which must be backpropagated from this stage.
    `set_grad_sync(bool)` is called before each backward, True only before the last one this stage runs:
    a data-parallel gradient reducer hooks in there to communicate once per step. Without grad enabled
    (evaluation) give forwards only: nothing is kept for a backward."""
    m = len(microbatches)
    last_backward = max((k for k, (op, _) in enumerate(actions) if op == "B"), default=None)
    inputs, outputs = {}, {}  # microbatch -> what its backward needs, from its forward until then
    total = torch.zeros((), device=comm.device)
    received = comm.exchange(None, None, actions[0], microbatches)
    for k, (op, i) in enumerate(actions):
        if op == "F":
            x, y = microbatches[i]
            if not comm.is_first:
                x = received.requires_grad_(torch.is_grad_enabled())  # its .grad is what goes back
            with autocast:
                out, loss = model(x, y if comm.is_last else None)
            if loss is not None:
                loss = loss / m  # the mean over microbatches: the one place the loss is scaled
                total += loss.detach().float()
            if torch.is_grad_enabled():
                inputs[i], outputs[i] = x, (None if comm.is_last else out, loss)
            send, send_to = (None, None) if comm.is_last else (out.detach(), comm.next_rank)
        else:
            if set_grad_sync is not None:
                set_grad_sync(k == last_backward)
            x, (out, loss) = inputs.pop(i), outputs.pop(i)
            if comm.is_last:
                (loss * loss_multiplier).backward()
            else:
                # the output's gradient from the next stage, plus this stage's own auxiliary loss if any
                tensors, grads = [out], [received.to(out.dtype)]
                if loss is not None:
                    tensors, grads = tensors + [loss * loss_multiplier], grads + [None]
                torch.autograd.backward(tensors, grads)
            send, send_to = (None, None) if comm.is_first else (x.grad, comm.prev_rank)
        recv_for = actions[k + 1] if k + 1 < len(actions) else None
        received = comm.exchange(send, send_to, recv_for, microbatches)
    return total


@torch.no_grad()
def pipeline_forward(model, microbatches, comm, autocast=nullcontext()):
    """Forward only (evaluation): every microbatch through the stages; returns this stage's part of the
    mean loss, as run_schedule."""
    actions = [("F", i) for i in range(len(microbatches))]
    return run_schedule(actions, model, microbatches, comm, autocast)


def tied_weight_group(layout, holder_stages):
    """The process group of the pipeline stages `holder_stages` (say the first and the last) of this rank's
    pipeline (same dp and tp rank), or None when one stage holds every copy. Every rank must call this, in
    the same order: every group is built by every rank."""
    stages = sorted(set(holder_stages))
    group = None
    if len(stages) < 2:
        return None
    for d in range(layout.dp):
        for t in range(layout.tp):
            ranks = [grid_rank(s, d, t, layout.dp, layout.tp) for s in stages]
            g = dist.new_group(ranks, timeout=layout.timeout, group_desc="tied weight")
            if layout.rank in ranks:
                group = g
    return group


def sync_tied_grads(copies, group):
    """Make the copies of one tied weight take the same step, the step of the single shared matrix in one
    process: its gradient is the sum of every copy's (one from the input side, the embedding; one from the
    output side, the head). `copies` are the copies this rank holds (none, one, or several when one rank
    holds two model chunks that each have one), `group` the ranks holding the others (None: all are here).
    Call it after the step's last backward, before the gradients are averaged across data-parallel ranks."""
    if not copies:
        return
    # a new tensor (sum starts from 0): the copies' own gradients are replaced, never reduced in place
    total = sum(w.grad if w.grad is not None else torch.zeros_like(w) for w in copies)
    if group is not None:
        dist.all_reduce(total, group=group)
    for i, w in enumerate(copies):
        w.grad = total if i == 0 else total.clone()


# -----------------------------------------------------------------------------
# 4. Data parallelism and ZeRO-1
#
# Every data-parallel rank holds the same parameters and runs its own slice of the global batch, so its
# gradient is the mean over its slice; the mean over the whole batch is the average of the ranks'
# gradients. Averaging is one collective per bucket of parameters, launched from a backward hook the
# moment the bucket's last gradient is ready, so the communication of the layers near the output runs
# while backward is still computing the layers near the input (the overlap DistributedDataParallel has;
# Li et al. 2020, "PyTorch Distributed", section 3.2.3).
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
# A bucket is one flat tensor, so it holds parameters of one dtype only: a parameter whose dtype differs
# from the one before it starts a new bucket.
#
# The buckets are launched in their order, the same on every rank, even when they fill in another order:
# collectives on a group must be issued in the same order by every rank, and the order gradients arrive
# in depends on the data (an MoE expert that got tokens on one replica and none on another has a gradient
# during backward on the first, only in finish() on the second). A bucket that is full waits for the ones
# before it (as DistributedDataParallel's reducer does); out of order, two ranks would add up different
# buckets, a mismatch error when their sizes differ and silently wrong gradients when they do not.

# torch 2.13 renamed the single-tensor collectives (the old names still work, with a warning)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Bucket:
    """A group of parameters whose gradients travel as one flat tensor (padded to a multiple of dp)."""

    def __init__(self, params, dp):
        self.params = params
        self.offsets, n = [], 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.shard_size = (n + dp - 1) // dp  # elements each data-parallel rank owns
        self.flat = torch.zeros(self.shard_size * dp, dtype=params[0].dtype, device=params[0].device)
        self.reset()

    def reset(self):
        self.ready = set()  # indices of the parameters whose gradient is in `flat`
        self.work = None  # the in-flight collective
        self.shard = None  # with sharding: the reduced gradient of this rank's slice


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
    before it is reduced, so call finish() after that addition."""

    def __init__(self, params, group, bucket_size_mb=25.0, shard=False, deferred=()):
        self.group, self.shard = group, shard
        self.dp, self.dp_rank = group_size(group), group_rank(group)
        self.sync = True
        deferred_ids = {id(p) for p in deferred}
        params = [p for p in params if p.requires_grad]
        early = [p for p in params if id(p) not in deferred_ids]
        late = [p for p in params if id(p) in deferred_ids]
        # backward produces gradients roughly in the reverse order of the forward pass: bucket them that way
        self.buckets, current, size = [], [], 0
        capacity = max(1, int(bucket_size_mb * 2 ** 20))
        for p in reversed(early):
            if current and p.dtype != current[0].dtype:  # one dtype per flat buffer
                self.buckets.append(_Bucket(current, self.dp))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= capacity:
                self.buckets.append(_Bucket(current, self.dp))
                current, size = [], 0
        if current:
            self.buckets.append(_Bucket(current, self.dp))
        for dtype in dict.fromkeys(p.dtype for p in late):
            self.buckets.append(_Bucket([p for p in late if p.dtype == dtype], self.dp))
        self.where = {}
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self.where[p] = (b, i)
        self.hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in early]
        self.launched = 0  # collectives launched since the last finish() (the next bucket to launch); tests read it

    def set_grad_sync(self, sync):
        self.sync = sync

    def _grad_ready(self, p):
        if not self.sync:
            return  # a gradient-accumulation micro-step: keep accumulating in p.grad
        bucket, i = self.where[p]
        if i in bucket.ready:
            raise RuntimeError("a gradient became ready twice in one synchronised step: call set_grad_sync(False) "
                               "before the backward of every micro-batch but the last")
        self._copy_in(bucket, i)
        # launch, in bucket order, every bucket that is full and has only launched buckets before it
        while self.launched < len(self.buckets) and self._full(self.buckets[self.launched]):
            self._launch(self.buckets[self.launched])

    @staticmethod
    def _full(bucket):
        return len(bucket.ready) == len(bucket.params)

    def _copy_in(self, bucket, i):
        p, start = bucket.params[i], bucket.offsets[i]
        view = bucket.flat[start:start + p.numel()]
        view.copy_(p.grad.reshape(-1)) if p.grad is not None else view.zero_()
        bucket.ready.add(i)

    def _launch(self, bucket):
        self.launched += 1
        if self.dp == 1:
            return
        if self.shard:
            bucket.shard = torch.empty(bucket.shard_size, dtype=bucket.flat.dtype, device=bucket.flat.device)
            bucket.work = _reduce_scatter_single(bucket.shard, bucket.flat, group=self.group, async_op=True)
        else:
            bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    def finish(self):
        """Wait for every bucket's collective (launching the ones the hooks did not, in bucket order:
        deferred parameters, parameters that got no gradient this step, the buckets after them) and point
        each p.grad at its part of the result."""
        for bucket in self.buckets[self.launched:]:
            for i in range(len(bucket.params)):
                if i not in bucket.ready:
                    self._copy_in(bucket, i)
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()  # sync point: the gradient is needed from here on
            # the sum over ranks / dp = the mean gradient over the global batch
            if self.shard:  # this rank's slice of the mean, zero elsewhere (the other ranks' slices)
                lo, hi = self.dp_rank * bucket.shard_size, (self.dp_rank + 1) * bucket.shard_size
                if self.dp > 1:
                    bucket.flat[lo:hi].copy_(bucket.shard).div_(self.dp)
                bucket.flat[:lo].zero_()
                bucket.flat[hi:].zero_()
            elif self.dp > 1:
                bucket.flat.div_(self.dp)
            for p, start in zip(bucket.params, bucket.offsets):
                p.grad = bucket.flat[start:start + p.numel()].view_as(p)
            bucket.reset()
        self.sync, self.launched = True, 0

    def owned_pieces(self):
        """(param, start, end): the range of each parameter's flattened elements this rank owns under
        sharding. Each parameter has at most one range: it is contiguous in its bucket, so is the slice."""
        pieces = []
        for bucket in self.buckets:
            lo, hi = self.dp_rank * bucket.shard_size, (self.dp_rank + 1) * bucket.shard_size
            for p, start in zip(bucket.params, bucket.offsets):
                a, b = max(lo, start), min(hi, start + p.numel())
                if a < b:
                    pieces.append((p, a - start, b - start))
        return pieces


class ZeroOneAdamW(torch.optim.Optimizer):
    """AdamW with its states partitioned across the data-parallel group (ZeRO stage 1).

    Takes parameter groups like torch.optim.AdamW (per-group lr and weight_decay) and owns the gradient
    averaging too (`self.grad_sync`, a sharded GradientBuckets): do not also all-reduce the gradients, or
    wrap the model in DistributedDataParallel, or they are reduced twice. Per step:
        backward (hooks reduce-scatter the buckets) -> grad_sync.finish() -> [clip] -> step() (AdamW on this
        rank's slice, then all-gather the updated slices)
    The update is torch.optim.AdamW's, element for element: decoupled weight decay p -= lr * wd * p, then
    p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps) (Loshchilov & Hutter 2019).
    The learning rate is read from self.param_groups at every step, so a schedule that writes
    group['lr'] reaches the update.

    step(found_inf) skips the update where found_inf (a 0-dim float tensor on the parameters' device, the
    argument torch's fused AdamW takes) is 1: weights, moments and step counter stay exactly as they were.
    The choice is made on the device (torch.where), so a step whose gradient is not finite is skipped
    without the host waiting for the device; the step counter lives on the device for the same reason,
    and the bias corrections are computed there from it."""

    def __init__(self, params, group=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 bucket_size_mb=25.0, deferred=()):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.group = group
        all_params = [p for g in self.param_groups for p in g["params"]]
        self.grad_sync = GradientBuckets(all_params, group, bucket_size_mb, shard=True, deferred=deferred)
        self.group_of = {p: g for g in self.param_groups for p in g["params"]}
        # the moments of this rank's slice only, created now so that their size can be reported at start-up
        for p, start, end in self.grad_sync.owned_pieces():
            self.state[p] = {"step": torch.zeros((), device=p.device), "flat_range": (start, end),
                             "exp_avg": torch.zeros(end - start, dtype=p.dtype, device=p.device),
                             "exp_avg_sq": torch.zeros(end - start, dtype=p.dtype, device=p.device)}

    @torch.no_grad()
    def step(self, found_inf=None):
        for p, state in self.state.items():
            group = self.group_of[p]
            lr, wd, (beta1, beta2), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
            start, end = state["flat_range"]
            param = p.view(-1)[start:end]  # a view: updating it updates p
            grad = p.grad.view(-1)[start:end]
            exp_avg, exp_avg_sq, t = state["exp_avg"], state["exp_avg_sq"], state["step"] + 1
            new_avg = exp_avg.lerp(grad, 1 - beta1)
            new_avg_sq = (exp_avg_sq * beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (new_avg_sq.sqrt() / (1 - beta2 ** t).sqrt()).add_(eps)
            new_param = (param * (1 - lr * wd)).sub_(lr / (1 - beta1 ** t) * new_avg / denom)
            if found_inf is None:
                updates = ((param, new_param), (exp_avg, new_avg), (exp_avg_sq, new_avg_sq), (state["step"], t))
            else:  # the old values where found_inf: a NaN in the new ones is never selected
                skip = found_inf.bool()
                updates = [(old, torch.where(skip, old, new)) for old, new in
                           ((param, new_param), (exp_avg, new_avg), (exp_avg_sq, new_avg_sq), (state["step"], t))]
            for old, new in updates:
                old.copy_(new)
        self._all_gather_params()

    def _all_gather_params(self):
        """Every rank updated its slice of each bucket; gather the slices so that every rank has the
        whole updated model."""
        gs = self.grad_sync
        if gs.dp == 1:
            return
        gathered = []
        for bucket in gs.buckets:
            full = torch.empty_like(bucket.flat)
            for p, start in zip(bucket.params, bucket.offsets):
                full[start:start + p.numel()].copy_(p.detach().reshape(-1))
            mine = full[gs.dp_rank * bucket.shard_size:(gs.dp_rank + 1) * bucket.shard_size].clone()
            gathered.append((bucket, full, _all_gather_single(full, mine, group=self.group, async_op=True)))
        for bucket, full, work in gathered:
            work.wait()
            for p, start in zip(bucket.params, bucket.offsets):
                p.detach().copy_(full[start:start + p.numel()].view_as(p))


def optimizer_state_bytes(optimizer):
    """Bytes of every tensor in an optimizer's state on this rank (the moments; the step counters too)."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if torch.is_tensor(v))


# -----------------------------------------------------------------------------
# The timeline printer: the pipeline schedules' action lists (section 3), placed in unit time slots.


def schedule_timeline(schedule, pp, m):
    """Each stage runs its actions in order, each in one time slot, as early as the stage is free and the
    action's input is ready: a forward of microbatch i after the previous stage's forward of i, a backward
    after the next stage's backward of i. Returns one row per stage: the action in each slot, None if idle.
    A real backward takes about twice a forward; the bubble fraction is the same, since the fill and the
    drain stretch with the work."""
    lists = [SCHEDULES[schedule](pp, s, m) for s in range(pp)]
    finish = {}  # (stage, action) -> the slot after it
    nxt, free = [0] * pp, [0] * pp
    while any(nxt[s] < len(lists[s]) for s in range(pp)):
        placed = False
        for s in range(pp):
            while nxt[s] < len(lists[s]):
                op, i = lists[s][nxt[s]]
                source = s - 1 if op == "F" else s + 1  # the stage the input comes from
                if 0 <= source < pp and (source, (op, i)) not in finish:
                    break  # its input is not ready yet
                ready = finish[(source, (op, i))] if 0 <= source < pp else 0
                start = max(free[s], ready)
                finish[(s, (op, i))] = free[s] = start + 1
                nxt[s] += 1
                placed = True
        if not placed:
            raise RuntimeError(f"schedule {schedule!r} deadlocks at pp={pp}, m={m}: every stage waits on another")
    rows = [[None] * max(free) for _ in range(pp)]
    for (s, action), end in finish.items():
        rows[s][end - 1] = action
    return rows


def bubble_fraction(rows):
    """The share of stage-time slots spent idle."""
    return sum(row.count(None) for row in rows) / sum(len(row) for row in rows)


def format_timeline(schedule, pp, m):
    """The timeline as text, one row per stage, with the microbatches each stage holds and the bubble."""
    rows = schedule_timeline(schedule, pp, m)
    width = len(str(m - 1)) + 1
    lines = [f"{schedule}: pp={pp} stages, m={m} microbatches; one slot per forward (F) or backward (B), . idle"]
    for s, row in enumerate(rows):
        cells = ["." * width if a is None else f"{a[0]}{a[1]}".ljust(width) for a in row]
        lines.append(f"stage {s} | " + " ".join(cells))
    # what each stage holds: microbatches between their forward and their backward
    held = []
    for s in range(pp):
        alive = peak = 0
        for op, _ in SCHEDULES[schedule](pp, s, m):
            alive += 1 if op == "F" else -1
            peak = max(peak, alive)
        held.append(peak)
    lines.append("activations held at most (microbatches): " + ", ".join(f"stage {s}: {h}" for s, h in enumerate(held)))
    lines.append(f"bubble: {bubble_fraction(rows):.1%} of the slots idle (measured on this timeline); "
                 f"theory (pp - 1) / (m + pp - 1) = {pp - 1}/{m + pp - 1} = {(pp - 1) / (m + pp - 1):.1%}")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Print a pipeline schedule as a timeline, one row per stage.")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    parser.add_argument("--pp", type=int, default=4, help="pipeline stages")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per step (m)")
    args = parser.parse_args()
    print(format_timeline(args.schedule, args.pp, args.microbatches))
