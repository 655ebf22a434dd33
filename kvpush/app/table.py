"""Plain-text tables for the CLI and benchmark reports."""

from __future__ import annotations


def render(headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown(headers: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(out)


# A reason may be 512 characters (the registry's limit): the table shows its start,
# ``kvpush status --json`` the whole of it.
REASON_WIDTH = 48
ENGINE_HEADERS = ["engine", "role", "model", "pool", "blocks", "free", "reserved", "live res.", "available"]


def availability(engine: dict) -> str:
    """The engine's "available" cell: yes, or no and why, shortened. An unavailable engine
    takes no reservation, however free its blocks look."""
    why = " ".join(engine.get("unavailable", "").split())
    if not why:
        return "yes"
    text = f"no: {why}"
    return text if len(text) <= REASON_WIDTH else text[:REASON_WIDTH - 3] + "..."


def engines_table(status_engines: list[dict]) -> str:
    """The engines of ``kvpush status`` (GetStatus as JSON: absent fields are zero or empty)."""
    rows = [[e["engine_id"], e.get("role", ""), e.get("model", ""), e.get("pool", ""), e.get("num_blocks", 0),
             e.get("free_blocks", 0), e.get("reserved_blocks", 0), e.get("live_reservations", 0), availability(e)]
            for e in status_engines]
    return render(ENGINE_HEADERS, rows)
