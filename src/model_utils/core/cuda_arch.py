"""TORCH_CUDA_ARCH_LIST as DeepSpeed's op builder can read it, in one place: the trainer normalises its own environment
with it (runtime.distributed.normalize_cuda_arch_list), and the launchers run this file to check and normalise the value
they export (scripts/launch_common.sh), so a malformed entry stops a launch before any job starts.

    python3 src/model_utils/cuda_arch.py "8.0 9.0a;10.0f+PTX"     prints 8.0;9.0;10.0+PTX (exit 1 with the reason)

Standard library only: the launchers run it before they have chosen the project's Python environment.
"""

import re
import sys

ENTRY = re.compile(r"^(\d+\.\d+)[a-zA-Z]*(\+PTX)?$")


def normalize(value: str) -> str:
    """DeepSpeed's op builder parses each entry with int(), so the arch-specific suffixes some images set go
    ('9.0a' -> '9.0', '10.0f' -> '10.0'); '+PTX' stays; ';'-separated, duplicates dropped. ValueError names an entry
    that is not an architecture."""
    entries = []
    for item in re.split(r"[;,\s]+", value.strip()):
        if not item:
            continue
        match = ENTRY.match(item)
        if not match:
            raise ValueError(f"TORCH_CUDA_ARCH_LIST entry '{item}' is not like 9.0, 9.0a or 8.6+PTX: fix "
                             "TORCH_CUDA_ARCH_LIST")
        entry = match.group(1) + (match.group(2) or "")
        if entry not in entries:
            entries.append(entry)
    return ";".join(entries)


if __name__ == "__main__":
    try:
        print(normalize(sys.argv[1]))
    except ValueError as error:
        print(error, file=sys.stderr)
        sys.exit(1)
