"""A rank's training state sent from a surviving peer's memory to a replacement, tensor by tensor.

DDP replicas are identical at every completed step, so any survivor holds the whole model and
optimizer state a replacement needs. It goes point to point over the re-formed group: first a
header (the step, the optimizer's hyperparameters, the shape and dtype of each optimizer state
tensor, its plain values), then each tensor's raw bytes straight into the receiver's own
tensors: the model's parameters and buffers as they are, the optimizer's state allocated from
the header (Adam creates its state at the first step, which a replacement has not taken). No
``torch.save`` buffer on either side: no pickling of tensors, no copy beyond the wire.

Both sides call with the same model and optimizer layout (the same job's code built them); a
mismatch is an error naming the tensor, never a silent partial copy.

CUDA tensors over gloo (ranks sharing a GPU): gloo's point-to-point calls read and write the
tensor's memory from the host, so a GPU tensor is staged through pinned host memory: the sender
copies every tensor to pinned buffers at once (asynchronous copies, one synchronisation), then
sends them; the receiver takes each into a pinned buffer and copies it onto its device, the copies
queued behind one another and waited for once. NCCL sends device memory itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence


@dataclass(frozen=True)
class StateHeader:
    """What the receiver needs before the tensors: the step they hold, and how to lay them out."""

    step: int  # completed steps the state holds
    model: tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype) of each model tensor
    optimizer: tuple[tuple[int, str, tuple[int, ...], str], ...]  # (param index, key, shape, dtype) of each state tensor
    plain: tuple[tuple[int, str, Any], ...]  # (param index, key, value) of each non-tensor state value
    groups: tuple[Mapping[str, Any], ...]  # each param group's settings (lr, betas, ...) without its params
    extra: Mapping[str, Any]  # the caller's own plain values (the step counter, a data position)


def _model_tensors(model: Any) -> list[tuple[str, Any]]:
    """The model's parameters and buffers, by name, as the tensors themselves (not copies)."""
    tensors = [(name, p.data) for name, p in model.named_parameters()]
    tensors += [(name, b) for name, b in model.named_buffers()]
    return tensors


def _params(optimizer: Any) -> list[Any]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def header_of(model: Any, optimizer: Any, step: int, extra: Mapping[str, Any] | None = None) -> StateHeader:
    """The sender's header for ``model`` and ``optimizer`` at ``step`` completed steps."""
    import torch

    tensors, plain = [], []
    for index, param in enumerate(_params(optimizer)):
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                tensors.append((index, key, tuple(value.shape), str(value.dtype).removeprefix("torch.")))
            else:
                plain.append((index, key, value))
    groups = tuple({k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups)
    model_layout = tuple((name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in _model_tensors(model))
    return StateHeader(step, model_layout, tuple(tensors), tuple(plain), groups, dict(extra or {}))


def _optimizer_tensors(optimizer: Any, header: StateHeader) -> list[Any]:
    """The optimizer state tensors in the header's order (the sender's own)."""
    params = _params(optimizer)
    return [optimizer.state[params[index]][key] for index, key, _, _ in header.optimizer]


def _through_host(dist: Any, group: Any) -> bool:
    """Whether this group's point-to-point calls need host memory (gloo), not device memory."""
    return str(dist.get_backend(group)) == "gloo"


def wait_for_copies(devices: Iterable[Any]) -> None:
    """Until the asynchronous copies queued on each device's current stream are done."""
    import torch

    for device in devices:
        torch.cuda.current_stream(device).synchronize()


def pinned_copies(tensors: Sequence[Any]) -> list[Any]:
    """Each tensor as a contiguous host tensor: CPU ones as they are (contiguous), CUDA ones copied
    into pinned host memory, all the copies queued at once and waited for once."""
    import torch

    copies, devices = [], set()
    for tensor in tensors:
        data = tensor.detach()
        if data.is_cuda:
            host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
            host.copy_(data, non_blocking=True)
            devices.add(data.device)
            data = host
        copies.append(data if data.is_contiguous() else data.contiguous())
    wait_for_copies(devices)
    return copies


def send_state(model: Any, optimizer: Any, step: int, dst: int, *, group: Any = None, extra: Mapping[str, Any] | None = None) -> int:
    """Send the state to rank ``dst`` (which calls :func:`receive_state`); returns the bytes sent."""
    import torch.distributed as dist

    header = header_of(model, optimizer, step, extra)
    dist.send_object_list([header], dst=dst, group=group)
    tensors = [t for _, t in _model_tensors(model)] + _optimizer_tensors(optimizer, header)
    outgoing = pinned_copies(tensors) if _through_host(dist, group) else [t.detach().contiguous() for t in tensors]
    sent = 0
    for data in outgoing:
        dist.send(data, dst=dst, group=group)
        sent += data.numel() * data.element_size()
    return sent


def receive_state(model: Any, optimizer: Any, src: int, *, group: Any = None) -> StateHeader:
    """Receive the state rank ``src`` sends (:func:`send_state`) into ``model``'s own tensors and
    ``optimizer``'s state; returns the header (its ``step`` and ``extra``)."""
    import torch
    import torch.distributed as dist

    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=group)
    header: StateHeader = box[0]
    mine = _model_tensors(model)
    layout = tuple((name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in mine)
    if layout != header.model:
        different = next((a, b) for a, b in zip(layout + (None,) * len(header.model), header.model + (None,) * len(layout)) if a != b)
        raise RuntimeError(f"in-place recovery: this rank's model differs from its peer's (here {different[0]}, there {different[1]})")
    receive = _Receiver(dist, src, group, _through_host(dist, group))
    for _, tensor in mine:
        receive.into(tensor)
    params = _params(optimizer)
    for index, key, shape, dtype in header.optimizer:
        param = params[index]
        buffer = torch.empty(shape, dtype=getattr(torch, dtype), device=param.device)
        receive.into(buffer)
        optimizer.state[param][key] = buffer
    receive.done()
    for index, key, value in header.plain:
        optimizer.state[params[index]][key] = value
    for group_settings, settings in zip(optimizer.param_groups, header.groups):
        group_settings.update(settings)
    return header


class _Receiver:
    """Receives each tensor in turn straight into its own memory where the wire can write it
    (a contiguous host tensor; any tensor under NCCL), else through a buffer: pinned host memory
    for a CUDA tensor over gloo, its copy onto the device queued; ``done`` waits for those."""

    def __init__(self, dist: Any, src: int, group: Any, through_host: bool) -> None:
        self.dist, self.src, self.group, self.through_host = dist, src, group, through_host
        self.devices: set[Any] = set()

    def into(self, tensor: Any) -> None:
        import torch

        if self.through_host and tensor.is_cuda:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.dist.recv(host, src=self.src, group=self.group)
            tensor.copy_(host, non_blocking=True)  # the pinned buffer is kept alive by the queued copy
            self.devices.add(tensor.device)
        elif tensor.is_contiguous():
            self.dist.recv(tensor, src=self.src, group=self.group)
        else:
            buffer = tensor.contiguous()
            self.dist.recv(buffer, src=self.src, group=self.group)
            tensor.copy_(buffer)

    def done(self) -> None:
        wait_for_copies(self.devices)
