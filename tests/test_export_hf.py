"""export_hf.py: a picotron checkpoint becomes a transformers model that computes the same thing.

The reference is transformers itself: the exported directory is loaded with the architecture's own
from_pretrained and its logits and greedy tokens are compared with picotron's model. Weights are
random and large (gains away from one, attention far from uniform), so a misplaced or mistransformed
tensor changes the logits by O(1), not by a rounding error.
"""

import importlib.util
import os
import stat

import pytest
import torch

import checkpoint
import export_hf
from dist_utils import make_token_data, train_in_process
from model import ModelConfig, Transformer, model_config_from
from parallel import ParallelLayout

HAVE_HF = all(importlib.util.find_spec(p) for p in ("transformers", "safetensors"))
needs_hf = pytest.mark.skipif(
    not HAVE_HF,
    reason="transformers and safetensors are not installed (pip install -r requirements-dev.txt)",
)
TINY = dict(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_kv_head=4, n_embd=64)


def random_model(**overrides):
    """A tiny model with every weight random at a scale that keeps activations O(1)."""
    model = Transformer(ModelConfig(**dict(TINY, **overrides)), attn_impl="eager")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norm gains and biases
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    return model.eval()


def save(model, out_dir, tokenizer="gpt2"):
    layout = ParallelLayout(1, 1, 1)  # one process: every piece is saved here
    checkpoint.save(
        str(out_dir),
        7,
        0,
        1,
        checkpoint.model_pieces(model, layout),
        {},
        {"model": vars(model.cfg), "tokenizer": tokenizer},
    )


def hf_class(name):
    import transformers

    return getattr(transformers, name)


def export_and_reload(model, tmp_path, arch):
    save(model, tmp_path / "run")
    export_hf.main(
        [f"--out_dir={tmp_path / 'run'}", f"--hf_dir={tmp_path / 'hf'}", "--check=False"]
    )
    return (
        hf_class(arch)
        .from_pretrained(tmp_path / "hf", dtype=torch.float32, attn_implementation="eager")
        .eval()
    )


@torch.no_grad()
def max_logit_diff(model, hf_model, seed=0):
    idx = torch.randint(
        0,
        model.cfg.vocab_size,
        (2, model.cfg.block_size),
        generator=torch.Generator().manual_seed(seed),
    )
    ours, theirs = model(idx)[0], hf_model(idx).logits
    assert ours.shape == theirs.shape
    return (ours - theirs).abs().max().item()


@needs_hf
@pytest.mark.parametrize(
    "n_kv_head,tie", [(4, True), (2, False), (1, True)], ids=["mha-tied", "gqa-untied", "mqa-tied"]
)
def test_llama_export_gives_the_same_logits(tmp_path, n_kv_head, tie):
    model = random_model(n_kv_head=n_kv_head, tie_embeddings=tie)
    hf_model = export_and_reload(model, tmp_path, "LlamaForCausalLM")
    assert (
        hf_model.config.tie_word_embeddings == tie
        and hf_model.config.num_key_value_heads == n_kv_head
    )
    assert max_logit_diff(model, hf_model) < 2e-5


@needs_hf
def test_llama_export_generates_the_same_greedy_tokens(tmp_path):
    model = random_model(n_kv_head=2, tie_embeddings=False)
    hf_model = export_and_reload(model, tmp_path, "LlamaForCausalLM")
    prompt = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(3))
    ours = model.generate(prompt, max_new_tokens=20, top_k=1)
    theirs = hf_model.generate(
        prompt, max_new_tokens=20, do_sample=False, attention_mask=torch.ones_like(prompt)
    )
    assert torch.equal(ours, theirs)


@needs_hf
def test_a_checkpoint_written_by_train_py_exports_with_its_own_check(tmp_path):
    """The real path: train.py's checkpoint (meta written by train.py) through the command line,
    whose own reload-and-compare check must pass."""
    data = make_token_data(str(tmp_path / "data"))
    train_in_process(
        [
            f"--data_dir={data}",
            f"--out_dir={tmp_path / 'run'}",
            "--n_layer=2",
            "--n_embd=64",
            "--n_head=4",
            "--n_kv_head=2",
            "--tie_embeddings=False",
            "--block_size=32",
            "--batch_size=2",
            "--max_iters=2",
            "--warmup_iters=0",
            "--eval_interval=0",
            "--checkpoint_interval=2",
            "--device=cpu",
        ]
    )
    # check=True: exits if off
    export_hf.main([f"--out_dir={tmp_path / 'run'}", f"--hf_dir={tmp_path / 'hf'}"])
    reader = checkpoint.CheckpointReader(checkpoint.latest_checkpoint(str(tmp_path / "run")))
    model = Transformer(model_config_from(reader.meta["model"]), attn_impl="eager")
    checkpoint.load_model(model, reader)
    hf_model = hf_class("LlamaForCausalLM").from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert max_logit_diff(model.eval(), hf_model) < 1e-5


@needs_hf
def test_the_export_check_catches_a_wrong_export(tmp_path, monkeypatch):
    model = random_model()
    save(model, tmp_path / "run")
    real = export_hf.hf_tensors

    def swapped_norms(model, arch):  # a plausible mistake: the two norms of a block exchanged
        t = real(model, arch)
        a, b = (
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight",
        )
        t[a], t[b] = t[b], t[a]
        return t

    monkeypatch.setattr(export_hf, "hf_tensors", swapped_norms)
    with pytest.raises(SystemExit, match="does not reproduce picotron's logits"):
        export_hf.main([f"--out_dir={tmp_path / 'run'}", f"--hf_dir={tmp_path / 'hf'}"])


@needs_hf
def test_the_weights_get_the_mode_of_the_other_exported_files(tmp_path):
    save(random_model(), tmp_path / "run")
    export_hf.main(
        [f"--out_dir={tmp_path / 'run'}", f"--hf_dir={tmp_path / 'hf'}", "--check=False"]
    )
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in (tmp_path / "hf").iterdir()}
    umask = os.umask(0)
    os.umask(umask)
    assert modes["model.safetensors"] == modes["config.json"] == 0o666 & ~umask, modes


@needs_hf
def test_a_gpt2_vocabulary_model_exports_with_a_working_tokenizer(tmp_path, gpt2):
    model = random_model(vocab_size=50257, n_layer=1)
    save(model, tmp_path / "run", tokenizer="gpt2")
    export_hf.main(
        [f"--out_dir={tmp_path / 'run'}", f"--hf_dir={tmp_path / 'hf'}", "--check=False"]
    )
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = (
        "First Citizen:\nBefore we proceed any further, hear me speak.  naïve café 🙂<|endoftext|>"
    )
    assert tokenizer.encode(text) == gpt2.encode(text, allowed_special="all")
    assert (
        tokenizer.eos_token_id
        == AutoConfig.from_pretrained(tmp_path / "hf").eos_token_id
        == gpt2.eot_token
    )


@needs_hf
def test_padding_rows_of_the_vocabulary_are_not_exported(tmp_path):
    model = random_model(vocab_size=500)  # padded to 512 rows in picotron
    assert model.tok_emb.weight.shape[0] == 512
    hf_model = export_and_reload(model, tmp_path, "LlamaForCausalLM")
    assert hf_model.model.embed_tokens.weight.shape[0] == 500
    assert max_logit_diff(model, hf_model) < 2e-5


# -----------------------------------------------------------------------------
# picotron's variants (a renamed option fails here: ModelConfig refuses an unknown field)

VARIANTS = [
    ("qk_norm", dict(qk_norm=True), "Qwen3ForCausalLM"),
    (
        "qk_norm-gqa-untied",
        dict(qk_norm=True, n_kv_head=2, tie_embeddings=False),
        "Qwen3ForCausalLM",
    ),
    ("softcaps-tied", dict(attn_softcap=5.0, final_softcap=3.0), "VaultGemmaForCausalLM"),
    (
        "softcaps-untied",
        dict(attn_softcap=5.0, final_softcap=3.0, tie_embeddings=False),
        "VaultGemmaForCausalLM",
    ),
    ("final-softcap", dict(final_softcap=3.0), "VaultGemmaForCausalLM"),
    ("bias", dict(bias=True), "LlamaForCausalLM"),
    (
        "mla",
        dict(
            attention="mla",
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            norm_eps=1e-6,
        ),
        "DeepseekV3ForCausalLM",
    ),
    (
        "mla-q-lora-untied",
        dict(
            attention="mla",
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            tie_embeddings=False,
            norm_eps=1e-6,
        ),
        "DeepseekV3ForCausalLM",
    ),
    ("gpt2-pieces", dict(norm="layernorm", mlp="gelu", bias=True), "GPTNeoXForCausalLM"),
    (
        "gpt2-pieces-parallel-no-bias-untied",
        dict(norm="layernorm", mlp="gelu", parallel_block=True, tie_embeddings=False),
        "GPTNeoXForCausalLM",
    ),
]


@needs_hf
@pytest.mark.parametrize("overrides,arch", [v[1:] for v in VARIANTS], ids=[v[0] for v in VARIANTS])
def test_variant_exports_to_its_architecture_with_the_same_logits(tmp_path, overrides, arch):
    model = random_model(**overrides)
    hf_model = export_and_reload(model, tmp_path, arch)
    assert type(hf_model).__name__ == arch
    assert max_logit_diff(model, hf_model) < 2e-5


@pytest.mark.parametrize(
    "option,value",
    [("n_expert", 4), ("parallel_block", True), ("norm", "layernorm"), ("mlp", "gelu")],
)
def test_an_option_no_architecture_holds_is_refused_by_name(option, value):
    cfg = ModelConfig(**TINY, **{option: value})
    with pytest.raises(
        ValueError, match=f"{option}={value!r}" if isinstance(value, str) else f"{option}={value}"
    ):
        export_hf.hf_architecture(cfg)


def test_qk_norm_with_softcapping_is_refused():
    with pytest.raises(ValueError, match="qk_norm=True with soft-capping"):
        export_hf.hf_architecture(ModelConfig(**TINY, qk_norm=True, attn_softcap=30.0))
    with pytest.raises(ValueError, match="bias=True with qk_norm: Qwen3 has no MLP biases"):
        export_hf.hf_architecture(ModelConfig(**TINY, qk_norm=True, bias=True))


def test_architecture_follows_the_options():
    assert export_hf.hf_architecture(ModelConfig(**TINY)) == "LlamaForCausalLM"
    assert export_hf.hf_architecture(ModelConfig(**TINY, qk_norm=True)) == "Qwen3ForCausalLM"
    assert (
        export_hf.hf_architecture(ModelConfig(**TINY, final_softcap=30.0))
        == "VaultGemmaForCausalLM"
    )
    assert (
        export_hf.hf_architecture(ModelConfig(**TINY, attention="mla")) == "DeepseekV3ForCausalLM"
    )
    assert (
        export_hf.hf_architecture(ModelConfig(**TINY, norm="layernorm", mlp="gelu"))
        == "GPTNeoXForCausalLM"
    )
    with pytest.raises(ValueError, match="GPT-NeoX has no grouped-query attention"):
        export_hf.hf_architecture(
            ModelConfig(**dict(TINY, n_kv_head=2), norm="layernorm", mlp="gelu")
        )
    with pytest.raises(ValueError, match="attention='mla' with qk_norm"):
        export_hf.hf_architecture(ModelConfig(**TINY, attention="mla", qk_norm=True))


# -----------------------------------------------------------------------------
# a dropless mixture of experts (capacity_factor=0): Qwen2-MoE's routing (softmax, top-k, no
# renormalising)

DROPLESS = dict(n_expert=4, n_expert_per_token=2, capacity_factor=0.0)
MOE_VARIANTS = [
    ("shared-expert", dict(DROPLESS, n_shared_expert=1), "Qwen2MoeForCausalLM"),
    (
        "two-shared-experts-untied",
        dict(DROPLESS, n_shared_expert=2, tie_embeddings=False),
        "Qwen2MoeForCausalLM",
    ),
    ("no-shared-expert-top1", dict(DROPLESS, n_expert_per_token=1), "Qwen2MoeForCausalLM"),
    ("qk_norm", dict(DROPLESS, qk_norm=True), "Qwen3MoeForCausalLM"),
]


@needs_hf
@pytest.mark.parametrize(
    "overrides,arch", [v[1:] for v in MOE_VARIANTS], ids=[v[0] for v in MOE_VARIANTS]
)
def test_a_dropless_mixture_of_experts_exports_with_the_same_logits(tmp_path, overrides, arch):
    model = random_model(**overrides)
    hf_model = export_and_reload(model, tmp_path, arch)
    assert type(hf_model).__name__ == arch and hf_model.config.norm_topk_prob is False
    diff = max_logit_diff(model, hf_model)
    assert diff < 2e-5, f"max logit difference {diff:.2e}"


@needs_hf
def test_a_dropless_moe_checkpoint_of_train_py_generates_the_same_greedy_tokens(tmp_path):
    """train.py's checkpoint through the command line (its own reload-and-compare check must pass),
    then greedy generation in transformers against picotron's (sample.py's Transformer.generate)."""
    data = make_token_data(str(tmp_path / "data"))
    train_in_process(
        [
            f"--data_dir={data}",
            f"--out_dir={tmp_path / 'run'}",
            "--n_layer=2",
            "--n_embd=64",
            "--n_head=4",
            "--n_kv_head=2",
            "--block_size=32",
            "--batch_size=2",
            "--max_iters=2",
            "--warmup_iters=0",
            "--n_expert=4",
            "--capacity_factor=0",
            "--n_shared_expert=1",
            "--learning_rate=1e-2",
            "--eval_interval=0",
            "--checkpoint_interval=2",
            "--device=cpu",
            "--peak_flops=1e12",
        ]
    )
    # check=True: exits if off
    export_hf.main([f"--out_dir={tmp_path / 'run'}", f"--hf_dir={tmp_path / 'hf'}"])
    reader = checkpoint.CheckpointReader(checkpoint.latest_checkpoint(str(tmp_path / "run")))
    model = Transformer(model_config_from(reader.meta["model"]), attn_impl="eager")
    checkpoint.load_model(model, reader)
    model.eval()
    hf_model = (
        hf_class("Qwen2MoeForCausalLM").from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    )
    diff = max_logit_diff(model, hf_model)
    print(
        "train.py's dropless MoE checkpoint as Qwen2MoeForCausalLM: max logit difference "
        f"{diff:.2e}"
    )
    assert diff < 1e-5
    prompt = torch.randint(
        0, model.cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(3)
    )
    ours = model.generate(prompt, max_new_tokens=20, top_k=1)
    theirs = hf_model.generate(
        prompt, max_new_tokens=20, do_sample=False, attention_mask=torch.ones_like(prompt)
    )
    assert torch.equal(ours, theirs)


def test_a_mixture_of_experts_with_capacity_dropping_is_refused_by_name():
    with pytest.raises(
        ValueError,
        match="n_expert=4 with capacity_factor=1.25: no transformers architecture drops tokens",
    ):
        export_hf.hf_architecture(ModelConfig(**TINY, n_expert=4, capacity_factor=1.25))
    with pytest.raises(
        ValueError, match="qk_norm=True and n_shared_expert=1: Qwen3-MoE has no shared expert"
    ):
        export_hf.hf_architecture(ModelConfig(**TINY, **DROPLESS, qk_norm=True, n_shared_expert=1))
    assert export_hf.hf_architecture(ModelConfig(**TINY, **DROPLESS)) == "Qwen2MoeForCausalLM"
