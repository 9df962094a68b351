"""
FP8 training (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"): the three matmuls of every
linear layer, the forward y = x W^T, the input gradient dx = dy W and the weight gradient dW = dy^T
x, run on 8-bit floating-point operands, as torchao's float8 training (`convert_to_float8_training`)
does, in plain torch. apply_fp8 swaps, in place, every linear of a built model for its FP8 form,
like any layout.

What changes and what does not. Each operand is cast just before its matmul: multiplied by a scale
that puts its largest magnitude at the format's largest value, clamped, rounded to FP8; the product
is divided by both scales. Only the matmuls' operands are FP8: the master weights, their gradients
and the optimizer state stay in the run's dtype, the embedding, the norms, attention and the loss
stay as they are, so a checkpoint does not depend on fp8 (an fp8 run resumes without it and back).

The two recipes (torchao's names):
  tensorwise  one scale per tensor: input and weight in e4m3 (3 mantissa bits, up to 448), the
              output gradient in e5m2 (2 mantissa bits, up to 57,344: gradients span more range
              than precision).
  rowwise     one scale per row of each operand along the matmul's inner dimension (per token of
              x, per output row of W, ...), all e4m3, each scale rounded down to a power of two
              (multiplying by it is exact, so the cast rounds only once). CUDA's rowwise kernel has
              no fp32 output, so torchao rounds each matmul's output through bf16, here too; and it
              multiplies the two gradient matmuls' scales in after the product (its rowwise kernel
              is slow without fast accumulation, so those run the tensorwise kernel with unit
              scales): with power-of-two scales this is the same number, done the same way so that
              the two agree bit for bit.
torchao floors every amax at 1e-12 and computes the scale in float64, then fp32: an all-zero tensor
gets a finite scale. Every cast clamps first: `.to(float8_e4m3fn)` saturates at 448, but
`.to(float8_e5m2)` turns values from 61,440 up into inf.

One rule for scales across layouts. A scale is the absolute maximum over exactly the elements one
process reduces together for it; where a layout splits those elements over ranks, the maximum is
all-reduced (MAX, exact) over the group that splits them, so a rank's cast equals what one process
casts for the same rows: the rule the learner met for the gradient norm (a sum of squares over the
shards, then the root). A linear knows three groups (Float8Matmul): `inner`, the ranks splitting its
input features (a row-parallel layer's tp group), `outer`, those splitting its output features (a
column-parallel layer's), `tokens`, those splitting the tokens of one process's micro-batch (context
parallelism's cp group). Tensorwise reduces x over inner and tokens, W over inner and outer, dy over
outer and tokens; rowwise reduces the forward's scales over inner, the input gradient's over outer,
the weight gradient's over tokens. Where a layout joins rows that one process casts apart, it splits
them again: under expert parallelism an expert's input holds rows from several data-parallel ranks,
which one process meets as separate micro-batches, so each source's rows get their own scales
(`sources`, the all-to-all's sizes) and the weight gradient is formed per source and summed, as one
process accumulates it. An empty input casts nothing but still joins the all-reduces. Rowwise's bf16
rounding is taken after the sum where a matmul's inner dimension is split, so the split equals one
process: a row-parallel layer's forward is rounded after its all-reduce (round_after; with a bias,
after the bias too, where one process adds it after the rounding: within rounding of it), a
column-parallel layer's input gradient and a weight gradient under context parallelism are summed
and rounded here (sum_then_round).

Speed is a GPU's: on CPU torch._scaled_mm runs (which is how these tests check the numerics without
a GPU), but slower than fp32 (1024^3: 47-53 ms fp32, 71-87 ms casts + _scaled_mm, one thread). An
H100's FP8 tensor cores run twice bf16's rate; torchao measures +25% (tensorwise) and +10% (rowwise)
at Llama 3 8B. Imports only torch and parallel.py.
"""

import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel import ColumnParallelLinear, RowParallelLinear, group_rank, group_size

RECIPES = ("none", "tensorwise", "rowwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
AMAX_FLOOR = 1e-12  # torchao's: an all-zero tensor gets a finite scale


def amax(x, dim, groups):
    """max |x| over dim (None: every element; else kept as a dimension of size 1), all-reduced over
    each group that splits those elements. An empty x gives zeros, all-reduced all the same (its
    peers wait)."""
    if x.numel() == 0:
        shape = (
            () if dim is None else [1 if d == dim % x.dim() else n for d, n in enumerate(x.shape)]
        )
        a = x.new_zeros(shape)
    else:
        a = x.abs().amax() if dim is None else x.abs().amax(dim, keepdim=True)
    for group in groups:
        if group_size(group) > 1:
            dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)
    return a


def scale_of(a, dtype, power_of_2=False):
    """The scale that maps amax a onto the format's largest value (in float64, then fp32, as
    torchao)."""
    scale = (torch.finfo(dtype).max / a.double().clamp(min=AMAX_FLOOR)).float()
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_2 else scale


def to_fp8(x, scale, dtype):
    top = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-top, top).to(dtype)


def cast(x, dtype, dim, groups, power_of_2=False):
    """(x in FP8, its scale): the scale's amax over dim, all-reduced over groups."""
    scale = scale_of(amax(x, dim, groups), dtype, power_of_2)
    return to_fp8(x, scale, dtype), scale


def scaled_mm(a, a_scale, b, b_scale, out_dtype, post_scaled=False):
    """a @ b / (a_scale * b_scale), a (M, K) and b (K, N) in FP8, scales 0-d or (M, 1) and (1, N).
    torch._scaled_mm takes the inverse scales, and (under torch.compile) a row-major, b
    column-major.
    post_scaled: the product with unit scales, then the scales multiplied in (torchao's gradient
    matmuls)."""
    a, b = a.contiguous(), b.t().contiguous().t()
    inverse = a_scale.reciprocal(), b_scale.reciprocal()
    if post_scaled:
        one = a_scale.new_ones(())
        return torch._scaled_mm(a, b, one, one, out_dtype=out_dtype) * (inverse[0] * inverse[1]).to(
            out_dtype
        )
    return torch._scaled_mm(a, b, *inverse, out_dtype=out_dtype, use_fast_accum=True)


def _rowwise_dtype(split):
    """The dtype of a rowwise matmul's output: bf16 (its kernel's), or fp32 where the inner
    dimension is split, its partial sums rounded once summed (round_after, sum_then_round)."""
    return torch.float32 if split else torch.bfloat16


def sum_then_round(partial, group):
    """A rowwise gradient matmul whose inner dimension the group splits (a column-parallel layer's
    input gradient, over tp; a weight gradient under context parallelism, over cp): its fp32
    partials summed here and rounded through bf16 once, as one process rounds the whole product. The
    layout sums the result over the same group again (f's backward, the gradient reducer), so group
    rank 0 keeps the rounded sum and the others give zeros: that sum is then exactly this one. It
    costs one all-reduce more of that gradient."""
    if group_size(group) == 1:
        return partial
    dist.all_reduce(partial, group=group)
    rounded = partial.to(torch.bfloat16).to(partial.dtype)
    return rounded if group_rank(group) == 0 else torch.zeros_like(rounded)


# -----------------------------------------------------------------------------
# the three matmuls


def forward_product(mm, x, weight):
    """y = x W^T for x (M, K) split into mm's sources; returns (y, what backward keeps). Tensorwise
    keeps the FP8 casts (a byte an element), rowwise the inputs themselves (its backward casts them
    along the other axis)."""
    g, pieces = mm, x.split(mm.sources or [x.shape[0]])
    if mm.recipe == "tensorwise":
        w8, ws = cast(weight, E4M3, None, (g.inner, g.outer))
        xs = [cast(piece, E4M3, None, (g.inner, g.tokens)) for piece in pieces]
        y = torch.cat([scaled_mm(x8, s, w8.t(), ws, x.dtype) for x8, s in xs])
        return y, (torch.cat([x8 for x8, _ in xs]), torch.stack([s for _, s in xs]), w8, ws)
    x8, xs = cast(x, E4M3, -1, (g.inner,), power_of_2=True)  # (M, 1)
    w8, ws = cast(weight, E4M3, -1, (g.inner,), power_of_2=True)  # (N, 1)
    split = group_size(g.inner) > 1
    y = scaled_mm(x8, xs, w8.t(), ws.t(), _rowwise_dtype(split))
    return (y if split else y.to(x.dtype)), (x, weight)


def input_grad(mm, dy, kept):
    """dx = dy W, dy (M, N) split into mm's sources."""
    g, pieces = mm, dy.split(mm.sources or [dy.shape[0]])
    if mm.recipe == "tensorwise":
        _, _, w8, ws = kept
        dys = [cast(piece, E5M2, None, (g.outer, g.tokens)) for piece in pieces]
        return torch.cat([scaled_mm(dy8, s, w8, ws, dy.dtype) for dy8, s in dys])
    weight = kept[1]
    dy8, dys = cast(dy, E4M3, -1, (g.outer,), power_of_2=True)  # (M, 1)
    w8, ws = cast(weight, E4M3, 0, (g.outer,), power_of_2=True)  # (1, K)
    dx = scaled_mm(dy8, dys, w8, ws, _rowwise_dtype(group_size(g.outer) > 1), post_scaled=True)
    return sum_then_round(dx, g.outer).to(dy.dtype)


def weight_grad(mm, sources, x_kept, dy, kept):
    """dW = dy^T x, formed per source and summed (one process's micro-batches). x_kept: the FP8 x
    (tensorwise) or x (rowwise) that forward kept; kept: the rest of it."""
    g = mm
    x_pieces, dy_pieces = x_kept.split(sources), dy.split(sources)
    dw = 0
    for i, (x_i, dy_i) in enumerate(zip(x_pieces, dy_pieces)):
        if mm.recipe == "tensorwise":
            dy8, s = cast(dy_i, E5M2, None, (g.outer, g.tokens))
            dw = dw + scaled_mm(dy8.t(), s, x_i, kept[1][i], dy.dtype)
        else:
            dy8, dys = cast(dy_i, E4M3, 0, (g.tokens,), power_of_2=True)  # (1, N)
            x8, xs = cast(x_i, E4M3, 0, (g.tokens,), power_of_2=True)  # (1, K)
            out = _rowwise_dtype(group_size(g.tokens) > 1)
            dw = dw + sum_then_round(
                scaled_mm(dy8.t(), dys.t(), x8, xs, out, post_scaled=True), g.tokens
            ).to(dy.dtype)
    return dw


class Float8LinearFunction(torch.autograd.Function):
    """y = x W^T with its three matmuls in FP8 (Float8Matmul's recipe and groups). Under a
    zero-bubble pipeline schedule (mm.store, a pipeline_schedules.WeightGradStore collecting) the
    backward leaves the weight gradient, still in FP8, for the schedule's W action."""

    @staticmethod
    def forward(ctx, x, weight, mm):
        x2 = x.reshape(-1, x.shape[-1])  # (M, K): every token a row
        y, kept = forward_product(mm, x2, weight)
        ctx.mm, ctx.weight, ctx.x_shape = mm, weight, x.shape
        ctx.sources = list(mm.sources or [x2.shape[0]])
        ctx.save_for_backward(*kept)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        mm, kept = ctx.mm, ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = input_grad(mm, dy2, kept).reshape(ctx.x_shape) if ctx.needs_input_grad[0] else None
        grads = functools.partial(_weight_grads, mm, ctx.sources, kept)
        if mm.store is not None and mm.store.collecting is not None:
            mm.store.collecting.append((ctx.weight, None, kept[0], dy2, grads))
            return dx, None, None
        return dx, grads(kept[0], dy2, False)[0], None


def _weight_grads(mm, sources, kept, x_kept, dy, with_bias):
    """WeightGradStore's weight_grads for an FP8 layer: (dW, None); the bias is added outside the
    product."""
    return weight_grad(mm, sources, x_kept, dy, kept), None


class RoundThroughBf16(torch.autograd.Function):
    """Rowwise's bf16 rounding of a sum taken after the sum (forward); the gradient passes through
    as it is."""

    @staticmethod
    def forward(ctx, y):
        return y.to(torch.bfloat16).to(y.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad


def round_after(combine, partial):
    return RoundThroughBf16.apply(combine(partial))


class Float8Matmul:
    """The FP8 form of a linear's product x W^T (+ b): the `matmul` hook of parallel.py's linears,
    and of Float8Linear. inner / outer / tokens: the groups splitting the input features, the output
    features and the tokens (None: not split). sources: under expert parallelism, the rows of each
    source rank, in order (set by the dispatch before each forward, apply_fp8). store: a
    pipeline_schedules.WeightGradStore that takes the weight gradient for its W action (set by the
    store)."""

    def __init__(self, recipe, inner=None, outer=None, tokens=None):
        if recipe not in RECIPES[1:]:
            raise ValueError(f"fp8 = {recipe!r} must be one of {', '.join(map(repr, RECIPES))}")
        self.recipe, self.inner, self.outer, self.tokens = recipe, inner, outer, tokens
        self.sources = self.store = None
        self.calls = 0  # products run eagerly (ledger.py's proof a run computed in FP8)

    def __call__(self, x, weight, bias=None):
        if not torch.compiler.is_compiling():  # (a count read under compile would be a guard)
            self.calls += 1
        device = x.device.type
        # the input in the autocast dtype, as F.linear's autocast would
        if torch.is_autocast_enabled(device):
            x = x.to(torch.get_autocast_dtype(device))
        with torch.autocast(device, enabled=False):
            y = Float8LinearFunction.apply(x, weight, self)
        return y if bias is None else y + bias.to(y.dtype)

    def __repr__(self):
        return f"Float8Matmul({self.recipe})"


class Float8Linear(nn.Linear):
    """nn.Linear whose product is a Float8Matmul (`matmul`, the hook parallel.py's linears have):
    the same parameters, names and state dict."""

    def forward(self, x):
        return self.matmul(x, self.weight, self.bias)


# -----------------------------------------------------------------------------
# applying it to a model


def check_fp8(recipe, device, dtype):
    """Stop at start-up where fp8 cannot run: a CUDA card without FP8 tensor cores (compute
    capability below 8.9: before Ada and Hopper), or a float64 run (the FP8 matmuls give at most
    fp32)."""
    if recipe == "none":
        return
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"fp8 = {recipe!r} needs FP8 tensor cores (CUDA compute capability 8.9 or above: Ada, "
            f"Hopper, Blackwell); {torch.cuda.get_device_name(device)} has {major}.{minor}: "
            f"train with --fp8=none (bf16)"
        )
    if dtype == torch.float64:
        raise ValueError(
            f"fp8 = {recipe!r} with dtype float64: the FP8 matmuls give fp32 at most; use "
            f"--fp8=none for a float64 run"
        )


def fp8_dims_ok(weight, device_type):
    """CUDA's FP8 kernels need both dimensions multiples of 16 (torchtitan's rule); the CPU's do
    not."""
    return device_type != "cuda" or (weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0)


def apply_fp8(model, recipe, *, keep=None, token_group=None, device_type="cpu"):
    """Swap, in place, every linear of `model` for its FP8 form: nn.Linear becomes Float8Linear (as
    torchao's convert_to_float8_training), parallel.py's column- and row-parallel linears get a
    Float8Matmul as their `matmul` hook, with their tensor-parallel group as the split they are.
    keep(name, module) -> True leaves a linear in the run's dtype (torchao's module_filter_fn:
    train.py keeps the head and the router); on CUDA a linear whose dimensions are not multiples of
    16 stays too, and so does one whose weight's gradient is summed over the tp ranks
    (tensor_parallel.sum_grad_over). token_group: the group splitting each sequence (context
    parallelism). Under expert parallelism each expert's rows are cast per source rank. Returns the
    model, as every apply_* does (count_fp8 counts the linears swapped). recipe 'none' changes
    nothing."""
    if recipe == "none":
        return model
    for name, layer in model.named_modules():
        if not isinstance(layer, nn.Linear | ColumnParallelLinear | RowParallelLinear) or (
            keep and keep(name, layer)
        ):
            continue
        if (
            not fp8_dims_ok(layer.weight, device_type)
            or getattr(layer.weight, "grad_summed_over", None) is not None
        ):
            # a weight every tp rank holds whole but uses for part of the work (MLA's
            # down-projections): its output gradient here is a partial sum, and no cast of a part
            # is one process's cast
            continue
        if isinstance(layer, ColumnParallelLinear):
            layer.matmul = Float8Matmul(recipe, outer=layer.group, tokens=token_group)
        elif isinstance(layer, RowParallelLinear):
            layer.matmul = Float8Matmul(recipe, inner=layer.group, tokens=token_group)
            # round the sum, not each rank's part
            if recipe == "rowwise" and group_size(layer.group) > 1:
                layer.combine = functools.partial(round_after, layer.combine)
        else:
            layer.__class__ = Float8Linear  # the same module: its parameters, hooks and name stay
            layer.matmul = Float8Matmul(recipe, tokens=token_group)
    for module in model.modules():  # the mixtures of experts whose experts are spread over ranks
        dispatch = getattr(module, "dispatch", None)
        if group_size(getattr(dispatch, "group", None)) > 1 and hasattr(module, "experts"):
            dispatch.exchange_counts = functools.partial(
                _per_source, dispatch.exchange_counts, module.experts
            )
    return model


def _per_source(exchange_counts, experts, counts):
    """expert_parallel's exchange_counts, then each local expert's FP8 products told the rows each
    source rank sends it (splits.recv[j][e]: they arrive source by source)."""
    splits = exchange_counts(counts)
    for e, expert in enumerate(experts.values()):
        for layer in expert.modules():
            if isinstance(getattr(layer, "matmul", None), Float8Matmul):
                layer.matmul.sources = [rows[e] for rows in splits.recv]
    return splits


def count_fp8(model):
    """How many of the model's linears compute in FP8."""
    return sum(isinstance(getattr(m, "matmul", None), Float8Matmul) for m in model.modules())


def fp8_calls(model):
    """How many FP8 products the model's linears ran eagerly (Float8Matmul.calls)."""
    matmuls = [getattr(m, "matmul", None) for m in model.modules()]
    return sum(mm.calls for mm in matmuls if isinstance(mm, Float8Matmul))
