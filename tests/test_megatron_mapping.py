"""megatron_cfg -> megatron-core objects, and pipeline stages' weights, without ranks."""

import pytest
import torch

from novarl.backends.megatron.convert import LayerShape, hf_to_megatron, megatron_to_hf, shards_to_hf
from novarl.backends.megatron.model import check_model, from_stage, to_stage
from novarl.config import load_config
from novarl.cli import BUNDLED_RECIPE
from novarl.errors import ConfigError
from tests.helpers import scalar_reads

pytest.importorskip("megatron.core")


def policy(*overrides):
    return load_config(BUNDLED_RECIPE, overrides=["policy.megatron_cfg.enabled=true", *overrides]).policy


def tiny(layers=4):
    from transformers import AutoConfig

    from novarl.models.loading import resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path("tiny-arith"))
    config.num_hidden_layers = layers
    return config


def transformer_config(*overrides, layers=4):
    from novarl.backends.megatron.model import transformer_config as build

    hf = tiny(layers)
    p = policy(*overrides)
    return build(hf, check_model(hf, p), p, precision="float32", world_size=8)


def test_transformer_config_maps_the_seeds_keys():
    config = transformer_config("policy.megatron_cfg.pipeline_model_parallel_size=2",
                                "policy.megatron_cfg.activation_checkpointing=true",
                                "policy.megatron_cfg.bias_activation_fusion=true")
    assert (config.num_layers, config.hidden_size, config.num_attention_heads, config.num_query_groups,
            config.kv_channels, config.ffn_hidden_size) == (4, 128, 2, 1, 64, 256)
    assert config.normalization == "RMSNorm" and config.gated_linear_unit and not config.add_bias_linear
    assert config.pipeline_model_parallel_size == 2 and config.params_dtype == torch.float32
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == \
        ("full", "uniform", 1)
    assert config.bias_activation_fusion and config.calculate_per_token_loss
    assert transformer_config("policy.megatron_cfg.recompute_granularity=selective").recompute_granularity == \
        "selective"
    assert transformer_config().recompute_granularity is None


def test_swiglu_is_fused_by_default_on_cuda_gpus_only(monkeypatch):
    """megatron_cfg.bias_activation_fusion unset: megatron-core's fused SwiGLU on a CUDA GPU (as NeMo RL's recipes
    set it), not on the CPU (where it would only compile); set, as set. (The fused layers on a GPU:
    tests/test_megatron_gpu.py, which runs with the default.)"""
    assert not transformer_config().bias_activation_fusion
    assert not transformer_config("policy.megatron_cfg.bias_activation_fusion=false").bias_activation_fusion
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert transformer_config().bias_activation_fusion
    assert not transformer_config("policy.megatron_cfg.bias_activation_fusion=false").bias_activation_fusion


def test_features_that_need_transformer_engine_are_refused_without_it():
    from novarl.backends.megatron.model import transformer_engine_available

    if transformer_engine_available():
        pytest.skip("Transformer Engine is installed here")
    with pytest.raises(ConfigError, match="fp8_cfg.enabled needs Transformer Engine"):
        transformer_config("policy.megatron_cfg.fp8_cfg={enabled: true}")
    with pytest.raises(ConfigError, match="context_parallel_size=2: megatron-core splits sequences only in "
                                          "Transformer Engine's attention"):
        transformer_config("policy.megatron_cfg.context_parallel_size=2")
    with pytest.raises(ConfigError, match="sequence_parallel needs Transformer Engine"):
        from novarl.backends.megatron.model import transformer_config as build

        hf = tiny()
        hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim = 4, 2, 32
        p = policy("policy.megatron_cfg.tensor_model_parallel_size=2", "policy.megatron_cfg.sequence_parallel=true")
        build(hf, check_model(hf, p), p, precision="float32", world_size=2)


def test_a_fusion_without_its_kernel_is_a_config_error():
    from novarl.backends.megatron.model import transformer_engine_available

    if transformer_engine_available():
        pytest.skip("Transformer Engine is installed here")
    with pytest.raises(ConfigError, match="megatron-core refused the model's configuration: apply_rope_fusion"):
        transformer_config("policy.megatron_cfg.apply_rope_fusion=true")


def test_without_transformer_engine_the_layers_attend_through_sdpa():
    """megatron-core's local layers, dense and Mixture-of-Experts, with novarl's SDPA core
    attention in place of its unfused DotProductAttention (packed rows included)."""
    from novarl.backends.megatron.attention import SDPAttention
    from novarl.backends.megatron.model import layer_spec, transformer_engine_available
    from novarl.backends.megatron.model import transformer_config as build
    from tests.helpers.models import tiny_moe

    if transformer_engine_available():
        pytest.skip("Transformer Engine is installed here: its layer spec is used")
    mixtral = tiny_moe("mixtral").config
    moe = build(mixtral, check_model(mixtral, policy()), policy(), precision="float32", world_size=1)
    for config in (transformer_config(), moe):
        attention = layer_spec(config).submodules.self_attention.submodules
        assert attention.core_attention is SDPAttention
    assert layer_spec(moe).submodules.mlp.module.__name__ == "MoELayer"  # still the experts' spec


def test_pipeline_stages_cut_and_join_the_weights():
    from transformers import AutoModelForCausalLM

    hf_config = tiny(layers=4)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config).state_dict()
    shape = LayerShape.from_hf_config(hf_config)
    full = hf_to_megatron(hf, shape)
    # three stages, uneven: 1 + 2 + 1 layers
    stages = [(0, range(0, 1)), (1, range(1, 3)), (2, range(3, 4))]
    parts = []
    for stage, layers in stages:
        local = to_stage(full, layers, first=stage == 0, last=stage == 2, tied=shape.tied)
        assert sorted({k.split(".")[2] for k in local if k.startswith("decoder.layers.")}) == \
            [str(i) for i in range(len(layers))]  # renumbered from 0 on each stage
        assert ("embedding.word_embeddings.weight" in local) == (stage == 0)
        assert ("output_layer.weight" in local) == (stage == 2)  # the tied head's own copy
        parts.append((0, stage, from_stage(local, layers)))
    back = shards_to_hf(parts, shape, tensor_parallel_size=1, fused_norms=False)
    assert back.keys() == megatron_to_hf(full, shape).keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_stage_sizes_follow_first_and_last_stage_settings():
    from types import SimpleNamespace

    from novarl.backends.megatron.model import _layers_on_stage

    config = SimpleNamespace(num_layers=10, pipeline_model_parallel_size=4, num_layers_in_first_pipeline_stage=1,
                             num_layers_in_last_pipeline_stage=1)
    assert [_layers_on_stage(config, s) for s in range(4)] == [1, 4, 4, 1]
    even = SimpleNamespace(num_layers=8, pipeline_model_parallel_size=4, num_layers_in_first_pipeline_stage=None,
                           num_layers_in_last_pipeline_stage=None)
    assert [_layers_on_stage(even, s) for s in range(4)] == [2, 2, 2, 2]


def test_uneven_layers_without_stage_settings_are_refused():
    with pytest.raises(ConfigError, match="pipeline_model_parallel_size=3 does not divide the 4 layers"):
        check_model(tiny(4), policy("policy.megatron_cfg.pipeline_model_parallel_size=3"))


def test_moe_with_tensor_parallelism_needs_sequence_parallelism():
    from transformers import MixtralConfig

    mixtral = MixtralConfig(vocab_size=19, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4)
    with pytest.raises(ConfigError) as err:
        check_model(mixtral, policy("policy.megatron_cfg.tensor_model_parallel_size=2",
                                    "policy.megatron_cfg.expert_model_parallel_size=3",
                                    "policy.megatron_cfg.expert_tensor_parallel_size=5"))
    for part in ("needs sequence_parallel=true", "expert_model_parallel_size=3 must divide the model's 4 experts",
                 "expert_tensor_parallel_size=5 must divide each expert's MLP size 96"):
        assert part in str(err.value)
    assert check_model(mixtral, policy("policy.megatron_cfg.expert_model_parallel_size=2")).num_experts == 4
    # experts split over ranks that also split the data: megatron-core reduces them as dense weights
    # unless they are expert-parallel too
    with pytest.raises(ConfigError, match="expert_tensor_parallel_size=2 with expert_model_parallel_size=1 must "
                                          "equal tensor_model_parallel_size=1"):
        check_model(mixtral, policy("policy.megatron_cfg.expert_tensor_parallel_size=2"))
    check_model(mixtral, policy("policy.megatron_cfg.expert_tensor_parallel_size=2",
                                "policy.megatron_cfg.expert_model_parallel_size=2"))


def test_virtual_pipeline_stages_map_and_must_cut_every_stage_evenly():
    config = transformer_config("policy.megatron_cfg.pipeline_model_parallel_size=2",
                                "policy.megatron_cfg.virtual_pipeline_model_parallel_size=2")
    assert config.virtual_pipeline_model_parallel_size == 2
    # pp 2 meets the same peer both ways: sends one by one, paired by parity (see model.py)
    assert not config.batch_p2p_comm
    assert transformer_config().virtual_pipeline_model_parallel_size is None
    with pytest.raises(ConfigError) as err:
        check_model(tiny(6), policy("policy.megatron_cfg.pipeline_model_parallel_size=2",
                                    "policy.megatron_cfg.virtual_pipeline_model_parallel_size=2",
                                    "policy.generation.backend=megatron"))
    assert "stages' layers must split into 2 equal chunks (6 layers)" in str(err.value)
    assert "decoding runs one model chunk per stage" in str(err.value)
    with pytest.raises(ConfigError, match="it needs pipeline_model_parallel_size > 1"):
        check_model(tiny(4), policy("policy.megatron_cfg.virtual_pipeline_model_parallel_size=2"))
    # uneven stages: each stage's layers in vpp chunks (first 2, middle 4 + 4, last 2 on 4 stages)
    check_model(tiny(12), policy("policy.megatron_cfg.pipeline_model_parallel_size=4",
                                 "policy.megatron_cfg.virtual_pipeline_model_parallel_size=2",
                                 "policy.megatron_cfg.num_layers_in_first_pipeline_stage=2",
                                 "policy.megatron_cfg.num_layers_in_last_pipeline_stage=2"))


def test_a_sliding_window_shorter_than_the_sequences_is_refused():
    hf = tiny()
    hf.sliding_window = 8
    with pytest.raises(ConfigError, match="sliding window of 8 tokens.*max_seq_length=16 must be at most 8"):
        check_model(hf, policy())
    hf.sliding_window = 4096  # longer than any sequence: the window never cuts
    check_model(hf, policy())


def test_the_critic_section_is_checked_like_the_policy_and_must_share_its_virtual_stages():
    """PPO's critic (`value`, which has no generation section) goes through the same checks with
    interleaving and context parallelism; its virtual stages must be the policy's (one
    megatron-core layout per process)."""
    layout = ["grpo.adv_estimator.name=gae", "value={}", "policy.megatron_cfg.pipeline_model_parallel_size=2",
              "policy.megatron_cfg.virtual_pipeline_model_parallel_size=2", "policy.megatron_cfg.context_parallel_size=2"]
    cfg = load_config(BUNDLED_RECIPE, overrides=["policy.megatron_cfg.enabled=true", *layout])
    assert cfg.value.generation is None
    assert check_model(tiny(4), cfg.value).num_layers == 4
    with pytest.raises(ConfigError, match="context_parallel_size=2 with policy.generation.backend='megatron'"):
        check_model(tiny(4), policy(*layout[2:], "policy.generation.backend=megatron"))
    with pytest.raises(Exception, match="value.megatron_cfg.virtual_pipeline_model_parallel_size=None differs"):
        load_config(BUNDLED_RECIPE, overrides=["policy.megatron_cfg.enabled=true", *layout,
                                               "value.megatron_cfg.virtual_pipeline_model_parallel_size=null"])


def test_gradient_norms_without_apex_are_computed_on_the_device():
    """megatron-core's fallback L2 norm (no Transformer Engine, no Apex) reads every tensor's norm on the
    host; novarl's (backends/training/megatron_optim.py foreach_l2_norm, in its place once an optimizer is
    built) is the norm of all the tensors together, with no value read back."""
    from megatron.core.optimizer import clip_grads

    from novarl.backends.training.megatron_optim import foreach_l2_norm

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=gen) for shape in ((64, 32), (32,), (7, 3, 5), (1,))]
    with scalar_reads() as reads:
        ours, _ = foreach_l2_norm(2048 * 32, None, [grads], False)
    assert reads.count == 0 and ours.shape == (1,) and ours.dtype == torch.float32
    want = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))
    torch.testing.assert_close(ours[0], want, rtol=1e-6, atol=0)
    assert float(foreach_l2_norm(0, None, [[]], False)[0]) == 0.0
    if clip_grads.l2_norm_impl.__module__ == "megatron.core.utils":  # (Apex's or Transformer Engine's stay)
        from novarl.backends.training.megatron_optim import _norms_without_host_reads

        _norms_without_host_reads()
        assert clip_grads.l2_norm_impl is foreach_l2_norm


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_adam_behind_megatron_core_takes_the_fused_kernel_mid_run_with_the_same_updates(device):
    """megatron_optim.fuse_adam: torch's AdamW, which megatron-core steps where neither Transformer Engine nor
    Apex is installed (foreach), switched to the fused kernel where its parameters are on the device type
    asked (CUDA in a run; the CPU's fused kernel here too), after a step and a round trip of its state
    through a checkpoint's form (as MegatronPolicy.load does: foreach groups, step counts on the CPU, moved
    to the parameters' device): the updates of the foreach twin; on another device type it is left as it is."""
    from types import SimpleNamespace

    from novarl.backends.training.megatron_optim import _load_optimizer_state, _optimizer_state, fuse_adam

    torch.manual_seed(0)
    first = [torch.nn.Parameter(torch.randn(5, 3, device=device)), torch.nn.Parameter(torch.randn(7, device=device))]
    twins = [first, [torch.nn.Parameter(p.detach().clone()) for p in first]]
    fused, plain = (torch.optim.AdamW(params, lr=0.1, weight_decay=0.01) for params in twins)
    fuse_adam(SimpleNamespace(optimizer=fused), device_types=("mps",))  # parameters elsewhere: left as it is
    assert not fused.param_groups[0]["fused"]
    for step in range(3):
        if step == 1:  # the state as a checkpoint holds it, loaded into a foreach AdamW, then fused
            saved = _optimizer_state(SimpleNamespace(optimizer=fused))
            fused = torch.optim.AdamW(first, lr=0.1, weight_decay=0.01)
            wrapped = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=fused)])  # megatron-core's chain
            with torch.no_grad():  # (as MegatronPolicy.load runs)
                _load_optimizer_state(SimpleNamespace(optimizer=fused), saved)
            fuse_adam(wrapped, device_types=(device,))
            assert all(fused.state[p]["step"].device == p.device for p in first)
        grads = [torch.randn_like(p) for p in first]
        for params, optimizer in zip(twins, (fused, plain)):
            for param, grad in zip(params, grads):
                param.grad = grad.clone()
            optimizer.step()
    assert fused.param_groups[0]["fused"] and not fused.param_groups[0]["foreach"]
    assert not plain.param_groups[0]["fused"]
    for a, b in zip(*twins):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
