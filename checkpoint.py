"""
Sharded, atomic, reshardable checkpoints.

A checkpoint is a folder  out_dir/ckpt_0001000/  holding
    rank00000.pt ... rankNNNNN.pt   what each rank holds, and nothing more: no rank gathers the model
    meta.json                       step, config, layout, the files and their sizes; written last

Every rank writes into  ckpt_0001000.tmp/ ; once all have finished (a barrier), rank 0 writes meta.json
and renames the folder. A rename is atomic, so a crash at any point leaves either the complete new
checkpoint or a .tmp folder that resume ignores, and the previous checkpoint is never touched.

Each tensor is saved as "pieces". A piece says which full tensor it belongs to (its name and full shape),
which tensor-parallel slice it is (dim, rank, world) and which range of that slice's flattened elements it
holds (all of them for a model shard, a ZeRO-1 rank's range for optimizer state). Loading assembles each
full tensor a rank needs from whatever pieces were saved, then cuts the slice this rank's layout needs, so
a checkpoint saved at one dp x tp x pp layout resumes at any other.
"""
import glob
import json
import math
import os
import re
import shutil
import time

import torch
import torch.distributed as dist

from parallel import full_shape_of, shard_of


def make_piece(tensor, param, flat_range=None):
    """Describe `tensor` (shaped like this rank's slice of `param`, or a flat range of it) for saving."""
    numel = tensor.numel() if flat_range is None else None
    return {
        "tensor": tensor.detach().cpu().clone().reshape(-1),
        "full_shape": list(full_shape_of(param)),
        "tp_dim": getattr(param, "tp_shard_dim", None),
        "tp_rank": getattr(param, "tp_rank", 0),
        "tp_world": getattr(param, "tp_world", 1),
        "flat_range": list(flat_range) if flat_range is not None else [0, numel],
    }


def _assemble(pieces, name):
    """The full tensor from its pieces (every tensor-parallel slice, every flat range)."""
    full_shape = pieces[0]["full_shape"]
    full = torch.empty(full_shape)
    by_slice = {}
    for p in pieces:
        by_slice.setdefault(p["tp_rank"], []).append(p)
    for tp_rank, parts in by_slice.items():
        dim, world = parts[0]["tp_dim"], parts[0]["tp_world"]
        slice_shape = list(full_shape)
        if dim is not None:
            slice_shape[dim] //= world
        flat = torch.empty(math.prod(slice_shape))
        covered = 0
        for p in parts:
            start, end = p["flat_range"]
            flat[start:end] = p["tensor"]
            covered += end - start
        if covered != flat.numel():
            raise RuntimeError(f"checkpoint is incomplete: tensor '{name}' slice {tp_rank} has {covered} of "
                               f"{flat.numel()} elements")
        target = full if dim is None else full.narrow(dim, tp_rank * slice_shape[dim], slice_shape[dim])
        target.copy_(flat.view(slice_shape))
    return full


class CheckpointReader:
    """Reads a checkpoint folder lazily (memory-mapped) and hands each rank the slices it needs."""

    def __init__(self, path):
        self.path = path
        with open(os.path.join(path, "meta.json")) as f:
            self.meta = json.load(f)
        self.files = [torch.load(os.path.join(path, name), map_location="cpu", mmap=True, weights_only=True)
                      for name in self.meta["files"]]

    def _pieces(self, section, name, key=None):
        found = []
        for f in self.files:
            entry = f[section].get(name)
            if entry is not None:
                found.append(entry if key is None else entry[key])
        return found

    def _fetch(self, section, name, param, key=None):
        pieces = self._pieces(section, name, key)
        if not pieces:
            raise KeyError(f"checkpoint {self.path} has no '{name}'" + (f" ({key})" if key else "") +
                           ": it was saved from a different model (compare the config in its meta.json)")
        full = _assemble(pieces, name)
        want = full_shape_of(param)
        if list(full.shape) != want:
            vocab = getattr(param, "vocab_size", None)
            if vocab is None or list(full.shape[1:]) != want[1:]:
                raise ValueError(f"checkpoint tensor '{name}' has shape {list(full.shape)} but the model "
                                 f"needs {want}: the model config differs from the checkpoint's")
            # the vocabulary is padded to a multiple of tp, so the padding differs between layouts:
            # keep the real tokens' rows, the padding rows are zero
            resized = torch.zeros(want)
            resized[:vocab] = full[:vocab]
            full = resized
        return shard_of(full, param)

    def model_tensor(self, name, param):
        return self._fetch("model", name, param)

    def optimizer_tensor(self, name, param, key):
        return self._fetch("optimizer", name, param, key)

    def rank_state(self, rank):
        """This rank's own extras (RNG states), or None when the world changed size since the save."""
        if self.meta["world_size"] != len(self.files) or rank >= len(self.files):
            return None
        return self.files[rank].get("extra")


def load_model(model, path):
    """Fill a model (any layout) with the weights of the checkpoint at `path`."""
    reader = CheckpointReader(path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(reader.model_tensor(checkpoint_name(name, p), p))
    return reader


def checkpoint_name(name, param):
    """A tied output head on the last pipeline stage is a copy of the embedding: save and load it as one."""
    return getattr(param, "init_name", name)


def _saved_here(param, layout, dp_sharded=False):
    """Each full tensor is saved once: data-parallel replicas leave it to dp rank 0 (unless dp_sharded:
    each dp rank then holds a different part, ZeRO-1's optimizer state), tensor-parallel replicas (norms)
    to tp rank 0, and a tied head's copy on the last stage to the embedding's stage."""
    if (layout.dp_rank != 0 and not dp_sharded) or hasattr(param, "init_name"):
        return False
    return layout.tp_rank == 0 or getattr(param, "tp_shard_dim", None) is not None


def model_pieces(model, layout):
    return {name: make_piece(p, p) for name, p in model.named_parameters() if _saved_here(p, layout)}


def optimizer_pieces(optimizer, model, layout):
    """The AdamW moments, saved like the parameters they belong to. parallel.ZeroOneAdamW's state says
    which flat range of each parameter's (tensor-parallel slice's) elements this rank owns: then every
    data-parallel rank saves its own range, and the ranks' pieces together cover every element once."""
    pieces = {}
    for name, p in model.named_parameters():
        state = optimizer.state.get(p)
        flat_range = state.get("flat_range") if state else None
        if state and _saved_here(p, layout, dp_sharded=flat_range is not None):
            pieces[name] = {k: make_piece(state[k], p, flat_range) for k in ("exp_avg", "exp_avg_sq")}
    return pieces


def load_zero(optimizer, model, reader):
    """Fill a ZeroOneAdamW's moments (any dp, any layout) from a checkpoint saved with or without ZeRO:
    each rank assembles the full moments of its parameters and keeps the flat range it owns now."""
    step = torch.tensor(float(reader.meta["adam_step"]))
    for name, p in model.named_parameters():
        state = optimizer.state.get(p)
        if not state:
            continue
        start, end = state["flat_range"]
        for k in ("exp_avg", "exp_avg_sq"):
            state[k].copy_(reader.optimizer_tensor(checkpoint_name(name, p), p, k).reshape(-1)[start:end])
        state["step"] = step.clone()


def adamw_step_count(optimizer):
    for state in optimizer.state.values():
        return int(state["step"])
    return 0


def load_adamw(optimizer, model, reader):
    # fused AdamW keeps its step counter on the parameters' device, the loop implementation on the CPU
    fused = optimizer.defaults.get("fused")
    for name, p in model.named_parameters():
        name = checkpoint_name(name, p)
        step = torch.tensor(float(reader.meta["adam_step"]), device=p.device if fused else "cpu")
        # contiguous: a tensor-parallel slice is a strided view, which fused AdamW would not update in place
        optimizer.state[p] = {"step": step, **{k: reader.optimizer_tensor(name, p, k).to(p.device).contiguous()
                                               for k in ("exp_avg", "exp_avg_sq")}}


# -----------------------------------------------------------------------------
# Writing


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def save(out_dir, step, rank, world_size, model_pieces, optimizer_pieces, meta, extra=None, keep_last_n=0):
    """Write this rank's pieces; the checkpoint appears (atomically) once every rank has written.
    model_pieces: {name: piece}; optimizer_pieces: {name: {state_key: piece}}."""
    final = os.path.join(out_dir, f"ckpt_{step:07d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that crashed
        os.makedirs(tmp)
    _barrier()
    name = f"rank{rank:05d}.pt"
    torch.save({"model": model_pieces, "optimizer": optimizer_pieces, "extra": extra or {}}, os.path.join(tmp, name))
    sizes = [None] * world_size
    if dist.is_initialized():
        dist.all_gather_object(sizes, (name, os.path.getsize(os.path.join(tmp, name))))
    else:
        sizes = [(name, os.path.getsize(os.path.join(tmp, name)))]
    if rank == 0:
        meta = dict(meta, step=step, world_size=world_size, files=[n for n, _ in sizes],
                    file_sizes=[s for _, s in sizes], saved_at=time.time())
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        if keep_last_n > 0:
            for old in complete_checkpoints(out_dir)[:-keep_last_n]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def is_complete(path):
    """A checkpoint counts only if its meta.json exists and every rank file has the size it was saved with."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        return all(os.path.getsize(os.path.join(path, n)) == s for n, s in zip(meta["files"], meta["file_sizes"]))
    except (OSError, ValueError, KeyError):
        return False


def complete_checkpoints(out_dir):
    """The complete checkpoints in out_dir, oldest first (.tmp folders of crashed saves are ignored)."""
    paths = [p for p in glob.glob(os.path.join(out_dir, "ckpt_*")) if re.fullmatch(r"ckpt_\d+", os.path.basename(p))]
    return sorted((p for p in paths if is_complete(p)), key=lambda p: int(p.rsplit("_", 1)[1]))


def latest_checkpoint(out_dir):
    done = complete_checkpoints(out_dir)
    return done[-1] if done else None
