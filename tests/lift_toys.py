"""The toys of tests/test_lift.py: each mechanism, lifted alone into a folder of its own, on 2 gloo
ranks against one process computed here, in the same worker.

test_lift.py copies this file into an empty folder beside the lifted ones and runs it there, one
process per rank (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment, as torchrun sets
them), with the checkout not on sys.path: it imports nothing of picotron but the lifted files, each
from its own folder (lifted()); a reducer's toy runs a second time from the folder mutants.json
names, if any (the mutation test's). Each rank writes what its toys measured to rank<r>.json: {toy:
{what: [kind, largest difference]}}, the difference ||a - b|| / ||b|| of a tensor against its
one-process value (|a - b| / |b| for a loss), `kind` naming the tolerance test_lift.py holds it to.
"""

import copy
import importlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
WORLD = (
    None  # the group of both ranks (dist.group.WORLD once initialised): None would mean "not split"
)


def lifted(folder, name):
    """Module `name` from HERE/folder, and nothing another toy lifted: every module imported from
    another folder here is forgotten first, so that an extension finds only its own folder's
    parallel.py."""
    for key, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve().parent.parent == HERE:
            del sys.modules[key]
    sys.path.insert(0, str(HERE / folder))
    try:
        module = importlib.import_module(name)
    finally:
        sys.path.remove(str(HERE / folder))
    for m in sys.modules.values():  # whatever it imported of ours came from its folder
        file = getattr(m, "__file__", None)
        if file and Path(file).resolve().parent.parent == HERE:
            assert Path(file).resolve().parent == HERE / folder, (
                f"{name} imported {file}, outside {folder}/"
            )
    return module


def difference(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def gathered(x, dim):
    """Both ranks' x side by side along dim (a tensor-parallel slice, whole)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def randn(g, *shape):
    return torch.randn(*shape, generator=g)


# -----------------------------------------------------------------------------
# the core pieces: a section of parallel.py with the sections it needs


def tensor_parallel_mlp(rank):
    """ColumnParallelLinear -> gelu -> RowParallelLinear at tp = 2, filled with its shards of the
    full tensors (shard_of), against the MLP unsplit: the output, the input's gradient and the full
    weights' and biases' gradients."""
    tp = lifted("tensor_parallel", "parallel")
    g = torch.Generator().manual_seed(0)
    # (B, T, C), the same on both ranks; dy: d loss / d out
    x, dy = (
        randn(g, 3, 5, 8),
        randn(g, 3, 5, 8),
    )
    w_up, b_up, w_down, b_down = randn(g, 16, 8), randn(g, 16), randn(g, 8, 16), randn(g, 8)
    # this rank: 8 of the 16 hidden features
    up = tp.ColumnParallelLinear(8, 16, bias=True, group=WORLD)
    down = tp.RowParallelLinear(16, 8, bias=True, group=WORLD)
    with torch.no_grad():  # this rank's slice of each full tensor (a replicated bias: all of it)
        for layer, w, b in ((up, w_up, b_up), (down, w_down, b_down)):
            layer.weight.copy_(tp.shard_of(w, layer.weight))
            layer.bias.copy_(tp.shard_of(b, layer.bias))
    x_here = x.clone().requires_grad_()
    out = down(F.gelu(up(x_here)))
    out.backward(dy)

    one = [t.clone().requires_grad_() for t in (x, w_up, b_up, w_down, b_down)]
    out_one = F.linear(F.gelu(F.linear(one[0], one[1], one[2])), one[3], one[4])
    out_one.backward(dy)
    weights = max(
        difference(gathered(up.weight.grad, 0), one[1].grad),
        difference(gathered(up.bias.grad, 0), one[2].grad),
        difference(gathered(down.weight.grad, 1), one[3].grad),
        # (the row-parallel bias is whole on each rank)
        difference(down.bias.grad, one[4].grad),
    )
    return {
        "output": ("output", difference(out, out_one)),
        "input gradient": ("gradient", difference(x_here.grad, one[0].grad)),
        "weight and bias gradients": ("gradient", weights),
    }


class ToyStage(nn.Module):
    """A pipeline stage: a linear layer, then tanh, or on the last stage the mean squared error."""

    def __init__(self, n_in, n_out, last):
        super().__init__()
        self.linear, self.last = nn.Linear(n_in, n_out), last

    def forward(self, x, targets=None):
        out = self.linear(x)
        return (out, F.mse_loss(out, targets)) if self.last else (torch.tanh(out), None)


def pipeline_1f1b(rank):
    """run_schedule walking one_f_one_b_actions on two stages, one per rank, 4 microbatches, against
    both stages on one process accumulating the microbatches' mean loss: the loss and each stage's
    gradients. Exact: the schedule reorders only forwards against backwards, each microbatch's
    arithmetic is the one process's and the gradients accumulate in the same microbatch order."""
    pp = lifted("pipeline", "parallel")
    torch.manual_seed(0)
    stages = [ToyStage(6, 8, last=False), ToyStage(8, 3, last=True)]
    one = copy.deepcopy(stages)
    g = torch.Generator().manual_seed(1)
    microbatches = [(randn(g, 4, 6), randn(g, 4, 3)) for _ in range(4)]
    # what travels: (batch, 8) activations
    comm = pp.PipelineComm(rank, 2, [0, 1], lambda x: (x.shape[0], 8))
    loss = pp.run_schedule(pp.one_f_one_b_actions(2, rank, 4), stages[rank], microbatches, comm)
    dist.all_reduce(loss)  # this rank's part of the mean loss: the last stage's, and 0

    loss_one = 0.0
    for x, y in microbatches:
        _, l = one[1](one[0](x)[0], y)
        (l / 4).backward()
        loss_one += l.detach() / 4
    grads = max(
        difference(p.grad, q.grad)
        for p, q in zip(stages[rank].parameters(), one[rank].parameters())
    )
    return {
        "loss": ("exact", abs(loss - loss_one).item() / abs(loss_one).item()),
        "this stage's gradients": ("exact", grads),
    }


def toy_model(seed, bias=True):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3, bias=bias))


def data_parallel(rank, folder="data_parallel"):
    """GradientBuckets over dp = 2, each rank a half of the batch in two micro-batches (gradient
    accumulation), small buckets: the average gradient against one process's gradient of the whole
    batch."""
    dp = lifted(folder, "parallel")
    model = toy_model(0)
    one = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = randn(g, 8, 5), randn(g, 8, 3)
    # ~100 bytes a bucket
    sync = dp.GradientBuckets(model.parameters(), WORLD, bucket_size_mb=100 / 2**20)
    assert len(sync.buckets) > 1
    mine = slice(4 * rank, 4 * rank + 4)
    for i, micro in enumerate((slice(0, 2), slice(2, 4))):
        sync.set_grad_sync(i == 1)  # only the last micro-batch's backward communicates
        (F.mse_loss(model(x[mine][micro]), y[mine][micro]) / 2).backward()
    sync.finish()
    F.mse_loss(one(x), y).backward()
    return {
        "gradients": (
            "gradient",
            max(difference(p.grad, q.grad) for p, q in zip(model.parameters(), one.parameters())),
        )
    }


def owned_gradients(opt, pairs):
    """The largest difference between the gradient elements a ZeRO optimizer steps with on this rank
    (its grads(): the slices it owns, after the reducer's finish, before the step) and the same
    elements of the one-process gradient: `pairs` maps each parameter to its one-process twin."""
    return max(
        difference(g, pairs[p].grad.reshape(-1)[slice(*opt.state[p]["flat_range"])])
        for p, g in opt.grads()
    )


def owned_weights(opt, pairs):
    """The same for the weights this rank stores and updates (a view of p, or ZeRO-3's shard)."""
    return max(
        difference(
            opt.owned_param(p), pairs[p].detach().reshape(-1)[slice(*opt.state[p]["flat_range"])]
        )
        for p in opt.state
    )


def zero_one(rank, folder="zero_one"):
    """ShardedGradientBuckets + ZeroOneAdamW at dp = 2 (63 elements in one bucket: padded to 64, the
    ranks' slices cut through a weight), 3 steps, against torch.optim.AdamW on one process: the
    losses, the gradient slices each rank steps with (before the step: AdamW's update barely changes
    when a gradient is scaled, so the weights alone would not see a gradient dp times too large) and
    the weights after it."""
    z = lifted(folder, "parallel")
    model, one = toy_model(0, bias=False), toy_model(0, bias=False)
    pairs = dict(zip(model.parameters(), one.parameters()))
    sync = z.ShardedGradientBuckets(list(model.parameters()), WORLD)
    opt = z.ZeroOneAdamW(model.parameters(), sync, lr=1e-2, weight_decay=0.1)
    opt_one = torch.optim.AdamW(one.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    mine = slice(4 * rank, 4 * rank + 4)
    losses, grads, weights = 0.0, 0.0, 0.0
    for _ in range(3):
        x, y = randn(g, 8, 5), randn(g, 8, 3)
        loss = F.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        sync.finish()
        loss_one = F.mse_loss(one(x), y)
        loss_one.backward()
        grads = max(grads, owned_gradients(opt, pairs))
        opt.step()
        opt.zero_grad()
        opt_one.step()
        opt_one.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)  # the two halves' mean losses: their mean is the batch's
        losses = max(losses, abs(loss / 2 - loss_one).item() / loss_one.item())
        weights = max([weights] + [difference(p, q) for p, q in pairs.items()])
    # the reduce-scatter every ZeRO stage sends with (gloo's written out: SlicesExchange), on its
    # own: three buffers of different sizes posted at once, each rank's slice of their sum (two
    # addends: exact)
    flats = [
        [randn(torch.Generator().manual_seed(10 * r + n), n) for r in range(2)] for n in (6, 18, 2)
    ]
    outs = [torch.empty(len(f[0]) // 2) for f in flats]
    for request in [z.reduce_scatter(out, f[rank].clone(), WORLD) for out, f in zip(outs, flats)]:
        request.wait()
    summed = max(difference(out, (f[0] + f[1]).view(2, -1)[rank]) for out, f in zip(outs, flats))
    return {
        "losses": ("loss", losses),
        "gradients before the step": ("gradient", grads),
        "weights": ("weight", weights),
        "reduce-scatter alone": ("exact", summed),
    }


# -----------------------------------------------------------------------------
# the extensions: a file of their own with the whole parallel.py


def ring_attention(rank):
    """ring_attention at cp = 2 on the zigzag split of q, k, v (rank r: chunks r and 3 - r of 4),
    against causal attention over the whole sequence on one process: this rank's outputs and q, k, v
    gradients."""
    cp = lifted("context_parallel", "context_parallel")
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (randn(g, 2, 8, 2, 4) for _ in range(4))  # (B, T, H, D)
    here = [cp.zigzag_split(t, 2, rank).requires_grad_() for t in (q, k, v)]
    out = cp.ring_attention(*here, cp.split_for_every_rank(torch.arange(8), 2), group=WORLD)
    out.backward(cp.zigzag_split(dout, 2, rank))

    one = [t.clone().requires_grad_() for t in (q, k, v)]
    out_one = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in one), is_causal=True
    ).transpose(1, 2)
    out_one.backward(dout)
    # this rank's, written out
    tokens = [2 * rank, 2 * rank + 1, 2 * (3 - rank), 2 * (3 - rank) + 1]
    return {
        "output": ("output", difference(out, out_one[:, tokens])),
        "q, k, v gradients": (
            "gradient",
            max(difference(t.grad, o.grad[:, tokens]) for t, o in zip(here, one)),
        ),
    }


def expert_all_to_all(rank):
    """dispatch_to_experts at ep = 2 (rank r holds experts 2r and 2r + 1 of 4; some rank sends an
    expert no row) against every rank's rows run through their experts on one process: the outputs,
    the rows' gradients and the local experts' gradients (the sum over both ranks' rows)."""
    ep = lifted("expert_parallel", "expert_parallel")
    torch.manual_seed(0)
    experts = [nn.Linear(6, 6) for _ in range(4)]  # the same on both ranks
    one = copy.deepcopy(experts)
    local = experts[2 * rank : 2 * rank + 2]
    counts = [[3, 0, 2, 1], [1, 2, 0, 4]]  # each rank's rows per expert, sorted by expert
    g = torch.Generator().manual_seed(1)
    rows = [randn(g, sum(c), 6) for c in counts]
    dys = [randn(g, sum(c), 6) for c in counts]

    def run_local_experts(x, sizes):
        return torch.cat([expert(part) for expert, part in zip(local, x.split(sizes))])

    splits = ep.exchange_expert_counts(torch.tensor(counts[rank]), WORLD)
    x_here = rows[rank].clone().requires_grad_()
    out = ep.ExpertParallelDispatch(WORLD)(x_here, splits, run_local_experts)
    out.backward(dys[rank])

    outs_one, xs_one = [], []
    for r in range(2):
        x = rows[r].clone().requires_grad_()
        o = torch.cat([expert(part) for expert, part in zip(one, x.split(counts[r]))])
        o.backward(dys[r])
        outs_one.append(o)
        xs_one.append(x)
    grads = max(
        difference(p.grad, q.grad)
        for e, expert in enumerate(local)
        for p, q in zip(expert.parameters(), one[2 * rank + e].parameters())
    )
    return {
        "outputs": ("output", difference(out, outs_one[rank])),
        "rows' gradient": ("gradient", difference(x_here.grad, xs_one[rank].grad)),
        "local experts' gradients": ("gradient", grads),
    }


class TwoLayers(nn.Module):
    """Two blocks (linear layers, each a ZeRO-3 unit gathered around its forward and backward) and a
    head (the root unit, whole through the step)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(5, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 3, bias=False)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def zero_three(rank, folder="zero"):
    """FullyShardedParameters + ZeroOneAdamW at dp = 2 on TwoLayers, 2 steps, against
    torch.optim.AdamW on one process: the losses, the gradient shards each rank steps with (before
    the step) and the weight shards each rank stores after it (the next step's loss checks what the
    gathers rebuild from them). The second block's weight is dealt whole to rank 1 (owners, as
    Muon's matrices are: optim.py): its own unit, broadcast from rank 1, its gradient reduced to
    it, stored and stepped there alone."""
    zero = lifted(folder, "zero")
    # the copy zero.py imported, from its own folder (lifted() checked)
    parallel = sys.modules["parallel"]
    torch.manual_seed(0)
    model = TwoLayers()
    one = copy.deepcopy(model)
    pairs = dict(zip(model.parameters(), one.parameters()))
    units = [(None, list(model.head.parameters()), 0)] + [
        (b, list(b.parameters()), 0) for b in model.blocks
    ]
    owners = {model.blocks[1].weight: 1}
    sync = zero.FullyShardedParameters(list(model.parameters()), WORLD, units, model, owners=owners)
    opt = parallel.ZeroOneAdamW(model.parameters(), sync, lr=1e-2, weight_decay=0.1)
    opt_one = torch.optim.AdamW(one.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    mine = slice(4 * rank, 4 * rank + 4)
    losses, grads, weights = 0.0, 0.0, 0.0
    for _ in range(2):
        x, y = randn(g, 8, 5), randn(g, 8, 3)
        sync.set_grad_sync(True)
        loss = F.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        sync.backward_done("B", 0)
        sync.finish()
        loss_one = F.mse_loss(one(x), y)
        loss_one.backward()
        grads = max(grads, owned_gradients(opt, pairs))
        opt.step()
        opt.zero_grad()
        opt_one.step()
        opt_one.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)
        losses = max(losses, abs(loss / 2 - loss_one).item() / loss_one.item())
        weights = max(weights, owned_weights(opt, pairs))
    return {
        "losses": ("loss", losses),
        "gradients before the step": ("gradient", grads),
        "weights": ("weight", weights),
    }


def fp8_tensor_parallel(rank):
    """fp8.apply_fp8 (both recipes) on ColumnParallelLinear -> gelu -> RowParallelLinear at tp = 2,
    against the same MLP of two nn.Linear with apply_fp8 on one process: the output, the input's
    gradient and the full weights' gradients (the scales are the same: fp8.py's rule; the fp32 sums
    differ in order)."""
    fp8 = lifted("fp8", "fp8")
    tp = sys.modules["parallel"]
    g = torch.Generator().manual_seed(0)
    x, dy = randn(g, 3, 5, 8), randn(g, 3, 5, 8)
    w_up, w_down = randn(g, 16, 8), randn(g, 8, 16)
    measured = {}
    for recipe in ("tensorwise", "rowwise"):
        mlp = nn.Sequential(
            tp.ColumnParallelLinear(8, 16, group=WORLD),
            nn.GELU(),
            tp.RowParallelLinear(16, 8, group=WORLD),
        )
        one = nn.Sequential(nn.Linear(8, 16, bias=False), nn.GELU(), nn.Linear(16, 8, bias=False))
        with torch.no_grad():
            for layer, single, w in ((mlp[0], one[0], w_up), (mlp[2], one[2], w_down)):
                layer.weight.copy_(tp.shard_of(w, layer.weight))
                single.weight.copy_(w)
        assert (
            fp8.count_fp8(fp8.apply_fp8(mlp, recipe))
            == fp8.count_fp8(fp8.apply_fp8(one, recipe))
            == 2
        )
        x_here, x_one = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, out_one = mlp(x_here), one(x_one)
        out.backward(dy)
        out_one.backward(dy)
        grads = max(
            difference(gathered(mlp[0].weight.grad, 0), one[0].weight.grad),
            difference(gathered(mlp[2].weight.grad, 1), one[2].weight.grad),
        )
        measured.update(
            {
                f"{recipe} output": ("output", difference(out, out_one)),
                f"{recipe} input gradient": ("gradient", difference(x_here.grad, x_one.grad)),
                f"{recipe} weight gradients": ("gradient", grads),
            }
        )
    return measured


TOYS = [
    tensor_parallel_mlp,
    pipeline_1f1b,
    data_parallel,
    zero_one,
    ring_attention,
    expert_all_to_all,
    zero_three,
    fp8_tensor_parallel,
]


def main():
    global WORLD
    torch.set_num_threads(1)
    checkout = Path(os.environ["PICOTRON_CHECKOUT"]).resolve()
    assert all(Path(p or ".").resolve() != checkout for p in sys.path), (
        f"the checkout is on sys.path: {sys.path}"
    )
    assert (
        importlib.util.find_spec("model") is None and importlib.util.find_spec("train") is None
    ), (
        "picotron's model.py or train.py can be imported here: "
        "the toys would not prove the lifted files alone"
    )
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    WORLD = dist.group.WORLD
    measured = {toy.__name__: toy(rank) for toy in TOYS}
    # test_lift.py's mutation test: {toy: a folder where its mechanism was lifted with a line
    # patched out}
    mutants = (
        json.loads((HERE / "mutants.json").read_text()) if (HERE / "mutants.json").exists() else {}
    )
    for toy in TOYS:
        if toy.__name__ in mutants:
            measured[f"{toy.__name__} mutant"] = toy(rank, mutants[toy.__name__])
    dist.barrier()
    dist.destroy_process_group()
    (HERE / f"rank{rank}.json").write_text(json.dumps(measured))


if __name__ == "__main__":
    main()
