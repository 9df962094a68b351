"""scripts/compare.py tells rounding from a real difference: a tensor-parallel linear whose weight
gradient is doubled at tp = 2 only (tests/broken_train.py, the test's own copy of train.py) is
called a real difference and named first; tp = 2 against pp = 2 under ZB-V, two layouts that only
sum in other orders, is rounding. Its exit status says which (0 rounding, 1 a real difference, 2 no
comparison), and so does its last line."""

import sys

import settings
from configurator import configure
from dist_utils import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import compare  # noqa: E402

TINY = [
    "--n_layer=4",
    "--n_embd=32",
    "--n_head=4",
    "--n_kv_head=2",
    "--block_size=16",
    "--batch_size=2",
    "--gradient_accumulation_steps=2",
    "--max_iters=4",
    "--warmup_iters=1",
    "--lr_decay_iters=10",
    "--learning_rate=3e-3",
    "--bucket_size_mb=0.01",
    "--peak_flops=1e12",
]
BROKEN = "blocks.1.mlp.up.weight"  # a ColumnParallelLinear's weight


def listed_after(text, heading):
    """The parameter names listed under the first line of `text` that starts with `heading`."""
    lines = text.split(heading, 1)[1].splitlines()[1:]
    return [line.split(":")[0].strip() for line in lines if line.startswith("  ")]


def test_a_gradient_doubled_at_tp2_is_a_real_difference_and_named_first(
    data_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("DOUBLE_GRADIENT_AT_TP2", BROKEN)
    status = compare.main(
        TINY
        + [
            f"--data_dir={data_dir}",
            "--a=--tp=2",
            "--b=",
            "--script=tests/broken_train.py",
            f"--work_dir={tmp_path}",
        ]
    )
    out = capsys.readouterr().out
    print(out)
    assert status == 1 and out.splitlines()[-1] == "compare: exit 1: a real difference"
    assert "float32: the runs part at step 1" in out  # the gradient norm moves at once
    assert listed_after(out, "float32: the runs part")[0] == BROKEN
    assert "verdict: a real difference" in out
    assert listed_after(out, "verdict: a real difference")[0] == BROKEN


def readme_command():
    """The words after `python scripts/compare.py` of the README's command: tests/test_readme.py
    leaves its run to the test below (four torchrun launches, a minute and more of the suite)."""
    from test_readme import README, shown_commands

    [words] = [w for _, w in shown_commands(README.read_text()) if w[1:2] == ["scripts/compare.py"]]
    return words[2:]


def test_the_readmes_tp2_against_pp2_zbv_is_rounding(data_dir, tmp_path, capsys):
    """The README's command as written (tp = 2 against pp = 2 under ZB-V on the quick start's
    config), cut to TINY after its own words."""
    argv = readme_command()
    assert argv[1:] == ["--a=--tp=2", "--b=--pp=2 --pp_schedule=zbv --pp_chunks=2"], argv
    status = compare.main(argv + TINY + [f"--data_dir={data_dir}", f"--work_dir={tmp_path}"])
    out = capsys.readouterr().out
    print(out)
    assert "float32: the runs agree within the tolerances" in out
    assert "verdict: rounding" in out and status == 0
    assert out.splitlines()[-1] == "compare: exit 0: the same model up to rounding"
    # a line as each of its steps ends: float32 the 4 steps asked, float64 the first 3 (they agree)
    lines = out.splitlines()
    assert [
        sum(line.startswith(f"{run}: step") for line in lines)
        for run in ("float32 a", "float32 b", "float64 a", "float64 b")
    ] == [4, 4, 3, 3]


def test_a_setting_that_does_not_exist_stops_before_any_run_with_exit_status_2(
    data_dir, tmp_path, capsys
):
    status = compare.main(
        TINY + [f"--data_dir={data_dir}", "--a=--tpp=2", "--b=", f"--work_dir={tmp_path}"]
    )
    out, err = capsys.readouterr()
    assert status == 2 and "error: unknown config key 'tpp'" in err
    assert out.splitlines()[-1] == "compare: exit 2: the comparison could not be made"
    assert list(tmp_path.iterdir()) == []  # no run started


def test_a_run_that_fails_stops_the_comparison_with_its_output_and_exit_status_2(tmp_path, capsys):
    status = compare.main(
        TINY + [f"--data_dir={tmp_path / 'none'}", "--a=", "--b=", f"--work_dir={tmp_path}"]
    )
    out, err = capsys.readouterr()
    assert status == 2 and "error: the run float32 " in err and "failed (exit status 1)" in err
    # the run's own error, quoted
    assert f"{tmp_path / 'none'}" in err.split("failed (exit status 1)")[1]
    assert out.splitlines()[-1] == "compare: exit 2: the comparison could not be made"


def test_the_config_file_cannot_undo_the_scripts_defaults_and_the_users_flags_replace_them():
    """The README's command trains 10 steps without evaluation, not its config's 300 steps."""

    def run_settings(*argv):
        values, _ = configure(settings.TRAINING, compare.with_defaults(list(argv)))
        return values["max_iters"], values["eval_interval"]

    # the config says 300 and 100
    assert run_settings("config/tiny_fineweb.py", "--tp=2") == (
        10,
        0,
    )
    assert run_settings("config/tiny_fineweb.py", "--max_iters=4", "--eval_interval=2") == (4, 2)
    # train.py's order: the file last
    assert run_settings("--max_iters=4", "config/tiny_fineweb.py") == (
        300,
        0,
    )
