"""Encoded RLDS images, decoded as TensorFlow does: simplejpeg when installed, else Pillow."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from grain_replay.errors import MissingDependencyError

__all__ = ["decode_image", "decoder_name", "jpeg_decoder"]

_JPEG_MAGIC = b"\xff\xd8"
_MODES = {1: "L", 3: "RGB", 4: "RGBA"}


def jpeg_decoder() -> Any:
    """``simplejpeg`` if installed (libjpeg-turbo with TF's fast integer IDCT: the frames
    ``tf.io.decode_jpeg`` gives, bit for bit, about 3x faster than Pillow), else None."""
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg


def decoder_name() -> str:
    """Which decoders (and versions) make the frames: a decoded-frame cache is only
    valid for the decoders that filled it (simplejpeg and Pillow differ in the last bit)."""
    from importlib import metadata

    names = []
    for dist in ("simplejpeg", "pillow"):
        try:
            names.append(f"{dist}=={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            names.append(f"{dist}: none")
    return ", ".join(names)


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError as e:
        raise MissingDependencyError(
            "Decoding RLDS images needs Pillow. Fix: pip install 'grain-replay[rl]' (or pip "
            "install pillow; add simplejpeg for TensorFlow's exact JPEG frames)."
        ) from e
    return Image


def decode_image(data: bytes, shape: tuple[int, ...], dtype: np.dtype, fast: Any) -> np.ndarray:
    """One PNG/JPEG image as ``shape`` (H, W, C) of ``dtype``; raises on bytes that do not
    decode to it (the caller names file, episode, step and feature)."""
    channels = shape[2]
    if fast is not None and data[:2] == _JPEG_MAGIC and dtype == np.uint8 and channels in (1, 3):
        colorspace = "GRAY" if channels == 1 else "RGB"
        arr = fast.decode_jpeg(data, colorspace=colorspace, fastdct=True, fastupsample=False)
        return np.asarray(arr).reshape(shape)
    image = _pil()
    with image.open(io.BytesIO(data)) as opened:
        im: Any = opened
        mode = _MODES.get(channels)
        if dtype == np.uint8 and mode is not None and im.mode != mode:
            im = im.convert(mode)
        arr = np.asarray(im)
    return arr.reshape(shape)
