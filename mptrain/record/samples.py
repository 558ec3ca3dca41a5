"""What the model says, in the record: `config.sample`'s prompts answered at each evaluation.

A `Sampler` answers the prompts greedily (`codec.complete`: the run's own tokenizer and chat
template, the decoder compiled once) with the params of the state as it is, cast as training
casts them, and writes each answer to TensorBoard as text (`sample/<i>`) and to
`samples.jsonl` in the workdir (`{"step", "prompt", "completion"}` a line; process 0 writes;
a resumed run first drops the lines past its step, as it does the history's). It reads the
state and changes nothing of it, and draws no random numbers: the training is the same with
samples as without.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from mptrain import errors
from mptrain.record import curves

SAMPLES = "samples.jsonl"


class Sampler:
    def __init__(self, trainer: Any, run: Any):
        from mptrain.data import codec
        from mptrain.models.decoder import decode

        cfg = trainer.config.sample
        self.prompts = list(cfg.prompts)
        if cfg.chat:
            self.prompts = [[{"role": "user", "content": p}] for p in self.prompts]
        self.model, self.run, self.max_new_tokens = trainer.model, run, cfg.max_new_tokens
        self.codec = codec.of_run(trainer.config)
        try:  # a prompt that cannot be answered stops the run now, not at its first evaluation
            switch = decode.longrope_switch(trainer.model)
            model, new = trainer.model, cfg.max_new_tokens
            codec.prepare(self.codec, self.prompts, model.max_len, new, switch)
        except ValueError as e:
            raise errors.ConfigError(f"config.sample.prompts: {e}") from None
        self.decoder = decode.make_decoder(trainer.model, cfg.max_new_tokens)
        self.cast = jax.jit(trainer.policy.cast_params)
        self.path = Path(trainer.workdir) / SAMPLES

    def __call__(self, step: int) -> list[dict]:
        from mptrain.data import codec

        params = self.cast(self.run.state.model_params)  # a LoRA run's: base and adapters
        answers = codec.complete(
            self.codec, self.model, params, self.prompts, self.max_new_tokens, run=self.decoder
        )
        if jax.process_index() == 0:
            texts = {
                f"sample/{i}": f"{a['prompt']}\n\n{a['completion']}" for i, a in enumerate(answers)
            }
            self.run.writer.write_texts(step, texts)
            lines = [
                {"step": step, "prompt": a["prompt"], "completion": a["completion"]}
                for a in answers
            ]
            for line in lines:
                curves.append_row(self.path, line)
        return answers


def create(trainer: Any, run: Any) -> Callable[[int], Any]:
    """The run's `Sampler`; where `config.sample.prompts` is empty, one that does nothing."""
    if trainer.config.get("sample", {}).get("prompts"):
        return Sampler(trainer, run)
    return lambda step: None
