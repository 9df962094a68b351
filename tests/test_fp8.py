"""FP8 training (fp8.py): equal to torchao's float8 training for the same weights and inputs, its
scales the same at tp = 2 as in one process, and a model it is applied to trains with the same
parameters and state dict."""

import copy

import pytest
import torch
import torch.nn as nn

import fp8
from dist_utils import run_ranks

RECIPES = ("tensorwise", "rowwise")


def torchao_or_skip():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        pytest.skip(
            "torchao is not installed (pip install -r requirements-dev.txt): "
            "the comparison needs it"
        )
    return Float8LinearConfig, convert_to_float8_training


def outputs_and_grads(model, x):
    """The output, the input's gradient and every weight's gradient of sum(out * fixed noise)."""
    x = x.clone().requires_grad_(True)
    y = model(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


def relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("zero_input", [False, True])
def test_apply_fp8_equals_torchao(recipe, zero_input):
    """Two linears (20 -> 36 -> 12: no dimension a multiple of 16), a 3-D input, a bias:
    fp8.apply_fp8 gives torchao's output, input gradient and weight gradients within 1e-6 relative;
    an all-zero input gives finite numbers."""
    Float8LinearConfig, convert_to_float8_training = torchao_or_skip()
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(20, 36, bias=False), nn.GELU(), nn.Linear(36, 12, bias=True))
    x = torch.zeros(2, 5, 20) if zero_input else torch.randn(2, 5, 20) * 3
    ours, theirs = copy.deepcopy(plain), copy.deepcopy(plain)
    assert fp8.count_fp8(fp8.apply_fp8(ours, recipe)) == 2
    convert_to_float8_training(theirs, config=Float8LinearConfig.from_recipe_name(recipe))
    got, want = outputs_and_grads(ours, x), outputs_and_grads(theirs, x)
    exact = outputs_and_grads(plain, x)
    for name, g, w, e in zip(
        ["output", "input grad", "w0 grad", "w2 grad", "b2 grad"], got, want, exact
    ):
        assert torch.isfinite(g).all(), name
        assert relative(g, w) <= 1e-6, f"{recipe} {name}: {relative(g, w):.2e} from torchao"
    # and it is FP8: torchao and ours part from the fp32 product by FP8's rounding
    if not zero_input:
        assert 1e-4 < relative(got[0], exact[0]) < 0.1


def test_fp8_keeps_parameters_names_and_state_dict():
    """apply_fp8 swaps in place: the same Parameter objects and state-dict keys, and keep() leaves a
    layer."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    params, keys = list(model.parameters()), list(model.state_dict())
    assert fp8.count_fp8(fp8.apply_fp8(model, "tensorwise", keep=lambda name, m: name == "1")) == 1
    assert isinstance(model[0], fp8.Float8Linear) and type(model[1]) is nn.Linear
    assert list(model.parameters()) == params and list(model.state_dict()) == keys
    assert fp8.count_fp8(fp8.apply_fp8(nn.Linear(8, 8), "none")) == 0


def test_cuda_keeps_linears_whose_dimensions_are_not_multiples_of_16():
    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 20))
    assert fp8.count_fp8(fp8.apply_fp8(model, "rowwise", device_type="cuda")) == 1
    assert type(model[1]) is nn.Linear


def test_e5m2_cast_saturates_instead_of_overflowing():
    """.to(float8_e5m2) turns 61,440 and above into inf; fp8.to_fp8 clamps first."""
    big = torch.tensor([1e5, -7e4])
    assert torch.isinf(big.to(torch.float8_e5m2).float()).all()
    assert fp8.to_fp8(big, torch.tensor(1.0), torch.float8_e5m2).float().tolist() == [
        57344.0,
        -57344.0,
    ]


def _tp_scales(rank, world_size):
    """On each of 2 ranks: the casts of this rank's slices of a full tensor, with the scale's amax
    all-reduced over the group that splits the elements, against the casts one process makes of the
    full tensor."""
    import torch.distributed as dist

    group = dist.group.WORLD
    full = torch.randn(6, 8, generator=torch.Generator().manual_seed(3)) * torch.arange(1, 9)
    mismatches = []
    # (dim the scale reduces over, dim the layout splits, power of 2): tensorwise over a column- and
    # a row-parallel split, rowwise along a split axis (reduced) and across one (each rank its own
    # rows)
    for dim, split, pow2 in (
        (None, 0, False),
        (None, 1, False),
        (-1, 1, True),
        (0, 0, True),
        (-1, 0, True),
    ):
        mine = full.chunk(world_size, dim=split)[rank]
        reduced_over_split = dim is None or dim % 2 == split
        x8, scale = fp8.cast(mine, fp8.E4M3, dim, (group,) if reduced_over_split else (), pow2)
        x8_one, scale_one = fp8.cast(full, fp8.E4M3, dim, (), pow2)
        if dim is not None and not reduced_over_split:
            scale_one = scale_one.chunk(world_size, dim=split)[rank]
        same = torch.equal(scale, scale_one) and torch.equal(
            x8.view(torch.uint8), x8_one.chunk(world_size, dim=split)[rank].view(torch.uint8)
        )
        if not same:
            mismatches.append((dim, split))
    return mismatches


def test_scales_at_tp2_are_bit_identical_to_one_process():
    """The one rule for scales: a rank's cast of its slice equals one process's cast of the same
    elements, bit for bit, for every scale whose elements the layout splits (all-reduced) or leaves
    whole."""
    assert run_ranks(_tp_scales, 2) == [[], []]


@pytest.mark.parametrize("recipe", RECIPES)
def test_split_backward_keeps_the_fp8_weight_gradient_and_equals_one_backward(recipe):
    """Under a zero-bubble schedule's split backward (WeightGradStore: B collects, W applies, a
    microbatch late) an FP8 model's gradients are those of its plain backward, bit for bit: W forms
    dW with the same FP8 matmuls (the store keeps the FP8 layers' inputs, not a plain linear's
    product)."""
    from model import ModelConfig, Transformer
    from pipeline_schedules import WeightGradStore, chunk_modules

    cfg = ModelConfig(
        vocab_size=128,
        block_size=8,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        n_embd=32,
        n_expert=4,
        n_expert_per_token=1,
        n_shared_expert=1,
    )
    plain, split = Transformer(cfg), Transformer(cfg)
    plain.init_weights(1), split.init_weights(1)
    for model in (plain, split):
        fp8.apply_fp8(
            model, recipe, keep=lambda name, _: name == "lm_head" or name.endswith(".router")
        )
    store = WeightGradStore(chunk_modules(split, 0))
    assert any(p is split.blocks["0"].attn.q_proj.weight for p in store.params)
    g = torch.Generator().manual_seed(7)
    batches = [[torch.randint(0, 128, (2, 8), generator=g) for _ in range(2)] for _ in range(3)]
    for x, y in batches:
        (plain(x, y)[1] / 3).backward()
    for i, (x, y) in enumerate(batches):
        with store.collect(i):
            (split(x, y)[1] / 3).backward()
        if i >= 1:
            store.apply(i - 1)
    store.apply(2)
    assert store.held == {} and store.held_bytes == 0
    in_fp8 = {
        id(m.weight)
        for m in split.modules()
        if isinstance(getattr(m, "matmul", None), fp8.Float8Matmul)
    }
    for (name, p), q in zip(plain.named_parameters(), split.parameters()):
        if id(q) in in_fp8:
            assert torch.equal(p.grad, q.grad), name
        else:  # (the tied head's plain split backward adds in another order)
            torch.testing.assert_close(
                q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}"
            )


TINY = [
    "--n_layer=2",
    "--n_head=4",
    "--n_kv_head=2",
    "--n_embd=64",
    "--block_size=32",
    "--batch_size=4",
    "--eval_interval=0",
    "--log_interval=1",
    "--warmup_iters=2",
    "--learning_rate=3e-3",
    "--device=cpu",
]


def test_an_fp8_run_says_so_and_resumes_without_fp8(tmp_path):
    """train.py --fp8=rowwise names how many linears compute in FP8 (all but the tied head: 7 a
    block); its checkpoint resumes with fp8 off, a checkpoint of the same names and shapes."""
    from contextlib import redirect_stdout
    import io
    from dist_utils import make_token_data, train_in_process

    data = make_token_data(str(tmp_path / "data"))
    run = TINY + [f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}", "--checkpoint_interval=2"]
    with redirect_stdout(io.StringIO()) as out:
        train_in_process(run + ["--fp8=rowwise", "--max_iters=2"])
    assert "fp8: 14 linears (rowwise)" in out.getvalue()
    records = train_in_process(run + ["--fp8=none", "--max_iters=3", "--init_from=resume"])
    assert [r["step"] for r in records if "loss" in r][-1] == 3


def test_fp8_refuses_an_unknown_recipe_and_float64():
    from dist_utils import main_exit_and_output

    code, out = main_exit_and_output(TINY + ["--fp8=blockwise", "--max_iters=1"])
    assert "fp8 = 'blockwise' must be one of 'none', 'tensorwise', 'rowwise'" in str(code)
    with pytest.raises(ValueError, match="fp8 = 'tensorwise' with dtype float64"):
        fp8.check_fp8("tensorwise", torch.device("cpu"), torch.float64)


def test_bench_compare_fp8_times_both_in_turn(capsys):
    """tools/bench.py --compare_fp8=True times the step with fp8 and without, in turn, and says
    which is which."""
    import json
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
            "--bench_steps=1",
            "--peak_flops=1e12",
            "--device=cpu",
            "--fp8=rowwise",
            "--compare_fp8=True",
        ]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1][len("RESULT ") :])
    assert (result["fp8"], result["compare_fp8"]) == ("rowwise", "none")
    assert result["compare_fp8_ms_per_step"] > 0 and result["compare_fp8_loss"] != result["loss"]
    assert any(line.startswith("fp8=rowwise against fp8=none:") for line in lines)


def test_a_linear_whose_gradient_tp_sums_stays_out_of_fp8():
    """MLA's down-projections at tp = 2: every rank holds them whole and backward gives each rank a
    partial output gradient (tensor_parallel.sum_grad_over sums their weight gradients): a cast of a
    part is not one process's cast, so they stay in the run's dtype; the column-parallel
    up-projections go to FP8."""
    from types import SimpleNamespace

    from model import ModelConfig, Transformer
    from tensor_parallel import apply_tensor_parallel

    cfg = ModelConfig(
        vocab_size=64,
        block_size=8,
        n_layer=1,
        n_head=2,
        n_kv_head=2,
        n_embd=32,
        attention="mla",
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=8,
    )
    with torch.device("meta"):
        model = Transformer(cfg)
    apply_tensor_parallel(model, SimpleNamespace(size=lambda: 2, rank=lambda: 0), False)
    fp8.apply_fp8(model, "tensorwise")
    summed = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and getattr(m.weight, "grad_summed_over", None) is not None
    ]
    assert summed, "MLA at tp=2 has down-projections whose gradient tp sums"
    for name, m in model.named_modules():
        if name in summed:
            assert not isinstance(m, fp8.Float8Linear), name
    assert any(
        isinstance(getattr(m, "matmul", None), fp8.Float8Matmul)
        for n, m in model.named_modules()
        if n.endswith("up")
    ), "the up-projections compute in FP8"
