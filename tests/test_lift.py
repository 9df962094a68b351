"""Liftable is tested, not claimed (STYLE.md): each mechanism, copied alone into an empty folder, runs a
2-rank toy equal to one process there; a lifted layer refuses to compute before it is filled; every class
that takes a group says that None means "not split".

What is copied. A core piece is a numbered section of parallel.py with the sections its header names on
its `# Needs:` line, after parallel.py's prologue (its imports, the two renamed collectives, at_least_fp32),
assembled from the section markers here, nothing copied by hand. An extension is its own file with the
whole parallel.py. Every folder is run in one launch: two processes (gloo) with the folder above them as
their working directory and nothing of the checkout on sys.path, running tests/lift_toys.py's toys, each
of which imports its mechanism from its own folder only and compares it with one process computed there.
The tolerances are tests/dist_utils.py's: 1e-5 relative on losses and outputs, by ||a - b|| / ||b|| 1e-4
on gradients and 1e-3 on weights after AdamW; the pipeline's are exact (its toy says why).
"""
import ast
import copy
import builtins
import inspect
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
from parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, mark_filled

ROOT = Path(__file__).resolve().parent.parent
PARALLEL = (ROOT / "parallel.py").read_text()

# folder: the section of parallel.py a core piece is, or the file an extension is
CORE = {"tensor_parallel": 4, "pipeline": 6, "data_parallel": 2, "zero_one": 3}
EXTENSIONS = {"context_parallel": "context_parallel.py", "expert_parallel": "expert_parallel.py", "zero": "zero.py"}
# tests/lift_toys.py's toys, and the folder each lifts its mechanism from
TOYS = {"tensor_parallel_mlp": "tensor_parallel", "pipeline_1f1b": "pipeline", "data_parallel": "data_parallel",
        "zero_one": "zero_one", "ring_attention": "context_parallel", "expert_all_to_all": "expert_parallel",
        "zero_three": "zero"}
TOLERANCE = {"loss": LOSS_RTOL, "output": LOSS_RTOL, "gradient": GRAD_NORM_RTOL, "weight": WEIGHT_RTOL, "exact": 0.0}


# -----------------------------------------------------------------------------
# assembling a core piece from parallel.py's section markers

SECTION = re.compile(r"^# -{20,}\n# (\d+)\. ", re.M)


def sections(source=PARALLEL):
    """(the prologue: everything above the first numbered section, without the module docstring;
    {n: section n, from its marker to the next numbered one})."""
    starts = [(int(m.group(1)), m.start()) for m in SECTION.finditer(source)]
    prologue = source[:starts[0][1]]
    docstring = ast.parse(prologue).body[0]
    prologue = "\n".join(prologue.splitlines()[docstring.end_lineno:]) + "\n"
    ends = [start for _, start in starts[1:]] + [len(source)]
    return prologue, {n: source[start:end] for (n, start), end in zip(starts, ends)}


def needs(section):
    """The sections a section's header names on its `# Needs:` line (the names in parentheses left out)."""
    header = section.split("\n\n", 1)[0]
    line = re.search(r"^# Needs: (.*?)\.$", header, re.M | re.S)
    assert line, f"the header of\n{header}\nhas no '# Needs:' line saying which other sections it needs"
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
    """The text of section n lifted: the prologue, the sections it needs and itself, in their order."""
    prologue, parts = sections()
    chosen = with_needs(n, parts)
    title = f"picotron's parallel.py, sections {', '.join(map(str, chosen))} alone (assembled by tests/test_lift.py)"
    return f'"""{title}."""\n' + prologue + "".join(parts[m] for m in chosen)


def unbound_names(source):
    """Names the code reads that nothing in it binds and that are not builtins: what a lifted file lacks.
    Coarse (a name bound anywhere counts as bound everywhere), which is enough to catch a missing section."""
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
    """The modules a file imports, anywhere in it, beyond torch, the standard library and `allowed`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or "").split(".")[0])
    return sorted(m for m in found if m != "torch" and m not in sys.stdlib_module_names and m not in allowed)


def test_each_section_of_parallel_py_names_the_earlier_sections_it_needs_and_lifts_with_them_alone():
    _, parts = sections()
    assert sorted(parts) == list(range(1, len(parts) + 1))
    for n, section in parts.items():
        assert all(m < n for m in needs(section)), f"section {n} needs a later section: {sorted(needs(section))}"
        missing = unbound_names(core_piece(n))
        assert not missing, (f"section {n} of parallel.py, lifted with sections {with_needs(n, parts)}, reads "
                             f"{sorted(missing)}, which none of them defines: name the section that does on its "
                             f"'# Needs:' line")


def test_the_section_check_sees_a_name_from_a_section_not_named():
    _, parts = sections()
    assert "grid_rank" in unbound_names(parts[6])  # the pipeline's from_layout, without section 1


def test_the_import_check_catches_a_lifted_file_that_imports_picotron():
    for module in ("model", "train", "settings", "metrics"):
        assert foreign_imports(f"import torch\nimport math\n\ndef f():\n    import {module}\n") == [module]
        assert foreign_imports(f"from {module} import something\n") == [module]
    assert foreign_imports("from parallel import group_size\n") == ["parallel"]
    assert foreign_imports("from parallel import group_size\n", allowed=("parallel",)) == []
    assert foreign_imports("from . import parallel\n", allowed=("parallel",)) == ["."]


# -----------------------------------------------------------------------------
# the toys, in one launch of two processes


def write_lifted(root):
    """The lifted folders under root, and lift_toys.py beside them; returns {folder: [its files]}."""
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
    """lift_toys.py on 2 ranks in root, as torchrun would start them; returns each rank's measurements. -E:
    no PYTHONPATH, so sys.path is root, the standard library and site-packages."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "PICOTRON_CHECKOUT": str(ROOT)}
    env.pop("PYTHONPATH", None)
    logs = [open(root / f"rank{r}.log", "w") for r in range(2)]
    procs = [subprocess.Popen([sys.executable, "-E", "lift_toys.py"], cwd=root, env={**env, "RANK": str(r)},
                              stdout=logs[r], stderr=subprocess.STDOUT) for r in range(2)]
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
        raise AssertionError(f"the lifted toys failed on rank {r} (exit {procs[r].returncode}):\n"
                             + (root / f"rank{r}.log").read_text()[-6000:])
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def lifted(tmp_path_factory):
    root = tmp_path_factory.mktemp("lifted")
    return SimpleNamespace(root=root, files=write_lifted(root))


@pytest.fixture(scope="module")
def measured(lifted):
    per_rank = run_two_ranks(lifted.root)
    assert all(set(on_rank) == set(TOYS) for on_rank in per_rank), f"toys run: {sorted(per_rank[0])}"
    return per_rank


def test_a_lifted_file_imports_only_torch_the_standard_library_and_for_an_extension_parallel(lifted):
    for folder, names in lifted.files.items():
        for name in names:
            allowed = ("parallel",) if folder in EXTENSIONS and name != "parallel.py" else ()
            foreign = foreign_imports((lifted.root / folder / name).read_text(), allowed)
            assert not foreign, f"{folder}/{name} imports {foreign}: a lifted file may import only torch, " \
                                f"the standard library" + (" and parallel.py" if allowed else "")


@pytest.mark.parametrize("toy", TOYS)
def test_a_mechanism_lifted_alone_equals_one_process_on_two_ranks(measured, toy):
    for rank, on_rank in enumerate(measured):
        for what, (kind, diff) in on_rank[toy].items():
            print(f"equivalence | test_lift {toy} ({TOYS[toy]}/) rank {rank} | {what}: largest relative "
                  f"difference {diff:.2e}, tolerance {TOLERANCE[kind]:.0e}", flush=True)
            assert diff <= TOLERANCE[kind], (f"{toy}, lifted into {TOYS[toy]}/, rank {rank}: {what} differs from "
                                             f"one process by {diff:.2e} (tolerance {TOLERANCE[kind]:.0e})")


# -----------------------------------------------------------------------------
# a layer refuses to compute before it is filled


def empty_layers():
    """(layer, its input, the full tensors load_full takes, what torch computes from them and the input)."""
    g = torch.Generator().manual_seed(0)
    x, ids = torch.randn(3, 4, generator=g), torch.tensor([[0, 9, 3]])
    w, b, table = torch.randn(6, 4, generator=g), torch.randn(6, generator=g), torch.randn(10, 4, generator=g)
    return [(ColumnParallelLinear(4, 6, bias=True), x, (w, b), F.linear(x, w, b)),
            (RowParallelLinear(4, 6, bias=True), x, (w, b), F.linear(x, w, b)),
            (VocabParallelEmbedding(10, 4), ids, (table,), F.embedding(ids, table))]


def test_a_layer_used_before_it_is_filled_raises_naming_itself_and_load_full():
    for layer, x, _, _ in empty_layers():
        with pytest.raises(RuntimeError, match=rf"{type(layer).__name__} \(weight .*\) was used before it was "
                                               rf"filled.*torch\.empty.*load_full"):
            layer(x)


def test_a_layer_filled_by_load_full_computes_what_torch_computes():
    for layer, x, full, expected in empty_layers():
        layer.load_full(*full)
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)


def tiny_transformer():
    cfg = ModelConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_kv_head=2, n_embd=16)
    return Transformer(cfg), torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def test_init_weights_and_load_model_mark_what_they_fill_and_only_that():
    model, x = tiny_transformer()
    with pytest.raises(RuntimeError, match="VocabParallelEmbedding .* before it was filled"):
        model(x)
    model.init_weights(0)
    logits, _ = model(x)
    # load_model a part at a time (ZeRO-3 loads a checkpoint a unit at a time): only that part may compute
    reader = SimpleNamespace(model_tensor=lambda name, p: dict(model.named_parameters())[name].detach())
    loaded, _ = tiny_transformer()
    checkpoint.load_model(loaded, reader, list(loaded.blocks["0"].parameters()))
    assert loaded.blocks["0"].attn.q_proj.filled and not loaded.blocks["1"].attn.q_proj.filled
    assert not loaded.tok_emb.filled
    checkpoint.load_model(loaded, reader)
    torch.testing.assert_close(loaded(x)[0], logits, rtol=0, atol=0)


def test_zero3_moving_a_filled_layers_weight_into_its_flat_buffer_leaves_it_filled():
    layer, x, full, expected = empty_layers()[0]
    layer.load_full(*full)
    model = nn.Sequential(layer)
    zero.FullyShardedParameters(list(model.parameters()), None, [(layer, list(layer.parameters()), 0)], model)
    assert layer.weight.untyped_storage().size() == 0  # between uses ZeRO-3 holds only the shard
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def test_mark_filled_marks_only_the_layers_whose_weight_it_is_given():
    model, _ = tiny_transformer()
    mark_filled(model, [model.blocks["1"].mlp.up.weight])
    filled = sorted(name for name, m in model.named_modules() if getattr(m, "filled", False))
    assert filled == ["blocks.1.mlp.up"]


def test_no_class_has_more_than_two_picotron_classes_above_it_and_zero_is_four_classes():
    """Composition over deep inheritance (STYLE.md): a reader holds at most three classes to know what one
    method does. ZeRO-2 and ZeRO-3 are at most four classes."""
    modules = (parallel, zero, optim, expert_parallel, pipeline_schedules, context_parallel, checkpoint)
    ours = {module.__name__ for module in modules} | {"model"}
    deep = {f"{cls.__module__}.{cls.__name__}": [c.__name__ for c in cls.__mro__[1:] if c.__module__ in ours]
            for module in modules for cls in vars(module).values()
            if inspect.isclass(cls) and cls.__module__ == module.__name__}
    assert not {name: above for name, above in deep.items() if len(above) > 2}
    assert len([c for c in vars(zero).values() if inspect.isclass(c) and c.__module__ == "zero"]) <= 4


# -----------------------------------------------------------------------------
# the hook list: what the extensions override, call or set on parallel.py's classes, all of it in its docstring

EXTENSION_FILES = ("zero.py", "optim.py", "expert_parallel.py", "pipeline_schedules.py", "context_parallel.py")
NOT_HOOKS = {"__init__", "forward", "backward", "apply", "step"}  # torch's own protocol, not a hook of ours


def core_classes(source=PARALLEL):
    """{class name: (its methods, the attributes its methods set on self)} of parallel.py, each with its
    picotron bases'."""
    classes = {node.name: node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)}

    def members(name):
        node = classes[name]
        methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
        attributes = {t.attr for n in ast.walk(node) if isinstance(n, ast.Assign) for target in n.targets
                      for t in (target.elts if isinstance(target, ast.Tuple) else [target])
                      if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                more = members(base.id)
                methods, attributes = methods | more[0], attributes | more[1]
        return methods, attributes
    return {name: members(name) for name in classes}


def extension_hooks(source, core):
    """The names a file's code uses of parallel.py's classes, as well as they can be told statically:
    the methods its subclasses of them override or reach through self or super(), the methods of theirs
    it calls on any object (by name: a name only a class here defines), and the attributes of theirs it
    sets on an object that is not self (by name too)."""
    tree = ast.parse(source)
    local = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    core_methods = set().union(*(methods for methods, _ in core.values())) - NOT_HOOKS
    core_attributes = set().union(*(attributes for _, attributes in core.values()))

    def core_bases(cls):
        names = [b.id for b in cls.bases if isinstance(b, ast.Name)]
        return [n for n in names if n in core] + [m for n in names if n in local for m in core_bases(local[n])]
    found = set()
    for cls in local.values():
        bases = core_bases(cls)
        if not bases:
            continue
        inherited = set().union(*(core[b][0] for b in bases)) - NOT_HOOKS
        own = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
        found |= own & inherited
        found |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and n.attr in inherited
                  and isinstance(n.value, ast.Name) and n.value.id == "self" and n.attr not in own}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in core_methods:
            found.add(node.func.attr)  # (super().x(...) and any object's .x(...))
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Attribute, ast.Name, ast.Lambda)):
            found |= {t.attr for t in node.targets if isinstance(t, ast.Attribute) and t.attr in core_attributes
                      and not (isinstance(t.value, ast.Name) and t.value.id == "self")}  # one value, not a new state
    return found


def listed_hooks(source=PARALLEL):
    """The names parallel.py's docstring lists as hooks, in its block that opens with 'through these hooks':
    each method written name(...), each attribute `name`."""
    doc = ast.get_docstring(ast.parse(source))
    block = doc[doc.index("through these\nhooks"):doc.index("Every piece works")]
    return set(re.findall(r"([A-Za-z_]\w*)\(", block)) | set(re.findall(r"`([A-Za-z_]\w*)`", block))


def unlisted_hooks(sources):
    core = core_classes()
    return {(name, hook) for name, source in sources.items() for hook in extension_hooks(source, core)
            if hook not in listed_hooks()}


def test_parallel_py_lists_every_hook_its_extensions_override_call_or_set():
    sources = {name: (ROOT / name).read_text() for name in EXTENSION_FILES}
    assert not unlisted_hooks(sources), (f"the extensions use these of parallel.py's classes, which its docstring "
                                         f"does not list among the hooks: {sorted(unlisted_hooks(sources))}")


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
    assert unlisted_hooks({"cheaper.py": extension}) == {("cheaper.py", "views"), ("cheaper.py", "offsets")}
    assert "plan" in extension_hooks("from parallel import GradientBuckets\nclass P(GradientBuckets):\n"
                                     "    def plan(self, params, size):\n        return []\n", core)


# -----------------------------------------------------------------------------
# group=None means "not split", in every class that takes a group


def arguments(function):
    try:
        return inspect.signature(function).parameters
    except (TypeError, ValueError):  # (a builtin's: a namedtuple's __init__)
        return ()


# the reducers and their buckets: their behaviour with group=None is tested (below) instead of their docstrings
NO_GROUP_RUNS = {parallel.Bucket, parallel.GradientBuckets, parallel.ShardedBucket, parallel.ShardedGradientBuckets,
                 zero.GradientShards, zero.FullyShardedParameters, optim.WholeMatrixBuckets, optim.WholeBucket}


def test_every_class_that_takes_a_group_says_that_none_means_not_split():
    quiet = []
    for module in (parallel, context_parallel, zero, expert_parallel, pipeline_schedules, optim):
        for name, cls in vars(module).items():
            if not inspect.isclass(cls) or cls.__module__ != module.__name__ or cls in NO_GROUP_RUNS:
                continue
            takes = {arg for method in ("__init__", "forward") for arg in arguments(getattr(cls, method, None))
                     if arg == "group" or arg.endswith("_group")}
            doc = " ".join((cls.__doc__ or "").split())
            if takes and not ("None" in doc and "not split" in doc):
                quiet.append(f"{module.__name__}.{name} ({', '.join(sorted(takes))})")
    assert not quiet, f"these take a group but their docstring does not say that None means 'not split': {quiet}"


def no_group_reducer(name, model):
    """The reducer `name` of `model`'s parameters with group=None, and the optimizer that steps with it."""
    params, adamw = list(model.parameters()), dict(lr=1e-2, weight_decay=0.1)
    if name == "all-reduce":
        return parallel.GradientBuckets(params, None), optim.AdamW(params, **adamw)
    if name == "Muon ZeRO-1":
        sync = optim.zero_one_muon_buckets(params, [model[0].weight], None, bucket_size_mb=1e-5)
        return sync, optim.Muon([{"params": [model[0].weight], "muon": True}, {"params": params[1:]}],
                                grad_sync=sync, **adamw)
    if name == "ZeRO-3":
        units = [(None, list(model[2].parameters()), 0)] + [(m, list(m.parameters()), 0) for m in model[:2]]
        sync = zero.FullyShardedParameters(params, None, units, model)
    else:
        sync = {"ZeRO-1": parallel.ShardedGradientBuckets, "ZeRO-2": zero.GradientShards}[name](params, None, 1e-5)
    return sync, parallel.ZeroOneAdamW(params, sync, **adamw)


@pytest.mark.parametrize("name", ["all-reduce", "ZeRO-1", "ZeRO-2", "ZeRO-3", "Muon ZeRO-1"])
def test_a_reducer_given_no_group_is_one_rank_that_sends_nothing_and_steps_as_its_optimizer_alone(monkeypatch, name):
    """group=None means "not split" (parallel.py's docstring): every reducer and its buckets, given none,
    hold every element on this one rank, call no collective (each of torch's raises here), and two steps
    move the weights as the optimizer over plain p.grad does (torch's AdamW; Muon without a reducer)."""
    for collective in ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                       "reduce_scatter_tensor", "get_backend", "get_global_rank"):
        monkeypatch.setattr(torch.distributed, collective, lambda *a, **k: pytest.fail("a collective ran"))
    for module in (parallel, zero):
        monkeypatch.setattr(module, "_all_gather_single", lambda *a, **k: pytest.fail("a collective ran"))
    monkeypatch.setattr(parallel, "_reduce_scatter_single", lambda *a, **k: pytest.fail("a collective ran"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 5), nn.Linear(5, 3))
    alone = copy.deepcopy(model)
    sync, optimizer = no_group_reducer(name, model)
    if name == "Muon ZeRO-1":
        reference = optim.Muon([{"params": [alone[0].weight], "muon": True}, {"params": list(alone.parameters())[1:]}],
                               lr=1e-2, weight_decay=0.1)
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
    whole = {p: p.detach().clone() for ps in sync.unit_by_unit() for p in ps} if name == "ZeRO-3" else {}
    for p, q in zip(model.parameters(), alone.parameters()):
        torch.testing.assert_close(whole.get(p, p.detach()), q.detach(), rtol=1e-6, atol=1e-7)
