"""Every model variant built tensor-parallel at tp=2 equals the single-process model: logits, loss
(with the MoE auxiliary losses) and every parameter's gradient, fp32 on gloo. One launch of two
ranks checks them all (a launch costs seconds; the models cost milliseconds)."""

import torch
import torch.distributed as dist

from dist_utils import backward, build_model, gather_full, run_ranks
from model import Transformer
from test_variants import VARIANTS, tiny_config, tokens

# the tp=2 cases: every variant of test_variants, plus the two ways replicated weights meet tp
TP_VARIANTS = {
    **VARIANTS,
    # one key/value head for two ranks: replicated k/v weights, their (sliced) biases and the
    # QK-norm gains
    "mqa_qk_norm_bias": dict(n_kv_head=1, qk_norm=True, bias=True),
    # two key/value heads split across two ranks, with QK-norm gains replicated over the split heads
    "gqa_split_qk_norm": dict(n_kv_head=2, qk_norm=True),
    # replicated k/v with q/k/v-only biases and a head size of its own; experts of a chosen width
    "mqa_qkv_bias_head_dim": dict(n_kv_head=1, head_dim=8, qkv_bias=True),
    "moe_gelu_intermediate_size": dict(
        n_expert=4,
        n_expert_per_token=2,
        capacity_factor=1.0,
        mlp="gelu",
        norm="layernorm",
        intermediate_size=48,
    ),
}


def compare_variants_at_tp2(rank, world_size):
    """On each rank: the full model and this rank's tp=2 slice of it, same weights, same batch,
    forward and backward; returns {variant: (largest logit difference, loss difference, (largest
    gradient difference, its parameter), names compared)}."""
    group = dist.new_group(list(range(world_size)))
    results = {}
    for name, overrides in TP_VARIANTS.items():
        cfg = tiny_config(**overrides)
        full, split = (
            build_model(cfg, tp_group=tp, attn_impl="eager", seed=7) for tp in (None, group)
        )
        x, y = tokens(seed=1), tokens(seed=2)
        full_logits, full_loss = full(x, y)
        full_loss.backward()
        logits, loss = split(x, y)
        backward(loss, split)
        parts = [torch.empty_like(logits) for _ in range(world_size)]
        dist.all_gather(parts, logits.contiguous(), group=group)  # the vocab-sharded logits, whole
        logit_err = (torch.cat(parts, dim=-1) - full_logits).abs().max().item()
        full_params = dict(full.named_parameters())
        grad_errs = {
            pname: (gather_full(p.grad, p, group) - full_params[pname].grad).abs().max().item()
            for pname, p in split.named_parameters()
        }
        worst = max(grad_errs, key=grad_errs.get)
        results[name] = (
            logit_err,
            abs(loss.item() - full_loss.item()),
            (grad_errs[worst], worst),
            sorted(grad_errs),
        )
    return results


def test_every_variant_at_tp2_equals_one_process():
    per_rank = run_ranks(compare_variants_at_tp2, 2)
    failures = []
    for rank, results in enumerate(per_rank):
        assert set(results) == set(TP_VARIANTS)
        for name, (logit_err, loss_err, (grad_err, worst), names) in results.items():
            full_names = sorted(
                n for n, _ in Transformer(tiny_config(**TP_VARIANTS[name])).named_parameters()
            )
            if names != full_names:
                failures.append(
                    f"{name} on rank {rank}: the tp model's parameters are not the full model's"
                )
            for what, err in (
                ("logits", logit_err),
                ("loss", loss_err),
                (f"the gradient of {worst}", grad_err),
            ):
                if not err < 1e-5:
                    failures.append(
                        f"{name} on rank {rank}: {what} differs by {err:.2e} (tolerance 1e-5)"
                    )
            print(
                f"equivalence | variants at tp=2 | {name} rank {rank}: logits {logit_err:.2e}, "
                f"loss {loss_err:.2e}, gradients {grad_err:.2e} ({worst}), tolerance 1e-5 "
                "(absolute)"
            )
    assert not failures, "\n".join(failures)
