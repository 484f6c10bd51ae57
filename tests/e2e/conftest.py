"""Artifacts that several end-to-end tests read: compiled once per session by the session's worker, since each
compile is the bulk of a test's time (about 30 s on 2 cores). A test that needs a fresh compile (a cache miss it
counts, a failure it provokes) still makes its own."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from client import Client
from client.sdk import Artifact
from modelzoo import MLP, export, seeded


@dataclass
class DynamicMLP:
    model: torch.nn.Module
    path: Path  # the .pt2 uploaded: batch 1..1024 as exported
    record: dict[str, Any]  # POST /v1/models' answer
    art: Artifact  # compiled for batches 1..64 on the CPU: one artifact, no buckets


@pytest.fixture(scope="session")
def dynamic_mlp(api_url: str, worker: dict, tmp_path_factory: pytest.TempPathFactory) -> DynamicMLP:
    """An MLP with a dynamic batch, compiled for batches 1..64: tests/e2e/test_compile_path.py checks that it serves
    the range from Python, tests/e2e/test_cpp_loader.py pulls it and runs it from C++."""
    tmp = tmp_path_factory.mktemp("dynamic-mlp")
    model = seeded(MLP, 2)
    batch = torch.export.Dim("batch", min=1, max=1024)
    path = export(model, (torch.randn(4, 32),), tmp / "mlp.pt2", dynamic_shapes={"x": {0: batch}})
    with Client(api_url, cache_dir=tmp / "cache", timeout=120) as c:
        record = c.upload(path)
        art = c.compile(path, {"x": [{"min": 1, "max": 64}, 32]}, target="cpu")
    assert isinstance(art, Artifact)  # one artifact, no buckets
    return DynamicMLP(model, path, record, art)
