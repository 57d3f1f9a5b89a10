"""Pydantic models of the OpenAI API requests and responses we serve, and request -> SamplingParams."""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, model_serializer

from hybridllm.entrypoints.openai.errors import OpenAIError, from_value_error
from hybridllm.entrypoints.openai.structured_outputs import structured_outputs_of
from hybridllm.json_limits import check_value_depth
from hybridllm.sampling_params import SamplingParams

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs; also bounds the completions `logprobs`
MAX_N = 128  # more samples than this per request is a mistake, not a workload


# Token ids are JSON integers: pydantic's lax mode would also take 1.0, true and "1" as ids.
TokenIds = list[StrictInt]
# A logit_bias key: a token id in decimal (int() alone would take " 1", "+1", "1_0" and other
# scripts' digits); 100 digits keep int() far from its 4300-digit limit.
_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,99}")
# A free-form JSON object from the client (schemas, template kwargs): the code that walks it
# (schema compilers, json.dumps, templates) recurses per level, so its depth is bounded here.
JSONObject = Annotated[dict[str, Any], AfterValidator(check_value_depth)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    # Unknown fields are ignored: clients (LangChain, the openai SDK's newer versions) send extras.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingRequest(OpenAIBaseModel):
    """The sampling fields completions and chat share, OpenAI's and our extensions."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions (vLLM names): not in OpenAI's API, accepted through `extra_body`.
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: TokenIds | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured outputs (entrypoints/openai/structured_outputs.py): OpenAI's response_format
    # ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}) and
    # vLLM's extension {"json" | "regex" | "choice" | "grammar": ...}.
    response_format: JSONObject | None = None
    structured_outputs: JSONObject | None = None

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        vocab_size: int,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        n = 1 if self.n is None else self.n
        if not 1 <= n <= MAX_N:
            raise OpenAIError(f"n must be in [1, {MAX_N}], got {n}", param="n")
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise OpenAIError(
                f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}", param="logprobs"
            )
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(
                "stream_options is only allowed when stream is true", param="stream_options"
            )
        structured = structured_outputs_of(self)  # OpenAIError (400) naming the field
        try:
            return SamplingParams(
                n=n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                min_p=self.min_p,
                seed=self.seed,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=self.repetition_penalty,
                stop=self.stop or [],
                stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logit_bias=self._token_logit_bias(vocab_size),
                structured_outputs=structured,
            )
        except ValueError as exc:
            raise from_value_error(exc) from exc

    def _token_logit_bias(self, vocab_size: int) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            if not _TOKEN_ID_KEY.fullmatch(key):
                shown = key if len(key) <= 40 else key[:40] + "..."
                raise OpenAIError(
                    f"logit_bias keys must be token ids in decimal, got {shown!r}",
                    param="logit_bias",
                )
            token_id = int(key)
            if not 0 <= token_id < vocab_size:
                raise OpenAIError(
                    f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})",
                    param="logit_bias",
                )
            if not -100.0 <= value <= 100.0:
                raise OpenAIError(
                    f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias"
                )
            bias[token_id] = float(value)
        return bias

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: TokenIds | list[TokenIds] | str | list[str]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def to_sampling_params(self, max_tokens: int | None, vocab_size: int) -> SamplingParams:
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise OpenAIError("best_of must equal n (no server-side ranking)", param="best_of")
        if self.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self._sampling_params(max_tokens, self.logprobs, vocab_size, prompt_logprobs)


class ChatContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


# OpenAI's rule for function names (letters, digits, underscores, dashes; at most 64).
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MAX_TOOLS = 128  # far more than any model follows; a bound on template work per request


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: JSONObject | None = None  # a JSON Schema of the arguments object
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: JSONObject | None = None
    # A Jinja template replacing the model's (vLLM's extension); refused with a 400 unless the
    # server runs with --trust-request-chat-template, and sandboxed even then.
    chat_template: str | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    def tool_choice_mode(self) -> str:
        """ "none", "auto", "required" or "named", after checking tools and tool_choice agree."""
        tools = self.tools or []
        if len(tools) > MAX_TOOLS:
            raise OpenAIError(f"at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
        names = [tool.function.name for tool in tools]
        if len(set(names)) != len(names):
            raise OpenAIError("tool function names must be unique", param="tools")
        for tool in tools:
            schema = tool.function.parameters
            if schema is not None and schema.get("type", "object") != "object":
                raise OpenAIError(
                    f"tool '{tool.function.name}': parameters must be a JSON Schema of type object",
                    param="tools",
                )
        choice = self.tool_choice
        if choice is None:  # OpenAI's default: auto when tools are offered
            return "auto" if tools else "none"
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise OpenAIError(
                    f"tool_choice names the function '{choice.function.name}', which is not "
                    "in tools",
                    param="tool_choice",
                )
            return "named"
        if choice != "none" and not tools:
            raise OpenAIError(f"tool_choice '{choice}' needs tools", param="tool_choice")
        return choice

    @property
    def requested_max_tokens(self) -> int | None:
        # OpenAI deprecated max_tokens for max_completion_tokens; the newer one wins.
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def to_sampling_params(self, max_tokens: int | None, vocab_size: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError("top_logprobs needs logprobs set to true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise OpenAIError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
                param="top_logprobs",
            )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, vocab_size)


class EmbeddingRequest(OpenAIBaseModel):
    model: str | None = None
    input: TokenIds | list[TokenIds] | str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


# ---- responses ----


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int | None = 0
    total_tokens: int = 0


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser (vLLM's field)
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class _DeltaModel(OpenAIBaseModel):
    """Streamed deltas leave out what they do not set: the openai client's accumulator merges
    every key it sees, and a null `type` in a later tool-call piece would overwrite the first."""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(_DeltaModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_DeltaModel):
    """A piece of tool call `index`: id, type and name in its first piece only."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(_DeltaModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class EmbeddingData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(OpenAIBaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "hybridllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- /tokenize and /detokenize (vLLM's shapes) ----


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template already has them
    return_token_strs: bool = False
    chat_template: str | None = None
    chat_template_kwargs: JSONObject | None = None
    tools: list[ChatTool] | None = None


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: TokenIds


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
