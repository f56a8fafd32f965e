"""The retrieval server protocol (envs.retrieval, tools/retrieval_server.py) against the real
server on 127.0.0.1: Search-R1's fields, one request for a turn's searches, and a server that is
slow, errors, or is down (only the affected samples fail, counted); its dense index over a tiny
random encoder made in the test."""

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
from megatron_rl_bi.envs.search import Retriever, read_corpus

from .. import REPO

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


@pytest.mark.parametrize("topk", [0, -1, True, "3", 2.5])
def test_the_server_refuses_a_topk_that_is_not_a_positive_integer(bm25_server, topk):
    with pytest.raises(urllib.error.HTTPError) as bad:  # true is JSON's boolean, not 1
        post(bm25_server, {"queries": ["river"], "topk": topk, "return_scores": True})
    assert bad.value.code == 400
    assert json.loads(bad.value.read()) == {"error": "queries must be strings and topk a positive integer"}


@pytest.mark.parametrize("path", ["/", "/search", "/retrieve/more"])
def test_the_server_answers_404_to_a_post_to_another_path(bm25_server, path):
    with pytest.raises(urllib.error.HTTPError) as bad:
        post(bm25_server.removesuffix("/retrieve") + path, {"queries": ["river"], "topk": 1, "return_scores": True})
    assert bad.value.code == 404
    assert json.loads(bad.value.read()) == {"error": f"no {path}: POST /retrieve"}


def test_a_turns_searches_go_in_one_request_and_each_gets_its_own_passages(bm25_server):
    retriever = RemoteRetriever(bm25_server, gather_s=0.2)
    queries = ["capital of France", "capital of Germany", "river Africa", "highest mountain"] * 2
    outcomes = call_all([lambda q=q: retriever.search(q, 1) for q in queries], timeout_s=10)
    assert [o.value for o in outcomes] == [[Retriever(CORPUS).search(q, 1)[0]] for q in queries]
    assert [o.value[0] for o in outcomes[:4]] == CORPUS[:1] + CORPUS[1:2] + CORPUS[2:3] + CORPUS[3:4]
    assert retriever.requests_sent == 1


def test_searches_of_different_depths_go_in_a_request_each(bm25_server):
    retriever = RemoteRetriever(bm25_server, gather_s=0.2)
    depths = [1, 3, 1, 3]
    outcomes = call_all([lambda k=k: retriever.search("capital", k) for k in depths], timeout_s=10)
    assert [len(o.value) for o in outcomes] == depths
    assert retriever.requests_sent == 2


class _Flaky(BaseHTTPRequestHandler):
    """Answers its first `failures` requests with `failure` (status, body: a 500 unless told), or
    sleeps `delay_s` on each, then the protocol."""

    failures, delay_s, seen, bodies, failure = 0, 0.0, 0, (), (500, b'{"error": "boom"}')

    def do_POST(self):
        type(self).seen += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies += (body,)
        time.sleep(self.delay_s)
        failing = type(self).seen <= self.failures
        status, data = self.failure if failing else (200, json.dumps(
            {"result": [[{"document": {"contents": f"about {q}"}, "score": 1.0}] for q in body["queries"]]}).encode())
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def flaky_server(failures=0, delay_s=0.0, failure=_Flaky.failure):
    handler = type("Handler", (_Flaky,), {"failures": failures, "delay_s": delay_s, "seen": 0, "bodies": (),
                                          "failure": failure})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    return server, serving(server), handler


def test_a_server_error_is_retried_then_answered():
    server, url, handler = flaky_server(failures=2)
    retriever = RemoteRetriever(url, retries=2, backoff_s=0.01, gather_s=0.0)
    assert retriever.search("x", 1) == ["about x"] and handler.seen == 3
    assert handler.bodies == ({"queries": ["x"], "topk": 1, "return_scores": True},) * 3  # Search-R1's request
    server.shutdown()


def test_retries_wait_twice_as_long_each_time(monkeypatch):
    from megatron_rl_bi.envs import retrieval

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    url = f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    server.server_close()  # nothing listens there: each attempt fails at once
    waits = []
    monkeypatch.setattr(retrieval.time, "sleep", waits.append)
    with pytest.raises(RetrievalError, match="no answer after 4 attempts"):
        RemoteRetriever(url, retries=3, backoff_s=0.25).retrieve(["x"], 1)
    assert waits == [0.25, 0.5, 1.0]


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


@pytest.mark.parametrize("body", [b"<html>ok</html>", b'{"results": [[]]}', b'{"result": [[], [], []]}'],
                         ids=["not JSON", "no result", "three lists"])
def test_an_ok_answer_outside_the_protocol_is_retried_then_fails_every_search_of_its_request_counted(body):
    server, url, handler = flaky_server(failures=100, failure=(200, body))
    retriever = RemoteRetriever(url, retries=1, backoff_s=0.01, gather_s=0.2)
    calls = [lambda: retriever.search("a", 1), lambda: retriever.search("b", 1), lambda: "answered, no search"]
    outcomes = call_all(calls, timeout_s=10)
    assert [(o.problem, o.value) for o in outcomes] == [(FAILED, None), (FAILED, None), (None, "answered, no search")]
    assert handler.seen == 2  # one request for both searches, retried once
    with pytest.raises(RetrievalError, match=r"no answer after 2 attempts \((JSONDecodeError|ValueError): "):
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


def test_the_lookup_corpus_served_answers_as_the_task_searches_in_process(tmp_path):
    """tools/lookup_corpus.py's file through the server gives every query the passages the lookup
    task's own index gives it, so the tiny search recipe runs the same through a server."""
    from megatron_rl_bi.envs.tasks import LookupTask
    corpus = tmp_path / "lookup.jsonl"
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "lookup_corpus.py"), "--seed", "1234",
                    "--output", str(corpus)], check=True, capture_output=True)
    task = LookupTask(1234)
    in_process = Retriever(task.corpus)
    queries = [task.keys[i] for i in range(0, len(task.keys), 97)] + ["is", "b4x 317", "zz9"]
    with_server = make_server(Retriever(read_corpus(str(corpus))), "127.0.0.1", 0)
    url = serving(with_server)
    try:
        served = RemoteRetriever(url, gather_s=0.0).retrieve(queries, 3)
    finally:
        with_server.shutdown()
    assert served == [in_process.search(query, 3) for query in queries]
    assert served[0][0] == task.corpus[0]


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    """A tiny random BERT and the test's byte-level tokenizer, saved as a user's encoder is."""
    import torch
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    directory = tmp_path_factory.mktemp("encoder")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(REPO, "tests", "functional_tests", "assets",
                                                                    "chat_tokenizer", "tokenizer.json"),
                                        pad_token="<|endoftext|>")
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=64)).save_pretrained(directory)
    return str(directory)


def _server_command(*flags):
    return [sys.executable, os.path.join(REPO, "tools", "retrieval_server.py"), *flags]


def test_the_dense_index_serves_each_passage_as_its_own_best_match(tmp_path, encoder_dir):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"contents": p}) + "\n" for p in CORPUS))
    embeddings = tmp_path / "corpus.npy"
    no_prefix = ["--dense-query-prefix", "", "--dense-passage-prefix", ""]
    written = subprocess.run(_server_command("--corpus", str(corpus), "--dense-encoder", encoder_dir,
                                             "--write-embeddings", str(embeddings), *no_prefix),
                             capture_output=True, text=True, timeout=300)
    assert written.returncode == 0 and "wrote the embeddings of 4 passages" in written.stdout, written.stderr[-2000:]
    process = subprocess.Popen(_server_command("--corpus", str(corpus), "--dense-encoder", encoder_dir,
                                               "--dense-embeddings", str(embeddings), "--port", "0", *no_prefix),
                               stdout=subprocess.PIPE, text=True)
    try:
        url = next(line for line in process.stdout if line.startswith("serving ")).split()[-1]
        for index, passage in enumerate(CORPUS):  # a query of a passage's own text: inner product 1
            [[best, *_]] = post(url, {"queries": [passage], "topk": 4, "return_scores": True})["result"]
            assert best["document"] == {"id": str(index), "contents": passage}
            assert abs(best["score"] - 1.0) < 1e-5
    finally:
        process.kill()
        process.wait()


def test_dense_flags_and_embeddings_that_do_not_fit_are_named(tmp_path, encoder_dir):
    import numpy as np

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"contents": p}) + "\n" for p in CORPUS))
    wrong = tmp_path / "wrong.npy"
    np.save(wrong, np.zeros((3, 32), np.float32))
    for flags, error in [(["--dense-embeddings", str(wrong)], "need --dense-encoder DIR"),
                         (["--dense-encoder", encoder_dir], "needs one of --dense-embeddings FILE"),
                         (["--dense-encoder", encoder_dir, "--dense-embeddings", str(wrong)],
                          f"--dense-embeddings {wrong}: shape (3, 32), expected [4 passages, dim]"),
                         (["--dense-encoder", str(tmp_path), "--dense-embeddings", str(wrong)],
                          f"--dense-encoder {tmp_path}: cannot load an encoder")]:
        done = subprocess.run(_server_command("--corpus", str(corpus), *flags), capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 2 and error in done.stderr, done.stderr[-1500:]


def test_the_encoder_mean_pools_the_texts_own_tokens(encoder_dir):
    """e5's pooling: the mean of the last hidden states over the text's tokens (padding left out),
    L2-normalized; computed here by hand from the model's outputs."""
    import numpy as np
    import torch

    from megatron_rl_bi.envs.dense_index import DenseEncoder

    encoder = DenseEncoder(encoder_dir)
    short, long = "query: river", "query: the highest mountain of the world"
    with torch.no_grad():
        hidden = encoder.model(**encoder.tokenizer([short], return_tensors="pt")).last_hidden_state[0]
    expected = (hidden.mean(0) / hidden.mean(0).norm()).numpy()
    alone, padded = encoder.encode([short]), encoder.encode([long, short])
    assert np.allclose(alone[0], expected, atol=1e-6)
    assert np.allclose(padded[1], alone[0], atol=1e-5)  # the padding of a batch does not count
    assert np.allclose(np.linalg.norm(padded, axis=1), 1.0, atol=1e-6)
