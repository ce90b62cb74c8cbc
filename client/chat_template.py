"""Chat templates from the GGUF (tokenizer.chat_template), rendered in a Jinja2 sandbox as llama.cpp's own
tools and Hugging Face's do: ``messages``, ``add_generation_prompt``, ``bos_token`` and ``eos_token`` in scope,
``raise_exception`` for templates that refuse a conversation (Gemma's refuses a role it does not know).

The rendered text starts with the BOS text when the template writes it; it is tokenized with special tokens
parsed and without another BOS, so BOS is there exactly once.

Which template (``--chat-template``): ``auto`` takes the GGUF's own; a GGUF without one is taken for a base
(pretrained, not instruction-tuned) model, as the packaged Gemma 3 270M is, and gets a plain transcript
("User: ...", "Assistant: ...") that such a model continues well, ending its answer where it starts the next
"User:" line. A name picks a template shipped in templates/ (gemma3: Google's published one, for an
instruction-tuned GGUF that lacks its template; chatml; transcript), and a path reads a Jinja file.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The template a GGUF without one gets: ChatML, as llama.cpp falls back to.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


TEMPLATES = Path(__file__).parent / "templates"
# Stop strings a template implies: where a base model's answer ends in a transcript.
IMPLIED_STOPS = {"transcript": ["\nUser:"]}


def shipped(name: str) -> str:
    return CHATML if name == "chatml" else (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def template_for(choice: str, gguf_template: str) -> tuple[str, list[str]]:
    """The template's source and the stop strings it implies, for ``--chat-template`` ``choice``."""
    if choice == "auto":
        if gguf_template:
            return gguf_template, []
        choice = "transcript"
    if choice == "chatml" or (TEMPLATES / f"{choice}.jinja").is_file():
        return shipped(choice), IMPLIED_STOPS.get(choice, [])
    path = Path(choice)
    if not path.is_file():
        raise TemplateError(f"--chat-template {choice!r} is neither a shipped template nor a file")
    return path.read_text(encoding="utf-8"), []


class TemplateError(ValueError):
    """The template refused the conversation (or failed); the message is the template's own."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""
    stops: tuple[str, ...] = ()  # stop strings the template implies (added to a request's own)

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        object.__setattr__(self, "_template", env.from_string(self.source or CHATML))

    def needs_bos(self, rendered: str) -> bool:
        """Whether tokenizing ``rendered`` must add BOS: the model wants one and the template did not write it."""
        return bool(self.bos_token) and not rendered.startswith(self.bos_token)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(  # type: ignore[attr-defined]
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the model's chat template failed on this conversation: {exc}") from None
