"""Old package of the model runner, kept for the guide's import paths: atom.engine holds it now."""
