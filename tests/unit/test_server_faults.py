"""An engine that dies or hangs while it serves is named with its state and log, on a real
process and a real socket: a small HTTP server run the way engines are (under the guard)."""

import sys
import time

import pytest

from eagle3lib.engines.server import EngineError, Server, http_json, request_timeout_s

# /health answers; /generate answers once, then hangs (HANG) or kills its own process (DIE) on the next request
STAND_IN = """
import http.server, json, os, signal, sys, time
port, mode = int(sys.argv[sys.argv.index("--port") + 1]), sys.argv[1]
served = []
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if served:
            print("the second request: " + mode, flush=True)
            if mode == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)
        served.append(1)
        body = json.dumps({"token_ids": [1, 2], "text": "ab"}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


class StandIn(Server):
    name = "stand-in"

    def complete(self, prompt_ids, sampling):
        r = http_json(self.url + "/generate", {"prompt": prompt_ids}, self.request_timeout_s)
        return {**r, "completion_tokens": 2, "finish_reason": "length", "meta": {}}


@pytest.mark.parametrize(
    ("mode", "said"), [("die", "exited with status -9"), ("hang", "still runs but did not answer within 2 s (hung)")]
)
def test_an_engine_that_dies_or_hangs_mid_request_is_named(tmp_path, mode, said):
    server = StandIn([sys.executable, "-c", STAND_IN, mode], tmp_path / "stand-in.log", start_timeout_s=60)
    with server:
        assert server.generate([1], 2)["text"] == "ab"
        server.request_timeout_s = 2
        t0 = time.time()
        with pytest.raises(EngineError) as err:
            server.generate([1], 2)
        assert time.time() - t0 < 10
    text = str(err.value)
    assert text.startswith(f"stand-in at http://127.0.0.1:{server.port} {said}"), text
    assert f"the second request: {mode}" in text  # the log's last lines


def test_the_request_limit_follows_the_measured_decode_speed():
    assert request_timeout_s(0.01, 64, 1) == pytest.approx(66.4)  # a minute for the prompt, 10x the decode
    assert request_timeout_s(0.05, 256, 8) == 600  # never above the first request's limit


class StandInWithMetrics(StandIn):
    def stats(self):
        with self.answering():
            return http_json(self.url + "/metrics", {"read": 1}, self.request_timeout_s)


def test_a_metrics_read_of_an_engine_that_died_is_named(tmp_path):
    """The benchmark reads the engine's counters between requests; a dead engine there is named as in generate."""
    server = StandInWithMetrics([sys.executable, "-c", STAND_IN, "die"], tmp_path / "stand-in.log", start_timeout_s=60)
    with server:
        server.generate([1], 2)
        with pytest.raises(EngineError) as err:
            server.stats()
    assert str(err.value).startswith(f"stand-in at http://127.0.0.1:{server.port} exited with status -9"), err.value
