"""One rule at every layout for a model whose parameters are not all used in a step:
Mixture-of-Experts blocks with latent attention (MLA), trained through train.py at dp=2 (ZeRO off
and on) and at pp=2, equal one process (tests/dist_utils.py: the equivalence rule); and a
one-process checkpoint in which experts never got a token resumes.

32 experts, top-1, 16 tokens a micro-batch (batch_size 2 x block_size 8; an expert takes at most
ceil(1.25 * 16 / 32) = 1 of them): in every step many experts get no token anywhere. Their gradient
is zero at every layout, one process included (train.forward_backward_step), so AdamW steps them
alike everywhere. Before that rule one process skipped them (no gradient) while data parallelism
stepped them with its zero gradient (momentum and weight decay). Measured on these runs without the
rule: the dp=2 losses part from one process's at step 3 (1.6e-5 relative) and by 1.0e-4 at step 8,
the gradient norms by up to 6.9e-4 (from step 4), 201 tensors of the final weights by more than 1e-4
(an idle expert's by 0.45).

And an expert that got tokens on one replica and none on the other has its gradient during backward
on the first, only in GradientBuckets.finish() on the second: the buckets must still be launched in
one order on every rank (parallel.py section 4). Launched as they filled, these runs stopped with a
gloo size mismatch (buckets of equal size would have been summed with the wrong ones, silently).

The reference keeps batch_size and raises gradient_accumulation_steps (capacity and the auxiliary
loss are per micro-batch): replica r's micro-batches are then the reference's micro-batches 2r and
2r + 1.
"""

import json
import os
import shutil

import pytest
import torch

from dist_utils import (
    assert_same_losses_and_norms,
    assert_same_tensors,
    checkpoint_weights,
    train_in_process,
    train_on_ranks,
)

STEPS = 8
MOE_MLA = [
    "--n_layer=2",
    "--n_embd=64",
    "--n_head=4",
    "--n_kv_head=4",
    "--block_size=8",
    "--batch_size=2",
    "--attention=mla",
    "--kv_lora_rank=32",
    "--qk_rope_head_dim=8",
    "--qk_nope_head_dim=16",
    "--v_head_dim=16",
    "--n_expert=32",
    "--n_expert_per_token=1",
    "--device=cpu",
    f"--max_iters={STEPS}",
    "--log_interval=1",
    "--eval_interval=1",
    "--eval_iters=1",
    "--checkpoint_interval=2",
    "--keep_last_n=0",
    "--warmup_iters=2",
    f"--lr_decay_iters={STEPS}",
    "--learning_rate=3e-3",
    # tiny buckets, many of them: they fill in another order on each replica (parallel.py section 4)
    "--bucket_size_mb=0.01",
    # skips timing a CPU matmul on each rank at start-up
    "--peak_flops=1e12",
]
ONE_PROCESS = ["--gradient_accumulation_steps=4"]
PER_REPLICA_AT_DP2 = ["--gradient_accumulation_steps=2"]


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    """One process, checkpoints at steps 2, 4, 6 and 8: (records, out_dir)."""
    out = tmp_path_factory.mktemp("one_process")
    return train_in_process(
        MOE_MLA + ONE_PROCESS + [f"--data_dir={data_dir}", f"--out_dir={out}"]
    ), out


def saved_state(ckpt_path):
    """The pieces of a one-process checkpoint's only rank file: {"model": ..., "optimizer": ...}."""
    return torch.load(os.path.join(ckpt_path, "rank00000.pt"), weights_only=True)


def idle_experts(state):
    """The expert parameters no token reached in any step so far: their AdamW moments are exactly
    zero (or absent, in a checkpoint written before every parameter got a zero gradient)."""
    moments = state["optimizer"]
    return [
        name
        for name in state["model"]
        if ".experts." in name
        and (name not in moments or not moments[name]["exp_avg"]["tensor"].any())
    ]


LAYOUTS = {  # name: (settings, the layout train.py must print)
    "dp2_zero0": (PER_REPLICA_AT_DP2 + ["--zero_stage=0"], "dp=2 x tp=1 x pp=1"),
    "dp2_zero1": (PER_REPLICA_AT_DP2 + ["--zero_stage=1"], "dp=2 x tp=1 x pp=1"),
    # every block gathered, idle experts too
    "dp2_zero3": (PER_REPLICA_AT_DP2 + ["--zero_stage=3"], "dp=2 x tp=1 x pp=1"),
    "pp2": (ONE_PROCESS + ["--pp=2"], "dp=1 x tp=1 x pp=2"),
}


@pytest.fixture(scope="module")
def layout_runs(data_dir, tmp_path_factory):
    """Every layout of LAYOUTS trained, one after another in one launch of 2 processes:
    {name: (records, out_dir, stdout)}."""
    outs = {name: tmp_path_factory.mktemp(name) for name in LAYOUTS}
    runs = train_on_ranks(
        [
            MOE_MLA + layout + [f"--data_dir={data_dir}", f"--out_dir={outs[name]}"]
            for name, (layout, _) in LAYOUTS.items()
        ],
        2,
    )
    return {name: (records, outs[name], stdout) for name, (records, stdout) in zip(LAYOUTS, runs)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_mla_with_idle_experts_equals_one_process(name, layout_runs, reference):
    ref_records, ref_out = reference
    # the case at hand: experts no token reached
    assert idle_experts(saved_state(ref_out / "ckpt_0000002"))
    records, out, stdout = layout_runs[name]
    assert LAYOUTS[name][1] in stdout
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    assert_same_losses_and_norms(records, ref_records)
    assert_same_tensors(
        checkpoint_weights(out / f"ckpt_{STEPS:07d}"),
        checkpoint_weights(ref_out / f"ckpt_{STEPS:07d}"),
    )


def test_a_one_process_moe_checkpoint_with_experts_that_never_got_a_token_resumes(
    data_dir, reference, tmp_path
):
    """Every parameter has AdamW moments in the checkpoint, an idle expert's zero ones included. A
    checkpoint written before that rule lacks them (AdamW had no state for a parameter that never
    had a gradient, and resuming it stopped with "has no 'blocks.0.mlp.experts.3.gate.weight'
    (exp_avg): it was saved from a different model"): with those moments removed it still resumes,
    to the same run."""
    ref_records, ref_out = reference
    state = saved_state(ref_out / "ckpt_0000002")
    missing = sorted(set(state["model"]) - set(state["optimizer"]))
    assert not missing, f"no AdamW moments saved for {missing}"
    idle = idle_experts(state)
    assert idle

    # the same checkpoint as an older picotron wrote it: no moments for the idle experts
    old = tmp_path / "ckpt_0000002"
    shutil.copytree(ref_out / "ckpt_0000002", old)
    for name in idle:
        del state["optimizer"][name]
    torch.save(state, old / "rank00000.pt")
    meta = json.loads((old / "meta.json").read_text())
    meta["file_sizes"] = [os.path.getsize(old / "rank00000.pt")]
    del meta["file_crc32"]  # that picotron wrote no checksums either
    (old / "meta.json").write_text(json.dumps(meta))

    records = train_in_process(
        MOE_MLA
        + ONE_PROCESS
        + [f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--init_from=resume"]
    )
    assert [r["step"] for r in records if "loss" in r] == list(range(3, STEPS + 1))
    assert_same_losses_and_norms(records, ref_records)
    assert_same_tensors(
        checkpoint_weights(tmp_path / f"ckpt_{STEPS:07d}"),
        checkpoint_weights(ref_out / f"ckpt_{STEPS:07d}"),
    )
