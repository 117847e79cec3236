"""Reading a model directory's files with errors that name the file (a sharded checkpoint has
many, and a bare JSONDecodeError or SafetensorError says neither which nor why)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{file} is not UTF-8 text: {exc}") from None
