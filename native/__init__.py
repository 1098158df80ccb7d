"""prunus's own CPU decode kernels (AVX2 + FMA + F16C, with AVX-VNNI / AVX-512 / AVX-512 VNNI / AMX linear kernels
chosen from the CPU at load), compiled on first use: :mod:`prunus.native.decoder`;
``python -m prunus.native.check_isa`` checks and times every kernel path the CPU runs."""
