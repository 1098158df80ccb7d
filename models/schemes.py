"""The names of the quantization schemes and granularities a model dir's config.json may hold.

Kept apart from :mod:`prunus.models.quantized` so that the CLI lists them without importing torch.
"""

SCHEMES = ("int8-weight-only", "w8a8-dynamic", "w8a8-static", "fp8-weight-only", "fp8-w8a8", "int4-weight-only")
GRANULARITIES = ("per_tensor", "per_channel", "per_group")
