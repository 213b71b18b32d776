"""Every registered backend holds to its protocol (backends/protocols.py) on the bundled model, in this
process: each training backend's policy and reference, built through its spec as trainer/setup.py
build_trainers does for one rank, run their verbs on a small real batch; each generation backend's
engine, built from its implementation's `engine_kwargs` as build_generator does, generates greedily
as the model does and follows new weights. A backend that cannot run here is skipped with its spec's reason.

Last, issue 32's proof that one module and one registry line add a generation backend:
tests/helpers/torch_generation.py, registered by one `monkeypatch.setitem`, runs through the
engine conformance test and a 2-step GRPO run of the bundled recipe.
"""

import math

import pytest
import torch

from novarl.algorithms.losses import make_loss
from novarl.backends import registry
from novarl.backends.contract.resolve import resolve_backends
from novarl.backends.protocols import Offloadable, Stoppable
from novarl.cli import BUNDLED_RECIPE
from novarl.config import load_config
from novarl.distributed.local import default_device, ensure_single_process_group
from novarl.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
from novarl.models.scores import Logprobs, Values
from novarl.rollout.batch import build_train_batch
from novarl.trainer.setup import generation_precision, split_prompts
from novarl.types import Completion, SamplingConfig
from tests.helpers import torch_generation, train_steps

QUICK = ["logger.progress_bar=false", "grpo.max_train_seconds=null", "grpo.val_at_start=false",
         "grpo.val_at_end=false", "grpo.max_num_steps=2"]
COVERED_ELSEWHERE = {
    "megatron": "tests/test_megatron_backend.py runs its verbs on emulated CPU ranks (in processes of their own), "
                "tests/test_megatron_gpu.py on a CUDA GPU",
}
"""Where the verbs of a backend skipped here are run."""


def skip_reason(name: str, lines: list[str]) -> str:
    elsewhere = COVERED_ELSEWHERE.get(name)
    return "; ".join(lines) + (f" ({elsewhere})" if elsewhere else "")


@pytest.fixture(scope="module")
def model():
    """(the bundled model's folder, its tokenizer)."""
    path = resolve_model_path("tiny-arith")
    return path, load_tokenizer(path)


def sequence_logprobs(hf_model, batch, temperature: float) -> torch.Tensor:
    """[N] the batch's per-token logprobs under a transformers model, one sequence at a time (0 at
    each sequence's first token): what a training backend's `logprobs` must give."""
    out = torch.zeros(batch.num_tokens)
    with torch.no_grad():
        for start, stop in zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist()):
            ids = batch.input_ids[start:stop]
            scores = torch.log_softmax(hf_model(input_ids=ids[None]).logits[0, :-1].float() / temperature, -1)
            out[start + 1:stop] = scores.gather(-1, ids[1:, None]).squeeze(1)
    return out


def answer_batch(cfg, tokenizer):
    """Two of the bundled task's prompts, each answered right (advantage +1) and wrong (-1), as the
    rollout builds a TrainBatch."""
    completions = []
    for prompt in split_prompts(cfg, tokenizer, "train")[:2]:
        for answer in (prompt.answer, str(int(prompt.answer) + 1)):
            ids = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
            completions.append(Completion(prompt=prompt, token_ids=ids, logprobs=[0.0] * len(ids), text=answer,
                                          finish_reason="stop", policy_version=0))
    return build_train_batch(completions, torch.tensor([1.0, -1.0, 1.0, -1.0]))


def built_roles(spec, cfg, path):
    """(policy, reference) of a training backend on one rank in this process, built as
    trainer/setup.py build_trainers builds them."""
    ensure_single_process_group()
    Policy, Reference = spec.classes()
    common = dict(policy=cfg.policy, model_path=path, **spec.role_arguments())
    device = default_device()
    policy = Policy(device=device, total_steps=4, seed=cfg.grpo.seed, **common,
                    **spec.trainer_arguments(accumulation_steps=1))
    return policy, Reference(device=device, **common)


@pytest.mark.parametrize("name", registry.TRAINING_BACKENDS)
def test_training_backend_runs_its_verbs(name, model, tmp_path):
    spec = registry.training_spec(name)
    cfg = load_config(BUNDLED_RECIPE, overrides=[f"policy.{spec.section}.enabled=true", *QUICK])
    assert resolve_backends(cfg).training == name
    missing, gpu = spec.missing(cfg)
    if missing or gpu:
        pytest.skip(skip_reason(name, [*missing, *gpu]))
    if spec.emulated():
        pytest.skip(skip_reason(name, [(f"{name} runs emulated on the CPU here, which changes torch process-wide: "
                                        "never in the test process")]))
    path, tokenizer = model
    policy, reference = built_roles(spec, cfg, path)
    loss = make_loss(cfg.loss_fn, cfg.policy.generation.max_new_tokens)
    batch = answer_batch(cfg, tokenizer)

    head = Logprobs(cfg.policy.generation.temperature)
    untrained = policy.forward(batch, head).cpu()
    assert untrained.shape == (batch.num_tokens,) and untrained.dtype == torch.float32
    first = batch.cu_seqlens[:-1]  # each sequence's first token, which has no prediction
    assert bool((untrained <= 0).all()) and bool((untrained[first] == 0).all())
    torch.testing.assert_close(untrained, sequence_logprobs(load_causal_lm(path), batch, head.temperature))
    torch.testing.assert_close(reference.forward(batch, head).cpu(), untrained)
    for role in (policy, reference):  # a language model has no value head
        with pytest.raises(TypeError, match="vocabulary head"):
            role.forward(batch, Values())
    batch.generator_logprobs = torch.where(batch.loss_mask, untrained, 0.0)  # as if it had generated them

    def step() -> torch.Tensor:
        metrics = {**policy.forward_backward(batch, loss, head), **policy.optim_step()}
        assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
        return policy.forward(batch, head).cpu()

    stepped = step()
    gain = batch.advantages * batch.loss_mask  # the step raises the right answers' logprobs, lowers the wrong ones'
    assert float((gain * stepped).sum()) > float((gain * untrained).sum())
    torch.testing.assert_close(reference.forward(batch, head).cpu(), untrained)  # the reference stays frozen
    if not torch.cuda.is_available():
        assert policy.gpu_stats() == {}

    policy.save(tmp_path / "checkpoint")
    after_save = step()
    policy.load(tmp_path / "checkpoint")
    assert torch.equal(policy.forward(batch, head).cpu(), stepped)
    assert torch.equal(step(), after_save)  # the optimizer's state and the schedule came back too
    check_export(policy, tokenizer, batch, after_save, tmp_path / "hf", head.temperature)


def check_export(policy, tokenizer, batch, logprobs, folder, temperature: float) -> None:
    """save_hf writes a folder transformers loads, giving the policy's `logprobs` on `batch`; the
    weight sync's buckets hold the same tensors under its names."""
    from transformers import AutoModelForCausalLM

    policy.save_hf(folder, tokenizer)
    exported = AutoModelForCausalLM.from_pretrained(folder)
    torch.testing.assert_close(sequence_logprobs(exported, batch, temperature), logprobs)
    weights = dict(pair for bucket in policy.weight_buckets(2**16, everywhere=True) for pair in bucket)
    state = exported.state_dict()
    assert {n for n, _ in exported.named_parameters()} <= weights.keys() <= state.keys()
    assert all(torch.equal(tensor.cpu(), state[name]) for name, tensor in weights.items())


@pytest.fixture
def test_backend_registered(monkeypatch):
    """The test module's generation backend, added as issue 32 says a backend is: one registry line."""
    monkeypatch.setitem(registry.GENERATION, torch_generation.NAME, torch_generation.__name__)
    monkeypatch.setattr(torch_generation.TorchSampler, "built", [])


def greedy(hf_model, prompt_ids: list[int], max_new_tokens: int, stop: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from a transformers model, one token per forward."""
    ids, tokens, logprobs = list(prompt_ids), [], []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            scores = torch.log_softmax(hf_model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
            token = int(scores.argmax())
            tokens.append(token)
            logprobs.append(float(scores[token]))
            ids.append(token)
            if token == stop:
                break
    return tokens, logprobs


@pytest.mark.usefixtures("test_backend_registered")
@pytest.mark.parametrize("name", [*registry.GENERATION_BACKENDS, torch_generation.NAME])
def test_generation_engine_runs_its_verbs(name, model):
    spec = registry.generation_spec(name)
    owner = next((s for s in registry.training_specs() if s.own_generation == name), None)
    cfg = load_config(BUNDLED_RECIPE, overrides=[f"policy.generation.backend={name}", *QUICK,
                                                 "policy.generation.vllm_cfg.enforce_eager=true",
                                                 *([f"policy.{owner.section}.enabled=true"] if owner else [])])
    if spec.engine_class is None:
        missing, gpu = owner.missing(cfg)
        pytest.skip(skip_reason(name, [(f"{spec.title} generation samples with the {owner.name} policy's own model "
                                        "on its ranks, no engine of its own"), *missing, *gpu]))
    if spec.missing(cfg):
        pytest.skip(skip_reason(name, spec.missing(cfg)))
    path, tokenizer = model
    device = default_device()
    factory = spec.implementation()
    kwargs = factory.engine_kwargs(cfg, model_path=path, tokenizer=tokenizer,
                                   precision=generation_precision(cfg, device))
    engine = factory(**{**kwargs, **({"device": device} if "device" in kwargs else {})})
    try:
        check_engine(engine, cfg, path, tokenizer)
    finally:
        if isinstance(engine, Stoppable):
            engine.shutdown()


def check_engine(engine, cfg, path, tokenizer) -> None:
    """Greedy completions of 2 prompts as the model gives them, before and after new weights."""
    prompts = split_prompts(cfg, tokenizer, "train")[:2]
    sampling = SamplingConfig(max_new_tokens=cfg.policy.generation.max_new_tokens, temperature=0.0)
    hf_model = load_causal_lm(path)

    def generated(version: int) -> list[list[int]]:
        completions = engine.generate(prompts, sampling)
        assert [c.prompt for c in completions] == prompts
        for c in completions:
            assert 1 <= len(c.token_ids) <= sampling.max_new_tokens and len(c.logprobs) == len(c.token_ids)
            assert all(isinstance(t, int) and 0 <= t < len(tokenizer) for t in c.token_ids)
            assert c.policy_version == version and c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
            expected, logprobs = greedy(hf_model, c.prompt.token_ids, sampling.max_new_tokens, tokenizer.eos_token_id)
            assert c.token_ids == expected
            assert c.logprobs == pytest.approx(logprobs, abs=1e-3)
        return [c.token_ids for c in completions]

    before = generated(0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # new weights, moving every one
        for param in hf_model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    engine.update_weights(iter(hf_model.state_dict().items()), version=1)
    if isinstance(engine, Offloadable):  # released and taken back between steps, the weights kept
        engine.offload()
        engine.onload()
    assert generated(1) != before


@pytest.mark.usefixtures("test_backend_registered")
def test_a_generation_backend_of_one_module_and_one_line_trains(tmp_path):
    from novarl.trainer.api import GRPOTrainer

    cfg = load_config(BUNDLED_RECIPE, overrides=[f"policy.generation.backend={torch_generation.NAME}", *QUICK,
                                                 f"logger.log_dir={tmp_path}"])
    result = GRPOTrainer(cfg).train()
    [engine] = torch_generation.TorchSampler.built
    assert engine.generate_calls == 2 and engine.weight_versions == [1, 2]  # it generated each step, then synced
    held, trained = engine.model.state_dict(), load_causal_lm(result.model_dir).state_dict()
    initial = load_causal_lm(resolve_model_path("tiny-arith")).state_dict()
    assert all(torch.equal(held[name], tensor) for name, tensor in trained.items())  # the policy's final weights,
    assert not all(torch.equal(held[name], tensor) for name, tensor in initial.items())  # not the model's first
    steps = train_steps(result.output_dir)
    assert sorted(steps) == [1, 2]
    for record in steps.values():
        assert record["weight_sync_mb"] > 0 and record["grad_norm"] > 0
        assert record["logprob_mismatch"] < 1e-3  # its logprobs are the policy's: the weights followed it
