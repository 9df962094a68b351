"""Bad input never trains silently, and always ends in one line that says what is wrong, not a
traceback.

Each case calls the tool's main(argv) in this process and reads the line it exits with; one
subprocess per tool shows what a user sees (no traceback). Under torchrun the line is printed once,
and no rank is left waiting for one that stopped: the multi-rank cases share one 2-rank launch
(run_ranks), plus one torchrun launch for a checkpoint write that fails on one rank."""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import fields

import numpy as np
import pytest
import torch

from conftest import ROOT, needs_gpt2
from dist_utils import main_exit_and_output, make_token_data, run_ranks

from tools import bench
import checkpoint
import export_hf
from tools import make_config
import metrics
import sample
import settings
from configurator import configure
from data import TRAIN_STREAM, _prepare_hint, load_data, read_data_meta, window_starts
import train
from settings import check_layout
from model import ModelConfig, Transformer, model_config_from
from parallel import resolve_dp
from pipeline_schedules import check_schedule

TINY = [
    "--n_layer=2",
    "--n_head=4",
    "--n_kv_head=2",
    "--n_embd=64",
    "--block_size=32",
    "--batch_size=4",
    "--eval_interval=0",
    "--log_interval=1",
    "--device=cpu",
]
BAD_ID = 600  # the token data below has a vocabulary of 512


def error_of(main, argv):
    """The one line main(argv) stops with."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    line = stop.value.code
    assert isinstance(line, str) and line.startswith("error: ") and "\n" not in line, line
    return line


def records_of(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory):
    return make_token_data(str(tmp_path_factory.mktemp("tokens")))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, token_dir):
    """A 2-layer run of 2 steps from a config file that sets data_dir and learning_rate, with a
    checkpoint at each step. Tests resume copies of it."""
    base = tmp_path_factory.mktemp("trained")
    config = base / "run_config.py"
    config.write_text(
        f"data_dir = {token_dir!r}\nlearning_rate = 2e-3\nwarmup_iters = 0\nkeep_last_n = 5\n"
    )
    out = base / "run"
    train.main(
        [
            str(config),
            f"--out_dir={out}",
            *TINY,
            "--max_iters=2",
            "--lr_decay_iters=10",
            "--checkpoint_interval=1",
        ]
    )
    return out


@pytest.fixture
def run_copy(trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


# --- settings -------------------------------------------------------------------------------------


def test_a_setting_whose_default_is_none_is_type_checked():
    line = error_of(train.main, ["--vocab_size=abc"])
    assert "config key 'vocab_size' must be of type int or None, got 'abc'" in line


@pytest.mark.parametrize(
    "arg,message",
    [
        ("--batch_size=0", "batch_size = 0 must be positive"),
        ("--block_size=-8", "block_size = -8 must be positive"),
        ("--log_interval=0", "log_interval = 0 must be positive"),
        ("--max_iters=0", "max_iters = 0 trains nothing"),
        ("--eval_iters=0", "eval_iters = 0 must be positive"),
        ("--checkpoint_interval=-1", "checkpoint_interval = -1 must not be negative"),
        ("--seed=-1", "seed = -1 must not be negative"),
        ("--beta2=1.0", "beta2 = 1.0 must be in [0, 1)"),
        ("--out_dir=", "out_dir is empty"),
        ("--out_dir= ", "out_dir is empty"),
    ],
)
def test_a_size_or_interval_out_of_range_is_an_error_naming_the_setting(arg, message, tmp_path):
    argv = [f"--out_dir={tmp_path}", arg]
    assert message in error_of(train.main, argv)
    assert message in error_of(bench.main, argv)


def test_a_config_file_with_a_syntax_error_names_the_file_and_line(tmp_path):
    config = tmp_path / "broken.py"
    config.write_text("n_layer = 2\nbatch_size = (3\n")
    assert f"config file {config}, line 2: '(' was never closed" in error_of(
        train.main, [str(config)]
    )
    config.write_text("n_layer = 2\n\nn_embd = 1 / 0\n")
    assert f"config file {config}, line 3: ZeroDivisionError" in error_of(train.main, [str(config)])


def test_a_config_line_that_sets_nothing_is_refused_naming_the_line_and_what_to_write(tmp_path):
    config = tmp_path / "yaml_habit.py"
    config.write_text('"""Two layers."""\nbatch_size = 4\nn_layer: 2\n')  # python ignores line 3
    assert error_of(train.main, [str(config)]) == (
        f"error: config file {config}, line 3: `n_layer: 2` is an annotation and sets nothing (a "
        f"config file is python, not YAML): write `n_layer = 2`"
    )
    config.write_text("if True:\n    n_layer == 2\n")
    assert (
        f"config file {config}, line 2: `n_layer == 2` computes a value and sets nothing: "
        f"assign the setting, as in `n_layer = 2`"
    ) in error_of(train.main, [str(config)])


def test_an_annotated_assignment_with_a_value_sets_the_setting(tmp_path):
    config = tmp_path / "annotated.py"
    config.write_text('"""A docstring is kept."""\nn_layer: int = 2\nprint("a call is kept")\n')
    values, given = configure(settings.TRAINING, [str(config)])
    assert values["n_layer"] == 2 and "n_layer" in given


@pytest.mark.parametrize(
    "tool,setting",
    [
        (train, "  --batch_size=8"),
        (bench, "  --bench_steps=10"),
        (make_config, "  --nproc=1"),
        (sample, "  --num_samples=3"),
        (export_hf, "  --hf_dir='hf'"),
    ],
)
def test_help_lists_every_setting_with_its_default_and_meaning(tool, setting, capsys):
    with pytest.raises(SystemExit) as stop:
        tool.main(["--help"])
    assert stop.value.code in (0, None)
    text = capsys.readouterr().out
    assert setting in text
    if tool in (train, bench, make_config):  # the training settings, under their banners
        assert "# the optimizer and the learning-rate schedule" in text
        for s in settings.TRAINING:
            assert f"  --{s.name}={s.default!r}".ljust(34) + f"  {s.meaning}" in text


@pytest.mark.parametrize("tool", [train, bench, make_config, sample, export_hf])
def test_help_shows_the_usage_lines_as_the_file_writes_them(tool, capsys):
    # a shell continuation (a backslash at the end of a line) in a docstring that is not raw joins
    # the two lines, with the next one's indent, into one long line
    with pytest.raises(SystemExit):
        tool.main(["--help"])
    usage = capsys.readouterr().out.split("\n# ")[0]  # what comes before the first settings banner
    source = set(open(tool.__file__).read().splitlines())
    assert [line for line in usage.strip().splitlines() if line not in source] == []


def test_a_type_error_quotes_the_value_given_and_the_one_it_replaces_with_their_sources(tmp_path):
    config = tmp_path / "run_config.py"
    config.write_text("max_iters = 300\n")
    line = error_of(train.main, [str(config), "--max_iters=3e2"])
    # not "like its default 1000": the user wrote 300
    assert line == (
        f"error: config key 'max_iters' must be of type int like 300 (from {config}), got 300.0 of "
        "type float (from --max_iters=3e2)"
    )
    line = error_of(train.main, ["--max_iters=3e2"])
    assert (
        "must be of type int like its default 1000, got 300.0 of type float (from --max_iters=3e2)"
        in line
    )


def test_a_bool_given_for_a_number_is_told_the_number_s_type(tmp_path):
    config = tmp_path / "run_config.py"
    config.write_text("max_iters = True\n")
    line = error_of(train.main, [str(config)])
    assert line == (
        "error: config key 'max_iters' must be of type int like its default 1000, got True of type "
        f"bool (from {config})"
    )
    assert (
        "learning_rate' must be of type float like its default 0.001, got False of type bool"
        in error_of(train.main, ["--learning_rate=False"])
    )


@pytest.mark.parametrize(
    "text,arg,message",
    [
        ("learning_rate = float('nan')\n", None, "learning_rate = nan must be a finite number"),
        ("min_lr = float('inf')\n", None, "min_lr = inf must be a finite number"),
        # python reads 1e999 as inf
        ("", "--grad_clip=1e999", "grad_clip = inf must be a finite number"),
    ],
)
def test_a_number_that_is_not_finite_stops_at_the_check(text, arg, message, tmp_path):
    config = tmp_path / "run_config.py"
    config.write_text(text)
    for tool in (train, bench, make_config):
        assert error_of(tool.main, [str(config), *([arg] if arg else [])]) == f"error: {message}"


def test_min_lr_above_learning_rate_stops_naming_both():
    line = error_of(train.main, ["--learning_rate=1e-3", "--min_lr=1.0"])
    assert line.startswith(
        "error: min_lr = 1.0 is above learning_rate = 0.001: the decay would raise the learning "
        "rate"
    )
    # equal: held
    assert settings.check_values({**settings.DEFAULTS, "learning_rate": 1e-3, "min_lr": 1e-3}) == []


def test_warmup_reaching_lr_decay_iters_is_a_one_line_warning_in_every_tool(
    token_dir, tmp_path, capsys
):
    argv = ["--warmup_iters=50", "--lr_decay_iters=30", "--max_iters=100"]
    warning = (
        "warning: warmup_iters = 50 is not below lr_decay_iters = 30: the learning rate climbs for "
        "50 steps, then drops to min_lr = 0.0001 in one step, with no decay"
    )
    # what the schedule does, by get_lr: the peak's last warm-up step, then min_lr at once
    lr_cfg = train.SimpleNamespace(
        **{**settings.DEFAULTS, "warmup_iters": 50, "lr_decay_iters": 30}
    )
    assert (train.get_lr(49, lr_cfg), train.get_lr(50, lr_cfg)) == (1e-3 * 50 / 51, 1e-4)
    _, notes, _ = train.configure_run(argv)
    assert [n for n in notes if n.startswith("warning:")] == [
        warning + " (lower --warmup_iters, or decay over the run: --lr_decay_iters=100)"
    ]
    make_config.main(
        [*argv, "--n_layer=2", "--n_embd=64", "--vocab_size=512", f"--out={tmp_path / 'c.py'}"]
    )
    assert capsys.readouterr().out.count(warning) == 1
    # the run ends before the drop: nothing to warn about
    assert (
        settings.check_values(
            {**settings.DEFAULTS, "warmup_iters": 50, "lr_decay_iters": 30, "max_iters": 40}
        )
        == []
    )


# --- resuming checks what it resumes --------------------------------------------------------------


@pytest.mark.parametrize(
    "args,message",
    [
        (["--n_layer=1"], "n_layer = 1 (the checkpoint has 2)"),
        (["--norm=layernorm"], "norm = 'layernorm' (the checkpoint has 'rmsnorm')"),
        (["--n_head=2"], "n_head = 2 (the checkpoint has 4)"),
        (
            ["--n_layer=3", "--mlp=gelu"],
            "n_layer = 3 (the checkpoint has 2); mlp = 'gelu' (the checkpoint has 'swiglu')",
        ),
    ],
)
def test_resume_refuses_another_architecture_naming_both_values(args, message, run_copy):
    line = error_of(
        train.main, [f"--out_dir={run_copy}", "--init_from=resume", "--max_iters=3", *args]
    )
    assert "another architecture" in line and message in line
    # nothing trained, nothing saved
    assert checkpoint.latest_checkpoint(str(run_copy)).endswith("ckpt_0000002")


def test_resume_without_the_config_file_keeps_its_data_dir_and_lr_and_prints_allowed_changes(
    run_copy, token_dir, capsys
):
    # data_dir and learning_rate came from the config file: left out now, they are the checkpoint's,
    # not train.py's defaults (data/fineweb_edu would not even exist here)
    train.main(
        [f"--out_dir={run_copy}", "--init_from=resume", "--max_iters=3", "--rope_theta=20000.0"]
    )
    out = capsys.readouterr().out
    assert "resume: max_iters = 3, the checkpoint's was 2" in out
    assert "resume: rope_theta = 20000.0, the checkpoint's was 10000.0" in out
    saved = checkpoint.read_meta(str(run_copy / "ckpt_0000003"))["config"]
    assert (
        saved["data_dir"] == token_dir
        and saved["learning_rate"] == 2e-3
        and saved["rope_theta"] == 20000.0
    )
    assert saved["n_layer"] == 2 and saved["n_kv_head"] == 2
    lr_cfg = train.SimpleNamespace(
        learning_rate=2e-3, min_lr=1e-4, warmup_iters=0, lr_decay_iters=10, lr_schedule="cosine"
    )
    assert records_of(run_copy)[-1]["lr"] == pytest.approx(train.get_lr(2, lr_cfg))


def test_a_changed_inherited_setting_and_the_new_global_batch_are_printed(run_copy, capsys):
    train.main([f"--out_dir={run_copy}", "--init_from=resume", "--max_iters=3", "--batch_size=2"])
    out = capsys.readouterr().out
    assert "resume: batch_size = 2, the checkpoint's was 4 (the run's recipe changes)" in out
    assert (
        "resume: the global batch is now 64 tokens per step, the checkpoint's run had 4 x 1 "
        "micro-batches x dp 1 x 32 = 128" in out
    )


def test_a_setting_missing_from_an_older_checkpoint_takes_its_default(run_copy):
    meta_path = run_copy / "ckpt_0000002" / "meta.json"
    meta = json.loads(meta_path.read_text())
    # as if saved before these settings existed
    for key in ("qk_norm", "router_z_loss_coef", "keep_last_n"):
        meta["config"].pop(key)
        meta["model"].pop(key, None)
    meta_path.write_text(json.dumps(meta))
    train.main([f"--out_dir={run_copy}", "--init_from=resume", "--max_iters=3"])
    saved = checkpoint.read_meta(str(run_copy / "ckpt_0000003"))["config"]
    assert (saved["qk_norm"], saved["router_z_loss_coef"], saved["keep_last_n"]) == (False, 0.0, 3)
    assert saved["learning_rate"] == 2e-3  # the settings it has are still inherited


def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_resumed(run_copy, capsys):
    rank_file = run_copy / "ckpt_0000002" / "rank00000.pt"
    size = rank_file.stat().st_size
    os.truncate(rank_file, 1000)
    train.main([f"--out_dir={run_copy}", "--init_from=resume", "--max_iters=2"])
    out = capsys.readouterr().out
    assert (
        f"resume: {run_copy / 'ckpt_0000002'} cannot be used: rank00000.pt has 1000 of its {size} "
        f"bytes; the newest complete checkpoint is {run_copy / 'ckpt_0000001'}"
    ) in out
    assert f"resumed from {run_copy / 'ckpt_0000001'} at step 1" in out
    assert [r["step"] for r in records_of(run_copy)] == [1, 2]


def test_an_unreadable_newest_checkpoint_is_named_and_the_previous_one_resumed(run_copy, capsys):
    # a checkpoint from before checksums (a damaged file with a crc32 stops instead:
    # test_checkpoint_integrity.py)
    meta_file = run_copy / "ckpt_0000002" / "meta.json"
    meta_file.write_text(
        json.dumps(
            {k: v for k, v in json.loads(meta_file.read_text()).items() if k != "file_crc32"}
        )
    )
    rank_file = run_copy / "ckpt_0000002" / "rank00000.pt"
    # the size it was saved with, but no zip archive
    rank_file.write_bytes(b"\0" * rank_file.stat().st_size)
    train.main([f"--out_dir={run_copy}", "--init_from=resume", "--max_iters=2"])
    out = capsys.readouterr().out
    assert f"checkpoint {run_copy / 'ckpt_0000002'} cannot be read on 1 rank(s) (checkpoint " in out
    assert f"falling back to {run_copy / 'ckpt_0000001'}" in out
    assert f"resumed from {run_copy / 'ckpt_0000001'} at step 1" in out


def test_resuming_a_finished_run_says_there_is_nothing_to_train(run_copy, capsys):
    train.main([f"--out_dir={run_copy}", "--init_from=resume"])
    assert (
        "at step 2, which is max_iters = 2 already: nothing to train (raise --max_iters"
        in capsys.readouterr().out
    )


# --- a schedule that needs a pipeline -------------------------------------------------------------


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("tool", [train, make_config, bench])
def test_zbv_at_pp_1_stops_at_start_up_naming_pp_and_the_schedule_settings(
    tool, chunks, token_dir, tmp_path
):
    own = {
        train: [f"--data_dir={token_dir}", f"--out_dir={tmp_path / 'run'}"],
        make_config: [f"--out={tmp_path / 'c.py'}"],
        bench: ["--bench_steps=1", "--warmup_steps=0"],
    }[tool]
    line = error_of(tool.main, [*TINY, *own, "--pp_schedule=zbv", f"--pp_chunks={chunks}"])
    assert line == (
        "error: pp_schedule='zbv' needs a pipeline of pp >= 2 ranks (its V is two model chunks on "
        "each), but pp = 1: set --pp=2 or more with --pp_chunks=2, or run on one stage with "
        "--pp_schedule=1f1b --pp_chunks=1"
    )
    assert not os.path.exists(tmp_path / "run") and not os.path.exists(tmp_path / "c.py")


# --- advice: a message that suggests settings gets past the check when they are given -------------
# Each message's every branch: the settings it suggests, added to the same command, pass start_up,
# the checks a launch makes before it builds anything (the settings', the resume's, the layout's and
# the schedule's).

RESUME = ["--init_from=resume", "--out_dir=out"]


def saved_run(**config):
    """The meta.json of a checkpoint out/ckpt_0000004 of a run with these settings (layout from
    them)."""
    layout = {k: config.get(k, 1) for k in ("cp", "tp", "pp", "ep")}
    layout["dp"] = config.pop("saved_dp", 1)
    return {"step": 4, "config": {**settings.DEFAULTS, **config}, "layout": layout}


@pytest.fixture
def start_up(monkeypatch):
    """start_up(argv, world_size=1, saved=None): the settings a launch of world_size processes makes
    of argv (resuming a checkpoint whose meta.json is `saved`), through train.configure_run and then
    the layout's, the schedule's and the model's split rules (settings.check_layout), the first of
    build.setup. Returns (cfg, notes); raises what train.main would print."""

    def run(argv, world_size=1, saved=None):
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        if saved is not None:
            monkeypatch.setattr(checkpoint, "latest_checkpoint", lambda out_dir: "out/ckpt_0000004")
            monkeypatch.setattr(
                checkpoint, "checkpoint_folders", lambda out_dir: ["out/ckpt_0000004"]
            )
            monkeypatch.setattr(checkpoint, "read_meta", lambda path: saved)
        cfg, notes, _ = train.configure_run(argv)
        resolve_dp(world_size, cfg.dp, cfg.tp, cfg.pp, cp=cfg.cp, ep=cfg.ep)
        check_schedule(cfg.pp_schedule, cfg.pp, cfg.gradient_accumulation_steps, cfg.pp_chunks)
        model_cfg = ModelConfig(
            **{
                f.name: getattr(cfg, f.name)
                for f in fields(ModelConfig)
                if f.name not in ("vocab_size", "eot_token")
            },
            vocab_size=512,
        )
        check_layout(
            model_cfg, cfg.tp, cfg.pp, cfg.cp, cfg.sequence_parallel, cfg.pp_chunks, ep=cfg.ep
        )
        return cfg, notes

    return run


def advice(start_up, argv, world_size=1, saved=None):
    """The message start_up stops argv with."""
    with pytest.raises(ValueError) as stop:  # (ConfigError is a ValueError)
        start_up(argv, world_size, saved)
    return str(stop.value)


def suggested(message, flags):
    """flags ('--a=1 --b=2') as a list of arguments, once the message is seen to suggest them."""
    assert flags in message, message
    return flags.split()


def test_zbv_at_pp_1_the_advice_either_way_passes(start_up):
    line = advice(start_up, ["--pp_schedule=zbv", "--pp_chunks=2"])
    start_up(
        ["--pp_schedule=zbv", "--pp_chunks=2", *suggested(line, "--pp_schedule=1f1b --pp_chunks=1")]
    )
    assert "--pp=2 or more with --pp_chunks=2" in line
    start_up(["--pp_schedule=zbv", "--pp=2", "--pp_chunks=2"], world_size=2)


def test_a_pp_2_zbv_checkpoint_resumed_on_one_process_is_told_settings_that_run(start_up):
    saved = saved_run(pp=2, pp_schedule="zbv", pp_chunks=2, gradient_accumulation_steps=4)
    # the layout left out: the checkpoint's pp = 2 does not fit one process
    line = advice(start_up, RESUME, saved=saved)
    assert line.endswith("for example --pp=1 --pp_schedule=1f1b --pp_chunks=1")
    cfg, _ = start_up([*RESUME, "--pp=1", "--pp_schedule=1f1b", "--pp_chunks=1"], saved=saved)
    assert (cfg.pp, cfg.pp_schedule, cfg.pp_chunks) == (1, "1f1b", 1)
    # --pp=1 given: the inherited zbv and its two chunks, then what that message says
    line = advice(start_up, [*RESUME, "--pp=1"], saved=saved)
    start_up([*RESUME, "--pp=1", *suggested(line, "--pp_schedule=1f1b --pp_chunks=1")], saved=saved)


@pytest.mark.parametrize(
    "config,given,world_size,flags",
    [
        # the given pp takes both processes (it once said --tp=2)
        ({"tp": 2}, ["--pp=2"], 2, "--tp=1"),
        ({"cp": 2, "tp": 2, "pp": 2}, [], 1, "--cp=1 --tp=1 --pp=1"),
        ({"tp": 4}, [], 2, "--tp=2"),
        ({"tp": 2}, ["--dp=4"], 4, "--tp=1"),  # a given dp is kept
        ({"tp": 2}, ["--dp=1"], 4, "--dp=2 --tp=2"),  # ... and takes what the others leave
        ({"pp": 2}, ["--tp=3"], 2, "--tp=1 --pp=2"),  # a given axis that cannot fit either
        (
            {
                "pp": 2,
                "pp_schedule": "interleaved_1f1b",
                "pp_chunks": 2,
                "gradient_accumulation_steps": 4,
            },
            [],
            1,
            "--pp=1 --pp_chunks=1",
        ),
        ({"pp": 2, "pp_layers": "3,1"}, [], 1, "--pp=1 --pp_layers=''"),
        # nothing to split
        ({"tp": 2, "sequence_parallel": True}, ["--pp=2"], 2, "--tp=1 --sequence_parallel=False"),
    ],
)
def test_a_layout_inherited_that_does_not_fit_the_world_is_told_flags_that_fit(
    start_up, config, given, world_size, flags
):
    saved = saved_run(**config)
    line = advice(start_up, [*RESUME, *given], world_size, saved)
    assert "came from the checkpoint out/ckpt_0000004" in line
    assert line.endswith(f"for example {flags}")
    start_up([*RESUME, *given, *flags.split()], world_size, saved)


def test_the_global_batch_that_a_restart_cannot_keep_is_told_three_ways_that_pass(start_up):
    saved = {
        **saved_run(batch_size=1, gradient_accumulation_steps=3),
        "recipe": {"batch_size": 1, "gradient_accumulation_steps": 3, "windows": 3},
    }
    auto = ["--init_from=auto", "--out_dir=out"]
    line = advice(start_up, auto, 2, saved)
    assert "Launch a number of processes whose dp divides 3" in line
    start_up(auto, 3, saved)
    assert "give --batch_size and --gradient_accumulation_steps for a new global batch" in line
    cfg, _ = start_up([*auto, "--batch_size=2", "--gradient_accumulation_steps=1"], 2, saved)
    assert cfg.batch_size * cfg.gradient_accumulation_steps * 2 == 4
    start_up([*RESUME, *suggested(line, "--init_from=resume")[1:]], 2, saved)


def test_another_architecture_is_told_to_leave_the_settings_out_or_start_a_new_run(start_up):
    saved = saved_run(n_layer=2)
    line = advice(start_up, [*RESUME, "--n_layer=3"], saved=saved)
    assert "Leave these settings out to resume it as it is" in line
    assert start_up(RESUME, saved=saved)[0].n_layer == 2
    assert "start a new run with --init_from=scratch and another --out_dir" in line
    start_up(["--init_from=scratch", "--out_dir=another", "--n_layer=3"])
    with pytest.raises(
        settings.ConfigError, match="Leave these settings out: a model's architecture comes from"
    ):
        settings.resume_values(
            settings.DEFAULTS, {"n_layer"}, {"n_layer": 2}, source="model/config.json"
        )
    settings.resume_values(settings.DEFAULTS, set(), {"n_layer": 2}, source="model/config.json")


@pytest.mark.parametrize(
    "argv,world_size",
    [
        (["--zero_stage=3"], 1),
        (["--zero_stage=3", "--ep=2", "--n_expert=4"], 2),
        (["--zero_stage=2", "--ep=2", "--n_expert=4"], 2),
        (["--zero_stage=1", "--ep=2", "--n_expert=4"], 2),
    ],
)
def test_muon_starts_at_every_zero_stage_with_or_without_experts(start_up, argv, world_size):
    """Muon deals its matrices whole at every ZeRO stage, the experts' over the ranks that hold
    them (optim.py; tests/matrix.py runs them against one process): ZeRO-3, and ZeRO-1 and 2 at
    ep > 1, once refused, start."""
    start_up(["--optimizer=muon", *argv], world_size)


def test_min_lr_above_learning_rate_is_told_a_min_lr_that_passes(start_up):
    line = advice(start_up, ["--learning_rate=1e-3", "--min_lr=1.0"])
    start_up(["--learning_rate=1e-3", "--min_lr=1.0", *suggested(line, "--min_lr=0.0001")])


def test_warmup_past_lr_decay_iters_is_told_an_lr_decay_iters_without_the_warning(start_up):
    argv = ["--warmup_iters=50", "--lr_decay_iters=30", "--max_iters=100"]
    line = next(n for n in start_up(argv)[1] if n.startswith("warning:"))
    assert not any(
        n.startswith("warning:")
        for n in start_up([*argv, *suggested(line, "--lr_decay_iters=100")])[1]
    )


def test_pp_layers_that_do_not_cut_the_model_is_told_a_cut_that_does(start_up):
    argv = ["--n_layer=4", "--pp=2", "--pp_layers=3,2"]
    line = advice(start_up, argv, 2)
    assert "for example '2,2'; '' cuts the stages by their cost" in line
    for cut in ("2,2", "''"):
        start_up([*argv, f"--pp_layers={cut}"], 2)
    # fewer blocks than stages: no pp_layers can do, and the message does not offer one
    line = advice(start_up, ["--n_layer=1", "--pp=2", "--pp_layers=1"], 2)
    assert line.endswith("n_layer = 1 blocks cannot fill 2 stages: lower --pp or --pp_chunks)")


# --- token ids are checked where they are read ----------------------------------------------------


def big_token_data(data_dir):
    """Token bins with more than 2 x 2^20 tokens: load_data looks at the first and last 2^20 tokens
    of train.bin, so an id planted in between is found only where the batch is read."""
    return make_token_data(str(data_dir), n_tokens=3 << 20)


def plant_bad_id(data_dir, n_windows, window, block_size=32, seed=1337):
    """Write BAD_ID into train.bin where the `window`-th of the n_windows windows of some step k >=
    1 reads it, in the middle of the file, and where no earlier step reads. Returns (k, offset)."""
    path = os.path.join(data_dir, "train.bin")
    tokens = np.fromfile(path, dtype=np.uint16)
    edge, earlier = 1 << 20, []
    for k in range(100):
        starts = window_starts(seed, TRAIN_STREAM, k, len(tokens), block_size, n_windows)
        offset = int(starts[window]) + block_size // 2
        if (
            k >= 1
            and edge <= offset < len(tokens) - edge
            and not any(s <= offset <= s + block_size for s in earlier)
        ):
            tokens[offset] = BAD_ID
            tokens.tofile(path)
            return k, offset
        earlier.extend(int(s) for s in starts)
    raise AssertionError("no step reads the middle of the file")


def test_a_bad_token_id_in_the_middle_of_train_bin_stops_naming_the_file_offset_and_id(tmp_path):
    data = big_token_data(tmp_path / "data")
    step, offset = plant_bad_id(data, n_windows=4, window=1)
    line = error_of(
        train.main,
        [
            f"--data_dir={data}",
            f"--out_dir={tmp_path / 'run'}",
            *TINY,
            f"--max_iters={step + 2}",
            "--checkpoint_interval=0",
        ],
    )
    assert (
        f"{data}/train.bin holds token id {BAD_ID} at token offset {offset}, outside the "
        "vocabulary of 512" in line
    )
    # it stopped at that batch
    assert [r["step"] for r in records_of(tmp_path / "run")] == list(range(1, step))


def test_a_corrupt_val_bin_stops_the_run(tmp_path):
    data = make_token_data(str(tmp_path / "odd"))
    with open(os.path.join(data, "val.bin"), "ab") as f:
        f.write(b"\x01")  # half a token
    line = error_of(
        train.main, [f"--data_dir={data}", f"--out_dir={tmp_path / 'a'}", *TINY, "--max_iters=1"]
    )
    assert f"{data}/val.bin has 4001 bytes, not a whole number of uint16 tokens" in line
    data = make_token_data(str(tmp_path / "ids"))
    val = np.fromfile(os.path.join(data, "val.bin"), dtype=np.uint16)
    val[1000] = BAD_ID
    val.tofile(os.path.join(data, "val.bin"))
    line = error_of(
        train.main, [f"--data_dir={data}", f"--out_dir={tmp_path / 'b'}", *TINY, "--max_iters=1"]
    )
    assert f"{data}/val.bin holds token id {BAD_ID}" in line


@pytest.mark.parametrize("split,recorded", [("train", 20000), ("val", 2000)])
def test_a_bin_cut_short_at_a_whole_token_stops_naming_both_counts(split, recorded, tmp_path):
    data = make_token_data(str(tmp_path / "data"))  # meta.json records 20000 and 2000 tokens
    path = os.path.join(data, f"{split}.bin")
    np.fromfile(path, dtype=np.uint16)[: recorded // 2].tofile(path)  # even bytes: whole tokens
    line = error_of(
        train.main, [f"--data_dir={data}", f"--out_dir={tmp_path / 'run'}", *TINY, "--max_iters=1"]
    )
    assert (
        f"{path} has {recorded // 2:,} tokens but {data}/meta.json records {split}_tokens = "
        f"{recorded:,}: the file was cut short"
    ) in line and "python prepare_data.py" in line


@pytest.mark.parametrize("val", ["absent", "empty"])
def test_an_absent_or_empty_val_bin_turns_validation_off(val, tmp_path, capsys):
    data = make_token_data(str(tmp_path / "data"))
    os.remove(os.path.join(data, "val.bin"))
    if val == "empty":
        open(os.path.join(data, "val.bin"), "w").close()
    train.main(
        [
            f"--data_dir={data}",
            f"--out_dir={tmp_path / 'run'}",
            *TINY,
            "--max_iters=2",
            "--eval_interval=1",
            "--eval_iters=1",
            "--checkpoint_interval=0",
        ]
    )
    assert f"no validation loss: {data}/val.bin is absent or empty" in capsys.readouterr().out
    evals = [r for r in records_of(tmp_path / "run") if "train_loss" in r]
    assert len(evals) == 2 and not any("val_loss" in r for r in evals)


def test_a_corrupt_meta_json_names_the_file(tmp_path):
    data = make_token_data(str(tmp_path / "data"))
    with open(os.path.join(data, "meta.json"), "w") as f:
        f.write('{"dtype": "uint16", ')
    line = error_of(train.main, [f"--data_dir={data}", f"--out_dir={tmp_path / 'run'}", *TINY])
    assert (
        f"{data}/meta.json is corrupt (JSONDecodeError" in line and "python prepare_data.py" in line
    )


@needs_gpt2
def test_missing_data_is_told_the_online_and_the_offline_prepare_and_the_offline_one_runs(tmp_path):
    data_dir, text = tmp_path / "data", tmp_path / "corpus.txt"
    line = error_of(train.main, [f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'run'}", *TINY])
    assert (
        f"run: python prepare_data.py --out_dir={data_dir} (streams FineWeb-Edu: needs the network)"
        in line
    )
    offline = suggested(
        line,
        f"without a network, from local text: python prepare_data.py --dataset=PATH "
        f"--out_dir={data_dir}",
    )[-2:]
    text.write_text("A local document, the kind a user without a network has. " * 200)
    import prepare_data

    prepare_data.main([offline[0].replace("PATH", str(text)), offline[1], "--num_proc=1"])
    meta = read_data_meta(str(data_dir))  # the data's checks now pass
    assert load_data(str(data_dir), "train", 32, meta["vocab_size"], meta)[2] > 33


def test_a_thread_count_of_one_is_said_in_the_singular(monkeypatch):
    monkeypatch.setattr(metrics, "measure_cpu_peak_flops", lambda dtype: 1e9)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert (
        metrics.device_peak_flops(0.0, torch.device("cpu"), torch.float32)[1]
        == "measured: best square fp32 matmul, 1 thread"
    )
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert metrics.device_peak_flops(0.0, torch.device("cpu"), torch.float32)[1].endswith(
        ", 2 threads"
    )


def test_bench_says_one_thread_in_the_singular(monkeypatch, capsys):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    bench.main(
        [
            "--n_layer=1",
            "--n_embd=32",
            "--n_head=2",
            "--n_kv_head=2",
            "--block_size=16",
            "--vocab_size=64",
            "--batch_size=1",
            "--warmup_steps=0",
            "--bench_steps=1",
            "--peak_flops=1e12",
            "--device=cpu",
        ]
    )
    assert ", 1 thread; layout dp=1" in capsys.readouterr().out


# --- files and devices ----------------------------------------------------------------------------


def test_an_unknown_device_is_an_error_listing_what_is_available(token_dir, tmp_path, run_copy):
    available = "available here: 'auto', 'cpu'" + (", 'cuda'" if torch.cuda.is_available() else "")
    for device in ("mps", "xla"):
        line = error_of(
            train.main,
            [f"--data_dir={token_dir}", f"--out_dir={tmp_path}", *TINY, f"--device={device}"],
        )
        assert f"device='{device}': picotron runs on CPU and CUDA only; {available}" in line
    assert "is not a device name: use one of 'auto', 'cpu'" in error_of(
        sample.main, [f"--out_dir={run_copy}", "--device=gpu0"]
    )


def test_sample_refuses_a_missing_checkpoint_or_prompt_file(run_copy, tmp_path):
    assert "--ckpt=/nowhere is not a complete checkpoint" in error_of(
        sample.main, ["--ckpt=/nowhere"]
    )
    assert "it is a run's folder, not one checkpoint" in error_of(
        sample.main, [f"--ckpt={run_copy}"]
    )
    line = error_of(
        sample.main, [f"--out_dir={run_copy}", f"--start=FILE:{tmp_path / 'prompt.txt'}"]
    )
    assert (
        f"--start=FILE:{tmp_path / 'prompt.txt'}: the prompt file cannot be read (FileNotFoundError"
        in line
    )
    assert "temperature = -1.0 must not be negative" in error_of(
        sample.main, [f"--out_dir={run_copy}", "--temperature=-1"]
    )


def test_sample_and_export_hf_answer_a_step_that_is_not_there_with_the_checkpoints_that_are(
    run_copy,
):
    listed = f"the complete checkpoints in {run_copy} are ckpt_0000001, ckpt_0000002"
    line = error_of(sample.main, [f"--out_dir={run_copy}", "--ckpt=3"])
    assert "--ckpt=3 is not a complete checkpoint" in line and line.endswith(
        f"{run_copy} has no ckpt_0000003; {listed}"
    )
    with pytest.raises(FileNotFoundError, match=listed):
        export_hf.load_picotron(str(run_copy), f"{run_copy}/ckpt_3")
    assert export_hf.load_picotron(str(run_copy), "ckpt_1")[2] == str(run_copy / "ckpt_0000001")


@needs_gpt2
def test_sample_refuses_an_empty_prompt(run_copy):
    # (the prompt is found empty once it is tokenized, with the checkpoint's tokenizer: its data's
    # GPT-2)
    assert "the prompt is empty" in error_of(sample.main, [f"--out_dir={run_copy}", "--start="])


def test_an_out_dir_that_cannot_be_created_stops_before_training(token_dir, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    line = error_of(train.main, [f"--data_dir={token_dir}", f"--out_dir={blocker / 'run'}", *TINY])
    assert (
        f"out_dir = '{blocker / 'run'}' cannot be created (Not a directory): choose another "
        "--out_dir" in line
    )


def test_a_logging_backend_that_cannot_start_is_one_line(token_dir, tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # setup() checks that it is installed before anything starts

    def no_login(cfg):  # what wandb.init raises without a login, but without trying the network
        raise RuntimeError("No API key configured. Use `wandb login` to log in.\nmore detail")

    monkeypatch.setattr(metrics, "WandbLog", no_login)
    line = error_of(
        train.main, [f"--data_dir={token_dir}", f"--out_dir={tmp_path}", *TINY, "--wandb_log=True"]
    )
    assert line == (
        "error: logging cannot start (RuntimeError: No API key configured. Use `wandb login` to "
        "log in.): fix that, or turn it off (--wandb_log=False)"
    )


def test_each_tool_prints_one_error_line_and_no_traceback(tmp_path):
    """What a user sees: each script run as a program (concurrently: each one's time is mostly
    imports)."""
    cases = {
        "train.py": ["--n_layr=3"],
        "sample.py": ["--ckpt=/nowhere"],
        "tools/bench.py": ["--batch_size=0"],
        "tools/make_config.py": ["--tp=3", "--nproc=4", f"--out={tmp_path / 'c.py'}"],
        "export_hf.py": [f"--out_dir={tmp_path / 'none'}", f"--hf_dir={tmp_path / 'hf'}"],
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {
        tool: subprocess.Popen(
            [sys.executable, str(ROOT / tool), *argv],
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for tool, argv in cases.items()
    }
    for tool, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, (tool, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, (
            tool,
            err,
        )


def test_under_torchrun_the_failure_summary_names_the_one_line_error(tmp_path):
    """torchrun's summary of a failed rank (its last lines) shows what the rank left in its error
    file; read back here with torch's own reader and formatter, as torchrun does, without a launch.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = tmp_path / "error.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--n_layr=3"],
        capture_output=True,
        text=True,
        env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)},
    )
    assert proc.returncode == 1 and proc.stderr.startswith("error: unknown config key 'n_layr'")
    failure = ProcessFailure(local_rank=0, pid=0, exitcode=1, error_file=str(error_file))
    summary = ChildFailedError("train.py", {0: failure}).format_msg()
    assert f"  traceback : {proc.stderr.strip()}" in summary


# --- MFU is never above 100% ----------------------------------------------------------------------


def test_the_cpu_peak_is_the_faster_of_the_run_dtype_and_fp32_with_a_note_when_the_dtype_is_slower(
    monkeypatch,
):
    measured = {torch.float32: 100e9, torch.bfloat16: 2e9}
    monkeypatch.setattr(metrics, "measure_cpu_peak_flops", measured.__getitem__)
    cpu = torch.device("cpu")
    peak, why = metrics.device_peak_flops(0.0, cpu, torch.bfloat16)
    assert (
        peak == 100e9
        and "note: bfloat16 has no fast matmul kernel on this CPU (2 GFLOP/s against 100" in why
    )
    measured[torch.bfloat16] = 300e9  # a CPU with AVX512_BF16 or AMX
    peak, why = metrics.device_peak_flops(0.0, cpu, torch.bfloat16)
    assert peak == 300e9 and "note" not in why
    assert metrics.device_peak_flops(0.0, cpu, torch.float32)[0] == 100e9


def test_a_bf16_run_on_this_cpu_reports_mfu_under_100_percent_and_the_note_where_bf16_is_slow(
    token_dir, tmp_path, capsys
):
    train.main(
        [
            f"--data_dir={token_dir}",
            f"--out_dir={tmp_path}",
            *TINY,
            "--max_iters=3",
            "--dtype=bfloat16",
            "--checkpoint_interval=0",
        ]
    )
    out = capsys.readouterr().out
    mfus = [r["mfu"] for r in records_of(tmp_path)]
    assert len(mfus) == 3 and all(0 < m <= 1 for m in mfus), mfus
    slow = metrics.measure_cpu_peak_flops(torch.bfloat16) < metrics.measure_cpu_peak_flops(
        torch.float32
    )
    assert ("note: bfloat16 has no fast matmul kernel on this CPU" in out) == slow, out


# --- several ranks: one 2-rank launch -------------------------------------------------------------


def _two_rank_cases(rank, world_size, cases):
    # train.main ends by destroying the process group; here several runs share this launch's group
    torch.distributed.destroy_process_group, destroy = (
        (lambda: None),
        torch.distributed.destroy_process_group,
    )
    try:
        results = {}
        for name, argv in cases.items():
            if name == "fallback" and rank == 1:  # only rank 1 cannot read the newest checkpoint
                newest, reader = (
                    checkpoint.latest_checkpoint(argv[0].split("=", 1)[1]),
                    checkpoint.CheckpointReader,
                )

                def failing_reader(path):
                    if path == newest:
                        raise checkpoint.CheckpointError(
                            f"checkpoint {path}: rank00000.pt cannot be read (here only)"
                        )
                    return reader(path)

                checkpoint.CheckpointReader = failing_reader
            resumed, resume = [], checkpoint.resume_run

            def recording_resume(*args):
                result = resume(*args)
                resumed.append(result[0])  # the step this rank resumed
                return result

            checkpoint.resume_run = recording_resume
            try:
                results[name] = (*main_exit_and_output(argv), resumed)
            finally:
                checkpoint.resume_run = resume
                if name == "fallback" and rank == 1:
                    checkpoint.CheckpointReader = reader
        return results
    finally:
        torch.distributed.destroy_process_group = destroy


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    base = tmp_path_factory.mktemp("two_ranks")
    small = [
        "--n_layer=2",
        "--n_head=4",
        "--n_kv_head=2",
        "--n_embd=64",
        "--block_size=32",
        "--batch_size=2",
        "--eval_interval=0",
        "--log_interval=1",
        "--device=cpu",
        "--checkpoint_interval=0",
    ]
    tp_data, dp_data = big_token_data(base / "tp_data"), big_token_data(base / "dp_data")
    # dp = 1: the step's 2 windows
    tp_step, tp_offset = plant_bad_id(tp_data, n_windows=2, window=1)
    # dp = 2: in rank 1's half of the 4
    dp_step, dp_offset = plant_bad_id(dp_data, n_windows=4, window=3)
    # one-process checkpoints to resume at dp = 2
    token = make_token_data(str(base / "tokens"))
    train.main(
        [
            f"--data_dir={token}",
            f"--out_dir={base / 'one'}",
            *TINY,
            "--max_iters=2",
            "--checkpoint_interval=1",
        ]
    )
    shutil.copytree(base / "one", base / "fallback")
    cases = {
        "tp": [
            f"--out_dir={base / 'tp'}",
            f"--data_dir={tp_data}",
            *small,
            "--tp=2",
            f"--max_iters={tp_step + 2}",
        ],
        "dp": [
            f"--out_dir={base / 'dp'}",
            f"--data_dir={dp_data}",
            *small,
            "--dp=2",
            f"--max_iters={dp_step + 2}",
        ],
        "resume_dp2": [f"--out_dir={base / 'one'}", "--init_from=resume", "--max_iters=3"],
        "fallback": [f"--out_dir={base / 'fallback'}", "--init_from=resume", "--max_iters=2"],
    }
    results = run_ranks(_two_rank_cases, 2, cases, timeout=240)
    return dict(
        base=base,
        results=results,
        tp=(tp_data, tp_step, tp_offset),
        dp=(dp_data, dp_step, dp_offset),
    )


@pytest.mark.parametrize("layout", ["tp", "dp"])
def test_a_bad_token_id_stops_every_rank_at_the_same_step_with_one_message(layout, two_ranks):
    data, step, offset = two_ranks[layout]
    (code0, _, _), (code1, _, _) = (r[layout] for r in two_ranks["results"])
    assert code0 == (
        f"error: {data}/train.bin holds token id {BAD_ID} at token offset {offset}, outside the "
        "vocabulary of 512: the file is corrupt or was written by another tokenizer; "
        f"{_prepare_hint(data)}"
    )
    # stopped too, at the same batch (the launch returned: no rank waits); run_script prints
    assert code1 == code0
    # the line on rank 0 only
    assert [r["step"] for r in records_of(two_ranks["base"] / layout)] == list(range(1, step))


def test_a_batch_size_inherited_at_another_dp_prints_the_new_global_batch(two_ranks):
    (code, out, resumed), (_, out1, resumed1) = (r["resume_dp2"] for r in two_ranks["results"])
    assert code is None and resumed == resumed1 == [2]
    assert (
        "resume: the global batch is now 256 tokens per step, the checkpoint's run had 4 x 1 "
        "micro-batches x dp 1 x 32 = 128 (set batch_size or gradient_accumulation_steps to keep "
        "it)" in out
    )
    assert out1 == ""  # rank 0 prints


def test_when_one_rank_cannot_read_the_newest_checkpoint_every_rank_falls_back_to_the_same(
    two_ranks,
):
    (code, out, resumed), (_, _, resumed1) = (r["fallback"] for r in two_ranks["results"])
    base = two_ranks["base"] / "fallback"
    assert code is None and resumed == resumed1 == [1]
    assert (
        f"checkpoint {base / 'ckpt_0000002'} cannot be read on 1 rank(s); falling back to "
        f"{base / 'ckpt_0000001'}" in out
    )


# --- a checkpoint write that fails on one rank: one torchrun launch -------------------------------


def test_a_write_past_the_file_size_limit_names_its_cause(tmp_path):
    """torch.save itself reports it as
    "[enforce fail at inline_container.cc] unexpected pos ..."."""
    import errno
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    try:
        with pytest.raises(OSError) as failed:
            checkpoint._save_file({"a": torch.zeros(100_000)}, tmp_path / "rank00000.pt")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert failed.value.errno == errno.EFBIG


def test_a_failed_save_on_one_rank_stops_every_rank_once_naming_path_and_cause(token_dir, tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "tests" / "train_with_file_size_limit.py"),
        f"--data_dir={token_dir}",
        f"--out_dir={out}",
        *TINY,
        "--tp=2",
        "--max_iters=4",
        "--checkpoint_interval=2",
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: saving checkpoint {out}/ckpt_0000004 failed on rank 1: OSError: [Errno 27] File "
        f"too large. The partial {out}/ckpt_0000004.tmp was removed; the last complete checkpoint "
        f"is {out}/ckpt_0000002. Free space or fix the permissions of out_dir '{out}', then resume "
        "with --init_from=resume"
    ], proc.stderr
    # no worker traceback (the launcher's own summary may follow)
    assert 'train.py", line' not in proc.stderr
    assert sorted(os.listdir(out)) == ["ckpt_0000002", "metrics.jsonl"]
    # the previous checkpoint still loads
    reader = checkpoint.CheckpointReader(str(out / "ckpt_0000002"))
    model = Transformer(model_config_from(reader.meta["model"]))
    checkpoint.load_model(model, reader)
    assert reader.meta["step"] == 2 and all(torch.isfinite(p).all() for p in model.parameters())
