"""prepare_data.py: documents in, EOT-separated token files out, every document exactly once.

The reference for every check is tiktoken itself (encode_ordinary on each document, plus the EOT
token), never prepare_data's own helpers.
"""

import hashlib
import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pytest
import tiktoken

import prepare_data
from conftest import ROOT, gpt2_encoding, needs_gpt2, shared_file

DOCS = [
    "First document.",
    "Unicode: naïve café, Ωμέγα, 日本語のテキスト, emoji 🙂🚀.",
    "A document that mentions <|endoftext|> as plain text must not be split there.",
    "",  # an empty document is still a document: a lone EOT
    "Line one\nLine two\n\n  indented line\ttab",
    "Zero-width joiner: 👩\u200d💻 and combining e\u0301.",
    "Last one, with a trailing newline.\n",
]


def write_jsonl(path, docs, field="text"):
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({field: d}, ensure_ascii=False) + "\n")
    return path


def numbered_docs(n):
    return [f"Document number {i}: " + "word " * (i % 7) + "é" * (i % 3) for i in range(n)]


def read_out(out_dir):
    out_dir = Path(out_dir)
    meta = json.loads((out_dir / "meta.json").read_text())
    return (
        meta,
        read_bin(out_dir / "train.bin", meta["dtype"]),
        read_bin(out_dir / "val.bin", meta["dtype"]),
    )


def read_bin(path, dtype):
    # the way train.py reads it; np.memmap refuses an empty file, which val.bin is when nothing was
    # held out
    return (
        np.array(np.memmap(path, dtype=dtype, mode="r"))
        if os.path.getsize(path)
        else np.array([], dtype=dtype)
    )


def decode_docs(tokens):
    """Split a token file on EOT and decode each piece; every document must end with its EOT."""
    enc, tokens = gpt2_encoding(), tokens.tolist()
    assert not tokens or tokens[-1] == enc.eot_token
    docs, start = [], 0
    for i, t in enumerate(tokens):
        if t == enc.eot_token:
            docs.append(enc.decode(tokens[start:i]))
            start = i + 1
    return docs


def stream_tokens(docs):
    enc = gpt2_encoding()
    return [t for d in docs for t in enc.encode_ordinary(d) + [enc.eot_token]]


@needs_gpt2
def test_round_trip_gives_back_every_document_exactly_once(tmp_path):
    src = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    prepare_data.prepare(str(src), str(tmp_path / "out"), val_fraction=0.3, num_proc=1)
    meta, train, val = read_out(tmp_path / "out")
    train_docs, val_docs = decode_docs(train), decode_docs(val)
    assert Counter(train_docs + val_docs) == Counter(DOCS)
    assert train_docs and val_docs
    # each split keeps the corpus order
    assert train_docs == [d for d in DOCS if d in train_docs]
    assert (
        meta["train_tokens"] == len(train) == os.path.getsize(tmp_path / "out" / "train.bin") // 2
    )
    assert meta["val_tokens"] == len(val) == os.path.getsize(tmp_path / "out" / "val.bin") // 2
    assert (meta["train_docs"], meta["val_docs"]) == (len(train_docs), len(val_docs))
    assert meta["train_tokens"] + meta["val_tokens"] == len(stream_tokens(DOCS))
    assert meta["source"] == {
        "dataset": str(src),
        "name": None,
        "split": "train",
        "text_field": "text",
    }
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot_token"]) == ("gpt2", 50257, 50256)
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_token_dtype_is_the_smallest_that_holds_every_id():
    assert prepare_data.token_dtype(50257) == np.uint16
    assert prepare_data.token_dtype(2**16) == np.uint16  # largest id 65535 still fits
    assert prepare_data.token_dtype(2**16 + 1) == np.uint32
    assert prepare_data.token_dtype(100277) == np.uint32  # cl100k_base


@needs_gpt2
def test_gpt2_is_written_as_uint16(tmp_path):
    prepare_data.prepare(
        str(write_jsonl(tmp_path / "d.jsonl", DOCS)), str(tmp_path / "out"), num_proc=1
    )
    meta, train, val = read_out(tmp_path / "out")
    assert meta["dtype"] == "uint16"
    assert os.path.getsize(tmp_path / "out" / "train.bin") == 2 * meta["train_tokens"]


@needs_gpt2
def test_a_large_vocabulary_is_written_as_uint32(tmp_path, monkeypatch):
    # cl100k_base is not in the offline cache, so pretend gpt2 needed 32-bit ids
    monkeypatch.setattr(prepare_data, "token_dtype", lambda n_vocab: np.uint32)
    prepare_data.prepare(
        str(write_jsonl(tmp_path / "d.jsonl", DOCS)),
        str(tmp_path / "out"),
        val_fraction=0,
        num_proc=1,
    )
    meta, train, val = read_out(tmp_path / "out")
    assert meta["dtype"] == "uint32"
    assert os.path.getsize(tmp_path / "out" / "train.bin") == 4 * meta["train_tokens"]
    assert train.tolist() == stream_tokens(DOCS)


@needs_gpt2
def test_chunking_and_processes_do_not_change_the_output(tmp_path):
    src = str(write_jsonl(tmp_path / "d.jsonl", numbered_docs(30)))
    runs = {
        "one_chunk": dict(chunk_docs=1024, num_proc=1),
        "chunks_of_4": dict(chunk_docs=4, num_proc=1),
        "chunks_of_4_on_2_procs": dict(chunk_docs=4, num_proc=2),
    }
    for run, kwargs in runs.items():
        prepare_data.prepare(src, str(tmp_path / run), val_fraction=0.2, **kwargs)
    files = {
        run: {f: (tmp_path / run / f).read_bytes() for f in ("train.bin", "val.bin", "meta.json")}
        for run in runs
    }
    assert files["chunks_of_4"] == files["one_chunk"]
    assert files["chunks_of_4_on_2_procs"] == files["one_chunk"]
    meta, train, val = read_out(tmp_path / "one_chunk")
    assert Counter(decode_docs(train) + decode_docs(val)) == Counter(numbered_docs(30))
    assert meta["val_docs"] > 0


@needs_gpt2
def test_val_split_is_about_val_fraction_and_never_empty(tmp_path):
    prepare_data.prepare(
        str(write_jsonl(tmp_path / "many.jsonl", numbered_docs(2000))),
        str(tmp_path / "many"),
        val_fraction=0.1,
        num_proc=1,
    )
    assert 150 < read_out(tmp_path / "many")[0]["val_docs"] < 250
    # two documents at the default fraction: one each, so train.py always has one to evaluate on
    prepare_data.prepare(
        str(write_jsonl(tmp_path / "two.jsonl", ["a", "b"])), str(tmp_path / "two"), num_proc=1
    )
    meta = read_out(tmp_path / "two")[0]
    assert (meta["train_docs"], meta["val_docs"]) == (1, 1)


@needs_gpt2
def test_max_tokens_caps_exactly(tmp_path):
    docs = numbered_docs(50)
    full = stream_tokens(docs)
    src = str(write_jsonl(tmp_path / "d.jsonl", docs))
    for cap in (1, 37, len(full) // 2, len(full) - 1):  # 37 falls inside a document
        prepare_data.prepare(
            src,
            str(tmp_path / f"cap{cap}"),
            val_fraction=0,
            max_tokens=cap,
            chunk_docs=8,
            num_proc=1,
        )
        meta, train, val = read_out(tmp_path / f"cap{cap}")
        assert train.tolist() == full[:cap]
        assert meta["train_tokens"] == cap and len(val) == 0
    # with a val split the cap counts both files
    prepare_data.prepare(
        src, str(tmp_path / "split"), val_fraction=0.3, max_tokens=300, chunk_docs=8, num_proc=2
    )
    meta, train, val = read_out(tmp_path / "split")
    assert len(train) + len(val) == meta["train_tokens"] + meta["val_tokens"] == 300
    # a cap above the corpus size changes nothing
    prepare_data.prepare(src, str(tmp_path / "big"), val_fraction=0, max_tokens=10**9, num_proc=1)
    assert read_out(tmp_path / "big")[1].tolist() == full


def test_txt_file_is_one_document(tmp_path, gpt2):
    path = shared_file("tinyshakespeare/input.txt")
    if path is None:
        path = tmp_path / "input.txt"
        path.write_text(
            "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 2000,
            encoding="utf-8",
        )
    text = Path(path).read_text(encoding="utf-8")
    prepare_data.prepare(str(path), str(tmp_path / "out"), max_tokens=20000)
    meta, train, val = read_out(tmp_path / "out")
    assert train.tolist() == gpt2.encode_ordinary(text)[:20000]
    assert (meta["train_docs"], meta["val_docs"], meta["val_tokens"]) == (1, 0, 0)


@needs_gpt2
def test_directory_and_glob_of_txt_files(tmp_path):
    texts = {
        "a.txt": "alpha\nfirst file\n",
        "b.txt": "beta: ünïcödé\n",
        "sub/c.txt": "gamma, in a subfolder",
    }
    for rel, text in texts.items():
        (tmp_path / "corpus" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "corpus" / rel).write_text(text, encoding="utf-8")
    (tmp_path / "corpus" / "notes.md").write_text("not a corpus file")
    prepare_data.prepare(
        str(tmp_path / "corpus"), str(tmp_path / "from_dir"), val_fraction=0, num_proc=1
    )
    assert decode_docs(read_out(tmp_path / "from_dir")[1]) == list(texts.values())  # sorted by path
    prepare_data.prepare(
        str(tmp_path / "corpus" / "*.txt"), str(tmp_path / "from_glob"), val_fraction=0, num_proc=1
    )
    assert decode_docs(read_out(tmp_path / "from_glob")[1]) == [texts["a.txt"], texts["b.txt"]]


@needs_gpt2
def test_parquet_fineweb_sample_has_known_token_count(tmp_path):
    path = shared_file("fineweb_edu_sample/fineweb_edu_sample10bt_150.parquet")
    if path is None:
        path = tmp_path / "sample.parquet"
        datasets.Dataset.from_dict({"text": numbered_docs(150)}).to_parquet(str(path))
    docs = [
        r["text"] for r in datasets.load_dataset("parquet", data_files=str(path), split="train")
    ]
    prepare_data.prepare(str(path), str(tmp_path / "out"))
    meta, train, val = read_out(tmp_path / "out")
    assert meta["train_docs"] + meta["val_docs"] == 150
    assert meta["train_tokens"] + meta["val_tokens"] == len(stream_tokens(docs))
    if shared_file("fineweb_edu_sample/fineweb_edu_sample10bt_150.parquet"):
        assert meta["train_tokens"] + meta["val_tokens"] == 89_438  # the sample's README figure
    assert Counter(decode_docs(train) + decode_docs(val)) == Counter(docs)
    # the jsonl copy of the same rows gives the same files
    jsonl = shared_file("fineweb_edu_sample/fineweb_edu_sample10bt_150.jsonl") or write_jsonl(
        tmp_path / "s.jsonl", docs
    )
    prepare_data.prepare(str(jsonl), str(tmp_path / "out_jsonl"))
    for f in ("train.bin", "val.bin"):
        assert (tmp_path / "out" / f).read_bytes() == (tmp_path / "out_jsonl" / f).read_bytes()


@needs_gpt2
def test_hub_default_is_fineweb_edu_sample_10bt_streamed(tmp_path, monkeypatch):
    calls = []

    def fake_load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        return iter([{"text": d, "id": i} for i, d in enumerate(DOCS)])

    monkeypatch.setattr(prepare_data.datasets, "load_dataset", fake_load_dataset)
    meta = prepare_data.prepare(out_dir=str(tmp_path / "out"), num_proc=1)
    assert calls == [
        ("HuggingFaceFW/fineweb-edu", {"name": "sample-10BT", "split": "train", "streaming": True})
    ]
    assert meta["val_fraction"] == 0.0005
    assert meta["source"]["name"] == "sample-10BT"


@needs_gpt2
def test_missing_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        prepare_data.prepare(str(tmp_path / "nope.jsonl"), str(tmp_path / "out"))
    with pytest.raises(FileNotFoundError, match="no_such_corpus"):
        # no '/': not a hub name either
        prepare_data.prepare("no_such_corpus", str(tmp_path / "out"))
    with pytest.raises(FileNotFoundError, match="missing_dir"):
        prepare_data.prepare("./missing_dir/data", str(tmp_path / "out"))


@needs_gpt2
def test_missing_text_field_names_field_and_columns_and_leaves_nothing_complete(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", DOCS, field="content")
    with pytest.raises(ValueError, match=r"'text'.*\['content'\]"):
        prepare_data.prepare(str(src), str(tmp_path / "out"), num_proc=1)
    assert not (tmp_path / "out" / "meta.json").exists()
    assert not (tmp_path / "out" / "train.bin").exists()


def test_unknown_tokenizer_lists_the_known_ones(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", DOCS)
    with pytest.raises(ValueError, match=r"not_a_tokenizer.*gpt2"):
        prepare_data.prepare(str(src), str(tmp_path / "out"), tokenizer="not_a_tokenizer")


@needs_gpt2
def test_command_line(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", DOCS)
    cmd = [
        sys.executable,
        str(ROOT / "prepare_data.py"),
        f"--dataset={src}",
        f"--out_dir={tmp_path / 'out'}",
        "--val_fraction=0.3",
        "--num_proc=2",
        "--max_tokens=40",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "wrote 40 gpt2 tokens" in result.stdout
    meta, train, val = read_out(tmp_path / "out")
    assert len(train) + len(val) == 40
    bad = subprocess.run(
        cmd[:2] + [f"--dataset={tmp_path / 'absent.txt'}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert bad.returncode != 0 and "absent.txt" in bad.stderr


def test_help_gives_every_default_out_dir_included(capsys):
    with pytest.raises(SystemExit):
        prepare_data.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert (
        "written, replacing those there (default data/fineweb_edu, the data_dir of "
        "config/tiny_fineweb.py)" in text
    )
    for default in (
        "default HuggingFaceFW/fineweb-edu",
        "default sample-10BT",
        "default text",
        "default gpt2",
        "default 0.0005 for FineWeb-Edu",
        "default: no cap",
        "default: all cores",
        "default train",
    ):
        assert default in text


@needs_gpt2
def test_local_files_without_out_dir_say_they_go_to_the_default_and_where_they_went(
    tmp_path, monkeypatch, capsys
):
    src = write_jsonl(tmp_path / "d.jsonl", DOCS)
    monkeypatch.chdir(tmp_path)
    prepare_data.main([f"--dataset={src}", "--num_proc=1"])
    out = capsys.readouterr().out
    assert out.startswith(
        "no --out_dir given: writing to data/fineweb_edu, the default, which "
        "config/tiny_fineweb.py reads (pass --out_dir=DIR to write elsewhere)\n"
    )
    assert "documents to data/fineweb_edu in" in out
    assert out.endswith(
        "train on it: python train.py config/tiny_fineweb.py --data_dir=data/fineweb_edu\n"
    )
    assert (tmp_path / "data" / "fineweb_edu" / "meta.json").exists()


# -----------------------------------------------------------------------------
# bad input: main() exits with one line, `error: ...`, that names the file and what to do, and
# leaves out_dir as it was


def main_error(*argv):
    """The message main(argv) exits with; it must be one line starting 'error: '."""
    with pytest.raises(SystemExit) as exit_info:
        prepare_data.main(list(argv))
    message = exit_info.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, (
        message
    )
    return message


@needs_gpt2
def test_missing_file_glob_or_directory_is_named(tmp_path):
    out = f"--out_dir={tmp_path / 'out'}"
    assert "nope.jsonl" in main_error(f"--dataset={tmp_path / 'nope.jsonl'}", out)
    assert "*.txt' matches no .txt" in main_error(f"--dataset={tmp_path / '*.txt'}", out)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "notes.md").write_text("not a corpus file")
    message = main_error(f"--dataset={tmp_path / 'corpus'}", out)
    assert "corpus" in message and "directory with no .txt" in message
    assert not (tmp_path / "out").exists()  # nothing was read, so nothing was made


@needs_gpt2
# (a .txt once made a 1-token bin)
@pytest.mark.parametrize(
    "name,text",
    [("empty.jsonl", ""), ("blank.jsonl", "\n\n"), ("empty.txt", ""), ("blank.txt", "\n  \n")],
)
def test_an_empty_or_blank_file_is_an_error_not_empty_bins(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    message = main_error(
        f"--dataset={tmp_path / name}", f"--out_dir={tmp_path / 'out'}", "--num_proc=1"
    )
    assert name in message and "holds no documents" in message
    assert not list((tmp_path / "out").iterdir())


@needs_gpt2
def test_an_empty_file_among_others_adds_no_document(tmp_path):
    (tmp_path / "corpus").mkdir()
    write_jsonl(tmp_path / "corpus" / "a.jsonl", DOCS[:3])
    (tmp_path / "corpus" / "b.jsonl").write_text("")
    write_jsonl(tmp_path / "corpus" / "c.jsonl", DOCS[3:])
    prepare_data.prepare(
        str(tmp_path / "corpus"), str(tmp_path / "out"), val_fraction=0, num_proc=1
    )
    assert decode_docs(read_out(tmp_path / "out")[1]) == DOCS


@needs_gpt2
def test_rows_without_text_are_skipped_and_counted_not_empty_documents(tmp_path, capsys):
    src = tmp_path / "rows.jsonl"
    src.write_text('{"text": "first"}\n\n{"other": 1}\n{"text": null}\n{"text": "last"}\n')
    prepare_data.prepare(str(src), str(tmp_path / "out"), val_fraction=0, num_proc=1)
    meta, train, _ = read_out(tmp_path / "out")
    assert decode_docs(train) == ["first", "last"] and meta["skipped_rows"] == 2
    # the first skipped row is the file's line 3: the blank line 2 holds no row
    assert (
        f"skipped 2 row(s) with no 'text' (null, or missing): the first is {src}, line 3"
        in capsys.readouterr().out
    )


@needs_gpt2
def test_the_empty_val_note_names_what_a_document_is_for_the_input(tmp_path, capsys):
    write_jsonl(tmp_path / "one.jsonl", ["the only row"])
    prepare_data.prepare(str(tmp_path / "one.jsonl"), str(tmp_path / "a"), num_proc=1)
    note = capsys.readouterr().out
    assert (
        "val.bin is empty: 1 document(s) is too few" in note and "each row is one document" in note
    )
    assert ".txt" not in note
    (tmp_path / "one.txt").write_text("one text")
    prepare_data.prepare(str(tmp_path / "one.txt"), str(tmp_path / "b"), num_proc=1)
    assert (
        "a .txt file is one document: split the text into several files" in capsys.readouterr().out
    )


@needs_gpt2
def test_malformed_jsonl_names_the_file_and_line(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "fine"}\n{"text": "no closing brace"\n{"text": "fine again"}\n')
    message = main_error(f"--dataset={src}", f"--out_dir={tmp_path / 'out'}", "--num_proc=1")
    assert "bad.jsonl: line 2 is not JSON" in message
    # valid JSON that is not an object is no row either
    src.write_text('{"text": "fine"}\n"just a string"\n')
    message = main_error(f"--dataset={src}", f"--out_dir={tmp_path / 'out'}", "--num_proc=1")
    assert "bad.jsonl: line 2 is a JSON str, not an object" in message


@needs_gpt2
def test_binary_file_given_as_txt_is_named(tmp_path):
    src = tmp_path / "picture.txt"
    src.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xd8")
    message = main_error(f"--dataset={src}", f"--out_dir={tmp_path / 'out'}", "--num_proc=1")
    assert "picture.txt is not UTF-8 text" in message and "0x89" in message


@needs_gpt2
def test_wrong_text_field_names_the_file_and_its_columns(tmp_path):
    # the second file of a directory: each file is read on its own, so the error names the one
    (tmp_path / "corpus").mkdir()
    write_jsonl(tmp_path / "corpus" / "a.jsonl", DOCS)
    write_jsonl(tmp_path / "corpus" / "b.jsonl", DOCS, field="content")
    message = main_error(
        f"--dataset={tmp_path / 'corpus'}", f"--out_dir={tmp_path / 'out'}", "--num_proc=1"
    )
    assert (
        "--text_field='text' is not a column of " + str(tmp_path / "corpus" / "b.jsonl") in message
    )
    assert "['content']" in message
    # a column that holds something other than text
    src = tmp_path / "numbers.jsonl"
    src.write_text('{"text": 1}\n{"text": 2}\n')
    message = main_error(f"--dataset={src}", f"--out_dir={tmp_path / 'out'}", "--num_proc=1")
    assert "numbers.jsonl holds int values, not text" in message


@needs_gpt2
def test_unreachable_hub_says_to_use_local_files(tmp_path, monkeypatch):
    # datasets' own offline path, which raises what it raises when the hub cannot be reached
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    message = main_error(
        "--dataset=picotron-tests/not-on-this-machine", f"--out_dir={tmp_path / 'out'}"
    )
    assert (
        "Couldn't reach 'picotron-tests/not-on-this-machine'" in message
        and "--dataset=PATH" in message
    )

    # the README's first command, offline: datasets' error for FineWeb-Edu when the network is down
    def no_network(path, **kwargs):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(prepare_data.datasets, "load_dataset", no_network)
    message = main_error("--max_tokens=20000000", f"--out_dir={tmp_path / 'out'}")
    assert "--dataset='HuggingFaceFW/fineweb-edu'" in message and "--dataset=PATH" in message
    assert not (tmp_path / "out").exists()


def test_tokenizer_that_cannot_be_downloaded_names_TIKTOKEN_CACHE_DIR_and_the_file(
    tmp_path, monkeypatch
):
    import requests  # what tiktoken downloads with

    def no_network(url, *args, **kwargs):
        raise requests.ConnectionError(
            f"Failed to resolve {url}", request=requests.Request("GET", url).prepare()
        )

    monkeypatch.setattr(requests, "get", no_network)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty_cache"))
    # forget the gpt2 this process already loaded
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    src = write_jsonl(tmp_path / "d.jsonl", DOCS)
    message = main_error(f"--dataset={src}", f"--out_dir={tmp_path / 'out'}")
    url = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe"
    assert url in message and f"TIKTOKEN_CACHE_DIR='{tmp_path / 'empty_cache'}'" in message
    # the name tiktoken looks for in its cache
    assert hashlib.sha1(url.encode()).hexdigest() in message


def test_an_unreachable_hub_is_an_error_at_once_not_after_datasets_retries(monkeypatch):
    # offline, datasets retries five times, backing off to 8 s, before its own error (~25 s): the
    # Hub's host is tried first, once. Here the connection fails as it does offline, without a real
    # network call. Offline it takes at most the attempt's timeout: checked as given, not on a clock
    # a load moves.
    attempts = []

    def no_network(address, timeout=None):
        attempts.append(timeout)
        raise socket.gaierror(-2, "Name or service not known")

    def datasets_must_not_be_asked(*args, **kwargs):
        raise AssertionError("datasets.load_dataset was called although the hub cannot be reached")

    # (conftest sets it: the tests run offline)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(prepare_data.urllib.request, "getproxies", lambda: {})
    monkeypatch.setattr(prepare_data.socket, "create_connection", no_network)
    monkeypatch.setattr(prepare_data.datasets, "load_dataset", datasets_must_not_be_asked)
    with pytest.raises(ConnectionError) as error:
        prepare_data.load_documents(
            prepare_data.DEFAULT_DATASET, prepare_data.DEFAULT_NAME, "train", "text"
        )
    assert len(attempts) == 1 and attempts[0] is not None and attempts[0] <= 5, attempts
    message = str(error.value)
    assert "--dataset='HuggingFaceFW/fineweb-edu' is a Hugging Face hub dataset" in message
    assert (
        "huggingface.co:443 cannot be reached (gaierror" in message and "--dataset=PATH" in message
    )


def test_behind_a_proxy_the_hub_is_not_tried_directly(monkeypatch):
    def no_direct_connection(address, timeout=None):
        raise AssertionError(f"a direct connection to {address} was tried although a proxy is set")

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(
        prepare_data.urllib.request, "getproxies", lambda: {"https": "http://proxy.example:3128"}
    )
    monkeypatch.setattr(prepare_data.socket, "create_connection", no_direct_connection)
    assert prepare_data.why_hub_unreachable() is None


@needs_gpt2
def test_a_failed_run_leaves_no_tmp_files_and_the_earlier_output_untouched(tmp_path):
    write_jsonl(tmp_path / "good.jsonl", numbered_docs(20))
    prepare_data.prepare(str(tmp_path / "good.jsonl"), str(tmp_path / "out"), num_proc=1)
    before = {f.name: f.read_bytes() for f in (tmp_path / "out").iterdir()}
    # a.jsonl is read (and tokens written) batch by batch before b.jsonl fails
    (tmp_path / "corpus").mkdir()
    write_jsonl(tmp_path / "corpus" / "a.jsonl", numbered_docs(30))
    (tmp_path / "corpus" / "b.jsonl").write_text('{"text": "cut off\n')
    for num_proc in (1, 2):
        with pytest.raises(ValueError, match="b.jsonl: line 1 is not JSON"):
            prepare_data.prepare(
                str(tmp_path / "corpus"), str(tmp_path / "out"), chunk_docs=4, num_proc=num_proc
            )
        assert {f.name: f.read_bytes() for f in (tmp_path / "out").iterdir()} == before
    main_error(f"--dataset={tmp_path / 'nope.txt'}", f"--out_dir={tmp_path / 'out'}")
    assert {f.name: f.read_bytes() for f in (tmp_path / "out").iterdir()} == before


@needs_gpt2
def test_command_line_error_is_one_line_without_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "prepare_data.py"), f"--dataset={tmp_path / 'absent.jsonl'}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode != 0
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "absent.jsonl" in result.stderr and "Traceback" not in result.stderr
