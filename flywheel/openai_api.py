"""Request and error shapes of the OpenAI-compatible API (responses reuse the openai SDK's own types): pydantic only,
so that the server, the gateway, the graders and the fine-tuning API share them without importing each other."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends a JSON string; an object is taken as it is


class ToolCall(BaseModel):
    """A tool call of an earlier assistant turn."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, refusal, audio... are accepted and ignored

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        for i, part in enumerate(content if isinstance(content, list) else []):
            if part.get("type") != "text":
                raise ValueError(f"content part {i} has type {part.get('type')!r}: only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i} is a text part without a string 'text'")
        return content

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a '{self.role}' message needs 'content'")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a 'tool' message needs 'tool_call_id'")
        return self


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # the output is constrained to the schema either way


class TextFormat(BaseModel):
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    type: Literal["json_object"]


class JsonSchemaFormat(BaseModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class ToolChoiceFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: the reply calls this tool."""

    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# Sampling parameters (OpenAI's and vLLM's) that the engine does not implement, each with the values that ask for
# nothing. Any other value is refused, naming the parameter: ignored, it would have the reply drawn otherwise than
# asked and recorded as drawn as asked (the log-probs training relies on would be of another distribution).
UNIMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "logit_bias": (None, {}),
    "top_k": (None, 0, -1),
    "min_p": (None, 0),
    "typical_p": (None, 1),
    "min_tokens": (None, 0),
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    "stop_token_ids": (None, []),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "logits_processors": (None, []),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
}


class ChatCompletionRequest(BaseModel):
    # Other parameters (user, metadata, store, ...) are accepted and ignored so that any client works; those that
    # would change how the reply is sampled are refused unless neutral (UNIMPLEMENTED).
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto"
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=128)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # a 64-bit generator seed (choice i: seed + i)
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM-style extension, for fixed-length benchmark work
    response_format: ResponseFormat | None = None
    guided_choice: list[str] | None = None  # vLLM's extension: the reply is exactly one of these strings

    @model_validator(mode="before")
    @classmethod
    def _implemented(cls, data: Any) -> Any:
        """A sampling parameter the engine does not implement, at a value that asks for something: a 400 at it."""
        for name, neutral in UNIMPLEMENTED.items():
            if isinstance(data, dict) and not any(data.get(name) == value for value in neutral):
                shown = " or ".join("null" if v is None else repr(v) for v in neutral)
                error = PydanticCustomError(
                    "unsupported_parameter",
                    "'{name}' is not implemented by this server's engine (only {shown}, which asks for nothing, is "
                    "accepted): leave it out, or ask a server that implements it",
                    {"name": name, "shown": shown},
                )
                detail = InitErrorDetails(type=error, loc=(name,), input=data[name])
                raise ValidationError.from_exception_data(cls.__name__, [detail])
        return data

    @field_validator("tools")
    @classmethod
    def _tools_shape(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(tools or []):
            fn = tool.get("function")
            if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, choice: Any) -> Any:
        fn = choice.get("function") if isinstance(choice, dict) else None
        named = isinstance(fn, dict) and choice.get("type") == "function" and isinstance(fn.get("name"), str)
        if choice is None or choice in ("none", "auto", "required") or named:
            return choice
        raise ValueError(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
        )

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_offered(cls, choice: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        if choice in (None, "none", "auto") or "tools" not in info.data:  # invalid tools are reported already
            return choice
        names = [tool["function"]["name"] for tool in info.data["tools"] or []]
        if not names:
            raise ValueError("tool_choice other than 'none' or 'auto' needs 'tools'")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"tool_choice.function.name {choice.function.name!r} is not one of the tools: {', '.join(names)}"
            )
        return choice

    @field_validator("guided_choice", mode="before")
    @classmethod
    def _choices_shape(cls, choices: Any) -> Any:
        if choices is None:
            return None
        if not isinstance(choices, list) or not choices:
            raise ValueError(f"guided_choice must be a non-empty list of strings, not {choices!r}")
        for i, choice in enumerate(choices):
            if not isinstance(choice, str):
                raise ValueError(f"guided_choice[{i}] is {choice!r}: every choice must be a string")
        return choices

    @field_validator("guided_choice")
    @classmethod
    def _one_guide(cls, choices: list[str] | None, info: ValidationInfo) -> list[str] | None:
        """A reply follows one grammar: the choices, a forced tool call or a response_format, never two."""
        if choices is None:
            return None
        if info.data.get("tools") and info.data.get("tool_choice") != "none":
            raise ValueError("guided_choice cannot be combined with tools (unless tool_choice is 'none')")
        if not isinstance(info.data.get("response_format"), TextFormat | None):
            raise ValueError("guided_choice cannot be combined with a JSON response_format")
        return choices

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, stop: Any) -> Any:
        if stop is None or isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            return stop
        raise ValueError("stop must be a string or a list of strings")

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, top_logprobs: int, info: ValidationInfo) -> int:
        if top_logprobs and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs 'logprobs': true")
        return top_logprobs

    @property
    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt lists: none with tool_choice "none"."""
        return None if self.tool_choice == "none" else self.tools

    @property
    def forced_tools(self) -> list[dict[str, Any]] | None:
        """The tools of which the reply must call one ("required": any, a named function: that one), else None."""
        if self.tool_choice == "required":
            return self.tools
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in self.tools or [] if t["function"]["name"] == self.tool_choice.function.name]
        return None

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
