"""No function or method over 60 lines of code (issue 35, item 7): a function a reader cannot hold
at once is split where a reader would split it, each piece named for what it does.

What is measured: every function and method (nested ones too, on their own and inside their parent)
of every .py file at the top of the repository, in scripts/ and in tests/, parsed with ast. Its
length is its physical lines from the `def` line to its last line, blank lines and comments
included, less the lines of its docstring (a docstring explains; it is not code to hold in mind).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 60

# Functions still being split by other helpers of issue 35, with their length when this test was
# written. The coordinator empties this set as their splits are merged; a name here that is no
# longer over the limit fails test_allowance_is_not_stale, so the set cannot outlive its reason.
ALLOWANCE = set()  # none: every function is within the limit


def code_lines(node):
    """Physical lines from the def to the function's end, less its docstring's lines."""
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def function_lengths(source, module):
    """{qualified name: code lines} of every function and method in `source`, named
    module.Class.function (a nested function after its parent's name)."""
    lengths = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lengths[f"{prefix}.{child.name}"] = code_lines(child)
                visit(child, f"{prefix}.{child.name}")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}.{child.name}")
            else:
                visit(child, prefix)

    visit(ast.parse(source), module)
    return lengths


def repository_lengths():
    """function_lengths of every .py file at the top level, in tools/, scripts/ and tests/ (tools.x,
    ...)."""
    lengths = {}
    folders = (
        (ROOT, ""),
        (ROOT / "tools", "tools."),
        (ROOT / "scripts", "scripts."),
        (ROOT / "tests", "tests."),
    )
    for folder, prefix in folders:
        for path in sorted(folder.glob("*.py")):
            lengths.update(function_lengths(path.read_text(), prefix + path.stem))
    return lengths


def over_limit(lengths, allowance=frozenset()):
    """[(name, code lines)] of the functions over MAX_LINES that the allowance does not name."""
    return sorted(
        (name, n) for name, n in lengths.items() if n > MAX_LINES and name not in allowance
    )


def test_no_function_over_60_lines():
    too_long = over_limit(repository_lengths(), ALLOWANCE)
    assert not too_long, (
        f"functions over {MAX_LINES} lines of code (def to end, less the docstring): "
        + ", ".join(f"{name} ({n})" for name, n in too_long)
        + ". Split each where a reader would, each piece a function named for what it does."
    )


def test_allowance_is_not_stale():
    lengths = repository_lengths()
    stale = sorted(name for name in ALLOWANCE if lengths.get(name, 0) <= MAX_LINES)
    assert not stale, (
        f"ALLOWANCE names functions that are gone or no longer over {MAX_LINES} lines: "
        f"{', '.join(stale)}; remove them from ALLOWANCE in tests/test_function_length.py"
    )


def synthetic_function(body_lines, docstring_lines=0):
    """Source of one function `f` with a docstring of docstring_lines lines and body_lines more
    lines, so that, written by hand, its code lines are 1 (the def) + body_lines."""
    doc = []
    if docstring_lines == 1:
        doc = ['    """One line."""']
    elif docstring_lines > 1:
        doc = ['    """First line.'] + ["    more."] * (docstring_lines - 2) + ['    """']
    body = ["    # a comment counts", ""] + ["    x = 1"] * (body_lines - 3) + ["    return x"]
    return "\n".join(["def f():"] + doc + body) + "\n"


def test_measure_counts_def_to_end_less_docstring():
    # the reference is the hand count: 1 def line + body lines; comments and blank lines count, the
    # docstring not
    assert function_lengths(synthetic_function(59, docstring_lines=5), "m") == {"m.f": 60}
    assert function_lengths(synthetic_function(10, docstring_lines=1), "m") == {"m.f": 11}
    assert function_lengths(synthetic_function(10), "m") == {"m.f": 11}


def test_a_function_of_61_lines_fails_and_one_of_60_passes():
    assert over_limit(function_lengths(synthetic_function(59, docstring_lines=9), "m")) == []
    assert over_limit(function_lengths(synthetic_function(60, docstring_lines=9), "m")) == [
        ("m.f", 61)
    ]
    assert over_limit(function_lengths(synthetic_function(60), "m"), {"m.f"}) == []


def test_methods_and_nested_functions_are_measured_by_name():
    source = (
        "class A:\n    def g(self):\n"
        "        def inner():\n            return 1\n        return inner()\n"
        "async def h():\n    pass\n"
    )
    assert function_lengths(source, "m") == {"m.A.g": 4, "m.A.g.inner": 2, "m.h": 2}
