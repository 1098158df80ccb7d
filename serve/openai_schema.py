"""pydantic models of the OpenAI requests prunus serves: ``/v1/completions`` and ``/v1/chat/completions``.

Strict (a string is not a number, ``1`` is not ``true``) and closed: a field not listed here is refused with
400 naming it (:mod:`prunus.serve.openai_errors`), never silently dropped. ``top_k``, ``repetition_penalty``,
``min_tokens``, ``stop_token_ids``, ``guided_json`` and ``guided_regex`` are extensions
(vLLM's names). What each field does is in
docs/serving.md; a field left out takes the model's ``generation_config.json`` default where it has one
(:mod:`prunus.serve.sampling_defaults`), else OpenAI's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


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

    model: str | None = Field(None, description="One of the names GET /v1/models lists; 404 otherwise.")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = None
    top_k: int | None = Field(None, ge=0, description="Extension: sample among the k likeliest tokens (0: all).")
    seed: int | None = Field(None, description="Choice i of n samples with seed + i.")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=64, description="Extension: more tokens that end it.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    user: str | None = Field(None, description="An end-user id: accepted, not used.")
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=100, description="Extension: transformers' penalty.")
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) -> bias from -100 to 100.")
    min_tokens: int = Field(0, ge=0, description="Extension: the stop tokens are barred until this many are made.")
    response_format: ResponseFormat | None = Field(None, description="JSON (any, or of a schema), token by token.")
    guided_json: dict[str, Any] | str | None = Field(None, description="Extension: the answer follows this schema.")
    guided_regex: str | None = Field(None, description="Extension: the answer matches this regular expression.")


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, description="Only equal to n (or left out).")
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
