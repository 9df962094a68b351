"""
ZeRO-2 and ZeRO-3 (ZeRO-1, the optimizer states sharded, is data parallelism's first step: parallel.py).
What each rank holds, over the dp x cp ranks that hold the same parameters ("dp" below):

  ZeRO-2 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
         section 5.2)  1/dp of the optimizer states and of the gradients; the whole parameters
  ZeRO-3 (section 5.3; Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data
         Parallel")    1/dp of the parameters too, each block gathered only around its forward and its
                       backward

ZeRO-2 (GradientShards). Holding the gradients whole until the last micro-batch would be ZeRO-1's memory,
so every micro-batch's gradients are reduce-scattered and added into this rank's slice (DeepSpeed's way:
with m micro-batches, m times ZeRO-1's reduce traffic); each bucket's flat buffer lives only from its first
gradient until its reduce-scatter has landed (at most two launched buckets are waited for at a time), and
p.grad is dropped the moment it is copied into its bucket. After the step the updated slices are
all-gathered into the parameters, as in ZeRO-1.

Under a pipeline schedule (parallel.py; pipeline_schedules.py) a micro-batch's gradient of a parameter is
complete after the backward action that writes it, and that is when it is sent: each action (op, chunk)
is a "phase", a bucket holds the parameters of one phase only, and after every B and W action the
executor calls backward_done(op, chunk), which launches the buckets of that phase the hooks did not. So:
  afab, 1f1b        one chunk, B the whole backward: every bucket after each micro-batch's B
  interleaved_1f1b  B of chunk c sends chunk c's buckets: each chunk's buckets are its own, and a
                    micro-batch's are sent v times over, a chunk at a time
  zero_bubble, zbv  B sends the parameters autograd gives gradients to (norm gains, the embedding, the
                    chunked loss's head, biases of row-parallel layers); W sends the tensor-parallel
                    linears' weights it computes (WeightGradStore.params), when it runs, however late
Every bucket is thus launched once per micro-batch for each action that writes it, in the same order on
every rank (the ranks of a dp group run the same action list). One parameter is written by two actions:
under zbv with tied embeddings rank 0 holds both ends of the model, and its one embedding-and-head
matrix, alone in a bucket, is sent after each of them (each part once). A tied weight whose copies sit on
two stages (the embedding on the first, the head on the last) is alone in a bucket on each, cut the same
way, so the owned shards of their gradients are summed across the two stages directly (the mean over dp
commutes with the sum).

ZeRO-3 (FullyShardedParameters). The parameters are cut into units: one per transformer block, and the
stage's other parameters (embedding, final norm, head) as the root unit, with a tied weight in a unit of
its own. Each unit is one bucket, padded to a multiple of dp, and each rank stores only its slice
(param_shard): 1/dp of the parameters, of the gradients (reduce-scattered into grad_shard, as ZeRO-2) and
of the optimizer state. A parameter is a view into its unit's gathered buffer (param_full), whose storage
is empty except while the unit is in use. The rhythm, per block and per micro-batch:

    forward:  all-gather the block (posted early: the previous block's forward prefetched it) ->
              post the all-gather of the next block -> compute -> free the storage
    backward: all-gather the block again (the later block's backward prefetched it) -> post the gather
              of the block before it -> recompute (activation checkpointing) and backward -> copy the
              gradients into the flat buffer and reduce-scatter it -> free the storage

Freeing is the storage itself (untyped_storage().resize_(0)), not a reference: what autograd saved for
backward are views of the same storage, so they hold no memory in between and see the regathered values.
The root unit stays whole from the step's first forward until the optimizer step (it is used at both
ends of the model: the embedding first, the head last). The gathers, like the reduce-scatters (every
bucket once per micro-batch), are unconditional and in the same order on every rank of the group: a block
runs forward and backward on every rank, even one whose MoE experts got no token. A pipeline stage gathers
each block again for every micro-batch (twice: forward and backward); with pp stages and m micro-batches,
2m all-gathers and m reduce-scatters of each unit per step, each unit's bytes times (dp - 1)/dp on the
wire. Memory at a time: the shards, plus about two gathered blocks (the one computing, the one
prefetched), the root unit, and two buckets of gradients in flight.

What each schedule gathers, per block and micro-batch: afab and 1f1b as above, forward and backward.
interleaved_1f1b the same, chunk by chunk: a block prefetches the next block of its own chunk only (the
root's hook, the chunk's first), since another chunk's block runs only after other actions. zero_bubble
and zbv gather before F and before B, free after each, and gather nothing for W: W computes
dW = dy^T x from the x and dy that B kept and needs no weight, so no block stays gathered from B to W.
Their blocks are two units each, phases of their own (the weights W computes, the rest that B does):
gathered and freed together, two all-gathers per gather; each part's gradients reduce-scattered after
its action. Under zbv rank 0's root unit (the embedding, the final norm, the head) is whole all step.

Both are reducers as parallel.py's ShardedGradientBuckets is, for parallel.ZeroOneAdamW to step with;
expert parallelism (expert_parallel.py) runs one of them over the experts' group beside the other.
"""
from contextlib import contextmanager

import torch
import torch.distributed as dist

from parallel import (ShardedBucket, ShardedGradientBuckets, _all_gather_single, _reduce_scatter_single,
                      reduces_by_all_reduce)


class TransientBucket(ShardedBucket):
    """A sharded bucket whose flat gradient exists only from the first gradient copied in until its
    reduce-scatter has finished; what persists is `grad_shard`, this rank's slice of the mean gradient.
    `phases`: the backward actions that write its gradients. group=None: not split (one rank owns it all)."""

    def __init__(self, params, group):
        super().__init__(params, group)
        self.grad_shard, self.phases = None, frozenset()

    def new_flat(self):
        return None  # (allocated when the first gradient comes: zeros())


class GradientShards(ShardedGradientBuckets):
    """ZeRO-2's reducer: every micro-batch's gradients are reduce-scattered, each added into its bucket's
    `grad_shard`, and p.grad is dropped as soon as it is copied into its bucket, so that no full-size
    gradient lives beyond the two buckets in flight (set_grad_sync's argument is ignored: calling it before
    a backward lands the buckets still in flight, whose flat buffers would otherwise add to that
    backward's peak). After finish() p.grad is None: the gradients are the grad_shards.

    Call backward_done(op, chunk) after each backward action: `phases` ({param: the actions (op, chunk)
    that write its gradient}; by default ("B", 0) for all, one plain backward) says which buckets each
    action completes, and no bucket mixes parameters of different phases; the hooks (and grad_ready for a
    gradient accumulated by hand) launch the buckets that fill during the action, backward_done the rest; a
    parameter that two actions write, alone in its bucket, is sent by backward_done after each.
    `tied` (copies, group): the copies this rank holds of a weight tied across pipeline stages, each alone
    in a bucket, and the group of the stages holding the others: finish() sums their shards over it.
    `units` (ZeRO-3): lists of parameters, one bucket each, each of one phase. group=None: not split (one
    rank holds every shard; nothing is sent)."""

    def __init__(self, params, group, bucket_size_mb=25.0, phases=None, tied=((), None), units=None):
        self.phases, self.units = phases, units
        self.tied_copies, self.tied_group = list(tied[0]), tied[1]
        super().__init__(params, group, bucket_size_mb)
        for b in self.buckets:
            b.phases = self.phase_of(b.params[0])
            if any(self.phase_of(p) != b.phases for p in b.params):
                raise ValueError("GradientShards: a unit mixes parameters that different backward actions complete")
        # each phase's buckets in bucket order (a parameter written by two actions, alone, is in both), and
        # the next of them to launch in the action now running
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
            raise ValueError(f"GradientShards: phases names no backward action for a parameter of shape "
                             f"{tuple(p.shape)}")
        return frozenset(self.phases[p])

    def kind(self, p):
        return self.phase_of(p), any(p is c for c in self.tied_copies) and id(p)  # a tied copy: alone

    def plan(self, params, bucket_size_mb):
        if self.units is None:
            return super().plan(params, bucket_size_mb)
        return [list(u) for u in reversed(self.units) if u]  # one bucket per unit, in backward order

    def new_bucket(self, params):
        return TransientBucket(params, self.group)

    def set_grad_sync(self, sync):
        for bucket in self.in_flight:  # a backward begins: land what the last one left in flight, before its peak
            self.settle(bucket)
        self.in_flight = []

    def grad_ready(self, p):
        """p.grad is complete for this micro-batch: copy it into its bucket, then launch, in its phase's
        bucket order, every bucket that is full and has only launched buckets before it (one that two
        actions write waits for backward_done)."""
        bucket, i = self.where[p]
        if len(bucket.phases) > 1:
            return
        if i in bucket.ready:
            raise RuntimeError(f"GradientShards: a gradient of shape {tuple(p.shape)} became ready twice in one "
                               f"backward action")
        self.copy_in(bucket, i)
        (phase,) = bucket.phases
        buckets = self.phase_buckets[phase]
        while self.next[phase] < len(buckets) and self.full(buckets[self.next[phase]]):
            self.next[phase] += 1
            self.launch(buckets[self.next[phase] - 1])

    def backward_done(self, op, chunk):
        """The backward action (op, chunk) of a micro-batch has run: launch, in order, the buckets of its
        phase that its hooks did not (a parameter without a gradient sends zeros). Every rank launches every
        bucket once per action that writes it, whatever its data did."""
        phase = (op, chunk)
        for bucket in self.phase_buckets.get(phase, [])[self.next.get(phase, 0):]:
            for i in range(len(bucket.params)):
                if i not in bucket.ready:
                    self.copy_in(bucket, i)
            self.launch(bucket)
        self.next[phase] = 0

    def copy_in(self, bucket, i):
        if bucket.shard is not None:  # its last launch must land before it refills
            self.settle(bucket)
        if bucket.flat is None:
            bucket.flat = bucket.zeros()
        super().copy_in(bucket, i)
        bucket.params[i].grad = None  # its elements are in the bucket now: the full-size gradient is not kept

    def launch(self, bucket):
        self.launched += 1
        while len(self.in_flight) >= 2:  # keep at most two buckets' full gradients in flight
            self.settle(self.in_flight.pop(0))
        bucket.shard = torch.empty(bucket.shard_size, dtype=bucket.flat.dtype, device=bucket.flat.device)
        if bucket.world == 1:
            bucket.shard.copy_(bucket.flat)
        elif reduces_by_all_reduce(bucket.group):  # (gloo) the sum lands in flat; settle() keeps this rank's slice
            bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)
        else:
            bucket.work = _reduce_scatter_single(bucket.shard, bucket.flat, group=bucket.group, async_op=True)
        self.in_flight.append(bucket)
        bucket.ready = set()  # sent: the next action that writes it starts it afresh

    def settle(self, bucket):
        """Wait for a bucket's reduce-scatter, add this micro-batch's mean into grad_shard, drop the flat
        gradient."""
        if bucket.shard is None:
            return
        if bucket.work is not None:
            bucket.work.wait()  # sync point: the flat gradient can only be freed once it is sent
            if bucket.world > 1 and reduces_by_all_reduce(bucket.group):
                lo, hi = bucket.owned()
                bucket.shard.copy_(bucket.flat[lo:hi])
        bucket.shard.div_(self.replicas)  # the sum over ranks / dp = the mean over the global batch
        bucket.grad_shard = bucket.shard if bucket.grad_shard is None else bucket.grad_shard.add_(bucket.shard)
        bucket.flat = bucket.shard = bucket.work = None

    def finish(self):
        """Land every bucket still in flight (every action having been closed by backward_done), then sum the
        tied copies' shards across their stages."""
        if any(b.ready for b in self.buckets) or any(p.grad is not None for p in self.where):
            raise RuntimeError("GradientShards.finish: gradients were never sent: call backward_done(op, chunk) "
                               "after each backward action")
        for bucket in self.in_flight:
            self.settle(bucket)
        self.in_flight, self.next, self.launched = [], dict.fromkeys(self.next, 0), 0
        if self.tied_group is not None:
            for p in self.tied_copies:
                dist.all_reduce(self.bucket_of(p).grad_shard, group=self.tied_group)

    def owned_grad(self, p, start, end, bucket, a, b):
        return bucket.grad_shard[a:b]

    def after_step(self):
        super().after_step()  # the updated slices, all-gathered
        for bucket in self.buckets:
            bucket.grad_shard = None


class Unit(TransientBucket):
    """ZeRO-3's bucket: also a unit of parameters, `param_shard` the elements this rank stores, `param_full`
    the gathered whole (its storage empty between uses), `gather` its state (None: empty, a request:
    gathering, True: whole), `keep_whole` for the root unit, `in_backward` while its block's backward runs.
    group=None: not split (the shard is the whole unit)."""

    def __init__(self, params, group):
        super().__init__(params, group)
        self.param_shard = self.param_full = self.gather = None
        self.keep_whole = self.in_backward = False


class FullyShardedParameters(GradientShards):
    """ZeRO-3: GradientShards whose buckets are the units of `units`, [(module or None, params, chunk)] in
    forward order; module None marks a unit kept whole through the step (gathered by the model's forward,
    freed after the optimizer step), else the module whose forward and backward use the unit: a block, whose
    units (one per phase: a split backward's B and W parts) are gathered and freed together. `chunk` is the
    model chunk the block runs in (the model's forward takes chunk=c): a block prefetches the next block of
    its own chunk only, the one that runs next. Moves each unit's parameters into its flat shards and
    registers the hooks on the blocks and on `model`. `phases` and `tied` as GradientShards'. group=None:
    not split (one rank holds every shard, and gathering a unit is copying it)."""

    def __init__(self, params, group, units, model, phases=None, tied=((), None)):
        super().__init__(params, group, phases=phases, tied=tied, units=[ps for _, ps, _ in units])
        self.whole, self.chunks, self.block_of = [], {}, {}  # chunk -> [(block, [its units])] in order
        self.ends_backward = {}  # id(block) -> the unit whose launch says the block's B is over
        with torch.no_grad():
            for module, params, chunk in units:
                if not params:
                    continue
                b = self.bucket_of(params[0])
                full = b.zeros()
                for p, start in zip(b.params, b.offsets):
                    full[start:start + p.numel()].copy_(p.reshape(-1))
                    p.data = full[start:start + p.numel()].view_as(p)  # p now lives in the gathered buffer
                lo, _ = b.owned()
                b.param_shard, b.param_full = full[lo:lo + b.shard_size].clone(), full
                b.keep_whole = module is None
                self._free([b])
                if module is None:
                    self.whole.append(b)
                    continue
                blocks = self.chunks.setdefault(chunk, [])
                if not blocks or blocks[-1][0] is not module:  # a new block: its hooks
                    blocks.append((module, []))
                    c, i = chunk, len(blocks) - 1
                    module.register_forward_pre_hook(lambda mod, args, c=c, i=i: self._pre_forward(c, i))
                    module.register_forward_hook(lambda mod, args, out, c=c, i=i: self._post_forward(c, i, out))
                blocks[-1][1].append(b)
                self.block_of[id(b)] = blocks[-1][1]
        # a block's B is over when the last of its units that B completes is launched (they launch in order)
        order = {id(b): k for k, b in enumerate(self.buckets)}
        for blocks in self.chunks.values():
            for _, block in blocks:
                in_b = [b for b in block if any(op == "B" for op, _ in b.phases)]
                if in_b:
                    self.ends_backward[id(block)] = max(in_b, key=lambda b: order[id(b)])
        model.register_forward_pre_hook(lambda mod, args, kwargs: self._gather_whole(kwargs.get("chunk", 0)),
                                        with_kwargs=True)

    def new_bucket(self, params):
        return Unit(params, self.group)

    def owned_param(self, p, start, end, bucket, a, b):
        return bucket.param_shard[a:b]  # the shard: updating it is the update (the full copy is stale)

    def _units(self):
        return self.whole + [b for blocks in self.chunks.values() for _, block in blocks for b in block]

    # the three states of a unit's parameters: storage empty (gather None, no bytes), gathering (gather =
    # the work), whole (gather True). A block is the list of its units; each is gathered over its group.
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

    def launch(self, bucket):
        """GradientShards' reduce-scatter, then: its gradients are all in, free it; if it is the last unit its
        block's B completes, the backward of the block has run: free the whole block (a split backward's W
        needs no weights, dW = dy^T x; the W part's own launch, after W, finds it free)."""
        super().launch(bucket)
        if bucket.keep_whole:
            return
        block = self.block_of[id(bucket)]
        self._free(block if self.ends_backward.get(id(block)) is bucket else [bucket])

    def after_step(self):
        """After the optimizer stepped the shards every gathered copy is stale: the next forward gathers the
        updated shards."""
        self._free(self._units())
        for bucket in self.buckets:
            bucket.grad_shard = None

    @contextmanager
    def whole_model(self):
        """Every unit gathered, to read the whole model (a test comparing weights)."""
        self._wait(self._units())
        try:
            yield
        finally:
            self._free(self._units())

    def unit_by_unit(self):
        """Yields each unit's parameters gathered, one at a time, then copies this rank's slice of what was
        written into them back into its shard and frees it: a checkpoint loads this way holding one unit
        whole, not the model (which may not fit on one device: that is why it is sharded)."""
        for b in self._units():
            self._wait([b])
            yield b.params
            lo, _ = b.owned()
            b.param_shard.copy_(b.param_full[lo:lo + b.shard_size])
            self._free([b])
