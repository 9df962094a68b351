"""
The training data: token bins (prepare_data.py writes them) read as windows of block_size + 1
tokens, each step's windows a pure function of (seed, stream, step), so every layout sees the same
global batch and a resumed run the batches it would have seen; each rank then takes its share (its
data-parallel slice of the windows, its context-parallel share of each window). train.py reads its
batches here.
"""

import json
import os

import numpy as np
import torch

from context_parallel import split_for_every_rank, zigzag_split
from model import document_ids_and_positions


class DataError(ValueError):
    pass


def _prepare_hint(data_dir):
    # the plain command streams FineWeb-Edu from the hub: offline, local text is what a user has
    return (
        f"run: python prepare_data.py --out_dir={data_dir} (streams FineWeb-Edu: needs the "
        f"network), or without a network, from local text: python prepare_data.py --dataset=PATH "
        f"--out_dir={data_dir} (PATH a .txt, .jsonl or .parquet file, a glob or a folder; see the "
        f"README)"
    )


def read_data_meta(data_dir):
    meta_path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(meta_path):
        raise FileNotFoundError(
            f"no meta.json in data_dir '{data_dir}': the token bins have not been prepared; "
            f"{_prepare_hint(data_dir)}"
        )
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        meta["dtype"], meta["vocab_size"]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(
            f"{meta_path} is corrupt ({type(e).__name__}: {e}): {_prepare_hint(data_dir)}"
        )
    return meta


def load_data(data_dir, split, block_size, vocab_size, meta):
    """Open <data_dir>/<split>.bin as a memmap, after checking that it is there and makes sense.
    Returns (path, dtype, number of tokens, vocab_size): what get_batch needs."""
    hint, meta_path = _prepare_hint(data_dir), os.path.join(data_dir, "meta.json")
    path = os.path.join(data_dir, f"{split}.bin")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {split}.bin in data_dir '{data_dir}'; {hint}")
    if meta.get("dtype") not in ("uint16", "uint32"):
        raise DataError(
            f"{meta_path} says dtype {meta.get('dtype')!r}; expected 'uint16' or 'uint32'. {hint}"
        )
    itemsize = np.dtype(meta["dtype"]).itemsize
    size = os.path.getsize(path)
    if size % itemsize:
        raise DataError(
            f"{path} has {size} bytes, not a whole number of {meta['dtype']} tokens: the file is "
            f"corrupt or was written with another dtype; {hint}"
        )
    if size // itemsize < block_size + 1:
        raise DataError(
            f"{path} has {size // itemsize} tokens, fewer than block_size + 1 = {block_size + 1}: "
            f"prepare more text or lower block_size"
        )
    data = np.memmap(path, dtype=meta["dtype"], mode="r")
    # a quick look at both ends catches bins of another tokenizer or dtype at once; every batch is
    # checked again where it is read (read_windows), since one bad id in the middle would do the
    # same harm
    sample = np.concatenate([data[: 1 << 20], data[-(1 << 20) :]])
    if sample.max() >= vocab_size:
        raise DataError(
            f"{path} holds token id {int(sample.max())} but the vocabulary has {vocab_size} "
            f"tokens: the bins do not match meta.json (dtype {meta['dtype']}) or the vocab_size "
            f"setting; {hint}"
        )
    # a bin cut short at a whole token (a copy stopped, a full disk) looks sound but for its length,
    # which prepare_data.py records; checked after the ids, so that bins of another tokenizer are
    # named as such whatever their length (a meta.json written by hand may not record the count)
    recorded = meta.get(f"{split}_tokens")
    if recorded is not None and recorded != len(data):
        raise DataError(
            f"{path} has {len(data):,} tokens but {meta_path} records {split}_tokens = "
            f"{recorded:,}: the file was cut short or changed after prepare_data.py "
            f"wrote it. To prepare it again, {hint}"
        )
    return path, meta["dtype"], len(data), vocab_size


TRAIN_STREAM, EVAL_STREAM = 0, 1


def window_starts(seed, stream, step, n_tokens, block_size, n_windows):
    """Where each of the n_windows windows of a step starts: a pure function of (seed, stream,
    step). Evaluation draws from its own stream, so its batches are fixed and independent of
    training's."""
    rng = np.random.default_rng([seed, stream, step])
    return rng.integers(0, n_tokens - block_size, size=n_windows)


def read_windows(data, starts, block_size):
    """The token windows at `starts`, (len(starts), block_size + 1), checked on the host: an id
    outside the vocabulary would crash the embedding at tp = 1, and at tp > 1 the vocab-parallel one
    would silently read zeros."""
    path, dtype, _, vocab_size = data
    # a fresh memmap per batch: keeping one open leaks memory (nanoGPT's note on np.memmap)
    tokens = np.memmap(path, dtype=dtype, mode="r")
    windows = np.stack([tokens[s : s + block_size + 1] for s in starts])
    if windows.max() >= vocab_size:
        row, col = np.unravel_index(int(windows.argmax()), windows.shape)
        raise DataError(
            f"{path} holds token id {int(windows[row, col])} at token offset "
            f"{int(starts[row]) + col}, outside the vocabulary of {vocab_size}: the file is "
            f"corrupt or was written by another tokenizer; {_prepare_hint(os.path.dirname(path))}"
        )
    return windows


def get_batch(data, starts, block_size, device, layout=None, eot_token=None):
    """A micro-batch of the windows at `starts`, checked by read_windows, as the model takes it
    (context_split; layout None: one process): its token ids and targets on the device; positions
    and document ids, when there are any, on the host."""
    windows = torch.from_numpy(read_windows(data, starts, block_size).astype(np.int64))
    x, *rest = context_split((windows[:, :-1], windows[:, 1:]), layout, eot_token)
    if device.type == "cuda":  # pinned memory lets the copy overlap the GPU's work
        x, y = (
            x.pin_memory().to(device, non_blocking=True),
            rest[0].pin_memory().to(device, non_blocking=True),
        )
    else:
        x, y = x.to(device), rest[0].to(device)
    return (x, y, *rest[1:])


def context_split(batch, layout, eot_token=None):
    """This context-parallel rank's share of a micro-batch of whole windows (x, y), (B, T) each: its
    two zigzag chunks of every window (context_parallel.py), and every cp rank's global token
    positions, (cp, B, T/cp) on the host, built from the whole window and split the same way.
    Without context parallelism the micro-batch as it is (the model then counts positions from 0
    itself). With eot_token (doc_mask=True) the positions restart at each document, and each token's
    document id comes after them, split the same way: (x, y, positions, documents); without context
    parallelism positions and documents are (B, T). Built from x on the host (a device x is copied
    back: a sync)."""
    cp = layout.cp if layout is not None else 1
    if cp == 1 and eot_token is None:
        return batch
    x, y = batch
    if eot_token is None:
        # (B, T): each window's own positions
        positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        extra = (positions,)
    else:
        documents, positions = document_ids_and_positions(x.cpu(), eot_token)  # (B, T) each
        extra = (positions, documents)
    if cp == 1:
        return (x, y, *extra)
    return (
        zigzag_split(x, cp, layout.cp_rank),
        zigzag_split(y, cp, layout.cp_rank),
        *(split_for_every_rank(e, cp) for e in extra),
    )


def document_end(model_cfg):
    """The end-of-text id the batches are cut into documents at: the model's eot_token under
    doc_mask, else None (no document ids)."""
    return model_cfg.eot_token if model_cfg.doc_mask else None


def rank_microbatches(cfg, layout, data, stream, step, n_micro, device, eot_token=None):
    """This data-parallel rank's n_micro micro-batches of a step. The step's global batch is
    batch_size * n_micro * dp windows; dp rank r takes the r-th contiguous slice of it, so the same
    windows are seen whatever the layout. Under context parallelism each is this cp rank's share,
    (x, y, positions) (context_split); with eot_token (document_end) positions and document ids too.

    Every rank checks the token ids of the whole global batch, not only its slice: a bad id then
    stops every rank at the same step with the same message, with no collective, and no rank is left
    waiting for one that stopped (the extra read is the other ranks' windows, from the page cache,
    on the host)."""
    per_rank = cfg.batch_size * n_micro
    starts = window_starts(cfg.seed, stream, step, data[2], cfg.block_size, per_rank * layout.dp)
    mine = slice(layout.dp_rank * per_rank, (layout.dp_rank + 1) * per_rank)
    if layout.dp > 1:
        read_windows(data, np.delete(starts, mine), cfg.block_size)
    starts = starts[mine]
    return [
        get_batch(
            data,
            starts[i * cfg.batch_size : (i + 1) * cfg.batch_size],
            cfg.block_size,
            device,
            layout,
            eot_token,
        )
        for i in range(n_micro)
    ]
