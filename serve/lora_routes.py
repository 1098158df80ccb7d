"""LoRA adapters on the OpenAI-compatible server (:mod:`prunus.runtime.lora_adapters`).

* a request's ``model`` may name a loaded adapter (``prunus serve --lora NAME=DIR``): its rows run with it;
  ``GET /v1/models`` lists each adapter with ``parent`` (and ``root``) the base's served name;
* ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter``
  ``{"lora_name"}`` (vLLM's names) change the set while serving. Both are refused (403) unless the server was
  started with an API key (``--api-key`` / ``PRUNUS_API_KEY``), and then need it like every route. An unloaded
  adapter takes no new request at once; requests already running with it finish with it (its weights are freed
  after the last of them).
"""

from __future__ import annotations

import asyncio

from pydantic import Field

from .http_guard import BadRequest
from .openai_schema import Strict

LOAD_PATH, UNLOAD_PATH = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
ROUTES = (LOAD_PATH, UNLOAD_PATH)


class LoadAdapter(Strict):
    lora_name: str = Field(description="The name requests give as 'model'.")
    lora_path: str = Field(description="A PEFT LoRA adapter dir on the server's disk, trained on the served base.")


class UnloadAdapter(Strict):
    lora_name: str = Field(description="A loaded adapter's name.")


def adapter_for(server, name: str | None) -> str | None:
    """The adapter a request's ``model`` names, or None (the base)."""
    return name if name is not None and name in server.engine.adapter_names() else None


def adapter_cards(server) -> list[dict]:
    base = server.model_names[0]
    return [{"id": name, "object": "model", "created": server.started, "owned_by": "prunus", "root": base,
             "parent": base, "max_model_len": server.engine.max_len} for name in server.engine.adapter_names()]


def _admin(server, name: str) -> None:
    if server.access.api_key is None:
        raise BadRequest(403, "loading and unloading LoRA adapters is refused on a server without an API key; start "
                              "prunus serve with --api-key (or PRUNUS_API_KEY) to allow it", code="forbidden")
    if name in server.model_names:
        raise BadRequest(400, f"{name[:60]!r} is the base model's served name; give the adapter another name",
                         param="lora_name")


def install(app, server) -> None:
    @app.post(LOAD_PATH)
    async def load_lora_adapter(body: LoadAdapter):
        _admin(server, body.lora_name)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(server.pool, server.engine.load_adapter, body.lora_name, body.lora_path)
        return {"object": "lora_adapter", "id": body.lora_name, "status": "loaded"}

    @app.post(UNLOAD_PATH)
    async def unload_lora_adapter(body: UnloadAdapter):
        _admin(server, body.lora_name)
        if body.lora_name not in server.engine.adapter_names():
            raise BadRequest(404, f"no adapter named {body.lora_name[:60]!r} is loaded; loaded: "
                                  f"{', '.join(server.engine.adapter_names()) or 'none'}", param="lora_name",
                             code="model_not_found")
        server.engine.unload_adapter(body.lora_name)
        return {"object": "lora_adapter", "id": body.lora_name, "status": "unloaded"}
