"""Shared pytest configuration for the blockattn-layers tests.

Importing test helpers: ``tests/`` is a package (``tests/__init__.py``), so with pytest's
default ``prepend`` import mode the repository root goes on ``sys.path`` and helpers import
as ``from tests.oracle import oracle_attention, make_jagged, rel_err``. Run the suite from the
repository root with ``python -m pytest`` (plain ``pytest`` works too). The root is also
added to ``sys.path`` below, for other import modes.

Markers (declared in setup.cfg): ``gpu`` tests are skipped automatically when CUDA is not
available; ``slow`` marks long-running tests.

This file is shared: append fixtures/hooks for other test modules below, keeping it generic.
"""
from __future__ import annotations

import os
import random
import sys

import pytest
import torch

# Without a GPU, the Triton kernels run on CPU tensors through Triton's interpreter. The
# variable must be set before the kernels are first imported (triton.jit reads it then).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

DEFAULT_SEED = 1234


def cuda_available() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` when no CUDA device is present."""
    if cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def seed() -> int:
    """A fixed seed for tests that build their own generators."""
    return DEFAULT_SEED


@pytest.fixture(autouse=True)
def _seed_everything():
    """Seed Python's and torch's global RNGs before every test, so failures reproduce."""
    random.seed(DEFAULT_SEED)
    torch.manual_seed(DEFAULT_SEED)
    yield


@pytest.fixture
def generator(seed) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed``."""
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def single_thread():
    """Run the test with one intra-op torch thread (restored afterwards).

    Tests made of many tiny ops run far faster single-threaded on small, shared CPU machines
    (thread start-up and contention dominate). Opt in per module with
    ``pytestmark = pytest.mark.usefixtures("single_thread")``.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
