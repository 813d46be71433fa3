"""dtype / device arguments of the model constructors are checked, with the value named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash.model import HybridConfig, TargetModel


@pytest.mark.parametrize(
    ("dtype", "device", "message"),
    [
        ("bfloat16", "cpu", "'dtype' must be one of"),
        (torch.int32, "cpu", r"'dtype' must be one of .* \(got torch.int32\)"),
        (torch.float32, "cuda:7", "'device' cuda:7 is not available"),
        (torch.float32, "nowhere", "'device' is not a torch device"),
        (torch.float32, "meta", "'device' must be a CPU or CUDA device"),
    ],
)
def test_bad_placement_is_refused_before_any_weight_is_built(
    tmp_path: Path, dtype: object, device: str, message: str
) -> None:
    if device == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    with pytest.raises(ValueError, match=message):
        TargetModel.seeded(HybridConfig.tiny_default(), dtype=dtype, device=device)  # type: ignore[arg-type]  # bad values on purpose
    TargetModel.tiny_default(0).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        TargetModel.from_pretrained(tmp_path, dtype=dtype, device=device)  # type: ignore[arg-type]  # as above


def test_good_placement_loads() -> None:
    model = TargetModel.seeded(HybridConfig.tiny_default(), dtype=torch.bfloat16, device="cpu")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
