"""Every shipped recipe validates, and its batch arithmetic is consistent."""

from pathlib import Path

import pytest

from novarl.cli import BUNDLED_RECIPE
from novarl.config import load_config
from novarl.plan.resolve import check_available, plan_batches, resolve_backends

EXAMPLES = sorted((Path(__file__).parents[1] / "examples" / "configs").glob("*.yaml"))


def test_there_are_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("path", [BUNDLED_RECIPE, *EXAMPLES], ids=lambda p: p.name)
def test_example_validates_and_needs_nothing_missing(path):
    cfg = load_config(path)
    plan = plan_batches(cfg)
    assert plan.samples_per_step % plan.global_batch_size == 0
    assert check_available(cfg, resolve_backends(cfg)).missing == ()
