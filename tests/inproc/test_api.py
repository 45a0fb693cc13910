"""The public Python API (dsakv.LLM, dsakv.SamplingParams, dsakv.plan): tokens equal `dsakv generate` and
transformers on a tiny checkpoint, text in and out through the checkpoint's tokenizer, logprobs equal
log_softmax of transformers' logits, bad options refused with the CLI's own message, plan() is `dsakv plan
--json` as data, close() frees the engine."""

from __future__ import annotations

import json

import pytest
import torch

import dsakv
from dsakv.cli.main import main
from dsakv.errors import ConfigError
from dsakv.testing.engines import _hf, hf_greedy, prompts_for, tiny_path

ARCH = "glm_moe_dsa"
OPTS = {"page_size": 4, "max_tokens": 512, "threads": 1}
CLI_OPTS = ["--page-size", "4", "--max-tokens", "512", "--threads", "1"]


@pytest.fixture(scope="module")
def llm():
    with dsakv.LLM(tiny_path(ARCH), **OPTS) as llm:
        yield llm


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict]:
    assert main(["generate", "--model", str(tiny_path(ARCH)), *argv, *CLI_OPTS, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _ids(prompts: list[list[int]]) -> list[str]:
    return [a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))]


def test_generate_equals_the_cli_and_transformers(llm, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = prompts_for([11, 5, 17], seed=7)
    out = llm.generate(prompts, dsakv.SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in out] == [hf_greedy(ARCH, tuple(p), 10) for p in prompts]
    assert [o.token_ids for o in out] == [
        r["output_ids"] for r in _cli(capsys, *_ids(prompts), "--max-new-tokens", "10", "--ignore-eos")
    ]
    assert [(o.index, o.prompt, o.prompt_token_ids, o.finish_reason) for o in out] == [
        (i, None, p, "length") for i, p in enumerate(prompts)
    ]
    assert out[0].logprobs is None and out[0].cumulative_logprob is None and out[0].error is None
    # seeded sampling: the same draws as the CLI's (the seed is the request's)
    sp = dsakv.SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    sampled = [o.token_ids for o in llm.generate(prompts, sp)]
    cli = _cli(
        capsys,
        *_ids(prompts),
        "--max-new-tokens",
        "8",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--seed",
        "3",
        "--ignore-eos",
    )
    assert sampled == [r["output_ids"] for r in cli]
    assert sampled != [hf_greedy(ARCH, tuple(p), 8) for p in prompts]  # it did sample
    # one prompt of ids is a batch of one; per-prompt params
    one = llm.generate(prompts[1], dsakv.SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert [o.token_ids for o in one] == [hf_greedy(ARCH, tuple(prompts[1]), 3)]
    two = llm.generate(prompts[:2], [dsakv.SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (2, 4)])
    assert [o.token_ids for o in two] == [
        hf_greedy(ARCH, tuple(p), n) for p, n in zip(prompts[:2], (2, 4), strict=True)
    ]


def test_text_prompts_use_the_checkpoints_tokenizer(llm, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_path(ARCH)))
    out = llm.generate(["Hello there", [5, 6, 7]], dsakv.SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert out[0].prompt == "Hello there" and out[0].prompt_token_ids == tok.encode("Hello there")
    row = _cli(capsys, "--prompt", "Hello there", "--max-new-tokens", "6", "--ignore-eos")[0]
    assert out[0].token_ids == row["output_ids"] == hf_greedy(ARCH, tuple(tok.encode("Hello there")), 6)
    assert out[0].text == row["text"] == tok.decode(row["output_ids"])
    assert out[1].prompt is None and out[1].text == tok.decode(out[1].token_ids)


def test_logprobs_equal_transformers(llm) -> None:
    prompt = list(range(5, 25))
    sp = dsakv.SamplingParams(max_new_tokens=5, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    (o,) = llm.generate([prompt], sp)
    assert o.logprobs is not None and [t.token_id for t in o.logprobs] == o.token_ids
    assert all(len(t.top) == 3 and t.top[0][0] == t.token_id for t in o.logprobs)  # greedy: the top token
    with torch.no_grad():
        ref = torch.log_softmax(_hf(ARCH)(torch.tensor([prompt + o.token_ids])).logits[0].float(), -1)
    got = torch.tensor([t.logprob for t in o.logprobs])
    want = torch.stack([ref[len(prompt) - 1 + i, t] for i, t in enumerate(o.token_ids)])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert o.cumulative_logprob == sum(t.logprob for t in o.logprobs)
    assert o.prompt_logprobs is not None and [t.token_id for t in o.prompt_logprobs] == prompt[1:]
    want_p = torch.stack([ref[i - 1, prompt[i]] for i in range(1, len(prompt))])
    torch.testing.assert_close(torch.tensor([t.logprob for t in o.prompt_logprobs]), want_p, atol=1e-4, rtol=0)


def _cli_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """What `dsakv generate` prints after 'dsakv generate: error: ' (argparse's errors exit, dsakv's return 2)."""
    try:
        assert main(argv) == 2
    except SystemExit as e:
        assert e.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("dsakv generate: error: "), err
    return err[len("dsakv generate: error: ") :]


@pytest.mark.parametrize(
    "options, flags",
    [
        ({"page_size": 0}, ["--page-size", "0"]),
        ({"kv_format": "fp9"}, ["--kv-format", "fp9"]),
        ({"kv_budget": "64MiB", "num_pages": 8}, ["--kv-budget", "64MiB", "--num-pages", "8"]),
        ({"kv_budget": "lots"}, ["--kv-budget", "lots"]),
        ({"hicache_ratio": -1}, ["--hicache-ratio", "-1"]),
        ({"tp_size": 3}, ["--tp-size", "3"]),
        ({"max_batch_tokens": "many"}, ["--max-batch-tokens", "many"]),
    ],
)
def test_a_bad_option_is_the_clis_error(options, flags, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tiny_path(ARCH))
    cli = _cli_error(capsys, ["generate", "--model", path, "--prompt-ids", "5,6", *flags])
    with pytest.raises(ConfigError) as e:
        dsakv.LLM(path, **options)
    assert str(e.value) == cli


def test_options_that_are_not_the_engines_are_refused_by_name() -> None:
    path = tiny_path(ARCH)
    with pytest.raises(ConfigError) as e:
        dsakv.LLM(path, max_new_tokens=4)
    assert (
        str(e.value) == "dsakv.LLM: max_new_tokens= is not an option here: it is per request: pass it in "
        "dsakv.SamplingParams"
    )
    with pytest.raises(ConfigError, match=r"unknown option page_sise=4 \(did you mean page_size, "):
        dsakv.LLM(path, page_sise=4)
    with pytest.raises(ConfigError, match=r"prefix_cache='yes' is a switch \(--prefix-cache\): give True or False"):
        dsakv.LLM(path, prefix_cache="yes")
    with pytest.raises(ConfigError, match=r"--model '/nonexistent' has no config.json"):
        dsakv.LLM("/nonexistent")


def test_bad_prompts_queue_nothing(llm) -> None:
    with pytest.raises(ConfigError, match="a prompt is empty"):
        llm.generate([[5, 6], []])
    with pytest.raises(ConfigError, match=r"prompt token id\(s\) \[-1\] are outside the vocabulary 0..511"):
        llm.generate([[5, 6], [7, -1]])
    with pytest.raises(ConfigError, match=r"give one dsakv.SamplingParams or a list of 2"):
        llm.generate([[5, 6], [7]], [dsakv.SamplingParams()])
    with pytest.raises(ConfigError, match=r"SamplingParams\(n=2\).*give n=1"):
        llm.generate([[5, 6]], dsakv.SamplingParams(n=2))
    assert not llm.engine.has_unfinished() and llm.generate([]) == []
    llm.engine.check_integrity()
    assert llm.engine.stats().pages_used == 0


def test_close_frees_the_engine() -> None:
    llm = dsakv.LLM(tiny_path(ARCH), **OPTS, prefix_cache=True, hicache_ratio=2)
    eng = llm.engine
    assert [o.token_ids for o in llm.generate([[5, 6, 7]], dsakv.SamplingParams(max_new_tokens=2))] == [
        hf_greedy(ARCH, (5, 6, 7), 2)
    ]
    llm.close()
    llm.close()  # idempotent
    assert "closed" in repr(llm) and eng.prefix_cache is not None
    with pytest.raises(ConfigError, match=r"is closed: make a new one"):
        llm.generate([[5, 6, 7]])
    with dsakv.LLM(tiny_path(ARCH), **OPTS) as inner:
        assert inner.stats()["generated_tokens"] == 0
    with pytest.raises(ConfigError, match="is closed"):
        inner.engine  # noqa: B018


PLAN_CASES = [
    ("glm-5.2", {"role": "decode", "kv_budget": "96.33GiB", "draft_layers": 1}),
    (
        "glm-5.2",
        {"role": "prefill", "pp_partition": [20, 20, 20, 18], "draft_layers": 1, "kv_budget": "98GiB", "balance": True},
    ),
    (
        "glm-5.2",
        {"role": "decode", "kv_budget": "96.33GiB", "draft_layers": 1, "tp": 8, "dp": 8, "enable_dp_attention": True},
    ),
    ("deepseek-v4-flash", {"kv_budget": "64GiB", "max_running_requests": 64}),
]


def _flags(options: dict) -> list[str]:
    out = []
    for k, v in options.items():
        flag = "--" + k.replace("_", "-")
        out += [flag] if v is True else [flag, ",".join(map(str, v)) if isinstance(v, list) else str(v)]
    return out


@pytest.mark.parametrize("model, options", PLAN_CASES)
def test_plan_is_the_clis_json(model, options, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", model, *_flags(options), "--json"]) == 0
    assert dsakv.plan(model, **options) == json.loads(capsys.readouterr().out)


def test_plan_figures_are_the_clis_table(capsys: pytest.CaptureFixture[str]) -> None:
    d = dsakv.plan("glm-5.2", role="decode", kv_budget="96.33GiB", draft_layers=1)
    assert (d["max_total_num_tokens_dense"], d["max_total_num_tokens_elided"]) == (1_661_504, 1_889_920)
    assert [(s["bytes_per_token_dense"], s["bytes_per_token_elided"]) for s in d["stages"]] == [(62_252, 54_728)]
    assert main(["plan", "glm-5.2", "--role", "decode", "--kv-budget", "96.33GiB", "--draft-layers", "1"]) == 0
    text = capsys.readouterr().out
    assert "dense 1,661,504 (stage 0 binds) -> elided 1,889,920" in text
    assert "62,252" in text and "54,728" in text
    rp = dsakv.plan(
        "glm-5.2", role="decode", kv_budget="96.33GiB", draft_layers=1, tp=8, dp=8, enable_dp_attention=True
    )
    assert (
        main(
            [
                "plan",
                "glm-5.2",
                "--role",
                "decode",
                "--kv-budget",
                "96.33GiB",
                "--draft-layers",
                "1",
                "--tp",
                "8",
                "--dp",
                "8",
                "--enable-dp-attention",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert f"elided {rp['max_total_num_tokens_elided']:,} tokens" in text and "1,889,920" in text


def test_plan_refuses_what_the_cli_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "glm-5.2", "--role", "router"])
    cli = capsys.readouterr().err.strip().splitlines()[-1].removeprefix("dsakv plan: error: ")
    with pytest.raises(ConfigError) as e:
        dsakv.plan("glm-5.2", role="router")
    assert str(e.value) == cli and "invalid choice: 'router'" in cli
    assert main(["plan", "glm-5.2", "--pp", "3", "--pp-partition", "40,38", "--kv-budget", "1GiB"]) == 2
    cli = capsys.readouterr().err.strip().removeprefix("dsakv plan: error: ")
    with pytest.raises(ConfigError) as e:
        dsakv.plan("glm-5.2", pp=3, pp_partition="40,38", kv_budget="1GiB")
    assert str(e.value) == cli == "--pp 3 but --pp-partition 40,38 has 2 stages"
    with pytest.raises(ConfigError, match=r"json= is not an option here: plan\(\) always returns data"):
        dsakv.plan("glm-5.2", json=True)
