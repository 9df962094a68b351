"""
How much memory each rank of a run will hold, predicted before anything runs: tools/make_config.py
prints the plan of a config, train.py prints it at start-up, and tools/bench.py's RESULT carries it
beside the measured peak.

What it predicts: for one rank of each pipeline stage, the bytes of the parameters, gradients,
optimizer state, saved activations, the loss's tensors, the gradients in flight, the optimizer
step's temporaries, and the step's peak. From what: the model config, the layout (dp, tp, pp, cp,
ep) and the execution settings (ZeRO stage, batch, micro-batches, schedule, activation
checkpointing, chunked loss, bucket size, optimizer, compute dtype, whether the attention kernel
keeps its scores), by shapes and dtypes alone: the parameters counted on the meta device, the
activations from the block's code, the peak by walking the rank's own actions of the schedule; no
constant is fitted to a measurement.

How it is checked: tests/test_memory.py holds the plan to every rank's measured peak of one step
(metrics.measure_step_memory: CUDA's allocator, or on CPU metrics.LiveTensorBytes, the live tensor
storages, or with compiled blocks the CPU allocator's), within 10%: every shipped config at one
process (at a small batch and vocabulary; the quick start and MoE at full size) and the README's
multi-process layouts, and small layouts through tools/bench.py; `python
tests/test_memory.py --measure` runs the larger set. It counts what eager blocks save for backward
(compiled ones save less), and torch.compile's own memory (its traces, generated code, caches) is no
tensor of the step: train.py's start-up says both when compile is on.
"""

import itertools
import math
from types import SimpleNamespace

import torch

from build import build_model, stage_cut
from metrics import rank_peak_memory_bytes
from expert_parallel import exchange_bytes, expert_rows
from model import (
    attention_dims,
    attention_head_dim,
    choose_attn_impl,
    loss_chunk_size,
    mlp_hidden_size,
    takes_muon,
)
from optim import deal_whole
from parallel import full_shape_of, split_vocab_size, stage_layers
from pipeline_schedules import virtual_stages
from tools.timeline import schedule_moments, walk_peak


# -----------------------------------------------------------------------------
# What the plan counts, kind by kind: for one rank of each pipeline stage, the bytes alive at the
# step's peak
#   parameters   the stage's tensors, this tp rank's slice (vocabulary padded as the layers pad
#                it); ZeRO-3: the 1/dp shards, the root unit (embedding, final norm, head) whole
#                and two gathered blocks
#   gradients    ZeRO-0/1: autograd's p.grad, accumulated over the micro-batches, plus the buckets'
#                flat copies with data-parallel replicas (dp x cp > 1, or ZeRO-1); ZeRO-2/3: the
#                1/dp shards plus three buckets (units) in flight (one filling, two being
#                reduce-scattered); Muon at ZeRO-2: AdamW's shards and the matrices it owns whole
#   optimizer    AdamW's two moments per element (1/dp under ZeRO, padded); Muon's one momentum
#                per element of a block's matrix (AdamW's two for the rest), ZeRO-1/2 dealing the
#                matrices whole (optim.deal_whole)
#   activations  what autograd saves per block and micro-batch (counted from the block's code
#                below: the attention kernel's own, the (B, H, T, T) probabilities where the
#                kernel keeps them, MLA's latents, QK-norm), held from a chunk's forward to its
#                backward, each tensor in its dtype: fp32 for the residual stream and the norms,
#                the compute dtype for the linears (under bf16 or fp16 autocast each linear also
#                keeps its own half copy of its input and weight); with activation checkpointing
#                each block's input and one block recomputed. Under the zero-bubble schedules B
#                frees them but for the linears' x and dy, which W frees. As a backward starts,
#                all of them beside the gradient arriving at the last block and its MLP's first
#                gradients
#   loss         the last stage: the chunked loss keeps its input and weight gradients from
#                forward to backward, and one chunk's logits while it runs (soft-capped, also
#                1 - tanh^2); without it the (N, V / tp) logits: their softmax (tp > 1) or
#                log-softmax and the soft-cap's tanh held, and while the loss runs the logits
#                beside the softmax (F.cross_entropy: two gradients)
#   buffers      at the end of a backward: the gradients in flight (autograd's new gradient of the
#                largest parameter, three for a weight tied within one chunk; ZeRO-2/3 also two
#                buckets or units, in flight through the next forwards until the next backward
#                lands them); after the last backward, at ZeRO-0/1 under pp with tied
#                embeddings, the copies' summed gradient
#   step         from the reduced gradients to the step's end: the gradient norm's square of the
#                largest gradient; AdamW's fused kernel makes none; ZeRO-1/2's all-gather after
#                it, a copy of this rank's 1/dp slice; Muon's new momentum and Nesterov step, the
#                matrix gathered across tp
# Expert parallelism: a rank holds n_expert / ep experts of each layer, sharded under ZeRO over the
# expert replicas ((dp / ep) x cp ranks); ZeRO-3 gathers a block's experts as a unit of their own.
# The experts' activations are counted on the rows a rank receives at the capacity bound
# (expert_rows), and while an MoE layer's outputs travel back its all-to-all buffers are alive
# beside them.
# The peak: the rank's actions of the schedule walked (pipeline_schedules.SCHEDULES, the lists the
# executor runs; with pp = 1 each micro-batch's forward, then its backward), the states plus what
# each action leaves held, so AFAB holds all m micro-batches, 1F1B pp - stage, interleaved 1F1B its
# chunks' share, with no count written per schedule; then the optimizer step. Not modelled: context
# parallelism's ring buffers (its ring attention is counted as a fused kernel).


def stage_parameter_elements(
    model_cfg,
    tp,
    pp,
    stage,
    schedule="1f1b",
    chunks=1,
    ep=1,
    shapes=None,
    pp_layers="",
    sequence_parallel=False,
    summed=None,
):
    """{name: elements this tp rank holds} of pipeline rank `stage`'s parameters (its chunks', cut
    as train.py cuts them): the model built on the meta device and the layout applied as
    build.build_model applies it, each group a stand-in of its size, so what is counted is what a
    run holds (under expert parallelism the first ep rank's experts). shapes: a dict, filled with
    each parameter's full shape (Muon orthogonalises the full matrix; autocast copies the matrices);
    summed: those tensor_parallel.sum_grad_over marks."""
    group = lambda size: SimpleNamespace(size=lambda: size, rank=lambda: 0) if size > 1 else None
    layout = SimpleNamespace(
        pp=pp, pp_rank=stage, tp_group=group(tp), ep_group=group(ep), cp_group=None
    )
    cfg = SimpleNamespace(
        chunked_loss=False,
        pp_schedule=schedule,
        pp_chunks=chunks,
        pp_layers=pp_layers,
        sequence_parallel=sequence_parallel,
        activation_checkpointing=False,
        fp8="none",
    )
    model = build_model(cfg, model_cfg, layout, "auto", "meta")  # (the kernel holds no parameters)
    out = {}
    # (a tied weight once: named_parameters gives each tensor once)
    for name, p in model.named_parameters():
        out[name] = p.numel()
        if shapes is not None:
            shapes[name] = tuple(full_shape_of(p))
        if summed is not None and hasattr(p, "grad_summed_over"):
            summed[name] = p.numel()
    return out


def is_expert(name):
    """A parameter (or module) of a routed expert: held by its ep rank only, averaged over its
    replicas."""
    return ".mlp.experts." in name


def compute_bytes(dtype="auto", device="auto"):
    """The bytes of an element of a run's compute dtype, which its narrow activations take: 2 under
    bf16 or fp16 autocast (dtype auto on a GPU is one of them: train.choose_device_and_dtype), else
    4."""
    gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return 2 if dtype in ("bfloat16", "float16") or (dtype == "auto" and gpu) else 4


def attention_saves_scores(model_cfg, attn_impl="auto", device="auto", dtype="auto"):
    """Whether a run with these settings keeps each block's (B, H, T, T) attention probabilities for
    backward (without context parallelism): the eager attention does (model.choose_attn_impl's for
    soft-capped scores unless flash-attn runs on a GPU in half precision), and SDPA on CPU when the
    value head differs from the query/key head (MLA: its math path). The fused kernels and ring
    attention keep the log-sum-exp."""
    gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    half = compute_bytes(dtype, device) < 4
    impl = attn_impl
    if impl == "auto":  # train.py's rule, for a device maybe not here
        compute = torch.bfloat16 if half else torch.float32
        where = "cuda" if gpu else "cpu"
        impl = choose_attn_impl("auto", where, compute, model_cfg.attn_softcap)[0]
    qk_dim, v_dim = attention_dims(model_cfg)
    return impl == "eager" or (impl == "sdpa" and not gpu and v_dim != qk_dim)


def attention_activation_elements(model_cfg, N, seq_len, tp, scores=False):
    """(wide, narrow) elements one attention layer saves for backward (block_activation_elements
    says which is which) for N tokens (this rank's, after sequence parallelism's gather) in
    sequences of seq_len, from model.py's CausalSelfAttention and MultiHeadLatentAttention: the
    rotated q and k, the values (repeated to the query heads under GQA), the output (o_proj's
    input); the log-sum-exp, or with scores=True (attention_saves_scores) the (B, H, T, T)
    probabilities and soft-capped the tanh (the T x T mask left out). RoPE saves none of its inputs.
    QK-norm keeps for q and k the projection's output, its product with the rsqrt and the rsqrt; MLA
    its latent (kv_down's output), that norm's rsqrt, product and output, and with q_lora_rank > 0
    the same of the query's. Wide: the log-sum-exp, the probabilities (autocast's softmax is fp32),
    what a norm reads and its rsqrt; narrow: a linear's output or input."""
    qk_dim, v_dim = attention_dims(model_cfg)
    H = model_cfg.n_head // tp
    if model_cfg.attention == "mla":
        kv_heads = norm_heads = H  # every head its own k_nope and v
        kvr, qr = model_cfg.kv_lora_rank, model_cfg.q_lora_rank
        # the latents as their norms read them (and their rsqrt); the rope key, the products and
        # outputs
        latents = [
            N * kvr + N + ((N * qr + N) if qr > 0 else 0),
            N * model_cfg.qk_rope_head_dim + 2 * N * kvr + (2 * N * qr if qr > 0 else 0),
        ]
    else:
        H_kv = model_cfg.n_kv_head // tp if model_cfg.n_kv_head % tp == 0 else 1
        kv_heads, norm_heads, latents = max(H, H_kv), H_kv, [0, 0]
    qkv = N * H * qk_dim + N * kv_heads * (qk_dim + v_dim)
    if scores:  # the probabilities (and the soft-capped scores' tanh)
        kernel = [N * H * seq_len, N * H * seq_len if model_cfg.attn_softcap else 0]
    else:
        kernel = [N * H, 0]  # the log-sum-exp
    heads = H + norm_heads  # QK-norm: the projection's output and rsqrt, the product
    qk_norm = [N * heads * qk_dim + N * heads, N * heads * qk_dim] if model_cfg.qk_norm else [0, 0]
    wide = kernel[0] + qk_norm[0] + latents[0]
    narrow = qkv + N * H * v_dim + kernel[1] + qk_norm[1] + latents[1]
    return wide, narrow


def block_activation_elements(
    model_cfg, tokens, tp, sequence_parallel=False, ep=1, seq_len=None, scores=False, autocast=False
):
    """(wide, narrow) elements autograd saves for one block's backward, for `tokens` tokens of a
    micro-batch (this rank's) in sequences of seq_len (block_size unless given), from model.py's
    Block: the residual input and mid-block sum, each norm's rsqrt, normalised input and output, the
    attention's tensors (attention_activation_elements), the MLP's hidden tensors (SwiGLU: gate,
    silu, up, product; GELU: up and gelu), or an MoE layer at its capacity bound (the local experts'
    rows: expert_rows). Wide: fp32 whatever the dtype (the residual stream, what a norm reads and
    its rsqrt, the router's, what the gates weight); narrow: the compute dtype's (a linear's output
    and input). Under autocast each linear keeps its own half copy of its input, where in fp32 q, k
    and v (SwiGLU's gate and up, an expert's) share one tensor."""
    C = model_cfg.n_embd
    N = tokens
    n_local = N // tp if sequence_parallel else N  # between the tensor-parallel regions
    attn_readers = (2 if model_cfg.attention == "mla" else 3) if autocast else 1
    mlp_readers = (2 if model_cfg.mlp == "swiglu" else 1) if autocast else 1
    # rsqrt, x * rsqrt; * gain, its output as the linears keep it (under sequence parallelism
    # gathered)
    norm = [n_local + n_local * C, N * C]
    attn = attention_activation_elements(model_cfg, N, seq_len or model_cfg.block_size, tp, scores)
    F = mlp_hidden_size(model_cfg) // tp
    per_token_mlp = (4 if model_cfg.mlp == "swiglu" else 2) * F
    if model_cfg.n_expert > 0:
        E = model_cfg.n_expert
        kept, received = expert_rows(model_cfg, N, ep)
        # tokens reordered (N x C), router logits and probabilities (N x E, fp32), each received
        # row's input and hidden tensors, each kept assignment's output (back on this rank), the
        # combined output; the shared experts on every token
        expert_in = mlp_readers * C + per_token_mlp
        mlp = [
            N * C + 2 * N * E + 2 * N * C,
            received * expert_in + kept * C + model_cfg.n_shared_expert * N * expert_in,
        ]
    else:
        mlp = [0, N * per_token_mlp]
    blocks_norms = 1 if model_cfg.parallel_block else 2
    # the block's input; the mid-block sum
    residual = n_local * C * (1 if model_cfg.parallel_block else 2)
    norm_outputs = norm[1] * (attn_readers + mlp_readers if autocast else blocks_norms)
    return residual + blocks_norms * norm[0] + attn[0] + mlp[0], norm_outputs + attn[1] + mlp[1]


def block_backward_elements(model_cfg, tokens, tp, sequence_parallel=False):
    """(wide, narrow) elements a backward adds, as it starts, to the activations of the chunk it
    runs (all still held): the gradient arriving at the last block (n_local x C: from the next
    stage, or the final norm's), and inside that block's MLP backward the gradient of its hidden
    product with the two it splits into (SwiGLU: the silu's and the up projection's), while the
    product itself is freed: net 2 x N x hidden (GELU: the gelu's input gradient, net 1). An MoE
    layer's is not added: its capacity bound already counts more rows than its routed tokens fill.
    The residual's gradient is wide, the MLP's narrow."""
    C, N = model_cfg.n_embd, tokens
    n_local = N // tp if sequence_parallel else N
    F = mlp_hidden_size(model_cfg) // tp
    mlp = 0 if model_cfg.n_expert > 0 else (2 if model_cfg.mlp == "swiglu" else 1) * N * F
    return n_local * C, mlp


def tied_sum_bytes(model_cfg, pp, zero_stage, elements, param_bytes=4):
    """The bytes of the tied embedding's summed gradient on a pipeline rank holding a copy, at
    ZeRO-0/1 (2/3's reducer sums the shards): after the last backward parallel.sync_tied_grads adds
    the copies' gradients into a new tensor and all-reduces it, beside this rank's copy's own
    gradient until the sum replaces it. One tensor of the copy's size, even where one rank holds the
    only copy (zbv's first: embedding = head)."""
    if pp == 1 or not model_cfg.tie_embeddings or zero_stage >= 2:
        return 0
    return elements.get("tok_emb.weight", elements.get("lm_head.weight", 0)) * param_bytes


def grad_norm_temp_elements(
    elements, zero_stage, skipped=(), largest_shard=None, matrices=(), owned=()
):
    """The elements of the gradient norm's temporary (train.global_grad_norm squares each gradient
    of the optimizer's grads() into a new tensor), for the largest: whole p.grad at ZeRO-0, else the
    slice this rank owns, at most the largest 1/dp shard of a bucket (largest_shard), but Muon's
    `matrices` whole where this rank owns them (`owned`). skipped: parameters the norm leaves out (a
    last stage's copy of the tied embedding, counted on the first)."""
    largest = max(
        (n for name, n in elements.items() if name not in skipped and name not in matrices),
        default=0,
    )
    if zero_stage >= 1 and largest_shard is not None:
        largest = min(largest, largest_shard)
    return max([largest] + [elements[name] for name in owned if name not in skipped])


def bucket_elements(param_elements, capacity):
    """The elements of each gradient bucket parallel.GradientBuckets makes of parameters of these
    sizes (one dtype): filled in backward order, closed once they reach capacity."""
    sizes, current = [], 0
    for n in reversed(param_elements):
        current += n
        if current >= capacity:
            sizes.append(current)
            current = 0
    return sizes + ([current] if current else [])


def last_launched(zero_stage, elements, unit_parts, root, holds_embedding, capacity):
    """ZeRO-2/3: the last two buckets (units) of each reducer that a backward launches, as
    (elements, whether of experts, whether dealt whole): they stay in flight through the forwards
    after it, until the next backward lands them (zero.GradientShards.set_grad_sync). Launched in
    backward order, the experts' by a reducer of their own; ZeRO-3's units (unit_parts) last to
    first, the root unit last where the stage holds the embedding, first where it holds only the
    head."""
    if zero_stage == 3:
        back = [
            [part for block in reversed(unit_parts) for part in reversed(block[e])] for e in (0, 1)
        ]
        root_unit = [(root, False)]
        launches = [back[0] + root_unit if holds_embedding else root_unit + back[0], back[1]]
    else:
        launches = [
            [
                (n, False)
                for n in bucket_elements(
                    [n for name, n in elements.items() if is_expert(name) == e], capacity
                )
            ]
            for e in (False, True)
        ]
    return [(n, bool(e), whole) for e, order in enumerate(launches) for n, whole in order[-2:]]


def weight_grad_residual_elements(model_cfg, tokens, tp):
    """Elements one block keeps for a micro-batch between a zero-bubble B and its W
    (pipeline_schedules.WeightGradStore): each tensor-parallel linear's input x (q, k and v read one
    tensor, as the MLP's gate and up do) and its output's gradient dy, all narrow. Counted for the
    dense attention and MLP."""
    C, D = model_cfg.n_embd, attention_head_dim(model_cfg)
    H = model_cfg.n_head // tp
    kv = model_cfg.n_kv_head // tp if model_cfg.n_kv_head % tp == 0 else model_cfg.n_kv_head
    F = mlp_hidden_size(model_cfg) // tp
    attn = C + H * D + 2 * kv * D + H * D + C  # q/k/v's x, their dy; o's x and dy
    # gate/up's x and dy; down's x and dy
    mlp = C + (2 if model_cfg.mlp == "swiglu" else 1) * F + F + C
    return tokens * (attn + mlp)


def fp8_saved_elements(model_cfg, tokens, tp, recipe, act_bytes):
    """fp8's change to a dense block's saved elements (of act_bytes; MoE and MLA counted as plain):
    tensorwise keeps each linear's input (q, k, v each theirs) and weight as FP8 casts (a byte
    each), no longer the norms' outputs and the MLP's hidden product, which only the linears kept;
    rowwise keeps what plain linears keep."""
    if recipe != "tensorwise" or model_cfg.n_expert > 0 or model_cfg.attention == "mla":
        return 0
    C, H = model_cfg.n_embd, model_cfg.n_head // tp
    D, F = attention_head_dim(model_cfg), mlp_hidden_size(model_cfg) // tp
    kv = model_cfg.n_kv_head // (tp if model_cfg.n_kv_head % tp == 0 else 1)
    up = 2 if model_cfg.mlp == "swiglu" else 1
    casts = tokens * (3 * C + H * D + up * C + F) + C * (2 * H + 2 * kv) * D + (up + 1) * C * F
    return round(casts / act_bytes) - tokens * ((1 if model_cfg.parallel_block else 2) * C + F)


def block_matrix_elements(elements, shapes, blocks):
    """A block's matrices on this rank, the mean over the stage's `blocks` (the router's stays
    fp32): what bf16 or fp16 autocast copies to half in each forward."""
    return sum(
        n
        for name, n in elements.items()
        if name.startswith("blocks.") and len(shapes[name]) > 1 and ".router." not in name
    ) // max(1, blocks)


def shard(n, ranks):
    """One rank's share of n elements split over `ranks` ranks, rounded up (ZeRO's shards are
    padded)."""
    return -(-n // ranks)


def zero3_unit_parts(elements, chunk_layers, owners):
    """ZeRO-3's units as zero.FullyShardedParameters cuts each block's dense and expert parts
    (zero.by_owner): per block [dense, experts], each a list of (elements, whether dealt whole): the
    parameters no rank owns, in even slices, then one unit per owner of Muon's matrices (owners:
    {name: rank}, muon_owners'; {} without Muon: one unit each)."""
    parts = []
    for i in (i for layers in chunk_layers for i in layers):
        block = []
        for expert in (False, True):
            by_owner = {}
            for name, n in elements.items():
                if name.startswith(f"blocks.{i}.") and is_expert(name) == expert:
                    by_owner[owners.get(name)] = by_owner.get(owners.get(name), 0) + n
            order = sorted(by_owner, key=lambda k: -1 if k is None else k)
            block.append([(by_owner[k], k is not None) for k in order if by_owner[k]])
        parts.append(block)
    return parts


def zero3_units(elements, chunk_layers):
    """[dense, experts] elements of each block here (chunk_layers: each chunk's blocks), each a
    ZeRO-3 unit."""
    return [
        [
            sum(
                n
                for name, n in elements.items()
                if name.startswith(f"blocks.{i}.") and is_expert(name) == expert
            )
            for expert in (False, True)
        ]
        for layers in chunk_layers
        for i in layers
    ]


def sharded_elements(block_units, root, replicas, expert_replicas):
    """This rank's elements of the parameters under ZeRO-2/3's sharding: each block's dense part
    over dp x cp, its experts over their own replicas, the root unit over dp x cp."""
    return sum(
        shard(dense, replicas) + shard(experts, expert_replicas) for dense, experts in block_units
    ) + shard(root, replicas)


def parameter_bytes(
    zero_stage, block_units, root, replicas, expert_replicas, param_bytes, kept=None
):
    """The bytes of the parameters one rank holds: all of its stage's, but under ZeRO-3 the shards,
    the root unit whole and two gathered blocks (the one computing, the one prefetched). kept: the
    elements ZeRO-3 stores where it does not cut them evenly (Muon's: muon_kept_elements)."""
    P = sum(map(sum, block_units)) + root
    params = P * param_bytes
    if zero_stage == 3:
        sharded = sharded_elements(block_units, root, replicas, expert_replicas)
        sharded = sharded if kept is None else kept
        biggest_block = max(map(sum, block_units), default=0)
        params = (
            sharded * param_bytes + (root + min(2, len(block_units)) * biggest_block) * param_bytes
        )
    return params


def gradient_bytes(
    model_cfg, zero_stage, held, replicas, expert_replicas, capacity, param_bytes, kept=None
):
    """(gradients, buffers, in_flight) of one rank, in bytes: its gradients, those in flight at the
    end of a backward, and ZeRO-2/3's last two buckets (units) still in flight after it, as [flat
    gradients, shards]. held: what the stage holds (stage_holdings). kept: the gradient elements
    ZeRO-2 keeps where it does not cut them evenly (Muon's: muon_kept_elements)."""
    elements, block_units, root = held.elements, held.block_units, held.root
    here, head_chunk = held.here, held.head_chunk
    P = sum(elements.values())
    # at the end of backward: autograd's new gradient of the largest parameter before it is added
    # into p.grad or copied into its bucket; for a weight tied within one chunk (one backward
    # reaches both uses) the head's part, the embedding's part and autograd's sum of them. Where one
    # rank holds the two ends in different chunks (zbv's first rank) each chunk's backward is its
    # own: the head's part becomes p.grad, and the embedding's, one new gradient, is added into it
    # later
    tied_in_chunk = model_cfg.tie_embeddings and head_chunk is not None and here[head_chunk] == 0
    largest = max(elements.values()) * (3 if tied_in_chunk else 1)
    buffers = largest * param_bytes
    if zero_stage >= 2:
        grads = sharded_elements(block_units, root, replicas, expert_replicas) * param_bytes
        if kept is not None:
            grads = kept * param_bytes
        # and in flight with it: its bucket's flat buffer, and the bucket launched before it
        if zero_stage == 3:
            units = [n for block in held.unit_parts for part in block for n, _ in part]
            sizes = sorted(units + [root], reverse=True)
        else:  # the experts fill buckets of their own
            sizes = sorted(
                sum(
                    (
                        bucket_elements(
                            [n for name, n in elements.items() if is_expert(name) == e], capacity
                        )
                        for e in (False, True)
                    ),
                    [],
                ),
                reverse=True,
            )
        buffers += (sizes[0] + (sizes[1] if len(sizes) > 1 else 0)) * param_bytes
        # the buckets still in flight through the forwards after a backward (last_launched): their
        # flat gradients, and from the second backward on their shards of the sum beside the
        # grad_shards (after the first the shard becomes the grad_shard, counted above)
        # (a unit dealt whole is reduced into its flat buffer itself: no shard of its own)
        last = last_launched(zero_stage, elements, held.unit_parts, root, 0 in here, capacity)
        in_flight = [
            sum(n for n, _, _ in last) * param_bytes,
            sum(
                0 if whole else shard(n, expert_replicas if e else replicas) for n, e, whole in last
            )
            * param_bytes,
        ]
    else:
        grads = P * param_bytes * (2 if (replicas > 1 or zero_stage == 1) else 1)
        in_flight = [0, 0]  # (flat gradients, shards)
    return grads, buffers, in_flight


def expert_dp_rank(run):
    """The rank's place among the ranks holding its experts (parallel.expert_groups: dp rank d and
    cp rank c at (d // ep) * cp + c), from run.dp_rank, its dp x cp rank (d * cp + c); None: not
    given."""
    if run.dp_rank is None:
        return None
    d, c = divmod(run.dp_rank, run.cp)
    return (d // run.ep) * run.cp + c


def muon_kept_elements(held, run):
    """Muon at ZeRO-2 and 3 (zero.GradientShards and FullyShardedParameters given owners): the
    gradient elements one rank keeps, and at ZeRO-3 the parameter elements it stores: AdamW's 1/dp
    shards and the matrices it owns, whole (the others free theirs once reduced, and store none)."""
    _, _, adamw_elements, owned = optimizer_state(
        held.elements,
        held.shapes,
        True,
        run.zero_stage,
        run.replicas,
        run.expert_replicas,
        run.dp_rank,
        expert_dp_rank(run),
    )
    return (
        shard(adamw_elements[0], run.replicas)
        + shard(adamw_elements[1], run.expert_replicas)
        + sum(held.elements[name] for name in owned)
    )


def muon_matrix_names(elements, shapes):
    """The names of the parameters Muon updates (model.takes_muon), in the model's order."""
    return [n for n in elements if takes_muon(n, torch.empty(shapes[n], device="meta"))]


def muon_owners(matrices, shapes, replicas, expert_replicas):
    """{name: its owner} of Muon's `matrices` under ZeRO, dealt as build.make_grad_sync's reducers
    deal them (optim.muon_buckets: deal_whole in backward order), the experts' apart over their own
    replicas where ep > 1."""

    def dealt(names, ranks):
        shaped = [torch.empty(shapes[name], device="meta") for name in reversed(names)]
        return dict(zip(reversed(names), deal_whole(shaped, ranks).values()))

    if expert_replicas == replicas:  # (ep = 1: one reducer deals them all)
        return dealt(matrices, replicas)
    dense = dealt([n for n in matrices if not is_expert(n)], replicas)
    return {**dense, **dealt([n for n in matrices if is_expert(n)], expert_replicas)}


def owned_matrices(names, owners, elements, ranks, rank):
    """The names among `names` that owners ({name: rank}) gives `rank` of `ranks`; rank None: the
    rank given the most elements."""
    share = [[n for n in names if owners[n] == r] for r in range(ranks)]
    if rank is not None:
        return share[rank]
    return max(share, key=lambda ns: sum(elements[n] for n in ns))


def optimizer_state(
    elements, shapes, muon, zero_stage, replicas, expert_replicas, dp_rank, expert_rank=None
):
    """(state elements, Muon's matrices, AdamW's elements as [dense, experts], the matrices this
    rank updates) of one rank: what the optimizer keeps, and what its step and ZeRO-1's slices are
    counted from. dp_rank, expert_rank: the rank's place among the ranks sharding a parameter, an
    expert (None: the rank dealt the most)."""
    # the optimizer's state: AdamW's two moments per element; Muon's one momentum per matrix element
    # (AdamW's two for the rest); under ZeRO 1/dp of them (the experts' over their replicas), except
    # Muon's matrices, dealt whole (optim.deal_whole): this rank's share is what the deal gives it
    matrices = muon_matrix_names(elements, shapes) if muon else []
    M = sum(elements[name] for name in matrices)
    # the elements AdamW steps: [dense, experts]
    adamw_elements = [
        sum(n for name, n in elements.items() if is_expert(name) == e and name not in matrices)
        for e in (False, True)
    ]
    P = sum(elements.values())
    if zero_stage == 0:
        state = 2 * (P - M) + M
        owned = matrices
    else:
        state = 2 * (shard(adamw_elements[0], replicas) + shard(adamw_elements[1], expert_replicas))
        owners = muon_owners(matrices, shapes, replicas, expert_replicas)
        if expert_replicas == replicas:
            owned = owned_matrices(matrices, owners, elements, replicas, dp_rank)
        else:  # the experts' reducer deals theirs over the ranks holding the same experts
            dense = [name for name in matrices if not is_expert(name)]
            experts = [name for name in matrices if is_expert(name)]
            owned = owned_matrices(dense, owners, elements, replicas, dp_rank)
            owned += owned_matrices(experts, owners, elements, expert_replicas, expert_rank)
        state += sum(elements[name] for name in owned)
    return state, matrices, adamw_elements, owned


def optimizer_step_bytes(
    zero_stage, elements, shapes, adamw_elements, owned, tp, replicas, expert_replicas, param_bytes
):
    """The bytes of the optimizer step's own temporaries (ZeRO-1/2's all-gather inputs, Muon's
    update)."""
    # the optimizer step's temporaries. AdamW makes none: it is torch's fused kernel
    # (parallel.adamw_step) on whole tensors or on ZeRO's flat slices alike. After it, ZeRO-1/2's
    # all-gather of the updated parameters (ShardedGradientBuckets.after_step) posts every bucket's
    # at once, each with a copy of this rank's slice as its input: 1/dp of the parameters AdamW
    # steps (the experts' over their replicas), beside the gradient shards (Muon's whole matrices
    # are broadcast in place). Muon's own, before that, for the largest matrix it owns: the new
    # momentum and its Nesterov step (its tp slice), the matrix gathered whole across tp, and
    # Newton-Schulz on it in fp32 (the normalised X; then at most X's next iterate, X X^T, the
    # polynomial's terms: see newton_schulz)
    step_temps = 0
    if zero_stage in (1, 2):
        step_temps = (
            (shard(adamw_elements[0], replicas) if replicas > 1 else 0)
            + (shard(adamw_elements[1], expert_replicas) if expert_replicas > 1 else 0)
        ) * param_bytes
    if owned:
        big = max(owned, key=lambda name: math.prod(shapes[name]))
        F, a = math.prod(shapes[big]), min(shapes[big])
        gathered = F * param_bytes if tp > 1 and elements[big] < F else 0
        newton_schulz_bytes = (F + max(F + 4 * a * a, 3 * F + 2 * a * a)) * 4
        step_temps = max(
            step_temps, 2 * elements[big] * param_bytes + gathered + newton_schulz_bytes
        )
    return step_temps


def zero1_slice_bytes(elements, matrices, adamw_elements, replicas, expert_replicas, param_bytes):
    """ZeRO-1: each bucket's reduce-scatter output (this rank's slice) lives from its launch in the
    last backward until finish(): at the end of it, every bucket's but the one of the largest
    gradient, the last to fill (Muon's whole matrices are reduced into the flat buffer itself)."""
    biggest_name = max(elements, key=elements.get)
    launched = [
        n
        - (
            elements[biggest_name]
            if is_expert(biggest_name) == e and biggest_name not in matrices
            else 0
        )
        for e, n in enumerate(adamw_elements)
    ]
    return (
        (shard(launched[0], replicas) if replicas > 1 else 0)
        + (shard(launched[1], expert_replicas) if expert_replicas > 1 else 0)
    ) * param_bytes


def activation_bytes(
    model_cfg,
    tokens,
    seq_len,
    tp,
    ep,
    sequence_parallel,
    activation_checkpointing,
    scores,
    blocks,
    fp8="none",
    act_bytes=4,
    block_matrices=0,
):
    """(saved, recompute, backward_start): the bytes a forward leaves per block until its backward,
    the block recomputed at a time, what a backward adds as it starts (blocks: whether the rank
    holds any). act_bytes: the compute dtype's; under autocast a forward also keeps a half copy of a
    block's block_matrices."""
    autocast = act_bytes < 4
    to_bytes = lambda wide, narrow: 4 * wide + act_bytes * narrow  # noqa: E731
    wide, narrow = block_activation_elements(
        model_cfg, tokens, tp, sequence_parallel, ep, seq_len, scores, autocast
    )
    narrow += fp8_saved_elements(model_cfg, tokens, tp, fp8, act_bytes) + (
        block_matrices if autocast else 0
    )
    per_block = to_bytes(wide, narrow)
    n_local = tokens // tp if sequence_parallel else tokens
    # with activation checkpointing a block keeps its (fp32) input, and one block is recomputed at a
    # time
    saved = 4 * n_local * model_cfg.n_embd if activation_checkpointing else per_block
    recompute = per_block if activation_checkpointing else 0
    # a backward, as it starts: the chunk's activations all held, and the backward's first tensors
    backward_start = (
        to_bytes(*block_backward_elements(model_cfg, tokens, tp, sequence_parallel))
        if blocks
        else 0
    )
    return saved, recompute, backward_start


def loss_bytes(model_cfg, N, tp, sequence_parallel, chunked_loss, act_bytes):
    """(held, once): the bytes the loss keeps on the head's chunk per micro-batch from its forward
    to its backward, and those alive only while it runs (N: this rank's tokens per micro-batch)."""
    C, V = model_cfg.n_embd, split_vocab_size(model_cfg.vocab_size, tp)
    n_local = N // tp if sequence_parallel else N  # between the tensor-parallel regions
    # the final norm's tensors: its rsqrt and x * rsqrt (fp32), its output as the head keeps it (the
    # compute dtype, gathered under sequence parallelism)
    final_norm = 4 * (n_local + n_local * C) + act_bytes * N * C
    vocab, capped = model_cfg.vocab_size, model_cfg.final_softcap > 0
    if chunked_loss and tp == 1:
        # model._chunked_cross_entropy: held, the head's input and weight gradients (the latter
        # fp32); while it runs, one chunk's logits buffer and soft-capped its 1 - tanh^2 (fp32); in
        # half precision also the chunk's fp32 logits, the half copies of input and weight, and a
        # chunk's weight gradient term
        half = act_bytes < 4
        loss_held = final_norm + N * C * act_bytes + V * C * 4
        loss_once = (
            min(N, loss_chunk_size(vocab))
            * vocab
            * (act_bytes + (4 if half else 0) + (4 if capped else 0))
        )
        loss_once += (N * C + 2 * V * C) * act_bytes if half else 0
    else:
        # the (N, V / tp) logits. Held: the softmax (tp > 1) or log-softmax, fp32, and soft-capped
        # the tanh. While the loss runs: the vocab-parallel loss's logits beside their exp (in half
        # precision also their fp32 copy); F.cross_entropy's backward's two gradients
        logits = N * (V // tp)
        loss_held = final_norm + logits * 4 + (logits * act_bytes if capped else 0)
        loss_once = logits * (act_bytes + (4 if act_bytes < 4 else 0)) if tp > 1 else 2 * logits * 4
    return loss_held, loss_once


def grad_norm_bytes(
    model_cfg, zero_stage, held, capacity, replicas, expert_replicas, param_bytes, muon=((), ())
):
    """The bytes of the gradient norm's temporary, once the gradients are reduced: the norm's square
    of the largest gradient (under ZeRO a slice of at most the largest bucket's or unit's shard; the
    experts' over their replicas; Muon's matrices whole where owned). held: what the stage holds
    (stage_holdings); muon: (Muon's matrices, those this rank updates), optimizer_state's."""
    elements, block_units, root = held.elements, held.block_units, held.root
    here, head_chunk = held.here, held.head_chunk
    kinds = [[n for name, n in elements.items() if is_expert(name) == e] for e in (False, True)]
    pieces = (
        block_units + [[root, 0]]
        if zero_stage == 3
        else itertools.zip_longest(*[bucket_elements(ns, capacity) for ns in kinds], fillvalue=0)
    )
    largest_shard = max(
        max(shard(dense, replicas), shard(experts, expert_replicas)) for dense, experts in pieces
    )
    # the head's copy
    copy_here = model_cfg.tie_embeddings and head_chunk is not None and 0 not in here
    return (
        grad_norm_temp_elements(
            elements, zero_stage, ("lm_head.weight",) if copy_here else (), largest_shard, *muon
        )
        * param_bytes
    )


def stage_holdings(model_cfg, run, stage):
    """What pipeline rank `stage` holds, as a namespace: here (its model stages), head_chunk (which
    of them holds the head and the loss, or None), elements and shapes (stage_parameter_elements),
    chunk_layers (each chunk's blocks), block_units (ZeRO-3's units: each block's dense part over
    dp x cp, its experts over their own replicas), unit_parts (those units as Muon's owners cut
    them: zero3_unit_parts) and root (the rest: embedding, final norm, head)."""
    pp, chunks, schedule = run.pp, run.chunks, run.schedule
    here = virtual_stages(schedule, pp, stage, chunks)
    last = pp * chunks - 1  # the model's last stage (this rank holds `chunks` of them)
    shapes = {}
    elements = stage_parameter_elements(
        model_cfg, run.tp, pp, stage, schedule, chunks, run.ep, shapes, run.pp_layers
    )
    cut = stage_cut(model_cfg, schedule, pp, chunks, run.pp_layers)
    chunk_layers = [stage_layers(cut, s) for s in here]
    block_units = zero3_units(elements, chunk_layers)
    owners = {}
    if run.muon and run.zero_stage == 3:
        matrices = muon_matrix_names(elements, shapes)
        owners = muon_owners(matrices, shapes, run.replicas, run.expert_replicas)
    return SimpleNamespace(
        here=here,
        head_chunk=here.index(last) if last in here else None,
        elements=elements,
        shapes=shapes,
        chunk_layers=chunk_layers,
        block_units=block_units,
        unit_parts=zero3_unit_parts(elements, chunk_layers, owners),
        root=sum(elements.values()) - sum(map(sum, block_units)),
    )


def optimizer_bytes(model_cfg, run, held):
    """(state, zero1_slices, step) of one rank, in bytes: the optimizer's state (optimizer_state),
    ZeRO-1's slices in flight at the end of the last backward (zero1_slice_bytes), and from the
    reduced gradients to the step's end the larger of the step's own temporaries
    (optimizer_step_bytes) and the gradient norm's (grad_norm_bytes)."""
    elements, shapes = held.elements, held.shapes
    zero_stage, param_bytes = run.zero_stage, run.param_bytes
    replicas = (run.replicas, run.expert_replicas)  # a parameter's, an expert's
    state, matrices, adamw_elements, owned = optimizer_state(
        elements, shapes, run.muon, zero_stage, *replicas, run.dp_rank, expert_dp_rank(run)
    )
    zero1_slices = (
        zero1_slice_bytes(elements, matrices, adamw_elements, *replicas, param_bytes)
        if zero_stage == 1
        else 0
    )
    own = optimizer_step_bytes(
        zero_stage, elements, shapes, adamw_elements, owned, run.tp, *replicas, param_bytes
    )
    norm = grad_norm_bytes(
        model_cfg, zero_stage, held, run.capacity, *replicas, param_bytes, (matrices, owned)
    )
    return state * param_bytes, zero1_slices, max(own, norm)


def activation_peak(model_cfg, run, held, stage, accumulated, buffers, in_flight):
    """(top, activations, loss): walk_peak over this stage's actions of the schedule, from what a
    block saves (activation_bytes), an MoE layer's all-to-all buffers and the loss's tensors
    (loss_bytes). accumulated, buffers, in_flight: the gradients' (stage_memory)."""
    N, tp, act_bytes = run.N, run.tp, run.act_bytes
    saved, recompute, backward_start = activation_bytes(
        model_cfg,
        N,
        run.seq_len,
        tp,
        run.ep,
        run.sequence_parallel,
        run.activation_checkpointing,
        run.attention_scores and run.cp == 1,
        bool(held.block_units),
        run.fp8,
        act_bytes,
        block_matrix_elements(held.elements, held.shapes, len(held.block_units)),
    )
    exchange = (
        exchange_bytes(model_cfg, N, run.ep, act_bytes)
        if run.ep > 1 and model_cfg.n_expert > 0 and held.block_units
        else 0
    )
    loss_held = loss_once = 0  # per micro-batch the head's chunk holds; while the loss runs
    if held.head_chunk is not None:
        loss_held, loss_once = loss_bytes(
            model_cfg, N, tp, run.sequence_parallel, run.chunked_loss, act_bytes
        )
    moments = schedule_moments(
        run.schedule,
        run.pp,
        stage,
        run.microbatches,
        run.chunks,
        [len(layers) for layers in held.chunk_layers],
        held.head_chunk,
        saved,
        act_bytes * weight_grad_residual_elements(model_cfg, N, tp),
    )
    return walk_peak(
        moments,
        held.head_chunk,
        run.zero_stage,
        recompute,
        backward_start,
        loss_held,
        loss_once,
        exchange,
        accumulated,
        buffers,
        in_flight,
    )


def stage_memory(model_cfg, run, stage):
    """One rank of pipeline stage `stage`: plan_memory's dict of bytes, each kind from its piece
    above and the peak the largest of three moments: the schedule's walk, the tied copies' sum and
    the optimizer step."""
    held = stage_holdings(model_cfg, run, stage)
    zero_stage, param_bytes = run.zero_stage, run.param_bytes
    replicas = (run.replicas, run.expert_replicas)  # a parameter's, an expert's
    P = sum(held.elements.values())
    kept = muon_kept_elements(held, run) if run.muon and zero_stage >= 2 else None
    params = parameter_bytes(zero_stage, held.block_units, held.root, *replicas, param_bytes, kept)
    grads, buffers, in_flight = gradient_bytes(
        model_cfg, zero_stage, held, *replicas, run.capacity, param_bytes, kept
    )
    state, zero1_slices, step = optimizer_bytes(model_cfg, run, held)
    buffers += zero1_slices
    accumulated = P * param_bytes if zero_stage < 2 else 0  # autograd's p.grad (ZeRO-0/1)
    top, activations, loss = activation_peak(
        model_cfg, run, held, stage, accumulated, buffers, in_flight
    )
    during_walk = params + (grads - accumulated) + state + top
    # after the last backward, before the data-parallel reduction: the tied copies' gradients
    # summed into a new tensor (the activations all freed; ZeRO-1's slices still in flight)
    tied = tied_sum_bytes(model_cfg, run.pp, zero_stage, held.elements, param_bytes)
    at_tied_sum = params + grads + state + zero1_slices + tied
    # then, the gradients reduced, the step's temporaries
    at_step = params + (grads if zero_stage >= 2 else P * param_bytes) + state + step
    return {
        "stage": stage,
        "parameters": params,
        "gradients": grads,
        "optimizer": state,
        "activations": activations,
        "loss": loss,
        "buffers": buffers,
        "step": step,
        "peak": max(during_walk, at_tied_sum, at_step),
    }


def plan_memory(
    model_cfg,
    dp=1,
    tp=1,
    pp=1,
    cp=1,
    zero_stage=0,
    batch_size=1,
    block_size=None,
    microbatches=1,
    schedule="1f1b",
    activation_checkpointing=False,
    chunked_loss=True,
    sequence_parallel=False,
    bucket_size_mb=25.0,
    param_bytes=4,
    act_bytes=4,
    chunks=1,
    ep=1,
    optimizer="adamw",
    dp_rank=None,
    attention_scores=False,
    pp_layers="",
    fp8="none",
):
    """For each pipeline stage, one rank's bytes: {'stage', 'parameters', 'gradients', 'optimizer',
    'activations', 'loss', 'buffers', 'step', 'peak'} (see above; ZeRO-3's gathered root unit and
    blocks are under 'parameters'; activations and loss are their largest over the step). dp_rank:
    the data-parallel (dp x cp) rank, where ranks differ (Muon's ZeRO-1 deals whole matrices); None:
    the largest of them. attention_scores: whether the attention kernel keeps the (B, H, T, T)
    probabilities (attention_saves_scores; never under context parallelism, whose ring attention
    keeps the log-sum-exp). pp_layers: the blocks of each model stage, as the setting ('': cut by
    cost, build.stage_cut)."""
    run = SimpleNamespace(**locals())  # the arguments, as the pieces above read them
    T = block_size or model_cfg.block_size
    run.seq_len = T // cp  # this rank's share of a sequence
    run.N = batch_size * T // cp  # this rank's tokens per micro-batch
    # the ranks that shard a parameter, an expert
    run.replicas, run.expert_replicas = dp * cp, dp // ep * cp
    # a gradient bucket's elements
    run.capacity = max(1, int(bucket_size_mb * 2**20)) // param_bytes
    run.muon = optimizer == "muon"
    return [stage_memory(model_cfg, run, stage) for stage in range(pp)]


def plan_for(cfg, model_cfg, layout_dims, dp_rank=None):
    """plan_memory for a run's settings (train.py's cfg) at layout_dims = (dp, tp, pp, cp); dp_rank:
    see plan_memory."""
    dp, tp, pp, cp = layout_dims
    return plan_memory(
        model_cfg,
        dp,
        tp,
        pp,
        cp,
        cfg.zero_stage,
        cfg.batch_size,
        cfg.block_size,
        cfg.gradient_accumulation_steps,
        cfg.pp_schedule,
        cfg.activation_checkpointing,
        cfg.chunked_loss,
        cfg.sequence_parallel,
        cfg.bucket_size_mb,
        chunks=cfg.pp_chunks,
        ep=cfg.ep,
        optimizer=cfg.optimizer,
        dp_rank=dp_rank,
        pp_layers=cfg.pp_layers,
        fp8=cfg.fp8,
        act_bytes=compute_bytes(cfg.dtype, cfg.device),
        attention_scores=attention_saves_scores(model_cfg, cfg.attn_impl, cfg.device, cfg.dtype),
    )


def format_plan(stages, gpu_mem_gib=None):
    """The plan as lines of text, one per stage, the largest named; with gpu_mem_gib what to change
    when it does not fit."""
    mib = lambda b: f"{b / 2**20:,.1f}"
    columns = ("parameters", "gradients", "optimizer", "activations", "loss", "buffers", "step")
    lines = [f"memory per rank (MiB): stage | {' '.join(columns)} | peak"]
    for s in stages:
        lines.append(
            f"  stage {s['stage']} | {' '.join(mib(s[k]) for k in columns)} | {mib(s['peak'])}"
        )
    top = max(stages, key=lambda s: s["peak"])
    lines.append(f"  largest: stage {top['stage']}, {top['peak'] / 2**30:.2f} GiB")
    if gpu_mem_gib is not None and top["peak"] > gpu_mem_gib * 2**30:
        kinds = {k: top[k] for k in ("parameters", "gradients", "optimizer", "activations", "loss")}
        worst = max(kinds, key=kinds.get)
        advice = {
            "parameters": "raise zero_stage to 3 or tp/pp",
            "gradients": "raise zero_stage to 2",
            "optimizer": "raise zero_stage (1 shards the optimizer state) or dp",
            "activations": "turn on activation_checkpointing, lower batch_size, or use 1f1b",
            "loss": "keep chunked_loss on (tp = 1) or lower batch_size",
        }[worst]
        lines.append(
            f"  does not fit {gpu_mem_gib} GiB: stage {top['stage']} needs "
            f"{top['peak'] / 2**30:.2f} GiB, most of it {worst}: {advice}"
        )
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# The plan beside the measure (metrics.measure_step_memory) on every rank: train.py's start-up,
# tools/bench.py's RESULT


def memory_rows(layout, predicted, measured, **more):
    """[{rank, dp_rank, cp_rank, tp_rank, pp_rank, predicted_bytes, measured_bytes, **more}] of
    every rank (every rank must call it: a gather)."""
    mine = {
        "rank": layout.rank,
        "dp_rank": layout.dp_rank,
        "cp_rank": layout.cp_rank,
        "tp_rank": layout.tp_rank,
        "pp_rank": layout.pp_rank,
        "predicted_bytes": int(predicted),
        "measured_bytes": int(measured),
        **more,
    }
    rows = [mine]
    if layout.world_size > 1:
        rows = [None] * layout.world_size
        torch.distributed.all_gather_object(rows, mine)
    return rows


def format_memory_rows(rows, compiled_on=None):
    """memory_rows as start-up lines: the first step's tensors' peak, which the plan counts (the log
    line's is the process's). compiled_on: the device, when the blocks compiled in that step: one
    more line says how compiling moves the measure from the plan, and what it adds that neither
    counts."""
    lines = [
        f"memory rank {r['rank']} (dp {r['dp_rank']} tp {r['tp_rank']} pp {r['pp_rank']}): "
        f"predicted {r['predicted_bytes'] / 2**20:,.1f} MiB, measured "
        f"{r['measured_bytes'] / 2**20:,.1f} MiB of tensors (step {r['step']})"
        for r in rows
    ]
    if compiled_on is not None:
        where = (
            f"the log lines' peak RSS ({rank_peak_memory_bytes(compiled_on) / 2**20:,.0f} MiB "
            f"after this first step, which compiled)"
            if compiled_on.type == "cpu"
            else "host memory"
        )
        lines.append(
            f"compile=True: the plan counts an eager step's tensors (compiled blocks save fewer "
            f"for backward: their partitioner recomputes cheap operations, so the measure may come "
            f"in under it); torch.compile's own memory (dynamo's traces, inductor's generated code "
            f"and caches) is in neither, but in {where}"
        )
    return "\n".join(lines)
