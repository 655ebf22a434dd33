"""A tiny random-weight Llama and its tokenizer, generated locally from a seed.

vLLM needs a model directory to serve; tests, the demo and benchmarks need one
that is small, float32, deterministic and made without the network. This
module trains a byte-level BPE tokenizer on the text below (a few KB), builds
a ``LlamaConfig`` with head sizes the CPU attention backend accepts, draws the
weights from ``seed`` and saves both with ``save_pretrained``.

Greedy decoding on random weights is only useful if the argmax is clear-cut:
otherwise the last bits of float arithmetic (one batch shape against another)
can flip a token and an equality test would test the noise. The weights are
therefore drawn with a larger spread than training would use
(``initializer_range``), which makes the logits peaky.

``ensure_model(path)`` is idempotent and safe to call from several processes
at once: it builds into a private temporary directory and renames it into
place; a complete directory (marker file with the same spec) is left alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

DEFAULT_DIR = ".kvpush/models/tiny-llama"
MARKER = "kvpush-tiny-model.json"

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# The training text: varied English, numbers and code-like lines, so common words
# become single tokens and anything else still encodes (byte-level fallback).
CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Disaggregated serving splits a request in two: the prefill engine reads the whole prompt at once and
writes its key and value cache; the decode engine generates one token after another. Moving the cache
from one engine to the other is the handover, and kvpush pushes it layer by layer while the next layer
is still being computed, so that only the last layer's write remains on the critical path.
The control plane reserves landing blocks on a decode engine before the prefill starts. Each engine
has a sidecar process that owns the network agent and the registered memory; the connector inside the
engine copies the cache into staging memory and asks the sidecar to push it. When every byte has landed
the decode sidecar reports LANDED, the connector copies the blocks into the engine's own cache and the
request starts decoding without computing its prompt again.
Once upon a time there was a little robot who wanted to learn how to paint. Every morning it rolled to
the window, looked at the sky and tried to mix the exact colour of the clouds. Some days the clouds were
white, some days grey, and on the best days they were pink and orange and gold.
Water boils at one hundred degrees Celsius at sea level. The speed of light is about three hundred
thousand kilometres per second. There are seven days in a week, twelve months in a year and twenty four
hours in a day. One, two, three, four, five, six, seven, eight, nine, ten.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))

class Queue:
    def __init__(self):
        self.items = []
    def push(self, item):
        self.items.append(item)
    def pop(self):
        return self.items.pop(0)

SELECT name, count(*) FROM requests WHERE state = 'LANDED' GROUP BY name ORDER BY 2 DESC;
{"model": "tiny-llama", "prompt": "Hello", "max_tokens": 16, "temperature": 0}
Question: what is the capital of France? Answer: Paris is the capital of France.
Question: how many legs does a spider have? Answer: a spider has eight legs.
Question: what colour is the sky on a clear day? Answer: the sky is blue.
She sells sea shells by the sea shore. Peter Piper picked a peck of pickled peppers.
To be, or not to be, that is the question. All that glitters is not gold.
The rain in Spain stays mainly in the plain. Early to bed and early to rise.
In the beginning the universe was created. This has made a lot of people very angry and been widely
regarded as a bad move. Far out in the uncharted backwaters of the unfashionable end of the western
spiral arm of the galaxy lies a small unregarded yellow sun.
Tokens, blocks, layers, heads, keys, values, caches, engines, requests, reservations, deadlines.
Hello, world! How are you today? I am fine, thank you. And you? Good morning, good evening, good night.
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 32 64 128 256 512 1024 2048 4096
"""


@dataclasses.dataclass(frozen=True)
class TinySpec:
    seed: int = 0
    vocab_size: int = 1024  # target for the BPE trainer (the text may yield fewer)
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 2048
    initializer_range: float = 0.2

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def is_complete(path: str, spec: TinySpec | None = None) -> bool:
    """True when ``path`` holds a model made by this module (with ``spec``, when given)."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return False
    if spec is not None and marker.get("spec") != spec.to_dict():
        return False
    return all(os.path.exists(os.path.join(path, name)) for name in marker.get("files", []))


def build_tokenizer(spec: TinySpec):
    """A byte-level BPE tokenizer trained on ``CORPUS`` (deterministic)."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, min_frequency=1, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([line for line in CORPUS.splitlines() if line.strip()], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>",
                                   additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = spec.max_position_embeddings
    return fast


def build_model(spec: TinySpec, tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings, initializer_range=spec.initializer_range,
        rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="float32",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.eval()
    return model


def generate(path: str, spec: TinySpec = TinySpec()) -> str:
    """Build the model into ``path`` unconditionally (atomically replacing nothing:
    the caller decides; see ``ensure_model``)."""
    tokenizer = build_tokenizer(spec)
    model = build_model(spec, tokenizer)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    files = sorted(n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n)))
    with open(os.path.join(path, MARKER), "w") as f:
        json.dump({"spec": spec.to_dict(), "files": files}, f, indent=1)
    return path


def ensure_model(path: str = DEFAULT_DIR, spec: TinySpec = TinySpec(), force: bool = False) -> str:
    """The model directory at ``path``, generated if missing or incomplete. Returns the absolute path."""
    path = os.path.abspath(path)
    if not force and is_complete(path, spec):
        return path
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-model-", dir=parent)
    try:
        generate(tmp, spec)
        if os.path.exists(path):
            if not force and is_complete(path, spec):  # another process won the race
                return path
            shutil.rmtree(path, ignore_errors=True)
        try:
            os.rename(tmp, path)
        except OSError:
            if not is_complete(path, spec):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def main(argv: list[str] | None = None) -> None:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    run(p.parse_args(argv))


def add_arguments(p) -> None:
    p.add_argument("--out", default=DEFAULT_DIR, help=f"model directory (default {DEFAULT_DIR})")
    p.add_argument("--seed", type=int, default=TinySpec.seed)
    p.add_argument("--layers", type=int, default=TinySpec.num_layers)
    p.add_argument("--force", action="store_true", help="rebuild even if the directory is complete")


def run(args) -> None:
    spec = TinySpec(seed=args.seed, num_layers=args.layers)
    path = ensure_model(args.out, spec, force=args.force)
    print(path)


if __name__ == "__main__":
    main()
