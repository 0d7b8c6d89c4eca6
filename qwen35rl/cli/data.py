"""`qwen35rl-data prepare gsm8k|geo3k --out DIR`: write the parquet files the data configs read
(`DIR/<name>/train.parquet`, `DIR/<name>/test.parquet`), from the Hugging Face hub or a local copy of it.

Exit codes: 0 written; 2 refused (unknown dataset or split, hub unreachable, --source without the files, an existing
non-empty output without --force, `datasets` not installed)."""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from qwen35rl.cli.stdout import console_script
from qwen35rl.exit_codes import EXIT_CONFIG

EXAMPLES = """examples:
  qwen35rl-data prepare gsm8k --out data                 # data/gsm8k/{train,test}.parquet from the hub
  qwen35rl-data prepare geo3k --out data --splits train,validation,test
  qwen35rl-data prepare gsm8k --out data --source ~/hf/gsm8k   # a copy of the hub repo (main/train-*.parquet)

exit codes: 0 written; 2 refused (the reason is printed; nothing is written)
"""


def parser() -> argparse.ArgumentParser:
    from qwen35rl.data.prepare import DATASETS, DEFAULT_SPLITS

    p = argparse.ArgumentParser(prog="qwen35rl-data", description="Data files for the qwen35rl data configs.",
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    known = "; ".join(f"{s.name} = {s.hub_id} ({', '.join(s.splits)})" for s in DATASETS.values())
    prep = sub.add_parser(
        "prepare", help="write DIR/NAME/<split>.parquet for data=NAME",
        description=f"Load a dataset with the `datasets` library and write the parquet files data=NAME reads. "
                    f"Datasets: {known}.", epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    prep.add_argument("name", metavar="NAME", help=f"the dataset: {' or '.join(DATASETS)}")
    prep.add_argument("--out", metavar="DIR", default="data",
                      help="output root: files go to DIR/NAME/<split>.parquet (default: data, the paths the data "
                           "configs name, relative to where you train)")
    prep.add_argument("--source", metavar="HUB_ID_OR_DIR",
                      help="a local directory laid out as the hub repository (gsm8k: main/<split>-*.parquet; "
                           "geo3k: data/<split>-*.parquet), or another hub id (default: the dataset's own)")
    prep.add_argument("--splits", default=",".join(DEFAULT_SPLITS), metavar="A,B",
                      help=f"comma-separated splits to write (default: {','.join(DEFAULT_SPLITS)})")
    prep.add_argument("--force", action="store_true", help="replace the split files of an existing DIR/NAME")
    prep.add_argument("--cache-dir", metavar="DIR",
                      help="the `datasets` cache (default: its own, under ~/.cache/huggingface)")
    return p


def _train_command(name: str, out: str, written: List[Path]) -> str:
    """The qwen35rl-train command that reads the written files."""
    train = [p for p in written if p.stem == "train"]
    val = [p for p in written if p.stem == "test"] or [p for p in written if p.stem == "validation"]
    defaults = Path(out).expanduser().resolve() == Path("data").resolve() and val and val[0].stem == "test"
    args = [f"data={name}"]
    if not defaults:
        if train:
            args.append(f"data.train_files=[{train[0]}]")
        if val:
            args.append(f"data.val_files=[{val[0]}]")
    return "qwen35rl-train " + " ".join(shlex.quote(a) for a in args)


@console_script
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from qwen35rl.data.prepare import DATASETS, PrepareError, prepare

    try:
        written = prepare(args.name, out=args.out, source=args.source, splits=args.splits.split(","),
                          force=args.force, cache_dir=args.cache_dir)
    except PrepareError as e:
        print(f"qwen35rl-data: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    columns = ", ".join(DATASETS[args.name].columns)
    for w in written:
        print(f"qwen35rl-data: wrote {w.path} ({w.rows} rows: {columns})")
    print(f"qwen35rl-data: train with: {_train_command(args.name, args.out, [w.path for w in written])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
