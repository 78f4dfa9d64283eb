"""The guide's package of the model runner (model_runner re-exports atom.engine.model_runner)."""
