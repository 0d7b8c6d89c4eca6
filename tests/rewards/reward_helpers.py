"""Reward functions for the scoring tests; module level so worker processes can import them."""
import os
import time


def length_or_hang(response, answer, example):
    """Hangs on a response "hang", raises on "raise", exits the process on "die", else returns the length."""
    if response == "hang":
        time.sleep(3600)
    if response == "raise":
        raise RuntimeError("bad reward")
    if response == "die":
        os._exit(3)
    if response == "nan":
        return float("nan")
    return float(len(response))


def prompt_index(response, answer, example):
    return float(example.index)


def digit_or_hang(response, answer, example):
    """1.0 for the right digit; hangs on anything that is not a digit."""
    if not response.strip().isdigit():
        time.sleep(3600)
    return float(response.strip() == answer)


def always_raises(response, answer, example):
    raise ConnectionError("reward server at 10.0.0.9:8000 refused the connection")


def digit_or_raise(response, answer, example):
    """1.0 for the right digit; raises on anything that is not a digit."""
    if not response.strip().isdigit():
        raise ValueError(f"not a digit: {response!r}")
    return float(response.strip() == answer)


def always_hangs(response, answer, example):
    time.sleep(3600)
    return 0.0


def hang_when_told(response, answer, example):
    """copy_digit's score, until the file named by QWEN35RL_TEST_HANG exists: then it notes that it hangs (that
    file + ".hanging") and hangs."""
    flag = os.environ.get("QWEN35RL_TEST_HANG")
    if flag and os.path.exists(flag):
        open(flag + ".hanging", "w").close()
        time.sleep(3600)
    return float(response.strip() == answer)
