"""Grader specifications: the JSON of OpenAI's reinforcement fine-tuning graders, field for field, validated.

``load_grader("grader.json")`` (or ``.yaml``) and ``parse_grader(dict)`` return a ``Grader``; anything wrong
raises ``GraderSpecError`` listing every problem at its JSON path (``graders.name.operation: ...``), including
what can be checked before any data is seen: template syntax and namespaces, formula syntax and names,
python source syntax and its ``grade`` function, label subsets, score ranges.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from flywheel.graders.formula import FUNCTIONS, FormulaError, parse_formula
from flywheel.graders.templates import check_template

T = TypeVar("T")

SimilarityMetric = Literal[
    "cosine", "fuzzy_match", "bleu", "gleu", "meteor", "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l"
]


class _Spec(BaseModel):
    # Unknown fields are errors: a misspelt "refrence" must not silently grade against nothing.
    model_config = ConfigDict(extra="forbid")

    name: str


class _InputAndReference(_Spec):
    input: str
    reference: str

    @field_validator("input", "reference")
    @classmethod
    def _templates(cls, template: str) -> str:
        return check_template(template)


class StringCheckGrader(_InputAndReference):
    """1.0 if the check holds, else 0.0. ``like``: input contains reference; ``ilike``: the same, ignoring case."""

    type: Literal["string_check"]
    operation: Literal["eq", "ne", "like", "ilike"]


class TextSimilarityGrader(_InputAndReference):
    """A similarity score between input and reference (see flywheel/graders/similarity.py)."""

    type: Literal["text_similarity"]
    evaluation_metric: SimilarityMetric
    pass_threshold: float | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["input_text", "output_text"]
    text: str

    @field_validator("text")
    @classmethod
    def _template(cls, template: str) -> str:
        return check_template(template)


def _kind_of_content(value: Any) -> str:
    # Tells pydantic which member of the union to validate against, so an error is reported once, for that member.
    return "text" if isinstance(value, str) else "parts" if isinstance(value, list) else "part"


_Part = Annotated[Annotated[str, Tag("text")] | Annotated[TextPart, Tag("part")], Discriminator(_kind_of_content)]
_Content = Annotated[
    Annotated[str, Tag("text")] | Annotated[TextPart, Tag("part")] | Annotated[list[_Part], Tag("parts")],
    Discriminator(_kind_of_content),
]


class InputMessage(BaseModel):
    """One message of a model grader's prompt; text content may hold templates (images and audio are not
    supported: a local judge is text-only)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant", "system", "developer"]
    content: _Content
    type: Literal["message"] | None = None

    @field_validator("content")
    @classmethod
    def _content_templates(cls, content: Any) -> Any:
        for part in content if isinstance(content, list) else [content]:
            if isinstance(part, str):
                check_template(part)
        return content

    def template(self) -> str:
        """The content as one text template (parts joined by newlines)."""
        parts = self.content if isinstance(self.content, list) else [self.content]
        return "\n".join(part if isinstance(part, str) else part.text for part in parts)


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    max_completions_tokens: int | None = Field(None, ge=1)
    reasoning_effort: str | None = None


class ScoreModelGrader(_Spec):
    """A judge model reads ``input`` and answers ``{"result": number, "steps": [...]}``; the score is the result,
    clamped to ``range``."""

    type: Literal["score_model"]
    model: str
    input: list[InputMessage] = Field(min_length=1)
    range: tuple[float, float] = (0.0, 1.0)
    sampling_params: SamplingParams | None = None
    pass_threshold: float | None = None

    @field_validator("range")
    @classmethod
    def _range_is_increasing(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not value[0] < value[1]:
            raise ValueError(f"range must be [low, high] with low < high, got {list(value)}")
        return value


class LabelModelGrader(_Spec):
    """A judge model picks one of ``labels``; the score is 1.0 if it is one of ``passing_labels``, else 0.0."""

    type: Literal["label_model"]
    model: str
    input: list[InputMessage] = Field(min_length=1)
    labels: list[str] = Field(min_length=1)
    passing_labels: list[str] = Field(min_length=1)

    @field_validator("passing_labels")
    @classmethod
    def _passing_labels_are_labels(cls, passing: list[str], info: ValidationInfo) -> list[str]:
        labels = info.data.get("labels", [])
        unknown = [label for label in passing if label not in labels]
        if labels and unknown:
            raise ValueError(f"{unknown} are not among labels {labels}")
        return passing


class PythonGrader(_Spec):
    """``source`` defines ``grade(sample, item) -> float``; it runs in a sandboxed process
    (flywheel/graders/sandbox.py). ``image_tag`` is accepted for compatibility and ignored: the grader runs on
    this machine's Python, with the packages installed here."""

    type: Literal["python"]
    source: str
    image_tag: str | None = None

    @field_validator("source")
    @classmethod
    def _defines_grade(cls, source: str) -> str:
        try:
            module = ast.parse(source)
        except SyntaxError as exc:
            raise ValueError(f"python syntax error at line {exc.lineno}: {exc.msg}") from None
        if not any(isinstance(node, ast.FunctionDef) and node.name == "grade" for node in module.body):
            raise ValueError("the source must define a top-level function grade(sample, item)")
        return source


class MultiGrader(_Spec):
    """Runs every grader in ``graders`` and combines their scores with ``calculate_output``, a formula over
    their keys (flywheel/graders/formula.py)."""

    type: Literal["multi"]
    graders: dict[str, Grader] = Field(min_length=1)
    calculate_output: str

    @field_validator("graders")
    @classmethod
    def _keys_are_names(cls, graders: dict[str, Any]) -> dict[str, Any]:
        for key in graders:
            if not key.isidentifier() or key in FUNCTIONS:
                raise ValueError(f"key {key!r} cannot be used in calculate_output: use a name like 'accuracy'")
        return graders

    @field_validator("calculate_output")
    @classmethod
    def _formula_parses(cls, formula: str, info: ValidationInfo) -> str:
        try:
            parse_formula(formula, info.data.get("graders"))  # names unchecked if the graders were invalid
        except FormulaError as exc:
            raise ValueError(str(exc)) from None
        return formula


Grader = Annotated[
    StringCheckGrader | TextSimilarityGrader | ScoreModelGrader | LabelModelGrader | PythonGrader | MultiGrader,
    Field(discriminator="type"),
]
MultiGrader.model_rebuild()
_GRADER: TypeAdapter[Grader] = TypeAdapter(Grader)


class GraderSpecError(ValueError):
    """A grader specification is invalid; ``problems`` are ``(json path, message)`` pairs."""

    def __init__(self, problems: list[tuple[str, str]], source: str = "grader") -> None:
        self.problems = problems
        lines = "\n".join(f"  {path}: {message}" for path, message in problems)
        super().__init__(f"{source}: invalid grader ({len(problems)} problem{'s' * (len(problems) != 1)}):\n{lines}")


def _json_path(loc: tuple[int | str, ...], data: Any, missing: bool) -> str:
    """Pydantic's error location as a JSON path into ``data``, leaving out the union-member labels pydantic adds
    (``graders.a.string_check.operation`` -> ``graders.a.operation``)."""
    path: list[int | str] = []
    node = data
    for i, key in enumerate(loc):
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            node = node[key]
        elif not (missing and i == len(loc) - 1):  # a union member's label, not a place in the data
            continue
        path.append(key)
    text = "".join(f"[{key}]" if isinstance(key, int) else f".{key}" for key in path).lstrip(".")
    return text or "(root)"


def validate_spec(adapter: TypeAdapter[T], data: Any, source: str) -> T:
    """Validate plain data (a dict from JSON or YAML) with ``adapter``; a ``GraderSpecError`` lists every problem at
    its JSON path. Shared by single graders and grader stacks (whose graders nest inside)."""
    try:
        return adapter.validate_python(data)
    except ValidationError as exc:
        problems: list[tuple[str, str]] = []
        for error in exc.errors(include_url=False):
            message = error["msg"].removeprefix("Value error, ")
            if error["type"] == "union_tag_invalid":
                message = f"unknown grader type {error['input'].get('type')!r}; expected one of {error['ctx']['expected_tags']}"
            elif error["type"] == "union_tag_not_found":
                message = (
                    "a grader needs a 'type' (string_check, text_similarity, score_model, label_model, python, multi)"
                )
            problem = (_json_path(error["loc"], data, error["type"] == "missing"), message)
            if problem not in problems:
                problems.append(problem)
        raise GraderSpecError(problems, source) from None


def parse_grader(data: Any, source: str = "grader") -> Grader:
    """Validate a grader given as plain data (a dict from JSON or YAML)."""
    return validate_spec(_GRADER, data, source)


def read_spec_file(path: str | Path) -> Any:
    """The plain data in a JSON or YAML file (by suffix; other suffixes: JSON, then YAML)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise GraderSpecError([("(file)", f"cannot read {path}: {exc.strerror}")], str(path)) from None
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                if path.suffix.lower() == ".json":
                    raise GraderSpecError(
                        [("(file)", f"invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}")], str(path)
                    ) from None
                data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise GraderSpecError([("(file)", f"invalid YAML: {exc}")], str(path)) from None
    return data


def load_grader(path: str | Path) -> Grader:
    """Load a grader from a JSON or YAML file."""
    return parse_grader(read_spec_file(path), str(path))
