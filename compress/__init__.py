"""prunus.compress: passes (quantize, smoothquant, prune, distill), recipes, the runner and its report."""

from .recipe import PASSES, load_recipe, parse_recipe, shortcut_passes
from .run import QualityDropError, compress

__all__ = ["PASSES", "load_recipe", "parse_recipe", "shortcut_passes", "QualityDropError", "compress"]
