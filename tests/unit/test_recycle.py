"""Large results are recycled only once nobody holds them; small ones are plain allocations."""
from __future__ import annotations

import threading

import torch

from vllmpy.layers import recycle
from vllmpy.layers.recycle import RECYCLE_MIN_BYTES, result_buffer

ROWS, COLS = 64, RECYCLE_MIN_BYTES // 4 // 64  # exactly the threshold in float32


def test_a_dropped_result_is_handed_out_again() -> None:
    first = result_buffer(ROWS, COLS, torch.float32)
    address = first.data_ptr()
    del first
    again = result_buffer(ROWS, COLS, torch.float32)
    assert again.data_ptr() == address and again.shape == (ROWS, COLS) and again.is_contiguous()


def test_a_held_result_or_any_view_of_it_is_never_handed_out() -> None:
    held = result_buffer(ROWS, COLS, torch.float32)
    held.fill_(7.0)
    other = result_buffer(ROWS, COLS, torch.float32)
    assert other.data_ptr() != held.data_ptr()
    other.fill_(1.0)
    assert bool((held == 7.0).all())
    view = held[:3]
    del held, other
    third = result_buffer(ROWS, COLS, torch.float32)
    assert not (third.data_ptr() <= view.data_ptr() < third.data_ptr() + third.nbytes)


def test_fewer_rows_reuse_the_buffer_and_more_grow_it() -> None:
    big = result_buffer(ROWS, COLS, torch.float32)
    address = big.data_ptr()
    del big
    assert result_buffer(ROWS // 2, COLS * 2, torch.float32).data_ptr() == address  # same size, other shape
    grown = result_buffer(ROWS * 2, COLS, torch.float32)
    assert grown.shape == (ROWS * 2, COLS) and grown.numel() == ROWS * 2 * COLS


def test_small_results_and_other_dtypes_and_threads_are_separate() -> None:
    small = result_buffer(4, 8, torch.float32)
    assert small.shape == (4, 8) and small.untyped_storage().nbytes() == 4 * 8 * 4
    f32 = result_buffer(ROWS, COLS, torch.float32)
    bf16 = result_buffer(ROWS, COLS * 2, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and bf16.data_ptr() != f32.data_ptr()
    seen = []
    worker = threading.Thread(target=lambda: seen.append(result_buffer(ROWS, COLS, torch.float32).data_ptr()))
    worker.start()
    worker.join()
    assert seen[0] != f32.data_ptr()
    assert recycle._storage_use_count is not None  # the torch this suite pins exposes the count


def test_a_buffer_made_under_inference_mode_is_not_handed_out_outside_it() -> None:
    """(float64: a dtype no other test here has recycled, so the first buffer is made under inference mode.)"""
    with torch.inference_mode():
        inside = result_buffer(ROWS, COLS, torch.float64)
        del inside
    outside = result_buffer(ROWS, COLS, torch.float64)
    outside.fill_(1.0)  # an inference tensor refuses an in-place write outside inference mode
    assert not outside.is_inference()
