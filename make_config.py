"""
Write a starter config for a model size and a parallel layout, checked before anything runs.

    python make_config.py --n_layer=12 --n_embd=768 --n_head=12 --tp=2 --pp=2 --nproc=8 --out=config/my.py
    torchrun --nproc_per_node=8 train.py config/my.py

Every train.py setting can be given (--key=value, or a config file to start from), plus `nproc`, the number
of processes the run will have, and `out`, the file to write. The layout is checked with train.py's own
rules (dp x tp x pp must be nproc, and model.check_layout: heads, key/value heads, MLP width and blocks
must split), so a layout that does not divide the model is refused here rather than after the job waited
in a queue. The file states the parameter count and the global batch in tokens, then lists every setting
of train.py with its comment there.
"""
import io
import json
import os
import sys
import tokenize
from dataclasses import fields

import torch

import train
from configurator import ConfigError, configure
from model import ModelConfig, Transformer, check_layout

GPT2_VOCAB_SIZE = 50257
DEFAULTS = dict(train.DEFAULTS, nproc=1, out="config/my.py")


def resolve_dp(nproc, dp, tp, pp):
    """train.py's rule: dp x tp x pp processes, dp = 0 meaning whatever nproc leaves over."""
    if nproc % (tp * pp):
        raise ValueError(f"nproc = {nproc} processes cannot be cut into tp = {tp} x pp = {pp} = {tp * pp}: use an "
                         f"nproc that is a multiple of {tp * pp}, or change tp or pp")
    if dp == 0:
        return nproc // (tp * pp)
    if dp * tp * pp != nproc:
        raise ValueError(f"dp = {dp} x tp = {tp} x pp = {pp} = {dp * tp * pp} processes, but nproc = {nproc}: "
                         f"leave dp=0 to have it computed, or make the product equal nproc")
    return dp


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


def literal(value):
    return json.dumps(value) if isinstance(value, str) else repr(value)


def settings_block(cfg):
    """train.py's block of defaults, line by line, with this config's values and train.py's comments."""
    with open(train.__file__) as f:
        source = f.read()
    start = source.index("# default config values")
    lines = source[start:source.index("DEFAULTS =", start)].splitlines()[1:]
    out = []
    for line in lines:
        if line.startswith("# ---"):
            continue
        name = line.split("=", 1)[0].strip()
        if "=" in line and name in cfg:
            comment = next((t.string for t in tokenize.generate_tokens(io.StringIO(line).readline)
                            if t.type == tokenize.COMMENT), None)
            line = f"{name} = {literal(cfg[name])}" + (f"  {comment}" if comment else "")
        out.append(line)
    return "\n".join(out)


def make_config(cfg, argv):
    """The config file's (header, settings); raises ValueError when the layout does not divide the model."""
    tp, pp = cfg["tp"], cfg["pp"]
    dp = resolve_dp(cfg["nproc"], cfg["dp"], tp, pp)
    vocab, vocab_source = vocab_size_of(cfg)
    model_cfg = ModelConfig(**{f.name: cfg[f.name] for f in fields(ModelConfig)
                               if f.name in cfg and f.name not in ("vocab_size", "attn_impl")}, vocab_size=vocab)
    check_layout(model_cfg, tp, pp)
    n_params, n_embedding = count_parameters(model_cfg)
    sequences = cfg["batch_size"] * cfg["gradient_accumulation_steps"] * dp
    tokens_per_step = sequences * cfg["block_size"]
    total_tokens = tokens_per_step * cfg["max_iters"]
    head_dim = model_cfg.n_embd // model_cfg.n_head
    launch = (f"torchrun --nproc_per_node={cfg['nproc']} train.py {cfg['out']}" if cfg["nproc"] > 1
              else f"python train.py {cfg['out']}")
    header = f"""\
# Written by: python make_config.py {' '.join(argv)}
#
# model:  {n_params / 1e6:.2f}M parameters ({(n_params - n_embedding) / 1e6:.2f}M without the embedding{'' if model_cfg.tie_embeddings else 's'}), \
{model_cfg.n_layer} layers, width {model_cfg.n_embd}, {model_cfg.n_head} heads ({model_cfg.n_kv_head} key/value) of size {head_dim}
#         vocabulary {vocab} ({vocab_source}), {'tied' if model_cfg.tie_embeddings else 'untied'} input and output embeddings
# layout: {cfg['nproc']} processes = dp {dp} x tp {tp} x pp {pp} (checked: the model splits this way)
# batch:  {cfg['batch_size']} sequences x {cfg['gradient_accumulation_steps']} micro-batches x {dp} data-parallel ranks \
= {sequences} sequences of {cfg['block_size']} tokens = {tokens_per_step:,} tokens per step
# run:    {cfg['max_iters']:,} steps = {total_tokens / 1e6:,.1f}M tokens, {total_tokens / n_params:.3g} tokens per parameter \
(Chinchilla's compute-optimal ratio is about 20)
# launch: {launch}
"""
    return header, settings_block(dict(cfg, dp=dp)) + "\n"


def main(argv):
    try:
        cfg = configure(DEFAULTS, argv)
        header, settings = make_config(cfg, argv)
    except (ConfigError, ValueError) as e:
        sys.exit(f"error: {e}")
    if os.path.dirname(cfg["out"]):
        os.makedirs(os.path.dirname(cfg["out"]), exist_ok=True)
    with open(cfg["out"], "w") as f:
        f.write(header + "\n" + settings)
    print("\n".join(line[2:] for line in header.splitlines()[2:]))
    print(f"wrote {cfg['out']}")


if __name__ == "__main__":
    main(sys.argv[1:])
