"""prunus.artifacts: what every stage shares when it reads or writes an artifact.

The one user-error type (:mod:`errors`), atomic writes and stale-temp cleanup (:mod:`atomic`),
the output-never-overwrites-an-input check (:mod:`paths`), names read from an artifact resolved inside
it (:mod:`contained`), bounded validation of files and values from outside (:mod:`validate`,
:mod:`safetensors_header`), the manifest schema
(:mod:`manifest_schema`), the rules of the caches prunus keeps (:mod:`cache_dir`: private dirs, no-follow
lock files, verify-or-rebuild) and the finite-weights check of a cached export (:mod:`finite_weights`); and two
helpers kept here because this is the lowest package all their users may import: process liveness and pid-named temporaries (:mod:`pids`: atomic writes clean a dead writer's
temporaries with it, as the tensor-parallel runtime does its own) and lazy package exports (:mod:`lazy`: the
``__init__`` of every package from ``models`` up). It imports neither torch nor any other prunus package,
so every stage and the CLI's start can use it.
"""
