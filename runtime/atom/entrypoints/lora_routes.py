"""Multi-LoRA on the OpenAI surface: adapters as models, and vLLM's load/unload endpoints.

- A request whose `model` is a loaded adapter's name runs under that adapter (`served_model`);
- /v1/models lists each adapter with `parent` = the base model (`adapter_cards`);
- POST /v1/load_lora_adapter {"lora_name", "lora_path"} and POST /v1/unload_lora_adapter
  {"lora_name"}, vLLM's shapes and answers. They read a path on the server's filesystem, so
  they are only served when the server has an API key (they sit under /v1/, behind it).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from atom.entrypoints.state import ServerState
from atom.wire import errors as codes
from atom.wire.api_error import APIError
from atom.wire.body import loads_object, read_body

MAX_BODY = 64 * 1024
LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"


def served_model(state: ServerState, body: dict[str, Any]) -> tuple[str, str | None]:
    """The model name the request is checked against, and its adapter (None: the base
    model): a loaded adapter's name selects it."""
    model, adapters = body.get("model"), state.engine.lora_adapters
    if isinstance(model, str) and adapters and model in adapters:
        return model, model
    return state.served_model_name, None


def adapter_cards(state: ServerState) -> list[dict[str, Any]]:
    """/v1/models entries of the loaded adapters (vLLM's: root = the adapter's directory,
    parent = the base model)."""
    return [{"id": name, "object": "model", "created": int(state.started), "owned_by": "atom",
             "root": path, "parent": state.served_model_name}
            for name, path in sorted((state.engine.lora_adapters or {}).items())]


def _field(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{name} must be a non-empty string", param=name,
                       code=codes.INVALID_REQUEST)
    return value


async def _change(state: ServerState, request: web.Request, load: bool) -> web.Response:
    if not state.api_key:
        raise APIError(403, "loading LoRA adapters at runtime needs an API key (--api-key): "
                            "the request names a path on the server", code="lora_forbidden")
    body = loads_object(await read_body(request, MAX_BODY))
    name = _field(body, "lora_name")
    path = _field(body, "lora_path") if load else ""
    if load and name == state.served_model_name:
        raise APIError(400, f"{name!r} is the base model's name", param="lora_name",
                       code=codes.INVALID_REQUEST)
    reply = await state.engine.change_lora(load, name, path)
    if reply.status != 200:
        raise APIError(reply.status, reply.message, param="lora_name",
                       code=reply.code or codes.INVALID_REQUEST)
    verb = "added" if load else "removed"
    return web.Response(text=f"Success: LoRA adapter '{name}' {verb} successfully.")


def add_lora_routes(app: web.Application, key: web.AppKey[ServerState]) -> None:
    """The two endpoints, reading the server's state under `key` (server.STATE_KEY)."""

    async def load(request: web.Request) -> web.Response:
        return await _change(request.app[key], request, True)

    async def unload(request: web.Request) -> web.Response:
        return await _change(request.app[key], request, False)

    app.router.add_post(LOAD_PATH, load)
    app.router.add_post(UNLOAD_PATH, unload)
