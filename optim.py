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
    who orthogonalises the whole matrix is muon_tp_mode's choice (Muon's tp_mode):
      'replicate': the tp ranks all-gather the slices of the Nesterov momentum, every rank
        orthogonalises the full matrix and keeps its slice of the result: one all-gather per
        matrix, no scatter back, Newton-Schulz run tp times over.
      'split': the matrices are dealt whole to the tp ranks by their Newton-Schulz work
        (deal_tp, deal_whole's rule); each matrix's slices are gathered to its owner (dist.gather),
        which alone orthogonalises it and scatters the slices of the result back (dist.scatter).
        The gathers are posted first, the scatters waited for last, so the owners work side by
        side: each rank runs about 1/tp of the Newton-Schulz, for a scatter more than replicate.
      'auto': per matrix, split where that is faster (split_pays): split sends the matrix once
        more (the scatter: (tp-1)/tp S / busbw for S bytes) and saves (tp-1)/tp of its F FLOPs per
        rank, so it pays when F / flops > S / busbw (latencies overlap: split_pays says why). At
        the rates build.py gives (Newton-Schulz's fp32 matmul rate; TP_LINK_BUSBW): an 8B model
        (n_embd 4096, intermediate 14336, 8 kv heads) at tp = 8 on H100s (67 TFLOP/s fp32, NVLink
        370 GB/s) splits every matrix: q 30.8 ms of Newton-Schulz against 0.18 ms of scatter, k
        1.4 against 0.05, gate 82 against 0.64. The quick start (config/tiny_fineweb.py, n_embd
        128) at tp = 2 on this 2-core CPU (77 GFLOP/s a process, gloo 1.35 GB/s) splits every
        matrix too: q 0.82 ms against 0.05, k 0.17 against 0.02, gate 1.9 against 0.15; measured
        there (tools/bench.py), the optimizer step took 131 ms split against 326 ms replicated.
        At those rates a matrix replicates only below 8 rows square (CPU) or 25 (H100), 12 or 37
        rows of a 4096-wide one: a tiny test model's. A slower link at a faster rate moves the
        line: across nodes (48 GB/s) at bf16's 989 TFLOP/s, the 8B's k (1024 rows) replicates.
    A matrix replicated across the tp ranks (key and value weights with fewer heads than ranks,
    MQA; MLA's down-projections) already has its complete gradient on every rank (copy_to_tp summed
    it), so every rank computes the same update with no collective, in every mode (deal_tp says
    why it is not dealt).
  ZeRO (every stage): the matrices are dealt whole instead of sliced, over the ranks that hold the
    same parameters (dp x cp under context parallelism, as for ZeroOneAdamW; "dp" below; an
    expert's over the dp x cp / ep ranks holding the same experts, whose reducer deals them apart),
    by their Newton-Schulz work (deal_whole). They travel in buckets of their own, one owner each
    (zero.WholeBucket): the gradient is reduced to the owner (instead of reduce-scattered), the
    owner keeps the momentum, runs Newton-Schulz and updates the matrix, which it broadcasts
    (instead of the all-gather). The AdamW parameters keep ZeRO's even slices. ZeRO-1
    (WholeMatrixBuckets) reduces once, after the last micro-batch. ZeRO-2 (zero.GradientShards
    given the owners) reduces after every micro-batch, the owner adding the sum into the gradient
    it keeps and every other rank freeing the bucket once the reduce has landed: a rank holds the
    gradients of its own matrices, whole, and AdamW's 1/dp shards, ZeRO-2's memory cut at matrix
    boundaries. ZeRO-3 (zero.FullyShardedParameters given the owners) stores each matrix on its
    owner alone, whole, in a unit of its own (each block's unit cut by owner, the parts gathered
    and freed together): it is broadcast from the owner wherever ZeRO-3 all-gathers (before the
    block's forward and again before its backward), its gradient reduced to the owner, and the
    owner updates its stored copy (owned_param: p itself is a view of a freed buffer at step
    time); the next forward's broadcast carries the update. With tp as well, the tp ranks of the
    owner do the tp all-gather among themselves.
What it costs. Bytes: across dp, what AdamW moves at the same stage (a reduce plus a broadcast move
what a reduce-scatter plus an all-gather move; under ZeRO-2 each rank sends every bucket once per
micro-batch, m times ZeRO-1's reduce traffic, then the broadcast once; under ZeRO-3 per
micro-batch a broadcast before each forward and each backward and a reduce, nothing after the
step); across tp, one all-gather of each matrix (replicate), or a gather and a scatter (split).
Memory: one momentum per element where AdamW keeps two, about 1/dp of them under ZeRO (the deal
balances the work, not the elements; ZeRO-3 the parameters and gradients too, cut alike);
split holds every dealt matrix's gathered slices, results and scattered slices within the step,
about three momenta of the tp slice at most. Compute: Newton-Schulz for an A x B matrix, A <= B,
is 5 x (X X^T: 2 A^2 B, its square: 2 A^3, times X: 2 A^2 B) = 20 A^2 B + 10 A^3 FLOPs a step; for m
x m matrices that is 5 m / (tokens per step) of the training FLOPs (6 m^2 per token), tp times over
under replicate, once under split.
It runs in fp32, so that every layout's update equals one process's to fp32 rounding (Jordan et al.
run it in bf16 on GPUs, faster).

The 2-D weights must be plain matrices (out, in), as nn.Linear keeps them: an expert stored as one
3-D tensor would need its own loop here.
"""

import math

import torch
import torch.distributed as dist

from parallel import (
    ShardedGradientBuckets,
    _all_gather_along,
    adamw_step,
    at_least_fp32,
    buckets_by_kind,
    full_shape_of,
    group_rank,
    group_size,
    optimizer_state_bytes,
    shard_of,
    wait_for_params,
)
from zero import (
    FullyShardedParameters,
    GradientShards,
    WholeBucket,
    post_broadcast,
    post_reduce,
)


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


def post_gather_to_owner(x, group, owner):
    """Post the gather of x, this rank's tensor-parallel slice of a matrix, to the rank `owner` of
    group: (its request, on the owner a list to receive the slices in rank order, else None)."""
    x = x.contiguous()
    slices = None
    if group_rank(group) == owner:
        slices = [torch.empty_like(x) for _ in range(group_size(group))]
    request = dist.gather(
        x, slices, dst=dist.get_global_rank(group, owner), group=group, async_op=True
    )
    return request, slices


def post_scatter_from_owner(full, param, group, owner):
    """Post the scatter of the owner's `full` matrix (None on the other ranks) in slices along
    param's tp_shard_dim, each rank's slice to it: (its request, this rank's slice, shaped like
    param)."""
    mine = torch.empty(param.shape, dtype=param.dtype, device=param.device)
    slices = None
    if full is not None:
        slices = [s.contiguous() for s in full.chunk(group_size(group), param.tp_shard_dim)]
    request = dist.scatter(
        mine, slices, src=dist.get_global_rank(group, owner), group=group, async_op=True
    )
    return request, mine


TP_MODES = ("auto", "split", "replicate")

# The tensor-parallel link's bus bandwidth (bytes/s) that tp_mode='auto' prices the scatter on, by
# device type: tools/machines.py's figures, copied since training never imports tools/
# (tests/test_muon_tp.py holds them equal). A GPU's: NVLink 4 within a DGX H100 (MACHINES["h100"]
# ["node"]: nccl-tests ring busbw 370 GB/s); a CPU's: gloo between processes (CPU_GLOO_LINK).
TP_LINK_BUSBW = {"cuda": 370e9, "cpu": 1.35e9}


def split_pays(shape, element_bytes, rates, steps=5):
    """Whether dealing an A x B matrix to one tp rank (tp_mode='split') takes less time than every
    tp rank orthogonalising it ('replicate'), at rates {flops: Newton-Schulz's fp32 FLOP/s, busbw:
    the tp link's bytes/s}. Both modes gather the momentum's slices (an all-gather, or a gather to
    the owner: the same bytes into a rank); split then scatters the result back, (tp-1)/tp S /
    busbw more for a matrix of S bytes, and runs Newton-Schulz's F FLOPs once instead of tp times,
    (tp-1)/tp F / flops less per rank on average. tp cancels: split pays when F / flops > S /
    busbw, at least 5 A FLOPs a byte in fp32 against the machine's FLOPs per byte of link. No
    latency: split posts every gather before it waits for one, and every scatter, so theirs
    overlap, where replicate waits for each all-gather in turn (the quick start's 28 matrices at
    tp = 2 on gloo: split's 28 gathers and 28 scatters took 20-22 ms, replicate's 28 all-gathers
    20 ms). The file's note works it for an 8B model and the quick start."""
    compute = newton_schulz_flops(shape, steps) / rates["flops"]
    return compute > math.prod(shape) * element_bytes / rates["busbw"]


def deal_tp(matrices, group, mode, rates=None):
    """{matrix: the rank of group that orthogonalises it} (deal_whole's deal) for the matrices of
    `matrices` ([(param, its Newton-Schulz steps)], the same list on every rank of group) that mode
    deals: 'split' every one split across group, 'auto' those split_pays at `rates` (none without
    rates), 'replicate' none. A matrix replicated across group (no tp_shard_dim: MQA's k and v,
    MLA's down-projections) is never dealt: its gradient is already whole on every rank, so each
    orthogonalises it with no collective at all, where dealing it would add a broadcast of its
    update to save (tp-1)/tp of its Newton-Schulz. These are the thin matrices, r rows of n
    (head_dim, or the latent rank), whose 20 r^2 n FLOPs are r^2 / n^2 of a square matrix's: at
    an 8B model's n = 4096, an MQA key projection (r = 128) is 1.4 GFLOP, 0.07% of the query's."""
    if mode not in TP_MODES:
        raise ValueError(f"tp_mode = {mode!r} must be one of {', '.join(map(repr, TP_MODES))}")
    tp = group_size(group)
    if tp == 1 or mode == "replicate":
        return {}
    dealt = [
        p
        for p, steps in matrices
        if getattr(p, "tp_shard_dim", None) is not None
        and (
            mode == "split"
            or rates is not None
            and split_pays(full_shape_of(p), p.element_size(), rates, steps)
        )
    ]
    return deal_whole(dealt, tp)


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


def copy_unless_inf(old, new, found_inf):
    """old <- new, unless found_inf (a 0-dim tensor on the device, 1: the step's gradient is not
    finite) says to keep the old values; decided on the device, without a host sync."""
    old.copy_(new if found_inf is None else torch.where(found_inf.bool(), old, new))


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
    see the file's note; None: not split (every matrix is whole here). tp_mode: who runs their
    Newton-Schulz, 'replicate' every tp rank, 'split' one tp rank each (deal_tp), 'auto' split
    where split_pays at tp_rates ({flops, busbw}, the same on every tp rank; None: none
    pays). grad_sync (ZeRO-1, 2 or 3): a WholeMatrixBuckets, zero.GradientShards or
    zero.FullyShardedParameters over the dp x cp group with the matrices dealt whole (muon_buckets
    builds it); the optimizer then steps with it as ZeroOneAdamW does, on the elements its
    owned_slices() name, read through its owned_param and owned_grad (do not also all-reduce the
    gradients). Per step: backward -> grad_sync.finish() ->
    [clip grads()] -> step(found_inf) (AdamW on this rank's slices, Muon on its matrices, then
    grad_sync.after_step()). Every state exists from the start (its size is reported before the
    first step): AdamW's moments flat over the elements this rank updates (`flat_range` under
    ZeRO), Muon's momentum shaped like the matrix (its tp slice)."""

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
        tp_mode="replicate",
        tp_rates=None,
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
        # the matrices the last step orthogonalised, or received orthogonalised from their tp owner
        # (the per-step check: stepped_without_newton_schulz)
        self.updated_orthogonal = set()
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
        # {matrix: the tp rank that orthogonalises it}, of those this rank steps that tp_mode deals
        mine = [(p, self.group_of[p]["ns_steps"]) for p in self.matrices if self.state.get(p)]
        self.tp_owners = deal_tp(mine, tp_group, tp_mode, tp_rates)

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

    def owned_param(self, p):
        """p's elements this rank updates, a flat view (updating it updates them): all of them
        without a reducer, else its owned slice, a matrix whole (ZeRO-3: in the shard the reducer
        stores, p itself being a view of a buffer freed at step time)."""
        if self.grad_sync is None:
            return p.detach().view(-1)
        return self.grad_sync.owned_param(*self.slices[p])

    def owned(self, p):
        """(owned_param(p), its gradient, flat): p.grad without a reducer, else the reducer's
        (ZeRO-2 and 3 keep it themselves, p.grad is None)."""
        if self.grad_sync is None:
            return self.owned_param(p), p.grad.view(-1)
        return self.owned_param(p), self.grad_sync.owned_grad(*self.slices[p])

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
        self.updated_orthogonal = set()
        dealt = []  # (matrix, its gather to its tp owner) of those tp_mode deals (tp_owners)
        for p in self.matrices:  # the same order on every rank: the tp collectives match
            state = self.state.get(p)
            if not state:
                continue  # another data-parallel rank owns it (ZeRO)
            mu = self.group_of[p]["momentum"]
            momentum, grad = state["momentum_buffer"], self.owned(p)[1].view_as(p)
            new_momentum = momentum.mul(mu).add_(grad)
            # the gradient plus the momentum's next step
            nesterov = grad.add(new_momentum, alpha=mu)
            copy_unless_inf(momentum, new_momentum, found_inf)
            if p in self.tp_owners:  # orthogonalised below, by its owner alone
                dealt.append((p, post_gather_to_owner(nesterov, self.tp_group, self.tp_owners[p])))
                continue
            full = gather_tp_slices(nesterov, p, self.tp_group)  # (A, B): the whole matrix
            self.update(p, shard_of(self.orthogonalised(full, p), p), found_inf)
        for p, orthogonal in self.orthogonalise_dealt(dealt):
            self.update(p, orthogonal, found_inf)
        if self.grad_sync is not None:
            self.grad_sync.after_step()

    def orthogonalised(self, full, p):
        """newton_schulz of p's whole matrix at its group's steps, in p's dtype, counted."""
        steps = self.group_of[p]["ns_steps"]
        self.orthogonalized += 1
        self.updated_orthogonal.add(p)
        self.newton_schulz_flops += newton_schulz_flops(full.shape, steps)
        return newton_schulz(full, steps).to(p.dtype)

    def update(self, p, orthogonal, found_inf):
        """W <- W - lr * wd * W - lr * 0.2 * sqrt(max(A, B)) * O, with O this rank's slice of the
        orthogonalised matrix and A x B the whole matrix's shape; found_inf keeps W. W is what
        owned_param says (ZeRO-3: the stored shard, not p)."""
        group = self.group_of[p]
        lr = group["lr"]
        scale = -lr * 0.2 * math.sqrt(max(full_shape_of(p)))
        weight = self.owned_param(p).view_as(p)
        new_p = (weight * (1 - lr * group["weight_decay"])).add_(orthogonal, alpha=scale)
        copy_unless_inf(weight, new_p, found_inf)

    def orthogonalise_dealt(self, gathers):
        """[(matrix, this rank's slice of it orthogonalised)] of the matrices dealt to one tp rank
        each, from their gathers, posted in the same order on every rank ([(matrix, (request,
        slices))]): each owner orthogonalises its own as they land and posts the scatter of each
        result (the others post theirs at once); every rank waits for the scatters only after
        posting them all, so the owners' Newton-Schulz runs side by side. (A scatter waited for at
        once would have every rank stand through each owner's work in turn: the FLOPs split, the
        time not.)"""
        scatters = []
        while gathers:  # (popped: a matrix's gathered slices freed once it is orthogonalised)
            p, (request, slices) = gathers.pop(0)
            request.wait()
            full = None
            if slices is not None:  # this rank's: (A, B), the slices joined in rank order
                full = self.orthogonalised(torch.cat(slices, p.tp_shard_dim), p)
            else:  # its tp owner's (whose own check holds it to having run Newton-Schulz)
                self.updated_orthogonal.add(p)
            scatters.append((p, post_scatter_from_owner(full, p, self.tp_group, self.tp_owners[p])))
        for _, (request, _) in scatters:
            request.wait()
        return [(p, orthogonal) for p, (_, orthogonal) in scatters]


def stepped_without_newton_schulz(optimizer, named_matrices):
    """The names of the matrices that take Muon (named_matrices: the model's, [(name, param)]) which
    the last optimizer step updated on this rank without Newton-Schulz: stepped by AdamW (a matrix
    that never reached Muon's group, or an optimizer that is not Muon at all), or by Muon along a
    momentum that never went through Muon.orthogonalised. A matrix this rank does not update (ZeRO:
    another rank owns it) is none of them. DeepSpeed's Muon once trained as SGD for a whole run
    with no sign (its issue 8441): train.py checks this after every step."""
    done = getattr(optimizer, "updated_orthogonal", set())
    return [
        name
        for name, p in named_matrices
        if optimizer.state.get(p) and ("momentum_buffer" not in optimizer.state[p] or p not in done)
    ]


def muon_buckets(
    params,
    matrices,
    group,
    bucket_size_mb=25.0,
    zero_stage=1,
    phases=None,
    tied=((), None),
    units=None,
    model=None,
):
    """ZeRO-1, 2 or 3 under Muon: the reducer that deals `matrices` whole (in backward order, as
    the buckets fill) over `group` and cuts every other parameter of `params` in ZeRO's even
    slices: WholeMatrixBuckets, or zero.GradientShards (2) or zero.FullyShardedParameters (3, its
    `units` and `model`) given the deal as their owners (phases and tied: GradientShards')."""
    owners = deal_whole(reversed(list(matrices)), group_size(group))
    if zero_stage == 3:
        return FullyShardedParameters(params, group, units, model, phases, tied, owners)
    if zero_stage == 2:
        return GradientShards(params, group, bucket_size_mb, phases, tied, owners=owners)
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
        if stage == 3:
            sharded += (
                ", the gradients and parameters too: each matrix stored by its owner alone, "
                "broadcast from it before each block's forward and backward"
            )
        split = (
            f"; muon_tp_mode={cfg.muon_tp_mode!r}: rank 0 deals {len(optimizer.tp_owners)} "
            f"matrices' Newton-Schulz over the {layout.tp} tp ranks, the rest run on every tp rank"
        )
        return (
            f"optimizer: Muon for {len(optimizer.matrices)} matrices ({n / 1e6:.2f}M parameters "
            f"on rank 0), AdamW for the rest; {state}"
            + (sharded if stage else "")
            + (split if layout.tp > 1 else "")
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
