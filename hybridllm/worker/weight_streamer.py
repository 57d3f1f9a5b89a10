"""Computes a CPU stage's decoder layers on an accelerator for steps with many tokens.

A CPU stage reads its weights from DRAM once per step, so it decodes a few sequences well and
is compute-bound on prefills and big batches. For those steps the `WeightStreamer` copies each
layer's weights (one pinned host copy per layer, made once at load) into one of two staging slots
on the accelerator, on a copy stream, while the accelerator computes the previous layer from the
other slot; the layer then runs there as an ordinary accelerator layer. GGUF blocks the CPU keeps
cross as blocks (about 4x fewer bytes than bf16) and the accelerator decodes them into the slot
(`layers/gguf_dequant_torch.py`); other weights cross as values in the accelerator's dtype.

The KV cache of these layers stays on the CPU, where the CPU path (the common case: decoding a
few sequences) reads it. A streamed step copies the blocks its sequences attend over into the
slot beside the weights (a compact cache holding only those blocks, with block tables and slot
mapping renumbered to match), attention runs on the accelerator, and the K/V rows the step wrote
are copied back into the CPU cache at the end. Each layer reads the blocks of its KV cache
group (sliding-window layers have their own block tables): a compact cache per group. Keeping KV on the accelerator instead would force
every CPU-computed step to fetch it back; moving only what a streamed step reads costs less than
the weights for prefills, and the cost model counts it for big decode batches.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from hybridllm.layers.attention import PagedAttention
from hybridllm.layers.attention_metadata import AttentionMetadata
from hybridllm.layers.gguf_dequant_torch import TORCH_DECODED_TYPES, dequantize_torch
from hybridllm.layers.linear import Linear
from hybridllm.layers.prepared_attention import prepare_attention

if TYPE_CHECKING:
    from hybridllm.plan.plan import StagePlan

logger = logging.getLogger(__name__)

NUM_SLOTS = 2  # double buffering: copy layer j + 1 while layer j computes


@dataclass(frozen=True)
class _Entry:
    """One parameter of a decoder layer in the flat staging layout."""

    module: str  # path of its module in the layer
    name: str  # attribute on that module
    shape: tuple[int, ...]
    offset: int  # in elements
    numel: int


def _layout(layer: nn.Module) -> tuple[list[_Entry], int]:
    """The twin's streamed parameters, laid out in one flat buffer; attention sinks (fp32, a
    few per layer) are not among them: they go to the accelerator once, at construction."""
    entries, offset = [], 0
    for path, module in layer.named_modules():
        if isinstance(module, PagedAttention):
            continue
        for name, param in module.named_parameters(recurse=False):
            entries.append(_Entry(path, name, tuple(param.shape), offset, param.numel()))
            offset += param.numel()
    return entries, offset


@dataclass(frozen=True)
class _Piece:
    """A run of one layer's host copy that fills elements of one twin parameter."""

    entry: _Entry
    start: int  # first element of the parameter it fills
    numel: int
    offset: int  # bytes into the layer's host copy (16-aligned)
    nbytes: int
    ggml_type: int | None = None  # GGUF blocks [rows, bytes per row] to decode; None: values
    rows: int = 0


def _align(n: int) -> int:
    return -(-n // 16) * 16


def _host_pieces(layer: nn.Module, entries: list[_Entry], dtype: torch.dtype) -> list[tuple]:
    """(piece kind, source tensor, start, numel, ggml type, rows) for every parameter of the
    twin: a Linear's decodable GGUF blocks as blocks (one run per stacked shard), else values."""
    pieces = []
    for e in entries:
        module = layer.get_submodule(e.module)
        cols = e.shape[-1]
        if isinstance(module, Linear) and e.name == "weight":
            if module.qweight is not None and module.ggml_type in TORCH_DECODED_TYPES:
                pieces.append((e, module.qweight, 0, e.numel, module.ggml_type, e.shape[0]))
                continue
            if module.shard_blocks and all(
                t in TORCH_DECODED_TYPES for _, t, _ in module.shard_blocks
            ):
                row = 0
                for blocks, ggml_type, rows in module.shard_blocks:
                    pieces.append((e, blocks, row * cols, rows * cols, ggml_type, rows))
                    row += rows
                continue
        pieces.append((e, _dense(layer, e).to(dtype), 0, e.numel, None, 0))
    return pieces


def _dense(layer: nn.Module, entry: _Entry) -> torch.Tensor:
    """The CPU layer's value of a parameter, as floats of the twin's shape."""
    module = layer.get_submodule(entry.module)
    if isinstance(module, Linear) and entry.name == "weight":
        value = module.dense_weight()
    else:
        value = getattr(module, entry.name).detach()
    if tuple(value.shape) != entry.shape:
        raise NotImplementedError(
            f"weight streaming cannot stage {entry.module}.{entry.name}: the CPU layer holds "
            f"{tuple(value.shape)}, the accelerator layer expects {entry.shape}"
        )
    return value


class _CopyStream:
    """The copy stream and the events that order it against compute; no-ops off CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.copied: dict[int, torch.cuda.Event] = {}
        self.computed: dict[int, torch.cuda.Event] = {}

    def context(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def _event(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def after_compute(self, layer: int) -> None:
        """Later copies wait until `layer` finished reading its slot."""
        if self.cuda and layer in self.computed:
            self.stream.wait_event(self.computed.pop(layer))

    def mark_copied(self, layer: int) -> None:
        if self.cuda:
            self.copied[layer] = self._event(self.stream)

    def host_wait_copied(self, layer: int) -> None:
        """The host may refill the pinned buffers that `layer`'s copies read from."""
        if self.cuda and layer in self.copied:
            self.copied[layer].synchronize()

    def wait_copied(self, layer: int) -> None:
        if self.cuda:
            torch.cuda.current_stream().wait_event(self.copied.pop(layer))

    def mark_computed(self, layer: int) -> None:
        if self.cuda:
            self.computed[layer] = self._event(None)

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.current_stream().synchronize()
            self.copied.clear()
            self.computed.clear()


class _Slot:
    """An accelerator twin of a decoder layer whose parameters are views into one flat
    buffer, and a KV buffer for the blocks a step reads."""

    def __init__(
        self, layer: nn.Module, entries: list[_Entry], numel: int, kv_numel: int, raw_bytes: int
    ):
        param = next(layer.parameters())
        self.raw = torch.empty(raw_bytes, dtype=torch.uint8, device=param.device)
        self.weights = torch.empty(numel, dtype=param.dtype, device=param.device)
        for e in entries:
            view = self.weights[e.offset : e.offset + e.numel].view(e.shape)
            setattr(layer.get_submodule(e.module), e.name, nn.Parameter(view, requires_grad=False))
        self.layer = layer
        self.attention = [m for m in layer.modules() if isinstance(m, PagedAttention)]
        self.kv = torch.empty(kv_numel, dtype=param.dtype, device=param.device)


@dataclass
class _StepBlocks:
    """A streamed step's view of the KV cache: the blocks it reads, renumbered."""

    block_ids: torch.Tensor  # [num_blocks] int64, CPU: the CPU cache's blocks, ascending
    metadata: AttentionMetadata  # on the accelerator, over the compact cache
    cpu_slots: torch.Tensor  # [num_tokens] int64: where the step's K/V go in the CPU cache
    compact_slots: torch.Tensor  # [num_tokens] int64, accelerator: the same rows, compact


class WeightStreamer:
    """Runs a CPU stage's layers on `device` for steps of at least `threshold` tokens."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device | str,
        dtype: torch.dtype,
        threshold: int,
        kv_tokens: int,
    ) -> None:
        """`model`: the CPU stage (weights loaded, before CPU repacking); `kv_tokens`: the
        KV rows (over all sequences of a step) a staging slot holds; larger steps stay on
        the CPU."""
        if len(model.kv_cache_shape(1, 1)) != 5:
            raise NotImplementedError(
                f"{type(model).__name__}'s KV cache is not per-head keys and values (MLA's latent)"
            )
        self.device = torch.device(device)
        self.dtype = dtype
        self.threshold = threshold
        layers = list(model.layers)
        twins = [model.make_layer(model.start_layer, dtype, self.device) for _ in range(NUM_SLOTS)]
        self.entries, numel = _layout(twins[0])
        pin = self.device.type == "cuda"
        # One flat host copy per layer (blocks and values side by side): a step copies each
        # with a single transfer, and the accelerator unpacks it into the slot's parameters.
        self.host: list[torch.Tensor] = []
        self.pieces: list[list[_Piece]] = []
        itemsize = torch.empty(0, dtype=dtype).element_size()
        for layer in layers:
            sources, pieces, offset = _host_pieces(layer, self.entries, dtype), [], 0
            # A layer of values only is laid out as the slot's parameters are: it lands in
            # place; one with blocks lands in the slot's raw buffer and is unpacked there.
            in_place = all(ggml_type is None for *_, ggml_type, _ in sources)
            for e, src, start, count, ggml_type, rows in sources:
                nbytes = src.numel() * src.element_size()
                if in_place:
                    offset = e.offset * itemsize
                pieces.append(_Piece(e, start, count, offset, nbytes, ggml_type, rows))
                offset = offset + nbytes if in_place else _align(offset + nbytes)
            flat = torch.empty(offset, dtype=torch.uint8, pin_memory=pin)
            for piece, (_, src, *_rest) in zip(pieces, sources):
                run = flat[piece.offset : piece.offset + piece.nbytes]
                run.view(src.dtype).view(src.shape).copy_(src)
            self.host.append(flat)
            self.pieces.append([] if in_place else pieces)
        raw_bytes = max((flat.numel() for flat, p in zip(self.host, self.pieces) if p), default=0)
        self.kv_heads, self.head_dim = model.num_kv_heads, model.head_dim
        self.kv_tokens = kv_tokens
        kv_numel = 2 * kv_tokens * self.kv_heads * self.head_dim
        self.slots = [_Slot(twin, self.entries, numel, kv_numel, raw_bytes) for twin in twins]
        self.host_kv = [torch.empty(kv_numel, dtype=dtype, pin_memory=pin) for _ in twins]
        self.new_kv = torch.empty(0, dtype=dtype, pin_memory=pin)  # the step's new K/V rows
        self.cpu_attention = [
            [m for m in layer.modules() if isinstance(m, PagedAttention)] for layer in layers
        ]
        # each layer's attention sinks (gpt-oss), on the accelerator once: a step points the
        # twin's attention at its layer's
        self.sinks = [
            [
                None
                if m.sinks is None
                else nn.Parameter(m.sinks.detach().to(self.device), requires_grad=False)
                for m in attention
            ]
            for attention in self.cpu_attention
        ]
        # each layer's kind (Gemma's local or global: which rotary table it reads), or None
        self.layer_kinds = [
            getattr(getattr(layer, "self_attn", None), "kind", None) for layer in layers
        ]
        self.rotary = copy.deepcopy(model.rotary_emb).to(self.device)
        self.rotary.recast_(dtype)
        self.copies = _CopyStream(self.device)
        # each layer's KV cache group; a step's compact blocks are built once per group
        self.layer_groups = list(model.execution.layer_groups)
        # each group's sliding window (None: full attention), from its layers' attention
        self.group_windows: dict[int, int | None] = {}
        for group, attention in zip(self.layer_groups, self.cpu_attention):
            self.group_windows[group] = attention[0].sliding_window if attention else None
        self._step: tuple[int, dict[int, _StepBlocks]] | None = None
        self.num_streamed_steps = 0

    @property
    def staging_bytes(self) -> int:
        """Accelerator memory the staging slots hold."""
        return sum(s.weights.nbytes + s.raw.nbytes + s.kv.nbytes for s in self.slots)

    @property
    def host_bytes_per_layer(self) -> int:
        """Bytes one layer's copy sends over the link (blocks where the CPU keeps them)."""
        return max(flat.numel() for flat in self.host)

    # ---- the per-step choice ---------------------------------------------------------------

    def wants(self, metadata: AttentionMetadata, kv_caches: list[torch.Tensor]) -> bool:
        """Stream this step: enough tokens, and the blocks it reads fit a slot."""
        num_tokens = int(metadata.slot_mapping.shape[0])
        if self.threshold < 0 or num_tokens < self.threshold or not kv_caches:
            return False
        blocks = self._group_blocks(metadata)
        if any(b.block_ids.numel() * metadata.block_size > self.kv_tokens for b in blocks.values()):
            return False
        self._step = (id(metadata), blocks)
        return True

    def _group_blocks(self, md: AttentionMetadata) -> dict[int, _StepBlocks]:
        """The compact blocks of each KV cache group the stage's layers read."""
        return {
            g: self._step_blocks(md.for_group(g), self.group_windows[g])
            for g in sorted(set(self.layer_groups))
        }

    def _step_blocks(self, md: AttentionMetadata, window: int | None = None) -> _StepBlocks:
        """The blocks the step reads, renumbered: under a sliding `window` only those from
        the one its first query reads on (table entries before it point at compact block 0,
        whose keys the window masks)."""
        bs = md.block_size
        table = md.block_tables.cpu().numpy()
        starts = md.query_start_loc_cpu
        first = [0] * len(md.seq_lens_cpu)
        if window is not None:
            first = [
                max(0, n - (starts[i + 1] - starts[i]) - window + 1) // bs
                for i, n in enumerate(md.seq_lens_cpu)
            ]
        used = [table[i, f : -(-n // bs)] for i, (f, n) in enumerate(zip(first, md.seq_lens_cpu))]
        ids = np.unique(np.concatenate(used))  # ascending
        compact_table = np.zeros_like(table)
        for i, (f, row) in enumerate(zip(first, used)):
            compact_table[i, f : f + len(row)] = np.searchsorted(ids, row)
        slots = md.slot_mapping.cpu().numpy()
        compact = np.searchsorted(ids, slots // bs) * bs + slots % bs
        dev = self.device
        metadata = AttentionMetadata(
            num_decodes=md.num_decodes,
            num_decode_tokens=md.num_decode_tokens,
            slot_mapping=torch.from_numpy(compact).to(dev),
            query_start_loc=md.query_start_loc.to(dev),
            seq_lens=md.seq_lens.to(dev),
            block_tables=torch.from_numpy(compact_table).to(dev),
            query_start_loc_cpu=md.query_start_loc_cpu,
            seq_lens_cpu=md.seq_lens_cpu,
            max_seq_len=md.max_seq_len,
            block_size=bs,
        )
        return _StepBlocks(
            torch.from_numpy(ids).long(), metadata, torch.from_numpy(slots), metadata.slot_mapping
        )

    # ---- one streamed step -----------------------------------------------------------------

    @torch.inference_mode()
    def run(
        self,
        layers: nn.ModuleList,
        kv_caches: list[torch.Tensor],
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stage's layers over one step, on the accelerator; returns (hidden, residual)
        on the stage's device and dtype, and leaves the step's K/V in the CPU caches."""
        if self._step is None or self._step[0] != id(metadata):
            self._step = (id(metadata), self._group_blocks(metadata))
        group_blocks = self._step[1]
        self._step = None
        dev, dtype = self.device, self.dtype
        # per KV cache group: its compact cache's shape and the attention over it
        kv_shapes = {
            g: (2, int(b.block_ids.numel()), metadata.block_size, self.kv_heads, self.head_dim)
            for g, b in group_blocks.items()
        }
        preps = {g: prepare_attention(b.metadata) for g, b in group_blocks.items()}
        layer_blocks = [group_blocks[g] for g in self.layer_groups]
        layer_shapes = [kv_shapes[g] for g in self.layer_groups]
        rotary = self.rotary(positions.to(dev), metadata.max_seq_len)
        h = hidden_states.to(dev, dtype)  # [num_tokens, hidden]
        r = None if residual is None else residual.to(dev, dtype)
        num_tokens = h.shape[0]
        new_kv = self._new_kv_rows(len(layers), num_tokens)  # [layers, 2, tokens, kvh, D]
        self._prefetch(0, layer_blocks[0].block_ids, kv_caches, layer_shapes[0])
        for j in range(len(layers)):
            slot = self.slots[j % NUM_SLOTS]
            for twin, cpu, sinks in zip(slot.attention, self.cpu_attention[j], self.sinks[j]):
                twin.sliding_window = cpu.sliding_window
                twin.logit_softcap = cpu.logit_softcap
                twin.sinks = sinks
            if self.layer_kinds[j] is not None:
                slot.layer.self_attn.kind = self.layer_kinds[j]
            kv_shape = layer_shapes[j]
            kv = slot.kv[: math.prod(kv_shape)].view(kv_shape)
            self.copies.wait_copied(j)
            self._unpack(j, slot)
            # the twin's forward reads the prep it is given: its own group's
            h, r = slot.layer(h, r, rotary, kv, preps[self.layer_groups[j]])
            # The rows this layer wrote, for the CPU cache.
            rows = kv.view(2, -1, self.kv_heads, self.head_dim).index_select(
                1, layer_blocks[j].compact_slots
            )
            new_kv[j].copy_(rows, non_blocking=True)
            self.copies.mark_computed(j)
            if j + 1 < len(layers):
                self._prefetch(j + 1, layer_blocks[j + 1].block_ids, kv_caches, layer_shapes[j + 1])
        self.copies.finish()
        for j, cache in enumerate(kv_caches):
            flat = cache.view(2, -1, self.kv_heads, self.head_dim)
            flat.index_copy_(1, layer_blocks[j].cpu_slots, new_kv[j].to(cache.dtype))
        self.num_streamed_steps += 1
        out_h = h.to(hidden_states.device, hidden_states.dtype)
        return out_h, r.to(hidden_states.device, hidden_states.dtype)

    def _unpack(self, j: int, slot: _Slot) -> None:
        """Fill the slot's parameters from layer j's raw bytes: values copied, blocks decoded
        (nothing to do for a layer that landed in place)."""
        for piece in self.pieces[j]:
            run = slot.raw[piece.offset : piece.offset + piece.nbytes]
            start = piece.entry.offset + piece.start
            target = slot.weights[start : start + piece.numel]
            if piece.ggml_type is None:
                target.copy_(run.view(self.dtype))
            else:
                cols = piece.numel // piece.rows
                blocks = run.view(piece.rows, -1)
                target.view(piece.rows, cols).copy_(
                    dequantize_torch(blocks, piece.ggml_type, piece.rows, cols)
                )

    def _prefetch(
        self,
        j: int,
        block_ids: torch.Tensor,
        kv_caches: list[torch.Tensor],
        kv_shape: tuple[int, ...],
    ) -> None:
        """Queue layer j's weights and the step's KV blocks into slot j % 2."""
        s = j % NUM_SLOTS
        slot, host_kv = self.slots[s], self.host_kv[s][: math.prod(kv_shape)].view(kv_shape)
        self.copies.host_wait_copied(j - NUM_SLOTS)  # its pinned KV buffer is free again
        host_kv.copy_(kv_caches[j].index_select(1, block_ids))  # a gather, on the host
        self.copies.after_compute(j - NUM_SLOTS)  # the slot's previous layer is done with it
        with self.copies.context():
            # in place (values only), or into the raw buffer to be unpacked
            target = slot.raw if self.pieces[j] else slot.weights.view(torch.uint8)
            target[: self.host[j].numel()].copy_(self.host[j], non_blocking=True)
            slot.kv[: host_kv.numel()].view(kv_shape).copy_(host_kv, non_blocking=True)
            self.copies.mark_copied(j)

    def _new_kv_rows(self, num_layers: int, num_tokens: int) -> torch.Tensor:
        shape = (num_layers, 2, num_tokens, self.kv_heads, self.head_dim)
        if self.new_kv.numel() < math.prod(shape):
            self.new_kv = torch.empty(
                math.prod(shape), dtype=self.dtype, pin_memory=self.device.type == "cuda"
            )
        return self.new_kv[: math.prod(shape)].view(shape)


def build_weight_streamer(
    model: nn.Module, stage: StagePlan, dtype: torch.dtype
) -> WeightStreamer | None:
    """The stage's weight streamer, or None (with a warning) for a model it cannot stage."""
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
            model, stage.stream_device, dtype, stage.stream_threshold, stage.stream_kv_tokens
        )
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
