"""A tiny Llama built at test time: random weights from a fixed seed, a byte-level BPE
tokenizer trained here on local text. Nothing comes from a hub.

Two layers, hidden 128, 4 query heads over 2 KV heads (grouped-query attention, as the
models SGLang serves), float32. The weights are drawn wider than ``transformers``' default
(``initializer_range`` 0.5), so that a read of wrong KV changes greedy outputs at once.
The oracle for a server's outputs is this model's greedy decode in ``transformers``
(``oracle.py``), which SGLang's CPU server matches token for token in float32; where two
logits are within rounding of each other, either token is taken as right.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 512
LAYERS = 2
SEED = 1234

_WORDS = (
    "cache",
    "page",
    "token",
    "layer",
    "host",
    "device",
    "storage",
    "radix",
    "tree",
    "prefix",
    "match",
    "insert",
    "evict",
    "load",
    "back",
    "write",
    "through",
    "request",
    "server",
    "model",
    "attention",
    "kernel",
    "stream",
    "counter",
    "batch",
    "schedule",
    "chunk",
)


def _corpus(lines: int = 2000) -> list[str]:
    """Deterministic training text: sentences of the words above (no randomness source)."""
    out = []
    n = len(_WORDS)
    for i in range(lines):
        out.append(" ".join(_WORDS[(i * 7 + j * j * 3) % n] for j in range(5 + i % 11)) + ".")
    return out


def build(path: Path) -> Path:
    """Write the model and its tokenizer to ``path`` (once: an existing build is kept) and
    return ``path``."""
    path = Path(path)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    specials = ["<pad>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        pad_token_id=fast.pad_token_id,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        initializer_range=0.5,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    # SGLang reads the dtype from the config: float32 throughout.
    cfg = json.loads((path / "config.json").read_text())
    cfg["torch_dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path
