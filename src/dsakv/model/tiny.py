"""make_tiny: write a small deterministic DSA checkpoint with transformers itself (real HF format).

The config is the `tiny` preset (12 GLM-5.2-shaped layers, producers 0, 1, 2, 6, 10) or,
for arch 'deepseek_v32', the same dims with every layer full. Weights are drawn from a
seeded generator, scaled by 1/sqrt(fan_in) (times a gain) so activations stay O(1) and
greedy tokens vary; norms get 1 + noise and the router bias noise, so a loader that
mixes up tensors is caught. Imports torch and transformers (lazily), dsakv.spec.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dsakv.errors import ConfigError
from dsakv.spec.presets import preset_config
from dsakv.util import byte_symbols

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

ARCHS = ("glm_moe_dsa", "deepseek_v32")
GAIN = 1.0
LM_HEAD_GAIN = 4.0


def tiny_config(arch: str = "glm_moe_dsa", layers: int = 12, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json dict of a tiny checkpoint (before transformers adds its derived fields)."""
    if arch not in ARCHS:
        raise ConfigError(f"unknown tiny arch {arch!r}: use one of {', '.join(ARCHS)}")
    if layers < 1:
        raise ConfigError(f"--layers {layers}: a model needs at least one layer")
    cfg = preset_config("tiny")
    cfg["num_hidden_layers"] = layers
    cfg["_name_or_path"] = f"tiny-{arch}"
    if arch == "deepseek_v32":
        cfg["model_type"] = "deepseek_v32"
        cfg["architectures"] = ["DeepseekV32ForCausalLM"]
        cfg.pop("index_topk_freq", None)
        cfg.pop("index_skip_topk_offset", None)
    cfg.update(overrides or {})
    return cfg


def _init_(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in sorted(list(model.named_parameters()) + list(model.named_buffers())):
            if not t.is_floating_point() or name.endswith("inv_freq"):
                continue
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            if name.endswith("e_score_correction_bias") or name.endswith(".bias"):
                t.copy_(0.1 * noise)
            elif "norm" in name:
                t.copy_(1.0 + 0.1 * noise)
            elif name.endswith("embed_tokens.weight"):
                t.copy_(noise)
            else:
                fan_in = t.shape[-1]
                gain = LM_HEAD_GAIN if name == "lm_head.weight" else GAIN
                t.copy_(noise * (gain / fan_in**0.5))


def build_tiny_hf(
    arch: str = "glm_moe_dsa", seed: int = 0, layers: int = 12, overrides: dict[str, Any] | None = None
) -> PreTrainedModel:
    """The transformers model of a tiny checkpoint, initialised (float32, eval mode)."""
    cfg = tiny_config(arch, layers, overrides)
    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "_name_or_path", "model_type", "torch_dtype")}
    if arch == "glm_moe_dsa":
        from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

        model: PreTrainedModel = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**kwargs))
    else:
        from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

        model = DeepseekV32ForCausalLM(DeepseekV32Config(**kwargs))
    _init_(model, seed)
    return model.float().eval()


def make_tiny(
    path: str | Path,
    arch: str = "glm_moe_dsa",
    seed: int = 0,
    layers: int = 12,
    overrides: dict[str, Any] | None = None,
    mtp: int = 0,
) -> Path:
    """Write the tiny checkpoint (config.json + model.safetensors + a byte-level tokenizer, see tiny_tokenizer) to
    directory `path`; returns it.

    `overrides` replaces config fields (e.g. rope_parameters for a yarn variant) before the model is built.
    `mtp` > 0 adds that many MTP (next-n) draft layers as GLM-5 / DeepSeek-V3 checkpoints store them
    (num_nextn_predict_layers, tensors model.layers.{layers + j}.*), drawn from the seeded generator too.
    """
    if mtp < 0:
        raise ConfigError(f"--mtp {mtp}: the number of MTP layers must be >= 0")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    over = dict(overrides or {})
    if mtp:
        over["num_nextn_predict_layers"] = mtp
    model = build_tiny_hf(arch, seed, layers, over)
    model.save_pretrained(str(out))
    if mtp:
        write_mtp_layers(out, init_mtp(out, mtp, seed))
    cfg = model.config
    write_tiny_tokenizer(out, int(cfg.vocab_size), int(cfg.max_position_embeddings))
    log.info("wrote tiny %s checkpoint (seed %d, %d layers, %d MTP) to %s", arch, seed, layers, mtp, out)
    return out


def init_mtp(ckpt: str | Path, num_layers: int, seed: int) -> torch.nn.Module:
    """A freshly initialised MTPDraft for the checkpoint config at `ckpt` (same scheme as the main weights)."""
    from dsakv.model.config import DSAConfig
    from dsakv.model.loader import load_config
    from dsakv.model.mtp import MTPDraft
    from dsakv.spec.model import ModelSpec

    cfg = load_config(ckpt)
    draft = MTPDraft(DSAConfig.from_dict(cfg, ModelSpec.from_dict(cfg)), num_layers).float()
    _init_(draft, seed + 7919)
    return draft


def write_mtp_layers(ckpt: str | Path, draft: torch.nn.Module) -> None:
    """Add (or replace) the draft's tensors in the checkpoint's model.safetensors under checkpoint names."""
    from safetensors.torch import load_file, save_file

    from dsakv.model.loader import load_config
    from dsakv.model.mtp import checkpoint_name

    root = Path(ckpt)
    n = int(load_config(root)["num_hidden_layers"])
    files = sorted(root.glob("*.safetensors"))
    if len(files) != 1:
        raise ConfigError(f"{str(root)!r} has {len(files)} safetensors files: the tiny writer expects exactly one")
    tensors = load_file(str(files[0]))
    for name, t in draft.state_dict().items():
        tensors[checkpoint_name(name, n)] = t.detach().to(torch.float32).contiguous().clone()
    save_file(tensors, str(files[0]), metadata={"format": "pt"})


# ---- tokenizer -----------------------------------------------------------------------------------------------

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
ROLE_TOKENS = tuple(f"<|{r}|>" for r in ("system", "developer", "user", "assistant", "tool"))
# {bos}<|role|>\n{content}\n ... <|assistant|>\n : the byte fallback's template (dsakv.serve.tokenizer) after a bos
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# merges are learned from this text (deterministic: same text, same merges, same tokenizer.json bytes)
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A tokenizer turns text into token ids, and a model reads the ids.
User: What is the capital of France? Assistant: The capital of France is Paris.
Question: How many pages does a request of one thousand tokens hold? Answer: sixty-three pages of sixteen tokens.
The key-value cache holds the keys and the values of every layer; the lightning indexer picks the top-k tokens.
def generate(prompt, max_tokens=16):
    return [token for token in model(prompt)][:max_tokens]
Hello, world! This is a small test of the tiny checkpoint's tokenizer, with numbers 0 1 2 3 4 5 6 7 8 9 10 100.
In the beginning there was the prompt, and the prompt was prefilled, and then the decode began one token at a time.
"""


def tiny_tokenizer(vocab_size: int = 512, bos_token_id: int = 0, eos_token_id: int = 1) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` for the tiny checkpoint, built locally (no download).

    Ids: bos 0 and eos 1 (the config's), byte b = id b + 2 (as dsakv's byte fallback), the chat role tokens
    <|system|> <|developer|> <|user|> <|assistant|> <|tool|> next, then BPE merges learned from a fixed text up
    to `vocab_size` ids. Any text round-trips (every byte has an id).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    if (bos_token_id, eos_token_id) != (0, 1):
        raise ConfigError(f"the tiny tokenizer puts bos/eos at ids 0/1, the config has {bos_token_id}/{eos_token_id}")
    first_merge = 2 + 256 + len(ROLE_TOKENS)
    if vocab_size < first_merge:
        raise ConfigError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer: give >= {first_merge}")
    trainer = trainers.BpeTrainer(
        vocab_size=256 + vocab_size - first_merge,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        min_frequency=1,
    )
    learn = Tokenizer(models.BPE())
    learn.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    learn.train_from_iterator([_CORPUS], trainer)
    merges = json.loads(learn.to_str())["model"]["merges"]
    pairs = (m.split(" ") if isinstance(m, str) else m for m in merges)  # "a b" (older tokenizers) or [a, b]
    merges = [(str(a), str(b)) for a, b in pairs][: vocab_size - first_merge]
    vocab: dict[str, int] = {BOS_TOKEN: bos_token_id, EOS_TOKEN: eos_token_id}
    vocab |= {s: b + 2 for b, s in enumerate(byte_symbols())}
    vocab |= {t: 2 + 256 + i for i, t in enumerate(ROLE_TOKENS)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS)]
    )
    if tok.get_vocab_size() > vocab_size:
        raise ConfigError(f"the tiny tokenizer has {tok.get_vocab_size()} ids, more than vocab_size {vocab_size}")
    return tok


def write_tiny_tokenizer(path: str | Path, vocab_size: int = 512, max_len: int | None = None) -> Path:
    """tokenizer.json + tokenizer_config.json (with the chat template) in `path`, loadable by
    transformers.AutoTokenizer.from_pretrained(path)."""
    out = Path(path)
    tiny_tokenizer(vocab_size).save(str(out / "tokenizer.json"))
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    if max_len is not None:
        cfg["model_max_length"] = max_len
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out
