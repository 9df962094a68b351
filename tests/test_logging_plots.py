"""The optional logging backends (W&B, TensorBoard) record what metrics.jsonl records, the progress
line shows an ETA, tools/plot.py draws runs from their metrics.jsonl, and metrics.jsonl survives a
kill in the middle of a write and a new run in the same out_dir.

Each backend's own files are read back (W&B's offline run file, TensorBoard's event file), so the
test checks what the backend stored, not what train.py meant to send it.
"""

import glob
import importlib.util
import json
import os
import struct

import pytest

from tools import plot
import metrics
import train
from dist_utils import make_token_data, run_train, train_in_process

HAVE = {p: importlib.util.find_spec(p) is not None for p in ("wandb", "tensorboard", "matplotlib")}


def skip_without(package):
    return pytest.mark.skipif(
        not HAVE[package], reason=f"{package} is not installed (pip install {package})"
    )


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """One 3-step run with every installed backend on: (out_dir, metrics.jsonl records, stdout,
    wandb dir)."""
    tmp = tmp_path_factory.mktemp("logging")
    data = make_token_data(str(tmp / "data"))
    out = tmp / "run"
    argv = [
        f"--data_dir={data}",
        f"--out_dir={out}",
        "--n_layer=2",
        "--n_embd=64",
        "--n_head=4",
        "--block_size=32",
        "--batch_size=2",
        "--max_iters=3",
        "--log_interval=1",
        "--eval_interval=3",
        "--eval_iters=2",
        "--checkpoint_interval=0",
        "--device=cpu",
        f"--wandb_log={HAVE['wandb']}",
        f"--tensorboard_log={HAVE['tensorboard']}",
        "--wandb_project=picotron-test",
        "--wandb_run_name=three-steps",
    ]
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp), "WANDB_SILENT": "true"}
    records, proc = run_train(argv, env=env)
    return out, records, proc.stdout, tmp / "wandb"


def metric(records, key):
    return {r["step"]: r[key] for r in records if key in r}


def wandb_history(run_file):
    """The logged rows of an offline W&B run file. The file is a 7-byte header, then a LevelDB-style
    log in 32 KiB blocks: each chunk has a 4-byte checksum, a 2-byte length and a 1-byte type (1
    full, 2 first, 3 middle, 4 last), and the chunks of a record carry one serialized protobuf
    Record."""
    from wandb.proto import wandb_internal_pb2

    data = open(run_file, "rb").read()
    assert data[:4] == b":W&B"
    rows, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's last few bytes are padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        item.key or "/".join(item.nested_key): json.loads(item.value_json)
                        for item in record.history.item
                    }
                )
    return rows


@skip_without("wandb")
def test_wandb_offline_records_the_loss_of_each_step(logged_run):
    out, records, _, wandb_dir = logged_run
    run_files = glob.glob(str(wandb_dir / "offline-run-*" / "run-*.wandb"))
    assert len(run_files) == 1
    rows = wandb_history(run_files[0])
    logged = {row["_step"]: row["loss"] for row in rows if "loss" in row}
    assert logged == pytest.approx(metric(records, "loss"), rel=1e-12)
    assert sorted(logged) == [1, 2, 3]
    assert any(row.get("val_loss") == pytest.approx(metric(records, "val_loss")[3]) for row in rows)


@skip_without("tensorboard")
def test_tensorboard_records_the_loss_of_each_step(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, records, _, _ = logged_run
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("loss")}
    assert logged == pytest.approx(metric(records, "loss"), rel=1e-6)  # TensorBoard stores float32
    assert sorted(logged) == [1, 2, 3]
    assert {e.step: e.value for e in events.Scalars("val_loss")} == pytest.approx(
        metric(records, "val_loss"), rel=1e-6
    )


def test_the_progress_line_shows_the_eta(logged_run):
    _, _, stdout, _ = logged_run
    lines = [line for line in stdout.splitlines() if "ms/step" in line]
    assert len(lines) == 3 and all(" | eta " in line for line in lines)


def test_format_duration():
    assert [metrics.format_duration(s) for s in (7, 95, 3725, 90000)] == [
        "7s",
        "1m35s",
        "1h02m",
        "25h00m",
    ]


@pytest.mark.parametrize(
    "flag,package", [("wandb_log", "wandb"), ("tensorboard_log", "tensorboard")]
)
def test_a_missing_backend_stops_at_start_up_with_the_pip_command(
    tmp_path, monkeypatch, flag, package
):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == package else real_find_spec(name, *a),
    )
    with pytest.raises(SystemExit, match=f"pip install {package}"):
        train.main([f"--{flag}=True", f"--out_dir={tmp_path / 'run'}", "--device=cpu"])
    assert not os.path.exists(tmp_path / "run")  # stopped before anything was written


# a log as a run writes it
LINES = [json.dumps({"step": s, "loss": 6.0 / s}) + "\n" for s in (1, 2, 3)]


def test_a_resume_drops_a_torn_last_line_of_the_log_with_a_one_line_warning(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    # killed in the middle of step 4's line
    path.write_text("".join(LINES) + '{"step": 4, "loss": 1.')
    metrics.MetricsLog(str(tmp_path), 0, resume_step=3)
    assert path.read_text() == "".join(LINES)
    assert capsys.readouterr().out == (
        f"warning: the last line of {path} (line 4) is cut short, as a kill in the "
        f"middle of a write leaves it: dropped it\n"
    )


def test_a_resume_keeps_a_whole_last_line_that_lost_only_its_newline(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(LINES).rstrip("\n"))
    log = metrics.MetricsLog(str(tmp_path), 0, resume_step=4)
    log.write({"step": 4, "loss": 1.5})
    assert path.read_text() == "".join(LINES) + json.dumps({"step": 4, "loss": 1.5}) + "\n"


def test_a_torn_line_in_the_middle_of_the_log_stops_the_resume_naming_the_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    damaged = LINES[0] + '{"step": 2, "lo\n' + LINES[2]
    path.write_text(damaged)
    with pytest.raises(metrics.LogError) as stop:
        metrics.MetricsLog(str(tmp_path), 0, resume_step=3)
    assert str(stop.value) == (
        f'{path} line 2 is not a whole record (it begins \'{{"step": 2, "lo\'), and records '
        f"follow it: the file is damaged. Delete or mend that line, or move the file aside to "
        f"start a new log, then resume again"
    )
    assert path.read_text() == damaged  # left as it was, for the user to see


def test_plot_reads_a_log_whose_last_line_a_kill_cut_off_as_the_resume_does(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    torn = "".join(LINES) + '{"step": 4, "loss": 1.'  # killed in the middle of step 4's line
    path.write_text(torn)
    assert plot.read_metrics(str(tmp_path)) == [json.loads(line) for line in LINES]
    warning = (
        f"warning: the last line of {path} (line 4) is cut short, as a kill in the middle "
        f"of a write leaves it: dropped it\n"
    )
    assert capsys.readouterr().out == warning
    assert path.read_text() == torn  # plotting changes no file


@skip_without("matplotlib")
def test_plot_stops_at_a_torn_line_in_the_middle_of_the_log_naming_the_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(LINES[0] + '{"step": 2, "lo\n' + LINES[2])
    with pytest.raises(SystemExit) as stop:
        plot.main([str(tmp_path), f"--out={tmp_path / 'x.png'}"])
    assert stop.value.code == (
        f"error: {path} line 2 is not a whole record (it begins "
        f'\'{{"step": 2, "lo\'), and records follow it: the file is '
        f"damaged. Delete or mend that line"
    )
    assert not os.path.exists(tmp_path / "x.png")


def test_a_log_that_cannot_be_written_at_start_up_stops_in_one_line(tmp_path, monkeypatch):
    import errno

    def full_disk(path, mode="r", *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(metrics, "open", full_disk, raising=False)  # metrics.py's own `open` only
    with pytest.raises(metrics.LogError) as stop:
        metrics.MetricsLog(str(tmp_path), 0)
    assert str(stop.value) == (
        f"cannot write the log {tmp_path / 'metrics.jsonl'} (OSError: [Errno 28] No space left "
        f"on device): free space on its disk (or fix the permissions of out_dir), then launch "
        f"again"
    )


def test_a_new_run_moves_an_earlier_run_s_log_aside_and_keeps_it(data_dir, tmp_path, capsys):
    """An out_dir without checkpoints (a finished run with checkpoint_interval=0, or one that died
    before its first save), with two earlier runs' logs: the new run writes its own, and overwrites
    neither."""
    earlier, before = tmp_path / "metrics.jsonl", tmp_path / "metrics.1.jsonl"
    earlier.write_text("".join(LINES))
    before.write_text(LINES[0])
    records = train_in_process(
        [
            f"--data_dir={data_dir}",
            f"--out_dir={tmp_path}",
            "--n_layer=1",
            "--n_embd=32",
            "--n_head=2",
            "--n_kv_head=2",
            "--block_size=16",
            "--batch_size=2",
            "--max_iters=1",
            "--eval_interval=0",
            "--checkpoint_interval=0",
            "--peak_flops=1e12",
            "--device=cpu",
        ]
    )
    assert [r["step"] for r in records] == [1]  # the new run's own log
    assert (tmp_path / "metrics.2.jsonl").read_text() == "".join(
        LINES
    ) and before.read_text() == LINES[0]
    assert (
        f"log: {earlier} held an earlier run's log (out_dir has no checkpoint to resume): moved it "
        f"to {tmp_path / 'metrics.2.jsonl'}\n"
    ) in capsys.readouterr().out


@skip_without("matplotlib")
def test_plot_writes_a_png_comparing_two_runs(tmp_path):
    for name, scale in (("a", 1.0), ("b", 0.8)):
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            for step in range(1, 6):
                f.write(
                    json.dumps(
                        {
                            "step": step,
                            "loss": scale * 6 / step,
                            "lr": 1e-3 * step / 5,
                            "grad_norm": 1.0 / step,
                            "tokens_per_sec": 1000.0 + step,
                            "ms_per_step": 20.0,
                        }
                    )
                    + "\n"
                )
            f.write(
                json.dumps({"step": 5, "train_loss": scale * 1.3, "val_loss": scale * 1.4}) + "\n"
            )
    out = tmp_path / "compare.png"
    plot.main([str(tmp_path / "a"), str(tmp_path / "b"), f"--out={out}"])
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out) > 10_000


@skip_without("matplotlib")  # without it tools/plot.py stops first, saying so (the next test)
def test_plot_names_a_run_without_metrics(tmp_path):
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        plot.main([str(tmp_path), f"--out={tmp_path / 'x.png'}"])


@skip_without("matplotlib")
def test_a_trace_box_is_labelled_only_where_its_label_fits_inside_it():
    # one rank's step: long forwards and backwards, weight gradients a tenth of a forward (a CPU's)
    spans, t = [], 0.0
    for i in range(8):
        for op, dur in (("F", 2000.0), ("B", 3000.0), ("W", 200.0)):
            spans.append(
                {"name": f"{op}{i}", "cat": op, "ph": "X", "pid": 0, "tid": 0, "ts": t, "dur": dur}
            )
            t += dur
    trace = {
        "traceEvents": spans,
        "otherData": {
            "step": 2,
            "schedule": "zero_bubble",
            "pp": 1,
            "microbatches": 8,
            "chunks": 1,
            "measured_bubble": [0.0],
            "ideal_bubble": 0.0,
            "device": "cpu",
        },
    }
    fig = plot.draw_trace(trace)
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    boxes = {
        e["name"]: ax.transData.transform([(e["ts"] / 1e3, 0), ((e["ts"] + e["dur"]) / 1e3, 0)])[
            :, 0
        ]
        for e in spans
    }
    drawn = {text.get_text(): text.get_window_extent(renderer) for text in ax.texts}
    # every W box is too narrow for its name
    assert set(drawn) == {f"{op}{i}" for op in "FB" for i in range(8)}
    for name, extent in drawn.items():
        left, right = boxes[name]
        assert left < extent.x0 and extent.x1 < right, name


@skip_without("matplotlib")
def test_plot_draws_the_predicted_step_over_the_measured_one_on_one_time_axis(tmp_path):
    from tools import step_time, timeline

    predicted = tmp_path / "predicted.json"
    step_time.main(
        ["--n_layer=4", "--n_embd=64", "--n_head=4", "--vocab_size=512", "--block_size=64"]
        + ["--pp=2", "--nproc=2", "--gradient_accumulation_steps=4", "--machine=a100"]
        + [f"--trace={predicted}"]
    )
    # a measured 1F1B step on two ranks (synthetic), 1 s an action: longer than the prediction
    ops = [
        ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],
        ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"],
    ]
    spans = [
        [(name, name[0], 0, r + k, r + k + 1, {}) for k, name in enumerate(names)]
        for r, names in enumerate(ops)
    ]
    info = {"step": 2, "schedule": "1f1b", "pp": 2, "microbatches": 4, "chunks": 1}
    info.update(measured_bubble=[0.1, 0.1], ideal_bubble=0.2, device="cpu")
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps(timeline.chrome_trace(spans, [{0: "chunk 0"}] * 2, info)))
    out = tmp_path / "step.png"
    plot.main([f"--trace={measured}", f"--predicted={predicted}", f"--out={out}"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = plot.draw_trace(plot.read_trace(str(measured)), plot.read_trace(str(predicted)))
    top, bottom = fig.axes
    assert top.get_title().startswith("predicted: 1f1b") and bottom.get_title().startswith(
        "measured: 1f1b"
    )
    assert top.get_xlim() == bottom.get_xlim() and bottom.get_xlim()[1] >= 9000  # ms


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a),
    )
    with pytest.raises(
        SystemExit,
        match="tools/plot.py needs matplotlib, which is not installed: pip install matplotlib",
    ):
        plot.main([str(tmp_path), f"--out={tmp_path / 'x.png'}"])


def test_no_optional_package_is_imported_by_picotron_at_start_up():
    """Importing every picotron module, and parsing a config, must not pull in an optional package:
    they are imported only when a setting or a command asks for them."""
    import subprocess
    import sys
    from conftest import ROOT

    code = (
        "import sys; "
        "import train, model, parallel, checkpoint, configurator, prepare_data, export_hf; "
        "from tools import plot, make_config, bench; "
        "print(sorted(m for m in ('transformers', 'safetensors', 'wandb', 'tensorboard', "
        "'matplotlib', 'flash_attn') if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert proc.stdout.strip() == "[]"
