"""compiler.check.compare: what the artifact check accepts, refuses and warns about."""

from __future__ import annotations

import torch

from compiler.check import compare


def test_a_bf16_result_within_tolerance_passes_and_reports_its_error():
    torch.manual_seed(0)
    e = torch.randn(64, 32).bfloat16()
    a = (e.float() * 1.02).bfloat16()
    r = compare(e, a)
    assert r["ok"] and 0 < r["max_rel_err"] < r["tolerance"]


def test_a_wrong_result_fails_naming_the_output():
    e = (torch.ones(4), torch.arange(4.0))
    r = compare(e, (torch.ones(4), torch.arange(4.0) + 1))
    assert not r["ok"] and r["why"].startswith("output 1")


def test_all_zero_eager_outputs_pass_with_a_note_saying_the_comparison_shows_little():
    # A classifier head initialised to zeros answers zeros for any input: the check compares nothing.
    r = compare(torch.zeros(8, 10), torch.zeros(8, 10))
    assert r["ok"] and r["max_rel_err"] == 0.0
    assert r["notes"] == ["output 0 is all zeros in eager at these inputs, so this comparison shows little "
                          "(a model with zero-initialised weights?)"]
    assert "notes" not in compare(torch.ones(3), torch.ones(3))
