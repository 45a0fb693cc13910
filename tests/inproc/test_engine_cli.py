"""`dsakv generate`: token ids in, transformers' greedy ids out; text prompts need a tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest

from dsakv.cli.main import main
from dsakv.testing.engines import engine, greedy_params, hf_greedy, prompts_for, tiny_path


def test_generate_prints_greedy_ids(capsys: pytest.CaptureFixture[str]) -> None:
    p0, p1 = prompts_for([20, 6], seed=4)
    path = tiny_path("glm_moe_dsa")
    argv = ["generate", "--model", str(path), "--prompt-ids", ",".join(map(str, p0)), "--prompt-ids"]
    argv += [",".join(map(str, p1)), "--max-new-tokens", "12", "--ignore-eos", "--page-size", "4"]
    argv += ["--threads", "1", "--max-tokens", "512"]
    assert main(argv + ["--json", "--stats"]) == 0
    out, err = capsys.readouterr()
    rows = json.loads(out)
    assert [r["output_ids"] for r in rows] == [hf_greedy("glm_moe_dsa", tuple(p), 12) for p in (p0, p1)]
    assert [r["finish_reason"] for r in rows] == ["length", "length"]
    assert json.loads(err.strip().splitlines()[-1])["generated_tokens"] == 24
    assert main(argv + ["--no-elide", "--kv-format", "fp8-656", "--index-format", "fp8-132"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("#0 prompt=20 finish=length ids=") and lines[1].startswith("#1 prompt=6 ")
    lossy = engine(
        "glm_moe_dsa", elide=False, kv_format="fp8-656", index_format="fp8-132", page_size=4, max_tokens=512
    ).generate([p0, p1], greedy_params(12))
    assert [[int(t) for t in line.split("ids=")[1].split(",")] for line in lines] == lossy


def test_generate_errors(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tiny_path("glm_moe_dsa"))
    bare = tmp_path / "bare"  # the checkpoint without make-tiny's tokenizer files
    shutil.copytree(path, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    assert main(["generate", "--model", str(bare), "--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    assert "--prompt needs a tokenizer in" in err and "pass token ids with --prompt-ids 1,2,3" in err
    assert main(["generate", "--model", path, "--prompt-ids", "1,x"]) == 2
    assert "--prompt-ids '1,x' must be comma-separated token ids" in capsys.readouterr().err
    assert main(["generate", "--model", path]) == 2
    assert "no prompt" in capsys.readouterr().err
    too_long = ["--prompt-ids", "5,6", "--max-new-tokens", "100", "--num-pages", "1"]
    assert main(["generate", "--model", path, *too_long]) == 2
    assert "can never fit in the KV pool of 1 pages x 64 tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--prompt-ids" in capsys.readouterr().out


def test_generate_text_prompt_with_a_tokenizer(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    model_dir = tmp_path / "tok"
    shutil.copytree(tiny_path("glm_moe_dsa"), model_dir)
    vocab = {"<bos>": 0, "<eos>": 1, "[UNK]": 2} | {f"w{i}": i for i in range(3, 512)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(model_dir))
    text = "w10 w20 w30 w40 w50"
    assert main(["generate", "--model", str(model_dir), "--prompt", text, "--max-new-tokens", "6", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["prompt_ids"] == [10, 20, 30, 40, 50]
    want = hf_greedy("glm_moe_dsa", (10, 20, 30, 40, 50), 6)
    if 1 in want:  # the checkpoint's eos stops generation (no --ignore-eos here)
        want = want[: want.index(1) + 1]
    assert row["output_ids"] == want
    assert row["text"] == " ".join(f"w{t}" if t > 2 else ["<bos>", "<eos>", "[UNK]"][t] for t in want)


@pytest.mark.parametrize(
    "sampling",
    [["--temperature", "1e-40"], ["--temperature", "1e-300"], ["--temperature", "1", "--top-p", "1e-300"]],
)
def test_generate_extreme_sampling_values_give_the_greedy_ids(
    sampling: list[str], capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A temperature that underflows fp32 or a top_p below its smallest value is a point mass on the argmax:
    the greedy ids, exit 0, and no traceback logged (it was a failed step and a traceback)."""
    (p0,) = prompts_for([7], seed=9)
    argv = ["generate", "--model", str(tiny_path("glm_moe_dsa")), "--prompt-ids", ",".join(map(str, p0))]
    argv += ["--max-new-tokens", "6", "--ignore-eos", "--seed", "3", "--threads", "1", "--json", *sampling]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["output_ids"] for r in rows] == [hf_greedy("glm_moe_dsa", tuple(p0), 6)]
    assert "error" not in rows[0]
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []
