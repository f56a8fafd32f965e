"""A dense index for the retrieval server (tools/retrieval_server.py --dense-encoder): passages'
embeddings computed beforehand (`write_embeddings`, or the user's own from the same encoder, a
float32 .npy of [passages, dim]), queries embedded at request time by a local Hugging Face
encoder (e5's recipe: mean pooling over the tokens, L2-normalized, "query: " / "passage: "
prefixes), passages ranked by inner product. Exact search (one matrix product), no ANN index:
fine for corpora that fit in memory, not for wiki-18's 21M passages.
"""

import numpy as np
import torch


class DenseEncoder:
    """A local encoder directory (config, weights and tokenizer, as `save_pretrained` writes them)."""

    def __init__(self, directory: str, batch_size: int = 64):
        from transformers import AutoModel, AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(directory)
            self.model = AutoModel.from_pretrained(directory).eval()
        except (OSError, ValueError) as exc:
            raise ValueError(f"--dense-encoder {directory}: cannot load an encoder ({exc})") from None
        self.batch_size = batch_size

    @torch.no_grad()
    def encode(self, texts: list[str]) -> np.ndarray:
        """[len(texts), dim] float32, each row of length 1."""
        rows = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[start:start + self.batch_size], padding=True, truncation=True,
                                   return_tensors="pt")
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1)
            rows.append(torch.nn.functional.normalize(pooled, dim=-1).float().numpy())
        return np.concatenate(rows) if rows else np.zeros((0, 0), np.float32)


class DenseRetriever:
    """Exact inner-product search of `encoder`'s query embeddings over the passages' embeddings."""

    def __init__(self, passages: list[str], embeddings_path: str, encoder: DenseEncoder, query_prefix: str = "query: "):
        embeddings = np.load(embeddings_path)
        if embeddings.ndim != 2 or embeddings.shape[0] != len(passages):
            raise ValueError(f"--dense-embeddings {embeddings_path}: shape {embeddings.shape}, expected "
                             f"[{len(passages)} passages, dim]")
        self.passages, self.encoder, self.query_prefix = passages, encoder, query_prefix
        self.embeddings = embeddings.astype(np.float32)

    def scored(self, query: str, k: int) -> list[tuple[int, float]]:
        """(passage index, score) of the `k` best passages, best first; equal scores by index."""
        scores = self.embeddings @ self.encoder.encode([self.query_prefix + query])[0]
        order = np.lexsort((np.arange(len(scores)), -scores))[:k]
        return [(int(i), float(scores[i])) for i in order]


def write_embeddings(passages: list[str], encoder: DenseEncoder, path: str, passage_prefix: str = "passage: ") -> None:
    """The passages' embeddings, as DenseRetriever reads them."""
    np.save(path, encoder.encode([passage_prefix + p for p in passages]))
