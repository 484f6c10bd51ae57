"""Client.load's target check for CPU levels: a package of a level at or below this host's loads; one from before
levels (an old label, built with -march=native, no pin among its factors) loads only on the CPU model that built
it. No service: the check reads the artifact's record."""

from __future__ import annotations

import platform

import pytest

from client.sdk import ClientError, _check_target
from compiler import cachekey
from compiler.device import cpu_name
from compiler.targets import Target

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 levels only")


def _meta(target: str, device_name: str) -> dict:
    return {"target": target, "factors": cachekey.factors("ab" * 32, [], target, {"torch": "x"}, {}),
            "worker": {"device_name": device_name}}


def test_a_pinned_package_of_the_baseline_loads_on_any_x86_64():
    _check_target(Target.parse("cpu-x86_64-v1"), "cpu", _meta("cpu-x86_64-v1", "another CPU"))


def test_a_march_native_package_loads_only_on_the_cpu_model_that_built_it():
    old = _meta("cpu-x86_64-default", "AMD EPYC 9654 96-Core Processor")  # the baseline label: any host's level
    assert "isa" not in old["factors"]
    if cpu_name() != old["worker"]["device_name"]:
        with pytest.raises(ClientError) as e:
            _check_target(Target.parse(old["target"]), "cpu", old)
        assert e.value.status == 409 and "-march=native on AMD EPYC 9654" in str(e.value)
    _check_target(Target.parse(old["target"]), "cpu", _meta("cpu-x86_64-default", cpu_name()))
