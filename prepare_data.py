"""
Tokenize a text corpus into the flat token files that train.py reads.

    python prepare_data.py --dataset=NAME_OR_PATH --out_dir=DIR [--name=SUBSET] [--text_field=text]
        [--tokenizer=gpt2] [--val_fraction=F] [--max_tokens=N] [--num_proc=N] [--split=train]

--tokenizer names a tiktoken encoding, or a transformers model folder whose tokenizer.json is then
used (with the `tokenizers` package; hf_tokenizer.py), so the bins fit a model loaded with
init_from=<folder>.

With no arguments it streams FineWeb-Edu (subset sample-10BT) from the Hugging Face hub into
data/fineweb_edu. --dataset may instead be local files: a .txt, .jsonl, .json or .parquet file, a
glob of them, or a directory holding them. A .txt file is one document (none if it is empty or
blank); json and parquet files hold one document per row, in the column --text_field. A row whose
text is null or missing is skipped, and the count is printed at the end (SkippedRows says why).

Output, in out_dir:
  train.bin, val.bin  every document's tokens (tiktoken's encode_ordinary) followed by the
                      end-of-text token, all concatenated: read them with
                      np.memmap(path, dtype=meta['dtype'], mode='r')
  meta.json           tokenizer, vocab_size, dtype, eot_token, token and document counts, source

Validation split: each document goes to val or train by a stable hash of its index in the stream
(see is_val), so about val_fraction of the documents are held out, the same ones on every run
whatever the batch size or process count; document 0 always goes to train and document 1 to val.
--max_tokens caps train+val tokens exactly: reading stops there and the last document is cut short,
without its EOT.

The corpus is read in batches of documents, the batches are tokenized on all cores, and each is
appended to the open output files as it comes back, so memory stays flat however large the corpus
is. The bins are written under temporary names and meta.json comes last: a directory with a
meta.json is complete.

Bad input (a missing path, an empty, malformed or non-UTF-8 file, a wrong --text_field, a hub or
tokenizer download that fails offline) ends in one line, `error: ...`, that names the file or
setting and what to do; out_dir is left as it was, with no temporary files and an earlier run's
output untouched.
"""

import argparse
import glob
import itertools
import json
import logging
import os
import sys
import time
from collections import deque
from contextlib import closing, contextmanager
import multiprocessing
import socket
import urllib.parse
import urllib.request

import datasets
import huggingface_hub
import numpy as np
import pyarrow  # datasets reads json and parquet files with pyarrow, and lets its errors through

import hf_tokenizer

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None

DEFAULT_DATASET = "HuggingFaceFW/fineweb-edu"
DEFAULT_NAME = "sample-10BT"
# where config/tiny_fineweb.py (the quick start) reads its data_dir
DEFAULT_OUT_DIR = "data/fineweb_edu"
# file suffix -> the datasets builder that reads it
LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
VAL_SEED = 1337

# -----------------------------------------------------------------------------
# tokenizer

get_encoding = hf_tokenizer.get_encoding  # a tiktoken encoding or a model folder's tokenizer


def token_dtype(n_vocab):
    # ids run from 0 to n_vocab-1, so 16 bits hold any vocabulary of up to 2**16 tokens (GPT-2 has
    # 50,257) and halve the files; bigger vocabularies (cl100k_base, o200k_base) need 32 bits
    return np.uint16 if n_vocab <= 2**16 else np.uint32


# each worker process's own encoder, built once by the pool initializer rather than per batch
_enc = None


def init_worker(tokenizer):
    global _enc
    _enc = get_encoding(tokenizer)


def tokenize_batch(texts):
    """One batch of documents -> (all their tokens, each document followed by EOT, as one flat
    array; each document's length including its EOT). One flat array is far cheaper to send back to
    the parent than a list of lists."""
    docs = [_enc.encode_ordinary(text) + [_enc.eot_token] for text in texts]
    lengths = np.array([len(doc) for doc in docs], dtype=np.int64)
    flat = (t for doc in docs for t in doc)
    tokens = np.fromiter(flat, dtype=token_dtype(_enc.n_vocab), count=int(lengths.sum()))
    return tokens, lengths


# -----------------------------------------------------------------------------
# reading documents


def local_files(dataset):
    """(builder, sorted file list) when `dataset` names local files, None when it names a hub
    dataset."""
    kinds = ", ".join(LOCAL_BUILDERS)
    is_glob = any(c in dataset for c in "*?[")
    if os.path.isdir(dataset):
        files = glob.glob(os.path.join(dataset, "**", "*"), recursive=True)
    elif os.path.splitext(dataset)[1] in LOCAL_BUILDERS or is_glob:
        files = glob.glob(dataset, recursive=True)
    elif os.path.exists(dataset):
        raise ValueError(
            f"--dataset={dataset!r} is a file of a type this script does not read; use {kinds}"
        )
    elif "/" not in dataset or dataset.startswith((".", "/")):
        raise FileNotFoundError(
            f"--dataset={dataset!r}: no such file or directory, and not a hub dataset name "
            f"(owner/name)"
        )
    else:
        return None
    files = sorted(
        f for f in files if os.path.isfile(f) and os.path.splitext(f)[1] in LOCAL_BUILDERS
    )
    if not files:
        if os.path.isdir(dataset):
            raise FileNotFoundError(
                f"--dataset={dataset!r} is a directory with no {kinds} file in it"
            )
        if is_glob:
            raise FileNotFoundError(f"--dataset={dataset!r} matches no {kinds} file")
        raise FileNotFoundError(f"--dataset={dataset!r}: no such file")
    builders = {LOCAL_BUILDERS[os.path.splitext(f)[1]] for f in files}
    if len(builders) > 1:
        raise ValueError(
            f"--dataset={dataset!r} mixes file types ({', '.join(sorted(builders))}); "
            f"pass a glob of one type"
        )
    return builders.pop(), files


def document_text(row, text_field, source):
    """The row's text, or None for a row without any (its field null, or missing where other rows
    have it)."""
    if text_field not in row:
        raise ValueError(
            f"--text_field={text_field!r} is not a column of {source}; its columns are {list(row)}"
        )
    text = row[text_field]
    if text is None:
        return None
    if not isinstance(text, str):
        raise ValueError(
            f"--text_field={text_field!r} of {source} holds {type(text).__name__} values, not text "
            f"(such as {text!r:.60})"
        )
    return text


class SkippedRows:
    """The rows that hold no text (their field null, or missing where other rows have it): skipped
    and counted, not written as empty documents (a lone EOT) nor stopped at. Skipped rather than an
    error because real corpora (parquet shards, hub datasets) have the odd null text, and one row in
    millions should not end a run of hours; counted because a misnamed field or a broken export must
    not pass in silence: prepare() prints how many there were and where the first one is, and
    meta.json records the count."""

    def __init__(self):
        self.count, self.first = 0, None

    def add(self, source, row):
        self.count += 1
        if self.first is None:
            self.first = (source, row)

    def where_first(self):
        source, row = self.first
        if source.endswith(".jsonl"):  # rows are the file's non-blank lines
            with open(source, encoding="utf-8", errors="replace") as f:
                nonblank = (n for n, line in enumerate(f, 1) if line.strip())
                return f"{source}, line {next(itertools.islice(nonblank, row - 1, None))}"
        return f"{source}, row {row}"


def first_bad_json_line(path):
    """'line N ...' for the first line of a JSON-lines file that is not a JSON object, or None.
    pyarrow's error counts rows within the block it was parsing, not lines of the file, so the file
    is read again to find it."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                # without its newline, so that colno counts within the line
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                return f"line {n} is not JSON ({e.msg} at column {e.colno})"
            if not isinstance(row, dict):
                return f"line {n} is a JSON {type(row).__name__}, not an object"
    return None


def local_texts(builder, files, split, text_field, skipped):
    """Every document's text, file by file in path order. Each file is its own datasets stream, so
    that an error can name the file it is in, and json or parquet files may differ in their other
    columns (one stream over them all casts every file to the first one's columns and fails on the
    others). Opening a stream per file costs little: about 0.6 s more than one stream over 1,000
    small files."""
    # the text builder's default is one row per line
    extra = {"sample_by": "document"} if builder == "text" else {}
    for path in files:
        # datasets reads lazily, so a file's problems surface while iterating as well as when
        # opening it; streamed, they come as they are, not wrapped in a DatasetGenerationError
        try:
            rows = datasets.load_dataset(
                builder, data_files=[path], split=split, streaming=True, **extra
            )
            for n, row in enumerate(rows, 1):
                text = document_text(row, text_field, path)
                if text is None:
                    skipped.add(path, n)
                # a .txt file of nothing or blank lines holds no document
                elif builder != "text" or text.strip():
                    yield text
        except StopIteration:
            # the json builder reads a file's first rows to learn its columns, and an empty file has
            # none: it holds no documents (prepare() fails if no file holds any)
            continue
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{path} is not UTF-8 text (it holds the byte {e.object[e.start]:#04x}: "
                f"{e.reason}); is it a binary file? prepare_data.py reads text files as UTF-8"
            ) from e
        except pyarrow.ArrowInvalid as e:
            # only a .jsonl file is one value per line; a .json value may span many lines
            bad_line = first_bad_json_line(path) if path.endswith(".jsonl") else None
            if bad_line:
                raise ValueError(
                    f"{path}: {bad_line}; a .jsonl file holds one JSON object per line, "
                    f'like {{"text": "..."}}'
                ) from e
            raise ValueError(f"{path} cannot be read as {builder} ({e})") from e


def why_hub_unreachable(timeout=3.0):
    """None when the Hub's host (HF_ENDPOINT, else huggingface.co) accepts a connection, else why
    not. Without this, datasets retries each request five times, backing off to 8 s, before it says
    it cannot connect: ~25 s offline for an error that is known in one."""
    if datasets.config.HF_HUB_OFFLINE:
        return None  # datasets fails at once itself, or uses its cache
    if urllib.request.getproxies().get("https"):
        return None  # reached through a proxy: that a direct connection fails says nothing
    url = urllib.parse.urlsplit(huggingface_hub.constants.ENDPOINT)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:  # socket.gaierror (the name does not resolve), a refusal, a timeout
        return f"{host}:{port} cannot be reached ({type(e).__name__}: {e})"
    return None


def hub_texts(rows, text_field, dataset, skipped):
    for n, row in enumerate(rows, 1):
        text = document_text(row, text_field, dataset)
        if text is None:
            skipped.add(dataset, n)
        else:
            yield text


def load_documents(dataset, name, split, text_field, skipped=None):
    """Every document's text, in order, read lazily; the rows without text are counted in `skipped`
    (a SkippedRows). What can be checked before reading is checked now: a missing path, an
    unreachable hub."""
    skipped = SkippedRows() if skipped is None else skipped
    # always streamed: the hub default is far too big to download first, and streaming local files
    # also skips datasets' Arrow cache, which would be a second full copy of the corpus on disk
    local = local_files(dataset)
    if local is None:
        offline = (
            f"Offline, tokenize local files instead: --dataset=PATH, a "
            f"{', '.join(LOCAL_BUILDERS)} file, a glob of them or a directory"
        )
        why = why_hub_unreachable()
        if why:
            raise ConnectionError(
                f"--dataset={dataset!r} is a Hugging Face hub dataset, and the hub {why}. {offline}"
            )
        try:
            rows = datasets.load_dataset(dataset, name=name, split=split, streaming=True)
        except ConnectionError as e:
            # datasets' own, when the hub cannot be reached or HF_HUB_OFFLINE is set
            raise ConnectionError(f"--dataset={dataset!r}: {e}. {offline}") from e
        return hub_texts(rows, text_field, dataset, skipped)
    if name is not None:
        raise ValueError(
            f"--name={name!r} selects a subset of a hub dataset; local files {dataset!r} have none"
        )
    builder, files = local
    return local_texts(builder, files, split, text_field, skipped)


def text_batches(texts, batch_docs):
    batch = []
    for text in texts:
        batch.append(text)
        if len(batch) == batch_docs:
            yield batch
            batch = []
    if batch:
        yield batch


def tokenized_batches(batches, tokenizer, num_proc):
    """Tokenize batches on num_proc processes, yielding results in input order."""
    if num_proc == 1:
        init_worker(tokenizer)
        yield from map(tokenize_batch, batches)
        return
    # not Pool.imap: its feeder thread pulls batches from the reader as fast as it can, so when
    # reading outpaces tokenizing the whole corpus piles up in memory. Two batches in flight per
    # worker keep every worker busy and memory flat. spawn, not fork: a process forked while its
    # parent has threads running (torch's, a reader's) can inherit a lock held by one of them and
    # wait on it forever
    with multiprocessing.get_context("spawn").Pool(
        num_proc, initializer=init_worker, initargs=(tokenizer,)
    ) as pool:
        pending = deque()
        for batch in batches:
            pending.append(pool.apply_async(tokenize_batch, (batch,)))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def is_val(doc_index, val_fraction):
    """Which documents go to val, from their position in the stream alone, so the split does not
    depend on the batch size, the number of processes, or Python's per-run randomized hash()."""
    # splitmix64's mixing function (Steele, Lea, Flood 2014) turns consecutive indices into 64
    # well-mixed bits; the top 53 are a uniform draw in [0, 1) that falls below val_fraction with
    # that probability
    x = (doc_index.astype(np.uint64) + np.uint64(VAL_SEED)) * np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    val = (x >> np.uint64(11)).astype(np.float64) / 2**53 < val_fraction
    # a small corpus could draw no val document at all, or only val ones: document 0 always goes to
    # train and document 1 to val, so any corpus of two or more documents has both splits
    val[doc_index == 0] = False
    val[doc_index == 1] = val_fraction > 0
    return val


# -----------------------------------------------------------------------------
# writing the bins


def write_bins(stream, f_train, f_val, val_fraction, max_tokens, bar):
    """Append each tokenized batch's documents to the train or val file (is_val), stopping exactly
    at max_tokens; show the progress. Returns ({split: tokens}, {split: documents})."""
    split_tokens, split_docs = {"train": 0, "val": 0}, {"train": 0, "val": 0}
    n_docs = n_tokens = 0
    t0 = last_print = time.time()
    for tokens, lengths in stream:
        if max_tokens is not None and n_tokens + len(tokens) > max_tokens:
            # cut exactly at the cap: later documents dropped, the last one kept cut short, no EOT
            keep = max_tokens - n_tokens
            # the documents that start before the cap
            n_keep = int(np.count_nonzero(np.cumsum(lengths) - lengths < keep))
            tokens, lengths = tokens[:keep], lengths[:n_keep].copy()
            lengths[-1] -= lengths.sum() - keep
        val_docs = is_val(np.arange(n_docs, n_docs + len(lengths)), val_fraction)
        val_tokens = np.repeat(val_docs, lengths)
        tokens[~val_tokens].tofile(f_train)
        tokens[val_tokens].tofile(f_val)
        split_tokens["val"] += int(val_tokens.sum())
        split_tokens["train"] += len(tokens) - int(val_tokens.sum())
        split_docs["val"] += int(val_docs.sum())
        split_docs["train"] += len(lengths) - int(val_docs.sum())
        n_docs += len(lengths)
        n_tokens += len(tokens)
        now = time.time()
        if bar is not None:
            bar.update(len(lengths))
            bar.set_postfix_str(
                f"{n_tokens:,} tokens, {n_tokens / (now - t0):,.0f} tokens/s", refresh=False
            )
        elif now - last_print > 10:
            print(
                f"{n_docs:,} docs, {n_tokens:,} tokens, {n_docs / (now - t0):,.0f} docs/s, "
                f"{n_tokens / (now - t0):,.0f} tokens/s",
                file=sys.stderr,
            )
            last_print = now
        if max_tokens is not None and n_tokens >= max_tokens:
            break
    return split_tokens, split_docs


def settings_with_defaults(dataset, name, val_fraction, max_tokens):
    """(name, val_fraction) with their defaults for `dataset` filled in; a value out of range is
    refused before anything is read."""
    if dataset == DEFAULT_DATASET and name is None:
        name = DEFAULT_NAME
    if val_fraction is None:
        # FineWeb-Edu's ~10M documents give 5M val tokens at 0.05%; a small corpus needs more
        val_fraction = 0.0005 if dataset == DEFAULT_DATASET else 0.005
    if not 0 <= val_fraction < 1:
        raise ValueError(f"--val_fraction={val_fraction} must be in [0, 1)")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"--max_tokens={max_tokens} must be positive (leave it out for no cap)")
    return name, val_fraction


@contextmanager
def out_dir_kept_on_failure(paths, bar):
    """A failed run, Ctrl-C included, leaves out_dir as it found it: no half-written .tmp files, and
    the bins and meta.json of an earlier run untouched (publish replaces them only once all is
    read). The progress bar is closed either way."""
    try:
        yield
    except BaseException:
        for path in paths.values():
            if os.path.exists(path + ".tmp"):
                os.remove(path + ".tmp")
        if bar is not None:
            # closing erases the bar, so that the error is the one line left on the terminal
            bar.leave = False
        raise
    finally:
        if bar is not None:
            bar.close()


def prepare(
    dataset=DEFAULT_DATASET,
    out_dir=DEFAULT_OUT_DIR,
    name=None,
    text_field="text",
    tokenizer="gpt2",
    val_fraction=None,
    max_tokens=None,
    num_proc=None,
    split="train",
    chunk_docs=1024,
):
    """Tokenize `dataset` into out_dir/{train.bin, val.bin, meta.json} (see the top of this file);
    returns meta."""
    name, val_fraction = settings_with_defaults(dataset, name, val_fraction, max_tokens)
    num_proc = num_proc or os.cpu_count()
    enc = get_encoding(tokenizer)  # a bad name fails here, before any data is read
    # a model folder's tokenizer is recorded by its absolute path, or as the tiktoken one it is
    tokenizer = enc.name
    skipped = SkippedRows()
    texts = load_documents(dataset, name, split, text_field, skipped)

    os.makedirs(out_dir, exist_ok=True)
    paths = {s: os.path.join(out_dir, f"{s}.bin") for s in ("train", "val")}
    bar = tqdm(desc="tokenizing", unit=" docs", file=sys.stderr) if tqdm else None
    t0 = time.time()
    with out_dir_kept_on_failure(paths, bar):
        batches = tokenized_batches(text_batches(texts, chunk_docs), tokenizer, num_proc)
        with (
            open(paths["train"] + ".tmp", "wb") as f_train,
            open(paths["val"] + ".tmp", "wb") as f_val,
            closing(batches) as stream,
        ):
            split_tokens, split_docs = write_bins(
                stream, f_train, f_val, val_fraction, max_tokens, bar
            )
        if sum(split_docs.values()) == 0:
            raise ValueError(
                f"--dataset={dataset!r} holds no documents (empty, or only blank lines"
                + (f"; its {skipped.count:,} rows have no {text_field!r}" if skipped.count else "")
                + ")"
            )
    elapsed = time.time() - t0

    meta = {
        "tokenizer": tokenizer,
        "vocab_size": enc.n_vocab,
        "dtype": np.dtype(token_dtype(enc.n_vocab)).name,
        "eot_token": enc.eot_token,
        "train_tokens": split_tokens["train"],
        "val_tokens": split_tokens["val"],
        "train_docs": split_docs["train"],
        "val_docs": split_docs["val"],
        "val_fraction": val_fraction,
        "max_tokens": max_tokens,
        "skipped_rows": skipped.count,
        "source": {"dataset": dataset, "name": name, "split": split, "text_field": text_field},
    }
    publish(paths, os.path.join(out_dir, "meta.json"), meta)
    print_summary(meta, out_dir, elapsed, skipped)
    return meta


def publish(paths, meta_path, meta):
    """Move the new bins (written beside them as .tmp) over out_dir's, then write meta.json."""
    # the old meta.json goes first: a crash between the renames never leaves new bins beside it
    if os.path.exists(meta_path):
        os.remove(meta_path)
    for path in paths.values():
        os.replace(path + ".tmp", path)
    with open(meta_path + ".tmp", "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(meta_path + ".tmp", meta_path)


def print_summary(meta, out_dir, elapsed, skipped):
    n_docs = meta["train_docs"] + meta["val_docs"]
    n_tokens = meta["train_tokens"] + meta["val_tokens"]
    print(
        f"wrote {n_tokens:,} {meta['tokenizer']} tokens from {n_docs:,} documents to {out_dir} "
        f"in {elapsed:.1f}s ({n_docs / elapsed:,.0f} docs/s, {n_tokens / elapsed:,.0f} tokens/s)"
    )
    for s in ("train", "val"):
        tokens, docs = meta[s + "_tokens"], meta[s + "_docs"]
        print(f"  {s}.bin: {tokens:,} tokens, {docs:,} documents ({meta['dtype']})")
    if skipped.count:
        field = meta["source"]["text_field"]
        print(
            f"  skipped {skipped.count:,} row(s) with no {field!r} (null, or missing): the first "
            f"is {skipped.where_first()}"
        )
    if meta["val_docs"] == 0 and meta["val_fraction"] > 0:
        # np.memmap cannot open an empty file, so say it here rather than leave train.py to find out
        local = local_files(meta["source"]["dataset"])
        more = (
            "a .txt file is one document: split the text into several files"
            if local and local[0] == "text"
            else "each row is one document: add rows"
        )
        print(
            f"  note: val.bin is empty: {n_docs} document(s) is too few to hold any out; {more} "
            "to get a val split."
        )
    print(f"train on it: python train.py config/tiny_fineweb.py --data_dir={out_dir}")


def argument_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument(
        "--dataset",
        default=DEFAULT_DATASET,
        help=f"hub dataset name, or a local file, glob or directory (default {DEFAULT_DATASET})",
    )
    parser.add_argument(
        "--out_dir",
        default=None,
        help=f"where train.bin, val.bin and meta.json are written, replacing those there (default "
        f"{DEFAULT_OUT_DIR}, the data_dir of config/tiny_fineweb.py)",
    )
    parser.add_argument(
        "--name", default=None, help=f"hub subset (default {DEFAULT_NAME} for {DEFAULT_DATASET})"
    )
    parser.add_argument(
        "--text_field",
        default="text",
        help="column holding the text (json, parquet, hub; default text)",
    )
    parser.add_argument(
        "--tokenizer",
        default="gpt2",
        help="a tiktoken encoding name, or a transformers model folder with tokenizer.json "
        "(default gpt2)",
    )
    parser.add_argument(
        "--val_fraction",
        type=float,
        default=None,
        help="share of documents held out for val (default 0.0005 for FineWeb-Edu, else 0.005)",
    )
    parser.add_argument(
        "--max_tokens",
        type=int,
        default=None,
        help="stop after this many tokens, train + val (default: no cap)",
    )
    parser.add_argument(
        "--num_proc", type=int, default=None, help="tokenizer processes (default: all cores)"
    )
    parser.add_argument(
        "--split", default="train", help="the split of the dataset to read (default train)"
    )
    return parser


def main(argv):
    args = argument_parser().parse_args(argv)
    if args.out_dir is None:
        args.out_dir = DEFAULT_OUT_DIR
        if args.dataset != DEFAULT_DATASET:
            # the default is named for FineWeb-Edu: a corpus of one's own written there replaces it
            print(
                f"no --out_dir given: writing to {DEFAULT_OUT_DIR}, the default, which "
                f"config/tiny_fineweb.py reads (pass --out_dir=DIR to write elsewhere)"
            )
    # on a malformed json or parquet file datasets logs a line of its own before raising; the error
    # below names the file and the line, so datasets' line would only repeat it, less exactly
    for builder in ("json", "parquet"):
        logger = logging.getLogger(f"datasets.packaged_modules.{builder}.{builder}")
        logger.setLevel(logging.CRITICAL)
    try:
        prepare(**vars(args))
    except (ValueError, OSError) as e:
        # what prepare() raises about its input and settings (OSError: a missing path, no network,
        # a full disk) names the file or setting and what to do; a traceback would bury it
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
