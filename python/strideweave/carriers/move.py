"""Movement between carriers: the completion handles and ``move_async``.

``move_async(tensor, destination)`` returns an :class:`AwaitMove` (an
:class:`AwaitResult` of the moved tensor); ``strideweave.move`` is exactly
``move_async(...).wait()``. The same objects as ``strideweave.AwaitResult``,
``strideweave.AwaitMove`` and ``strideweave.move_async``.
"""

from .._core import AwaitMove, AwaitResult, move_async

__all__ = ["AwaitResult", "AwaitMove", "move_async"]
