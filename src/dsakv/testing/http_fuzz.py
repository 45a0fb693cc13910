"""The seeded HTTP fuzz corpus of the serve tests: random and malformed bodies (types, encodings, nesting, sizes,
surrogates, invalid UTF-8, huge numbers), paths, methods and content types, bounded in count and time.

    statuses, n = fuzz(url)     every response checked (no 5xx, OpenAI error bodies, SSE ends with [DONE])

One corpus for the colocated server (tests/inproc/test_serve_fuzz.py) and the disaggregated router
(tests/cluster/test_serve_fuzz_router.py): the same seed sends the same cases to both.
"""

from __future__ import annotations

import json
import random
import time

import httpx

from dsakv.serve.limits import HttpLimits
from dsakv.testing.servers import MODEL

SEED = 20261201
MAX_CASES = 300
MAX_SECONDS = 30.0
LIMITS = HttpLimits(max_request_bytes=128 * 1024, body_timeout=5.0, header_timeout=5.0)

FIELDS = (
    "prompt messages max_tokens max_completion_tokens temperature top_p top_k seed n best_of stop stop_token_ids "
    "ignore_eos stream stream_options model logprobs echo suffix presence_penalty frequency_penalty logit_bias "
    "tools response_format top_logprobs user"
).split()


def _scalar(rng: random.Random) -> object:
    return rng.choice(
        [
            None,
            True,
            False,
            0,
            1,
            -1,
            2,
            rng.randint(-(2**70), 2**70),
            10**400,
            rng.random(),
            -rng.random() * 1e6,
            1e308,
            "",
            "x",
            "\ud800",
            "ok \U0001f600",
            "a" * rng.randint(0, 3000),
            rng.randint(0, 600),
        ]
    )


def _value(rng: random.Random, depth: int = 0) -> object:
    r = rng.random()
    if depth > 3 or r < 0.55:
        return _scalar(rng)
    if r < 0.8:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    return {rng.choice(FIELDS + ["role", "content", "type", "text"]): _value(rng, depth + 1) for _ in range(3)}


def _body(rng: random.Random) -> dict:
    b: dict = {}
    if rng.random() < 0.7:
        b["prompt"] = rng.choice(
            [[rng.randint(2, 300) for _ in range(rng.randint(1, 12))], "hello", _value(rng), [[5, 6]], ["hi"]]
        )
    if rng.random() < 0.4:
        role = rng.choice(["user", "system", "assistant", "bot", None, 3])
        content = rng.choice(["hi", "", None, [{"type": "text", "text": "x"}], _value(rng)])
        b["messages"] = rng.choice([[{"role": role, "content": content}], [], _value(rng)])
    for _ in range(rng.randint(0, 6)):
        b[rng.choice(FIELDS)] = _value(rng)
    if rng.random() < 0.5:
        b["max_tokens"] = rng.choice([1, 2, 3, rng.randint(-5, 5)])
    if rng.random() < 0.3:
        b["model"] = rng.choice([MODEL, "other", None])
    return b


def _raw(rng: random.Random) -> bytes:
    kind = rng.randrange(10)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 300)))
    if kind == 1:
        s = json.dumps(_body(rng)).encode()
        return s[: rng.randint(0, len(s))]
    if kind == 2:
        d = rng.choice([40, 65, 300, 3000])
        o, c = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
        return b'{"prompt": ' + o * d + b"5" + c * d + b"}"
    if kind == 3:
        return b'{"prompt": "\xff\xfe\xc3(", "max_tokens": 2}'
    if kind == 4:
        return b'{"prompt": "' + rng.choice([b"\\ud800", b"\\udfff\\ud800", b"\\u0000", b"\\uZZZZ"]) + b'"}'
    if kind == 5:
        return b'{"prompt": "' + b"y" * rng.choice([1000, 130 * 1024, 300 * 1024]) + b'", "max_tokens": 1}'
    if kind == 6:
        return rng.choice([b"null", b"[]", b"1e999", b'"str"', b"{}", b"{,}", b'{"prompt": NaN}', b"\xef\xbb\xbf{}"])
    return json.dumps(_body(rng), ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")


def reference(url: str) -> list[int]:
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def fuzz(url: str) -> tuple[dict[int, int], int]:
    """Run the corpus against the server at `url`: (status -> count, cases sent); asserts every response is not
    a 5xx, every error has an OpenAI error body and every stream ends with [DONE]."""
    rng = random.Random(SEED)
    statuses: dict[int, int] = {}
    t_end = time.monotonic() + MAX_SECONDS
    n = 0
    with httpx.Client(base_url=url, timeout=60) as client:
        while n < MAX_CASES and time.monotonic() < t_end:
            n += 1
            path = rng.choice(["/v1/completions"] * 5 + ["/v1/chat/completions"] * 4 + ["/v1/models", "/nope"])
            method = rng.choice(["POST"] * 12 + ["GET", "PUT", "DELETE"])
            ctype = rng.choice(["application/json"] * 6 + ["text/plain", "application/x-www-form-urlencoded", ""])
            raw = _raw(rng)
            headers = {"content-type": ctype} if ctype else {}
            try:
                with client.stream(method, path, content=raw, headers=headers) as r:
                    data = r.read()
            except httpx.TransportError as e:
                # a body over the limit is answered 413 unread and the connection closed: the kernel may reset
                # it before the client reads the 413 while it is still sending
                assert len(raw) > LIMITS.max_request_bytes, (n, method, path, len(raw), raw[:300], e)
                statuses[413] = statuses.get(413, 0) + 1
                continue
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (n, method, path, raw[:300], data[:500])
            if r.status_code >= 400:
                err = json.loads(data)["error"]
                assert set(err) == {"message", "type", "param", "code"}, data[:300]
            elif r.headers.get("content-type", "").startswith("text/event-stream"):
                assert data.rstrip().endswith(b"data: [DONE]"), data[-300:]
    return statuses, n


__all__ = ["LIMITS", "MAX_SECONDS", "fuzz", "reference"]
