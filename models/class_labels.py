"""A classifier's class names, kept in its model dir as ``labels.json`` (written by training on a table,
:mod:`prunus.data.tables`; carried by compress and export, :func:`prunus.models.module_dir.carried_files`), and read
by eval and by the Open Inference Protocol's classification answers. One reader, its format checked."""

from __future__ import annotations

from pathlib import Path

from prunus.artifacts.contained import inside
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import read_json_object

LABELS = "labels.json"
LABELS_FORMAT = "prunus-labels/1"


def read_labels(model_dir: str | Path) -> dict | None:
    """The model dir's ``labels.json`` (its manifest already verified), or None when it has none."""
    path = inside(model_dir, LABELS, fix="re-create the model dir", required=False)
    if path is None:
        return None
    labels = read_json_object(path, fix="re-create the model dir")
    classes = labels.get("classes")
    if labels.get("format") != LABELS_FORMAT or not (classes is None or (
            isinstance(classes, list) and all(isinstance(c, (int, str)) and not isinstance(c, bool) for c in classes))):
        raise PrunusError(f"{path}: not a {LABELS_FORMAT} file of class names; re-create the model dir")
    return labels
