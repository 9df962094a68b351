"""tools/step_time.py: the step-time model held to closed forms (the pipeline's bubble, a ring's
bytes, a bucket hidden under the backward), the links a layout's groups span, and a machine file
reproducing a prediction (one that is not a machine refused in one line). All in process: nothing
here launches, measures or communicates."""

import json
import re
from types import SimpleNamespace

import pytest

from tools import machines
from tools import make_config
from tools import step_time
from tools.machines import CPU_GLOO_LINK
from model import ModelConfig
from pipeline_schedules import SCHEDULES

SMALL = ModelConfig(n_layer=4, n_head=4, n_kv_head=4, n_embd=64, block_size=64, vocab_size=512)
LINK = {"busbw": 1e9, "latency": 0.0}
# this CPU's figures as machine=auto reads them (scripts/validate_step_time.py): gloo on the cores
# that compute
CPU = dict(
    name="auto",
    matmul_flops={"float32": 85e9},
    memory_bw=90e9,
    attention_efficiency=0.35,
    op_seconds=3e-6,
    node=CPU_GLOO_LINK,
    network=CPU_GLOO_LINK,
    overlaps=False,
    gpus_per_node=2,
)


def run_of(**changes):
    base = dict(
        dp=1,
        tp=1,
        pp=1,
        cp=1,
        ep=1,
        zero_stage=0,
        batch_size=2,
        gradient_accumulation_steps=4,
        pp_schedule="1f1b",
        pp_chunks=1,
        activation_checkpointing=False,
        sequence_parallel=False,
        bucket_size_mb=25.0,
        dtype="auto",
        pp_layers="",
        block_size=64,
        optimizer="adamw",
        attn_impl="auto",
        overlap_param_gather=True,
        chunked_loss=True,
        fp8="none",
        compile=False,
    )
    return SimpleNamespace(**{**base, **changes})


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 4)])
def test_one_f_one_b_with_equal_stages_idles_the_gpipe_share(pp, m):
    # equal stages, a forward 1 s and a backward 2 s: every rank idles (p - 1) / (m + p - 1) of the
    # step
    lists = [SCHEDULES["1f1b"](pp, r, m) for r in range(pp)]
    times = step_time.simulate_pipeline(
        lists, [(r,) for r in range(pp)], lambda r, a: {"F": 1.0, "B": 2.0}[a[0]], 0.0
    )
    step = max(end for _, end in times.values())
    assert step == pytest.approx(3 * (m + pp - 1))
    for r in range(pp):
        assert (step - 3 * m) / step == pytest.approx((pp - 1) / (m + pp - 1))


def test_a_transfer_delays_each_hop_of_the_fill_and_the_drain():
    # 1F1B at pp = 2, m = 1: F on rank 0, F and B on rank 1, B on rank 0; two messages, each t late
    lists = [SCHEDULES["1f1b"](2, r, 1) for r in range(2)]
    times = step_time.simulate_pipeline(
        lists, [(0,), (1,)], lambda r, a: {"F": 1.0, "B": 2.0}[a[0]], 0.25
    )
    assert max(end for _, end in times.values()) == pytest.approx(1 + 1 + 2 + 2 + 2 * 0.25)


def ring_all_reduce_bytes_sent(n, nbytes):
    """Each rank's bytes sent by a ring all-reduce, counted step by step: n - 1 reduce-scatter steps
    and n - 1 all-gather steps, each passing one of the n chunks to the next rank."""
    chunk = nbytes / n
    return sum(chunk for _ in range(n - 1)) + sum(chunk for _ in range(n - 1))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_a_ring_all_reduce_sends_twice_n_minus_one_over_n_of_the_buffer(n):
    nbytes = 1e8
    assert machines.collective_seconds("all_reduce", nbytes, n, LINK) == pytest.approx(
        ring_all_reduce_bytes_sent(n, nbytes) / LINK["busbw"]
    )
    # a reduce-scatter or an all-gather is one half of it
    assert machines.collective_seconds("reduce_scatter", nbytes, n, LINK) == pytest.approx(
        ring_all_reduce_bytes_sent(n, nbytes) / 2 / LINK["busbw"]
    )
    # and each of its 2 (n - 1) steps waits one latency
    assert machines.collective_seconds(
        "all_reduce", 0.0 + 1, n, {"busbw": 1e30, "latency": 1.0}
    ) == pytest.approx(2 * (n - 1))


def test_the_chunked_loss_runs_the_heads_backward_in_its_forward():
    """model.ChunkedLinearCrossEntropy computes the head's gradients in the forward and only scales
    them in the backward: the same work moved, so one stage's step barely changes and AFAB's first
    stage waits for the last stage's heavier forwards."""
    machine, links = machines.load_machine("a100"), {"tp": LINK}
    (_, plain), (_, chunked) = (
        step_time.ends_seconds(SMALL, run_of(chunked_loss=c), machine, links, 128)
        for c in (False, True)
    )
    assert chunked["weight_grad"] == 0 and chunked["forward"] == pytest.approx(
        sum(plain[k] for k in ("forward", "input_grad", "weight_grad"))
    )
    # the validation's small model on this CPU's figures (scripts/validate_step_time.py), where it
    # matters
    model = ModelConfig(
        n_layer=4, n_head=4, n_kv_head=4, n_embd=128, block_size=128, vocab_size=4096
    )
    one, afab = (
        [
            step_time.predict(
                model, run_of(chunked_loss=c, batch_size=4, block_size=128, **layout), CPU
            )["step_s"]
            for c in (False, True)
        ]
        for layout in ({}, dict(pp=2, pp_schedule="afab"))
    )
    assert one[1] == pytest.approx(one[0], rel=0.02) and afab[1] > 1.2 * afab[0]


def test_one_rank_communicates_nothing():
    assert machines.collective_seconds("all_reduce", 1e9, 1, LINK) == 0.0


@pytest.mark.parametrize("cp", [2, 4])
def test_the_ring_pays_a_latency_for_each_message_it_sends(cp):
    # no overlap (gloo on the cores that compute): forward cp - 1 messages of k and v, backward cp -
    # 1 of them and cp of their fp32 gradients (context_parallel.ring_attention_bytes), each one
    # latency and its bytes
    link = {"busbw": 1e9, "latency": 1e-3}
    tokens = 2 * SMALL.block_size // cp
    block = step_time.block_seconds(
        SMALL, run_of(cp=cp), CPU, {"tp": LINK, "cp": link, "ep": LINK}, tokens
    )
    # fp32 k and v, and their gradients
    kv = tokens * SMALL.n_kv_head * 2 * (SMALL.n_embd // SMALL.n_head) * 4
    assert block["cp"][0] == pytest.approx((cp - 1) * (1e-3 + kv / 1e9))
    assert block["cp"][1] == pytest.approx((2 * cp - 1) * (1e-3 + kv / 1e9))


def test_expert_parallelism_exchanges_the_counts_before_the_rows_forward():
    moe = ModelConfig(**{**vars(SMALL), "n_expert": 4, "n_expert_per_token": 2})
    link = {"busbw": 1e9, "latency": 1e-3}
    block = step_time.block_seconds(
        moe, run_of(dp=2, ep=2), CPU, {"tp": LINK, "cp": LINK, "ep": link}, 128
    )
    counts = machines.collective_seconds("all_to_all", 4 * 8, 2, link)
    assert counts >= 1e-3 and block["ep"][0] == pytest.approx(block["ep"][1] + counts)


def test_the_heads_tensor_parallel_messages_each_in_its_own_direction():
    # forward: the embedding's all-reduce and the loss's three of a float per token; backward: f's
    # all-reduce of the head's input gradient. Under SP a reduce-scatter (embedding) and an
    # all-gather (final norm) each way instead of the two activations' all-reduces.
    link = {"busbw": 1e9, "latency": 1e-3}
    tokens, links = 128, {"tp": link}
    activations = machines.collective_seconds("all_reduce", tokens * SMALL.n_embd * 4, 2, link)
    loss = 3 * machines.collective_seconds("all_reduce", tokens * 4, 2, link)
    embedding, head = step_time.ends_seconds(SMALL, run_of(tp=2), CPU, links, tokens)
    assert embedding["tp"] == [activations, 0.0] and head["tp"] == [
        pytest.approx(loss),
        activations,
    ]
    embedding, head = step_time.ends_seconds(
        SMALL, run_of(tp=2, sequence_parallel=True), CPU, links, tokens
    )
    assert embedding["tp"] == [activations / 2] * 2 and head["tp"] == [
        pytest.approx(loss + activations / 2),
        activations / 2,
    ]


def test_the_vocab_parallel_loss_takes_the_time_its_kernels_were_timed_at():
    # machine=auto times the loss's own kernels per logit (machines.loss_seconds), forward and
    # backward: under tp the head's forward and input gradient carry tokens x its vocabulary columns
    # of them in place of the two passes at the memory bandwidth; a machine without them, and tp =
    # 1, keep the passes
    tokens, links = 128, {"tp": {"busbw": 1e9, "latency": 1e-3}}
    timed = {**CPU, "loss_seconds": [5e-9, 3e-10]}
    columns = -(-SMALL.vocab_size // 2)
    (_, plain), (_, measured) = (
        step_time.ends_seconds(SMALL, run_of(tp=2), m, links, tokens) for m in (CPU, timed)
    )
    softmax = tokens * 2 * SMALL.vocab_size / 2 * 4 / CPU["memory_bw"]
    assert measured["forward"] - plain["forward"] == pytest.approx(
        tokens * columns * 5e-9 - softmax
    )
    assert measured["input_grad"] - plain["input_grad"] == pytest.approx(
        tokens * columns * 3e-10 - softmax
    )
    assert measured["weight_grad"] == plain["weight_grad"]
    one = [
        step_time.ends_seconds(SMALL, run_of(chunked_loss=False), m, links, tokens)[1]
        for m in (CPU, timed)
    ]
    assert one[0] == one[1]


@pytest.mark.parametrize("sequence_parallel,zero_stage", [(True, 0), (True, 1), (False, 0)])
def test_the_gradients_tp_ranks_hold_whole_are_summed_in_one_all_reduce_a_step(
    sequence_parallel, zero_stage
):
    # tensor_parallel.sum_partial_grads: under SP each block's two norm gains and the final norm's,
    # n_embd each (under ZeRO this rank's 1/dp of them), one all-reduce a step whatever the
    # micro-batches; with the key and value heads fewer than the tp ranks, each block's whole k and
    # v weights too
    link = {"busbw": 1e9, "latency": 1e-3}
    run = run_of(tp=2, dp=2, sequence_parallel=sequence_parallel, zero_stage=zero_stage)
    elements = (
        (2 * SMALL.n_layer + 1) * SMALL.n_embd / (2 if zero_stage else 1)
        if sequence_parallel
        else 0
    )
    expected = machines.collective_seconds("all_reduce", elements * 4, 2, link)
    seconds, sent = step_time.tp_summed_seconds(SMALL, run, [SMALL.n_layer], {0}, link)
    # (two ranks: an all-reduce sends its whole buffer once)
    assert seconds == pytest.approx(expected) and sent == elements * 4
    few_kv = ModelConfig(**{**vars(SMALL), "n_kv_head": 1})
    kv = 2 * SMALL.n_layer * SMALL.n_embd * (SMALL.n_embd // SMALL.n_head)
    assert step_time.tp_summed_seconds(few_kv, run_of(tp=2), [SMALL.n_layer], {0}, link) == (
        pytest.approx(machines.collective_seconds("all_reduce", kv * 4, 2, link)),
        kv * 4,
    )


def test_buckets_that_fit_in_the_backward_leave_only_the_last_exposed():
    # four equal buckets filling evenly over a 4 s backward, each reduced in 0.5 s: each is done
    # before the next is full, so only the last one's 0.5 s runs past the backward
    buckets = [(100, 0.5, 0)] * 4
    assert step_time.overlapped(buckets, 4.0, overlaps=True) == pytest.approx(0.5)
    # where nothing overlaps (gloo on the cores that compute) all of it is exposed
    assert step_time.overlapped(buckets, 4.0, overlaps=False) == pytest.approx(2.0)
    # buckets slower than the backward fills them queue up: 4 x 1.5 s from the first's ready time at
    # 1 s
    assert step_time.overlapped([(100, 1.5, 0)] * 4, 4.0, overlaps=True) == pytest.approx(
        1 + 4 * 1.5 - 4
    )


def test_zero_one_gathers_ahead_of_the_forward_wait_only_when_they_outrun_it():
    # two buckets of equal size, gathered in 1 s each; the forward reaches the second bucket after 3
    # s
    assert step_time.gathered_late(
        [(1, 1.0, 0), (1, 1.0, 0)], forward=6.0, overlaps=True
    ) == pytest.approx(1.0)
    assert step_time.gathered_late(
        [(1, 0.1, 0), (1, 0.1, 0)], forward=6.0, overlaps=True
    ) == pytest.approx(0.1)


def test_groups_inside_a_node_take_the_node_link_and_across_nodes_the_network():
    machine = machines.load_machine("h100")
    links = step_time.layout_links(machine, run_of(dp=8, tp=8), 8)
    assert links["tp"] == machine["node"]  # tp fastest: ranks 0-7, one node
    # dp: ranks 0, 8, 16, ...: one per node, one NIC each
    assert links["dp"]["busbw"] == machine["network"]["busbw"]
    links = step_time.layout_links(machine, run_of(dp=16), 8)
    assert links["dp"]["busbw"] == min(machine["node"]["busbw"], 8 * machine["network"]["busbw"])


def test_every_named_machine_has_every_field():
    for name in machines.MACHINES:
        machine = machines.load_machine(name)
        for field in (
            "matmul_flops",
            "peak_flops",
            "memory_bw",
            "attention_efficiency",
            "node",
            "network",
            "overlaps",
            "gpus_per_node",
            "memory_gib",
            "description",
        ):
            assert field in machine, (name, field)


def test_a_prediction_breaks_the_step_into_parts_that_sum_to_it():
    run = run_of(dp=2, tp=2, pp=2, gradient_accumulation_steps=4, zero_stage=1)
    p = step_time.predict(SMALL, run, machines.load_machine("a100"))
    assert sum(p["parts"].values()) == pytest.approx(p["step_s"])
    assert p["tokens_per_sec_per_gpu"] == pytest.approx(2 * 4 * 2 * 64 / p["step_s"] / 8)


def test_a_machine_written_to_a_file_reproduces_the_prediction(tmp_path):
    run = run_of(dp=2, zero_stage=2)
    first = step_time.predict(SMALL, run, machines.load_machine("l4"))
    path = tmp_path / "box.json"
    path.write_text(json.dumps(first["machine"]))
    assert (
        step_time.predict(SMALL, run, machines.load_machine(str(path)))["step_s"] == first["step_s"]
    )


def test_an_unknown_machine_is_refused_by_name():
    with pytest.raises(ValueError, match="machine = 'b300'"):
        machines.load_machine("b300")


# --machine=PATH.json that is JSON but not a machine, or no JSON at all: before, a traceback where
# the prediction first read the field (TypeError, ZeroDivisionError, KeyError, IsADirectoryError), a
# negative busbw a negative step, and a syntax error json's message without the file's name
A_MACHINE = {
    "matmul_flops": {"bfloat16": 1e15},
    "memory_bw": 3e12,
    "attention_efficiency": 0.5,
    "node": {"busbw": 3e11, "latency": 3e-6},
}
NOT_A_MACHINE = {  # what the file holds: (its text, the error line after "machine = 'PATH'")
    "a bare number": (
        "5",
        " holds 5, not an object: a machine file is an object of machines.MACHINES",
    ),
    "a rate as a string": (
        json.dumps({**A_MACHINE, "matmul_flops": {"bfloat16": "1e15"}}),
        ': matmul_flops.bfloat16 = "1e15": it must be a number of FLOP/s above',
    ),
    "node not an object": (
        json.dumps({**A_MACHINE, "node": 3e11}),
        ': node = 300000000000.0: it must be an object {"busbw": bytes/s',
    ),
    "a zero rate": (
        json.dumps({**A_MACHINE, "memory_bw": 0}),
        ": memory_bw = 0: it must be a number of bytes/s above 0",
    ),
    "a negative rate": (
        json.dumps({**A_MACHINE, "node": {"busbw": -1e9, "latency": 3e-6}}),
        ": node.busbw = -1000000000.0: it must be a number of bytes/s above 0",
    ),
    "a field missing": (
        json.dumps({k: v for k, v in A_MACHINE.items() if k != "memory_bw"}),
        ": memory_bw is missing: it must be a number of bytes/s above 0",
    ),
    "a syntax error": ('{"memory_bw": 3e12,}', " is not JSON (Expecting property name enclosed in"),
    "a folder": (None, " cannot be read (Is a directory): name a machine file"),
}
MODEL = [
    "--n_layer=2",
    "--n_embd=64",
    "--n_head=4",
    "--n_kv_head=4",
    "--block_size=32",
    "--vocab_size=512",
]
TOOLS = {  # each command line that takes --machine, at a model it plans in a moment
    "tools/step_time.py": lambda path, *flags: step_time.main(
        [*MODEL, f"--machine={path}", *flags]
    ),
    "tools/make_config.py --choose": lambda path, *flags: make_config.main(
        [
            *MODEL,
            "--nproc=2",
            "--choose=True",
            "--global_batch=4",
            f"--machine={path}",
            *flags,
            f"--out={path}.py",
        ]
    ),
}


def error_line(tool, *args):
    """The line a command line stops with (SystemExit's message): any other exception fails."""
    with pytest.raises(SystemExit) as stop:
        TOOLS[tool](*args)
    message = str(stop.value.code)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("holds", NOT_A_MACHINE)
def test_a_machine_file_that_is_not_a_machine_stops_the_tool_with_one_line_naming_file_and_field(
    tmp_path, tool, holds
):
    text, says = NOT_A_MACHINE[holds]
    path = tmp_path / "box.json"
    path.mkdir() if text is None else path.write_text(text)
    assert error_line(tool, path).startswith(f"error: machine = '{path}'{says}")


@pytest.mark.parametrize("tool", TOOLS)
def test_a_machine_file_without_a_rate_for_the_runs_dtype_is_refused_naming_it(tmp_path, tool):
    path = tmp_path / "box.json"
    path.write_text(json.dumps(A_MACHINE))  # bfloat16 only
    assert error_line(tool, path, "--dtype=float32").startswith(
        f"error: dtype = 'float32': machine '{path}' has no matmul_flops for it, only bfloat16: "
        f"choose --dtype="
    )


def test_every_named_machine_written_to_a_file_passes_the_checks_and_reads_back_the_same(tmp_path):
    for name in machines.MACHINES:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(machines.load_machine(name)))
        assert machines.load_machine(str(path)) == machines.load_machine(name)


@pytest.mark.parametrize("nproc", [0, -8])  # 0 was predicted as one process, -8 divided by zero
def test_a_process_count_below_one_is_refused_naming_nproc(nproc):
    refused = rf"^error: nproc = {nproc} must be at least 1: .* set --nproc=1"
    with pytest.raises(SystemExit, match=refused):
        step_time.main([f"--nproc={nproc}", "--machine=h100"])


def test_bench_predicts_its_step_and_step_time_given_its_machine_reproduces_it(tmp_path, capsys):
    from tools import bench

    flags = [
        "--n_layer=2",
        "--n_embd=64",
        "--n_head=4",
        "--n_kv_head=4",
        "--block_size=32",
        "--vocab_size=512",
        "--batch_size=2",
        "--gradient_accumulation_steps=2",
    ]
    measured = tmp_path / "measured.json"
    bench.main(flags + ["--warmup_steps=1", "--bench_steps=1", f"--trace={measured}"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1][len("RESULT ") :])
    # --trace without a pipeline: one more step's phases, in the order they ran, without overlap
    spans = [e for e in json.loads(measured.read_text())["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == [
        "F0",
        "B0",
        "F1",
        "B1",
        "dp reduction",
        "grad norm, clip",
        "optimizer",
    ]
    assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(spans, spans[1:]))
    assert result["predicted_step_s"] > 0 and result["machine"]["name"] == "auto"
    path = tmp_path / "here.json"
    path.write_text(json.dumps(result["machine"]))
    again = step_time.main(flags + [f"--machine={path}"])
    assert again["step_s"] == pytest.approx(result["predicted_step_s"], rel=1e-12)


def test_train_prints_the_predicted_step_at_start_up_and_the_measured_beside_it(tmp_path, capsys):
    from dist_utils import make_token_data, train_in_process

    data = make_token_data(str(tmp_path / "data"))
    train_in_process(
        [
            f"--data_dir={data}",
            f"--out_dir={tmp_path / 'out'}",
            "--n_layer=2",
            "--n_embd=64",
            "--n_head=4",
            "--n_kv_head=4",
            "--block_size=32",
            "--batch_size=2",
            "--max_iters=4",
            "--log_interval=2",
            "--eval_interval=0",
            "--checkpoint_interval=0",
        ]
    )
    out = capsys.readouterr().out
    assert re.search(r"^predicted step: [\d,.]+ ms on this machine \(cpu, ", out, re.M), out
    # beside the log line after the first step (whose memory train.py tracks): steps 3-4
    assert re.search(
        r"^step time: predicted [\d,.]+ ms, measured [\d,.]+ ms \(steps 3-4\)$", out, re.M
    ), out


def test_zero_one_gathers_wait_whole_when_overlap_param_gather_is_off():
    # small buckets: the first is needed at once, the later ones while the forward runs
    run = run_of(dp=2, zero_stage=1, bucket_size_mb=0.01)
    on = step_time.predict(SMALL, run, machines.load_machine("a100"))["parts"]["zero_gather"]
    off = step_time.predict(
        SMALL,
        run_of(dp=2, zero_stage=1, bucket_size_mb=0.01, overlap_param_gather=False),
        machines.load_machine("a100"),
    )["parts"]["zero_gather"]
    # off: every bucket's all-gather before the forward, whole
    pieces = step_time.rank_pieces(SMALL, run, step_time.stage_cut(SMALL, run), (0,))
    whole = sum(
        t
        for _, t, _ in step_time.bucket_collectives(
            pieces,
            run,
            step_time.layout_links(machines.load_machine("a100"), run, 8)["dp"],
            "all_gather",
        )
    )
    assert off == pytest.approx(whole) and on < off


def test_a_prediction_says_what_it_leaves_out_of_this_run(monkeypatch):
    """fp8 on a machine without an FP8 rate (predicted at the run's dtype's rate) and, on CPU, more
    threads than cores (a rank's cores are its own in the model) are said under the prediction,
    where train.py prints it, and not otherwise."""
    import os
    import torch
    import settings

    cfg = SimpleNamespace(
        **{
            **settings.DEFAULTS,
            "n_layer": 2,
            "n_embd": 64,
            "n_head": 4,
            "n_kv_head": 4,
            "block_size": 32,
            "vocab_size": 512,
            "batch_size": 2,
            "fp8": "rowwise",
        }
    )
    layout = SimpleNamespace(world_size=1, dp=1, tp=1)
    model_cfg = step_time.model_config_of(vars(cfg))
    machine = machines.load_machine("a100")
    monkeypatch.setattr(step_time, "startup_machine", lambda *args: machine)
    # noqa: E731
    predict = lambda: step_time.run_prediction(
        cfg, model_cfg, layout, torch.device("cpu"), torch.float32
    )[1]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(os.cpu_count() * torch.get_num_threads() + 1))
    assert (
        "(fp8 = 'rowwise': this machine has no FP8 matmul rate" in predict()
        and "threads share this machine's" in predict()
    )
    cfg.fp8 = "none"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    sharing = torch.get_num_threads() > (os.cpu_count() or 1)
    assert "fp8" not in predict() and ("threads share" in predict()) == sharing


# SMALL with an MLP twice as wide: per token forward, q, k, v and o 2 x 64 x 64 each, gate, up and
# down 2 x 64 x 128 each: 81,920 FLOPs; a micro-batch of 2 x 64 tokens: 10,485,760
FP8_SMALL = ModelConfig(
    n_layer=4,
    n_head=4,
    n_kv_head=4,
    n_embd=64,
    block_size=64,
    vocab_size=512,
    intermediate_size=128,
)
H100_FP8 = 794.5 / 989 * 1979e12  # bf16's MAMF share of the FP8 dense peak


def test_fp8_runs_a_blocks_matmuls_at_the_machines_fp8_rate():
    h100 = machines.load_machine("h100")
    fp8 = step_time.matmul_seconds(FP8_SMALL, run_of(fp8="tensorwise"), h100, 128)
    bf16 = step_time.matmul_seconds(FP8_SMALL, run_of(fp8="none"), h100, 128)
    assert fp8 == pytest.approx(10_485_760 / H100_FP8)
    assert bf16 == pytest.approx(10_485_760 / 794.5e12)
    assert bf16 / fp8 == pytest.approx(1979 / 989)


def test_a_cast_moves_its_operands_bytes_eager_or_compiled():
    """One linear, x (2, 3), W (4, 3), dy (2, 4), bf16 activations, 1 byte/s: tensorwise casts x and
    W forward (33 bytes an element eager, 2b + 1 compiled) and copies x8 (2) and y (4); dy for each
    gradient, W8 laid out for the first (2), dy8 and x8 for the second."""
    one = [(2, 3, 4, "column", False)]
    eager = step_time.fp8_cast_seconds(run_of(fp8="tensorwise"), {"memory_bw": 1.0}, one, 2)
    assert eager == [33 * 6 + 33 * 12 + 12 + 32, 33 * 8 + 24, 33 * 8 + 28]
    run = run_of(fp8="tensorwise", compile=True)
    compiled = step_time.fp8_cast_seconds(run, {"memory_bw": 1.0}, one, 2)
    assert compiled == [5 * 6 + 9 * 12 + 12 + 32, 5 * 8 + 24, 5 * 8 + 28]


def test_fp8s_casts_add_memory_time_to_a_blocks_forward():
    """FP8_SMALL's forward at tp 1, eager tensorwise, 128 tokens: the casts of q, k, v and o (x
    8,192, W 4,096, dy 8,192 elements) 454,656 bytes each, gate and up (x 8,192, W 8,192, dy
    16,384) 622,592, down (x 16,384, W 8,192, dy 8,192) 876,544: 3,940,352 over HBM3's 3.35 TB/s,
    beside the matmuls' time saved."""
    h100 = machines.load_machine("h100")
    links = {m: h100["node"] for m in ("tp", "cp", "ep")}
    on, off = (
        step_time.block_seconds(FP8_SMALL, run_of(fp8=recipe), h100, links, 128)
        for recipe in ("tensorwise", "none")
    )
    saved = 10_485_760 / 794.5e12 - 10_485_760 / H100_FP8
    assert on["forward"] - off["forward"] == pytest.approx(3_940_352 / 3.35e12 - saved)


def test_fp8_on_a_machine_without_fp8_tensor_cores_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"fp8 = 'tensorwise': machine 'a100' has no FP8"):
        step_time.predict(SMALL, run_of(fp8="tensorwise"), machines.load_machine("a100"))


def test_fp8s_amax_all_reduces_under_tp_are_priced_and_counted():
    """Tensorwise at tp 2: a column-parallel layer's W scale forward and dy's for each gradient
    over tp, a row-parallel layer's W and x scales forward; SMALL's block has 5 column-parallel
    linears (q, k, v, gate, up) and 2 row-parallel (o, down): 9 scalars forward, 10 backward."""
    run = run_of(tp=2, fp8="tensorwise")
    linears = step_time.fp8_linears(SMALL, run, 128)
    tp = step_time.fp8_collectives(run, linears, 2)["tp"]
    assert [len(side) for side in tp] == [9, 10]
    assert sorted({nbytes for side in tp for _, nbytes in side}) == [2, 4]


TRACED = [
    "--n_layer=4",
    "--n_embd=64",
    "--n_head=4",
    "--n_kv_head=4",
    "--block_size=64",
    "--vocab_size=512",
    "--batch_size=2",
    "--gradient_accumulation_steps=4",
    "--nproc=16",
    "--machine=a100",
    "--tp=2",
    "--cp=2",
    "--pp=2",
    "--zero_stage=1",
]


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble", "interleaved_1f1b"])
def test_the_predicted_trace_lays_out_every_rank_over_the_whole_step_naming_every_part(
    tmp_path, schedule
):
    path = tmp_path / "predicted.json"
    chunks = 2 if schedule == "interleaved_1f1b" else 1
    result = step_time.main(
        TRACED + [f"--pp_schedule={schedule}", f"--pp_chunks={chunks}", f"--trace={path}"]
    )
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    step_us = result["step_s"] * 1e6
    # one lane per pipeline rank, covered from 0 to the step without a gap or an overlap
    assert {(e["pid"], e["tid"]) for e in spans} == {(0, 0), (1, 0)}
    for r in range(2):
        lane = sorted((e for e in spans if e["pid"] == r), key=lambda e: e["ts"])
        assert lane[0]["ts"] == pytest.approx(0, abs=1e-6)
        for a, b in zip(lane, lane[1:]):
            assert a["ts"] + a["dur"] == pytest.approx(b["ts"], abs=1e-3)
        assert sum(e["dur"] for e in lane) == pytest.approx(step_us, rel=1e-9)
        # each micro-batch's actions, on every chunk the rank holds
        ops = "FBW" if schedule == "zero_bubble" else "FB"
        actions = sorted(e["name"] for e in lane if e["cat"] in ("F", "B", "W"))
        assert actions == sorted(f"{op}{i}" for op in ops for i in range(4) for _ in range(chunks))
    # every part of the step the prediction names has its spans (compute: F, B and W)
    categories = {e["cat"] for e in spans}
    named = {part for part, seconds in result["parts_s"].items() if seconds > 0}
    assert named - {"compute"} <= categories and "F" in categories
    assert {"tp", "cp", "pp", "dp", "zero_gather", "optimizer", "bubble"} <= named
    # the busiest rank's time per category is the prediction's part (pp and the bubble split
    # per wait here, as a whole there: their sum)
    busiest = max(
        range(2),
        key=lambda r: sum(e["dur"] for e in spans if e["pid"] == r and e["cat"] in ("F", "B", "W")),
    )
    of = lambda *cats: (
        sum(e["dur"] for e in spans if e["pid"] == busiest and e["cat"] in cats) / 1e6
    )
    parts = result["parts_s"]
    assert of("F", "B", "W") == pytest.approx(parts["compute"], rel=1e-9)
    for part in ("tp", "cp", "dp", "zero_gather", "optimizer"):
        assert of(part) == pytest.approx(parts[part], rel=1e-9, abs=1e-12), part
    assert of("pp", "bubble") == pytest.approx(parts["pp"] + parts["bubble"], rel=1e-9)
