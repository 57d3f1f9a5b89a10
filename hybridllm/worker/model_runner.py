"""Model runner: keeps per-request state, turns a SchedulerOutput into tensors, runs its stage, samples."""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridllm.config import EngineConfig
from hybridllm.engine.scheduler_output import (
    Logprobs,
    ModelRunnerOutput,
    SchedulerOutput,
)
from hybridllm.layers.attention_metadata import AttentionMetadata
from hybridllm.layers.cpu_kernels import load_cpu_kernels
from hybridllm.layers.gguf_linear import int8_activations_in_use
from hybridllm.plan.cpu_dtype import cpu_kv_cache_dtype
from hybridllm.plan.memory_budget import host_expert_bytes, worker_weight_bytes
from hybridllm.plan.model_size import model_size
from hybridllm.plan.plan import StagePlan
from hybridllm.platforms import Platform
from hybridllm.sample import Sampler, SamplingMetadata, compute_prompt_logprobs
from hybridllm.sample.grammar_mask import with_grammar_mask
from hybridllm.sampling_params import SamplingParams
from hybridllm.worker.intermediate_tensors import IntermediateTensors
from hybridllm.worker.kv_cache_budget import cpu_kv_budget, gpu_kv_budget, profile_spans

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CachedRequestState:
    """What a worker remembers about a running request between steps."""

    req_id: str
    token_ids: list[int]  # prompt + output, as known to the scheduler
    num_prompt_tokens: int
    block_ids: list[int]
    sampling_params: SamplingParams
    num_computed_tokens: int

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


class ModelRunner:
    """Owns one pipeline stage's layers and their KV cache on one device; executes one
    scheduler step at a time. Every stage keeps the same per-request state; the first
    embeds token ids, later ones continue from the previous stage's IntermediateTensors,
    and only the last computes logits and samples."""

    def __init__(
        self,
        config: EngineConfig,
        platform: Platform,
        stage: StagePlan,
        tp_group: object | None = None,
        show_progress: bool = False,
    ):
        self.config = config
        self.platform = platform
        self.device = platform.device
        self.stage = stage
        self.is_first_stage = stage.has_embedding
        self.is_last_stage = stage.has_lm_head
        self.tp_group = tp_group  # None without tensor parallelism
        self.dtype = _DTYPES[config.model_config.dtype]
        self.kv_cache_dtype = _kv_cache_dtype(config, self.dtype, self.device)
        self.block_size = config.cache_config.block_size
        self.show_progress = show_progress
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.requests: dict[str, CachedRequestState] = {}
        # greedy rows take the compiled argmax on a CPU last stage
        self.sampler = Sampler(native_argmax=self.device.type == "cpu" and load_cpu_kernels())
        self.eos_token_ids = set(config.model_config.eos_token_ids)  # masked under min_tokens

    # ---- set-up -------------------------------------------------------------------------------

    def load_model(self) -> None:
        from hybridllm.layers.gguf_linear import gguf_kernel_types
        from hybridllm.loader import open_model_source
        from hybridllm.loader.onload_quant import (
            ONLOAD_TYPES,
            QuantizedWeightCache,
            checkpoint_key,
            quantize_weights,
        )
        from hybridllm.models.registry import get_model_class

        mc = self.config.model_config
        source = open_model_source(mc.model)
        model_cls = get_model_class(mc.architecture)
        # Only tensor-parallel models take a group: plain models keep their signature.
        extra: dict[str, Any] = {} if self.tp_group is None else {"tp_group": self.tp_group}
        if self.stage.cpu_expert_layers:  # MoE: those layers' routed experts on the host
            extra["cpu_expert_layers"] = self.stage.cpu_expert_layers
        start, end = self.stage.layer_start, self.stage.layer_end
        with torch.device(self.device):
            model = model_cls(mc.hf_config, self.dtype, self.device, start, end, **extra)
        # On a CPU worker GGUF linears stay in their blocks (read ~6x fewer bytes per token).
        # Host experts of a GPU stage keep them too (the model decodes what goes to the GPU).
        host = torch.device("cpu") if self.stage.cpu_expert_layers else self.device
        keep = gguf_kernel_types(host) if mc.quantization != "none" else ()
        weights = source.iter_weights(model.owns_weight, keep)
        if mc.quantization in ONLOAD_TYPES and keep and self.device.type == "cpu":
            # float linears into blocks the native op reads (cached on disk per checkpoint)
            cache = QuantizedWeightCache(checkpoint_key(source.weight_files()))
            weights = quantize_weights(weights, model.quantize_role, mc.quantization, cache)
        if self.show_progress:
            from tqdm import tqdm

            weights = tqdm(weights, desc="Loading weights", unit="tensor", leave=False)
        loaded = model.load_weights(weights)
        missing = sorted(model.expected_weight_names() - loaded)
        if missing:
            raise ValueError(f"{mc.model}: weights missing from the checkpoint: {missing[:8]}")
        # Dense copies for streaming are taken before the CPU repacks its weights.
        streamer = self._weight_streamer(model) if self.stage.streams else None
        model.process_weights_after_loading()
        model.weight_streamer = streamer
        self.model = model.eval()

    def _weight_streamer(self, model: torch.nn.Module) -> Any:
        """The stage's weight streamer, or None (with a warning) for a model it cannot stage."""
        from hybridllm.layers.linear import Linear
        from hybridllm.worker.weight_streamer import WeightStreamer

        stage = self.stage
        if not hasattr(model, "make_layer"):
            logger.warning(
                "%s cannot stream its layers' weights; stage %d computes every step on the CPU",
                type(model).__name__,
                stage.pp_rank,
            )
            return None
        for module in model.modules():
            if isinstance(module, Linear):
                module.finish_loading()  # GGUF blocks kept or decoded, as they will run
        try:
            streamer = WeightStreamer(
                model, stage.stream_device, self.dtype, stage.stream_threshold,
                stage.stream_kv_tokens,
            )  # fmt: skip
        except NotImplementedError as exc:
            logger.warning("stage %d computes every step on the CPU: %s", stage.pp_rank, exc)
            return None
        logger.info(
            "stage %d streams its %d layers to %s for steps of >= %d tokens (%.0f MiB staged)",
            stage.pp_rank,
            stage.num_layers,
            stage.stream_device,
            stage.stream_threshold,
            streamer.staging_bytes / (1 << 20),
        )
        return streamer

    def kv_cache_bytes_per_block(self) -> int:
        m = self.model
        elems = 2 * self.block_size * m.num_kv_heads * m.head_dim
        return elems * self.kv_cache_dtype.itemsize * m.num_layers_in_stage

    def determine_num_blocks(self) -> int:
        """Blocks that fit this worker's KV budget (never more than the scheduler could use)."""
        cc, sc = self.config.cache_config, self.config.scheduler_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        per_block = self.kv_cache_bytes_per_block()
        if self.device.type == "cuda":
            if any(w.is_cpu for w in self.stage.workers):
                # The CPU ranks of a mixed tensor-parallel group size their KV cache without a
                # forward pass, so a profiling forward here would wait in its collectives for
                # them forever: take the planner's estimate of one full step's activations.
                peak = self._estimated_activation_bytes()
            else:
                # Activations of one full step, measured by a profiling forward pass.
                peak = self._profile_activation_bytes()
            # Read after the forward: what it allocated outside torch's caching allocator
            # (cuBLAS workspaces, NCCL buffers, lazily loaded kernels) stays and must count.
            free, total = self.platform.free_and_total_memory()
            budget = gpu_kv_budget(
                total,
                free,
                cc.gpu_memory_utilization,
                peak,
                torch.cuda.memory_allocated(self.device),
                cc.max_gpu_memory_bytes,
            )
        else:
            available, _ = self.platform.free_and_total_memory()
            plan = self.config.plan
            cpu_workers = [w for w in plan.workers() if w.is_cpu]
            # The default budget is a share of this machine's RAM: split it among the CPU
            # workers on this cluster node; an explicit one is the whole plan's.
            here = plan.workers_on_node(self.stage.node)
            sharing = cpu_workers if cc.kv_cache_memory_bytes else [w for w in here if w.is_cpu]
            budget = cpu_kv_budget(
                available,
                len(sharing),
                cc.kv_cache_memory_bytes,
                cc.max_cpu_memory_bytes,
                self._cpu_fixed_bytes(cpu_workers) if cc.max_cpu_memory_bytes else 0,
            )
        # No point in more blocks than max_num_seqs full-length sequences.
        needed = sc.max_num_seqs * -(-sc.max_model_len // self.block_size)
        num_blocks = min(budget // per_block, needed)
        if num_blocks < 1:
            raise ValueError(
                f"no memory left for the KV cache on {self.device} (budget {budget} bytes, "
                f"{per_block} bytes per block): lower max_model_len or raise the memory budget"
            )
        return int(num_blocks)

    def _model_size(self):
        mc = self.config.model_config
        return model_size(mc.hf_config, str(self.dtype).removeprefix("torch."), mc.cpu_blocks)

    def _estimated_activation_bytes(self) -> int:
        """The planner's bound on one full step's activations."""
        return self._model_size().activation_bytes(
            self.config.scheduler_config.max_num_batched_tokens
        )

    def _cpu_fixed_bytes(self, cpu_workers) -> int:
        """Weights and activation workspace of every CPU worker (they share the host's RAM),
        counted as the planner counts them."""
        sc = self.config.scheduler_config
        size = self._model_size()
        plan = self.config.plan
        weights = sum(
            worker_weight_bytes(size, plan.stage_of(w.rank), w.tp_rank) for w in cpu_workers
        )
        weights += sum(host_expert_bytes(size, stage) for stage in plan.stages)  # GPU stages' MoE
        return weights + len(cpu_workers) * size.activation_bytes(sc.max_num_batched_tokens)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = self.model.kv_cache_shape(num_blocks, self.block_size)
        self.kv_caches = [
            _zeros(shape, self.kv_cache_dtype, self.device)
            for _ in range(self.model.num_layers_in_stage)
        ]

    def _profile_activation_bytes(self) -> int:
        """Peak device memory of `profile_forward` beyond what was allocated before its forward
        (its temporary KV cache excluded: the real one is budgeted on its own)."""
        base = 0

        def cache_ready() -> None:
            nonlocal base
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)

        self.profile_forward(cache_ready)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        torch.cuda.empty_cache()
        return int(peak)

    def profile_forward(self, on_cache_ready: Callable[[], None] | None = None) -> int:
        """One step of the largest batch the scheduler may send, for its memory peak: the spans
        of `profile_spans` (max_num_batched_tokens tokens, or the last chunk of a max_model_len
        prompt when chunked prefill cuts prompts shorter) through this stage's layers, on a
        temporary KV cache; on the last stage logits for max_num_seqs rows and the sampler's
        most costly path over them (top-k, top-p, penalties, logprobs). `on_cache_ready` runs
        once the temporary cache exists. Returns the tokens run."""
        sc = self.config.scheduler_config
        spans = profile_spans(sc.max_num_batched_tokens, sc.max_model_len, sc.max_num_seqs)
        bs = self.block_size
        # Each sequence gets blocks for the tokens it writes (+1: a chunk may straddle a block
        # boundary); a longer context (a chunk's cached prefix) maps onto the same blocks
        # again, so its reads cost what real ones do without a max_model_len cache.
        tables, first = [], 0
        for _, q, ctx in spans:
            own = -(-q // bs) + 1
            tables.append([first + j % own for j in range(-(-ctx // bs))])
            first += own
        self.initialize_kv_cache(first)
        if on_cache_ready is not None:
            on_cache_ready()
        pos_np = np.concatenate([np.arange(start, start + q) for start, q, _ in spans])
        n = len(pos_np)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.from_numpy(pos_np.astype(np.int64)).to(self.device)
        md = self._metadata([], spans, tables, pos_np)
        stage_inputs = {}
        if not self.is_first_stage:
            hidden_size = self.config.model_config.hf_config.hidden_size
            zeros = torch.zeros(n, hidden_size, dtype=self.dtype, device=self.device)
            stage_inputs = {"hidden_states": zeros, "residual": zeros.clone()}
        with torch.inference_mode():
            hidden = self.model(ids, pos, self.kv_caches, md, **stage_inputs)
            if self.is_last_stage:
                num_rows = min(n, sc.max_num_seqs)
                logits = self.model.compute_logits(hidden[-num_rows:])  # [num_rows, vocab]
                params = SamplingParams(
                    temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1, logprobs=5
                )
                sampling_md = SamplingMetadata.build(
                    [params] * num_rows, [[0]] * num_rows, [[0]] * num_rows, self.device
                )
                self.sampler(logits, sampling_md)
        self.kv_caches = []
        return n

    # ---- one step -----------------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                block_ids=list(new.block_ids),
                sampling_params=new.sampling_params,
                num_computed_tokens=new.num_computed_tokens,
            )
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.token_ids.extend(cached.new_token_ids)
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _stage_inputs(self, intermediate: IntermediateTensors | None, num_tokens: int) -> dict:
        """Keyword arguments that feed the previous stage's activations into this one."""
        if self.is_first_stage:
            return {}
        if intermediate is None:
            raise ValueError(
                f"pipeline stage {self.stage.pp_rank} needs the activations of stage "
                f"{self.stage.pp_rank - 1}, got none"
            )
        if intermediate.num_tokens != num_tokens:
            raise ValueError(
                f"pipeline stage {self.stage.pp_rank} got activations for "
                f"{intermediate.num_tokens} tokens but this step computes {num_tokens}"
            )
        local = intermediate.to(self.device)
        return {"hidden_states": local.hidden_states, "residual": local.residual}

    @torch.inference_mode()
    def execute_model(
        self, so: SchedulerOutput, intermediate: IntermediateTensors | None = None
    ) -> ModelRunnerOutput | IntermediateTensors | None:
        """Run this stage on one step: sampled tokens from the last stage, activations
        [num_tokens, hidden] from the others (None for a step that computes nothing)."""
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput() if self.is_last_stage else None
        # Decodes (query length 1) first: the attention layer batches them in one kernel.
        order = sorted(so.num_scheduled_tokens, key=lambda r: so.num_scheduled_tokens[r] != 1)
        states = [self.requests[r] for r in order]
        num_decodes = sum(1 for r in order if so.num_scheduled_tokens[r] == 1)

        spans = []  # (start, length, context length after this step) per request
        for state in states:
            n = so.num_scheduled_tokens[state.req_id]
            spans.append((state.num_computed_tokens, n, state.num_computed_tokens + n))
        positions_np = np.concatenate([np.arange(s, s + n) for s, n, _ in spans])
        input_ids_np = None
        if self.is_first_stage:
            input_ids_np = np.concatenate(
                [np.asarray(st.token_ids[s : s + n]) for st, (s, n, _) in zip(states, spans)]
            )
        md = self._metadata(
            list(range(num_decodes)), spans, [st.block_ids for st in states], positions_np
        )
        stage_inputs = self._stage_inputs(intermediate, len(positions_np))
        input_ids = None
        if self.is_first_stage:
            input_ids = torch.from_numpy(input_ids_np.astype(np.int64)).to(self.device)
        positions = torch.from_numpy(positions_np.astype(np.int64)).to(self.device)
        hidden = self.model(input_ids, positions, self.kv_caches, md, **stage_inputs)
        if not self.is_last_stage:
            return IntermediateTensors(*hidden)  # [num_tokens, hidden] each

        out = ModelRunnerOutput()
        self._prompt_logprobs(states, spans, md, hidden, out)

        # Requests whose known tokens are all computed after this step sample one token.
        sample_rows, sample_states = [], []
        for i, (state, (_, _, ctx)) in enumerate(zip(states, spans)):
            if ctx >= len(state.token_ids):
                sample_rows.append(md.query_start_loc_cpu[i + 1] - 1)
                sample_states.append(state)
        if not sample_states:
            return out
        try:
            sampling_md = self._sampling_metadata(sample_states)
        except Exception:
            # One request's parameters broke the batch: find it, fail it alone.
            sample_rows, sample_states = self._drop_unsamplable(sample_rows, sample_states, out)
            if not sample_states:
                return out
            sampling_md = self._sampling_metadata(sample_states)
        if so.grammar_bitmask is not None:
            sampling_md = with_grammar_mask(
                sampling_md,
                [st.req_id for st in sample_states],
                so.structured_req_ids,
                so.grammar_bitmask,
                self.config.model_config.vocab_size,
                self.device,
            )
        rows = torch.tensor(sample_rows, dtype=torch.int64)  # [num_samples]
        if self.device.type == "cuda":
            # pinned + non_blocking: a pageable copy would wait for the queued forward pass
            rows = rows.pin_memory().to(self.device, non_blocking=True)
        else:
            rows = rows.to(self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))  # [num_samples, vocab]
        sampled = self.sampler(logits, sampling_md)
        out.req_ids = [st.req_id for st in sample_states]
        out.sampled_token_ids = sampled.sampled_token_ids.tolist()
        out.logprobs = sampled.logprobs_list()
        return out

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        return SamplingMetadata.build(
            [st.sampling_params for st in states],
            [st.token_ids[: st.num_prompt_tokens] for st in states],
            [st.output_token_ids for st in states],
            self.device,
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.config.model_config.vocab_size,
        )

    def _drop_unsamplable(
        self, rows: list[int], states: list[CachedRequestState], out: ModelRunnerOutput
    ) -> tuple[list[int], list[CachedRequestState]]:
        """Try each request's sampling metadata alone; the ones that fail go to `out.failed`
        (the scheduler finishes them with that error) and leave the batch."""
        kept_rows, kept_states = [], []
        for row, state in zip(rows, states):
            try:
                self._sampling_metadata([state])
            except Exception as exc:
                logger.warning("request %s cannot be sampled: %s", state.req_id, exc)
                out.failed[state.req_id] = f"its sampling parameters failed: {exc}"
                continue
            kept_rows.append(row)
            kept_states.append(state)
        return kept_rows, kept_states

    def _prompt_logprobs(self, states, spans, md, hidden, out: ModelRunnerOutput) -> None:
        for i, (state, (start, n, _)) in enumerate(zip(states, spans)):
            k = state.sampling_params.prompt_logprobs
            if k is None or start >= state.num_prompt_tokens:
                continue
            # Position p predicts prompt token p+1; the last prompt position predicts output.
            end = min(start + n, state.num_prompt_tokens - 1)
            entries: list[Logprobs | None] = [None] if start == 0 else []
            if end > start:
                q0 = md.query_start_loc_cpu[i]
                logits = self.model.compute_logits(hidden[q0 : q0 + end - start])
                nxt = torch.tensor(state.token_ids[start + 1 : end + 1], device=self.device)
                lps = compute_prompt_logprobs(logits, nxt, k)
                entries.extend(lps.to_list([k] * (end - start)))
            out.prompt_logprobs[state.req_id] = entries

    def _metadata(self, decode_idx, spans, block_tables, positions_np) -> AttentionMetadata:
        bs = self.block_size
        query_lens = [n for _, n, _ in spans]
        seq_lens = [ctx for _, _, ctx in spans]
        qsl = np.zeros(len(spans) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        max_blocks = max(-(-ctx // bs) for ctx in seq_lens)
        table = np.zeros((len(spans), max_blocks), dtype=np.int32)
        for i, ids in enumerate(block_tables):
            used = min(len(ids), max_blocks)
            table[i, :used] = ids[:used]
        # slot of each token = block_table[req][pos // bs] * bs + pos % bs
        req_of_token = np.repeat(np.arange(len(spans)), query_lens)
        slots = table[req_of_token, positions_np // bs].astype(np.int64) * bs + positions_np % bs
        dev = self.device
        return AttentionMetadata(
            num_decodes=len(decode_idx),
            num_decode_tokens=len(decode_idx),
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(table).to(dev),
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq_lens,
            max_seq_len=max(seq_lens),
            block_size=bs,
        )

    # ---- embeddings ---------------------------------------------------------------------------

    @torch.inference_mode()
    def embed(
        self,
        prompts: list[list[int]],
        pooling: str,
        normalize: bool,
        intermediate: list[IntermediateTensors] | None = None,
    ) -> list[list[float]] | list[IntermediateTensors]:
        """Pooled final hidden states of each prompt, through a scratch KV cache of its own.

        A stage before the last returns each prompt's activations for the next stage.
        """
        if pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be 'last' or 'mean', got {pooling!r}")
        results = []
        for i, token_ids in enumerate(prompts):
            n = len(token_ids)
            blocks = -(-n // self.block_size)
            shape = self.model.kv_cache_shape(blocks, self.block_size)
            scratch = [
                _zeros(shape, self.kv_cache_dtype, self.device)
                for _ in range(self.model.num_layers_in_stage)
            ]
            pos_np = np.arange(n)
            md = self._metadata([], [(0, n, n)], [list(range(blocks))], pos_np)
            stage_inputs = self._stage_inputs(intermediate[i] if intermediate else None, n)
            ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
            positions = torch.from_numpy(pos_np).to(self.device)
            hidden = self.model(ids, positions, scratch, md, **stage_inputs)
            if not self.is_last_stage:
                results.append(IntermediateTensors(*hidden))
                continue
            vec = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
            vec = vec.float()
            if normalize:
                vec = torch.nn.functional.normalize(vec, dim=0)
            results.append(vec.tolist())
        return results


def _kv_cache_dtype(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What this worker's KV cache holds: GPU workers their (16-bit) compute dtype, CPU workers
    `cpu_kv_cache_dtype` (plan/cpu_dtype.py)."""
    if device.type != "cpu":
        return dtype
    mc = config.model_config
    int8_blocks = mc.cpu_blocks is not None and int8_activations_in_use()
    return _DTYPES[cpu_kv_cache_dtype(config.cache_config.kv_cache_dtype, mc.dtype, int8_blocks)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV tensor. Zeros, not empty: padded slots of a gathered block are masked,
    but 0 * NaN would still leak.

    On the CPU an anonymous private mapping hands out zero pages on first touch, so a multi-GiB
    cache costs nothing until used (torch.zeros writes every byte up front). It asks for small
    pages: on the 2-core VM of docs/benchmarks.md a huge page's first touch ran at 0.33-0.43
    GB/s against 2.2-2.4 for 4 KB pages, and KV writes (which touch fresh blocks) took 2.4 s of
    a 64-prompt run with huge pages against 0.6 s without; decode attention read the same.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0 or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buffer.madvise(mmap.MADV_NOHUGEPAGE)
    # the tensor keeps the mapping alive; it is unmapped with the last reference
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)
