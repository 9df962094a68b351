"""scripts/gpu_check.sh works before any GPU has run it: its dry run goes through every section at a
tiny size on the CPU, its table renders failures and the figures, and the parts of the GPU path that
can run on a CPU (the pinning branch, the dtype rule, the attention's input dtype) do what the CUDA
tests expect."""

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from conftest import ROOT
from dist_utils import make_token_data

import model as model_module
from data import TRAIN_STREAM, get_batch, load_data, read_data_meta, window_starts
from model import ModelConfig, Transformer, choose_device_and_dtype

SCRIPT = ROOT / "scripts" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402  (scripts/gpu_check.py)


# --- the script -----------------------------------------------------------------------------------


def test_the_script_parses_and_rejects_an_unknown_section():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    proc = subprocess.run(["bash", str(SCRIPT), "benchh"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown section or option 'benchh'" in proc.stderr


def test_dry_run_goes_through_every_section_and_prints_the_table(tmp_path):
    """The dry run runs the very commands of a GPU run (the CUDA tests' collection, tools/bench.py
    with every argument the GPU run passes, the profile and its trace) at a tiny size on the CPU."""
    proc = subprocess.run(
        [
            "bash",
            str(SCRIPT),
            "--dry-run",
            "--work",
            str(tmp_path / "work"),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("**GPU check**") :]
    rows = [
        [c.strip() for c in line.strip("|").split(" | ")]
        for line in table.splitlines()
        if line.startswith("| ")
    ]
    sections = [
        (r[0], r[1], r[2]) for r in rows[1:] if r[0] != "tests" or r[1].startswith("pytest")
    ]
    assert sections == [
        ("env", "the machine: GPU, versions, bf16 matmul and copy rates", "ok"),
        ("tests", "pytest -m cuda tests/test_cuda.py", "ok"),
        ("bench", "2 x 64, batch 2 x 64", "ok"),
        ("bench", "2 x 96, batch 2 x 64", "ok"),
        ("bench", "3 x 128, batch 2 x 64", "ok"),
        ("bench", "fp8 tensorwise against bf16, 2 x 96, batch 2 x 64", "ok"),
    ], sections
    tests = [r[2] for r in rows[1:] if r[0] == "tests" and not r[1].startswith("pytest")]
    assert len(tests) >= 10 and all(r.startswith("skipped: needs a CUDA GPU") for r in tests), tests
    bench_rows = [line for line in table.splitlines() if line.startswith("| bench")]
    # every bench row carries bench's own predictions: tools/step_time.py's step and memory_plan's
    # peak
    assert all(
        "tok/s" in line and "ms/step (" in line and "GiB (planned 0.0 GiB against" in line
        for line in bench_rows
    ), bench_rows
    assert "profile:" in bench_rows[2] and "x the time of fp8=none" in bench_rows[3]
    assert (tmp_path / "out" / "summary.md").read_text().strip() == table.split("\n(logs:")[
        0
    ].strip()
    listing = subprocess.run(
        ["tar", "-tzf", str(tmp_path / "out" / "logs.tar.gz")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (
        "tests.xml" in listing and "profile_1b.json.gz" in listing and "bench_350m.log" in listing
    )


def write_logs(logs, bench_result, junit):
    logs.mkdir()
    env = {
        "torch": "2.11.0+cu130",
        "cuda": "13.0",
        "triton": "3.6.0",
        "flash_attn": False,
        "gpu": "NVIDIA H200",
        "capability": "9.0",
        "memory_gib": 139.8,
        "driver": "580.1",
        "peak_bf16": 989e12,
        "matmul_bf16_flops": 790e12,
        "copy_bytes_per_s": 4.3e12,
    }
    (logs / "env.log").write_text("gpu: NVIDIA H200\nENV " + json.dumps(env) + "\n")
    (logs / "tests.xml").write_text(junit)
    (logs / "bench_1b.log").write_text("building\nRESULT " + json.dumps(bench_result) + "\n")
    (logs / "bench_350m.log").write_text(
        "Traceback (most recent call last):\ntorch.OutOfMemoryError: CUDA out of "
        "memory. Tried to allocate 2.00 GiB\n"
    )
    (logs / "sections.tsv").write_text(
        f"env\tthe machine\tok\t5\t{logs / 'env.log'}\n"
        f"tests\tpytest -m cuda\tFAILED (exit 1)\t80\t{logs / 'tests.log'}\n"
        f"bench\t24 x 1024\tFAILED (exit 1)\t30\t{logs / 'bench_350m.log'}\n"
        f"bench\t24 x 2048\tok\t60\t{logs / 'bench_1b.log'}\n"
        f"bench\t12 x 768\tskipped: 12s of the 300s budget left\t0\t{logs / 'bench_125m.log'}\n"
    )


def test_summary_shows_failures_figures_and_the_predictions(tmp_path, capsys):
    junit = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
      <testcase classname="tests.test_cuda" name="test_fp16_trains_like_bf16" time="3.2">
        <properties>
          <property name="figures" value="step 50 loss fp16 2.1 / bf16 2.1 (0.10% apart)"/>
        </properties>
      </testcase>
      <testcase classname="tests.test_cuda" name="test_step_never_waits[bfloat16-False]" time="1.0">
        <properties><property name="figures" value="x = y.item()"/></properties>
        <failure
          message="AssertionError: the bfloat16 training step waits | here">traceback</failure>
      </testcase></testsuite></testsuites>"""
    result = {
        "tokens_per_sec": 51234.5,
        "ms_per_step": 320.0,
        "mfu": 0.52,
        "peak_flops": 989e12,
        "peak_mem_bytes": 60 * 2**30,
        "first_step_s": 41.2,
        "predicted_step_s": 0.288,
        "memory": [{"rank": 0, "predicted_bytes": 58 * 2**30, "measured_bytes": 59 * 2**30}],
        "compiled": True,
        "profile": {
            "device_busy": 0.97,
            "kinds": {"matmul": 0.7, "attention": 0.2, "other": 0.1, "copies": 0.001},
        },
    }
    write_logs(tmp_path / "logs", result, junit)
    # the tests' and the 355M bench's sections
    assert gpu_check.summary(str(tmp_path / "logs")) == 2
    out = capsys.readouterr().out
    assert out.startswith(
        "**GPU check** on NVIDIA H200 (sm 9.0, 140 GiB, driver 580.1); torch 2.11.0+cu130"
    )
    assert "| tests | pytest -m cuda | FAILED (exit 1) | 1 passed, 1 FAILED | 80 |" in out
    assert (
        "| tests | test_fp16_trains_like_bf16 | passed | step 50 loss fp16 2.1 / bf16 2.1 (0.10% "
        "apart) | 3 |" in out
    )
    # the pipe escaped
    assert "FAILED: AssertionError: the bfloat16 training step waits \\| here" in out
    assert (
        "51,234 tok/s, 320 ms/step, MFU 52.0% (65% of the measured bf16 matmul), predicted 288 "
        "ms/step (-10%), peak 60.0 GiB (planned 58.0 GiB against 59.0 GiB of the step's tensors), "
        "first step 41.2 s, profile: matmul 70%, attention 20%, other 10%; device busy 97%"
    ) in out
    assert (
        "| bench | 24 x 1024 | FAILED (exit 1) | torch.OutOfMemoryError: CUDA out of memory." in out
    )
    assert "| bench | 12 x 768 | skipped: 12s of the 300s budget left |" in out
    assert "bf16 matmul 8192^3 790 TFLOP/s measured, datasheet 989" in out
    assert (tmp_path / "logs" / "summary.md").read_text() == out


def test_without_a_cuda_gpu_the_check_stops_at_once_and_fails():
    """Run for real (not --dry-run) where torch sees no CUDA GPU, the check refuses before any
    section: it used to time every section on the CPU, print four FAILED rows and exit 0 as 'a dry
    run'."""
    proc = subprocess.run(
        ["bash", str(SCRIPT), "bench-125m"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable},
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (
        "no CUDA GPU here" in proc.stderr
        and "--dry-run" in proc.stderr
        and "===" not in proc.stdout
    )


def test_a_failed_section_fails_the_check_and_the_caption_says_no_gpu(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    info = {
        "torch": "2.13.0",
        "cuda": None,
        "triton": None,
        "flash_attn": False,
        "gpu": None,
        "cpu_threads": 2,
        "dry_run": False,
        "matmul_fp32_flops": 5e10,
    }
    (logs / "env.log").write_text("ENV " + json.dumps(info) + "\n")
    (logs / "sections.tsv").write_text(
        f"env\tthe machine\tok\t1\t{logs / 'env.log'}\n"
        f"bench\t2 x 64\tFAILED (exit 1)\t3\t{logs / 'b.log'}\n"
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "summary", str(logs)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and "1 section(s) failed" in proc.stderr, proc.stderr
    assert "no CUDA GPU: this is no GPU check" in proc.stdout and "dry run" not in proc.stdout


# --- the GPU path's pieces that run on a CPU ------------------------------------------------------


def test_get_batch_pins_and_copies_without_blocking_for_a_cuda_device(tmp_path, monkeypatch):
    """The branch get_batch takes for a CUDA device, run on the CPU: each of x and y is pinned, then
    copied with non_blocking=True (tests/test_cuda.py checks the same on a GPU, with the copies
    really pinned)."""
    data_dir = make_token_data(str(tmp_path / "data"), n_tokens=5000)
    meta = read_data_meta(data_dir)
    split = load_data(data_dir, "train", 32, meta["vocab_size"], meta)
    starts = window_starts(0, TRAIN_STREAM, 0, split[2], 32, 3)
    x_cpu, y_cpu = get_batch(split, starts, 32, torch.device("cpu"))
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        calls.append(("to", args, kwargs))
        return real_to(self, "cpu")

    monkeypatch.setattr(torch.Tensor, "to", to)
    fake_cuda = types.SimpleNamespace(type="cuda")
    x, y = get_batch(split, starts, 32, fake_cuda)
    monkeypatch.undo()
    assert calls == ["pin", ("to", (fake_cuda,), {"non_blocking": True})] * 2
    assert torch.equal(x, x_cpu) and torch.equal(y, y_cpu)


@pytest.mark.parametrize(
    "capability,dtype",
    [
        ((9, 0), torch.bfloat16),
        ((8, 0), torch.bfloat16),
        ((7, 5), torch.float16),
        ((6, 1), torch.float16),
    ],
)
def test_dtype_auto_on_a_cuda_device_follows_the_compute_capability(monkeypatch, capability, dtype):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: capability)
    dev, got, why = choose_device_and_dtype("cuda", "auto")
    assert dev.type == "cuda" and got == dtype and f"{capability[0]}.{capability[1]}" in why


def test_attention_inputs_are_half_precision_under_autocast(monkeypatch):
    """SDPA takes its flash kernel only for bf16/fp16 inputs: under autocast the queries, keys and
    values reach it in the autocast dtype (RoPE computes in fp32 and casts back). The dtype rules of
    linear and of the elementwise ops are the same on CPU and CUDA, so this holds on the GPU too."""
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", spy)
    m = Transformer(
        ModelConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32),
        attn_impl="sdpa",
        chunked_loss=True,
    )
    m.init_weights(0)
    x = torch.randint(0, 128, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(x, x)
    assert seen == [(torch.bfloat16,) * 3] * 2
