"""
ZeRO-2 and ZeRO-3 (ZeRO-1, the optimizer states sharded, is data parallelism's first step:
parallel.py). What each rank holds, over the dp x cp ranks that hold the same parameters ("dp"
below):

  ZeRO-2  1/dp of the optimizer states and of the gradients; the whole parameters
          (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
          Parameter Models", section 5.2)
  ZeRO-3  1/dp of the parameters too, each block gathered only around its forward and its backward
          (section 5.3; Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data
          Parallel")

ZeRO-2 (GradientShards). Holding the gradients whole until the last micro-batch would be ZeRO-1's
memory, so every micro-batch's gradients are reduce-scattered and added into this rank's slice
(DeepSpeed's way: with m micro-batches, m times ZeRO-1's reduce traffic); each bucket's flat buffer
lives only from its first gradient until its reduce-scatter has landed (at most two launched buckets
are waited for at a time), and p.grad is dropped the moment it is copied into its bucket. After the
step the updated slices are all-gathered into the parameters, as in ZeRO-1.

Under a pipeline schedule (parallel.py; pipeline_schedules.py) a micro-batch's gradient of a
parameter is complete after the backward action that writes it, and that is when it is sent: each
action (op, chunk) is a "phase", a bucket holds the parameters of one phase only, and after every B
and W action the executor calls backward_done(op, chunk), which launches the buckets of that phase
the hooks did not. So:
  afab, 1f1b        one chunk, B the whole backward: every bucket after each micro-batch's B
  interleaved_1f1b  B of chunk c sends chunk c's buckets: each chunk's buckets are its own, and a
                    micro-batch's are sent v times over, a chunk at a time
  zero_bubble, zbv  B sends the parameters autograd gives gradients to (norm gains, the embedding,
                    the chunked loss's head, biases of row-parallel layers); W sends the
                    tensor-parallel linears' weights it computes (WeightGradStore.params), when it
                    runs, however late
Every bucket is thus launched once per micro-batch for each action that writes it, in the same order
on every rank (the ranks of a dp group run the same action list). One parameter is written by two
actions: under zbv with tied embeddings rank 0 holds both ends of the model, and its one
embedding-and-head matrix, alone in a bucket, is sent after each of them (each part once). A tied
weight whose copies sit on two stages (the embedding on the first, the head on the last) is alone in
a bucket on each, cut the same way, so the owned shards of their gradients are summed across the two
stages directly (the mean over dp commutes with the sum).

ZeRO-3 (FullyShardedParameters). The parameters are cut into units: one per transformer block, and
the stage's other parameters (embedding, final norm, head) as the root unit, with a tied weight in a
unit of its own. Each unit is one bucket, padded to a multiple of dp, and each rank stores only its
slice (param_shard): 1/dp of the parameters, of the gradients (reduce-scattered into grad_shard, as
ZeRO-2) and of the optimizer state. A parameter is a view into its unit's gathered buffer
(param_full), whose storage is empty except while the unit is in use. The rhythm, per block and per
micro-batch:

    forward:  all-gather the block (posted early: the previous block's forward prefetched it)
              -> post the all-gather of the next block -> compute -> free the storage
    backward: all-gather the block again (the later block's backward prefetched it) -> post the
              gather of the block before it -> recompute (activation checkpointing) and backward
              -> copy the gradients into the flat buffer and reduce-scatter it -> free the storage

Freeing is the storage itself (untyped_storage().resize_(0)), not a reference: what autograd saved
for backward are views of the same storage, so they hold no memory in between and see the regathered
values. The root unit stays whole from the step's first forward until the optimizer step (it is used
at both ends of the model: the embedding first, the head last). The gathers, like the
reduce-scatters (every bucket once per micro-batch), are unconditional and in the same order on
every rank of the group: a block runs forward and backward on every rank, even one whose MoE experts
got no token. A pipeline stage gathers each block again for every micro-batch (twice: forward and
backward); with pp stages and m micro-batches, 2m all-gathers and m reduce-scatters of each unit per
step, each unit's bytes times (dp - 1)/dp on the wire. Memory at a time: the shards, plus about two
gathered blocks (the one computing, the one prefetched), the root unit, and two buckets of gradients
in flight.

What each schedule gathers, per block and micro-batch: afab and 1f1b as above, forward and backward.
interleaved_1f1b the same, chunk by chunk: a block prefetches the next block of its own chunk only
(the root's hook, the chunk's first), since another chunk's block runs only after other actions.
zero_bubble and zbv gather before F and before B, free after each, and gather nothing for W: W
computes dW = dy^T x from the x and dy that B kept and needs no weight, so no block stays gathered
from B to W. Their blocks are two units each, phases of their own (the weights W computes, the rest
that B does): gathered and freed together, two all-gathers per gather; each part's gradients
reduce-scattered after its action. Under zbv rank 0's root unit (the embedding, the final norm, the
head) is whole all step.

Parameters dealt whole (`owners`). Muon (optim.py) orthogonalises whole matrices, which ZeRO's even
slices would cut; so both reducers take owners, {param: rank of the group}, and give each of those
parameters whole to one rank: its buckets (WholeBucket) hold one owner's parameters only, their
gradients are reduced to the owner (dist.reduce) and kept there alone, and ZeRO-2 broadcasts them
from the owner after the step where it all-gathers slices. ZeRO-3 cuts each unit by owner
(by_owner): the rest in even slices and one unit per owner, gathered and freed together as a split
backward's parts are; an owner's unit is stored on the owner alone, whole, and gathered by a
broadcast from it. A rank then holds about 1/dp of each, cut at parameter boundaries.

Both are reducers as parallel.py's ShardedGradientBuckets is, for parallel.ZeroOneAdamW to step
with: GradientShards extends parallel.GradientBuckets through the hooks parallel.py's docstring
lists, with ZeRO-1's slices (parallel.ShardedBucket, owned_slices, gather_slices), and
FullyShardedParameters extends GradientShards, each ZeRO-3 unit's parameters held by a Unit beside
its bucket. Expert parallelism (expert_parallel.py) runs one of them over the experts' group beside
the other. At the end of this file: what of picotron's Transformer they are cut from, the backward
action that writes each parameter's gradient (backward_phases) and ZeRO-3's units (zero3_units).
"""

import torch
import torch.distributed as dist

from parallel import (
    GradientBuckets,
    ShardedBucket,
    _all_gather_single,
    buckets_by_kind,
    gather_slices,
    owned_slices,
    params_flat,
    post_gathers,
    post_reduce_scatter,
    summed_slice,
    wait_for_params,
)


class WholeBucket(ShardedBucket):
    """A bucket that one rank of the group, `owner`, gets all of: its gradient is reduced to the
    owner (post_reduce) and its parameters broadcast from it (post_broadcast, or ZeRO-3's Unit)."""

    def __init__(self, params, group, owner):
        self.owner = owner
        super().__init__(params, group)
        self.shard_size = self.numel

    def zeros(self):
        return torch.zeros(self.numel, dtype=self.params[0].dtype, device=self.params[0].device)

    def owned(self):
        return (0, self.numel) if self.rank == self.owner else (0, 0)


def post_reduce(bucket):
    """Post the sum over the group of a WholeBucket's flat buffer, landing on its owner only
    (dist.reduce: on the others flat is scratch once it has landed). One rank sends nothing."""
    if bucket.world > 1:
        bucket.work = dist.reduce(
            bucket.flat,
            dist.get_global_rank(bucket.group, bucket.owner),
            group=bucket.group,
            async_op=True,
        )


def post_broadcast(bucket):
    """After the step: the owner's updated parameters to every rank of the group, into the
    parameters themselves (params_flat), in place of ZeRO's all-gather of slices; returns its
    request."""
    return dist.broadcast(
        params_flat(bucket),
        dist.get_global_rank(bucket.group, bucket.owner),
        group=bucket.group,
        async_op=True,
    )


def gather_whole_or_slices(bucket):
    """After the step: a WholeBucket broadcast from its owner, any other bucket's slices
    all-gathered (gather_slices)."""
    return post_broadcast(bucket) if isinstance(bucket, WholeBucket) else gather_slices(bucket)


class GradientShards(GradientBuckets):
    """ZeRO-2's reducer: every micro-batch's gradients are reduce-scattered, each added into its
    bucket's `grad_shard`, and p.grad is dropped as soon as it is copied into its bucket, so that no
    full-size gradient lives beyond the two buckets in flight (set_grad_sync's argument is ignored:
    calling it before a backward lands the buckets still in flight, whose flat buffers would
    otherwise add to that backward's peak). A bucket's flat buffer lives from its first gradient
    until its reduce-scatter has landed. After finish() p.grad is None: the gradients are the
    grad_shards.

    Call backward_done(op, chunk) after each backward action: `phases` ({param: the actions (op,
    chunk) that write its gradient}; by default ("B", 0) for all, one plain backward) says which
    buckets each action completes, and no bucket mixes parameters of different phases; the hooks
    (and grad_ready for a gradient accumulated by hand) launch the buckets that fill during the
    action, backward_done the rest; a parameter that two actions write, alone in its bucket, is sent
    by backward_done after each. `tied` (copies, group): the copies this rank holds of a weight tied
    across pipeline stages, each alone in a bucket, and the group of the stages holding the others:
    finish() sums their shards over it. `units` (ZeRO-3): lists of parameters, one bucket each, each
    of one phase. `owners` ({param: rank of group}): parameters dealt whole, in buckets of one
    owner each (WholeBucket; a unit holds one owner's only): reduced to the owner instead of
    reduce-scattered, broadcast from it after the step (Muon's matrices: optim.py)."""

    def __init__(
        self,
        params,
        group,
        bucket_size_mb=25.0,
        phases=None,
        tied=((), None),
        units=None,
        owners=None,
    ):
        self.phases, self.units, self.owners = phases, units, owners or {}
        self.tied_copies, self.tied_group = list(tied[0]), tied[1]
        super().__init__(params, group, bucket_size_mb)
        if any(self.phase_of(p) != b.phases for b in self.buckets for p in b.params):
            raise ValueError(
                "GradientShards: a unit mixes parameters that different backward actions complete"
            )
        # each phase's buckets in order (a parameter two actions write is in both), and the next
        # to launch in the action now running
        self.phase_buckets = {}
        for b in self.buckets:
            for phase in sorted(b.phases):
                self.phase_buckets.setdefault(phase, []).append(b)
        self.next = dict.fromkeys(self.phase_buckets, 0)
        self.in_flight = []  # launched buckets not yet added into their grad_shard

    def phase_of(self, p):
        if self.phases is None:
            return frozenset({("B", 0)})
        if not self.phases.get(p):
            raise ValueError(
                f"GradientShards: phases names no backward action for a parameter of shape "
                f"{tuple(p.shape)}"
            )
        return frozenset(self.phases[p])

    def plan(self, params, bucket_size_mb):
        if self.units is not None:
            # one bucket per unit, in backward order
            return [list(u) for u in reversed(self.units) if u]
        tied = {id(p) for p in self.tied_copies}  # a tied copy: alone
        return buckets_by_kind(
            params,
            bucket_size_mb,
            lambda p: (self.phase_of(p), id(p) in tied and id(p), self.owners.get(p)),
        )

    def new_bucket(self, params):
        # its flat buffer: made by copy_in, dropped by settle
        owner = self.owners.get(params[0])
        if owner is None:
            bucket = ShardedBucket(params, self.group)
        else:
            bucket = WholeBucket(params, self.group, owner)
        bucket.phases, bucket.grad_shard = self.phase_of(params[0]), None
        return bucket

    def set_grad_sync(self, sync):
        # a backward begins: land what the last one left in flight, before its peak
        while self.in_flight:
            self.settle(self.in_flight[0])

    def grad_ready(self, p):
        """p.grad is complete: copy it into its bucket, then launch, in phase order, every full
        bucket with only launched ones before it (one two actions write waits for backward_done)."""
        bucket, i = self.where[p]
        if len(bucket.phases) > 1:
            return
        if i in bucket.ready:
            raise RuntimeError(
                f"GradientShards: a gradient of shape {tuple(p.shape)} became ready twice in one "
                f"backward action"
            )
        self.copy_in(bucket, i)
        (phase,) = bucket.phases
        buckets = self.phase_buckets[phase]
        while self.next[phase] < len(buckets) and self.full(buckets[self.next[phase]]):
            self.next[phase] += 1
            self.launch(buckets[self.next[phase] - 1])

    def backward_done(self, op, chunk):
        """Action (op, chunk) has run: launch, in order, its phase's buckets the hooks did not (a
        missing gradient sends zeros), so every rank launches each bucket whatever its data did."""
        phase = (op, chunk)
        for bucket in self.phase_buckets.get(phase, [])[self.next.get(phase, 0) :]:
            for i in range(len(bucket.params)):
                if i not in bucket.ready:
                    self.copy_in(bucket, i)
            self.launch(bucket)
        self.next[phase] = 0

    def copy_in(self, bucket, i):
        self.settle(bucket)  # its last launch, if still in flight, must land before it refills
        if bucket.flat is None:
            bucket.flat = bucket.zeros()
        super().copy_in(bucket, i)
        # its elements are in the bucket now: the full-size gradient is not kept
        bucket.params[i].grad = None

    def launch(self, bucket):
        self.launched += 1
        while len(self.in_flight) >= 2:  # keep at most two buckets' full gradients in flight
            self.settle(self.in_flight[0])
        if isinstance(bucket, WholeBucket):
            post_reduce(bucket)  # (whole on its owner; settle finds nothing on the others)
        else:
            post_reduce_scatter(bucket)
        self.in_flight.append(bucket)
        bucket.ready = set()  # sent: the next action that writes it starts it afresh

    def settle(self, bucket):
        """Land a bucket's reduce-scatter: add its mean into grad_shard, drop the flat buffer."""
        if bucket not in self.in_flight:
            return
        self.in_flight.remove(bucket)
        # the sum over ranks / dp = the mean over the global batch
        shard = summed_slice(bucket).div_(self.replicas)
        if bucket.grad_shard is not None:
            bucket.grad_shard.add_(shard)
        else:  # (kept: a copy where the slice is a view of flat, which goes now)
            bucket.grad_shard = shard if bucket.shard is not None else shard.clone()
        bucket.flat = bucket.shard = None

    def finish(self):
        """Land every bucket still in flight, then sum the tied copies' shards across stages."""
        if any(b.ready for b in self.buckets) or any(p.grad is not None for p in self.where):
            raise RuntimeError(
                "GradientShards.finish: gradients were never sent: call backward_done(op, chunk) "
                "after each backward action"
            )
        while self.in_flight:
            self.settle(self.in_flight[0])
        self.next, self.launched = dict.fromkeys(self.next, 0), 0
        if self.tied_group is not None:
            for p in self.tied_copies:
                shard = self.where[p][0].grad_shard
                dist.all_reduce(shard, group=self.tied_group)

    # what parallel.ZeroOneAdamW steps with: ZeRO-1's slices, the gradient's from grad_shard
    def owned_slices(self):
        return owned_slices(self.buckets)

    def owned_param(self, p, start, end, bucket, a, b):
        return p.detach().view(-1)[start:end]

    def owned_grad(self, p, start, end, bucket, a, b):
        return bucket.grad_shard[a:b]

    def after_step(self):
        """The updated slices all-gathered into the parameters, as ZeRO-1's after_step (waited for
        before their parameters are read), a WholeBucket broadcast from its owner; the shards
        dropped."""
        post_gathers(self.buckets, gather_whole_or_slices)
        for bucket in self.buckets:
            bucket.grad_shard = None


class Unit:
    """One ZeRO-3 unit's parameters, those of `bucket`: `param_shard` the elements this rank stores
    (its owned range: 1/dp, or of a WholeBucket all on its owner and none elsewhere), `param_full`
    the gathered whole, a flat buffer the parameters are views of, its storage empty between uses,
    filled by an all-gather of the shards (a WholeBucket's: a broadcast from its owner). `gather` is
    its state (None: empty, a request: gathering, True: whole), `keep_whole` marks the root unit,
    `in_backward` a block whose backward is running."""

    @torch.no_grad()
    def __init__(self, bucket, keep_whole):
        full = bucket.zeros()
        for p, start in zip(bucket.params, bucket.offsets):
            full[start : start + p.numel()].copy_(p.reshape(-1))
            p.data = full[start : start + p.numel()].view_as(p)
        lo, hi = bucket.owned()
        self.bucket, self.param_full = bucket, full
        self.param_shard = full[lo:hi].clone()
        self.keep_whole, self.gather, self.in_backward = keep_whole, None, False
        self.free()

    def post_gather(self):
        if self.gather is not None:
            return
        full, b = self.param_full, self.bucket
        full.untyped_storage().resize_(full.numel() * full.element_size())
        if b.world == 1:
            full.copy_(self.param_shard)
            self.gather = True
        elif isinstance(b, WholeBucket):
            if b.rank == b.owner:
                full.copy_(self.param_shard)
            owner = dist.get_global_rank(b.group, b.owner)
            self.gather = dist.broadcast(full, owner, group=b.group, async_op=True)
        else:
            self.gather = _all_gather_single(full, self.param_shard, group=b.group, async_op=True)

    def wait(self):
        self.post_gather()
        if self.gather is not True:
            self.gather.wait()  # sync point: the parameters are needed now
            self.gather = True

    def free(self):
        """Freeing is the storage itself, not a reference: what autograd saved are views of it."""
        if self.gather is not None and self.gather is not True:
            self.gather.wait()  # a prefetch nobody used: it must land before its buffer goes
        self.param_full.untyped_storage().resize_(0)
        self.gather, self.in_backward = None, False


def by_owner(params, owners):
    """params cut by owner, in order: those no rank owns (ZeRO's even slices), then each owner's
    (owners: {param: rank}, a parameter dealt whole), leaving out the empty parts."""
    parts = {}
    for p in params:
        parts.setdefault(owners.get(p), []).append(p)
    return [parts[k] for k in sorted(parts, key=lambda k: -1 if k is None else k)]


class FullyShardedParameters(GradientShards):
    """ZeRO-3: GradientShards whose buckets are the units of `units`, [(module or None, params,
    chunk)] in forward order; module None marks a unit kept whole through the step (gathered by the
    model's forward, freed after the optimizer step), else the module whose forward and backward use
    the unit: a block, whose units (one per phase: a split backward's B and W parts) are gathered
    and freed together. `chunk` is the model chunk the block runs in (the model's forward takes
    chunk=c): a block prefetches the next block of its own chunk only, the one that runs next. Moves
    each unit's parameters into its Unit's shard and registers the hooks on the blocks and on
    `model`. `phases`, `tied` and `owners` as GradientShards': a unit holding parameters dealt whole
    is cut into one unit of the others (even slices) and one per owner (by_owner), gathered and
    freed together, as a split backward's parts are.

    A block's rhythm (the paper's, section 5.3): before_forward gathers it (and posts the next
    block's gather), after_forward frees it; before_backward gathers it again (and posts the
    previous block's), after_backward frees it once its gradients are sent (reduce-scattered)."""

    def __init__(self, params, group, units, model, phases=None, tied=((), None), owners=None):
        owners = owners or {}
        units = [(m, part, c) for m, ps, c in units for part in by_owner(ps, owners)]
        super().__init__(
            params, group, phases=phases, tied=tied, units=[ps for _, ps, _ in units], owners=owners
        )
        # chunks: c -> [(block, [its Units])]
        self.whole, self.chunks, self.unit, self.block_of = [], {}, {}, {}
        for module, params, chunk in units:
            if not params:
                continue
            bucket = self.where[params[0]][0]
            unit = self.unit[id(bucket)] = Unit(bucket, keep_whole=module is None)
            if module is None:
                self.whole.append(unit)
                continue
            blocks = self.chunks.setdefault(chunk, [])
            if not blocks or blocks[-1][0] is not module:  # a new block: its hooks
                blocks.append((module, []))
                c, i = chunk, len(blocks) - 1
                module.register_forward_pre_hook(lambda m, a, c=c, i=i: self.before_forward(c, i))
                module.register_forward_hook(lambda m, a, y, c=c, i=i: self.after_forward(c, i, y))
            blocks[-1][1].append(unit)
            self.block_of[id(bucket)] = blocks[-1][1]
        # a block's B is over when the last of its B units is launched (they launch in order)
        order = {id(b): k for k, b in enumerate(self.buckets)}
        self.ends_backward = {}  # id(block) -> the bucket whose launch says the block's B is over
        for blocks in self.chunks.values():
            for _, block in blocks:
                in_b = [u.bucket for u in block if any(op == "B" for op, _ in u.bucket.phases)]
                if in_b:
                    self.ends_backward[id(block)] = max(in_b, key=lambda b: order[id(b)])
        model.register_forward_pre_hook(
            lambda mod, args, kwargs: self.gather_root(kwargs.get("chunk", 0)), with_kwargs=True
        )

    def owned_param(self, p, start, end, bucket, a, b):
        # the shard: updating it is the update (the full copy is stale)
        return self.unit[id(bucket)].param_shard[a:b]

    def _units(self):
        return self.whole + [u for blocks in self.chunks.values() for _, b in blocks for u in b]

    def _block(self, c, i):
        return self.chunks[c][i][1]

    @staticmethod
    def wait(units):
        """Every unit whole: all their gathers posted first, then each waited for."""
        for unit in units:
            unit.post_gather()
        for unit in units:
            unit.wait()

    def gather_root(self, chunk):
        self.wait(self.whole)
        if self.chunks.get(chunk):
            # prefetch the chunk's first block while the embedding computes
            for unit in self._block(chunk, 0):
                unit.post_gather()

    def before_forward(self, c, i):
        block = self._block(c, i)
        self.wait(block)
        # (not while recomputing in backward)
        if i + 1 < len(self.chunks[c]) and not block[0].in_backward:
            for unit in self._block(c, i + 1):
                unit.post_gather()

    def after_forward(self, c, i, out):
        block = self._block(c, i)
        if not block[0].in_backward:  # a recompute in backward keeps the block for its backward
            for unit in block:
                unit.free()
        if torch.is_grad_enabled() and torch.is_tensor(out) and out.requires_grad:
            out.register_hook(lambda grad, c=c, i=i: self.before_backward(c, i))

    def before_backward(self, c, i):
        block = self._block(c, i)
        for unit in block:
            unit.in_backward = True
        self.wait(block)
        if i > 0:
            for unit in self._block(c, i - 1):
                unit.post_gather()

    def launch(self, bucket):
        """GradientShards' reduce-scatter, then after_backward: the unit's gradients are sent."""
        super().launch(bucket)
        unit = self.unit[id(bucket)]
        if not unit.keep_whole:
            self.after_backward(unit)

    def after_backward(self, unit):
        """Free the unit, or the whole block once its last B unit is sent: a split backward's W
        needs no weights (dW = dy^T x), and the W part's own launch, after W, finds it free."""
        block = self.block_of[id(unit.bucket)]
        for u in block if self.ends_backward.get(id(block)) is unit.bucket else [unit]:
            u.free()

    def after_step(self):
        """Every gathered copy is stale once the shards stepped: the next forward gathers anew. The
        root's gather is posted at once, as ZeRO-1 posts its gathers after the step: the forward
        needs it first, with nothing before it to hide behind."""
        for unit in self._units():
            unit.free()
        for bucket in self.buckets:
            bucket.grad_shard = None
        for unit in self.whole:
            unit.post_gather()

    def unit_by_unit(self):
        """Yields each unit's parameters gathered, one at a time, then copies this rank's slice of
        what was written into them back into its shard and frees it: a checkpoint loads this way
        holding one unit whole, not the model (which may not fit on one device: that is why it is
        sharded)."""
        for unit in self._units():
            unit.wait()
            yield unit.bucket.params
            lo, hi = unit.bucket.owned()
            unit.param_shard.copy_(unit.param_full[lo:hi])
            unit.free()


def overlap_param_gather(model, grad_sync):
    """ZeRO-1 and ZeRO-2 (overlap_param_gather=True): each bucket's all-gather of the updated
    parameters, posted after the step (parallel.post_gathers), is waited for just before the forward
    first reads one of its parameters, so the gathers of the later blocks run while the earlier ones
    compute (Megatron-LM's --overlap-param-gather). The readers, in forward order: the model's own
    forward (the embedding, a head tied to it, and every parameter outside the blocks but the final
    norm's and the head's), each block, and the final norm (the head reads right after it). A bucket
    spanning two readers is waited for by the first; one holding a parameter no reader names stays
    waited for at once after the step. Under a pipeline each chunk's forward passes the hooks of
    what it holds. Returns the hook handles."""
    norm, embedding = getattr(model, "norm", None), getattr(model, "tok_emb", None)
    tail = {
        id(p)
        for m in (norm, getattr(model, "lm_head", None))
        if m is not None
        for p in m.parameters()
    }
    # a tied head: read first
    tail -= {id(p) for p in (embedding.parameters() if embedding is not None else ())}
    in_blocks = {id(p) for p in model.blocks.parameters()}
    readers = [(model, [p for p in model.parameters() if id(p) not in in_blocks | tail])]
    readers += [(block, list(block.parameters())) for block in model.blocks.values()]
    if norm is not None:
        readers.append((norm, [p for p in model.parameters() if id(p) in tail]))
    first = {}  # id(param) -> the first reader's index
    for k, (_, params) in enumerate(readers):
        for p in params:
            first.setdefault(id(p), k)
    waits, handles = [[] for _ in readers], []
    for bucket in grad_sync.buckets:
        readers_of = [first.get(id(p)) for p in bucket.params]
        bucket.waited_by_hook = None not in readers_of
        if bucket.waited_by_hook:
            waits[min(readers_of)].append(bucket)
    for (module, _), buckets in zip(readers, waits):
        if buckets:
            handles.append(
                module.register_forward_pre_hook(lambda mod, args, b=buckets: wait_for_params(b))
            )
    return handles


# -----------------------------------------------------------------------------
# How ZeRO-2 and ZeRO-3 cut picotron's Transformer: the backward action that writes each parameter's
# gradient (ZeRO-2/3 send it after that action), and ZeRO-3's units of parameters.


def backward_phases(chunk_params, weight_grad_stores=None):
    """{parameter: {(op, chunk)}}: the backward actions of a micro-batch that write each parameter's
    gradient (ZeRO-2/3 send it after each), from `chunk_params`, each chunk's parameters
    (pipeline_schedules.chunk_parameters; one list without a pipeline): ('B', c), or ('W', c) for
    those a split backward's W computes (WeightGradStore.params, one store per chunk). Under zbv
    with tied embeddings rank 0's embedding has two: chunk 0's B and, as the head, chunk 1's W (its
    B under the chunked loss)."""
    phases = {}
    for c, params in enumerate(chunk_params):
        by_hand = {id(p) for p in weight_grad_stores[c].params} if weight_grad_stores else set()
        for p in params:
            phases.setdefault(p, set()).add(("W" if id(p) in by_hand else "B", c))
    return phases


def zero3_units(model, tied=(), phases=None):
    """ZeRO-3's units, (module or None, params, chunk), in forward order: the root (this stage's
    embedding, final norm and head, kept whole through the step), a tied weight alone (its shards
    summed across stages), then each block, gathered around its forward and backward. A unit's
    gradients are sent after one backward action (`phases`, from backward_phases): under a split
    backward a block is two, its B and W parts (gathered and freed together), the root one each."""

    def by_phase(params):
        parts = {}
        for p in params:
            parts.setdefault(frozenset(phases[p]) if phases is not None else None, []).append(p)
        return list(parts.values())

    chunk_of = {i: c for c, layers in enumerate(model.chunk_layers) for i in layers}
    blocks = [
        (block, part, chunk_of[int(i)])
        for i, block in model.blocks.items()
        for part in by_phase(list(block.parameters()))
    ]
    apart = {id(p) for _, params, _ in blocks for p in params} | {id(p) for p in tied}
    root = [p for p in model.parameters() if id(p) not in apart]
    whole = [(None, part, None) for part in by_phase(root)] + [(None, [p], None) for p in tied]
    return whole + blocks
