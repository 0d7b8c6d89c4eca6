"""Build the train / val prompt lists of a run from `data.*`: synthetic, text (jsonl/parquet) or multimodal."""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence

from qwen35rl.config.data_check import FileProblem, Keys, decode_image, file_keys, lookup, read_head, row_problem
from qwen35rl.data.example import PromptExample
from qwen35rl.data.synthetic import make_prompts

log = logging.getLogger(__name__)

IMAGE_PLACEHOLDER = "<image>"
_VAL_SEED_OFFSET = 1_000_003  # a different stream for validation prompts than for training prompts
_NAMED_DROPS = 10  # dropped prompts named one by one in the log; the rest are counted


class DataError(ValueError):
    """Data that cannot make the prompts of a run (every prompt filtered out for length, ...); the message says
    what happened and what to change."""


def build_dataset(data_cfg: Any, tokenizer: Any, split: str, skipped: Optional[List[str]] = None) -> List[PromptExample]:
    """Prompts of `split` ("train" | "val"). `tokenizer` (HF-style: encode / decode / apply_chat_template) is needed
    for synthetic and text data; multimodal prompts are tokenised later by the processor and may pass None.
    Each file is read in its own layout (qwen35rl's columns, or verl's preprocessed parquet: `data_check.file_keys`).
    A row that cannot make a prompt raises a DataError naming the file, row and column; with
    `data.skip_bad_rows=true` it is skipped instead, logged, and its reason appended to `skipped`."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val' (got {split!r})")
    kind = data_cfg.kind
    if kind == "synthetic":
        examples = _synthetic(data_cfg, split)
    elif kind in ("text", "multimodal"):
        key = "data.train_files" if split == "train" else "data.val_files"
        skip = bool(getattr(data_cfg, "skip_bad_rows", False))
        examples, bad, rows_read = [], [], 0
        for path in data_cfg.train_files if split == "train" else data_cfg.val_files:
            rows = _rows(key, str(path))
            keys = file_keys(rows[0] if isinstance(rows[0], dict) else {}, data_cfg)
            rows_read += len(rows)
            for n, row in enumerate(rows):
                try:
                    examples.append(_checked_row(data_cfg, row, len(examples), f"{key}: {path}, row {n}",
                                                 kind == "multimodal", keys))
                except DataError as e:
                    if not skip:
                        raise
                    bad.append(str(e).replace(", or skip such rows with data.skip_bad_rows=true", ""))
        if bad:
            _report_skipped(split, key, bad, rows_read, examples)
            if skipped is not None:
                skipped += bad
    else:
        raise ValueError(f"data.kind={kind!r}: expected synthetic, text or multimodal")
    if kind == "multimodal":
        return examples  # prompt length is known only once the processor has added the image tokens
    if tokenizer is None:
        raise ValueError(f"data.kind={kind} needs a tokenizer to build prompt ids")
    kept, dropped = [], []
    for ex in examples:
        (kept if _tokenize(data_cfg, tokenizer, ex) is not None else dropped).append(ex)
    report_length_filter(data_cfg, split, len(examples), kept, dropped)
    return kept


def report_length_filter(data_cfg: Any, split: Optional[str], total: int, kept: Sequence[PromptExample],
                         dropped: Sequence[PromptExample], image_prompts: bool = False) -> None:
    """Log the prompts `data.filter_overlong_prompts` dropped (how many, and which: row index and token count);
    when it dropped all `total` of them, raise a DataError that says so, with their lengths and the settings to
    change. `dropped` examples carry their full, uncut `prompt_ids`."""
    if not dropped:
        return
    limit = int(data_cfg.max_prompt_length)
    what = ("image prompts" if image_prompts else "prompts") if split is None else \
        f"{split} {'image prompts' if image_prompts else 'prompts'}"
    named = ", ".join(f"{ex.index} ({len(ex.prompt_ids)} tokens)" for ex in dropped[:_NAMED_DROPS])
    more = f" and {len(dropped) - _NAMED_DROPS} more" if len(dropped) > _NAMED_DROPS else ""
    log.warning("dropped %d of %d %s longer than data.max_prompt_length=%d tokens (data.filter_overlong_prompts="
                "true): rows %s%s", len(dropped), total, what, limit, named, more)
    if kept:
        return
    lengths = sorted(len(ex.prompt_ids) for ex in dropped)
    if data_cfg.kind == "synthetic":
        source = f" (data.synthetic_task={data_cfg.synthetic_task})"
    elif split is None:
        source = ""
    else:
        key = "data.train_files" if split == "train" else "data.val_files"
        source = f" ({key}=[{', '.join(map(str, data_cfg.train_files if split == 'train' else data_cfg.val_files))}])"
    if image_prompts:
        counted = "the chat template, system prompt and image tokens included"
    elif data_cfg.use_chat_template:
        counted = "the chat template and system prompt included"
    else:
        counted = "the system prompt included"
    cut = "" if image_prompts else ("; or cut them instead of dropping them: data.filter_overlong_prompts=false with "
                                    "data.truncation=left (keeps each prompt's end) or data.truncation=right")
    shortest, longest = lengths[0], lengths[-1]
    if shortest == longest:
        have, raise_to = f"each has {shortest} tokens", f"to at least {shortest}"
    else:
        have = f"these have {shortest} (shortest) to {longest} (longest) tokens"
        raise_to = f"to at least {shortest} ({longest} keeps them all)"
    raise DataError(
        f"all {total} {what}{source} were filtered out for length: data.filter_overlong_prompts=true drops "
        f"every prompt longer than data.max_prompt_length={limit} tokens, and {have}, {counted}. Raise "
        f"data.max_prompt_length {raise_to}{cut}")


# ------------------------------------------------------------------------------------------------------ sources
def _synthetic(data_cfg: Any, split: str) -> List[PromptExample]:
    count = data_cfg.synthetic_size if split == "train" else data_cfg.val_size
    seed = data_cfg.seed if split == "train" else data_cfg.seed + _VAL_SEED_OFFSET
    return [
        PromptExample(prompt_ids=[], prompt_text=text, answer=answer, index=i,
                      messages=_messages(data_cfg.system_prompt, text), data_source=str(data_cfg.name),
                      extra_info={})
        for i, (text, answer) in enumerate(make_prompts(data_cfg.synthetic_task, count, seed))
    ]


def _rows(key: str, path: str) -> List[Any]:
    """The rows of one data file; a DataError naming it when it cannot be read or holds no rows (a file that is not
    what its extension says, a truncated parquet file, another format)."""
    try:
        rows, _ = read_head(path, limit=None)
    except FileProblem as e:
        raise DataError(f"{key}: {e.message}; {e.fix}") from None
    return rows


def _report_skipped(split: str, key: str, bad: Sequence[str], rows_read: int, kept: Sequence[PromptExample]) -> None:
    """Log the rows data.skip_bad_rows skipped; a DataError when no row was left."""
    named = "\n  ".join(bad[:_NAMED_DROPS])
    more = f"\n  and {len(bad) - _NAMED_DROPS} more" if len(bad) > _NAMED_DROPS else ""
    if not kept:
        raise DataError(f"none of the {rows_read} {split} rows ({key}) can make a prompt; the first:\n  {bad[0]}")
    log.warning("skipped %d of %d %s rows that cannot make a prompt (data.skip_bad_rows=true):\n  %s%s", len(bad),
                rows_read, split, named, more)


def _checked_row(data_cfg: Any, row: Any, index: int, where: str, with_images: bool,
                 keys: Optional[Keys] = None) -> PromptExample:
    """`_from_row`, with what a row lacks or holds wrongly (a missing column, a null / NaN / list answer, an image
    that does not decode, more <image> placeholders than images: `data_check.row_problem`) as a DataError naming
    the file, row and column: a bad row stops the run before any step trains on it."""
    keys = keys or file_keys(row if isinstance(row, dict) else {}, data_cfg)
    problem = row_problem(row, keys, with_images, decode=False)  # _from_row decodes the images
    if problem is not None:
        raise DataError(problem.text(where))
    try:
        return _from_row(data_cfg, row, index, with_images, keys)
    except (OSError, ValueError, KeyError, TypeError) as e:  # PIL's UnidentifiedImageError is an OSError
        raise DataError(f"{where}: {type(e).__name__}: {e} (an image of {keys.image!r} that does not decode, or "
                        "chat messages without role/content); fix the row, or skip such rows with "
                        "data.skip_bad_rows=true") from None


def _from_row(data_cfg: Any, row: Dict[str, Any], index: int, with_images: bool, keys: Keys) -> PromptExample:
    prompt = lookup(row, keys.prompt)
    answer = lookup(row, keys.answer)
    if isinstance(prompt, list):  # already chat messages (verl-style parquet)
        messages = [dict(m) for m in prompt]
        if data_cfg.system_prompt and keys.system_prompt_added and not any(m.get("role") == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": data_cfg.system_prompt})
        text = "\n\n".join(str(m["content"]) for m in messages if m.get("role") != "system")
    else:
        text = str(prompt)
        messages = _messages(data_cfg.system_prompt if keys.system_prompt_added else None, text)
    images = None
    if with_images:
        images = [decode_image(img) for img in (lookup(row, keys.image) or [])]
        messages = [m if m["role"] != "user" else {"role": "user", "content": _interleave(str(m["content"]), len(images))}
                    for m in messages]
        text = text.replace(IMAGE_PLACEHOLDER, "").strip()
    return PromptExample(prompt_ids=[], prompt_text=text, answer=str(answer), images=images, index=index,
                         messages=messages, **_verl_fields(data_cfg, row))


def _verl_fields(data_cfg: Any, row: Dict[str, Any]) -> Dict[str, Any]:
    """A row's `data_source` and `extra_info`, for a verl-signature reward. verl needs `data_source` in every row;
    here a row without one gets the dataset's name. verl gives a row without `extra_info` an empty dict."""
    source = row.get("data_source")
    extra = row.get("extra_info")
    return {"data_source": str(source) if source is not None else str(getattr(data_cfg, "name", "") or ""),
            "extra_info": dict(extra) if isinstance(extra, dict) else {}}


def _messages(system_prompt: Optional[str], user_text: str) -> List[Dict[str, Any]]:
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return system + [{"role": "user", "content": user_text}]


def _interleave(text: str, num_images: int) -> List[Dict[str, Any]]:
    """Processor-style content parts: each image where the text has `<image>`; all images first when the
    placeholders do not match the images one to one."""
    image = {"type": "image"}
    pieces = text.split(IMAGE_PLACEHOLDER)
    if len(pieces) - 1 != num_images:
        rest = "".join(pieces).strip()
        return [dict(image) for _ in range(num_images)] + ([{"type": "text", "text": rest}] if rest else [])
    parts: List[Dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        if i:
            parts.append(dict(image))
        if piece.strip():
            parts.append({"type": "text", "text": piece.strip()})
    return parts


# ----------------------------------------------------------------------------------------------- tokenisation
def _tokenize(data_cfg: Any, tokenizer: Any, ex: PromptExample) -> Optional[PromptExample]:
    """Fill prompt_ids; apply `data.max_prompt_length` (drop, cut or raise). None: dropped."""
    if data_cfg.use_chat_template:
        text = tokenizer.apply_chat_template(ex.messages, add_generation_prompt=True, tokenize=False)
    elif data_cfg.system_prompt:
        text = f"{data_cfg.system_prompt}\n\n{ex.prompt_text}"
    else:
        text = ex.prompt_text
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    limit = data_cfg.max_prompt_length
    if len(ids) > limit:
        if data_cfg.filter_overlong_prompts:
            ex.prompt_ids = ids  # its uncut length, for the report of what was dropped
            return None
        if data_cfg.truncation == "left":
            ids = ids[-limit:]
        elif data_cfg.truncation == "right":
            ids = ids[:limit]
        elif data_cfg.truncation == "error":
            raise ValueError(
                f"prompt {ex.index} has {len(ids)} tokens > data.max_prompt_length={limit} "
                f"(data.truncation=error; set data.truncation=left|right, data.filter_overlong_prompts=true "
                f"or raise data.max_prompt_length)")
        else:
            raise ValueError(f"data.truncation={data_cfg.truncation!r}: expected error, left or right")
        text = tokenizer.decode(ids)
    ex.prompt_ids, ex.prompt_text = ids, text
    return ex
