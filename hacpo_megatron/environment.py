"""The process environment, changed for a block: what processes started inside it inherit."""
from __future__ import annotations

import contextlib
import os
from typing import Dict, Iterator


@contextlib.contextmanager
def environment_set(values: Dict[str, str]) -> Iterator[None]:
    """`values` in os.environ inside the block; every variable as it was (or absent) after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
