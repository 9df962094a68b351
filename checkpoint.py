"""
Sharded, atomic, reshardable checkpoints.

A checkpoint is a folder  out_dir/ckpt_0001000/  holding
    rank00000.pt ... rankNNNNN.pt  what each rank holds and nothing more: no rank gathers the model
    meta.json                      step, config, layout, files, their sizes and crc32s; written last

Every rank writes into  ckpt_0001000.tmp/ ; once all have finished (a barrier), rank 0 writes
meta.json (whole or not at all: written aside, then renamed) and renames the folder. meta.json is
the commit: a .tmp folder without it is a save that stopped, which resume ignores; one with it is
complete, and counts as its step's checkpoint while no complete ckpt_0001000/ is there (a kill
between the two renames of a re-save, see _publish). A kill of any rank at any moment of a save
therefore leaves the checkpoints before it as they were, and never makes a partial one look
complete.

Each rank file's crc32 is computed as torch.save writes it (no second read) and checked by every
rank that reads the file: a file damaged on disk without changing its size (a bad sector, a copy
gone wrong) stops the load naming the file, rather than loading NaN that would later read as a
divergence. A save refuses weights that are not finite, so every checkpoint that verifies is one to
resume from. `python checkpoint.py --verify OUT_DIR` checks every checkpoint of a run offline and
names the newest intact one (verify).

Each tensor is saved as "pieces". A piece says which full tensor it belongs to (its name and full
shape), which tensor-parallel slice it is (dim, rank, world) and which range of that slice's
flattened elements it holds (all of them for a model shard, a ZeRO-1 rank's range for optimizer
state). Loading assembles each full tensor a rank needs from whatever pieces were saved, then cuts
the slice this rank's layout needs, so a checkpoint saved at one dp x cp x tp x pp layout resumes at
any other. The experts of a mixture of experts are named by their global index whichever rank holds
them, so expert parallelism (ep) changes freely too.
"""

import errno
import glob
import json
import math
import os
import re
import shlex
import shutil
import sys
import time
import zlib
from dataclasses import asdict

import torch
import torch.distributed as dist

from parallel import full_shape_of, shard_of


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read back as the model needs it; the message says
    which and why."""


class CorruptedCheckpoint(CheckpointError):
    """A rank file whose bytes are not those written (its crc32 differs from meta.json's): the load
    stops."""


def _gather(obj):
    """obj of every rank, in rank order (every rank must call it: it is also a barrier)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj):
    """Rank 0's obj, on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _error(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def make_piece(tensor, param, flat_range=None):
    """Describe `tensor` (shaped like this rank's slice of `param`, or a flat range of it) for
    saving."""
    return {
        "tensor": tensor.detach().cpu().clone().reshape(-1),
        "full_shape": list(full_shape_of(param)),
        "tp_dim": getattr(param, "tp_shard_dim", None),
        "tp_rank": getattr(param, "tp_rank", 0),
        "tp_world": getattr(param, "tp_world", 1),
        "flat_range": [0, tensor.numel()] if flat_range is None else list(flat_range),
    }


def _assemble(pieces, name):
    """The full tensor from its pieces (every tensor-parallel slice, every flat range), in their
    dtype (a float64 run's stay float64)."""
    full_shape, dtype = pieces[0]["full_shape"], pieces[0]["tensor"].dtype
    full = torch.empty(full_shape, dtype=dtype)
    by_slice = {}
    for p in pieces:
        by_slice.setdefault(p["tp_rank"], []).append(p)
    for tp_rank, parts in by_slice.items():
        dim, world = parts[0]["tp_dim"], parts[0]["tp_world"]
        slice_shape = list(full_shape)
        if dim is not None:
            slice_shape[dim] //= world
        flat = torch.empty(math.prod(slice_shape), dtype=dtype)
        covered = 0
        for p in parts:
            start, end = p["flat_range"]
            flat[start:end] = p["tensor"]
            covered += end - start
        if covered != flat.numel():
            raise RuntimeError(
                f"checkpoint is incomplete: tensor '{name}' slice {tp_rank} has {covered} of "
                f"{flat.numel()} elements"
            )
        target = (
            full if dim is None else full.narrow(dim, tp_rank * slice_shape[dim], slice_shape[dim])
        )
        target.copy_(flat.view(slice_shape))
    return full


def read_meta(path):
    """A checkpoint's meta.json: its step, settings, model config, layout and files."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {path}: its meta.json cannot be read ({type(e).__name__}: {e})"
        )


def file_crc32(path, chunk=1 << 24):
    """The crc32 of a file's bytes, read in 16 MiB blocks."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def why_corrupted(path, name, meta):
    """None when rank file `name` of checkpoint `path` has the crc32 meta.json recorded as it was
    written (or meta.json has none: a checkpoint from before checksums), else why not, naming the
    file."""
    crcs = dict(zip(meta["files"], meta.get("file_crc32", [])))
    found = file_crc32(os.path.join(path, name)) if name in crcs else None
    if found is None or found == crcs[name]:
        return None
    return (
        f"{os.path.join(path, name)} is corrupted, not diverged: its bytes' crc32 is {found:08x}, "
        f"meta.json recorded {crcs[name]:08x} as it was written (the file changed on disk since, "
        f"at the same size: the storage or a copy damaged it)"
    )


class CheckpointReader:
    """Reads a checkpoint folder lazily (memory-mapped) and hands each rank the slices it needs,
    once each file's crc32 is the one meta.json recorded (a full read of the files; else
    CorruptedCheckpoint)."""

    def __init__(self, path):
        self.path = path
        self.meta = read_meta(path)
        self.files = []
        for name in self.meta["files"]:
            if corrupted := why_corrupted(path, name, self.meta):
                raise CorruptedCheckpoint(corrupted)
            file = os.path.join(path, name)
            try:
                self.files.append(
                    torch.load(file, map_location="cpu", mmap=True, weights_only=True)
                )
            except Exception as e:  # a damaged file raises many kinds: all mean "unreadable"
                raise CheckpointError(f"checkpoint {path}: {name} cannot be read ({_error(e)})")

    def _pieces(self, section, name, key=None):
        entries = [f[section][name] for f in self.files if name in f[section]]
        return entries if key is None else [entry[key] for entry in entries]

    def has(self, section, name):
        return bool(self._pieces(section, name))

    def _fetch(self, section, name, param, key=None):
        pieces = self._pieces(section, name, key)
        if not pieces:
            raise CheckpointError(
                f"checkpoint {self.path} has no '{name}'"
                + (f" ({key})" if key else "")
                + ": it was saved from a different model (compare the config in its meta.json)"
            )
        full = _assemble(pieces, name)
        want = full_shape_of(param)
        if list(full.shape) != want:
            vocab = getattr(param, "vocab_size", None)
            if vocab is None or list(full.shape[1:]) != want[1:]:
                raise CheckpointError(
                    f"checkpoint tensor '{name}' has shape {list(full.shape)} but the model "
                    f"needs {want}: the model config differs from the checkpoint's"
                )
            # the vocabulary is padded to a multiple of tp, so the padding differs between layouts:
            # keep the real tokens' rows, the padding rows are zero
            resized = torch.zeros(want, dtype=full.dtype)
            resized[:vocab] = full[:vocab]
            full = resized
        return shard_of(full, param)

    def model_tensor(self, name, param):
        return self._fetch("model", name, param)

    def optimizer_tensor(self, name, param, key):
        return self._fetch("optimizer", name, param, key)

    def rank_state(self, rank):
        """This rank's own extras (RNG states), or None when the world changed size since the
        save."""
        if self.meta["world_size"] != len(self.files) or rank >= len(self.files):
            return None
        return self.files[rank].get("extra")


# the settings a checkpoint's model may differ in from the model it is loaded into: the context
# length and the RoPE base and scaling (a deliberate context extension), document masking (training
# on or off it); none changes a weight's shape or meaning
MAY_DIFFER = (
    "block_size",
    "rope_theta",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_context",
    "doc_mask",
    "eot_token",
)


def check_model_config(saved, model_cfg, path):
    """Refuse to load weights into another architecture, naming every setting that differs. A
    setting the checkpoint lacks (written before the setting existed) had its default then: head_dim
    = 0 is the n_embd / n_head every older checkpoint has, so it is compared as that."""
    saved = {**asdict(type(model_cfg)()), **saved}
    differ = [
        f"{k} = {v!r} (the checkpoint has {saved[k]!r})"
        for k, v in asdict(model_cfg).items()
        if k not in MAY_DIFFER and saved[k] != v
    ]
    if differ:
        raise CheckpointError(
            f"checkpoint {path} holds another model than the one configured: " + "; ".join(differ)
        )


def open_for_resume(path, model_cfg, say=print):
    """The reader of the checkpoint to resume: `path`, or when some rank cannot read it, the newest
    older complete checkpoint every rank can. All ranks decide together (one all_gather per
    candidate): a rank that resumed another step than the others would train another model. A
    corrupted file on any rank stops every rank, naming it: its NaN would otherwise pass for a
    divergence."""
    out_dir = os.path.dirname(path)
    # newest first
    candidates = [p for p in complete_checkpoints(out_dir) if step_of(p) <= step_of(path)][::-1]
    for i, candidate in enumerate(candidates):
        try:
            reader, error = CheckpointReader(candidate), None
        except CheckpointError as e:
            reader, error = None, (isinstance(e, CorruptedCheckpoint), str(e))
        errors = [(r, e) for r, e in enumerate(_gather(error)) if e]
        for r, (corrupted, text) in errors:
            if corrupted:  # the first rank that found it
                raise CorruptedCheckpoint(
                    text
                    + (f" (found by rank {r})" if dist.is_initialized() else "")
                    + ". "
                    + _corrupted_advice(out_dir, candidate)
                )
        if not errors:
            if "file_crc32" not in reader.meta:
                say(
                    f"checkpoint {candidate} was written before checkpoints had checksums: its "
                    f"files' sizes are checked, not their bytes"
                )
            check_model_config(reader.meta["model"], model_cfg, candidate)
            return reader
        say(
            f"checkpoint {candidate} cannot be read on {len(errors)} rank(s)"
            + (f" ({error[1]})" if error else "")
            + (f"; falling back to {candidates[i + 1]}" if i + 1 < len(candidates) else "")
        )
    raise CheckpointError(
        f"no checkpoint in '{out_dir}' can be read by every rank: start a new run with "
        f"--init_from=scratch, or repair the files named above"
    )


def _corrupted_advice(out_dir, corrupted):
    """What to do when checkpoint `corrupted` has a damaged file: resume from the newest intact
    older one."""
    intact = newest_intact(out_dir, before=step_of(corrupted))
    if intact is None:
        return (
            f"No older checkpoint in {out_dir} is intact: start again with --init_from=scratch "
            f"(or restore the file from a copy)"
        )
    return (
        f"Move it aside (mv {corrupted} {corrupted}.damaged) and launch again with "
        f"--init_from=resume to resume from the newest intact checkpoint, {intact} "
        f"(python checkpoint.py --verify {out_dir} checks them all)"
    )


def load_model(model, reader, only=None):
    """Fill a model (any layout), or only the parameters in `only`, with the weights a
    CheckpointReader holds; a tied copy (the head on a last stage, see Transformer.tied_copies)
    loads from the weight it copies."""
    copies, ids = model.tied_copies(), None if only is None else {id(p) for p in only}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ids is None or id(p) in ids:
                p.copy_(reader.model_tensor(copies.get(name, name), p))
    return reader


def _saved_here(param, layout, dp_sharded=False, expert=False):
    """Each full tensor is saved once: data- and context-parallel replicas leave it to the first of
    them (dp x cp rank 0; unless dp_sharded: each dp x cp rank then holds a different part, ZeRO-1's
    optimizer state), tensor-parallel replicas (norms) to tp rank 0. An expert under expert
    parallelism is held by one rank of each ep group, and saved by the one in the first group (cp
    rank 0, dp_rank < ep). (A tied copy is never saved: the original is.)"""
    first = layout.cp_rank == 0 and layout.dp_rank < layout.ep if expert else layout.dp_cp_rank == 0
    if not first and not dp_sharded:
        return False
    return layout.tp_rank == 0 or getattr(param, "tp_shard_dim", None) is not None


def model_pieces(model, layout, shards=None, optimizer=None):
    """The parameters, each full tensor once. shards (ZeRO-3): {param: the flat slice of it this
    rank stores}, whose range is the optimizer state's flat_range: every data-parallel rank saves
    its own."""
    copies, experts = model.tied_copies(), model.expert_parameters()
    if shards is not None:
        return {
            name: make_piece(shards[p], p, optimizer.state[p]["flat_range"])
            for name, p in model.named_parameters()
            if name not in copies and p in shards and _saved_here(p, layout, dp_sharded=True)
        }
    return {
        name: make_piece(p, p)
        for name, p in model.named_parameters()
        if name not in copies and _saved_here(p, layout, expert=name in experts)
    }


# the tensors of an optimizer's state that are saved: AdamW's two moments, Muon's momentum
STATE_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def optimizer_pieces(optimizer, model, layout):
    """The optimizer's states, saved like the parameters they belong to. Under ZeRO-1 a state says
    which flat range of its parameter's (tensor-parallel slice's) elements this rank owns
    (parallel.ZeroOneAdamW: a slice; optim.Muon: a whole matrix, or a slice for AdamW's part): every
    data-parallel rank saves its own."""
    pieces, copies, experts = {}, model.tied_copies(), model.expert_parameters()
    for name, p in model.named_parameters():
        state = optimizer.state.get(p)
        flat_range = state.get("flat_range") if state else None
        if (
            state
            and name not in copies
            and _saved_here(p, layout, flat_range is not None, name in experts)
        ):
            pieces[name] = {
                k: make_piece(state[k], p, flat_range) for k in STATE_KEYS if k in state
            }
    return pieces


def _moment(reader, name, p, key):
    """A saved state tensor (`key`) of parameter `name`, as this rank's slice. A checkpoint written
    before every parameter got a gradient each step may lack the moments of one that never had one
    (an expert no token reached): AdamW's moments start at zero, so zero is exactly what it had."""
    if not reader.has("optimizer", name) and reader.has("model", name):
        return torch.zeros_like(p)
    return reader.optimizer_tensor(name, p, key)


def load_states(optimizer, model, reader):
    """Fill an optimizer's states (they exist before its first step) from a checkpoint saved with or
    without ZeRO: each rank assembles the full state tensors of its parameters and keeps the flat
    range it owns."""
    step, copies = torch.tensor(float(reader.meta["adam_step"])), model.tied_copies()
    for name, p in model.named_parameters():
        state = optimizer.state.get(p)
        if not state:
            continue
        start, end = state.get("flat_range", (0, p.numel()))
        for k in STATE_KEYS:
            if k in state:
                saved = _moment(reader, copies.get(name, name), p, k).reshape(-1)[start:end]
                state[k].copy_(saved.view_as(state[k]))
        if "step" in state:
            # its own: the optimizers update it in place
            state["step"] = step.to(p.device, copy=True)


def adamw_step_count(optimizer):
    """AdamW's step counter (every AdamW state has the same; Muon's momentum has none)."""
    return next((int(state["step"]) for state in optimizer.state.values() if "step" in state), 0)


def resume_run(path, cfg, run, parts, say=print):
    """Load the checkpoint at `path` (saved at any layout, or an older one: open_for_resume) into
    train.py's run and parts: model, optimizer and loss scaler. Returns (its step, the path read,
    its meta)."""
    reader = open_for_resume(path, run.model_cfg, say)
    # ZeRO-3: a unit at a time, keeping this rank's slices
    for params in parts.grad_sync.unit_by_unit() if cfg.zero_stage == 3 else [None]:
        load_model(parts.model, reader, params)
    saved_optimizer = reader.meta["config"].get("optimizer", "adamw")
    # a model converted from transformers has no optimizer state
    if reader.meta.get("converted_from"):
        say(f"a model converted from {reader.meta['converted_from']}: a fresh optimizer")
    # AdamW's moments are not Muon's momentum, nor the reverse
    elif saved_optimizer != cfg.optimizer:
        say(
            f"resume: the checkpoint's optimizer state ({saved_optimizer}) is not loaded: "
            f"{cfg.optimizer}'s starts from zero"
        )
    else:
        # assembled from whatever pieces were saved (ZeRO-1 or not, any dp): zero_stage can change
        load_states(parts.optimizer, parts.model, reader)
    parts.scaler.scale = reader.meta["loss_scale"]
    extra = reader.rank_state(run.layout.rank)
    if extra:  # RNG states only mean something for the same rank in the same world
        torch.set_rng_state(extra["torch_rng"])
        if "cuda_rng" in extra and torch.cuda.is_available():
            torch.cuda.set_rng_state(extra["cuda_rng"])
    return reader.meta["step"], reader.path, reader.meta


# -----------------------------------------------------------------------------
# Writing


class _WriteRecorder:
    """The file torch.save writes through: it computes the crc32 of the bytes as they are written
    (torch.save writes a file front to back, never seeking back, so these are the file's bytes, with
    no second read) and keeps the OSError of a failed write. torch.save reports a full disk or a
    file-size limit as a RuntimeError of its own ("unexpected pos ..."); the OSError says what
    happened (ENOSPC, EFBIG, EDQUOT)."""

    def __init__(self, f):
        self.f, self.error, self.crc = f, None, 0

    def write(self, data):
        try:
            written = self.f.write(data)
        except OSError as e:
            self.error = e
            raise
        self.crc = zlib.crc32(data, self.crc)
        return written

    def flush(self):
        return self.f.flush()


def _save_file(obj, path):
    """Write obj to path; returns the crc32 of the bytes written."""
    with open(path, "wb") as f:
        recorder = _WriteRecorder(f)
        try:
            torch.save(obj, recorder)
            f.flush()
            # on the disk before meta.json names it: a power cut (not just a crash) must not leave
            # a committed checkpoint whose files were still in the page cache
            os.fsync(f.fileno())
        except RuntimeError as e:
            raise (recorder.error or e) from None
    return recorder.crc


def _fsync_dir(path):
    """Make a folder's entries (a rename, a new file) durable, as fsync makes a file's bytes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _start_folder(tmp, final):
    """Rank 0's first move of a save: an empty tmp folder, after publishing a complete save of this
    step killed between its renames. Returns (the error, its errno) of a failure, else None."""
    try:
        if is_complete(tmp) and not is_complete(final):
            # a save of this step killed between its renames: it is this step's checkpoint
            _publish(tmp, final)
        # leftovers of a save that was killed before its meta.json
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    except OSError as e:
        return (_error(e), e.errno)
    return None


def _write_rank_file(path, contents):
    """This rank's file, written unless a weight is NaN or inf: NaN never reaches the disk (the
    gather after this stops every rank). Returns (the names of the weights that are not finite,
    the file's size, its crc32, the error of a failed write, its errno)."""
    weights = contents["model"]
    bad = [n for n, piece in weights.items() if not torch.isfinite(piece["tensor"]).all()]
    size, crc, error, code = None, None, None, None
    try:
        if not bad:
            crc = _save_file(contents, path)
            size = os.path.getsize(path)
    except (OSError, RuntimeError) as e:
        error, code = _error(e), getattr(e, "errno", None)
    return bad, size, crc, error, code


def _commit(tmp, final, meta):
    """Rank 0's last move of a save, once every rank has written: meta.json, whole or not at all
    (written aside, then renamed: the commit), then the folder renamed into place."""
    with open(os.path.join(tmp, "meta.json.partial"), "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    # the commit
    os.rename(os.path.join(tmp, "meta.json.partial"), os.path.join(tmp, "meta.json"))
    _fsync_dir(tmp)
    _publish(tmp, final)
    # the rename durable before pruning removes an older checkpoint
    _fsync_dir(os.path.dirname(final) or ".")


def save(
    out_dir,
    step,
    rank,
    world_size,
    model_pieces,
    optimizer_pieces,
    meta,
    extra=None,
    keep_last_n=0,
    keep=(),
):
    """Write this rank's pieces ({name: piece}, {name: {state_key: piece}}); the checkpoint appears
    (atomically) once every rank has written, and keep_last_n > 0 then prunes the older ones but
    `keep`. One gather tells every rank whether every write worked and every weight was finite: when
    not, every rank raises the same CheckpointError (rank 0 having removed the partial folder), none
    is left waiting in a collective for one that stopped, and the earlier checkpoints are untouched.
    """
    final = os.path.join(out_dir, f"ckpt_{step:07d}")
    tmp = final + ".tmp"
    error = _start_folder(tmp, final) if rank == 0 else None
    error = _broadcast(error)  # rank 0's, on every rank
    failed = [(0, *error)] if error else []
    name, not_finite = f"rank{rank:05d}.pt", []
    if not failed:
        contents = {"model": model_pieces, "optimizer": optimizer_pieces, "extra": extra or {}}
        bad, size, crc, error, code = _write_rank_file(os.path.join(tmp, name), contents)
        names, sizes, crcs, errors, codes, bads = zip(*_gather((name, size, crc, error, code, bad)))
        failed = [(r, e, c) for r, (e, c) in enumerate(zip(errors, codes)) if e]
        not_finite = [(r, b) for r, b in enumerate(bads) if b]
        if rank == 0 and not failed and not not_finite:
            try:
                listing = dict(files=list(names), file_sizes=list(sizes), file_crc32=list(crcs))
                meta = dict(meta, step=step, world_size=world_size, **listing, saved_at=time.time())
                _commit(tmp, final, meta)
                if keep_last_n > 0:
                    _prune(out_dir, step, keep_last_n, keep)
            except OSError as e:
                failed = [(0, _error(e), e.errno)]
        failed = _broadcast(failed)
    if failed or not_finite:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if not_finite:
            raise CheckpointError(_not_finite_message(final, step, *not_finite[0]))
        raise CheckpointError(_failed_message(out_dir, final, *failed[0]))
    return final


def _prune(out_dir, step, keep_last_n, keep):
    """Remove all but the newest keep_last_n complete checkpoints, except those in `keep`."""
    done = complete_checkpoints(out_dir)
    for old in done[:-keep_last_n]:
        if old not in keep:
            shutil.rmtree(old, ignore_errors=True)  # killed midway, it is incomplete: ignored
    # and what killed saves and removals left (no save is under way now: this one is done, and a job
    # saves one checkpoint at a time): .tmp and .old folders that are not a checkpoint, and folders
    # older than the oldest kept (an earlier removal stopped halfway through). A damaged newer
    # folder stays, for the user to see (resume names it)
    oldest = min([step_of(p) for p in done[-keep_last_n:]] + [step])
    for p in glob.glob(os.path.join(out_dir, "ckpt_*")):
        name = _LEFTOVER.fullmatch(os.path.basename(p))
        if name and p not in done and (name.group(2) or int(name.group(1)) < oldest):
            shutil.rmtree(p, ignore_errors=True)


def _not_finite_message(final, step, r, names):
    out_dir, intact = os.path.dirname(final), newest_intact(os.path.dirname(final))
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (
        f"the weights are not finite at step {step} (rank {r}: {shown}): checkpoint {final} was "
        f"not written. Either the run diverged (resume with a lower --learning_rate) or it was "
        f"given bad input (a damaged data file or checkpoint: python checkpoint.py --verify "
        f"{out_dir}). "
        + (
            f"The last finite checkpoint is {intact}: resume from it with --init_from=resume"
            if intact
            else f"No checkpoint in {out_dir} is intact: start again with --init_from=scratch"
        )
    )


def _failed_message(out_dir, final, rank, cause, code):
    """The error of a save that failed on `rank`; for a full disk or quota, which old checkpoints
    can go."""
    advice = (
        f"Free space or fix the permissions of out_dir '{out_dir}', then resume with "
        f"--init_from=resume"
    )
    if code in (errno.ENOSPC, errno.EDQUOT):
        intact = newest_intact(out_dir)
        older = [p for p in checkpoint_folders(out_dir) if intact and step_of(p) < step_of(intact)]
        if older:
            freed = sum(
                os.path.getsize(os.path.join(d, f))
                for p in older
                for d, _, fs in os.walk(p)
                for f in fs
            )
            advice = (
                f"The checkpoints older than the newest intact one ({intact}) can be deleted to "
                f"free {freed / 2**20:,.1f} MiB: rm -r {' '.join(older)}; then resume with "
                f"--init_from=resume"
            )
        else:
            advice = (
                f"No checkpoint is older than the newest intact one ({intact or 'none'}): free "
                f"space on the disk of out_dir '{out_dir}' (or give another --out_dir), then "
                f"resume with --init_from=resume"
            )
    return (
        f"saving checkpoint {final} failed on rank {rank}: {cause}. The partial {final}.tmp was "
        f"removed; the last complete checkpoint is {latest_checkpoint(out_dir) or 'none'}. "
        f"{advice}"
    )


def _publish(tmp, final):
    """Rename the complete folder tmp to final. A folder already at final (the same step saved
    again, by a run resumed from an older checkpoint) is renamed aside and removed only once the new
    one is in place: at every moment one complete copy of the step is where complete_checkpoints
    looks (ckpt_N, or ckpt_N.tmp while ckpt_N is absent), never none, and never two that could both
    be read."""
    old = final + ".old"
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def why_incomplete(path):
    """None for a complete checkpoint (its meta.json is there and every rank file has the size it
    was saved with), else what is wrong with it, in a few words."""
    if not os.path.isdir(path):
        return "it does not exist" if not os.path.exists(path) else "it is not a folder"
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        sizes = dict(zip(meta["files"], meta["file_sizes"]))
    except FileNotFoundError:
        if checkpoint_folders(path):
            return (
                "it is a run's folder, not one checkpoint: name it as out_dir, or name one of its "
                "ckpt_* folders"
            )
        return "it has no meta.json"
    except KeyError as e:
        return f"its meta.json is not a checkpoint's (it has no {e})"
    except (OSError, ValueError, TypeError) as e:
        return f"its meta.json cannot be read ({type(e).__name__}: {e})"
    for name, size in sizes.items():
        file = os.path.join(path, name)
        if not os.path.exists(file):
            return f"{name} is missing"
        if os.path.getsize(file) != size:
            return f"{name} has {os.path.getsize(file)} of its {size} bytes"
    return None


def is_complete(path):
    return why_incomplete(path) is None


def checkpoint_folders(out_dir):
    """Every ckpt_<step> folder in out_dir, complete or not, oldest first (.tmp folders of saves
    that did not finish are not among them)."""
    paths = [
        p
        for p in glob.glob(os.path.join(out_dir, "ckpt_*"))
        if re.fullmatch(r"ckpt_\d+", os.path.basename(p))
    ]
    return sorted(paths, key=lambda p: int(p.rsplit("_", 1)[1]))


_NAME = re.compile(r"ckpt_(\d+)(\.tmp)?")
_LEFTOVER = re.compile(r"ckpt_(\d+)(\.tmp|\.old)?")  # the step, and the suffix of a save's leftover


def step_of(path):
    """The step of a checkpoint folder ckpt_<step> (or ckpt_<step>.tmp)."""
    return int(_NAME.fullmatch(os.path.basename(path)).group(1))


def complete_checkpoints(out_dir):
    """The complete checkpoints in out_dir, oldest first, one per step: ckpt_N/, or ckpt_N.tmp/ when
    that one is complete and ckpt_N/ is not (a save killed after its meta.json, before its rename).
    A .tmp folder without meta.json, a folder whose rank file is short, a ckpt_N.old/ are never
    listed."""
    by_step = {}
    # ckpt_N first
    for p in sorted(glob.glob(os.path.join(out_dir, "ckpt_*")), key=lambda p: p.endswith(".tmp")):
        name = _NAME.fullmatch(os.path.basename(p))
        if name and int(name.group(1)) not in by_step and is_complete(p):
            by_step[int(name.group(1))] = p
    return [by_step[step] for step in sorted(by_step)]


def latest_checkpoint(out_dir):
    return (complete_checkpoints(out_dir) or [None])[-1]


def why_damaged(path):
    """None for an intact checkpoint (complete, and every rank file has the crc32 meta.json
    recorded; one written before checksums by its sizes alone), else what is wrong with it: reads
    every file."""
    if why := why_incomplete(path):
        return why
    meta = read_meta(path)
    return next(filter(None, (why_corrupted(path, name, meta) for name in meta["files"])), None)


def newest_intact(out_dir, before=None):
    """The newest intact checkpoint in out_dir (of a step below `before`, when given), or None: it
    reads the files of every newer damaged one, so it is for errors and --verify, not for every
    start."""
    for path in reversed(complete_checkpoints(out_dir)):
        if (before is None or step_of(path) < before) and why_damaged(path) is None:
            return path
    return None


# -----------------------------------------------------------------------------
# the checkpoint a tool names (sample.py's and export_hf.py's --ckpt)


def _damaged(out_dir):
    """' (why each ckpt_* folder in out_dir cannot be used)', or '' when it has none."""
    return "".join(
        f" ({p} cannot be used: {why_incomplete(p)})" for p in checkpoint_folders(out_dir)
    )


def find_checkpoint(ckpt, out_dir):
    """The complete checkpoint a tool's --ckpt names (sample.py, export_hf.py), or with ckpt empty
    out_dir's newest (out_dir itself when it is one checkpoint's folder). --ckpt is a checkpoint
    folder's path, its step written as saved (out/run/ckpt_0000300) or not (out/run/ckpt_300), or a
    name or step alone (ckpt_300, 300), which is looked for in out_dir. When there is none, the
    FileNotFoundError says why and lists the complete checkpoints that are there."""
    if not ckpt:
        if is_complete(out_dir):
            return out_dir
        path = latest_checkpoint(out_dir)
        if path is None:
            raise FileNotFoundError(
                f"no complete checkpoint in out_dir '{out_dir}'{_damaged(out_dir)}: train "
                f"first, or name a run's folder with --out_dir, or a checkpoint with --ckpt"
            )
        return path
    if is_complete(ckpt):
        return ckpt
    parent, name = os.path.split(os.path.normpath(ckpt))
    named = re.fullmatch(r"ckpt_(\d+)", name) or (None if parent else re.fullmatch(r"(\d+)", name))
    if named:
        # ckpt_300 is ckpt_0000300, as save() names it (7 digits, so that names sort by step)
        folder, step = parent or out_dir, int(named.group(1))
        for path in complete_checkpoints(folder):
            if step_of(path) == step:
                return path
        padded = os.path.join(folder, f"ckpt_{step:07d}")
        if os.path.exists(padded):
            why = f"{padded}: {why_incomplete(padded)}"
        else:
            why = (
                f"{folder} has no ckpt_{step:07d}"
                if os.path.isdir(folder)
                else f"{folder} does not exist"
            )
    else:
        why = why_incomplete(ckpt)
        # a run's folder: list its checkpoints
        folder = ckpt if checkpoint_folders(ckpt) else parent or "."
    done = [os.path.basename(p) for p in complete_checkpoints(folder)]
    if done:
        shown = done if len(done) <= 6 else done[:1] + ["..."] + done[-4:]
        listed = f"; the complete checkpoints in {folder} are {', '.join(shown)}"
    elif os.path.isdir(folder) and (named or checkpoint_folders(folder)):
        listed = f"; {folder} holds no complete checkpoint"
    else:
        listed = ""
    raise FileNotFoundError(
        f"--ckpt={ckpt} is not a complete checkpoint (a ckpt_* folder with its meta.json and "
        f"every rank file): {why}{listed}"
    )


# -----------------------------------------------------------------------------
# offline: python checkpoint.py --verify OUT_DIR, and the command that resumes a run


def resume_command(out_dir, world_size, per_node=None):
    """The command that resumes the run in out_dir at world_size processes, per_node of them on each
    node."""
    per_node = per_node or world_size
    launcher = (
        "python"
        if world_size == 1
        else f"torchrun --nproc_per_node={per_node}"
        + (f" --nnodes={world_size // per_node}" if world_size > per_node else "")
    )
    return f"{launcher} train.py --init_from=resume --out_dir={shlex.quote(out_dir)}"


def verify(out_dir, say=print):
    """Check every checkpoint of out_dir offline (sizes and crc32s, reading every file), say what
    each is, and name the newest intact one with the command that resumes from it. Returns the exit
    status: 0 when the newest checkpoint is intact, 1 when it is not (an older one may be, named), 2
    when out_dir holds no checkpoint."""
    paths = sorted(
        set(checkpoint_folders(out_dir)) | set(complete_checkpoints(out_dir)), key=step_of
    )
    if not paths:
        say(f"error: no checkpoint in '{out_dir}' (no ckpt_* folder): name a run's out_dir")
        return 2
    intact = None
    for path in paths:
        start, why = time.time(), why_damaged(path)
        if why is None:
            intact, meta = path, read_meta(path)
            files, size = len(meta["files"]), sum(meta["file_sizes"]) / 2**20
            why = (
                f"intact ({files} file{'s' if files > 1 else ''}, {size:,.1f} MiB, "
                f"crc32 checked in {time.time() - start:.2f} s)"
                if "file_crc32" in meta
                else "intact by its sizes (written before checksums: its bytes cannot be checked)"
            )
        say(f"{path}: {why}")
    if intact is None:
        say(f"no checkpoint in {out_dir} is intact: start again with --init_from=scratch")
        return 1
    world = read_meta(intact)["world_size"]
    newer = [p for p in paths if step_of(p) > step_of(intact)]
    say(
        f"the newest intact checkpoint is {intact} "
        f"(saved by {world} process{'es' if world > 1 else ''})"
        + (
            f", older than the damaged {', '.join(newer)}: "
            f"move {'them' if len(newer) > 1 else 'it'} aside first ("
            + "; ".join(f"mv {p} {p}.damaged" for p in newer)
            + ")"
            if newer
            else ""
        )
        + f"; resume from it with:\n  {resume_command(out_dir, world)}"
    )
    return 1 if newer else 0


def verify_main(argv):
    """python checkpoint.py --verify OUT_DIR (or --verify=OUT_DIR); returns verify's exit status."""
    if len(argv) == 2 and argv[0] == "--verify":
        return verify(argv[1])
    if len(argv) == 1 and argv[0].startswith("--verify="):
        return verify(argv[0].split("=", 1)[1])
    print(
        "usage: python checkpoint.py --verify OUT_DIR   (checks every checkpoint of a run; exit "
        "status 0 when the newest is intact, 1 when it is not, 2 when OUT_DIR holds none)",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(verify_main(sys.argv[1:]))
