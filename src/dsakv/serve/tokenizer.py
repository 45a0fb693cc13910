"""Text <-> token ids for the HTTP layer: a checkpoint's HF tokenizer, or the byte-level fallback.

Byte fallback (checkpoints without a tokenizer, e.g. `dsakv make-tiny`): text is UTF-8 encoded and byte b
becomes token id b + 2 (ids 2..257; 0 and 1 are the tiny checkpoint's bos and eos). Decoding maps ids 2..257
back to bytes (invalid UTF-8 becomes U+FFFD) and renders every other id as `<|id|>`, e.g. `<|1|>` for eos:

    "hi" -> [106, 107]          [106, 107, 1, 300] -> "hi<|1|><|300|>"

`dsakv make-tiny` writes a real byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json with a chat
template; same ids for bytes, see dsakv.model.tiny.tiny_tokenizer), which load_tokenizer picks up.

Chat messages are rendered with the checkpoint's chat template when it has one, else with this template
(then encoded as above):

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n ... <|assistant|>\\n

`Detokenizer` turns a stream of new ids into text deltas (never splitting a UTF-8 character).
Imports the standard library, dsakv.errors and dsakv.util (transformers only inside load_tokenizer); must not
import torch, engine or disagg.
"""

from __future__ import annotations

import codecs
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from dsakv.errors import ConfigError
from dsakv.util import byte_symbols

log = logging.getLogger(__name__)

BYTE_OFFSET = 2  # byte b <-> token id b + BYTE_OFFSET
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class Tokenizer(Protocol):
    name: str
    # optional: an upper bound on the characters one token stands for (None: unknown). The HTTP layer refuses a
    # text of more than max_prompt_tokens x max_token_chars characters before tokenizing it (it cannot fit).
    max_token_chars: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (for logprobs' `bytes`; a piece of a character is not UTF-8)."""
        ...

    def render_chat(self, messages: Sequence[dict[str, str]]) -> list[int]: ...

    def detokenizer(self) -> Detokenizer: ...


class Detokenizer(Protocol):
    def feed(self, ids: Sequence[int]) -> str:
        """Text of `ids` appended to what was fed before (may hold back an incomplete character)."""
        ...

    def flush(self) -> str: ...


def simple_chat_text(messages: Sequence[dict[str, str]]) -> str:
    """The fallback chat template (module docstring), ending with the assistant's header."""
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)


class ByteTokenizer:
    """The byte-level fallback (module docstring)."""

    name = "bytes"
    max_token_chars: int | None = 1  # a token is one UTF-8 byte: a text of n characters is >= n tokens

    def __init__(self, vocab_size: int | None = None) -> None:
        if vocab_size is not None and vocab_size < 256 + BYTE_OFFSET:
            raise ValueError(
                f"the byte tokenizer needs a vocabulary of >= {256 + BYTE_OFFSET} ids, the model has {vocab_size}: "
                "send prompts as token-id lists"
            )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def token_bytes(self, token_id: int) -> bytes:
        if BYTE_OFFSET <= token_id < 256 + BYTE_OFFSET:
            return bytes([token_id - BYTE_OFFSET])
        return f"<|{token_id}|>".encode()

    def decode(self, ids: Sequence[int]) -> str:
        d = self.detokenizer()
        return d.feed(ids) + d.flush()

    def render_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.encode(simple_chat_text(messages))

    def detokenizer(self) -> ByteDetokenizer:
        return ByteDetokenizer()


class ByteDetokenizer:
    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        run = bytearray()
        for t in ids:
            if BYTE_OFFSET <= t < 256 + BYTE_OFFSET:
                run.append(t - BYTE_OFFSET)
                continue
            out.append(self._utf8.decode(bytes(run), final=True))
            run.clear()
            out.append(f"<|{t}|>")
        out.append(self._utf8.decode(bytes(run)))
        return "".join(out)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def _max_token_chars(tok: Any) -> int | None:
    """The longest token string of the vocabulary (byte-level BPE spells one symbol per byte, so this bounds the
    characters a token decodes to), at least 1; None if the tokenizer does not list its vocabulary."""
    try:
        vocab = tok.get_vocab()
        return max(1, max((len(t) for t in vocab if isinstance(t, str)), default=1))
    except Exception:  # a tokenizer without get_vocab: no bound before tokenizing
        return None


class HFTokenizer:
    """A transformers tokenizer (tokenizer.json / tokenizer_config.json in the checkpoint directory)."""

    def __init__(self, tok: Any, name: str) -> None:
        self.tok = tok
        self.name = name
        self._bytes: dict[int, bytes] = {}
        # byte-level BPE (GPT-2 style) tokens spell their bytes with printable stand-ins: invert that map
        self._byte_of = {c: b for b, c in enumerate(byte_symbols())}
        self._special = set(getattr(tok, "all_special_ids", ()) or ())
        self.max_token_chars = _max_token_chars(tok)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        got = self._bytes.get(token_id)
        if got is None:
            piece = self.tok.convert_ids_to_tokens(int(token_id))
            if (
                isinstance(piece, str)
                and piece
                and token_id not in self._special
                and all(c in self._byte_of for c in piece)
            ):
                got = bytes(self._byte_of[c] for c in piece)
            else:
                got = self.decode([token_id]).encode("utf-8")
            self._bytes[token_id] = got
        return got

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=False))

    def render_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        if getattr(self.tok, "chat_template", None):
            ids = self.tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        return list(self.tok.encode(simple_chat_text(messages), add_special_tokens=True))

    def detokenizer(self) -> HFDetokenizer:
        return HFDetokenizer(self)


class HFDetokenizer:
    """Incremental: decodes a window (the ids since the last emitted text's start, and the new ones) and emits what
    it adds to the window's text, so each step costs the window, not the whole output (O(n) per request, not
    O(n^2)); holds back text ending in U+FFFD (a split character) until it completes."""

    def __init__(self, tok: HFTokenizer) -> None:
        self.tok = tok
        self.ids: list[int] = []
        self.prefix = 0  # the window starts here: the ids of the last emitted piece (decode context)
        self.read = 0  # ids before this are emitted

    def _step(self, final: bool) -> str:
        before = self.tok.decode(self.ids[self.prefix : self.read])
        text = self.tok.decode(self.ids[self.prefix :])
        if (not final and text.endswith("\ufffd")) or len(text) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]

    def feed(self, ids: Sequence[int]) -> str:
        self.ids.extend(ids)
        return self._step(final=False)

    def flush(self) -> str:
        return self._step(final=True)


def load_tokenizer(model_dir: str | Path | None, vocab_size: int | None = None) -> Tokenizer:
    """The checkpoint's HF tokenizer if it has one, else the byte fallback (logged)."""
    if model_dir is not None:
        root = Path(model_dir)
        if (root / "tokenizer.json").is_file() or (root / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer

            try:
                tok = AutoTokenizer.from_pretrained(str(root))
            except Exception as e:  # a damaged tokenizer.json / tokenizer_config.json: one line, no traceback
                raise ConfigError(
                    f"the tokenizer in {root} cannot be loaded ({type(e).__name__}: {str(e)[:200]}): fix or remove "
                    "tokenizer.json / tokenizer_config.json (without them text uses the byte fallback)"
                ) from None
            log.info("tokenizer: %s from %s", type(tok).__name__, root)
            return HFTokenizer(tok, type(tok).__name__)
    log.info("tokenizer: none in the checkpoint; text uses the byte fallback (byte b <-> token id b + 2)")
    return ByteTokenizer(vocab_size)


__all__ = [
    "BYTE_OFFSET",
    "ByteTokenizer",
    "CHAT_ROLES",
    "Detokenizer",
    "HFTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "simple_chat_text",
]
