"""
The communication ledger: every torch.distributed call a process makes, counted from outside.

    with CommLedger(layout_groups(layout, pipeline)) as ledger:
        step()
    ledger.summary()   # {mechanism: {op: {"calls", "bytes", "waited_ms"}}}
    ledger.waits()     # {mechanism: ms this rank stood waiting}

It is applied the way a layout is applied to a model: inside the `with` block the functions of
torch.distributed that the mechanisms call (dist.all_reduce, dist.isend, ...) are
wrapped, and on leaving it they are put back, so outside a block nothing is wrapped and nothing is
paid. The mechanisms call plain torch.distributed and know nothing of it.

Each call is recorded under the mechanism its process group serves (the layout's tp, cp, dp, ep and
pp groups; any other group, the world's barriers and votes, under "world"), its op, dtype and
elements, the bytes this rank sends, and the milliseconds it stood in the call or in its wait().

Bytes sent follow nccl-tests' accounting (its PERFORMANCE.md: bus bandwidth), which
tools/step_time.py's ring formulas price: for n ranks and a tensor of S bytes an all-reduce sends
2(n-1)/n S, an all-gather or a reduce-scatter (n-1)/n of the whole tensor, a broadcast or a reduce
S; an all-to-all sends the bytes bound for the other ranks, a send S, a receive nothing; a gather
each rank's S to the root (the root nothing), a scatter the root's n-1 slices of S each (the others
nothing).
"""

import inspect
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

MECHANISMS = ("dp", "tp", "cp", "ep", "pp")

# torch.distributed's name -> the op the ledger counts it as
OPS = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
    "send": "send",
    "isend": "send",
    "recv": "recv",
    "irecv": "recv",
    "barrier": "barrier",
}

_open = []  # the ledgers whose `with` block is open now: every call is recorded in each
_lock = threading.Lock()
_originals = {}  # name -> torch.distributed's own function, while wrapped


def layout_groups(layout, pipeline=None):
    """{process group: mechanism} of a layout (parallel.ParallelLayout) and, when there is one, its
    pipeline's groups (parallel.Pipeline.groups). Data parallelism's groups come last, so a group
    that is the dp line and also serves another axis (ep = dp) is named for data parallelism, the
    all-to-all excepted (only expert parallelism sends one)."""
    named = {}
    for mechanism, group in (
        ("tp", layout.tp_group),
        ("cp", layout.cp_group),
        ("ep", layout.ep_group),
        ("dp", layout.dp_group),
        ("dp", layout.dp_cp_group),
        ("dp", layout.expert_dp_group),
    ):
        if group is not None:
            named[group] = mechanism
    for group in pipeline.groups() if pipeline is not None else ():
        named[group] = "pp"
    return named


def sent_bytes(op, args, n):
    """The bytes this rank sends in one call of `op` (OPS's name) with bound arguments `args`, in a
    group of n ranks, and the tensor whose dtype and elements are recorded."""
    if op == "all_reduce":
        t = args["tensor"]
        return 2 * (n - 1) * t.nbytes // n, t
    if op == "all_gather":
        whole = args.get("output_tensor")
        if whole is None:  # the list form: n tensors like the input
            t = args["tensor"]
            return (n - 1) * t.nbytes, t
        return (n - 1) * whole.nbytes // n, whole
    if op == "reduce_scatter":
        whole = args["input"]
        return (n - 1) * whole.nbytes // n, whole
    if op == "all_to_all":
        t, splits = args["input"], args.get("input_split_sizes")
        rank = dist.get_rank(args.get("group"))
        own = splits[rank] if splits else t.shape[0] // n
        per_row = t.nbytes // max(t.shape[0], 1)
        return (t.shape[0] - own) * per_row, t
    if op == "gather":  # (its root as a global rank: dst, as optim.post_gather_to_owner gives it)
        t = args["tensor"]
        return (t.nbytes if dist.get_rank() != args.get("dst") else 0), t
    if op == "scatter":
        t = args["tensor"]
        return ((n - 1) * t.nbytes if dist.get_rank() == args.get("src") else 0), t
    if op in ("broadcast", "reduce", "send", "recv"):
        t = args["tensor"]
        return (t.nbytes if op != "recv" else 0), t
    return 0, None  # barrier


class CommLedger:
    """Records every torch.distributed call made inside its `with` block (see the file's top)."""

    def __init__(self, groups):
        self.groups = groups  # {process group: mechanism}, layout_groups's
        self.entries = {}  # (mechanism, op, dtype) -> [calls, elements, bytes, waited_ms]

    def __enter__(self):
        with _lock:
            if not _open:
                wrap_torch_distributed()
            _open.append(self)
        return self

    def __exit__(self, *exc):
        with _lock:
            _open.remove(self)
            if not _open:
                unwrap_torch_distributed()

    def mechanism(self, group, op):
        """Its group's mechanism; an all-to-all is expert parallelism's and a send or a receive on
        the world's group the pipeline's activations' (no other mechanism sends either there)."""
        if op == "all_to_all":
            return "ep"
        world = c10d._get_default_group()
        if group is None or group is world:
            return "pp" if op in ("send", "recv") else "world"
        return self.groups.get(group, "world")

    def record(self, mechanism, op, tensor, sent):
        dtype = str(tensor.dtype).replace("torch.", "") if tensor is not None else "-"
        entry = self.entries.setdefault((mechanism, op, dtype), [0, 0, 0, 0.0])
        entry[0] += 1
        entry[1] += tensor.numel() if tensor is not None else 0
        entry[2] += sent
        return entry

    def summary(self):
        """{mechanism: {op: {"calls", "bytes", "waited_ms"}}} (dtypes summed)."""
        out = {}
        for (mechanism, op, _), (calls, _, sent, ms) in sorted(self.entries.items()):
            row = out.setdefault(mechanism, {}).setdefault(
                op, {"calls": 0, "bytes": 0, "waited_ms": 0.0}
            )
            row["calls"] += calls
            row["bytes"] += sent
            row["waited_ms"] += ms
        return out

    def waits(self):
        """{mechanism: ms this rank stood waiting on its communication}, every mechanism named."""
        out = {m: 0.0 for m in MECHANISMS}
        for (mechanism, _, _), entry in self.entries.items():
            if mechanism in out:
                out[mechanism] += entry[3]
        return out

    def bytes_sent(self):
        """{mechanism: bytes this rank sent}."""
        out = {}
        for (mechanism, _, _), entry in self.entries.items():
            out[mechanism] = out.get(mechanism, 0) + entry[2]
        return out


class TimedWork:
    """An asynchronous call's Work: its wait() adds the time waited to the entries it was counted
    in. Anything else is the Work's own."""

    def __init__(self, work, entries):
        self._work, self._entries = work, entries

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        done = self._work.wait(*args, **kwargs)
        ms = 1e3 * (time.perf_counter() - start)
        for entry in self._entries:
            entry[3] += ms
        return done

    def __getattr__(self, name):
        return getattr(self._work, name)


def counted_call(name, original):
    """torch.distributed.<name>, recording each call in every open ledger."""
    names = list(inspect.signature(original).parameters)  # (torch's, each a named parameter)
    op = OPS[name]

    def call(*args, **kwargs):
        # the arguments by name, as Signature.bind names them, at a fraction of its cost (bind
        # was half the ledger's 30 us a call)
        bound = dict(zip(names, args), **kwargs)
        group = bound.get("group")
        sent, tensor = sent_bytes(op, bound, dist.get_world_size(group))
        entries = [ledger.record(ledger.mechanism(group, op), op, tensor, sent) for ledger in _open]
        start = time.perf_counter()
        result = original(*args, **kwargs)
        if name in ("isend", "irecv") or bound.get("async_op", False):
            return TimedWork(result, entries)  # waited where it is waited for
        for entry in entries:
            entry[3] += 1e3 * (time.perf_counter() - start)
        return result

    call.__wrapped__ = original
    return call


# isend and irecv are wrapped in torch's own module too: a P2POp accepts only what that module calls
# isend and irecv, and batch_isend_irecv calls each op's function, so a batch is counted op by op
P2P_TOO = ("isend", "irecv")


def wrap_torch_distributed():
    for name in OPS:
        original = getattr(dist, name, None)
        if original is not None:
            _originals[name] = original
            setattr(dist, name, counted_call(name, original))
            if name in P2P_TOO:
                setattr(c10d, name, getattr(dist, name))


def unwrap_torch_distributed():
    for name, original in _originals.items():
        setattr(dist, name, original)
        if name in P2P_TOO:
            setattr(c10d, name, original)
    _originals.clear()


# -----------------------------------------------------------------------------
# A run that proves what it was asked for ran: after its first step, every parallel axis above 1
# and every setting that turns a mechanism on is held to what the ledger saw (summed over the
# world) and to three counters: the Newton-Schulz orthogonalisations (optim.Muon), the FP8 scaled
# matmuls (fp8.Float8Matmul) and the graphs torch.compile made.

COUNTERS = (
    "newton_schulz",
    "muon_matrices",
    "muon_expert_matrices",
    "muon_dealt",
    "fp8_matmuls",
    "compiled_graphs",
)
OP_NAMES = sorted(set(OPS.values()))


class MechanismNotRun(Exception):
    """A mechanism the settings turned on did nothing in the run's first step."""


def promised(cfg, layout):
    """[(setting, mechanism or None, ops or a counter, what it failed to do)]: what each setting
    that turns a mechanism on must make the first step send or count."""
    rows, dp_cp = [], layout.dp * layout.cp
    if layout.tp > 1:
        reduced = ("all_reduce", "reduce_scatter", "all_gather")
        rows.append((f"tp = {layout.tp}", "tp", reduced, "reduced no activation or gradient"))
        if cfg.sequence_parallel:
            # (a reduce-scatter, or on gloo parallel.reduce_scatter's sends)
            scattered = ("reduce_scatter", "send")
            rows.append(("sequence_parallel", "tp", scattered, "scattered no activation"))
    if dp_cp > 1:
        where = f"dp * cp = {dp_cp}"
        reduced = ("all_reduce", "reduce_scatter", "send")
        rows.append((where, "dp", reduced, "averaged no gradient across data-parallel ranks"))
        if cfg.zero_stage > 0:
            rows.append(
                (f"zero_stage = {cfg.zero_stage}", "dp", ("all_gather",), "gathered no parameter")
            )
    if layout.cp > 1:
        rows.append(
            (f"cp = {layout.cp}", "cp", ("send",), "passed no keys or values around the ring")
        )
    if layout.ep > 1:
        rows.append(
            (f"ep = {layout.ep}", "ep", ("all_to_all",), "sent no token to another rank's experts")
        )
    if layout.pp > 1:
        rows.append(
            (f"pp = {layout.pp}", "pp", ("send",), "sent nothing from one stage to the next")
        )
    if cfg.fp8 != "none":
        rows.append((f"fp8 = {cfg.fp8!r}", None, "fp8_matmuls", "ran no FP8 scaled matmul"))
    if cfg.optimizer == "muon":
        rows.append(("optimizer = 'muon'", None, "newton_schulz", "orthogonalised no matrix"))
    if cfg.compile:
        rows.append(("compile = True", None, "compiled_graphs", "compiled no graph"))
    return rows


def world_totals(ledger, counts, layout, device="cpu"):
    """({(mechanism, op): calls}, {counter: count}), each summed over the world's ranks (one
    all-reduce, made outside any ledger, on `device`: NCCL's must be the GPU's)."""
    keys = [(m, op) for m in MECHANISMS for op in OP_NAMES]
    calls = {}
    for (mechanism, op, _), entry in ledger.entries.items():
        calls[(mechanism, op)] = calls.get((mechanism, op), 0) + entry[0]
    values = [calls.get(k, 0) for k in keys] + [counts[c] for c in COUNTERS]
    values = torch.tensor(values, dtype=torch.int64, device=device)
    if layout.world_size > 1:
        dist.all_reduce(values)
    values = values.tolist()
    return dict(zip(keys, values)), dict(zip(COUNTERS, values[len(keys) :]))


def unproven(cfg, layout, calls, counts):
    """The lines naming each mechanism the settings turned on that did nothing (world_totals's
    calls and counts of the first step); [] when each did its work."""
    problems = []
    for setting, mechanism, what, failed in promised(cfg, layout):
        if mechanism is None:
            done = counts[what] > 0
        else:
            done = any(calls.get((mechanism, op), 0) > 0 for op in what)
        if not done:
            saw = (
                f"no {' or '.join(what)} on the {mechanism} groups" if mechanism else f"{what} = 0"
            )
            problems.append(
                f"{setting}: the first step {failed} (the ledger saw {saw}): the mechanism is not "
                f"wired into the step. This is picotron's fault, not the settings': report it, and "
                f"train without {setting.split(' ')[0]} meanwhile"
            )
    return problems + muon_count_problems(cfg, layout, counts)


def muon_count_problems(cfg, layout, counts):
    """Each Muon matrix is orthogonalised once a step by each tensor-parallel rank of the data-
    parallel ranks that update it: all of them under ZeRO-0, its owner under ZeRO-1, 2 and 3
    (optim.deal_whole); a matrix that muon_tp_mode deals to one tp rank (optim.deal_tp) by that rank
    alone. counts["muon_matrices"] sums the ranks' matrices (counts["muon_expert_matrices"] the
    experts' among them) and counts["muon_dealt"] the dealt ones each rank steps (every tp rank of
    an updating rank counts it), so the orthogonalisations owed are the first sum, under ZeRO a
    dense matrix's over the dp x cp ranks holding it and an expert's over the dp x cp / ep, less
    (tp - 1) / tp of the last."""
    if cfg.optimizer != "muon" or counts["newton_schulz"] == 0:
        return []  # (none at all: unproven's line already says so)
    owed, experts = counts["muon_matrices"], counts["muon_expert_matrices"]
    if cfg.zero_stage >= 1:
        holders = layout.dp * layout.cp
        owed = (owed - experts) // holders + experts // (holders // layout.ep)
    owed -= counts["muon_dealt"] - counts["muon_dealt"] // layout.tp
    if counts["newton_schulz"] == owed:
        return []
    return [
        f"optimizer = 'muon': the first step orthogonalised {counts['newton_schulz']} matrices "
        f"where the ranks owe {owed} (each once per tensor-parallel rank of the rank that updates "
        f"it): a matrix stepped without Newton-Schulz, or twice. This is picotron's fault, not the "
        f"settings': report it, and train with optimizer = 'adamw' meanwhile"
    ]


def format_ledger(summary, step, rank):
    """The ledger's summary as a table: each mechanism's calls, MiB sent and ms waited, per op."""
    lines = [
        f"communication ledger of step {step}, rank {rank} (bytes sent as nccl-tests counts them):",
        f"{'mechanism':<10} {'op':<15} {'calls':>7} {'MiB sent':>10} {'ms waited':>10}",
    ]
    for mechanism, ops in sorted(summary.items()):
        for op, row in sorted(ops.items()):
            mib, ms = row["bytes"] / 2**20, row["waited_ms"]
            lines.append(f"{mechanism:<10} {op:<15} {row['calls']:>7} {mib:>10.3f} {ms:>10.1f}")
    return "\n".join(lines)
