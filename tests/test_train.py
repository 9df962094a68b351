"""The single-process foundation: the model, the config system, data checks, the training loop,
resume, sampling, and imports on a machine without the optional GPU libraries."""

import contextlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, gpt2_encoding, shared_file
from dist_utils import make_token_data, train_in_process, train_losses

import configurator
import settings
import train
from model import ModelConfig, Transformer

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
]


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory):
    return make_token_data(str(tmp_path_factory.mktemp("tokens")))


def tiny_model(attn_impl="sdpa", **kw):
    cfg = ModelConfig(
        **{**dict(vocab_size=101, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=64), **kw}
    )
    model = Transformer(cfg, attn_impl=attn_impl)
    model.init_weights(seed=0)
    return model


# --- model ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
def test_changing_a_future_token_does_not_change_earlier_logits(attn_impl):
    model = tiny_model(attn_impl=attn_impl)
    x = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(0))
    t = 9
    x2 = x.clone()
    x2[:, t + 1] = (x2[:, t + 1] + 1) % 101
    a, _ = model(x)
    b, _ = model(x2)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=0)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


def test_sdpa_and_eager_attention_agree():
    x = torch.randint(0, 101, (2, 20), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(
        tiny_model(attn_impl="sdpa")(x)[0],
        tiny_model(attn_impl="eager")(x)[0],
        rtol=1e-5,
        atol=1e-5,
    )


def test_loss_is_mean_cross_entropy_of_the_logits():
    model = tiny_model()
    x = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(3))
    logits, loss = model(x, y)
    assert logits.shape == (2, 16, 101)  # the padded vocabulary rows never reach the caller
    torch.testing.assert_close(
        loss, torch.nn.functional.cross_entropy(logits.reshape(-1, 101), y.reshape(-1))
    )


def test_same_seed_gives_same_weights_and_padding_rows_are_zero():
    a, b = tiny_model(), tiny_model()
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    assert a.tok_emb.weight.shape[0] == 128 and a.tok_emb.weight[101:].abs().sum() == 0


def test_tiny_model_overfits_one_batch():
    torch.manual_seed(0)
    model = tiny_model(tie_embeddings=False)
    x = torch.randint(0, 101, (4, 32), generator=torch.Generator().manual_seed(4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(150):
        _, loss = model(x[:, :-1], x[:, 1:])
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1 * first, (first, loss.item())


def test_generate_greedy_is_deterministic_and_extends_the_prompt():
    model = tiny_model()
    x = torch.tensor([[1, 2, 3]])
    a = model.generate(x, 8, top_k=1)
    assert a.shape == (1, 11) and torch.equal(a[:, :3], x)
    assert torch.equal(a, model.generate(x, 8, top_k=1))


# --- configuration --------------------------------------------------------------------------------


def test_config_file_and_overrides_apply_in_order(tmp_path):
    path = tmp_path / "c.py"
    path.write_text("import math\nn_layer = 6\nlearning_rate = 1e-3\nout_dir = 'x'\n")
    cfg, _ = configurator.configure(
        settings.TRAINING, [str(path), "--n_layer=8", "--learning_rate=1", "--init_from=resume"]
    )
    assert (
        cfg["n_layer"] == 8
        and cfg["learning_rate"] == 1.0
        and isinstance(cfg["learning_rate"], float)
    )
    assert cfg["out_dir"] == "x" and cfg["init_from"] == "resume"


def test_unknown_key_names_the_key_and_close_matches():
    with pytest.raises(configurator.ConfigError, match=r"unknown config key 'n_layers'.*n_layer"):
        configurator.configure(settings.TRAINING, ["--n_layers=3"])


def test_unknown_key_in_a_config_file_is_rejected(tmp_path):
    path = tmp_path / "c.py"
    path.write_text("batch_sise = 3\n")
    with pytest.raises(configurator.ConfigError, match="batch_sise.*batch_size"):
        configurator.configure(settings.TRAINING, [str(path)])


@pytest.mark.parametrize(
    "arg,expected",
    [
        ("--n_layer=2.5", "must be of type int"),
        ("--compile=1", "must be a bool"),
        ("--learning_rate=fast", "must be of type float"),
    ],
)
def test_wrong_type_is_rejected(arg, expected):
    with pytest.raises(configurator.ConfigError, match=expected):
        configurator.configure(settings.TRAINING, [arg])


def refused(argv):
    """train.main's one-line error for argv: the message a user sees instead of a traceback (as a
    program: tests/test_bad_input.py)."""
    with pytest.raises(SystemExit) as stop:
        train_in_process(argv)
    assert isinstance(stop.value.code, str) and stop.value.code.startswith("error: "), (
        stop.value.code
    )
    assert "\n" not in stop.value.code, stop.value.code
    return stop.value.code


def test_command_line_error_is_a_clean_message(tmp_path):
    assert refused(["--n_layr=3", f"--out_dir={tmp_path}"]).startswith(
        "error: unknown config key 'n_layr'"
    )


# --- data checks ----------------------------------------------------------------------------------


def data_error(data_dir, tmp_path, *extra):
    return refused(
        [f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'out'}", "--max_iters=1", *TINY, *extra]
    )


def test_missing_data_says_what_to_run(tmp_path):
    assert "python prepare_data.py" in data_error(tmp_path / "nowhere", tmp_path)
    make_token_data(str(tmp_path / "d"))
    os.remove(tmp_path / "d" / "train.bin")
    err = data_error(tmp_path / "d", tmp_path)
    assert "no train.bin" in err and "python prepare_data.py" in err


def test_corrupt_or_mismatched_data_is_refused(tmp_path):
    d = make_token_data(str(tmp_path / "d"), vocab_size=512)
    with open(os.path.join(d, "train.bin"), "ab") as f:
        f.write(b"\x00")  # half a uint16 token
    assert "not a whole number of uint16 tokens" in data_error(d, tmp_path)
    d = make_token_data(str(tmp_path / "e"), vocab_size=512)
    # ids beyond the vocabulary
    np.full(1000, 600, dtype=np.uint16).tofile(os.path.join(d, "train.bin"))
    assert "token id 600" in data_error(d, tmp_path)


def test_too_few_tokens_for_block_size(tmp_path):
    d = make_token_data(str(tmp_path / "d"), n_tokens=20)
    assert "fewer than block_size + 1" in data_error(d, tmp_path)


# --- training loop --------------------------------------------------------------------------------


def test_lr_schedule_warms_up_then_decays_to_min_lr():
    cfg = train.SimpleNamespace(
        learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110, lr_schedule="cosine"
    )
    lrs = [train.get_lr(s, cfg) for s in range(130)]
    assert lrs[0] == pytest.approx(1 / 11) and lrs[9] == pytest.approx(10 / 11)
    assert lrs[10] == pytest.approx(1.0) and lrs[60] == pytest.approx(0.55)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[120] == 0.1


def test_logged_lr_is_the_lr_applied_and_loss_falls(token_dir, tmp_path):
    records = train_in_process(
        [
            f"--data_dir={token_dir}",
            f"--out_dir={tmp_path}",
            "--max_iters=30",
            "--lr_decay_iters=30",
            "--checkpoint_interval=0",
            *TINY,
        ]
    )
    cfg = train.SimpleNamespace(
        learning_rate=3e-3, min_lr=1e-4, warmup_iters=2, lr_decay_iters=30, lr_schedule="cosine"
    )
    assert [r["lr"] for r in records] == pytest.approx([train.get_lr(s, cfg) for s in range(30)])
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_sec"} <= set(records[0])
    losses = train_losses(records)
    assert np.mean(losses[-5:]) < losses[0] - 1.0


def test_resume_continues_exactly_like_an_uninterrupted_run(token_dir, tmp_path, capsys):
    common = [
        f"--data_dir={token_dir}",
        "--checkpoint_interval=3",
        "--max_iters=6",
        "--lr_decay_iters=6",
        "--eval_interval=3",
        "--eval_iters=2",
        "--gradient_accumulation_steps=2",
        *TINY,
    ]
    straight = train_in_process([f"--out_dir={tmp_path / 'a'}", *common])
    train_in_process([f"--out_dir={tmp_path / 'b'}", *common, "--max_iters=3"])
    capsys.readouterr()
    resumed = train_in_process([f"--out_dir={tmp_path / 'b'}", *common, "--init_from=resume"])
    assert "resumed from" in capsys.readouterr().out
    assert train_losses(resumed) == train_losses(straight)  # bit-identical in fp32 on CPU
    norms = [
        [r["grad_norm"] for r in records if "grad_norm" in r] for records in (resumed, straight)
    ]
    assert norms[0] == norms[1]
    assert [r["val_loss"] for r in resumed if "val_loss" in r] == [
        r["val_loss"] for r in straight if "val_loss" in r
    ]


def test_scratch_run_refuses_to_overwrite_checkpoints(token_dir, tmp_path):
    args = [f"--data_dir={token_dir}", f"--out_dir={tmp_path}", "--max_iters=1", *TINY]
    train_in_process(args)
    assert "--init_from=resume" in refused(args)
    assert "no complete checkpoint" in refused(
        [f"--data_dir={token_dir}", f"--out_dir={tmp_path / 'empty'}", "--init_from=resume", *TINY]
    )


# --- the whole path on real text: prepare, train, sample ------------------------------------------


@pytest.fixture(scope="module")
def real_text_run(tmp_path_factory):
    """prepare_data.py on real text, then train.py with the quick start's config cut small, in this
    process: (its out_dir, the records of its metrics.jsonl, what it printed)."""
    import prepare_data

    gpt2_encoding()
    tmp_path = tmp_path_factory.mktemp("real_text")
    source = shared_file("fineweb_edu_sample/fineweb_edu_sample10bt_150.jsonl")
    if source is None:  # a fresh clone without ../shared: make a small corpus of our own
        source = tmp_path / "docs.jsonl"
        source.write_text(
            "".join(
                json.dumps(
                    {"text": f"Document {i}: the quick brown fox jumps over the lazy dog. " * 20}
                )
                + "\n"
                for i in range(60)
            )
        )
    prepare_data.prepare(str(source), str(tmp_path / "data"), num_proc=1)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        records = train_in_process(
            [
                str(ROOT / "config/tiny_fineweb.py"),
                f"--data_dir={tmp_path / 'data'}",
                f"--out_dir={tmp_path / 'out'}",
                "--max_iters=4",
                "--eval_interval=2",
                "--eval_iters=1",
                "--batch_size=2",
                "--block_size=64",
                "--log_interval=1",
            ]
        )
    return str(tmp_path / "out"), records, printed.getvalue()


def test_prepare_train_sample_on_real_text(real_text_run):
    import sample

    out_dir, records, _ = real_text_run
    assert "val_loss" in records[-1] and len(train_losses(records)) == 4
    texts = sample.main(
        [
            f"--out_dir={out_dir}",
            "--start=The",
            "--num_samples=1",
            "--max_new_tokens=5",
            "--top_k=1",
        ]
    )
    assert (
        texts[0].startswith("The")
        and texts[0]
        == sample.main(
            [
                f"--out_dir={out_dir}",
                "--start=The",
                "--num_samples=1",
                "--max_new_tokens=5",
                "--top_k=1",
            ]
        )[0]
    )


def test_the_layout_line_gives_the_global_batch_in_tokens(real_text_run):
    _, _, printed = real_text_run
    layout_line = next(line for line in printed.splitlines() if line.startswith("layout:"))
    # batch_size 2 x 1 micro-batch x dp 1 = 2 windows of block_size 64
    assert layout_line.endswith("; global batch 2 x 1 micro-batches x dp 1 = 2 x 64 = 128 tokens")


def test_a_run_ends_with_a_summary_and_the_commands_that_take_it_further(real_text_run):
    import export_hf
    import sample

    out_dir, records, printed = real_text_run
    summary = printed[printed.index("finished:") :]
    # metrics.jsonl's: steps 2, 4
    evals = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    best = min(evals, key=lambda e: e[1])
    assert summary.startswith(f"finished: steps 0 -> 4 (4 steps, {4 * 2 * 64:,} tokens) in ")
    assert (
        f"validation loss {evals[-1][1]:.4f} at step 4, the best {best[1]:.4f} at step {best[0]}\n"
        in summary
    )
    assert f"checkpoint: {os.path.join(out_dir, 'ckpt_0000004')}\n" in summary
    shown = [
        shlex.split(line, comments=True) for line in summary.splitlines() if line.startswith("  ")
    ]
    # one process: python SCRIPT ...
    commands = {words[1]: words for words in shown if words[0] == "python"}
    assert set(commands) == {"sample.py", "train.py", "export_hf.py"}
    assert all(f"--out_dir={out_dir}" in words for words in commands.values())
    # each is taken as printed: sample.py samples, train.py finds this run's checkpoint to resume to
    # 8 steps, export_hf.py's flags parse
    assert sample.main(commands["sample.py"][2:] + ["--num_samples=1", "--max_new_tokens=2"])[
        0
    ].startswith("The history of")
    cfg, _, resume_path = train.configure_run(commands["train.py"][2:])
    assert (
        resume_path == os.path.join(out_dir, "ckpt_0000004")
        and cfg.max_iters == 8
        and cfg.batch_size == 2
    )
    configurator.configure(export_hf.EXPORT, commands["export_hf.py"][2:])


# --- optional GPU libraries -----------------------------------------------------------------------

BLOCK_GPU_LIBS = """
import sys
class Blocker:  # behaves as if flash_attn, triton and functorch were not installed at all
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('flash_attn', 'triton', 'functorch'):
            raise ImportError(f'{name} is blocked for this test')
sys.meta_path.insert(0, Blocker())
"""


def test_every_module_imports_without_flash_attn_triton_functorch():
    code = (
        BLOCK_GPU_LIBS
        + """
import glob, importlib, os
for path in sorted(glob.glob('*.py') + glob.glob('tools/*.py')):
    importlib.import_module(path[:-3].replace('/', '.'))
from model import choose_attn_impl
import torch
print(choose_attn_impl('auto', 'cpu', torch.float32)[0])
"""
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("sdpa")


def test_train_needs_no_tools_folder_at_dp2_zero1_tp2_pp2(tmp_path):
    """Training never needs tools/: the checkout copied without it trains at dp = 2 (ZeRO-1) x tp =
    2 x pp = 2, one launch for the three axes, and says in one line at start-up what it skipped."""
    copy = tmp_path / "picotron"
    shutil.copytree(
        ROOT,
        copy,
        ignore=shutil.ignore_patterns("tools", "tests", ".*", "out", "data", "hf", "__pycache__"),
    )
    data = make_token_data(str(tmp_path / "data"))
    argv = [
        "--dp=2",
        "--tp=2",
        "--pp=2",
        "--zero_stage=1",
        "--pp_trace=True",
        f"--data_dir={data}",
        f"--out_dir={tmp_path / 'out'}",
        "--n_layer=2",
        "--n_head=2",
        "--n_kv_head=2",
        "--n_embd=32",
        "--block_size=32",
        "--batch_size=2",
        "--gradient_accumulation_steps=2",
        "--max_iters=2",
        "--eval_iters=1",
        "--eval_interval=2",
        "--log_interval=1",
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=8",
            "train.py",
            *argv,
        ],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "layout: dp=2 x tp=2 x pp=2 = 8 processes" in proc.stdout, proc.stdout[:2000]
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("tools/ is not here")]
    assert skipped == [
        "tools/ is not here: no predicted memory or step at start-up, no measured peak beside "
        "a prediction, no pipeline description, no pp_trace"
    ], proc.stdout
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step      2 | loss")]
    assert len(steps) == 1 and "nan" not in steps[0], proc.stdout
