"""import_hf.py: a transformers model folder (config.json, safetensors, tokenizer.json) loads into
picotron at any layout and computes what transformers computes.

The reference is transformers itself: each model is built by transformers from its own config class
(tiny sizes, random weights far from their init: gains and biases away from 0 and 1), saved with
save_pretrained, and its logits and greedy generation are those picotron must give. One 2-rank
launch converts every model at tp=2 and at pp=2 with train.py's own functions (--max_iters=0) and
returns the logits each layout computes; sample.py then decodes greedily from each converted
checkpoint. No network: the tokenizer is trained here.
"""

import importlib.util
import json
import os
import re
import shutil
import sys

import pytest
import torch
import torch.distributed as dist

import checkpoint
import export_hf
import hf_tokenizer
import import_hf
import sample
import settings
import build
import train
from configurator import ConfigError
from conftest import needs_gpt2, shared_file
from dist_utils import make_token_data, run_ranks
from model import ModelConfig, Transformer, llama3_scaled_frequencies, rope_cache

HAVE_HF = all(importlib.util.find_spec(p) for p in ("transformers", "safetensors", "tokenizers"))
needs_hf = pytest.mark.skipif(
    not HAVE_HF,
    reason="transformers, safetensors and tokenizers are not installed "
    "(pip install -r requirements-dev.txt)",
)
VOCAB = 320  # not a multiple of 64 * tp: the padded rows of picotron's vocabulary are exercised
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=64,
    bos_token_id=None,
    # (no eos: generate never stops early)
    eos_token_id=None,
)
# llama3's RoPE scaling: each of its regimes meets some frequency
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
# name: (config class, its settings, how it is saved). 3 layers: pp=2 splits them 2 + 1; tied models
# then hold the embedding on stage 0 and its copy as the head on stage 1
MODELS = {
    # intermediate 96, not picotron's derived 192
    "llama": ("LlamaConfig", dict(num_key_value_heads=2), {}),
    "llama3": (
        "LlamaConfig",
        dict(num_key_value_heads=1, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
        {},
    ),
    # q/k/v biases
    "qwen2": (
        "Qwen2Config",
        dict(num_key_value_heads=1, head_dim=32, tie_word_embeddings=True),
        {},
    ),
    # 4 heads of 32 in a width of 64
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=32), {}),
    "llama_bf16_sharded": (
        "LlamaConfig",
        dict(num_key_value_heads=2),
        dict(dtype=torch.bfloat16, max_shard_size="100KB"),
    ),
    # the other architectures export_hf.py writes, in the shapes picotron holds: soft-capping and
    # Gemma's (1 + weight) norms and scaled embedding; dense latent attention; GPT-NeoX's fused
    # q/k/v, with biases
    "vaultgemma": (
        "VaultGemmaConfig",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=16,
            hidden_activation="silu",
            layer_types=["full_attention"] * 3,
        ),
        {},
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            num_key_value_heads=4,
            first_k_dense_replace=3,
            rope_interleave=False,
            q_lora_rank=24,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
        ),
        {},
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        dict(
            use_parallel_residual=False,
            hidden_act="gelu_pytorch_tanh",
            intermediate_size=256,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 1.0,
            },
        ),
        {},
    ),
    # a mixture of experts as transformers saves it (each expert's matrices under their own names),
    # its shared expert two of picotron's wide behind a zero gate (make_hf_model): the layout the
    # Hub's Qwen1.5-MoE has
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        ),
        {},
    ),
}
# picotron models exported by export_hf.py (experts stacked in one tensor per layer), imported by
# the launch too
EXPORTED = {
    "moe_export": dict(
        n_expert=4,
        n_expert_per_token=2,
        capacity_factor=0.0,
        n_shared_expert=1,
        n_layer=3,
        vocab_size=VOCAB,
        tie_embeddings=False,
    )
}
# every model converts at tp=2 and pp=2; a mixture of experts also at ep=2 (each rank holds 2 of the
# 4 experts)
LAYOUTS = {
    name: ("tp", "pp", "ep") if "moe" in name else ("tp", "pp") for name in [*MODELS, *EXPORTED]
}
PROMPT = "First Citizen:\nBefore we proceed"


def corpus():
    path = shared_file("tinyshakespeare/input.txt")
    if path:
        return path.read_text()[:30000]
    return " ".join(f"word{i % 97} and{i % 13} the{i % 7} citizen{i % 5}" for i in range(4000))


def write_tokenizer(folder):
    """A byte-level BPE trained here on a little text, 300 tokens and <|endoftext|>: no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [corpus()],
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>"}, f)


def make_hf_model(folder, config_class, overrides, save_kwargs=(), tokenizer=True, seed=0):
    """A transformers model, saved, every weight random at a scale that keeps activations O(1)."""
    import transformers

    config = getattr(transformers, config_class)(**{**SIZES, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                1 + 0.2 * torch.randn(p.shape, generator=g)
                if p.dim() == 1
                else torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5
            )
            # picotron's shared experts are not gated: sigmoid(0) = 1/2
            if name.endswith("shared_expert_gate.weight"):
                p.zero_()
    save_kwargs = dict(save_kwargs)
    if "dtype" in save_kwargs:
        model = model.to(save_kwargs.pop("dtype"))
    model.save_pretrained(folder, **save_kwargs)
    if tokenizer:
        write_tokenizer(folder)
    return str(folder)


def hf_reference(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def token_batch(seed=0):
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))


def export_picotron_model(root, overrides):
    """A random picotron model (test_export_hf's), saved and exported: (the export's folder, the
    model)."""
    from test_export_hf import random_model, save

    model = random_model(**overrides)
    save(model, root / "run")
    # its own check: exits if off
    export_hf.main([f"--out_dir={root / 'run'}", f"--hf_dir={root / 'hf'}"])
    return str(root / "hf"), model


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    if not HAVE_HF:
        pytest.skip("transformers, safetensors and tokenizers are not installed")
    root = tmp_path_factory.mktemp("hf")
    models = {
        name: make_hf_model(root / name, cls, overrides, save)
        for name, (cls, overrides, save) in MODELS.items()
    }
    return {
        **models,
        **{
            name: export_picotron_model(root / name, overrides)[0]
            for name, overrides in EXPORTED.items()
        },
    }


# -----------------------------------------------------------------------------
# one 2-rank launch: every model converted by train.py at tp=2 and at pp=2, and its logits at that
# layout


def convert_and_forward(rank, world_size, folders, out_root, idx):
    """On each rank: train.py's configure_run, setup and train with --max_iters=0 (the conversion),
    then the logits of the model each layout holds, assembled on rank 0 (tp: the vocabulary slices;
    pp: stage 0's hidden states sent to stage 1)."""
    results = {}
    for name, folder in folders.items():
        for layout in LAYOUTS[name]:
            cfg, _, _ = train.configure_run(
                [
                    f"--init_from={folder}",
                    "--max_iters=0",
                    f"--{layout}=2",
                    "--device=cpu",
                    "--dtype=float32",
                    f"--out_dir={out_root}/{name}_{layout}",
                ]
            )
            run = build.setup(cfg)
            model = train.train(cfg, run).eval()
            with torch.no_grad():
                # every rank computes the whole batch, its tokens sent to the experts' ranks
                if layout == "ep":
                    logits = model(idx)[0]
                elif layout == "tp":
                    parts = [None] * world_size
                    dist.all_gather_object(parts, model(idx)[0])
                    logits = torch.cat(parts, dim=-1)
                elif rank == 0:
                    dist.send(model(idx)[0].contiguous(), 1)
                else:
                    hidden = torch.empty(*idx.shape, model.cfg.n_embd)
                    dist.recv(hidden, 0)
                    logits = model(hidden)[0]
            if layout in ("tp", "ep") and rank == 0 or layout == "pp" and rank == 1:
                results[name, layout] = logits
            # what this rank read (loading again), against what it holds: fp32 in the file too
            if name == "llama":
                real_rows = lambda p: min(
                    p.shape[0],
                    getattr(p, "vocab_size", 1 << 62) - p.shape[0] * getattr(p, "tp_rank", 0),
                )
                held = sum(real_rows(p) * p[0].numel() * 4 for p in model.parameters())
                results["read", layout, rank] = (import_hf.load_weights(model, folder)[0], held)
    return results


@pytest.fixture(scope="module")
def converted(hf_models, tmp_path_factory):
    """{(model, layout): logits} from the 2-rank launch, and the folder of the converted
    checkpoints."""
    out_root = tmp_path_factory.mktemp("converted")
    per_rank = run_ranks(convert_and_forward, 2, hf_models, str(out_root), token_batch())
    return {**per_rank[0], **per_rank[1]}, out_root


@needs_hf
@pytest.mark.parametrize(
    "name,layout", [(name, layout) for name, layouts in LAYOUTS.items() for layout in layouts]
)
def test_a_loaded_model_gives_transformers_logits(name, layout, hf_models, converted):
    logits, _ = converted
    with torch.no_grad():
        want = hf_reference(hf_models[name])(token_batch()).logits
    got = logits[name, layout]
    assert got.shape == want.shape
    diff, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert diff <= 1e-5 * max(1.0, scale), (
        f"{name} at {layout}=2: logits differ by {diff:.2e} (logits up to {scale:.1f})"
    )


@needs_hf
@pytest.mark.parametrize("layout", ["tp", "pp"])
@pytest.mark.parametrize("name", MODELS)
def test_sample_py_decodes_greedily_as_transformers_does(name, layout, hf_models, converted):
    _, out_root = converted
    ckpt = checkpoint.latest_checkpoint(str(out_root / f"{name}_{layout}"))
    # the folder's tokenizer.json
    assert checkpoint.read_meta(ckpt)["tokenizer"] == os.path.abspath(hf_models[name])
    text = sample.main(
        [
            f"--ckpt={ckpt}",
            f"--start={PROMPT}",
            "--num_samples=1",
            "--max_new_tokens=16",
            "--top_k=1",
            "--device=cpu",
            "--dtype=float32",
        ]
    )[0]
    tokenizer = hf_tokenizer.FolderTokenizer(hf_models[name])
    prompt = torch.tensor([tokenizer.encode(PROMPT)])
    ids = hf_reference(hf_models[name]).generate(
        prompt, max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(prompt)
    )
    assert text == tokenizer.decode(ids[0].tolist())


@needs_hf
@pytest.mark.parametrize("layout", ["tp", "pp", "ep"])
def test_an_exported_mixture_of_experts_loads_at_every_layout_as_the_model_exported(
    layout, converted
):
    """Export, then import: the logits at each layout are those of the picotron model that was
    exported (random_model is seeded: this is the same model), as well as transformers' (above)."""
    from test_export_hf import random_model

    logits, _ = converted
    with torch.no_grad():
        want = random_model(**EXPORTED["moe_export"])(token_batch())[0]
    diff, scale = (logits["moe_export", layout] - want).abs().max().item(), want.abs().max().item()
    assert diff <= 1e-5 * max(1.0, scale), (
        f"at {layout}=2: logits differ by {diff:.2e} (logits up to {scale:.1f})"
    )


@needs_hf
def test_a_converted_mixture_of_experts_routes_dropless_and_resumes_so(converted):
    """transformers drops no token: the conversion is capacity_factor=0, and a resume of it keeps
    it."""
    _, out_root = converted
    meta = checkpoint.read_meta(checkpoint.latest_checkpoint(str(out_root / "moe_export_ep")))
    assert (
        meta["layout"]["ep"] == 2
        and meta["config"]["capacity_factor"] == 0
        and meta["model"]["n_shared_expert"] == 1
    )
    cfg, _, _ = train.configure_run(
        ["--init_from=resume", f"--out_dir={out_root / 'moe_export_ep'}", "--max_iters=5"]
    )
    assert (cfg.capacity_factor, cfg.n_expert, cfg.n_expert_per_token, cfg.aux_loss_coef) == (
        0,
        4,
        2,
        0.01,
    )


@needs_hf
def test_the_conversion_is_a_step_0_checkpoint_without_run_settings_or_optimizer(
    hf_models, converted
):
    _, out_root = converted
    ckpt = checkpoint.latest_checkpoint(str(out_root / "qwen3_tp"))
    meta = checkpoint.read_meta(ckpt)
    assert meta["step"] == 0 and meta["layout"] == {"dp": 1, "cp": 1, "tp": 2, "pp": 1, "ep": 1}
    assert meta["converted_from"] == os.path.abspath(hf_models["qwen3"])
    assert "max_iters" not in meta["config"] and "learning_rate" not in meta["config"]
    assert (
        meta["model"]["head_dim"] == 32
        and meta["model"]["qk_norm"]
        and meta["model"]["intermediate_size"] == 96
    )
    assert not checkpoint.CheckpointReader(ckpt).has("optimizer", "tok_emb.weight")


# -----------------------------------------------------------------------------
# one process: the settings, the refusals, resuming a converted model


@needs_hf
@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_each_rank_reads_only_the_slices_it_holds(layout, hf_models, converted):
    logits, _ = converted
    from safetensors.torch import load_file

    whole = sum(
        t.numel() * 4
        for t in load_file(os.path.join(hf_models["llama"], "model.safetensors")).values()
    )
    for rank in (0, 1):
        read, held = logits["read", layout, rank]
        assert read == held < 0.7 * whole, (
            f"rank {rank} read {read} bytes, holds {held}, the model has {whole}"
        )


@needs_hf
def test_the_settings_come_from_config_json_and_a_different_one_is_refused_by_name(hf_models):
    cfg, notes, _ = train.configure_run(
        [f"--init_from={hf_models['qwen2']}", "--max_iters=0", "--rope_theta=5e5"]
    )
    assert (cfg.n_layer, cfg.n_kv_head, cfg.head_dim, cfg.qkv_bias, cfg.tie_embeddings) == (
        3,
        1,
        32,
        True,
        True,
    )
    # allowed: a context extension
    assert any("rope_theta = 500000.0, the model's was 10000.0" in n for n in notes)
    with pytest.raises(
        ConfigError,
        match=r"n_layer = 5 \(the model has 3\); qkv_bias = False \(the model has True\)",
    ):
        train.configure_run(
            [f"--init_from={hf_models['qwen2']}", "--n_layer=5", "--qkv_bias=False"]
        )


REFUSED = [  # (config class, settings, the words naming what picotron cannot represent)
    (
        "LlamaConfig",
        dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
        "rope_type='yarn'",
    ),
    ("LlamaConfig", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("LlamaConfig", dict(attention_bias=True), "attention_bias=True with mlp_bias=False"),
    ("Qwen2Config", dict(use_sliding_window=True, max_window_layers=0), "use_sliding_window=True"),
    ("Qwen3Config", dict(attention_bias=True), "attention_bias=True"),
    (
        "DeepseekV3Config",
        dict(first_k_dense_replace=1, n_routed_experts=4, rope_interleave=False),
        "first_k_dense_replace=1",
    ),
    ("GPTNeoXConfig", dict(hidden_act="gelu_new"), "partial_rotary_factor=0.25"),
    ("MistralConfig", {}, "'MistralForCausalLM'"),
    # a mixture of experts picotron's does not compute: renormalised top-k weights, dense layers
    # among the sparse
    ("Qwen3MoeConfig", dict(norm_topk_prob=True), "norm_topk_prob=True"),
    ("Qwen2MoeConfig", dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
    ("Qwen2MoeConfig", dict(mlp_only_layers=[1]), "mlp_only_layers=[1]"),
]


@needs_hf
@pytest.mark.parametrize("config_class,overrides,words", REFUSED, ids=[r[2] for r in REFUSED])
def test_what_picotron_cannot_represent_is_refused_by_its_config_json_name(
    tmp_path, config_class, overrides, words
):
    import transformers

    config = getattr(transformers, config_class)(**{**SIZES, **overrides})
    config.architectures = [config_class.replace("Config", "ForCausalLM")]
    config.save_pretrained(tmp_path)
    with pytest.raises(
        SystemExit,
        match=f"error: picotron cannot represent .*{re.escape(words)}"
        if "ForCausalLM" not in words
        else words,
    ):
        train.main([f"--init_from={tmp_path}", "--max_iters=0", f"--out_dir={tmp_path / 'out'}"])


@needs_hf
def test_a_gated_shared_expert_is_refused_by_tensor_name(hf_models, tmp_path):
    """Qwen1.5-MoE learned its shared expert's gate; picotron's shared experts have none (its own
    exports hold a zero gate, which it reads back)."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "gated"
    shutil.copytree(hf_models["qwen2_moe"], folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.mlp.shared_expert_gate.weight"][0, 3] = 0.5
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        SystemExit,
        match=r"'model.layers.1.mlp.shared_expert_gate.weight' is not zero: Qwen2-MoE gates "
        r"its shared expert",
    ):
        train.main([f"--init_from={folder}", "--max_iters=0", f"--out_dir={tmp_path / 'out'}"])


@needs_hf
def test_weights_that_do_not_fit_the_config_are_refused_by_tensor_name(hf_models, tmp_path):
    folder = tmp_path / "llama"
    shutil.copytree(hf_models["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    with pytest.raises(
        SystemExit,
        match=r"'model.layers.0.mlp.gate_proj.weight' has shape \[96, 64\], the config says "
        r"\[128, 64\]",
    ):
        train.main([f"--init_from={folder}", "--max_iters=0", f"--out_dir={tmp_path / 'out'}"])
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(
        SystemExit, match=r"'model.layers.2.mlp.up_proj.weight' has no place in picotron's model"
    ):
        train.main([f"--init_from={folder}", "--max_iters=0", f"--out_dir={tmp_path / 'out'}"])


@needs_hf
def test_training_from_a_converted_model_equals_training_from_the_folder(hf_models, tmp_path):
    """Converting (max_iters=0) then resuming is training from the folder directly: the same
    weights, a fresh optimizer at step 0, and max_iters and the schedule from the resuming command
    line."""
    data = make_token_data(str(tmp_path / "data"), vocab_size=300)
    run = [
        "--device=cpu",
        "--dtype=float32",
        f"--data_dir={data}",
        "--batch_size=2",
        "--block_size=16",
        "--log_interval=1",
        "--eval_interval=0",
        "--checkpoint_interval=0",
        "--max_iters=3",
        "--warmup_iters=1",
        "--learning_rate=3e-3",
        "--lr_decay_iters=3",
    ]
    folder = hf_models["llama3"]
    train.main([f"--init_from={folder}", f"--out_dir={tmp_path / 'direct'}", *run])
    train.main([f"--init_from={folder}", "--max_iters=0", f"--out_dir={tmp_path / 'converted'}"])
    train.main(["--init_from=resume", f"--out_dir={tmp_path / 'converted'}", *run])
    records = {
        d: [json.loads(line) for line in open(tmp_path / d / "metrics.jsonl")]
        for d in ("direct", "converted")
    }
    assert [r["step"] for r in records["converted"]] == [1, 2, 3]
    for key in ("loss", "lr", "grad_norm"):
        got, want = [r[key] for r in records["converted"]], [r[key] for r in records["direct"]]
        assert got == pytest.approx(want, rel=1e-6), f"{key}: {got} against {want}"
    with pytest.raises(ConfigError, match=r"head_dim = 8 \(the checkpoint has 0\)"):
        train.configure_run(
            ["--init_from=resume", f"--out_dir={tmp_path / 'converted'}", "--head_dim=8"]
        )


def test_max_iters_0_converts_a_model_and_is_refused_otherwise():
    with pytest.raises(ConfigError, match="max_iters = 0 trains nothing: it only converts a model"):
        settings.check_values(dict(settings.DEFAULTS, max_iters=0))


def test_an_older_checkpoint_without_the_new_settings_is_the_default_model():
    old = {
        k: v
        for k, v in vars(ModelConfig()).items()
        if k not in ("head_dim", "intermediate_size", "qkv_bias")
    }
    checkpoint.check_model_config(old, ModelConfig(), "ckpt")
    for change in ("head_dim", "intermediate_size"):
        with pytest.raises(
            checkpoint.CheckpointError, match=f"{change} = 64 .the checkpoint has 0."
        ):
            checkpoint.check_model_config(old, ModelConfig(**{change: 64}), "ckpt")


@needs_hf
def test_transformers_defaults_are_those_import_hf_assumes():
    """A config.json may leave out what equals its class's default: import_hf's table must be that
    default."""
    import transformers

    for arch in import_hf.ARCHITECTURES:
        config = getattr(transformers, arch.replace("ForCausalLM", "Config"))().to_dict()
        for key, value in {**import_hf.COMMON_DEFAULTS, **import_hf.DEFAULTS[arch]}.items():
            if key in config and value is not None and key != "rope_theta":
                assert config[key] == value, (
                    f"{arch}: {key} defaults to {config[key]!r}, import_hf assumes {value!r}"
                )
            if key == "partial_rotary_factor":
                assert config["rope_parameters"]["partial_rotary_factor"] == value


@needs_hf
def test_llama3_frequencies_are_transformers_at_llama_3_2_sizes():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](
        LlamaConfig(hidden_size=2048, num_attention_heads=32, rope_parameters=rope), "cpu"
    )
    plain = 1.0 / 500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    got = llama3_scaled_frequencies(plain, 32.0, 1.0, 4.0, 8192)
    torch.testing.assert_close(got.float(), want, rtol=1e-6, atol=0)
    assert (got < plain).any() and (got == plain).any()  # some frequencies scaled, some kept
    cos, _ = rope_cache(16, 64, 500000.0, (32.0, 1.0, 4.0, 8192))
    assert not torch.allclose(cos, rope_cache(16, 64, 500000.0)[0])


# -----------------------------------------------------------------------------
# export, then import: the same model back


@needs_hf
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(n_kv_head=2, tie_embeddings=False, head_dim=32, intermediate_size=96),
        dict(qkv_bias=True, n_kv_head=1),
        dict(rope_scaling_factor=8.0, rope_original_context=16, bias=True),
        dict(qk_norm=True, head_dim=32),
        dict(attn_softcap=5.0, final_softcap=3.0),
        dict(attn_softcap=5.0, tie_embeddings=False, intermediate_size=80),
        dict(
            attention="mla",
            kv_lora_rank=32,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            norm_eps=1e-6,
        ),
        dict(norm="layernorm", mlp="gelu", bias=True),
        dict(
            norm="layernorm",
            mlp="gelu",
            parallel_block=True,
            tie_embeddings=False,
            intermediate_size=96,
        ),
        dict(
            n_expert=4,
            capacity_factor=0.0,
            n_shared_expert=2,
            intermediate_size=32,
            aux_loss_coef=0.02,
        ),
        dict(n_expert=4, capacity_factor=0.0, n_expert_per_token=1, tie_embeddings=False),
        dict(n_expert=4, capacity_factor=0.0, qk_norm=True),
    ],
    ids=[
        "llama",
        "gqa-head_dim-intermediate",
        "qwen2",
        "llama3-bias",
        "qwen3",
        "vaultgemma-tied",
        "vaultgemma-untied",
        "mla",
        "neox",
        "neox-parallel-no-bias",
        "qwen2_moe-two-shared-experts",
        "qwen2_moe-no-shared-expert-top1",
        "qwen3_moe",
    ],
)
def test_an_export_imports_as_the_same_model(tmp_path, overrides):
    from test_export_hf import TINY, random_model, save

    model = random_model(**overrides)
    save(model, tmp_path / "run")
    # its own check: exits if off
    export_hf.main([f"--out_dir={tmp_path / 'run'}", f"--hf_dir={tmp_path / 'hf'}"])
    found, _, _ = import_hf.model_settings(str(tmp_path / "hf"))
    cfg = ModelConfig(**found, block_size=TINY["block_size"])
    assert cfg == model.cfg
    import_hf.check_weights(str(tmp_path / "hf"), cfg)
    back = Transformer(cfg)
    import_hf.load_weights(back, str(tmp_path / "hf"))
    original = dict(model.named_parameters())
    for name, p in back.named_parameters():
        torch.testing.assert_close(
            p, original[name], rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}"
        )
    x = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # load_weights marked the layers it filled: they compute
        torch.testing.assert_close(back(x)[0], model(x)[0], rtol=1e-4, atol=1e-4)


# -----------------------------------------------------------------------------
# the tokenizer


@needs_hf
def test_prepare_data_tokenizes_with_a_model_folders_tokenizer(hf_models, tmp_path):
    # (here: datasets takes seconds to import, which the 2-rank workers need not)
    import prepare_data

    (tmp_path / "docs").mkdir()
    texts = [corpus()[i * 500 : (i + 1) * 500] for i in range(6)]
    for i, text in enumerate(texts):
        (tmp_path / "docs" / f"{i}.txt").write_text(text)
    prepare_data.main(
        [
            f"--dataset={tmp_path / 'docs'}",
            f"--out_dir={tmp_path / 'data'}",
            f"--tokenizer={hf_models['llama']}",
            "--num_proc=2",
            "--val_fraction=0",
        ]
    )
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    tokenizer = hf_tokenizer.FolderTokenizer(hf_models["llama"])
    assert meta["tokenizer"] == os.path.abspath(hf_models["llama"]) and meta["vocab_size"] == 300
    want = [t for text in texts for t in tokenizer.encode_ordinary(text) + [tokenizer.eot_token]]
    import numpy as np

    assert np.fromfile(tmp_path / "data" / "train.bin", dtype=meta["dtype"]).tolist() == want


@needs_hf
def test_a_folder_without_tokenizer_files_asks_for_tokenizer(hf_models, tmp_path):
    import prepare_data

    folder = make_hf_model(tmp_path / "bare", "LlamaConfig", {}, tokenizer=False)
    with pytest.raises(
        SystemExit, match="holds no tokenizer.json: name its tokenizer with --tokenizer"
    ):
        prepare_data.main(
            [f"--dataset={tmp_path}", f"--out_dir={tmp_path / 'data'}", f"--tokenizer={folder}"]
        )
    train.main([f"--init_from={folder}", "--max_iters=0", f"--out_dir={tmp_path / 'out'}"])
    with pytest.raises(
        SystemExit, match=r"converted from .*bare, which has no tokenizer files: pass --tokenizer"
    ):
        sample.main([f"--out_dir={tmp_path / 'out'}", "--max_new_tokens=2", "--num_samples=1"])
    text = sample.main(
        [
            f"--out_dir={tmp_path / 'out'}",
            f"--tokenizer={hf_models['llama']}",
            "--start=the",
            "--max_new_tokens=2",
            "--num_samples=1",
            "--top_k=1",
        ]
    )[0]
    assert text.startswith("the")


@needs_hf
@needs_gpt2
def test_a_folder_with_gpt2s_vocabulary_uses_tiktoken(tmp_path):
    import prepare_data

    export_hf.write_gpt2_tokenizer(str(tmp_path), 64)
    assert prepare_data.get_encoding(str(tmp_path)).name == "gpt2"  # tiktoken's own
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    # one token spelled otherwise
    spec["model"]["vocab"]["hello"] = spec["model"]["vocab"].pop("Ġthe")
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    assert hf_tokenizer.resolve(str(tmp_path)) == os.path.abspath(tmp_path)


@needs_hf
def test_without_the_tokenizers_package_the_error_gives_the_pip_command(hf_models, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers now raises ImportError
    with pytest.raises(ValueError, match="pip install tokenizers"):
        hf_tokenizer.FolderTokenizer(hf_models["llama"])
