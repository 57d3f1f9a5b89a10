"""A worker's request state and step inputs (order, positions, ids, slots, tables), no model."""

from __future__ import annotations

import pytest
import torch

from hybridllm.engine.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from hybridllm.sampling_params import SamplingParams
from hybridllm.worker.input_batch import (
    InputBatch,
    previous_stage_inputs,
    profile_block_tables,
    rows_on_device,
    step_inputs,
)
from hybridllm.worker.intermediate_tensors import IntermediateTensors
from hybridllm.worker.kv_cache_budget import profile_spans

CPU = torch.device("cpu")
BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def make_batch(with_input_ids: bool = True) -> InputBatch:
    return InputBatch(BLOCK_SIZE, CPU, with_input_ids, eos_token_ids={2}, vocab_size=100)


def new(req_id, prompt, blocks, computed=0, output=(), params=GREEDY) -> NewRequestData:
    return NewRequestData(req_id, list(prompt), list(output), params, (list(blocks),), computed)


def step(scheduled: dict[str, int], new_reqs=(), cached=(), finished=()) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=list(new_reqs),
        scheduled_cached_reqs=list(cached),
        num_scheduled_tokens=dict(scheduled),
        total_num_scheduled_tokens=sum(scheduled.values()),
        finished_req_ids=set(finished),
    )


def mixed_step() -> SchedulerOutput:
    """A 6-token prefill listed first, then two one-token queries (a prefix-cache hit's last
    prompt token and a one-token remainder)."""
    return step(
        {"a": 6, "c": 1, "d": 1},
        new_reqs=[
            new("a", range(10, 16), [3, 7]),
            new("c", range(30, 35), [5, 2], computed=4),
            new("d", [40, 41], [9], computed=1),
        ],
    )


def test_update_adds_extends_and_drops_requests():
    batch = make_batch()
    resumed = new("b", [20, 21], [4], output=[22])  # preempted, recomputes its output
    batch.update(step({"a": 6, "b": 3}, new_reqs=[new("a", range(10, 16), [3, 7]), resumed]))
    assert batch.requests["b"].token_ids == [20, 21, 22]
    assert batch.requests["b"].num_prompt_tokens == 2
    assert batch.requests["b"].output_token_ids == [22]
    cached = CachedRequestData("a", new_token_ids=[16], new_block_ids=([8],), num_computed_tokens=6)
    batch.update(step({"a": 1}, cached=[cached], finished={"b", "never-seen"}))
    assert set(batch.requests) == {"a"}
    state = batch.requests["a"]
    assert state.token_ids == [10, 11, 12, 13, 14, 15, 16]
    assert state.block_ids == ([3, 7, 8],)
    assert state.num_computed_tokens == 6
    assert state.output_token_ids == [16]


def test_decodes_first_with_positions_ids_and_slots():
    batch = make_batch()
    scheduler_output = mixed_step()
    batch.update(scheduler_output)
    inputs = batch.prepare_inputs(scheduler_output)
    assert [state.req_id for state in inputs.requests] == ["c", "d", "a"]
    assert inputs.spans == [(4, 1, 5), (1, 1, 2), (0, 6, 6)]
    assert inputs.num_tokens == 8
    assert inputs.positions.tolist() == [4, 1, 0, 1, 2, 3, 4, 5]
    assert inputs.input_ids.tolist() == [34, 41, 10, 11, 12, 13, 14, 15]
    assert inputs.input_ids.dtype == inputs.positions.dtype == torch.int64
    metadata = inputs.attn_metadata
    assert metadata.num_decodes == metadata.num_decode_tokens == 2
    # block * 4 + offset: c's position 4 in its second block (2), d's 1 in block 9, a across 3, 7
    assert metadata.slot_mapping.tolist() == [8, 37, 12, 13, 14, 15, 28, 29]
    assert metadata.slot_mapping.dtype == torch.int64
    assert metadata.query_start_loc.tolist() == [0, 1, 2, 8]
    assert metadata.query_start_loc.dtype == torch.int32
    assert metadata.query_start_loc_cpu == [0, 1, 2, 8]
    assert metadata.seq_lens.tolist() == metadata.seq_lens_cpu == [5, 2, 6]
    assert metadata.block_tables.tolist() == [[5, 2], [9, 0], [3, 7]]  # padded with block 0
    assert metadata.block_tables.dtype == torch.int32
    assert metadata.max_seq_len == 6 and metadata.block_size == BLOCK_SIZE
    # every request reaches its known tokens: each samples from its last row
    rows = inputs.sampling_rows()
    assert [r.row for r in rows] == [0, 1, 7]
    assert [r.state.req_id for r in rows] == ["c", "d", "a"]


def test_later_stages_take_no_input_ids():
    batch = make_batch(with_input_ids=False)
    scheduler_output = mixed_step()
    batch.update(scheduler_output)
    inputs = batch.prepare_inputs(scheduler_output)
    assert inputs.input_ids is None
    assert inputs.positions.tolist() == [4, 1, 0, 1, 2, 3, 4, 5]
    assert inputs.attn_metadata.slot_mapping.tolist() == [8, 37, 12, 13, 14, 15, 28, 29]


def test_chunked_prefill_spans_samples_and_prompt_logprobs():
    prompt = list(range(50, 60))  # 10 tokens over blocks 1, 2, 3
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    batch = make_batch()
    other = new("plain", [70, 71], [6])  # no prompt logprobs asked
    first = step({"p": 4, "plain": 2}, new_reqs=[new("p", prompt, [1, 2, 3], params=params), other])
    batch.update(first)
    inputs = batch.prepare_inputs(first)
    assert inputs.spans == [(0, 4, 4), (0, 2, 2)]
    assert inputs.attn_metadata.block_tables.tolist() == [[1], [6]]  # cut to the blocks read
    rows = inputs.sampling_rows()
    assert [(r.row, r.state.req_id) for r in rows] == [(5, "plain")]
    [logprob_rows] = inputs.prompt_logprob_rows()
    assert (logprob_rows.req_id, logprob_rows.num_logprobs) == ("p", 2)
    assert logprob_rows.first_row == 0 and logprob_rows.starts_prompt
    assert logprob_rows.next_token_ids == [51, 52, 53, 54]

    def chunk(computed: int, length: int):
        cached = CachedRequestData("p", [], ([],), num_computed_tokens=computed)
        scheduler_output = step({"p": length}, cached=[cached], finished={"plain"})
        batch.update(scheduler_output)
        return batch.prepare_inputs(scheduler_output)

    middle = chunk(4, 4)
    assert middle.positions.tolist() == [4, 5, 6, 7]
    assert middle.input_ids.tolist() == [54, 55, 56, 57]
    assert middle.attn_metadata.slot_mapping.tolist() == [8, 9, 10, 11]
    assert middle.attn_metadata.seq_lens_cpu == [8]
    assert middle.attn_metadata.block_tables.tolist() == [[1, 2]]
    assert middle.sampling_rows() == []
    [logprob_rows] = middle.prompt_logprob_rows()
    assert logprob_rows.next_token_ids == [55, 56, 57, 58] and not logprob_rows.starts_prompt

    last = chunk(8, 2)
    assert last.positions.tolist() == [8, 9]
    assert last.attn_metadata.slot_mapping.tolist() == [12, 13]
    assert last.attn_metadata.block_tables.tolist() == [[1, 2, 3]]
    assert [(r.row, r.state.req_id) for r in last.sampling_rows()] == [(1, "p")]
    # the last prompt position predicts the output, not a prompt token
    [logprob_rows] = last.prompt_logprob_rows()
    assert logprob_rows.next_token_ids == [59] and logprob_rows.first_row == 0

    decode = CachedRequestData("p", [61], ([],), num_computed_tokens=10)
    scheduler_output = step({"p": 1}, cached=[decode])
    batch.update(scheduler_output)
    inputs = batch.prepare_inputs(scheduler_output)
    assert inputs.positions.tolist() == [10] and inputs.input_ids.tolist() == [61]
    assert inputs.attn_metadata.slot_mapping.tolist() == [14]
    assert inputs.prompt_logprob_rows() == []


def test_prompt_logprobs_stop_at_the_prompt_of_a_resumed_request():
    # preempted after sampling 99, recomputed at once: its output is not scored as prompt
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1)
    scheduler_output = step(
        {"r": 5}, new_reqs=[new("r", [50, 51, 52, 53], [0, 1], 0, [99], params)]
    )
    batch = make_batch()
    batch.update(scheduler_output)
    inputs = batch.prepare_inputs(scheduler_output)
    assert inputs.input_ids.tolist() == [50, 51, 52, 53, 99]
    [logprob_rows] = inputs.prompt_logprob_rows()
    assert logprob_rows.next_token_ids == [51, 52, 53] and logprob_rows.starts_prompt
    assert [r.row for r in inputs.sampling_rows()] == [4]


def test_unsamplable_requests_leave_the_batch():
    batch = make_batch()
    broken = SamplingParams(temperature=0, max_tokens=4)
    broken.logit_bias = {10**9: 1.0}  # outside the 100-token vocab
    scheduler_output = step(
        {"good": 2, "bad": 2},
        new_reqs=[new("good", [5, 6], [0]), new("bad", [7, 8], [1], params=broken)],
    )
    batch.update(scheduler_output)
    rows = batch.prepare_inputs(scheduler_output).sampling_rows()
    with pytest.raises(ValueError, match="outside the vocab"):
        batch.sampling_metadata(rows)
    failed: dict[str, str] = {}
    kept = batch.drop_unsamplable(rows, failed)
    assert [(r.row, r.state.req_id) for r in kept] == [(1, "good")]
    assert list(failed) == ["bad"]
    assert failed["bad"].startswith("its sampling parameters failed: ")
    assert batch.sampling_metadata(kept).all_greedy


def test_profile_block_tables_share_blocks_between_reads():
    # chunked prefill: the last 16-token chunk of a 64-token prompt over its whole context
    spans = profile_spans(16, 64, 4)
    assert spans == [(48, 16, 64)]
    tables, num_blocks = profile_block_tables(spans, BLOCK_SIZE)
    assert num_blocks == 5  # 4 blocks written + 1 for a chunk that straddles a boundary
    assert tables == [[j % 5 for j in range(16)]]
    tables, num_blocks = profile_block_tables([(0, 6, 6), (0, 3, 3)], BLOCK_SIZE)
    assert tables == [[0, 1], [3]] and num_blocks == 5
    inputs = step_inputs([(0, 6, 6), (0, 3, 3)], [tables], 0, BLOCK_SIZE, CPU)
    assert inputs.input_ids is None and inputs.requests == []
    assert inputs.attn_metadata.slot_mapping.tolist() == [0, 1, 2, 3, 4, 5, 12, 13, 14]
    assert inputs.sampling_rows() == []


def test_previous_stage_inputs_check_the_activations():
    hidden = torch.arange(6, dtype=torch.float32).view(3, 2)
    kwargs = previous_stage_inputs(IntermediateTensors(hidden, hidden + 1), 3, 1, CPU)
    assert torch.equal(kwargs["hidden_states"], hidden)
    assert torch.equal(kwargs["residual"], hidden + 1)
    with pytest.raises(ValueError, match="stage 1 needs the activations of stage 0"):
        previous_stage_inputs(None, 3, 1, CPU)
    with pytest.raises(ValueError, match="activations for 3 tokens but this step computes 4"):
        previous_stage_inputs(IntermediateTensors(hidden, None), 4, 1, CPU)


def test_rows_on_device():
    rows = rows_on_device([0, 4, 9], CPU)
    assert rows.tolist() == [0, 4, 9] and rows.dtype == torch.int64
