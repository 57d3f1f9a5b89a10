"""Linear attention's state cache: a KV cache group of one slot per request, sized apart from the
paged groups, independent of context length, freed with the request; the config fields that
say which layers are linear."""

from __future__ import annotations

import json

import pytest
import torch

from hybridllm.engine.kv_cache_groups import KVCacheGroupSpec, kv_cache_groups
from hybridllm.engine.kv_cache_manager import KVCacheManager
from hybridllm.engine.request import Request
from hybridllm.layers.gated_delta_net import DeltaNetBatch, DeltaNetShape, DeltaNetState
from hybridllm.layers.prepared_attention import prepare_attention
from hybridllm.loader.hf_config import HFConfig
from hybridllm.loader.model_source import ModelLoadError
from hybridllm.sampling_params import SamplingParams
from hybridllm.worker.kv_cache_budget import group_block_needs, split_kv_budget
from tests.model_helpers import StepSequence, make_step, tiny_config

FULL = KVCacheGroupSpec(None, (3,))
STATE = KVCacheGroupSpec(None, (0, 1, 2), is_state=True)


def request(req_id: str, num_tokens: int) -> Request:
    return Request(req_id, list(range(3, 3 + num_tokens)), SamplingParams(max_tokens=4), None)


def test_groups_of_a_qwen3_next_config():
    groups = kv_cache_groups(tiny_config("qwen3_next"))
    assert groups == [FULL, STATE]
    assert STATE.blocks_per_request(block_size=4, chunk=16, num_tokens=10_000) == 1
    assert not STATE.is_full and FULL.is_full


def test_a_request_holds_one_slot_from_its_first_step_to_its_end():
    manager = KVCacheManager([FULL, STATE], [100, 2], block_size=4, enable_prefix_caching=True)
    assert not manager.enable_prefix_caching  # a state cannot be shared
    a, b, c = request("a", 10), request("b", 30), request("c", 5)
    assert manager.allocate_slots(a, 10) == ([0, 1, 2], [0])
    a.num_computed_tokens = 10
    assert manager.allocate_slots(a, 1) == ([], [])  # decode: no new slot
    assert manager.allocate_slots(b, 30) is not None
    assert manager.allocate_slots(c, 5) is None  # both slots held: c waits, nothing taken
    assert manager.managers[0].num_free_blocks == 100 - 3 - 8
    manager.free(a)
    assert manager.get_block_ids("c") == ([], [])
    blocks, slot = manager.allocate_slots(c, 5)
    assert len(blocks) == 2 and slot == [0]  # a's slot, reused
    manager.free(b)
    manager.free(c)
    assert [m.num_free_blocks for m in manager.managers] == [100, 2]


def test_state_slots_come_first_from_at_most_half_the_budget():
    needs = group_block_needs(
        [FULL, STATE], 16, max_num_seqs=8, max_model_len=4096, max_num_batched_tokens=512
    )
    assert needs == [8 * 256, 8]  # a slot per sequence, whatever max_model_len
    # roomy: every slot, the rest to the paged group
    assert split_kv_budget(2_000_000, [1_000, 50_000], needs, [FULL, STATE]) == [1_600, 8]
    # short: slots from half the budget, paged blocks from the rest
    assert split_kv_budget(200_000, [1_000, 50_000], needs, [FULL, STATE]) == [100, 2]
    # no paged layers on this worker (a stage of linear layers only)
    assert split_kv_budget(200_000, [0, 50_000], needs, [FULL, STATE]) == [needs[0], 4]


def test_state_size_is_independent_of_context_length():
    from hybridllm.models.qwen3_next import Qwen3NextForCausalLM
    from hybridllm.worker.kv_cache_sizing import layer_cache_layout

    config = tiny_config("qwen3_next")
    model = Qwen3NextForCausalLM(config, torch.float32, torch.device("cpu"))
    per_slot = DeltaNetState.floats_per_slot(DeltaNetShape.from_hf(config))
    for block_size in (4, 16, 256):
        shape, dtype = layer_cache_layout(model, STATE, 3, block_size, torch.bfloat16)
        assert (shape, dtype) == ((3 * per_slot,), torch.float32)
    state = DeltaNetState.in_buffer(DeltaNetShape.from_hf(config), torch.zeros(3 * per_slot))
    assert state.conv.is_contiguous() and state.recurrent.is_contiguous()
    assert state.conv.shape[0] == state.recurrent.shape[0] == 3
    assert state.nbytes_per_slot() == 4 * per_slot


def test_the_step_batch_marks_first_steps_fresh():
    # decodes first: one continuing (context 9), a one-token prompt's first step (context 1);
    # then a whole prompt and a later chunk of another
    seqs = [
        StepSequence([5], 8, [0, 1, 2]),
        StepSequence([6], 0, [3]),
        StepSequence([7, 8, 9], 0, [4]),
        StepSequence([10, 11], 4, [5, 6]),
    ]
    _, _, meta = make_step(seqs, block_size=4, num_groups=2)
    state_tables = torch.tensor([[2, 0], [0, 0], [3, 0], [1, 0]], dtype=torch.int32)
    meta.other_groups[0].block_tables = state_tables
    prep = prepare_attention(meta).for_group(1)
    batch = DeltaNetBatch.of_step(prep)
    assert batch.query_start_loc.tolist() == [0, 1, 2, 5, 7]
    assert batch.fresh.tolist() == [False, True, True, False]
    assert batch.slots.tolist() == [2, 0, 3, 1]
    assert DeltaNetBatch.of_step(prep) is batch  # once per step


def _config_json(tmp_path, **fields) -> HFConfig:
    base = tiny_config("qwen3_next").to_dict()
    for key in ("layer_types", "rope_parameters"):
        base.pop(key)
    base.update(rope_theta=10000.0, partial_rotary_factor=0.5)
    base.update(fields)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(base))
    return HFConfig.from_file(str(path))


def test_qwen3_next_config_json_derives_layer_kinds_and_the_rotated_part(tmp_path):
    config = _config_json(tmp_path, full_attention_interval=2)
    assert config.layer_types == ["linear_attention", "full_attention"] * 2
    assert config.rope_parameters["partial_rotary_factor"] == 0.5
    default = _config_json(tmp_path)  # transformers' default interval: 4
    assert default.layer_types == ["linear_attention"] * 3 + ["full_attention"]


@pytest.mark.parametrize(
    "fields",
    [
        {"layer_types": ["linear_attention"] * 3},  # one short
        {"layer_types": ["linear_attention", "mamba", "full_attention", "full_attention"]},
        {"layer_types": "linear_attention"},
        {"full_attention_interval": 0},
        {"full_attention_interval": "4"},
        {"linear_conv_kernel_dim": 0},
        {"linear_num_key_heads": -2},
        {"linear_value_head_dim": 16.0},
        {"linear_num_value_heads": 3},  # not a multiple of the 2 key heads
        {"head_dim": True},
        {"partial_rotary_factor": 0},
        {"partial_rotary_factor": 1.5},
        {"partial_rotary_factor": 0.0625},  # one of 16 dimensions: odd
        {"partial_rotary_factor": "half"},
    ],
)
def test_hostile_layer_fields_are_refused_by_name(tmp_path, fields):
    (key,) = fields
    name = "layer_types" if key == "layer_types" else key
    if key == "linear_num_value_heads":
        name = "multiple of linear_num_key_heads"
    with pytest.raises(ModelLoadError, match=name):
        _config_json(tmp_path, **fields)


def test_qwen3_5_folder_config_is_its_text_part():
    text = tiny_config("qwen3_5_moe").to_dict()
    config = HFConfig(
        {
            "model_type": "qwen3_5_moe",
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "text_config": text,
            "vision_config": {"depth": 2},
        }
    )
    assert config.model_type == "qwen3_5_moe_text"
    assert config.architectures == ["Qwen3_5MoeForConditionalGeneration"]
    assert config.linear_num_value_heads == text["linear_num_value_heads"]
    assert kv_cache_groups(config) == [FULL, STATE]
