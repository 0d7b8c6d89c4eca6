"""A reward with spread for random-init models: a random-init policy never writes a \\boxed{} answer, so geo3k's
math reward is 0 for every response, every advantage is 0 and the update's loss and gradient are exactly 0. This
reward is a fixed pseudo-random number in [0, 1) per response text (CRC32), so groups have non-zero advantages and
the GPU runs push real gradients through the language model and the vision tower. Use it as
`data.reward=bench.gpu.hash_reward:text_hash` (the project root on the path)."""
import zlib


def text_hash(response_text: str, answer: str = "", example=None) -> float:
    return (zlib.crc32(response_text.encode("utf-8", "surrogatepass")) % 1000) / 1000.0
