"""The Megatron-core training backend, run on CPU ranks (Ray actors, gloo) through
megatron-core's own GPTModel, DDP, optimizers and pipeline schedules, with CUDA's
requests mapped to the CPU (novarl/backends/megatron/cpu.py).

Tensor, pipeline and data parallelism each train like the DTensor backend on the
same samples; the weights synced to the generator are the trained ones; checkpoints
resume and convert offline. The GPU checks are in tests/test_megatron_gpu.py.
"""

import os
import shutil

import pytest
import torch

from novarl.cli import BUNDLED_RECIPE, main
from novarl.config import load_config
from novarl.errors import ConfigError
from novarl.trainer.api import GRPOTrainer
from tests.helpers import HF, train_steps

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

COMMON = ["logger.progress_bar=false", "grpo.max_train_seconds=null", "grpo.val_at_start=false",
          "grpo.val_at_end=false", "policy.train_micro_batch_size=128", "cluster.gpus_per_node=2", HF,
          # the same optimizer and constant schedule for both backends
          "policy.scheduler=[]", "policy.optimizer.kwargs={lr: 4.0e-4, weight_decay: 0.0}",
          "policy.megatron_cfg.optimizer.lr=4.0e-4", "policy.megatron_cfg.optimizer.weight_decay=0.0",
          "policy.megatron_cfg.optimizer.clip_grad=1.0",
          # a frozen reference in the policy's rank processes, laid out like it
          "loss_fn.reference_policy_kl_penalty=0.05"]
MEGATRON = "policy.megatron_cfg.enabled=true"
PACKING_MEGATRON = [MEGATRON, "policy.megatron_cfg.optimizer.lr=0.0", "policy.megatron_cfg.optimizer.weight_decay=0.0"]
"""lr 0 for the micro-batch layout measurements (tests/helpers/packing.py)."""


@pytest.fixture(scope="module", autouse=True)
def megatron_on_cpu(tmp_path_factory):
    ray = pytest.importorskip("ray")
    saved = {k: os.environ.get(k) for k in ("NOVARL_MEGATRON_ON_CPU", "NRL_MEGATRON_CHECKPOINT_DIR")}
    os.environ["NOVARL_MEGATRON_ON_CPU"] = "1"
    os.environ["NRL_MEGATRON_CHECKPOINT_DIR"] = str(tmp_path_factory.mktemp("megatron_cache"))
    yield
    ray.shutdown()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def two_kv_heads(tmp_path_factory):
    """tiny-arith with its one key/value head duplicated into two: the same function (each of
    the 2 query heads reads an identical copy), but tensor parallelism can now split it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from novarl.models.loading import resolve_model_path

    source = resolve_model_path("tiny-arith")
    config = AutoConfig.from_pretrained(source)
    config.num_key_value_heads = 2
    state = AutoModelForCausalLM.from_pretrained(source).state_dict()
    for name in list(state):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            state[name] = torch.cat([state[name], state[name]])
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(state)
    folder = tmp_path_factory.mktemp("models") / "tiny-arith-kv2"
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(source, name), folder / name)
    return folder


def run(tmp_path, steps, model, *overrides):
    cfg = load_config(BUNDLED_RECIPE, overrides=[f"logger.log_dir={tmp_path / 'logs'}", f"grpo.max_num_steps={steps}",
                                                 f"policy.model_name={model}", *COMMON, *overrides])
    result = GRPOTrainer(cfg).train()
    return result, train_steps(result.output_dir)


@pytest.fixture(scope="module")
def dtensor_steps(tmp_path_factory, two_kv_heads):
    """FSDP2 on 2 ranks: what every Megatron layout must match."""
    return run(tmp_path_factory.mktemp("dtensor"), 3, two_kv_heads)[1]


def assert_same_training(got, expected, *, loss_abs=1e-6, rel=1e-3):
    """Megatron's kernels (fused q/k/v, its RMSNorm, rotary and softmax) sum in another order
    than Hugging Face's: on one batch the gradient norms agree to 1e-8, but across a GRPO step
    the ratio to the old logprobs is 1 +- 1e-6 rather than exactly 1, and the step-1 gradient
    norm moves by about 7e-5 relative, which Adam's normalised updates carry into later steps'
    losses and KL terms; hence 1e-3 relative here (DeepSpeed, which runs the same Hugging Face
    module as DTensor, is held to 1e-4)."""
    assert sorted(got) == sorted(expected)
    for step in expected:
        # the same samples (the generator gets the same weights each step), hence the same loss and
        # gradients, up to the order of floating-point sums
        assert got[step]["reward_mean"] == expected[step]["reward_mean"]
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=rel, abs=loss_abs)
        assert got[step]["grad_norm"] == pytest.approx(expected[step]["grad_norm"], rel=rel)
        # Megatron's logprobs agree with the generator's, which got Megatron's weights back
        assert got[step]["logprob_mismatch_max"] < 1e-4


@pytest.mark.parametrize("layout", [
    ["policy.megatron_cfg.tensor_model_parallel_size=2"],
    # logprob micro-batches of 96 leave a short last one, padded for the pipeline's buffers
    ["policy.megatron_cfg.pipeline_model_parallel_size=2", "policy.logprob_batch_size=96"],
    # data parallel, with the replicated optimizer and full recomputation
    ["policy.megatron_cfg.optimizer.use_distributed_optimizer=false", "policy.megatron_cfg.activation_checkpointing=true"],
], ids=["tp2", "pp2", "dp2-replicated-optimizer-recompute"])
def test_megatron_layout_trains_like_dtensor(tmp_path, two_kv_heads, dtensor_steps, layout):
    result, got = run(tmp_path, 3, two_kv_heads, MEGATRON, *layout)
    assert_same_training(got, dtensor_steps)
    assert all(got[s]["grad_norm"] > 0 for s in got)
    assert (result.model_dir / "model.safetensors").is_file()


def test_resume_matches_and_the_checkpoint_converts_offline(tmp_path, two_kv_heads):
    """Distributed optimizer over 2 data-parallel ranks: its partitioned state round-trips; another
    layout is refused."""
    ckpt = ["checkpointing.enabled=true", "checkpointing.save_period=2", "checkpointing.keep_top_k=10",
            f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", MEGATRON]
    full, expected = run(tmp_path / "full", 4, two_kv_heads, *ckpt)
    shutil.rmtree(tmp_path / "ckpt" / "step_4")  # as if the run had died after step 3
    _, got = run(tmp_path / "resumed", 4, two_kv_heads, *ckpt)
    assert sorted(got) == [3, 4]  # went on from step_2
    assert_same_training(got, {s: expected[s] for s in (3, 4)}, loss_abs=1e-7, rel=1e-6)

    from transformers import AutoModelForCausalLM

    assert main(["convert", str(tmp_path / "ckpt" / "step_4"), str(tmp_path / "hf")]) == 0
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    final = AutoModelForCausalLM.from_pretrained(full.model_dir).state_dict()
    assert converted.keys() == final.keys()
    assert all(torch.equal(converted[k], final[k]) for k in final)

    # the same checkpoint under another layout (tensor parallel 2 instead of data parallel 2) is refused
    with pytest.raises(Exception, match="Resume with the same layout"):
        run(tmp_path / "other", 5, two_kv_heads, *ckpt, "policy.megatron_cfg.tensor_model_parallel_size=2")


def test_what_megatron_cannot_run_is_refused_together(tmp_path):
    """One message lists every problem, before any rank starts."""
    with pytest.raises(ConfigError) as err:
        run(tmp_path, 1, "tiny-arith", MEGATRON, "policy.megatron_cfg.converter_type=Qwen2ForCausalLM",
            "policy.megatron_cfg.expert_model_parallel_size=2", "policy.megatron_cfg.virtual_pipeline_model_parallel_size=2",
            "cluster.gpus_per_node=2")
    message = str(err.value)
    for part in ("converter_type='Qwen2ForCausalLM' does not match the model, a LlamaForCausalLM",
                 "needs a Mixture-of-Experts model", "virtual_pipeline_model_parallel_size"):
        assert part in message
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())


# ---------------------------------------------------------------- generation
def test_megatron_generation_is_greedy_like_hugging_face_on_tp_and_pp_ranks(two_kv_heads):
    """The driver's MegatronGeneration asks the policy's ranks to decode; greedy completions
    equal transformers' for the same weights, prompts of different lengths included. The
    pipeline's ranks are built as the micro-batch layout test's pp2 ranks are (lr 0), and then
    take its measurements (test_packed_and_dynamic_micro_batches_match_padded: one start of 2
    Megatron ranks fewer)."""
    from novarl.backends.generation.hf import HFGeneration
    from novarl.backends.generation.megatron import MegatronGeneration
    from novarl.backends.training.megatron import MegatronPolicy
    from novarl.distributed.ray_group import RayWorkerGroup
    from novarl.backends.remote import RemotePolicy
    from novarl.models.loading import load_tokenizer
    from novarl.types import Prompt, SamplingConfig
    from tests.helpers.packing import FROZEN
    from tests.helpers.stops import assert_stopped_like

    tokenizer = load_tokenizer(str(two_kv_heads))
    prompts = [Prompt(text, tokenizer(text)["input_ids"]) for text in
               ("12+34=", "56+7=", "99+99=", "1+2=", "40+60=", "8+75=")]
    greedy = SamplingConfig(max_new_tokens=4, temperature=0.0)
    expected = [c.text for c in HFGeneration(str(two_kv_heads), tokenizer, max_seq_length=16).generate(prompts, greedy)]
    tp2 = load_config(BUNDLED_RECIPE, overrides=[MEGATRON, f"policy.model_name={two_kv_heads}", *COMMON,
                                                 "policy.megatron_cfg.tensor_model_parallel_size=2"])
    pp2 = load_config(None, overrides=[*FROZEN, "cluster.gpus_per_node=2", *PACKING_MEGATRON,
                                       "policy.megatron_cfg.pipeline_model_parallel_size=2",
                                       "policy.generation.mcore_generation_config.block_size_tokens=2",  # chunked prefill
                                       "policy.generation.mcore_generation_config.buffer_size_gb=1e-6"])  # 1 a batch
    for layout, cfg in (("tp2", tp2), ("pp2", pp2)):
        group = RayWorkerGroup(MegatronPolicy, dict(policy=cfg.policy, model_path=str(two_kv_heads), total_steps=1,
                                                    emulate_cuda=True), world_size=2)
        try:
            generator = MegatronGeneration(RemotePolicy(group), tokenizer, max_seq_length=16,
                                           config=cfg.policy.generation.mcore_generation_config)
            got = generator.generate(prompts, greedy)
            assert [c.text for c in got] == expected, layout
            assert all(c.finish_reason in ("stop", "length") and len(c.logprobs) == len(c.token_ids) for c in got)
            sampled = generator.generate(prompts * 4, SamplingConfig(max_new_tokens=4, temperature=1.0, seed=7))
            assert len({c.text for c in sampled}) > len(prompts)  # it samples
            if layout == "tp2":  # a stop string: cut after the token that completes it, kept (as every engine)
                stop = next(c.text[1] for c in got if len(c.text) > 1)
                stopped = generator.generate(prompts, SamplingConfig(max_new_tokens=4, temperature=0.0,
                                                                     stop_strings=(stop,)))
                assert_stopped_like(got, stopped, stop, tokenizer)
            if layout == "pp2":
                assert_micro_batch_layouts_match(group)
        finally:
            group.shutdown()


def test_grpo_with_megatron_generation_on_the_policy_ranks(tmp_path, two_kv_heads):
    result, got = run(tmp_path, 4, two_kv_heads, MEGATRON, "policy.generation.backend=megatron",
                      "policy.megatron_cfg.tensor_model_parallel_size=2", "grpo.val_at_end=true",
                      "grpo.max_val_samples=64")
    assert all(0 < got[s]["reward_mean"] < 1 and got[s]["grad_norm"] > 0 for s in got)
    # generation and training are the same model: their logprobs agree (the decoder's KV cache
    # and the trainer's full recomputation sum in different orders)
    assert max(got[s]["logprob_mismatch_max"] for s in got) < 1e-4
    assert result.final_accuracy is not None


def test_megatron_generation_cannot_be_dedicated(tmp_path):
    with pytest.raises(ConfigError, match="samples with the policy's own model on its own GPUs"):
        run(tmp_path, 1, "tiny-arith", MEGATRON, "policy.generation.backend=megatron",
            "policy.generation.colocated.enabled=false")


def test_megatron_weights_reach_vllm(tmp_path):
    """The weights go to vLLM through the same name mapping: vLLM's sampling logprobs agree
    with Megatron's recomputed ones after every update."""
    pytest.importorskip("vllm")
    _, got = run(tmp_path, 3, "tiny-arith", MEGATRON, "cluster.gpus_per_node=1", "policy.generation.backend=vllm",
                 "policy.generation.vllm_cfg.enforce_eager=true", "loss_fn.reference_policy_kl_penalty=0.0")
    assert max(got[s]["logprob_mismatch_max"] for s in got) < 1e-3
    assert all(got[s]["grad_norm"] > 0 for s in got)


# ---------------------------------------------------------- experts (MoE)
MOE = [MEGATRON, "policy.megatron_cfg.expert_model_parallel_size=2", "reward.function=tests.helpers.rewards:digit_fraction"]


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    """A random 4-expert, top-2 Mixtral (tests/helpers/models.py) with the bundled tokenizer."""
    from novarl.models.loading import resolve_model_path
    from tests.helpers.models import tiny_moe

    model = tiny_moe("mixtral")
    folder = tmp_path_factory.mktemp("models") / "tiny-mixtral"
    model.save_pretrained(folder)
    source = resolve_model_path("tiny-arith")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(source, name), folder / name)
    return folder


def test_megatron_generation_with_experts_across_replicas_decodes_in_lockstep(tiny_mixtral):
    """Expert parallelism over the 2 data-parallel replicas (ep 2, dp 2): every forward's tokens meet in the
    experts' all-to-all, so the replicas decode in lockstep (as many batches and positions each, until both are
    done) where each stopped on its own share before and the other waited in the all-to-all for ever. Greedy
    completions of prompts of unlike lengths and counts (7 over 2 replicas) equal transformers' (a replica that
    finishes early, or has the shorter share, decodes on)."""
    import dataclasses
    import threading

    from novarl.backends.generation.hf import HFGeneration
    from novarl.backends.generation.megatron import MegatronGeneration
    from novarl.backends.training.megatron import MegatronPolicy
    from novarl.backends.remote import RemotePolicy
    from novarl.distributed.ray_group import RayWorkerGroup
    from novarl.models.loading import load_tokenizer
    from novarl.types import Prompt, SamplingConfig
    from tests.helpers.packing import FROZEN

    tokenizer = load_tokenizer(str(tiny_mixtral))
    prompts = [Prompt(text, tokenizer(text)["input_ids"]) for text in
               ("12+34=", "5+7=", "99+99=", "1+2=", "40+60=", "8+75=", "123+456=")]
    greedy = SamplingConfig(max_new_tokens=5, temperature=0.0)
    expected = [c.text for c in HFGeneration(str(tiny_mixtral), tokenizer, max_seq_length=24).generate(prompts, greedy)]
    cfg = load_config(None, overrides=[*FROZEN, "cluster.gpus_per_node=2", *PACKING_MEGATRON,
                                       "policy.megatron_cfg.expert_model_parallel_size=2"])
    group = RayWorkerGroup(MegatronPolicy, dict(policy=cfg.policy, model_path=str(tiny_mixtral), total_steps=1,
                                                emulate_cuda=True), world_size=2)
    got: list = []
    try:
        generator = MegatronGeneration(RemotePolicy(group), tokenizer, max_seq_length=24,
                                       config=cfg.policy.generation.mcore_generation_config)
        # a batch of one (buffer_size_gb): several batches a replica; the prompts' own seeds, fewer prompts than
        # replicas (the other replica decodes a copy): each sample is its seed's, wherever its prompt went
        one = MegatronGeneration(RemotePolicy(group), tokenizer, max_seq_length=24,
                                 config=cfg.policy.generation.mcore_generation_config.model_copy(
                                     update={"buffer_size_gb": 1e-6}))
        seeded = SamplingConfig(max_new_tokens=5, temperature=1.0, seeds=(11, 12, 13))

        def decode():
            got.append(generator.generate(prompts, greedy))
            got.append(one.generate(prompts[:3], seeded))
            got.append(one.generate(prompts[1:2], dataclasses.replace(seeded, seeds=(12,))))

        decoding = threading.Thread(target=decode, daemon=True)
        decoding.start()
        decoding.join(timeout=180)
        assert not decoding.is_alive(), "the replicas hung in the experts' all-to-all"
        assert [c.text for c in got[0]] == expected
        assert len(got[1]) == 3 and [c.token_ids for c in got[2]] == [got[1][1].token_ids]
    finally:
        group.shutdown()


def test_frozen_router_and_expert_checkpoints(tmp_path, tiny_mixtral):
    """2 experts per expert-parallel rank: the generator's weights (every expert, gathered from both
    ranks) give back Megatron's logprobs; freeze_moe_router (the default) keeps the router as it
    was while the experts train; the checkpoint's expert files convert offline to the exported
    policy. (Expert parallelism's forward and gradients against Hugging Face's, and expert tensor
    parallelism against it: tests/test_megatron_layouts.py.)"""
    from transformers import AutoModelForCausalLM

    ckpt = ["checkpointing.enabled=true", "checkpointing.save_period=2", f"checkpointing.checkpoint_dir={tmp_path / 'c'}"]
    result, got = run(tmp_path, 2, tiny_mixtral, *MOE, *ckpt)
    assert max(got[s]["logprob_mismatch_max"] for s in got) < 1e-4
    before = AutoModelForCausalLM.from_pretrained(tiny_mixtral).state_dict()
    after = AutoModelForCausalLM.from_pretrained(result.model_dir).state_dict()
    assert torch.equal(after["model.layers.0.mlp.gate.weight"], before["model.layers.0.mlp.gate.weight"])
    assert not torch.equal(after["model.layers.0.mlp.experts.down_proj"], before["model.layers.0.mlp.experts.down_proj"])
    assert main(["convert", str(tmp_path / "c" / "step_2"), str(tmp_path / "hf")]) == 0
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert converted.keys() == after.keys() and all(torch.equal(converted[k], after[k]) for k in after)


def test_packed_and_dynamic_micro_batches_match_padded():
    """The same policy (lr 0) under the three micro-batch layouts: token-budgeted micro-batches,
    padded (dynamic) or packed (without Transformer Engine, packed rows through novarl's
    SDPAttention: each sequence's own attention, and its own rotary positions) give the padded
    logprobs, loss and gradient norm over data-parallel ranks (shares gathered back in order),
    and through a pipeline (one buffer shape for every micro-batch: on the generation test's pp2
    ranks, above)."""
    from novarl.backends.training.megatron import MegatronPolicy
    from novarl.distributed.ray_group import RayWorkerGroup
    from novarl.models.loading import resolve_model_path
    from tests.helpers.packing import FROZEN, LAYOUTS, assert_same, layout_results, mixed_batch

    cfg = load_config(None, overrides=[*FROZEN, "cluster.gpus_per_node=2", *PACKING_MEGATRON])
    group = RayWorkerGroup(MegatronPolicy, dict(policy=cfg.policy, model_path=resolve_model_path("tiny-arith"),
                                                total_steps=1), world_size=2)
    try:
        picked = assert_micro_batch_layouts_match(group)
        # without tensor parallelism the output layer picks the following tokens' logprobs chunk by chunk
        # (backends/megatron/picking.py): the same numbers as the whole logits and megatron-core's
        # vocab-parallel cross entropy, and the same gradients (the loss and gradient norm)
        assert group.call("__getattribute__", "picks_logprobs")
        group.call_all("__setattr__", "picking_layer", None)
        whole = layout_results(group, mixed_batch(rows=14, positive=True))
        for layout in LAYOUTS:
            assert_same(whole[layout], picked[layout])
    finally:
        group.shutdown()


def assert_micro_batch_layouts_match(group) -> dict:
    from tests.helpers.packing import assert_same, layout_results, mixed_batch

    results = layout_results(group, mixed_batch(rows=14, positive=True))
    assert_same(results["packed"], results["fixed"])
    assert_same(results["dynamic"], results["fixed"])
    # packed rows ran as packed rows, without Transformer Engine too (novarl's SDPAttention): on this
    # batch fewer tokens than either padded layout (dp2: 320 vs 410 fixed, 360 dynamic; pp2: 320 vs 600, 1120)
    tokens = {layout: result["tokens_computed"] for layout, result in results.items()}
    assert tokens["packed"] < min(tokens["fixed"], tokens["dynamic"]), tokens
    return results
