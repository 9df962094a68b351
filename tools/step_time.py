"""
How long one training step of a run will take, predicted before anything runs: the time half of the
plan whose memory half is tools/memory_plan.py. `python tools/step_time.py config/x.py --nproc=64
--machine=h100 --tp=8` prints one layout's step broken down; tools/make_config.py --choose=True
ranks every layout that fits by it; train.py prints it at start-up beside the measured step, and
tools/bench.py puts it in its RESULT. --trace=FILE writes the step as simulated, every pipeline
rank's actions in time, as a Chrome trace (rank_spans), which tools/plot.py --trace draws.

It predicts one step's seconds as its parts (compute, the bubble, each mechanism's exposed
communication, the optimizer), tokens/s per device and MFU, from the model config, the layout, the
execution settings and a machine (tools/machines.py): metrics.pipeline_costs' FLOPs, the schedule's
own action lists placed in time, each collective's bytes counted from the code that sends them; no
constant fitted to a measured run. It calls no collective, touches no device and runs no model: it
runs on a laptop for an H100 cluster.

The terms, each with its formula and source where it is computed:
  compute       FLOPs / the machine's achieved matmul rate (its best published measurement, or
                one measured here at the model's shapes); attention, where the kernel is fused, at
                the kernel's published efficiency, counting the causal half it computes
                (FlashAttention-2's convention).
  fp8           the blocks' linears' three products at the machine's FP8 rate, the casts before
                them by the bytes fp8.py's kernels move (eager, or fused under compile), and the
                amax all-reduces fp8.py makes where tp or cp splits what one process casts
                (matmul_seconds, fp8_collectives); a machine without an FP8 rate is refused.
  non-matmul    the norms, residual adds, rotary, the MLP's activation, the loss's softmax and the
                optimizer step, by the bytes they move over the memory bandwidth (the roofline:
                Williams et al. 2009); under tp on a machine measured here, the vocab-parallel
                loss's kernels as they were timed.
  pipeline      every rank's actions placed in time (simulate_pipeline): bubble, interleaving,
                zero-bubble and the stages' imbalance all come out of the one simulation.
  communication the ring algorithm (Patarasuk & Yuan 2009; nccl-tests doc/PERFORMANCE.md's busbw):
                an all-reduce of S bytes over n ranks takes 2 (n - 1) latencies plus
                2 (n - 1) / n S / busbw, a reduce-scatter or all-gather half that; on the link the
                group spans (a node's, or the network's): machines.collective_seconds and
                group_link.
  overlap       only where the code overlaps: the data-parallel buckets with the backward (Li et
                al. 2020, 3.2.3), ZeRO-1/2's parameter all-gather with the next forward, ZeRO-3's
                prefetched gathers with the unit before, the cp ring with the attention it feeds.
                Where the links share the compute's cores (CPU, gloo with one core a rank) nothing
                overlaps.
  host          on CPU, each operator's dispatch and autograd bookkeeping (OPS_PER_BLOCK,
                op_seconds).
Left out, and which way each errs: kernels' efficiency at the run's own shapes (a named machine's
rate is the best shape's), congestion across nodes, the skew between ranks at each blocking exchange
(it waits for the slower), data loading, logging (all fast); overlap NCCL gets unasked (slow).
"""

import dataclasses
import json
import math
import os
import sys
from dataclasses import fields
from types import SimpleNamespace

if __name__ == "__main__" and not __package__:  # python tools/X.py: import from the repository
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch

import build
import metrics
import settings
from configurator import ConfigError, Setting, configure, section
from expert_parallel import expert_rows
from model import ModelConfig, attention_dims, mlp_hidden_size, takes_muon
from optim import deal_whole, split_pays
from parallel import resolve_dp, stage_layers
from pipeline_schedules import SCHEDULES, check_schedule, virtual_stages
from tools.machines import (
    MACHINES,
    collective_seconds,
    group_link,
    load_machine,
    measure_machine,
    p2p_seconds,
    probe_tokens,
    sent_bytes,
    startup_machine,
)
from tools.timeline import chrome_trace, check_channels, route_messages, simulate_pipeline
from tools import memory_plan


# -----------------------------------------------------------------------------
# The run: a config and a layout, in the fields the model reads


def run_of(cfg, nproc=None):
    """The settings the model reads, from train.py's cfg (a SimpleNamespace or dict of settings), dp
    resolved from nproc when dp = 0; overlap_param_gather (ZeRO-1/2) True, fp8 'none' and compile
    False (it changes only fp8's casts here), muon_tp_mode 'replicate' and muon_ns_steps 5 where a
    cfg has no such setting. dp_rank: the data-parallel (dp x cp) rank whose bytes comm_bytes
    counts, 0 (global rank 0's); Muon's deal under ZeRO gives each its own matrices."""
    source = cfg if isinstance(cfg, dict) else vars(cfg)
    names = (
        "dp",
        "tp",
        "pp",
        "cp",
        "ep",
        "zero_stage",
        "batch_size",
        "gradient_accumulation_steps",
        "pp_schedule",
        "pp_chunks",
        "activation_checkpointing",
        "sequence_parallel",
        "bucket_size_mb",
        "dtype",
        "pp_layers",
        "block_size",
        "optimizer",
        "attn_impl",
        "chunked_loss",
    )
    run = SimpleNamespace(
        **{k: source[k] for k in names},
        overlap_param_gather=source.get("overlap_param_gather", True),
        fp8=source.get("fp8", "none"),
        compile=source.get("compile", False),
        muon_tp_mode=source.get("muon_tp_mode", "replicate"),
        muon_ns_steps=source.get("muon_ns_steps", 5),
        dp_rank=0,
    )
    if not run.dp:
        run.dp = (nproc or 1) // (run.tp * run.pp * run.cp)
    run.pp_chunks = 2 if run.pp_schedule == "zbv" else run.pp_chunks
    return run


def dtype_of(run, machine):
    """The dtype the matmuls run in: the run's, or for 'auto' bf16 on a GPU machine and fp32 on a
    CPU. The one place a run's dtype meets the machine: one without its rate is refused here."""
    rates = machine["matmul_flops"]
    gpu = "bfloat16" in rates and machine.get("name") != "auto"
    dtype = run.dtype if run.dtype != "auto" else "bfloat16" if gpu else next(iter(rates))
    if dtype not in rates:
        raise ValueError(
            f"dtype = {dtype!r}: machine {machine.get('name')!r} has no matmul_flops "
            f"for it, only {', '.join(d for d in rates if d != 'fp8')}: choose --dtype= one of "
            f"them, or add "
            f"its rate to the machine file"
        )
    return dtype


def element_bytes(dtype):
    """The bytes of an activation's element in a run of this dtype (dtype_of's answer)."""
    return {"float64": 8, "float32": 4}.get(dtype, 2)


def wide_bytes(run):
    """The bytes of a parameter's element, its gradient's, and of what picotron keeps at least fp32
    beside narrow activations (parallel.at_least_fp32: the loss's floats, the ring's gradient
    accumulators, the router's counts): 8 in a float64 run, else 4."""
    return 8 if run.dtype == "float64" else 4


# (repr(model_cfg), tp, ep, sequence_parallel): _pieces' answer (the config is not hashable)
_PIECES = {}


def _pieces(model_cfg, tp, ep, sequence_parallel=False):
    """(({name: elements} of one block, {name: elements} of the rest) of every parameter on one tp
    (and ep) rank, the same of those whose gradient is summed over tp once a step, {name: full
    shape} of the block's matrices that Muon updates (model.takes_muon), in the model's order): a
    one-block model built on the meta device as build.build_model builds it
    (memory_plan.stage_parameter_elements), so the counts are the run's, at a cost that does not
    grow with the depth."""
    key = (repr(model_cfg), tp, ep, sequence_parallel)
    if key not in _PIECES:
        summed, shapes, block = {}, {}, "blocks.0."
        elements = memory_plan.stage_parameter_elements(
            dataclasses.replace(model_cfg, n_layer=1),
            tp,
            1,
            0,
            ep=ep,
            shapes=shapes,
            sequence_parallel=sequence_parallel,
            summed=summed,
        )
        split = (
            lambda of: (  # noqa: E731
                {name[len(block) :]: n for name, n in of.items() if name.startswith(block)},
                {name: n for name, n in of.items() if not name.startswith(block)},
            )
        )
        muon = {
            name[len(block) :]: shape
            for name, shape in shapes.items()
            if takes_muon(name, torch.empty(shape, device="meta"))
        }
        _PIECES[key] = split(elements), split(summed), muon
    return _PIECES[key]


def parameter_pieces(model_cfg, tp, ep):
    """({name: elements} of one block, {name: elements} of the rest) on one tp (and ep) rank
    (_pieces)."""
    return _pieces(model_cfg, tp, ep)[0]


def tp_summed_seconds(model_cfg, run, cut, held, link):
    """(seconds, bytes this rank sends) of the one all-reduce a step that sums over tp the gradients
    of the parameters each tp rank holds whole (tensor_parallel.sum_partial_grads), on a pipeline
    rank holding model stages `held`: under sequence parallelism the norms, and the replicated parts
    of attention (QK-norm gains, key/value heads fewer than the tp ranks, MLA's down-projections).
    Under ZeRO each rank sums its own slices."""
    if run.tp == 1:
        return 0.0, 0
    block, root = _pieces(model_cfg, run.tp, run.ep, run.sequence_parallel)[1]
    elements = sum(len(stage_layers(cut, s)) for s in held) * sum(block.values())
    elements += sum(root.values()) if len(cut) - 1 in held else 0  # (the final norm)
    shards = run.dp * run.cp if run.zero_stage >= 1 else 1
    nbytes = elements * wide_bytes(run) / shards
    return collective_seconds("all_reduce", nbytes, run.tp, link), sent_bytes(
        "all_reduce", nbytes, run.tp
    )


# -----------------------------------------------------------------------------
# Compute: one block's forward and backward for one micro-batch on one rank


def fused_attention(model_cfg, run, machine):
    """Whether the attention runs a fused kernel or writes its scores out: the eager attention (the
    rule of memory_plan.attention_saves_scores) and context parallelism's ring attention (its
    blocks' softmax)."""
    device = "cpu" if machine.get("name") == "auto" and not machine["overlaps"] else "cuda"
    return run.cp == 1 and not memory_plan.attention_saves_scores(
        model_cfg, run.attn_impl, device, dtype_of(run, machine)
    )


def elementwise_bytes(model_cfg, run, fused, act_bytes):
    """Bytes one token's forward through one block moves outside the matmuls, each eager kernel of
    model.py reading its inputs and writing its output (a = act_bytes; f = 4: RMSNorm and RoPE
    compute in fp32): RMSNorm per element 5f + 2a, plus 2 (a + f) for its casts in and out when a <
    f (to fp32, pow, mean, x * rsqrt, back, * weight; LayerNorm one fused kernel, 2a); RoPE per
    element of q and k 9f, plus the casts (four products and two sums of halves, the cat); two
    residual adds (3a); the MLP's activation (SwiGLU's silu and product 5a per hidden element,
    GELU's 2a, for each expert a token goes to); without a fused kernel the softmax (2a per head and
    key, the causal half). Under sequence parallelism the norms and adds see 1/tp of the tokens. A
    backward moves about twice a forward's."""
    tp, C, a, f, (qk, _) = run.tp, model_cfg.n_embd, act_bytes, 4, attention_dims(model_cfg)
    H, H_kv = model_cfg.n_head / tp, max(1, model_cfg.n_kv_head / tp)
    share = C / tp if run.sequence_parallel else C
    casts = 2 * (a + f) if a < f else 0
    norm = 5 * f + 2 * a + casts if model_cfg.norm == "rmsnorm" else 2 * a
    F = mlp_hidden_size(model_cfg) / tp
    mlp = (5 if model_cfg.mlp == "swiglu" else 2) * a * F
    if model_cfg.n_expert > 0:
        mlp *= model_cfg.n_expert_per_token + model_cfg.n_shared_expert
    # the causal half of the scores, on average
    softmax = 0 if fused else 2 * a * H * run.block_size / 2
    return 2 * norm * share + 2 * 3 * a * share + (9 * f + casts) * (H + H_kv) * qk + mlp + softmax


# The operators one block runs for a micro-batch, forward and backward (views included), counted
# with a TorchDispatchMode: model.Block's (SwiGLU 80 and 137, GELU 75 and 125, a mixture of experts
# 161 and 246), what the ends add (20 and 34); the ring attention, where a fused kernel's are 2 and
# 7, 91 and 69 per chunk pair a rank computes (2 cp + 1 of them) and 38 more backward
# (tests/test_context_parallel.py holds it to the ring's own).
OPS_PER_BLOCK, OPS_AT_ENDS = {"dense": (80, 137), "moe": (161, 246)}, (20, 34)
RING_OPS_PER_PAIR, RING_OPS_BACKWARD, FUSED_ATTENTION_OPS = (91, 69), 38, (2, 7)


def ring_seconds(model_cfg, run, machine, links, tokens, act_bytes, attention_f):
    """([forward, backward] seconds context parallelism's ring leaves exposed in one block,
    [forward, backward] bytes this rank sends) (context_parallel.ring_attention_bytes): forward
    cp - 1 messages of the keys and values; backward cp - 1 of them and cp of their fp32 gradients'
    accumulators, the last one bringing them home. Each overlaps the attention of its step (the ring
    feeds it), the last one nothing. attention_f: the block's forward attention seconds."""
    qk, v = attention_dims(model_cfg)
    kv_elements = tokens * max(1, model_cfg.n_kv_head // run.tp) * (qk + v)
    kv = p2p_seconds(kv_elements * act_bytes, links["cp"])
    kv_grads = p2p_seconds(kv_elements * wide_bytes(run), links["cp"])
    hidden = attention_f / run.cp if machine["overlaps"] else 0.0  # one step's attention
    seconds = [
        (run.cp - 1) * max(0.0, kv - hidden),
        (run.cp - 1) * max(0.0, kv + kv_grads - 2 * hidden) + kv_grads * (run.cp > 1),
    ]
    kv, kv_grads = kv_elements * act_bytes, kv_elements * wide_bytes(run)
    return seconds, [(run.cp - 1) * kv, ((run.cp - 1) * (kv + kv_grads) + kv_grads) * (run.cp > 1)]


def expert_exchange_seconds(model_cfg, run, links, tokens, act_bytes):
    """([forward, backward] seconds, [forward, backward] bytes this rank sends) of expert
    parallelism's all-to-alls in one block: two of the kept rows each way, forward after the counts'
    (exchange_expert_counts). The rows are priced spread evenly over the ep ranks: (ep - 1) / ep of
    them leave the rank, as they do where each rank's experts take an equal share."""
    if model_cfg.n_expert <= 0 or run.ep <= 1:
        return [0.0, 0.0], [0, 0]
    kept, _ = expert_rows(model_cfg, tokens, run.ep)
    row_bytes, count_bytes = kept * model_cfg.n_embd * act_bytes, model_cfg.n_expert * 8
    rows = 2 * collective_seconds("all_to_all", row_bytes, run.ep, links["ep"])
    counts = collective_seconds("all_to_all", count_bytes, run.ep, links["ep"])
    rows_sent = 2 * sent_bytes("all_to_all", row_bytes, run.ep)
    counts_sent = sent_bytes("all_to_all", count_bytes, run.ep)
    return [rows + counts, rows], [rows_sent + counts_sent, rows_sent]


def expert_window_collectives(model_cfg, run, tokens):
    """{'cp': [forward, backward]} of the (kind, bytes) collectives a mixture of experts makes over
    the cp ranks in one block's forward, whose capacity queue and balance counts are the whole
    window's (context_parallel.ContextWindow): the assignments per expert all-reduced (n_expert
    floats, at least fp32), and with a capacity the window's expert choices all-gathered (k int64s
    per token) to be queued. A recomputed forward makes them again."""
    if model_cfg.n_expert <= 0 or run.cp <= 1:
        return {}
    forward = [("all_reduce", model_cfg.n_expert * wide_bytes(run))]
    if model_cfg.capacity_factor > 0:
        forward.append(("all_gather", tokens * run.cp * model_cfg.n_expert_per_token * 8))
    return {"cp": [forward, []]}


def host_seconds(model_cfg, run, machine):
    """(forward, backward) seconds the host spends on one block's operators (op_seconds: measured on
    CPU, hidden behind a GPU's kernels), the ring's under cp."""
    ops_f, ops_b = OPS_PER_BLOCK["moe" if model_cfg.n_expert else "dense"]
    if run.cp > 1:
        pairs = 2 * run.cp + 1
        ops_f += RING_OPS_PER_PAIR[0] * pairs - FUSED_ATTENTION_OPS[0]
        ops_b += RING_OPS_PER_PAIR[1] * pairs + RING_OPS_BACKWARD - FUSED_ATTENTION_OPS[1]
    return ops_f * machine.get("op_seconds", 0.0), ops_b * machine.get("op_seconds", 0.0)


# -----------------------------------------------------------------------------
# FP8 (fp8.py): the blocks' linears' three products at the machine's FP8 rate, the casts before
# them, and the amaxes all-reduced where a layout splits what one process casts

# The linears apply_fp8 swaps, by name in a block: build.py keeps the router (and the head) in the
# run's dtype, and apply_fp8 every linear whose gradient is summed over tp (MLA's down-projections
# under tp; key/value heads fewer than the tp ranks are no linear there). o_proj and down are
# row-parallel under tp, the others column-parallel.
FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_up", "kv_up", "q_down", "kv_down")
FP8_LINEARS += ("gate", "up", "down")
ROW_PARALLEL = ("o_proj", "down")
# Bytes an element of one cast moves (cast_bytes), the eager kernels of fp8.cast: amax reads x,
# writes |x| and reads it (3b, b its bytes: 2 bf16 activations, 4 fp32 weights); to_fp8's
# x.float() (b + 4 where b < 4), * scale (8), clamp (8), .to(fp8) (5): 33 bytes whether b is 2 or
# 4. Compiled (torchao's float8 needs torch.compile for its speed), they fuse into two kernels: the
# amax reads x, the cast reads x and writes a byte (2b + 1). Laying an FP8 operand out
# column-major for _scaled_mm reads and writes it (2).
EAGER_CAST_BYTES, LAYOUT_BYTES = 33, 2


def cast_bytes(b, compiled):
    """Bytes one element of b bytes moves to be cast to FP8 with its scale (see above)."""
    return 2 * b + 1 if compiled else EAGER_CAST_BYTES


def fp8_rate(run, machine):
    """The FP8 matmul rate of a run with fp8 on (machine['matmul_flops']['fp8']), None with it off.
    A machine without FP8 tensor cores (the A100's compute capability 8.0, a CPU) has none and is
    refused here, as fp8.check_fp8 refuses such a GPU at start-up."""
    if getattr(run, "fp8", "none") == "none":
        return None
    if "fp8" not in machine["matmul_flops"]:
        raise ValueError(
            f"fp8 = {run.fp8!r}: machine {machine.get('name')!r} has no FP8 matmul rate (no FP8 "
            f"tensor cores: they need compute capability 8.9, Ada or Hopper): predict with "
            f"--fp8=none, or give the machine file matmul_flops.fp8"
        )
    return machine["matmul_flops"]["fp8"]


def fp8_linears(model_cfg, run, tokens):
    """[(rows M, input features K, output features N, 'row' or 'column', whether of an expert)] of
    one block's FP8
    linears on one rank (parameter_pieces' weights, this rank's share) for a micro-batch of `tokens`
    tokens; an expert sees its share of the top-k rows (dropless, spread evenly), ep experts a rank
    holding n_expert / ep of them. [] where fp8 is off."""
    if getattr(run, "fp8", "none") == "none":
        return []
    block, _ = parameter_pieces(model_cfg, run.tp, run.ep)
    C, out = model_cfg.n_embd, []
    for name, elements in block.items():
        parts = name.split(".")
        layer = parts[-2]
        summed = layer in ("q_down", "kv_down") or (
            layer in ("k_proj", "v_proj") and model_cfg.n_kv_head % run.tp
        )
        if parts[-1] != "weight" or layer not in FP8_LINEARS or (run.tp > 1 and summed):
            continue
        rows = tokens
        if "experts" in parts:  # (a routed expert; shared experts see every token)
            rows = tokens * model_cfg.n_expert_per_token * run.ep / model_cfg.n_expert
        K = {"q_up": model_cfg.q_lora_rank, "kv_up": model_cfg.kv_lora_rank}.get(layer, C)
        K = elements // C if layer in ROW_PARALLEL else K
        kind = "row" if layer in ROW_PARALLEL else "column"
        out.append((rows, K, elements // K, kind, "experts" in parts))
    return out


def fp8_cast_seconds(run, machine, linears, act_bytes):
    """[forward, input_grad, weight_grad] seconds of the FP8 casts and operand copies of `linears`
    (fp8_linears'), by the bytes they move (cast_bytes an element cast, eager or compiled;
    LAYOUT_BYTES one copied). x (M, K) and dy (M, N) in the activations' dtype, W (N, K) fp32.
    Tensorwise casts W and x forward and keeps the casts (torch.cat copies x8 and y), dy once per
    gradient product, and lays out W8, dy8^T and x8 for them. Rowwise casts x and W forward, then
    each again along the other axis for the gradients (dy twice as well), and multiplies the two
    gradients' scales into their bf16 outputs (read, written)."""
    compiled = getattr(run, "compile", False)
    cx, cw = cast_bytes(act_bytes, compiled), cast_bytes(4, compiled)
    seconds = [0.0, 0.0, 0.0]
    for M, K, N, *_ in linears:
        x, w, dy = M * K, N * K, M * N
        if run.fp8 == "tensorwise":
            parts = (
                cx * x + cw * w + 2 * x + 2 * act_bytes * dy,
                cx * dy + LAYOUT_BYTES * w,
                cx * dy + LAYOUT_BYTES * (dy + x),
            )
        else:
            parts = (
                cx * x + cw * w,
                cx * dy + cw * w + LAYOUT_BYTES * w + 4 * x,
                cx * (dy + x) + LAYOUT_BYTES * (dy + x) + 4 * w,
            )
        seconds = [s + p / machine["memory_bw"] for s, p in zip(seconds, parts)]
    return seconds


def fp8_collectives(run, linears, act_bytes):
    """{'tp': [forward, backward], 'cp': the same}, each a list of the (kind, bytes) all-reduces
    fp8.py makes in one block (the MAX of an amax over the ranks splitting what one process casts,
    and rowwise's sum_then_round), by its rule (fp8.py's top): a row-parallel layer splits its
    input features over tp (inner), a column-parallel one its output features (outer), cp the
    tokens. Tensorwise: W's scale over inner and outer, x's over inner and tokens, dy's over outer
    and tokens, once for each gradient product (each a scalar of the tensor's dtype; the weights
    fp32), x's and dy's per source rank under ep. Rowwise: the forward's (M, 1) and (N, 1) scales
    over inner; the input gradient's (M, 1) and (1, K) over outer and its fp32 (M, K) product
    summed there; the weight gradient's (1, N) and (1, K) over the tokens and its fp32 (N, K)
    product summed there, per source."""
    out = {"tp": [[], []], "cp": [[], []]}
    for M, K, N, kind, expert in linears:
        inner, outer, tokens = ("tp", None, "cp") if kind == "row" else (None, "tp", "cp")
        sources = run.ep if expert and run.ep > 1 else 1  # (an expert's rows, per source rank)
        if run.fp8 == "tensorwise":
            x, w, dy = [act_bytes] * sources, [4], [act_bytes] * sources
            wanted = [
                (0, [inner, outer], w),
                (0, [inner, tokens], x),
                (1, [outer, tokens], dy + dy),
            ]
        else:
            wanted = [
                (0, [inner], [M * act_bytes, N * 4]),
                (1, [outer], [M * act_bytes, K * 4, M * K * 4]),
                (1, [tokens], [N * act_bytes, K * act_bytes, N * K * 4] * sources),
            ]
        for side, groups, sizes in wanted:
            for group in groups:
                if group is not None and getattr(run, group) > 1:
                    out[group][side] += [("all_reduce", nbytes) for nbytes in sizes]
    return out


def matmul_seconds(model_cfg, run, machine, tokens):
    """Seconds of one of the three products (forward, input gradient, weight gradient: 2 FLOPs a
    weight and token each) of one block's matmuls on one rank for `tokens` tokens: metrics'
    FLOPs over tp at the machine's rate for the run's dtype, the FP8 linears' (fp8_linears: 2 M K N
    each) at its FP8 rate."""
    rate, rate8 = machine["matmul_flops"][dtype_of(run, machine)], fp8_rate(run, machine)
    _, blocks, _ = metrics.pipeline_costs(model_cfg)
    qk, v = attention_dims(model_cfg)
    attention = 6 * run.block_size * model_cfg.n_head * (qk + v)
    flops = tokens * (blocks[0] - attention) / 3 / run.tp
    fp8 = min(flops, sum(2 * M * K * N for M, K, N, *_ in fp8_linears(model_cfg, run, tokens)))
    return (flops - fp8) / rate + (fp8 / rate8 if fp8 else 0.0)


def add_collectives(comm, sent, extra, run, links):
    """Add collectives (extra: {mechanism: [forward, backward] lists of (kind, bytes)}, fp8's or a
    mixture's over cp) to a block's [forward, backward] seconds in comm and bytes in sent
    (block_seconds')."""
    for m, sides in extra.items():
        n = getattr(run, m)
        for side, collectives in enumerate(sides):
            comm[m][side] += sum(collective_seconds(*c, n, links[m]) for c in collectives)
            sent[m][side] += sum(sent_bytes(*c, n) for c in collectives)


def block_seconds(model_cfg, run, machine, links, tokens):
    """Seconds of one block on one rank for one micro-batch of `tokens` tokens (this rank's, after
    context parallelism's split): {'forward', 'input_grad', 'weight_grad'} of compute, the
    communication each leaves exposed, {'tp', 'cp', 'ep'} each [forward, backward] (the backward's
    with the recomputed forward's under activation checkpointing), and 'sent', the bytes this rank
    sends, {'tp', 'cp', 'ep'} the same. Matmuls:
    metrics.pipeline_costs' 6 FLOPs per weight and token (2 forward, 2 for the input's gradient, 2
    for the weights'), over tp, at the machine's matmul rate (matmul_seconds; under fp8 the FP8
    linears' at its FP8 rate, their casts and amax all-reduces added). Attention: its 6 T H (qk +
    v) FLOPs per token, with a fused kernel at the kernel's efficiency on the causal half it
    computes (FlashAttention-2 reports causal FLOP/s so, its backward 2.5 forwards), otherwise at
    the matmul rate on all of it. The rest: elementwise_bytes over the memory bandwidth."""
    dtype = dtype_of(run, machine)
    rate, act_bytes = machine["matmul_flops"][dtype], element_bytes(dtype)
    qk, v = attention_dims(model_cfg)
    attention = 6 * run.block_size * model_cfg.n_head * (qk + v)
    fused = fused_attention(model_cfg, run, machine)
    matmul_f = matmul_seconds(model_cfg, run, machine, tokens)
    linears = fp8_linears(model_cfg, run, tokens)
    cast_f, cast_i, cast_w = fp8_cast_seconds(run, machine, linears, act_bytes)
    # the eager attention computes every score and masks half; the zigzag ring skips the blocks no
    # query sees: the causal half and its 2 cp diagonal blocks' other half, of 2 cp x 2 cp
    unfused = 1.0 if run.cp == 1 else 0.5 + 1 / (4 * run.cp)
    attention_rate = rate * machine["attention_efficiency"] * 2 if fused else rate / unfused
    attention_f = tokens * attention / 3 / run.tp / attention_rate
    # a fused kernel's backward recomputes the scores: 2.5 forwards' FLOPs (FlashAttention-2's
    # count, in which its efficiency is reported), where the unfused backward is two
    attention_b = attention_f * (2.5 if fused else 2)
    elementwise_f = (
        tokens * elementwise_bytes(model_cfg, run, fused, act_bytes) / machine["memory_bw"]
    )
    # tensor parallelism's two regions a block copy their activations, forward and backward alike
    # (parallel.py): g clones its input for the in-place all-reduce, f its gradient (2a per
    # element); under SP the all-gather writes through the library's flat buffer, then
    # concatenates (4a), the reduce-scatter moves the sequence to the front (2a) and adds the
    # received piece (3a / tp)
    per_region = (6 + 3 / run.tp if run.sequence_parallel else 2) * (run.tp > 1)
    copies = tokens * 2 * per_region * act_bytes * model_cfg.n_embd / machine["memory_bw"]
    tp_collectives = tp_block_collectives(model_cfg, run, tokens, act_bytes)
    tp = sum(collective_seconds(*c, run.tp, links["tp"]) for c in tp_collectives)
    tp_sent = sum(sent_bytes(*c, run.tp) for c in tp_collectives)
    cp, cp_sent = ring_seconds(model_cfg, run, machine, links, tokens, act_bytes, attention_f)
    ep, ep_sent = expert_exchange_seconds(model_cfg, run, links, tokens, act_bytes)
    comm = {"tp": [tp, tp], "cp": cp, "ep": ep}
    sent = {"tp": [tp_sent, tp_sent], "cp": cp_sent, "ep": ep_sent}
    add_collectives(comm, sent, fp8_collectives(run, linears, act_bytes), run, links)
    add_collectives(comm, sent, expert_window_collectives(model_cfg, run, tokens), run, links)
    if run.activation_checkpointing:
        # (a dense block's last collective, the MLP's; a mixture of experts' outputs are saved)
        last = tp_collectives[-1] if model_cfg.n_expert == 0 else ("all_reduce", 0)
        last_sent = (collective_seconds(*last, run.tp, links["tp"]), sent_bytes(*last, run.tp))
        recompute_communication(comm, sent, last_sent)
    ops_f, ops_b = host_seconds(model_cfg, run, machine)
    # compute only (stage_actions adds the communication)
    forward = matmul_f + cast_f + attention_f + elementwise_f + copies + ops_f
    recompute = forward if run.activation_checkpointing else 0.0
    backward = matmul_f + cast_i + attention_b + 2 * elementwise_f + copies + ops_b
    return {
        "forward": forward,
        "input_grad": backward + recompute,
        "weight_grad": matmul_f + cast_w,
        **comm,
        "sent": sent,
    }


def tp_block_collectives(model_cfg, run, tokens, act_bytes):
    """[(kind, bytes)] of the tensor-parallel collectives of one block's forward (its backward sends
    the same bytes), in order (tensor_parallel.py): attention's output all-reduced (g), or under
    sequence parallelism its input all-gathered and its output reduce-scattered; then the MLP's
    alike. A mixture of experts is a replicated region (under SP its input all-gathered, its output
    sliced) in which each expert, and each shared expert, all-reduces its output rows: the kept
    assignments (expert_rows) and every token per shared expert, priced as one all-reduce."""
    region = tokens * model_cfg.n_embd * act_bytes
    sp = [("all_gather", region), ("reduce_scatter", region)]
    dense = sp if run.sequence_parallel else [("all_reduce", region)]
    if model_cfg.n_expert == 0:
        return dense + dense
    kept, _ = expert_rows(model_cfg, tokens)
    rows = kept + model_cfg.n_shared_expert * tokens
    experts = [("all_reduce", rows * model_cfg.n_embd * act_bytes)]
    return dense + (sp[:1] if run.sequence_parallel else []) + experts


def recompute_communication(comm, sent, last_tp):
    """Under activation checkpointing, add to a block's backward ([1] of each of block_seconds'
    [forward, backward] seconds in `comm` and bytes in `sent`) what its recomputed forward sends:
    the forward's, but for the block's last tp collective (last_tp: its seconds and bytes), the
    MLP's all-reduce (under SP its reduce-scatter). torch's non-reentrant checkpoint stops the
    recomputation once every tensor the backward saved is back (its early stop), and no backward
    saves that collective's output; the ring's and the experts' exchanges all feed saved tensors."""
    for m in comm:
        seconds, nbytes = last_tp if m == "tp" else (0.0, 0)
        comm[m][1] += comm[m][0] - seconds
        sent[m][1] += sent[m][0] - nbytes


def ends_seconds(model_cfg, run, machine, links, tokens):
    """(embedding, head) seconds for one micro-batch: {'forward', 'input_grad', 'weight_grad'} of
    compute, 'tp' and 'cp' [forward, backward] and 'sent' {'tp', 'cp'}: the bytes this rank sends,
    the same. Under cp the head's loss sums its token count over the cp ranks forward
    (context_parallel.loss_share). The embedding: a lookup (its rows written), under tp the
    vocab-parallel embedding's all-reduce forward (under SP a reduce-scatter, whose backward
    all-gathers). The head: 6 C V FLOPs per token over tp (metrics.pipeline_costs') and the loss's
    fp32 softmax read and written forward and backward (under tp machine=auto's timed kernels,
    machines.loss_seconds); all in the forward under the chunked loss (tp = 1:
    model.ChunkedLinearCrossEntropy, whose backward scales the gradients); under tp the
    vocab-parallel loss's three all-reduces of a float per token forward and f's all-reduce of the
    head's input gradient backward (under SP the final norm's all-gather forward and reduce-scatter
    backward instead)."""
    dtype = dtype_of(run, machine)
    rate, act_bytes = machine["matmul_flops"][dtype], element_bytes(dtype)
    C = model_cfg.n_embd
    _, _, head = metrics.pipeline_costs(model_cfg)
    lookup = tokens * C * act_bytes / machine["memory_bw"]
    activations = collective_seconds("all_reduce", tokens * C * act_bytes, run.tp, links["tp"])
    half = activations / 2  # (a reduce-scatter or an all-gather)
    # (a reduce-scatter sends what an all-gather of the same buffer does)
    sent, half_sent = (
        sent_bytes(kind, tokens * C * act_bytes, run.tp) for kind in ("all_reduce", "all_gather")
    )
    embedding = {
        "forward": lookup,
        "input_grad": 2 * lookup,
        "weight_grad": 0.0,
        "tp": [half, half] if run.sequence_parallel else [activations, 0.0],
        "cp": [0.0, 0.0],
        "sent": {
            "tp": [half_sent, half_sent] if run.sequence_parallel else [sent, 0],
            "cp": [0, 0],
        },
    }
    matmul = tokens * head / 3 / run.tp / rate
    softmax = tokens * 2 * model_cfg.vocab_size / run.tp * 4 / machine["memory_bw"]
    loss_f, loss_b = (
        [tokens * -(-model_cfg.vocab_size // run.tp) * s for s in machine["loss_seconds"]]
        if run.tp > 1 and "loss_seconds" in machine
        else (softmax, softmax)
    )
    ops_f, ops_b = (n * machine.get("op_seconds", 0.0) for n in OPS_AT_ENDS)
    loss = 3 * collective_seconds("all_reduce", tokens * wide_bytes(run), run.tp, links["tp"])
    tp = [loss + half, half] if run.sequence_parallel else [loss, activations]
    loss_sent = 3 * sent_bytes("all_reduce", tokens * wide_bytes(run), run.tp)
    tp_sent = [loss_sent + half_sent, half_sent] if run.sequence_parallel else [loss_sent, sent]
    # under cp the loss's token count: one int64 summed over the cp ranks
    count = collective_seconds("all_reduce", 8, run.cp, links["cp"]) if run.cp > 1 else 0.0
    count_sent = sent_bytes("all_reduce", 8, run.cp)
    chunked = run.chunked_loss and run.tp == 1
    # the chunked loss's backward scales its two gradients (each read and written, fp32)
    scale = (tokens + model_cfg.vocab_size) * C * 8 / machine["memory_bw"]
    head = (
        {
            "forward": 3 * matmul + 2 * softmax + ops_f,
            "input_grad": scale + ops_b,
            "weight_grad": 0.0,
        }
        if chunked
        else {
            "forward": matmul + loss_f + ops_f,
            "input_grad": matmul + loss_b + ops_b,
            "weight_grad": matmul,
        }
    )
    cp = {"cp": [count, 0.0], "sent": {"tp": tp_sent, "cp": [count_sent, 0]}}
    return embedding, {**head, "tp": tp, **cp}


# -----------------------------------------------------------------------------
# The pipeline: every rank's actions placed in time


# (schedule, pp, m, chunks): schedule_lists' answer, found once (the routing costs most)
_SCHEDULES = {}


def schedule_lists(run):
    """(each rank's actions, each rank's model stages, their routes for simulate_pipeline): the
    schedule's own lists, or without a pipeline each micro-batch's forward then backward."""
    m = run.gradient_accumulation_steps
    key = (run.pp_schedule, run.pp, m, run.pp_chunks)
    if key not in _SCHEDULES:
        if run.pp == 1:
            lists, stages = [[(op, i, 0) for i in range(m) for op in "FB"]], [(0,)]
        else:
            lists = [SCHEDULES[run.pp_schedule](run.pp, r, m, run.pp_chunks) for r in range(run.pp)]
            stages = [
                virtual_stages(run.pp_schedule, run.pp, r, run.pp_chunks) for r in range(run.pp)
            ]
        sent, expected, needs = route_messages("the step-time simulation", lists, stages)
        check_channels("the step-time simulation", sent, expected)
        _SCHEDULES[key] = lists, stages, (sent, needs)
    return _SCHEDULES[key]


def stage_actions(model_cfg, run, machine, links, cut, zero3):
    """{model stage: {op: (seconds, {part: seconds}, {mechanism: bytes this rank sends})}} of one
    micro-batch's F, B and W on each model stage: its blocks, the embedding on the first, the head
    and loss on the last; B is the whole backward where the schedule does not split it (no W).
    zero3: zero3_block_seconds', ZeRO-3's (gather, reduce-scatter) of one block's parameters, which
    prefetches the next block's gather while this one computes (forward and backward)."""
    tokens = run.batch_size * run.block_size // run.cp
    block = block_seconds(model_cfg, run, machine, links, tokens)
    (gather, reduce), zero3_sent = zero3
    hide = machine["overlaps"]
    zero3 = (
        max(0.0, gather - block["forward"] * hide),
        max(0.0, gather + reduce - (block["input_grad"] + block["weight_grad"]) * hide),
    )
    embedding, head = ends_seconds(model_cfg, run, machine, links, tokens)
    split = run.pp > 1 and run.pp_schedule in ("zero_bubble", "zbv")
    out = {}
    for s, n in enumerate(cut):
        ends = ([embedding] if s == 0 else []) + ([head] if s == len(cut) - 1 else [])
        f = {
            "compute": n * block["forward"] + sum(e["forward"] for e in ends),
            "tp": n * block["tp"][0] + sum(e["tp"][0] for e in ends),
            "cp": n * block["cp"][0] + sum(e["cp"][0] for e in ends),
            "ep": n * block["ep"][0],
            "zero": n * zero3[0],
        }
        w = {"compute": n * block["weight_grad"] + sum(e["weight_grad"] for e in ends)}
        b = {
            "compute": n * block["input_grad"]
            + sum(e["input_grad"] for e in ends)
            + (0 if split else w["compute"]),
            "tp": n * block["tp"][1] + sum(e["tp"][1] for e in ends),
            "cp": n * block["cp"][1],
            "ep": n * block["ep"][1],
            "zero": n * zero3[1],
        }
        sent = block["sent"]
        sent_f = {m: n * sent[m][0] for m in ("tp", "cp", "ep")}
        sent_b = {m: n * sent[m][1] for m in ("tp", "cp", "ep")}
        for m in ("tp", "cp"):  # (the ends run no expert)
            sent_f[m] += sum(e["sent"][m][0] for e in ends)
            sent_b[m] += sum(e["sent"][m][1] for e in ends)
        sent_f["dp"], sent_b["dp"] = n * zero3_sent[0], n * sum(zero3_sent)
        out[s] = {
            op: (sum(parts.values()), parts, sent)
            for op, parts, sent in (("F", f, sent_f), ("B", b, sent_b), ("W", w, {}))
        }
    return out


# -----------------------------------------------------------------------------
# Data parallelism and ZeRO: the buckets' collectives, overlapped where the code overlaps them


def rank_pieces(model_cfg, run, cut, held):
    """[(elements, whether of an expert, kind)] of the parameters a pipeline rank holds (held: its
    model stages), in forward order: the embedding on the first stage, each block's tensors, the
    final norm and head on the last. kind: 'muon' a block's matrix Muon updates (model.takes_muon),
    'block' the rest of a block, 'root' the rest, 'tied_copy' one copy of a tied embedding whose
    other copy is on another stage, 'both_ends' a tied embedding-and-head that the rank holds as
    both (zbv's rank 0), whose gradient two backward actions write."""
    (block, root), _, muon = _pieces(model_cfg, run.tp, run.ep)
    embedding = [n for name, n in root.items() if name.startswith("tok_emb.")]
    last = len(cut) - 1
    tied = model_cfg.tie_embeddings and last > 0
    ends = ("both_ends" if last in held else "tied_copy") if tied else "root"
    muon = muon if run.optimizer == "muon" else {}
    pieces = []
    for s in sorted(held):
        pieces += [(n, False, ends) for n in embedding] if s == 0 else []
        for _ in stage_layers(cut, s):
            pieces += [
                (n, ".experts." in name, "muon" if name in muon else "block")
                for name, n in block.items()
            ]
        if s == last:
            pieces += [
                (n, False, "root") for name, n in root.items() if not name.startswith("tok_emb.")
            ]
            pieces += [(n, False, "tied_copy") for n in embedding] if tied and 0 not in held else []
    return pieces


def muon_matrices(model_cfg, run, cut, held):
    """[(full shape, elements on this tp rank, replicas, owner)] of the matrices Muon updates on a
    pipeline rank holding model stages `held`, in the model's order. Under ZeRO each is dealt whole
    over the `replicas` ranks that hold it, dp x cp (an expert's under ep > 1: its own replicas,
    dp / ep x cp, which a reducer of their own deals): owner is the rank of them that steps it
    (optim.muon_buckets' deal: deal_whole of each reducer's matrices in backward order, by their
    Newton-Schulz work); without ZeRO None: every rank does. [] under AdamW."""
    if run.optimizer != "muon":
        return []
    (block, _), _, shapes = _pieces(model_cfg, run.tp, run.ep)
    replicas = lambda name: (  # noqa: E731
        run.dp // run.ep * run.cp if run.ep > 1 and ".experts." in name else run.dp * run.cp
    )
    matrices = [
        (shapes[name], block[name], replicas(name))
        for s in sorted(held)
        for _ in stage_layers(cut, s)
        for name in shapes
    ]
    if run.zero_stage == 0:
        return [(*m, None) for m in matrices]
    stand_ins = [torch.empty(shape, device="meta") for shape, _, _ in matrices]
    owners = {}
    for n in {n for _, _, n in matrices}:
        owners.update(
            deal_whole(reversed([t for t, m in zip(stand_ins, matrices) if m[2] == n]), n)
        )
    return [(*m, owners[t]) for m, t in zip(matrices, stand_ins)]


def replica_rank(run, replicas):
    """run.dp_rank's rank among the `replicas` ranks holding a parameter: dp x cp, or an expert's
    dp / ep x cp (parallel.expert_groups: the dp ranks at its place in each ep block)."""
    rank = getattr(run, "dp_rank", 0)
    if replicas == run.dp * run.cp:
        return rank
    dp_rank, cp_rank = divmod(rank, run.cp)
    return dp_rank // run.ep * run.cp + cp_rank


def muon_tp_seconds(matrices, run, machine, link):
    """(seconds, bytes this rank sends) of Muon's tensor-parallel exchanges in its step
    (optim.Muon), tp rank 0's, of the matrices data-parallel rank run.dp_rank steps (muon_matrices':
    all, or its own) that tp splits (fewer elements here than their full shape), by muon_tp_mode:
    'replicate' an all-gather of each one's slices; 'split' a gather of its slices to its tp owner
    (optim.deal_tp: deal_whole over the tp ranks, in the model's order) and a scatter back, a
    non-owner sending its slice, the owner tp - 1 of them; 'auto' split where optim.split_pays, at
    the machine's fp32 rate and tp link (the run decides at its own device's)."""
    wide, tp = wide_bytes(run), run.tp
    sliced = [
        (shape, n)
        for shape, n, replicas, owner in matrices
        if owner in (None, replica_rank(run, replicas)) and n < math.prod(shape)
    ]
    if tp == 1 or not sliced:
        return 0.0, 0
    mode, steps = getattr(run, "muon_tp_mode", "replicate"), getattr(run, "muon_ns_steps", 5)
    rates = dict(link, flops=machine["matmul_flops"].get("float32"))

    def pays(shape):
        if mode == "auto" and rates["flops"]:
            return split_pays(shape, wide, rates, steps)
        return mode == "split"

    dealt = [pays(shape) for shape, _ in sliced]
    stand_ins = [torch.empty(shape, device="meta") for (shape, _), d in zip(sliced, dealt) if d]
    owners = iter(deal_whole(stand_ins, tp).values())
    seconds, sent = 0.0, 0
    for (shape, n), split in zip(sliced, dealt):
        whole = math.prod(shape) * wide
        # (each a ring's time: the all-gather, or the gather and then the scatter)
        seconds += (2 if split else 1) * collective_seconds("all_gather", whole, tp, link)
        if split:
            sent += n * wide * (tp - 1 if next(owners) == 0 else 1)
        else:
            sent += sent_bytes("all_gather", whole, tp)
    return seconds, sent


def padded(elements, ranks):
    """A ZeRO bucket's (or ZeRO-3 unit's) elements as it sends them: padded to a multiple of the
    ranks that share it, so each holds an equal slice (parallel.ShardedBucket)."""
    return -(-elements // ranks) * ranks


def bucket_capacity(run):
    """A gradient bucket's elements: it closes once it holds bucket_size_mb (parallel.py)."""
    return -(-max(1, int(run.bucket_size_mb * 2**20)) // wide_bytes(run))


def bucket_collectives(pieces, run, link, kind):
    """[(elements, seconds, bytes this rank sends)] of each bucket's collective in backward order
    (memory_plan.bucket_elements: parallel.GradientBuckets' plan), the experts' buckets after the
    dense ones', over their own replicas. Gradients travel in the parameters' dtype (fp32); under
    ZeRO (a reduce-scatter, an all-gather) each bucket padded to slice evenly."""
    wide, out = wide_bytes(run), []
    for expert, n in ((False, run.dp * run.cp), (True, run.dp // run.ep * run.cp)):
        sizes = memory_plan.bucket_elements(
            [e for e, is_expert, _ in pieces if is_expert == expert], bucket_capacity(run)
        )
        sizes = sizes if kind == "all_reduce" else [padded(size, n) for size in sizes]
        out += [
            (size, collective_seconds(kind, size * wide, n, link), sent_bytes(kind, size * wide, n))
            for size in sizes
        ]
    return out


def whole_matrix_collectives(matrices, run, link, kind):
    """[(elements, seconds, bytes this rank sends)] of Muon's buckets under ZeRO-1/2
    (muon_matrices dealt: optim.WholeMatrixBuckets, zero.GradientShards' WholeBuckets), each
    owner's matrices in buckets of their own filled in backward order, reduced whole to the owner
    ('reduce') or broadcast from it after the step ('broadcast'): every rank sends the whole bucket
    either way. (ZeRO-2 also closes a bucket where the backward action changes: no byte moves.)"""
    wide, out = wide_bytes(run), []
    for ranks, owner in sorted({(r, o) for _, _, r, o in matrices}):
        mine = [n for _, n, r, o in matrices if (r, o) == (ranks, owner)]
        for size in memory_plan.bucket_elements(mine, bucket_capacity(run)):
            nbytes = size * wide
            out.append(
                (
                    size,
                    collective_seconds(kind, nbytes, ranks, link),
                    sent_bytes(kind, nbytes, ranks),
                )
            )
    return out


def overlapped(collectives, window, overlaps):
    """The seconds a series of collectives runs past the end of a compute window they overlap: each
    starts when its bucket is ready (the buckets fill evenly over the window, in the order given)
    and the one before it has ended (one channel). Without overlap, all of them."""
    total = sum(seconds for _, seconds, _ in collectives)
    if not overlaps:
        return total
    elements, done, end = sum(n for n, _, _ in collectives) or 1, 0, 0.0
    for n, seconds, _ in collectives:
        done += n
        end = max(end, window * done / elements) + seconds
    return max(0.0, end - window)


def gathered_late(collectives, forward, overlaps):
    """ZeRO-1/2's parameter all-gathers, posted together after the optimizer step
    (overlap_param_gather) and each waited for before its bucket's first use in the next forward:
    the seconds the forward waits, the buckets used in forward order (the reverse of the backward's)
    through `forward` seconds of compute."""
    if not overlaps:
        return sum(seconds for _, seconds, _ in collectives)
    order = list(reversed(collectives))
    elements, used, end, late = sum(n for n, _, _ in order) or 1, 0, 0.0, 0.0
    for n, seconds, _ in order:
        end += seconds
        late = max(late, end - forward * used / elements)
        used += n
    return max(0.0, late)


def data_parallel_seconds(pieces, matrices, run, machine, link, timing):
    """(exposed seconds of the gradients' reduction, of ZeRO-1/2's parameter gather, the bytes this
    rank sends in both) on one rank (pieces: rank_pieces'; matrices: muon_matrices'; timing:
    rank_timing's windows).
    ZeRO-0: each bucket all-reduced in the last micro-batch's backward (the reducer communicates
    only then), overlapped with it. ZeRO-1: reduce-scattered so. ZeRO-2: reduce-scattered in every
    micro-batch's backward, the earlier ones overlapped with the backward and the next forward too.
    ZeRO-1/2: every bucket's parameters all-gathered after the step, ahead of the next forward;
    Muon's matrices reduced whole to their owners and broadcast from them instead
    (whole_matrix_collectives). A tied embedding's copy is alone in its bucket; under ZeRO-2 one a
    rank holds as both ends is sent after each of the two actions that write it (zero.py).
    ZeRO-3: its blocks' gathers and reduce-scatters are in the actions (stage_actions); here its
    root units' (zero3_root_seconds)."""
    if run.dp * run.cp == 1:
        return 0.0, 0.0, 0
    if run.zero_stage == 3:
        return zero3_root_seconds(pieces, run, link)
    overlaps, whole = machine["overlaps"], run.zero_stage in (1, 2) and bool(matrices)
    kind = "all_reduce" if run.zero_stage == 0 else "reduce_scatter"
    apart = ("tied_copy", "both_ends") + (("muon",) if whole else ())
    parts = [[p for p in pieces if p[2] not in apart]] + [
        [p] for p in pieces if p[2] in ("tied_copy", "both_ends")
    ]
    sends = lambda part: 2 if run.zero_stage == 2 and part[0][2] == "both_ends" else 1  # noqa: E731
    buckets = [b for part in parts for b in sends(part) * bucket_collectives(part, run, link, kind)]
    buckets += whole_matrix_collectives(matrices, run, link, "reduce") if whole else []
    reduce = overlapped(buckets, timing["last_window"], overlaps)
    sent = sum(b for _, _, b in buckets)
    if run.zero_stage == 2:
        earlier = overlapped(buckets, timing["micro_window"], overlaps)
        reduce += (run.gradient_accumulation_steps - 1) * earlier
        sent *= run.gradient_accumulation_steps  # (every micro-batch's)
    gather = 0.0
    if run.zero_stage in (1, 2):
        gathers = [b for part in parts for b in bucket_collectives(part, run, link, "all_gather")]
        gathers += whole_matrix_collectives(matrices, run, link, "broadcast") if whole else []
        gather = gathered_late(gathers, timing["forward"], overlaps and run.overlap_param_gather)
        sent += sum(b for _, _, b in gathers)
    return reduce, gather, sent


def zero3_root_seconds(pieces, run, link):
    """(exposed seconds of the reduce-scatters, of the gather, the bytes this rank sends) of
    ZeRO-3's root units (zero.zero3_units: the embedding, final norm and head this rank holds, a
    tied copy in a unit of its own): gathered before the first forward, kept whole until the
    optimizer step; their gradients, sharded as ZeRO-2's, reduce-scattered after each micro-batch's
    backward, a tied matrix the rank holds as both ends after each of the two actions that write
    it."""
    m, ranks, wide = run.gradient_accumulation_steps, run.dp * run.cp, wide_bytes(run)
    reduce, gather, sent = 0.0, 0.0, 0
    for kind, sends in (("root", 1), ("tied_copy", 1), ("both_ends", 2)):
        elements = sum(n for n, _, k in pieces if k == kind)
        if elements:
            n = padded(elements, ranks) * wide
            reduce += sends * m * collective_seconds("reduce_scatter", n, ranks, link)
            gather += collective_seconds("all_gather", n, ranks, link)
            sent += sends * m * sent_bytes("reduce_scatter", n, ranks)
            sent += sent_bytes("all_gather", n, ranks)
    return reduce, gather, sent


# -----------------------------------------------------------------------------
# The step


_CUTS = {}  # build.stage_cut's answers (the model config is not hashable)


def stage_cut(model_cfg, run):
    """The blocks of each model stage, as train.py cuts them (build.stage_cut)."""
    key = (repr(model_cfg), run.pp_schedule, run.pp, run.pp_chunks, run.pp_layers)
    if key not in _CUTS:
        _CUTS[key] = (
            build.stage_cut(model_cfg, run.pp_schedule, run.pp, run.pp_chunks, run.pp_layers)
            if run.pp > 1
            else (model_cfg.n_layer,)
        )
    return _CUTS[key]


def layout_links(machine, run, gpus_per_node):
    """The link each group spans: tp, cp, the data-parallel dp x cp, pp, and ep (ep neighbouring dp
    ranks)."""
    dims = (run.dp, run.cp, run.tp, run.pp)
    links = {
        name: group_link(machine, dims, axes, gpus_per_node)
        for name, axes in (("tp", ("tp",)), ("cp", ("cp",)), ("dp", ("dp", "cp")), ("pp", ("pp",)))
    }
    links["ep"] = group_link(machine, (run.ep, run.cp, run.tp, run.pp), ("dp",), gpus_per_node)
    return links


def zero3_block_seconds(model_cfg, run, link):
    """((gather, reduce) seconds, the same in bytes this rank sends) of one block's parameters
    under ZeRO-3: the dense part over dp x cp, the experts over their replicas, each all-gathered
    and reduce-scattered, padded to slice evenly; under Muon the block's matrices dealt whole
    (muon_matrices; zero.by_owner's units), broadcast from their owner and reduced to it, every
    rank sending each whole."""
    if run.zero_stage != 3 or run.dp * run.cp == 1:
        return (0.0, 0.0), (0, 0)
    (block, _), _, shapes = _pieces(model_cfg, run.tp, run.ep)
    whole = shapes if run.optimizer == "muon" else {}
    wide, seconds, sent = wide_bytes(run), [0.0, 0.0], [0, 0]
    for expert, ranks in ((False, run.dp * run.cp), (True, run.dp // run.ep * run.cp)):
        names = [name for name in block if (".experts." in name) == expert]
        sliced = padded(sum(block[n] for n in names if n not in whole), ranks)
        dealt = sum(block[n] for n in names if n in whole)
        for side, kinds in enumerate((("all_gather", "broadcast"), ("reduce_scatter", "reduce"))):
            for kind, n in zip(kinds, (sliced, dealt)):
                seconds[side] += collective_seconds(kind, n * wide, ranks, link)
                sent[side] += sent_bytes(kind, n * wide, ranks)
    return seconds, sent


def rank_timing(r, lists, stages, times, times_without, actions):
    """One rank's {'end', 'busy' {part: seconds}, 'bubble', 'pp', 'last_window', 'micro_window',
    'forward', 'sent' {mechanism: bytes its actions send}} from the simulation (times_without: the
    same without the pipeline's transfers)."""
    last = len(lists[r]) - 1  # (a rank's actions run in its list's order)
    busy, sent = {}, {}
    end, end_without = times[(r, last)][1], times_without[(r, last)][1]
    m = max(i for _, i, _ in lists[r])
    first_last = min(
        times[(r, k)][0] for k, (op, i, _) in enumerate(lists[r]) if op != "F" and i == m
    )
    for op, c in {(op, c) for op, _, c in lists[r]}:  # each chunk runs each op once per micro-batch
        _, parts, sends = actions[stages[r][c]][op]
        for part, seconds in parts.items():
            busy[part] = busy.get(part, 0.0) + seconds * (m + 1)
        for mechanism, nbytes in sends.items():
            sent[mechanism] = sent.get(mechanism, 0) + nbytes * (m + 1)
    of = lambda op: sum(actions[s][op][0] for s in stages[r])
    split = any(op == "W" for op, _, _ in lists[r])  # (where B is not split, B holds W's work)
    return {
        "end": end,
        "busy": busy,
        "bubble": end_without - sum(busy.values()),
        "pp": end - end_without,
        "last_window": end - first_last,
        "micro_window": of("F") + of("B") + of("W") * split,
        "forward": of("F"),
        "sent": sent,
    }


def pipeline_sent(routes, r, message):
    """The bytes pipeline rank r sends its neighbours in a step: `message` bytes (a micro-batch's
    activations, or their gradient) for each of the schedule's messages that leave the rank
    (tools/timeline.route_messages; a chunk's output bound for another chunk of the same rank is
    handed over in memory)."""
    sent, _ = routes
    return message * sum(len(messages) for (source, _, _), messages in sent.items() if source == r)


def tied_seconds(model_cfg, run, cut, held, link):
    """(seconds, bytes this rank sends) of parallel.sync_tied_grads' all-reduce of the tied
    embedding's two copies' gradients, on a pipeline rank holding model stages `held`: only where
    it holds one copy and another rank the other (a rank holding both, as ZB-V's first rank does,
    sums them in memory). Under ZeRO-2/3 the reducer sums only this rank's shard of it, its copy
    alone in a bucket (zero.GradientShards.finish)."""
    first, last = 0 in held, len(cut) - 1 in held
    if not (run.pp > 1 and model_cfg.tie_embeddings and first != last):
        return 0.0, 0
    _, root = parameter_pieces(model_cfg, run.tp, run.ep)
    copy = sum(n for name, n in root.items() if name.startswith("tok_emb."))
    if run.zero_stage >= 2:
        copy = padded(copy, run.dp * run.cp) // (run.dp * run.cp)
    nbytes = wide_bytes(run) * copy
    return collective_seconds("all_reduce", nbytes, 2, link), sent_bytes("all_reduce", nbytes, 2)


def once_a_step(model_cfg, run, machine, links, cut, held, timing):
    """A pipeline rank's communication outside its actions (held: its model stages): the gradients'
    reduction and ZeRO-1/2's gather (data_parallel_seconds), the tied embedding's sum (tied_seconds)
    and the sum over tp (tp_summed_seconds), their seconds added to its `timing` (rank_timing's) as
    'dp', 'zero_gather', 'tied' and 'tp_summed', their bytes to its 'sent'."""
    pieces = rank_pieces(model_cfg, run, cut, held)
    matrices = muon_matrices(model_cfg, run, cut, held)
    timing["dp"], timing["zero_gather"], dp_sent = data_parallel_seconds(
        pieces, matrices, run, machine, links["dp"], timing
    )
    timing["tied"], tied_sent = tied_seconds(model_cfg, run, cut, held, links["pp"])
    timing["tp_summed"], tp_sent = tp_summed_seconds(model_cfg, run, cut, held, links["tp"])
    # (Muon's tp exchanges run inside its step)
    muon_tp, muon_sent = muon_tp_seconds(matrices, run, machine, links["tp"])
    timing["optimizer"] = optimizer_seconds(pieces, run, machine) + muon_tp
    sent = timing["sent"]
    for mechanism, nbytes in (("dp", dp_sent), ("pp", tied_sent), ("tp", tp_sent + muon_sent)):
        sent[mechanism] = sent.get(mechanism, 0) + nbytes
    return timing


def predict(model_cfg, run, machine, gpus_per_node=None):
    """One step's predicted seconds and its parts, for the slowest pipeline rank: {'step_s', 'parts'
    {'compute', 'bubble', 'tp', 'cp', 'ep', 'pp', 'dp', 'zero_gather', 'optimizer'} in seconds,
    'tokens_per_sec_per_gpu', 'mfu', 'comm_bytes' {'tp', 'cp', 'ep', 'pp', 'dp'}: the bytes rank 0
    sends in the step by nccl-tests' accounting (the bytes priced above; ledger.py books a run's
    so), 'machine', 'timeline': what the simulation placed (rank_spans)}. run: run_of's fields."""
    gpus_per_node = gpus_per_node or machine["gpus_per_node"]
    links = layout_links(machine, run, gpus_per_node)
    cut = stage_cut(model_cfg, run)
    actions = stage_actions(
        model_cfg, run, machine, links, cut, zero3_block_seconds(model_cfg, run, links["dp"])
    )
    lists, stages, routes = schedule_lists(run)
    dtype = dtype_of(run, machine)
    tokens = run.batch_size * run.block_size // run.cp
    message = (
        tokens * model_cfg.n_embd * element_bytes(dtype) // (run.tp if run.sequence_parallel else 1)
    )
    seconds = lambda r, a: actions[stages[r][a[2]]][a[0]][0]  # noqa: E731
    transfer = p2p_seconds(message, links["pp"]) if run.pp > 1 else 0.0
    times = simulate_pipeline(lists, stages, seconds, transfer, routes)
    times_without = simulate_pipeline(lists, stages, seconds, 0.0, routes) if run.pp > 1 else times
    ranks = []
    for r in range(len(lists)):
        timing = rank_timing(r, lists, stages, times, times_without, actions)
        timing["sent"]["pp"] = pipeline_sent(routes, r, message) if run.pp > 1 else 0
        once_a_step(model_cfg, run, machine, links, cut, stages[r], timing)
        timing["total"] = sum(
            timing[k] for k in ("end", "tied", "tp_summed", "dp", "zero_gather", "optimizer")
        )
        ranks.append(timing)
    prediction = summarize(model_cfg, run, machine, dtype, ranks)
    # what the simulation placed, kept for rank_spans (the step drawn: --trace)
    prediction["timeline"] = {
        "lists": lists,
        "stages": stages,
        "times": times,
        "actions": actions,
        "ranks": ranks,
        "transfer": transfer,
    }
    return prediction


def optimizer_seconds(pieces, run, machine):
    """AdamW's step over the elements this rank steps (all of its stage's, or under ZeRO its 1/dp
    shard, the experts' over their replicas), by the bytes it moves: torch's fused kernel reads the
    parameter, its gradient and the two moments and writes three of them back (7 x 4 bytes), and the
    gradient norm reads the gradient once more (4): 32 bytes an element over the memory bandwidth.
    """
    shards = (run.dp * run.cp, run.dp // run.ep * run.cp) if run.zero_stage >= 1 else (1, 1)
    stepped = sum(n / shards[expert] for n, expert, _ in pieces)
    return stepped * 32 / machine["memory_bw"]


def summarize(model_cfg, run, machine, dtype, ranks):
    """predict's answer from every pipeline rank's timing: the step is the slowest rank's, its parts
    the busiest rank's (the one with the most work), whose idle time in the step is the bubble."""
    step = max(t["total"] for t in ranks)
    busiest = max(ranks, key=lambda t: sum(t["busy"].values()))
    busy = busiest["busy"]
    parts = {
        "compute": busy.get("compute", 0.0),
        "tp": busy.get("tp", 0.0) + busiest["tp_summed"],
        "cp": busy.get("cp", 0.0),
        "ep": busy.get("ep", 0.0),
        "pp": busiest["pp"] + busiest["tied"],
        "dp": busiest["dp"] + busy.get("zero", 0.0),
        "zero_gather": busiest["zero_gather"],
        "optimizer": busiest["optimizer"],
    }
    parts["bubble"] = max(0.0, step - sum(parts.values()))
    world = run.dp * run.cp * run.tp * run.pp
    tokens_per_step = run.batch_size * run.gradient_accumulation_steps * run.dp * run.block_size
    peak = machine.get("peak_flops", machine["matmul_flops"]).get(dtype)
    flops = metrics.flops_per_token(model_cfg) * tokens_per_step / step
    return {
        "step_s": step,
        "parts": parts,
        # (global rank 0 is pipeline rank 0: the layout numbers the pipeline's ranks slowest)
        "comm_bytes": {m: ranks[0]["sent"].get(m, 0) for m in ("dp", "tp", "cp", "ep", "pp")},
        "tokens_per_sec_per_gpu": tokens_per_step / step / world,
        "mfu": flops / (world * peak) if peak else None,
        "dtype": dtype,
        "machine": {k: v for k, v in machine.items()},
    }


def format_prediction(prediction, run):
    """The prediction as lines: the step, its parts (each with its share), the bytes rank 0 sends
    per mechanism, tokens/s per device and MFU."""
    step, parts = prediction["step_s"], prediction["parts"]
    names = {
        "compute": "compute",
        "bubble": "pipeline bubble",
        "tp": "TP communication (exposed)",
        "cp": "CP ring (exposed)",
        "ep": "EP all-to-all (exposed)",
        "pp": "PP transfers (exposed)",
        "dp": "DP/ZeRO reduction (exposed)",
        "zero_gather": "ZeRO parameter gather (exposed)",
        "optimizer": "optimizer step",
    }
    lines = [
        f"predicted step: {step * 1e3:,.1f} ms on {prediction['machine'].get('description', '?')} "
        f"({prediction['dtype']}); layout dp {run.dp} x cp {run.cp} x tp {run.tp} x pp {run.pp} "
        f"x ep {run.ep}, "
        f"ZeRO-{run.zero_stage}, micro-batch {run.batch_size} x {run.gradient_accumulation_steps}"
        + (
            f", {run.pp_schedule} ({run.pp_chunks} chunk{'s' * (run.pp_chunks > 1)})"
            if run.pp > 1
            else ""
        )
        + (", activation checkpointing" if run.activation_checkpointing else "")
        + (f", fp8 {run.fp8}" if getattr(run, "fp8", "none") != "none" else "")
    ]
    for key, label in names.items():
        if parts[key] > 1e-4 * step or key == "compute":
            lines.append(f"  {label:34s} {parts[key] * 1e3:12,.2f} ms  {parts[key] / step:6.1%}")
    sent = [f"{m} {b / 2**20:,.2f}" for m, b in prediction["comm_bytes"].items() if b]
    if sent:
        lines.append(f"  MiB rank 0 sends: {', '.join(sent)}")
    lines.append(
        f"  tokens/s per device {prediction['tokens_per_sec_per_gpu']:,.0f}; "
        f"MFU {metrics.format_mfu(prediction['mfu'])}"
    )
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# The step drawn: each pipeline rank's simulated step as a Chrome trace (--trace)

# the parts of an action, in the order drawn: (part, the category of its span)
ACTION_PARTS = (("compute", None), ("tp", "tp"), ("cp", "cp"), ("ep", "ep"), ("zero", "dp"))
# what a rank does once a step after its last action, in the order the code runs it: (rank_timing's
# key, category, name): the tied copies' sum in the pipeline's last backward, the reducer's finish,
# sum_partial_grads, the optimizer, ZeRO-1/2's gather posted after it (the next forward waits)
STEP_END = (
    ("tied", "pp", "tied embedding sum"),
    ("dp", "dp", "dp reduction"),
    ("tp_summed", "tp", "tp sum"),
    ("optimizer", "optimizer", "optimizer"),
    ("zero_gather", "zero_gather", "ZeRO gather"),
)


def rank_spans(prediction):
    """Each pipeline rank's simulated step, [(name, category, lane 0, start s, end s, args)] from 0
    to step_s without a gap (timeline.chrome_trace's spans; the dp, cp and tp ranks of a stage run
    alike). Each action's compute (F3, B3, W3: its op the category), then the communication it
    leaves exposed (tp, cp, ep; ZeRO-3's gathers as dp): the model prices how much is exposed, not
    when, so it is drawn after the compute. A wait before an action is the pipeline's transfer of
    its input (pp), up to one transfer, and the rest bubble; after the last action STEP_END's work,
    then bubble to the slowest rank's end. (predict's parts take pp as what the transfers add to
    the busiest rank's end: its pp and bubble may split differently, their sum is the same.)"""
    timeline, step = prediction["timeline"], prediction["step_s"]
    out = []
    for r, actions in enumerate(timeline["lists"]):
        spans, free = [], 0.0
        for k, (op, i, c) in enumerate(actions):
            start, end = timeline["times"][(r, k)]
            spans += wait_spans(free, start, timeline["transfer"])
            _, parts, _ = timeline["actions"][timeline["stages"][r][c]][op]
            args = {"microbatch": i, "chunk": c, "stage": timeline["stages"][r][c]}
            for part, category in ACTION_PARTS:
                seconds = parts.get(part, 0.0)
                if part == "compute" or seconds > 0:
                    name = f"{op}{i}" if category is None else f"{part} {op}{i}"
                    spans.append((name, category or op, 0, start, start + seconds, args))
                    start += seconds
            free = end
        for key, category, name in STEP_END:
            seconds = timeline["ranks"][r][key]
            if seconds > 0:
                spans.append((name, category, 0, free, free + seconds, {}))
                free += seconds
        out.append(spans + wait_spans(free, step, 0.0))
    return out


def wait_spans(free, start, transfer):
    """The spans of a rank's wait from `free` to `start`: the transfer in flight at its end (pp,
    at most `transfer`), the bubble before it."""
    pp = min(transfer, max(0.0, start - free))
    spans = [("bubble", "bubble", 0, free, start - pp, {})] if start - pp > free else []
    return spans + ([("pp transfer", "pp", 0, start - pp, start, {})] if pp > 0 else [])


def predicted_trace(prediction, run):
    """chrome_trace's dict of the predicted step (rank_spans), its summary in otherData."""
    spans = rank_spans(prediction)
    summary = {
        "predicted": True,
        "step_s": prediction["step_s"],
        "parts_s": prediction["parts"],
        "schedule": run.pp_schedule if run.pp > 1 else "none",
        "pp": run.pp,
        "microbatches": run.gradient_accumulation_steps,
        "chunks": run.pp_chunks if run.pp > 1 else 1,
        "layout": f"dp {run.dp} x cp {run.cp} x tp {run.tp} x pp {run.pp} x ep {run.ep}",
        "device": prediction["machine"].get("description", "?"),
        "dtype": prediction["dtype"],
    }
    return chrome_trace(spans, [{0: "predicted"}] * len(spans), summary)


# -----------------------------------------------------------------------------
# The command line: one layout's step, broken down

OWN = section(
    "tools/step_time.py's own",
    Setting("nproc", 1, "processes the run will have (GPUs)"),
    Setting(
        "machine",
        "h100",
        "a named machine (" + ", ".join(MACHINES) + "), a .json file of the same fields, or "
        "'auto' (this machine, measured)",
    ),
    Setting(
        "gpus_per_node",
        0,
        "devices per node: which groups cross nodes (0: the machine's, 8 for the named ones)",
    ),
    Setting(
        "trace",
        "",
        "also write the simulated step, each pipeline rank's actions, exposed communication and "
        "bubble, here as a Chrome trace (.json; tools/plot.py --trace draws it; '': none)",
    ),
)


def check_counts(values):
    """Refuse a count that no launch has (nproc < 1, gpus_per_node < 0) with a ConfigError naming
    the setting. Unchecked, 0 processes are predicted as one and a negative count divides by zero
    far from here. tools/make_config.py, which takes the same two settings, checks them here too."""
    problems = []
    if values["nproc"] < 1:
        problems.append(
            f"nproc = {values['nproc']} must be at least 1: the processes the run "
            f"will have (torchrun's --nproc_per_node x nodes); set --nproc=1 or more"
        )
    if values["gpus_per_node"] < 0:
        problems.append(
            f"gpus_per_node = {values['gpus_per_node']} must not be negative: set "
            f"--gpus_per_node to one node's devices, or 0 for the machine's"
        )
    if problems:
        raise ConfigError("; ".join(problems))


def vocab_size_of(cfg):
    """(vocabulary size, where it comes from): the setting, else the data's meta.json, else
    GPT-2's."""
    if cfg["vocab_size"]:
        return cfg["vocab_size"], "the vocab_size setting"
    meta_path = os.path.join(cfg["data_dir"], "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            return json.load(f)["vocab_size"], meta_path
    return 50257, f"GPT-2's, as {meta_path} is not there yet"


def model_config_of(cfg):
    """The ModelConfig of a settings dict, its vocabulary as vocab_size_of finds it."""
    vocab, _ = vocab_size_of(cfg)
    return ModelConfig(
        **{f.name: cfg[f.name] for f in fields(ModelConfig) if f.name != "vocab_size"},
        vocab_size=vocab,
    )


def run_prediction(cfg, model_cfg, layout, device, dtype, machine_name=None, matmul_rate=None):
    """(predicted seconds or None, its lines, {'predicted_step_s', 'predicted_parts_s',
    'predicted_comm_bytes', 'machine'})
    of a run. machine_name None: train.py's start-up (on CPU the cached matmul probe and gloo's
    figures, no collective; on a GPU the named machine its name matches); 'auto': this machine
    measured (tools/bench.py: every rank calls this, with the linears' rate it timed between its
    steps)."""
    if machine_name is None:
        machine = startup_machine(model_cfg, dtype, device)
    elif machine_name == "auto":
        machine = measure_machine(
            model_cfg,
            dtype,
            device,
            collective=layout.world_size > 1,
            tokens=probe_tokens(cfg, device),
            tp=layout.tp,
            matmul_rate=matmul_rate,
        )
    else:
        machine = load_machine(machine_name)
    if machine is None:
        return (
            None,
            "predicted step: no named machine matches this GPU (python tools/step_time.py "
            "--machine=PATH.json predicts for one you describe)",
            {},
        )
    run = run_of(cfg, layout.world_size)
    run.dp = layout.dp
    # fp8 on a machine with no FP8 rate (a CPU runs fp8.py for its numerics): the run's dtype
    unpriced = run.fp8 != "none" and "fp8" not in machine["matmul_flops"]
    run.fp8 = "none" if unpriced else run.fp8
    p = predict(model_cfg, run, machine)
    lines = format_prediction(p, run)
    if unpriced:
        lines += (
            f"\n  (fp8 = {cfg.fp8!r}: this machine has no FP8 matmul rate, so its linears are "
            f"predicted at the {p['dtype']} rate)"
        )
    sharing = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) * torch.get_num_threads()
    # the model gives each rank its cores: say when they are shared
    if device.type == "cpu" and sharing > (os.cpu_count() or 1):
        lines += (
            f"\n  ({sharing} threads share this machine's {os.cpu_count()} cores: "
            f"expect a slower step)"
        )
    return (
        p["step_s"],
        lines,
        {
            "predicted_step_s": p["step_s"],
            "predicted_parts_s": p["parts"],
            "predicted_comm_bytes": p["comm_bytes"],
            "machine": machine,
        },
    )


def main(argv):
    try:
        values, _ = configure(settings.TRAINING + OWN, argv, usage=__doc__)
        check_counts(values)
        model_cfg = model_config_of(values)
        values["dp"] = resolve_dp(
            values["nproc"],
            values["dp"],
            values["tp"],
            values["pp"],
            count_name="nproc",
            cp=values["cp"],
            ep=values["ep"],
        )
        settings.check_layout(
            model_cfg,
            values["tp"],
            values["pp"],
            values["cp"],
            values["sequence_parallel"],
            values["pp_chunks"],
            ep=values["ep"],
        )
        check_schedule(
            values["pp_schedule"],
            values["pp"],
            values["gradient_accumulation_steps"],
            values["pp_chunks"],
        )
        dtype = (
            torch.float32
            if values["dtype"] in ("auto", "float32")
            else getattr(torch, values["dtype"])
        )
        machine = (
            load_machine(values["machine"])
            if values["machine"] != "auto"
            else measure_machine(model_cfg, dtype)
        )
        run = run_of(values)  # (predicted in here: dtype_of refuses a machine lacking --dtype)
        prediction = predict(model_cfg, run, machine, values["gpus_per_node"] or None)
    except (ConfigError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(format_prediction(prediction, run))
    if values["trace"]:
        with open(values["trace"], "w") as f:
            json.dump(predicted_trace(prediction, run), f)
        print(f"predicted trace -> {values['trace']}")
    kept = ("step_s", "tokens_per_sec_per_gpu", "mfu", "dtype", "machine", "comm_bytes")
    result = {k: prediction[k] for k in kept}
    layout = ("dp", "cp", "tp", "pp", "ep", "zero_stage", "pp_schedule", "pp_chunks")
    result.update(parts_s=prediction["parts"], **{k: getattr(run, k) for k in layout})
    print("RESULT " + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
