"""What the crc32s cost a save and a load of the quick start's checkpoint (config/tiny_fineweb.py's
model with the GPT-2 vocabulary, AdamW's two moments), at one process: the median of a few saves and
loads with the crc and without it (the crc switched off in checkpoint.py, in this process only).
docs/faults.md quotes it.

    python tests/time_checkpoint_crc.py [REPEATS]      (default 11)
"""

import os
import statistics
import sys
import tempfile
import time
import types
import zlib

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import checkpoint  # noqa: E402
from configurator import configure  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
import settings  # noqa: E402


def tiny_fineweb_model():
    values, _ = configure(settings.TRAINING, ["config/tiny_fineweb.py"])
    fields = ModelConfig.__dataclass_fields__
    model = Transformer(
        ModelConfig(**{k: v for k, v in values.items() if k in fields and k != "vocab_size"})
    )
    model.init_weights(seed=0)
    return model


def pieces(model):
    one = types.SimpleNamespace(dp_cp_rank=0, cp_rank=0, dp_rank=0, tp_rank=0, ep=1)  # one process
    moments = {
        p: {"exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)}
        for p in model.parameters()
    }
    optimizer = types.SimpleNamespace(state=moments)
    return checkpoint.model_pieces(model, one), checkpoint.optimizer_pieces(optimizer, model, one)


def load(path, model):
    reader = checkpoint.CheckpointReader(path)
    checkpoint.load_model(model, reader)
    copies = model.tied_copies()
    for name, p in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            reader.optimizer_tensor(copies.get(name, name), p, key)


def crc_switched(crc, real=(checkpoint.zlib, checkpoint.why_corrupted)):
    """checkpoint.py with its crc32s (crc True) or without: none computed at a save, none checked at
    a load."""
    checkpoint.zlib = real[0] if crc else types.SimpleNamespace(crc32=lambda data, value=0: 0)
    checkpoint.why_corrupted = real[1] if crc else (lambda path, name, meta: None)


def clocked(call):
    """(wall seconds, this process's CPU seconds) of call(): on a machine that other jobs share, the
    CPU time is the work the call did, which the wall time mixes with the others' turns."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = call()
    return (time.perf_counter() - wall, time.process_time() - cpu), result


def main(repeats):
    torch.manual_seed(0)
    model = tiny_fineweb_model()
    model_pieces, optimizer_pieces = pieces(model)
    times = {(crc, what): [] for crc in (False, True) for what in ("save", "load")}  # [(wall, cpu)]
    with tempfile.TemporaryDirectory() as out_dir:
        for step in range(1, repeats + 1):
            for crc in (False, True):  # alternated, so a busy machine's drift falls on both alike
                crc_switched(crc)
                took, path = clocked(
                    lambda: checkpoint.save(
                        os.path.join(out_dir, str(crc)),
                        step,
                        0,
                        1,
                        model_pieces,
                        optimizer_pieces,
                        {"adam_step": 1},
                        keep_last_n=1,
                    )
                )
                times[crc, "save"].append(took)
                times[crc, "load"].append(clocked(lambda: load(path, model))[0])
        size = os.path.getsize(os.path.join(path, "rank00000.pt")) / 2**20
    crc_switched(True)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"tiny_fineweb: {params:.2f}M parameters, a {size:.1f} MiB file; median of {repeats}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} cores (wall seconds, CPU seconds)"
    )
    for crc in (False, True):
        row = [
            f"{what} {statistics.median(w for w, _ in times[crc, what]):.3f} s (min "
            f"{min(times[crc, what])[0]:.3f}), "
            f"{statistics.median(c for _, c in times[crc, what]):.3f} s"
            for what in ("save", "load")
        ]
        print(f"  {'with' if crc else 'without'} crc32: " + "; ".join(row))
    took, _ = clocked(lambda: zlib.crc32(bytes(int(size * 2**20))))
    print(f"  zlib.crc32 alone over {size:.1f} MiB: {took[0]:.3f} s, {took[1]:.3f} s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 11)
