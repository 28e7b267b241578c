"""Reading rows from JSONL and Parquet files, each row tagged with where it came from for error messages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator, Tuple

ROW_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


class DataFormatError(ValueError):
    """A data file or one of its rows is malformed; the message names the file and the line or row."""


def read_rows(path: str | Path) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """Yield ``(location, row)`` for each row: location is "file:line N" (JSONL) or "file:row N" (Parquet)."""
    path = Path(path)
    if not path.is_file():
        raise DataFormatError(f"{path}: no such file")
    if path.suffix == ".parquet":
        yield from _read_parquet(path)
    elif path.suffix in (".jsonl", ".json"):
        yield from _read_jsonl(path)
    else:
        raise DataFormatError(f"{path}: unknown file type {path.suffix!r}; expected one of {ROW_FILE_SUFFIXES}")


def _read_jsonl(path: Path) -> Iterator[Tuple[str, Dict[str, Any]]]:
    with path.open("rb") as lines:
        for line_number, raw in enumerate(lines, start=1):
            location = f"{path}:line {line_number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataFormatError(f"{location}: not UTF-8 text (byte {raw[exc.start]:#04x} at column "
                                      f"{exc.start + 1})") from None
            if not line.strip():
                continue  # blank lines (a trailing newline) hold no row
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataFormatError(f"{location}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise DataFormatError(f"{location}: expected a JSON object, got {type(row).__name__}")
            yield location, row


def _read_parquet(path: Path) -> Iterator[Tuple[str, Dict[str, Any]]]:
    import pyarrow.parquet  # imported here: only Parquet users pay for it

    try:
        table = pyarrow.parquet.read_table(path)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise DataFormatError(f"{path}: cannot read as Parquet: {exc}") from exc
    for row_index, row in enumerate(table.to_pylist()):
        yield f"{path}:row {row_index}", row
