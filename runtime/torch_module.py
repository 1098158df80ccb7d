"""A generic model dir (any ``nn.Module``, :mod:`prunus.models.module_dir`) served in this process by torch:
``predict(batch)`` under ``inference_mode``. Its factory is imported only when ``trust_factory`` trusts it."""

from __future__ import annotations

import numpy as np
import torch

from prunus.models.model_dir import verify_model_dir
from prunus.models.module_dir import load_module

from .predict_backend import PredictBackend, check_predict_options
from .registry import Loaded


class TorchModuleBackend(PredictBackend):
    name = "torch"

    def __init__(self, path, config: dict, options):
        self.device = torch.device(options.device)
        self.module = load_module(path, config, trust_factory=options.trust_factory or False,
                                  device=self.device)
        super().__init__(path, config, options.max_batch)

    def _forward(self, batch: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            out = self.module(torch.from_numpy(batch).to(self.device))
        return out.detach().cpu().numpy()


def load(path, config: dict, options) -> Loaded:
    check_predict_options(path, options)
    verify_model_dir(path)  # every file against the manifest before the factory is imported
    backend = TorchModuleBackend(path, config, options)
    return Loaded(backend, None, {"task": config.get("task"), "factory": config.get("factory")})
