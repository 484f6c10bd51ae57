"""Issue 18's first hole, end to end with real parts: the one-node `aten._unsafe_index` program, exported with an
all-zero sample index, uploaded over HTTP, compiled and checked by a real worker, pulled with the SDK (signature and
sha256 verified) and called with indices from -400000 to 400000. On the tree before compiler.bounds the package
returned what lay at those offsets (a tensor its caller held elsewhere in its process); now it raises, as eager
does, and the check's record shows the adversarial cases it tried."""

from __future__ import annotations

import pytest
import torch

from modelzoo import export

pytestmark = pytest.mark.slow


class UnsafeIndex(torch.nn.Module):
    def forward(self, x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._unsafe_index.Tensor(x, [i])


def test_a_pulled_unsafe_index_artifact_raises_on_out_of_range_indices(api_url, worker, client, tmp_path):
    path = export(UnsafeIndex(), (torch.randn(16, 4), torch.zeros(8, dtype=torch.long)), tmp_path / "ui.pt2")
    art = client.compile(path, {"x": [16, 4], "i": [8]}, target="cpu", timeout=600)
    pulled = client.pull(art.key, tmp_path / "ui-cpu.pt2")  # signature, sha256 and size verified
    assert pulled.exists()
    fn = client.load(art)
    x = torch.randn(16, 4)
    ok = torch.tensor([0, 15, -1, -16, 7, 3, 2, 1])
    assert torch.equal(fn(x, ok), x[ok])
    # Just past the end first (main's package returned the next 64 bytes), then +-400000.
    for bad in (torch.tensor([0, 1, 2, 3, 4, 5, 6, 16]), torch.linspace(-400000, 400000, 8).long()):
        with pytest.raises(RuntimeError, match="index out of bounds"):
            out = fn(x, bad)
            pytest.fail(f"the package returned {out.tolist()} for indices {bad.tolist()}")

    check = art.meta["check"]
    assert check["passed"] is True
    adversarial = check["adversarial"]
    assert adversarial["failures"] == [] and adversarial["cases"] == 26
    assert adversarial["outcomes"]["refused"] == 12  # every out-of-range value, refused by eager and the package
    assert art.meta["factors"]["bounds"]["inductor"] == {"assert_indirect_indexing": True,
                                                         "debug_index_asserts": True}
