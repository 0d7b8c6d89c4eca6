"""The data files of a run, checked before launch: the first rows of every train and validation file are read and
checked against what the run reads from them, with the same row checks the loader applies to every row while it
builds the prompts (`qwen35rl/data/dataset.py`).

Two layouts of a row are read:
- qwen35rl's own, as `qwen35rl-data prepare` writes it, or any columns named by `data.prompt_key`,
  `data.answer_key` and `data.image_key` (a dotted key reads a nested field);
- verl's preprocessed parquet (verl's `examples/data_preprocess/*.py`): `prompt` as a list of chat messages,
  the answer in `reward_model.ground_truth`, the images in `images`. A file whose rows lack the configured columns
  but have verl's is read with verl's (`file_keys`), and no `data.system_prompt` is added to its prompts: verl's
  rows carry their instruction.

What stops a run (exit 2, naming the file, row, column and the fix): a file that is not .parquet / .jsonl, cannot
be read or holds no rows; a missing, null or mistyped column; an image that does not decode; more `<image>`
placeholders than images. With `data.skip_bad_rows=true` bad rows are skipped and counted instead (the plan warns
of those among the first rows; a file without one usable row still stops the run).

Torch-free: pyarrow reads the first row group's first rows only, and PIL decodes the images of those rows."""
from __future__ import annotations

import difflib
import io
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from qwen35rl.config.problems import ERROR, WARNING, Problem

HEAD_ROWS = 32
"""Rows the plan reads from the start of each data file."""
IMAGE_PLACEHOLDER = "<image>"
EXTENSIONS = (".parquet", ".jsonl", ".json")
VERL_PROMPT, VERL_ANSWER, VERL_IMAGES = "prompt", "reward_model.ground_truth", "images"
_MISSING = object()


class FileProblem(ValueError):
    """A data file that cannot be read as rows: `message` says what is wrong, `fix` what to do."""

    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.message, self.fix = message, fix


@dataclass(frozen=True)
class Keys:
    """The columns a file is read with, and which layout that is."""

    prompt: str
    answer: str
    image: str
    form: str
    """`qwen35rl` (the configured columns) or `verl` (verl's preprocessed parquet)."""

    @property
    def system_prompt_added(self) -> bool:
        """verl's rows carry their instruction: data.system_prompt is not added to them."""
        return self.form != "verl"


@dataclass(frozen=True)
class RowProblem:
    """Why one row cannot make a prompt: the column (as read) and the setting that names it, and the fix."""

    column: str
    setting: str
    message: str
    fix: str

    def text(self, where: str) -> str:
        return f"{where}: {self.message}; {self.fix}" if self.fix else f"{where}: {self.message}"


def _get(node: Any, key: str, default: Any = None) -> Any:
    try:
        value = node[key]
    except (KeyError, TypeError, AttributeError):
        return default
    return default if value is None else value


def lookup(row: Dict[str, Any], key: str) -> Any:
    """`row[key]`, or a nested field named with dots (`reward_model.ground_truth`); `_MISSING` when absent."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _is_chat(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m and "content" in m
                                                          for m in value)


def is_verl_row(row: Dict[str, Any]) -> bool:
    """A row as verl's data preprocessing writes it: chat messages in `prompt`, the answer in `reward_model`."""
    return _is_chat(row.get(VERL_PROMPT)) and lookup(row, VERL_ANSWER) is not _MISSING


def file_keys(first_row: Dict[str, Any], data_cfg: Any) -> Keys:
    """The columns of a file, from its first row: the configured ones where the row has them, else verl's where
    the row is verl's preprocessed form."""
    prompt, answer = str(_get(data_cfg, "prompt_key", "prompt")), str(_get(data_cfg, "answer_key", "answer"))
    image = str(_get(data_cfg, "image_key", "images"))
    configured = lookup(first_row, prompt) is not _MISSING and lookup(first_row, answer) is not _MISSING
    if not configured and is_verl_row(first_row):
        image = image if lookup(first_row, image) is not _MISSING else VERL_IMAGES
        return Keys(VERL_PROMPT, VERL_ANSWER, image, "verl")
    verl = (prompt, answer) == (VERL_PROMPT, VERL_ANSWER) and is_verl_row(first_row)
    return Keys(prompt, answer, image, "verl" if verl else "qwen35rl")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, float) and value != value:
        return "NaN"
    if isinstance(value, (list, tuple)) and not value:
        return "an empty list"
    if isinstance(value, str) and not value.strip():
        return "an empty string"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    parts = []
    for m in prompt:
        content = m.get("content")
        if isinstance(content, list):  # content parts: {"type": "text", "text": ...} / {"type": "image"}
            parts += [str(c.get("text", "")) if isinstance(c, dict) else str(c) for c in content]
            parts += [IMAGE_PLACEHOLDER for c in content if isinstance(c, dict) and c.get("type") == "image"]
        else:
            parts.append(str(content))
    return " ".join(parts)


def decode_image(image: Any) -> Any:
    """A PIL image (RGB) from a PIL image, raw bytes, a {"bytes": ..., "path": ...} parquet struct or a file path;
    raises (OSError, ValueError) when it does not decode."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, dict):
        image = image.get("bytes") or image.get("path")
    if isinstance(image, (bytes, bytearray)):
        return Image.open(io.BytesIO(image)).convert("RGB")
    if isinstance(image, str):
        return Image.open(image).convert("RGB")
    raise ValueError(f"an image is {_kind(image)} (expected encoded bytes, a {{bytes, path}} struct or a file path)")


def row_problem(row: Any, keys: Keys, multimodal: bool, decode: bool = True) -> Optional[RowProblem]:
    """What keeps `row` from making a prompt, or None. `decode`: decode its images too."""
    if not isinstance(row, dict):
        return RowProblem("-", "-", f"the row is {_kind(row)}, not an object of columns",
                          "write one JSON object (or parquet row) per prompt")
    columns = ", ".join(map(str, row)) or "none"
    setting = {keys.prompt: "data.prompt_key", keys.answer: "data.answer_key", keys.image: "data.image_key"}

    def missing(key: str) -> RowProblem:
        close = difflib.get_close_matches(key, [str(c) for c in row], n=1, cutoff=0.6)
        fix = f"set {setting[key]}={close[0]} if that column holds it" if close else \
            f"set {setting[key]} to the column that holds it"
        if _is_chat(row.get(VERL_PROMPT)) and lookup(row, VERL_ANSWER) is _MISSING:
            fix += f" (verl's preprocessed rows carry the answer in {VERL_ANSWER}, which these lack)"
        return RowProblem(key, setting[key], f"no column {key!r} ({setting[key]}); the row has {columns}",
                          f"{fix}, or write the file with `qwen35rl-data prepare` (README: Data)")

    answer = lookup(row, keys.answer)
    if answer is _MISSING:
        return missing(keys.answer)
    nan = isinstance(answer, float) and answer != answer
    if answer is None or nan or isinstance(answer, (list, tuple, dict, bool)) or \
            (isinstance(answer, str) and not answer.strip()):
        shown = "NaN" if isinstance(answer, float) else _kind(answer).replace("a list", "list").replace("a dict", "dict")
        return RowProblem(keys.answer, setting[keys.answer], f"the answer ({keys.answer}) is {shown}, not a string or "
                          "number",
                          f"fix the row, point {setting[keys.answer]} at the ground-truth column, or skip such rows "
                          "with data.skip_bad_rows=true")
    prompt = lookup(row, keys.prompt)
    if prompt is _MISSING:
        return missing(keys.prompt)
    if isinstance(prompt, list):
        if not _is_chat(prompt):
            return RowProblem(keys.prompt, setting[keys.prompt], f"the prompt ({keys.prompt}) is a list but not chat "
                              "messages (each a {role, content} object)" if prompt else
                              f"the prompt ({keys.prompt}) is an empty list",
                              "give the prompt as text or as chat messages, or skip such rows with "
                              "data.skip_bad_rows=true")
    elif not isinstance(prompt, str) or not prompt.strip():
        return RowProblem(keys.prompt, setting[keys.prompt], f"the prompt ({keys.prompt}) is {_kind(prompt)}, not text "
                          "or chat messages", f"fix the row, point {setting[keys.prompt]} at the prompt column, or skip such "
                          "rows with data.skip_bad_rows=true")
    if not multimodal:
        return None
    images = lookup(row, keys.image)
    if images is _MISSING:
        return missing(keys.image)
    if not isinstance(images, (list, tuple)) or not images:
        return RowProblem(keys.image, setting[keys.image], f"data.kind=multimodal, but the row's images ({keys.image}) "
                          f"are {_kind(images)}", "give each row a list of its images, use data.kind=text, or skip such "
                          "rows with data.skip_bad_rows=true")
    placeholders = _prompt_text(prompt).count(IMAGE_PLACEHOLDER)
    if placeholders > len(images):
        return RowProblem(keys.prompt, setting[keys.prompt], f"the prompt has {placeholders} {IMAGE_PLACEHOLDER} "
                          f"placeholders but the row has {len(images)} image(s) in {keys.image!r}",
                          "give one image per placeholder, or skip such rows with data.skip_bad_rows=true")
    if decode:
        for i, image in enumerate(images):
            try:
                decode_image(image)
            except Exception as e:  # noqa: BLE001 - PIL raises UnidentifiedImageError (OSError), ValueError, ...
                return RowProblem(keys.image, setting[keys.image], f"image {i} of {keys.image!r} does not decode "
                                  f"({type(e).__name__}: {e})",
                                  "fix or re-encode the image (PNG / JPEG bytes or a readable file path), or "
                                  "skip such rows with data.skip_bad_rows=true")
    return None


# ------------------------------------------------------------------------------------------------------- files
def file_type_problem(path: str) -> Optional[FileProblem]:
    if os.path.isdir(path):
        return FileProblem(f"{path} is a directory", "list the .parquet or .jsonl files in it, one by one")
    if not path.endswith(EXTENSIONS):
        ext = os.path.splitext(path)[1] or "(no extension)"
        return FileProblem(f"{path} is a {ext} file; qwen35rl reads .parquet, or .jsonl / .json with one JSON object "
                           "per line", "write the rows as parquet or jsonl (e.g. pandas' to_parquet / to_json("
                           "orient='records', lines=True)) and list that file")
    return None


def read_head(path: str, limit: Optional[int] = HEAD_ROWS) -> Tuple[List[Any], Optional[int]]:
    """(the first `limit` rows of a data file, or all with None; its row count where known without reading it
    all). FileProblem when the file cannot be read as rows or holds none."""
    bad = file_type_problem(path)
    if bad:
        raise bad
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            # buffered reads without pre-buffering: the first rows cost their own pages
            pf = pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False) if limit else pq.ParquetFile(path)
            total = int(pf.metadata.num_rows)
            if limit is None:
                rows = pf.read().to_pylist()
            else:
                rows = []
                for batch in pf.iter_batches(batch_size=limit):
                    rows = batch.to_pylist()[:limit]
                    break
        except Exception as e:  # noqa: BLE001 - pyarrow's errors for a file that is no parquet, or a truncated one
            raise FileProblem(f"{path} cannot be read as a data file: not parquet ({type(e).__name__}: {e})",
                              "give a parquet file (is it another format under a .parquet name?), or write it again")
        if not total:
            raise FileProblem(f"{path} holds no rows", "give a file with prompts, or remove it from the list")
        return rows, total
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise FileProblem(f"{path} cannot be read as a data file: line {n} is not a JSON object "
                                      f"({e.msg})",
                                      "write one JSON object per line (jsonl)") from None
                if limit is not None and len(rows) >= limit:
                    break
    except UnicodeDecodeError:
        raise FileProblem(f"{path} cannot be read as a data file: not UTF-8 text",
                          "a .jsonl file holds one JSON object per line; for parquet "
                          "data, name the file .parquet") from None
    except OSError as e:
        raise FileProblem(f"{path} cannot be read ({e.strerror or e})", "check the path and its permissions") from None
    if not rows:
        raise FileProblem(f"{path} holds no rows", "give a file with prompts, or remove it from the list")
    return rows, (len(rows) if limit is None or len(rows) < limit else None)


_CACHE: Dict[Tuple[Any, ...], Dict[str, Any]] = {}


def _unread(path: str, why: str) -> Dict[str, Any]:
    return {"path": path, "checked": False, "why": why, "error": None, "fix": None, "format": None, "columns": None,
            "rows_read": 0, "rows": None, "bad_rows": []}


def check_file(path: str, data_cfg: Any) -> Dict[str, Any]:
    """The check of one data file (cached per file version and data settings): {path, checked, why (not checked),
    error + fix (the file cannot be read), format, columns, rows_read, rows (count, where known), bad_rows
    ([{row, column, setting, problem, fix}])}."""
    out = _unread(path, None)
    if "://" in path:
        out["why"] = "a remote file: the nodes read it"
        return out
    if not os.path.exists(path):
        out["why"] = "not here: data_file_missing"
        return out
    multimodal = str(_get(data_cfg, "kind", "text")) == "multimodal"
    keys = (str(_get(data_cfg, "prompt_key", "")), str(_get(data_cfg, "answer_key", "")),
            str(_get(data_cfg, "image_key", "")), multimodal)
    try:
        st = os.stat(path)
        cache_key = (os.path.abspath(path), st.st_mtime_ns, st.st_size, keys)
    except OSError:
        cache_key = None
    if cache_key in _CACHE:
        return dict(_CACHE[cache_key])
    out["checked"] = True
    try:
        rows, out["rows"] = read_head(path)
    except FileProblem as e:
        out.update(error=e.message, fix=e.fix)
    else:
        out["rows_read"] = len(rows)
        first = rows[0] if isinstance(rows[0], dict) else {}
        k = file_keys(first, data_cfg)
        out["format"] = k.form
        out["columns"] = {"prompt": k.prompt, "answer": k.answer, "images": k.image if multimodal else None}
        for i, row in enumerate(rows):
            p = row_problem(row, k, multimodal)
            if p is not None:
                out["bad_rows"].append({"row": i, "column": p.column, "setting": p.setting, "problem": p.message,
                                        "fix": p.fix})
    if cache_key is not None:
        _CACHE[cache_key] = dict(out)
    return out


def check(cfg: Any) -> Optional[Dict[str, Any]]:
    """The plan's `data_check`: {rows_per_file, skip_bad_rows, files: [check_file + key]}; None for data generated
    in code."""
    d = cfg["data"]
    if str(_get(d, "kind", "synthetic")) == "synthetic":
        return None
    t = _get(cfg, "trainer", {})
    validates = int(_get(t, "test_freq", 0)) > 0 or bool(_get(t, "val_before_train", False))
    files = []
    for key in ("data.train_files", "data.val_files"):
        for path in _get(d, key.split(".")[1], []) or []:
            if key == "data.val_files" and not validates:  # training never reads them
                files.append({"key": key, **_unread(str(path), "the run does not validate: trainer.test_freq=-1, "
                                                               "trainer.val_before_train=false")})
            else:
                files.append({"key": key, **check_file(str(path), d)})
    return {"rows_per_file": HEAD_ROWS, "skip_bad_rows": bool(_get(d, "skip_bad_rows", False)), "files": files}


def problems(cfg: Any) -> List[Problem]:
    """Errors for files that cannot be read and for bad rows among the first ones (warnings with
    data.skip_bad_rows=true, unless no row read is usable)."""
    result = check(cfg)
    if result is None:
        return []
    skip = result["skip_bad_rows"]
    out: List[Problem] = []
    for f in result["files"]:
        if f["error"]:
            out.append(Problem("data_unusable", f["key"], f["error"], f["fix"], ERROR))
            continue
        bad, read = f["bad_rows"], f["rows_read"]
        if not bad:
            continue
        first = bad[0]
        path = f["path"] + (" (verl's preprocessed format)" if f["format"] == "verl" else "")
        row = f"row {first['row']}: {first['problem']}"
        scope = f"the {read} rows" if f["rows"] == read else f"the first {read} rows"
        if skip and len(bad) < read:
            out.append(Problem("data_rows_skipped", "data.skip_bad_rows", f"{path}: {len(bad)} of {scope} cannot make "
                               f"a prompt and will be skipped (data.skip_bad_rows=true); {row}",
                               "training counts the skipped rows (metrics data/skipped_rows/train and /val, the "
                               "end-of-run summary) and names them in its log", WARNING))
            continue
        if len(bad) == read and read > 1:
            message = f"{path}: none of {scope} can make a prompt; {row}"
        elif len(bad) > 1:
            message = f"{path}: {len(bad)} of {scope} cannot make a prompt; {row}"
        else:
            message = f"{path}, {row}"
        hint = first["fix"] if skip else first["fix"].replace(", or skip such rows with data.skip_bad_rows=true", "")
        if not skip and len(bad) < read:
            hint += "; or data.skip_bad_rows=true to skip the rows that cannot make a prompt (counted)"
        out.append(Problem("data_unusable", f["key"], message, hint, ERROR))
    return out


def render_lines(result: Optional[Dict[str, Any]]) -> List[str]:
    """The plan's `data check` lines: one per file."""
    if not result:
        return []
    lines, seen = [], set()
    for f in sorted(result["files"], key=lambda f: not f["checked"]):
        name = f["path"]
        if name in seen:  # the same file for training and validation: said once
            continue
        seen.add(name)
        if not f["checked"]:
            lines.append(f"  data check {name}: not read ({f['why']})")
        elif f["error"]:
            lines.append(f"  data check {name}: UNUSABLE ({f['error']})")
        else:
            c = f["columns"]
            cols = f"prompt={c['prompt']}, answer={c['answer']}" + (f", images={c['images']}" if c["images"] else "")
            form = "verl's preprocessed format" if f["format"] == "verl" else "qwen35rl format"
            extra = "; instruction in the rows, no data.system_prompt added" if f["format"] == "verl" else ""
            bad = len(f["bad_rows"])
            verdict = "all usable" if not bad else f"{bad} bad" + (" (skipped)" if result["skip_bad_rows"] else "")
            lines.append(f"  data check {name}: {form} ({cols}{extra}); first {f['rows_read']} row(s) read, {verdict}")
    return lines
