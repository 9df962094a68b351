"""scripts/reading_path.py measures what a learner reads for each mechanism: its table has one row per
mechanism with two counts, the README shows exactly that table, and the walk behind it follows calls into
picotron's own files only, counts each line once, and counts as "other" the lines marked so and what only
they reach. The walk is checked on a small project written here, its counts made by hand."""
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import reading_path  # noqa: E402  (scripts/reading_path.py)

MECHANISMS = ["tensor parallel", "data parallel", "ZeRO-1", "1F1B", "ring attention", "ZeRO-3", "expert parallel",
              "Muon"]


@pytest.fixture(scope="module")
def printed():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "reading_path.py")], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_the_table_has_a_row_per_mechanism_ending_in_lines_read_and_other(printed):
    header, rule, *rows = printed.splitlines()
    assert header.startswith("| mechanism |") and re.fullmatch(r"(\|---)+\|", rule), printed
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert [c[0] for c in cells][:len(MECHANISMS)] == MECHANISMS, [c[0] for c in cells]
    for c in cells:
        assert re.fullmatch(r"\d+", c[-2]) and re.fullmatch(r"\d+", c[-1]), f"{c[0]}: the last two cells {c[-2:]}"
        assert 0 < int(c[-2]) and int(c[-1]) <= int(c[-2]), f"{c[0]}: read {c[-2]}, other {c[-1]}"


def test_the_readme_shows_the_table_the_script_prints(printed):
    readme = (ROOT / "README.md").read_text()
    assert printed + "\n" in readme, ("README.md's reading table is not what scripts/reading_path.py prints now: run "
                                      "python scripts/reading_path.py --write")


# -----------------------------------------------------------------------------
# the walk, on a small project

CORE = '''\
import torch
from helpers import helper, Base


def entry(x):
    """Two docstring lines,
    counted."""

    y = torch.zeros(3)  # torch: not followed
    return helper(x) + twice(y) + len(y)


# a comment just above a def is read with it
def twice(y):
    return 2 * y


def never_called():
    return 0


class Layer(Base):
    def forward(self, x):
        self.check(x)
        return special(x)  # only for another setting


def special(x):
    return x
'''
HELPERS = '''\
def helper(x):
    return x


class Base:
    def check(self, x):
        pass


def unused():
    pass
'''


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "core.py").write_text(CORE)
    (tmp_path / "helpers.py").write_text(HELPERS)
    monkeypatch.setattr(reading_path, "ENTRIES", {"function": ["core.py entry"], "layer": ["core.py Layer"]})
    monkeypatch.setattr(reading_path, "STOPS", {})
    monkeypatch.setattr(reading_path, "OTHER", [])
    return reading_path.load(tmp_path)


def test_the_walk_reads_what_the_entry_calls_in_any_of_the_files_and_stops_at_torch(project):
    total, other, order, _ = reading_path.measure(project, "function")
    # entry 5 (its blank line left out), twice 3 (with the comment above it), helper 2; not never_called, unused
    assert total == 5 + 3 + 2 and other == 0
    assert [(file, name) for file, name, _ in order] == [("core.py", "entry"), ("helpers.py", "helper"),
                                                         ("core.py", "twice")]


def test_a_class_is_read_with_its_bases_and_what_its_methods_call(project):
    total, _, order, _ = reading_path.measure(project, "layer")
    assert {name for _, name, _ in order} >= {"Layer", "Base", "Base.check", "special"}
    assert total == 4 + 3 + 2  # Layer, Base (the method within it, counted once), special


def test_lines_marked_other_and_what_only_they_reach_count_as_other(project, monkeypatch):
    monkeypatch.setattr(reading_path, "OTHER", [("core.py Layer.forward: return special(x)", "another setting")])
    total, other, _, others = reading_path.measure(project, "layer")
    assert (total, other) == (9, 1 + 2)  # the marked line, and special, which only it calls
    assert set(others["core.py"].values()) == {"another setting", "reached only from other lines"}


def test_a_row_named_in_what_the_lines_serve_reads_them_as_its_own(project, monkeypatch):
    monkeypatch.setattr(reading_path, "OTHER", [("core.py Layer.forward: return special(x)", "function and layer")])
    assert reading_path.measure(project, "layer")[:2] == (9, 0)


def test_a_stop_ends_the_walk_there(project, monkeypatch):
    monkeypatch.setattr(reading_path, "STOPS", {"function": ["helpers.py"]})
    assert reading_path.measure(project, "function")[0] == 5 + 3


def test_an_entry_or_mark_that_no_longer_matches_the_code_is_an_error_naming_it(project, monkeypatch):
    for stale in ("core.py gone", "core.py entry: no such text"):
        monkeypatch.setattr(reading_path, "OTHER", [(stale, "x")])
        with pytest.raises(ValueError, match=re.escape(repr(stale))):
            reading_path.measure(project, "function")


def test_write_replaces_the_readmes_table_and_nothing_else():
    readme = textwrap.dedent(f"""\
        # title

        {reading_path.HEADER.splitlines()[0]}
        |---|---|---|---|
        | old | row | 1 | 0 |

        after
        """)
    new = reading_path.HEADER + "\n| new | row | 2 | 1 |"
    assert reading_path.with_table(readme, new) == f"# title\n\n{new}\n\nafter\n"
