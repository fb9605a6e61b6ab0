"""The environment interface's pure parts: loading a user's class, calling its code under a
timeout, checking what it returns; the built-in calc environment; the launch checks."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import pytest

from actors.config import ConfigError, load_config
from actors.environment.envs.calc import CalcEnvironment, CalcTask
from actors.environment.interface import (
    EntrypointError,
    ModelOutput,
    StepResult,
    Task,
    UserCodeError,
    as_step_result,
    call_user,
    check_observation,
    load_class,
)
from ops.launch import check_real_tasks
from tests.user_envs import SyncBlocking

TASK = Task("k0", "calc", 1, 7, 0, 0)


@pytest.mark.parametrize(
    ("entrypoint", "message"),
    [
        ("tests.user_envs", "is not 'package.module:Class'"),
        ("tests.no_such_module:X", "cannot import tests.no_such_module: ModuleNotFoundError"),
        ("tests.user_envs:Nope", "tests.user_envs has no class Nope"),
        ("tests.user_envs:ModelOutput", "ModelOutput has no reset or step method"),
    ],
)
def test_an_entrypoint_that_names_nothing_usable_says_what_is_wrong(entrypoint: str, message: str):
    with pytest.raises(EntrypointError, match=message):
        load_class(entrypoint)


def test_load_class_returns_the_named_class():
    assert load_class("tests.user_envs:SyncBlocking") is SyncBlocking


def test_user_calls_that_raise_or_hang_become_user_code_errors_and_a_hung_thread_blocks_no_other_call():
    async def go():
        async def raises(_):
            raise ValueError("bad")

        async def hangs(_):
            await asyncio.sleep(3600)  # barrier-ok: user code that hangs, for the timeout to end

        with pytest.raises(UserCodeError, match="step raised ValueError: bad") as e:
            await call_user("step", 1.0, raises, None)
        assert e.value.reason == "env_exceptions"
        env = SyncBlocking()
        env.reset(Task("k", "f", 0, 0, 1, 0))  # sample 1: step blocks its thread for good
        started = time.monotonic()
        with pytest.raises(UserCodeError, match="did not return within 0.2 s") as e:
            await call_user("step", 0.2, env.step, ModelOutput("", [], 0))
        assert e.value.reason == "env_timeouts" and time.monotonic() - started < 2.0
        with pytest.raises(UserCodeError, match="did not return"):
            await call_user("step", 0.2, hangs, None)
        # many blocked threads later, a plain call still runs at once (each call has its own thread)
        for _ in range(40):
            with pytest.raises(UserCodeError):
                await call_user("step", 0.01, env.step, ModelOutput("", [], 0))
        other = SyncBlocking()
        assert other.reset(TASK) == [104, 105, 58]
        assert await call_user("step", 1.0, other.step, ModelOutput("", [], 0)) == StepResult(reward=1.0, done=True)

    asyncio.run(go())


@pytest.mark.parametrize(
    "value",
    [
        {"observation": "x"},
        ("x", 1.0),
        ("x", math.nan, False),
        ("x", "1", False),
        ("x", True, False),
        ("x", 1.0, "yes"),
        (None, 0.0, False),
        ({"role": "tool"}, 0.0, False),
        ([1, "2"], 0.0, False),
    ],
)
def test_a_step_that_returns_garbage_is_a_bad_return(value):
    with pytest.raises(UserCodeError) as e:
        as_step_result(value)
    assert e.value.reason == "env_bad_returns"


def test_a_step_may_return_a_step_result_or_a_triple_of_text_ids_or_chat_messages():
    assert as_step_result(("obs", 1, True)) == StepResult("obs", 1, True)
    assert as_step_result(StepResult([1, 2], 0.5)).observation == [1, 2]
    assert as_step_result(([{"role": "tool", "content": "ok"}], 0.0, False)).reward == 0.0
    check_observation([0, 255], "reset", vocab_size=256)
    with pytest.raises(UserCodeError, match="token id 256 outside the vocabulary"):
        check_observation([0, 256], "reset", vocab_size=256)


def test_the_calc_environment_plays_the_calc_task_through_the_interface():
    async def go():
        env, task = CalcEnvironment(), CalcTask()
        assert await env.reset(TASK) == task.prompt(1, 7)
        first = await env.step(ModelOutput("a1b2", [], 0))
        assert first == StepResult(observation=task.tool("a1b2"))
        last = await env.step(ModelOutput("33", [], 1))
        assert last.done and last.reward == pytest.approx(task.reward(["a1b2", "33"])) == pytest.approx(4 / 48)

    asyncio.run(go())


def _torch_config(tmp_path: Path, extra: str, mix: str = "calc", backend: str = "torch") -> Path:
    path = tmp_path / "c.toml"
    path.write_text(f'[engines]\nbackend = "{backend}"\n[environments]\n{extra}\n[workload]\nmix = {{ {mix} = 1.0 }}\n')
    return path


def test_launch_checks_the_environments_before_anything_starts(tmp_path: Path):
    check_real_tasks(load_config(_torch_config(tmp_path, "", "code")))
    check_real_tasks(load_config(_torch_config(tmp_path, 'entrypoint = "tests.user_envs:Misbehaving"', "my-agent")))
    with pytest.raises(ConfigError, match="unknown task family 'my-agent'"):
        load_config(_torch_config(tmp_path, "", "my-agent"))
    with pytest.raises(ConfigError, match="swe in workload.mix is modelled"):
        check_real_tasks(load_config(_torch_config(tmp_path, "", "swe")))
    with pytest.raises(ConfigError, match="tests.user_envs has no class Gone"):
        check_real_tasks(load_config(_torch_config(tmp_path, 'entrypoint = "tests.user_envs:Gone"')))
    with pytest.raises(ConfigError, match="runs on real backends"):
        check_real_tasks(load_config(_torch_config(tmp_path, 'entrypoint = "tests.user_envs:Misbehaving"', backend="emulated")))


CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _hf_tokenizer(path: Path, template: str | None):
    """A small byte-level BPE tokenizer saved as a checkpoint's tokenizer, with `template`."""
    tokenizers = pytest.importorskip("tokenizers", reason="transformers' tokenizers come with the dev extra")
    from transformers import PreTrainedTokenizerFast

    from actors.engine.torch.model import HfTokenizer

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"], initial_alphabet=alphabet)
    bpe.train_from_iterator(["hello tool result"], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>")
    fast.chat_template = template
    fast.save_pretrained(str(path))
    return HfTokenizer(path)


def test_chat_messages_render_with_the_checkpoints_template_and_a_later_turn_without_its_preamble(tmp_path: Path):
    tok = _hf_tokenizer(tmp_path / "tok", CHATML)
    first = tok.render_chat([{"role": "user", "content": "hello"}], continuation=False)
    later = tok.render_chat([{"role": "tool", "content": "result"}], continuation=True)
    assert tok._tok.decode(first) == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok._tok.decode(later) == "<|im_start|>tool\nresult<|im_end|>\n<|im_start|>assistant\n"
    bare = _hf_tokenizer(tmp_path / "bare", None)
    with pytest.raises(ValueError, match="no chat template"):
        bare.render_chat([{"role": "user", "content": "hello"}], continuation=False)
