"""A transformers vision tower loaded vision-only: what the Kimi and Qwen towers share.

A family's tower (``kimi.tower``, ``qwen.tower``) builds its modules on the meta device from
the config and reads only the tower's tensors from the safetensors shards, so the language
model is never built and an LM-only shard is never opened (an encoder host may hold only the
vision shards). What does not depend on the family lives here: where the tower runs and in
which dtype, the batched forward split per image (``LoadedTower``), which shard holds which
tensor, the state checks that name what is wrong, the non-persistent buffers transformers
recomputes, and the one start-up error (``EncoderLoadError``).

``encode`` is synchronous and thread-agnostic: the batching layer calls it from one worker
thread; it never touches asyncio.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

__all__ = [
    "EncoderLoadError",
    "LoadedTower",
    "check_state",
    "materialise_buffers",
    "resolve_device",
    "tensor_files",
]

_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"


class EncoderLoadError(RuntimeError):
    """The checkpoint directory cannot give a vision encoder; the message says why.

    Raised at start-up (operator-facing, so it names the path), never while serving a request.
    """


class LoadedTower:
    """What every vision-only tower loaded here shares: where it runs, in which dtype, the
    module, the tensors read, and the batched forward split per image. Subclasses load
    ``_module`` and say how many output rows each image gives (``_tokens_per_image``)."""

    _module: nn.Module
    _checkpoint_keys: tuple[str, ...]

    def __init__(
        self, path: str | os.PathLike[str], device: str | torch.device, dtype: torch.dtype | None
    ) -> None:
        self._path = Path(path)
        self._device = resolve_device(device)
        # bfloat16 on CUDA (what the checkpoints hold and the servers run); float32 elsewhere
        # (CPU bf16 is slow and the tests compare against float32 references).
        cuda = self._device.type == "cuda"
        self._dtype = dtype or (torch.bfloat16 if cuda else torch.float32)

    @property
    def device(self) -> torch.device:
        """Where the forward pass runs."""
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype of the weights (outputs are always float32)."""
        return self._dtype

    @property
    def model(self) -> nn.Module:
        """The loaded module: the tower (and its merger or projector), no language model."""
        return self._module

    @property
    def checkpoint_keys(self) -> tuple[str, ...]:
        """The checkpoint tensor names that were read: the tower's, nothing else."""
        return self._checkpoint_keys

    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """Synchronous: one forward over the whole batch; one ``[tokens, hidden]`` float32 CPU
        tensor per image. Inputs that cannot belong together raise ``ValueError`` before any
        compute, so a bad batch never reaches the device. On CUDA each image's tensor is its
        own copy (a cache may keep one without pinning the batch); on the CPU, a view."""
        sizes = self._tokens_per_image(pixel_values, grid_thw)
        if not sizes:
            return []
        with torch.inference_mode():
            features = self._module(
                pixel_values.to(self._device, self._dtype, non_blocking=True),
                grid_thw.to(self._device, torch.long),
            )
            return [chunk.to("cpu", torch.float32) for chunk in torch.split(features, sizes, dim=0)]

    def _tokens_per_image(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[int]:
        raise NotImplementedError


# ---------------------------------------------------------------------- helpers


def resolve_device(device: str | torch.device) -> torch.device:
    """``auto`` means CUDA when present; anything else is taken as a torch device string."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise EncoderLoadError(f"unknown device {device!r}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise EncoderLoadError(f"device {device!r} requested but CUDA is not available")
    return resolved


def tensor_files(path: Path) -> dict[str, Path]:
    """Map every checkpoint tensor name to its file, reading only the index or file headers."""
    index = path / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text("utf-8"))["weight_map"]
            files = {str(key): path / str(name) for key, name in weight_map.items()}
        except (OSError, ValueError, LookupError, TypeError, AttributeError) as exc:
            raise EncoderLoadError(f"{path}: {_INDEX_FILE} is malformed") from exc
        # A shard listed but absent only matters if a vision tensor lives there: opening it
        # then fails with a clear error. LM-only shards may be left off an encoder host.
        return files
    shards = [path / _SINGLE_FILE] if (path / _SINGLE_FILE).is_file() else []
    shards = shards or sorted(path.glob("*.safetensors"))
    if not shards:
        raise EncoderLoadError(f"{path}: no safetensors weights (model.safetensors or an index)")
    files: dict[str, Path] = {}
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt", device="cpu") as reader:
                files.update(dict.fromkeys(reader.keys(), shard))
        except (OSError, SafetensorError) as exc:
            raise EncoderLoadError(f"{shard}: cannot read safetensors weights") from exc
    return files


def read_state(
    files: Mapping[str, Path],
    wanted: Iterable[str],
    rename: Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
    expected: Mapping[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The wanted checkpoint tensors under the module's names, and the keys that fit none.

    Each shard is opened once, and each tensor is cast and moved as it is read, so the
    checkpoint never sits in memory twice. ``rename`` maps one checkpoint tensor to the
    module tensor(s) it becomes (a fused tensor may become several).
    """
    by_file: dict[Path, list[str]] = defaultdict(list)
    for key in wanted:
        by_file[files[key]].append(key)
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for shard, keys in sorted(by_file.items()):
        try:
            with safe_open(str(shard), framework="pt", device="cpu") as reader:
                for key in sorted(keys):
                    for name, value in rename(key, reader.get_tensor(key)):
                        if name not in expected:
                            unexpected.append(key)
                            continue
                        state[name] = value.to(
                            device=device, dtype=dtype if value.is_floating_point() else None
                        )
        except (OSError, SafetensorError) as exc:
            raise EncoderLoadError(f"{shard}: cannot read safetensors weights") from exc
    return state, unexpected


def check_state(
    path: Path,
    state: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    unexpected: list[str],
) -> None:
    """Every module tensor present with its shape, no stray vision tensors: say which, not how."""
    missing = sorted(set(expected) - set(state))
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise EncoderLoadError(
            f"{path}: the checkpoint lacks {len(missing)} vision tensor(s): {shown}"
        )
    if unexpected:
        shown = ", ".join(sorted(unexpected)[:5]) + (", ..." if len(unexpected) > 5 else "")
        raise EncoderLoadError(
            f"{path}: {len(unexpected)} vision tensor(s) do not fit the config: {shown}"
        )
    for name, value in state.items():
        want = tuple(expected[name].shape)
        if tuple(value.shape) != want:
            raise EncoderLoadError(
                f"{path}: tensor {name} has shape {list(value.shape)}, "
                f"the config expects {list(want)}"
            )


def materialise_buffers(module: nn.Module, device: torch.device) -> None:
    """Give the non-persistent buffers (RoPE ``inv_freq``, temporal sin table) real values.

    They were created on the meta device and are not in the checkpoint. Recomputing them is
    transformers' own job: allocate them, mark every loaded parameter as initialised and run
    ``initialize_weights`` — the path ``from_pretrained`` takes, which skips marked tensors.
    """
    from transformers import PreTrainedModel

    for submodule in module.modules():
        for name, buffer in list(submodule.named_buffers(recurse=False)):
            if buffer is not None and buffer.is_meta:
                submodule._buffers[name] = torch.empty_like(buffer, device=device)
    for parameter in module.parameters():
        parameter._is_hf_initialized = True  # type: ignore[attr-defined]
    for submodule in module.children():
        if isinstance(submodule, PreTrainedModel):
            submodule.initialize_weights()
    leftover = [
        name
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]
        if tensor.is_meta
    ]
    if leftover:  # a transformers change we do not know how to initialise
        raise EncoderLoadError(f"tensors left uninitialised after loading: {leftover[:5]}")
