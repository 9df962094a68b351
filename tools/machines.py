"""
The machines tools/step_time.py predicts for: a few numbers each, every one with its source
(MACHINES, from the figures ../shared/published_runs.md collects), a JSON file of the same fields
for any other (H200, MI300X, B200: --machine=PATH.json), or this machine measured in a second or two
(machine=auto: a matmul at the model's shapes, an elementwise product on operands out of the caches,
a fused attention, a chain of autograd operators, and an all-reduce over the run's group where there
is one, each timed as a step meets it); and how long a collective takes on the link a group spans
(collective_seconds: the ring algorithm). Nothing here is fitted to a training run's measured step.
"""

import itertools
import json
import math
import os
import re
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.functional import gelu, linear, silu

import metrics
from model import attention_dims, mlp_hidden_size
from parallel import grid_rank


# -----------------------------------------------------------------------------
# Machines: a few numbers each, every one with its source (../shared/published_runs.md collects
# them)
#
#   matmul_flops    achieved dense matmul FLOP/s per dtype: the best published measurement
#                   (MAMF, stas00 ml-engineering compute/accelerator/README.md), else the
#                   datasheet's peak (errs fast); "fp8", where the GPU has FP8 tensor cores, the
#                   rate of fp8.py's scaled matmuls (a machine without it cannot run --fp8)
#   peak_flops      the datasheet peak MFU divides by (metrics.GPU_PEAK_FLOPS)
#   memory_bw       bytes/s of device memory (datasheet)
#   attention_efficiency  a fused attention kernel's achieved share of matmul_flops, forward and
#                   backward
#   node, network   per link: busbw (bytes/s, nccl-tests' bus bandwidth of a ring) and latency (s
#                   per ring step); network.busbw is per NIC, one per GPU: a group with g ranks on
#                   a node crosses nodes over g NICs, min(node busbw, g x NIC busbw)
#   overlaps        whether communication runs beside compute (a GPU's copy engines and NCCL's
#                   kernels do; gloo on a CPU core that also computes does not)
#   gpus_per_node, memory_gib  which groups cross nodes; what tools/make_config.py fits into

MACHINES = {
    "a100": {
        "description": "A100-80GB SXM, NVLink 3 (DGX A100), 8 x 200 Gb/s HDR InfiniBand per node",
        # MAMF bf16 best shape 271.2 TFLOP/s (stas00 compute/accelerator/README.md); fp32 =
        # datasheet 19.5; no fp8: the A100 has no FP8 tensor cores (compute capability 8.0)
        "matmul_flops": {"bfloat16": 271.2e12, "float16": 271.2e12, "float32": 19.5e12},
        "peak_flops": {
            "bfloat16": 312e12,
            "float16": 312e12,
            "float32": 19.5e12,
        },  # NVIDIA datasheet
        "memory_bw": 2.0e12,  # HBM2e 2.0 TB/s (stas00 memory table)
        # FlashAttention-2 (Dao 2023, abstract and figure 4): forward + backward at 50-73% of the
        # A100's peak; the range's middle, over the MAMF (which is 87% of the peak): 0.615 x 312 /
        # 271.2
        "attention_efficiency": 0.71,
        # nccl-tests all-reduce busbw on one DGX A100 node: 232 GB/s (NVIDIA GTC24 S62129); latency:
        # the 32 KiB all-reduce of stas00's nccl-tests table at 1.31 GB/s busbw takes 44 us over 2
        # (8 - 1) steps
        "node": {"busbw": 232e9, "latency": 3.1e-6},
        # one 200 Gb/s HDR link: busbw 24 GB/s (GTC24 S62129; 8 of them: the multi-node 192 GB/s)
        "network": {"busbw": 24e9, "latency": 5e-6},
        "overlaps": True,
        "gpus_per_node": 8,
        "memory_gib": 80,
    },
    "h100": {
        "description": "H100-80GB SXM, NVLink 4 (DGX H100), 8 x 400 Gb/s NDR per node",
        # MAMF bf16 794.5 TFLOP/s (stas00, torch 2.7.0+cu126); fp32 = datasheet 67. FP8: no
        # published MAMF, so bf16's achieved share of its peak (794.5 / 989 = 80.3%) of the FP8
        # peak: 0.803 x 1979 = 1589.8
        "matmul_flops": {
            "bfloat16": 794.5e12,
            "float16": 794.5e12,
            "float32": 67e12,
            "fp8": 794.5 / 989 * 1979e12,
        },
        # NVIDIA H100 datasheet; FP8 dense 1979 (3958 with sparsity), twice bf16's
        "peak_flops": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12, "fp8": 1979e12},
        "memory_bw": 3.35e12,  # HBM3 (stas00 memory table)
        # FlashAttention-3 (Shah et al. 2024, section 1): FlashAttention-2, PyTorch's SDPA kernel,
        # reaches 35% of the H100's peak; over the MAMF (80.3% of the peak): 0.35 / 0.803
        "attention_efficiency": 0.44,
        # nccl-tests ring all-reduce busbw, one node: 370 GB/s (GTC24 S62129; stas00 H200 ring 367
        # GB/s)
        "node": {"busbw": 370e9, "latency": 3.1e-6},
        "network": {"busbw": 48e9, "latency": 5e-6},  # one 400 Gb/s link: 48 GB/s (GTC24 S62129)
        "overlaps": True,
        "gpus_per_node": 8,
        "memory_gib": 80,
    },
    "l4": {
        "description": "8 x L4 24GB on PCIe Gen4 (no NVLink), one 200 Gb/s NIC per node",
        # no published MAMF for the L4: the datasheet's 121 TFLOP/s bf16 and 242.5 FP8 (485 with
        # sparsity; Ada has FP8 tensor cores) (errs fast)
        "matmul_flops": {
            "bfloat16": 121e12,
            "float16": 121e12,
            "float32": 30.3e12,
            "fp8": 242.5e12,
        },
        "peak_flops": {"bfloat16": 121e12, "float16": 121e12, "float32": 30.3e12, "fp8": 242.5e12},
        "memory_bw": 300e9,  # NVIDIA L4 datasheet: 300 GB/s GDDR6
        # no published figure for the L4: the H100's FlashAttention-2 share
        "attention_efficiency": 0.44,
        # PCIe Gen4 x16: 32 GB/s per direction (PCI-SIG), the ring's wire speed through the host's
        # switch (errs fast: traffic through the root complex rarely reaches it)
        "node": {"busbw": 32e9, "latency": 10e-6},
        "network": {
            "busbw": 25e9 / 8,
            "latency": 10e-6,
        },  # one 200 Gb/s NIC shared by the node's 8 GPUs
        "overlaps": True,
        "gpus_per_node": 8,
        "memory_gib": 24,
    },
}

# gloo between two ranks of a 2-vCPU machine (docs/performance.md#on-this-machine), timed as a step
# issues it (measure_link: what an exchange adds to the MLP forward before it, the mean at a
# micro-batch's message and at 8 MiB; the 26 two-rank launches of the small validation model in one
# run of scripts/validate_step_time.py): busbw 0.84-2.14 GB/s, a latency of 0.73-1.53 ms a ring
# step, their medians below. Back to back the same link reads 1.33 GB/s and 0.08 ms
# (../shared/PERF_NOTES.md), which a step never sees. Used where a CPU run measures no collective
# (train.py's start-up, tools/step_time.py alone).
CPU_GLOO_LINK = {"busbw": 1.35e9, "latency": 1.2e-3}


def load_machine(name):
    """A machine by name (MACHINES) or from a JSON file of the same fields (--machine=PATH.json)."""
    if name in MACHINES:
        return dict(MACHINES[name], name=name)
    if name.endswith(".json") and os.path.exists(name):
        machine = read_machine_file(name)
        return {
            "network": machine["node"],
            "overlaps": True,
            "gpus_per_node": 8,
            "memory_gib": 80,
            "peak_flops": machine["matmul_flops"],
            **machine,
            "name": machine.get("name", name),
        }
    raise ValueError(
        f"machine = {name!r} is neither one of {', '.join(MACHINES)}, 'auto', nor a .json file "
        f"that exists: name one, or describe yours in a file with machines.MACHINES' fields"
    )


# A machine file's fields, checked as it is read: a wrong one would otherwise stop the prediction
# with a traceback where it is first used (a string divided, a number indexed), or pass as a step of
# zero or negative seconds. A rate for the run's dtype is checked where the dtype is known
# (step_time.dtype_of). The dtypes are settings.py's.
DTYPES = ("float32", "bfloat16", "float16", "float64")
RATE_KEYS = DTYPES + ("fp8",)  # (fp8: the rate of fp8.py's scaled matmuls)
_MISSING = object()  # a required field the file lacks
SHOWN_BY = (
    "machines.MACHINES' fields; python tools/step_time.py --machine=h100 prints one in its RESULT"
)


def _number_above(least, strict=True):
    """A check that a JSON value is a finite number above `least` (strict) or at least it: not a
    string, not true or false (Python's 1 and 0), not NaN or Infinity (which json reads)."""

    def check(value):
        if not (type(value) is int or type(value) is float and math.isfinite(value)):  # (bool: no)
            return False
        return value > least if strict else value >= least

    return check


def _require(where, field, value, check, what):
    """Unless check(value): a ValueError of one line naming the file, the field, what it must be."""
    if value is _MISSING or not check(value):
        found = "is missing" if value is _MISSING else f"= {json.dumps(value)[:40]}"
        raise ValueError(f"{where}: {field} {found}: it must be {what} ({SHOWN_BY})")


def _check_rates(machine, where):
    """matmul_flops (required) and peak_flops (optional): FLOP/s above 0 keyed by dtype."""
    by_dtype = lambda v: isinstance(v, dict) and v and set(v) <= set(RATE_KEYS)  # noqa: E731
    for key in ("matmul_flops", "peak_flops"):
        if key in machine or key == "matmul_flops":
            rates = machine.get(key, _MISSING)
            what = "an object of FLOP/s keyed by " + ", ".join(RATE_KEYS)
            _require(where, key, rates, by_dtype, what)
            for dtype, rate in rates.items():
                what = "a number of FLOP/s above 0"
                _require(where, f"{key}.{dtype}", rate, _number_above(0), what)


def _check_links(machine, where):
    """node (required) and network (optional): each an object of busbw and latency."""
    for key in ("node", "network"):
        if key in machine or key == "node":
            link = machine.get(key, _MISSING)
            what = 'an object {"busbw": bytes/s, "latency": seconds a ring step}'
            _require(where, key, link, lambda v: isinstance(v, dict), what)
            busbw, latency = link.get("busbw", _MISSING), link.get("latency", _MISSING)
            what = "a number of bytes/s above 0"
            _require(where, f"{key}.busbw", busbw, _number_above(0), what)
            what = "a number of seconds a ring step, 0 or more"
            _require(where, f"{key}.latency", latency, _number_above(0, strict=False), what)


def check_machine_fields(machine, where):
    """Each field a machine file must hold (matmul_flops, memory_bw, attention_efficiency, node) and
    each it may hold, the nested ones by their path ('node.busbw'), a parent before its entries."""
    positive, at_least_zero = _number_above(0), _number_above(0, strict=False)
    _check_rates(machine, where)
    memory_bw = machine.get("memory_bw", _MISSING)
    _require(where, "memory_bw", memory_bw, positive, "a number of bytes/s above 0")
    efficiency = machine.get("attention_efficiency", _MISSING)
    what = "a number above 0 (a share of matmul_flops)"
    _require(where, "attention_efficiency", efficiency, positive, what)
    _check_links(machine, where)
    two = lambda v: isinstance(v, list) and len(v) == 2 and all(map(at_least_zero, v))  # noqa: E731
    optional = {
        "overlaps": (lambda v: isinstance(v, bool), "true or false"),
        "gpus_per_node": (lambda v: positive(v) and v == int(v), "a whole number above 0"),
        "memory_gib": (at_least_zero, "a number of GiB, 0 or more"),
        "op_seconds": (at_least_zero, "a number of seconds, 0 or more"),
        "loss_seconds": (two, "two seconds a logit, [forward, backward], each 0 or more"),
        "name": (lambda v: isinstance(v, str), "a string"),
        "description": (lambda v: isinstance(v, str), "a string"),
    }
    for key, (check, what) in optional.items():
        if key in machine:
            _require(where, key, machine[key], check, what)


def read_machine_file(path):
    """The fields of a machine file (--machine=PATH.json), each checked: a ValueError of one line
    that names the file, the field and what it must hold, which tools/step_time.py and
    tools/make_config.py print."""
    where = f"machine = {path!r}"
    try:
        with open(path) as f:
            machine = json.load(f)
    except OSError as e:  # a folder, no permission
        raise ValueError(f"{where} cannot be read ({e.strerror}): name a machine file") from None
    except ValueError as e:  # json.JSONDecodeError, or bytes that are not UTF-8
        raise ValueError(f"{where} is not JSON ({e}): fix it ({SHOWN_BY})") from None
    if not isinstance(machine, dict):
        raise ValueError(
            f"{where} holds {json.dumps(machine)[:40]}, not an object: a machine file "
            f"is an object of {SHOWN_BY}"
        )
    check_machine_fields(machine, where)
    return machine


# -----------------------------------------------------------------------------
# A collective's time on the link a group spans: the ring algorithm (tools/step_time.py times every
# exchange so)


RING_STEPS = {
    "all_reduce": lambda n: 2 * (n - 1),
    "reduce_scatter": lambda n: n - 1,
    "all_gather": lambda n: n - 1,
    "all_to_all": lambda n: n - 1,
}
# A broadcast or a reduce (Muon's whole matrices under ZeRO: optim.py) passes the whole buffer
# along the ring's n - 1 hops in pipelined chunks: each rank sends all S bytes, in n - 1 latencies
# (nccl-tests: busbw = algbw)
WHOLE_BUFFER = ("broadcast", "reduce")


def collective_seconds(kind, nbytes, n, link):
    """One collective of `nbytes` (the whole buffer: an all-reduce's input, a reduce-scatter's
    input, an all-gather's output, the rows an all-to-all sends) over n ranks, by the ring algorithm
    (Patarasuk & Yuan 2009): steps latencies plus steps / n of the bytes over the bus bandwidth,
    steps = 2 (n - 1) for an all-reduce and n - 1 for the others (nccl-tests doc/PERFORMANCE.md:
    busbw = algbw x 2 (n - 1) / n, or (n - 1) / n, so that a ring at wire speed reads as the link's
    bandwidth)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if kind in WHOLE_BUFFER:
        return (n - 1) * link["latency"] + nbytes / link["busbw"]
    steps = RING_STEPS[kind](n)
    return steps * link["latency"] + steps / n * nbytes / link["busbw"]


def sent_bytes(kind, nbytes, n):
    """The bytes one rank sends in that collective (collective_seconds'), as nccl-tests counts them
    and ledger.py books them: steps / n of the buffer (a broadcast's or a reduce's all of it), in
    whole bytes."""
    if n <= 1:
        return 0
    return int(nbytes) if kind in WHOLE_BUFFER else RING_STEPS[kind](n) * int(nbytes) // n


def p2p_seconds(nbytes, link):
    """A send (the pipeline's activations, a ring step): a latency and the bytes over the link (per
    direction)."""
    return link["latency"] + nbytes / link["busbw"] if nbytes else 0.0


def group_link(machine, dims, axes, gpus_per_node):
    """The link a group along `axes` ('dp', 'cp', 'tp', 'pp') of the grid dims = (dp, cp, tp, pp)
    spans: the node's, when its ranks share a node (parallel.ParallelLayout numbers tp fastest, then
    cp, dp, pp, as torchrun fills nodes with consecutive ranks), else the network's with as many
    NICs as the group has ranks on a node (NCCL runs one ring per NIC: the multi-node busbw of 8 x
    24 GB/s = 192 on a DGX A100)."""
    dp, cp, tp, pp = dims
    sizes = {"dp": dp, "cp": cp, "tp": tp, "pp": pp}
    at = {a: list(range(sizes[a])) if a in axes else [0] for a in sizes}
    ranks = [
        grid_rank(p, d, t, dp, tp, c, cp)
        for p in at["pp"]
        for d in at["dp"]
        for c in at["cp"]
        for t in at["tp"]
    ]
    nodes = {r // gpus_per_node for r in ranks}
    if len(nodes) == 1:
        return machine["node"]
    per_node = len(ranks) // len(nodes)
    net = machine["network"]
    return {
        "busbw": min(machine["node"]["busbw"], per_node * net["busbw"]),
        "latency": net["latency"],
    }


# -----------------------------------------------------------------------------
# machine=auto: this machine measured, in a few seconds


def device_sync(dev):
    """A call that waits for the device's queued kernels (a GPU's run ahead of the host), before a
    timer reads."""
    return (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)


def calls_between_waits(dev):
    """How many calls of a probed kernel run between two waits for the device: on a GPU 10, so the
    host runs ahead as in a step and the wait's own tens of microseconds do not count against
    kernels of a few hundred (the H200 read the model's linears at 123-329 TFLOP/s waiting after
    each, where its steps run them at about 500); on CPU, where nothing runs ahead, 1."""
    return 10 if dev.type == "cuda" else 1


def _median_of(measure, repeats):
    """The median of `repeats` calls of measure() (each returns seconds) after two warm-up calls
    (the thread pool, the kernel's choice, first-touch pages): the statistic tools/bench.py reports
    of its steps, which see the machine's noise as the probe does (a best of a few read this
    machine's prediction 6-9% apart from one call to the next)."""
    measure()
    measure()
    return statistics.median(measure() for _ in range(repeats))


def _median_seconds(fn, dev, repeats=7):
    """fn's median seconds on device dev (_median_of), each timing calls_between_waits(dev) calls
    and a wait."""
    sync, calls = device_sync(dev), calls_between_waits(dev)

    def timed():
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        return (time.perf_counter() - start) / calls

    return _median_of(timed, repeats)


def measure_link(group=None, device="cpu", nbytes=2**16, burst=None, clock=time.perf_counter):
    """{'busbw', 'latency'} of an all-reduce over `group` (every rank of it must call this),
    nccl-tests' convention: timed at `nbytes` (the run's own message) and at 8 MiB (a bucket's), the
    line through the two gives the bus bandwidth (its slope) and the latency (where it meets zero
    bytes, over 2 (n - 1) ring steps). Each is timed as a step issues it, between bursts of `burst`
    (compute of the step's own grain), not back to back: on gloo an exchange wakes threads that
    slept through the compute and waits for the rank the compute left behind, which makes a 256 KiB
    all-reduce between two CPU ranks here 2.1 ms against 0.6 ms back to back. And an exchange costs
    the step more than its wait: on CPU the compute after it runs slower (gloo's threads and the
    kernel's loopback copies share the ranks' cores and caches: 3 ms of matmul here took 10-15% more
    of the main thread's own CPU time after an exchange than after more matmul). So an exchange's
    time is what it adds to a burst: a burst and an exchange, less a burst alone. The mean of many:
    a step sums dozens of exchanges, and a sum of many draws comes to their count times their mean,
    not their median; these waits have a long tail (one rank's lateness: a 256 KiB all-reduce after
    64 ms of compute took 2.6 ms at the median, 5.0 on average), so the run's own message is timed
    60 times (15 read the latency 0.4 to 1.5 ms from one launch to the next), 8 MiB 15 times. clock:
    where the seconds are read (a test drives a fake one: no busy machine moves them)."""
    n = dist.get_world_size(group)
    sync = device_sync(torch.device(device))
    burst = burst or (lambda: None)

    def mean_seconds(fn, repeats):
        seconds = []
        for _ in range(repeats):
            start = clock()
            fn()
            sync()
            seconds.append(clock() - start)
        return statistics.mean(seconds)

    def timed(size, repeats):
        t = torch.zeros(max(1, size // 4), device=device)
        alone = mean_seconds(burst, repeats)
        # warm-up: the connections, the buffers; the ranks met again
        dist.all_reduce(t, group=group)
        return mean_seconds(lambda: (burst(), dist.all_reduce(t, group=group)), repeats) - alone

    large = max(2**23, 2 * nbytes)
    small_s, large_s = timed(nbytes, 60), timed(large, 15)
    per_byte = max(large_s - small_s, 1e-9) / (large - nbytes)
    zero_bytes = max(small_s - per_byte * nbytes, 0.0)
    return {"busbw": 2 * (n - 1) / n / per_byte, "latency": zero_bytes / (2 * (n - 1))}


def last_level_cache_bytes(dev):
    """The device's last-level cache: a GPU's L2, a CPU's largest cache (Linux's sysfs; 32 MiB where
    it does not say)."""
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).L2_cache_size
    sizes = []
    for index in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as f:
                text = f.read().strip()
        except OSError:
            break
        sizes.append(
            int(text[:-1]) * {"K": 2**10, "M": 2**20}[text[-1]] if text[-1] in "KM" else int(text)
        )
    return max(sizes, default=32 * 2**20)


def memory_bandwidth(elements, dtype, dev):
    """Bytes/s of the roofline's memory (Williams et al. 2009) as the model's elementwise kernels
    meet it: z = x * y (reads two, writes one) on tensors of `elements`, each call on the triple
    used longest ago of a pool past four times the last-level cache (STREAM's rule, McCalpin 1995).
    Its operands come from memory, as a step's do (an activation written in the forward is read in
    the backward long after the caches held it), and the figure is the device memory's, as a named
    machine's datasheet gives it. On this CPU (32 MiB of L3) one hot triple reads 65-95 GB/s, the
    pool 15-19 GB/s; the small validation model's step spends 28 us on a product that the first
    gives 10 us (docs/performance.md#on-this-machine)."""
    size = elements * torch.finfo(dtype).bits // 8
    # four caches' worth of triples and one more: between two calls on a triple the others move four
    # caches
    triples = [
        [torch.ones(elements, device=dev, dtype=dtype) for _ in range(3)]
        for _ in range(1 + -(-4 * last_level_cache_bytes(dev) // (3 * size)))
    ]
    # in the order they were written: the first is the longest evicted
    order = itertools.cycle(triples)

    def product():
        x, y, z = next(order)
        torch.mul(x, y, out=z)

    return 3 * size / _median_seconds(product, dev)


def probe_tokens(cfg, dev):
    """The tokens the probes of a run's machine run on: a micro-batch's on one rank (after context
    parallelism's split), at most 4,096 on CPU (the probe stays a few seconds) and 16,384 on a GPU
    (shapes a GPU runs at its step's rate; the head's logits are then 1.6 GB in bf16 at GPT-2's
    vocabulary)."""
    return min(4096 if dev.type == "cpu" else 16384, cfg.batch_size * cfg.block_size // cfg.cp)


def linear_pass(model_cfg, dtype, dev, tokens, tp=1):
    """(FLOPs, one_pass) of the model's own linears on this device: each distinct (in, out) of a
    block's (q, k and v, the output projection, the MLP's) and the head's, this tp rank's share, run
    forward and backward (x W^T, then dy W and dy^T x: 6 FLOPs per weight and token) on `tokens`
    tokens, weighted as the model runs them; one_pass() runs every shape once (on a GPU
    calls_between_waits times in a row) and returns the seconds of one run of each, weighted so
    (those FLOPs' time)."""
    sync, calls = device_sync(dev), calls_between_waits(dev)
    C, F, (qk, v) = model_cfg.n_embd, mlp_hidden_size(model_cfg) // tp, attention_dims(model_cfg)
    H, H_kv = model_cfg.n_head // tp, max(1, model_cfg.n_kv_head // tp)
    shapes = {
        (C, H * qk): model_cfg.n_layer,
        (C, H_kv * (qk + v)): model_cfg.n_layer,
        (H * v, C): model_cfg.n_layer,
        (C, F): (2 if model_cfg.mlp == "swiglu" else 1) * model_cfg.n_layer,
        (F, C): model_cfg.n_layer,
        (C, -(-model_cfg.vocab_size // tp)): 1,
    }
    cases = [
        (
            count,
            torch.randn(tokens, n_in, device=dev, dtype=dtype, requires_grad=True),
            torch.randn(n_out, n_in, device=dev, dtype=dtype, requires_grad=True),
            torch.randn(tokens, n_out, device=dev, dtype=dtype),
        )
        for (n_in, n_out), count in shapes.items()
    ]

    # a micro-batch's linears: each shape timed once, times how often the model runs it
    def one_pass():
        seconds = 0.0
        for count, x, w, dy in cases:
            start = time.perf_counter()
            for _ in range(calls):
                linear(x, w).backward(dy)
            sync()
            seconds += count * (time.perf_counter() - start) / calls
        return seconds

    return sum(
        count * 6 * tokens * n_in * n_out for (n_in, n_out), count in shapes.items()
    ), one_pass


def linear_rate(model_cfg, dtype, dev, tokens, tp=1):
    """FLOP/s of the model's own linears (linear_pass), the median of 15 passes: a slow stretch of
    the host spoils a few passes, where each shape's repeats timed back to back let it spoil that
    shape's every one (three launches of one run read the same compute 262, 321 and 403 ms so).
    tools/bench.py times its passes between its timed steps instead (bench.timed_steps)."""
    flops, one_pass = linear_pass(model_cfg, dtype, dev, tokens, tp)
    return flops / _median_of(one_pass, 15)


def loss_seconds(model_cfg, dev, tokens, tp):
    """[forward, backward] seconds per logit of the vocab-parallel loss's own kernels
    (parallel.VocabParallelCrossEntropy: the max, the shifted copy, exp, the sum and the division
    forward; the target's scatter and the scaling backward) on a micro-batch's fp32 logits over this
    rank's vocabulary, as a step issues them: the copy made anew each time (on CPU, past glibc's
    mmap threshold, pages it touches first). On this CPU max and exp cost 1.2-1.5 ns an element and
    the first touch more: not a bandwidth."""
    logits = torch.randn(tokens, -(-model_cfg.vocab_size // tp), device=dev)
    target = torch.randint(0, logits.shape[1], (tokens, 1), device=dev)

    def forward():
        exp = (logits - logits.max(dim=-1).values.unsqueeze(-1)).exp_()
        return exp.div_(exp.sum(dim=-1).unsqueeze(-1))

    softmax = forward()
    backward = lambda: softmax.scatter_add_(-1, target, -torch.ones_like(softmax[:, :1])).mul_(0.5)
    return [
        _median_seconds(forward, dev) / logits.numel(),
        _median_seconds(backward, dev) / logits.numel(),
    ]


def mlp_forward(model_cfg, dtype, dev, tokens, tp):
    """A call that runs the model's MLP forward on `tokens` tokens, this tp rank's share (its
    matmuls and its activation): the compute between two of tp's exchanges, after which measure_link
    times one. An exchange costs more after more compute (the ranks drift further apart, the caches
    cool): here a 256 KiB all-reduce added 1.5-1.9 ms after 0.4 ms of compute, 2.1-2.5 after 1.4 ms
    and 3.6-3.8 after 14 ms. After the MLP's first linear alone (the burst until 2026-12-04) the
    small validation model's link read 0.55-1.1 ms a ring step, after its MLP 0.73-1.53
    (docs/performance.md#on-this-machine)."""
    C, F, swiglu = model_cfg.n_embd, mlp_hidden_size(model_cfg) // tp, model_cfg.mlp == "swiglu"
    x = torch.randn(tokens, C, device=dev, dtype=dtype)
    w_in = torch.randn((2 if swiglu else 1) * F, C, device=dev, dtype=dtype)
    w_out = torch.randn(C, F, device=dev, dtype=dtype)

    def forward():
        h = linear(x, w_in)
        return linear(silu(h[:, :F]) * h[:, F:] if swiglu else gelu(h), w_out)

    return forward


def attention_efficiency(model_cfg, dtype, dev, tokens, matmul_rate):
    """The fused attention kernel's achieved share of matmul_rate: a causal SDPA forward and
    backward at the model's heads, on one sequence of up to 1,024 on CPU (seconds); on a GPU the
    micro-batch's sequences whole, up to the probe's tokens (one short sequence leaves most of a
    GPU's multiprocessors idle)."""
    H, D = model_cfg.n_head, attention_dims(model_cfg)[0]
    if dev.type == "cpu":
        B, T = 1, min(model_cfg.block_size, 1024)
    else:
        B, T = max(1, tokens // model_cfg.block_size), model_cfg.block_size
    q = torch.randn(B, H, T, D, device=dev, dtype=dtype, requires_grad=True)

    def sdpa():
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()

    # forward and backward (FlashAttention-2's 3.5 forwards), causal half
    attention_flops = 3.5 * 4 * B * T * T * H * D / 2
    return attention_flops / _median_seconds(sdpa, dev) / matmul_rate


def operator_seconds(dev):
    """The host's cost of one operator as a training step pays it, the dispatcher and autograd's
    bookkeeping: a chain of 50 one-element products forward, each recorded for the backward, and
    its backward (50 more operators). A product outside autograd costs a third of that here (1.0
    against 2.9 us), and the quick start's model at width 16, its compute nothing, spends 2.3 us an
    operator of OPS_PER_BLOCK."""
    one = torch.ones(1, device=dev, requires_grad=True)

    def chain():
        y = one
        for _ in range(50):
            y = y * 1.0  # (its backward: one product each)
        y.backward()

    return _median_seconds(chain, dev) / 100


def measure_machine(
    model_cfg, dtype, device="cpu", collective=False, tokens=512, matmul_rate=None, tp=1
):
    """This machine, measured in a second or two: the model's linears forward and backward on a
    micro-batch's tokens (linear_rate; or matmul_rate given), an elementwise product for the memory
    bandwidth, a causal SDPA forward and backward at the model's heads for the attention kernel's
    share of the matmul rate, an operator's host cost through autograd, under tp the vocab-parallel
    loss's kernels (loss_seconds), and with collective an all-reduce over every process (each must
    call this: on one machine every group of the run shares its links), else gloo's figures above.
    """
    dev = torch.device(device)
    if matmul_rate is None:
        matmul_rate = linear_rate(model_cfg, dtype, dev, tokens, tp)
    memory_bw = memory_bandwidth(tokens * mlp_hidden_size(model_cfg), dtype, dev)
    efficiency = attention_efficiency(model_cfg, dtype, dev, tokens, matmul_rate)
    op_seconds = operator_seconds(dev)
    name = str(dtype).replace("torch.", "")
    # the link timed on the run's own message (a micro-batch's activations, whole: what tp, cp, ep
    # and pp exchange), each exchange after the compute that comes between two of tp's (mlp_forward)
    message = tokens * model_cfg.n_embd * torch.finfo(dtype).bits // 8
    link = CPU_GLOO_LINK
    if collective:
        burst = mlp_forward(model_cfg, dtype, dev, tokens, tp)
        link = measure_link(None, dev, nbytes=max(message, 2**16), burst=burst)
    # the peak MFU divides by: the datasheet's on a GPU, on CPU the square-matmul probe
    # tools/bench.py's MFU reads
    peak = (
        metrics.gpu_peak_flops(torch.cuda.get_device_name(dev), dtype)
        if dev.type == "cuda"
        else metrics.measure_cpu_peak_flops(dtype)
    ) or matmul_rate
    threads = torch.get_num_threads()
    return {
        "name": "auto",
        "description": f"this machine ({dev}, {name}, {threads} thread(s), measured)",
        "matmul_flops": {name: matmul_rate},
        "peak_flops": {name: max(peak, matmul_rate)},
        "memory_bw": memory_bw,
        "attention_efficiency": efficiency,
        "node": link,
        "network": link,
        # a GPU's launches run ahead of its kernels: their cost is hidden but at the smallest shapes
        "op_seconds": op_seconds if dev.type == "cpu" else 0.0,
        **({"loss_seconds": loss_seconds(model_cfg, dev, tokens, tp)} if tp > 1 else {}),
        # gloo's exchanges run on the cores that compute (one a rank): nothing overlaps on CPU
        "overlaps": dev.type == "cuda",
        "gpus_per_node": 1 << 20,
        "memory_gib": 0,
    }


def startup_machine(model_cfg, dtype, device):
    """train.py's start-up machine: on CPU the cached matmul peak (metrics.measure_cpu_peak_flops,
    which the MFU reads too) and gloo's figures, no collective; on a GPU the named machine its name
    matches, else None."""
    if device.type == "cpu":
        return measure_machine(
            model_cfg, dtype, "cpu", matmul_rate=metrics.measure_cpu_peak_flops(dtype)
        )
    name = torch.cuda.get_device_name(device)
    return next(
        (load_machine(key) for key in MACHINES if re.search(rf"\b{key}\b", name, re.I)), None
    )
