"""Images in datasets: every input form made canonical PNG bytes, and the `<image>` markers that place them.

A dataset row holds `images: list<binary>` (PNG, in marker order) beside messages whose text keeps one `IMAGE_MARKER`
per image (veRL's convention). PIL is imported only where an image is decoded or encoded.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

IMAGE_MARKER = "<image>"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# The chat fields of prompts and sft rows whose content may hold image parts (`take_images`), in chat order.
MESSAGE_FIELDS = ("messages", "prompt", "completion", "response")
_PART_IMAGE_KEYS = ("image", "image_url", "url", "path", "bytes")
_MAX_PATH_CHARS = 4096  # longer text is never tried as a file name (base64 data would make the OS refuse it)


class ImageError(ValueError):
    """An image, or a row's images and markers, are wrong; the message names the field (callers add file and row)."""


def encode_png(image: Any) -> bytes:
    """A PIL image as canonical PNG bytes: RGB, transparency composited on white, no metadata, fixed settings.

    Equal pixels give equal bytes, whatever the image's source format, mode or metadata, so equal pictures give equal
    dataset digests.
    """
    from PIL import Image

    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        # Dropping the alpha channel would show whatever colour transparent pixels happen to store.
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    rgb = image.convert("RGB")
    # A fresh image carries no info dict, which PNG saving would otherwise copy into the bytes (ICC profile, dpi).
    clean = Image.frombytes("RGB", rgb.size, rgb.tobytes())
    buf = io.BytesIO()
    clean.save(buf, format="PNG", compress_level=6, optimize=False)
    return buf.getvalue()


def blank_png(data: bytes) -> bytes:
    """A white picture of the same size as the PNG `data` (the blank-image ablation)."""
    from PIL import Image

    return encode_png(Image.new("RGB", decode_png(data).size, (255, 255, 255)))


def decode_png(data: bytes) -> Any:
    """PNG (or any image) bytes as an RGB PIL image."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


def _reencode(data: bytes, what: str) -> bytes:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()  # the first frame of an animation
            return encode_png(image)
    except Exception as err:  # noqa: BLE001 (PIL's decoders raise many types on corrupt data: OSError, SyntaxError, ...)
        raise ImageError(f"{what} is not a decodable image ({type(err).__name__}: {err})") from None


def _shown(text: str) -> str:
    return text if len(text) <= 80 else f"{text[:77]}..."


def _b64(text: str) -> bytes | None:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        return None


def _file(text: str, base_dir: str | Path | None) -> Path | None:
    """The file `text` names (relative to `base_dir`), or None when it names none."""
    if len(text) > _MAX_PATH_CHARS or "\0" in text or "\n" in text:
        return None
    path = Path(text).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return path


def _from_text(text: str, base_dir: str | Path | None) -> bytes:
    if text.startswith("data:"):
        header, sep, payload = text.partition(",")
        data = _b64(payload) if sep and header.endswith(";base64") else None
        if data is None:
            raise ImageError(f"{_shown(text)!r} is not a base64 data URL ('data:image/png;base64,...')")
        return _reencode(data, "data URL")
    if text.startswith(("http://", "https://")):
        raise ImageError(f"{_shown(text)}: remote images are not fetched; give a local path, bytes or base64")
    path = _file(text.removeprefix("file://"), base_dir)
    try:
        is_file = path is not None and path.is_file()
    except OSError:  # a name too long for the file system: base64 data
        is_file = False
    if is_file:
        try:
            data = path.read_bytes()
        except OSError as err:
            raise ImageError(f"image file {path} cannot be read ({err.strerror or err})") from None
        return _reencode(data, f"image file {path}")
    data = _b64(text)
    if data is not None and len(data) >= len(PNG_SIGNATURE):
        return _reencode(data, "base64 image data")
    missing = f"no image file {_shown(str(path))}" if path is not None else "too long for a file name"
    raise ImageError(f"{_shown(text)!r} is neither an image file ({missing}) nor base64 image data")


def canonical_png(value: Any, base_dir: str | Path | None = None) -> bytes:
    """Any image input as canonical PNG bytes (`encode_png`), so one picture gives the same bytes in every form.

    Args:
        value: encoded image bytes (any format PIL reads); a Hugging Face `Image` struct {"bytes", "path"}; a path
            (absolute, or relative to `base_dir`; `file://` allowed); base64 text, plain or a `data:image/...;base64,`
            URL. Remote URLs are refused: nothing here goes on the network.
        base_dir: the folder relative paths start from: the data file's folder.

    Raises:
        ImageError naming the problem, and the image file for a path.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _reencode(bytes(value), "image bytes")
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return canonical_png(value["bytes"], base_dir)
        if value.get("path"):
            return canonical_png(str(value["path"]), base_dir)
        raise ImageError("image struct has neither 'bytes' nor 'path'")
    if isinstance(value, str):
        return _from_text(value, base_dir)
    raise ImageError(f"expected a path, bytes, base64 text or a {{bytes, path}} struct, got {type(value).__name__}")


def count_markers(messages: Sequence[dict]) -> int:
    """How many `<image>` markers the messages' contents hold."""
    return sum(str(m.get("content") or "").count(IMAGE_MARKER) for m in messages)


def check_markers(messages: Sequence[dict], images: Sequence[Any] | None, where: str | None = None) -> None:
    """Raise ImageError unless the messages hold one `<image>` marker per image (null images: none).

    Args:
        where: what to start the message with, e.g. "data.jsonl line 3" (callers that add it themselves omit it).
    """
    markers, count = count_markers(messages), len(images or ())
    if markers != count:
        prefix = f"{where}: " if where else ""
        raise ImageError(f"{prefix}{markers} {IMAGE_MARKER} markers in the messages but {count} images")


def _is_parts(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(p, dict) and "type" in p for p in value)


def _part_image(part: dict, label: str) -> Any:
    for key in _PART_IMAGE_KEYS:
        value = part.get(key)
        if key == "image_url" and isinstance(value, dict):  # OpenAI's {"type": "image_url", "image_url": {"url"}}
            value = value.get("url")
        if value is not None:
            return value
    raise ImageError(f"field '{label}' is an image part without an image (keys: {', '.join(_PART_IMAGE_KEYS)})")


def _flatten(parts: list, label: str, found: list[tuple[str, Any]]) -> str:
    """A content given as parts, as text with a marker where each image part was; the images are appended to `found`.

    Parts are joined with nothing in between: the exact inverse of splitting a text on its markers.
    """
    pieces = []
    for k, part in enumerate(parts):
        here = f"{label}[{k}]"
        if not isinstance(part, dict):
            raise ImageError(f"field '{here}' must be a {{type, ...}} object, got {type(part).__name__}")
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ImageError(f"field '{here}' is a text part without a 'text' string")
            pieces.append(part["text"])
        elif kind in ("image", "image_url"):
            found.append((here, _part_image(part, here)))
            pieces.append(IMAGE_MARKER)
        else:
            raise ImageError(f"field '{here}' has part type {kind!r}; expected 'text' or 'image'")
    return "".join(pieces)


def take_images(row: dict, base_dir: str | Path | None) -> bool:
    """Bring a prompts/sft row's images into the dataset form, in place.

    Image parts inside the chat fields (`MESSAGE_FIELDS`: a message's content given as [{"type": "text", "text"},
    {"type": "image", "image" | "path" | "url" | "bytes": ...}, ...], or such a list as the whole field) become
    `<image>` markers in the text, and their images `row["images"]` in order; or `row["images"]` lists the images of
    markers already in the text. Either way the images become canonical PNG bytes, and a row without any gets null.

    Returns:
        Whether the row gives images at all (image parts, or an `images` field, even null): its markers must then
        match its images (`check_markers`, once the row's messages are built). Rows without both are plain text.

    Raises:
        ImageError naming the field ("images[1]", "messages[0].content[2]") and, for a path, the image file.
    """
    found: list[tuple[str, Any]] = []
    for field in MESSAGE_FIELDS:
        value = row.get(field)
        if _is_parts(value) and not any("role" in p for p in value):
            row[field] = _flatten(value, field, found)
        elif isinstance(value, list):
            row[field] = [
                {**m, "content": _flatten(m["content"], f"{field}[{i}].content", found)}
                if isinstance(m, dict) and isinstance(m.get("content"), list)
                else m
                for i, m in enumerate(value)
            ]
    listed = row.get("images")
    if listed is not None and not isinstance(listed, (list, tuple)):
        raise ImageError(f"field 'images' must be a list of images, got {type(listed).__name__}")
    if found and listed:
        raise ImageError("images are given both as message parts and in field 'images'; use one of the two")
    given = "images" in row or bool(found)
    sources = found or [(f"images[{i}]", value) for i, value in enumerate(listed or ())]
    pngs = []
    for label, value in sources:
        try:
            pngs.append(canonical_png(value, base_dir))
        except ImageError as err:
            raise ImageError(f"field '{label}': {err}") from None
    row["images"] = pngs or None
    return given
