"""
Generate text from a picotron checkpoint (saved at any parallel layout) on one device.

    python sample.py --out_dir=out/tiny_fineweb --start="The history of" --max_new_tokens=100
    python sample.py --out_dir=out/tiny_fineweb --start=FILE:prompt.txt --top_k=1     # greedy

The tokenizer is the one the checkpoint records (its data's, or a converted model's: a tiktoken
encoding or a model folder's tokenizer.json, see hf_tokenizer.py); --tokenizer names another.
"""

import sys
from contextlib import nullcontext

import torch

import checkpoint
import hf_tokenizer
from checkpoint import find_checkpoint
from configurator import ConfigError, Setting, configure, section
from model import Transformer, choose_attn_impl, choose_device_and_dtype, model_config_from

SAMPLING = section(
    "sampling",
    Setting("out_dir", "out", "the newest complete checkpoint in here is used..."),
    Setting(
        "ckpt",
        "",
        "...unless one is named here: its folder, or its step in out_dir (300 or ckpt_300)",
    ),
    Setting("start", "\n", "the prompt, or FILE:path to read it from a file"),
    Setting("num_samples", 3, "samples to draw"),
    Setting("max_new_tokens", 200, "tokens generated per sample"),
    Setting(
        "temperature", 0.8, "1.0 samples from the model's distribution, lower is more conservative"
    ),
    Setting(
        "top_k", 200, "keep only the top_k most likely tokens; 1 is greedy decoding, 0 keeps all"
    ),
    Setting("seed", 1337, "seeds the sampling"),
    Setting("device", "auto", "'auto' (CUDA when present), 'cpu', 'cuda', 'cuda:1', ..."),
    Setting(
        "dtype",
        "auto",
        "'auto' (bf16 on Ampere+, fp16 before, fp32 on CPU), 'float32', 'bfloat16', 'float16'",
    ),
    Setting(
        "tokenizer",
        "",
        "a tiktoken encoding or a model folder with tokenizer.json; empty = the checkpoint's",
    ),
)


def read_prompt(start):
    if not start.startswith("FILE:"):
        return start
    path = start[len("FILE:") :]
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise FileNotFoundError(
            f"--start=FILE:{path}: the prompt file cannot be read ({type(e).__name__}: {e})"
        )


def checkpoint_tokenizer(meta, given):
    """The tokenizer's name: --tokenizer, else the checkpoint's. A model converted from a folder
    without tokenizer files has none."""
    if given:
        return given
    if meta.get("tokenizer", "gpt2") is None:
        raise ValueError(
            f"the checkpoint's model was converted from {meta.get('converted_from')}, which has no "
            f"tokenizer files: pass --tokenizer=NAME (a tiktoken encoding, or a model folder with "
            f"tokenizer.json)"
        )
    return meta.get("tokenizer", "gpt2")


def check_values(cfg):
    problems = [
        f"{k} = {cfg[k]} must be positive" for k in ("num_samples", "max_new_tokens") if cfg[k] <= 0
    ]
    problems += [
        f"{k} = {cfg[k]} must not be negative ({why})"
        for k, why in (("temperature", "0 is greedy"), ("top_k", "0 keeps every token"))
        if cfg[k] < 0
    ]
    if problems:
        raise ConfigError("; ".join(problems))


def main(argv):
    try:
        cfg, _ = configure(SAMPLING, argv, usage=__doc__)
        check_values(cfg)
        path = find_checkpoint(cfg["ckpt"], cfg["out_dir"])
        prompt = read_prompt(cfg["start"])
        dev, ptdtype, _ = choose_device_and_dtype(cfg["device"], cfg["dtype"])
        reader = checkpoint.CheckpointReader(path)
        enc = hf_tokenizer.get_encoding(checkpoint_tokenizer(reader.meta, cfg["tokenizer"]))
        ids = enc.encode(prompt, allowed_special={"<|endoftext|>"})
        if not ids:
            start = cfg["start"]
            source = f"the file {start[5:]}" if start.startswith("FILE:") else "--start"
            raise ValueError(
                f"the prompt is empty ({source} holds no text): generation needs at least one "
                f"token to start from"
            )
    except (ConfigError, ValueError, OSError, checkpoint.CheckpointError) as e:
        sys.exit(f"error: {e}")
    model_cfg = model_config_from(reader.meta["model"])
    attn_impl, _ = choose_attn_impl("auto", dev.type, ptdtype, model_cfg.attn_softcap)
    model = Transformer(model_cfg, attn_impl=attn_impl)
    checkpoint.load_model(model, reader)
    model.to(dev).eval()
    x = torch.tensor(ids, dtype=torch.long, device=dev)[None, :]
    torch.manual_seed(cfg["seed"])
    autocast = (
        torch.autocast(dev.type, dtype=ptdtype) if ptdtype != torch.float32 else nullcontext()
    )
    samples = []
    with autocast:
        for _ in range(cfg["num_samples"]):
            y = model.generate(
                x, cfg["max_new_tokens"], temperature=cfg["temperature"], top_k=cfg["top_k"] or None
            )
            text = enc.decode(y[0].tolist())
            samples.append(text)
            print(text)
            print("---------------")
    return samples


if __name__ == "__main__":
    main(sys.argv[1:])
