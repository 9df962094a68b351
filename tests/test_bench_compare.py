"""tools/bench.py's compared columns (--compare_optimizer, --compare_zero_stage, --compare_doc_mask,
--compare_fp8, --schedules): each passes train.py's own checks before anything is built, ends in a
one-line error where it cannot run, and is labelled by the settings it ran with (issue 51: 3, 8)."""

import json
from types import SimpleNamespace

import pytest
import torch

from tools import bench
import settings
import build
from configurator import ConfigError, configure
from fp8 import check_fp8
from model import ModelConfig
from settings import check_layout

TINY = [
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
]


def error_of(argv):
    """The one line bench.main(argv) stops with (faults.run_script prints it, no traceback)."""
    with pytest.raises(SystemExit) as stop:
        bench.main(TINY + argv)
    line = stop.value.code
    assert isinstance(line, str) and line.startswith("error: ") and "\n" not in line, line
    return line


def refusal(**values):
    """settings.check_values' message for the default settings with `values`: what train.py says."""
    defaults, _ = configure(settings.TRAINING, [])
    with pytest.raises(ConfigError) as refused:
        settings.check_values({**defaults, **values})
    return str(refused.value)


MUON = ["--optimizer=muon"]
INTERLEAVED = [
    "--pp=2",
    "--n_layer=4",
    "--pp_layers=2,2",
    "--gradient_accumulation_steps=4",
    "--schedules=1f1b,interleaved_1f1b:2",
]


@pytest.mark.parametrize(
    "argv,flag,variant",
    [
        (
            MUON + ["--compare_zero_stage=4"],
            "compare_zero_stage",
            dict(optimizer="muon", zero_stage=4),
        ),
        (["--compare_optimizer=sgd"], "compare_optimizer", dict(optimizer="sgd")),
        # (once an IndexError from the pipeline's cut: pp_layers names 2 stages, interleaving makes
        # 4)
        (INTERLEAVED, "schedules", dict(pp=2, n_layer=4, pp_layers="2,2", pp_chunks=2)),
    ],
)
def test_a_compared_column_train_py_refuses_stops_before_anything_runs_with_its_message(
    argv, flag, variant, monkeypatch
):
    """A compared column picotron refuses (a ZeRO stage or an optimizer it does not have, a pipeline
    cut that does not fit): refused by the check train.py applies, in its words, naming the flag,
    before setup."""
    monkeypatch.setattr(build, "setup", lambda *a, **k: pytest.fail("setup ran: nothing should"))
    line = error_of(argv)
    assert refusal(**variant) in line
    assert f"--{flag}" in line


def test_each_compared_column_is_labelled_by_the_settings_it_runs_with():
    """The label is read from the column's settings, which differ from the run's in one setting."""
    cfg, args = bench.parse_args(
        TINY
        + MUON
        + [
            "--compare_zero_stage=1",
            "--eot_token=3",
            "--compare_doc_mask=True",
            "--compare_fp8=True",
        ]
    )
    _, by_optimizer = bench.parse_args(TINY + ["--eot_token=3", "--compare_optimizer=muon"])
    columns = {**args.compared, **by_optimizer.compared}
    expected = {
        "compare_zero_stage": ("ZeRO-1", {"zero_stage": 1}),
        "compare_doc_mask": ("doc_mask=True", {"doc_mask": True}),
        "compare_fp8": ("fp8=tensorwise", {"fp8": "tensorwise"}),
        "compare_optimizer": ("muon", {"optimizer": "muon"}),
    }
    ours = {flag: vars(cfg) for flag in expected}
    ours["compare_optimizer"] = {**vars(cfg), "optimizer": "adamw"}  # (that run's own: the default)
    for flag, (label, other) in columns.items():
        changed = {k: v for k, v in vars(other).items() if ours[flag][k] != v}
        assert (label, changed) == expected[flag], flag
    assert set(columns) == set(expected)


def test_the_compared_zero_stage_times_both_and_names_each_by_its_stage(capsys):
    bench.main(TINY + MUON + ["--compare_zero_stage=1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("ZeRO-0 against ZeRO-1: "), lines[-2]
    assert any(line.split() == ["picotron", "ZeRO-1"] for line in lines)
    result = json.loads(lines[-1][len("RESULT ") :])
    assert (result["zero_stage"], result["compare_zero_stage"]) == (0, 1)
    assert result["compare_tokens_per_sec"] > 0


def fp8_at_float64():
    check_fp8("tensorwise", torch.device("cpu"), torch.float64)


def doc_mask_without_eot():
    check_layout(
        ModelConfig(
            block_size=32,
            vocab_size=512,
            n_layer=2,
            n_head=4,
            n_kv_head=4,
            n_embd=64,
            doc_mask=True,
        )
    )


@pytest.mark.parametrize(
    "argv,check",
    [
        (["--dtype=float64", "--compare_fp8=True"], fp8_at_float64),
        (["--compare_doc_mask=True"], doc_mask_without_eot),
    ],
)
def test_a_compared_column_that_cannot_run_ends_in_one_line_before_any_is_built(
    argv, check, monkeypatch
):
    """fp8 at float64, or doc_mask without an end-of-text id: build.setup's own check, its message
    in one line naming the flag (once a traceback from inside the timed run), before any model is
    built."""
    monkeypatch.setattr(build, "build", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(ValueError) as expected:
        check()
    line = error_of(argv)
    assert str(expected.value) in line
    assert argv[-1].split("=")[0] in line


def test_a_schedule_the_layout_cannot_hold_is_refused_before_any_model_is_built(monkeypatch):
    """--schedules=interleaved_1f1b:2 on 2 blocks at pp = 2 (4 stages): check_layout's message,
    naming the schedule, from main's checks (once a traceback from each rank's timed run). The
    layout build.setup would build under torchrun is given here by hand: no process is launched."""
    monkeypatch.setattr(build, "build", lambda *a, **k: pytest.fail("a model was built"))
    cfg, args = bench.parse_args(
        TINY + ["--pp=2", "--gradient_accumulation_steps=4", "--schedules=1f1b,interleaved_1f1b:2"]
    )
    model_cfg = ModelConfig(
        block_size=32, vocab_size=512, n_layer=2, n_head=4, n_kv_head=4, n_embd=64
    )
    setup = SimpleNamespace(
        model_cfg=model_cfg,
        layout=SimpleNamespace(tp=1, pp=2, cp=1, ep=1),
        dev=torch.device("cpu"),
        dtype=torch.float32,
    )
    with pytest.raises(ValueError) as stop:
        bench.timed_columns(cfg, args, setup)
    assert str(stop.value).startswith("--schedules=interleaved_1f1b:2 would time ")
    assert "pp * pp_chunks <= 2" in str(stop.value)


def test_a_machine_file_that_is_not_a_machine_stops_bench_before_any_step(tmp_path, monkeypatch):
    """--machine=FILE.json is read with the settings (it was read after the timed steps, and a bad
    one ended the benchmark in a traceback)."""
    bad = tmp_path / "box.json"
    bad.write_text(json.dumps({"matmul_flops": {"float32": "fast"}}))
    monkeypatch.setattr(build, "setup", lambda *a, **k: pytest.fail("setup ran: nothing should"))
    line = error_of([f"--machine={bad}"])
    assert str(bad) in line and "matmul_flops.float32" in line, line
