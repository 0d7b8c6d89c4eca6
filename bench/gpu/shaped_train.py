"""`python -m bench.gpu.shaped_train <overrides>`: qwen35rl's CLI with the realistic response lengths
(`bench.gpu.lengths`): the hf rollout's responses are cut to the drawn lengths before the loop sees them. Needs
trainer.launcher=local (the rollout runs in this process)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu.lengths import response_lengths, shape  # noqa: E402


def install() -> None:
    from qwen35rl.engines.base import RolloutResult
    from qwen35rl.engines.hf_rollout import HfRolloutEngine

    plain = HfRolloutEngine.generate
    calls = [0]

    def generate(self, request):
        result = plain(self, request)
        if not result.response_ids:
            return result
        lengths = response_lengths(len(result.response_ids), int(request.max_new_tokens), calls[0])
        calls[0] += 1
        ids = shape(result.response_ids, lengths, self.eos_token_ids[0])
        logp = [lp[:len(r)] for lp, r in zip(result.log_probs, ids)]
        finish = ["stop" if r and r[-1] in self.eos_token_ids else f for r, f in zip(ids, result.finish_reasons)]
        return RolloutResult(ids, logp, finish)

    HfRolloutEngine.generate = generate


if __name__ == "__main__":
    if "trainer.launcher=local" not in sys.argv:
        sys.exit("bench.gpu.shaped_train: add trainer.launcher=local (the rollout must run in this process)")
    install()
    from qwen35rl.cli.train import main

    sys.exit(main())
