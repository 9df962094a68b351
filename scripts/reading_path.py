"""
What a learner reads to understand each mechanism, measured: every line reached by following the calls from
the mechanism's entry points, and how many of those lines exist only for another mechanism or setting.

    python scripts/reading_path.py           the table, in markdown (the README shows it)
    python scripts/reading_path.py --show    and under it, per mechanism, each def read and each "other" part
    python scripts/reading_path.py --write   rewrite the README's copy of the table

The walk. A row starts from its entry points (ENTRIES below: "file name", a def or class, Class.method for
a method; or "file name: text", the lines of that def the text marks as OTHER's are marked, below: ZeRO-1's
wiring in train.py). It reads the whole of each def or class it reaches, with the comment lines just above
it, and follows every name in it (ast; annotations left out) that is a def or class of picotron's own
top-level files: a bare name of the file or one imported from another of them, self.method and
super().method through the class and its picotron bases, module.name and Class.method. It stops at torch,
builtins and the standard library (they are not picotron's files) and at what STOPS names for the row. A
call on any other object (bucket.views(), comm.send()) is not followed: what it calls is read only if the
walk reaches it by name. Lines read: the non-blank lines of all that, each counted once, docstrings and
comments included.

Other lines: those OTHER marks (but for what serves the row itself: a ZeRO-1 hook in GradientBuckets is
ZeRO-1's own on its row), and what only they lead to: the walk is made a second time without following
the marked lines, and whatever it no longer reaches is other too. The marks are kept here, not as comments
in the code: the code is rewritten by several hands at once, and a marker comment lost in a merge would
lower the count without a word, where an entry here that no longer matches stops the script with its name;
and the code's reader is spared a bookkeeping comment on every such line. `--show` lists every other part
with what it serves. An entry marks a whole def, or at each line of it holding its text: the statement
starting there (with the comment lines just above it); on a comment line, the comment and the statement
after it; in a docstring, that line; and "first ~ last" the lines from one holding `first` to the next
holding `last`.
"""
import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# -----------------------------------------------------------------------------
# the rows: a mechanism, its entry points ("file name" or "file name: text"), where its walk stops

ENTRIES = {
    "tensor parallel": ["parallel.py ColumnParallelLinear", "parallel.py RowParallelLinear",
                        "parallel.py VocabParallelEmbedding", "parallel.py vocab_parallel_cross_entropy"],
    "data parallel": ["parallel.py GradientBuckets"],
    "ZeRO-1": ["parallel.py ShardedGradientBuckets", "parallel.py ZeroOneAdamW",
               "train.py make_grad_sync: if zero == 1:", "train.py make_optimizer: if cfg.zero_stage >= 1:",
               "train.py forward_backward_step: parts.grad_sync.finish()", "train.py train_step: optimizer.step("],
    "1F1B": ["parallel.py one_f_one_b_actions", "parallel.py PipelineComm", "parallel.py run_schedule"],
    "ring attention": ["context_parallel.py zigzag_split", "context_parallel.py ring_attention"],
    "ZeRO-3": ["zero.py FullyShardedParameters"],
    "expert parallel": ["expert_parallel.py exchange_expert_counts", "expert_parallel.py dispatch_to_experts",
                        "expert_parallel.py ExpertSplit"],
    "Muon": ["optim.py Muon", "optim.py zero_one_muon_buckets"],
}
# what a row's walk does not enter (its entry points aside): a file, or "file name". Every row stops at the
# model, read on its own (a mechanism that swaps the model's layers names them without reading them)
STOPS = {
    "every row": ["model.py"],
    "1F1B": ["pipeline_schedules.py"],  # the schedules beyond 1F1B, and the split backward
}

# -----------------------------------------------------------------------------
# the lines that exist only for another mechanism or setting: (where, what they serve). A row named in what
# they serve ("ZeRO-2 and ZeRO-3") reads them as its own

OTHER = [
    # tensor parallelism: the fill protocol (checkpoints, import_hf), the matmul hook (the split backward of
    # pipeline_schedules.py), sequence parallelism's hooks, the vocabulary padding (kernel sizes)
    ("parallel.py RowParallelLinear: (sequence parallelism's SequenceParallelRowLinear reduce-scatters instead)",
     "sequence parallelism"),
    ("parallel.py VocabParallelEmbedding: Hook: combine ~ reduce-scatters instead", "sequence parallelism"),
    ("parallel.py padded_vocab_size: and to a multiple of 64 per rank ~ kernel sizes (nanoGPT", "kernel sizes"),
    ("parallel.py VocabParallelEmbedding: self.weight.vocab_size = vocab_size", "loading weights"),
    # (the matmul hook is not "other": it is the layers' one extension point, named as such in their
    # docstrings and parallel.py's hook list, which the issue asks for in place of moving it)
    # ZeRO-2/3: the pipeline's tied copies, summed across stages
    ("zero.py GradientShards: `tied` (copies, group): the copies ~ finish() sums their shards over it.",
     "tied embeddings (pipeline)"),
    ("zero.py GradientShards: self.tied_copies, self.tied_group = ", "tied embeddings (pipeline)"),
    ("zero.py GradientShards.plan: tied = {id(p) for p in self.tied_copies}", "tied embeddings (pipeline)"),
    ("zero.py GradientShards.finish: if self.tied_group is not None: ~ dist.all_reduce(self.where[p][0].grad_shard",
     "tied embeddings (pipeline)"),
    # 1F1B's executor: the chunks of one rank, the W actions' refusal, context parallelism's positions,
    # a dead peer's message
    ("parallel.py PipelineExecutor: `model` is the rank's stage, or a list ~ model stage each is):",
     "interleaved schedules"),
    ("parallel.py PipelineExecutor: self.chunks = list(model) if", "interleaved schedules"),
    ("parallel.py PipelineExecutor.post_receive: if source is None or self.comm.is_here(source):",
     "interleaved schedules"),
    ("parallel.py PipelineExecutor: x, y, *context = self.microbatches[i]", "ring attention"),
    ("parallel.py PipelineExecutor.act: if op not in (\"F\", \"B\"): ~ ScheduleExecutor)\")", "the split backward (zero bubble)"),
    # data parallelism: the split backward's gradients, announced by hand; the experts' divisor
    ("parallel.py GradientBuckets: fires) is announced with grad_ready(p) once complete.",
     "the split backward (zero bubble)"),
    # ring attention: document masking, soft-capping
    ("context_parallel.py visibility: (documents: ids like positions, whose positions ~ previous one and a query's",
     "document masking"),
    ("context_parallel.py visibility: span = int(positions.max()) + 1 ~ return documents * span", "document masking"),
    ("context_parallel.py ring_attention: documents (doc_mask): their document ids", "document masking"),
    ("context_parallel.py ring_attention: soft-capped when softcap > 0 (Gemma 2)", "soft-capping (Gemma 2)"),
    ("context_parallel.py _scores: t = torch.tanh(s / softcap) if softcap else None ~ return (s, None) if t is None",
     "soft-capping (Gemma 2)"),
    ("context_parallel.py _block_backward: if softcap:", "soft-capping (Gemma 2)"),
]


# -----------------------------------------------------------------------------
# reading picotron's files


DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


class Source:
    """One of picotron's files, parsed: its lines, its top-level defs and classes, what it imports from
    the others (name -> (file, name)) and which of them it imports whole (alias -> file)."""

    def __init__(self, path, files):
        self.name, self.text = path.name, path.read_text()
        self.lines = self.text.splitlines()
        self.tree = ast.parse(self.text)
        self.defs = {n.name: n for n in self.tree.body if isinstance(n, DEFS)}
        self.imported, self.modules = {}, {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and f"{node.module}.py" in files:
                for alias in node.names:
                    self.imported[alias.asname or alias.name] = (f"{node.module}.py", alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if f"{alias.name}.py" in files:
                        self.modules[alias.asname or alias.name] = f"{alias.name}.py"

    def find(self, qualname):
        """The node of a top-level def or class, or Class.method; None if there is none."""
        first, *rest = qualname.split(".")
        node = self.defs.get(first)
        for part in rest:
            node = next((n for n in getattr(node, "body", []) if isinstance(n, DEFS) and n.name == part), None)
        return node

    def is_comment(self, line):
        return self.lines[line - 1].lstrip().startswith("#")

    def comments_above(self, line):
        """The comment lines directly above `line` (no blank line between), as a range."""
        start = line
        while start > 1 and self.is_comment(start - 1):
            start -= 1
        return range(start, line)

    def def_lines(self, node):
        """A def or class whole: its decorators, its body, the comment lines just above it."""
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        return set(self.comments_above(start)) | set(range(start, node.end_lineno + 1))

    def part_lines(self, node, text):
        """The lines `text` marks inside the def `node`, at each line holding it: "first ~ last", the lines
        from one holding `first` to the next holding `last`; else in a docstring that line, on a comment line
        the comment block and the statement after it, on a line of code the statement starting there (on a
        continuation line, the innermost one holding it) with the comment lines just above it."""
        first, _, last = (part.strip() for part in text.partition(" ~ "))
        statements = [n for n in ast.walk(node) if isinstance(n, ast.stmt) and n is not node]
        strings = [n for n in statements if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
                   and isinstance(n.value.value, str)]
        found = set()
        for line in range(node.lineno, node.end_lineno + 1):
            if first not in self.lines[line - 1]:
                continue
            if last:
                end = next((k for k in range(line, node.end_lineno + 1) if last in self.lines[k - 1]), None)
                found |= set(range(line, end + 1)) if end else set()
            elif any(s.lineno <= line <= s.end_lineno for s in strings):
                found.add(line)
            else:
                start = line
                while self.is_comment(start) and start < node.end_lineno:
                    start += 1
                starting = [s for s in statements if s.lineno == start]
                holding = [s for s in statements if s.lineno <= start <= s.end_lineno]
                statement = (max(starting, key=lambda s: s.end_lineno) if starting
                             else min(holding, key=lambda s: s.end_lineno - s.lineno))
                found |= set(self.comments_above(line)) | set(range(line, statement.end_lineno + 1))
        return found


def load(root):
    files = {p.name for p in root.glob("*.py")}
    return {name: Source(root / name, files) for name in sorted(files)}


def locate(sources, where):
    """(file, qualname, lines) of a locator "file name" or "file name: text"; ValueError if it is stale."""
    place, _, text = where.partition(": ")
    file, _, qualname = place.partition(" ")
    source = sources.get(file)
    node = source.find(qualname) if source is not None else None
    if node is None:
        raise ValueError(f"{where!r}: {file} has no def or class {qualname!r}")
    lines = source.part_lines(node, text) if text else source.def_lines(node)
    if not lines:
        raise ValueError(f"{where!r}: no line of {file} {qualname} holds {text!r}")
    return file, qualname, lines


# -----------------------------------------------------------------------------
# the walk


def names_in(node, skip):
    """The Name and Attribute nodes under `node` that a reader follows: not in annotations, not on a line
    in `skip` (the row's "other" lines), nor in a statement that starts on one."""
    todo = [node]
    while todo:
        n = todo.pop()
        if isinstance(n, ast.stmt) and n is not node and n.lineno in skip:
            continue
        if isinstance(n, (ast.Name, ast.Attribute)) and n.lineno not in skip:
            yield n
        children = [v for field, value in ast.iter_fields(n) if field not in ("annotation", "returns")
                    for v in (value if isinstance(value, list) else [value]) if isinstance(v, ast.AST)]
        todo += reversed(children)  # popped in the order they are written


def method_of(sources, file, cls, name, seen=()):
    """(file, "Class.method") of `name` looked up in class `cls` of `file`, then in its picotron bases."""
    source = sources[file]
    node = source.defs.get(cls)
    if not isinstance(node, ast.ClassDef) or (file, cls) in seen:
        return None
    if source.find(f"{cls}.{name}") is not None:
        return file, f"{cls}.{name}"
    for base in node.bases:
        target = resolve_name(sources, file, base.id) if isinstance(base, ast.Name) else None
        found = target and method_of(sources, *target, name, seen + ((file, cls),))
        if found:
            return found
    return None


def resolve_name(sources, file, name):
    """(file, name) of a bare name read in `file`: its own top-level def or class, or one it imports."""
    if name in sources[file].defs:
        return file, name
    target = sources[file].imported.get(name)
    return target if target and target[1] in sources[target[0]].defs else None


def resolve(sources, file, cls, n):
    """Where a Name or Attribute node read in `file` (inside class `cls`, or None) leads: (file, qualname)."""
    if isinstance(n, ast.Name):
        return resolve_name(sources, file, n.id)
    value = n.value
    if isinstance(value, ast.Name) and value.id in ("self", "cls") and cls:
        return method_of(sources, file, cls, n.attr)
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super" and cls:
        bases = [b.id for b in sources[file].defs[cls].bases if isinstance(b, ast.Name)]
        return next(filter(None, (method_of(sources, *resolve_name(sources, file, b) or (file, b), n.attr)
                                  for b in bases)), None)
    if isinstance(value, ast.Name) and value.id in sources[file].modules:
        module = sources[file].modules[value.id]
        return (module, n.attr) if n.attr in sources[module].defs else None
    if isinstance(value, ast.Name):  # Class.method
        target = resolve_name(sources, file, value.id)
        return target and method_of(sources, *target, n.attr)
    return None


def stopped(row, file, qualname):
    return any(stop in (file, f"{file} {qualname}", f"{file} {qualname.split('.')[0]}")
               for stop in STOPS.get("every row", []) + STOPS.get(row, []))


def other_lines(sources, row):
    """{file: {line: what it serves}} of OTHER, but for what serves the row itself."""
    marked = {}
    for where, serves in OTHER:
        file, _, lines = locate(sources, where)
        if row not in re.split(r", | and ", serves):
            marked.setdefault(file, {}).update(dict.fromkeys(lines, serves))
    return marked


def walk(sources, row, skip):
    """What row's reader reads, not following what the lines in `skip` ({file: lines}) name: ({file: set of
    lines}, [(file, qualname, its lines)] in the order reached)."""
    read, order, todo, seen = {}, [], [], set()
    for where in ENTRIES[row]:
        file, qualname, lines = locate(sources, where)
        todo.append((file, qualname, lines, ": " in where))
    entries = len(todo)
    while todo:
        file, qualname, lines, part = todo.pop(0)
        key = (file, qualname, part and min(lines))
        entries -= 1
        if key in seen or (entries < 0 and stopped(row, file, qualname)):
            continue
        seen.add(key)
        read.setdefault(file, set()).update(lines)
        order.append((file, qualname if not part else f"{qualname} (line {min(lines)})", lines))
        top = sources[file].defs.get(qualname.split(".")[0])
        cls = top.name if isinstance(top, ast.ClassDef) else None
        for n in names_in(sources[file].find(qualname), skip.get(file, set())):
            target = resolve(sources, file, cls, n) if not part or n.lineno in lines else None
            if target is not None:
                todo.append((*target, sources[target[0]].def_lines(sources[target[0]].find(target[1])), False))
    return read, order


def measure(sources, row):
    """(lines read, of which other, the walk's order, {file: {other line: what it serves}}) for a row. Read:
    everything the walk reaches. Other: the lines OTHER marks, and what is reached only through them (the
    walk again, not following the marked lines, does not reach it)."""
    marked = other_lines(sources, row)
    read, order = walk(sources, row, {})
    core, _ = walk(sources, row, marked)
    others = {}
    for file, lines in read.items():
        others[file] = {k: marked.get(file, {}).get(k, "reached only from other lines") for k in lines
                        if k in marked.get(file, {}) or k not in core.get(file, set())}

    def count(file, lines):
        return sum(1 for k in lines if sources[file].lines[k - 1].strip())
    return (sum(count(file, lines) for file, lines in read.items()),
            sum(count(file, lines) for file, lines in others.items()), order, others)


# -----------------------------------------------------------------------------
# the table

HEADER = "| mechanism | entry points | lines read | of which other |\n|---|---|---|---|"


def entry_cell(row):
    """The row's entry points, by file: its defs and classes, then the defs whose lines it reads."""
    whole, parts = {}, {}
    for where in ENTRIES[row]:
        place, _, text = where.partition(": ")
        file, _, name = place.partition(" ")
        names = (parts if text else whole).setdefault(file, [])
        if f"`{name}`" not in names:
            names.append(f"`{name}`")
    cells = [f"{file} " + ", ".join(names) for file, names in whole.items()]
    cells += [f"{file}: lines of " + ", ".join(names) for file, names in parts.items()]
    return "; ".join(cells)


def table(sources):
    rows = [HEADER]
    for row in ENTRIES:
        total, other, _, _ = measure(sources, row)
        rows.append(f"| {row} | {entry_cell(row)} | {total} | {other} |")
    return "\n".join(rows)


def details(sources):
    """Per row: each def read with its non-blank lines, and each run of "other" lines with what it serves."""
    out = []
    for row in ENTRIES:
        total, other, order, others = measure(sources, row)
        out.append(f"\n## {row}: {total} lines read, {other} other")
        shown = {}
        for file, name, lines in order:  # (a method of a class already listed adds nothing)
            new = lines - shown.setdefault(file, set())
            shown[file] |= lines
            n = sum(1 for k in new if sources[file].lines[k - 1].strip())
            if n:
                out.append(f"  read   {file} {name}: {n} line{'s' if n != 1 else ''}")
        for file, marked in others.items():
            for start, end, serves in runs(marked):
                out.append(f"  other  {file} {start}-{end}: {serves}")
    return "\n".join(out)


def runs(marked):
    """[(first, last, what)] of {line: what}, consecutive lines serving the same thing joined."""
    found = []
    for k in sorted(marked):
        if found and found[-1][1] == k - 1 and found[-1][2] == marked[k]:
            found[-1] = (found[-1][0], k, marked[k])
        else:
            found.append((k, k, marked[k]))
    return found


def with_table(readme, new):
    """The README's text with its table (from HEADER's first line to the first line not in a table) new."""
    lines = readme.splitlines(keepends=True)
    first = HEADER.splitlines()[0]
    start = next((k for k, line in enumerate(lines) if line.rstrip("\n") == first), None)
    if start is None:
        raise SystemExit(f"README.md has no line {first!r}: put the table where it belongs once by hand "
                         f"(python scripts/reading_path.py prints it), then --write keeps it current")
    end = next((k for k in range(start, len(lines)) if not lines[k].startswith("|")), len(lines))
    return "".join(lines[:start]) + new + "\n" + "".join(lines[end:])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--show", action="store_true", help="list each def read and each other part, per row")
    parser.add_argument("--write", action="store_true", help="rewrite the table in README.md")
    args = parser.parse_args(argv)
    sources = load(ROOT)
    try:
        text = table(sources)
    except ValueError as e:
        raise SystemExit(f"scripts/reading_path.py: a stale entry in ENTRIES or OTHER: {e}; change it to where the "
                         f"code is now")
    print(text)
    if args.show:
        print(details(sources))
    if args.write:
        readme = ROOT / "README.md"
        readme.write_text(with_table(readme.read_text(), text))
        print(f"wrote {readme.relative_to(ROOT)}'s table", file=sys.stderr)


if __name__ == "__main__":
    main()
