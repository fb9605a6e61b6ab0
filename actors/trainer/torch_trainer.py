"""The sync trainer with real training: GRPO on the tiny model, weights served over the bus.

* start: load the checkpoint (policy 0, the weights every engine loaded), answer
  `subjects.train_model()` with the model spec engines must match.
* each step: `grpo.grpo_update` on the step's finished trajectories (token ids, generated
  mask, rollout logprobs) in a worker thread; the model time it took on the clock is the step's train_s.
* the new version's weights (safetensors bytes + blake2b checksum) are served in chunks on
  `subjects.train_weights()`; engines fetch and load them before confirming LoadPolicy(v).
* `trainer.update = "external"`: the update is someone else's. The step's trajectories go to
  an external trainer over `subjects.train_update()` and its weights are served instead.
"""

from __future__ import annotations

import asyncio

import torch
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from actors.engine.torch.model import checksum, load_model, load_tokenizer, load_weights_bytes, model_spec, split_chunks, weights_to_bytes
from actors.trainer.actor import TrainerActor
from actors.trainer.grpo import grpo_update
from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.train import FinishedTrajectory, ModelSpecRequest, TrainBatch, TrainedWeights, WeightsChunk, WeightsFetch

KEEP_VERSIONS = 2  # weights kept for late fetchers


class TorchTrainerActor(TrainerActor):
    def __init__(self, actor_id, config, nc, clock, lm=None, tokenizer=None) -> None:
        super().__init__(actor_id, config, nc, clock)
        mc = config.model
        self.lm = lm if lm is not None else load_model(mc.checkpoint, mc.threads)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(mc.checkpoint)
        self.spec = model_spec(self.lm, self.tokenizer)
        self.optimizer = torch.optim.Adam(self.lm.parameters(), lr=mc.learning_rate)
        self._weights: dict[int, tuple[list[memoryview], str, int]] = {}  # version -> (chunks, checksum, bytes)
        self.train_stats: list = []

    async def setup(self) -> None:
        await super().setup()
        await self.nc.subscribe(subjects.train_model(), cb=self._on_spec_request)
        await self.nc.subscribe(subjects.train_weights(), cb=self._on_weights_fetch)

    async def _on_spec_request(self, msg: Msg) -> None:
        if self.decode_or_count(ModelSpecRequest, msg) is not None and msg.reply:
            await msg.respond(encode(self.spec))

    async def _on_weights_fetch(self, msg: Msg) -> None:
        request = self.decode_or_count(WeightsFetch, msg)
        if request is None:
            reply = WeightsChunk(version=-1, ok=False, error="malformed weights fetch")
        elif request.version not in self._weights:
            self.counters["weights_unknown_version"] += 1
            reply = WeightsChunk(
                version=request.version, ok=False, error=f"version {request.version} not served (have {sorted(self._weights)})"
            )
        else:
            chunks, digest, total = self._weights[request.version]
            if not 0 <= request.chunk < len(chunks):
                reply = WeightsChunk(version=request.version, ok=False, error=f"no chunk {request.chunk}")
            else:
                reply = WeightsChunk(
                    version=request.version,
                    ok=True,
                    chunk=request.chunk,
                    n_chunks=len(chunks),
                    total_bytes=total,
                    checksum=digest,
                    data=bytes(chunks[request.chunk]),
                )
                self.counters["weights_chunks_served"] += 1
        if msg.reply:
            await msg.respond(encode(reply))

    async def _train(self, batch: list[FinishedTrajectory], new_version: int, min_version: int = -1) -> float:
        if self.config.trainer.update == "external":
            return await self._train_external(batch, new_version, min_version)
        mc, tc = self.config.model, self.config.trainer
        started_s = self.clock.now_s()
        stats = await asyncio.to_thread(
            grpo_update,
            self.lm,
            self.optimizer,
            batch,
            temperature=mc.temperature,
            clip_eps=mc.clip_eps,
            epochs=mc.epochs,
            pad_id=self.tokenizer.pad_id,
            correction=tc.off_policy_correction,
            is_cap=tc.is_cap,
            min_version=min_version,
        )
        unusable = len(batch) - sum(1 for t in batch if t.token_ids)
        if unusable:
            self.counters["trajectories_without_tokens"] += unusable
            self.log.error("%d finished trajectories carry no token ids: not trained on", unusable)
        payload = await asyncio.to_thread(weights_to_bytes, self.lm)
        self._serve(new_version, payload)
        train_s = self.clock.now_s() - started_s  # the model seconds the real update took
        self.train_stats.append(stats)
        self.counters["train_updates"] += 1
        self.counters["trained_tokens"] += stats.tokens
        self.counters["is_capped_tokens"] += stats.is_capped_tokens
        self.log.info(
            "trained policy %d: loss %.4f on %d tokens of %d trajectories, rollout/trainer logprob gap %.2e, clipped %.3f, %.2f s",
            new_version,
            stats.loss,
            stats.tokens,
            stats.trajectories,
            stats.mean_abs_logprob_gap,
            stats.clipped_fraction,
            train_s,
        )
        return train_s

    async def _train_external(self, batch: list[FinishedTrajectory], new_version: int, min_version: int) -> float:
        """`trainer.update = "external"`: the step's trajectories go to the external trainer
        (`subjects.train_update()`, request/reply); its weights become policy `new_version`,
        checked against their checksum, loaded here (so the model spec engines check stays
        this model's) and served to the engines as ours would be."""
        started_s = self.clock.now_s()
        request = encode(TrainBatch(version=new_version, min_version=min_version, trajectories=batch))
        timeout_s = self.config.trainer.update_timeout_wall_s
        try:
            reply = decode(TrainedWeights, (await self.nc.request(subjects.train_update(), request, timeout=timeout_s)).data)
        except (NoRespondersError, TimeoutError) as e:
            what = "no external trainer answers" if isinstance(e, NoRespondersError) else f"no answer within {timeout_s:g} s"
            raise RuntimeError(f"policy {new_version}: {what} on {subjects.train_update()} (trainer.update_module)") from None
        if not reply.ok or reply.version != new_version:
            raise RuntimeError(f"policy {new_version}: the external trainer answered version {reply.version}: {reply.error or 'not ok'}")
        if checksum(reply.weights) != reply.checksum:
            raise RuntimeError(f"policy {new_version}: the external trainer's weights do not match their checksum")
        await asyncio.to_thread(load_weights_bytes, self.lm, reply.weights)  # refuses a state dict of another model
        self._serve(new_version, reply.weights)
        self.counters["external_updates"] += 1
        self.counters["trained_tokens"] += reply.trained_tokens
        train_s = self.clock.now_s() - started_s
        self.log.info(
            "policy %d from the external trainer: %d bytes, %d tokens, %.2f s",
            new_version,
            len(reply.weights),
            reply.trained_tokens,
            train_s,
        )
        return train_s

    def _serve(self, version: int, payload: bytes) -> None:
        """Serve `payload` as policy `version` in chunks; keep the newest KEEP_VERSIONS."""
        self._weights[version] = (split_chunks(payload, self.config.model.kv_chunk_bytes), checksum(payload), len(payload))
        for old in sorted(self._weights)[:-KEEP_VERSIONS]:
            del self._weights[old]

    def _weights_ref(self) -> str:
        return subjects.train_weights()
