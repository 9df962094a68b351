"""Context parallelism (context_parallel.py) and sequence parallelism (parallel.py) against one
process, fp32 on CPU with gloo.

  the zigzag split      its balance (every rank the same attention work) and errors; no processes
  ring attention alone  against plain causal attention written out here on the whole sequence:
                        MHA, GQA, MQA, D_v != D, soft-capping, document masking, a cp group that is
                        not the world
  the model at cp 2, 4  Llama/GQA, MLA, soft-capping, MoE with capacity dropping: logits, loss and
                        every gradient against the unsplit model, and five training steps through
                        train.py's own build and train_step (losses, gradient norms, final weights)
  cp composed           cp2 x tp2 and cp2 x dp2 with ZeRO-3, five steps each
  sequence parallelism  at tp 2 and 4, every variant, against tensor parallelism without it
  train.py              a one-process checkpoint resumed at cp = 2, and that run's checkpoint
                        resumed at one process

train.py at cp = 2 composed with tp (sequence parallel or not), pp, dp and ZeRO, activation
checkpointing and document masking, against one process: the equivalence matrix (tests/matrix.py).

The distributed numerics share two launches, one of 2 ranks and one of 4, that build every layout in
turn (module fixtures); each test reads its part. The one-process references are computed here, in
the test process, with the same functions at a layout of one rank.

    PYTHONPATH=. python tests/test_context_parallel.py --measure
        the figures: activation memory per rank, attention work, ring bytes per step
"""

import math
import shutil
import sys
import re
import time
from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import checkpoint
from tools import make_config
import parallel
import settings
from tools import step_time
from data import context_split
import build
import train
from dist_utils import (
    assert_same_losses_and_norms,
    assert_same_tensors,
    backward,
    build_model,
    gather_full,
    gathered_parameters,
    run_ranks,
    train_in_process,
    train_on_ranks,
)
from model import ModelConfig, Transformer, choose_attn_impl, model_config_from
import context_parallel
from context_parallel import (
    attention_work,
    check_context_split,
    ring_attention,
    ring_attention_bytes,
    split_for_every_rank,
    zigzag_gather,
    zigzag_split,
)
from parallel import ParallelLayout
from settings import check_layout, sequence_split_problems
from test_variants import MLA, MOE
from test_variants_tp import TP_VARIANTS


# -----------------------------------------------------------------------------
# ring attention alone: the inputs, the reference, and what each rank runs

B, T = 2, 32
# fp32; the largest difference seen, 3.9e-6 in a gradient of ~7, is a third of it
TOL = dict(rtol=1e-5, atol=1e-5)

# name -> query heads, key/value heads, q/k head size, v head size, soft-cap, document masking
CASES = {
    "mha": dict(H=4, H_kv=4, D=8, Dv=8, softcap=0.0, documents=False),
    "gqa": dict(H=4, H_kv=2, D=8, Dv=8, softcap=0.0, documents=False),
    "mqa": dict(H=4, H_kv=1, D=8, Dv=8, softcap=0.0, documents=False),
    # D = qk_nope + qk_rope != D_v
    "mla_like": dict(H=4, H_kv=4, D=12, Dv=8, softcap=0.0, documents=False),
    "softcap": dict(H=4, H_kv=2, D=8, Dv=8, softcap=5.0, documents=False),
    "documents": dict(H=4, H_kv=2, D=8, Dv=8, softcap=0.0, documents=True),
}
# per batch row, the lengths of the documents packed into the window (boundaries fall inside chunks)
DOCUMENT_LENGTHS = [[5, 14, 13], [19, 3, 10]]


def make_inputs(name):
    """q, k, v, the output's gradient, and the window's positions and document ids (None without
    documents). q is scaled up so that the scores reach the soft-cap and the softmax is far from
    uniform."""
    case = CASES[name]
    g = torch.Generator().manual_seed(list(CASES).index(name))
    q = 2 * torch.randn(B, T, case["H"], case["D"], generator=g)
    k = torch.randn(B, T, case["H_kv"], case["D"], generator=g)
    v = torch.randn(B, T, case["H_kv"], case["Dv"], generator=g)
    dout = torch.randn(B, T, case["H"], case["Dv"], generator=g)
    if not case["documents"]:
        return q, k, v, dout, torch.arange(T), None
    documents = torch.stack(
        [torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in DOCUMENT_LENGTHS]
    )
    starts = torch.stack(
        [
            torch.tensor([sum(n[:d]) for d in range(len(n))])[doc]
            for n, doc in zip(DOCUMENT_LENGTHS, documents)
        ]
    )
    positions = torch.arange(T) - starts  # (B, T): each document's positions restart at 0
    return q, k, v, dout, positions, documents


def reference_attention(q, k, v, softcap, documents=None):
    """Plain attention over the whole sequence: (B, T, H, D) -> (B, T, H, D_v)."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    visible = torch.ones(T, T, dtype=torch.bool).tril()
    if documents is not None:
        # (B, 1, T, T)
        visible = visible & (documents[:, :, None] == documents[:, None, :])[:, None]
    return (scores.masked_fill(~visible, float("-inf")).softmax(dim=-1) @ v).transpose(1, 2)


def reference(name):
    """The reference output and the gradients of q, k, v, on the whole sequence."""
    q, k, v, dout, _, documents = make_inputs(name)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = reference_attention(q, k, v, CASES[name]["softcap"], documents)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


def run_case(name, group):
    """This rank's ring attention of case `name`: its output, its gradients, the bytes it sent."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, dout, positions, documents = make_inputs(name)
    q, k, v = (zigzag_split(t, cp, rank).requires_grad_() for t in (q, k, v))
    positions = split_for_every_rank(positions, cp)  # (cp, T/cp) or (cp, B, T/cp)
    documents = split_for_every_rank(documents, cp) if documents is not None else None
    SENT.clear()
    with CountingOperators() as forward_ops:
        out = ring_attention(
            q, k, v, positions, group, softcap=CASES[name]["softcap"], documents=documents
        )
    forward_bytes, blocks = sum(SENT), BLOCKS.pop("count", 0)
    SENT.clear()
    dout = zigzag_split(dout, cp, rank)
    with CountingOperators() as backward_ops:
        out.backward(dout)
    # numpy: torch tensors would cross the result queue as shared memory, gone once the worker exits
    return dict(
        out=out.detach().numpy(),
        dq=q.grad.numpy(),
        dk=k.grad.numpy(),
        dv=v.grad.numpy(),
        forward_bytes=forward_bytes,
        backward_bytes=sum(SENT),
        blocks=blocks,
        operators=(forward_ops.count, backward_ops.count),
    )


class CountingOperators(TorchDispatchMode):
    """The operators dispatched inside the block (views included), as step_time.OPS_PER_BLOCK counts
    them."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


# in the worker processes: bytes of each isend, chunk pairs computed in forward
SENT, BLOCKS = (
    [],
    {},
)


def _count_communication_and_blocks():
    batch_isend_irecv, block_forward = dist.batch_isend_irecv, context_parallel._block_forward

    def counting_batch_isend_irecv(ops):
        SENT.extend(
            op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend
        )
        return batch_isend_irecv(ops)

    def counting_block_forward(*args):
        BLOCKS["count"] = BLOCKS.get("count", 0) + 1
        return block_forward(*args)

    dist.batch_isend_irecv, context_parallel._block_forward = (
        counting_batch_isend_irecv,
        counting_block_forward,
    )


def gathered(pieces, key):
    """The whole sequence of one result from every cp rank's pieces, in rank order."""
    return zigzag_gather([torch.from_numpy(p[key]) for p in pieces])


# -----------------------------------------------------------------------------
# the model and the training step at a layout: what each rank of a launch runs, and (at a layout of
# one rank) the references

TINY = dict(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
SEED, STEPS = 7, 5
# the variants the issue names for context parallelism; capacity_factor 1.0 makes the MoE drop
# tokens
CP_VARIANTS = {
    "llama_gqa": {},
    "mla": {**MLA, "q_lora_rank": 24},
    "softcap": dict(attn_softcap=5.0, final_softcap=10.0),
    "moe_dropping": MOE,
}
# five training steps: fp32, a large learning rate (differences grow with each step), tiny buckets
# (several per step), clipping active at these norms
STEP_SETTINGS = dict(
    TINY,
    device="cpu",
    dtype="float32",
    batch_size=2,
    gradient_accumulation_steps=2,
    learning_rate=1e-2,
    warmup_iters=1,
    lr_decay_iters=10,
    bucket_size_mb=0.01,
    seed=SEED,
)
# the composed layouts of the 4-rank launch, with the settings each changes (dp2 takes half the
# windows per rank, so the global batch stays the reference's 4 windows; cp with sequence
# parallelism, pp and ZeRO-1: the equivalence matrix)
COMPOSED = {
    "cp2_tp2": dict(cp=2, tp=2),
    "cp2_dp2_zero3": dict(cp=2, dp=2, zero_stage=3, batch_size=1),
}


def model_batch(batch=2):
    g = torch.Generator().manual_seed(1)
    return (
        torch.randint(0, TINY["vocab_size"], (batch, TINY["block_size"]), generator=g),
        torch.randint(0, TINY["vocab_size"], (batch, TINY["block_size"]), generator=g),
    )


def model_at(layout, overrides, sequence_parallel=False):
    """This layout's model (one stage) on model_batch, forward and backward: the whole window's
    logits (gathered over tp and cp), the loss (the cp ranks' shares averaged), the MoE statistics,
    and every gradient (averaged over cp: gradients are averaged over dp x cp; gathered over tp).
    Every rank must call it; the full tensors are returned as numpy (torch tensors would cross the
    result queue as shared memory, gone once the worker exits)."""
    cfg = ModelConfig(**{**TINY, **overrides})
    model = build_model(
        cfg,
        tp_group=layout.tp_group,
        attn_impl="eager",
        cp_group=layout.cp_group,
        sequence_parallel=sequence_parallel,
        seed=SEED,
    )
    x, y, *positions = context_split(model_batch(), layout)
    logits, loss = model(x, y, *positions)
    backward(loss, model)
    if layout.tp_group is not None:  # the vocabulary slices (all real here: 512 splits evenly)
        parts = [torch.empty_like(logits) for _ in range(layout.tp)]
        dist.all_gather(parts, logits.contiguous(), group=layout.tp_group)
        logits = torch.cat(parts, dim=-1)
    if layout.cp_group is not None:  # every rank's zigzag chunks, in window order
        logits = context_parallel.all_gather_context(logits.detach(), layout.cp_group)
    stats = torch.stack(
        [loss.detach(), model.moe_aux_loss().detach() if cfg.n_expert else torch.zeros(())]
    )
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    if layout.cp_group is not None:  # the mean of the cp ranks' shares
        for t in (stats, *grads.values()):
            dist.all_reduce(t, group=layout.cp_group)
            t /= layout.cp
    grads = {
        name: gather_full(grads[name], p, layout.tp_group).numpy()
        for name, p in model.named_parameters()
    }
    dropped = [b.mlp.last_dropped_frac.item() for b in model.blocks.values() if cfg.n_expert]
    return dict(
        logits=logits.detach().numpy(),
        loss=stats[0].item(),
        aux=stats[1].item(),
        dropped=dropped,
        grads=grads,
    )


def relative_error(a, b):
    """max |a - b| / max |b|: the per-tensor measure of tests/test_tensor_parallel.py."""
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


# sequence parallelism at tp = 4: the variants that combine every other (replicated key/value heads
# at tp = 4 included), and the two ways replicated weights meet tp; at tp = 2 every variant
SP_AT_TP4 = ("llama", "all_gqa", "all_mla", "mqa_qk_norm_bias")


def sequence_parallel_against_tp(layout):
    """Each variant's model at this tp with sequence parallelism against the same tp without it: the
    largest relative difference of the logits, the loss and the gradients, and whether the
    parameters are the same (by name)."""
    out = {}
    for name, overrides in TP_VARIANTS.items():
        if layout.tp == 4 and name not in SP_AT_TP4:
            continue
        plain, sp = model_at(layout, overrides), model_at(layout, overrides, sequence_parallel=True)
        grads = {n: relative_error(sp["grads"][n], g) for n, g in plain["grads"].items()}
        worst = max(grads, key=grads.get)
        out[name] = dict(
            logits=relative_error(sp["logits"], plain["logits"]),
            loss=abs(sp["loss"] - plain["loss"]),
            grad=grads[worst],
            worst=worst,
            names=sorted(sp["grads"]) == sorted(plain["grads"]),
        )
    return out


def step_windows(step, n):
    """The step's global batch: n windows of block_size + 1 random tokens, a pure function of the
    step."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, TINY["vocab_size"], (n, TINY["block_size"] + 1), generator=g)


def five_steps(layout, model_overrides=None, **setting_overrides):
    """STEPS optimizer steps of train.py's own model, optimizer and step (build, train_step) at this
    layout. Data-parallel rank r takes the r-th slice of each step's windows, and each cp rank its
    share of them (context_split). Returns the logged records (loss, global gradient norm) and the
    final weights, whole, from the ranks that hold a stage's first replica (the others return {}).
    """
    cfg = SimpleNamespace(
        **{**settings.DEFAULTS, **STEP_SETTINGS, **(model_overrides or {}), **setting_overrides}
    )
    model_cfg = ModelConfig(**{f.name: getattr(cfg, f.name) for f in fields(ModelConfig)})
    attn, _ = choose_attn_impl("auto", "cpu", torch.float32, model_cfg.attn_softcap)
    run = SimpleNamespace(
        dev=torch.device("cpu"),
        dtype=torch.float32,
        layout=layout,
        datasets={},
        model_cfg=model_cfg,
        attn_impl=attn,
        tokenizer="gpt2",
        hf_dir=None,
    )
    parts = build.build(cfg, run)
    per_rank = cfg.batch_size * cfg.gradient_accumulation_steps
    records = []
    for step in range(STEPS):
        mine = step_windows(step, per_rank * layout.dp)[
            layout.dp_rank * per_rank : (layout.dp_rank + 1) * per_rank
        ]
        micro = [context_split((w[:, :-1], w[:, 1:]), layout) for w in mine.split(cfg.batch_size)]
        loss, norm = train.train_step(cfg, layout, parts, micro, train.get_lr(step, cfg))
        records.append(
            {
                "step": step + 1,
                "loss": train.mean_across_ranks(loss, layout).item(),
                "grad_norm": norm.item(),
            }
        )
    copies = parts.model.tied_copies()
    # ZeRO-3: the parameters gathered to be read
    sharded = parts.grad_sync if cfg.zero_stage == 3 else None
    whole = gathered_parameters(sharded)
    # (a copy: numpy() would pin the storage that ZeRO-3 frees by resizing it)
    weights = {
        name: gather_full(whole.get(p, p).detach().clone(), p, layout.tp_group).numpy()
        for name, p in parts.model.named_parameters()
        if name not in copies
    }
    return records, weights if layout.dp_cp_rank == 0 and layout.tp_rank == 0 else {}


def _launch(rank, world_size):
    """Everything one launch of world_size ranks checks: ring attention alone, the model and five
    training steps at cp = world_size for every CP variant, sequence parallelism at tp = world_size
    for every variant, and (4 ranks) the composed layouts."""
    _count_communication_and_blocks()
    out = {"ring": {name: run_case(name, dist.group.WORLD) for name in CASES}}
    if world_size == 4:  # a cp group that is not the whole world: ranks {0, 2} and {1, 3}
        pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        out["ring"]["subgroup"] = run_case("gqa", pairs[rank % 2])
    cp = ParallelLayout(1, 1, 1, world_size, rank, cp=world_size)
    out["model"] = {name: model_at(cp, overrides) for name, overrides in CP_VARIANTS.items()}
    out["steps"] = {
        f"cp{world_size}_{name}": five_steps(cp, overrides)
        for name, overrides in CP_VARIANTS.items()
    }
    tp = ParallelLayout(1, world_size, 1, world_size, rank)
    out["sequence_parallel"] = sequence_parallel_against_tp(tp)
    if world_size == 4:
        for name, layout in COMPOSED.items():
            sizes = {k: layout.get(k, 1) for k in ("dp", "cp", "tp", "pp")}
            grid = ParallelLayout(
                sizes["dp"], sizes["tp"], sizes["pp"], world_size, rank, cp=sizes["cp"]
            )
            out["steps"][name] = five_steps(grid, **layout)
    out["grid"] = {"cp": cp.cp_rank, "tp": tp.tp_rank}
    return out


@pytest.fixture(scope="module")
def launch2():
    return run_ranks(_launch, 2)


@pytest.fixture(scope="module")
def launch4():
    return run_ranks(_launch, 4)


@pytest.fixture(params=["launch2", "launch4"], ids=["2_ranks", "4_ranks"])
def launch(request):
    """(ranks of the launch, every rank's results)."""
    ranks = request.getfixturevalue(request.param)
    return len(ranks), ranks


@pytest.fixture
def ring(launch):
    """(cp, every rank's ring attention results) of one launch."""
    cp, ranks = launch
    return cp, [r["ring"] for r in ranks]


@pytest.fixture
def ring4(launch4):
    return 4, [r["ring"] for r in launch4]


_references = {}


def reference_steps(model_overrides=None, **setting_overrides):
    """five_steps on one process (cached: several layouts share a reference)."""
    key = repr((model_overrides, setting_overrides))
    if key not in _references:
        _references[key] = five_steps(ParallelLayout(1, 1, 1), model_overrides, **setting_overrides)
    return _references[key]


def reference_model(overrides):
    return model_at(ParallelLayout(1, 1, 1), overrides)


def merged_weights(ranks, key):
    """A layout's final weights, whole: the union of its stages' (each from its first replica)."""
    weights = {}
    for r in ranks:
        weights.update({name: torch.from_numpy(w) for name, w in r["steps"][key][1].items()})
    return weights


def assert_same_steps(ranks, key, reference):
    records, ref_weights = reference
    # (train_step on synthetic batches)
    assert_same_losses_and_norms(ranks[0]["steps"][key][0], records, evaluated=False)
    assert_same_tensors(
        merged_weights(ranks, key), {n: torch.from_numpy(w) for n, w in ref_weights.items()}
    )


# -----------------------------------------------------------------------------
# the split


def test_zigzag_split_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    tokens = torch.arange(8)[None]
    assert [zigzag_split(tokens, 2, r)[0].tolist() for r in range(2)] == [
        [0, 1, 6, 7],
        [2, 3, 4, 5],
    ]
    assert [zigzag_split(tokens, 4, r)[0].tolist() for r in range(4)] == [
        [0, 7],
        [1, 6],
        [2, 5],
        [3, 4],
    ]


def test_zigzag_gather_undoes_the_split():
    x = torch.randn(2, 24, 3)
    for cp in (1, 2, 3, 4):
        for dim in (1, -2):
            assert torch.equal(
                zigzag_gather([zigzag_split(x, cp, r, dim) for r in range(cp)], dim), x
            )


def test_length_that_does_not_split_into_2cp_chunks_is_a_clear_error():
    with pytest.raises(
        ValueError,
        match=r"block_size = 30 does not split into 2 \* cp = 4 .* multiple of 4 "
        r"\(e.g. 28 or 32\)",
    ):
        check_context_split(30, cp=2)
    problems = sequence_split_problems(36, cp=2, tp=2)
    assert len(problems) == 1 and re.match(
        r"block_size = 36 does not split into 2 \* cp \* tp = 8 \(cp = 2, tp = 2", problems[0]
    )
    with pytest.raises(
        ValueError, match=r"zigzag_split: 12 tokens do not split into 2 \* cp = 8 equal chunks"
    ):
        zigzag_split(torch.zeros(1, 12), cp=4, cp_rank=0)
    assert sequence_split_problems(32, cp=4, tp=2) == []


def unmasked_pairs(tokens):
    """Causal (query, key) pairs of the queries at these global indices: query i sees keys 0..i."""
    return sum(int(i) + 1 for i in tokens)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_gives_every_rank_the_same_attention_work(cp):
    seq = 64
    tokens = split_for_every_rank(torch.arange(seq), cp)  # global index = position here
    assert len({unmasked_pairs(t) for t in tokens}) == 1
    # 2cp - 1 chunk pairs under the diagonal and two on it, of 4cp^2 pairs (the section's count)
    assert (
        attention_work(tokens)
        == [{"blocks": 2 * cp + 1, "scores": (2 * cp + 1) * (seq // (2 * cp)) ** 2}] * cp
    )


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_contiguous_split_does_not_balance_the_work(cp):
    tokens = torch.arange(64).view(cp, -1)  # rank r holds tokens r*T/cp .. (r+1)*T/cp - 1
    pairs = [unmasked_pairs(t) for t in tokens]
    blocks = [w["blocks"] for w in attention_work(tokens)]
    assert pairs == sorted(pairs) and pairs[0] < pairs[-1]
    # r whole pieces (4 chunk pairs each), 3 of its own
    assert blocks == [4 * r + 3 for r in range(cp)]


# -----------------------------------------------------------------------------
# one process: the ring of one is ordinary attention


@pytest.mark.parametrize("name", list(CASES))
def test_single_process_equals_plain_attention(name):
    q, k, v, dout, positions, documents = make_inputs(name)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(
        q,
        k,
        v,
        positions[None],
        None,
        softcap=CASES[name]["softcap"],
        documents=documents[None] if documents is not None else None,
    )
    grads = torch.autograd.grad(out, (q, k, v), dout)
    expected = reference(name)
    torch.testing.assert_close(out, expected[0], **TOL)
    for got, want in zip(grads, expected[1:]):
        torch.testing.assert_close(got, want, **TOL)


def test_query_with_no_visible_key_gets_zeros_not_nan():
    # in a chunk pair a query can see none of the keys (another document); merged and
    # differentiated, its lse of -inf must give zeros (B, H_kv, G, T, D): 3 queries, 5 keys
    q, k, v, dout = (torch.randn(1, 1, 1, n, d) for n, d in ((3, 4), (5, 4), (5, 2), (3, 2)))
    visible = torch.tensor([[True] * 5, [False] * 5, [True, True, False, False, False]])
    out, lse = context_parallel._block_forward(q, k, v, visible, 5.0)
    assert lse[..., 1].item() == float("-inf") and out[..., 1, :].abs().max().item() == 0.0
    empty = (torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    merged, merged_lse = context_parallel._merge(*empty, out, lse)
    torch.testing.assert_close(merged, out)
    torch.testing.assert_close(context_parallel._merge(*empty, *empty)[0], torch.zeros_like(out))
    dq, dk, dv = torch.zeros_like(q), torch.zeros(1, 1, 5, 4), torch.zeros(1, 1, 5, 2)
    delta = (dout * out).sum(-1)
    context_parallel._block_backward(q, k, v, dout, merged_lse, delta, visible, 5.0, dq, dk, dv)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert dq[..., 1, :].abs().max().item() == 0.0


# -----------------------------------------------------------------------------
# ring attention at cp = 2 and cp = 4 (the two launches), against one process on the whole sequence


@pytest.mark.parametrize("name", list(CASES))
def test_ring_output_equals_one_process(ring, name):
    _, ranks = ring
    torch.testing.assert_close(gathered([r[name] for r in ranks], "out"), reference(name)[0], **TOL)


@pytest.mark.parametrize("name", list(CASES))
def test_ring_gradients_equal_one_process(ring, name):
    _, ranks = ring
    _, dq, dk, dv = reference(name)
    torch.testing.assert_close(gathered([r[name] for r in ranks], "dq"), dq, **TOL)
    torch.testing.assert_close(gathered([r[name] for r in ranks], "dk"), dk, **TOL)
    torch.testing.assert_close(gathered([r[name] for r in ranks], "dv"), dv, **TOL)


def test_ring_in_a_group_that_is_not_the_whole_world(ring4):
    _, ranks = ring4  # the 4-rank launch ran cp = 2 in the groups {0, 2} and {1, 3} too
    expected = reference("gqa")
    for group in ([0, 2], [1, 3]):
        pieces = [ranks[r]["subgroup"] for r in group]
        for i, key in enumerate(("out", "dq", "dk", "dv")):
            torch.testing.assert_close(gathered(pieces, key), expected[i], **TOL)


@pytest.mark.parametrize("name", list(CASES))
def test_ring_sends_the_analytic_bytes(ring, name):
    cp, ranks = ring
    case = CASES[name]
    expected = ring_attention_bytes(
        B, T // cp, case["H_kv"], case["D"], case["Dv"], cp, element_size=4
    )
    assert [(r[name]["forward_bytes"], r[name]["backward_bytes"]) for r in ranks] == [
        (expected["forward"], expected["backward"])
    ] * cp


def test_every_rank_computes_the_same_number_of_blocks(ring):
    cp, ranks = ring
    assert [r["mha"]["blocks"] for r in ranks] == [2 * cp + 1] * cp
    assert [r["mha"]["blocks"] for r in ranks] == [
        w["blocks"] for w in attention_work(split_for_every_rank(torch.arange(T), cp))
    ]


def test_step_time_counts_the_ring_operators_each_rank_dispatches(ring):
    """step_time charges each operator a host's cost on CPU: its count of the ring's, in place of a
    fused kernel's, within a tenth of what each rank dispatches (MHA; the counts were taken at
    another shape)."""
    cp, ranks = ring
    pairs, (forward, backward) = 2 * cp + 1, step_time.RING_OPS_PER_PAIR
    predicted = (forward * pairs, backward * pairs + step_time.RING_OPS_BACKWARD)
    for r in ranks:
        assert r["mha"]["operators"] == pytest.approx(predicted, rel=0.1)


# -----------------------------------------------------------------------------
# the model at cp = 2 and 4 against one process


MODEL_TOL = 1e-5  # fp32, max |a - b| / max |b| per tensor; the largest seen is under 1e-6


@pytest.mark.parametrize("variant", list(CP_VARIANTS))
def test_cp_model_logits_loss_and_every_gradient_equal_one_process(launch, variant):
    cp, ranks = launch
    got, want = ranks[0]["model"][variant], reference_model(CP_VARIANTS[variant])
    assert relative_error(got["logits"], want["logits"]) < MODEL_TOL
    assert abs(got["loss"] - want["loss"]) <= MODEL_TOL * abs(want["loss"]), (
        got["loss"],
        want["loss"],
    )
    assert set(got["grads"]) == set(want["grads"])
    errors = {n: relative_error(g, want["grads"][n]) for n, g in got["grads"].items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < MODEL_TOL, (
        f"cp={cp} {variant}: gradient of {worst} off by {errors[worst]:.2e}"
    )


def test_cp_moe_routes_drops_and_balances_as_one_process(launch):
    """The capacity queue of the whole window (the expert ids gathered across cp): the same dropped
    fraction in every layer, the same auxiliary loss; and the test batch really overflows an expert.
    """
    cp, ranks = launch
    want = reference_model(CP_VARIANTS["moe_dropping"])
    assert min(want["dropped"]) > 0
    for r in ranks:
        got = r["model"]["moe_dropping"]
        assert got["dropped"] == pytest.approx(want["dropped"], abs=1e-7)
        assert got["aux"] == pytest.approx(want["aux"], rel=1e-5)


@pytest.mark.parametrize("variant", list(CP_VARIANTS))
def test_five_training_steps_at_cp_equal_one_process(launch, variant):
    cp, ranks = launch
    assert_same_steps(ranks, f"cp{cp}_{variant}", reference_steps(CP_VARIANTS[variant]))


@pytest.mark.parametrize("layout", list(COMPOSED))
def test_cp_composed_with_tp_and_with_dp_zero3_equals_one_process(launch4, layout):
    extra = {k: v for k, v in COMPOSED[layout].items() if k == "batch_size"}
    # dp2 halves the windows per rank: the reference takes the same global batch of 4 windows
    reference = reference_steps(batch_size=2) if extra else reference_steps()
    assert_same_steps(launch4, layout, reference)


def test_the_layout_numbers_tp_fastest_then_cp_then_dp_then_pp(monkeypatch):
    # no processes: a group is its ranks
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: tuple(ranks))
    # 13 = ((1 * 2 + 1) * 2 + 0) * 2 + 1
    layout = ParallelLayout(2, 2, 2, world_size=16, rank=13, cp=2)
    assert (layout.pp_rank, layout.dp_rank, layout.cp_rank, layout.tp_rank) == (1, 1, 0, 1)
    assert (layout.tp_group, layout.cp_group, layout.dp_group, layout.pp_group) == (
        (12, 13),
        (13, 15),
        (9, 13),
        (5, 13),
    )
    # gradients average over these
    assert layout.dp_cp_group == (9, 11, 13, 15) and layout.dp_cp_rank == 2
    assert layout.pp_prev == 5 and layout.pp_next is None
    assert parallel.grid_rank(1, 1, 1, 2, 2, cp_rank=0, cp=2) == 13
    # at cp = 1 the numbering is a run's without context parallelism; the dp group is dp x cp's
    assert parallel.grid_rank(1, 1, 1, 2, 2) == (1 * 2 + 1) * 2 + 1
    flat = ParallelLayout(2, 2, 2, world_size=8, rank=7)
    assert flat.dp_cp_group is flat.dp_group == (5, 7) and flat.cp_group is None


def test_the_grid_names_every_rank_once_with_its_sequence_share():
    text = settings.format_grid(2, 2, 2, cp=2)
    assert "stage 1 replica 0 sequence share 1 (chunks 1, 2): ranks [10, 11]" in text
    ranks = [
        int(r) for line in text.splitlines() for r in line.split("[")[1].rstrip("]").split(",")
    ]
    assert sorted(ranks) == list(range(16))


# -----------------------------------------------------------------------------
# sequence parallelism


SP_CASES = [("launch2", v) for v in TP_VARIANTS] + [("launch4", v) for v in SP_AT_TP4]


@pytest.mark.parametrize(
    "launch_name, variant", SP_CASES, ids=[f"tp{n[-1]}-{v}" for n, v in SP_CASES]
)
def test_sequence_parallel_equals_tensor_parallel_without_it(request, launch_name, variant):
    ranks = request.getfixturevalue(launch_name)
    tp = len(ranks)
    for rank, r in enumerate(ranks):
        e = r["sequence_parallel"][variant]
        assert e["names"], (
            f"tp={tp} {variant}: the parameters differ from the model without sequence parallelism"
        )
        assert e["logits"] < MODEL_TOL and e["loss"] < MODEL_TOL * 10, (tp, variant, rank, e)
        assert e["grad"] < MODEL_TOL, (
            f"tp={tp} {variant} rank {rank}: {e['worst']}'s gradient off by {e['grad']:.1e}"
        )


def test_sequence_parallel_at_tp1_and_lengths_that_do_not_split_are_refused():
    cfg = ModelConfig(**TINY)
    with pytest.raises(ValueError, match=r"sequence_parallel=True needs tp > 1"):
        check_layout(cfg, tp=1, sequence_parallel=True)
    with pytest.raises(
        ValueError, match=r"block_size = 32 does not split into tp = 3 equal pieces"
    ):
        check_layout(
            ModelConfig(**{**TINY, "n_head": 3, "n_kv_head": 3, "n_embd": 96}),
            tp=3,
            sequence_parallel=True,
        )
    cfg = ModelConfig(**{**TINY, "block_size": 24})
    with pytest.raises(
        ValueError, match=r"block_size = 24 does not split into 2 \* cp \* tp = 16 \(cp = 4, tp = 2"
    ):
        check_layout(cfg, tp=2, cp=4, sequence_parallel=True)
    check_layout(cfg, tp=2, cp=4)  # without sequence parallelism 2 * cp = 8 chunks are enough


def test_make_config_checks_the_cp_layout(tmp_path):
    with pytest.raises(
        SystemExit, match=r"block_size = 36 does not split into 2 \* cp = 8 \(cp = 4\)"
    ):
        make_config.main(["--block_size=36", "--cp=4", "--nproc=4", f"--out={tmp_path / 'bad.py'}"])
    with pytest.raises(
        SystemExit, match=r"nproc = 6 processes cannot be cut into cp = 4 x tp = 1 x pp = 1"
    ):
        make_config.main(["--cp=4", "--nproc=6", f"--out={tmp_path / 'bad.py'}"])
    make_config.main(
        [
            "--cp=2",
            "--tp=2",
            "--sequence_parallel=True",
            "--pp=2",
            "--nproc=16",
            "--block_size=1024",
            f"--out={tmp_path / 'c.py'}",
        ]
    )
    text = (tmp_path / "c.py").read_text()
    assert "16 processes = dp 2 x cp 2 x tp 2 (sequence parallel) x pp 2" in text
    assert "nproc / (cp * tp * pp) = 16 / (2 * 2 * 2)" in text


# -----------------------------------------------------------------------------
# train.py: a checkpoint resumed across cp, both ways. One process's step-2 checkpoint resumes at cp
# = 2 with ZeRO-1 to step 4, and that run's step-4 checkpoint at one process to step 6; each segment
# must be the uninterrupted run. (train.py at cp = 2, alone and composed with every other axis,
# against one process: the equivalence matrix, tests/matrix.py.) Each run logs every step, evaluates
# and saves every second step.

TRAIN_ARGS = [
    "--n_layer=2",
    "--n_embd=64",
    "--n_head=4",
    "--n_kv_head=2",
    "--block_size=32",
    "--device=cpu",
    "--batch_size=2",
    "--gradient_accumulation_steps=2",
    "--max_iters=6",
    "--log_interval=1",
    "--eval_interval=2",
    "--eval_iters=2",
    "--checkpoint_interval=2",
    "--warmup_iters=2",
    "--lr_decay_iters=10",
    "--learning_rate=3e-3",
    "--bucket_size_mb=0.01",
    # skips timing a CPU matmul on each rank at start-up
    "--peak_flops=1e12",
]


@pytest.fixture(scope="module")
def one_process(data_dir, tmp_path_factory):
    """The uninterrupted run, here in the test process: (records, out_dir)."""
    out = tmp_path_factory.mktemp("one_process")
    return train_in_process(TRAIN_ARGS + [f"--data_dir={data_dir}", f"--out_dir={out}"]), out


@pytest.fixture(scope="module")
def resumed_at_cp2(one_process, data_dir, tmp_path_factory):
    """One process's step-2 checkpoint resumed at cp = 2 with ZeRO-1 to step 4: (records, out_dir,
    stdout)."""
    out = tmp_path_factory.mktemp("cp2")
    shutil.copytree(one_process[1] / "ckpt_0000002", out / "ckpt_0000002")
    [(records, stdout)] = train_on_ranks(
        [
            TRAIN_ARGS
            + [
                f"--data_dir={data_dir}",
                f"--out_dir={out}",
                "--max_iters=4",
                "--init_from=resume",
                "--cp=2",
                "--zero_stage=1",
            ]
        ],
        2,
    )
    return records, out, stdout


def final_weights(path):
    """A checkpoint's weights, loaded into a single-process model (whatever layout saved them)."""
    reader = checkpoint.CheckpointReader(path)
    model = Transformer(model_config_from(reader.meta["model"]))
    checkpoint.load_model(model, reader)
    return dict(model.named_parameters())


def test_a_one_process_checkpoint_resumes_at_cp2_with_the_uninterrupted_run(
    resumed_at_cp2, one_process
):
    # the whole AdamW moments cut into the two cp ranks' ZeRO-1 shards
    records, out, stdout = resumed_at_cp2
    assert f"resumed from {out / 'ckpt_0000002'} at step 2" in stdout
    assert "layout: dp=1 x cp=2 x tp=1 x pp=1 = 2 processes" in stdout
    assert "stage 0 replica 0 sequence share 1 (chunks 1, 2): ranks [1]" in stdout
    assert [r["step"] for r in records if "loss" in r] == [3, 4]
    assert_same_losses_and_norms(records, one_process[0])


def test_a_cp2_checkpoint_resumes_at_one_process_with_the_uninterrupted_run(
    resumed_at_cp2, one_process, data_dir, tmp_path, capsys
):
    # ZeRO-1's moments, sharded over the two cp ranks, assembled for plain AdamW
    shutil.copytree(resumed_at_cp2[1] / "ckpt_0000004", tmp_path / "ckpt_0000004")
    records = train_in_process(
        TRAIN_ARGS
        + [
            f"--data_dir={data_dir}",
            f"--out_dir={tmp_path}",
            "--init_from=resume",
            "--cp=1",
            "--zero_stage=0",
        ]
    )
    assert f"resumed from {tmp_path / 'ckpt_0000004'} at step 4" in capsys.readouterr().out
    assert [r["step"] for r in records if "loss" in r] == [5, 6]
    ref_records, ref_out = one_process
    assert_same_losses_and_norms(records, ref_records)
    assert_same_tensors(
        final_weights(tmp_path / "ckpt_0000006"), final_weights(ref_out / "ckpt_0000006")
    )


# -----------------------------------------------------------------------------
# Measurement, not a test:  PYTHONPATH=. python tests/test_context_parallel.py --measure
# At the shape of config/tiny_fineweb.py with block_size 2048 (one sequence per rank): the
# activation memory per rank (the bytes autograd saves for backward, counted by saved-tensor hooks,
# each storage once) at cp = 1, 2, 4 and at tp = 2 with and without sequence parallelism; the
# attention work per rank, zigzag against contiguous; the bytes the ring sends per step against
# ring_attention_bytes.

MEASURE = dict(vocab_size=50257, block_size=2048, n_layer=4, n_head=4, n_kv_head=2, n_embd=128)


def measure_window():
    """One window of block_size + 1 random tokens, as (x, y)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, MEASURE["vocab_size"], (1, MEASURE["block_size"] + 1), generator=g)
    return x[:, :-1], x[:, 1:]


class SavedStorages:
    """Bytes autograd holds for backward (parameters excluded), live and at peak, through
    saved-tensor hooks as tests/test_pipeline.py's SavedActivations, but each storage counted once
    however many operations save it (q, k and v's projections all save their one input)."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.held, self.live, self.peak = {}, 0, 0  # storage -> how many saved tensors hold it

    def pack(self, t):
        key = t.untyped_storage().data_ptr()
        if key in self.params:
            return t
        if self.held.get(key, 0) == 0:
            self.live += t.untyped_storage().nbytes()
            self.peak = max(self.peak, self.live)
        self.held[key] = self.held.get(key, 0) + 1
        return _Storage(t, key, self)

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(
            self.pack, lambda h: h.t if isinstance(h, _Storage) else h
        )
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


class _Storage:
    def __init__(self, t, key, counter):
        self.t, self.key, self.counter, self.nbytes = t, key, counter, t.untyped_storage().nbytes()

    def __del__(self):
        self.counter.held[self.key] -= 1
        if self.counter.held[self.key] == 0:
            self.counter.live -= self.nbytes


def measured_activations(rank, world_size, cp, tp, sequence_parallel):
    """(bytes saved by the embedding and the blocks, by the whole forward with the head and the
    loss) on this rank, one sequence of block_size tokens per step."""
    layout = ParallelLayout(1, tp, 1, world_size, rank, cp=cp)
    model = build_model(
        ModelConfig(**MEASURE),
        tp_group=layout.tp_group,
        chunked_loss=True,
        cp_group=layout.cp_group,
        sequence_parallel=sequence_parallel,
    )
    batch = context_split(measure_window(), layout)
    body = {}

    # what the embedding and the blocks saved (nothing is let go during forward)
    def after_the_blocks(*_):
        body["bytes"] = saved.live

    list(model.blocks.values())[-1].register_forward_hook(after_the_blocks)
    with SavedStorages(model) as saved:
        _, loss = model(*batch)
        total = saved.peak
    loss.backward()
    return body["bytes"], total


def measured_ring_bytes(rank, world_size):
    """Bytes this rank's ring sends in one forward and backward of the model (every attention
    layer)."""
    _count_communication_and_blocks()
    layout = ParallelLayout(1, 1, 1, world_size, rank, cp=world_size)
    model = build_model(ModelConfig(**MEASURE), chunked_loss=True, cp_group=layout.cp_group)
    SENT.clear()
    _, loss = model(*context_split(measure_window(), layout))
    loss.backward()
    return sum(SENT)


def measured_attention_time(rank, world_size, split, repeats=3):
    """CPU seconds this rank spends in ring attention, forward and backward, at the model's
    attention shape (the best of a few repeats), with the zigzag or the contiguous split of the
    sequence."""
    torch.set_num_threads(1)
    cp, T = world_size, MEASURE["block_size"]
    H, H_kv, D = MEASURE["n_head"], MEASURE["n_kv_head"], MEASURE["n_embd"] // MEASURE["n_head"]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, h, D, generator=g) for h in (H, H_kv, H_kv))
    if split == "zigzag":
        share, positions = (
            (lambda t: zigzag_split(t, cp, rank)),
            split_for_every_rank(torch.arange(T), cp),
        )
    else:
        share, positions = (lambda t: t.chunk(cp, dim=1)[rank]), torch.arange(T).view(cp, -1)
    q, k, v = (share(t).requires_grad_() for t in (q, k, v))
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.process_time()
        ring_attention(q, k, v, positions, dist.group.WORLD).sum().backward()
        best = min(best, time.process_time() - start)
    return best


def mib(nbytes):
    return f"{nbytes / 2**20:,.1f} MiB"


def measure_activation_memory():
    print(
        f"model: {MEASURE}, one sequence per step (batch_size 1), fp32\n\n"
        "activation memory per rank (bytes saved for backward; the head's and loss's are the "
        "chunked loss's gradients at tp = 1, the vocab-parallel softmax at tp = 2):",
        flush=True,
    )
    rows = [
        ("one process", 1, 1, 1, False),
        ("cp = 2", 2, 2, 1, False),
        ("cp = 4", 4, 4, 1, False),
        ("tp = 2", 2, 1, 2, False),
        ("tp = 2, sequence parallel", 2, 1, 2, True),
        ("cp = 2 x tp = 2, sequence parallel", 4, 2, 2, True),
    ]
    base = None
    for label, world, cp, tp, sp in rows:
        if world == 1:
            per_rank = [measured_activations(0, 1, 1, 1, False)]
        else:
            per_rank = run_ranks(measured_activations, world, cp, tp, sp)
        body, total = max(b for b, _ in per_rank), max(t for _, t in per_rank)
        base = base or body
        print(
            f"  {label:34s} embedding + blocks {mib(body):>12s} "
            f"({body / base:.2f} of one process)   whole forward {mib(total):>12s}",
            flush=True,
        )


def measure_attention_work():
    print(
        "\nattention work per rank, one layer (score elements computed per head; CPU time of ring "
        "attention forward + backward, 1 thread, best of 3):",
        flush=True,
    )
    T = MEASURE["block_size"]
    for cp in (2, 4):
        splits = (
            ("contiguous", torch.arange(T).view(cp, -1)),
            ("zigzag", split_for_every_rank(torch.arange(T), cp)),
        )
        for split, positions in splits:
            work = [w["scores"] for w in attention_work(positions)]
            seconds = run_ranks(measured_attention_time, cp, split)
            print(
                f"  cp = {cp} {split:10s}  scores per rank {work}  "
                f"(max / min {max(work) / min(work):.2f});  "
                f"ms per rank {[round(1000 * s) for s in seconds]}  "
                f"(max / min {max(seconds) / min(seconds):.2f})",
                flush=True,
            )


def measure_ring_bytes():
    print(
        "\nring bytes sent per rank in one step (forward + backward, every layer), "
        "measured against ring_attention_bytes:",
        flush=True,
    )
    T, D = MEASURE["block_size"], MEASURE["n_embd"] // MEASURE["n_head"]
    for cp in (2, 4):
        sent = run_ranks(measured_ring_bytes, cp)
        per_layer = ring_attention_bytes(1, T // cp, MEASURE["n_kv_head"], D, D, cp)
        analytic = MEASURE["n_layer"] * (per_layer["forward"] + per_layer["backward"])
        verdict = "equal" if set(sent) == {analytic} else "DIFFERENT"
        print(
            f"  cp = {cp}: measured {sent} bytes per rank; analytic n_layer x "
            f"(forward {per_layer['forward']:,} + backward {per_layer['backward']:,}) = "
            f"{analytic:,} ({verdict})",
            flush=True,
        )


def measure():
    measure_activation_memory()
    measure_attention_work()
    measure_ring_bytes()


if __name__ == "__main__":
    if sys.argv[1:] != ["--measure"]:
        sys.exit(
            "usage: PYTHONPATH=. python tests/test_context_parallel.py --measure   "
            "(the tests run under pytest)"
        )
    measure()
