"""Document masking (doc_mask=True, model.py): attention stops at the end-of-text token, positions
restart.

On one process: the document ids and positions of a window (the eot belongs to the document it
ends); FlashAttention-2's varlen offsets; SDPA's block mask against the eager attention; and the
property itself: changing an earlier document of a window (its tokens and its length) leaves every
logit of the next document unchanged, for a dense model, MLA and a mixture of experts that drops
nothing; without doc_mask the same change moves them (so the test can fail). Then through train.py,
on bins whose documents are 3 to 20 tokens long: the model takes the eot token from meta.json, and
doc_mask changes the run. (doc_mask at tp2, pp2, cp2 and the other layouts gives one process's run:
the equivalence matrix, tests/matrix.py.)

(Ring attention with document ids, its fully hidden chunk pairs included, is tested against plain
attention in tests/test_context_parallel.py.)
"""

import json

import numpy as np
import pytest
import torch

import checkpoint
from dist_utils import train_in_process
from model import ModelConfig, Transformer, document_ids_and_positions, document_mask

EOT = 63


def test_the_eot_belongs_to_the_document_it_ends_and_positions_restart_after_it():
    x = torch.tensor([[5, EOT, 3, 7, EOT, EOT, 1], [EOT, 2, 2, 2, 2, 2, 2]])
    documents, positions = document_ids_and_positions(x, EOT)
    assert documents.tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 4, 5]]


def test_flash_varlen_offsets_are_the_documents_of_the_rows_laid_end_to_end():
    documents = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    mask = document_mask(documents, "flash", torch.device("cpu"))
    assert mask.cu_seqlens.tolist() == [0, 2, 5, 6, 12] and mask.cu_seqlens.dtype == torch.int32
    assert mask.max_seqlen == 6


def test_sdpa_block_mask_equals_the_eager_attention():
    cfg = ModelConfig(
        vocab_size=64,
        block_size=24,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        n_embd=32,
        doc_mask=True,
        eot_token=EOT,
    )
    # two rows, other boundaries
    x = torch.cat([window(5, 9, 1, 6, end=False), window(3, 7, 11, seed=1)])
    logits = {}
    for impl in ("sdpa", "eager"):
        model = Transformer(cfg, attn_impl=impl)
        model.init_weights(0)
        logits[impl], _ = model(x)
    err = (logits["sdpa"] - logits["eager"]).abs().max().item()
    assert err < 1e-5, err


def window(*lengths, seed=0, end=True):
    """(1, T): documents of these lengths (each ended by EOT except, with end=False, the last)."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for i, n in enumerate(lengths):
        doc = torch.randint(0, EOT, (n,), generator=g)
        if end or i < len(lengths) - 1:
            doc[-1] = EOT
        parts.append(doc)
    return torch.cat(parts)[None]


VARIANTS = {
    "dense": dict(),
    "mla": dict(
        attention="mla", kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8
    ),
    # capacity_factor = n_expert: an expert can take every token, so nothing is dropped
    "moe_dropless": dict(n_expert=4, n_expert_per_token=2, capacity_factor=4.0),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_changing_an_earlier_document_leaves_the_next_documents_logits_unchanged(variant):
    cfg = dict(
        vocab_size=64,
        block_size=48,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        n_embd=32,
        eot_token=EOT,
        **VARIANTS[variant],
    )
    masked, plain = Transformer(ModelConfig(**cfg, doc_mask=True)), Transformer(ModelConfig(**cfg))
    masked.init_weights(0)
    plain.init_weights(0)
    masked.eval()  # (no auxiliary losses; the logits are the same either way)
    plain.eval()
    later = window(17, seed=3, end=False)  # the document whose logits are compared
    base = torch.cat([window(9, 6, seed=1), later], dim=1)
    n = later.shape[1]
    # other text, other lengths
    for earlier in (window(9, 6, seed=5), window(12, 6, seed=2), window(4, seed=4)):
        changed = torch.cat([earlier, later], dim=1)
        for model, isolated in ((masked, True), (plain, False)):
            with torch.no_grad():
                a, _ = model(base)
                b, _ = model(changed)
            err = (a[:, -n:] - b[:, -n:]).abs().max().item()
            if isolated:
                assert err < 1e-5, f"{variant}: the next document's logits moved by {err}"
            else:
                assert err > 1e-3, f"{variant}: without doc_mask the change should show ({err})"


# -----------------------------------------------------------------------------
# through train.py (at tp2, pp2, cp2 and the other layouts against one process: the equivalence
# matrix)

TINY = [
    "--n_layer=2",
    "--n_embd=64",
    "--n_head=4",
    "--n_kv_head=2",
    "--block_size=32",
    "--device=cpu",
    "--max_iters=1",
    "--log_interval=1",
    "--eval_interval=0",
    "--warmup_iters=2",
    "--learning_rate=3e-3",
    "--batch_size=4",
    "--gradient_accumulation_steps=2",
    "--doc_mask=True",
    "--checkpoint_interval=1",
    # skips timing a CPU matmul at start-up
    "--peak_flops=1e12",
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Bins of documents 3 to 20 tokens long, each ended by the eot token (63 of a 64-token
    vocabulary): a 32-token window holds several."""
    out = tmp_path_factory.mktemp("docs")
    rng = np.random.default_rng(0)
    for split, n in (("train", 20000), ("val", 2000)):
        tokens = []
        while len(tokens) < n:
            start = rng.integers(0, 40)
            # learnable: counting
            tokens += [(start + i) % EOT for i in range(rng.integers(2, 20))] + [EOT]
        np.array(tokens[:n], dtype=np.uint16).tofile(out / f"{split}.bin")
    with open(out / "meta.json", "w") as f:
        json.dump({"tokenizer": "gpt2", "vocab_size": 64, "dtype": "uint16", "eot_token": EOT}, f)
    return str(out)


def test_the_model_takes_eot_from_meta_json_and_doc_mask_changes_the_run(data_dir, tmp_path):
    masked = train_in_process(TINY + [f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'masked'}"])
    model = checkpoint.CheckpointReader(str(tmp_path / "masked" / "ckpt_0000001")).meta["model"]
    assert model["doc_mask"] is True and model["eot_token"] == EOT
    plain = train_in_process(
        [a for a in TINY if a != "--doc_mask=True"]
        + [f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'plain'}"]
    )
    first = (
        [r["loss"] for r in masked if "loss" in r][0],
        [r["loss"] for r in plain if "loss" in r][0],
    )
    assert abs(first[0] - first[1]) > 1e-4 * first[1], first


def test_bench_times_doc_mask_beside_plain_attention(capsys):
    from tools import bench

    bench.main(
        [
            "--n_layer=2",
            "--n_embd=64",
            "--n_head=4",
            "--n_kv_head=4",
            "--block_size=32",
            "--vocab_size=16",
            "--eot_token=3",
            "--doc_mask=True",
            "--compare_doc_mask=True",
            "--batch_size=2",
            "--warmup_steps=1",
            "--bench_steps=2",
            "--peak_flops=1e12",
        ]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("doc_mask=True against doc_mask=False: ") for line in lines), lines
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["doc_mask"] is True and result["compare_doc_mask_ms_per_step"] > 0
