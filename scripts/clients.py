"""Third-party clients against a real `dsakv serve`: lm-eval and guidellm, their outputs parsed and checked.

    python scripts/clients.py --tools /path/to/tools-venv/bin [--workdir DIR] [--keep]

What it does (exit 0 only if every check passes; one line per check):

1. `dsakv make-tiny` a checkpoint (with its byte-level tokenizer) and start `dsakv serve` on it (this Python, so
   this checkout's dsakv), prefix cache on.
2. lm-eval (`lm_eval --model local-completions`, tokenized requests, the checkpoint's tokenizer) runs two local
   tasks: a multiple-choice loglikelihood task (echo + logprobs) and a generate_until task. Checked: every
   document scored; each loglikelihood equals the sum of log_softmax of transformers' logits over the
   continuation tokens (within 1e-3); each generation equals dsakv's greedy Engine on the same prompt ids cut
   at the task's stop string; the server counted exactly the requests lm-eval sent.
3. guidellm (`guidellm run`, openai_http backend, synthetic text, the checkpoint's tokenizer) runs a bounded
   constant-rate load of N chat requests. Checked: N successful, 0 errored or incomplete, each with exactly
   output_tokens completion tokens and the prompt tokens the chat template gives for its text (the usage the
   server reported), and the server counted N more requests.

The tools are heavy (lm-eval pulls datasets/pandas/pyarrow/scipy/scikit-learn, guidellm datasets/pandas/
pyarrow; in a fresh venv they also pull a CUDA torch, ~6 GB), so they are not in the `test` extra: give a venv
that has them (`python -m venv T && T/bin/pip install "lm_eval[api]" guidellm`); it needs no dsakv.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

LL_DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " London", " a fox"], "label": 0},
    {"question": "The quick brown fox jumps over the", "choices": [" lazy dog", " moon"], "label": 0},
    {"question": "One, two, three,", "choices": [" four", " seven", " ten"], "label": 0},
    {"question": "The key-value cache holds the keys and the", "choices": [" values", " doors"], "label": 0},
]
GEN_DOCS = [
    {"question": "Hello, world! This is", "answer": " a small test"},
    {"question": "def generate(prompt, max_tokens=16):", "answer": "\n    return"},
    {"question": "In the beginning there was the", "answer": " prompt"},
]
GEN_UNTIL = "\n\n"
GEN_TOKENS = 8
LOAD_REQUESTS, LOAD_PROMPT, LOAD_OUTPUT, LOAD_RATE = 12, 32, 8, 4

FAILED: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"  {'ok ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        FAILED.append(what)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def requests_total(url: str) -> int:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("dsakv_requests_total "):
            return int(float(line.split()[1]))
    raise RuntimeError("no dsakv_requests_total on /metrics")


def write_tasks(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "ll.jsonl").write_text("".join(json.dumps(d) + "\n" for d in LL_DOCS))
    (root / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN_DOCS))
    common = 'dataset_path: json\ntest_split: test\ndoc_to_text: "{{question}}"\ntarget_delimiter: ""\n'
    (root / "dsakv_ll.yaml").write_text(
        f"task: dsakv_ll\n{common}dataset_kwargs:\n  data_files: {{test: {root / 'll.jsonl'}}}\n"
        'output_type: multiple_choice\ndoc_to_choice: "{{choices}}"\ndoc_to_target: label\n'
        "metric_list:\n  - metric: acc\n"
    )
    (root / "dsakv_gen.yaml").write_text(
        f"task: dsakv_gen\n{common}dataset_kwargs:\n  data_files: {{test: {root / 'gen.jsonl'}}}\n"
        'output_type: generate_until\ndoc_to_target: "{{answer}}"\n'
        f"generation_kwargs:\n  until: [{json.dumps(GEN_UNTIL)}]\n  max_gen_toks: {GEN_TOKENS}\n"
        "  do_sample: false\n  temperature: 0\nmetric_list:\n  - metric: exact_match\n"
    )


def run_tool(cmd: list[str], log: Path, timeout: float) -> int:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)  # the tools' venv, not this checkout
    print(f"$ {' '.join(cmd)}", flush=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
    if rc != 0:
        print(log.read_text()[-4000:])
    return rc


class Reference:
    """transformers' logits and dsakv's greedy Engine on the same checkpoint, for the checks."""

    def __init__(self, ckpt: Path) -> None:
        import torch
        import transformers

        from dsakv.config import EngineConfig, LayoutConfig, PoolConfig
        from dsakv.engine.engine import Engine

        self.torch = torch
        self.tok = transformers.AutoTokenizer.from_pretrained(str(ckpt))
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
        self.engine = Engine(ckpt, EngineConfig(layout=LayoutConfig(page_size=16), pool=PoolConfig(num_pages=64)))

    def loglikelihood(self, context: str, continuation: str) -> float:
        """As lm-eval splits it: encode(context + continuation), the context's tokens first."""
        whole = self.tok.encode(context + continuation, add_special_tokens=False)
        n = len(self.tok.encode(context, add_special_tokens=False))
        with self.torch.no_grad():
            lp = self.torch.log_softmax(self.hf(self.torch.tensor([whole])).logits[0].float(), -1)
        return float(sum(lp[i - 1, whole[i]].item() for i in range(n, len(whole))))

    def greedy_text(self, context: str) -> str:
        from dsakv.engine.request import SamplingParams

        ids = self.tok.encode(context, add_special_tokens=False)
        out = self.engine.generate([ids], SamplingParams(max_new_tokens=GEN_TOKENS))[0]
        text = self.tok.decode(out, skip_special_tokens=False)
        return text.split(GEN_UNTIL)[0]


def check_lm_eval(tools: Path, url: str, ckpt: Path, work: Path, ref: Reference) -> None:
    print("lm-eval: local-completions, a loglikelihood task and a generate task", flush=True)
    tasks, out = work / "tasks", work / "lmeval"
    write_tasks(tasks)
    before = requests_total(url)
    args = (
        f"model=tiny,base_url={url}/v1/completions,tokenizer={ckpt},tokenizer_backend=huggingface,"
        "tokenized_requests=True,num_concurrent=2,max_retries=1"
    )
    cmd = [str(tools / "lm_eval"), "--model", "local-completions", "--model_args", args]
    cmd += ["--tasks", "dsakv_ll,dsakv_gen", "--include_path", str(tasks), "--output_path", str(out), "--log_samples"]
    rc = run_tool(cmd, work / "lmeval.log", 900)
    check(rc == 0, f"lm_eval exited {rc}")
    if rc != 0:
        return
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    check({"dsakv_ll", "dsakv_gen"} <= set(results), f"results for both tasks: {sorted(results)}")
    ll = [json.loads(x) for x in next(out.rglob("samples_dsakv_ll_*.jsonl")).read_text().splitlines()]
    gen = [json.loads(x) for x in next(out.rglob("samples_dsakv_gen_*.jsonl")).read_text().splitlines()]
    check(len(ll) == len(LL_DOCS) and len(gen) == len(GEN_DOCS), f"{len(ll)} + {len(gen)} documents scored")
    worst, n_ll = 0.0, 0
    for s in ll:
        for i, choice in enumerate(s["doc"]["choices"]):
            got = float(s["resps"][i][0][0])
            worst = max(worst, abs(got - ref.loglikelihood(s["doc"]["question"], choice)))
            n_ll += 1
    check(worst < 1e-3, f"{n_ll} loglikelihoods equal transformers' (max |diff| {worst:.2e})")
    same = sum(s["resps"][0][0] == ref.greedy_text(s["doc"]["question"]) for s in gen)
    check(same == len(gen), f"{same}/{len(gen)} generations equal dsakv's greedy engine")
    sent = requests_total(url) - before
    check(sent == n_ll + len(gen), f"server counted {sent} requests, lm-eval sent {n_ll} + {len(gen)}")
    acc = results["dsakv_ll"].get("acc,none")
    print(f"  lm-eval: dsakv_ll acc {acc}, dsakv_gen exact_match {results['dsakv_gen'].get('exact_match,none')}")


def check_guidellm(tools: Path, url: str, ckpt: Path, work: Path, ref: Reference) -> None:
    print(f"guidellm: {LOAD_REQUESTS} synthetic chat requests at {LOAD_RATE}/s", flush=True)
    before = requests_total(url)
    report = work / "guidellm.json"
    cmd = [str(tools / "guidellm"), "run", "--backend", f"kind=openai_http,target={url},model=tiny"]
    cmd += ["--profile", f"kind=constant,rate={LOAD_RATE}", "--constraint", f"kind=max_requests,count={LOAD_REQUESTS}"]
    cmd += ["--data", f"kind=synthetic_text,prompt_tokens={LOAD_PROMPT},output_tokens={LOAD_OUTPUT}"]
    cmd += ["--tokenizer", f"kind=huggingface_auto,model={ckpt}", "--output", f"kind=json,path={report}"]
    cmd += ["--disable-console-interactive"]
    rc = run_tool(cmd, work / "guidellm.log", 900)
    check(rc == 0, f"guidellm exited {rc}")
    if rc != 0:
        return
    (bench,) = json.loads(report.read_text())["benchmarks"]
    totals = bench["metrics"]["request_totals"]
    check(
        (totals["successful"], totals["errored"], totals["incomplete"]) == (LOAD_REQUESTS, 0, 0),
        f"requests successful/errored/incomplete {totals['successful']}/{totals['errored']}/{totals['incomplete']}",
    )
    reqs: list[dict[str, Any]] = bench["requests"]["successful"]
    check(all(r["output_tokens"] == LOAD_OUTPUT for r in reqs), f"every request got {LOAD_OUTPUT} output tokens")
    exact = 0
    for r in reqs:
        body = json.loads(r["request_args"])["body"]
        msgs = [{"role": m["role"], "content": "".join(p["text"] for p in m["content"])} for m in body["messages"]]
        ids = ref.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        exact += r["prompt_tokens"] == len(ids)
    check(exact == len(reqs), f"{exact}/{len(reqs)} prompt token counts equal the chat template's")
    sent = requests_total(url) - before
    check(sent == LOAD_REQUESTS, f"server counted {sent} requests")
    tps = bench["metrics"]["output_tokens_per_second"]["successful"]["mean"]
    print(f"  guidellm: {len(reqs)} requests, mean output {tps:.1f} tok/s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tools", required=True, type=Path, help="bin/ of a venv with lm_eval[api] and guidellm")
    ap.add_argument("--workdir", type=Path, help="where the checkpoint, logs and reports go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the workdir")
    ap.add_argument("--only", choices=("lm-eval", "guidellm"), help="run one client only")
    args = ap.parse_args(argv)
    for tool in ("lm_eval", "guidellm"):
        if not (args.tools / tool).exists() and args.only in (None, tool.replace("_", "-")):
            ap.error(f"{args.tools / tool} does not exist: --tools is the bin/ of a venv with lm_eval and guidellm")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dsakv-clients-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "ckpt"
    subprocess.run([sys.executable, "-m", "dsakv", "make-tiny", str(ckpt)], check=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(work / "serve.log", "w")  # noqa: SIM115
    serve = [sys.executable, "-m", "dsakv", "serve", "--model", str(ckpt), "--port", str(port)]
    serve += ["--served-model-name", "tiny", "--prefix-cache", "--threads", "1"]
    proc = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                print((work / "serve.log").read_text()[-4000:])
                return 1
            time.sleep(0.2)
        print(f"dsakv serve on {url} ({ckpt})", flush=True)
        ref = Reference(ckpt)
        if args.only in (None, "lm-eval"):
            check_lm_eval(args.tools, url, ckpt, work, ref)
        if args.only in (None, "guidellm"):
            check_guidellm(args.tools, url, ckpt, work, ref)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"clients: {'all checks passed' if not FAILED else f'{len(FAILED)} checks FAILED'}")
    return 0 if not FAILED else 1


if __name__ == "__main__":
    sys.exit(main())
