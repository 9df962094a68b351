r"""
Start from a transformers model: read a local model folder (config.json and safetensors weights)
into picotron's model at any layout. train.py does it for init_from=<folder>:

    torchrun --nproc_per_node=4 train.py --init_from=hf/SmolLM2-135M --tp=2 --pp=2 \
        --max_iters=0 --out_dir=out/smol
    torchrun --nproc_per_node=8 train.py --init_from=resume --out_dir=out/smol --data_dir=... \
        --max_iters=2000

(max_iters=0 converts the model once into a picotron checkpoint at the launch's layout and exits;
resuming it starts a fresh optimizer at step 0. With max_iters > 0 training starts from the model
directly.)

  1. The config: config.json becomes picotron's model settings, every one of them (head_dim,
     intermediate_size, qkv_bias, Llama 3's RoPE scaling, the experts, ...); whatever picotron
     cannot represent (a sliding window, another RoPE scaling, DeepSeek's mixture of experts,
     renormalised top-k weights, a GELU-gated MLP) is refused by its config.json name, all at
     once. The architectures are those export_hf.py writes, and Qwen2's:
         LlamaForCausalLM        SmolLM2, Llama 3.x, TinyLlama
         Qwen2ForCausalLM        Qwen2.5 (q/k/v biases: qkv_bias=True)
         Qwen3ForCausalLM        Qwen3 dense (qk_norm=True, head_dim)
         Qwen2MoeForCausalLM     a dropless mixture of experts (capacity_factor=0), its shared
                                 expert ungated (a zero gate: picotron's exports; see moe_settings)
         Qwen3MoeForCausalLM     the same with qk_norm=True, without shared experts
         VaultGemmaForCausalLM, DeepseekV3ForCausalLM (dense layers), GPTNeoXForCausalLM
  2. The weights: each tensor is found under its transformers name (export_hf.py's table, read
     the other way; experts in stacked tensors or one by one), its shape checked against the
     config, and each rank reads only its own slice of it (an expert-parallel rank: only its own
     experts), straight from the safetensors files (safe_open(...).get_slice: a slice of a
     memory-mapped file), so no rank ever holds a full model. One file or several
     (model.safetensors.index.json), fp32, bf16 or fp16: each slice is cast to the parameters'
     fp32 as it is copied in.

Needs the safetensors package (pip install safetensors); the model folder's tokenizer is
hf_tokenizer.py's.
"""

import json
import os
import re
from contextlib import ExitStack
from dataclasses import fields
from typing import NamedTuple

import torch

import export_hf
import hf_tokenizer
from model import ModelConfig, Transformer, mlp_hidden_size, swiglu_hidden_size
from parallel import full_shape_of
from tensor_parallel import load_shard

# the architectures picotron reads -> their model_type
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "VaultGemmaForCausalLM": "vaultgemma",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "GPTNeoXForCausalLM": "gpt_neox",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
MOE = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

# transformers' defaults for what a config.json may leave out (tests/test_import_hf.py checks them
# against the config classes). A key present with the value null keeps null: q_lora_rank null is
# full-rank queries.
COMMON_DEFAULTS = {
    "num_key_value_heads": None,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "head_dim": None,
    "rope_theta": 10000.0,
    "use_sliding_window": False,
    "layer_types": None,
}
DEFAULTS = {
    "LlamaForCausalLM": {},
    "Qwen2ForCausalLM": {},
    "Qwen3ForCausalLM": {"head_dim": 128},
    "VaultGemmaForCausalLM": {
        "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh",
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "DeepseekV3ForCausalLM": {
        "first_k_dense_replace": 3,
        "rope_interleave": True,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
    },
    "GPTNeoXForCausalLM": {
        "layer_norm_eps": 1e-5,
        "hidden_act": "gelu",
        "attention_bias": True,
        "use_parallel_residual": True,
        "partial_rotary_factor": 0.25,
    },
    "Qwen2MoeForCausalLM": {
        "qkv_bias": True,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
    },
    "Qwen3MoeForCausalLM": {
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
    },
}
# transformers' names of x * sigmoid(x), and of GELU's tanh approximation (picotron's, GPT-2's)
SILU = ("silu", "swish")
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")
# the model settings that are not the architecture: they come from the command line (and the data's
# meta.json), not from config.json. (A mixture of experts' capacity_factor and aux_loss_coef do
# come from it: transformers routes dropless, capacity_factor=0, and config.json has
# router_aux_loss_coef; a dense model has their defaults.)
NOT_ARCHITECTURE = ("block_size", "router_z_loss_coef", "doc_mask", "eot_token")


def require_safetensors():
    try:
        # lazily: only a run that loads a transformers model needs it
        import safetensors  # noqa: F401
    except ImportError:
        raise ValueError(
            "init_from=<a transformers model folder> reads its weights with the safetensors "
            "package, which is not installed: pip install safetensors"
        )


# -----------------------------------------------------------------------------
# 1. The config


def read_config(folder):
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"init_from={folder!r} is not 'scratch', 'resume' or a transformers model folder: "
            f"{'it has no config.json' if os.path.isdir(folder) else 'no such folder'}"
        )
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e})")


def architecture_of(config, folder):
    names = config.get("architectures") or []
    by_model_type = {t: a for a, t in ARCHITECTURES.items()}
    arch = names[0] if names else by_model_type.get(config.get("model_type"))
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{folder} holds a {arch or config.get('model_type')!r} model: picotron loads "
            f"{', '.join(ARCHITECTURES)}"
        )
    return arch


def rope_settings(config, defaults, problems):
    """RoPE's base and Llama 3's scaling, from rope_parameters (transformers 5) or rope_theta and
    rope_scaling (older config.json files)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in params.values()):
        problems.append(
            f"rope_parameters per layer type ({', '.join(params)}): picotron's layers share one "
            f"RoPE"
        )
        return {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get(
        "rope_theta",
        config.get("rope_theta", config.get("rotary_emb_base", defaults["rope_theta"])),
    )
    partial = config.get(
        "partial_rotary_factor",
        config.get("rotary_pct", defaults.get("partial_rotary_factor", 1.0)),
    )
    partial = params.get("partial_rotary_factor", partial)
    if partial != 1.0:
        problems.append(
            f"partial_rotary_factor={partial}: picotron rotates every dimension of a head (RoPE on "
            f"part of it, as Pythia has, is not implemented)"
        )
    out = {"rope_theta": float(theta)}
    if rope_type == "llama3":
        context = config.get("max_position_embeddings")
        out.update(
            rope_scaling_factor=float(params["factor"]),
            rope_low_freq_factor=float(params["low_freq_factor"]),
            rope_high_freq_factor=float(params["high_freq_factor"]),
            rope_original_context=int(params.get("original_max_position_embeddings", context)),
        )
    elif rope_type != "default":
        problems.append(
            f"rope_type={rope_type!r}: picotron has plain RoPE and Llama 3's scaling "
            f"(rope_type 'llama3')"
        )
    return out


def model_settings(folder):
    """picotron's architecture settings for the model in `folder` (every ModelConfig field but those
    in NOT_ARCHITECTURE), its transformers architecture, and notes to print. Raises ValueError
    naming each config.json entry picotron cannot represent. A size that equals picotron's derived
    one is written 0 (head_dim, intermediate_size), so an export of a picotron model reads back as
    the same settings. (One setting comes from the weights: Qwen2-MoE's shared experts,
    shared_expert_count.)"""
    config = read_config(folder)
    arch = architecture_of(config, folder)
    defaults = {**COMMON_DEFAULTS, **DEFAULTS[arch]}
    get = lambda key: config.get(key, defaults.get(key))
    problems = []
    required = "vocab_size hidden_size num_hidden_layers num_attention_heads intermediate_size"
    missing = [k for k in required.split() if k not in config]
    if missing:
        raise ValueError(
            f"{folder}/config.json has no {', '.join(missing)}: it is not a complete {arch} config"
        )
    n_head = config["num_attention_heads"]
    s = {f.name: f.default for f in fields(ModelConfig) if f.name not in NOT_ARCHITECTURE}
    s.update(
        vocab_size=config["vocab_size"],
        n_layer=config["num_hidden_layers"],
        n_head=n_head,
        n_embd=config["hidden_size"],
        tie_embeddings=bool(get("tie_word_embeddings")),
        norm_eps=float(get("rms_norm_eps")),
        n_kv_head=get("num_key_value_heads") or n_head,
        **rope_settings(config, defaults, problems),
    )
    s.update(mlp_settings(arch, config, get, problems))
    s.update(attention_settings(arch, config, get, problems))
    s.update(bias_settings(arch, get, problems))
    if arch in MOE:
        # after mlp_settings: the experts' width replaces the dense MLP's
        s.update(moe_settings(arch, folder, config, get, problems))
    if problems:
        raise ValueError(
            f"picotron cannot represent the {arch} in {folder}: " + "; ".join(problems)
        )
    notes = [f"init_from: {arch} from {folder}"]
    if arch == "DeepseekV3ForCausalLM" and s["norm_eps"] != 1e-6:
        notes.append(
            f"  note: DeepSeek-V3's latent norms have eps 1e-6 built in, picotron's use "
            f"rms_norm_eps = {s['norm_eps']}: the logits differ by about 1e-5"
        )
    return s, arch, notes


def mlp_settings(arch, config, get, problems):
    """The MLP: SwiGLU (gated with SiLU), or GPT-NeoX's GELU MLP with the rest of GPT-NeoX's block
    (LayerNorm, its biases, the parallel block); its width is 0 where it is picotron's derived one.
    """
    n_embd, s = config["hidden_size"], {}
    derived_mlp = swiglu_hidden_size(n_embd)
    act_key = "hidden_activation" if arch == "VaultGemmaForCausalLM" else "hidden_act"
    if arch == "GPTNeoXForCausalLM":
        s.update(
            norm="layernorm",
            mlp="gelu",
            bias=bool(get("attention_bias")),
            n_kv_head=config["num_attention_heads"],
            parallel_block=bool(get("use_parallel_residual")),
            norm_eps=float(get("layer_norm_eps")),
        )
        derived_mlp = 4 * n_embd
        if get(act_key) not in GELU_TANH:
            problems.append(
                f"{act_key}={get(act_key)!r}: picotron's GELU MLP is the tanh approximation "
                f"({' or '.join(map(repr, GELU_TANH))})"
            )
    elif get(act_key) not in SILU:
        problems.append(
            f"{act_key}={get(act_key)!r}: picotron's SwiGLU MLP gates with SiLU ('silu')"
        )
    size = config["intermediate_size"]
    s["intermediate_size"] = 0 if size == derived_mlp else size
    return s


def attention_settings(arch, config, get, problems):
    """The attention: DeepSeek's latent attention, or heads of head_dim (0: n_embd / n_head) that
    see the whole context, QK-normed (Qwen3), soft-capped (VaultGemma)."""
    n_embd, n_head, s = config["hidden_size"], config["num_attention_heads"], {}
    if arch == "DeepseekV3ForCausalLM":
        s.update(
            attention="mla",
            n_kv_head=n_head,
            kv_lora_rank=get("kv_lora_rank"),
            q_lora_rank=get("q_lora_rank") or 0,
            qk_rope_head_dim=get("qk_rope_head_dim"),
            qk_nope_head_dim=get("qk_nope_head_dim"),
            v_head_dim=get("v_head_dim"),
        )
        if get("first_k_dense_replace") < config["num_hidden_layers"]:
            problems.append(
                f"first_k_dense_replace={get('first_k_dense_replace')} < num_hidden_layers="
                f"{config['num_hidden_layers']}: the layers after it are DeepSeek's mixture of "
                f"experts, which picotron's (with capacity and a Switch balance loss) is not"
            )
        if get("rope_interleave"):
            problems.append(
                "rope_interleave=True: picotron rotates the two halves of a head, not interleaved "
                "pairs"
            )
        return s
    if arch == "GPTNeoXForCausalLM":
        return s
    head_dim = get("head_dim") or n_embd // n_head
    s["head_dim"] = 0 if head_dim * n_head == n_embd else head_dim
    if get("use_sliding_window"):
        problems.append(
            "use_sliding_window=True: picotron's attention always sees the whole context"
        )
    layer_types = get("layer_types")
    if arch == "VaultGemmaForCausalLM" and layer_types is None:
        problems.append(
            "no layer_types: VaultGemma's default alternates sliding-window layers, which picotron "
            "does not have"
        )
    elif layer_types and any(t != "full_attention" for t in layer_types):
        problems.append(
            f"layer_types with {sorted(set(layer_types) - {'full_attention'})}: picotron's "
            f"attention always sees the whole context"
        )
    if arch == "VaultGemmaForCausalLM":
        s.update(
            attn_softcap=float(get("attn_logit_softcapping") or 0.0),
            final_softcap=float(get("final_logit_softcapping") or 0.0),
        )
        if get("query_pre_attn_scalar") != head_dim:
            problems.append(
                f"query_pre_attn_scalar={get('query_pre_attn_scalar')} != head_dim={head_dim}: "
                f"picotron scales the scores by 1/sqrt(head_dim)"
            )
    s["qk_norm"] = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    return s


def bias_settings(arch, get, problems):
    """picotron's biases: bias=True on every attention and MLP linear (Llama's attention_bias with
    mlp_bias), qkv_bias=True on q, k and v only (Qwen2's, always; Qwen2-MoE's qkv_bias)."""
    if arch == "LlamaForCausalLM":
        if get("attention_bias") != get("mlp_bias"):
            problems.append(
                f"attention_bias={get('attention_bias')} with mlp_bias={get('mlp_bias')}: "
                f"picotron's bias=True puts biases on the attention and the MLP linears alike "
                f"(qkv_bias: on q, k and v only)"
            )
        return {"bias": bool(get("attention_bias") and get("mlp_bias"))}
    if arch == "Qwen2ForCausalLM":
        return {"qkv_bias": True}  # Qwen2's q, k and v always have biases, o_proj never
    if arch == "Qwen2MoeForCausalLM":
        return {"qkv_bias": bool(get("qkv_bias"))}
    if arch != "GPTNeoXForCausalLM" and get("attention_bias"):
        problems.append(
            f"attention_bias=True: {arch}'s attention biases (o_proj's too, none in the MLP) are "
            f"not one of picotron's bias settings"
        )
    return {}


def moe_settings(arch, folder, config, get, problems):
    """A Qwen-MoE's sparse MLP as picotron's mixture of experts (the inverse of export_hf.py's): its
    router is picotron's (a softmax over every expert in fp32, the top-k probabilities as they are,
    norm_topk_prob=False) and it routes dropless, which is capacity_factor=0 (transformers drops no
    token). Renormalised top-k weights and dense layers among the sparse ones are refused by name;
    Qwen2-MoE's shared expert is read from the weights (shared_expert_count)."""
    width = get("moe_intermediate_size")
    # the name Qwen3-MoE's config class saves
    n_expert = config.get("num_local_experts", get("num_experts"))
    s = dict(
        n_expert=n_expert,
        n_expert_per_token=get("num_experts_per_tok"),
        capacity_factor=0.0,
        aux_loss_coef=float(get("router_aux_loss_coef")),
        intermediate_size=0 if width == swiglu_hidden_size(config["hidden_size"]) else width,
    )
    if not s["n_expert"]:
        problems.append(
            "num_experts=0: every layer is a dense MLP of intermediate_size, which picotron loads "
            "as the dense architecture (Qwen2ForCausalLM, Qwen3ForCausalLM)"
        )
    if get("norm_topk_prob"):
        problems.append(
            "norm_topk_prob=True: picotron weights each chosen expert by its softmax probability "
            "as it is; renormalising the top-k weights to sum to 1 is not implemented"
        )
    if get("decoder_sparse_step") != 1:
        problems.append(
            f"decoder_sparse_step={get('decoder_sparse_step')}: every layer of picotron's mixture "
            f"of experts is sparse (dense MLP layers between sparse ones are not implemented)"
        )
    if get("mlp_only_layers"):
        problems.append(
            f"mlp_only_layers={get('mlp_only_layers')}: every layer of picotron's mixture of "
            f"experts is sparse (dense MLP layers among them are not implemented)"
        )
    # (a folder refused already need not have weights)
    if arch == "Qwen2MoeForCausalLM" and not problems:
        s["n_shared_expert"] = shared_expert_count(
            folder, config, width, get("shared_expert_intermediate_size"), problems
        )
    return s


def shared_expert_count(folder, config, width, shared_width, problems):
    """Qwen2-MoE's one shared expert, sigmoid(shared_expert_gate x) * shared_expert(x), as
    picotron's n_shared_expert shared experts, which are not gated. export_hf.py writes picotron's
    side by side (n SwiGLUs of `width` are one SwiGLU n times wider), the down projection doubled
    behind a gate of zeros (sigmoid(0) = 1/2), or all zeros without any. So: a gate that is not zero
    is refused (Qwen1.5-MoE learned its gates); a shared expert that is zero in every layer adds
    nothing and is none; any other is shared_expert_intermediate_size / moe_intermediate_size
    experts. Reads one gate (and one down projection) per layer."""
    layers = [f"model.layers.{i}.mlp." for i in range(config["num_hidden_layers"])]
    with WeightFiles(folder) as files:
        nonzero = lambda name: files.find(name) is not None and bool(files.read(name).any())
        gate = "shared_expert_gate.weight"
        gated = [p + gate for p in layers if nonzero(p + gate)]
        if gated:
            problems.append(
                f"'{gated[0]}' is not zero: Qwen2-MoE gates its shared expert with a learned "
                f"sigmoid, picotron's shared experts are not gated (picotron's own exports have "
                f"zero gates)"
            )
            return 0
        if not any(nonzero(p + "shared_expert.down_proj.weight") for p in layers):
            return 0
    if shared_width % width:
        problems.append(
            f"shared_expert_intermediate_size={shared_width} is not a multiple of "
            f"moe_intermediate_size={width}: picotron's shared experts are each as wide as a "
            f"routed one"
        )
        return 0
    return shared_width // width


def model_tokenizer(folder):
    """The tokenizer the converted model records (hf_tokenizer.resolve): a tiktoken encoding's name,
    the folder's path, or None for a folder without tokenizer files."""
    return hf_tokenizer.resolve(folder)


def run_tokenizer(folder, data_meta, data_dir):
    """(the tokenizer a run from `folder` records, a warning or None): the folder's tokenizer; a
    folder without one leaves the data's (None when converting without data: sample.py then asks),
    and data tokenized otherwise is worth a warning."""
    tokenizer = model_tokenizer(folder)
    if tokenizer is None:
        return data_meta.get("tokenizer"), None
    if data_meta and data_meta.get("tokenizer") != tokenizer:
        return tokenizer, (
            f"warning: data_dir '{data_dir}' was tokenized with {data_meta.get('tokenizer')!r}, "
            f"the model's tokenizer is {tokenizer!r}: prepare the data with --tokenizer={folder}"
        )
    return tokenizer, None


def conversion_report(layout, folder, loaded, save_seconds, path, peak_bytes):
    """The lines of a conversion (train.py's init_from=<folder> with max_iters=0): what each rank
    read, how long it took and the most memory it held (CUDA allocator peak, or max RSS on CPU: that
    counts the pages of the memory-mapped safetensors files the rank touched). Every rank must call
    it (a gather)."""
    mine = (layout.rank, loaded.seconds, save_seconds, loaded.bytes_read, peak_bytes)
    rows = [mine]
    if layout.world_size > 1:
        rows = [None] * layout.world_size
        torch.distributed.all_gather_object(rows, mine)
    lines = [
        f"converted {folder} ({loaded.file_bytes / 2**20:,.1f} MiB of safetensors) to {path}, "
        f"step 0, layout dp={layout.dp} x tp={layout.tp} x pp={layout.pp}; resume it with "
        f"--init_from=resume"
    ]
    lines += [
        f"  rank {rank}: read {read / 2**20:,.1f} MiB in {load_s:.2f} s, saved in {save_s:.2f} s, "
        f"peak memory {peak / 2**20:,.0f} MiB"
        for rank, load_s, save_s, read, peak in rows
    ]
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# 2. The weights


def weight_map(folder):
    """{tensor name: its safetensors file} of a model folder: one model.safetensors, or the shards
    that model.safetensors.index.json lists."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = json.load(f)["weight_map"]
        return {name: os.path.join(folder, file) for name, file in files.items()}
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    torch_files = ("pytorch_model.bin", "pytorch_model.bin.index.json")
    other = [n for n in torch_files if os.path.exists(os.path.join(folder, n))]
    hint = ""
    if other:
        hint = (
            f", only {other[0]}: save it as safetensors with transformers, from_pretrained then "
            f"save_pretrained"
        )
    raise FileNotFoundError(
        f"{folder} has no model.safetensors (nor model.safetensors.index.json){hint}"
    )


# the names a tensor is saved under besides its transformers name (GPT-NeoX's checkpoints, and
# transformers' own save_pretrained, call its head embed_out)
ALIASES = {"lm_head.weight": "embed_out.weight"}


class WeightFiles:
    """The open safetensors files of a model folder (a context manager): shapes and slices by tensor
    name (or its alias), and how many bytes of tensor data were read."""

    def __init__(self, folder):
        require_safetensors()
        self.folder, self.map, self.bytes_read = folder, weight_map(folder), 0
        self._stack, self._open = ExitStack(), {}
        # a Qwen-MoE's experts stacked in one tensor per layer (export_hf.py; transformers'
        # modules), or each expert's matrices under their own names (transformers' save_pretrained,
        # checkpoints on the Hub)
        self.stacked = any(name.endswith(".mlp.experts.gate_up_proj") for name in self.map)

    def find(self, name):
        """The name `name` is saved under here, or None."""
        return next((n for n in (name, ALIASES.get(name)) if n in self.map), None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def _slice(self, name):
        from safetensors import safe_open

        name = self.find(name) or name
        path = self.map[name]
        if path not in self._open:
            self._open[path] = self._stack.enter_context(safe_open(path, framework="pt"))
        return self._open[path].get_slice(name)

    def shape(self, name):
        return list(self._slice(name).get_shape())

    def dtype(self, name):
        return self._slice(name).get_dtype()

    def read(self, name, index=()):
        """The tensor, or the part of it `index` (a tuple of ints and slices) selects, in its saved
        dtype (only that part is read; the parameter's copy_ casts it, in the same pass)."""
        t = self._slice(name)[tuple(index)]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def total_bytes(self):
        return sum(os.path.getsize(p) for p in set(self.map.values()))


class Source(NamedTuple):
    """Where a picotron parameter is in the files: the tensor `name`; for an expert stacked with the
    others, its index in that tensor; `block`, the rows and columns of that tensor (or of the
    expert's matrix) the parameter is (None: all of it); `shape`, the tensor's full shape where it
    holds more than the parameter; `part`, which of q, k, v it is in GPT-NeoX's fused projection;
    `transform`, applied to what is read."""

    name: str
    expert: int = None
    block: tuple = None
    shape: list = None
    part: int = None
    transform: object = None


EXPERT_PARAMETER = re.compile(
    r"blocks\.(\d+)\.mlp\.(experts|shared_experts)\.(\d+)\.(gate|up|down)\.weight"
)


def hf_source(name, cfg, arch, stacked=True):
    """Where picotron's (full-model) parameter `name` comes from, a Source: the inverse of
    export_hf.py's hf_tensors. stacked: the folder's experts are stacked (WeightFiles.stacked)."""
    expert = EXPERT_PARAMETER.fullmatch(name)
    if expert:
        return expert_source(*expert.groups(), cfg, stacked)
    hf = export_hf.hf_name(name, arch)
    part, transform = None, None
    if arch == "GPTNeoXForCausalLM":
        hf = export_hf.neox_name(hf)
        for j, x in enumerate("qkv"):
            if f".self_attn.{x}_proj." in hf:
                hf, part = hf.replace(f"self_attn.{x}_proj", "attention.query_key_value"), j
    if arch == "VaultGemmaForCausalLM":  # undo export_hf.gemma_conventions
        scale = torch.tensor(cfg.n_embd**0.5, dtype=torch.float32)
        if name == "tok_emb.weight":
            transform = lambda t: t * scale
        elif name == "norm.weight" and cfg.tie_embeddings:
            transform = lambda t: (t + 1.0) / scale
        elif name.endswith("norm.weight"):
            transform = lambda t: t + 1.0
    return Source(hf, part=part, transform=transform)


def expert_source(layer, kind, index, part, cfg, stacked):
    """The inverse of export_hf.qwen_moe_layout. Routed expert e: its gate then its up rows in
    experts.gate_up_proj[e], its down projection experts.down_proj[e] (not stacked: under their own
    names, experts.e.gate_proj.weight ...). Shared expert j: its rows (gate, up) or columns (down)
    of Qwen2-MoE's one shared expert, the down projection halved (the export doubled it behind a
    zero gate: sigmoid(0) = 1/2)."""
    p, j = f"model.layers.{layer}.mlp.", int(index)
    I, C, E, n = mlp_hidden_size(cfg), cfg.n_embd, cfg.n_expert, cfg.n_shared_expert
    if kind == "experts" and not stacked:
        return Source(f"{p}experts.{j}.{part}_proj.weight")
    if kind == "experts" and part == "down":
        return Source(p + "experts.down_proj", expert=j, shape=[E, C, I])
    if kind == "experts":
        rows = slice(I, 2 * I) if part == "up" else slice(0, I)
        return Source(
            p + "experts.gate_up_proj", expert=j, block=(rows, slice(0, C)), shape=[E, 2 * I, C]
        )
    mine = slice(j * I, (j + 1) * I)  # shared expert j's hidden units
    if part == "down":
        return Source(
            p + "shared_expert.down_proj.weight",
            block=(slice(0, C), mine),
            shape=[C, n * I],
            transform=lambda t: t / 2,
        )
    return Source(
        f"{p}shared_expert.{part}_proj.weight", block=(mine, slice(0, C)), shape=[n * I, C]
    )


def source_index(src, dim, start, size):
    """The index into src's tensor of the parameter's rows start:start+size along its dim (dim None:
    all of the parameter)."""
    index = list(src.block or [slice(None)] * (0 if dim is None else dim + 1))
    if dim is not None:
        first = index[dim].start or 0
        index[dim] = slice(first + start, first + start + size)
    return tuple(([] if src.expert is None else [src.expert]) + index)


def source_reader(files, cfg, arch, name):
    """tensor_parallel.load_shard's reader of parameter `name`: read(dim, start, size) gives that
    slice of the full tensor (dim None: all of it), reading only it from the files."""
    src = hf_source(name, cfg, arch, files.stacked)
    if src.part is None:

        def read(dim, start, size):
            t = files.read(src.name, source_index(src, dim, start, size))
            return src.transform(t.float()) if src.transform else t

        return read
    hd = cfg.n_embd // cfg.n_head

    # GPT-NeoX's rows are [q_h; k_h; v_h] head after head: read the heads
    def read_fused(dim, start, size):
        assert dim in (None, 0), "q, k and v are split by rows only"
        first, last = (0, cfg.n_head) if dim is None else (start // hd, (start + size) // hd)
        t = files.read(src.name, (slice(3 * first * hd, 3 * last * hd),))  # (heads * 3 * hd, ...)
        return t.view(last - first, 3, hd, *t.shape[1:])[:, src.part].reshape(-1, *t.shape[1:])

    return read_fused


def expected_tensors(cfg, arch, stacked):
    """{transformers tensor name: its full shape} that picotron's model reads, from the whole model
    built on the meta device (no memory)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {}
    for name, p in model.named_parameters():
        src = hf_source(name, cfg, arch, stacked)
        shape = full_shape_of(p)
        if hasattr(p, "vocab_size"):  # picotron pads the vocabulary; the file has vocab_size rows
            shape[0] = p.vocab_size
        if src.part is not None:
            shape[0] *= 3
        expected[src.name] = src.shape or shape
    return expected


def check_weights(folder, cfg):
    """Stop before anything is built when the folder's weights are not what its config says or hold
    tensors picotron has no place for. Every rank runs it alike (reading the same few small
    tensors), so every rank stops together."""
    _, arch, _ = model_settings(folder)
    problems = []
    with WeightFiles(folder) as files:
        expected = expected_tensors(cfg, arch, files.stacked)
        for name, shape in expected.items():
            if files.find(name) is None:
                problems.append(f"'{name}' is missing")
            elif files.shape(name) != shape:
                problems.append(f"'{name}' has shape {files.shape(name)}, the config says {shape}")
            elif files.dtype(name) not in ("F32", "BF16", "F16"):
                problems.append(
                    f"'{name}' is {files.dtype(name)}: picotron reads fp32, bf16 and fp16 weights "
                    f"(not quantized ones)"
                )
        for name in sorted(set(files.map) - {files.find(n) for n in expected}):
            why = unused_tensor_problem(files, name, cfg, arch)
            if why:
                problems.append(why)
    if problems:
        shown = problems[:8] + ([f"and {len(problems) - 8} more"] if len(problems) > 8 else [])
        raise ValueError(
            f"the weights in {folder} do not fit its {arch} config.json: " + "; ".join(shown)
        )


def unused_tensor_problem(files, name, cfg, arch):
    """Why a tensor picotron does not read must not be left behind, or None when nothing is lost:
    buffers older transformers saved (RoPE's inv_freq, GPT-NeoX's masks), a tied head saved beside
    its embedding, and what GPT-NeoX has where picotron has nothing: zero biases (bias=False) and,
    in a parallel block, the MLP's norm when it equals the attention's (picotron's parallel block
    has one norm)."""
    if name.endswith(("rotary_emb.inv_freq", "attention.bias", "attention.masked_bias")):
        return None
    if name in ("lm_head.weight", ALIASES["lm_head.weight"]) and cfg.tie_embeddings:
        return None
    # Qwen2-MoE's shared expert gate, and its shared expert when picotron has none: model_settings
    # found every gate zero (else it refused) and, for n_shared_expert = 0, every shared expert zero
    if arch == "Qwen2MoeForCausalLM":
        if ".mlp.shared_expert_gate." in name:
            return None
        if ".mlp.shared_expert." in name and not cfg.n_shared_expert:
            return None
    if arch == "GPTNeoXForCausalLM":
        if name.endswith(".bias") and not cfg.bias and not files.read(name).any():
            return None
        if cfg.parallel_block and ".post_attention_layernorm." in name:
            twin = name.replace("post_attention_layernorm", "input_layernorm")
            as_float = lambda n: files.read(n).float()
            if twin in files.map and torch.equal(as_float(name), as_float(twin)):
                return None
            return (
                f"'{name}' differs from '{twin}': picotron's parallel block has one norm for "
                f"attention and MLP (use_parallel_residual=True with two norms is not implemented)"
            )
    return f"'{name}' has no place in picotron's model (config.json describes a model without it)"


def load_weights(model, folder):
    """Fill every parameter of `model` (any layout: a tensor-parallel slice, a pipeline stage, a
    tied copy) from the folder, reading only its own slices. Returns (bytes of tensor data read,
    bytes of the files)."""
    _, arch, _ = model_settings(folder)
    copies = model.tied_copies()
    with WeightFiles(folder) as files:
        for name, p in model.named_parameters():
            load_shard(p, source_reader(files, model.cfg, arch, copies.get(name, name)))
        return files.bytes_read, files.total_bytes()
