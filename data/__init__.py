"""prunus.data: corpora (the built-in one included), deterministic batches, prefetch, evaluation."""

from .batches import eval_batches, get_batch, step_offsets
from .corpus import BUILTIN, Corpus, default_data, load_corpus
from .evaluate import DEFAULT_EVAL_TOKENS, default_seq_len, evaluate, unigram_bits_per_byte
from .evaluate_model_dir import evaluate_model_dir
from .prose import PROSE
from .prefetch import Prefetcher

__all__ = ["eval_batches", "get_batch", "step_offsets", "BUILTIN", "PROSE", "Corpus", "default_data", "load_corpus",
           "DEFAULT_EVAL_TOKENS", "default_seq_len", "evaluate", "evaluate_model_dir", "unigram_bits_per_byte", "Prefetcher"]
