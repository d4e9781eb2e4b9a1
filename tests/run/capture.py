"""A fake CUDA graph capture for CPU tests: what a real capture refuses, enforced (tests/run/test_graphs.py's
docstring gives the sources), and ``device_work`` for the Python stand-ins of GPU kernels, which may read
their tensors on the host as the GPU reads them on the device."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

_DEVICE_WORK: list[bool] = []


@contextlib.contextmanager
def device_work() -> Iterator[None]:
    """Inside: a fake kernel runs (its host reads stand for the device's own)."""
    _DEVICE_WORK.append(True)
    try:
        yield
    finally:
        _DEVICE_WORK.pop()


CAPTURE_ERROR = "operation not permitted when stream is capturing"


class CaptureUnsupported(RuntimeError):
    """cudaErrorStreamCaptureUnsupported, as a real capture raises it."""


@contextlib.contextmanager
def capture_guard() -> Iterator[None]:
    """Inside: every host synchronisation and host-to-device copy tests/run/test_graphs.py's docstring lists
    raises CaptureUnsupported (outside ``device_work``)."""

    def refuse(what: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            if _DEVICE_WORK:  # a fake kernel's Python: work a real GPU does, not the host
                return original(*args, **kwargs)
            raise CaptureUnsupported(f"{CAPTURE_ERROR} ({what})")

        return refused

    patches = [(torch.Tensor, name) for name in ("item", "tolist", "cpu", "numpy", "__bool__", "nonzero")]
    patches += [(torch, name) for name in ("nonzero", "tensor", "from_numpy", "as_tensor")]
    patches += [(torch.cuda, "synchronize")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patches]
    try:
        for owner, name, original in saved:
            setattr(owner, name, refuse(name, original))
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


class FakeGraphs:
    """``run.graphs.GraphCapture`` with the capture rules enforced (module docstring); ``replays=False``:
    a replay that moves nothing (the poison must catch it)."""

    def __init__(self, replays: bool = True) -> None:
        self.replays = replays

    def capture(self, call: Callable[[], Any], calls: int) -> tuple[Callable[[], None], Any]:
        call()  # the side-stream warm-up, outside the capture
        with capture_guard():
            output = None
            for _ in range(calls):
                output = call()

        def replay() -> None:
            if self.replays:
                with capture_guard():
                    for _ in range(calls):
                        call()

        return replay, output
