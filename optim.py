"""
The optimizers beside ZeRO's sharded AdamW (parallel.py): torch's AdamW with the interface the
training step uses for every optimizer, and Muon, whose matrices are orthogonalised whole across
tensor- and data-parallel ranks.

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks") steps a weight
matrix along its momentum made orthogonal: the momentum M = U S V^T is replaced by about U V^T, so
that every direction of the matrix moves by the same amount, where a gradient step moves mostly
along its few largest singular directions. U V^T comes without an SVD, from five iterations of a
quintic Newton-Schulz polynomial: matmuls only. Liu et al. 2025 ("Muon is Scalable for LLM
Training", Moonshot AI, section 2.2) scale the update of an A x B matrix by 0.2 * sqrt(max(A, B)): U
V^T has RMS 1 / sqrt(max(A, B)), so the update's RMS is 0.2, about AdamW's, and an AdamW recipe's
learning rate and decoupled weight decay carry over. Muon is for the matrices that map hidden states
to hidden states; the embedding, the head, the router, the norms and the biases stay on AdamW
(Jordan et al. and Liu et al. both keep the embedding and head on AdamW): one optimizer, with
parameter groups.

Orthogonalising is not elementwise, as AdamW is: it needs the whole matrix, which tensor parallelism
and ZeRO's even slices both cut. What each rank holds and which collectives run, for each:
  Tensor parallelism: each rank keeps the momentum of its own slice (momentum is elementwise);
    the tp ranks all-gather the slices of the Nesterov momentum, every rank orthogonalises the full
    matrix and keeps its slice of the result. Gathering is one all-gather per matrix on the fastest
    links, with no extra process group and no scatter back; its price is Newton-Schulz run tp times
    over (dealing whole matrices to tp ranks would split that work, at the cost of a gather to each
    owner and a scatter back). A matrix replicated across the tp ranks (key and value weights with
    fewer heads than ranks, MQA; MLA's down-projections) already has its complete gradient on every
    rank (copy_to_tp summed it), so every rank computes the same update with no collective.
  ZeRO-1 and ZeRO-2: the matrices are dealt whole instead of sliced, over the ranks that hold the
    same parameters (dp x cp under context parallelism, as for ZeroOneAdamW; "dp" below), by their
    Newton-Schulz work (deal_whole). They travel in buckets of their own, one owner each: the
    gradient is reduced to the owner (instead of reduce-scattered), the owner keeps the momentum,
    runs Newton-Schulz, and broadcasts the updated matrix (instead of the all-gather). The AdamW
    parameters keep ZeRO's even slices. ZeRO-1 (WholeMatrixBuckets) reduces once, after the last
    micro-batch. ZeRO-2 (WholeMatrixShards, zero.GradientShards with whole buckets) reduces after
    every micro-batch, the owner adding the sum into the gradient it keeps and every other rank
    freeing the bucket once the reduce has landed: a rank holds the gradients of its own matrices,
    whole, and AdamW's 1/dp shards, ZeRO-2's memory cut at matrix boundaries. With tp as well, the
    tp ranks of the owner do the tp all-gather among themselves. ZeRO-3 is refused: its parameter
    shards would cut the matrices again.
What it costs. Bytes: across dp, what AdamW moves at the same stage (a reduce plus a broadcast move
what a reduce-scatter plus an all-gather move; under ZeRO-2 each rank sends every bucket once per
micro-batch, m times ZeRO-1's reduce traffic, then the broadcast once); across tp, one all-gather of
each matrix. Memory: one momentum per element where AdamW keeps two, about 1/dp of them under ZeRO
(the deal balances the work, not the elements). Compute: Newton-Schulz for an A x B matrix, A <= B,
is 5 x (X X^T: 2 A^2 B, its square: 2 A^3, times X: 2 A^2 B) = 20 A^2 B + 10 A^3 FLOPs a step; for m
x m matrices that is 5 m / (tokens per step) of the training FLOPs (6 m^2 per token), tp times over.
It runs in fp32, so that every layout's update equals one process's to fp32 rounding (Jordan et al.
run it in bf16 on GPUs, faster).

The 2-D weights must be plain matrices (out, in), as nn.Linear keeps them: an expert stored as one
3-D tensor would need its own loop here.
"""

import math

import torch
import torch.distributed as dist

from parallel import (
    ShardedBucket,
    ShardedGradientBuckets,
    _all_gather_along,
    adamw_step,
    at_least_fp32,
    buckets_by_kind,
    full_shape_of,
    gather_slices,
    group_size,
    optimizer_state_bytes,
    params_flat,
    post_gathers,
    shard_of,
    wait_for_params,
)
from zero import GradientShards


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW with weight decay as each parameter group says, stepped by torch's fused
    kernel (one kernel for the whole update: on CPU it was a third of a small model's step unfused),
    with the interface the training step uses for every optimizer: grads() and step(found_inf). Its
    states exist from the start, as ZeroOneAdamW's and Muon's do (their size is reported before the
    first step)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
        for p in (p for g in self.param_groups for p in g["params"]):
            self.state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }

    def grads(self):
        """[(param, gradient)] of every parameter. One that got none (an expert no token reached)
        gets a zero gradient, as the data-parallel reducer gives it: AdamW then steps every
        parameter alike (its moments decay, the weight decays, one step counter for all), and every
        parameter has a state to save."""
        params = [p for g in self.param_groups for p in g["params"]]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [(p, p.grad) for p in params]

    @torch.no_grad()
    def step(self, found_inf=None):
        """AdamW's update (parallel.adamw_step); found_inf (a 0-dim float tensor on the device, 1:
        the gradient is not finite) leaves every weight, moment and step counter as it was, decided
        on the device without a host sync."""
        for group in self.param_groups:
            params = group["params"]
            adamw_step(
                params, [p.grad for p in params], [self.state[p] for p in params], group, found_inf
            )


NEWTON_SCHULZ_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Jordan et al. 2024


def newton_schulz(G, steps=5, eps=1e-7):
    """About U V^T for G = U S V^T. G is scaled to Frobenius norm 1, so every singular value is at
    most 1; then each iteration X <- a X + b (X X^T) X + c (X X^T)^2 X maps every singular value s
    to a s + b s^3 + c s^5 and leaves U and V alone. Jordan et al.'s (a, b, c) buy a steep start (a
    = 3.4: small singular values grow fast) with not converging to exactly 1: after 5 iterations
    every singular value from 0.01 of the norm up lands in [0.68, 1.13], which the update tolerates.
    In fp32 (fp64 in a float64 run); the Gram matrix X X^T is taken on the shorter side."""
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


def newton_schulz_flops(shape, steps=5):
    """The FLOPs of newton_schulz on a matrix of `shape`, A x B with A <= B: each iteration X X^T
    (2 A^2 B), the quintic's square of it (2 A^3) and its product with X (2 A^2 B); 20 A^2 B +
    10 A^3 in 5 steps. Per element it grows with A, so a deal by size is not a deal of the work."""
    a, b = sorted(shape)
    return steps * (4 * a * a * b + 2 * a**3)


def deal_whole(params, n):
    """{param: rank}, in the order given: each param whole to one of n ranks, the ranks' Newton-
    Schulz work (newton_schulz_flops of the full matrix, parallel.full_shape_of) balanced: the
    costliest first, each to the rank with the least so far, ties to the lower rank (Graham's LPT
    rule, within 4/3 of the best deal). Every rank deals the same params alike."""
    params = list(params)
    costs = [newton_schulz_flops(full_shape_of(p)) for p in params]
    load, owners = [0] * n, {}
    for i in sorted(range(len(params)), key=lambda i: -costs[i]):  # (stable: ties keep order)
        owners[i] = min(range(n), key=lambda r: (load[r], r))
        load[owners[i]] += costs[i]
    return {p: owners[i] for i, p in enumerate(params)}


def gather_tp_slices(x, param, group):
    """The full matrix of which x is this rank's tensor-parallel slice (shaped like param); x itself
    when param is replicated (no tp_shard_dim) or the group is one rank."""
    dim = getattr(param, "tp_shard_dim", None)
    if dim is None or group_size(group) == 1:
        return x
    return _all_gather_along(x, group, dim)


class WholeBucket(ShardedBucket):
    """A bucket that one rank of the group, `owner`, gets all of."""

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
    """After the step: the owner's updated matrices to every rank of the group, into the parameters
    themselves (params_flat), in place of ZeRO's all-gather of slices; returns its request."""
    return dist.broadcast(
        params_flat(bucket),
        dist.get_global_rank(bucket.group, bucket.owner),
        group=bucket.group,
        async_op=True,
    )


class WholeMatrixBuckets(ShardedGradientBuckets):
    """ZeRO-1's reducer with some parameters dealt whole: `owners` ({param: rank of group},
    deal_whole's) sends each of those parameters' gradients whole to one rank, in buckets of their
    own, one owner per bucket, reduced to the owner (dist.reduce) instead of reduce-scattered; after
    the step the owner broadcasts what it updated (instead of the all-gather). Every other parameter
    keeps ZeRO-1's even slices. It extends ShardedGradientBuckets through the hooks parallel.py's
    docstring lists."""

    def __init__(self, params, group, bucket_size_mb=25.0, owners=None):
        self.owners = owners or {}
        super().__init__(params, group, bucket_size_mb)

    def plan(self, params, bucket_size_mb):
        return buckets_by_kind(params, bucket_size_mb, self.owners.get)  # one owner per bucket

    def new_bucket(self, params):
        owner = self.owners.get(params[0])
        if owner is None:
            return super().new_bucket(params)
        bucket = WholeBucket(params, self.group, owner)
        bucket.flat = bucket.zeros()
        return bucket

    def launch(self, bucket):
        if not isinstance(bucket, WholeBucket):
            return super().launch(bucket)
        post_reduce(bucket)  # the sum lands on the owner only (land() then finds it in flat)

    def gather(self, bucket):
        if not isinstance(bucket, WholeBucket):
            return super().gather(bucket)
        return post_broadcast(bucket)


class WholeMatrixShards(GradientShards):
    """ZeRO-2's reducer (zero.GradientShards) with some parameters dealt whole, as
    WholeMatrixBuckets deals them at ZeRO-1: each micro-batch's gradients of a bucket of
    `owners`' parameters are reduced to its owner (dist.reduce) instead of reduce-scattered, and
    the owner adds them into its grad_shard, the whole gradient; the other ranks drop the flat
    buffer once the reduce has landed and hold nothing of it. After the step the owner broadcasts
    what it updated. Every other parameter keeps ZeRO-2's even shards. What each rank holds is
    ZeRO-2's promise, cut at matrix boundaries: about 1/dp of the gradients, and of the states.
    `phases` and `tied` as GradientShards' (a pipeline's backward actions; Muon's matrices are the
    blocks', never a tied weight)."""

    def __init__(
        self, params, group, bucket_size_mb=25.0, phases=None, tied=((), None), owners=None
    ):
        self.owners = owners or {}
        super().__init__(params, group, bucket_size_mb, phases, tied)

    def plan(self, params, bucket_size_mb):
        tied = {id(p) for p in self.tied_copies}
        return buckets_by_kind(
            params,
            bucket_size_mb,
            lambda p: (self.phase_of(p), id(p) in tied and id(p), self.owners.get(p)),
        )

    def new_bucket(self, params):
        owner = self.owners.get(params[0])
        if owner is None:
            return super().new_bucket(params)
        # its flat buffer made by copy_in and dropped by settle, as GradientShards' buckets'
        bucket = WholeBucket(params, self.group, owner)
        bucket.phases, bucket.grad_shard = self.phase_of(params[0]), None
        return bucket

    def launch(self, bucket):
        """GradientShards.launch, with a reduce to the owner in place of the reduce-scatter:
        settle() then finds the sum in the owner's flat (its owned range, all of it) and nothing
        on the others (an empty range), so their flat buffer goes unread."""
        if not isinstance(bucket, WholeBucket):
            return super().launch(bucket)
        self.launched += 1
        while len(self.in_flight) >= 2:  # at most two buckets' full gradients in flight
            self.settle(self.in_flight[0])
        post_reduce(bucket)
        self.in_flight.append(bucket)
        bucket.ready = set()

    def after_step(self):
        """The owners' matrices broadcast and the others' slices all-gathered (waited for before
        their parameters are read); the gradients dropped."""
        post_gathers(
            self.buckets,
            lambda b: post_broadcast(b) if isinstance(b, WholeBucket) else gather_slices(b),
        )
        for bucket in self.buckets:
            bucket.grad_shard = None


class Muon(torch.optim.Optimizer):
    """Muon for the parameter groups with muon=True (2-D matrices), AdamW for the others: one
    optimizer, whose param_groups' lr the schedule writes at each step. Muon's update of an A x B
    matrix W with gradient G (Nesterov momentum; Liu et al. 2025's scale and decoupled weight
    decay):
        M <- mu M + G;   O = newton_schulz(G + mu M)
        W <- W - lr * wd * W - lr * 0.2 * sqrt(max(A, B)) * O
    where A x B is the full matrix's shape, on a rank that holds a tensor-parallel slice of it too.
    The other groups take parallel.adamw_step, torch's fused AdamW.

    tp_group: matrices split across it (parameters marked by mark_sharded) are orthogonalised whole,
    see the file's note; None: not split (every matrix is whole here). grad_sync (ZeRO-1 or 2): a
    WholeMatrixBuckets or WholeMatrixShards over the dp x cp group with the matrices dealt whole
    (muon_buckets builds it); the optimizer then steps with it as ZeroOneAdamW does, on the elements
    its owned_slices() name, read through its owned_param and owned_grad (do not also all-reduce the
    gradients). Per step: backward -> grad_sync.finish() -> [clip grads()] -> step(found_inf) (AdamW
    on this rank's slices, Muon on its matrices, then grad_sync.after_step()). Every state exists
    from the start (its size is reported before the first step): AdamW's moments flat over the
    elements this rank updates (`flat_range` under ZeRO), Muon's momentum shaped like the matrix
    (its tp slice)."""

    def __init__(
        self,
        params,
        lr=1e-3,
        momentum=0.95,
        ns_steps=5,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.0,
        tp_group=None,
        grad_sync=None,
    ):
        super().__init__(
            params,
            dict(
                lr=lr,
                momentum=momentum,
                ns_steps=ns_steps,
                betas=betas,
                eps=eps,
                weight_decay=weight_decay,
                muon=False,
            ),
        )
        self.tp_group, self.grad_sync = tp_group, grad_sync
        # the matrices Newton-Schulz ran on and its FLOPs, since the start (ledger.py's proof that
        # Muon ran; tools/bench.py's balance of the work across ranks)
        self.orthogonalized = self.newton_schulz_flops = 0
        self.group_of = {p: g for g in self.param_groups for p in g["params"]}
        self.matrices = [p for g in self.param_groups if g["muon"] for p in g["params"]]
        if any(p.dim() != 2 for p in self.matrices):
            raise ValueError(
                f"Muon orthogonalises 2-D matrices; its groups hold tensors of shapes "
                f"{sorted({tuple(p.shape) for p in self.matrices if p.dim() != 2})}"
            )
        # ZeRO: {param: its piece this rank owns, (param, start, end, bucket, a, b)}: a matrix whole
        self.slices = {piece[0]: piece for piece in grad_sync.owned_slices()} if grad_sync else {}
        if grad_sync is not None:
            pieces = [piece[:3] for piece in self.slices.values()]
        else:
            pieces = [(p, 0, p.numel()) for g in self.param_groups for p in g["params"]]
        for p, start, end in pieces:
            if self.group_of[p]["muon"]:
                self.state[p] = {"momentum_buffer": torch.zeros_like(p)}
            else:
                self.state[p] = {
                    "step": torch.zeros((), device=p.device),
                    "exp_avg": torch.zeros(end - start, dtype=p.dtype, device=p.device),
                    "exp_avg_sq": torch.zeros(end - start, dtype=p.dtype, device=p.device),
                }
            if grad_sync is not None:
                self.state[p]["flat_range"] = (start, end)

    def grads(self):
        """[(param, gradient)]: every gradient element this rank holds, each once (ZeRO: its owned
        slices, a matrix's whole gradient on its owner). A parameter without a gradient (an expert
        no token reached) gets a zero one, as the data-parallel reducer gives it, so that every
        parameter steps alike."""
        if self.grad_sync is not None:
            return [(p, self.grad_sync.owned_grad(*piece)) for p, piece in self.slices.items()]
        for p in self.group_of:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [(p, p.grad) for p in self.group_of]

    def owned(self, p):
        """(p's elements this rank updates, their gradient), flat views: all of them without a
        reducer, else its owned slice (ZeRO-2: the gradient is the reducer's, p.grad is None)."""
        if self.grad_sync is None:
            return p.detach().view(-1), p.grad.view(-1)
        return self.grad_sync.owned_param(*self.slices[p]), self.grad_sync.owned_grad(
            *self.slices[p]
        )

    @torch.no_grad()
    def step(self, found_inf=None):
        """found_inf: as ZeroOneAdamW.step's (a step with a non-finite gradient changes nothing)."""
        if self.grad_sync is not None:
            # (the last gathers, if no forward waited: they write p too)
            wait_for_params(self.grad_sync.buckets)
        for group in self.param_groups:
            if group["muon"]:
                continue
            mine = [p for p in group["params"] if self.state.get(p)]
            params, grads = zip(*map(self.owned, mine)) if mine else ((), ())
            adamw_step(list(params), list(grads), [self.state[p] for p in mine], group, found_inf)
        for p in self.matrices:  # the same order on every rank: the tp all-gathers match
            state = self.state.get(p)
            if not state:
                continue  # another data-parallel rank owns it (ZeRO)
            group = self.group_of[p]
            lr, mu = group["lr"], group["momentum"]
            momentum, grad = state["momentum_buffer"], self.owned(p)[1].view_as(p)
            new_momentum = momentum.mul(mu).add_(grad)
            # the gradient plus the momentum's next step
            nesterov = grad.add(new_momentum, alpha=mu)
            full = gather_tp_slices(nesterov, p, self.tp_group)  # (A, B): the whole matrix
            orthogonal = shard_of(newton_schulz(full, group["ns_steps"]), p).to(p.dtype)
            self.orthogonalized += 1
            self.newton_schulz_flops += newton_schulz_flops(full.shape, group["ns_steps"])
            scale = -lr * 0.2 * math.sqrt(max(full.shape))
            new_p = (p * (1 - lr * group["weight_decay"])).add_(orthogonal, alpha=scale)
            # found_inf: keep the old values
            for old, new in (
                (p, new_p),
                (momentum, new_momentum),
            ):
                old.copy_(new if found_inf is None else torch.where(found_inf.bool(), old, new))
        if self.grad_sync is not None:
            self.grad_sync.after_step()


def muon_buckets(
    params, matrices, group, bucket_size_mb=25.0, zero_stage=1, phases=None, tied=((), None)
):
    """ZeRO-1 or 2 under Muon: the reducer that deals `matrices` whole (in backward order, as the
    buckets fill) over `group` and cuts every other parameter of `params` in ZeRO's even slices:
    WholeMatrixBuckets, or at zero_stage=2 WholeMatrixShards (phases and tied: GradientShards')."""
    owners = deal_whole(reversed(list(matrices)), group_size(group))
    if zero_stage == 2:
        return WholeMatrixShards(params, group, bucket_size_mb, phases, tied, owners)
    return WholeMatrixBuckets(params, group, bucket_size_mb, owners)


class DynamicLossScaler:
    """fp16 has a narrow range: gradients of small losses underflow to zero. Multiply the loss by a
    large scale before backward (loss_multiplier) and divide the gradients by it after (unscale). A
    step whose gradient norm is inf/nan is skipped (the optimizer's found_inf) and the scale halved;
    after `growth_interval` good steps it doubles (Micikevicius et al. 2017). The overflow check
    uses the global gradient norm, already reduced across every rank, so all ranks agree on skipping
    a step. With enabled=False (bf16, fp32) it does nothing."""

    def __init__(self, enabled, scale=2.0**16, growth_interval=2000):
        self.enabled, self.scale, self.growth_interval, self.good_steps = (
            enabled,
            scale,
            growth_interval,
            0,
        )

    def loss_multiplier(self):
        return self.scale if self.enabled else 1.0

    def unscale(self, grads):
        if self.enabled:
            for _, grad in grads:
                grad.mul_(1.0 / self.scale)

    def update(self, found_inf):
        """After the global gradient norm: found_inf (0-dim, 1 when it is not finite) lowers the
        scale, good steps raise it. Reading it is a host-device sync, with fp16 only."""
        if not self.enabled:
            return
        if found_inf.item():
            self.scale /= 2
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2


def describe_optimizer(optimizer, model, cfg, layout):
    """The start-up lines saying what train.py's optimizer is (cfg: its settings) and what its state
    costs on rank 0."""
    state = f"state {optimizer_state_bytes(optimizer) / 2**20:.2f} MiB on rank 0"
    dp, stage = layout.dp_cp, cfg.zero_stage
    if cfg.optimizer == "muon":
        n = sum(p.numel() for p in optimizer.matrices)
        sharded = (
            f", whole matrices and AdamW slices across {dp} data-parallel ranks (ZeRO-{stage})"
        )
        if stage == 2:
            sharded += ", the gradients too: each matrix's kept by its owner alone"
        return (
            f"optimizer: Muon for {len(optimizer.matrices)} matrices ({n / 1e6:.2f}M parameters "
            f"on rank 0), AdamW for the rest; {state}" + (sharded if stage else "")
        )
    if stage == 0:
        return f"optimizer: AdamW, {state}"
    unsharded = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    text = (
        f"optimizer: ZeroOneAdamW (ZeRO-{stage}), {state}, about 1/{dp} of the unsharded "
        f"{unsharded / 2**20:.2f} MiB"
    )
    if stage >= 2 and dp > 1:
        m = cfg.gradient_accumulation_steps
        text += (
            f"\nZeRO-{stage}: the gradients are reduce-scattered after every one of the {m} "
            f"micro-batches ({m}x the reduce traffic of ZeRO-1, which sends them once per step) "
            f"and kept as 1/{dp} shards"
        )
        if stage == 3:
            text += (
                "; the parameters too: each block all-gathered before its forward and "
                "again before its backward, every micro-batch"
            )
    return text
