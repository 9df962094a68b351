"""Shared test setup.

Tests run offline: when the project checkout has `../shared/data` beside it (our machines and CI), the
tiktoken cache and the small real corpora there are used. On a user's fresh clone without it, tiktoken
downloads the GPT-2 files as usual and the tests that need a real corpus make their own text.
"""
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


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Token bins every training test of a file shares (tests/dist_utils.py make_token_data); a file whose
    runs need other data defines its own."""
    from dist_utils import make_token_data
    return make_token_data(str(tmp_path_factory.mktemp("data")))


def pytest_addoption(parser):
    parser.addoption("--write-matrix", action="store_true",
                     help="tests/test_matrix.py: write the results into docs/equivalence.md")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (tests/test_cuda.py); skipped where there is none. "
                                       "scripts/gpu_check.sh runs them with pytest -m cuda")


def pytest_collection_modifyitems(config, items):
    """The cuda-marked tests are collected everywhere and skipped, with the reason, where no GPU is."""
    import pytest
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False here); "
                                   "scripts/gpu_check.sh runs these on one")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
