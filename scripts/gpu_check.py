"""The two Python parts of scripts/gpu_check.sh (which says what the check is and how to run it).

    python scripts/gpu_check.py env [--dry-run]  the machine: GPU, versions, two measured ceilings
    python scripts/gpu_check.py summary LOGS     the Markdown table of a check's logs in LOGS

env prints `ENV {json}` last. The ceilings are what MFU can be read against beside the datasheet: a
large bf16 matrix product on random data (never zeros: they run faster) and a device-to-device copy
(bytes read plus bytes written), each the median of 10 timed runs after 3 warm-ups, timed with CUDA
events.

summary reads what each section left in LOGS: sections.tsv (one line per section: section, check,
status, seconds, log file), the env log's ENV line, the pytest junit XML of the tests (each test's
`figures` property, from record_property) and each bench log's RESULT line. A memory planner's
prediction is shown beside the measured peak (bench's memory rows: tools/memory_plan.py's prediction
and the measured step's tensors), and tools/step_time.py's predicted step beside the measured one
(bench's `predicted_step_s`, its machine=auto measured on the GPU).
"""

import json
import os
import statistics
import subprocess
import sys
import xml.etree.ElementTree as ET

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import metrics  # noqa: E402
from model import flash_attn_available  # noqa: E402


# -----------------------------------------------------------------------------
# env


def timed_median(fn, warmup=3, repeats=10):
    """Median seconds of fn on the GPU, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def env(dry_run=False):
    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "flash_attn": flash_attn_available(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    try:
        info["driver"] = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        info["driver"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(
            gpu=p.name,
            capability=f"{p.major}.{p.minor}",
            memory_gib=p.total_memory / 2**30,
            multiprocessors=p.multi_processor_count,
            peak_bf16=metrics.gpu_peak_flops(p.name, torch.bfloat16),
        )
        n = 8192
        a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        info["matmul_bf16_flops"] = 2 * n**3 / timed_median(lambda: a @ b)
        del a, b
        src = torch.randn(2**29, device="cuda")  # 2 GiB of fp32
        dst = torch.empty_like(src)
        info["copy_bytes_per_s"] = 2 * src.numel() * 4 / timed_median(lambda: dst.copy_(src))
        del src, dst
    else:
        info.update(gpu=None, cpu_threads=torch.get_num_threads(), dry_run=dry_run)
        info["matmul_fp32_flops"] = metrics.measure_cpu_peak_flops(
            torch.float32, sizes=(256,), repeats=2
        )
    for k, v in info.items():
        print(f"{k}: {v}")
    print("ENV " + json.dumps(info), flush=True)


# -----------------------------------------------------------------------------
# summary


def last_json_line(path, prefix):
    """The JSON after `prefix` on the last line of the file that starts with it, or None."""
    if not path or not os.path.exists(path):
        return None
    found = None
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith(prefix):
                found = line[len(prefix) :]
    try:
        return json.loads(found) if found else None
    except ValueError:
        return None


def last_error_line(path):
    """The last line of a log that looks like the reason it stopped (an error, a traceback's last
    line)."""
    if not path or not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    for line in reversed(lines):
        if (
            line.startswith(("error:", "RuntimeError", "torch.OutOfMemoryError", "AssertionError"))
            or "Error" in line.split(":")[0]
        ):
            return line
    return lines[-1] if lines else ""


def cell(text, limit=220):
    """One table cell: no newlines, pipes escaped, long text cut."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def test_rows(xml_path):
    """(check, result, figures, seconds) for each test in a pytest junit XML file."""
    rows = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        figures = " ".join(
            p.get("value", "") for p in case.iter("property") if p.get("name") == "figures"
        )
        result = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                message = (node.get("message") or node.text or "").strip().splitlines()
                result = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag] + (
                    f": {message[0]}" if message else ""
                )
                break
        rows.append((case.get("name"), result, figures, float(case.get("time") or 0)))
    return rows


def gib(n):
    return f"{n / 2**30:.1f} GiB"


def bench_figures(result, env_info):
    """The figures of one bench RESULT: speed, MFU (of the datasheet peak, and of the measured
    matmul rate), tools/step_time.py's predicted step, memory (and the planner's prediction), the
    first step (compilation), the profile."""
    parts = [f"{result['tokens_per_sec']:,.0f} tok/s", f"{result['ms_per_step']:,.0f} ms/step"]
    if result.get("mfu") is not None:
        mfu = f"MFU {100 * result['mfu']:.1f}%"
        measured = (env_info or {}).get("matmul_bf16_flops")
        if measured and result.get("peak_flops"):
            of_measured = result["mfu"] * result["peak_flops"] / measured
            mfu += f" ({100 * of_measured:.0f}% of the measured bf16 matmul)"
        parts.append(mfu)
    else:
        parts.append("MFU n/a")
    # (--compare_fp8: the same step with fp8 the other way, timed in turn)
    if result.get("compare_fp8"):
        parts.append(
            f"{result['ms_per_step'] / result['compare_fp8_ms_per_step']:.2f}x the time of "
            f"fp8={result['compare_fp8']}"
        )
    # (tools/step_time.py on bench's machine=auto, measured there)
    predicted = result.get("predicted_step_s")
    if predicted:
        error = 1e3 * predicted / result["ms_per_step"] - 1
        parts.append(f"predicted {1e3 * predicted:,.0f} ms/step ({100 * error:+.0f}%)")
    # the planner's prediction: memory_plan's for the measured step's tensors (bench's memory rows,
    # rank 0)
    rank0 = (result.get("memory") or [{}])[0]
    planned, measured = rank0.get("predicted_bytes"), rank0.get("measured_bytes")
    parts.append(
        f"peak {gib(result['peak_mem_bytes'])} (planned {gib(planned) if planned else '-'}"
        + (f" against {gib(measured)} of the step's tensors)" if measured and planned else ")")
    )
    if result.get("first_step_s") is not None:
        parts.append(f"first step {result['first_step_s']:.1f} s")
    if not result.get("compiled"):
        parts.append("eager (not compiled)")
    profile = result.get("profile")
    if profile:
        kinds = sorted(profile["kinds"].items(), key=lambda kv: -kv[1])
        parts.append(
            "profile: "
            + ", ".join(f"{k} {100 * v:.0f}%" for k, v in kinds if v >= 0.005)
            + f"; device busy {100 * profile['device_busy']:.0f}%"
        )
    return ", ".join(parts)


def caption(env_info):
    if not env_info:
        return "**GPU check**: no ENV line (the env section did not run)"
    if env_info.get("gpu"):
        where = (
            f"{env_info['gpu']} (sm {env_info['capability']}, {env_info['memory_gib']:.0f} GiB, "
            f"driver {env_info.get('driver')})"
        )
    elif env_info.get("dry_run"):
        where = (
            f"CPU ({env_info.get('cpu_threads')} threads; a dry run: the figures are not a GPU's)"
        )
    else:
        where = f"CPU ({env_info.get('cpu_threads')} threads; no CUDA GPU: this is no GPU check)"
    flash = "installed" if env_info["flash_attn"] else "not installed"
    return (
        f"**GPU check** on {where}; torch {env_info['torch']}, CUDA {env_info['cuda']}, triton "
        f"{env_info['triton']}, flash-attn {flash}"
    )


def read_sections(logs):
    """[(section, check, status, seconds, log file)] from LOGS/sections.tsv, one a line."""
    sections = []
    with open(os.path.join(logs, "sections.tsv")) as f:
        for line in f:
            if line.strip():
                section, check, status, seconds, log = line.rstrip("\n").split("\t")
                sections.append((section, check, status, float(seconds), log))
    return sections


def env_figures(env_info):
    """The env row's figures: the measured ceilings beside the datasheet's peak."""
    if env_info and env_info.get("gpu"):
        peak = env_info.get("peak_bf16")
        datasheet = f"{peak / 1e12:.0f}" if peak else "unknown (not in metrics.GPU_PEAK_FLOPS)"
        return (
            f"bf16 matmul 8192^3 {env_info['matmul_bf16_flops'] / 1e12:.0f} TFLOP/s measured, "
            f"datasheet {datasheet}; "
            f"device copy {env_info['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write)"
        )
    if env_info:
        return f"fp32 matmul {env_info['matmul_fp32_flops'] / 1e9:.1f} GFLOP/s (CPU)"
    return ""


def summary(logs):
    """Print and write the table; return how many sections failed or timed out (a budget skip is no
    failure: the table says it), so the script's exit code says whether the check passed."""
    sections = read_sections(logs)
    env_log = next((log for s, _, _, _, log in sections if s == "env"), None)
    env_info = last_json_line(env_log, "ENV ")
    rows = []
    for section, check, status, seconds, log in sections:
        if section == "env":
            shown = status if status != "ok" or env_info else "no ENV line"
            rows.append((section, check, shown, env_figures(env_info), seconds))
        elif section == "tests":
            xml = os.path.join(os.path.dirname(log), "tests.xml")
            cases = test_rows(xml) if os.path.exists(xml) else []
            counts = {}
            for _, result, _, _ in cases:
                counts[result.split(":")[0]] = counts.get(result.split(":")[0], 0) + 1
            tally = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no results"
            rows.append((section, check, status, tally, seconds))
            rows += [(section, name, result, figures, t) for name, result, figures, t in cases]
        else:  # bench
            result = last_json_line(log, "RESULT ")
            if result:
                rows.append((section, check, status, bench_figures(result, env_info), seconds))
            else:
                rows.append((section, check, status, last_error_line(log), seconds))
    out = [
        caption(env_info),
        "",
        "| section | check | result | figures | seconds |",
        "|---|---|---|---|---|",
    ]
    out += [
        f"| {cell(s)} | {cell(c)} | {cell(r)} | {cell(fig, 600)} | {t:.0f} |"
        for s, c, r, fig, t in rows
    ]
    text = "\n".join(out)
    with open(os.path.join(logs, "summary.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return sum(status.startswith(("FAILED", "TIMEOUT")) for _, _, status, _, _ in sections)


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "env":
        env(dry_run="--dry-run" in sys.argv[2:])
    elif len(sys.argv) == 3 and sys.argv[1] == "summary":
        failed = summary(sys.argv[2])
        if failed:
            sys.exit(
                f"gpu_check: {failed} section(s) failed or timed out (the table's result column)"
            )
    else:
        sys.exit(__doc__)
