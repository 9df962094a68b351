"""Speed you can see and trust: the FLOPs count behind MFU, the peak table, peak memory,
tools/bench.py's output, and the fast paths (chunked loss, activation checkpointing, the
torch.compile fallback) computing the same thing as the plain paths."""

import functools
import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dist_utils import build_model, gathered_parameters, make_token_data, run_train

import metrics
import model as model_module
import settings
import build
import train
from fp8 import count_fp8
from metrics import flops_per_token
from model import ModelConfig, chunked_cross_entropy


TINY = dict(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_kv_head=4, n_embd=64)


def tiny_model(seed=0, activation_checkpointing=False, chunked_loss=False, **kw):
    torch.manual_seed(seed)
    return build_model(
        ModelConfig(**{**TINY, **kw}),
        activation_checkpointing=activation_checkpointing,
        chunked_loss=chunked_loss,
        seed=seed,
    )


# --- FLOPs per token ------------------------------------------------------------------------------


def test_flops_per_token_dense_is_the_hand_count():
    # n_embd 64, 4 heads of 16, SwiGLU width 2/3 * 4 * 64 = 170 -> rounded up to 192
    attn = 4 * 64 * 64  # q, k, v, o
    mlp = 3 * 64 * 192  # gate, up, down
    head = 64 * 512  # the output head over the real vocabulary (the embedding lookup is no matmul)
    # per layer: q.k over 32 positions and the weighted sum of v, 4 heads
    scores = 6 * 2 * 32 * 4 * (16 + 16)
    assert flops_per_token(ModelConfig(**TINY)) == 6 * (2 * (attn + mlp) + head) + scores


def test_flops_per_token_gqa_counts_the_smaller_key_value_projections():
    attn = 2 * 64 * 64 + 2 * 64 * 16  # q and o full; k and v for one head of 16
    mlp, head, scores = 3 * 64 * 192, 64 * 512, 6 * 2 * 32 * 4 * (16 + 16)
    assert (
        flops_per_token(ModelConfig(**{**TINY, "n_kv_head": 1}))
        == 6 * (2 * (attn + mlp) + head) + scores
    )


def test_flops_per_token_counts_the_matmul_weights_the_model_has():
    """The formula from the config against the built model's matmul weights (not the embedding)."""
    for kw in (
        {},
        {"n_kv_head": 2},
        {"tie_embeddings": False},
        {"head_dim": 32, "intermediate_size": 96, "qkv_bias": True},
        {"mlp": "gelu", "norm": "layernorm", "intermediate_size": 80},
    ):
        m = tiny_model(**kw)
        weights = sum(
            p.numel()
            for n, p in m.named_parameters()
            if p.dim() == 2 and not n.startswith(("tok_emb", "lm_head"))
        )
        weights += m.cfg.n_embd * m.cfg.vocab_size
        head_dim = m.cfg.head_dim or m.cfg.n_embd // m.cfg.n_head
        scores = 6 * m.cfg.n_layer * m.cfg.block_size * m.cfg.n_head * head_dim * 2
        assert flops_per_token(m.cfg) == 6 * weights + scores


def test_flops_per_token_moe_counts_only_the_active_experts():
    # written from the variant settings (model.py's MoE may not be built here): router + (top-k +
    # shared) experts
    cfg = ModelConfig(
        **TINY, attention="mha", mlp="swiglu", n_expert=8, n_expert_per_token=2, n_shared_expert=1
    )
    attn, expert, head, scores = 4 * 64 * 64, 3 * 64 * 192, 64 * 512, 6 * 2 * 32 * 4 * 32
    moe = 64 * 8 + (2 + 1) * expert
    assert flops_per_token(cfg) == 6 * (2 * (attn + moe) + head) + scores
    dense = ModelConfig(**TINY, mlp="gelu")
    assert flops_per_token(dense) == 6 * (2 * (attn + 2 * 64 * 256) + head) + scores


def test_flops_per_token_mla_counts_the_latent_projections():
    cfg = ModelConfig(
        **TINY,
        attention="mla",
        q_lora_rank=0,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
    )
    attn = 64 * 4 * 24 + 64 * (32 + 8) + 32 * 4 * (16 + 16) + 4 * 16 * 64  # q, kv down, kv up, o
    mlp, head, scores = 3 * 64 * 192, 64 * 512, 6 * 2 * 32 * 4 * (24 + 16)
    assert flops_per_token(cfg) == 6 * (2 * (attn + mlp) + head) + scores


# --- peak FLOP/s and MFU --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,dtype,peak",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989e12),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),
        ("NVIDIA H200", torch.float32, 67e12),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12),
        ("NVIDIA A10", torch.float16, 125e12),
        ("NVIDIA L4", torch.bfloat16, 121e12),
        ("Tesla V100-SXM2-16GB", torch.float16, 125e12),
        ("Tesla T4", torch.float16, 65e12),
        ("Tesla T4", torch.bfloat16, None),  # no bf16 tensor cores: unknown, not a guess
        ("NVIDIA GeForce RTX 3090", torch.bfloat16, 71e12),
        ("NVIDIA GeForce RTX 4090", torch.float32, 82.6e12),
        ("NVIDIA A10G", torch.bfloat16, None),  # neither an A10 nor an A100
        ("NVIDIA GeForce RTX 4090 Laptop GPU", torch.bfloat16, None),
    ],
)
def test_gpu_peak_flops_table(name, dtype, peak):
    assert metrics.gpu_peak_flops(name, dtype) == peak


def test_unknown_gpu_reports_mfu_as_not_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "Imaginary GPU 9000")
    peak, why = metrics.device_peak_flops(0.0, torch.device("cuda"), torch.bfloat16)
    assert peak is None and "peak_flops" in why
    assert metrics.mfu(1e6, 1e5, peak, 1) is None and metrics.format_mfu(None) == "n/a"
    # the setting overrides
    peak, why = metrics.device_peak_flops(123e12, torch.device("cuda"), torch.bfloat16)
    assert peak == 123e12 and metrics.mfu(1e6, 1e5, peak, 2) == pytest.approx(1e11 / 246e12)


def test_cpu_peak_is_measured():
    peak, why = metrics.device_peak_flops(0.0, torch.device("cpu"), torch.float32)
    assert peak > 1e8 and "measured" in why


# a step's record as train.py logs it, before its MFU
LOG_RECORD = {
    "step": 10,
    "loss": 3.0,
    "lr": 1e-3,
    "grad_norm": 1.0,
    "skipped_steps": 0,
    "tokens_per_sec": 60e3,
    "ms_per_step": 100.0,
    "peak_mem_bytes": 2**30,
    "epoch": 0.1,
}


def test_a_low_cpu_probe_is_probed_again_the_best_kept_and_the_mfu_capped_at_100_percent(
    monkeypatch,
):
    """metrics.PeakFlops, which train.py's log line and tools/bench.py ask for the MFU: a first
    probe taken under load (20 GFLOP/s), then the run's achieved FLOP/s per device comes to 90% of
    it and more."""
    probes, taken = iter([20e9, 50e9, 40e9]), []

    @functools.lru_cache(maxsize=None)  # as the real probe: kept until PeakFlops clears it
    def probe(dtype):
        taken.append(dtype)
        return next(probes)

    monkeypatch.setattr(metrics, "measure_cpu_peak_flops", probe)
    cpu = torch.device("cpu")
    peak = metrics.PeakFlops(0.0, cpu, torch.float32)
    assert (
        peak.flops == 20e9
        and len(taken) == 1
        and str(peak).startswith("0.02 TFLOP/s per device (measured")
    )
    # 17 GFLOP/s per device (1 MFLOP/token x 34,000 tokens/s over 2 devices): 85%, no new probe
    assert (
        peak.mfu(1e6, 34e3, 2) == {"mfu": pytest.approx(0.85), "peak_flops": 20e9}
        and len(taken) == 1
    )
    # 19 GFLOP/s, 95% of the probe: probed again, the better peak kept and said
    got = peak.mfu(1e6, 19e3, 1)
    assert len(taken) == 2 and peak.flops == 50e9 and got["mfu"] == pytest.approx(19 / 50)
    assert (
        got["mfu_note"]
        == "the run reached 95% of the peak: probed again, the best of 2 probes is 50.0 GFLOP/s"
    )
    # 60 GFLOP/s: probed again (40, worse: 50 kept), and still above it: capped at 100%, said
    got = peak.mfu(1e6, 60e3, 1)
    assert len(taken) == 3 and peak.flops == 50e9 and got["mfu"] == 1.0
    assert got["mfu_note"].endswith(
        "the best of 3 probes is 50.0 GFLOP/s; capped at 100%: 120% of the best probe"
    )
    # the same rate again is no new high: no probe at every log line
    assert peak.mfu(1e6, 60e3, 1)["mfu"] == 1.0 and len(taken) == 3
    record = {**LOG_RECORD, **got}
    assert f"| MFU 100.0% ({got['mfu_note']}) | peak RSS" in metrics.format_log_line(
        record, 60, cpu
    )
    # a given peak is the user's word: never probed, but the MFU is capped all the same
    given = metrics.PeakFlops(1e9, cpu, torch.float32)
    got = given.mfu(1e6, 2e3, 1)
    assert len(taken) == 3 and got == {
        "mfu": 1.0,
        "peak_flops": 1e9,
        "mfu_note": "capped at 100%: 200% of the peak_flops setting",
    }
    assert "| MFU 50.0% | peak RSS" in metrics.format_log_line(
        {**record, "mfu": 0.5, "mfu_note": None}, 60, cpu
    )


# --- the chunked loss -----------------------------------------------------------------------------


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_chunked_cross_entropy_equals_cross_entropy_of_the_full_logits(monkeypatch, softcap):
    # 300 tokens: 5 chunks, the last short
    monkeypatch.setattr(model_module, "loss_chunk_size", lambda vocab: 64)
    torch.manual_seed(0)
    h = torch.randn(300, 16, requires_grad=True)
    w = (0.5 * torch.randn(1024, 16)).requires_grad_()  # 1000 real tokens + 24 padding rows
    t = torch.randint(0, 1000, (300,))
    t[::7] = -1  # ignored
    (3 * chunked_cross_entropy(h, w, t, vocab_size=1000, softcap=softcap)).backward()
    grads = h.grad, w.grad
    h.grad = w.grad = None
    logits = h @ w[:1000].t()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits, t, ignore_index=-1)
    (3 * loss).backward()
    torch.testing.assert_close(grads[0], h.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads[1], w.grad, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        torch.testing.assert_close(
            chunked_cross_entropy(h, w, t, vocab_size=1000, softcap=softcap), loss
        )


def test_chunked_cross_entropy_under_bf16_autocast_is_the_autocast_logits_loss(monkeypatch):
    """Under bf16 autocast (a GPU's run) each chunk's logits are a bf16 matmul taken to fp32 in a
    buffer of their own, reused chunk by chunk: the loss and gradients of F.cross_entropy on the
    autocast logits."""
    monkeypatch.setattr(model_module, "loss_chunk_size", lambda vocab: 64)
    torch.manual_seed(0)
    h = torch.randn(300, 16, requires_grad=True)
    w = (0.5 * torch.randn(1024, 16)).requires_grad_()
    t = torch.randint(0, 1000, (300,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked = chunked_cross_entropy(h, w, t, vocab_size=1000)
        chunked.backward()
        grads = h.grad, w.grad
        h.grad = w.grad = None
        loss = F.cross_entropy((h @ w[:1000].t()).float(), t)
        loss.backward()
    torch.testing.assert_close(chunked, loss)
    torch.testing.assert_close(grads[0], h.grad, rtol=2e-2, atol=1e-4)
    torch.testing.assert_close(grads[1], w.grad, rtol=2e-2, atol=1e-4)


def test_chunked_loss_model_has_the_same_loss_and_gradients():
    x, y = torch.randint(0, 512, (2, 32)), torch.randint(0, 512, (2, 32))
    plain, chunked = tiny_model(), tiny_model(chunked_loss=True)
    logits, loss = plain(x, y)
    none, chunked_loss = chunked(x, y)
    assert none is None  # the point: no whole logits; without targets they are returned as usual
    torch.testing.assert_close(chunked_loss, loss)
    loss.backward()
    chunked_loss.backward()
    for (name, a), b in zip(plain.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)
    torch.testing.assert_close(chunked(x)[0], logits)


# --- activation checkpointing ---------------------------------------------------------------------


def test_activation_checkpointing_gives_identical_loss_and_gradients():
    x, y = torch.randint(0, 512, (2, 32)), torch.randint(0, 512, (2, 32))
    plain, ckpt = tiny_model(), tiny_model(activation_checkpointing=True)
    _, a = plain(x, y)
    _, b = ckpt(x, y)
    a.backward()
    b.backward()
    assert torch.equal(a, b)
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad), name


def saved_activation_bytes(m, x, y):
    """Bytes autograd keeps for backward during the forward pass."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x, y)
    return total


def test_activation_checkpointing_keeps_fewer_activations():
    x, y = torch.randint(0, 512, (4, 32)), torch.randint(0, 512, (4, 32))
    kw = dict(n_layer=4, chunked_loss=True)
    plain, ckpt = (
        saved_activation_bytes(tiny_model(**kw), x, y),
        saved_activation_bytes(tiny_model(activation_checkpointing=True, **kw), x, y),
    )
    assert ckpt < plain / 3


# --- train.py: the step, the fallback, the log ----------------------------------------------------


def tiny_run(tmp_path, **kw):
    cfg = SimpleNamespace(
        **{
            **settings.DEFAULTS,
            **TINY,
            "batch_size": 2,
            "out_dir": str(tmp_path / "out"),
            "data_dir": None,
            **kw,
        }
    )
    return cfg, build.setup(cfg, training=False)


def test_compile_failure_falls_back_to_eager_with_a_log_line(tmp_path, monkeypatch, capsys):
    def fails_when_called(*args, **kwargs):
        raise RuntimeError("backend compiler failed: no C compiler here\nlong traceback")

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fails_when_called)
    micro = [(torch.randint(0, 512, (2, 32)), torch.randint(0, 512, (2, 32)))]
    results = []
    for compiled in (True, False):
        cfg, run = tiny_run(tmp_path, compile=compiled)
        parts = build.build(cfg, run)
        assert parts.compiled == compiled
        loss, _ = train.train_step(cfg, run.layout, parts, micro, 1e-3)
        assert not parts.compiled and all(
            "forward" not in b.__dict__ for b in parts.model.blocks.values()
        )
        results.append((loss, [p.detach().clone() for p in parts.model.parameters()]))
    assert (
        "torch.compile failed (RuntimeError: backend compiler failed: no C compiler here); "
        "continuing without it" in capsys.readouterr().out
    )
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)


def compile_counting_graphs(monkeypatch):
    """torch.compile as train.compile_blocks calls it, through dynamo and AOT autograd but with
    eager kernels (no C compiler needed): returns the list each graph dynamo hands to the backend is
    appended to."""
    graphs, real_compile = [], torch.compile
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def counting(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend=counting))
    torch._dynamo.reset()
    return graphs


@pytest.mark.parametrize("activation_checkpointing, zero_stage", [(False, 0), (True, 0), (True, 3)])
def test_compiled_blocks_share_one_graph_at_any_depth_and_train_like_eager(
    tmp_path, monkeypatch, activation_checkpointing, zero_stage
):
    """compile=True compiles block by block: one graph for 2 blocks and for 6 (so compile time does
    not grow with depth), parameters under their own names, and the same losses and weights as
    eager. At ZeRO-3 every block's storage is emptied after its forward and refilled before its
    backward (and its recompute) around the compiled graph: a graph that kept the first values it
    saw, or read an emptied storage, would train apart from eager."""
    graphs = compile_counting_graphs(monkeypatch)
    micro = [(torch.randint(0, 512, (2, 32)), torch.randint(0, 512, (2, 32)))]
    for n_layer in (2, 6):
        results = {}
        for compiled in (True, False):
            cfg, run = tiny_run(
                tmp_path,
                compile=compiled,
                n_layer=n_layer,
                zero_stage=zero_stage,
                activation_checkpointing=activation_checkpointing,
            )
            parts = build.build(cfg, run)
            losses = [
                train.train_step(cfg, run.layout, parts, micro, 1e-3)[0].item() for _ in range(2)
            ]
            # ZeRO-3: the blocks' storages are empty now
            sharded = parts.grad_sync if cfg.zero_stage == 3 else None
            whole = gathered_parameters(sharded)
            results[compiled] = (
                losses,
                {n: whole.get(p, p).detach().clone() for n, p in parts.model.named_parameters()},
            )
            assert parts.compiled == compiled
        assert len(graphs) == 1, f"{len(graphs)} graphs for {n_layer} blocks"
        assert results[True][0] == pytest.approx(results[False][0], rel=1e-5)
        assert results[True][1].keys() == results[False][1].keys()
        for name, p in results[True][1].items():
            torch.testing.assert_close(p, results[False][1][name], rtol=1e-5, atol=1e-6, msg=name)
        graphs.clear()
        torch._dynamo.reset()


@pytest.mark.parametrize("fp8", ["tensorwise", "rowwise"])
def test_compiled_fp8_blocks_are_one_graph_and_train_like_eager_fp8(tmp_path, monkeypatch, fp8):
    """compile=True with fp8 on: dynamo and AOT autograd take fp8.py's autograd function into the
    blocks' one graph (no break, no fall-back to eager), and the compiled blocks train as the eager
    FP8 ones do."""
    graphs = compile_counting_graphs(monkeypatch)
    micro = [(torch.randint(0, 512, (2, 32)), torch.randint(0, 512, (2, 32)))]
    results = {}
    for compiled in (True, False):
        cfg, run = tiny_run(tmp_path, compile=compiled, fp8=fp8)
        parts = build.build(cfg, run)
        results[compiled] = [
            train.train_step(cfg, run.layout, parts, micro, 1e-3)[0].item() for _ in range(2)
        ]
        assert parts.compiled == compiled and count_fp8(parts.model) > 0
    assert len(graphs) == 1
    assert results[True] == pytest.approx(results[False], rel=1e-6)
    torch._dynamo.reset()


def test_train_py_compiles_the_blocks_in_the_first_step_whose_memory_it_measures(
    tmp_path, monkeypatch, capsys
):
    """train.py measures its first step's peak memory, the step in which torch.compile compiles: a
    run with compile=True hands dynamo's graph of the blocks to the backend (under a
    TorchDispatchMode dynamo skips the blocks and never compiles them again), and the measure still
    sees the step's tensors: the plan within 10% of it (less the tensors that other tests left alive
    in this process before the run), and a line that says why the two differ."""
    graphs = compile_counting_graphs(monkeypatch)
    make_token_data(tmp_path / "data")
    # what earlier tests left alive, weakly held: what of it outlives the run was alive at the run's
    # measure, what the run frees (a cache it replaces) was not (counting it failed this test when
    # another module was imported first)
    before = metrics.live_cpu_storages()
    train.main(
        [
            f"--data_dir={tmp_path / 'data'}",
            f"--out_dir={tmp_path / 'out'}",
            "--n_layer=2",
            "--n_embd=64",
            "--block_size=32",
            "--batch_size=2",
            "--max_iters=2",
            "--log_interval=1",
            "--eval_interval=0",
            "--checkpoint_interval=0",
            "--compile=True",
            "--device=cpu",
            "--peak_flops=1e12",
        ]
    )
    out = capsys.readouterr().out
    assert len(graphs) == 1 and "torch.compile failed" not in out, out
    (memory,) = [
        r["memory"]
        for r in map(json.loads, open(tmp_path / "out" / "metrics.jsonl"))
        if "memory" in r
    ]
    left_alive = sum(storage.nbytes() for storage in before.keys())
    predicted, measured = memory[0]["predicted_bytes"], memory[0]["measured_bytes"] - left_alive
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured, left_alive)
    assert "compile=True: the plan counts an eager step's tensors" in out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_train_step_reads_nothing_back_from_the_device(tmp_path, monkeypatch, dtype):
    """fp32 and bf16 steps never read a tensor back to the host (.item(), float(), int(), bool(),
    .tolist(), .numpy()): the host can run ahead of the GPU (only fp16 must look). The dense model
    here has none; the one read-back allowed anywhere is MoE's expert counts
    (MixtureOfExperts.forward, for the split sizes)."""
    cfg, run = tiny_run(tmp_path, dtype=dtype)
    parts = build.build(cfg, run)
    micro = [(torch.randint(0, 512, (2, 32)), torch.randint(0, 512, (2, 32)))]

    def read_back(self, *args, **kwargs):
        raise AssertionError("host-device sync inside the training step")

    for name in ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, read_back)
    train.train_step(cfg, run.layout, parts, micro, 1e-3)


def test_the_read_back_check_catches_each_kind_of_read(monkeypatch):
    """The check above could not pass by accident: each way of reading a tensor back trips it."""

    def read_back(self, *args, **kwargs):
        raise AssertionError("host-device sync")

    for name in ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, read_back)
    t = torch.ones(())
    for read in (
        lambda: t.item(),
        lambda: t.tolist(),
        lambda: float(t),
        lambda: int(t),
        lambda: bool(t),
        lambda: t.numpy(),
        lambda: [0, 1][t.long()],
    ):
        with pytest.raises(AssertionError, match="host-device sync"):
            read()


def test_training_log_has_mfu_and_peak_memory(tmp_path):
    make_token_data(tmp_path / "data")
    argv = [
        f"--data_dir={tmp_path / 'data'}",
        f"--out_dir={tmp_path / 'out'}",
        "--n_layer=2",
        "--n_embd=64",
        "--block_size=32",
        "--batch_size=2",
        "--max_iters=2",
        "--log_interval=1",
        "--eval_interval=0",
        "--checkpoint_interval=0",
    ]
    train.main(argv)
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert 0 < r["mfu"] < 1 and r["peak_mem_bytes"] > 10 * 2**20


# --- tools/bench.py -------------------------------------------------------------------------------


def test_bench_prints_a_table_and_a_parseable_result_line(capsys):
    from tools import bench

    bench.main(
        [
            "--n_layer=2",
            "--n_embd=64",
            "--n_head=4",
            "--n_kv_head=4",
            "--block_size=32",
            "--vocab_size=512",
            "--batch_size=2",
            "--warmup_steps=1",
            "--bench_steps=2",
            "--reference=True",
            "--peak_flops=1e12",
        ]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("tokens/s") for line in lines)
    assert lines[-1].startswith("RESULT ")
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["flops_per_token"] == flops_per_token(ModelConfig(**TINY))
    assert result["tokens_per_sec"] > 0 and result["peak_mem_bytes"] > 0
    assert result["ms_per_step"] == pytest.approx(1000 * 2 * 32 / result["tokens_per_sec"])
    assert result["mfu"] == pytest.approx(
        result["flops_per_token"] * result["tokens_per_sec"] / 1e12
    )
    assert result["reference_tokens_per_sec"] > 0


def test_bench_times_the_matmul_probe_between_its_timed_steps(monkeypatch, capsys):
    """On CPU the prediction's linears are timed three passes after each timed step, none in the
    warm-up (this host's pace moves from one second to the next: probed after the steps, it read
    other seconds than they ran in), and the rate the RESULT's machine carries is their FLOPs over
    the passes' median."""
    from tools import bench
    from tools import machines

    events = []

    def fake_pass(model_cfg, dtype, dev, tokens, tp=1):
        def one_pass():
            events.append("pass")
            return [0.01, 0.02, 0.04][len(events) % 3]

        return 1e9, one_pass

    monkeypatch.setattr(machines, "linear_pass", fake_pass)
    step = bench.Picotron.step
    monkeypatch.setattr(
        bench.Picotron, "step", lambda self, i, *a: events.append(f"step {i}") or step(self, i, *a)
    )
    bench.main(
        [
            "--n_layer=2",
            "--n_embd=64",
            "--n_head=4",
            "--n_kv_head=4",
            "--block_size=32",
            "--vocab_size=512",
            "--batch_size=2",
            "--warmup_steps=1",
            "--bench_steps=2",
            "--peak_flops=1e12",
        ]
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1][len("RESULT ") :])
    assert events[:9] == [
        "step 0",
        "step 1",
        "pass",
        "pass",
        "pass",
        "step 2",
        "pass",
        "pass",
        "pass",
    ], events
    assert result["machine"]["matmul_flops"]["float32"] == pytest.approx(1e9 / 0.02)


def test_machine_auto_times_the_vocab_parallel_loss_only_under_tp():
    """tools/bench.py's machine=auto times the vocab-parallel loss's own kernels
    (machines.loss_seconds), which tools/step_time.py puts in the head under tp; without tp the loss
    is another (the chunked one) and nothing is timed."""
    from tools import machines

    tiny = ModelConfig(n_layer=1, n_embd=16, n_head=2, n_kv_head=2, block_size=8, vocab_size=64)
    forward, backward = machines.measure_machine(tiny, torch.float32, tokens=16, tp=2)[
        "loss_seconds"
    ]
    assert forward > 0 and backward > 0
    assert "loss_seconds" not in machines.measure_machine(tiny, torch.float32, tokens=16)


def test_the_memory_probe_reads_each_product_from_a_pool_past_the_cache(monkeypatch):
    """machines.memory_bandwidth times z = x * y on triples from a pool past four times the
    last-level cache, each call on the triple used (or written) longest ago: as a step's kernels
    read activations the caches no longer hold (a product timed on one hot triple reads the cache's
    bandwidth, 4-5x memory's)."""
    from tools import machines

    monkeypatch.setattr(machines, "last_level_cache_bytes", lambda dev: 2**20)
    written, read = [], []
    ones, mul = torch.ones, torch.mul
    monkeypatch.setattr(torch, "ones", lambda *a, **k: written.append(ones(*a, **k)) or written[-1])
    monkeypatch.setattr(
        torch, "mul", lambda x, y, out: read.append(out.data_ptr()) or mul(x, y, out=out)
    )
    assert machines.memory_bandwidth(4096, torch.float32, torch.device("cpu")) > 0
    pool = [z.data_ptr() for z in written[2::3]]
    # a call's triple: four caches' worth since its last
    assert (len(pool) - 1) * 3 * 4096 * 4 >= 4 * 2**20
    assert len(read) == 9 and read == [pool[i % len(pool)] for i in range(9)]


def test_the_link_probe_counts_what_an_exchange_adds_to_the_compute_after_it(monkeypatch):
    """machines.measure_link prices an exchange by what it adds to a burst of compute (a burst and
    an exchange, less a burst alone): on CPU the compute after an exchange runs slower, and the step
    pays that too. Faked on a fake clock (nothing waits, so no load moves the figures): an
    all-reduce of S bytes over 2 ranks takes 1 ms + S / 1 GB/s, and a 1 ms burst takes 1 ms more
    after one; the line through the two sizes reads 2 ms at zero bytes (1 ms a ring step) and
    1 GB/s, where timing the exchange alone (the probe before it subtracted the burst) reads half
    the latency."""
    import torch.distributed as dist
    from tools import machines

    now, after_exchange = [0.0], [False]

    def burst():
        now[0] += 1e-3 + 1e-3 * after_exchange[0]
        after_exchange[0] = False

    def all_reduce(t, group=None):
        now[0] += 1e-3 + t.numel() * 4 / 1e9
        after_exchange[0] = True

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    link = machines.measure_link(nbytes=2**16, burst=burst, clock=lambda: now[0])
    # within 1%: the 8 MiB size's first burst timed alone follows the last 64 KiB exchange (1 of 15)
    assert link["latency"] == pytest.approx(1e-3, rel=0.01)
    assert link["busbw"] == pytest.approx(1e9, rel=0.01)


def test_bench_under_torchrun_prints_one_table_and_one_result_line():
    """2 ranks (dp=2): rank 0 alone prints, once; the figures are the whole job's (both replicas'
    tokens). With --ledger_overhead the same step inside the communication ledger is timed in turn:
    its cost, a share of the plain step."""
    _, proc = run_train(
        [
            "--n_layer=2",
            "--n_embd=64",
            "--n_head=4",
            "--n_kv_head=4",
            "--block_size=32",
            "--vocab_size=512",
            "--batch_size=2",
            "--warmup_steps=1",
            "--bench_steps=2",
            "--peak_flops=1e12",
            "--ledger_overhead=True",
        ],
        nproc=2,
        script="tools/bench.py",
    )
    lines = proc.stdout.strip().splitlines()
    assert sum(line.startswith("tokens/s") for line in lines) == 1, proc.stdout
    assert sum(line.startswith("bench: ") for line in lines) == 1, proc.stdout
    assert [line for line in lines if line.startswith("RESULT ")] == [lines[-1]], proc.stdout
    result = json.loads(lines[-1][len("RESULT ") :])
    assert (result["world_size"], result["dp"], result["tp"], result["pp"]) == (2, 2, 1, 1)
    assert result["tokens_per_step"] == 2 * 32 * 2
    assert result["ms_per_step"] == pytest.approx(
        1000 * result["tokens_per_step"] / result["tokens_per_sec"]
    )
    assert result["mfu"] == pytest.approx(
        result["flops_per_token"] * result["tokens_per_sec"] / (2 * 1e12)
    )
    assert result["ledger_overhead"] == pytest.approx(
        result["ledger_ms_per_step"] / result["ms_per_step"] - 1
    )
    assert sum(line.startswith("ledger on against off: ") for line in lines) == 1, proc.stdout
    # tools/step_time.py's prediction beside it, on this machine measured with its all-reduce over
    # the two ranks
    assert (
        result["predicted_step_s"] > 0
        and result["machine"]["name"] == "auto"
        and result["machine"]["node"]["busbw"] > 0
    )
