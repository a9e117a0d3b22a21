"""Copies the finished shards of a `dspark-hf prepare-data` folder into a compact folder for committing.

The training campaign runs over several sessions on machines that do not outlive them, so its regenerated answers are
committed. A committed shard keeps what training reads (`input_ids`, `loss_mask`, `prompt_length`, ...) and leaves
out the decoded `messages` text (half the size; the text is `tokenizer.decode(input_ids)`), compressed with zstd.
Its `.done.json` travels with it, so `prepare-data` run over a copy of the packed folder skips those prompts. Shards
already packed are left alone.

    python scripts/pack_campaign_shards.py /work/data/conv-v2 training_data/smollm2-135m-instruct/conv-v2
"""

import argparse
import shutil
from pathlib import Path

import pyarrow.parquet as pq

from dspark_hf.training.data import DONE_SUFFIX


def pack(source: Path, destination: Path) -> list[str]:
    """Packs every finished shard of `source` not yet in `destination`; returns the names packed."""
    destination.mkdir(parents=True, exist_ok=True)
    packed = []
    for done in sorted(source.glob(f"*{DONE_SUFFIX}")):
        name = done.name[: -len(DONE_SUFFIX)]
        if (destination / done.name).exists():
            continue
        shard = source / f"{name}.parquet"
        if shard.exists():  # a shard whose prompts all failed has a done file and no parquet
            table = pq.read_table(shard)
            table = table.drop_columns([column for column in ("messages",) if column in table.column_names])
            tmp = destination / f"{name}.parquet.tmp"
            pq.write_table(table, tmp, compression="zstd", compression_level=19)
            tmp.replace(destination / f"{name}.parquet")
        shutil.copyfile(done, destination / done.name)  # last: a shard counts as packed once its done file is there
        packed.append(name)
    return packed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a prepare-data output folder")
    parser.add_argument("destination", type=Path, help="the folder to commit")
    args = parser.parse_args(argv)
    if not args.source.is_dir():
        parser.error(f"{args.source} is not a folder; pass a prepare-data --output_dir.")
    names = pack(args.source, args.destination)
    print(f"packed {len(names)} shard(s) into {args.destination}")


if __name__ == "__main__":
    main()
