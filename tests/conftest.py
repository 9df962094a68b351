"""Shared test setup.

Tests run offline: when the project checkout has `../shared/data` beside it (our machines and CI),
the tiktoken cache and the small real corpora there are used. On a user's fresh clone without it,
tiktoken downloads the GPT-2 files as usual and the tests that need a real corpus make their own
text; where it cannot (no network, and no TIKTOKEN_CACHE_DIR holding them) the tests that need the
GPT-2 tokenizer (marked needs_gpt2) are skipped, saying why, and every other test runs.
"""

import functools
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(ROOT))

if (SHARED_DATA / "tiktoken_cache").is_dir():
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(SHARED_DATA / "tiktoken_cache"))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def shared_file(relpath):
    """Path of a file in ../shared/data, or None when this checkout has no ../shared beside it."""
    p = SHARED_DATA / relpath
    return p if p.exists() else None


@functools.cache
def _load_gpt2():
    """(tiktoken's GPT-2 encoding, None), or (None, why it cannot be loaded). Tried once per
    session: offline, each try is a failed download."""
    import hf_tokenizer

    try:
        return hf_tokenizer.get_encoding("gpt2"), None
    except OSError as e:  # hf_tokenizer's ConnectionError names the file and TIKTOKEN_CACHE_DIR
        return None, f"{type(e).__name__}: {e}"


def gpt2_encoding():
    """tiktoken's GPT-2 encoding. A test that needs it and runs where it cannot be loaded is skipped
    with the reason, rather than failing (or erroring at collection) for want of a network."""
    enc, why = _load_gpt2()
    if enc is None:
        pytest.skip(f"needs the GPT-2 tokenizer, which cannot be loaded here ({why})")
    return enc


@pytest.fixture
def gpt2():
    return gpt2_encoding()


# on a test that tokenizes with GPT-2, directly or through a tool
needs_gpt2 = pytest.mark.usefixtures("gpt2")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Token bins every training test of a file shares (tests/dist_utils.py make_token_data); a file
    whose runs need other data defines its own."""
    from dist_utils import make_token_data

    return make_token_data(str(tmp_path_factory.mktemp("data")))


def pytest_addoption(parser):
    parser.addoption(
        "--write-matrix",
        action="store_true",
        help="tests/test_matrix.py: write the results into docs/equivalence.md",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "cuda: needs a CUDA GPU (tests/test_cuda.py); skipped where there is none. "
        "scripts/gpu_check.sh runs them with pytest -m cuda",
    )


def pytest_collection_modifyitems(config, items):
    """The cuda-marked tests are collected everywhere, skipped with the reason where no GPU is."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU (torch.cuda.is_available() is False here); "
        "scripts/gpu_check.sh runs these on one"
    )
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
