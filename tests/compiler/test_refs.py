"""Registry references: the one grammar of names, tags and versions (compiler/refs.py)."""

from __future__ import annotations

import pytest

from compiler.errors import Conflict, Unprocessable
from compiler.refs import Ref, check_tag, check_word


@pytest.mark.parametrize(("text", "name", "tag", "version"), [
    ("bert-base", "bert-base", "latest", None), ("bert-base:prod", "bert-base", "prod", None),
    ("bert-base@3", "bert-base", None, 3), ("a.b_c-9:v1.2", "a.b_c-9", "v1.2", None),
])
def test_references_parse_and_print_back(text, name, tag, version):
    ref = Ref.parse(text)
    assert (ref.name, ref.tag, ref.version) == (name, tag, version)
    assert Ref.parse(str(ref)) == ref


@pytest.mark.parametrize("text", ["", "Bert", "-x", "a/b", "a:b:c", "a@0", "a@x", "a@1234567890", "a b", "a:",
                                  "bert\u202e", "bert\x1b[31m", "é", "a" * 130, "evil\n", "evil:prod\n",
                                  "evil@1\n"])
def test_anything_else_is_refused_with_the_grammar(text):
    with pytest.raises(Unprocessable):
        Ref.parse(text)


@pytest.mark.parametrize("text", ["evil\n", "x\n", "prod\n"])
def test_a_final_newline_is_not_part_of_a_word(text):
    """The grammar's `$` took a final newline under `re.match`: a compile request named 'evil\\n' made a name no
    route could read, tag or delete, and a Redis key with a newline in it."""
    for check in (lambda: check_word("name", text, 64, "S"), lambda: check_tag(text, 64, "S")):
        with pytest.raises(Unprocessable, match="is not allowed"):
            check()


def test_words_are_bounded_by_the_setting_they_name_and_latest_is_never_set():
    assert check_word("name", "x" * 8, 8, "AOTC_MAX_REGISTRY_NAME_CHARS") == "x" * 8
    with pytest.raises(Unprocessable, match="AOTC_MAX_REGISTRY_NAME_CHARS"):
        check_word("name", "x" * 9, 8, "AOTC_MAX_REGISTRY_NAME_CHARS")
    with pytest.raises(Conflict, match="newest version"):
        check_tag("latest", 64, "AOTC_MAX_REGISTRY_NAME_CHARS")
