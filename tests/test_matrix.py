"""The equivalence matrix (tests/matrix.py): every declared case trains like one process, or is
refused with its rule's message; and docs/equivalence.md shows exactly these cases.

The cases share launches: one launch of 2, one of 4 and one of 8 processes
(tests/dist_utils.run_ranks), each running all the cases of its size in turn through train.py's
configure_run, setup and train; the runs of one process (the references, a case resumed at one
process) run here, in the pytest process. Then each case is compared with its reference
(tests/dist_utils.py: the equivalence rule): the loss and gradient norm of every step, the evaluated
train and val losses, the final weights and the final optimizer states.

    python -m pytest tests/test_matrix.py --write-matrix    also rewrites docs/equivalence.md
"""

import os
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

import matrix
from dist_utils import (
    FLOAT64_RTOL,
    FP8_RTOL,
    ROOT,
    WEIGHT_RTOL,
    assert_same_losses_and_norms,
    assert_same_tensors,
    checkpoint_optimizer_states,
    checkpoint_weights,
    read_records,
    run_ranks,
)

PAGE = ROOT / "docs" / "equivalence.md"
MEASURED = {}  # case name: its largest differences and result, for the page
SECONDS = {}  # "matrix": how long the runs took


@contextmanager
def one_thread():
    """The one-process runs here use one thread, as each rank of a launch does (the machine is
    shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def selected_cases(request):
    """The names of the cases whose test is selected, and of the runs they resume."""
    wanted = {
        item.callspec.params["name"]
        for item in request.session.items
        if item.originalname == "test_case_equals_one_process_or_is_refused"
    }
    for name in list(wanted):
        while "resume_from" in matrix.CASES[name]:
            name = matrix.CASES[name]["resume_from"]
            wanted.add(name)
    return wanted


def one_process_references(wanted, data, root):
    """{case: its reference's out_dir}, each distinct reference run once in this process."""
    references, reference_of = {}, {}
    for name, case in matrix.CASES.items():
        if case["refused"] or name not in wanted:
            continue
        values = matrix.reference_values(case)
        key = tuple(sorted(values.items()))
        if key not in references:
            references[key] = str(root / f"reference{len(references)}")
            error = matrix.run_one(
                matrix.argv_of(values, data, references[key]), None, references[key] + ".log"
            )
            assert error is None, f"the one-process reference of {name} failed: {error}"
        reference_of[name] = references[key]
    return reference_of


@pytest.fixture(scope="module")
def matrix_runs(tmp_path_factory, request):
    """Every case run, and its reference: (errors: {name: each rank's error or None}, out_dir:
    {name: the case's out_dir}, reference: {name: its reference's out_dir}). Only the cases whose
    test is selected run (pytest -k pairwise-07), with the runs they resume."""
    root = tmp_path_factory.mktemp("matrix")
    wanted = selected_cases(request)
    data = matrix.make_matrix_data(str(root / "data"))
    out_dir = {name: str(root / name) for name in matrix.CASES}

    def job(name):
        case = matrix.CASES[name]
        source = case.get("resume_from")
        argv = matrix.argv_of(
            matrix.settings_of(case), data, out_dir[name], resume=source is not None
        )
        copy_from = (
            os.path.join(out_dir[source], f"ckpt_{matrix.RESUME_AT:07d}") if source else None
        )
        return name, argv, copy_from, out_dir[name] + ".rank{rank}.log"

    start, errors, timings, seconds_of = time.time(), {}, [], {}
    by_world = {}
    for name, case in matrix.CASES.items():
        if name in wanted:
            by_world.setdefault(matrix.world_size(case), []).append(name)
    for world in sorted(w for w in by_world if w > 1):
        # resumed ones last
        names = sorted(by_world[world], key=lambda n: "resume_from" in matrix.CASES[n])
        began = time.time()
        per_rank = run_ranks(matrix.run_launch, world, [job(n) for n in names], timeout=1800)
        timings.append(f"{len(names)} cases on {world} processes in {time.time() - began:.0f} s")
        errors.update({n: [r[n][0] for r in per_rank] for n in names})
        seconds_of.update({n: per_rank[0][n][1] for n in names})
    began = time.time()
    with one_thread():
        for name in by_world.get(1, []):
            _, argv, copy_from, log = job(name)
            errors[name] = [matrix.run_one(argv, copy_from, log.format(rank=0))]
        reference_of = one_process_references(wanted, data, root)
    timings.append(
        f"{len(set(reference_of.values()))} references and {len(by_world.get(1, []))} "
        f"one-process cases here in {time.time() - began:.0f} s"
    )
    seconds = time.time() - start
    slowest = sorted(seconds_of, key=seconds_of.get, reverse=True)[:5]
    print(
        f"\nmatrix: {'; '.join(timings)}; {seconds:.0f} s in all; the slowest cases: "
        + ", ".join(f"{n} {seconds_of[n]:.1f} s" for n in slowest),
        flush=True,
    )
    SECONDS["matrix"] = seconds
    return SimpleNamespace(errors=errors, out_dir=out_dir, reference=reference_of)


def compare(name, runs):
    """The case against its reference; returns its largest differences."""
    case = matrix.CASES[name]
    errors = runs.errors[name]
    if case["refused"]:
        for rank, error in enumerate(errors):
            assert error is not None, (
                f"{name}: rank {rank} ran, where picotron must refuse: {case['refused']}"
            )
            first = error.split("\n\n")[0]
            assert case["refused"] in first, (
                f"{name}: rank {rank} stopped with another message: {first}"
            )
        return {}
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    assert not failed, (
        f"{name} failed on rank {failed[0][0]} (the logs: {runs.out_dir[name]}.rank*.log):\n"
        f"{failed[0][1]}"
    )
    records = read_records([f"--out_dir={runs.out_dir[name]}"])
    reference = read_records([f"--out_dir={runs.reference[name]}"])
    first = matrix.RESUME_AT + 1 if "resume_from" in case else 1
    assert [r["step"] for r in records if "loss" in r] == list(range(first, matrix.STEPS + 1))
    evaluated = [r["step"] for r in records if "val_loss" in r and "train_loss" in r]
    assert evaluated == [s for s in (matrix.RESUME_AT, matrix.STEPS) if s >= first], (
        f"{name}: evaluated {evaluated}"
    )
    rtol = FLOAT64_RTOL if case.get("dtype") == "float64" else None
    worst = assert_same_losses_and_norms(
        records, reference, label=name, rtol=FP8_RTOL if "fp8" in case else rtol
    )
    final = f"ckpt_{matrix.STEPS:07d}"
    got, want = (os.path.join(d, final) for d in (runs.out_dir[name], runs.reference[name]))
    weights = assert_same_tensors(
        checkpoint_weights(got), checkpoint_weights(want), rtol=rtol or WEIGHT_RTOL, label=name
    )
    state = assert_same_tensors(
        checkpoint_optimizer_states(got),
        checkpoint_optimizer_states(want),
        rtol=rtol or WEIGHT_RTOL,
        what="optimizer states",
        label=name,
    )
    evals = [worst[k] for k in ("train_loss", "val_loss") if k in worst]
    return dict(
        loss=worst["loss"],
        grad_norm=worst["grad_norm"],
        eval=max(evals) if evals else None,
        weights=weights,
        state=state,
    )


@pytest.mark.parametrize("name", list(matrix.CASES))
def test_case_equals_one_process_or_is_refused(name, matrix_runs):
    try:
        MEASURED[name] = {**compare(name, matrix_runs), "result": "pass"}
    except AssertionError:
        MEASURED[name] = {"result": "FAIL"}
        raise


def test_the_cases_cover_every_pair_of_values():
    """Every pair of values of two axes is in a case that runs, or, where picotron refuses every
    combination holding it, in a refused case; every case runs on at most 8 processes."""
    total, ran, refused = matrix.coverage()
    assert ran + refused == total == len(matrix.ALL_PAIRS)
    assert all(matrix.world_size(c) <= 8 for c in matrix.CASES.values())
    assert all(len(matrix.refusals(c)) == 1 for c in matrix.REFUSED)


def test_the_page_shows_exactly_the_declared_cases(request):
    """docs/equivalence.md has one row per case, with the case's layout and features, and no other:
    it cannot claim a case that is not run. (Its numbers are the last run's: --write-matrix rewrites
    it from this run's, once every case has run.)"""
    if request.config.getoption("--write-matrix"):
        missing = [name for name in matrix.CASES if name not in MEASURED]
        assert not missing, (
            f"--write-matrix writes the page from a run of every case; not run: {missing}"
        )
        matrix.write_page(PAGE, MEASURED, SECONDS.get("matrix"))
    rows = matrix.page_rows(PAGE)
    want = [matrix.row_key(name) for name in matrix.CASES]
    assert rows == want, (
        f"docs/equivalence.md is out of date: rows {sorted(set(rows) ^ set(want))} differ; "
        f"regenerate it: python -m pytest tests/test_matrix.py --write-matrix"
    )
