"""Every command and Python example in README.md runs as written, shortened by overrides
only: two steps, 50 held-out prompts, Hugging Face generation (a vLLM engine start costs
~20 s; tests/test_vllm.py covers vLLM). The files the examples name (my.yaml, a model
folder, a data file) are made in a scratch working directory first.

A README command this file does not know fails the test: a new command in the README
needs a line here."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import novarl
from novarl.cli import main
from novarl.config import BUNDLED_RECIPE
from novarl.models.bundled import resolve_bundled

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
SHORT = ["grpo.max_num_steps=2", "grpo.max_val_samples=50", "policy.generation.backend=hf",
         "logger.progress_bar=false"]
SHORT_KEYWORDS = dict(max_num_steps=2, grpo__max_val_samples=50, policy__generation__backend="hf",
                      logger__progress_bar=False, max_seq_length=16, policy__generation__max_new_tokens=4,
                      # 32 samples a step: a model folder starts from NeMo RL's sizes (512 samples in micro-batches of 4)
                      num_prompts_per_step=8, num_generations_per_prompt=4, policy__train_micro_batch_size=8)

CLUSTER_ONLY = re.compile(r"^(ray start|srun|sleep|head=|RAY_ADDRESS=)")
"""Lines of the multi-node and Slurm examples: they need a cluster."""
NOT_RUN_HERE = {
    "make demo": "`novarl train` on the bundled recipe, run below shortened",
    "make test": "the test suite itself",
}
VALIDATED_HERE = {
    "novarl train -c examples/configs/grpo_tiny_fsdp2x2.yaml": "tests/test_distributed.py trains this recipe on its 2 "
                                                                "ranks (and on one), checking more than this run would",
}
"""Commands whose training another test runs: here `novarl validate` on the same arguments (~25 s of suite time)."""

QWEN_32B_CONFIG = {  # Qwen2.5-32B's config.json shapes, for `novarl plan --model path/to/Qwen2.5-32B`
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 5120,
    "intermediate_size": 27648, "num_hidden_layers": 64, "num_attention_heads": 40,
    "num_key_value_heads": 8, "vocab_size": 152064, "max_position_embeddings": 32768,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def commands() -> list[str]:
    """Every shell line of the README's bash blocks, comments and continuations folded."""
    lines = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line and not line.startswith("#") and not CLUSTER_ONLY.match(line):
                lines.append(line)
    return lines


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A working directory holding what the README's examples name."""
    work = tmp_path_factory.mktemp("readme")
    shutil.copy(BUNDLED_RECIPE, work / "my.yaml")
    shutil.copytree(resolve_bundled("tiny-arith"), work / "path" / "to" / "hf_folder")
    (work / "path" / "to" / "Qwen2.5-32B").mkdir(parents=True)
    (work / "path" / "to" / "Qwen2.5-32B" / "config.json").write_text(json.dumps(QWEN_32B_CONFIG))
    (work / "data").mkdir()
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 20) for b in range(40, 50)]
    (work / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shutil.copytree(ROOT / "examples", work / "examples")
    shutil.copytree(ROOT / "scripts", work / "scripts")
    return work


def test_the_readme_has_the_commands_this_test_runs():
    assert commands()[:2] == ["make demo", "make test"]
    assert any(c.startswith("novarl convert results/grpo") for c in commands())
    assert len(blocks("python")) == 1


def run_command(line: str, capsys) -> tuple[int, str]:
    if line in NOT_RUN_HERE:
        return 0, NOT_RUN_HERE[line]
    argv = shlex.split(line)
    if line in VALIDATED_HERE:
        argv[1] = "validate"
    if argv[:3] == ["python", "-m", "novarl"]:
        proc = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=120)
        return proc.returncode, proc.stdout + proc.stderr
    assert argv[0] == "novarl", f"a README command this test does not know how to run: {line!r}"
    if argv[1] == "train":
        argv += SHORT
    code = main(argv[1:])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_every_readme_command_runs(workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    ran = []
    for line in commands():
        code, output = run_command(line, capsys)
        assert code == 0, f"README command failed: {line}\n{output[-3000:]}"
        ran.append(line)
    # The commands feed each other: train wrote the run eval read, and the checkpoints convert joined.
    assert (workdir / "runs" / "tiny_arith" / "exp_001" / "policy" / "config.json").is_file()
    assert (workdir / "out" / "hf_model" / "model.safetensors").is_file()
    assert any(line.startswith("novarl train -c examples/configs/grpo_tiny_fsdp2x2.yaml") for line in ran)


class ShortTrainer(novarl.GRPOTrainer):
    def __init__(self, config=None, **kwargs):
        super().__init__(config, **{**kwargs, **SHORT_KEYWORDS})


def short_train(*args, **kwargs):
    return novarl.train(*args, **{**kwargs, **SHORT_KEYWORDS})


def test_the_python_examples_run(workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    source = blocks("python")[0]
    assert source.startswith("import novarl\n")
    namespace = {"novarl": SimpleNamespace(train=short_train, GRPOTrainer=ShortTrainer,
                                           load_config=novarl.load_config)}
    exec(compile(source.replace("import novarl\n", "", 1), str(README), "exec"), namespace)
    assert isinstance(namespace["result"], novarl.TrainResult) and namespace["result"].steps == 2
    assert namespace["trainer"].roles is not None
    printed = capsys.readouterr().out
    assert re.search(r"\d+\.\d% -> \d+\.\d%; policy in ", printed), printed
