"""prunus.models: architectures, tokenizers, the model-dir format, generation, Hugging Face conversion.

Public names are imported from their submodules on first use (:mod:`prunus.artifacts.lazy`), so that
``import prunus.models.config`` or ``prunus --help`` does not import torch.
"""

from prunus.artifacts.lazy import lazy_package

_EXPORTS = {
    "PRESETS": "config", "ModelConfig": "config", "get_preset": "config", "PrunusError": "prunus.artifacts.errors",
    "generate": "generate", "sample_next": "generate", "stream_tokens": "generate", "KVCache": "kv_cache",
    "Transformer": "llama", "load_model": "model_dir", "load_model_tokenizer": "model_dir",
    "read_manifest": "model_dir", "save_model": "model_dir", "update_manifest_metrics": "model_dir",
    "verify_model_dir": "model_dir", "ByteTokenizer": "tokenizer", "HFTokenizer": "tokenizer",
    "load_tokenizer": "tokenizer", "ModuleFactory": "module_factory", "build_module": "module_factory",
    "load_module": "module_dir", "save_module": "module_dir", "get_task": "tasks", "TASKS": "tasks",
}
__all__ = list(_EXPORTS)
lazy_package(__name__, _EXPORTS)
