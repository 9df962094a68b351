"""
Tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", section 3), with sequence parallelism
(Korthikanti et al. 2022, section 4.2.2), applied to a built model.Transformer:
apply_tensor_parallel swaps each of the model's layers for its parallel form from parallel.py (the
column- and row-parallel linears, the vocab-parallel embedding) and its loss for the vocab-parallel
one, in place. Built on the meta device, the swaps allocate nothing; each layer keeps its name, so a
checkpoint's names do not depend on the layout. The model's own code stays one process's: where a
region needs its input gathered or copied (f), a forward pre-hook does it; where a whole parameter's
gradient is partial on each rank, sum_partial_grads sums it. Imports only torch and parallel.py; it
reads the model by its layers' names (q_proj, o_proj, gate, up, down, ...) as gpt-fast's tp.py does,
so a model with the same names takes it as it is.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelEmbedding,
    SequenceParallelRowLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    group_rank,
    group_size,
    split_vocab_size,
    scatter_to_tp,
    valid_vocab_columns,
    vocab_parallel_cross_entropy,
)


class VocabParallelLoss(nn.Module):
    """model.NextTokenLoss with the head split by vocabulary: the logits stay this rank's slice of
    the vocabulary (its real columns: the last ranks may hold only padding) and the loss is the
    vocab-parallel cross-entropy, which never gathers them. Under sequence parallelism the final
    norm's output, this rank's tokens, is all-gathered first (gather_from_sp, whose backward sums,
    so the head does not copy its input). The chunked loss does not apply: the vocab-parallel loss
    never makes whole logits anyway."""

    chunked = False

    def __init__(self, group, vocab_size, softcap=0.0, sequence_parallel=False):
        super().__init__()
        self.group, self.vocab_size, self.softcap = group, vocab_size, softcap
        self.sp_group = group if sequence_parallel else None

    def forward(self, h, head, targets=None):
        h = gather_from_sp(h, self.sp_group)  # (B, T/tp, C) -> (B, T, C); the identity without SP
        logits = head(h)[..., : valid_vocab_columns(self.vocab_size, head.out_per_rank, self.group)]
        # Gemma 2's soft-capping (model.soft_cap), elementwise: fine on a vocabulary slice
        if self.softcap:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        if targets is None:
            return logits, None
        vocab_start = group_rank(self.group) * head.out_per_rank
        # flatten, not reshape(-1, V): a rank holding only padding has V = 0 here
        return logits, vocab_parallel_cross_entropy(
            logits.flatten(0, -2), targets.reshape(-1), vocab_start, self.group
        )


# -----------------------------------------------------------------------------
# How each layer splits.
#
# Attention (Shoeybi et al. 2019, section 3): each rank holds n_head / tp query heads
# (column-parallel q), and the output projection is row-parallel. Key/value heads are split the same
# way when tp divides n_kv_head. With fewer key/value heads than ranks (MQA, small GQA) they cannot
# be split: every rank keeps the full k/v weights and uses the one head its query heads read
# (KeyValueHeadOfRank). MLA (DeepSeek-V2) splits its heads: q_proj / q_up and kv_up are
# column-parallel (each rank makes its own heads' q, k_nope and v), o_proj is row-parallel; the
# down-projections (kv_down, q_down) and the latent norms are small and replicated: every rank
# computes the whole latent. Computing the latent once and scattering it would save a few small
# matmuls per rank but cost a collective in each direction; replication is simpler and as fast.
#
# The MLPs: gate and up are column-parallel, down row-parallel: the hidden activations stay split
# across tensor-parallel ranks, with no communication in between. With bias=True the row-parallel
# down adds its bias once, after the all-reduce. A mixture of experts splits every expert the same
# way (one all-reduce per expert, of no rows for one without tokens) and keeps its router
# replicated: its input and everything after the all-reduces are the same on every rank, so every
# rank routes identically (the ranks run the same experts in the same order: the collectives match)
# and computes the same, complete router gradient.
#
# Each region (attention, an MLP, each expert) takes its input through f once, at its entry, for all
# the column-parallel layers that read it (q, k and v; gate and up): its gradient is all-reduced
# once per region in the backward pass, not once per projection. Under sequence parallelism the
# entry all-gathers the tokens instead (gather_from_sp, whose backward reduce-scatter does f's sum),
# and the row-parallel layer that leaves the region reduce-scatters. A mixture of experts stays a
# replicated region under sequence parallelism: its input is all-gathered (backward: keep this
# rank's slice, the computation after the gather being the same on every rank), it runs on the whole
# sequence exactly as without, and each rank keeps its own tokens of the output; what it does not
# give the MoE layer is the memory saving.
#
# A parameter every rank holds whole but each applies to only its part of the work gets only that
# part's gradient: the QK-norm gains (each rank normalises its own heads), the replicated key/value
# weights (its heads' rows), MLA's down-projections and latent norms (read by its heads only), and
# under sequence parallelism the norms between the regions (its own tokens). sum_grad_over marks
# them; sum_partial_grads sums the parts across the group once a step, after the last micro-batch's
# backward, all of them in one all-reduce: Megatron-LM's all-reduce of the sequence-parallel
# gradients (finalize_model_grads). Summed as each backward made them, one small blocking all-reduce
# per parameter and micro-batch, they cost 11% of a sequence-parallel step on CPU (2 ranks, 8
# layers: 68 of them a step). A sum commutes with the data-parallel average and with accumulation,
# so it may come after both; it must come before anything reads the gradient (the norm, clipping,
# the optimizer: train.train_step calls it first).


def sum_grad_over(module, group):
    """Mark `module`'s parameters as partial on each tp rank, for sum_partial_grads (see above)."""
    for p in module.parameters():
        p.grad_summed_over = group


def sum_partial_grads(grads):
    """Sum over its tp group every gradient sum_grad_over marked, one all-reduce per group (see
    above). grads: [(param, gradient)], the optimizer's grads() (under ZeRO this rank's slices: the
    tp ranks of a replica own the same ones), the same parameters in the same order on every rank of
    the group."""
    by_group = {}
    for p, grad in grads:
        if getattr(p, "grad_summed_over", None) is not None and grad.numel():
            by_group.setdefault(p.grad_summed_over, []).append(grad)
    for group, parts in by_group.items():
        flat = torch.cat([grad.reshape(-1) for grad in parts])
        dist.all_reduce(flat, group=group)
        for grad, summed in zip(parts, flat.split([grad.numel() for grad in parts])):
            grad.copy_(summed.view_as(grad))


def enter_region(module, group, sequence_parallel):
    """Pass `module`'s first input through f, or under sequence parallelism the tokens' all-gather,
    in a forward pre-hook: the module's own code stays one process's (see above)."""
    enter = gather_from_sp if sequence_parallel else copy_to_tp
    module.register_forward_pre_hook(lambda _, args: (enter(args[0], group), *args[1:]))


class KeyValueHeadOfRank(nn.Module):
    """A key or value projection whose heads are fewer than the tp ranks: the whole weight,
    replicated (its names unchanged), of which this rank uses the rows of the one head its query
    heads read. Rank r holds query heads r * n_head / tp onwards, and key/value head j serves the
    n_head / n_kv_head query heads from j * n_head / n_kv_head: with tp a multiple of n_kv_head, all
    of rank r's query heads read head r * n_kv_head / tp."""

    def __init__(self, linear, head, head_dim):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.rows = slice(head * head_dim, (head + 1) * head_dim)

    def forward(self, x):
        return F.linear(
            x, self.weight[self.rows], None if self.bias is None else self.bias[self.rows]
        )


def column_parallel(linear, group, copy_input=False):
    """The ColumnParallelLinear of an nn.Linear, on its device (meta: nothing allocated)."""
    shape, bias = (linear.in_features, linear.out_features), linear.bias is not None
    with torch.device(linear.weight.device):
        return ColumnParallelLinear(*shape, bias, group, copy_input=copy_input)


def row_parallel(linear, group, sequence_parallel=False):
    """The RowParallelLinear of an nn.Linear (leaving into a sequence-parallel region:
    SequenceParallelRowLinear)."""
    with torch.device(linear.weight.device):
        layer = SequenceParallelRowLinear if sequence_parallel else RowParallelLinear
        return layer(linear.in_features, linear.out_features, linear.bias is not None, group)


def apply_tp_attention(attn, group, sequence_parallel):
    """Split an attention's heads (CausalSelfAttention or MultiHeadLatentAttention, see above)."""
    tp, columns = group_size(group), ("q_proj", "q_up", "kv_up")
    if hasattr(attn, "k_proj"):  # (MLA's keys and values come from kv_up)
        kv_heads = attn.k_proj.out_features // attn.head_dim
        if kv_heads % tp == 0:
            columns += ("k_proj", "v_proj")
        else:
            head = group_rank(group) * kv_heads // tp
            attn.k_proj, attn.v_proj = (
                KeyValueHeadOfRank(p, head, attn.head_dim) for p in (attn.k_proj, attn.v_proj)
            )
    for name in columns:
        if hasattr(attn, name):
            setattr(attn, name, column_parallel(getattr(attn, name), group))
    attn.o_proj = row_parallel(attn.o_proj, group, sequence_parallel)
    # replicated, each rank reading its own heads' share: sum the gradients
    for module in attn.children():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            sum_grad_over(module, group)
    enter_region(attn, group, sequence_parallel)


def apply_tp_mlp(mlp, group, sequence_parallel):
    """Split a dense MLP: gate and up column-parallel, down row-parallel (see above)."""
    for name in ("gate", "up"):
        if hasattr(mlp, name):
            setattr(mlp, name, column_parallel(getattr(mlp, name), group))
    mlp.down = row_parallel(mlp.down, group, sequence_parallel)
    enter_region(mlp, group, sequence_parallel)


def apply_tp_experts(moe, group, sequence_parallel):
    """Split every expert of a mixture of experts like a dense MLP; under sequence parallelism the
    layer gathers the whole sequence and gives back this rank's tokens (see above)."""
    for expert in [*moe.experts.values(), *moe.shared_experts]:
        apply_tp_mlp(expert, group, sequence_parallel=False)
    if sequence_parallel:
        moe.register_forward_pre_hook(lambda _, args: (gather_from_tp(args[0], group, dim=1),))
        moe.register_forward_hook(lambda _, args, out: scatter_to_tp(out, group, dim=1))


def apply_tensor_parallel(model, group, sequence_parallel=False):
    """Split a model.Transformer across the tensor-parallel group (Megatron-LM; with
    sequence_parallel, Korthikanti et al. 2022): the embedding by vocabulary, each attention by
    heads, each MLP and expert by its hidden width, the head by vocabulary with the vocab-parallel
    loss. Returns the model."""
    if group_size(group) == 1:
        return model
    tp, cfg = group_size(group), model.cfg
    for block in model.blocks.values():
        apply_tp_attention(block.attn, group, sequence_parallel)
        if hasattr(block.mlp, "experts"):
            apply_tp_experts(block.mlp, group, sequence_parallel)
        else:
            apply_tp_mlp(block.mlp, group, sequence_parallel)
        if sequence_parallel:  # the norms between the regions see this rank's tokens only
            for norm in (getattr(block, "attn_norm", None), getattr(block, "mlp_norm", None)):
                if norm is not None:
                    sum_grad_over(norm, group)
    if model.tok_emb is not None:
        with torch.device(model.tok_emb.weight.device):
            embedding = SequenceParallelEmbedding if sequence_parallel else VocabParallelEmbedding
            model.tok_emb = embedding(cfg.vocab_size, cfg.n_embd, group)
    if model.lm_head is not None:
        if sequence_parallel:
            sum_grad_over(model.norm, group)
        tied = cfg.tie_embeddings and model.tok_emb is not None
        rows = split_vocab_size(cfg.vocab_size, tp)  # padded to 64 rows per rank
        with torch.device(model.lm_head.weight.device):
            model.lm_head = ColumnParallelLinear(
                cfg.n_embd, rows, group=group, copy_input=not sequence_parallel
            )
        # rows past it are padding (load_shard reads the real ones)
        model.lm_head.weight.vocab_size = cfg.vocab_size
        if tied:
            model.lm_head.weight = model.tok_emb.weight  # one tensor, one gradient
        model.loss = VocabParallelLoss(group, cfg.vocab_size, cfg.final_softcap, sequence_parallel)
    return model


# -----------------------------------------------------------------------------
# Filling a layer used alone (outside a model that init_shares or a checkpoint fills): each full
# tensor is either the tensor itself (drawn, or from another layout's checkpoint) or a reader of
# slices, read(dim, start, size) returning that slice of it, so that a rank reads only its shard of
# a safetensors file (import_hf.py reads a transformers model so).


def load_full(layer, weight, bias=None):
    """Fill a layer's weight (and bias) with this rank's slices of the full tensors: (out_features,
    in_features) and (out_features,) for the linears, the (vocab_size, dim) table for the embedding.
    """
    load_shard(layer.weight, weight)
    if bias is not None:
        load_shard(layer.bias, bias)
    return layer


def load_shard(param, source):
    """Fill `param` with its slice of a full tensor. `source` is the full tensor, or a reader
    read(dim, start, size) of slices of it (dim None: the whole tensor). A vocabulary-padded table
    reads only the real rows (rows past `vocab_size` stay zero), so the source needs no padding, or
    any padding."""
    dim = getattr(param, "tp_shard_dim", None)
    read = source
    if not callable(source):
        read = lambda d, start, size: source if d is None else source.narrow(d, start, size)
    with torch.no_grad():
        if dim is None:
            param.copy_(read(None, 0, None))
            return param
        size = param.shape[dim]
        start = param.tp_rank * size
        # < size only in padded tables
        real = max(0, min(size, getattr(param, "vocab_size", start + size) - start))
        param.narrow(dim, real, size - real).zero_()
        if real > 0:
            param.narrow(dim, 0, real).copy_(read(dim, start, real))
    return param
