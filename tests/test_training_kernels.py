"""The fast paths of a training step on a GPU, and their CPU fallbacks: packed attention through
torch's varlen flash kernel (models/attention.py) equals each sequence's own causal attention; the
optimizer is the fused kernel on CUDA and the CPU (backends/training/optim.py); the chunked logprob head
(models/logprob_head.py) in bf16 on CUDA equals the full softmax, and its chunk steps compiled
(fused, where the decoder layers are compiled) equal the eager ones. The CUDA tests skip without
CUDA; the fallbacks, the compiled paths and the choices between them are tested here on the CPU."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from novarl.backends.training.optim import build_optimizer
from novarl.config.schema import OptimizerConfig
from novarl.models import attention
from tests.helpers import scalar_reads

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
LENGTHS = (300, 17, 128, 1, 64)


def per_sequence_attention(query, key, value, lengths):
    """[1, H, T, D] each sequence's causal attention alone, [1, T, H, D] out (the reference)."""
    outs, start = [], 0
    for length in lengths:
        q, k, v = (t[:, :, start:start + length] for t in (query, key, value))
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        outs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        start += length
    return torch.cat(outs, dim=2).transpose(1, 2)


def packed_qkv(device, dtype, heads=8, kv_heads=2, dim=64):
    generator = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    make = lambda h: torch.randn(1, h, total, dim, generator=generator).to(device, dtype).requires_grad_()  # noqa: E731
    cu = torch.nn.functional.pad(torch.tensor(LENGTHS).cumsum(0), (1, 0))
    return make(heads), make(kv_heads), make(kv_heads), cu


def attention_and_grads(fn, query, key, value):
    out = fn(query, key, value)
    weights = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out).to(out.dtype)
    grads = torch.autograd.grad((out * weights).sum(), (query, key, value))
    return out.float(), [g.float() for g in grads]


@pytest.mark.parametrize("device, asked", [("cpu", None), pytest.param("cuda", None, marks=cuda),
                                           pytest.param("cuda", "padded_sdpa", marks=cuda)])
def test_packed_attention_equals_per_sequence_attention(device, asked, monkeypatch):
    """The CPU's float32 takes the padded-rows SDPA path; CUDA's bf16 torch's varlen flash kernel, or
    the kernel NOVARL_PACKED_ATTENTION names."""
    monkeypatch.setattr(attention, "packed_kernel", None)
    monkeypatch.setattr(attention, "ASKED", asked)  # NOVARL_PACKED_ATTENTION, as a process starts with it
    query, key, value, cu = packed_qkv(device, torch.float32 if device == "cpu" else torch.bfloat16)
    module = torch.nn.Module()
    got, got_grads = attention_and_grads(
        lambda q, k, v: attention.varlen_attention(module, q, k, v, None, cu_seq_lens_q=cu, max_length_q=300)[0],
        query, key, value)
    assert attention.packed_kernel == ("padded_sdpa" if device == "cpu" else asked or "flash_varlen")
    with scalar_reads() as reads:  # the longest sequence given: nothing read back from the boundaries' device
        attention.varlen_attention(module, query, key, value, None, cu_seq_lens_q=cu.to(device), max_length_q=300)
    assert reads.count == 0
    want, want_grads = attention_and_grads(lambda q, k, v: per_sequence_attention(q, k, v, LENGTHS),
                                           *(t.detach().float().requires_grad_() for t in (query, key, value)))
    tolerance = 1e-6 if device == "cpu" else 2e-2
    assert (got - want).norm() / want.norm() < tolerance
    for g, w in zip(got_grads, want_grads, strict=True):
        assert (g - w).norm() / w.norm() < tolerance


def test_the_packed_kernel_is_chosen_by_device_dtype_and_novarl_packed_attention(monkeypatch, capsys):
    """The choice alone, for a query as CUDA shows it (this torch has the varlen API: flash_varlen)."""
    from types import SimpleNamespace

    cuda_bf16, cuda_fp32 = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16), SimpleNamespace(is_cuda=True,
                                                                                                dtype=torch.float32)
    choose = attention._packed_choice
    monkeypatch.setattr(attention, "ASKED", None)
    assert choose(torch.zeros(1, dtype=torch.bfloat16), 0.0) == "padded_sdpa"  # the CPU
    assert (choose(cuda_bf16, 0.0), choose(cuda_fp32, 0.0), choose(cuda_bf16, 0.1)) == (
        "flash_varlen" if attention._flash_varlen() else "padded_sdpa", "padded_sdpa", "padded_sdpa")
    monkeypatch.setattr(attention, "ASKED", "padded_sdpa")
    assert choose(cuda_bf16, 0.0) == "padded_sdpa"
    monkeypatch.setattr(attention, "_said", set())
    monkeypatch.setattr(attention, "ASKED", "fa3")
    assert choose(cuda_bf16, 0.0) == choose(cuda_bf16, 0.0) != "fa3"
    capsys.readouterr()
    for _ in range(2):  # a pass, then what it took said (rows.run_model)
        assert attention.varlen_kernel(cuda_bf16, 0.0) is not None and attention._unsaid is not None
        attention.say_attention_path()
    err = capsys.readouterr().err
    assert err.count("NOVARL_PACKED_ATTENTION='fa3' is not a packed attention kernel (flash_varlen, padded_sdpa): "
                     "not used") == 1  # said once
    assert err.count("packed attention: ") == 1 and attention._unsaid is None


def test_compiled_layers_note_the_packed_attention_path_without_a_graph_break(monkeypatch):
    """Packed rows through compiled decoder layers (the CPU's padded-rows path): the attention's note of its path
    for the log is a global's store that the compiled layer replays, not a log call inside it (a graph break
    on CUDA, where the path is said); run_model says it after the pass."""
    from torch._dynamo.utils import counters
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from novarl.backends.training import rows
    from novarl.backends.training.batching import MicroBatching
    from novarl.backends.training.parallelize import apply_compile
    from novarl.types import TrainBatch

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    assert attention.use_varlen_attention(model) == attention.VARLEN
    apply_compile(model)
    ids = torch.randint(1, 64, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.arange(12) < torch.tensor([[12], [9], [5]])
    mb = TrainBatch.from_rows(ids, mask, mask.clone(), torch.zeros(3))
    inputs = rows.model_inputs(mb, MicroBatching("packed", 3, 64, 1), attention.VARLEN)
    notes = []
    monkeypatch.setattr(rows, "say_attention_path", lambda: notes.append(attention._unsaid))
    torch._dynamo.reset()
    counters.clear()
    for _ in range(2):
        attention.packed_kernel, attention._unsaid = None, None
        rows.run_model(model, attention.VARLEN, inputs)
        assert attention.packed_kernel == "padded_sdpa"
    assert notes == [("padded_sdpa", False, torch.float32, False)] * 2
    assert dict(counters["graph_break"]) == {}


def test_shared_keys_read_a_shared_prompt_in_each_row_of_its_group():
    """A group's second row reads its prompt's keys again (fewer queries than keys: the varlen kernel's
    causal attention aligned at the bottom right); groups of single samples share nothing: they are laid out
    as the plain packed row, with no keys gathered."""
    from novarl.backends.training.batching import lay_out
    from novarl.types import TrainBatch

    lengths = torch.tensor([13, 9, 11])
    ids = torch.randint(1, 64, (3, 13), generator=torch.Generator().manual_seed(0))
    ids[1, :5] = ids[0, :5]
    mask = torch.arange(13) < lengths[:, None]
    mb = TrainBatch.from_rows(ids, mask, mask, torch.zeros(3))
    mb.prompt_lengths = torch.tensor([5, 5, 4])
    mb.group_ids = torch.tensor([0, 0, 1])
    keys = lay_out(mb, "packed", 8, share_prompts=True).shared_keys
    assert not torch.equal(keys.cu_queries.diff(), keys.cu_keys.diff())
    assert int(keys.cu_keys[-1] - keys.cu_queries[-1]) == 5  # the prompt's 5 keys twice
    mb.group_ids = torch.tensor([0, 1, 2])
    alone = lay_out(mb, "packed", 8, share_prompts=True)
    assert alone.shared_keys is None and alone.attention_rows is None
    assert torch.equal(alone.cu_seqlens, lay_out(mb, "packed", 8).cu_seqlens)


def test_the_optimizer_is_fused_on_cuda_and_the_cpu_unless_the_config_chooses():
    param = [torch.nn.Parameter(torch.zeros(3))]
    adamw = OptimizerConfig(name="torch.optim.AdamW", kwargs={"lr": 1e-3})
    assert not build_optimizer(adamw, param).defaults.get("fused")  # no device given: torch's default
    assert build_optimizer(adamw, param, torch.device("cpu")).defaults["fused"] is True
    chosen = OptimizerConfig(name="torch.optim.AdamW", kwargs={"lr": 1e-3, "foreach": True})
    assert not build_optimizer(chosen, param, torch.device("cpu")).defaults.get("fused")
    rmsprop = OptimizerConfig(name="torch.optim.RMSprop", kwargs={"lr": 1e-3})  # no fused kernel
    assert "fused" not in build_optimizer(rmsprop, param, torch.device("cpu")).defaults
    # on DTensors (FSDP2's) SGD steps unfused: DTensor has no rule for its fused kernel (it raised), Adam's fuse
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from novarl.distributed.local import ensure_single_process_group

    ensure_single_process_group()
    sharded = [torch.nn.Parameter(distribute_tensor(torch.ones(3), init_device_mesh("cpu", (1,))))]
    sharded[0].grad = distribute_tensor(torch.ones(3), sharded[0].device_mesh)
    sgd = build_optimizer(OptimizerConfig(name="torch.optim.SGD", kwargs={"lr": 0.5}), sharded, torch.device("cpu"))
    assert not sgd.defaults.get("fused") and build_optimizer(OptimizerConfig(name="torch.optim.SGD", kwargs={
        "lr": 0.5}), param, torch.device("cpu")).defaults["fused"] is True
    sgd.step()
    assert torch.equal(sharded[0].full_tensor(), torch.full((3,), 0.5))
    assert build_optimizer(adamw, sharded, torch.device("cpu")).defaults["fused"] is True
    if torch.cuda.is_available():
        on_gpu = [torch.nn.Parameter(torch.zeros(3, device="cuda"))]
        assert build_optimizer(adamw, on_gpu, torch.device("cuda")).defaults["fused"] is True
        assert not build_optimizer(chosen, on_gpu, torch.device("cuda")).defaults.get("fused")


@cuda
def test_chunked_logprobs_on_cuda_in_bf16_equal_the_full_softmax():
    from novarl.models.logprob_head import chunked_logprobs

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3000, 256, generator=generator).cuda().bfloat16().requires_grad_()
    weight = (torch.randn(32_000, 256, generator=generator) / 16).cuda().bfloat16().requires_grad_()
    targets = torch.randint(0, 32_000, (3000,), generator=generator).cuda()
    full = torch.log_softmax(torch.nn.functional.linear(hidden, weight).float(), -1).gather(-1, targets[:, None])[:, 0]
    picked = chunked_logprobs(hidden, weight, targets, 1.0, 700)
    assert torch.allclose(picked, full, atol=1e-4)
    want = torch.autograd.grad(full.sum(), (hidden, weight))
    got = torch.autograd.grad(picked.sum(), (hidden, weight))
    for g, w in zip(got, want, strict=True):
        assert (g.float() - w.float()).norm() / w.float().norm() < 1e-2


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float32), ("cpu", torch.bfloat16),
                                           pytest.param("cuda", torch.bfloat16, marks=cuda)])
def test_fused_chunks_give_the_eager_chunks_numbers(device, dtype):
    from novarl.models.logprob_head import chunked_logprobs

    """fused=True (the decoder layers compiled): each chunk's steps compiled by inductor, the last chunk
    short; logprobs within 1e-5 and gradients within float rounding of the eager steps (float32: 1e-5;
    bf16: the gradients are bf16, within one rounding of each other)."""
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(23, 32, generator=generator).to(device, dtype).requires_grad_()
    weight = (torch.randn(300, 32, generator=generator) / 4).to(device, dtype).requires_grad_()
    targets = torch.randint(0, 300, (23,), generator=generator).to(device)
    upstream = torch.randn(23, generator=generator).to(device)
    results = []
    for fused in (False, True):
        picked = chunked_logprobs(hidden, weight, targets, 0.7, 10, fused=fused)
        results.append((picked, torch.autograd.grad((picked * upstream).sum(), (hidden, weight))))
    (want, want_grads), (got, got_grads) = results
    assert torch.allclose(got, want, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert g.dtype == dtype
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        assert (g.float() - w.float()).norm() / w.float().norm() < tolerance


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=cuda)])
def test_a_vocabulary_part_on_a_group_of_one_gives_the_whole_heads_numbers_without_host_reads(device, dtype):
    """chunked_logprobs' `vocab` mode (Megatron's output layer under tensor parallelism, its chunk steps fused on
    CUDA; over 2 ranks in tests/test_logprob_head.py) on a group of one: the whole vocabulary's logprobs and
    gradients, eager and fused, with nothing read back to the host (its masks and collectives stay on the
    device)."""
    import torch.distributed as dist

    from novarl.distributed.local import ensure_single_process_group
    from novarl.models.logprob_head import chunked_logprobs

    ensure_single_process_group()
    group = dist.new_group([0], backend="nccl" if device == "cuda" else "gloo")
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(23, 32, generator=generator).to(device, dtype).requires_grad_()
    weight = (torch.randn(300, 32, generator=generator) / 4).to(device, dtype).requires_grad_()
    targets = torch.randint(0, 300, (23,), generator=generator).to(device)
    upstream = torch.randn(23, generator=generator).to(device)

    def run(fused: bool, vocab) -> tuple:
        picked = chunked_logprobs(hidden, weight, targets, 0.7, 10, fused=fused, vocab=vocab)
        return picked, torch.autograd.grad((picked * upstream).sum(), (hidden, weight))

    for fused in (False, True):
        want, want_grads = run(fused, None)
        run(fused, (group, 0))  # compiled on first use (fused): outside the count
        with scalar_reads() as reads:
            got, got_grads = run(fused, (group, 0))
        assert reads.count == 0
        assert torch.allclose(got, want, atol=1e-6)
        for g, w in zip(got_grads, want_grads, strict=True):
            assert torch.allclose(g.float(), w.float(), atol=1e-6)


def test_a_chunk_step_that_cannot_compile_runs_eagerly_said_once(monkeypatch, capsys):
    """Where torch.compile fails (no Triton, an old GPU), the fused head's steps run as the eager ones."""
    from novarl.models import logprob_head

    def no_compiler(fn, **_):
        def compiled(*args):
            raise RuntimeError("Cannot find a working triton installation\nmore lines")
        return compiled

    monkeypatch.setattr(torch, "compile", no_compiler)
    step = logprob_head.CompiledOrEager(logprob_head._chunk_forward)
    hidden, weight, targets = torch.randn(5, 8), torch.randn(11, 8), torch.tensor([0, 3, 10, 2, 7])
    for _ in range(2):
        got = step(hidden, weight, targets, 1.0)
        want = logprob_head._chunk_forward(hidden, weight, targets, 1.0)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert capsys.readouterr().err.count("warning: _chunk_forward could not be compiled (RuntimeError: Cannot find a "
                                         "working triton installation); it runs eagerly") == 1


def test_compiled_decoder_layers_give_the_same_logprobs_and_gradients():
    """policy.dtensor_cfg.torch_compile: each decoder layer compiled in place (inductor on the CPU), and
    the picking head's chunk steps (fused), against the eager model with the plain head; no graph break."""
    import copy

    from torch._dynamo.utils import counters
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from novarl.backends.training.batching import MicroBatching
    from novarl.backends.training.parallelize import apply_compile
    from novarl.backends.training.rows import model_logprobs
    from novarl.models.logprob_head import picking_head, use_picking_head
    from novarl.types import TrainBatch

    torch.manual_seed(0)
    eager = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    compiled = copy.deepcopy(eager)
    assert use_picking_head(compiled, rows=7)
    apply_compile(compiled)
    assert picking_head(compiled).fused
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.arange(12) < torch.tensor([[12], [9]])
    mb = TrainBatch.from_rows(ids, mask, mask.clone(), torch.zeros(2))
    results = []
    torch._dynamo.reset()  # traced here, not found in the cache of an earlier test: its graph breaks are counted
    counters.clear()
    for model in (eager, compiled):
        logprobs, _ = model_logprobs(model, None, mb, MicroBatching("fixed", 2, 64, 1), 1.0)
        logprobs.sum().backward()
        results.append((logprobs.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert dict(counters["graph_break"]) == {} and counters["stats"]["unique_graphs"] > 0
    (want, want_grads), (got, got_grads) = results
    assert torch.allclose(got, want, atol=1e-5)
    for name, grad in want_grads.items():
        assert torch.allclose(got_grads[name], grad, atol=1e-5), name


def bottom_right_varlen(query, key, value, cu_queries, cu_keys, longest_queries, longest_keys, scaling):
    """What flash-attention's varlen kernel computes, in plain torch on the CPU: [1, Tq, H, D]."""
    outs = []
    for a in range(len(cu_queries) - 1):
        q = query[:, :, cu_queries[a]:cu_queries[a + 1]]
        k, v = (t[:, :, cu_keys[a]:cu_keys[a + 1]] for t in (key, value))
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        allowed = torch.arange(k.shape[2]) <= torch.arange(q.shape[2])[:, None] + (k.shape[2] - q.shape[2])
        outs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling))
    return torch.cat(outs, dim=2).transpose(1, 2)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_the_varlen_kernels_inputs_give_the_padded_paths_logprobs(shared, device, monkeypatch):
    """A packed micro-batch (with shared prompts: each completion's keys gathered after its prompt's)
    through torch's varlen kernel (CUDA, bf16), or on the CPU through a kernel that computes what it
    does: the logprobs and gradients of the padded-rows path."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from novarl.backends.training.batching import MicroBatching
    from novarl.backends.training.rows import model_logprobs
    from novarl.types import TrainBatch

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    assert attention.use_varlen_attention(model) == attention.VARLEN
    lengths, prompts, groups = [13, 9, 11, 6, 15], [5, 5, 5, 3, 4], [0, 0, 0, 1, 2]
    ids = torch.randint(1, 64, (5, 15), generator=torch.Generator().manual_seed(4))
    for s in (1, 2):
        ids[s, :5] = ids[0, :5]
    mask = torch.arange(15) < torch.tensor(lengths)[:, None]
    mb = TrainBatch.from_rows(ids, mask, mask & (torch.arange(15) >= torch.tensor(prompts)[:, None]), torch.zeros(5))
    mb.prompt_lengths, mb.group_ids = torch.tensor(prompts), torch.tensor(groups)
    batching = MicroBatching("packed", 5, 96, 8, share_prompts=shared)
    if device == "cuda":
        model, mb = model.cuda().bfloat16(), mb.to(torch.device("cuda"))
    calls = []

    def counted(*args):
        calls.append(args[3])
        return (attention.flash_varlen if device == "cuda" else bottom_right_varlen)(*args)

    results = []
    for kernel in (None, counted):
        monkeypatch.setattr(attention, "varlen_kernel", lambda query, dropout, shared_keys=False: kernel)
        model.zero_grad()
        logprobs, _ = model_logprobs(model, attention.VARLEN, mb, batching, 1.0)
        logprobs.sum().backward()
        results.append((logprobs.detach().float(), [p.grad.float().clone() for p in model.parameters()]))
    assert len(calls) == 2  # each layer's attention went through the kernel
    # queries: a prompt once (13 = 5 + 8), the completions of its followers (4, 6), then the row's padding
    assert calls[0].tolist() == ([0, 13, 17, 23, 29, 44, 48] if shared else [0, 13, 22, 33, 39, 54, 56])
    (want, want_grads), (got, got_grads) = results
    tolerance = 1e-5 if device == "cpu" else 3e-2
    assert torch.allclose(got, want, atol=tolerance)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert (g - w).norm() <= tolerance * max(w.norm(), 1.0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_a_packed_row_of_alike_pieces_runs_as_padded_rows_side_by_side(device, monkeypatch):
    """A packed row whose pieces (each sequence with its padding, the row's tail) all hold as many tokens is
    laid out with that length, and its attention runs as padded rows side by side through SDPA (cuDNN's kernel
    on an H100, faster than the varlen one): the logprobs and gradients of the varlen path on the same row
    (torch's varlen kernel on CUDA in bf16, the padded gather path on the CPU). Unlike pieces keep the varlen path."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from novarl.backends.training.batching import MicroBatching, lay_out
    from novarl.backends.training.rows import model_logprobs
    from novarl.types import TrainBatch

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    assert attention.use_varlen_attention(model) == attention.VARLEN
    batching = MicroBatching("packed", 4, 64, 8)

    def batch(lengths: list[int]) -> TrainBatch:
        ids = torch.randint(1, 64, (len(lengths), 16), generator=torch.Generator().manual_seed(3))
        mask = torch.arange(16) < torch.tensor(lengths)[:, None]
        return TrainBatch.from_rows(ids, mask, mask & (torch.arange(16) >= 4), torch.zeros(len(lengths)))

    assert lay_out(batch([15, 16, 13, 16]), "packed", 8, sequence_multiple=16).piece_length == 16
    assert lay_out(batch([15, 16, 13, 16]), "packed", 8).piece_length is None  # 15 + 16 + 13 + 16 + a tail of 4
    mb = batch([16, 16, 16, 16])
    if device == "cuda":
        model, mb = model.cuda().bfloat16(), mb.to(torch.device("cuda"))
    original, widths = attention._side_by_side, []

    def counted(query, key, value, length, dropout, scaling):
        widths.append(length)
        return original(query, key, value, length, dropout, scaling)

    monkeypatch.setattr(attention, "_side_by_side", counted)
    results = []
    for asked in (None, "flash_varlen" if device == "cuda" else "padded_sdpa"):  # (a kernel asked: no rows)
        monkeypatch.setattr(attention, "ASKED", asked)
        model.zero_grad()
        logprobs, _ = model_logprobs(model, attention.VARLEN, mb, batching, 1.0)
        logprobs.sum().backward()
        results.append((logprobs.detach().float(), [p.grad.float().clone() for p in model.parameters()]))
    assert widths == [16, 16]  # each layer's attention, in the first pass only
    (got, got_grads), (want, want_grads) = results
    tolerance = 1e-5 if device == "cpu" else 3e-2
    assert torch.allclose(got, want, atol=tolerance)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert (g - w).norm() <= tolerance * max(w.norm(), 1.0)


def test_decoder_layers_compile_by_default_only_where_it_was_measured_to_win():
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    from novarl.backends.training.parallelize import compiles
    from novarl.config.schema import DTensorConfig

    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    default = DTensorConfig()
    assert compiles(default, qwen, gpu) and not compiles(default, qwen, cpu)
    for unmeasured in ({"tensor_parallel_size": 2}, {"context_parallel_size": 2}, {"activation_checkpointing": True},
                       {"lora_cfg": {"enabled": True}}):
        assert not compiles(DTensorConfig.model_validate(unmeasured), qwen, gpu), unmeasured
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=32))
    assert not compiles(default, gpt2, gpu)
    assert compiles(DTensorConfig(torch_compile=True), qwen, cpu)
    assert not compiles(DTensorConfig(torch_compile=False), qwen, gpu)

    from novarl.backends.contract.checks import check_config
    from novarl.config import load_config

    def refused(*overrides: str) -> bool:  # torch cannot trace its DTensor styles over varying lengths
        tp = ["cluster.gpus_per_node=2", "policy.dtensor_cfg.tensor_parallel_size=2", *overrides]
        return any("policy.dtensor_cfg.torch_compile=true with tensor_parallel_size=2 and " in str(problem)
                   for problem in check_config(load_config(None, overrides=tp)).problems)

    assert not refused("policy.dtensor_cfg.torch_compile=true")  # the default plans: local tensors inside
    assert not refused("policy.dtensor_cfg.torch_compile=true", "policy.dtensor_cfg.sequence_parallel=true")
    assert not refused("policy.dtensor_cfg.torch_compile=true", "policy.dtensor_cfg.lora_cfg.enabled=true")
    assert refused("policy.dtensor_cfg.torch_compile=true",
                   "policy.dtensor_cfg.custom_parallel_plan=novarl.backends.training.parallelize:LLAMA_LAYER_PLAN")
    assert not refused()  # the default, off under tensor parallelism
    assert not refused("policy.dtensor_cfg.torch_compile=true", "policy.megatron_cfg.enabled=true")  # not read


def trains_like_eager(build, tolerance: float = 1e-5, *, head_compiles: bool = False) -> None:
    """The policy `build(compiled)` makes, eager then compiled (each traced afresh), over two steps (logprob
    pass, training pass and optimizer step) on one rank: the compiled one's logprobs, loss and gradient norm are
    the eager one's within `tolerance`, its layers compiled without a graph break (head_compiles: the eager
    model's head compiles its chunk steps too, as on CUDA)."""
    from torch._dynamo.utils import counters

    from novarl.distributed.local import ensure_single_process_group
    from tests.helpers.packing import measure, mixed_batch

    ensure_single_process_group()
    runs = {}
    for compiled in (False, True):
        policy = build(compiled)
        call = lambda method, *args, policy=policy: getattr(policy, method)(*args)  # noqa: E731
        torch._dynamo.reset()
        counters.clear()
        runs[compiled] = [measure(call, mixed_batch(rows=6, seed=seed)) for seed in range(2)]
        assert dict(counters["graph_break"]) == {}
        assert (counters["stats"]["unique_graphs"] > 0) is (compiled or head_compiles)
    for got, want in zip(runs[True], runs[False], strict=True):
        torch.testing.assert_close(got["logprobs"], want["logprobs"], rtol=tolerance, atol=tolerance)
        for name in ("loss", "grad_norm"):
            assert got[name] == pytest.approx(want[name], rel=tolerance), name


def test_compiled_layers_with_lora_and_activation_checkpointing_train_like_eager_ones():
    """policy.dtensor_cfg.torch_compile=true where it is not on by default (not measured on a GPU): LoRA's
    adapted layers and activation checkpointing train like eager ones (float rounding)."""
    from novarl.backends.training import dtensor
    from novarl.config import load_config
    from novarl.models.loading import resolve_model_path

    def build(compiled: bool):
        cfg = load_config(None, overrides=[
            "policy.train_micro_batch_size=3", "policy.logprob_batch_size=4", "policy.scheduler=[]",
            "policy.optimizer.kwargs={lr: 0.01}", "policy.dtensor_cfg.activation_checkpointing=true",
            "policy.dtensor_cfg.lora_cfg.enabled=true", "policy.dtensor_cfg.lora_cfg.dim=4",
            f"policy.dtensor_cfg.torch_compile={str(compiled).lower()}"])
        return dtensor.DTensorPolicy(cfg.policy, resolve_model_path("tiny-arith"), torch.device("cpu"), total_steps=4)

    trains_like_eager(build)


def tensor_parallel_compiled_layers_train_like_eager_ones(model: str, extra: list[str]) -> None:
    from novarl.backends.training import dtensor
    from novarl.config import load_config

    def build(compiled: bool):
        cfg = load_config(None, overrides=[
            "cluster.gpus_per_node=2", "policy.dtensor_cfg.tensor_parallel_size=2", "policy.train_micro_batch_size=3",
            "policy.logprob_batch_size=4", "policy.scheduler=[]", "policy.optimizer.kwargs={lr: 0.01}",
            "policy.sequence_packing.enabled=true", f"policy.dtensor_cfg.torch_compile={str(compiled).lower()}",
            *extra])
        return dtensor.DTensorPolicy(cfg.policy, model, torch.device("cpu"), total_steps=4)

    torch.set_num_threads(1)
    trains_like_eager(build)


SP = "policy.dtensor_cfg.sequence_parallel=true"
TP_LORA = ["policy.dtensor_cfg.lora_cfg.enabled=true", "policy.dtensor_cfg.lora_cfg.dim=4",
           "policy.dtensor_cfg.lora_cfg.use_triton=false"]


@pytest.mark.parametrize("extra", [[], [SP], [SP, *TP_LORA]], ids=["tp", "tp+sp", "tp+sp+lora"])
def test_tensor_parallel_compiled_layers_train_like_eager_ones(tmp_path, extra):
    """policy.dtensor_cfg.torch_compile=true with tensor_parallel_size=2 (the default plans: local tensors inside
    the layers, backends/training/local_tp.py; LoRA's adapters split with their layers), on 2 ranks over two steps
    of other lengths (packed rows): no graph break, and the eager layers' logprobs, loss and gradient norm (float
    rounding). On torch's DTensor styles, torch failed to trace the second length."""
    from tests.helpers.models import two_kv_head_copy
    from tests.helpers.spawn import checked_rank, spawned

    model = str(two_kv_head_copy(tmp_path / "kv2"))
    outcomes = spawned(checked_rank, 2, "gloo", tensor_parallel_compiled_layers_train_like_eager_ones, model, extra)
    assert outcomes == [None, None], outcomes


def deepspeed_compiled_layers_train_like_eager_ones(device: str) -> None:
    from novarl.backends.training.deepspeed import DeepSpeedPolicy
    from novarl.config import load_config
    from novarl.models.loading import resolve_model_path

    def build(compiled: bool):
        cfg = load_config(None, overrides=[
            "policy.deepspeed_cfg.enabled=true", "policy.deepspeed_cfg.zero_stage=2", "policy.precision=float32",
            "policy.deepspeed_cfg.activation_checkpointing=true", "policy.train_micro_batch_size=3",
            "policy.logprob_batch_size=4", "policy.scheduler=[]", "policy.optimizer.kwargs={lr: 0.01}",
            f"policy.deepspeed_cfg.torch_compile={str(compiled).lower()}"])
        return DeepSpeedPolicy(cfg.policy, resolve_model_path("tiny-arith"), torch.device(device), total_steps=4)

    trains_like_eager(build, 1e-5 if device == "cpu" else 1e-4, head_compiles=device == "cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_deepspeed_compiled_layers_train_like_eager_ones(device):
    """policy.deepspeed_cfg.torch_compile=true (off by default: not measured on a GPU): ZeRO-2's decoder
    layers compiled before the engine wraps them, with activation checkpointing, train like eager ones in
    float32 (float rounding). In a process of its own, away from what the worker's earlier tests left process-wide
    (dynamo's caches and counters among them)."""
    pytest.importorskip("deepspeed")
    from tests.helpers.spawn import in_a_fresh_process

    in_a_fresh_process(deepspeed_compiled_layers_train_like_eager_ones, device,
                       backend="nccl" if device == "cuda" else "gloo")


def test_compiled_layers_stay_compiled_through_the_policys_and_the_references_passes_on_packed_rows():
    """One decoder layer's compiled forward serves the policy's training and logprob passes and the frozen
    reference's, over packed rows whose attention takes several paths (shared prompts, alike pieces, varlen) as
    their lengths change: more graphs than dynamo's default limit of 8, past which it would run the layer eagerly
    for the rest of the run (models/compile_limits.py). With novarl's limit no pass gives up compiling."""
    from torch._dynamo.utils import counters

    from novarl.algorithms.losses import make_loss
    from novarl.backends.training.dtensor import DTensorPolicy, DTensorReference
    from novarl.config import load_config
    from novarl.distributed.local import ensure_single_process_group
    from novarl.models.loading import resolve_model_path
    from tests.helpers.packing import HEAD, LOSS, mixed_batch

    ensure_single_process_group()
    cfg = load_config(None, overrides=[
        "policy.precision=bfloat16", "policy.dtensor_cfg.torch_compile=true", "policy.train_micro_batch_size=3",
        "policy.logprob_batch_size=4", "policy.sequence_packing.enabled=true",
        "policy.sequence_packing.train_mb_tokens=64", "policy.sequence_packing.logprob_mb_tokens=64"])
    path = resolve_model_path("tiny-arith")
    policy = DTensorPolicy(cfg.policy, path, torch.device("cpu"), total_steps=8)
    reference = DTensorReference(cfg.policy, path, torch.device("cpu"))
    torch._dynamo.reset()
    counters.clear()
    for seed in range(6):
        batch = mixed_batch(rows=7, longest=10 + 6 * seed, seed=seed)
        batch.old_logprobs = policy.forward(batch, HEAD)
        batch.reference_logprobs = reference.forward(batch, HEAD)
        policy.forward_backward(batch, make_loss(LOSS), HEAD)
        policy.optim_step()
    assert counters["stats"]["unique_graphs"] > 8 and dict(counters["graph_break"]) == {}
    assert not [reason for reason in counters["unimplemented"] if "recompile limit" in reason]


def test_compiled_layers_under_zero3_are_refused():
    """ZeRO-3 fetches each submodule's parameters in a hook DeepSpeed keeps out of compiled code: a layer
    would compile in pieces, so deepspeed_cfg.torch_compile with stage 3 is refused before anything starts,
    for the policy and for the critic; stage 2 is not."""
    from novarl.backends.contract.checks import check_config
    from novarl.config import load_config

    def refused(*overrides: str) -> list[str]:
        problems = check_config(load_config(None, overrides=["policy.deepspeed_cfg.enabled=true", *overrides])).problems
        return [str(p).split(":")[0] for p in problems if "compile in pieces" in str(p)]

    assert refused("policy.deepspeed_cfg.zero_stage=3", "policy.deepspeed_cfg.torch_compile=true") == [
        "policy.deepspeed_cfg.torch_compile=true with zero_stage=3"]
    assert refused("policy.deepspeed_cfg.zero_stage=2", "policy.deepspeed_cfg.torch_compile=true") == []
    assert refused("policy.deepspeed_cfg.zero_stage=3") == []
    critic = ["policy.deepspeed_cfg.zero_stage=3", "grpo.adv_estimator.name=gae", "value={}",
              "value.deepspeed_cfg.enabled=true", "value.deepspeed_cfg.zero_stage=3",
              "value.deepspeed_cfg.torch_compile=true"]
    assert refused(*critic) == ["value.deepspeed_cfg.torch_compile=true with zero_stage=3"]


def test_one_data_parallel_shard_gathers_each_layer_once_a_pass_and_trains_as_resharding_does(monkeypatch):
    """On one data-parallel shard a trainable model's gathered weights serve every micro-batch of a step
    (parallelize.py keeps_gathered): each FSDP unit is gathered twice in a step of three logprob and three
    training micro-batches (in each pass's first forward), where resharding gathers each layer in every forward
    and backward; nothing is left gathered after the logprob pass. The numbers
    are resharding's over two steps with a learning rate, and a logprob pass between the backward and the
    optimizer step does not leave copies the step makes stale (the next pass reads the new weights)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from novarl.algorithms.losses import make_loss
    from novarl.backends.training import dtensor
    from novarl.backends.training.parallelize import decoder_layers, fsdp_units, groups_modules_fully
    from novarl.config import load_config
    from novarl.distributed.local import ensure_single_process_group
    from novarl.models.loading import resolve_model_path
    from tests.helpers.packing import HEAD, LOSS, measure, mixed_batch

    ensure_single_process_group()
    cfg = load_config(None, overrides=["policy.train_micro_batch_size=3", "policy.logprob_batch_size=4",
                                       "policy.scheduler=[]", "policy.optimizer.kwargs={lr: 0.01}"])
    batch, gathers = mixed_batch(rows=9), []
    original = FSDPParamGroup._to_unsharded

    def counted(group):
        gathers.append(group)
        return original(group)

    monkeypatch.setattr(FSDPParamGroup, "_to_unsharded", counted)
    monkeypatch.setattr(dtensor, "one_device", lambda *args: False)  # FSDP2 on one rank (not one_device.py)
    runs = {}
    for keep in (True, False):
        if not keep:
            monkeypatch.setattr(dtensor, "keeps_gathered", lambda *args: False)
        policy = dtensor.DTensorPolicy(cfg.policy, resolve_model_path("tiny-arith"), torch.device("cpu"),
                                       total_steps=2)
        assert policy.keep_gathered is keep  # keep: the choice itself for one rank, trainable, no offload
        call = lambda method, *args: getattr(policy, method)(*args)  # noqa: E731
        gathers.clear()
        first = measure(call, batch)
        runs[keep] = {"gathers": len(gathers), "first": first}
        policy.forward(batch, HEAD)
        assert not any(isinstance(p, torch.nn.Parameter) and not hasattr(p, "device_mesh")
                       for p in policy.model.parameters())  # every weight is its shard (a DTensor) again
        batch.old_logprobs = None
        second = policy.forward_backward(batch, make_loss(LOSS), HEAD)
        runs[keep]["between"] = policy.forward(batch, HEAD)  # after the backward, before the step
        runs[keep].update(second=second, norm=policy.optim_step()["grad_norm"], after=policy.forward(batch, HEAD))
    layers = policy.model.config.num_hidden_layers
    # kept: tiny-arith's layers, far under KEPT_UNIT_PARAMETERS, are one unit (where this torch's FSDP2 groups
    # modules fully), the root another; else each decoder layer is a unit, and the root
    units = len(fsdp_units(decoder_layers(policy.model), keep_gathered=True)) + 1
    assert units == (2 if groups_modules_fully() else layers + 1) and layers > 1
    assert runs[True]["gathers"] == 2 * units and runs[False]["gathers"] > 4 * (layers + 1)
    for name in ("loss", "grad_norm"):
        assert runs[True]["first"][name] == pytest.approx(runs[False]["first"][name], rel=1e-6)
    assert runs[True]["second"]["loss"] == pytest.approx(runs[False]["second"]["loss"], rel=1e-6)
    assert runs[True]["norm"] == pytest.approx(runs[False]["norm"], rel=1e-6)
    for name in ("between", "after"):
        torch.testing.assert_close(runs[True][name], runs[False][name], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(runs[True]["between"], runs[True]["after"])  # the step changed the weights


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_one_device_trains_like_fsdp2_on_one_rank(monkeypatch, device, precision):
    """On one device the DTensor backend's model is the plain module (one_device.py), not FSDP2's: float32
    parameters, and in bfloat16 copies for each pass whose gradients the float32 ones accumulate. Over two
    steps with a learning rate (three training and three logprob micro-batches each, compiled layers on
    CUDA) its logprobs, losses, gradient norms and weights are FSDP2's on one rank (float32: to rounding;
    bfloat16: the same casts and kernels, to bf16's resolution over two updates), with no graph break in the
    compiled layers. During a pass the layers compute with the copies, none is left after it, and a checkpoint
    FSDP2 wrote resumes on it."""
    from torch._dynamo.utils import counters

    from novarl.backends.training import dtensor
    from novarl.backends.training.one_device import OneDeviceWeights
    from novarl.config import load_config
    from novarl.distributed.local import ensure_single_process_group
    from novarl.models.loading import resolve_model_path
    from tests.helpers.packing import measure, mixed_batch

    ensure_single_process_group()
    cfg = load_config(None, overrides=["policy.train_micro_batch_size=3", "policy.logprob_batch_size=4",
                                       "policy.scheduler=[]", "policy.optimizer.kwargs={lr: 0.01}",
                                       f"policy.precision={precision}"])
    batch, runs, policies = mixed_batch(rows=9).to(torch.device(device)), {}, {}
    for plain in (True, False):
        monkeypatch.setattr(dtensor, "one_device", lambda *args, plain=plain: plain)
        policy = dtensor.DTensorPolicy(cfg.policy, resolve_model_path("tiny-arith"), torch.device(device),
                                       total_steps=4)
        assert isinstance(policy.weights, OneDeviceWeights) is plain
        seen = []
        policy.model.model.layers[0].mlp.register_forward_pre_hook(
            lambda module, args: seen.append(module.down_proj.weight.dtype))
        call = lambda method, *args: getattr(policy, method)(*args)  # noqa: E731
        torch._dynamo.reset()  # its compiled layers traced here, graph breaks counted
        counters.clear()
        runs[plain] = [measure(call, batch), measure(call, batch)]
        runs[plain].append(policy.full_state_dict())
        policies[plain] = policy
        assert set(seen) == {getattr(torch, precision)}
        assert dict(counters["graph_break"]) == {}  # (on the CPU nothing compiles by default)
    one, fsdp = runs[True], runs[False]
    tolerance = dict(rtol=1e-5, atol=1e-6) if precision == "float32" else dict(rtol=0.02, atol=0.02)
    for got, want in zip(one[:2], fsdp[:2]):
        torch.testing.assert_close(got["logprobs"], want["logprobs"], **tolerance)
        for name in ("loss", "grad_norm"):
            assert got[name] == pytest.approx(want[name], rel=tolerance["rtol"], abs=tolerance["atol"]), name
    assert one[2].keys() == fsdp[2].keys()
    for name, weight in one[2].items():
        torch.testing.assert_close(weight, fsdp[2][name], **tolerance)
        assert weight.dtype == torch.float32
    plain = policies[True]
    assert not plain.weights.gathered and all(p.dtype == torch.float32 and p.grad is None and
                                              not hasattr(p, "device_mesh") for p in plain.model.parameters())
    with tempfile.TemporaryDirectory() as tmp:  # FSDP2's checkpoint, resumed on one device
        policies[False].save(Path(tmp))
        plain.load(Path(tmp))
        after = [measure(lambda method, *args: getattr(p, method)(*args), batch) for p in (plain, policies[False])]
    torch.testing.assert_close(after[0]["logprobs"], after[1]["logprobs"], **tolerance)
    assert after[0]["loss"] == pytest.approx(after[1]["loss"], rel=tolerance["rtol"], abs=tolerance["atol"])


def grad_norm_reduced_once_on_the_mesh() -> None:
    """clip_grad_norm on two ranks over gradients on a (dp 1, tp 2) mesh (split and replicated) and on none."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from novarl.backends.training import parallelize

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    full = [torch.randn(8, 4, generator=torch.Generator().manual_seed(seed)) for seed in range(4)]
    placements = [[Replicate(), Shard(0)], [Replicate(), Shard(1)], [Replicate(), Replicate()]]
    params = [torch.nn.Parameter(distribute_tensor(torch.zeros(8, 4), mesh, placement)) for placement in placements]
    params.append(torch.nn.Parameter(torch.zeros(8, 4)))
    for param, grad, placement in zip(params, full, [*placements, None]):
        param.grad = grad.clone() if placement is None else distribute_tensor(grad.clone(), mesh, placement)
    counts_on_entry, whole = [], parallelize.whole

    def counted(tensor):
        counts_on_entry.append(comm.get_total_counts())
        return whole(tensor)

    parallelize.whole = counted
    try:
        with CommDebugMode() as comm:
            norm = parallelize.clip_grad_norm(params, max_norm=1.0)
    finally:
        parallelize.whole = whole
    expected = torch.linalg.vector_norm(torch.cat([grad.reshape(-1) for grad in full]))
    torch.testing.assert_close(norm, expected)
    assert counts_on_entry == [0]  # nothing reduced before the move to the mesh's devices
    clipped = [param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad for param in params]
    torch.testing.assert_close(torch.linalg.vector_norm(torch.cat([grad.reshape(-1) for grad in clipped])),
                               torch.tensor(1.0), rtol=1e-5, atol=1e-5)


def test_the_gradient_norm_is_reduced_once_on_the_meshs_devices():
    """The gradient norm over a mesh is reduced once, in `whole` (on the mesh's devices): under CPU offload the
    gradients are on the host, and NCCL refuses host tensors. torch's get_total_norm, which it used before,
    reduced the per-gradient norms where they were (one collective inside it on a mesh of 2 ranks; on one rank
    none, so one GPU would not have shown it)."""
    from tests.helpers.spawn import checked_rank, spawned

    for outcome in spawned(checked_rank, 2, "gloo", grad_norm_reduced_once_on_the_mesh):
        assert outcome is None, outcome


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_cpu_offload_trains_as_fsdp2_on_the_device(monkeypatch, device):
    """Under CPU offload FSDP2 keeps the parameters, their gradients and the optimizer on the host while the
    passes run on the device: on a GPU the gradient norm (a DTensor on the host) is reduced on the mesh's GPU,
    where NCCL takes it (parallelize.clip_grad_norm), and two clipped steps give the device-held model's
    numbers."""
    from novarl.backends.training import dtensor
    from novarl.config import load_config
    from novarl.distributed.local import ensure_single_process_group
    from novarl.models.loading import resolve_model_path
    from tests.helpers.packing import measure, mixed_batch

    ensure_single_process_group()
    monkeypatch.setattr(dtensor, "one_device", lambda *args: False)  # FSDP2 on the one rank, offloaded or not
    batch, runs = mixed_batch(rows=9).to(torch.device(device)), {}
    for offload in (False, True):
        cfg = load_config(None, overrides=["policy.train_micro_batch_size=3", "policy.logprob_batch_size=4",
                                           "policy.scheduler=[]", "policy.optimizer.kwargs={lr: 0.01}",
                                           "policy.precision=float32", "policy.max_grad_norm=0.5",
                                           f"policy.dtensor_cfg.cpu_offload={str(offload).lower()}"])
        policy = dtensor.DTensorPolicy(cfg.policy, resolve_model_path("tiny-arith"), torch.device(device),
                                       total_steps=4)
        assert {p.device.type for p in policy.model.parameters()} == {"cpu" if offload else device}
        call = lambda method, *args, policy=policy: getattr(policy, method)(*args)  # noqa: E731
        runs[offload] = [measure(call, batch), measure(call, batch)]
    for got, want in zip(runs[True], runs[False]):
        torch.testing.assert_close(got["logprobs"].cpu(), want["logprobs"].cpu(), rtol=1e-4, atol=1e-4)
        for name in ("loss", "grad_norm"):
            assert got[name] == pytest.approx(want[name], rel=1e-4, abs=1e-6), name


def test_one_device_copies_share_tied_weights_cast_a_layers_inputs_and_train_the_float32_weights():
    """OneDeviceWeights on a module with a tied weight and a layer fed float32 tensors (OLMo 2's rotary
    tables): while gathered the layer computes with bf16 weights and inputs (FSDP2 casts a unit's floating
    inputs), both places of the tied weight hold one copy, and the backward's gradient lands in float32 on the
    float32 weight (both uses summed) with none left on a copy; released, everything is float32 again."""
    from novarl.backends.training.one_device import OneDeviceWeights

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4, bias=False)
            self.seen = []

        def forward(self, x, tables=None):
            self.seen.append((x.dtype, tables[0].dtype, self.proj.weight.dtype))
            return self.proj(x) * tables[0]

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layer, model.head = Layer(), torch.nn.Linear(4, 4, bias=False)
    model.head.weight = model.layer.proj.weight  # tied
    weights = OneDeviceWeights(model, torch.bfloat16, [model.layer])
    x, tables = torch.randn(3, 4), (torch.ones(3, 4), torch.ones(3, 4))
    for _ in range(2):  # two micro-batches: the float32 gradient accumulates
        weights.gather()
        assert model.layer.proj.weight is model.head.weight and model.head.weight.dtype == torch.bfloat16
        model.head(model.layer(x, tables=tables)).sum().backward()
        assert model.head.weight.grad is None  # the copy's, added to the float32 weight's and freed
        weights.release()
    weight = model.layer.proj.weight
    assert weight is model.head.weight and weight.dtype == torch.float32 and weight.grad.dtype == torch.float32
    assert model.layer.seen == [(torch.bfloat16,) * 3] * 2
    reference = torch.nn.Parameter(weight.detach().bfloat16())
    (torch.nn.functional.linear(torch.nn.functional.linear(x.bfloat16(), reference) * 1, reference)).sum().backward()
    torch.testing.assert_close(weight.grad, 2 * reference.grad.float(), rtol=0.02, atol=0.02)
    model.layer(x, tables=tables)  # released: no cast
    assert model.layer.seen[-1] == (torch.float32,) * 3


def test_kept_layers_are_sharded_in_runs_whose_parameters_bound_the_transient_buffers(monkeypatch):
    """Where a shard keeps its gathered weights, FSDP2 units are runs of consecutive layers of at most
    KEPT_UNIT_PARAMETERS (at least one layer, the last run shorter); else one a layer, and so with an FSDP2
    whose grouped units novarl has not tested."""
    from novarl.backends.contract import model_shape
    from novarl.backends.training import parallelize
    from novarl.backends.training.parallelize import fsdp_units

    assert model_shape.layers_per_kept_unit(47_000_000, 28) == 5  # Qwen2.5-1.5B's layers: 6 units
    assert model_shape.layers_per_kept_unit(2_000_000_000, 80) == 1  # a layer over the bound: a unit alone
    assert model_shape.layers_per_kept_unit(1_000, 3) == 3
    monkeypatch.setattr(model_shape, "KEPT_UNIT_PARAMETERS", 25)
    layers = [torch.nn.Linear(3, 3) for _ in range(7)]  # 12 parameters each: 2 a unit
    assert fsdp_units(layers, keep_gathered=True) == [layers[0:2], layers[2:4], layers[4:6], layers[6:]]
    assert fsdp_units(layers, keep_gathered=False) == [[layer] for layer in layers]
    monkeypatch.setattr(parallelize, "groups_modules_fully", lambda: False)  # an older torch's FSDP2
    assert fsdp_units(layers, keep_gathered=True) == [[layer] for layer in layers]


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_the_optimizer_step_is_queued_before_the_gradient_norm_is_read():
    """DTensor's optim_step computes the gradient norm and clips on the gradients' device and reads the norm
    back only after the optimizer's step (on a GPU: the host queues the whole step, then waits once): no value
    read back before optimizer.step; the gradients it steps with are clipped to max_grad_norm; the norm
    reported is the one before clipping."""
    from novarl.algorithms.losses import make_loss
    from novarl.backends.training import dtensor
    from novarl.config import load_config
    from novarl.distributed.local import ensure_single_process_group
    from novarl.models.loading import resolve_model_path
    from tests.helpers import scalar_reads
    from tests.helpers.packing import HEAD, LOSS, mixed_batch

    ensure_single_process_group()
    cfg = load_config(None, overrides=["policy.train_micro_batch_size=3", "policy.max_grad_norm=0.01"])
    policy = dtensor.DTensorPolicy(cfg.policy, resolve_model_path("tiny-arith"), torch.device("cpu"), total_steps=2)
    batch = mixed_batch(rows=6)
    batch.old_logprobs = batch.generator_logprobs
    policy.forward_backward(batch, make_loss(LOSS), HEAD)
    grads = lambda: [p.grad for p in policy.model.parameters() if p.grad is not None]  # noqa: E731
    before, seen = torch.nn.utils.get_total_norm(grads()), {}
    step = policy.optimizer.step

    def counted(*args, **kwargs):
        seen.update(reads=reads.count, norm=torch.nn.utils.get_total_norm(grads()))
        return step(*args, **kwargs)

    policy.optimizer.step = counted
    with scalar_reads() as reads:
        metrics = policy.optim_step()
    assert seen["reads"] == 0 and reads.count > 0  # the norm, read after the step
    assert metrics["grad_norm"] == pytest.approx(float(before), rel=1e-5) and float(before) > 0.01
    assert float(seen["norm"]) == pytest.approx(0.01, rel=1e-3)


@cuda
def test_a_micro_batch_on_the_gpu_is_cut_with_copies_that_do_not_wait_for_the_gpu():
    """A batch moved to the GPU is cut into micro-batches from its host copy, the indices travelling
    through pinned memory (types.py to_device): the same micro-batches as the CPU batch's."""
    from novarl.types import to_device
    from tests.helpers.packing import mixed_batch

    batch = mixed_batch(rows=6)
    on_gpu = batch.to(torch.device("cuda"))
    for sequences in ([0, 2, 5], [4]):
        got, want = on_gpu.select(sequences), batch.select(sequences)
        for name in ("input_ids", "cu_seqlens", "position_ids", "loss_mask", "advantages", "prompt_lengths",
                     "group_ids", "sequence_index"):
            assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
    host = torch.arange(5)
    assert to_device(host, torch.device("cpu")) is host and torch.equal(to_device(host, torch.device("cuda")).cpu(),
                                                                         host)
