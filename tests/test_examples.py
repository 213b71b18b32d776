"""Every shipped recipe validates, and its batch arithmetic is consistent."""

from pathlib import Path

import pytest

from novarl.cli import BUNDLED_RECIPE
from novarl.config import load_config
from novarl.backends.contract.resolve import check_available, plan_batches, resolve_backends

EXAMPLES = sorted((Path(__file__).parents[1] / "examples" / "configs").glob("*.yaml"))


def test_there_are_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("path", [BUNDLED_RECIPE, *EXAMPLES], ids=lambda p: p.name)
def test_example_validates_and_needs_nothing_missing(path):
    cfg = load_config(path)
    plan = plan_batches(cfg)
    assert plan.samples_per_step % plan.global_batch_size == 0
    assert check_available(cfg, resolve_backends(cfg)).missing == ()


def test_every_size_inconsistency_is_reported_together():
    from novarl.errors import ConfigError

    cfg = load_config(BUNDLED_RECIPE, overrides=[
        "cluster.gpus_per_node=3", "policy.dtensor_cfg.tensor_parallel_size=2",  # 3 ranks, tp 2
        "policy.train_global_batch_size=100",                                     # 512 samples
        "grpo.num_generations_per_prompt=1", "grpo.num_prompts_per_step=64",
        "policy.generation.backend=vllm", "policy.generation.vllm_cfg.max_model_len=8"])
    with pytest.raises(ConfigError) as err:
        plan_batches(cfg)
    text = str(err.value)
    assert text.startswith("The config's sizes do not fit together:")
    for needle in ("3 ranks is not a multiple of", "64 x 1 = 64 samples, not a multiple of",
                   "every advantage would be 0", "max_model_len=8 is shorter than policy.max_seq_length=16"):
        assert needle in text, needle
