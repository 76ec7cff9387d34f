"""A chat's messages as one prompt: the model's chat template (`options.chat_template`, a Jinja2
string over `messages`, as Hugging Face writes them) run in jinja2's sandbox, or a plain default.

The template sees `messages` (each {"role", "content"}, content as text), `add_generation_prompt`
(True), and `bos_token` / `eos_token` ("" : the tokenizer adds none), as Hugging Face's do.
"""
from __future__ import annotations

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import OpenAiError, invalid

# role-tagged lines, then the assistant's turn opened
DEFAULT_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}{{ '\\n' }}{% endfor %}"
                    "{% if add_generation_prompt %}assistant:{% endif %}")
ROLES = ("system", "developer", "user", "assistant")

_env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)


def _raise(message: str):
    raise TemplateError(message)


_env.globals["raise_exception"] = _raise   # Hugging Face templates call it on messages they refuse


class ChatTemplate:
    """One model's template, compiled once (a syntax error is the config's, said at start-up)."""

    def __init__(self, source: str | None, model: str):
        self.source = source if source is not None else DEFAULT_TEMPLATE
        try:
            self.template = _env.from_string(self.source)
        except TemplateError as exc:
            raise ValueError(f"model {model!r}: options.chat_template is not a Jinja2 template: {exc}") from None

    def render(self, messages: list[dict]) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, bos_token="", eos_token="")
        except (TemplateError, TypeError, ValueError, LookupError) as exc:   # the template's own failure
            raise invalid(f"the model's chat template refused these messages: {exc}", "messages") from None


def messages_of(raw) -> list[dict]:
    """The request's `messages` as {"role", "content": str}: text content only (a string, or a
    list of {"type": "text", "text"} parts), the roles a template knows."""
    if not isinstance(raw, list) or not raw:
        raise invalid("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"{where} must be an object with role and content", where)
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise invalid(f"{where}.role {role!r} is not supported: one of {', '.join(ROLES)} (no tools)",
                          f"{where}.role")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise invalid(f"{where}: {', '.join(extra)} not supported (text messages only)", f"{where}.{extra[0]}")
        if isinstance(content, list):
            parts = []
            for k, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid(f"{where}.content[{k}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                  "are supported", f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise invalid(f"{where}.content must be a string or a list of text parts", f"{where}.content")
        out.append({"role": role, "content": content, **({"name": m["name"]} if "name" in m else {})})
    return out


__all__ = ["ChatTemplate", "messages_of", "DEFAULT_TEMPLATE", "OpenAiError"]
