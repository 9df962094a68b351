"""
The tokenizer of a transformers model folder, for prepare_data.py, sample.py and the models
import_hf.py loads. A tokenizer is named by a string, which meta.json files and checkpoints record:

    a tiktoken encoding ('gpt2', 'cl100k_base', ...)  tiktoken, as for picotron's own models
    a model folder (its absolute path)                the folder's tokenizer.json, read with the
                                                      `tokenizers` package (pip install tokenizers)

A folder whose vocabulary is exactly one of tiktoken's encodings (GPT-2's, for picotron's own
exports) resolves to that encoding: tiktoken is faster and needs no other package. Every other
folder keeps its own tokenizer; `tokenizers` is imported only then.
"""

import hashlib
import json
import os

import tiktoken

# the vocabulary size of each tiktoken encoding a folder may match: only those of its size are
# loaded (an encoding not in tiktoken's cache is a download)
TIKTOKEN_SIZES = {
    "gpt2": 50257,
    "r50k_base": 50257,
    "p50k_base": 50281,
    "cl100k_base": 100277,
    "o200k_base": 200019,
}


def byte_level_alphabet():
    """GPT-2's byte-level BPE writes each byte as a printable character (Radford et al. 2019,
    encoder.py): the printable ASCII and Latin-1 bytes stand for themselves, the other 68 are
    shifted to 256 and up. tokenizer.json files of byte-level tokenizers spell their tokens in it;
    tiktoken keeps raw bytes."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    alphabet, shifted = {}, 0
    for b in range(256):
        if b in printable:
            alphabet[b] = chr(b)
        else:
            alphabet[b] = chr(256 + shifted)
            shifted += 1
    return alphabet


def has_tokenizer(folder):
    return os.path.isfile(os.path.join(folder, "tokenizer.json"))


def folder_vocabulary(folder):
    """{token as spelled in tokenizer.json: id}, added (special) tokens included; None without
    tokenizer.json."""
    if not has_tokenizer(folder):
        return None
    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    vocab = dict(spec.get("model", {}).get("vocab") or {})
    # a Unigram model lists [piece, score] pairs: no tiktoken encoding
    if not isinstance(vocab, dict):
        return None
    vocab.update({t["content"]: t["id"] for t in spec.get("added_tokens", [])})
    return vocab


def tiktoken_vocabulary(enc):
    """An encoding's vocabulary spelled as a byte-level tokenizer.json spells it."""
    alphabet, vocab = byte_level_alphabet(), {}
    for i in range(enc.n_vocab):
        try:
            piece = enc.decode_single_token_bytes(i)
        except (
            KeyError
        ):  # (ids with no token: cl100k_base has a few between its ranks and its specials)
            continue
        vocab["".join(alphabet[b] for b in piece)] = i
    for special in enc.special_tokens_set:  # these are spelled as they are
        vocab.pop("".join(alphabet[b] for b in special.encode()), None)
        vocab[special] = enc.encode_single_token(special)
    return vocab


def matching_tiktoken(folder):
    """The tiktoken encoding whose vocabulary is exactly the folder's, or None."""
    vocab = folder_vocabulary(folder)
    if not vocab:
        return None
    size = max(vocab.values()) + 1
    for name, n_vocab in TIKTOKEN_SIZES.items():
        if n_vocab != size:
            continue
        try:
            enc = tiktoken.get_encoding(name)
        except (
            Exception
        ):  # not in the cache and no network: the folder's own tokenizer does the same job
            continue
        if tiktoken_vocabulary(enc) == vocab:
            return name
    return None


def resolve(folder):
    """The name a model folder's tokenizer is recorded under: a tiktoken encoding's, or the folder's
    absolute path; None when the folder has no tokenizer.json."""
    if not has_tokenizer(folder):
        return None
    return matching_tiktoken(folder) or os.path.abspath(folder)


def end_of_text_token(folder, tokenizer):
    """The id that ends a document: tokenizer_config.json's eos_token, else config.json's (or
    generation_config.json's) eos_token_id."""
    path = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and tokenizer.token_to_id(eos) is not None:
            return tokenizer.token_to_id(eos)
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token_id")
            eos = eos[0] if isinstance(eos, list) and eos else eos
            if isinstance(eos, int):
                return eos
    raise ValueError(
        f"the tokenizer of {folder} names no end-of-text token (eos_token in "
        f"tokenizer_config.json, or eos_token_id in config.json): add one, documents are separated "
        f"by it"
    )


class FolderTokenizer:
    """A model folder's tokenizer.json, with the part of tiktoken's Encoding that picotron uses:
    name, n_vocab, eot_token, encode_ordinary (a document's tokens, nothing added), encode (a
    prompt, with what the tokenizer adds in front, a BOS token for Llama), decode."""

    def __init__(self, folder):
        try:
            # lazily: an optional dependency, needed only for a folder's own tokenizer
            import tokenizers
        except ImportError:
            raise ValueError(
                f"the tokenizer of {folder} (tokenizer.json) is read with the tokenizers package, "
                f"which is not installed: pip install tokenizers"
            )
        self.name = os.path.abspath(folder)
        self.tokenizer = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        self.n_vocab = max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        self.eot_token = end_of_text_token(folder, self.tokenizer)

    def encode_ordinary(self, text):
        # unlike tiktoken's encode_ordinary, the text of a special token, "<|endoftext|>", becomes
        # that token
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode(self, text, allowed_special=None):
        return self.tokenizer.encode(text).ids

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def folder_encoding(folder):
    """The tokenizer of a model folder: tiktoken's encoding when the vocabulary is one of its, else
    the folder's tokenizer.json."""
    if not has_tokenizer(folder):
        raise ValueError(
            f"{folder} holds no tokenizer.json: name its tokenizer with --tokenizer (a tiktoken "
            f"encoding, or a model folder that has tokenizer.json)"
        )
    name = matching_tiktoken(folder)
    return tiktoken.get_encoding(name) if name else FolderTokenizer(folder)


def get_encoding(name):
    """A tiktoken encoding, or the tokenizer of a transformers model folder (folder_encoding:
    tiktoken when its vocabulary is one of tiktoken's, else its tokenizer.json). Either has
    encode_ordinary, eot_token, n_vocab and name, the name meta.json records."""
    if os.path.isdir(name):
        return folder_encoding(name)
    names = tiktoken.list_encoding_names()
    if name not in names:
        moved = (
            " (a checkpoint records its data's tokenizer folder: it was moved or deleted?)"
            if os.path.isabs(name)
            else ""
        )
        raise ValueError(
            f"unknown tokenizer {name!r}: --tokenizer must name a tiktoken encoding, one of "
            f"{', '.join(names)}, or a model folder with tokenizer.json{moved}"
        )
    try:
        return tiktoken.get_encoding(name)
    except OSError as e:
        # tiktoken downloads an encoding's files on first use and keeps them in TIKTOKEN_CACHE_DIR,
        # each named by the sha1 of its URL. The download's errors (requests' ConnectionError,
        # HTTPError) are OSErrors that carry the request; any other OSError (say, an unwritable
        # cache) already names its path.
        url = getattr(getattr(e, "request", None), "url", None)
        if url is None:
            raise
        cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR")
        cache = (
            f"TIKTOKEN_CACHE_DIR={cache_dir!r} holds no copy of it"
            if cache_dir
            else f"TIKTOKEN_CACHE_DIR is {'empty' if cache_dir == '' else 'not set'}"
        )
        sha1 = hashlib.sha1(url.encode()).hexdigest()
        raise ConnectionError(
            f"--tokenizer={name}: tiktoken could not download {url} ({type(e).__name__}), and "
            f"{cache}. Offline, set TIKTOKEN_CACHE_DIR to a directory holding the encoding's "
            f"files, each named by the sha1 of its URL (this one: {sha1}); one filled by a run "
            f"with network access will do"
        ) from e
