"""Pipeline parallel 2 over Ray against `mp` on one machine: decode tokens/s and per-step cost.

Both engines are alive at once on the embedded SmolLM2 (fp32; `--model` for another) with
`pipeline_parallel_size=2`, and the rounds alternate between them so that drift in the
machine's speed hits both alike. Each round starts a batch of B fresh 32-token prompts,
steps until every request has its first token (prefill done), then times `--steps` decode
steps: tokens/s = B x steps / time, ms/step = time / steps; the best round counts. The Ray
engine joins `--ray-address` (or RAY_ADDRESS), else starts a local Ray with every core;
`--ray-nodes 2` instead starts a local two-node cluster so that the two stages run on
different Ray nodes (scheduler output over TCP with CURVE, activations over gloo).

    python benchmarks/bench_ray_executor.py [--batches 1 32] [--json out.json]

The JSON has, per batch, both engines' tokens/s and ms/step, and the Ray executor's per-step
overhead (its ms/step minus mp's) against the 1 ms target.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_offline import machine, random_prompts, write_results  # noqa: E402

PROMPT_LEN = 32
TARGET_OVERHEAD_MS = 1.0


class DecodeRunner:
    """One engine with pipeline_parallel_size=2; `decode` times decode steps at a batch."""

    def __init__(self, backend: str, model: str | None, max_seqs: int, ray_address: str | None):
        from hybridllm import LLM, SamplingParams

        extra = {"ray_address": ray_address} if backend == "ray" and ray_address else {}
        self.llm = LLM(
            model,
            dtype="float32",
            quantization="none",
            pipeline_parallel_size=2,
            distributed_executor_backend=backend,
            max_num_seqs=max_seqs,
            max_model_len=1024,
            enable_prefix_caching=False,
            use_tqdm=False,
            **extra,
        )
        self.params_for = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        self.llm.generate(random_prompts(2, PROMPT_LEN, seed=99), self.params_for(8))  # warm-up
        self.nodes = [s.node for s in self.llm.llm_engine.config.plan.stages]

    def decode(self, prompts: list[list[int]], steps: int) -> tuple[float, float]:
        """(decode tokens/s, ms per engine step) for one batch of `prompts`."""
        engine = self.llm.llm_engine
        params = self.params_for(steps + 8)  # nobody finishes inside the timed steps
        tag = time.perf_counter_ns()
        for i, p in enumerate(prompts):
            engine.add_request(f"b{tag}-{i}", {"prompt_token_ids": p}, params)
        started: set[str] = set()
        while len(started) < len(prompts):  # prefill (maybe chunked) and first tokens
            started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
        tokens = 0
        t0 = time.perf_counter()
        for _ in range(steps):
            tokens += sum(1 for _ in engine.step())  # one output per request that got a token
        elapsed = time.perf_counter() - t0
        for i in range(len(prompts)):
            engine.abort_request(f"b{tag}-{i}")
        while engine.has_unfinished_requests():
            engine.step()
        return tokens / elapsed, 1e3 * elapsed / steps

    def close(self) -> None:
        self.llm.shutdown()


def _start_ray(nodes: int, address: str | None) -> object | None:
    """A local two-node cluster for --ray-nodes 2 (returned, to shut down); else nothing."""
    if nodes == 1:
        return None
    if address:
        raise SystemExit("--ray-nodes 2 starts its own cluster: give no --ray-address")
    import ray
    from ray.cluster_utils import Cluster

    cpus = max(2, (os.cpu_count() or 2) // 2)
    cluster = Cluster(
        initialize_head=True, head_node_args=dict(num_cpus=cpus, object_store_memory=200 << 20)
    )
    cluster.add_node(num_cpus=cpus, object_store_memory=200 << 20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    return cluster


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder or .gguf (default: embedded)")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--steps", type=int, default=48, help="decode steps timed per round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per batch")
    ap.add_argument("--ray-address", default=None, help="Ray cluster to join")
    ap.add_argument("--ray-nodes", type=int, default=1, choices=[1, 2])
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    cluster = _start_ray(args.ray_nodes, args.ray_address)
    max_seqs = max(args.batches)
    runners = {
        backend: DecodeRunner(backend, args.model, max_seqs, args.ray_address)
        for backend in ("mp", "ray")
    }
    import ray

    results: dict = {
        "machine": machine(),
        "python": platform.python_version(),
        "ray": ray.__version__,
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "pipeline_parallel_size": 2,
        "ray_stage_nodes": len({n for n in runners["ray"].nodes}),
        "steps": args.steps,
        "rounds": args.rounds,
        "target_overhead_ms_per_step": TARGET_OVERHEAD_MS,
        "batches": {},
    }
    for batch in args.batches:
        best: dict[str, tuple[float, float]] = {}
        for r in range(args.rounds):
            prompts = random_prompts(batch, PROMPT_LEN, seed=1000 * batch + r)
            order = list(runners) if r % 2 == 0 else list(reversed(runners))
            for name in order:
                tps, ms = runners[name].decode(prompts, args.steps)
                if name not in best or ms < best[name][1]:
                    best[name] = (tps, ms)
        entry = {
            name: {"decode_tokens_per_s": round(tps, 1), "ms_per_step": round(ms, 3)}
            for name, (tps, ms) in best.items()
        }
        overhead = best["ray"][1] - best["mp"][1]
        entry["ray_overhead_ms_per_step"] = round(overhead, 3)
        entry["within_target"] = overhead <= TARGET_OVERHEAD_MS
        results["batches"][str(batch)] = entry
    for runner in runners.values():
        runner.close()
    if cluster is not None:
        ray.shutdown()
        cluster.shutdown()
    write_results(results, args.json)


if __name__ == "__main__":
    main()
