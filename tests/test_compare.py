"""scripts/compare.py tells rounding from a real difference: a tensor-parallel linear whose weight gradient is
doubled at tp = 2 only (tests/broken_train.py, the test's own copy of train.py) is called a real difference
and named first; tp = 2 against pp = 2 under ZB-V, two layouts that only sum in other orders, is rounding."""
import sys

import pytest

from dist_utils import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import compare  # noqa: E402

TINY = ["--n_layer=4", "--n_embd=32", "--n_head=4", "--n_kv_head=2", "--block_size=16", "--batch_size=2",
        "--gradient_accumulation_steps=2", "--max_iters=4", "--warmup_iters=1", "--lr_decay_iters=10",
        "--learning_rate=3e-3", "--bucket_size_mb=0.01", "--peak_flops=1e12"]
BROKEN = "blocks.1.mlp.up.weight"  # a ColumnParallelLinear's weight


def listed_after(text, heading):
    """The parameter names listed under the first line of `text` that starts with `heading`."""
    lines = text.split(heading, 1)[1].splitlines()[1:]
    return [line.split(":")[0].strip() for line in lines if line.startswith("  ")]


def test_a_gradient_doubled_at_tp2_is_a_real_difference_and_named_first(data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DOUBLE_GRADIENT_AT_TP2", BROKEN)
    status = compare.main(TINY + [f"--data_dir={data_dir}", "--a=--tp=2", "--b=", "--script=tests/broken_train.py",
                                  f"--work_dir={tmp_path}"])
    out = capsys.readouterr().out
    print(out)
    assert status == 1
    assert "float32: the runs part at step 1" in out  # the gradient norm moves at once
    assert listed_after(out, "float32: the runs part")[0] == BROKEN
    assert "verdict: a real difference" in out
    assert listed_after(out, "verdict: a real difference")[0] == BROKEN


def test_tp2_against_pp2_zbv_is_rounding(data_dir, tmp_path, capsys):
    status = compare.main(TINY + [f"--data_dir={data_dir}", "--a=--tp=2 --sequence_parallel=True",
                                  "--b=--pp=2 --pp_schedule=zbv --pp_chunks=2", f"--work_dir={tmp_path}"])
    out = capsys.readouterr().out
    print(out)
    assert "float32: the runs agree within the tolerances" in out
    assert "verdict: rounding" in out and status == 0


def test_a_setting_that_does_not_exist_stops_before_any_run(data_dir, capsys):
    with pytest.raises(SystemExit, match="unknown config key 'tpp'"):
        compare.main(TINY + [f"--data_dir={data_dir}", "--a=--tpp=2", "--b="])
