"""The model variants (model.py), one process: each variant against an independent reference or the
property that defines it, then causality and a short training run for every variant and for configs
that combine them all. tests/test_variants_tp.py checks the same variants at tp=2 against one
process."""

import importlib.machinery
import math
import re
import sys
import types
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import settings
from configurator import configure
from conftest import ROOT
from dist_utils import build_model, make_token_data, train_in_process
from model import (
    Block,
    CausalSelfAttention,
    GeluMLP,
    MixtureOfExperts,
    ModelConfig,
    MultiHeadLatentAttention,
    Transformer,
    apply_rope,
    causal_attention,
    causal_attention_scores,
    choose_attn_impl,
    expert_capacity_mask,
    flash_attn_available,
    make_norm,
    rope_cache,
)
from settings import check_layout

TINY = dict(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_kv_head=4, n_embd=64)
MLA = dict(attention="mla", kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
MOE = dict(
    n_expert=4,
    n_expert_per_token=2,
    n_shared_expert=1,
    router_z_loss_coef=1e-3,
    capacity_factor=1.0,
)
# every variant alone, and two configs that combine them all (GQA and MLA cannot be combined)
VARIANTS = {
    "llama": {},
    "gqa": dict(n_kv_head=2),
    "mqa": dict(n_kv_head=1),
    "mla": MLA,
    "mla_low_rank_q": {**MLA, "q_lora_rank": 24, "v_head_dim": 24},
    "qk_norm": dict(qk_norm=True),
    "softcap": dict(attn_softcap=5.0, final_softcap=10.0),
    "parallel_block": dict(parallel_block=True),
    "layernorm_gelu_bias": dict(norm="layernorm", mlp="gelu", bias=True),
    "moe": MOE,
    # the shapes of real checkpoints: heads not n_embd / n_head wide, any MLP width, q/k/v-only
    # biases, Llama 3's RoPE scaling (an original context of 16 < block_size 32 scales most
    # frequencies)
    "real_model_shapes": dict(
        n_kv_head=2,
        head_dim=32,
        intermediate_size=96,
        qkv_bias=True,
        rope_scaling_factor=8.0,
        rope_original_context=16,
    ),
    "all_gqa": dict(
        n_kv_head=2,
        qk_norm=True,
        attn_softcap=5.0,
        final_softcap=10.0,
        parallel_block=True,
        norm="layernorm",
        mlp="gelu",
        bias=True,
        **MOE,
    ),
    "all_mla": {
        **MLA,
        "q_lora_rank": 24,
        "qk_norm": True,
        "attn_softcap": 5.0,
        "final_softcap": 10.0,
        "parallel_block": True,
        "norm": "layernorm",
        "mlp": "gelu",
        "bias": True,
        **MOE,
    },
}


def tiny_config(**overrides):
    return ModelConfig(**{**TINY, **overrides})


def tiny_model(seed=0, attn_impl="eager", **overrides):
    torch.manual_seed(seed)
    m = Transformer(tiny_config(**overrides), attn_impl=attn_impl)
    m.init_weights(seed)
    return m


def tokens(batch=2, length=32, seed=0):
    return torch.randint(
        0, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed)
    )


# -----------------------------------------------------------------------------
# multi-head, grouped-query and multi-query attention


def reference_mha(x, wq, wk, wv, wo, n_head, cos, sin):
    """Plain multi-head attention, one head at a time, with an explicit causal softmax."""
    B, T, C = x.shape
    D = C // n_head
    q = apply_rope((x @ wq.T).view(B, T, n_head, D), cos, sin)
    k = apply_rope((x @ wk.T).view(B, T, n_head, D), cos, sin)
    v = (x @ wv.T).view(B, T, n_head, D)
    heads = []
    for h in range(n_head):
        scores = q[:, :, h] @ k[:, :, h].transpose(1, 2) / math.sqrt(D)  # (B, T, T)
        scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
        heads.append(scores.softmax(-1) @ v[:, :, h])
    return torch.cat(heads, dim=-1) @ wo.T


def test_attention_with_as_many_kv_heads_as_heads_is_plain_multi_head_attention():
    cfg = tiny_config(n_kv_head=4)
    attn = CausalSelfAttention(cfg)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 16, cfg.n_embd)
    cos, sin = rope_cache(cfg.block_size, cfg.n_embd // cfg.n_head, cfg.rope_theta)
    expected = reference_mha(
        x,
        attn.q_proj.weight,
        attn.k_proj.weight,
        attn.v_proj.weight,
        attn.o_proj.weight,
        cfg.n_head,
        cos,
        sin,
    )
    torch.testing.assert_close(attn(x, cos, sin), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_kv_head", [2, 1], ids=["gqa", "mqa"])
def test_grouped_query_attention_equals_mha_with_each_kv_head_copied_to_its_query_heads(n_kv_head):
    gqa = CausalSelfAttention(tiny_config(n_kv_head=n_kv_head))
    mha = CausalSelfAttention(tiny_config(n_kv_head=4))
    for p in gqa.parameters():
        torch.nn.init.normal_(p, std=0.1)
    head_dim, group = 16, 4 // n_kv_head
    with torch.no_grad():
        mha.q_proj.weight.copy_(gqa.q_proj.weight)
        mha.o_proj.weight.copy_(gqa.o_proj.weight)
        for name in ("k_proj", "v_proj"):  # query head h reads key/value head h // group
            per_head = getattr(gqa, name).weight.view(n_kv_head, head_dim, -1)
            getattr(mha, name).weight.copy_(
                per_head.repeat_interleave(group, dim=0).reshape(4 * head_dim, -1)
            )
    x = torch.randn(2, 16, 64)
    cos, sin = rope_cache(32, head_dim, 10000.0)
    assert sum(p.numel() for p in gqa.parameters()) < sum(p.numel() for p in mha.parameters())
    torch.testing.assert_close(gqa(x, cos, sin), mha(x, cos, sin), rtol=1e-5, atol=1e-6)


def test_qk_norm_normalises_every_query_and_key_head_before_rope():
    cfg = tiny_config(qk_norm=True)
    attn = CausalSelfAttention(cfg)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, 0.1)
        attn.q_norm.weight.uniform_(0.5, 2.0)
        attn.k_norm.weight.copy_(attn.q_norm.weight)
    seen = {}
    attn.q_norm.register_forward_hook(lambda m, i, out: seen.setdefault("q", out))
    attn.k_norm.register_forward_hook(lambda m, i, out: seen.setdefault("k", out))
    # large inputs: without the norm, q and k would be large
    x = 100 * torch.randn(2, 8, cfg.n_embd)
    attn(x, *rope_cache(cfg.block_size, 16, cfg.rope_theta))
    for t in seen.values():  # (B, T, H, D): divided by the gain, every head has rms 1
        rms = (t / attn.q_norm.weight).pow(2).mean(-1).sqrt()
        torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-4, atol=1e-4)
    assert set(seen) == {"q", "k"} and attn.q_norm.weight.shape == (16,)


# -----------------------------------------------------------------------------
# multi-head latent attention


def test_mla_caches_kv_lora_rank_plus_rope_dims_per_token():
    cfg = tiny_config(**MLA)
    attn = MultiHeadLatentAttention(cfg)
    x = torch.randn(2, 10, cfg.n_embd)
    cached = attn.compress_kv(x)
    assert cached.shape == (2, 10, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    assert cfg.kv_lora_rank + cfg.qk_rope_head_dim < 2 * cfg.n_head * (
        cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    )


def test_mla_keys_and_values_see_the_tokens_only_through_the_cached_latent():
    """Feed the attention one input for its queries and another for its latent: the output changes
    exactly as if the second input had been the whole input's keys and values, i.e. k and v are a
    function of compress_kv's output alone."""
    cfg = tiny_config(**MLA, q_lora_rank=24)
    attn = MultiHeadLatentAttention(cfg)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.1)
    cos, sin = rope_cache(cfg.block_size, cfg.qk_rope_head_dim, cfg.rope_theta)
    x_q, x_kv = torch.randn(2, 8, cfg.n_embd), torch.randn(2, 8, cfg.n_embd)
    latent = attn.compress_kv(x_kv)
    attn.compress_kv = lambda x: latent  # the cache, in place of recomputing it from x
    mixed = attn(x_q, cos, sin)
    # reference: the same attention written from the latent, by hand
    B, T, H = 2, 8, cfg.n_head
    q = attn.q_up(attn.q_latent_norm(attn.q_down(x_q))).view(B, T, H, 24)
    c_kv, k_rope = latent.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    k_nope, v = attn.kv_up(attn.kv_latent_norm(c_kv)).view(B, T, H, 32).split([16, 16], dim=-1)
    q = torch.cat([q[..., :16], apply_rope(q[..., 16:], cos, sin)], dim=-1).transpose(1, 2)
    k = torch.cat(
        [k_nope, apply_rope(k_rope.unsqueeze(2), cos, sin).expand(B, T, H, 8)], dim=-1
    ).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True)  # scale 1/sqrt(24)
    expected = attn.o_proj(y.transpose(1, 2).reshape(B, T, H * 16))
    torch.testing.assert_close(mixed, expected, rtol=1e-5, atol=1e-6)


# -----------------------------------------------------------------------------
# soft-capping


def test_soft_capped_attention_scores_never_exceed_the_cap():
    q, k = 30 * torch.randn(2, 4, 16, 8), 30 * torch.randn(2, 4, 16, 8)
    uncapped = causal_attention_scores(q, k)
    capped = causal_attention_scores(q, k, softcap=5.0)
    finite = torch.isfinite(capped)
    assert uncapped[finite].abs().max() > 5.0  # the inputs would break the cap
    assert capped[finite].abs().max() <= 5.0
    assert torch.equal(finite, torch.isfinite(uncapped))  # still causal


def test_soft_capped_logits_never_exceed_the_cap():
    capped, uncapped = tiny_model(final_softcap=2.0), tiny_model()
    for m in (capped, uncapped):
        with torch.no_grad():
            m.lm_head.weight.mul_(200.0)  # tied: the embedding grows too, and with it the logits
    assert uncapped(tokens())[0].abs().max() > 2.0
    assert capped(tokens())[0].abs().max() <= 2.0


def test_a_very_large_softcap_changes_nothing():
    capped = tiny_model(attn_softcap=1e5, final_softcap=1e5)
    plain = tiny_model(attn_impl="eager")
    x = tokens()
    torch.testing.assert_close(capped(x, x)[0], plain(x, x)[0], rtol=1e-5, atol=1e-5)


# -----------------------------------------------------------------------------
# the parallel block, norms and MLPs


def test_parallel_block_is_x_plus_attn_of_norm_plus_mlp_of_norm():
    cfg = tiny_config(parallel_block=True, norm="layernorm", bias=True)
    block = Block(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    cos, sin = rope_cache(cfg.block_size, 16, cfg.rope_theta)
    x = torch.randn(2, 8, cfg.n_embd)
    h = F.layer_norm(x, (cfg.n_embd,), block.attn_norm.weight, block.attn_norm.bias, cfg.norm_eps)
    expected = x + block.attn(h, cos, sin) + block.mlp(h)
    sequential = x + block.attn(h, cos, sin)
    sequential = sequential + block.mlp(
        F.layer_norm(
            sequential, (cfg.n_embd,), block.attn_norm.weight, block.attn_norm.bias, cfg.norm_eps
        )
    )
    out = block(x, cos, sin)
    assert not hasattr(block, "mlp_norm")  # one norm feeds both
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(out, sequential, atol=1e-3)


def test_layernorm_and_gelu_mlp_are_gpt2s():
    cfg = tiny_config(norm="layernorm", mlp="gelu", bias=True)
    norm, mlp = make_norm(cfg, cfg.n_embd), GeluMLP(cfg)
    for p in list(norm.parameters()) + list(mlp.parameters()):
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(3, 5, cfg.n_embd)
    mean, var = x.mean(-1, keepdim=True), x.var(-1, keepdim=True, unbiased=False)
    torch.testing.assert_close(
        norm(x), (x - mean) / torch.sqrt(var + cfg.norm_eps) * norm.weight + norm.bias
    )
    assert mlp.up.weight.shape == (4 * cfg.n_embd, cfg.n_embd)
    h = x @ mlp.up.weight.T + mlp.up.bias
    h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))  # GPT-2's gelu
    torch.testing.assert_close(mlp(x), h @ mlp.down.weight.T + mlp.down.bias, rtol=1e-5, atol=1e-6)


def test_bias_setting_puts_biases_in_every_attention_and_mlp_linear():
    with_bias = dict(tiny_model(bias=True, norm="layernorm").named_parameters())
    without = dict(tiny_model().named_parameters())
    assert not any(n.endswith("bias") for n in without)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"blocks.0.attn.{name}.bias" in with_bias
    for name in (
        "gate",
        "up",
        "down",
    ):
        assert f"blocks.0.mlp.{name}.bias" in with_bias
    assert "blocks.0.attn_norm.bias" in with_bias and "norm.bias" in with_bias


# -----------------------------------------------------------------------------
# Mixture-of-Experts


def moe_layer(**overrides):
    cfg = tiny_config(**{**MOE, **overrides})
    layer = MixtureOfExperts(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return cfg, layer


def test_capacity_mask_keeps_each_experts_first_assignments_in_order():
    expert_ids = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    keep = expert_capacity_mask(expert_ids, n_expert=3, capacity=2)
    # expert 0: rows 0, 1 kept, rows 2 and 3 dropped; expert 1: rows 0, 2 kept, row 3 dropped
    assert keep.tolist() == [[True, True], [True, True], [False, True], [False, False]]


def test_no_expert_receives_more_than_its_capacity():
    cfg, layer = moe_layer(capacity_factor=1.0, n_shared_expert=0)
    with torch.no_grad():
        # nearly every token's first choice: expert 0
        layer.router.weight[0] += 5.0 * torch.ones(cfg.n_embd)
    x = torch.randn(4, 16, cfg.n_embd).abs()
    layer(x)
    capacity = math.ceil(1.0 * 64 * 2 / 4)
    assert layer.last_tokens_per_expert.max() <= capacity
    assert layer.last_tokens_per_expert[0] == capacity  # it was full: the overflow was dropped
    assert layer.last_dropped_frac > 0


def dense_top_k_reference(layer, x):
    """Run every expert on every token and combine each token's top-k with the router's
    probabilities."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = (tokens @ layer.router.weight.T).softmax(-1)
    gate, chosen = probs.topk(layer.k, dim=-1)
    every = torch.stack([expert(tokens) for expert in layer.experts.values()], dim=1)  # (N, E, C)
    out = (
        every.gather(1, chosen[..., None].expand(-1, -1, tokens.shape[-1])) * gate[..., None]
    ).sum(1)
    for shared in layer.shared_experts:
        out = out + shared(tokens)
    return out.view_as(x)


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_moe_without_drops_equals_dense_top_k_reference(mlp):
    cfg, layer = moe_layer(capacity_factor=4.0, mlp=mlp, bias=mlp == "gelu")
    x = torch.randn(3, 8, cfg.n_embd)
    out = layer(x)
    assert layer.last_dropped_frac == 0
    torch.testing.assert_close(out, dense_top_k_reference(layer, x), rtol=1e-5, atol=1e-6)


def test_capacity_factor_zero_is_dropless_routing():
    """capacity_factor = 0 keeps every assignment however unbalanced the router: an expert chosen by
    every token takes all of them, and the layer is the dense top-k mixture (which no capacity would
    give here)."""
    cfg, layer = moe_layer(capacity_factor=0.0, n_shared_expert=0)
    with torch.no_grad():
        # nearly every token's first choice: expert 0
        layer.router.weight[0] += 5.0 * torch.ones(cfg.n_embd)
    x = torch.randn(4, 16, cfg.n_embd).abs()
    out = layer(x)
    assert layer.last_dropped_frac == 0
    # expert 0 took all 64 tokens, twice what a capacity factor of 1 would let it (ceil(64 * 2 / 4)
    # = 32)
    assert layer.last_tokens_per_expert.sum() == 64 * 2 and layer.last_tokens_per_expert[0] == 64
    torch.testing.assert_close(out, dense_top_k_reference(layer, x), rtol=1e-5, atol=1e-6)


def test_dropped_tokens_pass_through_on_the_residual():
    cfg, layer = moe_layer(capacity_factor=0.25, n_expert_per_token=1, n_shared_expert=0)
    x = torch.randn(2, 16, cfg.n_embd)
    out = layer(x)
    dropped_rows = (out == 0).all(-1)  # a token none of whose experts took it gets exactly zero
    assert 0 < dropped_rows.float().mean() == pytest.approx(layer.last_dropped_frac.item())


def test_balanced_router_aux_loss_is_its_analytic_minimum():
    """Switch's loss n_expert * sum_e f_e P_e is minimal, equal to 1, when tokens and probability
    mass are spread evenly. Tokens here are one-hot in the first n_expert dimensions and the router
    reads them directly, so each expert is the first choice of exactly a quarter of the tokens."""
    cfg, layer = moe_layer(
        n_expert_per_token=1, aux_loss_coef=0.01, router_z_loss_coef=0.0, capacity_factor=4.0
    )
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, :4] = 3.0 * torch.eye(4)
    x = F.one_hot(torch.arange(32) % 4, cfg.n_embd).float().view(2, 16, cfg.n_embd)
    layer(x)
    assert layer.aux_loss.item() == pytest.approx(0.01 * 1.0, rel=1e-6)
    with torch.no_grad():
        layer.router.weight[0, :4] = 4.0  # expert 0 now wins every token
    layer(x)
    assert layer.aux_loss.item() > 0.015


def test_router_gets_gradients_from_the_language_modelling_loss_alone():
    m = tiny_model(**{**MOE, "aux_loss_coef": 0.0, "router_z_loss_coef": 0.0})
    x = tokens()
    _, loss = m(x, x)
    loss.backward()
    for i in range(2):
        assert m.blocks[str(i)].mlp.router.weight.grad.abs().sum() > 0


def test_training_loss_adds_the_aux_losses_and_eval_loss_leaves_them_out():
    m = tiny_model(**MOE)
    x = tokens()
    logits, train_loss = m(x, x)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1))
    aux = sum(m.blocks[str(i)].mlp.aux_loss for i in range(2))
    assert aux > 0
    torch.testing.assert_close(train_loss, ce + aux)
    m.eval()
    torch.testing.assert_close(m(x, x)[1], ce)


def test_pipeline_stages_return_their_own_aux_loss():
    """Contract with the pipeline: a stage that is not the last returns (hidden, its blocks' aux
    loss); the last returns (logits, CE + its aux). Together they make the whole model's loss."""
    cfg = tiny_config(**MOE, n_layer=4)
    full = Transformer(cfg)
    full.init_weights(0)
    first, last = (build_model(cfg, stages=(s,), stage_blocks=(2, 2)) for s in (0, 1))
    x = tokens()
    hidden, first_aux = first(x)
    logits, last_loss = last(hidden, x)
    full_logits, full_loss = full(x, x)
    assert first_aux is not None and first_aux.requires_grad
    torch.testing.assert_close(logits, full_logits)
    torch.testing.assert_close(first_aux + last_loss, full_loss)
    dense = build_model(tiny_config(n_layer=4), stages=(0,), stage_blocks=(2, 2))
    assert dense(x)[1] is None  # dense: no aux


# -----------------------------------------------------------------------------
# every variant: causal, and it learns


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_is_causal(variant):
    """Changing the tokens from position t on leaves every logit before t unchanged. The MoE
    variants drop tokens (capacity_factor 1.0): the drop decisions must be causal too."""
    m = tiny_model(**VARIANTS[variant])
    x = tokens()
    y = x.clone()
    y[:, 20:] = (y[:, 20:] + 1) % TINY["vocab_size"]
    a, b = m(x)[0], m(y)[0]
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=1e-5)
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def pattern_batch(step, batch=8, length=32):
    """Windows of a repeating sequence with 30% noise: learnable in a few steps (like
    make_token_data)."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, 97, (batch, 1), generator=g)
    seq = (start + torch.arange(length + 1)) % 97
    noise = torch.randint(0, TINY["vocab_size"], seq.shape, generator=g)
    seq = torch.where(torch.rand(seq.shape, generator=g) < 0.7, seq, noise)
    return seq[:, :-1], seq[:, 1:]


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_trains(variant):
    m = tiny_model(**VARIANTS[variant])
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    losses = []
    for step in range(20):
        x, y = pattern_batch(step)
        _, loss = m(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses


# -----------------------------------------------------------------------------
# the attention backend


@pytest.fixture
def fake_flash(monkeypatch):
    """A stand-in flash_attn module in plain torch, with FlashAttention-2's interface and its limits
    (one head size for q, k and v); it records each call's keyword arguments. The real kernel is
    only checked where a GPU exists."""
    calls = []

    def flash_attn_func(q, k, v, causal=False, softmax_scale=None, softcap=0.0):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1], "FlashAttention-2 needs one head size"
        calls.append(dict(causal=causal, softmax_scale=softmax_scale, softcap=softcap))
        B, T, H, D = q.shape
        k, v = (t.repeat_interleave(H // t.shape[2], dim=2) for t in (k, v))
        s = torch.einsum("bthd,bshd->bhts", q, k) * (softmax_scale or D**-0.5)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("bhts,bshd->bthd", s.softmax(-1), v)

    module = types.ModuleType("flash_attn")
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    module.flash_attn_func = flash_attn_func
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    flash_attn_available.cache_clear()  # it remembers its answer
    yield calls
    flash_attn_available.cache_clear()


@pytest.fixture
def no_flash(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import flash_attn now raises ImportError
    flash_attn_available.cache_clear()
    yield
    flash_attn_available.cache_clear()


@pytest.mark.parametrize(
    "device,dtype,flash,softcap,expected",
    [
        ("cpu", torch.float32, False, 0.0, "sdpa"),
        ("cpu", torch.float32, False, 50.0, "eager"),
        ("cuda", torch.bfloat16, True, 0.0, "flash"),
        ("cuda", torch.bfloat16, True, 50.0, "flash"),
        ("cuda", torch.float16, False, 50.0, "eager"),
        ("cuda", torch.float32, True, 50.0, "eager"),
        ("cuda", torch.float32, True, 0.0, "sdpa"),
    ],
)
def test_auto_attention_picks_a_kernel_that_can_do_the_job(
    device, dtype, flash, softcap, expected, request
):
    request.getfixturevalue("fake_flash" if flash else "no_flash")
    impl, why = choose_attn_impl("auto", device, dtype, softcap)
    assert impl == expected
    assert ("cap" in why) == (softcap > 0)  # the log line says why the softcap decided it


def test_sdpa_refuses_a_softcap_naming_the_setting():
    with pytest.raises(ValueError, match="attn_softcap"):
        choose_attn_impl("sdpa", "cpu", torch.float32, 30.0)
    with pytest.raises(ValueError, match="attn_softcap"):
        Transformer(tiny_config(attn_softcap=30.0), attn_impl="sdpa")


@pytest.mark.parametrize("dv", [8, 24])
def test_flash_path_passes_the_softcap_and_pads_mla_head_sizes(fake_flash, dv):
    q, k = torch.randn(2, 12, 4, 16), torch.randn(2, 12, 2, 16)
    v = torch.randn(2, 12, 2, dv)
    out = causal_attention(q, k, v, "flash", softcap=3.0)
    assert fake_flash[-1] == dict(causal=True, softmax_scale=1 / 4.0, softcap=3.0)
    torch.testing.assert_close(
        out, causal_attention(q, k, v, "eager", softcap=3.0), rtol=1e-5, atol=1e-6
    )


# -----------------------------------------------------------------------------
# layout checks, configs, train.py


@pytest.mark.parametrize(
    "overrides,tp,message",
    [
        (dict(attention="gqa"), 1, "attention = 'gqa' must be one of"),
        (dict(norm="batchnorm"), 1, "norm = 'batchnorm'"),
        (dict(MLA, n_head=6, n_embd=60), 4, "n_head = 6 must be divisible by tp = 4"),
        (dict(MLA, qk_rope_head_dim=7), 1, "qk_rope_head_dim = 7 must be positive and even"),
        (
            dict(MLA, mlp="gelu", n_embd=31, n_head=8),
            8,
            "MLP width 124 .from n_embd = 31. must be divisible by tp = 8",
        ),
        (
            dict(n_expert=2, n_expert_per_token=3),
            1,
            "n_expert_per_token = 3 must be between 1 and n_expert = 2",
        ),
        (
            dict(n_expert=2, capacity_factor=-1.0),
            1,
            "capacity_factor = -1.0 must be positive .* or 0 .dropless",
        ),
        (dict(head_dim=7), 1, "head_dim = 7 must be even for RoPE"),
        (dict(MLA, head_dim=32), 1, "head_dim = 32 applies to attention='mha' only"),
        (dict(MLA, qkv_bias=True), 1, "qkv_bias = True applies to attention='mha' only"),
        (
            dict(intermediate_size=100),
            8,
            "MLP width 100 .intermediate_size. must be divisible by tp = 8",
        ),
        (
            dict(rope_scaling_factor=8.0, rope_low_freq_factor=4.0, rope_high_freq_factor=1.0),
            1,
            "must satisfy 0 < low < high",
        ),
    ],
)
def test_check_layout_explains_variant_constraints(overrides, tp, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        check_layout(tiny_config(**overrides), tp=tp)


def test_mla_does_not_need_n_embd_divisible_by_n_head():
    check_layout(tiny_config(**MLA, n_embd=60, n_head=8), tp=2)


@pytest.mark.parametrize("name", ["llama_gqa", "mla", "moe", "gemma2_style", "parallel_block"])
def test_variant_config_file_builds_a_model_that_runs(name):
    cfg = SimpleNamespace(**configure(settings.TRAINING, [str(ROOT / "config" / f"{name}.py")])[0])
    text = (ROOT / "config" / f"{name}.py").read_text()
    # a header saying what it shows and how to run it
    assert text.startswith("#") and "train.py" in text
    assert not re.search(r"^data_dir\s*=", text, re.M)  # model keys only: the default data applies
    model_cfg = ModelConfig(
        **{f: getattr(cfg, f) for f in ModelConfig.__dataclass_fields__ if f != "vocab_size"},
        vocab_size=512,
    )
    check_layout(model_cfg, tp=2)
    m = Transformer(
        model_cfg,
        attn_impl=choose_attn_impl(cfg.attn_impl, "cpu", torch.float32, cfg.attn_softcap)[0],
        chunked_loss=cfg.chunked_loss,
    )
    m.init_weights(0)
    x = tokens(1, 16)
    logits, _ = m(x)
    _, loss = m(x, x)  # with train.py's chunked_loss=True the loss comes without the logits
    assert logits.shape == (1, 16, 512) and math.isfinite(loss.item())


def test_train_logs_moe_statistics_and_why_it_chose_the_attention(tmp_path, capsys):
    data = make_token_data(tmp_path / "data")
    records = train_in_process(
        [
            f"--data_dir={data}",
            f"--out_dir={tmp_path / 'out'}",
            "--n_layer=2",
            "--n_embd=64",
            "--block_size=32",
            "--batch_size=4",
            "--max_iters=4",
            "--log_interval=2",
            "--eval_interval=4",
            "--eval_iters=2",
            "--checkpoint_interval=0",
            "--n_expert=4",
            "--capacity_factor=0.5",
            "--attn_softcap=30.0",
            "--final_softcap=30",
        ]
    )
    stdout = capsys.readouterr().out
    assert "attention: eager (auto:" in stdout and "attn_softcap = 30.0" in stdout
    logged = [r for r in records if "loss" in r]
    assert len(logged) == 2
    for r in logged:
        # 2 layers x 0.01 x (between 1, balanced, and n_expert)
        assert 0.02 <= r["aux_loss"] <= 0.08
        assert 0 < r["moe_dropped_frac"] < 1  # half the capacity a balanced router needs
