"""prunus.cli: the click commands. Parsing and rendering only; the work is in the Python API."""
