"""
A Llama-style decoder-only transformer, written once for every parallel layout.

    token embedding -> n_layer x [x + attn(norm(x)); x + mlp(norm(x))] -> norm -> lm_head

RoPE positions, RMSNorm before each sublayer (pre-norm), causal self-attention with n_kv_head key/value
heads (MHA when n_kv_head == n_head, GQA below it, MQA at 1), a SwiGLU MLP, optionally tied input and
output embeddings.

The model is built directly in its parallel form: the linears are parallel.py's Column/Row parallel
layers, which are plain linears when there is no tensor-parallel group, and a pipeline stage builds only
its own blocks (and the embedding on the first stage, the head on the last). Weights are initialised from
a generator seeded by (seed, parameter name) over the full tensor, then sliced, so every layout starts
from the same full model.
"""
import functools
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, copy_to_tp,
                      full_shape_of, group_rank, group_size, padded_vocab_size, shard_of, valid_vocab_columns,
                      vocab_parallel_cross_entropy)


@dataclass
class ModelConfig:
    vocab_size: int = 50257
    block_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 4
    n_embd: int = 128
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    attn_impl: str = "sdpa"  # resolved from 'auto' by choose_attn_impl before the model is built


# -----------------------------------------------------------------------------
# Attention backend, chosen at run time. flash_attn is never imported at module level: picotron must
# import on a T4, a laptop or a CPU box where it is absent or cannot load.


@functools.lru_cache(maxsize=None)
def flash_attn_available():
    """Installed and importable: a flash-attn built for another CUDA or GPU can be present but fail to load."""
    try:
        import flash_attn  # noqa: F401  (lazily, here only)
        return True
    except Exception:
        return False


def choose_attn_impl(attn_impl, device_type, dtype):
    """Returns (impl, reason). 'auto' takes FlashAttention-2 when it is installed, on CUDA, in half
    precision (its only supported dtypes); otherwise PyTorch's SDPA, which itself dispatches to a fused
    kernel where it can."""
    if attn_impl == "auto":
        if device_type == "cuda" and dtype in (torch.bfloat16, torch.float16) and flash_attn_available():
            return "flash", "auto: flash-attn is installed, device is CUDA and dtype is half precision"
        why = ("flash-attn is not installed" if not flash_attn_available() else
               "device is not CUDA" if device_type != "cuda" else "dtype is not bf16/fp16")
        return "sdpa", f"auto: {why}, so PyTorch SDPA"
    if attn_impl == "flash":
        if not flash_attn_available():
            raise ValueError("attn_impl='flash' but flash-attn is not installed: pip install flash-attn, "
                             "or use attn_impl='auto' or 'sdpa'")
        if device_type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
            raise ValueError("attn_impl='flash' needs a CUDA device and dtype bfloat16 or float16: "
                             "use attn_impl='sdpa' here")
        return "flash", "requested"
    if attn_impl in ("sdpa", "eager"):
        return attn_impl, "requested"
    raise ValueError(f"attn_impl must be 'auto', 'sdpa', 'flash' or 'eager', got {attn_impl!r}")


def causal_attention(q, k, v, impl):
    """q: (B, T, H, D), k and v: (B, T, H_kv, D) with H a multiple of H_kv. Returns (B, T, H, D)."""
    if impl == "flash":
        from flash_attn import flash_attn_func  # lazily: see choose_attn_impl
        return flash_attn_func(q, k, v, causal=True)  # takes GQA directly
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
    if group > 1:  # each key/value head serves `group` query heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    if impl == "sdpa":
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:  # eager: written out, the reference the fused kernels must agree with
        T = q.shape[2]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = att @ v
    return y.transpose(1, 2)


# -----------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    """Zhang & Sennrich 2019: x / rms(x) * g, computed in fp32 for stability under bf16/fp16 autocast."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.weight.init_value = 1.0

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_cache(seq_len, head_dim, theta):
    """cos and sin of RoPE (Su et al. 2021), (T, head_dim/2), frequencies theta^(-2i/head_dim)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x, cos, sin):
    """Rotate the two halves of each head: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). The half split
    (not interleaved pairs) is the convention of Hugging Face's Llama, so weights export as they are."""
    T = x.shape[1]
    cos, sin = cos[:T, None, :], sin[:T, None, :]  # (T, 1, D/2), broadcast over (B, T, H, D/2)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class CausalSelfAttention(nn.Module):
    """Multi-head attention with n_kv_head key/value heads. Under tensor parallelism each rank holds
    n_head / tp query heads (column-parallel q), and the output projection is row-parallel.

    Key/value heads are split the same way when tp divides n_kv_head. With fewer key/value heads than
    ranks (MQA, small GQA) they cannot be split: every rank keeps the full k/v weights and uses the one
    head its query heads read. Each rank then holds only part of those weights' gradient (from its own
    query heads), so the weights pass through copy_to_tp, whose backward sums the parts across ranks."""

    def __init__(self, cfg, tp_group=None):
        super().__init__()
        tp = group_size(tp_group)
        self.tp_group, self.attn_impl = tp_group, cfg.attn_impl
        self.head_dim = cfg.n_embd // cfg.n_head
        self.n_head_local = cfg.n_head // tp
        kv_dim = cfg.n_kv_head * self.head_dim
        self.q_proj = ColumnParallelLinear(cfg.n_embd, cfg.n_head * self.head_dim, group=tp_group)
        self.kv_split = cfg.n_kv_head % tp == 0
        if self.kv_split:
            self.k_proj = ColumnParallelLinear(cfg.n_embd, kv_dim, group=tp_group)
            self.v_proj = ColumnParallelLinear(cfg.n_embd, kv_dim, group=tp_group)
        else:
            self.k_proj = nn.Linear(cfg.n_embd, kv_dim, bias=False)
            self.v_proj = nn.Linear(cfg.n_embd, kv_dim, bias=False)
            self.kv_head = group_rank(tp_group) * cfg.n_kv_head // tp  # the one head this rank reads
        self.o_proj = RowParallelLinear(cfg.n_head * self.head_dim, cfg.n_embd, group=tp_group)
        self.o_proj.weight.init_std = 0.02 / math.sqrt(2 * cfg.n_layer)  # GPT-2's depth-scaled residual init

    def project_kv(self, x):
        if self.kv_split:
            return self.k_proj(x), self.v_proj(x)
        rows = slice(self.kv_head * self.head_dim, (self.kv_head + 1) * self.head_dim)
        x = copy_to_tp(x, self.tp_group)
        k = F.linear(x, copy_to_tp(self.k_proj.weight, self.tp_group)[rows])
        v = F.linear(x, copy_to_tp(self.v_proj.weight, self.tp_group)[rows])
        return k, v

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head_local, self.head_dim)  # (B, T, H_local, D)
        k, v = self.project_kv(x)
        k = k.view(B, T, -1, self.head_dim)  # (B, T, H_kv_local, D)
        v = v.view(B, T, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = causal_attention(q, k, v, self.attn_impl)
        return self.o_proj(y.reshape(B, T, self.n_head_local * self.head_dim))


def swiglu_hidden_size(n_embd, multiple_of=64):
    """Llama's SwiGLU width: 2/3 of GPT's 4x (three matrices instead of two keep the parameter count),
    rounded up to a multiple of 64 so it splits across tensor-parallel ranks and runs on fast matmul sizes."""
    hidden = int(2 * 4 * n_embd / 3)
    return (hidden + multiple_of - 1) // multiple_of * multiple_of


class SwiGLUMLP(nn.Module):
    """Shazeer 2020: down(silu(gate(x)) * up(x)). gate and up are column-parallel, down row-parallel:
    the hidden activations stay split across tensor-parallel ranks, with no communication in between."""

    def __init__(self, cfg, tp_group=None):
        super().__init__()
        hidden = swiglu_hidden_size(cfg.n_embd)
        self.gate = ColumnParallelLinear(cfg.n_embd, hidden, group=tp_group)
        self.up = ColumnParallelLinear(cfg.n_embd, hidden, group=tp_group)
        self.down = RowParallelLinear(hidden, cfg.n_embd, group=tp_group)
        self.down.weight.init_std = 0.02 / math.sqrt(2 * cfg.n_layer)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg, tp_group=None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg, tp_group)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = SwiGLUMLP(cfg, tp_group)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


# -----------------------------------------------------------------------------
# The model


def check_layout(cfg, tp=1, pp=1):
    """Stop before anything is built when the model cannot be split this way, saying what must divide what."""
    problems = []
    if cfg.n_embd % cfg.n_head:
        problems.append(f"n_embd = {cfg.n_embd} must be divisible by n_head = {cfg.n_head}")
    elif (cfg.n_embd // cfg.n_head) % 2:
        problems.append(f"the head size n_embd / n_head = {cfg.n_embd // cfg.n_head} must be even for RoPE")
    if cfg.n_head % cfg.n_kv_head:
        problems.append(f"n_head = {cfg.n_head} must be divisible by n_kv_head = {cfg.n_kv_head}")
    if cfg.n_head % tp:
        problems.append(f"n_head = {cfg.n_head} must be divisible by tp = {tp} (each rank takes n_head / tp heads)")
    if cfg.n_kv_head % tp and tp % cfg.n_kv_head:
        problems.append(f"n_kv_head = {cfg.n_kv_head} and tp = {tp}: one must divide the other (key/value heads are "
                        f"split when tp divides n_kv_head, replicated when n_kv_head divides tp)")
    if swiglu_hidden_size(cfg.n_embd) % tp:
        problems.append(f"the MLP width {swiglu_hidden_size(cfg.n_embd)} must be divisible by tp = {tp}")
    if pp > cfg.n_layer:
        problems.append(f"pp = {pp} stages but only n_layer = {cfg.n_layer} blocks: use pp <= {cfg.n_layer}")
    if problems:
        raise ValueError("the model cannot be built with this layout: " + "; ".join(problems))


def stage_layers(n_layer, pp, pp_rank):
    """The block indices of pipeline stage pp_rank. When pp does not divide n_layer the first stages get
    one block more: the last stage already carries the output head and the loss, the heaviest part of a
    small model with a large vocabulary."""
    if pp > n_layer:
        raise ValueError(f"pp = {pp} stages but only n_layer = {n_layer} blocks: every stage needs at least "
                         f"one block, so use pp <= {n_layer}")
    sizes = [n_layer // pp + (1 if s < n_layer % pp else 0) for s in range(pp)]
    start = sum(sizes[:pp_rank])
    return range(start, start + sizes[pp_rank])


class Transformer(nn.Module):
    """The whole model, or one pipeline stage of it (pp > 1): the first stage takes token ids, the others
    take the previous stage's hidden states; the last stage returns the logits and the loss, the others
    their hidden states (and no loss)."""

    def __init__(self, cfg, tp_group=None, pp=1, pp_rank=0):
        super().__init__()
        self.cfg, self.tp_group = cfg, tp_group
        self.is_first, self.is_last = pp_rank == 0, pp_rank == pp - 1
        self.layer_ids = stage_layers(cfg.n_layer, pp, pp_rank)
        if self.is_first:
            self.tok_emb = VocabParallelEmbedding(cfg.vocab_size, cfg.n_embd, tp_group)
        # keyed by the global block index, so a parameter has the same name whichever stage holds it
        self.blocks = nn.ModuleDict({str(i): Block(cfg, tp_group) for i in self.layer_ids})
        if self.is_last:
            self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
            vocab_padded = padded_vocab_size(cfg.vocab_size, group_size(tp_group))
            self.lm_head = ColumnParallelLinear(cfg.n_embd, vocab_padded, group=tp_group)
            self.lm_head.weight.vocab_size = cfg.vocab_size
            if cfg.tie_embeddings:
                if self.is_first:
                    self.lm_head.weight = self.tok_emb.weight  # one tensor, one gradient
                else:
                    # the first stage holds the embedding: this copy starts equal to it (same init name)
                    # and the pipeline sums the two copies' gradients so they stay equal
                    self.lm_head.weight.init_name = "tok_emb.weight"
        cos, sin = rope_cache(cfg.block_size, cfg.n_embd // cfg.n_head, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x, targets=None):
        if self.is_first:
            if x.shape[1] > self.cfg.block_size:
                raise ValueError(f"sequence of length {x.shape[1]} is longer than block_size {self.cfg.block_size}")
            x = self.tok_emb(x)
        for block in self.blocks.values():
            x = block(x, self.rope_cos, self.rope_sin)
        if not self.is_last:
            return x, None
        logits = self.lm_head(self.norm(x))
        # drop the padded vocabulary columns: they are not tokens and must not enter the softmax
        logits = logits[..., :valid_vocab_columns(self.cfg.vocab_size, self.lm_head.out_per_rank, self.tp_group)]
        loss = None
        if targets is not None:
            vocab_start = group_rank(self.tp_group) * self.lm_head.out_per_rank
            loss = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                vocab_start, self.tp_group)
        return logits, loss

    @torch.no_grad()
    def init_weights(self, seed):
        """Every parameter's full tensor is drawn from its own generator, seeded by (seed, name), and this
        rank keeps its slice: the same seed gives the same full model whatever the layout. Linear and
        embedding weights are N(0, 0.02) (GPT-2), residual output projections N(0, 0.02/sqrt(2 n_layer)),
        norm gains 1, biases 0, padded vocabulary rows 0."""
        for name, p in self.named_parameters():
            if hasattr(p, "init_value"):
                p.fill_(p.init_value)
                continue
            if name.endswith("bias"):
                p.zero_()
                continue
            name = getattr(p, "init_name", name)
            g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**62)
            shape = full_shape_of(p)
            full = torch.zeros(shape)
            rows = getattr(p, "vocab_size", shape[0])  # only real tokens get random rows
            full[:rows].normal_(0.0, getattr(p, "init_std", 0.02), generator=g)
            p.copy_(shard_of(full, p))

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Sample max_new_tokens tokens after idx (B, T), on a single-process model. top_k=1 is greedy."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.cfg.block_size:]
            logits, _ = self(context)
            logits = logits[:, -1, :].float()
            if top_k is not None and top_k > 0:
                v, _ = torch.topk(logits, min(top_k, logits.shape[-1]))
                logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
            if top_k == 1 or temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                next_id = torch.multinomial(F.softmax(logits / temperature, dim=-1), num_samples=1)
            idx = torch.cat([idx, next_id], dim=1)
        return idx
