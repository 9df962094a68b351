"""
Expert parallelism: the experts of a mixture of experts spread over data-parallel ranks, each token
sent to its experts' rank and back with two all-to-alls (an autograd function, forward and
backward), and their gradients averaged over the ranks that hold the same experts.

A mixture-of-experts layer holds n_expert MLPs, but each token uses only k of them. Splitting every
expert across the tensor-parallel ranks (parallel.py) keeps every expert on every rank; expert
parallelism (GShard, section 2.2; Switch Transformer, section 5.4) instead places whole experts on
different ranks, so the number of experts can grow with the number of ranks. ep neighbouring
data-parallel ranks form an expert-parallel group (the layout, parallel.py): rank r of the group
holds experts r * n_expert / ep up to (r + 1) * n_expert / ep - 1, every rank still holds all the
other parameters (attention, router, shared experts), and every rank still runs its own micro-batch.

Each rank routes its own tokens as one process would (the capacity too, before anything moves),
then:
  1. counts: how many of its assignments go to each expert; the counts are exchanged first (an
     all-to-all of n_expert integers), so every rank knows how many rows it will receive from whom.
     Both are read back to the host once: all_to_all_single needs its split sizes as numbers.
  2. dispatch: the token rows, sorted by expert and so by destination rank, go to the ranks of their
     experts (all_to_all_single with uneven splits).
  3. each rank runs its local experts, each on its contiguous group of rows (the received rows are
     sorted from source-rank-major to expert-major first, and back after).
  4. return: a second all-to-all, the reverse of the first, sends every output row to its token's
     rank, where the router weights combine them (model.MixtureOfExperts).
Backward runs the same two exchanges in reverse (AllToAll's backward), so each expert's weight
gradient sums the contributions of every rank that sent it tokens: the gradient of the ep ranks'
summed losses. The ranks holding the same experts (the expert_dp_group: dp / ep of them, times cp
under context parallelism) add theirs, and dividing by dp (dp * cp) gives the mean over the global
batch that one process computes: ExpertSplit, at the end of this file, runs the experts' own reducer
over that group, dividing by dp x cp.

Cost: each rank sends every token row routed to another rank's expert twice forward (the token, its
output) and twice backward (their gradients): 4 * rows * n_embd * bytes per element per layer, plus
the counts; none of it overlaps with compute here. Memory: each rank holds n_expert / ep experts'
weights, gradients and AdamW moments (ZeRO-1 shards the moments over the expert_dp_group, ZeRO-2 the
gradients too, ZeRO-3 the weights as well: zero.py). With tp > 1 every tensor-parallel rank
exchanges the same rows with its own ep group (each keeps its slice of the experts). An expert that
receives no rows still runs, on zero rows: its zero gradient arrives during backward as a busy
expert's does, so the gradient buckets fill at the same point on every rank.
"""

import math
from collections import namedtuple

import torch
import torch.distributed as dist

from parallel import Reducers, group_rank, group_size

ExpertSplits = namedtuple("ExpertSplits", "send recv recv_counts")


def exchange_expert_counts(counts, group):
    """counts: (n_expert,) int64 on the device, this rank's assignments per (global) expert, the
    experts of group rank j being the j-th block of n_expert / ep. Returns ExpertSplits:
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
    # n_expert / ep counts to each rank
    dist.all_to_all_single(recv_counts, counts, group=group)
    both = torch.cat([counts, recv_counts]).tolist()  # host-device sync
    n = len(both) // 2
    return ExpertSplits(
        both[:n],
        [both[n + j * n // ep : n + (j + 1) * n // ep] for j in range(ep)],
        recv_counts.view(ep, -1),
    )


class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits: this rank sends send_splits[j] rows of x (in order,
    rank 0's first) to group rank j and receives recv_splits[j] rows from it, stacked in rank order.
    Its backward is the same exchange reversed: every received row's gradient goes back to the rank
    that sent the row, into the place the row came from (the send and receive sizes swap). `sent`
    (an ExpertParallelDispatch) adds the bytes this rank sends to other ranks to its bytes_sent,
    both ways."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group, sent):
        ctx.splits, ctx.group, ctx.sent = (send_splits, recv_splits), group, sent
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        work = dist.all_to_all_single(
            out, x.contiguous(), recv_splits, send_splits, group=group, async_op=True
        )
        work.wait()
        sent.bytes_sent += _bytes_to_others(x, send_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        grad_x = grad.new_empty((sum(send_splits), *grad.shape[1:]))
        work = dist.all_to_all_single(
            grad_x, grad.contiguous(), send_splits, recv_splits, group=ctx.group, async_op=True
        )
        work.wait()
        ctx.sent.bytes_sent += _bytes_to_others(grad, recv_splits, ctx.group)
        return grad_x, None, None, None, None


def _bytes_to_others(x, splits, group):
    row = math.prod(x.shape[1:]) * x.element_size()  # from the shape: x may have no rows at all
    return (sum(splits) - splits[group_rank(group)]) * row


def dispatch_to_experts(rows, splits, run_local_experts, group, sent):
    """rows: (n, C), this rank's kept token-to-expert assignments sorted by expert (n =
    sum(splits.send)); splits from exchange_expert_counts. run_local_experts(x, sizes) runs this
    rank's experts in order, the e-th on the next sizes[e] rows of x, and returns their outputs
    stacked the same way. Returns the (n, C') outputs in the order of `rows`. With group None (ep =
    1) this is run_local_experts(rows, splits.send)."""
    ep = group_size(group)
    if ep == 1:
        return run_local_experts(rows, splits.send)
    n_local = len(splits.recv[0])
    # rows to each rank
    send = [sum(splits.send[j * n_local : (j + 1) * n_local]) for j in range(ep)]
    recv = [sum(r) for r in splits.recv]  # rows from each rank
    # source-rank-major, expert-sorted within
    received = AllToAll.apply(rows, send, recv, group, sent)
    # expert-major: each received row's local expert; a stable sort keeps the sources in order
    expert_of_row = (
        torch.arange(n_local, device=rows.device)
        .repeat(ep)
        .repeat_interleave(splits.recv_counts.reshape(-1), output_size=sum(recv))
    )
    order = expert_of_row.argsort(stable=True)
    sizes = [sum(r[e] for r in splits.recv) for e in range(n_local)]
    out = run_local_experts(received[order], sizes)
    back = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))
    return AllToAll.apply(out[back], recv, send, group, sent)  # each output row to its token's rank


def expert_rows(model_cfg, tokens, ep=1):
    """(kept, received): the most token-to-expert assignments one rank keeps of its `tokens` (its
    sent rows) and the most rows its local experts receive from the ep ranks, at the capacity bound:
    each source rank sends an expert at most its capacity ceil(capacity_factor * N * k / E)
    (dropless: every assignment, all of them possibly to this rank's experts). At ep = 1 the two are
    the same."""
    E, k, N = model_cfg.n_expert, model_cfg.n_expert_per_token, tokens
    if model_cfg.capacity_factor == 0:
        return N * k, ep * N * k
    capacity = math.ceil(model_cfg.capacity_factor * N * k / E)
    return min(N * k, E * capacity), min(ep * N * k, E * capacity)


def exchange_bytes(model_cfg, tokens, ep, act_bytes):
    """The memory planner's count (tools/memory_plan.py): while an MoE layer's outputs travel back,
    the rows it sent, the rows it received, its experts' outputs and their reordered copy
    (dispatch_to_experts), beside the activations saved so far."""
    kept, received = expert_rows(model_cfg, tokens, ep)
    return (kept + 3 * received) * model_cfg.n_embd * act_bytes


class ExpertParallelDispatch:
    """model.LocalExperts across the ep group: the counts exchanged, the kept assignments sent to
    their experts' ranks and back by the two all-to-alls (see the top of this file). bytes_sent: the
    bytes this rank has sent to other ranks, forward and backward (the training log reads and resets
    it)."""

    def __init__(self, group):
        self.group, self.bytes_sent = group, 0

    def exchange_counts(self, counts):
        return exchange_expert_counts(counts, self.group)

    def __call__(self, rows, splits, run_local_experts):
        return dispatch_to_experts(rows, splits, run_local_experts, self.group, self)


def apply_expert_parallel(model, group):
    """Spread the routed experts of a model.Transformer over the ep group: group rank r keeps
    experts r * n_expert / ep up to (r + 1) * n_expert / ep - 1 of every mixture-of-experts layer,
    keyed by their global index (experts.5 is expert 5 at every ep, so checkpoints reshard between
    ep values), and reaches the others' through the all-to-all. Everything else stays whole on every
    rank. Returns the model."""
    ep, rank = group_size(group), group_rank(group)
    if ep == 1:
        return model
    for moe in model.moe_layers().values():
        n_local = moe.n_expert // ep
        for name in [name for name in moe.experts if int(name) // n_local != rank]:
            del moe.experts[name]
        moe.dispatch = ExpertParallelDispatch(group)
    return model


class ExpertSplit(Reducers):
    """The gradient reducer of a model under expert parallelism: two reducers of one kind
    (GradientBuckets, parallel.ShardedGradientBuckets, zero.GradientShards or
    zero.FullyShardedParameters, whatever the ZeRO stage), `dense` over the data-parallel group for
    every parameter but the experts, `experts` over the expert replicas (layout.expert_dp_group: the
    ranks holding the same experts; None when there is one: ep = dp). An expert's gradient on a rank
    is already the sum over the ep ranks that sent it tokens, so its sum over the expert replicas is
    the sum over all dp x cp ranks: the experts' reducer divides by the dense group's size (its
    `replicas`), not by its own. The optimizer's states of the experts are sharded over their
    replicas, as their gradients are (ZeRO-2) and their parameters (ZeRO-3: each block is then
    gathered by both, its experts over their group, the rest over the data-parallel group). It
    answers every call a reducer answers, as parallel.Reducers does: passing each to both, or to the
    one holding the parameter."""

    def __init__(self, dense, experts):
        experts.replicas = dense.replicas
        super().__init__(dense, experts)
