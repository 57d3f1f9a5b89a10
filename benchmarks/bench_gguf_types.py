"""hybridllm against llama.cpp on real GGUF files of many types, made by llama.cpp's own tools.

For each file (benchmarks/make_gguf_files.py makes a random-weight Llama-3.2-1B-shaped model in
every type into /work/gguf-files/): hybridllm's batch-1 decode of 64 tokens (`--new-tokens`)
after a 1-token prompt against `llama-bench -p 0 -n 64`, and the time to first token of a
512-token prompt (`--prompt-len`) against `llama-bench -p 512 -n 0`, same threads, in alternating
rounds (hybridllm, then llama.cpp, `--rounds` times; the best of each is reported, every round
in the JSON), and hybridllm's peak resident memory against the file's size. `--depths 0 8192`
also decodes after a context that long (`llama-bench -d 8192`).

hybridllm runs in a child process of this script (one per file, loaded once, kept across the
rounds; `benchmarks/bench_offline.py`'s HybridRunner: the engine as `bench_cpu_gguf.py` runs it,
the engine stepped by hand for the timings), so its peak RSS (the child's VmHWM) is its own;
`llama-bench` is a fresh process for each measurement, as in bench_cpu_gguf.py. Prompts are
random tokens, a fresh one each round (no prefix-cache hits).

    python benchmarks/bench_gguf_types.py [--dir /work/gguf-files] [--types Q4_K_M IQ4_XS ...]
        [--files F.gguf ...] [--rounds 3] [--threads 2] [--llamacpp-bin DIR] [--json F] [--md F]

Prints a markdown table: type | file MiB | hybridllm tok/s | llama.cpp tok/s | ratio |
TTFT hybridllm / llama.cpp | TTFT ratio | peak RSS MiB | RSS / file | (RSS - runtime) / file,
the last less the child's resident memory before it loaded the model (torch, hybridllm: about
300 MiB, which dominates a small file). Types without kernels yet are dequantized to fp32 at load,
which shows as RSS / file near 32 / bits-per-weight.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.make_gguf_files import (  # noqa: E402
    ALL_TYPES,
    DEFAULT_OUT,
    find_llamacpp_bin,
    llamacpp_env,
    tensor_types,
)

VOCAB_LOW = 3  # random prompt tokens avoid the specials SmolLM2's vocabulary starts with


# ---- the hybridllm child -------------------------------------------------------------------------


def _status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM), in bytes."""
    peak = _status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    return _status_bytes("VmRSS") or 0


def child(args: argparse.Namespace) -> None:
    """Load the file once, then answer `round SEED` lines on stdin with one JSON line each
    (decode tok/s, TTFT), and `quit` with the peak RSS."""
    from benchmarks.bench_offline import HybridRunner
    from hybridllm import SamplingParams

    runtime_rss = current_rss_bytes()  # torch and hybridllm imported, no model yet
    t0 = time.perf_counter()
    rng = random.Random(0)
    vocab = args.vocab
    warmup = [rng.randrange(VOCAB_LOW, vocab) for _ in range(16)]
    runner = HybridRunner(
        warmup,
        "auto",
        args.child,
        cpu_threads=args.threads,
        max_model_len=max(args.prompt_len, *args.depths) + args.new_tokens + 16,
        kv_cache_memory=args.kv_cache_memory,
    )
    engine = runner.llm.llm_engine
    decode_params = SamplingParams(temperature=0, max_tokens=args.new_tokens + 1, ignore_eos=True)
    ttft_params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    emit({"loaded_s": time.perf_counter() - t0, "runtime_rss": runtime_rss})

    def timed(prompt: list[int], params) -> tuple[float, float]:
        t = time.perf_counter()
        engine.add_request(f"r-{t}", {"prompt_token_ids": prompt}, params)
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter() - t
        return first, time.perf_counter() - t - first

    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        rng = random.Random(int(cmd[1]))
        # decode: 64 tokens after the first, from an empty context as llama-bench -p 0 -n 64,
        # and after a prompt of each further depth as llama-bench -p 0 -n 64 -d DEPTH
        decode = {}
        for depth in args.depths:
            prompt = [rng.randrange(VOCAB_LOW, vocab) for _ in range(max(1, depth))]
            _, rest = timed(prompt, decode_params)
            decode[str(depth)] = args.new_tokens / rest
        prompt = [rng.randrange(VOCAB_LOW, vocab) for _ in range(args.prompt_len)]
        ttft, _ = timed(prompt, ttft_params)
        emit({"decode_tok_s": decode, "ttft_s": ttft})
    runner.close()
    emit({"peak_rss": peak_rss_bytes()})


def emit(obj: dict) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


class HybridChild:
    """The parent's handle on one child process."""

    def __init__(self, path: Path, args: argparse.Namespace, vocab: int):
        cmd = [sys.executable, __file__, "--child", str(path), "--threads", str(args.threads),
               "--new-tokens", str(args.new_tokens), "--prompt-len", str(args.prompt_len),
               "--vocab", str(vocab), "--kv-cache-memory", args.kv_cache_memory,
               "--depths", *map(str, args.depths)]  # fmt: skip
        self.log = open(args.log_dir / f"hybridllm-{path.stem}.log", "w")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        self.loaded = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])
        self.proc.wait()
        raise RuntimeError(f"hybridllm child exited ({self.proc.returncode}), see {self.log.name}")

    def round(self, seed: int) -> dict:
        self.proc.stdin.write(f"round {seed}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> int:
        """Ends the child; its peak RSS in bytes (VmHWM, or wait4's ru_maxrss if larger)."""
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        peak = self._read()["peak_rss"]
        _, status, usage = os.wait4(self.proc.pid, 0)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.log.close()
        return max(peak, usage.ru_maxrss * 1024)


# ---- llama-bench ---------------------------------------------------------------------------------


def llama_bench(bin_dir: Path, path: Path, threads: int, *args: str) -> float:
    """llama-bench's tokens/s (one repetition, a fresh process)."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(path), "-t", str(threads), "-r", "1",
           "-o", "json", *args]  # fmt: skip
    run = subprocess.run(cmd, check=True, capture_output=True, text=True, env=llamacpp_env(bin_dir))
    return json.loads(run.stdout)[0]["avg_ts"]


# ---- the parent ----------------------------------------------------------------------------------


def type_of(path: Path) -> str:
    """The file type from make_gguf_files.py's names (`NAME.TYPE.gguf`), else the most common
    quantized tensor type in the file."""
    parts = path.name.split(".")
    if len(parts) >= 3:
        return parts[-2]
    types = [t for t in tensor_types(path) if t not in ("F32",)]
    return types[0] if types else "?"


def vocab_size(path: Path) -> int:
    import gguf

    reader = gguf.GGUFReader(str(path))
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def bench_file(path: Path, args: argparse.Namespace) -> dict:
    print(f"[bench_gguf_types] {path.name}", file=sys.stderr, flush=True)
    ours = HybridChild(path, args, vocab_size(path))
    first, *deeper = args.depths
    keys = ["ours_tok_s", "ours_ttft_s", "theirs_tok_s", "theirs_ttft_s"]
    keys += [f"{who}_tok_s_depth_{d}" for d in deeper for who in ("ours", "theirs")]
    rounds: dict[str, list[float]] = {k: [] for k in keys}
    try:
        for r in range(args.rounds):
            got = ours.round(1000 + r)
            rounds["ours_tok_s"].append(got["decode_tok_s"][str(first)])
            for d in deeper:
                rounds[f"ours_tok_s_depth_{d}"].append(got["decode_tok_s"][str(d)])
            rounds["ours_ttft_s"].append(got["ttft_s"])
            if args.llamacpp_bin:
                for d in args.depths:
                    tg = llama_bench(args.llamacpp_bin, path, args.threads,
                                     "-p", "0", "-n", str(args.new_tokens), "-d", str(d))  # fmt: skip
                    key = "theirs_tok_s" if d == first else f"theirs_tok_s_depth_{d}"
                    rounds[key].append(tg)
                pp = llama_bench(args.llamacpp_bin, path, args.threads,
                                 "-p", str(args.prompt_len), "-n", "0")  # fmt: skip
                rounds["theirs_ttft_s"].append(args.prompt_len / pp)
    finally:
        peak = ours.close() if ours.proc.poll() is None else None
    size = path.stat().st_size
    result = {
        "type": type_of(path),
        "file": str(path),
        "file_bytes": size,
        "tensor_types": tensor_types(path),
        "load_s": ours.loaded["loaded_s"],
        "peak_rss_bytes": peak,
        "runtime_rss_bytes": ours.loaded["runtime_rss"],
        "rss_over_file": peak / size if peak else None,
        # the peak less what the process held before loading the model (torch, hybridllm)
        "model_rss_over_file": (peak - ours.loaded["runtime_rss"]) / size if peak else None,
        "rounds": {k: [round(v, 4) for v in vs] for k, vs in rounds.items()},
        "ours_tok_s": max(rounds["ours_tok_s"]),
        "ours_ttft_s": min(rounds["ours_ttft_s"]),
    }
    for key in keys[4:]:  # decode after deeper contexts: the best round of each
        if rounds[key]:
            result[key] = max(rounds[key])
    if rounds["theirs_tok_s"]:
        result["theirs_tok_s"] = max(rounds["theirs_tok_s"])
        result["theirs_ttft_s"] = min(rounds["theirs_ttft_s"])
        result["decode_ratio"] = result["ours_tok_s"] / result["theirs_tok_s"]
        result["ttft_ratio"] = result["theirs_ttft_s"] / result["ours_ttft_s"]
    return result


def markdown(results: list[dict], args: argparse.Namespace) -> str:
    n, p = args.new_tokens, args.prompt_len
    lines = [
        f"| type | file MiB | hybridllm tok/s ({n} tokens, batch 1) | llama.cpp tok/s "
        f"(`-p 0 -n {n}`) | ratio | TTFT {p} hybridllm / llama.cpp (s) | TTFT ratio | "
        "peak RSS MiB | RSS / file | (RSS - runtime) / file |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    for r in results:
        lines.append(
            f"| {r['type']} | {r['file_bytes'] / 2**20:.0f} | {r['ours_tok_s']:.1f} | "
            f"{f(r.get('theirs_tok_s'), '.1f')} | {f(r.get('decode_ratio'), '.2f')}x | "
            f"{r['ours_ttft_s']:.3f} / {f(r.get('theirs_ttft_s'), '.3f')} | "
            f"{f(r.get('ttft_ratio'), '.2f')}x | "
            f"{f(r['peak_rss_bytes'] and r['peak_rss_bytes'] / 2**20, '.0f')} | "
            f"{f(r['rss_over_file'], '.2f')} | {f(r['model_rss_over_file'], '.2f')} |"
        )
    for r in results:
        for d in args.depths[1:]:
            ours, theirs = r[f"ours_tok_s_depth_{d}"], r.get(f"theirs_tok_s_depth_{d}")
            lines.append(
                f"- {r['type']}: decode after {d} tokens of context: hybridllm {ours:.1f} tok/s "
                f"({ours / r['ours_tok_s']:.2f}x its first depth's), llama.cpp {f(theirs, '.1f')}"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=DEFAULT_OUT, help="make_gguf_files.py's output")
    ap.add_argument("--prefix", default="random-llama-1b", help="file names PREFIX.TYPE.gguf")
    ap.add_argument("--types", nargs="+", default=ALL_TYPES)
    ap.add_argument("--files", nargs="+", type=Path, help="these files instead of --dir/--types")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument(
        "--depths",
        type=int,
        nargs="+",
        default=[0],
        help="decode after a prompt this long (0: one token), each; llama-bench -d the same",
    )
    ap.add_argument(
        "--kv-cache-memory",
        default="128MiB",
        help="hybridllm's KV cache (default 128MiB: a 1B's 512 + 64 tokens need about 20 MiB; "
        "the engine's default share of the RAM would count in the peak RSS)",
    )
    ap.add_argument("--llamacpp-bin", type=Path, help="default: build_llamacpp.sh's folder")
    ap.add_argument("--no-llamacpp", action="store_true", help="hybridllm only")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--md", type=Path, help="also write the markdown table here")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp"), help="the children's logs")
    # the child's side
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=49152, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    if args.no_llamacpp:
        args.llamacpp_bin = None
    else:
        args.llamacpp_bin = find_llamacpp_bin(args.llamacpp_bin, build=False)
        if args.llamacpp_bin is None:
            sys.exit("llama.cpp's llama-bench not found: --llamacpp-bin DIR, or --no-llamacpp")
    files = args.files or [args.dir / f"{args.prefix}.{t}.gguf" for t in args.types]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        print(f"[bench_gguf_types] skipping missing files: {missing}", file=sys.stderr)
    results, failed = [], []
    for f in files:
        if not f.is_file():
            continue
        try:
            results.append(bench_file(f, args))
        except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
            # one file failing (out of memory, a type one engine cannot run) ends its row only
            print(f"[bench_gguf_types] {f.name} failed: {e}", file=sys.stderr, flush=True)
            failed.append({"file": str(f), "error": str(e)})
    table = markdown(results, args)
    if failed:
        table += "\n\nfailed: " + ", ".join(Path(x["file"]).name for x in failed)
    print(table)
    if args.md:
        args.md.write_text(table + "\n")
    if args.json:
        args.json.write_text(
            json.dumps({"threads": args.threads, "results": results, "failed": failed}, indent=2)
        )


if __name__ == "__main__":
    main()
