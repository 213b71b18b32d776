"""Megatron's interleaved pipeline (virtual pipeline stages) and expert tensor parallelism, held
against the plain layouts on the same four spawned gloo ranks (megatron-core on the CPU,
backends/megatron/cpu.py), each layout built in turn in the same processes:

- a 4-layer Llama on 2 data-parallel x 2 pipeline stages, then on 2 stages of 2 interleaved
  chunks each (layers 0 and 2 on stage 0, 1 and 3 on stage 1): the same logprobs, loss and
  gradient norm, the same weights after an optimizer step (every chunk stepped), and a
  checkpoint of the interleaved layout that loads back whole;
- a 4-expert Mixtral on 4 data-parallel ranks with its experts over 2 expert-parallel ranks,
  whole (2 copies of each), then each split over 2 expert-tensor-parallel ranks: the same;
- Mixtral, Qwen2-MoE (a gated shared expert, routing weights not renormalised) and Qwen3-MoE
  (query/key norms), converted and run on expert-parallel ranks: Hugging Face's logprobs, and for
  Mixtral its loss and gradient norm (routers scaled away from ties: see tests/helpers/models.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.spawn import send, spawned

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow

COMMON = ["policy.megatron_cfg.enabled=true", "cluster.gpus_per_node=4", "policy.train_micro_batch_size=4",
          "policy.logprob_batch_size=4", "policy.megatron_cfg.optimizer.lr=1.0e-3",
          "policy.megatron_cfg.optimizer.weight_decay=0.0", "policy.megatron_cfg.scheduler.lr_warmup_iters=0",
          "policy.megatron_cfg.scheduler.lr_decay_style=constant", "policy.max_seq_length=64"]
PIPELINES = {"pp2": ["policy.megatron_cfg.pipeline_model_parallel_size=2"],
             "pp2-vpp2": ["policy.megatron_cfg.pipeline_model_parallel_size=2",
                          "policy.megatron_cfg.virtual_pipeline_model_parallel_size=2"]}
EXPERTS = {"ep2": ["policy.megatron_cfg.freeze_moe_router=false", "policy.megatron_cfg.expert_model_parallel_size=2"],
           "ep2-etp2": ["policy.megatron_cfg.freeze_moe_router=false", "policy.megatron_cfg.expert_model_parallel_size=2",
                        "policy.megatron_cfg.expert_tensor_parallel_size=2"]}


def save_models(folder) -> dict[str, str]:
    """The test models, saved once: a 4-layer Llama (4 query, 2 key/value heads) and 4-expert
    top-2 Mixtral, Qwen2-MoE and Qwen3-MoE (tests/helpers/models.py)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.helpers.models import tiny_moe

    torch.manual_seed(0)
    llama = LlamaConfig(vocab_size=19, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                        intermediate_size=128, num_hidden_layers=4, tie_word_embeddings=True)
    models = {"llama": AutoModelForCausalLM.from_config(llama),
              **{name: tiny_moe(name) for name in ("mixtral", "qwen2_moe", "qwen3_moe")}}
    paths = {}
    for name, model in models.items():
        paths[name] = str(folder / name)
        model.save_pretrained(paths[name])
    return paths


def hf_step(path: str, batch, temperature: float) -> tuple[torch.Tensor, float, float]:
    """Under the Hugging Face model: the batch's token logprobs (each sequence alone, 0 at its
    first), the loss on them and its gradient norm over every weight."""
    from transformers import AutoModelForCausalLM

    from novarl.algorithms.losses import make_loss
    from tests.helpers.packing import LOSS

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = []
    for start, end in zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist()):
        ids = batch.input_ids[start:end]
        logits = model(ids[None]).logits[0, :-1].float() / temperature
        out += [torch.zeros(1), logits.log_softmax(-1).gather(1, ids[1:, None])[:, 0]]
    logprobs = torch.cat(out)
    loss, _ = make_loss(LOSS)(logprobs, batch)
    loss.backward()
    norm = torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]).norm()
    return logprobs.detach(), float(loss), float(norm)


def measure(policy, batch, loss) -> dict:
    """logprobs (at temperature 0.7: packing.HEAD); one step's loss, gradient norm and update;
    logprobs after it; the weights."""
    from tests.helpers.packing import HEAD

    before = policy.forward(batch, HEAD)
    metrics = policy.forward_backward(batch, loss, HEAD)
    metrics.update(policy.optim_step())
    return {"logprobs": before, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
            "after": policy.forward(batch, HEAD), "weights": policy.full_state_dict()}


def layouts_rank(rank: int, world: int, rendezvous: str, results, paths: dict, checkpoint: str) -> None:
    import os
    import warnings

    warnings.filterwarnings("ignore")
    os.environ["NRL_MEGATRON_CHECKPOINT_DIR"] = os.path.join(checkpoint, "conversions")
    import torch.distributed as dist
    from megatron.core import parallel_state

    from novarl.algorithms.losses import make_loss
    from novarl.backends.training.megatron import MegatronPolicy
    from novarl.config import load_config
    from tests.helpers.packing import HEAD, LOSS, mixed_batch

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    batch = mixed_batch(rows=10, longest=30).with_own_counts()
    out = {}

    def build(model: str, overrides: list[str]) -> MegatronPolicy:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        cfg = load_config(None, overrides=[*COMMON, *overrides])
        return MegatronPolicy(cfg.policy, paths[model], total_steps=4, emulate_cuda=True)

    for model in ("qwen2_moe", "qwen3_moe"):  # the conversion, against Hugging Face's forward
        out[model] = build(model, EXPERTS["ep2"]).forward(batch, HEAD)
    for model, layouts in (("llama", PIPELINES), ("mixtral", EXPERTS)):
        for name, overrides in layouts.items():
            policy = build(model, overrides)
            out[name] = measure(policy, batch, make_loss(LOSS))
            out[name]["chunks"] = [list(chunk.layers) for chunk in policy.chunks]
            if name in ("pp2-vpp2", "ep2-etp2"):  # its checkpoint, loaded into a fresh policy of the layout
                folder = os.path.join(checkpoint, name)
                policy.save(folder)
                fresh = build(model, overrides)
                fresh.load(folder)
                out[name]["loaded"] = fresh.full_state_dict()
    send(results, rank, out)


def assert_same_step(got: dict, want: dict) -> None:
    torch.testing.assert_close(got["logprobs"], want["logprobs"], rtol=1e-5, atol=1e-5)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    torch.testing.assert_close(got["after"], want["after"], rtol=1e-5, atol=1e-5)
    assert got["weights"].keys() == want["weights"].keys()
    for name, tensor in want["weights"].items():  # (Adam scales tiny gradients' rounding up: 1 % of lr)
        torch.testing.assert_close(got["weights"][name], tensor, rtol=1e-5, atol=1e-5, msg=name)


def test_interleaved_pipeline_and_expert_tensor_parallelism_train_like_the_plain_layouts(tmp_path):
    from tests.helpers.packing import mixed_batch

    paths = save_models(tmp_path / "models")
    ranks = spawned(layouts_rank, 4, paths, str(tmp_path))
    batch = mixed_batch(rows=10, longest=30).with_own_counts()
    for model in ("qwen2_moe", "qwen3_moe", "mixtral"):  # Megatron's forward of the converted weights is HF's
        want, loss, grad_norm = hf_step(paths[model], batch, temperature=0.7)
        for rank in ranks:
            got = rank[model] if model != "mixtral" else rank["ep2"]["logprobs"]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5, msg=model)
    for rank in ranks:  # and its backward: expert parallelism's gradients are the whole model's
        assert rank["ep2"]["loss"] == pytest.approx(loss, rel=1e-5)
        assert rank["ep2"]["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    # ranks 0 and 1 (data-parallel) are stage 0, ranks 2 and 3 stage 1: stage 0 holds layers 0
    # and 2, stage 1 layers 1 and 3, in two chunks each
    assert [r["pp2"]["chunks"] for r in ranks] == [[[0, 1]]] * 2 + [[[2, 3]]] * 2
    assert [r["pp2-vpp2"]["chunks"] for r in ranks] == [[[0], [2]]] * 2 + [[[1], [3]]] * 2
    for plain, split in (("pp2", "pp2-vpp2"), ("ep2", "ep2-etp2")):
        want = ranks[0][plain]
        assert want["grad_norm"] > 0 and not torch.equal(want["after"], want["logprobs"])  # the step moved
        for rank in ranks:
            assert_same_step(rank[split], rank[plain])
        weights = ranks[0][split]["weights"]  # gathered on rank 0 only
        assert weights and not any(r[split]["weights"] for r in ranks[1:])
        loaded = ranks[0][split]["loaded"]
        assert loaded.keys() == weights.keys() and all(torch.equal(loaded[k], weights[k]) for k in weights)
