"""``kvpush status``'s engine table says whether each engine can take reservations."""

from __future__ import annotations

from kvpush.app.table import REASON_WIDTH, availability, engines_table


def test_an_unavailable_engine_says_so_and_why():
    table = engines_table([
        {"engine_id": "decode-0", "role": "DECODE", "model": "tiny", "num_blocks": 16, "free_blocks": 16},
        {"engine_id": "decode-1", "role": "DECODE", "model": "tiny", "num_blocks": 16, "free_blocks": 16,
         "unavailable": "engine not connected yet"},
    ]).splitlines()
    assert table[0].split() == ["engine", "role", "model", "pool", "blocks", "free", "reserved", "live", "res.",
                                "available"]
    assert table[2].endswith("  yes") and table[2].startswith("decode-0")
    assert table[3].endswith("  no: engine not connected yet") and table[3].startswith("decode-1")


def test_a_long_reason_is_shortened_on_one_line():
    why = "engine's OpenAI server not answering:\n  ConnectionRefusedError: " + "x" * 500
    cell = availability({"unavailable": why})
    assert len(cell) == REASON_WIDTH and cell.endswith("...") and "\n" not in cell
    assert cell == "no: engine's OpenAI server not answering: Con..."
