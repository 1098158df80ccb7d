"""prunus.models: architectures, tokenizers, the model-dir format, generation, Hugging Face conversion."""

from .config import PRESETS, ModelConfig, get_preset
from .errors import PrunusError
from .generate import generate, sample_next, stream_tokens
from .kv_cache import KVCache
from .llama import Transformer
from .model_dir import load_model, load_model_tokenizer, read_manifest, save_model, update_manifest_metrics, verify_model_dir
from .tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "PRESETS", "ModelConfig", "get_preset", "PrunusError", "generate", "sample_next", "stream_tokens",
    "KVCache", "Transformer", "load_model", "load_model_tokenizer", "read_manifest", "save_model",
    "update_manifest_metrics", "verify_model_dir", "ByteTokenizer", "HFTokenizer", "load_tokenizer",
]
