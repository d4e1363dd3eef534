"""Tests on the real libraries (diffusers, transformers): ``make test-real``.

They build tiny random-weight models from configs (no hub access) and run the libraries' own loops.
They are slow on a small CPU (Dynamo traces the real modules), so ``pytest tests`` skips them unless
``TORCHSYNC_PASS_REAL=1`` is set (``make test-real`` sets it); they skip when the libraries are not
installed (``pip install -e .[real]``).
"""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TORCHSYNC_PASS_REAL") == "1":
        return
    skip = pytest.mark.skip(reason="real-library test: run `make test-real` (or set TORCHSYNC_PASS_REAL=1)")
    for item in items:
        if "real" in item.keywords:
            item.add_marker(skip)
