"""The router's memory of the turns it sent (kvpush/router/kv_aware.py): which later prompts
extend them, by how much, and the guess it makes from that."""

from __future__ import annotations

from kvpush.contract.block_hash import BlockHasher
from kvpush.router.config import RouterConfig
from kvpush.router.kv_aware import Guess, GuessHold, KvAware, RecentTurns

HASHER = BlockHasher(16)


def cfg(**kw) -> RouterConfig:
    return RouterConfig(controlplane="127.0.0.1:1", token="", model="tiny", prefill_urls=(), decode=(),
                        **{"prefix_block_size": 16, "local_prefill_tokens": 20, **kw})


def rest(turns: RecentTurns, keys, num_tokens: int) -> int | None:
    found = turns.extends(keys, num_tokens)
    return None if found is None else found[0]


def alone(kv: KvAware, prompt, salt=None) -> bool | None:
    guess = kv.guess(kv.keys(prompt, salt), len(prompt))
    return None if guess is None else guess.alone


def test_a_prompt_extending_a_sent_one_has_the_rest_beyond_it_and_its_answer():
    turns = RecentTurns()
    first = list(range(100, 170))                      # 70 tokens: 4 full blocks
    turns.add(HASHER.keys(first)[-1], 70 + 8)              # its answer adds at most 8
    assert rest(turns, HASHER.keys(first + list(range(12))), 82) == 4
    assert rest(turns, HASHER.keys(first + list(range(5))), 75) == 0  # (within the answer's bound)
    # Another conversation, or this one changed before the end of the sent prompt: no match.
    assert rest(turns, HASHER.keys(list(range(200, 300))), 100) is None
    assert rest(turns, HASHER.keys(first[:40] + [1] * 60), 100) is None
    # The longest sent prompt it extends counts.
    second = first + list(range(8)) + list(range(500, 540))  # turn 2: 118 tokens
    turns.add(HASHER.keys(second)[-1], 118 + 8)
    assert rest(turns, HASHER.keys(second + list(range(8)) + [9] * 10), 136) == 10


def test_the_memory_is_bounded_and_keeps_the_recently_extended():
    turns = RecentTurns(capacity=2)
    prompts = [[k] * 32 for k in range(3)]
    turns.add(HASHER.keys(prompts[0])[-1], 32)
    turns.add(HASHER.keys(prompts[1])[-1], 32)
    assert rest(turns, HASHER.keys(prompts[0] + [1]), 33) == 1  # a hit: prompts[0] is the newest now
    turns.add(HASHER.keys(prompts[2])[-1], 32)                     # ... so prompts[1] goes
    assert len(turns) == 2
    assert rest(turns, HASHER.keys(prompts[1] + [1]), 33) is None
    assert rest(turns, HASHER.keys(prompts[0] + [1]), 33) == 1


def test_the_guess():
    kv = KvAware(cfg(), 750)
    first = list(range(100, 164))
    keys = kv.keys(first)
    assert alone(kv, first) is False                   # nothing sent yet: the prefill request leaves early
    kv.sent(keys, 64, max_tokens=16)
    short, long_ = first + list(range(16 + 19)), first + list(range(16 + 20))
    assert alone(kv, short) is True       # 19 new: under the threshold of 20
    assert alone(kv, long_) is False      # 20 new
    # A salted prompt's keys are salted: it extends only turns sent with the same salt.
    assert alone(kv, short, "tenant-a") is False
    kv.sent(kv.keys(first, "tenant-a"), 64, max_tokens=16)
    assert alone(kv, short, "tenant-a") is True
    # An unknown bound on the answer (the context unknown): any extension may be its answer.
    kv.sent(kv.keys(list(range(300, 332))), 32, max_tokens=None)
    much = list(range(300, 332)) + list(range(500))
    assert alone(kv, much) is True


def test_no_guess_without_keys_or_decode_alone():
    for off in (cfg(prefix_block_size=0), cfg(local_prefill_tokens=0)):
        kv = KvAware(off, 750)
        keys = kv.keys(list(range(64))) or tuple(HASHER.keys(list(range(64))))
        kv.sent(keys, 64, 8)
        assert kv.guess(keys, 64) is None
    assert KvAware(cfg(), 750).guess((), 64) is None


def test_the_guess_names_the_engine_that_served_the_turn_it_extends():
    kv = KvAware(cfg(), 750)
    first = list(range(100, 164))
    keys = kv.keys(first)
    kv.sent(keys, 64, max_tokens=16)
    nxt = first + list(range(16 + 5))
    assert kv.guess(kv.keys(nxt), len(nxt)) == Guess(True, 5, "")  # its Reserve has not answered yet
    kv.served(keys, "decode-1")
    assert kv.guess(kv.keys(nxt), len(nxt)) == Guess(True, 5, "decode-1")
    kv.served(kv.keys(list(range(64))), "decode-0")  # a prompt never sent: nothing remembered
    assert kv.guess(kv.keys(list(range(64)) + [1]), 65) == Guess(False, 65, "")
    # Sent again (a retry, or the same prompt anew): who serves it is not known until it is.
    kv.sent(keys, 64, max_tokens=16)
    assert kv.guess(kv.keys(nxt), len(nxt)).engine_id == ""


def test_a_guessed_turns_hold_follows_the_reserves_round_trips():
    hold = GuessHold(floor_ms=20, ceiling_ms=750)
    for _ in range(GuessHold.MIN_SEEN - 1):
        hold.observe(0.004)
    assert hold.ms == 750                               # too few seen: the Reserve's own timeout
    hold.observe(0.004)
    assert hold.ms == 20                                # 2 x p99 = 8 ms, under the floor
    for _ in range(GuessHold.WINDOW):                   # the control plane slows: 30 ms round trips
        hold.observe(0.030)
    assert hold.ms == 60
    for k in range(GuessHold.WINDOW):                   # a tail: 3 in 256 wait 0.2 s
        hold.observe(0.2 if k % 100 == 0 else 0.010)
    assert hold.ms == 400                               # (p99 is the tail's)
    for k in range(GuessHold.WINDOW):                   # timeouts: the ceiling, not past it
        hold.observe(0.5 if k % 2 else 0.010)
    assert hold.ms == 750

