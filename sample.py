"""
Generate text from a picotron checkpoint (saved at any parallel layout) on one device.

    python sample.py --out_dir=out/tiny_fineweb --start="The history of" --num_samples=3 --max_new_tokens=100
    python sample.py --out_dir=out/tiny_fineweb --start=FILE:prompt.txt --top_k=1     # greedy
"""
import sys
from contextlib import nullcontext

import tiktoken
import torch

import checkpoint
from configurator import ConfigError, configure
from model import ModelConfig, Transformer, choose_attn_impl
from train import choose_device_and_dtype

# -----------------------------------------------------------------------------
out_dir = "out"  # the newest complete checkpoint in here is used...
ckpt = ""  # ...unless a checkpoint folder is named here
start = "\n"  # the prompt, or FILE:path to read it from a file
num_samples = 3
max_new_tokens = 200
temperature = 0.8  # 1.0 samples from the model's distribution, lower is more conservative
top_k = 200  # keep only the top_k most likely tokens; 1 is greedy decoding, 0 keeps all
seed = 1337
device = "auto"
dtype = "auto"
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in dict(globals()).items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))}


def main(argv):
    try:
        cfg = configure(DEFAULTS, argv)
        path = cfg["ckpt"] or checkpoint.latest_checkpoint(cfg["out_dir"])
        if not path:
            raise FileNotFoundError(f"no complete checkpoint in out_dir '{cfg['out_dir']}': train first, or pass --ckpt")
        dev, ptdtype, _ = choose_device_and_dtype(cfg["device"], cfg["dtype"])
    except (ConfigError, ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    reader = checkpoint.CheckpointReader(path)
    model_cfg = ModelConfig(**reader.meta["model"])
    model_cfg.attn_impl, _ = choose_attn_impl("auto", dev.type, ptdtype, model_cfg.attn_softcap)
    model = Transformer(model_cfg)
    checkpoint.load_model(model, path)
    model.to(dev).eval()
    enc = tiktoken.get_encoding(reader.meta.get("tokenizer", "gpt2"))

    prompt = cfg["start"]
    if prompt.startswith("FILE:"):
        with open(prompt[5:], encoding="utf-8") as f:
            prompt = f.read()
    ids = enc.encode(prompt, allowed_special={"<|endoftext|>"})
    x = torch.tensor(ids, dtype=torch.long, device=dev)[None, :]
    torch.manual_seed(cfg["seed"])
    autocast = torch.autocast(dev.type, dtype=ptdtype) if ptdtype != torch.float32 else nullcontext()
    samples = []
    with autocast:
        for _ in range(cfg["num_samples"]):
            y = model.generate(x, cfg["max_new_tokens"], temperature=cfg["temperature"], top_k=cfg["top_k"] or None)
            text = enc.decode(y[0].tolist())
            samples.append(text)
            print(text)
            print("---------------")
    return samples


if __name__ == "__main__":
    main(sys.argv[1:])
