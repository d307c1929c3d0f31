"""`loadtest.random_engine`'s module constants for A/B runs (`BENCH_ENGINE_CONSTANTS`)."""

from __future__ import annotations

import pytest

from loadtest.random_engine import set_engine_constants
from service.engine import segment_launch, shared_decode


def test_engine_constants_are_set_by_module_and_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # Saved by monkeypatch (set to their own values), so the module is restored after the test.
    monkeypatch.setattr(segment_launch, "PARTIALS_MAXNREG", segment_launch.PARTIALS_MAXNREG)
    monkeypatch.setattr(segment_launch, "PREROTATE", segment_launch.PREROTATE)
    monkeypatch.setattr(shared_decode, "PREFILL_BY_REQUEST", shared_decode.PREFILL_BY_REQUEST)
    done = set_engine_constants(
        "segment_launch.PARTIALS_MAXNREG=96,segment_launch.PREROTATE=false shared_decode.PREFILL_BY_REQUEST=True"
    )
    assert done == {
        "segment_launch.PARTIALS_MAXNREG": 96,
        "segment_launch.PREROTATE": False,
        "shared_decode.PREFILL_BY_REQUEST": True,
    }
    assert segment_launch.PARTIALS_MAXNREG == 96 and segment_launch.PREROTATE is False
    assert set_engine_constants("segment_launch.PARTIALS_MAXNREG=none") == {"segment_launch.PARTIALS_MAXNREG": None}
    assert segment_launch.PARTIALS_MAXNREG is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("segment_launch.NO_SUCH_THING=1", "has no NO_SUCH_THING"),
        ("PARTIALS_MAXNREG=1", "is not module.NAME=value"),
        ("segment_launch.PARTIALS_MAXNREG=", "is not module.NAME=value"),
        ("segment_launch.PARTIALS_MAXNREG=lots", "is not an int"),
    ],
)
def test_a_wrong_engine_constant_is_an_error(text: str, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    before = segment_launch.PARTIALS_MAXNREG
    monkeypatch.setattr(segment_launch, "PARTIALS_MAXNREG", before)
    with pytest.raises(ValueError, match=message):
        set_engine_constants(text)
    assert before == segment_launch.PARTIALS_MAXNREG


def test_an_unknown_engine_module_is_an_error() -> None:
    with pytest.raises(ModuleNotFoundError):
        set_engine_constants("no_such_module.X=1")
