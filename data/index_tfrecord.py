"""Write the index file of TFRecord files (one "offset length" line per record).

The format is that of `tfrecord.tools.tfrecord2idx`. `write_into_tfrecord.py` writes indices
itself; this is for TFRecord files made elsewhere. Only record headers are read, so it is fast.

Example:
    python data/index_tfrecord.py out/*.tfrecord
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python data/index_tfrecord.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.errors import DataError
from data.parallel import run_script
from data.tfrecord_io import RecordError, index_path_for, scan_records, write_index


def index_file(path: str) -> int:
    """Write the index of one TFRecord file beside it and return its number of records.

    Raises:
        DataError: the file is missing or a record header is corrupt or truncated.
    """
    if not Path(path).is_file():
        raise DataError(f"{path} does not exist")
    try:
        entries = scan_records(path)
    except RecordError as error:
        raise DataError(f"{path} {error}") from None
    write_index(entries, index_path_for(path))
    return len(entries)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tfrecord_files", nargs="+", help="TFRecord files to index")
    args = parser.parse_args(argv)
    for path in args.tfrecord_files:
        count = index_file(path)
        print(f"[index] {index_path_for(path)}: {count} records", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_script(main)
