"""prunus's own CPU decode kernels (AVX2 + FMA), compiled on first use: :mod:`prunus.native.decoder`."""
