"""Rows with images: the layouts users hold, read into one form (chat messages whose content is a list of parts, and
the row's images in the order the parts name them), each row checked with a Problem naming it and the fix.

Layouts (one per dataset, from the columns):
  chat      TRL's: `messages`, each {"role", "content"} with content a string or a list of parts ({"type": "image"},
            {"type": "text", "text": ...}), and `images`: a list of image paths (relative to the data file), PIL
            images or `datasets` Image values, one per image part, in order. A row without images leaves `images`
            out or empty.
  sharegpt  LLaVA's: `conversations` of {"from", "value"} (human, gpt, system), an `<image>` tag in a value where an
            image stands, and `image`: one path or a list of them, one per tag, in order.

In either layout an `<image>` tag inside a text stands for the next image, as LLaVA writes it. The loss is on the
assistant's (gpt's) answers only, as for text chats; the image tokens never carry loss.
"""

from __future__ import annotations

from model_utils.data.sft.formats import SHAREGPT_ROLES, row_problem

VISION = "vision"  # the data format of a vision-language model's run (data.pipeline.prepare_data)
IMAGE_TAG = "<image>"

VISION_FORMATS = ("chat", "sharegpt")

IMAGE_COLUMNS = {"chat": "images", "sharegpt": "image"}

LAYOUT_HELP = ('chat: {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": '
               '"..."}]}, {"role": "assistant", "content": "..."}], "images": ["a.png"]}; sharegpt: '
               '{"conversations": [{"from": "human", "value": "<image>\\n..."}, {"from": "gpt", "value": "..."}], '
               '"image": "a.png"}')


def vision_format(columns: list[str], requested: str, source: str) -> str:
    """The layout of a dataset with images from its columns (`requested`: --data_format, auto or one of
    VISION_FORMATS). Raises DataError naming the data, the columns and the layouts."""
    from model_utils.core.problems import Problem
    from model_utils.data.errors import DataError

    if requested in VISION_FORMATS and ({"chat": "messages", "sharegpt": "conversations"}[requested] in columns):
        return requested
    if requested == "auto":
        if "messages" in columns:
            return "chat"
        if "conversations" in columns:
            return "sharegpt"
    raise DataError(Problem("--dataset", source, f"holds no rows a vision-language model reads (columns: "
                            f"{', '.join(columns) or 'none'}; --data_format {requested})",
                            f"give each row one of the layouts ({LAYOUT_HELP}), and leave --data_format at auto"))


def _text_parts(text: str) -> list[dict]:
    """A text as parts, each `<image>` tag an image part."""
    parts = []
    for i, piece in enumerate(text.split(IMAGE_TAG)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _content_parts(content) -> list[dict] | None:
    """A message's content as parts, None where it is neither a string nor a list of known parts."""
    if isinstance(content, str):
        return _text_parts(content)
    if not isinstance(content, list):
        return None
    parts = []
    for part in content:
        if not isinstance(part, dict):
            return None
        kind = part.get("type")
        if kind == "image":
            parts.append({"type": "image"})
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.extend(_text_parts(part["text"]))
        else:
            return None
    return parts


def _image_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def row_messages(row: dict, fmt: str, number: int, source: str) -> tuple[list[dict], list]:
    """(messages whose content is a list of parts, the row's image values in order) of row `number` (1-based), or a
    DataError naming the row: a malformed conversation, no answer, or image parts and images that do not pair up."""
    if fmt == "sharegpt":
        turns = row.get("conversations")
        if not isinstance(turns, list) or not all(isinstance(t, dict) and isinstance(t.get("value"), str)
                                                   and t.get("from") in SHAREGPT_ROLES for t in turns or [None]):
            raise row_problem(source, number, "`conversations` is not a list of {from, value} with from human, gpt "
                              "or system", f"write the rows as {LAYOUT_HELP}")
        messages = [{"role": SHAREGPT_ROLES[t["from"]], "content": _text_parts(t["value"])} for t in turns]
    else:
        raw = row.get("messages")
        messages = []
        for message in raw if isinstance(raw, list) else [None]:
            parts = _content_parts(message.get("content")) if isinstance(message, dict) else None
            if parts is None or not isinstance(message.get("role"), str):
                raise row_problem(source, number, "`messages` is not a list of {role, content} with content a "
                                  "string or a list of {\"type\": \"image\"} and {\"type\": \"text\", \"text\": ...}",
                                  f"write the rows as {LAYOUT_HELP}")
            messages.append({"role": message["role"], "content": parts})
    images = _image_list(row.get(IMAGE_COLUMNS[fmt]))
    if not any(m["role"] == "assistant" for m in messages):
        raise row_problem(source, number, "has no assistant (gpt) message, so no token would carry loss",
                          "add the answer, or remove the row")
    slots = sum(part["type"] == "image" for m in messages for part in m["content"])
    if slots != len(images):
        column, slot = IMAGE_COLUMNS[fmt], "<image> tag" if fmt == "sharegpt" else "image part or <image> tag"
        raise row_problem(source, number, f"names {slots} image(s) in its conversation but holds {len(images)} in "
                          f"`{column}`", f"give one image in `{column}` per {slot}, in order")
    return messages, images


def rendered(messages: list[dict]) -> list[dict]:
    """Messages as chat templates take them: text-only content as a string (templates written for text chats), lists
    of parts kept where an image is among them."""
    out = []
    for message in messages:
        parts = message["content"]
        if all(part["type"] == "text" for part in parts):
            out.append({"role": message["role"], "content": "".join(part["text"] for part in parts)})
        else:
            out.append({"role": message["role"], "content": [dict(part) for part in parts]})
    return out
