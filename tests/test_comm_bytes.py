"""tools/step_time.py's comm_bytes held to the communication ledger (ledger.py): for each layout,
the bytes rank 0 sends in one training step, per mechanism (dp, tp, cp, ep, pp), as the step-time
model prices them and as the ledger books them while the step runs, must be equal, to the byte. The
world's own all-reduces (the loss, the gradient norm, the stop vote: "world") are no mechanism's and
the model prices none of them.

One launch per world size runs every layout in turn in the same processes (tools/bench.py's
Picotron: train.py's step on random tokens), two steps first so the step counted is a steady one.
The model's side is step_time.predict on a named machine at float32 (the H100, which has an FP8
rate for the fp8 layouts): the bytes do not depend on the machine, only on the dtype.

Two layouts are set up so that what the code sends is fixed before it runs:
  - expert parallelism: which rank a token's experts live on depends on the router, so the bytes an
    all-to-all sends elsewhere vary from step to step; the model prices them spread evenly, (ep - 1)
    / ep of the kept rows. Routing every token to every expert (n_expert_per_token = n_expert,
    dropless) makes that exact whatever the router learns.
  - ZeRO with sequence parallelism: the norm gains' gradients are summed over tp once a step for the
    slices this rank owns (tensor_parallel.sum_partial_grads), and where the slices cut the buckets
    decides how many of those elements rank 0 owns; the model prices the mean share, 1/dp. There the
    tp bytes of rank 0 and of its data-parallel peer together must be dp times the model's.
"""

import io
from contextlib import redirect_stdout
from pathlib import Path

import build
from dist_utils import run_ranks
from ledger import MECHANISMS, CommLedger, layout_groups
from tools import machines, step_time
from tools.bench import Picotron, parse_args

ROOT = Path(__file__).resolve().parent.parent
MOE = str(ROOT / "config" / "moe.py")

# 4 blocks (interleaved 1F1B and ZB-V cut them in 2 x 2 chunks), buckets of 10 KiB (several a step)
TINY = [
    "--n_layer=4",
    "--n_embd=32",
    "--n_head=4",
    "--n_kv_head=2",
    "--block_size=16",
    "--batch_size=2",
    "--vocab_size=128",
    "--gradient_accumulation_steps=2",
    "--bucket_size_mb=0.01",
    "--device=cpu",
    "--dtype=float32",
    "--compile=False",
]
EVERY_EXPERT = ["--n_expert=4", "--n_expert_per_token=4", "--capacity_factor=0"]

TWO_RANKS = [
    ["--dp=2", "--zero_stage=0"],
    ["--dp=2", "--zero_stage=1"],
    ["--dp=2", "--zero_stage=2"],
    ["--dp=2", "--zero_stage=3"],
    ["--tp=2"],
    ["--tp=2", "--sequence_parallel=True"],
    ["--tp=2", "--sequence_parallel=True", "--activation_checkpointing=True"],
    ["--tp=2", "--activation_checkpointing=True", *EVERY_EXPERT],
    ["--cp=2"],
    # fp8's amax all-reduces (and rowwise's sums before rounding) over the tp and cp groups
    ["--tp=2", "--fp8=tensorwise"],
    ["--tp=2", "--fp8=tensorwise", "--activation_checkpointing=True"],
    ["--tp=2", "--fp8=rowwise"],
    ["--cp=2", "--fp8=rowwise"],
    ["--pp=2", "--pp_schedule=1f1b"],
    ["--pp=2", "--pp_schedule=interleaved_1f1b", "--pp_chunks=2"],
    ["--pp=2", "--pp_schedule=zbv", "--pp_chunks=2"],
    [MOE, "--dp=2", "--ep=2", "--n_expert_per_token=8", "--capacity_factor=0"],
]
FOUR_RANKS = [
    ["--tp=2", "--dp=2", "--zero_stage=1", "--sequence_parallel=True"],
    ["--dp=2", "--pp=2", "--pp_schedule=1f1b"],
    ["--dp=2", "--pp=2", "--pp_schedule=1f1b", "--zero_stage=2"],
    # odd sizes: each ZeRO bucket padded to a multiple of 4 before it is cut
    ["--dp=4", "--zero_stage=1", "--n_embd=42", "--n_head=3", "--n_kv_head=3"],
]


def _ledger_and_model(rank, world_size, layouts):
    """For each layout (a config file first, where there is one): (the bytes this rank sent in one
    step, by mechanism, as the ledger booked them; the model's comm_bytes for rank 0)."""
    out = []
    for argv in layouts:
        config, flags = (argv[:1], argv[1:]) if argv[0].endswith(".py") else ([], argv)
        with redirect_stdout(io.StringIO()):
            cfg, _ = parse_args(config + TINY + flags)
            setup = build.setup(cfg, training=False)
            picotron = Picotron(cfg, setup)
        picotron.step(0)
        picotron.step(1)
        with CommLedger(layout_groups(setup.layout, picotron.parts.pipeline)) as ledger:
            picotron.step(2)
        run = step_time.run_of(cfg, world_size)
        model = step_time.predict(setup.model_cfg, run, machines.load_machine("h100"))
        sent = ledger.bytes_sent()
        out.append(({m: sent.get(m, 0) for m in MECHANISMS}, model["comm_bytes"]))
    return out


def assert_ledger_equals_model(layouts, ranks, exceptions=()):
    """Rank 0's bytes per mechanism, ledger against model, exactly, for every layout; `exceptions`:
    (layout index, mechanism, the ranks whose ledger bytes together are dp times the model's)."""
    differences = []
    for i, argv in enumerate(layouts):
        booked, priced = ranks[0][i]
        for mechanism in MECHANISMS:
            summed = next((peers for j, m, peers in exceptions if (j, m) == (i, mechanism)), None)
            got = sum(ranks[r][i][0][mechanism] for r in summed) if summed else booked[mechanism]
            want = priced[mechanism] * (len(summed) if summed else 1)
            if got != want:
                differences.append(f"{' '.join(argv)}: {mechanism} ledger {got}, model {want}")
    assert not differences, "\n".join(differences)


def test_two_ranks_send_the_bytes_the_model_prices():
    assert_ledger_equals_model(TWO_RANKS, run_ranks(_ledger_and_model, 2, TWO_RANKS))


def test_four_ranks_send_the_bytes_the_model_prices():
    # tp x dp with ZeRO-1 and SP: rank 0's data-parallel peer is rank 2 (tp is numbered fastest)
    ranks = run_ranks(_ledger_and_model, 4, FOUR_RANKS)
    assert_ledger_equals_model(FOUR_RANKS, ranks, exceptions=[(0, "tp", (0, 2))])
