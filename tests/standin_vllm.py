"""A stand-in for vLLM's OpenAI server whose speed is set per speculative depth and requests in flight, so that a
test knows which depth pays at each load. Started as `python -m vllm.entrypoints.openai.api_server` with its
folder on PYTHONPATH (tests/e2e/test_schedule_standin.py writes it there as that module): it reads the same flags
(--model, --speculative-config, --host, --port), answers /health, /v1/models, /metrics (the spec_decode counters,
every draft accepted up to half the depth) and /v1/completions (token ids, or a stream of chunks as `vllm bench
serve` asks), and writes the speculative config it was launched with to $STANDIN_LAUNCHES.

Per output token it sleeps MS_PER_TOKEN[depth][in flight] ms, the depth being the schedule's at the number of
requests in flight (vLLM's per-batch-size lookup), the in-flight count taken when the token is made.
"""

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# depth -> {requests in flight (at least): ms per output token}; the first key not above the count applies
MS_PER_TOKEN = json.loads(os.environ.get("STANDIN_MS_PER_TOKEN", "{}"))

parser = argparse.ArgumentParser()
parser.add_argument("--model")
parser.add_argument("--speculative-config")
parser.add_argument("--host", default="127.0.0.1")
parser.add_argument("--port", type=int)
args, _ = parser.parse_known_args()
spec = json.loads(args.speculative_config) if args.speculative_config else None
with open(os.environ["STANDIN_LAUNCHES"], "a") as f:
    f.write(json.dumps(spec) + "\n")

lock = threading.Lock()
state = {"in_flight": 0, "drafts": 0, "draft_tokens": 0, "accepted": 0}


def depth_now() -> int:
    if spec is None:
        return 0
    for first, last, depth in spec.get("num_speculative_tokens_per_batch_size") or []:
        if first <= state["in_flight"] <= last:
            return depth
    return spec["num_speculative_tokens"]


def token_ms(depth: int) -> float:
    table = MS_PER_TOKEN[str(depth)]
    return [ms for at_least, ms in sorted((int(k), v) for k, v in table.items()) if at_least <= state["in_flight"]][-1]


def one_token() -> None:
    with lock:
        depth = depth_now()
        ms = token_ms(depth)
        if depth:
            state["drafts"] += 1
            state["draft_tokens"] += depth
            state["accepted"] += depth // 2
    time.sleep(ms / 1000)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def send(self, body: bytes, kind="application/json"):
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            self.send(json.dumps({"data": [{"id": args.model}]}).encode())
        elif self.path == "/metrics":
            lines = [
                f"vllm:spec_decode_num_drafts_total {state['drafts']}",
                f"vllm:spec_decode_num_draft_tokens_total {state['draft_tokens']}",
                f"vllm:spec_decode_num_accepted_tokens_total {state['accepted']}",
            ]
            self.send(("\n".join(lines) + "\n").encode(), "text/plain")
        else:
            self.send(b"ok", "text/plain")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = int(body.get("max_tokens") or 16)
        with lock:
            state["in_flight"] += 1
        try:
            if body.get("stream"):
                self.stream(n)
            else:
                for _ in range(n):
                    one_token()
                choice = {"text": "a" * n, "token_ids": [7] * n, "finish_reason": "length"}
                usage = {"prompt_tokens": 4, "completion_tokens": n}
                self.send(json.dumps({"choices": [choice], "usage": usage}).encode())
        finally:
            with lock:
                state["in_flight"] -= 1

    def stream(self, n: int):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(data: str):
            raw = f"data: {data}\n\n".encode()
            self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
            self.wfile.flush()

        for i in range(n):
            one_token()
            finish = "length" if i == n - 1 else None
            chunk(json.dumps({"choices": [{"index": 0, "text": "a", "finish_reason": finish}]}))
        chunk(json.dumps({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": n}}))
        chunk("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
