"""Server side of structured outputs: `response_format` and `structured_outputs` -> params, 400s."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from hybridllm.entrypoints.openai.errors import OpenAIError
from hybridllm.sampling_params import SamplingParams
from hybridllm.structured.params import StructuredOutputsParams

# A schema that takes longer than this to compile, queueing included, is refused (the engine
# thread never waits; the compile itself is killed at the manager's compile_timeout_s).
COMPILE_TIMEOUT_S = 30.0


def structured_outputs_of(request: Any) -> StructuredOutputsParams | None:
    """The constraint a chat or completion request asks for, or None; OpenAIError (400)
    naming the field when it is malformed. Both fields at once are refused."""
    response_format = getattr(request, "response_format", None)
    extension = getattr(request, "structured_outputs", None)
    from_format = _from_response_format(response_format)
    if extension is None:
        return from_format
    if from_format is not None:
        raise OpenAIError(
            "give either response_format or structured_outputs, not both",
            param="structured_outputs",
        )
    try:
        return StructuredOutputsParams.from_dict(extension)
    except (TypeError, ValueError) as exc:
        raise OpenAIError(str(exc), param="structured_outputs") from None


def _from_response_format(response_format: Any) -> StructuredOutputsParams | None:
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise OpenAIError("response_format must be an object", param="response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise OpenAIError(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            param="response_format.type",
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise OpenAIError(
            "response_format.json_schema must be an object with a 'schema'",
            param="response_format.json_schema",
        )
    schema = spec.get("schema")
    if schema is None:
        # OpenAI's name for it; some clients send `json_schema.json_schema` (older vLLM docs).
        schema = spec.get("json_schema")
    if not isinstance(schema, dict):
        raise OpenAIError(
            "response_format.json_schema.schema must be a JSON schema object",
            param="response_format.json_schema.schema",
        )
    try:
        return StructuredOutputsParams(json=schema)
    except ValueError as exc:
        raise OpenAIError(
            _rename(str(exc), True), param="response_format.json_schema.schema"
        ) from None


async def compile_structured_outputs(engine: Any, request: Any, params: Any) -> None:
    """Compile the request's grammar off the event loop (cached for the engine): an invalid
    or unsupported one is a 400 before anything is queued, and the engine thread never
    compiles on its step path. A no-op for engines without structured outputs (test doubles)."""
    constraint = getattr(params, "structured_outputs", None)
    manager = getattr(getattr(engine, "engine", None), "structured_output", None)
    if constraint is None or manager is None:
        return
    from_format = getattr(request, "structured_outputs", None) is None
    param = "response_format" if from_format else "structured_outputs"
    if from_format and getattr(request, "response_format", None) is None:
        param = "tools"  # the constraint came from tool_choice (enforce_tool_choice)
    try:
        # The checks are short; the compile is awaited as a future, so waiting compiles hold
        # no thread of the loop's executor (eight of them held all six on a 2-core machine,
        # and a small grammar then waited behind the large ones).
        await asyncio.to_thread(manager.check, constraint)
        compiled = asyncio.wrap_future(manager.compile_async(constraint))
        await asyncio.wait_for(compiled, COMPILE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise OpenAIError(
            f"the {param} grammar did not compile within {COMPILE_TIMEOUT_S:.0f} s", param=param
        ) from None
    except ValueError as exc:
        raise OpenAIError(_rename(str(exc), param == "response_format"), param=param) from None


def enforce_tool_choice(constraint: Any, params: SamplingParams) -> SamplingParams:
    """The `ToolChoiceEnforcer` for tool_choice "required" or a named function: the reply
    must follow the constraint's JSON schema (compiled and checked like any other)."""
    if params.structured_outputs is not None:
        raise OpenAIError(
            "tool_choice 'required' or a named function cannot be combined with "
            "response_format or structured_outputs",
            param="tool_choice",
        )
    try:
        structured = StructuredOutputsParams(json=constraint.reply_schema())
    except ValueError as exc:
        raise OpenAIError(str(exc), param="tools") from None
    return dataclasses.replace(params, structured_outputs=structured)


def _rename(message: str, from_format: bool) -> str:
    if not from_format:
        return message
    return message.replace("structured_outputs.json_object", "response_format").replace(
        "structured_outputs.json", "response_format.json_schema.schema"
    )
