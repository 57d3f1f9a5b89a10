"""Predicts the time of one engine step for a `Plan` from measured device rates (a roofline model).

Each worker's part of a step takes max(bytes it reads / its bandwidth, FLOPs / its matmul rate):
weights (its shard of the stage's layers and, on the last stage, the full LM head matrix), the
KV cache its tokens attend over, and the logits it samples from. A stage takes as long as its
slowest worker plus its tensor-parallel all-reduces; the hidden states then cross to the next
stage. Decode of few tokens comes out bandwidth-bound, prefill compute-bound.

Pipelining: a step of T tokens may be cut into m <= pp micro-batches. A micro-batch's own latency
is the sum over stages; the busiest stage serves all m micro-batches in turn. So a cycle lasts
max(latency, m * slowest stage) and yields T tokens; the model takes the best m. At batch 1
(m = 1) this is the sum of the stages; when every stage re-reads its weights per micro-batch
(bandwidth-bound decode), m = 1 stays best, which is what the engine should then do.

CPU workers of one stage run at the same time and share the host's memory bandwidth and cores
(stages are treated as each having the whole host, which holds at batch 1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hybridllm.plan.hardware_profile import HardwareProfile
from hybridllm.plan.memory_budget import worker_shard
from hybridllm.plan.model_size import ModelSize
from hybridllm.plan.plan import Plan, StagePlan

DECODE_BATCHES = (1, 8, 64)
PREFILL_TOKENS = 1024
DEFAULT_CONTEXT_LEN = 1024
# Fixed cost of one hop (a stage handing hidden states on, or one all-reduce): a CUDA sync plus
# a shared-memory handshake is tens of microseconds; NCCL among GPUs is a few.
HOP_LATENCY_S = 30e-6
GPU_ALLREDUCE_LATENCY_S = 10e-6
# Sampling reads the fp32 logits a few times (softmax, top-k/p).
SAMPLING_PASSES = 3
# Fixed cost of running one layer whatever its size: eager PyTorch dispatches ~20 ops per
# decoder layer (a few us each on the CPU; kernel launches on a GPU without graph capture).
# CPU: SmolLM2's decode steps on a 2-core Zen 5 took 6.1 ms, of which 2.7 ms reading blocks
# and 0.1 ms of KV: about 100 us for each of its 30 layers and LM head. GPU: an estimate.
# They matter only for small models.
CPU_LAYER_OVERHEAD_S = 100e-6
GPU_LAYER_OVERHEAD_S = 15e-6
# Query tokens a fused attention kernel serves per pass over a sequence's KV.
ATTENTION_QUERY_TILE = 128


@dataclass(frozen=True)
class DeviceRates:
    read_bandwidth: float  # bytes/s
    matmul_flops: float  # FLOP/s at the model's dtype
    link_bandwidth: float  # bytes/s to and from the host (a CPU reaches its own RAM)
    block_read_bandwidth: float  # bytes/s of GGUF blocks a CPU computes from (else read_bandwidth)
    block_matmul_flops: float  # FLOP/s of a CPU's GEMMs from GGUF blocks (else matmul_flops)


@dataclass(frozen=True)
class PlanPrediction:
    decode_tokens_per_s: tuple[tuple[int, float], ...]  # (batch, tokens/s)
    prefill_tokens_per_s: float
    decode_latency_s: float  # one token at batch 1
    context_len: int
    # per streaming stage: (pp_rank, decode crossover, prefill crossover) in tokens, -1: never
    stream_crossovers: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class CostModel:
    """Step-time predictions for plans on the machine `profile` describes."""

    profile: HardwareProfile
    context_len: int = DEFAULT_CONTEXT_LEN  # tokens each decoding sequence attends over

    def device_rates(self, device: str, dtype: str, sharing: int = 1) -> DeviceRates:
        """Rates of one worker; `sharing` workers on the host CPU split its bandwidth and cores."""
        if device == "cpu":
            cpu = self.profile.cpu
            flops = cpu.fp32_flops if dtype == "float32" else cpu.bf16_flops
            blocks = min(cpu.block_read_bandwidth or cpu.read_bandwidth, cpu.read_bandwidth)
            return DeviceRates(
                cpu.read_bandwidth / sharing,
                flops / sharing,
                cpu.read_bandwidth / 2,
                blocks / sharing,
                (cpu.block_gemm_flops or flops) / sharing,
            )
        index = int(device.partition(":")[2] or 0)
        gpu = self.profile.gpu(index)
        flops = gpu.fp32_flops if dtype == "float32" else gpu.bf16_flops
        return DeviceRates(gpu.read_bandwidth, flops, gpu.h2d_bandwidth, gpu.read_bandwidth, flops)

    def worker_time(
        self,
        stage: StagePlan,
        tp_rank: int,
        size: ModelSize,
        num_tokens: int,
        num_seqs: int,
        context_len: int,
    ) -> float:
        """Seconds worker `tp_rank` of `stage` spends on `num_tokens` tokens of `num_seqs` sequences."""
        size = size.for_worker(stage, tp_rank)  # a CPU worker may read GGUF blocks
        shard = worker_shard(size, stage, tp_rank)
        cpu_workers = sum(w.is_cpu for w in stage.workers)
        worker = stage.workers[tp_rank]
        rates = self.device_rates(worker.device, size.dtype, cpu_workers if worker.is_cpu else 1)
        layers = stage.num_layers
        kv_per_layer = shard.kv_heads * size.kv_bytes_per_token_per_layer // size.num_kv_heads
        # Each sequence's KV is read once per query tile (once per token when decoding).
        query_tiles = -(-num_tokens // (num_seqs * ATTENTION_QUERY_TILE))
        # keys each layer reads, summed over the stage's layers (a sliding one: its window)
        attended = size.attended_context(stage.layer_start, stage.layer_end, context_len)
        layer_bytes = size.shard_layer_bytes(shard.q_heads, shard.kv_heads, shard.intermediate)
        weight_bytes = layers * layer_bytes
        bytes_read = num_seqs * query_tiles * attended * kv_per_layer
        # Matmuls at 2 FLOPs per multiply-add, and attention's QK^T and PV.
        matmul = size.shard_matmul_params(shard.q_heads, shard.kv_heads, shard.intermediate)
        q_dim = shard.q_heads * size.head_dim
        flops = num_tokens * (layers * 2 * matmul + 4 * q_dim * attended)
        experts_s = 0.0
        if size.moe is not None and len(stage.workers) == 1:
            # layer by layer: a step reads the experts its tokens select, not all of them;
            # experts the plan put on the CPU beside a GPU stage cost the CPU's time
            here = [
                worker.is_cpu or not stage.experts_on_cpu(i)
                for i in range(stage.layer_start, stage.layer_end)
            ]
            ids = range(stage.layer_start, stage.layer_end)
            weight_bytes = sum(size.step_weight_bytes(i, num_tokens, r) for i, r in zip(ids, here))
            active = sum(size.active_matmul_params(i, r) for i, r in zip(ids, here))
            flops = num_tokens * (2 * active + layers * 4 * q_dim * context_len)
            experts_s = self.cpu_expert_time(stage, size, num_tokens)
        if stage.has_embedding:
            bytes_read += num_tokens * size.hidden_size * size.dtype_bytes  # a gather of rows
        if stage.has_lm_head:
            # Logits are computed for sampled rows only, but the whole matrix is read each step.
            vocab_share = shard.vocab / size.vocab_size
            weight_bytes += int(size.lm_head_bytes * vocab_share) + size.final_norm_bytes
            bytes_read += num_seqs * shard.vocab * 4 * SAMPLING_PASSES
            flops += 2 * num_seqs * shard.vocab * size.hidden_size
        overhead = CPU_LAYER_OVERHEAD_S if worker.is_cpu else GPU_LAYER_OVERHEAD_S
        fixed = overhead * (layers + stage.has_lm_head)
        # the GGUF blocks a CPU worker keeps are read as fast as the op decodes them, and
        # multiplied at the op's GEMM rate (the int8 GEMM, 2-4x fp32, where built)
        blocks = worker.is_cpu and size.matmul_bytes_per_param is not None
        weight_rate = rates.block_read_bandwidth if blocks else rates.read_bandwidth
        flop_rate = rates.block_matmul_flops if blocks else rates.matmul_flops
        read_s = weight_bytes / weight_rate + bytes_read / rates.read_bandwidth
        return fixed + max(read_s, flops / flop_rate) + experts_s

    def cpu_expert_time(self, stage: StagePlan, size: ModelSize, num_tokens: int) -> float:
        """Seconds the host CPU spends on the routed experts a GPU stage keeps there: the
        selected experts' bytes at the CPU's rate, top_k experts' FLOPs per token, and per layer
        the hidden states and router logits crossing to the host and the routed sum back (the
        GPU's shared expert overlaps this; not counted)."""
        worker = stage.workers[0]
        moe = size.moe
        if moe is None or worker.is_cpu or stage.cpu_expert_layers == 0:
            return 0.0
        end = stage.layer_start + stage.cpu_expert_layers
        layers = [i for i in range(stage.layer_start, end) if moe.is_sparse(i)]
        if not layers:
            return 0.0
        cpu = size.cpu_view()
        rates = self.device_rates("cpu", size.dtype)
        link = self.device_rates(worker.device, size.dtype).link_bandwidth
        share = moe.active_experts(num_tokens) / moe.num_experts
        read = share * sum(cpu.routed_expert_bytes(i) for i in layers)
        blocks = cpu.matmul_bytes_per_param is not None
        read_s = read / (rates.block_read_bandwidth if blocks else rates.read_bandwidth)
        flop_rate = rates.block_matmul_flops if blocks else rates.matmul_flops
        flops = 2 * num_tokens * moe.top_k * moe.expert_params * len(layers)
        # [tokens, hidden] out and back, [tokens, E] fp32 logits out
        crossing = num_tokens * (2 * size.hidden_size * size.dtype_bytes + 4 * moe.num_experts)
        hops = len(layers) * (HOP_LATENCY_S + crossing / link)
        return len(layers) * CPU_LAYER_OVERHEAD_S + max(read_s, flops / flop_rate) + hops

    def stream_time(
        self, stage: StagePlan, size: ModelSize, num_tokens: int, num_seqs: int, context_len: int
    ) -> float:
        """Seconds a one-worker CPU stage takes when it streams its layers to its stream device.

        Each layer's weights (GGUF blocks where the CPU keeps them, else dense values in the
        plan's dtype; the device decodes blocks) and the KV its sequences attend over
        cross the link on a copy stream while the device computes the previous layer, so a step
        costs one layer's copy plus the larger of the remaining copies and the device's
        compute; the hidden states cross twice, the step's new K/V rows come back, and the
        embedding or LM head stay on the CPU.
        """
        device = stage.stream_device or "cpu"
        link = self.device_rates(device, size.dtype).link_bandwidth
        layers = stage.num_layers
        cached = max(0, num_seqs * context_len - num_tokens)  # KV rows from earlier steps
        kv_rows = cached + num_tokens  # read in, then the new ones written back
        sent = size.for_worker(stage, 0).layer_bytes  # GGUF blocks cross as blocks
        per_layer = (sent + kv_rows * size.kv_bytes_per_token_per_layer) / link
        worker = dataclasses.replace(stage.workers[0], device=device)
        twin = dataclasses.replace(
            stage,
            workers=(worker,),
            has_embedding=False,
            has_lm_head=False,
            stream_device=None,
        )
        compute = self.worker_time(twin, 0, size, num_tokens, num_seqs, context_len)
        ends = dataclasses.replace(stage, layer_end=stage.layer_start, stream_device=None)
        on_cpu = 0.0
        if stage.has_embedding or stage.has_lm_head:
            on_cpu = self.worker_time(ends, 0, size, num_tokens, num_seqs, context_len)
        hidden_io = 4 * num_tokens * size.hidden_size * size.dtype_bytes / link
        return per_layer + max((layers - 1) * per_layer, compute) + hidden_io + on_cpu

    def streams_step(
        self, stage: StagePlan, num_tokens: int, num_seqs: int, context_len: int
    ) -> bool:
        """Whether the engine streams this step: the stage streams, the step has at least the
        threshold's tokens and the KV it reads fits the staging buffers."""
        return (
            stage.streams
            and num_tokens >= stage.stream_threshold
            and num_seqs * context_len <= stage.stream_kv_tokens
        )

    def stream_crossover(
        self, stage: StagePlan, size: ModelSize, context_len: int, max_tokens: int, decode: bool
    ) -> int:
        """The fewest tokens at which streaming beats computing on the CPU (decode-shaped steps
        of `context_len` each, or one prompt's chunk), or -1 when it never does up to
        `max_tokens`."""

        def faster(n: int) -> bool:
            seqs, ctx = (n, context_len) if decode else (1, n)
            if seqs * ctx > stage.stream_kv_tokens:
                return False
            cpu = self.worker_time(stage, 0, size, n, seqs, ctx)
            return self.stream_time(stage, size, n, seqs, ctx) < cpu

        n = 1
        while n <= max_tokens and not faster(n):
            n *= 2
        if n > max_tokens:
            return -1
        low = n // 2  # not faster (or 0); bisect (low, n]
        while n - low > 1:
            mid = (low + n) // 2
            low, n = (low, mid) if faster(mid) else (mid, n)
        return n

    def allreduce_time(self, stage: StagePlan, size: ModelSize, num_tokens: int) -> float:
        """Two all-reduces per layer (attention and MLP outputs) of [num_tokens, hidden]."""
        if len(stage.workers) == 1:
            return 0.0
        message = num_tokens * size.hidden_size * size.dtype_bytes
        links = [self.device_rates(w.device, size.dtype).link_bandwidth for w in stage.workers]
        mixed = any(w.is_cpu for w in stage.workers)
        latency = HOP_LATENCY_S if mixed else GPU_ALLREDUCE_LATENCY_S
        # Each rank sends and receives about 2x the message (reduce-scatter + all-gather).
        return 2 * stage.num_layers * (latency + 2 * message / min(links))

    def transfer_time(
        self, src: StagePlan, dst: StagePlan, size: ModelSize, num_tokens: int
    ) -> float:
        """Hidden states and residual, [num_tokens, 2 * hidden], handed from `src` to `dst`."""
        message = 2 * num_tokens * size.hidden_size * size.dtype_bytes
        link = min(
            self.device_rates(w.device, size.dtype).link_bandwidth
            for w in (src.workers[0], dst.workers[0])
        )
        return HOP_LATENCY_S + message / link

    def stage_time(
        self, stage: StagePlan, size: ModelSize, num_tokens: int, num_seqs: int, context_len: int
    ) -> float:
        if self.streams_step(stage, num_tokens, num_seqs, context_len):
            return self.stream_time(stage, size, num_tokens, num_seqs, context_len)
        slowest = max(
            self.worker_time(stage, r, size, num_tokens, num_seqs, context_len)
            for r in range(len(stage.workers))
        )
        return slowest + self.allreduce_time(stage, size, num_tokens)

    def step_time(
        self,
        plan: Plan,
        size: ModelSize,
        num_tokens: int,
        num_seqs: int,
        context_len: int,
        max_micro_batches: int,
        chunked_prompt: bool = False,
    ) -> float:
        """Seconds per `num_tokens` tokens with the best micro-batch count.

        Decode (the default): micro-batches cycle through the pipeline in steady state.
        `chunked_prompt`: the tokens are one prompt cut into chunks; chunk i+1 enters a stage
        once chunk i left it, so the prompt takes one chunk's latency + (m - 1) slowest stages.
        """
        best = float("inf")
        for m in range(1, max(1, min(max_micro_batches, plan.pipeline_parallel_size)) + 1):
            tokens, seqs = max(1, num_tokens // m), max(1, num_seqs // m)
            stages = [self.stage_time(s, size, tokens, seqs, context_len) for s in plan.stages]
            hops = [
                self.transfer_time(a, b, size, tokens) for a, b in zip(plan.stages, plan.stages[1:])
            ]
            latency = sum(stages) + sum(hops)
            if chunked_prompt:
                total = latency + (m - 1) * max(stages)
            else:
                total = max(latency, m * max(stages))
            best = min(best, total * num_tokens / (tokens * m))
        return best

    def decode_tokens_per_s(self, plan: Plan, size: ModelSize, batch: int) -> float:
        """Tokens/s of `batch` sequences each decoding one token per step."""
        return batch / self.step_time(plan, size, batch, batch, self.context_len, batch)

    def prefill_tokens_per_s(
        self, plan: Plan, size: ModelSize, num_tokens: int = PREFILL_TOKENS
    ) -> float:
        """Prompt tokens/s of one `num_tokens` prompt (attending on average to half of it)."""
        step = self.step_time(
            plan, size, num_tokens, 1, num_tokens // 2, num_tokens, chunked_prompt=True
        )
        return num_tokens / step

    def predict(self, plan: Plan, size: ModelSize) -> PlanPrediction:
        decode = tuple((b, self.decode_tokens_per_s(plan, size, b)) for b in DECODE_BATCHES)
        limit = max(stage.stream_kv_tokens for stage in plan.stages)
        crossovers = tuple(
            (
                stage.pp_rank,
                self.stream_crossover(stage, size, self.context_len, limit, decode=True),
                self.stream_crossover(stage, size, self.context_len, limit, decode=False),
            )
            for stage in plan.stages
            if stage.stream_device is not None
        )
        return PlanPrediction(
            decode_tokens_per_s=decode,
            prefill_tokens_per_s=self.prefill_tokens_per_s(plan, size),
            decode_latency_s=1.0 / decode[0][1],
            context_len=self.context_len,
            stream_crossovers=crossovers,
        )
