"""prunus.data: corpora (the built-in one included), deterministic batches, prefetch, evaluation."""

from .batches import eval_batches, get_batch, step_offsets
from .corpus import BUILTIN, Corpus, load_corpus
from .evaluate import evaluate, evaluate_model_dir, unigram_bits_per_byte
from .prefetch import Prefetcher

__all__ = ["eval_batches", "get_batch", "step_offsets", "BUILTIN", "Corpus", "load_corpus", "evaluate",
           "evaluate_model_dir", "unigram_bits_per_byte", "Prefetcher"]
