"""The retrieval server protocol (envs.retrieval, tools/retrieval_server.py) against the real
server on 127.0.0.1: Search-R1's fields, one request for a turn's searches, and a server that is
slow, errors, or is down (only the affected samples fail, counted)."""

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_rl_bi.envs.environment import FAILED, call_all
from megatron_rl_bi.envs.retrieval import RemoteRetriever, RetrievalError, passages_of
from megatron_rl_bi.envs.search import Retriever

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))

from retrieval_server import make_server  # noqa: E402

CORPUS = ["Paris is the capital of France.", "Berlin is the capital of Germany.",
          "The Nile is a river in Africa.", "Mount Everest is the highest mountain."]


def serving(server):
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    return f"http://{host}:{port}/retrieve"


@pytest.fixture
def bm25_server():
    server = make_server(Retriever(CORPUS), "127.0.0.1", 0)
    yield serving(server)
    server.shutdown()


def post(url, body):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


def test_the_server_answers_in_search_r1s_fields(bm25_server):
    answer = post(bm25_server, {"queries": ["capital of France", "highest mountain"], "topk": 2,
                                "return_scores": True})
    first = answer["result"][0][0]
    assert first["document"] == {"id": "0", "contents": CORPUS[0]} and first["score"] > 0
    assert answer["result"][1][0]["document"]["contents"] == CORPUS[3] and len(answer["result"][0]) == 2
    plain = post(bm25_server, {"queries": ["river"], "topk": 1, "return_scores": False})
    assert plain == {"result": [[{"id": "2", "contents": CORPUS[2]}]]}
    with pytest.raises(urllib.error.HTTPError) as bad:
        post(bm25_server, {"queries": "not a list"})
    assert bad.value.code == 400


def test_a_turns_searches_go_in_one_request_and_each_gets_its_own_passages(bm25_server):
    retriever = RemoteRetriever(bm25_server, gather_s=0.2)
    queries = ["capital of France", "capital of Germany", "river Africa", "highest mountain"] * 2
    outcomes = call_all([lambda q=q: retriever.search(q, 1) for q in queries], timeout_s=10)
    assert [o.value for o in outcomes] == [[Retriever(CORPUS).search(q, 1)[0]] for q in queries]
    assert [o.value[0] for o in outcomes[:4]] == CORPUS[:1] + CORPUS[1:2] + CORPUS[2:3] + CORPUS[3:4]
    assert retriever.requests_sent == 1


class _Flaky(BaseHTTPRequestHandler):
    """Answers 500 to its first `failures` requests (or sleeps `delay_s` on each), then the protocol."""

    failures, delay_s, seen = 0, 0.0, 0

    def do_POST(self):
        type(self).seen += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(self.delay_s)
        failing = type(self).seen <= self.failures
        data = json.dumps({"error": "boom"} if failing else
                          {"result": [[{"document": {"contents": f"about {q}"}, "score": 1.0}] for q in body["queries"]]}).encode()
        self.send_response(500 if failing else 200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def flaky_server(failures=0, delay_s=0.0):
    handler = type("Handler", (_Flaky,), {"failures": failures, "delay_s": delay_s, "seen": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    return server, serving(server), handler


def test_a_server_error_is_retried_then_answered():
    server, url, handler = flaky_server(failures=2)
    retriever = RemoteRetriever(url, retries=2, backoff_s=0.01, gather_s=0.0)
    assert retriever.search("x", 1) == ["about x"] and handler.seen == 3
    server.shutdown()


def test_a_server_that_keeps_failing_fails_only_its_samples_counted():
    server, url, handler = flaky_server(failures=100)
    retriever = RemoteRetriever(url, retries=2, backoff_s=0.01, gather_s=0.05)
    calls = [lambda: retriever.search("a", 1), lambda: retriever.search("b", 1), lambda: "answered, no search"]
    outcomes = call_all(calls, timeout_s=10)
    assert [o.problem for o in outcomes] == [FAILED, FAILED, None] and outcomes[2].value == "answered, no search"
    assert handler.seen == 3  # one request, retried twice
    with pytest.raises(RetrievalError, match=r"--rl-search-url http://127.0.0.1:\d+/retrieve: no answer after 3 attempts"):
        retriever.search("c", 1)
    server.shutdown()


def test_a_slow_server_times_out_and_is_retried():
    server, url, handler = flaky_server(delay_s=0.5)
    retriever = RemoteRetriever(url, timeout_s=0.1, retries=1, backoff_s=0.01, gather_s=0.0)
    with pytest.raises(RetrievalError, match="TimeoutError|timed out"):
        retriever.search("x", 1)
    assert handler.seen == 2
    server.shutdown()


def test_a_server_that_is_down_names_the_flag():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    url = f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    server.server_close()  # nothing listens there now
    with pytest.raises(RetrievalError, match=f"--rl-search-url {url}: no answer after 2 attempts .URLError"):
        RemoteRetriever(url, retries=1, backoff_s=0.01, gather_s=0.0).search("x", 1)


def test_answers_outside_the_protocol_are_named():
    with pytest.raises(ValueError, match='expected {"result": \\[...\\]} with 2 lists'):
        passages_of({"result": [[]]}, 2)
    with pytest.raises(ValueError, match="a document without 'contents'"):
        passages_of({"result": [[{"document": {"text": "x"}}]]}, 1)
    assert passages_of({"result": [[{"contents": "plain"}]]}, 1) == [["plain"]]


def test_the_server_runs_from_its_command_line(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"contents": p}) + "\n" for p in CORPUS))
    process = subprocess.Popen([sys.executable, os.path.join(REPO, "tools", "retrieval_server.py"), "--corpus",
                                str(corpus), "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        url = next(line for line in process.stdout if line.startswith("serving ")).split()[-1]
        assert RemoteRetriever(url, gather_s=0.0).search("capital of Germany", 1) == [CORPUS[1]]
    finally:
        process.kill()
        process.wait()
