"""Image input: loading (media.py), the checkpoint's preprocessing (image_processor.py), placeholder
expansion per family (placeholders.py), the request-side feature record (inputs.py), the scheduler's
span rules (scheduling.py) and the runner's encoder cache (encoder_cache.py)."""
