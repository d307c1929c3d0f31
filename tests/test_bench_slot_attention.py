"""The slot-attention benchmark refuses bad arguments before it looks for a GPU, naming what is wrong."""

from __future__ import annotations

import pytest

from loadtest.bench_slot_attention import main


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--shares", "0"], "--shares"),
        (["--shares", "1.5"], "--shares"),
        (["--runs", "0"], "--runs"),
        (["--configs", "128/64"], "--configs"),
        (["--configs", "128/0/8"], "--configs"),
        (["--configs", "a/64/8"], "--configs"),
    ],
)
def test_bad_arguments_are_refused_by_name(argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err
