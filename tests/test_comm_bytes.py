"""tools/step_time.py's comm_bytes held to the communication ledger (ledger.py) on every layout of
the equivalence matrix (tests/matrix.py's CASES: its pairwise rows and its named ones, float64 and
fp8 among them; not the refused cases, which never step, nor the resumed runs, whose layouts are
rows' again), and on two layouts the matrix does not reach (EXTRA). For each, the bytes rank 0
sends in one training step, per mechanism (dp, tp, cp, ep, pp), as the step-time model prices them
and as the ledger books them while the step runs, must be equal, to the byte. The world's own
all-reduces (the loss, the gradient norm, the stop vote: "world") are no mechanism's and the model
prices none.

One launch per world size (2, 4 and 8 processes) runs its layouts in turn in the same processes
(tools/bench.py's Picotron: train.py's step on random tokens), each with the case's settings as the
matrix trains it (matrix.settings_of), buckets of 10 KiB (several a step); one step first, so the
step counted is a steady one (ZeRO-3's first forward gathers its root units, which a steady step
gathered after the step before). The model's side is step_time.predict on a named machine (the H100,
which has an FP8 rate for the fp8 layouts; given a float64 rate for the float64 ones): the bytes do
not depend on the machine's rates, only on the dtype.

Two things are set up so that what the code sends is fixed before it runs:
  - a mixture of experts: which rank a token's experts live on (ep) and how many rows each
    expert's tp all-reduce carries depend on the router; the model prices them spread evenly, the
    kept rows (ep - 1) / ep of them to other ranks. Routing every token to every expert
    (n_expert_per_token = n_expert, a capacity then dropping nothing) makes that exact whatever the
    router learns.
  - ZeRO with sequence parallelism: the norm gains' gradients are summed over tp once a step for the
    slices this rank owns (tensor_parallel.sum_partial_grads), and where the slices cut the buckets
    decides how many of those elements rank 0 owns; the model prices the mean share, 1/dp. There the
    tp bytes of rank 0 and its data-parallel peers (the dp x cp ranks of its tp and pp coordinates)
    together must be what the model prices for each of them together (each its own data-parallel
    rank: Muon's deal under ZeRO gives each rank its own matrices to gather over tp).
"""

import io
from contextlib import redirect_stdout

import build
import matrix
from dist_utils import run_ranks
from ledger import MECHANISMS, CommLedger, layout_groups
from tools import machines, step_time
from tools.bench import Picotron, parse_args

# what every layout runs with beside the case's settings: the matrix's vocabulary (its data's
# end-of-text id, for doc_mask), 10 KiB buckets, CPU
RUN = dict(vocab_size=128, eot_token=127, bucket_size_mb=0.01, device="cpu", compile=False)

# one process, the matrix's dense GQA model, AdamW
ONE_PROCESS = dict(matrix.BASE, **matrix.MODELS["dense_gqa"], dp=1, tp=1, cp=1, pp=1, zero_stage=0)
# layouts no matrix row holds: FP8's amaxes recomputed with the activations; odd sizes, each ZeRO
# bucket padded to a multiple of 4 before it is cut
EXTRA = {
    "fp8-tp2-checkpointing": dict(
        ONE_PROCESS, tp=2, fp8="tensorwise", activation_checkpointing=True
    ),
    "dp4-zero1-odd-sizes": dict(
        ONE_PROCESS, dp=4, zero_stage=1, n_embd=42, n_head=3, n_kv_head=3, intermediate_size=60
    ),
}


def argv_of(values):
    """The command line of a layout's settings (matrix.settings_of's), as this test runs it."""
    values = {"dtype": "float32", **values, **RUN}
    if values.get("n_expert", 0) > 0:
        values["n_expert_per_token"] = values["n_expert"]  # (every token to every expert)
    return [f"--{k}={v}" for k, v in values.items()]


def layouts(world_size):
    """{name: argv} of every matrix case that trains on world_size processes, then EXTRA's."""
    out = {
        name: argv_of(matrix.settings_of(case))
        for name, case in matrix.CASES.items()
        if not case["refused"]
        and "resume_from" not in case
        and matrix.world_size(case) == world_size
    }
    for name, values in EXTRA.items():
        if values["dp"] * values["tp"] * values.get("cp", 1) * values["pp"] == world_size:
            out[name] = argv_of(values)
    return out


def machine_for(dtype):
    """The H100's figures; for a float64 run a float64 rate too (any: bytes do not depend on it)."""
    h100 = machines.load_machine("h100")
    rates = h100["matmul_flops"]
    return dict(h100, matmul_flops={"float64": rates["float32"], **rates})


def _ledger_and_model(rank, world_size, argvs):
    """For each layout: (the bytes this rank sent in one step, by mechanism, as the ledger booked
    them; the model's comm_bytes for this rank's data-parallel rank; its (tp, pp) coordinates;
    whether ZeRO and sequence parallelism share out the tp sum, see the top)."""
    out = []
    for argv in argvs:
        with redirect_stdout(io.StringIO()):
            cfg, _ = parse_args(argv)
            setup = build.setup(cfg, training=False)
            picotron = Picotron(cfg, setup)
        picotron.step(0)
        layout = setup.layout
        with CommLedger(layout_groups(layout, picotron.parts.pipeline)) as ledger:
            picotron.step(1)
        run = step_time.run_of(cfg, world_size)
        run.dp_rank = layout.dp_cp_rank
        model = step_time.predict(setup.model_cfg, run, machine_for(cfg.dtype))
        sent = ledger.bytes_sent()
        shared = cfg.zero_stage >= 1 and cfg.sequence_parallel and layout.dp * layout.cp > 1
        coordinates = (layout.tp_rank, layout.pp_rank)
        out.append(
            ({m: sent.get(m, 0) for m in MECHANISMS}, model["comm_bytes"], coordinates, shared)
        )
    return out


def assert_ledger_equals_model(names, ranks):
    """Rank 0's bytes per mechanism, ledger against model, exactly, for every layout; where ZeRO
    and sequence parallelism share out the tp sum, its tp bytes and its data-parallel peers'
    together."""
    differences = []
    for i, name in enumerate(names):
        _, _, coordinates, shared = ranks[0][i]
        for mechanism in MECHANISMS:
            peers = [0]
            if mechanism == "tp" and shared:
                peers = [r for r, of in enumerate(ranks) if of[i][2] == coordinates]
            got = sum(ranks[r][i][0][mechanism] for r in peers)
            want = sum(ranks[r][i][1][mechanism] for r in peers)
            if got != want:
                differences.append(
                    f"{name}: {mechanism} ledger {got}, model {want} (ranks {peers})"
                )
    assert not differences, "\n".join(differences)


def check_world_size(world_size):
    named = layouts(world_size)
    assert named, f"no layout on {world_size} processes"
    ranks = run_ranks(_ledger_and_model, world_size, list(named.values()), timeout=600)
    assert_ledger_equals_model(list(named), ranks)


def test_two_ranks_send_the_bytes_the_model_prices():
    check_world_size(2)


def test_four_ranks_send_the_bytes_the_model_prices():
    check_world_size(4)


def test_eight_ranks_send_the_bytes_the_model_prices():
    check_world_size(8)
