"""AOTC_TIMING_PASS=alone (the default): a check that holds the device lock times itself, with no timing child,
only while the registry (real Redis) shows no other live worker on the same host and device."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.store import Store
from worker.isolation import Sandbox
from worker.job import JobRunner
from worker.settings import WorkerSettings

INFO = {"host": "farm-test-host", "device": "cuda:0", "target": "cuda-sm90", "toolchain": {"torch": "x"},
        "device_name": "test"}


@pytest.fixture
def runner(store: Store, tmp_path: Path) -> Iterator[JobRunner]:
    assert WorkerSettings.model_fields["timing_pass"].default == "alone"  # (the suite's workers run auto)
    settings = WorkerSettings(work_dir=tmp_path / "work", data_dir=tmp_path / "data", timing_pass="alone")
    sandbox = Sandbox.__new__(Sandbox)  # never runs a child here
    r = JobRunner(store, settings, INFO, "farm-test-me", threading.Event(), sandbox)
    yield r
    for wid in ("farm-test-me", "farm-test-other", "farm-test-elsewhere", "farm-test-gpu1"):
        store.workers.remove(wid)


def _register(store: Store, wid: str, **info: Any) -> None:
    store.workers.heartbeat({**INFO, "id": wid, **info}, ttl_s=30)


def test_a_worker_alone_on_its_device_times_in_its_check(runner: JobRunner, store: Store) -> None:
    _register(store, "farm-test-me")
    _register(store, "farm-test-elsewhere", host="another-host")  # another machine's cuda:0
    _register(store, "farm-test-gpu1", device="cuda:1")  # this machine's other GPU
    assert runner._times_itself()


def test_a_second_worker_on_the_device_brings_the_timing_pass_back(runner: JobRunner, store: Store) -> None:
    _register(store, "farm-test-me")
    _register(store, "farm-test-other")
    assert not runner._times_itself()
    store.workers.remove("farm-test-other")
    assert runner._times_itself()


@pytest.mark.parametrize(("mode", "expected"), [("separate", False), ("auto", True)])
def test_the_other_modes_ignore_the_registry(runner: JobRunner, store: Store, mode: str, expected: bool) -> None:
    _register(store, "farm-test-other")
    runner.settings = runner.settings.model_copy(update={"timing_pass": mode})
    assert runner._times_itself() is expected


@pytest.mark.parametrize("mode", ["alone", "auto"])
def test_windows_always_take_the_timing_pass(runner: JobRunner, store: Store, mode: str) -> None:
    """AOTC_TIMING_WINDOWS above 1: only the timing pass takes windows (compiler/timing.py), so a check never times
    itself, alone on its device or not."""
    _register(store, "farm-test-me")
    runner.settings = runner.settings.model_copy(update={"timing_pass": mode, "timing_windows": 3})
    assert not runner._times_itself()
