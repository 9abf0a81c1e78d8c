"""Print the versions of the project's dependencies in this environment, one line, for CI's log."""

import sys
from importlib import metadata

NAMES = ("torch", "deepspeed", "transformers", "datasets", "tokenizers", "numpy", "safetensors", "tqdm", "peft", "accelerate",
         "trl")


def version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


label = sys.argv[1] if len(sys.argv) > 1 else "versions"
print(f"{label}: python {sys.version.split()[0]} | " + " | ".join(f"{n} {version(n)}" for n in NAMES), flush=True)
