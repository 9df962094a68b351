"""Data parallelism and ZeRO-1's pieces on their own (CPU, gloo, fp32): ZeroOneAdamW and the
gradient buckets against torch.optim.AdamW and the mean gradient computed by hand, and the layout's
checks.

train.py at dp = 2 and 4, with ZeRO 0 to 3, alone and with the other axes, against one process: the
equivalence matrix (tests/matrix.py, tests/test_matrix.py). The optimizer state train.py logs at dp
= 2, whole at ZeRO-0 and halved at ZeRO-1: tests/test_checkpoint.py's run whose rank dies and
resumes.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import parallel
import settings
import zero
from model import ModelConfig, Transformer
from dist_utils import run_ranks
from parallel import (
    GradientBuckets,
    ParallelLayout,
    ShardedGradientBuckets,
    ZeroOneAdamW,
    init_distributed,
    optimizer_state_bytes,
)


# -----------------------------------------------------------------------------
# ZeroOneAdamW and GradientBuckets on their own, against torch.optim.AdamW


def _tiny_net():
    torch.manual_seed(0)
    # 2-d weights (decayed) and 1-d biases (not): two parameter groups, sizes that do not split
    # evenly
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(), nn.Linear(5, 3))


def _groups(net, wd):
    return [
        {"params": [p for p in net.parameters() if p.dim() >= 2], "weight_decay": wd},
        {"params": [p for p in net.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]


def _moment_bytes(optimizer):
    return sum(
        s[k].numel() * s[k].element_size()
        for s in optimizer.state.values()
        for k in ("exp_avg", "exp_avg_sq")
    )


def _zero_against_adamw(rank, world_size):
    """Two micro-batches per step on each of 2 ranks (reference: the whole batch on one model)."""
    lrs = [1e-2, 3e-2, 2e-3, 5e-4]  # a schedule: each step's update must use its own lr
    ref, net = _tiny_net(), _tiny_net()
    ref_opt = torch.optim.AdamW(_groups(ref, 0.1), betas=(0.9, 0.95))
    sync = ShardedGradientBuckets(
        list(net.parameters()), dist.group.WORLD, bucket_size_mb=10 * 4 / 2**20
    )
    opt = ZeroOneAdamW(_groups(net, 0.1), sync, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(1)
    launched_per_backward, max_diff = [], 0.0
    for lr in lrs:
        x, y = torch.randn(8, 7, generator=g), torch.randn(8, 3, generator=g)
        for o in (ref_opt, opt):
            for group in o.param_groups:
                group["lr"] = lr
        (nn.functional.mse_loss(ref(x), y)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mine = x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]
        for i in range(2):  # gradient accumulation: communication only on the last micro-batch
            sync.set_grad_sync(i == 1)
            (
                nn.functional.mse_loss(net(mine[0][2 * i : 2 * i + 2]), mine[1][2 * i : 2 * i + 2])
                / 2
            ).backward()
            launched_per_backward.append(sync.launched)
        sync.finish()
        opt.step()
        opt.zero_grad()
        max_diff = max(
            max_diff,
            max((a - b).abs().max().item() for a, b in zip(ref.parameters(), net.parameters())),
        )
    return {
        "max_diff": max_diff,
        "launched_per_backward": launched_per_backward,
        "n_buckets": len(sync.buckets),
        "zero_moment_bytes": _moment_bytes(opt),
        "adamw_moment_bytes": _moment_bytes(ref_opt),
        "zero_state_bytes": optimizer_state_bytes(opt),
    }


def _buckets_with_a_parameter_unused_on_one_rank(rank):
    """Three equal linears, one bucket each; rank 1 skips the middle one (as a replica none of whose
    tokens reached an MoE expert): its bucket fills during backward on rank 0 and only in finish()
    on rank 1. Returns the largest difference from the mean gradient computed by hand (zero where a
    rank had none)."""
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(4, 4, bias=False) for _ in range(3))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))

    def backward():
        h = layers[0](x)
        if rank == 0:
            h = layers[1](h)
        layers[2](h).pow(2).sum().backward()

    # the reference, before any hook is registered: every gradient all-reduced on its own
    backward()
    expected = []
    for p in layers.parameters():
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        expected.append(g / 2)
        p.grad = None
    sync = GradientBuckets(
        list(layers.parameters()), dist.group.WORLD, bucket_size_mb=16 * 4 / 2**20
    )
    backward()
    launched_in_backward = sync.launched
    sync.finish()
    return {
        "n_buckets": len(sync.buckets),
        "launched_in_backward": launched_in_backward,
        "max_diff": max(
            (p.grad - e).abs().max().item() for p, e in zip(layers.parameters(), expected)
        ),
    }


def _data_parallel_worker(rank, world_size):
    return {
        **_zero_against_adamw(rank, world_size),
        "unused": _buckets_with_a_parameter_unused_on_one_rank(rank),
    }


@pytest.fixture(scope="module")
def zero_results():
    return run_ranks(_data_parallel_worker, 2)


def test_zero_one_adamw_follows_adamw_under_a_changing_learning_rate(zero_results):
    for r in zero_results:
        assert r["max_diff"] < 1e-6


def test_zero_one_state_is_one_dp_th_of_adamw_state(zero_results):
    full = zero_results[0]["adamw_moment_bytes"]
    # every element's moments exactly once
    assert sum(r["zero_moment_bytes"] for r in zero_results) == full
    # at most one padded element per bucket, 2 fp32 moments
    padding = 2 * 4 * zero_results[0]["n_buckets"]
    for r in zero_results:
        assert abs(r["zero_moment_bytes"] - full / 2) <= padding


def test_gradients_are_communicated_from_backward_hooks_on_the_last_micro_batch_only(zero_results):
    for r in zero_results:
        assert r["n_buckets"] > 2
        # after the accumulation micro-step's backward: nothing launched; after the last one's
        # backward returns (before finish()): every bucket already launched, from the hooks, during
        # backward
        assert r["launched_per_backward"] == [0, r["n_buckets"]] * 4


def test_buckets_are_launched_in_the_same_order_on_every_rank_whatever_order_they_fill_in(
    zero_results,
):
    # rank 0 fills buckets 0, 1, 2 during backward; rank 1 fills 0 and 2, and 1 only in finish():
    # launched as they filled, rank 1 would add its bucket 2 to rank 0's bucket 1 (same size: no
    # error, wrong sums)
    assert [r["unused"]["n_buckets"] for r in zero_results] == [3, 3]
    # rank 1's bucket 2 waits
    assert [r["unused"]["launched_in_backward"] for r in zero_results] == [
        3,
        1,
    ]
    for r in zero_results:
        assert r["unused"]["max_diff"] < 1e-6, r["unused"]


def _reduce_scatter_worker(rank, world_size):
    """parallel.reduce_scatter (on gloo the point-to-point SlicesExchange) of buffers of several
    sizes, all posted before any is waited for, as the buckets are: (this rank's slices, every
    rank's buffers)."""
    flats = [
        [
            torch.randn(
                n, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * r + n)
            )
            for r in range(world_size)
        ]
        for n in (4 * world_size, 12 * world_size, world_size)
    ]
    outs = [torch.empty(len(f[0]) // world_size, dtype=torch.float64) for f in flats]
    requests = [
        parallel.reduce_scatter(out, f[rank].clone(), dist.group.WORLD)
        for out, f in zip(outs, flats)
    ]
    # (waited in another order than posted: each lands on its own)
    for request in reversed(requests):
        request.wait()
    # (lists: pickled)
    return [o.tolist() for o in outs], [[f.tolist() for f in per_rank] for per_rank in flats]


@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_reduce_scatter_gives_each_rank_its_slice_of_the_sum(world_size):
    for rank, (outs, flats) in enumerate(run_ranks(_reduce_scatter_worker, world_size)):
        for out, per_rank in zip(outs, flats):
            # one process
            expected = torch.tensor(per_rank, dtype=torch.float64).sum(0).view(world_size, -1)[rank]
            torch.testing.assert_close(
                torch.tensor(out, dtype=torch.float64), expected, rtol=1e-12, atol=1e-12
            )


def _overlap_worker(rank, world_size):
    """A 3-block Transformer under ZeRO-1 at dp = 2, three steps, with zero.overlap_param_gather and
    without: how many buckets' gathers are still in flight when step() returns, whether block 1's
    parameters are whole when its forward starts, and the weights at the end."""
    cfg = ModelConfig(vocab_size=64, block_size=8, n_layer=3, n_head=2, n_kv_head=2, n_embd=16)
    out = {}
    for overlap in (True, False):
        torch.manual_seed(0)
        model = Transformer(cfg)
        sync = ShardedGradientBuckets(
            list(model.parameters()), dist.group.WORLD, bucket_size_mb=900 * 4 / 2**20
        )
        if overlap:
            zero.overlap_param_gather(model, sync)
        opt = ZeroOneAdamW(model.parameters(), sync, lr=1e-2)
        block = {id(p) for p in model.blocks["1"].parameters()}
        mine = [b for b in sync.buckets if any(id(p) in block for p in b.params)]
        whole = []  # (this hook runs after overlap_param_gather's, registered before it)
        model.blocks["1"].register_forward_pre_hook(
            lambda m, a: whole.append([b.gathering is None for b in mine])
        )
        in_flight, g = [], torch.Generator().manual_seed(rank)
        for _ in range(3):
            x, y = (
                torch.randint(0, 64, (2, 8), generator=g),
                torch.randint(0, 64, (2, 8), generator=g),
            )
            model(x, y)[1].backward()
            sync.finish()
            opt.step()
            opt.zero_grad()
            in_flight.append(sum(b.gathering is not None for b in sync.buckets))
        parallel.wait_for_params(sync.buckets)  # (what train.py's evaluation and save call first)
        out[overlap] = {
            "in_flight": in_flight,
            "whole": whole,
            "n_buckets": len(sync.buckets),
            "weights": [p.detach().reshape(-1).tolist() for p in model.parameters()],
        }
    return out


def test_zero_one_gathers_stay_in_flight_after_the_step_and_land_before_their_first_use():
    for r in run_ranks(_overlap_worker, 2):
        on, off = r[True], r[False]
        assert on["n_buckets"] > 3
        assert off["in_flight"] == [0, 0, 0]  # waited for at once
        # left in flight for the next forward
        assert all(n > 1 for n in on["in_flight"]), on["in_flight"]
        # whole when block 1 starts
        assert all(all(seen) for seen in on["whole"]) and len(on["whole"]) == 3
        # the same arithmetic: only when each wait happens moves
        assert on["weights"] == off["weights"]


# -----------------------------------------------------------------------------
# the layout


def test_a_layout_that_does_not_multiply_to_the_world_size_is_refused():
    with pytest.raises(
        ValueError, match=r"dp=2 x tp=2 x pp=1 = 4 ranks does not match the world size 6"
    ):
        ParallelLayout(2, 2, 1, world_size=6, rank=0)


def test_dp_defaults_to_world_size_over_tp_times_pp(monkeypatch):
    # pretend torchrun started us: no group is built
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: None)
    assert init_distributed(0, 3, 1, "cpu").dp == 2
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tp \* pp = 4 \* 1"):
        init_distributed(0, 4, 1, "cpu")


def test_the_grid_names_every_rank_once():
    text = settings.format_grid(2, 2, 2)
    assert "stage 1 replica 0: ranks [4, 5]" in text
    assert sorted(
        int(r) for r in text.replace("[", ",").replace("]", ",").split(",") if r.strip().isdigit()
    ) == list(range(8))
