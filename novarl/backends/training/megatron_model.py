"""One rank of a Megatron-core GPTModel built from a Hugging Face checkpoint (`MegatronModel`):
megatron-core's layout read from `policy.megatron_cfg`, this stage's model chunks (one, or
virtual_pipeline_model_parallel_size interleaved ones), the converted weights loaded into them
and gathered back, and megatron-core's schedule run over a plan of micro-batches (with context
parallelism, each rank's share of every sequence). The policy and the reference built on it, with
DDP, the optimizer and checkpoints: backends/training/megatron.py.

megatron-core is imported in this module's functions only.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from novarl.backends.megatron.cache import load_shard
from novarl.backends.megatron.convert import (
    EXPERTS,
    expert_tensor_part,
    experts_of_rank,
    experts_to_global,
    join_expert_tensor_parts,
    shards_to_hf,
)
from novarl.backends.training.batching import (
    MicroBatching,
    ModelInputs,
    Plan,
    gather_sequences,
    lay_out,
    micro_batch,
    plan_micro_batches,
)
from novarl.backends.training.rows import per_token
from novarl.config.schema import PolicyConfig
from novarl.distributed.parking import Parking, module_tensors, wakes
from novarl.logging.console import info
from novarl.models.attention import say_attention_path
from novarl.models.context_parallel import ContextShard
from novarl.models.scores import Head, Logprobs, Values, check_head, scaled_logits, training_precision
from novarl.types import TrainBatch

class MegatronModel:
    """One rank of a Megatron GPTModel built from a Hugging Face checkpoint."""

    process_reusable = True
    """megatron-core's process-wide state is cleared by leave_process: the rank's process may serve
    another run (kept_ranks.REUSE_RANKS_VARIABLE), of the same flavour (process_flavour)."""
    _said_not_compiled = False
    """Whether this process said that megatron_cfg.torch_compile is not applied (the policy's and the
    reference's models both read it)."""

    @staticmethod
    def process_flavour(kwargs: dict) -> str:
        """The CPU emulation changes torch for the whole process (backends/megatron/cpu.py): a process
        that ran it serves only groups that run it too."""
        from novarl.backends.megatron import cpu

        return "megatron-on-cpu" if kwargs.get("emulate_cuda") or cpu.requested() else ""

    def leave_process(self) -> None:
        """megatron-core's parallel groups, RNG tracker and MoE loss tracker cleared, as in a new process."""
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.transformer.moe import moe_utils

        parallel_state.destroy_model_parallel()
        tensor_parallel.get_cuda_rng_tracker().reset()
        moe_utils.get_moe_layer_wise_logging_tracker().clear()

    def __init__(self, policy: PolicyConfig, model_path: str, device: torch.device | None, *, trainable: bool,
                 seed: int = 42, emulate_cuda: bool = False, value_head: bool = False) -> None:
        """value_head: the last stage's output layer replaced by a zero-initialised scalar one
        (PPO's critic, MegatronCritic)."""
        from novarl.backends.megatron import cpu, model

        if emulate_cuda or cpu.requested():
            cpu.install()
        model.apply_env_vars(policy)
        from megatron.core import parallel_state, tensor_parallel
        from transformers import AutoConfig

        if not dist.is_initialized():
            raise RuntimeError("the Megatron backend needs the process group joined first")
        sizes = model.ParallelSizes.from_policy(policy)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=sizes.tensor, pipeline_model_parallel_size=sizes.pipeline,
                context_parallel_size=sizes.context, expert_model_parallel_size=sizes.expert,
                expert_tensor_parallel_size=sizes.expert_tensor,
                virtual_pipeline_model_parallel_size=sizes.virtual if sizes.virtual > 1 else None)
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
        self.on_gpu = torch.cuda.is_available()
        # megatron-core computes on the rank's current CUDA device (Ray shows each rank one GPU)
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if self.on_gpu
                                 else torch.device("cpu"))
        self.value_head = value_head
        self.hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=policy.trust_remote_code)
        self.shape = model.check_model(self.hf_config, policy)
        self.precision = training_precision(policy.precision, on_gpu=self.on_gpu)
        self.config = model.transformer_config(self.hf_config, self.shape, policy, precision=self.precision,
                                               world_size=dist.get_world_size())
        self.fused_norms = model.transformer_engine_available()
        self._read_layout(sizes)
        self.cpu_group = dist.new_group(backend="gloo")  # weights and checkpoints travel on the CPU
        # this stage's model chunks: one, or virtual_pipeline_model_parallel_size interleaved ones
        self.chunks = model.stage_chunks(self.config)
        self.modules = [model.build_gpt_model(self.config, self.hf_config, self.shape, chunk,
                                              max_sequence_length=policy.max_seq_length) for chunk in self.chunks]
        self.replica_group = self._replica_zero_group()
        self._load_converted(model_path)
        if value_head:
            self._with_value_head()
        self.picking_layer = self._picking_output(policy.logprob_chunk_size)
        for module in self.modules:
            if self.on_gpu:
                module.cuda()
            module.train(trainable)
            module.requires_grad_(trainable)
            if trainable and self.shape.num_experts and policy.megatron_cfg.freeze_moe_router:
                for name, param in module.named_parameters():
                    if ".mlp.router." in name:
                        param.requires_grad_(False)
        self._compile(policy.megatron_cfg)
        self.model_chunks = list(self.modules)  # what the schedule runs (DDP-wrapped for training)
        # sequence parallelism splits every row's tokens evenly over the tensor-parallel ranks; context
        # parallelism every sequence into 2 x cp chunks (of a multiple of the tensor-parallel size then)
        sp = self.tp_size if self.config.sequence_parallel else 1
        self.packed_sequence_multiple = 2 * self.cp_size * sp if self.cp_size > 1 else 1
        multiple = math.lcm(policy.make_sequence_length_divisible_by * sp, self.packed_sequence_multiple)
        self.train_batching = MicroBatching.from_policy(policy, training=True, sequence_multiple=multiple)
        self.logprob_batching = MicroBatching.from_policy(policy, training=False, sequence_multiple=multiple)
        self.empty_unused_memory_level = policy.megatron_cfg.empty_unused_memory_level
        self.parking = Parking()

    def park(self, group: str, host_too: bool = False) -> int:
        """Implements Parkable (distributed/parking.py): the weights (every chunk's parameters and buffers) to
        host memory; a frozen model has no optimizer state."""
        if group != "weights":
            return 0
        return self.parking.park(group, [t for module in self.modules for t in module_tensors(module)],
                                 host_too=host_too)

    def _compile(self, mc) -> None:
        """megatron_cfg.torch_compile: the local spec's layers compiled; over Transformer Engine's, said once."""
        from novarl.backends.megatron import model

        if model.compiles_layers(mc):
            for module in self.modules:
                model.compile_layers(module)
        elif mc.torch_compile and dist.get_rank() == 0 and not MegatronModel._said_not_compiled:
            MegatronModel._said_not_compiled = True
            info("policy.megatron_cfg.torch_compile is not applied: Transformer Engine's layers are fused already")

    def _read_layout(self, sizes) -> None:
        """This rank's place in megatron-core's layout: ranks, sizes and groups."""
        from megatron.core import parallel_state as ps

        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        self.pp_rank, self.pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.cp_rank, self.cp_size = ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()
        self.ep_rank, self.ep_size = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
        self.etp_rank, self.etp_size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
        self.dp_group, self.tp_group = ps.get_data_parallel_group(), ps.get_tensor_model_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.cp_group = ps.get_context_parallel_group() if self.cp_size > 1 else None
        # who holds a copy of each weight to gather or save: data-parallel replica 0 the dense
        # ones, expert-data-parallel replica 0 the experts (each expert-tensor-parallel rank its part)
        self.holds_dense = self.dp_rank == 0 and self.cp_rank == 0
        self.holds_experts = self.shape.num_experts > 0 and ps.get_expert_data_parallel_rank() == 0
        # tokens of other data-parallel ranks meet in the experts: every rank's micro-batches take one shape
        self.experts_span_data = self.shape.num_experts > 0 and sizes.expert * sizes.expert_tensor > sizes.tensor
        self.first_stage, self.last_stage = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()

    @property
    def module(self):
        """The stage's model without interleaving (Megatron generation runs it; interleaving
        is refused with Megatron generation)."""
        if len(self.modules) != 1:
            raise RuntimeError("this stage holds several model chunks (virtual pipeline stages)")
        return self.modules[0]

    # ------------------------------------------------------------ weights in
    def _load_converted(self, model_path: str) -> None:
        folder = self._converted_folder(model_path)
        self._load_chunks(load_shard(folder, self.tp_rank), tied=self.shape.tied, error=RuntimeError)

    def _load_chunks(self, state: dict[str, torch.Tensor], *, tied: bool, error: type[Exception]) -> None:
        """This rank's tensor-parallel shard of the whole model (global layer and expert numbers,
        every expert whole) into its chunks: each its layers, this rank's experts, cut to its
        expert-tensor-parallel part."""
        from novarl.backends.megatron.model import to_stage

        for chunk, module in zip(self.chunks, self.modules):
            part = self._experts_here(to_stage(state, chunk.layers, first=chunk.first, last=chunk.last, tied=tied))
            missing, unexpected = module.load_state_dict(part, strict=False)
            missing = [m for m in missing if not m.endswith("_extra_state")]
            if missing or unexpected:
                raise error(f"the Megatron weights (tensor-parallel rank {self.tp_rank}, stage {self.pp_rank}, layers "
                            f"{chunk.layers.start}-{chunk.layers.stop - 1}) do not fit the model: missing "
                            f"{missing[:5]}, unexpected {unexpected[:5]}")

    def _with_value_head(self) -> None:
        """PPO's critic: no output weights shared with the embedding, and on the pipeline's last
        chunk a scalar head (ScalarHead) where the vocabulary's output layer was."""
        from novarl.backends.training.megatron_critic import ScalarHead

        for chunk, module in zip(self.chunks, self.modules):
            module.share_embeddings_and_output_weights = False
            if chunk.last:
                dtype = next(module.parameters()).dtype
                module.output_layer = ScalarHead(self.config.hidden_size, dtype=dtype,
                                                 sequence_parallel=self.config.sequence_parallel)

    def _picking_output(self, rows: int | None):
        """The output layer, made to pick the following tokens' logprobs (backends/megatron/picking.py;
        `rows` rows of logits at once, the chunk steps compiled on CUDA; under tensor parallelism each
        rank its part of the vocabulary), where this stage has it: not under context parallelism (whose
        ranks hold parts of each sequence: Transformer Engine's, not run on novarl's CPU emulation), not
        the critic. None elsewhere: there the logits are computed whole."""
        last = [module for chunk, module in zip(self.chunks, self.modules) if chunk.last]
        if self.value_head or self.cp_size > 1 or not last:
            return None
        from novarl.backends.megatron.picking import use_picking_output

        layer = last[0].output_layer
        return layer if use_picking_output(layer, self.shape.vocab_size, rows, fused=self.on_gpu) else None

    @property
    def picks_logprobs(self) -> bool:
        """Whether the logprobs come from the output layer chunk by chunk, without whole logits."""
        return self.picking_layer is not None

    def _experts_here(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` (every expert whole, global numbers) cut to this expert-parallel rank's experts
        and to its expert-tensor-parallel part of each."""
        if not self.shape.num_experts:
            return state
        mine = experts_of_rank(state, rank=self.ep_rank, expert_parallel_size=self.ep_size,
                               num_experts=self.shape.num_experts)
        return expert_tensor_part(mine, rank=self.etp_rank, expert_tensor_parallel_size=self.etp_size)

    def _replica_zero_group(self) -> dist.ProcessGroup:
        """A gloo group of the ranks that hold a copy of some weight to gather (global rank 0
        among them): the full weights travel over it alone."""
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, self.holds_dense or self.holds_experts, group=self.cpu_group)
        return dist.new_group(ranks=[r for r, holds in enumerate(ranks) if holds], backend="gloo")

    def _converted_folder(self, model_path: str) -> Path:
        """The conversion, made once: by global rank 0, and again by the first rank of any node
        whose disk does not show it (a node-local cache folder); the other ranks wait."""
        import socket

        from novarl.backends.megatron.cache import conversion_ready, converted_checkpoint

        sizes = dict(tensor_parallel_size=self.tp_size, fused_norms=self.fused_norms)
        if dist.get_rank() == 0:
            converted_checkpoint(model_path, **sizes)
        dist.barrier(group=self.cpu_group)
        host, ready = socket.gethostname(), conversion_ready(model_path, **sizes) is not None
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (host, ready), group=self.cpu_group)
        first_here = min(rank for rank, (where, _) in enumerate(everyone) if where == host)
        if not ready and dist.get_rank() == first_here:
            converted_checkpoint(model_path, **sizes)
        dist.barrier(group=self.cpu_group)
        folder = conversion_ready(model_path, **sizes)
        if folder is None:
            raise RuntimeError(f"rank {dist.get_rank()} on {host} sees no complete Megatron conversion of {model_path}")
        return folder

    # -------------------------------------------------------------- compute
    def _context_shard(self, inputs: ModelInputs) -> ContextShard | None:
        """This context-parallel rank's share of a micro-batch's tokens: chunks r and 2cp-1-r of
        every sequence (of each padded row, or of the packed row's sequences), the layout
        Transformer Engine's context-parallel attention takes. None without context parallelism."""
        if self.cp_group is None:
            return None
        from novarl.models.context_parallel import shard_rows

        return shard_rows(inputs.bounds, self.cp_group, inputs.input_ids.device)

    def _forward(self, model, inputs: ModelInputs, shard: ContextShard | None = None,
                 head: Head | None = None) -> torch.Tensor:
        """The stage's output for a micro-batch (this cp rank's share of its tokens under context
        parallelism): on the last stage vocab-parallel logits [R, W, V/tp], or where its output layer
        picks and the head is Logprobs each position's logprob of the token after it [R, W]; hidden
        states for the next stage otherwise."""
        piece = self._side_by_side(inputs, shard)
        if self.picking_layer is None or not isinstance(head, Logprobs):
            return self._run_model(model, inputs, shard, piece)
        from novarl.backends.megatron.picking import picking

        following = _following(inputs.input_ids)
        with picking(self.picking_layer, following if piece is None else following.view(-1, piece), head.temperature):
            return self._run_model(model, inputs, shard, piece)

    def _side_by_side(self, inputs: ModelInputs, shard: ContextShard | None) -> int | None:
        """Where a packed row's pieces all hold as many tokens (ModelInputs.piece_length), that length: the row
        runs as padded rows side by side, one a piece, through causal attention over [s, b] rows (SDPA's
        kernel: cuDNN's on an H100, where torch's varlen kernel took 1.7x as long for the same work in the
        DTensor backend's run C; or Transformer Engine's) and megatron-core's own rotary positions (each
        piece counts from 0): as fixed rows would run. Not under context parallelism
        (each sequence is split), pipelines (the stages' buffers have the schedule's one shape), experts that
        take tokens from other data-parallel ranks (every rank's micro-batch has one shape, _model_inputs),
        sequence parallelism with pieces that do not split over the tensor-parallel ranks, or a packed
        attention kernel asked by name (models/attention.py KERNEL_ENV)."""
        from novarl.models import attention

        piece = inputs.piece_length
        split = self.tp_size if self.config.sequence_parallel else 1
        if piece is None or shard is not None or self.pp_size > 1 or self.experts_span_data or piece % split \
                or attention.ASKED is not None:
            return None
        return piece

    def _run_model(self, model, inputs: ModelInputs, shard: ContextShard | None, piece: int | None) -> torch.Tensor:
        """The model over the micro-batch's layout: padded rows, a packed row, or (piece: _side_by_side) a
        packed row's alike pieces as padded rows; then the log says the packed attention's path (what compiled
        layers could not say inside)."""
        out = self._model_pass(model, inputs, shard, piece)
        say_attention_path()
        return out

    def _model_pass(self, model, inputs: ModelInputs, shard: ContextShard | None, piece: int | None) -> torch.Tensor:
        ids, positions = inputs.input_ids, inputs.position_ids
        if piece is not None:  # [1, W] as [W / piece, piece] and back: logits, picked logprobs or values
            out = model(ids.view(-1, piece), positions.view(-1, piece), None)
            return out.reshape(*ids.shape, *out.shape[2:])
        if shard is not None:
            ids = ids.reshape(-1).index_select(0, shard.local).view(ids.shape[0], -1)
            positions = positions.reshape(-1).index_select(0, shard.local).view(ids.shape[0], -1)
        if inputs.attention_mask is not None:
            # right-padded rows need only causal attention (the padding follows every real token), which the
            # layers' causal core attention applies without a mask: Transformer Engine's (split over the cp
            # ranks under cp) or novarl's SDPAttention (is_causal, so that torch picks its flash kernel)
            return model(ids, positions, None)
        # a packed row: varlen attention (Transformer Engine's, or novarl's SDPAttention) and per-sequence
        # rotary, the whole row's sequence boundaries (each sequence padded to its cp split) under cp
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = inputs.cu_seqlens
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                                 cu_seqlens_kv_padded=cu, max_seqlen_q=inputs.max_seqlen,
                                 max_seqlen_kv=inputs.max_seqlen)
        return model(ids, positions, None, packed_seq_params=packed)

    def _position_scores(self, output: torch.Tensor, following: torch.Tensor, head: Head) -> torch.Tensor:
        """[R, W] float32 each position's score of the token after it: its logprob at the head's
        temperature from vocab-parallel logits [R, W, V/tp], or its value from a scalar head's
        [R, W, 1] output (the critic's)."""
        from megatron.core import tensor_parallel

        if isinstance(head, Values):
            return output[..., 0].float()
        if output.dim() == 2:  # the picking output layer's logprobs already
            return output
        logits = scaled_logits(output, head.temperature)
        part = logits.shape[-1]
        columns = torch.arange(self.tp_rank * part, (self.tp_rank + 1) * part, device=logits.device)
        if columns[-1] >= self.shape.vocab_size:  # Megatron's vocabulary padding: never a token
            logits = logits.masked_fill(columns >= self.shape.vocab_size, float("-inf"))
        return -tensor_parallel.vocab_parallel_cross_entropy(logits, following)

    def _token_scores(self, output: torch.Tensor, inputs: ModelInputs, shard: ContextShard | None, head: Head
                      ) -> torch.Tensor:
        """[n] the micro-batch's tokens' scores under the head (logprobs, or a critic's values), each read at its
        predecessor's position; 0 at each sequence's first token. Under context parallelism the
        cp ranks' positions are gathered first: every cp rank computes the same loss, and each
        takes back its own positions' gradients (summed over the cp ranks by DDP)."""
        following = _following(inputs.input_ids).reshape(-1)
        if shard is not None:
            following = following.index_select(0, shard.local)
        scores = self._position_scores(output, following.view(output.shape[:2]), head).reshape(-1)
        if shard is not None:
            scores = shard.gather_identical_loss(scores)
        return per_token(scores, inputs.previous)

    def _run_pipeline(self, batch: TrainBatch, batching: MicroBatching, loss_of, head: Head, forward_only: bool
                      ) -> tuple[Plan, list[Any]]:
        """megatron-core's schedule over this rank's micro-batches of the plan:
        loss_of(the head's scores, mb, computed tokens) -> (loss, what to keep) runs on the last
        stage; what it keeps per micro-batch is returned there ([] elsewhere), in plan order
        (empty micro-batches included)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        check_head(head, value_head=self.value_head, model=type(self).__name__)
        plan = plan_micro_batches(batch.lengths.tolist(), self.dp_size, batching)
        if len(self.model_chunks) > 1:
            plan = interleavable(plan, self.pp_size)
        batch = batch.to(self.device)
        micro = [micro_batch(batch, sequences) for sequences in plan.ranks[self.dp_rank]]
        inputs = self._model_inputs(micro, batching)
        shards = [self._context_shard(laid) for laid in inputs]
        kept: list[Any] = []

        def step(data_iterator, model):
            mb, laid, shard = next(data_iterator)
            output = self._forward(model, laid, shard, head)

            def loss_func(output_tensor):
                computed = laid.tokens_computed if shard is None else len(shard.local)
                value, keep = loss_of(self._token_scores(output_tensor, laid, shard, head), mb, computed)
                kept.append(keep)
                return value, torch.ones((), dtype=torch.int, device=value.device), {}

            return output, loss_func

        # each model chunk reads every micro-batch once (the embedding's chunk the tokens, the
        # head's the targets; every chunk the positions and mask)
        work = [iter(list(zip(micro, inputs, shards))) for _ in self.model_chunks]
        get_forward_backward_func()(  # (it divides seq_length by cp for the stages' buffers)
            forward_step_func=step, data_iterator=work, model=self.model_chunks, num_microbatches=len(micro),
            seq_length=max(i.input_ids.shape[1] for i in inputs),
            micro_batch_size=max(i.input_ids.shape[0] for i in inputs), forward_only=forward_only)
        return plan, kept

    def _model_inputs(self, micro: list[TrainBatch], batching: MicroBatching) -> list[ModelInputs]:
        """The micro-batches as model inputs. Pipeline stages exchange buffers of one shape, so
        there every micro-batch takes the largest [rows, width]; where experts gather tokens from
        other data-parallel ranks (expert parallelism), each takes the largest of its counterparts
        on those ranks (megatron-core's token gathers take equal shares)."""
        def laid(mb: TrainBatch, rows: int | None = None, width: int | None = None) -> ModelInputs:
            return lay_out(mb, batching.layout, batching.length_multiple,
                           sequence_multiple=self.packed_sequence_multiple, rows=rows, width=width)

        inputs = [laid(mb) for mb in micro]
        pipelined, shared = self.pp_size > 1, self.experts_span_data and self.dp_size > 1
        if not (pipelined or shared):
            return inputs
        shapes = torch.tensor([list(i.input_ids.shape) for i in inputs], dtype=torch.long, device=self.device)
        if pipelined:
            shapes = shapes.amax(0, keepdim=True).expand_as(shapes).contiguous()
        if shared:
            dist.all_reduce(shapes, op=dist.ReduceOp.MAX, group=self.dp_group)
        return [i if tuple(i.input_ids.shape) == (rows, width) else laid(mb, rows=rows, width=width)
                for mb, i, (rows, width) in zip(micro, inputs, shapes.tolist())]

    @torch.no_grad()
    @wakes("weights")
    def forward(self, batch: TrainBatch, head: Head) -> torch.Tensor:
        """[N] the head's score of each of batch.input_ids (0 at each sequence's first token), on
        every rank: computed on each data-parallel share's last stage, sent to the other stages,
        gathered over data-parallel ranks."""
        zero = torch.zeros((), device=self.device)
        plan, parts = self._run_pipeline(batch, self.logprob_batching,
                                         lambda scores, mb, _: (zero, scores.detach()), head, forward_only=True)
        mine_sequences = plan.sequences(self.dp_rank)
        count = int(batch.lengths[mine_sequences].sum()) if mine_sequences else 0
        if self.last_stage:
            real = [lp for lp, sequences in zip(parts, plan.ranks[self.dp_rank]) if sequences is not None]
            mine = torch.cat(real) if real else torch.zeros(0, device=self.device)
        else:
            mine = torch.empty(count, device=self.device)
        if self.pp_size > 1:
            dist.broadcast(mine, src=self._last_stage_rank(), group=self.pp_group)
        out = gather_sequences(batch, plan, mine.float(), self.dp_rank, self.dp_group if self.dp_size > 1 else None)
        self._empty_cache(level=1)
        return out

    @wakes("weights")
    def sample_tokens(self, prompts: list[list[int]], sampling, stop_ids: list[int], max_seq_length: int,
                      config) -> list[tuple[list[int], list[float]]]:
        """Megatron generation on this model's ranks (backends/generation/megatron.py)."""
        from novarl.backends.generation.megatron import sample_tokens

        return sample_tokens(self, prompts, sampling, stop_ids, max_seq_length, config)

    def _last_stage_rank(self) -> int:
        return dist.get_global_rank(self.pp_group, self.pp_size - 1)

    def _empty_cache(self, level: int) -> None:
        """megatron_cfg.empty_unused_memory_level: 1 frees the allocator cache after logprobs,
        2 after training steps too."""
        if self.on_gpu and self.empty_unused_memory_level >= level:
            torch.cuda.empty_cache()

    # ----------------------------------------------------------- weights out
    def _local_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(this rank's dense weights, its experts' weights), on the CPU with global layer and
        expert numbers."""
        from novarl.backends.megatron.model import from_stage

        state: dict[str, torch.Tensor] = {}
        for chunk, module in zip(self.chunks, self.modules):
            state.update(from_stage({name: tensor.detach().to("cpu", copy=True)
                                     for name, tensor in module.state_dict().items()
                                     if not name.endswith("_extra_state") and tensor is not None}, chunk.layers))
        experts = {name: tensor for name, tensor in state.items() if EXPERTS in name}
        if experts:
            experts = experts_to_global(experts, rank=self.ep_rank, expert_parallel_size=self.ep_size,
                                        num_experts=self.shape.num_experts)
        return {name: tensor for name, tensor in state.items() if EXPERTS not in name}, experts

    @wakes("weights")
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every rank calls it; rank 0 gets the full CPU tensors under Hugging Face
        names, the others {}. The ranks holding a copy of each weight send it over a gloo group
        of their own."""
        if not (self.holds_dense or self.holds_experts):
            return {}
        dense, experts = self._local_state()
        mine = (self.tp_rank, self.pp_rank, dense if self.holds_dense else None,
                self.etp_rank, experts if self.holds_experts else {})
        parts: list[Any] = [None] * dist.get_world_size(self.replica_group)
        dist.gather_object(mine, parts if dist.get_rank() == 0 else None, dst=0, group=self.replica_group)
        if dist.get_rank() != 0:
            return {}
        by_etp: list[dict[str, torch.Tensor]] = [{} for _ in range(self.etp_size)]
        for *_, etp_rank, part in parts:
            by_etp[etp_rank].update(part)
        return shards_to_hf([(tp, pp, d) for tp, pp, d, *_ in parts if d is not None], self.shape,
                            tensor_parallel_size=self.tp_size, fused_norms=self.fused_norms,
                            experts=join_expert_tensor_parts(by_etp))


def interleavable(plan: Plan, pipeline: int) -> Plan:
    """The plan with empty micro-batches added to make each rank's count a multiple of the
    pipeline's stages: the interleaved schedule runs micro-batches in groups of that many."""
    count = len(plan.ranks[0])
    missing = -count % pipeline if count >= pipeline else pipeline - count
    return dataclasses.replace(plan, ranks=[rank + [None] * missing for rank in plan.ranks])


def _following(ids: torch.Tensor) -> torch.Tensor:
    """[R, W] each position's next token in the flattened rows (read where it is one; 0 after the last)."""
    return torch.nn.functional.pad(ids.reshape(-1)[1:], (0, 1)).view(ids.shape)
