"""
Export a picotron checkpoint to a Hugging Face transformers model directory.

    python export_hf.py --out_dir=out --hf_dir=hf/my-model
    python -c "import transformers as t; t.AutoModelForCausalLM.from_pretrained('hf/my-model')"

The newest complete checkpoint in out_dir, or the one --ckpt names (saved at any dp x tp x pp
layout), is loaded into one process, its weights are renamed to the transformers names and written
as config.json + model.safetensors, with the GPT-2 tokenizer files when the model uses GPT-2's
vocabulary. The export is then reloaded in transformers and its logits compared with picotron's
(--check=False skips that).

Which architecture holds which model (each computes exactly what picotron computes):
    the base model: RMSNorm, SwiGLU, RoPE,
      MHA/GQA/MQA, tied or untied                      LlamaForCausalLM
      + bias=True (attention and MLP linears)          LlamaForCausalLM (attention_bias, mlp_bias)
      + qkv_bias=True (q, k and v only)                Qwen2ForCausalLM
      + qk_norm=True (RMSNorm on each q and k head)    Qwen3ForCausalLM
      + attn_softcap and/or final_softcap (tanh)       VaultGemmaForCausalLM
      + attention='mla' (multi-head latent attention)  DeepseekV3ForCausalLM (all layers dense)
    a dropless mixture of experts
      (n_expert > 0, capacity_factor=0)                Qwen2MoeForCausalLM
      + qk_norm=True, no shared experts                Qwen3MoeForCausalLM
    GPT-2's pieces with RoPE: norm='layernorm',
      mlp='gelu' (with or without bias, sequential
      or parallel_block), MHA                          GPTNeoXForCausalLM
Gemma2 also has soft-capping, but it normalises each sublayer's output too (sandwich norms), which
picotron's blocks do not; VaultGemma is the Gemma variant without them.

A mixture of experts exports only dropless (capacity_factor=0): no transformers model drops the
tokens over an expert's capacity, so a model trained with capacity would compute something else
there. Picotron's router (softmax over every expert in fp32, top-k, the top-k probabilities not
renormalised, SwiGLU experts) is Qwen2-MoE's with norm_topk_prob=False; Mixtral and OLMoE
renormalise the top-k weights (and OLMoE, like Qwen3-MoE, always norms q and k), DeepSeek-V3 scores
experts with sigmoids in groups. Qwen2-MoE always has one shared expert behind a sigmoid gate: it
holds picotron's shared experts side by side (n_shared_expert SwiGLUs are one SwiGLU that many times
wider), the gate weights are zero and the shared down projection is doubled (sigmoid(0) = 1/2, and
both scalings are exact in floating point); without shared experts it is all zeros. Qwen3-MoE
(always QK-norm, no shared expert) holds qk_norm=True without shared experts.

The combinations no architecture holds (a mixture of experts with capacity dropping; parallel
blocks, LayerNorm or a GELU MLP other than all three GPT-NeoX pieces together; QK-norm with
soft-capping; MLA with QK-norm, soft-capping or biases; experts with biases, GELU, MLA or
soft-capping) stop the export with the options named. head_dim, intermediate_size and Llama 3's RoPE
scaling export to every architecture that has them (all but GPT-NeoX's head size, which is
hidden_size / num_attention_heads), so import_hf.py reads every export back as the model it came
from (a mixture of experts too: it undoes qwen_moe_layout).

transformers and safetensors are needed only here: pip install transformers safetensors
"""

import importlib
import importlib.util
import json
import os
import re
import sys
from dataclasses import fields

import torch
from tiktoken.load import read_file_cached

import checkpoint
from checkpoint import find_checkpoint
from configurator import ConfigError, Setting, configure, make_folder, section
from model import ModelConfig, Transformer, attention_head_dim, mlp_hidden_size, model_config_from

EXPORT = section(
    "export",
    Setting(
        "out_dir",
        "out",
        "the training run: its newest complete checkpoint is exported "
        "(or a ckpt_* folder itself)...",
    ),
    Setting(
        "ckpt",
        "",
        "...unless one is named here: its folder, or its step in out_dir (300 or ckpt_300)",
    ),
    Setting("hf_dir", "hf", "where the transformers model directory is written"),
    Setting(
        "check", True, "reload the export in transformers and compare its logits with picotron's"
    ),
)

# tiktoken's gpt2 source
GPT2_FILES = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
GPT2_VOCAB_SIZE, GPT2_EOT = 50257, 50256


def require(package, why):
    if importlib.util.find_spec(package) is None:
        raise ValueError(
            f"{why} needs the {package} package, which is not installed: pip install {package}"
        )


# -----------------------------------------------------------------------------
# reading the checkpoint


def load_picotron(out_dir, ckpt=""):
    """The single-process model of a checkpoint (checkpoint.find_checkpoint: the one --ckpt names,
    else out_dir's newest), whatever layout it was saved at, and its meta.json."""
    path = find_checkpoint(ckpt, out_dir)
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    known = {f.name for f in fields(ModelConfig)}
    # execution choices that older checkpoints saved with the model
    known |= {"attn_impl", "activation_checkpointing", "chunked_loss"}
    unknown = sorted(set(meta["model"]) - known)
    if unknown:
        raise ValueError(
            f"checkpoint {path} has model options {unknown} that this picotron's ModelConfig "
            f"lacks: it was saved by a newer picotron; export it with that version"
        )
    cfg = model_config_from(meta["model"])
    # picotron's written-out reference attention (the checkpoint may name flash, CUDA-only)
    model = Transformer(cfg, attn_impl="eager")
    checkpoint.load_model(model, checkpoint.CheckpointReader(path))
    return model.eval(), meta, path


# -----------------------------------------------------------------------------
# choosing the transformers architecture


def moe_blockers(cfg):
    """What keeps a mixture of experts from Qwen2-MoE and Qwen3-MoE, the architectures whose routing
    is picotron's (see the module's docstring), as one message per option."""
    name = f"n_expert={cfg.n_expert}"
    blockers = []
    if cfg.capacity_factor > 0:
        blockers.append(
            f"{name} with capacity_factor={cfg.capacity_factor}: no transformers architecture "
            f"drops tokens over an expert's capacity as picotron's router does; a mixture of "
            f"experts trained dropless (capacity_factor=0) exports"
        )
    if cfg.norm == "layernorm" and cfg.mlp == "gelu":
        blockers.append(
            f"{name} with norm='layernorm', mlp='gelu': GPT-NeoX has no mixture of experts"
        )
    if cfg.bias:
        blockers.append(f"{name} with bias=True: Qwen-MoE's experts have no biases")
    if cfg.attention == "mla":
        blockers.append(
            f"{name} with attention='mla': DeepSeek-V3's experts are chosen by sigmoid scores in "
            f"groups, not by picotron's softmax"
        )
    if cfg.attn_softcap or cfg.final_softcap:
        blockers.append(f"{name} with soft-capping: no mixture-of-experts architecture soft-caps")
    if cfg.qk_norm and cfg.n_shared_expert:
        blockers.append(
            f"{name} with qk_norm=True and n_shared_expert={cfg.n_shared_expert}: Qwen3-MoE has no "
            f"shared expert (and Qwen2-MoE no QK-norm)"
        )
    if cfg.qk_norm and cfg.qkv_bias:
        blockers.append(
            f"{name} with qk_norm=True and qkv_bias=True: Qwen3-MoE's attention_bias gives o_proj "
            f"a bias too"
        )
    return blockers


def neox_blockers(cfg):
    """What keeps a LayerNorm + GELU model from GPT-NeoX, which has those, RoPE, sequential or
    parallel blocks, and nothing else."""
    blockers = []
    pieces = "norm='layernorm', mlp='gelu'"
    if cfg.n_kv_head != cfg.n_head:
        blockers.append(
            f"{pieces} with n_kv_head={cfg.n_kv_head} < n_head={cfg.n_head}: "
            f"GPT-NeoX has no grouped-query attention"
        )
    blockers += [
        f"{pieces} with {name}: GPT-NeoX has no such option"
        for name in ("qk_norm", "attn_softcap", "final_softcap", "qkv_bias")
        if getattr(cfg, name)
    ]
    if cfg.attention == "mha" and attention_head_dim(cfg) * cfg.n_head != cfg.n_embd:
        blockers.append(
            f"{pieces} with head_dim={cfg.head_dim}: GPT-NeoX's head size is "
            f"n_embd / n_head = {cfg.n_embd / cfg.n_head:g}"
        )
    if cfg.attention == "mla":
        blockers.append(f"{pieces} with attention='mla': no architecture has both")
    return blockers


def llama_family_blockers(cfg):
    """What keeps an RMSNorm + SwiGLU model from the Llama family (Llama, Qwen2, Qwen3,
    VaultGemma): the GPT-NeoX pieces alone, and the options no one member holds together."""
    blockers = []
    norm, mlp = cfg.norm, cfg.mlp
    if cfg.parallel_block:
        blockers.append(
            "parallel_block=True with RMSNorm or SwiGLU: the only parallel-block architecture "
            "(GPT-NeoX) uses LayerNorm and GELU (norm='layernorm', mlp='gelu')"
        )
    if norm != "rmsnorm":
        blockers.append(
            f"norm={norm!r} with mlp={mlp!r}: LayerNorm comes only with the GELU MLP (GPT-NeoX)"
        )
    if mlp != "swiglu":
        blockers.append(
            f"mlp={mlp!r} with norm={norm!r}: the GELU MLP comes only with LayerNorm (GPT-NeoX)"
        )
    if cfg.attention == "mla":
        return blockers  # mla_blockers says what DeepSeek-V3 cannot hold
    qk_norm = bool(cfg.qk_norm)
    softcap = bool(cfg.attn_softcap or cfg.final_softcap)
    option = "qk_norm" if qk_norm else "soft-capping"
    holder = "Qwen3" if qk_norm else "VaultGemma"
    if qk_norm and softcap:
        blockers.append(
            "qk_norm=True with soft-capping: the architectures with both (Gemma3) also normalise "
            "each sublayer's output, which picotron does not"
        )
    elif cfg.bias and (qk_norm or softcap):
        blockers.append(f"bias=True with {option}: {holder} has no MLP biases")
    elif cfg.qkv_bias and not cfg.bias and (qk_norm or softcap):
        blockers.append(
            f"qkv_bias=True with {option}: {holder}'s attention_bias gives o_proj a bias too"
        )
    return blockers


def mla_blockers(cfg):
    """DeepSeek-V3's attention has no QK-norm, no soft-capping, and biases on only some
    projections."""
    return [
        f"attention='mla' with {name}: DeepSeek-V3's MLA has no such option"
        for name in ("qk_norm", "attn_softcap", "final_softcap", "bias")
        if getattr(cfg, name)
    ]


def hf_architecture(cfg):
    """The transformers architecture that computes what this picotron model computes, or a
    ValueError naming each option that no architecture can hold."""
    moe = cfg.n_expert > 0
    neox = cfg.norm == "layernorm" and cfg.mlp == "gelu"
    mla = cfg.attention == "mla"
    blockers = moe_blockers(cfg) if moe else []
    blockers += neox_blockers(cfg) if neox else llama_family_blockers(cfg)
    if mla:
        blockers += mla_blockers(cfg)
    if blockers:
        raise ValueError(
            "this model cannot be exported to a transformers architecture: " + "; ".join(blockers)
        )
    if moe:
        return "Qwen3MoeForCausalLM" if cfg.qk_norm else "Qwen2MoeForCausalLM"
    if neox:
        return "GPTNeoXForCausalLM"
    if mla:
        return "DeepseekV3ForCausalLM"
    if cfg.qk_norm:
        return "Qwen3ForCausalLM"
    if cfg.attn_softcap or cfg.final_softcap:
        return "VaultGemmaForCausalLM"
    # (with bias=True every linear has one already: Llama holds it)
    if cfg.qkv_bias and not cfg.bias:
        return "Qwen2ForCausalLM"
    return "LlamaForCausalLM"


# -----------------------------------------------------------------------------
# weights and config

# picotron's parameter names -> the Llama family's (VaultGemma calls the MLP's norm
# pre_feedforward_layernorm)
HF_NAMES = [
    (r"tok_emb\.weight", r"model.embed_tokens.weight"),
    (r"blocks\.(\d+)\.attn_norm\.(weight|bias)", r"model.layers.\1.input_layernorm.\2"),
    (r"blocks\.(\d+)\.attn\.([qkvo])_proj\.(weight|bias)", r"model.layers.\1.self_attn.\2_proj.\3"),
    (r"blocks\.(\d+)\.attn\.([qk])_norm\.weight", r"model.layers.\1.self_attn.\2_norm.weight"),
    # multi-head latent attention: DeepSeek's a (down) and b (up) projections around latent norms
    (r"blocks\.(\d+)\.attn\.q_down\.weight", r"model.layers.\1.self_attn.q_a_proj.weight"),
    (
        r"blocks\.(\d+)\.attn\.q_latent_norm\.weight",
        r"model.layers.\1.self_attn.q_a_layernorm.weight",
    ),
    (r"blocks\.(\d+)\.attn\.q_up\.weight", r"model.layers.\1.self_attn.q_b_proj.weight"),
    (
        r"blocks\.(\d+)\.attn\.kv_down\.weight",
        r"model.layers.\1.self_attn.kv_a_proj_with_mqa.weight",
    ),
    (
        r"blocks\.(\d+)\.attn\.kv_latent_norm\.weight",
        r"model.layers.\1.self_attn.kv_a_layernorm.weight",
    ),
    (r"blocks\.(\d+)\.attn\.kv_up\.weight", r"model.layers.\1.self_attn.kv_b_proj.weight"),
    (r"blocks\.(\d+)\.mlp_norm\.(weight|bias)", r"model.layers.\1.post_attention_layernorm.\2"),
    (r"blocks\.(\d+)\.mlp\.(gate|up|down)\.(weight|bias)", r"model.layers.\1.mlp.\2_proj.\3"),
    # a mixture of experts: the router, and each expert by name (qwen_moe_layout stacks them)
    (r"blocks\.(\d+)\.mlp\.router\.weight", r"model.layers.\1.mlp.gate.weight"),
    (
        r"blocks\.(\d+)\.mlp\.(experts|shared_experts)\.(\d+)\.(gate|up|down)\.weight",
        r"model.layers.\1.mlp.\2.\3.\4_proj.weight",
    ),
    (r"norm\.(weight|bias)", r"model.norm.\1"),
    (r"lm_head\.weight", r"lm_head.weight"),
]


def hf_name(name, arch):
    for pattern, replacement in HF_NAMES:
        if re.fullmatch(pattern, name):
            new = re.sub(pattern, replacement, name)
            if arch == "VaultGemmaForCausalLM":
                new = new.replace("post_attention_layernorm", "pre_feedforward_layernorm")
            return new
    return None


def hf_tensors(model, arch):
    """picotron's weights under transformers' names: padded vocabulary rows cut, a tied head written
    once."""
    cfg = model.cfg
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue  # transformers ties it to the embedding (tie_word_embeddings)
        new = hf_name(name, arch)
        if new is None:
            raise ValueError(
                f"the checkpoint's parameter '{name}' has no counterpart in {arch}: the option "
                f"that added it cannot be exported"
            )
        if name in ("tok_emb.weight", "lm_head.weight"):
            # rows past vocab_size pad the vocabulary for tensor parallelism
            t = t[: cfg.vocab_size]
        tensors[new] = t.detach().float().clone().contiguous()
    if arch == "VaultGemmaForCausalLM":
        gemma_conventions(tensors, cfg)
    if arch == "GPTNeoXForCausalLM":
        tensors = neox_layout(tensors, cfg)
    if cfg.n_expert > 0:
        qwen_moe_layout(tensors, cfg, shared_expert=arch == "Qwen2MoeForCausalLM")
    return tensors


def qwen_moe_layout(tensors, cfg, shared_expert):
    """Qwen-MoE keeps a layer's experts in two stacked tensors, experts.gate_up_proj (E, 2 I, C),
    each expert's gate rows then its up rows, and experts.down_proj (E, C, I). Qwen2-MoE's one
    shared expert holds picotron's n_shared_expert shared experts side by side (I * n wide: their
    gate and up rows stacked, their down columns), doubled behind a zero gate (sigmoid(0) = 1/2);
    zeros without any."""
    I = mlp_hidden_size(cfg)
    for i in range(cfg.n_layer):
        p = f"model.layers.{i}.mlp."
        take = lambda kind, e, part: tensors.pop(f"{p}{kind}.{e}.{part}_proj.weight")
        gate_up = [
            torch.cat([take("experts", e, "gate"), take("experts", e, "up")])
            for e in range(cfg.n_expert)
        ]
        tensors[p + "experts.gate_up_proj"] = torch.stack(gate_up)
        tensors[p + "experts.down_proj"] = torch.stack(
            [take("experts", e, "down") for e in range(cfg.n_expert)]
        )
        if not shared_expert:
            continue
        n = cfg.n_shared_expert
        shared = {
            part: [take("shared_experts", j, part) for j in range(n)]
            for part in ("gate", "up", "down")
        }
        for part in ("gate", "up"):
            tensors[f"{p}shared_expert.{part}_proj.weight"] = (
                torch.cat(shared[part]) if n else torch.zeros(I, cfg.n_embd)
            )
        tensors[p + "shared_expert.down_proj.weight"] = (
            2 * torch.cat(shared["down"], 1) if n else torch.zeros(cfg.n_embd, I)
        )
        tensors[p + "shared_expert_gate.weight"] = torch.zeros(1, cfg.n_embd)


def gemma_conventions(tensors, cfg):
    """Gemma's RMSNorm multiplies by (1 + weight), and its embedding output is multiplied by
    sqrt(n_embd). Store weight - 1 and the embedding divided by sqrt(n_embd). A tied head reads that
    divided embedding, so the final norm's gain is multiplied by sqrt(n_embd) to give the same
    logits."""
    # the float32 value transformers multiplies by
    scale = torch.tensor(cfg.n_embd**0.5, dtype=torch.float32)
    tensors["model.embed_tokens.weight"] /= scale
    if cfg.tie_embeddings:
        tensors["model.norm.weight"] *= scale
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            t -= 1.0


# the Llama names -> GPT-NeoX's
NEOX_NAMES = [
    ("model.embed_tokens.", "gpt_neox.embed_in."),
    ("model.norm.", "gpt_neox.final_layer_norm."),
    ("model.layers.", "gpt_neox.layers."),
    (".self_attn.o_proj.", ".attention.dense."),
    (".mlp.up_proj.", ".mlp.dense_h_to_4h."),
    (".mlp.down_proj.", ".mlp.dense_4h_to_h."),
]


def neox_name(llama_name):
    for old, new in NEOX_NAMES:
        llama_name = llama_name.replace(old, new)
    return llama_name


def neox_layout(tensors, cfg):
    """GPT-NeoX fuses q, k and v into one projection whose output is read per head as [q_h; k_h;
    v_h] (query_key_value), and its parallel block has a second norm for the MLP, where picotron's
    parallel block reads one norm's output twice: that second norm gets the same weights."""
    H, hd = cfg.n_head, cfg.n_embd // cfg.n_head
    for i in range(cfg.n_layer):
        prefix = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            parts = [tensors.pop(f"{prefix}self_attn.{x}_proj.{kind}", None) for x in "qkv"]
            if parts[0] is not None:  # (H * hd, ...) each -> (H, 3, hd, ...) -> (3 * H * hd, ...)
                fused = torch.stack([t.view(H, hd, *t.shape[1:]) for t in parts], dim=1)
                tensors[f"{prefix}attention.query_key_value.{kind}"] = fused.reshape(
                    3 * H * hd, *parts[0].shape[1:]
                )
            if cfg.parallel_block and f"{prefix}input_layernorm.{kind}" in tensors:
                tensors[f"{prefix}post_attention_layernorm.{kind}"] = tensors[
                    f"{prefix}input_layernorm.{kind}"
                ].clone()
    return {neox_name(name): t for name, t in tensors.items()}


def hf_rope(cfg):
    """transformers' rope_parameters for picotron's RoPE: plain, or with Llama 3's scaling."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling_factor:
        rope = {
            "rope_type": "llama3",
            "rope_theta": cfg.rope_theta,
            "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_context,
        }
    return rope


def gpt_neox_config(cfg, tensors, rope, tokens):
    """GPTNeoXForCausalLM's config: apart from the Llama-like ones, as it has its own names for most
    settings."""
    return dict(
        architectures=["GPTNeoXForCausalLM"],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.n_embd,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        intermediate_size=tensors["gpt_neox.layers.0.mlp.dense_h_to_4h.weight"].shape[0],
        hidden_act="gelu_pytorch_tanh",  # picotron's GELU is the tanh approximation, as GPT-2's
        max_position_embeddings=cfg.block_size,
        layer_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        use_parallel_residual=bool(cfg.parallel_block),
        attention_bias="gpt_neox.layers.0.attention.query_key_value.bias" in tensors,
        rope_parameters={**rope, "partial_rotary_factor": 1.0},
        dtype="float32",
        **tokens,
    )


def qwen_options(cfg):
    """What the Qwen architectures (dense and MoE) need said: every layer attends to the whole
    context."""
    return dict(
        hidden_act="silu",
        use_sliding_window=False,
        sliding_window=None,
        layer_types=["full_attention"] * cfg.n_layer,
    )


def qwen_moe_options(cfg, arch):
    """Qwen-MoE's router and experts: picotron's routing (see the module's docstring) in every
    layer."""
    options = dict(
        num_experts=cfg.n_expert,
        num_experts_per_tok=cfg.n_expert_per_token,
        moe_intermediate_size=mlp_hidden_size(cfg),
        norm_topk_prob=False,  # picotron's gates are the top-k probabilities as they are
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=cfg.aux_loss_coef,
    )
    if arch == "Qwen2MoeForCausalLM":
        shared_width = mlp_hidden_size(cfg) * max(1, cfg.n_shared_expert)
        options.update(qkv_bias=bool(cfg.qkv_bias), shared_expert_intermediate_size=shared_width)
    return options


def vaultgemma_options(cfg):
    """VaultGemma's soft-capping, and the settings that make its layers plain full attention."""
    return dict(
        hidden_activation="silu",
        query_pre_attn_scalar=attention_head_dim(cfg),  # scores scaled by 1/sqrt(head_dim)
        attn_logit_softcapping=cfg.attn_softcap or None,
        final_logit_softcapping=cfg.final_softcap or None,
        # every layer attends to the whole context; transformers builds a sliding-window mask
        # all the same and needs a window for it, which no layer uses
        sliding_window=cfg.block_size,
        layer_types=["full_attention"] * cfg.n_layer,
    )


def deepseek_v3_options(cfg):
    """DeepSeek-V3's multi-head latent attention, with every layer's MLP dense."""
    return dict(
        hidden_act="silu",
        num_key_value_heads=cfg.n_head,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank or None,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rope_interleave=False,  # picotron rotates halves, not interleaved pairs
        first_k_dense_replace=cfg.n_layer,  # every layer a dense MLP
        num_mtp_layers=0,
    )


def hf_config(model, arch, tensors, tokenizer_fits):
    """The transformers config (a dict for its config class) of this model under `arch`."""
    cfg = model.cfg
    rope = hf_rope(cfg)
    tokens = dict(
        bos_token_id=GPT2_EOT if tokenizer_fits else None,
        eos_token_id=GPT2_EOT if tokenizer_fits else None,
        pad_token_id=None,
    )
    if arch == "GPTNeoXForCausalLM":  # its own names for most settings
        return gpt_neox_config(cfg, tensors, rope, tokens)
    kwargs = dict(
        architectures=[arch],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.n_embd,
        intermediate_size=mlp_hidden_size(cfg),
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head,
        max_position_embeddings=cfg.block_size,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in tensors,
        dtype="float32",
        **tokens,
    )
    if arch != "DeepseekV3ForCausalLM":
        kwargs.update(head_dim=attention_head_dim(cfg))
    # Qwen2's q, k and v always have biases, its o_proj never (Qwen2-MoE: qkv_bias for q, k, v)
    if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
        del kwargs["attention_bias"]
    if arch == "LlamaForCausalLM":
        kwargs.update(hidden_act="silu", mlp_bias="model.layers.0.mlp.gate_proj.bias" in tensors)
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        kwargs.update(qwen_options(cfg))
    elif arch == "VaultGemmaForCausalLM":
        kwargs.update(vaultgemma_options(cfg))
    elif arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        kwargs.update(qwen_options(cfg), **qwen_moe_options(cfg, arch))
    elif arch == "DeepseekV3ForCausalLM":
        kwargs.update(deepseek_v3_options(cfg))
    return kwargs


def match_hf_parameters(tensors, hf_model, arch):
    """Check the tensors against the parameters transformers builds for the config. A QK-norm
    without a learned gain in picotron becomes a gain of one, a bias GPT-NeoX always has (norms,
    MLP) and picotron's bias=False model lacks becomes zeros; anything else missing, extra or
    misshapen stops the export."""
    expected = {name: p.shape for name, p in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    for name in sorted(set(expected) - set(tensors)):
        if re.fullmatch(r"model\.layers\.\d+\.self_attn\.[qk]_norm\.weight", name):
            tensors[name] = torch.ones(expected[name], device="cpu")
        elif arch == "GPTNeoXForCausalLM" and name.endswith(".bias"):
            tensors[name] = torch.zeros(expected[name], device="cpu")
        else:
            raise ValueError(f"{arch} needs '{name}', which picotron's checkpoint does not have")
    for name, t in tensors.items():
        if name not in expected:
            raise ValueError(
                f"'{name}' has no place in {arch}: the option that added it cannot be exported"
            )
        if tuple(t.shape) != tuple(expected[name]):
            raise ValueError(
                f"'{name}' has shape {list(t.shape)} but {arch} expects {list(expected[name])}"
            )


# -----------------------------------------------------------------------------
# tokenizer


def write_gpt2_tokenizer(hf_dir, block_size):
    """GPT-2's tokenizer as transformers files (vocab.json, merges.txt, tokenizer.json), from the
    two files tiktoken's gpt2 encoding is built from: encoder.json is the vocabulary, vocab.bpe the
    merges. tiktoken reads them from its cache (TIKTOKEN_CACHE_DIR) when they are there, so this
    works offline."""
    from transformers import GPT2TokenizerFast

    with open(os.path.join(hf_dir, "vocab.json"), "wb") as f:
        f.write(read_file_cached(GPT2_FILES + "encoder.json"))
    with open(os.path.join(hf_dir, "merges.txt"), "wb") as f:
        f.write(read_file_cached(GPT2_FILES + "vocab.bpe"))
    tokenizer = GPT2TokenizerFast.from_pretrained(hf_dir, model_max_length=block_size)
    tokenizer.save_pretrained(hf_dir)


# -----------------------------------------------------------------------------
# export and check


def hf_classes(arch):
    """(model class, config class) of an architecture, imported from its own module: asking the
    top-level transformers package for a name it has not loaded yet scans every model it ships
    (seconds)."""
    import transformers

    module = {
        "LlamaForCausalLM": "llama",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
        "Qwen2MoeForCausalLM": "qwen2_moe",
        "Qwen3MoeForCausalLM": "qwen3_moe",
        "VaultGemmaForCausalLM": "vaultgemma",
        "DeepseekV3ForCausalLM": "deepseek_v3",
        "GPTNeoXForCausalLM": "gpt_neox",
    }[arch]
    # requirements-dev.txt's floor: before 5.14 GPT-NeoX's head is named embed_out, and a tied one
    # is not tied
    if tuple(int(n) for n in re.findall(r"\d+", transformers.__version__)[:2]) < (5, 14):
        raise ValueError(
            f"export_hf.py needs transformers >= 5.14, this is {transformers.__version__}: "
            f"pip install -U transformers"
        )
    try:
        modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        configuration = importlib.import_module(
            f"transformers.models.{module}.configuration_{module}"
        )
    except ImportError:
        raise ValueError(
            f"this model exports to {arch}, which transformers {transformers.__version__} does not "
            f"have: pip install -U transformers"
        )
    return getattr(modeling, arch), getattr(configuration, arch.replace("ForCausalLM", "Config"))


def export(out_dir, hf_dir, ckpt=""):
    """Write the transformers directory; returns (picotron model, architecture name)."""
    require("transformers", "export_hf.py")
    require("safetensors", "export_hf.py")
    from safetensors.torch import save_file

    model, meta, path = load_picotron(out_dir, ckpt)
    # before the conversion: a folder that cannot be written is found at once
    make_folder("hf_dir", hf_dir)
    arch = hf_architecture(model.cfg)
    model_class, config_class = hf_classes(arch)
    tokenizer_fits = (
        meta.get("tokenizer") in ("gpt2", "r50k_base") and model.cfg.vocab_size == GPT2_VOCAB_SIZE
    )
    tensors = hf_tensors(model, arch)
    config = config_class(**hf_config(model, arch, tensors, tokenizer_fits))
    with torch.device("meta"):  # the parameter names and shapes, without allocating the model
        match_hf_parameters(tensors, model_class(config), arch)

    config.save_pretrained(hf_dir)
    weights = os.path.join(hf_dir, "model.safetensors")
    save_file(tensors, weights, metadata={"format": "pt"})
    # save_file writes a temporary file (mode 0600) and renames it: give the weights the mode of
    # config.json beside them, 0666 less the umask (which os.umask reads only by setting it)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(weights, 0o666 & ~umask)
    print(f"exported {path} (step {meta['step']}) as {arch} to {hf_dir}")
    if arch == "DeepseekV3ForCausalLM" and model.cfg.norm_eps != 1e-6:
        print(
            f"  note: DeepSeek-V3's latent norms have eps 1e-6 built in, picotron's norm_eps is "
            f"{model.cfg.norm_eps}: the logits differ by about 1e-5 (exactly the same with "
            f"norm_eps=1e-6)"
        )
    if tokenizer_fits:
        write_gpt2_tokenizer(hf_dir, model.cfg.block_size)
        print("  with the GPT-2 tokenizer")
    else:
        print(
            f"  without a tokenizer: the model's vocabulary ({model.cfg.vocab_size} tokens, "
            f"tokenizer {meta.get('tokenizer')!r}) is not GPT-2's {GPT2_VOCAB_SIZE}"
        )
    return model, arch


@torch.no_grad()
def max_logit_difference(model, arch, hf_dir, batch=2, seq_len=64, seed=0):
    """Reload the export in transformers and compare its logits with picotron's on random tokens."""
    model_class, _ = hf_classes(arch)
    hf_model = model_class.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    shape = (batch, min(seq_len, model.cfg.block_size))
    idx = torch.randint(0, model.cfg.vocab_size, shape, generator=g)
    ours, _ = model(idx)
    theirs = hf_model(idx).logits
    return (ours - theirs).abs().max().item(), ours.abs().max().item()


def main(argv):
    try:
        cfg, _ = configure(EXPORT, argv, usage=__doc__)
        model, arch = export(cfg["out_dir"], cfg["hf_dir"], cfg["ckpt"])
        if cfg["check"]:
            diff, scale = max_logit_difference(model, arch, cfg["hf_dir"])
            print(
                f"  check: transformers' logits differ from picotron's by at most {diff:.2e} "
                f"(logits up to {scale:.1f})"
            )
            # fp32 agrees to ~1e-6; a wrong mapping differs by O(1)
            if not diff <= 1e-4 * max(1.0, scale):
                raise ValueError(
                    f"the exported {arch} does not reproduce picotron's logits (max difference "
                    f"{diff:.2e}): the export is wrong for this model; please report it"
                )
    except (ConfigError, ValueError, FileNotFoundError, checkpoint.CheckpointError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
