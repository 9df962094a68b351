"""tools/make_config.py: a starter config for a size and a layout, refused when the layout does not
divide the model, and one that train.py accepts and trains with."""

import re

import pytest

from tools import machines
from tools import make_config
from conftest import ROOT
from dist_utils import make_token_data, train_in_process


def test_a_layout_that_does_not_divide_the_heads_is_refused_by_name(tmp_path):
    out = tmp_path / "bad.py"
    with pytest.raises(SystemExit, match=r"n_head = 6 must be divisible by tp = 4"):
        make_config.main(
            ["--n_head=6", "--n_kv_head=6", "--n_embd=96", "--tp=4", "--nproc=4", f"--out={out}"]
        )
    assert not out.exists()


def test_more_pipeline_stages_than_blocks_is_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"pp = 4 stages but only n_layer = 2 blocks"):
        make_config.main(["--n_layer=2", "--pp=4", "--nproc=4", f"--out={tmp_path / 'bad.py'}"])


def test_a_process_count_the_layout_does_not_divide_is_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"nproc = 6 processes cannot be cut into tp = 2 x pp = 2"):
        make_config.main(["--tp=2", "--pp=2", "--nproc=6", f"--out={tmp_path / 'bad.py'}"])


def test_the_config_states_parameters_and_global_batch(tmp_path):
    out = tmp_path / "c.py"
    make_config.main(
        [
            "--n_layer=3",
            "--n_embd=64",
            "--n_head=4",
            "--n_kv_head=2",
            "--vocab_size=1000",
            "--tie_embeddings=False",
            "--block_size=128",
            "--batch_size=6",
            "--gradient_accumulation_steps=2",
            "--tp=2",
            "--pp=1",
            "--nproc=8",
            f"--out={out}",
        ]
    )
    text = out.read_text()
    # Llama parameter count written out: q, o (d x d), k, v (d x kv_heads*head_dim), SwiGLU 3 x d x
    # 192 (2/3 of 4d rounded up to 64), two norm gains per block; the final norm; untied embedding
    # and head (1000 x d each)
    d, kv = 64, 2 * 16
    per_block = 2 * d * d + 2 * d * kv + 3 * d * 192 + 2 * d
    params = 3 * per_block + d + 2 * 1000 * d
    assert f"{params / 1e6:.2f}M parameters" in text
    assert "dp 4 x tp 2 x pp 1" in text
    assert f"{6 * 2 * 4 * 128:,} tokens per step" in text
    namespace = {}
    exec(text, namespace)
    assert (namespace["dp"], namespace["tp"], namespace["n_kv_head"], namespace["batch_size"]) == (
        4,
        2,
        2,
        6,
    )


def test_a_generated_config_trains_one_step(tmp_path):
    data = make_token_data(str(tmp_path / "data"))
    config = tmp_path / "config" / "tiny.py"
    make_config.main(
        [
            "--n_layer=2",
            "--n_embd=64",
            "--n_head=4",
            "--block_size=32",
            "--batch_size=2",
            "--max_iters=1",
            "--eval_interval=0",
            "--checkpoint_interval=0",
            "--device=cpu",
            f"--data_dir={data}",
            f"--out_dir={tmp_path / 'run'}",
            "--nproc=1",
            f"--out={config}",
        ]
    )
    assert "vocabulary 512" in config.read_text()  # read from the data's meta.json
    records = train_in_process([str(config), f"--out_dir={tmp_path / 'run'}"])
    assert [r["step"] for r in records if "loss" in r] == [1]


def test_the_parameter_count_follows_head_dim_intermediate_size_and_qkv_bias(tmp_path):
    out = tmp_path / "c.py"
    make_config.main(
        [
            "--n_layer=2",
            "--n_embd=64",
            "--n_head=4",
            "--n_kv_head=2",
            "--head_dim=32",
            "--intermediate_size=96",
            "--qkv_bias=True",
            "--vocab_size=1000",
            f"--out={out}",
        ]
    )
    # q and o: 64 x 4*32 each; k and v: 64 x 2*32 each, with biases on q, k and v; SwiGLU 3 x 64 x
    # 96
    d = 64
    per_block = 2 * d * 128 + 2 * d * 64 + (128 + 2 * 64) + 3 * d * 96 + 2 * d
    text = out.read_text()
    assert f"{(2 * per_block + d + 1000 * d) / 1e6:.2f}M parameters" in text
    assert "4 heads (2 key/value) of size 32" in text


def assignments(text):
    return [
        line.split(" = ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")
    ]


def test_no_grouped_query_attention_nobody_asked_for(tmp_path, capsys):
    out = tmp_path / "c.py"
    make_config.main(["--n_layer=2", "--n_embd=384", "--n_head=6", "--nproc=1", f"--out={out}"])
    text = out.read_text()
    # what was asked, plus dp and n_kv_head = n_head (the default 4 would be GQA at 6 heads), each
    # saying why
    assert assignments(text) == ["n_layer", "n_head", "n_kv_head", "n_embd", "dp"]
    assert (
        "n_kv_head = 6  # " in text
        and "(= n_head: multi-head attention (set n_kv_head for GQA))" in text
    )
    assert "chose n_kv_head = 6" in capsys.readouterr().out
    out.unlink()
    make_config.main(["--n_head=8", "--n_kv_head=2", "--n_embd=128", "--nproc=1", f"--out={out}"])
    assert "n_kv_head = 2  #" in out.read_text()  # asked for: kept


def test_a_pipeline_gets_4_x_pp_microbatches_and_says_why(tmp_path, capsys):
    out = tmp_path / "c.py"
    make_config.main(["--n_layer=4", "--pp=2", "--nproc=2", f"--out={out}"])
    text = out.read_text()
    assert (
        "gradient_accumulation_steps = 8  # " in text and "(pp - 1) / (m + pp - 1), at 11%" in text
    )
    assert "chose gradient_accumulation_steps = 8: 4 x pp microbatches" in capsys.readouterr().out
    out.unlink()
    make_config.main(
        ["--n_layer=4", "--pp=2", "--nproc=2", "--gradient_accumulation_steps=2", f"--out={out}"]
    )
    assert "gradient_accumulation_steps = 2  #" in out.read_text()  # asked for: kept


def test_a_pipeline_states_its_cut_by_cost_or_by_hand_and_warns_when_no_cut_balances(tmp_path):
    out = tmp_path / "c.py"
    make_config.main(
        [
            "--n_layer=8",
            "--n_embd=256",
            "--n_head=8",
            "--block_size=128",
            "--vocab_size=16384",
            "--pp=2",
            "--nproc=2",
            f"--out={out}",
        ]
    )
    assert (
        "# pipeline: 1f1b, 8 microbatches, cut by cost, blocks per stage 0: 0-5 (47% of the work) "
        "| 1: 6-7 (53%)\n" in out.read_text()
    )
    make_config.main(
        [
            "--n_layer=8",
            "--n_embd=256",
            "--n_head=8",
            "--block_size=128",
            "--vocab_size=16384",
            "--pp=2",
            "--pp_layers=7,1",
            "--nproc=2",
            f"--out={out}",
            "--force=True",
        ]
    )
    text = out.read_text()
    assert "cut by pp_layers, blocks per stage 0: 0-6 (55% of the work) | 1: 7 (45%)" in text
    assert 'pp_layers = "7,1"  # the blocks of each model stage' in text
    # the quick start's model: its head is most of its work
    make_config.main(
        [
            "--n_layer=4",
            "--n_embd=128",
            "--n_head=4",
            "--n_kv_head=2",
            "--block_size=256",
            "--vocab_size=50304",
            "--pp=2",
            "--nproc=2",
            f"--out={out}",
            "--force=True",
        ]
    )
    assert (
        "# warning: no cut of the blocks brings every rank within 115% of an even share"
        in out.read_text()
    )


def test_an_existing_file_is_refused_unless_force_is_given(tmp_path, capsys):
    out = tmp_path / "c.py"
    out.write_text("# someone's own config\n")
    with pytest.raises(
        SystemExit, match=r"out = '.*c.py' exists: choose another --out, or pass --force=True"
    ):
        make_config.main(["--n_layer=2", f"--out={out}"])
    assert out.read_text() == "# someone's own config\n"
    # the advice, either way, is taken
    make_config.main(["--n_layer=2", f"--out={tmp_path / 'another.py'}"])
    make_config.main(["--n_layer=2", f"--out={out}", "--force=True"])
    assert "n_layer = 2  #" in out.read_text()
    assert capsys.readouterr().out.endswith(f"overwrote {out}\n")


def test_an_out_that_cannot_be_written_is_told_to_choose_another(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(
        SystemExit, match=r"out = '.*a_file/c.py' cannot be written \(.*\): choose another --out"
    ):
        make_config.main(["--n_layer=2", f"--out={blocker / 'c.py'}"])
    make_config.main(["--n_layer=2", f"--out={tmp_path / 'c.py'}"])
    assert "n_layer = 2  #" in (tmp_path / "c.py").read_text()


def test_the_default_out_says_where_it_wrote(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    make_config.main(["--n_layer=2"])
    assert (tmp_path / "config" / "my.py").exists()
    assert capsys.readouterr().out.endswith(
        f"wrote config/my.py ({tmp_path / 'config' / 'my.py'}): the default "
        f"--out; --out=PATH writes elsewhere\n"
    )


def test_gpu_mem_gib_is_compared_in_the_plans_unit(tmp_path, capsys):
    # the plan states the largest stage in GiB: a GPU a little smaller does not hold it, a little
    # larger does
    make_config.main(["--n_layer=2", f"--out={tmp_path / 'a.py'}"])
    largest = float(re.search(r"largest: stage 0, ([\d.]+) GiB", capsys.readouterr().out).group(1))
    make_config.main(
        ["--n_layer=2", f"--out={tmp_path / 'b.py'}", f"--gpu_mem_gib={largest - 0.01}"]
    )
    assert f"does not fit {largest - 0.01}" in capsys.readouterr().out
    make_config.main(
        ["--n_layer=2", f"--out={tmp_path / 'c.py'}", f"--gpu_mem_gib={largest + 0.01}"]
    )
    assert "does not fit" not in capsys.readouterr().out


def test_choose_writes_the_fastest_layout_that_fits_with_every_layout_setting(tmp_path, capsys):
    from tools import step_time

    out = tmp_path / "chosen.py"
    make_config.main(
        [
            "--n_layer=4",
            "--n_embd=64",
            "--n_head=4",
            "--n_kv_head=4",
            "--vocab_size=512",
            "--block_size=64",
            "--nproc=4",
            "--machine=a100",
            "--choose=True",
            "--global_batch=16",
            f"--out={out}",
        ]
    )
    printed = capsys.readouterr().out
    written = {}
    exec(out.read_text(), {}, written)
    for name in make_config.LAYOUT_SETTINGS:
        assert name in written, name
    # the global batch is held: 16 sequences per step, whatever the layout
    assert written["batch_size"] * written["gradient_accumulation_steps"] * written["dp"] == 16
    assert written["dp"] * written["cp"] * written["tp"] * written["pp"] == 4
    # and it is the first of the ranked list, whose times rise
    times = [float(t) for t in re.findall(r"^\s*\d+\.\s+([\d.e+-]+) ms", printed, re.M)]
    assert times == sorted(times) and len(times) == 10
    # the written config, predicted on its own, takes the first time listed
    cfg = {**defaults(), **written}
    prediction = step_time.predict(
        step_time.model_config_of(cfg), step_time.run_of(cfg), machines.load_machine("a100")
    )
    assert prediction["step_s"] * 1e3 == pytest.approx(times[0], rel=1e-3)


def defaults():
    import settings

    return {s.name: s.default for s in settings.TRAINING}


def test_choose_keeps_a_layout_setting_given_on_the_command_line(tmp_path):
    out = tmp_path / "held.py"
    make_config.main(
        [
            "--n_layer=4",
            "--n_embd=64",
            "--n_head=4",
            "--n_kv_head=4",
            "--vocab_size=512",
            "--block_size=64",
            "--nproc=4",
            "--machine=a100",
            "--choose=True",
            "--global_batch=16",
            "--pp=2",
            f"--out={out}",
        ]
    )
    written = {}
    exec(out.read_text(), {}, written)
    assert written["pp"] == 2


# --- the process count and the launch line: nodes of the machine's GPUs ---------------------------

TINY = [
    "--n_layer=4",
    "--n_embd=64",
    "--n_head=4",
    "--n_kv_head=4",
    "--vocab_size=512",
    "--block_size=64",
]


@pytest.mark.parametrize("nproc", [0, -8])
def test_a_process_count_below_one_is_refused_naming_nproc(nproc, tmp_path):
    out = tmp_path / "c.py"
    refused = rf"^error: nproc = {nproc} must be at least 1: .* set --nproc=1"
    with pytest.raises(SystemExit, match=refused):
        make_config.main([*TINY, f"--nproc={nproc}", f"--out={out}"])
    assert not out.exists()


def launch_of(text):
    """The torchrun command of a config's `# launch:` line, read by torchrun's own parser."""
    from torch.distributed.run import get_args_parser

    words = re.search(r"^# launch: (.*)$", text, re.M).group(1).split()
    assert words[0] == "torchrun"
    return get_args_parser().parse_args(words[1:])


def test_above_one_node_the_launch_line_names_nodes_gpus_per_node_and_slurm_sh(tmp_path, capsys):
    # the command of issue 51: 64 processes on h100 nodes of 8 GPUs (tools/machines.py), the layout
    # chosen
    out = tmp_path / "c.py"
    make_config.main(
        [
            *TINY,
            "--nproc=64",
            "--machine=h100",
            "--choose=True",
            "--tp=4",
            "--pp=1",
            "--cp=1",
            "--zero_stage=1",
            "--activation_checkpointing=False",
            "--global_batch=64",
            f"--out={out}",
        ]
    )
    text, printed = out.read_text(), capsys.readouterr().out
    launch = launch_of(text)
    assert (launch.nnodes, launch.nproc_per_node, launch.rdzv_backend) == ("8", "8", "c10d")
    assert launch.rdzv_endpoint == "HOST:29500" and launch.training_script == "train.py"
    assert launch.training_script_args == [str(out)]
    assert "torchrun --nnodes=8 --nproc_per_node=8 " in printed
    # the SLURM advice names what scripts/slurm.sh has you change
    script = (ROOT / "scripts" / "slurm.sh").read_text()
    assert "scripts/slurm.sh with --nodes=8 --gpus-per-node=8," in text
    for name in (
        "#SBATCH --nodes=",
        "#SBATCH --gpus-per-node=",
        "GPUS_PER_NODE=",
        "CONFIG=",
        "ARGS=",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=",
    ):
        assert name in script, name


def test_gpus_per_node_cuts_the_launch_and_one_node_keeps_the_one_node_form(tmp_path):
    out = tmp_path / "c.py"
    make_config.main([*TINY, "--nproc=12", "--gpus_per_node=4", f"--out={out}"])
    launch = launch_of(out.read_text())
    assert (launch.nnodes, launch.nproc_per_node) == ("3", "4")
    make_config.main([*TINY, "--nproc=8", f"--out={out}", "--force=True"])  # one h100 node
    assert f"# launch: torchrun --nproc_per_node=8 train.py {out}\n" in out.read_text()


def test_a_process_count_that_fills_no_whole_nodes_is_refused(tmp_path):
    out = tmp_path / "c.py"
    refused = (
        r"^error: nproc = 12 is more than one node of 8 GPUs \(h100's\) but not a multiple "
        r"of 8: .* set --nproc=8 or 16, or --gpus_per_node"
    )
    with pytest.raises(SystemExit, match=refused):
        make_config.main([*TINY, "--nproc=12", f"--out={out}"])
    assert not out.exists()


def test_choose_with_machine_auto_lists_the_machines_choose_takes():
    with pytest.raises(SystemExit) as stop:
        make_config.main([*TINY, "--machine=auto", "--choose=True", "--out=unused.py"])
    message = str(stop.value.code)
    assert message.startswith(
        "error: machine = 'auto' is not one tools/make_config.py can plan for: --choose"
    )
    allowed = re.search(r"need a named machine: (.*?), or a \.json file", message).group(1)
    assert allowed.split(", ") == list(machines.MACHINES)  # 'auto' is not among them
