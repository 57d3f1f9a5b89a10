"""Model runner: loads its stage's layers, runs each scheduler step through them, samples."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hybridllm.config import EngineConfig
from hybridllm.engine.kv_cache_groups import KVCacheGroupSpec, kv_cache_groups
from hybridllm.engine.scheduler_output import Logprobs, ModelRunnerOutput, SchedulerOutput
from hybridllm.layers.cpu_kernels import cpu_kernels_enabled
from hybridllm.plan.plan import StagePlan
from hybridllm.platforms import Platform
from hybridllm.sample import Sampler, compute_prompt_logprobs
from hybridllm.sample.draft_acceptance import accepted_length, group_by_request
from hybridllm.sample.grammar_mask import with_grammar_mask
from hybridllm.worker import kv_cache_sizing
from hybridllm.worker.input_batch import (
    CachedRequestState,
    InputBatch,
    SampleRow,
    StepInputs,
    previous_stage_inputs,
    profile_block_tables,
    rows_on_device,
    step_inputs,
)
from hybridllm.worker.intermediate_tensors import IntermediateTensors
from hybridllm.worker.kv_cache_budget import profile_spans
from hybridllm.worker.kv_cache_sizing import TORCH_DTYPES, kv_zeros, profile_sampling_metadata
from hybridllm.worker.weight_streamer import build_weight_streamer


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
        self.dtype = TORCH_DTYPES[config.model_config.dtype]
        self.kv_cache_dtype = kv_cache_sizing.kv_cache_dtype(config, self.dtype, self.device)
        self.block_size = config.cache_config.block_size
        self.show_progress = show_progress
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        # speculative decoding's "mtp" method: the checkpoint's MTP layer on the last stage,
        # with a KV cache of its own over the target's block tables
        spec = config.speculative_config
        self.uses_mtp = self.is_last_stage and spec is not None and spec.method == "mtp"
        self.mtp: torch.nn.Module | None = None
        self.mtp_kv_cache: torch.Tensor | None = None
        eos_token_ids = set(config.model_config.eos_token_ids)  # masked under min_tokens
        vocab_size = config.model_config.vocab_size
        self.input_batch = InputBatch(
            self.block_size, self.device, self.is_first_stage, eos_token_ids, vocab_size
        )
        # greedy rows take the compiled argmax on a CPU last stage with the kernels on
        native_argmax = self.device.type == "cpu" and cpu_kernels_enabled(
            config.kernel_config.cpu_kernels
        )
        self.sampler = Sampler(native_argmax=native_argmax)

    @property
    def requests(self) -> dict[str, CachedRequestState]:
        """The running requests this worker keeps state for, by id."""
        return self.input_batch.requests

    # ---- set-up -------------------------------------------------------------------------------

    def load_model(self) -> None:
        from hybridllm.layers.gguf_linear import gguf_kernel_types
        from hybridllm.loader import open_model_source
        from hybridllm.models.registry import get_model_class

        model_config = self.config.model_config
        source = open_model_source(model_config.model)
        model_class = get_model_class(model_config.architecture)
        # Only tensor-parallel models take a group: plain models keep their signature.
        extra: dict[str, Any] = {} if self.tp_group is None else {"tp_group": self.tp_group}
        if self.stage.cpu_expert_layers:  # MoE: those layers' routed experts on the host
            extra["cpu_expert_layers"] = self.stage.cpu_expert_layers
        start, end = self.stage.layer_start, self.stage.layer_end
        with torch.device(self.device):
            model = model_class(
                model_config.hf_config, self.dtype, self.device, start, end, **extra
            )
        # On a CPU worker GGUF linears stay in their blocks (read ~6x fewer bytes per token).
        # Host experts of a GPU stage keep them too (the model decodes what goes to the GPU).
        host = torch.device("cpu") if self.stage.cpu_expert_layers else self.device
        kernels = self.config.kernel_config
        keep = (
            gguf_kernel_types(host, kernels.cpu_kernels)
            if model_config.quantization != "none"
            else ()
        )
        weights = self._quantized_at_load(
            source.iter_weights(model.owns_weight, keep), model.quantize_role, source, keep, host
        )
        if self.show_progress:
            from tqdm import tqdm

            weights = tqdm(weights, desc="Loading weights", unit="tensor", leave=False)
        loaded = model.load_weights(weights)
        missing = sorted(model.expected_weight_names() - loaded)
        if missing:
            raise ValueError(
                f"{model_config.model}: weights missing from the checkpoint: {missing[:8]}"
            )
        if self.uses_mtp:
            self.mtp = self._load_mtp(model_class, source, keep, model)
        # Dense copies for streaming are taken before the CPU repacks its weights.
        streamer = (
            build_weight_streamer(model, self.stage, self.dtype) if self.stage.streams else None
        )
        model.process_weights_after_loading(kernels)
        model.execution.attach_weight_streamer(streamer)
        self.model = model.eval()

    def _quantized_at_load(
        self, weights: Any, quantize_role: Any, source: Any, keep: Any, host: torch.device
    ) -> Any:
        """`weights`, with `--quantization q8_0|q4_0|q4_1` applied where the tensors land on a
        CPU with the native kernels: float linears into blocks the native op reads (cached on
        disk per checkpoint)."""
        from hybridllm.loader.onload_quant import (
            ONLOAD_TYPES,
            QuantizedWeightCache,
            checkpoint_key,
            quantize_weights,
        )

        quantization = self.config.model_config.quantization
        if quantization not in ONLOAD_TYPES or not keep or host.type != "cpu":
            return weights
        cache = QuantizedWeightCache(checkpoint_key(source.weight_files()))
        return quantize_weights(weights, quantize_role, quantization, cache)

    def _load_mtp(self, model_class: type, source: Any, keep: Any, target: Any) -> Any:
        """The checkpoint's MTP layer (models/mtp.py) on this stage's device; its routed
        experts on the host where the stage keeps its last layer's there (as the plan counts
        them)."""
        from hybridllm.models.mtp import MultiTokenPredictor
        from hybridllm.plan.memory_budget import mtp_experts_on_host

        on_host = mtp_experts_on_host(self.stage)
        stage_kwargs = {"cpu_expert_layers": 1} if on_host else {}
        with torch.device(self.device):
            mtp = MultiTokenPredictor(
                model_class, self.config.model_config.hf_config, self.dtype, self.device,
                **stage_kwargs,
            )  # fmt: skip
        host = torch.device("cpu") if on_host else self.device
        mtp.load_weights(
            self._quantized_at_load(
                source.iter_mtp_weights(mtp.owns_weight, keep),
                mtp.quantize_role,
                source,
                keep,
                host,
            ),  # fmt: skip
            lambda names: source.iter_weights(names.__contains__, keep),
            target,
        )
        mtp.process_weights_after_loading(self.config.kernel_config)
        return mtp.eval()

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of `block_size` tokens over every layer of the stage."""
        return sum(self.kv_cache_group_bytes_per_block())

    def kv_cache_group_bytes_per_block(self) -> list[int]:
        """Bytes of one block of each KV cache group over this stage's layers of the group
        (and the MTP layer's, which shares the target's block tables)."""
        sizes = kv_cache_sizing.group_bytes_per_block(
            self.model, self.block_size, self.kv_cache_dtype, self.kv_cache_groups
        )
        if self.mtp is not None:
            extra = kv_cache_sizing.group_bytes_per_block(
                self.mtp.block, self.block_size, self.kv_cache_dtype, self.kv_cache_groups
            )
            sizes = [a + b for a, b in zip(sizes, extra)]
        return sizes

    @property
    def kv_cache_groups(self) -> list[KVCacheGroupSpec]:
        return kv_cache_groups(self.config.model_config.hf_config)

    def determine_num_blocks(self) -> tuple[int, ...]:
        """Blocks of each KV cache group that fit this worker's KV budget (never more than the
        scheduler could use)."""
        return kv_cache_sizing.determine_num_blocks(
            self.config,
            self.platform,
            self.stage,
            self.kv_cache_group_bytes_per_block(),
            self.profile_forward,
        )

    def initialize_kv_cache(self, num_blocks: int | tuple[int, ...]) -> None:
        self.kv_caches = self._new_kv_cache(num_blocks)
        if self.mtp is not None:
            (self.mtp_kv_cache,) = self._new_kv_cache(num_blocks, self.mtp.block)

    def _new_kv_cache(
        self, num_blocks: int | tuple[int, ...], model: torch.nn.Module | None = None
    ) -> list[torch.Tensor]:
        """One cache tensor per layer of the stage (or of `model`), of its KV cache group's
        block count (an int: every group has that many): paged KV, or a linear-attention
        layer's state slots."""
        model = self.model if model is None else model
        specs = self.kv_cache_groups
        if isinstance(num_blocks, int):
            num_blocks = (num_blocks,) * len(specs)
        caches = []
        for g in model.execution.layer_groups:
            shape, dtype = kv_cache_sizing.layer_cache_layout(
                model, specs[g], num_blocks[g], self.block_size, self.kv_cache_dtype
            )
            caches.append(kv_zeros(shape, dtype, self.device))
        return caches

    def _group_tables(
        self, tables: list[list[int]], num_blocks: int
    ) -> tuple[list[list[list[int]]], tuple[int, ...]]:
        """Every KV cache group's block tables for a scratch step whose paged groups all use
        `tables` (over `num_blocks` blocks), and each group's block count: a state group gives
        sequence i slot i."""
        per_group, counts = [], []
        for spec in self.kv_cache_groups:
            if spec.is_state:
                per_group.append([[i] for i in range(len(tables))])
                counts.append(len(tables))
            else:
                per_group.append(tables)
                counts.append(num_blocks)
        return per_group, tuple(counts)

    def profile_forward(self, on_cache_ready: Callable[[], None] | None = None) -> int:
        """One step of the largest batch the scheduler may send, for its memory peak: the spans
        of `profile_spans` (max_num_batched_tokens tokens, or the last chunk of a max_model_len
        prompt when chunked prefill cuts prompts shorter) through this stage's layers, on a
        temporary KV cache; on the last stage logits for max_num_seqs rows (times 1 + drafts with
        speculative decoding) and the sampler's most costly path over them (top-k, top-p,
        penalties, logprobs). `on_cache_ready` runs once the temporary cache exists. Returns the
        tokens run."""
        scheduler_config = self.config.scheduler_config
        spans = profile_spans(
            scheduler_config.max_num_batched_tokens,
            scheduler_config.max_model_len,
            scheduler_config.max_num_seqs,
        )
        block_tables, num_blocks = profile_block_tables(spans, self.block_size)
        tables, num_blocks = self._group_tables(block_tables, num_blocks)
        self.initialize_kv_cache(num_blocks)
        if on_cache_ready is not None:
            on_cache_ready()  # the step's inputs below count towards the peak
        num_tokens = sum(length for _, length, _ in spans)
        ids = np.zeros(num_tokens, dtype=np.int64)  # every stage gets ids here
        inputs = step_inputs(spans, tables, 0, self.block_size, self.device, ids)
        stage_inputs = {}
        if not self.is_first_stage:
            hidden_size = self.config.model_config.hf_config.hidden_size
            zeros = torch.zeros(num_tokens, hidden_size, dtype=self.dtype, device=self.device)
            stage_inputs = {"hidden_states": zeros, "residual": zeros.clone()}
        with torch.inference_mode():
            hidden = self._forward(inputs, self.kv_caches, stage_inputs)
            if self.is_last_stage:
                # a verify step samples at each draft too (speculative decoding)
                spec = self.config.speculative_config
                rows_per_seq = 1 if spec is None else 1 + spec.num_speculative_tokens
                num_rows = min(num_tokens, scheduler_config.max_num_seqs * rows_per_seq)
                logits = self.model.compute_logits(hidden[-num_rows:])  # [num_rows, vocab]
                self.sampler(logits, profile_sampling_metadata(num_rows, self.device))
                if self.mtp is not None:  # the MTP layer runs on every row of a step
                    ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
                    mtp_hidden = self.mtp(
                        ids, hidden, inputs.positions, self.mtp_kv_cache, inputs.attn_metadata
                    )
                    self.mtp.compute_logits(mtp_hidden[-scheduler_config.max_num_seqs :])
        self.kv_caches = []
        self.mtp_kv_cache = None
        return num_tokens

    # ---- one step -----------------------------------------------------------------------------

    def _forward(
        self, inputs: StepInputs, kv_caches: list[torch.Tensor], stage_inputs: dict
    ) -> Any:
        """This stage's layers over one batch: hidden states [num_tokens, hidden] on the last
        stage, (hidden states, residual) before it."""
        return self.model(
            inputs.input_ids, inputs.positions, kv_caches, inputs.attn_metadata, **stage_inputs
        )

    def _stage_inputs(self, intermediate: IntermediateTensors | None, num_tokens: int) -> dict:
        """Keyword arguments that feed the previous stage's activations into this one."""
        if self.is_first_stage:
            return {}
        return previous_stage_inputs(intermediate, num_tokens, self.stage.pp_rank, self.device)

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: SchedulerOutput, intermediate: IntermediateTensors | None = None
    ) -> ModelRunnerOutput | IntermediateTensors | None:
        """Run this stage on one step: sampled tokens from the last stage, activations
        [num_tokens, hidden] from the others (None for a step that computes nothing)."""
        self.input_batch.update(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput() if self.is_last_stage else None
        inputs = self.input_batch.prepare_inputs(scheduler_output)
        stage_inputs = self._stage_inputs(intermediate, inputs.num_tokens)
        hidden = self._forward(inputs, self.kv_caches, stage_inputs)
        if not self.is_last_stage:
            return IntermediateTensors(*hidden)  # [num_tokens, hidden] each

        output = ModelRunnerOutput()
        self._prompt_logprobs(inputs, hidden, output)
        rows, sampled_rows = self._sample(scheduler_output, inputs, hidden, output)
        if self.mtp is not None:  # every step: the MTP layer's cache follows the target's
            output.draft_token_ids = self._mtp_drafts(inputs, hidden, rows, sampled_rows, output)
        return output

    def _sample(
        self,
        scheduler_output: SchedulerOutput,
        inputs: StepInputs,
        hidden: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> tuple[list[SampleRow], dict[int, int]]:
        """Sample the step's sampling rows into `output` (the kept tokens per request); returns
        the rows sampled and each one's token by row."""
        rows = inputs.sampling_rows()
        if not rows:
            return [], {}
        batch = self.input_batch
        try:
            sampling_metadata = batch.sampling_metadata(rows)
        except Exception:
            # One request's parameters broke the batch: find it, fail it alone.
            rows = batch.drop_unsamplable(rows, output.failed)
            if not rows:
                return [], {}
            sampling_metadata = batch.sampling_metadata(rows)
        if scheduler_output.grammar_bitmask is not None:
            sampling_metadata = with_grammar_mask(
                sampling_metadata,
                [(row.state.req_id, row.num_drafts_before) for row in rows],
                scheduler_output.structured_req_ids,
                scheduler_output.grammar_bitmask,
                scheduler_output.scheduled_spec_decode_tokens,
                self.config.model_config.vocab_size,
                self.device,
            )
        row_index = rows_on_device([row.row for row in rows], self.device)  # [num_rows]
        logits = self.model.compute_logits(hidden.index_select(0, row_index))  # [rows, vocab]
        sampled = self.sampler(logits, sampling_metadata)
        sampled_ids = sampled.sampled_token_ids.tolist()
        req_ids = [row.state.req_id for row in rows]
        tokens = group_by_request(req_ids, sampled_ids)
        logprobs = group_by_request(req_ids, sampled.logprobs_list())
        for req_id, request_ids in tokens.items():
            kept = accepted_length(batch.requests[req_id].spec_token_ids, request_ids) + 1
            output.req_ids.append(req_id)
            output.sampled_token_ids.append(request_ids[:kept])
            entries = logprobs[req_id][:kept]
            output.logprobs.append(None if entries[0] is None else entries)
        return rows, dict(zip((row.row for row in rows), sampled_ids))

    def _mtp_drafts(
        self,
        inputs: StepInputs,
        hidden: torch.Tensor,
        rows: list[SampleRow],
        sampled_rows: dict[int, int],
        output: ModelRunnerOutput,
    ) -> dict[str, list[int]]:
        """Run the MTP layer on every row of the step and draft, for each request that sampled,
        the token after its last kept one. Row p reads the token at p + 1: the next known token,
        else the one the row sampled (a rejected draft's row reads a token no one keeps; the
        next step writes its position again)."""
        next_ids = np.zeros(inputs.num_tokens, dtype=np.int64)
        starts = inputs.attn_metadata.query_start_loc_cpu
        for i, (state, (start, length, _)) in enumerate(zip(inputs.requests, inputs.spans)):
            known = state.token_ids[start + 1 : start + 1 + length]
            next_ids[starts[i] : starts[i] + len(known)] = known
        for row, token in sampled_rows.items():
            next_ids[row] = token
        ids = torch.from_numpy(next_ids).to(self.device)
        mtp_hidden = self.mtp(
            ids, hidden, inputs.positions, self.mtp_kv_cache, inputs.attn_metadata
        )  # [num_tokens, hidden]
        # each request's draft comes from the row of its last kept token
        rows_of: dict[str, list[int]] = {}
        for row in rows:
            rows_of.setdefault(row.state.req_id, []).append(row.row)
        req_ids = output.req_ids
        draft_rows = [
            rows_of[r][len(kept) - 1] for r, kept in zip(req_ids, output.sampled_token_ids)
        ]
        if not draft_rows:
            return {}
        draft_index = rows_on_device(draft_rows, self.device)
        last_hidden = mtp_hidden.index_select(0, draft_index)  # [num_requests, hidden]
        token = self._mtp_argmax(last_hidden)  # [num_requests]
        drafts = {req_id: [t] for req_id, t in zip(req_ids, token.tolist())}
        # Past the first draft the layer reads its own output in place of the target's hidden
        # state, one position further each time, writing its KV into the request's lookahead
        # slots (the scheduler holds k - 1 past the step's tokens; the next step writes those
        # positions again from the target's real states).
        states = {row.state.req_id: row.state for row in rows}
        alive = list(req_ids)  # requests whose chain goes on
        kept_at = (inputs.positions.index_select(0, draft_index) + 1).tolist()  # kept token's
        for j in range(1, self.config.speculative_config.num_speculative_tokens):
            keep = [i for i, r in enumerate(alive) if self._has_slot(states[r], kept_at[i] + j - 1)]
            if not keep:
                break
            if len(keep) < len(alive):
                index = rows_on_device(keep, self.device)
                last_hidden, token = (
                    last_hidden.index_select(0, index),
                    token.index_select(0, index),
                )
                alive, kept_at = [alive[i] for i in keep], [kept_at[i] for i in keep]
            # at position q + j - 1 (q: the kept token's): the previous state and draft j
            spans = [(q + j - 1, 1, q + j) for q in kept_at]
            groups = len(states[alive[0]].block_ids)
            tables = [[states[r].block_ids[g] for r in alive] for g in range(groups)]
            step = step_inputs(spans, tables, len(alive), self.block_size, self.device)
            last_hidden = self.mtp(
                token, last_hidden, step.positions, self.mtp_kv_cache, step.attn_metadata
            )  # [len(alive), hidden]
            token = self._mtp_argmax(last_hidden)
            for r, t in zip(alive, token.tolist()):
                drafts[r].append(t)
        return drafts

    def _mtp_argmax(self, mtp_hidden: torch.Tensor) -> torch.Tensor:
        """The MTP layer's greedy token for each row [n], of the target's vocabulary."""
        logits = self.mtp.compute_logits(mtp_hidden)  # [n, vocab]
        return logits[:, : self.config.model_config.vocab_size].argmax(dim=-1)

    def _has_slot(self, state: CachedRequestState, position: int) -> bool:
        """Whether the request's blocks reach `position` (in every KV cache group)."""
        return all(len(ids) * self.block_size > position for ids in state.block_ids)

    def _prompt_logprobs(
        self, inputs: StepInputs, hidden: torch.Tensor, output: ModelRunnerOutput
    ) -> None:
        """Logprobs of the prompt tokens this step computes, for requests that asked."""
        for rows in inputs.prompt_logprob_rows():
            entries: list[Logprobs | None] = [None] if rows.starts_prompt else []
            num_rows = len(rows.next_token_ids)
            if num_rows:
                logits = self.model.compute_logits(
                    hidden[rows.first_row : rows.first_row + num_rows]
                )  # [num_rows, vocab]
                targets = torch.tensor(rows.next_token_ids, device=self.device)
                logprobs = compute_prompt_logprobs(logits, targets, rows.num_logprobs)
                entries.extend(logprobs.to_list([rows.num_logprobs] * num_rows))
            output.prompt_logprobs[rows.req_id] = entries

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
            tables, num_blocks = self._group_tables(
                [list(range(-(-n // self.block_size)))], -(-n // self.block_size)
            )
            scratch = self._new_kv_cache(num_blocks)
            ids = np.asarray(token_ids, dtype=np.int64)  # every stage gets ids here
            inputs = step_inputs([(0, n, n)], tables, 0, self.block_size, self.device, ids)
            stage_inputs = self._stage_inputs(intermediate[i] if intermediate else None, n)
            hidden = self._forward(inputs, scratch, stage_inputs)
            if not self.is_last_stage:
                results.append(IntermediateTensors(*hidden))
                continue
            vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
            vector = vector.float()
            if normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            results.append(vector.tolist())
        return results
