"""
3D parallelism in plain torch.distributed: process groups, tensor parallelism (Megatron-LM style).

Read top to bottom:
  1. The layout: how the world of ranks is cut into data-, tensor- and pipeline-parallel groups.
  2. Tensor parallelism: the four communication operators as autograd functions, then the layers built
     from them (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding) and the vocab-parallel
     cross-entropy.

Every layer here works on its own, given only torch and a process group (None means "not split": the
layer is then an ordinary nn.Linear / nn.Embedding), so it can be lifted into another project.

Reference: Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using
Model Parallelism" (the f and g operators, section 3).
"""
import math
import os

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


class ParallelLayout:
    """Cuts `world_size` ranks into a dp x tp x pp grid and builds one process group per row of it.

    Ranks are numbered with tp fastest, then dp, then pp:  rank = (pp_rank * dp + dp_rank) * tp + tp_rank.
    Tensor parallelism talks on every layer (several collectives per block), so its ranks are neighbours,
    which on a real cluster means the same node and its fast links. Data parallelism talks once per step,
    pipeline parallelism only sends activations between neighbouring stages, so both can span nodes.

    With world_size 1 no group is built and every group is None: the single-process path.
    """

    def __init__(self, dp, tp, pp, world_size=1, rank=0):
        if dp * tp * pp != world_size:
            raise ValueError(f"the layout dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} ranks does not match the "
                             f"world size {world_size}: set --dp, --tp and --pp so that their product is {world_size} "
                             f"(leave dp=0 to have it computed as world_size / (tp * pp))")
        self.dp, self.tp, self.pp, self.world_size, self.rank = dp, tp, pp, world_size, rank
        self.tp_rank = rank % tp
        self.dp_rank = (rank // tp) % dp
        self.pp_rank = rank // (tp * dp)
        self.tp_group = self.dp_group = self.pp_group = None
        self.pp_prev = self.pp_next = None  # global ranks of the neighbouring pipeline stages
        if world_size == 1:
            return
        # every rank must create every group, in the same order, even the groups it is not in
        grid = lambda p, d, t: (p * dp + d) * tp + t
        for p in range(pp):
            for d in range(dp):
                ranks = [grid(p, d, t) for t in range(tp)]
                g = dist.new_group(ranks)
                if rank in ranks:
                    self.tp_group = g if tp > 1 else None
        for p in range(pp):
            for t in range(tp):
                ranks = [grid(p, d, t) for d in range(dp)]
                g = dist.new_group(ranks)
                if rank in ranks:
                    self.dp_group = g if dp > 1 else None
        for d in range(dp):
            for t in range(tp):
                ranks = [grid(p, d, t) for p in range(pp)]
                g = dist.new_group(ranks)
                if rank in ranks:
                    self.pp_group = g if pp > 1 else None
                    self.pp_ranks = ranks
        if pp > 1:
            self.pp_prev = self.pp_ranks[self.pp_rank - 1] if self.pp_rank > 0 else None
            self.pp_next = self.pp_ranks[self.pp_rank + 1] if self.pp_rank < pp - 1 else None

    @property
    def is_first_stage(self):
        return self.pp_rank == 0

    @property
    def is_last_stage(self):
        return self.pp_rank == self.pp - 1

    def describe(self):
        return (f"rank {self.rank}: dp_rank {self.dp_rank}/{self.dp}  tp_rank {self.tp_rank}/{self.tp}  "
                f"pp_rank {self.pp_rank}/{self.pp}")


def init_distributed(dp, tp, pp, device_type):
    """Start torch.distributed when launched by torchrun (WORLD_SIZE set) and build the layout.
    dp=0 means "whatever is left": world_size / (tp * pp)."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
    if dp == 0:
        if world_size % (tp * pp) != 0:
            raise ValueError(f"the world size {world_size} is not divisible by tp * pp = {tp} * {pp}: "
                             f"launch a multiple of {tp * pp} processes or change --tp/--pp")
        dp = world_size // (tp * pp)
    return ParallelLayout(dp, tp, pp, world_size, rank)


# -----------------------------------------------------------------------------
# 2. Tensor parallelism: the communication operators
#
# A column-parallel linear splits its output features across ranks: every rank needs the whole input,
# produces a slice of the output. A row-parallel linear splits its input features: every rank holds a
# slice of the input, produces a partial sum of the whole output. Chaining column -> row (attention:
# QKV -> output projection; MLP: up -> down) needs exactly one all-reduce in the forward pass (g, after
# the row-parallel layer) and one in the backward pass (f, before the column-parallel layer). When several
# column-parallel layers read one input (q, k, v), f is applied once to that input (copy_input=False below).


# Measurement aid, off by default: set `parallel.tp_comm_bytes = {}` and every tensor-parallel collective
# in this file adds the bytes of the tensor this rank contributes, keyed by the collective ("all_reduce",
# "all_gather"); set it back to None to stop. Unused, it costs one `is None` test per collective.
tp_comm_bytes = None


def _count(kind, tensor):
    if tp_comm_bytes is not None:
        tp_comm_bytes[kind] = tp_comm_bytes.get(kind, 0) + tensor.numel() * tensor.element_size()


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
        _count("all_reduce", grad)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward. Each rank computed a partial sum of the
    output; the sum is the output, and its gradient flows unchanged to every partial."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone(memory_format=torch.contiguous_format)  # all_reduce works in place: leave the caller's x
        _count("all_reduce", x)
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
        _count("all_gather", x)
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
        _count("all_gather", grad)
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

    The weight is left uninitialised, like the model's other parameters (Transformer.init_weights fills
    them). On its own: `layer.weight.copy_(shard_of(full_weight, layer.weight))`, the same for the bias."""

    def __init__(self, in_features, out_features, bias=False, group=None, gather_output=False, copy_input=True):
        super().__init__()
        self.group, self.gather_output, self.copy_input = group, gather_output, copy_input
        self.out_per_rank = _divide(out_features, group_size(group), "out_features")
        self.weight = mark_sharded(nn.Parameter(torch.empty(self.out_per_rank, in_features)), 0, group)
        self.bias = mark_sharded(nn.Parameter(torch.zeros(self.out_per_rank)), 0, group) if bias else None

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

    The weight is left uninitialised, as in ColumnParallelLinear: fill it with shard_of(full_weight, ...)."""

    def __init__(self, in_features, out_features, bias=False, group=None, input_is_parallel=True):
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        self.in_per_rank = _divide(in_features, group_size(group), "in_features")
        self.weight = mark_sharded(nn.Parameter(torch.empty(out_features, self.in_per_rank)), 1, group)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

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
    range, writes zeros for the others, and the all-reduce (g) assembles every token's vector."""

    def __init__(self, vocab_size, dim, group=None):
        super().__init__()
        self.group, self.vocab_size = group, vocab_size
        self.rows_per_rank = padded_vocab_size(vocab_size, group_size(group)) // group_size(group)
        self.vocab_start = group_rank(group) * self.rows_per_rank
        self.weight = mark_sharded(nn.Parameter(torch.empty(self.rows_per_rank, dim)), 0, self.group)
        self.weight.vocab_size = vocab_size  # rows past it are padding: zero at init, never looked up

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
        _count("all_reduce", max_logit)
        dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=group)
        _count("all_reduce", target_logit)
        dist.all_reduce(target_logit, group=group)
        exp = (logits - max_logit.unsqueeze(-1)).exp_()  # the one (N, V_local) temporary; becomes the softmax
        sum_exp = exp.sum(dim=-1)
        _count("all_reduce", sum_exp)
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
