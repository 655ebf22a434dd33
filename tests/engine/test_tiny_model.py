"""The tiny model generator: offline, deterministic, idempotent, and shaped for vLLM's CPU backend."""

from __future__ import annotations

import hashlib
import json
import os

from kvpush.app.tiny_model import MARKER, TinySpec, ensure_model, is_complete


def sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_generated_once_deterministic_and_usable(tmp_path, tiny_model):
    path = ensure_model(str(tmp_path / "m"))
    assert is_complete(path, TinySpec())
    marker = os.path.join(path, MARKER)
    mtime = os.stat(marker).st_mtime_ns
    assert ensure_model(path) == path and os.stat(marker).st_mtime_ns == mtime  # present: left alone
    # The same seed gives the same bytes as the session's model directory.
    for name in ("model.safetensors", "tokenizer.json"):
        assert sha(os.path.join(path, name)) == sha(os.path.join(tiny_model, name)), name
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["dtype"] == "float32" and config["head_dim"] in (32, 64, 80, 96, 112, 128)
    assert config["num_key_value_heads"] == 2 and config["num_hidden_layers"] == 4

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = tok("The decode engine loads what landed.")["input_ids"]
    assert ids and max(ids) < config["vocab_size"]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|assistant|>\n")
    # Another spec is another model.
    assert not is_complete(path, TinySpec(seed=1))
