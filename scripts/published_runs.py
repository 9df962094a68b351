"""
tools/step_time.py's prediction beside published training runs (../shared/published_runs.md): every
row picotron's settings can express, predicted on the named machine of its GPU, its error against
the published step time, and the rows it cannot express, with why. Nothing is tuned to the published
figures: where a source leaves a setting unpublished, the choice below is said in the row's note and
made the same way for every row of that source.

    python scripts/published_runs.py              # the markdown table docs/performance.md carries

A row's model is the source's (layers, width, heads, MLP, vocabulary, sequence); picotron's
architecture stands in where the FLOPs are the same (RoPE for learned positions or ALiBi), and
picotron's step is predicted: its fused attention, fp32 gradients and AdamW, which the source's code
need not share.
"""

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import machines  # noqa: E402
import settings  # noqa: E402
from tools import step_time  # noqa: E402
from model import ModelConfig  # noqa: E402

SOURCE = "../shared/published_runs.md"

# (layers, width, heads, kv heads, MLP width, vocabulary, sequence, mlp, tied)
GPT = lambda L, h, a, V=51200, s=2048, tied=True: (L, h, a, a, 4 * h, V, s, "gelu", tied)
MODELS = {
    "gpt1.7": GPT(24, 2304, 24),
    "gpt3.6": GPT(30, 3072, 32),
    "gpt7.5": GPT(36, 4096, 32),
    "gpt18": GPT(40, 6144, 48),
    "gpt39": GPT(48, 8192, 64),
    "gpt76": GPT(60, 10240, 80),
    "gpt146": GPT(80, 12288, 96),
    "gpt310": GPT(96, 16384, 128),
    "gpt530": GPT(105, 20480, 128),
    "gpt1t": GPT(128, 25600, 160),
    "gpt175": GPT(96, 12288, 96),
    "mlm1.7": GPT(24, 2048, 16, 131072, 4096, False),
    "mlm7": GPT(30, 4096, 32, 131072, 4096, False),
    "mlm16": GPT(32, 6144, 48, 131072, 4096, False),
    "mlm32": GPT(48, 7168, 56, 131072, 4096, False),
    "mlm70": GPT(84, 8192, 64, 131072, 4096, False),
    "mlm119": GPT(92, 10240, 80, 131072, 4096, False),
    "mlm177": GPT(96, 12288, 96, 131072, 4096, False),
    "mlm314": GPT(96, 16384, 128, 131072, 4096, False),
    "mlm462": GPT(112, 18432, 144, 131072, 4096, False),
    "llama3-8b-32k": (32, 4096, 32, 8, 14336, 128256, 32768, "swiglu", False),
    "llama3-70b-8k": (80, 8192, 64, 8, 28672, 128256, 8192, "swiglu", False),
    "llama3-405b": (126, 16384, 128, 8, 53248, 128256, 8192, "swiglu", False),
    "llama2-13b": (40, 5120, 40, 40, 13824, 32000, 4096, "swiglu", False),
    "llama2-70b": (80, 8192, 64, 8, 28672, 32000, 4096, "swiglu", False),
    "mpt7": GPT(32, 4096, 32, 50368, 2048),
    "mpt7-8k": GPT(32, 4096, 32, 50368, 8192),
    "mpt13": GPT(40, 5120, 40, 50368, 2048),
    "mpt30": GPT(48, 7168, 56, 50368, 2048),
    "mpt70": GPT(80, 8192, 64, 50368, 2048),
}

# (id, model, machine, dp, tp, pp, schedule, chunks, micro-batch, global batch, zero, checkpointing,
# published step s, note). Unpublished settings, one rule per source:
# - Narayanan Table 1 (v, mbs unpublished): interleaved over 2 chunks where pp > 1, micro-batch 1;
# - Table 2: schedule 1F1B; recompute "not stated": on (full), as Table 1's eq. 3 assumes;
# - Megatron-LM's table (mbs, SP, recompute, distributed optimizer unpublished): micro-batch 1,
#   sequence parallel where tp > 1, no recompute (its MFU counts none), ZeRO-1 (the distributed
#   optimizer), 1F1B.
N1 = "v and mbs unpublished: interleaved x2 where pp > 1, mbs 1"
N2 = "schedule and recompute not stated: 1F1B, full recompute"
NM = "mbs/SP/recompute/dist-opt unpublished: mbs 1, SP, none, ZeRO-1"
ROWS = [
    ("NAR-1", "gpt1.7", "a100", 32, 1, 1, "1f1b", 1, 1, 512, 0, True, 3.53, N1),
    ("NAR-2", "gpt3.6", "a100", 32, 2, 1, "1f1b", 1, 1, 512, 0, True, 3.7, N1),
    ("NAR-3", "gpt7.5", "a100", 32, 4, 1, "1f1b", 1, 1, 512, 0, True, 3.7, N1),
    ("NAR-4", "gpt18", "a100", 32, 8, 1, "1f1b", 1, 1, 1024, 0, True, 9.4, N1),
    ("NAR-5", "gpt39", "a100", 32, 8, 2, "interleaved_1f1b", 2, 1, 1536, 0, True, 14.5, N1),
    ("NAR-6", "gpt76", "a100", 32, 8, 4, "interleaved_1f1b", 2, 1, 1792, 0, True, 16.1, N1),
    ("NAR-7", "gpt146", "a100", 24, 8, 8, "interleaved_1f1b", 2, 1, 2304, 0, True, 24.8, N1),
    ("NAR-8", "gpt310", "a100", 15, 8, 16, "interleaved_1f1b", 2, 1, 2160, 0, True, 37.6, N1),
    (
        "NAR-9",
        "gpt530",
        "a100",
        9,
        8,
        35,
        "interleaved_1f1b",
        1,
        1,
        2520,
        0,
        True,
        54.1,
        N1 + "; 105 blocks do not split into 35 x 2 chunks: 1F1B",
    ),
    ("NAR-10", "gpt1t", "a100", 6, 8, 64, "interleaved_1f1b", 2, 1, 3072, 0, True, 103, N1),
    ("NZ-1", "gpt175", "a100", 384, 1, 1, "1f1b", 1, 4, 1536, 3, True, 81.6, N2),
    ("NZ-2", "gpt175", "a100", 768, 1, 1, "1f1b", 1, 2, 1536, 3, True, 66.7, N2),
    ("NZ-3", "gpt175", "a100", 1536, 1, 1, "1f1b", 1, 1, 1536, 3, True, 66.7, N2),
    ("NZ-4", "gpt530", "a100", 640, 1, 1, "1f1b", 1, 4, 2560, 3, True, 256, N2),
    ("NZ-5", "gpt530", "a100", 1120, 1, 1, "1f1b", 1, 2, 2240, 3, True, 180, N2),
    ("NZ-6", "gpt530", "a100", 2240, 1, 1, "1f1b", 1, 1, 2240, 3, True, 184, N2),
    ("NZ-7", "gpt175", "a100", 4, 8, 12, "1f1b", 1, 1, 1536, 0, True, 76.8, N2),
    ("NZ-8", "gpt175", "a100", 8, 8, 12, "1f1b", 1, 1, 1536, 0, True, 39.4, N2),
    ("NZ-9", "gpt175", "a100", 16, 8, 12, "1f1b", 1, 1, 1536, 0, True, 20.8, N2),
    ("NZ-10", "gpt530", "a100", 2, 8, 35, "1f1b", 1, 1, 2240, 0, True, 206, N2),
    ("NZ-11", "gpt530", "a100", 4, 8, 35, "1f1b", 1, 1, 2240, 0, True, 106, N2),
    ("NZ-12", "gpt530", "a100", 8, 8, 35, "1f1b", 1, 1, 2240, 0, True, 55.4, N2),
    ("MLM-1", "mlm1.7", "h100", 48, 1, 1, "1f1b", 1, 1, 192, 1, False, 0.452, NM),
    ("MLM-2", "mlm7", "h100", 48, 2, 1, "1f1b", 1, 1, 192, 1, False, 0.8, NM),
    ("MLM-3", "mlm16", "h100", 48, 4, 1, "1f1b", 1, 1, 192, 1, False, 0.85, NM),
    ("MLM-4", "mlm32", "h100", 48, 8, 1, "1f1b", 1, 1, 192, 1, False, 0.892, NM),
    ("MLM-5", "mlm70", "h100", 48, 8, 2, "1f1b", 1, 1, 384, 1, False, 2.18, NM),
    ("MLM-6", "mlm119", "h100", 48, 8, 4, "1f1b", 1, 1, 768, 1, False, 3.65, NM),
    ("MLM-7", "mlm177", "h100", 48, 8, 6, "1f1b", 1, 1, 1152, 1, False, 5.26, NM),
    ("MLM-8", "mlm314", "h100", 48, 8, 8, "1f1b", 1, 1, 1536, 1, False, 8.4, NM),
    ("MLM-9", "mlm462", "h100", 48, 8, 16, "1f1b", 1, 1, 3072, 1, False, 12.7, NM),
    ("TT-3", "llama3-70b-8k", "a100", 64, 1, 1, "1f1b", 1, 1, 64, 3, True, 24.7, "FSDP2 as ZeRO-3"),
    ("TT-4", "llama2-13b", "a100", 64, 1, 1, "1f1b", 1, 2, 128, 3, False, 3.79, "FSDP2 as ZeRO-3"),
    ("TT-8", "llama2-70b", "a100", 64, 1, 1, "1f1b", 1, 2, 128, 3, True, 23.2, "FSDP2 as ZeRO-3"),
    (
        "TT-22",
        "llama3-405b",
        "h100",
        16,
        8,
        1,
        "1f1b",
        1,
        2,
        32,
        3,
        True,
        18.8,
        "a 500 W HBM2e H100, slower than the SXM figures used: errs fast",
    ),
    (
        "TT-23",
        "llama3-70b-8k",
        "h100",
        32,
        8,
        1,
        "1f1b",
        1,
        16,
        512,
        3,
        True,
        27.4,
        "a 500 W HBM2e H100, slower than the SXM figures used: errs fast; compiled",
    ),
    (
        "TT-15",
        "llama3-70b-8k",
        "h100",
        32,
        8,
        1,
        "1f1b",
        1,
        16,
        512,
        3,
        True,
        19.8,
        "TT-23 in float8 (tensorwise, compiled): errs fast as TT-23",
    ),
    (
        "TT-18",
        "llama3-8b-32k",
        "h100",
        8,
        1,
        1,
        "1f1b",
        1,
        1,
        8,
        3,
        True,
        8.42,
        "float8 (tensorwise, compiled), FSDP2 as ZeRO-3: errs fast as TT-23",
    ),
    (
        "MOS-1",
        "mpt7",
        "h100",
        8,
        1,
        1,
        "1f1b",
        1,
        6,
        48,
        3,
        False,
        1.15,
        "FSDP as ZeRO-3; RoPE for ALiBi",
    ),
    (
        "MOS-2",
        "mpt13",
        "h100",
        64,
        1,
        1,
        "1f1b",
        1,
        2,
        128,
        3,
        False,
        0.853,
        "FSDP as ZeRO-3; RoPE for ALiBi",
    ),
    (
        "MOS-3",
        "mpt30",
        "h100",
        32,
        1,
        1,
        "1f1b",
        1,
        14,
        1344,
        3,
        True,
        37.3,
        "FSDP as ZeRO-3; RoPE for ALiBi",
    ),
    (
        "MOS-4",
        "mpt70",
        "h100",
        64,
        1,
        1,
        "1f1b",
        1,
        8,
        2048,
        3,
        True,
        63.1,
        "FSDP as ZeRO-3; RoPE for ALiBi",
    ),
    (
        "MOS-5",
        "mpt7-8k",
        "h100",
        8,
        1,
        1,
        "1f1b",
        1,
        8,
        128,
        3,
        True,
        18.9,
        "FSDP as ZeRO-3; RoPE for ALiBi",
    ),
    (
        "MOS-6",
        "mpt7",
        "a100",
        8,
        1,
        1,
        "1f1b",
        1,
        6,
        96,
        3,
        False,
        5.3,
        "FSDP as ZeRO-3; RoPE for ALiBi",
    ),
    (
        "MOS-7",
        "mpt13",
        "a100",
        8,
        1,
        1,
        "1f1b",
        1,
        2,
        48,
        3,
        False,
        5.43,
        "FSDP as ZeRO-3; RoPE for ALiBi",
    ),
    (
        "MOS-8",
        "mpt30",
        "a100",
        8,
        1,
        1,
        "1f1b",
        1,
        3,
        504,
        3,
        True,
        141,
        "FSDP as ZeRO-3; RoPE for ALiBi",
    ),
    (
        "MOS-9",
        "mpt70",
        "a100",
        64,
        1,
        1,
        "1f1b",
        1,
        8,
        2048,
        3,
        True,
        160,
        "FSDP as ZeRO-3; RoPE for ALiBi",
    ),
]

# the float8 rows (torchao's float8 linears, tensorwise: its default recipe, which torchtitan's
# benchmark does not override) and the compiled ones (compile changes only fp8's casts here)
FLOAT8 = {"TT-15", "TT-18"}
COMPILED = FLOAT8 | {"TT-23"}

NOT_EXPRESSIBLE = [
    (
        "TT-1, TT-2, TT-5, TT-6, TT-7, TT-25",
        "selective activation checkpointing (per layer or per op): picotron "
        "recomputes whole blocks or none",
    ),
    (
        "TT-9 to TT-12",
        "selective activation checkpointing, on a 500 W HBM2e H100 whose peak torchtitan itself "
        "does not know",
    ),
    (
        "TT-13, TT-14",
        "float8 with selective activation checkpointing (per op): picotron recomputes whole "
        "blocks or none",
    ),
    (
        "TT-16, TT-17",
        "float8 with asynchronous tensor parallelism, and the pipeline's micro-batches unpublished",
    ),
    (
        "TT-19 to TT-21",
        "float8 with context parallelism through torch's context_parallel, which runs the fused "
        "SDPA kernel on each block of the ring (rotate method unstated); picotron's ring computes "
        "its blocks' scores unfused, priced at the matmul rate: at 64k-256k tokens the attention "
        "is most of the step, so the row would compare two attention kernels, not FP8",
    ),
    (
        "TT-24, TT-26",
        "asynchronous tensor parallelism (communication overlapped inside the matmuls): picotron's "
        "TP collectives are not overlapped",
    ),
]


def predict_row(row):
    """(predicted seconds, the prediction) of one row, from the training settings' defaults and its
    own."""
    rid, model, machine, dp, tp, pp, schedule, chunks, mbs, gbs, zero, ac, _, _ = row
    L, h, a, kv, ffn, V, s, mlp, tied = MODELS[model]
    cfg = {st.name: st.default for st in settings.TRAINING}
    cfg.update(
        n_layer=L,
        n_embd=h,
        n_head=a,
        n_kv_head=kv,
        intermediate_size=ffn,
        vocab_size=V,
        block_size=s,
        mlp=mlp,
        tie_embeddings=tied,
        dp=dp,
        tp=tp,
        pp=pp,
        pp_schedule=schedule,
        pp_chunks=chunks,
        batch_size=mbs,
        gradient_accumulation_steps=gbs // (dp * mbs),
        zero_stage=zero,
        activation_checkpointing=ac,
        sequence_parallel=tp > 1 and model.startswith("mlm"),
        fp8="tensorwise" if rid in FLOAT8 else "none",
        compile=rid in COMPILED,
    )
    model_cfg = ModelConfig(**{k: cfg[k] for k in ModelConfig.__dataclass_fields__ if k in cfg})
    prediction = step_time.predict(model_cfg, step_time.run_of(cfg), machines.load_machine(machine))
    return prediction["step_s"], prediction


def ranks(values):
    """Each value's rank, 1 the smallest, ties sharing their mean rank."""
    order = sorted(values)
    return [order.index(v) + 1 + (order.count(v) - 1) / 2 for v in values]


def spearman(a, b):
    """Spearman's rank correlation: Pearson's of the ranks."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def rankings(rows, predicted):
    """Lines: for each model run on one machine at several GPU counts (dp varied, the rest held),
    the rank correlation of the predicted step times with the published."""
    groups = {}
    for row in rows:
        groups.setdefault((row[1], row[2], row[4], row[5], row[10]), []).append(row)
    lines = []
    for (model, machine, *_), members in groups.items():
        if len(members) < 2:
            continue
        published = [r[12] for r in members]
        mine = [predicted[r[0]] for r in members]
        lines.append(
            f"| {model} on {machine} | "
            + ", ".join(f"{r[0]} ({r[3] * r[4] * r[5]} GPUs)" for r in members)
            + f" | {spearman(published, mine):.2f} |"
        )
    return lines


def row_line(row, seconds, prediction, error):
    """A row of the table: the run, its layout, published and predicted step, the error and the
    largest predicted parts."""
    rid, _, machine, dp, tp, pp, schedule, chunks, mbs, gbs, zero, ac, published, note = row
    top = sorted(prediction["parts"].items(), key=lambda kv: -kv[1])[:3]
    layout = (
        f"{dp}/{tp}/{pp}"
        + (f", {schedule} x{chunks}" if pp > 1 else "")
        + f", {mbs} x {gbs // (dp * mbs)}, {zero}, {'full' if ac else 'none'}"
    )
    parts = ", ".join(f"{k} {v / seconds:.0%}" for k, v in top)
    return (
        f"| {rid} | {dp * tp * pp} | {layout} | {machine} | {published:g} | {seconds:.3g} | "
        f"{error:+.0%} | {parts} | {note} |"
    )


def main():
    lines = [
        "| ID | GPUs | layout (dp/tp/pp, schedule, mbs x m, ZeRO, recompute) | machine | "
        "published s | predicted s | error | largest parts | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    errors, predicted = {}, {}
    for row in ROWS:
        rid, published = row[0], row[12]
        seconds, p = predict_row(row)
        errors[rid], predicted[rid] = seconds / published - 1, seconds
        lines.append(row_line(row, seconds, p, errors[rid]))
    absolute = [abs(e) for e in errors.values()]
    faster, slower = sum(e < 0 for e in errors.values()), sum(e > 0 for e in errors.values())
    bf16 = [abs(e) for rid, e in errors.items() if rid not in FLOAT8]
    float8 = ", ".join(f"{rid} {errors[rid]:+.0%}" for rid in sorted(FLOAT8))
    lines += [
        "",
        f"{len(errors)} rows expressed; median absolute error {statistics.median(absolute):.0%}, "
        f"mean {statistics.mean(absolute):.0%}, {faster} predicted faster than published, "
        f"{slower} slower. Without the {len(FLOAT8)} float8 rows ({float8}): median "
        f"{statistics.median(bf16):.0%}, mean {statistics.mean(bf16):.0%}. Source of every "
        f"published figure: {SOURCE}.",
        "",
        "| one model, several GPU counts | runs | "
        "Spearman, predicted against published step time |",
        "|---|---|---|",
    ]
    lines += rankings([row for row in ROWS if row[0] not in FLOAT8], predicted)
    lines += ["", "| rows not expressed | why |", "|---|---|"]
    lines += [f"| {ids} | {why} |" for ids, why in NOT_EXPRESSIBLE]
    print("\n".join(lines))
    return errors


if __name__ == "__main__":
    main()
