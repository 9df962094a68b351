"""
A Llama-style decoder-only transformer, written once for every parallel layout, with the common
variants.

    token embedding -> n_layer x [x + attn(norm(x)); x + mlp(norm(x))] -> norm -> lm_head

The default is Llama: RoPE positions, RMSNorm before each sublayer (pre-norm), causal self-attention
with n_kv_head key/value heads (MHA when n_kv_head == n_head, GQA below it, MQA at 1), a SwiGLU MLP,
optionally tied input and output embeddings. Each variant is one setting, written where its code is,
paper cited:

    attention='mla'       multi-head latent attention (DeepSeek-V2)        MultiHeadLatentAttention
    qk_norm=True          RMSNorm on each query and key head               CausalSelfAttention, MLA
    attn_softcap, final_softcap   Gemma 2's tanh soft-capping              soft_cap
    parallel_block=True   x + attn(norm(x)) + mlp(norm(x)) (GPT-J, PaLM)   Block
    norm='layernorm', mlp='gelu', bias=True   GPT-2's pieces               make_norm, GeluMLP
    n_expert > 0          Mixture-of-Experts MLP (Switch, GShard, DeepSeekMoE)  MixtureOfExperts

and the shapes real checkpoints have (import_hf.py loads them): head_dim (heads not n_embd / n_head
wide, Qwen3), intermediate_size (any MLP width, TinyLlama), qkv_bias (biases on q, k and v only,
Qwen2) and rope_scaling_factor with its three companions (Llama 3.1's RoPE scaling,
llama3_scaled_frequencies).

The model knows nothing of how it runs, as nanoGPT's does: Transformer(cfg) is the whole model in
one process, its linears nn.Linear. Each parallel mechanism applies itself to a built model, in its
own file, by swapping modules for their parallel forms (tensor_parallel.apply_tensor_parallel,
parallel.apply_pipeline; context_parallel.apply_context_parallel;
expert_parallel.apply_expert_parallel), so the maths below is read apart from all of them. Where a
mechanism changes more than a layer, the model leaves one small named piece for it to swap, each a
plain class here that does what one process does:
    AttentionKernel      attention proper; context parallelism swaps in ring attention
    Rotary               RoPE's cos and sin; context parallelism reads its rank's positions
    TokenWindow          the tokens a router queues and counts; context parallelism's window
    LocalExperts         how tokens reach their experts; expert parallelism's all-to-all
    NextTokenLoss        the head's logits and loss; tensor parallelism's vocab-parallel loss,
                         context parallelism's share of it
    Transformer.chunk_layers   the blocks each forward runs; the pipeline's stages and chunks
Weights are initialised from a generator seeded by (seed, parameter name) over the full tensor, then
cut to this rank's share (init_weights), so every layout starts from the same full model.
"""

import functools
import math
import zlib
from dataclasses import dataclass, fields
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class ModelConfig:
    """The architecture, and nothing about how it runs (attention kernel, activation checkpointing,
    the chunked loss: those are Transformer's arguments). Every field is a training setting of the
    same name."""

    vocab_size: int = 50257
    block_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 4
    n_embd: int = 128
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # the shapes real checkpoints have; 0 keeps the derived sizes (n_embd / n_head; the MLP widths
    # below)
    head_dim: int = 0  # attention='mha' only
    intermediate_size: int = 0  # the MLP's hidden width (each expert's too)
    rope_scaling_factor: float = 0.0  # Llama 3's RoPE scaling; 0 = plain RoPE
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    # the variants (train.py explains each setting; the classes below explain the idea)
    attention: str = "mha"  # 'mha' (n_kv_head makes it GQA/MQA) or 'mla'
    kv_lora_rank: int = 64  # mla
    q_lora_rank: int = 0  # mla; 0 = full-rank queries
    qk_rope_head_dim: int = 16  # mla
    qk_nope_head_dim: int = 32  # mla
    v_head_dim: int = 32  # mla
    qk_norm: bool = False
    attn_softcap: float = 0.0  # 0 = off
    final_softcap: float = 0.0  # 0 = off
    parallel_block: bool = False
    norm: str = "rmsnorm"  # 'rmsnorm' or 'layernorm'
    mlp: str = "swiglu"  # 'swiglu' or 'gelu'
    bias: bool = False
    qkv_bias: bool = False  # biases on the query, key and value projections only (Qwen2)
    n_expert: int = 0  # 0 = dense MLP
    n_expert_per_token: int = 2
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.01
    n_shared_expert: int = 0
    router_z_loss_coef: float = 0.0
    doc_mask: bool = False  # attention stops at eot_token, positions restart after it
    # the end-of-text id that ends each document in the bins (meta.json's); -1 = unknown
    eot_token: int = -1


def model_config_from(saved):
    """The ModelConfig of a checkpoint's saved model settings. Checkpoints written before the
    execution choices left ModelConfig hold attn_impl, activation_checkpointing and chunked_loss
    too: they are not the architecture, so they are dropped."""
    known = {f.name for f in fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in saved.items() if k in known})


# -----------------------------------------------------------------------------
# Where the model runs: device, precision and attention backend, chosen at run time. flash_attn is
# never imported at module level: picotron must import on a T4, a laptop or a CPU box where it is
# absent or cannot load.


def choose_device_and_dtype(device_name, dtype_name):
    """Returns (device, dtype, reason). fp32 on CPU (CPUs have no fast fp16 and bf16 is opt-in),
    bf16 on CUDA compute capability 8.0+ (Ampere), fp16 with a loss scaler before it. float64, on
    CPU only, is for checking: the whole run (weights, activations, collectives, optimizer) in
    float64, where two layouts' roundings fall to ~1e-15 and only a real difference stays
    (scripts/compare.py)."""
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    available = "'auto', 'cpu'" + (", 'cuda', 'cuda:0' ..." if torch.cuda.is_available() else "")
    try:
        dev = torch.device(device_name)
    except RuntimeError:
        raise ValueError(f"device={device_name!r} is not a device name: use one of {available}")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(
            f"device={device_name!r}: picotron runs on CPU and CUDA only; "
            f"available here: {available}"
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={device_name!r} but CUDA is not available here: use one of {available}"
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(
            f"device={device_name!r} but this machine has "
            f"{torch.cuda.device_count()} CUDA device(s)"
        )
    if dtype_name == "auto":
        if dev.type != "cuda":
            return dev, torch.float32, "auto: CPU, so float32"
        major, minor = torch.cuda.get_device_capability(dev)
        if major >= 8:
            return dev, torch.bfloat16, f"auto: compute capability {major}.{minor} >= 8.0 has bf16"
        return (
            dev,
            torch.float16,
            f"auto: compute capability {major}.{minor} < 8.0, so fp16 with a loss scaler",
        )
    dtypes = {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "float64": torch.float64,
    }
    if dtype_name not in dtypes:
        raise ValueError(
            f"dtype must be 'auto', 'float32', 'bfloat16', 'float16' or 'float64', "
            f"got {dtype_name!r}"
        )
    if dtype_name == "float16" and dev.type == "cpu":
        raise ValueError("dtype='float16' on CPU has no fast kernels: use 'float32' or 'bfloat16'")
    if dtype_name == "float64" and dev.type == "cuda":
        # GPUs run float64 matmuls at 1/2 (H100) to 1/64 (consumer cards) of fp32's rate, and
        # flash-attn takes half precision only: float64 is a check of the numerics, which the CPU
        # does as well
        raise ValueError(
            "dtype='float64' is for checking runs on CPU (scripts/compare.py): use --device=cpu "
            "with it, or dtype 'auto', 'bfloat16' or 'float32' on CUDA"
        )
    return dev, dtypes[dtype_name], "requested"


@functools.lru_cache(maxsize=None)
def flash_attn_available():
    """Installed and importable: a flash-attn built for another CUDA or GPU can be present but fail
    to load."""
    try:
        import flash_attn  # noqa: F401  (lazily, here only)

        return True
    except Exception:
        return False


def choose_attn_impl(attn_impl, device_type, dtype, softcap=0.0):
    """Returns (impl, reason). 'auto' takes FlashAttention-2 when it is installed, on CUDA, in half
    precision (its only supported dtypes); otherwise PyTorch's SDPA, which itself dispatches to a
    fused kernel where it can. SDPA cannot soft-cap attention scores (softcap = attn_softcap > 0):
    then 'auto' falls back to the eager attention written out below. FlashAttention-2 soft-caps from
    version 2.6."""
    if attn_impl == "auto":
        if (
            device_type == "cuda"
            and dtype in (torch.bfloat16, torch.float16)
            and flash_attn_available()
        ):
            capped = ", and it soft-caps the scores" if softcap else ""
            return (
                "flash",
                f"auto: flash-attn is installed, device is CUDA and dtype is half "
                f"precision{capped}",
            )
        why = (
            "flash-attn is not installed"
            if not flash_attn_available()
            else "device is not CUDA"
            if device_type != "cuda"
            else "dtype is not bf16/fp16"
        )
        if softcap:
            return "eager", (
                f"auto: {why}, and attn_softcap = {softcap} needs a kernel that can cap "
                f"scores, which SDPA cannot, so the explicit (eager) attention"
            )
        return "sdpa", f"auto: {why}, so PyTorch SDPA"
    if attn_impl == "flash":
        if not flash_attn_available():
            raise ValueError(
                "attn_impl='flash' but flash-attn is not installed: pip install flash-attn, "
                "or use attn_impl='auto' or 'sdpa'"
            )
        if device_type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                "attn_impl='flash' needs a CUDA device and dtype bfloat16 or float16: "
                "use attn_impl='sdpa' here"
            )
        return "flash", "requested"
    if attn_impl == "sdpa" and softcap:
        raise ValueError(
            f"attn_impl='sdpa' cannot soft-cap attention scores (attn_softcap = {softcap}): use "
            f"attn_impl='auto' or 'eager' (or 'flash' on a GPU), or set attn_softcap=0"
        )
    if attn_impl in ("sdpa", "eager"):
        # (this function is the one place that keeps SDPA away from soft-capping)
        return attn_impl, "requested"
    raise ValueError(f"attn_impl must be 'auto', 'sdpa', 'flash' or 'eager', got {attn_impl!r}")


def soft_cap(x, cap):
    """Gemma 2's logit soft-capping (Gemma Team 2024, "Gemma 2", section 2): cap * tanh(x / cap)
    keeps x inside (-cap, cap) and is close to the identity for |x| well below cap, so no score or
    logit can grow without bound. cap = 0 turns it off."""
    return cap * torch.tanh(x / cap) if cap else x


def causal_attention_scores(q, k, softcap=0.0):
    """The eager path's pre-softmax scores, (B, H, T, T): q k^T / sqrt(D), soft-capped, -inf above
    the diagonal. q and k are (B, H, T, D) with as many key heads as query heads."""
    T = q.shape[2]
    att = soft_cap((q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1]), softcap)
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return att.masked_fill(~mask, float("-inf"))


def at_least_fp32(dtype):
    """fp32 for the half-precision dtypes, the dtype itself otherwise (fp64 stays fp64):
    parallel.at_least_fp32's rule, written here too because model.py imports nothing of how it runs.
    """
    return torch.promote_types(dtype, torch.float32)


def causal_attention(q, k, v, impl, softcap=0.0, documents=None):
    """q: (B, T, H, D), k: (B, T, H_kv, D), v: (B, T, H_kv, D_v) with H a multiple of H_kv (D_v
    differs from D in MLA). softcap > 0 soft-caps every score (after the 1/sqrt(D) scale) before the
    softmax, which only 'flash' and 'eager' can (impl comes from choose_attn_impl, which never pairs
    'sdpa' with a cap). Returns (B, T, H, D_v). documents (a DocumentMask, doc_mask=True): a query
    sees only the keys of its own document."""
    if impl == "flash":
        from flash_attn import flash_attn_func  # lazily: see choose_attn_impl

        d, dv = q.shape[-1], v.shape[-1]
        # FlashAttention-2 wants one head size for q, k and v: pad the smaller with zeros
        if dv != d:
            if dv < d:  # (zero value columns give zero outputs, cut off below)
                v = F.pad(v, (0, d - dv))
            else:  # (zero query/key columns add nothing to the scores; the scale stays 1/sqrt(d))
                q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))
        capped = {"softcap": softcap} if softcap else {}  # flash-attn < 2.6 has no softcap argument
        if documents is None:
            # flash-attn takes GQA directly
            y = flash_attn_func(q, k, v, causal=True, softmax_scale=1.0 / math.sqrt(d), **capped)
        else:
            from flash_attn import flash_attn_varlen_func

            # every document its own causal sequence, the batch's rows end to end: (B * T, H, D)
            B, T = q.shape[:2]
            cu, n = documents.cu_seqlens, documents.max_seqlen
            y = flash_attn_varlen_func(
                q.flatten(0, 1),
                k.flatten(0, 1),
                v.flatten(0, 1),
                cu,
                cu,
                n,
                n,
                causal=True,
                softmax_scale=1.0 / math.sqrt(d),
                **capped,
            ).view(B, T, *q.shape[2:])
        return y[..., :dv]
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
    if group > 1:  # each key/value head serves `group` query heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    # every query sees itself, so no row of the mask is all hidden: no NaN
    if impl == "sdpa" and documents is not None:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=documents.visible)
    elif impl == "sdpa":
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # eager: written out, the reference the fused kernels must agree with, and the one that can cap
    else:
        att = causal_attention_scores(q, k, softcap)
        if documents is not None:
            att = att.masked_fill(~documents.visible, float("-inf"))
        y = att.softmax(dim=-1) @ v
    return y.transpose(1, 2)


# -----------------------------------------------------------------------------
# Document masking (doc_mask=True). The bins are documents laid end to end, each ended by the
# end-of-text token, and a training window cuts across several. Plain causal attention lets a token
# attend to the end of an unrelated earlier document; with doc_mask a query sees only the earlier
# keys of its own document, and RoPE positions restart at 0 with each document, so a document is
# processed exactly as if it began the window (as Llama 3 trains: Dubey et al. 2024, section 3.2).
# The end-of-text token belongs to the document it ends (it is predicted from that document; the
# token after it starts the next).
#
# Document ids and positions are built on the host with the batch (data.context_split), so that no
# kernel choice needs a device sync: SDPA gets a (B, 1, T, T) boolean mask, "same document and not
# later" (SDPA picks its memory-efficient kernel with a mask, not the flash one, so on old GPUs and
# CPU it costs a T x T mask per microbatch, built once per forward and shared by every layer);
# FlashAttention-2 gets the documents' offsets in the flattened batch (cu_seqlens) for its varlen
# kernel, which skips the hidden blocks and costs nothing extra; under context parallelism the ids
# travel with the keys and values as positions do (every rank holds every rank's ids on the host;
# context_parallel.py), and a chunk pair that hides every key is skipped or gives zeros, never NaN.
#
# Isolation is exact for dense models and for MoE without dropping: a token-choice router with a
# capacity (capacity_factor) queues the tokens of a whole microbatch, so an earlier document can
# take the capacity a later one would have had. That coupling stays.


@dataclass
class DocumentMask:
    """What attention needs to stop at documents, made once per forward (document_mask).
    ids: document ids, (B, T) on the model's device; under context parallelism (cp, B, T/cp) on
        the host.
    visible (sdpa, eager): (B, 1, T, T) bool, key in the query's document and not later.
    cu_seqlens, max_seqlen (flash): the documents' starts in the batch's rows laid end to end, plus
        the end, (n_documents + 1,) int32 on the device, and the longest document's length."""

    ids: torch.Tensor
    visible: torch.Tensor = None
    cu_seqlens: torch.Tensor = None
    max_seqlen: int = 0


def document_ids_and_positions(tokens, eot_token):
    """(documents, positions) of token ids (..., T), each shaped like tokens: the number of
    end-of-text tokens before each token in its row (the eot itself belongs to the document it
    ends), and its position inside its document, counted from 0."""
    ends = (tokens == eot_token).long()
    documents = ends.cumsum(-1) - ends
    index = torch.arange(tokens.shape[-1], device=tokens.device).expand_as(tokens)
    starts = torch.ones_like(tokens, dtype=torch.bool)  # a document starts at 0 and after every eot
    starts[..., 1:] = ends[..., :-1].bool()
    # each token's document start
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values
    return documents, index - first


def document_mask(documents, impl, device):
    """The DocumentMask of document ids (B, T)."""
    if impl == "flash":
        B, T = documents.shape
        starts = torch.ones_like(documents, dtype=torch.bool)
        starts[:, 1:] = documents[:, 1:] != documents[:, :-1]  # each row starts a document too
        offsets = starts.flatten().nonzero().flatten()
        cu = torch.cat([offsets, offsets.new_tensor([B * T])]).int()
        # from a host tensor, no sync; from a device one (the model derived the ids itself), .item()
        # syncs
        longest = int((cu[1:] - cu[:-1]).max())
        return DocumentMask(
            ids=documents.to(device, non_blocking=True),
            cu_seqlens=cu.to(device, non_blocking=True),
            max_seqlen=longest,
        )
    ids = documents.to(device, non_blocking=True)
    T = ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    visible = (ids[:, :, None] == ids[:, None, :]) & causal  # (B, T, T): query row, key column
    return DocumentMask(ids=ids, visible=visible[:, None])


class AttentionKernel(nn.Module):
    """Attention proper, softmax(q k^T / sqrt(D)) v over the causal (and document) mask, with the
    kernel choose_attn_impl chose; no parameters. It is its own module so that context parallelism
    can swap it for ring attention over the cp ranks' shares of the sequence
    (context_parallel.RingAttentionKernel), which reads the positions and document ids this one does
    not need."""

    def __init__(self, impl, softcap=0.0):
        super().__init__()
        self.impl, self.softcap = impl, softcap

    def document_mask(self, documents, device):
        """What this kernel needs to stop at documents, built once per forward from ids (B, T)."""
        return document_mask(documents, self.impl, device)

    def forward(self, q, k, v, positions=None, documents=None):
        return causal_attention(q, k, v, self.impl, self.softcap, documents)


# -----------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    """Zhang & Sennrich 2019: x / rms(x) * g, computed in fp32 for stability under bf16/fp16
    autocast."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.to(at_least_fp32(x.dtype))
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            x.dtype
        ) * self.weight


def make_norm(cfg, dim):
    """norm='rmsnorm' (Llama) or 'layernorm' (Ba et al. 2016, GPT-2: subtracts the mean too, and has
    a bias when bias=True). Gains start at 1, biases at 0 (see init_weights)."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, cfg.norm_eps)
    if cfg.norm == "layernorm":
        return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)
    raise ValueError(f"norm must be 'rmsnorm' or 'layernorm', got {cfg.norm!r}")


def llama3_scaled_frequencies(
    inv_freq, factor, low_freq_factor, high_freq_factor, original_context
):
    """Llama 3.1's RoPE scaling (Meta's llama-models, apply_scaling; transformers' rope_type
    'llama3'), which stretches a model pretrained on original_context tokens to a longer context.
    Per frequency w, of wavelength 2 pi / w:
        wavelength < original_context / high_freq_factor: kept. These rotate many times within the
            original context and encode local order.
        wavelength > original_context / low_freq_factor: w / factor. These never completed a turn in
            the original context, so they are slowed down (interpolated, Chen et al. 2023) to stay
            in range.
        in between: (1 - s) w / factor + s w, with
            s = (original_context / wavelength - low) / (high - low)
    """
    wavelength = 2 * math.pi / inv_freq
    smooth = (original_context / wavelength - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    scaled = torch.where(
        wavelength > original_context / low_freq_factor, inv_freq / factor, inv_freq
    )
    medium = (wavelength >= original_context / high_freq_factor) & (
        wavelength <= original_context / low_freq_factor
    )
    return torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def rope_scaling(cfg):
    """The Llama 3 scaling arguments of rope_cache, or None for plain RoPE (rope_scaling_factor =
    0)."""
    if not cfg.rope_scaling_factor:
        return None
    return (
        cfg.rope_scaling_factor,
        cfg.rope_low_freq_factor,
        cfg.rope_high_freq_factor,
        cfg.rope_original_context,
    )


def rope_cache(seq_len, head_dim, theta, scaling=None):
    """cos and sin of RoPE (Su et al. 2021), (T, head_dim/2), frequencies theta^(-2i/head_dim),
    rescaled as Llama 3 does when scaling = (factor, low_freq_factor, high_freq_factor,
    original_context)."""
    # on the host, also while the model is built on the meta device: a buffer is computed, not
    # initialised
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim
    )
    if scaling is not None:
        inv_freq = llama3_scaled_frequencies(inv_freq, *scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device="cpu"), inv_freq)
    return angles.cos().float(), angles.sin().float()


class Rotary(nn.Module):
    """RoPE's cos and sin for the model's tokens, from one cache of block_size positions (buffers
    that a checkpoint does not save). forward(positions): the first rows of the cache (every row's
    tokens at 0, 1, ...; apply_rope takes as many as the sequence has), or each token's own row when
    positions are given, (B, T) (doc_mask: positions restart with each document). Context
    parallelism wraps it so that it reads this rank's row of every rank's positions
    (context_parallel.apply_context_parallel)."""

    def __init__(self, cfg):
        super().__init__()
        dim = cfg.qk_rope_head_dim if cfg.attention == "mla" else attention_head_dim(cfg)
        cos, sin = rope_cache(cfg.block_size, dim, cfg.rope_theta, rope_scaling(cfg))
        # kept where the model is built (`with torch.device("cuda")`), or on the host under the meta
        # device
        where = torch.empty(0).device
        where = torch.device("cpu") if where.type == "meta" else where
        self.register_buffer("cos", cos.to(where), persistent=False)
        self.register_buffer("sin", sin.to(where), persistent=False)

    def forward(self, positions=None):
        if positions is None:
            return self.cos, self.sin
        # the copy does not block: no host-device sync
        positions = positions.to(self.cos.device, non_blocking=True)
        return self.cos[positions], self.sin[positions]


def apply_rope(x, cos, sin):
    """Rotate the two halves of each head: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). The half
    split (not interleaved pairs) is the convention of Hugging Face's Llama, so weights export as
    they are.
    x: (B, T, H, D); cos and sin: (T', D/2) for positions 0, 1, ... (T' >= T: the first T are
    used), or (B, T, D/2), each token's own (a context-parallel rank's tokens are not 0..T-1)."""
    T = x.shape[1]
    if cos.dim() == 2:
        cos, sin = cos[:T, None, :], sin[:T, None, :]  # (T, 1, D/2), broadcast over (B, T, H, D/2)
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # (B, T, 1, D/2)
    x1, x2 = x.to(at_least_fp32(x.dtype)).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def attention_head_dim(cfg):
    """The query/key/value head size of attention='mha': head_dim, or n_embd / n_head when it is 0.
    Real models decouple the two: Qwen3-0.6B has 16 heads of 128 in a width of 1024."""
    return cfg.head_dim or cfg.n_embd // cfg.n_head


def attention_dims(cfg):
    """(query/key head size, value head size): MLA's [nope ; rope] and v_head_dim, else
    attention_head_dim."""
    if cfg.attention == "mla":
        return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    return attention_head_dim(cfg), attention_head_dim(cfg)


class CausalSelfAttention(nn.Module):
    """Multi-head attention with n_kv_head key/value heads (Shazeer 2019 "Fast Transformer Decoding"
    for MQA, Ainslie et al. 2023 for GQA): q_proj makes n_head query heads, k_proj and v_proj
    n_kv_head each, and each key/value head serves n_head / n_kv_head query heads. The heads are
    counted from the projections' outputs, so the same forward runs a tensor-parallel rank's share
    of them (tensor_parallel.apply_tensor_parallel says how the heads are split).

    qk_norm=True applies RMSNorm to every query and key head before RoPE (Dehghani et al. 2023,
    "Scaling Vision Transformers to 22B Parameters"; OLMo 2, Gemma 3): the scores cannot blow up
    through the size of q and k, a known cause of loss spikes. Its gains (one per head dimension)
    are shared by all heads.

    The head size is attention_head_dim(cfg), so n_head * head_dim need not be n_embd (q_proj and
    o_proj are then not square). qkv_bias=True gives q, k and v a bias and o none (Qwen2); bias=True
    gives all four one. Attention itself is self.attend, an AttentionKernel (context parallelism
    swaps in ring attention); the projections, QK-norm and RoPE are per token."""

    def __init__(self, cfg, attn_impl="sdpa"):
        super().__init__()
        self.head_dim = attention_head_dim(cfg)
        kv_dim = cfg.n_kv_head * self.head_dim
        qkv_bias = cfg.bias or cfg.qkv_bias
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.n_embd, kv_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.n_embd, kv_dim, bias=qkv_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.o_proj = nn.Linear(cfg.n_head * self.head_dim, cfg.n_embd, bias=cfg.bias)
        self.attend = AttentionKernel(attn_impl, cfg.attn_softcap)

    def forward(self, x, cos, sin, positions=None, documents=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim)  # (B, T, H, D)
        k = self.k_proj(x).view(B, T, -1, self.head_dim)  # (B, T, H_kv, D)
        v = self.v_proj(x).view(B, T, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self.attend(q, k, v, positions, documents)
        return self.o_proj(y.flatten(2))


class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-AI 2024, "DeepSeek-V2", section 2.1), attention='mla'.

    Keys and values are rebuilt from one small latent per token, so a KV cache stores only that
    latent (kv_lora_rank numbers) and one RoPE key shared by all heads (qk_rope_head_dim numbers),
    instead of 2 * n_kv_head * head_dim:

        latent = kv_down(x) = [c_kv ; k_rope]      c_kv: kv_lora_rank, k_rope: qk_rope_head_dim
        [k_nope ; v] per head = kv_up(norm(c_kv))  qk_nope_head_dim and v_head_dim per head
        k = [k_nope ; rope(k_rope)]                the same k_rope for every head ("decoupled RoPE":
                                                   rotating k_nope would put a position-dependent
                                                   matrix between q and kv_up, which could then no
                                                   longer be folded into the query at inference)
        q = [q_nope ; rope(q_rope)] per head       from q_proj(x), or q_up(norm(q_down(x))) when
                                                   q_lora_rank > 0
        out = o_proj(softmax(q k^T / sqrt(qk_nope_head_dim + qk_rope_head_dim)) v)

    With qk_norm the per-head queries [q_nope ; q_rope] and keys [k_nope ; k_rope] are
    RMS-normalised before RoPE, as in CausalSelfAttention. n_kv_head does not apply: every head has
    its own k_nope and v. The heads are counted from q's and kv_up's outputs (a tensor-parallel rank
    holds some of them: tensor_parallel.apply_tensor_parallel). Under context parallelism what
    travels round the ring is the per-head keys and values, not the latent (context_parallel.py says
    why)."""

    def __init__(self, cfg, attn_impl="sdpa"):
        super().__init__()
        self.nope_dim, self.rope_dim, self.v_dim = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        self.kv_lora_rank = cfg.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        if cfg.q_lora_rank > 0:
            self.q_down = nn.Linear(cfg.n_embd, cfg.q_lora_rank, bias=cfg.bias)
            self.q_latent_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.q_up = nn.Linear(cfg.q_lora_rank, cfg.n_head * qk_dim, bias=cfg.bias)
        else:
            self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * qk_dim, bias=cfg.bias)
        self.kv_down = nn.Linear(cfg.n_embd, cfg.kv_lora_rank + self.rope_dim, bias=cfg.bias)
        self.kv_latent_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.kv_up = nn.Linear(
            cfg.kv_lora_rank, cfg.n_head * (self.nope_dim + self.v_dim), bias=cfg.bias
        )
        if cfg.qk_norm:
            self.q_norm = RMSNorm(qk_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(qk_dim, cfg.norm_eps)
        self.o_proj = nn.Linear(cfg.n_head * self.v_dim, cfg.n_embd, bias=cfg.bias)
        self.attend = AttentionKernel(attn_impl, cfg.attn_softcap)

    def compress_kv(self, x):
        """What a KV cache would store per token: (B, T, kv_lora_rank + qk_rope_head_dim)."""
        return self.kv_down(x)

    def forward(self, x, cos, sin, positions=None, documents=None):
        B, T, _ = x.shape
        q = (
            self.q_up(self.q_latent_norm(self.q_down(x)))
            if hasattr(self, "q_down")
            else self.q_proj(x)
        )
        q = q.view(B, T, -1, self.nope_dim + self.rope_dim)  # (B, T, H, nope + rope)
        c_kv, k_rope = self.compress_kv(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_up(self.kv_latent_norm(c_kv)).view(B, T, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # (B, T, H, nope), (B, T, H, v)
        # one k_rope for all heads
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(-1, -1, kv.shape[2], -1)], dim=-1)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        k_nope, k_rope = k.split([self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)
        k = torch.cat([k_nope, apply_rope(k_rope, cos, sin)], dim=-1)
        y = self.attend(q, k, v, positions, documents)  # (B, T, H, v)
        return self.o_proj(y.flatten(2))


def swiglu_hidden_size(n_embd, multiple_of=64):
    """Llama's SwiGLU width: 2/3 of GPT's 4x (three matrices instead of two keep the parameter
    count), rounded up to a multiple of 64 so it splits across tensor-parallel ranks and runs on
    fast matmul sizes."""
    hidden = int(2 * 4 * n_embd / 3)
    return (hidden + multiple_of - 1) // multiple_of * multiple_of


class SwiGLUMLP(nn.Module):
    """Shazeer 2020: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg):
        super().__init__()
        hidden = mlp_hidden_size(cfg)
        self.gate = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.up = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.down = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GeluMLP(nn.Module):
    """GPT-2's MLP (Radford et al. 2019), mlp='gelu': down(gelu(up(x))) with a 4 x n_embd hidden
    layer (or intermediate_size) and GELU's tanh approximation (Hendrycks & Gimpel 2016) as GPT-2
    used."""

    def __init__(self, cfg):
        super().__init__()
        hidden = mlp_hidden_size(cfg)
        self.up = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.down = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)

    def forward(self, x):
        return self.down(F.gelu(self.up(x), approximate="tanh"))


def mlp_hidden_size(cfg):
    """The MLP's hidden width: intermediate_size, or when it is 0 the width derived from n_embd (4
    n_embd for GELU, swiglu_hidden_size for SwiGLU). Real models choose their own (TinyLlama: 5632
    for 2048)."""
    if cfg.intermediate_size:
        return cfg.intermediate_size
    return 4 * cfg.n_embd if cfg.mlp == "gelu" else swiglu_hidden_size(cfg.n_embd)


def make_mlp(cfg):
    if cfg.mlp == "swiglu":
        return SwiGLUMLP(cfg)
    if cfg.mlp == "gelu":
        return GeluMLP(cfg)
    raise ValueError(f"mlp must be 'swiglu' or 'gelu', got {cfg.mlp!r}")


def expert_capacity_mask(expert_ids, n_expert, capacity):
    """Which token-to-expert assignments fit: expert_ids (N, k) lists each token's k experts, tokens
    in priority order. Every expert keeps its first `capacity` assignments in that order (row by
    row, a token's first choice before its second) and drops the rest. Returns a bool (N, k)."""
    onehot = F.one_hot(expert_ids.flatten(), n_expert)  # (N * k, E)
    slot = (onehot.cumsum(0) * onehot).sum(-1) - 1  # each assignment's place in its expert's queue
    return (slot < capacity).view_as(expert_ids)


class TokenWindow:
    """The tokens whose choices a MixtureOfExperts queues for capacity and counts for its balance
    loss: in one process, the forward's own. Context parallelism swaps in the whole window's (every
    cp rank's share: context_parallel.ContextWindow), so that the queue and the counts are those of
    one process."""

    def gather(self, choices):  # (T, B, k) -> the window's, (T_window, B, k)
        return choices

    def mine(self, window_verdicts):  # the window's (T_window, B, k) -> this forward's (T, B, k)
        return window_verdicts

    def total(self, counts):  # this forward's assignments per expert -> the window's
        return counts


class LocalExperts:
    """How a MixtureOfExperts reaches its experts when they are all in this process: the kept
    assignments, sorted by expert, go straight to run_local_experts. Expert parallelism swaps in the
    all-to-all (expert_parallel.ExpertParallelDispatch), whose bytes sent to other ranks bytes_sent
    counts: none here."""

    bytes_sent = 0

    def exchange_counts(self, counts):
        """counts, the kept assignments per expert, read to the host (.send): the one sync of the
        layer."""
        return SimpleNamespace(send=counts.tolist())

    def __call__(self, rows, splits, run_local_experts):
        return run_local_experts(rows, splits.send)


def count_per_expert(expert_ids, n):
    """How many of the (flat) expert_ids are 0, 1, ..., n - 1: a bincount that never reads the
    largest id back to the host (torch.bincount does, on a GPU)."""
    return torch.zeros(n, dtype=torch.long, device=expert_ids.device).scatter_add_(
        0, expert_ids, torch.ones_like(expert_ids)
    )


class MixtureOfExperts(nn.Module):
    """A Mixture-of-Experts MLP (n_expert > 0): a router sends each token to its top-k experts
    (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021), each
    expert an MLP like the dense one (mlp='swiglu' or 'gelu', intermediate_size wide when set).

        p = softmax(router(x))                          (N, n_expert), computed in fp32
        out = sum over the top-k experts e of p_e * expert_e(x)   (+ every shared expert's output)

    The top-k probabilities are used as they are, not renormalised (Switch, DeepSeek-V2; Qwen2-MoE's
    norm_topk_prob=False): the router then gets a gradient from the language-modelling loss even
    with k = 1.

    Capacity: with capacity_factor > 0 each expert takes at most ceil(capacity_factor * N * k /
    n_expert) of the N * k assignments of a micro-batch; the others are dropped and contribute
    nothing, so a token whose experts are all full passes through the block on its residual
    connection alone. Assignments queue by position in the sequence (all tokens at position 0 first,
    then 1, ...; a token's k choices one after the other), so whether a token is dropped depends
    only on tokens at its position or before: the model stays causal. A batch-major queue, or
    GShard's ranking of every first choice before any second choice, would let later tokens push
    earlier ones out. capacity_factor = 0 is dropless routing: every assignment is kept, the expert
    batches are as large as routing makes them (MegaBlocks, Gale et al. 2023; what the transformers
    models compute, so only a dropless model exports: export_hf.py).

    Experts run only on their own tokens: the kept assignments are sorted by expert (the dropped
    ones last, cut off by count, so no boolean indexing syncs), each expert takes its contiguous
    group of tokens, and the weighted outputs are added back with index_add. Reading the group sizes
    is the one host-device sync, once per layer (expert_parallel.exchange_expert_counts).

    Auxiliary losses (weighted; forward leaves their sum in self.aux_loss, which Transformer.forward
    adds to the training loss):
      load balancing (Switch eq. 4, with f counting all k choices):
        aux_loss_coef * n_expert * sum_e f_e P_e, f_e the fraction of assignments routed to e
        (before capacity), P_e the mean router probability of e. It is 1 (times the coefficient)
        for a perfectly balanced router, larger otherwise.
      router z-loss (ST-MoE, Zoph et al. 2022), which keeps the router's logits small:
        router_z_loss_coef * mean(logsumexp(router logits)^2).
    n_shared_expert experts see every token, outside the routing (DeepSeekMoE, Dai et al. 2024).

    How the layer runs under each layout, where that layout is applied: tensor parallelism splits
    every expert like the dense MLP and keeps the router replicated
    (tensor_parallel.apply_tensor_parallel); context parallelism makes the capacity queue and the
    balance counts the window's (self.window, context_parallel.apply_context_parallel); expert
    parallelism keeps this rank's experts, keyed by their global index, and sends the kept
    assignments to their experts' ranks and back (self.dispatch,
    expert_parallel.apply_expert_parallel). Routing, capacity, the auxiliary losses and the dropped
    fraction are computed where the tokens are, exactly as in one process."""

    def __init__(self, cfg):
        super().__init__()
        self.n_expert, self.k, self.capacity_factor = (
            cfg.n_expert,
            cfg.n_expert_per_token,
            cfg.capacity_factor,
        )
        self.aux_loss_coef, self.router_z_loss_coef = cfg.aux_loss_coef, cfg.router_z_loss_coef
        self.router = nn.Linear(cfg.n_embd, cfg.n_expert, bias=False)
        self.experts = nn.ModuleDict({str(e): make_mlp(cfg) for e in range(cfg.n_expert)})
        self.shared_experts = nn.ModuleList(make_mlp(cfg) for _ in range(cfg.n_shared_expert))
        self.window, self.dispatch = TokenWindow(), LocalExperts()
        # set by each forward: the auxiliary loss (part of the graph), and statistics for the
        # training log
        self.aux_loss = self.last_dropped_frac = self.last_tokens_per_expert = None
        self.last_load = (
            None  # this forward's kept assignments per expert, host list (the split sizes)
        )
        # what the training log reads (metrics.moe_metrics) and resets: the assignments per expert
        # of the training forwards (added by Transformer.forward)
        self.step_load = [0] * cfg.n_expert

    def forward(self, x):
        B, T, D = x.shape
        tokens = x.transpose(0, 1).reshape(T * B, D)  # position-major, the capacity queue's order
        N, E = tokens.shape[0], self.n_expert
        # routing decisions in fp32 (ST-MoE, section 3)
        with torch.autocast(x.device.type, enabled=False):
            fp32 = at_least_fp32(tokens.dtype)
            # (N, E); the router's weight is fp32 (fp64 in a float64 run)
            logits = self.router(tokens.to(fp32))
        probs = logits.softmax(dim=-1)
        gate, expert = probs.topk(self.k, dim=-1)  # (N, k) each
        if self.capacity_factor == 0:  # dropless
            keep = window_keep = torch.ones_like(expert, dtype=torch.bool)
        # queue the window's choices (this forward's, or every cp rank's), keep this rank's verdicts
        else:
            window = self.window.gather(expert.view(T, B, self.k))  # (T_window, B, k)
            capacity = math.ceil(self.capacity_factor * window.numel() / E)
            window_keep = expert_capacity_mask(window.reshape(-1, self.k), E, capacity)
            keep = self.window.mine(window_keep.view(window.shape)).reshape(N, self.k)

        # every assignment sorted by expert, the dropped ones last (as expert E, cut off by count)
        target = expert.masked_fill(~keep, E).flatten()  # (N * k,)
        order = target.argsort(stable=True)
        counts = count_per_expert(target, E + 1)[:E]  # kept assignments per expert
        splits = self.dispatch.exchange_counts(counts)  # host-device sync: the split sizes
        n_kept = sum(splits.send)
        token_idx = order[:n_kept] // self.k
        gate_of = gate.flatten()[order[:n_kept]]
        y = self.dispatch(tokens[token_idx], splits, self.run_local_experts)
        out = torch.zeros_like(tokens).index_add(
            0, token_idx, (y * gate_of.unsqueeze(-1).to(y.dtype)).to(tokens.dtype)
        )
        for shared in self.shared_experts:
            out = out + shared(tokens)

        routed = self.window.total(count_per_expert(expert.flatten(), E).to(probs.dtype))
        routed = routed / routed.sum()  # f_e, over the window's N * k assignments
        # P_e as the mean over this rank's tokens: every cp rank holds as many, so this is its share
        aux = self.aux_loss_coef * E * (routed * probs.mean(0)).sum()
        if self.router_z_loss_coef:
            aux = aux + self.router_z_loss_coef * torch.logsumexp(logits, dim=-1).pow(2).mean()
        self.aux_loss = aux
        self.last_dropped_frac = 1.0 - window_keep.float().mean()
        self.last_tokens_per_expert, self.last_load = counts, splits.send
        return out.view(T, B, D).transpose(0, 1)

    def run_local_experts(self, x, sizes):
        """This rank's experts in order, the e-th on the next sizes[e] rows of x; their outputs
        stacked."""
        # Every expert runs, one without tokens on zero rows: its weights then get their (zero)
        # gradient during backward, at the same point on every rank, so that the gradient buckets
        # fill, and ZeRO-2/3 launch their reduce-scatters between the same gathers and all-to-alls,
        # on a rank whose expert got no token as on one whose did (zero.py). On zero rows a tp
        # all-reduce moves nothing.
        return torch.cat(
            [expert(rows) for expert, rows in zip(self.experts.values(), x.split(sizes))]
        )

    def count_load(self):
        """Add the last forward's assignments per expert to the step's (Transformer.forward calls it
        once per training forward: a checkpointed block's forward runs again in backward and must
        not count twice)."""
        self.step_load = [a + b for a, b in zip(self.step_load, self.last_load)]


class Block(nn.Module):
    """One pre-norm transformer block.

    Sequential (GPT-2, Llama):  x = x + attn(norm1(x));  x = x + mlp(norm2(x))
    Parallel (parallel_block=True; GPT-J, Wang & Komatsuzaki 2021; PaLM, Chowdhery et al. 2022, sec.
    2):
                                x = x + attn(norm(x)) + mlp(norm(x))   with one norm
    The parallel form lets attention and MLP start from the same input, so their input matmuls can
    be fused and, under tensor parallelism, their two output all-reduces merged into one (PaLM
    reports ~15% faster training at scale). Here they stay two separate layers, each with its own
    all-reduce.

    positions: each token's position, for ring attention (context parallelism) and doc_mask;
    documents: what the attention kernel needs to stop at documents (AttentionKernel.document_mask).
    """

    def __init__(self, cfg, attn_impl="sdpa"):
        super().__init__()
        self.parallel = cfg.parallel_block
        self.attn_norm = make_norm(cfg, cfg.n_embd)
        if cfg.attention == "mla":
            self.attn = MultiHeadLatentAttention(cfg, attn_impl)
        elif cfg.attention == "mha":
            self.attn = CausalSelfAttention(cfg, attn_impl)
        else:
            raise ValueError(f"attention must be 'mha' or 'mla', got {cfg.attention!r}")
        if not self.parallel:
            self.mlp_norm = make_norm(cfg, cfg.n_embd)
        self.mlp = MixtureOfExperts(cfg) if cfg.n_expert > 0 else make_mlp(cfg)

    def forward(self, x, cos, sin, positions=None, documents=None):
        if self.parallel:
            h = self.attn_norm(x)
            return x + self.attn(h, cos, sin, positions, documents) + self.mlp(h)
        x = x + self.attn(self.attn_norm(x), cos, sin, positions, documents)
        return x + self.mlp(self.mlp_norm(x))


# -----------------------------------------------------------------------------
# The loss without the logits. With a 50k vocabulary the (B*T, V) logits are by far the largest
# tensors of a small model (B=8, T=256: 412 MB in fp32), and a plain F.cross_entropy makes several
# of them (logits, log-softmax, their gradients). On CPU each is fresh memory the kernel must fault
# in page by page, every step. Computing the loss a chunk of tokens at a time, and the head's
# gradients right there while the chunk's softmax is at hand, keeps one small chunk of logits alive
# instead.


def loss_chunk_size(vocab_size, budget_bytes=128 * 2**20):
    """Tokens per chunk: as many as keep one chunk's fp32 logits within budget_bytes, a multiple of
    64 and at least 64 rows. Fewer, larger chunks cost less: each chunk adds its gradient into the
    whole (V, C) weight gradient, one more pass over it; one chunk's buffer is allocated once per
    call and reused."""
    return max(64, budget_bytes // (4 * vocab_size) // 64 * 64)


def _chunked_cross_entropy(h, weight, targets, vocab_size, softcap, ignore_index, need_grads):
    """The summed cross-entropy of softmax(h @ weight[:vocab_size]^T) over the tokens, chunk by
    chunk, in fp32 (fp64 in a float64 run); with need_grads also its gradients for h and weight
    (rows past vocab_size, padding, get zero). h: (N, C), weight: (V_padded, C), targets: (N,)."""
    device_type = h.device.type
    compute = (
        torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else h.dtype
    )
    fp32 = at_least_fp32(compute)
    with torch.autocast(device_type, enabled=False):  # the casts autocast would make, made explicit
        h_c, w_c = h.to(compute), weight[:vocab_size].to(compute)
        N = h.shape[0]
        chunk = min(N, loss_chunk_size(vocab_size))
        # reused by every chunk
        logits_buf = torch.empty(chunk, vocab_size, dtype=compute, device=h.device)
        # in half precision the chunk's fp32 logits have a buffer of their own, reused likewise (a
        # fresh copy each chunk kept two of them alive as the next replaced the last), and the half
        # buffer takes the chunk's gradient back for the matmuls
        z_buf = (
            None if compute == fp32 else torch.empty(chunk, vocab_size, dtype=fp32, device=h.device)
        )
        # the soft cap's derivative 1 - tanh^2, reused likewise
        dcap_buf = torch.empty(chunk, vocab_size, dtype=fp32, device=h.device) if softcap else None
        loss = torch.zeros((), dtype=fp32, device=h.device)
        grad_h = torch.empty_like(h_c) if need_grads else None
        grad_w = torch.zeros_like(weight, dtype=fp32) if need_grads else None
        for start in range(0, N, chunk):
            rows = slice(start, min(start + chunk, N))
            n = rows.stop - start
            z = torch.mm(h_c[rows], w_c.t(), out=logits_buf[:n])
            z = z if z_buf is None else z_buf[:n].copy_(z)  # (n, V), fp32
            if softcap:  # z = softcap * tanh(z / softcap) (Gemma 2), whose derivative is 1 - tanh^2
                tanh = z.div_(softcap).tanh_()
                dcap = torch.square(tanh, out=dcap_buf[:n]).neg_().add_(1.0)
                z = tanh.mul_(softcap)
            t = targets[rows]
            valid = t != ignore_index
            t = t.masked_fill(~valid, 0).unsqueeze(1)
            z_max = z.amax(dim=1, keepdim=True)
            z_target = z.gather(1, t)
            probs = z.sub_(z_max).exp_()  # in place: from here z holds exp(z - max)
            sum_exp = probs.sum(dim=1, keepdim=True)
            loss += ((sum_exp.log() + z_max - z_target).squeeze(1) * valid).sum()
            # d loss_i / d z_i = softmax(z_i) - onehot(target_i), zero for ignored tokens
            if need_grads:
                grad_z = probs.div_(sum_exp)
                grad_z.scatter_add_(1, t, torch.full_like(z_target, -1.0))
                grad_z.mul_(valid.unsqueeze(1))
                if softcap:
                    grad_z.mul_(dcap)
                grad_z_c = grad_z if z_buf is None else logits_buf[:n].copy_(grad_z)
                torch.mm(grad_z_c, w_c, out=grad_h[rows])
                if compute == fp32:
                    grad_w[:vocab_size].addmm_(grad_z.t(), h_c[rows])
                else:
                    grad_w[:vocab_size] += grad_z_c.t() @ h_c[rows]
    return loss, grad_h, grad_w


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of the logits h @ weight[:vocab_size]^T against targets (ignore_index left
    out of the mean), without the (N, V) logits: the gradients are computed in the forward pass,
    chunk by chunk, and the backward pass only scales them by the incoming gradient (one backward
    per forward)."""

    @staticmethod
    def forward(ctx, h, weight, targets, vocab_size, softcap, ignore_index):
        loss_sum, grad_h, grad_w = _chunked_cross_entropy(
            h, weight, targets, vocab_size, softcap, ignore_index, need_grads=True
        )
        count = (targets != ignore_index).sum().clamp(min=1)
        ctx.save_for_backward(grad_h, grad_w, count)
        ctx.h_dtype, ctx.weight_dtype = h.dtype, weight.dtype
        return loss_sum / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w, count = ctx.saved_tensors
        scale = grad_loss.to(at_least_fp32(grad_loss.dtype)) / count
        return (
            (grad_h.to(scale.dtype) * scale).to(ctx.h_dtype),
            grad_w.mul_(scale).to(ctx.weight_dtype),
            None,
            None,
            None,
            None,
        )


def chunked_cross_entropy(h, weight, targets, vocab_size=None, softcap=0.0, ignore_index=-1):
    """F.cross_entropy(logits, targets, ignore_index=ignore_index) for logits = h @
    weight[:vocab_size].T, soft-capped when softcap > 0, with h (N, C) and weight (V, C), computed
    in chunks of tokens (see above). Under torch.no_grad it computes the loss only."""
    vocab_size = vocab_size or weight.shape[0]
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return ChunkedLinearCrossEntropy.apply(
            h, weight, targets, vocab_size, softcap, ignore_index
        )
    loss_sum, _, _ = _chunked_cross_entropy(
        h, weight, targets, vocab_size, softcap, ignore_index, need_grads=False
    )
    return loss_sum / (targets != ignore_index).sum().clamp(min=1)


# -----------------------------------------------------------------------------
# The model


def choice_problems(cfg):
    """config_problems' sentences about the settings that name one of a few pieces."""
    problems = []
    for key, allowed in (
        ("attention", ("mha", "mla")),
        ("norm", ("rmsnorm", "layernorm")),
        ("mlp", ("swiglu", "gelu")),
    ):
        value = getattr(cfg, key)
        if value not in allowed:
            problems.append(f"{key} = {value!r} must be one of {', '.join(map(repr, allowed))}")
    return problems


def attention_problems(cfg):
    """config_problems' sentences about the attention heads: MLA's sizes, or MHA's head size and
    key/value heads."""
    problems = []
    if cfg.attention == "mla":
        if cfg.qk_rope_head_dim <= 0 or cfg.qk_rope_head_dim % 2:
            problems.append(
                f"qk_rope_head_dim = {cfg.qk_rope_head_dim} must be positive and even for RoPE"
            )
        for key in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            if getattr(cfg, key) <= 0:
                problems.append(
                    f"{key} = {getattr(cfg, key)} must be positive with attention='mla'"
                )
        if cfg.q_lora_rank < 0:
            problems.append(
                f"q_lora_rank = {cfg.q_lora_rank} must be 0 (full-rank queries) or positive"
            )
        problems += [
            f"{key} = {getattr(cfg, key)!r} applies to attention='mha' only (MLA's head sizes are "
            f"qk_nope_head_dim, qk_rope_head_dim and v_head_dim; bias=True gives it biases)"
            for key in ("head_dim", "qkv_bias")
            if getattr(cfg, key)
        ]
    elif cfg.head_dim:
        if cfg.head_dim % 2:
            problems.append(f"head_dim = {cfg.head_dim} must be even for RoPE")
    elif cfg.n_embd % cfg.n_head:
        problems.append(
            f"n_embd = {cfg.n_embd} must be divisible by n_head = {cfg.n_head} (or set head_dim)"
        )
    elif (cfg.n_embd // cfg.n_head) % 2:
        problems.append(
            f"the head size n_embd / n_head = {cfg.n_embd // cfg.n_head} must be even for RoPE"
        )
    if cfg.attention == "mha" and cfg.n_head % cfg.n_kv_head:
        problems.append(f"n_head = {cfg.n_head} must be divisible by n_kv_head = {cfg.n_kv_head}")
    return problems


def rope_problems(cfg):
    """config_problems' sentences about Llama 3.1's RoPE scaling (llama3_scaled_frequencies)."""
    problems = []
    if not cfg.rope_scaling_factor:
        return problems
    if not 0 < cfg.rope_low_freq_factor < cfg.rope_high_freq_factor:
        problems.append(
            f"rope_low_freq_factor = {cfg.rope_low_freq_factor} and rope_high_freq_factor = "
            f"{cfg.rope_high_freq_factor} must satisfy 0 < low < high (Llama 3.1: 1 and 4)"
        )
    if cfg.rope_original_context <= 0:
        problems.append(
            f"rope_original_context = {cfg.rope_original_context} must be positive (the "
            f"context the model was pretrained at before scaling; Llama 3.1: 8192)"
        )
    return problems


def moe_problems(cfg):
    """config_problems' sentences about the mixture of experts."""
    problems = []
    if cfg.n_expert < 0 or cfg.n_shared_expert < 0:
        problems.append(
            f"n_expert = {cfg.n_expert} and n_shared_expert = {cfg.n_shared_expert} must be >= 0"
        )
    if cfg.n_expert > 0:
        if not 1 <= cfg.n_expert_per_token <= cfg.n_expert:
            problems.append(
                f"n_expert_per_token = {cfg.n_expert_per_token} must be between 1 and "
                f"n_expert = {cfg.n_expert}"
            )
        if cfg.capacity_factor < 0:
            problems.append(
                f"capacity_factor = {cfg.capacity_factor} must be positive (1.0 fits a perfectly "
                f"balanced router exactly; 1.25 is usual) or 0 (dropless: no token is dropped)"
            )
        if cfg.aux_loss_coef < 0 or cfg.router_z_loss_coef < 0:
            problems.append(
                f"aux_loss_coef = {cfg.aux_loss_coef} and "
                f"router_z_loss_coef = {cfg.router_z_loss_coef} "
                f"must be >= 0 (a negative weight trains the router towards imbalance)"
            )
    return problems


def config_problems(cfg):
    """What makes the model impossible to build from cfg, whatever the layout: a list of sentences,
    each saying what must hold (settings.check_layout adds the layout's and stops on any)."""
    problems = choice_problems(cfg) + attention_problems(cfg) + rope_problems(cfg)
    if cfg.attn_softcap < 0 or cfg.final_softcap < 0:
        problems.append(
            f"attn_softcap = {cfg.attn_softcap} and final_softcap = {cfg.final_softcap} "
            f"must be >= 0 (0 = off)"
        )
    problems += moe_problems(cfg)
    if cfg.doc_mask and not 0 <= cfg.eot_token < cfg.vocab_size:
        problems.append(
            f"doc_mask=True needs the end-of-text id that separates the documents, eot_token, "
            f"in the vocabulary of {cfg.vocab_size}; it is {cfg.eot_token}: prepare the data with "
            f"prepare_data.py (its meta.json names it), or set --eot_token"
        )
    return problems


def padded_vocab_size(vocab_size):
    """The embedding's and the head's rows: the vocabulary rounded up to a multiple of 64, which
    keeps their matmuls on fast kernel sizes (nanoGPT's 50257 -> 50304); tensor parallelism pads to
    64 per rank (parallel.split_vocab_size). The extra rows are never a target: NextTokenLoss cuts
    their logits off, the embedding never looks them up, so they stay zero and take no gradient."""
    return (vocab_size + 63) // 64 * 64


class NextTokenLoss(nn.Module):
    """The head's logits (soft-capped: final_softcap) and their mean cross-entropy against the
    targets, ignore_index -1 left out of the mean; no parameters. forward(h, head, targets) ->
    (logits, loss): loss None without targets; logits None under the chunked loss (chunked=True with
    targets), which computes the loss from h and the head's weight without them. Tensor parallelism
    swaps it for the vocab-parallel loss (tensor_parallel.VocabParallelLoss), context parallelism
    wraps it to give this rank's share (context_parallel.ContextParallelLoss)."""

    def __init__(self, vocab_size, softcap=0.0, chunked=False):
        super().__init__()
        self.vocab_size, self.softcap, self.chunked = vocab_size, softcap, chunked

    def forward(self, h, head, targets=None):
        if targets is not None and self.chunked:
            return None, chunked_cross_entropy(
                h.reshape(-1, h.shape[-1]),
                head.weight,
                targets.reshape(-1),
                vocab_size=self.vocab_size,
                softcap=self.softcap,
            )
        # drop the padded vocabulary columns: they are not tokens and must not enter the softmax
        logits = soft_cap(head(h)[..., : self.vocab_size], self.softcap)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(
            logits.flatten(0, -2).to(at_least_fp32(logits.dtype)),
            targets.reshape(-1),
            ignore_index=-1,
        )


class Transformer(nn.Module):
    """The whole model, built from its config alone (attn_impl, a kernel choose_attn_impl chose;
    'auto' picks as for a CPU; chunked_loss, the loss without whole logits: how it runs, not what it
    computes).

    forward(x, targets=None, positions=None, documents=None, chunk=0) returns (output, loss):
        x           token ids (B, T); a chunk that does not start at block 0 (a later pipeline
                    stage) takes the previous chunk's hidden states (B, T, n_embd) instead
        positions   None, or with doc_mask each token's position in its document, (B, T); under
                    context parallelism every cp rank's (context_parallel.py)
        documents   doc_mask=True: each token's document id, shaped like positions, on the host
                    (document_ids_and_positions; data.context_split builds both with the batch).
                    Given neither, the first chunk derives both from x itself. Without doc_mask:
                    None.
        output      the logits (B, T, vocab_size) on the chunk that ends the model; None instead
                    when the chunked loss computes the loss without them. On other chunks the
                    hidden states.
        loss        with targets, on the chunk that ends the model: the mean cross-entropy, plus
                    the MoE auxiliary losses while training. On other chunks: their auxiliary loss
                    (a scalar the pipeline backpropagates from there), None for a dense model or in
                    eval mode.
    In eval mode (model.eval()) the auxiliary losses are left out, so a validation loss is the plain
    cross-entropy, comparable with a dense model's.

    chunk_layers, the one pipeline hook: the global indices of the blocks each chunk runs, [all of
    them] here. The pipeline keeps this rank's blocks (parallel.apply_pipeline sets it, and removes
    the embedding, the final norm and the head from the ranks that do not run them). A chunk whose
    first block is block 0 embeds, one whose last block is the last runs the final norm, the head
    and the loss. Blocks are keyed by their global index, so a parameter has the same name wherever
    it is held.

    Tied embeddings: the head is the embedding's own tensor. When the pipeline puts them on
    different ranks each holds a copy; `tied_copies()` names it for the checkpoint and the gradient
    norm, init_weights draws it under the embedding's name, and the training step keeps the two
    equal by summing their gradients (parallel.sync_tied_grads)."""

    def __init__(self, cfg, *, attn_impl="auto", chunked_loss=False):
        super().__init__()
        # flash needs its device checked, which the caller's choose_attn_impl did
        if attn_impl != "flash":
            attn_impl, _ = choose_attn_impl(attn_impl, "cpu", torch.float32, cfg.attn_softcap)
        self.cfg = cfg
        vocab_rows = padded_vocab_size(cfg.vocab_size)
        self.tok_emb = nn.Embedding(vocab_rows, cfg.n_embd)
        self.blocks = nn.ModuleDict({str(i): Block(cfg, attn_impl) for i in range(cfg.n_layer)})
        self.norm = make_norm(cfg, cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, vocab_rows, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # one tensor, one gradient
        for table in (self.tok_emb.weight, self.lm_head.weight):
            # rows past it are padding: zero at init, and a checkpoint's may differ
            table.vocab_size = cfg.vocab_size
        self.rope = Rotary(cfg)
        self.loss = NextTokenLoss(cfg.vocab_size, cfg.final_softcap, chunked_loss)
        self.chunk_layers = [list(range(cfg.n_layer))]

    def forward(self, x, targets=None, positions=None, documents=None, chunk=0):
        layers = self.chunk_layers[chunk]
        starts, ends = layers[0] == 0, layers[-1] == self.cfg.n_layer - 1
        if starts and self.cfg.doc_mask and documents is None and positions is None:
            # derived from the tokens, on x's device
            documents, positions = document_ids_and_positions(x, self.cfg.eot_token)
        if (documents is None) == self.cfg.doc_mask:
            raise ValueError(
                f"Transformer.forward: documents (each token's document id, shaped like "
                f"positions) must be given exactly with doc_mask=True "
                f"(doc_mask = {self.cfg.doc_mask} here; the first chunk derives them from the "
                f"tokens when neither is given)"
            )
        if starts:
            if x.shape[1] > self.cfg.block_size:
                raise ValueError(
                    f"sequence of length {x.shape[1]} is longer than "
                    f"block_size {self.cfg.block_size}"
                )
            x = self.tok_emb(x)
        cos, sin = self.rope(positions)
        blocks = [self.blocks[str(i)] for i in layers]
        mask = (
            None
            if documents is None
            else blocks[0].attn.attend.document_mask(documents, cos.device)
        )
        for block in blocks:
            x = block(x, cos, sin, positions, mask)
        aux = None
        if self.training:
            aux = self.moe_aux_loss(blocks)
            # this chunk's layers only: a pipeline's other chunks run separately
            for block in blocks:
                if isinstance(block.mlp, MixtureOfExperts):
                    block.mlp.count_load()
        if not ends:
            return x, aux
        logits, loss = self.loss(self.norm(x), self.lm_head, targets)
        return logits, (loss + aux if loss is not None and aux is not None else loss)

    def moe_layers(self):
        """{block index: its MixtureOfExperts} of the blocks held here (empty for a dense model)."""
        return {
            int(i): block.mlp
            for i, block in self.blocks.items()
            if isinstance(block.mlp, MixtureOfExperts)
        }

    def moe_aux_loss(self, blocks=None):
        """The sum of the MoE auxiliary losses of `blocks` (default: all held here) from the forward
        pass just run (None if dense)."""
        blocks = self.blocks.values() if blocks is None else blocks
        losses = [block.mlp.aux_loss for block in blocks if isinstance(block.mlp, MixtureOfExperts)]
        return sum(losses) if losses else None

    def expert_parameters(self):
        """{name: parameter} of the routed experts, the parameters expert parallelism spreads over
        the ep ranks (a rank holds n_expert / ep of them, named by their global index). Their
        replicas are the dp / ep ranks holding the same experts, not the dp ranks: their gradients
        are averaged over those, ZeRO-1 shards them over those, the gradient norm and the parameter
        count count them once per expert, and a checkpoint saves them once per expert."""
        return {
            f"blocks.{i}.mlp.experts.{name}": p
            for i, moe in self.moe_layers().items()
            for name, p in moe.experts.named_parameters()
        }

    def tied_copies(self):
        """{name of a parameter here: name of the weight it copies}: the head's weight where the
        pipeline left the head without the embedding, under tie_embeddings. A checkpoint saves the
        original only, the gradient norm counts it once, and the copy loads from the original."""
        if self.cfg.tie_embeddings and self.lm_head is not None and self.tok_emb is None:
            return {"lm_head.weight": "tok_emb.weight"}
        return {}

    @torch.no_grad()
    def init_weights(self, seed, full_shape=lambda p: p.shape, share=lambda full, p: full):
        """Every parameter's full tensor is drawn from its own generator, seeded by (seed, name),
        and this rank keeps its share, share(full, p) (full_shape(p): the full tensor's shape; a
        layout that splits parameters passes its own, build.init_shares): the same seed gives the
        same full model whatever the layout (a tied copy is drawn under the name of the weight it
        copies). Linear and embedding weights are N(0, 0.02) (GPT-2), residual output projections
        (attention's o_proj, the MLPs' down) N(0, 0.02/sqrt(2 n_layer)), norm gains 1, biases 0,
        padded vocabulary rows 0. The draws are made on the CPU whatever device the model is on (a
        CUDA generator would draw other numbers), so a model built on the GPU gets the same weights
        as on the CPU. One full tensor at a time: a rank never holds more than its share plus the
        largest full tensor."""
        copies = self.tied_copies()
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            if name.endswith("bias"):
                p.zero_()
                continue
            name = copies.get(name, name)
            g = torch.Generator(device="cpu").manual_seed(
                (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**62
            )
            shape = full_shape(p)
            # on the CPU even inside a `with torch.device("cuda")` block
            full = torch.zeros(shape, device="cpu")
            rows = getattr(p, "vocab_size", shape[0])  # only real tokens get random rows
            # GPT-2's depth-scaled residual init
            residual = name.endswith((".o_proj.weight", ".down.weight"))
            full[:rows].normal_(
                0.0, 0.02 / math.sqrt(2 * self.cfg.n_layer) if residual else 0.02, generator=g
            )
            p.copy_(share(full, p))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Sample max_new_tokens tokens after idx (B, T), on a single-process model. top_k=1 is
        greedy."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.cfg.block_size :]
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


def takes_muon(name, param):
    """With optimizer='muon', the parameters Muon updates: the 2-D weights inside the blocks
    (attention and MLP projections, experts; q, k and v are separate matrices). Not the MoE router,
    which maps a hidden state to one score per expert as the head maps it to one per token; the
    embedding and the head sit outside the blocks, norm gains and biases are 1-D: all of those take
    AdamW."""
    return name.startswith("blocks.") and param.dim() == 2 and not name.endswith("router.weight")


# -----------------------------------------------------------------------------
# How it runs, applied to a built model like a layout: activation checkpointing and torch.compile,
# block by block.


def apply_activation_checkpointing(model):
    """Recompute each block's activations during backward, keeping only its input (Chen et al. 2016,
    "Training Deep Nets with Sublinear Memory Cost"): the block's forward is wrapped in place, so no
    parameter is renamed. Outside autograd (evaluation) a block runs as it is."""
    for block in model.blocks.values():
        block.forward = functools.partial(checkpointed, block.forward)
    return model


def checkpointed(forward, *args):
    """forward(*args), its activations recomputed in backward (torch.utils.checkpoint,
    non-reentrant)."""
    if not torch.is_grad_enabled():
        return forward(*args)
    return checkpoint(forward, *args, use_reentrant=False)


def compile_blocks(model):
    """torch.compile each transformer block in place, one block at a time (train.py's compile=True);
    returns True. Every block runs the same code on the same shapes, and its parameters are the
    compiled graph's inputs rather than constants, so dynamo traces one graph that every block
    reuses: compile time is one block's at any depth, where torch.compile(model) unrolls the loop
    over the blocks into one graph that grows with n_layer. The embedding, the document mask's
    host-side offsets, the final norm and the chunked loss (a loop of large matmuls, nothing to
    fuse) stay eager, outside any graph; evaluation runs the compiled blocks too (one more graph,
    without autograd). The parameters are graph inputs by default from torch 2.5 (dynamo's
    inline_inbuilt_nn_modules; before it each block would compile anew). The compiled forward is an
    attribute of the block instance, so no parameter is renamed (a compiled module would prefix them
    with _orig_mod.) and uncompile_blocks undoes it. The block's own hooks stay outside the graph
    (nn.Module.__call__ runs them around forward): under ZeRO-3 the all-gather before, the free
    after and the re-gather before backward run eagerly around the compiled code, which sees
    parameters whose storage is filled whenever it runs."""
    for block in model.blocks.values():
        # activation checkpointing's wrapper, or None for Block.forward
        eager = block.__dict__.get("forward")
        block.forward = torch.compile(block.forward)
        block.forward.eager = eager
    return True


def uncompile_blocks(model):
    """Undo compile_blocks; returns False (the blocks are not compiled any more)."""
    for block in model.blocks.values():
        eager = block.forward.eager
        if eager is None:
            del block.forward  # Block.forward, the class's own, again
        else:
            block.forward = eager
    return False
