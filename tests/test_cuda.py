"""The GPU path, on a CUDA GPU: the dtype picked for the card, fp16 with the loss scaler, the
attention kernel, fused AdamW resumed on the device, pinned non-blocking batches, a training step
that never waits for the device, activation checkpointing, the chunked loss, torch.compile, and the
initial weights.

Every test here is marked cuda: collected everywhere, skipped where torch.cuda.is_available() is
False (tests/conftest.py), run by scripts/gpu_check.sh with `pytest -m cuda`. Each records the
figures it saw (record_property), which the script's summary table shows. Each test's CPU
counterpart, where the same code can run without a GPU, is in tests/test_gpu_check.py or
tests/test_bench.py."""

import math
import time
import traceback
from types import SimpleNamespace

import pytest
import torch

from dist_utils import build_model, make_token_data, relative_difference

import checkpoint
import settings
from data import (
    TRAIN_STREAM,
    get_batch,
    load_data,
    rank_microbatches,
    read_data_meta,
    window_starts,
)
import build
import train
from model import (
    ModelConfig,
    Transformer,
    choose_attn_impl,
    choose_device_and_dtype,
    flash_attn_available,
)

pytestmark = pytest.mark.cuda
DEVICE = torch.device("cuda")

# small enough to take seconds, large enough for the GPU kernels a real run takes (head size 64,
# GQA)
SMALL = dict(
    n_layer=4, n_head=4, n_kv_head=2, n_embd=256, block_size=256, batch_size=8, vocab_size=512
)


def gpu_run(tmp_path, data_dir=None, **kw):
    """train.py's settings and setup for a GPU run (random tokens unless data_dir is given)."""
    cfg = SimpleNamespace(
        **{
            **settings.DEFAULTS,
            **SMALL,
            "device": str(DEVICE),
            "out_dir": str(tmp_path / "out"),
            "data_dir": data_dir,
            "eval_interval": 0,
            **kw,
        }
    )
    return cfg, build.setup(cfg, training=False)


def random_batches(cfg, step, device=DEVICE):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.block_size + 1), generator=g)
    return [(tokens[:, :-1].to(device), tokens[:, 1:].to(device))]


def train_steps(cfg, run, parts, steps, first=0):
    """train.py's loop without the logging: (losses, grad norms) as floats, read after the last
    step."""
    out = []
    for step in range(first, first + steps):
        micro = (
            rank_microbatches(
                cfg, run.layout, run.datasets["train"], TRAIN_STREAM, step, 1, run.dev
            )
            if run.datasets
            else random_batches(cfg, step)
        )
        out.append(train.train_step(cfg, run.layout, parts, micro, train.get_lr(step, cfg)))
    return [loss.item() for loss, _ in out], [norm.item() for _, norm in out]


def small_model(device=DEVICE, seed=0, **kw):
    m = build_model(
        ModelConfig(
            **{k: v for k, v in {**SMALL, **kw}.items() if k in ModelConfig.__dataclass_fields__}
        ),
        attn_impl=kw.get("attn_impl", "sdpa"),
        activation_checkpointing=kw.get("activation_checkpointing", False),
        chunked_loss=kw.get("chunked_loss", False),
        seed=seed,
    )
    return m.to(device)


def peak_bytes(fn):
    """The most memory the CUDA allocator held above what it held before fn ran."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def first_sync_point(fn):
    """None when fn makes no synchronizing CUDA call (torch.cuda.set_sync_debug_mode("error") raises
    at the first one: a read-back, a blocking copy, a stream or device synchronize); else that
    call's traceback."""
    torch.cuda.synchronize()
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as e:
        if "synchronizing" not in str(e):
            raise
        return traceback.format_exc()
    finally:
        torch.cuda.set_sync_debug_mode(old)
    return None


def grad_differences(a, b):
    """{name: ||grad_a - grad_b|| / ||grad_b||} of two models of the same shape."""
    return {
        name: relative_difference(p.grad.float(), q.grad.float())
        for (name, p), q in zip(a.named_parameters(), b.parameters())
    }


# --- the precision and the attention kernel chosen for the card -----------------------------------


def test_dtype_auto_is_bf16_from_compute_capability_8_and_fp16_before(monkeypatch, record_property):
    major, minor = torch.cuda.get_device_capability()
    dev, dtype, why = choose_device_and_dtype("auto", "auto")
    record_property(
        "figures", f"{torch.cuda.get_device_name()}, sm {major}.{minor}: {dtype} ({why})"
    )
    assert dev.type == "cuda" and dtype == (torch.bfloat16 if major >= 8 else torch.float16), why
    # a V100's answer
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (7, 0))
    assert choose_device_and_dtype("cuda", "auto")[1] == torch.float16


def test_fp16_with_the_loss_scaler_trains_like_bf16(tmp_path, record_property):
    """50 steps on learnable tokens forced to float16 (the loss scaler on) and in bfloat16: the fp16
    losses stay finite and end within 2% of bf16's. The gradient norms are compared too: with
    clipping and AdamW a gradient left scaled by 65536 would barely move the loss, but its norm
    would be far off."""
    data = make_token_data(str(tmp_path / "data"), n_tokens=200_000)
    runs = {}
    for dtype in ("bfloat16", "float16"):
        cfg, run = gpu_run(
            tmp_path, data, dtype=dtype, learning_rate=3e-3, warmup_iters=5, lr_decay_iters=50
        )
        parts = build.build(cfg, run)
        losses, norms = train_steps(cfg, run, parts, 50)
        runs[dtype] = losses, norms, parts.scaler, sum(not math.isfinite(n) for n in norms)
    (bf16, bf16_norms, bf16_scaler, _), (fp16, fp16_norms, scaler, n_skipped) = (
        runs["bfloat16"],
        runs["float16"],
    )
    loss_diff = abs(fp16[-1] - bf16[-1]) / bf16[-1]
    norm_diff = abs(fp16_norms[-1] - bf16_norms[-1]) / bf16_norms[-1]
    record_property(
        "figures",
        f"step 50 loss fp16 {fp16[-1]:.4f} / bf16 {bf16[-1]:.4f} ({100 * loss_diff:.2f}% apart; "
        f"from {bf16[0]:.3f}), grad norm {100 * norm_diff:.1f}% apart, {n_skipped} fp16 steps "
        f"skipped, loss scale {scaler.scale:g}",
    )
    assert scaler.enabled and not bf16_scaler.enabled
    assert all(math.isfinite(x) for x in fp16), f"fp16 losses: {fp16}"
    assert bf16[-1] < bf16[0] - 1.0, (
        f"bf16 did not learn in 50 steps ({bf16[0]:.3f} -> {bf16[-1]:.3f}): no comparison"
    )
    assert loss_diff <= 0.02, (
        f"fp16 ends at {fp16[-1]:.4f}, bf16 at {bf16[-1]:.4f}: {100 * loss_diff:.2f}% apart"
    )
    assert norm_diff <= 0.1, (
        f"grad norm at step 50: fp16 {fp16_norms[-1]:.4g}, bf16 {bf16_norms[-1]:.4g}"
    )
    assert n_skipped <= 10 and 1 <= scaler.scale < float("inf"), (
        f"{n_skipped} skipped, scale {scaler.scale}"
    )


def test_attention_auto_is_sdpa_and_takes_its_flash_kernel(record_property):
    """Without the flash-attn package 'auto' picks SDPA, and the model's attention in bf16 runs with
    only SDPA's flash backend allowed (it raises 'No available kernel' when the inputs do not suit
    it: fp32 queries after RoPE, a wrong layout), agreeing with the eager attention."""
    impl, why = choose_attn_impl("auto", DEVICE.type, torch.bfloat16)
    record_property("figures", f"{impl}: {why}")
    if flash_attn_available():
        assert impl == "flash", why
    else:
        assert impl == "sdpa" and "flash-attn is not installed" in why, why
    x, y = random_batches(SimpleNamespace(**SMALL), 0)[0]
    fused, eager = small_model(attn_impl=impl), small_model(attn_impl="eager")
    if impl == "sdpa":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        only_flash = sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    else:
        from contextlib import nullcontext

        only_flash = nullcontext()
    with only_flash, torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        _, loss = fused(x, y)
    loss.backward()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        _, eager_loss = eager(x, y)
    eager_loss.backward()
    assert relative_difference(loss.float(), eager_loss.float()) < 1e-2, (
        loss.item(),
        eager_loss.item(),
    )
    worst = max(grad_differences(fused, eager).items(), key=lambda kv: kv[1])
    assert worst[1] < 5e-2, (
        f"gradients of flash and eager attention differ most in {worst[0]}: {worst[1]:.2e}"
    )


# --- the optimizer and the data on the device -----------------------------------------------------


def test_fused_adamw_resumes_on_the_device(tmp_path, record_property):
    """3 steps, a checkpoint, 3 more; a fresh model resumed from the checkpoint holds AdamW's exact
    state on the GPU (the step counter too, where fused AdamW keeps it) and its next 3 steps follow
    the first run's."""
    data = make_token_data(str(tmp_path / "data"), n_tokens=50_000)
    cfg, run = gpu_run(
        tmp_path,
        data,
        dtype="float32",
        checkpoint_interval=3,
        max_iters=6,
        lr_decay_iters=6,
        warmup_iters=2,
        learning_rate=3e-3,
    )
    first = build.build(cfg, run)
    assert first.optimizer.defaults.get("fused"), first.optimizer.defaults
    train_steps(cfg, run, first, 3)
    path = train.save_checkpoint(cfg, run, first, 3)
    saved = {
        name: {k: v.clone() for k, v in first.optimizer.state[p].items()}
        for name, p in first.model.named_parameters()
    }
    straight, _ = train_steps(cfg, run, first, 3, first=3)

    second = build.build(cfg, run)
    step, _, _ = checkpoint.resume_run(path, cfg, run, second)
    assert step == 3 and checkpoint.adamw_step_count(second.optimizer) == 3
    for name, p in second.model.named_parameters():
        state = second.optimizer.state[p]
        assert set(state) == set(saved[name]), name
        for k, v in state.items():
            assert v.device == p.device and v.device.type == DEVICE.type, (
                f"{name} {k} on {v.device}"
            )
            assert torch.equal(v, saved[name][k]), f"{name} {k} differs from the state saved"
    resumed, _ = train_steps(cfg, run, second, 3, first=3)
    record_property(
        "figures",
        f"losses after resume {[round(x, 5) for x in resumed]}, uninterrupted "
        f"{[round(x, 5) for x in straight]}",
    )
    # fp32 on the GPU; the attention's backward may add in another order from run to run
    assert max(abs(a - b) / b for a, b in zip(resumed, straight)) < 1e-4, (resumed, straight)


def test_batches_are_pinned_and_copied_without_blocking(tmp_path, monkeypatch, record_property):
    data_dir = make_token_data(str(tmp_path / "data"), n_tokens=20_000)
    meta = read_data_meta(data_dir)
    split = load_data(data_dir, "train", 64, meta["vocab_size"], meta)
    starts = window_starts(0, TRAIN_STREAM, 0, split[2], 64, 4)
    on_cpu = get_batch(split, starts, 64, torch.device("cpu"))
    pinned, copies = [], []
    pin, to = torch.Tensor.pin_memory, torch.Tensor.to

    def pin_and_keep(self, *args, **kwargs):
        pinned.append(pin(self, *args, **kwargs))
        return pinned[-1]

    def to_and_note(self, *args, **kwargs):
        copies.append((self.is_pinned(), kwargs.get("non_blocking", False)))
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_and_keep)
    monkeypatch.setattr(torch.Tensor, "to", to_and_note)
    batch = []
    sync = first_sync_point(lambda: batch.extend(get_batch(split, starts, 64, DEVICE)))
    monkeypatch.undo()
    record_property("figures", f"{len(pinned)} pinned, copies (pinned, non_blocking): {copies}")
    assert sync is None, f"reading a batch waits for the device:\n{sync}"
    assert len(pinned) == 2 and all(t.is_pinned() for t in pinned)
    assert copies == [(True, True), (True, True)]
    for got, want in zip(batch, on_cpu):
        assert got.device.type == DEVICE.type and torch.equal(got.cpu(), want)


# --- the training step ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,compile", [("bfloat16", False), ("float32", False), ("bfloat16", True)]
)
def test_training_step_never_waits_for_the_device(tmp_path, dtype, compile, record_property):
    """torch.cuda.set_sync_debug_mode("error") around train.train_step, after a first step
    (compilation, AdamW's lazily made state): no read-back, no blocking copy, no synchronize
    anywhere in the step, so the host runs ahead and the GPU never waits for Python."""
    cfg, run = gpu_run(tmp_path, dtype=dtype, compile=compile)
    parts = build.build(cfg, run)
    train.train_step(cfg, run.layout, parts, random_batches(cfg, 0), 1e-3)
    micro = random_batches(cfg, 1)
    sync = first_sync_point(lambda: train.train_step(cfg, run.layout, parts, micro, 1e-3))
    record_property("figures", "no sync" if sync is None else sync.strip().splitlines()[-1])
    assert sync is None, f"the {dtype} training step waits for the device here:\n{sync}"
    assert parts.compiled == compile


def test_fp16_step_waits_only_at_the_loss_scaler(tmp_path, monkeypatch):
    """fp16 must read whether the gradient norm is finite to adjust its loss scale
    (optim.DynamicLossScaler. update): that is the step's first read-back, and with that read taken
    out the step makes none."""
    cfg, run = gpu_run(tmp_path, dtype="float16")
    parts = build.build(cfg, run)
    train.train_step(cfg, run.layout, parts, random_batches(cfg, 0), 1e-3)
    # (copied to the device before the timing)
    micro, later = (
        random_batches(cfg, 1),
        random_batches(cfg, 2),
    )
    sync = first_sync_point(lambda: train.train_step(cfg, run.layout, parts, micro, 1e-3))
    assert sync is not None and "scaler.update(found_inf)" in sync and "found_inf.item()" in sync, (
        sync
    )
    monkeypatch.setattr(parts.scaler, "update", lambda found_inf: None)
    sync = first_sync_point(lambda: train.train_step(cfg, run.layout, parts, later, 1e-3))
    assert sync is None, f"the fp16 step waits for the device beside the loss scaler:\n{sync}"


def test_activation_checkpointing_on_the_gpu_same_gradients_less_memory(record_property):
    """8 blocks: the plain path keeps every block's activations (about 55 x n_embd bytes per token
    each), checkpointing only each block's input and, in backward, one block's recomputed
    activations."""
    shape = dict(n_layer=8, n_embd=512, n_head=8, n_kv_head=8, block_size=1024, batch_size=8)
    x, y = random_batches(SimpleNamespace(**{**SMALL, **shape}), 0)[0]
    models, peaks, losses = {}, {}, {}
    for ac in (False, True):
        models[ac] = small_model(activation_checkpointing=ac, chunked_loss=True, **shape)

        def step():
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
                _, losses[ac] = models[ac](x, y)
            losses[ac].backward()

        peaks[ac] = peak_bytes(step)
    diffs = grad_differences(models[True], models[False])
    worst = max(diffs, key=diffs.get)
    record_property(
        "figures",
        f"peak above the weights {peaks[True] / 2**20:,.0f} MiB with checkpointing, "
        f"{peaks[False] / 2**20:,.0f} MiB without; worst gradient {worst} {diffs[worst]:.1e}",
    )
    assert relative_difference(losses[True], losses[False]) < 1e-6, (
        losses[True].item(),
        losses[False].item(),
    )
    assert diffs[worst] < 1e-2, f"{worst}: {diffs[worst]:.2e}"
    assert peaks[True] < 0.5 * peaks[False], (peaks[True], peaks[False])


def test_chunked_loss_on_the_gpu_same_loss_less_memory(record_property):
    """At GPT-2's vocabulary the (tokens, vocab) logits are the largest tensors: 8192 tokens x 50304
    in bf16 are 0.8 GB, and the plain loss keeps fp32 copies and gradients of them."""
    shape = dict(
        n_layer=2,
        n_embd=512,
        n_head=8,
        n_kv_head=8,
        block_size=1024,
        batch_size=8,
        vocab_size=50257,
    )
    x, y = random_batches(SimpleNamespace(**{**SMALL, **shape}), 0)[0]
    models, peaks, losses = {}, {}, {}
    for chunked in (False, True):
        models[chunked] = small_model(chunked_loss=chunked, **shape)

        def step():
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
                _, losses[chunked] = models[chunked](x, y)
            losses[chunked].backward()

        peaks[chunked] = peak_bytes(step)
    diffs = grad_differences(models[True], models[False])
    worst = max(diffs, key=diffs.get)
    loss_diff = relative_difference(losses[True].float(), losses[False].float())
    record_property(
        "figures",
        f"peak above the weights {peaks[True] / 2**20:,.0f} MiB chunked, "
        f"{peaks[False] / 2**20:,.0f} MiB from the logits; loss {loss_diff:.1e} apart, "
        f"worst gradient {worst} {diffs[worst]:.1e}",
    )
    assert loss_diff < 1e-3, (losses[True].item(), losses[False].item())
    assert diffs[worst] < 2e-2, f"{worst}: {diffs[worst]:.2e}"
    assert peaks[True] < 0.5 * peaks[False], (peaks[True], peaks[False])


def test_compile_runs_the_blocks_compiled_on_the_gpu(tmp_path, capsys, record_property):
    """compile=True on CUDA: inductor compiles one graph that all four blocks share (no fallback to
    eager, no recompilation per block), and the compiled steps follow the eager ones."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    results = {}
    for compile in (True, False):
        cfg, run = gpu_run(tmp_path, compile=compile)
        parts = build.build(cfg, run)
        start = time.perf_counter()
        results[compile] = train_steps(cfg, run, parts, 1)[0]
        first_step = time.perf_counter() - start
        results[compile] += train_steps(cfg, run, parts, 2, first=1)[0]
        if compile:
            compiled, graphs, compile_s = (
                parts.compiled,
                counters["stats"]["unique_graphs"],
                first_step,
            )
    out = capsys.readouterr().out
    diff = max(abs(a - b) / b for a, b in zip(results[True], results[False]))
    record_property(
        "figures",
        f"{graphs} graph(s) for 4 blocks, first step {compile_s:.1f} s, losses {diff:.1e} "
        f"from eager",
    )
    assert compiled and "torch.compile failed" not in out, out
    assert graphs == 1, f"{graphs} graphs compiled for 4 identical blocks (one expected)"
    assert diff < 2e-2, (results[True], results[False])


# --- the initial weights --------------------------------------------------------------------------


def test_initialising_on_the_gpu_gives_the_cpu_weights(record_property):
    """init_weights draws every tensor from its own CPU generator, whatever device the model is on:
    a model built on the GPU (built there, or moved there before init_weights) has exactly the CPU
    model's weights, and in fp32 computes the same logits."""
    cfg = ModelConfig(**{k: v for k, v in SMALL.items() if k in ModelConfig.__dataclass_fields__})
    cpu = Transformer(cfg)
    cpu.init_weights(1337)
    with DEVICE:
        built_there = Transformer(cfg)
        built_there.init_weights(1337)
    moved = Transformer(cfg).to(DEVICE)
    moved.init_weights(1337)
    want = dict(cpu.named_parameters())
    differ = [
        f"{how}: {name}"
        for how, m in (("built on the GPU", built_there), ("moved first", moved))
        for name, p in m.named_parameters()
        if not torch.equal(p.cpu(), want[name])
    ]
    x = torch.randint(
        0, cfg.vocab_size, (2, cfg.block_size), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        logits_diff = relative_difference(built_there(x.to(DEVICE))[0].cpu(), cpu(x)[0])
    record_property(
        "figures", f"{len(differ)} tensors differ; fp32 logits {logits_diff:.1e} from the CPU's"
    )
    assert not differ, "initialised on the GPU, these weights differ from the CPU's: " + ", ".join(
        differ
    )
    assert logits_diff < 1e-4, logits_diff
