"""The real model of the `torch` backend: building, loading, specs, weights on the wire.

* The default model is tiny and randomly initialised (Qwen2- or Llama-style, from
  `[model]` with a fixed seed); `ops.launch` saves it once into the run folder so every
  process loads identical weights. Any local Hugging Face checkpoint directory works too.
* Tokenizer: a byte-level tokenizer that needs no download (ids 0-255 are bytes, then EOS,
  BOS, PAD), or the checkpoint's own tokenizer files when it has them (local files only).
* `model_spec` is what trainer and engines must agree on; `spec_differences` says what differs.
* Weights travel as one safetensors payload with a blake2b checksum, split in chunks; KV
  travels with a CRC-32C (`kv_checksum`, hardware CRC via the `crc32c` package; zlib's CRC-32
  where that is missing; the prefix names the algorithm and the receiver checks with the one
  named). It guards against corruption on the way, not against an adversary. Measured for
  1 MiB on a 2-CPU machine: CRC-32C 0.04-0.06 ms, zlib's CRC-32 0.3-0.45 ms (blake2b ~5x that).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import platform
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from bus_schemas.train import ModelSpec

try:
    from crc32c import crc32c as _crc32c
except ImportError:  # the dependency is declared; a missing build falls back to zlib's CRC-32
    _crc32c = None

BYTE_TOKENIZER_FILE = "prorsa_tokenizer.json"


@dataclass(frozen=True, slots=True)
class ByteTokenizer:
    """Bytes 0-255 are tokens 0-255; 256 EOS, 257 BOS, 258 PAD."""

    eos_id: int = 256
    bos_id: int = 257
    pad_id: int = 258
    vocab_size: int = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def render_chat(self, messages: list[dict], continuation: bool) -> list[int]:
        """The tiny model's plain chat format (it has no template of its own): a line
        "role: content" per message, then "assistant: " opens the model's turn. A
        continuation starts on a new line, after the model's last output."""
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return self.encode("\n" + text if continuation else text)

    def spec(self) -> dict[str, str]:
        return {
            "kind": "bytes",
            "vocab_size": str(self.vocab_size),
            "eos_id": str(self.eos_id),
            "bos_id": str(self.bos_id),
            "pad_id": str(self.pad_id),
        }


class HfTokenizer:
    """A checkpoint's own tokenizer (local files only)."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.eos_id = int(self._tok.eos_token_id if self._tok.eos_token_id is not None else 0)
        self.bos_id = int(self._tok.bos_token_id if self._tok.bos_token_id is not None else self.eos_id)
        self.pad_id = int(self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos_id)
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict], continuation: bool) -> list[int]:
        """Chat messages in the checkpoint's chat template, the assistant's turn opened after
        them. `continuation`: as the next messages of a conversation already under way: what
        the template adds to a two-message conversation, without that conversation (so no
        second system preamble)."""
        if not getattr(self._tok, "chat_template", None):
            raise ValueError("the checkpoint's tokenizer has no chat template")

        def render(conversation: list[dict], open_turn: bool) -> str:
            return self._tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=open_turn)

        if not continuation:
            return self.encode(render(messages, True))
        before = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
        head, full = render(before, False), render(before + messages, True)
        if not full.startswith(head):
            raise ValueError("the chat template renders a conversation's next messages by rewriting its earlier ones")
        return self.encode(full[len(head) :])

    def spec(self) -> dict[str, str]:
        vocab = json.dumps(sorted(self._tok.get_vocab().items()), separators=(",", ":"))
        return {
            "kind": "hf",
            "vocab_size": str(self.vocab_size),
            "eos_id": str(self.eos_id),
            "bos_id": str(self.bos_id),
            "pad_id": str(self.pad_id),
            "vocab_digest": hashlib.blake2b(vocab.encode(), digest_size=16).hexdigest(),
        }


Tokenizer = ByteTokenizer | HfTokenizer


def tiny_config(model, tie_embeddings: bool = True):  # model: actors.config.ModelSection
    """The HF config of the tiny model that `[model]` describes; `tie_embeddings = False` gives
    it its own output projection (the vllm backend needs that for in-place weight updates)."""
    from transformers import LlamaConfig, Qwen2Config

    tok = ByteTokenizer()
    cls = Qwen2Config if model.architecture == "qwen2" else LlamaConfig
    return cls(
        vocab_size=tok.vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_hidden_layers=model.layers,
        num_attention_heads=model.heads,
        num_key_value_heads=model.kv_heads,
        max_position_embeddings=model.max_positions,
        tie_word_embeddings=tie_embeddings,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )


def build_tiny(model, out_dir: str | Path, tie_embeddings: bool = True) -> Path:
    """Initialise the tiny model from `[model]` with its seed and save it (weights + tokenizer)."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(model.seed)
    lm = AutoModelForCausalLM.from_config(tiny_config(model, tie_embeddings))
    lm.save_pretrained(str(out_dir))
    (out_dir / BYTE_TOKENIZER_FILE).write_text(json.dumps(ByteTokenizer().spec(), indent=1) + "\n")
    return out_dir


def load_tokenizer(checkpoint: str | Path) -> Tokenizer:
    path = Path(checkpoint)
    if (path / BYTE_TOKENIZER_FILE).exists() or not any(
        (path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return ByteTokenizer()
    return HfTokenizer(path)


# glibc malloc options (mallopt): M_TRIM_THRESHOLD -1, M_MMAP_THRESHOLD -3
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's ceiling for it on 64-bit
TRIM_THRESHOLD_BYTES = 256 << 20
_allocator_tuned: bool | None = None


def tune_allocator() -> bool:
    """Keep tensor-sized blocks (up to 32 MiB) in the heap and freed memory in the process.

    glibc serves a block above its mmap threshold with a fresh mmap and unmaps it on free, so
    every such tensor costs a page fault per 4 KiB; the threshold adapts only to the largest
    block freed so far, and a KV that grows by one token per step stays above it. Measured here:
    a 1 MiB bytes copy 1.0 ms instead of 0.07 ms, 70-80 k page faults per 16 decode steps of the
    bench, prefill and decode ~2x slower in the first rounds of a process than later. Called by
    `load_model`, so every process that runs the model (engines, trainer, the bench's plain
    baseline) runs under the same allocator settings. Returns whether the options were set
    (glibc only; elsewhere a no-op)."""
    global _allocator_tuned
    if _allocator_tuned is None:
        _allocator_tuned = False
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            try:
                libc = ctypes.CDLL("libc.so.6")
                _allocator_tuned = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
                    libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
                )
            except (OSError, AttributeError):
                pass
    return _allocator_tuned


def load_model(checkpoint: str | Path, threads: int = 1):
    """The checkpoint's causal LM in eval mode, float32 on CPU (GPU when present), with `threads`
    intra-op threads and the allocator tuned (`tune_allocator`)."""
    from transformers import AutoModelForCausalLM

    path = Path(checkpoint)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model.checkpoint {str(path)!r} is not a model directory (no config.json)")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line per actor log, not a progress bar
    tune_allocator()
    torch.set_num_threads(threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lm = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)
    return lm.to(device).eval()


def model_spec(lm, tokenizer: Tokenizer) -> ModelSpec:
    cfg = lm.config.to_dict()
    skip = {"transformers_version", "dtype", "torch_dtype", "use_cache", "name_or_path"}
    fields = {k: json.dumps(v, sort_keys=True) for k, v in cfg.items() if not k.startswith("_") and k not in skip}
    return ModelSpec(model_config=fields, tokenizer=tokenizer.spec())


def spec_differences(mine: ModelSpec, theirs: ModelSpec, me: str = "engine", them: str = "trainer") -> list[str]:
    """One line per differing field, e.g. "model config hidden_size: engine 64, trainer 128"."""
    out: list[str] = []
    for what, a, b in (("model config", mine.model_config, theirs.model_config), ("tokenizer", mine.tokenizer, theirs.tokenizer)):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                out.append(f"{what} {key}: {me} {a.get(key, '(absent)')}, {them} {b.get(key, '(absent)')}")
    return out


# --- bytes on the wire ----------------------------------------------------------------------
def checksum(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


_KV_CRCS = {"crc32c": _crc32c, "crc32": zlib.crc32} if _crc32c is not None else {"crc32": zlib.crc32}
KV_CHECKSUM_ALGORITHM = next(iter(_KV_CRCS))


def kv_checksum(data: bytes | memoryview, algorithm: str = KV_CHECKSUM_ALGORITHM) -> str:
    """The checksum of `data` as "<algorithm>:<crc in 8 hex digits>"."""
    return kv_checksum_of([data], algorithm)


def kv_checksum_of(parts, algorithm: str = KV_CHECKSUM_ALGORITHM) -> str:
    """The checksum of the parts' concatenation, computed part by part (no join)."""
    crc = _KV_CRCS[algorithm]
    value = 0
    for part in parts:
        value = crc(part, value)
    return f"{algorithm}:{value:08x}"


def kv_checksum_matches(parts, expected: str) -> bool:
    """Whether the parts' concatenation has checksum `expected`, computed with the algorithm that
    `expected` names (so a sender with either algorithm is understood); an unknown one: False."""
    algorithm = expected.partition(":")[0]
    return algorithm in _KV_CRCS and kv_checksum_of(parts, algorithm) == expected


def split_chunks(data: bytes | memoryview, chunk_bytes: int) -> list[memoryview]:
    view = memoryview(data)
    return [view[i : i + chunk_bytes] for i in range(0, max(1, len(data)), chunk_bytes)]


def weights_to_bytes(lm) -> bytes:
    state = {k: v.detach().to("cpu").contiguous() for k, v in lm.state_dict().items()}
    # tied embeddings share storage; safetensors refuses shared tensors, so drop the alias
    if getattr(lm.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return st_save(state)


def load_weights_bytes(lm, data: bytes) -> None:
    state = st_load(data)
    missing, unexpected = lm.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and lm.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
