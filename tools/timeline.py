"""
The pipeline schedules drawn in time, one row per rank and one column per time slot:

    python tools/timeline.py --schedule zero_bubble --pp 4 --microbatches 8
    python tools/timeline.py --schedule interleaved_1f1b --pp 4 --microbatches 8 --chunks 2

What is drawn is what runs: the rows are the very action lists the executor walks
(pipeline_schedules.SCHEDULES, routed by parallel.message_route), placed in time by a simulator of
the executor's exchanges. Each action lasts its time (forward = B = W = 1 slot, a backward not split
into B and W 2 slots); a rank runs its actions in order, each as soon as its input has been sent,
over first-in first-out channels, one per pair of ranks and kind of message. So a list that would
hang real processes, or hand one microbatch's activations to another, fails here first, without
processes (the tests put every schedule through it). Under the rows: the most microbatches each rank
holds, and the bubble measured on this timeline beside the paper's formula
(pipeline_schedules.ideal_bubble).

Then the start-up line of a pipeline run (train.py prints it: each rank's blocks and share of the
work). The end of the file measures the real thing: a step's actions timed on every rank (train.py's
pp_trace, tools/bench.py --schedules), written as pp_trace.json in Chrome's trace format with the
measured bubble; and the activation memory each rank holds for backward, sampled at every action
(ActivationMemory; tools/bench.py reports both).
"""

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager

if __name__ == "__main__" and not __package__:  # python tools/X.py: import from the repository
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist

from parallel import message_route, stage_layers
from pipeline_schedules import (
    SCHEDULES,
    balance_units,
    check_schedule,
    cost_cut,
    ideal_bubble,
    stage_work,
    virtual_stages,
)


# -----------------------------------------------------------------------------
# The simulator: the pipeline schedules' action lists (parallel.py, section 4), placed in time slots
# as the executor's exchanges would place them.

ACTION_TIME = {"F": 1, "B": 2, "W": 1}  # in slots; a backward split into B and W takes 1 + 1


def action_times(actions):
    """Each op's duration in a list: forward = B = W = 1 slot, a backward that is not split (no W in
    the list) 2 slots, as the whole backward of a layer is about twice its forward's matmuls."""
    split = any(op == "W" for op, _, _ in actions)
    return {**ACTION_TIME, "B": 1 if split else 2}


def schedule_timeline(schedule, pp, m, chunks=1, lists=None):
    """Place every rank's actions in time slots as the executor (parallel.PipelineExecutor) would
    run them, or raise RuntimeError where real processes would hang or mix up messages. Returns one
    row per rank: the action in each slot (an action lasting two slots fills two), None where the
    rank is idle.

    The model of the executor: a rank runs its actions in order, each as soon as the previous one
    ended and its input has been sent (a send never waits for its receiver); messages between two
    ranks go through one first-in first-out channel per direction and kind, so the k-th message a
    rank sends on a channel is the k-th that the other receives on it, and both must be the same
    microbatch's, for the same stage. `lists` (default: the schedule's own) lets a test hand in a
    broken one."""
    chunks = 2 if schedule == "zbv" else chunks
    lists = (
        lists if lists is not None else [SCHEDULES[schedule](pp, r, m, chunks) for r in range(pp)]
    )
    stages = [virtual_stages(schedule, pp, r, chunks) for r in range(pp)]
    where = f"{schedule} at pp={pp}, m={m}"
    sent, expected, needs = route_messages(where, lists, stages)
    check_channels(where, sent, expected)
    return place_in_time(
        f"{schedule} deadlocks at pp={pp}, m={m}, chunks={chunks}", lists, needs, sent
    )


def route_messages(where, lists, stages):
    """Walk each rank's list (stages[r]: the model stage of each of rank r's chunks) as the executor
    would, checking that every action comes after what it needs on its own rank, and route its
    messages. Returns (sent, expected, needs): for each channel (from rank, to rank, kind) the
    messages sent on it in order, as (message, rank, index of the sending action), and those
    expected on it; needs[r][k] is (channel, position) of the message rank r's action k waits for,
    or None."""
    owner = {s: r for r, held in enumerate(stages) for s in held}
    n_stages = len(owner)
    sent, expected, needs = {}, {}, []
    # on its own rank, a backward follows its forward, a W its backward
    before = {
        "B": "F",
        "W": "B",
    }
    for r, actions in enumerate(lists):
        produced, done, row = set(), set(), []
        for k, (op, i, c) in enumerate(actions):
            if op in before and (before[op], i, c) not in done:
                raise RuntimeError(
                    f"{where}: rank {r} runs {op}{i} of chunk {c} before its {before[op]}{i}"
                )
            done.add((op, i, c))
            source, destination = message_route(op, stages[r][c], n_stages)
            wait = None
            if source is not None:
                message = (op, i, stages[r][c])
                if owner[source] == r:  # handed over in memory: its producer must come first
                    if message not in produced:
                        raise RuntimeError(
                            f"{where}: rank {r} runs {op}{i} of chunk {c} before its own action "
                            f"that produces its input"
                        )
                else:
                    channel = (owner[source], r, op)
                    expected.setdefault(channel, []).append(message)
                    wait = (channel, len(expected[channel]) - 1)
            if destination is not None:
                message = (op, i, destination)
                if owner[destination] == r:
                    produced.add(message)
                else:
                    sent.setdefault((r, owner[destination], op), []).append((message, r, k))
            row.append(wait)
        needs.append(row)
    return sent, expected, needs


def check_channels(where, sent, expected):
    """Both ends of every channel agree on the order of its messages: else the receiver would take
    one microbatch's message for another's (or wait for one that never comes)."""
    kinds = {"F": "activations", "B": "gradients"}
    for channel in sorted(set(sent) | set(expected)):
        out, into = [s[0] for s in sent.get(channel, [])], expected.get(channel, [])
        if out != into:
            j = next(
                j
                for j in range(max(len(out), len(into)))
                if j >= len(out) or j >= len(into) or out[j] != into[j]
            )
            what = lambda msg: f"{msg[0]}{msg[1]} for stage {msg[2]}" if msg else "nothing"
            raise RuntimeError(
                f"{where}: rank {channel[0]}'s message #{j} of {kinds[channel[2]]} "
                f"to rank {channel[1]} is {what(out[j] if j < len(out) else None)}, but rank "
                f"{channel[1]} expects {what(into[j] if j < len(into) else None)}: the lists "
                f"disagree on the order"
            )


def place_in_time(deadlock, lists, needs, sent):
    """Run the lists in time slots: simulate_pipeline with each action lasting action_times' slots
    and messages arriving as they are sent. Returns the rows (schedule_timeline's); raises
    RuntimeError starting with `deadlock` when every rank still at work waits on another."""
    slots = [action_times(actions) for actions in lists]
    placed = simulate_pipeline(
        lists, None, lambda r, action: slots[r][action[0]], 0, (sent, needs), deadlock
    )
    rows = [[None] * max(end for _, end in placed.values()) for _ in lists]
    for (r, k), (start, end) in placed.items():
        for slot in range(start, end):
            rows[r][slot] = lists[r][k]
    return rows


def simulate_pipeline(
    lists, stages, seconds, transfer, routes=None, deadlock="the step-time simulation"
):
    """Place every rank's actions (lists[r], the schedule's; stages[r], the model stage of each of
    its chunks) in time as the executor runs them: a rank runs its actions in order, each when the
    one before has ended and its input has arrived, which is `transfer` after the action that sent
    it ended. seconds(r, action): an action's duration (slots for the printed timeline, seconds for
    tools/step_time.py); routes: route_messages' (sent, needs) of these lists, when already found.
    Returns {(r, k): (start, end)}; raises RuntimeError starting with `deadlock` when every rank
    still at work waits on another."""
    if routes is None:
        sent, expected, needs = route_messages(deadlock, lists, stages)
        check_channels(deadlock, sent, expected)
    else:
        sent, needs = routes
    # the (rank, index) of the action whose message each action waits for
    senders = [
        [None if need is None else sent[need[0]][need[1]][1:] for need in row] for row in needs
    ]
    times, position, free = {}, [0] * len(lists), [0] * len(lists)
    while any(position[r] < len(lists[r]) for r in range(len(lists))):
        progressed = False
        for r, actions in enumerate(lists):
            k = position[r]
            while k < len(actions):
                ready = 0
                if senders[r][k] is not None:
                    if senders[r][k] not in times:
                        break  # its input has not been sent yet
                    ready = times[senders[r][k]][1] + transfer
                start = max(free[r], ready)
                free[r] = start + seconds(r, actions[k])
                times[(r, k)] = (start, free[r])
                k += 1
                progressed = True
            position[r] = k
        if not progressed:
            waiting = ", ".join(
                f"rank {r} at {lists[r][position[r]]}"
                for r in range(len(lists))
                if position[r] < len(lists[r])
            )
            raise RuntimeError(f"{deadlock}: every rank waits on another ({waiting})")
    return times


# -----------------------------------------------------------------------------
# The printed timeline: the rows as text, the microbatches each rank holds, the bubble measured on
# the rows beside the paper's formula, and the command line.


def bubble_fraction(rows):
    """The share of rank-time slots spent idle."""
    return sum(row.count(None) for row in rows) / sum(len(row) for row in rows)


def held_microbatches(actions, chunks=1):
    """The most microbatches a rank holds at once, in whole stages' worth (a chunk's microbatch is
    1/chunks of one): from a microbatch's forward to the end of its backward, its W when the
    backward is split."""
    split = any(op == "W" for op, _, _ in actions)
    alive = peak = 0
    for op, _, _ in actions:
        alive += 1 if op == "F" else -1 if op == ("W" if split else "B") else 0
        peak = max(peak, alive)
    return peak / chunks


def bubble_formula(schedule, pp, m, chunks=1):
    """The paper's formula as text, for the printed timeline."""
    if ideal_bubble(schedule, pp, m, chunks) is None:
        return (
            "none in the paper for m < pp"
            if schedule == "zero_bubble"
            else "none in the paper (idle only in the first fill, pp - 1 slots, when m >= 2 pp)"
        )
    numerator, denominator = {
        "afab": (pp - 1, m + pp - 1),
        "1f1b": (pp - 1, m + pp - 1),
        "interleaved_1f1b": (pp - 1, chunks * m + pp - 1),
        "zero_bubble": (pp - 1, 3 * m + pp - 1),
    }[schedule]
    text = {
        "afab": "(pp - 1) / (m + pp - 1)",
        "1f1b": "(pp - 1) / (m + pp - 1)",
        "interleaved_1f1b": "(pp - 1) / (v m + pp - 1)",
        "zero_bubble": "(pp - 1) / (3 m + pp - 1)",
    }[schedule]
    return f"{text} = {numerator}/{denominator} = {numerator / denominator:.1%}"


def format_timeline(schedule, pp, m, chunks=1):
    """The timeline as text, one row per rank, with the microbatches each rank holds and the
    bubble."""
    if schedule == "zbv":
        chunks = 2
    rows = schedule_timeline(schedule, pp, m, chunks)
    label = lambda a: f"{a[0]}{a[1]}" + (f".{a[2]}" if chunks > 1 else "")
    width = max(len(label((op, m - 1, chunks - 1))) for op in "FBW")
    lines = [
        f"{schedule}: pp={pp} ranks, m={m} microbatches"
        + (f", {chunks} chunks per rank" if chunks > 1 else "")
        + "; a slot per forward (F), backward (B, two slots when not split into B and W) or "
        + "weight gradient (W)"
        + (", .c the chunk" if chunks > 1 else "")
        + "; .. idle"
    ]
    for r, row in enumerate(rows):
        cells = []
        for slot, a in enumerate(row):
            if a is None:
                cells.append("." * width)
            elif slot > 0 and row[slot - 1] is a:
                cells.append("-" * width)  # the action of the slot before, still running
            else:
                cells.append(label(a).ljust(width))
        lines.append(f"rank {r} | " + " ".join(cells))
    lists = [SCHEDULES[schedule](pp, r, m, chunks) for r in range(pp)]
    held = [held_microbatches(actions, chunks) for actions in lists]
    lines.append(
        "activations held at most (microbatches of a stage, F to the end of the backward): "
        + ", ".join(f"rank {r}: {h:g}" for r, h in enumerate(held))
    )
    lines.append(
        f"bubble: {bubble_fraction(rows):.1%} of the slots idle (measured on this timeline); "
        f"theory {bubble_formula(schedule, pp, m, chunks)}"
    )
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# The start-up line of a pipeline run (train.py prints it): the schedule, each rank's blocks
# and share of the work, and why the stages may not balance.


def describe_pipeline(schedule, pp, m, chunks, stage_blocks, costs, warn=True):
    """The start-up line naming the schedule, the blocks of each rank (chunk by chunk) and its share
    of the work (costs as metrics.pipeline_costs gives them), and with warn two warnings:
    balance_warning's, and one when there are fewer micro-batches than stages (the stages are then
    idle most of the step)."""
    blocks = lambda r: r.start if len(r) == 1 else f"{r.start}-{r.stop - 1}"
    per_rank = [
        ", ".join(
            str(blocks(stage_layers(stage_blocks, s)))
            for s in virtual_stages(schedule, pp, p, chunks)
        )
        for p in range(pp)
    ]
    shares = rank_work(schedule, pp, chunks, stage_blocks, costs)
    best = cost_cut(schedule, pp, chunks, costs)
    text = (
        f"pipeline: {schedule}, {m} microbatches, "
        + (f"{chunks} chunks per rank, " if chunks > 1 else "")
        + ("cut by cost, " if tuple(stage_blocks) == best else "cut by pp_layers, ")
        + ("blocks per stage " if chunks == 1 else "blocks per rank (chunk by chunk) ")
        + " | ".join(
            f"{p}: {text} ({share:.0%}{' of the work' if p == 0 else ''})"
            for p, (text, share) in enumerate(zip(per_rank, shares))
        )
    )
    if not warn:
        return text
    text += balance_warning(schedule, pp, chunks, stage_blocks, costs, best)
    if m < pp:
        bubble, whose = ideal_bubble(schedule, pp, m, chunks), schedule
        if bubble is None:  # (the paper gives no formula for this m)
            bubble, whose = ideal_bubble("1f1b", pp, m), "1f1b"
        text += (
            f"\nwarning: gradient_accumulation_steps = {m} microbatches for pp = {pp} stages: "
            f"the stages are idle about {bubble:.0%} of each step ({whose}'s bubble); raise "
            f"gradient_accumulation_steps (lowering batch_size to keep the batch): {4 * pp} "
            f"microbatches bring 1F1B's bubble, (pp - 1) / (m + pp - 1), under 20%"
        )
    return text


def balance_warning(schedule, pp, chunks, stage_blocks, costs, best):
    """A warning, or "". When no cut by cost (best: cost_cut's) brings every unit that must balance
    (balance_units: the ranks, or under interleaving the model stages) within 115% of an even
    share, the others wait for the costliest, which their measured bubble shows: the warning says
    why (the head, or blocks that do not deal evenly), lest it be taken for a failure. Or when
    pp_layers is that uneven and the cut by cost is not."""
    units = balance_units(schedule, pp, chunks)
    unit = "rank" if len(units) == pp else "model stage"
    total = lambda cut: sum(stage_work(cut, costs))
    share = lambda cut: [sum(stage_work(cut, costs)[s] for s in u) / total(cut) for u in units]
    even, best_shares, head_share = 1 / len(units), share(best), costs[2] / total(best)
    # the least the unit with the head can do: the head and the loss, a block in each of its stages
    with_head = next(u for u in units if pp * chunks - 1 in u)
    head_unit = head_share + len(with_head) * min(costs[1]) / total(best)
    if max(best_shares) > 1.15 * even:
        why = (
            f"the head and the loss alone are {head_share:.0%} of the model's work, so the "
            f"{unit} that holds them does at least {head_unit:.0%}"
            if head_unit > 1.15 * even
            else f"{len(costs[1])} blocks do not deal evenly into {pp * chunks} stages"
        )
        idle = 1 - min(best_shares) / max(best_shares)
        return (
            f"\nwarning: no cut of the blocks brings every {unit} within 115% of an even share "
            f"of the work ({even:.0%}): {why}. The others wait for the costliest"
            + (
                f", so the least busy rank is idle about {idle:.0%} of each step on top of the "
                f"schedule's bubble; "
                if unit == "rank"
                else " on every lap of the ring; "
            )
            + (
                "split the model with tp (which splits the head too) or dp rather than pp"
                + (", or use fewer chunks" if chunks > 1 else "")
                if head_unit > 1.15 * even
                else "a pp * pp_chunks that divides n_layer deals them evenly"
            )
        )
    if max(share(stage_blocks)) > 1.15 * even:
        return (
            f"\nwarning: pp_layers gives a {unit} {max(share(stage_blocks)):.0%} of the work, "
            f"where an even share is {even:.0%}; the cut by cost (pp_layers='') gives at most "
            f"{max(best_shares):.0%}: {','.join(map(str, best))}"
        )
    return ""


def rank_work(schedule, pp, chunks, stage_blocks, costs):
    """Each pipeline rank's share of the model's work (its chunks' stages summed), under the cut
    stage_blocks."""
    work = stage_work(stage_blocks, costs)
    ranks = [virtual_stages(schedule, pp, p, chunks) for p in range(pp)]
    return [sum(work[s] for s in stages) / sum(work) for stages in ranks]


# -----------------------------------------------------------------------------
# The schedule walked for memory: tools/memory_plan.py's peak, action by action


def schedule_moments(schedule, pp, stage, m, chunks, chunk_blocks, head_chunk, saved, residual):
    """Walks pipeline rank `stage`'s actions (pipeline_schedules.SCHEDULES; with pp = 1 each
    micro-batch's forward and backward in turn) and yields, after each, (op, its chunk, activation
    bytes held, micro-batches the head's chunk holds, backwards so far). A forward of chunk c adds
    `saved` per block of the chunk (chunk_blocks[c] of them); its backward takes them away, except
    that under the zero-bubble schedules (whose W actions are separate) B leaves `residual` per
    block until W. head_chunk: the chunk holding the head and the loss, or None."""
    if pp == 1:
        actions = [(op, i, 0) for i in range(m) for op in "FB"]
    else:
        actions = SCHEDULES[schedule](pp, stage, m, chunks)
    split = any(op == "W" for op, _, _ in actions)
    held, head, backwards = 0, 0, 0
    for op, _, c in actions:
        blocks = chunk_blocks[c]
        if op == "F":
            held += blocks * saved
            head += c == head_chunk
        elif op == "B":
            held += blocks * ((residual if split else 0) - saved)
            head -= c == head_chunk
            backwards += 1
        else:
            held -= blocks * residual
        yield op, c, held, head, backwards


def walk_peak(
    moments,
    head_chunk,
    zero_stage,
    recompute,
    backward_start,
    loss_held,
    loss_once,
    exchange,
    accumulated,
    buffers,
    in_flight,
):
    """(top, activations, loss): the most bytes beyond the states the step holds, over
    schedule_moments' actions, and the largest activations and loss tensors along the way.

    The step walked action by action. At the end of a forward: what is held, the block just computed
    under activation checkpointing, the loss's chunk on the head's chunk (or, if larger, an MoE
    layer's all-to-all buffers in that forward), and ZeRO-0/1's p.grad once a backward has run. As a
    backward starts: what was held before it, the block it recomputes (activation checkpointing) and
    its first tensors (backward_start). At the end of a backward or W: what is still held, and the
    gradients in flight (for ZeRO-0/1 from the second backward on: the first writes p.grad without a
    copy)."""
    top = activations = loss = before = 0  # before: the activations held before this action
    for op, c, held, held_head, backwards in moments:
        if op == "F":
            act = held + recompute
            loss_now = held_head * loss_held + (loss_once if c == head_chunk else 0)
            landing = in_flight[0] + (in_flight[1] if backwards > 1 else 0)
            now = (
                act
                + max(loss_now, held_head * loss_held + exchange)
                + ((accumulated + landing) if backwards else 0)
            )
        else:
            act, loss_now = held, held_head * loss_held
            now = (
                act + loss_now + accumulated + (buffers if zero_stage >= 2 or backwards > 1 else 0)
            )
            if op == "B":
                starting = before + recompute + backward_start + loss_now
                now = max(now, starting + (accumulated if backwards > 1 else 0))
        before = held
        top = max(top, now)
        activations, loss = max(activations, act), max(loss, loss_now)
    return top, activations, loss


# -----------------------------------------------------------------------------
# The pipeline measured: one step's actions timed on every rank, and the activations each holds


class PipelineTrace:
    """Every pipeline action's start and end on this rank during one step (pass it as
    parallel.PipelineExecutor's trace). Time zero is the end of a barrier every rank joins when the
    trace is made, so the ranks' clocks agree to within the barrier's own skew (a fraction of a
    millisecond on one machine). On a GPU each time is a CUDA event recorded on the stream: the host
    only sees kernels being launched, the events see them run. times() reads them (on a GPU after a
    synchronize, so call it after the step)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.events = []  # (action, start, end): CUDA events, or seconds since time zero
        if dist.is_initialized():
            dist.barrier()
        if self.cuda:
            torch.cuda.synchronize(device)
            self.zero = torch.cuda.Event(enable_timing=True)
            self.zero.record()
        else:
            self.zero = time.perf_counter()

    def __call__(self, action):
        return self._timed(action)

    @contextmanager
    def _timed(self, action):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((action, start, end))
        else:
            start = time.perf_counter() - self.zero
            yield
            self.events.append((action, start, time.perf_counter() - self.zero))

    def times(self):
        """[(op, microbatch, chunk, start seconds, end seconds)] in the order the actions ran."""
        if self.cuda:
            torch.cuda.synchronize()
            return [
                (*a, self.zero.elapsed_time(s) / 1e3, self.zero.elapsed_time(e) / 1e3)
                for a, s, e in self.events
            ]
        return [(*a, s, e) for a, s, e in self.events]


def measured_bubble(times_by_rank):
    """Each rank's idle share of the step: 1 - (its actions' time) / (first start to last end, over
    all ranks)."""
    spans = [t for times in times_by_rank for t in times]
    begin, finish = min(t[3] for t in spans), max(t[4] for t in spans)
    return [1 - sum(t[4] - t[3] for t in times) / (finish - begin) for times in times_by_rank]


def pipeline_values(value, layout):
    """[value of pipeline rank 0, 1, ...] of one pipeline (the ranks of data- and tensor-parallel
    rank 0), on every rank: a gather of Python objects, which every rank must join."""
    if not dist.is_initialized():
        return [value]
    gathered = [None] * layout.world_size
    dist.all_gather_object(
        gathered, (layout.pp_rank, value) if layout.dp_rank == 0 and layout.tp_rank == 0 else None
    )
    by_rank = dict(g for g in gathered if g is not None)
    return [by_rank[r] for r in range(layout.pp)]


def chrome_trace(spans_by_rank, lane_names, summary):
    """One step in Chrome's trace format (chrome://tracing, https://ui.perfetto.dev), as a dict to
    write as JSON: a process row per pipeline rank, a thread row per lane (lane_names[r]: {lane:
    its name}), a complete ("X") event per span (name, category, lane, start s, end s, args), in
    microseconds, and `summary` as otherData. The one format of a step measured
    (write_pipeline_trace, tools/bench.py --trace) and predicted (tools/step_time.py --trace), so
    tools/plot.py --trace draws either, or both."""
    events = []
    for r, spans in enumerate(spans_by_rank):
        events += [
            {"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"pipeline rank {r}"}},
            {"name": "process_sort_index", "ph": "M", "pid": r, "args": {"sort_index": r}},
        ]
        events += [
            {"name": "thread_name", "ph": "M", "pid": r, "tid": lane, "args": {"name": lane_name}}
            for lane, lane_name in lane_names[r].items()
        ]
        events += [
            {
                "name": name,
                "cat": cat,
                "ph": "X",
                "pid": r,
                "tid": lane,
                "ts": start * 1e6,
                "dur": (end - start) * 1e6,
                "args": args,
            }
            for name, cat, lane, start, end, args in spans
        ]
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": summary}


def action_spans(times, stages):
    """chrome_trace's spans of one rank's timed pipeline actions (PipelineTrace.times()): F3, B3,
    W3, each on the lane of its chunk."""
    return [
        (f"{op}{i}", op, c, start, end, {"microbatch": i, "chunk": c, "stage": stages[c]})
        for op, i, c, start, end in times
    ]


def write_pipeline_trace(trace, layout, cfg, step, path=None):
    """Gather one pipeline's trace and write it, on rank 0, to `path` (default
    <out_dir>/pp_trace.json) in chrome_trace's format: a lane per chunk, an event per action. Every
    rank must call it (a gather). Returns, on rank 0, the summary line to print: each rank's
    measured bubble beside the schedule's ideal one."""
    times_by_rank = pipeline_values(trace.times(), layout)
    if layout.rank != 0:
        return None
    bubbles = measured_bubble(times_by_rank)
    m, chunks = cfg.gradient_accumulation_steps, cfg.pp_chunks
    ideal = ideal_bubble(cfg.pp_schedule, layout.pp, m, chunks)
    stages = [virtual_stages(cfg.pp_schedule, layout.pp, r, chunks) for r in range(layout.pp)]
    lanes = [
        {c: f"chunk {c} (model stage {stage})" for c, stage in enumerate(held)} for held in stages
    ]
    spans = [action_spans(times, held) for times, held in zip(times_by_rank, stages)]
    summary = {
        "step": step,
        "schedule": cfg.pp_schedule,
        "pp": layout.pp,
        "microbatches": m,
        "chunks": chunks,
        "measured_bubble": bubbles,
        "ideal_bubble": ideal,
        "device": "cuda" if trace.cuda else "cpu",
    }
    path = path or os.path.join(cfg.out_dir, "pp_trace.json")
    with open(path, "w") as f:
        json.dump(chrome_trace(spans, lanes, summary), f)
    return (
        f"pipeline trace of step {step} -> {path}: measured bubble "
        + " | ".join(f"rank {r} {b:.1%}" for r, b in enumerate(bubbles))
        + f" (mean {sum(bubbles) / len(bubbles):.1%}); ideal {cfg.pp_schedule} "
        + (f"{ideal:.1%}" if ideal is not None else "(no formula)")
        + " with forward = B = W in time"
    )


class ActivationMemory:
    """The bytes this rank holds for backward, live and at peak: the floating-point tensors autograd
    saves (seen through saved-tensor hooks; parameters and integer index tensors such as token ids
    are left out, and a tensor saved by two operations counts twice), plus what zero-bubble
    WeightGradStores keep between a microbatch's B and its W. Use it as a context around the step;
    sampled at every save and, passed as parallel.PipelineExecutor's trace, at the end of every
    action."""

    def __init__(self, model, stores=()):
        self.params = {p.data_ptr() for p in model.parameters()}
        self.stores, self.live, self.peak = list(stores), 0, 0

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    def _pack(self, t):
        if not t.is_floating_point() or t.data_ptr() in self.params:
            return t
        return _Saved(t, self)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def sample(self):
        self.peak = max(self.peak, self.live + sum(store.held_bytes for store in self.stores))

    @contextmanager
    def __call__(self, action):
        yield
        self.sample()


class _Saved:
    """A tensor autograd saved, counted in an ActivationMemory while autograd holds it."""

    def __init__(self, tensor, counter):
        self.tensor, self.counter, self.nbytes = (
            tensor,
            counter,
            tensor.numel() * tensor.element_size(),
        )
        counter.live += self.nbytes
        counter.sample()

    def __del__(self):
        self.counter.live -= self.nbytes


def main(argv):
    parser = argparse.ArgumentParser(
        description="Print a pipeline schedule as a timeline, one row per rank."
    )
    parser.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b")
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per step (m)")
    parser.add_argument(
        "--chunks",
        type=int,
        default=None,
        help="model chunks per rank (v): interleaved_1f1b any (default 2), zbv 2, the others 1",
    )
    args = parser.parse_args(argv)
    chunks = args.chunks or (2 if args.schedule in ("interleaved_1f1b", "zbv") else 1)
    try:
        check_schedule(args.schedule, args.pp, args.microbatches, chunks)
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")
    print(format_timeline(args.schedule, args.pp, args.microbatches, chunks))


if __name__ == "__main__":
    main(sys.argv[1:])
