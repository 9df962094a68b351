"""
nanoGPT-style configuration: a config is a python file of plain assignments, and any setting can be
overridden on the command line with --key=value. Every setting must already exist among the defaults
(at the top of train.py), so a typo stops the run instead of being silently ignored:

    python train.py config/tiny_fineweb.py --batch_size=16 --compile=False

Values given on the command line are python literals (16, 3e-4, True, 'abc') or, failing that, plain
strings. Each value must have the type of its default; an int is accepted where a float is expected.
"""
import ast
import difflib


class ConfigError(ValueError):
    pass


def _close_matches(key, known):
    matches = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    return f" Did you mean: {', '.join(matches)}?" if matches else ""


def _check(key, value, defaults, source):
    if key not in defaults:
        raise ConfigError(f"unknown config key '{key}' (from {source}).{_close_matches(key, defaults)}"
                          f" Every key must be one of the defaults at the top of train.py.")
    default = defaults[key]
    if default is None or value is None:
        return value  # a None default means "decided at run time" (e.g. vocab_size from meta.json)
    if isinstance(default, bool) != isinstance(value, bool):  # bool is an int subclass: check it first
        raise ConfigError(f"config key '{key}' must be a bool (True/False), got {value!r} (from {source})")
    if isinstance(default, float) and isinstance(value, int):
        return float(value)
    if not isinstance(value, type(default)):
        raise ConfigError(f"config key '{key}' must be of type {type(default).__name__} like its default "
                          f"{default!r}, got {value!r} of type {type(value).__name__} (from {source})")
    return value


def configure(defaults, argv):
    """Apply config files and --key=value overrides (in command-line order) to a dict of defaults."""
    config = dict(defaults)
    for arg in argv:
        if not arg.startswith("--"):
            # a config file: run it and keep the names it assigns
            namespace = {}
            try:
                with open(arg) as f:
                    exec(f.read(), namespace)
            except FileNotFoundError:
                raise ConfigError(f"config file '{arg}' not found (settings are given as --key=value)")
            for key, value in namespace.items():
                if key.startswith("_") or key == "__builtins__" or callable(value) or type(value).__name__ == "module":
                    continue
                config[key] = _check(key, value, defaults, arg)
        else:
            key, sep, text = arg[2:].partition("=")
            if not sep:
                raise ConfigError(f"'{arg}' needs a value: write it as --{key}=VALUE")
            try:
                value = ast.literal_eval(text)
            except (SyntaxError, ValueError):
                value = text  # a bare word is a string: --init_from=resume
            config[key] = _check(key, value, defaults, arg)
    return config
