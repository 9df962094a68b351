"""
The pipeline schedules beyond 1F1B (parallel.py has the pipeline itself: the action lists of AFAB
and 1F1B, the executor of their forwards and backwards and the step's Pipeline): interleaved 1F1B,
zero bubble ZB-H1 and ZB-V, with the model chunks they place on each rank and the split backward the
zero-bubble ones need. Each schedule is still one function giving every rank's ordered list of
actions (op, microbatch, chunk), run by the same executor (ScheduleExecutor and SchedulePipeline
below: parallel.PipelineExecutor and parallel.Pipeline, extended through their hooks); `python
tools/timeline.py --schedule zbv --pp 4 --microbatches 8` draws them. Here too: every schedule's
table (SCHEDULES, afab and 1f1b included), the rules that refuse one that cannot run
(check_schedule), the bubbles (ideal_bubble) and the cut of the blocks into stages by their cost
(cost_cut).

  interleaved_1f1b  v chunks per rank: the bubble (pp - 1) / (v m + pp - 1) (Narayanan et al.
                    2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
                    Megatron-LM", section 2.2.2), for v times the point-to-point messages
  zero_bubble       ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.1): the
                    backward split in two, and the weights' half fills 1F1B's idle slots:
                    (pp - 1) / (3 m + pp - 1)
  zbv               ZB-V (same paper, section 6): two chunks per rank in a V, only the fill's
                    pp - 1 chunk-slots idle (forward = input backward = weight backward in time)

Chunks ("virtual stages"). With v chunks per rank the layers are cut into pp * v model stages and
rank r holds stages r, r + pp, r + 2 pp, ... (zbv: r and 2 pp - 1 - r, so the last rank turns the V
round and rank 0 holds both ends of the model). A microbatch then goes round the ring of ranks v
times, each time through a v-th of the layers: the fill and the drain take chunk-sized slots, a v-th
of a stage's, for v times the point-to-point messages. A rank's chunks are one Transformer
(model.py) whose parameters keep their whole-model names, so the optimizer, the gradient norm and
the checkpoints see one set of parameters whatever v is, and a checkpoint moves between any
chunkings. Between two chunks of one rank (the V's turn) the executor hands the message over in
memory.

The split backward (zero_bubble, zbv). A backward computes the gradient of the stage's input, which
the previous stage waits for, and the gradients of the weights, which nothing needs before the
optimizer step. For a linear layer y = x W^T they are dx = dy W and dW = dy^T x. The action 'B'
computes dx and keeps x and dy; 'W' computes dW from them later (WeightGradStore below, through the
tensor-parallel linears' `matmul` hook): the same matmuls as one backward, none twice. Parameters
other than the tensor-parallel linears' weights (norm gains, the embedding, a router, a row-parallel
bias) are cheap and get their gradients in B. What a rank holds between a microbatch's B and its W
is only the linears' x and dy.
"""

import functools
import itertools
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel import (
    ColumnParallelLinear,
    Pipeline,
    PipelineExecutor,
    RowParallelLinear,
    afab_actions,
    message_route,
    one_f_one_b_actions,
    stage_layers,
)


def virtual_stages(schedule, pp, rank, chunks=1):
    """The model stages (of pp * chunks) that pipeline rank `rank` holds, one per chunk in chunk
    order: rank, rank + pp, rank + 2 pp, ..., or for zbv's V rank and 2 pp - 1 - rank."""
    if schedule == "zbv":
        return (rank, 2 * pp - 1 - rank)
    return tuple(rank + c * pp for c in range(chunks))


def interleaved_order(pp, m, chunks):
    """The order of a rank's forwards under interleaving, as (microbatch, chunk): microbatches in
    groups of pp, each group through chunk 0, then chunk 1, ... A group of pp fills the ring
    exactly: when the rank has sent the group's last microbatch on, the first is back from its lap,
    ready for the next chunk. (With m not a multiple of pp the last group is smaller: evaluation's
    forwards only.)"""
    order = []
    for start in range(0, m, pp):
        group = range(start, min(start + pp, m))
        order += [(i, c) for c in range(chunks) for i in group]
    return order


def interleaved_1f1b_actions(pp, stage, m, chunks):
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2): 1F1B over chunk-sized work. The k-th
    forward is interleaved_order's k-th; the k-th backward takes the same microbatch through the
    chunks in reverse, the last chunk first. m must be a multiple of pp (check_schedule): a smaller
    last group would reach a chunk before the previous lap's microbatches have come round."""
    order = interleaved_order(pp, m, chunks)
    forwards = [("F", i, c) for i, c in order]
    backwards = [("B", i, chunks - 1 - c) for i, c in order]
    # warm-up: microbatch 0 makes v - 1 laps of the ring (pp forwards each) before its last chunk,
    # then, as in 1F1B, goes through the pp - stage - 1 later ranks and back. Megatron's warm-up has
    # 2 (pp - stage - 1) for this last part: slack for its synchronous sends, which the executor
    # here does not need (it never waits for a send); with the smaller warm-up the first rank holds
    # v pp chunk-sized microbatches, the pp whole ones of 1F1B, where Megatron's holds (1 + (pp - 1)
    # / (v pp)) times that (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    # Transformer Models", section 4.2.3). The bubble is the same.
    warmup = min((chunks - 1) * pp + pp - stage - 1, len(order))
    actions = forwards[:warmup]
    for k in range(len(order) - warmup):
        actions += [forwards[warmup + k], backwards[k]]
    return actions + backwards[len(order) - warmup :]


def zero_bubble_actions(pp, stage, m, chunks=1):
    """ZB-H1 (Qi et al. 2023, section 3.1): 1F1B with each backward split into B (the input's
    gradient, which the previous stage waits for) and W (the weights' gradients). B runs where
    1F1B's backward ran; W waits: stage s leaves its first s microbatches' W for the end, where
    1F1B's cool-down leaves the later stages idle, and runs each later W right after its B. With
    forward = B = W in time the bubble is (pp - 1) / (3 m + pp - 1) for m >= pp, a third of 1F1B's;
    a stage holds at most pp microbatches between F and W (1F1B's first stage's count), and what it
    holds after B is only the linears' x and dy."""
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
    # the delayed W's, in the drain's idle slots
    return actions + [("W", i, 0) for i in range(w, m)]


def zbv_actions(pp, stage, m, chunks=2):
    """ZB-V (Qi et al. 2023, section 6): two chunks per rank in a V (virtual_stages), the backward
    split as in zero_bubble. Rank r's chunk 0 is model stage r, its chunk 1 stage 2 pp - 1 - r:
    microbatches go down the ranks through the chunks 0 and come back up through the chunks 1, so
    the last rank runs both halves of the turn and rank 0 both ends of the model. In phases (with
    forward = B = W in time each slot is filled):
      1. 2 (pp - r) - 1 forwards of chunk 0 (the deeper the rank, the sooner its chunk 1 gets work);
      2. r pairs (chunk 1 forward, chunk 0 forward) while the V's second arm fills;
      3. pp - r triples (chunk 1 forward, B, W): the turn comes back;
      4. steady state: chunk 0's F, B, W, then chunk 1's, until every forward is done;
      5. cool-down: r pairs of B (chunks 0 and 1), then pp - r of (chunk 0's B, W), then the
         rest of the W's.
    The phases are written for at least 2 pp - 1 microbatches; with fewer, the actions of the
    microbatches that do not exist are left out (schedule_timeline checks the rest still runs)."""
    n = max(m, 2 * pp - 1)
    # the next microbatch of each op on each chunk
    count = {(op, c): 0 for op in "FBW" for c in (0, 1)}
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


SCHEDULES = {
    "afab": afab_actions,
    "1f1b": one_f_one_b_actions,
    "interleaved_1f1b": interleaved_1f1b_actions,
    "zero_bubble": zero_bubble_actions,
    "zbv": zbv_actions,
}


def check_schedule(schedule, pp, m, chunks=1):
    """Stop before anything is built when a schedule cannot run this way (a wrong list would hang
    between ranks, or send a microbatch's activations to another's), saying what must hold and what
    to change."""
    if schedule not in SCHEDULES:
        raise ValueError(
            f"pp_schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}"
        )
    if pp == 1:
        # (its cut and its V place model stages 0 and 1 on ranks that are not there)
        if schedule == "zbv":
            raise ValueError(
                "pp_schedule='zbv' needs a pipeline of pp >= 2 ranks (its V is two model chunks on "
                "each), but pp = 1: set --pp=2 or more with --pp_chunks=2, or run on one stage "
                "with --pp_schedule=1f1b --pp_chunks=1"
            )
        if chunks > 1:
            raise ValueError(
                f"pp_chunks = {chunks} needs a pipeline: with pp = 1 one rank holds the whole "
                f"model (set --pp to 2 or more, or --pp_chunks=1)"
            )
        return
    if schedule in ("afab", "1f1b", "zero_bubble") and chunks != 1:
        raise ValueError(
            f"pp_chunks = {chunks}: pp_schedule={schedule!r} runs one model chunk per rank; use "
            f"--pp_schedule=interleaved_1f1b for {chunks} chunks per rank (or --pp_chunks=1)"
        )
    if schedule == "zbv" and chunks != 2:
        raise ValueError(
            f"pp_schedule='zbv' holds two model chunks on each rank (the V): set --pp_chunks=2 "
            f"(got {chunks})"
        )
    if schedule == "interleaved_1f1b" and m % pp:
        lower, upper = max(pp, m // pp * pp), (m // pp + 1) * pp
        raise ValueError(
            f"pp_schedule='interleaved_1f1b' needs gradient_accumulation_steps (the microbatches, "
            f"{m}) to be a multiple of pp = {pp}: they go round the ring of ranks in groups of pp "
            f"(Megatron-LM's rule); use {lower}"
            + (f" or {upper}" if upper != lower else "")
            + ", adjusting batch_size to keep the batch"
        )


def ideal_bubble(schedule, pp, m, chunks=1):
    """The paper's idle share of a step, with forward = B = W in time (an unsplit backward twice a
    forward), or None where the paper gives no formula (zbv; zero_bubble with m < pp). afab and 1f1b
    idle alike, (pp - 1) / (m + pp - 1) (GPipe, section 2.2)."""
    if schedule in ("afab", "1f1b"):
        return (pp - 1) / (m + pp - 1)
    if schedule == "interleaved_1f1b":
        return (pp - 1) / (chunks * m + pp - 1)
    if schedule == "zero_bubble" and m >= pp:
        return (pp - 1) / (3 * m + pp - 1)
    return None


def forward_only_actions(pp, stage, m, chunks=1):
    """Evaluation's forwards, for any m: in interleaved_order, which with one chunk is 0, 1, ..., m
    - 1."""
    return [("F", i, c) for i, c in interleaved_order(pp, m, chunks)]


def balanced_cut(block_costs, n_stages, first_cost=0, last_cost=0):
    """The number of blocks of each of n_stages contiguous pipeline stages, first to last, that
    makes the costliest stage as cheap as it can be. block_costs[i] is block i's work (any unit:
    FLOPs, seconds; at least one block per stage, so len(block_costs) >= n_stages), first_cost what
    the first stage does beside its blocks (the embedding), last_cost the last stage's (the final
    norm, the head and the loss). Under interleaving the stages are the pp * chunks model stages in
    model order.

    Two passes of one dynamic programme over "the best cut of blocks 0 .. j - 1 into the first
    stages": the first finds the least cost the costliest stage can have; the second, among the cuts
    within it, takes the most even one (the least sum of squared stage costs), so a stage that the
    head keeps above the others does not push the rest as full as it is: an error in the costs then
    moves the slowest stage little. On a tie the first stages get fewer blocks: under 1F1B stage s
    holds pp - s microbatches."""
    n = len(block_costs)
    if not 1 <= n_stages <= n:
        raise ValueError(
            f"{n} blocks cannot be cut into {n_stages} stages of at least one block each"
        )
    extra = [first_cost if s == 0 else 0 for s in range(n_stages)]
    extra[-1] += last_cost
    # before[i]: the cost of blocks 0 .. i - 1
    before = list(itertools.accumulate(block_costs, initial=0))
    cost = lambda start, stop, s: before[stop] - before[start] + extra[s]

    def best_cut(score, limit):
        # cuts[j]: (score, blocks per stage) of the best cut of blocks 0 .. j - 1 into the stages so
        # far, each within the limit (tuples compare the score, then the first stage's blocks)
        cuts = {0: (0, ())}
        for s in range(n_stages):
            ends = [n] if s == n_stages - 1 else range(s + 1, n - (n_stages - 1 - s) + 1)
            options = {
                j: [
                    (score(so_far, cost(i, j, s)), sizes + (j - i,))
                    for i, (so_far, sizes) in cuts.items()
                    if i < j and cost(i, j, s) <= limit
                ]
                for j in ends
            }
            cuts = {j: min(found) for j, found in options.items() if found}
        return cuts[n]

    slowest = best_cut(max, math.inf)[0]
    return best_cut(lambda squares, c: squares + c * c, slowest)[1]


def stage_work(stage_blocks, costs):
    """The cost of each model stage under the cut stage_blocks (the blocks of each stage, first to
    last), costs being (embedding, [each block], the final norm, head and loss), as
    metrics.pipeline_costs gives."""
    first, blocks, last = costs
    work = [sum(blocks[i] for i in stage_layers(stage_blocks, s)) for s in range(len(stage_blocks))]
    work[0], work[-1] = work[0] + first, work[-1] + last
    return work


def balance_units(schedule, pp, chunks):
    """The groups of model stages whose costs must be even for no rank to wait on another: under zbv
    each rank's two stages, which a microbatch crosses back to back (down the V, then up it: the
    rank's total is what the others wait for); otherwise each model stage alone (one per rank, or
    under interleaving each lap round the ring waits on every chunk in turn: python
    tools/timeline.py draws both)."""
    if schedule == "zbv":
        return [virtual_stages(schedule, pp, p, chunks) for p in range(pp)]
    return [(s,) for s in range(pp * chunks)]


def cost_cut(schedule, pp, chunks, costs):
    """The blocks of each of the pp * chunks model stages, cut by their cost (costs as
    stage_work's): balanced_cut, whose costliest stage is as cheap as it can be. Under zbv, whose
    ranks must balance rather than its stages (balance_units), blocks are then moved one at a time
    across a stage boundary while that makes the costliest rank cheaper, or the ranks more even,
    without making any stage costlier than balanced_cut's costliest (a local search: each move must
    improve; rank 0 holds both ends of the model, so the head's stage there takes as few blocks as
    it can)."""
    cut = balanced_cut(costs[1], pp * chunks, costs[0], costs[2])
    limit, units = max(stage_work(cut, costs)), balance_units(schedule, pp, chunks)

    def unevenness(sizes):
        stages = stage_work(sizes, costs)
        totals = [sum(stages[s] for s in unit) for unit in units]
        return max(totals), sum(t * t for t in totals), sum(c * c for c in stages), sizes

    while True:
        moves = [
            cut[:k] + (cut[k] - d, cut[k + 1] + d) + cut[k + 2 :]
            for k in range(len(cut) - 1)
            for d in (1, -1)
        ]
        moves = [
            sizes for sizes in moves if min(sizes) > 0 and max(stage_work(sizes, costs)) <= limit
        ]
        best = min(moves, key=unevenness, default=cut)
        if unevenness(best) >= unevenness(cut):
            return cut
        cut = best


# The modules and parameters of each model chunk of picotron's Transformer: what the split backward
# takes (WeightGradStore, over a chunk's modules) and what the backward actions of a chunk write
# (zero.py's backward_phases, over each chunk's parameters).


def chunk_modules(model, chunk):
    """The modules chunk `chunk` of a Transformer runs: the embedding on stage 0, its blocks, the
    final norm and the head on the last stage (the zero-bubble schedules split the backward of the
    linears in them). Not the head under the chunked loss, which reads the head's weight itself: its
    gradient comes in the backward."""
    layers = model.chunk_layers[chunk]
    modules = [model.tok_emb] if layers[0] == 0 else []
    modules += [model.blocks[str(i)] for i in layers]
    if layers[-1] == model.cfg.n_layer - 1:
        modules += [model.norm] + ([] if model.loss.chunked else [model.lm_head])
    return modules


def chunk_parameters(model, chunk):
    """The parameters chunk `chunk` uses, each once: its modules', and the head's under the chunked
    loss."""
    params = [p for module in chunk_modules(model, chunk) for p in module.parameters()]
    if model.chunk_layers[chunk][-1] == model.cfg.n_layer - 1:
        params += list(model.lm_head.parameters())
    return list({id(p): p for p in params}.values())


class _LinearSplitBackward(torch.autograd.Function):
    """y = x W^T + b whose backward computes dx = dy W only, leaving (x, dy) in store.collecting for
    a later dW = dy^T x (and db = the sum of dy): WeightGradStore.linear. With store.collecting None
    (a backward outside a zero-bubble B action) it computes the weight's gradient at once, as a
    plain linear. Under autocast it computes in the autocast dtype, casting what F.linear's autocast
    would cast."""

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
        # (..., in): autograd casts it to x's dtype
        dx = dy @ w_c if ctx.needs_input_grad[0] else None
        if ctx.store.collecting is not None:
            ctx.store.collecting.append(
                (ctx.weight, ctx.bias, x_c, dy, WeightGradStore.weight_grads)
            )
            return dx, None, None, None
        dw, db = WeightGradStore.weight_grads(x_c, dy, ctx.bias is not None)
        return dx, dw.to(ctx.weight.dtype), None if db is None else db.to(ctx.bias.dtype), None


class WeightGradStore:
    """The split backward of a model chunk's linear layers (a ColumnParallelLinear's or
    RowParallelLinear's `matmul` hook, an nn.Linear's forward): between a microbatch's B and its W,
    each layer's input x and output gradient dy, and how W forms dW (db) from them: weight_grads, or
    an FP8 layer's own (fp8.py: its Float8Matmul splits its backward at the store it is given,
    keeping dW in FP8).

    ScheduleExecutor runs a B inside `collect(i)`, which keeps what the chunk's layers' backward
    leaves for microbatch i, and a W as `apply(i, ready)`, which accumulates dW = dy^T x (db = sum
    of dy) into .grad by hand: no backward hook fires for those (B gives them no gradient), so
    ready(p) says when each is in (the data-parallel reducer's grad_ready). `params` lists, in a
    fixed order, every parameter whose gradient W computes."""

    def __init__(self, modules):
        self.params, self.held, self.collecting = [], {}, None
        # of the x and dy kept (each counted per layer): timeline.ActivationMemory reads it
        self.held_bytes = 0
        for module in modules:
            for layer in module.modules():
                if hasattr(getattr(layer, "matmul", None), "store"):
                    # an FP8 product: collects here itself; its bias, outside it, in B
                    layer.matmul.store = self
                    self.params.append(layer.weight)
                    continue
                if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
                    # the layers' hook: their product, with this backward
                    layer.matmul = self.linear
                elif isinstance(layer, nn.Linear):
                    # a plain linear (one process, and the layers tensor parallelism leaves whole):
                    # its forward is this product
                    layer.forward = functools.partial(self.linear_layer, layer)
                else:
                    continue
                self.params.append(layer.weight)
                # the bias too, but a row-parallel one's (added after the sum) gets its grad in B
                if not isinstance(layer, RowParallelLinear) and layer.bias is not None:
                    self.params.append(layer.bias)
        # a tied head's weight is the embedding's
        self.params = list({id(p): p for p in self.params}.values())

    def linear_layer(self, layer, x):
        return self.linear(x, layer.weight, layer.bias)

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
            self.held_bytes += sum(
                x.numel() * x.element_size() + dy.numel() * dy.element_size()
                for _, _, x, dy, _ in self.collecting
            )
        finally:
            self.collecting = None

    @staticmethod
    def weight_grads(x, dy, with_bias):
        """dW = dy^T x over every token, (out, in), and db = the sum of dy over the tokens (None
        without bias)."""
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        return dy2.t() @ x2, (dy2.sum(0) if with_bias else None)

    @torch.no_grad()
    def apply(self, microbatch, ready=None):
        """W for one microbatch: accumulate each layer's dW (db) into .grad, calling ready(p), if
        given, as soon as p's gradient for this microbatch is in (after the last layer that uses p).
        """
        held = self.held.pop(microbatch)
        last = {
            id(p): j
            for j, (weight, bias, *_) in enumerate(held)
            for p in (weight, bias)
            if p is not None
        }
        for j, (weight, bias, x, dy, weight_grads) in enumerate(held):
            self.held_bytes -= x.numel() * x.element_size() + dy.numel() * dy.element_size()
            dw, db = weight_grads(x, dy, bias is not None)
            for p, g in ((weight, dw), (bias, db)):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g.to(p.dtype)
                else:
                    p.grad.add_(g.to(p.dtype))
                if ready is not None and last[id(p)] == j:
                    ready(p)


def announced_by_hand(grad_sync, params):
    """Take the data-parallel reducer's backward hooks off `params`, whose gradients the W actions
    accumulate by hand and announce with grad_ready (WeightGradStore.apply): a hook firing for one
    of them as well (a gradient autograd also adds in B) would send it before its W. Through every
    part of a parallel.Reducers."""
    for reducer in getattr(grad_sync, "parts", None) or [grad_sync]:
        if hasattr(reducer, "parts"):
            announced_by_hand(reducer, params)
            continue
        for p in params:
            hook = reducer.hooks.pop(id(p), None)
            if hook is not None:
                hook.remove()


class ScheduleExecutor(PipelineExecutor):
    """parallel.PipelineExecutor for the schedules here, extended through its act hook with what
    they need beside forward and backward:
      split_backward  for lists with 'W' actions (zero_bubble, zbv): one WeightGradStore per chunk
                      (built before the chunk's first forward); a B runs inside its collect(i), a W
                      is its apply(i, ready), ready(p) being the reducer's grad_ready as each
                      gradient it computes is in; the reducer is told backward_done('W', chunk)
                      after a W, as the core tells it after a B
      chunks          a message between two chunks of this rank (the V's turn) is handed over in
                      memory"""

    def __init__(
        self,
        model,
        microbatches,
        comm,
        autocast=nullcontext(),
        loss_multiplier=1.0,
        grad_sync=None,
        split_backward=None,
        trace=None,
    ):
        super().__init__(model, microbatches, comm, autocast, loss_multiplier, grad_sync, trace)
        self.split_backward = split_backward
        # messages from one chunk of this rank to another, by (kind, microbatch, stage)
        self.here = {}

    def act(self, action, received, last):
        op, i, c = action
        source, destination = message_route(op, self.comm.chunk_stages[c], self.comm.n_stages)
        # from this rank's other chunk: kept, not received
        if source is not None and self.comm.is_here(source):
            received = self.here.pop((op, i, self.comm.chunk_stages[c]))
        if op == "W":
            product = self.weight_gradients(i, c, last)
        else:
            split = op == "B" and self.split_backward is not None
            with self.split_backward[c].collect(i) if split else nullcontext():
                product = super().act(action, received, last)
        # for this rank's other chunk: kept, not sent
        if product is not None and self.comm.is_here(destination):
            self.here[(op, i, destination)], product = product, None
        return product

    def weight_gradients(self, i, c, last):
        """W: the weights' half of microbatch i's split backward on chunk c, from what B kept."""
        if self.split_backward is None:
            raise ValueError(
                "these actions split the backward into B and W: give the executor split_backward, "
                "one WeightGradStore per chunk (built before the chunk's first forward)"
            )
        if self.grad_sync is not None:
            self.grad_sync.set_grad_sync(last)  # only the chunk's last W sends what it computes
        self.split_backward[c].apply(
            i, self.grad_sync.grad_ready if self.grad_sync is not None else None
        )
        self.backward_done("W", c)


@dataclass
class SchedulePipeline(Pipeline):
    """parallel.Pipeline (afab and 1f1b) for the schedules here: this rank's model chunks (chunks),
    and one WeightGradStore per chunk when the schedule splits the backward (zero_bubble, zbv; None
    otherwise). A step runs ScheduleExecutor over the chunks."""

    chunks: int = 1
    weight_grad_stores: list = None

    def actions(self, m):
        return SCHEDULES[self.schedule](self.comm.pp, self.comm.stage, m, self.chunks)

    def evaluation_actions(self, m):
        return forward_only_actions(self.comm.pp, self.comm.stage, m, self.chunks)

    def executor(
        self, model, microbatches, autocast, loss_multiplier=1.0, grad_sync=None, trace=None
    ):
        chunks = model  # what the executor calls: with one chunk the model itself
        if self.chunks > 1:
            chunks = [functools.partial(model, chunk=c) for c in range(self.chunks)]
        return ScheduleExecutor(
            chunks,
            microbatches,
            self.comm,
            autocast,
            loss_multiplier,
            grad_sync,
            self.weight_grad_stores,
            trace,
        )
