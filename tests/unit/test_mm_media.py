"""Image loading (vllmpy/multimodal/media.py) and preprocessing (image_processor.py): every refusal names
its field; pixel values equal transformers' PIL image processors for RGB, RGBA, grayscale and palette
images, Gemma 3's fixed resize and CLIP's shortest-edge resize + center crop."""
from __future__ import annotations

import base64
import io
import os

import numpy as np
import pytest
from PIL import Image

from vllmpy.multimodal.image_processor import ImageProcessor
from vllmpy.multimodal.media import MediaConfig, MediaError, load_image


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _image(mode: str = "RGB", size=(30, 20), seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    rgba = Image.fromarray(rng.integers(0, 256, size=(size[1], size[0], 4), dtype=np.uint8), "RGBA")
    return rgba.convert(mode) if mode != "RGBA" else rgba


def test_data_url_and_bytes_decode_to_the_same_pixels():
    image = _image()
    url = "data:image/png;base64," + base64.b64encode(_png(image)).decode()
    for source in (url, _png(image)):
        loaded = load_image(source, MediaConfig(), "f")
        assert loaded.size == image.size and loaded.tobytes() == image.tobytes()
    assert load_image(image, MediaConfig(), "f") is image


@pytest.mark.parametrize("source,words", [
    ("data:image/png;base64,%%%", "not valid base64"),
    ("data:image/png,abc", "base64-encoded"),
    ("data:application/json;base64,e30=", "not an image type"),
    ("data:image/png;base64," + base64.b64encode(b"GIF89a garbage").decode(), "could not be decoded"),
    ("gopher://x/a.png", "scheme 'gopher'"),
    ("/etc/passwd", r"scheme '\(none\)'"),
    (12, "URL string or a PIL image"),
])
def test_bad_sources_name_their_field(source, words):
    with pytest.raises(MediaError, match=words) as info:
        load_image(source, MediaConfig(), "messages[0].content[1].image_url")
    assert info.value.field == "messages[0].content[1].image_url"


def test_file_urls_only_under_the_allowed_directory(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(_png(_image()))
    (tmp_path / "secret.png").write_bytes(_png(_image()))
    os.symlink(tmp_path / "secret.png", allowed / "link.png")
    config = MediaConfig(allowed_local_media_path=str(allowed))
    assert load_image((allowed / "a.png").as_uri(), config, "f").size == (30, 20)
    with pytest.raises(MediaError, match="was not started with --allowed-local-media-path"):
        load_image((allowed / "a.png").as_uri(), MediaConfig(), "f")
    for url in ((tmp_path / "secret.png").as_uri(), f"file://{allowed}/../secret.png", (allowed / "link.png").as_uri()):
        with pytest.raises(MediaError, match="outside --allowed-local-media-path"):
            load_image(url, config, "f")
    with pytest.raises(MediaError, match="names host"):
        load_image(f"file://example.com{allowed}/a.png", config, "f")
    with pytest.raises(MediaError, match="over the limit of 10"):
        load_image((allowed / "a.png").as_uri(), MediaConfig(str(allowed), max_bytes=10), "f")


def test_decompression_bombs_are_refused(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(MediaError, match="too large to decode"):
        load_image(_png(_image(size=(20, 20))), MediaConfig(), "f")


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P", "LA"])
def test_gemma3_pixels_equal_transformers(mode):
    from transformers import Gemma3ImageProcessorPil

    reference = Gemma3ImageProcessorPil(size={"height": 24, "width": 24})
    ours = ImageProcessor.from_dict(reference.to_dict())
    for size in ((30, 20), (11, 47)):
        image = _image(mode, size)
        expected = reference(images=[image], return_tensors="np")["pixel_values"][0]
        assert np.array_equal(ours(image), expected), (mode, size)


def test_clip_shortest_edge_and_center_crop_equal_transformers():
    from transformers import CLIPImageProcessorPil

    reference = CLIPImageProcessorPil(size={"shortest_edge": 20}, crop_size={"height": 16, "width": 18})
    ours = ImageProcessor.from_dict(reference.to_dict())
    for size in ((30, 20), (21, 53), (20, 20)):
        image = _image("RGB", size)
        expected = reference(images=[image], return_tensors="np")["pixel_values"][0]
        assert np.array_equal(ours(image), expected), size


def test_unsupported_processor_options_are_refused():
    from vllmpy.errors import UnsupportedCheckpointError

    with pytest.raises(UnsupportedCheckpointError, match="do_pan_and_scan"):
        ImageProcessor.from_dict({"image_processor_type": "Gemma3ImageProcessor", "do_pan_and_scan": True})
    with pytest.raises(UnsupportedCheckpointError, match="Idefics3ImageProcessor"):
        ImageProcessor.from_dict({"image_processor_type": "Idefics3ImageProcessor"})
