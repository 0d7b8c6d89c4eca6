"""A reward and GSM8K-shaped data for the GPU runs of random-init checkpoints (`bench/gpu/vllm_runs.sh`).

`digit_share` scores a response by the share of its characters that are decimal digits (0 for an empty one). It
has spread only where the policy samples byte tokens: on the 0.8B architecture's 248k vocabulary a random-init
policy rarely does (the decoded text is nearly empty), and on the H100 runs of 2026-12-05 the reward stayed at
0-0.03 for 50 steps (bench/results/vllm_gpu.md).
Use it as `data.reward=bench.gpu.learnable:digit_share` (the project root on the path).

`decoded_length` has spread there: the byte tokenizer decodes only its 266 ids and drops the rest of the 248k, so
a random-init policy's 128-token response decodes to ~0.13 characters on average, some responses to a few; the
reward (characters decoded, up to 32, over 32) is learned by making byte tokens likelier.

`write_gsm8k_like PATH ROWS [SEED]` writes GSM8K-shaped jsonl rows {question, answer} (short arithmetic word
problems), as data=gsm8k reads them."""
import json
import random
import sys
from pathlib import Path

NAMES = ["Ann", "Bo", "Cy", "Dee", "Eli", "Fay"]
THINGS = ["apples", "books", "coins", "pens", "stones"]


def digit_share(response_text: str, answer: str = "", example=None) -> float:
    text = response_text.strip()
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def decoded_length(response_text: str, answer: str = "", example=None) -> float:
    return min(len(response_text), 32) / 32.0


def write_gsm8k_like(path: Path, rows: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _ in range(rows):
            a, b, c = rng.randint(2, 60), rng.randint(2, 60), rng.randint(2, 9)
            who, what = rng.choice(NAMES), rng.choice(THINGS)
            q = (f"{who} has {a} {what}, buys {b} more, then gives away a {c}th of them, rounded down. "
                 f"How many {what} does {who} keep?")
            f.write(json.dumps({"question": q, "answer": str(a + b - (a + b) // c)}) + "\n")
    return path


if __name__ == "__main__":
    if sys.argv[1:2] == ["write_gsm8k_like"]:
        write_gsm8k_like(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 0)
    else:
        sys.exit("usage: python3 bench/gpu/learnable.py write_gsm8k_like PATH ROWS [SEED]")
