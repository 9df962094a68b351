"""Mixed precision without a GPU: fp16's dynamic loss scaling (optim.DynamicLossScaler and the step
it guards: a step whose gradient is inf or nan is skipped, the scale halves, and grows again after
good steps), and bf16 autocast through train.py, close to fp32."""

import math
from types import SimpleNamespace

import pytest
import torch

import settings
import build
import train
from optim import DynamicLossScaler
from dist_utils import make_token_data, train_in_process

TINY = dict(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_kv_head=4, n_embd=64)


# -----------------------------------------------------------------------------
# fp16: the loss scaler


def test_loss_scaler_halves_on_an_overflow_and_doubles_after_growth_interval_good_steps():
    scaler = DynamicLossScaler(enabled=True, scale=2.0**16, growth_interval=3)
    # found_inf, as the step computes it from the norm
    bad, good = (
        torch.tensor(1.0),
        torch.tensor(0.0),
    )
    assert scaler.loss_multiplier() == 2.0**16
    scaler.update(bad)
    assert scaler.scale == 2.0**15
    scaler.update(bad)
    assert scaler.scale == 2.0**14
    for expected in (2.0**14, 2.0**14, 2.0**15):  # the third good step in a row doubles it
        scaler.update(good)
        assert scaler.scale == expected
    for _ in range(2):
        scaler.update(good)
    scaler.update(bad)  # an overflow restarts the count
    assert scaler.scale == 2.0**14
    for expected in (2.0**14, 2.0**14, 2.0**15):
        scaler.update(good)
        assert scaler.scale == expected


def test_a_disabled_loss_scaler_never_scales():
    scaler = DynamicLossScaler(enabled=False)
    grads = [(None, torch.ones(3))]
    scaler.unscale(grads)
    scaler.update(torch.tensor(1.0))
    assert (
        scaler.loss_multiplier() == 1.0
        and scaler.scale == 2.0**16
        and torch.equal(grads[0][1], torch.ones(3))
    )


def tiny_parts(tmp_path, scaler):
    cfg = SimpleNamespace(
        **{
            **settings.DEFAULTS,
            **TINY,
            "batch_size": 2,
            "out_dir": str(tmp_path / "out"),
            "data_dir": None,
            "device": "cpu",
            "dtype": "float32",
        }
    )
    run = build.setup(cfg, training=False)
    parts = build.build(cfg, run)
    parts.scaler = scaler  # fp16's scaler on an fp32 CPU model: the same arithmetic, no GPU needed
    return cfg, run, parts


def test_a_step_with_an_inf_or_nan_gradient_is_skipped_and_a_scaled_step_is_the_unscaled_one(
    tmp_path,
):
    """The scaled loss's gradient, divided by the scale, is the gradient: scaling by a power of two
    is exact in floating point, so the step equals a step without scaling, bit for bit."""
    g = torch.Generator().manual_seed(0)
    batches = [
        [(torch.randint(0, 512, (2, 32), generator=g), torch.randint(0, 512, (2, 32), generator=g))]
        for _ in range(4)
    ]
    scaler = DynamicLossScaler(enabled=True, scale=2.0**10, growth_interval=2)
    cfg, run, parts = tiny_parts(tmp_path, scaler)
    start = {n: p.detach().clone() for n, p in parts.model.named_parameters()}
    weight = parts.model.blocks["0"].mlp.up.weight

    for bad in (math.inf, math.nan):  # one gradient element overflows: the norm is not finite
        hook = weight.register_hook(
            lambda grad, bad=bad: grad.index_put((torch.tensor([0]),), torch.tensor(bad))
        )
        _, norm = train.train_step(cfg, run.layout, parts, batches[0], 1e-3)
        hook.remove()
        assert not math.isfinite(norm.item())
        changed = [n for n, p in parts.model.named_parameters() if not torch.equal(p, start[n])]
        assert not changed, f"a skipped step changed {changed}"
        # its gradients do not leak into the next step
        assert all(p.grad is None for p in parts.model.parameters())
        # not stepped
        assert all(
            s["step"] == 0 and not s["exp_avg"].any() for s in parts.optimizer.state.values()
        )
    assert scaler.scale == 2.0**8

    # the same initial weights
    _, _, reference = tiny_parts(tmp_path, DynamicLossScaler(enabled=False))
    for i, micro in enumerate(batches[1:3]):
        _, norm = train.train_step(cfg, run.layout, parts, micro, 1e-3)
        _, ref_norm = train.train_step(cfg, run.layout, reference, micro, 1e-3)
        assert norm.item() == ref_norm.item()
        for (name, p), q in zip(parts.model.named_parameters(), reference.model.parameters()):
            assert torch.equal(p, q), (
                f"step {i + 1}: {name} differs by {(p - q).abs().max().item():.2e}"
            )
    assert scaler.scale == 2.0**9  # two good steps in a row (growth_interval=2): doubled once


# -----------------------------------------------------------------------------
# bf16 autocast through train.py

# bf16 keeps 8 significant bits: autocast rounds every matmul's inputs to a relative 2^-9 = 2e-3
# (the products are summed in fp32; the weights, the norms, the softmax and the loss stay fp32). The
# loss is a mean over 128 tokens, so those roundings largely cancel: measured on an AVX2 CPU without
# native bf16 over 8 steps, each loss within 4.5e-5 of fp32's and each gradient norm within 1.2e-3.
# The bounds below are 20x and 10x that, and still a small part of what the loss falls in these
# steps (10%): a bf16 run that did not learn, or computed another loss, is far outside them.
BF16_LOSS_RTOL, BF16_GRAD_NORM_RTOL = 1e-3, 1e-2


def test_bf16_autocast_trains_through_train_py_close_to_fp32(tmp_path, capsys):
    data = make_token_data(str(tmp_path / "data"))
    argv = [
        f"--data_dir={data}",
        "--n_layer=2",
        "--n_embd=64",
        "--n_head=4",
        "--n_kv_head=4",
        "--block_size=32",
        "--batch_size=4",
        "--device=cpu",
        "--max_iters=8",
        "--log_interval=1",
        "--eval_interval=8",
        "--eval_iters=2",
        "--checkpoint_interval=0",
        "--warmup_iters=2",
        "--learning_rate=3e-3",
        # a given peak: measuring bf16 matmuls on a CPU without bf16 kernels is slow
        "--peak_flops=1e12",
    ]
    runs = {
        dtype: train_in_process(argv + [f"--out_dir={tmp_path / dtype}", f"--dtype={dtype}"])
        for dtype in ("float32", "bfloat16")
    }
    assert "dtype: bfloat16" in capsys.readouterr().out
    for key, rtol in (
        ("loss", BF16_LOSS_RTOL),
        ("grad_norm", BF16_GRAD_NORM_RTOL),
        ("val_loss", BF16_LOSS_RTOL),
    ):
        fp32, bf16 = (
            [r[key] for r in runs[dtype] if key in r] for dtype in ("float32", "bfloat16")
        )
        assert len(bf16) == len(fp32) > 0 and all(math.isfinite(v) for v in bf16), (key, bf16)
        worst = max(abs(b - a) / abs(a) for a, b in zip(fp32, bf16))
        print(
            f"precision | bf16 against fp32 | {key}: largest relative difference {worst:.2e}, "
            f"bound {rtol:.0e}"
        )
        assert worst <= rtol, (
            f"bf16 {key} differs from fp32 by {worst:.2e} relative (bound {rtol:.0e}): {bf16} "
            f"{fp32}"
        )
        assert bf16 != fp32, f"bf16 {key} is fp32's exactly: autocast did not run in bf16"
    fp32_losses = [r["loss"] for r in runs["float32"] if "loss" in r]
    assert fp32_losses[-1] < 0.95 * fp32_losses[0]  # the model learns far more than the bound


# -----------------------------------------------------------------------------
# float64: a checking mode, on CPU only (tests/test_matrix.py's float64 cases hold layouts to 1e-12)


def test_float64_is_chosen_on_cpu_and_refused_on_cuda(monkeypatch):
    from model import choose_device_and_dtype

    assert choose_device_and_dtype("cpu", "float64")[1] == torch.float64
    # a CUDA device, as far as the check goes
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="dtype='float64' is for checking runs on CPU"):
        choose_device_and_dtype("cuda", "float64")
