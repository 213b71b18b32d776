"""policy.hf_config_overrides (NeMo RL's key): the overridden model folder in novarl's cache, the
checks that read the overridden config (validate, plan, train), a run that trains and exports
with it, and a bad override refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from novarl.cli import BUNDLED_RECIPE, main
from novarl.config import load_config
from novarl.models.bundled import resolve_bundled
from novarl.models.config_overrides import read_config, with_overrides
from novarl.trainer.api import GRPOTrainer
from tests.helpers import HF, train_steps

TINY = str(resolve_bundled("tiny-arith"))
LONGER = "policy.hf_config_overrides={max_position_embeddings: 128}"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("NOVARL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_overridden_folder_holds_the_overridden_config_and_links_the_rest(cache):
    folder = Path(with_overrides(TINY, {"max_position_embeddings": 128, "rope_scaling": {"type": "linear"}}))
    assert folder.parent == cache / "models" and folder.name.startswith("tiny_arith-")
    config = json.loads((folder / "config.json").read_text())
    original = json.loads((Path(TINY) / "config.json").read_text())
    assert config == {**original, "max_position_embeddings": 128, "rope_scaling": {"type": "linear"}}
    others = sorted(p.name for p in Path(TINY).iterdir() if p.name != "config.json")
    assert sorted(p.name for p in folder.iterdir() if p.name != "config.json") == others
    assert all((folder / name).is_symlink() and (folder / name).resolve() == (Path(TINY) / name).resolve()
               for name in others)
    # made once per model and overrides; other overrides, another folder; none, the model's own
    assert with_overrides(TINY, {"rope_scaling": {"type": "linear"}, "max_position_embeddings": 128}) == str(folder)
    assert with_overrides(TINY, {"max_position_embeddings": 256}) != str(folder)
    assert with_overrides(TINY, {}) == TINY
    assert not [p for p in (cache / "models").iterdir() if p.name.endswith(".partial")]
    assert read_config(TINY, {"max_position_embeddings": 128})["max_position_embeddings"] == 128


def test_validate_reads_the_overridden_positions(capsys, tmp_path):
    """A 64-position model: 128 tokens is refused with vLLM (it refuses such an engine) and warned
    about otherwise, until the override gives it 128 positions."""
    common = [f"logger.log_dir={tmp_path}", "policy.max_seq_length=128"]
    assert main(["validate", *common, "policy.generation.backend=vllm"]) == 2
    assert "policy.max_seq_length=128 is longer than the model's max_position_embeddings=64" in capsys.readouterr().err
    assert main(["validate", *common, "policy.generation.backend=vllm", LONGER]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("#")]
    assert said and not any("longer than the model's" in line or "'policy.hf_config_overrides'" in line
                            for line in said)  # read, so neither warned about nor refused
    assert main(["validate", *common, HF, "policy.hf_config_overrides={max_position_embeddings: 100}"]) == 0
    assert "policy.max_seq_length=128 is longer than the model's max_position_embeddings=100 " \
           "(policy.hf_config_overrides)" in capsys.readouterr().out


def test_a_run_trains_and_exports_with_the_overridden_config(tmp_path, cache, capsys):
    cfg = load_config(BUNDLED_RECIPE, overrides=[
        f"logger.log_dir={tmp_path}", "grpo.max_num_steps=1", "logger.progress_bar=false", "grpo.val_at_start=false",
        "grpo.val_at_end=false", "grpo.num_prompts_per_step=4", "policy.train_micro_batch_size=32",
        "policy.max_seq_length=96", "checkpointing.enabled=true", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        HF, LONGER])
    run = GRPOTrainer(cfg).train()
    assert train_steps(run.output_dir)[1]["grad_norm"] > 0
    (made,) = (cache / "models").iterdir()
    assert f"model: tiny-arith ({made}, its config.json with policy.hf_config_overrides max_position_embeddings); " \
        in capsys.readouterr().err
    exported = json.loads((run.output_dir / "policy" / "config.json").read_text())
    assert exported["max_position_embeddings"] == 128
    # novarl convert writes the checkpoint with the run's config too
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "converted")]) == 0
    assert json.loads((tmp_path / "converted" / "config.json").read_text())["max_position_embeddings"] == 128
    assert json.loads((made / "config.json").read_text())["max_position_embeddings"] == 128


def test_an_override_the_weights_do_not_fit_is_refused_naming_the_key(capsys, tmp_path):
    code = main(["train", f"logger.log_dir={tmp_path / 'runs'}", HF, "policy.hf_config_overrides={hidden_size: 64}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "policy.hf_config_overrides={'hidden_size': 64} applied to policy.model_name=" in err
    assert "model.embed_tokens.weight is [19, 128] in the weights but [19, 64] by config.json" in err
    assert not (tmp_path / "runs").exists()  # refused before the run folder is made


def test_a_critic_of_the_same_model_with_other_overrides_gets_its_own_folder():
    from novarl.models.loading import load_tokenizer
    from novarl.trainer.setup import critic_model_path

    overrides = ["grpo.adv_estimator.name=gae", "value={}", LONGER]
    tokenizer = load_tokenizer(TINY)
    same = load_config(None, overrides=overrides)
    policy_path = with_overrides(TINY, same.policy.hf_config_overrides)
    assert critic_model_path(same, policy_path, tokenizer) == policy_path
    other = load_config(None, overrides=[*overrides, "value.hf_config_overrides={max_position_embeddings: 96}"])
    critic = critic_model_path(other, policy_path, tokenizer)
    assert critic != policy_path and read_config(critic)["max_position_embeddings"] == 96
