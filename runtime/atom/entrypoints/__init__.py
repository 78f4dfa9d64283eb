"""The OpenAI-compatible HTTP server (aiohttp) around atom.engine.LLMEngine."""
