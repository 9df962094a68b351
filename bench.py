"""
Time picotron's training step: tokens/s, ms/step, MFU and peak memory, for any config and layout.

    python bench.py config/tiny_fineweb.py
    python bench.py config/tiny_fineweb.py --compile=True --bench_steps=20
    python bench.py --n_layer=6 --n_head=6 --n_kv_head=6 --n_embd=384 --reference=True
    torchrun --nproc_per_node=4 bench.py config/tiny_fineweb.py --tp=2 --dp=2

Every train.py setting works here, and the model, optimizer and step are train.py's own (setup, build,
compile_model, train_step), so this times exactly what training runs, in whatever layouts train.py supports.
Bench-only settings: --warmup_steps (untimed steps first: compiling, allocator and thread warm-up),
--bench_steps (timed steps), --reference=True (also time the plain GPT of tests/reference_gpt.py at the same
size, step by step in turn with picotron's, so both see the same machine). Tokens are random unless
--data_dir is given on the command line. The last line printed is `RESULT {json}`, for scripts.
"""
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

import train
from configurator import ConfigError, configure
from model import flops_per_token

BENCH_DEFAULTS = {"warmup_steps": 3, "bench_steps": 10, "reference": False}


def parse_args(argv):
    """Split the command line into bench-only settings and train.py's (config files and the rest)."""
    is_bench = lambda a: a.startswith("--") and a[2:].partition("=")[0] in BENCH_DEFAULTS
    bench = SimpleNamespace(**configure(BENCH_DEFAULTS, [a for a in argv if is_bench(a)]))
    train_argv = [a for a in argv if not is_bench(a)]
    cfg = SimpleNamespace(**configure(train.DEFAULTS, train_argv))
    if not any(a.startswith("--data_dir=") for a in train_argv):
        cfg.data_dir = None  # random tokens: a config file's data_dir is not needed to time a step
    if bench.bench_steps < 1 or bench.warmup_steps < 0:
        raise ConfigError(f"bench_steps = {bench.bench_steps} must be >= 1 and warmup_steps = "
                          f"{bench.warmup_steps} >= 0")
    return cfg, bench


def random_microbatches(cfg, layout, vocab_size, step, device):
    """Random (x, y) micro-batches, the same on every tensor- and pipeline-parallel rank of a data-parallel
    rank (as real batches are), different across data-parallel ranks and steps."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009 + layout.dp_rank)
    out = []
    for _ in range(cfg.gradient_accumulation_steps):
        tokens = torch.randint(0, vocab_size, (cfg.batch_size, cfg.block_size + 1), generator=g)
        out.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
    return out


def load_reference_gpt():
    path = Path(__file__).resolve().parent / "tests" / "reference_gpt.py"
    spec = importlib.util.spec_from_file_location("reference_gpt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Picotron:
    """train.py's training step, one call per step."""
    name = "picotron"

    def __init__(self, cfg, dev, ptdtype, layout, model_cfg, datasets):
        self.cfg, self.dev, self.layout, self.model_cfg, self.datasets = cfg, dev, layout, model_cfg, datasets
        self.model, self.optimizer, self.autocast, self.scaler = train.build(cfg, dev, ptdtype, layout, model_cfg)
        self.step_model = train.compile_model(self.model, cfg, layout)
        self.grad_sync = train.make_grad_sync(self.model, cfg, layout, self.optimizer)
        self.pipeline = train.make_pipeline(cfg, layout, self.model, model_cfg, dev)
        self.flops_per_token = flops_per_token(model_cfg)

    def batches(self, step):
        if self.datasets:
            return train.rank_microbatches(self.cfg, self.layout, self.datasets["train"], train.TRAIN_STREAM, step,
                                           self.cfg.gradient_accumulation_steps, self.dev)
        return random_microbatches(self.cfg, self.layout, self.model_cfg.vocab_size, step, self.dev)

    def step(self, i):
        """One training step; returns its loss as a float, which waits for the device (and every rank)."""
        lr = train.get_lr(i, self.cfg)
        loss, _, self.step_model = train.train_step(self.cfg, self.layout, self.model, self.step_model,
                                                    self.optimizer, self.scaler, self.autocast, self.batches(i), lr,
                                                    self.pipeline, self.grad_sync)
        return train.mean_across_ranks(loss, self.layout).item()


class ReferenceGPT:
    """The plain GPT of tests/reference_gpt.py at the same size, on the same batches, one process."""
    name = "reference GPT"

    def __init__(self, picotron):
        cfg, mc, ref = picotron.cfg, picotron.model_cfg, load_reference_gpt()
        torch.manual_seed(cfg.seed)
        self.picotron = picotron
        self.model = ref.GPT(mc.vocab_size, mc.block_size, mc.n_layer, mc.n_head, mc.n_embd).to(picotron.dev)
        self.optimizer = ref.make_optimizer(self.model, cfg.learning_rate, cfg.weight_decay)
        self.step_model = torch.compile(self.model) if cfg.compile else self.model
        self.flops_per_token = self.model.flops_per_token()

    def step(self, i):
        p = self.picotron
        loss = 0.0
        for x, y in p.batches(i):
            with p.autocast:
                _, micro_loss = self.step_model(x, y)
            micro_loss = micro_loss / p.cfg.gradient_accumulation_steps
            micro_loss.backward()
            loss += micro_loss.detach()
        if p.cfg.grad_clip > 0:  # as nanoGPT does, and picotron's step
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), p.cfg.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = train.get_lr(i, p.cfg)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def reset_peak_memory(dev):
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


def run(cfg, bench, dev, ptdtype, layout, datasets, model_cfg):
    runners = [Picotron(cfg, dev, ptdtype, layout, model_cfg, datasets)]
    if bench.reference:
        runners.append(ReferenceGPT(runners[0]))
    for r in runners:
        for i in range(bench.warmup_steps):
            r.step(i)
    reset_peak_memory(dev)
    # the runners take turns step by step, so a machine that speeds up or slows down affects them alike
    times = {r.name: [] for r in runners}
    losses = {}
    for i in range(bench.warmup_steps, bench.warmup_steps + bench.bench_steps):
        for r in runners:
            start = time.perf_counter()
            losses[r.name] = r.step(i)
            times[r.name].append(time.perf_counter() - start)
    peak_mem = train.peak_memory_bytes(dev, layout)

    tokens_per_step = cfg.batch_size * cfg.gradient_accumulation_steps * layout.dp * cfg.block_size
    peak, peak_why = train.device_peak_flops(cfg.peak_flops, dev, ptdtype)
    results = {}
    for r in runners:
        seconds = statistics.median(times[r.name])
        tokens_per_sec = tokens_per_step / seconds
        results[r.name] = {"tokens_per_sec": tokens_per_sec, "ms_per_step": 1000 * seconds,
                           "ms_per_step_min": 1000 * min(times[r.name]), "ms_per_step_max": 1000 * max(times[r.name]),
                           "flops_per_token": r.flops_per_token,
                           "mfu": train.mfu(r.flops_per_token, tokens_per_sec, peak, layout.world_size),
                           "loss": losses[r.name]}
    # the process's peak memory covers whatever ran in it: with the reference alongside it is both models'
    results["picotron"]["peak_mem_bytes"] = peak_mem

    if layout.rank == 0:
        print_table(cfg, bench, dev, ptdtype, layout, model_cfg, results, peak, peak_why, step_model_kind(runners[0]))
        if bench.reference:
            print("(peak memory is the whole process's: both models, as they ran side by side)")
        result = dict(results["picotron"], device=str(dev), dtype=str(ptdtype).replace("torch.", ""),
                      world_size=layout.world_size, dp=layout.dp, tp=layout.tp, pp=layout.pp,
                      compiled=step_model_kind(runners[0]) == "compiled", peak_flops=peak,
                      tokens_per_step=tokens_per_step, threads=torch.get_num_threads())
        if bench.reference:
            ref = results["reference GPT"]
            result.update(reference_tokens_per_sec=ref["tokens_per_sec"], reference_ms_per_step=ref["ms_per_step"],
                          reference_mfu=ref["mfu"], speedup_vs_reference=results["picotron"]["tokens_per_sec"] / ref["tokens_per_sec"])
        print("RESULT " + json.dumps(result), flush=True)
    return results


def step_model_kind(picotron):
    return "eager" if picotron.step_model is picotron.model else "compiled"


def print_table(cfg, bench, dev, ptdtype, layout, model_cfg, results, peak, peak_why, kind):
    mc = model_cfg
    print(f"\nbench: {mc.n_layer} layers, {mc.n_head} heads ({mc.n_kv_head} kv), width {mc.n_embd}, block {mc.block_size}, "
          f"vocab {mc.vocab_size}, batch {cfg.batch_size} x {cfg.gradient_accumulation_steps} micro x dp {layout.dp}; "
          f"{dev}, {str(ptdtype).replace('torch.', '')}, {kind}, {torch.get_num_threads()} threads; "
          f"layout dp={layout.dp} tp={layout.tp} pp={layout.pp}; activation_checkpointing={cfg.activation_checkpointing}, "
          f"chunked_loss={cfg.chunked_loss}; {'data ' + cfg.data_dir if cfg.data_dir else 'random tokens'}; "
          f"{bench.warmup_steps} warm-up + {bench.bench_steps} timed steps (median)")
    print(f"peak: {f'{peak / 1e12:.3g} TFLOP/s per device' if peak else 'unknown'} ({peak_why})")
    names = list(results)
    rows = [("tokens/s", lambda r: f"{r['tokens_per_sec']:,.0f}"),
            ("ms/step (median)", lambda r: f"{r['ms_per_step']:,.1f}"),
            ("ms/step (min-max)", lambda r: f"{r['ms_per_step_min']:,.0f}-{r['ms_per_step_max']:,.0f}"),
            ("MFLOP/token", lambda r: f"{r['flops_per_token'] / 1e6:,.1f}"),
            ("MFU", lambda r: train.format_mfu(r["mfu"])),
            ("peak memory (MiB)", lambda r: f"{r['peak_mem_bytes'] / 2**20:,.0f}" if "peak_mem_bytes" in r else "-"),
            ("loss (last step)", lambda r: f"{r['loss']:.4f}")]
    print(f"{'':20s}" + "".join(f"{n:>16s}" for n in names))
    for label, fmt in rows:
        print(f"{label:20s}" + "".join(f"{fmt(results[n]):>16s}" for n in names))


def main(argv):
    try:
        cfg, bench = parse_args(argv)
        dev, ptdtype, layout, datasets, model_cfg, _ = train.setup(cfg, training=False)
        if bench.reference and layout.world_size > 1:
            raise ValueError("reference=True times a single-process GPT beside picotron: run it without torchrun")
    except (ConfigError, ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    try:
        return run(cfg, bench, dev, ptdtype, layout, datasets, model_cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
