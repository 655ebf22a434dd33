"""The contract's types: the lifecycle is the proto's enum, the wire form of the push
parameters is what the router has always sent, and the conversions go both ways."""

from __future__ import annotations

import pytest

from kvpush.contract.layout import KvLayout, LayoutError, scales_digest
from kvpush.contract.states import (DECODE, LIVE, PREFILL, TERMINAL, LandingState, PushState, State, reported,
                                    role_from_proto, role_to_proto)
from kvpush.contract.target import PushTarget
from kvpush.contract.transfer_params import PushParams, TransferParamsError
from kvpush.contract.v1 import types_pb2


def test_the_lifecycle_is_the_proto_enum():
    proto = {name: value for name, value in types_pb2.ReservationState.items() if value}
    assert {s.name: int(s) for s in State} == proto
    assert LIVE | TERMINAL == set(State) and not LIVE & TERMINAL
    assert State(types_pb2.LANDED) is State.LANDED and State.LANDED.live and State.CONSUMED.terminal


def test_local_outcomes_map_to_reports_once():
    assert {s: reported(s) for s in PushState if reported(s)} == {PushState.FAILED: State.FAILED,
                                                                 PushState.CANCELLED: State.FAILED}
    assert {s: reported(s) for s in LandingState if reported(s)} == {
        LandingState.LANDED: State.LANDED, LandingState.CONSUMED: State.CONSUMED, LandingState.FAILED: State.FAILED}
    # The two enums share values: a cancelled landing (the control plane ended it) is not
    # a cancelled push (a failure to report).
    assert reported(LandingState.CANCELLED) is None and reported(PushState.CANCELLED) == State.FAILED
    assert {LandingState.FAILED, LandingState.CANCELLED, LandingState.CONSUMED} == {s for s in LandingState if s.ended}


def test_roles_convert_at_the_proto_edge():
    assert role_from_proto(role_to_proto(PREFILL)) == PREFILL and role_from_proto(types_pb2.DECODE) == DECODE
    with pytest.raises(ValueError, match="role"):
        role_to_proto("router")
    with pytest.raises(ValueError):
        role_from_proto(0)


def test_push_params_keep_their_wire_form():
    target = PushTarget("res-1", "decode-0", "inc1", (4, 5), 16, 20, "decode-0.inc1", 1234)
    params = PushParams("decode", target)
    wire = params.to_dict()
    assert wire == {"role": "decode", "reservation_id": "res-1", "engine_id": "decode-0",
                    "engine_incarnation": "inc1", "nixl_agent": "decode-0.inc1", "block_ids": [4, 5],
                    "block_size": 16, "num_tokens": 20, "deadline_unix_ms": 1234}
    assert PushParams.from_dict(wire) == params
    assert PushParams.from_request(params.as_kv_transfer_params()).for_role("prefill").target == target
    res = types_pb2.Reservation(id="res-1", engine_id="decode-0", engine_incarnation="inc1", nixl_agent="decode-0.inc1",
                                block_ids=[4, 5], block_size=16, num_tokens=20, deadline_unix_ms=1234)
    assert PushParams.from_reservation(res, "decode") == params
    # A decode engine of TP 2: the reservation says so, and so do the params (only then).
    res.decode_tp_size = 2
    tp2 = PushParams.from_reservation(res, "decode")
    assert tp2.target.tp_size == 2 and tp2.to_dict()["tp_size"] == 2
    assert PushParams.from_dict(tp2.to_dict()) == tp2
    # A reservation naming its prefill engine: the life named travels (its sidecar checks it).
    res.prefill_engine_id, res.prefill_engine_incarnation = "prefill-0", "p1"
    named = PushParams.from_reservation(res, "prefill")
    assert named.target.prefill_incarnation == "p1" and named.to_dict()["prefill_incarnation"] == "p1"
    assert PushParams.from_dict(named.to_dict()) == named


@pytest.mark.parametrize("change, message", [
    ({"extra": 1}, "unknown fields"),
    ({"num_tokens": None}, "kvpush transfer params"),
    ({"block_ids": [4]}, "cannot hold"),
    ({"tp_size": 0}, "tp_size must be in"),
    ({"role": "router"}, "kvpush.role"),
    ({"prefill_incarnation": 7}, "prefill_incarnation must be"),
])
def test_bad_push_params_are_refused_naming_the_field(change, message):
    good = PushParams("decode", PushTarget("r", "d", "i", (4, 5), 16, 20)).to_dict()
    with pytest.raises(TransferParamsError, match=message):
        PushParams.from_dict({**good, **change})
    missing = dict(good)
    del missing["engine_incarnation"]
    with pytest.raises(TransferParamsError, match="engine_incarnation"):
        PushParams.from_dict(missing)


def test_the_layout_converts_to_and_from_its_proto_once():
    layout = KvLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype="bfloat16", kv_parts=1)
    assert KvLayout.from_proto(layout.to_proto()) == layout
    with pytest.raises(LayoutError, match="engine.kv_layout"):
        KvLayout.from_proto(types_pb2.KvLayout(num_layers=0, block_size=16, num_kv_heads=2, head_dim=8),
                            "engine.kv_layout")


def test_fp8_layouts_carry_their_scales_and_pair_only_with_equal_ones():
    digest = scales_digest([0.5, 1.0], [1.0, 1.0])
    assert digest.startswith("sha256:") and scales_digest([1.0, 1.0], [1.0, 1.0]) == ""
    assert scales_digest([0.5, 1.0], [1.0, 1.0]) == digest != scales_digest([1.0, 0.5], [1.0, 1.0])
    fp8 = KvLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype="float8_e4m3fn", scales=digest)
    assert KvLayout.from_proto(fp8.to_proto()) == fp8 == KvLayout.from_dict(fp8.to_dict())
    assert KvLayout.parse(f"layers=2,block=16,heads=2,dim=8,dtype=float8_e4m3fn,scales={digest}") == fp8
    unit = KvLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype="float8_e4m3fn")
    assert "kv_layout.scales differs" in fp8.compatibility_error(unit)
    assert KvLayout.from_dict({k: v for k, v in unit.to_dict().items() if k != "scales"}) == unit  # older records
    with pytest.raises(LayoutError, match="kv_layout.scales is for fp8 dtypes"):
        KvLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype="bfloat16", scales=digest)
    with pytest.raises(LayoutError, match="kv_layout.scales is for fp8 dtypes"):
        KvLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype="float8_e5m2", scales="0.5")
