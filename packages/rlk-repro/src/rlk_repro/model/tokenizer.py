"""A Hugging Face model directory's tokenizer: ``tokenizer.json`` (the ``tokenizers`` library), the chat template
and the special tokens of ``tokenizer_config.json``, the EOS ids of ``generation_config.json``.

What the rollout engines do with it, as VIME does: a prompt is rendered with the chat template
(``add_generation_prompt=True``, like ``tokenizer.apply_chat_template(..., tokenize=False)``) and encoded without
adding special tokens; a response stops at any *stop token* — the config's, the generation config's and the
tokenizer's EOS, and any ``--rollout-stop-token-ids`` — which stays in the response (and is trained on); the
response text for the reward is decoded with the special tokens kept (VIME's ``skip_special_tokens`` default,
False). The chat template is rendered in a sandboxed Jinja environment as transformers renders it (``trim_blocks``,
``lstrip_blocks``, ``raise_exception``, ``tojson``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rlk_core.errors import RlkConfigError


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise RlkConfigError(f"{path} cannot be read: {exc}") from None
    return doc if isinstance(doc, dict) else {}


class HFTokenizer:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        tj = self.path / "tokenizer.json"
        if not tj.is_file():
            raise RlkConfigError(f"{self.path} has no tokenizer.json (a Hugging Face fast tokenizer is needed)")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise RlkConfigError("reading tokenizer.json needs the tokenizers package: pip install "
                                 "'rlk-repro[tokenizer]'") from None
        self._tok = Tokenizer.from_file(str(tj))
        self.config = _read_json(self.path / "tokenizer_config.json")
        template = self.config.get("chat_template")
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        self.chat_template: str | None = template if isinstance(template, str) else None
        self._compiled = None  # the chat template, compiled at its first use
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        gen = _read_json(self.path / "generation_config.json").get("eos_token_id")
        self.generation_eos_ids = [gen] if isinstance(gen, int) else [int(x) for x in (gen or [])]

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def stop_token_ids(self, config_eos: int, extra: list[int] | tuple[int, ...] = ()) -> list[int]:
        """The config's EOS, the generation config's, the tokenizer's, and ``extra``: sorted, each once."""
        ids = {int(config_eos), *self.generation_eos_ids, *(int(x) for x in extra)}
        if self.eos_token_id is not None:
            ids.add(int(self.eos_token_id))
        return sorted(ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        if self.chat_template is None:
            raise RlkConfigError(f"{self.path}: --apply-chat-template, but tokenizer_config.json has no chat_template")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        try:
            if self._compiled is None:  # compiled once: a data set renders it per row
                env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
                env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
                env.globals["raise_exception"] = raise_exception
                self._compiled = env.from_string(self.chat_template)
            return self._compiled.render(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
                eos_token=self.eos_token or "", **kwargs)
        except TemplateError as exc:
            raise RlkConfigError(f"{self.path}: the chat template failed: {exc}") from None
