"""Registry references: `bert-base`, `bert-base:prod`, `bert-base@3`. The one parser of names, tags and versions,
shared by the API, the SDK and the CLI. Torch-free.

A name and a tag are lowercase ASCII letters, digits, '.', '_' and '-', starting with a letter or a digit: they
end up in Redis keys, URLs and terminals, so the grammar is an allow-list. `latest` is not a tag anyone sets: it
always names the newest version. How long a name or tag may be is the API's setting (AOTC_MAX_REGISTRY_NAME_CHARS);
HARD_MAX_CHARS only bounds what any parser reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from compiler.errors import Conflict, Unprocessable

HARD_MAX_CHARS = 129  # a name and a tag of 64 characters each, and the colon
LATEST = "latest"
_WORD = r"[a-z0-9][a-z0-9._-]*"
NAME_PATTERN = f"^{_WORD}$"
TAG_PATTERN = f"^{_WORD}$"
_REF = re.compile(rf"^(?P<name>{_WORD})(?::(?P<tag>{_WORD})|@(?P<version>[0-9]{{1,9}}))?$")
_NAME = re.compile(NAME_PATTERN)


@dataclass(frozen=True)
class Ref:
    """A parsed reference: the name, and either a tag or a version (a bare name is `name:latest`)."""

    name: str
    tag: str | None = None
    version: int | None = None

    @classmethod
    def parse(cls, text: str) -> Ref:
        if len(text) > HARD_MAX_CHARS:
            raise Unprocessable(f"the reference is {len(text)} characters; at most {HARD_MAX_CHARS} are read")
        m = _REF.fullmatch(text)  # not match: its `$` takes a final newline
        if not m:
            raise Unprocessable(
                f"cannot read the reference {text!r}: write NAME, NAME:TAG or NAME@VERSION, where a name or tag is "
                "lowercase letters, digits, '.', '_' and '-', starting with a letter or a digit (e.g. bert-base:prod)")
        version = m.group("version")
        if version is not None and int(version) < 1:
            raise Unprocessable(f"versions count from 1; {text!r} names version {version}")
        return cls(m.group("name"), m.group("tag") or (None if version else LATEST),
                   int(version) if version else None)

    def __str__(self) -> str:
        return f"{self.name}@{self.version}" if self.version is not None else f"{self.name}:{self.tag}"


def check_word(kind: str, text: str, max_chars: int, setting: str) -> str:
    """A name or a tag (`kind`) checked against the grammar and `max_chars` (the setting that says so)."""
    if len(text) > max_chars:
        raise Unprocessable(f"the {kind} is {len(text)} characters; the limit is {max_chars} ({setting})",
                            setting=setting)
    if not _NAME.fullmatch(text):  # not match: its `$` takes a final newline
        raise Unprocessable(f"the {kind} {text[:HARD_MAX_CHARS]!r} is not allowed: use lowercase letters, digits, "
                            "'.', '_' and '-', starting with a letter or a digit")
    return text


def check_tag(text: str, max_chars: int, setting: str) -> str:
    """A tag someone may set: a word, and never `latest`, which follows the newest version by itself."""
    check_word("tag", text, max_chars, setting)
    if text == LATEST:  # a well-formed tag, taken: a conflict with what the registry keeps by itself
        raise Conflict("'latest' always names the newest version; it cannot be set or removed")
    return text
