"""`flywheel prepare --chat-template`: giving a checkpoint without a chat template (as a GGUF may be) one, checked
before it is saved. The checkpoint is a copy of the embedded model's config and tokenizer files with the template
removed (no weights: preparing a directory reads only its config and tokenizer)."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from flywheel.cli import app
from flywheel.inference.chat import render_prompt
from flywheel.inference.loading import EMBEDDED_MODEL, resolve_model

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL = {
    "type": "function",
    "function": {"name": "lookup_account", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture
def bare(tmp_path):
    """A checkpoint directory whose tokenizer has no chat template."""
    source = resolve_model(EMBEDDED_MODEL).path
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(source / name, bare / name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    assert AutoTokenizer.from_pretrained(bare).chat_template is None
    return bare


def prepare(model, template_file) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["prepare", "--model", str(model), "--chat-template", str(template_file)])
    return result.exit_code, " ".join(result.output.split())  # rich wraps to the terminal width


def test_a_checked_template_is_saved_and_used_for_every_later_chat(bare, tmp_path):
    with pytest.raises(ValueError, match=r"flywheel prepare --model <the model> --chat-template"):
        render_prompt(AutoTokenizer.from_pretrained(bare), [{"role": "user", "content": "Hi"}])
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    code, output = prepare(bare, template)
    assert code == 0, output
    assert (bare / "chat_template.jinja").read_text() == CHATML and str(bare) in output
    tokenizer = AutoTokenizer.from_pretrained(bare)
    ids = render_prompt(tokenizer, [{"role": "user", "content": "Where is my refund?"}], [TOOL])
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "Where is my refund?" in text and "lookup_account" in text  # tools in the default format's system turn


@pytest.mark.parametrize(
    "template, fragment",
    [
        ("{% for m in messages %}{{ m['content'] }", "does not render a conversation"),  # a syntax error
        ("{{ raise_exception('no system turn') }}", "does not render a conversation"),
        ("<|im_start|>assistant\n", "rendered a user message without its content"),
        (None, "No such file"),
    ],
)
def test_a_template_that_cannot_format_a_chat_is_refused_and_nothing_written(bare, tmp_path, template, fragment):
    path = tmp_path / "template.jinja"
    if template is not None:
        path.write_text(template)
    code, output = prepare(bare, path)
    assert code == 2 and fragment in output and path.name in output
    assert not (bare / "chat_template.jinja").exists()
