"""The built-in search environment (`--rl-env search`), offline: a BM25 index (bm25s) over a
local corpus; the model searches with `<search>query</search>`, reads
`<information>top-k passages</information>`, and answers with `<answer>...</answer>`, scored by
exact match after Search-R1's normalization (verifiers.verify_exact_match) against the example's
accepted answers; a turn with neither is told so and the conversation goes on (envs.actions).

The corpus is `--rl-search-corpus FILE` (JSONL, one passage a line: "contents" or "text"), or,
without it, the task's own corpus (the built-in `--rl-task lookup`); or the searches go to a
retrieval server, `--rl-search-url URL` (envs.retrieval).
"""

from megatron_rl_bi import compat
from megatron_rl_bi.envs.actions import no_action_observation
from megatron_rl_bi.envs.verifiers import verify_exact_match
from megatron_rl_bi.jsonfile import parse_object

def read_corpus(path: str) -> list[str]:
    """The passages of a JSONL corpus; a line without text fails with FILE:LINE."""
    passages = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            record = parse_object(line, path, line_number)
            text = record.get("contents", record.get("text"))
            if not isinstance(text, str) or not text:
                raise ValueError(f"{path}:{line_number}: a passage needs a non-empty 'contents' or 'text'")
            passages.append(text)
    if not passages:
        raise ValueError(f"{path}: no passages")
    return passages


class Retriever:
    """BM25 over passages (English stop words removed), built once and shared by every sample."""

    def __init__(self, passages: list[str]):
        self.passages = passages
        self.bm25s = compat.bm25s_without_jax()
        self.index = self.bm25s.BM25()
        self.index.index(self.bm25s.tokenize(passages, stopwords="en", show_progress=False), show_progress=False)

    def search(self, query: str, k: int) -> list[str]:
        """The `k` best passages for `query`, best first (fewer when the corpus is smaller)."""
        return [self.passages[i] for i, _ in self.scored(query, k)]

    def scored(self, query: str, k: int) -> list[tuple[int, float]]:
        """(passage index, BM25 score) of the `k` best passages for `query`, best first."""
        tokens = self.bm25s.tokenize([query], stopwords="en", show_progress=False)
        if not tokens.vocab:  # only stop words, or nothing: nothing to match
            return []
        ids, scores = self.index.retrieve(tokens, k=min(k, len(self.passages)), show_progress=False)
        return [(int(i), float(score)) for i, score in zip(ids[0], scores[0])]


ACTIONS = ("<search>query</search>", "<answer>answer</answer>")
# The search as a function schema, for --rl-tool-format chat (envs.tool_format).
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "Search the corpus; the best passages come back.",
    "parameters": {"type": "object", "required": ["query"],
                   "properties": {"query": {"type": "string", "description": "what to look up"}}}}}


class SearchEnvironment:
    """One sample's conversation; the class attributes come from `search_environment`."""

    retriever = None
    top_k = 3
    stop_strings = ("</search>", "</answer>")
    tools = (SEARCH_TOOL,)

    def reset(self, example) -> str:
        """The example's prompt as it is: a dataset's prompts carry their instructions."""
        self.answers = example.accepted or (example.answer,)
        return example.prompt

    def step(self, text: str) -> tuple[str, float, bool]:
        if text.endswith("</search>"):
            query = text.rsplit("<search>", 1)[-1].removesuffix("</search>").strip()
            return information(self.retriever.search(query, self.top_k)), 0.0, False
        if "<answer>" in text and "</answer>" in text:
            return "", verify_exact_match(text, self.answers), True
        return no_action_observation(ACTIONS), 0.0, False


def information(passages: list[str]) -> str:
    """The observation of a search: the passages found, numbered, between information tags."""
    found = "\n".join(f"Doc {i}: {passage}" for i, passage in enumerate(passages, 1))
    return f"\n<information>{found}</information>\n"


def search_environment(retriever, top_k: int) -> type:
    """The environment class searching with `retriever` (anything with search(query, k): a
    Retriever, built once, or a RemoteRetriever)."""
    return type("SearchEnvironment", (SearchEnvironment,), {"retriever": retriever, "top_k": top_k})
