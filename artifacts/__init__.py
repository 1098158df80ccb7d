"""prunus.artifacts: what every stage shares when it reads or writes an artifact.

The one user-error type (:mod:`errors`), atomic writes and stale-temp cleanup (:mod:`atomic`),
the output-never-overwrites-an-input check (:mod:`paths`), names read from an artifact resolved inside
it (:mod:`contained`), bounded validation of files and values from outside (:mod:`validate`,
:mod:`safetensors_header`), the manifest schema
(:mod:`manifest_schema`), process liveness (:mod:`pids`) and lazy package exports (:mod:`lazy`).
It imports neither torch nor any other prunus package, so every stage and the CLI's start can use it.
"""
