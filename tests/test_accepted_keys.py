"""A key the config accepts is used, warned about once, or refused -- never silently dropped;
and bad input ends in one clear error. All at validate (or load) time: nothing is trained.

- vLLM's settings given with Hugging Face generation: one warning, only for keys the config sets.
- The settings of a training backend that does not train: one warning a section.
- Unknown names under `env`: refused, with NeMo RL's closest environment name.
- `env.math_default` (NeMo RL's math environment under its other registered name): read as `env.math`.
- `policy.backend: auto` warns about nothing the config did not set.
- Key paths thousands of levels deep (command line and Python): a ConfigError, not a RecursionError.
- `novarl validate` offline names every missing hub resource (model and data) in one error.
"""

from __future__ import annotations

import pytest

from novarl.cli import BUNDLED_RECIPE, main
from novarl.config import load_config
from novarl.errors import ConfigError
from novarl.backends.contract.resolve import check_available, resolve_backends


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["validate", "-c", str(BUNDLED_RECIPE), *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def warnings_of(*overrides: str) -> list[str]:
    cfg = load_config(BUNDLED_RECIPE, overrides=list(overrides))
    return [*cfg.load_warnings, *check_available(cfg, resolve_backends(cfg)).warnings]


def test_vllm_settings_with_hugging_face_generation_are_said_once():
    given = warnings_of("policy.generation.backend=hf", "policy.generation.vllm_cfg.gpu_memory_utilization=0.5",
                        "policy.generation.vllm_cfg.tensor_parallel_size=1", "policy.generation.vllm_cfg.precision=float32",
                        "policy.generation.vllm_kwargs={swap_space: 1}")
    (line,) = [w for w in given if "vLLM's settings, not used" in w]
    # the keys set (a default value set counts), in the schema's order; precision is HF's dtype
    assert line == ("policy.generation.{vllm_cfg.tensor_parallel_size, vllm_cfg.gpu_memory_utilization, vllm_kwargs}: "
                    "vLLM's settings, not used: generation runs on 'hf' (Hugging Face generation reads only "
                    "vllm_cfg.precision, its dtype)")
    assert not any("vllm" in w for w in warnings_of("policy.generation.backend=hf"))  # defaults: nothing said


def test_settings_of_a_training_backend_that_does_not_train_are_said():
    """megatron_cfg / deepspeed_cfg keys set while another backend trains, and dtensor_cfg keys under
    Megatron: one warning per section, the keys set; a section written `enabled: false` (a template, as
    NeMo RL's configs carry) is not said, nor DTensor's LoRA section (every backend's)."""
    def said(*overrides: str) -> list[str]:
        return [w for w in warnings_of(*overrides) if "not used: training runs on" in w]

    assert said("policy.megatron_cfg.tensor_model_parallel_size=2", "policy.megatron_cfg.optimizer.lr=1e-5") == [
        "policy.megatron_cfg.{optimizer.lr, tensor_model_parallel_size}: not used: training runs on 'dtensor' "
        "(policy.megatron_cfg.enabled: true would train on it)"]
    assert said("policy.deepspeed_cfg.zero_stage=3") == [
        "policy.deepspeed_cfg.{zero_stage}: not used: training runs on 'dtensor' (policy.deepspeed_cfg.enabled: "
        "true would train on it)"]
    assert said("policy.megatron_cfg.enabled=true", "policy.dtensor_cfg.activation_checkpointing=true",
                "policy.dtensor_cfg.lora_cfg.dim=4") == [
        "policy.dtensor_cfg.{activation_checkpointing}: not used: training runs on 'megatron'"]
    assert said("policy.megatron_cfg.enabled=false", "policy.megatron_cfg.tensor_model_parallel_size=2") == []
    assert said() == []
    # Megatron's optimizer and schedule are megatron_cfg's (the seeds' rule): the recipe's own are a note
    cfg = load_config(BUNDLED_RECIPE, overrides=["policy.megatron_cfg.enabled=true"])
    assert ("policy.{optimizer, scheduler} not read: Megatron trains with policy.megatron_cfg.optimizer and "
            "policy.megatron_cfg.scheduler") in resolve_backends(cfg).notes


def test_unknown_environment_names_are_refused_with_the_closest():
    with pytest.raises(ConfigError) as info:
        load_config(BUNDLED_RECIPE, overrides=["env.zz_unknown_key=1", "env.maht.num_workers=2"])
    message = str(info.value)
    assert "unknown key 'env.zz_unknown_key': env holds NeMo RL's environments" in message
    assert "unknown key 'env.maht' (did you mean 'math'?)" in message
    # NeMo RL's own environments are known: not built, the block said once and left out
    cfg = load_config(BUNDLED_RECIPE, overrides=["env.dapo.num_workers=2"])
    assert any(w.startswith("env.dapo: NeMo RL's 'dapo' environment is not built") for w in cfg.load_warnings)


def test_nemo_rls_math_default_environment_is_its_math_environment():
    """NeMo RL registers MathEnvironment as both 'math' and 'math_default' (environments/utils.py
    ENV_REGISTRY): env.math_default is read as env.math is, a dataset naming it included."""
    def tree(**env) -> dict:
        return {"data": {"train": {"data_path": "train.jsonl"},
                         "default": {"dataset_name": "ResponseDataset", "env_name": "math_default"}}, "env": env}

    cfg = load_config(tree(math_default={"num_workers": 4}))
    assert cfg.reward.function == "math_verify"
    assert cfg.load_warnings == ("env.math_default: completions are scored by reward.function='math_verify' "
                                 "(math-verify, as NeMo RL's hf_math_verify); num_workers=4 is not used (the reward "
                                 "runs in the driver)",)
    assert load_config(tree(math_default={"math_verify_impl": "dapo_math_verify"})).reward.function == \
        "dapo_math_verify"
    assert load_config(tree(math={"num_workers": 2}, math_default={"num_workers": 1})).load_warnings == (
        "env.math and env.math_default: completions are scored by reward.function='math_verify' (math-verify, as "
        "NeMo RL's hf_math_verify); env.math.num_workers=2 is not used (the reward runs in the driver)",)


def test_backend_auto_warns_only_about_what_the_config_sets():
    from novarl.plan.auto import apply_auto
    from novarl.backends.contract.checks import check_config

    cfg, why = apply_auto(load_config(BUNDLED_RECIPE, overrides=["policy.backend=auto"]), on_gpu=False)
    assert why and check_config(cfg).warnings == []  # not the GAE keys that nobody set


@pytest.mark.parametrize("depth", [65, 5000])
def test_a_key_path_too_deep_is_a_clear_error(capsys, depth):
    path = ".".join(["a"] * depth)
    code, out, err = run(capsys, f"{path}=1")
    assert code == 2 and out == "" and "Traceback" not in err
    assert f"the key path has {depth:,} levels" in err and "no setting is nested more than 64 levels deep" in err
    for overrides, keywords in (([f"{path}=1"], {}), ([], {path.replace(".", "__"): 1})):
        with pytest.raises(ConfigError, match=f"the key path has {depth:,} levels"):
            load_config(BUNDLED_RECIPE, overrides=overrides, **keywords)
    with pytest.raises(ConfigError, match="nested more than 64 levels deep"):  # path and value deep together
        load_config(BUNDLED_RECIPE, **{"__".join(["a"] * 60): {"b": {"c": {"d": {"e": {"f": 1}}}}}})


def test_validate_offline_names_every_missing_hub_resource(capsys, hub_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    code, out, err = run(capsys, "policy.model_name=someorg/nomodel", "data.train_data_path=someorg/nodata",
                         "data.val_data_path=someorg/noheldout")
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith("novarl: error: 3 problems stop this run:"), err
    for name in ("policy.model_name='someorg/nomodel'", "data.train_data_path='someorg/nodata'",
                 "data.val_data_path='someorg/noheldout'"):
        assert f"  - {name}:" in err, err
