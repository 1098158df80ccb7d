"""pydantic models of the OpenAI requests prunus serves: ``/v1/completions`` and ``/v1/chat/completions``.

Strict (a string is not a number, ``1`` is not ``true``) and closed: a field not listed here is refused with
400 naming it (:mod:`prunus.serve.openai_errors`), never silently dropped. ``model`` is required, as OpenAI's
API requires it. Every number lies in OpenAI's documented range (``temperature`` 0 to 2, ``top_p`` in (0, 1],
the penalties -2 to 2, ``logit_bias`` -100 to 100, ``top_logprobs`` 0 to 20, ``seed`` a 64-bit integer);
``top_k``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``guided_json`` and ``guided_regex`` are
extensions (vLLM's names and ranges, ``repetition_penalty`` from 0.01). Chat also takes the fields OpenAI's
clients may send by default (``store``, ``metadata``, ``service_tier``, ...) where their value asks for nothing
prunus cannot do (:data:`SDK_FIELDS`; the rest are one 400 each, :mod:`prunus.serve.chat_api`). What each
field does is in docs/serving.md; a field left out takes the model's ``generation_config.json`` default where it
has one (:mod:`prunus.serve.sampling_defaults`), else OpenAI's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .logits_processors import REPETITION_PENALTY

MAX_N = 16
MAX_NAME = 256
OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: Literal[False] | None = Field(None, description="Only false: prunus pads no chunk.")


class JsonSchemaFormat(Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="A JSON schema; left out: any JSON.")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Sampling(Strict):
    """The fields both endpoints take."""

    model: str = Field(min_length=1, max_length=MAX_NAME,
                       description="One of the names GET /v1/models lists; 404 otherwise.")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="Extension: sample among the k likeliest tokens (0 or -1: "
                                                        "all).")
    seed: int | None = Field(None, ge=-(2**63), lt=2**64, description="Choice i of n samples with seed + i.")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=64, description="Extension: more tokens that end it.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    user: str | None = Field(None, description="An end-user id: accepted, not used.")
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY[0], le=REPETITION_PENALTY[1],
                                             description="Extension: transformers' penalty, 0.01 to 100.")
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) -> bias from -100 to 100.")
    min_tokens: int = Field(0, ge=0, description="Extension: the stop tokens are barred until this many are made.")
    response_format: ResponseFormat | None = Field(None, description="JSON (any, or of a schema), token by token.")
    guided_json: dict[str, Any] | str | None = Field(None, description="Extension: the answer follows this schema.")
    guided_regex: str | None = Field(None, description="Extension: the answer matches this regular expression.")


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="Only equal to n (or left out).")
    suffix: str | None = Field(None, description="Not supported: only null.")


class ChatCompletionRequest(Sampling):
    messages: list[dict[str, Any]] = Field(description="Rendered with the model's chat template.")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = Field(None, description="Functions the model may call (through its chat "
                                                                 "template's tools).")
    tool_choice: str | dict[str, Any] | None = Field(None, description='"none", "auto", "required" or a function.')
    parallel_tool_calls: bool | None = Field(None, description="false: the answer's first tool call only; "
                                                 "otherwise every call it holds.")

    # What OpenAI's clients may send: accepted where the value asks for nothing prunus cannot do (SDK_FIELDS).
    store: bool | None = Field(None, description="Only false: prunus stores no completions.")
    metadata: dict[str, str] | None = Field(None, max_length=16, description="Tags (up to 16): accepted, not used.")
    service_tier: str | None = Field(None, max_length=32, description='Only "auto" or "default".')
    safety_identifier: str | None = Field(None, max_length=MAX_NAME, description="An end-user id: accepted, not "
                                                                                  "used.")
    prompt_cache_key: str | None = Field(None, max_length=MAX_NAME, description="Accepted; prunus's prefix "
                                                                                 "cache needs no key.")
    prompt_cache_retention: str | None = Field(None, max_length=32, description='Only "in_memory".')
    modalities: list[str] | None = Field(None, max_length=4, description='Only ["text"].')
    verbosity: str | None = Field(None, max_length=32, description='Only "medium" (OpenAI\'s default).')
    reasoning_effort: Any = Field(None, description="Not supported: only null.")
    audio: Any = Field(None, description="Not supported: only null.")
    prediction: Any = Field(None, description="Not supported: only null.")
    web_search_options: Any = Field(None, description="Not supported: only null.")
    moderation: Any = Field(None, description="Not supported: only null.")
    prompt_cache_options: Any = Field(None, description="Not supported: only null.")
    functions: Any = Field(None, description="Deprecated by OpenAI: give 'tools'. Only null.")
    function_call: Any = Field(None, description="Deprecated by OpenAI: give 'tool_choice'. Only null.")


# field -> (the values prunus takes besides null, what to do otherwise)
SDK_FIELDS: dict[str, tuple[tuple, str]] = {
    "store": ((False,), "prunus stores no completions; give false or leave it out"),
    "service_tier": (("auto", "default"), "prunus has one tier; give \"auto\" or \"default\" or leave it out"),
    "prompt_cache_retention": (("in_memory",), "prunus's prefix cache lives in memory; give \"in_memory\" or "
                                               "leave it out"),
    "modalities": ((["text"],), "prunus answers in text only; give [\"text\"] or leave it out"),
    "verbosity": (("medium",), "prunus cannot steer verbosity; leave it out"),
    "reasoning_effort": ((), "prunus cannot steer reasoning effort; leave it out"),
    "audio": ((), "prunus answers in text only; leave it out"),
    "prediction": ((), "predicted outputs are not supported; leave it out"),
    "web_search_options": ((), "prunus does not search the web; leave it out"),
    "moderation": ((), "prunus does not moderate; leave it out"),
    "prompt_cache_options": ((), "prunus's prefix cache takes no options; leave it out"),
    "functions": ((), "give 'tools' instead (OpenAI deprecated 'functions')"),
    "function_call": ((), "give 'tool_choice' instead (OpenAI deprecated 'function_call')"),
}
