"""Liftable is tested, not claimed (STYLE.md): each mechanism, copied alone into an empty folder,
runs a 2-rank toy equal to one process there, gradients included, and fails when a reducer's
division by the group size is patched out; a lifted layer refuses to compute before it is filled;
given group=None ("not split"), each collective helper and reducer computes what one process
computes.

What is copied. A core piece is a numbered section of parallel.py with the sections its header names
on its `# Needs:` line, after parallel.py's prologue (its imports, the two renamed collectives,
at_least_fp32), assembled from the section markers here, nothing copied by hand. An extension is its
own file with the whole parallel.py. Every folder is run in one launch: two processes (gloo) with
the folder above them as their working directory and nothing of the checkout on sys.path, running
tests/lift_toys.py's toys, each of which imports its mechanism from its own folder only and compares
it with one process computed there. The tolerances are tests/dist_utils.py's: 1e-5 relative on
losses and outputs, by ||a - b|| / ||b|| 1e-4 on gradients and 1e-3 on weights after AdamW; the
pipeline's are exact (its toy says why).
"""

import ast
import inspect
import copy
import builtins
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import checkpoint
import context_parallel
import expert_parallel
import optim
import parallel
import pipeline_schedules
import zero
from dist_utils import GRAD_NORM_RTOL, LOSS_RTOL, WEIGHT_RTOL
from model import ModelConfig, Transformer
from parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tensor_parallel import load_full
from build import init_shares, materialize

ROOT = Path(__file__).resolve().parent.parent
PARALLEL = (ROOT / "parallel.py").read_text()

# folder: the section of parallel.py a core piece is, or the file an extension is
CORE = {"tensor_parallel": 4, "pipeline": 6, "data_parallel": 2, "zero_one": 3}
EXTENSIONS = {
    "context_parallel": "context_parallel.py",
    "expert_parallel": "expert_parallel.py",
    "zero": "zero.py",
    "fp8": "fp8.py",
}
# tests/lift_toys.py's toys, and the folder each lifts its mechanism from
TOYS = {
    "tensor_parallel_mlp": "tensor_parallel",
    "pipeline_1f1b": "pipeline",
    "data_parallel": "data_parallel",
    "zero_one": "zero_one",
    "ring_attention": "context_parallel",
    "expert_all_to_all": "expert_parallel",
    "zero_three": "zero",
    "fp8_tensor_parallel": "fp8",
}
TOLERANCE = {
    "loss": LOSS_RTOL,
    "output": LOSS_RTOL,
    "gradient": GRAD_NORM_RTOL,
    "weight": WEIGHT_RTOL,
    "exact": 0.0,
}


# -----------------------------------------------------------------------------
# assembling a core piece from parallel.py's section markers

SECTION = re.compile(r"^# -{20,}\n# (\d+)\. ", re.M)


def sections(source=PARALLEL):
    """(the prologue: everything above the first numbered section, without the module docstring;
    {n: section n, from its marker to the next numbered one})."""
    starts = [(int(m.group(1)), m.start()) for m in SECTION.finditer(source)]
    prologue = source[: starts[0][1]]
    docstring = ast.parse(prologue).body[0]
    prologue = "\n".join(prologue.splitlines()[docstring.end_lineno :]) + "\n"
    ends = [start for _, start in starts[1:]] + [len(source)]
    return prologue, {n: source[start:end] for (n, start), end in zip(starts, ends)}


def needs(section):
    """The sections a section's header names on its `# Needs:` line (the names in parentheses left
    out)."""
    header = section.split("\n\n", 1)[0]
    line = re.search(r"^# Needs: (.*?)\.$", header, re.M | re.S)
    assert line, (
        f"the header of\n{header}\nhas no '# Needs:' line saying which other sections it needs"
    )
    return {int(n) for n in re.findall(r"\d+", re.sub(r"\([^)]*\)", "", line.group(1)))}


def with_needs(n, parts):
    """Section n and every section it needs, directly or through another."""
    found, todo = set(), [n]
    while todo:
        m = todo.pop()
        if m not in found:
            found.add(m)
            todo += needs(parts[m])
    return sorted(found)


def core_piece(n):
    """Section n's lifted text: the prologue, the sections it needs and itself, in their order."""
    prologue, parts = sections()
    chosen = with_needs(n, parts)
    numbers = ", ".join(map(str, chosen))
    title = f"picotron's parallel.py, sections {numbers} alone (assembled by tests/test_lift.py)"
    return f'"""{title}."""\n' + prologue + "".join(parts[m] for m in chosen)


def unbound_names(source):
    """Names the code reads that nothing in it binds and that are not builtins: what a lifted file
    lacks. Coarse (a name bound anywhere counts as bound everywhere), which is enough to catch a
    missing section."""
    bound, read = set(dir(builtins)), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return read - bound


def foreign_imports(source, allowed=()):
    """The modules a file imports anywhere in it beyond torch, the standard library, `allowed`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or "").split(".")[0])
    return sorted(
        m for m in found if m != "torch" and m not in sys.stdlib_module_names and m not in allowed
    )


def test_each_section_of_parallel_py_names_the_earlier_ones_it_needs_and_lifts_with_them_alone():
    _, parts = sections()
    assert sorted(parts) == list(range(1, len(parts) + 1))
    for n, section in parts.items():
        assert all(m < n for m in needs(section)), (
            f"section {n} needs a later section: {sorted(needs(section))}"
        )
        missing = unbound_names(core_piece(n))
        assert not missing, (
            f"section {n} of parallel.py, lifted with sections {with_needs(n, parts)}, reads "
            f"{sorted(missing)}, which none of them defines: name the section that does on its "
            f"'# Needs:' line"
        )


def test_the_section_check_sees_a_name_from_a_section_not_named():
    _, parts = sections()
    assert "grid_rank" in unbound_names(parts[6])  # the pipeline's from_layout, without section 1


def test_the_import_check_catches_a_lifted_file_that_imports_picotron():
    for module in ("model", "train", "settings", "metrics"):
        assert foreign_imports(f"import torch\nimport math\n\ndef f():\n    import {module}\n") == [
            module
        ]
        assert foreign_imports(f"from {module} import something\n") == [module]
    assert foreign_imports("from parallel import group_size\n") == ["parallel"]
    assert foreign_imports("from parallel import group_size\n", allowed=("parallel",)) == []
    assert foreign_imports("from . import parallel\n", allowed=("parallel",)) == ["."]


# -----------------------------------------------------------------------------
# the toys, in one launch of two processes


def write_lifted(root):
    """The lifted folders under root, and lift_toys.py beside them: {folder: [its files]}."""
    files = {}
    for folder, n in CORE.items():
        (root / folder).mkdir()
        (root / folder / "parallel.py").write_text(core_piece(n))
        files[folder] = ["parallel.py"]
    for folder, name in EXTENSIONS.items():
        (root / folder).mkdir()
        shutil.copy(ROOT / name, root / folder / name)
        shutil.copy(ROOT / "parallel.py", root / folder / "parallel.py")
        files[folder] = [name, "parallel.py"]
    shutil.copy(ROOT / "tests" / "lift_toys.py", root / "lift_toys.py")
    return files


def run_two_ranks(root, timeout=600):
    """lift_toys.py on 2 ranks in root, as torchrun would start them; returns each rank's
    measurements. -E: no PYTHONPATH, so sys.path is root, the standard library and site-packages."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
        "PICOTRON_CHECKOUT": str(ROOT),
    }
    env.pop("PYTHONPATH", None)
    logs = [open(root / f"rank{r}.log", "w") for r in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-E", "lift_toys.py"],
            cwd=root,
            env={**env, "RANK": str(r)},
            stdout=logs[r],
            stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:  # the other rank would wait for it for ever
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        r = failed[0]
        raise AssertionError(
            f"the lifted toys failed on rank {r} (exit {procs[r].returncode}):\n"
            + (root / f"rank{r}.log").read_text()[-6000:]
        )
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]


# The reducers' division of the summed gradients by the group's size (the sum over dp ranks / dp =
# the mean over the global batch), and the file of each toy's folder that makes it: the mutation
# test deletes it there
DIVISION = re.compile(r"\.div_\((?:self\.)?replicas\)")
DIVIDES = {"data_parallel": "parallel.py", "zero_one": "parallel.py", "zero_three": "zero.py"}


def write_mutants(root):
    """Each reducer's folder again, as <folder>_undivided, with its division by the group size
    deleted, and mutants.json naming them for lift_toys.py, which runs those toys a second time from
    there (in the same launch). Returns {toy: the divisions deleted}; a folder where none was found
    is not written."""
    deleted, mutants = {}, {}
    for toy, name in DIVIDES.items():
        folder = f"{TOYS[toy]}_undivided"
        patched, deleted[toy] = DIVISION.subn("", (root / TOYS[toy] / name).read_text())
        if deleted[toy]:
            shutil.copytree(root / TOYS[toy], root / folder)
            (root / folder / name).write_text(patched)
            mutants[toy] = folder
    (root / "mutants.json").write_text(json.dumps(mutants))
    return deleted


@pytest.fixture(scope="module")
def lifted(tmp_path_factory):
    root = tmp_path_factory.mktemp("lifted")
    files = write_lifted(root)
    return SimpleNamespace(root=root, files=files, mutants=write_mutants(root))


@pytest.fixture(scope="module")
def measured(lifted):
    per_rank = run_two_ranks(lifted.root)
    assert all(set(TOYS) <= set(on_rank) for on_rank in per_rank), (
        f"toys run: {sorted(per_rank[0])}"
    )
    return per_rank


def test_a_lifted_file_imports_only_torch_the_standard_library_and_for_an_extension_parallel(
    lifted,
):
    for folder, names in lifted.files.items():
        for name in names:
            allowed = ("parallel",) if folder in EXTENSIONS and name != "parallel.py" else ()
            foreign = foreign_imports((lifted.root / folder / name).read_text(), allowed)
            assert not foreign, (
                f"{folder}/{name} imports {foreign}: a lifted file may import only torch, "
                f"the standard library" + (" and parallel.py" if allowed else "")
            )


@pytest.mark.parametrize("toy", TOYS)
def test_a_mechanism_lifted_alone_equals_one_process_on_two_ranks(measured, toy):
    for rank, on_rank in enumerate(measured):
        for what, (kind, diff) in on_rank[toy].items():
            print(
                f"equivalence | test_lift {toy} ({TOYS[toy]}/) rank {rank} | {what}: largest "
                f"relative difference {diff:.2e}, tolerance {TOLERANCE[kind]:.0e}",
                flush=True,
            )
            assert diff <= TOLERANCE[kind], (
                f"{toy}, lifted into {TOYS[toy]}/, rank {rank}: {what} differs from "
                f"one process by {diff:.2e} (tolerance {TOLERANCE[kind]:.0e})"
            )


def test_every_toy_compares_gradients_with_one_process(measured):
    """A toy that compared only losses and weights after AdamW would be blind to the gradients'
    scale: Adam divides the first moment by the root of the second, so a gradient dp times too large
    moves the weights almost as the right one does."""
    for toy in TOYS:
        kinds = {kind for what, (kind, _) in measured[0][toy].items() if "gradient" in what}
        assert kinds & {"gradient", "exact"}, (
            f"{toy} measures no gradient against one process: {sorted(measured[0][toy])}"
        )


def test_a_reducer_toy_fails_when_the_division_by_the_group_size_is_patched_out(lifted, measured):
    for toy, deleted in lifted.mutants.items():
        assert deleted, (
            f"{TOYS[toy]}/{DIVIDES[toy]} (lifted for {toy}) has no division by the group size "
            f"matching {DIVISION.pattern}: point DIVISION at the line that divides the summed "
            f"gradients by dp"
        )
    for rank, on_rank in enumerate(measured):
        for toy in DIVIDES:
            ((what, (kind, diff)),) = [
                (w, m) for w, m in on_rank[f"{toy} mutant"].items() if "gradient" in w
            ]
            others = "".join(
                f"; {w} {d:.1e}" for w, (_, d) in on_rank[f"{toy} mutant"].items() if w != what
            )
            print(
                f"mutation | {toy} without the division, rank {rank}: {what} {diff:.2e} (tolerance "
                f"{TOLERANCE[kind]:.0e}){others}",
                flush=True,
            )
            # the sum over 2 ranks where their mean belongs: ||2g - g|| / ||g|| = 1
            assert abs(diff - 1) < 1e-4, (
                f"{toy} with its division by dp patched out: its {what} differ from one "
                f"process by {diff:.2e}, not by 1 (twice the mean gradient)"
            )


# -----------------------------------------------------------------------------
# a layer used alone is filled with load_full; a model is built on the meta device, then given its
# shares


def empty_layers():
    """(layer, its input, the full tensors load_full takes, what torch computes from them and the
    input)."""
    g = torch.Generator().manual_seed(0)
    x, ids = torch.randn(3, 4, generator=g), torch.tensor([[0, 9, 3]])
    w, b, table = (
        torch.randn(6, 4, generator=g),
        torch.randn(6, generator=g),
        torch.randn(10, 4, generator=g),
    )
    return [
        (ColumnParallelLinear(4, 6, bias=True), x, (w, b), F.linear(x, w, b)),
        (RowParallelLinear(4, 6, bias=True), x, (w, b), F.linear(x, w, b)),
        (VocabParallelEmbedding(10, 4), ids, (table,), F.embedding(ids, table)),
    ]


def test_a_layer_filled_by_load_full_computes_what_torch_computes():
    for layer, x, full, expected in empty_layers():
        load_full(layer, *full)
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)


def tiny_config():
    return ModelConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_kv_head=2, n_embd=16)


def test_a_model_built_on_meta_holds_nothing_until_materialized_then_init_shares_draws_it():
    with torch.device("meta"):
        model = Transformer(tiny_config())
    assert all(p.is_meta for p in model.parameters())
    materialize(model, "cpu")
    assert not any(p.is_meta for p in model.parameters())
    init_shares(model, 0)
    whole = Transformer(tiny_config())  # built on the CPU, drawn by the model itself
    whole.init_weights(0)
    for (name, p), q in zip(model.named_parameters(), whole.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_load_model_fills_the_parameters_it_is_given_and_only_those():
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    source = Transformer(tiny_config())
    source.init_weights(0)
    logits, _ = source(x)
    # load_model a part at a time (ZeRO-3 loads a checkpoint a unit at a time): only that part is
    # written
    reader = SimpleNamespace(
        model_tensor=lambda name, p: dict(source.named_parameters())[name].detach()
    )
    loaded = Transformer(tiny_config())
    with torch.no_grad():
        for p in loaded.parameters():
            p.fill_(7.0)
    checkpoint.load_model(loaded, reader, list(loaded.blocks["0"].parameters()))
    assert torch.equal(loaded.blocks["0"].attn.q_proj.weight, source.blocks["0"].attn.q_proj.weight)
    assert (loaded.blocks["1"].attn.q_proj.weight == 7).all() and (loaded.tok_emb.weight == 7).all()
    checkpoint.load_model(loaded, reader)
    torch.testing.assert_close(loaded(x)[0], logits, rtol=0, atol=0)


def test_zero3_moving_a_filled_layers_weight_into_its_flat_buffer_computes_the_same():
    layer, x, full, expected = empty_layers()[0]
    load_full(layer, *full)
    model = nn.Sequential(layer)
    zero.FullyShardedParameters(
        list(model.parameters()), None, [(layer, list(layer.parameters()), 0)], model
    )
    assert layer.weight.untyped_storage().size() == 0  # between uses ZeRO-3 holds only the shard
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def test_no_class_has_more_than_two_picotron_classes_above_it_and_zero_is_four_classes():
    """Composition over deep inheritance (STYLE.md): a reader holds at most three classes to know
    what one method does. ZeRO-2 and ZeRO-3 are at most four classes."""
    modules = (
        parallel,
        zero,
        optim,
        expert_parallel,
        pipeline_schedules,
        context_parallel,
        checkpoint,
    )
    ours = {module.__name__ for module in modules} | {"model"}
    deep = {
        f"{cls.__module__}.{cls.__name__}": [
            c.__name__ for c in cls.__mro__[1:] if c.__module__ in ours
        ]
        for module in modules
        for cls in vars(module).values()
        if inspect.isclass(cls) and cls.__module__ == module.__name__
    }
    assert not {name: above for name, above in deep.items() if len(above) > 2}
    assert (
        len([c for c in vars(zero).values() if inspect.isclass(c) and c.__module__ == "zero"]) <= 4
    )


# -----------------------------------------------------------------------------
# the hook list: what the extensions override, call or set on parallel.py's classes, all of it in
# its docstring

EXTENSION_FILES = (
    "zero.py",
    "optim.py",
    "expert_parallel.py",
    "pipeline_schedules.py",
    "context_parallel.py",
    "tensor_parallel.py",
    "fp8.py",
)
# torch's own protocol, not a hook of ours
NOT_HOOKS = {"__init__", "forward", "backward", "apply", "step"}


def core_classes(source=PARALLEL):
    """{class name: (its methods, the attributes its methods set on self)} of parallel.py, each with
    its picotron bases'."""
    classes = {node.name: node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)}

    def members(name):
        node = classes[name]
        methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
        attributes = {
            t.attr
            for n in ast.walk(node)
            if isinstance(n, ast.Assign)
            for target in n.targets
            for t in (target.elts if isinstance(target, ast.Tuple) else [target])
            if isinstance(t, ast.Attribute)
            and isinstance(t.value, ast.Name)
            and t.value.id == "self"
        }
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                more = members(base.id)
                methods, attributes = methods | more[0], attributes | more[1]
        return methods, attributes

    return {name: members(name) for name in classes}


def extension_hooks(source, core):
    """The names a file's code uses of parallel.py's classes, as well as they can be told
    statically: the methods its subclasses of them override or reach through self or super(), the
    methods of theirs it calls on any object (by name: a name only a class here defines), and the
    attributes of theirs it sets on an object that is not self (by name too)."""
    tree = ast.parse(source)
    local = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    core_methods = set().union(*(methods for methods, _ in core.values())) - NOT_HOOKS
    core_attributes = set().union(*(attributes for _, attributes in core.values()))

    def core_bases(cls):
        names = [b.id for b in cls.bases if isinstance(b, ast.Name)]
        return [n for n in names if n in core] + [
            m for n in names if n in local for m in core_bases(local[n])
        ]

    found = set()
    for cls in local.values():
        bases = core_bases(cls)
        if not bases:
            continue
        inherited = set().union(*(core[b][0] for b in bases)) - NOT_HOOKS
        own = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
        found |= own & inherited
        found |= {
            n.attr
            for n in ast.walk(cls)
            if isinstance(n, ast.Attribute)
            and n.attr in inherited
            and isinstance(n.value, ast.Name)
            and n.value.id == "self"
            and n.attr not in own
        }
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in core_methods
        ):
            found.add(node.func.attr)  # (super().x(...) and any object's .x(...))
        # an attribute given an existing value (or a lambda): one value, not a new state
        if isinstance(node, ast.Assign) and isinstance(
            node.value, (ast.Attribute, ast.Name, ast.Lambda)
        ):
            found |= {
                t.attr
                for t in node.targets
                if isinstance(t, ast.Attribute)
                and t.attr in core_attributes
                and not (isinstance(t.value, ast.Name) and t.value.id == "self")
            }
    return found


def listed_hooks(source=PARALLEL):
    """The names parallel.py's docstring lists as hooks, in its block that opens with 'through these
    hooks': each method written name(...), each attribute `name`."""
    doc = ast.get_docstring(ast.parse(source))
    block = doc[doc.index("through these\nhooks") : doc.index("Every piece works")]
    return set(re.findall(r"([A-Za-z_]\w*)\(", block)) | set(re.findall(r"`([A-Za-z_]\w*)`", block))


def unlisted_hooks(sources):
    core = core_classes()
    return {
        (name, hook)
        for name, source in sources.items()
        for hook in extension_hooks(source, core)
        if hook not in listed_hooks()
    }


def test_parallel_py_lists_every_hook_its_extensions_override_call_or_set():
    sources = {name: (ROOT / name).read_text() for name in EXTENSION_FILES}
    assert not unlisted_hooks(sources), (
        f"the extensions use these of parallel.py's classes, which its docstring "
        f"does not list among the hooks: {sorted(unlisted_hooks(sources))}"
    )


def test_the_hook_check_sees_an_override_a_call_and_a_setting_not_listed():
    extension = """
from parallel import GradientBuckets, ShardedBucket

class Cheaper(GradientBuckets):
    def views(self, bucket):
        return super().views(bucket)

def f(bucket):
    bucket.views()
    bucket.offsets = bucket.params
"""
    core = core_classes()
    assert {"views", "offsets"} <= extension_hooks(extension, core)
    assert unlisted_hooks({"cheaper.py": extension}) == {
        ("cheaper.py", "views"),
        ("cheaper.py", "offsets"),
    }
    assert "plan" in extension_hooks(
        "from parallel import GradientBuckets\nclass P(GradientBuckets):\n"
        "    def plan(self, params, size):\n        return []\n",
        core,
    )


# -----------------------------------------------------------------------------
# group=None means "not split" (parallel.py's module docstring says so once): in one process, with
# no process group at all, each collective helper returns what the one-process code computes from
# its input, and its input's gradient is that code's too


def one_process_cases():
    """(helper's name, a function of the inputs calling it with group=None, the one-process code
    computing the same thing with torch alone, the inputs)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 6, generator=g)  # (B, T, C)
    logits, targets = torch.randn(5, 11, generator=g), torch.tensor([0, 10, 3, 3, 7])
    q, k, v = (torch.randn(2, 8, 2, 4, generator=g) for _ in range(3))  # (B, T, H, D)
    # rows sorted by expert, 4 experts
    rows, counts = (
        torch.randn(6, 4, generator=g),
        torch.tensor([2, 0, 3, 1]),
    )
    experts = [nn.Linear(4, 4) for _ in range(4)]

    def run_experts(rows, sizes):
        return torch.cat([expert(part) for expert, part in zip(experts, rows.split(sizes))])

    def causal(q, k, v):
        return F.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True
        ).transpose(1, 2)

    def dispatched(rows):
        splits = expert_parallel.exchange_expert_counts(counts, None)
        return expert_parallel.ExpertParallelDispatch(None)(rows, splits, run_experts)

    def identity(x):
        return x

    return [
        ("copy_to_tp", lambda x: parallel.copy_to_tp(x, None), identity, (x,)),
        ("reduce_from_tp", lambda x: parallel.reduce_from_tp(x, None), identity, (x,)),
        ("gather_from_tp", lambda x: parallel.gather_from_tp(x, None), identity, (x,)),
        ("scatter_to_tp", lambda x: parallel.scatter_to_tp(x, None, dim=1), identity, (x,)),
        ("gather_from_sp", lambda x: parallel.gather_from_sp(x, None), identity, (x,)),
        ("reduce_scatter_to_sp", lambda x: parallel.reduce_scatter_to_sp(x, None), identity, (x,)),
        (
            "vocab_parallel_cross_entropy",
            lambda z: parallel.vocab_parallel_cross_entropy(z, targets, group=None),
            lambda z: F.cross_entropy(z, targets),
            (logits,),
        ),
        (
            "ring_attention",
            lambda q, k, v: context_parallel.ring_attention(q, k, v, torch.arange(8)[None], None),
            causal,
            (q, k, v),
        ),
        (
            "dispatch_to_experts",
            dispatched,
            lambda rows: run_experts(rows, counts.tolist()),
            (rows,),
        ),
    ]


def test_each_collective_helper_given_group_none_returns_the_one_process_result():
    for name, helper, one_process, inputs in one_process_cases():
        here = [t.clone().requires_grad_() for t in inputs]
        one = [t.clone().requires_grad_() for t in inputs]
        out, expected = helper(*here), one_process(*one)
        torch.testing.assert_close(out, expected, msg=lambda m: f"{name}(group=None): {m}")
        dy = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
        out.backward(dy)
        expected.backward(dy)
        for a, b in zip(here, one):
            torch.testing.assert_close(
                a.grad, b.grad, msg=lambda m: f"{name}(group=None), its input's gradient: {m}"
            )


def toy_model_pair():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    one = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    one.load_state_dict(model.state_dict())
    return model, one


def test_a_reducer_given_group_none_leaves_each_gradient_as_backward_made_it():
    model, one = toy_model_pair()
    x, y = torch.randn(8, 5, generator=torch.Generator().manual_seed(1)), torch.zeros(8, 3)
    for reducer in (parallel.GradientBuckets, parallel.ShardedGradientBuckets):
        model.zero_grad(set_to_none=True)
        one.zero_grad(set_to_none=True)
        sync = reducer(list(model.parameters()), None)
        F.mse_loss(model(x), y).backward()
        sync.finish()
        F.mse_loss(one(x), y).backward()
        for p, q in zip(model.parameters(), one.parameters()):
            torch.testing.assert_close(
                p.grad, q.grad, rtol=0, atol=0, msg=lambda m: f"{reducer.__name__}: {m}"
            )


def no_group_reducer(name, model):
    """The reducer `name` of `model`'s parameters with group=None, and the optimizer that steps with
    it."""
    params, adamw = list(model.parameters()), dict(lr=1e-2, weight_decay=0.1)
    if name == "all-reduce":
        return parallel.GradientBuckets(params, None), optim.AdamW(params, **adamw)
    units = [(None, list(model[2].parameters()), 0)] + [
        (m, list(m.parameters()), 0) for m in model[:2]
    ]
    if name.startswith("Muon"):
        stage = int(name[-1])
        sync = optim.muon_buckets(
            params, [model[0].weight], None, 1e-5, zero_stage=stage, units=units, model=model
        )
        return sync, optim.Muon(
            [{"params": [model[0].weight], "muon": True}, {"params": params[1:]}],
            grad_sync=sync,
            **adamw,
        )
    if name == "ZeRO-3":
        sync = zero.FullyShardedParameters(params, None, units, model)
    else:
        sync = {"ZeRO-1": parallel.ShardedGradientBuckets, "ZeRO-2": zero.GradientShards}[name](
            params, None, 1e-5
        )
    return sync, parallel.ZeroOneAdamW(params, sync, **adamw)


@pytest.mark.parametrize(
    "name",
    ["all-reduce", "ZeRO-1", "ZeRO-2", "ZeRO-3", "Muon ZeRO-1", "Muon ZeRO-2", "Muon ZeRO-3"],
)
def test_a_reducer_given_no_group_is_one_rank_that_sends_nothing_and_steps_as_its_optimizer_alone(
    monkeypatch, name
):
    """group=None means "not split" (parallel.py's docstring): every reducer and its buckets, given
    none, hold every element on this one rank, call no collective (each of torch's raises here), and
    two steps move the weights as the optimizer over plain p.grad does (torch's AdamW; Muon without
    a reducer)."""
    for collective in (
        "all_reduce",
        "reduce",
        "broadcast",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "get_backend",
        "get_global_rank",
    ):
        monkeypatch.setattr(
            torch.distributed, collective, lambda *a, **k: pytest.fail("a collective ran")
        )
    for module in (parallel, zero):
        monkeypatch.setattr(
            module, "_all_gather_single", lambda *a, **k: pytest.fail("a collective ran")
        )
    monkeypatch.setattr(
        parallel, "_reduce_scatter_single", lambda *a, **k: pytest.fail("a collective ran")
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 5), nn.Linear(5, 3))
    alone = copy.deepcopy(model)
    sync, optimizer = no_group_reducer(name, model)
    if name.startswith("Muon"):
        reference = optim.Muon(
            [{"params": [alone[0].weight], "muon": True}, {"params": list(alone.parameters())[1:]}],
            lr=1e-2,
            weight_decay=0.1,
        )
    else:
        reference = torch.optim.AdamW(alone.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(2):
        x, y = torch.randn(8, 4), torch.randn(8, 3)
        sync.set_grad_sync(True)
        F.mse_loss(model(x), y).backward()
        if hasattr(sync, "backward_done"):
            sync.backward_done("B", 0)
        sync.finish()
        optimizer.step()
        optimizer.zero_grad()
        F.mse_loss(alone(x), y).backward()
        reference.step()
        reference.zero_grad()
    whole = (
        {p: p.detach().clone() for ps in sync.unit_by_unit() for p in ps}
        if name.endswith("ZeRO-3")
        else {}
    )
    for p, q in zip(model.parameters(), alone.parameters()):
        torch.testing.assert_close(whole.get(p, p.detach()), q.detach(), rtol=1e-6, atol=1e-7)
