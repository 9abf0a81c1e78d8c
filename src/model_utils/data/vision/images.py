"""The images of the rows as files: a path as written (relative ones from the data file's directory), or, for an image
the dataset holds itself (a `datasets` Image column's bytes, a PIL image), a PNG file written once into the packed
data's cache under its content's digest. Every image an example names is then a path that each rank opens when its
micro-batch needs it; a missing or unreadable one is refused before the run with its row and file.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

from model_utils.data.sft.formats import row_problem


def open_rgb(path: str):
    """The image at `path`, decoded, in RGB (what every image processor takes)."""
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


class ImageFiles:
    """Resolves the image values of rows to files: `base_dir` for relative paths, `store` (a directory of the cache)
    for the images a dataset holds itself."""

    def __init__(self, base_dir: str | None, store: Path):
        self.base_dir = Path(base_dir) if base_dir else None
        self.store = Path(store)

    def path_of(self, value, source: str, number: int) -> str:
        """The file of one image value of row `number`, or a DataError naming the row and the fix."""
        if isinstance(value, dict):  # a datasets Image value not decoded: {"bytes": ..., "path": ...}
            if value.get("bytes"):
                return self._stored(value["bytes"])
            value = value.get("path")
        if hasattr(value, "save") and hasattr(value, "mode"):  # a PIL image (a decoded datasets Image column)
            buffer = io.BytesIO()
            value.save(buffer, format="PNG")
            return self._stored(buffer.getvalue())
        if not isinstance(value, str) or not value:
            raise row_problem(source, number, f"has an image that is neither a path nor an image ({type(value).__name__})",
                              "give each image as a file path (relative to the data file), or as a datasets Image")
        if value.startswith(("http://", "https://")):
            raise row_problem(source, number, f"names the image {value}, a URL: training reads local files only",
                              "download the images and write their paths (relative to the data file) instead")
        path = Path(value).expanduser()
        if not path.is_absolute() and self.base_dir is not None:
            path = self.base_dir / path
        if not path.is_file():
            where = f" (relative paths are read from {self.base_dir})" if self.base_dir and not Path(value).is_absolute() else ""
            raise row_problem(source, number, f"names the image {value}, which is not a file{where}",
                              "fix the path, or copy the image there")
        return str(path.resolve())

    def _stored(self, data: bytes) -> str:
        """`data` (an encoded image) as a file of the store, named by its digest; written once (to a temporary name,
        then moved)."""
        digest = hashlib.sha256(data).hexdigest()[:32]
        path = self.store / f"{digest}.img"
        if not path.exists():
            self.store.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return str(path)


def readable_image(path: str, source: str, number: int):
    """The decoded RGB image of row `number`, or a DataError naming the file and the row."""
    from PIL import UnidentifiedImageError

    try:
        return open_rgb(path)
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise row_problem(source, number, f"names the image {path}, which cannot be read as an image "
                          f"({str(e).splitlines()[0] if str(e) else type(e).__name__})",
                          "replace the file with a PNG or JPEG image, or remove the row") from e
