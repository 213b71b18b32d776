"""Training-strategy presets (NovaRL seed 004): each resolves to its backend, and the
dotted overrides still win."""

import pytest

from novarl.cli import BUNDLED_RECIPE, main
from novarl.config import load_config
from novarl.core.distributed import PRESETS, get_default_fsdp_preset, get_preset, get_zero3_preset
from novarl.errors import UserError
from novarl.backends.contract.resolve import resolve_backends


@pytest.mark.parametrize(("name", "backend", "stage", "offload"), [
    ("fsdp", "dtensor", None, False), ("zero2", "deepspeed", 2, False), ("zero3", "deepspeed", 3, False),
    ("zero3-offload", "deepspeed", 3, True)])
def test_each_preset_resolves_to_its_backend(name, backend, stage, offload):
    cfg = load_config(BUNDLED_RECIPE, overrides=["policy.megatron_cfg.enabled=false"], **get_preset(name))
    assert resolve_backends(cfg).training == backend
    ds = cfg.policy.deepspeed_cfg
    if stage is not None:
        assert (ds.zero_stage, ds.offload_optimizer, ds.offload_param) == (stage, offload, offload)


def test_presets_are_documented_with_when_to_use_them():
    for make in (get_default_fsdp_preset, get_zero3_preset):
        assert "When:" in make.__doc__
    assert set(PRESETS) == {"fsdp", "zero2", "zero3", "zero3-offload"}


def test_the_fsdp_preset_turns_off_a_deepspeed_config():
    cfg = load_config({"policy": {"deepspeed_cfg": {"enabled": True}}}, **get_default_fsdp_preset())
    assert resolve_backends(cfg).training == "dtensor" and cfg.policy.dtensor_cfg.activation_checkpointing


def test_cli_preset_under_the_overrides(capsys):
    assert main(["validate", "--preset", "zero3-offload", "policy.deepspeed_cfg.offload_param=false"]) == 0
    out = capsys.readouterr().out
    assert "training backend: deepspeed" in out
    cfg = load_config(BUNDLED_RECIPE, overrides=["policy.deepspeed_cfg.offload_param=false"],
                      **get_preset("zero3-offload"))
    assert cfg.policy.deepspeed_cfg.offload_optimizer and not cfg.policy.deepspeed_cfg.offload_param


def test_unknown_preset_is_a_user_error(capsys):
    with pytest.raises(UserError, match="unknown preset 'zero4'; the presets are fsdp, zero2"):
        get_preset("zero4")
    assert main(["validate", "--preset", "zero4"]) == 2
