"""A step's small host-built tensors moved to the device in one copy.

``torch.tensor(values, device="cuda")`` is a copy from pageable memory that torch follows with a stream
synchronize, so a step whose metadata were built that way waited for the device once per tensor (about
forty times with adapters: the attention tables, the token ids, and eight tables per SGMV group). The
builders make their tensors on the host instead, and :func:`move_to_device` moves every tensor of the
step's metadata at once: their bytes are packed into one pinned buffer, copied with ``non_blocking=True``
(the copy waits for nothing on the host; the compute stream runs it in order), and each tensor becomes a
view of the device copy at its own aligned offset. On CPU nothing moves.

The tensors are found through the fields of frozen dataclasses (the per-step values: metadata, plans),
dict values and tuple items. Mutable objects are state, not values, and are never walked: a step's
sequences and their adapters' host copies stay where they are. A new object is built wherever a tensor
inside it moved.
"""

import dataclasses
import itertools
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

ALIGN_BYTES = 16  # every tensor starts at a multiple of this in the buffer: the widest element is 8 bytes


def move_to_device(tree: T, device: torch.device) -> T:
    """``tree`` (a tensor, or dataclasses and dicts holding tensors) with its host tensors on ``device``."""
    if device.type == "cpu":
        return tree
    return pack_and_move(
        tree,
        alloc=lambda num_bytes: torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True),
        copy=lambda buffer: buffer.to(device, non_blocking=True),
    )


def pack_and_move(
    tree: T,
    alloc: Callable[[int], torch.Tensor],
    copy: Callable[[torch.Tensor], torch.Tensor],
) -> T:
    """Pack ``tree``'s CPU tensors into ``alloc(num_bytes)`` (a uint8 host buffer), move it with one ``copy``, and
    return ``tree`` with each of those tensors replaced by its view of the copied buffer.

    The device is factored out: :func:`move_to_device` passes a pinned buffer and a non-blocking copy.
    """
    found: dict[int, torch.Tensor] = {}  # by id, in the order met: a tensor named twice moves once
    _collect(tree, found)
    tensors = list(found.values())
    if not tensors:
        return tree
    sizes = [tensor.numel() * tensor.element_size() for tensor in tensors]
    starts = list(itertools.accumulate((-(-size // ALIGN_BYTES) * ALIGN_BYTES for size in sizes), initial=0))
    host = alloc(starts[-1])  # [num_bytes] uint8
    spans = list(zip(tensors, starts, sizes, strict=False))  # (tensor, first byte, bytes)
    for tensor, start, size in spans:
        host[start : start + size].copy_(tensor.contiguous().view(-1).view(torch.uint8))
    moved = copy(host)  # [num_bytes] uint8, the one copy
    views = {
        id(tensor): moved[start : start + size].view(tensor.dtype).view(tensor.shape) for tensor, start, size in spans
    }
    return _replace(tree, views)


def _is_value(node: object) -> bool:
    """A frozen dataclass instance: walked. A mutable one (a sequence, an adapter entry) is not."""
    return dataclasses.is_dataclass(node) and not isinstance(node, type) and node.__dataclass_params__.frozen


def _collect(node: object, found: dict[int, torch.Tensor]) -> None:
    if isinstance(node, torch.Tensor):
        if node.device.type == "cpu":
            found.setdefault(id(node), node)
    elif _is_value(node):
        for field in dataclasses.fields(node):
            _collect(getattr(node, field.name), found)
    elif isinstance(node, dict):
        for value in node.values():
            _collect(value, found)
    elif isinstance(node, tuple):
        for value in node:
            _collect(value, found)


def _replace(node: T, views: dict[int, torch.Tensor], memo: dict[int, object] | None = None) -> T:
    """``node`` with its moved tensors replaced; an object met twice becomes one new object (``memo``, by id), so
    references between values survive the move (a plan that names the metadata it was built for still names
    the moved metadata)."""
    memo = {} if memo is None else memo
    if id(node) in memo:
        return memo[id(node)]  # type: ignore[return-value]
    new = _replace_once(node, views, memo)
    memo[id(node)] = new
    return new


def _replace_once(node: T, views: dict[int, torch.Tensor], memo: dict[int, object]) -> T:
    if isinstance(node, torch.Tensor):
        return views.get(id(node), node)
    if _is_value(node):
        changes = {}
        for field in dataclasses.fields(node):
            value = getattr(node, field.name)
            new = _replace(value, views, memo)
            if new is not value:
                changes[field.name] = new
        return dataclasses.replace(node, **changes) if changes else node
    if isinstance(node, dict):
        items = {key: _replace(value, views, memo) for key, value in node.items()}
        return items if any(items[key] is not value for key, value in node.items()) else node
    if isinstance(node, tuple):
        values = [_replace(value, views, memo) for value in node]
        if all(new is old for new, old in zip(values, node, strict=True)):
            return node
        return type(node)(*values) if hasattr(node, "_fields") else tuple(values)
    return node
