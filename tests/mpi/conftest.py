import json
import os
from pathlib import Path


def rank_records(directory: Path) -> list[dict]:
    """What each rank of tests/model_dirs/mpi_ranks wrote at start (with its pid)."""
    return [{**json.loads(p.read_text()), "pid": int(p.stem)} for p in sorted(directory.glob("*.json"))]


def rank_log(directory: Path, pid: int) -> list[str]:
    path = directory / f"{pid}.log"
    return path.read_text().splitlines() if path.exists() else []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
