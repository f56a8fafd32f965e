"""A retrieval server in Search-R1's protocol over this package's BM25 index, so one retriever
serves several jobs (`--rl-env search --rl-search-url http://HOST:PORT/retrieve`):

  python tools/retrieval_server.py --corpus wiki.jsonl --port 8000
  -> POST /retrieve {"queries": [...], "topk": 3, "return_scores": true}
     {"result": [[{"document": {"id": "0", "contents": "..."}, "score": 12.5}, ...], ...]}

The corpus is JSONL, one passage a line ("contents" or "text"; a document's id is its line's
index among the passages). A bad request is answered 400 with {"error": ...}.

With a local Hugging Face encoder (e5's kind: mean pooling, "query: " / "passage: " prefixes) the
index is dense (megatron_rl_bi/envs/dense_index.py), over the passages' embeddings computed once:

  python tools/retrieval_server.py --corpus wiki.jsonl --dense-encoder e5 --write-embeddings wiki.npy
  python tools/retrieval_server.py --corpus wiki.jsonl --dense-encoder e5 --dense-embeddings wiki.npy
"""

import argparse
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl_bi.envs.dense_index import DenseEncoder, DenseRetriever, write_embeddings  # noqa: E402
from megatron_rl_bi.envs.search import Retriever, read_corpus  # noqa: E402


def answer(retriever: Retriever | DenseRetriever, request: object) -> dict:
    """The protocol's answer to one request body; ValueError for a malformed one."""
    if not isinstance(request, dict) or not isinstance(request.get("queries"), list):
        raise ValueError('expected {"queries": [...], "topk": k, "return_scores": bool}')
    queries, k = request["queries"], request.get("topk", 3)
    if not all(isinstance(q, str) for q in queries) or isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError("queries must be strings and topk a positive integer")
    result = []
    for query in queries:
        hits = [({"id": str(i), "contents": retriever.passages[i]}, score) for i, score in retriever.scored(query, k)]
        result.append([{"document": d, "score": s} for d, s in hits] if request.get("return_scores")
                      else [d for d, _ in hits])
    return {"result": result}


def make_server(retriever: Retriever | DenseRetriever, host: str, port: int) -> ThreadingHTTPServer:
    """The server (not yet serving: call serve_forever); port 0 picks a free one."""
    lock = threading.Lock()  # one search at a time: the index is shared

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            if self.path != "/retrieve":
                return self._send(404, {"error": f"no {self.path}: POST /retrieve"})
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with lock:
                    body = answer(retriever, request)
            except ValueError as exc:  # bad JSON too
                return self._send(400, {"error": str(exc)})
            self._send(200, body)

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # quiet: a training job sends thousands
            pass

    return ThreadingHTTPServer((host, port), Handler)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", required=True, help="JSONL, one passage a line ('contents' or 'text')")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="0: a free port (printed)")
    parser.add_argument("--dense-encoder", default=None, metavar="DIR",
                        help="a local Hugging Face encoder: search by its embeddings, not BM25")
    parser.add_argument("--dense-embeddings", default=None, metavar="FILE.npy",
                        help="--dense-encoder: the passages' embeddings ([passages, dim] float32)")
    parser.add_argument("--write-embeddings", default=None, metavar="FILE.npy",
                        help="--dense-encoder: compute the passages' embeddings into FILE and exit")
    parser.add_argument("--dense-query-prefix", default="query: ", help="--dense-encoder: before each query")
    parser.add_argument("--dense-passage-prefix", default="passage: ",
                        help="--write-embeddings: before each passage")
    return parser


def build_retriever(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """BM25 over the corpus, or the dense index of --dense-encoder and --dense-embeddings; None
    after --write-embeddings (done). A missing or contradictory flag is a parser error."""
    passages = read_corpus(args.corpus)
    if not args.dense_encoder:
        if args.dense_embeddings or args.write_embeddings:
            parser.error("--dense-embeddings and --write-embeddings need --dense-encoder DIR")
        return Retriever(passages)
    if bool(args.dense_embeddings) == bool(args.write_embeddings):
        parser.error("--dense-encoder needs one of --dense-embeddings FILE (serve) or --write-embeddings FILE")
    try:
        encoder = DenseEncoder(args.dense_encoder)
        if args.write_embeddings:
            write_embeddings(passages, encoder, args.write_embeddings, args.dense_passage_prefix)
            print(f"wrote the embeddings of {len(passages)} passages to {args.write_embeddings}")
            return None
        return DenseRetriever(passages, args.dense_embeddings, encoder, args.dense_query_prefix)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    retriever = build_retriever(args, parser)
    if retriever is None:
        return
    server = make_server(retriever, args.host, args.port)
    host, port = server.server_address[:2]
    print(f"serving http://{host}:{port}/retrieve", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
