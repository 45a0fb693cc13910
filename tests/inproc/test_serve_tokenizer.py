"""The tiny checkpoint's real tokenizer: a byte-level BPE written by make-tiny (tokenizers, built locally), loaded
by transformers.AutoTokenizer; any text round-trips; byte b is id b + 2 as in the byte fallback; the chat
template; /tokenize, /detokenize and /v1/models on a live server that uses it."""

from __future__ import annotations

import json

import httpx
import pytest
import transformers

from dsakv.model.tiny import ROLE_TOKENS, tiny_tokenizer, write_tiny_tokenizer
from dsakv.serve.tokenizer import BYTE_OFFSET, HFTokenizer, load_tokenizer
from dsakv.testing.engines import tiny_path
from dsakv.testing.servers import live_server, make_engine

TEXTS = ["Hello, world!", "héllo 日本語 \x00\x01 \n\t  two  spaces ", "The quick brown fox", "🦊" * 3, " "]


@pytest.fixture(scope="module")
def hf():
    return transformers.AutoTokenizer.from_pretrained(str(tiny_path("glm_moe_dsa")))


def test_make_tiny_writes_a_loadable_byte_level_tokenizer(hf, tmp_path):
    assert len(hf) == 512 == json.loads((tiny_path("glm_moe_dsa") / "config.json").read_text())["vocab_size"]
    assert (hf.bos_token_id, hf.eos_token_id) == (0, 1)
    assert hf.convert_tokens_to_ids(list(ROLE_TOKENS)) == [258, 259, 260, 261, 262]
    for t in TEXTS:
        ids = hf.encode(t, add_special_tokens=True)
        assert hf.decode(ids) == t and all(0 <= i < 512 for i in ids)
    for b in range(256):  # every single byte: the byte fallback's id
        assert hf.convert_tokens_to_ids(hf.convert_ids_to_tokens(b + BYTE_OFFSET)) == b + BYTE_OFFSET
    assert hf.encode("a", add_special_tokens=False) == [ord("a") + 2]
    assert hf.encode("The quick", add_special_tokens=False) != [c + 2 for c in b"The quick"]  # merges exist
    # same text, same merges: the file is reproducible
    write_tiny_tokenizer(tmp_path, 512, 4096)
    assert (tmp_path / "tokenizer.json").read_bytes() == (tiny_path("glm_moe_dsa") / "tokenizer.json").read_bytes()
    assert tiny_tokenizer(300).get_vocab_size() == 300


def test_chat_template(hf):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|bos|><|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    ids = HFTokenizer(hf, "t").render_chat(msgs)
    assert ids[:2] == [0, 258] and ids[-2:] == [261, 12] and hf.decode(ids) == text


def test_token_bytes_exact(hf):
    tok = HFTokenizer(hf, "t")
    ids = hf.encode("日本 fox", add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == "日本 fox".encode()
    assert tok.token_bytes(1) == b"<|eos|>"


def test_tokenize_detokenize_models(tmp_path):
    tok = load_tokenizer(tiny_path("glm_moe_dsa"), 512)
    assert isinstance(tok, HFTokenizer)
    with live_server(make_engine(), tok) as (srv, _):
        r = httpx.post(f"{srv.url}/tokenize", json={"prompt": "Hello, world!"}, timeout=30).json()
        assert r["tokens"] == tok.encode("Hello, world!") and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == 1024  # 64 pages x 16 tokens
        d = httpx.post(f"{srv.url}/detokenize", json={"tokens": r["tokens"]}, timeout=30).json()
        assert d == {"prompt": "Hello, world!"}
        m = httpx.post(f"{srv.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert m.json()["tokens"] == [0, 260, 12, 106, 107, 12, 261, 12]
        bad = httpx.post(f"{srv.url}/detokenize", json={"tokens": [1, -2]}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        card = httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"][0]
        assert card["max_model_len"] == 1024 and card["tokenizer"] == tok.name
        # a text completion encodes with the checkpoint's tokenizer
        c = httpx.post(
            f"{srv.url}/v1/completions", json={"prompt": "The quick", "max_tokens": 4, "temperature": 0}, timeout=60
        ).json()
        assert c["prompt_token_ids"] == tok.encode("The quick")
        assert c["choices"][0]["text"] == tok.decode(c["choices"][0]["token_ids"])


def test_hf_detokenizer_is_incremental_and_exact(hf):
    """Streaming detokenization decodes a window, not the whole output each step (it runs on the HTTP event loop):
    500 random ids (split characters and invalid bytes included) fed 1-4 at a time give exactly decode(all), and
    the ids decoded in all stay under 6 per id, a tenth of what decoding the whole output at each step would."""
    import random

    tok = HFTokenizer(hf, "tiny")
    decoded: list[int] = []
    real = tok.decode

    def counting(ids):
        decoded.append(len(ids))
        return real(ids)

    tok.decode = counting  # type: ignore[method-assign]
    rng = random.Random(7)
    ids = [rng.randrange(0, 512) for _ in range(500)] + hf.encode("héllo 日本語 🦊", add_special_tokens=False)
    d, out, i, whole = tok.detokenizer(), "", 0, 0
    while i < len(ids):
        k = rng.randint(1, 4)
        out += d.feed(ids[i : i + k])
        i += k
        whole += i  # what one decode of the whole output so far would take
    out += d.flush()
    assert sum(decoded) < 6 * len(ids) and 10 * sum(decoded) < whole, (sum(decoded), whole)
    assert out == real(ids)
    assert tok.max_token_chars == max(len(t) for t in hf.get_vocab())
