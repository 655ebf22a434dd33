"""The router's tokenizer (``kvpush/router/tokens.py``) against vLLM's, with the tiny
model's byte-level BPE: the output text primed with the prompt's last tokens
(``tokens.priming``) against vLLM's detokenizer primed with the whole prompt (the
aggregated engine's), token by token, for prompts of text and of raw ids, outputs rich in
tokens that hold part of a multi-byte character and U+FFFD typed in the text; and prompt
ids from the Rust tokenizer called straight against the HF tokenizer's."""

from __future__ import annotations

import os
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpush.app import engines
from kvpush.app.tiny_model import DEFAULT_DIR, ensure_model
from kvpush.router.tokens import PRIMING, HFTokenCounter, OutputText, priming

vllm_detok = pytest.importorskip("vllm.v1.engine.detokenizer", reason="vLLM is installed by scripts/setup.sh")

MODEL_DIR = ensure_model(os.path.join(engines.ROOT, DEFAULT_DIR))
COUNTER = HFTokenCounter(MODEL_DIR)
RUST = COUNTER._rust
VOCAB = COUNTER.vocab_size
# Tokens that hold part of a character (alone they decode to U+FFFD).
SPLIT = [t for t in range(VOCAB) if "\ufffd" in RUST.decode([t])]
PIECES = ["é", "ü", "日本", "😀", "\ufffd", " the", " push", "ed", " KV", ",", "\n", "  ", "a", "Z9"]


def vllm_texts(prompt: list[int], output: list[int]) -> list[str]:
    params = types.SimpleNamespace(stop=None, min_tokens=0, include_stop_str_in_output=False,
                                   skip_special_tokens=True, spaces_between_special_tokens=True)
    request = types.SimpleNamespace(sampling_params=params, request_id="x", prompt_token_ids=prompt)
    detok = vllm_detok.FastIncrementalDetokenizer(COUNTER._tok, request)
    return [detok.decode_next(t) for t in output]


def router_texts(prompt: list[int], output: list[int]) -> list[str]:
    out = COUNTER.output_text(prompt)
    return [out.step(t) for t in output]


text_prompts = st.lists(st.sampled_from(PIECES), min_size=20, max_size=200).map(
    lambda parts: COUNTER.completion_ids("".join(parts)))
id_prompts = st.lists(st.one_of(st.sampled_from(SPLIT), st.integers(0, VOCAB - 1)), min_size=1, max_size=120)
outputs = st.lists(st.one_of(st.sampled_from(SPLIT), st.integers(0, VOCAB - 1),
                             st.sampled_from(PIECES).map(lambda p: RUST.encode(p, add_special_tokens=False).ids[0])),
                   min_size=1, max_size=16)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.one_of(text_prompts, id_prompts), output=outputs)
def test_texts_equal_vllm_primed_with_the_whole_prompt(prompt, output):
    assert router_texts(prompt, output) == vllm_texts(prompt, output)


def test_a_long_text_prompt_primes_with_a_few_tokens():
    prompt = COUNTER.completion_ids(" ".join(["the KV is pushed é 日本 😀"] * 400))
    assert len(prompt) > 2000
    primed = priming(RUST, prompt)
    assert 4 <= len(primed) < PRIMING and primed == prompt[-len(primed):]
    output = RUST.encode(" and decode starts 😀 at once", add_special_tokens=False).ids
    assert router_texts(prompt, output) == vllm_texts(prompt, output)


def test_a_prompt_ending_inside_a_character_primes_with_all_of_it():
    """vLLM's first text is then the whole prompt's text and the token's; so is ours."""
    ids = RUST.encode("日本 " * 40 + "😀", add_special_tokens=False).ids
    assert "\ufffd" in RUST.decode(ids[-1:])
    prompt = ids[:-1]   # ends with part of the emoji
    assert priming(RUST, prompt) == prompt
    texts = router_texts(prompt, ids[-1:] + [ids[0]])
    assert texts == vllm_texts(prompt, ids[-1:] + [ids[0]])
    assert texts[0].startswith("日本 日本")


def test_a_metaspace_tokenizers_leading_space_after_special_tokens():
    """A SentencePiece-style tokenizer (a metaspace decoder, or Llama's strip) drops the
    leading space of a decode's first text: primed with special tokens alone (skipped),
    the next token would be that first text and lose its space; primed with the whole
    prompt it keeps it. The suffix then reaches back to a token with text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.decoders import DecodeStream
    vocab = {"<unk>": 0, "</s>": 1, "▁Hello": 2, "▁world": 3, "▁the": 4, "▁KV": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    llama = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                               decoders.Strip(" ", 1, 0)])
    for decoder, ending in [(d, e) for d in (decoders.Metaspace(), llama)
                            for e in ([1] * 6, [1] * 40, [5, 1, 1, 1, 1])]:
        tok.decoder = decoder
        prompt = [2, 3, 4, 5] * 10 + ending
        whole = DecodeStream(ids=prompt, skip_special_tokens=True)
        expected = [whole.step(tok, t) for t in (3, 4, 2)]
        assert expected[0] == " world"
        out = OutputText(tok, prompt)
        assert [out.step(t) for t in (3, 4, 2)] == expected
        assert tok.decode(priming(tok, prompt), True)


def test_short_prompts_prime_whole():
    prompt = COUNTER.completion_ids("the KV")
    assert priming(RUST, prompt) == prompt


texts = st.lists(st.sampled_from(PIECES + ["<s>", "</s>", "<|im_start|>", "<|endoftext|>", "\t", "ß"]),
                 min_size=1, max_size=60).map("".join)


@settings(max_examples=200, deadline=None)
@given(text=texts)
def test_prompt_ids_are_the_hf_tokenizers(text):
    """The Rust tokenizer called straight gives what the HF one (vLLM's) gives."""
    hf = COUNTER._tok
    assert COUNTER.completion_ids(text) == list(hf(text)["input_ids"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    assert COUNTER.chat_ids(messages) == list(hf.apply_chat_template(messages, add_generation_prompt=True,
                                                                      tokenize=True, return_dict=False))
