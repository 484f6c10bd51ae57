"""Compile options: one frozen, typed model, turned into Inductor's config dict in exactly one place.

This module imports no torch, so the API can validate options and hash them into cache keys.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class CompileOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["default", "max-autotune"] = "default"

    def canonical(self) -> dict[str, Any]:
        """Every option with its value, defaults included, so equal options hash equal."""
        return self.model_dump(mode="json")

    def canonical_json(self) -> str:
        return json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))

    def inductor_configs(self) -> dict[str, Any]:
        """The `inductor_configs` passed to aoti_compile_and_package. Global torch config is never touched."""
        configs: dict[str, Any] = {}
        if self.mode == "max-autotune":
            configs["max_autotune"] = True
        return configs
