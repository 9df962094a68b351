"""
Write a starter config for a model size and a parallel layout, checked before anything runs.

    python make_config.py --n_layer=12 --n_embd=768 --n_head=12 --tp=2 --pp=2 --nproc=8 --out=config/my.py
    torchrun --nproc_per_node=8 train.py config/my.py

Every training setting can be given (--key=value, or a config file to start from), plus `nproc`, the number
of processes the run will have, and `out`, the file to write (an existing one is refused unless
--force=True). The layout is checked with train.py's own rules (dp x cp x tp x pp must be nproc, and
settings.check_layout: heads, key/value heads, MLP width and blocks must split, block_size into context
parallelism's 2*cp chunks; the pipeline schedule's rules), so a layout that does not divide the model is
refused here rather than after the job waited in a queue. The file states the parameter count and the global
batch in tokens, then the settings that were asked for (and the few this script chose, each saying why),
with their meanings from settings.py; every other setting keeps its default.
"""
import json
import os
import sys
from dataclasses import fields

import torch

import memory_plan
import metrics
import settings
from configurator import ConfigError, Setting, configure, section
from model import ModelConfig, Transformer, attention_head_dim
from settings import check_layout
from parallel import resolve_dp
from pipeline_schedules import check_schedule, describe_pipeline

GPT2_VOCAB_SIZE = 50257
OWN = section(
    "make_config.py's own",
    Setting("nproc", 1, "processes the run will have (torchrun --nproc_per_node x nodes)"),
    Setting("out", "config/my.py", "the config file to write"),
    Setting("force", False, "overwrite --out if it exists (else an existing file is refused)"),
    Setting("gpu_mem_gib", 0.0, "the memory of one GPU in GiB (2**30 bytes, the plan's unit): say which stage does "
                                "not fit it, and what to change (0: no check)"),
)


def vocab_size_of(cfg):
    """(vocabulary size, where it comes from): the setting, else the data's meta.json, else GPT-2's."""
    if cfg["vocab_size"]:
        return cfg["vocab_size"], "the vocab_size setting"
    meta_path = os.path.join(cfg["data_dir"], "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            return json.load(f)["vocab_size"], meta_path
    return GPT2_VOCAB_SIZE, f"GPT-2's, as {meta_path} is not there yet"


def count_parameters(model_cfg):
    """(all parameters, those in embedding tables), without the vocabulary's padding rows. The model is built
    on the meta device: shapes only, no memory, so any size can be counted."""
    with torch.device("meta"):
        model = Transformer(model_cfg)
    total = embeddings = 0
    for name, p in model.named_parameters():  # a tied head is the embedding's tensor, counted once
        n = getattr(p, "vocab_size", p.shape[0]) * (p.numel() // p.shape[0])
        total += n
        embeddings += n if name in ("tok_emb.weight", "lm_head.weight") else 0
    return total, embeddings


def choices(cfg, given, dp):
    """The settings this script fills in beyond what was asked, {name: (value, why)}: the ones whose
    default would mean something nobody asked for at this size or layout."""
    if cfg["cp"] > 1:
        chosen = {"dp": (dp, f"nproc / (cp * tp * pp) = {cfg['nproc']} / ({cfg['cp']} * {cfg['tp']} * {cfg['pp']})")}
    else:
        chosen = {"dp": (dp, f"nproc / (tp * pp) = {cfg['nproc']} / ({cfg['tp']} * {cfg['pp']})")}
    if "n_kv_head" not in given and cfg["n_kv_head"] != cfg["n_head"]:
        # the default n_kv_head fits the default n_head only: at another n_head it would be grouped-query
        # attention nobody requested
        chosen["n_kv_head"] = (cfg["n_head"], "= n_head: multi-head attention (set n_kv_head for GQA)")
    if cfg["pp"] > 1 and "gradient_accumulation_steps" not in given:
        m = 4 * cfg["pp"]
        chosen["gradient_accumulation_steps"] = (m, f"4 x pp microbatches keep the pipeline bubble, (pp - 1) / "
                                                    f"(m + pp - 1), at {(cfg['pp'] - 1) / (m + cfg['pp'] - 1):.0%}")
    return chosen


def literal(value):
    return json.dumps(value) if isinstance(value, str) else repr(value)


def settings_block(cfg, given, chosen):
    """The asked-for and chosen settings under their banners, each with its meaning."""
    lines, current = [], None
    for s in settings.TRAINING:
        if s.name not in given and s.name not in chosen:
            continue
        if s.section != current:
            current = s.section
            lines.append(f"\n# {current}")
        why = f" ({chosen[s.name][1]})" if s.name in chosen else ""
        lines.append(f"{s.name} = {literal(cfg[s.name])}  # {s.meaning}{why}")
    lines.append("\n# every other setting keeps its default: python train.py --help lists them all")
    return "\n".join(lines).lstrip("\n")


def make_config(cfg, given, argv):
    """The config file's (header, settings); raises ValueError when the layout does not divide the model."""
    tp, pp, cp = cfg["tp"], cfg["pp"], cfg["cp"]
    dp = resolve_dp(cfg["nproc"], cfg["dp"], tp, pp, count_name="nproc", cp=cp, ep=cfg["ep"])
    chosen = choices(cfg, given, dp)
    cfg = dict(cfg, **{k: v for k, (v, _) in chosen.items()})
    vocab, vocab_source = vocab_size_of(cfg)
    model_cfg = ModelConfig(**{f.name: cfg[f.name] for f in fields(ModelConfig) if f.name != "vocab_size"},
                            vocab_size=vocab)
    check_layout(model_cfg, tp, pp, cp, cfg["sequence_parallel"], cfg["pp_chunks"], ep=cfg["ep"])
    check_schedule(cfg["pp_schedule"], pp, cfg["gradient_accumulation_steps"], cfg["pp_chunks"])
    n_params, n_embedding = count_parameters(model_cfg)
    sequences = cfg["batch_size"] * cfg["gradient_accumulation_steps"] * dp
    tokens_per_step = sequences * cfg["block_size"]
    total_tokens = tokens_per_step * cfg["max_iters"]
    head_dim = attention_head_dim(model_cfg)
    layout = (f"dp {dp} x " + (f"cp {cp} x " if cp > 1 else "") + f"tp {tp}"
              + (" (sequence parallel)" if cfg["sequence_parallel"] else "") + f" x pp {pp}")
    launch = (f"torchrun --nproc_per_node={cfg['nproc']} train.py {cfg['out']}" if cfg["nproc"] > 1
              else f"python train.py {cfg['out']}")
    header = f"""\
# Written by: python make_config.py {' '.join(argv)}
#
# model:  {n_params / 1e6:.2f}M parameters ({(n_params - n_embedding) / 1e6:.2f}M without the embedding{'' if model_cfg.tie_embeddings else 's'}), \
{model_cfg.n_layer} layers, width {model_cfg.n_embd}, {model_cfg.n_head} heads ({model_cfg.n_kv_head} key/value) of size {head_dim}
#         vocabulary {vocab} ({vocab_source}), {'tied' if model_cfg.tie_embeddings else 'untied'} input and output embeddings
# layout: {cfg['nproc']} processes = {layout} (checked: the model splits this way)
# batch:  {cfg['batch_size']} sequences x {cfg['gradient_accumulation_steps']} micro-batches x {dp} data-parallel ranks \
= {sequences} sequences of {cfg['block_size']} tokens = {tokens_per_step:,} tokens per step
# run:    {cfg['max_iters']:,} steps = {total_tokens / 1e6:,.1f}M tokens, {total_tokens / n_params:.3g} tokens per parameter \
(Chinchilla's compute-optimal ratio is about 20)
# launch: {launch}
"""
    if pp > 1:  # the stages' cut and each rank's share of the work, as train.py prints them
        cut = metrics.stage_cut(model_cfg, cfg["pp_schedule"], pp, cfg["pp_chunks"], cfg["pp_layers"])
        pipeline = describe_pipeline(cfg["pp_schedule"], pp, cfg["gradient_accumulation_steps"], cfg["pp_chunks"], cut,
                                     metrics.pipeline_costs(model_cfg))
        header += "".join(f"# {line}\n" for line in pipeline.splitlines())
    plan = memory_plan.plan_memory(model_cfg, dp, tp, pp, cp, cfg["zero_stage"], cfg["batch_size"],
                                   cfg["block_size"], cfg["gradient_accumulation_steps"], cfg["pp_schedule"],
                                   cfg["activation_checkpointing"], cfg["chunked_loss"], cfg["sequence_parallel"],
                                   cfg["bucket_size_mb"], act_bytes=2 if cfg["dtype"] in ("bfloat16", "float16") else 4,
                                   chunks=cfg["pp_chunks"], ep=cfg["ep"], optimizer=cfg["optimizer"],
                                   pp_layers=cfg["pp_layers"], attention_scores=memory_plan.attention_saves_scores(
                                       model_cfg, cfg["attn_impl"], cfg["device"], cfg["dtype"]))
    memory = memory_plan.format_plan(plan, cfg["gpu_mem_gib"] or None)
    header += "".join(f"# {line}\n" for line in memory.splitlines())
    return header, settings_block(cfg, given, chosen) + "\n", chosen


def main(argv):
    try:
        values, given = configure(settings.TRAINING + OWN, argv, usage=__doc__)
        warnings = settings.check_values(values)
        header, body, chosen = make_config(values, given, argv)
        out, existed = values["out"], os.path.exists(values["out"])
        if existed and not values["force"]:
            raise ConfigError(f"out = {out!r} exists: choose another --out, or pass --force=True to overwrite it")
        try:
            if os.path.dirname(out):
                os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(out, "w") as f:
                f.write(header + "\n" + body)
        except OSError as e:
            raise ConfigError(f"out = {out!r} cannot be written ({e.strerror}): choose another --out")
    except (ConfigError, ValueError) as e:
        sys.exit(f"error: {e}")
    print("\n".join(warnings + [line[2:] for line in header.splitlines()[2:]]))
    for name, (value, why) in chosen.items():
        print(f"chose {name} = {value}: {why}")
    # the default --out is a path in the current folder: say where the file went, so it is not found by surprise
    where = out if os.path.isabs(out) else f"{out} ({os.path.abspath(out)})"
    print(f"{'overwrote' if existed else 'wrote'} {where}" + ("" if "out" in given else
                                                            ": the default --out; --out=PATH writes elsewhere"))


if __name__ == "__main__":
    main(sys.argv[1:])
