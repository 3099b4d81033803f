"""``_streams._on_comm_stream``, the stream switch of ``async_op`` calls and of the deep_ep
facade's ``async_finish``: the order of its two native crossings, what each records, and that
the stream is restored when the op raises. The native module is replaced by a recorder (the real
crossings need CUDA; the GPU suites run them)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ep_backend import _streams

COMM = (7, 0, 1)
PREVIOUS = (3, 0, 1)


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def _enter_comm_stream(self, *args: Any) -> tuple[int, int, int]:
        self.calls.append(("enter", *args))
        return PREVIOUS

    def _exit_comm_stream(self, previous, comm, inputs, outputs) -> None:
        self.calls.append(
            ("exit", previous, comm, [id(t) for t in inputs], [id(t) for t in outputs])
        )


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    rec = _Recorder()
    monkeypatch.setattr(_streams, "_native", lambda: rec)
    return rec


def test_runs_the_body_between_enter_and_exit_and_records_the_tensors(recorder: _Recorder) -> None:
    a, b, out = torch.zeros(1), torch.zeros(2), torch.zeros(3)

    def body() -> tuple[str, list[torch.Tensor]]:
        recorder.calls.append(("body",))
        return "result", [out]

    assert _streams._on_comm_stream(COMM, True, [a, None, b], body) == "result"
    assert recorder.calls == [
        ("enter", *COMM, True),
        ("body",),
        ("exit", PREVIOUS, COMM, [id(a), id(b)], [id(out)]),  # None inputs skipped
    ]


def test_restores_the_stream_and_records_nothing_when_the_body_raises(recorder: _Recorder) -> None:
    def body() -> tuple[str, list[torch.Tensor]]:
        raise ValueError("op failed")

    with pytest.raises(ValueError, match="op failed"):
        _streams._on_comm_stream(COMM, False, [torch.zeros(1)], body)
    assert recorder.calls == [("enter", *COMM, False), ("exit", PREVIOUS, COMM, [], [])]
