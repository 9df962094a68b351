"""Tensor parallelism: parallel.py's operators and layers, and model.py's split of the Llama model
(MHA, GQA, MQA), each against one process with the same weights and inputs, fp32 on CPU with gloo.

The reference is always the unsplit computation: nn.Linear, F.cross_entropy on the full logits, the
model built without a tensor-parallel group. To pay the process start-up once per world size, one
run_ranks call per tp does every check and returns the errors; the tests below each read one
behaviour from it. train.py at tp = 2 (training steps, the evaluation, the final weights) against
one process: the equivalence matrix (tests/matrix.py).

    PYTHONPATH=. python tests/test_tensor_parallel.py --measure
        tokens/s and TP bytes per step at tp = 1, 2, 4
"""

import os
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dist_utils import backward, build_model, gather_full, make_token_data, run_ranks, run_train
from model import ModelConfig, swiglu_hidden_size
from parallel import (
    ColumnParallelLinear,
    ParallelLayout,
    RowParallelLinear,
    copy_to_tp,
    gather_from_tp,
    split_vocab_size,
    reduce_from_tp,
    scatter_to_tp,
    shard_of,
    valid_vocab_columns,
    vocab_parallel_cross_entropy,
)
from settings import check_layout
from tensor_parallel import load_full

TOL = 1e-5  # fp32: max |tp - reference| / max |reference|, per tensor

TINY = dict(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_kv_head=4, n_embd=64)
MODEL_CONFIGS = {
    "llama_mha": dict(),  # the defaults: key/value heads split with the query heads
    # tp=2 splits the 2 key/value heads, tp=4 replicates them; vocab 520 pads to 576 / 640 / 768 at
    # tp = 1 / 2 / 4, and at tp=4 the last rank holds nothing but padding
    "gqa_padded_vocab": dict(n_kv_head=2, vocab_size=520),
    # one key/value head, replicated on every rank
    "mqa_untied": dict(n_kv_head=1, tie_embeddings=False),
}


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def gather_vocab_columns(local, vocab_size, rows_per_rank, group):
    """Full-vocab tensor from (..., V_local) slices whose widths differ (the padding is cut off on
    each rank): pad each to rows_per_rank, all-gather, cut to vocab_size."""
    padded = F.pad(local, (0, rows_per_rank - local.shape[-1]))
    parts = [torch.empty_like(padded) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat(parts, dim=-1)[..., :vocab_size]


# -----------------------------------------------------------------------------
# what each rank runs


def check_primitives(group):
    """Forward and backward of f, g, gather and scatter on rank-dependent tensors; True where they
    hold."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    per_rank = [torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(world)]  # what rank r holds
    # rank r's incoming gradient
    grads = [torch.arange(6.0).reshape(2, 3) * (r + 1) for r in range(world)]
    out = {}

    x = per_rank[rank].clone().requires_grad_()
    y = copy_to_tp(x, group)
    incoming = grads[rank].clone()
    y.backward(incoming)
    out["copy_forward_identity"] = torch.equal(y, per_rank[rank])
    out["copy_backward_all_reduce"] = torch.equal(x.grad, sum(grads))
    # autograd may share it elsewhere
    out["copy_leaves_incoming_grad"] = torch.equal(incoming, grads[rank])

    x = per_rank[rank].clone().requires_grad_()
    y = reduce_from_tp(x, group)
    y.backward(grads[rank])
    out["reduce_forward_all_reduce"] = torch.equal(y, sum(per_rank))
    out["reduce_backward_identity"] = torch.equal(x.grad, grads[rank])
    out["reduce_leaves_input"] = torch.equal(x.detach(), per_rank[rank])

    x = per_rank[rank].clone().requires_grad_()
    y = gather_from_tp(x, group)
    # the same on every rank, as after a gather
    full_grad = torch.arange(6.0 * world).reshape(2, 3 * world)
    y.backward(full_grad)
    out["gather_forward_concatenates"] = torch.equal(y, torch.cat(per_rank, dim=-1))
    out["gather_backward_keeps_own_slice"] = torch.equal(
        x.grad, full_grad[:, 3 * rank : 3 * rank + 3]
    )

    x = torch.cat(per_rank, dim=-1).requires_grad_()  # the same on every rank, as before a scatter
    y = scatter_to_tp(x, group)
    y.backward(grads[rank])
    out["scatter_forward_keeps_own_slice"] = torch.equal(y, per_rank[rank])
    out["scatter_backward_all_gathers"] = torch.equal(x.grad, torch.cat(grads, dim=-1))
    return out


def check_linears(group):
    """ColumnParallelLinear(gather_output=True) and RowParallelLinear(input_is_parallel=False), used
    on their own with slices of an nn.Linear's weights, against that nn.Linear: output, input
    gradient, weight and bias gradients."""
    g = torch.Generator().manual_seed(0)
    x_full = torch.randn(3, 5, 24, generator=g)
    out, fills = {}, {}
    for kind in ("column", "row"):
        ref = nn.Linear(24, 16, bias=True)
        with torch.no_grad():
            ref.weight.copy_(torch.randn(16, 24, generator=g))
            ref.bias.copy_(torch.randn(16, generator=g))
        if kind == "column":
            layer = ColumnParallelLinear(24, 16, bias=True, group=group, gather_output=True)
        else:
            layer = RowParallelLinear(24, 16, bias=True, group=group, input_is_parallel=False)
        # a layer fills itself from the full tensors, or from a reader of slices (as a safetensors
        # file gives)
        load_full(layer, ref.weight.detach(), ref.bias.detach())
        if kind == "column":
            twin = ColumnParallelLinear(24, 16, bias=True, group=group, gather_output=True)
        else:
            twin = RowParallelLinear(24, 16, bias=True, group=group, input_is_parallel=False)
        reads = []
        reader = lambda t: (
            lambda dim, start, size: (
                reads.append(dim)
                or (t if dim is None else t.narrow(dim, start, size)).detach().clone()
            )
        )
        load_full(twin, reader(ref.weight), reader(ref.bias))
        fills[f"{kind}/reader_fill_equals_full_fill"] = (
            torch.equal(twin.weight, layer.weight)
            and torch.equal(twin.bias, layer.bias)
            and torch.equal(layer.weight, shard_of(ref.weight, layer.weight))
        )
        fills[f"{kind}/reader_reads_only_slices"] = reads == [
            1 if kind == "row" else 0,
            None if kind == "row" else 0,
        ]
        upstream = torch.randn(3, 5, 16, generator=g)  # d loss / d y, the same on every rank
        x_ref, x = x_full.clone().requires_grad_(), x_full.clone().requires_grad_()
        y_ref, y = ref(x_ref), layer(x)
        (y_ref * upstream).sum().backward()
        (y * upstream).sum().backward()
        out[f"{kind}/output"] = rel_err(y, y_ref)
        out[f"{kind}/input_grad"] = rel_err(x.grad, x_ref.grad)
        out[f"{kind}/weight_grad"] = rel_err(
            gather_full(layer.weight.grad, layer.weight, group), ref.weight.grad
        )
        out[f"{kind}/bias_grad"] = rel_err(
            gather_full(layer.bias.grad, layer.bias, group), ref.bias.grad
        )
    return out, fills


def check_cross_entropy(group, vocab_size):
    """vocab_parallel_cross_entropy on this rank's columns of full logits (padding cut off, as the
    model does) against F.cross_entropy on the full logits, with some targets ignored (-1): loss and
    gradient."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(40, vocab_size, generator=g) * 3
    targets = torch.randint(0, vocab_size, (40,), generator=g)
    targets[::7] = -1
    rows_per_rank = split_vocab_size(vocab_size, world) // world
    start = rank * rows_per_rank
    width = valid_vocab_columns(vocab_size, rows_per_rank, group)
    local = logits[:, start : start + width].clone().requires_grad_()
    full = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, start, group, ignore_index=-1)
    ref = F.cross_entropy(full, targets, ignore_index=-1)
    loss.backward()
    ref.backward()
    grad = gather_vocab_columns(local.grad, vocab_size, rows_per_rank, group)
    return {"loss": rel_err(loss, ref), "grad": rel_err(grad, full.grad), "columns_here": width}


def check_model(group, overrides, seed=1234):
    """The model at this tp against the same model built without a group: initial weights (exactly),
    logits, loss and every gradient; replicated gradients identical on every rank; padded rows
    untouched."""
    cfg = ModelConfig(**{**TINY, **overrides})
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=g)
    y = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=g)
    y[0, :5] = -1  # ignored targets
    ref, model = build_model(cfg, seed=seed), build_model(cfg, tp_group=group, seed=seed)
    ref_params = dict(ref.named_parameters())
    out = {
        "init_differs": [
            name
            for name, p in model.named_parameters()
            if not torch.equal(
                gather_full(p.detach(), p, group),
                gather_full(ref_params[name].detach(), ref_params[name], None),
            )
        ]
    }
    ref_logits, ref_loss = ref(x, y)
    logits, loss = model(x, y)
    ref_loss.backward()
    backward(loss, model)
    out["logits"] = rel_err(
        gather_vocab_columns(logits.detach(), cfg.vocab_size, model.lm_head.out_per_rank, group),
        ref_logits.detach(),
    )
    out["loss"] = rel_err(loss.detach(), ref_loss.detach())
    out["grads"] = {
        name: rel_err(
            gather_full(p.grad, p, group),
            gather_full(ref_params[name].grad, ref_params[name], None),
        )
        for name, p in model.named_parameters()
    }
    # replicated parameters (norms, replicated key/value weights) must get the same gradient on
    # every rank, or the copies drift apart with the first optimizer step
    spread = 0.0
    for name, p in model.named_parameters():
        if getattr(p, "tp_shard_dim", None) is None:
            copies = [torch.empty_like(p.grad) for _ in range(dist.get_world_size(group))]
            dist.all_gather(copies, p.grad, group=group)
            spread = max(spread, max((c - p.grad).abs().max().item() for c in copies))
    out["replicated_grad_spread"] = spread
    # padded vocabulary rows: never looked up, never a logit, so zero weights and zero gradient
    padding = [p for p in model.parameters() if getattr(p, "vocab_size", None) is not None]
    out["padding_abs_max"] = max(
        max(
            t[valid_vocab_columns(p.vocab_size, p.shape[0], group) :].abs().max().item()
            if valid_vocab_columns(p.vocab_size, p.shape[0], group) < p.shape[0]
            else 0.0
            for t in (p.detach(), p.grad)
        )
        for p in padding
    )
    return out


def count_tp_bytes(group, overrides, batch_size=2):
    """Bytes this rank puts into tensor-parallel collectives in one forward and backward, counted by
    wrapping torch.distributed's collectives (parallel.py keeps no counter of its own)."""
    cfg = ModelConfig(**{**TINY, **overrides})
    model = build_model(cfg, tp_group=group)
    x = torch.randint(
        0, cfg.vocab_size, (batch_size, cfg.block_size), generator=torch.Generator().manual_seed(0)
    )
    counted, real = (
        {},
        {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "broadcast")},
    )

    def counting(name):
        def collective(first, *args, **kwargs):
            tensor = args[0] if name == "all_gather" else first  # all_gather(outputs, input)
            counted[name] = counted.get(name, 0) + tensor.numel() * tensor.element_size()
            return real[name](first, *args, **kwargs)

        return collective

    try:
        for name in real:
            setattr(dist, name, counting(name))
        _, loss = model(x, x)
        backward(loss, model)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return counted


def tp_checks(rank, world_size):
    group = ParallelLayout(1, world_size, 1, world_size, rank).tp_group
    linears, fills = check_linears(group)
    return {
        "primitives": check_primitives(group),
        "linears": linears,
        "linear_fills": fills,
        "cross_entropy": {v: check_cross_entropy(group, v) for v in (500, 50)},
        "model": {name: check_model(group, overrides) for name, overrides in MODEL_CONFIGS.items()},
        "bytes": {
            name: count_tp_bytes(group, overrides) for name, overrides in MODEL_CONFIGS.items()
        },
    }


# -----------------------------------------------------------------------------
# the tests


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def tp_results(request):
    return run_ranks(tp_checks, request.param)


def _every_rank(tp_results, section):
    return [r[section] for r in tp_results]


def test_copy_to_region_is_identity_forward_all_reduce_backward(tp_results):
    for p in _every_rank(tp_results, "primitives"):
        assert p["copy_forward_identity"] and p["copy_backward_all_reduce"]
        assert p["copy_leaves_incoming_grad"], (
            "the all-reduce overwrote the gradient autograd handed in"
        )


def test_reduce_from_region_is_all_reduce_forward_identity_backward(tp_results):
    for p in _every_rank(tp_results, "primitives"):
        assert p["reduce_forward_all_reduce"] and p["reduce_backward_identity"]
        assert p["reduce_leaves_input"], "the all-reduce overwrote the caller's tensor"


def test_gather_and_scatter_along_the_last_dimension(tp_results):
    for p in _every_rank(tp_results, "primitives"):
        assert p["gather_forward_concatenates"] and p["gather_backward_keeps_own_slice"]
        assert p["scatter_forward_keeps_own_slice"] and p["scatter_backward_all_gathers"]


def test_column_and_row_parallel_linears_on_their_own_equal_nn_linear(tp_results):
    for errors in _every_rank(tp_results, "linears"):
        assert max(errors.values()) < TOL, errors


def test_a_parallel_linear_fills_its_shard_from_a_full_tensor_or_a_reader_of_slices(tp_results):
    for fills in _every_rank(tp_results, "linear_fills"):
        assert all(fills.values()), fills


def test_tp_bytes_per_step_equal_the_analytic_figure(tp_results):
    """One f and one g per attention and per MLP, the embedding's g, the head's f, the loss's three
    reductions of one number per token, and (tp not dividing n_kv_head) the replicated k/v weights'
    grads. One f per projection instead of per sublayer would pass every other test while sending
    more."""
    tp = len(tp_results)
    for name, overrides in MODEL_CONFIGS.items():
        cfg = ModelConfig(**{**TINY, **overrides})
        for r in tp_results:
            counted = r["bytes"][name]
            assert counted.get("all_reduce") == analytic_tp_bytes(cfg, 2, tp), (name, counted)
            assert "all_gather" not in counted and "broadcast" not in counted, (name, counted)


def test_vocab_parallel_cross_entropy_equals_f_cross_entropy_with_ignored_targets(tp_results):
    for by_vocab in _every_rank(tp_results, "cross_entropy"):
        for vocab, e in by_vocab.items():
            assert e["loss"] < TOL and e["grad"] < TOL, (vocab, e)
    # vocab 50 leaves some ranks nothing but padding: the loss must still hold there
    assert min(r["cross_entropy"][50]["columns_here"] for r in tp_results) == 0


def test_tp_model_starts_from_the_same_full_weights_as_one_process(tp_results):
    for by_config in _every_rank(tp_results, "model"):
        for name, r in by_config.items():
            assert r["init_differs"] == [], name


@pytest.mark.parametrize("config", list(MODEL_CONFIGS))
def test_tp_model_logits_loss_and_every_gradient_equal_one_process(tp_results, config):
    for by_config in _every_rank(tp_results, "model"):
        r = by_config[config]
        assert r["logits"] < TOL and r["loss"] < TOL, (r["logits"], r["loss"])
        worst = max(r["grads"], key=r["grads"].get)
        assert r["grads"][worst] < TOL, (worst, r["grads"][worst])
        print(
            f"equivalence | tp={len(tp_results)} {config} | logits {r['logits']:.2e}, "
            f"loss {r['loss']:.2e}, gradients {r['grads'][worst]:.2e} ({worst}): "
            f"max |tp - one process| / max |one process|, tolerance {TOL:.0e}"
        )


def test_replicated_norm_and_kv_gradients_are_identical_on_every_rank(tp_results):
    for by_config in _every_rank(tp_results, "model"):
        for name, r in by_config.items():
            assert r["replicated_grad_spread"] == 0.0, name


def test_vocabulary_padding_never_affects_the_loss(tp_results):
    # gqa_padded_vocab pads 520 differently at every tp (one rank holds only padding at tp=4): its
    # loss and logits match one process (above) and the padded rows stay exactly zero, gradient
    # included
    for by_config in _every_rank(tp_results, "model"):
        r = by_config["gqa_padded_vocab"]
        assert r["loss"] < TOL and r["logits"] < TOL
        assert r["padding_abs_max"] == 0.0


@pytest.mark.parametrize(
    "overrides, tp, message",
    [
        (dict(n_head=6, n_kv_head=6, n_embd=96), 4, "n_head = 6 must be divisible by tp = 4"),
        (dict(n_head=4, n_kv_head=4), 8, "tp = 8 is larger than n_head = 4"),
        (
            dict(n_head=6, n_kv_head=3, n_embd=96),
            2,
            "n_kv_head = 3 and tp = 2: one must divide the other",
        ),
        (
            dict(n_head=6, n_kv_head=6, n_embd=96),
            3,
            f"the MLP width {swiglu_hidden_size(96)} (from n_embd = 96) must "
            f"be divisible by tp = 3",
        ),
    ],
)
def test_check_layout_names_what_must_divide_what(overrides, tp, message):
    with pytest.raises(ValueError, match="cannot be built with this layout") as e:
        check_layout(ModelConfig(**overrides), tp)
    assert message in str(e.value)


def test_train_py_stops_with_a_clean_error_when_tp_does_not_divide_the_heads(tmp_path):
    data = make_token_data(str(tmp_path / "data"))
    _, proc = run_train(
        [
            f"--data_dir={data}",
            f"--out_dir={tmp_path / 'out'}",
            "--tp=2",
            "--n_head=3",
            "--n_kv_head=3",
            "--n_embd=96",
            "--device=cpu",
        ],
        nproc=2,
        check=False,
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert lines, proc.stderr[-2000:]
    assert "n_head = 3 must be divisible by tp = 2" in lines[0]
    assert "n_kv_head = 3 and tp = 2: one must divide the other" in lines[0]


# -----------------------------------------------------------------------------
# Measurement, not a test:  PYTHONPATH=. python tests/test_tensor_parallel.py --measure
# tokens/s of train.py at tp = 1, 2, 4, and the bytes each rank puts into tensor-parallel
# collectives per step (count_tp_bytes) against the analytic count, at tiny_fineweb.py's size.

BENCH = dict(n_layer=4, n_head=4, n_kv_head=4, n_embd=128, block_size=256, vocab_size=50257)
BENCH_BATCH = 8


def analytic_tp_bytes(cfg, batch_size, tp):
    """fp32 bytes each rank contributes to TP all-reduces in one forward + backward (Megatron
    layout): per block one g (attention output) and one g (MLP output) forward, one f (attention
    input) and one f (MLP input) backward, each B*T*n_embd; the embedding's g forward and the head's
    f backward, B*T*n_embd each; the cross-entropy's max, sum-exp and target logit, B*T each; with
    key/value heads replicated (tp does not divide n_kv_head), the k and v weights' gradients,
    n_kv_head*head_dim*n_embd each, per block."""
    btc = batch_size * cfg.block_size * cfg.n_embd
    kv = (
        2 * cfg.n_layer * cfg.n_kv_head * (cfg.n_embd // cfg.n_head) * cfg.n_embd
        if cfg.n_kv_head % tp
        else 0
    )
    return 4 * ((4 * cfg.n_layer + 2) * btc + 3 * batch_size * cfg.block_size + kv)


def measured_tp_bytes(rank, world_size, overrides, batch_size):
    return count_tp_bytes(
        ParallelLayout(1, world_size, 1, world_size, rank).tp_group, overrides, batch_size
    )


def time_steps(rank, world_size, overrides, batch_size, steps):
    """Median wall and CPU seconds of this rank's training steps (forward, backward, AdamW), the
    first left out. CPU time is what the rank itself computed: on a machine shared with other jobs
    it stays close to what the step costs, where the wall time mostly measures the competition for
    cores."""
    torch.set_num_threads(1)
    group = ParallelLayout(1, world_size, 1, world_size, rank).tp_group
    cfg = ModelConfig(**{**TINY, **overrides})
    model = build_model(cfg, tp_group=group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    wall, cpu = [], []
    for _ in range(steps + 1):
        x = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size + 1), generator=g)
        w0, c0 = time.perf_counter(), time.process_time()
        _, loss = model(x[:, :-1], x[:, 1:])
        backward(loss, model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    median = lambda v: sorted(v[1:])[len(v[1:]) // 2]
    return median(wall), median(cpu)


def measure(steps=8, log_interval=2):
    with tempfile.TemporaryDirectory() as tmp:
        data = make_token_data(f"{tmp}/data", n_tokens=200_000, vocab_size=BENCH["vocab_size"])
        args = [f"--{k}={v}" for k, v in BENCH.items() if k != "vocab_size"] + [
            f"--batch_size={BENCH_BATCH}",
            f"--data_dir={data}",
            f"--max_iters={steps}",
            f"--log_interval={log_interval}",
            "--eval_interval=0",
            "--checkpoint_interval=0",
            "--device=cpu",
            "--dtype=float32",
            "--attn_impl=sdpa",
        ]
        for tp, threads in ((1, 1), (1, 2), (2, 1), (4, 1)):
            records, _ = run_train(
                args + [f"--out_dir={tmp}/tp{tp}_{threads}", f"--tp={tp}"],
                nproc=tp,
                env={"OMP_NUM_THREADS": str(threads)},
            )
            # the first interval warms up
            rates = sorted(r["tokens_per_sec"] for r in records[1:] if "tokens_per_sec" in r)
            ms = sorted(r["ms_per_step"] for r in records[1:] if "ms_per_step" in r)
            rate, step_ms = rates[len(rates) // 2], ms[len(ms) // 2]
            print(
                f"tp={tp} ({tp} process(es) x {threads} thread(s)): {rate:,.0f} tokens/s, "
                f"{step_ms:.0f} ms/step (median of {len(rates)} intervals of {log_interval} steps; "
                f"load average after: {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    for tp in (1, 2, 4):
        per_rank = run_ranks(time_steps, tp, BENCH, BENCH_BATCH, 4)
        wall, cpu = max(w for w, _ in per_rank), max(c for _, c in per_rank)
        tokens = BENCH_BATCH * BENCH["block_size"]
        print(
            f"tp={tp} in-process steps: wall {wall * 1e3:.0f} ms/step ({tokens / wall:,.0f} "
            f"tokens/s); CPU per rank {cpu * 1e3:.0f} ms/step (slowest rank; {tokens / cpu:,.0f} "
            f"tokens/s if each rank had its own core; load average {os.getloadavg()[0]:.1f})",
            flush=True,
        )
    for name, overrides in (("MHA", {}), ("MQA", {"n_kv_head": 1})):
        cfg = ModelConfig(**{**TINY, **BENCH, **overrides})
        for tp in (2, 4):
            counted = run_ranks(measured_tp_bytes, tp, {**BENCH, **overrides}, BENCH_BATCH)[0]
            expected = analytic_tp_bytes(cfg, BENCH_BATCH, tp)
            # a ring all-reduce sends 2(p-1)/p of its buffer
            wire = 2 * (tp - 1) / tp * counted.get("all_reduce", 0)
            verdict = "equal" if counted.get("all_reduce") == expected else "DIFFERENT"
            print(
                f"{name} tp={tp}: counted {counted} bytes per rank per step, analytic all_reduce "
                f"{expected:,} ({verdict}); ring all-reduce sends {wire / 1e6:.1f} MB per rank",
                flush=True,
            )


if __name__ == "__main__":
    if sys.argv[1:] != ["--measure"]:
        sys.exit(
            "usage: PYTHONPATH=. python tests/test_tensor_parallel.py --measure   "
            "(the tests run under pytest)"
        )
    measure()
