"""FP8 generation (policy.generation.vllm_cfg.precision: fp8, NeMo RL's key): vLLM's online FP8
quantization. The engine arguments are checked here against the installed vLLM's own parsing; no
FP8 kernel runs on CPU, so a CPU host is told in one line that only a GPU host runs it."""

from __future__ import annotations

import os

import pytest
import torch

from novarl.backends.generation.vllm import fp8_engine_args
from novarl.cli import main
from novarl.config import load_config
from novarl.config.schema import VllmConfig
from novarl.models.loading import resolve_model_path
from novarl.backends.contract.resolve import check_available, resolve_backends
from novarl.trainer.setup import generation_precision

DEEP_GEMM = {"VLLM_USE_DEEP_GEMM": "1", "VLLM_USE_DEEP_GEMM_E8M0": "0"}


def test_only_fp8_gets_quantization_arguments():
    tiny = resolve_model_path("tiny-arith")
    for precision in (None, "bfloat16", "float32"):
        assert fp8_engine_args(VllmConfig(precision=precision, use_deep_gemm=True), tiny) == ({}, {})
    assert fp8_engine_args(VllmConfig(precision="fp8"), tiny) == ({"quantization": "fp8_per_block"}, {})
    assert fp8_engine_args(VllmConfig(precision="fp8", use_deep_gemm=True), tiny)[1] == DEEP_GEMM


def test_fp8_computes_in_the_policys_dtype_and_the_sync_sends_it():
    cfg = load_config(None, overrides=["policy.generation.vllm_cfg.precision=fp8", "policy.precision=bfloat16"])
    assert generation_precision(cfg, torch.device("cuda")) == "bfloat16"
    cfg = load_config(None, overrides=["policy.generation.vllm_cfg.precision=fp8"])  # policy.precision unset
    assert generation_precision(cfg, torch.device("cuda")) == "bfloat16"


def test_layers_kept_in_bf16_are_named_by_patterns_vllm_matches():
    """NeMo RL's num_first/last_layers_in_bf16 and quantization_ignored_layer_kws become
    quantization_config.ignore; the installed vLLM resolves them to 128 x 128 FP8 blocks and
    skips exactly those layers (fused q/k/v and gate/up included, layer 1 not taken for 10)."""
    tiny = resolve_model_path("tiny-arith")  # 2 decoder layers
    v = VllmConfig(precision="fp8", num_first_layers_in_bf16=1, num_last_layers_in_bf16=1,
                   quantization_ignored_layer_kws=["lm_head"])
    args, _ = fp8_engine_args(v, tiny)
    assert args == {"quantization": "fp8_per_block", "quantization_config": {"ignore": [
        "*layers.0.*", "*layer.0.*", "*transformer.h.0.*", "*layers.1.*", "*layer.1.*", "*transformer.h.1.*",
        "*lm_head*"]}}
    pytest.importorskip("vllm")
    from vllm.config.quantization import resolve_quantization_config
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer

    resolved = resolve_quantization_config(args["quantization"], args["quantization_config"])
    assert resolved.linear.weight.dtype == torch.float8_e4m3fn
    assert tuple(resolved.linear.weight.scale.group_shape) == (128, 128)
    first, _ = fp8_engine_args(VllmConfig(precision="fp8", num_first_layers_in_bf16=2), tiny)
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def ignored(name: str) -> bool:
        return should_ignore_layer(name, ignore=first["quantization_config"]["ignore"], fused_mapping=fused,
                                   use_fnmatch=True)

    assert ignored("model.layers.0.self_attn.qkv_proj") and ignored("model.layers.1.mlp.gate_up_proj")
    assert not ignored("model.layers.10.mlp.down_proj") and not ignored("model.layers.2.self_attn.o_proj")


def test_fp8_arguments_reach_the_engine_in_the_policys_dtype(monkeypatch):
    """VllmGeneration passes them to vllm.LLM (recorded there: no engine starts) and sets
    DeepGEMM's environment before vLLM reads it."""
    vllm = pytest.importorskip("vllm")
    from novarl.backends.generation.vllm import VllmGeneration

    class Recorded(Exception):
        pass

    seen: dict = {}

    def recording_llm(**kwargs):
        seen.update(kwargs)
        raise Recorded

    monkeypatch.setattr(vllm, "LLM", recording_llm)
    for key in DEEP_GEMM:
        monkeypatch.setenv(key, "unset")  # restored when the test ends
    cfg = load_config(None, overrides=["policy.generation.vllm_cfg.precision=fp8",
                                       "policy.generation.vllm_cfg.use_deep_gemm=true"])
    with pytest.raises(Recorded):
        VllmGeneration(resolve_model_path("tiny-arith"), None, cfg.policy.generation,
                       precision=generation_precision(cfg, torch.device("cuda")), max_seq_length=16)
    assert (seen["quantization"], seen["dtype"]) == ("fp8_per_block", "bfloat16")
    assert {key: os.environ[key] for key in DEEP_GEMM} == DEEP_GEMM


def test_a_cpu_host_is_told_fp8_needs_a_gpu_in_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("novarl.host.has_cuda", lambda: False)
    code = main(["validate", "policy.generation.vllm_cfg.precision=fp8", "policy.precision=bfloat16"])
    out, err = capsys.readouterr()
    assert code == 0, err
    (line,) = [line for line in out.splitlines() if "valid for a GPU host" in line]
    assert ("a CUDA GPU of compute capability 7.5 or newer for policy.generation.vllm_cfg.precision='fp8' (vLLM's "
            "online FP8 quantization: FP8 matmuls on Hopper and Blackwell, FP8 weights through vLLM's Marlin kernels, "
            "computed in the policy's dtype, on Turing, Ampere and Ada); this host has none: set it to null") in line


def test_the_gpus_named_are_those_vllms_online_fp8_runs_on():
    """The installed vLLM's own figures behind the line above: fp8_per_block is its online
    quantization, from compute capability 7.5, in bfloat16 or float16; CUTLASS's block-scaled FP8
    kernels start at Hopper, and Marlin (FP8 weights) is chosen before Triton below it."""
    pytest.importorskip("vllm")
    from vllm.model_executor.kernels.linear import _POSSIBLE_FP8_BLOCK_KERNELS
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.platforms import PlatformEnum

    online = get_quantization_config("fp8_per_block")
    assert online.get_min_capability() == 75
    assert set(online.get_supported_act_dtypes()) == {torch.bfloat16, torch.float16}
    names = [kernel.__name__ for kernel in _POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CUDA]]
    assert names.index("MarlinFP8ScaledMMLinearKernel") < names.index("TritonFp8BlockScaledMMKernel")


def test_fp8_with_a_float32_policy_is_refused_at_validate(capsys, monkeypatch, tmp_path):
    """vLLM's online FP8 computes in bfloat16 or float16 only, and the engine takes the policy's
    dtype: refused on any host (not 'valid for a GPU host'), saying what to set."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("novarl.host.has_cuda", lambda: True)
    code = main(["validate", "policy.generation.vllm_cfg.precision=fp8", "policy.precision=float32",
                 "policy.generation.backend=vllm"])
    _, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err
    assert ("FP8 generation computing in float32 (policy.precision='float32' with policy.generation.vllm_cfg."
            "precision='fp8'): vLLM's online FP8 computes in bfloat16 or float16 only; set policy.precision to "
            "bfloat16") in err
    for precision in ("bfloat16", "float16"):
        cfg = load_config(None, overrides=["policy.generation.vllm_cfg.precision=fp8", f"policy.precision={precision}",
                                           "policy.generation.backend=vllm"])
        assert not any("float32" in m for m in check_available(cfg, resolve_backends(cfg)).missing)


def test_fp8_is_refused_for_other_engines_and_its_keys_are_said_unused_without_it():
    cfg = load_config(None, overrides=["policy.generation.vllm_cfg.precision=fp8", "policy.generation.backend=hf"])
    (refused,) = check_available(cfg, resolve_backends(cfg)).missing
    assert refused.startswith("FP8 generation by 'hf' (policy.generation.vllm_cfg.precision='fp8'")
    cfg = load_config(None, overrides=["policy.generation.vllm_cfg.use_deep_gemm=true",
                                       "policy.generation.vllm_cfg.num_last_layers_in_bf16=2"])
    warnings = [w for w in check_available(cfg, resolve_backends(cfg)).warnings if "FP8" in w]
    assert warnings == [f"policy.generation.vllm_cfg.{key} is set and applies to FP8 generation (vllm_cfg.precision: "
                        "fp8), which is off: it is not used" for key in ("use_deep_gemm", "num_last_layers_in_bf16")]
    assert not any("use_deep_gemm" in w for w in cfg.load_warnings)  # said once, by the check above


@pytest.mark.parametrize("key, value", [("is_mx", "true"), ("pow2_weight_scaling_factors", "true"),
                                        ("pow2_activation_scaling_factors", "true"), ("kv_cache_dtype", "fp8")])
def test_nemo_rl_fp8_keys_novarl_does_not_build_are_refused(key, value):
    from novarl.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config(None, overrides=["policy.generation.vllm_cfg.precision=fp8",
                                     f"++policy.generation.vllm_cfg.{key}={value}"])
    assert f"'policy.generation.vllm_cfg.{key}' = " in str(info.value)
