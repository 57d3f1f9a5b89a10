"""Single-stream decode through the server against offline decode, side by side in one run.

The embedded model by default. Offline: `LLM.generate` in this process. Served: a real
`hybridllm serve` subprocess, one streamed `/v1/completions` (or `--endpoint
/v1/chat/completions`) request at a time read by a minimal raw-socket SSE reader (so the client
costs as little CPU as a client can). Both decode NEW_TOKENS tokens after the same prompt of
token ids, greedy, ignore_eos; the rounds alternate (offline, served, offline, ...). Reported:
decode tokens/s after the first token (median over rounds) and end to end, and their ratio.

    python benchmarks/bench_served_vs_offline.py [--rounds 5] [--new-tokens 128]
        [--endpoint /v1/completions] [--cpu-threads N] [--json out.json] [-- server args...]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.integration.openai_server import RemoteServer  # noqa: E402

PROMPT = list(range(1000, 1064))  # 64 ordinary vocabulary ids


def offline_round(llm, sampling_params) -> tuple[float, float]:
    """(decode tokens/s after the first token, end-to-end tokens/s)."""
    start = time.monotonic()
    out = llm.generate([{"prompt_token_ids": PROMPT}], sampling_params, use_tqdm=False)[0]
    end = time.monotonic()
    n = len(out.outputs[0].token_ids)
    first = out.metrics["first_token_time"]
    return (n - 1) / (end - first), n / (end - start)


def served_round(port: int, endpoint: str, new_tokens: int) -> tuple[float, float]:
    """One streamed request over a raw socket: (decode tokens/s, end-to-end tokens/s)."""
    body: dict = {"max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    if endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Tell me a long story."}]
    else:
        body["prompt"] = PROMPT
    payload = json.dumps(body).encode()
    request = (
        f"POST {endpoint} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode() + payload
    start = time.monotonic()
    received: list[tuple[int, float]] = []  # (bytes so far, when they had arrived)
    data = bytearray()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(request)
        while chunk := sock.recv(65536):
            data += chunk
            received.append((len(data), time.monotonic()))
    # Each SSE event whose choice carries text is one token here (greedy, a token a step);
    # the chat endpoint's first event (the role, empty content) is not.
    times = []
    offset = 0
    for event in bytes(data).split(b"\n\n"):
        offset += len(event) + 2
        at = event.find(b"data: {")  # after the HTTP chunk's size line
        if at < 0:
            continue
        choices = json.loads(event[at + 6 :]).get("choices") or [{}]
        choice = choices[0]
        text = choice.get("text") or (choice.get("delta") or {}).get("content")
        if text:
            times.append(next(t for n, t in received if n >= min(offset, len(data))))
    if len(times) < 2:
        raise RuntimeError(f"the server streamed no tokens: {bytes(data[:300])!r}")
    return (len(times) - 1) / (times[-1] - times[0]), len(times) / (times[-1] - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--json", default=None)
    parser.add_argument("--cpu-threads", type=int, default=None, help="for both engines")
    parser.add_argument("server_args", nargs="*")
    args = parser.parse_args()

    from hybridllm import LLM, SamplingParams

    llm = LLM(max_model_len=1024, cpu_threads=args.cpu_threads)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    offline_round(llm, params)  # warm-up
    results: dict[str, list] = {"offline": [], "served": []}
    server_args = ["--max-model-len", "1024", *args.server_args]
    if args.cpu_threads:
        server_args += ["--cpu-threads", str(args.cpu_threads)]
    with RemoteServer(server_args) as server:
        served_round(server.port, args.endpoint, 8)  # warm-up
        for _ in range(args.rounds):
            results["offline"].append(offline_round(llm, params))
            results["served"].append(served_round(server.port, args.endpoint, args.new_tokens))
    summary = {}
    for name, rounds in results.items():
        summary[name] = {
            "decode_tok_s": statistics.median(r[0] for r in rounds),
            "end_to_end_tok_s": statistics.median(r[1] for r in rounds),
            "rounds": rounds,
        }
    ratio = summary["served"]["decode_tok_s"] / summary["offline"]["decode_tok_s"]
    e2e = summary["served"]["end_to_end_tok_s"] / summary["offline"]["end_to_end_tok_s"]
    for name in results:
        s = summary[name]
        print(
            f"{name:8s} decode {s['decode_tok_s']:7.1f} tok/s   end to end {s['end_to_end_tok_s']:7.1f}"
        )
    print(f"served / offline: decode {ratio:.3f}, end to end {e2e:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"endpoint": args.endpoint, "new_tokens": args.new_tokens, **summary}, f)
    llm.shutdown()


if __name__ == "__main__":
    main()
