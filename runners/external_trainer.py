"""An external trainer, as a user's own would sit beside Prorsa (`trainer.update = "external"`).

    python -m runners.external_trainer --config CONFIG --id updater --nats-url URL

`ops.launch` starts it as the `updater` actor, with its bus credentials in the environment
(PRORSA_NATS_USER, PRORSA_NATS_PASSWORD). It uses nats-py and the message types of
`bus_schemas` only:

    prorsa.train.update  ◀── TrainBatch(version, min_version, trajectories)   (request)
                         ──▶ TrainedWeights(version, ok, weights, checksum)   (reply)

Each trajectory carries its token ids, the mask of the tokens the policy generated, their
rollout logprobs and the reward. Here the update is GRPO on the run's model (Prorsa's own
`grpo_update`, standing in for yours); the reply carries the safetensors bytes of the new
state dict. Prorsa's trainer checks them, serves them to the engines and publishes the
version. It exits on SIGTERM, as every actor does when the run ends.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

import nats
import torch

from actors.config import load_config
from actors.engine.torch.model import checksum, load_model, load_tokenizer, weights_to_bytes
from actors.trainer.grpo import grpo_update
from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.train import TrainBatch, TrainedWeights

log = logging.getLogger("external_trainer")


class Update:
    """The model and its optimizer; `__call__` turns a TrainBatch into the reply."""

    def __init__(self, config) -> None:
        mc = config.model
        self.config = config
        self.lm = load_model(mc.checkpoint, mc.threads)
        self.pad_id = load_tokenizer(mc.checkpoint).pad_id
        self.optimizer = torch.optim.Adam(self.lm.parameters(), lr=mc.learning_rate)

    def __call__(self, batch: TrainBatch) -> TrainedWeights:
        mc = self.config.model
        stats = grpo_update(
            self.lm,
            self.optimizer,
            batch.trajectories,
            temperature=mc.temperature,
            clip_eps=mc.clip_eps,
            epochs=mc.epochs,
            pad_id=self.pad_id,
            min_version=batch.min_version,
        )
        weights = weights_to_bytes(self.lm)
        log.info("policy %d: loss %.4f on %d tokens", batch.version, stats.loss, stats.tokens)
        return TrainedWeights(version=batch.version, ok=True, weights=weights, checksum=checksum(weights), trained_tokens=stats.tokens)


async def serve(config_path: str, nats_url: str) -> None:
    update = Update(load_config(config_path))
    user = os.environ.get("PRORSA_NATS_USER")
    nc = await nats.connect(
        nats_url, user=user, password=os.environ.get("PRORSA_NATS_PASSWORD"), inbox_prefix=f"_INBOX_{user}" if user else "_INBOX"
    )

    async def on_batch(msg) -> None:
        try:
            batch = decode(TrainBatch, msg.data)
            reply = await asyncio.to_thread(update, batch)
        except Exception as e:  # say why in the reply: Prorsa's trainer stops the run with it
            log.exception("update failed")
            reply = TrainedWeights(version=-1, ok=False, error=f"{type(e).__name__}: {e}")
        await msg.respond(encode(reply))

    await nc.subscribe(subjects.train_update(), cb=on_batch)
    await nc.flush()
    log.info("waiting for batches on %s", subjects.train_update())
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await nc.drain()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m runners.external_trainer")
    parser.add_argument("--config", required=True)
    parser.add_argument("--id", default="updater")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s {args.id} %(message)s")
    asyncio.run(serve(args.config, args.nats_url))


if __name__ == "__main__":
    main()
