"""A retrieval server as the search environment's retriever (`--rl-search-url URL`), in
Search-R1's protocol: `POST URL` with `{"queries": [...], "topk": k, "return_scores": true}`,
answered by `{"result": [[{"document": {"id": ..., "contents": ...}, "score": ...}, ...], ...]}`,
one list a query, best first (without scores a list holds the documents themselves).

The searches of a turn run at once on the environment pool (envs.environment.call_all, up to
--rl-env-workers of them); the first to arrive waits `gather_s` for the others and sends them all
in one request. A request
that times out, fails to connect, answers an HTTP error or a body that is not the protocol is
retried `retries` times, waiting `backoff_s`, then twice as long, ...; then every search of that
request raises, which ends those samples alone with reward 0, counted as environment failures.
What a server returns for a query does not depend on the other queries beside it, so batching
changes no sample.

`tools/retrieval_server.py` serves this package's BM25 index over a JSONL corpus in the same
protocol, so one retriever can serve several jobs.
"""

import json
import threading
import time
import urllib.request
from dataclasses import dataclass, field


class RetrievalError(RuntimeError):
    """The server gave no usable answer after every retry."""


@dataclass
class _Search:
    query: str
    done: threading.Event = field(default_factory=threading.Event)
    passages: list[str] | None = None
    error: RetrievalError | None = None


class RemoteRetriever:
    """`search(query, k)` through a retrieval server; searches arriving together share a request."""

    def __init__(self, url: str, timeout_s: float = 10.0, retries: int = 3, backoff_s: float = 0.5,
                 gather_s: float = 0.02):
        self.url, self.timeout_s, self.retries, self.backoff_s, self.gather_s = url, timeout_s, retries, backoff_s, gather_s
        self._lock = threading.Lock()
        self._waiting: dict[int, list[_Search]] = {}  # by k
        self.requests_sent = 0

    def search(self, query: str, k: int) -> list[str]:
        """The `k` best passages for `query`, best first; RetrievalError when the server fails."""
        search = _Search(query)
        with self._lock:
            waiting = self._waiting.setdefault(k, [])
            leads = not waiting
            waiting.append(search)
        if leads:
            time.sleep(self.gather_s)
            with self._lock:
                batch = self._waiting.pop(k)
            self._answer(batch, k)
        search.done.wait()
        if search.error is not None:
            raise search.error
        return search.passages

    def _answer(self, batch: list[_Search], k: int) -> None:
        """Every search of `batch` answered (or given the request's error), and released."""
        try:
            for search, passages in zip(batch, self.retrieve([s.query for s in batch], k)):
                search.passages = passages
        except RetrievalError as error:
            for search in batch:
                search.error = error
        finally:  # whatever happened, no search of the batch waits on
            for search in batch:
                search.done.set()

    def retrieve(self, queries: list[str], k: int) -> list[list[str]]:
        """One request for `queries` (with retries): each query's passages."""
        body = json.dumps({"queries": queries, "topk": k, "return_scores": True}).encode()
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                with self._lock:
                    self.requests_sent += 1
                request = urllib.request.Request(self.url, data=body, method="POST",
                                                 headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return passages_of(json.loads(response.read()), len(queries))
            except (OSError, ValueError) as exc:  # URLError, HTTPError, timeouts; bad JSON or protocol
                problem = f"{type(exc).__name__}: {exc}"
        raise RetrievalError(f"--rl-search-url {self.url}: no answer after {self.retries + 1} attempts ({problem})")


def passages_of(answer: object, num_queries: int) -> list[list[str]]:
    """Each query's passages ('contents') from a protocol answer; ValueError naming what is wrong."""
    results = answer.get("result") if isinstance(answer, dict) else None
    if not isinstance(results, list) or len(results) != num_queries:
        raise ValueError(f"expected {{\"result\": [...]}} with {num_queries} lists, got {str(answer)[:200]}")
    passages = []
    for hits in results:
        if not isinstance(hits, list):
            raise ValueError(f"a query's result is not a list: {str(hits)[:200]}")
        documents = [hit.get("document", hit) if isinstance(hit, dict) else hit for hit in hits]
        if not all(isinstance(d, dict) and isinstance(d.get("contents"), str) for d in documents):
            raise ValueError(f"a document without 'contents': {str(hits)[:200]}")
        passages.append([d["contents"] for d in documents])
    return passages
