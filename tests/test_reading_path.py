"""scripts/reading_path.py traces what a learner reads for each mechanism from real runs: its table
has one row per mechanism, the layout its 2-process run adds and the lines read; the README shows
exactly that table. The counting rule behind it (a function entered counts whole, a nested def
within its outer def once, only picotron's own files count, the tools apart, the one-process run's
functions subtracted) is checked on a small project and a trace written here, its counts made by
hand."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import reading_path  # noqa: E402  (scripts/reading_path.py)

MECHANISMS = [
    "tensor parallel",
    "data parallel",
    "ZeRO-1",
    "1F1B",
    "ring attention",
    "ZeRO-3",
    "expert parallel",
    "Muon",
]


@pytest.fixture(scope="module")
def printed():
    """The script's table: one launch of 2 ranks for the rows, the one-process runs beside it."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "reading_path.py")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout.strip()


def test_the_table_has_a_row_per_mechanism_ending_in_lines_read(printed):
    header, rule, *rows = printed.splitlines()
    assert header == reading_path.HEADER.splitlines()[0] and re.fullmatch(r"(\|---)+\|", rule)
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert [c[0] for c in cells] == MECHANISMS, [c[0] for c in cells]
    for c in cells:
        assert re.fullmatch(r"`[^`]+`", c[1]), f"{c[0]}: the layout {c[1]}"
        assert len(c) == 3 and re.fullmatch(r"\d+", c[-1]), f"{c[0]}: {c[1:]}"
        assert int(c[-1]) > 0, f"{c[0]}: a layout that enters nothing beyond one process"


def test_the_readme_shows_the_table_the_script_prints(printed):
    readme = (ROOT / "README.md").read_text()
    assert printed + "\n" in readme, (
        "README.md's reading table is not what "
        "scripts/reading_path.py prints now: run "
        "python scripts/reading_path.py --write"
    )


# -----------------------------------------------------------------------------
# the counting rule, on a small project and a trace written here

CORE = '''\
import torch


def entry(x):
    """Two docstring lines,
    counted."""

    # a comment inside, counted
    def inner(y):
        return y

    return inner(x) + helper(x)


@staticmethod
def helper(x):
    return x


class Layer:
    def forward(self, x):
        return [v for v in x]


def never_entered():
    return 0
'''
PLAN = """\
def plan():
    return 1
"""
ENTRY, INNER = ("core.py", 4, "entry"), ("core.py", 9, "inner")
HELPER = ("core.py", 15, "helper")  # a code object's first line: its first decorator's
FORWARD, LISTCOMP = ("core.py", 21, "forward"), ("core.py", 22, "<listcomp>")


@pytest.fixture
def project(tmp_path, monkeypatch):
    """core.py, a tool (plan.py), files in tests/ and scripts/: the spans of the ones counted."""
    (tmp_path / "core.py").write_text(CORE)
    (tmp_path / "plan.py").write_text(PLAN)
    for folder in ("tests", "scripts"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "other.py").write_text(PLAN)
    monkeypatch.setattr(reading_path, "TOOLS", {"plan.py"})
    return reading_path.load(tmp_path)


def test_a_function_entered_counts_whole_and_a_nested_def_once(project):
    read, tools = reading_path.count(project, {ENTRY, INNER}, set())
    # entry: its 7 non-blank lines (the docstring and the comment in them), inner's 2 among them
    assert len(read) == 7 and not tools
    assert reading_path.by_function(project, {ENTRY, INNER}, read) == {"core.py": [("entry", 7)]}


def test_a_decorated_function_is_keyed_at_its_decorator_and_counts_it(project):
    assert len(reading_path.count(project, {HELPER}, set())[0]) == 3
    assert not reading_path.count(project, {("core.py", 16, "helper")}, set())[0]


def test_what_the_one_process_run_entered_is_subtracted(project):
    entered = {ENTRY, INNER, HELPER, FORWARD, LISTCOMP}
    read, _ = reading_path.count(project, entered, {HELPER})
    assert len(read) == 7 + 2  # entry, and forward with its comprehension; not helper
    assert reading_path.by_function(project, entered, read) == {
        "core.py": [("entry", 7), ("Layer.forward", 2)]
    }


def test_only_picotrons_own_functions_count_and_the_tools_apart(project):
    entered = {
        ENTRY,
        ("plan.py", 1, "plan"),
        ("tests/other.py", 1, "plan"),
        ("scripts/other.py", 1, "plan"),
        ("torch/nn/modules/module.py", 1, "forward"),
        ("core.py", 1, "<module>"),
        # (a class body's code)
        ("core.py", 20, "Layer"),
    }
    read, tools = reading_path.count(project, entered, set())
    assert len(read) == 7 and tools == {("plan.py", 1), ("plan.py", 2)}


def test_the_tools_can_be_a_folder(tmp_path, monkeypatch):
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "plan.py").write_text(PLAN)
    (tmp_path / "core.py").write_text(CORE)
    monkeypatch.setattr(reading_path, "TOOLS", {"tools/"})
    spans = reading_path.load(tmp_path)
    read, tools = reading_path.count(spans, {ENTRY, ("tools/plan.py", 1, "plan")}, set())
    assert len(read) == 7 and len(tools) == 2


def test_write_replaces_the_readmes_table_and_nothing_else():
    readme = textwrap.dedent(f"""\
        # title

        {reading_path.HEADER.splitlines()[0]}
        |---|---|---|---|
        | old | `--tp=2` | 1 | 0 |

        after
        """)
    new = reading_path.HEADER + "\n| new | `--tp=2` | 1 |"
    assert reading_path.with_table(readme, new) == f"# title\n\n{new}\n\nafter\n"
