"""
nanoGPT-style configuration: a config is a python file of plain assignments, and any setting can be
overridden on the command line with --key=value:

    python train.py config/tiny_fineweb.py --batch_size=16 --compile=False

A tool declares its settings as a list of `Setting`s (train.py's are in settings.py), each with its
default and a one-line meaning; `configure` applies config files and overrides in command-line
order. A key that is not declared stops the run with the close matches named (a typo never goes
unnoticed), and a value must have the type of its default (an int is accepted where a float is
expected; a setting whose default is None declares its type). A config file's statement that sets
nothing (`n_layer: 2`, YAML's habit) is refused, naming its line. Values on the command line are
python literals (16, 3e-4, True, 'abc') or, failing that, plain strings. `--help` prints every
setting with its default and meaning.
"""

import ast
import difflib
import os
import sys
from typing import NamedTuple


class ConfigError(ValueError):
    pass


class Setting(NamedTuple):
    name: str
    default: object
    meaning: str  # one line: what it is, its units, what 0 or None means
    type: type = None  # needed only when the default is None; otherwise the default's type
    resume: str = "inherit"  # what init_from='resume' does with it: see settings.py
    section: str = ""  # the banner it is listed under


def section(title, *settings):
    """The settings of one banner (`# I/O`, `# model`, ...) of a tool's list."""
    return [s._replace(section=title) for s in settings]


def _close_matches(key, known):
    matches = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    return f" Did you mean: {', '.join(matches)}?" if matches else ""


def _check(key, value, declared, source, before=None):
    """`value` for `key` as the declared type, or a ConfigError quoting the value given and where it
    came from. before: (value, where it came from) of what it replaces, the example of the right
    type that the message gives (a config file's 300, not a default of 1000 that the user never
    wrote)."""
    if key not in declared:
        raise ConfigError(
            f"unknown config key '{key}' (from {source}).{_close_matches(key, declared)}"
            f" Run with --help to list every setting."
        )
    setting = declared[key]
    expected = setting.type if setting.default is None else type(setting.default)
    if value is None and setting.default is None:
        return value  # None means "decided at run time" (vocab_size from meta.json)
    if expected is bool and not isinstance(value, bool):
        raise ConfigError(
            f"config key '{key}' must be a bool (True/False), got {value!r} (from {source})"
        )
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    # (bool is an int subclass: True given for a number is a type error too, not "must be a bool")
    if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
        if setting.default is None:
            allowed = f"{expected.__name__} or None"
        elif before is not None and before[1] is not None:
            allowed = f"{expected.__name__} like {before[0]!r} (from {before[1]})"
        else:
            allowed = f"{expected.__name__} like its default {setting.default!r}"
        raise ConfigError(
            f"config key '{key}' must be of type {allowed}, got {value!r} of type "
            f"{type(value).__name__} (from {source})"
        )
    return value


def _module_statements(body):
    """The statements a config file runs, those inside if/for/while/with/try included (not a
    function's or a class's body: it sets nothing until it is called)."""
    for node in body:
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                yield from _module_statements(getattr(node, field, []))


def _refuse_statements_that_set_nothing(tree, path):
    """Refuse a statement that python runs and that sets nothing, naming its line: `n_layer: 2`
    (YAML's habit) is a bare annotation and `n_layer == 2` a comparison thrown away, and either
    would train the default in silence. Kept: an annotated assignment with a value (`n_layer: int
    = 2` sets n_layer as `n_layer = 2` does, type-checked alike), a string alone (a docstring or a
    comment), and a call (`print(...)`) or `(x := 2)`, which do something."""
    for node in _module_statements(tree.body):
        where = f"config file {path}, line {node.lineno}: `{ast.unparse(node)}`"
        if isinstance(node, ast.AnnAssign) and node.value is None:
            fix = f"{ast.unparse(node.target)} = {ast.unparse(node.annotation)}"
            raise ConfigError(
                f"{where} is an annotation and sets nothing (a config file is "
                f"python, not YAML): write `{fix}`"
            )
        value = node.value if isinstance(node, ast.Expr) else None
        if (
            value is None
            or isinstance(value, (ast.Call, ast.NamedExpr))
            or (isinstance(value, ast.Constant) and isinstance(value.value, str))
        ):
            continue
        equals = isinstance(value, ast.Compare) and isinstance(value.ops[0], ast.Eq)
        fix = f"{ast.unparse(value.left)} = {ast.unparse(value.comparators[0])}" if equals else None
        raise ConfigError(
            f"{where} computes a value and sets nothing: assign the setting, as in "
            f"`{fix or 'name = value'}`"
        )


def _run_config_file(path):
    """The names a config file assigns; a syntax error or a failing line is named by file and
    line."""
    try:
        with open(path) as f:
            source = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' not found (settings are given as --key=value)")
    except (IsADirectoryError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file '{path}' cannot be read as python source: {e}")
    namespace = {}
    try:
        tree = ast.parse(source, path)
        _refuse_statements_that_set_nothing(tree, path)
        code = compile(tree, path, "exec")  # compiled under its path: errors name the file
    except SyntaxError as e:
        raise ConfigError(f"config file {path}, line {e.lineno}: {e.msg}: {(e.text or '').strip()}")
    try:
        exec(code, namespace)
    except Exception as e:
        tb, line = e.__traceback__, "?"
        while tb is not None:  # the innermost frame of the config file itself
            if tb.tb_frame.f_code.co_filename == path:
                line = tb.tb_lineno
            tb = tb.tb_next
        raise ConfigError(f"config file {path}, line {line}: {type(e).__name__}: {e}")
    return {
        k: v
        for k, v in namespace.items()
        if not k.startswith("_") and not callable(v) and type(v).__name__ != "module"
    }


def make_folder(key, path):
    """Create the folder a setting names for the tool to write into (out_dir, hf_dir), or stop
    naming the setting, the path and why: before any work, not at the first save."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"{key} = {path!r} cannot be created ({e.strerror}): choose another --{key}"
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{key} = {path!r} is not writable by this user: choose another --{key} or fix its "
            f"permissions"
        )


def format_help(settings, usage=""):
    """Every setting under its banner, `--name=default  meaning`, after the tool's usage text."""
    lines = [usage.strip(), ""] if usage else []
    current = None
    for s in settings:
        if s.section != current:
            current = s.section
            lines.append(f"# {current}")
        lines.append(f"  --{s.name}={s.default!r}".ljust(34) + f"  {s.meaning}")
    return "\n".join(lines)


def configure(settings, argv, usage=""):
    """Apply config files and --key=value overrides (in command-line order) to the declared
    settings. Returns (values, given): every setting's value, and the names that a config file or
    the command line set (resuming a run takes the others from its checkpoint). --help prints the
    settings and exits."""
    if "--help" in argv or "-h" in argv:
        print(format_help(settings, usage))
        sys.exit(0)
    declared = {s.name: s for s in settings}
    values, given = {s.name: s.default for s in settings}, set()
    sources = {}  # where each given value came from: a config file or the --key=value that set it
    for arg in argv:
        if not arg.startswith("--"):
            for key, value in _run_config_file(arg).items():
                values[key] = _check(key, value, declared, arg, (values.get(key), sources.get(key)))
                given.add(key)
                sources[key] = arg
            continue
        key, sep, text = arg[2:].partition("=")
        if not sep:
            raise ConfigError(
                f"'{arg}' needs a value: write it as --{key}=VALUE (--help lists the settings)"
            )
        try:
            value = ast.literal_eval(text)
        except (SyntaxError, ValueError):
            value = text  # a bare word is a string: --init_from=resume
        if (
            key in declared
            and isinstance(declared[key].default, str)
            and not isinstance(value, str)
        ):
            value = text  # a string setting takes the text as written: --out_dir=2024
        values[key] = _check(key, value, declared, arg, (values.get(key), sources.get(key)))
        given.add(key)
        sources[key] = arg
    return values, given
