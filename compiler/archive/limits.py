"""The bounds on the work one upload may cost, each named after the setting that changes it.

The API builds a `Limits` from its settings (service/api/settings.py, `AOTC_*`) and passes it to
`inspect_archive`; the worker's re-check uses the defaults. Every refusal names the setting (`Limits.name`), so
an operator knows what to raise and a user knows what was too big.
"""

from __future__ import annotations

from dataclasses import dataclass

MB = 2**20


@dataclass(frozen=True)
class Limits:
    # the zip
    max_entries: int = 20_000  # AOTC_MAX_ZIP_ENTRIES
    max_unpacked_bytes: int = 8192 * MB  # AOTC_MAX_UNPACKED_MB: all entries, uncompressed, as the zip declares them
    max_entry_bytes: int = 4096 * MB  # AOTC_MAX_ENTRY_MB: one entry, uncompressed
    # AOTC_MAX_COMPRESSION_RATIO: uncompressed/compressed, of each entry over 1 MiB and of the whole archive
    max_compression_ratio: int = 100
    # the JSON inside (models/model.json and the payload configs)
    max_json_bytes: int = 32 * MB  # AOTC_MAX_JSON_MB
    max_json_depth: int = 64  # AOTC_MAX_JSON_DEPTH: nesting of arrays and objects
    max_json_values: int = 2_000_000  # AOTC_MAX_JSON_VALUES: numbers, strings, arrays, objects... in one file
    # strings in the program's graph that codegen may paste into C++ or Python source
    max_graph_string_chars: int = 256  # AOTC_MAX_GRAPH_STRING_CHARS

    @staticmethod
    def name(field: str) -> str:
        """The environment variable that sets `field` (the API's settings read AOTC_*)."""
        return {
            "max_entries": "AOTC_MAX_ZIP_ENTRIES",
            "max_unpacked_bytes": "AOTC_MAX_UNPACKED_MB",
            "max_entry_bytes": "AOTC_MAX_ENTRY_MB",
            "max_compression_ratio": "AOTC_MAX_COMPRESSION_RATIO",
            "max_json_bytes": "AOTC_MAX_JSON_MB",
            "max_json_depth": "AOTC_MAX_JSON_DEPTH",
            "max_json_values": "AOTC_MAX_JSON_VALUES",
            "max_graph_string_chars": "AOTC_MAX_GRAPH_STRING_CHARS",
        }[field]


DEFAULT_LIMITS = Limits()
