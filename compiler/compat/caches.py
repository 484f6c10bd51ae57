"""Inductor's caches, as a fleet of compile workers sees them.

Three caches matter (torch 2.11 and 2.13 alike):
  FX graph cache      compile_fx skips it when aot_mode is set (`... and not aot_mode`), so AOTInductor
                      compiles neither read nor write it, locally or remotely.
  autotune cache      the best Triton config per kernel source, local (beside the kernel) and, with
                      autotune_remote_cache, in Redis (TORCHINDUCTOR_REDIS_URL). JSON, keyed by torch, Triton
                      and the GPU. It has no CPU counterpart. aotc's sandboxed compile children have no route
                      to Redis, so its remote form is off (worker/isolation.py).
  max-autotune timings  AlgorithmSelectorCache (a PersistentCache) keeps every benchmarked matmul/conv choice's
                      time in one local JSON file per system, {"cache": {op: {inputs: {precision: {choice:
                      ms}}}}}; Inductor has no remote form of it. gemm_timings_location() and the
                      functions after it locate, read and merge that file so the worker can share it
                      (worker/tuning.py): it seeds the file in a compile child's cache dir before the compile
                      and reads it after.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
from typing import Any


def inductor_cache_settings() -> dict[str, Any]:
    """What Inductor will do with its caches in this process (after the worker set TORCHINDUCTOR_* variables)."""
    from torch._inductor import compile_fx as _compile_fx
    from torch._inductor import config

    try:  # the line that keeps AOTInductor away from the FX graph cache, present in 2.11 and 2.13
        fx_in_aot: bool | None = "and not aot_mode" not in inspect.getsource(_compile_fx)
    except (OSError, TypeError):
        fx_in_aot = None
    return {
        "fx_graph_remote_cache": bool(getattr(config, "fx_graph_remote_cache", False)),
        "autotune_remote_cache": bool(getattr(config, "autotune_remote_cache", False)),
        "fx_graph_cache_used_by_aot_compiles": fx_in_aot,
    }


def gemm_timings_location(cache_dir: str) -> tuple[str, str] | None:
    """(path of the timings file, system hash) for an Inductor whose TORCHINDUCTOR_CACHE_DIR is `cache_dir` on
    this machine: the layout of CacheBase.get_local_cache_path, computed without changing this process's cache
    dir (the worker seeds and reads a child's file from outside). None where this torch lacks that layout."""
    try:
        from torch._inductor.codecache import CacheBase

        system = str(CacheBase.get_system()["hash"])
    except Exception:
        return None
    return os.path.join(cache_dir, "cache", system), system


def read_gemm_timings(path: str) -> dict[tuple[str, str, str, str], float]:
    """Every (op, inputs, precision, choice) -> time in the local timings file; {} if there is none or its
    layout is not the one above (then nothing is shared, and Inductor benchmarks as usual)."""
    try:
        with open(path, "rb") as f:
            return parse_gemm_timings(f.read())
    except OSError:
        return {}


def parse_gemm_timings(data: bytes, *, numbers_only: bool = True) -> dict[tuple[str, str, str, str], Any]:
    """read_gemm_timings on a file's bytes (the worker reads a child's file itself, without following links).
    `numbers_only=False` keeps every leaf as it is, for a caller that judges (and counts) what is not a time."""
    try:
        cache = json.loads(data).get("cache", {})
    except (ValueError, AttributeError, RecursionError):
        return {}
    out: dict[tuple[str, str, str, str], Any] = {}
    if not isinstance(cache, dict):
        return out
    for op, by_inputs in cache.items():
        for inputs, by_precision in (by_inputs.items() if isinstance(by_inputs, dict) else ()):
            for precision, by_choice in (by_precision.items() if isinstance(by_precision, dict) else ()):
                for choice, ms in (by_choice.items() if isinstance(by_choice, dict) else ()):
                    if isinstance(ms, (int, float)) and not isinstance(ms, bool) and math.isfinite(ms):
                        out[(op, inputs, precision, choice)] = float(ms)
                    elif not numbers_only:
                        out[(op, inputs, precision, choice)] = ms
    return out


def merge_gemm_timings(path: str, timings: dict[tuple[str, str, str, str], float]) -> int:
    """Add the timings the local file lacks (local measurements win) and write it atomically, in the layout
    Inductor reads. Returns how many were added."""
    try:
        with open(path) as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or not isinstance(doc.get("cache"), dict):
            return 0
    except FileNotFoundError:
        doc = {"system": {}, "cache": {}}
    except (OSError, ValueError):
        return 0
    added = 0
    for (op, inputs, precision, choice), ms in timings.items():
        level = doc["cache"]
        for k in (op, inputs, precision):
            nxt = level.setdefault(k, {})
            if not isinstance(nxt, dict):
                break
            level = nxt
        else:
            if choice not in level:
                level[choice] = ms
                added += 1
    if added:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.aotc-{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    return added


def without_precompiled_headers() -> contextlib.AbstractContextManager[Any]:
    """AOTInductor compiles without precompiled headers in this block: each translation unit parses the headers
    itself, and no header is built or read. For a compile that has no trusted header set to include (the worker's
    warm-up is still building it, worker/headers.py): building one of its own is the same parse, written to a .gch
    that no other compile may use. `aot_inductor.precompile_headers` is in 2.11 and 2.13; a torch without it never
    precompiles AOTInductor's headers, so there is nothing to turn off."""
    from torch._inductor import config

    if not hasattr(config.aot_inductor, "precompile_headers"):
        return contextlib.nullcontext()
    return config.patch({"aot_inductor.precompile_headers": False})
