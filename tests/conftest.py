"""Shared fixtures: every test starts from a clean Dynamo and a clean nosync state."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)


@pytest.fixture(autouse=True)
def clean_dynamo():
    import torchsync_pass

    torch._dynamo.reset()
    counters.clear()
    torchsync_pass.reset()
    yield
    torch._dynamo.reset()
    counters.clear()
    torchsync_pass.reset()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
