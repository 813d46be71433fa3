"""Suite-wide test settings."""

import pytest
from hypothesis import settings

# CI runs on a shared 2-core machine: wall-clock deadlines would make property tests
# flaky without testing anything; a failure prints its reproduction blob.
settings.register_profile("dflash", deadline=None, print_blob=True)
settings.load_profile("dflash")


@pytest.fixture
def float32_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """The DFlash drafter's packed CPU products in float32 even where the CPU multiplies
    bfloat16 natively: for tests that compare the host proposal path with another path
    (the uncached reference, the device step, a float64 softmax) to float32 precision."""
    from dflash.model.drafters import dflash_layers

    monkeypatch.setattr(dflash_layers, "cpu_bf16_products", lambda: False)
