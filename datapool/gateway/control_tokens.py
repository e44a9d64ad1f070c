"""Control-token text a client typed stays text: ``<|im_end|>`` in a user message is never the real end-of-turn id.

A chat template writes client strings (message content, names, tool arguments and schemas) into one string with
its own control tokens; tokenizing that string turns every ``<|im_start|>`` / ``<|endoftext|>`` a client typed into
the control id, so a user could close its own turn and write a system or assistant turn the model then trusts, and
the recorded prompt would hold control ids nobody rendered. Here, as in transformers' own
``apply_chat_template(..., sanitize_control_tokens=True)`` (recent 5.x only, and only for whole-chat tokenization,
while the gateway also tokenizes just the rendered suffix of an extended turn):

1. ``mark`` wraps each control token found in client strings in two private-use markers (a marker character the
   client sent is itself wrapped, so nothing is lost or forged), before the template renders them;
2. ``encode`` splits the rendering at the markers: the template's text is tokenized as usual (its control tokens
   stay control ids), each marked token as plain text (the tokenizer's model without its added tokens);
3. ``unmark`` gives the text the template would have rendered from the original strings (the prompt text shown).

A rendering without markers (no control-token text in any client string) is tokenized exactly as before, in one
call. Control tokens: the tokenizer's special added tokens, plus the added tokens the chat template writes.
"""
from __future__ import annotations

import re
from typing import Any, Callable

_START, _END = "\U000f0a0a", "\U000f0a0b"  # Supplementary Private Use Area-A: no tokenizer maps them to a token
_ESCAPED_MARKER = re.compile(r"\\udb82\\ude0[ab]|\\U000f0a0[ab]", re.IGNORECASE)
"""A marker as json.dumps(ensure_ascii=True) or Python's repr (a template printing a list or dict) writes it."""


def map_strings(fn: Callable[[str], str], value: Any) -> Any:
    """``value`` with ``fn`` applied to every string in it (through dict values, lists and tuples; keys kept)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {key: map_strings(fn, item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [map_strings(fn, item) for item in value]
    return value


class ControlTokenError(ValueError):
    """A control token that this tokenizer cannot encode as text (its plain-text tokenization is the token)."""


class ControlTokens:
    """Marks control-token text in client strings and tokenizes renderings of marked strings (thread-safe: no
    tokenizer state is changed, unlike ``split_special_tokens=True`` which flips a flag on the shared backend)."""

    def __init__(self, tokenizer, chat_template: str | None) -> None:
        self.tokenizer = tokenizer
        template = chat_template or ""
        added = getattr(tokenizer, "added_tokens_decoder", {}).values()
        tokens = {t.content for t in added if t.content and (t.special or (t.content in template
                                                                            and not t.content.isspace()))}
        tokens |= {t for t in getattr(tokenizer, "all_special_tokens", ()) if t}
        self.tokens = tuple(sorted(tokens, key=len, reverse=True))  # longest first: a token before its parts
        found = "|".join(map(re.escape, self.tokens)) or "(?!)"
        self._find = re.compile(f"{found}|[{_START}{_END}]")
        self._marked = re.compile(f"{_START}({found}|[{_START}{_END}]){_END}|[{_START}{_END}]")
        self._newline = tokenizer("\n", add_special_tokens=False)["input_ids"] if self.tokens else []

    def mark(self, value: Any) -> Any:
        """``value`` (a string, or the dicts/lists of messages and tools) with every control token (and marker
        character) in its strings wrapped in markers; dict keys are left as they are."""
        return map_strings(lambda text: self._find.sub(lambda m: f"{_START}{m.group(0)}{_END}", text), value)

    def unmark_value(self, value: Any) -> Any:
        """``mark`` undone on a string, dict or list."""
        return map_strings(self.unmark, value)

    def unmark(self, text: str) -> str:
        """The rendering as the template writes it from the unmarked strings (a lone marker, left where a template
        split a marked token, is dropped)."""
        return self._marked.sub(lambda m: m.group(1) or "", text)

    def encode(self, text: str) -> list[int]:
        """Ids of a rendering of marked strings: marked control tokens as text, everything else as usual."""
        if _ESCAPED_MARKER.search(text):
            raise ControlTokenError("the chat template escapes the text it renders (tojson with ensure_ascii, or a "
                                    "list or dict printed as Python), so the control-token text in the request cannot "
                                    "be kept as text: remove control-token text (like <|...|>) from it, or send "
                                    "message content as a string")
        pieces = self._marked.split(text)  # [template text, marked token or None, template text, ...]
        if len(pieces) == 1:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = self.tokenizer(pieces[0], add_special_tokens=False)["input_ids"] if pieces[0] else []
        for i, piece in enumerate(pieces[1:], start=1):
            if not piece:
                continue
            as_text = i % 2 == 1
            piece_ids = self._after_newline(piece, as_text)
            if as_text and piece in self.tokens and self.tokenizer.convert_tokens_to_ids(piece) in piece_ids:
                raise ControlTokenError(f"the tokenizer turns the text {piece!r} into its control token: remove it "
                                        "from the messages")
            ids += piece_ids
        return ids

    def _after_newline(self, piece: str, as_text: bool) -> list[int]:
        """Encode ``piece`` as if it followed a newline, so a SentencePiece tokenizer adds no word-start space to a
        piece from the middle of the prompt (the same trick transformers uses); byte-level BPE is unaffected."""
        encode = self._encode_text if as_text else (
            lambda s: self.tokenizer(s, add_special_tokens=False)["input_ids"])
        ids = encode("\n" + piece)
        if self._newline and ids[: len(self._newline)] == self._newline:
            return ids[len(self._newline):]
        return encode(piece)

    def _encode_text(self, text: str) -> list[int]:
        """``text`` as plain text: the backend's normalizer, pre-tokenizer and model, no added tokens matched."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:  # a slow (Python) tokenizer: no shared flag to race on
            return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        splits = [s for s, _ in backend.pre_tokenizer.pre_tokenize_str(text)] if backend.pre_tokenizer else [text]
        return [token.id for split in splits for token in backend.model.tokenize(split)]
