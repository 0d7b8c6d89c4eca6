"""`qwen35rl-data prepare NAME`: the parquet files `conf/data/<NAME>.yaml` reads, made from the public dataset.

Each dataset is loaded with the `datasets` library, from the Hugging Face hub (`load_dataset(HUB_ID, CONFIG)`) or from
a local copy of the hub repository's parquet shards (`load_dataset("parquet", data_files=...)`), converted row by row
and written to `OUT/<NAME>/<split>.parquet`:

- gsm8k (openai/gsm8k, config main; splits train, test): `question`; `answer` = the final number (what follows the
  solution's `#### ` line, thousands separators removed), which `data.reward=math` compares the boxed answer with;
  `solution` = the original answer text (worked solution and `#### N` line).
- geo3k (hiyouga/geometry3k; splits train, validation, test): `problem` (with its `<image>` placeholder), `answer`,
  `images` = a list of {bytes, path} structs (the encoded image files, as the hub stores them and as
  `qwen35rl.data.dataset` reads them).

`datasets` is imported only here, when a dataset is prepared (`pip install 'qwen35rl[data]'`).
"""
from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from qwen35rl.config.datasets import COLUMNS, DEFAULT_SPLITS, SPLITS


class PrepareError(Exception):
    """A dataset that cannot be prepared as asked (the command exits 2 with this message)."""


@dataclass(frozen=True)
class Spec:
    name: str
    hub_id: str
    hub_config: Optional[str]
    folder: str
    """The folder of the hub repository that holds this config's parquet shards (`<split>-00000-of-00001.parquet`)."""
    splits: Tuple[str, ...]
    source_columns: Tuple[str, ...]
    convert: Callable[[Dict[str, Any], int, str, Optional[Path]], Dict[str, Any]]
    columns: Tuple[str, ...]
    """Columns of the written files, in order."""


# ------------------------------------------------------------------------------------------------------ rows
_FINAL_ANSWER = "####"
_GROUPED_NUMBER = re.compile(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?")


def final_answer(solution: str) -> Optional[str]:
    """What follows the last `####` of a GSM8K answer ("1,000" -> "1000"); None when there is no such line."""
    head, sep, tail = str(solution).rpartition(_FINAL_ANSWER)
    answer = tail.strip()
    if not sep or not answer:
        return None
    return answer.replace(",", "") if _GROUPED_NUMBER.fullmatch(answer) else answer


def _gsm8k_row(row: Dict[str, Any], n: int, split: str, source_dir: Optional[Path]) -> Dict[str, Any]:
    solution = str(row["answer"])
    answer = final_answer(solution)
    if answer is None:
        raise PrepareError(f"gsm8k {split} row {n}: its answer has no '#### <final answer>' line "
                           f"(it ends with {solution[-60:]!r})")
    return {"question": str(row["question"]).strip(), "answer": answer, "solution": solution}


def _geo3k_row(row: Dict[str, Any], n: int, split: str, source_dir: Optional[Path]) -> Dict[str, Any]:
    images = row["images"]
    if images is None:
        images = []
    elif not isinstance(images, (list, tuple)):
        images = [images]
    return {"problem": str(row["problem"]).strip(), "answer": str(row["answer"]).strip(),
            "images": [_image_struct(img, f"geo3k {split} row {n}", source_dir) for img in images]}


def _image_struct(image: Any, where: str, source_dir: Optional[Path]) -> Dict[str, Any]:
    """{bytes, path} of one image: the stored encoded bytes as they are; a file named by path only is read in."""
    path = None
    if isinstance(image, dict):
        path = image.get("path")
        data = image.get("bytes")
    elif isinstance(image, (bytes, bytearray)):
        data = bytes(image)
    elif hasattr(image, "save"):  # a decoded PIL image
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        data = buf.getvalue()
    else:
        raise PrepareError(f"{where}: unsupported image value of type {type(image).__name__}")
    if not data and path:
        candidates = [Path(path)] + ([source_dir / path] if source_dir is not None else [])
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise PrepareError(f"{where}: the image has no bytes and its path {path!r} is not a file here")
        data = found.read_bytes()
    if not data:
        raise PrepareError(f"{where}: an image without bytes or path")
    return {"bytes": bytes(data), "path": path}


DATASETS: Dict[str, Spec] = {
    "gsm8k": Spec("gsm8k", "openai/gsm8k", "main", "main", SPLITS["gsm8k"], ("question", "answer"),
                  _gsm8k_row, COLUMNS["gsm8k"]),
    "geo3k": Spec("geo3k", "hiyouga/geometry3k", None, "data", SPLITS["geo3k"],
                  ("problem", "answer", "images"), _geo3k_row, COLUMNS["geo3k"]),
}


def local_layouts(spec: Spec, split: str) -> List[str]:
    """Glob patterns (relative to --source) tried in order for a split's parquet shards: the hub repository's
    layout, its folder itself, and the hub's parquet conversion (refs/convert/parquet)."""
    config = spec.hub_config or "default"
    return [f"{spec.folder}/{split}-*.parquet", f"{split}-*.parquet", f"{config}/{split}/*.parquet"]


# -------------------------------------------------------------------------------------------------- loading
def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise PrepareError("qwen35rl-data needs the 'datasets' package: pip install 'qwen35rl[data]' "
                           "(or pip install 'datasets>=2.14')") from None
    return datasets


def _local_files(spec: Spec, source: Path, splits: Sequence[str]) -> Dict[str, List[str]]:
    files: Dict[str, List[str]] = {}
    for split in splits:
        for pattern in local_layouts(spec, split):
            found = sorted(str(p) for p in source.glob(pattern) if p.is_file())
            if found:
                files[split] = found
                break
        else:
            tried = ", ".join(str(source / p) for p in local_layouts(spec, split))
            raise PrepareError(f"--source {source}: no {split} parquet files of {spec.hub_id} there (looked for "
                               f"{tried}); give a copy of the hub repository (its {spec.folder}/ folder holds "
                               f"{split}-00000-of-00001.parquet)")
    return files


def _check_parquet(path: str) -> None:
    """A parquet file starts and ends with the magic bytes PAR1: a shard that does not is named, not a traceback."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
            f.seek(max(os.path.getsize(path) - 4, 0))
            tail = f.read(4)
    except OSError as e:
        raise PrepareError(f"--source: cannot read {path} ({e.strerror or e})") from None
    if head != b"PAR1" or tail != b"PAR1":
        raise PrepareError(f"--source: {path} is not a parquet file (no PAR1 magic bytes); give a copy of the hub "
                           "repository's parquet files as they are")


def load_splits(spec: Spec, source: Optional[str], splits: Sequence[str],
                cache_dir: Optional[str] = None) -> Dict[str, Any]:
    """split -> a `datasets.Dataset`, from the hub (source None or a hub id) or a local directory."""
    datasets = _import_datasets()
    local = Path(source).expanduser() if source else None
    if local is not None and local.exists():
        if not local.is_dir():
            raise PrepareError(f"--source {source}: not a directory (give the directory of the hub repository's "
                               f"files, e.g. one holding {spec.folder}/train-00000-of-00001.parquet)")
        files = _local_files(spec, local, splits)
        for f in (f for shards in files.values() for f in shards):
            _check_parquet(f)
        try:
            loaded = datasets.load_dataset("parquet", data_files=files, cache_dir=cache_dir)
        except Exception as e:  # noqa: BLE001 - a shard the reader refuses: said with the files, no traceback
            raise PrepareError(f"--source {source}: the parquet files could not be read ({type(e).__name__}: "
                               f"{e}); give a copy of the hub repository's files as they are") from None
        return {split: loaded[split] for split in splits}
    hub_id = source or spec.hub_id
    if source and (source.startswith((".", "/", "~")) or not re.fullmatch(r"[\w.-]+/[\w.-]+", source)):
        raise PrepareError(f"--source {source}: no such directory here (nor a hub id like {spec.hub_id})")
    try:
        unreachable = _hub_unreachable()
        if unreachable:  # datasets would retry for half a minute before saying so
            raise ConnectionError(unreachable)
        loaded = datasets.load_dataset(hub_id, spec.hub_config, cache_dir=cache_dir)
    except Exception as e:  # noqa: BLE001 - any failure to fetch is said the same way, with the way out
        what = f"{hub_id}" + (f" (config {spec.hub_config})" if spec.hub_config else "")
        reason = f"{type(e).__name__}: {e}"
        cause = ("the Hugging Face hub is not reachable from here"
                 if isinstance(e, ConnectionError) or "connect" in reason.lower() or "offline" in reason.lower()
                 else "the hub did not give it")
        local_note = f" (--source {source} is not a directory here, so it was taken as a hub id)" if source else ""
        shards = ", ".join(f"{s}-00000-of-00001.parquet" for s in spec.splits)
        raise PrepareError(
            f"could not load {what} from the Hugging Face hub{local_note}: {cause} ({reason}). Copy the repository's "
            f"parquet files from a machine that reaches the hub (its {spec.folder}/ folder: {shards}) and pass "
            f"--source DIR with that copy, or set HF_ENDPOINT to a mirror") from None
    missing = [s for s in splits if s not in loaded]
    if missing:
        raise PrepareError(f"{hub_id} has no split {', '.join(missing)} (it has {', '.join(loaded)})")
    return {split: loaded[split] for split in splits}


HUB_PROBE_S = 3.0
"""Seconds to wait for a TCP connection to the hub before saying it cannot be reached."""


def _hub_unreachable() -> Optional[str]:
    """Why the hub (HF_ENDPOINT, default huggingface.co) cannot be reached from here, in one quick TCP connection;
    None when it can, or when the hub is switched off (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE: datasets reads its
    cache then)."""
    import os
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return None
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_S).close()
    except OSError as e:
        return f"cannot connect to {host}:{port} within {HUB_PROBE_S:g} s ({e})"
    return None


# -------------------------------------------------------------------------------------------------- writing
def _features(spec: Spec) -> Any:
    datasets = _import_datasets()
    text = datasets.Value("string")
    if spec.name == "geo3k":
        image_list = getattr(datasets, "List", None) or datasets.Sequence
        return datasets.Features({"problem": text, "answer": text, "images": image_list(datasets.Image())})
    return datasets.Features({c: text for c in spec.columns})


def _schema(spec: Spec) -> Any:
    """The written schema, with the `datasets` feature metadata (images load as images with `datasets` too)."""
    import pyarrow as pa

    features = _features(spec)
    schema = getattr(features, "arrow_schema", None)
    return schema if schema is not None else pa.schema(features.type)


def convert_split(spec: Spec, dataset: Any, split: str, source_dir: Optional[Path] = None) -> List[Dict[str, Any]]:
    """The written rows of one loaded split. Read in Arrow form: images stay the stored encoded bytes."""
    table = dataset.with_format("arrow")[:]
    missing = [c for c in spec.source_columns if c not in table.column_names]
    if missing:
        raise PrepareError(f"{spec.hub_id} {split}: the rows lack {', '.join(missing)} (their columns: "
                           f"{', '.join(table.column_names)}); is --source a copy of {spec.hub_id}?")
    rows = table.select(list(spec.source_columns)).to_pylist()
    return [spec.convert(row, n, split, source_dir) for n, row in enumerate(rows)]


@dataclass
class Written:
    split: str
    path: Path
    rows: int


def _check_splits(spec: Spec, splits: Sequence[str]) -> List[str]:
    splits = [s.strip() for s in splits if s.strip()]
    if not splits:
        raise PrepareError("--splits is empty")
    unknown = [s for s in splits if s not in spec.splits]
    if unknown:
        raise PrepareError(f"{spec.name} has no split {', '.join(map(repr, unknown))}: its splits are "
                           f"{', '.join(spec.splits)}")
    return list(dict.fromkeys(splits))


def get_spec(name: str) -> Spec:
    if name not in DATASETS:
        from qwen35rl.names import did_you_mean

        hint = did_you_mean(name, DATASETS)
        raise PrepareError(f"unknown dataset {name!r}: qwen35rl-data prepares {' or '.join(DATASETS)}"
                           + (f" ({hint})" if hint else ""))
    return DATASETS[name]


def prepare(name: str, out: str = "data", source: Optional[str] = None, splits: Sequence[str] = DEFAULT_SPLITS,
            force: bool = False, cache_dir: Optional[str] = None) -> List[Written]:
    """Load, convert and write `out/<name>/<split>.parquet` for each split; nothing is written unless every split
    loaded and converted. An existing non-empty `out/<name>` is refused unless `force` (its split files are then
    replaced, other files left alone)."""
    spec = get_spec(name)
    splits = _check_splits(spec, splits)
    target = Path(out).expanduser() / spec.name
    if target.exists() and not target.is_dir():
        raise PrepareError(f"{target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not force:
        raise PrepareError(f"{target} exists and is not empty ({', '.join(sorted(p.name for p in target.iterdir()))}): "
                           f"pass --force to replace its {', '.join(s + '.parquet' for s in splits)}, or choose "
                           "another --out")
    _check_writable(target, "--out", out)
    if cache_dir:
        _check_writable(Path(cache_dir).expanduser(), "--cache-dir", cache_dir)
    loaded = load_splits(spec, source, splits, cache_dir=cache_dir)
    source_dir = Path(source).expanduser() if source and Path(source).expanduser().is_dir() else None
    converted = {split: convert_split(spec, loaded[split], split, source_dir) for split in splits}
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _schema(spec)
    written = []
    try:
        target.mkdir(parents=True, exist_ok=True)
        for split, rows in converted.items():
            path = target / f"{split}.parquet"
            tmp = path.with_name(f".{path.name}.tmp")
            try:
                pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            written.append(Written(split, path, len(rows)))
    except OSError as e:  # a full disk, a directory made read-only meanwhile
        raise PrepareError(f"--out {out}: cannot write {e.filename or target} ({e.strerror or e})"
                           + (f"; written before it: {', '.join(str(w.path) for w in written)}" if written else "")) from None
    return written


def _check_writable(path: Path, flag: str, given: str) -> None:
    """`path` (a directory to write) can be made here; checked before anything is loaded."""
    from qwen35rl.config.paths import unwritable_dir

    why = unwritable_dir(str(path))
    if why:
        raise PrepareError(f"{flag} {given}: {path} cannot be made: {why} (choose a directory you can write)")
