"""Bad flags and bad checkpoints, table-driven: `dsakv serve|generate|plan` called in-process (cli.main.main) must
exit 2 with exactly one stderr line `dsakv CMD: error: ...` naming the value, no traceback, and start nothing (the
server entry points are replaced by a failing stub, so a case that slipped through fails instead of serving).
One subprocess checks the same through `python -m dsakv`."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from dsakv.cli import disagg_roles, serve_cmd
from dsakv.cli.main import main
from dsakv.serve import server
from dsakv.testing.engines import tiny_path

T = "{tiny}"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    src = tiny_path("glm_moe_dsa")
    root = tmp_path_factory.mktemp("badcfg")
    out = {"tiny": src}

    def variant(name: str) -> Path:
        d = root / name
        shutil.copytree(src, d)
        out[name] = d
        return d

    st = variant("truncated") / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])  # header intact, tensors cut off
    (variant("corrupt") / "model.safetensors").write_bytes(b"\x00" * 1000)
    hdr = variant("badheader") / "model.safetensors"
    hdr.write_bytes(struct.pack("<Q", 5) + b"{nope" + b"\x00" * 64)
    (variant("badutf") / "config.json").write_bytes(b'\xff\xfe{"model_type": "glm_moe_dsa"}')
    for name, patch in (
        ("experts", {"num_experts_per_tok": 11}),  # > n_routed_experts (8)
        ("groups", {"n_group": 2, "topk_group": 3}),
        ("eps", {"rms_norm_eps": -1.0}),
    ):
        d = variant(name)
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(patch)
        (d / "config.json").write_text(json.dumps(cfg))
    (variant("nosafetensors") / "model.safetensors").unlink()
    for name, patch in (("float7", {"dtype": "float7"}), ("topk", {"index_topk": 10**9})):
        d = variant(name)
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(patch)
        (d / "config.json").write_text(json.dumps(cfg))
    (variant("deep") / "config.json").write_text('{"a": ' * 100_000 + "1" + "}" * 100_000)
    (variant("badtok") / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": [')
    (variant("badgen") / "generation_config.json").write_text("eos_token_id = 1")
    (variant("listgen") / "generation_config.json").write_text("[1, 2]")
    (root / "a-file").write_text("not a directory")
    out["afile"] = root / "a-file"
    return out


# (argv with {name} = a model directory of the fixture, words the one error line must contain)
CASES = [
    ("serve --model {tiny} --port 70000", "--port 70000 is not a TCP port: give 0..65535"),
    ("serve --model {tiny} --port -1", "--port -1 is not a TCP port"),
    ("serve --model {tiny} --threads 0", "--threads 0 must be an integer in 1..4096"),
    ("serve --model {tiny} --request-timeout -5", "--request-timeout -5.0 must be a finite number of seconds > 0"),
    ("serve --model {tiny} --request-timeout nan", "--request-timeout nan"),
    ("serve --model {tiny} --hicache-ratio nan", "--hicache-ratio nan must be a finite number > 0"),
    ("serve --model {tiny} --hicache-ratio inf", "--hicache-ratio inf must be a finite number > 0"),
    ("serve --model {tiny} --hicache-ratio -1", "--hicache-ratio -1.0"),
    ("serve --model {tiny} --hicache-size 100TiB", "--hicache-size 100TiB asks for a 100.00 TiB host tier"),
    ("serve --model {tiny} --num-pages 1000000000000", "--num-pages 1000000000000 must be an integer in 1.."),
    ("serve --model {tiny} --num-pages 2000000000", "--num-pages 2000000000 asks for a"),
    ("serve --model {tiny} --num-pages 0", "--num-pages 0 must be an integer"),
    ("serve --model {tiny} --kv-budget 100TiB", "--kv-budget 100TiB asks for a"),
    ("serve --model {tiny} --kv-budget 0", "--kv-budget '0' must be more than 0 bytes"),
    ("serve --model {tiny} --kv-budget lots", "--kv-budget = 'lots' is not a size"),
    ("serve --model {tiny} --max-tokens 0", "--max-tokens 0 must be an integer"),
    ("serve --model {tiny} --page-size -3", "--page-size -3 must be an integer in 1..65536"),
    ("serve --model {tiny} --max-batch-tokens 0", "--max-batch-tokens 0"),
    ("serve --model {tiny} --max-running-requests 0", "--max-running-requests 0"),
    ("serve --model {tiny} --seed -1", "--seed -1 must be an integer in 0.."),
    ("serve --model {tiny} --host 999.1.1.1", "--host '999.1.1.1' is not a valid IPv4 address"),
    ("serve --model {tiny} --host 'a b'", "--host 'a b' is not a host"),
    ("serve --model {tiny} --max-request-bytes 0", "--max-request-bytes 0 must be an integer >= 64"),
    ("serve --model {tiny} --max-request-bytes huge", "--max-request-bytes = 'huge' is not a size"),
    ("serve --model {tiny} --http-body-timeout inf", "--http-body-timeout inf must be a finite number"),
    ("serve --model {tiny} --http-header-timeout 0", "--http-header-timeout 0.0"),
    ("serve --model {tiny} --keep-alive-timeout -1", "--keep-alive-timeout -1.0"),
    ("serve --model {tiny} --max-connections 0", "--max-connections 0 must be an integer >= 1"),
    ("serve --model {corrupt}", "is corrupt: its header claims 0 bytes"),
    ("serve --model {badheader}", "is corrupt: its header is not JSON"),
    ("serve --model {truncated}", "is corrupt or truncated: tensor"),
    ("serve --model {nosafetensors}", "no *.safetensors files in"),
    ("serve --model {badutf}", "config.json' is not UTF-8 text"),
    ("serve --model {experts}", "'num_experts_per_tok' = 11 is more than 'n_routed_experts' = 8"),
    ("serve --model {groups}", "'n_group' = 2, 'topk_group' = 3: need 1 <= topk_group <= n_group"),
    ("serve --model {eps}", "'rms_norm_eps' = -1.0 must be a finite number > 0"),
    ("serve --model /nonexistent/dir", "--model '/nonexistent/dir' has no config.json"),
    ("serve", "--role colocated needs --model DIR"),
    ("serve --role decode --model {tiny} --port 70000", "--port 70000 is not a TCP port: give 1..65535"),
    ("serve --role decode --model {tiny} --port 0", "--port 0 is not a TCP port: give 1..65535"),
    ("serve --role decode --model {tiny} --rpc-timeout nan", "--rpc-timeout nan"),
    ("serve --role decode --model {tiny} --mooncake-timeout 1", "--mooncake-timeout 1 must be an integer in 5.."),
    (
        "serve --role prefill --model {tiny} --transfer-staging-size lots",
        "--transfer-staging-size = 'lots' is not a size",
    ),
    ("serve --role prefill --model {tiny} --tp-size 2 --hisparse", "--hisparse with --role prefill is not supported"),
    ("serve --role prefill --model {tiny} --hisparse", "--hisparse with --role prefill is not supported"),
    (
        "serve --role decode --model {tiny} --tp-size 2 --dp-size 2 --enable-dp-attention --ep-size 2 --hisparse",
        "--hisparse with --enable-dp-attention --dp-size 2 is not supported yet: drop --hisparse, or run attention TP",
    ),
    ("serve --role decode --model {experts}", "'num_experts_per_tok' = 11"),
    ("serve --role decode --model {truncated}", "is corrupt or truncated"),
    ("serve --role prefill --model {tiny} --pp-size 0", "--pp-size 0 must be an integer in 1..256"),
    ("serve --role prefill --model {tiny} --pp-size 2 --pp-rank 5", "--pp-rank 5 must be in 0..1 (--pp-size 2)"),
    ("serve --role prefill --model {tiny} --pp-size 2 --port 65535", "must be <= 65535: pick a lower --port"),
    ("serve --role prefill --model {tiny} --stage-timeout -1", "--stage-timeout -1.0"),
    ("serve --role prefill --model {tiny} --dist-port 70000", "--dist-port 70000 is not a TCP port"),
    ("serve --role prefill --model {tiny} --decode nowhere", "--decode 'nowhere' must be HOST:PORT"),
    ("serve --role router --prefill garbage --decode 127.0.0.1:9100", "--prefill 'garbage' must be HOST:PORT"),
    ("serve --role router --prefill 127.0.0.1:99999 --decode 127.0.0.1:9100", "port 99999 is not a TCP port"),
    ("serve --role router --prefill 127.0.0.1:9200 --decode 127.0.0.1:0", "port 0 is not a TCP port"),
    ("serve --role router --prefill 300.0.0.1:9200 --decode 127.0.0.1:9100", "'300.0.0.1' is not a valid IPv4"),
    ("serve --role router --prefill 127.0.0.1:9200 --decode 127.0.0.1:9100 --kv-timeout -1", "--kv-timeout -1.0"),
    ("serve --role router --prefill 127.0.0.1:9200 --decode 127.0.0.1:9100 --queue-timeout inf", "--queue-timeout"),
    ("serve --role router --prefill 127.0.0.1:9200 --decode 127.0.0.1:9100 --health-interval 0", "--health-interval"),
    ("serve --role router --prefill 127.0.0.1:9200 --decode 127.0.0.1:9100 --model {badutf}", "is not UTF-8 text"),
    ("generate --model {tiny} --prompt-ids 5,6 --threads 0", "--threads 0 must be an integer in 1..4096"),
    ("generate --model {tiny} --prompt-ids 5,6 --hicache-ratio inf", "--hicache-ratio inf must be a finite number"),
    ("generate --model {tiny} --prompt-ids 5,6 --num-pages 2000000000", "--num-pages 2000000000 asks for a"),
    ("generate --model {tiny} --prompt-ids 5,6 --max-new-tokens 0", "--max-new-tokens 0"),
    ("generate --model {corrupt} --prompt-ids 5,6", "is corrupt"),
    ("generate --model {badutf} --prompt-ids 5,6", "is not UTF-8 text"),
    ("generate --model {experts} --prompt-ids 5,6", "'num_experts_per_tok' = 11"),
    ("generate --model {tiny} --prompt-ids a,b", "--prompt-ids 'a,b' must be comma-separated token ids"),
    ("plan {badutf} --kv-budget 1GiB", "is not valid JSON"),
    ("plan glm-5.2 --kv-budget 1GiB --mem-fraction nan", "--mem-fraction nan must be in (0, 1]"),
    # issue 26: every one of these once ended in a traceback, or was accepted and then failed every request
    ("plan glm-5.2 --kv-budget 1e999", "--kv-budget = '1e999' is larger than any memory"),
    ("serve --model {tiny} --kv-budget 1e999", "--kv-budget = '1e999' is larger than any memory"),
    ("serve --model {tiny} --max-request-bytes 1e999", "--max-request-bytes = '1e999' is larger than any memory"),
    ("serve --model {deep}", "config.json' nests arrays/objects too deeply to be a config"),
    ("generate --model {deep} --prompt-ids 5,6", "config.json' nests arrays/objects too deeply"),
    ("plan {deep} --kv-budget 1GiB", "config.json' is not a usable config (RecursionError)"),
    ("serve --model {tiny} --hicache-ratio 2 --hicache-disk-dir {afile}", "-disk-dir '{afile}' is a file, not a dir"),
    ("generate --model {tiny} --prompt-ids 5 --hicache-disk-dir {afile}", "--hicache-disk-dir '{afile}' is a file"),
    ("serve --model {tiny} --hicache-disk-dir {afile}/sub", "cannot be created: '{afile}' is a file"),
    ("serve --model {float7}", "'dtype' = 'float7' is not a torch dtype"),
    ("generate --model {float7} --prompt-ids 5", "'dtype' = 'float7' is not a torch dtype"),
    ("serve --model {badtok}", "tokenizer.json' is not valid JSON"),
    ("serve --role router --prefill 127.0.0.1:9200 --decode 127.0.0.1:9100 --model {badtok}", "is not valid JSON"),
    ("serve --model {badgen}", "generation_config.json' is not valid JSON"),
    ("generate --model {badgen} --prompt-ids 5", "generation_config.json' is not valid JSON"),
    ("serve --model {listgen}", "generation_config.json' must hold a JSON object"),
    ("serve --role decode --model {tiny} --pp-size 2 --dist-port 70000", "--dist-port 70000 is not a TCP port"),
    ("serve --model {tiny} --pp-size 2 --pp-rank 1", "--pp-rank 1 is for --role prefill / decode: a colocated"),
    (  # a decode's DP attention x PP (decode/dp_pipe.py): every cell's port and rendezvous must be a port
        "serve --role decode --model {tiny} --port 65531 --pp-size 2 --tp-size 2 --dp-size 2 --enable-dp-attention "
        "--ep-size 2",
        "--port 65531 with --dp-size 2 --pp-size 2: cell (DP rank d, stage s) listens on --port + d x 2 + s",
    ),
    (
        "serve --role decode --model {tiny} --pp-size 2 --tp-size 2 --dp-size 2 --enable-dp-attention --ep-size 2 "
        "--speculative-num-steps 1",
        "--speculative-num-steps with --role decode --pp-size 2 (any --tp-size) is not supported yet",
    ),
    (  # DP attention x PP runs colocated (pipeline/dp_stage.py); what a pipeline refuses is refused before any rank
        "generate --model {tiny} --prompt-ids 5 --pp-size 2 --tp-size 2 --dp-size 2 --enable-dp-attention --ep-size 2 "
        "--speculative-num-steps 1",
        "--pp-size 2 with --speculative-num-steps is not supported yet: drop one of them",
    ),
    ("generate --model {tiny} --prompt-ids 5 --pp-size 65", "--pp-size 65 must be an integer in 1..64"),
    ("generate --model {tiny} --prompt-ids 5 --pp-size 2 --stage-timeout 0", "--stage-timeout 0.0"),
    (
        "generate --model {tiny} --prompt-ids 5 --pp-size 2 --prefix-cache",
        "--pp-size 2 with the prefix cache (--prefix-cache / --hicache-*) is not supported yet",
    ),
    (
        "generate --model {tiny} --prompt-ids 5 --pp-size 2 --pp-partition 6,5",
        "--pp-partition 6,5 must give every stage >= 1 layer and sum to the model's 12 layers (sums to 11)",
    ),
    ("serve --role router --prefill 127.0.0.1:9200 --decode 127.0.0.1:9100 --kv-timeout 1e9", "most it may be, 3600"),
    ("serve --role router --prefill 127.0.0.1:9200 --decode 127.0.0.1:9100 --rpc-timeout 1e9", "most it may be, 600"),
    ("serve --role router --prefill 127.0.0.1:9200 --decode 127.0.0.1:9100 --queue-timeout 1e12", "--queue-timeout"),
    ("serve --model {tiny} --request-timeout 1e300", "--request-timeout 1e+300 is over the most it may be"),
    ("serve --model {tiny} --max-json-depth 1000000", "--max-json-depth 1000000 must be at most 512"),
    ("serve --model {tiny} --http-body-timeout 1e12", "--http-body-timeout 1000000000000.0 must be at most 86400"),
    ("serve --model {tiny} --hicache-ratio 2 --hicache-storage-timeout nan", "--hicache-storage-timeout nan must be"),
    ("serve --model {tiny} --hicache-ratio 2 --hicache-storage-timeout inf", "--hicache-storage-timeout inf must be"),
    ("serve --model {topk}", "'index_topk' = 1000000000 is more than 'max_position_embeddings' = 4096"),
    ("generate --model {topk} --prompt-ids 5", "'index_topk' = 1000000000 is more than"),
    (
        "serve --role prefill --model {tiny} --port 9200 --pp-size 2 --hicache-ratio 2 --hicache-storage mooncake "
        "--mooncake-master 127.0.0.1:50051",
        "--hicache-storage mooncake with --pp-size 2: only a single-stage prefill can use the storage tier",
    ),
]


@pytest.fixture
def no_serving(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a bad config got past validation and would start serving")

    monkeypatch.setattr(server, "run_http", refuse)
    monkeypatch.setattr(serve_cmd, "run_colocated", refuse)
    monkeypatch.setattr(disagg_roles, "run_role", refuse)


def _argv(line: str, models: dict[str, Path]) -> list[str]:
    import shlex

    return [a.format(**{k: str(v) for k, v in models.items()}) for a in shlex.split(line)]


def _fill(words: str, models: dict[str, Path]) -> str:
    return words.format(**{k: str(v) for k, v in models.items()}) if "{" in words else words


@pytest.mark.parametrize("line,words", CASES, ids=[c[0][:70] for c in CASES])
def test_bad_config_is_one_line_error(models, no_serving, capsys, line, words):
    argv = _argv(line, models)
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"dsakv {argv[0]}: error: "), lines[0]
    assert _fill(words, models) in lines[0], lines[0]


def test_good_config_passes_validation(models, no_serving):
    """The same checks let the README's commands through (they reach the stubbed server)."""
    for line in (
        "serve --model {tiny} --port 8000 --kv-budget 64MiB --prefix-cache",
        "serve --role decode --model {tiny} --port 9100 --num-pages 256 --page-size 16",
        "serve --role prefill --model {tiny} --port 9200 --pp-size 2 --pp-partition 7,5 --hicache-ratio 2",
        "serve --role router --port 8000 --prefill 127.0.0.1:9200 --decode localhost:9100",
        "serve --model {tiny} --port 8000 --pp-size 2 --tp-size 2 --dp-size 2 --enable-dp-attention --ep-size 2",
        "serve --role prefill --model {tiny} --port 9250 --pp-size 2 --prefix-cache --tp-size 2 --dp-size 2 "
        "--enable-dp-attention --ep-size 2",
    ):
        with pytest.raises(AssertionError, match="would start serving"):
            main(_argv(line, models))


def test_bad_config_through_the_real_entry_point(models):
    r = subprocess.run(
        [sys.executable, "-m", "dsakv", "serve", "--model", str(models["truncated"]), "--threads", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
    assert r.stderr.startswith("dsakv serve: error: checkpoint file ") and "truncated" in r.stderr
