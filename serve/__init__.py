"""prunus.serve: this stage's API lands with its issue; nothing is exported yet."""
