"""Imports run one way. Every import of every project file is read (ast, function-level ones too)
and held to the order a learner reads the house in:

  foundation     configurator.py, model.py, hf_tokenizer.py
  mechanisms     parallel.py and each mechanism beyond it, the optimizers
  the run        data, settings, metrics, checkpoints, faults, the build (build.py), transformers
                 interop
  planners       tools/: machines, memory_plan, step_time, timeline
  entry scripts  train.py, sample.py, prepare_data.py, tools/bench.py, tools/make_config.py,
                 tools/plot.py

A file imports only files of its own layer or a layer above it in this list, no circle forms,
nothing imports an entry script, and a function-level import is only of an optional library.
train.py's import of the planners is the one guarded import: training runs without tools/
(tests/test_train.py)."""

import ast

from conftest import ROOT

LAYERS = {
    "foundation": ["configurator", "model", "hf_tokenizer"],
    "mechanisms": [
        "parallel",
        "tensor_parallel",
        "context_parallel",
        "pipeline_schedules",
        "zero",
        "expert_parallel",
        "fp8",
        "optim",
    ],
    "the run": [
        "ledger",
        "data",
        "settings",
        "metrics",
        "checkpoint",
        "faults",
        "build",
        "export_hf",
        "import_hf",
    ],
    "planners": ["tools.machines", "tools.memory_plan", "tools.step_time", "tools.timeline"],
    "entry scripts": [
        "train",
        "sample",
        "prepare_data",
        "tools.bench",
        "tools.make_config",
        "tools.plot",
    ],
}
# bench.py times train.py's own step (train_step, get_lr), so that what it times is what trains
ENTRY_IMPORTED_BY = {("tools.bench", "train")}
# what a function may import: libraries a run detects when it needs them (requirements-dev.txt)
OPTIONAL = {
    "flash_attn",
    "wandb",
    "torch.utils.tensorboard",
    "matplotlib",
    "transformers",
    "safetensors",
    "tokenizers",
    "triton",
    "tqdm",
}
LAYER_OF = {module: n for n, modules in enumerate(LAYERS.values()) for module in modules}


def module_name(path):
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def project_files():
    """Every .py file of the project but the tests and the configs (plain assignments)."""
    return sorted(
        p
        for p in ROOT.rglob("*.py")
        if p.relative_to(ROOT).parts[0] not in ("tests", "config")
        and ".git" not in p.parts
        and p.name != "__init__.py"
    )


def imports_of(path):
    """[(imported module, line, inside a function)] of a file, `from tools import x` as tools.x."""
    tree = ast.parse(path.read_text())
    in_function = {
        id(node)
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(fn)
        if node is not fn
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, id(node) in in_function) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = (
                [f"{node.module}.{a.name}" for a in node.names]
                if node.module == "tools"
                else [node.module]
            )
            found += [(name, node.lineno, id(node) in in_function) for name in names]
    return found


def project_graph():
    """{module: {project module it imports: first line}} over every project file."""
    modules = {module_name(p): p for p in project_files()}
    return modules, {
        m: {name: line for name, line, _ in reversed(imports_of(p)) if name in modules}
        for m, p in modules.items()
    }


def test_every_project_module_has_a_layer():
    modules, _ = project_graph()
    unplaced = [m for m in modules if m not in LAYER_OF and not m.startswith("scripts.")]
    assert not unplaced, f"place {unplaced} in one of tests/test_imports.py's LAYERS"


def test_imports_run_one_way_and_nothing_imports_an_entry_script():
    _, graph = project_graph()
    entry = LAYER_OF["train"]
    wrong = []
    for module, imported in graph.items():
        for name, line in imported.items():
            # a script drives the others: it may import any but itself
            if module.startswith("scripts."):
                continue
            if LAYER_OF[name] == entry and (module, name) not in ENTRY_IMPORTED_BY:
                wrong.append(f"{module}:{line} imports the entry script {name}")
            elif LAYER_OF[name] > LAYER_OF[module] and not (
                module == "train" and name.startswith("tools.")
            ):
                wrong.append(f"{module}:{line} imports {name}, of a later layer")
    assert not wrong, "\n".join(wrong)


def circles(graph):
    """The import circles of {module: [modules it imports]}, each as 'a -> b -> a'."""
    state, found = {}, []

    def visit(module, path):
        state[module] = "open"
        for name in graph[module]:
            if state.get(name) == "open":
                found.append(" -> ".join(path[path.index(name) :] + [name]))
            elif name not in state:
                visit(name, path + [name])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])
    return found


def late_imports(path):
    """The function-level imports of a file that are not of an optional library."""
    return [
        f"{path.name}:{line} imports {name}"
        for name, line, in_function in imports_of(path)
        if in_function and not any(name == o or name.startswith(o + ".") for o in OPTIONAL)
    ]


def test_no_import_circle():
    _, graph = project_graph()
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(found)


def test_a_function_level_import_is_only_of_an_optional_library():
    late = [line for p in project_files() for line in late_imports(p)]
    assert not late, "import these at the top of the file:\n" + "\n".join(late)


def test_the_checks_catch_a_circle_and_a_late_import(tmp_path):
    """The same functions on two files written here: b imports a inside a function, a imports b."""
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    import a\n    import matplotlib\n")
    graph = {
        p.stem: [name for name, _, _ in imports_of(p)]
        for p in (tmp_path / "a.py", tmp_path / "b.py")
    }
    graph["b"].remove("matplotlib")
    assert circles(graph) == ["a -> b -> a"]
    assert late_imports(tmp_path / "b.py") == ["b.py:2 imports a"]  # matplotlib is optional
