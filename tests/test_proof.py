"""A run proves what it was asked for ran (ledger.py's unproven, train.prove_mechanisms): each
mechanism's wiring broken in turn (a stub put in its place, the run otherwise whole) stops the run
after its first step with a message naming the setting; unbroken, the same runs train. One launch
of 2 ranks runs every case, in-process (tests/dist_utils.py's way)."""

import io
from contextlib import redirect_stdout

import pytest
import torch
import torch.distributed as dist

import build
import context_parallel
import optim
import parallel
import train
from dist_utils import make_token_data, run_ranks, without_memory_measurement
from ledger import MechanismNotRun

TINY = [
    "--n_layer=2",
    "--n_head=4",
    "--n_kv_head=2",
    "--n_embd=32",
    "--block_size=32",
    "--batch_size=2",
    "--max_iters=1",
    "--eval_interval=0",
    "--checkpoint_interval=0",
    "--device=cpu",
    "--peak_flops=1e12",
]


class NoWork:
    """What a collective that was never posted leaves to wait for."""

    def wait(self):
        return True


def without_sequence_parallel(model, group, sequence_parallel=False):
    return APPLY_TP(model, group, False)


APPLY_TP = build.apply_tensor_parallel

# (the settings, the stub: (module, name, what replaces it), what the stop names[, a second stub])
CASES = [
    (["--dp=2"], (parallel.GradientBuckets, "launch", lambda self, bucket: None), "dp * cp = 2"),
    (["--tp=2"], (build, "apply_tensor_parallel", lambda model, *a: model), "tp = 2"),
    (
        ["--tp=2", "--sequence_parallel=True"],
        (build, "apply_tensor_parallel", without_sequence_parallel),
        "sequence_parallel",
    ),
    (
        ["--dp=2", "--zero_stage=1"],
        (parallel, "_all_gather_single", lambda *a, **k: NoWork()),
        "zero_stage = 1",
    ),
    (
        ["--cp=2"],
        # each rank's own keys and values "received" in place of its neighbour's: nothing sent
        (context_parallel, "_post_ring_exchange", lambda ts, group: ([t.clone() for t in ts], [])),
        "cp = 2",
    ),
    (
        ["config/moe.py", "--ep=2", "--n_expert=4"],
        (build, "apply_expert_parallel", lambda model, group: model),
        "ep = 2",
    ),
    (
        ["--fp8=tensorwise"],
        (build, "apply_fp8", lambda model, *a, **k: model),
        "fp8 = 'tensorwise'",
    ),
    # Muon that steps its matrices as plain SGD (DeepSpeed's silent failure, its issue 8441)
    (
        ["--optimizer=muon"],
        (optim.Muon, "step", lambda self, found_inf=None: sgd(self)),
        "optimizer = 'muon'",
    ),
    # stages that hand each other zeros in place of activations and gradients: nothing sent
    (
        ["--pp=2"],
        (parallel.PipelineComm, "send", lambda self, t, kind, to: NoWork()),
        "pp = 2",
        (parallel.PipelineComm, "receive", lambda self, kind, src, x: (zeros(self, x), NoWork())),
    ),
    # ZeRO-1 and ZeRO-2 Muon with one matrix stepped as SGD by its owner, the others orthogonalised:
    # the step's own check (train.check_muon_step) names it
    (
        ["--optimizer=muon", "--zero_stage=1"],
        (optim.Muon, "step", lambda self, found_inf=None: one_matrix_as_sgd(self, found_inf)),
        "optimizer = 'muon': this step updated 1 of its matrices without Newton-Schulz (blocks.",
    ),
    (
        ["--optimizer=muon", "--zero_stage=2"],
        (optim.Muon, "step", lambda self, found_inf=None: one_matrix_as_sgd(self, found_inf)),
        "optimizer = 'muon': this step updated 1 of its matrices without Newton-Schulz (blocks.",
    ),
    # Newton-Schulz off from the second step on: the first step's proof passes, the second stops
    (
        ["--optimizer=muon", "--max_iters=3"],
        (optim.Muon, "orthogonalised", lambda self, full, p: off_after_step_1(self, full, p)),
        "optimizer = 'muon': this step updated 14 of its matrices without Newton-Schulz",
    ),
    # a matrix orthogonalised twice by its owner: the first step's count is off by one
    (
        ["--optimizer=muon", "--zero_stage=1"],
        (optim.Muon, "orthogonalised", lambda self, full, p: first_twice(self, full, p)),
        "optimizer = 'muon': the first step orthogonalised",
    ),
    (["--compile=True"], (build, "compile_blocks", lambda model: True), "compile = True"),
]


def zeros(comm, x):
    return torch.zeros(comm.message_shape(x), dtype=comm.dtype, requires_grad=True)


MUON_STEP = optim.Muon.step


def one_matrix_as_sgd(muon, found_inf):
    i = next(i for i, p in enumerate(muon.matrices) if muon.state.get(p))  # the first it owns
    first = muon.matrices.pop(i)
    # its whole gradient, the reducer's (under ZeRO-2 p.grad is None)
    grad = dict(muon.grads())[first].view_as(first)
    try:
        MUON_STEP(muon, found_inf)
    finally:
        muon.matrices.insert(i, first)
    with torch.no_grad():
        first.add_(grad, alpha=-1e-3)


ORTHOGONALISED = optim.Muon.orthogonalised


def off_after_step_1(muon, full, p):
    """Newton-Schulz for the first step's matrices (at ZeRO-0 every rank's all), then the momentum
    itself, unorthogonalised."""
    if muon.orthogonalized < len(muon.matrices):
        return ORTHOGONALISED(muon, full, p)
    return full.to(p.dtype)


def first_twice(muon, full, p):
    if p is next(q for q in muon.matrices if muon.state.get(q)):  # the first this rank owns
        ORTHOGONALISED(muon, full, p)
    return ORTHOGONALISED(muon, full, p)


def sgd(muon):
    with torch.no_grad():
        for p in muon.matrices:
            p.add_(p.grad, alpha=-1e-3)


def _run_cases(rank, world_size, data_dir, out_dir):
    """Each case's run with its stub in place, then without: (the stop's message or None, the
    unbroken run's) per case."""
    found = []
    for i, (settings, *stubs) in enumerate(CASES):
        stubs = [stubs[0]] + stubs[2:]
        outcome = []
        for broken in (True, False):
            argv = [
                *settings[:1],
                *TINY,
                *settings[1:],
                f"--data_dir={data_dir}",
                f"--out_dir={out_dir}/{i}{broken}",
            ]
            originals = [(owner, name, getattr(owner, name)) for owner, name, _ in stubs]
            for owner, name, stub in stubs if broken else []:
                setattr(owner, name, stub)
            try:
                with redirect_stdout(io.StringIO()), without_memory_measurement():
                    cfg, _, _ = train.configure_run(argv)
                    train.train(cfg, build.setup(cfg))
                outcome.append(None)
            except MechanismNotRun as e:
                outcome.append(str(e))
            finally:
                for owner, name, original in originals:
                    setattr(owner, name, original)
            dist.barrier()
        found.append(outcome)
    return found


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("proof")
    make_token_data(root / "data", vocab_size=512)
    return run_ranks(_run_cases, 2, str(root / "data"), str(root / "out"), timeout=900)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[" ".join(c[0]) for c in CASES])
def test_a_mechanism_whose_wiring_is_broken_stops_the_run_naming_its_setting(outcomes, case):
    named = CASES[case][2]
    for rank, found in enumerate(outcomes):
        stopped, unbroken = found[case]
        assert stopped is not None, f"rank {rank}: the broken run trained on"
        assert stopped.startswith(named), stopped
        assert "This is picotron's fault" in stopped
        assert unbroken is None, f"rank {rank}: the whole run stopped: {unbroken}"
