"""The runner's per-request state kept across steps: block table rows appended to (deltas), penalty counts
folded in incrementally, a read-only view for logits processors, and grammar failures that fail only
their own request."""
from __future__ import annotations

import pytest
import torch

from vllmpy.runner.block_table import BlockTables
from vllmpy.sampling import RowState, SamplingMetadata
from vllmpy.sampling.penalties import TokenCounts
from vllmpy.sampling_params import SamplingParams

CPU = torch.device("cpu")


def test_block_table_rows_append_deltas_and_are_reused_clean():
    """Each step appends only the chunk's new entries (new_block_ids); a truncation (rejected drafts'
    blocks) lets the next entries overwrite the tail; slots are one gather; a freed row is reused clean."""
    tables = BlockTables(num_groups=2, device=CPU, capacity=1, width=2)
    tables.append("a", ([7, 3], [5]))
    tables.append("b", ([9], [4, 6, 8]))  # grows the rows and the second group's width
    tables.append("a", ([], [2]))
    tables.append("a", ([1, 11], [10]))  # grows the first group's width
    tables.truncate("a", 2)
    tables.append("a", ([12], [13]))
    rows = tables.row_index(["b", "a"])
    assert tables.gather(["b", "a"], rows, 0).tolist() == [[9, 0, 0], [7, 3, 12]]
    assert tables.gather(["b", "a"], rows, 1).tolist() == [[4, 6, 8], [5, 2, 13]]
    positions = torch.tensor([5, 0, 9, 11])  # two tokens of b, two of a; blocks of 4
    slots = tables.slot_mapping(rows.repeat_interleave(torch.tensor([2, 2])), positions, 4, 1)
    assert slots.tolist() == [6 * 4 + 1, 4 * 4, 13 * 4 + 1, 13 * 4 + 3]
    tables.remove("a")
    tables.append("c", ([14], [15]))  # takes a's row: nothing of a's is left in it
    assert tables.gather(["c"], tables.row_index(["c"]), 0).tolist() == [[14]]
    assert tables.tables[0][tables.rows["c"]].tolist()[1:3] == [0, 0]


def test_penalty_counts_fold_in_only_new_tokens_and_match_a_recount():
    counts = TokenCounts([1, 1, 2], vocab_size=6, device=CPU)
    output = [3, 3]
    counts.update(output)
    output += [2, 9, 3]  # 9 is outside the vocabulary: ignored
    counts.update(output)
    assert counts.num_counted == 5
    assert counts.output.tolist() == [0, 0, 1, 3, 0, 0]
    assert counts.seen.tolist() == [False, True, True, True, False, False]


def test_penalties_follow_the_tokens_appended_between_steps():
    row = RowState(SamplingParams(temperature=0.0, frequency_penalty=1.0), [0], [], None, set())
    for token in (1, 1, 2):
        row.output_token_ids.append(token)
        meta = SamplingMetadata.build([row], 4, CPU)
    assert meta.penalties.output_counts.tolist() == [[0, 2, 1, 0]] and row.counts.num_counted == 3


def test_processors_get_a_read_only_live_view():
    row = RowState(SamplingParams(), [5, 6], [1], None, set())
    view = SamplingMetadata.build([row], 8, CPU).rows[0]
    row.output_token_ids.append(2)  # the runner appends: the view sees it without a copy
    assert view.output_token_ids == [1, 2] and list(view.prompt_token_ids) == [5, 6]
    with pytest.raises((AttributeError, TypeError)):
        view.output_token_ids.append(3)
    with pytest.raises(TypeError):
        view.output_token_ids[0] = 3
    with pytest.raises(AttributeError):
        view.output_token_ids = [3]
    assert row.output_token_ids == [1, 2]


@pytest.mark.parametrize("where", ["accept", "new_grammar"])
def test_a_grammar_that_raises_fails_only_its_request(tiny_llama_dir, monkeypatch, where):
    from vllmpy import LLM
    from vllmpy.sampling_params import StructuredOutputsParams
    from vllmpy.structured_output.grammar import Grammar
    from vllmpy.structured_output.manager import StructuredOutputManager

    def broken(*args, **kwargs):
        raise RuntimeError("matcher crashed")
    target = Grammar if where == "accept" else StructuredOutputManager
    monkeypatch.setattr(target, where, broken)
    llm = LLM(model=tiny_llama_dir, num_blocks=64, max_model_len=256)
    constrained = SamplingParams(temperature=0.0, max_tokens=4,
                                 structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    bad, good = llm.generate(["Say yes", "Once upon"], [constrained, free], use_tqdm=False)
    assert bad.outputs[0].finish_reason == "error" and "matcher crashed" in bad.error
    assert good.outputs[0].finish_reason == "length" and len(good.outputs[0].token_ids) == 6
    kv = llm.engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
